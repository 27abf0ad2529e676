"""The usage record: one JSON line per ended request, what a platform team bills from.

Written by each router replica through Python logging (:class:`UsageLog`) to a rotating file of
its own (``usage-<replica>.jsonl``; several processes rotating one file would lose lines) and,
if asked, to its stdout. A line holds the request's time, id, tenant, model (an adapter's
request: its base model, and the adapter's name in ``adapter``, else null), priority, prompt,
completion and cached prompt tokens (null where the engine does not report them), HTTP status,
finish reason, queue wait, time to first token and duration. Every request that reached an
engine has one with the tokens it was charged, including a request whose client left (status
499): one that left during its prefill is billed its prompt's estimate (``prompt_estimated``
true; :mod:`serve_app.governance.accounting`), since the engine's count never came. It never holds a key, a key digest
or any prompt or output text: the record is built from named fields only (:data:`FIELDS`).

Token figures are the same numbers the router adds to its per-tenant Prometheus counters
(``ray_serve_app_tenant_tokens_total``), at the same moment, so the two agree exactly.

:func:`read_records` and :func:`summarize` are what ``serve-app usage`` runs: totals per
(tenant, model), filtered by time and tenant.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

from serve_app.config import UsageSettings

# Every key a usage line has, in order: the record is built from these and nothing else.
FIELDS = ("time", "request_id", "tenant", "model", "adapter", "priority", "prompt_tokens",
          "completion_tokens", "cached_tokens", "status", "finish_reason", "queue_wait_s",
          "ttft_s", "duration_s", "stream", "n", "prompt_estimated")
FILE_PREFIX = "usage-"


class UsageLog:
    """Writes usage lines for one router replica (``replica``: a short id for its file name).
    Contract: :meth:`record` is called once per ended request, on the replica's event loop;
    a write that fails is logged by Python logging's handler and never fails the request."""

    def __init__(self, settings: UsageSettings, replica: str) -> None:
        self.enabled = settings.enabled
        # One logger per replica id: two apps in one process must not share handlers.
        self._log = logging.getLogger(f"serve_app.usage.{replica}")
        self._log.setLevel(logging.INFO)
        self._log.propagate = False  # not into the replica's own log: billing data stays apart
        self.path: Path | None = None
        for handler in list(self._log.handlers):
            self._log.removeHandler(handler)
            handler.close()
        if settings.dir is not None:
            folder = Path(settings.dir)
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / f"{FILE_PREFIX}{_safe(replica)}.jsonl"
            self._add(logging.handlers.RotatingFileHandler(
                self.path, maxBytes=settings.max_bytes, backupCount=settings.backups,
                encoding="utf-8"))
        if settings.stdout:
            self._add(logging.StreamHandler(sys.stdout))

    def _add(self, handler: logging.Handler) -> None:
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._log.addHandler(handler)

    def record(self, **fields: Any) -> None:
        """Write one line of :data:`FIELDS` (missing ones null; ``time`` defaults to now)."""
        if not self.enabled:
            return
        fields.setdefault("time", datetime.now(timezone.utc).isoformat(timespec="milliseconds"))
        self._log.info(json.dumps({k: fields.get(k) for k in FIELDS}, separators=(",", ":")))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64] or "router"


def usage_files(paths: Iterable[str | Path]) -> list[Path]:
    """The usage files of ``paths``: a file as given, a folder's ``usage-*.jsonl`` and their
    rotated copies (oldest first, so lines come in time order per replica)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob(f"{FILE_PREFIX}*.jsonl*"),
                           key=lambda f: (f.name.split(".jsonl")[0], -_rotation(f)))
            out.extend(found)
        else:
            out.append(p)
    return out


def _rotation(path: Path) -> int:
    suffix = path.name.rsplit(".jsonl", 1)[-1].lstrip(".")
    return int(suffix) if suffix.isdigit() else 0


def read_records(files: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """Every usage line of ``files`` as a dict; lines that are not usage records (a partial
    last line, another program's output) are skipped."""
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "tenant" in rec and "prompt_tokens" in rec:
                    yield rec


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``--since``: a span back from now (``30m``, ``24h``, ``7d``) or an ISO date or time
    (``2026-12-01``, ``2026-12-01T08:00``; UTC unless it says otherwise). Raises ValueError
    with the accepted forms."""
    now = now or datetime.now(timezone.utc)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return now - timedelta(**{unit: float(m.group(1))})
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: give a span (30m, 24h, 7d) or an ISO date or "
                         "time (2026-12-01, 2026-12-01T08:00)") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


@dataclass
class UsageTotal:
    """What one tenant ran on one model."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def summarize(records: Iterable[dict[str, Any]], since: datetime | None = None,
              tenant: str | None = None) -> dict[tuple[str, str], UsageTotal]:
    """Totals per (tenant, model) of ``records`` at or after ``since``, of ``tenant`` only if
    given; an adapter's requests count under the adapter's name (the id the tenant asked
    for). A request counts as an error when its status is not 200."""
    totals: dict[tuple[str, str], UsageTotal] = {}
    for rec in records:
        if tenant is not None and rec.get("tenant") != tenant:
            continue
        if since is not None:
            try:
                when = datetime.fromisoformat(rec["time"])
            except (KeyError, TypeError, ValueError):
                continue
            if when < since:
                continue
        model = str(rec.get("adapter") or rec.get("model"))
        t = totals.setdefault((str(rec.get("tenant")), model), UsageTotal())
        t.requests += 1
        t.errors += rec.get("status") != 200
        t.prompt_tokens += int(rec.get("prompt_tokens") or 0)
        t.completion_tokens += int(rec.get("completion_tokens") or 0)
        t.cached_tokens += int(rec.get("cached_tokens") or 0)
    return totals


def format_table(totals: dict[tuple[str, str], UsageTotal]) -> str:
    """``serve-app usage``'s table: one row per tenant and model, sorted."""
    head = ("tenant", "model", "requests", "errors", "prompt", "completion", "cached", "total")
    rows = [head] + [(t, m, str(u.requests), str(u.errors), str(u.prompt_tokens),
                      str(u.completion_tokens), str(u.cached_tokens), str(u.total_tokens))
                     for (t, m), u in sorted(totals.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in rows)
