"""What one generation request costs its tenant: reserved at admission, charged as its tokens
flow, settled once at its end, however it ended (issue 37).

A request pays for the engine work it caused, in three ledgers: the tenant's token quota (TPM)
and token budget (:class:`~serve_app.governance.tenants.TenantGate`), and its fair-share service
in the model's fair queue (VTC, :mod:`serve_app.governance.fair_queue`). One :class:`Charge` per
request keeps what was charged where, so that no token is charged twice or never.

Contract (the pipeline calls these on the router's event loop, in this order; every call after
:meth:`Charge.settle` is a no-op):

1. :meth:`Charge.reserve`, the quota step, before the request queues: admits it by its
   tenant's rates and budget, holding its most from the budget: the prompt's estimated tokens
   plus ``n x max_tokens`` (``router.budget_reserve_max_tokens`` per choice when the client set
   no limit). Raises the 429. :meth:`Charge.refund` if the request is then refused (its queue
   is full): the rate charge and the reservation go back.
2. :meth:`Charge.admitted` once it has an admission place: the fair queue to charge, and the
   service the admission controller charged when it granted the place (:attr:`Charge.
   expected_service`: the prompt's estimate and the most output, so that the fair queue's next
   choice already sees it).
3. :meth:`Charge.dispatched` just before the engine call: from here the request pays for its
   prompt. Its fair-share service is charged the prompt's estimate at once (a long prompt holds
   the engine from now on) where the admission did not charge more already.
4. :meth:`Charge.flow` with the request's cumulative token counts, once the first chunk came
   and then per chunk (batch) the router receives: the engine's exact prompt count replaces the
   estimate, and the new tokens are charged to TPM, the budget (the reservation shrinks by as
   much) and the fair-share service beyond what was charged already. A long generation's
   tenant so rises in the fair queue as soon as it is admitted, not only when it ends.
5. :meth:`Charge.settle` once, however the request ended: charges what the flow did not, gives
   back the unused reservation (of the budget, and of the fair-share service: a negative
   remainder), and returns the request's final figures for its metrics and
   usage record, with the fair-share service left to charge through the admission slot.

The prompt estimate (:func:`estimate_prompt_tokens`) is exact for token-id prompts; for text
it is one token per ``BYTES_PER_TOKEN`` (3) bytes of UTF-8 plus the template's overhead: above
the about 4 characters a token of English BPE tokenizers, so that the reservation errs high for
prose and stays close for code and non-Latin scripts (3 bytes a character, often one token). It
is used until the engine's count arrives with the first chunk, which then also resizes the
reservation to the real prompt; a request whose client left after dispatch but before its
first chunk (status 499) is billed on it, since the engine did (some of) its prefill. A request
the engine refused or that failed before its first chunk (4xx, 503) pays nothing: no work was
done for it, or the fault was ours.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from serve_app.ingress.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.governance.fair_queue import service_of
from serve_app.governance.keys import Tenant

if TYPE_CHECKING:
    from serve_app.ingress.responses import ResponseBuilder
    from serve_app.governance.tenants import TenantGate
    from serve_app.governance.usage import UsageLog

BYTES_PER_TOKEN = 3
# Tokens a chat template adds around each message (role markers) and once per prompt (BOS).
MESSAGE_OVERHEAD = 4
PROMPT_OVERHEAD = 1
# Ended this way after its dispatch and before its first chunk, a request still pays its prompt.
ABANDONED = frozenset({499, 408})


class ServiceLedger(Protocol):
    """The fair queue's side: :meth:`FairQueue.charge <serve_app.governance.fair_queue.FairQueue.
    charge>` (a FIFO queue's does nothing)."""

    def charge(self, tenant: str, service: float) -> None: ...


def _text_tokens(text: str) -> int:
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-size // BYTES_PER_TOKEN)


def estimate_prompt_tokens(req: CompletionRequest | ChatCompletionRequest) -> int:
    """The prompt's tokens before the engine counted them (see the module docstring)."""
    if isinstance(req, CompletionRequest):
        if isinstance(req.prompt, list):
            return len(req.prompt)  # token ids: exact
        return PROMPT_OVERHEAD + _text_tokens(req.prompt)  # type: ignore[arg-type]
    return PROMPT_OVERHEAD + sum(MESSAGE_OVERHEAD + _text_tokens(m.text())
                                 for m in req.messages)


def completion_limit(req: CompletionRequest | ChatCompletionRequest, default: int) -> int:
    """The most completion tokens ``req`` may generate: ``n x max_tokens``, ``default`` per
    choice where the client set no limit."""
    limit = req.max_tokens if isinstance(req, CompletionRequest) else (
        req.max_completion_tokens or req.max_tokens)
    return req.n * (limit or default)


class Charge:
    """One request's account with its tenant (see the module docstring for the contract)."""

    __slots__ = ("gate", "tenant", "estimate", "limit", "held", "queue", "sent", "prompt",
                 "completion", "charged", "service", "settled", "estimated")

    def __init__(self, gate: TenantGate, tenant: Tenant, prompt_estimate: int,
                 completion_limit: int) -> None:
        self.gate, self.tenant = gate, tenant
        self.estimate, self.limit = prompt_estimate, completion_limit
        self.held = 0              # budget tokens this request holds now
        self.queue: ServiceLedger | None = None
        self.sent = False          # dispatched to an engine
        self.prompt = 0            # the engine's prompt count (0: not known yet)
        self.completion = 0        # completion tokens generated so far
        self.charged = 0           # tokens charged to TPM and the budget
        self.service = 0.0         # fair-share service charged
        self.settled = False
        self.estimated = False     # settled on the prompt's estimate (its client left early)

    # -- 1. quota ------------------------------------------------------------------------------
    async def reserve(self) -> None:
        """Admit by the tenant's rates and budget (raises the 429), holding the request's most."""
        self.held = await self.gate.acquire(self.tenant, self.estimate + self.limit)

    def refund(self) -> None:
        """The request was refused after :meth:`reserve` (queue full): it costs nothing."""
        self.gate.refund(self.tenant, self.held)
        self.held = 0
        self.settled = True

    # -- 2, 3. admission, dispatch -------------------------------------------------------------
    @property
    def expected_service(self) -> float:
        """The fair-share service this request may cost at most: its prompt's estimate and its
        completion limit (what the admission controller charges when it grants the place)."""
        return service_of(self.estimate, self.limit)

    def admitted(self, queue: ServiceLedger, prepaid: float = 0.0) -> None:
        """The request has its place; ``prepaid``: the service the controller charged then."""
        self.queue = queue
        self.service = prepaid

    def dispatched(self) -> None:
        """The request goes to an engine now: its prompt's service is charged (estimated)."""
        self.sent = True
        self._serve(service_of(self.estimate, 0))

    # -- 4. tokens as they flow ----------------------------------------------------------------
    def flow(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The request's cumulative counts so far (``prompt_tokens``: the engine's count)."""
        if self.settled:
            return
        if prompt_tokens and not self.prompt:  # the engine's count: resize the reservation
            self.prompt = prompt_tokens
            if prompt_tokens > self.estimate and self.held:
                self.held += self.gate.budgets.reserve(self.tenant.name,
                                                       prompt_tokens - self.estimate)
            elif prompt_tokens < self.estimate:
                give = min(self.held, self.estimate - prompt_tokens)
                self.held -= give
                self.gate.charge_tokens(self.tenant, 0, give)
        if completion_tokens > self.completion:
            self.completion = completion_tokens
        if self.prompt:
            self._charge(self.prompt + self.completion)
            self._serve(service_of(self.prompt, self.completion))

    def _charge(self, total: int) -> None:
        """Charge TPM and the budget up to ``total`` tokens; the reservation shrinks as much."""
        more = total - self.charged
        if more <= 0:
            return
        self.charged = total
        release = min(self.held, more)
        self.held -= release
        self.gate.charge_tokens(self.tenant, more, release)

    def _serve(self, service: float) -> None:
        """Charge the fair queue up to ``service``, never below what was charged (the first
        chunk may lower the estimate, and the prepaid service covers the request's most: what
        was overcharged goes back at :meth:`settle`)."""
        if self.queue is not None and service > self.service:
            self.queue.charge(self.tenant.name, service - self.service)
            self.service = service

    # -- 5. the end ----------------------------------------------------------------------------
    def settle(self, status: int, prompt_tokens: int = 0, completion_tokens: int = 0
               ) -> tuple[int, int, float]:
        """The request ended with ``status`` (its last counts, if any): charge what the flow
        did not, give the unused reservation back. Returns (prompt tokens, completion tokens,
        fair-share service still to charge: the admission slot's release charges it). Once;
        later calls return zeros."""
        if self.settled:
            return 0, 0, 0.0
        self.flow(prompt_tokens, completion_tokens)
        self.settled = True
        prompt = self.prompt
        if not prompt and self.sent and status in ABANDONED:
            prompt = self.estimate  # left in prefill: the engine's count never came
            self.estimated = True
        self._charge(prompt + self.completion)
        self.gate.charge_tokens(self.tenant, 0, self.held)
        self.held = 0
        left = service_of(prompt, self.completion) - self.service
        self.service += left
        return prompt, self.completion, left


@dataclass(slots=True)
class Progress:
    """How far one request got, for its usage record: ``time.monotonic()`` readings of its
    arrival, admission and first chunk, and the prompt tokens the engine's prefix cache held
    (None where the engine does not say)."""

    arrived: float
    admitted: float | None = None
    first_chunk: float | None = None
    cached_tokens: int | None = None
    stream: bool = False
    # The LoRA adapter the request runs with, (name, id, path) (serve_app/governance/adapters.py):
    # its usage record and tenant metrics carry the name; None: the base model.
    adapter: tuple[str, int, str] | None = None

    @property
    def adapter_name(self) -> str:
        return self.adapter[0] if self.adapter is not None else ""


def record_usage(usage: UsageLog | None, tenant: Tenant, model: str, status: int,
                 builder: ResponseBuilder | None, prompt: int, completion: int,
                 progress: Progress, prompt_estimated: bool = False) -> None:
    """One usage line for an ended request (the same token figures the tenant counters get):
    named figures only, never the key or any prompt or output text. ``prompt_estimated``: the
    prompt's figure is :func:`estimate_prompt_tokens`' (its client left before the engine's
    count came)."""
    if usage is None or not usage.enabled:
        return
    now = time.monotonic()
    reasons = sorted({c.finish_reason for c in builder.choices if c.finish_reason}) \
        if builder is not None else []

    def since_arrival(t: float | None) -> float | None:
        return None if t is None else round(t - progress.arrived, 4)

    usage.record(
        request_id=builder.request_id if builder is not None else None,
        tenant=tenant.name, model=model, adapter=progress.adapter_name or None,
        priority=tenant.priority, prompt_tokens=prompt,
        completion_tokens=completion, prompt_estimated=prompt_estimated,
        cached_tokens=progress.cached_tokens, status=status,
        finish_reason=",".join(reasons) or None,
        queue_wait_s=since_arrival(progress.admitted),
        ttft_s=since_arrival(progress.first_chunk), duration_s=since_arrival(now),
        stream=progress.stream, n=len(builder.choices) if builder is not None else None)
