"""User plug-ins named `module:attribute` (a router class, a system factory).

`import_spec` is shared by `eval.replay --systems=module:Attr` and the serving binary's
`--router=module:Class`, so a research router written once plugs into both.

A plug-in is user code: whatever it raises while being imported, looked up, constructed or
called (`call_plugin`) comes back as a `PluginError` (a `ValueError`: the CLIs print it as
`error: ...`) naming the spec, the exception's type and message and where it was raised, in one
line instead of a traceback (the original exception stays chained as `__cause__`). That
includes `SystemExit` (a plug-in calling `sys.exit()` is a bug, not the end of the program) and
any other `BaseException`, except `KeyboardInterrupt`, `GeneratorExit` and asyncio's
`CancelledError`: those are control flow (Ctrl-C stops the program as ever) and pass unchanged.
A plain `ValueError` the plug-in raises itself while being built also passes unchanged: it is a
user-facing message; its subclasses (`json.JSONDecodeError`, `UnicodeDecodeError`) are bugs and
are wrapped.

While a plug-in runs (`guard_system`, `guard_router`, `guard_callable`: a router's `choose`
and `bind`, hooks), everything it raises is wrapped the same way, plain `ValueError`s too, and a
`choose` that returns anything but an index into its candidates is refused, so an error names
the spec and the plug-in's method; this project's own code (modules under `serving.` and
`eval.`) is never wrapped, so its bugs keep their tracebacks.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import sys
import sysconfig
import traceback
from collections.abc import Callable
from typing import Any

_OURS = ("serving", "eval")  # packages whose code is not a plug-in's
_HOOK_LISTS = ("tick_hooks", "submit_hooks", "placement_hooks", "dispatch_hooks",
               "refused_hooks", "reconfigured_hooks")
_STDLIB = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
_SITE = tuple({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})


class PluginError(ValueError):
    """A plug-in failed; the message names its spec (what the CLIs print as `error: ...`)."""


def _passes(e: BaseException) -> bool:
    """Whether `e` passes a plug-in wrapper unchanged: control flow (Ctrl-C, a generator's or
    an asyncio task's end) or a `PluginError`, which already names a spec."""
    asyncio = sys.modules.get("asyncio")  # no CancelledError exists unless asyncio is loaded
    return (isinstance(e, (KeyboardInterrupt, GeneratorExit, PluginError)) or
            (asyncio is not None and isinstance(e, asyncio.CancelledError)))


def _shown(obj: object, show: Callable[[object], str] = str) -> str:
    """`show(obj)` (`str` or `repr`) on one line, whitespace runs made one space, cut at 400
    characters; never raises, even for an object whose `__str__` does."""
    try:
        text = " ".join(show(obj).split())
    except Exception as e:
        return f"<cannot be shown: {show.__name__}() raised {type(e).__name__}>"
    return text if len(text) <= 400 else text[:400] + "..."


def _describe(e: BaseException) -> str:
    """`Type: message (at file:line in function)`, one line, the frame being the innermost one
    outside the standard library (frames of frozen importlib machinery skipped; a SyntaxError's
    message has its line); `SystemExit(code)` for a SystemExit. Never raises."""
    if isinstance(e, SystemExit):
        text = f"SystemExit({_shown(e.code, repr)})"
    else:
        message = _shown(e)
        text = f"{type(e).__name__}: {message}" if message else type(e).__name__
    try:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if not f.filename.startswith("<")]
    except Exception:
        frames = []
    # The innermost frame outside Python's standard library (a json.loads the plug-in called
    # points at the plug-in's line), else the innermost.
    own = [f for f in frames if not f.filename.startswith(_STDLIB) or f.filename.startswith(_SITE)]
    if frames and not isinstance(e, SyntaxError):
        f = (own or frames)[-1]
        text += f" (at {f.filename}:{f.lineno} in {f.name})"
    return text


def _failed(spec: str, what: str, role: str, e: BaseException) -> PluginError:
    return PluginError(f"{what} {spec!r}: {role} raised {_describe(e)}")


