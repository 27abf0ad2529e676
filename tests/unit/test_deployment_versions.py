"""Deployment versions (serve_app.app.deployment_versions): what a redeploy rolls.

Serve replaces a deployment's replicas when its version changes and applies option changes in
place when it does not; these tests pin which config changes reach which deployment."""

from pathlib import Path

from serve_app.app import ROUTER_DEPLOYMENT, deployment_versions, llm_server_name
from serve_app.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _config():
    return load_config(REPO / "deployments" / "local-cpu.yaml")


def _with_model(cfg, **update):
    return cfg.model_copy(update={"models": [cfg.models[0].model_copy(update=update)]})


def test_same_config_same_versions():
    assert deployment_versions(_config()) == deployment_versions(_config())


def test_engine_argument_change_rolls_the_engines_only():
    cfg = _config()
    engine = llm_server_name(cfg.models[0].name)
    changed = _with_model(cfg, engine_kwargs={**cfg.models[0].engine_kwargs, "seed": 7})
    before, after = deployment_versions(cfg), deployment_versions(changed)
    assert after[engine] != before[engine]
    assert after[ROUTER_DEPLOYMENT] == before[ROUTER_DEPLOYMENT]


def test_router_setting_change_rolls_the_router_only():
    cfg = _config()
    engine = llm_server_name(cfg.models[0].name)
    changed = cfg.model_copy(update={"router": cfg.router.model_copy(update={"max_n": 3})})
    before, after = deployment_versions(cfg), deployment_versions(changed)
    assert after[ROUTER_DEPLOYMENT] != before[ROUTER_DEPLOYMENT]
    assert after[engine] == before[engine]


def test_a_max_num_seqs_change_reaches_the_router_through_its_autoscaling_target():
    # The router sizes demand per replica from max_num_seqs when no target is set.
    cfg = _config()
    changed = _with_model(cfg, engine_kwargs={**cfg.models[0].engine_kwargs, "max_num_seqs": 3})
    assert (deployment_versions(changed)[ROUTER_DEPLOYMENT]
            != deployment_versions(cfg)[ROUTER_DEPLOYMENT])


def test_another_engine_class_is_another_engine_version():
    cfg = _config()
    engine = llm_server_name(cfg.models[0].name)
    assert (deployment_versions(cfg, "serve_app.engine.scripted:ScriptedEngine")[engine]
            != deployment_versions(cfg)[engine])


def test_tenants_are_not_part_of_any_version_regression_router_rolled_after_a_live_change():
    """Tenants change live; an engine-argument deploy after a live tenant change rolled the
    routers (their bound tenants differed) and HAProxy's reload cut keep-alive connections."""
    from serve_app.config import TenantSettings

    cfg = _config()
    tenant = TenantSettings(name="t", api_key_sha256=["0" * 64])
    with_tenant = cfg.model_copy(update={"tenants": [tenant]})
    assert deployment_versions(with_tenant) == deployment_versions(cfg)


def test_replica_counts_roll_nothing_regression_scaling_to_one_replica_replaced_every_engine():
    """Replica counts and the autoscaling policy are Serve options, applied in place; in the
    versions they made `serve-app deploy` from two replicas to one replace every engine."""
    cfg = _config()
    for update in ({"min_replicas": 2, "max_replicas": 2}, {"max_replicas": 4},
                   {"initial_replicas": 0, "min_replicas": 0}, {"upscale_delay_s": 1.0}):
        changed = _with_model(cfg, autoscaling=cfg.models[0].autoscaling.model_copy(
            update=update))
        assert deployment_versions(changed) == deployment_versions(cfg), update


def test_an_autoscaling_target_change_reaches_the_router_only():
    cfg = _config()
    engine = llm_server_name(cfg.models[0].name)
    changed = _with_model(cfg, autoscaling=cfg.models[0].autoscaling.model_copy(
        update={"target_per_replica": 3}))
    before, after = deployment_versions(cfg), deployment_versions(changed)
    assert after[ROUTER_DEPLOYMENT] != before[ROUTER_DEPLOYMENT]
    assert after[engine] == before[engine]


# --- What rolls an engine: the code it runs and the fields it reads, nothing else (issue 41) ---

