"""Backbones (one factory, through timm) and the projection / prediction heads of the methods."""
from __future__ import annotations

import math

import timm
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from timm.layers import DropPath
from timm.models.vision_transformer import VisionTransformer
from torch import nn

STEMS = ("imagenet", "small", "small_stride2")
STEM_INITS = ("torch", "kaiming_fan_out")
POSITION_EMBEDDINGS = ("timm", "dino")


def create_backbone(arch: str, stem: str = "imagenet", image_size: int | None = None,
                    zero_init_residual: bool = True, drop_path_rate: float = 0.0, stem_init: str = "torch",
                    vit_pos_embed: str = "timm") -> nn.Module:
    """Build a timm backbone that returns pooled features; `backbone.num_features` is their width.

    stem: "imagenet" keeps the architecture's own stem. For small images (32 px) on ResNets,
      "small" is a 3x3 stride-1 convolution without max-pool (the CIFAR stem of SimCLR / SimSiam) and
      "small_stride2" a 3x3 stride-2 convolution without max-pool (4x cheaper, for CPU runs).
    image_size: input side for ViTs (their position embedding depends on it); ignored by ResNets.
    zero_init_residual: ResNets start each residual branch's last BatchNorm at zero (timm's zero_init_last).
    drop_path_rate: stochastic depth (Huang et al. 2016), timm's drop_path_rate: the largest per-block rate, rising
      linearly with depth (fine-tuning recipes: 0.1 for ViT-S/B). It adds no parameters: an export loads either way.
    stem_init: how a small stem's new convolution starts: "torch", nn.Conv2d's default (Kaiming-uniform with
      a = sqrt(5)), or "kaiming_fan_out", Kaiming-normal over the fan-out for ReLU, as timm and torchvision start every
      other convolution of a ResNet and as HobbitLong/SupContrast starts its CIFAR stem (networks/resnet_big.py,
      ResNet.__init__).
    vit_pos_embed: how a ViT's position embedding meets another input size (DINO's 96 px local crops, a
      low-resolution selection pass) and how its class token starts: "timm", timm's (antialiased bicubic resampling;
      class token normal, std 1e-6), or "dino", facebookresearch/dino's (`DinoPositionEmbedding`).
    """
    if stem not in STEMS:
        raise ValueError(f"model.stem={stem!r} is not one of {STEMS}")
    if stem_init not in STEM_INITS:
        raise ValueError(f"model.stem_init={stem_init!r} is not one of {STEM_INITS}")
    if vit_pos_embed not in POSITION_EMBEDDINGS:
        raise ValueError(f"model.vit_pos_embed={vit_pos_embed!r} is not one of {POSITION_EMBEDDINGS}")
    kwargs = {"num_classes": 0}
    if is_vision_transformer(arch):
        kwargs["dynamic_img_size"] = True     # the HVS selection pass may run at a lower resolution
        if image_size is not None:
            kwargs["img_size"] = image_size
    if arch.startswith("resnet"):
        kwargs["zero_init_last"] = zero_init_residual
    if drop_path_rate > 0:
        kwargs["drop_path_rate"] = drop_path_rate
    try:
        backbone = timm.create_model(arch, pretrained=False, **kwargs)
    except RuntimeError as error:  # timm: "Unknown model (...)"
        raise ValueError(f"model.arch={arch!r} is not a timm model name ({error}); "
                         "try resnet18, resnet50 or vit_small_patch16_224") from None
    if stem != "imagenet":
        if not hasattr(backbone, "conv1") or not hasattr(backbone, "maxpool"):
            raise ValueError(f"model.stem={stem!r} needs a ResNet-style backbone; {arch!r} has no conv1/maxpool. "
                             "Use model.stem=imagenet for this architecture.")
        stride = 1 if stem == "small" else 2
        backbone.conv1 = nn.Conv2d(3, backbone.conv1.out_channels, 3, stride, 1, bias=False)
        if stem_init == "kaiming_fan_out":
            nn.init.kaiming_normal_(backbone.conv1.weight, mode="fan_out", nonlinearity="relu")
        backbone.maxpool = nn.Identity()
    if vit_pos_embed == "dino" and is_vision_transformer(arch):
        backbone.__class__ = DinoPositionEmbedding  # same parameters and state_dict; see its docstring
        nn.init.trunc_normal_(backbone.cls_token, std=0.02)
    for module in backbone.modules():
        if type(module) is nn.Conv2d and max(module.stride) > 1 and max(module.kernel_size) > 1:
            module.__class__ = StridedConv2d        # same parameters and state_dict; see its docstring
    return backbone


