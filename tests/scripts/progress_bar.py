"""One epoch of progress as the Trainer drives it: a step loop that advances every step, reports
(measured, then shown) at log intervals and logs one message mid-epoch, then an epoch line. Run with a terminal or a pipe
as stdout/stderr; prints which mode it chose first."""

from __future__ import annotations

import sys
import time

from xlatrain.logs import ensure_console, get_logger
from xlatrain.progress import EpochProgress, IntervalMeter, interactive_terminal

num_steps, log_every, start_step = (int(a) for a in sys.argv[1:4])
log = get_logger("xlatrain.train.trainer")
ensure_console()
interactive = interactive_terminal(is_main=True)
log.info(f"mode {'bar' if interactive else 'lines'}")
meter = IntervalMeter(start_step, samples_per_step=64, start_sums=(0.5 * start_step, 0.0))
with EpochProgress(3, num_steps, start_step, interactive=interactive, log=log.info) as progress:
    for step in range(start_step + 1, num_steps + 1):
        time.sleep(0.03)
        progress.advance(step)
        if step % log_every == 0 and step < num_steps:
            stats = meter.measure(step, loss_sum=0.5 * step, nonfinite=0)
            progress.show(step, epoch_loss=stats.epoch_loss, samples_per_s=stats.samples_per_s, nonfinite=0)
        if step == num_steps // 2:
            log.info("checkpoint written mid-epoch")
log.info("epoch 3/3  train_loss 0.5000")
