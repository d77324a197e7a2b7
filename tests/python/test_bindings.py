"""The Python layer over the C++ core: layouts, plans, errors, and the host executor with ranks as
threads (the GIL is released while ranks wait on each other)."""

import os
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

import tide
from rounding import gamma
from tide.demo import bf16_bits_to_float, to_bf16_bits


def run_ranks(world, fn, timeout_ms=20000):
    """Runs fn(rank, bootstrap) on `world` threads sharing a rendezvous directory."""
    results, errors = [None] * world, [None] * world
    with tempfile.TemporaryDirectory() as d:
        def body(r):
            try:
                results[r] = fn(r, tide.FileBootstrap(d, r, world, timeout_ms))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[r] = e
        threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results, errors


def test_layout_follows_fsdp2_sharding():
    layout = tide.BucketLayout([tide.ParamSpec("w", [10, 3]), tide.ParamSpec("b", [3], tide.DType.fp32)],
                               tide.Topology.single_node(4))
    w, b = layout.params
    assert (w.rows_per_rank, w.shard_numel, w.slot_bytes) == (3, 9, 18)
    assert [w.valid_rows(r) for r in range(4)] == [3, 3, 3, 1]
    assert [b.valid_rows(r) for r in range(4)] == [1, 1, 1, 0]
    assert b.window_offset == 256 and layout.window_bytes == 512
    assert "w [10, 3] bf16/fp32: c = 3 rows" in layout.describe()


def test_layout_of_a_param_sharded_on_dim_1():
    spec = tide.ParamSpec("experts", [2, 8, 3], shard_dim=1)
    assert spec.shard_dim == 1 and tide.ParamSpec("w", [4]).shard_dim == 0
    layout = tide.BucketLayout([spec], tide.Topology.single_node(4))
    (p,) = layout.params
    assert (p.shard_dim, p.shard_dim_size, p.outer_rows, p.rows_per_rank, p.row_numel) == (1, 8, 2, 2, 3)
    assert (p.shard_numel, p.block_bytes, p.block_pitch, p.block_offset(3)) == (12, 12, 48, 36)
    tide.verify_programs(layout, [tide.plan_all_gather(layout, r) for r in range(4)])
    with pytest.raises(ValueError, match=r"shape\[1\] \(shard_dim 1\) = 6, expected a multiple of W = 4"):
        tide.BucketLayout([tide.ParamSpec("experts", [2, 6, 3], shard_dim=1)], tide.Topology.single_node(4))
    with pytest.raises(ValueError, match="shard_dim = 3"):
        tide.BucketLayout([tide.ParamSpec("experts", [2, 8, 3], shard_dim=3)], tide.Topology.single_node(4))


def test_plans_print_and_verify():
    layout = tide.BucketLayout([tide.ParamSpec("w", [7, 2])], tide.Topology(1, 3))
    ags = [tide.plan_all_gather(layout, r, bucket=4) for r in range(3)]
    tide.verify_programs(layout, ags)
    assert "program all_gather rank 1/3 bucket 4" in str(ags[1])
    rs = tide.plan_reduce_scatter(layout, 2, tide.ReduceOptions(kind=tide.ReduceKind.sum, accumulate=True))
    assert "+= into out[0]+0" in rs.to_string()


