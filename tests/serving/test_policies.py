"""The live pool's named policies (`--policy`): `vertumnus` is the simulator's default, part for
part, and the binary's flags replace one part at a time."""

from __future__ import annotations

import pytest
from absl import flags

from serving.engine_config import POLICIES, EngineConfig, policy_parts
from serving.policy.composition import CompositionController
from serving.policy.controller import ReconfigurationController
from serving.policy.fetch_router import FetchingVertumnusRouter
from serving.policy.queue_order import FCFS, SJF, QueueOrder
from tests.serving.api_fixtures import BS, make_client


def _simulated(name: str):
    """The simulator's system `name` on 8 GPUs of degrees {2, 4} (no demand sample)."""
    from eval.experiment import ReplayConfig, ReplayEnv
    env = ReplayEnv.build(ReplayConfig(num_gpus=8, degrees=(2, 4)), 512, {2, 4}, ())
    return env.build_system(name, None)


@pytest.mark.parametrize("name", ["vertumnus", "vertumnus-paper"])
def test_a_live_policy_is_the_simulated_system_of_that_name(name):
    # Every part the live pool can take is the simulated system's own (the replayed initial
    # choice, which needs a demand sample, and the fetch it chooses are the exceptions).
    system = _simulated(name)
    parts = policy_parts(name)
    router = system.router
    live = router.live.horizon_s if router.live is not None else None
    assert (live, router.congestion_price, router.queue_order) == (
        parts["live_horizon_s"], parts["congestion_price"], parts["queue_order"])
    controllers = [getattr(f, "__self__", None) for f in system.setup]
    kind = {CompositionController: "whatif", ReconfigurationController: "paper"}
    assert [kind[type(c)] for c in controllers if type(c) in kind] == [
        parts["controller_policy"]]


def test_the_paper_policy_is_engine_configs_defaults_and_vertumnus_differs_in_each_part():
    assert EngineConfig.for_policy("vertumnus-paper") == EngineConfig()
    full = EngineConfig.for_policy("vertumnus")
    assert (full.controller_policy, full.live_horizon_s, full.congestion_price,
            full.queue_order, full.prefix_fetch) == ("whatif", 300.0, True, SJF, True)
    paper = EngineConfig()
    for part in POLICIES["vertumnus"]:
        assert getattr(full, part) != getattr(paper, part), part
    # fields given on top replace the policy's; the other fields keep their defaults
    assert EngineConfig.for_policy("vertumnus", prefix_fetch=False, block_size=32) == \
        EngineConfig(**{**POLICIES["vertumnus"], "prefix_fetch": False, "block_size": 32})
    with pytest.raises(ValueError, match=r"policy must be one of \['vertumnus', "
                                         r"'vertumnus-paper'\], got 'paper'"):
        EngineConfig.for_policy("paper")
    for bad in (-1.0, True, "300"):
        with pytest.raises(ValueError, match="live_horizon_s must be None or a finite number"):
            EngineConfig.for_policy("vertumnus", live_horizon_s=bad)
    with pytest.raises(ValueError, match=r"policy must be one of \['vertumnus', "):
        EngineConfig.for_policy(["vertumnus"])
    policy_parts("vertumnus")["prefix_fetch"] = False  # a copy: the table is not changed
    assert POLICIES["vertumnus"]["prefix_fetch"] is True
    with pytest.raises(TypeError):  # and the table is read-only
        POLICIES["vertumnus"]["prefix_fetch"] = False


def _parsed(argv):
    """`serving.main.policy_flags()` under the flags `argv`."""
    import serving.main as main
    fv = flags.FLAGS
    try:
        fv(["serving.main", *argv])
        return main.policy_flags(), EngineConfig(**main.policy_flags()).describe_policy()
    finally:
        fv.unparse_flags()


