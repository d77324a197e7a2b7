"""How TIDE hooks FSDP2: the function objects themselves, not the names that refer to them.

Tools and tests wrap FSDP2's ``foreach_all_gather`` / ``foreach_reduce`` (to count or time them) by
rebinding the module attribute, and restore "the original" later. Rebinding is the hook point they
use, so TIDE does not use it: it swaps the ``__code__`` of FSDP2's own function objects for a
two-line dispatcher (``_DISPATCH[name](*args, **kwargs)``) and keeps a clone of the stock function.
Every reference then reaches TIDE: FSDP2's module global, a wrapper's captured original (installed
before TIDE or after), and a restored original. TIDE is never half-on. What it cannot see is code
that replaces a function with one that never calls the original; the bucket notices
(``_bucket.Bucket.owns`` and ``on_param_freed``) and raises. docs/ARCHITECTURE.md says why this design.
"""

from __future__ import annotations

import inspect
import threading
import types

from . import _fsdp2

_DISPATCH_GLOBAL = "__tide_dispatch__"
_DISPATCH: dict = {}  # name -> TIDE's function, injected into FSDP2's module globals


class _Hook:
    def __init__(self, name: str):
        self.name = name
        self.func = _stock_function(name)
        self.stock_code = self.func.__code__
        # The stock function as it was, callable after its object's code is swapped.
        self.stock = types.FunctionType(self.stock_code, self.func.__globals__, self.func.__name__,
                                        self.func.__defaults__, self.func.__closure__)
        self.stock.__kwdefaults__ = self.func.__kwdefaults__
        self.signature = inspect.signature(self.stock)
        # Positions of the stock function's parameters, so that a call's arguments are read by name
        # without binding: inspect's bind cost 53 us per call under cProfile on a 2-core x86
        # CPU, the largest Python cost per bucket after the collective itself.
        self.positions = {p.name: i for i, p in enumerate(self.signature.parameters.values())
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
        missing = [p for p in _fsdp2.READ_PARAMETERS.get(name, ()) if p not in self.positions]
        if missing:  # at enable, not as a KeyError inside a step
            raise RuntimeError(f"tide.fsdp: torch {_fsdp2.torch.__version__}'s FSDP2 {name} has no "
                               f"parameter {', '.join(missing)} (its signature is {self.signature}): "
                               "its internals changed; tide.fsdp's version adapter (_fsdp2.py) "
                               "does not know this version")
        namespace: dict = {}
        exec(f"def {self.func.__name__}(*args, **kwargs):\n"
             f"    return {_DISPATCH_GLOBAL}[{name!r}](*args, **kwargs)\n", namespace)
        self.dispatch_code = namespace[self.func.__name__].__code__

    def install(self, replacement) -> None:
        _DISPATCH[self.name] = replacement
        self.func.__globals__[_DISPATCH_GLOBAL] = _DISPATCH
        self.func.__signature__ = self.signature  # inspect.signature still shows FSDP2's
        self.func.__code__ = self.dispatch_code

    def uninstall(self) -> None:
        self.func.__code__ = self.stock_code
        del self.func.__signature__

    @property
    def installed(self) -> bool:
        return self.func.__code__ is self.dispatch_code


def _stock_function(name: str) -> types.FunctionType:
    """FSDP2's own function object for `name`, found under whatever wraps it (torch.no_grad's
    decorator, or another tool's wrapper) where FSDP2 calls it and where it is defined: through
    ``__wrapped__``, closure cells and default arguments, the function whose code is `name` in
    FSDP2's source file."""
    source = _fsdp2.SOURCE_FILES[name]
    starts = []
    for owner, attr in _fsdp2.hook_locations(name):
        starts.append(owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None))
    pending, seen = [s for s in starts if s is not None], set()
    while pending:
        f = pending.pop(0)
        if id(f) in seen:
            continue
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        if isinstance(f, types.FunctionType) and code.co_name == name and code.co_filename == source:
            return f
        if isinstance(f, types.FunctionType) and code.co_name == name and _DISPATCH_GLOBAL in code.co_names:
            return f  # already hooked (its code is the dispatcher)
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            pending.append(wrapped)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        pending.extend(getattr(f, "__defaults__", None) or ())
        pending.extend((getattr(f, "__kwdefaults__", None) or {}).values())
    raise RuntimeError(f"tide.fsdp: cannot find FSDP2's own {name} (from {source}) under {starts!r}: "
                       "something replaced it without keeping the original reachable")


_hooks: dict = {}
_lock = threading.Lock()
_users = 0  # enabled modules (across threads): the hooks stay installed while any is enabled


def stock(name: str):
    """The stock FSDP2 function `name` (callable whether or not TIDE's hooks are installed)."""
    return _hook(name).stock


class Call:
    """One call's arguments to a hooked function, read by parameter name without binding."""

    __slots__ = ("positions", "args", "kwargs")

    def __init__(self, name: str, args: tuple, kwargs: dict):
        self.positions, self.args, self.kwargs = _hook(name).positions, args, kwargs

    def get(self, param: str, default=None):
        """The argument `param`, positional or keyword; a keyword-only parameter (torch 2.15's
        ``prepare_reduce_scatter_inputs``) has no position and is only ever passed by keyword."""
        i = self.positions.get(param, len(self.args))
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(param, default)

    def with_argument(self, param: str, value) -> tuple:
        """(args, kwargs) of the same call with `param` set to `value`."""
        i = self.positions[param]
        if i < len(self.args):
            args = list(self.args)
            args[i] = value
            return tuple(args), self.kwargs
        return self.args, {**self.kwargs, param: value}


def _hook(name: str) -> _Hook:
    if name not in _hooks:
        _hooks[name] = _Hook(name)
    return _hooks[name]


def acquire(replacements: dict) -> None:
    """Installs TIDE's functions (once; counted per enabled module)."""
    global _users
    with _lock:
        hooks = [(_hook(name), fn) for name, fn in replacements.items()]  # may raise: none installed yet
        for hook, fn in hooks:
            if not hook.installed:
                hook.install(fn)
        _users += 1


def release() -> None:
    """One enabled module fewer; the last one restores FSDP2's code."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for hook in _hooks.values():
                if hook.installed:
                    hook.uninstall()


def installed() -> bool:
    return bool(_hooks) and all(h.installed for h in _hooks.values())
