"""Which submodules are a model's repeated blocks, and what activation checkpointing does to them."""

import functools

import pytest
import torch
import torchvision
from torch import nn

import xlatrain
from xlatrain.backend.units import apply_activation_checkpointing, find_units


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v))


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Tiny(nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        self.embed = nn.Embedding(10, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).mean(dim=1)


def test_the_default_units_are_the_outermost_repeated_blocks():
    model = Tiny()
    units = find_units(model)
    # Each Layer holds an Attention (also repeated): only the layers are units.
    assert [name for name, _ in units] == ["layers.0", "layers.1", "layers.2"]
    resnet = torchvision.models.resnet18(num_classes=3)
    blocks = find_units(resnet)
    assert len(blocks) == 8 and {type(m).__name__ for _, m in blocks} == {"BasicBlock"}
    # Nothing repeats: no unit (FSDP then shards the model as one).
    assert find_units(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))) == []


def test_units_can_be_named_by_class_by_class_name_or_by_a_function():
    model = Tiny()
    assert [n for n, _ in find_units(model, [Attention])] == [f"layers.{i}.attn" for i in range(3)]
    assert [n for n, _ in find_units(model, ("Attention",))] == [f"layers.{i}.attn" for i in range(3)]
    assert [n for n, _ in find_units(model, lambda m: isinstance(m, nn.LayerNorm))] == [
        f"layers.{i}.norm{j}" for i in range(3) for j in (1, 2)]
    with pytest.raises(ValueError, match=r"units names 'Block', which the model does not contain; .*Layer"):
        find_units(model, ["Block"])


def _saved_bytes(model, x):
    """Bytes autograd keeps for backward during one forward pass."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x).sum()
    return total, out


def test_activation_checkpointing_keeps_less_for_backward_and_the_same_gradients():
    torch.manual_seed(0)
    plain = Tiny(d=32, n=4)
    checkpointed = Tiny(d=32, n=4)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing([m for _, m in find_units(checkpointed)])
    x = torch.randint(0, 10, (8, 64))
    kept_plain, out_plain = _saved_bytes(plain, x)
    kept_ckpt, out_ckpt = _saved_bytes(checkpointed, x)
    # Only each layer's input is kept; what it computes inside is recomputed in backward.
    assert kept_ckpt < 0.3 * kept_plain, (kept_ckpt, kept_plain)
    out_plain.backward()
    out_ckpt.backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_activation_checkpointing_and_units_reach_the_model_through_the_config(tmp_path):
    trainer = xlatrain.Trainer(
        Tiny(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(run_dir=str(tmp_path)),
        backend=xlatrain.BackendConfig(accelerator="cpu", activation_checkpointing=True, units=["Attention"]),
    )
    assert trainer.strategy.units == ["Attention"] * 3
    kept, _ = _saved_bytes(trainer.model, torch.randint(0, 10, (4, 32)))
    reference, _ = _saved_bytes(Tiny(), torch.randint(0, 10, (4, 32)))
    assert kept < reference
    assert "activation checkpointing of 3 unit(s) (Attention)" in trainer.backend.describe()


def test_units_without_fsdp_or_checkpointing_are_refused():
    with pytest.raises(ValueError, match=r"units=\['Layer'\] takes effect only with strategy='fsdp' or activation_checkpointing=True"):
        xlatrain.BackendConfig(units=["Layer"])
