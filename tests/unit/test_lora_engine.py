"""The engine side of LoRA: vLLM's arguments, the adapters an engine holds, and that an adapter
change reaches no engine's arguments or version (adding one restarts nothing)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from serve_app.app import (
    build_app,
    deployment_versions,
    llm_server_name,
    llm_server_options,
)
from serve_app.config import LoraSettings, ModelSettings, load_config
from serve_app.engine.adapters import LoadedAdapters
from serve_app.engine.protocol import EngineRequestError
from serve_app.engine.vllm_adapter import engine_args_for

REPO = Path(__file__).resolve().parents[2]


def test_engine_args_enable_lora_with_the_limits():
    m = ModelSettings(name="m", path="/m", lora={"max_loras": 2, "max_lora_rank": 8,
                                                   "max_cpu_loras": 4})
    args = engine_args_for(m)
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"],
            args["max_cpu_loras"]) == (True, 2, 8, 4)
    assert "enable_lora" not in engine_args_for(ModelSettings(name="m", path="/m"))
    assert "max_cpu_loras" not in engine_args_for(
        ModelSettings(name="m", path="/m", lora={"max_loras": 2}))


def _run(coro):
    return asyncio.run(coro)


def test_first_request_loads_then_the_adapter_is_held():
    calls = []

    async def load(name, adapter_id, path):
        calls.append((name, adapter_id, path))
        return True

    held = LoadedAdapters("m", capacity=2)
    for ref in [("a", 11, "/a"), ("a", 11, "/a"), ("b", 12, "/b"), ("a", 11, "/a"),
                ("c", 13, "/c")]:
        _run(held.ensure(ref, load))
    # b was least recently used when c came: it is dropped from the record (vLLM's LRU).
    assert [c[0] for c in calls] == ["a", "b", "c"]
    assert held.names() == ("a", "c") and held.loads == 3


def test_every_load_and_eviction_is_told_to_the_replicas_swap_counter():
    from serve_app.engine.adapter_swaps import count_swaps
    from serve_app.engine.scripted import ScriptedEngine

    async def load(name, adapter_id, path):
        return True

    engine = ScriptedEngine(ModelSettings(name="m", path="./unused", device="cpu",
                                          lora=LoraSettings(max_loras=2)))
    counter = count_swaps(engine, "serve_app_adapter_swaps", "m")
    assert counter is not None and engine.loras.on_swap == counter.record
    swaps = []
    engine.loras.on_swap = lambda event, name: swaps.append((event, name))
    for ref in [("a", 11, "/a"), ("b", 12, "/b"), ("a", 11, "/a"), ("c", 13, "/c")]:
        _run(engine.loras.ensure(ref, load))
    assert swaps == [("load", "a"), ("load", "b"), ("load", "c"), ("evict", "b")]
    assert (engine.loras.loads, engine.loras.evictions) == (3, 1)

    def broken(event, name):
        raise RuntimeError("metrics down")

    engine.loras.on_swap = broken  # a failing metric fails no request
    _run(engine.loras.ensure(("d", 14, "/d"), load))
    assert engine.loras.names() == ("c", "d")
    assert count_swaps(object(), "serve_app_adapter_swaps", "m") is None  # no adapters here
    assert count_swaps(engine, "", "m") is None  # no name given: not counted


def test_a_failed_load_is_a_503_naming_the_adapter_and_holds_nothing():
    async def broken(name, adapter_id, path):
        raise OSError(f"no file in {path}")

    async def fine(name, adapter_id, path):
        return True

    held = LoadedAdapters("m", capacity=2)
    with pytest.raises(EngineRequestError) as info:
        _run(held.ensure(("bad", 5, "/bad"), broken))
    err = info.value
    assert err.status_code == 503 and err.code == "adapter_unavailable"
    assert "`bad`" in err.message and "/bad" in err.message
    assert held.names() == ()
    _run(held.ensure(("good", 6, "/good"), fine))  # other adapters unaffected
    _run(held.ensure(("bad", 5, "/bad"), fine))  # a later request tries again
    assert held.names() == ("good", "bad")


def test_lora_off_refuses_adapters_with_503():
    async def load(*_):
        raise AssertionError("must not load")

    with pytest.raises(EngineRequestError) as info:
        _run(LoadedAdapters("m", capacity=0).ensure(("x", 1, "/x"), load))
    assert info.value.status_code == 503 and "LoRA is off" in info.value.message


def _lora_config(adapters):
    cfg = load_config(REPO / "deployments" / "local-cpu.yaml")
    m = cfg.models[0].model_copy(update={"lora": ModelSettings.model_validate(
        {"name": "x", "path": "x", "lora": {"max_loras": 2, "max_lora_rank": 8}}).lora,
        "adapters": adapters})
    return cfg.model_copy(update={"models": [m]})


def _adapter(name):
    from serve_app.config import AdapterSettings

    return AdapterSettings(name=name, path=f"org/{name}", owners=["public"])


def _engine_bound(cfg):
    """The LLMServer's constructor arguments and its options, as build_app binds them."""
    server = next(iter(build_app(cfg)._bound_deployment.init_args[1].values()))
    return server._bound_deployment.init_args, llm_server_options(cfg.models[0])


def test_adding_an_adapter_changes_no_deployment():
    """Adding or removing an adapter must restart nothing: the engines' constructor
    arguments, options (runtime_env included) and versions, and the router's version, stay."""
    one, two = _lora_config([_adapter("a")]), _lora_config([_adapter("a"), _adapter("b")])
    assert _engine_bound(one) == _engine_bound(two) == _engine_bound(_lora_config([]))
    assert deployment_versions(one) == deployment_versions(two)
    args, _ = _engine_bound(two)
    assert "adapters" not in args[0]


def test_lora_limits_roll_the_engines():
    cfg = _lora_config([])
    m = cfg.models[0]
    bigger = cfg.model_copy(update={"models": [m.model_copy(update={
        "lora": m.lora.model_copy(update={"max_loras": 4})})]})
    before, after = deployment_versions(cfg), deployment_versions(bigger)
    assert before[llm_server_name(m.name)] != after[llm_server_name(m.name)]
