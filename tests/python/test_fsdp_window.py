"""A bucket's window lease over a real pool (host windows, ranks as threads): the all-gather keeps
or takes back its own window without a remap, a window vacated and then handed to another bucket by
the pool is no longer the first bucket's (neither to gather into again nor to stage in), and the
reduce-scatter stages in the vacated window (Slot-Reuse) or a pool of wider windows; during a CUDA
graph capture (a capture id, no GPU needed) the pool makes no window and no group's address remaps."""

from __future__ import annotations

import torch
import torch.distributed as dist

import threaded_world
from tide import _tide
from tide.fsdp import _fsdp2
from tide.fsdp._bucket import Counts
from tide.fsdp._pool import WindowPool
from tide.fsdp._window import WindowLease

WINDOW_BYTES = 4096


def lease_rank(rank: int) -> dict:
    group = dist.group.WORLD
    pool = WindowPool(group, WINDOW_BYTES, 30_000, "test/window/lease", torch.device("cpu"),
                      _tide.Topology.single_node(2), "host")
    counts = Counts()
    a, b = WindowLease(pool, counts), WindowLease(pool, counts)
    storage = _fsdp2.UnshardedStorage([torch.zeros(4)])
    seen = {}

    first = a.acquire_for_all_gather(0, "b")
    assert a.vacate(storage) and a.vacate(storage)  # once per param: the first call acts
    assert pool.is_pending(first, a)
    seen["regather_same"] = a.acquire_for_all_gather(0, "b") is first  # taken back before anyone else
    seen["remaps_after_regather"] = counts.remaps

    a.vacate(storage)
    seen["b_takes_vacated"] = b.acquire_for_all_gather(0, "b") is first  # the pool released a's window
    seen["a_vacate_after_release"] = a.vacate(storage)  # a's params are no longer on it
    b.vacate(storage)
    staged = a.staging_window(WINDOW_BYTES, 0, "b")  # b's pending window is not a's to reuse as its own
    seen["a_staging_not_reclaimed"] = a.window is None and staged is first and not pool.pending
    a.release_staging(staged)

    second = b.acquire_for_all_gather(0, "b")  # b's vacated window went to the free list: mapped already
    b.vacate(storage)
    seen["b_slot_reuse"] = b.staging_window(WINDOW_BYTES, 0, "b") is second and not pool.pending
    b.release_staging(second)
    wide = a.staging_window(2 * WINDOW_BYTES, 0, "b")
    seen["wide"] = wide in pool.sized[2 * WINDOW_BYTES].windows and wide not in pool.windows
    a.release_staging(wide)
    seen["windows"], seen["remaps"] = len(pool.windows), counts.remaps
    return seen


def test_window_lease_takes_the_same_windows_on_every_rank():
    results = threaded_world.run(2, lease_rank)
    assert results[0] == results[1], results
    seen = results[0]
    assert seen == {"regather_same": True, "remaps_after_regather": 1, "b_takes_vacated": True,
                    "a_vacate_after_release": False, "a_staging_not_reclaimed": True,
                    "b_slot_reuse": True, "wide": True, "windows": 1, "remaps": 2}, seen


def _graphs_alive(window, captures) -> None:
    """What this rank's CUDA reports alive for `window`: `captures` (the host windows have none)."""
    window.live_captures = lambda: set(captures)


def captured_lease_rank(rank: int) -> dict:
    pool = WindowPool(dist.group.WORLD, WINDOW_BYTES, 30_000, "test/window/captured", torch.device("cpu"),
                      _tide.Topology.single_node(2), "host")
    counts = Counts()
    a, b, c = WindowLease(pool, counts), WindowLease(pool, counts), WindowLease(pool, counts)
    storage = _fsdp2.UnshardedStorage([torch.zeros(4)])
    captured = a.acquire_for_all_gather(0, "layers.0")
    a.record(captured, 7)  # as the bucket records a captured all-gather
    c.record(captured, 7)  # a second group of the captured step shares the window
    _graphs_alive(captured, {7})
    a.vacate(storage)
    seen = {"b_own_window": b.acquire_for_all_gather(0, "layers.1") is not captured,
            "owned_kept_free": captured in pool.free}
    seen["c_takes_it"] = c.acquire_for_all_gather(0, "layers.2") is captured  # an owner
    b.vacate(storage)  # b's window is free: a, whose window c holds, would remap onto it
    try:
        a.acquire_for_all_gather(0, "layers.0")
    except RuntimeError as e:
        seen.update(error=str(e), mapped_kept=a.mapped is captured, holds=a.window)
    else:
        return {"error": None}
    _graphs_alive(captured, set())  # the graph was destroyed: the address may map another window
    a_window = a.acquire_for_all_gather(0, "layers.0")
    seen["after_graph"] = not a.captures and not captured.captures and a_window is not captured \
        and a.mapped is a_window
    return seen


