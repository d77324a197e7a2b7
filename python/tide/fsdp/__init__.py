"""tide.fsdp: TIDE's zero-copy all-gather and mixed-precision reduce-scatter inside FSDP2.

    model = ...; fully_shard(layer) for each layer; fully_shard(model)
    handle = tide.fsdp.enable(model)   # after fully_shard, while the model is sharded (between steps)
    ...train as usual...               # handle.counts(): TIDE's collectives since the last reset
    tide.fsdp.disable(model)           # back to stock FSDP2

What changes for a handled FSDP2 param group ("bucket"):
- all-gather: each rank casts its shard straight into its slot of a window and pushes it to the same
  slot on every peer; the window *is* the unsharded parameters' storage, so FSDP2's copy-in and
  copy-out (``all_gather_copy_in``, ``split_with_sizes_copy``) never run;
- reduce-scatter: per-parameter gradients are read in place and reduced in fp32 (or the reduce
  dtype) into the shard, staging in the slots the all-gather vacated; FSDP2's copy-in
  (``chunk_cat``) and its full-group reduce-dtype buffer never exist. Everything after the
  reduce-scatter (divide factors, HSDP all-reduce, ``+=`` into ``.grad``, post-accumulate hooks)
  is stock FSDP2's own code.

The modules, by role: ``_fsdp2`` (every private FSDP2 symbol: the version adapter), ``_hooks``
(how TIDE hooks FSDP2's functions), ``_dispatch`` (TIDE's versions of them), ``_fallbacks`` (why a
group or call stays stock), ``_bucket`` (one handled param group), ``_window`` (a group's windows
through a step), ``_extension`` (a group's all-gather extension inputs: fsdp_pre_all_gather
tensors laid out as bytes), ``_float8`` (torchao's float8 weights cast by TIDE, and their amax
exchange), ``_capture`` (CUDA graph captures), ``_pool`` (pooled windows), ``_memory`` (tensors
over them), ``_placement`` (nodes and transports), ``_agreement`` (ranks agreeing through the
store). docs/ARCHITECTURE.md has the design.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from .. import _tide
from . import _capture, _dispatch, _fallbacks, _fsdp2, _hooks
from ._agreement import agree
from ._bucket import Bucket, Counts
from ._dtypes import TORCH_TO_TIDE
from ._extension import ExtensionGather, uses_extension
from ._placement import launcher_ranks_per_node, placements, topology_for, transport_for
from ._pool import GRAPH_END_WAIT_S, WindowPool, size_classes

__all__ = ["enable", "disable", "TideFSDP", "TRANSPORTS", "topology_for", "transport_for"]

log = logging.getLogger("tide.fsdp")
TRANSPORTS = ("auto", "ipc", "nccl")
ACROSS_NODES_OPTION_FIELDS = ("chunk_bytes", "max_chunks_in_flight", "ring_depth", "rs_recursive_halving", "wire_dtype")


class TideFSDP:
    """What ``enable`` did: the handled buckets, the fallbacks (with reasons), the pools, and the
    collectives TIDE ran since the last ``reset_counts``."""

    def __init__(self):
        self.buckets: list[Bucket] = []
        self.fallbacks: list[tuple] = []  # (param group path, reason)
        self.pools: list[WindowPool] = []
        self._counts = Counts()

    def _before_replay(self) -> None:
        for b in self.buckets:
            b.before_replay()

    def counts(self) -> dict:
        """TIDE's all-gathers and reduce-scatters (calls and bytes) since the last reset: what a
        profiler or flight recorder would count for c10d collectives, which TIDE does not use; and
        `remaps`, the all-gathers that had to map another window at their group's fixed address."""
        return self._counts.as_dict()

    def reset_counts(self) -> None:
        self._counts.reset()

    def pool_bytes(self) -> int:
        """Bytes of window memory this rank holds now (all pools)."""
        return sum(p.total_bytes() for p in self.pools)

    def enable_sm_stats(self, enabled: bool = True) -> None:
        """CUDA: time TIDE's kernels (cast, reduce) from now on (off by default: it adds events)."""
        for pool in self.pools:
            for pooled in pool.all_windows():
                if hasattr(pooled.executor, "enable_stats"):
                    pooled.executor.reset_stats()
                    pooled.executor.enable_stats(enabled)
            pool.stats_enabled = enabled
            for sized in pool.sized.values():
                sized.stats_enabled = enabled

    def sm_cta_us(self) -> float:
        """CUDA: SM time of TIDE's kernels since enable_sm_stats, in CTA-microseconds (CTAs x kernel
        time of the cast, reduce, cast-to-peers kernel (small buckets; its flag waits included) and, between
        virtual nodes over IPC, pull kernels; copies and flag operations use no SMs).
        Synchronizes the executors. 0 on CPU."""
        total = 0.0
        for pool in self.pools:
            for pooled in pool.all_windows():
                if hasattr(pooled.executor, "stats"):
                    st = pooled.executor.stats()
                    total += (st.cast_cta_us + st.reduce_cta_us + st.cast_to_peers_cta_us
                              + st.network_cta_us)
        return total

    def lowerings(self) -> int:
        """CUDA: the collectives since enable_sm_stats that checked and lowered their program (a
        window's first run of it, or a run on other pointers than its last); the others reused the
        lowering. Synchronizes the executors. 0 on CPU."""
        return sum(pooled.executor.stats().lowerings for pool in self.pools
                   for pooled in pool.all_windows() if hasattr(pooled.executor, "stats"))

    def capture_refusals(self) -> dict:
        """CUDA: per handled group whose collectives no CUDA graph can capture, why (programs across
        nodes, shards offloaded to the CPU); empty when a captured step can run TIDE's collectives
        (after one uncaptured step), and on CPU."""
        refusals = {b.path: b.capture_refusal()[0] for b in self.buckets if b.cuda}
        return {path: what for path, what in refusals.items() if what}

    def __repr__(self):
        return (f"TideFSDP({len(self.buckets)} buckets handled, {len(self.fallbacks)} fallbacks, "
                f"{sum(len(p.all_windows()) for p in self.pools)} pooled windows)")


