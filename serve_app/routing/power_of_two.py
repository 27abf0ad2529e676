"""The ``power_of_two`` routing policy: Serve's own choice for every request (two random
candidates, the shorter queue wins). Keys are not computed: it costs the request nothing."""

from __future__ import annotations

from serve_app.engine.protocol import GenerationRequest
from serve_app.routing.policy import Candidate, Choice


class PowerOfTwo:
    """Spreads every request by Serve's power-of-two choice (the default policy)."""

    name = "power_of_two"

    def key(self, request: GenerationRequest | None) -> bytes | None:
        return None

    def needs_load(self) -> bool:
        return False

    def routed(self, replica_id: str) -> None:
        pass

    def choose(self, key: object | None, candidates: list[Candidate]) -> Choice:
        return Choice("power_of_two")
