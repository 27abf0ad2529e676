"""Token budgets: windows, the book, the store sync (a fake store), the 429 (pure logic)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pytest

from serve_app.config import AppConfig, ModelSettings, TenantSettings
from serve_app.governance import budgets as budgets_mod
from serve_app.governance.budgets import BudgetSync, budget_report
from serve_app.ingress.errors import OpenAIError
from serve_app.governance.tenants import TenantGate
from serve_app.governance.budget import BudgetBook, window_of
from serve_app.governance.keys import Tenant, key_digest, new_key


def _ts(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


def _tenant(name: str = "a", tokens: int | None = 200, period: str = "day") -> TenantSettings:
    budget = None if tokens is None else {"tokens": tokens, "period": period}
    return TenantSettings(name=name, api_key_sha256=[key_digest(new_key())],
                          token_budget=budget)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_windows_are_utc_days_and_months():
    assert window_of("day", _ts(2026, 12, 3, 23, 59)) == ("2026-12-03", _ts(2026, 12, 4))
    assert window_of("month", _ts(2026, 12, 31, 12)) == ("2026-12", _ts(2027, 1, 1))
    assert window_of("month", _ts(2026, 2, 1)) == ("2026-02", _ts(2026, 3, 1))
    with pytest.raises(ValueError):
        window_of("week", 0)


def test_spent_budget_refuses_until_the_window_ends_then_starts_at_zero():
    clock = Clock(_ts(2026, 12, 3, 22))
    book = BudgetBook([_tenant(tokens=200)], clock=clock)
    assert book.check("a") is None
    book.charge("a", 150)
    assert book.check("a") is None  # below the budget: admitted (may overshoot in flight)
    book.charge("a", 60)
    refusal = book.check("a")
    assert refusal is not None and refusal.retry_after_s(clock.t) == 2 * 3600
    assert "200 tokens per day" in refusal.message and "2026-12-04T00:00:00Z" in refusal.message
    clock.t = _ts(2026, 12, 4, 0, 0, 1)
    assert book.check("a") is None and book.spent("a") == 0
    assert book.check("no-budget") is None and book.spent("no-budget") is None


def test_a_new_tenant_list_keeps_the_spend():
    book = BudgetBook([_tenant(tokens=200)], clock=Clock(_ts(2026, 12, 3)))
    book.charge("a", 250)
    book.update([_tenant(tokens=200)])  # a redeploy of the same config
    assert book.check("a") is not None
    book.update([_tenant(tokens=1000)])  # a raised budget: the spend still counts
    assert book.spent("a") == 250 and book.check("a") is None


class FakeStore:
    """Ray's internal KV as a dict (what serve_private's kv_* reach)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(budgets_mod, "kv_put", self.data.__setitem__)
        monkeypatch.setattr(budgets_mod, "kv_get", self.data.get)
        monkeypatch.setattr(budgets_mod, "kv_list",
                            lambda prefix: [k for k in self.data if k.startswith(prefix)])
        monkeypatch.setattr(budgets_mod, "kv_del", lambda key: self.data.pop(key, None),
                            raising=False)  # (absent before issue 37)


def test_records_of_every_router_replica_add_up_and_survive_a_restart(monkeypatch):
    store = FakeStore()
    store.install(monkeypatch)
    clock = Clock(_ts(2026, 12, 3, 12))
    tenants = [_tenant(tokens=200)]

    async def main() -> None:
        r1, r2 = BudgetBook(tenants, clock=clock), BudgetBook(tenants, clock=clock)
        s1, s2 = BudgetSync(r1, "llm", "r1"), BudgetSync(r2, "llm", "r2")
        r1.charge("a", 120)
        r2.charge("a", 90)
        await s1.sync()
        await s2.sync()
        await s1.sync()
        assert r1.spent("a") == r2.spent("a") == 210
        assert r1.check("a") is not None and r2.check("a") is not None
        # r1 restarts under a new id, r2 is gone: the new replica knows only after reading.
        fresh = BudgetBook(tenants, clock=clock)
        assert not fresh.ready() and fresh.check("a") is None
        sync = BudgetSync(fresh, "llm", "r3")
        await asyncio.wait_for(sync.ready("a"), 5)
        assert fresh.spent("a") == 210 and fresh.check("a") is not None
        sync._task.cancel()
    asyncio.run(main())
    assert set(store.data) == {"llm/budget/a/2026-12-03/r1", "llm/budget/a/2026-12-03/r2"}
    report = budget_report("llm", tenants, now=clock.t)
    assert report == {"a": {"tokens": 200, "period": "day", "window": "2026-12-03",
                            "spent": 210, "left": 0, "resets_at": "2026-12-04T00:00:00Z"}}


