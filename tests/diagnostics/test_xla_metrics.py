import json
import os
import subprocess
import sys
import textwrap

import pytest

from xlatrain.diagnostics.xla_metrics import compilation_analyses, debug_file, diff


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


# Two compilations as torch_xla 2.9 writes them with PT_XLA_DEBUG_LEVEL=1 (paths shortened), with
# the post-compilation lines that follow each.
_ANALYSES = """
Compilation Analysis: ================================================================================
Compilation Analysis: Compilation Cause
Compilation Analysis:   user torch_xla.sync
Compilation Analysis: Graph Info: 
Compilation Analysis:   Graph Hash: 788ff11b4f6e3037acc1458b62edd227
Compilation Analysis:   Number of Graph Inputs: 17
Compilation Analysis:   Number of Graph Outputs: 13
Compilation Analysis: Python Frame Triggered Execution: 
Compilation Analysis:   sync (/site-packages/torch_xla/torch_xla.py:87)
Compilation Analysis:   step_end (/src/xlatrain/backend/xla.py:210)
Compilation Analysis:   ..........
Compilation Analysis: --------------------------------------------------------------------------------
Compilation Analysis: ================================================================================

Computation hash: eec98bd8105b673fff33df51bfe55926

Post Compilation Analysis: ================================================================================
Post Compilation Analysis: Graph input size: 0.000000 GB
Post Compilation Analysis: --------------------------------------------------------------------------------
Compilation Analysis: ================================================================================
Compilation Analysis: Compilation Cause
Compilation Analysis:   most likely user code trying to access tensor value before torch_xla.sync
Compilation Analysis: Graph Info: 
Compilation Analysis:   Graph Hash: 66e131cc8feed9deb3cfd13b3b00e372
Compilation Analysis:   Number of Graph Inputs: 6
Compilation Analysis:   Number of Graph Outputs: 1
Compilation Analysis: Python Frame Triggered Execution: 
Compilation Analysis:   item_loss (/home/me/train.py:57)
Compilation Analysis:   _train_epoch (/src/xlatrain/train/trainer.py:356)
Compilation Analysis: --------------------------------------------------------------------------------
"""


def test_compilation_analyses_are_read_in_order_with_cause_inputs_and_frames():
    first, second = compilation_analyses(_ANALYSES)
    assert first == {
        "cause": "user torch_xla.sync", "graph_hash": "788ff11b4f6e3037acc1458b62edd227", "graph_inputs": 17,
        "graph_outputs": 13, "frames": ["sync (/site-packages/torch_xla/torch_xla.py:87)",
                                        "step_end (/src/xlatrain/backend/xla.py:210)"],
    }
    assert second["cause"].startswith("most likely user code trying to access tensor value")
    assert (second["graph_inputs"], second["frames"][0]) == (6, "item_loss (/home/me/train.py:57)")
    assert compilation_analyses("Post Compilation Analysis: Graph input size: 0 GB\nunrelated\n") == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PT_XLA_DEBUG_LEVEL": "1", "PT_XLA_DEBUG_FILE": "/tmp/x.txt"}, "/tmp/x.txt"),
        ({"PT_XLA_DEBUG_LEVEL": "2", "PT_XLA_DEBUG_FILE": "/tmp/x.txt"}, "/tmp/x.txt"),
        ({"PT_XLA_DEBUG_LEVEL": "0", "PT_XLA_DEBUG_FILE": "/tmp/x.txt"}, None),  # no analysis written
        ({"PT_XLA_DEBUG_LEVEL": "1"}, None),  # written to stderr
        ({"PT_XLA_DEBUG_FILE": "/tmp/x.txt"}, None),
    ],
)
def test_debug_file_is_known_only_when_torch_xla_writes_its_analysis_there(monkeypatch, env, expected):
    for name in ("PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert debug_file() == expected


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
    counters = [xla_metrics.step_counters()]
    for step in range(5):
        w = w * 0.5 + 1.0
        torch_xla.sync()
        w.sum().item()
        counters.append(xla_metrics.step_counters())
    loop = xla_metrics.snapshot()
    torch.linalg.eig(torch.randn(4, 4, device=device))
    torch_xla.sync()
    end = xla_metrics.snapshot()
    print("RESULT " + json.dumps({"loop": xla_metrics.diff(start, loop), "eig": xla_metrics.diff(loop, end), "end": end,
                                  "counters": counters}))
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
    # Per step, without a metric read: which steps compiled (the first two: the update graph, then
    # the .item() sum) and one scalar read each.
    compiled, reads, copies = zip(*result["counters"])
    assert [copies[i + 1] - copies[i] for i in range(5)] == [1] * 5  # .item() copies its scalar to the CPU
    steps = [(compiled[i + 1] - compiled[i], reads[i + 1] - reads[i]) for i in range(5)]
    assert [r for _, r in steps] == [1] * 5
    assert sum(c for c, _ in steps) == loop["compile_count"] and all(c == 0 for c, _ in steps[2:])

    assert eig["cpu_fallback_ops"].get("aten::linalg_eig", 0) >= 1
    assert "aten::linalg_eig" in end["fallback_ops"]
    for key in ("persistent_cache_hit", "persistent_cache_miss", "persistent_cache_deserialize_failure"):
        assert end[key] == 0  # no persistent cache was initialised in this process
