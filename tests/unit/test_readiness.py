"""``GET /ready``'s rule (serve_app/ingress/readiness.py): every model kept warm has a live
engine replica; a model allowed at zero is ready at zero; the body names no model."""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.ingress.readiness import readiness


def feed(live: int) -> SimpleNamespace:
    return SimpleNamespace(replicas=[object()] * live)


def test_a_kept_model_without_a_live_replica_is_loading_and_the_others_do_not_hide_it():
    ok, body = readiness({"big": feed(0), "small": feed(2)}, {"big": 1, "small": 1})
    assert not ok and body == {"status": "loading", "models": 2, "models_loading": 1}


def test_every_kept_model_live_is_ready():
    ok, body = readiness({"big": feed(1), "small": feed(3)}, {"big": 2, "small": 1})
    assert ok and body == {"status": "ready", "models": 2, "models_loading": 0}


def test_a_model_allowed_at_zero_is_ready_at_zero():
    ok, body = readiness({"cold": feed(0), "warm": feed(1)}, {"cold": 0, "warm": 1})
    assert ok and body["models_loading"] == 0


def test_the_body_names_no_model():
    _, body = readiness({"secret-model": feed(0)}, {"secret-model": 1})
    assert "secret-model" not in repr(body)
