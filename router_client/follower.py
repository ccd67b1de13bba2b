"""A router's own copy of the index, kept by WatchIndex: Match without a network hop.

An :class:`IndexFollower` opens ``WatchIndex`` on one indexer replica (the
memory backend), loads the snapshot into a :class:`indexer.memory.MemoryIndex`
of its own (the same index code the replica runs, not a copy of it), then
applies every change the replica streams, in order. While it is in sync,
:meth:`IndexFollower.match` answers from that copy, in process; while it is
not (connecting, loading a snapshot, told to resync, the stream broken, a
hybrid-attention instance in the model), it answers None and the caller asks
the indexer (:class:`router_client.indexer_client.IndexerClient` does so when
given a follower), which falls back to load-only routing as it always does.

What the follower answers is what the replica answered when the follower had
applied the same changes: the same code, the same changes, in the same order
(tests/integration/test_follower.py checks it against the replica's own Match
on random workloads). It lags the replica by the stream's delay:
:attr:`IndexFollower.lag_s` holds the last ones (arrival minus the replica's
``applied_at``; on one host, or with synchronised clocks).

Memory: ``max_pairs`` bounds the copy in (block, instance) pairs (about
110 bytes each, docs/benchmarks.md). Past it, the model matched least
recently (one never matched first) is dropped: the follower follows the
others on a new stream and that model's Matches go to the indexer
(:attr:`IndexFollower.dropped`); the last model is never dropped.

Route-time predictions (``predictions``, on by default): the follower asks
its replica for them, and while the stream carries them
(:attr:`IndexFollower.predictions_followed`, from ``WatchSynced``) a Match
with ``include_predicted`` is answered from the copy too, predicted depths
and each instance's pending prefill included, as the replica would answer
it: the snapshot holds each instance's unexpired predictions and every later
one arrives as a change, recorded by the same code and dropped by the same
stores, clears, resets and removals, each at the replica's expiry. A router
sees its own prediction here one stream delay after the replica
acknowledged it.

Not followed: instances of a hybrid-attention model (sliding window, Mamba):
their hits are cut by group presence that only the ingesting replica holds
(indexer/groups.py), so their Matches go to the indexer. Each instance's
lease is kept by the changes (registrations, heartbeats, batches) on the
follower's own clock.

Silence: the follower asks the replica for a keepalive every ``keepalive_ms``
of an idle stream (sent only when the follower has read every change). Once
one arrived on a stream (the replica answers the snapshot's end with one), a
stream silent for longer than ``max_silence_s`` (default three intervals, at
least two of the replica's) is taken as stalled: the follower goes out of
sync at once, so its Matches go to the indexer, and opens the stream again
(:attr:`IndexFollower.stalls`). A replica that predates keepalives sends
none, and then no bound applies: a quiet stream is not cut.

Holding the copy through an outage: out of sync, :meth:`IndexFollower.match`
answers None, and the caller asks the indexer. Should the indexer not answer
either (down, unreachable, the breaker open, busy),
:meth:`IndexFollower.held_match` answers from the copy the follower held when
it last heard from its replica in sync, for up to ``hold_s`` (default
:data:`DEFAULT_HOLD_S`) after that: a router keeps routing by cache through an
indexer restart instead of falling back to load alone. A held answer is the
replica's state of at most ``hold_s`` ago (indexer/CONSISTENCY.md, "A
follower's answers"); past it, or with ``hold_s`` 0, nothing is held. The copy
held is the last one loaded: a new snapshot replaces it only once it is in
whole. :class:`router_client.indexer_client.IndexerClient` does this when
given a follower (``IndexerClient.follower_held_matches`` counts those
answers, :attr:`IndexFollower.held_matches` too).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Never

import grpc
import grpc.aio

from indexer.convert import batch_from_pb, state_from_pb
from indexer.memory import MAX_PREDICTED_PER_INSTANCE, MemoryIndex
from indexer.model import (
    HYBRID_LORA,
    HYBRID_MARKER,
    Event,
    EventBatch,
    InstanceId,
    InstanceMatch,
    Namespace,
)
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.errors import KvmeshError
from kvmesh.tasks import stop_tasks
from kvmesh.tls import ChannelFactory, ClientTLS
from router_client.indexer_client import MatchOutcome, MatchStatus, WorkerMatch, instance_name

log = logging.getLogger(__name__)

#: Entries of the follower's name and answer caches before they start over.
_CACHE_CAP = 65536
#: Whole answers the follower keeps made (IndexFollower._outcomes), at most.
_OUTCOME_CAP = 4096
#: One of them: the copy's hits, and the answer made of them.
_Made = tuple[list[InstanceMatch], dict[str, WorkerMatch]]
#: Lags kept for :attr:`IndexFollower.lag_s`.
LAG_WINDOW = 4096
#: Options of the channel a follower opens: any message size, for the replica
#: bounds what it sends (its limits.max_message_bytes, 16 MiB by default),
#: where grpc's default of 4 MiB would end the stream at the first larger
#: change (a batch of some 250,000 blocks). A channel passed in needs the same.
RECEIVE_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    # gRPC's own reconnect backoff grows to 120 s: after a replica restarted a
    # few times the copy stayed out of sync long past the follower's own 2 s cap.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
#: Reconnect backoff: first and longest pause, seconds.
BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 2.0
#: The keepalive interval a follower asks for by default, ms.
DEFAULT_KEEPALIVE_MS = 1000
#: The silence bound by default, in keepalive intervals.
SILENCE_INTERVALS = 3
#: Seconds a follower out of sync keeps answering from its last copy when the
#: indexer cannot answer either (:meth:`IndexFollower.held_match`), counted
#: from when it last heard from its replica in sync: long enough to ride out
#: a replica's restart and a new snapshot, short enough that the copy's view
#: of which blocks are held is still mostly true (engines evict over minutes).
DEFAULT_HOLD_S = 60.0


class IndexFollower:
    """One replica's index for ``models`` (empty: every model), followed in process.

    Pass ``target`` (``host:port``, dialled with ``tls``) or a ready ``channel``
    (closed by the caller; opened with :data:`RECEIVE_OPTIONS`). :meth:`start`
    it on the router's event loop; :meth:`close` it there.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        channel: grpc.aio.Channel | None = None,
        models: Sequence[str] = (),
        tls: ClientTLS | None = None,
        max_buffer: int = 0,
        max_pairs: int = 0,
        keepalive_ms: int = DEFAULT_KEEPALIVE_MS,
        max_silence_s: float | None = None,
        hold_s: float = DEFAULT_HOLD_S,
        predictions: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if (target is None) == (channel is None):
            raise ValueError("pass exactly one of target and channel")
        if keepalive_ms < 0 or (max_silence_s is not None and max_silence_s <= 0):
            raise ValueError("keepalive_ms must be >= 0 and max_silence_s > 0")
        if not hold_s >= 0:
            raise ValueError(f"hold_s must be >= 0 seconds, got {hold_s!r}")
        self._factory: ChannelFactory | None = None
        if channel is None:
            assert target is not None
            self._factory = ChannelFactory(
                target, tls or ClientTLS(), options=RECEIVE_OPTIONS, what="router: follower"
            )
            channel = self._factory.channel()
        self._channel = channel
        self._stub = pb_grpc.IndexerServiceStub(channel)
        self.models = tuple(models)
        self._wanted = frozenset(models)
        self._max_buffer = max_buffer
        self._clock = clock
        #: Keepalive interval asked of the replica, ms (0: none, no silence bound).
        self.keepalive_ms = keepalive_ms
        #: Longest silence of a stream with keepalives before it counts as
        #: stalled, seconds (at least two of the replica's intervals).
        self.max_silence_s = (
            max_silence_s if max_silence_s is not None else SILENCE_INTERVALS * keepalive_ms / 1000
        )
        #: Seconds after the follower last heard from its replica in sync that
        #: :meth:`held_match` still answers from the copy (0: never).
        self.hold_s = hold_s
        #: Whether the follower asks its replica for route-time predictions.
        self.predictions = predictions
        #: Whether the stream in sync carries them (WatchSynced.predictions):
        #: Matches with include_predicted are then answered here too.
        self.predictions_followed = False
        #: time.monotonic() of the last response read in sync (-inf: none yet,
        #: or closed): what a held answer's age counts from.
        self._heard_at = -math.inf
        #: Matches answered from the held copy (:meth:`held_match`).
        self.held_matches = 0
        #: The copy Matches are answered from (replaced at each snapshot).
        self.index = MemoryIndex(clock=clock)
        self._staging: MemoryIndex | None = None
        #: The instance whose snapshot parts are arriving (more follow).
        self._part: _Parts | None = None
        #: Instances of the snapshot being loaded installed so far.
        self._installed = 0
        #: Per instance of the last snapshot, the position it was read at.
        self._skip: dict[InstanceId, int] = {}
        self._skip_until = 0
        #: Whether Matches are answered here (the snapshot loaded, the stream up).
        self.synced = False
        #: Position of the last change applied.
        self.position = 0
        self.snapshots = 0
        self.resyncs = 0
        self.reconnects = 0
        self.changes_applied = 0
        #: Changes the copy could not apply as the replica had (an instance it
        #: does not hold): counted, then the follower resyncs.
        self.divergences = 0
        #: Snapshots that arrived with a gap (an instance's part missing, out of
        #: order or interrupted; fewer instances than WatchSynced counts):
        #: counted, then the follower takes a new one.
        self.gaps = 0
        self.local_matches = 0
        #: Keepalives received (responses without changes, sent on an idle stream).
        self.keepalives = 0
        #: Streams silent past the bound (:meth:`silence_bound`): each one put
        #: the follower out of sync and was opened again.
        self.stalls = 0
        #: The last lags, seconds (arrival minus the replica's applied_at).
        self.lag_s: deque[float] = deque(maxlen=LAG_WINDOW)
        self._hybrid: dict[str, bool] = {}
        self._names: dict[InstanceId, str] = {}
        self._answers: dict[tuple[int, int, int, int, int], WorkerMatch] = {}
        #: The same for answers with predictions (predicted_depth last).
        self._pred_answers: dict[tuple[int, int, int, int, int, int], WorkerMatch] = {}
        #: Whole answers by the identities of the copy's hits (which the copy
        #: keeps made: a shared prefix asked again gives the same objects),
        #: each with those hits, which keeps the identities from being reused.
        self._outcomes: dict[tuple[int, ...], _Made] = {}
        #: The copy's bound in (block, instance) pairs (0: none). Past it, the
        #: model matched least recently is dropped and its Matches go remote.
        self.max_pairs = max_pairs
        #: Models dropped for the bound (their Matches go to the indexer).
        self.dropped: set[str] = set()
        self._matched_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._synced_event = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> IndexFollower:
        """Start following (returns at once; :meth:`wait_synced` waits for the snapshot)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvmesh-follower")
        return self

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until the follower is in sync, at most ``timeout_s``; whether it is."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._synced_event.wait()
        return self.synced

    async def close(self) -> None:
        """Stop following (and close the channel this follower opened)."""
        self._set_synced(False)
        self._heard_at = -math.inf  # a closed follower holds nothing
        if self._task is not None:
            await stop_tasks(self._task, what="follower")
            self._task = None
        if self._factory is not None:
            await self._channel.close()

    # -- Match -----------------------------------------------------------------

    def match(
        self, model: str, lora_name: str, keys: Sequence[int], *, include_predicted: bool = False
    ) -> MatchOutcome | None:
        """``keys``' hits from the copy, or None when it cannot answer (out of
        sync, a model not followed, a hybrid-attention model, predictions asked
        for and not followed): ask the indexer.

        ``include_predicted``: the replica's Match with predictions, from the
        copy (hits with ``predicted_depth``, and ``pending``), when the stream
        carries them (:attr:`predictions_followed`)."""
        if not self.synced or not self._answers_for(model):
            return None
        if include_predicted and not self.predictions_followed:
            return None
        self._matched_at[model] = time.monotonic()
        self.local_matches += 1
        if include_predicted:
            return self._answer_predicted(model, lora_name, keys)
        return self._answer(model, lora_name, keys)

    @property
    def held_age_s(self) -> float:
        """Seconds since the follower last heard from its replica in sync (0 in
        sync; inf before the first snapshot): the age of what a held answer
        would say."""
        if self.synced:
            return 0.0
        return time.monotonic() - self._heard_at

    def held_match(
        self, model: str, lora_name: str, keys: Sequence[int], *, include_predicted: bool = False
    ) -> MatchOutcome | None:
        """``keys``' hits from the last copy while the follower is out of sync,
        for a caller whose indexer did not answer either (see the module
        docstring); None in sync (use :meth:`match`), before the first
        snapshot, past ``hold_s``, and for a model the copy does not follow.
        With ``include_predicted``, the copy's predictions too (each ends at
        its expiry) when the last stream carried them, else the hits alone."""
        if self.synced or self._heard_at == -math.inf or self.held_age_s > self.hold_s:
            return None
        if not self._answers_for(model):
            return None
        self.held_matches += 1
        if include_predicted and self.predictions_followed:
            return self._answer_predicted(model, lora_name, keys)
        return self._answer(model, lora_name, keys)

    def _answers_for(self, model: str) -> bool:
        """Whether the copy answers for ``model``: followed, not dropped for the
        bound, not hybrid-attention."""
        if self._wanted and model not in self._wanted:
            return False
        return model not in self.dropped and not self._is_hybrid(model)

    def _answer(self, model: str, lora_name: str, keys: Sequence[int]) -> MatchOutcome:
        hits = self.index.match_sync(Namespace(model, lora_name), keys)
        ident = tuple(map(id, hits))
        made = self._outcomes.get(ident)
        if made is not None:
            # The same hits as an answer made before: a copy of it (the caller
            # may change its dict).
            return MatchOutcome(MatchStatus.OK, dict(made[1]))
        # Names and answers are immutable and repeat (64 holders of one prefix
        # share a depth): made once each, not per Match (a third of a 32-block
        # Match's cost with 64 holders was building them).
        names, answers = self._names, self._answers
        if len(names) > _CACHE_CAP or len(answers) > _CACHE_CAP:
            names.clear()
            answers.clear()
        if len(self._outcomes) > _OUTCOME_CAP:
            self._outcomes.clear()
        out: dict[str, WorkerMatch] = {}
        for h in hits:
            name = names.get(h.instance)
            if name is None:
                name = names[h.instance] = instance_name(h.instance.worker_id, h.instance.dp_rank)
            key = (h.depth, h.gpu_blocks, h.cpu_blocks, h.disk_blocks, h.tokens)
            answer = answers.get(key)
            if answer is None:
                answer = answers[key] = WorkerMatch(*key)
            out[name] = answer
        self._outcomes[ident] = (hits, out)
        return MatchOutcome(MatchStatus.OK, dict(out))

    def _answer_predicted(self, model: str, lora_name: str, keys: Sequence[int]) -> MatchOutcome:
        """The answer of a Match with predictions: what the replica's unary
        Match would answer from the same changes (hits with predicted_depth,
        the pending prefill of each instance of the model)."""
        idx = self.index
        hits = idx.match_sync(Namespace(model, lora_name), keys, include_predicted=True)
        names, answers = self._names, self._pred_answers
        if len(names) > _CACHE_CAP or len(answers) > _CACHE_CAP:
            names.clear()
            answers.clear()
        out: dict[str, WorkerMatch] = {}
        for h in hits:
            key = (h.depth, h.gpu_blocks, h.cpu_blocks, h.disk_blocks, h.tokens, h.predicted_depth)
            answer = answers.get(key)
            if answer is None:
                answer = answers[key] = WorkerMatch(*key)
            out[self._name(h.instance)] = answer
        pending = {self._name(i): n for i, n in idx.pending_predicted_sync(model).items()}
        return MatchOutcome(MatchStatus.OK, out, pending)

    def _name(self, iid: InstanceId) -> str:
        """``iid``'s worker name, made once (:data:`_CACHE_CAP` bounds the cache)."""
        name = self._names.get(iid)
        if name is None:
            name = self._names[iid] = instance_name(iid.worker_id, iid.dp_rank)
        return name

    def _is_hybrid(self, model: str) -> bool:
        got = self._hybrid.get(model)
        if got is None:
            marked = self.index.match_sync(
                Namespace(model, HYBRID_LORA), [HYBRID_MARKER], include_stale=True
            )
            got = self._hybrid[model] = bool(marked)
        return got

    # -- the stream ----------------------------------------------------------

    def _set_synced(self, value: bool) -> None:
        self.synced = value
        if value:
            self._heard_at = time.monotonic()
            self._synced_event.set()
        else:
            self._synced_event.clear()

    async def _run(self) -> None:
        delay = BACKOFF_START_S
        while True:
            req = pb.WatchIndexRequest(
                models=self.models,
                max_buffer=self._max_buffer,
                instance_parts=True,
                keepalive_ms=self.keepalive_ms,
                predictions=self.predictions,
            )
            call = self._stub.WatchIndex(req)
            code: grpc.StatusCode | str | None = None
            # No bound until the replica shows it sends keepalives on this stream.
            silence_s: float | None = None
            try:
                while (resp := await self._read(call, silence_s)) is not None:
                    if self.synced:
                        self._heard_at = time.monotonic()
                    if resp.HasField("keepalive"):
                        silence_s = self.silence_bound(resp.keepalive)
                        if not resp.changes:
                            self.keepalives += 1
                    for ch in resp.changes:
                        await self._on(ch)
                    delay = BACKOFF_START_S
                    if self.max_pairs and self.synced:
                        self._bound()
            except grpc.aio.AioRpcError as e:
                code = e.code()
            except _Diverged:
                code = "diverged"
            except _Stalled as e:
                code = f"stalled: {e}"
            except _Gap as e:
                code = f"gap in the snapshot: {e}"
            except _Narrowed:
                code = "narrowed"
                delay = 0.0
            finally:
                call.cancel()
            self._set_synced(False)
            self._staging = None
            self._part = None
            self.reconnects += 1
            log.warning("follower: WatchIndex ended (%s); reconnecting in %.2fs", code, delay)
            await asyncio.sleep(delay)
            delay = min(max(delay, BACKOFF_START_S) * 2, BACKOFF_CAP_S)

    async def _read(
        self,
        call: grpc.aio.UnaryStreamCall[pb.WatchIndexRequest, pb.WatchIndexResponse],
        silence_s: float | None,
    ) -> pb.WatchIndexResponse | None:
        """The stream's next response, or None at its end; with ``silence_s``,
        :class:`_Stalled` (counted, out of sync at once) when nothing arrives
        for that long (the read is cancelled, and the call with it)."""
        try:
            async with asyncio.timeout(silence_s):
                resp = await call.read()
        except TimeoutError:
            self.stalls += 1
            self._set_synced(False)
            raise _Stalled(f"nothing for {silence_s:.2f}s") from None
        return resp if isinstance(resp, pb.WatchIndexResponse) else None  # None: EOF

    def silence_bound(self, keepalive: pb.WatchKeepalive) -> float | None:
        """The longest silence of a stream whose replica sends ``keepalive``s:
        :attr:`max_silence_s`, and at least two of the replica's intervals (it
        may keep a longer one than asked); None when none were asked."""
        if not self.keepalive_ms:
            return None
        return max(self.max_silence_s, 2 * keepalive.interval_ms / 1000)

    def _bound(self) -> None:
        """Past ``max_pairs``: drop the model matched least recently (never matched
        first), and follow the others on a new stream."""
        held = self.index.pairs_by_model()
        if sum(held.values()) <= self.max_pairs or len(held) < 2:
            return
        victim = min(held, key=lambda m: (self._matched_at.get(m, 0.0), -held[m]))
        self.dropped.add(victim)
        kept = (
            sorted(set(held) - self.dropped)
            if not self.models
            else [m for m in self.models if m not in self.dropped]
        )
        log.warning(
            "follower: %d pairs, over max_pairs %d: %s goes to the indexer from now on",
            sum(held.values()),
            self.max_pairs,
            victim,
        )
        self.models = tuple(kept)
        self._wanted = frozenset(kept)
        self._set_synced(False)
        raise _Narrowed

    async def _on(self, ch: pb.WatchChange) -> None:
        kind = ch.WhichOneof("change")
        now = self._clock()
        if kind == "snapshot":
            await self._on_snapshot(ch)
            return
        if self._part is not None:
            self._gap(f"{kind} before the last part of {self._part.instance}")
        if kind == "synced":
            if ch.synced.instances != self._installed:
                self._gap(f"{self._installed} instances, WatchSynced counts {ch.synced.instances}")
            self._installed = 0
            self.index = (
                self._staging if self._staging is not None else MemoryIndex(clock=self._clock)
            )
            self._staging = None
            self._hybrid = {}
            self._skip_until = max(self._skip.values(), default=0)
            self.position = ch.position
            self.snapshots += 1
            self.predictions_followed = self.predictions and ch.synced.predictions
            self._set_synced(True)
            return
        if kind == "resync":
            self.resyncs += 1
            self._set_synced(False)  # the copy is void until the next snapshot
            return
        self.position = ch.position
        if self._skip:
            if ch.position > self._skip_until:
                self._skip = {}
            else:
                iid = self._instance_of(ch, kind)
                if ch.position <= self._skip.get(iid, 0):
                    return  # the snapshot already held it
        try:
            await self._apply(ch, kind)
        except KvmeshError as e:
            # The copy does not hold what the replica held when it applied this:
            # answer nothing from it until a new snapshot.
            self.divergences += 1
            log.warning("follower: change at %d did not apply (%s); resyncing", ch.position, e)
            self._set_synced(False)
            raise _Diverged from e
        self.changes_applied += 1
        if ch.applied_at:
            self.lag_s.append(max(0.0, now - ch.applied_at))

    async def _on_snapshot(self, ch: pb.WatchChange) -> None:
        """One entry of a snapshot: an instance whole, or one of its parts (put
        together here, and installed with the last)."""
        snap = ch.snapshot
        if self._staging is None:
            self._staging = MemoryIndex(clock=self._clock)
            self._skip = {}
            self._installed = 0
        state = state_from_pb(snap.info)
        iid = state.spec.instance
        content = batch_from_pb(snap.content)
        got = self._part
        if got is None:
            if snap.part != 0:
                self._gap(f"part {snap.part} of {iid} without its part 0")
            if snap.more:
                self._part = _Parts(iid, ch.position, content, list(content.events), 1)
                return
        else:
            if iid != got.instance or snap.part != got.next or ch.position != got.position:
                self._gap(
                    f"part {snap.part} of {iid} at {ch.position} where part {got.next} "
                    f"of {got.instance} at {got.position} was due"
                )
            got.events.extend(content.events)
            got.next += 1
            if snap.more:
                return
            content = dataclasses.replace(got.first, events=tuple(got.events))
            self._part = None
        await self._staging.load_instance(state, content)
        for p in snap.predicted:
            _record(self._staging, state.spec.model, p, self._clock())
        self._skip[iid] = ch.position
        self._installed += 1

    def _gap(self, what: str) -> Never:
        """The snapshot arrived broken: nothing of it is installed; a new one is taken."""
        self.gaps += 1
        self._part = None
        self._staging = None
        self._set_synced(False)
        raise _Gap(what)

    @staticmethod
    def _instance_of(ch: pb.WatchChange, kind: str | None) -> InstanceId:
        if kind == "registered":
            ref = ch.registered.info.instance
        elif kind == "renewed":
            ref = ch.renewed
        elif kind == "batch":
            ref = ch.batch.instance
        elif kind == "predicted":
            ref = ch.predicted.instance
        else:
            ref = ch.gone.instance
        return InstanceId(ref.worker_id, ref.dp_rank)

    async def _apply(self, ch: pb.WatchChange, kind: str | None) -> None:
        idx = self.index
        # A lease runs from the replica's time of the change (applied_at), not
        # from when the copy applied it.
        if kind == "registered":
            state = state_from_pb(ch.registered.info)
            await idx.register(state.spec)
            if ch.applied_at:
                idx.renewed_at(state.spec.instance, ch.applied_at)
            self._hybrid.pop(state.spec.model, None)
        elif kind == "renewed":
            iid = InstanceId(ch.renewed.worker_id, ch.renewed.dp_rank)
            with contextlib.suppress(KvmeshError):
                await idx.heartbeat(iid)
                if ch.applied_at:
                    idx.renewed_at(iid, ch.applied_at)
        elif kind == "batch":
            batch = batch_from_pb(ch.batch)
            await idx.apply(batch)
            if ch.applied_at:
                idx.renewed_at(batch.instance, ch.applied_at)
            if any(getattr(ev, "lora_name", "") == HYBRID_LORA for ev in batch.events):
                self._hybrid = {}
        elif kind == "gone":
            iid = InstanceId(ch.gone.instance.worker_id, ch.gone.instance.dp_rank)
            with contextlib.suppress(KvmeshError):
                await idx.remove_instance(iid)
            self._hybrid = {}
        elif kind == "predicted":
            ref = ch.predicted.instance
            model = idx.model_of(InstanceId(ref.worker_id, ref.dp_rank))
            if model is not None:
                _record(idx, model, ch.predicted, self._clock())


