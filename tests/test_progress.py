"""Progress: a bar drawn in a real pseudo-terminal, plain lines through a pipe, and the numbers
each log interval reports."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest
from conftest import SCRIPTS, script_env

from xlatrain.progress import EpochProgress, IntervalMeter, interactive_terminal

LINE = re.compile(r"  epoch (\d+) step (\d+)/(\d+)  loss (\d+\.\d{4})  ([\d,]+) samples/s")


def _env_without_launchers() -> dict[str, str]:
    env = script_env({"TERM": "xterm"})
    for name in ("CI", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    return env


def _run_in_pty(args: list[str], columns: int | None) -> str:
    """Run the progress script with one pseudo-terminal as stdout and stderr; return all it drew."""
    main_fd, child_fd = pty.openpty()
    if columns is not None:
        fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "progress_bar.py"), *args],
        stdin=subprocess.DEVNULL, stdout=child_fd, stderr=child_fd, env=_env_without_launchers(),
    )
    os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main_fd)
    assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode()


@pytest.mark.parametrize("columns", [100, None], ids=["sized", "unsized-terminal"])
def test_bar_in_a_terminal(columns: int | None) -> None:
    out = _run_in_pty(["20", "5", "0"], columns)
    assert out.startswith("mode bar\r\n")
    frames = re.split(r"\r\n|\r|\n", out)
    bars = [f for f in frames if f.startswith("epoch 3 step ")]
    # Redrawn in place with carriage returns, step by step to the end of the epoch.
    assert len(bars) >= 5 and "\r" in out
    assert any(f.startswith("epoch 3 step 20/20") for f in bars)
    # Loss and samples/s of the last read, the bar's own rate and the ETA.
    full = re.compile(r"epoch 3 step 15/20, loss 0\.5000, [\d,]+ samples/s "
                      r"\|.*\| \[\d\d:\d\d<\d\d:\d\d, [\d.]+step/s\]")
    assert any(full.match(f) for f in bars), bars
    # Before the first read there is no loss yet: rate and ETA are unknown at step 0.
    assert re.fullmatch(r"epoch 3 step 0/20 \| +\| \[00:00<\?, \?step/s\]", bars[0]), bars[0]
    # A message logged under the bar clears it and gets a line of its own; the bar comes back.
    at = out.index("checkpoint written mid-epoch")
    assert re.search(r"\r +\r$", out[:at]) and out[at:].startswith("checkpoint written mid-epoch\r\n\repoch 3 step")
    # No plain interval lines in a terminal, and the closed bar is wiped before the epoch line.
    assert not LINE.search(out)
    assert re.search(r"\r +\repoch 3/3  train_loss 0\.5000\r\n$", out)


def test_bar_resumed_inside_the_epoch_starts_at_its_step() -> None:
    out = _run_in_pty(["20", "5", "12"], 100)
    bars = [f for f in re.split(r"\r\n|\r|\n", out) if f.startswith("epoch 3 step ")]
    assert bars[0].startswith("epoch 3 step 12/20 ")
    assert any(f.startswith("epoch 3 step 15/20, loss 0.5000,") for f in bars)


def test_piped_output_is_plain_lines() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "progress_bar.py"), "20", "5", "0"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_env_without_launchers(), timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and "\r" not in proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0] == "mode lines"
    assert lines[-1] == "epoch 3/3  train_loss 0.5000"
    intervals = [LINE.fullmatch(line) for line in lines[1:-1] if line != "checkpoint written mid-epoch"]
    assert all(intervals) and [int(m.group(2)) for m in intervals] == [5, 10, 15]
    assert lines.index("checkpoint written mid-epoch") == 3  # logged after step 10's line


def test_interactive_only_on_the_main_process_in_a_terminal() -> None:
    main_fd, child_fd = pty.openpty()
    read_fd, write_fd = os.pipe()
    with os.fdopen(child_fd, "w") as tty, os.fdopen(write_fd, "w") as pipe:
        assert interactive_terminal(True, streams=[tty, tty], environ={})
        assert not interactive_terminal(False, streams=[tty, tty], environ={})
        assert not interactive_terminal(True, streams=[tty, pipe], environ={})
        assert not interactive_terminal(True, streams=[tty, tty], environ={"CI": "true"})
        assert interactive_terminal(True, streams=[tty, tty], environ={"CI": "false"})
        assert not interactive_terminal(True, streams=[tty, tty], environ={"TORCHELASTIC_RUN_ID": "x"})
        assert not interactive_terminal(True, streams=[tty, tty], environ={"TERM": "dumb"})
    assert not interactive_terminal(True, streams=[tty, tty], environ={})  # closed streams
    os.close(main_fd)
    os.close(read_fd)


def _shown(progress: EpochProgress, meter: IntervalMeter, step: int, loss_sum: float, nonfinite: float = 0):
    """One log interval as the Trainer's progress observer shows it: measured, then shown."""
    stats = meter.measure(step, loss_sum=loss_sum, nonfinite=nonfinite)
    progress.show(step, epoch_loss=stats.epoch_loss, samples_per_s=stats.samples_per_s, nonfinite=stats.nonfinite,
                  nonfinite_over=stats.nonfinite_over)
    return stats


