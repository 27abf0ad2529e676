"""LLMServer: the Ray Serve deployment that owns one engine per replica.

The engine class is injected (an import path), so tests can run the whole deployment with a
stand-in engine while production uses :class:`serve_app.engine.vllm_adapter.VLLMEngine`.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, AsyncIterator

from serve_app.config import ModelSettings
from serve_app.engine.protocol import Engine, GenerationChunk, GenerationRequest

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_CLASS = "serve_app.engine.vllm_adapter:VLLMEngine"


def import_engine_class(path: str) -> type:
    """Resolve ``"module:Class"`` into the class."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class LLMServer:
    """One replica: loads the engine at construction and streams its output.

    Methods are called by Ray Serve through deployment handles: ``generate`` by the router for
    every request (streaming), ``check_health`` by the Serve controller every few seconds.
    """

    async def __init__(self, settings: dict[str, Any], engine_class: str = DEFAULT_ENGINE_CLASS
                       ) -> None:
        self.settings = ModelSettings.model_validate(settings)
        self.engine: Engine = import_engine_class(engine_class)(self.settings)
        await self.engine.start()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the engine's chunks for ``request``; cancellation aborts the engine's work."""
        async for chunk in self.engine.generate(request):
            yield chunk

    async def model_info(self) -> dict[str, Any]:
        """Facts the router needs about the served model."""
        return {"name": self.settings.name, "max_model_len": self.engine.max_model_len}

    async def engine_load(self) -> dict[str, int]:
        """Running and waiting requests in the engine, plus those the front end still tracks."""
        load = self.engine.load()
        unfinished = getattr(self.engine, "unfinished_requests", None)
        return {
            "running": load.running,
            "waiting": load.waiting,
            "unfinished": unfinished() if unfinished else load.running + load.waiting,
        }

    async def check_health(self) -> None:
        """Raise when the engine is dead; a busy engine is healthy (no request is issued)."""
        await self.engine.check_health()

    async def __del__(self) -> None:
        # The constructor may have failed before the engine existed.
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.shutdown()
