"""tide.fsdp among everything else that touches FSDP2 (issue 15), on CPU with ranks as threads of
one process (FSDP2's multi-threaded tests' world: the "threaded" backend). Every case trains the
same model with stock FSDP2 and with TIDE and compares, and asserts that TIDE handled the groups:
the counts on its handle moved and FSDP2's layout copies did not run. Parameters must be bitwise
equal to stock's: at W = 2 every reduction is a sum of two numbers, and at W = 4 (2 x 2 for HSDP)
the threaded backend sums the ranks' gradients in rank order as TIDE does, dividing by a power of
two (fsdp_harness.compare)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives_module
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

import fsdp_harness as h
import threaded_world
import tide
import tide.fsdp
from tide.fsdp import _dispatch, _fallbacks, _hooks

_construct = threading.Lock()  # torch's global RNG: one thread-rank builds its model at a time


def make(layers=5, tied=False, shard_kwargs=None, root_kwargs=None, mesh=None):
    with _construct:
        torch.manual_seed(0)
        model = h.TinyLlama(layers=layers, tied=tied)
    kw = dict(shard_kwargs or {})
    if mesh is not None:
        kw["mesh"] = mesh
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **{**kw, **(root_kwargs or {})})
    return model


def step(model, gen, micro=1, sync_pattern=None, last_pattern=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for m in range(micro):
        if sync_pattern is not None:
            model.set_requires_gradient_sync(sync_pattern[m])
        if last_pattern is not None:
            model.set_is_last_backward(last_pattern[m])
        tokens = torch.randint(0, h.VOCAB, (2, 8), generator=gen)
        loss = F.cross_entropy(model(tokens).view(-1, h.VOCAB), tokens.roll(-1, 1).view(-1))
        loss.backward()
    opt.step()
    opt.zero_grad()


def sgd_steps(model, input_shape, lr, steps=2):
    """`steps` SGD steps on model(x).sum(), x of `input_shape` from this rank's generator; the
    sharded params after them."""
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        model(torch.randn(*input_shape, generator=gen)).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.to_local().detach().clone() for p in model.parameters()]


def params_of(model):
    for m in model.modules():  # reshard_after_backward=False leaves them unsharded
        if isinstance(m, torch.distributed.fsdp.FSDPModule):
            m.reshard()
    return [p.to_local().detach().clone() for p in model.parameters()]


def train(model, steps=2, **kw):
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    counter = h.OpCounter()
    with counter:
        for _ in range(steps):
            step(model, gen, **kw)
    return params_of(model), counter.counts


def _step_counts(world=2):
    """One step of make()'s model after the first, fp32: 6 groups gathered in forward and the 5
    blocks again in backward (the root stays unsharded), 6 reduce-scatters. All-gather bytes: every
    param padded to ceil(d0 / W) rows per rank, W ranks, 4 B; reduce-scatter bytes: the gradients
    as they are. No remaps: every bucket finds the window its address maps free (the first step maps
    them)."""
    model = h.TinyLlama()

    def gathered(params):
        return sum(-(-p.shape[0] // world) * world * (p.numel() // p.shape[0]) * 4 for p in params)

    blocks = [p for b in model.blocks for p in b.parameters()]
    root = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return {"all_gathers": 11, "reduce_scatters": 6,
            "all_gather_bytes": 2 * gathered(blocks) + gathered(root),
            "reduce_scatter_bytes": sum(p.numel() * 4 for p in model.parameters()), "remaps": 0}


STEP_COUNTS = _step_counts()


GROUPS = 6  # make()'s: the root and its 5 blocks


def compare(world, build, train_kwargs=None, before_train=None):
    """fsdp_harness.compare with this module's train(**train_kwargs) and make()'s groups."""
    return h.compare(world, build, lambda model: train(model, **(train_kwargs or {})), GROUPS,
                     before_train=before_train)


# --- ranks as threads ------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_threaded_ranks_match_stock(world):
    compare(world, make)


def test_ranks_that_disagree_get_desync_error_on_every_rank():
    def rank_fn(rank):
        model = make(layers=5 if rank == 0 else 4)  # rank 1 built another model
        return tide.fsdp.enable(model, timeout_ms=20000)

    results = threaded_world.run(2, rank_fn, raise_errors=False)
    for rank, r in enumerate(results):
        assert isinstance(r, tide.DesyncError), f"rank {rank}: {r!r}"
        assert "disagree on param group" in str(r) and "group rank 1 (global 1)" in str(r), str(r)
    assert str(results[0]) == str(results[1])  # the same diagnosis on every rank


def test_exception_on_one_rank_inside_enable_is_raised_on_every_rank():
    """rank 1's norm weight gets an fsdp_pre_all_gather that raises: enable's probe raises there
    alone, and every rank raises the same DesyncError naming rank 1 and the error at once, rank 1
    chaining its own (not the other rank's TimeoutError after timeout_ms)."""
    timeout_ms = 20000

    def refuse(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2's signature (v2)
        raise ValueError("refused on purpose")

    def rank_fn(rank):
        model = make()
        if rank == 1:
            local = model.norm.weight._local_tensor
            local.fsdp_pre_all_gather = local.fsdp_post_all_gather = refuse.__get__(local)
        start = time.monotonic()
        try:
            tide.fsdp.enable(model, timeout_ms=timeout_ms)
        except Exception as e:  # noqa: BLE001 - checked below
            return e, time.monotonic() - start
        return None, time.monotonic() - start

    results = threaded_world.run(2, rank_fn)
    for rank, (error, seconds) in enumerate(results):
        assert isinstance(error, tide.DesyncError), f"rank {rank}: {error!r}"
        assert str(error).startswith("tide.fsdp.enable: global rank 1 raised ValueError at param group "
                                     "<root>: refused on purpose;"), str(error)
        assert seconds < timeout_ms / 1000, f"rank {rank} waited {seconds} s: {error!r}"
    assert str(results[0][0]) == str(results[1][0])
    assert isinstance(results[1][0].__cause__, ValueError), repr(results[1][0].__cause__)


def test_shapes_that_differ_name_the_param():
    def rank_fn(rank):
        with _construct:
            torch.manual_seed(0)
            model = h.TinyLlama()
            if rank == 1:
                model.norm = h.RMSNorm(h.DIM + 1)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return tide.fsdp.enable(model, timeout_ms=20000)

    results = threaded_world.run(2, rank_fn, raise_errors=False)
    for r in results:
        assert isinstance(r, tide.DesyncError) and "param 1: norm.weight [32] torch.float32/torch.float32 vs norm.weight [33]" in str(r), repr(r)


@pytest.mark.parametrize("option, values", [
    ("ranks_per_node", ({"ranks_per_node": 1}, {"ranks_per_node": 2})),
    ("transport", ({"transport": "auto"}, {"transport": "ipc"})),
    ("across_nodes", ({}, {"across_nodes": tide.AcrossNodesOptions(chunk_bytes=1 << 20)}))])
def test_ranks_passing_different_options_get_desync_error_naming_it(option, values):
    """Options shape windows and programs: ranks that differ would fail later, far from the cause."""
    def rank_fn(rank):
        return tide.fsdp.enable(make(), timeout_ms=20000, **values[rank])

    results = threaded_world.run(2, rank_fn, raise_errors=False)
    for rank, r in enumerate(results):
        assert isinstance(r, tide.DesyncError), f"rank {rank}: {r!r}"
        assert f"disagree on enable's {option}" in str(r), str(r)


def test_a_retry_after_a_timeout_meets_on_fresh_keys():
    """Rank 0's enable times out (rank 1 is late); rank 1 then finds rank 0's stale agreement key
    and goes on alone until its own timeout. Both retry: the retry must succeed on both ranks, not
    meet the first attempt's leftovers (it did: one rank enabled, the other hung)."""
    barrier = threading.Barrier(2)

    def rank_fn(rank):
        model = make()
        if rank == 1:
            barrier.wait()  # after rank 0 timed out
        first = None
        try:
            tide.fsdp.enable(model, timeout_ms=1500)
        except TimeoutError as e:
            first = e
        if rank == 0:
            barrier.wait()
        dist.barrier()
        handle = tide.fsdp.enable(model, timeout_ms=20000)
        mine, ops = train(model)
        tide.fsdp.disable(model)
        return first, handle, ops

    for rank, (first, handle, ops) in enumerate(threaded_world.run(2, rank_fn, timeout_s=90)):
        assert isinstance(first, TimeoutError), f"rank {rank}: first enable gave {first!r}"
        h.assert_handled(handle, ops, GROUPS)


def test_a_rank_that_never_enables_is_named_within_the_timeout():
    def rank_fn(rank):
        model = make()
        if rank == 0:
            tide.fsdp.enable(model, timeout_ms=1500)
        return "skipped enable"

    results = threaded_world.run(2, rank_fn, raise_errors=False, timeout_s=60)
    assert isinstance(results[0], TimeoutError), repr(results[0])
    assert "for group ranks [1] (global [1])" in str(results[0]), str(results[0])
    assert results[1] == "skipped enable"


# --- others' patches of the functions TIDE hooks ---------------------------------------------------

class Counting:
    """What a tool does: wrap FSDP2's module functions (to count or time them), restore later."""

    def __init__(self):
        self.calls = {"foreach_all_gather": 0, "foreach_reduce": 0}
        self.saved = {}
        self.lock = threading.Lock()

    def install(self):
        for name in self.calls:
            original = getattr(group_module, name)
            self.saved[name] = original

            def wrapper(*a, __name=name, __original=original, **k):
                with self.lock:
                    self.calls[__name] += 1
                return __original(*a, **k)

            setattr(group_module, name, wrapper)

    def restore(self):
        for name, original in self.saved.items():
            setattr(group_module, name, original)


def test_wrappers_installed_before_enable_keep_counting_and_tide_stays_on():
    tool = Counting()
    tool.install()  # before TIDE installs anything
    try:
        results = compare(2, make)
    finally:
        tool.restore()
    tide_calls = sum(handle.counts()["all_gathers"] for _, handle, _ in results)
    assert tool.calls["foreach_all_gather"] >= tide_calls > 0, (tool.calls, tide_calls)
    assert tool.calls["foreach_reduce"] > 0


def test_wrappers_installed_after_enable_and_restored_mid_training():
    tool = Counting()

    def after_enable(model, handle):
        dist.barrier()
        if dist.get_rank() == 0:
            tool.install()
        dist.barrier()

    results = compare(2, make, before_train=after_enable)
    assert tool.calls["foreach_all_gather"] > 0 and tool.calls["foreach_reduce"] > 0, tool.calls

    # Restoring "the originals" mid-training leaves TIDE on: its hook is the functions themselves.
    def rank_fn(rank):
        model = make()
        handle = tide.fsdp.enable(model)
        gen = torch.Generator().manual_seed(7)
        step(model, gen)
        dist.barrier()
        if rank == 0:
            tool.restore()
        dist.barrier()
        handle.reset_counts()
        counter = h.OpCounter()
        with counter:
            step(model, gen)
        tide.fsdp.disable(model)
        return handle.counts(), counter.counts

    for counts, ops in threaded_world.run(2, rank_fn):
        assert counts == STEP_COUNTS, counts
        assert ops["split_with_sizes_copy"] == 0 and ops["chunk_cat"] == 0, ops


def test_disable_restores_fsdp2_code():
    def rank_fn(rank):
        model = make()
        tide.fsdp.enable(model)
        installed = tide.fsdp._hooks.installed()
        tide.fsdp.disable(model)
        return installed

    assert threaded_world.run(2, rank_fn) == [True, True]
    assert not tide.fsdp._hooks.installed()
    assert group_module.foreach_all_gather.__wrapped__.__code__.co_filename.endswith("_fsdp_collectives.py")


def test_a_replacement_that_bypasses_tide_is_refused_loudly():
    stock = tide.fsdp._hooks.stock("foreach_all_gather")  # a reimplementation: never calls the original
    saved = group_module.foreach_all_gather

    def rank_fn(rank):
        model = make()
        tide.fsdp.enable(model)
        dist.barrier()
        if rank == 0:
            group_module.foreach_all_gather = lambda *a, **k: stock(*a, **k)
        dist.barrier()
        try:
            step(model, torch.Generator().manual_seed(1))
        finally:
            dist.barrier()
            if rank == 0:
                group_module.foreach_all_gather = saved
        return "trained"

    try:
        results = threaded_world.run(2, rank_fn, raise_errors=False, timeout_s=60)
    finally:
        group_module.foreach_all_gather = saved
    for r in results:
        assert isinstance(r, RuntimeError) and "TIDE did not run" in str(r), repr(r)


# --- FSDP2's entry points and knobs --------------------------------------------------------------

def test_async_unshard_in_flight_is_refused_then_enable_works_after_it():
    def rank_fn(rank):
        model = make()
        pending = model.unshard(async_op=True)
        with pytest.raises(ValueError, match="has an all-gather in flight"):
            tide.fsdp.enable(model)
        pending.wait()
        with pytest.raises(ValueError, match="is UNSHARDED .*call model.reshard.. first"):
            tide.fsdp.enable(model)
        model.reshard()
        handle = tide.fsdp.enable(model)
        mine, ops = train(model)
        tide.fsdp.disable(model)
        stock, _ = train(make())
        h.assert_handled(handle, ops, GROUPS)
        return all(torch.equal(a, b) for a, b in zip(mine, stock))

    assert threaded_world.run(2, rank_fn) == [True, True]


def test_unshard_reshard_and_async_unshard_after_enable_run_through_tide():
    def before_train(model, handle):
        model.unshard()
        model.reshard()
        model.unshard(async_op=True).wait()  # FSDP2's pre-forward then finds it unsharded
        model.reshard()
        assert handle.counts()["all_gathers"] == 2, handle.counts()

    compare(2, make, before_train=before_train)


@pytest.mark.parametrize("knob", [
    "reshard_after_backward_false", "reshard_after_forward_false", "forward_prefetch",
    "backward_prefetch", "unshard_in_backward_false", "reduce_scatter_unused_params",
    "gradient_divide_factor", "tied_embeddings", "reduce_scatter_max_input_buffers",
    "separate_reduce_scatter_group"])
def test_fsdp_module_knobs(knob):
    setter = {"reduce_scatter_unused_params": "set_reduce_scatter_unused_params",
              "reduce_scatter_max_input_buffers": "set_reduce_scatter_max_input_buffers",
              "separate_reduce_scatter_group": "set_separate_reduce_scatter_group"}.get(knob)
    if setter and not hasattr(torch.distributed.fsdp.FSDPModule, setter):
        pytest.skip(f"torch {torch.__version__} has no FSDPModule.{setter}")

    def build():
        model = make(tied=knob == "tied_embeddings")
        blocks = list(model.blocks)
        if knob == "reshard_after_backward_false":
            model.set_reshard_after_backward(False)
        elif knob == "reshard_after_forward_false":
            model.set_reshard_after_forward(False)
        elif knob == "forward_prefetch":
            for a, b in zip(blocks, blocks[1:]):
                a.set_modules_to_forward_prefetch([b])
        elif knob == "backward_prefetch":
            for a, b in zip(blocks[1:], blocks):
                a.set_modules_to_backward_prefetch([b])
        elif knob == "unshard_in_backward_false":
            model.set_reshard_after_forward(False)
            for m in [*blocks, model]:
                m.set_unshard_in_backward(False)
        elif knob == "reduce_scatter_unused_params":
            model.set_reduce_scatter_unused_params(True)
        elif knob == "reduce_scatter_max_input_buffers":
            model.set_reduce_scatter_max_input_buffers(2)
        elif knob == "separate_reduce_scatter_group":
            model.set_separate_reduce_scatter_group(True)
        elif knob == "gradient_divide_factor":
            for m in [*blocks, model]:
                m.set_gradient_divide_factor(2.0)
                m.set_force_sum_reduction_for_comms(True)
        return model

    compare(2, build)


@pytest.mark.parametrize("sync, last", [
    ((False, True), (False, True)), ((True, True), (True, True)), ((True, True), (False, True)),
    ((False, True), (True, True))])
def test_gradient_accumulation_sync_and_last_backward(sync, last):
    compare(2, make, train_kwargs={"micro": 2, "sync_pattern": sync, "last_pattern": last})


def test_enable_and_disable_between_accumulation_micro_batches_are_refused():
    """Gradients accumulated without sync live on the unsharded parameters until a later
    micro-batch reduces them; enable and disable drop those parameters, so they must wait."""
    def micro_batch(model, gen, sync):
        model.set_requires_gradient_sync(sync)
        tokens = torch.randint(0, h.VOCAB, (2, 8), generator=gen)
        F.cross_entropy(model(tokens).view(-1, h.VOCAB), tokens.roll(-1, 1).view(-1)).backward()

    def rank_fn(rank):
        gen = torch.Generator().manual_seed(5)
        model = make()
        micro_batch(model, gen, sync=False)
        with pytest.raises(ValueError, match="holds unsharded gradients not yet reduced"):
            tide.fsdp.enable(model)
        micro_batch(model, gen, sync=True)
        tide.fsdp.enable(model)
        micro_batch(model, gen, sync=False)
        with pytest.raises(ValueError, match="holds unsharded gradients not yet reduced"):
            tide.fsdp.disable(model)
        micro_batch(model, gen, sync=True)
        tide.fsdp.disable(model)
        return "ok"

    assert threaded_world.run(2, rank_fn) == ["ok", "ok"]


def test_enable_and_disable_between_a_forward_and_its_backward_are_refused():
    """Autograd holds the unsharded parameters a forward built; enable and disable replace them,
    so a backward after either would lose its gradients (it did: no error, stale parameters)."""
    def forward(model, gen):
        tokens = torch.randint(0, h.VOCAB, (2, 8), generator=gen)
        return F.cross_entropy(model(tokens).view(-1, h.VOCAB), tokens.roll(-1, 1).view(-1))

    def rank_fn(rank):
        gen = torch.Generator().manual_seed(6)
        model = make()
        loss = forward(model, gen)
        with pytest.raises(ValueError, match="has run a forward whose backward has not finished"):
            tide.fsdp.enable(model)
        loss.backward()
        handle = tide.fsdp.enable(model)
        loss = forward(model, gen)
        with pytest.raises(ValueError, match="has run a forward whose backward has not finished"):
            tide.fsdp.disable(model)
        loss.backward()
        assert handle.counts()["reduce_scatters"] == 6, handle.counts()
        loss = forward(model, gen)
        with torch.no_grad():  # an eval forward beside one whose backward is pending: refused
            forward(model, gen)
        with pytest.raises(ValueError, match="has run a forward whose backward has not finished"):
            tide.fsdp.disable(model)
        loss.backward()
        with torch.no_grad():  # eval forwards alone: no backward comes, disable undoes them
            forward(model, gen)
            forward(model, gen)
        tide.fsdp.disable(model)
        return "ok"

    assert threaded_world.run(2, rank_fn) == ["ok", "ok"]


def test_evaluation_between_steps_then_disable_trains_as_stock():
    """Evaluation forwards (torch.no_grad, the root kept unsharded as FSDP2's default root is) and
    an unshard() between training steps, then disable with the groups where they left them: the
    evaluation losses and the training after disable are stock FSDP2's, bitwise (W = 2: every
    reduction is a sum of two numbers), and TIDE ran every group's collectives before."""
    def evaluate(model, gen):
        tokens = torch.randint(0, h.VOCAB, (2, 8), generator=gen)
        with torch.no_grad():
            return F.cross_entropy(model(tokens).view(-1, h.VOCAB), tokens.roll(-1, 1).view(-1))

    def run(model, handle):
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        # Made once, with the model sharded: one made while a group is unsharded (after an
        # evaluation) would step the unsharded parameters, with stock FSDP2 too.
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        evals = []
        for i in range(4):
            if i == 2 and handle is not None:
                model.unshard()  # every group unsharded, then disable reshards them
                tide.fsdp.disable(model)
            tokens = torch.randint(0, h.VOCAB, (2, 8), generator=gen)
            F.cross_entropy(model(tokens).view(-1, h.VOCAB), tokens.roll(-1, 1).view(-1)).backward()
            opt.step()
            opt.zero_grad()
            evals += [evaluate(model, gen), evaluate(model, gen)]
        return evals, params_of(model)

    def rank_fn(rank):
        stock = run(make(), None)
        model = make()
        handle = tide.fsdp.enable(model)
        mine = run(model, handle)
        return stock, mine, handle

    for (stock_evals, stock_params), (evals, params), handle in threaded_world.run(2, rank_fn):
        assert handle.fallbacks == [] and handle.counts()["all_gathers"] >= 2 * GROUPS, handle.counts()
        for k, (a, b) in enumerate(zip(stock_evals, evals)):
            assert torch.equal(a, b), f"evaluation {k}: {b} (TIDE, then stock) != {a} (stock)"
        for k, (a, b) in enumerate(zip(stock_params, params)):
            assert torch.equal(a, b), f"param {k}: max diff {(a - b).abs().max()}"


def test_replicate_groups_fall_back_and_train_as_stock():
    """FSDP2-based replicate() (a DDP mesh: nothing is sharded) is left to stock FSDP2."""
    replicate = pytest.importorskip("torch.distributed._composable.replicate_with_fsdp").replicate

    def build():
        with _construct:
            torch.manual_seed(0)
            model = h.TinyLlama(layers=2)
        for block in model.blocks:
            replicate(block)
        replicate(model)
        return model

    def rank_fn(rank):
        stock, _ = train(build())
        model = build()
        handle = tide.fsdp.enable(model)
        mine, _ = train(model)
        tide.fsdp.disable(model)
        return handle, all(torch.equal(a, b) for a, b in zip(mine, stock))

    for handle, same in threaded_world.run(2, rank_fn):
        assert handle.buckets == [] and len(handle.fallbacks) == 3, handle.fallbacks
        assert all("replicate()" in why for _, why in handle.fallbacks), handle.fallbacks
        assert same


def test_custom_comm_set_before_enable_stays_stock_and_after_enable_is_refused():
    if not hasattr(group_module.FSDPParamGroup, "_all_gather_comm") and not hasattr(
            torch.distributed.fsdp.FSDPModule, "set_custom_all_gather"):
        pytest.skip(f"torch {torch.__version__} has no custom all-gather comms")
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class Mine(DefaultAllGather):
        pass

    def rank_fn(rank):
        model = make()
        model.set_custom_all_gather(Mine())
        handle = tide.fsdp.enable(model)
        reasons = {reason for _, reason in handle.fallbacks}
        tide.fsdp.disable(model)
        model = make()
        tide.fsdp.enable(model)
        model.set_custom_all_gather(Mine())
        with pytest.raises(ValueError, match="custom all-gather comm .Mine. was set after tide.fsdp.enable"):
            step(model, torch.Generator().manual_seed(0))
        return len(handle.buckets), reasons

    for buckets, reasons in threaded_world.run(2, rank_fn):
        assert buckets == 5 and reasons == {"a custom all-gather comm (Mine)"}, (buckets, reasons)


def test_upstream_comm_features_are_left_to_stock():
    """FSDP2's own comm variants (allocation from the process group; on GPUs symmetric memory)
    replace the default comm objects: TIDE leaves such groups to stock FSDP2 and says so."""
    if not hasattr(torch.distributed.fsdp.FSDPModule, "set_allocate_memory_from_process_group_for_comm"):
        pytest.skip(f"torch {torch.__version__} has no set_allocate_memory_from_process_group_for_comm")

    def rank_fn(rank):
        model = make()
        model.blocks[0].set_allocate_memory_from_process_group_for_comm(True)
        handle = tide.fsdp.enable(model)
        tide.fsdp.disable(model)
        return handle.fallbacks

    for fallbacks in threaded_world.run(2, rank_fn):
        assert len(fallbacks) == 1 and fallbacks[0][0] == "blocks.0", fallbacks
        assert fallbacks[0][1].startswith("a custom all-gather comm (ProcessGroupAlloc"), fallbacks


def test_disable_with_an_all_gather_in_flight_is_refused():
    def rank_fn(rank):
        model = make()
        tide.fsdp.enable(model)
        pending = model.unshard(async_op=True)  # TIDE's all-gather, params still SHARDED
        with pytest.raises(ValueError, match="has an all-gather in flight"):
            tide.fsdp.disable(model)
        pending.wait()
        model.reshard()
        tide.fsdp.disable(model)
        return "ok"

    assert threaded_world.run(2, rank_fn) == ["ok", "ok"]


def test_several_param_groups_of_one_module_get_pools_of_their_own():
    """torch >= 2.12: shard_placement_fn can put a module's params on two meshes over the same
    ranks (dense vs experts): two param groups of one module, of different size classes."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    from torch.distributed.tensor import Shard
    if not hasattr(_fsdp_common, "ShardPlacementResult"):
        pytest.skip(f"torch {torch.__version__} has one param group per module")

    class TwoMeshes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.Parameter(torch.randn(4, 8))
            self.big = torch.nn.Parameter(torch.randn(64, 8))

        def forward(self, x):
            return (x @ self.small.T).sum() + (x @ self.big.T).sum()

    def build():
        with _construct:
            torch.manual_seed(0)
            model = TwoMeshes()
        experts = _fsdp_common.FSDPMeshInfo(DeviceMesh.from_group(dist.new_group([0, 1]), "cpu"),
                                            shard_mesh_dim=0)
        fully_shard(model, shard_placement_fn=lambda p: _fsdp_common.ShardPlacementResult(
            Shard(0), experts) if p is model.big else None)
        return model

    def rank_fn(rank):
        stock = sgd_steps(build(), (3, 8), lr=0.1)
        model = build()
        handle = tide.fsdp.enable(model)
        mine = sgd_steps(model, (3, 8), lr=0.1)
        tide.fsdp.disable(model)
        return len(handle.buckets), len({p.name for p in handle.pools}), handle.counts(), \
            all(torch.equal(a, b) for a, b in zip(mine, stock))

    for buckets, pool_names, counts, bitwise in threaded_world.run(2, rank_fn):
        assert buckets == 2 and pool_names == 2, (buckets, pool_names)
        assert counts["reduce_scatters"] == 4 and bitwise, (counts, bitwise)


# --- HSDP, offload -----------------------------------------------------------------------------------

def test_hsdp_2x2_with_and_without_all_reduce():
    from torch.distributed.device_mesh import init_device_mesh

    def build(all_reduce=True):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = make(mesh=mesh)
        model.set_requires_all_reduce(all_reduce)
        return model

    compare(4, build)
    compare(4, lambda: build(all_reduce=False))


@pytest.mark.parametrize("pin_memory", [False, True])
def test_cpu_offload_is_handled(pin_memory):
    if pin_memory and not torch.cuda.is_available():
        pytest.skip("pinned host memory needs a CUDA build with a GPU")
    compare(2, lambda: make(shard_kwargs={"offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)}))


# --- observability -------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [5, 12])
def test_after_the_first_step_all_gathers_find_their_window_mapped(layers):
    # A remap of a bucket's fixed address waits, on CUDA, on the host for the params' last readers
    # (tide-bench host-cost). A pool of 2 windows for 12 buckets still needs none after the first
    # step: each bucket takes back the window its address maps while that window is free.
    def rank_fn(rank):
        model = make(layers=layers)
        handle = tide.fsdp.enable(model)
        gen = torch.Generator().manual_seed(3)
        step(model, gen)
        first = handle.counts()
        handle.reset_counts()
        step(model, gen)
        windows = sum(len(p.all_windows()) for p in handle.pools)
        tide.fsdp.disable(model)
        return first, handle.counts(), windows

    for first, second, windows in threaded_world.run(2, rank_fn, timeout_s=60):
        assert first["remaps"] >= layers + 1 > windows, (first, windows)  # each bucket mapped once
        assert second["all_gathers"] == 2 * layers + 1 and second["remaps"] == 0, second


def test_profiler_shows_tide_collectives_and_counts_are_per_step():
    def rank_fn(rank):
        model = make()
        handle = tide.fsdp.enable(model)
        gen = torch.Generator().manual_seed(3)
        step(model, gen)
        handle.reset_counts()
        names = set()
        if rank == 0:  # one profiler per process: rank 0's thread records
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step(model, gen)
            names = {e.key for e in prof.key_averages()}
        else:
            step(model, gen)
        tide.fsdp.disable(model)
        return handle.counts(), names

    results = threaded_world.run(2, rank_fn, timeout_s=60)
    for counts, _ in results:
        assert counts == STEP_COUNTS, counts
    names = results[0][1]
    assert any(n.startswith("tide::all_gather blocks.0 (") for n in names), sorted(names)[:20]
    assert any(n.startswith("tide::reduce_scatter <root> (") for n in names), sorted(names)[:20]


# --- misuse after enable, named as the user knows the model -------------------------------------------

def test_enable_on_a_submodule_after_the_model_names_the_group_by_its_model_path():
    def rank_fn(rank):
        model = make()
        handle = tide.fsdp.enable(model)
        try:
            with pytest.raises(ValueError) as refused:
                tide.fsdp.enable(model.blocks[0])
        finally:
            tide.fsdp.disable(model)
        return str(refused.value), [b.path for b in handle.buckets]

    for message, paths in threaded_world.run(2, rank_fn):
        assert "param group blocks.0 is already handled" in message and "<root>" not in message, message
        assert paths[0] == "<root>" and paths[1:] == [f"blocks.{i}" for i in range(GROUPS - 1)], paths


def disable_after_a_failed_step(model) -> None:
    """tide.fsdp.disable after a step that raised inside FSDP2's forward or backward: torch >= 2.13
    resets FSDP2's state (reset_iter_state, the way out disable names); torch 2.11 has no way back
    to FSDP2's idle state, so disable refuses, naming the state it is in."""
    if hasattr(model, "reset_iter_state"):
        model.reset_iter_state()
        tide.fsdp.disable(model)
    else:
        with pytest.raises(ValueError, match="is in FSDP2 training state"):
            tide.fsdp.disable(model)


def test_a_cast_after_enable_is_refused_saying_to_cast_before():
    def rank_fn(rank):
        model = make()
        handle = tide.fsdp.enable(model)
        model.to(torch.bfloat16)
        tokens = torch.randint(0, h.VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
        with pytest.raises(ValueError) as refused:
            model(tokens)
        disable_after_a_failed_step(model)
        return str(refused.value), handle.counts()

    for message, counts in threaded_world.run(2, rank_fn):
        assert "torch.bfloat16, but was torch.float32 at tide.fsdp.enable" in message, message
        assert "cast the model before tide.fsdp.enable" in message and "param group <root>" in message, message
        assert counts["all_gathers"] == 0, counts


# --- zero-size params ---------------------------------------------------------------------------------

def _with_empty_params(shape, trainable):
    with _construct:
        torch.manual_seed(0)
        model = h.TinyLlama()
    for block in model.blocks:  # a param with a dim of 0 in every block
        block.register_parameter("empty", torch.nn.Parameter(torch.zeros(shape), requires_grad=trainable))
        fully_shard(block)
        # Used in forward (after FSDP2's pre-forward unshard), so a trainable one gets a gradient.
        block.register_forward_pre_hook(lambda m, args: (args[0] + m.empty.sum(),))
    fully_shard(model)
    return model


@pytest.mark.parametrize("shape", [(0, 5), (1, 0, 5)])
def test_frozen_zero_size_params_are_handled(shape):
    # No bytes in the window, an empty all-gather output, no reduce-scatter: bitwise stock's.
    compare(2, lambda: _with_empty_params(shape, trainable=False))


def test_trainable_zero_size_params_stay_stock_with_stock_s_error():
    # Stock's reduce-scatter refuses the empty gradient (chunk_cat); such a group stays stock, so the
    # same error comes from the same place.
    def rank_fn(rank):
        errors = []
        for enable in (False, True):
            model = _with_empty_params((0, 5), trainable=True)
            handle = tide.fsdp.enable(model) if enable else None
            tokens = torch.randint(0, h.VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
            try:
                model(tokens).sum().backward()
            except RuntimeError as e:
                errors.append(str(e))
            if hasattr(model, "reset_iter_state"):
                model.reset_iter_state()
                model.unshard()  # the root's unsharded gradients, left by the failed backward, dropped
                model.zero_grad(set_to_none=True)
                model.reshard()
        disable_after_a_failed_step(model)
        return errors, handle

    for errors, handle in threaded_world.run(2, rank_fn):
        assert len(errors) == 2 and errors[0] == errors[1] and "non-empty" in errors[0], errors
        assert [p for p, _ in handle.fallbacks] == [f"blocks.{i}" for i in range(GROUPS - 1)], handle.fallbacks
        assert all("zero-size (0, 5) and trainable" in r for _, r in handle.fallbacks), handle.fallbacks
        assert [b.path for b in handle.buckets] == ["<root>"], handle.buckets


# --- gradient dtypes; torch 2.15: per-param mixed precision and FSDP2's new hooks ------------------

def test_gradients_of_two_dtypes_in_one_reduce_scatter_run_stock():
    """The guard itself, on every version (before 2.15 FSDP2 asserts one dtype per group, so only
    a direct call mixes them): a reduce-scatter over bf16 and fp32 gradients is stock's, whichever
    dtype comes first. (It compared through dtype.__eq__, whose NotImplemented is truthy.)"""
    call = _hooks.Call("foreach_reduce", (), {"reduce_scatter_comm": None})
    for first, other in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        grads = [torch.zeros(4, dtype=first), torch.zeros(4, dtype=other), torch.zeros(2, dtype=first)]
        reason = _fallbacks.reduce_scatter_reason(None, (), [], grads, call)
        assert reason == "mixed gradient dtypes ['torch.bfloat16', 'torch.float32']", reason


needs_per_param_policy = pytest.mark.skipif(
    "param_dtype_override_fn" not in MixedPrecisionPolicy.__dataclass_fields__,
    reason=f"torch {torch.__version__} has no per-param mixed precision (2.15: param_dtype_override_fn)")


def _fsdp_param_group(module):
    (param_group,) = module._get_fsdp_state()._fsdp_param_groups
    return param_group


@needs_per_param_policy
@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float32, None], ids=["bf16", "fp32", "none"])
def test_per_param_mixed_precision_matches_stock(reduce_dtype, caplog, monkeypatch):
    """bf16 compute with fp32 norms (param_dtype_override_fn keeps the 1-D params in their own
    dtype): each block's group gathers bf16 and fp32 params side by side, in TIDE's window. With a
    bf16 reduce FSDP2 hands every gradient over in bf16 and TIDE reduces every group. With fp32, or
    none (2.15: each param's grad dtype, fp32 here), a block's bf16 weight gradients meet its fp32
    norm gradients in one reduce-scatter: stock's, logged once per group; the root's (bf16
    embedding and head) and the final norm's own group (fp32) stay TIDE's. Bitwise equal to stock:
    at W = 2 every reduction sums two numbers."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                  param_dtype_override_fn=lambda p: p.dtype if p.ndim == 1 else None)

    def build():
        with _construct:
            torch.manual_seed(0)
            model = h.TinyLlama()
        for module in [*model.blocks, model.norm, model]:
            fully_shard(module, mp_policy=policy)
        return model

    def rank_fn(rank):
        stock, _ = train(build())
        model = build()
        handle = tide.fsdp.enable(model, timeout_ms=30000)
        try:
            mine, _ = train(model)
        finally:
            tide.fsdp.disable(model)
        return [torch.equal(a, b) for a, b in zip(mine, stock)], handle

    monkeypatch.setattr(_dispatch, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="tide.fsdp"):
        results = threaded_world.run(2, rank_fn)
    mixed = reduce_dtype is not torch.bfloat16
    groups, steps = 7, 2
    for rank, (equal, handle) in enumerate(results):
        assert all(equal), f"rank {rank}: params differ from stock's: {equal}"
        assert len(handle.buckets) == groups and handle.fallbacks == [], (handle, handle.fallbacks)
        counts = handle.counts()
        assert counts["all_gathers"] > 0, counts
        assert counts["reduce_scatters"] == steps * (2 if mixed else groups), counts
    logged = sorted(r.getMessage() for r in caplog.records if "mixed gradient dtypes" in r.getMessage())
    assert len(logged) == (5 if mixed else 0), logged
    assert all("['torch.bfloat16', 'torch.float32']" in line for line in logged), logged


def _counted_default(attribute, calls):
    """FSDP2's default for a param group's copy-function `attribute`, counting its calls."""
    default = {"_all_gather_output_fn": _fsdp2_defaults()[0],
               "_prepare_reduce_scatter_inputs": _fsdp2_defaults()[1]}[attribute]

    def users_function(*args, **kwargs):
        calls.append(threading.get_ident())
        return default(*args, **kwargs)
    return users_function


def _fsdp2_defaults():
    return (getattr(collectives_module, "_default_all_gather_output_fn", None),
            getattr(collectives_module, "_default_reduce_scatter_input_fn", None))


@pytest.mark.skipif(_fsdp2_defaults()[0] is None, reason=f"torch {torch.__version__}'s FSDP2 has no copy functions (2.15)")
@pytest.mark.parametrize("attribute", ["_all_gather_output_fn", "_prepare_reduce_scatter_inputs"])
def test_a_groups_own_copy_function_keeps_it_stock(attribute):
    """A param group's own all-gather output or reduce-scatter input function (torch 2.15) runs
    where stock calls it: set before enable, the group stays stock FSDP2, named with the reason;
    an output function set after enable is refused at the next all-gather, and an input function
    set after enable runs those reduce-scatters stock. Bitwise equal to stock throughout."""
    what = {"_all_gather_output_fn": "all-gather output", "_prepare_reduce_scatter_inputs": "reduce-scatter input"}[attribute]

    def rank_fn(rank):
        calls = []
        stock_model = make()
        setattr(_fsdp_param_group(stock_model.blocks[0]), attribute, _counted_default(attribute, calls))
        stock, _ = train(stock_model)
        model = make()
        setattr(_fsdp_param_group(model.blocks[0]), attribute, _counted_default(attribute, calls))
        before = tide.fsdp.enable(model)
        try:
            mine, _ = train(model)
        finally:
            tide.fsdp.disable(model)
        model = make()
        after = tide.fsdp.enable(model)
        setattr(_fsdp_param_group(model.blocks[0]), attribute, _counted_default(attribute, calls))
        error = None
        try:
            late, _ = train(model)
        except ValueError as e:
            error, late = str(e), None
            disable_after_a_failed_step(model)
        else:
            tide.fsdp.disable(model)
        return stock, mine, late, before, after, error, len(calls)

    for stock, mine, late, before, after, error, calls in threaded_world.run(2, rank_fn):
        assert before.fallbacks == [("blocks.0", f"a custom {what} function (_counted_default.<locals>.users_function)")], before.fallbacks
        assert len(before.buckets) == GROUPS - 1 and before.counts()["reduce_scatters"] > 0
        assert all(map(torch.equal, mine, stock)), "stock's group with TIDE's beside it differs from stock"
        assert calls > 0, "the group's own function never ran"
        assert after.fallbacks == [] and len(after.buckets) == GROUPS, after.fallbacks
        if attribute == "_all_gather_output_fn":
            assert error is not None and "blocks.0: a custom all-gather output function" in error and \
                "was set after tide.fsdp.enable" in error, error
        else:
            assert error is None and all(map(torch.equal, late, stock)), error
            assert after.counts()["reduce_scatters"] == 2 * (GROUPS - 1), after.counts()


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp.FSDPModule, "set_keep_unsharded_storage"),
                    reason=f"torch {torch.__version__} has no set_keep_unsharded_storage (2.15)")
def test_kept_unsharded_storage_keeps_the_groups_stock():
    """set_keep_unsharded_storage(True) (torch 2.15): FSDP2 never frees the unsharded params, and
    TIDE's windows are handed back at that free; before enable every group stays stock (and trains
    as stock), after enable the next all-gather is refused naming the group."""
    def rank_fn(rank):
        stock_model = make()
        stock_model.set_keep_unsharded_storage(True)
        stock, _ = train(stock_model)
        model = make()
        model.set_keep_unsharded_storage(True)
        before = tide.fsdp.enable(model)
        try:
            mine, _ = train(model)
        finally:
            tide.fsdp.disable(model)
        model = make()
        tide.fsdp.enable(model)
        model.set_keep_unsharded_storage(True)
        with pytest.raises(ValueError, match=r"param group .*: set_keep_unsharded_storage\(True\) was set after tide.fsdp.enable"):
            train(model)
        disable_after_a_failed_step(model)
        return all(map(torch.equal, mine, stock)), before

    for equal, before in threaded_world.run(2, rank_fn):
        assert equal and before.buckets == [], before
        assert len(before.fallbacks) == GROUPS and all(
            r.startswith("set_keep_unsharded_storage(True)") for _, r in before.fallbacks), before.fallbacks


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp.FSDPModule, "finalize_backward"),
                    reason=f"torch {torch.__version__} has no manual backward finalization (2.15)")
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_manual_backward_finalization_matches_stock(async_op):
    """Backward finalized by the caller (torch 2.15): the reduce-scatters run from
    finalize_backward, after autograd, and with async_op=True the caller waits on the handle
    (enable and disable refuse before it); TIDE handles every group, bitwise equal to stock."""
    def train_finalizing(model):
        model.set_manual_backward_finalization(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        counter = h.OpCounter()
        with counter:
            for _ in range(2):
                tokens = torch.randint(0, h.VOCAB, (2, 8), generator=gen)
                F.cross_entropy(model(tokens).view(-1, h.VOCAB), tokens.roll(-1, 1).view(-1)).backward()
                reduction = model.finalize_backward(async_op=async_op)
                if async_op:  # the reduction is not over until wait(): enable and disable refuse
                    with pytest.raises(ValueError, match=r"has a gradient reduction in flight .*after the handle's wait\(\)"):
                        tide.fsdp.disable(model) if id(model) in tide.fsdp._enabled else tide.fsdp.enable(model)
                    reduction.wait()
                opt.step()
                opt.zero_grad()
        return params_of(model), counter.counts

    h.compare(2, make, train_finalizing, GROUPS)


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp.FSDPModule, "set_keep_unsharded_storage"),
                    reason=f"torch {torch.__version__}'s FSDP2 ignores fsdp_should_release_all_gather_outputs_after_post_all_gather (2.15)")
def test_an_extension_releasing_its_outputs_after_post_all_gather_keeps_its_group_stock():
    """An all-gather extension that opts into FSDP2 2.15's release after fsdp_post_all_gather has
    its all-gather outputs freed inside FSDP2's unshard, not at the reshard TIDE hooks: its groups
    stay stock, named with the reason, and train as stock; the root's plain group is TIDE's."""
    from test_fsdp_extensions import SplitTensorV2

    class ReleasingSplitTensor(SplitTensorV2):
        def fsdp_should_release_all_gather_outputs_after_post_all_gather(self):
            return True  # its unsharded value is a sum of the outputs, not a view of them

    def build():
        with _construct:
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(),
                                                              torch.nn.Linear(16, 8, bias=False)) for _ in range(2)],
                                        torch.nn.Linear(8, 4, bias=False))
        for mlp in model[:2]:
            for linear in (mlp[0], mlp[2]):
                linear.weight = torch.nn.Parameter(ReleasingSplitTensor(linear.weight.detach().clone()))
            fully_shard(mlp)
        fully_shard(model)
        return model

    def rank_fn(rank):
        stock = sgd_steps(build(), (2, 8), lr=0.05)
        model = build()
        handle = tide.fsdp.enable(model)
        try:
            mine = sgd_steps(model, (2, 8), lr=0.05)
        finally:
            tide.fsdp.disable(model)
        return all(map(torch.equal, mine, stock)), handle

    for equal, handle in threaded_world.run(2, rank_fn):
        assert equal, "differs from stock FSDP2"
        assert [path for path, _ in handle.fallbacks] == ["0", "1"], handle.fallbacks
        assert all("fsdp_should_release_all_gather_outputs_after_post_all_gather" in r for _, r in handle.fallbacks)
        assert [b.path for b in handle.buckets] == ["<root>"] and handle.counts()["reduce_scatters"] > 0, handle


@pytest.mark.parametrize("version", ["2.10.2", "2.16.0", "3.0.0+cu140"])
def test_a_torch_outside_the_supported_range_is_refused_in_one_line(version, monkeypatch):
    from tide.fsdp import _fsdp2
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(RuntimeError) as refused:
        _fsdp2.check_torch_version()
    assert str(refused.value) == (f"tide.fsdp: torch {version} is outside the versions tide.fsdp supports "
                                  "(2.11 to 2.15); its FSDP2 internals are unknown to it"), refused.value
