"""The model cards of ``GET /v1/models``: each served model's name and ``max_model_len``.

A listing must never wake a model scaled to zero: a call through Serve's handle at zero
replicas queues in the handle, and Serve counts it as demand (a client listing models every
10 s kept every GPU model warm). So a card comes from what the router already knows:

* the config: the served name, and ``max_model_len`` where the config sets it (the engine is
  started with exactly that length, so no engine is asked);
* else the last length an engine answered (kept once known);
* else an engine is asked, only while the model's engine feed
  (:class:`~serve_app.admission.feed.EngineFeed`) sees a live replica or has not polled yet,
  and only by broadcast (:func:`~serve_app.serve_private.broadcast_each`), which reaches the
  running replicas and never queues: at zero it fails at once, and the card goes out without
  the length.

Unknown lengths are asked of every model at once, each ask bounded. A model that cannot answer
(still loading, failing) keeps its card without the length and is not asked again for
``FAILURE_TTL_S``: one model still loading must not slow the listing of the others, nor every
listing after it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Mapping, Protocol

from ray.serve.handle import DeploymentHandle

from serve_app.serve_private import broadcast_each

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 5.0
FAILURE_TTL_S = 10.0


class Feed(Protocol):
    """What the cards read of a model's engine feed (:class:`EngineFeed`)."""

    handle: DeploymentHandle
    replicas: list[Any]  # the live replicas of the last poll; [] at zero
    polled_at: float  # 0.0 until the first poll


class ModelCards:
    """Cards of the models behind ``feeds``; ``lengths`` maps a model to the ``max_model_len``
    its config sets (None: the engine's own, learnt from it). Single-threaded (the router's
    event loop)."""

    def __init__(self, feeds: Mapping[str, Feed], lengths: Mapping[str, int | None] | None = None,
                 created: int | None = None, ask_timeout_s: float = ASK_TIMEOUT_S,
                 failure_ttl_s: float = FAILURE_TTL_S) -> None:
        self.feeds = feeds
        self.created = int(time.time()) if created is None else created
        self.ask_timeout_s = ask_timeout_s
        self.failure_ttl_s = failure_ttl_s
        self._max_model_len: dict[str, int] = {
            n: int(length) for n, length in (lengths or {}).items() if length is not None}
        self._failed_at: dict[str, float] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}

    async def cards(self, names: list[str]) -> list[dict[str, Any]]:
        """The cards of ``names``, in that order, asking the unknown lengths concurrently."""
        await asyncio.gather(*(self._ask(n) for n in names))
        return [self._card(n) for n in names]

    async def card(self, name: str) -> dict[str, Any]:
        return (await self.cards([name]))[0]

    def _card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": self.created,
                                "owned_by": "serve-app", "root": name}
        if name in self._max_model_len:
            card["max_model_len"] = self._max_model_len[name]
        return card

    def _may_ask(self, name: str) -> bool:
        """Whether ``name``'s engines may be asked now: a live replica in the feed's view, or
        no view yet (a router that served no request; the broadcast then finds out)."""
        feed = self.feeds.get(name)
        return feed is not None and (bool(feed.replicas) or not feed.polled_at)

    async def _ask(self, name: str) -> None:
        """Learn ``name``'s length unless known, failed recently or at zero; concurrent
        listings share one ask."""
        if name in self._max_model_len or not self._may_ask(name):
            return
        failed = self._failed_at.get(name)
        if failed is not None and time.monotonic() - failed < self.failure_ttl_s:
            return
        task = self._asking.get(name)
        if task is None:
            task = self._asking[name] = asyncio.ensure_future(self._fetch(name))
            task.add_done_callback(lambda _: self._asking.pop(name, None))
        await asyncio.shield(task)

    async def _fetch(self, name: str) -> None:
        try:
            answers = await broadcast_each(self.feeds[name].handle, "model_info",
                                           timeout_s=self.ask_timeout_s)
            infos = [a for a in answers if isinstance(a, dict) and "max_model_len" in a]
            if not infos:
                raise RuntimeError(f"no replica answered: {answers!r}")
            self._max_model_len[name] = int(infos[0]["max_model_len"])
            self._failed_at.pop(name, None)
        except Exception as err:  # at zero, loading, failing: the card goes without the length
            self._failed_at[name] = time.monotonic()
            logger.info("model_info of %s unavailable: %r", name, err)
