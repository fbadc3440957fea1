"""A run directory on object storage (run_dir="gs://..."), against a GCS API server on 127.0.0.1."""

import json
import signal
import subprocess
import sys

import pytest

from xlatrain import storage
from xlatrain.storage.emulator import LocalGCS

pytestmark = pytest.mark.object_store

BUCKET = "runs"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with LocalGCS(bucket=BUCKET, data_dir=tmp_path_factory.mktemp("gcs")) as server:
        yield server


def _fit(url, epochs, cache, gcs, *extra, env=None):
    from conftest import SCRIPTS, script_env

    full = script_env({**gcs.env, "XLATRAIN_CACHE_DIR": str(cache), **(env or {})})
    return subprocess.run([sys.executable, str(SCRIPTS / "remote_run_fit.py"), url, str(epochs), *extra],
                          env=full, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def _history(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("HISTORY "))[8:])


def _objects(url):
    fs, path = storage.filesystem(url)
    return sorted(name[len(path) + 1:] for name in fs.find(path))


def test_a_run_on_object_storage_goes_up_and_resumes_on_a_machine_that_has_none_of_it(gcs, tmp_path):
    url = f"gs://{BUCKET}/{tmp_path.name}"
    first = _history(_fit(url, 2, tmp_path / "vm1", gcs))
    names = _objects(url)
    assert "history.json" in names and "best.safetensors" in names and ".xlatrain.lock" not in names
    assert any(n.startswith("checkpoints/step-") and n.endswith("/meta.json") for n in names)
    # Another machine (an empty local cache): the run resumes from the store and trains on.
    more = _fit(url, 3, tmp_path / "vm2", gcs)
    history = _history(more)
    assert [r["epoch"] for r in history] == [1, 2, 3] and history[:2] == first
    assert "brought down" in more.stderr + more.stdout
    assert json.loads(storage.read_bytes(f"{url}/history.json")) == history
    # xlatrain report reads the run from the store and puts its report beside it.
    from conftest import run_command, script_env

    out = run_command([sys.executable, "-m", "xlatrain.cli", "report", url],
                      env={**gcs.env, "XLATRAIN_CACHE_DIR": str(tmp_path / "vm3")}).stdout
    assert f"wrote {url}/report" in out
    assert any(n.startswith("report/") for n in _objects(url))
    # xlatrain export reads its newest checkpoint from the store and puts the weights beside it.
    out = run_command([sys.executable, "-m", "xlatrain.cli", "export", url],
                      env={**gcs.env, "XLATRAIN_CACHE_DIR": str(tmp_path / "vm4")}).stdout
    assert f"wrote {url}/model.safetensors (the model's weights from" in out
    from safetensors.torch import load as load_safetensors

    weights = load_safetensors(storage.read_bytes(f"{url}/model.safetensors"))
    best = load_safetensors(storage.read_bytes(f"{url}/best.safetensors"))
    assert weights.keys() == best.keys() and all(v.shape == best[k].shape for k, v in weights.items())
    empty = subprocess.run([sys.executable, "-m", "xlatrain.cli", "export", f"gs://{BUCKET}/no-run-here"],
                           env=script_env({**gcs.env, "XLATRAIN_CACHE_DIR": str(tmp_path / "vm5")}),
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and f"gs://{BUCKET}/no-run-here holds no complete checkpoint" in empty.stderr


def test_kill_9_while_a_checkpoint_goes_up_resumes_from_the_last_complete_one(gcs, tmp_path):
    url = f"gs://{BUCKET}/{tmp_path.name}"
    whole = _history(_fit(f"gs://{BUCKET}/{tmp_path.name}-whole", 3, tmp_path / "ref", gcs))
    killed = _fit(url, 3, tmp_path / "vm1", gcs, "2")  # dies while epoch 2's checkpoint goes up
    assert killed.returncode == -signal.SIGKILL
    steps = sorted({n.split("/")[1] for n in _objects(url) if n.startswith("checkpoints/")})
    complete = sorted({n.split("/")[1] for n in _objects(url) if n.endswith("/meta.json")})
    assert len(steps) == 2 and complete == steps[:1]  # the second one is part way up, without its meta.json
    # At once, from another machine: the lock of the killed run is fresh, so the run is refused.
    refused = _fit(url, 3, tmp_path / "vm2", gcs)
    assert refused.returncode != 0 and "is in use by another run" in refused.stderr
    # Once it is stale (here: at once), the run takes it over and resumes from epoch 1's checkpoint.
    resumed = _fit(url, 3, tmp_path / "vm2", gcs, env={"XLATRAIN_RUN_LOCK_STALE_S": "0"})
    assert "took over the lock" in resumed.stderr + resumed.stdout
    assert [(r["epoch"], r["train_loss"]) for r in _history(resumed)] == [(r["epoch"], r["train_loss"]) for r in whole]


def test_a_run_whose_lock_another_run_took_over_stops_before_writing_and_leaves_the_lock_alone(gcs, tmp_path, monkeypatch):
    import functools

    import torch
    from torch import nn

    import xlatrain
    from xlatrain.storage.lock import RunDirError

    monkeypatch.setenv("XLATRAIN_CACHE_DIR", str(tmp_path / "vm1"))
    url = f"gs://{BUCKET}/{tmp_path.name}"
    other = json.dumps({"pid": 1, "host": "vm2", "started": 0.0, "renewed": 1e12, "command": "xlatrain fit"}).encode()

    class TakenOver:
        def on_epoch_end(self, trainer, row):  # this run stalls; another takes its stale lock over
            if row["epoch"] == 1:
                storage.write_bytes(f"{url}/.xlatrain.lock", other)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    trainer = xlatrain.Trainer(
        nn.Linear(6, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=3, batch_size=8, run_dir=url, diagnostics=False, tensorboard=False),
        accelerator="cpu", callbacks=[TakenOver()])
    with pytest.raises(RunDirError, match="took this one's lock over .*vm2"):
        trainer.fit(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()))
    assert storage.read_bytes(f"{url}/.xlatrain.lock") == other  # neither renewed over nor removed
    assert [r["epoch"] for r in json.loads(storage.read_bytes(f"{url}/history.json"))] == [1]
    assert sorted({n.split("/")[1] for n in _objects(url) if n.startswith("checkpoints/")}) == ["step-00000004"]


def test_a_run_directory_in_a_missing_bucket_is_input_to_change(gcs, tmp_path, monkeypatch):
    # Refused before anything runs, as a name to change (exit 2 on the command line), not as an
    # outage (exit 1): the kind of storage failure survives the run directory's verdict.
    import functools

    import torch
    from torch import nn

    import xlatrain

    monkeypatch.setenv("XLATRAIN_CACHE_DIR", str(tmp_path / "vm1"))
    trainer = xlatrain.Trainer(
        nn.Linear(6, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=1, batch_size=8, run_dir="gs://no-such-bucket/run"), backend="cpu")
    data = torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randint(0, 2, (16,)))
    with pytest.raises(storage.StorageInputError, match="no-such-bucket"):
        trainer.fit(data)
