"""``GET /ready``: whether the stack can answer now, not only accept.

``/health`` says the router is up; ``/v1/models`` answers from the config as soon as the router
is (it must never wake a model at zero, :mod:`serve_app.ingress.model_cards`). Neither says the
engines have loaded: a script that waited on ``/v1/models`` sent its load while an 8B engine was
still compiling, and measured nothing (bench/RESULTS.md 42c). ``/ready`` answers 200 once every
model that keeps replicas (``autoscaling.min_replicas`` >= 1) has a live engine replica in this
router's engine feed, 503 until then. A model allowed to sit at zero is ready at zero: its
requests wake it.

It is for start-up and roll-out scripts that wait on the engines; a load balancer's health
check wants ``/health`` (one model that cannot be placed must not take the router, and with it
every other model, out of rotation). The body gives counts only: like ``/health`` it needs no
API key, so it names no model."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence


class LiveView(Protocol):
    """What readiness reads of a model's engine feed (:class:`EngineFeed`)."""

    replicas: Sequence[Any]  # the live replicas of the last poll; [] at zero or before one


def readiness(feeds: Mapping[str, LiveView], kept: Mapping[str, int]) -> tuple[bool, dict[str, Any]]:
    """(ready, body) for the models of ``feeds``; ``kept`` maps a model to its ``min_replicas``.
    Ready when every model with ``kept`` >= 1 has at least one live replica."""
    waiting = [m for m, feed in feeds.items() if kept.get(m, 1) >= 1 and not feed.replicas]
    return not waiting, {"status": "loading" if waiting else "ready",
                         "models": len(feeds), "models_loading": len(waiting)}
