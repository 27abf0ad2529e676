"""What a benchmark sends and when (pure and seeded; unit-tested).

Prompts are random token ids of exact lengths, sent as token-id prompts so no tokenizer on
either side can change their length. Outputs have fixed lengths (``ignore_eos``) or lengths drawn
from a range. Arrivals follow a gamma process (burstiness 1 = Poisson) or a concurrency cap.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Tenant:
    """A client identity in the mix: its API key, its share of the requests and the model its
    requests name (None: the run's ``--model``; a LoRA adapter's name sends them to it)."""

    name: str
    api_key: str | None
    share: float
    model: str | None = None


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the run: prompt token ids, output length, tenant, send offset (s)."""

    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    tenant: Tenant
    send_at: float | None  # seconds after the run starts; None under a concurrency cap


def parse_tenants(specs: list[str]) -> list[Tenant]:
    """``name:key:share[:model]`` (key may be empty; model, the ``model`` the tenant's requests
    name, may hold colons and defaults to the run's) -> tenants; no specs -> one anonymous
    tenant."""
    if not specs:
        return [Tenant("default", None, 1.0)]
    tenants = []
    for spec in specs:
        parts = spec.split(":", 3)
        if len(parts) < 3 or (len(parts) == 4 and not parts[3]):
            raise ValueError(f"tenant {spec!r}: write name:api_key:share or "
                             "name:api_key:share:model (key may be empty)")
        name, key, share, *model = parts
        tenants.append(Tenant(name, key or None, float(share), model[0] if model else None))
    if any(t.share <= 0 for t in tenants):
        raise ValueError("tenant shares must be positive")
    return tenants


def parse_length(spec: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"16-256"`` -> (16, 256) (uniform, inclusive)."""
    lo, _, hi = spec.partition("-")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"length {spec!r}: write N or LO-HI with 1 <= LO <= HI")
    return a, b


def gamma_offsets(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Send offsets (s) of requests at mean ``rate`` req/s with gamma-distributed gaps, without
    end: 0, then each gap added.

    Shape = burstiness, scale = 1 / (rate * burstiness), so the mean gap is 1/rate whatever the
    burstiness; burstiness 1 is a Poisson process, lower is burstier, higher is more regular.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    t = 0.0
    while True:
        yield t
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """The first ``n`` of :func:`gamma_offsets`."""
    return list(itertools.islice(gamma_offsets(rate, burstiness, rng), n))


def iter_plan(n: int | None, input_len: tuple[int, int], output_len: tuple[int, int],
              tenants: list[Tenant], vocab: tuple[int, int], seed: int = 0,
              rate: float | None = None, burstiness: float = 1.0) -> Iterator[PlannedRequest]:
    """``n`` requests (``None``: without end, for runs bounded by time), drawn as they are
    needed: prompt/output lengths uniform in the ranges, tenants by share, token ids uniform in
    ``vocab`` = (low, high) exclusive, arrival offsets when ``rate`` is set. A run bounded by
    time builds only the requests it sends (a plan of a million prompts up front kept the
    client busy for minutes instead of sending load)."""
    rng = random.Random(seed)
    arrivals = gamma_offsets(rate, burstiness, random.Random(f"{seed}-arrivals")) if rate else None
    weights = [t.share for t in tenants]
    for i in itertools.count() if n is None else range(n):
        p_len = rng.randint(*input_len)
        yield PlannedRequest(
            index=i,
            prompt_token_ids=[rng.randrange(*vocab) for _ in range(p_len)],
            max_tokens=rng.randint(*output_len),
            tenant=rng.choices(tenants, weights)[0],
            send_at=next(arrivals) if arrivals is not None else None,
        )


def plan(n: int, input_len: tuple[int, int], output_len: tuple[int, int], tenants: list[Tenant],
         vocab: tuple[int, int], seed: int = 0, rate: float | None = None,
         burstiness: float = 1.0) -> list[PlannedRequest]:
    """The first ``n`` requests of :func:`iter_plan`, as a list."""
    return list(iter_plan(n, input_len, output_len, tenants, vocab, seed, rate, burstiness))
