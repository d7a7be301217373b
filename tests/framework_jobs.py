"""Jobs that tests/test_frameworks.py starts: a framework's own training over a named process group.

``python framework_jobs.py FRAMEWORK --backend sn|gloo --out DIR``, run under sn_trainer.launch (or, for
Lightning, also as a plain script that Lightning starts its own processes from). Every rank writes
DIR/rank<r>.pt: the backend of the group its DDP wrapper reduced over, that group's backend class,
and the trained parameters, so that the test can compare "sn" with gloo.
"""
import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


def use_backend(name: str) -> None:
    """Registers "sn" the way a user does: by importing its module."""
    if name == "sn":
        import sn_trainer.distributed  # noqa: F401


def regression_data(n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return x, (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)).tanh()


def small_net(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1)).double()


def record(out: str, ddp_model, **extra) -> None:
    """What this rank trained and over which group: DIR/rank<r>.pt."""
    group = ddp_model.process_group
    state = {k: v.detach().clone() for k, v in ddp_model.module.state_dict().items()}
    # torch's ProcessGroup holds the backend that runs its collectives: gloo's, or sn_trainer's.
    implementation = group._get_backend(torch.device("cpu"))
    found = {"backend": dist.get_backend(group), "world_size": dist.get_world_size(group),
             "backend_class": type(implementation).__name__, "state": state, **extra}
    torch.save(found, Path(out) / f"rank{dist.get_rank()}.pt")


def lightning_job(args) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

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
            record(args.out, self.trainer.strategy.model)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*regression_data()), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=args.backend),
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=args.out)
    trainer.fit(Regression(), loader)


def accelerate_job(args) -> None:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # Accelerate's own way in first: on CPU it accepts gloo (or mpi) only, and says so.
    try:
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=args.backend)])
        refused = ""
    except ValueError as e:
        refused = str(e)
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    # The way that works: the group first; Accelerate finds it initialised and uses it.
    if not dist.is_initialized():
        dist.init_process_group(args.backend)
    accelerator = Accelerator(cpu=True)
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*regression_data()), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _, (x, y) in zip(range(args.steps), loader):
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
    record(args.out, model, refused=refused)


def hf_job(args) -> None:
    from transformers import Trainer, TrainingArguments

    from framework_models import TinyRegressor, TinyRegressorConfig

    options = dict(use_cpu=True, max_steps=args.steps, learning_rate=0.1, per_device_train_batch_size=4,
                   lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0, train_sampling_strategy="sequential",
                   ddp_find_unused_parameters=False, report_to=[], save_strategy="no", logging_strategy="no", seed=0,
                   dataloader_num_workers=0, disable_tqdm=True)
    with tempfile.TemporaryDirectory() as scratch:
        # Its own way in first: ddp_backend goes to Accelerate, which on CPU accepts gloo (or mpi) only.
        try:
            TrainingArguments(output_dir=scratch, ddp_backend=args.backend, **options)
            refused = ""
        except ValueError as e:
            refused = str(e)
        # The way that works: a group initialised before TrainingArguments is the one it adopts.
        if not dist.is_initialized():
            dist.init_process_group(args.backend)
        training = TrainingArguments(output_dir=scratch, **options)
        x, y = regression_data()
        rows = [{"features": x[i], "labels": y[i]} for i in range(len(x))]
        trainer = Trainer(model=TinyRegressor(TinyRegressorConfig()), args=training, train_dataset=rows)
        trainer.train()
        record(args.out, trainer.model_wrapped, refused=refused)


def powersgd_job(args) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    dist.init_process_group(args.backend)
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
    for step in range(args.steps):
        rows = slice(step * 8 + rank * 8 // size, step * 8 + (rank + 1) * 8 // size)
        optimizer.zero_grad()
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        optimizer.step()
    before, after = state.total_numel_before_compression, state.total_numel_after_compression
    record(args.out, ddp, compressed=(before, after))


JOBS = {"lightning": lightning_job, "accelerate": accelerate_job, "hf": hf_job, "powersgd": powersgd_job}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", choices=sorted(JOBS))
    parser.add_argument("--backend", choices=["sn", "gloo"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    use_backend(args.backend)
    JOBS[args.job](args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
