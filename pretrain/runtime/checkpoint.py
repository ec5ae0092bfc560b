"""Checkpoints: the `Checkpointer` saves a run and resumes it, through DeepSpeed's checkpoints.

RUN_DIR/checkpoints/stepNNNNNNNN/                   DeepSpeed shards (model, optimizer, per rank) + client state
RUN_DIR/checkpoints/stepNNNNNNNN/trainer_state.json  step, data position and run layout; written last, so a
                                                    checkpoint without it is incomplete and never loaded
RUN_DIR/checkpoints/latest                          the newest complete checkpoint (for DeepSpeed's tools)

After every checkpoint the task writes what other stages read (`TrainingTask.write_export`; pretraining's
backbone export: pretrain/export.py). Every file that a reader may see while it is written (trainer_state.json,
latest, the exports) is written to a temporary name and renamed: a crash or a full disk leaves the previous
version, never half a file. Resuming loads the newest checkpoint that loads and holds finite parameters, falling
back to older ones with a message; rotation deletes only older checkpoints once a newer one is complete.
"""
from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from pretrain.runtime.atomic_write import write_text_atomically
from pretrain.runtime.distributed import (all_ranks_agree, average_buffers, first_non_finite_tensor,
                                          parameters_finite_on_every_rank)
from pretrain.runtime.divergence import TrainingDiverged
from pretrain.runtime.task import TrainingTask

TRAINER_STATE = "trainer_state.json"

# The checkpoint format this code writes (trainer_state.json's "format") and the oldest it resumes. Raise it when what
# a checkpoint holds changes so that older code would resume it wrongly (a renamed or re-meaning piece of state), and
# say here what each version added; keep resuming the previous version where it can be, or lower nothing and refuse it.
#   0: the checkpoints written before the format was versioned (trainer_state.json without "format"), the same content
#   1: "format" written (2026-11-28); tests/data/checkpoint_format_1 is one, which every later version must resume
CHECKPOINT_FORMAT = 1
OLDEST_RESUMABLE_FORMAT = 0

# What a checkpoint's step count, data position and schedule depend on. Resuming with any of them changed
# would silently train another run (other epochs, another schedule, zero steps), so it is refused. A checkpoint
# written before a key was added resumes without its check. Settings
# that only change values (optim.lr, weight decay, clipping, logging, checkpoint frequency, max_steps) may
# change on resume: the new values apply from the resumed step on.
RUN_LAYOUT = {
    "world_size": "the number of processes",
    "batch_size": "the batch size per process",
    "grad_accum": "the micro-batches per optimizer step",
    "num_images": "the number of training images",
    "epochs": "the number of epochs",
    "seed": "the seed",
    "budget_pflop": "the compute budget in PFLOP (optim.budget_pflop, 0: none)",
    "flops_per_step": "the FLOPs counted for one optimizer step (0: not counted; the model, the views or hard view "
                      "selection changed)",
    "schedule_step_seconds": "the step time the schedule was sized from (optim.schedule_from_minutes; 0: not timed)",
    "schedule_steps": "the optimizer steps every schedule spans (a timed schedule: engine.max_minutes changed)",
}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as it is; the message says why and what to do."""


def run_layout(options, world_size: int, num_images: int, flops_per_step: int = 0, schedule_step_seconds: float = 0.0,
               schedule_steps: int = 0) -> dict[str, int | float]:
    """The settings of RUN_LAYOUT for this start; `options`: the loop's (`pretrain.runtime.loop.LoopOptions`);
    `flops_per_step`: the count of a compute-budgeted run (pretrain/runtime/compute_budget.py), which a resumed run
    takes again; `schedule_step_seconds`: the timed step of a schedule sized by minutes, which a resumed run takes from
    its checkpoint (`timed_step_of_checkpoint`); `schedule_steps`: the schedule's length."""
    return {"world_size": world_size, "batch_size": options.batch_size, "grad_accum": options.grad_accum,
            "num_images": num_images, "epochs": options.epochs, "seed": options.seed,
            "budget_pflop": options.budget_pflop, "flops_per_step": flops_per_step,
            "schedule_step_seconds": schedule_step_seconds, "schedule_steps": schedule_steps}


def read_trainer_state(checkpoint: Path) -> dict:
    """A checkpoint's trainer_state.json: its step, data position, clock and run layout."""
    return json.loads((checkpoint / TRAINER_STATE).read_text())


def timed_step_of_checkpoint(checkpoint_dir: Path) -> float:
    """The step time a resumed run's schedule was sized from: the newest complete checkpoint's that can be read
    (0.0 without one, or when its schedule was not sized by a timed step)."""
    for checkpoint in complete_checkpoints(checkpoint_dir):
        try:
            return float(read_trainer_state(checkpoint).get("schedule_step_seconds", 0.0))
        except (OSError, ValueError):
            continue              # the loader falls back to an older checkpoint too: the same run, the same schedule
    return 0.0


