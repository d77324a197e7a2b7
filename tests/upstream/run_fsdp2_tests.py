#!/usr/bin/env python3
"""Runs PyTorch's own FSDP2 unit tests (test_fully_shard_*.py, kept outside this repo) with TIDE off
and on, one pytest process per test and mode with a timeout, and reports per test: pass / fail /
skip / hang, and with TIDE on whether TIDE handled param groups or everything fell back.

    python tests/upstream/run_fsdp2_tests.py --tests-dir /tmp/upstream_fsdp \
        --files test_fully_shard_training.py --modes off on --timeout 120 --out /tmp/upstream_results

TIDE on: tide_on/sitecustomize.py (put on PYTHONPATH, so it also loads in the rank processes that
FSDP2's multi-process tests spawn) wraps fully_shard so that each root FSDP2 module's first forward
calls tide.fsdp.enable(root) first; tide_on/tide_upstream_hook.py says how, and what it records.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOOK_DIR = HERE / "tide_on"


def collect(python: str, tests_dir: Path, file: str) -> list[str]:
    out = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tests_dir), file],
                         cwd=tests_dir, capture_output=True, text=True, timeout=600)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        sys.stderr.write(f"collect {file}: no tests\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n")
    return ids


def outcome(rc: int, text: str) -> str:
    summary = ""
    for line in reversed(text[-4000:].splitlines()):
        if re.search(r"\b(passed|failed|skipped|error|errors|no tests ran)\b.* in [\d.]+s", line):
            summary = line
            break
    if "failed" in summary or "error" in summary:
        return "fail"
    if "passed" in summary:
        return "pass"
    if "skipped" in summary:
        return "skip"
    return "fail" if rc else "pass"


def tide_summary(log: Path) -> dict:
    s = {"enables": 0, "buckets": 0, "fallbacks": [], "errors": [], "not_applicable": 0,
         "all_gathers": 0, "reduce_scatters": 0, "log": []}
    if not log.exists():
        return s
    last_counts: dict = {}
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        ev = e.get("event")
        if ev == "enable":
            s["enables"] += 1
            s["buckets"] += e["buckets"]
            for fb in e["fallbacks"]:
                if fb[1] not in s["fallbacks"]:
                    s["fallbacks"].append(fb[1])
        elif ev == "enable_error":
            if e["error"] not in s["errors"]:
                s["errors"].append(e["error"])
        elif ev == "not_applicable":
            s["not_applicable"] += 1
        elif ev == "counts":
            key = (e["pid"], e["thread"])
            c = e["counts"]
            prev = last_counts.get(key, {"all_gathers": 0, "reduce_scatters": 0})
            last_counts[key] = {k: max(prev[k], c[k]) for k in ("all_gathers", "reduce_scatters")}
        elif ev == "log":
            msg = e["message"]
            if msg not in s["log"]:
                s["log"].append(msg)
    for c in last_counts.values():
        s["all_gathers"] = max(s["all_gathers"], c["all_gathers"])
        s["reduce_scatters"] = max(s["reduce_scatters"], c["reduce_scatters"])
    if s["enables"] == 0:
        s["tide"] = ("enable raised" if s["errors"] else
                     "not applicable (no param groups)" if s["not_applicable"] else "not enabled")
    elif s["buckets"] == 0:
        s["tide"] = "full fallback"
    elif s["all_gathers"] == 0 and s["reduce_scatters"] == 0:
        s["tide"] = "handled, no TIDE collective seen"
    else:
        s["tide"] = "handled"
    return s


def run_one(python: str, tests_dir: Path, test_id: str, mode: str, timeout: float, out: Path) -> dict:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id)
    log_file = out / "logs" / f"{safe}.{mode}.txt"
    tide_log = out / "logs" / f"{safe}.{mode}.tide.jsonl"
    for p in (log_file, tide_log):
        if p.exists():
            p.unlink()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TIDE_UPSTREAM"] = mode
    env["TIDE_UPSTREAM_LOG"] = str(tide_log)
    env.setdefault("TIDE_UPSTREAM_CPU_MULTIPROC", "1")
    t0 = time.time()
    with open(log_file, "w") as f:
        proc = subprocess.Popen([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                                 "--rootdir", str(tests_dir), test_id],
                                cwd=tests_dir, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)  # the pytest process group: pytest and its rank processes
            rc = proc.wait()
    text = log_file.read_text(errors="replace")
    res = {"test": test_id, "mode": mode, "seconds": round(time.time() - t0, 1),
           "outcome": "hang" if hung else outcome(rc, text), "rc": rc, "log": str(log_file)}
    if mode == "on":
        res["tide_info"] = tide_summary(tide_log)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests-dir", type=Path, default=Path("/tmp/upstream_fsdp"))
    ap.add_argument("--files", nargs="+", required=True)
    ap.add_argument("--modes", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/upstream_results"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("-k", dest="filter", default=None, help="run only test ids containing this")
    ap.add_argument("--ids", type=Path, default=None, help="a file of test ids (file::Class::test), in order")
    a = ap.parse_args()
    (a.out / "logs").mkdir(parents=True, exist_ok=True)
    results_path = a.out / "results.jsonl"
    for file in a.files:
        ids = collect(a.python, a.tests_dir, file)
        if a.ids:
            wanted = [l.strip() for l in a.ids.read_text().splitlines() if l.strip().startswith(file + "::")]
            ids = [i for i in wanted if i in ids]
        if a.filter:
            ids = [i for i in ids if a.filter in i]
        for test_id in ids:
            for mode in a.modes:
                r = run_one(a.python, a.tests_dir, test_id, mode, a.timeout, a.out)
                with open(results_path, "a") as f:
                    f.write(json.dumps(r) + "\n")
                extra = f" [{r['tide_info']['tide']}]" if mode == "on" else ""
                print(f"{r['outcome']:5} {mode:3} {r['seconds']:6.1f}s {test_id}{extra}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
