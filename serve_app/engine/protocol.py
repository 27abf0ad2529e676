"""The engine contract every LLMServer replica drives, and the records that cross the Ray hop.

The router never sees vLLM objects: it sends a :class:`GenerationRequest` and receives
:class:`GenerationChunk` records. One chunk crosses a process boundary per engine step per
request, the hottest path in the system, so a chunk travels in its wire form
(:meth:`GenerationChunk.to_wire`): nested tuples of builtins, about 20% cheaper per streamed
item than the dataclass on Serve's gRPC hop (``bench/serve_hop.py``, bench/RESULTS.md section
12). Most of that hop's cost is per message, whatever it holds: the chunks after a request's
first travel batched across requests (:mod:`serve_app.engine.channel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol, runtime_checkable


class EngineRequestError(Exception):
    """A request the engine refuses because of its content (maps to an HTTP 4xx).

    Raised by :meth:`Engine.generate` before any chunk is produced. ``param`` names the request
    field at fault, as OpenAI error bodies do.
    """

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields must survive pickling across the Ray hop.
        return (_rebuild_request_error, (self.message, self.status_code, self.param, self.code))


def _rebuild_request_error(message: str, status_code: int, param: str | None,
                           code: str | None) -> EngineRequestError:
    return EngineRequestError(message, status_code=status_code, param=param, code=code)


@dataclass(slots=True)
class SamplingOptions:
    """The sampling knobs of the OpenAI API the engine honours (validated by the router)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(slots=True)
class GenerationRequest:
    """One request as the router hands it to an engine replica.

    Exactly one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat, rendered with the
    tokenizer's chat template by the engine side) is set.
    """

    request_id: str
    sampling: SamplingOptions
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    add_special_tokens: bool = True
    # Prefix-cache isolation: requests share cached prefixes only with the same salt. The router
    # sets it from the tenant (never from the client).
    cache_salt: str | None = None
    # Order inside the engine's waiting queue (lower first), set by the router from the fair
    # queue; engines without priority scheduling ignore it.
    priority: int = 0
    # False: the caller needs only the finished result, so the engine may yield one chunk (the
    # whole completion, finished=True) instead of one per step. Engines may still stream.
    stream: bool = True
    # The router replica whose output channel carries the chunks after the first
    # (serve_app/engine/channel.py); None: every chunk comes back on the request's own stream.
    reply_to: str | None = None
    # The client's session key (OpenAI ``prompt_cache_key``, else ``user``): requests that name
    # one are kept together by the ``prefix_cache`` routing policy, within their tenant.
    session: str | None = None
    # Set by the ``prefix_cache`` routing policy (serve_app/routing/prefix_blocks.py): the
    # chained hashes of the prompt's leading blocks of ``prefix_block_tokens`` tokens each (and
    # of the session key), computed once by the router; the replica that serves the request
    # records them as cached (serve_app/engine/server.py, ServedBlocks).
    prefix_hashes: tuple[int, ...] | None = None
    prefix_block_tokens: int = 0
    # The W3C trace context (``traceparent``, ``tracestate``) of the router's dispatch span when
    # tracing is on (serve_app/observability/tracing.py); the replica passes it on to vLLM.
    trace_context: dict[str, str] | None = None
    # The LoRA adapter to run the request with, as the router's adapter table names it
    # (serve_app/governance/adapters.py): (name, id, path), builtins for the Ray hop. The id is
    # stable for a (model, name, path), so every replica and router agree on it and a
    # changed path is a new adapter to vLLM. None: the base model.
    adapter: tuple[str, int, str] | None = None


