"""Tenant-owned LoRA adapters on the real vLLM CPU engine (issue 39), one app for the module.

The app `lora` runs beside the suite's stack (its Ray, Serve and tenants): the tiny model with
LoRA on (max_loras 2, max_cpu_loras 2) and four adapters the project writes: team-a's, team-b's,
a public one, and team-c's whose weights file is broken. Checked: each tenant's /v1/models
lists exactly what it may use; greedy output through the stack equals vLLM's own with the same
adapter (and differs from the base model's); three adapters on two slots are all served, the
engine swapping the least recently used out; another tenant's adapter and an unknown one are
both 404; the broken adapter is a 503 naming it while the others serve on; usage records carry
the adapter; adding and removing an adapter with a live deploy restarts no replica. The check
against vLLM's own output (a second engine start) runs in `make test-long`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serve_app.launch import wait_until_serving
from serve_app.observability.metrics import ROUTER_METRICS

from .conftest import exported, wait_until
from .prometheus import targets_health

pytestmark = pytest.mark.integration

APP, PREFIX, MODEL = "lora", "/lora", "tiny-lora-base"
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]
MAX_TOKENS = 16
OWNERS = {"a-tune": ["team-a"], "b-tune": ["team-b"], "shared": ["public"],
          "broken": ["team-c"]}
# Who asks for each adapter in the parity test: an owner.
ASKER = {"": "team-a", "a-tune": "team-a", "b-tune": "team-b", "shared": "team-c"}


def _config(stack, adapters: dict[str, Path]):
    from serve_app.config import AdapterSettings, LoraSettings

    base = stack["config"].models[0]
    model = base.model_copy(update={
        "name": MODEL, "lora": LoraSettings(max_loras=2, max_lora_rank=8, max_cpu_loras=2),
        "adapters": [AdapterSettings(name=n, path=str(p), owners=OWNERS.get(n, ["team-a"]))
                     for n, p in adapters.items()]})
    return stack["config"].model_copy(update={"models": [model]})


@pytest.fixture(scope="module")
def lora(stack, tmp_path_factory):
    from ray import serve

    from serve_app.adapter_files import ADAPTER_WEIGHTS, write_tiny_adapter
    from serve_app.app import build_app
    from serve_app.config.app import check_adapter_folders

    root = tmp_path_factory.mktemp("adapters")
    folders = {name: write_tiny_adapter(root / name, stack["path"], seed=seed)
               for seed, name in enumerate(["a-tune", "b-tune", "shared", "broken", "late"], 1)}
    (folders["broken"] / ADAPTER_WEIGHTS).write_bytes(b"not a safetensors file")
    late = folders.pop("late")  # added live by the live-change test
    cfg = _config(stack, folders)
    check_adapter_folders(cfg)  # a broken weights file passes the config: it fails at load
    serve.run(build_app(cfg), name=APP, route_prefix=PREFIX, blocking=False)
    base = stack["base"] + PREFIX
    try:
        wait_until_serving(base, timeout_s=300, interval_s=0.2)
        yield {"base": base, "config": cfg, "folders": folders, "late": late,
               "keys": stack["keys"]}
    finally:
        serve.delete(APP)


def _start_reference(folders: dict[str, Path], out_dir: Path, stack
                     ) -> tuple[subprocess.Popen, Path]:
    """Start vLLM's own greedy run (reference_lora.py) for the base model and each working
    adapter, with no Ray; :func:`reference` collects it."""
    spec = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "max_lora_rank": 8,
            "ignore_eos": True,
            "adapters": {n: str(p) for n, p in folders.items() if n != "broken"}}
    out, spec_file = out_dir / "outputs.json", out_dir / "spec.json"
    spec_file.write_text(json.dumps(spec))
    with spec_file.open() as stdin:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("reference_lora.py")),
             str(stack["path"]), str(out)], stdin=stdin, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    return proc, out


def _headers(lora, tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {lora['keys'][tenant]}"}


def _listed(lora, tenant: str) -> set[str]:
    r = httpx.get(f"{lora['base']}/v1/models", headers=_headers(lora, tenant), timeout=30)
    assert r.status_code == 200, r.text
    return {c["id"] for c in r.json()["data"]}


def _complete(lora, tenant: str, model: str, prompt: str = PROMPTS[0],
              stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    if stream:
        body["stream"] = True
    return httpx.post(f"{lora['base']}/v1/completions", json=body,
                      headers=_headers(lora, tenant), timeout=120)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(e["choices"][0]["text"] for e in events if e["choices"])
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference(lora, stack, tmp_path_factory):
    """vLLM's own greedy output for the base model and each working adapter (no Ray)."""
    proc, out = _start_reference(lora["folders"], tmp_path_factory.mktemp("lora-reference"),
                                 stack)
    try:
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(out.read_text())


