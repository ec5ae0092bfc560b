"""The trained detector's detections on a split, in COCO's results format."""
from __future__ import annotations

import torch
from torch import nn

from transfer.detection.scenes import SceneSplit, batch_of


@torch.no_grad()
def predict(model: nn.Module, split: SceneSplit, batch_size: int, device: torch.device) -> list[dict]:
    """The detections of `model` on every image of `split`, in COCO's results format (bbox x, y, w, h)."""
    model.eval()
    detections = []
    for start in range(0, len(split.image_ids), batch_size):
        indices = torch.arange(start, min(start + batch_size, len(split.image_ids)))
        images, _ = batch_of(split, indices, device)
        for index, output in zip(indices.tolist(), model(images)):
            for box, score, label in zip(output["boxes"].cpu().tolist(), output["scores"].cpu().tolist(),
                                         output["labels"].cpu().tolist()):
                x0, y0, x1, y1 = box
                detections.append({"image_id": split.image_ids[index], "category_id": int(label),
                                   "bbox": [round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)],
                                   "score": round(float(score), 5)})
    return detections
