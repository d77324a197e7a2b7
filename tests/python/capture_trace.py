"""What a CUDA graph capture leaves unjoined, and who put it there (a diagnostic for captured
training; TIDE_CAPTURE_TRACE=1 installs it in tests/python/torchtitan_shared_gpu.py).

install() wraps the Python-side stream operations (Stream.wait_stream / wait_event /
record_event, Event.record / wait, entering torch.cuda.stream) and logs those made while a
torch.cuda.graph capture is open, each with the FSDP2 / TIDE / torchtitan frames that made it.
Before each capture ends it asks CUDA (driver API, through ctypes) for the capture's graph: every
leaf node that is not among the origin stream's current dependencies is work the origin never
joined (what cudaStreamEndCapture refuses with cudaErrorStreamCaptureUnjoined); each is printed
with its type, its kernel's name, and the streams whose pending work it is.
"""

from __future__ import annotations

import ctypes
import os
import sys
import traceback

import torch

_lib = None
_log: list[str] = []
_streams: dict[int, str] = {}
_open = [0]
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_sem_signal", 9: "ext_sem_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}


def _cuda():
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3]
              if any(k in f.filename for k in ("fsdp", "tide", "torchtitan", "autograd"))]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[::-1][:4])


def _name(stream) -> str:
    handle = stream.cuda_stream
    if handle not in _streams:
        _streams[handle] = f"s{len(_streams)}"
    return f"{_streams[handle]}(0x{handle:x})"


def _capture_info(handle: int):
    """(status, graph, [dependency nodes]) of the stream `handle`."""
    lib = _cuda()
    status, cid, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
    deps, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
    edges = ctypes.c_void_p()
    if hasattr(lib, "cuStreamGetCaptureInfo_v3"):
        rc = lib.cuStreamGetCaptureInfo_v3(ctypes.c_void_p(handle), ctypes.byref(status), ctypes.byref(cid),
                                           ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(edges),
                                           ctypes.byref(n))
    else:
        rc = lib.cuStreamGetCaptureInfo_v2(ctypes.c_void_p(handle), ctypes.byref(status), ctypes.byref(cid),
                                           ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(n))
    if rc != 0:
        return -rc, None, []
    return status.value, graph.value, [deps[i] for i in range(n.value)]


def _kernel_name(node) -> str:
    lib = _cuda()
    params = (ctypes.c_void_p * 32)()
    if lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), params) != 0:
        return "?"
    name = ctypes.c_char_p()
    if params[0] and lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params[0])) == 0:
        return name.value.decode()[:120]
    return "?"


def unjoined(origin_handle: int) -> list[str]:
    """The capture's leaf nodes the origin stream has not joined, described."""
    lib = _cuda()
    status, graph, origin_deps = _capture_info(origin_handle)
    if status != 1 or not graph:
        return [f"origin stream not capturing (status {status})"]
    n = ctypes.c_size_t()
    lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * n.value)()
    lib.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n))
    e = ctypes.c_size_t()
    lib.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(e))
    src, dst = (ctypes.c_void_p * max(e.value, 1))(), (ctypes.c_void_p * max(e.value, 1))()
    lib.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, None, ctypes.byref(e))
    has_out = {src[i] for i in range(e.value)}
    joined = set(origin_deps)
    pending = {}
    for handle, label in _streams.items():
        st, g, deps = _capture_info(handle)
        if st == 1 and g == graph:
            for d in deps:
                pending.setdefault(d, []).append(label)
    out = []
    for i in range(n.value):
        node = nodes[i]
        if node in has_out or node in joined:
            continue
        t = ctypes.c_int()
        lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
        kind = NODE_TYPES.get(t.value, str(t.value))
        what = f"{kind} {_kernel_name(node)}" if kind == "kernel" else kind
        out.append(f"leaf {node:#x}: {what}; pending on streams {pending.get(node, ['(none tracked)'])}")
    return out


def _wrap(cls, name, describe):
    original = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        if _open[0]:
            try:
                _log.append(f"{describe(self, *args)} @ {_where()}")
            except Exception as e:  # a diagnostic never breaks the run
                _log.append(f"{name}: {e!r}")
        return original(self, *args, **kwargs)

    setattr(cls, name, wrapped)


def install() -> None:
    S, E = torch.cuda.Stream, torch.cuda.Event
    _wrap(S, "wait_stream", lambda s, o: f"{_name(s)}.wait_stream({_name(o)})")
    _wrap(S, "wait_event", lambda s, e: f"{_name(s)}.wait_event(ev{id(e) % 10000})")
    _wrap(S, "record_event", lambda s, e=None: f"{_name(s)}.record_event()")
    _wrap(E, "record", lambda e, s=None: f"ev{id(e) % 10000}.record({_name(s or torch.cuda.current_stream())})")
    _wrap(E, "wait", lambda e, s=None: f"{_name(s or torch.cuda.current_stream())}.wait(ev{id(e) % 10000})")
    ctx = torch.cuda.StreamContext
    _wrap(ctx, "__enter__", lambda c: f"enter stream {_name(c.stream) if c.stream is not None else None}")
    graph = torch.cuda.graph
    enter, exit_ = graph.__enter__, graph.__exit__

    def g_enter(self):
        r = enter(self)
        _open[0] += 1
        _log.clear()
        _log.append(f"capture begins on {_name(self.capture_stream)}")
        return r

    def g_exit(self, *exc):
        rank = os.environ.get("RANK", "?")
        try:
            found = unjoined(self.capture_stream.cuda_stream)
        except Exception as e:
            found = [f"analysis failed: {e!r}"]
        _open[0] -= 1
        if found or exc[0] is not None:
            print(f"[capture_trace rank {rank}] {len(_log)} stream operations in the capture:", file=sys.stderr)
            for line in _log:
                print(f"[capture_trace rank {rank}]   {line}", file=sys.stderr)
            for line in found:
                print(f"[capture_trace rank {rank}] UNJOINED {line}", file=sys.stderr)
        else:
            print(f"[capture_trace rank {rank}] capture joined ({len(_log)} stream operations)", file=sys.stderr)
        return exit_(self, *exc)

    graph.__enter__, graph.__exit__ = g_enter, g_exit
