"""Fine-tuning (`python -m transfer finetune`): a run killed (SIGKILL) and stopped (SIGTERM) resumes at the
right step with the hand-computed schedule; the label-fraction subset; layer-wise lr decay read off the
optimizer; --from random vs the export; bad input refused in one line with exit status 2.

The export is written directly in the format of `pretrain.export.export_backbone` (a random ResNet-18 with
the digits pretraining config) instead of pretraining one: the tests check the machinery, not accuracy."""
import json
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.config import load_config
from pretrain.models import create_backbone
from tests.machine_speed import scaled
from tests.conftest import wait_for
from tests.run_helpers import kill_process_tree, logged, run, start

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "configs/transfer/finetune_digits.yaml"
EXPORT_STEP = 42


def write_export(run_dir: Path, digits: Path, seed: int = 1, overrides: Sequence[str] = ()) -> Path:
    """RUN_DIR/backbone.pth as `export_backbone` writes it: {arch, stem, state_dict, config, epoch, step}, of
    simclr_digits.yaml with `overrides` (e.g. the small ResNet of tests/engine_helpers.py)."""
    cfg = load_config(ROOT / "configs/pretrain/simclr_digits.yaml",
                      [f"data.train={digits / 'train.beton'}", f"data.val={digits / 'val.beton'}", *overrides])
    torch.manual_seed(seed)
    backbone = create_backbone(cfg.model.arch, cfg.model.stem, cfg.data.views[0].size, cfg.model.zero_init_residual)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"arch": cfg.model.arch, "stem": cfg.model.stem, "state_dict": backbone.state_dict(),
                "config": OmegaConf.to_container(cfg, resolve=True), "epoch": 3, "step": EXPORT_STEP},
               run_dir / "backbone.pth")
    return run_dir / "backbone.pth"


def finetune_command(run_dir: Path, *overrides: str, start: str = "export") -> list[str]:
    return [sys.executable, "-m", "transfer", "finetune", "--run", str(run_dir), "--config", str(CONFIG),
            "--from", start, *overrides]


def hand_computed_lr(step: int) -> float:
    """finetune_digits: lr 0.2 per 256 images at batch 16 -> 0.0125; 10% of the 1437 digits is 14 per class,
    140 images, 140 // 16 = 8 steps per epoch, 2 epochs = 16 steps; warm-up 1 epoch = 8 steps linear from 0,
    then half a cosine to 0."""
    peak, warmup, total = 0.2 * 16 / 256, 8, 16
    if step < warmup:
        return peak * step / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.slow
