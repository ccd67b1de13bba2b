"""Backends of the fault harness and the faults each one takes.

A :class:`Target` is what the replicas of a run share: nothing (the memory
backend: one replica, its own index), one real ``redis-server``
(:class:`StandaloneTarget`) or a real Redis Cluster with replicas
(:class:`ClusterTarget`). Each injects its faults on the real processes:

- ``CLIENT PAUSE ms ALL`` (every command waits; one that waits longer than
  the replicas' socket timeout fails on their side and runs afterwards);
- standalone: Redis killed and restarted empty on its port;
- cluster: a slot migrated to another master the way ``redis-cli --cluster
  reshard`` does it (``CLUSTER SETSLOT IMPORTING`` / ``MIGRATING``,
  ``MIGRATE`` of its keys, ``CLUSTER SETSLOT NODE`` on every master), with a
  pause halfway so that calls meet ASK redirections and TRYAGAIN; a master
  failed over to its replica (``CLUSTER FAILOVER``).

Blocking admin work runs in a thread so that the replicas (same event loop)
keep serving while it happens.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Literal, cast

import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from indexer.redis import keys as K
from lab.redisproc import RedisClusterProcess, RedisProcess

#: Seconds the split migration pauses after moving half of a slot's keys:
#: long enough for a call in flight to meet the half-moved slot.
SPLIT_PAUSE_S = 0.03

#: Keys moved per MIGRATE command.
_MIGRATE_BATCH = 100


class Target:
    """The backend the replicas of a run share (base: the memory backend, no Redis)."""

    kind = "memory"
    cluster = False

    @property
    def url(self) -> str:
        """URL the replicas connect to ('' without Redis)."""
        return ""

    async def pause(self, ms: int, node: int) -> None:
        """``CLIENT PAUSE ms ALL`` on the Redis (node: a master's index, -1 all)."""
        raise NotImplementedError(f"{self.kind}: no pause")

    async def restart_empty(self) -> None:
        """Kill Redis and start it again, empty."""
        raise NotImplementedError(f"{self.kind}: no restart")

    async def migrate(
        self, prefix: str, what: Literal["control", "node", "block"], to: int, split: bool
    ) -> str:
        """Move one slot to another master; a description of what moved."""
        raise NotImplementedError(f"{self.kind}: no slots")

    async def failover(self, master: int) -> str:
        """Fail master ``master`` over to its replica; a description."""
        raise NotImplementedError(f"{self.kind}: no replicas")

    def close(self) -> None:
        """Stop what the target started (nothing by default)."""


class StandaloneTarget(Target):
    """One private ``redis-server`` (:class:`lab.redisproc.RedisProcess`)."""

    kind = "standalone"

    def __init__(self, proc: RedisProcess) -> None:
        self.proc = proc

    @property
    def url(self) -> str:
        """The server's URL."""
        return self.proc.url

    async def pause(self, ms: int, node: int) -> None:
        """Pause every client of the server for ``ms`` milliseconds."""
        r = aioredis.Redis(host=self.proc.host, port=self.proc.port)
        try:
            await cast(Any, r).execute_command("CLIENT", "PAUSE", ms, "ALL")
        finally:
            await r.aclose()

    async def restart_empty(self) -> None:
        """SIGKILL and start again on the same port (no persistence: empty)."""

        def go() -> None:
            self.proc.kill()
            self.proc.start()

        await asyncio.to_thread(go)


class ClusterTarget(Target):
    """A private Redis Cluster with replicas (:class:`lab.redisproc.RedisClusterProcess`)."""

    kind = "cluster"
    cluster = True

    def __init__(self, proc: RedisClusterProcess) -> None:
        self.proc = proc

    @property
    def url(self) -> str:
        """A node's URL (the client discovers the rest)."""
        return self.proc.url

    def _client(self, i: int) -> redis.Redis:
        n = self.proc.nodes[i]
        return redis.Redis(host=n.host, port=n.port, socket_timeout=5.0)

    def _cmd(self, i: int, *args: Any) -> Any:
        r = self._client(i)
        try:
            return cast(Any, r).execute_command(*args)
        finally:
            r.close()

    async def pause(self, ms: int, node: int) -> None:
        """Pause the clients of one master (``node`` among the masters now) or of all."""
        masters = await asyncio.to_thread(self.proc.masters_now)
        chosen = masters if node < 0 else [masters[node % len(masters)]]
        for i in chosen:
            n = self.proc.nodes[i]
            r = aioredis.Redis(host=n.host, port=n.port)
            try:
                await cast(Any, r).execute_command("CLIENT", "PAUSE", ms, "ALL")
            finally:
                await r.aclose()

    def _owner(self, slot: int) -> int:
        for i, n in enumerate(self.proc.nodes):
            if not n.running:
                continue
            for lo, hi, master, *_ in self._cmd(i, "CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return self.proc.ports.index(int(master[1]))
        raise RuntimeError(f"no master serves slot {slot}")

    def _slot(self, prefix: str, what: str, rng: random.Random) -> int | None:
        """The slot to move: the control slot, a node-tag slot or a block anchor slot."""
        if what == "control":
            return int(key_slot(K.cluster_base(prefix) + K.GEN))
        pattern = (
            K.base(prefix) + K.NODE_GEN + b"*"
            if what == "node"
            else K.base(prefix) + K.BLOCK + b"{*"
        )
        found: set[int] = set()
        for i in self.proc.masters_now():
            r = self._client(i)
            try:
                for name in r.scan_iter(match=pattern, count=1000):
                    tag = name[name.index(b"{") + 1 : name.index(b"}")]
                    if what == "block" and tag[:1] == b"n":
                        continue  # a master's copy of the shallow blocks, not an anchor
                    found.add(int(key_slot(name)))
            finally:
                r.close()
        return rng.choice(sorted(found)) if found else None

    async def migrate(
        self, prefix: str, what: Literal["control", "node", "block"], to: int, split: bool
    ) -> str:
        """Move one slot (with its keys) to another master, as a resharding does."""
        rng = random.Random(f"{prefix}/{what}/{to}")
        slot = await asyncio.to_thread(self._slot, prefix, what, rng)
        if slot is None:
            return f"no {what} slot holds keys yet"
        return await asyncio.to_thread(self._move, slot, to, split)

    def _move(self, slot: int, to: int, split: bool) -> str:
        src = self._owner(slot)
        others = [m for m in self.proc.masters_now() if m != src]
        dst = others[to % len(others)]
        ids = {i: self._cmd(i, "CLUSTER", "MYID") for i in [src, dst]}
        dst_node = self.proc.nodes[dst]
        self._cmd(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        self._cmd(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        moved = 0
        keys = self._cmd(src, "CLUSTER", "GETKEYSINSLOT", slot, 100_000)
        half = len(keys) // 2 if split else len(keys)
        for part in (keys[:half], keys[half:]):
            for j in range(0, len(part), _MIGRATE_BATCH):
                batch = part[j : j + _MIGRATE_BATCH]
                self._cmd(src, "MIGRATE", dst_node.host, dst_node.port, "", 0, 5000, "KEYS", *batch)
                moved += len(batch)
            if split and part is keys[:half]:
                time.sleep(SPLIT_PAUSE_S)
        # Keys written meanwhile (a call that got ASK wrote on the target already).
        while rest := self._cmd(src, "CLUSTER", "GETKEYSINSLOT", slot, 1000):
            self._cmd(src, "MIGRATE", dst_node.host, dst_node.port, "", 0, 5000, "KEYS", *rest)
            moved += len(rest)
        ids[dst] = self._cmd(dst, "CLUSTER", "MYID")
        self._cmd(dst, "CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        self._cmd(src, "CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        for m in self.proc.masters_now():
            if m not in (src, dst):
                self._cmd(m, "CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        self.proc.wait_ok()
        return f"slot {slot} ({moved} keys) from node {src} to node {dst}"

    async def failover(self, master: int) -> str:
        """``CLUSTER FAILOVER`` on a replica of the ``master``-th master now."""

        def go() -> str:
            masters = self.proc.masters_now()
            m = masters[master % len(masters)]
            replicas = self.proc.replicas_of(m)
            if not replicas:
                return f"node {m} has no replica"
            self.proc.failover(replicas[0])
            return f"node {replicas[0]} took over from node {m}"

        return await asyncio.to_thread(go)
