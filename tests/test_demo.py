"""`make demo` end to end: the digits CNN reaches the promised accuracy and leaves its files."""

import json

from xlatrain.cli import main


def test_demo_reaches_095_and_writes_history_weights_and_plot(tmp_path, capsys):
    run_dir = tmp_path / "demo"
    assert main(["demo", "--run-dir", str(run_dir), "--accelerator", "cpu"]) == 0
    history = json.loads((run_dir / "history.json").read_text())
    assert len(history) == 12 and history[-1]["val_accuracy"] >= 0.95
    assert (run_dir / "history.csv").read_text().count("\n") == 13
    assert (run_dir / "best.safetensors").stat().st_size > 0
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "final validation accuracy" in capsys.readouterr().out


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert main(["demo", "--epochs", "0"]) == 2
    assert "epochs=0 is not valid" in capsys.readouterr().err
