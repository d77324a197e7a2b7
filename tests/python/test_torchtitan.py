"""torchtitan as a client of TIDE: torchtitan 0.3.0's own trainer (torchtitan.train.main) on W = 2
CPU ranks over gloo, with the command line a user gives it: stock FSDP2 (``--module llama3``) vs
TIDE (``--module tide.torchtitan``, the same ``--config``). At FSDP degree 2 with fp32 the two runs
must agree bitwise: every step's loss and gradient norm, and the final parameters (with bf16 params
too: at W = 2 each reduced element is one fp32 sum of two, the same on both paths). Cases: the debug
model under both DTensor backends; bf16 params with FSDP2's PREMUL_SUM as on GPUs; torchtitan's
float8 converter (its rowwise recipe, emulated on CPU: torchtitan 0.3.0 has no fp8 all-gather, so
its float8 weights are plain params to FSDP2); and a checkpoint saved and resumed (torchtitan loads
it after TIDE is enabled), against stock's.

Skips unless torchtitan 0.3.0 and triton are installed (``pip install .[torchtitan]``;
scripts/torchtitan_check.sh makes a venv with them and runs this file, as CI does).
tests/python/torchtitan_cpu.py holds the CPU-only shims torchtitan itself needs; TIDE_TITAN_STEPS
sets the steps (default 10).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _skip_reason() -> str:
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan not installed (scripts/torchtitan_check.sh installs torchtitan==0.3.0 in a venv and runs this)"
    version = importlib.metadata.version("torchtitan")
    if version != "0.3.0":
        return f"torchtitan {version} installed; this test and its CPU shims are for 0.3.0"
    if importlib.util.find_spec("triton") is None:
        return "triton not installed (torchtitan 0.3.0 imports it unconditionally: pip install triton)"
    return ""


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "-")

STEPS = int(os.environ.get("TIDE_TITAN_STEPS", "10"))
# (spmd backend, FSDP2 param dtype, config, TIDE keeps FSDP2's PREMUL_SUM): fp32 under both DTensor
# backends; what a GPU user runs (bf16 params, FSDP2's PREMUL_SUM reduce op, which gloo lacks, so
# only TIDE's run keeps it, against stock's force-sum SUM: the same sums at a factor of 1.0); float8.
NO_TORCHAO = importlib.util.find_spec("torchao") is None
CASES = [pytest.param("partial_dtensor", "float32", "llama3_debugmodel", False, id="partial_dtensor-float32"),
         pytest.param("full_dtensor", "float32", "llama3_debugmodel", False, id="full_dtensor-float32"),
         pytest.param("full_dtensor", "bfloat16", "llama3_debugmodel", True, id="full_dtensor-bfloat16-premul"),
         pytest.param("full_dtensor", "float32", "llama3_debugmodel_float8", False, id="float8",
                      marks=pytest.mark.skipif(NO_TORCHAO, reason="torchao not installed (torchtitan's float8 "
                                                                  "converter needs it: pip install .[float8])"))]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    sys.path.insert(0, HERE)
    import torchtitan_cpu

    return torchtitan_cpu.make_assets(str(tmp_path_factory.mktemp("torchtitan_assets")))


def run_titan(tmp_path, assets, module: str, config: str, backend: str, dtype: str, steps: int = STEPS,
              checkpoint: str = "", premul: bool = False) -> list[dict]:
    """torchtitan.train on 2 ranks (torchrun); each rank's record (losses, grad norms as float.hex,
    a hash of its parameter shards, TIDE's handle). checkpoint: a folder to save every
    `steps` steps to and to resume from (torchtitan loads the latest step there)."""
    tokenizer, data = assets
    out = tmp_path / f"{module}-{config}-{backend}-{dtype}-{steps}"
    dump = tmp_path / (checkpoint or "dump")
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(steps)] if checkpoint else ["--checkpoint.no-enable"]
    env = dict(os.environ, TIDE_TITAN_OUT=str(out), HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TIDE_TITAN_FORCE_SUM="0" if premul else "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "torchtitan_cpu.py"), "--module", module, "--config", config,
           "--hf_assets_path", tokenizer, "--dataloader.dataset_path", data,
           "--parallelism.spmd_backend", backend, "--training.mixed_precision_param", dtype,
           "--training.steps", str(steps), "--training.seq_len", "256", "--training.local_batch_size", "2",
           "--debug.seed", "42", "--validator.no-enable", "--dump_folder", str(dump), *ckpt]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"torchtitan {module} {config} {backend} {dtype} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.loads((tmp_path / f"{out.name}.rank{r}").read_text()) for r in range(2)]


@pytest.mark.parametrize("backend,dtype,config,premul", CASES)
def test_torchtitan_tide_matches_stock(tmp_path, assets, backend, dtype, config, premul):
    stock = run_titan(tmp_path, assets, "llama3", config, backend, dtype)
    tide = run_titan(tmp_path, assets, "tide.torchtitan", config, backend, dtype, premul=premul)
    for rank in range(2):
        s, t = stock[rank], tide[rank]
        assert "tide" not in s
        (handle,) = t["tide"]  # one model part (no pipeline parallelism)
        # A pass by total fallback would prove nothing: every FSDP2 param group must be TIDE's.
        assert handle["fallbacks"] == [], handle["fallbacks"]
        assert len(handle["buckets"]) == 8, handle  # tok_embeddings, 6 layers, norm + lm_head
        assert handle["counts"]["all_gathers"] > 0 and handle["counts"]["reduce_scatters"] > 0, handle
    assert_same(stock, tide, STEPS)
    assert float.fromhex(stock[0]["losses"][-1]) < float.fromhex(stock[0]["losses"][0])  # it trains


def assert_same(stock, tide, steps):
    for rank in range(2):
        s, t = stock[rank], tide[rank]
        assert len(s["losses"]) == steps
        assert t["losses"] == s["losses"], (rank, s["losses"], t["losses"])
        assert t["grad_norms"] == s["grad_norms"], rank
        assert t["params_sha256"] == s["params_sha256"], rank


def test_torchtitan_checkpoint_resume(tmp_path, assets):
    """TIDE is enabled before torchtitan loads a checkpoint, which copies into the sharded
    parameters TIDE recorded: save at step 3, resume to step 6, stock vs TIDE, bitwise."""
    for module in ("llama3", "tide.torchtitan"):
        first = run_titan(tmp_path, assets, module, "llama3_debugmodel", "partial_dtensor", "float32", 3,
                          f"ckpt-{module}")
        assert (tmp_path / f"ckpt-{module}" / "checkpoint" / "step-3").is_dir()
        resumed = run_titan(tmp_path, assets, module, "llama3_debugmodel", "partial_dtensor", "float32", 6,
                            f"ckpt-{module}")
        if module == "llama3":
            stock = (first, resumed)
    assert_same(stock[0], first, 3)
    assert_same(stock[1], resumed, 3)  # steps 4-6, after the load
    assert resumed[0]["tide"][0]["fallbacks"] == [] and len(resumed[0]["tide"][0]["buckets"]) == 8


def test_tide_torchtitan_wraps_any_registered_config_and_keeps_captured_steps():
    """What --module tide.torchtitan hands torchtitan for a config name: the registry's own config
    with TIDE's hook after the spec's (an MoE model's load-balancing hook kept), captured steps as
    the registry has them (torchtitan's default: on); an unknown name and an unknown torchtitan
    release refused with one line."""
    import torchtitan
    import tide.torchtitan as tt
    from torchtitan.models.llama3 import config_registry as llama3
    from torchtitan.models.qwen3 import config_registry as qwen3

    stock = llama3.llama3_debugmodel()
    config = tt.llama3_debugmodel()  # the attribute torchtitan's ConfigManager reads
    assert stock.training.disable_cuda_graphs is False and config.training.disable_cuda_graphs is False
    assert stock.model_spec.post_optimizer_build_fn is None
    assert config.model_spec.post_optimizer_build_fn is not None
    assert (config.model_spec.name, config.model_spec.flavor) == (stock.model_spec.name, stock.model_spec.flavor)

    moe_name = next(n for n in dir(qwen3) if "moe" in n and "debug" in n and callable(getattr(qwen3, n)))
    moe = getattr(tt, f"qwen3.{moe_name}")()
    hook = moe.model_spec.post_optimizer_build_fn
    kept = getattr(qwen3, moe_name)().model_spec.post_optimizer_build_fn
    assert kept is not None and hook is not kept and kept in [c.cell_contents for c in hook.__closure__ or ()]

    with pytest.raises(AttributeError, match="no torchtitan config registry has a config 'no_such_config'"):
        tt.no_such_config
    saved = torchtitan.__version__
    torchtitan.__version__ = "0.9.0"
    try:
        with pytest.raises(RuntimeError, match="torchtitan 0.9.0 is not one this module knows"):
            tt.llama3_debugmodel()
    finally:
        torchtitan.__version__ = saved


def _positions(seed: int, batch: int, seq: int = 256):
    """Packed-document positions as torchtitan's loader makes them: 0, 1, ... restarting per document."""
    import torch
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        row: list = []
        while len(row) < seq:
            row += list(range(int(torch.randint(20, 120, (1,), generator=g))))
        rows.append(row[:seq])
    return torch.tensor(rows)


@pytest.mark.parametrize("batch", [4, 1])
def test_shim_d_keeps_the_block_masks_context_equal_and_its_documents_current(monkeypatch, batch):
    """torchtitan_cpu's shim D (needed where BlockMask keeps mask_mod, closure and all, in its pytree
    context: torch 2.11), forced on here: two steps' mask_mods pass 2.11's equality (same code, same
    closure contents) and the first step's function masks the second step's documents, as a replay
    of a graph captured at the first step reads them."""
    import torch
    from torch.nn.attention.flex_attention import and_masks, create_mask
    from torchtitan.models.common import attention, decoder
    sys.path.insert(0, HERE)
    import torchtitan_cpu

    p1, p2 = _positions(1, batch), _positions(2, batch)
    seq = p1.shape[1]
    expected = create_mask(and_masks(attention.get_causal_mask_mod(),
                                     attention.get_efficient_causal_mask_mod_for_packed_document(p2)),
                           batch, None, seq, seq, device="cpu")
    for name in ("get_causal_mask_mod", "get_efficient_causal_mask_mod_for_packed_document"):
        monkeypatch.setattr(decoder, name, getattr(decoder, name))  # restored after the test
    assert torchtitan_cpu.install_stable_document_mask_mods(force=True)
    first = and_masks(decoder.get_causal_mask_mod(), decoder.get_efficient_causal_mask_mod_for_packed_document(p1))
    second = and_masks(decoder.get_causal_mask_mod(), decoder.get_efficient_causal_mask_mod_for_packed_document(p2))
    contents = [tuple(c.cell_contents for c in f.__closure__ or ()) for f in (first, second)]
    assert first.__code__ == second.__code__ and contents[0] == contents[1]
    assert torch.equal(create_mask(first, batch, None, seq, seq, device="cpu"), expected)
    unpatched = and_masks(attention.get_causal_mask_mod(), attention.get_efficient_causal_mask_mod_for_packed_document(p1))
    assert not torch.equal(create_mask(unpatched, batch, None, seq, seq, device="cpu"), expected)
