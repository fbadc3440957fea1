import json
import os
import subprocess
import sys
import textwrap

import pytest

from xlatrain.diagnostics.xla_metrics import diff


def test_diff_subtracts_numbers_and_keeps_only_changed_ops():
    before = {"compile_count": 2, "compile_s": 1.5, "fallback_ops": {"aten::a": 1, "aten::b": 4}}
    after = {"compile_count": 5, "compile_s": 2.0, "fallback_ops": {"aten::a": 1, "aten::b": 6, "aten::c": 2}}
    assert diff(before, after) == {"compile_count": 3, "compile_s": 0.5, "fallback_ops": {"aten::b": 2, "aten::c": 2}}


def test_diff_counts_a_key_missing_before_from_zero():
    assert diff({}, {"scalar_reads": 3, "cpu_fallback_ops": {"aten::x": 1}}) == {
        "scalar_reads": 3,
        "cpu_fallback_ops": {"aten::x": 1},
    }


def test_diff_of_something_that_is_not_a_snapshot_says_what_to_pass():
    with pytest.raises(ValueError, match=r"'device' holds str.*snapshot\(\)"):
        diff({}, {"device": "xla:0"})


# One .item() per step is one device-to-host transfer per step; linalg.eig has no XLA lowering
# and runs on the CPU. Run in a child so the runtime and its metrics start from zero.
_SCRIPT = textwrap.dedent(
    """
    import json
    import torch, torch_xla
    from xlatrain.diagnostics import xla_metrics

    device = torch_xla.device()
    w = torch.randn(8, 8, device=device)
    torch_xla.sync()
    start = xla_metrics.snapshot()
    for step in range(5):
        w = w * 0.5 + 1.0
        torch_xla.sync()
        w.sum().item()
    loop = xla_metrics.snapshot()
    torch.linalg.eig(torch.randn(4, 4, device=device))
    torch_xla.sync()
    end = xla_metrics.snapshot()
    print("RESULT " + json.dumps({"loop": xla_metrics.diff(start, loop), "eig": xla_metrics.diff(loop, end), "end": end}))
    """
)


@pytest.mark.xla
def test_item_per_step_and_cpu_fallback_show_in_the_metrics():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "CPU_NUM_DEVICES"))}
    env["PJRT_DEVICE"] = "CPU"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    loop, eig, end = result["loop"], result["eig"], result["end"]

    assert loop["transfer_from_device_count"] == 5  # one host read per step
    assert loop["scalar_reads"] == 5
    assert loop["cpu_fallback_ops"] == {}  # .item() is a read, not a missing lowering
    assert 1 <= loop["compile_count"] <= 4 and loop["compile_s"] > 0
    assert loop["execute_count"] >= 5

    assert eig["cpu_fallback_ops"].get("aten::linalg_eig", 0) >= 1
    assert "aten::linalg_eig" in end["fallback_ops"]
    for key in ("persistent_cache_hit", "persistent_cache_miss", "persistent_cache_deserialize_failure"):
        assert end[key] == 0  # no persistent cache was initialised in this process
