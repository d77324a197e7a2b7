"""The version adapter: every private FSDP2 symbol tide touches (tide.fsdp, and tide-bench's
stand-ins for FSDP2's collectives), and nothing else.

FSDP2's internals (``torch.distributed.fsdp._fully_shard``) change between releases; this module
is the one place that reads them, so a new torch version means reading this file against its
sources (docs/fsdp2_internals.md lists what differs). ``check_torch_version`` refuses, with
one line, a version outside the range tide.fsdp is written and tested against.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from typing import Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
from torch.distributed.fsdp._fully_shard import _fsdp_common as common
from torch.distributed.fsdp._fully_shard import _fsdp_param as param_module
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module
from torch.distributed.tensor import Shard

# Written against 2.11, 2.13 (2.14 is 2.13 for FSDP2) and 2.15, 2.12 read from its sources; tested
# on 2.11, 2.13, 2.14 and 2.15. The upper bound is the newest released torch: a later one is
# refused until its FSDP2 has been read (this tuple is the one place that says so).
SUPPORTED = ((2, 11), (2, 15))

ShardedState = param_module.ShardedState
# FSDP2's reduce-scatter comm interface (torch >= 2.12: _fsdp_api.ReduceScatter, an ABC whose
# instances foreach_reduce calls); TIDE's comm subclasses it where it exists.
try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatterBase
except ImportError:
    ReduceScatterBase = object
TrainingState = common.TrainingState
# The FSDP2 objects TIDE's internal signatures name.
FSDPParam = param_module.FSDPParam
FSDPParamGroup = group_module.FSDPParamGroup
ParamName = Callable[[FSDPParam, int], str]  # what param_names returns
AllGatherResult = collectives.AllGatherResult

# The functions TIDE hooks: (module, attribute path, function name inside FSDP2's source file).
# _hooks.py hooks the function objects themselves, so every reference to them sees TIDE.
HOOK_TARGETS = {
    "foreach_all_gather": (group_module, "foreach_all_gather"),
    "foreach_all_gather_copy_out": (group_module, "foreach_all_gather_copy_out"),
    "foreach_reduce": (group_module, "foreach_reduce"),
    "foreach_reduce_scatter_copy_in": (collectives, "foreach_reduce_scatter_copy_in"),
    "free_unsharded_param": (param_module.FSDPParam, "free_unsharded_param"),
    "unshard": (group_module.FSDPParamGroup, "unshard"),
}
# The parameters TIDE's dispatchers read from each hooked call, by name (_hooks.Call).
READ_PARAMETERS = {
    "foreach_all_gather": ("fsdp_params", "all_gather_comm", "all_gather_stream"),
    "foreach_reduce": ("fsdp_params", "unsharded_grads", "reduce_scatter_comm", "reduce_dtype",
                       "gradient_divide_factor", "all_reduce_group", "all_reduce_grads"),
}


def hook_locations(name: str) -> list:
    """(owner, attribute) pairs where FSDP2 keeps the function `name`: where it calls it from and
    where it is defined (other code may have rebound either)."""
    owner, attr = HOOK_TARGETS[name]
    defined = {"free_unsharded_param": param_module.FSDPParam,
               "unshard": group_module.FSDPParamGroup}.get(name, collectives)
    return [(owner, attr), (defined, attr)]


# Where each hooked function is defined (its code object's file): how the stock function is told
# from other code's wrappers around it.
SOURCE_FILES = {
    "foreach_all_gather": collectives.__file__,
    "foreach_all_gather_copy_out": collectives.__file__,
    "foreach_reduce": collectives.__file__,
    "foreach_reduce_scatter_copy_in": collectives.__file__,
    "free_unsharded_param": param_module.__file__,
    "unshard": group_module.__file__,
}


def torch_version() -> tuple:
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def check_torch_version() -> None:
    low, high = SUPPORTED
    if not low <= torch_version() <= high:
        raise RuntimeError(
            f"tide.fsdp: torch {torch.__version__} is outside the versions tide.fsdp supports "
            f"({low[0]}.{low[1]} to {high[0]}.{high[1]}); its FSDP2 internals are unknown to it")


def param_groups(module: torch.nn.Module) -> list:
    """(module path, FSDPParamGroup) for every param group under `module`, in module order
    (identical on every rank). The path is the group's in the model its FSDP root belongs to:
    FSDP2's own ``_module_fqn`` once lazy init (the first forward) has set it, else the path under
    `module` (before lazy init, the module passed is all there is to go by)."""
    groups, seen = [], set()
    for path, m in module.named_modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        found = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: a list per module
        if found is None:
            single = getattr(state, "_fsdp_param_group", None)  # torch 2.11
            found = [single] if single is not None else []
        for g in found:
            if id(g) not in seen:
                seen.add(id(g))
                fqn = getattr(g, "_module_fqn", None)
                groups.append(((fqn if fqn is not None else path) or "<root>", g))
    return groups


def process_group(param_group):
    """The process group a param group all-gathers and reduce-scatters over (None: no sharding,
    as with FSDP2-based ``replicate()``, whose DDP mesh has no shard dimension)."""
    if not is_sharded(param_group):
        return None
    return param_group._all_gather_process_group


def is_sharded(param_group) -> bool:
    """Whether FSDP2 shards this group's params (False for ``replicate()``: DDP mesh info)."""
    return getattr(getattr(param_group, "mesh_info", None), "shard_mesh_dim", None) is not None


