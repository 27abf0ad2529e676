"""The router: the OpenAI HTTP surface (FastAPI) as a Ray Serve ingress deployment.

Per request: read a bounded body -> validate -> find the model's LLMServer handle -> stream the
engine's chunks back as OpenAI JSON or SSE. The first chunk is awaited before the HTTP response
starts, so request errors the engine finds (context too long, bad token ids) are real 4xx status
codes, not errors in the middle of a 200 stream. When the client goes away the handler is
cancelled and the engine request with it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve_app.config import APP_NAME, AppConfig
from serve_app.engine.protocol import EngineRequestError, GenerationChunk
from serve_app.engine.timing import server_timing_header, with_router_phases
from serve_app.ingress.admission import AdmissionController, NoReplicaInTime, QueueFull, Slot
from serve_app.ingress.channels import ChannelTicket, ModelChannels, chunks_after_first
from serve_app.ingress.direct_start import DirectStarter
from serve_app.ingress.engine_feed import EngineFeed
from serve_app.ingress.errors import OpenAIError, install_error_handlers
from serve_app.ingress.live_config import REFRESH_S, read_tenants, tenants_version
from serve_app.ingress.openapi import install as install_openapi
from serve_app.ingress.openapi import request_body
from serve_app.ingress.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.ingress.responses import Kind, ResponseBuilder
from serve_app.ingress.stall import ClientStalled, StallWatch
from serve_app.ingress.tenants import TenantGate
from serve_app.ingress.transport import on_data_plane, uses_grpc
from serve_app.routing.capacity import COLD_START_PROBE, capacity_policy
from serve_app.routing.pinned import PREFER_KWARG
from serve_app.tenancy.fair_queue import service_of
from serve_app.tenancy.keys import Tenant

logger = logging.getLogger(__name__)

app = FastAPI(title="serve-app OpenAI endpoint", docs_url=None, redoc_url=None)
install_openapi(app, [CompletionRequest, ChatCompletionRequest])
install_error_handlers(app)

RequestT = TypeVar("RequestT", bound=BaseModel)


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The request body parsed as JSON, refusing more than ``max_bytes`` before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise OpenAIError(413, f"request body is larger than {max_bytes} bytes")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise OpenAIError(413, f"request body is larger than {max_bytes} bytes")
        parts.append(part)
    raw = b"".join(parts)
    if not raw:
        raise OpenAIError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise OpenAIError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # e.g. thousands of nested `[`
        raise OpenAIError(400, "the request body is nested too deeply") from None
    except ValueError as err:  # e.g. an integer past Python's digit limit
        raise OpenAIError(400, f"the request body has a value out of range: {err}") from None


def parse_request(model_cls: type[RequestT], data: Any) -> RequestT:
    """Validate ``data`` into ``model_cls`` or raise a 400 that names the first bad field."""
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        errors = err.errors()
        first = errors[0]
        # `param` is the top-level field, as OpenAI reports it; nested locations stay in the text.
        param = str(first["loc"][0]) if first["loc"] else None
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            msg = "this field is required"
        elif len([e for e in errors if e["loc"][:1] == first["loc"][:1]]) > 1:
            msg = "has the wrong type or shape; see the OpenAI API reference for this field"
        raise OpenAIError(400, f"{param}: {msg}" if param else msg, param=param) from None


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls ``on_abandon`` when it is done sending, however that went.

    A client that leaves before the first byte can make Starlette cancel the response before
    it ever starts the body generator; a generator that never started never runs its
    ``finally``, which would leave the engine generating and the admission slot held.
    ``on_abandon(status)`` must be idempotent (the generator's own cleanup usually ran
    already); its status is 408 when the stall watch cut a client that stopped reading, 499
    otherwise.

    The body streams in the task that calls the response, and a client that leaves cancels it
    (``client_gone``: a future that completes on the client's disconnect, e.g. the one that
    watched it while the request was queued; else one is started on ``receive``). Starlette's
    own response, for ASGI servers before spec 2.4 (uvicorn's), streams in a second task beside
    a disconnect listener in an anyio task group: about 0.9 ms between the first chunk and its
    first write at c=1 on a 2-core machine (bench/RESULTS.md 12d), on every request's TTFT."""

    def __init__(self, content: AsyncIterator[bytes], *, on_abandon: Callable[[int], None],
                 stall_watch: StallWatch | None = None,
                 client_gone: asyncio.Future[Any] | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_abandon = on_abandon
        self._stall_watch = stall_watch
        self._client_gone = client_gone

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        status = 499
        task = asyncio.current_task()
        assert task is not None
        gone = self._client_gone or asyncio.ensure_future(_disconnected(receive))
        streaming = True
        left = False

        def client_left(fut: asyncio.Future[Any]) -> None:
            # Runs between the task's steps: while `streaming`, the task waits at an await
            # inside stream_response, where the cancellation arrives.
            nonlocal left
            if streaming and not fut.cancelled():
                left = True
                task.cancel()

        gone.add_done_callback(client_left)
        try:
            await self.stream_response(send)
            streaming = False
        except ClientStalled:
            status = 408  # cut on purpose: the connection closes without the rest of the body
        except asyncio.CancelledError:
            if not left or task.uncancel() > 0:
                raise  # cancelled from outside (shutdown), not by the client leaving
        except OSError:  # ASGI servers of spec 2.4 raise on writes to a closed connection
            raise ClientDisconnect() from None
        finally:
            streaming = False
            gone.remove_done_callback(client_left)
            gone.cancel()
            self._on_abandon(status)

    async def stream_response(self, send: Any) -> None:
        """Starlette's, with each write timed by the stall watch (if any): a client that takes
        nothing for ``router.stream_stall_timeout_s`` is cut (:mod:`serve_app.ingress.stall`)."""
        if self._stall_watch is None:
            return await super().stream_response(send)
        timed_send, watched = self._stall_watch.timed(send)
        try:
            await super().stream_response(timed_send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not watched.stalled or task is None:
                raise
            task.uncancel()  # our own cut, not a cancellation of the whole response
            raise ClientStalled() from None
        finally:
            self._stall_watch.done(watched)


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


async def _disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return when the client disconnects. The body has been read, so the next ASGI message
    can only be ``http.disconnect``: no polling."""
    while (await receive())["type"] != "http.disconnect":
        # Only a server that answers receive() with empty body messages gets here; don't spin.
        await asyncio.sleep(0.05)


def _app_name() -> str:
    """This replica's Serve application (the key of its live tenant list)."""
    try:
        return serve.get_replica_context().app_name
    except Exception:  # outside a Serve replica (unit tests)
        return APP_NAME


def _router_id() -> str:
    """This router replica's Serve id (it keys the backlog it reports to the engines)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (unit tests)
        return f"router-{uuid.uuid4().hex[:8]}"


# Serve serializes the class when it is decorated: every module-level helper it calls must be
# defined above this point.
@serve.deployment(name="Router")
@serve.ingress(app)
class OpenAIRouter:
    """The ingress deployment. ``servers`` maps model names to their LLMServer handles."""

    def __init__(self, config: dict[str, Any], servers: dict[str, DeploymentHandle]) -> None:
        self.config = AppConfig.model_validate(config)
        self.settings = self.config.router
        servers = {name: on_data_plane(h) for name, h in servers.items()}
        self.streams = {name: h.options(stream=True) for name, h in servers.items()}
        self.handles = servers
        self.created = int(time.time())
        self._max_model_len: dict[str, int] = {}
        self.gate = TenantGate(self.config)
        # Streams whose client stopped reading are cut (serve_app/ingress/stall.py).
        self._stall_watch = StallWatch(self.settings.stream_stall_timeout_s)
        # Live tenants (serve_app/ingress/live_config.py): the bound config's until a deploy
        # publishes others. Read once before the first request is authenticated, then every
        # REFRESH_S by a background task: the store read (a thread hop and a GCS round trip)
        # used to run inline on every request that found the list a second old, which at
        # c=1 was most of them, on their time to first token.
        self.tenants_version = tenants_version(self.config.tenants)
        self._tenants_checked = 0.0
        self._tenants_task: asyncio.Task[None] | None = None
        self._tenants_read = asyncio.Event()
        self._app_name = _app_name()
        # Until the first load poll the model may have no replica: one request goes through
        # (it wakes a model scaled to zero), the rest wait for the feed's first answer.
        self.admission = {
            m.name: AdmissionController(COLD_START_PROBE, self.settings.max_queued_per_band,
                                        functools.partial(self.gate.queue_changed, m.name),
                                        policy=self.settings.queue_policy,
                                        first_request_slots=self.settings.admission.headroom)
            for m in self.config.models
        }
        router_id = _router_id()
        self.router_id = router_id
        # Streams' chunks after the first come batched per replica (serve_app/engine/channel.py).
        self.channels = ({m.name: ModelChannels(m.name, servers[m.name], router_id)
                          for m in self.config.models}
                         if self.settings.output_channels else {})
        # Requests also start on their engine over a socket (serve_app/engine/direct_start.py).
        self.direct = ({m.name: DirectStarter() for m in self.config.models}
                       if self.settings.direct_start else {})
        adm = self.settings.admission
        self.feeds = {
            m.name: EngineFeed(
                m.name, servers[m.name], self.admission[m.name],
                capacity_policy(adm.policy, headroom=adm.headroom,
                                kv_cache_high=adm.kv_cache_high,
                                fixed_per_replica=m.max_ongoing_requests,
                                upper_bound=self.settings.max_in_flight_per_model),
                adm, self.settings.num_replicas, router_id, on_poll=self.gate.engines_polled)
            for m in self.config.models
        }
        # Queue-depth gauges set in the constructor never reach Prometheus (measured: the
        # series stayed absent); they are published on the first request instead, and the
        # engine feeds start then (they need the replica's event loop).
        self._queue_gauges_live = False
        if self.gate.keys.open:
            logger.warning("no tenants configured: the endpoint is open (no API key needed)")

    # -- routes ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> dict[str, Any]:
        await self._tenants_current()
        tenant = self.gate.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [await self._model_card(m)
                                           for m in self._visible(tenant)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(self, model: str, request: Request) -> dict[str, Any]:
        await self._tenants_current()
        tenant = self.gate.authenticate(request.headers.get("authorization"))
        self._stream_handle(model, tenant)
        return await self._model_card(model)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, CompletionRequest, "completion", "cmpl-")

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, ChatCompletionRequest, "chat", "chatcmpl-")

    async def _tenants_current(self) -> None:
        """Return once the live tenant list has been read at least once by this replica (a
        replica started after a tenant change must not accept a revoked key even once); the
        first call starts the task that re-reads it every REFRESH_S. Free after the first read."""
        if self._tenants_task is None:
            self._tenants_task = asyncio.get_running_loop().create_task(
                self._keep_tenants_current())
        if not self._tenants_read.is_set():
            await self._tenants_read.wait()

    async def _keep_tenants_current(self) -> None:
        """Re-read the live tenant list every REFRESH_S, for the life of the replica."""
        while True:
            try:
                await self._refresh_tenants(force=True)
            except Exception:  # never let the refresher die: the next round tries again
                logger.exception("live tenant refresh failed")
            self._tenants_read.set()
            await asyncio.sleep(REFRESH_S)

    async def _refresh_tenants(self, force: bool = False) -> None:
        """Adopt the live tenant list if a deploy published a new one (unless ``force``, at
        most one store read per REFRESH_S; a record that does not validate against this app is
        refused and logged, and the current tenants stay)."""
        now = time.monotonic()
        if not force and now - self._tenants_checked < REFRESH_S:
            return
        self._tenants_checked = now
        try:
            live = await asyncio.to_thread(read_tenants, self._app_name)
        except Exception:
            logger.warning("could not read the live tenant list; keeping %s",
                           self.tenants_version, exc_info=True)
            return
        if live is None or live[0] == self.tenants_version:
            return
        version, tenants = live
        try:
            config = AppConfig.model_validate({
                **self.config.model_dump(mode="json"),
                "tenants": [t.model_dump(mode="json") for t in tenants]})
        except ValidationError as err:
            logger.error("live tenant list %s refused, keeping %s: %s", version,
                         self.tenants_version, err)
            return
        self.config = config
        self.gate.set_tenants(config.tenants)
        logger.info("tenants: version %s -> %s (%d tenants)", self.tenants_version, version,
                    len(config.tenants))
        self.tenants_version = version

    async def tenants_state(self) -> dict[str, Any]:
        """The tenant list this router replica enforces now (version and names)."""
        await self._refresh_tenants()
        return {"version": self.tenants_version, "tenants": [t.name for t in self.config.tenants]}

    async def admission_state(self) -> dict[str, dict[str, Any]]:
        """Per model: requests in flight and queued, the capacity and the live replicas as the
        engine feed saw them, each with its node and load (`serve-app status`, white-box
        tests)."""
        return {name: {"in_flight": a.in_flight, "queued": a.queued(), "capacity": a.capacity,
                       "in_flight_by_tenant": dict(a.tenant_in_flight),
                       "replicas": len(self.feeds[name].replicas),
                       "per_replica": [
                           {"replica": r.replica, "node": r.node, "active": r.active,
                            "running": r.running, "waiting": r.waiting,
                            "requests_total": r.requests_total}
                           for r in self.feeds[name].replicas],
                       "engine_waiting": sum(r.waiting for r in self.feeds[name].replicas),
                       "engine_running": sum(r.running for r in self.feeds[name].replicas),
                       "output_channels": (self.channels[name].open_channels()
                                           if name in self.channels else 0),
                       "direct_sent": self.direct[name].sent if name in self.direct else 0,
                       "transport": "grpc" if uses_grpc(self.streams[name]) else "actor call"}
                for name, a in self.admission.items()}

    # -- internals ------------------------------------------------------------------------------
    async def _model_card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": self.created,
                                "owned_by": "serve-app", "root": name}
        if name not in self._max_model_len:
            try:
                # Bounded: a replica still loading must not hold /v1/models hostage.
                info = await asyncio.wait_for(self.handles[name].model_info.remote(), 5)
                self._max_model_len[name] = info["max_model_len"]
            except Exception:  # a model still starting keeps its card without the length
                logger.warning("model_info of %s unavailable", name, exc_info=True)
        if name in self._max_model_len:
            card["max_model_len"] = self._max_model_len[name]
        return card

    def _visible(self, tenant: Tenant) -> list[str]:
        """The served models ``tenant`` may use; the others do not exist for it."""
        return [m for m in self.streams if tenant.may_use(m)]

    def _stream_handle(self, model: str, tenant: Tenant) -> DeploymentHandle:
        """``model``'s handle, or the same 404 whether it is not served or not allowed to
        ``tenant`` (the message lists only the tenant's own models)."""
        handle = self.streams.get(model)
        if handle is None or not tenant.may_use(model):
            raise OpenAIError(404, f"The model `{model}` does not exist. Available models: "
                              f"{', '.join(self._visible(tenant))}", param="model",
                              code="model_not_found")
        return handle

    async def _handle(self, http_request: Request,
                      model_cls: type[CompletionRequest] | type[ChatCompletionRequest],
                      kind: Kind, id_prefix: str) -> Response:
        """Authenticate, parse and serve one generation request; account it to its tenant
        (status, tokens, token quota) once it ends. Streams account when the stream ends."""
        arrived = time.monotonic()
        if not self._queue_gauges_live:
            self._queue_gauges_live = True
            for name, controller in self.admission.items():
                self.gate.queue_changed(name, controller)
                self.feeds[name].start()
        await self._tenants_current()
        tenant = self.gate.authenticate(http_request.headers.get("authorization"))
        label, status, builder, streaming = "", 500, None, False
        slot = Slot()
        try:
            body = await read_json_body(http_request, self.settings.max_body_bytes)
            req = parse_request(model_cls, body)
            # Before anything sized by `n` exists: the response builder allocates one choice
            # per `n`, and an n of 10**12 once took the router replica's memory and event loop
            # (found by the schema fuzzer).
            if req.n > self.settings.max_n:
                raise OpenAIError(400, f"n must be at most {self.settings.max_n}", param="n")
            # Only served names become metric labels: client strings must not grow the series.
            label = req.model if req.model in self.streams else "unknown"
            request_id = f"{id_prefix}{uuid.uuid4().hex}"
            builder = ResponseBuilder(kind, request_id, req.model, req.n)
            response = await self._serve(http_request, req, builder, tenant, slot, arrived)
            status, streaming = response.status_code, isinstance(response, StreamingResponse)
            return response
        except OpenAIError as err:
            status = err.status_code
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            if not streaming:
                self._end(tenant, label, status, builder, slot)

    def _end(self, tenant: Tenant, label: str, status: int, builder: ResponseBuilder | None,
             slot: Slot) -> None:
        """Account an ended request to its tenant and free its admission slot."""
        tokens = self._tokens(builder)
        self.gate.finish(tenant, label, status, *tokens)
        slot.release(service_of(*tokens))

    @staticmethod
    def _tokens(builder: ResponseBuilder | None) -> tuple[int, int]:
        if builder is None:
            return 0, 0
        return builder.prompt_tokens, builder.completion_tokens

    async def _serve(self, http_request: Request, req: CompletionRequest | ChatCompletionRequest,
                     builder: ResponseBuilder, tenant: Tenant, slot: Slot, arrived: float
                     ) -> Response:
        handle = self._stream_handle(req.model, tenant)
        self.gate.admit(tenant)
        # From here until the response starts, watch the client: one that leaves while its
        # request is queued or in prefill frees its place and the engine at once.
        gone = asyncio.ensure_future(_disconnected(http_request.receive))
        start = asyncio.ensure_future(self._admit_and_start(handle, req, builder, tenant, slot,
                                                             arrived))
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
            self.gate.first_token(tenant, req.model, time.monotonic() - arrived)
        headers = {"X-Request-Id": builder.request_id}
        if self.settings.server_timing and first.timing:
            headers["Server-Timing"] = server_timing_header(first.timing)
        if req.stream:
            ended = False

            def end(status: int) -> None:
                """Once per stream, however it ends: stop the engine work, account it."""
                nonlocal ended
                if not ended:
                    ended = True
                    # A completed stream's own Serve stream ends by itself (with channels it
                    # may still be closing): cancelling it would abort a finished request.
                    if status != 200 or ticket is None:
                        gen.cancel()
                    if ticket is not None:
                        self.channels[req.model].release(ticket)
                    self._end(tenant, req.model, status, builder, slot)

            return GuardedStreamingResponse(
                self._sse(gen, first, ticket, self.channels.get(req.model), builder,
                          req.include_usage, end),
                on_abandon=end, stall_watch=self._stall_watch, client_gone=gone,
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
        collect = asyncio.ensure_future(self._collect(gen, first, builder))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left (or we were cancelled): stop the engine
                collect.cancel()
                gen.cancel()
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody is listening; nginx's "client closed"
        if collect.exception() is not None:  # the engine failed mid-request: our fault, not theirs
            logger.error("engine request failed mid-way", exc_info=collect.exception())
            raise OpenAIError(503, "the model failed while generating; retry shortly",
                              headers={"Retry-After": "1"})
        return JSONResponse(builder.body(), headers=headers)

    async def _admit_and_start(self, handle: DeploymentHandle,
                               req: CompletionRequest | ChatCompletionRequest,
                               builder: ResponseBuilder, tenant: Tenant, slot: Slot,
                               arrived: float
                               ) -> tuple[DeploymentResponseGenerator, GenerationChunk,
                                          ChannelTicket | None]:
        """Wait for an admission slot, send the request to an engine, await its first chunk.
        A streamed request's later chunks come through the model's output channels (when
        ``router.output_channels``): the ticket says where."""
        try:
            await slot.acquire(self.admission[req.model], tenant.name, tenant.priority, req.n)
        except QueueFull:
            self.gate.refund(tenant)  # refused: the request costs no quota
            raise OpenAIError(429, f"{req.model} is at capacity and the {tenant.priority}-"
                              "priority queue is full; retry shortly", code="queue_full",
                              headers={"Retry-After": "1"}) from None
        except NoReplicaInTime:
            raise OpenAIError(503, f"{req.model} has no replica running yet and none started "
                              f"within {self.settings.admission.cold_start_timeout_s:g} s; "
                              "retry shortly", headers={"Retry-After": "5"}) from None
        admitted = time.monotonic()
        self.gate.admitted(tenant, req.model, admitted - arrived)
        generation = req.to_generation(builder.request_id)
        generation.cache_salt = tenant.cache_salt
        generation.priority = slot.priority
        generation.stream = req.stream
        channels = self.channels.get(req.model) if req.stream else None
        ticket = None
        if channels is not None:
            generation.reply_to = self.router_id
            ticket = channels.register(builder.request_id)
        direct = self.direct.get(req.model)
        target = direct.choose(self.feeds[req.model].replicas) if direct is not None else None
        sent = time.monotonic()
        gen: DeploymentResponseGenerator
        if target is not None and direct is not None and direct.send(target, generation):
            # The engine starts on the socket's frame; the call follows it there.
            gen = handle.generate.remote(generation, **{PREFER_KWARG: target.replica})
        else:
            target = None
            gen = handle.generate.remote(generation)
        if direct is not None:  # counted while the request is on its way, not on its TTFT
            self.gate.engine_started(req.model, "serve" if target is None else "direct")
        try:
            first = await self._first_chunk(gen)
            if target is not None and direct is not None and first.replica != target.replica:
                # Serve sent the call elsewhere (the chosen replica is stopping): the engine
                # work the frame started there would run on unclaimed until its orphan limit.
                direct.went_elsewhere(target.replica, builder.request_id)
                self.gate.engine_started(req.model, "elsewhere")
            if self.settings.server_timing:  # the router's phases beside the replica's
                first.timing = with_router_phases(first.timing, arrived, admitted, sent,
                                                  time.monotonic())
            return gen, first, ticket
        except BaseException:
            gen.cancel()
            if target is not None and direct is not None:
                direct.abort(target.replica, builder.request_id)
            if channels is not None and ticket is not None:
                channels.release(ticket)
            raise

    @staticmethod
    async def _collect(gen: DeploymentResponseGenerator, first: GenerationChunk,
                       builder: ResponseBuilder) -> None:
        try:
            builder.add(first)
            if not first.finished:
                async for wire in gen:
                    builder.add(GenerationChunk.from_wire(wire))
        finally:
            gen.cancel()  # no-op once the stream ended; aborts the engine work if cancelled

    async def _first_chunk(self, gen: DeploymentResponseGenerator) -> GenerationChunk:
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

    async def _sse(self, gen: DeploymentResponseGenerator, first: GenerationChunk,
                   ticket: ChannelTicket | None, channels: ModelChannels | None,
                   builder: ResponseBuilder, include_usage: bool,
                   end: Callable[[int], None]) -> AsyncIterator[bytes]:
        """SSE bytes for the stream; closing this generator (client gone) aborts the engine.
        The tenant is charged what was generated, however the stream ended."""
        status = 499  # until the stream completes or fails: the client went away
        try:
            yield builder.events(first)
            if not first.finished:
                if ticket is not None and channels is not None:
                    # Only once the first event is out: after a replica's idle close this
                    # opens a channel (a Serve call), which sat on the request's TTFT; the
                    # chunks wait in the replica's outbox meanwhile.
                    channels.attach(ticket, first.replica)
                    async for chunk in chunks_after_first(gen, ticket):
                        yield builder.events(chunk)
                else:
                    async for wire in gen:
                        yield builder.events(GenerationChunk.from_wire(wire))
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
