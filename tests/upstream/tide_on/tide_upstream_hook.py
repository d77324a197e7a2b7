"""Turns TIDE on inside PyTorch's own FSDP2 tests, as a user would: ``tide.fsdp.enable(root)`` once
the root FSDP2 module is fully sharded, i.e. just before its first forward.

``fully_shard`` is wrapped wherever PyTorch exposes it, before the test files import it. Each module
it shards gets a forward pre-hook, prepended so that it runs before FSDP2's own pre-forward (which
does the lazy init and the first all-gather). The first time that hook runs on a module that is (or
is about to become) a root and whose param groups TIDE does not handle yet, it calls
``tide.fsdp.enable(module)``; an explicit ``FSDPModule.unshard`` before the first forward does the
same first. A refusal or error from ``enable`` propagates into the test (the test then fails, as a
user's program would), and is recorded.

Every event goes as one JSON line to $TIDE_UPSTREAM_LOG (pid, thread, event, details): "enable"
(buckets handled, fallbacks with reasons), "enable_error", "not_applicable" (no param groups to
enable, e.g. a parameter-less model), "counts" (the handle's counts() at each later root forward
and at exit), and "log" (records of the tide loggers: fallbacks and warnings).
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import sys
import threading

_log_path = os.environ.get("TIDE_UPSTREAM_LOG")
_lock = threading.Lock()
_handles: list = []  # (module path hint, handle)


def _write(event: str, **details) -> None:
    if not _log_path:
        return
    line = json.dumps({"pid": os.getpid(), "thread": threading.get_ident(), "event": event, **details},
                      default=str)
    with _lock, open(_log_path, "a") as f:
        f.write(line + "\n")


class _ToJson(logging.Handler):
    def emit(self, record):
        try:
            _write("log", logger=record.name, level=record.levelname, message=record.getMessage())
        except Exception:
            pass


def _handled(module) -> bool:
    from tide.fsdp import _fsdp2

    try:
        groups = _fsdp2.param_groups(module)
    except Exception:
        return False
    return any(getattr(fp, "_tide_bucket", None) is not None for _, pg in groups for fp in pg.fsdp_params)


def _maybe_enable(module) -> None:
    import tide.fsdp

    if id(module) in tide.fsdp._enabled:
        h = tide.fsdp._enabled[id(module)]
        _write("counts", module=type(module).__name__, counts=h.counts())
        return
    if getattr(module, "_tide_upstream_tried", False):
        return
    module._tide_upstream_tried = True
    state = module._get_fsdp_state()
    if state._is_root is False:  # lazily initialized as a non-root: its root decides
        return
    if _handled(module):
        return
    try:
        handle = tide.fsdp.enable(module)
    except ValueError as e:
        if "no FSDP2 param groups" in str(e):
            _write("not_applicable", module=type(module).__name__, error=str(e))
            return
        _write("enable_error", module=type(module).__name__, error=f"{type(e).__name__}: {e}")
        raise
    except Exception as e:
        _write("enable_error", module=type(module).__name__, error=f"{type(e).__name__}: {e}")
        raise
    _handles.append(handle)
    _write("enable", module=type(module).__name__, buckets=len(handle.buckets),
           bucket_paths=[b.path for b in handle.buckets], fallbacks=handle.fallbacks)


def _pre_hook(module, args, kwargs):
    _maybe_enable(module)
    return None


def _hook_modules(result, args):
    from torch import nn

    mods = args[0] if args else result
    if isinstance(mods, nn.Module):
        mods = [mods]
    for m in mods:
        if isinstance(m, nn.Module) and not getattr(m, "_tide_upstream_hooked", False):
            m._tide_upstream_hooked = True
            m.register_forward_pre_hook(_pre_hook, prepend=True, with_kwargs=True)


def _at_exit() -> None:
    for h in _handles:
        _write("counts", module="(exit)", counts=h.counts(), buckets=len(h.buckets))


def install() -> None:
    import importlib

    import torch.distributed.fsdp as fsdp_pkg

    orig = fsdp_pkg.fully_shard
    if getattr(orig, "_tide_upstream_wrapper", False):
        return

    @functools.wraps(orig)
    def fully_shard(*args, **kwargs):
        result = orig(*args, **kwargs)
        _hook_modules(result, args)
        return result

    fully_shard._tide_upstream_wrapper = True
    for name in ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                 "torch.distributed.fsdp._fully_shard._fully_shard",
                 "torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "fully_shard", None) is orig:
            mod.fully_shard = fully_shard
    # Modules that bound the original by `from ... import fully_shard` before this ran (PyTorch's
    # test helpers in torch.testing._internal.common_fsdp, e.g. MLPStack.parallelize, which the ND
    # mesh tests shard with): without this their fully_shard calls would bypass the hook.
    for name, mod in list(sys.modules.items()):
        if mod is not None and getattr(mod, "fully_shard", None) is orig:
            mod.fully_shard = fully_shard
    # An explicit FSDPModule.unshard before the first forward (test_1f1b_microbatching issues
    # unshard(async_op=True) on every module first): a user turns TIDE on before it, so the hook
    # does too (enable refuses a group whose stock all-gather is already in flight).
    from torch.distributed.fsdp import FSDPModule

    stock_unshard = FSDPModule.unshard

    @functools.wraps(stock_unshard)
    def unshard(self, *args, **kwargs):
        _maybe_enable(self)
        return stock_unshard(self, *args, **kwargs)

    FSDPModule.unshard = unshard
    for name in ("tide", "tide.fsdp"):
        logging.getLogger(name).addHandler(_ToJson())
    atexit.register(_at_exit)
    _write("installed")