def all_gather_in_flight(param_group) -> bool:
    """An all-gather issued and not yet copied out (unshard(async_op=True), a prefetch)."""
    return getattr(param_group, "_all_gather_result", None) is not None


def state_fallback_reason(param_group) -> str:
    """Why a param group's current state is one TIDE does not own ("" if it can take it over)."""
    if all_gather_in_flight(param_group):
        return ("has an all-gather in flight (unshard(async_op=True) not yet waited on, or a "
                "prefetch): enable TIDE before it, or after the step that consumes it")
    state = getattr(param_group, "_training_state", TrainingState.IDLE)
    if state != TrainingState.IDLE:
        return f"is in FSDP2 training state {state.name} (inside forward or backward): call it between steps"
    if gradient_reduction_pending(param_group):
        return ("has a gradient reduction in flight (finalize_backward(async_op=True)): its "
                "reduce-scatters may still run and FSDP2 holds their buffers; call it after the "
                "handle's wait()")
    if backward_pending(param_group):
        way_out = ("call model.reset_iter_state() first" if hasattr(FSDPModule, "reset_iter_state")
                   else "run a training step first")
        manual = (", or with set_manual_backward_finalization(True) after finalize_backward()"
                  if hasattr(FSDPModule, "finalize_backward") else "")
        return ("has run a forward whose backward has not finished: autograd holds the unsharded "
                "parameters that forward built, so their gradients would be lost; call it after "
                f"the backward{manual} (after a torch.no_grad() forward, where no backward "
                f"follows: {way_out})")
    for fp in param_group.fsdp_params:
        if fp.sharded_state != ShardedState.SHARDED:
            return (f"is {fp.sharded_state.name} (unsharded by unshard() or reshard_after_forward=False): "
                    "call model.reshard() first")
    if gradients_pending(param_group):
        return ("holds unsharded gradients not yet reduced (set_requires_gradient_sync(False) "
                "micro-batches): enable or disable TIDE after the micro-batch that reduces them")
    return ""


def is_idle(param_group) -> bool:
    """Whether the group is between steps (FSDP2 runs none of its forward or backward)."""
    return getattr(param_group, "_training_state", TrainingState.IDLE) == TrainingState.IDLE


def in_forward(param_group) -> bool:
    """Whether FSDP2 runs the group's forward (its pre-forward unshard, or a forward prefetch)."""
    return getattr(param_group, "_training_state", TrainingState.IDLE) == TrainingState.FORWARD


def in_pre_backward(param_group) -> bool:
    return getattr(param_group, "_training_state", TrainingState.IDLE) == TrainingState.PRE_BACKWARD


def is_unsharded(param_group) -> bool:
    """Whether FSDP2 holds the group's unsharded parameters (its unshard() then does nothing)."""
    return all(fp.sharded_state == ShardedState.UNSHARDED for fp in param_group.fsdp_params)


