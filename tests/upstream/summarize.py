#!/usr/bin/env python3
"""Summarizes run_fsdp2_tests.py results (one or more results.jsonl): per file, outcomes with TIDE off
and on, and how TIDE did in the TIDE-on runs; then every test whose outcome differs, and every TIDE-on
fallback reason and enable error."""
import collections
import json
import sys
from pathlib import Path


def main(paths):
    rows = [json.loads(l) for p in paths for l in Path(p).read_text().splitlines() if l.strip()]
    by = collections.defaultdict(dict)
    for r in rows:
        by[r["test"]][r["mode"]] = r
    files = collections.defaultdict(list)
    for t in by:
        files[t.split("::")[0]].append(t)
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
        off, on = m.get("off", {}).get("outcome"), m.get("on", {}).get("outcome")
        info = m.get("on", {}).get("tide_info", {})
        flag = "  <-- differs" if off != on else ""
        print(f"  {off} -> {on} [{info.get('tide')}; buckets {info.get('buckets')}, AG {info.get('all_gathers')}, "
              f"RS {info.get('reduce_scatters')}] {t.split('::', 1)[1]}{flag}")
        for fb in info.get("fallbacks", []):
            print(f"      fallback: {fb}")
        for e in info.get("errors", []):
            print(f"      enable error: {e[:300]}")


if __name__ == "__main__":
    main(sys.argv[1:])