def test_deliveries():
    layout = tide.BucketLayout([tide.ParamSpec("w", [7, 2])], tide.Topology(1, 3))
    assert tide.default_delivery(layout) == tide.Delivery.cast_to_peers  # a small bucket
    for delivery in (tide.Delivery.push, tide.Delivery.cast_to_peers):
        tide.verify_programs(layout, [tide.plan_all_gather(layout, r, delivery=delivery) for r in range(3)])
        tide.verify_programs(layout, [tide.plan_reduce_scatter(layout, r, delivery=delivery)
                                      for r in range(3)])
    assert tide.plan_all_gather(layout, 0, delivery=tide.Delivery.push).bytes_pushed() > 0
    default = tide.plan_all_gather(layout, 0)
    assert default.delivery == tide.Delivery.cast_to_peers
    assert default.bytes_pushed() == 0 and "[push] cast in[0]+0 -> win[1]" in default.to_string()
    # The reduce-scatter's chunks are copies either way; cast_to_peers takes every slot-free wait
    # before them.
    rs = tide.plan_reduce_scatter(layout, 0)
    assert rs.delivery == tide.Delivery.cast_to_peers and "delivery cast_to_peers" in str(rs)
    steps = str(rs).splitlines()[1:]
    first_push = next(i for i, s in enumerate(steps) if s.lstrip().startswith("[push]"))
    assert sum("wait slot_free" in s for s in steps[:first_push]) == 2, str(rs)
    nodes = tide.BucketLayout([tide.ParamSpec("w", [8, 2])], tide.Topology(2, 2))
    assert tide.default_delivery(nodes) == tide.Delivery.push
    with pytest.raises(ValueError, match="delivery = cast_to_peers, expected push with 2 nodes"):
        tide.plan_all_gather(nodes, 0, delivery=tide.Delivery.cast_to_peers)
    with pytest.raises(ValueError, match="delivery = cast_to_peers, expected push with 2 nodes"):
        tide.plan_reduce_scatter(nodes, 0, delivery=tide.Delivery.cast_to_peers)


@pytest.mark.parametrize("make, fragment", [
    (lambda: tide.BucketLayout([], tide.Topology.single_node(2)), "at least one param"),
    (lambda: tide.BucketLayout([tide.ParamSpec("w", [0])], tide.Topology.single_node(2)), "shape[0] = 0"),
    (lambda: tide.Topology(0, 8), "nodes = 0"),
    (lambda: tide.plan_all_gather(tide.BucketLayout([tide.ParamSpec("w", [4])], tide.Topology(1, 2)), 2),
     "rank = 2, expected in [0, 2)"),
    (lambda: tide.parse_dtype("int4"), "expected one of bf16, fp16, fp32"),
    (lambda: tide.FileBootstrap("/nonexistent", 0, 1), "an existing directory"),
])
def test_bad_input_raises_value_error_naming_the_argument(make, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        make()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_host_all_gather_and_reduce_scatter(world):
    specs = [tide.ParamSpec("q", [13, 8]), tide.ParamSpec("norm", [8]), tide.ParamSpec("s", [])]
    layout = tide.BucketLayout(specs, tide.Topology.single_node(world))
    rng = np.random.default_rng(world)
    full = [rng.standard_normal(max(p.numel, 1)).astype(np.float32) for p in layout.params]
    grads = [[to_bf16_bits(rng.standard_normal(p.numel).astype(np.float32)) for p in layout.params]
             for _ in range(world)]

    def rank_fn(rank, boot):
        window = tide.HostWindow.create(boot, layout.window_bytes)
        ex = tide.HostExecutor(window)
        shards = [np.ascontiguousarray(f[rank * p.shard_numel: rank * p.shard_numel + p.valid_numel(rank)])
                  for f, p in zip(full, layout.params)]
        ex.run(tide.plan_all_gather(layout, rank), [s.ctypes.data for s in shards])
        raw = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * layout.window_bytes)
                                    .from_address(window.data_ptr(rank))).copy()
        outs = [np.full(p.valid_numel(rank), 0.5, np.float32) for p in layout.params]
        ex.run(tide.plan_reduce_scatter(layout, rank, tide.ReduceOptions(accumulate=True)),
               [g.ctypes.data for g in grads[rank]], [o.ctypes.data for o in outs])
        return raw, outs

    results, errors = run_ranks(world, rank_fn)
    assert errors == [None] * world
    for rank, (raw, outs) in enumerate(results):
        for i, p in enumerate(layout.params):
            got = raw[p.window_offset:p.window_offset + 2 * p.numel].view(np.uint16)
            np.testing.assert_array_equal(got, to_bf16_bits(full[i][:p.numel]))
            start, n = rank * p.shard_numel, p.valid_numel(rank)
            mine = [bf16_bits_to_float(grads[r][i][start:start + n]).astype(np.float64) for r in range(world)]
            ref = 0.5 + sum(mine) / world
            # fp32: the sum of W exact bf16 values (gamma(W - 1) of sum |g|), its scaling by
            # fl(1/W) (2u) and the accumulation into 0.5 (u of the result): within
            # gamma(W + 2) * (0.5 + sum |g| / W) of the float64 reference.
            bound = gamma(world + 2) * (0.5 + sum(np.abs(g) for g in mine) / world)
            assert np.all(np.abs(outs[i] - ref) <= bound), np.max(np.abs(outs[i] - ref) - bound)


