"""`module:attribute` plug-ins: the same router class serves in eval.replay and serving.main."""

from __future__ import annotations

import pytest

from serving.policy.plugins import import_spec, router_from_spec
from tests.serving.api_fixtures import make_client
from tests.eval.plugin_example import ExampleRouter


def test_router_class_is_built_fresh():
    a = router_from_spec("tests.eval.plugin_example:ExampleRouter")
    b = router_from_spec("tests.eval.plugin_example:ExampleRouter")
    assert isinstance(a, ExampleRouter) and a is not b


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "module:attribute"),
    ("not_a_module_xyz:R", "cannot import module"),
    ("tests.eval.plugin_example:Missing", "has no attribute"),
    ("tests.eval.plugin_example:example_system", "not a router class"),
])
def test_bad_router_specs(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        router_from_spec(spec)
    assert spec in str(e.value)


def test_import_spec_dotted():
    assert import_spec("tests.eval.plugin_example:ExampleRouter.choose") is ExampleRouter.choose


def test_plugged_router_serves_requests():
    client, engine = make_client(router=router_from_spec("tests.eval.plugin_example:ExampleRouter"))
    with client:
        ids = [client.post("/v1/completions", json={"prompt": f"p{i}"}).json()["worker_id"]
               for i in range(3)]
    assert engine.scheduler.router.name == "example-fewest-requests"
    assert sorted(ids) == [0, 1, 2]  # fewest outstanding, rotating ties: every worker once
