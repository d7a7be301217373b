"""The reducer a worker sums its gradients with: the kind the plan names, and across nodes gloo
over it, its shard compressed between nodes where the plan says (compress=powersgd)."""
from __future__ import annotations

from ..collectives.over_gloo import CrossNodeReducer
from ..collectives.reducer import Reducer, ReducerSetup
from ..collectives.registry import make_reducer
from ..collectives.compression import PowerSGD, shard_compression
from .worker_spec import WorkerSpec


def worker_reducer(spec: WorkerSpec) -> Reducer:
    """The reducer the plan names (comm=auto: the fastest here), and across nodes gloo over it."""
    shared = spec.shared
    plan, layout = shared.plan, shared.layout
    settings = plan.settings
    # gloo's own timeout is a backstop behind the launcher's watchdog, which names the worker
    # that stopped (gloo would name one of those left waiting for it).
    backstop = 2 * settings.worker_timeout + 30
    setup = ReducerSetup(spec.rank, plan.workers, layout.shards[spec.rank], layout.padded_numel,
                         shared.flat.dtype, spec.store_path, settings.reduce, backstop)
    reducer = make_reducer(settings.comm, setup, shared.reducers)
    if spec.cluster is None:
        return reducer
    return CrossNodeReducer(reducer, spec.cluster.store(f"shard{spec.rank}"), spec.cluster.node_rank,
                            spec.cluster.nodes, spec.cluster.device(), backstop, _compressor(spec))


def _compressor(spec: WorkerSpec) -> PowerSGD | None:
    """compress=powersgd: this worker's exchange of its shard between nodes (None: sent whole)."""
    settings = spec.shared.plan.settings
    if settings.compress == "none":
        return None
    rank = spec.rank
    plan = shard_compression(spec.shared.layout, rank, settings.compress_rank)
    compressor = PowerSGD(plan, settings.compress_rank, settings.compress_after,
                          seed=settings.seed * 1_000_003 + rank, steps_done=spec.shared.plan.start_step)
    saved = (spec.share or {}).get("compress")
    if saved is not None:
        compressor.load_state(saved, spec.cluster.node_rank, spec.cluster.nodes)
    return compressor
