"""The benchmark commands of the README run, tiny: their tables print and their JSON is written (their
numbers are measured by running them, never asserted here)."""
import json
from pathlib import Path

import pytest
import torch

from tests import forked_runs
from tests.engine_helpers import SMALL_RESNET

pytestmark = pytest.mark.slow          # every benchmark command, tiny

ROOT = Path(__file__).parents[1]


def test_bench_commands_run_and_write_their_tables(tmp_path):
    # `python -m pretrain.bench ...`, forked from a server that imported torch (tests/forked_runs.py)
    forked_runs.run("pretrain.bench", ["loader", "--images", "64", "--batch-size", "16", "--workers", "1", "--epochs",
                                       "1", "--views", "2", "--data-dir", tmp_path / "data", "--out",
                                       tmp_path / "loader.json"])
    assert json.loads((tmp_path / "loader.json").read_text())
    forked_runs.run("pretrain.bench", ["hvs", "--batch-size", "8", "--steps", "1", "--warmup", "1", "--override",
                                       *SMALL_RESNET, "--out", tmp_path / "hvs.json"])
    result = json.loads((tmp_path / "hvs.json").read_text())
    assert len(result["rows"]) == 6 and result["overrides"] == SMALL_RESNET
    precision = forked_runs.run("pretrain.bench", ["precision", "--batch-size", "2", "--size", "8", "--rounds", "2",
                                                   "--arch", "test_resnet", "--stem", "imagenet",
                                                   "--out", tmp_path / "precision.json"])
    result = json.loads((tmp_path / "precision.json").read_text())
    assert result["rounds"] == 2 and result["fp32_step_s"]["min"] > 0 and result["bf16_over_fp32"]["median"] > 0
    assert "bf16 / fp32 step time, per round: median" in precision.stdout and "test_resnet (imagenet stem)" in precision.stdout
    workers = forked_runs.run("pretrain.bench", ["workers", "--images", "20", "--workers", "1", "--batch-size", "8",
                                                 "--rounds", "1", "--data-dir", tmp_path / "data",
                                                 "--out", tmp_path / "workers.json"])
    result = json.loads((tmp_path / "workers.json").read_text())
    assert set(result["epoch_s"]) == {"fork", "forkserver"} and result["forkserver_over_fork"]["median"] > 0
    assert "forkserver / fork, per round: median" in workers.stdout



def test_bench_storage_cuts_the_same_crops_from_every_stored_form(tmp_path):
    """`bench storage` compares each stored form's views with the same crops of the folder's JPEGs: raw pixels at
    the folder's own size must give identical views (the boxes line up, the padded canvas's extent is honoured),
    and a 96 px store finite PSNRs with more of its 224 px views upsampled."""
    forked_runs.run("pretrain.bench", ["storage", "--photos", "generated", "--images", "8", "--batch-size", "4",
                                       "--workers", "1", "--epochs", "1", "--rounds", "1", "--views-per-group", "2",
                                       "--stores", "0:raw", "96:90", "--data-dir", tmp_path / "data",
                                       "--out", tmp_path / "storage.json"])
    raw, small = json.loads((tmp_path / "storage.json").read_text())["rows"]
    assert [raw["store"], small["store"]] == ["0:raw", "96:90"] and raw["bytes_per_image"] > small["bytes_per_image"]
    assert len(raw["views"]) == 2 and all(v["views"] == 16 for v in raw["views"].values())     # 224 and 96 px views
    for group, views in raw["views"].items():
        assert views["psnr_db_median"] is None and views["psnr_db_p10"] is None, group      # None: identical
        assert small["views"][group]["psnr_db_p10"] is not None
    assert small["views"]["224 px, scale 0.4-1.0"]["upsampled_share"] == 1.0
    assert raw["views"]["224 px, scale 0.4-1.0"]["upsampled_share"] < 1.0
    assert raw["host_ms_per_image"]["median"] > 0

