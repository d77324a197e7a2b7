"""tide-bench fsdp: train the embedded model with stock FSDP2 and with TIDE; measure each step."""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from ..fsdp import _fsdp2  # FSDP2's private functions and objects, as each torch version has them


# FSDP2's layout-conversion ops: the copies between per-parameter tensors and flat rank-major
# buffers that TIDE folds into collective addressing.
LAYOUT_OPS = ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat")
# For parameters sharded on a dim > 0 (shard_placement_fn), FSDP2 also re-lays each one out with a
# torch.cat: in the all-gather copy-out (rank-major rows -> column blocks) and before the
# reduce-scatter (column blocks -> rank-major rows). Counted only inside these functions, so the
# model's own cats are not.
SHARD_DIM_FUNCTIONS = ("foreach_all_gather_copy_out", "foreach_reduce")
TIMED_FUNCTIONS = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


class LayoutCopyCounter(TorchDispatchMode):
    """Counts the bytes FSDP2's layout-conversion ops read and write, as they run (the Shard(i > 0)
    re-layout cats included, also in shard_dim_bytes)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls = 0
        self.shard_dim_bytes = 0
        self._inside = 0  # depth of SHARD_DIM_FUNCTIONS calls
        self._calls = contextlib.ExitStack()

    def _counted_inside(self, fn):
        def inside(*a, **k):
            self._inside += 1
            try:
                return fn(*a, **k)
            finally:
                self._inside -= 1

        return inside

    def __enter__(self):
        counted = dict.fromkeys(SHARD_DIM_FUNCTIONS, self._counted_inside)
        self._calls.enter_context(_fsdp2.calls_replaced(counted))
        return super().__enter__()

    def __exit__(self, *exc):
        self._calls.close()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        shard_dim_cat = self._inside and name.startswith("aten.cat")
        if shard_dim_cat or any(op in name for op in LAYOUT_OPS):
            self.calls += 1
            # every tensor argument is read or written once (inputs, output buffers)
            n = _tensor_bytes(list(args)) + _tensor_bytes(list(kwargs.values()))
            if shard_dim_cat and "out" not in kwargs:  # the result is written too
                n += _tensor_bytes(args[0])
            self.bytes += n
            if shard_dim_cat:
                self.shard_dim_bytes += n
        return func(*args, **kwargs)


class CollectiveTimer:
    """Wall time spent in FSDP2's collective functions (whichever are installed: stock or TIDE's),
    layout copies included. On a GPU each timed call is synchronised, which serialises FSDP2's
    overlap: the step time is then measured in a separate, untimed pass."""

    def __init__(self, device: str):
        self.device, self.seconds = device, 0.0
        self._calls = contextlib.ExitStack()

    def _timed(self, fn):
        def timed(*a, **k):
            if self.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - t0
            return out

        return timed

    def __enter__(self):
        self._calls.enter_context(_fsdp2.calls_replaced(dict.fromkeys(TIMED_FUNCTIONS, self._timed)))
        return self

    def __exit__(self, *exc):
        self._calls.close()


@contextlib.contextmanager
def _in_place_gloo_reduce_scatter():
    """Ranks sharing a GPU run stock FSDP2 over gloo, whose reduce-scatter clones its whole input
    on the GPU (a full-group buffer NCCL does not allocate). Stock's reduce-scatter then runs as an
    in-place all-reduce of FSDP2's scratch input (dead after the call) and a copy of this rank's
    chunk, so stock's GPU memory is what it would be under NCCL."""

    def in_place(gloo_call):
        def reduce_scatter(self, output_tensor, input_tensor, group, op, async_op=False):
            if async_op:  # FSDP2 reduces synchronously on its stream; anything else stays gloo's
                return gloo_call(self, output_tensor, input_tensor, group, op, async_op)
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()].view_as(output_tensor))

        return reduce_scatter

    with _fsdp2.default_reduce_scatter_replaced(in_place):
        yield


