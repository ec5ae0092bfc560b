"""The backbone factory: the bf16 path on the CPU gives sound gradients where oneDNN's does not; a small stem's
initialisation."""
import math
from pathlib import Path

import pytest
import torch

from pretrain.models import StridedConv2d, create_backbone
from pretrain.runtime.bf16_support import cpu_bf16_is_native


@pytest.mark.slow
def test_bf16_gradients_of_single_pixel_strided_convolutions_are_sound_on_the_cpu():
    # 8 px views through the stride-2 stem reach layer4's stride-2 3x3 convolution at 1 x 1. Only the centre tap
    # of its kernel sees the pixel, so the other taps' gradient is exactly 0; oneDNN's bf16 weight gradient puts
    # garbage there (up to 1e35, or NaN, different every call). StridedConv2d computes that case in fp32.
    torch.manual_seed(0)
    backbone = create_backbone("resnet18", "small_stride2", zero_init_residual=False)   # gradients reach conv1
    conv = backbone.layer4[0].conv1
    assert isinstance(conv, StridedConv2d) and conv.stride == (2, 2) and conv.kernel_size == (3, 3)
    # Where bf16 is emulated (no AVX-512 BF16 or AMX), its weight gradients cost about 0.5 s an image here: 4 images
    # reach the same 1 x 1 convolution (pretrain/runtime/bf16_support.py).
    images = torch.randn(48 if cpu_bf16_is_native() else 4, 3, 8, 8)
    for _ in range(5):                 # the garbage differs from call to call: look several times
        backbone.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            features = backbone(images)
        features.float().sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in backbone.parameters())
        padding_only = torch.ones(3, 3, dtype=torch.bool)
        padding_only[1, 1] = False
        assert conv.weight.grad[:, :, padding_only].abs().max() == 0
        assert conv.weight.grad[:, :, 1, 1].abs().max() > 0


def test_the_swapped_convolution_keeps_the_state_dict_of_timm():
    import timm

    ours = create_backbone("resnet50").state_dict()
    theirs = timm.create_model("resnet50", num_classes=0).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].shape == theirs[k].shape for k in ours)


def test_channels_last_convolutions_keep_weights_deepspeed_can_flatten_and_compute_the_same():
    # engine.channels_last on GPUs: converting the weights broke deepspeed.initialize on an H200 (its broadcast views
    # each parameter as bytes); the inputs are converted instead, and the values stay those of the NCHW network.
    from pretrain.runtime.loop import channels_last_inputs

    torch.manual_seed(0)
    backbone = create_backbone("resnet18", "small_stride2").train()
    hooked = create_backbone("resnet18", "small_stride2").train()
    hooked.load_state_dict(backbone.state_dict())
    channels_last_inputs(hooked)
    layouts = []
    hooked.layer2[0].conv2.register_forward_hook(
        lambda module, inputs, output: layouts.append((inputs[0].is_contiguous(memory_format=torch.channels_last),
                                                       output.is_contiguous(memory_format=torch.channels_last))))
    images = torch.randn(4, 3, 32, 32)
    expected, actual = backbone(images), hooked(images)
    assert layouts == [(True, True)]                       # the convolutions read and write NHWC
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    expected.square().sum().backward()
    actual.square().sum().backward()
    for (name, p), q in zip(backbone.named_parameters(), hooked.parameters()):
        q.data.view(torch.uint8)                           # what DeepSpeed does at initialisation: no error
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_a_small_stem_starts_as_nn_conv2d_or_kaiming_normal_over_its_fan_out():
    """model.stem_init: torch keeps nn.Conv2d's default (uniform within 1 / sqrt(fan_in), fan_in 27); kaiming_fan_out
    draws Kaiming-normal over the fan-out for ReLU, std sqrt(2 / (64 x 9)) = 0.059, as SupContrast's CIFAR stem and
    timm's other convolutions. The 1,728 weights' std within 10% of it; the SupContrast and TCL CIFAR presets ask for
    it."""
    from pretrain.config import load_config

    torch.manual_seed(0)
    default = create_backbone("resnet18", "small").conv1.weight
    assert default.abs().max() <= 1 / math.sqrt(27)
    assert default.std().item() == pytest.approx(1 / math.sqrt(27) / math.sqrt(3), rel=0.1)    # uniform: 0.111
    kaiming = create_backbone("resnet18", "small", stem_init="kaiming_fan_out").conv1.weight
    assert kaiming.std().item() == pytest.approx(math.sqrt(2 / (64 * 9)), rel=0.1)             # 0.059
    timm_stem = create_backbone("resnet18", "imagenet").conv1.weight      # timm's own: fan-out over 64 x 7 x 7
    assert timm_stem.std().item() == pytest.approx(math.sqrt(2 / (64 * 49)), rel=0.1)
    configs = Path(__file__).parents[1] / "configs/pretrain"
    assert {name: load_config(configs / f"{name}_cifar_folder.yaml").model.stem_init
            for name in ("supcon", "tcl", "simclr", "simsiam")} == {
        "supcon": "kaiming_fan_out", "tcl": "kaiming_fan_out", "simclr": "torch", "simsiam": "torch"}
    with pytest.raises(ValueError, match="model.stem_init='he' is not one of"):
        create_backbone("resnet18", "small", stem_init="he")


