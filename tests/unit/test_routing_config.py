"""A model's ``routing:`` config: validated with named fields, passed to the request router,
and rolled with the routers (which read it), never the engines."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.app import ROUTER_DEPLOYMENT, deployment_versions, llm_server_name, \
    llm_server_options
from serve_app.config import load_config
from serve_app.config.routing import RoutingSettings
from serve_app.routing.pinned import PinnedOrPolicyRouter
from serve_app.routing.adapter_placement import AdapterPlacement
from serve_app.routing.power_of_two import PowerOfTwo
from serve_app.routing.prefix_affinity import PrefixAffinity
from serve_app.routing.prefix_cache import PrefixCache

REPO = Path(__file__).resolve().parents[2]


def _config():
    return load_config(REPO / "deployments" / "local-cpu.yaml")


def _with_routing(cfg, **routing):
    model = cfg.models[0].model_copy(update={"routing": RoutingSettings(**routing)})
    return cfg.model_copy(update={"models": [model]})


def test_the_default_is_prefix_cache_with_adapter_placement():
    # prefix_cache reached 1.0x power of two's output on multi-turn chat without the lockstep
    # (bench/RESULTS.md 38d: 1.03x, 1.01x; history 1.04x, hot tenant 1.11x, random 0.98x), so it
    # is the default; a bare request router agrees, and an adapter's requests are still placed.
    assert _config().models[0].routing.policy == "prefix_cache"
    router = PinnedOrPolicyRouter.__new__(PinnedOrPolicyRouter)
    router.initialize_state()
    assert router.policy.name == "prefix_cache"
    assert isinstance(router.policy, AdapterPlacement)
    assert isinstance(router.policy.inner, PrefixCache)


def test_no_adapter_placement_leaves_the_policy_alone():
    router = PinnedOrPolicyRouter.__new__(PinnedOrPolicyRouter)
    router.initialize_state(policy="power_of_two", adapter_replicas=0)
    assert isinstance(router.policy, PowerOfTwo)


def test_every_routing_field_is_described():
    for name, field in RoutingSettings.model_fields.items():
        assert field.description, name


def test_an_unknown_policy_fails_naming_the_field_and_the_choices(tmp_path):
    text = (REPO / "deployments" / "local-cpu.yaml").read_text().replace(
        "    autoscaling:", "    routing:\n      policy: round_robin\n    autoscaling:", 1)
    (tmp_path / "c.yaml").write_text(text.replace("./models", str(REPO / "models")))
    with pytest.raises((ValidationError, ValueError)) as err:
        load_config(tmp_path / "c.yaml")
    assert "routing.policy" in str(err.value) and "prefix_affinity" in str(err.value)


def test_knobs_are_bounded():
    with pytest.raises(ValidationError, match="block_tokens"):
        RoutingSettings(block_tokens=0)
    with pytest.raises(ValidationError, match="imbalance_margin"):
        RoutingSettings(imbalance_margin=-1)
    with pytest.raises(ValidationError, match="load_factor"):
        RoutingSettings(load_factor=0.5)  # below the mean: no replica could ever take a key


def test_the_deployment_passes_routing_to_the_request_router():
    cfg = _with_routing(_config(), policy="prefix_affinity", block_tokens=32, prefix_blocks=2,
                        chars_per_token=3, imbalance_margin=6, load_factor=1.5)
    rr = llm_server_options(cfg.models[0])["request_router_config"]
    assert rr["request_router_class"].endswith(":PinnedOrPolicyRouter")
    router = PinnedOrPolicyRouter.__new__(PinnedOrPolicyRouter)
    router.initialize_state(**rr["request_router_kwargs"])  # what Serve does with them
    inner = router.policy.inner  # within adapter placement (serve_app/routing/adapter_placement.py)
    assert isinstance(inner, PrefixAffinity)
    assert (inner.imbalance_margin, inner.load_factor) == (6, 1.5)
    assert (inner.keyer.block_tokens, inner.keyer.prefix_blocks,
            inner.keyer.chars_per_token) == (32, 2, 3)
    assert router.policy.adapter_replicas == 2
    assert router.decisions.model == cfg.models[0].name


def test_a_routing_change_rolls_the_routers_not_the_engines():
    """The request router lives in the routers' handles and reads its kwargs once: new
    routers apply a new policy; engines (minutes of GPU start-up) need not restart."""
    cfg = _config()
    changed = _with_routing(cfg, policy="power_of_two")
    engine = llm_server_name(cfg.models[0].name)
    before, after = deployment_versions(cfg), deployment_versions(changed)
    assert after[engine] == before[engine]
    assert after[ROUTER_DEPLOYMENT] != before[ROUTER_DEPLOYMENT]
