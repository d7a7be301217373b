"""Small models, datasets and a reference loop shared by the tests (importable by spawned workers)."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import time
import traceback

import psutil
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


class SmallConvNet(nn.Module):
    """A conv net without batch norm: its result cannot depend on how a batch is split."""

    def __init__(self, channels: int = 1, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(channels, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def tiny_dataset(n: int = 84, seed: int = 1, dtype: torch.dtype = torch.float32) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g))


# The reference loops below share no code with sn_trainer: they draw their global batches with
# torch's own DataLoader, from the order sn_trainer documents (a permutation per epoch, seeded
# with seed * 1_000_003 + epoch), and compute the loss themselves.

def plain_loader(dataset, batch_size: int, seed: int, epoch: int, drop_last: bool = True) -> DataLoader:
    """One epoch of global batches, as a plain DataLoader with a seeded RandomSampler draws them."""
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last)


def plain_batches(dataset, batch_size: int, seed: int, drop_last: bool = True):
    """Global batches one after another, epoch after epoch."""
    for epoch in itertools.count():
        yield from plain_loader(dataset, batch_size, seed, epoch, drop_last)


def plain_indices(n: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The sample indices of global batch ``step`` of the first epoch."""
    sampler = RandomSampler(range(n), generator=torch.Generator().manual_seed(seed * 1_000_003))
    return torch.tensor(list(sampler)[step * batch_size : (step + 1) * batch_size])


def plain_fit(model, dataset, batch_size, steps, seed, optimizer, loss, scheduler=None, drop_last=True, clip=None):
    """Plain PyTorch, written as its users write it, over the same global batches.

    ``optimizer(model)`` builds the optimizer (groups and all); ``loss(model, batch)`` is the
    batch's loss. Gradients are set to None between steps, as ``zero_grad()`` does; the
    modules stay in the modes they were given in.
    """
    opt = optimizer(model)
    sched = scheduler(opt) if scheduler else None
    for _, batch in zip(range(steps), plain_batches(dataset, batch_size, seed, drop_last)):
        opt.zero_grad()
        loss(model, batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
    return model


def cross_entropy(model, batch):
    inputs, targets = batch
    return torch.nn.functional.cross_entropy(model(inputs), targets)


def worker_slices(batch_size: int, workers: int) -> list[tuple[int, int]]:
    """How sn_trainer documents a global batch's split: the first batch % workers take one more."""
    base, extra = divmod(batch_size, workers)
    bounds = [0]
    for rank in range(workers):
        bounds.append(bounds[-1] + base + (1 if rank < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))


# float64 equivalence: summation order moves results by ~1e-16 per operation, so a wrong count
# or a lost term shows far above this, and no CPU's kernels come near it.
EXACT = {"rtol": 1e-10, "atol": 1e-12}


def assert_exact(model, reference, **tolerance):
    """Every parameter (and floating buffer) equal to the reference's in float64, to 1e-10."""
    tolerance = tolerance or EXACT
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.dtype == torch.float64, f"{name} is {p.dtype}: exactness is tested in float64"
        torch.testing.assert_close(p, q, **tolerance, msg=lambda m: f"{name}: {m}")
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, **tolerance, msg=lambda m: f"buffer {name}: {m}")


def assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6):
    """Two runs of sn_trainer (a resume, a restart) against each other, in float32."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


class TinyGPT(nn.Module):
    """A decoder-only transformer in nanoGPT's shape: tied embeddings, forward(idx, targets) -> (logits, loss)."""

    def __init__(self, vocab: int = 11, block: int = 8, embd: int = 16, heads: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, embd)
        self.wpe = nn.Embedding(block, embd)
        self.ln1 = nn.LayerNorm(embd)
        self.qkv = nn.Linear(embd, 3 * embd, bias=False)  # a key bias has a zero gradient: noise AdamW would amplify
        self.proj = nn.Linear(embd, embd)
        self.ln2 = nn.LayerNorm(embd)
        self.mlp = nn.Sequential(nn.Linear(embd, 4 * embd), nn.GELU(), nn.Linear(4 * embd, embd))
        self.ln_f = nn.LayerNorm(embd)
        self.head = nn.Linear(embd, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.heads = heads

    def forward(self, idx, targets=None):
        n, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        shape = (n, t, self.heads, x.shape[-1] // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(n, t, -1))
        x = x + self.mlp(self.ln2(x))
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss


class SwitchLayer(nn.Module):
    """A router and 3 experts, each sample sent to its top expert (Switch Transformer's routing).
    ``collapsing``: a large first input sends a sample to expert 0, by far."""

    def __init__(self, collapsing: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 2) for _ in range(3))
        if collapsing:
            with torch.no_grad():
                self.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [-1.0, 1, 0, 0], [-1.0, 0, 1, 0]]))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top = probs.argmax(-1)
        out = torch.stack([self.experts[int(e)](row) * probs[i, e] for i, (row, e) in enumerate(zip(x, top))])
        return out, probs, top


