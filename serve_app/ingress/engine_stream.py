"""Reading one request's Serve stream from its LLMServer replica: the first chunk (the engine's
refusal of the request becomes its 4xx; a cold start is bounded, and ends at once when the
model's replica cannot be placed) and, for a non-streamed
answer, the rest of the chunks into its response builder, the tenant's charge told of each;
for a streamed one, its SSE bytes (:func:`sse_events`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from ray.serve.handle import DeploymentResponseGenerator

from serve_app.engine.protocol import EngineRequestError, GenerationChunk
from serve_app.ingress.channels import ChannelTicket, ModelChannels, chunks_after_first
from serve_app.ingress.errors import OpenAIError
from serve_app.ingress.responses import ResponseBuilder

if TYPE_CHECKING:
    from serve_app.admission.feed import EngineFeed

logger = logging.getLogger(__name__)

# Told a request's cumulative (prompt, completion) tokens as its chunks arrive.
Flow = Callable[[int, int], None]


def no_flow(prompt_tokens: int, completion_tokens: int) -> None:
    pass


async def collect_chunks(gen: DeploymentResponseGenerator, first: GenerationChunk,
                         builder: ResponseBuilder, flow: Flow = no_flow) -> None:
    """Every chunk of a non-streamed request into ``builder``; ``flow`` after each."""
    try:
        builder.add(first)
        if not first.finished:
            async for wire in gen:
                builder.add(GenerationChunk.from_wire(wire))
                flow(builder.prompt_tokens, builder.completion_tokens)
    finally:
        gen.cancel()  # no-op once the stream ended; aborts the engine work if cancelled


async def first_chunk(gen: DeploymentResponseGenerator) -> GenerationChunk:
    """The request's first chunk; the engine's refusal of the request becomes its 4xx."""
    try:
        return GenerationChunk.from_wire(await gen.__anext__())
    except StopAsyncIteration:
        raise OpenAIError(503, "the engine ended the request without output") from None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        engine_error = _engine_error(exc)
        if engine_error is not None:
            raise OpenAIError(engine_error.status_code, engine_error.message,
                              param=engine_error.param, code=engine_error.code) from None
        logger.exception("engine request failed")
        raise OpenAIError(503, "the model is unavailable right now; retry shortly",
                          headers={"Retry-After": "1"}) from None


def no_replica_error(model: str, timeout_s: float, unplaceable: str | None) -> OpenAIError:
    """The 503 of a request whose model had no live replica: none started within
    ``timeout_s`` (``cold_start_timeout_s``), or ``unplaceable`` says why none can."""
    if unplaceable:
        return OpenAIError(503, f"{model} cannot be placed on this cluster: {unplaceable}. "
                           "Give the model fewer resources per replica or add a node that "
                           "can hold one", code="model_cannot_be_placed",
                           headers={"Retry-After": "10"})
    return OpenAIError(503, f"{model} has no replica running yet and none started within "
                       f"{timeout_s:g} s; retry shortly", headers={"Retry-After": "5"})


async def first_chunk_of_cold_start(gen: DeploymentResponseGenerator, model: str,
                                    arrived: float, timeout_s: float,
                                    feed: EngineFeed | None = None) -> GenerationChunk:
    """The first chunk of a request sent while its model had no live replica, within
    ``timeout_s`` (``cold_start_timeout_s``) of the request's arrival (a request that waited
    that long in the queue before it was sent gets its 503 at once, not a second full wait),
    or a 503 as soon as the model's ``feed`` finds its replica cannot be placed."""
    left = timeout_s - (time.monotonic() - arrived)
    if left <= 0:
        raise no_replica_error(model, timeout_s, None)
    first = asyncio.ensure_future(first_chunk(gen))
    waits: set[asyncio.Future[object]] = {first}
    failed = None if feed is None else asyncio.ensure_future(feed.placement_failed.wait())
    if failed is not None:
        waits.add(failed)
    try:
        await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            if not task.done():
                task.cancel()
    if first.done() and not first.cancelled():
        return first.result()  # the first chunk, or the 4xx/503 first_chunk raised
    unplaceable = feed.unplaceable if failed is not None and failed.done() else None
    raise no_replica_error(model, timeout_s, unplaceable)


def _engine_error(exc: BaseException) -> EngineRequestError | None:
    """The EngineRequestError inside ``exc`` as Ray delivers it (wrapped or as its cause)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if isinstance(seen, EngineRequestError):
            return seen
        if seen is None:
            return None
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None


async def sse_events(gen: DeploymentResponseGenerator, first: GenerationChunk,
                     ticket: ChannelTicket | None, channels: ModelChannels | None,
                     builder: ResponseBuilder, include_usage: bool,
                     end: Callable[[int], None],
                     flow: Flow | None = None) -> AsyncIterator[bytes]:
    """SSE bytes for the stream; closing this generator (client gone) aborts the engine.
    ``flow`` is told the request's token counts as each chunk arrives (its charge); the
    tenant is charged what was generated, however the stream ended."""
    status = 499  # until the stream completes or fails: the client went away
    flow = flow or no_flow
    try:
        yield builder.events(first)
        if not first.finished:
            if ticket is not None and channels is not None:
                # Only once the first event is out: after a replica's idle close this
                # opens a channel (a Serve call), which sat on the request's TTFT; the
                # chunks wait in the replica's outbox meanwhile.
                channels.attach(ticket, first.replica)
                async for chunk in chunks_after_first(gen, ticket):
                    events = builder.events(chunk)
                    flow(builder.prompt_tokens, builder.completion_tokens)
                    yield events
            else:
                async for wire in gen:
                    events = builder.events(GenerationChunk.from_wire(wire))
                    flow(builder.prompt_tokens, builder.completion_tokens)
                    yield events
        yield builder.final_events(include_usage)
        status = 200
    except Exception:
        status = 503
        logger.exception("stream failed mid-way")
        err = {"error": {"message": "the stream was interrupted by a server fault",
                         "type": "server_error", "param": None, "code": None}}
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
    finally:
        end(status)