def test_missing_rank_raises_timeout_error_naming_it():
    layout = tide.BucketLayout([tide.ParamSpec("w", [4, 4])], tide.Topology.single_node(2))

    def rank_fn(rank, boot):
        window = tide.HostWindow.create(boot, layout.window_bytes)
        if rank == 1:
            return None  # never runs the collective
        shard = np.zeros(8, np.float32)
        tide.HostExecutor(window, timeout_ms=200).run(tide.plan_all_gather(layout, 0, bucket=3),
                                                      [shard.ctypes.data])

    _, errors = run_ranks(2, rank_fn)
    assert isinstance(errors[0], TimeoutError), errors
    assert "from rank 1 (bucket 3 all_gather, phase slot_free, epoch 1)" in str(errors[0])


def test_mismatched_collectives_raise_desync_error():
    layout = tide.BucketLayout([tide.ParamSpec("w", [4, 4])], tide.Topology.single_node(2))

    def rank_fn(rank, boot):
        window = tide.HostWindow.create(boot, layout.window_bytes)
        ex = tide.HostExecutor(window, timeout_ms=5000)
        buf = np.zeros(16, np.float32)
        ex.run(tide.plan_all_gather(layout, rank, bucket=1 + rank), [buf.ctypes.data])

    _, errors = run_ranks(2, rank_fn)
    assert all(isinstance(e, tide.DesyncError) for e in errors), errors
    assert "rank 0 runs bucket 1 all_gather" in str(errors[0]) and "bucket 2 all_gather" in str(errors[0])


def test_callback_bootstrap_exchanges_bytes():
    barrier = threading.Barrier(2)
    slots = [None, None]

    def make(rank):
        def allgather(mine: bytes):
            slots[rank] = mine
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return tide.CallbackBootstrap(rank, 2, allgather)

    layout = tide.BucketLayout([tide.ParamSpec("w", [2, 2], tide.DType.fp32)], tide.Topology.single_node(2))
    results = [None, None]

    def body(rank):
        window = tide.HostWindow.create(make(rank), layout.window_bytes)
        shard = np.array([rank + 1.0, rank + 2.0], np.float32)
        tide.HostExecutor(window).run(tide.plan_all_gather(layout, rank), [shard.ctypes.data])
        results[rank] = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_float * 4)
                                              .from_address(window.data_ptr(rank))).copy()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(2):
        np.testing.assert_array_equal(results[r], [1, 2, 2, 3])


