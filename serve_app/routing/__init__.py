"""Which engine replica gets a request: the LLMServer deployment's request router
(:mod:`serve_app.routing.pinned`) and its replica-choice policies, named in a model's
``routing:`` config (docs/routing.md).

The policy registry is here, at the package's face: :data:`POLICIES` names each policy's class
and :func:`build_policy` makes one from a model's settings. The policies import only the
interface (:mod:`serve_app.routing.policy`) and their own helpers, never this registry.
"""

from __future__ import annotations

from typing import Any

from serve_app.config.routing import RoutingSettings
from serve_app.routing.adapter_placement import AdapterPlacement
from serve_app.routing.policy import RoutingPolicy
from serve_app.routing.power_of_two import PowerOfTwo
from serve_app.routing.prefix_affinity import PrefixAffinity
from serve_app.routing.prefix_blocks import BlockHasher
from serve_app.routing.prefix_cache import PrefixCache
from serve_app.routing.prefix_index import index_for
from serve_app.routing.prefix_key import PrefixKeyer

POLICIES: tuple[str, ...] = (PowerOfTwo.name, PrefixAffinity.name, PrefixCache.name)


def build_policy(name: str, model: str = "", **knobs: Any) -> RoutingPolicy:
    """The policy called ``name`` with its knobs, for ``model`` (whose index ``prefix_cache``
    reads: :func:`serve_app.routing.prefix_index.index_for`); a knob not given takes its
    default from :class:`RoutingSettings`, which also says what each one means (one place for
    them). Raises ValueError, naming the known policies, for an unknown name."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; use one of: {', '.join(POLICIES)}")
    k = RoutingSettings(policy=name, **knobs)  # type: ignore[arg-type]  # checked above
    inner: RoutingPolicy
    if name == PowerOfTwo.name:
        inner = PowerOfTwo()
    elif name == PrefixAffinity.name:
        inner = PrefixAffinity(PrefixKeyer(block_tokens=k.block_tokens,
                                           prefix_blocks=k.prefix_blocks,
                                           chars_per_token=k.chars_per_token),
                               imbalance_margin=k.imbalance_margin, load_factor=k.load_factor)
    else:
        inner = PrefixCache(BlockHasher(block_tokens=k.block_tokens,
                                        chars_per_token=k.chars_per_token,
                                        max_blocks=k.max_blocks),
                            lambda: index_for(model), imbalance_margin=k.imbalance_margin,
                            load_factor=k.load_factor, request_cost_tokens=k.request_cost_tokens)
    if k.adapter_replicas == 0:  # adapters routed like the base model's requests
        return inner
    # A LoRA adapter's requests follow where the replicas report it loaded, whatever routes
    # the base model's requests.
    return AdapterPlacement(inner, lambda: index_for(model), adapter_replicas=k.adapter_replicas,
                            imbalance_margin=k.imbalance_margin, load_factor=k.load_factor)


__all__ = ["POLICIES", "build_policy"]
