"""The Trainer's front door: every setting in its signature and help with its default, one
TrainerConfig or keywords (or both), and an unknown or impossible setting refused in one line."""
import inspect
import pydoc
import re

import pytest

from sn_trainer import CheckpointConfig, ConfigError, Trainer, TrainerConfig
from sn_trainer.config import setting_rows


@pytest.mark.unit
def test_the_signature_lists_every_setting_with_its_default():
    parameters = inspect.signature(Trainer).parameters
    rows = list(setting_rows())
    assert list(parameters)[:2] == ["config", "cluster"]
    assert [name for name in parameters][2:] == [row.keyword for row in rows]
    assert all(parameters[row.keyword].default == row.default for row in rows)
    assert parameters["checkpoint_keep"].default == 3 and parameters["workers"].default == "auto"


@pytest.mark.unit
def test_help_names_every_setting_with_its_default_and_meaning():
    page = re.sub(r"\n *\| ?", "\n", pydoc.render_doc(Trainer, renderer=pydoc.plaintext))  # the class's margin
    shown = " ".join(page.split())
    for row in setting_rows():
        assert f"{row.keyword} (default {row.default!r}):" in shown, row.keyword
        assert " ".join(row.help.replace("`", "").split())[:60] in shown, row.keyword


@pytest.mark.quick
def test_a_config_keywords_or_both():
    config = TrainerConfig(batch_size=8, workers=1, checkpoint=CheckpointConfig(keep=5))
    assert Trainer(config).config == config
    both = Trainer(config, workers=2, checkpoint_dir="ckpt").config
    assert (both.workers, both.batch_size, both.checkpoint.dir, both.checkpoint.keep) == (2, 8, "ckpt", 5)
    assert Trainer(batch_size=8, workers=1, checkpoint_keep=5).config == config
    assert Trainer(config).settings.workers == 1  # what this machine makes of them


@pytest.mark.unit
@pytest.mark.parametrize("settings, message", [
    ({"batchsize": 8}, r"^unknown setting batchsize; did you mean batch_size\? \(every setting: help\(sn_trainer."
                       r"TrainerConfig\)\)$"),
    ({"checkpoint_directory": "x"}, "unknown setting checkpoint_directory; did you mean checkpoint_dir?"),
    ({"checkpoint_keep": 0}, "checkpoint_keep must be >= 1, got 0"),
    ({"comm": "mpi", "workers": 2}, "comm must be one of auto, local, shm, gloo, got 'mpi'"),
    ({"comm": "local", "workers": 2}, "comm=local sums nothing: it is one worker's; with workers=2 use auto, shm, gloo"),
    ({"allocator": "mimalloc"}, "allocator must be one of system, jemalloc, tcmalloc, auto, got 'mimalloc'"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(**settings)


@pytest.mark.unit
def test_only_a_config_is_taken_positionally():
    with pytest.raises(ConfigError, match="Trainer takes a TrainerConfig or the settings as keywords"):
        Trainer({"batch_size": 8})


def test_one_worker_needs_no_reducer():
    assert Trainer(workers=1, comm="gloo").settings.comm == "local"
    assert Trainer(workers=1, comm="local").settings.comm == "local"
