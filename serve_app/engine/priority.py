"""The vLLM priority the router gives a request (lower runs first), and how two compare: the
one home of its layout, read by the router (serve_app/governance/fair_queue.py,
``engine_priority``) and by the engine's scheduler (serve_app/engine/vllm_scheduler.py).

Layout: the band's index above :data:`COUNT_BITS` bits of the tenant's requests already in the
engines when this one was released. Pure; no vLLM import.
"""

from __future__ import annotations

COUNT_BITS = 32
_COUNT_MASK = (1 << COUNT_BITS) - 1


def encode_priority(band_index: int, tenant_in_flight: int) -> int:
    """The priority of a request of band ``band_index`` (0 the best) whose tenant has
    ``tenant_in_flight`` requests in the engines (saturating at the field's width)."""
    return (band_index << COUNT_BITS) | min(max(tenant_in_flight, 0), _COUNT_MASK)


def outranks(waiting: int, running: int) -> bool:
    """Whether a waiting request of priority ``waiting`` should start before a running one of
    ``running`` finishes its chunked prefill (serve_app/engine/vllm_scheduler.py): a better
    band, or the same band and its tenant has fewer than half as many requests in the engines.
    The margin keeps tenants that flood alike (200 against 198 in flight) from holding each
    other's prefills back step after step; a quiet tenant (0 in flight) outranks any flood,
    and equal priorities (bare vLLM's 0 for every request) never do."""
    band_w, count_w = waiting >> COUNT_BITS, waiting & _COUNT_MASK
    band_r, count_r = running >> COUNT_BITS, running & _COUNT_MASK
    if band_w != band_r:
        return band_w < band_r
    return 2 * count_w < count_r
