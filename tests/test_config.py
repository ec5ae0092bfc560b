"""Config loading: schema defaults, YAML files, overrides, and errors a user can act on."""
from pathlib import Path

import pytest

from pretrain.config import ConfigError, load_config, views_to_draw
from pretrain.__main__ import main

CONFIGS = sorted(Path(__file__).parents[1].glob("configs/pretrain/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.name


def test_overrides_are_typed_and_applied():
    cfg = load_config(None, ["hvs.enabled=true", "optim.lr=0.3", "data.views.0.size=64", "hvs.selection_size=16"])
    assert cfg.hvs.enabled is True and cfg.optim.lr == 0.3 and cfg.data.views[0].size == 64
    groups = views_to_draw(cfg)
    assert [groups[0].count] == cfg.hvs.num_views == [4] and groups[0].scale == (0.2, 1.0)


def test_one_item_of_a_list_of_numbers_is_a_key_of_its_own():
    """`data.views.0.scale.0=0.5` sets one crop bound (a search's `--space` moves it); an item past the list's end is
    refused naming the list's length."""
    cfg = load_config(None, ["data.views.0.scale.0=0.5", "data.mean.2=0.25"])
    assert list(cfg.data.views[0].scale) == [0.5, 1.0] and cfg.data.mean[2] == 0.25 and cfg.data.mean[0] != 0.25
    with pytest.raises(ConfigError, match=r"data.views.0.scale.2: data.views.0.scale has 2 item\(s\)"):
        load_config(None, ["data.views.0.scale.2=0.5"])
    with pytest.raises(ConfigError, match=r"data.views.0.scale.0=1.5|scale"):
        load_config(None, ["data.views.0.scale.0=1.5"])                  # above its upper bound: refused


@pytest.mark.parametrize("override, closest", [("hvs.enabld=true", "hvs.enabled"),
                                               ("optim.wieght_decay=0.1", "optim.weight_decay"),
                                               ("data.views.0.szie=3", "data.views.0.size"),
                                               ("data.views.0.scael.1=0.5", "data.views.0.scale.0")])
def test_mistyped_key_names_the_closest_valid_one(override, closest):
    with pytest.raises(ConfigError, match=f"unknown config key .*did you mean '{closest}'"):
        load_config(None, [override])


def test_mistyped_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmethod:\n  temprature: 0.1\n")
    with pytest.raises(ConfigError, match="'method.temprature'.*'method.temperature'"):
        load_config(path)


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match="method.name='byol'"):
        load_config(None, ["method.name=byol"])
    with pytest.raises(ConfigError, match=r"hvs.num_views=\[2\] equals the views trained on"):
        load_config(None, ["hvs.enabled=true", "hvs.num_views=[2]"])
    with pytest.raises(ConfigError, match=r"hvs.num_views is a list; write hvs.num_views=\[4\]"):
        load_config(None, ["hvs.num_views=4"])
    with pytest.raises(ConfigError, match=r"hvs.max_candidates=-1"):
        load_config(None, ["hvs.enabled=true", "hvs.max_candidates=-1"])
    with pytest.raises(ConfigError, match="lars"):
        load_config(None, ["optim.name=lars", "engine.zero_stage=2"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["hvs.enabled"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/pretrain/nope.yaml")


def test_method_keys_come_from_the_chosen_method():
    assert load_config(None, ["method.name=simsiam", "method.fix_pred_lr=false"]).method.fix_pred_lr is False
    # a key of another method is unknown for this one, and the error says so
    with pytest.raises(ConfigError, match="unknown config key 'method.temperature'"):
        load_config(None, ["method.name=simsiam", "method.temperature=0.1"])
    with pytest.raises(ConfigError, match="data.views.0.count=3"):
        load_config(None, ["data.views.0.count=3"])          # SimCLR trains on pairs


def test_cli_reports_config_errors_without_traceback(capsys):
    assert main(["hvs.enabld=true"]) == 2
    assert "did you mean 'hvs.enabled'" in capsys.readouterr().err


def test_cli_refuses_a_missing_beton_and_says_how_to_write_it(capsys, tmp_path):
    assert main(["data.train=nope.beton", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "data.train='nope.beton' does not exist" in err and "python -m pretrain.data write" in err
    assert not (tmp_path / "run").exists()          # nothing is created for a run that cannot start


def test_every_method_file_is_a_method_with_its_own_options():
    """Adding a method is one file: it is found by name, and its Options are the method.* keys."""
    from dataclasses import fields

    from pretrain.config import SCHEMA_KEYS
    from pretrain.methods import available_methods, method_module
    from pretrain.methods.base import Method

    names = available_methods()
    assert {"simclr", "simsiam"} <= set(names)
    for name in names:
        module = method_module(name)
        assert issubclass(module.METHOD, Method) and module.Options().name == name
        assert not any(key.startswith("method.") for key in SCHEMA_KEYS)
        assert "name" in {f.name for f in fields(module.Options)}


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[1].glob("configs/transfer/finetune_*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_finetune_config_loads(path):
    from transfer.finetune.config import load_finetune_config

    cfg = load_finetune_config(path)
    assert cfg.name and cfg.optim.epochs > 0


@pytest.mark.parametrize("override, message", [
    ("optim.lr=abc", "invalid value for optim.lr: Value 'abc' of type 'str' could not be converted to Float"),
    ("optim.epochs=1.5", "invalid value for optim.epochs: Value '1.5'"),
    ("hvs.enabled=maybe", "invalid value for hvs.enabled: Value 'maybe' is not a valid bool"),
    ("optim.lr=", "invalid value for optim.lr: it needs a value (optim.lr= gives none)"),
    ("data.views.3.size=8", "data.views.3.size: data.views has 1 item(s), numbered from 0"),
    ("data.std=[0,0,0]", "data.std=[0.0, 0.0, 0.0] must be positive in every channel"),
    ("data.mean=[0.5]", "data.mean=[0.5] must be 3 finite numbers"),
    ("seed=-1", "seed=-1 must be a finite number >= 0"),
    ("method.temperature=0", "method.temperature=0.0 must be positive (a temperature"),
    ("engine.max_minutes=-1", "engine.max_minutes=-1.0 must be a finite number >= 0 (minutes of training"),
    ("engine.checkpoint_every_minutes=nan", "engine.checkpoint_every_minutes=nan must be a finite number >= 0"),
    ("optim.budget_pflop=-1", "optim.budget_pflop=-1.0 must be a finite number >= 0 (the compute budget in PFLOP"),
    ("optim.budget_pflop=1e15flop", "invalid value for optim.budget_pflop: Value '1e15flop' of type 'str' could not "
                                    "be converted to Float"),
    ("optim.budget_flops=1", "unknown config key 'optim.budget_flops'; did you mean 'optim.budget_pflop'?"),
    ("engine.checkpoints_per_run=-6", "engine.checkpoints_per_run=-6 must be a finite number >= 0"),
])
def test_bad_values_are_one_line_naming_the_key(override, message):
    """Type errors used to print OmegaConf's four-line dump; std 0, a mean of the wrong length, a negative seed and
    a zero temperature used to pass the config and fail after start-up with a traceback."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, [override])
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_an_empty_config_file_or_a_directory_is_refused(tmp_path):
    """An empty file used to train 500 steps on the built-in defaults and exit 0."""
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(tmp_path / "empty.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
