"""build_app(config) -> serve.Application: the router in front of one LLMServer per model.

Import paths for Serve:
* ``serve_app.app:app_builder`` takes ``config`` (a YAML path) as its argument, for
  ``serve run serve_app.app:app_builder config=deployments/local-cpu.yaml`` and Serve config files.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from serve_app.config import (
    DEFAULT_CONFIG,
    DEFAULT_DRAIN_TIMEOUT_S,
    APP_NAME,
    AppConfig,
    ModelSettings,
    load_config,
)
from serve_app.engine.placement import replica_placement
from serve_app.engine.server import DEFAULT_ENGINE_CLASS, LLMServer
from serve_app.ingress.router import OpenAIRouter
from serve_app.observability.metrics import ROUTER_METRICS
from serve_app.routing.pinned import ROUTER_CLASS as PINNED_ROUTER_CLASS
from serve_app.serve_private import with_version

ROUTER_DEPLOYMENT = "Router"  # the name OpenAIRouter's @serve.deployment gives it
GRACEFUL_SHUTDOWN_S = DEFAULT_DRAIN_TIMEOUT_S  # a model's drain_timeout_s by default
HEALTH_CHECK_PERIOD_S = 5
HEALTH_CHECK_TIMEOUT_S = 30


# Ray Serve's high-throughput mode (Ray >= 2.56). With the Python proxy and actor-call data plane
# a single proxy process saturates near 2k streamed tokens/s (measured: bench/RESULTS.md).
HIGH_THROUGHPUT_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # Serve's first readiness check of a starting proxy waits 5 s (then 10, 15, ... after each
    # restart). The HAProxy proxy starts HAProxy and its manager actor and, on a loaded head
    # (2 cores beside a CPU hog; Ray's workers run at nice 15), took longer each time: Serve
    # killed it every time, and `serve.start`, waiting on the killed actor, failed.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
}


def ray_env(config: AppConfig) -> dict[str, str]:
    """Environment variables Ray must be started with (on every node) to serve ``config``."""
    return dict(HIGH_THROUGHPUT_ENV) if config.router.high_throughput else {}


def llm_server_name(model: str) -> str:
    """Serve deployment name of ``model``'s LLMServer."""
    return "LLMServer-" + re.sub(r"[^A-Za-z0-9_-]", "_", model)


def llm_server_options(m: ModelSettings) -> dict[str, Any]:
    """Serve deployment options of one model's LLMServer (pure; unit-tested)."""
    a = m.autoscaling
    options: dict[str, Any] = {
        "name": llm_server_name(m.name),
        "max_ongoing_requests": m.max_ongoing_requests,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": m.drain_timeout_s,
        # Output channels are opened on one named replica; requests go where the model's
        # routing policy says (serve_app/routing/pinned.py).
        "request_router_config": {"request_router_class": PINNED_ROUTER_CLASS,
                                  "request_router_kwargs": m.routing.router_kwargs(m.name)},
        **replica_placement(m).deployment_options(),
    }
    if a.min_replicas == a.max_replicas:
        options["num_replicas"] = a.min_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": a.initial_replicas,
            # Serve's routing still reads it; the policy below sizes replicas by queue depth.
            "target_ongoing_requests": m.target_per_replica,
            "metrics_interval_s": a.metrics_interval_s,
            "look_back_period_s": a.look_back_period_s,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "downscale_to_zero_delay_s": a.idle_timeout_s,
            "policy": {
                "policy_function": "serve_app.autoscaling:QueueDepthPolicy",
                "policy_kwargs": {"target_per_replica": m.target_per_replica,
                                  "downscale_utilization": a.downscale_utilization,
                                  "model": m.name},
            },
        }
    if m.engine_env:
        options["ray_actor_options"]["runtime_env"] = {"env_vars": dict(m.engine_env)}
    return options


def build_app(config: AppConfig, engine_class: str = DEFAULT_ENGINE_CLASS) -> Application:
    """The Serve application for ``config``; ``engine_class`` injects the engine (tests).

    Each deployment carries a version made of what its replicas read of the config and the
    code they run (:func:`deployment_versions`). On a redeploy Serve replaces only the
    replicas whose version changed and applies option changes (replica counts, autoscaling,
    max_ongoing_requests, the drain timeout) in place: engine arguments roll the engines
    behind routers that stay, router settings roll the routers and leave the engines
    (minutes of GPU start-up) alone. Without versions Serve
    replaces every replica of an imperatively deployed app on every deploy. (Serve's
    declarative path, `serve deploy` and KubeRay's RayService, gives every deployment the
    config's code version instead and ignores these.)"""
    versions = deployment_versions(config, engine_class)
    servers = {
        m.name: with_version(serve.deployment(LLMServer).options(**llm_server_options(m)),
                             versions[llm_server_name(m.name)])
        .bind(m.model_dump(mode="json", exclude=set(LIVE_MODEL_FIELDS)), engine_class,
              ROUTER_METRICS["adapter_swaps"])
        for m in config.models
    }
    router = with_version(OpenAIRouter.options(
        num_replicas=config.router.num_replicas,
        max_ongoing_requests=config.router.max_ongoing_requests,
        ray_actor_options=router_actor_options(config),
    ), versions[ROUTER_DEPLOYMENT])
    return router.bind(router_view(config).model_dump(mode="json"), servers)


