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


def captured_lease_rank(rank: int) -> dict:
    pool = WindowPool(dist.group.WORLD, WINDOW_BYTES, 30_000, "test/window/captured", torch.device("cpu"),
                      _tide.Topology.single_node(2), "host")
    counts = Counts()
    a, b = WindowLease(pool, counts), WindowLease(pool, counts)
    storage = _fsdp2.UnshardedStorage([torch.zeros(4)])
    captured = a.acquire_for_all_gather(0, "layers.0")
    a.captured_path = "layers.0"  # as the bucket marks it once the all-gather was captured
    captured.live_graphs = lambda: 1  # as the executor reports a graph alive that captured it
    a.vacate(storage)
    b.acquire_for_all_gather(0, "layers.1")  # takes a's vacated window
    try:
        a.acquire_for_all_gather(0, "layers.0")  # a new window, which a's address would map
    except RuntimeError as e:
        seen = {"error": str(e), "mapped_kept": a.mapped is captured, "new_window_free": len(pool.free) == 1,
                "holds": a.window}
    else:
        return {"error": None}
    captured.live_graphs = lambda: 0  # the graph was destroyed: the address may map another window
    seen["after_graph"] = a.acquire_for_all_gather(0, "layers.0") is not captured and a.captured_path is None
    return seen


def test_a_captured_group_never_maps_another_window():
    """A graph's replays write the window its capture mapped at the group's address: while the
    graph lives, a later run-by-run all-gather that would map another one there raises on every
    rank, naming the group, and gives the window it took back to the pool; once it is destroyed,
    the address maps another window."""
    for rank, seen in enumerate(threaded_world.run(2, captured_lease_rank)):
        assert seen["error"] and seen["error"].startswith(
            "tide.fsdp: param group layers.0: this all-gather, run by run after a CUDA graph captured "
            "the group"), (rank, seen)
        assert "would map another window at the group's address" in seen["error"], (rank, seen)
        assert seen["mapped_kept"] and seen["new_window_free"] and seen["holds"] is None, (rank, seen)
        assert seen["after_graph"], (rank, seen)


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
