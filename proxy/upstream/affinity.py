"""Prompt-cache affinity: a conversation goes back to the worker that holds its prefix.

vLLM and SGLang cache prompt prefixes per server, so a conversation that lands on another
worker each turn recomputes its whole history. The request's affinity key is, in order,
`prompt_cache_key` (Codex sends its thread id), `conversation`, else (setting
`hash_messages`, on by default) a hash of the leading system message and the first user
message, which stay the same for every turn of one conversation.

The key is placed on a consistent-hash ring with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads"): each worker has `vnodes` points on
the ring; from the key's point the walk takes the first worker whose in-flight count is under
ceil((1 + epsilon) * average load), the average counting this request (weighted by capacity
when capacities differ). A hot key therefore spills to the next worker on the ring instead of
overloading its owner, and adding or losing a worker moves only the keys it owned.

Affinity only chooses among the workers routing already found eligible (model, provider
requirements, health, ejection, capacity, the `order` tier); the ring is over that set.
Rings are cached by the set's signature (and, for the common request, on the pool's cached
route of the model), so a request costs a bisect and a short walk, never a ring rebuild.
Failover excludes the failed worker and the walk continues on the ring.

Pure, no I/O. proxy.upstream.routing calls `pick`; the forwarder computes `request_key` once per request.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from bisect import bisect_left
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

if TYPE_CHECKING:
    from proxy.config.sections import RoutingAffinity
    from proxy.protocol.upstream_request import UpstreamRequest
    from proxy.upstream.workers import Route, Worker, WorkerPool

RING_CACHE_SIZE = 128  # rings kept per pool (one per eligible-set signature seen recently)


def _h64(data: bytes) -> int:
    """A ring point of a worker's vnode (built once per ring, so the cost does not matter)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def key_point(data: bytes, tag: bytes = b"") -> int:
    """A request key's point on the ring: the CRC-32 of tag + data in the top 32 bits (as
    nginx's consistent `hash` does), stable across processes and a few times cheaper than a
    blake2b per request. Keys land on the workers in the same proportions as with _h64: the
    spread comes from the vnode points. The tag is chained, not concatenated: a long
    prompt is not copied."""
    return zlib.crc32(data, zlib.crc32(tag)) << 32


class AffinityKey(NamedTuple):
    """Where one request sits on the ring, and how the walk is bounded."""

    source: str  # prompt_cache_key | conversation | messages
    point: int
    epsilon: float  # routing.affinity.epsilon
    vnodes: int  # routing.affinity.vnodes


def _leading(messages: list) -> tuple[Any, Any]:
    system = user = None
    if messages and isinstance(messages[0], dict) and messages[0].get("role") in ("system", "developer"):
        system = messages[0].get("content")
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            user = m.get("content")
            break
    return system, user


def request_key(t: UpstreamRequest, settings: RoutingAffinity) -> AffinityKey | None:
    """The request's affinity key (None: affinity off, or nothing to key on). `settings` are
    the app's routing.affinity (config.routing.affinity)."""
    if not settings.enabled:
        return None
    if t.prompt_cache_key:
        source, tag, data = "prompt_cache_key", b"k\x00", t.prompt_cache_key.encode()
    elif t.conversation:
        source, tag, data = "conversation", b"c\x00", t.conversation.encode()
    elif settings.hash_messages:
        system, user = _leading(t.chat.get("messages") or [])
        if system is None and user is None:
            return None
        try:
            data = orjson.dumps([system, user])
        except TypeError:
            return None
        source, tag = "messages", b"m\x00"
    else:
        return None
    return AffinityKey(source, key_point(data, tag), settings.epsilon, settings.vnodes)


# --------------------------------------------------------------------------- the ring


class Ring:
    """`vnodes` points per worker, sorted; a worker's points depend only on its name, so the
    ring of a subset is the full ring with the other workers' points left out."""

    __slots__ = ("workers", "points", "owners")

    def __init__(self, workers: list[Worker], vnodes: int) -> None:
        self.workers = workers  # held: the ids in the cache signature stay valid
        pairs = sorted((_h64(f"{w.name}\x00{i}".encode()), idx) for idx, w in enumerate(workers)
                       for i in range(vnodes))
        self.points = [p for p, _ in pairs]
        self.owners = [idx for _, idx in pairs]

    def walk(self, point: int) -> Iterator[Worker]:
        """Distinct workers in ring order, starting at the key's point."""
        points, owners, workers = self.points, self.owners, self.workers
        n = len(points)
        if not n:
            return
        start = bisect_left(points, point)
        seen: set[int] = set()
        for j in range(n):
            idx = owners[(start + j) % n]
            if idx not in seen:
                seen.add(idx)
                yield workers[idx]
                if len(seen) == len(workers):
                    return

    def owner(self, point: int) -> Worker | None:
        if not self.points:
            return None
        i = bisect_left(self.points, point) % len(self.points)
        return self.workers[self.owners[i]]


