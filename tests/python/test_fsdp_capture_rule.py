"""A captured window belongs to its graphs (docs/DESIGN.md section 4), tried with what training
loops do around a captured model: a reference model beside the trained one (both roots under one
tide.fsdp.enable, so they lease from one pool), a module used only in evaluation, the graph torn
down and the model gathered at once, a capture that aborts, torchtitan's chunked loss (the head
unshard()ed across its chunks), torchtitan's order of steps (a warm-up, a validation, then the
capture; its units, the last kept unsharded after forward), and a checkpoint taken before the
warm-up loaded between it and the capture. Each scenario runs run by run and captured, TIDE in both,
and must be exact: losses, evaluations and parameters bitwise, and TIDE's all-gathers and
reduce-scatters equal, step by step and between steps (a replay counts none: its step's
collectives are counted once, at capture).

On a GPU (the GPU gate) steps are captured and replayed as torchtitan steps them, W = 2 and 3
ranks as processes sharing the GPU. On CPU the host logic runs with a capture id standing in for
CUDA's (nothing is recorded or replayed; the graph is "alive" until the scenario destroys it), so
the decisions the rule makes are checked in CI: the same counts, and no window a graph captured is
held by a group it did not capture.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_harness as h
import tide
import tide.fsdp
from tide.bench.model import PRESETS, LlamaModel
from tide.fsdp import _capture, _pool

# aborted_capture last: torch's CUDA generator stays in its capture state after a capture that
# raised (any later CUDA random number raises), and every scenario builds its model with one.
SCENARIOS = ("reference_model", "reference_model_before_too", "eval_only_module", "teardown_then_gather",
             "chunked_loss", "validation_before_capture", "checkpoint_loaded", "aborted_capture")
STEPS = 8  # a warm-up, a capture and >= 5 replays
CAPTURE_STEP = 1
FAKE_CAPTURE = 77  # the CPU stand-in for a CUDA capture id
CHUNKS = 4


class HeadSkippingLlama(LlamaModel):
    """The tiny Llama with torchtitan's ``_skip_lm_head``: the chunked loss applies the head."""

    def forward(self, tokens, skip_head: bool = False):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return x if skip_head else self.head(x).float()


def _build(scenario: str, device):
    cfg = dataclasses.replace(PRESETS["tiny"], layers=4)
    torch.manual_seed(0)
    parent = nn.Module()
    with torch.device(device):
        parent.model = HeadSkippingLlama(cfg)
        if scenario == "eval_only_module":
            parent.model.probe = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if scenario.startswith("reference_model"):
            parent.reference = HeadSkippingLlama(cfg).requires_grad_(False)
    for root in (parent.model, getattr(parent, "reference", None)):
        if root is None:
            continue
        if scenario == "validation_before_capture":  # torchtitan's units: the last kept unsharded after forward
            fully_shard(root.embed)
        for layer in root.layers:
            fully_shard(layer)
        if scenario == "validation_before_capture":
            fully_shard([root.norm, root.head], reshard_after_forward=False)
        if scenario == "chunked_loss":
            fully_shard(root.head)
        if scenario == "eval_only_module":
            fully_shard(root.probe)
        fully_shard(root)  # FSDP2's default root: kept unsharded after forward
    return cfg, parent


def chunked_loss(model, tokens):
    """torchtitan 0.3.0's ChunkedLossWrapper, its FSDP2 calls as it makes them: the head kept
    unsharded across the chunks by an explicit unshard() (reshard after forward and backward off),
    one reduce-scatter at the last chunk, the decoder's backward from the chunks' gradients."""
    hidden = model(tokens, skip_head=True)
    targets = tokens.roll(-1, 1)
    chunks = [c.detach().requires_grad_(hidden.requires_grad) for c in hidden.chunk(CHUNKS, dim=1)]
    head = model.head
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    total, grads = hidden.new_zeros((), dtype=torch.float32), []
    for i, (chunk, target) in enumerate(zip(chunks, targets.chunk(CHUNKS, dim=1))):
        if i == CHUNKS - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(chunk).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) / CHUNKS
        total = total + loss.detach()
        if hidden.requires_grad:
            loss.backward()
            grads.append(chunk.grad)
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.set_requires_gradient_sync(True, recurse=False)
    head.reshard()
    if hidden.requires_grad:
        hidden.backward(torch.cat(grads, dim=1))
    return total


