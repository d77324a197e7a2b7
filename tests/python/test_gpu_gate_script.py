"""scripts/gpu_gate.sh's bookkeeping, without a GPU: the verdict line counts a stage that has not
run, failed or ran on other sources as not passed; `a+b` runs stages side by side and reports each;
an unknown stage is refused; `first second` runs every stage once, GATE_ONLY limits them and the
verdict, and `touched BASE` names the stages a change touches."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "scripts" / "gpu_gate.sh"
STAGES = ("build", "cpp", "python", "bench", "presets", "titan", "sanitize")


def gate(script: Path, tmp_path: Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GATE_DIR=str(tmp_path / "gate"), OUT=str(tmp_path / "out"), **env_vars)
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=120)


def record(tmp_path: Path, stage: str, result: str, digest: str) -> None:
    (tmp_path / "gate").mkdir(exist_ok=True)
    (tmp_path / "gate" / stage).write_text(f"{result}\n{digest}\n")


@pytest.fixture
def digest(tmp_path) -> str:
    out = gate(GATE, tmp_path, "digest")
    assert out.returncode == 0 and re.fullmatch(r"[0-9a-f]{12}", out.stdout.strip()), out
    return out.stdout.strip()


def test_no_stage_run_is_no_pass(tmp_path, digest):
    out = gate(GATE, tmp_path, "verdict")
    assert out.returncode == 1
    assert out.stdout.startswith("GPU GATE FAIL: build not run, cpp not run")
    assert f"sources {digest}]" in out.stdout


def test_every_stage_passed_on_these_sources_is_a_pass(tmp_path, digest):
    for s in STAGES:
        record(tmp_path, s, f"PASS ({s} detail)", digest)
    out = gate(GATE, tmp_path, "verdict")
    assert out.returncode == 0, out.stdout
    assert out.stdout.startswith("GPU GATE PASS: build PASS, cpp PASS, python PASS, bench PASS, presets PASS, titan PASS, sanitize PASS")
    assert "  cpp: PASS (cpp detail)" in out.stdout


@pytest.mark.parametrize("stage, result, shown", [
    ("sanitize", "FAIL (exit 1)", "sanitize FAIL"),
    ("cpp", "PASS (on older sources)", "cpp stale"),
])
def test_a_failed_or_stale_stage_fails_the_gate(tmp_path, digest, stage, result, shown):
    for s in STAGES:
        record(tmp_path, s, "PASS", digest)
    record(tmp_path, stage, result, digest if result.startswith("FAIL") else "0123456789ab")
    out = gate(GATE, tmp_path, "verdict")
    assert out.returncode == 1
    assert out.stdout.startswith("GPU GATE FAIL:") and shown in out.stdout.splitlines()[0]


def stand_in_gate(tmp_path: Path, results: dict) -> Path:
    """A copy of the script whose stages only say they ran and record `results[stage]`."""
    scripts = tmp_path / "root" / "scripts"
    scripts.mkdir(parents=True)
    text = GATE.read_text()
    for stage in STAGES:
        head = f"stage_{stage}() {{\n"
        assert head in text, stage
        text = text.replace(head, f"{head}  echo ran {stage}; record {stage} \"{results.get(stage, 'PASS (stand-in)')}\"; return\n", 1)
    script = scripts / "gpu_gate.sh"
    script.write_text(text)
    return script


@pytest.mark.parametrize("args", [("cpp+nope",), ("frobnicate",), ("build+",), ("+cpp",), ("cpp++python",)])
def test_unknown_stages_are_refused(tmp_path, args):
    out = gate(stand_in_gate(tmp_path, {}), tmp_path, *args)
    assert out.returncode == 2 and "usage:" in out.stdout
    assert not re.search(r"^ran ", out.stdout, re.M), out.stdout
    assert not any((tmp_path / "gate" / s).exists() for s in STAGES)


def test_stages_side_by_side_each_report_their_result(tmp_path):
    """`cpp+python`: both run (their outputs in OUT/gate_stage_<name>.txt), each result is reported,
    the verdict sees both."""
    script = stand_in_gate(tmp_path, {"python": "FAIL (stand-in)"})
    out = gate(script, tmp_path, "cpp+python", "verdict")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "== gate: cpp: PASS (stand-in)" in out.stdout
    assert "== gate: python: FAIL (stand-in)" in out.stdout
    assert "build not run, cpp PASS, python FAIL" in out.stdout
    for stage in ("cpp", "python"):
        assert f"ran {stage}" in (tmp_path / "out" / f"gate_stage_{stage}.txt").read_text()


def test_first_and_second_run_every_stage_once_and_end_with_the_verdict(tmp_path):
    out = gate(stand_in_gate(tmp_path, {}), tmp_path, "first", "second")
    assert out.returncode == 0, out.stdout + out.stderr
    ran = sorted(re.findall(r"ran (\w+)", out.stdout + "".join(
        p.read_text() for p in (tmp_path / "out").glob("gate_stage_*.txt"))))
    assert ran == sorted(STAGES), ran
    assert out.stdout.splitlines()[-len(STAGES) - 1].startswith("GPU GATE PASS: build PASS")


def test_gate_only_runs_and_judges_the_stages_it_names(tmp_path):
    out = gate(stand_in_gate(tmp_path, {}), tmp_path, "first", "second", GATE_ONLY="build titan")
    assert out.returncode == 0, out.stdout + out.stderr
    ran = re.findall(r"ran (\w+)", out.stdout + "".join(
        p.read_text() for p in (tmp_path / "out").glob("gate_stage_*.txt")))
    assert sorted(ran) == ["build", "titan"], ran
    assert "GPU GATE PASS (only the stages GATE_ONLY names): build PASS, titan PASS [" in out.stdout
    bad = gate(stand_in_gate(tmp_path / "b", {}), tmp_path, "verdict", GATE_ONLY="build nope")
    assert bad.returncode == 2 and "GATE_ONLY: 'nope' is no stage" in bad.stderr
    blank = gate(stand_in_gate(tmp_path / "c", {}), tmp_path, "verdict", GATE_ONLY=" ")
    assert blank.returncode == 2 and "names no stage" in blank.stderr


def test_touched_names_the_stages_a_change_touches(tmp_path):
    """A copy of the repository's files in a git repository of its own: each change since its
    first commit touches the stages the script's table gives it."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_gate.sh").write_text(GATE.read_text())
    for f in ("docs/x.md", "python/tide/fsdp/a.py", "python/tide/bench/b.py", "tests/python/test_a.py",
              "tests/python/torchtitan_cpu.py", "tests/gpu/t.cpp", "src/a.cpp"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text("0\n")
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "base", "--allow-empty")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "files")
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    script = repo / "scripts" / "gpu_gate.sh"
    for changed, stages in [((), ""), (("docs/x.md",), ""),
                            (("tests/python/test_a.py",), "build python"),
                            (("tests/python/torchtitan_cpu.py",), "build titan"),
                            (("python/tide/bench/b.py",), "build python bench presets titan"),
                            (("python/tide/fsdp/a.py", "tests/gpu/t.cpp"), "build cpp python bench presets titan sanitize"),
                            (("src/a.cpp",), " ".join(STAGES))]:
        git("checkout", "-q", base, "--", ".")
        for f in changed:
            (repo / f).write_text("1\n")
        out = gate(script, tmp_path, "touched", base)
        assert out.returncode == 0 and out.stdout.strip() == stages, (changed, out.stdout, out.stderr)
    assert gate(script, tmp_path, "touched", "no-such-commit").returncode == 2


