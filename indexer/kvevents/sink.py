"""What an engine-stream subscriber needs of the index it feeds: :class:`EventSink`.

Two implementations: :class:`indexer.logic.IndexerLogic` (the subscriber runs
inside an indexer replica) and :class:`indexer.bridge.link.IndexerLink` (the
subscriber runs in ``kvmesh bridge`` next to the engine and reaches the
indexer Service over gRPC). The subscriber's replay, gap, restart and rebuild
logic (indexer/kvevents/subscriber.py) is the same over both; only the errors
matter to it, and both sides raise the same ones:

- :class:`~kvmesh.errors.Unavailable`: try again later (the backend, or the
  indexer replica, is down); the subscriber retries with backoff.
- :class:`~kvmesh.errors.FailedPrecondition` from ``publish``: the instance
  is not registered (any more), or no longer with the batch's incarnation:
  the subscriber registers it again and rebuilds it from the engine's replay.
- :class:`~kvmesh.errors.NotFound` from ``heartbeat``: the index dropped the
  instance (reaped, removed, lost): the same.
- any other :class:`~kvmesh.errors.KvmeshError` from ``publish``: the batch
  was refused (nothing applied); the subscriber counts it and treats its
  sequence as lost (``engine_events.on_unrecoverable_gap``).
"""

from __future__ import annotations

from typing import Protocol

from indexer.model import ApplyResult, EventBatch, InstanceId, InstanceSpec, InstanceState


class EventSink(Protocol):
    """The index calls an engine-stream subscriber makes, in the order it makes them.

    Calls of one subscriber never overlap; calls of several subscribers may.
    """

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        """Every registered instance of ``model`` (all models when empty)."""
        ...

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """Register ``spec``; the state and whether the index reset the instance."""
        ...

    async def heartbeat(self, instance: InstanceId) -> object:
        """Renew the instance's lease (:class:`~kvmesh.errors.NotFound` when unknown)."""
        ...

    async def publish(self, batch: EventBatch, *, skip_invalid: bool = False) -> ApplyResult:
        """Apply one batch; ``skip_invalid``: leave out events that do not validate
        (counted) instead of refusing the batch."""
        ...
