"""Runs torchtitan 0.3.0's own trainer (torchtitan.train.main) on CPU ranks over gloo, with the
command line a user gives it, stock FSDP2 or with TIDE (``--module tide.torchtitan``), and writes
what it saw as JSON.

    TIDE_TITAN_OUT=out.json python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/python/torchtitan_cpu.py --module tide.torchtitan --config llama3_debugmodel ...

TEST-ONLY. The "CPU shims" (1-2 below at import, 3-5 applied to whatever config --module/--config
loads) exist because torchtitan 0.3.0 itself (TIDE off too) assumes a GPU; the "torch shims" (A-B,
at import, on CPU and GPU: tests/python/torchtitan_shared_gpu.py imports this module) because it
assumes a torch newer than 2.11, each applied only where torch lacks what it uses. None of them
touches TIDE, and stock and TIDE runs get the same ones. TIDE_TITAN_FORCE_SUM=0 leaves out shim 4 (only
for runs where TIDE takes every reduce-scatter). The driver (record_and_run) only records (losses,
gradient norms, validation losses, a hash of the final parameter shards, TIDE's handle); it changes
nothing else; tests/python/torchtitan_shared_gpu.py runs it on one GPU. `make_assets` writes the
small tokenizer and text data set that torchtitan's debug config reads from its source tree's
tests/assets (not in the wheel), since nothing can be downloaded here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys

import types

import torch
import torch.distributed as dist


# -------------------------------------------------------------------------------------- torch shims
# For a torch that lacks what torchtitan 0.3.0 uses (torch 2.13 has all of it; the GPU machine's 2.11
# does not). Each is applied at import, CPU or GPU, only where torch lacks the thing.
def install_data_parallel_mesh_dims() -> bool:
    """A. torch.distributed.fsdp.DataParallelMeshDims where torch lacks it (torchtitan's fsdp and
    full_dtensor modules import it at import time): a copy of torch 2.13's dataclass. Enough for
    partial_dtensor, where torchtitan never passes one to fully_shard; full_dtensor and spmd_types
    pass it as fully_shard(dp_mesh_dims=...), which a torch without it lacks (nor does its
    fully_shard take parameters already DTensors on the full SPMD mesh), so they fail there with a
    TypeError: no shim translates that. Whether it was installed."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return False

    @dataclasses.dataclass
    class DataParallelMeshDims:
        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self):
            if self.shard is None and self.replicate is None:
                raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

        @property
        def shard_names(self) -> tuple[str, ...]:
            return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            return (() if self.replicate is None else (self.replicate,) if isinstance(self.replicate, str)
                    else tuple(self.replicate))

    DataParallelMeshDims.__module__ = "torch.distributed.fsdp"
    DataParallelMeshDims.__qualname__ = "DataParallelMeshDims"
    fsdp.DataParallelMeshDims = DataParallelMeshDims
    return True