class FakeCapture:
    """CPU: `current_capture` answers FAKE_CAPTURE inside `capturing()`, and every window reports
    the fake graph alive until `destroy()`."""

    def __init__(self):
        self.live, self.active = set(), False
        self.stock = (_capture.current_capture, _pool.PooledWindow.live_captures)
        _capture.current_capture = lambda device: FAKE_CAPTURE if self.active else 0
        _pool.PooledWindow.live_captures = lambda window: set(self.live)

    def capturing(self, fn, *args):
        self.active = True
        self.live.add(FAKE_CAPTURE)
        try:
            return fn(*args)
        finally:
            self.active = False

    def destroy(self):
        self.live.clear()

    def close(self):
        _capture.current_capture, _pool.PooledWindow.live_captures = self.stock


class Steps:
    """fn(*batch) run by run, or captured at CAPTURE_STEP and replayed: on CUDA as torchtitan
    steps it (tide.bench.captured_step); on CPU the capture is FakeCapture's and later steps run
    uncaptured (nothing replays on CPU). An aborted capture is dropped and training goes on
    uncaptured, as a user's loop does."""

    def __init__(self, fn, captured: bool, device, abort: bool):
        self.fn, self.captured, self.cuda, self.abort = fn, captured, device.type == "cuda", abort
        self.calls, self.step, self.fake, self.now, self.aborted = 0, None, None, fn, None
        if captured and not self.cuda:
            self.fake = FakeCapture()

    def __call__(self, *batch):
        self.calls += 1
        aborting = self.abort and self.calls == CAPTURE_STEP + 1
        if not self.captured or (self.abort and self.calls > CAPTURE_STEP + 1):
            return None if aborting else self.fn(*batch)  # run by run, the failed step is not run
        self.now = self._aborting if aborting else self.fn
        stream = torch.cuda.current_stream() if self.cuda else None
        try:
            if self.cuda:
                from tide.bench.captured_step import CapturedStep
                if self.step is None:
                    self.step = CapturedStep(lambda *b: self.now(*b))
                return self.step(*batch).clone()
            if self.calls == CAPTURE_STEP + 1:
                return self.fake.capturing(self.now, *batch)
            return self.fn(*batch)
        except Exception:  # noqa: BLE001 - CUDA's error at the host sync, or ours on CPU
            if not aborting:
                raise
            # The capture aborted; the step stays uncaptured from here on. torch.cuda.graph left
            # its capture stream current (its exit raised before restoring it): back to ours. The
            # graph object stays referenced (torch's allocator may still consult it) but holds
            # nothing.
            if stream is not None:
                torch.cuda.set_stream(stream)
            self.aborted, self.step = self.step, None
            if self.fake is not None:
                self.fake.destroy()
            return None

    def _aborting(self, *batch):
        loss = self.fn(*batch)
        if self.cuda:
            loss.item()  # a host sync inside the capture: CUDA invalidates it
        raise RuntimeError("the capture aborted")

    def destroy(self):
        self.step = None  # CapturedStep holds the only reference to its CUDAGraph
        if self.fake is not None:
            self.fake.destroy()

    def close(self):
        self.destroy()
        if self.fake is not None:
            self.fake.close()


def _evaluate(cfg, model, gen, device, loss):
    model.eval()
    with torch.no_grad():
        out = loss(model, cfg.batch(2, 16, gen, device)[0]).float().cpu()
    model.train()
    return out


def _next_token(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens.roll(-1, 1).view(-1))


def _probe(model, tokens):
    hidden = model(tokens, skip_head=True)
    logits = model.probe(hidden).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens.roll(-1, 1).view(-1))


def _foreign_windows(handle) -> list:
    """Groups that hold a window (their parameters on it) that captures recorded, none of whose
    programs there were theirs."""
    return [b.path for b in handle.buckets
            if b.lease.window is not None and not b.lease.vacated and b.lease.window.captures
            and b.lease not in b.lease.window.owners()]