def test_demo_runs_and_checks_itself(capsys):
    from tide import demo
    assert demo.main(["--world", "2", "--hidden", "64"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_multinode_plans_run_on_the_host_transport():
    """Across nodes from Python: net options, network ops in the programs, windows sized from
    program.window_bytes (the reduce-scatter's staging), run on the host executor (virtual nodes)."""
    layout = tide.BucketLayout([tide.ParamSpec("w", [9, 8], tide.DType.fp32, tide.DType.fp32)],
                               tide.Topology(2, 2))
    net = tide.AcrossNodesOptions(chunk_bytes=64)
    ags = [tide.plan_all_gather(layout, r, 1, net) for r in range(4)]
    rss = [tide.plan_reduce_scatter(layout, r, tide.ReduceOptions(kind=tide.ReduceKind.sum), 2, net)
           for r in range(4)]
    tide.verify_programs(layout, ags)
    tide.verify_programs(layout, rss)
    assert "net send" in str(rss[0]) and rss[0].window_bytes > layout.window_bytes == ags[0].window_bytes
    w = layout.params[0]
    grads = [np.arange(72, dtype=np.float32) * (r + 1) for r in range(4)]

    def rank(r, boot):
        window = tide.HostWindow.create(boot, rss[r].window_bytes)
        executor = tide.HostExecutor(window)
        out = np.zeros(w.valid_rows(r) * 8, dtype=np.float32)
        executor.run(rss[r], [grads[r].ctypes.data], [out.ctypes.data])
        return out

    results, errors = run_ranks(4, rank)
    assert errors == [None] * 4
    full = sum(grads)
    for r in range(4):
        start = r * w.rows_per_rank * 8
        np.testing.assert_array_equal(results[r], full[start:start + results[r].size])


def test_bf16_wire_is_an_option_and_fp16_is_refused():
    """AcrossNodesOptions.wire_dtype: bf16 partial sums between nodes (lossy, half the bytes); only fp32
    and bf16 are accepted, with the offending value in the message."""
    layout = tide.BucketLayout([tide.ParamSpec("w", [16, 8])], tide.Topology(2, 2))
    assert tide.AcrossNodesOptions().wire_dtype == tide.DType.fp32
    fp32 = tide.plan_reduce_scatter(layout, 0, tide.ReduceOptions(), 1, tide.AcrossNodesOptions(chunk_bytes=64))
    bf16 = tide.plan_reduce_scatter(layout, 0, tide.ReduceOptions(), 1,
                                    tide.AcrossNodesOptions(chunk_bytes=64, wire_dtype=tide.DType.bf16))
    assert "onto the bf16 partial" in str(bf16) and "onto the fp32 partial" in str(fp32)
    with pytest.raises(ValueError, match="wire_dtype.*fp32 or bf16"):
        tide.plan_reduce_scatter(layout, 0, tide.ReduceOptions(), 1,
                                 tide.AcrossNodesOptions(wire_dtype=tide.DType.fp16))


def test_missing_nccl_is_a_clear_error():
    env = dict(os.environ, TIDE_NCCL_LIB="/nonexistent/libnccl.so.2")
    code = ("import tide\ntry:\n    tide.nccl_version()\nexcept RuntimeError as e:\n"
            "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60).stdout
    assert "ERR NCCL not found" in out and "/nonexistent/libnccl.so.2" in out


def test_nccl_comm_from_a_process_group_says_when_nccl_is_missing():
    """tide.distributed.nccl_comm over a process group: with no NCCL to load (forced here with a
    TIDE_NCCL_LIB that does not exist) the error says where TIDE looked."""
    code = ("import os, torch.distributed as dist, tide, tide.distributed as td\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "try:\n    td.nccl_comm(dist.group.WORLD)\n    print('MADE')\n"
            "except RuntimeError as e:\n    print('ERR', e)\n")
    env = dict(os.environ, TIDE_NCCL_LIB="/nonexistent/libnccl.so.2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120).stdout
    assert "ERR NCCL not found" in out and "/nonexistent/libnccl.so.2" in out, out


@pytest.mark.skipif(not tide.cuda_built, reason="this build has no CUDA transport")
def test_cuda_window_reach_is_exposed():
    # Which peers a CUDA window maps: its node's (other nodes over NCCL) or the host's (virtual
    # nodes, network over CUDA IPC). Creating one needs a GPU; the GPU tests do.
    assert {tide.CudaWindowScope.node, tide.CudaWindowScope.host} == set(tide.CudaWindowScope.__members__.values())
    assert "scope" in tide.CudaWindow.create.__doc__
