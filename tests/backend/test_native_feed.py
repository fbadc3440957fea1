"""The device feeds of the native backend: every batch, in order, structure kept, one ahead.

``_AheadCopier`` feeds TorchTPU; here it runs with the CPU device, the same code with another
device name. ``_CudaPrefetcher`` needs a GPU (marked ``gpu``): it copies in stream, or on a side
stream for batches of ``SIDE_STREAM_BYTES`` or more, chosen by the first batch's size."""

import pytest
import torch

from xlatrain.backend.native import SIDE_STREAM_BYTES, _AheadCopier, _CudaPrefetcher, batch_bytes


class _Counting:
    """A loader that records how many batches have been taken from it."""

    def __init__(self, batches):
        self.batches, self.taken = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.taken += 1
            yield batch


def _batches():
    return [{"image": torch.full((2, 3), float(i)), "meta": (torch.tensor([i]), f"name-{i}")} for i in range(4)]


def test_the_ahead_copier_yields_every_batch_in_order_and_starts_the_next_copy_first():
    loader = _Counting(_batches())
    feed = _AheadCopier(loader, torch.device("cpu"))
    assert len(feed) == 4
    seen = []
    for batch in feed:
        # The next batch's copy was started before this one was handed over (except the last).
        assert loader.taken == min(len(seen) + 2, 4)
        seen.append(batch)
    for i, batch in enumerate(seen):
        assert torch.equal(batch["image"], torch.full((2, 3), float(i)))
        assert torch.equal(batch["meta"][0], torch.tensor([i])) and batch["meta"][1] == f"name-{i}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_prefetcher_yields_every_batch_on_the_gpu_in_order():
    seen = list(_CudaPrefetcher(_Counting(_batches()), torch.device("cuda", 0)))
    assert [b["image"].device.type for b in seen] == ["cuda"] * 4
    assert [int(b["meta"][0].item()) for b in seen] == [0, 1, 2, 3]


def test_a_batch_counts_the_bytes_of_every_tensor_it_holds():
    batch = {"image": torch.zeros(2, 3, dtype=torch.uint8), "meta": (torch.zeros(4, dtype=torch.float64), "name"),
             "rows": [torch.zeros(5, dtype=torch.bfloat16)]}
    assert batch_bytes(batch) == 6 + 32 + 10
    assert batch_bytes("no tensor") == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, SIDE_STREAM_BYTES // 64 + 1], ids=["in-stream", "side-stream"])
def test_the_cuda_prefetcher_copies_small_and_large_batches_whole_and_in_order(rows):
    """Page-locked batches under and over the side stream's size: each arrives whole, in order,
    one ahead, and still holds its values after the host's copy is gone and the stream moved on."""
    host = [torch.full((rows, 64), i, dtype=torch.uint8).pin_memory() for i in range(4)]
    loader = _Counting([(t, torch.tensor([i])) for i, t in enumerate(host)])
    seen = []
    for images, index in _CudaPrefetcher(loader, torch.device("cuda", 0)):
        assert loader.taken == min(len(seen) + 2, 4)
        seen.append((images.sum(dtype=torch.int64), images.numel(), index))  # used on the compute stream
    del host, loader
    torch.cuda.synchronize()
    assert [int(total) for total, _, _ in seen] == [i * rows * 64 for i in range(4)]
    assert [int(index) for _, _, index in seen] == [0, 1, 2, 3]
