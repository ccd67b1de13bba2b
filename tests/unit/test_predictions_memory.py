"""Route-time predictions on the memory backend, against a naive reference.

A Hypothesis state machine drives random sequences of predict, store,
remove, clear, reset, remove-instance, clock steps and Matches on a
:class:`MemoryIndex` in virtual time, and a plain model of the semantics
(indexer/index.py, "Predictions") beside it: every Match's ``depth`` (and
tiers) must be those of the Match without predictions, and every
``predicted_depth`` (and the set of instances returned) the reference's,
and the pending prefill (each prediction counted until it expires, is
confirmed, or its pending deadline passes) the reference's. Broken variants
(one that ignores expiry, one that keeps an instance's predictions through a
clear, one that ignores pending deadlines, one that keeps a key's older
deadline when it is predicted again) must fail the same machine.
"""

from __future__ import annotations

import asyncio
import heapq
import timeit
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from indexer.memory import MemoryIndex, _Instance
from indexer.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
)
from kvmesh.errors import FailedPrecondition, NotFound

NS = Namespace("m")
WORKERS = [InstanceId("w0"), InstanceId("w1"), InstanceId("w2", 1)]
KEYS = [11, 12, 13, 14, 15, 16]
CAP = 5
LEASE_S = 1000.0

keys_st = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6)
worker_st = st.sampled_from(WORKERS)


_LOOP = asyncio.new_event_loop()


def run(coro):  # type: ignore[no-untyped-def]
    """Run ``coro`` on one loop for the module (the memory backend never waits)."""
    return _LOOP.run_until_complete(coro)


class Reference:
    """The semantics, held the plainest way: held keys and predictions per instance."""

    def __init__(self) -> None:
        self.held: dict[InstanceId, set[int]] = {w: set() for w in WORKERS}
        # instance -> {key: expiry}, oldest recorded first
        self.pred: dict[InstanceId, dict[int, float]] = {w: {} for w in WORKERS}
        # instance -> {key: when it stops counting as pending} (absent: never)
        self.until: dict[InstanceId, dict[int, float]] = {w: {} for w in WORKERS}

    def predict(
        self,
        w: InstanceId,
        keys: Sequence[int],
        expiry: float,
        now: float,
        until: float | None = None,
    ) -> int:
        for p in self.pred.values():
            for k in [k for k, e in p.items() if e <= now]:
                del p[k]
        mine = self.pred[w]
        n = 0
        for k in keys:
            if k in self.held[w]:
                continue
            mine.pop(k, None)
            mine[k] = expiry
            if until is None:
                self.until[w].pop(k, None)
            else:
                self.until[w][k] = until
            n += 1
        while len(mine) > CAP:
            del mine[next(iter(mine))]
        return n

    def store(self, w: InstanceId, keys: Sequence[int]) -> None:
        self.held[w].update(keys)
        for k in keys:
            self.pred[w].pop(k, None)

    def remove(self, w: InstanceId, keys: Sequence[int]) -> None:
        # The test's engine hashes are the keys; a hash the instance never
        # stored names no block (ignored), one it holds drops the block and
        # any prediction of it.
        for k in keys:
            if k in self.held[w]:
                self.held[w].discard(k)
                self.pred[w].pop(k, None)

    def clear(self, w: InstanceId) -> None:
        self.held[w] = set()
        self.pred[w] = {}

    def pending(self, now: float) -> dict[InstanceId, int]:
        """Unexpired predictions per instance whose pending deadline has not
        passed (none: left out)."""
        out = {
            w: sum(e > now and self.until[w].get(k, e) > now for k, e in self.pred[w].items())
            for w in WORKERS
        }
        return {w: n for w, n in out.items() if n}

    def predicted(self, keys: Sequence[int], now: float) -> dict[InstanceId, int]:
        out = {}
        for w in WORKERS:
            d = 0
            while d < len(keys) and (
                keys[d] in self.held[w] or self.pred[w].get(keys[d], -1.0) > now
            ):
                d += 1
            if d:
                out[w] = d
        return out


