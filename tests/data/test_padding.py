"""PadCollate: which fields are sequences, what each is padded with, and to what length."""

import torch

from xlatrain import PadCollate


def test_tuple_items_pad_their_targets_as_labels_and_their_inputs_with_zero():
    """(ids, labels) tuples padded their labels with 0, a real class that the loss then counted."""
    ids, labels = PadCollate(pad_to_multiple_of=8)([([5, 6, 7], [6, 7, 8]), ([9], [10])])
    assert ids.shape == labels.shape == (2, 8)
    assert ids[1].tolist() == [9] + [0] * 7 and labels[1].tolist() == [10] + [-100] * 7
    ids, labels = PadCollate(pad_to_multiple_of=4, pad_values={0: 1, 1: -1})([([5, 6], [6, 7]), ([9], [10])])
    assert ids[1].tolist() == [9, 1, 1, 1] and labels[1].tolist() == [10, -1, -1, -1]


def test_a_field_of_one_size_beside_the_sequence_is_stacked_not_padded():
    """A 10-wide multi-hot target was taken for a sequence: padded to 16, and input_ids with it."""
    collate = PadCollate(pad_to_multiple_of=8, attention_mask="attention_mask")
    hot = [torch.zeros(10), torch.ones(10)]
    batch = collate([{"input_ids": [1, 2, 3], "target": hot[0]}, {"input_ids": [4], "target": hot[1]}])
    assert batch["input_ids"].shape == (2, 8) and torch.equal(batch["target"], torch.stack(hot))
    assert batch["attention_mask"].tolist() == [[1, 1, 1] + [0] * 5, [1] + [0] * 7]
    # Token labels have each item's length of input_ids: padded with them, even where every
    # item has the same length.
    same = collate([{"input_ids": [1, 2], "labels": [3, 4]}, {"input_ids": [5, 6], "labels": [7, 8]}])
    assert same["input_ids"].shape == same["labels"].shape == (2, 8) and same["labels"][0, 2] == -100
    ids, features = PadCollate(pad_to_multiple_of=8)([([1, 2, 3], torch.tensor([0.5, 0.5])), ([4], torch.tensor([0.1, 0.9]))])
    assert ids.shape == (2, 8) and features.shape == (2, 2)


def test_a_field_named_with_none_is_stacked_where_its_size_matches_the_sequence_by_chance():
    """One item of 10 tokens beside a 10-wide target: nothing tells the target from a sequence
    but the user's word."""
    item = {"input_ids": list(range(1, 11)), "target": torch.zeros(10)}
    assert PadCollate(pad_to_multiple_of=8)([item])["target"].shape == (1, 16)  # taken for a sequence
    batch = PadCollate(pad_to_multiple_of=8, pad_values={"target": None})([item])
    assert batch["input_ids"].shape == (1, 16) and batch["target"].shape == (1, 10)
