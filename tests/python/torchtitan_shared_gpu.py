"""torchtitan 0.3.0's own trainer (torchtitan.train.main, what ``-m torchtitan.train`` runs) with
its ranks as processes sharing ONE GPU, recording what it logs (tests/python/torchtitan_cpu.py's
record_and_run: every step's loss and gradient norm, every validation's loss, as float.hex), and
the comparison of two such runs that scripts/torchtitan_gpu.sh makes (captured vs
--training.disable_cuda_graphs).

    CUDA_VISIBLE_DEVICES=0 TIDE_TITAN_OUT=out/captured python -m torch.distributed.run --standalone \
        --nproc_per_node 2 tests/python/torchtitan_shared_gpu.py --module tide.torchtitan \
        --config llama3_debugmodel ...

TEST-ONLY launcher shims, kept out of the product. torchtitan assumes NCCL and one GPU per rank;
none of these touches TIDE, and both runs of a comparison get the same ones:
  1. The process group is gloo. torchtitan asks torch.distributed.init_process_group for the
     backend torch maps to "cuda" (NCCL), and NCCL refuses two ranks on one GPU. TIDE carries
     every FSDP2 all-gather and reduce-scatter (scripts/torchtitan_gpu.sh fails a run where a
     group fell back to the process group); what is left to gloo is torchtitan's own all-reduces
     of token counts, losses and the gradient norm, outside the captured forward + backward.
  2. torch.distributed.set_timeout where torch lacks it (torchtitan_cpu.py's shim 2, applied when
     that module is imported), and torchtitan_cpu.py's torch shims for a torch older than
     torchtitan 0.3.0's (the GPU machine's 2.11), applied there too, each only where torch lacks
     the thing: A. a stand-in for torch.distributed.fsdp.DataParallelMeshDims (for the import;
     partial_dtensor passes none to fully_shard); B. the config's ChunkedLossWrapper replaced by
     the loss it wraps, where FSDP2 cannot complete the [norm, lm_head] unit whose lm_head the
     model's forward skips (the dry run's summary names the loss).
  3. A stand-in for the ``datasets`` package where it is not installed: torchtitan's text data
     set imports it at import time, and it does not fit the folder carried to a GPU machine with
     no registry (it needs pyarrow and pandas). It reads the local JSON-lines data set
     (torchtitan_cpu.make_assets) and splits and shuffles it as ``datasets`` does for a map-style
     data set (``load_dataset(folder, split="train")``, ``split_dataset_by_node``: contiguous
     shards; ``shuffle(seed)``: numpy's default_rng permutation). TIDE_TITAN_DATASETS_STUB=1
     uses it even where ``datasets`` is installed (to check it against the real one on CPU).
Every rank is on cuda:0 without a shim: torchtitan's get_local_device takes device 0 when one
device is visible, and scripts/torchtitan_gpu.sh makes one visible. Without CUDA the same driver
runs on CPU ranks with torchtitan_cpu.py's CPU shims (uncaptured only): scripts/torchtitan_gpu.sh
--cpu checks this plumbing there.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
import types

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------- 1. gloo, not NCCL
def install_gloo_process_group() -> None:
    init = dist.init_process_group

    def init_gloo(*args, **kwargs):
        if args:  # backend is init_process_group's first parameter
            args = ("gloo",) + args[1:]
        else:
            kwargs["backend"] = "gloo"
        kwargs.pop("device_id", None)  # binds NCCL communicators to a device; gloo takes none
        return init(*args, **kwargs)

    dist.init_process_group = init_gloo


# -------------------------------------------------------------------------- 3. a `datasets` stand-in
class StubDataset:
    """What torchtitan's HuggingFaceTextDataset uses of a map-style ``datasets.Dataset``."""

    def __init__(self, rows: list[dict]):
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        return iter(self._rows)

    def skip(self, n: int) -> "StubDataset":
        return StubDataset(self._rows[n:])

    def shard(self, num_shards: int, index: int, contiguous: bool = True) -> "StubDataset":
        if not contiguous:
            return StubDataset(self._rows[index::num_shards])
        div, mod = divmod(len(self._rows), num_shards)
        start = div * index + min(index, mod)
        return StubDataset(self._rows[start:start + div + (1 if index < mod else 0)])

    def shuffle(self, seed: int | None = None, **_) -> "StubDataset":
        import numpy as np

        return StubDataset([self._rows[i] for i in np.random.default_rng(seed).permutation(len(self._rows))])


