"""What a request costs its tenant (issue 37): reserved at admission, charged as tokens flow,
settled at the end, including for a client that leaves during prefill.

The tests drive the real :class:`RequestPipeline` (admission controller, tenant gate, budget
book, fair queue) with a scripted engine handle and a fake HTTP request: no Ray cluster.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from serve_app.admission.controller import AdmissionController
from serve_app.config import AppConfig, ModelSettings, RouterSettings, TenantSettings
from serve_app.engine.protocol import ChoiceDelta, GenerationChunk
from serve_app.ingress.pipeline import RequestPipeline
from serve_app.ingress.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.governance.tenants import TenantGate
from serve_app.governance.adapters import AdapterTable
from serve_app.governance.keys import Tenant, key_digest, new_key

MODEL = "m"
PROMPT_TOKENS = 5  # what the scripted engine reports for every prompt


class Engine:
    """The model's streaming handle: ``generate.remote`` gives a scripted stream. Each request
    waits ``prefill`` (an Event: set it to let the prefill end) before its first chunk, then
    yields ``tokens`` tokens in chunks of ``per_chunk``, waiting ``step`` between chunks."""

    def __init__(self, tokens: int, per_chunk: int = 1, step: asyncio.Event | None = None,
                 prefill: asyncio.Event | None = None) -> None:
        self.tokens, self.per_chunk = tokens, per_chunk
        self.step, self.prefill = step, prefill
        self.sent: list[Any] = []
        self.cancelled = 0
        self.generate = self

    def remote(self, generation: Any) -> "_Stream":
        self.sent.append(generation)
        return _Stream(self)


class _Stream:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.left = engine.tokens
        self.first = True
        self.done = False

    def __aiter__(self) -> "_Stream":
        return self

    async def __anext__(self) -> Any:
        e = self.engine
        if self.done or self.left <= 0:
            raise StopAsyncIteration
        if self.first and e.prefill is not None:
            await e.prefill.wait()
        elif not self.first and e.step is not None:
            await e.step.wait()
            e.step.clear()
        else:
            await asyncio.sleep(0)
        n = min(e.per_chunk, self.left)
        self.left -= n
        last = self.left == 0
        chunk = GenerationChunk([ChoiceDelta(0, "x" * n, n, "length" if last else None)],
                                PROMPT_TOKENS, last, None, "replica-1" if self.first else None)
        self.first = False
        return chunk.to_wire()

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.engine.cancelled += 1


class Feed:
    replicas = ["replica-1"]

    def start(self) -> None:
        pass


class Tenants:
    """LiveTenants' three members the pipeline uses."""

    def __init__(self, gate: TenantGate, tenant: Tenant) -> None:
        self.gate, self.tenant = gate, tenant
        self.adapters = AdapterTable([])

    async def authenticate(self, authorization: str | None) -> Tenant:
        return self.tenant


class Usage:
    enabled = True

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def record(self, **fields: Any) -> None:
        self.records.append(fields)


