"""What users do between the replays of a captured step (GPU gate): evaluation, unshard() and
reshard(), set_reshard_after_forward, state-dict and distributed-checkpoint save and load, LR and
optimizer changes, a new capture for a new shape, disable and enable, destroying the graph. Each
case trains a 4-layer model (more groups than the pool has windows, as in real models) run by run
and captured (torchtitan's way of stepping: tide.bench.captured_step), TIDE in both, over >= 5
replays, and is exact (losses, evaluation losses and parameters bitwise equal) or refused with one
error naming the group and the way out. 50 capture/destroy cycles leave no graph, wait record,
window or memory behind. W = 2 and 3 ranks as processes sharing one GPU (gloo). Skips without CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_harness as h
import tide
import tide.fsdp
from tide.bench.captured_step import CapturedStep
from tide.bench.model import PRESETS

pytestmark = pytest.mark.skipif(not (tide.cuda_built and torch.cuda.is_available()),
                                reason="needs a CUDA build of TIDE and a GPU")

STEPS = 10  # optimizer steps: a warm-up, a capture and >= 5 replays of each graph
CASES = ("eval", "eval_blocks_kept", "eval_bf16", "unshard_some", "unshard_all", "reshard_root_for_eval",
         "state_dict", "checkpoint", "optimizer", "new_shape", "disable_enable", "destroy_graph")


def _build(case: str, device):
    cfg = dataclasses.replace(PRESETS["tiny"], layers=4)
    torch.manual_seed(0)
    with torch.device(device):
        model = cfg.build()
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if case == "eval_bf16" else MixedPrecisionPolicy())
    for unit, placement in model.fsdp_units():
        fully_shard(unit, mp_policy=policy, shard_placement_fn=placement,
                    reshard_after_forward=case != "eval_blocks_kept")
    fully_shard(model, mp_policy=policy)  # FSDP2's default root: kept unsharded after forward
    return cfg, model


class _Steps:
    """fwd_bwd run by run, or captured at its second call per batch shape and replayed."""

    def __init__(self, fwd_bwd, captured: bool):
        self.fwd_bwd, self.captured, self.graphs = fwd_bwd, captured, {}

    def __call__(self, *batch):
        if not self.captured:
            return self.fwd_bwd(*batch)
        shape = tuple(batch[0].shape)
        if shape not in self.graphs:
            self.graphs[shape] = CapturedStep(self.fwd_bwd)
        return self.graphs[shape](*batch).clone()

    def destroy(self) -> None:
        self.graphs.clear()  # CapturedStep holds the only reference to its CUDAGraph


def _evaluate(cfg, model, gen, device):
    model.eval()
    with torch.no_grad():
        loss = cfg.loss(model, cfg.batch(2, 16, gen, device)).float().cpu()
    model.train()
    return loss


def between(rank: int, world: int, device, case: str, captured: bool) -> dict:
    cfg, model = _build(case, device)
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen, eval_gen = torch.Generator().manual_seed(100 + rank), torch.Generator().manual_seed(7 + rank)

    def fwd_bwd(*batch):
        loss = cfg.loss(model, batch)
        loss.backward()
        return loss.detach()

    steps = _Steps(fwd_bwd, captured)
    out = {"losses": [], "evals": [], "refused": [], "handled": len(handle.buckets), "fallbacks": handle.fallbacks}
    saved, checkpoint = None, None
    if case == "checkpoint":  # one directory for every rank: rank 0's
        names = [tempfile.mkdtemp(prefix="tide-dcp-") if rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        checkpoint = names[0]
    for i in range(STEPS):
        seq = 32 if case == "new_shape" and i >= 4 and i % 2 == 0 else 16
        out["losses"].append(steps(*cfg.batch(2, seq, gen, device)).float().cpu())
        opt.step()
        opt.zero_grad(set_to_none=False)  # as torchtitan does with captured steps
        if i < 2:
            continue  # the warm-up and the capture
        if case.startswith("eval") and i % 2 == 0:
            out["evals"] += [_evaluate(cfg, model, eval_gen, device), _evaluate(cfg, model, eval_gen, device)]
        elif case == "unshard_some" and i == 3:
            model.layers[1].unshard()
            model.unshard()  # the root's group
            out["evals"].append(_evaluate(cfg, model, eval_gen, device))
            model.reshard()
        elif case == "unshard_all" and i == 3:
            try:
                for layer in model.layers:
                    layer.unshard()
            except RuntimeError as e:
                out["refused"].append(str(e))
            for layer in model.layers:
                layer.reshard()
        elif case == "reshard_root_for_eval" and i in (3, 5):
            model.set_reshard_after_forward(True, recurse=False)
            out["evals"].append(_evaluate(cfg, model, eval_gen, device))
            model.set_reshard_after_forward(False, recurse=False)
        elif case == "state_dict" and i in (3, 5):
            if saved is None:
                saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                model.load_state_dict(saved)
        elif case == "checkpoint" and i in (3, 5):
            import torch.distributed.checkpoint as dcp
            state = model.state_dict()
            if i == 3:
                dcp.save(state, checkpoint_id=checkpoint)
            else:
                dcp.load(state, checkpoint_id=checkpoint)
                model.load_state_dict(state)
        elif case == "optimizer" and i == 3:
            for g in opt.param_groups:
                g["lr"] *= 0.5
        elif case == "optimizer" and i == 5:
            opt = torch.optim.SGD(model.parameters(), lr=5e-3, momentum=0.9)
        elif case == "disable_enable" and i == 4:
            if captured:
                try:
                    tide.fsdp.disable(model)
                except ValueError as e:
                    out["refused"].append(str(e))
            steps.destroy()
            tide.fsdp.disable(model)
            out["losses"].append(fwd_bwd(*cfg.batch(2, 16, gen, device)).float().cpu())  # stock FSDP2
            opt.step()
            opt.zero_grad(set_to_none=False)
            handle = tide.fsdp.enable(model, timeout_ms=60000)
        elif case == "destroy_graph" and i in (4, 6):
            steps.destroy()
    torch.cuda.synchronize()
    out["params"] = [p.to_local().detach().float().cpu() for p in model.parameters()]
    out["counts"] = handle.counts()
    steps.destroy()
    tide.fsdp.disable(model)
    return out


def between_every_case(rank: int, world: int, device) -> dict:
    results = {}
    for case in CASES:
        for captured in (False, True):
            try:
                results[case, captured] = between(rank, world, device, case, captured)
            except Exception as e:  # noqa: BLE001 - the case's test reports it
                results[case, captured] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def runs(request):
    return h.run_processes(request.param, between_every_case, device_type="cuda")


@pytest.mark.parametrize("case", CASES)
def test_between_replays_exact_or_refused_naming_the_group(runs, case):
    for rank, results in enumerate(runs):
        eager, mine = results[case, False], results[case, True]
        where = f"{case}, rank {rank} of {len(runs)}"
        assert isinstance(eager, dict), f"{where}, run by run: {eager}"
        assert isinstance(mine, dict), f"{where}, captured: {mine}"
        assert mine["fallbacks"] == [] and mine["handled"] == eager["handled"] == 5, (where, mine["fallbacks"])
        assert eager["refused"] == [], (where, eager["refused"])
        if case == "unshard_all":  # 4 layers held at once, where the captured step holds 2
            assert len(mine["refused"]) == 1, (where, mine["refused"])
            assert mine["refused"][0].startswith("tide.fsdp: param group layers."), (where, mine["refused"])
            assert "reshard() the others first, or destroy the graph" in mine["refused"][0], (where, mine["refused"])
        elif case == "disable_enable":
            assert len(mine["refused"]) == 1 and "CUDA graph(s) that replay its collectives still exist" \
                in mine["refused"][0] and "param group" in mine["refused"][0], (where, mine["refused"])
        else:
            assert mine["refused"] == [], (where, mine["refused"])
        for key in ("losses", "evals", "params"):
            assert len(eager[key]) == len(mine[key]) and (key != "evals" or mine[key] or not case.startswith("eval")), \
                (where, key, len(eager[key]), len(mine[key]))
            for k, (a, b) in enumerate(zip(eager[key], mine[key])):
                assert torch.equal(a, b), f"{where}: {key}[{k}]: {a.flatten()[:4]} (run by run) != {b.flatten()[:4]}"


# --- 50 capture/destroy cycles -----------------------------------------------------------------------

CYCLES = 50


def capture_cycles(rank: int, world: int, device) -> dict:
    cfg, model = _build("eval", device)
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    gen = torch.Generator().manual_seed(100 + rank)

    def fwd_bwd(*batch):
        loss = cfg.loss(model, batch)
        loss.backward()
        return loss.detach()

    def state():
        torch.cuda.synchronize()
        deadline = time.monotonic() + 2.0  # CUDA reports a destroyed graph from a thread of its own
        while time.monotonic() < deadline:
            graphs = [w.executor.captured_state() for p in handle.pools for w in p.all_windows()]
            if all(g[0] == 0 for g in graphs):
                break
            time.sleep(0.001)
        return {"captured": [sum(g[i] for g in graphs) for i in range(3)], "pool_bytes": handle.pool_bytes(),
                "allocated": torch.cuda.memory_allocated()}

    seen, live = [], []
    for cycle in range(CYCLES + 1):
        step = CapturedStep(fwd_bwd)
        for _ in range(3):  # warm-up, capture (and a replay), a replay
            step(*cfg.batch(2, 16, gen, device))
        torch.cuda.synchronize()
        live.append([sum(w.executor.captured_state()[0] for p in handle.pools for w in p.all_windows())])
        model.zero_grad(set_to_none=True)
        del step
        seen.append(state())
    tide.fsdp.disable(model)
    return {"first": seen[0], "last": seen[-1], "live": live[0]}


def test_capture_destroy_cycles_leave_nothing_behind():
    for rank, r in enumerate(h.run_processes(2, capture_cycles, device_type="cuda")):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert r["live"][0] >= 1, f"rank {rank}: no live graph counted while one existed: {r['live']}"
        assert r["first"]["captured"] == [0, 0, 0], f"rank {rank}: {r['first']}"
        assert r["last"] == r["first"], f"rank {rank}: after {CYCLES} more cycles {r['last']} != {r['first']}"