def test_router_only_model_fields_roll_no_engine_regression_a_drain_timeout_rolled_every_gpu():
    """``max_ongoing_requests`` and ``drain_timeout_s`` are Serve options no engine replica
    reads; in the engines' version a change of either replaced every engine (minutes of GPU
    start-up each). Serve still gets the new values, as deployment options."""
    from serve_app.app import llm_server_options

    cfg = _config()
    m = cfg.models[0]
    engine = llm_server_name(m.name)
    for update in ({"max_ongoing_requests": m.max_ongoing_requests + 1},
                   {"drain_timeout_s": m.drain_timeout_s + 30}):
        changed = _with_model(cfg, **update)
        assert deployment_versions(changed)[engine] == deployment_versions(cfg)[engine], update
        options = llm_server_options(changed.models[0])
        serve_name = {"max_ongoing_requests": "max_ongoing_requests",
                      "drain_timeout_s": "graceful_shutdown_timeout_s"}[next(iter(update))]
        assert options[serve_name] == next(iter(update.values()))


def test_a_drain_timeout_change_rolls_no_router_either():
    # Serve alone reads it (graceful_shutdown_timeout_s); max_ongoing_requests, read by the
    # routers' `fixed` capacity policy, rolls them.
    cfg = _config()
    m = cfg.models[0]
    assert (deployment_versions(_with_model(cfg, drain_timeout_s=m.drain_timeout_s + 30))
            == deployment_versions(cfg))
    assert (deployment_versions(_with_model(cfg, max_ongoing_requests=3))[ROUTER_DEPLOYMENT]
            != deployment_versions(cfg)[ROUTER_DEPLOYMENT])


def test_fields_the_engine_reads_roll_it():
    cfg = _config()
    m = cfg.models[0]
    engine = llm_server_name(m.name)
    for update in ({"engine_kwargs": {**m.engine_kwargs, "max_num_seqs": 3}},
                   {"max_model_len": 64}, {"engine_stall_timeout_s": 400.0},
                   {"engine_env": {**m.engine_env, "OMP_NUM_THREADS": "1"}},
                   {"path": m.path + "-other"}):
        assert deployment_versions(_with_model(cfg, **update))[engine] != \
            deployment_versions(cfg)[engine], update


def test_the_engine_code_reads_none_of_the_fields_left_out_of_its_version():
    """The guard of ENGINE_UNREAD_FIELDS: a field left out of the engines' version must not be
    read by the code an engine replica runs (it would keep the old value after a deploy)."""
    import ast

    from serve_app.app import ENGINE_UNREAD_FIELDS, LLMServer, code_files
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS
    from serve_app.engine.server import DEFAULT_ENGINE_CLASS

    reads = []
    for path in code_files(LLMServer.__module__, DEFAULT_ENGINE_CLASS, SCRIPTED_ENGINE_CLASS):
        if path.parent.name == "config":  # the schema defines them; the engine code is below
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_UNREAD_FIELDS:
                reads.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not reads, f"the engine reads fields left out of its version: {reads}"


def test_the_engine_digest_covers_the_engine_code_alone():
    from serve_app.app import LLMServer, code_files
    from serve_app.engine.server import DEFAULT_ENGINE_CLASS

    root = REPO / "serve_app"
    files = {p.relative_to(root).as_posix()
             for p in code_files(LLMServer.__module__, DEFAULT_ENGINE_CLASS)}
    assert {"engine/server.py", "engine/vllm_adapter.py", "config/model.py",
            "__init__.py"} <= files
    # Of observability/, only the tracing the engine replica does (its spans).
    engine_code = {f for f in files if not f.startswith("observability/")}
    assert files - engine_code <= {"observability/__init__.py", "observability/tracing.py"}
    assert {f.split("/")[0] for f in engine_code} <= {"__init__.py", "engine", "config"}, files


