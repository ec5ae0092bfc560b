"""The backbone factory: the bf16 path on the CPU gives sound gradients where oneDNN's does not."""
import pytest
import torch

from pretrain.models import StridedConv2d, create_backbone
from pretrain.runtime.cpu_bf16 import cpu_bf16_is_native


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
    # reach the same 1 x 1 convolution (pretrain/runtime/cpu_bf16.py).
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
