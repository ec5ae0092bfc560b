"""The fine-tuned network: a backbone export (or the same backbone at random initialisation) with a new linear
head, and its optimizer groups with layer-wise learning-rate decay."""
from __future__ import annotations

import torch
from timm.models import group_parameters
from torch import nn

from eval.features import BackboneExport
from eval.results import trained_image_size
from pretrain.models import create_backbone

STARTS = ("export", "random")


class Classifier(nn.Module):
    """logits = head(backbone(images)): the pooled features of the backbone through one new linear layer."""

    def __init__(self, backbone: nn.Module, num_classes: int, head_init_std: float = 0.01):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.num_features, num_classes)
        # A small head (DINO's fine-tuning scales the new layer down, facebookresearch/dino#31): the first steps
        # then barely disturb the pretrained features with the gradients of a random classifier.
        nn.init.trunc_normal_(self.head.weight, std=head_init_std)
        nn.init.zeros_(self.head.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))


def build_classifier(export: BackboneExport, start: str, num_classes: int, *, drop_path_rate: float = 0.0,
                     head_init_std: float = 0.01, seed: int = 0) -> Classifier:
    """The export's backbone (`start="export"`: its weights) or the same architecture, stem and init rule at
    random initialisation (`start="random"`, seeded: the baseline), with a new head of `num_classes`.

    The backbone is built as pretraining built it (`create_backbone` with the export's arch, stem, first view
    size and model.zero_init_residual), plus stochastic depth, which adds no parameters.
    """
    if start not in STARTS:
        raise ValueError(f"start={start!r} is not one of {STARTS}")
    torch.manual_seed(seed)
    zero_init_residual = bool(export.config.get("model", {}).get("zero_init_residual", False))
    backbone = create_backbone(export.arch, export.stem, trained_image_size(export.config), zero_init_residual,
                               drop_path_rate=drop_path_rate)
    if start == "export":
        backbone.load_state_dict(export.backbone.state_dict())
    return Classifier(backbone, num_classes, head_init_std)


def backbone_layers(backbone: nn.Module) -> dict[str, int]:
    """Parameter name -> layer index, from timm's own grouping of the architecture (`group_matcher(coarse=True)`):
    ViT: 0 the patch / position embedding and class token, 1..depth the blocks (the final norm with the last);
    ResNet: 0 the stem (conv1, bn1), 1..4 the stages layer1..layer4. Without a group_matcher: all layer 0."""
    matcher = getattr(backbone, "group_matcher", None)
    if matcher is None:
        return {name: 0 for name, _ in backbone.named_parameters()}
    return group_parameters(backbone, matcher(coarse=True), reverse=True)


def layer_decay_param_groups(model: Classifier, layer_decay: float) -> list[dict]:
    """Optimizer groups with layer-wise lr decay (BEiT, Bao et al. 2022; MAE, He et al. 2022): with L backbone layers
    (`backbone_layers`) the head is layer L, and a parameter of layer l gets `lr_scale` = layer_decay ** (L - l)
    (applied by `pretrain.runtime.optim.set_schedule_values`). ResNet: head 1, layer4 d, layer3 d^2, ..., stem d^5.
    ViT: head 1, last block d, ..., first block d^depth, embeddings d^(depth + 1): MAE's scales (util/lr_decay.py),
    except that the final norm goes with the last block (timm's grouping) where MAE gives it the head's 1.

    Within a layer, biases and normalisation weights (1-D) and the backbone's `no_weight_decay()` names (ViT:
    pos_embed, cls_token) form a `no_decay` group, as `pretrain.methods.base.split_decay_groups` does.
    """
    layers = backbone_layers(model.backbone)
    head_layer = max(layers.values(), default=-1) + 1
    skip_decay = set(model.backbone.no_weight_decay()) if hasattr(model.backbone, "no_weight_decay") else set()
    groups: dict[tuple[int, bool], dict] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        inner = name.removeprefix("backbone.")
        layer = layers[inner] if name.startswith("backbone.") else head_layer
        no_decay = parameter.ndim <= 1 or inner in skip_decay
        group = groups.setdefault((layer, no_decay), {"params": [], "layer": layer, "no_decay": no_decay,
                                                      "lr_scale": layer_decay ** (head_layer - layer)})
        group["params"].append(parameter)
    return [groups[key] for key in sorted(groups)]
