"""The named invariants the fault harness checks after every step (indexer/CONSISTENCY.md).

Each name is what a violation reports; the text is the rule, in the words of
the contract. The driver (``lab/faults/driver.py``) checks every answer it
gets against :class:`~lab.faults.model.FleetModel` and reports the first
invariant an answer breaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.faults.ops import Op, describe

INVARIANTS: dict[str, str] = {
    "ack_lost": "an acknowledged write is missing (a block, a sequence, a registration), "
    "absent a Redis restarted empty",
    "removed_reported": "blocks are reported after their removal (BlockRemoved, "
    "AllBlocksCleared, reset, RemoveInstance, reap) was acknowledged",
    "listed_twice": "an instance (or, in SGLang's prefix answer, an address) appears twice "
    "in one answer",
    "ghost_instance": "a removed, reaped, expired, unregistered or (without include_stale) "
    "stale instance is answered past the lag bound",
    "stale_identity": "an instance is answered with an address or stale flag it did not have "
    "within the lag bound (e.g. its old address after a re-registration)",
    "hidden_live": "a live instance holding the prefix throughout the lag window is missing "
    "from a Match answer",
    "valid_rejected": "a valid request is refused without a fault to explain it (e.g. a "
    "batch rejected because another replica changed the instance), or refused during a "
    "fault with another status than UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED",
    "not_recovered": "after a fault ended, valid requests kept failing longer than RECOVERY_S",
    "wrong_ack": "an acknowledgement differs from the contract: batch outcome, applied "
    "sequence, block counts, register's reset flag, lease expiry, entries removed",
    "wrong_read": "a read differs from the contract in a way no other invariant names: "
    "order, tier counts, ListInstances fields, GetStats sizes",
    "names_grow_memory": "a replica keeps memory for names clients invent (unknown models "
    "and workers, instances registered and removed)",
    "zmq_phantom": "the index names a block of a ZMQ-fed instance that its engine does not hold",
    "zmq_lost": "the engine's replay buffer covered everything the subscriber missed, yet "
    "the index lacks part of the engine's cache",
    "zmq_stuck": "a ZMQ subscriber did not catch up with its engine within ZMQ_CATCH_UP_S",
    "follower_lag": "a router's follower answered a Match from a copy that lacked a change "
    "its replica had acknowledged longer than its lag bound F (FOLLOWER_LAG_S) before, or "
    "longer than F after its stalled stream flowed again, instead of catching up or "
    "answering nothing",
    "starved": "a Match waited for a whole ZMQ ingest burst: the replica served no gRPC "
    "while it ingested",
}


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which, at which step of the run, by which operation, and how."""

    invariant: str
    step: int
    op: Op
    detail: str

    def __post_init__(self) -> None:
        if self.invariant not in INVARIANTS:
            raise ValueError(f"unknown invariant {self.invariant!r}")

    def __str__(self) -> str:
        return f"{self.invariant} at step {self.step} ({describe(self.op)}): {self.detail}"
