"""Steady client load for the rollout tests: threads that send one request after another until
stopped and record how each ended."""

from __future__ import annotations

import threading

import httpx


# How long a load client waits for a byte (a first token included). A client that waited
# longer counts its request as failed ("ReadTimeout"): the tests that fault a node or an engine
# assert that no request hung. Tests that leave a model without an engine replica for a while
# on purpose (a rolling update of its only replica) pass a longer patience.
PATIENCE_S = 60.0


def streams(base: str, model: str, headers: dict, results: list, stop: threading.Event,
            patience_s: float = PATIENCE_S) -> None:
    """Keep one stream open after another until stopped; each result is (status, True) for a
    stream that ended with [DONE], (status, False, "error event" or "cut after N lines") for
    one that did not, or (error and lines received, False) for a connection that broke."""
    with httpx.Client(base_url=base, timeout=patience_s, headers=headers) as c:
        while not stop.is_set():
            lines: list[str] = []
            try:
                with c.stream("POST", "/v1/completions", json={
                        "model": model, "prompt": "live", "max_tokens": 24,
                        "ignore_eos": True, "stream": True}) as r:
                    lines.extend(r.iter_lines())
                    if "data: [DONE]" in lines:
                        results.append((r.status_code, True))
                    else:
                        signal = any(line.startswith("data:") and '"error"' in line
                                     for line in lines)
                        results.append((r.status_code, False, "error event" if signal
                                        else f"cut after {len(lines)} lines"))
            except httpx.HTTPError as err:  # a cut connection is a failure too
                results.append((f"{type(err).__name__} after {len(lines)} lines: {err}", False))


def whole_requests(base: str, model: str, headers: dict, results: list,
                   stop: threading.Event, patience_s: float = PATIENCE_S) -> None:
    """Send one non-streamed request after another until stopped; each result is (status,
    finished with its full length)."""
    with httpx.Client(base_url=base, timeout=patience_s, headers=headers) as c:
        while not stop.is_set():
            try:
                r = c.post("/v1/completions", json={"model": model, "prompt": "whole",
                                                    "max_tokens": 12, "ignore_eos": True})
            except httpx.HTTPError as err:  # a reset connection is a failure too
                results.append((type(err).__name__, False))
                continue
            ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            results.append((r.status_code, ok))


def start(*targets: tuple) -> tuple[threading.Event, list[threading.Thread]]:
    """Start one daemon thread per (function, args...) with a shared stop event last."""
    stop = threading.Event()
    threads = [threading.Thread(target=fn, args=(*args, stop), daemon=True)
               for fn, *args in targets]
    for t in threads:
        t.start()
    return stop, threads


def finish(stop: threading.Event, threads: list[threading.Thread]) -> None:
    stop.set()
    for t in threads:
        t.join(timeout=120)


def ok_count(results: list) -> int:
    """Requests that ended well: status 200 and complete ([DONE], or the full length)."""
    return sum(r == (200, True) for r in results)


def assert_only_in_flight_failed(results: list, threads: int) -> list:
    """``results`` are those of requests sent after a fault (a lost node or replica) by
    ``threads`` load threads: each thread had at most one request in flight at the fault, so at
    most ``threads`` fail; none hung (timed out), and each failure told its client (an error
    status, or an SSE error event in a started stream). Returns the failures."""
    failed = [r for r in results if r != (200, True)]
    assert len(failed) <= threads, failed
    assert not [r for r in failed if "Timeout" in str(r[0])], failed
    assert all(r[0] != 200 or r[2:] == ("error event",) for r in failed), failed
    return failed


def greedy_completions(base: str, model: str, prompts: list[str],
                       headers: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """Each prompt's greedy completion of 24 tokens (text, tokens): what the parallel tests
    compare between a sharded replica and the single-rank engine."""
    out = []
    with httpx.Client(timeout=120, headers=headers or {}) as c:
        for prompt in prompts:
            r = c.post(f"{base}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            out.append((body["choices"][0]["text"], body["usage"]["completion_tokens"]))
    return out