def install_unchunked_loss() -> bool:
    """B. The loaded config's ChunkedLossWrapper replaced by the loss it wraps (its ``loss_fn``, as
    torchtitan's own llama3_debugmodel_ce_loss config does) where torch's FSDP2 cannot complete a
    grouped unit one of whose modules skipped forward (torch 2.13 completes it from the root's
    post-forward: FSDPState._force_complete_incomplete_states). The wrapper skips lm_head in the
    model's forward and runs it per chunk; lm_head shares a unit with the final norm
    (fully_shard([norm, lm_head])), and a torch without that completion never registers the unit's
    pre-backward hook on the norm's output, so the norm's backward finds its weight resharded
    (stock FSDP2 too: "data is not allocated yet"). Same loss, one lm_head call over the whole
    sequence; both runs of a comparison get it. Whether it was installed."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    if hasattr(FSDPState, "_force_complete_incomplete_states"):
        return False
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config.manager import ConfigManager

    load = ConfigManager._load_config

    def load_unchunked(self, args):
        config, rest = load(self, args)
        if isinstance(config.loss, ChunkedLossWrapper.Config):
            print(f"torchtitan_cpu: torch {torch.__version__}'s FSDP2 cannot run ChunkedLossWrapper over the "
                  f"grouped [norm, lm_head] unit: its loss_fn ({type(config.loss.loss_fn).__qualname__}) "
                  "is used unchunked", file=sys.stderr)
            config.loss = config.loss.loss_fn
        return config, rest

    ConfigManager._load_config = load_unchunked
    return True


def install_block_mask_without_separate_full_blocks() -> bool:
    """C. torchtitan's flex-attention masks (CUDA) pass create_block_mask(separate_full_blocks=),
    which torch 2.11 lacks: there every BlockMask keeps its full blocks apart, which is what
    separate_full_blocks=True asks for, so the keyword is dropped when True (False, torchtitan's
    batch-invariant mode, has no equivalent there and raises). Whether it was installed."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return False
    from torchtitan.models.common import attention

    compiled = attention._compiled_create_block_mask

    def without_keyword(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise NotImplementedError(f"torch {torch.__version__}'s create_block_mask always separates "
                                      "full blocks: batch-invariant flex attention needs a newer torch")
        return compiled(*args, **kwargs)

    attention._compiled_create_block_mask = without_keyword  # create_attention_mask looks it up per call
    return True


def install_stable_document_mask_mods(force: bool = False) -> bool:
    """D. torchtitan's flex-attention mask_mod as the same function object every step, reading its
    document tensors from buffers updated in place, where torch's BlockMask keeps mask_mod, closure
    tensors and all, in its pytree context (torch 2.11: BlockMask._flatten wraps it in a
    _MaskModWrapper that compares __code__ and closure contents; torch 2.13 lifts the closure
    tensors into the leaves, _extract_callable_pytree). torchtitan's CUDAGraphInputSpec requires
    that context to be equal every step (cudagraph.py:87-95) and rebuilds each step's BlockMask
    from the FIRST step's context (cudagraph.py:118): its decoder builds a new and_masks(causal,
    packed_document_mask) each step, whose closure holds two new functions (unequal: the
    ValueError), and whose document tensors would otherwise stay the first step's in every
    replay. With stable functions over stable buffers both hold: the context is equal, and the
    buffers (graph inputs at fixed addresses) carry each step's documents. Same values as
    torchtitan's own factories, eager or captured; both runs of a comparison get it. Whether it
    was installed."""
    from torch.nn.attention import flex_attention

    if hasattr(flex_attention, "_extract_callable_pytree") and not force:
        return False
    from torchtitan.models.common import attention, decoder

    causal = attention.get_causal_mask_mod()  # no closure: one instance serves every call
    make_document = attention.get_efficient_causal_mask_mod_for_packed_document
    stable = {}  # (code, positions' shape, device) -> (buffers, mask_mod reading them)

    def document_mask_mod(positions):
        fresh = make_document(positions)
        values = [cell.cell_contents for cell in fresh.__closure__ or ()]
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise TypeError(f"torchtitan_cpu: {fresh.__qualname__} closes over a non-tensor: "
                            "shim D handles only tensors")
        key = (fresh.__code__, tuple(positions.shape), positions.device)
        if key not in stable:
            buffers = [v.clone() for v in values]
            cells = tuple(types.CellType(b) for b in buffers)
            stable[key] = buffers, types.FunctionType(fresh.__code__, fresh.__globals__, fresh.__name__,
                                                      fresh.__defaults__, cells)
        buffers, mask_mod = stable[key]
        for buffer, value in zip(buffers, values):
            buffer.copy_(value)
        return mask_mod

    # decoder.py:287-288 looks both up in its own globals at each call
    decoder.get_causal_mask_mod = lambda: causal
    decoder.get_efficient_causal_mask_mod_for_packed_document = document_mask_mod
    return True


# A, before anything imports torchtitan: it imports DataParallelMeshDims (torch 2.13 has it, 2.11 not).
install_data_parallel_mesh_dims()


# ---------------------------------------------------------------------------------------- CPU shims
# 1. torchtitan.tools.utils picks its device at import: torch._utils._get_available_device_type()
#    is None without an accelerator, and torchtitan then takes "cuda" (torch.cuda.set_device fails).
#    Point it at "cpu", with torch.cpu as its device module plus the memory queries torchtitan's
#    DeviceMemoryMonitor makes (get_device_name, get_device_properties, memory_stats, ...), which
#    torch.cpu lacks, and current_device() as an index (torch.cpu's is the string "cpu"). Only
#    torchtitan's import sees the change; torch's own functions are restored after it.
class _CPUDeviceModule:
    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def current_device(self):  # an index: set_pg_timeouts passes it as barrier(device_ids=[...])
        return 0

    def get_device_name(self, device=None):
        return "cpu"

    def get_device_properties(self, device=None):
        import types

        return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device=None):
        return {}

    def reset_peak_memory_stats(self, device=None):
        pass

    def empty_cache(self):
        pass


if not torch.cuda.is_available():
    import torch._utils

    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: _CPUDeviceModule()
    import torchtitan.tools.utils  # noqa: E402,F401  (binds device_type, device_module)

    torch._utils._get_available_device_type, torch._utils._get_device_module = saved
# 2. torchtitan's set_pg_timeouts (after step 1) calls torch.distributed.set_timeout, which torch
#    2.13 does not have; its private equivalent is _set_pg_timeout(timeout, group).
if not hasattr(dist, "set_timeout"):
    from torch.distributed import distributed_c10d

    dist.set_timeout = lambda timeout, group=None: distributed_c10d._set_pg_timeout(timeout, group)
# B. torchtitan's chunked loss needs FSDP2 to complete a partly run grouped unit (torch 2.13 does, 2.11 not).
install_unchunked_loss()
# C. torchtitan's flex-attention masks pass a create_block_mask keyword that torch 2.11 lacks.
install_block_mask_without_separate_full_blocks()
# D. torch 2.11's BlockMask keeps its mask_mod, closure and all, in its pytree context, which
#    torchtitan's CUDA-graph wrapper requires equal every step (2.13 lifts the closure into leaves).
install_stable_document_mask_mods()


