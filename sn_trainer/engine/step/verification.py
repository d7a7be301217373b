""""exact" earned on the run's own batches: a split step compared with one process's step.

Where a run splits its global batches (workers, nodes or accumulation), its steps are compared, at
the steps ``Schedule`` names, with what one process computes on the same global batch. Worker 0
of every node holds a ``Reference``: a private copy of the model and of the step's code (loss, step
function, optimizer factory, after_update), made before the worker binds its model to the shared
weights. At a verified step it reads the global batch whole, collated as a plain DataLoader
collates it (``Feed.whole``), and on its copy, from the weights, buffers and frozen parameters
the workers started the phase with:

1. forward and backward of every micro-batch: the loss, each parameter's gradient and the
   buffers the forward passes left are compared with the workers' (``gradient``); a difference
   stops the run before the step's update;
2. the optimizer's step from the same optimizer state (each worker's shard of it, gathered) on
   the workers' own summed gradient, and after_update: the weights are compared with the
   workers' once they updated (``update``), so that a sharded update is checked too.

The copies touch nothing of the run: not its parameters, buffers or module modes, not the
random streams (kept and put back), not the user's step function (a copy of it runs; only what it
writes outside itself, a module's global, a file, sees the extra call). Every worker takes part
in the agreement on the verdict, so all stop, or go on, at the same step.
"""
from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...data import random_state
from ...data.batching import map_tensors
from ...errors import NotExact
from ...shm import futex
from ...shm.group import SHM_SAFE
from ..memory import state as optimizer_state
from ..memory.layout import FlatLayout
from ..plan import Plan
from . import position
from .gather import Gathering, gathering
from .objective import Precision
from .phases import PhaseSpec, scaled_lr

# Where sn_trainer only says what it did (a user's override, split="like_ddp"), a mismatch is said
# and training goes on; else it stops. What each says of what to do.
SPLIT_ADVICE = ("a sample's loss or output depends on the other samples of its batch (padding to the batch's longest "
                "sample, a statistic over the batch, a load-balancing term, a loss over the batch's samples), so the "
                "workers' slices do not add up to the global batch's: make it independent of the batch (pad to a "
                "fixed length), compute a loss over the global batch from sn_trainer.gather, or return (loss_sum, "
                "count); or pass split=\"like_ddp\" to train on, labelled like DDP from that step (each worker "
                "computes its slice alone, as DDP does)")
UPDATE_ADVICE = ("the optimizer's update of its shards differs from one process's update of the whole parameters: "
                 "shards=full (one worker steps the whole optimizer) is exact for any optimizer; please report it")


@dataclass(frozen=True)
class Schedule:
    """Which steps are verified: the first of a launch, every ``every``-th step and the last; a step
    that trains off is found at most ``every`` - 1 steps later. ``every`` 0: none."""

    every: int
    first: int  # the launch's first step (from 0)
    last: int  # the run's last step (from 0)

    def due(self, step: int) -> bool:
        if self.every <= 0:
            return False
        return step in (self.first, self.last) or (step + 1) % self.every == 0

    def steps(self) -> list[int]:
        """Every verified step, counted from 1."""
        return [step + 1 for step in range(self.first, self.last + 1) if self.due(step)]


def tolerances(dtype: torch.dtype, precision: str) -> tuple[float, float]:
    """How far apart, relative, one process's step and the workers' may be from rounding alone: of
    what the step computes (loss, gradients, buffers) in ``dtype`` (the lowest of the parameters'
    and the loss's: a float64 model may take its loss in float32, as Hugging Face's do), and of the
    update, computed from the same gradient bits on both sides (only the clipping norm's summation
    order differs).

    A float64 step moves by about 1e-16 per operation, a float32 one by 1e-7, where a split changes
    the order of a sum; a part computed in float32 on purpose inside a float64 model (T5's norm)
    moves by float32's rounding at the element it crosses. The bounds leave that room: a step that
    is off, a wrong count, a loss that couples its samples, moves by far more (1e-3 to 1).
    """
    if precision == "bf16" or dtype not in (torch.float32, torch.float64):
        return 5e-2, 1e-3
    if dtype == torch.float64:
        return 1e-6, 1e-9
    return 1e-3, 1e-5