def test_killed_then_stopped_run_resumes_at_the_right_step(digits, tmp_path):
    """SIGKILL after the first checkpoint (a crash), SIGTERM during the resumed run (a scheduler's stop: the step
    finishes, a checkpoint is saved, exit 128 + 15), then the same command completes the run: every step is
    logged once, with the lr of the schedule, and the result reaches RUN_DIR/eval and RUN_DIR/tb."""
    run_dir = tmp_path / "run"
    write_export(run_dir, digits)
    common = ("data.batch_size=16", "optim.epochs=2", "engine.checkpoint_every_steps=2", "data.num_workers=1",
              "engine.log_every_steps=1")
    finetune_dir = run_dir / f"finetune/digits_10pct_export_step{EXPORT_STEP:07d}"
    latest = finetune_dir / "checkpoints/latest"

    first = start(finetune_command(run_dir, *common))      # forked from a server that imported torch: fast start
    wait_for(latest.exists, first)
    kill_process_tree(first.pid)
    first.wait(timeout=scaled(60))
    killed_at = int(latest.read_text().strip().removeprefix("step"))
    assert killed_at % 2 == 0 and 2 <= killed_at < 16

    second = start(finetune_command(run_dir, *common))
    wait_for(lambda: int(latest.read_text().strip().removeprefix("step")) > killed_at, second)
    second.send_signal(signal.SIGTERM)
    second.wait(timeout=scaled(120))
    assert second.returncode == 128 + signal.SIGTERM, second.stderr[-2000:]
    assert f"resumed {finetune_dir} at step {killed_at} " in second.stdout
    stopped_at = int(latest.read_text().strip().removeprefix("step"))
    assert f"stopped on a signal after step {stopped_at}" in second.stderr
    assert killed_at < stopped_at < 16

    third = run(finetune_command(run_dir, *common))
    assert f"at step {stopped_at} " in third.stdout

    lines = logged(finetune_dir)
    assert [line["step"] for line in lines] == list(range(1, 17))            # each step once, none lost
    for line in lines:
        assert line["train/lr"] == pytest.approx(hand_computed_lr(line["step"] - 1), rel=1e-9, abs=1e-12)
        assert math.isfinite(line["train/loss"])
    assert [line["step"] for line in lines if "val/top1" in line] == [8, 16]   # every epoch end
    events = EventAccumulator(str(finetune_dir / "tb")).Reload()
    assert [e.step for e in events.Scalars("train/lr")] == list(range(1, 17))

    # The subset the run trained on: saved, class-balanced, reused by the resumed runs.
    subset = json.loads((finetune_dir / "label_subset.json").read_text())
    assert subset["images_per_class"] == [14] * 10 and len(subset["indices"]) == 140

    result = json.loads((run_dir / f"eval/finetune_10pct_export_step{EXPORT_STEP:07d}.json").read_text())
    assert [e["epoch"] for e in result["evaluations"]] == [1, 2]
    assert result["top1"] == result["evaluations"][-1]["top1"] == lines[-1]["val/top1"]
    assert 0 <= result["top1"] <= result["top5"] <= 1 and result["num_train"] == 140 and result["num_val"] == 360
    scalars = EventAccumulator(str(run_dir / "tb")).Reload()
    top1 = scalars.Scalars("eval/finetune_10pct_export_top1")
    assert [(e.step, e.value) for e in top1] == [(EXPORT_STEP, pytest.approx(result["top1"]))]

    # The finished run with another recipe: refused by name, nothing trained or rewritten (it used to resume the
    # finished run, train nothing and report its accuracy under the new settings).
    other = run(finetune_command(run_dir, *common, "optim.lr=0.4"), expect=2)
    assert "optim.lr=0.2 -> 0.4" in other.stderr and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert json.loads((run_dir / f"eval/finetune_10pct_export_step{EXPORT_STEP:07d}.json").read_text()) == result


def test_label_fraction_subset_is_class_balanced_and_seeded(tmp_path):
    from pretrain.config import ConfigError
    from transfer.label_fraction import class_balanced_subset, label_subset_for_run

    labels = np.repeat(np.arange(4), [50, 80, 120, 150])          # unbalanced: 400 images, 4 classes
    subset = class_balanced_subset(labels, 0.1, seed=0)
    assert np.bincount(labels[subset]).tolist() == [10, 10, 10, 10]   # round(0.1 * 400 / 4) from every class
    assert len(np.unique(subset)) == len(subset)
    assert np.array_equal(subset, class_balanced_subset(labels, 0.1, seed=0))
    assert not np.array_equal(subset, class_balanced_subset(labels, 0.1, seed=1))
    assert np.bincount(labels[class_balanced_subset(labels, 0.01, seed=0)]).tolist() == [1, 1, 1, 1]
    assert np.array_equal(class_balanced_subset(labels, 1.0, seed=0), np.arange(400))
    few = np.repeat(np.arange(3), [2, 40, 40])                       # a class smaller than its share: all of it
    assert np.bincount(few[class_balanced_subset(few, 0.5, seed=0)]).tolist() == [2, 14, 14]

    # Saved with the run and reused; a resumed run with another fraction or seed is refused.
    saved = label_subset_for_run(tmp_path, labels, 0.1, 0, write=True)
    assert np.array_equal(saved, subset)
    assert np.array_equal(label_subset_for_run(tmp_path, labels, 0.1, 0, write=False), subset)
    with pytest.raises(ConfigError, match="fraction was 0.1 and is now 0.01"):
        label_subset_for_run(tmp_path, labels, 0.01, 0, write=False)
    with pytest.raises(ConfigError, match="seed was 0 and is now 5"):
        label_subset_for_run(tmp_path, labels, 0.1, 5, write=False)