def test_the_train_benchmarks_overrides_reach_every_table_it_times():
    """`train --override engine.precision=bf16` used to reach the images/s table only: the split by phase, the
    2-process and the contention rows timed the split case without it (fp32), under the same heading."""
    from pretrain.bench import build_parser
    from pretrain.bench.train import selected_cases, split_case

    args = build_parser().parse_args(["train", "--only", "simclr", "--override", "engine.precision=bf16",
                                      "--split-case", "dino HVS"])
    assert selected_cases(args) == [
        ("simclr", "configs/pretrain/simclr_fashion_mnist.yaml", ["engine.precision=bf16"]),
        ("simclr HVS", "configs/pretrain/simclr_fashion_mnist.yaml", ["hvs.enabled=true", "engine.precision=bf16"])]
    assert split_case(args) == ("dino HVS", "configs/pretrain/dino_fashion_mnist.yaml",
                                ["hvs.enabled=true", "engine.precision=bf16"])


@pytest.mark.parametrize("option, value", [("--images", "0"), ("--batch-size", "-1"), ("--epochs", "0"),
                                           ("--views", "0"), ("--workers", "0")])
def test_counts_that_cannot_be_measured_are_refused_by_argparse(capsys, option, value):
    """--images 0, --batch-size -1 and --epochs 0 used to end in tracebacks, --views 0 in a result of 0.0 images/s."""
    from pretrain.bench import main

    with pytest.raises(SystemExit) as refused:
        main(["loader", option, value])
    assert refused.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {option}: " in error and "positive" in error


def test_fewer_images_than_a_batch_is_refused_not_timed_as_zero(capsys):
    from pretrain.bench import main

    with pytest.raises(SystemExit) as refused:
        main(["loader", "--images", "10", "--batch-size", "256"])
    assert refused.value.code == 2 and "--images 10 is fewer than --batch-size 256" in capsys.readouterr().err


def test_peers_reads_back_a_finished_run_only_when_it_trained_the_same_recipe(tmp_path):
    """A finished run left in --work-dir by another revision or other flags would be reported as this one: its
    settings (config.yaml as the run wrote it: lists where the composed config has tuples) must equal the run the
    command would make."""
    import yaml
    from omegaconf import OmegaConf

    from pretrain.bench.peers import RECIPES, check_same_recipe
    from pretrain.config import load_config

    config, recipe = RECIPES["simsiam"]
    cfg = load_config(config, [*recipe, "seed=1", f"run_dir={tmp_path}"])
    written = yaml.safe_load(OmegaConf.to_yaml(cfg, resolve=True))         # as RUN_DIR/config.yaml holds it
    check_same_recipe(tmp_path, written, cfg)                               # the same run: read back
    older = load_config(config, ["seed=1", f"run_dir={tmp_path}"])          # an older run: the config's 2 layers
    with pytest.raises(SystemExit, match=r"holds a finished run with other settings \(model.proj_layers=2 -> 3\)"):
        check_same_recipe(tmp_path, yaml.safe_load(OmegaConf.to_yaml(older, resolve=True)), cfg)
    other_crops = load_config(config, [*recipe, "seed=1", "data.views.0.scale=[0.2,1.0]", f"run_dir={tmp_path}"])
    with pytest.raises(SystemExit, match=r"data.views=.*'scale': \[0.3, 1.0\].*'scale': \[0.2, 1.0\]"):
        check_same_recipe(tmp_path, written, other_crops)


