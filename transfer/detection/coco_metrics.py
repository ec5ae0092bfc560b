"""COCO box mAP: pycocotools' COCOeval (bbox) of detections in COCO's results format against a COCO instances file."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

COCO_STATISTICS = ("map", "ap50", "ap75", "ap_small", "ap_medium", "ap_large", "ar_1", "ar_10", "ar_100",
                   "ar_small", "ar_medium", "ar_large")


def coco_box_metrics(ground_truth: str | Path, detections: list[dict]) -> tuple[dict[str, float], str]:
    """COCOeval (bbox) of `detections` against the COCO instances file `ground_truth`.

    Returns ({map, ap50, ap75, ap_small, ..., ar_large}: COCOeval's 12 statistics in its order, map being
    AP@[0.50:0.95] with 101-point interpolation), and COCOeval's printed summary. No detections scores 0.
    """
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):                     # pycocotools prints progress on stdout
        coco_gt = COCO(str(ground_truth))
        if not detections:
            return {name: 0.0 for name in COCO_STATISTICS}, "no detections: every AP is 0\n"
        # loadRes adds keys (id, area, segmentation) to the dicts it is given: hand it copies
        evaluation = COCOeval(coco_gt, coco_gt.loadRes([dict(d) for d in detections]), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        summary_start = printed.tell()
        evaluation.summarize()
    summary = printed.getvalue()[summary_start:]
    return {name: float(value) for name, value in zip(COCO_STATISTICS, evaluation.stats)}, summary