def describe_write_error(error: Exception, directory: Path) -> str:
    """One line for a failed write; says "no space left on device" when that is why (torch's zip writer
    reports a full disk only as "file write failed")."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    full = free is not None and free < 1 << 20
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left" in reason or full:
        return f"no space left on device ({reason})"
    return reason


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Checkpoint directories with their trainer_state.json (complete), newest first."""
    return sorted((p for p in checkpoint_dir.glob("step*") if (p / TRAINER_STATE).is_file()), reverse=True)


class Checkpointer:
    """Saves the run at a step (DeepSpeed checkpoint + trainer state + the task's state outside the engine, then
    the task's `write_export`) after checking that the parameters are finite, resumes it, and words what
    divergence leaves behind.

    `stage` is the run's `Stage` (pretrain/runtime/loop.py: its run_dir, name, options.keep_checkpoints and
    divergence_advice); `layout` the settings of RUN_LAYOUT for this start (`run_layout`).
    """

    def __init__(self, engine, task: TrainingTask, stage, layout: dict[str, int | float]):
        self.engine, self.task, self.stage, self.layout = engine, task, stage, layout
        self.directory = stage.run_dir / "checkpoints"
        self.saved_step: int | None = None

    def resume(self) -> tuple[int, int, float] | None:
        """Load the newest checkpoint that loads; return its (epoch, batch in epoch, seconds trained), or None (a
        fresh start). A checkpoint written before the training clock was kept counts from 0."""
        resumed = self.load_newest_loadable()
        if resumed is None:
            return None
        trainer_state, client_state = resumed
        self.task.load_state_outside_engine(client_state.get("task", client_state.get("method", {})))
        self.saved_step = self.engine.global_steps
        return trainer_state["epoch"], trainer_state["batch_in_epoch"], trainer_state.get("trained_seconds", 0.0)

    def save(self, epoch: int, batch_in_epoch: int, trained_seconds: float) -> None:
        step = self.engine.global_steps
        if not parameters_finite_on_every_rank(self.engine.module):
            where = first_non_finite_tensor(self.engine.module)
            raise self.diverged(f"the parameters or BatchNorm statistics are NaN or inf after step {step}"
                                + (f" ({where}, and maybe others)" if where else ""), epoch)
        self.write({"format": CHECKPOINT_FORMAT, "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                    "trained_seconds": trained_seconds, **self.layout},
                   {"task": self.task.state_outside_engine()})
        self.task.write_export(self.stage.run_dir, epoch, step)
        self.saved_step = step

    def diverged(self, what: str, epoch: int) -> TrainingDiverged:
        saved = self.saved_step
        kept = (f"The last checkpoint ({self.directory / f'step{saved:08d}'}), of step {saved}, and what it "
                "exported are finite and kept; rerunning the same command resumes from there" if saved is not None
                else "No checkpoint had been saved yet; rerunning the same command starts afresh")
        return TrainingDiverged(f"{self.stage.name} diverged in epoch {epoch}: {what}. {kept}. "
                                f"{self.stage.divergence_advice()}")

    def write(self, trainer_state: dict, client_state: dict) -> None:
        """Save checkpoint `stepNNNNNNNN` of `trainer_state["step"]` on every rank; mark it complete, point `latest`
        at it, and keep the newest `engine.keep_checkpoints` complete checkpoints (0: all).

        A failed write (a full disk) removes the partial checkpoint, leaves `latest` on the last complete one,
        and raises CheckpointError on every rank.
        """
        engine, checkpoint_dir, keep = self.engine, self.directory, self.stage.options.keep_checkpoints
        tag = f"step{trainer_state['step']:08d}"
        average_buffers(engine.module)
        failure = None
        try:
            engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=client_state, save_latest=False)
        except (OSError, RuntimeError) as error:
            failure = describe_write_error(error, checkpoint_dir)
            dist.barrier()          # the one DeepSpeed's save ends with, which this rank did not reach
        if dist.get_rank() == 0 and failure is None:
            try:
                write_text_atomically(checkpoint_dir / tag / TRAINER_STATE, json.dumps(trainer_state, indent=1))
                write_text_atomically(checkpoint_dir / "latest", tag)
            except OSError as error:
                failure = describe_write_error(error, checkpoint_dir)
        if not all_ranks_agree(failure is None):
            previous = [p.name for p in complete_checkpoints(checkpoint_dir) if p.name != tag]
            if dist.get_rank() == 0:
                shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)
            dist.barrier()
            last = f"the last complete checkpoint is {previous[0]}" if previous else "no complete checkpoint exists yet"
            reason = failure or "failed on another process"
            raise CheckpointError(f"could not write checkpoint {checkpoint_dir / tag}: {reason}. The partial "
                                  f"checkpoint was removed; {last}. Free space, then rerun the same command to resume "
                                  "from it.")
        if dist.get_rank() == 0 and keep > 0:
            complete = complete_checkpoints(checkpoint_dir)
            for old in complete[keep:]:
                shutil.rmtree(old, ignore_errors=True)
            for leftover in checkpoint_dir.glob("step*"):        # incomplete ones, older than the newest complete
                if leftover.is_dir() and leftover.name < complete[0].name and leftover not in complete:
                    shutil.rmtree(leftover, ignore_errors=True)
        dist.barrier()

    def load_newest_loadable(self) -> tuple[dict, dict] | None:
        """Load the newest complete checkpoint that loads and holds finite parameters; return its
        (trainer_state, client_state), or None when the run has no complete checkpoint.

        Refused (CheckpointError) when the newest checkpoint was written with another RUN_LAYOUT, or when none
        loads. Older checkpoints are tried in turn, with a message naming each one skipped and why.
        """
        engine, checkpoint_dir = self.engine, self.directory
        candidates = complete_checkpoints(checkpoint_dir)
        if not candidates:
            return None
        check_layout(candidates[0], self.layout)
        reasons = []
        for candidate in candidates:
            reason = None
            try:
                path, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=candidate.name)
                if path is None:
                    reason = "DeepSpeed found no model states in it"
            except Exception as error:       # a torn zip, a missing shard, a shape mismatch: all mean "cannot use"
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            if all_ranks_agree(reason is None) and not parameters_finite_on_every_rank(engine.module):
                reason = "its parameters or BatchNorm statistics are not finite (NaN or inf): the run had diverged"
            if all_ranks_agree(reason is None):
                if reasons and dist.get_rank() == 0:
                    print(f"resuming from {candidate.name}, the newest checkpoint that loads; skipped "
                          + "; ".join(reasons), flush=True)
                return read_trainer_state(candidate), client_state
            reasons.append(f"{candidate.name} ({reason or 'it failed to load on another process'})")
        raise CheckpointError(
            f"none of the {len(candidates)} checkpoints in {checkpoint_dir} can be resumed: " + "; ".join(reasons)
            + ". If they do not match this run's model or optimizer, resume with the settings in "
            f"{checkpoint_dir.parent / 'config.yaml'}, or start a new run with another name=... .")


