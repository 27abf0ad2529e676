"""Chained block hashes of a request's prompt: what the ``prefix_cache`` policy matches against
the replicas' prefix caches.

A prompt is cut into blocks as the router can see them without a tokenizer (the same cut as
:mod:`serve_app.routing.prefix_key`): ``block_tokens`` ids of a token-id prompt, or
``block_tokens * chars_per_token`` characters of a text prompt or of the chat messages written
as one text (role and content in order: a chat template renders a conversation's leading
messages the same whatever follows, so turn k+1's text begins with turn k's). Block i's hash
covers the tenant's cache salt and blocks 0..i (each hash is chained on its parent's), as vLLM's
block hashes do (a LoRA adapter's name joins the salt: vLLM's hashes cover the adapter too):
two prompts share block i's hash only when they share the salt and everything
up to the end of block i, so the longest run of a prompt's hashes that a replica holds is the
prefix it has cached (in the router's cut; a block of the engine's is a few tokens off at the
edges, which only shortens a match by a block).

Bounded work: hashing stops after ``max_blocks`` blocks, whatever the body's size, and reads
only the characters of those blocks (chat messages are not joined into one text; a message is
sliced as far as the blocks reach). A prompt shorter than one block has no hashes.

Explicit sessions: a request naming a session (:attr:`GenerationRequest.session`, OpenAI's
``prompt_cache_key`` or else ``user``) gets one more hash, of (salt, session key), scoped by
tenant like the blocks; it is not a block (it never extends a match of the prompt's blocks),
and the replica that serves the request records it beside them.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterator

from serve_app.engine.protocol import GenerationRequest

_TEXT, _TOKENS, _CHAT, _SESSION = b"t", b"i", b"c", b"s"


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A request's hashes: ``blocks`` (chained, first block first, at most ``max_blocks``),
    ``session`` (the hash of its tenant-scoped session key, or None)."""

    blocks: tuple[int, ...]
    session: int | None


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Cuts and hashes prompts (see the module docstring). Every knob is >= 1."""

    block_tokens: int = 64
    chars_per_token: int = 4
    max_blocks: int = 256

    def __post_init__(self) -> None:
        for name in ("block_tokens", "chars_per_token", "max_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    @property
    def block_chars(self) -> int:
        """Characters of a text block."""
        return self.block_tokens * self.chars_per_token

    def of(self, request: GenerationRequest) -> PromptBlocks:
        """The hashes of ``request`` (pure; costs at most ``max_blocks`` block hashes)."""
        salt = (request.cache_salt or "").encode()
        if request.adapter is not None:  # vLLM's block hashes include the adapter too
            salt += b"\0lora:" + request.adapter[0].encode()
        root = _root(salt)
        if request.prompt_token_ids is not None:
            blocks = _chain(root, _TOKENS, self._token_blocks(request.prompt_token_ids))
        elif request.messages is not None:
            blocks = _chain(root, _CHAT, self._text_blocks(_chat_pieces(request.messages)))
        elif request.prompt is not None:
            blocks = _chain(root, _TEXT, self._text_blocks(iter((request.prompt,))))
        else:
            blocks = ()
        session = None
        if request.session:
            h = hashlib.blake2b(root, digest_size=8)
            h.update(_SESSION)
            h.update(request.session.encode())
            session = int.from_bytes(h.digest(), "big")
        return PromptBlocks(blocks, session)

    def _token_blocks(self, ids: list[int]) -> Iterator[bytes]:
        n, size = min(self.max_blocks, len(ids) // self.block_tokens), self.block_tokens
        fmt = f"<{size}q"
        for i in range(n):
            yield struct.pack(fmt, *ids[i * size:(i + 1) * size])

    def _text_blocks(self, pieces: Iterator[str]) -> Iterator[bytes]:
        """Whole blocks of ``block_chars`` characters of the pieces taken as one text, at most
        ``max_blocks``; a piece is sliced, never copied whole."""
        size, left = self.block_chars, self.max_blocks
        carry = ""
        for piece in pieces:
            start = 0
            if carry:
                need = size - len(carry)
                carry += piece[:need]
                start = need
                if len(carry) < size:
                    continue
                yield carry.encode()
                carry = ""
                left -= 1
                if not left:
                    return
            whole = min(left, (len(piece) - start) // size)
            for i in range(whole):
                yield piece[start + i * size:start + (i + 1) * size].encode()
            left -= whole
            if not left:
                return
            carry = piece[start + whole * size:]


def _chat_pieces(messages: list[dict[str, str]]) -> Iterator[str]:
    """The messages' text in order, as :func:`serve_app.routing.prefix_key.chat_text` writes
    it, piece by piece (the content is never copied)."""
    for m in messages:
        yield f"<|{m.get('role', '')}|>\n"
        yield m.get("content", "")
        yield "\n"


def _root(salt: bytes) -> bytes:
    # The salt's length first: ("ab", "c...") and ("a", "bc...") must not hash alike.
    h = hashlib.blake2b(digest_size=8)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    return h.digest()


def _chain(root: bytes, kind: bytes, blocks: Iterator[bytes]) -> tuple[int, ...]:
    out: list[int] = []
    parent = root + kind
    for block in blocks:
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        out.append(int.from_bytes(parent, "big"))
    return tuple(out)
