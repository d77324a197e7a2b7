"""tide.fsdp inside captured steps, as torchtitan 0.3.0 runs every GPU step by default: one
warm-up micro-batch on a side stream, one capture of forward + backward into a shared pool with
``capture_error_mode="thread_local"`` (torchtitan's own ``wrap_with_cuda_graph`` where torchtitan
imports), or a plain ``torch.cuda.graph``; a replay for every later micro-batch, the optimizer
outside. Each configuration trains the same model run by run and captured, TIDE in both: losses and
parameters bitwise equal over >= 5 replays, every group handled, TIDE's collectives in the graph.
What a graph cannot replay raises at capture, naming the group; a peer that stops replaying ends
the waiting process within TIDE's timeout, naming the peer. W = 2 ranks as processes sharing one
GPU (gloo). Skips without CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_harness as h
import tide
import tide.fsdp
from tide.bench.captured_step import CapturedStep
from tide.bench.model import PRESETS

pytestmark = pytest.mark.skipif(not (tide.cuda_built and torch.cuda.is_available()),
                                reason="needs a CUDA build of TIDE and a GPU")

CONFIGS = {
    "reshard_after_forward": dict(preset="tiny", mp="fp32", reshard=True),
    "keep_after_forward": dict(preset="tiny", mp="fp32", reshard=False),
    "bf16_fp32_reduce": dict(preset="tiny", mp="bf16", reshard=True),
    "float8_all_gather": dict(preset="tiny", mp="bf16", reshard=True, float8=True),
    "moe": dict(preset="qwen3-moe-tiny", mp="bf16", reshard=True),
    "grad_accumulation": dict(preset="tiny", mp="bf16", reshard=True, micro=3),
}
STEPS = 6  # optimizer steps: >= 5 replays in every captured configuration


def _build(c: dict, device):
    cfg = PRESETS[c["preset"]]
    if c["preset"].startswith("qwen3-moe"):
        cfg = dataclasses.replace(cfg, capturable=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = cfg.build()
    if c.get("float8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from tide.bench.fsdp_bench import float8_linear
        convert_to_float8_training(model, module_filter_fn=float8_linear,
                                   config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if c["mp"] == "bf16" else MixedPrecisionPolicy())
    for unit, placement in model.fsdp_units():
        fully_shard(unit, mp_policy=policy, shard_placement_fn=placement,
                    reshard_after_forward=c["reshard"])
    fully_shard(model, mp_policy=policy, reshard_after_forward=c["reshard"])
    return cfg, model


TORCHTITAN_FOUND = importlib.util.find_spec("torchtitan") is not None


class _Stepper:
    """fwd_bwd captured at its second call and replayed from then on. Mode "titan": by
    torchtitan's own CUDAGraphWrapper where torchtitan imports, else by CapturedStep (which steps
    as it does; `wrapper` says which, and why); "plain": a torch.cuda.graph in its default, global
    capture mode."""

    def __init__(self, fwd_bwd, mode: str):
        self.step, self.wrapper = None, "CapturedStep"
        if mode == "titan":
            try:
                from torchtitan.distributed.cudagraph import CUDAGraphWrapper
                self.make = lambda batch: CUDAGraphWrapper(fwd_bwd, batch)
                self.wrapper = "torchtitan"
            except Exception as e:  # noqa: BLE001 - any import failure: said in `wrapper`
                self.wrapper = f"CapturedStep (torchtitan: {type(e).__name__}: {e})"
                self.make = lambda batch: CapturedStep(fwd_bwd)
        else:
            self.make = lambda batch: CapturedStep(fwd_bwd, "global")

    def __call__(self, *batch):
        if self.step is None:
            self.step = self.make(batch)
        return self.step(*batch)

    def destroy(self) -> None:
        """Destroys the graph, as a user must before tide.fsdp.disable (which refuses while a
        graph that replays the group's collectives lives)."""
        if self.wrapper == "torchtitan":
            from torchtitan.distributed.cudagraph import cudagraph_teardown
            cudagraph_teardown()
        self.step = None


def _error_chain(e: BaseException) -> str:
    """An error and the ones it was raised while handling (a refused capture's CUDA error at
    capture end sits on top of TIDE's)."""
    chain = [e]
    while chain[-1].__context__ is not None:
        chain.append(chain[-1].__context__)
    return " <- ".join(f"{type(c).__name__}: {c}" for c in chain)


def train(rank: int, world: int, device, name: str, mode: str) -> dict:
    """STEPS optimizer steps of `micro` micro-batches each, run by run ("eager") or captured."""
    c = CONFIGS[name]
    cfg, model = _build(c, device)
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)

    def fwd_bwd(*batch):
        loss = cfg.loss(model, batch)
        loss.backward()
        return loss.detach()

    step = fwd_bwd if mode == "eager" else _Stepper(fwd_bwd, mode)
    losses, captured_counts, replay_counts, calls = [], None, None, 0
    try:
        for _ in range(STEPS):
            for _ in range(c.get("micro", 1)):
                batch = cfg.batch(2, 16, gen, device)
                before = handle.counts()
                losses.append(step(*batch).clone())
                calls += 1
                if mode != "eager" and calls in (2, 3):  # the capture (and its first replay), a replay
                    after = handle.counts()  # TIDE's collectives ran in the capture, none in a replay
                    counts = {k: after[k] - before[k] for k in ("all_gathers", "reduce_scatters")}
                    if calls == 2:
                        captured_counts = counts
                    else:
                        replay_counts = counts
            opt.step()
            opt.zero_grad(set_to_none=False)  # as torchtitan does with captured steps
        torch.cuda.synchronize()
    except BaseException:
        with contextlib.suppress(Exception):  # the step's own error is the result
            if mode != "eager":
                step.destroy()
            tide.fsdp.disable(model)
        raise
    if mode != "eager":
        step.destroy()
    tide.fsdp.disable(model)
    return {"losses": [x.float().cpu() for x in losses],
            "params": [p.to_local().detach().float().cpu() for p in model.parameters()],
            "buckets": len(handle.buckets), "fallbacks": handle.fallbacks,
            # float8 weights whose scale TIDE computes (its amax exchange) and whose cast it writes
            "casts": sum(b.amax_exchange.count for b in handle.buckets if b.amax_exchange is not None),
            "captured_counts": captured_counts, "replay_counts": replay_counts,
            "wrapper": getattr(step, "wrapper", None)}


