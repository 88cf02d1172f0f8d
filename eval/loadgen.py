"""`python -m eval.loadgen`: the load generator, kept at its old path; the code is `eval.live.loadgen`."""

from absl import app, flags

from eval.live import loadgen
from eval.live.loadgen import main

flags.adopt_module_key_flags(loadgen)  # --help lists the tool's flags

if __name__ == "__main__":
    app.run(main)
