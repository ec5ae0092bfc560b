"""Where a method's recipe follows its reference code: weight decay (SimSiam), the projector's end (SimCLR), gradient
clipping (DINO). The gradient edits themselves are tested through DeepSpeed in tests/test_gradient_edits.py."""
import pytest
import torch
from torch import nn

from pretrain.config import load_config
from pretrain.methods import build_method
from pretrain.models import ScaleOnlyBatchNorm1d
from pretrain.optim import build_optimizer, set_schedule_values
from tests.engine_helpers import CONFIGS

TINY = ["model.proj_hidden_dim=32", "model.proj_out_dim=16"]


def test_simsiam_decays_every_parameter_and_keeps_the_predictor_at_the_base_lr():
    """facebookresearch/simsiam passes every parameter, biases and BatchNorm included, to SGD with wd 1e-4."""
    cfg = load_config(CONFIGS / "simsiam_digits.yaml", TINY)
    method = build_method(cfg)
    optimizer = build_optimizer(cfg, method.param_groups(), 0.1)
    set_schedule_values(optimizer, lr=0.01, weight_decay=1e-4, base_lr=0.1, step=5)
    grouped = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(grouped) == len(list(method.parameters()))
    assert sum(p.ndim == 1 for p in grouped) > 10                    # the biases and BatchNorm are in there
    assert all(group["weight_decay"] == 1e-4 for group in optimizer.param_groups)
    predictor = {id(p) for p in method.predictor.parameters()}
    for group in optimizer.param_groups:
        on_predictor = {id(p) for p in group["params"]} <= predictor
        assert group["lr"] == (0.1 if on_predictor else 0.01)


@pytest.mark.parametrize("config", ["simclr_digits.yaml", "simclr_cifar_folder.yaml", "simclr_imagenet_folder.yaml"])
def test_simclr_projector_ends_with_a_bias_free_linear_and_a_scale_only_batchnorm(config):
    """google-research/simclr's head: the last LinearLayer has use_bias=False, use_bn=True (BN center=False)."""
    cfg = load_config(CONFIGS / config, TINY)
    method = build_method(cfg).train()
    *_, linear, norm = method.projector
    assert isinstance(linear, nn.Linear) and linear.bias is None
    assert isinstance(norm, ScaleOnlyBatchNorm1d) and norm.bias is None
    with torch.no_grad():
        norm.scale.copy_(torch.linspace(0.5, 2.0, 16))
        out = norm(torch.randn(64, 16) * 3 + 5)
    torch.testing.assert_close(out.mean(0), torch.zeros(16), atol=1e-5, rtol=0)      # no shift
    torch.testing.assert_close(out.std(0, unbiased=False), torch.linspace(0.5, 2.0, 16), atol=1e-3, rtol=0)
    no_decay = {id(p) for group in method.param_groups() if group.get("no_decay") for p in group["params"]}
    assert id(norm.scale) in no_decay                                # SimCLR excludes BN from weight decay
    plain = build_method(load_config(CONFIGS / config, [*TINY, "model.proj_last_bn=none"]))
    assert isinstance(plain.projector[-1], nn.Linear) and plain.projector[-1].bias is not None


@pytest.mark.parametrize("config", ["dino_digits.yaml", "dino_resnet50_imagenet_folder.yaml",
                                    "dino_vit_small_imagenet_folder.yaml"])
def test_dino_configs_clip_each_parameter_at_3_not_the_global_norm(config):
    cfg = load_config(CONFIGS / config)
    assert cfg.optim.grad_clip_per_parameter == 3.0 and cfg.optim.grad_clip == 0.0


def test_simsiam_normalises_each_training_view_on_its_own_and_the_selection_pool_jointly():
    """facebookresearch/simsiam runs z1 = encoder(x1), z2 = encoder(x2) (BatchNorm statistics per view); the views
    used to go through BatchNorm as one batch of 2B. The selection pool goes as one batch, as automl/hvp@main's
    select_crops (`single_forward(torch.cat(images))`); `method.per_view_batchnorm=false` is the joint form."""
    cfg = load_config(CONFIGS / "simsiam_digits.yaml", TINY)
    torch.manual_seed(0)
    method = build_method(cfg).train()
    views = torch.randn(6, 2, 3, 16, 16)
    outputs = method([views])
    for v in range(2):                                           # each view alone, as the reference's forward
        z = method.projector(method.backbone(views[:, v]))
        torch.testing.assert_close(outputs["z"][:, v], z)
        torch.testing.assert_close(outputs["p"][:, v], method.predictor(z))
    pool = torch.randn(6, 4, 3, 16, 16)                         # the selection pool: one batch of 4B
    z_pool = method.projector(method.backbone(pool.flatten(0, 1))).unflatten(0, (6, 4))
    torch.testing.assert_close(method([pool])["z"], z_pool)
    joint = build_method(load_config(CONFIGS / "simsiam_digits.yaml", [*TINY, "method.per_view_batchnorm=false"]))
    joint.load_state_dict(method.state_dict())
    z_joint = method.projector(method.backbone(views.flatten(0, 1))).unflatten(0, (6, 2))
    torch.testing.assert_close(joint.train()([views])["z"], z_joint)
    assert not torch.allclose(z_joint, outputs["z"], atol=1e-3)