@dataclass(frozen=True)
class Difference:
    """What a verified step found different: the worst of what it compared."""

    what: str  # "the loss", "the gradient of fc.weight", "buffer bn.running_mean", "the update of fc.weight"
    off: float  # relative
    tolerance: float
    update: bool  # found in the update (the optimizer's step) rather than what the step computed

    def said(self) -> str:
        return f"{self.what} is {self.off:.2g} off (relative; rounding allows {self.tolerance:.1g})"


def _norm(tensor: torch.Tensor) -> float:
    """The L2 norm (inf where an element is not finite): in the tensor's own dtype, precise enough
    for ratios held to 1e-6 at the finest."""
    return tensor.norm().item() if tensor.numel() else 0.0


def relative(found: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """``|found - expected| / max(|found|, |expected|, floor)`` (inf where either is not finite, 0
    where both are zero)."""
    dtype = torch.promote_types(found.dtype, expected.dtype)
    found, expected = found.to(dtype), expected.to(dtype)
    scale = max(_norm(found), _norm(expected), floor)
    off = torch.dist(found, expected).item() if found.numel() else 0.0
    return off / scale if scale > 0 and math.isfinite(scale) else (0.0 if off == 0 else math.inf)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a model holds besides its trainable parameters: buffers and frozen parameters, by name."""
    held = {name: b for name, b in model.named_buffers()}
    held.update((name, p) for name, p in model.named_parameters() if not p.requires_grad)
    return held


_SIMPLE = (int, float, bool, str, bytes, type(None))


def _simple(value: Any) -> bool:
    """Plain data (numbers, strings, and tuples, lists and dicts of them): what a module or a step
    function keeps between calls in its attributes (a call counter, a step), which a copy made
    once would not follow."""
    if isinstance(value, _SIMPLE):
        return True
    if isinstance(value, (tuple, list)):
        return all(_simple(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _SIMPLE) and _simple(v) for k, v in value.items())
    return False


def _attributes(objects: list[Any]) -> list[dict[str, Any]]:
    """Each object's plain-data attributes (torch's own bookkeeping left out), copied."""
    return [{key: copy.deepcopy(value) for key, value in getattr(obj, "__dict__", {}).items()
             if not key.startswith("_") and key != "training" and _simple(value)} for obj in objects]


def _copy(obj: Any) -> Any:
    """A private copy of the user's code (what cannot be copied is used as it is)."""
    try:
        return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - an object holding a lock, a file: the original, as a worker holds it
        return obj


# Where a float32 step exceeds its first bound, what one process's own step is from float64 tells how
# ill-conditioned it is: a difference up to NOISE times that, or ROUNDING_CAP, is rounding too.
NOISE, ROUNDING_CAP = 8, 3e-2


@dataclass
class Found:
    """One process's phase on a global batch: its loss, gradient (flat, divided as the workers
    divide theirs), which parameters the backward reached, and the buffers and frozen parameters left."""

    loss: float
    grad: torch.Tensor
    reached: torch.Tensor
    state: dict[str, torch.Tensor]

    def kept(self) -> "Found":
        """A copy that the next pass of the same reference leaves as it is."""
        return Found(self.loss, self.grad.clone(), self.reached.clone(),
                     {name: t.detach().clone() for name, t in self.state.items()})


def _code(objective: Any) -> list[Any]:
    """The user's objects of an objective whose attributes may change between calls."""
    return [f for f in (objective.step_fn, objective.loss_fn, objective.metric_fn) if f is not None]