def import_spec(spec: str, what: str = "plug-in"):
    """The object named by `spec` = "module:attribute" (dotted attributes allowed).

    Raises:
      PluginError: naming `spec`, for a malformed spec, a module that cannot be imported or
        raises while being imported (the exception's type and message given), or a missing
        attribute (or one whose lookup raises).
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise PluginError(f"{what} {spec!r}: a plug-in must be named 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"{what} {spec!r}: cannot import module {module_name!r} "
                          f"({_shown(e)})") from e
    except BaseException as e:  # the module's own code failed (a SyntaxError, sys.exit(), ...)
        if _passes(e):
            raise
        raise _failed(spec, what, f"importing module {module_name!r}", e) from e
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{what} {spec!r}: module {module_name!r} has no attribute "
                              f"{attr!r}") from None
        except BaseException as e:  # a module __getattr__ or a property that fails
            if _passes(e):
                raise
            raise _failed(spec, what, f"looking up {attr!r}", e) from e
    return obj


def call_plugin(spec: str, what: str, role: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, `fn` being the plug-in `spec` (`role` says what it is, e.g. "factory 'f'").

    The arguments are checked against `fn`'s signature first, so a plug-in of the wrong shape
    is told apart from one whose own code raises a TypeError.

    Raises:
      PluginError: `fn` does not take `args` ("... must be callable with ..."), or it raised
        anything but a plain ValueError or control flow (see the module docstring; the message
        names `spec`, the exception's type, message and the line that raised it).
      ValueError: a plain one that `fn` raised, unchanged.
    """
    try:
        signature = inspect.signature(fn)
    except Exception:  # no introspectable signature: let the call tell
        signature = None
    if signature is not None:
        try:
            signature.bind(*args)
        except TypeError as e:
            takes = "no arguments" if not args else f"{len(args)} positional argument(s)"
            raise PluginError(f"{what} {spec!r}: {role} must be callable with {takes} "
                              f"({e})") from None
    try:
        return fn(*args)
    except BaseException as e:
        if type(e) is ValueError or _passes(e):
            raise
        raise _failed(spec, what, role, e) from e


def _is_ours(obj: Any) -> bool:
    """Whether `obj` is this project's code: a function or class (a bound method: its function)
    defined under `_OURS`, or an instance of a class defined there."""
    try:
        if inspect.ismethod(obj):
            obj = obj.__func__
        module = (obj.__module__ if inspect.isfunction(obj) or inspect.isclass(obj)
                  else type(obj).__module__)
    except Exception:
        return False
    return isinstance(module, str) and module.partition(".")[0] in _OURS


def _name(fn: Any) -> str:
    try:
        return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)
    except Exception:
        return type(fn).__name__


def guard_callable(spec: str, what: str, role: str, fn: Callable[..., Any],
                   binds: bool = False) -> Callable[..., Any]:
    """`fn`, a plug-in's callable run by this project's code (a hook), wrapped so that whatever
    it raises (control flow aside, plain ValueErrors included) becomes a `PluginError`
    "{what} '{spec}': {role} raised Type: message (at file:line in function)". With `binds`,
    `fn` takes the scheduler (`fn(scheduler, ...)`), and the hooks it adds to the scheduler's
    `_HOOK_LISTS` are guarded too (as "tick hook Class.method", ...). `fn` itself when it is
    this project's code (`serving.`, `eval.`)."""
    return fn if _is_ours(fn) else _guard(spec, what, role, fn, None, binds)