def stub_load_dataset(path: str, name: str | None = None, split: str = "train", streaming: bool = False, **_):
    files = sorted(glob.glob(os.path.join(path, "*.json")) + glob.glob(os.path.join(path, "*.jsonl")))
    if streaming or not files or split != "train":
        raise NotImplementedError(f"torchtitan_shared_gpu's datasets stand-in reads a local folder of JSON "
                                  f"lines (split 'train', not streamed), not {path!r} (split {split!r}, "
                                  f"streaming={streaming}): make it with torchtitan_cpu.make_assets")
    rows = []
    for file in files:
        with open(file) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return StubDataset(rows)


def install_datasets_stub() -> bool:
    """The stand-in as ``datasets`` where that does not import (or TIDE_TITAN_DATASETS_STUB=1);
    whether it was installed."""
    if importlib.util.find_spec("datasets") is not None and os.environ.get("TIDE_TITAN_DATASETS_STUB") != "1":
        return False
    module = types.ModuleType("datasets")
    module.__doc__ = "tests/python/torchtitan_shared_gpu.py's stand-in for the datasets package"
    module.Dataset, module.load_dataset = StubDataset, stub_load_dataset
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = lambda ds, rank, world_size: ds.shard(world_size, rank, contiguous=True)
    module.distributed = distributed
    sys.modules["datasets"], sys.modules["datasets.distributed"] = module, distributed
    return True


# -------------------------------------------------------------------------------------- comparison
def load_run(prefix: str, world: int) -> list[dict]:
    """Each rank's record of a run (record_and_run's $TIDE_TITAN_OUT.rank<r>)."""
    runs = []
    for rank in range(world):
        with open(f"{prefix}.rank{rank}") as f:
            runs.append(json.load(f))
    return runs


def _value(x: str) -> str:
    return f"{x} ({float.fromhex(x)!r})"


def compare(a: list[dict], b: list[dict], names=("captured", "uncaptured"), steps: int | None = None,
            validations: int | None = None, require_tide: bool = True) -> tuple[int, str]:
    """(status, verdict) of two runs' records, rank by rank: 0 when every logged training loss and
    gradient norm and every validation loss are bitwise equal (and there are `steps` and
    `validations` of them, and every rank's model parts are TIDE's with no fallback where
    `require_tide`); 1 with the first differing value; 2 when a run's record is not what the run
    should have logged (a difference in values would prove nothing then)."""
    for name, run in zip(names, (a, b)):
        for rank, r in enumerate(run):
            if steps is not None and len(r["losses"]) != steps:
                return 2, f"{name} run, rank {rank}: {len(r['losses'])} training losses logged, not {steps}"
            if validations is not None and len(r["validation"]) != validations:
                return 2, f"{name} run, rank {rank}: {len(r['validation'])} validations logged, not {validations}"
            if require_tide:
                handles = r.get("tide") or []
                if not handles:
                    return 2, f"{name} run, rank {rank}: TIDE was not enabled (no handle on the model)"
                for h in handles:
                    if h["fallbacks"] or not h["buckets"]:
                        return 2, (f"{name} run, rank {rank}: TIDE handles {len(h['buckets'])} groups, "
                                   f"fallbacks {h['fallbacks']}: a comparison would not be TIDE's")
    for rank, (x, y) in enumerate(zip(a, b)):
        if x["steps"] != y["steps"]:
            return 1, f"rank {rank}: logged steps {x['steps']} vs {y['steps']}"
        for key, what in (("losses", "training loss"), ("grad_norms", "gradient norm")):
            for step, u, v in zip(x["steps"], x[key], y[key]):
                if u != v:
                    return 1, f"{what} at step {step}, rank {rank}: {names[0]} {_value(u)} vs {names[1]} {_value(v)}"
        if [s for s, _ in x["validation"]] != [s for s, _ in y["validation"]]:
            return 1, f"rank {rank}: validations at steps {[s for s, _ in x['validation']]} vs {[s for s, _ in y['validation']]}"
        for (step, u), (_, v) in zip(x["validation"], y["validation"]):
            if u != v:
                return 1, f"validation loss at step {step}, rank {rank}: {names[0]} {_value(u)} vs {names[1]} {_value(v)}"
    params = "equal" if all(x["params_sha256"] == y["params_sha256"] for x, y in zip(a, b)) else "NOT equal"
    groups = sum(len(h["buckets"]) for h in (a[0].get("tide") or []))
    tide = f", {groups} param groups TIDE's on every rank, no fallback" if require_tide else ""
    return 0, (f"{len(a[0]['losses'])} train steps, {len(a[0]['validation'])} validations, bitwise, W = {len(a)}"
               f"{tide}; final parameter shards {params}")


