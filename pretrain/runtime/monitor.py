"""What a run reports: TensorBoard scalars and images under RUN_DIR/tb, one JSON line per logged step in
RUN_DIR/metrics.jsonl, and a progress line on the console. Only rank 0 writes."""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from torchvision.utils import make_grid

from pretrain.runtime.atomic_write import write_text_atomically


class MetricsFileError(ValueError):
    """metrics.jsonl holds a line that is not JSON before its last line; the message names file and line."""


def keep_logged_steps_up_to(metrics: Path, step: int) -> None:
    """Rewrite `metrics` (atomically) with only the lines of steps <= `step`.

    A crash or a full disk can leave the last line torn: it is dropped with a warning. A broken line before
    the last was not written by a crash; it is refused with its line number.
    """
    if not metrics.exists():
        return
    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                print(f"warning: dropped the torn last line of {metrics} (line {number}: {line[:60]!r}...), "
                      "left by a crash or a full disk", file=sys.stderr, flush=True)
                continue
            raise MetricsFileError(f"{metrics} line {number} is not JSON ({line[:60]!r}): fix or delete that line, "
                                   "then rerun") from None
        if record.get("step", 0) <= step:
            kept.append(line)
    write_text_atomically(metrics, "".join(line + "\n" for line in kept))


class TrainingMonitor:
    def __init__(self, run_dir: Path, total_steps: int, enabled: bool = True, print_every_steps: int = 10,
                 resumed_step: int | None = None):
        """resumed_step: the step a resumed run restarts from. What a killed run logged after its last
        checkpoint is dropped, from metrics.jsonl and (through purge_step) from TensorBoard, so each step
        appears once. A fresh start (None) removes the logs of an earlier attempt that saved no checkpoint."""
        self.enabled = enabled
        self.print_every_steps = max(1, print_every_steps)
        self.total_steps = total_steps
        self.started = time.time()
        self.first_step: int | None = None
        if enabled:
            metrics = run_dir / "metrics.jsonl"
            if resumed_step is not None:
                keep_logged_steps_up_to(metrics, resumed_step)
            elif metrics.exists() or (run_dir / "tb").exists():
                metrics.unlink(missing_ok=True)
                shutil.rmtree(run_dir / "tb", ignore_errors=True)
                print(f"fresh start: removed the logs of an earlier attempt that saved no checkpoint "
                      f"({metrics}, {run_dir / 'tb'})", file=sys.stderr, flush=True)
            purge_step = resumed_step + 1 if resumed_step is not None else None
            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)
            self.jsonl = open(metrics, "a")

    def log(self, step: int, epoch: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        for tag, value in scalars.items():
            self.tb.add_scalar(tag, value, step)
        self.jsonl.write(json.dumps({"step": step, "epoch": epoch, "time": round(time.time(), 3), **scalars}) + "\n")
        self.jsonl.flush()
        if step % self.print_every_steps == 0 or step in (1, self.total_steps):
            self.tb.flush()
            self._progress(step, epoch, scalars)

    def log_images(self, step: int, tag: str, images: torch.Tensor) -> None:
        """images: (rows, cols, C, H, W) in [0, 1], shown as one grid (one row per sample)."""
        if not self.enabled:
            return
        rows, cols = images.shape[:2]
        self.tb.add_image(tag, make_grid(images.flatten(0, 1).float().cpu(), nrow=cols, padding=1), step)

    def _progress(self, step: int, epoch: int, scalars: dict[str, float]) -> None:
        if self.first_step is None:
            self.first_step, self.started = step, time.time()
        done = step - self.first_step
        eta = ""
        if done > 0:
            seconds = (time.time() - self.started) / done * (self.total_steps - step)
            eta = f" eta {int(seconds // 60)}m{int(seconds % 60):02d}s"
        parts = [f"epoch {epoch}", f"step {step}/{self.total_steps}",
                 f"loss {scalars.get('train/loss', float('nan')):.4f}", f"lr {scalars.get('train/lr', 0):.4g}",
                 f"{scalars.get('perf/images_per_s', 0):.0f} img/s",
                 f"data wait {100 * scalars.get('perf/data_wait_frac', 0):.0f}%"]
        if "hvs/selected_loss" in scalars:
            parts.append(f"hvs loss {scalars['hvs/selected_loss']:.3f}/{scalars['hvs/mean_pair_loss']:.3f}")
        print(" | ".join(parts) + eta, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.tb.close()
            self.jsonl.close()
