"""Frozen features for evaluation: load a backbone export, check it, and encode a dataset once.

Everything the evaluation protocols (k-NN, linear probe) read comes through here:

- `load_backbone_export(path)` reads `backbone.pth` (written by pretraining: `{arch, stem, state_dict,
  config, epoch, step}`, plus `embedding_head` for the metric-learning methods), rebuilds the backbone with
  `pretrain.models.create_backbone` (and the embedding head with `pretrain.models.mlp`) and refuses an
  export whose weights do not fit that architecture, naming the mismatched keys.
- `embed(head, features)` maps backbone features through the embedding head (what `eval retrieval` ranks by).
- `extract_features(encode, loader)` runs any `encode(images) -> features` callable (a frozen backbone,
  `torch.flatten` for raw pixels, a randomly initialised network) over a loader of
  `(images, labels, indices)` batches and returns the features in dataset order.

User errors (missing or mismatched checkpoint, missing .beton) raise `EvaluationInputError`, which the
command line prints without a traceback.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eval.results import trained_image_size
from eval.stop_points import stop_point
from pretrain.models import create_backbone

# How many mismatched state_dict keys an error message names before summarising the rest.
_KEYS_SHOWN = 5


class EvaluationInputError(Exception):
    """A user-facing problem with the inputs of an evaluation (checkpoint, data paths, options).

    The message says what is wrong and what to do; `python -m eval` prints it and exits with status 2.
    """


@dataclass
class BackboneExport:
    """A pretrained backbone rebuilt from `backbone.pth`, with the run config it was trained under.

    backbone: the timm backbone with the exported weights loaded, in eval mode, on the CPU.
    config:   the resolved run config (plain dicts / lists) saved with the export.
    embedding_head: the head whose (L2-normalised) output the method's loss trained, in eval mode, on the CPU,
              when the export has one (the metric-learning methods); None otherwise.
    """

    path: Path
    arch: str
    stem: str
    backbone: nn.Module
    config: dict[str, Any]
    epoch: int
    step: int
    embedding_head: nn.Module | None = None

    @property
    def num_features(self) -> int:
        return int(self.backbone.num_features)


def resolve_device(device: str | torch.device) -> torch.device:
    """Map "auto" to CUDA when available, else the CPU; pass anything else to `torch.device`."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise EvaluationInputError(f"--device {device!r} is not a torch device ({error}); "
                                   "use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise EvaluationInputError(f"--device {device!r} asks for CUDA but torch sees no GPU; use --device cpu or auto")
    return resolved


def resolve_checkpoint_path(run_dir: str | Path | None, checkpoint: str | Path | None) -> Path:
    """The export to evaluate: `checkpoint` when given, else `run_dir/backbone.pth`; it must exist."""
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_file():
            raise EvaluationInputError(f"no backbone export at {path}: pass the backbone.pth written by "
                                       "`python -m pretrain ...` with --checkpoint, or use --run RUN_DIR")
        return path
    if run_dir is None:
        raise EvaluationInputError("no checkpoint to evaluate: pass --run RUN_DIR (reads RUN_DIR/backbone.pth) "
                                   "or --checkpoint FILE")
    path = Path(run_dir) / "backbone.pth"
    if not path.is_file():
        raise EvaluationInputError(f"no backbone export at {path}: run `python -m pretrain --config FILE` "
                                   "first or pass --checkpoint")
    return path


def _describe_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:_KEYS_SHOWN])
    more = len(keys) - _KEYS_SHOWN
    return shown + (f" (and {more} more)" if more > 0 else "")


