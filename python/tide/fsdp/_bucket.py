"""One FSDP2 param group handled by TIDE ("bucket"): its layout and plans, its unsharded parameters'
views of the fixed address its window lease maps windows at (_window.py), and its two collectives."""

from __future__ import annotations

import contextlib
import math
import json
import weakref
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from .. import _tide
from . import _capture, _fsdp2
from ._agreement import exchange
from ._capture import not_capturable
from ._dtypes import TIDE_TO_TORCH, TORCH_TO_TIDE
from ._extension import ExtensionGather, uses_extension
from ._float8 import AmaxExchange
from ._memory import bytes_at
from ._pool import WindowPool
from ._window import WindowLease


class Counts:
    """TIDE's collectives since the last reset, as a user reads them from the handle."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.all_gathers = self.reduce_scatters = 0
        self.all_gather_bytes = self.reduce_scatter_bytes = 0
        # All-gathers that mapped another window at their bucket's fixed address: on CUDA each
        # waits on the host for the params' last readers (the rest find their window mapped).
        self.remaps = 0

    def as_dict(self) -> dict:
        return {"all_gathers": self.all_gathers, "reduce_scatters": self.reduce_scatters,
                "all_gather_bytes": self.all_gather_bytes, "reduce_scatter_bytes": self.reduce_scatter_bytes,
                "remaps": self.remaps}


# Whether a torch profiler records now (torch's own query; private, so looked up once with a
# fallback that always records).
_profiler_on = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def _profiled(label: Callable[[], str], cuda: bool) -> contextlib.ExitStack:
    """A profiler range (torch.profiler's record_function) while a profiler records and, on CUDA,
    an NVTX range. `label()` builds the name: only when a range is opened (record_function costs
    ~10 us of host time per call even with no profiler, three times per group and step)."""
    stack = contextlib.ExitStack()
    if _profiler_on():
        stack.enter_context(torch.profiler.record_function(label()))
    if cuda:
        stack.enter_context(torch.cuda.nvtx.range(label()))
    return stack


class Bucket:
    def __init__(self, bucket_id: int, path: str, param_group: _fsdp2.FSDPParamGroup, group: dist.ProcessGroup,
                 layout: _tide.BucketLayout, across_nodes: _tide.AcrossNodesOptions, counts: Counts,
                 param_name: _fsdp2.ParamName, gather: ExtensionGather | None = None) -> None:
        self.id, self.path, self.param_group, self.group = bucket_id, path, param_group, group
        self.fsdp_params = list(param_group.fsdp_params)
        # The params with bytes, in layout order (layout.params[i] is laid_out[i]); a frozen
        # zero-size param has no slot: its all-gather output is an empty tensor of its own.
        self.laid_out = [fp for fp in self.fsdp_params if _fsdp2.has_bytes(fp)]
        self.index = {id(p): i for i, p in enumerate(self.laid_out)}
        self.layout, self.across_nodes, self.counts = layout, across_nodes, counts
        self.param_name = param_name
        self.rank = group.rank()
        self._set_gather(gather)
        # Across nodes the reduce-scatter stages partial sums after the bucket's window: a window
        # holds the larger of the two programs' windows (a subset's is never larger).
        self.window_bytes = max(self.ag_program.window_bytes,
                                _tide.plan_reduce_scatter(layout, self.rank, _tide.ReduceOptions(),
                                                          bucket_id, across_nodes).window_bytes)
        shard_numels = iter(p.shard_numel for p in layout.params)
        self.numels = [next(shard_numels) if _fsdp2.has_bytes(fp) else 0 for fp in self.fsdp_params]
        self.rs_programs: dict = {}
        self.pool: WindowPool | None = None
        self.lease: WindowLease | None = None  # the bucket's windows: acquire, map, vacate, stage, release
        self.param_outputs: list[torch.Tensor] = []  # per layout param: its view of the fixed address
        self.all_gather_outputs: list[torch.Tensor] = []  # per FSDP param, what FSDP2 builds it from
        self.storage: _fsdp2.UnshardedStorage | None = None  # the outputs' storages, freed at reshard
        # Whether a forward with autograd on ran since FSDP2 last cleared its record of forwards
        # (at the end of a backward): if none did, the record is of no_grad forwards (evaluation),
        # whose backward never comes, and disable may clear it (no_grad_forwards_only).
        self.grad_forward = False
        # The CUDA graph capture the last all-gather ran in (0: none): parameters FSDP2 holds
        # unsharded are current only in the same one (before_unshard).
        self.gathered_in = 0

    def _set_gather(self, gather: ExtensionGather | None) -> None:
        """The all-gather's layout and program: the params' own layout, or with all-gather
        extensions the inputs' (an _extension.ExtensionGather); the reduce-scatter's is always the
        params'. Which params have extensions is remembered: FSDP2 allows attaching them until its
        lazy init (the first forward), which may come after enable."""
        self.gather = gather
        self.gather_layout = gather.layout if gather is not None else self.layout
        self.ag_program = _tide.plan_all_gather(self.gather_layout, self.rank, self.id, self.across_nodes)
        self.ag_bytes = sum(self.layout.world * p.slot_bytes for p in self.gather_layout.params)
        self.extensions = [_fsdp2.has_extension(fp) for fp in self.fsdp_params]
        casts = sum(why == "" for why in gather.why_not_cast) if gather is not None else 0
        self.amax_exchange = AmaxExchange(casts, self.layout.topology, self.rank, self.id, self.across_nodes) \
            if casts else None

    def _follow_extensions(self) -> None:
        """Before the bucket's first all-gather: if extension methods were attached to (or taken
        from) its params since enable, as FSDP2 allows until its lazy init, the all-gather is laid
        out again for them (every rank must agree; a layout that outgrows the bucket's window is
        refused, naming the group)."""
        if [_fsdp2.has_extension(fp) for fp in self.fsdp_params] == self.extensions:
            return
        releasing = [self.param_name(fp, i) for i, fp in enumerate(self.fsdp_params)
                     if _fsdp2.releases_after_post_all_gather(fp)]
        if releasing:
            raise ValueError(f"tide.fsdp: param group {self.path}: extension methods attached after "
                             f"tide.fsdp.enable free {', '.join(releasing)}'s all-gather outputs after "
                             "fsdp_post_all_gather; attach them before enable (the group then stays "
                             "stock FSDP2)")
        gather = ExtensionGather(self.param_group, self.param_name, self.layout.topology) \
            if uses_extension(self.param_group) else None
        if gather is not None and gather.layout is None:
            raise ValueError(f"tide.fsdp: param group {self.path}: extension methods attached after "
                             "tide.fsdp.enable return only empty all-gather inputs; attach them "
                             "before enable (the group then stays stock FSDP2)")
        mine = json.dumps(gather.describe() if gather is not None else None)
        theirs = exchange(self.group, f"extensions/{self.id}", mine, self.pool.timeout_ms or _tide.default_timeout_ms())
        if any(t != mine for t in theirs):
            raise _tide.DesyncError(
                f"tide.fsdp: param group {self.path}: the ranks' all-gather extensions, attached after "
                f"tide.fsdp.enable, differ: {theirs} (per group rank); attach the same on every rank")
        previous = self.gather
        self._set_gather(gather)
        if self.ag_program.window_bytes > self.pool.window_bytes:
            window_bytes = self.ag_program.window_bytes
            self._set_gather(previous)
            raise ValueError(
                f"tide.fsdp: param group {self.path}: its all-gather extensions, attached after "
                f"tide.fsdp.enable, need a {window_bytes} B window, more than the "
                f"{self.pool.window_bytes} B enable sized; attach them before tide.fsdp.enable")

    def attach(self, pool: WindowPool) -> None:
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        self.lease = WindowLease(pool, self.counts)
        self.lease.reshard_stale = weakref.WeakMethod(self.reshard_stale)  # weakly: no cycle

    def _ensure_param_outputs(self) -> None:
        # One tensor per param over the bucket's fixed address, each with its own storage starting at
        # the param (FSDP2 views it with as_strided(storage_offset=0)); created once, never resized.
        if self.param_outputs:
            return
        base = self.lease.range.ptr
        for p in self.gather_layout.params:
            nbytes = self.layout.world * p.slot_bytes
            raw = bytes_at(base + p.window_offset, nbytes, self.pool.device)
            self.param_outputs.append(raw.view(TIDE_TO_TORCH[p.dtype]))
        self.storage = _fsdp2.UnshardedStorage(self.param_outputs)
        if self.gather is not None:
            self.gather.set_outputs(self.param_outputs)
            return
        # Per FSDP param (FSDP2's order): its window view, or an empty tensor for a zero-size one.
        views = iter(self.param_outputs)
        self.all_gather_outputs = [next(views) if _fsdp2.has_bytes(fp) else
                                   torch.empty(0, dtype=_fsdp2.dtypes(fp)[1],
                                               device=self.pool.device)
                                   for fp in self.fsdp_params]
        self.result_numels = [[n] for n in self.numels]
        self.result_dtypes = [[out.dtype] for out in self.all_gather_outputs]

    def check_state(self, all_gather_comm: object) -> None:
        """Refuses FSDP2 settings changed after enable that TIDE would silently override."""
        if not _fsdp2.is_default_comm(all_gather_comm, "all_gather"):
            raise ValueError(f"tide.fsdp: param group {self.path}: a custom all-gather comm "
                             f"({type(all_gather_comm).__name__}) was set after tide.fsdp.enable; set "
                             "it before enable (the group then stays stock FSDP2)")
        if _fsdp2.uses_post_forward_mesh(self.param_group):
            raise ValueError(f"tide.fsdp: param group {self.path}: reshard_after_forward became an int "
                             "after tide.fsdp.enable; set it before enable (the group then stays stock)")
        changed = _fsdp2.custom_all_gather_output_reason(self.param_group) or \
            ("set_keep_unsharded_storage(True)" if _fsdp2.keeps_unsharded_storage(self.param_group) else "")
        if changed:
            raise ValueError(f"tide.fsdp: param group {self.path}: {changed} was set after "
                             "tide.fsdp.enable; set it before enable (the group then stays stock FSDP2)")

    def before_unshard(self) -> None:
        """Where FSDP2 unshards the group (a forward, a prefetch, a user's unshard()), before it
        checks whether the group is unsharded already.

        Parameters FSDP2 holds unsharded (reshard_after_forward False, an evaluation, unshard())
        are current only where they were gathered: uncaptured, or in the capture running now. One
        gathered uncaptured is resharded here when a capture begins, so that the graph records
        the all-gather it reads them from; one gathered in a capture (an aborted one, or whose
        graph replays since) is resharded when an uncaptured forward or another capture uses it.
        FSDP2 then gathers the current shards. Replays cannot leave stale ones behind: before
        each, the groups a graph captured are resharded (before_replay). In its backward the
        group is unsharded by its own forward, of the same step."""
        param_group = self.param_group
        if _fsdp2.in_forward(param_group):
            if not _fsdp2.backward_pending(param_group):
                self.grad_forward = False
            self.grad_forward = self.grad_forward or torch.is_grad_enabled()
        if _fsdp2.in_pre_backward(param_group) or not _fsdp2.is_unsharded(param_group) \
                or _fsdp2.all_gather_in_flight(param_group):
            return
        if self.gathered_in != _capture.current_capture(self.pool.device):
            _fsdp2.to_sharded(param_group)

    def reshard_stale(self, capture: int) -> bool:
        """Whether the group gave its window back: FSDP2 keeps it unsharded, idle, since before
        capture `capture` (gathered outside it), with no backward of a forward with autograd on to
        come. Its parameters are stale to the capture anyway (before_unshard)."""
        param_group = self.param_group
        if self.gathered_in == capture or not _fsdp2.is_idle(param_group) or not _fsdp2.is_unsharded(param_group) \
                or _fsdp2.all_gather_in_flight(param_group) \
                or (_fsdp2.backward_pending(param_group) and not self.no_grad_forwards_only()):
            return False
        _fsdp2.to_sharded(param_group)
        return True

    def before_replay(self) -> None:
        """Before a CUDA graph replays (any graph: which windows a replay writes is not known on
        the host), parameters FSDP2 holds unsharded on a window a graph captured for this group
        are resharded: the replay rewrites the window under them, and model.parameters() would
        return what it wrote. Afterwards FSDP2 gathers them anew where it uses them."""
        if self.lease.captures and _fsdp2.is_idle(self.param_group) and _fsdp2.is_unsharded(self.param_group) \
                and not _fsdp2.all_gather_in_flight(self.param_group):
            _fsdp2.to_sharded(self.param_group)

    def no_grad_forwards_only(self) -> bool:
        """Whether every forward FSDP2 recorded since the group's last backward ran under
        torch.no_grad (evaluation): no backward will come for them."""
        return _fsdp2.backward_pending(self.param_group) and not self.grad_forward

    def all_gather(self, stream: torch.cuda.Stream | None = None) -> _fsdp2.AllGatherResult:
        compute = torch.cuda.current_stream(self.pool.device) if self.cuda else None
        capture = _capture.current_capture(self.pool.device)
        if capture:
            self._refuse_capture()
        if capture and (not self.param_outputs or (self.gather is not None and self.gather.unchecked)):
            raise not_capturable(self.path, "its first all-gather is being captured (it lays the "
                                 "group out and checks it with the other ranks on the host)",
                                 "run one step uncaptured first, as torchtitan's warm-up steps do")
        if not self.param_outputs:
            self._follow_extensions()
        window = self.lease.acquire_for_all_gather(capture, self.path)
        self._ensure_param_outputs()
        event = None
        with _profiled(lambda: f"tide::all_gather {self.path} ({self.ag_bytes} B)", self.cuda):
            if self.cuda:
                # On FSDP2's all-gather stream, after the compute stream (optimizer steps write
                # the shards) and after the window's previous user; FSDP2 waits on the event.
                stream = stream or compute
                stream.wait_stream(compute)
                with torch.cuda.stream(stream):
                    shards = self._shards(stream, capture)
                window.use_on(stream, capture)
                window.run(self.ag_program, [s.data_ptr() for s in shards], (), self._scales())
                event = stream.record_event()
            else:  # `shards` referenced until the program has read them (extension inputs are new tensors)
                shards = self._shards(None, capture)
                window.run(self.ag_program, [s.data_ptr() for s in shards], (), self._scales())
        if capture:  # its replays write this window: the window is the graph's and this group's
            self.lease.record(window, capture)
        self.gathered_in = capture
        if self.gather is not None and self.gather.unchecked:
            with torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
                self.gather.check_casts(self.fsdp_params, self.rank, self.group)
        self.counts.all_gathers += 1
        self.counts.all_gather_bytes += self.ag_bytes
        if self.gather is not None:
            numels, dtypes = self.gather.input_numels(), self.gather.input_dtypes()
        else:
            numels, dtypes = self.result_numels, self.result_dtypes
        return _fsdp2.all_gather_result(self.param_outputs[0], numels, dtypes, event)

    def capture_refusal(self) -> tuple[str, str]:
        """CUDA: why no CUDA graph can capture this group's collectives, whichever step it captures,
        and what to do instead; ("", "") when a capture can (after one uncaptured step)."""
        if not self.cuda:
            return "", ""
        across_nodes = _tide.CudaExecutor.capture_refusal(self.ag_program)
        if across_nodes:
            return (f"its collectives span nodes ({across_nodes})",
                    "run the steps uncaptured (torchtitan: --training.disable_cuda_graphs)")
        if any(_fsdp2.offloaded(fp) for fp in self.fsdp_params):
            return ("its shards are offloaded to the CPU (FSDP2's CPUOffloadPolicy), and the "
                    "optimizer steps them on the host", "capture without CPU offload")
        return "", ""

    def _refuse_capture(self) -> None:
        what, instead = self.capture_refusal()
        if what:
            raise not_capturable(self.path, what, instead)

    def _scales(self) -> list[int]:
        """The scales of the e4m3 casts of the shards _shards just made ([] without such casts)."""
        return self.gather.scale_pointers() if self.gather is not None else []

    def _shards(self, stream: torch.cuda.Stream | None, capture: int) -> list[torch.Tensor]:
        """What the all-gather program reads: each laid-out param's padded shard, or with all-gather
        extensions each param's all-gather inputs (_extension.py)."""
        if self.gather is not None:
            return self.gather.shards(
                self.fsdp_params, lambda i, j: self._shard(self.fsdp_params[i], self.gather_layout.params[j],
                                                           stream),
                lambda amaxes: self.amax_exchange(amaxes, self.pool, capture, self.path, self.lease), capture,
                self.path)
        return [self._shard(fp, p, stream) for p, fp in zip(self.layout.params, self.laid_out)]

    def _shard(self, fp: _fsdp2.FSDPParam, p: _tide.ParamLayout, stream: torch.cuda.Stream | None) -> torch.Tensor:
        """FSDP param `fp`'s padded shard as the all-gather reads it for layout param `p`. With CPU
        offload on CUDA the shards live in host memory: each goes to the device by a copy engine on
        the all-gather stream (a shard-sized tensor, as stock FSDP2's own offload copy; no
        full-group buffer). Allocated on that stream, so the allocator hands its memory out again
        only in that stream's order, after the all-gather has read it."""
        data = _fsdp2.sharded_data(fp)
        if data.dtype != TIDE_TO_TORCH[p.shard_dtype]:
            raise ValueError(f"tide.fsdp: param group {self.path}: {p.name} is {data.dtype}, but was "
                             f"{TIDE_TO_TORCH[p.shard_dtype]} at tide.fsdp.enable (model.to(dtype) "
                             "after enable?): cast the model before tide.fsdp.enable, or disable, "
                             "cast and enable again")
        if not data.is_contiguous():
            raise RuntimeError(f"tide.fsdp: param group {self.path}: sharded data of {p.name} is "
                               "not contiguous (FSDP2 internals changed?)")
        if stream is not None and data.device.type == "cpu" and _fsdp2.offloaded(fp):
            data = data.to(self.pool.device, non_blocking=data.is_pinned())
        if data.device.type != self.pool.device.type:
            raise RuntimeError(f"tide.fsdp: param group {self.path}: sharded data of {p.name} is "
                               f"on {data.device}, expected {self.pool.device}")
        return data

    def owns(self, all_gather_result: _fsdp2.AllGatherResult) -> bool:
        return bool(self.param_outputs) and all_gather_result.all_gather_output is self.param_outputs[0]

    def copy_out(self) -> None:
        self.storage.restore()  # where stock's copy-out re-allocates the outputs' storage
        if self.gather is not None:
            return self.gather.copy_out(self.fsdp_params)
        for fp, out in zip(self.fsdp_params, self.all_gather_outputs):
            _fsdp2.set_all_gather_outputs(fp, [out])

    def on_param_freed(self, fp: _fsdp2.FSDPParam) -> None:
        """FSDP2 frees param `fp`'s unsharded tensors (reshard): the window is vacated (at the
        group's first param) and an extension's own inner tensors freed, as stock frees them."""
        if self.gather is not None and self.storage is not None:
            _fsdp2.free_inner_tensors(fp, self.storage)
        if not self.lease.vacate(self.storage):
            # FSDP2 frees unsharded params only after an all-gather built them: this one ran
            # without TIDE, so TIDE's window is not what the params are (or were) built on.
            raise RuntimeError(
                f"tide.fsdp: param group {self.path}: FSDP2 freed parameters that TIDE did not gather: "
                "its all-gather ran past TIDE (code that replaced foreach_all_gather without "
                "calling the original?). TIDE cannot vouch for this model's parameters; "
                "call tide.fsdp.disable(model) before replacing FSDP2's functions")

    def rs_program(self, subset: tuple[int, ...], grad_dtype: torch.dtype, reduce_dtype: torch.dtype,
                   options_key: tuple) -> "RsPlan":
        key = (subset, grad_dtype, reduce_dtype, options_key)
        program = self.rs_programs.get(key)
        if program is None:
            specs = [_tide.ParamSpec(self.layout.params[i].name, list(self.layout.params[i].shape),
                                     TORCH_TO_TIDE[grad_dtype], TORCH_TO_TIDE[reduce_dtype],
                                     shard_dim=self.layout.params[i].shard_dim)
                     for i in subset]
            layout = _tide.BucketLayout(specs, self.layout.topology)
            kind, prescale = options_key
            options = _tide.ReduceOptions(kind=kind, prescale=prescale)
            offsets, offset = [], 0
            for p in layout.params:  # stock's flat output layout: padded shards back to back
                offsets.append(offset * reduce_dtype.itemsize)
                offset += p.shard_numel
            grad_bytes = sum(p.numel for p in layout.params) * grad_dtype.itemsize
            program = RsPlan(_tide.plan_reduce_scatter(layout, self.rank, options, self.id, self.across_nodes),
                             tuple(offsets), grad_bytes)
            self.rs_programs[key] = program
        return program


class RsPlan(NamedTuple):
    """A reduce-scatter's program and what a step needs besides the gradients' pointers, computed
    once: each param's byte offset in stock's flat output, and the gradients' bytes."""
    program: object
    output_offsets: tuple
    grad_bytes: int


class ReduceScatterComm(_fsdp2.ReduceScatterBase):
    """FSDP2's reduce-scatter comm (its ABC where the version has one) as TIDE runs it inside stock
    ``foreach_reduce``: the full-group input buffer it allocates is a one-element stand-in
    (copy-in is skipped for it), and the "collective" is TIDE-RS from the per-parameter gradients
    straight into the output shard."""

    def __init__(self, bucket: Bucket, subset: tuple[int, ...], divide_factor: float | None) -> None:
        self.bucket, self.subset, self.divide_factor = bucket, subset, divide_factor
        self.input_standin: torch.Tensor | None = None
        self.grads: list[torch.Tensor] | None = None

    def allocate(self, size: torch.Size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.input_standin is None:
            numel = math.prod(size)
            self.input_standin = torch.empty(1, dtype=dtype, device=device).expand(numel)
            return self.input_standin
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup | None = None, op: object = None, async_op: bool = False) -> None:
        if input_tensor is not self.input_standin or self.grads is None:
            raise RuntimeError("tide.fsdp: reduce-scatter called without TIDE's gradient hand-off "
                               "(FSDP2 internals changed?)")
        bucket, grads = self.bucket, self.grads
        # stock foreach_reduce calls this on its reduce-scatter stream
        stream = torch.cuda.current_stream(bucket.pool.device) if bucket.cuda else None
        capture = _capture.current_capture(bucket.pool.device)
        if capture:
            bucket._refuse_capture()
        if op == dist.ReduceOp.AVG:
            options_key = (_tide.ReduceKind.avg, 1.0)
        elif op == dist.ReduceOp.SUM:
            options_key = (_tide.ReduceKind.sum, 1.0)
        else:  # PREMUL_SUM(1 / gradient_divide_factor)
            options_key = (_tide.ReduceKind.sum, 1.0 / float(self.divide_factor))
        plan = bucket.rs_program(self.subset, grads[0].dtype, output_tensor.dtype, options_key)
        program = plan.program
        # One array pass per step over the pointers: no per-param binding call or object.
        base = output_tensor.data_ptr()
        outputs = [base + offset for offset in plan.output_offsets]
        inputs = list(map(torch.Tensor.data_ptr, grads))
        window = bucket.lease.staging_window(program.window_bytes, capture, bucket.path)
        nbytes = plan.grad_bytes
        bucket.counts.reduce_scatters += 1
        bucket.counts.reduce_scatter_bytes += nbytes
        try:
            with _profiled(lambda: f"tide::reduce_scatter {bucket.path} ({nbytes} B)", bucket.cuda):
                if bucket.cuda:
                    window.use_on(stream, capture)
                    window.run(program, inputs, outputs)
                    for g in grads:  # read in place on this stream; freed by the compute stream
                        g.record_stream(stream)
                    window.set_ready(stream.record_event(), capture)
                else:
                    window.run(program, inputs, outputs)
            if capture:
                bucket.lease.record(window, capture)
        finally:
            bucket.lease.release_staging(window)
            self.grads = None
        return None
