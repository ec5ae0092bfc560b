"""python -m launch.demo: the whole pipeline, small, on the CPU, on the embedded UCI digits.

1. write the digits .beton files (data/digits/), 2. pretrain SimCLR with hard view selection
(`python -m pretrain`, as a user runs it), 3. evaluate k-NN and a linear probe of the pretrained encoder next
to the same encoder at random initialisation and next to raw pixels, 4. print the table and write it to
RUN_DIR/demo.json. A killed demo resumes its pretraining; a finished one starts afresh.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from eval.features import extract_features, load_backbone_export, resolve_device
from eval.knn import weighted_knn
from eval.linear import train_linear_probe
from pretrain.config import load_config
from pretrain.data.digits import write_digits
from pretrain.data.loader import build_image_loader
from pretrain.models import create_backbone

CONFIG = "configs/pretrain/simclr_digits.yaml"


def evaluate(encode, cfg, device) -> dict[str, float]:
    """k-NN (k=20, T=0.07) and linear-probe top-1 of `encode` on the digits val split."""
    size = cfg.data.views[0].size
    def features(path):
        loader = build_image_loader(path, size, 256, device=device, mean=tuple(cfg.data.mean),
                                    std=tuple(cfg.data.std), num_workers=cfg.data.num_workers,
                                    crop_fraction=cfg.data.eval_crop_fraction)
        return extract_features(encode, loader, device)
    train_x, train_y = features(cfg.data.train)
    val_x, val_y = features(cfg.data.val)
    return {"knn": weighted_knn(train_x, train_y, val_x, val_y, ks=(20,))[20],
            "linear": train_linear_probe(train_x, train_y, val_x, val_y, device=device).final}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/demo", help="where the demo run goes (default: runs/demo)")
    parser.add_argument("--data-dir", default="data/digits", help="where the digits .beton files go")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help=f"extra overrides of {CONFIG}, e.g. optim.epochs=5")
    args = parser.parse_args(argv)
    started = time.time()
    run_dir, data_dir = Path(args.run_dir), Path(args.data_dir)

    # ==== 1. data ====
    write_digits(data_dir)

    # ==== 2. pretraining, exactly as a user runs it ====
    if (run_dir / "finished.json").exists():
        shutil.rmtree(run_dir)
    overrides = [f"name={run_dir.name}", f"run_dir={run_dir}", "hvs.enabled=true",
                 f"data.train={data_dir / 'train.beton'}", f"data.val={data_dir / 'val.beton'}", *args.overrides]
    command = [sys.executable, "-m", "pretrain", "--config", CONFIG, *overrides]
    print("$", " ".join(command), flush=True)
    pretrain_started = time.time()
    if subprocess.run(command).returncode != 0:
        print("demo: pretraining failed (see above)", file=sys.stderr)
        return 1

    pretrain_seconds = time.time() - pretrain_started

    # ==== 3. evaluation: pretrained vs random init vs raw pixels ====
    cfg = load_config(CONFIG, overrides)
    device = resolve_device("auto")
    pretrained = load_backbone_export(run_dir / "backbone.pth").backbone.to(device).eval()
    torch.manual_seed(cfg.seed)
    random_init = create_backbone(cfg.model.arch, cfg.model.stem, cfg.data.views[0].size,
                                  cfg.model.zero_init_residual).to(device).eval()
    results = {name: evaluate(encode, cfg, device) for name, encode in
               [("pretrained", pretrained), ("random_init", random_init), ("raw_pixels", lambda x: x.flatten(1))]}

    # ==== 4. report ====
    table = {protocol: {name: round(results[name][protocol], 4) for name in results} for protocol in ("knn", "linear")}
    table["seconds"] = round(time.time() - started, 1)
    (run_dir / "demo.json").write_text(json.dumps(table, indent=2) + "\n")
    print(f"\n{'encoder':<14}{'k-NN top-1':>12}{'linear top-1':>14}")
    for name in results:
        print(f"{name:<14}{table['knn'][name]:>12.2%}{table['linear'][name]:>14.2%}")
    print(f"\n{table['seconds']:.0f} s in all ({pretrain_seconds:.0f} s pretraining); results in {run_dir / 'demo.json'}; "
          f"tensorboard --logdir {run_dir.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
