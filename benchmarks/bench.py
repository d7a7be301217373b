"""Side by side, in one process tree: plain PyTorch, DDP on gloo, sn_trainer, and the "ideal" ceiling.

(a) plain: one process, every physical core as an intra-op thread;
(b) ddp:   DistributedDataParallel on gloo, W processes pinned to a core each, 1 thread each;
(c) sn:    sn_trainer with W workers (comm=auto), 1 thread each;
(d) ideal: W independent pinned processes, each training its own replica on B/W samples with
           no communication at all: the ceiling of data parallelism on this machine; each keeps
           freed memory for its next step as sn_trainer's workers do (glibc's malloc; heap_bench.py
           measures that alone);
(e) ideal in lockstep: the same, meeting at a barrier (multiprocessing's) before each update and
           moving no data: the ceiling of synchronous data parallelism, where every step waits for
           the slowest worker's step;
(f) ideal over shared memory: W pinned processes training ONE set of parameters held once in
           shared memory, each summing its shard of the gradient rows (sn_trainer's shared-memory
           reducer, alone) and updating that shard with its own optimizer, in a plain loop: what
           the design costs where the cores exchange a step's gradients and weights, with
           nothing else of sn_trainer's (its data feed, bookkeeping, checks and stage timers).
Every image case runs in fp32 with contiguous tensors, in fp32 with channels_last (sn_trainer's
default for conv nets without batch norm, given to every variant alike), and in bf16 with
channels_last; batch-norm nets also with sn_trainer's sync_batchnorm (its cost); a small GPT
on character windows reports tokens/s. Rounds alternate over every variant and case, so that
drift on a shared machine hits all alike; ratios are of medians. Also: sn_trainer with 1
worker (scaling), sn_trainer reading each batch inline (prefetch=false) against its read-ahead
thread as prefetch=auto decides (what the thread costs or gains on one core), achieved GFLOP/s against the matmul peak measured in the same run, and the
memory of whole process trees (launcher and workers, the dataset made once and shared the
same way in each), resnet18, sn vs DDP.

    python benchmarks/bench.py              # the full table (about 30 minutes on 2 cores)
    python benchmarks/bench.py --cases 'lenet b64 cl,gpt b32' --rounds 2   # some rows
"""
from __future__ import annotations

import argparse
import ctypes.util
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset

from sn_trainer import Trainer
from sn_trainer.data.sampler import slice_bounds
from sn_trainer.node.runtime import (Runtime, available_allocators, available_openmps, default_runtime,
                                     forget_openmp_registrations, keep_freed_memory)
from sn_trainer.node.topology import plan_pinning, read_topology
from sn_trainer.models import build_model
from sn_trainer.models.gpt import GPT as GPTModel
from sn_trainer.models.gpt import language_model_step
from sn_trainer.node.cpu import bf16_supported
from sn_trainer.engine.collectives.in_node import ShmReducer, ShmShared
from sn_trainer.engine.collectives.reducer import ReducerSetup
from sn_trainer.engine.memory.peak import pss_bytes
from sn_trainer.recipe.flat_layout import FlatLayout

import harness

SHAPES = {"lenet": (1, 28, 28), "cifar10_quick": (3, 32, 32), "cifar10_quick_bn": (3, 32, 32),
          "resnet18": (3, 64, 64)}
GPT = {"vocab": 96, "block": 64, "n_layer": 3, "n_head": 4, "n_embd": 128}  # the gpt_text preset's size
VARIANTS = ("plain", "ddp", "sn", "ideal", "ideal_lockstep", "ideal_shared")
# Variants whose name's suffix is no runtime (``sn_jemalloc_intel`` is sn_trainer launched with one):
# other figures of a row, never a launch of their variant.
OTHER_FIGURES = frozenset({"ideal_lockstep", "ideal_shared", "sn_sync", "sn_1worker", "sn_inline"})
RESULT = "bench"


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    precision: str = "fp32"
    channels_last: bool = False

    @property
    def label(self) -> str:
        suffix = " " + "+".join(([self.precision] if self.precision != "fp32" else []) + (["cl"] if self.channels_last else []))
        return f"{self.model} b{self.batch}{suffix.rstrip()}"


    @property
    def batch_norm(self) -> bool:
        return self.model in ("cifar10_quick_bn", "resnet18")

    @property
    def per_sample(self) -> int:
        """What a sample counts: tokens for the GPT, images otherwise."""
        return GPT["block"] if self.model == "gpt" else 1


