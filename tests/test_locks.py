"""Lock files install from any checkout path: they hold ``name==version`` lines only."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from freeze_lock import PIN, lock_lines  # noqa: E402

LOCKS = sorted(REPO.glob("requirements*.lock"))


def test_both_environments_and_their_installers_have_a_lock():
    assert [p.name for p in LOCKS] == ["requirements-tools.lock", "requirements-xla.lock", "requirements.lock"]


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_line_of_a_lock_is_a_registry_pin(lock):
    lines = [line for line in lock.read_text().splitlines() if line.strip()]
    bad = [line for line in lines if not PIN.match(line)]
    assert not bad, f"{lock.name} holds lines that name a path, URL or editable install: {bad}"
    assert not [line for line in lines if line.lower().startswith("xlatrain==")], "the project itself is not locked"


def _pins(name: str) -> dict[str, str]:
    lines = REPO.joinpath(name).read_text().split()
    return {n.lower().replace("_", "-"): v for n, _, v in (line.partition("==") for line in lines)}


def test_each_lock_pins_its_runtime():
    current, xla = _pins("requirements.lock"), _pins("requirements-xla.lock")
    assert (xla["torch"], xla["torchvision"], xla["torch-xla"]) == ("2.9.0", "0.24.0", "2.9.0")
    assert "torch-tpu" in current and "libtpu" in current and "torch-xla" not in current
    # The newest torch that has a torchvision release made for it (torchvision 0.29 is for 2.14).
    assert current["torch"].startswith("2.14.") and current["torchvision"].startswith("0.29.")


@pytest.mark.parametrize(
    "line",
    ["-e /work/main", "--editable /home/ana/xlatrain", "/tmp/wheels/torch-2.9.0.whl", "./vendor/pkg",
     "foo @ file:///tmp/foo", "bar @ https://example.org/bar.whl", "git+https://example.org/x.git", "numpy>=2"],
)
def test_make_lock_refuses_what_is_not_a_registry_release(line):
    with pytest.raises(SystemExit, match="cannot lock"):
        lock_lines(f"numpy==2.4.6\n{line}\n")


def test_make_lock_leaves_the_project_out_and_keeps_pins():
    frozen = "numpy==2.4.6\nxlatrain==0.1.0\ntorch==2.14.1\n"
    assert lock_lines(frozen) == ["numpy==2.4.6", "torch==2.14.1"]