def to_sharded(param_group) -> None:
    """FSDP2's own reshard of the group, whatever reshard_after_forward says: it frees the
    unsharded parameters (free_unsharded_param, per param) and marks the group sharded."""
    param_group._to_sharded()


def forget_forwards(param_group) -> None:
    """Drops FSDP2's record of the group's forwards since its last backward (what
    ``reset_iter_state`` clears): for forwards under torch.no_grad, whose backward never comes."""
    param_group._post_forward_indices.clear()


def recorded_forward_groups(param_group) -> list:
    """The groups of the group's FSDP tree whose forwards FSDP2 recorded since the tree's last
    backward, once per group: the order its backward prefetches by (``post_forward_order``)."""
    order = getattr(getattr(param_group, "comm_ctx", None), "post_forward_order", None) or []
    return list({id(g): g for g in order}.values())


def forget_recorded_forwards(param_group) -> None:
    """Drops every record of forwards in the group's FSDP tree since its last backward (what the
    root's post-backward callback clears when the backward ends)."""
    order = param_group.comm_ctx.post_forward_order
    for g in order:
        g._post_forward_indices.clear()
    order.clear()


def gradient_reduction_pending(param_group) -> bool:
    """torch >= 2.15: the group's FSDP tree finalized a backward asynchronously and the handle
    ``finalize_backward(async_op=True)`` returned has not been waited on (FSDP2 keeps it in the
    shared comm context until ``wait()``)."""
    return getattr(param_group.comm_ctx, "active_gradient_reduction", None) is not None


def backward_pending(param_group) -> bool:
    """A forward ran and the backward that finalizes it has not: FSDP2 records each forward use
    of a group for the pre-backward prefetch order and clears the record when the backward ends.
    (It records no_grad forwards too, so this also holds after an eval forward until the next
    backward: a refusal then, never lost gradients.)"""
    return bool(getattr(param_group, "_post_forward_indices", None))


def gradients_pending(param_group) -> bool:
    """Gradients accumulated without synchronization, kept on the unsharded parameters (or in
    FSDP2's accumulation buffer) until a later micro-batch reduces them: dropping the unsharded
    parameters, as enable and disable do, would lose them."""
    for fp in param_group.fsdp_params:
        if getattr(fp, "unsharded_accumulated_grad", None) is not None:
            return True
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and unsharded.grad is not None:
            return True
    return False


def uses_post_forward_mesh(param_group) -> bool:
    return bool(getattr(param_group, "_use_post_forward_mesh", False))


def custom_comm_reason(param_group) -> str:
    """Non-empty when the group's all-gather or reduce-scatter comm is not FSDP2's default (torch
    >= 2.12: set_custom_all_gather / set_custom_reduce_scatter, symmetric memory, allocation from
    the process group), or its copy functions around them are not (torch >= 2.15: the group's
    all-gather output function and reduce-scatter input function): TIDE would replace the user's
    comm, or skip the copy-out or copy-in the user's function runs in, so such a group stays stock."""
    default_ag = getattr(collectives, "DefaultAllGather", None)
    default_rs = getattr(collectives, "DefaultReduceScatter", None)
    ag = getattr(param_group, "_all_gather_comm", None)
    rs = getattr(param_group, "_reduce_scatter_comm", None)
    if ag is not None and default_ag is not None and type(ag) is not default_ag:
        return f"a custom all-gather comm ({type(ag).__name__})"
    if rs is not None and default_rs is not None and type(rs) is not default_rs:
        return f"a custom reduce-scatter comm ({type(rs).__name__})"
    return custom_all_gather_output_reason(param_group) or \
        custom_reduce_scatter_input_reason(getattr(param_group, "_prepare_reduce_scatter_inputs", None))


# torch >= 2.15: the functions FSDP2's copy-out and reduce-scatter copy-in call by default; a
# param group's _all_gather_output_fn / _prepare_reduce_scatter_inputs may name others (None where
# the version has no such hook).
_DEFAULT_ALL_GATHER_OUTPUT_FN = getattr(collectives, "_default_all_gather_output_fn", None)
_DEFAULT_REDUCE_SCATTER_INPUT_FN = getattr(collectives, "_default_reduce_scatter_input_fn", None)