def dino_resampled_pos_embed(pos_embed: torch.Tensor, height: int, width: int, prefix_tokens: int = 1) -> torch.Tensor:
    """The position embedding (1, prefix + N, D) of a square grid of N patches, for a grid of height x width patches,
    as facebookresearch/dino's `interpolate_pos_encoding` (vision_transformer.py): unchanged at its own size, else the
    patches' part resized by plain bicubic interpolation (no antialiasing) with the scale factor (n + 0.1) / sqrt(N)
    per side (DINO's offset against floating-point error in the output size); the prefix (class token) part kept."""
    side = math.isqrt(pos_embed.shape[1] - prefix_tokens)
    if height == width == side:
        return pos_embed
    patches = pos_embed[:, prefix_tokens:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
    patches = F.interpolate(patches, scale_factor=((height + 0.1) / side, (width + 0.1) / side), mode="bicubic")
    return torch.cat([pos_embed[:, :prefix_tokens], patches.permute(0, 2, 3, 1).reshape(1, height * width, -1)], dim=1)


class DinoPositionEmbedding(VisionTransformer):
    """timm's VisionTransformer with DINO's position embedding for inputs of another size (`model.vit_pos_embed=dino`):
    `dino_resampled_pos_embed` in place of timm's antialiased bicubic resampling, and (set by `create_backbone`) the
    class token started trunc-normal with std 0.02, as DINO's `VisionTransformer.__init__`. For the ViTs DINO trains:
    a class token, no register tokens, the class token's embedding in the position embedding."""

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        if not self.dynamic_img_size or self.no_embed_class or self.reg_token is not None or self.cls_token is None:
            return super()._pos_embed(x)
        batch, height, width, dim = x.shape
        tokens = torch.cat([self.cls_token.expand(batch, -1, -1), x.reshape(batch, -1, dim)], dim=1)
        return self.pos_drop(tokens + dino_resampled_pos_embed(self.pos_embed, height, width))


class StridedConv2d(nn.Conv2d):
    """nn.Conv2d that computes a strided convolution of a single-pixel input in fp32 under CPU bf16 autocast.

    oneDNN's bf16 weight gradient of a strided k x k convolution (k > 1) of a 1 x 1 input is garbage on the CPU
    (torch 2.13: values up to 1e35 or NaN in the kernel taps that only see padding, different every call), so
    a CPU bf16 run whose small views reach 1 x 1 before a ResNet's stride-2 convolution (8 px views with the
    stride-2 stem, or a low-resolution selection pass) would diverge at once. Those convolutions cost nothing
    at one pixel; everything else keeps bf16. GPUs (cuDNN) are not affected; fp32 is not affected.
    """

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if input.shape[-2:] == (1, 1) and input.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return super()._conv_forward(input.float(), weight.float(), None if bias is None else bias.float())
        return super()._conv_forward(input, weight, bias)


def is_vision_transformer(arch: str) -> bool:
    """Whether timm's `arch` is a ViT (sized by its input, and the one kind DINO gives stochastic depth)."""
    return arch.startswith("vit")


def backbone_from_config(cfg: DictConfig, drop_path_rate: float = 0.0) -> nn.Module:
    """The backbone the `model.*` keys describe; a ViT is sized for the first view group. `model.zero_init_residual`
    is a bool here: `load_config` fills a None with the method's reference value (`Method.reference_model`)."""
    model = cfg.model
    return create_backbone(model.arch, model.stem, cfg.data.views[0].size, bool(model.zero_init_residual),
                           drop_path_rate, model.stem_init, model.vit_pos_embed)


def without_stochastic_depth(module: nn.Module) -> nn.Module:
    """`module` with every timm DropPath replaced by nn.Identity, what timm builds at drop_path_rate 0 (no
    parameters either way, so the state_dict is unchanged): a copy of a student that must not drop blocks, as DINO's
    teacher, built without the rate (main_dino.py:166). Returns `module`, changed in place."""
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, DropPath):
                setattr(parent, name, nn.Identity())
    return module


