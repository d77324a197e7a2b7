"""Windows pooled per process group's ranks and size class, each with the executor that runs
programs on it."""

from __future__ import annotations

import json
import time
import weakref

import torch
import torch.distributed as dist

from .. import _tide
from ..distributed import store_bootstrap
from ._agreement import exchange
from ._capture import not_capturable

# How long a wait for CUDA's report that graphs are gone lasts (CUDA reports a destroyed graph
# from a thread of its own, once its last replays are done): tide.fsdp.disable, and a captured
# group's remap, wait this long before they refuse.
GRAPH_END_WAIT_S = 2.0


class PooledWindow:
    """One window of a pool and its executor. On CUDA, `ready` is the event after which the window
    may be written again (its last reader's stream recorded it), and `ready_capture` the CUDA graph
    capture it was recorded in (0: none).

    `captures`: per CUDA graph capture that recorded programs on this window, the leases
    (_window.WindowLease) whose programs they are. While one of those graphs lives, its replays
    write the window, which therefore belongs to those leases (docs/DESIGN.md section 4): the pool
    hands it to no other. A record goes only when every rank's CUDA reported its graph gone
    (WindowPool.forget_ended_captures), so every rank decides from the same records."""

    def __init__(self, window, executor) -> None:
        self.shared, self.executor = window, executor
        self.ready = None  # torch.cuda.Event or None
        self.ready_capture = 0
        self.captures: dict[int, weakref.WeakSet] = {}  # capture id -> leases
        # CUDA: each program this window runs, prepared once (_tide.PreparedProgram): a run with the
        # pointers of the one before skips the executor's checks and lowering, a pass per param.
        # Keyed by the program object, which the dict keeps alive.
        self.prepared: dict = {}

    def run(self, program, inputs: list[int], outputs: list[int] = (), scales: list[int] = ()) -> None:
        """Runs (CPU) or enqueues (CUDA) `program` on this window's executor. `scales`: per param
        the address of the fp32 scale of its e4m3 cast, 0 for none (empty: no such param)."""
        if not hasattr(self.executor, "prepare"):  # the host executor: nothing to keep
            self.executor.run(program, inputs, outputs, scales)
            return
        prepared = self.prepared.get(program)
        if prepared is None:
            prepared = self.prepared[program] = self.executor.prepare(program)
        self.executor.run(prepared, inputs, outputs, scales)

    def live_graphs(self) -> int:
        """CUDA graphs alive now that replay collectives on this window (0 on CPU): CUDA tells
        the executor when one is destroyed (shortly after, from a thread of its own)."""
        return self.executor.captured_state()[0] if hasattr(self.executor, "captured_state") else 0

    def live_captures(self) -> set[int]:
        """The captures whose graphs this rank's CUDA has not yet reported gone (none on CPU)."""
        return set(self.executor.live_captures()) if hasattr(self.executor, "live_captures") else set()

    def record(self, capture: int, lease: object) -> None:
        """Capture `capture` recorded a program of `lease` on this window. Held weakly: the lease
        holds its pool, which holds this window, and a cycle would leave the windows to the
        garbage collector, whose next run may come while another graph is being captured on this
        thread, where a window's teardown (a device synchronize) invalidates that capture."""
        self.captures.setdefault(capture, weakref.WeakSet()).add(lease)

    def owners(self, capture: int = 0) -> set:
        """The leases this window belongs to, by captures other than `capture` (the one in
        progress, whose groups share the pool's windows as every step does); empty: any lease's."""
        owners: set = set()
        for c, leases in self.captures.items():
            if c != capture:
                owners |= set(leases)
        return owners

    def available_to(self, lease: object, capture: int) -> bool:
        owners = self.owners(capture) if self.captures else ()
        return not owners or lease in owners

    def set_ready(self, event: torch.cuda.Event, capture: int) -> None:
        self.ready, self.ready_capture = event, capture

    def use_on(self, stream: torch.cuda.Stream, capture: int) -> None:
        """CUDA: the next program on this window runs on `stream` (in CUDA graph capture `capture`,
        0: none), after the window's last use. A last use recorded outside that capture is not
        waited for: CUDA refuses a captured wait on other work, and there is none to wait for. A
        capture starts after a synchronize (torch.cuda.graph's), a replay runs after what its
        stream was given before it, and a run after a replay runs after it on FSDP2's streams
        (each waits for the compute stream that launched the replay)."""
        if self.ready is not None and self.ready_capture == capture:
            stream.wait_event(self.ready)
        self.executor.set_stream(stream.cuda_stream)


