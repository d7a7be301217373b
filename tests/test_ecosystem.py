"""The tools people run beside a trainer, each real and running locally: MLflow's tracking store,
an Optuna study, submitit's launcher (and what it would send to Slurm)."""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import mlflow
import pytest

import sn_trainer
from helpers import processes_with_marker
from test_cli import TINY, sn_train

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def runs(uri: str):
    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=["sn_trainer"], order_by=["params.batch_size"])


def test_a_multirun_sweep_is_one_mlflow_experiment_with_a_run_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = sn_train(["--multirun", *TINY, "batch_size=16,32", "workers=2", "max_steps=4", "logger=[tensorboard,mlflow]",
                     f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": ""})
    assert proc.returncode == 0, proc.stderr
    found = runs(f"sqlite:///{sweep / 'mlflow.db'}")
    assert list(found["params.batch_size"]) == ["16", "32"] and set(found["status"]) == {"FINISHED"}
    names = list(found["tags.mlflow.runName"])  # the job's overrides, as Hydra names its folder
    assert names[0].startswith("batch_size=16,") and names[1].startswith("batch_size=32,") and "workers=2" in names[0]
    assert set(found["params.optim.lr"]) == {"0.02"} and set(found["params.dataset.name"]) == {"synthetic"}
    for job, run in zip(sorted(sweep.glob("[0-9]*")), found.to_dict("records")):
        summary = json.loads((job / "summary.json").read_text())
        assert run["metrics.final.test_accuracy"] == pytest.approx(summary["test_accuracy"])
        assert run["tags.last_checkpoint"] == summary["last_checkpoint"]
        history = mlflow.MlflowClient().get_metric_history(run["run_id"], "loss")
        assert [m.step for m in history] == [2, 4]  # every progress record, by step (log_every=2)
        kept = mlflow.artifacts.load_dict(f"{run['artifact_uri']}/summary.json")
        assert kept["samples_per_sec"] == summary["samples_per_sec"]
        assert list(job.glob("events.out.tfevents.*"))  # TensorBoard as well


def test_mlflow_tracking_uri_is_where_runs_go(tmp_path):
    store = tmp_path / "elsewhere.db"
    proc = sn_train([*TINY, "max_steps=2", "workers=1", "logger=mlflow", f"hydra.run.dir={tmp_path / 'run'}"],
                    cwd=tmp_path, env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}"})
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "run" / "mlflow.db").exists()
    found = runs(f"sqlite:///{store}")
    assert len(found) == 1 and found["tags.mlflow.runName"][0] == "run"
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))  # logger=mlflow alone


def test_an_optuna_study_of_three_trials_searches_lr_weight_decay_and_batch(tmp_path):
    """+experiment=optuna_lr: hydra-optuna-sweeper's TPE study, each trial a job whose objective
    is the test accuracy it returns; the sweep report reads the study."""
    import yaml

    sweep = tmp_path / "study"
    proc = sn_train(["--multirun", "+experiment=optuna_lr", "hydra.sweeper.n_trials=3", "max_steps=5", "workers=2",
                     f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    trials = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert len(trials) == 3 and {t["config"]["dataset"]["name"] for t in trials} == {"fashion_mnist"}
    for t in trials:
        assert 0.005 <= t["config"]["optim"]["lr"] <= 0.2 and 1e-5 <= t["config"]["optim"]["weight_decay"] <= 1e-3
        assert t["batch_size"] in (64, 128, 256)
    found = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    top = max(trials, key=lambda t: t["test_accuracy"])
    assert found["best_value"] == pytest.approx(top["test_accuracy"])
    assert found["best_params"]["optim.lr"] == pytest.approx(top["config"]["optim"]["lr"])
    assert found["best_params"]["batch_size"] == top["batch_size"]
    report = subprocess.run([sys.executable, "-m", "sn_trainer.report", str(sweep)], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr
    assert "study (3 trials), best test accuracy first:" in report.stdout
    assert f"(test accuracy {found['best_value']})" in report.stdout


def test_sweep_jobs_run_through_submitit_on_this_machine(tmp_path):
    """hydra/launcher=submitit_local: the jobs a Slurm sweep would send, run by submitit here."""
    marker = uuid.uuid4().hex
    sweep = tmp_path / "sweep"
    proc = sn_train(["--multirun", "hydra/launcher=submitit_local", *TINY, "batch_size=16,32", "workers=2",
                     "max_steps=3", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env={"SN_TEST_MARKER": marker})
    assert proc.returncode == 0, proc.stderr
    assert "Submitit 'local' sweep output dir" in proc.stderr + proc.stdout
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted(s["batch_size"] for s in summaries) == [16, 32] and all(s["steps"] == 3 for s in summaries)
    assert list((sweep / ".submitit").rglob("*_result.pkl"))  # submitit ran them, and kept their results
    assert processes_with_marker(marker) == []


def fake_slurm_commands(bin_dir: Path) -> dict[str, str]:
    """``srun`` and ``scontrol`` as scripts that note their arguments: enough for submitit to
    write its sbatch file, and for the multi-node script to run, without a cluster."""
    bin_dir.mkdir()
    for name, body in (("srun", 'echo "srun $*" >> "$SLURM_FAKE_LOG"'),
                       ("scontrol", 'echo node07; echo node08')):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.unit
def test_the_slurm_preset_asks_for_whole_nodes(tmp_path, monkeypatch):
    """hydra/launcher=slurm_node, composed as the command line composes it, through the launcher's
    own mapping into submitit: the sbatch file it would submit."""
    import submitit
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    from sn_trainer.cli import hydra_settings  # noqa: F401 - every setting's default, as the command line registers it

    monkeypatch.setenv("PATH", fake_slurm_commands(tmp_path / "bin")["PATH"])
    with initialize_config_dir(config_dir=str(Path(sn_trainer.__file__).with_name("conf")), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm_node", "hydra.launcher.partition=cpu",
                                           "hydra.launcher.cpus_per_task=64"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    executor = submitit.AutoExecutor(cluster="slurm", folder=str(tmp_path / "jobs"))
    executor.update_parameters(**{k if k in generic else f"slurm_{k}": v for k, v in params.items()
                                  if k not in ("_target_", "submitit_folder", "max_num_timeout")})
    sbatch = executor._executor._make_submission_file_text("python -m sn_trainer", "0")  # what sbatch would get
    for line in ("#SBATCH --partition=cpu", "#SBATCH --cpus-per-task=64", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --nodes=1", "#SBATCH --exclusive", "#SBATCH --time=240"):
        assert line in sbatch.splitlines(), sbatch


@pytest.mark.quick
def test_the_multinode_sbatch_script_starts_one_torchrun_per_node_meeting_on_the_first(tmp_path):
    """examples/slurm_torchrun.sbatch under Slurm's variables: srun starts torchrun with the c10d
    rendezvous test_multinode.py runs for real (two torchruns on one machine)."""
    log = tmp_path / "calls"
    env = {**os.environ, **fake_slurm_commands(tmp_path / "bin"), "SLURM_FAKE_LOG": str(log),
           "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}
    done = subprocess.run(["bash", str(ROOT / "examples" / "slurm_torchrun.sbatch"), "workers=16", "batch_size=512"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().split() == [
        "srun", "--kill-on-bad-exit=1", "python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", "--rdzv-endpoint=node07:29500", "--rdzv-id=4242", "-m", "sn_trainer", "workers=16",
        "batch_size=512"]
