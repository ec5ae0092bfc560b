"""`python -m pretrain.bench workers`: what starting the torchvision backend's DataLoader workers from the forkserver
costs against forking them from the training process (torch's default on Linux), measured the same way in
alternating rounds.

One epoch of the torchvision view loader's workers (pretrain/data/torchvision_loader.py: `worker_batches`, which
starts new workers every epoch) over generated 64 px JPEGs, 2 views of 32 px. The first round's forkserver epoch
includes the forkserver's own start (once per process: it imports torch and torchvision) and is reported apart; the
table gives each start method's median seconds an epoch and range over the other rounds, and the per-round ratio.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from pretrain.runtime.argument_types import positive_int


def run_workers_benchmark(args: argparse.Namespace) -> dict:
    # heavy: torchvision, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.bench.images import synthetic_image_folder
    from pretrain.bench.precision import median_and_range
    from pretrain.data.loader import IMAGENET_MEAN, IMAGENET_STD
    from pretrain.data.torchvision_loader import ImageFolderViews, worker_batches
    from pretrain.data.views import ViewGroup

    folder = synthetic_image_folder(Path(args.data_dir), args.images)
    dataset = ImageFolderViews(folder, [ViewGroup(count=2, size=32)], IMAGENET_MEAN, IMAGENET_STD)
    first, times = {}, {"fork": [], "forkserver": []}
    for round_ in range(args.rounds + 1):
        for method in ("fork", "forkserver"):
            dataset.draw_seed = (0, round_)
            start = time.perf_counter()
            for _ in worker_batches(dataset, args.workers, start_method=method, batch_size=args.batch_size):
                pass
            if round_:
                times[method].append(time.perf_counter() - start)
            else:                                 # the forkserver's own start, once per process
                first[method] = time.perf_counter() - start
    ratios = [b / a for a, b in zip(times["fork"], times["forkserver"])]
    result = {"images": args.images, "workers": args.workers, "batch_size": args.batch_size, "rounds": args.rounds,
              "first_epoch_s": first, "epoch_s": {method: median_and_range(values) for method, values in times.items()},
              "forkserver_over_fork": median_and_range(ratios)}
    print(f"\nthe torchvision view loader, {args.images} images of 64 px, 2 views of 32 px, {args.workers} workers, "
          f"seconds an epoch over {args.rounds} alternating rounds (after a first round)\n")
    print("| workers started by | first epoch (s) | epoch (s), median | range |")
    print("| --- | --- | --- | --- |")
    for method in ("fork", "forkserver"):
        s = result["epoch_s"][method]
        print(f"| {method} | {first[method]:.2f} | {s['median']:.2f} | {s['min']:.2f}-{s['max']:.2f} |")
    r = result["forkserver_over_fork"]
    print(f"\nforkserver / fork, per round: median {r['median']:.2f}x, range {r['min']:.2f}-{r['max']:.2f}x")
    return result


def add_workers_command(commands) -> None:
    parser = commands.add_parser("workers", help="DataLoader workers from the forkserver against forked: seconds an "
                                 "epoch, alternating", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=positive_int, default=256, help="generated images (default 256)")
    parser.add_argument("--workers", type=positive_int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per batch (default 32)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed rounds after the first (default 5)")
    parser.add_argument("--data-dir", default="bench/data", help="where the generated images are kept")
    parser.add_argument("--out", default="bench/workers.json", help="where the JSON result goes")
    parser.set_defaults(run=run_workers_benchmark)