class PredictionMachine(RuleBasedStateMachine):
    """The memory backend against :class:`Reference`, in virtual time."""

    index_class: type[MemoryIndex] = MemoryIndex

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.index = self.index_class(clock=lambda: self.now)
        self.ref = Reference()
        self.seq = dict.fromkeys(WORKERS, 0)
        self.resets = 0
        for w in WORKERS:
            run(self.index.register(InstanceSpec(w, NS.model, f"addr-{w}", LEASE_S, "a")))

    def _apply(self, w: InstanceId, *events: object) -> None:
        self.seq[w] += 1
        run(self.index.apply(EventBatch(w, self.seq[w], tuple(events))))  # type: ignore[arg-type]

    @rule(
        w=worker_st,
        keys=keys_st,
        ttl=st.sampled_from([0.5, 1.0, 2.0]),
        pending=st.sampled_from([None, None, 0.0, 0.25, 0.5, 1.0]),
    )
    def predict(self, w: InstanceId, keys: list[int], ttl: float, pending: float | None) -> None:
        n = self.index.predict_sync(NS, w, keys, ttl, CAP, pending_s=pending)
        until = None if pending is None else self.now + pending
        assert n == self.ref.predict(w, keys, self.now + ttl, self.now, until)

    @rule(w=worker_st, keys=keys_st)
    def store(self, w: InstanceId, keys: list[int]) -> None:
        ks = tuple(dict.fromkeys(keys))
        self._apply(w, BlockStored(block_hashes=ks, block_keys=ks))
        self.ref.store(w, ks)

    @rule(w=worker_st, keys=keys_st)
    def remove(self, w: InstanceId, keys: list[int]) -> None:
        self._apply(w, BlockRemoved(block_hashes=tuple(keys)))
        self.ref.remove(w, keys)

    @rule(w=worker_st)
    def clear(self, w: InstanceId) -> None:
        self._apply(w, AllBlocksCleared())
        self.ref.clear(w)

    @rule(w=worker_st)
    def reset(self, w: InstanceId) -> None:
        self.seq[w] = 0
        self.resets += 1
        run(self.index.register(InstanceSpec(w, NS.model, f"addr-{w}", LEASE_S, f"i{self.resets}")))
        self.ref.clear(w)

    @rule(w=worker_st)
    def remove_instance(self, w: InstanceId) -> None:
        run(self.index.remove_instance(w))
        self.seq[w] = 0
        run(self.index.register(InstanceSpec(w, NS.model, f"addr-{w}", LEASE_S, "a")))
        self.ref.clear(w)

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(keys=keys_st)
    def match(self, keys: list[int]) -> None:
        plain = self.index.match_sync(NS, keys)
        got = self.index.match_sync(NS, keys, include_predicted=True)
        want = self.ref.predicted(keys, self.now)
        assert {m.instance: m.predicted_depth for m in got} == want
        confirmed = {m.instance: m for m in got if m.depth}
        assert confirmed == {
            m.instance: m._replace(predicted_depth=want[m.instance]) for m in plain
        }
        for m in got:
            assert m.predicted_depth >= m.depth
            if not m.depth:
                assert (m.gpu_blocks, m.cpu_blocks, m.disk_blocks) == (0, 0, 0)
        order = [(-m.depth, -m.predicted_depth, m.instance) for m in got]
        assert order == sorted(order)

    @rule()
    def pending(self) -> None:
        # The prefill every router sent and no engine confirmed (MatchResponse.pending).
        assert self.index.pending_predicted_sync(NS.model) == self.ref.pending(self.now)
        assert self.index.pending_predicted_sync("another-model") == {}

    @invariant()
    def bounded(self) -> None:
        for inst in self.index._instances.values():
            assert len(inst.predicted or ()) <= CAP


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
#: A broken variant only has to fail: no shrinking of its counterexample, and
#: the same draws every run (a random search missed _IgnoresExpiry once in 200;
#: the draws of a derandomized search differ with the code under test, and 200
#: of them missed _KeepsOldDeadline once: up to 1,000, a caught variant stops early).
BROKEN_SETTINGS = settings(SETTINGS, max_examples=1000, phases=[Phase.generate], derandomize=True)


def test_memory_predictions_match_the_reference() -> None:
    run_state_machine_as_test(PredictionMachine, settings=SETTINGS)


class _IgnoresExpiry(MemoryIndex):
    """Broken: a prediction never expires."""

    def _purge_predictions(self, now: float, budget: int = 0) -> None:
        return None

    def _match_predicted(self, namespace, keys, include_stale):  # type: ignore[no-untyped-def]
        real = self._clock
        self._clock = lambda: float("-inf")
        try:
            return super()._match_predicted(namespace, keys, include_stale)
        finally:
            self._clock = real


class _KeepsThroughClear(MemoryIndex):
    """Broken: a clear, reset or removal leaves the instance's predictions."""

    def _drop_predictions(self, inst: _Instance) -> None:
        return None


class _StoreKeepsPredictions(MemoryIndex):
    """Broken: a store leaves the instance's predictions of what it stored
    (every Match stays right: a held block counts, predicted or not; only the
    pending prefill counts work the engine has finished)."""

    def _confirm(self, inst: _Instance, base: int, keys: Sequence[int]) -> None:
        return None


class _PendingWhilePredicted(MemoryIndex):
    """Broken: a prediction counts as pending prefill until it expires or is
    confirmed, whatever its pending deadline."""

    def predict_sync(self, *args, pending_s=None, **kw):  # type: ignore[no-untyped-def]
        return super().predict_sync(*args, **kw)


