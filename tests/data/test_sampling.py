import itertools

import pytest
import torch

from xlatrain.data.sampling import EvalSampler, PaddedDataset, TrainSampler


def _per_process(n, b, num_processes, epoch, seed=0):
    out = []
    for p in range(num_processes):
        s = TrainSampler(n, loader_batch=b, num_processes=num_processes, process_index=p, seed=seed)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n,b,num_processes", [(100, 8, 1), (100, 8, 2), (101, 5, 3), (64, 4, 4)])
def test_train_split_is_disjoint_full_batches_and_reshuffled(n, b, num_processes):
    steps = n // (b * num_processes)
    epochs = [_per_process(n, b, num_processes, e) for e in (1, 2)]
    for parts in epochs:
        flat = list(itertools.chain.from_iterable(parts))
        assert len(flat) == len(set(flat)) == steps * b * num_processes
        assert all(len(p) == steps * b for p in parts)
    assert epochs[0] != epochs[1]  # each epoch reshuffles
    assert _per_process(n, b, num_processes, 1) == epochs[0]  # and is reproducible from the seed


def test_each_global_batch_is_the_same_set_whatever_the_process_count():
    one = _per_process(96, 16, 1, epoch=3)[0]
    two = _per_process(96, 8, 2, epoch=3)
    for step in range(96 // 16):
        joined = two[0][step * 8 : (step + 1) * 8] + two[1][step * 8 : (step + 1) * 8]
        assert sorted(joined) == sorted(one[step * 16 : (step + 1) * 16])


def test_grad_accumulation_keeps_whole_groups():
    s = TrainSampler(100, loader_batch=8, step_multiple=3)
    assert s.steps_per_epoch == 12 and len(list(s)) == 96


def test_training_set_smaller_than_a_global_batch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"10 samples, fewer than one optimizer step needs.*Lower batch_size"):
        TrainSampler(10, loader_batch=8, num_processes=2)


@pytest.mark.parametrize("n", [1, 7, 50, 101])
@pytest.mark.parametrize("b,num_processes", [(1, 1), (4, 1), (8, 2), (3, 3)])
def test_eval_covers_every_sample_exactly_once_in_full_batches(n, b, num_processes):
    dataset = PaddedDataset(list(range(n)), n)
    seen = []
    for p in range(num_processes):
        s = EvalSampler(n, loader_batch=b, num_processes=num_processes, process_index=p)
        idx = list(s)
        assert len(idx) % b == 0 and len(idx) == len(s)
        seen += [dataset[i][0] for i in idx if dataset[i][1]]
        assert torch.equal(s.indices(p), torch.tensor(idx))
    assert sorted(seen) == list(range(n))


def test_empty_eval_set_is_an_error():
    with pytest.raises(ValueError, match="evaluation set is empty"):
        EvalSampler(0, loader_batch=4)
