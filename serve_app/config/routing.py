"""A model's ``routing:`` section: how the routers choose the engine replica of each request
(:mod:`serve_app.routing`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from serve_app.config.base import _Strict


class RoutingSettings(_Strict):
    """Replica choice for one model's requests (docs/routing.md).

    ``prefix_cache`` (the default) sends a request to the replica holding the longest cached
    prefix of its prompt (an index of what each replica served, the same on every router),
    weighed against load within a bound: it follows multi-turn conversations
    (:mod:`serve_app.routing.prefix_cache`). ``power_of_two`` is Ray Serve's own choice for
    every request that names no LoRA adapter: two random replicas, the one with fewer requests
    wins. ``prefix_affinity`` sends requests that share a tenant and their leading prompt
    blocks to one replica, within the same bound. Whatever the policy, a LoRA adapter's
    requests go to the replicas that hold it (``adapter_replicas``).

    The default follows the measurements (bench/RESULTS.md 38d, two replicas on one H100):
    against power of two, ``prefix_cache`` gave 1.03x and 1.01x the output on multi-turn chat
    (TTFT p50 0.75x, 0.89x), 1.04x on history-heavy sessions (TTFT 0.61x), 1.11x with one hot
    tenant, 0.98x on random prompts (nothing to find). ``prefix_affinity`` lost on chat
    (0.91-0.92x, issue 38); on single-shot prompts sharing long prefixes it gave TTFT p50 0.31x
    and 1.28x output (31b).
    """

    policy: Literal["power_of_two", "prefix_affinity", "prefix_cache"] = Field(
        "prefix_cache", description="`prefix_cache` (default): the replica holding the "
        "longest cached prefix of the prompt (an index of the block hashes each replica "
        "served, carried to every router on the engine feed), weighed against load, within a "
        "load bound; follows conversations; against power_of_two 1.01-1.04x output and TTFT "
        "p50 0.53-0.91x where prompts share prefixes, 0.98x on random prompts. "
        "`power_of_two`: Serve's choice for every request that names no adapter, keys unused; "
        "it costs a request nothing: for traffic that shares no prefix. "
        "`prefix_affinity`: rendezvous hashing "
        "of (tenant cache salt, leading prompt blocks) over the replicas, within the same "
        "bound; every router computes the same choice with no shared state; for single-shot "
        "prompts that share a long leading prefix (system prompt, few-shot block).")
    block_tokens: int = Field(
        64, ge=1, description="prefix_affinity and prefix_cache: tokens per key block. A "
        "prompt shorter than one block (and, for prefix_cache, without a session key) has no "
        "key and is spread by power of two (reason `cold`).")
    prefix_blocks: int = Field(
        4, ge=1, description="prefix_affinity: leading blocks that make the key (default 4 x "
        "64 = 256 tokens). Keep block_tokens x prefix_blocks at or under the prefix your "
        "tenants' requests share (system prompt, few-shot block): a key that reaches into the "
        "unique part of each prompt spreads requests like random choice.")
    chars_per_token: int = Field(
        4, ge=1, description="prefix_affinity and prefix_cache: characters counted as one "
        "token when a text "
        "prompt or chat messages are cut into blocks (the router has no tokenizer; only "
        "requests of equal leading text must agree).")
    imbalance_margin: int = Field(
        4, ge=0, description="prefix_affinity and prefix_cache: requests a replica may "
        "always hold above the least-loaded candidate and still take the key's requests "
        "(prefix_affinity counts Serve's queue lengths, prefix_cache the engine feed's); "
        "decides at small loads (see load_factor for large ones). Past both bounds the "
        "request goes to the first replica of the key's order within them (reason "
        "`load_fallback`).")
    load_factor: float = Field(
        1.25, ge=1.0, description="prefix_affinity and prefix_cache: a replica may take the "
        "key's request while, "
        "with it, it holds at most this many times the mean load of the replicas (consistent "
        "hashing with bounded loads; HAProxy's hash-balance-factor 125). Lower spreads a hot "
        "tenant sooner; higher keeps more prefixes on one replica, cached once.")

    max_blocks: int = Field(
        256, ge=1, description="prefix_cache: leading blocks of a prompt that are hashed and "
        "indexed (256 x 64 = 16,384 tokens); the router's work per request is bounded by it "
        "whatever the body's size (about 1 us a block, bench/RESULTS.md 38a). Matches longer "
        "than this count as this long: conversations that share more than that are spread by "
        "load.")
    request_cost_tokens: int = Field(
        64, ge=0, description="prefix_cache: prefill tokens that one request more on a replica "
        "(the requests it serves, as the engine feed reports them) is worth: a replica's score "
        "is its cached prefix minus this times its load above the least-loaded candidate's. "
        "Higher spreads by load sooner; 0 follows the longest prefix up to the load bound. On "
        "multi-turn chat 16 and 256 did no better than 64 (bench/RESULTS.md 38e).")
    adapter_replicas: int = Field(
        2, ge=0, description="Every policy: the most replicas one LoRA adapter's requests go "
        "to (serve_app/routing/adapter_placement.py). An adapter's requests go to a replica "
        "that reports it loaded while that one is within the load bound (load_factor, "
        "imbalance_margin); past it, a further replica takes them (and loads it) until this "
        "many hold it; then they wait on the least-loaded of those. 2 (default): a hot "
        "adapter's overflow still has a second replica, while on a larger fleet it takes no "
        "more than two replicas' adapter slots (each swap costs a load). 0: no placement, an "
        "adapter's requests are routed like the base model's by the policy. A router knob, "
        "not an engine argument: changing it restarts no engine.")

    def router_kwargs(self, model: str) -> dict[str, Any]:
        """The request router's ``initialize_state`` arguments (Serve's
        ``request_router_kwargs``, JSON only)."""
        return {"model": model, **self.model_dump(mode="json")}