class _KeepsOldDeadline(MemoryIndex):
    """Broken: a key predicted again keeps the pending deadline it had."""

    def predict_sync(self, namespace, instance, keys, ttl_s, cap=CAP, pending_s=None):  # type: ignore[no-untyped-def]
        inst = self._instances.get(instance)
        old = dict(inst.pend_until or {}) if inst is not None else {}
        n = super().predict_sync(namespace, instance, keys, ttl_s, cap, pending_s)
        if inst is not None and inst.pend_until is not None and old:
            base = self._ns_id(namespace) << 64
            for k in keys:
                when = old.get(base | k)
                if when is not None and inst.predicted and base | k in inst.predicted:
                    inst.pend_until[base | k] = when
                    assert inst.pend_heap is not None
                    heapq.heappush(inst.pend_heap, (when, base | k))
        return n


@pytest.mark.parametrize(
    "broken",
    [
        _IgnoresExpiry,
        _KeepsThroughClear,
        _StoreKeepsPredictions,
        _PendingWhilePredicted,
        _KeepsOldDeadline,
    ],
)
def test_broken_variants_fail(broken: type[MemoryIndex]) -> None:
    machine = type(f"Broken{broken.__name__}", (PredictionMachine,), {"index_class": broken})
    # A wrong answer, or (predictions of a removed instance kept) a look-up of it.
    with pytest.raises((AssertionError, KeyError)):
        run_state_machine_as_test(machine, settings=BROKEN_SETTINGS)


# -- the plain cases -----------------------------------------------------------


def _index() -> tuple[MemoryIndex, list[float]]:
    t = [100.0]
    index = MemoryIndex(clock=lambda: t[0])
    run(index.register(InstanceSpec(WORKERS[0], "m", "a0", 30.0)))
    run(index.register(InstanceSpec(WORKERS[1], "m", "a1", 30.0)))
    return index, t


def test_predicted_only_instance_and_expiry() -> None:
    index, t = _index()
    ks = (1, 2)
    run(index.apply(EventBatch(WORKERS[0], 1, (BlockStored(block_hashes=ks, block_keys=ks),))))
    assert index.predict_sync(NS, WORKERS[1], [1, 2, 3], 2.0) == 3
    assert index.predict_sync(NS, WORKERS[0], [1, 2, 3], 2.0) == 1  # 1 and 2 are held
    got = index.match_sync(NS, [1, 2, 3, 4], include_predicted=True)
    assert [(m.instance, m.depth, m.predicted_depth) for m in got] == [
        (WORKERS[0], 2, 3),
        (WORKERS[1], 0, 3),
    ]
    assert [m.predicted_depth for m in index.match_sync(NS, [1, 2, 3, 4])] == [0]
    assert run(index.stats()).predicted_blocks == 4
    t[0] += 2.0
    got = index.match_sync(NS, [1, 2, 3], include_predicted=True)
    assert [(m.instance, m.depth, m.predicted_depth) for m in got] == [(WORKERS[0], 2, 2)]
    assert run(index.stats()).predicted_blocks == 0


def test_not_live_and_other_model_are_refused() -> None:
    index, t = _index()
    with pytest.raises(NotFound):
        index.predict_sync(NS, InstanceId("nobody"), [1], 1.0)
    with pytest.raises(FailedPrecondition) as err:
        index.predict_sync(Namespace("other"), WORKERS[0], [1], 1.0)
    assert err.value.field == "model"
    t[0] += 31.0  # lease over
    with pytest.raises(NotFound):
        index.predict_sync(NS, WORKERS[0], [1], 1.0)


def test_match_cost_does_not_grow_with_expired_predictions() -> None:
    """Expired predictions are purged a bounded amount a call and never walked."""
    index, t = _index()
    for i in range(20):
        index.predict_sync(NS, WORKERS[1], range(1000 + 1000 * i, 2000 + 1000 * i), 1.0)
    t[0] += 5.0
    keys = list(range(10**6, 10**6 + 32))
    index.match_sync(NS, keys, include_predicted=True)  # purges at most one budget
    for _ in range(10):
        index.match_sync(NS, keys, include_predicted=True)
    assert not index._pred_heap and index._pred_count == 0
    cost = min(
        timeit.repeat(
            lambda: index.match_sync(NS, keys, include_predicted=True), number=200, repeat=3
        )
    )
    assert cost / 200 < 1e-3


def test_pending_deadlines_come_due_without_a_read() -> None:
    """A router that predicts and never reads the pending figure: the deadlines
    come due at its predictions, so what the index keeps for them is one
    pending window's, not every prediction's."""
    index, t = _index()
    for i in range(2000):
        t[0] += 0.01
        index.predict_sync(NS, WORKERS[0], [i % 50], 10.0, pending_s=0.05)
    inst = index._instances[WORKERS[0]]
    assert inst.pend_heap is not None and len(inst.pend_heap) <= 10
    assert index.pending_predicted_sync(NS.model) == {WORKERS[0]: 5}
