"""The tools people run beside a trainer, each real and running locally: MLflow's tracking store,
an Optuna study."""
import json
import subprocess
import sys

import mlflow
import pytest

from test_cli import TINY, sn_train

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