def _function_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def custom_all_gather_output_reason(param_group) -> str:
    """Non-empty when the group's all-gather output function (torch >= 2.15, the copy-out's
    ``all_gather_output_fn``) is not FSDP2's default: TIDE's all-gather writes the unsharded
    params in place and runs no copy-out to call it from."""
    fn = getattr(param_group, "_all_gather_output_fn", _DEFAULT_ALL_GATHER_OUTPUT_FN)
    if fn is _DEFAULT_ALL_GATHER_OUTPUT_FN:
        return ""
    return f"a custom all-gather output function ({_function_name(fn)})"


def custom_reduce_scatter_input_reason(fn) -> str:
    """Non-empty when `fn`, a reduce-scatter input function (torch >= 2.15: foreach_reduce's
    ``prepare_reduce_scatter_inputs``, None where a call passes none) is not FSDP2's default:
    TIDE's reduce-scatter reads the gradients in place in its own layout, which what `fn` does to
    them or to their padded sizes would not match."""
    if fn is None or fn is _DEFAULT_REDUCE_SCATTER_INPUT_FN:
        return ""
    return f"a custom reduce-scatter input function ({_function_name(fn)})"


# torch >= 2.15 frees all-gather outputs apart from free_unsharded_param, or keeps them
# (FSDPParam.keep_unsharded_storage, set by FSDPModule.set_keep_unsharded_storage).
_FREES_OUTPUTS_APART = hasattr(param_module.FSDPParam, "free_all_gather_outputs")
_keep_unsharded_storage = operator.attrgetter("keep_unsharded_storage")


def keeps_unsharded_storage(param_group) -> bool:
    """set_keep_unsharded_storage(True) (torch >= 2.15): FSDP2's reshard keeps the unsharded
    params' storage and never calls free_unsharded_param, where TIDE hands the group's window back
    to its pool for other groups to fill."""
    return _FREES_OUTPUTS_APART and any(map(_keep_unsharded_storage, param_group.fsdp_params))


def releases_after_post_all_gather(fp) -> bool:
    """An all-gather extension that opts into
    ``fsdp_should_release_all_gather_outputs_after_post_all_gather`` (torch >= 2.15; earlier FSDP2
    ignores it): FSDP2 frees the param's all-gather outputs right after ``fsdp_post_all_gather``,
    inside ``init_unsharded_param``, and not through free_unsharded_param, which TIDE hooks; for
    TIDE those outputs are views of the group's window. Asked as FSDP2 asks it (the method's bool)."""
    should_release = getattr(fp._sharded_local_tensor,
                             "fsdp_should_release_all_gather_outputs_after_post_all_gather", None)
    return _FREES_OUTPUTS_APART and should_release is not None and should_release() is True


def is_default_comm(comm, kind: str) -> bool:
    """Whether a comm object passed to foreach_all_gather / foreach_reduce is FSDP2's default
    (None on versions without comm objects)."""
    cls = getattr(collectives, "DefaultAllGather" if kind == "all_gather" else "DefaultReduceScatter", None)
    return comm is None or cls is None or type(comm) is cls


def param_names(module: torch.nn.Module) -> ParamName:
    """A function naming an FSDPParam by its path under `module` ("blocks.0.q.weight"): the same on
    every rank, and set before the first forward (FSDP2's own ``_param_fqn`` is set at lazy init)."""
    paths = {id(m): p for p, m in module.named_modules()}

    def name(fp, index: int) -> str:
        info = getattr(fp, "_module_info", None)
        owner, attr = getattr(info, "module", None), getattr(info, "param_name", None)
        if owner is not None and attr and id(owner) in paths:
            return f"{paths[id(owner)]}.{attr}".lstrip(".")
        return getattr(fp, "_param_fqn", None) or attr or f"param{index}"

    return name


def unsharded_shape(fp) -> torch.Size:
    """A param's unsharded (original) shape."""
    return fp._orig_size


def shard_dim(fp) -> int:
    """The dim FSDP2 shards the param on (its Shard(dim) placement)."""
    return fp.fsdp_placement.dim


def trainable(fp) -> bool:
    """Whether the param (FSDP2's sharded DTensor of it) requires a gradient."""
    return fp.sharded_param.requires_grad