def test_each_tenant_lists_exactly_what_it_may_use(lora):
    assert _listed(lora, "team-a") == {MODEL, "a-tune", "shared"}
    assert _listed(lora, "team-b") == {MODEL, "b-tune", "shared"}
    assert _listed(lora, "team-c") == {MODEL, "shared", "broken"}
    r = httpx.get(f"{lora['base']}/v1/models/a-tune", headers=_headers(lora, "team-a"),
                  timeout=30)
    assert r.status_code == 200 and r.json()["parent"] == MODEL
    assert httpx.get(f"{lora['base']}/v1/models/a-tune", headers=_headers(lora, "team-b"),
                     timeout=30).status_code == 404


def test_another_tenants_adapter_and_an_unknown_one_are_both_404(lora):
    theirs = _complete(lora, "team-b", "a-tune")
    unknown = _complete(lora, "team-b", "no-such-adapter")
    for r in (theirs, unknown):
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
    assert "a-tune" not in unknown.text


# vLLM's own run is a second engine start beside the app's (~40 s of make test's two cores):
# the LoRA path's other tests, the swaps' panel included, stay in make test.
@pytest.mark.long
def test_greedy_output_equals_vllms_own_with_the_same_adapter(lora, reference):
    """Three adapters on an engine with two LoRA slots (and two in host memory): all served,
    each with vLLM's own output, the least recently used swapped out."""
    from ray import serve

    from serve_app.app import llm_server_name

    got: dict[str, list[str]] = {}
    for name in ["", "a-tune", "b-tune", "shared", "a-tune"]:  # a-tune again: after a swap
        got[name] = [_text(_complete(lora, ASKER[name], name or MODEL, prompt, stream=i == 1))
                     for i, prompt in enumerate(PROMPTS)]
        assert got[name] == reference[name], name
    for name in ("a-tune", "b-tune", "shared"):
        assert got[name] != got[""], f"{name} answers as the base model does"
    server = serve.get_deployment_handle(llm_server_name(MODEL), app_name=APP)
    load = server.engine_load.remote().result(timeout_s=30)
    # Two in host memory (max_cpu_loras), least recent first: b-tune was swapped out.
    assert load.adapters == ("shared", "a-tune"), load.adapters
    # What `serve-app status` shows per engine replica (the router's last poll of it).
    router = serve.get_deployment_handle("Router", app_name=APP)
    wait_until(lambda: router.admission_state.remote().result(timeout_s=30)[MODEL][
        "per_replica"][0]["adapters"] == ["shared", "a-tune"], 10, 0.1)
    # The swaps in the metrics, as Ray's metrics agents export them: each adapter loaded (a-tune
    # twice), a-tune evicted for shared and b-tune for a-tune's return.
    metric = "ray_" + ROUTER_METRICS["adapter_swaps"] + "_total"

    def swaps() -> dict[tuple[str, str], float]:
        return {(labels["event"], labels["adapter"]): value for labels, value in exported(metric)
                if labels.get("model") == MODEL}
    wanted = {("load", "a-tune"): 2, ("load", "b-tune"): 1, ("load", "shared"): 1,
              ("evict", "a-tune"): 1, ("evict", "b-tune"): 1}
    try:
        wait_until(lambda: all(swaps().get(k, 0) >= n for k, n in wanted.items()), 60, 0.5)
    except AssertionError:
        raise AssertionError(f"swaps exported: {swaps()}") from None


