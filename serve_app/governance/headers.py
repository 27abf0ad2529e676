"""OpenAI's rate-limit response headers, from a tenant's quota state (pure, no Ray).

The ``openai`` client and most SDKs read six headers on every response:
``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests``
and the same three for ``-tokens``. Limits are whole numbers, remaining values are floored (a
bucket at 4.7 requests admits 4 more), and a reset is the time until the bucket is full again,
written as OpenAI writes it: Go's duration format (``"17ms"``, ``"1s"``, ``"6m0s"``, ``"1h0m0s"``).
A dimension the tenant has no limit on gets no headers (there is nothing to count down).

**The limit is the tenant's, never a router's share.** Where a router replica enforces only its
share of a limit (``governance.quota_scope: replica``, or the cluster quota's outage, when it
falls back to its local share), the headers still state the tenant's configured limit, and
``remaining`` is this router's share scaled up to it (:func:`share_remaining`): what the tenant
may still send if the other routers' shares are as spent as this one (the load balancer spreads
a tenant's requests over them). It is 0 whenever this router would refuse the tenant's next
request, so a client that reads ``remaining > 0`` is not refused by this router for that
dimension next (it may be for the other one: each dimension counts down on its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LimitState:
    """One bucket as a client should see it: its size, what is left now (may be negative for
    tokens, charged after the fact), and seconds until it is full again."""

    limit: int
    remaining: float
    reset_s: float


def share_remaining(level: float, capacity: float, limit: int, need: float) -> float:
    """``remaining`` of the tenant's whole ``limit``, from a bucket of ``capacity`` (this router's
    share of it) at ``level``: the level scaled by ``limit / capacity``, the same fraction of
    the whole as this share has left (it never exceeds ``limit``). ``need``: the level the
    bucket must hold to admit one more request (1 for requests, any amount above 0 for tokens);
    below it the answer is 0 (a debt stays negative, scaled), never a scaled figure above 0 that
    the next request through this router would not get. With the whole limit in the bucket
    (``capacity == limit``) it is the level itself."""
    scaled = level * limit / capacity if capacity > 0 else 0.0
    return scaled if level >= need else min(0.0, scaled)


def reset_duration(seconds: float) -> str:
    """``seconds`` as OpenAI's reset headers write it (Go's ``time.Duration`` string, rounded
    up to the millisecond below a second and to the second above): 0 -> ``"0s"``, 0.017 ->
    ``"17ms"``, 1 -> ``"1s"``, 360 -> ``"6m0s"``, 3725 -> ``"1h2m5s"``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(requests: LimitState | None, tokens: LimitState | None
                      ) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers for a tenant's request and token buckets (either None:
    no limit on it, no headers for it)."""
    out: dict[str, str] = {}
    for suffix, state in (("requests", requests), ("tokens", tokens)):
        if state is None:
            continue
        out[f"x-ratelimit-limit-{suffix}"] = str(state.limit)
        out[f"x-ratelimit-remaining-{suffix}"] = str(max(0, math.floor(state.remaining)))
        out[f"x-ratelimit-reset-{suffix}"] = reset_duration(state.reset_s)
    return out
