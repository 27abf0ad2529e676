"""/v1/models cards: every model asked at once, a failure remembered briefly, a length kept."""

from __future__ import annotations

import asyncio
import time

from serve_app.ingress.model_cards import ModelCards


class _Info:
    """Stands in for a handle's ``model_info`` method: ``.remote()`` gives an awaitable."""

    def __init__(self, delay_s: float, length: int | None, calls: list[str], name: str) -> None:
        self.delay_s, self.length, self.calls, self.name = delay_s, length, calls, name

    def remote(self):
        self.calls.append(self.name)

        async def answer() -> dict:
            await asyncio.sleep(self.delay_s)
            if self.length is None:
                raise RuntimeError("replica still loading")
            return {"max_model_len": self.length}

        return answer()


class _Handle:
    def __init__(self, delay_s: float, length: int | None, calls: list[str], name: str) -> None:
        self.model_info = _Info(delay_s, length, calls, name)


def test_models_are_asked_at_once_and_a_slow_one_does_not_hold_the_others_regression():
    """Each model used to be asked in turn with up to 5 s each: one loading model slowed the
    listing of all of them."""
    calls: list[str] = []
    cards = ModelCards({"a": _Handle(0.3, 100, calls, "a"), "b": _Handle(0.3, 200, calls, "b"),
                        "c": _Handle(0.3, 300, calls, "c")}, created=1)
    t0 = time.monotonic()
    listed = asyncio.run(cards.cards(["a", "b", "c"]))
    assert time.monotonic() - t0 < 0.8  # concurrent: about one ask, not three
    assert [c["max_model_len"] for c in listed] == [100, 200, 300]
    asyncio.run(cards.cards(["a", "b", "c"]))
    assert sorted(calls) == ["a", "b", "c"]  # lengths kept: not asked again


def test_a_failed_model_keeps_its_card_and_is_not_asked_again_until_its_ttl():
    calls: list[str] = []
    cards = ModelCards({"up": _Handle(0, 100, calls, "up"), "down": _Handle(0, None, calls, "down")},
                       created=1, failure_ttl_s=60)
    first = asyncio.run(cards.cards(["up", "down"]))
    assert "max_model_len" not in first[1] and first[1]["id"] == "down"
    asyncio.run(cards.cards(["up", "down"]))
    assert calls.count("down") == 1  # the failure is remembered
    cards.failure_ttl_s = 0
    cards.handles["down"] = _Handle(0, 50, calls, "down")
    assert asyncio.run(cards.card("down"))["max_model_len"] == 50  # asked again after the TTL


def test_an_ask_past_its_bound_counts_as_a_failure():
    calls: list[str] = []
    cards = ModelCards({"slow": _Handle(5, 100, calls, "slow")}, created=1, ask_timeout_s=0.05)
    t0 = time.monotonic()
    card = asyncio.run(cards.card("slow"))
    assert time.monotonic() - t0 < 1 and "max_model_len" not in card
