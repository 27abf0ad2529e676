"""The request pipeline of one router replica, in the order a generation request meets it:

1. **authenticate**: API key -> tenant, by the live tenant list
   (:meth:`serve_app.governance.live_config.LiveTenants.authenticate`; 401);
2. **read**: a bounded body, validated into its OpenAI model (:mod:`serve_app.ingress.http`;
   400/413), and the model (or adapter: :mod:`serve_app.governance.adapters`) resolved for the
   tenant (404);
3. **quota**: the tenant's token budget, reserving the request's most from it, and its rate
   and token limits, the latter for the whole app through the quota actor's leases
   (:meth:`Charge.reserve <serve_app.governance.accounting.Charge.reserve>`; 429 + Retry-After,
   ``insufficient_quota`` for a spent budget);
4. **admit**: a place in the model's in-flight limit and under the tenant's concurrency cap,
   waiting in the fair queue while there is none (:mod:`serve_app.admission`; 429 when the
   band's queue is full, 503 when no replica came up in time);
5. **dispatch**: one Serve call to the LLMServer deployment, whose request router picks the
   replica; the first chunk is awaited before the HTTP response starts, so errors the engine
   finds (context too long, bad token ids) are real 4xx status codes, not errors inside a 200;
6. **stream**: SSE events (later chunks through the output channels,
   :mod:`serve_app.ingress.channels`) or one JSON body; the tenant is charged the tokens as
   the chunks arrive (TPM, budget, fair-share service);
7. **finish**: once, however the request ended (completed, failed, client gone): the engine
   work is cancelled if unfinished, the charge settled (a client that left during prefill
   pays its prompt), the admission place freed, and its usage record written.

What a request costs and when is :mod:`serve_app.governance.accounting`'s contract.

Every answer after authentication carries the tenant's ``x-ratelimit-*`` headers.

A client that goes away at any point, queued, in prefill or streaming, cancels its request and
the engine's work with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve_app.admission.controller import (
    AdmissionController,
    NoReplicaInTime,
    QueueFull,
    Slot,
)
from serve_app.admission.feed import EngineFeed
from serve_app.config import RouterSettings
from serve_app.engine.protocol import GenerationChunk
from serve_app.engine.timing import CACHED_TOKENS, server_timing_header, with_router_phases
from serve_app.governance.accounting import (
    Charge,
    Progress,
    completion_limit,
    estimate_prompt_tokens,
    record_usage,
)
from serve_app.governance.budgets import BudgetSync
from serve_app.ingress.channels import ChannelTicket, ModelChannels
from serve_app.ingress.engine_stream import (
    collect_chunks,
    first_chunk,
    first_chunk_of_cold_start,
    sse_events,
    no_replica_error,
)
from serve_app.ingress.errors import OpenAIError
from serve_app.ingress.http import disconnected, parse_request, read_json_body
from serve_app.governance.live_config import LiveTenants
from serve_app.ingress.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.ingress.responses import Kind, ResponseBuilder
from serve_app.ingress.stall import StallWatch
from serve_app.ingress.streaming import GuardedStreamingResponse
from serve_app.governance.tenants import TenantGate
from serve_app.governance.usage import UsageLog
from serve_app.governance.keys import Tenant
from serve_app.observability import tracing

logger = logging.getLogger(__name__)

OpenAIRequest = CompletionRequest | ChatCompletionRequest


class RequestPipeline:
    """Serves generation requests for one router replica (see the module docstring).

    ``streams`` maps served model names to streaming handles of their LLMServer deployments;
    ``admission``, ``feeds`` and ``channels`` are keyed the same way (``channels`` only when
    ``router.output_channels`` is on)."""

    def __init__(self, settings: RouterSettings, tenants: LiveTenants,
                 streams: dict[str, DeploymentHandle],
                 admission: dict[str, AdmissionController], feeds: dict[str, EngineFeed],
                 channels: dict[str, ModelChannels], router_id: str,
                 usage: UsageLog | None = None, budgets: BudgetSync | None = None) -> None:
        self.settings = settings
        self.tenants = tenants
        self.streams = streams
        self.admission = admission
        self.feeds = feeds
        self.channels = channels
        self.router_id = router_id
        self.usage = usage
        self.budgets = budgets
        # Streams whose client stopped reading are cut (serve_app/ingress/stall.py).
        self.stall_watch = StallWatch(settings.stream_stall_timeout_s)
        self._started = False
        tracing.configure(settings.tracing, "router")  # off: nothing is set up

    @property
    def gate(self) -> TenantGate:
        """The tenant gate (its keys and limits follow the live tenant list)."""
        return self.tenants.gate

    # -- models a tenant sees ---------------------------------------------------------------
    def visible(self, tenant: Tenant) -> list[str]:
        """The served models ``tenant`` may use; the others do not exist for it."""
        return [m for m in self.streams if tenant.may_use(m)]

    def model_handle(self, model: str, tenant: Tenant) -> DeploymentHandle:
        """``model``'s handle, or the same 404 whether it is not served or not allowed to
        ``tenant`` (the message lists only the tenant's own models)."""
        handle = self.streams.get(model)
        if handle is None or not tenant.may_use(model):
            raise OpenAIError(404, f"The model `{model}` does not exist. Available models: "
                              f"{', '.join(self.visible(tenant))}", param="model",
                              code="model_not_found")
        return handle

    # -- the pipeline ---------------------------------------------------------------------------
    async def handle(self, http_request: Request, model_cls: type[OpenAIRequest], kind: Kind,
                     id_prefix: str) -> Response:
        """Serve one generation request through every step; a non-streaming request finishes
        here, a stream when its response ends."""
        progress = Progress(time.monotonic())
        self.start_feeds()
        rt = tracing.start_request(http_request.headers)  # tracing.NO_TRACE while off
        tenant = await rt.authenticate(
            self.tenants.authenticate(http_request.headers.get("authorization")))
        label, status, builder, streaming = "", 500, None, False
        slot, charge = Slot(), None
        try:
            req = await self._read(http_request, model_cls)
            builder = ResponseBuilder(kind, f"{id_prefix}{uuid.uuid4().hex}", req.model, req.n)
            # A tenant's adapter runs on its base model: req.model becomes the base's name.
            progress.adapter = self.tenants.adapters.route(req, tenant)
            # Only served names become metric labels: client strings must not grow the series.
            label = req.model if req.model in self.streams else "unknown"
            progress.stream = req.stream
            rt.request(tenant, label, builder.request_id)
            charge = Charge(self.gate, tenant, estimate_prompt_tokens(req), completion_limit(
                req, self.settings.budget_reserve_max_tokens))
            response = await self._serve(http_request, req, builder, tenant, slot, charge,
                                         progress)
            status, streaming = response.status_code, isinstance(response, StreamingResponse)
            return response
        except OpenAIError as err:
            status = err.status_code
            rt.error(err)
            # Every authenticated answer carries the tenant's rate-limit state, errors too (a
            # 429's remaining figures are what tells a client how long to back off).
            err.headers = {**self.gate.ratelimit_headers(tenant), **(err.headers or {})}
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            if not streaming:
                self._finish(tenant, label, status, builder, slot, charge, progress, rt)

    def start_feeds(self) -> None:
        """On the first request (or ``/ready``; idempotent): publish the queue gauges and start
        the engine feeds. Gauges set in the replica's constructor never reach Prometheus
        (measured: the series stayed absent), and the feeds need the replica's event loop."""
        if self._started:
            return
        self._started = True
        for name, controller in self.admission.items():
            self.gate.queue_changed(name, controller)
            self.feeds[name].start()
        if self.gate.cluster is not None:  # the quota-degraded gauge exists from the start
            self.gate.cluster.publish_degraded()

    async def _read(self, http_request: Request, model_cls: type[OpenAIRequest]
                    ) -> OpenAIRequest:
        req = parse_request(model_cls, await read_json_body(http_request,
                                                            self.settings.max_body_bytes))
        # Before anything sized by `n` exists: the response builder allocates one choice per
        # `n`, and an n of 10**12 once took the router replica's memory and event loop (found
        # by the schema fuzzer).
        if req.n > self.settings.max_n:
            raise OpenAIError(400, f"n must be at most {self.settings.max_n}", param="n")
        return req

    def _finish(self, tenant: Tenant, label: str, status: int,
                builder: ResponseBuilder | None, slot: Slot, charge: Charge | None,
                progress: Progress, rt: tracing.RequestTrace | None = None) -> None:
        """Settle an ended request's charge, count it, free its admission place (charging the
        fair queue the service the flow did not), and write its usage record."""
        counts = (builder.prompt_tokens, builder.completion_tokens) if builder is not None \
            else (0, 0)
        prompt, completion, service = (0, 0, 0.0) if charge is None \
            else charge.settle(status, *counts)
        self.gate.finish(tenant, label, status, prompt, completion, progress.adapter_name)
        slot.release(service)
        (rt or tracing.NO_TRACE).finish(status, prompt, completion, progress.cached_tokens)
        record_usage(self.usage, tenant, label, status, builder, prompt, completion, progress,
                     charge is not None and charge.estimated)

    async def _serve(self, http_request: Request, req: OpenAIRequest, builder: ResponseBuilder,
                     tenant: Tenant, slot: Slot, charge: Charge, progress: Progress
                     ) -> Response:
        handle = self.model_handle(req.model, tenant)
        if self.budgets is not None:  # a replica that just started reads the spend first
            await self.budgets.ready(tenant.name)
        await tracing.current().phase("quota", charge.reserve())
        # From here until the response starts, watch the client: one that leaves while its
        # request is queued or in prefill frees its place and the engine at once.
        gone = asyncio.ensure_future(disconnected(http_request.receive))
        start = asyncio.ensure_future(self._admit_and_dispatch(handle, req, builder, tenant,
                                                               slot, charge, progress))
        try:
            await asyncio.wait({start, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            gone.cancel()
            start.cancel()
            raise
        if not start.done():  # the client left first
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)  # its cleanup has run
            return Response(status_code=499)
        try:
            gen, first, ticket = start.result()
        except BaseException:
            gone.cancel()
            raise
        if req.stream:  # a non-streaming response has no first token before its last one
            self.gate.first_token(tenant, req.model, time.monotonic() - progress.arrived)
        headers = {"X-Request-Id": builder.request_id, **self.gate.ratelimit_headers(tenant)}
        if self.settings.server_timing and first.timing:
            headers["Server-Timing"] = server_timing_header(first.timing)
        if req.stream:
            return self._stream(req, gen, first, ticket, builder, tenant, slot, charge, gone,
                                headers, progress)
        return await self._collect_json(gen, first, builder, tenant, charge, gone, headers)

    async def _admit_and_dispatch(self, handle: DeploymentHandle, req: OpenAIRequest,
                                  builder: ResponseBuilder, tenant: Tenant, slot: Slot,
                                  charge: Charge, progress: Progress
                                  ) -> tuple[DeploymentResponseGenerator, GenerationChunk,
                                             ChannelTicket | None]:
        """Wait for an admission place, send the request to the model's deployment, await its
        first chunk. A streamed request's later chunks come through the model's output
        channels when ``router.output_channels`` is on: the ticket says where."""
        controller = self.admission[req.model]
        rt = tracing.current()
        # Where the request joined the queue: the requests already waiting (a fair queue has no
        # fixed position; VTC picks among tenants), read only for a recorded span.
        ahead = {"serve_app.queue.ahead": controller.queued(),
                 "serve_app.queue.ahead_in_band": controller.queued(tenant.priority)
                 } if rt.recording else {}
        try:
            await rt.phase("queue", slot.acquire(
                controller, tenant.name, tenant.priority, req.n, charge.expected_service),
                band=tenant.priority, **ahead)
        except QueueFull as full:
            charge.refund()  # refused: the request costs no quota
            raise OpenAIError(429, f"{req.model} {full}", code="queue_full",
                              headers={"Retry-After": "1"}) from None
        except NoReplicaInTime as late:
            raise no_replica_error(req.model, self.settings.admission.cold_start_timeout_s,
                                   late.reason) from None
        arrived = progress.arrived
        admitted = progress.admitted = time.monotonic()
        self.gate.admitted(tenant, req.model, admitted - arrived)
        charge.admitted(controller.queue, charge.expected_service)
        generation = req.to_generation(builder.request_id)
        generation.cache_salt = tenant.cache_salt  # from the tenant, never from the client
        generation.adapter = progress.adapter
        generation.priority = slot.priority
        generation.stream = req.stream
        generation.trace_context = tracing.current().dispatch()
        channels = self.channels.get(req.model) if req.stream else None
        ticket = None
        if channels is not None:
            generation.reply_to = self.router_id
            ticket = channels.register(builder.request_id)
        sent = time.monotonic()
        # Sent while the model had no live replica: it waits in Serve's handle queue for one to
        # start, which for a model that cannot be placed is forever; bound it like the queue.
        cold = not self.feeds[req.model].replicas
        charge.dispatched()  # from here the request pays for the engine's work
        gen: DeploymentResponseGenerator = handle.generate.remote(generation)
        try:
            if cold:
                first = await first_chunk_of_cold_start(
                    gen, req.model, arrived, self.settings.admission.cold_start_timeout_s,
                    self.feeds[req.model])
            else:
                first = await first_chunk(gen)
            slot.assign(first.replica)  # from now on it counts only while its replica is live
            charge.flow(first.prompt_tokens, sum(d.num_tokens for d in first.deltas))
            progress.first_chunk = time.monotonic()
            tracing.current().first_chunk(first)
            if first.timing and CACHED_TOKENS in first.timing:
                progress.cached_tokens = int(first.timing[CACHED_TOKENS])
            if self.settings.server_timing:  # the router's phases beside the replica's
                first.timing = with_router_phases(first.timing, arrived, admitted, sent,
                                                  time.monotonic())
            return gen, first, ticket
        except BaseException:
            gen.cancel()
            if channels is not None and ticket is not None:
                channels.release(ticket)
            raise

    def _stream(self, req: OpenAIRequest, gen: DeploymentResponseGenerator,
                first: GenerationChunk, ticket: ChannelTicket | None, builder: ResponseBuilder,
                tenant: Tenant, slot: Slot, charge: Charge, gone: asyncio.Future[None],
                headers: dict[str, str], progress: Progress) -> StreamingResponse:
        ended, rt = False, tracing.current()

        def end(status: int) -> None:
            """Once per stream, however it ends: stop the engine work, account it."""
            nonlocal ended
            if not ended:
                ended = True
                # A completed stream's own Serve stream ends by itself (with channels it may
                # still be closing): cancelling it would abort a finished request.
                if status != 200 or ticket is None:
                    gen.cancel()
                if ticket is not None:
                    self.channels[req.model].release(ticket)
                self._finish(tenant, req.model, status, builder, slot, charge, progress, rt)

        return GuardedStreamingResponse(
            self._sse(gen, first, ticket, self.channels.get(req.model), builder,
                      req.include_usage, end, charge.flow),
            on_abandon=end, stall_watch=self.stall_watch, client_gone=gone,
            media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})

    async def _collect_json(self, gen: DeploymentResponseGenerator, first: GenerationChunk,
                            builder: ResponseBuilder, tenant: Tenant, charge: Charge,
                            gone: asyncio.Future[None], headers: dict[str, str]) -> Response:
        collect = asyncio.ensure_future(collect_chunks(gen, first, builder, charge.flow))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left (or we were cancelled): stop the engine
                collect.cancel()
                gen.cancel()
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody is listening; nginx's "client closed"
        if collect.exception() is not None:  # the engine failed mid-request: our fault
            logger.error("engine request failed mid-way", exc_info=collect.exception())
            raise OpenAIError(503, "the model failed while generating; retry shortly",
                              headers={"Retry-After": "1"})
        # The token figures count this answer's own tokens (charged as they came).
        headers.update(self.gate.ratelimit_headers(tenant))
        return JSONResponse(builder.body(), headers=headers)

    # The stream's SSE bytes (serve_app/ingress/engine_stream.py), where the tests reach it.
    _sse = staticmethod(sse_events)