def test_peers_gives_the_difference_to_the_peer_with_its_interval_and_the_speed_ratio_per_seed():
    from pretrain.bench.peers import difference_table

    def row(library, seed, knn, linear, rate):
        return {"method": "simclr", "library": library, "seed": seed, "epoch": 1, "knn": knn, "linear": linear,
                "images_per_s": rate}
    rows = [row("hardview", 0, 81.0, 85.0, 600), row("lightly 1.6.0", 0, 80.0, 85.5, 500),
            row("hardview", 1, 82.0, 84.0, 660), row("lightly 1.6.0", 1, 80.0, 84.5, 600),
            row("hardview", 2, 80.0, 83.0, 700), row("lightly 1.6.0", 2, 80.0, 83.5, 500)]
    # k-NN differences 1, 2, 0: mean +1.00, std 1, t(0.975, 2) = 4.303 -> +-2.48; linear all -0.5: no spread
    table = difference_table(rows)
    assert "| simclr | 1 | 3 | +1.00 [-1.48, +3.48], p = 0.23 | -0.50 [-0.50, -0.50], p = - | 1.20x (1.10-1.40) |" in table
    one_seed = difference_table(rows[:2])
    assert "+1.00 (one seed: no interval) | -0.50 (one seed: no interval) | 1.20x (1.20-1.20)" in one_seed


def test_peers_scores_an_export_once_and_again_when_the_export_is_newer(tmp_path, monkeypatch):
    """A comparison run again reads back the results of exports already scored; an export written after its
    result (a run trained again) is scored again."""
    import os

    import torch

    from pretrain.bench import peers

    checkpoint = tmp_path / "exports" / "backbone_step00000005.pth"
    checkpoint.parent.mkdir()
    torch.save({"step": 5}, checkpoint)
    (tmp_path / "eval").mkdir()
    scored = []

    def score(command, **_):                      # what `python -m eval PROTOCOL --run ... --checkpoint ...` writes
        protocol = command[3]
        scored.append(protocol)
        top1 = {"20": 0.75} if protocol == "knn" else 0.8
        (tmp_path / "eval" / f"{protocol}_step0000005.json").write_text(json.dumps({"top1": top1}))
    monkeypatch.setattr(peers.subprocess, "run", score)
    assert peers.evaluate(tmp_path, checkpoint) == {"knn": 75.0, "linear": 80.0} and scored == ["knn", "linear"]
    assert peers.evaluate(tmp_path, checkpoint) == {"knn": 75.0, "linear": 80.0} and len(scored) == 2   # read back
    later = checkpoint.stat().st_mtime + 10
    os.utime(checkpoint, (later, later))                                   # trained again after it was scored
    peers.evaluate(tmp_path, checkpoint)
    assert scored == ["knn", "linear", "knn", "linear"]


def project_and_plain_step(config: str, overrides: list[str]) -> dict:
    """From the same weights and batch (`bench train`'s fixed views), one step of the project (`train_step` through
    the DeepSpeed engine, as the loop takes it) and one of `bench train`'s plain loop (`plain_step`): each side's
    loss and every parameter's gradient, read as backward accumulated it (before the optimizer used it)."""
    import copy

    from pretrain.bench.train import fixed_batch, plain_step
    from pretrain.config import load_config
    from pretrain.methods import build_method
    from pretrain.runtime.distributed import init_distributed, release_distributed
    from pretrain.runtime.loop import train_step
    from pretrain.runtime.optim import build_optimizer
    from pretrain.runtime.task import BatchPosition
    from tests.engine_helpers import SMALL_RESNET, engine_for

    cfg = load_config(ROOT / config, [*overrides, "data.batch_size=8", *SMALL_RESNET])
    torch.manual_seed(cfg.seed)
    project = build_method(cfg, 10).train()
    plain = copy.deepcopy(project)

    def capture(method) -> dict:
        gradients = {}
        for name, parameter in method.named_parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(
                    lambda p, name=name: gradients.__setitem__(name, p.grad.detach().clone()))
        return gradients

    batch = fixed_batch(cfg, torch.device("cpu"))
    init_distributed("cpu")
    try:
        project_gradients = capture(project)
        engine, _, gradient_edits = engine_for(cfg, project)
        engine.train()
        project_loss = train_step(engine, project, batch, BatchPosition(cfg.seed, 0, 0, 0),
                                  gradient_edits=gradient_edits).loss
        del engine
    finally:
        release_distributed()
    plain_gradients = capture(plain)
    plain_loss = plain_step(cfg, plain, build_optimizer(cfg, plain.param_groups(), cfg.optim.lr), batch, 0, False)
    return {"losses": (float(project_loss), float(plain_loss)), "gradients": (project_gradients, plain_gradients)}


