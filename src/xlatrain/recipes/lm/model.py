"""A decoder-only transformer over bytes: pre-norm blocks, causal ``scaled_dot_product_attention``,
rotary or learned positions, the output layer tied to the token embedding.

Shapes: ``B`` batch, ``T`` positions, ``D`` width, ``H`` heads, ``K`` width per head, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes: no tokenizer to download
POSITIONS = ("rotary", "learned")


def rotary_tables(T: int, K: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation, ``[T, K/2]`` each (RoFormer's rotary embedding)."""
    inv_freq = 1.0 / base ** (torch.arange(0, K, 2, dtype=torch.float32) / K)
    angles_TK2 = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    return angles_TK2.cos(), angles_TK2.sin()


def apply_rotary(x_BHTK: torch.Tensor, cos_TK2: torch.Tensor, sin_TK2: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHTK[..., 0::2], x_BHTK[..., 1::2]
    cos, sin = cos_TK2.to(x_BHTK.dtype), sin_TK2.to(x_BHTK.dtype)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x_BTD: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q_BHTK, k_BHTK, v_BHTK = (
            t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in self.qkv(x_BTD).split(D, dim=2)
        )
        if rotary is not None:
            q_BHTK, k_BHTK = apply_rotary(q_BHTK, *rotary), apply_rotary(k_BHTK, *rotary)
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        return self.proj(y_BHTK.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x_BTD)))


class Block(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = MLP(width)

    def forward(self, x_BTD: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.norm1(x_BTD), rotary)
        return x_BTD + self.mlp(self.norm2(x_BTD))


class ByteGPT(nn.Module):
    """``tokens [B, T] -> logits [B, T, V]``.

    Args:
        context: longest sequence (positions) the model takes.
        width, layers, heads: ``D``, the number of blocks, attention heads (``D`` divisible by it).
        positions: ``rotary`` (no parameters) or ``learned`` (an embedding per position).
    """

    def __init__(self, *, context: int, width: int = 128, layers: int = 4, heads: int = 4,
                 positions: str = "rotary") -> None:
        super().__init__()
        if width % heads or (width // heads) % 2:
            raise ValueError(f"model.width={width} must split into model.heads={heads} heads of an even width each")
        if positions not in POSITIONS:
            raise ValueError(f"model.positions={positions!r} is not valid: choose one of {', '.join(POSITIONS)}")
        self.context, self.width, self.layers, self.heads, self.positions = context, width, layers, heads, positions
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(context, width) if positions == "learned" else None
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # weight tying
        cos, sin = rotary_tables(context, width // heads)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        cos, sin = rotary_tables(self.context, self.width // self.heads)
        with torch.no_grad():  # buffers of a model built on the meta device get their values here
            self.rotary_cos.copy_(cos.to(self.rotary_cos.device))
            self.rotary_sin.copy_(sin.to(self.rotary_sin.device))

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        T = tokens_BT.shape[1]
        x_BTD = self.embed(tokens_BT)
        rotary = None
        if self.position is not None:
            x_BTD = x_BTD + self.position(torch.arange(T, device=tokens_BT.device))
        else:
            rotary = (self.rotary_cos[:T], self.rotary_sin[:T])
        for block in self.blocks:
            x_BTD = block(x_BTD, rotary)
        return self.head(self.norm(x_BTD))

    def num_parameters(self) -> int:
        """Distinct parameters (the tied output layer counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def train_flops_per_sample(self) -> int:
        """Model FLOPs of one training sample (forward and backward) of ``context`` tokens: 6 per
        matmul weight per token (2 forward, 4 backward; the output layer's, tied to the token
        embedding, included; norms and the learned position table, which multiply nothing, left
        out) plus attention's 12 x layers x width x T per token, every query against every key
        (PaLM, appendix B)."""
        position = self.position.weight if self.position is not None else None
        matmul = sum(p.numel() for p in self.parameters() if p.dim() == 2 and p is not position)
        T = self.context
        return 6 * matmul * T + 12 * self.layers * self.width * T * T

    @property
    def tokens_per_sample(self) -> int:
        return self.context