@dataclass(frozen=True)
class Timing:
    warmup: int
    steps: int

    def for_case(self, case: Case) -> "Timing":
        """resnet18 steps are ~20x LeNet's: fewer of them, so that a round stays minutes long."""
        return Timing(max(2, self.warmup // 4), max(4, self.steps // 5)) if case.model == "resnet18" else self


def make_model(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)
    if case.model == "gpt":
        return GPTModel(GPT["vocab"], GPT["block"], GPT["n_layer"], GPT["n_head"], GPT["n_embd"])
    return build_model(case.model, SHAPES[case.model], 10)


def make_data(case: Case, n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    if case.model == "gpt":
        tokens = torch.randint(0, GPT["vocab"], (n, GPT["block"] + 1), generator=g)
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return TensorDataset(torch.randn(n, *SHAPES[case.model], generator=g), torch.randint(0, 10, (n,), generator=g))


def batch_loss(case: Case, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if case.model == "gpt":
        return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), targets.flatten())
    return torch.nn.functional.cross_entropy(out.float(), targets)


def sgd():
    return functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


# --- the loop every baseline runs: plain PyTorch, nothing of sn_trainer's ----------------------

def random_batch(inputs, targets, batch: int, generator, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` samples drawn at random, as every plain loop here reads its batch."""
    idx = torch.randint(0, len(inputs), (batch,), generator=generator)
    x = inputs[idx]
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, targets[idx]


def step_loss(case: Case, net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The forward pass and the loss, in the case's precision."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16"):
        out = net(x)
    return batch_loss(case, out, y)


def timed_loop(model, data, batch, timing: Timing, case: Case, ddp_model=None, start_line=None,
               step_line=None) -> float:
    """Train ``timing.warmup`` + ``timing.steps`` steps on ``batch`` samples each; seconds of the latter.
    With ``step_line``, every process meets there before each update."""
    inputs, targets = data.tensors
    if case.channels_last:
        model = model.to(memory_format=torch.channels_last)
    net = ddp_model(model) if ddp_model else model
    opt = sgd()(net.parameters())
    generator = torch.Generator().manual_seed(1)
    start = 0.0
    for step in range(timing.warmup + timing.steps):
        if step == timing.warmup:
            if start_line is not None:
                start_line.wait()
            start = time.perf_counter()
        x, y = random_batch(inputs, targets, batch, generator, case)
        opt.zero_grad(set_to_none=False)
        step_loss(case, net, x, y).backward()
        if step_line is not None:
            step_line.wait()
        opt.step()
    return time.perf_counter() - start


def _pin(cpus, threads):
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)


def plain_worker(_rank, case, timing, cpus, data, queue):
    _pin(cpus, len(cpus))
    seconds = timed_loop(make_model(case), data, case.batch, timing, case)
    queue.put(case.batch * timing.steps / seconds)


def ddp_worker(rank, case, timing, pinning, store, data, queue):
    _pin(pinning[rank], 1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a benchmark on one machine: loopback only
    world = len(pinning)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    lo, hi = slice_bounds(case.batch, world, rank)
    wrap = functools.partial(torch.nn.parallel.DistributedDataParallel)
    seconds = timed_loop(make_model(case), data, hi - lo, timing, case, ddp_model=wrap)
    slowest = torch.tensor([seconds])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(case.batch * timing.steps / slowest.item())  # a SimpleQueue writes synchronously
    dist.barrier()
    # Leave without gloo's teardown: destroying the group at exit aborted one process in a few
    # of our runs ("terminate called without an active exception"); the result is already out.
    os._exit(0)


def ideal_worker(rank, case, timing, pinning, allocator, start_line, step_line, data, queue):
    _pin(pinning[rank], 1)
    keep_freed_memory(allocator)  # as sn_trainer's workers: the ceiling runs on the same heap
    lo, hi = slice_bounds(case.batch, len(pinning), rank)
    queue.put(timed_loop(make_model(case), data, hi - lo, timing, case, start_line=start_line, step_line=step_line))


def shared_worker(rank, case, timing, pinning, allocator, start_line, flat, rows, data, queue):
    """(f): this process's slice of each global batch through the one model whose parameters all the
    processes share (``flat``); its shard of the summed gradient (``rows``: sn_trainer's shared-memory
    reducer's) updated by its own optimizer; a barrier before the next step reads the weights."""
    _pin(pinning[rank], 1)
    keep_freed_memory(allocator)
    model, workers = make_model(case), len(pinning)
    if case.channels_last:
        model = model.to(memory_format=torch.channels_last)
    layout = FlatLayout(model, workers, channels_last=case.channels_last)
    layout.bind(model, flat)  # the launcher copied the first model's values in
    shard = layout.shards[rank]
    reducer = ShmReducer(ReducerSetup(rank, workers, shard, layout.padded_numel, flat.dtype, store_path="",
                                      mode="sum", timeout_s=300.0, shared=rows))
    layout.attach_gradients(model, reducer.grad_flat)
    piece = torch.nn.Parameter(flat[shard.start : shard.stop])
    piece.grad = reducer.shard_grad
    opt = sgd()([piece])
    inputs, targets = data.tensors
    lo, hi = slice_bounds(case.batch, workers, rank)
    generator, start = torch.Generator().manual_seed(1), 0.0
    for step in range(timing.warmup + timing.steps):
        if step == timing.warmup:
            start_line.wait()
            start = time.perf_counter()
        x, y = random_batch(inputs, targets, hi - lo, generator, case)
        reducer.grad_flat.zero_()
        step_loss(case, model, x, y).backward()
        reducer.reduce()
        reducer.shard_grad.div_(workers)  # the mean of the slices' mean gradients
        opt.step()
        reducer.barrier()  # nobody reads weights still being written
    seconds = time.perf_counter() - start
    reducer.close()
    queue.put(seconds)


def matmul_peak_worker(rank, dtype, pinning, start_line, queue):
    _pin(pinning[rank], 1)
    a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    for _ in range(3):
        a @ b
    start_line.wait()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    queue.put(2 * 1024**3 * reps / (time.perf_counter() - start) / 1e9)


def runtime_of(variant: str) -> Runtime:
    """The runtime a variant's name asks for: ideal_tcmalloc, sn_jemalloc_intel (OpenMP), sn (defaults)."""
    parts = [] if variant in OTHER_FIGURES else variant.split("_")[1:]
    return Runtime(parts[0] if parts else "system", parts[1] if len(parts) > 1 else "gnu")


@contextmanager
def preloaded(runtime: Runtime):
    """Processes spawned inside run with ``runtime``'s libraries (LD_PRELOAD), as sn_trainer's workers can."""
    libraries, before = runtime.libraries(), os.environ.get("LD_PRELOAD")
    if libraries:
        os.environ["LD_PRELOAD"] = ":".join(libraries)
    try:
        yield
    finally:
        os.environ.pop("LD_PRELOAD", None) if before is None else os.environ.__setitem__("LD_PRELOAD", before)


def spawn(fn, nprocs, *args) -> list:
    """Run ``fn(rank, *args, queue)`` in ``nprocs`` spawned processes; return what they queued."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(fn, args=(*args, queue), nprocs=nprocs, start_method="spawn")
    results = []
    while not queue.empty():
        results.append(queue.get())
    return results


# --- one measurement of each variant -------------------------------------------------------------

# --- the best-launched peers: PyTorch's own CPU launcher, run_cpu -----------------------------------

def _library(name: str) -> Path | None:
    """The file the dynamic loader would take for lib<name>, or None."""
    found = ctypes.util.find_library(name)
    if not found:
        return None
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        if (Path(folder) / found).exists():
            return Path(folder) / found
    return None


def run_cpu_env(tmp: str) -> dict[str, str]:
    """An environment in which run_cpu finds this machine's tcmalloc, jemalloc and Intel OpenMP.

    run_cpu looks for ``libtcmalloc.so``, ``libjemalloc.so`` and ``libiomp5.so`` under
    ``$VIRTUAL_ENV/lib`` (among conda's and /usr/local's); Debian names them by version, and
    intel-openmp (PyPI) puts libiomp5 in this environment's lib/.
    """
    lib = Path(tmp) / "lib"
    lib.mkdir(exist_ok=True)
    targets = {"libtcmalloc.so": _library("tcmalloc_minimal"), "libjemalloc.so": _library("jemalloc"),
               "libiomp5.so": Path(sys.prefix) / "lib" / "libiomp5.so"}
    for name, target in targets.items():
        if target is not None and target.exists():
            (lib / name).symlink_to(target)
    return {**os.environ, "VIRTUAL_ENV": tmp}


def run_cpu_measure(variant: str, case: Case, workers: int, timing: Timing, topology) -> float:
    """Plain PyTorch or DDP, each process launched by ``python -m torch.backends.xeon.run_cpu`` with its
    defaults: tcmalloc (else jemalloc) and Intel OpenMP preloaded, threads and cores set by it."""
    spec = json.dumps({"case": asdict(case), "timing": asdict(timing)})
    launcher = [sys.executable, "-m", "torch.backends.xeon.run_cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        env = run_cpu_env(tmp)
        if variant == "plain_cpu":
            out = subprocess.run([*launcher, "--ninstances", "1", "--ncores-per-instance",
                                  str(topology.physical_cores), "--", __file__, "--one", spec, "plain"],
                                 env=env, capture_output=True, text=True, check=True)
            return float(out.stdout.strip().splitlines()[-1])
        procs = [subprocess.Popen([*launcher, "--ninstances", str(workers), "--ncores-per-instance", "1", "--rank",
                                   str(r), "--", __file__, "--one", spec, f"ddp:{r}:{workers}:{tmp}/store"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for r in range(workers)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        return float(outputs[0].strip().splitlines()[-1])


def one(spec: str, what: str) -> None:
    """One process of a run_cpu-launched variant: print samples/s (DDP: rank 0, the slowest rank's)."""
    raw = json.loads(spec)
    case, timing = Case(**raw["case"]), Timing(**raw["timing"])
    data = make_data(case)
    if what == "plain":
        print(case.batch * timing.steps / timed_loop(make_model(case), data, case.batch, timing, case))
        return
    _, rank, world, store = what.split(":", 3)
    rank, world = int(rank), int(world)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    lo, hi = slice_bounds(case.batch, world, rank)
    seconds = torch.tensor([timed_loop(make_model(case), data, hi - lo, timing, case,
                                       ddp_model=torch.nn.parallel.DistributedDataParallel)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(case.batch * timing.steps / seconds.item(), flush=True)
    dist.barrier()
    # Leaving without the exit handlers (gloo's teardown, as ddp_worker) skips Intel's OpenMP's too, which
    # run_cpu preloads: its registration in /dev/shm is this process's to remove.
    forget_openmp_registrations([os.getpid()])
    os._exit(0)


def measure(variant: str, case: Case, workers: int, timing: Timing, topology, data=None) -> float:
    """Samples/s of one variant. The dataset is made once, here, and reaches every process the same
    way (shared memory), so memory compares like with like."""
    if variant in ("plain_cpu", "ddp_cpu"):
        return run_cpu_measure(variant, case, workers, timing, topology)
    pinning = plan_pinning(topology, workers, 1)
    data = data if data is not None else make_data(case)
    for t in data.tensors:
        t.share_memory_()
    if variant.startswith("plain"):  # plain_tcmalloc_intel: plain PyTorch with that allocator and OpenMP
        cpus = tuple(c.cpus[0] for c in topology.cores)
        with preloaded(runtime_of(variant)):
            return spawn(plain_worker, 1, case, timing, cpus, data)[0]
    if variant == "ddp":
        with tempfile.TemporaryDirectory() as tmp:
            return spawn(ddp_worker, workers, case, timing, pinning, f"{tmp}/store", data)[0]
    if variant == "ideal_shared":
        return case.batch * timing.steps / shared_seconds(case, workers, timing, pinning, data)
    if variant.startswith("ideal"):
        start_line = mp.get_context("spawn").Barrier(workers)
        step_line = mp.get_context("spawn").Barrier(workers) if variant == "ideal_lockstep" else None
        # A global batch is done when its last slice is: like DDP's and sn_trainer's, the
        # ideal's rate is the slowest process's (summing each process's own rate would credit
        # the time one of them runs on after the other has stopped).
        runtime = runtime_of(variant)
        with preloaded(runtime):  # ideal_tcmalloc_intel: the ideal with that allocator and OpenMP
            seconds = max(spawn(ideal_worker, workers, case, timing, pinning, runtime.allocator, start_line,
                                step_line, data))
        return case.batch * timing.steps / seconds
    runtime = runtime_of(variant) if variant not in OTHER_FIGURES else default_runtime()
    result = Trainer(workers=workers, threads=1, batch_size=case.batch, max_steps=timing.warmup + timing.steps,
                     measure_after=timing.warmup, precision=case.precision, channels_last=case.channels_last,
                     sync_batchnorm=variant == "sn_sync", allocator=runtime.allocator, openmp=runtime.openmp,
                     prefetch=False if variant == "sn_inline" else "auto",
                     log_every=10**9, verify_every=0).fit(  # speed alone: verify_cost.md has a check's
        make_model(case), data, optimizer=sgd(), step_fn=language_model_step if case.model == "gpt" else None)
    return result.samples_per_sec


def shared_seconds(case: Case, workers: int, timing: Timing, pinning, data) -> float:
    """(f)'s timed seconds: the slowest process's, as the ideal's. The parameters and the gradient rows are
    made here, before the processes start, as sn_trainer's launcher makes them."""
    model = make_model(case)
    layout = FlatLayout(model, workers, channels_last=case.channels_last)
    flat = torch.zeros(layout.padded_numel).share_memory_()
    layout.bind(model, flat, copy_values=True)
    rows = ShmShared.allocate(workers, layout.padded_numel, flat.dtype)
    try:
        return max(spawn(shared_worker, workers, case, timing, pinning, default_runtime().allocator,
                         mp.get_context("spawn").Barrier(workers), flat, rows, data))
    finally:
        rows.release()


def matmul_peak(dtype, workers, topology) -> float:
    pinning = plan_pinning(topology, workers, 1)
    start_line = mp.get_context("spawn").Barrier(workers)
    return sum(spawn(matmul_peak_worker, workers, dtype, pinning, start_line))


def flops_per_sample(case: Case) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    model, (inputs, targets) = make_model(case), make_data(case, n=case.batch).tensors
    with FlopCounterMode(display=False) as counter:
        batch_loss(case, model(inputs), targets).backward()
    return counter.get_total_flops() / case.batch


# --- memory: whole process trees (launcher and workers), each variant in a process of its own ----

def tree_pss(root: psutil.Process) -> int:
    """Summed PSS of ``root`` and all its descendants (0 for those that just ended)."""
    total = pss_bytes(root.pid)
    for child in root.children(recursive=True):
        total += pss_bytes(child.pid)
    return total


MEMORY_CASE, MEMORY_TIMING = Case("resnet18", 32), Timing(warmup=3, steps=12)
TINY_MEMORY_CASE, TINY_MEMORY_TIMING = Case("lenet", 8), Timing(warmup=1, steps=2)


def memory_probe(variant: str, workers: int, tiny: bool) -> None:
    """Run one variant of the memory case in this process (its launcher); ``memory_comparison`` samples it."""
    case, timing = (TINY_MEMORY_CASE, TINY_MEMORY_TIMING) if tiny else (MEMORY_CASE, MEMORY_TIMING)
    measure(variant, case, workers, timing, read_topology())


def memory_comparison(workers: int, tiny: bool = False) -> dict:
    """Peak summed PSS of each variant's whole process tree, the launcher included, sampled every 0.2 s."""
    out = {}
    for variant in ("sn", "ddp"):
        probe = subprocess.Popen([sys.executable, __file__, "--memory-probe", variant, "--workers", str(workers),
                                  *(["--tiny"] if tiny else [])])
        root, peak = psutil.Process(probe.pid), 0
        while probe.poll() is None:
            try:
                peak = max(peak, tree_pss(root))
            except psutil.Error:
                pass
            time.sleep(0.2)  # sampling another process's memory: there is nothing to wait on instead
        if probe.returncode != 0:
            raise RuntimeError(f"the memory probe of {variant} failed with {probe.returncode}")
        out[variant] = peak
    out["ratio_sn_over_ddp"] = out["sn"] / out["ddp"]
    return out


# --- the run -------------------------------------------------------------------------------------

ALLOCATED = [a for a in ("jemalloc", "tcmalloc") if a in available_allocators()]
# With Intel's OpenMP in place of torch's GNU one, as run_cpu launches the peers: each allocator.
WITH_INTEL_OPENMP = [f"{a}_intel" for a in ("system", *ALLOCATED)] if "intel" in available_openmps() else []


def variants_of(case: Case, runtimes: bool = False, launches: tuple[str, ...] | None = None) -> tuple[str, ...]:
    extra = ("sn_sync",) if case.batch_norm else ()  # the cost of sync_batchnorm
    if runtimes:  # every variant with its best launch: plain PyTorch, the ideal and sn_trainer with each
        # allocator x OpenMP runtime alike (or those of ``launches``), and run_cpu's own launch for plain PyTorch and DDP
        launches = (*ALLOCATED, *WITH_INTEL_OPENMP) if launches is None else launches
        extra += ("plain_cpu", "ddp_cpu", *(f"{variant}_{a}" for variant in ("plain", "ideal", "sn") for a in launches))
    return (*VARIANTS, *extra, "sn_1worker", "sn_inline")


def best_of(med: dict[str, float], prefix: str) -> tuple[str, float]:
    """The fastest of a variant's launches (plain, plain_cpu; sn, sn_tcmalloc...)."""
    name = max({v for v in med if v == prefix or v.startswith(prefix + "_")} - OTHER_FIGURES, key=med.get)
    return name, med[name]


def main() -> None:
    parser = harness.rounds_options(harness.options(__doc__, RESULT))
    parser.add_argument("--memory-probe", choices=("sn", "ddp"), help=argparse.SUPPRESS)
    parser.add_argument("--one", nargs=2, metavar=("SPEC", "WHAT"), help=argparse.SUPPRESS)
    parser.add_argument("--no-launches", action="store_true",
                        help="leave out every variant's other launches (allocators x OpenMP runtimes, run_cpu) and "
                             "their table: the rows' own figures in a third of the time")
    args = parser.parse_args()
    if args.one:
        one(*args.one)
        return
    topology = read_topology()
    workers = args.workers or topology.physical_cores
    if args.memory_probe:
        memory_probe(args.memory_probe, workers, args.tiny)
        return
    if args.tiny:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    timing = Timing(args.warmup, args.steps)
    fp32 = [Case("lenet", 64), Case("lenet", 128), Case("lenet", 256), Case("cifar10_quick", 100),
            Case("cifar10_quick", 200)]
    # The same with channels_last in every variant: sn_trainer's default for conv nets without batch norm.
    cases = fp32 + [Case(c.model, c.batch, "fp32", True) for c in fp32]
    if bf16_supported():
        cases += [Case("cifar10_quick", 100, "bf16", True), Case("cifar10_quick", 200, "bf16", True)]
    else:
        print("this CPU has no native bfloat16: the bf16 rows are left out")
    cases += [Case("cifar10_quick_bn", 100), Case("cifar10_quick_bn", 200), Case("resnet18", 32),
              Case("gpt", 32), Case("gpt", 64)]
    if args.cases:
        cases = harness.picked(parser, cases, args.cases)
    elif args.tiny:  # a row of every table, at a batch of a few samples
        cases = [Case("lenet", 8, "fp32", True)]
    # Best-launched peers on the rows as sn_trainer ships them (channels_last for these conv nets).
    runtime_rows = {c.label for c in cases if c.channels_last and c.precision == "fp32" and not args.no_launches}
    # A tiny run launches each peer with one of those runtimes, the last (tcmalloc with Intel's OpenMP, where both
    # are installed: the one that preloads two libraries).
    launches = (*ALLOCATED, *WITH_INTEL_OPENMP)[-1:] if args.tiny else None

    samples: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for case in cases:
            for variant in variants_of(case, case.label in runtime_rows, launches):
                rate = (measure("sn", case, 1, timing.for_case(case), topology) if variant == "sn_1worker"
                        else measure(variant, case, workers, timing.for_case(case), topology))
                samples.setdefault((case.label, variant), []).append(rate)
                print(f"round {round_index + 1}: {case.label:24s} {variant:10s} {rate:9.1f} samples/s", flush=True)

    # The peak of each precision the rows ran in: theirs is the fraction of it they reach.
    peak = {p: matmul_peak(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[p]), workers, topology)
            for p in sorted({case.precision for case in cases})}
    memory = memory_comparison(workers, args.tiny)
    rows = []
    for case in cases:
        med = {v: statistics.median(samples[(case.label, v)])
               for v in variants_of(case, case.label in runtime_rows, launches)}
        spread = {v: [min(samples[(case.label, v)]), max(samples[(case.label, v)])] for v in med}
        fp32_plain = samples.get((Case(case.model, case.batch).label, "plain"))  # absent when --cases left it out
        gflops = flops_per_sample(case) * med["sn"] / 1e9
        rows.append({"case": case.label, **asdict(case), "per_worker_batch": case.batch / workers,
                     "median": med, "min_max": spread, "per_sample": case.per_sample,
                     "sn_over_plain": med["sn"] / med["plain"], "sn_over_ddp": med["sn"] / med["ddp"],
                     "sn_over_ideal": med["sn"] / med["ideal"], "ddp_over_ideal": med["ddp"] / med["ideal"],
                     "sn_over_lockstep": med["sn"] / med["ideal_lockstep"],
                     "lockstep_over_ideal": med["ideal_lockstep"] / med["ideal"],
                     "sn_over_shared": med["sn"] / med["ideal_shared"],
                     "shared_over_ideal": med["ideal_shared"] / med["ideal"],
                     "sn_over_fp32_plain": med["sn"] / statistics.median(fp32_plain) if fp32_plain else None,
                     "sn_scaling_1_to_w": med["sn"] / med["sn_1worker"],
                     "sync_bn_over_sn": med["sn_sync"] / med["sn"] if "sn_sync" in med else None,
                     "inline_over_sn": med["sn_inline"] / med["sn"],
                     "runtimes": _runtimes(med) if case.label in runtime_rows else None,
                     "sn_gflops": gflops, "sn_fraction_of_peak": gflops / peak[case.precision]})
    report = {"machine": harness.describe(), "workers": workers, "threads_per_worker": 1,
              "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "optimizer": "SGD momentum 0.9",
              "data": "synthetic, in memory, made once and shared with every process", "matmul_peak_gflops": peak,
              "memory_case": (TINY_MEMORY_CASE if args.tiny else MEMORY_CASE).label,
              "memory_pss_bytes": memory, "rows": rows, "command": harness.command()}
    harness.write(harness.out_of(args, RESULT), report, markdown(report))


def _runtimes(med: dict[str, float]) -> dict:
    plain, ideal, sn = best_of(med, "plain"), best_of(med, "ideal"), best_of(med, "sn")
    return {"best_plain": plain, "best_ideal": ideal, "best_sn": sn, "ddp_cpu": med["ddp_cpu"],
            "sn_over_best_plain": sn[1] / plain[1], "ideal_over_best_plain": ideal[1] / plain[1]}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# sn_trainer against plain PyTorch, DDP-gloo and the ideal, W={report['workers']}", "",
             f"{harness.machine_line(m)} `{report['command']}`: {report['rounds']} rounds x {report['steps']} steps "
             f"after {report['warmup']} warm-up (resnet18: a fifth of the steps, a quarter of the warm-up), "
             f"{report['optimizer']}, {report['data']}. The ideal's processes keep freed memory for the next step as "
             "sn_trainer's workers do (glibc's malloc). Samples/s (tokens/s for the GPT) are medians over rounds "
             "[min-max].", "",
             "| case | per-worker batch | plain | DDP-gloo | sn_trainer | ideal | ideal in lockstep "
             "| ideal over shared memory | sn/plain | sn/DDP | sn/ideal | DDP/ideal | lockstep/ideal | sn/lockstep "
             "| shared/ideal | sn/shared | sn 1->W | sn GFLOP/s (of peak) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        med, mm, k = r["median"], r["min_max"], r["per_sample"]
        cell = {v: f"{k * med[v]:.0f} [{k * mm[v][0]:.0f}-{k * mm[v][1]:.0f}]" for v in VARIANTS}
        lines.append(f"| {r['case']} | {r['per_worker_batch']:g} | {cell['plain']} | {cell['ddp']} | {cell['sn']} "
                     f"| {cell['ideal']} | {cell['ideal_lockstep']} | {cell['ideal_shared']} | {r['sn_over_plain']:.2f} "
                     f"| {r['sn_over_ddp']:.2f} | {r['sn_over_ideal']:.2f} | {r['ddp_over_ideal']:.2f} "
                     f"| {r['lockstep_over_ideal']:.2f} | {r['sn_over_lockstep']:.2f} | {r['shared_over_ideal']:.2f} "
                     f"| {r['sn_over_shared']:.2f} | {r['sn_scaling_1_to_w']:.2f}x | {r['sn_gflops']:.1f} "
                     f"({100 * r['sn_fraction_of_peak']:.0f}%) |")
    as_shipped = [r for r in report["rows"] if r["channels_last"] and r["sn_over_fp32_plain"] is not None]
    if as_shipped:  # rows whose contiguous fp32 plain PyTorch ran too
        lines.append("\nsn_trainer as it ships (channels_last=auto: on for conv nets without batch norm) against "
                     "plain PyTorch as usually written (fp32, contiguous), same run:")
    for r in as_shipped:
        lines.append(f"- {r['case']}: sn_trainer / fp32 contiguous plain PyTorch = {r['sn_over_fp32_plain']:.2f}")
    synced = [r for r in report["rows"] if r["sync_bn_over_sn"] is not None]
    if synced:
        lines.append("\nBatch norm over the global batch (`sync_batchnorm=true`) against per-worker statistics, "
                     "same run, samples/s [min-max]:\n\n| case | sn_trainer | sn_trainer, sync_batchnorm | ratio |\n"
                     "|---|---:|---:|---:|")
    for r in synced:
        med, mm = r["median"], r["min_max"]
        lines.append(f"| {r['case']} | {med['sn']:.0f} [{mm['sn'][0]:.0f}-{mm['sn'][1]:.0f}] | "
                     f"{med['sn_sync']:.0f} [{mm['sn_sync'][0]:.0f}-{mm['sn_sync'][1]:.0f}] | "
                     f"{r['sync_bn_over_sn']:.2f} |")
    lines.append("\nsn_trainer reading each batch inline (`prefetch=false`) against `prefetch=auto` (a thread reading "
                 "the next batch where it decides so), same run, samples/s [min-max]:\n\n"
                 "| case | sn_trainer, prefetch=auto | sn_trainer, prefetch=false | inline / auto |\n|---|---:|---:|---:|")
    for r in report["rows"]:
        med, mm, k = r["median"], r["min_max"], r["per_sample"]
        lines.append(f"| {r['case']} | {k * med['sn']:.0f} [{k * mm['sn'][0]:.0f}-{k * mm['sn'][1]:.0f}] | "
                     f"{k * med['sn_inline']:.0f} [{k * mm['sn_inline'][0]:.0f}-{k * mm['sn_inline'][1]:.0f}] | "
                     f"{r['inline_over_sn']:.2f} |")
    launched = [r for r in report["rows"] if r.get("runtimes")]
    if launched:
        lines.append("\nEvery variant with its best launch, same run: plain PyTorch, the ideal and sn_trainer each "
                     "with every allocator, with GNU's OpenMP and with Intel's (`_intel`), plain PyTorch and DDP also "
                     "launched by PyTorch's `python -m torch.backends.xeon.run_cpu` (its defaults: tcmalloc, Intel "
                     "OpenMP, cores and threads set by it); samples/s, the best launch named:\n\n"
                     "| case | plain, best launch | DDP, run_cpu | ideal, best | sn_trainer, best (tuned runtime) "
                     "| sn / best plain | ideal / best plain |\n|---|---|---:|---|---|---:|---:|")
    for r in launched:
        rt = r["runtimes"]
        lines.append(f"| {r['case']} | {rt['best_plain'][1]:.0f} ({rt['best_plain'][0]}) | {rt['ddp_cpu']:.0f} "
                     f"| {rt['best_ideal'][1]:.0f} ({rt['best_ideal'][0]}) | {rt['best_sn'][1]:.0f} "
                     f"({rt['best_sn'][0]}) | {rt['sn_over_best_plain']:.2f} | {rt['ideal_over_best_plain']:.2f} |")
    peak = report["matmul_peak_gflops"]
    lines.append("\nMatmul peak measured in the same run (1024x1024, one pinned process per core): "
                 + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items()) + ". GFLOP/s count the nominal "
                 "operations of direct convolution; oneDNN runs 5x5 convolutions faster than that count allows "
                 "at the matmul's rate, so the fraction can pass 100%: compare rows with it, not with 100%.")
    mem, (model, batch) = report["memory_pss_bytes"], report["memory_case"].split(" b")
    lines.append(f"\n{model} ({'x'.join(map(str, SHAPES[model]))}, batch {batch}), peak summed PSS of the whole "
                 "process tree (launcher, fork server "
                 f"and workers; the dataset made once in the launcher and shared alike): sn_trainer "
                 f"{mem['sn'] / 2**20:.0f} MiB, DDP {mem['ddp'] / 2**20:.0f} MiB, ratio {mem['ratio_sn_over_ddp']:.2f}.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