def cases_of_bench_train() -> list[tuple[str, str, list[str]]]:
    from pretrain.bench.train import cases
    return cases(imagenet=False)


@pytest.mark.parametrize("name, config, overrides", cases_of_bench_train(),
                         ids=[name.replace(" ", "_") for name, _, _ in cases_of_bench_train()])
def test_bench_trains_plain_loop_computes_the_projects_loss_and_gradients(name, config, overrides):
    """`bench train` sets the project's step against a plain loop: a ratio that means something only if both do the
    same work. For every case it times: the same loss and the same gradient of every parameter, on the same batch."""
    result = project_and_plain_step(config, overrides)
    project_loss, plain_loss = result["losses"]
    assert plain_loss == pytest.approx(project_loss, rel=1e-6), name
    project, plain = result["gradients"]
    assert project.keys() == plain.keys() and project, name
    for key, gradient in project.items():
        torch.testing.assert_close(plain[key], gradient, rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_bench_train_alternates_its_rounds_and_quotes_the_median_and_range_of_their_ratios(tmp_path, monkeypatch,
                                                                                           capsys):
    """README's speed ratios once quoted one run's best-of-two (SimCLR 1.06x: the best of five runs between 0.92 and
    1.06): each round now times both sides, the first side alternating, and the ratio is each round's own, quoted as
    median and range. Step times are fabricated here (no timing is measured): project 100, 80, 125 images/s and plain
    110, 100, 100 in rounds 1-3 give ratios 1.1, 1.25, 0.8: median 1.1, range 0.8-1.25, where the ratio of the sides'
    medians would be 1.0 and the best-of (the faster run of each side) 110 / 125 = 0.88."""
    from pretrain.bench import main, train

    rates = {"project": [100.0, 80.0, 125.0], "plain": [110.0, 100.0, 100.0]}
    calls = []

    def fabricated_run(case: dict, processes: int = 1, environ: dict | None = None) -> dict:
        if case.get("count_reads"):                           # the project's run that counts its reads
            return {"seconds": [1.0] * 4, "reads": [135, 0, 1, 0, 290]}
        side = "plain" if case["plain"] else "project"
        calls.append(side)
        step = 10 / rates[side][(calls.count(side) - 1) % 3]  # batch 10 (the override below); round 1-3 of a case
        return {"seconds": [100.0, step, 3 * step, step]}     # the warm-up step, then the median is `step`
    monkeypatch.setattr(train, "case_in_a_process", fabricated_run)
    (tmp_path / "train.beton").touch()                        # the benchmark writes Fashion-MNIST where it is missing
    main(["train", "--only", "simclr", "--steps", "3", "--warmup", "1", "--rounds", "3", "--split-case", "none",
          "--override", "data.batch_size=10", "--data-dir", str(tmp_path), "--out", str(tmp_path / "train.json")])
    assert calls == ["project", "plain", "plain", "project", "project", "plain"] * 2     # simclr, then simclr HVS
    row = json.loads((tmp_path / "train.json").read_text())["rows"][0]
    assert row["plain_over_project"] == pytest.approx({"median": 1.1, "min": 0.8, "max": 1.25})
    assert row["project_images_per_s"] == pytest.approx({"median": 100.0, "min": 80.0, "max": 125.0})
    assert row["plain_images_per_s"] == pytest.approx({"median": 100.0, "min": 100.0, "max": 110.0})
    assert row["reads"] == {"quiet_step_max": 1, "logging_step_max": 0, "per_step": [0, 1, 0, 290]}
    assert row["rounds"] == [{"project": 100.0, "plain": 110.0, "ratio": 1.1, "order": ["project", "plain"]},
                             {"project": 80.0, "plain": 100.0, "ratio": 1.25, "order": ["plain", "project"]},
                             {"project": 125.0, "plain": 100.0, "ratio": 0.8, "order": ["project", "plain"]}]
    table = capsys.readouterr().out
    assert "faster of" not in table and "3 alternating rounds" in table
    assert "plain / project" in table and "1.100   0.800-1.250       3       1 / 0" in table


def test_alternating_rounds_reverse_the_order_of_more_than_two_sides(monkeypatch):
    """--plain-variants times the plain loop as it is and with each variant by the same rounds: A B C, C B A, A B C."""
    from pretrain.bench import train
    from pretrain.config import load_config

    calls = []
    monkeypatch.setattr(train, "timed_in_a_process", lambda case: calls.append(case["variant"]) or [1.0, 0.5])
    cfg = load_config(ROOT / "configs/pretrain/simclr_fashion_mnist.yaml", ["data.batch_size=10"])
    rounds = train.alternating_rounds({"as it is": {"variant": None}, "compile": {"variant": "compile"},
                                       "bf16": {"variant": "bf16"}}, 3, cfg, 1, "simclr")
    assert calls == [None, "compile", "bf16", "bf16", "compile", None, None, "compile", "bf16"]
    assert [r["order"] for r in rounds] == [["as it is", "compile", "bf16"], ["bf16", "compile", "as it is"],
                                            ["as it is", "compile", "bf16"]]
    assert rounds[0]["compile"] == 20.0                       # 10 images / the median of the steps after 1: 0.5 s


def test_bench_train_refuses_zero_rounds_naming_the_option(capsys):
    from pretrain.bench import main

    with pytest.raises(SystemExit) as refused:
        main(["train", "--rounds", "0"])
    assert refused.value.code == 2 and "argument --rounds: 0 is not a positive integer" in capsys.readouterr().err


def test_every_bench_command_and_option_says_what_it_is_in_its_help():
    """`python -m pretrain.bench --help` listed two commands as "==SUPPRESS==" (argparse prints a subcommand's
    SUPPRESS help as text): every command and every option of each has a help text of its own."""
    import argparse

    from pretrain.bench import build_parser

    parser = build_parser()
    assert "SUPPRESS" not in parser.format_help()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    assert set(helps) == set(commands.choices) and all(helps.values()), helps
    for name, command in commands.choices.items():
        for action in command._actions:
            if action.dest != "help":
                assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)


