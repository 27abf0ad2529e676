"""The model cards of ``GET /v1/models``: each served model with its ``max_model_len``, which
only an engine replica knows.

The length is asked of every model at once (not one after another), each ask bounded, and kept
once known. A model that cannot answer (still loading, scaled to zero, failing) keeps its card
without the length, and is not asked again for ``FAILURE_TTL_S``: one model still loading
must not slow the listing of the others, nor every listing after it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 5.0
FAILURE_TTL_S = 10.0


class ModelCards:
    """Cards of the models behind ``handles``; single-threaded (the router's event loop)."""

    def __init__(self, handles: dict[str, DeploymentHandle], created: int | None = None,
                 ask_timeout_s: float = ASK_TIMEOUT_S, failure_ttl_s: float = FAILURE_TTL_S
                 ) -> None:
        self.handles = handles
        self.created = int(time.time()) if created is None else created
        self.ask_timeout_s = ask_timeout_s
        self.failure_ttl_s = failure_ttl_s
        self._max_model_len: dict[str, int] = {}
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

    async def _ask(self, name: str) -> None:
        """Learn ``name``'s length unless known or failed recently; concurrent listings share
        one ask."""
        if name in self._max_model_len:
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
            info = await asyncio.wait_for(self.handles[name].model_info.remote(),
                                          self.ask_timeout_s)
            self._max_model_len[name] = int(info["max_model_len"])
            self._failed_at.pop(name, None)
        except Exception:  # a model still starting keeps its card without the length
            self._failed_at[name] = time.monotonic()
            logger.warning("model_info of %s unavailable", name, exc_info=True)