def check_state_dict_fits(backbone: nn.Module, state_dict: dict[str, torch.Tensor], arch: str, stem: str,
                          path: Path) -> None:
    """Raise `EvaluationInputError` naming the first mismatched keys when `state_dict` does not fit `backbone`."""
    expected = backbone.state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    reshaped = [f"{key} {tuple(state_dict[key].shape)} vs {tuple(value.shape)}"
                for key, value in expected.items()
                if key in state_dict and tuple(state_dict[key].shape) != tuple(value.shape)]
    if not (missing or unexpected or reshaped):
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys: {_describe_keys(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys: {_describe_keys(unexpected)}")
    if reshaped:
        problems.append(f"{len(reshaped)} keys with other shapes (export vs model): {_describe_keys(reshaped)}")
    raise EvaluationInputError(
        f"the weights in {path} do not fit create_backbone(arch={arch!r}, stem={stem!r}): " + "; ".join(problems)
        + ". Export the backbone alone (not the projector, heads or a DeepSpeed checkpoint) with the arch and "
        "stem it was trained with, or pass the matching --checkpoint.")


def load_backbone_export(path: str | Path, image_size: int | None = None) -> BackboneExport:
    """Load `backbone.pth`, rebuild its backbone and load the weights strictly.

    image_size: input side for ViTs (their position embedding depends on it); defaults to the size of the
      first training view in the saved config (`trained_image_size`).
    Raises `EvaluationInputError` for a file that is not an export, an unknown architecture or stem, or
    weights that do not fit the architecture.
    """
    path = Path(path)
    try:
        export = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip and "weights only" failures all mean "not an export"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "weights_only" in str(error) or "Weights only load failed" in str(error):
            reason = "it holds Python objects, not a tensor dict (a DeepSpeed checkpoint shard or another file)"
        raise EvaluationInputError(f"{path} is not a backbone export ({reason}); pass the backbone.pth written by "
                                   "`python -m pretrain`, or one of RUN_DIR/exports/backbone_stepNNNNNNNN.pth (not a "
                                   "file of RUN_DIR/checkpoints/)") from None
    if not isinstance(export, dict) or "state_dict" not in export or "arch" not in export:
        keys = sorted(export) if isinstance(export, dict) else type(export).__name__
        raise EvaluationInputError(f"{path} is not a backbone export: expected a dict with 'arch' and 'state_dict', "
                                   f"found {keys}; pass the backbone.pth written by `python -m pretrain`")
    config = export.get("config") or {}
    arch = export["arch"]
    stem = export.get("stem") or config.get("model", {}).get("stem", "imagenet")
    if image_size is None:
        image_size = trained_image_size(config)
    try:
        backbone = create_backbone(arch, stem, image_size)
    except ValueError as error:
        raise EvaluationInputError(f"cannot rebuild the backbone of {path}: {error}") from None
    check_state_dict_fits(backbone, export["state_dict"], arch, stem, path)
    non_finite = [name for name, tensor in export["state_dict"].items()
                  if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if non_finite:
        raise EvaluationInputError(
            f"{path} holds NaN or inf in {len(non_finite)} tensors ({_describe_keys(non_finite)}): the run diverged "
            f"before step {export.get('step')}, and its accuracy would be chance. Evaluate an earlier export, or rerun "
            "the pretraining with a lower optim.lr (it stops at a non-finite loss and keeps the last finite checkpoint)")
    backbone.load_state_dict(export["state_dict"])
    backbone.eval()
    head = load_embedding_head(export["embedding_head"], path) if "embedding_head" in export else None
    return BackboneExport(path=path, arch=arch, stem=stem, backbone=backbone, config=config,
                          epoch=int(export.get("epoch", 0)), step=int(export.get("step", 0)), embedding_head=head)


def load_embedding_head(entry: Any, path: Path) -> nn.Module:
    """The export's `embedding_head` ({in_dim, hidden_dim, out_dim, num_layers, state_dict}, and last_bn, hidden_bn,
    as `pretrain.export.export_backbone` writes it) rebuilt with `pretrain.models.mlp`, in eval mode. Exports
    written before last_bn / hidden_bn were recorded had neither a last BatchNorm nor hidden layers without one."""
    from pretrain.models import mlp

    shape_keys = ("in_dim", "hidden_dim", "out_dim", "num_layers")
    if not isinstance(entry, dict) or any(key not in entry for key in (*shape_keys, "state_dict")):
        found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise EvaluationInputError(f"the embedding_head of {path} is not {{{', '.join(shape_keys)}, state_dict}} "
                                   f"(found {found}); re-export it with `python -m pretrain`, or evaluate the backbone "
                                   "(`python -m eval retrieval --features backbone`)")
    shape = {**{key: int(entry[key]) for key in shape_keys}, "last_bn": str(entry.get("last_bn", "none")),
             "hidden_bn": bool(entry.get("hidden_bn", True))}
    head = mlp(**shape)
    try:
        head.load_state_dict(entry["state_dict"])
    except RuntimeError as error:
        problem = " ".join(line.strip() for line in str(error).splitlines()[1:3])
        raise EvaluationInputError(f"the embedding_head weights in {path} do not fit mlp({shape}): {problem}; "
                                   "evaluate the backbone (`python -m eval retrieval --features backbone`)") from None
    non_finite = [name for name, tensor in entry["state_dict"].items()
                  if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if non_finite:
        raise EvaluationInputError(f"{path} holds NaN or inf in its embedding head ({_describe_keys(non_finite)}): "
                                   "the run diverged; evaluate an earlier export")
    return head.eval()


@torch.no_grad()
def embed(head: nn.Module, features: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """(N, D) backbone features -> (N, E) outputs of the embedding head in eval mode, on the features' device,
    `batch_size` rows at a time. Not normalised: retrieval L2-normalises whatever it ranks."""
    head = head.to(features.device).eval()
    return torch.cat([head(chunk.float()) for chunk in features.split(batch_size)])


def resolve_beton_path(override: str | Path | None, config: dict[str, Any], split: str,
                       option: str | None = None) -> Path:
    """The data of `split` ("train" or "val"): the override when given, else config["data"][split]. An image
    folder, or a complete pretrain .beton (anything else is refused with the reason). `option`: how the user passes
    another path, with {} for it (default "--train {}"; `eval baselines` takes "data.train={}")."""
    option = option or f"--{split} {{}}"
    if override is not None:
        path = Path(override)
    else:
        configured = config.get("data", {}).get(split)
        if not configured:
            raise EvaluationInputError(f"the export's config has no data.{split} path: pass "
                                       f"{option.format('FILE.beton')}")
        path = Path(configured)
    if not path.exists():   # a .beton, or an image folder (read without FFCV)
        where = "" if path.is_absolute() else f", relative to {Path.cwd()}"
        raise EvaluationInputError(f"no .beton file or image folder at {path} (data.{split}{where}): write it with "
                                   f"`python -m pretrain.data ...` or pass {option.format('FILE.beton')} (or an image "
                                   "folder)")
    if path.is_file():
        from pretrain.data import DatasetError
        from pretrain.data.ffcv_loader import check_beton_fields

        try:
            check_beton_fields(path)
        except DatasetError as error:
            raise EvaluationInputError(f"{option.format(path)}: {error}") from None
        from pretrain.data.writer import is_unlabeled

        if is_unlabeled(path):
            raise EvaluationInputError(f"{path} (data.{split}) has no labels (written with --unlabeled), which "
                                       f"evaluation scores against: pass a labelled .beton with "
                                       f"{option.format('FILE.beton')}")
    return path


def stored_identity(path: str | Path) -> list[int] | str:
    """What tells one version of a file from another without reading it: [size, modification time in ns], or for a
    folder a digest of those of every file under it with their relative paths. Rewriting data (the writer renames a
    new file into place) changes them. Not the change time: pretraining's hard link RUN_DIR/backbone.pth changes an
    export's at every checkpoint, and the watcher's protocols would extract its features again. Not a content hash:
    it would read a 100 GB .beton at every evaluation of every checkpoint; a cache must be cheaper to check than to
    rebuild."""
    path = Path(path)

    def identity(file: Path) -> list[int]:
        status = file.stat()
        return [status.st_size, status.st_mtime_ns]

    if not path.is_dir():
        return identity(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path)}\t{identity(file)}\n".encode())
    return digest.hexdigest()


@torch.no_grad()
def extract_features(encode: Callable[[torch.Tensor], torch.Tensor],
                     loader: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode every batch of `loader` and return `(features (N, D) float32, labels (N,) long)` on the CPU.

    encode: any callable from a batch of images to a (B, D) tensor (a frozen backbone in eval mode,
      `lambda x: x.flatten(1)` for raw pixels, ...); outputs with more than two dimensions are flattened.
      It runs under `torch.no_grad()`; put a network in eval mode yourself.
    loader: yields `(images, labels, indices)`; rows are placed at their dataset index, so the result is
      in dataset order whatever order the loader uses. Every index in 0..N-1 must appear exactly once.
    device: where `images` are moved before encoding (no copy when they are already there).
    """
    device = resolve_device(device)
    features_by_batch, labels_by_batch, indices_by_batch = [], [], []
    for images, labels, indices in loader:
        stop_point()                   # a watcher's stop signal, taken here (eval/stop_points.py)
        features = encode(images.to(device, non_blocking=True))
        # Copies, not views: FFCV reuses its batch buffers, so a kept view would be overwritten by later batches.
        features_by_batch.append(features.flatten(1).float().cpu().clone())
        labels_by_batch.append(labels.reshape(-1).long().cpu().clone())
        indices_by_batch.append(indices.reshape(-1).long().cpu().clone())
    if not features_by_batch:
        raise EvaluationInputError("the loader yielded no images: check that the .beton file holds data")
    features = torch.cat(features_by_batch)
    labels = torch.cat(labels_by_batch)
    indices = torch.cat(indices_by_batch)
    bad = int((~torch.isfinite(features)).any(dim=1).sum())
    if bad:     # finite weights whose BatchNorm statistics overflow in eval mode (a run at a huge lr): not chance
        raise EvaluationInputError(f"the encoder gives NaN or inf features for {bad} of {len(features)} images (its "
                                   "weights or BatchNorm running statistics overflow: the run diverged without a NaN "
                                   "loss); evaluate an earlier export (RUN_DIR/exports/) or retrain at a lower lr")
    if not torch.equal(torch.sort(indices).values, torch.arange(len(indices))):
        raise ValueError(f"the loader's indices are not a permutation of 0..{len(indices) - 1}; extract_features "
                         "needs every image exactly once (no drop_last, no shuffling across ranks)")
    ordered_features = torch.empty_like(features)
    ordered_labels = torch.empty_like(labels)
    ordered_features[indices] = features
    ordered_labels[indices] = labels
    return ordered_features, ordered_labels
