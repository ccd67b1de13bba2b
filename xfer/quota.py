"""What each peer may ask of a prefill sidecar: its waiting rooms and its Bootstrap rate.

A peer is the caller of Bootstrap: its certificate identity, or its host
when it has none. :class:`PeerQuota` keeps, per peer, a token bucket of
``limits.per_peer.bootstrap_rps`` and the rooms its Bootstraps opened that
the prefill engine has not claimed yet (no chunk added): those are the
rooms only the peer asked for, so they count against it, in the order they
were opened. Once the engine adds a chunk, or clears the room, it is the
engine's and no longer counts.

Not thread-safe: :class:`xfer.logic.XferLogic` calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvmesh.errors import ResourceExhausted
from xfer.config import PeerLimits


class _Peer:
    __slots__ = ("rooms", "stamp", "tokens")

    def __init__(self, tokens: float) -> None:
        self.tokens = tokens
        self.stamp = time.monotonic()
        #: Room ids opened by this peer's Bootstraps and not claimed yet, oldest first.
        self.rooms: OrderedDict[int, None] = OrderedDict()


class PeerQuota:
    """Per-peer Bootstrap rate and waiting rooms (see the module docstring)."""

    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits
        self._burst = float(limits.bootstrap_burst or max(1.0, limits.bootstrap_rps))
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    def _peer(self, key: str) -> _Peer:
        st = self._peers.get(key)
        if st is None:
            st = self._peers[key] = _Peer(self._burst)
            if len(self._peers) > self.limits.max_peers:
                for k, old in list(self._peers.items()):
                    if not old.rooms and k != key:
                        del self._peers[k]
                        break
        else:
            self._peers.move_to_end(key)
        return st

    def take(self, key: str) -> None:
        """Count one Bootstrap of ``key`` or raise RESOURCE_EXHAUSTED (with the delay until
        its bucket holds a token again)."""
        rps = self.limits.bootstrap_rps
        if rps <= 0:
            return
        st = self._peer(key)
        now = time.monotonic()
        st.tokens = min(self._burst, st.tokens + (now - st.stamp) * rps)
        st.stamp = now
        if st.tokens < 1.0:
            raise ResourceExhausted(
                f"peer {key!r} is over its rate of {rps:g} Bootstrap calls/s; retry later",
                field="limits.per_peer.bootstrap_rps",
                retry_after_s=(1.0 - st.tokens) / rps,
            )
        st.tokens -= 1.0

    def rooms(self, key: str) -> list[int]:
        """The rooms counted against ``key``, oldest first."""
        st = self._peers.get(key)
        return list(st.rooms) if st is not None else []

    def full(self, key: str) -> bool:
        """Whether ``key`` holds ``max_rooms`` rooms (never, without a cap)."""
        cap = self.limits.max_rooms
        return bool(cap) and len(self.rooms(key)) >= cap

    def add(self, key: str, room: int) -> None:
        """Count ``room`` against ``key``."""
        self._peer(key).rooms[room] = None

    def release(self, key: str, room: int) -> None:
        """Stop counting ``room`` against ``key`` (claimed, cleared or forgotten)."""
        st = self._peers.get(key)
        if st is not None:
            st.rooms.pop(room, None)