def fake_torchtitan(folder: Path) -> Path:
    """A folder that imports as torchtitan 0.3.0's CUDA-graph wrapper (what
    scripts/torchtitan_wrapper.sh makes), for the gate's check alone."""
    package = folder / "torchtitan" / "distributed"
    package.mkdir(parents=True)
    (folder / "torchtitan" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "cudagraph.py").write_text("class CUDAGraphWrapper:\n    pass\n")
    info = folder / "torchtitan-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchtitan\nVersion: 0.3.0\n")
    return folder


@pytest.mark.parametrize("titan, wrapper", [
    ("fake", "captured steps by torchtitan 0.3.0 CUDAGraphWrapper"),
    ("missing", "captured steps by CapturedStep (no "),
    ("broken", "captured steps by CapturedStep (torchtitan's wrapper does not import from"),
])
def test_the_python_stage_names_the_wrapper_that_stepped_captured_steps(tmp_path, titan, wrapper):
    """torchtitan's own wrapper where TIDE_TITAN_PATH holds it, CapturedStep otherwise; the stage's
    result says which (no test is selected here: the stage fails, and says so)."""
    folder = tmp_path / "titan"
    if titan == "fake":
        fake_torchtitan(folder)
    elif titan == "broken":
        (folder / "torchtitan").mkdir(parents=True)
    env = dict(os.environ, GATE_DIR=str(tmp_path / "gate"), OUT=str(tmp_path / "out"),
               TIDE_TITAN_PATH=str(folder), PYTEST_K="no_test_has_this_name", PYTEST_SPLIT="0")
    out = subprocess.run(["bash", str(GATE), "python"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr  # the stage ran; its result is recorded
    result = (tmp_path / "gate" / "python").read_text().splitlines()[0]
    assert result.startswith("FAIL") and wrapper in result, result


def titan_gate(tmp_path: Path, verdict: str | None, rc: int) -> Path:
    """A copy of the script beside a stand-in scripts/torchtitan_gpu.sh that prints `verdict` (if
    any) and exits `rc`, and a build-titan/trainer/ folder for the titan stage to find."""
    scripts = tmp_path / "root" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "gpu_gate.sh").write_text(GATE.read_text())
    (scripts / "torchtitan_gpu.sh").write_text(
        "echo \"== args: $*\"\n" + (f"echo '{verdict}'\n" if verdict else "") + f"exit {rc}\n")
    (tmp_path / "root" / "build-titan" / "trainer").mkdir(parents=True)
    return scripts / "gpu_gate.sh"


@pytest.mark.parametrize("verdict, rc, result", [
    ("torchtitan captured vs uncaptured: PASS (10 train steps, 6 validations, bitwise)", 0,
     "PASS (captured vs uncaptured: 10 train steps, 6 validations, bitwise)"),
    ("torchtitan captured vs uncaptured: FAIL (validation loss at step 4, rank 0: ...)", 1,
     "FAIL (exit 1: FAIL (validation loss at step 4, rank 0: ...))"),
    (None, 1, "FAIL (exit 1: no verdict line; see gate_titan.log)"),
    ("torchtitan captured vs uncaptured: PASS (a line the exit status contradicts)", 3, "FAIL (exit 3: PASS"),
])
def test_the_titan_stage_records_the_verdict_of_torchtitan_gpu(tmp_path, verdict, rc, result):
    script = titan_gate(tmp_path, verdict, rc)
    out = gate(script, tmp_path, "titan")
    assert out.returncode == 0, out.stdout + out.stderr  # the stage ran; its result is recorded
    recorded = (tmp_path / "gate" / "titan").read_text().splitlines()[0]
    assert recorded.startswith(result), recorded
    assert f"--out {tmp_path / 'out' / 'titan'}" in (tmp_path / "out" / "gate_titan.log").read_text()


def test_the_titan_stage_without_the_trainer_packages_fails_naming_the_script(tmp_path):
    script = stand_in_gate(tmp_path, {})  # stand-ins for the other stages; titan's own code here
    text = script.read_text()
    script.write_text(text.replace('stage_titan() {\n  echo ran titan; record titan "PASS (stand-in)"; return\n',
                                   "stage_titan() {\n"))
    env = dict(os.environ, GATE_DIR=str(tmp_path / "gate"), OUT=str(tmp_path / "out"),
               TIDE_TITAN_PATH=str(tmp_path / "no-titan"))
    out = subprocess.run(["bash", str(script), "titan", "verdict"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1, out.stdout
    recorded = (tmp_path / "gate" / "titan").read_text().splitlines()[0]
    assert recorded.startswith("FAIL (not run: no ") and "scripts/torchtitan_wrapper.sh" in recorded, recorded
    verdict = next(line for line in out.stdout.splitlines() if line.startswith("GPU GATE"))
    assert verdict.startswith("GPU GATE FAIL:") and "titan FAIL" in verdict, verdict
