"""Adapters as tenants see them: which adapter ids each tenant sees, where a request naming
one goes, 404 for an unknown adapter and for another tenant's alike, the adapter on the usage
record, and ids that stay put through live changes. No Ray: the real RequestPipeline with the
scripted engine handle of test_accounting."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app.admission.controller import AdmissionController
from serve_app.config import AppConfig, RouterSettings, adapter_id
from serve_app.governance.adapters import AdapterTable
from serve_app.governance.keys import Tenant
from serve_app.governance.tenants import TenantGate
from serve_app.ingress.errors import OpenAIError
from serve_app.ingress.pipeline import RequestPipeline
from serve_app.ingress.protocol import CompletionRequest
from tests.unit.test_accounting import MODEL, Engine, Feed, HttpRequest, Usage

A, B = Tenant("team-a"), Tenant("team-b")


def _config(adapters=None, **model):
    adapters = adapters if adapters is not None else [
        {"name": "a-tune", "path": "org/a", "owners": ["team-a"]},
        {"name": "b-tune", "path": "org/b", "owners": ["team-b"]},
        {"name": "shared", "path": "org/s", "owners": ["public"]}]
    return AppConfig.model_validate({
        "models": [{"name": MODEL, "path": MODEL, "lora": {"max_loras": 2, "max_lora_rank": 8},
                    "adapters": adapters, **model}],
        "tenants": [{"name": n, "api_key_sha256": [d * 64]}
                    for n, d in (("team-a", "a"), ("team-b", "b"), ("team-c", "c"))]})


def test_each_tenant_sees_its_own_and_the_public_adapters():
    table = AdapterTable.from_config(_config())
    assert [a.name for a in table.visible(A)] == ["a-tune", "shared"]
    assert [a.name for a in table.visible(B)] == ["b-tune", "shared"]
    assert [a.name for a in table.visible(Tenant("team-c"))] == ["shared"]
    # A tenant not allowed the base model sees none of its adapters.
    assert table.visible(Tenant("team-a", models=frozenset({"other"}))) == []


def test_card_names_the_parent_and_not_the_path():
    table = AdapterTable.from_config(_config())
    [adapter] = [a for a in table.visible(A) if a.name == "a-tune"]
    card = table.card(adapter, {"id": MODEL, "object": "model", "max_model_len": 2048})
    assert card["id"] == "a-tune" and card["parent"] == MODEL
    assert card["max_model_len"] == 2048 and "org/a" not in json.dumps(card)


def test_ids_are_stable_through_adding_and_removing_others():
    before = AdapterTable.from_config(_config())
    cfg = _config([{"name": "new", "path": "org/n", "owners": ["public"]},
                   {"name": "shared", "path": "org/s", "owners": ["public"]}])
    after = AdapterTable.from_config(cfg)
    assert after.for_tenant("shared", A).ref == before.for_tenant("shared", A).ref
    assert 1 <= before.for_tenant("shared", A).ref[1] < 2**31
    # The same on every router and engine: a digest, not an order or a process's hash seed.
    assert adapter_id(MODEL, "shared", "org/s") == before.for_tenant("shared", A).ref[1]
    # New weights (a new path) are a new adapter to vLLM, whose cache holds weights by id.
    moved = AdapterTable.from_config(_config([{"name": "shared", "path": "org/s2",
                                               "owners": ["public"]}]))
    assert moved.for_tenant("shared", A).ref[1] != before.for_tenant("shared", A).ref[1]


def _pipeline(tenant: Tenant):
    cfg = _config()
    gate = TenantGate(cfg)
    engine = Engine(tokens=3)
    usage = Usage()

    class Tenants:
        def __init__(self) -> None:
            self.gate, self.adapters = gate, AdapterTable.from_config(cfg)

        async def authenticate(self, authorization):
            return tenant

    pipeline = RequestPipeline(RouterSettings(), Tenants(), {MODEL: engine},
                               {MODEL: AdmissionController(8, max_queued=10)},
                               {MODEL: Feed()}, {}, "router-1", usage=usage)
    return pipeline, engine, usage


def _ask(pipeline, model):
    body = {"model": model, "prompt": "hello", "max_tokens": 3}
    return asyncio.run(pipeline.handle(HttpRequest(body), CompletionRequest, "completion",
                                       "cmpl-"))


def test_an_adapter_request_runs_on_the_base_model_with_the_adapter():
    pipeline, engine, usage = _pipeline(A)
    response = _ask(pipeline, "a-tune")
    assert response.status_code == 200
    assert json.loads(response.body)["model"] == "a-tune"  # the id the client asked for
    [sent] = engine.sent
    assert sent.adapter == ("a-tune", adapter_id(MODEL, "a-tune", "org/a"), "org/a")
    assert sent.cache_salt == A.cache_salt  # the tenant's prefix-cache salt still applies
    [record] = usage.records
    assert (record["model"], record["adapter"], record["tenant"]) == (MODEL, "a-tune", "team-a")
    _ask(pipeline, MODEL)
    assert engine.sent[1].adapter is None and usage.records[1]["adapter"] is None


def _not_found(pipeline, model) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        _ask(pipeline, model)
    return info.value


def test_another_tenants_adapter_is_a_404_like_an_unknown_one():
    pipeline, engine, usage = _pipeline(A)
    theirs, unknown = _not_found(pipeline, "b-tune"), _not_found(pipeline, "no-such")
    for err in (theirs, unknown):
        assert err.status_code == 404 and err.code == "model_not_found"
    # Nothing tells the two apart but the name asked for: b-tune's existence does not leak.
    assert theirs.message.replace("b-tune", "X") == unknown.message.replace("no-such", "X")
    assert "b-tune" not in unknown.message
    assert engine.sent == []


def test_routers_adopt_published_adapters_and_refuse_a_bad_pair(monkeypatch):
    """The live path: a deploy publishes the adapters; a router's refresher adopts them (and
    keeps what it has when the record does not validate against its tenants)."""
    from serve_app.governance import live_config

    start = _config([{"name": "shared", "path": "org/s", "owners": ["public"]}])
    live = live_config.LiveTenants(start, TenantGate(start), "llm")
    grown = _config()
    record = {"now": (live_config.adapters_version(live_config.adapters_of(grown)),
                      live_config.adapters_of(grown))}
    monkeypatch.setattr(live_config, "_read_live", lambda app: (None, record["now"]))
    asyncio.run(live.refresh(force=True))
    assert [a.name for a in live.adapters.visible(A)] == ["a-tune", "shared"]
    bad = {MODEL: [{"name": "x", "path": "org/x", "owners": ["team-z"]}]}
    record["now"] = (live_config.adapters_version(bad), bad)
    asyncio.run(live.refresh(force=True))
    assert [a.name for a in live.adapters.visible(A)] == ["a-tune", "shared"]


def test_an_adapter_only_change_is_a_live_deploy():
    from serve_app.launch import _structure

    one = _config().model_dump(mode="json")
    two = _config([{"name": "shared", "path": "org/s", "owners": ["public"]}]).model_dump(
        mode="json")
    assert _structure(one) == _structure(two)
    lora = _config(lora={"max_loras": 4, "max_lora_rank": 8}).model_dump(mode="json")
    assert _structure(lora) != _structure(one)