class WindowPool:
    """Windows of one size shared by every bucket of a process group. Every rank acquires and
    releases at the same points of FSDP2's schedule, so pool decisions agree across ranks and a new
    window (a collective) is created by all ranks together. On CUDA the windows are VMM windows
    (their data can be mapped at each bucket's fixed address)."""

    def __init__(self, group: dist.ProcessGroup, window_bytes: int, timeout_ms: int | None, name: str,
                 device: torch.device, topology: _tide.Topology, transport: str | None) -> None:
        self.group, self.window_bytes, self.timeout_ms, self.device = group, window_bytes, timeout_ms, device
        self.topology, self.transport = topology, transport  # transport: see _placement.transport_for
        self.name = name
        self.bootstrap = store_bootstrap(group, name, timeout_ms)
        self.sized: dict = {}  # window bytes -> WindowPool (of_size)
        self.free: list[PooledWindow] = []
        self.windows: list[PooledWindow] = []
        # Vacated windows (their params were freed) -> the lease that vacated them: free at the
        # next acquire, until then their lease may take them back (_window.WindowLease).
        self.pending: dict[PooledWindow, object] = {}
        # The leases of this pool's buckets, in the order they were made (the same on every rank),
        # held weakly (PooledWindow.record says why).
        self.leases: list[weakref.ref] = []
        self.stats_enabled = False
        # The pool whose of_size made this one (None: itself), held weakly: windows must go by
        # reference counting alone (PooledWindow.record says why).
        self._root: weakref.ref | None = None
        # The root's: capture id -> its place in the order its leases' programs were first
        # recorded (WindowLease.record), the same on every rank.
        self.capture_order: dict[int, int] = {}

    def acquire(self, prefer: PooledWindow | None = None, capture: int = 0, path: str = "",
                lease: object = None) -> PooledWindow:
        """A free window that belongs to no live graph but `lease`'s (PooledWindow.owners):
        `prefer` when it is one (the window a bucket's fixed address maps already, so the bucket
        need not remap it), else the last released, else a new one. Every rank has the same free
        list, records and preference, so every rank takes the same window. A new one is refused
        during a CUDA graph capture (`capture`, for group `path`)."""
        self.release_pending()
        if capture and prefer is not None and prefer not in self.free:
            # A capture maps no other window at the group's address: the one mapped there, back
            # from a group that holds it since before the capture.
            self._reclaim_stale(lease, capture, prefer)
        if prefer is not None and prefer in self.free and prefer.available_to(lease, capture):
            self.free.remove(prefer)
            return prefer
        window = self._last_free(lease, capture)
        if window is None and any(w.captures for w in self.free):
            # Only windows of live graphs are free: ask every rank's CUDA whether those are gone
            # before making another window.
            self.forget_ended_captures()
            window = self._last_free(lease, capture)
        if window is None and capture:
            window = self._reclaim_stale(lease, capture)
        if window is not None:
            self.free.remove(window)
            return window
        if capture:
            raise not_capturable(path, "it needs a new window while the step is captured (all "
                                 "ranks create it together, on the host)",
                                 "run one step uncaptured first, as torchtitan's warm-up steps do")
        if self.device.type == "cuda":
            # IPC between nodes: every rank's window is mapped (all on this host). NCCL: a
            # communicator per window, since windows can have an all-gather and a reduce-scatter
            # in flight at once and NCCL needs one order of operations per communicator.
            comm = _tide.NcclComm.create(self.bootstrap) if self.transport == "nccl" else None
            scope = _tide.CudaWindowScope.host if self.transport == "ipc" else _tide.CudaWindowScope.node
            window = _tide.CudaWindow.create(self.bootstrap, self.window_bytes, self.topology,
                                             _tide.CudaMemory.vmm, scope)
            executor = _tide.CudaExecutor(window, torch.cuda.current_stream(self.device).cuda_stream,
                                          self.timeout_ms, comm)
            if self.stats_enabled:
                executor.enable_stats(True)
        else:
            window = _tide.HostWindow.create(self.bootstrap, self.window_bytes)
            executor = _tide.HostExecutor(window, self.timeout_ms)
        pooled = PooledWindow(window, executor)
        self.windows.append(pooled)
        return pooled

    @property
    def root(self) -> "WindowPool":
        return self._root() if self._root is not None else self

    def _reclaim_stale(self, lease: object, capture: int, wanted: PooledWindow | None = None) -> PooledWindow | None:
        """During capture `capture`: windows held by groups that FSDP2 keeps unsharded since
        before the capture, idle (an evaluation's, reshard_after_forward=False between steps,
        unshard()), go back to the pool: the one holding `wanted`, else (no window free) one
        after another until a window is free for `lease`. Their parameters are not this
        capture's (Bucket.before_unshard reshards such a group where the capture uses it), and
        the step the capture records needs the windows it needed uncaptured. Every rank holds the
        same leases in the same order and reclaims alike."""
        for ref in self.leases:
            other = ref()
            if other is None or other is lease or other.reshard_stale is None or other.window is None \
                    or other.vacated or (wanted is not None and other.window is not wanted):
                continue
            reshard = other.reshard_stale()
            if reshard is None or not reshard(capture):
                continue
            self.release_pending()
            window = wanted if wanted is not None and wanted in self.free else self._last_free(lease, capture)
            if window is not None:
                return window
        return None

    def _last_free(self, lease: object, capture: int) -> PooledWindow | None:
        return next((w for w in reversed(self.free) if w.available_to(lease, capture)), None)

    def forget_ended_captures(self, wait: bool = False) -> None:
        """Drops the records (PooledWindow.captures) of captures whose graphs every rank's CUDA
        reported gone: ranks agree through the store, as CUDA reports a destroyed graph late and
        not at the same moment on every rank. Captures are named by the order they were first
        recorded in (capture_order: capture ids are per process). `wait`: first
        wait for this rank's work and up to GRAPH_END_WAIT_S for CUDA's reports (a graph the
        user has just destroyed)."""
        root = self.root  # a capture's records span the bucket pool and its wider pools
        windows = [w for w in root.all_windows() if w.captures]
        order = root.capture_order
        if wait and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            deadline = time.monotonic() + GRAPH_END_WAIT_S
            while any(w.live_captures() & w.captures.keys() for w in windows) and time.monotonic() < deadline:
                time.sleep(0.001)
        live = set().union(*(w.live_captures() for w in windows)) if windows else set()
        mine = sorted(order[c] for c in order if c not in live)
        theirs = exchange(root.group, f"{root.name}/ended-captures", json.dumps(mine),
                          self.timeout_ms or _tide.default_timeout_ms())
        ended = set.intersection(*(set(json.loads(t)) for t in theirs))
        for w in windows:
            for c in [c for c in w.captures if order[c] in ended]:
                for lease in w.captures.pop(c):
                    lease.forget_capture(c)

    def release(self, pooled: PooledWindow) -> None:
        self.free.append(pooled)

    def release_later(self, pooled: PooledWindow, lease: object) -> None:
        """`pooled` becomes free at the next acquire; until then `lease` may reclaim it."""
        self.pending[pooled] = lease

    def is_pending(self, pooled: PooledWindow, lease: object) -> bool:
        return self.pending.get(pooled) is lease

    def reclaim(self, pooled: PooledWindow, lease: object) -> bool:
        """Takes `pooled` back for `lease` if it is still pending for it."""
        if self.pending.get(pooled) is not lease:
            return False
        del self.pending[pooled]
        return True

    def release_pending(self) -> None:
        """Every pending window to the free list, in the order they were vacated."""
        self.free.extend(self.pending)
        self.pending.clear()


    def of_size(self, window_bytes: int) -> "WindowPool":
        """The pool of `window_bytes` windows, for programs sized otherwise than this pool's buckets:
        reduce-scatters whose gradients do not fit a window (gradient accumulation keeps bf16
        params' unsharded gradients in an fp32 reduce dtype: twice the window), and float8 amax
        exchanges (_float8.AmaxExchange: a few bytes). Same decision, same name on every rank:
        created together."""
        pool = self.sized.get(window_bytes)
        if pool is None:
            pool = WindowPool(self.group, window_bytes, self.timeout_ms, f"{self.name}/size/{window_bytes}",
                              self.device, self.topology, self.transport)
            pool.stats_enabled = self.stats_enabled
            pool._root = weakref.ref(self.root)
            self.sized[window_bytes] = pool
        return pool

    def live_graphs(self) -> int:
        """CUDA graphs alive now that replay collectives on this pool's windows (0 on CPU)."""
        return sum(w.live_graphs() for w in self.all_windows())

    def all_windows(self) -> list[PooledWindow]:
        return self.windows + [w for pool in self.sized.values() for w in pool.all_windows()]

    def total_bytes(self) -> int:
        return len(self.windows) * self.window_bytes + sum(p.total_bytes() for p in self.sized.values())

SIZE_CLASS_RATIO = 1.25


def size_classes(buckets: list) -> list[list]:
    """Buckets grouped into pools of similar window size: each pool's windows are as large as its
    largest bucket, so one pool for a root (embedding + head) and the layers would size every
    layer's window for the root. A class holds sizes within SIZE_CLASS_RATIO of its smallest.
    Deterministic in the layouts, hence the same on every rank."""
    classes: list = []
    for b in sorted(buckets, key=lambda b: (b.window_bytes, b.id)):
        if classes and b.window_bytes <= SIZE_CLASS_RATIO * classes[-1][0].window_bytes:
            classes[-1].append(b)
        else:
            classes.append([b])
    return classes
