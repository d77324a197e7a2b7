#!/usr/bin/env python3
"""Summarizes run_fsdp2_tests.py results (one or more results.jsonl; for a test run more than once in
a mode, the last line wins): per file, outcomes with TIDE off and on, and how TIDE did in the TIDE-on
runs; then every test whose outcome differs, and every TIDE-on fallback reason and enable error.

    python tests/upstream/summarize.py OUT/results.jsonl [...]             # text
    python tests/upstream/summarize.py --markdown OUT/results.jsonl [...]  # a table per file

A mode a test was not run in shows as "not run"."""
import collections
import json
import sys
from pathlib import Path


def load(paths):
    rows = [json.loads(l) for p in paths for l in Path(p).read_text().splitlines() if l.strip()]
    by = collections.defaultdict(dict)
    for r in rows:
        by[r["test"]][r["mode"]] = r
    files = collections.defaultdict(list)
    for t in by:
        files[t.split("::")[0]].append(t)
    return by, files


def tide_cell(info: dict) -> str:
    if not info:
        return ""
    t = info.get("tide", "")
    if t.startswith("handled"):
        t += f" (TIDE AG {info.get('all_gathers')}, RS {info.get('reduce_scatters')}, the most one rank counted)"
    extra = [f"fallback: {fb}" for fb in info.get("fallbacks", [])]
    extra += [f"enable error: {e[:200]}" for e in info.get("errors", [])]
    return "; ".join([t] + extra).replace("|", "\\|")


def markdown(by, files):
    for f, tests in files.items():
        print(f"\n### {f}\n")
        print("| test | TIDE off | TIDE on | what TIDE did |")
        print("|---|---|---|---|")
        for t in tests:
            m = by[t]
            cell = lambda mode: (f"{m[mode]['outcome']} ({m[mode]['seconds']:.0f} s)" if mode in m else "not run")
            print(f"| {t.split('::', 1)[1]} | {cell('off')} | {cell('on')} | "
                  f"{tide_cell(m.get('on', {}).get('tide_info', {}))} |")


def text(by, files):
    print("| file | tests | TIDE off: pass/fail/skip/hang | TIDE on: pass/fail/skip/hang | TIDE on: handled / full fallback / not enabled / enable raised |")
    print("|---|---|---|---|---|")
    for f, tests in files.items():
        cnt = {m: collections.Counter(by[t][m]["outcome"] for t in tests if m in by[t]) for m in ("off", "on")}
        tide = collections.Counter(by[t]["on"]["tide_info"]["tide"] for t in tests if "on" in by[t])
        fmt = lambda c: "/".join(str(c.get(k, 0)) for k in ("pass", "fail", "skip", "hang"))
        handled = sum(v for k, v in tide.items() if k.startswith("handled"))
        print(f"| {f} | {len(tests)} | {fmt(cnt['off'])} | {fmt(cnt['on'])} | {handled} / {tide.get('full fallback', 0)} / "
              f"{tide.get('not enabled', 0)} / {tide.get('enable raised', 0)} |")
    print("\nPer test (off -> on [TIDE]):")
    for t, m in by.items():
        off = m.get("off", {}).get("outcome", "not run")
        on = m.get("on", {}).get("outcome", "not run")
        info = m.get("on", {}).get("tide_info", {})
        flag = "  <-- differs" if off != on and "not run" not in (off, on) else ""
        print(f"  {off} -> {on} [{info.get('tide')}; buckets {info.get('buckets')}, AG {info.get('all_gathers')}, "
              f"RS {info.get('reduce_scatters')}] {t.split('::', 1)[1]}{flag}")
        for fb in info.get("fallbacks", []):
            print(f"      fallback: {fb}")
        for e in info.get("errors", []):
            print(f"      enable error: {e[:300]}")


def main(argv):
    md = "--markdown" in argv
    paths = [a for a in argv if a != "--markdown"]
    by, files = load(paths)
    (markdown if md else text)(by, files)


if __name__ == "__main__":
    main(sys.argv[1:])
