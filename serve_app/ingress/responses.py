"""Turn engine chunks into OpenAI JSON bodies and SSE events.

This runs once per engine chunk per request, so the streaming path formats events from
pre-encoded prefixes instead of building and serialising nested dicts for every token.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from serve_app.engine.protocol import GenerationChunk

DONE_EVENT = b"data: [DONE]\n\n"

Kind = Literal["completion", "chat"]


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


class ResponseBuilder:
    """Accumulates one request's chunks; emits SSE events or the final JSON body.

    Contract: feed every chunk in order to :meth:`events` (streaming) or :meth:`add`
    (non-streaming); then call :meth:`final_events` or :meth:`body` once.
    """

    def __init__(self, kind: Kind, request_id: str, model: str, n: int) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.choices = [_Choice() for _ in range(n)]
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        head = json.dumps({"id": request_id, "object": obj, "created": self.created,
                           "model": model})[:-1]
        # Everything before the choice's index, pre-encoded once per request.
        self._prefix = f'data: {head}, "choices": [{{"index": '

    # -- accumulation ---------------------------------------------------------------------------
    def add(self, chunk: GenerationChunk) -> None:
        self.prompt_tokens = chunk.prompt_tokens
        for d in chunk.deltas:
            c = self.choices[d.index]
            if d.text:
                c.text.append(d.text)
            c.tokens += d.num_tokens
            if d.finish_reason is not None:
                c.finish_reason = d.finish_reason
                c.stop_reason = d.stop_reason

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def usage(self) -> dict[str, int]:
        completion = self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    # -- streaming ------------------------------------------------------------------------------
    def events(self, chunk: GenerationChunk) -> bytes:
        """SSE events for ``chunk`` (one per choice with news), after accounting for it."""
        self.add(chunk)
        out: list[str] = []
        for d in chunk.deltas:
            if not d.text and d.finish_reason is None:
                continue
            finish = "null" if d.finish_reason is None else json.dumps(d.finish_reason)
            if self.kind == "completion":
                out.append(f'{self._prefix}{d.index}, "text": {json.dumps(d.text)}, '
                           f'"logprobs": null, "finish_reason": {finish}}}]}}\n\n')
                continue
            c = self.choices[d.index]
            if not c.started:
                c.started = True
                out.append(f'{self._prefix}{d.index}, "delta": {{"role": "assistant", '
                           f'"content": ""}}, "logprobs": null, "finish_reason": null}}]}}\n\n')
            delta = f'{{"content": {json.dumps(d.text)}}}' if d.text else "{}"
            out.append(f'{self._prefix}{d.index}, "delta": {delta}, "logprobs": null, '
                       f'"finish_reason": {finish}}}]}}\n\n')
        return "".join(out).encode()

    def final_events(self, include_usage: bool) -> bytes:
        """The closing events: the usage chunk when asked for, then ``[DONE]``."""
        if not include_usage:
            return DONE_EVENT
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        usage = {"id": self.request_id, "object": obj, "created": self.created,
                 "model": self.model, "choices": [], "usage": self.usage()}
        return b"data: " + json.dumps(usage).encode() + b"\n\n" + DONE_EVENT

    # -- non-streaming --------------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.kind == "completion":
                choices.append({"index": i, "text": text, "logprobs": None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            else:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return {
            "id": self.request_id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
