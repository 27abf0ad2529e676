"""One real stack for the integration suite: local Ray, Serve, the router and a vLLM CPU engine
serving the tiny model. Started once per session (about a minute) and shared by every test."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve_app.engine.protocol import EngineLoad
from serve_app.launch import wait_until_serving

from .ports import free_port, free_ports

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "tiny-llama"
MODEL = "tiny-llama"
DEFAULT_TENANT = "team-a"
# The shared stack's engine runs at most ENGINE_BATCH requests (max_num_seqs) and the router lets
# HEADROOM more wait inside it, so floods of a few dozen requests saturate it and the backlog
# waits in the router's fair queue, as on a GPU under load.
ENGINE_BATCH = 8
HEADROOM = 2
IN_FLIGHT = ENGINE_BATCH + HEADROOM
# router.stream_stall_timeout_s of the shared stack: short, so the slow-reader test is quick.
STALL_S = 3.0
# The model's engine_stall_timeout_s in the shared stack: short, so the hung-engine test is quick
# (the tiny model's steps take milliseconds).
ENGINE_STALL_S = 10.0
# Tenants of the shared stack: the default one the tests act as, a second unlimited one, and
# tenants whose limits the tenancy tests run into (each test owns its limited tenant).
TENANTS: dict[str, dict] = {
    "team-a": {},
    "team-b": {"priority": "high"},
    "team-c": {},
    "rpm-limited": {"requests_per_minute": 3},
    "tpm-limited": {"tokens_per_minute": 120},
    "no-models": {"models": []},
    # test_governance.py's: rate-limit headers, a concurrency cap, usage records, a budget.
    "headers": {"requests_per_minute": 4, "tokens_per_minute": 100000},
    "capped": {"max_concurrent_requests": 2},
    "usage-a": {},
    "usage-b": {"priority": "low"},
    "budget": {"token_budget": {"tokens": 200, "period": "day"}},
}


# A port for a server a test starts (tests/integration/ports.py: one nothing else takes).
_free_port = free_port
# Tries at starting the suite's stack on fresh ports when one was taken since it was chosen.
PORT_TRIES = 3
# Serve holds a stopping ingress replica (every Router replica: direct ingress behind HAProxy)
# open for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, 30 s by default, so that a load
# balancer outside can deregister it, and only then refuses new connections (HAProxy retries those
# on another replica) and waits for the requests in flight. Each app a test module deletes, each
# router roll and the suite's end waited those 30 s: about six minutes of a run. HAProxy, on this
# machine, is reloaded without a stopping replica as soon as the replica starts to stop, and
# retries a refused connection on another replica, so the suite gives it 1 s. That is harsher
# for the tests that roll routers under load (less time before the old router refuses), and
# production keeps Serve's 30 s. 1 s against 3 s: an app's deletion 3.0 s against 4.0 s, a router
# roll 4.4 s against 8.4 s, seven modules of make test 146-151 s against 162-166 s of pytest
# (bench/RESULTS.md, "make test's ingress drain").
SUITE_INGRESS_DRAIN_S = "1"


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    """URL of a Prometheus scraping the running stack's Ray metrics agents (the committed
    scrape config); skips where the binary is absent."""
    from .prometheus import MISSING, WHY_MISSING, running_prometheus

    if MISSING:
        pytest.skip(WHY_MISSING)
    with running_prometheus(tmp_path_factory.mktemp("prometheus")) as url:
        yield url


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start, as the session starts, what a selected test module runs beside the stack's start
    (its ``start_early(config)``): vLLM's own reference run for the engine-parity test is an
    engine start of ~40 s, which overlaps the stack's instead of following it."""
    started: set[object] = set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and module not in started and hasattr(module, "start_early"):
            started.add(module)
            module.start_early(session.config)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from serve_app.models import write_model

    return write_model("tiny", TINY)