def check_layout(checkpoint: Path, layout: dict[str, int | float]) -> None:
    """Refuse (CheckpointError, one line) a checkpoint of a format this code does not resume, or written with another
    RUN_LAYOUT than this start's."""
    saved = read_trainer_state(checkpoint)
    version = saved.get("format", 0)
    if not OLDEST_RESUMABLE_FORMAT <= version <= CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"cannot resume {checkpoint.parent.parent} from {checkpoint.name}: it is in checkpoint format {version}, and "
            f"this code resumes formats {OLDEST_RESUMABLE_FORMAT} to {CHECKPOINT_FORMAT} "
            "(pretrain/runtime/checkpoint.py: CHECKPOINT_FORMAT). Resume it with the code that wrote it (its "
            "provenance.json names the commit), or start a new run with another name=... .")
    changed = [f"{RUN_LAYOUT[key]} was {saved[key]} and is now {layout[key]}"
               for key in RUN_LAYOUT if key in saved and saved[key] != layout[key]]
    if changed:
        raise CheckpointError(
            f"cannot resume {checkpoint.parent.parent} from {checkpoint.name}: " + "; ".join(changed)
            + ". The run's steps, data position and schedule depend on these: resume with the settings it was "
            "trained with (processes: torchrun --nproc-per-node N), or start a new run with another name=... .")


def changed_settings(saved, current, keys: Sequence[str]) -> list[str]:
    """`key=old -> new` for every setting under `keys` (each a dotted key or a whole section) that differs between
    the configs `saved` and `current` (DictConfigs or plain dicts)."""
    saved, current = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(saved), resolve=True)), \
        OmegaConf.create(OmegaConf.to_container(OmegaConf.create(current), resolve=True))

    def leaves(key: str):
        node = OmegaConf.select(current, key)
        if OmegaConf.is_dict(node):
            for name in node:
                yield from leaves(f"{key}.{name}")
        else:
            yield key

    def plain(value):
        """A setting as plain Python, tuples as lists (a config written to YAML and read back has no tuples)."""
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return [plain(item) for item in value] if isinstance(value, (list, tuple)) else value

    return [f"{leaf}={plain(OmegaConf.select(saved, leaf))!r} -> {plain(OmegaConf.select(current, leaf))!r}"
            for key in keys for leaf in leaves(key)
            if plain(OmegaConf.select(saved, leaf)) != plain(OmegaConf.select(current, leaf))]


def check_resumable(saved_config_path: Path, config, keys: Sequence[str]) -> None:
    """Refuse to resume a run directory whose RUN_DIR/config.yaml differs from `config` in any setting under `keys`
    (what would make it another run: pretraining's model and method; fine-tuning's and detection's whole recipe)."""
    if not saved_config_path.is_file():
        return
    changed = changed_settings(OmegaConf.load(saved_config_path), config, keys)
    if changed:
        raise CheckpointError(
            f"{saved_config_path.parent} holds a run with other settings ({'; '.join(changed)}): resuming it would "
            "not train what this command asks for. Use another run name (name=...), rerun with the settings in "
            f"{saved_config_path}, or delete that directory.")