class Reference:
    """Worker 0's one process: a private copy of the model over private flat weights and gradients, and
    the step's code copied.

    ``model`` must be the worker's model before it is bound to the shared weights (and before
    batch norm is synchronised): what one process trains.
    """

    def __init__(self, model: nn.Module, layout: FlatLayout, phases: list[PhaseSpec], plan: Plan,
                 dtype: torch.dtype):
        self.model, self.layout, self.plan = copy.deepcopy(model), layout, plan  # the rehearsal copied it too
        self.flat = torch.zeros(layout.padded_numel, dtype=dtype)
        self.grad_flat = torch.zeros(layout.padded_numel, dtype=dtype)
        layout.bind(self.model, self.flat)
        self.params = layout.parameters(self.model)
        self.reached = torch.zeros(len(self.params), dtype=torch.bool)
        for index, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=index: self.reached.__setitem__(i, True))
        self.phases = phases
        self.objectives = [_copy(phase.objective) for phase in phases]
        self.after = [_copy(phase.after_update) for phase in phases]
        self.precision, self.dtype = Precision(plan.settings.precision), dtype
        self.computed_tolerance, self.update_tolerance = tolerances(dtype, plan.settings.precision)
        self._start: dict[str, torch.Tensor] = {}
        self._attributes: list[dict[str, Any]] = []
        self._before = torch.zeros(0, dtype=dtype)

    def phase_start(self, model: nn.Module, index: int, objective: Any) -> None:
        """What the worker's model and phase ``index``'s code hold besides the weights as the phase
        starts: buffers, frozen parameters, and the plain data their objects keep (a call counter)."""
        self._start = {name: t.detach().clone() for name, t in _state(model).items()}
        self._attributes = _attributes([*model.modules(), *_code(objective)])

    def _load_start(self, index: int) -> None:
        for obj, attributes in zip([*self.model.modules(), *_code(self.objectives[index])], self._attributes):
            for key, value in attributes.items():
                setattr(obj, key, value)
        held = _state(self.model)
        with torch.no_grad():
            for name, value in self._start.items():
                mine = held.get(name)
                if mine is not None and mine.shape == value.shape and mine.dtype == value.dtype:
                    mine.copy_(value)
                else:  # a buffer the forward replaced with another shape: replaced here too
                    module_name, _, leaf = name.rpartition(".")
                    owner = self.model.get_submodule(module_name) if module_name else self.model
                    owner._buffers[leaf] = value.clone()

    def gradient(self, index: int, batches: list[tuple[Any, int]], flat: torch.Tensor, step: int) -> Found:
        """Forward and backward of phase ``index`` on the global batch's micro-batches, from ``flat``'s
        weights and the phase's starting state, as one process computes them: the loss, the
        gradient (in ``grad_flat``), divided as the workers divide theirs, and the state left."""
        self.flat.copy_(flat)
        self._before = flat.clone()
        self._load_start(index)
        self.grad_flat.zero_()
        self.layout.attach_gradients(self.model, self.grad_flat)  # backward accumulates there
        self.reached.zero_()
        objective, settings = self.objectives[index], self.plan.settings
        loss_sum = count = 0.0
        lowest = self.dtype
        with random_state.kept(), gathering(Gathering()), torch.enable_grad():
            for micro, (batch, samples) in enumerate(batches):
                if samples == 0:
                    continue
                where = position.in_training(step, micro, self.plan.steps_per_epoch, settings.accumulate)
                with position.at(position.checking(where)):
                    micro_loss, micro_count = objective.train_terms(self.model, batch, samples, self.precision,
                                                                    self.dtype)
                micro_loss.backward()
                loss_sum += micro_loss.item()
                count += micro_count
                if micro_loss.is_floating_point() and torch.finfo(micro_loss.dtype).bits < torch.finfo(lowest).bits:
                    lowest = micro_loss.dtype
        self.computed_tolerance = tolerances(lowest, settings.precision)[0]
        if objective.divides and count > 0:
            self.grad_flat.div_(count)
            loss_sum /= count
        return Found(loss_sum, self.grad_flat, self.reached.clone(), _state(self.model))

    def in_float64(self, index: int, batches: list[tuple[Any, int]], step: int) -> Found | None:
        """The last ``gradient`` again in float64, without autocast, on a float64 copy of the model:
        how far rounding moved one process's own step (None where the step cannot run so: a model
        or step that keeps a lower dtype of its own)."""
        twin = copy.deepcopy(self.model).double()
        objective = _copy(self.objectives[index])
        for p in twin.parameters():
            p.grad = None
        params = self.layout.parameters(twin)
        for i, p in enumerate(params):
            with torch.no_grad():
                p.copy_(self.layout.view(self.flat, i))
        reached = torch.zeros(len(params), dtype=torch.bool)
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: reached.__setitem__(i, True))
        state = _state(twin)
        with torch.no_grad():
            for name, value in self._start.items():
                if name in state and state[name].shape == value.shape:
                    state[name].copy_(value)
        settings, loss_sum, count = self.plan.settings, 0.0, 0.0
        try:
            with random_state.kept(), gathering(Gathering()), torch.enable_grad():
                for micro, (batch, samples) in enumerate(batches):
                    if samples == 0:
                        continue
                    where = position.in_training(step, micro, self.plan.steps_per_epoch, settings.accumulate)
                    wide = map_tensors(batch, lambda t: t.double() if t.is_floating_point() else t)
                    with position.at(position.checking(where)):
                        micro_loss, micro_count = objective.train_terms(twin, wide, samples, Precision("fp32"),
                                                                        torch.float64)
                    micro_loss.backward()
                    loss_sum += micro_loss.item()
                    count += micro_count
        except Exception:  # noqa: BLE001 - a part that keeps its own dtype: no float64 step to measure against
            return None
        grad = torch.zeros(self.layout.padded_numel, dtype=torch.float64)
        for i, p in enumerate(params):
            if p.grad is not None:
                self.layout.view(grad, i).copy_(p.grad)
        divided = objective.divides and count > 0
        if divided:
            grad.div_(count)
        return Found(loss_sum / count if divided else loss_sum, grad, reached, _state(twin))

    def compare_computed(self, found: Found, loss: float, theirs: torch.Tensor, unused: tuple[int, ...],
                         model: nn.Module, rounding: Found | None = None) -> Difference | None:
        """The workers' loss, gradient (``theirs``, divided as they divide it) and what their forward
        passes left in ``model`` against one process's (``found``); the worst difference beyond
        rounding, or None. ``rounding``: one process's step again in float64; where given, a
        difference up to ``NOISE`` times how far that is from ``found`` counts as rounding too (a
        float32 net's batch norms and ReLUs can move a small gradient by a percent from rounding
        alone, where float64 moves it by 1e-14)."""
        tolerance, layout = self.computed_tolerance, self.layout

        def allowed(other: Callable[[Found], torch.Tensor], floor: float = 0.0) -> float:
            if rounding is None:
                return tolerance
            return max(tolerance, ROUNDING_CAP, NOISE * relative(other(rounding), other(found), floor))

        worst = (relative(torch.tensor(loss), torch.tensor(found.loss)), "the loss",
                 allowed(lambda f: torch.tensor(f.loss)))
        scale = _norm(theirs)
        for index, slot in enumerate(layout.slots):
            reached = bool(found.reached[index])
            if reached == (index in unused):
                return Difference(f"whether {slot.name} gets a gradient (one process: {'yes' if reached else 'no'}, "
                                  f"the workers: {'no' if reached else 'yes'})", math.inf, tolerance, update=False)
            span = slice(slot.offset, slot.stop)
            floor = scale * math.sqrt(slot.numel / layout.numel)  # this parameter's share of the whole gradient
            off = relative(theirs[span], found.grad[span], floor)
            bound = allowed(lambda f, span=span: f.grad[span], floor)
            if not off / bound <= worst[0] / worst[2]:
                worst = (off, f"the gradient of {slot.name}", bound)
        buffers = dict(model.named_buffers())
        for name, value in _state(model).items():
            other = found.state.get(name)
            if other is None or other.shape != value.shape:
                off = math.inf
            elif value.is_floating_point() or value.is_complex():
                off = relative(value, other)
            else:
                off = 0.0 if torch.equal(value, other) else math.inf
            bound = allowed(lambda f, name=name: f.state[name]) if math.isfinite(off) and value.is_floating_point() \
                else tolerance
            if not off / bound <= worst[0] / worst[2]:
                worst = (off, f"{'buffer' if name in buffers else 'frozen parameter'} {name}", bound)
        off, what, bound = worst
        return Difference(what, off, bound, update=False) if not off <= bound else None

    def update(self, index: int, theirs: torch.Tensor, unused: tuple[int, ...], parts: list[dict[str, Any] | None],
               step: int) -> None:
        """Phase ``index``'s optimizer step as one process takes it, on the workers' own gradient
        (``theirs``, divided as they divide it), from the state their shards held (``parts``: each
        worker's ``optimizer.state_dict()``), clipped as plain PyTorch clips; then after_update."""
        spec, settings, layout = self.phases[index], self.plan.settings, self.layout
        if spec.optimizer is None:
            return
        optimizer = spec.optimizer(optimizer_state.group_params(self.params, range(len(self.params)),
                                                                spec.group_options, spec.slot_groups))
        if any(part is not None for part in parts):
            _load(optimizer, optimizer_state.gather(parts, layout, spec.slot_groups), layout, spec)
        for i, p in enumerate(self.params):
            p.grad = None if i in unused or spec.slot_groups[i] is None else layout.view(theirs, i)
        if settings.clip_grad_norm is not None:
            clipped = self.params if len(self.phases) == 1 else \
                [p for p, group in zip(self.params, spec.slot_groups) if group is not None]
            torch.nn.utils.clip_grad_norm_([p for p in clipped if p.grad is not None], settings.clip_grad_norm)
        with scaled_lr(optimizer, self.plan.lr_factor(step + 1)):
            optimizer.step()
        if self.after[index] is not None:
            with torch.no_grad():
                self.after[index](self.model)

    def compare_update(self, flat: torch.Tensor) -> Difference | None:
        """The workers' updated weights against one process's; the worst difference beyond rounding, or
        None (also where the update overflowed: the run's own check of its weights says that)."""
        layout, before, mine = self.layout, self._before, self.flat
        if not torch.isfinite(flat).all():
            return None
        eps = torch.finfo(mine.dtype).eps
        worst = (0.0, "")
        for slot in layout.slots:
            span = slice(slot.offset, slot.stop)
            theirs, ours, start = flat[span], mine[span], before[span]
            moved = max(torch.dist(theirs, start).item(), torch.dist(ours, start).item(), 10 * eps * _norm(start))
            off = torch.dist(theirs, ours).item() / moved if moved > 0 else 0.0
            if not off <= worst[0]:
                worst = (off if math.isfinite(off) else math.inf, f"the update of {slot.name}")
        off, what = worst
        return Difference(what, off, self.update_tolerance, update=True) if not off <= self.update_tolerance else None


