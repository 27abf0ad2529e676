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
