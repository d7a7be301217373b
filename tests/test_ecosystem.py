"""The tools people run beside a trainer, each real and running locally: MLflow's tracking store."""
import json
import os

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