@contextlib.contextmanager
def _collectives_moving_nothing():
    """The compute-only reference (--compute-only): stock FSDP2's training steps with collectives
    that move nothing. A param group's first all-gather is real and its unsharded params then stay
    allocated (resharding frees nothing), so every later forward and backward computes on those
    values; every later all-gather does nothing (no copy-in, no collective, no copy-out), and every
    reduce-scatter does nothing but give each sharded param a zero gradient of its shard's shape
    (where it has none), so the optimizer steps every param as in the other modes. The step then
    holds the model's compute, FSDP2's hooks and the optimizer, and no communication: its peak
    memory (every unsharded param resident) and its final params (zero gradients) compare with
    nothing."""
    nothing_gathered = _fsdp2.all_gather_result(None, [], [])

    def all_gather(gather):
        def gather_once(fsdp_params, *args, **kwargs):
            if all(map(_fsdp2.holds_all_gather_outputs, fsdp_params)):
                return nothing_gathered
            return gather(fsdp_params, *args, **kwargs)

        return gather_once

    def all_gather_copy_out(copy_out):
        def copy_out_once(result, *args, **kwargs):
            if result is not nothing_gathered:
                copy_out(result, *args, **kwargs)

        return copy_out_once

    def reduce_scatter(_):
        def zero_gradients(fsdp_params, unsharded_grads, *args, **kwargs):
            for fp in fsdp_params:
                _fsdp2.zero_gradient_if_none(fp)
            # What FSDP2's post_backward and finalize_backward wait on: an event of the current
            # stream (the zeros were written there; a captured step records it inside its graph),
            # for the reduce-scatter and for the post-reduce (torch 2.11 waits the former's
            # whenever the backward ends), and nothing to keep alive.
            stream = torch.get_device_module(unsharded_grads[0].device).current_stream()
            event = stream.record_event()
            return _fsdp2.foreach_reduce_result(
                reduce_scatter_input=None, reduce_scatter_event=event, post_reduce_stream=stream,
                post_reduce_event=event, all_reduce_input=None, all_reduce_event=None,
                partial_reduce_output=None)

        return zero_gradients

    with _fsdp2.calls_replaced({"foreach_all_gather": all_gather,
                                "foreach_all_gather_copy_out": all_gather_copy_out,
                                "foreach_reduce": reduce_scatter,
                                "free_unsharded_param": lambda _: lambda fp: None}):  # frees nothing
        yield