def padded_shard_shape(fp) -> torch.Size:
    """The shape of a param's shard as FSDP2 pads it (dim 0 rounded up to a multiple of W)."""
    return fp.padded_sharded_param_size


def sharded_data(fp) -> torch.Tensor:
    """The param's padded shard as FSDP2's all-gather reads it (host memory with CPU offload)."""
    return fp._sharded_param_data


def offloaded(fp) -> bool:
    """Whether FSDP2 keeps the param's shard in host memory (CPUOffloadPolicy)."""
    return fp.offload_to_cpu


def set_all_gather_outputs(fp, outputs: list) -> None:
    """Makes `outputs` the tensors FSDP2 builds the unsharded param from (its ``all_gather_outputs``:
    one for a plain param, one per all-gather input with an extension); a no-op when they already
    are."""
    current = fp.all_gather_outputs
    if len(current) != len(outputs) or any(a is not b for a, b in zip(current, outputs)):
        fp.all_gather_outputs = list(outputs)


def has_bytes(fp) -> bool:
    """False for a zero-size param (a dim of 0): nothing to gather or reduce, no place in a window."""
    return fp._orig_size.numel() > 0


def dtypes(fp) -> tuple:
    """(sharded dtype, unsharded/communication dtype) of a param. FSDPParam sets its own dtype
    attributes only at lazy init (first forward), and enable() may run before that, so this reads
    the policy they come from: the param's own (FSDPParam.mp_policy; torch 2.15 resolves
    ``param_dtype_override_fn`` into it per param, and its param groups keep none)."""
    orig = fp.sharded_param.dtype
    return orig, (fp.mp_policy.param_dtype or orig)


def all_gather_result(output: torch.Tensor, input_numels: list, input_dtypes: list, event=None):
    """FSDP2's AllGatherResult for TIDE's all-gather: `output` identifies the bucket's; the inputs'
    numels and dtypes per param (one each for a plain param, one per all-gather input for an
    extension param) are what stock's copy-out would read."""
    fields = dict(all_gather_output=output, all_gather_event=event, all_gather_work=None,
                  param_all_gather_input_dtypes=[list(d) for d in input_dtypes],
                  param_all_gather_input_numels=[list(n) for n in input_numels],
                  all_gather_input_split_sizes=[n for numels in input_numels for n in numels])
    return AllGatherResult(**{f: fields[f] for f in AllGatherResult._fields})


# --- All-gather extensions (fsdp_pre_all_gather / fsdp_post_all_gather; _extension.py) -------------

def local_tensor_type(fp) -> str:
    """The class name of a param's sharded local tensor (a subclass with an all-gather extension)."""
    return type(fp._sharded_local_tensor).__name__


def sharded_local_tensor(fp) -> torch.Tensor:
    """The param's sharded local tensor (the subclass instance that defines an extension)."""
    return fp._sharded_local_tensor


def shard_mesh(fp):
    """The mesh FSDP2 passes ``fsdp_pre_all_gather`` (the shard dim's, from the root mesh; older
    releases name it ``shard_mesh``)."""
    return fp.shard_mesh_from_root if hasattr(type(fp), "shard_mesh_from_root") else fp.shard_mesh


def record_extension_inputs(fp, metadata, input_sizes: list) -> None:
    """What FSDP2's own ``all_gather_inputs`` records for ``init_unsharded_param``: the metadata
    ``fsdp_post_all_gather`` receives and the inputs' N-D sizes, for inputs TIDE made itself."""
    if not hasattr(fp, "_extensions_data"):
        fp._init_extensions()  # as extension_inputs: methods attached after fully_shard
    fp._extensions_data.all_gather_metadata = metadata
    fp._extensions_data.all_gather_input_sizes = list(input_sizes)


def has_extension(fp) -> bool:
    """Whether a param's sharded tensor defines FSDP2's all-gather extension protocol."""
    return hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")


