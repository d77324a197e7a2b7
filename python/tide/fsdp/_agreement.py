"""Ranks agreeing before they act: an exchange of one string per rank through the torch.distributed
store, bounded by a timeout, and the check that every rank of a process group describes its param
groups the same way (else a DesyncError on every rank, naming the first difference, or the rank
that raised while describing them).

Keys carry the process group's global ranks, a topic and a round number counted per (store,
topic, group, rank): the n-th exchange on a topic by this rank of this group in this
torch.distributed world. Nothing comes from process state shared by ranks, so ranks that are
threads of one process (FSDP2's multi-threaded tests) meet on the same keys as ranks that are
processes, and a new world (a new store) starts from round 0.
"""

from __future__ import annotations

import json
import threading

import torch.distributed as dist

from .. import _tide
from ..distributed import wait_for_ranks

_rounds: dict = {}
_stores: dict = {}  # id -> store: keeps each store alive, so its id is never reused for another
_lock = threading.Lock()


def _group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def exchange(group: dist.ProcessGroup, topic: str, mine: str, timeout_ms: int) -> list[str]:
    """Every group rank's `mine`, in group-rank order. A rank missing after `timeout_ms` is a
    TimeoutError naming it (it never called, or called a different number of times)."""
    return _exchange(group, topic, mine, timeout_ms)[1]


def _exchange(group: dist.ProcessGroup, topic: str, mine: str, timeout_ms: int) -> tuple[int, list[str]]:
    store = dist.distributed_c10d._get_default_store()
    ranks, rank = _group_ranks(group), group.rank()
    base = f"tide/{topic}/{'-'.join(map(str, ranks))}"
    with _lock:
        _stores[id(store)] = store
        n = _rounds.get((id(store), base, rank), 0)
        _rounds[(id(store), base, rank)] = n + 1
    keys = [f"{base}/{n}/{q}" for q in range(len(ranks))]
    store.set(keys[rank], mine)
    try:
        wait_for_ranks(store, keys, timeout_ms, f"rank {rank} at '{topic}' (round {n})")
    except TimeoutError as e:
        missing = [q for q, k in enumerate(keys) if not store.check([k])]
        raise TimeoutError(
            f"tide.fsdp: rank {rank} of process group {list(ranks)} waited {timeout_ms} ms at "
            f"'{topic}' (round {n}) for group ranks {missing} (global {[ranks[q] for q in missing]}): "
            "they did not reach it, or reached it a different number of times (every rank must "
            "call tide.fsdp.enable on the same model)") from e
    return n, [store.get(k).decode() for k in keys]


def agree(groups: dict, options: dict, entries: dict, timeout_ms: int,
          failure: BaseException | None = None, failed_at: str = "") -> dict:
    """check_agreement for every process group of one enable, in module order (the same on every
    rank): `groups` and `entries` by group ranks. Returns each group's round, by its ranks.

    A rank that raised `failure` while describing its param groups (at param group `failed_at`)
    still takes part, sending the failure instead of its entries, and a rank that learns of a
    failure or a disagreement passes it on in its later groups: every rank of the groups it reaches
    raises the same tide.DesyncError at once, naming the rank, instead of waiting out the timeout
    for a rank that stopped. The rank that failed chains its own exception. With no group of
    several ranks, `failure` is raised as it is."""
    if failure is not None and not groups:
        raise failure
    problem = None
    if failure is not None:
        at = f" at param group {failed_at}" if failed_at else ""
        problem = (f"tide.fsdp.enable: global rank {dist.get_rank()} raised {type(failure).__name__}{at}: "
                   f"{failure}; every rank of its process groups raises this, TIDE is enabled on none")
    rounds = {}
    for ranks, group in groups.items():
        rounds[ranks], problem = check_agreement(group, options, entries[ranks], timeout_ms, problem)
    if problem is not None:
        raise _tide.DesyncError(problem) from failure
    return rounds


def check_agreement(group: dist.ProcessGroup, options: dict, entries: list, timeout_ms: int,
                    problem: str | None = None) -> tuple[int, str | None]:
    """One exchange through the store: every rank of `group` passes `options` (enable's arguments
    that shape windows and programs) and `entries` (JSON-able descriptions of the group's param
    groups in module order), or, where it already has one, a `problem` that stops the enable
    instead. Returns the round (how many agreements this rank of this group reached before, the
    same on every rank of it: every later exchange of the same enable is keyed by it, so an enable
    that timed out on one rank leaves nothing a retry could mistake for its own) and the problem
    every rank of the group now has: the first one a rank sent, in group-rank order, else the first
    difference between the ranks' options or entries, else None."""
    ranks = _group_ranks(group)
    sent = {"problem": problem} if problem is not None else {"options": options, "groups": entries}
    n, theirs = _exchange(group, "enable", json.dumps(sent, sort_keys=True), timeout_ms)
    decoded = [json.loads(t) for t in theirs]
    problems = [d["problem"] for d in decoded if "problem" in d]
    if problems:
        return n, problems[0]
    return n, _disagreement(ranks, decoded)


def _disagreement(ranks: tuple[int, ...], decoded: list[dict]) -> str | None:
    """The first difference between the ranks' options or param groups, as the DesyncError's text;
    None where every rank sent the same."""
    for q, d in enumerate(decoded):
        if d["options"] != decoded[0]["options"]:
            key = next(k for k in sorted(set(d["options"]) | set(decoded[0]["options"]))
                       if d["options"].get(k) != decoded[0]["options"].get(k))
            return (f"tide.fsdp.enable: the ranks of process group {list(ranks)} disagree on enable's "
                    f"{key}: {decoded[0]['options'].get(key)!r} on group rank 0 (global {ranks[0]}) vs "
                    f"{d['options'].get(key)!r} on group rank {q} (global {ranks[q]}); every rank must "
                    "pass the same options")
    lists = [d["groups"] for d in decoded]
    for i in range(max(len(x) for x in lists)):
        at = [x[i] if i < len(x) else None for x in lists]
        other = next((q for q in range(len(at)) if at[q] != at[0]), None)
        if other is not None:
            return (f"tide.fsdp.enable: the ranks of process group {list(ranks)} disagree on param group "
                    f"{i}: {_difference(at[0], at[other])} on group rank 0 (global {ranks[0]}) vs group "
                    f"rank {other} (global {ranks[other]}); every rank must call enable on the same "
                    "model, sharded the same way")
    return None


def _difference(a: list | None, b: list | None) -> str:
    """The first thing that differs between two param-group identities [path, params, decision]."""
    if a is None or b is None:
        present = a if a is not None else b
        return (f"{present[0]!r} exists on one rank only ("
                f"{'fewer' if a is None else 'more'} param groups)")
    path_a, params_a, decision_a = a
    path_b, params_b, decision_b = b
    if path_a != path_b:
        return f"module {path_a!r} vs {path_b!r}"
    for k in range(max(len(params_a), len(params_b))):
        pa = params_a[k] if k < len(params_a) else None
        pb = params_b[k] if k < len(params_b) else None
        if pa != pb:
            return f"module {path_a!r} param {k}: {_param(pa)} vs {_param(pb)}"
    return f"module {path_a!r}: TIDE {_decision(decision_a)} vs {_decision(decision_b)}"


def _param(p: list | None) -> str:
    if p is None:
        return "none"
    return (f"{p[0]} {p[1]} {p[2]}/{p[3]}" + (f" sharded on dim {p[4]}" if p[4] else "")
            + (f" with all-gather inputs {p[5]} (dtype, numel)" if p[5] else ""))


def _decision(reason: str) -> str:
    return f"falls back ({reason})" if reason else "handles it"
