"""scripts/torchtitan_gpu.sh without a GPU: its arguments, its dry run (the commands it would run,
and torchtitan's own parse of them where torchtitan imports), and the comparison of two runs'
records (tests/python/torchtitan_shared_gpu.py's compare), on records written here. The datasets
stand-in against the real `datasets` where that is installed."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "torchtitan_gpu.sh"
sys.path.insert(0, str(Path(__file__).parent))
import torchtitan_shared_gpu as driver  # noqa: E402

# torchtitan as the script finds it: installed, or the folder it puts on PYTHONPATH (TIDE_TITAN_PATH,
# default build-titan/). torchtitan's model registries import triton, so without it the script's
# parse fails (tide.torchtitan finds no llama3_debugmodel): the parse cannot be checked here.
TITAN_PATH = Path(os.environ.get("TIDE_TITAN_PATH") or ROOT / "build-titan")
HAS_TITAN = importlib.util.find_spec("torchtitan") is not None or (TITAN_PATH / "torchtitan").is_dir()
NO_TRITON = (f"torchtitan is found ({'installed' if importlib.util.find_spec('torchtitan') else TITAN_PATH}) but "
             f"triton does not import with {sys.executable}: torchtitan's model registries import it, so the "
             "script's dry run cannot parse its runs here (scripts/torchtitan_check.sh's venv has both)"
             if HAS_TITAN and importlib.util.find_spec("triton") is None else "")


def script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=dict(os.environ, PYTHON=sys.executable, **env),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (("--steps", "0"), "--steps '0': expected a positive integer"),
    (("--steps", "2"), "--steps 2: expected 3 or more"),
    (("--val-freq",), "--val-freq: expected a value"),
    (("--val-steps", "x"), "--val-steps 'x': expected a positive integer"),
    (("--frobnicate",), "unknown argument '--frobnicate'"),
])
def test_bad_arguments_are_refused(tmp_path, args, message):
    out = script("--out", str(tmp_path / "out"), *args)
    assert out.returncode == 2 and message in out.stderr and "usage:" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(bool(NO_TRITON), reason=NO_TRITON)
def test_dry_run_prints_both_runs_and_runs_nothing(tmp_path):
    out = script("--dry-run", "--steps", "8", "--val-freq", "3", "--out", str(tmp_path / "out"), "--",
                 "--parallelism.spmd_backend", "full_dtensor")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "W = 2, 8 steps, 3 validations of 3 steps" in out.stdout  # steps 1, 3, 6
    runs = [line for line in out.stdout.splitlines() if "torch.distributed.run" in line]
    assert len(runs) == 2, out.stdout
    for line, record in zip(runs, ("captured", "uncaptured")):
        assert "CUDA_VISIBLE_DEVICES=0" in line and f"TIDE_TITAN_OUT={tmp_path / 'out' / record}" in line
        assert "--nproc_per_node  2" in line and "tests/python/torchtitan_shared_gpu.py" in line
        assert "--module  tide.torchtitan  --config  llama3_debugmodel" in line
        assert "--validator.enable  --validator.freq  3  --validator.steps  3" in line
        assert "--debug.seed  42" in line and line.endswith("--parallelism.spmd_backend  full_dtensor")
        assert ("--training.disable_cuda_graphs" in line) == (record == "uncaptured"), line
        assert " '' " not in line, line  # no empty argument
    assert "compare_main" in out.stdout
    if HAS_TITAN:  # torchtitan's own ConfigManager parsed both command lines
        assert "captured: torchtitan parses it: llama3 debugmodel: 8 steps of 8 x 2048 tokens, CUDA graphs on" in out.stdout
        assert "uncaptured: torchtitan parses it: llama3 debugmodel: 8 steps of 8 x 2048 tokens, CUDA graphs off" in out.stdout
        assert "spmd backend full_dtensor" in out.stdout and "TIDE on" in out.stdout, out.stdout
        assert "validation every 3 steps (and step 1), 3 steps each" in out.stdout
    else:
        assert "NOT CHECKED here: torchtitan does not import" in out.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not HAS_TITAN, reason="torchtitan not installed (scripts/torchtitan_check.sh's venv has it)")
@pytest.mark.skipif(bool(NO_TRITON), reason=NO_TRITON)
def test_dry_run_fails_a_flag_torchtitan_does_not_have(tmp_path):
    out = script("--dry-run", "--out", str(tmp_path), "--", "--training.no_such_flag", "1")
    assert out.returncode == 2 and "CHECK FAILED: torchtitan does not parse the captured run's arguments" in out.stdout


def record(losses=("0x1.0p+3", "0x1.8p+2", "0x1.4p+2"), validation=((1, "0x1.2p+3"), (2, "0x1.1p+3")), fallbacks=()):
    return {"steps": list(range(1, len(losses) + 1)), "losses": list(losses),
            "grad_norms": ["0x1.0p-1"] * len(losses), "validation": [list(v) for v in validation],
            "params_sha256": "abc", "tide": [{"buckets": ["tok_embeddings", "layers.0", "norm"],
                                              "fallbacks": [list(f) for f in fallbacks]}]}


def test_equal_records_pass():
    a = [record(), record()]
    status, verdict = driver.compare(a, copy.deepcopy(a), steps=3, validations=2)
    assert status == 0, verdict
    assert verdict.startswith("3 train steps, 2 validations, bitwise, W = 2, 3 param groups TIDE's")


@pytest.mark.parametrize("change, first", [
    (lambda r: r["losses"].__setitem__(1, "0x1.8000000000001p+2"), "training loss at step 2, rank 1"),
    (lambda r: r["grad_norms"].__setitem__(2, "0x1.1p-1"), "gradient norm at step 3, rank 1"),
    (lambda r: r["validation"][1].__setitem__(1, "0x1.1000000000001p+3"), "validation loss at step 2, rank 1"),
])
def test_the_first_differing_value_is_named_bitwise(change, first):
    a = [record(), record()]
    b = copy.deepcopy(a)
    change(b[1])
    status, verdict = driver.compare(a, b, steps=3, validations=2)
    assert status == 1 and verdict.startswith(first), verdict
    assert "captured 0x" in verdict and "vs uncaptured 0x" in verdict


@pytest.mark.parametrize("b, why", [
    ([record(losses=("0x1.0p+3",)), record()], "captured run, rank 0: 1 training losses logged, not 3"),
    ([record(validation=()), record()], "captured run, rank 0: 0 validations logged, not 2"),
    ([record(fallbacks=(("norm", "why"),)), record()], "fallbacks [['norm', 'why']]"),
])
def test_a_record_that_is_not_a_full_tide_run_proves_nothing(b, why):
    status, verdict = driver.compare(b, [record(), record()], steps=3, validations=2)
    assert status == 2 and why in verdict, verdict


def test_compare_main_prints_one_line(tmp_path, capsys):
    for name, loss in (("captured", "0x1.0p+3"), ("uncaptured", "0x1.0p+3"), ("other", "0x1.1p+3")):
        for rank in range(2):
            (tmp_path / f"{name}.rank{rank}").write_text(json.dumps(record(losses=(loss, loss, loss))))
    label = "torchtitan captured vs uncaptured"
    assert driver.compare_main([label, str(tmp_path / "captured"), str(tmp_path / "uncaptured"), "2", "3", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"{label}: PASS (3 train steps, 2 validations, bitwise")
    assert driver.compare_main([label, str(tmp_path / "captured"), str(tmp_path / "other"), "2", "3", "2"]) == 1
    assert capsys.readouterr().out.startswith(f"{label}: FAIL (training loss at step 1, rank 0: captured 0x1.0")
    assert driver.compare_main([label, str(tmp_path / "captured"), str(tmp_path / "missing"), "2", "3", "2"]) == 2
    assert capsys.readouterr().out.startswith(f"{label}: FAIL (no record of a run")


def test_the_datasets_stand_in_shards_like_datasets(tmp_path):
    rows = [{"text": f"doc {i}"} for i in range(11)]
    (tmp_path / "data.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = driver.stub_load_dataset(str(tmp_path), split="train")
    shards = [list(ds.shard(3, i)) for i in range(3)]
    assert [len(s) for s in shards] == [4, 4, 3] and sum(shards, []) == rows  # contiguous
    assert list(ds.skip(9)) == rows[9:] and sorted(r["text"] for r in ds.shuffle(seed=43)) == sorted(r["text"] for r in rows)
    if importlib.util.find_spec("datasets") is not None:  # the real one, where installed
        import datasets
        from datasets.distributed import split_dataset_by_node

        real = datasets.load_dataset(str(tmp_path), split="train", cache_dir=str(tmp_path / "cache"))
        assert [list(split_dataset_by_node(real, i, 3)) for i in range(3)] == shards
        assert list(real.shuffle(seed=43)) == list(ds.shuffle(seed=43))