def extension_inputs(fp, clear: bool = True) -> list:
    """A param's all-gather inputs, 1-D, from FSDP2's own ``all_gather_inputs`` (which calls
    ``fsdp_pre_all_gather`` with the signature the tensor defines, moves CPU-offloaded shards to
    the device, checks padding, and records the metadata and input sizes that
    ``init_unsharded_param`` hands ``fsdp_post_all_gather``). clear=True (a probe outside an
    all-gather) forgets that record again."""
    if not hasattr(fp, "_extensions_data"):
        # The methods were attached after fully_shard; FSDP2 sets them up at its lazy init
        # ("allow monkey patch after init"), which comes after an enable before the first forward.
        fp._init_extensions()
    inputs = fp.all_gather_inputs
    if clear:
        fp._extensions_data.clear()
    return inputs


@contextlib.contextmanager
def gradients_in_place(fsdp_params, grads: list):
    """Around stock ``foreach_reduce`` for TIDE-RS: stock chunk-cats (copies) the gradient of a
    param sharded on a dim > 0 into rank-major order before its copy-in, where TIDE reads the
    gradient's blocks in place. For the call such params look sharded on dim 0 and their gradients
    (entries of `grads`, the list stock frees) flat views: numel = W x the shard, so stock's dim-0
    padding adds nothing and its output offsets stay the shards back to back. Data is untouched."""
    inner = [(i, fp, fp.fsdp_placement) for i, fp in enumerate(fsdp_params) if fp.fsdp_placement.dim != 0]
    for i, fp, _ in inner:
        grads[i] = grads[i].view(-1)
        fp.fsdp_placement = Shard(0)
    try:
        yield
    finally:
        for _, fp, placement in inner:
            fp.fsdp_placement = placement


class UnshardedStorage:
    """The storages of a bucket's per-param all-gather outputs, freed and re-allocated where stock
    FSDP2 frees (``free_storage``: ``resize_(0)`` at reshard) and re-allocates (``alloc_storage`` at
    copy-out) its own. TIDE's outputs view the bucket's fixed address, which maps a pooled window
    that other buckets refill after this one reshards, so every view of them (the unsharded
    params, FSDP2's ``all_gather_outputs``, autograd's saved tensors, a user's views; all share
    each output's StorageImpl) must stop reading it then, as they would with stock.

    Where torch has ``UntypedStorage._swap_data_ptr_`` (2.13, 2.14), `release` swaps each output's
    data pointer with an empty storage of its device: the StorageImpl is then 0 bytes, exactly as
    stock's after ``resize_(0)`` (the same ``setStorage ... out of bounds for storage of size 0``
    error on a view's use); `restore` swaps it back. Host-side pointer swaps: no allocation, no
    synchronization. Without it (torch 2.11), `release` bumps each output's version counter,
    which its views share, so autograd refuses a saved tensor used while the bucket is released
    ("modified by an inplace operation"), and `restore` sets the version back (as stock's
    copy-out preserves it); a view read directly outside autograd is not caught there."""

    SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def __init__(self, outputs: list):
        self.outputs = outputs
        self.storages = [t.untyped_storage() for t in outputs]
        self.ids = {s._cdata for s in self.storages}  # their StorageImpls, which views share
        # The other side of each swap: empty while the output is live, the output's bytes while not.
        self.aside = [torch.UntypedStorage(0, device=t.device) for t in outputs] if self.SWAP else []
        self.versions: list = []
        self.live = True

    def _swap(self) -> None:
        """Each output's bytes and its aside storage trade places (release and restore alike)."""
        for storage, aside in zip(self.storages, self.aside):
            storage._swap_data_ptr_(aside)

    def release(self) -> None:
        if not self.live:
            return
        self.live = False
        if self.SWAP:
            self._swap()
        else:
            self.versions = [t._version for t in self.outputs]
            for t in self.outputs:
                torch.autograd.graph.increment_version(t)

    def restore(self) -> None:
        if self.live:
            return
        self.live = True
        if self.SWAP:
            self._swap()
        else:
            torch._C._autograd._unsafe_set_version_counter(tuple(self.outputs), tuple(self.versions))


def free_inner_tensors(fp, window: UnshardedStorage) -> None:
    """Frees what stock's ``free_unsharded_param`` frees beside the all-gather outputs: the tensors
    an extension's ``fsdp_post_all_gather`` returned as its inner tensors (an upcast copy, say),
    their storages resized to 0 as stock's ``free_storage`` does; stock's ``init_unsharded_param``
    re-allocates them at the next all-gather. Those that view the window's outputs are `window`'s
    to release."""
    for t in fp._unsharded_inner_tensors:
        storage = t.untyped_storage()
        if storage._cdata not in window.ids and storage.size() != 0:
            storage.resize_(0)