def scenario(rank: int, world: int, device, name: str, captured: bool) -> dict:
    cfg, parent = _build(name, device)
    model = parent.model
    handle = tide.fsdp.enable(parent, timeout_ms=60000)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen, eval_gen = torch.Generator().manual_seed(100 + rank), torch.Generator().manual_seed(7 + rank)
    loss_of = chunked_loss if name == "chunked_loss" else _next_token

    def fwd_bwd(tokens):
        loss = loss_of(model, tokens)
        if name != "chunked_loss":
            loss.backward()
        return loss.detach()

    steps = Steps(fwd_bwd, captured, device, abort=name == "aborted_capture")
    checkpoint = {}
    out = {"losses": [], "evals": [], "step_counts": [], "between_counts": [], "foreign": [],
           "handled": len(handle.buckets), "fallbacks": handle.fallbacks}

    def counted(key, fn, *args):
        handle.reset_counts()
        result = fn(*args)
        c = handle.counts()
        out[key].append((c["all_gathers"], c["reduce_scatters"]))
        return result

    def between(i):
        if name == "reference_model" and i in (3, 5, 7) or name == "reference_model_before_too" and i in (-1, 3, 5, 7):
            out["evals"].append(_evaluate(cfg, parent.reference, eval_gen, device, _next_token))
        elif name == "eval_only_module" and i % 2 == 1:
            out["evals"].append(_evaluate(cfg, model, eval_gen, device, _probe))
        elif name == "chunked_loss" and i % 2 == 1:  # torchtitan's validation: the chunked loss, no_grad
            out["evals"].append(_evaluate(cfg, model, eval_gen, device, chunked_loss))
        elif name == "teardown_then_gather" and i == 5:
            steps.destroy()
            units = [m for m in model.modules() if isinstance(m, FSDPModule)]
            for m in units:
                m.unshard()
            out["evals"].append(_evaluate(cfg, model, eval_gen, device, _next_token))
            for m in units:
                m.reshard()
            steps.captured = False  # run by run from here on
        elif name == "validation_before_capture" and i in (0, STEPS - 1):  # torchtitan's first, after the warm-up
            # (validations between replays: test_fsdp_cuda_graphs_between.py; on CPU, where
            # nothing replays, a step after the capture runs uncaptured on the captured windows)
            out["evals"].append(_evaluate(cfg, model, eval_gen, device, _next_token))
        elif name == "checkpoint_loaded" and i == -1:  # the sharded state dict, copied
            checkpoint.update((k, v.detach().clone()) for k, v in model.state_dict().items())
        elif name == "checkpoint_loaded" and i == 0:  # a resume into the warmed-up model (in place)
            model.load_state_dict(checkpoint)
            out["evals"].append(_evaluate(cfg, model, eval_gen, device, _next_token))
        elif name == "aborted_capture" and i >= CAPTURE_STEP:
            out["evals"].append(_evaluate(cfg, model, eval_gen, device, _next_token))

    try:
        counted("between_counts", between, -1)
        for i in range(STEPS):
            loss = counted("step_counts", steps, cfg.batch(2, 16, gen, device)[0])
            if loss is None:  # the aborted step: its gradients are dropped, the optimizer skips it
                opt.zero_grad(set_to_none=False)
            else:
                out["losses"].append(loss.float().cpu())
                opt.step()
                opt.zero_grad(set_to_none=False)  # as torchtitan does with captured steps
            counted("between_counts", between, i)
            out["foreign"] += _foreign_windows(handle)
        if device.type == "cuda":
            torch.cuda.synchronize()
        # A root an evaluation left unsharded shows plain tensors (both runs alike)
        out["params"] = [getattr(p, "to_local", lambda: p)().detach().float().cpu().clone() for p in parent.parameters()]
    finally:
        steps.close()
    tide.fsdp.disable(parent)
    return out


def every_scenario(rank: int, world: int, device) -> dict:
    results = {}
    for name in SCENARIOS:
        for captured in (False, True):
            try:
                results[name, captured] = scenario(rank, world, device, name, captured)
            except Exception as e:  # noqa: BLE001 - the scenario's test reports it
                results[name, captured] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    return results