def _guard(spec: str, what: str, role: str, fn: Callable[..., Any],
           check: Callable[[Any, tuple], str | None] | None, binds: bool) -> Callable[..., Any]:
    """`guard_callable` without the test of whose code `fn` is; `check(result, args)` says why
    a result is refused (None: it is not)."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        lists = [getattr(args[0], n, None) for n in _HOOK_LISTS] if binds and args else []
        before = [len(h) if isinstance(h, list) else 0 for h in lists]
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            if _passes(e):
                raise
            raise _failed(spec, what, role, e) from e
        for hooks, n, kind in zip(lists, before, _HOOK_LISTS):
            if isinstance(hooks, list):  # hooks the plug-in added: guarded too
                hooks[n:] = [guard_callable(spec, what, f"{kind[:-1].replace('_', ' ')} "
                                            f"{_name(h)}", h) for h in hooks[n:]]
        why = check(out, args) if check is not None else None
        if why is not None:
            raise PluginError(f"{what} {spec!r}: {role} {why}")
        return out

    return guarded


def _not_an_index(i: Any, args: tuple) -> str | None:
    """Why `i`, returned by `choose(request, candidates, matched, now)`, is not an index into
    the candidates; None when it is."""
    if len(args) < 2:  # candidates passed by keyword: not the scheduler's call
        return None
    n = len(args[1])
    if (type(i) is int or isinstance(i, numbers.Integral) and not isinstance(i, bool)) \
            and 0 <= i < n:
        return None
    return f"returned {_shown(i, repr)}, not an index into its {n} candidates (0 to {n - 1})"


class _GuardedRouter:
    """A router whose `choose` and `bind` are guarded (for routers that take no attributes)."""

    def __init__(self, router: Any, choose: Callable[..., Any], bind: Any) -> None:
        self._router, self.choose = router, choose
        if bind is not None:
            self.bind = bind

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)


def guard_router(spec: str, what: str, router: Any) -> Any:
    """`router`, a plug-in's router, with its `choose` and `bind` guarded (`guard_callable`;
    role "router Class.choose"), a `choose` that returns anything but an index into its
    candidates refused: the same object, its class and attributes kept, where it takes the
    guarded methods, else a proxy; `router` itself when its class is this project's code."""
    if _is_ours(router):
        return router
    cls = type(router).__name__
    try:
        choose = _guard(spec, what, f"router {cls}.choose", router.choose, _not_an_index, False)
        bind = getattr(router, "bind", None)
        bind = None if bind is None else _guard(spec, what, f"router {cls}.bind", bind, None, True)
    except BaseException as e:  # a `choose` or `bind` whose lookup raises
        if _passes(e):
            raise
        raise _failed(spec, what, f"router {cls}", e) from e
    try:
        router.choose = choose
        if bind is not None:
            router.bind = bind
        return router
    except Exception:  # __slots__, a read-only property, a __setattr__ that refuses
        return _GuardedRouter(router, choose, bind)


def guard_system(spec: str, what: str, system: Any) -> Any:
    """`system` (an `eval.systems.System`, built by the plug-in `spec`) with the plug-in's code
    that a run calls guarded: its router (`guard_router`), tick hooks, setup functions (and
    the hooks they add) and prefix-index factory (`guard_callable`); this project's classes
    and functions it uses are not."""
    def guard(role: str, fn: Callable[..., Any], binds: bool = False) -> Callable[..., Any]:
        return guard_callable(spec, what, f"{role} {_name(fn)}", fn, binds)
    system.router = guard_router(spec, what, system.router)
    system.tick_hooks = [guard("tick hook", h) for h in system.tick_hooks]
    system.setup = [guard("setup", f, binds=True) for f in system.setup]
    system.make_prefix_index = guard("make_prefix_index", system.make_prefix_index)
    return system


def router_from_spec(spec: str):
    """A fresh router from `spec` naming a router class (it has `choose`) built with no
    arguments.

    Raises:
      PluginError: as `import_spec`, or the attribute is not a router class, or its
        constructor needs arguments or raises (as `call_plugin`: the message names the spec
        and the exception's type and message).
    """
    obj = import_spec(spec, "router")
    if not (inspect.isclass(obj) and callable(getattr(obj, "choose", None))):
        raise PluginError(f"router {spec!r}: {spec.partition(':')[2]!r} is not a router class "
                          "(a class with a choose(request, candidates, matched, now) method)")
    return construct_router(spec, "router", obj)


def construct_router(spec: str, what: str, cls: type) -> Any:
    """`cls()`, the router class of the plug-in `spec`.

    Raises:
      PluginError: the class is not constructible with no arguments, or its constructor raised
        (as `call_plugin`).
    """
    role = f"router class {spec.partition(':')[2]!r}"
    try:
        inspect.signature(cls).bind()
    except TypeError as e:
        raise PluginError(f"{what} {spec!r}: {role} must be constructible with no arguments "
                          f"({e})") from None
    except Exception:  # no introspectable signature: let the call tell
        pass
    return call_plugin(spec, what, role, cls)