class AffinityState:
    """Per pool: the ring cache and the hit / miss counters (read by proxy.runtime.metrics)."""

    def __init__(self) -> None:
        self.rings: OrderedDict[tuple, Ring] = OrderedDict()
        self.ring_builds = 0
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (result, reason) -> count

    def ring(self, workers: list[Worker], vnodes: int) -> Ring:
        signature = (vnodes, *map(id, workers))
        ring = self.rings.get(signature)
        if ring is None:
            ring = Ring(list(workers), vnodes)
            self.ring_builds += 1
            self.rings[signature] = ring
            while len(self.rings) > RING_CACHE_SIZE:
                self.rings.popitem(last=False)
        else:
            self.rings.move_to_end(signature)
        return ring


def state(pool: WorkerPool) -> AffinityState:
    st = pool.affinity_state
    if st is None:
        st = pool.affinity_state = AffinityState()
    return st


def _bounds(workers: list[Worker], epsilon: float) -> dict[int, int]:
    """ceil((1 + epsilon) * average load), this request included, per worker (capacity-weighted)."""
    total = sum(w.in_flight for w in workers) + 1
    capacity = sum(max(w.capacity, 1) for w in workers)
    return {id(w): math.ceil((1 + epsilon) * total * max(w.capacity, 1) / capacity) for w in workers}


_NOTHING: frozenset[int] = frozenset()


def pick(pool: WorkerPool, key: AffinityKey, serving: list[Worker], eligible: list[Worker],
         excluded: set[int] | frozenset[int], need_capacity: bool) -> Worker | None:
    """The first worker on the ring of `eligible` from the key's point that is not excluded,
    has room and is under the load bound; counts a hit when it is the key's primary owner
    (the owner on the ring of every worker serving the model). None: no worker can take it."""
    st = state(pool)
    return _walk(st, key, st.ring(eligible, key.vnodes), st.ring(serving, key.vnodes), eligible, excluded,
                 need_capacity)


def pick_on_route(pool: WorkerPool, key: AffinityKey, route: Route, need_capacity: bool) -> Worker | None:
    """pick() for a request with no provider object and nothing excluded: the eligible set is
    the route's available workers, and both rings are kept on the route."""
    st = state(pool)
    rings = route.rings.get(key.vnodes)
    if rings is None:
        rings = route.rings[key.vnodes] = (st.ring(route.available, key.vnodes),
                                           st.ring(route.serving, key.vnodes))
    return _walk(st, key, rings[0], rings[1], route.available, _NOTHING, need_capacity)


def _walk(st: AffinityState, key: AffinityKey, ring: Ring, primary_ring: Ring, eligible: list[Worker],
          excluded: set[int] | frozenset[int], need_capacity: bool) -> Worker | None:
    """Ring.walk() from the key's point, inline (no generator), bounded as _bounds() says."""
    # _bounds() of the usable (not excluded) workers, computed only for the workers the walk
    # reaches (the same arithmetic, in the same order, without building the dict).
    total = 1
    capacity = 0
    for w in eligible:
        if not excluded or id(w) not in excluded:
            total += w.in_flight
            capacity += max(w.capacity, 1)
    scaled = (1 + key.epsilon) * total
    points, owners, workers = ring.points, ring.owners, ring.workers
    n = len(points)
    if not n:
        return None
    start = bisect_left(points, key.point)
    chosen = None
    seen: set[int] = set()
    for j in range(n):
        idx = owners[(start + j) % n]
        if idx in seen:
            continue
        seen.add(idx)
        w = workers[idx]
        if (id(w) not in excluded and not (need_capacity and w.in_flight >= w.capacity)
                and w.in_flight < math.ceil(scaled * max(w.capacity, 1) / capacity)):
            chosen = w
            break
        if len(seen) == len(workers):
            break
    if chosen is None:
        return None
    # The same ring (every serving worker eligible): its owner is the one at the key's point.
    primary = workers[owners[start % n]] if primary_ring is ring else primary_ring.owner(key.point)
    if chosen is primary:
        st.outcomes[("hit", "")] += 1
    elif primary is not None and id(primary) in excluded:
        st.outcomes[("miss", "failover")] += 1
    elif primary is not None and any(w is primary for w in eligible):
        st.outcomes[("miss", "load")] += 1
    else:
        st.outcomes[("miss", "ineligible")] += 1
    return chosen
