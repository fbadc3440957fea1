"""A byte-level decoder-only transformer on the Python standard library's source (``configs/lm.yaml``)."""

from xlatrain.recipes.lm.data import ByteWindows, split_bytes, stdlib_files
from xlatrain.recipes.lm.model import ByteGPT
from xlatrain.recipes.lm.recipe import DataConfig, build, byte_loss

__all__ = ["ByteGPT", "ByteWindows", "DataConfig", "build", "byte_loss", "split_bytes", "stdlib_files"]