_enabled: dict = {}  # id(module) -> TideFSDP


def _specs(param_group, param_name) -> list:
    """The window layout's params: those with bytes (a frozen zero-size param has no slot)."""
    return [_tide.ParamSpec(param_name(fp, i), list(_fsdp2.unsharded_shape(fp)),
                            TORCH_TO_TIDE[_fsdp2.dtypes(fp)[1]],
                            TORCH_TO_TIDE[_fsdp2.dtypes(fp)[0]],
                            shard_dim=_fsdp2.shard_dim(fp))
            for i, fp in enumerate(param_group.fsdp_params) if _fsdp2.has_bytes(fp)]


def _identity(path: str, param_group, reason: str, param_name, gather) -> list:
    """What every rank of the group must agree on about one param group: its place in the FSDP
    tree, its params' names, shapes, dtypes and shard dims, its all-gather extensions' inputs, and
    whether TIDE takes it."""
    inputs = gather.describe() if gather is not None else [None] * len(param_group.fsdp_params)
    params = [[param_name(fp, i), list(_fsdp2.unsharded_shape(fp)), str(_fsdp2.dtypes(fp)[0]),
               str(_fsdp2.dtypes(fp)[1]), _fsdp2.shard_dim(fp), inputs[i]]
              for i, fp in enumerate(param_group.fsdp_params)]
    return [path, params, reason]


# enable's keywords that were renamed (one word per concept), and their names now.
_RENAMED_KEYWORDS = {"net": "across_nodes", "network": "transport"}


def _refuse_renamed_keywords(removed: dict) -> None:
    """Refuses a keyword enable does not take; a renamed one with its new name."""
    for old in removed:
        if old in _RENAMED_KEYWORDS:
            raise TypeError(f"tide.fsdp.enable: the keyword {old}= is now {_RENAMED_KEYWORDS[old]}=")
    if removed:
        raise TypeError(f"tide.fsdp.enable: unexpected keyword(s) {', '.join(sorted(removed))}")


