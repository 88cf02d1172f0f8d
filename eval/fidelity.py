"""`python -m eval.fidelity`: the simulator-fidelity check, kept at its old path; the code is `eval.live.fidelity`."""

from absl import app

from eval.live.fidelity import main

if __name__ == "__main__":
    app.run(main)
