"""One process's step, as worker 0 of a verified run computes it beside the workers'
(``engine.step.verification``): a private copy of the model over private flat weights and
gradients, the step's code copied, and what it finds against what the workers computed.

From the weights, buffers, frozen parameters and plain attributes (a call counter) the workers
started a phase with, on the global batch read and collated as a plain DataLoader collates it:
forward and backward of every micro-batch, compared with the workers' loss, gradient and buffers
(``gradient``, ``compare_computed``; a float32 step beyond its first bound is computed again in
float64, ``in_float64``, to tell rounding from a difference); then the optimizer's step from the
state every worker's shard held, on the workers' own gradient, and after_update, compared with
the weights they updated (``update``, ``compare_update``). Its copies touch nothing of the run:
random streams are kept and put back, and the user's code that runs is a copy.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...data import random_state
from ...data.batching import map_tensors
from ..memory import state as optimizer_state
from ...recipe.flat_layout import FlatLayout
from ..plan import Plan
from ...recipe import position
from ...recipe.gather import Gathering, gathering
from ...recipe.objective import Precision
from .phases import PhaseSpec, scaled_lr


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