def enable(module: torch.nn.Module, *, timeout_ms: int | None = None, ranks_per_node: int | None = None,
           across_nodes=None, transport: str = "auto", **removed) -> TideFSDP:
    """Turns TIDE on for every FSDP2 param group under `module` (call after ``fully_shard``, with the
    model sharded: before the first step or between steps). Returns what was handled.

    Every rank of each process group must call it on the same model: the ranks check that they
    describe their param groups identically (through the store, within `timeout_ms`, default
    TIDE_TIMEOUT_MS) and raise tide.DesyncError on every rank otherwise, naming the first difference,
    or the rank and its exception where one rank raised while describing them.

    ranks_per_node: declares nodes of that many consecutive global ranks (default: LOCAL_WORLD_SIZE
    as torchrun sets it; unset: every group is one node); groups that span several
    run TIDE's across-node programs (recursive-doubling all-gather, two-phase reduce-scatter)
    between them, with `across_nodes` (a tide.AcrossNodesOptions: 16 MiB chunks by default) pacing the transport
    steps. ``tide.AcrossNodesOptions(wire_dtype=tide.DType.bf16)`` sends the reduce-scatter's partial sums
    as bf16 between nodes: half the bytes, but LOSSY (one bf16 rounding per transfer; results are
    no longer bitwise equal to stock FSDP2's). A group on one node must have its ranks on one host.

    transport: what carries those steps on CUDA devices. "auto" (default): CUDA IPC when every rank
    of the group is on this host (virtual nodes), else NCCL; "ipc"; "nccl" (a communicator per
    pooled window, one rank per GPU). On CPU the host executor's host transport carries them
    (virtual nodes of one host; "nccl" falls back)."""
    _refuse_renamed_keywords(removed)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"tide.fsdp.enable: module is {type(module).__name__}, expected an nn.Module")
    if id(module) in _enabled:
        raise ValueError("tide.fsdp.enable: TIDE is already enabled on this module")
    if timeout_ms is not None and (not isinstance(timeout_ms, int) or timeout_ms <= 0):
        raise ValueError(f"tide.fsdp.enable: timeout_ms = {timeout_ms!r}, expected a positive int")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node <= 0):
        raise ValueError(f"tide.fsdp.enable: ranks_per_node = {ranks_per_node!r}, expected a positive int")
    if ranks_per_node is None:
        ranks_per_node = launcher_ranks_per_node()
    if across_nodes is not None and not isinstance(across_nodes, _tide.AcrossNodesOptions):
        raise TypeError(f"tide.fsdp.enable: across_nodes is {type(across_nodes).__name__}, expected tide.AcrossNodesOptions")
    across_nodes = across_nodes if across_nodes is not None else _tide.AcrossNodesOptions()
    if transport not in TRANSPORTS:
        raise ValueError(f"tide.fsdp.enable: transport = {transport!r}, expected one of {TRANSPORTS}")
    _fsdp2.check_torch_version()
    groups = _fsdp2.param_groups(module)
    if not groups:
        raise ValueError("tide.fsdp.enable: no FSDP2 param groups under this module; call "
                         "fully_shard(...) on it (or its submodules) first")
    wait_ms = timeout_ms or _tide.default_timeout_ms()
    for path, pg in groups:
        handling = next((fp._tide_bucket for fp in pg.fsdp_params if getattr(fp, "_tide_bucket", None)), None)
        if handling is not None:
            # Each enable names groups by their path under the module it was given: the one that
            # is not the group's own root ("<root>") says where it is.
            name = path if handling.path == "<root>" else handling.path
            raise ValueError(f"tide.fsdp.enable: param group {name} is already handled by TIDE (an "
                             "earlier tide.fsdp.enable on a module containing it); call "
                             "tide.fsdp.disable on that module first")
        state = _fsdp2.state_fallback_reason(pg)
        if state:
            raise ValueError(f"tide.fsdp.enable: param group {path} {state}")

    # 1. What the model alone decides, agreed by every rank of each process group. What a rank
    # raises while deciding (an extension's fsdp_pre_all_gather refusing its shard, say) reaches
    # the agreement too: the other ranks raise it at once rather than wait for this one.
    process_groups: dict = {}  # group ranks -> process group, in module order
    for _, pg in groups:
        group = _fsdp2.process_group(pg)
        if group is not None and group.size() > 1:
            process_groups.setdefault(tuple(dist.get_process_group_ranks(group)), group)
    identities: dict = {ranks: [] for ranks in process_groups}  # group ranks -> identities in module order
    decided = []  # (bucket id, path, param group, process group, topology, gather, reason)
    failure, failed_at = None, ""
    try:
        param_name = _fsdp2.param_names(module)
        for bucket_id, (path, pg) in enumerate(groups):
            failed_at = path
            group = _fsdp2.process_group(pg)
            reason = _fallbacks.group_reason(pg, group, param_name)
            topology = None
            if not reason:
                topology, reason = topology_for(dist.get_process_group_ranks(group), ranks_per_node)
                if not reason and topology.nodes > 1:
                    reason = _fallbacks.multi_node_reason(pg, param_name)
            # All-gather extensions: their inputs' layout (fsdp_pre_all_gather runs once here).
            gather = ExtensionGather(pg, param_name, topology) if not reason and uses_extension(pg) else None
            if gather is not None and gather.layout is None:
                gather, reason = None, "every fsdp_pre_all_gather input of the group is empty (nothing to gather)"
            decided.append((bucket_id, path, pg, group, topology, gather, reason))
            if group is not None and group.size() > 1:
                identities[tuple(dist.get_process_group_ranks(group))].append(
                    _identity(path, pg, reason, param_name, gather))
    except Exception as e:  # noqa: BLE001 - raised on every rank, through the agreement
        failure = e
    options = {"ranks_per_node": ranks_per_node, "transport": transport,
               "across_nodes": {k: str(getattr(across_nodes, k)) for k in ACROSS_NODES_OPTION_FIELDS}}
    rounds = agree(process_groups, options, identities, wait_ms, failure, failed_at)

    # 2. Where the ranks are (the same answer on every rank of a group: exchanged).
    where: dict = {}
    result = TideFSDP()
    by_ranks: dict = {}  # (group ranks, device) -> [(bucket, group_transport)]
    for bucket_id, path, pg, group, topology, gather, reason in decided:
        group_transport = None
        if not reason:
            key = (tuple(dist.get_process_group_ranks(group)), pg.device.type)
            if key not in where:
                where[key] = placements(group, pg.device, wait_ms, rounds[key[0]])
            group_transport, reason = transport_for(where[key], pg.device.type, topology, transport)
        if reason:
            result.fallbacks.append((path, reason))
            log.warning("tide.fsdp: param group %s falls back to stock FSDP2: %s", path, reason)
            continue
        layout = _tide.BucketLayout(_specs(pg, param_name), topology)
        bucket = Bucket(bucket_id, path, pg, group, layout, across_nodes, result._counts, param_name, gather)
        # FSDP2 may give each param group its own process-group object over the same ranks; TIDE
        # talks through windows, not the group, so those buckets share pools.
        by_ranks.setdefault((tuple(dist.get_process_group_ranks(group)), str(pg.device)), []).append(
            (bucket, group_transport))
        result.buckets.append(bucket)

    # 3. Pools, named by the model (the enable round and the first bucket's id), not by process state.
    for (ranks, _), entries in by_ranks.items():
        group_transport = entries[0][1]  # a function of the ranks and the device: the same for all
        for members in size_classes([b for b, _ in entries]):
            # The first member's id: a module can hold several param groups (torch >= 2.12), so
            # its path alone could name two pools alike.
            name = f"tide/pool/{'-'.join(map(str, ranks))}/{rounds[ranks]}/{members[0].id}"
            pool = WindowPool(members[0].group, max(b.window_bytes for b in members), timeout_ms,
                              name, members[0].param_group.device, members[0].layout.topology,
                              group_transport)
            result.pools.append(pool)
            for b in members:
                b.attach(pool)
    _hooks.acquire(_dispatch.REPLACEMENTS)  # their lookup can fail: then none is installed
    for b in result.buckets:
        for fp in b.fsdp_params:
            # A stock all-gather may have run before: its tensors must not back TIDE's params.
            _fsdp2.forget_unsharded(fp)
            fp._tide_bucket = b
    if any(b.cuda for b in result.buckets):
        _capture.add_before_replay(result._before_replay)
    _enabled[id(module)] = result
    return result