@pytest.fixture(scope="session")
def stack(tiny_model_path, tmp_path_factory):
    """Base URL (``http://host:port``) of the running app, plus handles for white-box checks."""
    from ray import serve

    from serve_app.app import APP_NAME, llm_server_name
    from serve_app.config import TenantSettings, load_config
    from serve_app.launch import start_stack, stop_stack
    from serve_app.governance.keys import key_digest, new_key

    # Read by the Serve controller and replicas Ray starts below (they inherit this environment).
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", SUITE_INGRESS_DRAIN_S)
    cfg = load_config(REPO / "deployments" / "local-cpu.yaml")
    # Tenants with fresh keys: the suite runs with authentication on, as production does.
    keys = {name: new_key() for name in TENANTS}
    tenants = [TenantSettings(name=name, api_key_sha256=[key_digest(keys[name])], **limits)
               for name, limits in TENANTS.items()]
    # A small engine batch so the router's fair queue and admission are exercised by the suite.
    model = cfg.models[0]
    model = model.model_copy(update={"engine_kwargs": {**model.engine_kwargs,
                                                       "max_num_seqs": ENGINE_BATCH},
                                     "engine_stall_timeout_s": ENGINE_STALL_S})
    # Server-Timing on: the phase test reads it (off by default in production configs). No
    # batch places kept back (the CPU default keeps 2 of 64): the suite's tests count the small
    # batches' places exactly; test_capacity covers the reserve.
    router = cfg.router.model_copy(update={
        "server_timing": True, "stream_stall_timeout_s": STALL_S,
        "admission": cfg.router.admission.model_copy(
            update={"headroom": HEADROOM, "poll_interval_s": 0.05, "batch_reserve": 0})})
    # Usage records on (test_governance.py reads them).
    usage_dir = tmp_path_factory.mktemp("usage")
    governance = cfg.governance.model_copy(update={"usage": cfg.governance.usage.model_copy(
        update={"dir": str(usage_dir)})})
    cfg = cfg.model_copy(update={"router": router, "tenants": tenants, "models": [model],
                                 "governance": governance})
    base, cfg = _start_on_free_ports(cfg, start_stack)
    try:  # a loaded 2-core machine starts the engine slowly
        wait_until_serving(base, timeout_s=600, interval_s=0.5)
    except TimeoutError:
        pytest.fail("the app did not become ready in 600 s")
    server = serve.get_deployment_handle(llm_server_name(MODEL), app_name=APP_NAME)
    router_handle = serve.get_deployment_handle("Router", app_name=APP_NAME)
    yield {"base": base, "server": server, "router": router_handle, "model": MODEL,
           "usage_dir": usage_dir,
           "path": tiny_model_path,
           "keys": keys, "key": keys[DEFAULT_TENANT], "config": cfg,
           "headers": {"Authorization": f"Bearer {keys[DEFAULT_TENANT]}"}}
    # However the suite went, the router must hold nothing at its end: a leaked admission slot
    # (in flight with no request behind it) would throttle the model forever.
    state = router_handle.admission_state.remote().result(timeout_s=30)[MODEL]
    deadline = time.time() + 60
    while (state["in_flight"] or state["queued"]) and time.time() < deadline:
        time.sleep(0.2)
        state = router_handle.admission_state.remote().result(timeout_s=30)[MODEL]
    stop_stack()
    assert state["in_flight"] == 0 and state["queued"] == 0, f"router leaked: {state}"


def _start_on_free_ports(cfg, start_stack) -> tuple[str, object]:
    """Start the suite's stack for ``cfg`` on ports of its own (the OpenAI endpoint, HAProxy's
    stats and metrics, Serve's fallback proxy), so that it runs beside `make run` or another
    suite; when one was taken after it was chosen (PortInUseError, raised before Ray starts),
    again on fresh ones. Returns the base URL and the config as started."""
    from serve_app.launch import PortInUseError

    for attempt in range(PORT_TRIES):
        port, stats, metrics, fallback = free_ports(4)
        router = cfg.router.model_copy(update={
            "port": port, "haproxy_stats_port": stats, "haproxy_metrics_port": metrics,
            "fallback_proxy_port": fallback})
        try:
            # As `serve-app run` starts it (the same data plane, with the dashboard, whose head
            # writes the Prometheus service-discovery file the committed scrape config reads).
            # Logical CPUs: the autoscaling and TP tests add apps whose engines take one or two.
            started = cfg.model_copy(update={"router": router})
            return start_stack(started, num_cpus=4, log_to_driver=False), started
        except PortInUseError as err:
            if attempt == PORT_TRIES - 1:
                raise
            print(f"\n{err}; starting on other ports")
    raise AssertionError("unreachable")