def test_the_gpu_checks_parts_parse_and_its_tests_collect_on_the_cpu(tmp_path, monkeypatch, capsys):
    """`make gpu-check` (pretrain/bench/gpu_check.py) runs on a GPU lease only: its dry run here keeps it from rotting
    in between (a renamed option, a GPU test module that no longer imports), and its parts' time limits fit the
    8 minutes it promises."""
    from pretrain.bench import gpu_check

    assert gpu_check.dry_run(tmp_path) == {"command": "gpu-check", "dry_run": True,
                                           "parts": [name for name, _, _ in gpu_check.parts(tmp_path)]}
    assert capsys.readouterr().out.count(": ok") == 5
    # the step against the plain loop for both of the models: SimCLR R50 (2 batches) and DINO ViT-S/16
    assert [name.split(", ")[1] for name, _, _ in gpu_check.parts(tmp_path) if name.startswith("project step")] == [
        "SimCLR R50 224 px", "SimCLR R50 224 px", "DINO ViT-S/16 2 x 224 + 8 x 96"]
    assert sum(limit for _, _, limit in gpu_check.parts(tmp_path)) <= gpu_check.LEASE_SECONDS == 480
    rotten = [(name, [*command[:-2], "--no-such-option"], limit) for name, command, limit in gpu_check.parts(tmp_path)]
    monkeypatch.setattr(gpu_check, "parts", lambda out_dir: rotten[1:])
    with pytest.raises(SystemExit):
        gpu_check.dry_run(tmp_path)
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