def _refuse_live_graphs(result: TideFSDP) -> None:
    """Refuses to disable while a CUDA graph that replays the model's collectives exists: its
    replays write the windows disable frees."""
    pools = [p for p in result.pools if p.device.type == "cuda"]
    if not pools or not any(p.live_graphs() for p in pools):
        return
    torch.cuda.synchronize(pools[0].device)
    deadline = time.monotonic() + GRAPH_END_WAIT_S
    while any(p.live_graphs() for p in pools) and time.monotonic() < deadline:
        time.sleep(0.001)
    live = [(p, p.live_graphs()) for p in pools]
    if any(n for _, n in live):
        paths = [b.path for b in result.buckets if b.pool in [p for p, n in live if n]]
        graphs = max(n for _, n in live)
        raise ValueError(f"tide.fsdp.disable: param group {paths[0]}: {graphs} CUDA graph(s) that "
                         "replay its collectives still exist, and their replays write the windows "
                         "disable would free; destroy them first (del graph, or graph.reset(); "
                         "torchtitan: cudagraph_teardown()), then disable")


def _end_evaluation(bucket: Bucket) -> None:
    """What an evaluation (forwards under torch.no_grad) or an unshard() left of a group, undone as
    FSDP2's own reshard and ``reset_iter_state`` undo it: its record of forwards whose backward
    never comes, and its unsharded parameters (views of TIDE's window, which stock FSDP2 does not
    gather into). A group with an all-gather in flight, a forward with autograd on whose backward
    has not run, or unreduced gradients is left as it is (disable refuses it, naming the group)."""
    param_group = bucket.param_group
    if not _fsdp2.is_idle(param_group) or _fsdp2.all_gather_in_flight(param_group) \
            or _fsdp2.gradients_pending(param_group) or _fsdp2.gradient_reduction_pending(param_group):
        return
    if bucket.no_grad_forwards_only():
        _fsdp2.forget_forwards(param_group)
    if not _fsdp2.backward_pending(param_group) and _fsdp2.is_unsharded(param_group):
        _fsdp2.to_sharded(param_group)


def disable(module: torch.nn.Module) -> None:
    """Turns TIDE off for `module` between steps; FSDP2's stock path takes over. Groups left
    unsharded by an evaluation (torch.no_grad forwards) or unshard() are resharded first, as
    FSDP2 reshards them."""
    result = _enabled.get(id(module))
    if result is None:
        raise ValueError("tide.fsdp.disable: TIDE is not enabled on this module")
    _refuse_live_graphs(result)
    for b in result.buckets:
        _end_evaluation(b)
    for b in result.buckets:
        state = _fsdp2.state_fallback_reason(b.param_group)
        if state:
            raise ValueError(f"tide.fsdp.disable: param group {b.path} {state}")
    del _enabled[id(module)]
    _capture.remove_before_replay(result._before_replay)
    for pool in result.pools:
        pool.release_pending()
    for b in result.buckets:
        for fp in b.fsdp_params:
            del fp._tide_bucket
            _fsdp2.forget_unsharded(fp)
    _hooks.release()
