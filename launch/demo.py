"""python -m launch.demo: the whole pipeline, small, on the CPU, on the embedded UCI digits.

1. write the digits .beton files (data/digits/) and the moved digits (data/digits_moved/: the same digits
moved, scaled and recoloured on clutter, where raw pixels cannot match aligned strokes), 2. pretrain SimCLR
with hard view selection (`python -m pretrain`, as a user runs it), 3. evaluate k-NN and a linear probe of
the pretrained encoder on both sets, next to the same encoder at random initialisation and next to raw
pixels, 4. fine-tune it with 10% of the labels (`python -m transfer finetune`) next to the same network from
random initialisation, 5. with --detection, train the digit-scenes detector on it and from random
initialisation (`python -m transfer detection`), 6. print the table and write it to RUN_DIR/demo.json.
A killed demo resumes its pretraining; a finished one starts afresh.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


from eval.baselines import evaluate_encoder, random_init_backbone
from eval.features import load_backbone_export, resolve_device
from pretrain.config import load_config
from pretrain.data.digits import write_digits
from pretrain.runtime.argument_types import CommandLineParser
from transfer.digit_scenes import write_moved_digits

CONFIG = "configs/pretrain/simclr_digits.yaml"
FINETUNE_CONFIG = "configs/transfer/finetune_digits.yaml"


def run_stage(command: list[str]) -> bool:
    """Run a stage's command line as a user does; True when it succeeded."""
    print("$", " ".join(command), flush=True)
    return subprocess.run(command).returncode == 0


def newest_result(run_dir: Path, prefix: str) -> dict:
    """The newest result file RUN_DIR/eval/PREFIX_stepNNNNNNN.json, read (not the files written next to it,
    such as a detector's ..._stepNNNNNNN_detections.json)."""
    return json.loads(sorted((run_dir / "eval").glob(f"{prefix}_step{'[0-9]' * 7}.json"))[-1].read_text())


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(prog="python -m launch.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/demo", help="where the demo run goes (default: runs/demo)")
    parser.add_argument("--data-dir", default="data/digits", help="where the digits .beton files go")
    parser.add_argument("--moved-dir", default="data/digits_moved", help="where the moved digits go")
    parser.add_argument("--detection", action="store_true",
                        help="also train the digit-scenes detector on the encoder and from random init "
                             "(python -m transfer detection; make demo-detection)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help=f"extra overrides of {CONFIG}, e.g. optim.epochs=5")
    args = parser.parse_args(argv)
    started = time.time()
    run_dir, data_dir = Path(args.run_dir), Path(args.data_dir)

    # ==== 1. data ====
    write_digits(data_dir)
    moved = write_moved_digits(args.moved_dir)

    # ==== 2. pretraining, exactly as a user runs it ====
    if (run_dir / "finished.json").exists():
        shutil.rmtree(run_dir)
    overrides = [f"name={run_dir.name}", f"run_dir={run_dir}", "hvs.enabled=true",
                 f"data.train={data_dir / 'train.beton'}", f"data.val={data_dir / 'val.beton'}", *args.overrides]
    command = [sys.executable, "-m", "pretrain", "--config", CONFIG, *overrides]
    pretrain_started = time.time()
    if not run_stage(command):
        print("demo: pretraining failed (see above)", file=sys.stderr)
        return 1

    pretrain_seconds = time.time() - pretrain_started

    # ==== 3. evaluation: pretrained vs random init vs raw pixels ====
    cfg = load_config(CONFIG, overrides)
    device = resolve_device("auto")
    pretrained = load_backbone_export(run_dir / "backbone.pth").backbone.to(device).eval()
    random_init = random_init_backbone(cfg).to(device)
    encoders = {"pretrained": pretrained, "random_init": random_init, "raw_pixels": lambda x: x.flatten(1)}
    plain = {name: evaluate_encoder(encode, cfg, device, cfg.data.train, cfg.data.val)
             for name, encode in encoders.items()}
    shifted = {name: evaluate_encoder(encode, cfg, device, moved["train"], moved["val"])
               for name, encode in encoders.items()}

    # ==== 4. transfer: fine-tuning with 10% of the labels (and detection) vs the same network from random init ====
    table = {protocol: {name: round(plain[name][protocol], 4) for name in encoders} for protocol in ("knn", "linear")}
    table.update({f"{protocol}_moved": {name: round(shifted[name][protocol], 4) for name in encoders}
                  for protocol in ("knn", "linear")})
    stages = {"finetune": ("finetune", "--config", FINETUNE_CONFIG)}
    if args.detection:
        stages["detection"] = ("detection",)
    for stage, stage_args in stages.items():
        table[stage] = {}
        for name, start in (("pretrained", "export"), ("random_init", "random")):
            if not run_stage([sys.executable, "-m", "transfer", *stage_args, "--run", str(run_dir), "--from", start]):
                print(f"demo: {stage} failed (see above)", file=sys.stderr)
                return 1
            if stage == "finetune":
                table[stage][name] = round(newest_result(run_dir, f"finetune_10pct_{start}")["top1"], 4)
            else:
                table[stage][name] = round(newest_result(run_dir, f"detection_{start}")["map"], 4)

    # ==== 5. report ====
    table["seconds"] = round(time.time() - started, 1)
    (run_dir / "demo.json").write_text(json.dumps(table, indent=2) + "\n")
    columns = [("knn", "k-NN"), ("linear", "linear"), ("knn_moved", "k-NN moved"), ("linear_moved", "linear moved"),
               ("finetune", "fine-tune 10%"), *([("detection", "detection mAP")] if args.detection else [])]
    print(f"\n{'encoder':<14}" + "".join(f"{title:>15}" for _, title in columns))
    for name in encoders:
        cells = [table[key].get(name) for key, _ in columns]
        print(f"{name:<14}" + "".join(f"{'-':>15}" if value is None else f"{value:>15.2%}" for value in cells))
    print(f"\n{table['seconds']:.0f} s in all ({pretrain_seconds:.0f} s pretraining); results in {run_dir / 'demo.json'}; "
          f"tensorboard --logdir {run_dir.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
