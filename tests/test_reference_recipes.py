"""Where a method's recipe follows its reference code: weight decay (SimSiam), the projector's end (SimCLR), gradient
clipping (DINO), the residual branches' init and the projector's hidden layers (every method), the presets' values
and the sources their headers name. The gradient edits themselves are tested through DeepSpeed in
tests/test_gradient_edits.py."""
import pytest
import torch
from torch import nn

from pretrain.config import load_config
from pretrain.methods import build_method
from pretrain.models import ScaleOnlyBatchNorm1d, backbone_from_config
from pretrain.runtime.optim import build_optimizer, set_schedule_values
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


# Each method's reference: whether its ResNet zero-initialises the last BatchNorm of every residual branch, and whether
# its projector's hidden layers have a BatchNorm (None: the method's head is not model.proj_*'s MLP).
REFERENCE_MODEL = {
    "simclr": (True, True),               # google-research/simclr resnet.py:395, :480; model_util.py:162-165
    "simsiam": (True, True),              # facebookresearch/simsiam simsiam/builder.py:24, :28-33
    "dino": (False, None),                # facebookresearch/dino main_dino.py:176 (torchvision's default)
    "supcon": (False, False),             # HobbitLong/SupContrast networks/resnet_big.py:76, :170, :174-178
    "tcl": (False, False),                # chaitanyaanimesh/Tuned-Contrastive-Learning, its
                                          # models/resnet_big_pretrained_cifar.py:77, :113
    "contrastive_balance": (False, True),  # paper 000: no code, no head named
    "weighted_contrastive": (False, True),  # paper 001: an ImageNet-pretrained backbone, one linear layer
    "smoco": (False, True),               # paper 002: the same
}


def residual_branch_last_norms(backbone: nn.Module) -> list[nn.BatchNorm2d]:
    """The BatchNorm that ends each residual branch of a timm ResNet (bn2 of a BasicBlock, bn3 of a Bottleneck)."""
    from timm.models.resnet import BasicBlock, Bottleneck

    return [m.bn2 if isinstance(m, BasicBlock) else m.bn3 for m in backbone.modules()
            if isinstance(m, (BasicBlock, Bottleneck))]


@pytest.mark.parametrize("name", sorted(REFERENCE_MODEL))
def test_each_method_builds_its_references_residual_init_and_projector_by_default(name):
    """model.zero_init_residual and model.proj_hidden_bn left out take the method's reference value; the built
    backbone's last BatchNorm of every residual branch is zero exactly then, and the other value is one key away."""
    from pretrain.methods import method_module

    zero_init, hidden_bn = REFERENCE_MODEL[name]
    config = CONFIGS / f"{name}_digits.yaml"
    cfg = load_config(config, [*TINY, "model.zero_init_residual=null"])       # left out (a digits preset sets it)
    assert cfg.model.zero_init_residual is zero_init and cfg.model.proj_hidden_bn is hidden_bn
    assert method_module(name).METHOD.reference_model.get("proj_hidden_bn") is hidden_bn
    for value in (zero_init, not zero_init):
        norms = residual_branch_last_norms(backbone_from_config(load_config(config, [
            *TINY, f"model.zero_init_residual={str(value).lower()}"])))
        assert len(norms) == 8 and all(bool((norm.weight == 0).all()) is value for norm in norms)
    if hidden_bn is None:
        return
    projector = build_method(load_config(config, [*TINY, "model.proj_layers=2"])).projector   # one hidden layer
    assert any(isinstance(layer, nn.BatchNorm1d) for layer in projector[:-1]) is hidden_bn


def test_bottleneck_resnets_zero_initialise_their_third_batchnorm():
    norms = residual_branch_last_norms(backbone_from_config(load_config(CONFIGS / "simsiam_imagenet_folder.yaml")))
    assert len(norms) == 16 and all(bool((norm.weight == 0).all()) for norm in norms)