def _load(optimizer: torch.optim.Optimizer, gathered: dict[str, Any], layout: FlatLayout, spec: PhaseSpec) -> None:
    """Load a gathered optimizer state (per parameter name, ``memory.state.gather``'s) into an
    optimizer over one process's whole parameters, built with the phase's groups."""
    slots = [i for i, group in enumerate(spec.slot_groups) if group is not None]
    if spec.group_options is not None:  # group_params numbers them group by group
        slots.sort(key=lambda i: spec.slot_groups[i])
    current = optimizer.state_dict()
    state = {number: gathered["state"][layout.slots[i].name] for number, i in enumerate(slots)
             if layout.slots[i].name in gathered["state"]}
    groups = [{**group, **{k: v for k, v in saved.items() if k != "params"}}
              for group, saved in zip(current["param_groups"], gathered["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


@contextmanager
def borrowed(cpus: tuple[int, ...], threads: int):
    """This thread on ``cpus`` with ``threads`` intra-op threads while the block runs (the peers
    asleep lend theirs), then pinned and sized as before: the run's own steps compute as they did."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    mine, held = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(held)
        os.sched_setaffinity(0, mine)


class Bell:
    """A word of shared memory (int32) the node's other workers sleep on while worker 0 verifies:
    asleep, they lend it their cores. A peer that dies meanwhile is the launcher's to see."""

    def __init__(self, word: torch.Tensor):
        self.word = word

    def ring(self, generation: int) -> None:
        self.word[0] = generation
        if SHM_SAFE:
            futex.wake(self.word.data_ptr())

    def wait(self, generation: int) -> None:
        while (seen := int(self.word[0])) != generation:
            if SHM_SAFE:
                futex.wait(self.word.data_ptr(), seen, 0.05)
            else:
                time.sleep(0.001)


@dataclass
class Peers:
    """What a worker's verification needs of the run around it."""

    rank: int  # within the node
    workers: int  # of the node
    barrier: Callable[[], None]
    global_sum: Callable[[torch.Tensor], torch.Tensor]
    state_file: Callable[[int], str]  # where worker r leaves its optimizer state for worker 0 to read
    bell: Bell
    cores: tuple[int, ...]  # every worker's of the node: worker 0 computes on them while the others sleep
    threads: int  # the node's workers' intra-op threads, together


class Verification:
    """One worker's part in verifying its run: at a verified step it hands over its shard of the
    summed gradient (into ``grads``, shared by the node's workers) and its optimizer state; worker 0
    also compares (``reference``) while the others sleep. Every worker learns the verdict at once.

    A difference stops the run (``NotExact``, in every worker) unless the user consented to what
    it means: ``split="like_ddp"`` for what the step computes, a ``shards`` setting sn_trainer has
    not proven for the optimizer (``plan.unproven``) for the update. Then the run trains on,
    relabelled from that step, and nothing more is verified. Where one process's step itself
    fails (the user's code on the global batch), the run trains on, said unverified from there.
    """

    def __init__(self, plan: Plan, peers: Peers, grads: torch.Tensor, shard: tuple[int, int],
                 reference: Reference | None):
        self.plan, self.peers, self.grads, self.shard, self.reference = plan, peers, grads, shard, reference
        self.schedule = Schedule(plan.settings.verify_every, plan.start_step, plan.total_steps - 1)
        self.verified: list[int] = []  # steps (from 1) every phase of which was found equal
        self.relabelled: str | None = None  # what the run became after a consented difference
        self._last_equal = plan.start_step  # the last step (from 1) known equal, or where the launch began
        self._rings = 0
        self._failure = ""

    def due(self, step: int) -> bool:
        return self.relabelled is None and self.schedule.due(step)

    def phase_start(self, model: nn.Module, index: int, objective: Any) -> None:
        """As verified phase ``index`` starts: worker 0 keeps what the model and the phase's code
        hold besides the weights, and nobody's forward writes a frozen parameter before it has (a
        barrier)."""
        if self.relabelled is not None:  # all workers know it: the agreement was global
            return
        if self.reference is not None:
            self.reference.phase_start(model, index, objective)
        self.peers.barrier()

    def after_reduce(self, step: int, index: int, shard_grad: torch.Tensor, optimizer: torch.optim.Optimizer | None,
                     whole: Callable[[], list[tuple[Any, int]]], flat: torch.Tensor, totals, model: nn.Module,
                     timer) -> None:
        """After phase ``index``'s reduce, before its update: one process's forward and backward
        compared with the workers'.

        Raises:
            NotExact: they differ, and the user did not consent to train on so.
        """
        if self.relabelled is not None:
            return
        start, stop = self.shard
        with timer("verify"):
            self.grads[start:stop].copy_(shard_grad)
            own = optimizer.state_dict() if optimizer is not None else None
            if self.reference is None:  # worker 0 reads the others' from files; its own it holds
                torch.save(own, self.peers.state_file(self.peers.rank))
        with timer("wait"):
            self.peers.barrier()  # every shard of the gradient and of the optimizer's state is there
        self._rings += 1
        difference = None
        if self.reference is None:
            with timer("wait"):
                self.peers.bell.wait(self._rings)
        else:
            with timer("verify"):
                try:
                    difference = self._compare_computed(step, index, whole, flat, totals, model, own)
                except Exception as exc:  # noqa: BLE001 - the user's code on the global batch: the run goes on
                    self._failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
                finally:
                    self.peers.bell.ring(self._rings)
        self._agree(step, difference, timer)

    def _compare_computed(self, step, index, whole, flat, totals, model, own) -> Difference | None:
        reference = self.reference
        divides = reference.objectives[index].divides
        theirs = self.grads / totals.count if divides and totals.count > 0 else self.grads.clone()
        loss = totals.loss_sum / totals.count if divides and totals.count > 0 else totals.loss_sum
        batches = whole()
        with borrowed(self.peers.cores, self.peers.threads):
            found = reference.gradient(index, batches, flat, step)
            difference = reference.compare_computed(found, loss, theirs, totals.unused, model)
            if difference is not None and math.isfinite(difference.off) and reference.dtype != torch.float64:
                # Beyond the first bound: how far does rounding alone move one process's own step?
                # The same step in float64 tells (a step that is off stays off in any precision).
                found = found.kept()
                rounding = reference.in_float64(index, batches, step)
                if rounding is not None:
                    difference = reference.compare_computed(found, loss, theirs, totals.unused, model, rounding)
            if difference is None:
                parts = [own if rank == self.peers.rank else torch.load(self.peers.state_file(rank), weights_only=False)
                         for rank in range(self.peers.workers)]
                reference.update(index, theirs, totals.unused, parts, step)
        return difference

    def after_update(self, step: int, flat: torch.Tensor, timer, last_phase: bool) -> None:
        """After a phase's update (every shard written): one process's update compared with the
        workers'; the step counts as verified once its last phase was.

        Raises:
            NotExact: they differ, and the user did not consent to train on so.
        """
        if self.relabelled is not None:  # found so in this step's computation already: its update has no reference
            return
        with timer("wait"):
            self.peers.barrier()
        difference = None
        if self.reference is not None:
            with timer("verify"):
                difference = self.reference.compare_update(flat)
        self._agree(step, difference, timer)
        if last_phase and self.relabelled is None:
            self.verified.append(step + 1)
            self._last_equal = step + 1

    def _agree(self, step: int, difference: Difference | None, timer) -> None:
        """Every worker of every node learns whether any worker 0 found a difference, or could not
        compare: stop, relabel or go on."""
        verdict = torch.zeros(3, dtype=torch.float64)
        if difference is not None:
            verdict[1 if difference.update else 0] = 1.0
        verdict[2] = float(bool(self._failure))
        with timer("wait"):
            verdict = self.peers.global_sum(verdict)
        if not verdict.any():
            return
        if verdict[2] > 0 and not verdict[:2].any():
            self.relabelled = (f"unverified from step {step + 1}: one process's step on the global batch raised "
                               f"{self._failure or '(on another node)'}; {self._seen()}")
            return
        update = bool(verdict[1] > 0)
        consent = bool(self.plan.unproven) if update else self.plan.settings.split == "like_ddp"
        said = self._message(step, difference, update)
        if consent:
            self.relabelled = f"{'not exact' if update else 'like DDP'} from step {step + 1}: {said}"
            return
        raise NotExact(said if difference is not None else
                       f"step {step + 1} differs from one process's step on the same global batch (worker 0 found "
                       "it; its message says how)")

    def _seen(self) -> str:
        verified = self.verified
        return f"steps {_listed(verified)} were verified equal" if verified else "no step was verified before it"

    def _message(self, step: int, difference: Difference | None, update: bool) -> str:
        done = step + 1
        unverified = (f"; steps {self._last_equal + 1}-{done - 1} were not verified and may have trained off"
                      if done - 1 > self._last_equal else "")
        found = difference.said() if difference is not None else "another node's worker 0 found it"
        if update:
            return (f"step {done}'s update differs from one process's on the same gradient and optimizer state: "
                    f"{found}; {self._seen()}{unverified}; the update was applied. "
                    + ("; ".join(self.plan.unproven) if self.plan.unproven else UPDATE_ADVICE))
        return (f"step {done} differs from one process's step on the same global batch: {found}; {self._seen()}"
                f"{unverified}; no update was applied for step {done}. Likely cause: {SPLIT_ADVICE}")


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]}"
