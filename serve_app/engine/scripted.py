"""A scripted engine: vLLM's scheduling shape without a model, for fast deterministic tests.

It implements :class:`serve_app.engine.protocol.Engine` the way the router sees vLLM: a batch of
at most ``max_num_seqs`` running requests, a waiting queue ordered by ``priority`` (then
arrival, as vLLM's priority scheduler does), one engine step every ``scripted_step_s`` seconds in
which waiting requests start (up to the batch's free places) and every running request emits one
token. Tokens are deterministic words (``" t0 t1 ..."``), so a test can tell how far a request
got. Nothing is computed, so a step's time is exact even on a loaded two-core machine, and a
replica starts in well under a second.

Inject it through ``build_app(config, engine_class=SCRIPTED_ENGINE_CLASS)``; it reads its knobs
from the model's ``engine_kwargs``:

* ``max_num_seqs`` (default 256): the batch limit, as in vLLM;
* ``max_num_batched_tokens`` (default 2048): reported as the step budget;
* ``scripted_step_s`` (default 0.02): the time of one engine step;
* ``scripted_step_s_at`` (default none): ``{step number: seconds}``, steps that take longer
  (numbered from 0, the engine's first step; a step runs only while there is work);
* ``scripted_clock_scale`` (default 1): the engine's clock runs this many times faster than
  real time. Step times and the stall watch read that clock, so a 90 s step at scale 5 passes
  in 18 s of real time and the stall watch sees 90 s;
* ``scripted_start_file`` (default none): a path; the engine's start (and so the replica's
  constructor) waits until that file exists, the way a real engine's replica stays in its
  constructor while the model loads. A test holds a replica "loading" for exactly as long as
  it needs, with no sleep.

The model's ``engine_stall_timeout_s`` runs the real :class:`serve_app.engine.stall.StallWatch`
on the engine's clock, as the vLLM adapter runs it: its ``check_health`` fails when the watch
declares a stall (the scripted engine has no processes to kill; its step loop is stopped).

Each replica also records the order in which it started requests (:meth:`started_order`), which
ordering tests read through ``LLMServer.engine_started_order``, and its step loop can be held
between steps (:meth:`hold_steps`, through ``LLMServer.engine_hold_steps``): while it is held no
request starts or finishes, so a test can place requests in the router's queue without racing
the engine's clock.

With the model's ``lora:`` set it keeps the adapters its requests named as the vLLM adapter
does (:class:`serve_app.engine.adapters.LoadedAdapters`, ``max_cpu_loras`` of them, least
recently used out; loading one always succeeds) and reports them in :attr:`EngineLoad.adapters`,
for routing tests; without it a request naming an adapter fails as on vLLM (503).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from serve_app.config import ModelSettings
from serve_app.engine.adapters import LoadedAdapters
from serve_app.engine.protocol import (
    ChoiceDelta,
    EngineLoad,
    EngineRequestError,
    GenerationChunk,
    GenerationRequest,
)
from serve_app.engine.stall import StallWatch

SCRIPTED_ENGINE_CLASS = "serve_app.engine.scripted:ScriptedEngine"
DEFAULT_STEP_S = 0.02
DEFAULT_MAX_MODEL_LEN = 2048
# Started-order records kept per replica (a test reads the recent ones).
STARTED_ORDER_KEPT = 4096


async def _load_adapter(name: str, adapter_id: int, path: str) -> bool:
    """The scripted engine's adapter loader: nothing to read, always loaded."""
    return True