def test_budget_records_are_never_deleted_regression_past_windows_pruned(monkeypatch):
    """Every (tenant, window, router replica) wrote a record that was never deleted: a year of
    daily budgets over 10 routers left 3,650 keys per tenant in the GCS. A sync deletes every
    record of a past window (any replica's, a removed tenant's too) and keeps the current
    ones, and a later window's (a replica whose clock lags must not delete it)."""
    store = FakeStore()
    store.install(monkeypatch)
    clock = Clock(_ts(2026, 12, 3, 23, 59))
    tenants = [_tenant("a", tokens=200), _tenant("m", tokens=5000, period="month")]
    kept = {"llm/budget/a/2026-12-03/r2": b"7", "llm/budget/m/2026-12/r2": b"9",
            "llm/budget/a/2026-12-04/r3": b"1",  # r3's clock is ahead: past midnight
            "other-app/budget/a/2026-11-30/r1": b"3"}  # another app's records are its own
    old = {"llm/budget/a/2026-12-02/r1": b"50", "llm/budget/a/2026-11-30/r9": b"80",
           "llm/budget/gone/2026-12-01/r1": b"5", "llm/budget/m/2026-11/r1": b"400",
           "llm/budget/gone/2025-12/r4": b"1"}
    store.data.update(kept)
    store.data.update(old)

    async def main() -> None:
        book = BudgetBook(tenants, clock=clock)
        sync = BudgetSync(book, "llm", "r1")
        book.charge("a", 10)
        await sync.sync()
        assert set(store.data) == set(kept) | {"llm/budget/a/2026-12-03/r1"}
        assert book.spent("a") == 10 + 7  # r3's next-day record is not today's spend
        store.data["llm/budget/a/2026-12-01/r5"] = b"1"  # written late by a lagging replica
        await sync.sync()  # the same windows: no listing of the whole store every second
        assert "llm/budget/a/2026-12-01/r5" in store.data
        clock.t = _ts(2026, 12, 4, 0, 1)  # a new day: yesterday's records go
        book.charge("a", 3)
        await sync.sync()
        assert {k for k in store.data if k.startswith("llm/")} == {
            "llm/budget/a/2026-12-04/r1", "llm/budget/a/2026-12-04/r3",
            "llm/budget/m/2026-12/r2"}
        assert book.spent("a") == 3 + 1
    asyncio.run(main())


def test_an_unreachable_store_fails_open_on_what_the_replica_knows(monkeypatch):
    def down(*_: object) -> None:
        raise ConnectionError("gcs down")

    monkeypatch.setattr(budgets_mod, "kv_list", down)
    monkeypatch.setattr(budgets_mod, "kv_put", down)
    book = BudgetBook([_tenant(tokens=200)])

    async def main() -> None:
        sync = BudgetSync(book, "llm", "r1")
        await asyncio.wait_for(sync.ready("a"), 5)  # does not hang
        sync._task.cancel()
    asyncio.run(main())
    book.charge("a", 300)
    assert book.check("a") is not None


def test_reservations_count_against_the_budget_until_released():
    """Requests in flight hold their most; a request is admitted while spend plus holds is
    below the budget, so the last one admitted may pass it by at most its own reservation."""
    book = BudgetBook([_tenant(tokens=200)], clock=Clock(_ts(2026, 12, 3, 12)))
    held = []
    while book.check("a") is None:
        held.append(book.reserve("a", 70))
    assert held == [70, 70, 70] and book.held("a") == 210 and book.spent("a") == 0
    book.charge("a", 30)  # one request's tokens so far: its hold shrinks as much
    book.release("a", 30)
    assert book.check("a") is not None  # 30 spent + 180 held
    book.release("a", 140)  # two ended having used nothing more
    assert book.check("a") is None and book.held("a") == 40
    book.release("a", 1000)  # never below zero
    assert book.held("a") == 0
    assert book.reserve("no-budget", 70) == 0


