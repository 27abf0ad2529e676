"""The official openai client works unchanged: chat and text, streamed and not, models list."""

import pytest
from openai import OpenAI

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oai(stack):
    return OpenAI(base_url=stack["base"] + "/v1", api_key=stack["key"], max_retries=0)


def test_models_list(oai, stack):
    models = oai.models.list().data
    assert [m.id for m in models] == [stack["model"]]
    assert oai.models.retrieve(stack["model"]).id == stack["model"]


def test_text_completion(oai, stack):
    r = oai.completions.create(model=stack["model"], prompt="Hello", max_tokens=8,
                               extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].text, str) and r.choices[0].text


def test_text_completion_streamed(oai, stack):
    chunks = list(oai.completions.create(model=stack["model"], prompt="Hello", max_tokens=10,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_streamed_chunks_after_the_first_come_through_an_output_channel(oai, stack):
    """Streams use the batched output channels (serve_app/engine/channel.py), and their text
    is the same as the whole request's: no chunk lost or reordered on the way."""
    from tests.integration.conftest import admission_state

    kwargs = dict(model=stack["model"], prompt="The quick brown fox", max_tokens=24,
                  temperature=0.0, extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kwargs))
    assert streamed == whole
    assert admission_state(stack)["output_channels"] >= 1


def test_router_reaches_engines_over_grpc_regression_handles_from_the_driver_used_actor_calls(
        stack):
    """The suite's stack runs Serve's throughput-optimized data plane: the router's calls to
    the engine replicas go over its gRPC transport, not as the Ray actor calls the driver's
    handles default to (serve_app/serve_private.py)."""
    from tests.integration.conftest import admission_state

    assert admission_state(stack)["transport"] == "grpc"


def test_chat_completion(oai, stack):
    r = oai.chat.completions.create(model=stack["model"], max_tokens=8,
                                    messages=[{"role": "user", "content": "Hi"}])
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens > 0


def test_chat_completion_streamed(oai, stack):
    stream = oai.chat.completions.create(
        model=stack["model"], max_tokens=12, stream=True, n=2,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "terse"}, {"role": "user", "content": "Hi"}])
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant", "assistant"]  # once per choice
    assert chunks[-1].usage.completion_tokens == 24
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_non_streamed_choices_arrive_whole(oai, stack):
    """Non-streaming requests take vLLM's final output only (one message per request, not one
    per step): every choice still arrives complete, with its finish reason and the usage."""
    r = oai.completions.create(model=stack["model"], prompt="Hello", max_tokens=10, n=3,
                               temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in r.choices)
    assert r.usage.completion_tokens == 30
    streamed = oai.completions.create(model=stack["model"], prompt="Hello", max_tokens=10,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
    whole = oai.completions.create(model=stack["model"], prompt="Hello", max_tokens=10,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_unknown_model_raises_not_found(oai):
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [True, False])
def test_server_timing_phases_add_up(client, stack, stream):
    """With ``router.server_timing`` the response says where its time to the first chunk went:
    the router's queue and dispatch, and inside dispatch the replica's phases from vLLM's own
    engine-core timestamps (the real CPU engine reports them)."""
    from serve_app.engine.timing import parse_server_timing

    body = {"model": stack["model"], "prompt": "Hello there", "max_tokens": 4,
            "ignore_eos": True, "stream": stream}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        r.read()
        phases = parse_server_timing(r.headers.get("server-timing"))
    assert set(phases) == {"queue", "dispatch", "hop_in", "replica", "tokenize", "to_engine",
                           "engine_queue", "prefill", "to_replica", "hop_out"}, phases
    assert all(v >= 0 for v in phases.values()), phases
    # The replica's part lies inside the router's dispatch, and is made of its sub-phases;
    # router and replica share this host's clock, so the hop there and back completes it.
    assert phases["replica"] <= phases["dispatch"] + 0.1
    parts = sum(phases[k] for k in ("tokenize", "to_engine", "engine_queue", "prefill",
                                    "to_replica"))
    assert abs(parts - phases["replica"]) < 0.5, phases
    hop = phases["hop_in"] + phases["replica"] + phases["hop_out"]
    assert abs(hop - phases["dispatch"]) < 0.5, phases


def test_every_request_reaches_its_engine_through_its_serve_call_once(oai, stack):
    """One request path: each request is one Serve call to the LLMServer deployment (counted by
    Serve for ``max_ongoing_requests``, draining and autoscaling), and its engine runs it once:
    the replicas' request count grows by exactly the requests sent, and nothing is left
    unfinished in the engine."""
    from tests.integration.conftest import engine_load, wait_until

    before = engine_load(stack).requests_total
    for n in range(6):
        if n % 2:
            text = "".join(c.choices[0].text for c in oai.completions.create(
                model=stack["model"], prompt=f"Count {n}", max_tokens=5, stream=True,
                extra_body={"ignore_eos": True}) if c.choices)
        else:
            text = oai.chat.completions.create(
                model=stack["model"], messages=[{"role": "user", "content": f"Hi {n}"}],
                max_tokens=5, extra_body={"ignore_eos": True}).choices[0].message.content
        assert text
    after = wait_until(lambda: (x := engine_load(stack)).unfinished == 0 and x.active == 0
                       and x, 30)
    assert after.requests_total - before == 6


def test_status_shows_each_engine_replica_with_its_node_and_requests_taken(oai, stack):
    """`serve-app status` lists, per model, the engine replicas a router's load poll sees: the
    Ray node each runs on and the requests it has taken (how evenly the routers spread them)."""
    import ray

    from serve_app.launch import status
    from tests.integration.conftest import wait_until

    def replicas() -> list[dict]:
        return status(address=None)["models"][stack["model"]]["per_replica"]

    before = {r["replica"]: r["requests_total"] for r in replicas()}
    for n in range(3):
        oai.completions.create(model=stack["model"], prompt=f"Status {n}", max_tokens=2)
    wait_until(lambda: sum(r["requests_total"] - before.get(r["replica"], 0)
                           for r in replicas()) >= 3, 15, 0.2)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert replicas() and all(r["node"] in alive for r in replicas()), replicas()


def test_status_from_a_node_shell_regression_high_throughput_env_emptied_the_engine_view(stack):
    """`serve-app status` run where cluster.yaml's exports hold (Serve's high-throughput mode):
    Serve then refused the router call from outside an event loop and `models` came back {}."""
    import json
    import os
    import subprocess
    import sys

    import ray

    from serve_app.app import HIGH_THROUGHPUT_ENV
    from tests.integration.conftest import REPO

    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "serve_app.cli", "status", "--address", address],
                          cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, **HIGH_THROUGHPUT_ENV})
    assert done.returncode == 0, done.stderr[-3000:]
    view = json.loads(done.stdout)["models"].get(stack["model"])
    assert view and view["per_replica"], f"{done.stdout}\n{done.stderr[-3000:]}"
