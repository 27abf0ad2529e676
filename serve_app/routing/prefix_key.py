"""The affinity key of a request: its tenant's cache salt and its prompt's leading blocks.

The key must be computable where Serve routes (the router replica, before the engine has seen
the request) and equal on every router replica. What the request carries then
(:class:`~serve_app.engine.protocol.GenerationRequest`): token ids for a token-id prompt, the
text of a text prompt, or the chat messages, which the engine side renders with the model's
chat template. The router holds no tokenizer, so:

* token ids are cut into blocks of ``block_tokens`` ids;
* text is cut into blocks of ``block_tokens * chars_per_token`` characters (an estimate of
  the same length; it only has to be the same for two requests that share a prefix);
* chat messages are first written as one text, role and content of each message in order
  (never the request's JSON, whose field order and escapes are the client's): a chat template
  renders the leading messages the same way whatever follows them, so two conversations whose
  first messages agree agree on the leading characters of this text, as they do on the
  leading tokens of the rendered prompt.

A request for a LoRA adapter (``request.adapter``) is keyed by the adapter alone, whatever
its tenant and prompt: every router sends an adapter's requests to the same replica (the
first of its rendezvous order within the load bound), where the adapter is loaded and its
prompts' prefixes cached, instead of loading it on every replica (each one's ``max_loras``
slots, swapped least recently used out); overflow spills to the next replica of the same
order. The engine's prefix cache stays per tenant (the request's cache salt), as it is.

The key covers the first ``prefix_blocks`` whole blocks, or as many whole blocks as the prompt
has when it is shorter; a prompt under one block has no key (nothing worth keeping together:
the request is spread by load). Two requests have the same key only with the same cache salt,
as vLLM shares cached blocks only within a salt: keys of different tenants never collide by
construction (a collision of the 128-bit digest aside).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from serve_app.engine.protocol import GenerationRequest

_TEXT, _TOKENS, _CHAT, _ADAPTER = b"t", b"i", b"c", b"a"


@dataclass(frozen=True, slots=True)
class PrefixKeyer:
    """Computes affinity keys (see the module docstring). All three knobs are >= 1."""

    block_tokens: int = 64
    prefix_blocks: int = 4
    chars_per_token: int = 4

    def __post_init__(self) -> None:
        for name in ("block_tokens", "prefix_blocks", "chars_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    @property
    def block_chars(self) -> int:
        """Characters of a text block."""
        return self.block_tokens * self.chars_per_token

    def key(self, request: GenerationRequest | None) -> bytes | None:
        """The key of ``request``, or None (no request, or a prompt shorter than one block
        and no adapter)."""
        if request is None:
            return None
        if request.adapter is not None:  # the adapter's replicas (the module docstring)
            return adapter_key(request.adapter[0])
        salt = (request.cache_salt or "").encode()
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            n = min(self.prefix_blocks, len(ids) // self.block_tokens) * self.block_tokens
            return _digest(salt, _TOKENS, struct.pack(f"<{n}q", *ids[:n])) if n else None
        if request.messages is not None:
            return self._text_key(salt, _CHAT, chat_text(request.messages))
        if request.prompt is not None:
            return self._text_key(salt, _TEXT, request.prompt)
        return None

    def _text_key(self, salt: bytes, kind: bytes, text: str) -> bytes | None:
        n = min(self.prefix_blocks, len(text) // self.block_chars) * self.block_chars
        return _digest(salt, kind, text[:n].encode()) if n else None


def adapter_key(name: str) -> bytes:
    """The key of every request for adapter ``name``, whatever its tenant and prompt."""
    return _digest(b"", _ADAPTER, name.encode())


def chat_text(messages: list[dict[str, str]]) -> str:
    """The messages as one text, in order: what a chat template's rendering of them begins
    with, up to the template's own markers (which are the same for every request of a model)."""
    return "".join(f"<|{m.get('role', '')}|>\n{m.get('content', '')}\n" for m in messages)


def _digest(salt: bytes, kind: bytes, payload: bytes) -> bytes:
    # The salt's length first: ("ab", "c...") and ("a", "bc...") must not hash alike.
    h = hashlib.blake2b(digest_size=16)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(kind)
    h.update(payload)
    return h.digest()
