"""Every error sn_trainer raises on purpose: bad input (settings, files, user code) and failed runs."""
from __future__ import annotations

import signal


class InputError(ValueError):
    """Something the user gave cannot be used; the message says what and how to fix it.

    Raised before any worker starts and before anything saved is touched; the command line
    turns it into one ``error: ...`` line and exit code 2.
    """


class ConfigError(InputError):
    """A setting is wrong; the message names it and says what would be right."""


class CheckpointError(InputError):
    """A checkpoint file cannot be resumed from: missing, corrupt, unsafe, or of another run."""


class DataError(InputError):
    """Dataset files are missing or malformed; the message lists the ways to provide them."""


class UserCodeError(InputError):
    """The user's model, step, loss, metric or optimizer failed on a first micro-batch.

    The message carries the user's own traceback; no worker was started.
    """


class NotExact(InputError):
    """A verified step differed from what one process computes on the same global batch (its loss,
    a gradient, a buffer, or the update): raised in every worker at that step, before its update
    where what differed was computed before it, so the run stops with the checkpoints it had. The
    message names the step, what differed and by how much, the steps verified before it and those
    that were not."""


LossDoesNotSplit = NotExact  # its name before the verification compared whole steps


class WorkerFailed(RuntimeError):
    """A worker raised, died or hung; the message names it and carries its traceback, signal or phase."""

    def __init__(self, rank: int, detail: str, others: list[tuple[int, str]] | None = None, where: str = ""):
        self.rank = rank
        self.detail = detail
        text = f"{where}worker {rank} failed: {detail.rstrip()}"
        for other_rank, other in others or []:
            last = other.strip().splitlines()[-1] if other.strip() else "?"
            text += f"\n(then {where}worker {other_rank}: {last})"
        super().__init__(text)


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run after a whole step; ``checkpoint`` resumes it."""

    def __init__(self, signum: int, step: int | None, checkpoint_path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint_path
        where = f"checkpoint {checkpoint_path}" if checkpoint_path else "no checkpoint (set checkpoint_dir to keep one)"
        when = f"after step {step}" if step is not None else "before its first step finished"
        super().__init__(f"stopped by {signal.Signals(signum).name} {when}; {where}")


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became non-finite (no update was applied for that step), or an
    update of finite gradients made the parameters so (``parameters=True``); no checkpoint of it."""

    def __init__(self, step: int, parameters: bool = False):
        self.step, self.parameters = step, parameters
        if parameters:
            super().__init__(f"the parameters became non-finite at step {step}, from finite gradients (no checkpoint "
                             "written of them): the optimizer's step overflowed; lower the learning rate")
        else:
            super().__init__(f"loss or gradient became non-finite at step {step} (no update applied, no checkpoint "
                             "written); lower the learning rate, set clip_grad_norm, or use on_nan=skip")


class CollectiveFailed(RuntimeError):
    """A collective of the ``"sn"`` torch.distributed backend could not complete: a peer died or
    never arrived within the group's timeout, or the ranks called it with different tensors; the
    message names the rank and what differed."""