@dataclass(slots=True)
class ChoiceDelta:
    """New output of one choice since the previous chunk."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


# (index, text, num_tokens, finish_reason, stop_reason) per choice with news, then prompt_tokens,
# finished, timing and replica. A transport may hand tuples back as lists; from_wire takes either.
WireDelta = tuple[int, str, int, "str | None", "int | str | None"]
WireChunk = tuple[tuple[WireDelta, ...], int, bool, "dict[str, float] | None", "str | None"]


@dataclass(slots=True)
class GenerationChunk:
    """What the engine produced for one request since the last chunk.

    ``prompt_tokens`` is set on every chunk (it is known before the first token); ``finished``
    is True on the last chunk of the request, after which the stream ends.
    """

    deltas: list[ChoiceDelta]
    prompt_tokens: int
    finished: bool
    # On the first chunk only, from engines that know them: where the request's time to this
    # chunk went on the replica side, in milliseconds by phase (see
    # :data:`serve_app.engine.timing.PHASES`), and two clock readings of the replica the router
    # turns into its hop phases. The router can pass them on in a Server-Timing header
    # (``router.server_timing``).
    timing: dict[str, float] | None = None
    # On the first chunk only: the Serve id of the LLMServer replica serving the request (the
    # router opens its output channel to that replica).
    replica: str | None = None

    def to_wire(self) -> WireChunk:
        """This chunk as builtins only, for the Ray hop (see the module docstring)."""
        return (tuple((d.index, d.text, d.num_tokens, d.finish_reason, d.stop_reason)
                      for d in self.deltas),
                self.prompt_tokens, self.finished, self.timing, self.replica)

    @classmethod
    def from_wire(cls, wire: WireChunk | list[Any]) -> "GenerationChunk":
        """The chunk :meth:`to_wire` encoded (tuples, or lists where a transport made them so)."""
        deltas, prompt_tokens, finished, timing, replica = wire
        return cls([ChoiceDelta(*d) for d in deltas], prompt_tokens, finished, timing, replica)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine replica's load: the one record the engine, the routers' engine feed, the
    capacity policies, autoscaling and `serve-app status` share.

    The engine fills the first six fields (:meth:`Engine.load`, as of its latest scheduler
    step); the replica adds the rest when it answers ``LLMServer.engine_load``.

    ``running``: requests the engine has started (decoding or in a chunked prefill).
    ``waiting``: requests it holds but could not start (token budget, KV cache, max_num_seqs).
    ``kv_cache_usage``: fraction of KV-cache blocks in use (0..1).
    ``max_running``: the most requests the engine runs at once (vLLM's ``max_num_seqs``; 0:
    unknown).
    ``step_tokens``: tokens one engine step may process (``max_num_batched_tokens``).
    ``prefill_tokens_avg``: prompt tokens recent requests needed computed (moving average): the
    prompt less what the engine's prefix cache held, so a step starts as many prompts as it
    really can; 0 before the first request.
    ``replica``: Serve's id of the replica; ``node``: the Ray node it runs on.
    ``active``: requests the replica is serving (tokenizing, in the engine, streaming out).
    ``requests_total``: requests it has taken since it started (how evenly routers spread them).
    ``unfinished``: requests the engine front end still tracks (drops once aborts are processed).
    ``router_demand``: per router replica that reported to this replica within the last few
    seconds, its demand for the model (requests it has in flight plus those it holds queued):
    how the routers share the model's capacity (:mod:`serve_app.admission.share`).
    ``prefix_report``: what this replica's prefix cache holds, as block hashes, since what the
    asking router last knew (:class:`PrefixReport`); None when the router asked for none.
    ``adapters``: the LoRA adapters the engine has loaded as far as it knows (those it ran
    most recently, at most its ``max_cpu_loras``), least recent first; () without LoRA.
    """

    running: int
    waiting: int
    kv_cache_usage: float = 0.0
    max_running: int = 0
    step_tokens: int = 0
    prefill_tokens_avg: float = 0.0
    replica: str = ""
    node: str = ""
    active: int = 0
    requests_total: int = 0
    unfinished: int = 0
    router_demand: tuple[tuple[str, int], ...] = ()
    prefix_report: PrefixReport | None = None
    adapters: tuple[str, ...] = ()

    @property
    def step_intake(self) -> int:
        """About how many waiting prompts one engine step can start (0: unknown)."""
        if self.step_tokens <= 0 or self.prefill_tokens_avg <= 0:
            return 0
        return int(self.step_tokens // max(1.0, self.prefill_tokens_avg))

    @property
    def in_engine(self) -> int:
        """Requests on this replica, counted where they are most: sent to it (``active``) or
        held by its engine (a request the engine still runs after its stream was cancelled)."""
        return max(self.active, self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class PrefixReport:
    """The block hashes a replica counts as cached in its engine's prefix cache, as a change
    since what one router knew (:class:`serve_app.engine.server.ServedBlocks` writes it,
    :mod:`serve_app.routing.prefix_index` reads it).

    ``epoch``: the replica's record's id (new when the replica starts); ``seq``: its change
    count after this report. ``base``: the ``seq`` the change starts from (the router applies it
    only when it knows exactly that state), or None for a whole snapshot: ``added`` is then
    everything held. ``added`` and ``removed`` never share a hash.
    """

    epoch: str
    seq: int
    base: int | None
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


@runtime_checkable
class Engine(Protocol):
    """An inference engine owned by one LLMServer replica.

    Lifecycle: the replica constructs the engine, awaits :meth:`start` once, then serves
    :meth:`generate` calls concurrently until :meth:`shutdown`.
    """

    async def start(self) -> None:
        """Load the model; return when requests can be served. Raises if it cannot start."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, in tokens, the engine accepts."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream chunks as soon as the engine produces them.

        Raises :class:`EngineRequestError` for a bad request before the first chunk. Cancelling
        the iteration (the task is cancelled, or ``aclose()``) aborts the engine's work.
        """

    async def check_health(self) -> None:
        """Raise if the engine is dead. Must return promptly while the engine is busy."""

    def load(self) -> EngineLoad:
        """Requests running and waiting inside the engine right now (cheap, no I/O)."""

    async def shutdown(self) -> None:
        """Release the engine's processes and memory."""
