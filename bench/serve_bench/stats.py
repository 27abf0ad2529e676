"""Benchmark metrics with the definitions ``vllm bench serve`` uses (pure; unit-tested).

* TTFT: request sent -> first streamed chunk with content.
* ITL: gaps between consecutive content chunks.
* TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one output token.
* E2EL: request sent -> last chunk.
* Throughput: tokens (or requests) of successful requests / wall time of the measured run.
* Goodput: successful requests meeting every SLO / wall time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """What one benchmark request saw. Times are seconds on one monotonic clock."""

    start: float
    tenant: str = "default"
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    end: float | None = None
    status: int = 0  # HTTP status; 0 when no response came (connection error)
    error: str | None = None
    # The server's own account of the time to first token (``Server-Timing``, ms), if it sent
    # one: the stack does with ``router.server_timing``.
    server_timing: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.end is not None

    @property
    def e2el(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method), 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def distribution(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / median / p90 / p99 / std of ``values`` (seconds), reported in ms by default."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "std": 0.0}
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    out = {"mean": mean * scale, "median": percentile(values, 50) * scale, "std": var**0.5 * scale}
    for p in PERCENTILES[1:]:
        out[f"p{p}"] = percentile(values, p) * scale
    return out


@dataclass(frozen=True)
class SLO:
    """Per-request latency objectives in milliseconds (None: not checked)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        checks = [(self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot), (self.e2el_ms, r.e2el)]
        for limit, value in checks:
            if limit is None:
                continue
            if value is None or value * 1000 > limit:
                # A one-token request has no TPOT; it cannot miss a TPOT objective.
                if limit is self.tpot_ms and value is None and r.output_tokens <= 1:
                    continue
                return False
        return True


def summarize(records: list[RequestRecord], duration_s: float,
              slo: SLO | None = None) -> dict[str, Any]:
    """The metrics of one run over ``duration_s`` seconds of wall time."""
    ok = [r for r in records if r.ok]
    failures = Counter(str(r.status) if r.status else (r.error or "error").split(":")[0]
                       for r in records if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failures_by_status": dict(failures),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl]),
        "e2el_ms": distribution([r.e2el for r in ok if r.e2el is not None]),
    }
    if slo is not None:
        good = sum(1 for r in ok if slo.met(r))
        summary["goodput"] = good / duration
        summary["slo"] = asdict(slo)
    return summary


def summarize_by_tenant(records: list[RequestRecord], duration_s: float,
                        slo: SLO | None = None) -> dict[str, dict[str, Any]]:
    """:func:`summarize` for each tenant's requests separately."""
    tenants = sorted({r.tenant for r in records})
    return {t: summarize([r for r in records if r.tenant == t], duration_s, slo) for t in tenants}


def service_over_time(records: list[RequestRecord], t0: float, bin_s: float
                      ) -> dict[str, list[float]]:
    """Output tokens per second each tenant received, in bins of ``bin_s`` from ``t0``.

    A request's tokens are spread evenly between its first token and its end (the records keep
    gaps, not per-token times, so this is exact only for the totals of each request).
    """
    ok = [r for r in records if r.ok and r.ttft is not None and r.end is not None]
    if not ok:
        return {}
    n_bins = int((max(r.end for r in ok) - t0) // bin_s) + 1  # type: ignore[operator]
    series: dict[str, list[float]] = {}
    for r in ok:
        row = series.setdefault(r.tenant, [0.0] * n_bins)
        first, end = r.start + r.ttft, r.end  # type: ignore[operator]
        span = end - first  # type: ignore[operator]
        lo_bin = int((first - t0) // bin_s)
        hi_bin = min(int((end - t0) // bin_s), n_bins - 1)  # type: ignore[operator]
        for b in range(lo_bin, hi_bin + 1):
            if span <= 0:
                row[b] += r.output_tokens / bin_s
                break
            overlap = min(end, t0 + (b + 1) * bin_s) - max(first, t0 + b * bin_s)  # type: ignore[type-var]
            row[b] += r.output_tokens * max(overlap, 0.0) / span / bin_s
    return series


def paired_difference(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0
                      ) -> dict[str, float]:
    """How much larger ``b`` is than ``a`` when each ``b[i]`` was measured beside ``a[i]`` (the
    same prompt, back to back): the median of the per-pair differences ``b[i] - a[i]`` with a
    95% bootstrap interval (pairs resampled, seeded), beside each side's own median.

    Pairing removes what both sides share in a pair (the prompt, the machine's state at that
    moment); two medians taken in separate runs moved by 7 ms between machines where the gap
    to measure was 2 ms (bench/RESULTS.md section 12b)."""
    if len(a) != len(b):
        raise ValueError("paired samples need the same length")
    if not a:
        return {"pairs": 0}
    import random

    diffs = [y - x for x, y in zip(a, b)]
    rng = random.Random(seed)
    n = len(diffs)
    boots = sorted(percentile([diffs[rng.randrange(n)] for _ in range(n)], 50)
                   for _ in range(resamples))
    return {
        "pairs": n,
        "a_p50": percentile(a, 50),
        "b_p50": percentile(b, 50),
        "diff_p50": percentile(diffs, 50),
        "diff_mean": sum(diffs) / n,
        "diff_p50_ci_low": percentile(boots, 2.5),
        "diff_p50_ci_high": percentile(boots, 97.5),
        "b_slower_share": sum(d > 0 for d in diffs) / n,
    }
