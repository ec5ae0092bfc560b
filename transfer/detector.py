"""The digit-scenes detector: torchvision's Faster R-CNN in the R50-C4 layout of MoCo's detection protocol, on a
timm ResNet (the stem and layer1-layer3 as the trunk, layer4 + pooling as the box head). How it is trained and
evaluated: transfer/detection/.
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.ops import FrozenBatchNorm2d, MultiScaleRoIAlign

from pretrain.models import StridedConv2d


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm2d under `module` by torchvision's FrozenBatchNorm2d with its statistics and affine."""
    if isinstance(module, nn.BatchNorm2d):
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps)
        with torch.no_grad():
            frozen.weight.copy_(module.weight)
            frozen.bias.copy_(module.bias)
            frozen.running_mean.copy_(module.running_mean)
            frozen.running_var.copy_(module.running_var)
        return frozen
    for name, child in module.named_children():
        setattr(module, name, freeze_batchnorm(child))
    return module


class ResNetTrunk(nn.Module):
    """The stem and layer1-layer3 of a timm ResNet: the feature map the RPN and RoIAlign read (C4)."""

    def __init__(self, resnet: nn.Module):
        super().__init__()
        self.stem = nn.Sequential(resnet.conv1, resnet.bn1, resnet.act1, resnet.maxpool)
        self.layer1, self.layer2, self.layer3 = resnet.layer1, resnet.layer2, resnet.layer3
        self.out_channels = next(info["num_chs"] for info in resnet.feature_info if info["module"] == "layer3")

    def stages(self) -> list[nn.Module]:
        return [self.stem, self.layer1, self.layer2, self.layer3]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layer3(self.layer2(self.layer1(self.stem(images))))


class OnePixelConv2d(StridedConv2d):
    """nn.Conv2d that computes a convolution with a 1 x 1 output as one matrix product over the kernel taps
    that overlap the input (the other taps only ever see zero padding): the same numbers, far faster.

    With `model.roi_output_size=2` the C4 box head runs layer4 on hundreds of 2 x 2 RoIs per batch, so every
    convolution there has a 1 x 1 output. oneDNN (torch 2.13, CPU) computes each as a full padded
    convolution, and its backward is 5-10x slower than its forward: it was more than half of a training
    iteration. Any other convolution (a larger output, groups, dilation, other padding modes) goes to
    nn.Conv2d (through StridedConv2d, whose guard for CPU bf16 stays in place).
    """

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.groups == 1 and self.padding_mode == "zeros" and self.dilation == (1, 1) \
                and not isinstance(self.padding, str):
            (height, width), (kernel_h, kernel_w) = input.shape[-2:], self.kernel_size
            (pad_h, pad_w), (stride_h, stride_w) = self.padding, self.stride
            one_pixel = ((height + 2 * pad_h - kernel_h) // stride_h + 1,
                         (width + 2 * pad_w - kernel_w) // stride_w + 1) == (1, 1)
            # the output pixel sees padded rows 0..kernel_h-1: input rows 0..rows-1 meet taps pad_h..pad_h+rows-1
            rows, cols = min(height, kernel_h - pad_h), min(width, kernel_w - pad_w)
            if one_pixel and rows > 0 and cols > 0:
                window = input[:, :, :rows, :cols].flatten(1)
                taps = weight[:, :, pad_h:pad_h + rows, pad_w:pad_w + cols].flatten(1)
                return nn.functional.linear(window, taps, bias)[:, :, None, None]
        return super()._conv_forward(input, weight, bias)


class ResNetC5BoxHead(nn.Module):
    """layer4 of the ResNet on each RoI, then global average pooling: the box head of R50-C4."""

    def __init__(self, resnet: nn.Module):
        super().__init__()
        self.layer4 = resnet.layer4
        for module in self.layer4.modules():
            if isinstance(module, nn.Conv2d):
                module.__class__ = OnePixelConv2d          # same parameters and state_dict; see its docstring
        self.out_channels = int(resnet.num_features)

    def forward(self, rois: torch.Tensor) -> torch.Tensor:
        return self.layer4(rois).mean(dim=(2, 3))


def build_detector(resnet: nn.Module, cfg: DictConfig, num_classes: int, image_size: int,
                   mean: list[float], std: list[float]) -> nn.Module:
    """Faster R-CNN (C4) on `resnet`; `num_classes` counts the object classes (background is added)."""
    model = cfg.model
    trunk, box_head = ResNetTrunk(resnet), ResNetC5BoxHead(resnet)
    for stage in trunk.stages()[:model.frozen_stages]:
        freeze_batchnorm(stage)
        stage.requires_grad_(False)
    if model.norm == "frozen":
        freeze_batchnorm(trunk)
        freeze_batchnorm(box_head)
    anchors = AnchorGenerator(sizes=(tuple(int(s) for s in model.anchor_sizes),),
                              aspect_ratios=(tuple(float(r) for r in model.aspect_ratios),))
    roi_align = MultiScaleRoIAlign(featmap_names=["0"], output_size=model.roi_output_size, sampling_ratio=2)
    return FasterRCNN(
        trunk, min_size=image_size, max_size=image_size, image_mean=list(mean), image_std=list(std),
        rpn_anchor_generator=anchors, rpn_batch_size_per_image=model.rpn_batch_size_per_image,
        rpn_pre_nms_top_n_train=model.rpn_pre_nms_top_n_train, rpn_post_nms_top_n_train=model.rpn_post_nms_top_n_train,
        rpn_pre_nms_top_n_test=model.rpn_pre_nms_top_n_test, rpn_post_nms_top_n_test=model.rpn_post_nms_top_n_test,
        box_roi_pool=roi_align, box_head=box_head,
        box_predictor=FastRCNNPredictor(box_head.out_channels, num_classes + 1),
        box_batch_size_per_image=model.box_batch_size_per_image, box_score_thresh=model.box_score_thresh,
        box_detections_per_img=model.box_detections_per_img)
