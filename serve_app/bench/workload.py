"""What a benchmark sends and when (pure and seeded; unit-tested).

Prompts are random token ids of exact lengths, sent as token-id prompts so no tokenizer on
either side can change their length. Outputs have fixed lengths (``ignore_eos``) or lengths drawn
from a range. Arrivals follow a gamma process (burstiness 1 = Poisson) or a concurrency cap.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Tenant:
    """A client identity in the mix: its API key and its share of the requests."""

    name: str
    api_key: str | None
    share: float


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the run: prompt token ids, output length, tenant, send offset (s)."""

    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    tenant: Tenant
    send_at: float | None  # seconds after the run starts; None under a concurrency cap


def parse_tenants(specs: list[str]) -> list[Tenant]:
    """``name:key:share`` (key may be empty) -> tenants; no specs -> one anonymous tenant."""
    if not specs:
        return [Tenant("default", None, 1.0)]
    tenants = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(f"tenant {spec!r}: write name:api_key:share (key may be empty)")
        name, key, share = parts
        tenants.append(Tenant(name, key or None, float(share)))
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


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send offsets of ``n`` requests at mean ``rate`` req/s with gamma-distributed gaps.

    Shape = burstiness, scale = 1 / (rate * burstiness), so the mean gap is 1/rate whatever the
    burstiness; burstiness 1 is a Poisson process, lower is burstier, higher is more regular.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def plan(n: int, input_len: tuple[int, int], output_len: tuple[int, int], tenants: list[Tenant],
         vocab: tuple[int, int], seed: int = 0, rate: float | None = None,
         burstiness: float = 1.0) -> list[PlannedRequest]:
    """``n`` requests: prompt/output lengths drawn uniformly from the ranges, tenants by share,
    token ids uniform in ``vocab`` = (low, high) exclusive, arrival offsets when ``rate`` is set."""
    rng = random.Random(seed)
    arrivals = gamma_arrivals(n, rate, burstiness, rng) if rate else [None] * n
    weights = [t.share for t in tenants]
    out = []
    for i in range(n):
        p_len = rng.randint(*input_len)
        out.append(PlannedRequest(
            index=i,
            prompt_token_ids=[rng.randrange(*vocab) for _ in range(p_len)],
            max_tokens=rng.randint(*output_len),
            tenant=rng.choices(tenants, weights)[0],
            send_at=arrivals[i],
        ))
    return out