@pytest.mark.long  # 16 s; the make-test tier keeps every other panel against Prometheus
def test_the_dashboards_adapter_swap_panels_draw_the_engines_swaps(lora, prometheus):
    """The dashboard panels of series only a model serving adapters exports (the suite's stack
    has none: test_dashboards_prometheus.py leaves them to this app), as Grafana queries them,
    against a real Prometheus scraping this app: each draws this model's swaps, per adapter."""
    from serve_app.observability.previews import (datasource_interval_s, finite_points,
                                                  grafana_step, panel_queries, query_range,
                                                  rate_interval)
    from serve_app.observability.dashboards import DASHBOARDS

    step = grafana_step(60, datasource_interval_s())
    queries = [q for name in DASHBOARDS
               for q in panel_queries(name, rate_interval(step, datasource_interval_s()))
               if q.adapters_only]
    assert queries, "no dashboard panel draws the adapter swaps"
    # Three adapters through two slots: each request after the second loads one, evicting.
    for name in ("a-tune", "b-tune", "shared", "a-tune"):
        _text(_complete(lora, ASKER[name], name))

    def drawn(expr: str) -> set[tuple[str, str]]:
        end = time.time()
        return {(s["metric"].get("adapter", ""), s["metric"].get("event", ""))
                for s in query_range(prometheus, expr, end - 60, end, step)
                if s["metric"].get("model") == MODEL and finite_points(s)}
    for q in queries:
        try:
            wait_until(lambda: {("a-tune", "load"), ("shared", "load")} <= drawn(q.expr)
                       and any(event == "evict" for _, event in drawn(q.expr)), 60, 1)
        except AssertionError:
            raise AssertionError(f"{q.panel}: {q.expr} drew {drawn(q.expr)}; targets "
                                 f"{targets_health(prometheus)}") from None


def test_a_broken_adapter_is_a_503_naming_it_and_others_serve_on(lora):
    r = _complete(lora, "team-c", "broken")
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "adapter_unavailable" and "`broken`" in error["message"]
    assert _text(_complete(lora, "team-c", "shared"))  # the engine and other adapters live
    assert _complete(lora, "team-c", "broken").status_code == 503  # and it stays refused


def test_usage_records_carry_the_adapter(lora, stack):
    from serve_app.governance.usage import read_records, usage_files

    request_id = _complete(lora, "team-b", "b-tune").json()["id"]

    def record():
        return next((r for r in read_records(usage_files([stack["usage_dir"]]))
                     if r["request_id"] == request_id), None)

    rec = wait_until(record, 30, 0.2)
    assert (rec["tenant"], rec["model"], rec["adapter"], rec["status"]) == (
        "team-b", MODEL, "b-tune", 200)
    assert rec["completion_tokens"] == MAX_TOKENS


def _replica_actors() -> set[str]:
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name.startswith(f"ServeReplica:{APP}:")}


def test_adding_and_removing_an_adapter_live_restarts_no_replica(lora, stack):
    """What `serve-app deploy` does with a change of adapters only (launch.deploy: the same
    structure, so it records the config live): every router adopts it within about a
    second. And should the app be deployed again with it (a deploy that changed something
    else too), Serve finds every deployment's version and arguments unchanged: the engine and
    router replicas stay the same actors."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.governance.live_config import record_deploy

    before = _replica_actors()
    assert before
    grown = _config(stack, {**lora["folders"], "late": lora["late"]})  # team-a's
    try:
        record_deploy(APP, grown, "live")
        wait_until(lambda: "late" in _listed(lora, "team-a"), 15, 0.1)
        assert "late" not in _listed(lora, "team-b")
        late = _text(_complete(lora, "team-a", "late"))
        assert late != _text(_complete(lora, "team-a", "a-tune"))
        # serve.run returns once the app runs again: a roll would have replaced actors by then.
        serve.run(build_app(grown), name=APP, route_prefix=PREFIX, blocking=False)
        assert _replica_actors() == before
    finally:
        record_deploy(APP, lora["config"], "live")
        serve.run(build_app(lora["config"]), name=APP, route_prefix=PREFIX, blocking=False)
    wait_until(lambda: "late" not in _listed(lora, "team-a"), 15, 0.1)
    assert _complete(lora, "team-a", "late").status_code == 404
    assert _replica_actors() == before