def lr_by_parameter(model, layer_decay: float, lr: float = 1.0) -> dict[str, float]:
    """Each parameter's lr in the optimizer built as the fine-tuning builds it, after one schedule update."""
    from pretrain.runtime.optim import build_optimizer, set_schedule_values
    from transfer.classifier import layer_decay_param_groups
    from transfer.finetune.config import load_finetune_config

    cfg = load_finetune_config(CONFIG, [f"optim.layer_decay={layer_decay}"])
    optimizer = build_optimizer(cfg, layer_decay_param_groups(model, cfg.optim.layer_decay), lr)
    set_schedule_values(optimizer, lr, 1e-4, lr)
    name_of = {id(p): name for name, p in model.named_parameters()}
    lrs = {name_of[id(p)]: group["lr"] for group in optimizer.param_groups for p in group["params"]}
    assert sorted(lrs) == sorted(name_of.values())                  # every parameter in exactly one group
    skip = model.backbone.no_weight_decay() if hasattr(model.backbone, "no_weight_decay") else set()
    for group in optimizer.param_groups:          # no weight decay on biases, norms and e.g. ViT's pos_embed
        names = [name_of[id(p)] for p in group["params"]]
        plain = [p.ndim > 1 and name_of[id(p)].removeprefix("backbone.") not in skip for p in group["params"]]
        assert group["weight_decay"] == (1e-4 if all(plain) else 0.0) and (all(plain) or not any(plain)), names
    return lrs


def test_layer_decay_gives_the_promised_lr_ratios():
    from transfer.classifier import Classifier

    d = 0.5
    resnet = Classifier(create_backbone("resnet18", "small_stride2"), 10)
    lrs = lr_by_parameter(resnet, d)
    stage = {"conv1": 5, "bn1": 5, "layer1": 4, "layer2": 3, "layer3": 2, "layer4": 1}   # head: d ** 0
    for name, lr in lrs.items():
        part = name.split(".")[1] if name.startswith("backbone.") else "head"
        assert lr == pytest.approx(d ** stage.get(part, 0), rel=1e-12), name
    assert lrs["head.weight"] == 1.0 and lrs["backbone.layer1.0.conv1.weight"] == d ** 4

    vit = Classifier(create_backbone("vit_tiny_patch16_224", image_size=32), 10)      # 12 blocks
    lrs = lr_by_parameter(vit, d)
    for name, lr in lrs.items():
        inner = name.removeprefix("backbone.")
        if inner.startswith("blocks."):
            expected = d ** (12 - int(inner.split(".")[1]))           # last block d, first block d^12
        elif inner.startswith(("cls_token", "pos_embed", "patch_embed")):
            expected = d ** 13
        elif inner.startswith("norm."):
            expected = d                                               # with the last block (timm's grouping)
        else:
            expected = 1.0                                             # the head
        assert lr == pytest.approx(expected, rel=1e-12), name
    assert lr_by_parameter(vit, 1.0) == {name: 1.0 for name in lrs}    # no decay: one lr everywhere


