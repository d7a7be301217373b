"""One source of truth per option: the dataclasses' defaults and help, checked against the shipped
YAML and the docs' settings reference, and shown by ``--help``."""
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sn_trainer
from sn_trainer.cli import hydra_settings
from sn_trainer.cli.run_config import CLI_DEFAULTS, RunConfig, option_rows, options_markdown
from sn_trainer.config import settings_markdown

ROOT = Path(__file__).resolve().parents[1]
CONF = Path(sn_trainer.__file__).with_name("conf")  # the copy shipped inside the package


def composed() -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config")
    raw = OmegaConf.to_container(cfg, resolve=False)
    raw.pop("hydra", None)
    return raw


def leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.quick
def test_the_yaml_defaults_are_the_dataclass_defaults():
    yaml = leaves(composed())
    rows = {key: default for key, default, _ in option_rows()}
    assert set(yaml) <= set(rows), f"in the YAML only: {set(yaml) - set(rows)}"
    groups = ("model.", "dataset.", "optim.")  # their YAML files set what differs between options
    missing = {key for key in rows if not key.startswith(groups)} - set(yaml)
    assert not missing, f"in config.py only: {missing}"
    for key, value in yaml.items():
        expected = CLI_DEFAULTS.get(key, (rows[key],))[-1]
        assert value == expected, f"{key}: the YAML says {value!r}, config.py says {expected!r}"
    RunConfig.from_dict(composed())  # and it builds


@pytest.mark.unit
def test_the_main_config_writes_no_default_of_its_own():
    """conf/config.yaml holds its defaults list and Hydra's settings: every default comes from the
    dataclasses, through the config store's node, once."""
    own = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    assert set(own) == {"defaults", "hydra"}
    assert own["defaults"][0] == hydra_settings.NAME
    node = leaves(hydra_settings.settings_node())
    assert node["batch_size"] == sn_trainer.TrainerConfig().batch_size and node["bench.steps"] == 30
    assert node["checkpoint.dir"] == CLI_DEFAULTS["checkpoint.dir"][1]
    assert not any(key.startswith(("model.", "dataset.", "optim.")) for key in node)  # their options' YAML


@pytest.mark.unit
def test_every_group_option_sets_known_keys_only():
    for group in ("model", "dataset", "optim"):
        for path in sorted((CONF / group).glob("*.yaml")):
            keys = OmegaConf.to_container(OmegaConf.load(path)).keys()
            known = {row[0].split(".", 1)[1] for row in option_rows() if row[0].startswith(f"{group}.")}
            assert set(keys) <= known, f"{path.name}: unknown keys {set(keys) - known}"


@pytest.mark.unit
def test_the_settings_reference_holds_the_generated_tables():
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    assert options_markdown() in page, "docs/reference/settings.md's command-line table is stale: paste the output " \
        "of python -c 'from sn_trainer.cli.run_config import options_markdown; print(options_markdown())'"
    assert settings_markdown() in page, "docs/reference/settings.md's Trainer table is stale: paste the output " \
        "of python -c 'from sn_trainer.config import settings_markdown; print(settings_markdown())'"


def test_help_explains_every_key_with_its_default(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sn_trainer", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shown = " ".join(proc.stdout.split())
    for key, _, help_text in option_rows():
        assert f"{key} (default" in shown, key
        assert " ".join(help_text.replace("`", "").split()) in shown, key  # the whole text, however wrapped


@pytest.mark.unit
def test_one_name_per_setting():
    """No two settings share a name across groups (as the run's seed and the dataset's once did), but
    each group's ``name``: which model, dataset or optimizer (``model=lenet`` sets ``model.name``)."""
    names = {}
    for key, _, _ in option_rows():
        names.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    shared = {name: keys for name, keys in names.items() if len(keys) > 1}
    assert shared == {"name": ["model.name", "dataset.name", "optim.name"]}


@pytest.mark.unit
@pytest.mark.parametrize("args", [
    ["dataset.augment=true"],  # fashion_mnist reads it: its YAML lists it
    ["dataset=synthetic", "dataset.data_seed=1"],
    ["+experiment=gpt_text", "dataset.path=x"],  # the experiment chooses dataset=text
    ["+experiment=singlecaffe_mnist", "dataset.data_seed=1"],
    ["optim=adamw", "optim.betas=[0.9,0.95]"],
    ["--multirun", "dataset=synthetic,folder", "dataset.data_seed=1,2"],
])
def test_a_group_key_the_chosen_option_reads_is_let_through(args):
    from hydra.core.global_hydra import GlobalHydra

    from sn_trainer.__main__ import _refused_key

    assert _refused_key(args) is None
    assert not GlobalHydra.instance().is_initialized()  # left for the run's own Hydra


@pytest.mark.unit
def test_each_group_option_lists_the_keys_it_reads():
    """What an option's YAML leaves out is refused on the command line: what it reads, it lists."""
    dataset = {path.stem: set(OmegaConf.load(path)) for path in (CONF / "dataset").glob("*.yaml")}
    images = {"fashion_mnist", "mnist", "cifar10", "synthetic", "folder"}
    assert all("augment" in dataset[name] for name in images)  # image_splits and ImageFiles augment any of them
    assert {name for name, keys in dataset.items() if "data_seed" in keys} == {"synthetic", "folder"}
    assert {name for name, keys in dataset.items() if "test_fraction" in keys} == {"folder", "text"}


@pytest.mark.unit
@pytest.mark.parametrize("key", ["measure_after", "profile_dir"])
def test_api_only_settings_are_refused_on_the_command_line(key):
    from sn_trainer import ConfigError

    with pytest.raises(ConfigError, match=f"{key} is a Trainer argument, not a command-line setting"):
        RunConfig.from_dict({key: 1})
