"""User plug-ins named `module:attribute` (a router class, a system factory).

`import_spec` is shared by `eval.replay --systems=module:Attr` and the serving binary's
`--router=module:Class`, so a research router written once plugs into both.

A plug-in is user code: whatever it raises while being imported, looked up, constructed or
called (`call_plugin`) comes back as a `ValueError` naming the spec, the exception's type and
message and where it was raised, so a CLI reports it in one line instead of a traceback (the
original exception stays chained as `__cause__`). A `ValueError` the plug-in raises itself is
passed on unchanged: it already is a user-facing message.
"""

from __future__ import annotations

import importlib
import inspect
import traceback
from collections.abc import Callable
from typing import Any


def _describe(e: BaseException) -> str:
    """`Type: message (at file:line in function)`, the frame being the innermost one of user
    code (frames of frozen importlib machinery skipped; a SyntaxError's message has its line)."""
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
    if frames and not isinstance(e, SyntaxError):
        text += f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})"
    return text


def import_spec(spec: str, what: str = "plug-in"):
    """The object named by `spec` = "module:attribute" (dotted attributes allowed).

    Raises:
      ValueError: naming `spec`, for a malformed spec, a module that cannot be imported or
        raises while being imported (the exception's type and message given), or a missing
        attribute (or one whose lookup raises).
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: a plug-in must be named 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({e})") from e
    except Exception as e:  # the module's own code failed (a SyntaxError, a RuntimeError, ...)
        raise ValueError(f"{what} {spec!r}: importing module {module_name!r} raised "
                         f"{_describe(e)}") from e
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute "
                             f"{attr!r}") from None
        except Exception as e:  # a module __getattr__ or a property that fails
            raise ValueError(f"{what} {spec!r}: looking up {attr!r} raised {_describe(e)}") from e
    return obj


def call_plugin(spec: str, what: str, role: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, `fn` being the plug-in `spec` (`role` says what it is, e.g. "factory 'f'").

    The arguments are checked against `fn`'s signature first, so a plug-in of the wrong shape
    is told apart from one whose own code raises a TypeError.

    Raises:
      ValueError: `fn` does not take `args` ("... must be callable with ..."), or it raised
        anything but a ValueError (the message names `spec`, the exception's type, message and
        the line that raised it); a ValueError from `fn` itself propagates unchanged.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: let the call tell
        signature = None
    if signature is not None:
        try:
            signature.bind(*args)
        except TypeError as e:
            takes = "no arguments" if not args else f"{len(args)} positional argument(s)"
            raise ValueError(f"{what} {spec!r}: {role} must be callable with {takes} "
                             f"({e})") from None
    try:
        return fn(*args)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{what} {spec!r}: {role} raised {_describe(e)}") from e


def router_from_spec(spec: str):
    """A fresh router from `spec` naming a router class (it has `choose`) built with no
    arguments.

    Raises:
      ValueError: as `import_spec`, or the attribute is not a router class, or its
        constructor needs arguments or raises (as `call_plugin`: the message names the spec
        and the exception's type and message).
    """
    obj = import_spec(spec, "router")
    if not (inspect.isclass(obj) and callable(getattr(obj, "choose", None))):
        raise ValueError(f"router {spec!r}: {spec.partition(':')[2]!r} is not a router class "
                         "(a class with a choose(request, candidates, matched, now) method)")
    return construct_router(spec, "router", obj)


def construct_router(spec: str, what: str, cls: type) -> Any:
    """`cls()`, the router class of the plug-in `spec`.

    Raises:
      ValueError: the class is not constructible with no arguments, or its constructor raised
        (as `call_plugin`).
    """
    role = f"router class {spec.partition(':')[2]!r}"
    try:
        inspect.signature(cls).bind()
    except TypeError as e:
        raise ValueError(f"{what} {spec!r}: {role} must be constructible with no arguments "
                         f"({e})") from None
    except ValueError:  # no introspectable signature: let the call tell
        pass
    return call_plugin(spec, what, role, cls)