class PssSampler:
    """CPU: this process's peak proportional set size, sampled from /proc/self/smaps_rollup every
    `interval` s on a thread. Peak RSS counts every shared-memory page this rank touched in full,
    its peers' TIDE windows included (the host transport reads them in place), so the ranks' RSS
    figures add up to more than the host holds; PSS splits a shared page among the processes that
    map it, so the ranks' PSS adds up to the physical memory. Sampled: a peak shorter than the
    interval can be missed."""

    def __init__(self, interval: float = 0.5):
        import threading
        self.interval, self.peak_kib = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        try:
            with open("/proc/self/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        self.peak_kib = max(self.peak_kib, int(line.split()[1]))
                        return
        except OSError:
            pass

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def float8_linear(module, fqn: str) -> bool:
    """The linears --float8 converts (as torchtitan's float8 converter: the layers' projections,
    not the output head; torchao's float8 matmul needs both dims multiples of 16)."""
    return (fqn.startswith("layers.") and isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def _build(cfg, device: str, mp: str, world: int, expert_shard_dim: int = 0, fp8_all_gather=None):
    """cfg.build() on `device`, fully_shard on each of the model's FSDP units (inner first: its
    layers, and an MoE's experts with their shard placement), then on the root. fp8_all_gather not
    None: the layers' linears trained in float8 by torchao, their weights all-gathered as fp8 or not."""
    torch.manual_seed(0)
    with torch.device(device):
        model = cfg.build()
    if fp8_all_gather is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, module_filter_fn=float8_linear,
                                   config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mp == "bf16" else MixedPrecisionPolicy())
    mesh = None
    if device == "cpu":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
    for unit, placement in model.fsdp_units(expert_shard_dim):
        fully_shard(unit, mp_policy=policy, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mp_policy=policy, mesh=mesh)
    return model


@contextlib.contextmanager
def _deterministic_algorithms(on: bool):
    """torch.use_deterministic_algorithms(True) while `on` (the flag is read when each kernel is
    launched, so a capture bakes the deterministic kernels into its graph), without filling every
    torch.empty with NaN; the previous settings restored."""
    if not on:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def _collective_runs(counts: dict) -> int:
    return counts["all_gathers"] + counts["reduce_scatters"]


def _progress(label: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r  {label:<6} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


MODES = ("stock", "stock-captured", "tide", "tide-captured", "compute-only")


def run_mode(rank: int, world: int, mode: str, cfg, opts: dict) -> dict:
    """One rank's run of one mode of `cfg` (a model config from model.py): "stock" FSDP2, "tide"
    run by run, "tide-captured" or "stock-captured" (forward + backward captured in a CUDA graph
    and replayed, as torchtitan steps it; the optimizer outside; stock only over NCCL), or
    "compute-only" (stock FSDP2 with collectives that move nothing, see
    _collectives_moving_nothing; captured as the others are when opts["cuda_graphs"])."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    device = opts["device"]
    shared_gpus = device == "cuda" and dist.get_backend() == "gloo"  # see launch.backend_for
    if mode == "stock-captured" and dist.get_backend() != "nccl":
        raise ValueError(f"mode stock-captured: backend {dist.get_backend()}: expected nccl (one GPU per "
                         "rank); gloo's collectives cannot be captured in a CUDA graph")
    with contextlib.ExitStack() as stack:
        pss = stack.enter_context(PssSampler()) if device == "cpu" else None
        if shared_gpus:  # stock's groups; under TIDE, the groups that fall back (TIDE's own never use it)
            stack.enter_context(_in_place_gloo_reduce_scatter())
        if mode == "compute-only":
            stack.enter_context(_collectives_moving_nothing())
        result = _train(rank, mode, cfg, device, world, opts)
    result["peak_pss_mib"] = pss.peak_kib / 1024 if pss is not None and pss.peak_kib else None
    result["ranks_share_gpus"] = shared_gpus
    return result


def _train(rank: int, mode: str, cfg, device: str, world: int, opts: dict) -> dict:
    # --float8: stock trains with fp8 all-gather off (the reference: gloo has no fp8), TIDE with it on.
    fp8_all_gather = (not mode.startswith("stock")) if opts.get("float8") else None
    captured = mode.endswith("-captured") or (mode == "compute-only" and opts.get("cuda_graphs"))
    model = _build(cfg, device, opts["mp"], world, opts.get("expert_shard_dim", 0), fp8_all_gather)
    handle = None
    if mode.startswith("tide"):
        import tide.fsdp
        kwargs = {}
        if opts.get("ranks_per_node"):
            kwargs = {"ranks_per_node": opts["ranks_per_node"],
                      "across_nodes": tide.AcrossNodesOptions(chunk_bytes=opts["chunk_bytes"],
                                             wire_dtype=getattr(tide.DType, opts["wire_dtype"])),
                      "transport": opts.get("transport", "auto")}
        handle = tide.fsdp.enable(model, **kwargs)
        if not handle.buckets:  # a "TIDE" column that is stock FSDP2 would be a lie
            raise RuntimeError(f"tide-bench fsdp: TIDE handled no param group on rank {rank}: "
                               f"{handle.fallbacks}")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator(device).manual_seed(1000 + rank)  # the batch is drawn on the device
    total = opts["warmup"] + opts["steps"]
    step_s, host_s, coll_s = [], [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    deterministic = device == "cuda" and cfg.deterministic_backward

    def forward_backward(*batch):
        with _deterministic_algorithms(deterministic):
            loss = cfg.loss(model, batch)
            loss.backward()
        return loss.detach()

    if captured:
        from .captured_step import CapturedStep
    fwd_bwd = CapturedStep(forward_backward) if captured else forward_backward

    def one_step():
        loss = fwd_bwd(*cfg.batch(opts["batch"], opts["seq"], gen, device))
        opt.step()
        # Captured steps keep their gradients' storage (torchtitan's zero_grad with graphs): the
        # run-by-run steps they are compared with do the same.
        opt.zero_grad(set_to_none=not opts.get("cuda_graphs"))
        return loss

    # One counted step (the dispatch mode sees every op, which slows the step: it is not timed).
    # Captured: this is the warm-up, run by run on the capture's side stream.
    counter = LayoutCopyCounter()
    if handle is not None:
        handle.reset_counts()
    with counter:
        one_step()
    step_counts = handle.counts() if handle is not None else None
    sm_cta_us = None  # TIDE's kernels' SM time in one step (CUDA); NCCL's cannot be timed from here
    lowered = None  # (collectives lowered again, collectives) in that step
    if device == "cuda":  # every mode takes this step: their parameters must see the same updates
        if handle is not None and not captured:  # (captured: the capture, which times no kernel)
            handle.enable_sm_stats(True)
            runs_before = _collective_runs(handle.counts())
        one_step()
        if handle is not None and not captured:
            sm_cta_us = handle.sm_cta_us()
            lowered = (handle.lowerings(), _collective_runs(handle.counts()) - runs_before)
            handle.enable_sm_stats(False)
    loop_start = handle.counts() if handle is not None else None
    for step in range(total):
        # (a replay calls no Python: there is no collective to time, but the step is taken so
        # that every mode's parameters see the same updates)
        timer = contextlib.nullcontext() if captured else CollectiveTimer(device)
        with timer:
            t0 = time.perf_counter()
            one_step()
            seconds = time.perf_counter() - t0
        if device == "cuda":  # the timer synchronised every collective: time a plain step too
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            one_step()
            host = time.perf_counter() - t0  # until the step returns: what the host spent issuing it
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        if step >= opts["warmup"]:
            if not captured:
                coll_s.append(timer.seconds)
            step_s.append(seconds)
            if device == "cuda":
                host_s.append(host)
        if rank == 0 and opts["progress"]:
            _progress(mode, step + 1, total)
    dist.barrier()
    params = [p.to_local().detach().float().cpu().clone() for p in model.parameters()]
    result = {
        "mode": mode,
        "step_ms": statistics.median(step_s) * 1e3,
        "host_ms": statistics.median(host_s) * 1e3 if host_s else None,
        "collectives_ms": statistics.median(coll_s) * 1e3 if coll_s else None,
        "replays": fwd_bwd.replays if captured else 0,
        # TIDE's collectives the timed steps ran from Python: none when every step replays a graph
        "loop_collectives": (_collective_runs(handle.counts()) - _collective_runs(loop_start)
                             if handle is not None else None),
        "layout_copy_bytes": counter.bytes,
        "shard_dim_copy_bytes": counter.shard_dim_bytes,
        "sm_cta_us": sm_cta_us,
        "lowered": lowered,
        "peak_memory_mib": (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
                            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device == "cuda" else "process peak RSS",
        "tide_buckets": len(handle.buckets) if handle else 0,
        "tide_fallbacks": [reason for _, reason in handle.fallbacks] if handle else [],
        "tide_fallback_groups": [[path, reason] for path, reason in handle.fallbacks] if handle else [],
        "param_groups": _group_count(model),
        "tide_window_mib": handle.pool_bytes() / 2**20 if handle else 0.0,
        # TIDE's all-gathers in the counted step, and one all-gather of every handled group: as
        # gathered (fp8 bytes for float8 weights with fp8 all-gather on) and in the params' own
        # communication dtype (what the same groups would gather without all-gather extensions).
        "tide_step_all_gather_bytes": step_counts["all_gather_bytes"] if step_counts else 0,
        "tide_gather_bytes": sum(b.ag_bytes for b in handle.buckets) if handle else 0,
        "tide_param_bytes": sum(b.layout.world * p.slot_bytes for b in handle.buckets
                                for p in b.layout.params) if handle else 0,
        "tide_extension_groups": sum(b.gather is not None for b in handle.buckets) if handle else 0,
        # float8 weights whose e4m3 bytes TIDE's all-gather cast (no fsdp_pre_all_gather tensor)
        "tide_float8_casts": sum(why == "" for b in handle.buckets if b.gather is not None
                                 for why in b.gather.why_not_cast) if handle else 0,
        "params": params,
    }
    return result


def _group_count(model) -> int:
    """FSDP2 param groups under the model (the denominator of "TIDE handled N")."""
    return len(_fsdp2.param_groups(model))


def compare(first: list, second: list) -> float:
    """Max |second - first| over every rank's final parameter shards (two modes' runs)."""
    worst = 0.0
    for s, t in zip(first, second):
        for a, b in zip(s["params"], t["params"]):
            if a.numel():
                worst = max(worst, (a - b).abs().max().item())
    return worst