def _record(idx: MemoryIndex, model: str, p: pb.WatchPredicted, now: float) -> None:
    """Record route-time predictions as the replica did, for what is left of
    their life (they expire at the replica's ``expires_at``, and stop counting
    as pending prefill at its ``pending_until``). One the copy cannot record
    (its instance's lease ran out here first) is left out: it is advice, and
    gone at its expiry anyway."""
    ttl_s = p.expires_at - now
    if ttl_s <= 0:
        return
    iid = InstanceId(p.instance.worker_id, p.instance.dp_rank)
    with contextlib.suppress(KvmeshError):
        idx.predict_sync(
            Namespace(model, p.lora_name),
            iid,
            p.block_keys,
            ttl_s,
            p.max_per_instance or MAX_PREDICTED_PER_INSTANCE,
            pending_s=p.pending_until - now if p.pending_until else None,
        )


@dataclasses.dataclass(slots=True)
class _Parts:
    """An instance of a snapshot arriving in parts: what came so far."""

    instance: InstanceId
    position: int
    first: EventBatch
    events: list[Event]
    next: int


class _Gap(Exception):
    """The snapshot arrived broken: the stream is dropped and opened again."""


class _Narrowed(Exception):
    """The bound dropped a model: the stream is opened again for the others."""


class _Stalled(Exception):
    """The stream was silent past the bound: it is dropped and opened again."""


class _Diverged(Exception):
    """The copy could not apply a change: the stream is dropped and opened again."""