def router_actor_options(config: AppConfig) -> dict[str, Any]:
    """Ray actor options of a router replica (pure; unit-tested): no CPU reserved (it must
    never wait for one an engine holds), the configured custom resources if any."""
    options: dict[str, Any] = {"num_cpus": 0}
    if config.router.resources:
        options["resources"] = dict(config.router.resources)
    return options


# Model fields no engine replica reads, left out of the engines' version: changing them rolls no
# engine. tests/unit/test_deployment_versions.py checks that the engine's code reads none of them.
# * autoscaling: Serve options (num_replicas, autoscaling_config), applied in place; in the
#   version they replaced every engine to scale a model from two replicas to one.
# * routing: read where requests are routed, in the routers' handles (the router's version).
# * max_ongoing_requests: Serve's option of that name. Serve applies it in place
#   (NeedsActorReconfigure: the controller calls reconfigure() on each running replica, whose
#   request cap follows, and tells the handles); the `fixed` capacity policy of the routers
#   reads it too, and it stays in the router's version.
# * drain_timeout_s: Serve's graceful_shutdown_timeout_s (NeedsReconfigure: the controller's own
#   record of each replica, read when it stops one). No replica reads it.
# engine_stall_timeout_s stays in: the engine's stall watch reads it (engine/stall.py).
# * adapters: live (serve_app/governance/live_config.py); each request names its adapter to the
#   engine (GenerationRequest.adapter). Not even bound to the engines (LIVE_MODEL_FIELDS): their
#   constructor arguments stay the same when an adapter comes or goes.
ENGINE_UNREAD_FIELDS = frozenset({"autoscaling", "routing", "max_ongoing_requests",
                                  "drain_timeout_s", "adapters"})
# Model fields that change live, never through a deployment: in no deployment's version, not
# bound to the engines; the routers start from theirs and follow the published ones.
LIVE_MODEL_FIELDS = frozenset({"adapters"})
# Model fields only Serve reads: in no version at all.
SERVE_ONLY_FIELDS = frozenset({"drain_timeout_s"})


def deployment_versions(config: AppConfig, engine_class: str = DEFAULT_ENGINE_CLASS
                        ) -> dict[str, str]:
    """Serve deployment name -> the version :func:`build_app` gives it (pure; unit-tested).

    A version is made of what the deployment's replicas read of the config and the code they
    run (:func:`code_digest`): an engine's, of its model's settings less
    :data:`ENGINE_UNREAD_FIELDS`, its engine class and the files of ``serve_app`` an engine
    replica imports (not the router's, not ``bench/``); the router's, of :func:`router_view`
    less the live tenants and the Serve-only fields, and the files a router replica imports."""
    engine_code = code_digest(LLMServer.__module__, engine_class)
    versions = {llm_server_name(m.name): deployment_version(
        m.model_dump(mode="json", exclude=set(ENGINE_UNREAD_FIELDS)), engine_class,
        code=engine_code)
        for m in config.models}
    # Tenants are live (serve_app/governance/live_config.py): every router replica adopts the
    # published list within a second, so they are no part of the router's version. With them
    # in it, the first redeploy after a live tenant change (an engine argument, say) rolled the
    # routers too, and HAProxy's reload cut keep-alive connections (found by the two-node
    # rollout test).
    router_args = router_view(config).model_dump(mode="json")
    router_args.pop("tenants")
    for m in router_args["models"]:  # of autoscaling the router reads its target alone
        m["autoscaling"] = {"target_per_replica": m["autoscaling"]["target_per_replica"]}
        for name in SERVE_ONLY_FIELDS | LIVE_MODEL_FIELDS:
            m.pop(name)
    versions[ROUTER_DEPLOYMENT] = deployment_version(
        router_args, sorted(m.name for m in config.models),
        code=code_digest(OpenAIRouter.func_or_class.__module__, PINNED_ROUTER_CLASS))
    return versions