def check(runs, name: str, replays: bool) -> None:
    for rank, results in enumerate(runs):
        eager, mine = results[name, False], results[name, True]
        where = f"{name}, rank {rank} of {len(runs)}"
        assert isinstance(eager, dict), f"{where}, run by run: {eager}"
        assert isinstance(mine, dict), f"{where}, captured: {mine}"
        assert mine["fallbacks"] == [] and mine["handled"] == eager["handled"] >= 5, (where, mine["fallbacks"])
        assert mine["foreign"] == [], f"{where}: groups hold windows a graph captured for others: {mine['foreign']}"
        assert eager["between_counts"] == mine["between_counts"], (where, eager["between_counts"],
                                                                   mine["between_counts"])
        # Per step: run by run's counts at the warm-up and the capture; a replay counts none, and
        # steps after an aborted capture or a teardown run by run again.
        expected = list(eager["step_counts"])
        if replays and name != "aborted_capture":
            last = 5 if name == "teardown_then_gather" else STEPS - 1
            expected[CAPTURE_STEP + 1:last + 1] = [(0, 0)] * (last - CAPTURE_STEP)
        if name == "aborted_capture":  # run by run does not run the failed step; captured, it ran to the raise
            expected[CAPTURE_STEP] = mine["step_counts"][CAPTURE_STEP]
        if name in ("validation_before_capture", "checkpoint_loaded"):
            # An evaluation before the capture. Run by run, the step after it gathers once less
            # (the unit it left unsharded: [norm, head], or the root) and nothing more: its
            # backward prefetches no unit by the evaluation's forwards (FSDP2's record of them,
            # whose backward never comes, would have it gather that unit again after its
            # backward, for nothing).
            first = eager["step_counts"][0]
            after_validation = [(first[0] - 1, first[1]) if i == 1 else first for i in range(STEPS)]
            assert eager["step_counts"] == after_validation, (where, eager["step_counts"])
            # Captured, the capture gathers that unit again: the graph reads it from its own all-gather.
            expected[CAPTURE_STEP] = (first[0], first[1])
        assert mine["step_counts"] == expected, (where, eager["step_counts"], mine["step_counts"])
        for key in ("losses", "evals", "params"):
            assert len(eager[key]) == len(mine[key]), (where, key, len(eager[key]), len(mine[key]))
            for k, (a, b) in enumerate(zip(eager[key], mine[key])):
                assert torch.equal(a, b), f"{where}: {key}[{k}]: {a.flatten()[:4]} (run by run) != {b.flatten()[:4]}"


@pytest.fixture(scope="module")
def cpu_runs():
    return h.run_processes(2, every_scenario)


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_rule_on_the_host(cpu_runs, name):
    check(cpu_runs, name, replays=False)


gpu = pytest.mark.skipif(not (tide.cuda_built and torch.cuda.is_available()),
                         reason="needs a CUDA build of TIDE and a GPU")


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def gpu_runs(request):
    return h.run_processes(request.param, every_scenario, device_type="cuda")


@gpu
@pytest.mark.parametrize("name", SCENARIOS)
def test_cuda_captured_and_replayed(gpu_runs, name):
    check(gpu_runs, name, replays=True)


def freed_at_disable(rank: int, world: int, device) -> dict:
    """With captures recorded (a stand-in capture on CPU), TIDE's objects form no reference cycle:
    the windows go as soon as the model and handle do, with the garbage collector off. Left to the
    collector, a window's teardown (a device synchronize on CUDA) can run while another graph is
    being captured, and invalidate that capture (seen on one H100: the next scenario's capture)."""
    cfg, parent = _build("teardown_then_gather", device)
    handle = tide.fsdp.enable(parent, timeout_ms=60000)
    gen = torch.Generator().manual_seed(rank)
    fake = FakeCapture()
    def step(tokens, model=parent.model):
        _next_token(model, tokens).backward()

    try:
        step(cfg.batch(2, 16, gen, device)[0])  # the warm-up, then the stand-in capture
        fake.capturing(step, cfg.batch(2, 16, gen, device)[0])
        recorded = sum(bool(w.captures) for p in handle.pools for w in p.all_windows())
        windows = [weakref.ref(w) for p in handle.pools for w in p.all_windows()]
        fake.destroy()
        tide.fsdp.disable(parent)
    finally:
        fake.close()
    gc.disable()
    try:
        del handle, parent
        alive = sum(w() is not None for w in windows)
    finally:
        gc.enable()
    return {"recorded": recorded, "windows": len(windows), "alive": alive}


def test_disable_leaves_no_cycle_for_the_garbage_collector():
    for rank, r in enumerate(h.run_processes(2, freed_at_disable)):
        assert r["recorded"] > 0 and r["windows"] > 0, (rank, r)
        assert r["alive"] == 0, f"rank {rank}: {r['alive']} of {r['windows']} windows outlive the handle: {r}"