def projector_from_config(cfg: DictConfig, in_dim: int, last_bn: str | None = None) -> nn.Sequential:
    """The projection MLP the `model.proj_*` keys describe, on `in_dim` backbone features; `last_bn` (a method's
    fixed choice) overrides `model.proj_last_bn`. model.proj_layers=1 is one linear layer (with bias), the
    embedding layer of the metric-learning papers 001 and 002; `model.proj_hidden_bn` (filled by `load_config` with
    the method's reference value) chooses the hidden layers' BatchNorm."""
    shape = projector_shape(cfg, in_dim)
    return mlp(**{**shape, "last_bn": last_bn or shape["last_bn"]})


def projector_shape(cfg: DictConfig, in_dim: int) -> dict:
    """The `mlp` arguments (in_dim, hidden_dim, out_dim, num_layers, last_bn, hidden_bn) of `projector_from_config`:
    what an export records to rebuild the projector without the config's schema."""
    model = cfg.model
    return {"in_dim": int(in_dim), "hidden_dim": int(model.proj_hidden_dim), "out_dim": int(model.proj_out_dim),
            "num_layers": int(model.proj_layers), "last_bn": str(model.proj_last_bn),
            "hidden_bn": bool(model.proj_hidden_bn)}


class ScaleOnlyBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm with a learnable scale and no shift: TensorFlow's `BatchNormalization(center=False)`, which ends
    google-research/simclr's projection head (its last LinearLayer has use_bias=False, use_bn=True)."""

    def __init__(self, num_features: int):
        super().__init__(num_features, affine=False)
        self.scale = nn.Parameter(torch.ones(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


LAST_BATCHNORMS = {"none": None, "bn": lambda dim: nn.BatchNorm1d(dim, affine=False), "bn_scale": ScaleOnlyBatchNorm1d}


def mlp(in_dim: int, hidden_dim: int, out_dim: int, num_layers: int, last_bn: str = "none",
        hidden_bn: bool = True) -> nn.Sequential:
    """Hidden blocks then a final linear, optionally followed by a BatchNorm (and then without bias).

    hidden_bn: the hidden blocks are Linear(no bias)-BN-ReLU (SimCLR's, SimSiam's heads) or, False, Linear-ReLU
      with biases (SupContrast's SupConResNet head, networks/resnet_big.py:174-178).
    last_bn: "none"; "bn", without affine parameters (SimSiam's projector); "bn_scale", with a scale and no shift
      (SimCLR's projector).
    """
    layers: list[nn.Module] = []
    dim = in_dim
    for _ in range(num_layers - 1):
        if hidden_bn:
            layers += [nn.Linear(dim, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True)]
        else:
            layers += [nn.Linear(dim, hidden_dim), nn.ReLU(inplace=True)]
        dim = hidden_dim
    last_norm = LAST_BATCHNORMS[last_bn]
    layers.append(nn.Linear(dim, out_dim, bias=last_norm is None))
    if last_norm is not None:
        layers.append(last_norm(out_dim))
    return nn.Sequential(*layers)