def deployment_version(*init_args: Any, code: str) -> str:
    """A deployment's version: its constructor arguments and ``code``, the digest of the code
    its replicas run (:func:`code_digest`).

    Serve's public API no longer takes versions (:func:`serve_app.serve_private.with_version`);
    an imperative deploy without one counts every deployment as changed. The code digest
    makes an upgrade of the code a replica runs roll that deployment, as it must."""
    digest = hashlib.sha256(json.dumps(init_args, sort_keys=True, default=str).encode())
    digest.update(code.encode())
    return digest.hexdigest()[:16]


_PACKAGE = "serve_app"
_PACKAGE_ROOT = Path(__file__).resolve().parent
# A string naming a module of the package ("serve_app.engine.scripted:ScriptedEngine"): an
# import path handed to importlib or to Serve, counted as an import of that module.
_IMPORT_PATH = re.compile(r"serve_app(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_.]*)?")


@functools.lru_cache(maxsize=None)
def code_digest(*roots: str) -> str:
    """SHA-256 (path and content) of the files of ``serve_app`` a replica whose code starts at
    ``roots`` can run: the modules ``roots`` name (``"pkg.module"`` or an import path
    ``"pkg.module:Class"``; names outside ``serve_app`` are skipped), every ``serve_app`` module
    those import, at any depth (at the top or inside a function: a lazy import runs too), or
    name in a string (an import path), and the ``__init__.py`` of each one's packages.

    The rule: a replica's version changes with the code it imports and with nothing else. The
    LLMServer deployment starts at ``serve_app.engine.server`` and its engine class; it does
    not import the router, the ingress, the tenancy or admission code, the CLI or ``bench/``
    (``serve_bench``, outside this package), so editing those rolls no engine. Files read
    through anything but an import (data files) are not covered; the package has none on
    the replicas' paths."""
    digest = hashlib.sha256()
    for path in sorted(_module_closure(roots)):
        digest.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def code_files(*roots: str) -> list[Path]:
    """The files :func:`code_digest` hashes for ``roots``, sorted (for tests and curiosity)."""
    return sorted(_module_closure(roots))


def _module_closure(roots: tuple[str, ...]) -> set[Path]:
    files: set[Path] = set()
    pending = [root.split(":")[0] for root in roots]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or not (name == _PACKAGE or name.startswith(_PACKAGE + ".")):
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:  # an attribute (`from serve_app.config import ModelSettings`)
            continue
        files.add(path)
        parts = name.split(".")
        pending.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # its packages
        pending.extend(_imports_of(name, path))
    return files


def _module_file(name: str) -> Path | None:
    base = _PACKAGE_ROOT.joinpath(*name.split(".")[1:])
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _imports_of(name: str, path: Path) -> list[str]:
    """Module names ``path`` (module ``name``) imports or names in an import-path string;
    for ``from a import b``, both ``a`` and ``a.b`` (``b`` may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from its package, up level - 1 packages
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found.append(base)
            found.extend(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _IMPORT_PATH.fullmatch(node.value):
                found.append(node.value.split(":")[0])
    return found


def router_view(config: AppConfig) -> AppConfig:
    """``config`` as the router needs it: each model's engine arguments and environment left
    out (the one value the router derives from them, the autoscaling target, resolved).

    The router's version is made of these arguments (:func:`build_app`). Bound to the whole
    config, an engine-argument change also replaced the router replicas, and with them
    HAProxy's backends: clients whose keep-alive connection the old HAProxy worker closed got
    "Server disconnected without sending a response" (seen in the rolling-update test, 2 of
    ~20 streams). The engines roll behind routers that stay."""
    models = [m.model_copy(update={
        "engine_kwargs": {}, "engine_env": {},
        "autoscaling": m.autoscaling.model_copy(
            update={"target_per_replica": m.target_per_replica})})
        for m in config.models]
    return config.model_copy(update={"models": models})


def app_builder(args: dict[str, str]) -> Application:
    """Serve's application builder: ``args["config"]`` is a deployment YAML path (its tenants
    joined by ``SERVE_APP_TENANTS_FILE``'s, the RayService's Secret).

    The declarative path (`serve deploy`, KubeRay's RayService) publishes the config and its
    tenants like `serve-app deploy` does, with an audit record: the routers and the quota actor
    follow the published list, and without it a tenant added to the Secret had no limit (50 of
    50 requests admitted against its 6 per minute) and a lowered limit kept its old value."""
    from serve_app.governance.live_config import record_deploy

    config = load_config(Path(args.get("config") or DEFAULT_CONFIG))
    record_deploy(APP_NAME, config, "rayservice")
    return build_app(config)