MODES = ("titan", "plain")


def train_every_config(rank: int, world: int, device) -> dict:
    """Every configuration, run by run and in each of its captured modes, in one world (starting
    ranks costs seconds each); a configuration's error is its result."""
    results = {}
    for name in CONFIGS:
        for mode in ("eager",) + MODES:
            try:
                if CONFIGS[name].get("float8"):
                    import torchao.float8  # noqa: F401
                results[name, mode] = train(rank, world, device, name, mode)
            except Exception as e:  # noqa: BLE001 - reported by the test of that configuration
                results[name, mode] = _error_chain(e)
    return results


@pytest.fixture(scope="module")
def runs():
    return h.run_processes(2, train_every_config, device_type="cuda")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_captured_steps_train_bitwise_as_run_by_run(runs, name):
    if CONFIGS[name].get("float8") and "No module named 'torchao" in str(runs[0][name, "eager"]):
        pytest.skip("needs torchao")
    for rank, results in enumerate(runs):
        eager = results[name, "eager"]
        assert isinstance(eager, dict), f"{name}, run by run, rank {rank}: {eager}"
        for mode in MODES:
            mine, where = results[name, mode], f"{name}, {mode}, rank {rank}"
            assert isinstance(mine, dict), f"{where}: {mine}"
            if mode == "titan" and TORCHTITAN_FOUND:
                assert mine["wrapper"] == "torchtitan", f"{where}: {mine['wrapper']}"
            assert mine["fallbacks"] == [] and mine["buckets"] == eager["buckets"] > 0, (where, mine["fallbacks"])
            assert mine["casts"] == eager["casts"] and (mine["casts"] > 0) == bool(CONFIGS[name].get("float8")), \
                (where, mine["casts"])
            counts = mine["captured_counts"]
            assert counts and counts["all_gathers"] > 0 and counts["reduce_scatters"] > 0, (where, counts)
            assert mine["replay_counts"] == {"all_gathers": 0, "reduce_scatters": 0}, (where, mine["replay_counts"])
            for k, (a, b) in enumerate(zip(eager["losses"], mine["losses"])):
                assert torch.equal(a, b), f"{where}: loss of micro-batch {k}: {a} (run by run) != {b}"
            for k, (a, b) in enumerate(zip(eager["params"], mine["params"])):
                assert torch.equal(a, b), f"{where}: param {k}: max diff {(a - b).abs().max()}"