def test_a_budget_held_by_requests_in_flight_says_so_and_asks_for_a_short_retry():
    """Spend below the budget, the rest reserved in flight: the refusal says "reserved" and
    asks for a retry in a second (the reservations come back as requests end), not at the
    window's end hours away as for a spent budget."""
    clock = Clock(_ts(2026, 12, 3, 12))
    book = BudgetBook([_tenant(tokens=200)], clock=clock)
    book.charge("a", 50)
    book.reserve("a", 150)
    refusal = book.check("a", 10)
    assert refusal is not None and refusal.retry_after_s(clock.t) == 1.0
    assert "150 of its 200 tokens per day left" in refusal.message
    assert "reserved by its requests in flight" in refusal.message
    book.release("a", 150)
    book.charge("a", 150)  # the request in flight used all it held: now spent
    refusal = book.check("a", 10)
    assert refusal is not None and refusal.retry_after_s(clock.t) == 12 * 3600
    assert "has used its budget" in refusal.message


def test_nothing_in_flight_is_never_reported_as_reserved_regression_retry_every_second_forever():
    """Two routers, 100 of 2,000 tokens left and nothing held: a request reserving 200 is
    refused by its share over the routers. Called "reserved in flight" with Retry-After 1 s,
    a client would have asked every second until the window ended; it waits for the window."""
    clock = Clock(_ts(2026, 12, 3, 12))
    book = BudgetBook([_tenant(tokens=2000)], clock=clock, routers=2)
    book.charge("a", 1900)
    refusal = book.check("a", 200)
    assert refusal is not None and refusal.retry_after_s(clock.t) == 12 * 3600
    assert "reserved" not in refusal.message


def test_the_gate_answers_a_spent_budget_with_insufficient_quota():
    key = new_key()
    tenant = TenantSettings(name="a", api_key_sha256=[key_digest(key)],
                            token_budget={"tokens": 10, "period": "month"})
    cfg = AppConfig(models=[ModelSettings(name="m", path="m")], tenants=[tenant])
    gate = TenantGate(cfg)
    a = Tenant("a")
    gate.admit(a)
    gate.budgets.charge("a", 10)
    with pytest.raises(OpenAIError) as err:
        gate.admit(a)
    body = err.value.body()["error"]
    assert err.value.status_code == 429
    assert body["type"] == "insufficient_quota" and body["code"] == "insufficient_quota"
    assert int(err.value.headers["Retry-After"]) >= 1


def test_a_tenant_without_a_budget_never_waits_for_the_store(monkeypatch):
    def hangs(*_: object) -> None:
        import time
        time.sleep(1.5)

    monkeypatch.setattr(budgets_mod, "kv_list", hangs)
    book = BudgetBook([_tenant("a", tokens=200), _tenant("free", tokens=None)])

    async def main() -> None:
        sync = BudgetSync(book, "llm", "r1")
        await asyncio.wait_for(sync.ready("free"), 1)
        assert not book.ready("a")
        sync._task.cancel()
    asyncio.run(main())


@pytest.mark.parametrize("routers", [2, 4])
def test_reservations_on_every_router_stay_within_the_budget_regression_budget_overspent_over_routers(
        routers):
    """Each router replica holds its reservations to its part of what is left, so requests
    started together on all of them reserve at most the budget plus one request's reservation
    (each replica once counted only its own reservations against the whole budget: 40 requests
    of 65 tokens over two replicas spent 2,600 of a 2,000-token budget)."""
    clock = Clock(_ts(2026, 12, 3, 12))
    books = [BudgetBook([_tenant(tokens=2000)], clock=clock, routers=routers)
             for _ in range(routers)]
    admitted = [0] * routers
    for _ in range(40):  # started together: the requests arrive at the replicas in turn
        for i, book in enumerate(books):
            if book.check("a", 65) is None:
                book.reserve("a", 65)
                admitted[i] += 1
    assert sum(admitted) * 65 <= 2000 + 65, admitted
    assert sum(admitted) * 65 >= 2000 - routers * 65 * routers, admitted  # not starved either