def compare_main(argv: list[str]) -> int:
    """compare_main([label, prefix_a, prefix_b, world, steps, validations]): prints
    '<label>: PASS (...)' or '<label>: FAIL (...)', the runs named by their records' file names;
    exit status as compare's."""
    label, prefix_a, prefix_b, world, steps, validations = argv
    names = (os.path.basename(prefix_a), os.path.basename(prefix_b))
    try:
        a, b = load_run(prefix_a, int(world)), load_run(prefix_b, int(world))
    except (OSError, ValueError, KeyError) as e:
        print(f"{label}: FAIL (no record of a run: {e})")
        return 2
    status, verdict = compare(a, b, names, int(steps), int(validations))
    print(f"{label}: {'PASS' if status == 0 else 'FAIL'} ({verdict})")
    return status


def parse_only(argv: list[str]) -> str:
    """The config torchtitan's own ConfigManager makes of `argv` (the trainer's arguments), in one
    line: every flag and value is checked as the trainer checks them, and nothing runs."""
    sys.path.insert(0, HERE)
    import torchtitan_cpu  # noqa: F401  (its torch shims A-B at import, as the runs get them)

    install_datasets_stub()
    from torchtitan.config import ConfigManager

    c = ConfigManager().parse_args(argv)
    spec = c.model_spec
    return (f"{spec.name} {spec.flavor}: {c.training.steps} steps of {c.training.local_batch_size} x "
            f"{c.training.seq_len} tokens, CUDA graphs {'off' if c.training.disable_cuda_graphs else 'on'}, "
            f"reshard after forward '{c.parallelism.fsdp_reshard_after_forward}', "
            f"spmd backend {c.parallelism.spmd_backend}, validation "
            f"{'every ' + str(c.validator.freq) + ' steps (and step 1), ' + str(c.validator.steps) + ' steps each' if c.validator.enable else 'off'}, "
            f"TIDE {'on' if spec.post_optimizer_build_fn is not None and 'enable_tide' in spec.post_optimizer_build_fn.__qualname__ else 'off'}, "
            f"seed {c.debug.seed}, loss {type(c.loss).__qualname__.removesuffix('.Config')}")


def main() -> None:
    sys.path.insert(0, HERE)
    import torchtitan_cpu  # its shim 2 and torch shims A-B at import; its CPU shims (1 at import) only without CUDA

    if torch.cuda.is_available():
        install_gloo_process_group()
    else:
        torchtitan_cpu.install_config_shims()
    if install_datasets_stub():
        print("torchtitan_shared_gpu: `datasets` is not installed here: its stand-in reads the local data set",
              file=sys.stderr)
    torchtitan_cpu.record_and_run()
    from tide.bench.launch import exit_rank

    exit_rank()  # its record written: no interpreter finalization, which gloo can abort


if __name__ == "__main__":
    main()