def test_a_captured_window_belongs_to_its_graphs_groups():
    """While a graph lives, the window it captured goes only to the groups whose programs it
    recorded: another group gets a window of its own (no refusal), an owner takes it, and an owner
    whose address would map another window raises on every rank, naming the group, and gives the
    window it took back to the pool; once the graph is gone, the records go and the address maps
    another window."""
    for rank, seen in enumerate(threaded_world.run(2, captured_lease_rank)):
        assert seen["error"] and seen["error"].startswith(
            "tide.fsdp: param group layers.0: this all-gather, run by run after a CUDA graph captured "
            "the group"), (rank, seen)
        assert "would map another window at the group's address" in seen["error"], (rank, seen)
        assert seen["b_own_window"] and seen["owned_kept_free"] and seen["c_takes_it"], (rank, seen)
        assert seen["mapped_kept"] and seen["holds"] is None, (rank, seen)
        assert seen["after_graph"], (rank, seen)


def ended_captures_rank(rank: int) -> dict:
    """CUDA reports a destroyed graph late and per rank: a record goes only once every rank's
    reports it gone; within a capture its own groups share its windows, another capture's do not."""
    pool = WindowPool(dist.group.WORLD, WINDOW_BYTES, 30_000, "test/window/ended", torch.device("cpu"),
                      _tide.Topology.single_node(2), "host")
    a, b, d = (WindowLease(pool, Counts()) for _ in range(3))
    storage = _fsdp2.UnshardedStorage([torch.zeros(4)])
    window = a.acquire_for_all_gather(0, "a")
    a.vacate(storage)
    pool.release_pending()
    a.record(window, 9)  # capture 9 in progress: its groups share the pool's windows
    _graphs_alive(window, {9})
    seen = {"same_capture_shares": window.available_to(b, 9), "other_capture": window.available_to(d, 11),
            "uncaptured_other": window.available_to(d, 0), "owner": window.available_to(a, 0)}
    _graphs_alive(window, {9} if rank == 1 else set())  # rank 1's report is late
    pool.forget_ended_captures()
    seen["kept_while_one_rank_reports_it"] = 9 in window.captures and a.captures == {9}
    _graphs_alive(window, set())
    pool.forget_ended_captures()
    seen["gone_once_all_report_it"] = not window.captures and not a.captures and window.available_to(d, 0)
    return seen


def test_records_of_a_capture_go_when_every_rank_reports_its_graph_gone():
    for rank, seen in enumerate(threaded_world.run(2, ended_captures_rank)):
        assert seen == {"same_capture_shares": True, "other_capture": False, "uncaptured_other": False,
                        "owner": True, "kept_while_one_rank_reports_it": True,
                        "gone_once_all_report_it": True}, (rank, seen)


def capture_refusals_rank(rank: int) -> dict:
    """What a capture (capture id 7 here, as _capture.capture_id reports one) may not ask of the
    pool: a window no rank has yet, or a remap of a group's fixed address."""
    pool = WindowPool(dist.group.WORLD, WINDOW_BYTES, 30_000, "test/window/capture", torch.device("cpu"),
                      _tide.Topology.single_node(2), "host")
    counts = Counts()
    a = WindowLease(pool, counts)
    storage = _fsdp2.UnshardedStorage([torch.zeros(4)])
    seen = {}
    try:
        a.acquire_for_all_gather(7, "layers.0")  # the pool has no window yet: all ranks would create one
    except RuntimeError as e:
        seen["new_window"] = str(e)
    seen["no_window_made"] = not pool.windows and a.window is None and a.mapped is None

    first = a.acquire_for_all_gather(0, "layers.0")  # run by run: made and mapped at a's address
    a.vacate(storage)
    pool.release_pending()
    held = pool.acquire()  # another bucket holds a's vacated window...
    second = pool.acquire()  # ...and a second window is made, run by run, and left free
    pool.release(second)
    assert held is first and pool.free == [second]
    try:
        a.acquire_for_all_gather(7, "layers.0")
    except RuntimeError as e:
        seen["remap"] = str(e)
    # `second` is back on the free list; a's address still maps `first`, which the graph would write
    seen["remap_returned"] = pool.free == [second] and a.window is None and a.mapped is first
    seen["remaps"] = counts.remaps
    try:
        a.staging_window(2 * WINDOW_BYTES, 7, "layers.0")  # a wider pool, empty: a new window
    except RuntimeError as e:
        seen["wide_staging"] = str(e)
    seen["no_wide_window_made"] = not a.staging_pool.windows
    return seen


def test_a_capture_refuses_new_windows_and_remaps_naming_the_group():
    """During a capture the pool never creates a window (all ranks create one together, on the host,
    which no replay repeats) and a group's address never maps another window: each raises on every
    rank, names the group and says what to do instead, and leaves the pool as it was."""
    for rank, seen in enumerate(threaded_world.run(2, capture_refusals_rank)):
        assert seen["new_window"] == (
            "tide.fsdp: param group layers.0: it needs a new window while the step is captured (all ranks "
            "create it together, on the host), which a CUDA graph cannot replay; run one step uncaptured "
            "first, as torchtitan's warm-up steps do"), (rank, seen)
        assert seen["no_window_made"], (rank, seen)
        assert seen["remap"].startswith("tide.fsdp: param group layers.0: its all-gather must map another "
                                        "pooled window at the group's address"), (rank, seen)
        assert "capture a model whose groups keep their windows" in seen["remap"], (rank, seen)
        assert seen["remap_returned"] and seen["remaps"] == 1, (rank, seen)  # a's first map only
        assert seen["wide_staging"].startswith("tide.fsdp: param group layers.0: it needs a new window "
                                               "while the step is captured"), (rank, seen)
        assert seen["no_wide_window_made"], (rank, seen)
