"""The ``power_of_two`` routing policy: Serve's own choice (two random candidates,
the shorter queue wins) for every request it is asked about. Keys are not computed: it costs
the request nothing. A LoRA adapter's requests are placed before it is asked
(:mod:`serve_app.routing.adapter_placement` wraps every policy unless
``routing.adapter_replicas`` is 0)."""

from __future__ import annotations

from serve_app.engine.protocol import GenerationRequest
from serve_app.routing.policy import Candidate, Choice


class PowerOfTwo:
    """Leaves every request it is asked about to Serve's power-of-two choice."""

    name = "power_of_two"

    def key(self, request: GenerationRequest | None) -> bytes | None:
        return None

    def needs_load(self, key: object) -> bool:
        return False

    def routed(self, replica_id: str) -> None:
        pass

    def choose(self, key: object | None, candidates: list[Candidate]) -> Choice:
        return Choice("power_of_two")