@pytest.mark.parametrize("config", sorted(path.name for path in CONFIGS.glob("*.yaml")))
def test_every_preset_keeps_its_methods_residual_init(config):
    """No preset departs from its method's reference in model.zero_init_residual (the SimSiam configs and the SimCLR
    CIFAR preset used to start every residual branch at weight 1), unless it sets the key itself beside the
    measurement that made it depart (the digits presets: a comment saying "measured")."""
    import re

    from pretrain.methods import method_module

    cfg = load_config(CONFIGS / config)
    if cfg.model.zero_init_residual is method_module(cfg.method.name).METHOD.reference_model["zero_init_residual"]:
        return
    text = (CONFIGS / config).read_text()
    block = re.search(r"((?:\n  #[^\n]*)+)\n  zero_init_residual: (true|false)\n", text)
    assert block and "measured" in block.group(1), f"{config} departs from its method's reference without a measurement"


@pytest.mark.parametrize("config", ["supcon_cifar_folder.yaml", "tcl_cifar_folder.yaml", "supcon_digits.yaml",
                                    "tcl_digits.yaml"])
def test_supcon_and_tcl_project_through_supcontrasts_head_and_views(config):
    """SupContrast's SupConResNet head is Linear-ReLU-Linear with biases and no BatchNorm (networks/resnet_big.py:
    174-178; the TCL code's too); model.proj_hidden_bn=true is the Linear(no bias)-BN-ReLU-Linear head of before. The
    CIFAR presets draw SupContrast's views: RandomResizedCrop scale 0.2-1, ColorJitter(0.4, 0.4, 0.4, 0.1) with p 0.8,
    grayscale 0.2 (main_supcon.py:147-152)."""
    cfg = load_config(CONFIGS / config, TINY)
    torch.manual_seed(0)
    projector = build_method(cfg).projector
    assert [type(layer) for layer in projector] == [nn.Linear, nn.ReLU, nn.Linear]
    assert all(layer.bias is not None for layer in projector if isinstance(layer, nn.Linear))
    x = torch.randn(5, projector[0].in_features)
    torch.testing.assert_close(projector(x), projector[2](torch.relu(projector[0](x))))
    with_bn = build_method(load_config(CONFIGS / config, [*TINY, "model.proj_hidden_bn=true"])).projector
    assert [type(layer) for layer in with_bn] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    if "cifar" in config:
        group = cfg.data.views[0]
        assert tuple(group.scale) == (0.2, 1.0) and group.jitter_p == 0.8 and group.grayscale_p == 0.2
        assert (group.brightness, group.contrast, group.saturation, group.hue) == (0.4, 0.4, 0.4, 0.1)


def test_the_simclr_cifar_preset_holds_google_research_simclrs_cifar_command():
    """README.md: run.py --train_batch_size=512 --train_epochs=1000 --learning_rate=1.0 --weight_decay=1e-4
    --temperature=0.5 --resnet_depth=18 --use_blur=False --color_jitter_strength=0.5, with run.py's defaults for
    the rest (LARS, momentum 0.9, 10 warm-up epochs, linear lr scaling, num_proj_layers 3 of the backbone's width,
    proj_out_dim 128); strength s: brightness, contrast, saturation 0.8 s, hue 0.2 s (data_util.py:74-77); NT-Xent's two
    directions summed (objective.py:86), where the ImageNet preset's reference (automl/hvp) averages them."""
    cfg = load_config(CONFIGS / "simclr_cifar_folder.yaml")
    assert cfg.method.directions == "sum"
    assert load_config(CONFIGS / "simclr_imagenet_folder.yaml").method.directions == "mean"
    o, group, m = cfg.optim, cfg.data.views[0], cfg.model
    assert (cfg.data.batch_size, o.epochs, o.lr, o.lr_scaling, o.weight_decay) == (512, 1000, 1.0, "linear", 1e-4)
    assert (o.name, o.momentum, o.warmup_epochs, cfg.method.temperature) == ("lars", 0.9, 10, 0.5)
    strength = 0.5
    assert (group.brightness, group.contrast, group.saturation, group.hue) == pytest.approx(
        (0.8 * strength, 0.8 * strength, 0.8 * strength, 0.2 * strength))
    assert group.blur_p == 0 and tuple(group.scale) == (0.08, 1.0) and group.interpolation == "bicubic"
    assert (m.arch, m.stem, m.proj_layers, m.proj_hidden_dim, m.proj_out_dim) == ("resnet18", "small", 3, 512, 128)
    assert m.zero_init_residual and m.proj_hidden_bn and m.proj_last_bn == "bn_scale"