def test_lines_carry_the_epoch_mean_and_a_rate_no_faster_than_the_steps() -> None:
    lines: list[str] = []
    progress = EpochProgress(2, 30, 0, interactive=False, log=lines.append)
    meter = IntervalMeter(0, samples_per_step=64)
    started = time.perf_counter()
    losses = [1.0] * 10 + [0.5] * 10
    stats = []
    for step in range(1, 21):
        time.sleep(0.01)
        progress.advance(step)
        if step % 10 == 0:
            stats.append(_shown(progress, meter, step, sum(losses[:step])))
    elapsed = time.perf_counter() - started
    progress.close()
    assert [LINE.fullmatch(line).group(1, 2, 3, 4) for line in lines] == [  # type: ignore[union-attr]
        ("2", "10", "30", "1.0000"), ("2", "20", "30", "0.7500"),
    ]
    assert [s.epoch_loss for s in stats] == [1.0, 0.75]
    assert [s.interval_loss for s in stats] == [1.0, 0.5]
    # The rate counts the samples since the last read over the time since then: both reads
    # cover 10 steps of at least 10 ms, so neither can exceed 64 samples per 10 ms.
    assert all(0 < s.samples_per_s <= 6400 for s in stats)
    assert sum(10 * 64 / s.samples_per_s for s in stats) <= elapsed


def test_first_interval_after_a_resume_uses_the_checkpointed_sum() -> None:
    stats = IntervalMeter(10, samples_per_step=8, start_sums=(10.0, 0.0)).measure(20, loss_sum=15.0, nonfinite=0)
    assert (stats.epoch_loss, stats.interval_loss) == (0.75, 0.5)
    unknown = IntervalMeter(10, samples_per_step=8)
    assert unknown.measure(20, loss_sum=15.0, nonfinite=0).interval_loss == 0.75
    # Under skip_step the checkpoint's count of skipped steps is the interval's start too: 3 skipped
    # before step 100 (sum 97 over 97 that counted), steps 101-110 each 1.0, none skipped.
    resumed = IntervalMeter(100, samples_per_step=8, start_sums=(97.0, 3.0), skipped_out=True)
    stats = resumed.measure(110, loss_sum=107.0, nonfinite=3.0)
    assert (stats.epoch_loss, stats.interval_loss, stats.nonfinite) == (1.0, 1.0, 3)
    # Counts are means over processes: 0.5 of 2 processes is one step, said as one.
    assert IntervalMeter(0, samples_per_step=8, processes=2).measure(4, loss_sum=2.0, nonfinite=0.5).nonfinite == 1


def test_non_finite_steps_are_named_in_the_line() -> None:
    lines: list[str] = []
    progress = EpochProgress(1, 40, 0, interactive=False, log=lines.append)
    assert _shown(progress, IntervalMeter(0, samples_per_step=8), 10, 5.0, nonfinite=3.0).nonfinite == 3
    assert lines[0].endswith("samples/s  (3 non-finite steps)")
    # Two processes whose losses were both NaN at the same 2 steps: 4 losses, not 4 steps of 10.
    assert _shown(progress, IntervalMeter(0, samples_per_step=8, processes=2), 20, 5.0, nonfinite=2.0).nonfinite == 4
    assert lines[1].endswith("samples/s  (4 non-finite losses over 2 processes)")


def _read_until(fd: int, marker: bytes) -> bytes:
    out = b""
    while not out.endswith(marker):
        out += os.read(fd, 65536)
    return out


