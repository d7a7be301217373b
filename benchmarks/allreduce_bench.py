"""All-reduce latency and bandwidth, the "sn" backend against gloo and against the memory's speed, side by
side in one run.

    python benchmarks/allreduce_bench.py [--procs 2] [--busy 2 --rounds 5] [--out results/<machine>/allreduce]

``--busy N`` runs N busy loops of the same priority beside the ranks for the whole run (a machine with
other work on it; results in allreduce_busy), ``--rounds R`` times every size R times, the sizes in
turn, and reports the median of the rounds' medians and the worst round's speed-up.

The same processes time all three: the default group is "sn", a second group over the same ranks is
gloo, and each size is timed on one, then the other, then as a plain memory copy of the same bytes in
every rank at once, so that all see the same machine at the same moment.

The bound: whatever its algorithm, an all-reduce must at least read each rank's input and write each
rank's result, which is what a copy of the tensor does; with every rank copying at once, as every rank
all-reduces at once, the copy's time is a lower bound of the all-reduce's (a generous one: the ranks'
data must also cross between their cores). "of bound" is that copy's time over the all-reduce's.

Each rank runs torch with cores / procs intra-op threads. The report names the CPU, the cores, torch's
version, and how much CPU time other processes took while it ran (a busy machine is said to be one).
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import harness

sys.path.insert(0, str(harness.ROOT))  # this checkout's sn_trainer, here and in the ranks spawned from here
RESULT = "allreduce"
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20]
TINY_SIZES = [4 << 10, 64 << 10]
SECONDS_PER_CASE = 0.6


def _slowest(seconds: float, group) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item()


def time_all_reduce(tensor: torch.Tensor, group) -> tuple[float, float]:
    """Median and fastest seconds of one float32 SUM all-reduce, each timed between barriers on the same
    group (every rank runs the same count of them; the slowest rank's figures: a collective is done when
    every rank has its result). On a shared machine the fastest is what it does when the others leave
    it the cores."""
    start = time.perf_counter()
    for _ in range(2):
        dist.all_reduce(tensor, group=group)
    first = _slowest((time.perf_counter() - start) / 2, group)
    samples = []
    for _ in range(max(5, min(200, int(SECONDS_PER_CASE / first)))):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        samples.append(time.perf_counter() - start)
    return _slowest(statistics.median(samples), group), _slowest(min(samples), group)


def time_copy(tensor: torch.Tensor, group) -> tuple[float, float]:
    """Median and fastest seconds of copying ``tensor`` into another tensor, every rank at once (timed
    between barriers, like the all-reduces; the slowest rank's figures)."""
    target = torch.empty_like(tensor)
    target.copy_(tensor)
    first = _slowest(_once(target, tensor), group)  # the same count of copies in every rank
    samples = []
    for _ in range(max(5, min(200, int(SECONDS_PER_CASE / 4 / max(1e-6, first))))):
        dist.barrier()  # sn's: the closest start of the ranks' copies
        start = time.perf_counter()
        target.copy_(tensor)
        samples.append(time.perf_counter() - start)
    return _slowest(statistics.median(samples), group), _slowest(min(samples), group)


def _once(target: torch.Tensor, tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    target.copy_(tensor)
    return time.perf_counter() - start


def bench_rank(rank: int, procs: int, store: str, out: str, sizes: list[int], rounds: int, pin: bool) -> None:
    import sn_trainer.distributed  # noqa: F401  (registers "sn")

    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // procs)
    torch.set_num_threads(per_rank)
    dist.init_process_group("sn", init_method=f"file://{store}", rank=rank, world_size=procs,
                            timeout=datetime.timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")  # its threads made now, before the pinning: the OS places them
    if pin and len(cores) >= procs:  # the calling thread, which runs sn's collectives, on cores of its own, as
        os.sched_setaffinity(0, cores[rank * per_rank : (rank + 1) * per_rank])  # sn_trainer.launch pins ranks
    rows = []  # per round, per size: (size, sn, gloo, copy), each (median, fastest)
    for _ in range(rounds):
        rows.append([])
        for size in sizes:
            tensor = torch.ones(size // 4)
            rows[-1].append((size, time_all_reduce(tensor, None), time_all_reduce(tensor, gloo),
                             time_copy(tensor, gloo)))
    native = dist.group.WORLD._get_backend(torch.device("cpu"))._group.native is not None
    if rank == 0:
        torch.save((rows, native), out)
    dist.destroy_process_group()


PING_PONG = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    volatile int64_t *word = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int a = atoi(argv[1]), b = atoi(argv[2]), n = atoi(argv[3]);
    pid_t child = fork();
    cpu_set_t set; CPU_ZERO(&set); CPU_SET(child == 0 ? b : a, &set); sched_setaffinity(0, sizeof set, &set);
    if (child == 0) { for (int i = 1; i <= n; i++) { while (word[0] != i); word[8] = i; } _exit(0); }
    struct timespec t0, t1; clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 1; i <= n; i++) { word[0] = i; while (word[8] != i); }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.0f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n);
    wait(0);
    return 0;
}
"""


def round_trip_ns(tmp: str, trips: int = 200000) -> float | None:
    """Nanoseconds for a cache line to go from the first rank's core to the second's and back: where two
    cores lie apart (other dies, or a VM's virtual CPUs placed so by its host), data crossing between
    them is slow, and every shared-memory collective with it; the mean of ``trips``. None where no C
    compiler is found."""
    cores = sorted(os.sched_getaffinity(0))
    source, binary = os.path.join(tmp, "ping.c"), os.path.join(tmp, "ping")
    Path(source).write_text(PING_PONG.replace("#include <stdio.h>", "#include <stdio.h>\n#include <stdlib.h>"))
    try:
        subprocess.run(["cc", "-O2", "-o", binary, source], check=True, capture_output=True)
        return float(subprocess.run([binary, str(cores[0]), str(cores[-1]), str(trips)], capture_output=True, text=True,
                                    check=True).stdout)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def busy_seconds() -> float:
    """CPU seconds all processes of the machine have spent so far (user + system, from /proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds this process and its finished children have spent."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def over_rounds(rounds: list[list[tuple]]) -> list[tuple]:
    """Per size: the median over the rounds of each figure, and the worst round's speed-up (gloo's median
    over sn's)."""
    merged = []
    for per_size in zip(*rounds):
        figures = [tuple(statistics.median(row[part][which] for row in per_size) for which in (0, 1))
                   for part in (1, 2, 3)]
        worst = min(row[2][0] / row[1][0] for row in per_size)
        merged.append((per_size[0][0], *figures, worst))
    return merged


def report(rows, native: bool, procs: int, seconds: float, others: float, round_trip: float | None, busy: int = 0,
           rounds: int = 1, pin: bool = True) -> str:
    beside = (f", beside {busy} busy loop(s) of the same priority (`{' '.join(harness.BUSY_LOOP)}`)" if busy else "")
    lines = [f"# All-reduce: \"sn\" against gloo, {procs} processes, float32 SUM{beside}", "",
             f"- CPU: {cpu_model()}; {len(os.sched_getaffinity(0))} cores usable ({os.cpu_count()} online)",
             f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}",
             f"- sn's collectives: {'the C core' if native else 'the Python path (no C core built)'}",
             f"- a cache line's round trip between the first and the last core: "
             f"{f'{round_trip:.0f} ns' if round_trip else 'not measured (no C compiler)'}, measured before the run",
             f"- each rank: {max(1, len(os.sched_getaffinity(0)) // procs)} intra-op thread(s); "
             + ("the thread that runs sn's collectives pinned to as many cores of its own, gloo's threads placed by "
                "the OS" if pin else "no rank pinned (`--no-pin`: every thread placed by the OS, as under torchrun)")
             + "; median of timed all-reduces between barriers, the slowest rank's",
             f"- other processes took {others:.1f} CPU s during the {seconds:.1f} s run "
             + (f"(the {busy} busy loop(s) included)" if busy else
                f"({'a busy machine: figures are lower bounds of what it does alone' if others > 0.05 * seconds else 'an idle machine'})"),
             f"- {rounds} round(s), every size in turn in each; a figure is the median of the rounds' medians; "
             "\"worst round\" is the lowest of the rounds' speed-ups",
             f"- measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
             f"with `{harness.command()}`", "",
             "| size | sn median | sn bandwidth | gloo median | gloo bandwidth | sn speed-up | worst round "
             "| copy (bound) | sn of bound | sn fastest | gloo fastest | copy fastest | speed-up, fastest |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, (sn, sn_min), (gloo, gloo_min), (copy, copy_min), worst in rows:
        lines.append(f"| {_size(size)} | {_seconds(sn)} | {size / sn / 1e9:.2f} GB/s | {_seconds(gloo)} | "
                     f"{size / gloo / 1e9:.2f} GB/s | {gloo / sn:.1f}x | {worst:.1f}x "
                     f"| {_seconds(copy)} ({size / copy / 1e9:.1f} GB/s) "
                     f"| {copy / sn:.2f} | {_seconds(sn_min)} | {_seconds(gloo_min)} | {_seconds(copy_min)} "
                     f"| {gloo_min / sn_min:.1f}x |")
    lines += ["", "Bandwidth is the tensor's bytes over the median all-reduce's time (what each rank gets per "
              "second); the speed-up is gloo's time over sn's. The copy is every rank copying the tensor at once "
              "(the bound, see the script's docstring); \"sn of bound\" is the copy's median time over sn's."]
    return "\n".join(lines) + "\n"


def _size(size: int) -> str:
    return f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--procs", type=int, default=2, help="processes (ranks) on this machine")
    parser.add_argument("--sizes", type=lambda text: [int(v) for v in text.split(",")], default=None,
                        help="bytes per all-reduce, comma-separated (default: 4 KB to 64 MB)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops to run beside the ranks (default: none)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every size (default: 1)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the ranks to the OS, as torchrun does (default: each on cores of its own, as "
                             "sn_trainer.launch does)")
    args = parser.parse_args()
    sizes = args.sizes or (TINY_SIZES if args.tiny else SIZES)
    with tempfile.TemporaryDirectory() as tmp:
        store, rows_file = os.path.join(tmp, "store"), os.path.join(tmp, "rows.pt")
        round_trip = round_trip_ns(tmp, 1000 if args.tiny else 200000)
        with harness.busy_loops(args.busy):
            started, busy, own = time.monotonic(), busy_seconds(), own_seconds()
            mp.spawn(bench_rank, args=(args.procs, store, rows_file, sizes, args.rounds, args.pin), nprocs=args.procs)
            seconds = time.monotonic() - started
            others = max(0.0, busy_seconds() - busy - (own_seconds() - own))
        rounds, native = torch.load(rows_file)
        rows = over_rounds(rounds)
        text = report(rows, native, args.procs, seconds, others, round_trip, args.busy, args.rounds, args.pin)
    stem = RESULT + ("_busy" if args.busy else "") + ("" if args.pin else "_unpinned")
    harness.write(harness.out_of(args, stem),
                  {"machine": harness.describe(), "procs": args.procs, "native": native, "round_trip_ns": round_trip,
                   "seconds": seconds, "others_cpu_seconds": others, "busy_loops": args.busy, "pinned": args.pin,
                   "command": harness.command(),
                   "rows": [{"bytes": size, "sn_s": sn, "gloo_s": gloo, "copy_s": copy, "worst_round_speedup": worst}
                            for size, sn, gloo, copy, worst in rows],
                   "rounds": [[{"bytes": size, "sn_s": sn, "gloo_s": gloo, "copy_s": copy}
                               for size, sn, gloo, copy in per_round] for per_round in rounds]}, text)


if __name__ == "__main__":
    main()
