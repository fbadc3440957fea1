"""A pack that data.shards names is read as it is: the keys that generate a synthetic set
(data.num_studies, slices_per_study, stored_size, seed) must agree with it, or are refused."""

import pytest

from xlatrain.recipes.pe_detection.recipe import GENERATED_FROM, DataConfig, prepare_data

MADE = {"num_studies": 6, "slices_per_study": [4, 5], "stored_size": 48, "image_size": 32, "num_folds": 3,
        "pack_workers": 1}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A folder generated and packed by the recipe (into ROOT/shards)."""
    root = tmp_path_factory.mktemp("made")
    prepare_data(DataConfig(root=str(root), **MADE))
    return root


def test_a_pack_the_recipe_made_records_what_it_was_generated_from(made):
    assert (made / "shards" / GENERATED_FROM).read_text() == (made / GENERATED_FROM).read_text()


def test_a_named_pack_made_from_other_generation_keys_is_refused(made, tmp_path):
    named = dict(MADE, root=str(tmp_path / "unused"), shards=str(made / "shards"))
    prepare_data(DataConfig(**named))  # the same values: read as it is, nothing generated
    assert not (tmp_path / "unused").exists()
    for key, value in (("num_studies", 40), ("stored_size", 64), ("slices_per_study", [4, 6]), ("seed", 1)):
        with pytest.raises(ValueError, match=rf"the pack data.shards names \({made}/shards\) was generated with "
                                             rf"data.{key}=.*; this config asks for data.{key}="):
            prepare_data(DataConfig(**dict(named, **{key: value})))


def test_a_named_pack_that_records_nothing_says_the_generation_keys_it_cannot_check(made, tmp_path, caplog):
    import logging
    import shutil

    caplog.set_level(logging.INFO, logger="xlatrain")
    pack = tmp_path / "pack"  # as `xlatrain pack` or an older xlatrain left it: no record
    shutil.copytree(made / "shards", pack)
    (pack / GENERATED_FROM).unlink()
    # Whether they agree cannot be told: said, not refused (a refusal made an older run unresumable:
    # removing the keys as told then changed its recorded config).
    prepare_data(DataConfig(root=str(tmp_path / "unused"), shards=str(pack), num_studies=40, stored_size=64))
    assert "note: data.num_studies=40, data.stored_size=64 are not checked against the pack data.shards names" in caplog.text
    # Left at their defaults they ask for nothing; data.seed draws the folds, so it is used.
    prepare_data(DataConfig(root=str(tmp_path / "unused"), shards=str(pack), seed=3))
    # An older xlatrain's pack in data.root/shards: the record beside train.csv speaks for it.
    (made / "shards" / GENERATED_FROM).rename(tmp_path / "kept.json")
    try:
        with pytest.raises(ValueError, match=r"was generated with data.num_studies=6; this config asks for data.num_studies=7"):
            prepare_data(DataConfig(**dict(MADE, root=str(made), shards=str(made / "shards"), num_studies=7)))
    finally:
        (tmp_path / "kept.json").rename(made / "shards" / GENERATED_FROM)


def test_real_data_has_no_generation_keys_to_check(made, tmp_path):
    prepare_data(DataConfig(root=str(tmp_path / "unused"), shards=str(made / "shards"), synthetic=False, num_studies=40))


def test_a_pack_on_object_storage_records_it_and_is_checked_there(tmp_path):
    url = f"memory://xlatrain-test-{tmp_path.name}/pe"  # fsspec's in-process store
    small = dict(MADE, num_studies=4, slices_per_study=[3, 4], stored_size=32, num_folds=2)
    prepare_data(DataConfig(root=str(tmp_path / "made"), shards=url, **small))
    with pytest.raises(ValueError, match=rf"the pack data.shards names \({url}\) was generated with data.num_studies=4"):
        prepare_data(DataConfig(root=str(tmp_path / "unused"), shards=url, **dict(small, num_studies=5)))
