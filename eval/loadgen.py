"""`python -m eval.loadgen`: the load generator, kept at its old path; the code is `eval.live.loadgen`."""

from absl import app

from eval.live.loadgen import main

if __name__ == "__main__":
    app.run(main)