@pytest.mark.parametrize("config", sorted(path.name for path in CONFIGS.glob("dino_*.yaml")))
def test_dino_presets_resize_their_crops_bicubically(config):
    """DataAugmentationDINO resizes every crop with interpolation=Image.BICUBIC (main_dino.py:436, :443, :452)."""
    assert all(group.interpolation == "bicubic" for group in load_config(CONFIGS / config).data.views)


PRESETS = sorted([*CONFIGS.glob("*.yaml"), *(CONFIGS.parent / "transfer").glob("*.yaml")])


@pytest.mark.parametrize("path", PRESETS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_preset_names_its_source_and_has_a_row_in_the_preset_table(path):
    """The header (the leading comment block) names the source whose values the preset holds, on one `# Source:`
    line; docs/configuration.md's table of presets has its row (configs/transfer ones as `transfer/NAME`), which says
    where the preset departs from that source."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    sources = [line for line in header if line.startswith("# Source: ")]
    assert len(sources) == 1, f"{path}: its header needs one '# Source: ...' line naming the paper or code it follows"
    assert len(sources[0].split()) >= 5, sources[0]
    docs = (CONFIGS.parents[1] / "docs" / "configuration.md").read_text()
    table = docs[docs.index("**Presets and their sources**"):docs.index("Any key can be overridden")]
    name = path.name if path.parent == CONFIGS else f"transfer/{path.name}"
    assert f"`{name}`" in table, f"docs/configuration.md's preset table has no row for {name}"


@pytest.mark.parametrize("config, reference", [("simclr_digits.yaml", False), ("simsiam_digits.yaml", True),
                                               ("dino_digits.yaml", False), ("supcon_digits.yaml", True),
                                               ("tcl_digits.yaml", True)])
def test_biases_and_normalisation_are_decayed_as_in_the_methods_reference(config, reference):
    """SupContrast (and the TCL code on it) and facebookresearch/simsiam pass every parameter to SGD with the weight
    decay; google-research/simclr and DINO exclude biases and BatchNorm. `optim.decay_norm_and_bias` gives the other
    behaviour one key away; SupCon and TCL used to exclude them."""
    def decays(overrides=()) -> tuple[bool, bool]:
        cfg = load_config(CONFIGS / config, [*TINY, *overrides])
        optimizer = build_optimizer(cfg, build_method(cfg).param_groups(), 0.1)
        set_schedule_values(optimizer, lr=0.1, weight_decay=1e-4, base_lr=0.1, step=0)
        one_d = [group["weight_decay"] for group in optimizer.param_groups for p in group["params"] if p.ndim == 1]
        return cfg.optim.decay_norm_and_bias, all(wd == 1e-4 for wd in one_d) and bool(one_d)

    assert decays() == (reference, reference)
    assert decays([f"optim.decay_norm_and_bias={str(not reference).lower()}"]) == (not reference, not reference)


@pytest.mark.parametrize("config", sorted(path.name for path in CONFIGS.glob("*_cifar_folder.yaml")))
def test_the_cifar_presets_write_their_32_px_images_raw_not_as_jpeg(config):
    """The references read CIFAR's pixels as they are; a JPEG of a 32 px image (the writer's default, quality 90)
    subsamples its colour to 16 px. Every CIFAR preset's write commands say --write-mode raw, for train and val."""
    writes = [line for line in (CONFIGS / config).read_text().splitlines() if "python -m pretrain.data write " in line]
    assert len(writes) == 2 and all(line.rstrip().endswith("--write-mode raw") for line in writes), writes


@pytest.mark.parametrize("config", sorted(path.name for path in CONFIGS.glob("*_imagenet_folder.yaml")))
def test_the_imagenet_presets_keep_imagenets_typical_images_at_their_own_size(config):
    """The presets said --max-side 320: 61-81% of DINO's 224 px global views were then upsampled from fewer
    stored pixels than they have, where 512 px keeps ImageNet's typical (~400 x 350) images whole at 1.7-2.4 host
    cores per GPU (`python -m pretrain.bench storage`, docs/benchmarks.md). Every ImageNet preset writes at 512."""
    writes = [line for line in (CONFIGS / config).read_text().splitlines() if "python -m pretrain.data write " in line]
    assert len(writes) == 1 and writes[0].rstrip().endswith("--max-side 512"), writes
