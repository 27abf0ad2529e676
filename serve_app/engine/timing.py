"""Where one request's time to its first token went, phase by phase, and its Server-Timing form.

The replica measures its side (``replica_phases``) from its own clock and vLLM's per-request
engine-core timestamps; the router adds its fair-queue wait and the hop to the replica, and with
``router.server_timing`` sends all of it in a W3C ``Server-Timing`` response header, which the
flood benchmark reads per request (and browsers' developer tools show). Both processes run on
one host per replica and every timestamp here is ``CLOCK_MONOTONIC`` (Python's
``time.monotonic``, which vLLM's engine core uses too), so differences across processes are
meaningful.

Phases, in order (milliseconds):

* ``queue``: waiting in the router's fair queue for an admission slot;
* ``dispatch``: admission -> the first chunk back at the router (everything below, plus the hop
  router -> replica -> router through Ray Serve);
* ``replica``: the replica's ``generate`` call -> the engine's first output there; made of
* ``tokenize``: rendering and encoding the prompt on the replica;
* ``to_engine``: handing the request to vLLM's engine core until its scheduler queued it (the
  core reads new requests between steps, so this includes the rest of the step in flight);
* ``engine_queue``: in vLLM's waiting queue until a step scheduled it;
* ``prefill``: scheduled -> first token (the prompt's steps, other requests' work included);
* ``to_replica``: the engine core's output -> the replica's ``generate`` loop.

A non-streamed request's first chunk is its whole completion (vLLM's final output only), so
there ``dispatch``, ``replica`` and ``to_replica`` include the decode as well.
"""

from __future__ import annotations

from typing import Any

PHASES = ("queue", "dispatch", "replica", "tokenize", "to_engine", "engine_queue", "prefill",
          "to_replica")


def replica_phases(entered: float, submitted: float, first_output: float,
                   engine_stats: Any | None) -> dict[str, float]:
    """The replica-side phases of one request, in ms.

    ``entered``, ``submitted`` (handed to the engine) and ``first_output`` are the replica's
    ``time.monotonic()``; ``engine_stats`` is vLLM's ``RequestOutput.metrics``
    (``queued_ts``, ``scheduled_ts``, ``first_token_ts`` from the engine core's monotonic
    clock), or None when the engine gives none: then only ``replica`` and ``tokenize``."""
    out = {"replica": _ms(first_output - entered), "tokenize": _ms(submitted - entered)}
    queued = getattr(engine_stats, "queued_ts", 0.0) or 0.0
    scheduled = getattr(engine_stats, "scheduled_ts", 0.0) or 0.0
    first_token = getattr(engine_stats, "first_token_ts", 0.0) or 0.0
    if 0 < queued <= scheduled <= first_token:
        out.update(to_engine=_ms(queued - submitted), engine_queue=_ms(scheduled - queued),
                   prefill=_ms(first_token - scheduled),
                   to_replica=_ms(first_output - first_token))
    return out


def server_timing_header(phases: dict[str, float]) -> str:
    """``Server-Timing`` value for ``phases`` (ms), in :data:`PHASES` order."""
    return ", ".join(f"{name};dur={phases[name]:.1f}" for name in PHASES if name in phases)


def parse_server_timing(value: str | None) -> dict[str, float]:
    """The ``name -> dur`` entries of a ``Server-Timing`` header value (others ignored)."""
    phases: dict[str, float] = {}
    for entry in (value or "").split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, dur = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    phases[name] = float(dur)
                except ValueError:
                    pass
    return phases


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