def _capture_one_step(model, device) -> str:
    x = torch.randint(0, 256, (2, 16), device=device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            model(x).sum().backward()
    except RuntimeError as e:
        return _error_chain(e)
    return "captured"


def refused_captures(rank: int, world: int, device) -> dict:
    """A capture before any step; a capture, after an uncaptured step, of a model whose groups
    span nodes (one rank per node: the across-node programs, over IPC here)."""
    _, model = _build(CONFIGS["reshard_after_forward"], device)
    tide.fsdp.enable(model, timeout_ms=60000)
    first = _capture_one_step(model, device)
    _, model = _build(CONFIGS["reshard_after_forward"], device)
    handle = tide.fsdp.enable(model, timeout_ms=60000, ranks_per_node=1)
    model(torch.randint(0, 256, (2, 16), device=device)).sum().backward()
    torch.cuda.synchronize()
    return {"first_step": first, "buckets": len(handle.buckets), "refusals": handle.capture_refusals(),
            "across_nodes": _capture_one_step(model, device)}


def test_captures_a_graph_cannot_replay_raise_naming_the_group():
    for rank, r in enumerate(h.run_processes(2, refused_captures, device_type="cuda")):
        assert "error" not in r, f"rank {rank}: {r}"
        for key, what in (("first_step", "its first all-gather is being captured"),
                          ("across_nodes", "its collectives span nodes")):
            assert "tide.fsdp: param group" in r[key] and what in r[key], f"rank {rank}, {key}: {r[key]}"
            assert "which a CUDA graph cannot replay" in r[key], f"rank {rank}, {key}: {r[key]}"
        assert "--training.disable_cuda_graphs" in r["across_nodes"], r["across_nodes"]
        assert r["buckets"] > 0 and len(r["refusals"]) == r["buckets"], f"rank {rank}: {r['refusals']}"
        assert all("span nodes" in why for why in r["refusals"].values()), r["refusals"]


# --- a peer that stops replaying --------------------------------------------------------------------

TIMEOUT_MS = 3000


def _stuck_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(0)
    h.join_world(port, rank, world, "gloo")
    device = torch.device("cuda", 0)
    cfg, model = _build(CONFIGS["reshard_after_forward"], device)
    tide.fsdp.enable(model, timeout_ms=TIMEOUT_MS)
    gen = torch.Generator().manual_seed(rank)

    def fwd_bwd(*batch):
        loss = cfg.loss(model, batch)
        loss.backward()
        return loss.detach()

    step = CapturedStep(fwd_bwd)
    for _ in range(3):  # warm-up, capture + replay, replay
        step(*cfg.batch(2, 16, gen, device))
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:  # stops replaying: waits until the test ends it
        open(os.path.join(out_dir, "stopped"), "w").close()
        time.sleep(120)
        return
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    log = os.open(os.path.join(out_dir, "stderr.0"), os.O_WRONLY | os.O_CREAT)
    os.dup2(log, 2)  # what the watchdog prints, in C
    with open(os.path.join(out_dir, "started"), "w") as f:
        f.write(str(time.monotonic()))
    step(*cfg.batch(2, 16, gen, device))
    torch.cuda.synchronize()  # the watchdog ends this process first
    with open(os.path.join(out_dir, "returned"), "w") as f:
        f.write("the replay returned")


def test_a_peer_that_stops_replaying_ends_the_waiting_process_naming_it():
    with tempfile.TemporaryDirectory() as out_dir, h.rendezvous() as port:
        context = mp.start_processes(_stuck_worker, args=(2, port, out_dir), nprocs=2,
                                     join=False, start_method="spawn")
        survivor, stopped = context.processes
        survivor.join(timeout=120)
        ended = time.monotonic()
        stopped.kill()
        stopped.join()
        assert os.path.exists(os.path.join(out_dir, "stopped")), "rank 1 did not get to stop"
        assert not os.path.exists(os.path.join(out_dir, "returned")), "rank 0's replay returned"
        assert survivor.exitcode is not None and survivor.exitcode != 0, survivor.exitcode
        with open(os.path.join(out_dir, "stderr.0")) as f:
            printed = f.read()
        with open(os.path.join(out_dir, "started")) as f:
            started = float(f.read())
        print(printed, file=sys.stderr)
        assert "tide: rank 0: timed out after 3000 ms waiting for" in printed, printed
        assert "from rank 1" in printed and "a replay of a CUDA graph" in printed, printed
        assert "the process ends here" in printed, printed
        assert TIMEOUT_MS / 1000 - 0.1 <= ended - started < TIMEOUT_MS / 1000 + 15, ended - started
