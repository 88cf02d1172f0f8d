"""Console scripts of the evaluation tools (pyproject's `[project.scripts]`).

    vertumnus-loadgen --launch_server     # = python -m eval.live.loadgen --launch_server
    vertumnus-replay --systems=vertumnus  # = python -m eval.replay --systems=vertumnus

Each imports its tool (which defines the tool's absl flags) only when called, so one script never
loads the other's flags, then parses `sys.argv` and runs the tool's `main` with `absl.app.run`,
as `python -m <module>` does (`--help` too: `serving.console.help_as_module`). The serving
binary's script, `vertumnus-serve`, is `serving.main:run`.
"""

from __future__ import annotations

from absl import app

from serving.console import help_as_module


def loadgen() -> None:
    """`vertumnus-loadgen`: the live load generator (`eval.live.loadgen`; `--helpfull`)."""
    from eval.live import loadgen as tool

    help_as_module(tool)
    app.run(tool.main)


def replay() -> None:
    """`vertumnus-replay`: trace replay through simulated pools (`eval.replay`; `--helpfull`)."""
    from eval import replay as tool

    help_as_module(tool)
    app.run(tool.main)
