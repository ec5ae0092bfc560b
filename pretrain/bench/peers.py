"""`python -m pretrain.bench peers`: this project against a peer library at equal settings, on Fashion-MNIST.

For each method (SimCLR, SimSiam, DINO) and seed, two runs of the same recipe, scored by the same evaluation:
- this project: `python -m pretrain --config configs/pretrain/METHOD_fashion_mnist.yaml` (plus the recipe's
  overrides), its FFCV loader, its method, its DeepSpeed loop;
- the peer: lightly 1.6's own pieces for the method (its view transform, projection / prediction heads and loss)
  in a plain PyTorch loop over the same Fashion-MNIST images (PIL, torchvision DataLoader), on the same backbone
  (`pretrain.models.create_backbone`: timm ResNet-18, stride-2 stem, residuals zero-initialised as the recipe's
  method's reference: SimCLR and SimSiam yes, DINO no), with the recipe's optimizer and schedule (SGD, momentum 0.9,
  this project's lr arrays: the peak lr x batch / 256 after a linear warm-up, then a cosine), with the weight decay
  on every parameter as lightly's examples have it, the recipe's batch and epochs; its backbone is written as this
  project's export (DINO's: the teacher's, as `method.export`). DINO's peer is lightly's DINO example with the
  recipe's settings: DINOTransform (2 globals, no locals), DINOProjectionHead, DINOLoss, the teacher updated by
  `update_momentum` at lightly's `cosine_schedule` from the recipe's momentum to 1 over the run's steps, the last
  layer's gradients cancelled for the recipe's first steps, and DINO's per-parameter gradient clipping.
Both exports are scored by `python -m eval knn` (k = 20) and `python -m eval linear` on the 10,000 test images
after every epoch; images/s is the median of the logged windows of each run (loader included). What still differs
between the two sides (BatchNorm's batch first: for SimCLR the peer normalises each view on its own) is DIFFERENCES,
printed under the table and kept in the JSON.

lightly is the benchmark's optional extra, never the package's: `make bench-peers` installs it
(`pip install --no-deps lightly==1.6.0 lightning-utilities`, over this project's torch and torchvision).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

from pretrain.bench.machine import this_machine
from pretrain.runtime.argument_types import non_negative_int, positive_int

RECIPES = {   # the project's config and what the comparison sets on both sides
    "simclr": ("configs/pretrain/simclr_fashion_mnist.yaml", []),
    # lightly's SimSiamProjectionHead has 3 layers (the SimSiam paper's); the project's config, 2 for the CPU
    "simsiam": ("configs/pretrain/simsiam_fashion_mnist.yaml", ["model.proj_layers=3"]),
    "dino": ("configs/pretrain/dino_fashion_mnist.yaml", []),
}
LIGHTLY_INSTALL = "make bench-peers (pip install --no-deps lightly==1.6.0 lightning-utilities)"
# What still differs between the two sides, printed under the table and kept in the JSON (docs/benchmarks.md).
DIFFERENCES = [
    "BatchNorm's batch, SimCLR: the peer (lightly's examples) passes each view through the backbone and the heads on "
    "its own, so every BatchNorm normalises over the B images of one view; this project's SimCLR passes the 2 views "
    "together (pretrain/methods/base.py: encode_view_groups), over 2B images, as google-research/simclr does. SimSiam: "
    "both sides pass each view on its own (method.per_view_batchnorm, as facebookresearch/simsiam's builder.py)",
    "weight decay, SimCLR: the peer decays every parameter, this project's SimCLR config leaves norms and biases "
    "undecayed as google-research/simclr (optim.decay_norm_and_bias=true decays them). SimSiam: both decay every "
    "parameter (facebookresearch/simsiam)",
    "the SimCLR projector's last BatchNorm: affine in lightly's head, scale-only here (google-research/simclr)",
    "the views: lightly's transform on PIL images through a torchvision DataLoader, this project's FFCV loader and "
    "its own augmentations, at the recipe's settings (DINO's blur: PIL's three box blurs on the peer's side, the "
    "sampled Gaussian out to three sigmas here)",
    "DINO: the peer decays every parameter (lightly's example), this project's DINO leaves norms and biases "
    "undecayed as facebookresearch/dino (optim.decay_norm_and_bias=true decays them); the peer's teacher sees the two "
    "globals in one batch per view (lightly), as here; the last layer's gradients are cancelled for the same steps "
    "on both sides",
]


def lightly_version() -> str:
    try:
        import lightly  # optional: installed by `make bench-peers`, not a dependency of the package
    except ImportError:
        print(f"error: the peer library lightly is not installed: {LIGHTLY_INSTALL}", file=sys.stderr)
        raise SystemExit(2) from None
    return lightly.__version__


# ============ the peer: lightly's pieces in a plain PyTorch loop ============

class GrayImages(torch.utils.data.Dataset):
    """Fashion-MNIST's training images as PIL RGB images (gray copied to R, G, B, as the .beton writer stores
    them), each through `transform` (lightly's multi-view transform: a list of views)."""

    def __init__(self, images: np.ndarray, transform):
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.transform(Image.fromarray(self.images[index]).convert("RGB"))


class PeerMethod:
    """A method of the peer: lightly's view transform, the trainable heads, the loss of a batch of views (a list of
    tensors) through the student backbone, what follows the backward and the optimizer step, and the backbone to
    export. SimCLR and SimSiam need no more than the loss."""

    def __init__(self, transform, heads: torch.nn.ModuleDict, loss):
        self.transform, self.heads, self.loss = transform, heads, loss

    def after_backward(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def exported(self, backbone: torch.nn.Module) -> torch.nn.Module:
        return backbone


class PeerDINO(PeerMethod):
    """lightly's DINO example (lightly/examples/pytorch/dino.py) at the recipe's settings, the schedule per step."""

    def __init__(self, cfg, backbone: torch.nn.Module, steps: int, steps_per_epoch: int):
        # optional: lightly, installed by `make bench-peers`, not a dependency of the package
        import copy

        from lightly.loss import DINOLoss
        from lightly.models.modules import DINOProjectionHead
        from lightly.models.utils import deactivate_requires_grad, update_momentum
        from lightly.transforms import DINOTransform
        from lightly.utils.scheduler import cosine_schedule

        from pretrain.methods.dino import teacher_temp_schedule, value_at     # the recipe's schedule, per step

        method, model, (first, second) = cfg.method, cfg.model, cfg.data.views[:2]
        transform = DINOTransform(
            global_crop_size=first.size, global_crop_scale=tuple(first.scale), n_local_views=0, hf_prob=first.flip_p,
            cj_prob=first.jitter_p, cj_strength=1.0, cj_bright=first.brightness, cj_contrast=first.contrast,
            cj_sat=first.saturation, cj_hue=first.hue, random_gray_scale=first.grayscale_p,
            gaussian_blur=(first.blur_p, second.blur_p, 0.0), sigmas=tuple(first.blur_sigma),
            solarization_prob=second.solarize_p, normalize={"mean": list(cfg.data.mean), "std": list(cfg.data.std)})
        def dino_head() -> torch.nn.Module:
            return DINOProjectionHead(backbone.num_features, model.proj_hidden_dim, model.proj_out_dim, method.out_dim,
                                      batch_norm=method.use_bn_in_head, freeze_last_layer=1,
                                      norm_last_layer=method.norm_last_layer)
        # The teacher starts as the student, as facebookresearch/dino's (lightly's example builds its teacher head
        # anew; a weight-normalised head cannot be deep-copied)
        head, teacher_head = dino_head(), dino_head()
        teacher_head.load_state_dict(head.state_dict())
        self.teacher = torch.nn.ModuleDict({"backbone": copy.deepcopy(backbone), "head": teacher_head})
        deactivate_requires_grad(self.teacher)
        criterion = DINOLoss(output_dim=method.out_dim, warmup_teacher_temp=method.warmup_teacher_temp,
                             teacher_temp=method.teacher_temp, student_temp=method.student_temp,
                             center_momentum=method.center_momentum)
        self.frozen_steps = round(method.freeze_last_layer_epochs * steps_per_epoch)
        self.clip = float(cfg.optim.grad_clip_per_parameter)
        self.momentum = [cosine_schedule(step, steps, method.momentum_teacher, 1.0) for step in range(steps)]
        self.update_momentum, self.backbone, self.head = update_momentum, backbone, head
        self.teacher_temp = teacher_temp_schedule(method.warmup_teacher_temp, method.teacher_temp,
                                                  round(method.warmup_teacher_temp_epochs * steps_per_epoch), steps)
        self.step = 0

        def loss(views: list[torch.Tensor]) -> torch.Tensor:
            with torch.no_grad():
                teacher = [self.teacher["head"](self.teacher["backbone"](view)) for view in views]
            student = [head(backbone(view)) for view in views]
            return criterion(teacher, student, teacher_temp=value_at(self.teacher_temp, self.step))
        super().__init__(transform, torch.nn.ModuleDict({"head": head}), loss)

    def after_backward(self, step: int) -> None:
        self.head.cancel_last_layer_gradients(current_epoch=0 if step < self.frozen_steps else 1)
        if self.clip > 0:                     # facebookresearch/dino utils.clip_gradients
            for p in [*self.backbone.parameters(), *self.head.parameters()]:
                if p.grad is not None:
                    scale = self.clip / (p.grad.norm() + 1e-6)
                    if scale < 1:
                        p.grad.mul_(scale)

    def after_step(self, step: int) -> None:
        self.update_momentum(self.backbone, self.teacher["backbone"], m=self.momentum[step])
        self.update_momentum(self.head, self.teacher["head"], m=self.momentum[step])
        self.step = step + 1

    def exported(self, backbone: torch.nn.Module) -> torch.nn.Module:
        return self.teacher["backbone"]


def lightly_model(method: str, cfg, backbone: torch.nn.Module, steps: int, steps_per_epoch: int) -> PeerMethod:
    """lightly's pieces for `method`, with the recipe's view, head and loss settings."""
    # optional: lightly, installed by `make bench-peers`, not a dependency of the package
    from lightly.loss import NegativeCosineSimilarity, NTXentLoss
    from lightly.models.modules import (SimCLRProjectionHead, SimSiamPredictionHead, SimSiamProjectionHead)
    from lightly.transforms import SimCLRTransform, SimSiamTransform

    if method == "dino":
        return PeerDINO(cfg, backbone, steps, steps_per_epoch)
    view = cfg.data.views[0]
    transform_options = dict(input_size=view.size, cj_prob=view.jitter_p, cj_strength=1.0, cj_bright=view.brightness,
                             cj_contrast=view.contrast, cj_sat=view.saturation, cj_hue=view.hue,
                             min_scale=view.scale[0], random_gray_scale=view.grayscale_p, gaussian_blur=view.blur_p,
                             hf_prob=view.flip_p, normalize={"mean": list(cfg.data.mean), "std": list(cfg.data.std)})
    width, model = backbone.num_features, cfg.model
    if method == "simclr":
        projector = SimCLRProjectionHead(width, model.proj_hidden_dim, model.proj_out_dim, num_layers=model.proj_layers)
        criterion = NTXentLoss(temperature=cfg.method.temperature)

        def loss(views: list[torch.Tensor]) -> torch.Tensor:
            return criterion(projector(backbone(views[0])), projector(backbone(views[1])))
        return PeerMethod(SimCLRTransform(**transform_options), torch.nn.ModuleDict({"projector": projector}), loss)
    projector = SimSiamProjectionHead(width, model.proj_hidden_dim, model.proj_out_dim)
    predictor = SimSiamPredictionHead(model.proj_out_dim, model.pred_hidden_dim, model.proj_out_dim)
    criterion = NegativeCosineSimilarity()

    def simsiam_loss(views: list[torch.Tensor]) -> torch.Tensor:        # lightly's SimSiam example
        z0, z1 = projector(backbone(views[0])), projector(backbone(views[1]))
        p0, p1 = predictor(z0), predictor(z1)
        return 0.5 * (criterion(z0.detach(), p1) + criterion(z1.detach(), p0))
    return PeerMethod(SimSiamTransform(**transform_options),
                      torch.nn.ModuleDict({"projector": projector, "predictor": predictor}), simsiam_loss)


def train_peer(method: str, cfg, run_dir: Path, workers: int) -> list[float]:
    """Train `method` with lightly's pieces for cfg.optim.epochs epochs; write this project's export after each epoch
    (RUN_DIR/exports/backbone_stepN.pth, the last also RUN_DIR/backbone.pth); return images/s of each window of
    cfg.engine.print_every_steps steps."""
    # heavy: omegaconf, cv2, timm, for this benchmark only (see pretrain/bench/__init__.py)
    from omegaconf import OmegaConf

    from pretrain.data.fashion_mnist import read_fashion_mnist
    from pretrain.models import create_backbone
    from pretrain.runtime.optim import schedules_from_config, set_schedule_values

    if cfg.optim.name != "sgd":
        raise SystemExit(f"error: the peer's loop trains with SGD; the recipe's optim.name is {cfg.optim.name!r}")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    backbone = create_backbone(cfg.model.arch, cfg.model.stem, zero_init_residual=cfg.model.zero_init_residual)
    images, _ = read_fashion_mnist()["train"]
    steps_per_epoch = len(images) // cfg.data.batch_size
    total = steps_per_epoch * cfg.optim.epochs       # the project's run of this recipe: its epochs, no compute budget
    peer = lightly_model(method, cfg, backbone, total, steps_per_epoch)
    heads = peer.heads
    loader = torch.utils.data.DataLoader(GrayImages(images, peer.transform), batch_size=cfg.data.batch_size,
                                         shuffle=True, drop_last=True, num_workers=workers,
                                         persistent_workers=workers > 0,
                                         generator=torch.Generator().manual_seed(cfg.seed))
    # The recipe's optimizer and schedule (this project's arrays, so that every step's lr is the same on both sides);
    # the weight decay on every parameter, as lightly's examples; SimSiam's predictor at the base lr (fix_pred_lr).
    fixed = list(heads["predictor"].parameters()) if "predictor" in heads and cfg.method.get("fix_pred_lr") else []
    rest = [p for p in [*backbone.parameters(), *heads.parameters()] if all(p is not q for q in fixed)]
    optimizer = torch.optim.SGD([{"params": rest}, *([{"params": fixed, "fixed_lr": True}] if fixed else [])],
                                lr=cfg.optim.lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    schedules = schedules_from_config(cfg, len(loader), total, cfg.data.batch_size)
    backbone.train(), heads.train()
    rates, step, window, started = [], 0, cfg.engine.print_every_steps, time.perf_counter()
    (run_dir / "exports").mkdir(parents=True, exist_ok=True)
    for epoch in range(cfg.optim.epochs):
        for views in loader:
            set_schedule_values(optimizer, schedules.lr[step], schedules.weight_decay[step], schedules.peak_lr, step)
            loss = peer.loss(views)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            peer.after_backward(step)
            optimizer.step()
            peer.after_step(step)
            step += 1
            if step % window == 0:
                rates.append(window * cfg.data.batch_size / (time.perf_counter() - started))
                print(f"lightly {method} epoch {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"{rates[-1]:.0f} img/s", flush=True)
                started = time.perf_counter()
        export = {"arch": cfg.model.arch, "stem": cfg.model.stem, "epoch": epoch, "step": step,
                  "state_dict": {k: v.detach().clone() for k, v in peer.exported(backbone).state_dict().items()},
                  "config": OmegaConf.to_container(cfg, resolve=True)}
        torch.save(export, run_dir / "exports" / f"backbone_step{step:08d}.pth")
        torch.save(export, run_dir / "backbone.pth")
    return rates


# ============ the comparison ============

RECIPE_KEYS = ("model", "method", "optim", "hvs", "seed", "data.views", "data.batch_size")   # what a run trained


def check_same_recipe(run_dir: Path, saved, cfg) -> None:
    """Refuse to read back a finished run of `run_dir` whose settings `saved` (its config.yaml, or the peer's export's
    config) differ from `cfg`, the run this command would make: a run left by an earlier revision or other flags would
    be reported as this one."""
    # heavy: omegaconf, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.runtime.checkpoint import changed_settings

    changed = changed_settings(saved, cfg, RECIPE_KEYS)
    if changed:
        raise SystemExit(f"error: {run_dir} holds a finished run with other settings ({'; '.join(changed)}): it is not "
                         "the run this command compares. Delete it, or pass another --work-dir.")


def evaluate(run_dir: Path, checkpoint: Path) -> dict[str, float]:
    """k-NN (k = 20) and linear-probe top-1 of one export, by this project's `python -m eval`; a result written after
    the export was (a finished comparison run again) is read back."""
    from eval.results import result_path      # where `python -m eval` writes: the one place that says so

    step = torch.load(checkpoint, weights_only=True, map_location="cpu")["step"]
    top1 = {}
    for protocol in ("knn", "linear"):
        result = result_path(run_dir, protocol, step)
        if not result.is_file() or result.stat().st_mtime < checkpoint.stat().st_mtime:
            subprocess.run([sys.executable, "-m", "eval", protocol, "--run", str(run_dir), "--checkpoint",
                            str(checkpoint)], check=True, stdout=subprocess.DEVNULL)
        top1[protocol] = json.loads(result.read_text())["top1"]
    return {"knn": 100 * float(top1["knn"]["20"]), "linear": 100 * float(top1["linear"])}


def epoch_exports(run_dir: Path, steps_per_epoch: int, epochs: int) -> list[Path]:
    return [run_dir / "exports" / f"backbone_step{steps_per_epoch * (e + 1):08d}.pth" for e in range(epochs)]


def run_peers(args: argparse.Namespace) -> dict:
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config

    version = lightly_version()
    data = Path(args.data_dir)
    if not (data / "train.beton").exists():
        subprocess.run([sys.executable, "-m", "pretrain.data", "write-fashion-mnist", "--out-dir", str(data)],
                       check=True)
    rows = []
    print(f"1-minute load average before: {os.getloadavg()[0]:.2f}", flush=True)
    for method in args.methods:
        config, recipe = RECIPES[method]
        for seed in args.seeds:
            overrides = [*recipe, f"seed={seed}", f"optim.epochs={args.epochs}", f"data.train={data / 'train.beton'}",
                         f"data.val={data / 'test.beton'}", f"data.num_workers={args.workers}",
                         "engine.keep_exports=0", "engine.image_grid_every_steps=0"]
            for library in ("hardview", f"lightly {version}"):
                run_dir = Path(args.work_dir) / f"{method}_{library.split()[0]}_seed{seed}"
                cfg = load_config(config, [*overrides, f"run_dir={run_dir}"])
                if library == "hardview":
                    if (run_dir / "finished.json").exists():
                        check_same_recipe(run_dir, yaml.safe_load((run_dir / "config.yaml").read_text()), cfg)
                    else:
                        subprocess.run([sys.executable, "-m", "pretrain", "--config", config, *overrides,
                                        f"run_dir={run_dir}"], check=True)
                    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                    rates = [line["perf/images_per_s"] for line in logged if "perf/images_per_s" in line]
                    minutes = max(line.get("perf/training_seconds", 0) for line in logged) / 60    # its training clock
                else:                 # a finished peer run is read back, as a finished project run is
                    finished = run_dir / "finished.json"
                    if finished.exists():
                        check_same_recipe(run_dir, torch.load(run_dir / "backbone.pth", map_location="cpu",
                                                              weights_only=True)["config"], cfg)
                    else:
                        started = time.perf_counter()
                        rates = train_peer(method, cfg, run_dir, args.workers)
                        finished.write_text(json.dumps({"images_per_s": rates,
                                                        "train_minutes": (time.perf_counter() - started) / 60}))
                    finished_run = json.loads(finished.read_text())
                    rates, minutes = finished_run["images_per_s"], finished_run.get("train_minutes", float("nan"))
                steps_per_epoch = 60000 // cfg.data.batch_size
                for epoch, export in enumerate(epoch_exports(run_dir, steps_per_epoch, args.epochs), start=1):
                    scores = evaluate(run_dir, export)
                    rows.append({"method": method, "library": library, "seed": seed, "epoch": epoch, **scores,
                                 "images_per_s": round(float(np.median(rates[1:] or rates)), 1),
                                 "train_minutes": round(minutes, 2), "load_average_1min": os.getloadavg()[0]})
                    print(f"{method:<8}{library:<14}seed {seed} epoch {epoch}: k-NN {scores['knn']:.2f}%  linear "
                          f"{scores['linear']:.2f}%  {rows[-1]['images_per_s']:.0f} images/s", flush=True)
    table = summary_table(rows) + "\n\n" + difference_table(rows)
    print("\n" + table + "\n\nwhat still differs between the two sides:\n" + "\n".join(f"- {d}" for d in DIFFERENCES))
    return {"command": "peers", "epochs": args.epochs, "seeds": args.seeds, "lightly": version,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "machine": this_machine(), "rows": rows,
            "table": table, "differences": DIFFERENCES}


def summary_table(rows: list[dict]) -> str:
    """Markdown: per method, library and epoch, the mean (and std over seeds) of k-NN and linear top-1, images/s."""
    lines = ["| method | library | epoch | seeds | k-NN top-1 (k = 20) | linear top-1 | images/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["method"], r["library"], r["epoch"]) for r in rows}, key=lambda k: (k[0], k[2], k[1]))

    def cell(values: list[float]) -> str:
        return f"{np.mean(values):.2f}" + (f" ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else "")
    for method, library, epoch in keys:
        group = [r for r in rows if (r["method"], r["library"], r["epoch"]) == (method, library, epoch)]
        lines.append(f"| {method} | {library} | {epoch} | {len(group)} | {cell([r['knn'] for r in group])} | "
                     f"{cell([r['linear'] for r in group])} | {np.median([r['images_per_s'] for r in group]):.0f} |")
    return "\n".join(lines)


def difference_table(rows: list[dict]) -> str:
    """Markdown: per method and epoch, this project minus the peer over the seeds both ran (the verdict, with its
    interval: `eval.statistics.paired_difference`'s mean, 95% t interval and paired t-test p), and this project's
    images/s over the peer's per seed (each seed's two runs ran one after the other), median and range."""
    from eval.statistics import paired_difference     # heavy: scipy, for this benchmark only

    lines = ["| method | epoch | seeds | k-NN: hardview - peer, 95% CI | linear: hardview - peer, 95% CI | "
             "images/s: hardview / peer, median (range) |", "| --- | --- | --- | --- | --- | --- |"]
    for method, epoch in sorted({(r["method"], r["epoch"]) for r in rows}):
        ours, peer = ({r["seed"]: r for r in rows if (r["method"], r["epoch"]) == (method, epoch)
                       and (r["library"] == "hardview") == mine} for mine in (True, False))
        seeds = sorted(set(ours) & set(peer))
        cells = []
        for metric in ("knn", "linear"):
            if len(seeds) < 2:
                cells.append(f"{ours[seeds[0]][metric] - peer[seeds[0]][metric]:+.2f} (one seed: no interval)"
                             if seeds else "-")
                continue
            difference = paired_difference({s: ours[s][metric] for s in seeds}, {s: peer[s][metric] for s in seeds})
            low, high = difference.interval
            p_value = "-" if difference.p_value is None else f"{difference.p_value:.2f}"
            cells.append(f"{difference.mean:+.2f} [{low:+.2f}, {high:+.2f}], p = {p_value}")
        ratios = [ours[s]["images_per_s"] / peer[s]["images_per_s"] for s in seeds]
        speed = f"{np.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        lines.append(f"| {method} | {epoch} | {len(seeds)} | {cells[0]} | {cells[1]} | {speed} |")
    return "\n".join(lines)


def add_peers_command(commands) -> None:
    parser = commands.add_parser(
        "peers", help="this project against lightly at equal settings on Fashion-MNIST: accuracy per epoch, images/s",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=tuple(RECIPES), default=list(RECIPES),
                        help="methods to compare (default: all)")
    parser.add_argument("--seeds", nargs="+", type=non_negative_int, default=[0], help="seeds (default: 0)")
    parser.add_argument("--epochs", type=positive_int, default=1, help="epochs of each run (default: 1)")
    parser.add_argument("--workers", type=positive_int, default=2, help="loader workers of both (default: 2)")
    parser.add_argument("--data-dir", default="data/fashion_mnist",
                        help="the Fashion-MNIST .beton files, written when missing (default: data/fashion_mnist)")
    parser.add_argument("--work-dir", default="bench/peers", help="the runs (default: bench/peers)")
    parser.add_argument("--out", default="bench/peers.json", help="where the JSON result goes")
    parser.set_defaults(run=run_peers)