def test_serve_applies_the_router_only_fields_in_place():
    """What Serve (Ray 2.60's DeploymentVersion) does with a deploy that changes only
    max_ongoing_requests and drain_timeout_s: no replica restarts; max_ongoing_requests reaches
    the running replicas through reconfigure() and the handles through a broadcast;
    graceful_shutdown_timeout_s is the controller's own, read when it stops a replica."""
    from ray.serve._private.version import DeploymentVersion

    from serve_app.app import build_app

    def engine_version(cfg):
        server = next(iter(build_app(cfg)._bound_deployment.init_args[1].values()))
        d = server._bound_deployment
        return DeploymentVersion(
            d.version, d._deployment_config, d.ray_actor_options,
            placement_group_bundles=d._replica_config.placement_group_bundles,
            placement_group_strategy=d._replica_config.placement_group_strategy)

    cfg = _config()
    m = cfg.models[0]
    before = engine_version(cfg)
    after = engine_version(_with_model(cfg, max_ongoing_requests=m.max_ongoing_requests + 1,
                                       drain_timeout_s=m.drain_timeout_s + 30))
    assert not before.requires_actor_restart(after)
    assert before.requires_actor_reconfigure(after)
    assert before.requires_long_poll_broadcast(after)
    assert after.deployment_config.max_ongoing_requests == m.max_ongoing_requests + 1
    assert after.deployment_config.graceful_shutdown_timeout_s == m.drain_timeout_s + 30
    # An engine argument does restart them.
    seed = engine_version(_with_model(cfg, engine_kwargs={**m.engine_kwargs, "seed": 7}))
    assert before.requires_actor_restart(seed)


def _versions_of_a_copy(tmp_path, edit=None) -> dict[str, str]:
    """deployment_versions of a copy of the repository's code (serve_app/ and bench/), after
    ``edit(copy_root)``, in a fresh interpreter that imports the copy."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "copy"
    if not copy.exists():
        for top in ("serve_app", "bench"):
            shutil.copytree(REPO / top, copy / top, ignore=lambda d, names: [
                n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir()
                or n in ("__pycache__", "out", "results")])
    if edit is not None:
        edit(copy)
    config = str(REPO / "deployments" / "local-cpu.yaml")
    code = ("import json, serve_app\n"
            "from serve_app.app import deployment_versions\n"
            "from serve_app.config import load_config\n"
            f"versions = deployment_versions(load_config({config!r}))\n"
            "print(json.dumps([serve_app.__file__, versions]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(copy / "bench")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    where, versions = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(where).is_relative_to(copy), where  # the copy's code, not the checkout's
    return versions


def _append_comment(paths):
    for path in paths:
        with open(path, "a") as f:
            f.write("\n# an edit\n")


def test_editing_the_benchmark_code_rolls_nothing_regression_a_bench_edit_rolled_every_engine(
        tmp_path):
    """The benchmark client, flood, chaos and simulation code was inside serve_app and its
    digest: editing a benchmark (or its docstring) rolled every GPU engine on the next deploy.
    Wherever the benchmark code lives (serve_app/bench/ before, bench/ now), editing it rolls
    nothing."""
    cfg = _config()
    engine = llm_server_name(cfg.models[0].name)
    before = _versions_of_a_copy(tmp_path)
    after = _versions_of_a_copy(tmp_path, lambda root: _append_comment(
        [*root.glob("bench/**/*.py"), *root.glob("serve_app/bench/**/*.py")]))
    assert after[engine] == before[engine]
    assert after == before


def test_router_code_rolls_the_routers_and_engine_code_the_engines(tmp_path):
    cfg = _config()
    engine = llm_server_name(cfg.models[0].name)
    before = _versions_of_a_copy(tmp_path)
    router_edit = _versions_of_a_copy(tmp_path, lambda root: _append_comment(
        [root / "serve_app" / "ingress" / "pipeline.py", root / "serve_app" / "cli.py"]))
    assert router_edit[engine] == before[engine]
    assert router_edit[ROUTER_DEPLOYMENT] != before[ROUTER_DEPLOYMENT]
    engine_edit = _versions_of_a_copy(tmp_path, lambda root: _append_comment(
        [root / "serve_app" / "engine" / "vllm_adapter.py"]))
    assert engine_edit[engine] != router_edit[engine]
    assert engine_edit[ROUTER_DEPLOYMENT] == router_edit[ROUTER_DEPLOYMENT]