def layer_decayed_step_errors() -> dict[str, float]:
    """Worker (a process of its own, with its own process group): per ZeRO stage, the largest difference between
    the update of one real fine-tuning step (DeepSpeed engine with the loop's config, layer-decay groups) and the
    hand-computed one, lr x layer_decay ** depth x the plain-torch gradient, over every parameter."""
    import copy

    import deepspeed
    import torch.nn.functional as F

    from pretrain.runtime.distributed import init_distributed
    from pretrain.runtime.loop import initialize_engine
    from pretrain.runtime.optim import build_optimizer, set_schedule_values
    from pretrain.runtime.stage import LoopOptions
    from transfer.classifier import Classifier, layer_decay_param_groups
    from transfer.finetune.config import load_finetune_config

    init_distributed()
    depth = {"conv1": 5, "bn1": 5, "layer1": 4, "layer2": 3, "layer3": 2, "layer4": 1}
    errors = {}
    for stage in (0, 2, 3):
        cfg = load_finetune_config(CONFIG, [f"engine.zero_stage={stage}", "optim.momentum=0", "optim.weight_decay=0",
                                            "optim.layer_decay=0.5", "data.batch_size=4"])
        torch.manual_seed(0)
        model = Classifier(create_backbone("resnet18", "small_stride2", 16, False), 10)
        reference = copy.deepcopy(model)
        optimizer = build_optimizer(cfg, layer_decay_param_groups(model, cfg.optim.layer_decay), 0.1)
        engine, optimizer, _ = initialize_engine(model, optimizer, LoopOptions.from_config(cfg))
        set_schedule_values(optimizer, 0.1, 0.0, 0.1, 0)
        images, labels = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.arange(4)
        engine.backward(F.cross_entropy(engine(images), labels))
        engine.step()
        F.cross_entropy(reference(images), labels).backward()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            stepped = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        worst = 0.0
        for name, p in reference.named_parameters():
            part = name.split(".")[1] if name.startswith("backbone.") else "head"
            expected = p.detach() - 0.1 * 0.5 ** depth.get(part, 0) * p.grad
            worst = max(worst, (stepped[name] - expected).abs().max().item())
        errors[str(stage)] = worst
    return errors


def write_layer_decayed_step_errors(path: str) -> None:
    Path(path).write_text(json.dumps(layer_decayed_step_errors()))


@pytest.mark.slow
def test_a_real_step_under_zero_0_2_3_takes_the_layer_decayed_sgd_step(tmp_path):
    """Through DeepSpeed, not just the optimizer's groups; also catches DeepSpeed's default clipping at norm 1.0
    (the gradient norm here is about 100), which optim.grad_clip=0 must turn off. The worker runs in a process
    forked from the test server that has imported torch and DeepSpeed (tests/forked_runs.py)."""
    from tests.forked_runs import context

    worker = context().Process(target=write_layer_decayed_step_errors, args=(str(tmp_path / "errors.json"),))
    worker.start()
    worker.join(300)
    assert worker.exitcode == 0
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert set(errors) == {"0", "2", "3"}
    for stage, error in errors.items():
        assert error < 1e-6, (stage, error)


def test_from_random_starts_from_random_weights_and_the_default_from_the_export(digits, tmp_path):
    from eval.features import load_backbone_export
    from transfer.classifier import build_classifier

    export = load_backbone_export(write_export(tmp_path, digits, seed=1))
    exported = torch.load(tmp_path / "backbone.pth", weights_only=True)["state_dict"]
    pretrained = build_classifier(export, "export", 10, seed=0)
    random_init = build_classifier(export, "random", 10, seed=0)
    for name, tensor in exported.items():
        assert torch.equal(pretrained.backbone.state_dict()[name], tensor), name
    assert not torch.equal(random_init.backbone.conv1.weight, exported["conv1.weight"])
    assert not torch.equal(random_init.backbone.layer4[1].conv2.weight, exported["layer4.1.conv2.weight"])
    torch.manual_seed(0)                                               # the same init rule, the run's seed
    fresh = create_backbone("resnet18", "small_stride2", 16, False)
    assert torch.equal(random_init.backbone.conv1.weight, fresh.conv1.weight)
    assert torch.equal(pretrained.head.weight, random_init.head.weight)   # the same new head either way
    assert random_init.head.weight.std() < 0.02 and not random_init.head.bias.any()


def test_top1_and_top5_equal_a_brute_force_count():
    from transfer.finetune.stage import evaluate

    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(6, 8)
    features, labels = torch.randn(50, 6, generator=generator), torch.randint(0, 8, (50,), generator=generator)
    batches = [(features[i:i + 16], labels[i:i + 16], torch.arange(i, min(i + 16, 50))) for i in range(0, 50, 16)]
    top1, top5 = evaluate(model, batches, bf16=False)
    logits = model(features).detach().numpy()
    rank_of_label = [(logits[i] > logits[i, labels[i]]).sum() for i in range(50)]   # classes scored above it
    assert top1 == sum(rank < 1 for rank in rank_of_label) / 50
    assert top5 == sum(rank < 5 for rank in rank_of_label) / 50
    assert 0 < top1 < top5 < 1 and model.training