def dino_interpolate_pos_encoding(pos_embed: torch.Tensor, patch_size: int, w: int, h: int) -> torch.Tensor:
    """facebookresearch/dino vision_transformer.py `interpolate_pos_encoding`, step by step as DINO writes it."""
    n = pos_embed.shape[1] - 1
    if (w // patch_size) * (h // patch_size) == n and w == h:
        return pos_embed
    class_pos_embed, patch_pos_embed = pos_embed[:, 0], pos_embed[:, 1:]
    dim = pos_embed.shape[-1]
    w0, h0 = w // patch_size + 0.1, h // patch_size + 0.1
    patch_pos_embed = torch.nn.functional.interpolate(
        patch_pos_embed.reshape(1, int(math.sqrt(n)), int(math.sqrt(n)), dim).permute(0, 3, 1, 2),
        scale_factor=(w0 / math.sqrt(n), h0 / math.sqrt(n)), mode="bicubic")
    assert int(w0) == patch_pos_embed.shape[-2] and int(h0) == patch_pos_embed.shape[-1]
    return torch.cat((class_pos_embed.unsqueeze(0), patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim)), dim=1)


def test_a_vit_with_dinos_position_embedding_resamples_it_for_96_px_locals_as_dino_does():
    """model.vit_pos_embed=dino: the tokens of a 96 px local crop of a 224 px ViT-Ti/16 get DINO's
    interpolate_pos_encoding (plain bicubic from 14 x 14 to 6 x 6 at scale 6.1 / 14), not timm's antialiased
    resampling, which differs; at 224 px both add the embedding as it is. The class token starts trunc-normal with std
    0.02 (DINO), not timm's 1e-6. The state_dict is timm's: an export loads either way."""
    torch.manual_seed(0)
    dino = create_backbone("vit_tiny_patch16_224", image_size=224, vit_pos_embed="dino").eval()
    timm_vit = create_backbone("vit_tiny_patch16_224", image_size=224).eval()
    timm_vit.load_state_dict(dino.state_dict())
    assert 0.01 < dino.cls_token.std().item() < 0.03 and timm_vit.cls_token.std().item() < 0.03
    with torch.no_grad():
        for size in (96, 224):
            patches = dino.patch_embed(torch.randn(2, 3, size, size))           # (2, n, n, D): a dynamic size
            tokens = torch.cat([dino.cls_token.expand(2, -1, -1), patches.flatten(1, 2)], dim=1)
            expected = tokens + dino_interpolate_pos_encoding(dino.pos_embed, 16, size, size)
            torch.testing.assert_close(dino._pos_embed(patches), expected)
            timm_tokens = timm_vit._pos_embed(patches)
            if size == 224:
                torch.testing.assert_close(timm_tokens, expected)
            else:
                assert (timm_tokens - expected).abs().max() > 1e-3               # antialiased: another embedding
    fresh = create_backbone("vit_tiny_patch16_224", image_size=224)
    assert fresh.cls_token.std().item() < 1e-5                                 # timm's start
    from pretrain.config import load_config
    from pretrain.models import DinoPositionEmbedding, backbone_from_config
    preset = load_config(Path(__file__).parents[1] / "configs/pretrain/dino_vit_small_imagenet_folder.yaml",
                         ["model.arch=vit_tiny_patch16_224"])
    assert isinstance(backbone_from_config(preset), DinoPositionEmbedding)     # the DINO preset asks for it
    with pytest.raises(ValueError, match="model.vit_pos_embed='jax' is not one of"):
        create_backbone("vit_tiny_patch16_224", vit_pos_embed="jax")
