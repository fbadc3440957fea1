import os

import pytest
import torch
from torch import nn

from xlatrain import load_weights
from xlatrain.checkpoint import atomic_write_bytes, save_weights


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight  # the weight-tying trap of the TPU docs


def test_tied_weights_are_stored_once_and_stay_tied_after_loading(tmp_path):
    from safetensors import safe_open

    torch.manual_seed(0)
    src = Tied()
    path = save_weights(src, tmp_path / "w.safetensors")
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["embed.weight"]  # one tensor for the tied pair
    dst = Tied()  # built tied, as the model's own code ties it
    load_weights(dst, path)
    assert torch.equal(dst.embed.weight, src.embed.weight)
    assert dst.out.weight is dst.embed.weight  # loading kept the tie
    with torch.no_grad():
        dst.embed.weight.add_(1)
    assert torch.equal(dst.out.weight, dst.embed.weight)


def test_tied_weights_load_into_an_untied_module_by_value(tmp_path):
    torch.manual_seed(0)
    src = Tied()
    path = save_weights(src, tmp_path / "w.safetensors")
    dst = Tied()
    dst.out.weight = nn.Parameter(torch.zeros(10, 4))  # a module whose two weights are separate
    load_weights(dst, path)
    # The alias is filled from the one stored tensor: both weights get the saved values.
    assert torch.equal(dst.out.weight, src.embed.weight) and torch.equal(dst.embed.weight, src.embed.weight)
    assert dst.out.weight is not dst.embed.weight


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "best.safetensors"
    atomic_write_bytes(target, b"old")


    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["best.safetensors"]


def test_a_truncated_weights_file_is_a_clear_error(tmp_path):
    path = save_weights(nn.Linear(3, 3), tmp_path / "w.safetensors")
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_weights(nn.Linear(3, 3), path)
