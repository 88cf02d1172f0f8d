"""`--help` of the console scripts (`vertumnus-serve`, `vertumnus-loadgen`, `vertumnus-replay`).

absl's `--help` prints the docstring of `sys.modules["__main__"]` and the key flags of the module
named `sys.argv[0]`: under `python -m serving.main` that is the tool itself, but under an
installed console script it is the generated wrapper, which has neither, so the script's `--help`
printed only a usage line. `help_as_module(tool)` makes it print what `python -m <tool> --help`
does.
"""

from __future__ import annotations

import sys
import types

from absl import flags


def help_as_module(tool: types.ModuleType, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Gives the running program `tool`'s docstring and key flags (those it defines or adopts),
    as `absl.app`'s `--help` reads them; call it before `absl.app.run`.

    Args:
      tool: the module whose `main` the console script runs (its flags already defined).
      flag_values: the flag registry (absl's global one).
    """
    main = sys.modules.get("__main__")
    if main is not None and main is not tool:
        main.__doc__ = tool.__doc__
    name = sys.argv[0] if sys.argv else ""
    if name == tool.__name__:
        return
    for flag in flag_values.get_key_flags_for_module(tool.__name__):
        flag_values.register_key_flag_for_module(name, flag)
