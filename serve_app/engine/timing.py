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
* ``hop_in``: the router's call -> the replica's engine call entered (Serve's routing, the gRPC
  request, the replica's request wrapper);
* ``replica``: the replica's ``generate`` call -> the engine's first output there; made of
* ``tokenize``: rendering and encoding the prompt on the replica;
* ``to_engine``: handing the request to vLLM's engine core until its scheduler queued it (the
  core reads new requests between steps, so this includes the rest of the step in flight);
* ``engine_queue``: in vLLM's waiting queue until a step scheduled it;
* ``prefill``: scheduled -> first token (the prompt's steps, other requests' work included);
* ``to_replica``: the engine core's output -> the replica's ``generate`` loop;
* ``hop_out``: that first output -> the router has it as a chunk (Serve's stream item back).

``hop_in`` and ``hop_out`` compare the replica's clock with the router's: they are given only
where both are the same clock (one host); across hosts ``CLOCK_MONOTONIC`` values are unrelated,
and a hop outside ``0 .. dispatch`` is dropped.

A non-streamed request's first chunk is its whole completion (vLLM's final output only), so
there ``dispatch``, ``replica`` and ``to_replica`` include the decode as well.
"""

from __future__ import annotations

from typing import Any

PHASES = ("queue", "dispatch", "hop_in", "replica", "tokenize", "to_engine", "engine_queue",
          "prefill", "to_replica", "hop_out")

# The replica's own clock readings, in seconds, for the router's hop phases (not phases).
_ENTERED, _FIRST_OUTPUT = "_entered", "_first_output"


def replica_phases(entered: float, submitted: float, first_output: float,
                   engine_stats: Any | None) -> dict[str, float]:
    """The replica-side phases of one request, in ms.

    ``entered``, ``submitted`` (handed to the engine) and ``first_output`` are the replica's
    ``time.monotonic()``; ``engine_stats`` is vLLM's ``RequestOutput.metrics``
    (``queued_ts``, ``scheduled_ts``, ``first_token_ts`` from the engine core's monotonic
    clock), or None when the engine gives none: then only ``replica`` and ``tokenize``."""
    out = {"replica": _ms(first_output - entered), "tokenize": _ms(submitted - entered),
           _ENTERED: entered, _FIRST_OUTPUT: first_output}
    queued = getattr(engine_stats, "queued_ts", 0.0) or 0.0
    scheduled = getattr(engine_stats, "scheduled_ts", 0.0) or 0.0
    first_token = getattr(engine_stats, "first_token_ts", 0.0) or 0.0
    if 0 < queued <= scheduled <= first_token:
        out.update(to_engine=_ms(queued - submitted), engine_queue=_ms(scheduled - queued),
                   prefill=_ms(first_token - scheduled),
                   to_replica=_ms(first_output - first_token))
    return out


def with_router_phases(replica: dict[str, float] | None, arrived: float, admitted: float,
                       sent: float, received: float) -> dict[str, float]:
    """All phases of one request: the replica's (``replica``, from :func:`replica_phases`,
    None when the engine gave none) and the router's, from its ``time.monotonic()`` readings:
    request ``arrived``, ``admitted``, the engine call ``sent``, its first chunk ``received``."""
    phases = dict(replica or {})
    entered, first_output = phases.pop(_ENTERED, None), phases.pop(_FIRST_OUTPUT, None)
    dispatch = received - admitted
    phases["queue"] = _ms(admitted - arrived)
    phases["dispatch"] = _ms(dispatch)
    if entered is not None and first_output is not None:
        hop_in, hop_out = entered - sent, received - first_output
        if 0 <= hop_in <= dispatch and 0 <= hop_out <= dispatch:  # one host's clock
            phases["hop_in"], phases["hop_out"] = _ms(hop_in), _ms(hop_out)
    return phases


# Not a phase: the prompt tokens the engine's prefix cache held, which the first chunk's timing
# dict carries to the router for the usage record (server_timing_header writes only PHASES).
CACHED_TOKENS = "cached_tokens"


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