def switch_step(model, batch):
    """Cross-entropy plus Switch's load-balancing loss: 3 * sum over experts of (the share of the batch
    routed there) x (the batch's mean router probability there). It couples the batch's samples."""
    x, y = batch
    out, probs, top = model(x)
    share = torch.nn.functional.one_hot(top, 3).to(probs.dtype).mean(0)
    return torch.nn.functional.cross_entropy(out, y) + 3 * (share * probs.mean(0)).sum()


def token_dataset(n: int = 48, block: int = 8, vocab: int = 11, seed: int = 1, pad_fraction: float = 0.0):
    """Windows of tokens and their next tokens; a share of the targets set to -1 (padding)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, block + 1), generator=g)
    targets = tokens[:, 1:].clone()
    if pad_fraction:
        targets[torch.rand(targets.shape, generator=g) < pad_fraction] = -1
    return TensorDataset(tokens[:, :-1].contiguous(), targets)


def in_a_worker() -> bool:
    """Whether the calling code runs inside a worker's training step or evaluation (not the
    rehearsal before the run, which may run in the test's own process, calling the model as often
    as it needs, nor the verification's copy of the step): the faults below count only these calls."""
    from sn_trainer.recipe import position

    where = position._current.get()
    return where is not None and not where.checking


class Bomb(nn.Module):
    """Wraps a model; on its ``at_call``-th forward in a worker, the first worker to get there fails.

    The flag file decides which worker (O_EXCL: exactly one wins) and records when it failed,
    so a test can time the teardown from the failure itself.
    """

    def __init__(self, inner: nn.Module, flag_path: str, action: str, at_call: int = 3):
        super().__init__()
        self.inner, self.flag_path, self.action, self.at_call = inner, flag_path, action, at_call
        self.calls = 0

    def forward(self, x):
        self.calls += in_a_worker()
        if self.calls == self.at_call:
            try:
                fd = os.open(self.flag_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return self.inner(x)
            os.write(fd, f"{time.time()} {os.getpid()}".encode())
            os.close(fd)
            if self.action == "raise":
                raise RuntimeError("boom: injected failure")
            os.kill(os.getpid(), 9)
        return self.inner(x)


class ReportsPlacement(nn.Module):
    """Wraps a model; every forward in a worker appends this process's pid, session, CPUs and torch
    thread counts to a JSON-lines file, so a test sees where each worker really ran."""

    def __init__(self, inner: nn.Module, path: str):
        super().__init__()
        self.inner, self.path = inner, path

    def forward(self, x):
        if not in_a_worker():  # the rehearsal's calls, wherever it runs, are no worker's
            return self.inner(x)
        line = json.dumps({"pid": os.getpid(), "session": os.getsid(0), "cpus": sorted(os.sched_getaffinity(0)),
                           "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads()})
        with open(self.path, "a") as log:  # one short append per call: whole lines from every process
            log.write(line + "\n")
        return self.inner(x)


@contextlib.contextmanager
def leaks_checked():
    """Assert that the block leaves no child process, no new /dev/shm entry and no shared-memory segment
    that would outlive its processes behind."""
    before = shared_memory()
    yield
    assert live_children() == []
    assert shared_memory().new_since(before) == SharedMemory(set(), set())


@dataclasses.dataclass(frozen=True)
class SharedMemory:
    """What the machine holds that would outlive a process: /dev/shm's entries, and System V segments
    nothing marked for removal."""
    entries: set[str]
    segments: set[int]

    def new_since(self, before: SharedMemory) -> SharedMemory:
        return SharedMemory(self.entries - before.entries, self.segments - before.segments)

    def still_in(self, now: SharedMemory) -> SharedMemory:
        return SharedMemory(self.entries & now.entries, self.segments & now.segments)


def shared_memory() -> SharedMemory:
    return SharedMemory(set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set(), kept_segments())


def kept_segments() -> set[int]:
    """System V shared-memory segments of this IPC namespace that nothing marked for removal: what would
    outlive every process that has them (the shared-memory core marks its own at once)."""
    with open("/proc/sysvipc/shm") as listing:
        rows = [line.split() for line in listing.readlines()[1:]]
    return {int(row[1]) for row in rows if not int(row[2]) & 0o1000}  # SHM_DEST in the mode


def live_children() -> list[psutil.Process]:
    """This process's descendants, less multiprocessing's resource tracker and fork server.

    Both are one per parent, started with the first worker and kept for reuse; they belong to
    this (test) process, not to any run. The fork server's children, the workers, do count.
    """
    kids = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            helper = "resource_tracker" in command or ("forkserver" in command and child.ppid() == os.getpid())
            if not helper:
                kids.append(child)
        except psutil.NoSuchProcess:
            continue
    return kids


def probe_replica(spec, send):
    """A worker target that inspects its replica instead of training (see test_shared_memory)."""
    from sn_trainer.engine.step.replica import Replica

    replica = Replica(spec)
    params = list(replica.model.parameters())
    flat_pointer = spec.shared.flat.untyped_storage().data_ptr()
    report = {
        "storages": sorted({p.untyped_storage().data_ptr() for p in params}) == [flat_pointer],
        "all_shared": all(p.is_shared() for p in params),
        "shard_size": replica.layout.shards[spec.rank].size,
    }
    replica.reducer.barrier()
    if spec.rank == 1:
        with torch.no_grad():
            params[0].view(-1)[0] = 42.0
    replica.reducer.barrier()
    report["seen"] = params[0].view(-1)[0].item()  # rank 0 sees rank 1's write
    replica.reducer.barrier()
    replica.reducer.grad_flat.fill_(1.0)
    replica.reducer.reduce()
    (phase,) = replica.phases
    phase.update(replica.reducer.shard_grad, count=1.0, unused=(), step_done=1, norm_sum=replica.reducer.sum_in_node,
                 whole_model=True)
    replica.reducer.barrier()
    report["state_numel"] = sum(t.numel() for state in phase.optimizer.state.values() for t in state.values()
                                if torch.is_tensor(t) and t.dim() > 0)
    replica.close()
    return report


class NaNAt(nn.Module):
    """Wraps a model; its ``at_call``-th forward in every worker returns NaN outputs."""

    def __init__(self, inner: nn.Module, at_call: int):
        super().__init__()
        self.inner, self.at_call, self.calls = inner, at_call, 0

    def forward(self, x):
        self.calls += in_a_worker()
        out = self.inner(x)
        return out * float("nan") if self.calls == self.at_call else out


class NaNGradAt(nn.Module):
    """Wraps a model; at its ``at_call``-th forward, worker ``rank`` alone gets a NaN gradient.

    Every loss stays finite: only that worker's backward pass goes wrong.
    """

    def __init__(self, inner: nn.Module, at_call: int, rank: int):
        super().__init__()
        self.inner, self.at_call, self.rank, self.calls = inner, at_call, rank, 0

    def forward(self, x):
        self.calls += in_a_worker()
        out = self.inner(x)
        my_rank = torch.initial_seed() % 1000  # each worker seeds torch with seed * 1000 + its rank
        return _NaNGradient.apply(out) if self.calls == self.at_call and my_rank == self.rank else out


class _NaNGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def processes_with_marker(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries SN_TEST_MARKER=marker (a run and all it started)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SN_TEST_MARKER") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stops_halfway_through_a_message(payload, send):
    """A worker target that writes the start of a message into its pipe (a length of 1 MiB, then
    10 bytes of it) and stops itself, as SIGSTOP can catch a worker sending a checkpoint part."""
    import signal
    import struct

    (conn,) = [cell.cell_contents for cell in send.__closure__ if hasattr(cell.cell_contents, "fileno")]
    os.write(conn.fileno(), struct.pack("!i", 1 << 20) + b"0123456789")
    os.kill(os.getpid(), signal.SIGSTOP)


def openmp_registrations() -> set[str]:
    """What Intel's OpenMP (libiomp5) has registered in /dev/shm: a file per process it ran in, which
    must go with the process however it ends."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("__KMP_REGISTERED_LIB_")}


# --- ranks of a process group, spawned -----------------------------------------------------------

def run_ranks(target, world: int, tmp_path, timeout_s: float = 120.0, extra=()) -> list[int | None]:
    """Run ``target(rank, world, store_path, out_dir, *extra)`` in ``world`` spawned processes; their exit codes."""
    context = multiprocessing.get_context("spawn")
    store = str(tmp_path / "store")
    processes = [context.Process(target=_guarded, args=(target, rank, world, store, str(tmp_path), *extra))
                 for rank in range(world)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [process.exitcode for process in processes]


def _guarded(target, rank, world, store, out_dir, *extra):
    try:
        target(rank, world, store, out_dir, *extra)
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as file:
            file.write(traceback.format_exc())
        raise


def saved_results(tmp_path, world: int) -> list[dict]:
    """What each rank of ``run_ranks`` saved as rank<r>.pt, once no rank wrote an error."""
    errors = [p.read_text() for p in sorted(tmp_path.glob("error*.txt"))]
    assert errors == []
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
