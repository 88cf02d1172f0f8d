"""`python -m eval.fidelity`: the simulator-fidelity check, kept at its old path; the code is `eval.live.fidelity`."""

from absl import app, flags

from eval.live import fidelity
from eval.live.fidelity import main

flags.adopt_module_key_flags(fidelity)  # --help lists the tool's flags

if __name__ == "__main__":
    app.run(main)
