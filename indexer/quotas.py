"""Per-identity quotas: which caps a caller's writes are held to, and its publish rate.

The counts live in the index, shared by every replica and kept in the same
step as each write (indexer/index.py, "Quotas"; indexer/redis/KEYS.md,
"Quotas"): this module only decides, call by call, whose they are and which
caps apply. No grpc here; the caller is :func:`kvmesh.auth.current_client`.

- An engine identity of the policy (any identity but an admin): the
  indexer's ``quotas`` (indexer/config.py), each overridden by the identity's
  own ``quotas`` entry in the policy. Its new instances count under its name.
- An admin identity: no caps at all, so that an operator can always register
  and remove even when every engine is at its quotas.
- No identity (authorization off: every caller is one anonymous client; a
  ZMQ subscriber of this replica): only ``max_blocks_per_instance``.

``publish_blocks_per_s`` is a token bucket per identity on each replica
(a rate needs no shared state: N replicas admit N times it at most).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from indexer.config import IndexerConfig, Quotas
from indexer.model import BlockStored, Event, Quota
from kvmesh.auth import Client, Principal
from kvmesh.errors import ResourceExhausted

#: Identities whose resolved quotas (and publish buckets) a replica keeps; the
#: least recently used goes first beyond it. A policy lists far fewer.
CACHE_SIZE = 4096


class _Blocks:
    """A token bucket of blocks that may go into debt: a batch larger than the
    bucket passes when it is full, and the next ones wait for the rate to pay it."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self, n: int) -> float:
        """Take ``n`` blocks; 0.0 when granted, else the seconds until they would be."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        need = min(float(n), self.burst)
        if self.tokens >= need:
            self.tokens -= n
            return 0.0
        return (need - self.tokens) / self.rate


def is_admin(client: Client | None) -> bool:
    """Whether ``client`` is an admin identity of the policy (not the anonymous caller)."""
    return (
        client is not None
        and client.principal.via != "open"
        and ("admin" in client.principal.roles)
    )


class QuotaPolicy:
    """The quotas of each caller of one replica (see the module docstring).

    ``free_loras``: LoRA names of the service's own marker blocks, outside
    every cap.
    """

    def __init__(self, config: IndexerConfig, free_loras: tuple[str, ...] = ()) -> None:
        self.defaults = config.quotas
        self.free_loras = free_loras
        self._anonymous = Quota(
            max_blocks_per_instance=self.defaults.max_blocks_per_instance,
            free_loras=free_loras,
        )
        self._unlimited = Quota(free_loras=free_loras)
        # principal id -> (principal, its quotas, the backend's Quota), for
        # principals of the current policy (each reload makes new ones).
        self._resolved: OrderedDict[int, tuple[Principal, Quotas, Quota]] = OrderedDict()
        self._buckets: OrderedDict[str, _Blocks] = OrderedDict()

    def values(self, client: Client | None) -> Quotas | None:
        """The quotas of ``client``'s identity (None: it has none of its own: admin,
        anonymous, no caller)."""
        got = self._resolve(client)
        return None if got is None else got[1]

    def quota(self, client: Client | None) -> Quota:
        """The caps a write by ``client`` is held to."""
        if client is None or client.principal.via == "open":
            return self._anonymous
        if is_admin(client):
            return self._unlimited
        got = self._resolve(client)
        assert got is not None
        return got[2]

    def _resolve(self, client: Client | None) -> tuple[Principal, Quotas, Quota] | None:
        if client is None or client.principal.via == "open" or is_admin(client):
            return None
        p = client.principal
        hit = self._resolved.get(id(p))
        if hit is not None and hit[0] is p:
            self._resolved.move_to_end(id(p))
            return hit
        own = p.quotas
        values = (
            self.defaults
            if own is None
            else self.defaults.model_copy(update=own.model_dump(exclude_none=True))
        )
        quota = Quota(
            identity=p.name,
            max_instances=values.max_instances_per_identity,
            max_namespaces=values.max_namespaces_per_identity,
            max_blocks=values.max_blocks_per_identity,
            max_blocks_per_instance=values.max_blocks_per_instance,
            free_loras=self.free_loras,
        )
        hit = (p, values, quota)
        self._resolved[id(p)] = hit
        if len(self._resolved) > CACHE_SIZE:
            self._resolved.popitem(last=False)
        return hit

    def check_dp_rank(self, client: Client | None, dp_rank: int) -> None:
        """RESOURCE_EXHAUSTED when ``client``'s identity may not register ``dp_rank``."""
        values = self.values(client)
        if values is not None and dp_rank > values.max_dp_rank:
            assert client is not None
            raise ResourceExhausted(
                f"identity {client.principal.name!r} may register dp ranks up to "
                f"{values.max_dp_rank}, got {dp_rank}",
                field="quotas.max_dp_rank",
            )

    def take_blocks(self, client: Client | None, events: Sequence[Event]) -> None:
        """Take the blocks ``events`` store from ``client``'s publish rate, or raise
        RESOURCE_EXHAUSTED (with the delay after which they would pass)."""
        values = self.values(client)
        if values is None or values.publish_blocks_per_s <= 0:
            return
        assert client is not None
        blocks = sum(len(ev.block_hashes) for ev in events if isinstance(ev, BlockStored))
        if not blocks:
            return
        name = client.principal.name
        rate = values.publish_blocks_per_s
        burst = float(values.publish_blocks_burst or max(1.0, rate))
        b = self._buckets.get(name)
        if b is None or b.rate != rate or b.burst != burst:
            b = self._buckets[name] = _Blocks(rate, burst)
            if len(self._buckets) > CACHE_SIZE:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(name)
        wait = b.take(blocks)
        if wait:
            raise ResourceExhausted(
                f"identity {name!r} is over its rate of {rate:g} stored blocks/s; retry later",
                field="quotas.publish_blocks_per_s",
                retry_after_s=wait,
            )
