"""User plug-ins named `module:attribute` (a router class, a system factory).

`import_spec` is shared by `eval.replay --systems=module:Attr` and the serving binary's
`--router=module:Class`, so a research router written once plugs into both.
"""

from __future__ import annotations

import importlib
import inspect


def import_spec(spec: str, what: str = "plug-in"):
    """The object named by `spec` = "module:attribute" (dotted attributes allowed).

    Raises:
      ValueError: naming `spec`, for a malformed spec, a module that cannot be imported, or a
        missing attribute.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: a plug-in must be named 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({e})") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def router_from_spec(spec: str):
    """A fresh router from `spec` naming a router class (it has `choose`) built with no
    arguments.

    Raises:
      ValueError: as `import_spec`, or the attribute is not a router class, or its
        constructor needs arguments.
    """
    obj = import_spec(spec, "router")
    if not (inspect.isclass(obj) and callable(getattr(obj, "choose", None))):
        raise ValueError(f"router {spec!r}: {spec.partition(':')[2]!r} is not a router class "
                         "(a class with a choose(request, candidates, matched, now) method)")
    try:
        return obj()
    except TypeError as e:
        raise ValueError(f"router {spec!r}: the class must be constructible with no arguments "
                         f"({e})") from e
