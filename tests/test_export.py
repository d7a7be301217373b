"""python -m sn_trainer.export: any checkpoint's weights as safetensors that load_model restores,
ties included (also from a checkpoint written before ties were recorded); bad paths in one line."""
import functools
import subprocess
import sys

import pytest
import torch

from helpers import TinyGPT, token_dataset
from sn_trainer import Trainer
from sn_trainer.export import main, tied_in

pytestmark = pytest.mark.timeout(180)
safetensors_torch = pytest.importorskip("safetensors.torch")


def gpt_step(model, batch):
    idx, targets = batch
    return model(idx, targets)[1]


@pytest.fixture(scope="module")
def checkpoint_file(tmp_path_factory):
    """A tied GPT's checkpoint after two steps, as this version writes it (aliases recorded)."""
    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    Trainer(workers=1, batch_size=6, max_steps=2, checkpoint_dir=str(folder)).fit(
        TinyGPT(), token_dataset(), step_fn=gpt_step, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    return sorted(folder.glob("step-*.pt"))[-1]


def written_before_aliases(checkpoint_file, path, shared_storage=False):
    """The checkpoint as a writer before aliases were recorded left it: no `aliases` entry, the
    tied weight under both names (equal copies, as its workers cloned the model; or one tensor)."""
    saved = torch.load(checkpoint_file, weights_only=True)
    assert saved["aliases"] == {"head.weight": "wte.weight"}
    del saved["aliases"]
    assert not torch.equal(saved["model"]["head.weight"], TinyGPT().wte.weight)  # it trained
    if shared_storage:
        saved["model"]["head.weight"] = saved["model"]["wte.weight"]
        saved["optimizer"] = None
    else:
        assert saved["model"]["head.weight"].untyped_storage().data_ptr() != \
            saved["model"]["wte.weight"].untyped_storage().data_ptr()
    torch.save(saved, path)
    return saved


@pytest.mark.parametrize("shared_storage", [pytest.param(False, marks=pytest.mark.quick), True])
def test_a_checkpoint_written_before_ties_were_recorded_exports_what_load_model_restores(
        checkpoint_file, tmp_path, shared_storage):
    old = tmp_path / "old.pt"
    saved = written_before_aliases(checkpoint_file, old, shared_storage)
    done = subprocess.run([sys.executable, "-m", "sn_trainer.export", str(old), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh = TinyGPT()
    safetensors_torch.load_model(fresh, tmp_path / "out" / "model.safetensors")  # strict: no unexpected key
    assert fresh.head.weight is fresh.wte.weight
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved["model"][name]), name


@pytest.mark.unit
def test_only_a_name_the_optimizer_leaves_out_is_taken_for_an_equal_copys_alias():
    weight = torch.randn(3, 4)
    model = {"a": weight, "b": weight.clone(), "frozen": weight.clone()}
    optimizer = {"param_groups": [{"params": ["a", "b"]}], "state": {}}
    assert tied_in({"model": model, "optimizer": optimizer}) == {"frozen": "a"}
    assert tied_in({"model": model, "optimizer": [optimizer, {"param_groups": [{"params": ["frozen"]}]}]}) == {}
    assert tied_in({"model": model, "optimizer": None}) == {}  # equal copies, no evidence: kept
    assert tied_in({"model": {"a": weight, "b": weight}, "optimizer": None}) == {"b": "a"}  # one tensor
    assert tied_in({"model": model, "optimizer": optimizer, "aliases": {}}) == {}  # recorded: no ties


def test_bad_paths_are_one_line_and_exit_2(checkpoint_file, tmp_path, capsys):
    def export(*args):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err.strip()

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for args, expected in [
        ((checkpoint_file.parent, tmp_path / "x"),
         f"error: {checkpoint_file.parent} is a folder, not a checkpoint file; give one of its step-*.pt files"),
        ((tmp_path / "nope.pt", tmp_path / "x"), f"error: {tmp_path / 'nope.pt'}: no such file; give a checkpoint"),
        ((checkpoint_file, a_file), f"error: {a_file} is a file, not a folder; give a folder to write model.safe"),
    ]:
        code, out, err = export(*args)
        assert code == 2 and out == "" and err.startswith(expected) and "\n" not in err, err
    assert not (tmp_path / "x").exists()
    assert export(checkpoint_file, tmp_path / "out")[0] == 0
    code, _, err = export(checkpoint_file, tmp_path / "out")
    assert code == 2 and err == (f"error: {tmp_path / 'out' / 'model.safetensors'} exists; pass --overwrite to "
                                 "replace it, or give another folder")
    (tmp_path / "out" / "model_ema.safetensors").write_bytes(b"an earlier run's average")
    code, out, _ = export(checkpoint_file, tmp_path / "out", "--overwrite")
    assert code == 0 and out.split() == [str(tmp_path / "out" / "model.safetensors")]
    assert not (tmp_path / "out" / "model_ema.safetensors").exists()  # not this checkpoint's: gone
