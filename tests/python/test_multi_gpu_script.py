"""scripts/multi_gpu.sh without a GPU: its dry run checks that every subcommand and flag it would
use exists and that the reader of tide-bench's JSON reads what a CPU run writes, prints every
run of issue 58 (and says which are not implemented), writes nothing and
exits 0; bad arguments exit 2 naming the argument; a flag that does not exist fails the dry run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "multi_gpu.sh"
MULTICAST_OFF = ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1")


def multi_gpu(script: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, TITAN_PYTHON=sys.executable)
    return subprocess.run(["bash", str(script), "--out", str(tmp_path / "out"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def commands(text: str) -> list[str]:
    return [line[4:] for line in text.splitlines() if line.startswith("  $ ")]


def test_dry_run_prints_every_run_and_runs_nothing(tmp_path):
    out = multi_gpu(SCRIPT, tmp_path, "--dry-run", "--gpus", "8")
    assert out.returncode == 0, out.stdout + out.stderr
    text, cmds = out.stdout, commands(out.stdout)
    assert "CHECK FAILED" not in text
    assert all(m in text for m in MULTICAST_OFF), text
    for model in ("8b-layers", "70b-layers", "qwen3-moe-layers --expert-shard-dim 1", "wan-layers"):
        # one invocation per size: stock and TIDE, run by run and captured, and compute-only
        fsdp = [c for c in cmds if f"tide.bench.cli fsdp --device cuda --world 8 --model {model} " in c]
        assert len(fsdp) == 2 and all("--cuda-graphs --compute-only" in c for c in fsdp), (model, fsdp)
        assert "--seq" not in fsdp[0] and "--seq 2048 --batch 4" in fsdp[1], fsdp
    assert "checked: python -m tide.bench.report exposure reads a CPU run's JSON" in text
    titan = [c for c in cmds if "-m torchtitan.train" in c]
    assert len(titan) == 4 and all("--nproc_per_node 8" in c and "--training.steps 50" in c
                                   and "--validator.enable" in c for c in titan), titan
    assert {re.search(r"--module (\S+) --config (\S+)", c).groups() for c in titan} == {
        (m, c) for m in ("llama3", "tide.torchtitan") for c in ("llama3_debugmodel", "llama3_debugmodel_float8")}
    for w in (2, 4, 8):
        visible = "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, range(w)))
        assert any(c.startswith(f"env {visible} ") and "tide_bench_cuda compare --bucket llama --min-mib 1 "
                   "--max-mib 1024 --cuda-graphs" in c for c in cmds), w
        for coll in ("ag", "rs"):
            assert any(f"sweep --collective {coll} --world {w} --min-mib 1 --max-mib 1 --cuda-graphs" in c
                       for c in cmds), (w, coll)
            for bucket in ("small", "experts"):
                assert any(f"bucket --bucket {bucket} --collective {coll} --world {w} --cuda-graphs" in c
                           for c in cmds), (w, coll, bucket)
    assert any("tide.bench.cli interference --device cuda --world 8" in c for c in cmds)
    for nodes, world in ((2, 4), (2, 8), (4, 8)):
        for coll in ("ag", "rs"):
            assert any(f"sweep --collective {coll} --world {world} --nodes {nodes} --transport nccl" in c
                       for c in cmds), (nodes, world, coll)
    for run in ("symm-mem", "hf"):
        assert re.search(rf"^NOT IMPLEMENTED {run}: ", text, re.M), run
    assert "dry run: nothing ran" in text
    assert not (tmp_path / "out").exists()


def test_dry_run_names_the_runs_fewer_gpus_cannot_make(tmp_path):
    out = multi_gpu(SCRIPT, tmp_path, "--dry-run", "--gpus", "2", "--only", "virtual-nodes")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NOT RUN virtual-nodes 2x2: needs 4 GPUs" in out.stdout
    assert "NOT RUN virtual-nodes 4x2: needs 8 GPUs" in out.stdout
    assert commands(out.stdout) == []


@pytest.mark.parametrize("args, message", [
    (("--gpus", "1"), "--gpus '1': expected an integer >= 2"),
    (("--gpus", "two"), "--gpus 'two': expected an integer >= 2"),
    (("--only", "fsdp,nope"), "--only: unknown run 'nope'"),
    (("--gpus",), "--gpus: expected a value"),
    (("--frobnicate",), "unknown argument '--frobnicate'"),
])
def test_bad_arguments_are_refused(tmp_path, args, message):
    out = multi_gpu(SCRIPT, tmp_path, "--dry-run", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"multi_gpu.sh: {message}" in out.stderr and "usage:" in out.stderr
    assert commands(out.stdout) == []


def test_a_flag_that_does_not_exist_fails_the_dry_run(tmp_path):
    """A copy of the script (beside the real sources) whose tide-bench and tide_bench_cuda checks
    ask for flags neither has."""
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    (root / "bench").symlink_to(ROOT / "bench")
    text = SCRIPT.read_text()
    for head in ("need_bench_flags fsdp --device", "need_cuda_flags compare --bucket"):
        assert head in text, head
        text = text.replace(head, head.replace("--", "--no-such-flag --", 1), 1)
    script = root / "scripts" / "multi_gpu.sh"
    script.write_text(text)
    out = multi_gpu(script, tmp_path, "--dry-run", "--only", "fsdp,compare")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "CHECK FAILED: tide-bench fsdp has no flag --no-such-flag" in out.stdout
    assert "CHECK FAILED: tide_bench_cuda has no option --no-such-flag" in out.stdout
    assert "2 check(s) failed" in out.stdout


def test_torchtitan_flags_are_checked_against_its_help(tmp_path):
    """Where torchtitan imports, its trainer's --help must list every flag the runs pass (tyro spells
    them with dashes or underscores): here a stand-in torchtitan whose help lacks one, a prefix of
    another it has."""
    package = tmp_path / "titan" / "torchtitan" / "config"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "manager.py").write_text(
        "print('usage: manager.py [-h] [--hf-assets-path STR] [--dataloader.dataset-path STR] "
        "[--training.steps INT] [--validator.enable | --validator.no-enable] [--validator.steps INT] "
        "[--validator.dataloader.dataset_path STR] [--dump-folder STR]')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "titan"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--only", "torchtitan", "--out", str(tmp_path / "out")],
                         env=dict(env, PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    failed = [line for line in out.stdout.splitlines() if "CHECK FAILED" in line]
    assert failed == ["  CHECK FAILED: torchtitan's trainer has no flag --validator.dataloader.dataset"], out.stdout