@pytest.fixture
def client(stack):
    with httpx.Client(base_url=stack["base"], timeout=120, headers=stack["headers"]) as c:
        yield c


def engine_load(stack) -> EngineLoad:
    return stack["server"].engine_load.remote().result(timeout_s=30)



def admission_state(stack) -> dict:
    """The router's admission view of the model: in_flight, queued, capacity, replicas, ..."""
    return stack["router"].admission_state.remote().result(timeout_s=30)[stack["model"]]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value (returned) or fail after timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


async def complete_recorded(client, base: str, model: str, key: str, tenant: str, ids: list,
                            max_tokens: int, stream: bool = False) -> None:
    """One completion as ``tenant`` (its ``key``) at ``base``; appends (tenant, request id) once
    it is answered."""
    body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "stream": stream}
    async with client.stream("POST", f"{base}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, await r.aread()
        await r.aread()
        # The router's id leads X-Request-Id (Ray Serve appends its own after a comma); it is
        # the id the engine saw.
        ids.append((tenant, r.headers["x-request-id"].split(",")[0].strip()))


@contextlib.contextmanager
def sampled(read, every_s: float = 0.02):
    """A list that a thread fills with ``read()`` every ``every_s`` while the block runs (the
    router's admission state under a load, say); stopped and joined on the way out."""
    samples: list = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            samples.append(read())
            time.sleep(every_s)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def scripted_app(stack, model: str, batch: int, step_s: float, max_ongoing_requests: int = 256,
                 batch_reserve: int = 0, start_file: str | None = None):
    """The suite's router configuration and tenants in front of one scripted-engine replica
    (``batch`` places, a step every ``step_s``, Serve's ``max_ongoing_requests``), as a Serve
    application to run beside the shared stack. ``batch_reserve``: the routers'
    ``admission.batch_reserve`` (the suite's stack keeps 0). ``start_file``: the engine stays
    in its start until that file exists (its ``scripted_start_file``): ``serve.run`` of it
    returns only then."""
    from serve_app.app import build_app
    from serve_app.config import ModelSettings
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS

    settings = ModelSettings(name=model, path=str(stack["path"]), device="cpu",
                             max_model_len=2048, max_ongoing_requests=max_ongoing_requests,
                             engine_kwargs={
                                 "max_num_seqs": batch, "scripted_step_s": step_s,
                                 "scripted_start_file": start_file})
    cfg = stack["config"]
    router = cfg.router.model_copy(update={"admission": cfg.router.admission.model_copy(
        update={"batch_reserve": batch_reserve})})
    return build_app(cfg.model_copy(update={"models": [settings], "router": router}),
                     SCRIPTED_ENGINE_CLASS)


def start_scripted_app(stack, app: str, prefix: str, model: str, batch: int,
                       step_s: float, max_ongoing_requests: int = 256,
                       batch_reserve: int = 0) -> str:
    """Run :func:`scripted_app` as ``app`` beside the shared stack, wait until it is ready, and
    return its base URL. The caller deletes it (serve.delete)."""
    from ray import serve

    serve.run(scripted_app(stack, model, batch, step_s, max_ongoing_requests, batch_reserve),
              name=app, route_prefix=prefix, blocking=False)
    base = stack["base"] + prefix
    wait_until_serving(base, timeout_s=120, interval_s=0.2)
    return base


# Where Ray writes the metrics agents' addresses (what Prometheus's file discovery reads).
METRICS_TARGETS_FILE = Path("/tmp/ray/session_latest/prom_metrics_service_discovery.json")


def exported(metric: str) -> list[tuple[dict[str, str], float]]:
    """Every series of ``metric`` as Ray's metrics agents export it now (the targets
    Prometheus scrapes): its labels and value. An agent that does not answer is skipped."""
    import json
    import re

    targets = [t for group in json.loads(METRICS_TARGETS_FILE.read_text())
               for t in group["targets"]]
    out: list[tuple[dict[str, str], float]] = []
    for target in targets:
        try:
            text = httpx.get(f"http://{target}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith(metric + "{"):
                labels, value = line.rsplit(" ", 1)
                out.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return out
