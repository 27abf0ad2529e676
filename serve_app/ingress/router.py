"""The router: the OpenAI HTTP surface (FastAPI) as a Ray Serve ingress deployment.

This class only wires the parts together and maps routes to them: the request pipeline
(:mod:`serve_app.ingress.pipeline`: authenticate -> quota -> admit -> dispatch -> stream ->
finish), the live tenant list (:mod:`serve_app.governance.live_config`), the model cards
(:mod:`serve_app.ingress.model_cards`), and per served model its admission controller and
engine feed (:mod:`serve_app.admission`) and output channels
(:mod:`serve_app.ingress.channels`).
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.admission import COLD_START_PROBE, capacity_policy
from serve_app.admission.controller import AdmissionController
from serve_app.admission.feed import EngineFeed
from serve_app.config import APP_NAME, AppConfig
from serve_app.governance.budgets import BudgetSync
from serve_app.ingress.channels import ModelChannels
from serve_app.ingress.errors import install_error_handlers
from serve_app.governance.live_config import LiveTenants
from serve_app.ingress.model_cards import ModelCards
from serve_app.ingress.openapi import install as install_openapi
from serve_app.ingress.openapi import request_body
from serve_app.ingress.pipeline import RequestPipeline
from serve_app.ingress.readiness import readiness
from serve_app.ingress.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.governance.tenants import TenantGate
from serve_app.governance.usage import UsageLog
from serve_app.serve_private import on_data_plane, uses_grpc

logger = logging.getLogger(__name__)

app = FastAPI(title="serve-app OpenAI endpoint", docs_url=None, redoc_url=None)
install_openapi(app, [CompletionRequest, ChatCompletionRequest])
install_error_handlers(app)


def _replica_context() -> tuple[str, str]:
    """This replica's Serve application (the key of its live tenant list) and its replica id
    (which keys the backlog it reports to the engines); stand-ins outside Serve (unit tests)."""
    try:
        ctx = serve.get_replica_context()
        return ctx.app_name, ctx.replica_id.unique_id
    except Exception:
        return APP_NAME, f"router-{uuid.uuid4().hex[:8]}"


@serve.deployment(name="Router")
@serve.ingress(app)
class OpenAIRouter:
    """The ingress deployment. ``servers`` maps model names to their LLMServer handles."""

    def __init__(self, config: dict[str, Any], servers: dict[str, DeploymentHandle]) -> None:
        config_ = AppConfig.model_validate(config)
        settings = config_.router
        app_name, router_id = _replica_context()
        servers = {name: on_data_plane(h) for name, h in servers.items()}
        gate = TenantGate(config_, app_name)
        self.tenants = LiveTenants(config_, gate, app_name)
        adm = settings.admission
        # Until the first load poll the model may have no replica: one request goes through
        # (it wakes a model scaled to zero), the rest wait for the feed's first answer.
        admission = {
            m.name: AdmissionController(COLD_START_PROBE, settings.max_queued_per_band,
                                        functools.partial(gate.queue_changed, m.name),
                                        policy=settings.queue_policy,
                                        first_request_slots=adm.headroom, caps=gate.caps,
                                        max_queued_per_tenant=settings.max_queued_per_tenant)
            for m in config_.models}
        if gate.cluster is not None:  # with several routers, fair share over all of them
            gate.cluster.share_service({name: c.queue for name, c in admission.items()})
        feeds = {
            m.name: EngineFeed(
                m.name, servers[m.name], admission[m.name],
                capacity_policy(adm.policy, headroom=adm.headroom,
                                kv_cache_high=adm.kv_cache_high,
                                fixed_per_replica=m.max_ongoing_requests,
                                upper_bound=settings.max_in_flight_per_model,
                                batch_reserve=adm.batch_reserve),
                adm, router_id, on_poll=gate.engines_polled)
            for m in config_.models}
        # Cards from the config and the feeds' view: listing models never wakes one at zero.
        self.cards = ModelCards(feeds, {m.name: m.max_model_len for m in config_.models})
        self.feeds = feeds
        self.kept_replicas = {m.name: m.autoscaling.min_replicas for m in config_.models}
        # Streams' chunks after the first come batched per replica (serve_app/engine/channel.py).
        channels = ({m.name: ModelChannels(m.name, servers[m.name], router_id)
                     for m in config_.models} if settings.output_channels else {})
        self.pipeline = RequestPipeline(
            settings, self.tenants, {n: h.options(stream=True) for n, h in servers.items()},
            admission, feeds, channels, router_id,
            UsageLog(config_.governance.usage, router_id),
            BudgetSync(gate.budgets, app_name, router_id))
        if gate.keys.open:
            logger.warning("no tenants configured: the endpoint is open (no API key needed)")

    # -- routes ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self) -> Response:
        """200 once every model kept warm has a live engine replica, 503 while one loads
        (:mod:`serve_app.ingress.readiness`)."""
        self.pipeline.start_feeds()  # a router that served no request has not polled yet
        ok, body = readiness(self.feeds, self.kept_replicas)
        if ok:
            return JSONResponse(body)
        # "Not now": a poller (and the schema fuzzer) asks again in a second.
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> dict[str, Any]:
        """The models and the LoRA adapters the tenant may use (an adapter's ``parent``: its
        base model); the rest do not exist for it."""
        tenant = await self.tenants.authenticate(request.headers.get("authorization"))
        models = self.pipeline.visible(tenant)
        cards = dict(zip(models, await self.cards.cards(models)))
        table = self.tenants.adapters
        return {"object": "list", "data": [*cards.values(), *(
            table.card(a, cards[a.model]) for a in table.visible(tenant) if a.model in cards)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(self, model: str, request: Request) -> dict[str, Any]:
        tenant = await self.tenants.authenticate(request.headers.get("authorization"))
        adapter = self.tenants.adapters.for_tenant(model, tenant)
        if adapter is not None:
            return self.tenants.adapters.card(adapter, await self.cards.card(adapter.model))
        self.pipeline.model_handle(model, tenant)  # 404 unless served and allowed
        return await self.cards.card(model)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self.pipeline.handle(request, CompletionRequest, "completion", "cmpl-")

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self.pipeline.handle(request, ChatCompletionRequest, "chat", "chatcmpl-")

    # -- state for `serve-app status` and white-box tests ---------------------------------------
    async def tenants_state(self) -> dict[str, Any]:
        """The tenant list this router replica enforces now (version and names)."""
        return await self.tenants.state()

    async def admission_state(self) -> dict[str, dict[str, Any]]:
        """Per model: requests in flight and queued, the capacity and the live replicas as the
        engine feed saw them, each with its node and load."""
        p = self.pipeline
        return {name: {"in_flight": a.in_flight, "queued": a.queued(), "capacity": a.capacity,
                       "in_flight_by_tenant": dict(a.tenant_in_flight),
                       "replicas": len(p.feeds[name].replicas),
                       "held_answers": p.feeds[name].held,
                       "per_replica": [
                           {"replica": r.replica, "node": r.node, "active": r.active,
                            "running": r.running, "waiting": r.waiting,
                            "requests_total": r.requests_total,
                            "adapters": list(r.adapters)}
                           for r in p.feeds[name].replicas],
                       "engine_waiting": sum(r.waiting for r in p.feeds[name].replicas),
                       "engine_running": sum(r.running for r in p.feeds[name].replicas),
                       "output_channels": (p.channels[name].open_channels()
                                           if name in p.channels else 0),
                       "transport": "grpc" if uses_grpc(p.streams[name]) else "actor call"}
                for name, a in p.admission.items()}