def cpu_config(config, force_sum: bool = True):
    """The loaded config's model on CPU: 3. SDPA in place of FlexAttention (which has no backward on
    CPU), 4. force-sum reduction (torchtitan sets FSDP2's gradient divide factor to 1.0, and FSDP2
    then reduce-scatters with PREMUL_SUM(1.0), which gloo lacks; SUM with no division is the same).
    force_sum=False keeps PREMUL_SUM, as on GPUs: only runs where TIDE takes every reduce-scatter."""
    from torchtitan.distributed.fsdp import FSDPModule
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    spec = config.model_spec
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        if isinstance(attr, int):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    parallelize = spec.parallelize_fn
    if not force_sum:
        return config

    def parallelize_force_sum(model, **kwargs):
        model = parallelize(model, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return model

    config.model_spec = dataclasses.replace(spec, parallelize_fn=parallelize_force_sum)
    return config


def install_config_shims() -> None:
    """3-4 on the config torchtitan loads from --module/--config (its ConfigManager._load_config),
    and 5. float8 emulation: torchtitan's float8 converter refuses a machine without SM89 unless
    ``emulate`` (torchao's float8 matmuls in high precision), which it sets on CPU."""
    from torchtitan.components.quantization.float8 import Float8LinearConverter
    from torchtitan.config.manager import ConfigManager

    load = ConfigManager._load_config
    force_sum = os.environ.get("TIDE_TITAN_FORCE_SUM", "1") != "0"

    def load_for_cpu(self, args):
        config, rest = load(self, args)
        return cpu_config(config, force_sum), rest

    init = Float8LinearConverter.__init__

    def init_emulated(self, config):
        config.emulate, config.model_compile_enabled = True, False
        init(self, config)

    ConfigManager._load_config = load_for_cpu
    Float8LinearConverter.__init__ = init_emulated


# --------------------------------------------------------------------------------------- test data
def make_assets(root: str, vocab: int = 2000, docs: int = 400, seed: int = 0) -> tuple[str, str]:
    """A word-level tokenizer (vocab + bos/eos, under the debug model's 2048) and a c4-like JSON
    data set of Zipf-distributed words; returns (tokenizer folder, data set folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "c4_test")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    words = [f"w{i}" for i in range(vocab)]
    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": specials[1], "eos_token": specials[2], "add_bos_token": True,
                   "add_eos_token": True}, f)
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(vocab)]
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for _ in range(docs):
            n = rng.randint(50, 400)
            f.write(json.dumps({"text": " ".join(rng.choices(words, weights, k=n))}) + "\n")
    return tok_dir, data_dir


# ------------------------------------------------------------------------------------------ driver
def record_and_run() -> None:
    """torchtitan.train.main() (what ``-m torchtitan.train`` runs), recording what the trainer
    logs: every logged step's loss and gradient norm, every validation's loss (float.hex, so a
    comparison is bitwise), a hash of the final parameter shards and TIDE's handle; written to
    $TIDE_TITAN_OUT.rank<RANK> as JSON when that is set. Changes nothing the trainer does."""
    from torchtitan import train
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    seen = {"losses": [], "grad_norms": [], "steps": [], "validation": [], "params_sha256": None}
    log, log_validation = MetricsProcessor.log, MetricsProcessor.log_validation

    def record(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        seen["steps"].append(step)
        seen["losses"].append(float(global_avg_loss).hex())
        seen["grad_norms"].append(float(grad_norm).hex())
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    def record_validation(self, loss, step, *args, **kwargs):
        seen["validation"].append([step, float(loss).hex()])
        return log_validation(self, loss, step, *args, **kwargs)

    close = Trainer.close

    def close_and_hash(self):
        digest = hashlib.sha256()
        for part in self.model_parts:
            for name, p in part.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                digest.update(name.encode())
                digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            handle = getattr(part, "tide_handle", None)
            if handle is not None:
                seen.setdefault("tide", []).append({
                    "repr": repr(handle), "buckets": [b.path for b in handle.buckets],
                    "fallbacks": [list(map(str, f)) for f in handle.fallbacks],
                    "counts": handle.counts()})
        seen["params_sha256"] = digest.hexdigest()
        return close(self)

    MetricsProcessor.log = record
    MetricsProcessor.log_validation = record_validation
    Trainer.close = close_and_hash
    train.main()
    out = os.environ.get("TIDE_TITAN_OUT")
    if out:
        with open(f"{out}.rank{os.environ.get('RANK', '0')}", "w") as f:
            json.dump(seen, f, indent=1)


def main():
    install_config_shims()
    record_and_run()
    from tide.bench.launch import exit_rank

    exit_rank()  # its record written: no interpreter finalization, which gloo can abort


if __name__ == "__main__":
    main()