class HttpRequest:
    """The ASGI request: a JSON body, then ``http.disconnect`` once ``leave`` is set."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.raw = json.dumps(body).encode()
        self.headers = {"authorization": "Bearer k", "content-length": str(len(self.raw))}
        self.leave = asyncio.Event()

    async def stream(self):
        yield self.raw

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}


def _setup(engine: Engine, capacity: int = 64, **limits: Any
           ) -> tuple[RequestPipeline, TenantGate, AdmissionController, Usage]:
    settings = RouterSettings()
    tenant = TenantSettings(name="t", api_key_sha256=[key_digest(new_key())], **limits)
    cfg = AppConfig(models=[ModelSettings(name=MODEL, path=MODEL)], tenants=[tenant])
    gate = TenantGate(cfg)
    gate.quotas.clock = lambda: 0.0  # no refill while a test runs: TPM's level shows the charge
    controller = AdmissionController(capacity, max_queued=1000)
    usage = Usage()
    pipeline = RequestPipeline(settings, Tenants(gate, Tenant("t")), {MODEL: engine},
                               {MODEL: controller}, {MODEL: Feed()}, {}, "router-1",
                               usage=usage)
    return pipeline, gate, controller, usage


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 8, **fields}


def _tpm_used(gate: TenantGate) -> float:
    bucket = gate.quotas._tpm["t"]
    return bucket.capacity - bucket.level


async def _until(predicate, timeout_s: float = 2.0) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(wait(), timeout_s)


# -- finding 3: abandoned prefill is free --------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_abandoned_prefill_is_free_regression_client_gone_before_first_chunk_pays(stream):
    """A client that left while its request was in prefill was charged nothing: no TPM, no
    budget, no fair-share service, and a usage record without tokens. The engine did the
    prefill: the tenant pays its prompt (the estimate: the first chunk never came)."""
    prefill = asyncio.Event()
    engine = Engine(tokens=8, prefill=prefill)
    pipeline, gate, controller, usage = _setup(
        engine, tokens_per_minute=100000, token_budget={"tokens": 100000, "period": "day"})

    async def main() -> Any:
        http = HttpRequest(_body(stream=stream))
        answer = asyncio.ensure_future(pipeline.handle(http, CompletionRequest, "completion",
                                                       "cmpl-"))
        await _until(lambda: engine.sent)  # dispatched: the engine is in the prefill
        http.leave.set()
        return await asyncio.wait_for(answer, 2)

    response = asyncio.run(main())
    assert response.status_code == 499 and engine.cancelled == 1
    assert gate.budgets.spent("t") > 0
    assert _tpm_used(gate) > 0
    assert controller.queue.service("t") > 0
    assert controller.in_flight == 0
    [record] = usage.records
    assert record["status"] == 499 and record["prompt_tokens"] > 0
    assert record["completion_tokens"] == 0


def test_a_request_that_left_while_queued_costs_nothing():
    """Never dispatched: no engine work, so no charge (and its reservation is released)."""
    engine = Engine(tokens=4, prefill=asyncio.Event())
    pipeline, gate, controller, usage = _setup(
        engine, capacity=1, token_budget={"tokens": 100000, "period": "day"})

    async def main() -> None:
        first = HttpRequest(_body())
        busy = asyncio.ensure_future(pipeline.handle(first, CompletionRequest, "completion",
                                                     "cmpl-"))
        await _until(lambda: engine.sent)
        queued = HttpRequest(_body())
        waiting = asyncio.ensure_future(pipeline.handle(queued, CompletionRequest,
                                                        "completion", "cmpl-"))
        await _until(lambda: controller.queued() == 1)
        queued.leave.set()
        assert (await asyncio.wait_for(waiting, 2)).status_code == 499
        assert len(engine.sent) == 1 and gate.budgets.spent("t") == 0
        first.leave.set()
        await asyncio.wait_for(busy, 2)

    asyncio.run(main())
    assert [r["status"] for r in usage.records] == [499, 499]
    assert usage.records[0]["prompt_tokens"] == 0  # the queued one
    assert gate.budgets.held("t") == 0


# -- finding 4: budgets bound nothing under concurrency -----------------------------------------
def test_budgets_bound_nothing_under_concurrency_regression_40_requests_spend_the_budget_once():
    """200 requests started together spent 839x a 1,000-token budget: the check counted
    finished requests only. 40 concurrent requests of max_tokens 64 against a 2,000-token
    budget now spend at most the budget plus one request's worth; the rest get 429
    insufficient_quota at admission."""
    engine = Engine(tokens=64, per_chunk=8)
    pipeline, gate, controller, usage = _setup(
        engine, token_budget={"tokens": 2000, "period": "day"})

    async def main() -> list[int]:
        async def one() -> int:
            try:
                r = await pipeline.handle(HttpRequest(_body(max_tokens=64, ignore_eos=True)),
                                          CompletionRequest, "completion", "cmpl-")
                return r.status_code
            except Exception as err:  # the OpenAIError the route turns into its answer
                return getattr(err, "status_code", 500)
        return list(await asyncio.gather(*(one() for _ in range(40))))

    codes = asyncio.run(main())
    one_request = PROMPT_TOKENS + 64
    spent = gate.budgets.spent("t")
    assert spent <= 2000 + one_request, (spent, codes)
    assert codes.count(200) >= 2000 // one_request - 1  # what fits was served
    assert set(codes) == {200, 429}
    assert spent == sum(r["prompt_tokens"] + r["completion_tokens"] for r in usage.records)
    assert gate.budgets.held("t") == 0  # every reservation settled


def test_a_finished_request_settles_its_reservation_to_the_real_count():
    engine = Engine(tokens=3)
    pipeline, gate, _, usage = _setup(engine, token_budget={"tokens": 1000, "period": "day"})

    async def main() -> Any:
        return await pipeline.handle(HttpRequest(_body(max_tokens=500)), CompletionRequest,
                                     "completion", "cmpl-")

    assert asyncio.run(main()).status_code == 200
    assert gate.budgets.spent("t") == PROMPT_TOKENS + 3
    assert gate.budgets.held("t") == 0
    assert usage.records[0]["prompt_tokens"] == PROMPT_TOKENS


# -- finding 2: fair share swings ----------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_fair_share_swings_regression_service_rises_while_a_long_generation_runs(stream):
    """Fair-queue service was charged only when a request ended, so a tenant of long
    generations held the engines long before its service rose. It is now charged when the
    request gets its place, for its prompt and its most output (charged as tokens came, places
    freed together still went to one tenant: test_admission_queue_bounds.py), nothing more while
    it runs, and the end settles to the exact total."""
    step = asyncio.Event()
    engine = Engine(tokens=40, per_chunk=4, step=step)
    pipeline, gate, controller, _ = _setup(engine, tokens_per_minute=100000)
    seen: list[float] = []

    async def main() -> None:
        http = HttpRequest(_body(max_tokens=40, stream=stream))
        answer = asyncio.ensure_future(pipeline.handle(http, CompletionRequest, "completion",
                                                       "cmpl-"))
        if stream:
            response = await answer
            body = response.body_iterator
            await body.__anext__()  # the first chunk's events
        else:
            await _until(lambda: engine.sent)
        for _ in range(5):  # five more chunks of 4 tokens each, the request still running
            step.set()
            if stream:
                await body.__anext__()
            else:
                await _until(lambda: not step.is_set())
                await asyncio.sleep(0.01)
            seen.append(controller.queue.service("t"))
        assert seen[-1] > 0, seen  # before the end
        assert _tpm_used(gate) > 0  # TPM too counts the stream while it runs
        while True:
            step.set()
            if stream:
                try:
                    await body.__anext__()
                except StopAsyncIteration:
                    break
            else:
                if answer.done():
                    break
                await asyncio.sleep(0.001)

    asyncio.run(main())
    assert seen[0] >= 2 * 40 and len(set(seen)) == 1, seen  # the whole output at once
    assert controller.queue.service("t") == PROMPT_TOKENS + 2 * 40  # exact, not twice
    assert _tpm_used(gate) == pytest.approx(PROMPT_TOKENS + 40, abs=1)


# -- the estimate -------------------------------------------------------------------------------
def test_prompt_estimate_is_exact_for_token_ids_and_bounded_for_text():
    from serve_app.governance.accounting import estimate_prompt_tokens

    ids = CompletionRequest(model=MODEL, prompt=[1, 2, 3, 4])
    assert estimate_prompt_tokens(ids) == 4
    text = CompletionRequest(model=MODEL, prompt="a" * 400)
    assert 100 <= estimate_prompt_tokens(text) <= 140  # 4 and 3 characters a token
    wide = CompletionRequest(model=MODEL, prompt="\u00e9" * 400)  # 2 UTF-8 bytes each
    assert estimate_prompt_tokens(wide) >= 200
    chat = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "a" * 40}])
    assert 10 < estimate_prompt_tokens(chat) < 30
