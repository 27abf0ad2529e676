"""/v1/models cards: a model at zero is never called, the config's length needs no call, an
unknown length is asked by broadcast (every model at once), a failure remembered briefly."""

from __future__ import annotations

import asyncio
import time

from ray.serve.exceptions import DeploymentUnavailableError

from serve_app.ingress.model_cards import ModelCards


class _Result:
    """Stands in for a Serve ``ReplicaResult`` of a broadcast."""

    def __init__(self, delay_s: float, length: int | None) -> None:
        self.delay_s, self.length = delay_s, length

    async def get_async(self) -> dict:
        await asyncio.sleep(self.delay_s)
        if self.length is None:
            raise RuntimeError("replica still loading")
        return {"name": "m", "max_model_len": self.length}


class _Broadcast:
    def __init__(self, results: list[_Result]) -> None:
        self.results = results

    async def _fetch_replica_results_async(self) -> list[_Result]:
        if not self.results:  # what Serve's router raises with no running replica
            raise DeploymentUnavailableError("m")
        return self.results


class _Model:
    """One fake stands for a model's deployment handle and its engine feed (``handle`` is
    itself), so that every engine call of any kind is recorded in ``calls``: ``.remote()`` of
    any method (a call that queues at zero) and ``.broadcast()``."""

    def __init__(self, name: str, calls: list[str], length: int | None = 100,
                 delay_s: float = 0.0, replicas: int = 1, polled: bool = True) -> None:
        self.name, self.calls, self.length, self.delay_s = name, calls, length, delay_s
        self.replicas = [f"{name}-replica-{i}" for i in range(replicas)]
        self.polled_at = 1.0 if polled else 0.0

    @property
    def handle(self) -> "_Model":
        return self

    def broadcast(self, method: str, *args) -> _Broadcast:
        self.calls.append(f"{self.name}.broadcast.{method}")
        return _Broadcast([_Result(self.delay_s, self.length) for _ in self.replicas])

    def __getattr__(self, method: str):  # handle.<method>.remote(): a call through Serve
        if method.startswith("_"):
            raise AttributeError(method)
        model = self

        class _Method:
            def remote(self, *args):
                model.calls.append(f"{model.name}.remote.{method}")

                async def answer() -> dict:
                    return await _Result(model.delay_s, model.length).get_async()

                return answer()

        return _Method()


def test_a_model_at_zero_is_listed_without_any_engine_call_regression():
    """Listing models asked every engine for its card: at zero replicas the call queued in
    Serve's handle, Serve counted it as demand, and a client listing models every 10 s kept
    every model warm."""
    calls: list[str] = []
    cards = ModelCards({"cold": _Model("cold", calls, replicas=0)}, created=1)
    for _ in range(3):
        listed = asyncio.run(cards.cards(["cold"]))
        assert listed == [{"id": "cold", "object": "model", "created": 1,
                           "owned_by": "serve-app", "root": "cold"}]
        assert asyncio.run(cards.card("cold"))["id"] == "cold"
    assert calls == []


def test_the_config_length_makes_the_card_without_asking_the_engine():
    calls: list[str] = []
    cards = ModelCards({"m": _Model("m", calls, length=100)}, {"m": 4096}, created=1)
    assert asyncio.run(cards.card("m"))["max_model_len"] == 4096
    assert calls == []


def test_a_live_model_is_asked_once_by_broadcast_and_its_length_kept_at_zero():
    calls: list[str] = []
    model = _Model("m", calls, length=2048, replicas=2)
    cards = ModelCards({"m": model}, {"m": None}, created=1)
    assert asyncio.run(cards.card("m"))["max_model_len"] == 2048
    model.replicas = []  # scaled to zero since: the last answer stands, nothing is called
    assert asyncio.run(cards.card("m"))["max_model_len"] == 2048
    assert calls == ["m.broadcast.model_info"]


def test_a_router_whose_feed_has_not_polled_asks_by_broadcast_which_fails_at_zero():
    """Before its first poll the feed knows no replica; a broadcast reaches running replicas
    only (at zero Serve raises at once, queueing nothing)."""
    calls: list[str] = []
    cards = ModelCards({"m": _Model("m", calls, replicas=0, polled=False)}, created=1,
                       failure_ttl_s=60)
    assert "max_model_len" not in asyncio.run(cards.card("m"))
    asyncio.run(cards.card("m"))
    assert calls == ["m.broadcast.model_info"]  # the failure is remembered


def test_models_are_asked_at_once_and_a_slow_one_does_not_hold_the_others_regression():
    """Each model used to be asked in turn with up to 5 s each: one loading model slowed the
    listing of all of them."""
    calls: list[str] = []
    cards = ModelCards({n: _Model(n, calls, length=length, delay_s=0.3)
                        for n, length in (("a", 100), ("b", 200), ("c", 300))}, created=1)
    t0 = time.monotonic()
    listed = asyncio.run(cards.cards(["a", "b", "c"]))
    assert time.monotonic() - t0 < 0.8  # concurrent: about one ask, not three
    assert [c["max_model_len"] for c in listed] == [100, 200, 300]
    asyncio.run(cards.cards(["a", "b", "c"]))
    assert len(calls) == 3  # lengths kept: not asked again


def test_a_failed_model_keeps_its_card_and_is_not_asked_again_until_its_ttl():
    calls: list[str] = []
    down = _Model("down", calls, length=None)
    cards = ModelCards({"up": _Model("up", calls), "down": down}, created=1, failure_ttl_s=60)
    first = asyncio.run(cards.cards(["up", "down"]))
    assert "max_model_len" not in first[1] and first[1]["id"] == "down"
    asyncio.run(cards.cards(["up", "down"]))
    assert calls.count("down.broadcast.model_info") == 1  # the failure is remembered
    cards.failure_ttl_s = 0
    down.length = 50
    assert asyncio.run(cards.card("down"))["max_model_len"] == 50  # asked again after the TTL


def test_an_ask_past_its_bound_counts_as_a_failure():
    calls: list[str] = []
    cards = ModelCards({"slow": _Model("slow", calls, delay_s=5)}, created=1, ask_timeout_s=0.05)
    t0 = time.monotonic()
    card = asyncio.run(cards.card("slow"))
    assert time.monotonic() - t0 < 1 and "max_model_len" not in card