def count_prompt_tokens(request: GenerationRequest) -> int:
    """The scripted tokenizer: token ids as given, else one token per whitespace-split word
    (chat: every message's words plus 4 tokens of template per message)."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    if request.messages is not None:
        return sum(len(m.get("content", "").split()) + 4 for m in request.messages)
    return max(1, len((request.prompt or "").split()))


@dataclass
class _Sequence:
    """One request inside the scripted engine."""

    request: GenerationRequest
    arrival: int
    prompt_tokens: int
    max_tokens: int
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # chunks, or the error ending it
    generated: int = 0

    @property
    def order(self) -> tuple[int, int]:
        return (self.request.priority, self.arrival)


class ScriptedEngine:
    """:class:`serve_app.engine.protocol.Engine` that follows a script instead of a model."""

    def __init__(self, settings: ModelSettings) -> None:
        kwargs = settings.engine_kwargs
        self.settings = settings
        self.max_running = int(kwargs.get("max_num_seqs") or 256)
        self.step_tokens = int(kwargs.get("max_num_batched_tokens") or 2048)
        self.step_s = float(kwargs.get("scripted_step_s") or DEFAULT_STEP_S)
        self.step_s_at = {int(k): float(v)
                          for k, v in (kwargs.get("scripted_step_s_at") or {}).items()}
        self.clock_scale = float(kwargs.get("scripted_clock_scale") or 1.0)
        self.start_file = kwargs.get("scripted_start_file")
        self.steps = 0
        self.watch = StallWatch(settings.engine_stall_timeout_s)
        lora = settings.lora  # the vLLM adapter's capacity (serve_app/engine/vllm_adapter.py)
        self.loras = LoadedAdapters(settings.name, 0 if lora is None
                                    else lora.max_cpu_loras or lora.max_loras)
        self._max_model_len = settings.max_model_len or DEFAULT_MAX_MODEL_LEN
        self._running: list[_Sequence] = []
        self._waiting: list[_Sequence] = []
        self._arrivals = itertools.count()
        self._started: list[str] = []
        self._prefill_tokens_avg = 0.0
        self._loop: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._released = asyncio.Event()  # cleared while a test holds the step loop
        self._released.set()
        self._parked = asyncio.Event()  # set while the loop waits between steps
        origin = time.monotonic()
        scale = self.clock_scale
        # The engine's clock: real monotonic time, sped up by scripted_clock_scale.
        self.clock: Callable[[], float] = lambda: origin + (time.monotonic() - origin) * scale

    async def start(self) -> None:
        while self.start_file and not os.path.exists(self.start_file):
            await asyncio.sleep(0.05)  # "loading the model"
        self._loop = asyncio.create_task(self._run())

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running), waiting=len(self._waiting),
                          kv_cache_usage=len(self._running) / self.max_running,
                          max_running=self.max_running, step_tokens=self.step_tokens,
                          prefill_tokens_avg=self._prefill_tokens_avg,
                          adapters=self.loras.names())

    def unfinished_requests(self) -> int:
        return len(self._running) + len(self._waiting)

    def started_order(self) -> list[str]:
        """Request ids in the order this engine started them (oldest first)."""
        return list(self._started)

    async def check_health(self) -> None:
        """Fail when the step loop is gone, or when the stall watch declares a stall on the
        engine's clock (then the loop is stopped, as the vLLM adapter kills a stalled core)."""
        if self._loop is None or self._loop.done():
            raise RuntimeError("the scripted engine's step loop is not running")
        stalled = self.watch.check(self.clock(), self.unfinished_requests())
        if stalled is not None:
            self._loop.cancel()
            error = RuntimeError(f"the scripted engine has held requests for {stalled:.0f} s "
                                 f"without a step (stall timeout {self.watch.timeout_s:.0f} s)")
            for seq in self._running + self._waiting:  # as vLLM ends them when its core dies
                seq.out.put_nowait(error)
            raise error

    async def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.cancel()

    async def hold_steps(self, held: bool) -> None:
        """``held=True``: stop the step loop after its current step and return once it has
        stopped (from then on nothing starts, emits or finishes); ``False``: let it run on."""
        if held:
            self._released.clear()
            await self._parked.wait()
        else:
            self._released.set()
            self._wake.set()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        prompt_tokens = count_prompt_tokens(request)
        room = self._max_model_len - prompt_tokens
        if room < 1:
            raise EngineRequestError(
                f"this model's maximum context length is {self._max_model_len} tokens; the "
                f"prompt has {prompt_tokens}", param="prompt", code="context_length_exceeded")
        max_tokens = request.sampling.max_tokens or room
        if max_tokens > room:
            raise EngineRequestError(
                f"max_tokens ({max_tokens}) plus the prompt ({prompt_tokens} tokens) exceeds "
                f"the context length ({self._max_model_len})", param="max_tokens")
        if request.adapter is not None:
            await self.loras.ensure(request.adapter, _load_adapter)
        seq = _Sequence(request, next(self._arrivals), prompt_tokens, max_tokens)
        self._prefill_tokens_avg += 0.1 * (prompt_tokens - self._prefill_tokens_avg)
        self.watch.submitted(self.clock(), engine_idle=not self.unfinished_requests())
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                chunk = await seq.out.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
                if chunk.finished:
                    return
        finally:  # finished, cancelled or abandoned: the engine forgets it (vLLM's abort)
            if seq in self._waiting:
                self._waiting.remove(seq)
            if seq in self._running:
                self._running.remove(seq)

    async def _run(self) -> None:
        """The step loop: start waiting requests, then one token for every running one."""
        while True:
            while not (self._running or self._waiting) or not self._released.is_set():
                self._parked.set()
                self._wake.clear()
                await self._wake.wait()
            self._parked.clear()
            started = self.clock()
            self._waiting.sort(key=lambda s: s.order)
            while self._waiting and len(self._running) < self.max_running:
                seq = self._waiting.pop(0)
                self._running.append(seq)
                self._started.append(seq.request.request_id)
            del self._started[:-STARTED_ORDER_KEPT]
            step_s = self.step_s_at.get(self.steps, self.step_s)
            self.steps += 1
            await asyncio.sleep(max(0.0, step_s - (self.clock() - started)) / self.clock_scale)
            for seq in list(self._running):
                self._emit(seq)
            self.watch.stepped(self.clock(), bool(self._running or self._waiting))

    def _emit(self, seq: _Sequence) -> None:
        """One step's token for every choice of ``seq``; the last one finishes it."""
        token = seq.generated
        seq.generated += 1
        finished = seq.generated >= seq.max_tokens
        if finished:
            self._running.remove(seq)
        if not seq.request.stream and not finished:
            return  # final output only: one chunk with the whole completion
        count = seq.generated if not seq.request.stream else 1
        first = token + 1 - count
        text = "".join(f" t{k}" for k in range(first, token + 1))
        deltas = [ChoiceDelta(index=i, text=text, num_tokens=count,
                              finish_reason="length" if finished else None)
                  for i in range(seq.request.sampling.n)]
        seq.out.put_nowait(GenerationChunk(deltas=deltas, prompt_tokens=seq.prompt_tokens,
                                           finished=finished))
