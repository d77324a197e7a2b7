"""Hugging Face transformers models under FSDP2 with TIDE, on CPU: random init from tiny configs
(nothing downloaded), one ``fully_shard`` per decoder layer plus the root, as accelerate's FSDP2
path and torchtitan wrap them; W = 2 ranks as spawned processes over gloo. Each model trains a few
steps with stock FSDP2 and with TIDE: the final parameters must be bitwise equal (at W = 2 every
reduced element is one sum of two, the same on both paths), TIDE must have handled every group and
none of FSDP2's layout copies may have run.

Architectures: Llama with tied input/output embeddings, Qwen3-MoE (a mixture of experts: 3-D
expert weights, a router), Qwen2 (biases on q/k/v). And accelerate's own FSDP2 preparation
(``accelerate.utils.fsdp_utils.fsdp2_prepare_model``) where it runs on CPU, with
``tide.fsdp.enable`` after it.

Skips unless transformers is installed (``pip install .[hf]``; scripts/test.sh installs it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import fsdp_harness as h
import tide.fsdp

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install .[hf])")

VOCAB, SEQ, STEPS = 64, 12, 3
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(arch: str):
    import transformers as t
    if arch == "llama_tied":
        return t.LlamaConfig(**TINY, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return t.Qwen3MoeConfig(**TINY, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "qwen2":
        return t.Qwen2Config(**TINY, tie_word_embeddings=False)
    raise ValueError(arch)


def build(arch: str):
    import transformers as t
    torch.manual_seed(0)
    config = _config(arch)
    config._attn_implementation = "eager"
    return t.AutoModelForCausalLM.from_config(config)


def shard(model) -> None:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def train(model, steps: int = STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    counter = h.OpCounter()
    losses = []
    with counter:
        for _ in range(steps):
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return [p.to_local().detach().clone() for p in model.parameters()], losses, dict(counter.counts)


def run_arch(rank: int, world: int, device, arch: str) -> dict:
    try:
        stock_model = build(arch)
        shard(stock_model)
        stock, stock_losses, stock_ops = train(stock_model)
        model = build(arch)
        shard(model)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        handle = tide.fsdp.enable(model, timeout_ms=60000)
        try:
            mine, losses, ops = train(model)
        finally:
            tide.fsdp.disable(model)
        return {"groups": len(tide.fsdp._fsdp2.param_groups(model)), "buckets": len(handle.buckets),
                "fallbacks": handle.fallbacks, "counts": handle.counts(), "ops": ops, "stock_ops": stock_ops,
                "tied": tied, "equal": all(torch.equal(a, b) for a, b in zip(mine, stock)),
                "losses": losses, "stock_losses": stock_losses}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}"}


ARCHS = ("llama_tied", "qwen3_moe", "qwen2")


def run_all(rank: int, world: int, device) -> dict:
    """Every case in one world (transformers imports once per rank)."""
    out = {arch: run_arch(rank, world, device, arch) for arch in ARCHS}
    try:
        out["accelerate"] = run_accelerate(rank, world, device)
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["accelerate"] = {"error": f"{type(e).__name__}: {e}"}
    return out


_results: list = []


def results(case: str) -> list[dict]:
    if not _results:
        _results.extend(h.run_processes(2, run_all))
    return [r[case] for r in _results]


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_model_trains_bitwise_as_stock(arch):
    for rank, r in enumerate(results(arch)):
        assert "error" not in r, f"rank {rank}: {r}"
        assert r["groups"] == 3 and r["buckets"] == 3 and r["fallbacks"] == [], r  # 2 layers + root
        assert r["counts"]["all_gathers"] > 0 and r["counts"]["reduce_scatters"] > 0, r
        assert r["stock_ops"]["chunk_cat"] > 0 or r["stock_ops"]["split_with_sizes_copy"] > 0, r
        assert not any(r["ops"].values()), f"rank {rank}: FSDP2 layout copies ran: {r['ops']}"
        assert r["tied"] == (arch == "llama_tied"), r
        assert r["losses"] == r["stock_losses"] and r["equal"], f"rank {rank}: differs from stock FSDP2: {r}"


def run_accelerate(rank: int, world: int, device) -> dict:
    """accelerate's FSDP2 preparation (its fully_shard per decoder layer + root, from the model's
    ``_no_split_modules``), then tide.fsdp.enable, then training; against the same preparation
    without TIDE."""
    if importlib.util.find_spec("accelerate") is None:
        return {"skip": "accelerate is not installed (pip install .[hf])"}
    try:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    except ImportError as e:
        return {"skip": f"accelerate: {e}"}
    runs = {}
    for with_tide in (False, True):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                                auto_wrap_policy="transformer_based_wrap")
        accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
        # On CPU accelerate keeps no FSDP plugin (its FSDP path is for GPUs): given back, its own
        # preparation function runs as prepare() would call it on GPUs.
        accelerator.state.fsdp_plugin = plugin
        model = fsdp2_prepare_model(accelerator, build("llama_tied"))
        handle = tide.fsdp.enable(model, timeout_ms=60000) if with_tide else None
        try:
            params, losses, ops = train(model)
        finally:
            if handle is not None:
                tide.fsdp.disable(model)
        runs[with_tide] = (params, losses, ops, handle)
    params, losses, ops, handle = runs[True]
    return {"groups": len(tide.fsdp._fsdp2.param_groups(model)), "buckets": len(handle.buckets),
            "fallbacks": handle.fallbacks, "ops": ops,
            "equal": all(torch.equal(a, b) for a, b in zip(params, runs[False][0])),
            "losses": losses, "stock_losses": runs[False][1]}


def test_accelerate_fsdp2_preparation_then_enable():
    for rank, r in enumerate(results("accelerate")):
        if "skip" in r:
            pytest.skip(r["skip"])
        assert "error" not in r, f"rank {rank}: {r}"
        assert r["buckets"] == r["groups"] >= 3 and r["fallbacks"] == [], r
        assert not any(r["ops"].values()), f"rank {rank}: FSDP2 layout copies ran: {r['ops']}"
        assert r["losses"] == r["stock_losses"] and r["equal"], f"rank {rank}: differs from accelerate's stock FSDP2: {r}"