def forget_unsharded(fp) -> None:
    """Drops a param's unsharded tensors (a stock all-gather's, or TIDE's) so that the next
    all-gather's output backs the unsharded parameter."""
    fp.all_gather_outputs = []
    fp._unsharded_inner_tensors = []  # an extension's (fsdp_post_all_gather's) views of them
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param


# --- FSDP2's calls as tide-bench replaces them (bench/fsdp_bench.py) ------------------------------

@contextlib.contextmanager
def calls_replaced(replacements: dict):
    """Within the block FSDP2 calls ``replacements[name](original)`` where it calls its function
    `name` (a HOOK_TARGETS name, looked up where FSDP2's param group or FSDPParam calls it),
    `original` being what it called there before: stock's, another replacement, or a function TIDE
    hooked (TIDE replaces the function object's code, so its dispatch runs inside `original`). Each
    is put back on exit."""
    saved = []
    try:
        for name, replace in replacements.items():
            owner, attr = HOOK_TARGETS[name]
            original = getattr(owner, attr)
            setattr(owner, attr, replace(original))
            saved.append((owner, attr, original))
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


@contextlib.contextmanager
def default_reduce_scatter_replaced(replace: Callable):
    """Within the block FSDP2's default reduce-scatter comm (DefaultReduceScatter, a group's unless
    it has a custom one) calls ``replace(original)`` as its ``__call__`` method, `original` being
    the one it had."""
    cls = collectives.DefaultReduceScatter
    original = cls.__call__
    cls.__call__ = replace(original)
    try:
        yield
    finally:
        cls.__call__ = original


# What foreach_reduce returns, in order, by the names post_backward unpacks it into. torch 2.11
# returns no post_reduce_stream (the stream the post-reduce event is recorded on; later releases
# key that event by it in comm_ctx._last_post_reduce_events): whether the running torch does is
# read from foreach_reduce's declared return type, whose str names torch.Stream among the tuple's
# types whether the annotation is evaluated (2.11 to 2.15) or a string.
REDUCE_RESULTS = tuple(
    name for name in ("reduce_scatter_input", "reduce_scatter_event", "post_reduce_stream",
                      "post_reduce_event", "all_reduce_input", "all_reduce_event", "partial_reduce_output")
    if name != "post_reduce_stream"
    or "Stream" in str(inspect.signature(collectives.foreach_reduce).return_annotation))


def foreach_reduce_result(*, reduce_scatter_input, reduce_scatter_event, post_reduce_stream,
                          post_reduce_event, all_reduce_input, all_reduce_event,
                          partial_reduce_output) -> tuple:
    """The tuple a stand-in for foreach_reduce returns, shaped as the running torch's FSDP2 unpacks
    it (REDUCE_RESULTS: post_reduce_stream is left out where foreach_reduce returns none)."""
    results = {"reduce_scatter_input": reduce_scatter_input, "reduce_scatter_event": reduce_scatter_event,
               "post_reduce_stream": post_reduce_stream, "post_reduce_event": post_reduce_event,
               "all_reduce_input": all_reduce_input, "all_reduce_event": all_reduce_event,
               "partial_reduce_output": partial_reduce_output}
    return tuple(results[name] for name in REDUCE_RESULTS)


def holds_all_gather_outputs(fp) -> bool:
    """Whether the param's all-gather outputs (what its unsharded param views) exist and hold their
    storage: an all-gather filled them and no reshard has freed them since."""
    outputs = fp.all_gather_outputs
    return bool(outputs) and all(t.untyped_storage().size() for t in outputs)


def zero_gradient_if_none(fp) -> None:
    """Gives the param (FSDP2's sharded DTensor of it) a zero gradient of its shard's shape and
    dtype, as a reduce-scatter would give it a gradient, unless it already has one."""
    sharded = fp.sharded_param
    if sharded.grad is None:
        sharded.grad = fp.to_sharded_dtensor(torch.zeros(fp.sharded_size, dtype=sharded.dtype,
                                                         device=sharded.device))