def write_image_folder(root: Path, classes: list[str]) -> Path:
    from PIL import Image

    for label, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (40 * label, 10 * i, 0)).save(root / name / f"{i}.png")
    return root


def test_bad_input_is_refused_in_one_line_with_status_2(digits, tmp_path, capsys):
    from transfer.__main__ import build_parser, main

    run_dir = tmp_path / "run"
    write_export(run_dir, digits)
    base = ["finetune", "--run", str(run_dir), "--config", str(CONFIG)]

    def refused(argv: list[str], expected: str) -> None:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err                         # one line, no traceback
        assert expected in err, err

    refused(["finetune", "--run", str(tmp_path / "nowhere")], "no such run directory")
    (tmp_path / "empty").mkdir()
    refused(["finetune", "--run", str(tmp_path / "empty")], "no backbone export at")
    refused(base + ["optim.layer_decy=0.5"], "did you mean 'optim.layer_decay'")
    refused(base + ["data.label_fraction=150%"], "data.label_fraction='150%' is not a share of the labels")
    refused(base + ["data.label_fraction=ten"], "data.label_fraction='ten' is not a share of the labels")
    refused(base + ["data.label_fraction=0%"], "give a percentage in (0%, 100%]")
    refused(base + ["optim.layer_decay=0"], "optim.layer_decay=0.0 must lie in (0, 1]")
    refused(base + ["mixup.mixup_alpha=0.8", "data.batch_size=15"], "data.batch_size=15 is odd")
    refused(base + ["augment.randaugment=rand-x9"], "augment.randaugment='rand-x9' is not a timm RandAugment")
    refused(base + ["augment.scale=[0.9,0.2]"], "augment.scale must satisfy 0 < min <= max <= 1")
    refused(base + [f"data.val={tmp_path / 'missing'}"], "data.val=")
    train = write_image_folder(tmp_path / "train", ["a", "b"])
    val = write_image_folder(tmp_path / "val", ["a", "b", "c"])
    refused(base + [f"data.train={train}", f"data.val={val}"],
            "the training and validation data have different classes")
    # refused while building the data, after the run directory was made: it is removed again (label_subset.json
    # and checkpoints/ used to stay behind)
    refused(base + ["data.label_fraction=1e-9"], "give fewer than optim.grad_accum=1 batches")
    assert not (run_dir / "finetune").exists()                         # nothing was started

    finetune = next(action for action in build_parser()._actions if action.dest == "command").choices["finetune"]
    for action in finetune._actions:
        assert action.help, action.dest                               # --help explains every option


@pytest.mark.slow
def test_a_vit_fine_tunes_at_another_image_size_than_it_was_pretrained_at(digits, tmp_path):
    """A ViT exported at 32 px (a 2 x 2 patch grid) fine-tuned at 48 px (3 x 3): timm's dynamic_img_size
    interpolates the position embedding at every forward (as DINOv2 does; MAE interpolates it once), so the first
    step runs and the export's position embedding is what is trained on."""
    cfg = load_config(ROOT / "configs/pretrain/simclr_digits.yaml",
                      [f"data.train={digits / 'train.beton'}", f"data.val={digits / 'val.beton'}",
                       "model.arch=vit_tiny_patch16_224", "model.stem=imagenet", "data.views.0.size=32"])
    torch.manual_seed(0)
    backbone = create_backbone(cfg.model.arch, cfg.model.stem, 32)
    run_dir = tmp_path / "vit"
    run_dir.mkdir()
    torch.save({"arch": cfg.model.arch, "stem": cfg.model.stem, "state_dict": backbone.state_dict(),
                "config": OmegaConf.to_container(cfg, resolve=True), "epoch": 3, "step": EXPORT_STEP},
               run_dir / "backbone.pth")
    run(finetune_command(run_dir, "data.image_size=48", "optim.epochs=1", "engine.max_steps=2",
                         "data.label_fraction=10%"))
    result = json.loads(next((run_dir / "eval").glob("finetune_*.json")).read_text())
    assert result["image_size"] == 48 and 0.0 <= result["top1"] <= 1.0
