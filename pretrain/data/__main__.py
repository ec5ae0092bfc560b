"""Command line for writing datasets: `python -m pretrain.data {write,write-digits,write-fashion-mnist} --help`."""
from __future__ import annotations

import argparse
import sys

from pretrain.data import DatasetError
from pretrain.data.fashion_mnist import FASHION_MNIST_DIR, write_fashion_mnist
from pretrain.data.writer import DEFAULT_MAX_SIDE, write_image_folder
from pretrain.runtime.argument_types import CommandLineParser, output_folder


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="python -m pretrain.data",
                                     description="Write image datasets to FFCV .beton files for pretraining.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    folder = commands.add_parser("write", help="Write an image folder (one sub-folder per class, or unlabeled) to a "
                                               ".beton.",
                                 description="Write an image folder laid out as FOLDER/<class>/<image>.{jpg,png} "
                                             "to a .beton; with --unlabeled, every image under FOLDER at any depth "
                                             "(or listed in a text file), with label -1, for self-supervised "
                                             "pretraining. Unreadable images are skipped and listed in "
                                             "OUT.skipped.txt, class names go to OUT.classes.json ([] without labels).")
    folder.add_argument("--image-folder", required=True,
                        help="Folder with one sub-folder of images per class; with --unlabeled, a folder of images "
                             "(flat or nested at any depth) or a text file of image paths, one per line (relative to "
                             "the file's folder).")
    folder.add_argument("--unlabeled", action="store_true",
                        help="Write the images without labels (label -1): self-supervised methods pretrain on them; "
                             "evaluate on a labelled set (data.val, eval --train/--val).")
    folder.add_argument("--out", required=True, help="Output .beton path (e.g. data/train.beton).")
    folder.add_argument("--max-side", type=int, default=DEFAULT_MAX_SIDE,
                        help="Shrink images whose longer side exceeds this many pixels (aspect kept); 0 keeps every "
                             "size. Loaders size their decode buffers for the largest stored image times the batch, "
                             "so keep it near the sizes you train at. Default: %(default)s.")
    folder.add_argument("--write-mode", choices=("jpg", "raw"), default="jpg",
                        help="Store images as JPEG (small, decoded on load) or raw uint8 pixels. Default: jpg.")
    folder.add_argument("--jpeg-quality", type=int, default=90, help="JPEG quality for --write-mode jpg. Default: 90.")
    folder.add_argument("--workers", type=int, default=2, help="Processes/threads used to read and write. Default: 2.")

    digits = commands.add_parser("write-digits", help="Write the embedded digits set to OUT_DIR/{train,val}.beton.",
                                 description="Write scikit-learn's 1797 digits, upsampled to 32x32 RGB, split 80/20 "
                                             "stratified (seed 0), to OUT_DIR/train.beton and OUT_DIR/val.beton.")
    digits.add_argument("--out-dir", required=True, type=output_folder, help="Output folder (e.g. data/digits).")
    digits.add_argument("--force", action="store_true", help="Rewrite even when both .beton files already exist.")
    digits.add_argument("--write-mode", choices=("jpg", "raw"), default="jpg",
                        help="Store images as JPEG or raw uint8 pixels. Default: jpg.")
    digits.add_argument("--workers", type=int, default=2, help="Processes used to write. Default: 2.")
    digits.add_argument("--split-classes", action="store_true",
                        help="Write the deep-metric-learning split instead: every image of the digits 0-4 to "
                             "OUT_DIR/train.beton, every image of 5-9 to OUT_DIR/test.beton (train on the first half "
                             "of the classes, retrieve among the unseen second half).")

    fashion = commands.add_parser("write-fashion-mnist",
                                  help="Write Fashion-MNIST to OUT_DIR/{train,test}.beton (the public benchmark).",
                                  description="Write Fashion-MNIST's 60,000 train and 10,000 test images (28x28 "
                                              "grayscale, stored raw as RGB) to OUT_DIR/train.beton and "
                                              "OUT_DIR/test.beton from the four IDX files of Debian's "
                                              "dataset-fashion-mnist (make install installs it), and the training "
                                              "images split for searches: OUT_DIR/search_val.beton (a sixth of each "
                                              "class, 10,000, fixed) and OUT_DIR/search_train.beton (the other "
                                              "50,000); choose a recipe on those, report it on test.")
    fashion.add_argument("--out-dir", required=True, type=output_folder, help="Output folder (e.g. data/fashion_mnist).")
    fashion.add_argument("--source-dir", default=str(FASHION_MNIST_DIR),
                         help="Folder with train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
                              "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz. Default: %(default)s.")
    fashion.add_argument("--force", action="store_true",
                         help="Rewrite the .beton files that exist already (default: keep them, write those missing).")
    fashion.add_argument("--limit", type=int, default=0,
                         help="Write only the first LIMIT images of each split (a tiny set for smoke tests); "
                              "0 writes them all. Default: 0.")
    fashion.add_argument("--workers", type=int, default=2, help="Processes used to write. Default: 2.")
    return parser


def print_reports(reports) -> None:
    for report in reports:
        if report.written < 0:
            print(f"{report.out_path}: exists, kept (pass --force to rewrite)")
        else:
            print(report.summary())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "write":
        try:
            if args.max_side < 0:
                raise ValueError(f"--max-side {args.max_side} must be a number of pixels, or 0 to keep every size")
            report = write_image_folder(args.image_folder, args.out, unlabeled=args.unlabeled,
                                        max_side=args.max_side or None,
                                        write_mode=args.write_mode, jpeg_quality=args.jpeg_quality,
                                        workers=args.workers)
        except (OSError, ValueError) as error:      # a missing folder, a full disk, a bad value
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(report.summary())
        return 0
    if args.command == "write-digits":
        from pretrain.data.digits import write_digits  # heavy: scikit-learn (~1.5 s), for write-digits only

        print_reports(write_digits(args.out_dir, force=args.force, write_mode=args.write_mode, workers=args.workers,
                                   split_classes=args.split_classes))
    else:
        try:
            if args.limit < 0:
                raise ValueError(f"--limit {args.limit} must be a number of images, or 0 to write them all")
            print_reports(write_fashion_mnist(args.out_dir, source_dir=args.source_dir, force=args.force,
                                              workers=args.workers, limit=args.limit))
        except (DatasetError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
