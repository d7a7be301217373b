"""Jobs that tests/test_frameworks.py starts: a framework's own training, written the way its documentation
writes CPU DDP (gloo, named or by default), one job after another in the same processes.

``python framework_jobs.py JOB [JOB ...] --out DIR``, run under sn_trainer.launch, with or without
``--cpu-backend=sn`` (or, for Lightning alone, as a plain script that Lightning starts its own processes
from; ``--backend sn`` then names "sn" in Lightning's strategy, the one edit that way needs). Every rank
writes DIR/<job>-rank<r>.pt: the backend of the group its DDP wrapper reduced over, that group's backend
class, and the trained parameters, so that the test can compare "sn" with gloo.
"""
import argparse
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


def store_of_its_own(job: str, agent: dict[str, str], kept: list) -> None:
    """Under the launcher, point the next group's env:// rendezvous at a store made for ``job``: a group
    made again on the agent's store would find the keys the previous job's group left there.

    Rank 0 serves it (multi-tenant: the rendezvous then takes this very server) on a port it is given,
    and says which through the agent's store.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    said = dist.TCPStore(agent["MASTER_ADDR"], int(agent["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=120))
    if os.environ["RANK"] == "0":
        kept.append(dist.TCPStore(agent["MASTER_ADDR"], 0, is_master=True, multi_tenant=True))
        said.set(f"framework_jobs/{job}", str(kept[-1].port))
    os.environ.update(MASTER_PORT=said.get(f"framework_jobs/{job}").decode(), TORCHELASTIC_USE_AGENT_STORE="False")


def regression_data(n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return x, (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)).tanh()


def small_net(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1)).double()


def record(out: str, job: str, ddp_model, **extra) -> None:
    """What this rank trained and over which group: DIR/<job>-rank<r>.pt."""
    group = ddp_model.process_group
    state = {k: v.detach().clone() for k, v in ddp_model.module.state_dict().items()}
    # torch's ProcessGroup holds the backend that runs its collectives: gloo's, or sn_trainer's.
    implementation = group._get_backend(torch.device("cpu"))
    found = {"backend": dist.get_backend(group), "world_size": dist.get_world_size(group),
             "backend_class": type(implementation).__name__, "state": state, **extra}
    torch.save(found, Path(out) / f"{job}-rank{dist.get_rank()}.pt")


def lightning_job(args) -> None:
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_net()

        def training_step(self, batch, _):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def on_train_end(self):
            record(args.out, "lightning", self.trainer.strategy.model)

    if args.backend == "sn":  # started by Lightning itself: no launcher to redirect gloo, so "sn" is named
        import sn_trainer.distributed  # noqa: F401  (registers "sn")
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="sn")
    else:
        strategy = "ddp"  # Lightning's default DDP: gloo on CPU
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*regression_data()), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=args.out)
    trainer.fit(Regression(), loader)
    return trainer


def accelerate_job(args) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    # The name "sn" itself: Accelerate accepts gloo (or mpi) only on CPU, and says so.
    try:
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="sn")])
        refused = ""
    except ValueError as e:
        refused = str(e)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)  # as its CPU documentation has it: the group is gloo
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*regression_data()), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _, (x, y) in zip(range(4), loader):
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
    record(args.out, "accelerate", model, refused=refused)
    AcceleratorState._reset_state(reset_partial_state=True)  # the next job makes its own
    return model


def hf_job(args) -> None:
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from framework_models import TinyRegressor, TinyRegressorConfig

    options = dict(use_cpu=True, max_steps=4, learning_rate=0.1, per_device_train_batch_size=4,
                   lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0, train_sampling_strategy="sequential",
                   ddp_find_unused_parameters=False, report_to=[], save_strategy="no", logging_strategy="no", seed=0,
                   dataloader_num_workers=0, disable_tqdm=True)
    with tempfile.TemporaryDirectory() as scratch:
        # The name "sn" itself: ddp_backend goes to Accelerate, which on CPU accepts gloo (or mpi) only.
        try:
            TrainingArguments(output_dir=scratch, ddp_backend="sn", **options)
            refused = ""
        except ValueError as e:
            refused = str(e)
        AcceleratorState._reset_state(reset_partial_state=True)
        # As Hugging Face documents CPU DDP: use_cpu, ddp_backend="gloo", started by a torchrun-style launcher.
        training = TrainingArguments(output_dir=scratch, ddp_backend="gloo", **options)
        x, y = regression_data()
        rows = [{"features": x[i], "labels": y[i]} for i in range(len(x))]
        trainer = Trainer(model=TinyRegressor(TinyRegressorConfig()), args=training, train_dataset=rows)
        trainer.train()
        record(args.out, "hf", trainer.model_wrapped, refused=refused)
    AcceleratorState._reset_state(reset_partial_state=True)
    return trainer


def powersgd_job(args) -> None:
    """A plain DDP script for gloo: ``init_process_group("gloo")``, DDP with the PowerSGD hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    ddp = nn.parallel.DistributedDataParallel(model)
    # Compression from the third step on, for every matrix (a low threshold, since they are tiny).
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                   min_compression_rate=0.5, random_seed=0)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = regression_data()
    rank, size = dist.get_rank(), dist.get_world_size()
    for step in range(5):
        rows = slice(step * 8 + rank * 8 // size, step * 8 + (rank + 1) * 8 // size)
        optimizer.zero_grad()
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        optimizer.step()
    before, after = state.total_numel_before_compression, state.total_numel_after_compression
    record(args.out, "powersgd", ddp, compressed=(before, after))
    return ddp


JOBS = {"lightning": lightning_job, "accelerate": accelerate_job, "hf": hf_job, "powersgd": powersgd_job}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("jobs", nargs="+", choices=sorted(JOBS))
    parser.add_argument("--backend", choices=["sn"], default=None, help="Lightning started by itself: name \"sn\"")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    agent, stores = {name: os.environ.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT")}, []
    # What each job trained with, its group with it, kept to the end: a gloo group whose last reference
    # goes with a collective on gloo's own thread would join that thread from itself (torch aborts).
    kept = []
    for job in args.jobs:  # in the same processes, each job's group destroyed before the next makes its own
        store_of_its_own(job, agent, stores)
        kept.append(JOBS[job](args))
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
