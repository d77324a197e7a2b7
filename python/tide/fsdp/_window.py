"""A bucket's pooled windows through one step, end to end: acquired and mapped at the bucket's fixed
address for the all-gather, vacated where FSDP2 frees the unsharded params, taken again as the
reduce-scatter's staging window (or another window staged in), released to the pool."""

from __future__ import annotations

import weakref

import torch

from .. import _tide
from . import _fsdp2
from ._capture import capture_id, not_capturable
from ._pool import PooledWindow, WindowPool


class WindowLease:
    """The windows one bucket holds. Every rank calls these at the same points of FSDP2's schedule,
    so every rank takes the same windows in the same order.

    The all-gather's window is held (`window` set, not `vacated`: the params are built on it),
    vacated (the params were freed: the window waits among the pool's pending windows, and this
    lease takes it back unless the pool's next acquire returned it to the free list first), or none."""

    def __init__(self, pool: WindowPool, counts) -> None:
        self.pool, self.counts = pool, counts  # counts: _bucket.Counts (remaps)
        self.cuda = pool.device.type == "cuda"
        # The bucket's fixed address: the params' views point here, whichever window is mapped.
        self.range = (_tide.CudaAddressRange if self.cuda else _tide.HostAddressRange)(pool.window_bytes)
        self.window: PooledWindow | None = None  # the all-gather's window
        self.vacated = False
        self.mapped: PooledWindow | None = None  # the window mapped at the fixed address (kept after release)
        self.freed: torch.cuda.Event | None = None  # CUDA: on the compute stream after the params' last use
        self.freed_capture = 0  # the capture `freed` was recorded in (0: none)
        self.staging_pool: WindowPool | None = None  # where the reduce-scatter's window returns
        # The captures that recorded this lease's programs, kept as long as their records on the
        # windows (PooledWindow.captures): while one lives, the graph's replays write the window
        # mapped here, so the address must keep mapping it.
        self.captures: set[int] = set()
        # The bucket's Bucket.reshard_stale, weakly (weakref.WeakMethod): gives the window back
        # where FSDP2 keeps the group unsharded since before a capture, idle (WindowPool._reclaim_stale).
        self.reshard_stale = None
        pool.leases.append(weakref.ref(self))

    def record(self, window: PooledWindow, capture: int) -> None:
        """Capture `capture` recorded a program of this lease on `window`: the window is the
        graph's, and this lease's, while the graph lives."""
        window.record(capture, self)
        self.captures.add(capture)
        order = self.pool.root.capture_order
        order.setdefault(capture, len(order))

    def forget_capture(self, capture: int) -> None:
        self.captures.discard(capture)

    def _reclaim(self) -> bool:
        """Whether this lease still has its window: held, or vacated and taken back from the pool's
        pending windows. Forgets a vacated window the pool has released since."""
        if self.window is None or not self.vacated:
            return self.window is not None
        if self.pool.reclaim(self.window, self):
            self.vacated = False
            return True
        self.window, self.vacated = None, False
        return False

    def acquire_for_all_gather(self, capture: int, path: str) -> PooledWindow:
        """The window the all-gather writes, mapped at the fixed address: the one this lease still
        has, else a pool window (preferring the one mapped here already: no remap). During a CUDA
        graph capture (`capture`, for group `path`) a remap is refused."""
        if self._reclaim():
            return self.window
        window = self.pool.acquire(prefer=self.mapped, capture=capture, path=path, lease=self)
        try:
            if capture and self.mapped is not window:
                raise not_capturable(path, "its all-gather must map another pooled window at the "
                                     "group's address (the host remaps it once the params' last "
                                     "readers are done), as every step of this model does: its "
                                     "groups share fewer windows than they hold at once",
                                     "capture a model whose groups keep their windows (the pool "
                                     "makes one per group held at once), or run uncaptured")
            self._map(window, path)
        except BaseException:  # not mapped: not this lease's, so back to the pool
            self.pool.release(window)
            raise
        self.window = window
        return window

    def _map(self, window: PooledWindow, path: str) -> None:
        if self.mapped is window:
            # Still mapped here since this lease last held it (windows map at several addresses
            # at once): no remap, so no host wait; the window's `ready` event orders its reuse.
            return
        if self.mapped is not None and self in self.mapped.owners():
            # A graph's replays write the window mapped here, and its parameters read this
            # address: mapping another window would hand them stale bytes. Unless the graphs
            # are gone, which CUDA reports late: wait for that (every rank takes this path).
            self.pool.forget_ended_captures(wait=True)
        if self.mapped is not None and self in self.mapped.owners():
            raise RuntimeError(
                f"tide.fsdp: param group {path}: this all-gather, run by run after a "
                "CUDA graph captured the group, would map another window at the group's address, "
                "which the graph's replays do not follow: more groups are unsharded at once than "
                "the captured step holds (unshard(), reshard_after_forward=False between replays); "
                "reshard() the others first, or destroy the graph (then this group's address is "
                "free to map another window)")
        self.counts.remaps += 1
        self.mapped = None  # until the new mapping is in place
        if self.cuda and self.freed is not None:
            # The host remaps the range: the params' last readers (kernels on the compute stream,
            # recorded when FSDP2 freed them) must be done with the old mapping. An event recorded
            # in a capture is a graph's node, which the host cannot wait for: the device then.
            if self.freed_capture:
                torch.cuda.synchronize(self.pool.device)
            else:
                self.freed.synchronize()
        self.range.map_data_of(window.shared)
        self.mapped = window

    def vacate(self, storage: _fsdp2.UnshardedStorage) -> bool:
        """Where FSDP2 frees the unsharded params (once per param; the first call acts): stock frees
        the outputs' storage here, and from here on no view of them reads the window, which the
        reduce-scatter stages in or another bucket refills after the pool's next acquire. False
        when the params were not built on this lease's window (an all-gather ran past TIDE)."""
        if self.window is None:
            return False
        if self.vacated:
            return self.pool.is_pending(self.window, self)
        storage.release()
        if self.cuda:  # the params' last readers were enqueued on the current stream
            compute = torch.cuda.current_stream(self.pool.device)
            self.freed, self.freed_capture = compute.record_event(), capture_id(compute)
            self.window.set_ready(self.freed, self.freed_capture)
        self.vacated = True
        self.pool.release_later(self.window, self)
        return True

    def staging_window(self, window_bytes: int, capture: int, path: str) -> PooledWindow:
        """The window the reduce-scatter stages in (`window_bytes` its program's): the one the
        all-gather vacated (Slot-Reuse), else a pool window (the params are still in use:
        reshard_after_backward=False), or a wider window (the pool's of_size) when the program
        outgrows the pool's windows. `release_staging` returns it."""
        if window_bytes > self.pool.window_bytes:
            self.staging_pool = self.pool.of_size(window_bytes)
            return self.staging_pool.acquire(capture=capture, path=path, lease=self)
        self.staging_pool = self.pool
        if self.vacated and self._reclaim():
            window, self.window, self.vacated = self.window, None, False
            return window
        return self.pool.acquire(capture=capture, path=path, lease=self)

    def release_staging(self, window: PooledWindow) -> None:
        self.staging_pool.release(window)
        self.staging_pool = None