def test_a_read_landing_after_the_bar_closed_is_measured_but_not_drawn() -> None:
    """On CUDA a deferred read can run at the epoch-end read, after the epoch's bar is gone."""
    main_fd, child_fd = pty.openpty()
    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    lines: list[str] = []
    with os.fdopen(child_fd, "w") as tty:
        progress = EpochProgress(1, 20, 0, interactive=True, log=lines.append, stream=tty)
        progress.advance(10)
        progress.close()
        tty.write("|closed|")
        tty.flush()
        drawn = _read_until(main_fd, b"|closed|")
        stats = _shown(progress, IntervalMeter(0, samples_per_step=8), 10, 5.0)
        tty.write("|end|")
        tty.flush()
        after = _read_until(main_fd, b"|end|")
    os.close(main_fd)
    assert drawn.startswith(b"\repoch 1 step 0/20 ") and drawn.endswith(b"\r|closed|")  # drawn, then wiped
    assert after == b"|end|"
    assert stats.epoch_loss == 0.5 and lines == []


def test_the_last_step_is_drawn_however_soon_it_follows_the_last_redraw() -> None:
    """The bar stays up through the epoch's end (evaluation, a checkpoint): it must show the last
    step there, though steps that come faster than the bar redraws are otherwise skipped."""
    main_fd, child_fd = pty.openpty()
    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with os.fdopen(child_fd, "w") as tty:
        progress = EpochProgress(1, 3, 0, interactive=True, log=print, stream=tty)
        for step in (1, 2, 3):
            progress.advance(step)
        tty.write("|drawn|")
        tty.flush()
        drawn = _read_until(main_fd, b"|drawn|")
        progress.close()
    os.close(main_fd)
    frames = [f for f in re.split(rb"\r", drawn) if f.startswith(b"epoch 1 step ")]
    assert frames[0].startswith(b"epoch 1 step 0/3 ") and frames[-1].startswith(b"epoch 1 step 3/3 "), frames


def test_the_epoch_line_says_its_rates_are_the_training_steps_and_its_time_the_whole_epochs():
    from xlatrain.progress import epoch_line

    row = {"epoch": 2, "train_loss": 0.5, "val_loss": 0.6, "epoch_time_s": 3.6, "samples_per_s": 556.0,
           "tokens_per_s": 71168.0, "mfu": 0.1, "warmup_s": 0.4}
    assert epoch_line(row, 12, "val_loss", True) == (
        "epoch 2/12  train_loss 0.5000  val_loss 0.6000  3.6s with validation (first steps 0.4s, left out of the "
        "rates)  training 556 samples/s  71,168 tokens/s  MFU 10.0%  (best val_loss)")
    without = {k: v for k, v in row.items() if k not in ("val_loss", "warmup_s", "tokens_per_s", "mfu")}
    assert epoch_line(without, 12, "train_loss", False) == "epoch 2/12  train_loss 0.5000  3.6s  training 556 samples/s"
    # A small model's first steps take hundredths of a second: said as such, not as "0.0s".
    assert "(first steps 0.043s, left out" in epoch_line({**row, "warmup_s": 0.0432}, 12, "val_loss", True)


def test_an_epoch_whose_monitored_value_is_nan_says_it_was_not_judged():
    from xlatrain.progress import epoch_line

    row = {"epoch": 1, "train_loss": 0.5, "val_mean_auc": float("nan"), "epoch_time_s": 1.0}
    assert epoch_line(row, 3, "val_mean_auc", False).endswith(
        "(val_mean_auc is NaN: not judged, so no best weights from this epoch)")
    assert "NaN" not in epoch_line({**row, "val_mean_auc": 0.7}, 3, "val_mean_auc", False)


def test_an_epoch_that_skipped_non_finite_steps_says_how_many():
    """With log_every past the epoch's last step, no progress line said a step was skipped."""
    from xlatrain.progress import epoch_line

    row = {"epoch": 1, "train_loss": 0.5, "epoch_time_s": 1.0, "nonfinite_steps": 2}
    assert epoch_line(row, 3, "train_loss", False).endswith("(2 steps with a NaN/Inf loss or gradient norm, skipped)")
    assert epoch_line({**row, "nonfinite_steps": 1}, 3, "train_loss", False).endswith("(1 step with a NaN/Inf loss "
                                                                                       "or gradient norm, skipped)")
    assert "skipped" not in epoch_line({**row, "nonfinite_steps": 0}, 3, "train_loss", False)