def test_the_binarys_flags_replace_one_part_of_the_policy_at_a_time():
    parts, line = _parsed([])
    assert parts == POLICIES["vertumnus"]
    assert line == ("whatif controller, live sets of 300 s, congestion price on, queue order "
                    "sjf, prefix fetch on")
    assert _parsed(["--policy=vertumnus-paper"])[0] == POLICIES["vertumnus-paper"]
    assert _parsed(["--live_horizon_s=0"])[0] == {**POLICIES["vertumnus"],
                                                  "live_horizon_s": None}
    assert _parsed(["--policy=vertumnus-paper", "--live_horizon_s=60", "--queue_order=sjf:2",
                    "--prefix_fetch"])[0] == {**POLICIES["vertumnus-paper"],
                                              "live_horizon_s": 60.0,
                                              "queue_order": QueueOrder("sjf", 2.0),
                                              "prefix_fetch": True}
    assert _parsed(["--queue_order=gated-sjf"])[0] == {**POLICIES["vertumnus"],
                                                      "queue_order": QueueOrder("gated-sjf")}
    assert _parsed(["--noprefix_fetch", "--nocongestion_price",
                    "--controller_policy=paper"])[0] == {
        **POLICIES["vertumnus"], "prefix_fetch": False, "congestion_price": False,
        "controller_policy": "paper"}
    # the paper's controller's knobs are refused where the what-if controller runs
    with pytest.raises(ValueError, match="--upper, --hold_s tune the paper's controller; "
                                         "the what-if controller of this policy"):
        _parsed(["--upper=0.5", "--hold_s=3"])
    assert _parsed(["--upper=0.5", "--controller_policy=paper"])[0]["controller_policy"] == "paper"
    assert _parsed(["--upper=0.5", "--policy=vertumnus-paper"])[0] == POLICIES["vertumnus-paper"]
    assert _parsed(["--upper=0.5", "--nocontroller"])[0] == POLICIES["vertumnus"]  # no controller
    # a plug-in router is the router: the router's parts are left at the paper's, the
    # controller stays the policy's
    router = "--router=serving.policy.router:LeastWorkRouter"
    parts, _ = _parsed([router])
    assert parts == {**POLICIES["vertumnus-paper"], "controller_policy": "whatif"}
    assert parts["queue_order"] == FCFS
    # beside a plug-in, a router part may be turned off, not on
    assert _parsed([router, "--noprefix_fetch", "--live_horizon_s=0", "--queue_order=fcfs",
                    "--nocongestion_price"])[0] == parts
    for on in ("--prefix_fetch", "--live_horizon_s=60", "--queue_order=hrrn",
               "--congestion_price"):
        with pytest.raises(flags.IllegalFlagValueError, match="it does not apply with --router"):
            _parsed([router, on])


def test_the_live_engine_serves_under_the_full_vertumnus_policy():
    parts = policy_parts("vertumnus")
    del parts["controller_policy"]  # (make_client's own argument)
    client, engine = make_client(controller_policy="whatif", kv_bytes_per_token=4096, **parts)
    with client:
        assert isinstance(engine._router, FetchingVertumnusRouter)
        assert isinstance(engine.controller, CompositionController)
        assert engine._router.live.horizon_s == 300.0 and engine._router.congestion_price
        assert engine.scheduler.queue_order == SJF
        ids = [(11 * j) % 250 + 1 for j in range(3 * BS + 2)]
        first = client.post("/v1/completions", json={"prompt": ids}).json()
        again = client.post("/v1/completions", json={"prompt": ids}).json()
        assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"] == len(ids)
        assert client.get("/v1/workers").json()["policy"] == {
            "name": "vertumnus", "router": "FetchingVertumnusRouter",
            "description": "whatif controller, live sets of 300 s, congestion price on, queue "
                           "order sjf, prefix fetch on"}
    client, engine = make_client()  # the paper's parts, controller off
    with client:
        assert client.get("/v1/workers").json()["policy"] == {
            "name": "vertumnus-paper", "router": "VertumnusRouter",
            "description": "paper controller (off), no live sets, congestion price off, queue "
                           "order fcfs, prefix fetch off"}


def test_a_config_is_named_by_the_policy_whose_parts_it_has():
    assert EngineConfig().policy == "vertumnus-paper"
    assert EngineConfig.for_policy("vertumnus", block_size=64).policy == "vertumnus"
    assert EngineConfig.for_policy("vertumnus", prefix_fetch=False).policy == "custom"
    assert EngineConfig(queue_order=QueueOrder("sjf", 2.0)).describe_policy() == (
        "paper controller, no live sets, congestion price off, queue order sjf:2, "
        "prefix fetch off")
