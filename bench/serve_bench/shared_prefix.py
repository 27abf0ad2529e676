"""The shared-prefix workload of ``serve-app bench`` (pure and seeded; unit-tested).

What multi-tenant traffic looks like to a prefix cache: N groups (a tenant's system prompt,
few-shot block, RAG context), each with its own prefix of P tokens; every request is its
group's prefix followed by a unique suffix of S tokens, and asks for O output tokens.

* Groups belong to tenants round-robin (group g to tenant g mod T), and a request picks its
  tenant by share, then one of that tenant's groups uniformly: ``--tenant hot:KEY:0.7`` makes
  one tenant send 70% of the load over its own groups.
* With ``turns`` > 1 a request is a turn of a session (one group): turn k's prompt is the
  prefix, the earlier turns' user suffixes each followed by an O-token stand-in for the
  assistant's answer, then the new suffix, so a session's history grows by S + O tokens a
  turn. The plan goes round by round (every session's turn 1, then every turn 2, ...), so a
  session's next turn is usually sent after its last one finished.
* ``shuffle_span`` > 1 shuffles each pass over the sessions within spans of that many places
  (a session keeps its span, so its next turn still comes at least ``sessions - shuffle_span
  + 1`` requests after its last: keep that above the concurrency). Without it every pass has
  the same order: at a concurrency that divides the sessions evenly, requests finishing about
  in the order they started hand each session's next turn the place its last turn had, and
  power of two choices alternating over two replicas keeps every session on one replica by
  accident. Independent users' sessions have no such lockstep (bench/RESULTS.md 38c).
* ``sessions`` (default: one per group) is how many sessions a round holds: many
  conversations over a few system prompts (``--sessions 64 --prefix-groups 8``). ``skew`` > 0
  makes a tenant's groups unequally popular: group rank r (0 first) is drawn with weight
  1 / (r + 1) ** skew (Zipf; 0: uniform, as before).
* :func:`warmup_requests` is one request per group: the prefixes are cached somewhere before
  the measured run, as in the issue's ceiling measurement.
* :func:`cached_ceiling` is the share of the run's prompt tokens that a perfect router could
  find cached: each request's longest prefix, in whole cache blocks, that an earlier request of
  its tenant (the warm-up included) already sent, with an unbounded cache.

Prompts are token ids (as the rest of the bench), so their lengths are exact.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from serve_bench.workload import PlannedRequest, Tenant, gamma_offsets


@dataclass(frozen=True)
class SharedPrefix:
    """The workload's shape: ``groups`` prefixes of ``prefix_len`` tokens, suffixes of
    ``suffix_len`` tokens, ``output_len`` output tokens, ``turns`` turns per session (1: every
    request is a fresh suffix on its group's prefix)."""

    groups: int
    prefix_len: int
    suffix_len: int
    output_len: int
    turns: int = 1
    sessions: int = 0  # sessions per round; 0: one per group
    skew: float = 0.0  # Zipf exponent of the groups' popularity within a tenant
    shuffle_span: int = 0  # each later pass shuffled within spans of this many sessions; 0: off

    def __post_init__(self) -> None:
        if self.groups < 1 or self.prefix_len < 1 or self.suffix_len < 1 or self.turns < 1:
            raise ValueError("shared prefix: groups, prefix length, suffix length and turns "
                             "must be at least 1")
        if self.sessions < 0 or self.skew < 0 or self.shuffle_span < 0:
            raise ValueError("shared prefix: sessions, skew and shuffle span must be at least 0")
        if self.shuffle_span > (self.sessions or self.groups):
            raise ValueError("shared prefix: the shuffle span is larger than a round's sessions")
        if self.output_len < 1:
            raise ValueError("shared prefix: output length must be at least 1")


def group_prefix(group: int, length: int, vocab: tuple[int, int], seed: int) -> list[int]:
    """Group ``group``'s prefix: the same ids for the same (group, seed) in every run, and
    different groups differ from their first token (a key on the leading blocks tells them
    apart)."""
    rng = random.Random(f"prefix-{seed}-{group}")
    return [rng.randrange(*vocab) for _ in range(length)]


def tenant_groups(shape: SharedPrefix, tenants: list[Tenant]) -> dict[str, list[int]]:
    """Tenant name -> its groups (round-robin). Every tenant needs at least one group."""
    if shape.groups < len(tenants):
        raise ValueError(f"shared prefix: {shape.groups} groups for {len(tenants)} tenants; "
                         "give every tenant at least one group (raise --prefix-groups)")
    owned: dict[str, list[int]] = {t.name: [] for t in tenants}
    for g in range(shape.groups):
        owned[tenants[g % len(tenants)].name].append(g)
    return owned


def iter_shared_prefix(n: int | None, shape: SharedPrefix, tenants: list[Tenant],
                       vocab: tuple[int, int], seed: int = 0, rate: float | None = None,
                       burstiness: float = 1.0) -> Iterator[PlannedRequest]:
    """``n`` requests of the workload (None: without end), drawn as they are needed."""
    rng = random.Random(f"shared-{seed}")
    order_rng = random.Random(f"order-{seed}")  # its own: no other draw's sequence moves
    arrivals = gamma_offsets(rate, burstiness, random.Random(f"{seed}-arrivals")) if rate else None
    owned = tenant_groups(shape, tenants)
    prefixes = {g: group_prefix(g, shape.prefix_len, vocab, seed) for g in range(shape.groups)}
    weights = [t.share for t in tenants]
    popularity = {name: [1.0 / (r + 1) ** shape.skew for r in range(len(groups))]
                  for name, groups in owned.items()}

    def draw() -> list[int]:
        return [rng.randrange(*vocab) for _ in range(shape.suffix_len)]

    def answer() -> list[int]:  # stands for the assistant's answer in a session's history
        return [rng.randrange(*vocab) for _ in range(shape.output_len)]

    index = itertools.count()
    while True:
        # One round: a session per draw of (tenant, group); turns > 1 repeat the sessions.
        sessions = []
        for _ in range(shape.sessions or shape.groups):
            tenant = rng.choices(tenants, weights)[0]
            group = (rng.choice(owned[tenant.name]) if not shape.skew else
                     rng.choices(owned[tenant.name], popularity[tenant.name])[0])
            sessions.append((tenant, group, []))
        for turn in range(shape.turns):
            if turn and shape.shuffle_span > 1:
                sessions = shuffled_in_spans(sessions, shape.shuffle_span, order_rng)
            for tenant, group, history in sessions:
                i = next(index)
                if n is not None and i >= n:
                    return
                user = draw()
                prompt = prefixes[group] + history + user
                history.extend(user + answer())
                yield PlannedRequest(i, prompt, shape.output_len, tenant,
                                     next(arrivals) if arrivals is not None else None)


def shuffled_in_spans(items: list, span: int, rng: random.Random) -> list:
    """``items`` shuffled within consecutive spans of ``span`` places (the last may be
    shorter): an item moves at most ``span - 1`` places."""
    out: list = []
    for start in range(0, len(items), span):
        part = items[start:start + span]
        rng.shuffle(part)
        out.extend(part)
    return out


def shared_prefix_plan(n: int, shape: SharedPrefix, tenants: list[Tenant],
                       vocab: tuple[int, int], seed: int = 0) -> list[PlannedRequest]:
    """The first ``n`` requests of :func:`iter_shared_prefix`, as a list."""
    return list(iter_shared_prefix(n, shape, tenants, vocab, seed))


def warmup_requests(shape: SharedPrefix, tenants: list[Tenant], vocab: tuple[int, int],
                    seed: int = 0) -> list[PlannedRequest]:
    """One request per group (its prefix and a suffix of its own), as its tenant."""
    rng = random.Random(f"warmup-{seed}")
    owner = {g: t for t in tenants for g in tenant_groups(shape, tenants)[t.name]}
    return [PlannedRequest(g, group_prefix(g, shape.prefix_len, vocab, seed)
                           + [rng.randrange(*vocab) for _ in range(shape.suffix_len)],
                           shape.output_len, owner[g], None)
            for g in range(shape.groups)]


def cached_ceiling(requests: Iterable[PlannedRequest], block_tokens: int = 16,
                   seen_before: Iterable[PlannedRequest] = ()) -> float:
    """The share of ``requests``' prompt tokens a perfect router could find cached (module
    docstring): per request, the whole blocks of ``block_tokens`` (vLLM's block size on GPU)
    from its first that an earlier request of its tenant, or one of ``seen_before`` (the
    warm-up), already sent. 0 for no prompt tokens."""
    seen: set[int] = set()

    def blocks(req: PlannedRequest) -> list[int]:
        """Chained keys (this process's tuple hash: a collision is one block miscounted)."""
        ids, out, key = req.prompt_token_ids, [], hash(req.tenant.name)
        for i in range(len(ids) // block_tokens):
            key = hash((key, tuple(ids[i * block_tokens:(i + 1) * block_tokens])))
            out.append(key)
        return out

    for req in seen_before:
        seen.update(blocks(req))
    found = total = 0
    for req in requests:
        keys = blocks(req)
        total += len(req.prompt_token_ids)
        hit = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        found += hit * block_tokens
        seen.update(keys)
    return found / total if total else 0.0
