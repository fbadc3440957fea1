"""One device, one process: the model as it is, on the device."""

from __future__ import annotations

from xlatrain.backend.eager import EagerStrategy


class SingleDevice(EagerStrategy):
    name = "single"
