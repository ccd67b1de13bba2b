"""Property tests: random operation sequences against a backend and the naive model.

After every operation the backend and tests/contract/reference.py must agree
on the result and on the whole index content (dump). The same harness run with
each deliberately broken model in place of the reference must find a
counterexample, which shows the properties can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from indexer.memory import MemoryIndex
from indexer.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    IndexDump,
    InstanceId,
    InstanceSpec,
    Namespace,
    Tier,
)
from kvmesh.blockkeys import block_keys
from kvmesh.errors import KvmeshError
from tests.conftest import FakeClock
from tests.contract.reference import BROKEN, ReferenceIndex

BS = 2  # tokens per block: tiny, so random prompts share prefixes often
MODELS = ["m", "m2"]
WORKERS = [InstanceId("w0", 0), InstanceId("w0", 1), InstanceId("w1", 0)]

# Few prompts over a two-token alphabet: operations often hit the same chains.
prompts_st = st.lists(
    st.lists(st.integers(0, 1), min_size=BS, max_size=6 * BS), min_size=1, max_size=3
)
tier_st = st.sampled_from([Tier.GPU, Tier.CPU, Tier.DISK])
seq_delta_st = st.sampled_from([1, 1, 1, 1, 0, -1, 2, 3])
inst_st = st.sampled_from(WORKERS)

store_st = st.tuples(
    st.just("store"),
    st.integers(0, 4),  # prompt index
    st.integers(0, 5),  # first block
    st.integers(1, 6),  # block count
    st.sampled_from(["", "", "lora"]),
    tier_st,
    st.booleans(),  # precomputed keys instead of tokens
)
remove_st = st.tuples(
    st.just("remove"),
    st.integers(0, 4),
    st.lists(st.integers(0, 6), max_size=4),  # block indices (6+ are unknown hashes)
    st.one_of(st.none(), tier_st),
    st.sampled_from(["", "lora"]),
)


def _twice(spec: tuple[Any, ...]) -> bool:
    return spec[0] == "store" and spec[3] % 2 == 0


event_st = st.one_of(store_st, store_st, remove_st, st.tuples(st.just("clear")))
batch_st = st.tuples(
    st.just("batch"), inst_st, seq_delta_st, st.lists(event_st, min_size=1, max_size=3)
)
match_st = st.tuples(
    st.just("match"),
    st.integers(0, 4),
    st.sampled_from(MODELS),
    st.sampled_from(["", "lora"]),
    st.booleans(),  # include_stale
)
register_st = st.tuples(
    st.just("register"),
    inst_st,
    st.sampled_from(MODELS[:1] * 4 + MODELS[1:]),
    st.sampled_from(["a", "a", "a", "b"]),  # incarnation: "b" resets
)
# (weight, strategy): most operations are batches and matches.
_WEIGHTED_OPS = [
    (8, register_st),
    (35, batch_st),
    (25, match_st),
    (8, st.tuples(st.just("heartbeat"), inst_st)),
    (10, st.tuples(st.just("advance"), st.sampled_from([1.0, 5.0, 20.0, 40.0]))),
    (7, st.tuples(st.just("reap"))),
    (7, st.tuples(st.just("remove_instance"), inst_st)),
]


def _pick(n: int) -> st.SearchStrategy[tuple[Any, ...]]:
    for weight, strategy in _WEIGHTED_OPS:
        if n < weight:
            return strategy
        n -= weight
    raise AssertionError("weights out of range")


op_st = st.integers(0, sum(w for w, _ in _WEIGHTED_OPS) - 1).flatmap(_pick)
case_st = st.tuples(
    prompts_st, st.sampled_from([1 << 64, 5]), st.lists(op_st, min_size=10, max_size=60)
)


@dataclass
class Harness:
    """Drives one subject (async backend) and one reference with the same ops."""

    subject: Any
    ref: ReferenceIndex
    clock: FakeClock
    prompts: list[list[int]]
    hash_mod: int
    model_of: dict[InstanceId, str] = field(default_factory=dict)
    next_seq: dict[InstanceId, int] = field(default_factory=dict)

    def ehash(self, prompt: list[int], block: int) -> int:
        """The 'engine hash' of a prompt's block: content based, maybe colliding."""
        data = bytes(prompt[: (block + 1) * BS])
        return xxhash.xxh3_64_intdigest(data) % self.hash_mod

    def event(self, spec: tuple[Any, ...], iid: InstanceId) -> Any:
        kind = spec[0]
        if kind == "clear":
            return AllBlocksCleared()
        prompt = self.prompts[spec[1] % len(self.prompts)]
        n_blocks = len(prompt) // BS
        if kind == "remove":
            hashes = tuple(self.ehash(prompt, b) if b < n_blocks else 10**6 + b for b in spec[2])
            return BlockRemoved(hashes, spec[3])
        _, _, first, count, lora, tier, use_keys = spec
        first = min(first, n_blocks - 1)
        last = min(n_blocks, first + count)
        hashes = tuple(self.ehash(prompt, b) for b in range(first, last))
        parent = self.ehash(prompt, first - 1) if first else None
        if use_keys:
            model = self.model_of.get(iid, "m")
            keys = block_keys(prompt, BS, model, lora)[first:last]
            return BlockStored(hashes, parent, (), 0, lora, tier, tuple(keys))
        tokens = tuple(prompt[first * BS : last * BS])
        return BlockStored(hashes, parent, tokens, BS, lora, tier)

    async def call(self, name: str, *args: Any, **kw: Any) -> None:
        got: Any
        want: Any
        try:
            got = await getattr(self.subject, name)(*args, **kw)
        except KvmeshError as e:
            got = type(e)
        try:
            want = getattr(self.ref, name)(*args, **kw)
        except KvmeshError as e:
            want = type(e)
        if name in ("register", "heartbeat"):
            got, want = normalise_state(got), normalise_state(want)
        assert got == want, f"{name}{args}: backend {got!r} != model {want!r}"

    async def run(self, ops: list[tuple[Any, ...]]) -> None:
        # Every instance starts registered so that most batches take effect.
        preamble: list[tuple[Any, ...]] = [("register", iid, "m", "a") for iid in WORKERS]
        for op in preamble + ops:
            kind = op[0]
            if kind == "register":
                _, iid, model, inc = op
                self.model_of[iid] = model
                await self.call("register", InstanceSpec(iid, model, f"http://{iid}", 30.0, inc))
            elif kind == "batch":
                _, iid, delta, events = op
                seq = max(0, self.next_seq.get(iid, -1) + delta)
                self.next_seq[iid] = max(seq, self.next_seq.get(iid, -1))
                # w0/dp1 publishes as an engine stream (a store per physical copy):
                # a store of an even block count is of two physical copies.
                copies = iid == WORKERS[1]
                evs = tuple(
                    ev
                    for e in events
                    for ev in [self.event(e, iid)] * (2 if copies and _twice(e) else 1)
                )
                await self.call("apply", EventBatch(iid, seq, evs, counts_copies=copies))
            elif kind == "heartbeat":
                await self.call("heartbeat", op[1])
            elif kind == "advance":
                self.clock.advance(op[1])
            elif kind == "reap":
                await self.call("reap_expired")
            elif kind == "remove_instance":
                await self.call("remove_instance", op[1])
            elif kind == "match":
                # The drawn prompt and namespace, then every prompt of the pool
                # in the drawn namespace: more of the index is checked per op.
                _, p, model, lora, include_stale = op
                ns = Namespace(model, lora)
                first = self.prompts[p % len(self.prompts)]
                for prompt in [first, *self.prompts]:
                    keys = block_keys(prompt, BS, model, lora)
                    await self.call("match", ns, keys, include_stale=include_stale)
            got_dump = normalise_dump(await self.subject.dump())
            want_dump = normalise_dump(self.ref.dump())
            assert got_dump == want_dump, f"after {op}: dumps differ"


def normalise_state(s: Any) -> Any:
    if isinstance(s, tuple):
        return (normalise_state(s[0]), *s[1:])
    if hasattr(s, "lease_expires_at"):
        return (s.spec, round(s.lease_expires_at, 3), s.live, s.stale, s.applied_sequence, s.blocks)
    return s


def normalise_dump(d: IndexDump) -> Any:
    return (
        {ns: t for ns, t in d.blocks.items() if t},
        {i: e for i, e in d.engine_hashes.items() if e},
        {i: normalise_state(s) for i, s in d.instances.items()},
    )


class SyncAsAsync:
    """Presents a (possibly broken) reference model with the async interface."""

    def __init__(self, model: ReferenceIndex) -> None:
        self.model = model

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.model, name)

        async def call(*args: Any, **kw: Any) -> Any:
            return fn(*args, **kw)

        return call


def run_case(
    subject_factory: Callable[[FakeClock], Any], case: Any, ref_cls: type = ReferenceIndex
) -> None:
    prompts, hash_mod, ops = case
    clock = FakeClock()
    subject = subject_factory(clock)

    async def go() -> None:
        try:
            await Harness(subject, ref_cls(clock), clock, prompts, hash_mod).run(ops)
        finally:
            if hasattr(subject, "close"):
                await subject.close()

    asyncio.run(go())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=case_st)
def test_memory_backend_matches_reference(case: Any) -> None:
    run_case(lambda clock: MemoryIndex(clock=clock), case)


@pytest.fixture(scope="module")
def private_redis() -> Any:
    """A Redis of this module's own: every example dumps the index, and a dump
    SCANs the whole keyspace, which the session's Redis fills with what earlier
    tests left (the conformance runs' indexes made 200 examples take 117 s)."""
    from lab.redisproc import RedisProcess

    with RedisProcess() as proc:
        yield proc


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=case_st)
def test_redis_backend_matches_reference(case: Any, private_redis: Any) -> None:
    import uuid

    from indexer.redis.backend import RedisIndex

    run_case(
        lambda clock: RedisIndex(private_redis.url, prefix=f"p{uuid.uuid4().hex[:8]}", clock=clock),
        case,
    )


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=case_st)
def test_redis_backend_in_parts_matches_reference(case: Any, private_redis: Any) -> None:
    """Every batch of two blocks or more applied in parts of one block (a
    script each, KEYS.md "Apply in parts"): Redis keeps the contract."""
    run_case(_parts_of_one(private_redis), case)


def _parts_of_one(server: Any) -> Callable[[Any], Any]:
    import uuid

    from indexer.redis.backend import RedisIndex

    return lambda clock: RedisIndex(
        server.url, prefix=f"p{uuid.uuid4().hex[:8]}", clock=clock, apply_part_blocks=1
    )


def test_broken_parts_are_caught(private_redis: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts whose stored pieces restart their chains at the namespace seed
    must fail the harness."""
    from dataclasses import replace

    import indexer.redis.backend as backend

    real = backend.event_piece

    def broken(ev: Any, i: int, j: int) -> Any:
        piece = real(ev, i, j)
        return (
            replace(piece, parent_block_hash=None)
            if i and isinstance(piece, BlockStored)
            else piece
        )

    monkeypatch.setattr(backend, "event_piece", broken)
    find_counterexample(lambda case: run_case(_parts_of_one(private_redis), case), case_st, 500)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=case_st)
def test_redis_cluster_backend_in_parts_matches_reference(case: Any, redis_cluster: Any) -> None:
    """The same on a 3-master Cluster: each part a control-slot script and its
    data-node writes."""
    import uuid

    from indexer.redis.backend import RedisIndex

    run_case(
        lambda clock: RedisIndex(
            redis_cluster.url,
            prefix=f"p{uuid.uuid4().hex[:8]}",
            clock=clock,
            cluster=True,
            apply_part_blocks=1,
        ),
        case,
    )


@pytest.mark.parametrize("anchor_depth", [1, 2])
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=case_st)
def test_redis_cluster_backend_matches_reference(
    case: Any, anchor_depth: int, redis_cluster: Any
) -> None:
    """The cluster layout (shallow copies, anchor tags, split apply) keeps the contract."""
    import uuid

    from indexer.redis.backend import RedisIndex

    run_case(
        lambda clock: RedisIndex(
            redis_cluster.url,
            prefix=f"p{uuid.uuid4().hex[:8]}",
            clock=clock,
            cluster=True,
            anchor_depth=anchor_depth,
        ),
        case,
    )


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_broken_model_is_caught(bug: str) -> None:
    """The harness must tell a correct backend from each broken model."""
    assert_counterexample(BROKEN[bug])


def assert_counterexample(ref_cls: type = ReferenceIndex) -> None:
    """The memory backend against ``ref_cls`` must fail the harness within 3,000 cases."""
    find_counterexample(
        lambda case: run_case(lambda clock: MemoryIndex(clock=clock), case, ref_cls),
        case_st,
        3000,
    )


def find_counterexample(
    check: Callable[[Any], None], strategy: st.SearchStrategy[Any], cases: int
) -> None:
    """``check`` must fail (AssertionError) on one of ``cases`` cases drawn from
    ``strategy``: deterministic and without shrinking, only "is one found" matters."""

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def prop(case: Any) -> None:
        check(case)

    with pytest.raises(AssertionError):
        prop()


@contextlib.contextmanager
def sliced_applies(slices: Callable[..., Any] | None = None) -> Iterator[None]:
    """Every memory apply goes a block at a time, the loop getting a turn between slices."""
    import indexer.memory as memory
    from indexer.pacing import Pacer

    saved = memory.SLICE_WORK, memory.loop_pacer, memory.MemoryIndex._slices
    memory.SLICE_WORK = 1
    memory.loop_pacer = lambda: Pacer(0.0)  # type: ignore[assignment]
    if slices is not None:
        memory.MemoryIndex._slices = slices  # type: ignore[method-assign]
    try:
        yield
    finally:
        memory.SLICE_WORK, memory.loop_pacer, memory.MemoryIndex._slices = saved  # type: ignore[method-assign]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=case_st)
def test_memory_backend_sliced_matches_reference(case: Any) -> None:
    """Applied a slice at a time (as long batches are), the memory backend keeps the contract."""
    with sliced_applies():
        run_case(lambda clock: MemoryIndex(clock=clock), case)


@contextlib.contextmanager
def maps_copied_often(rebuilt: Callable[..., Any] | None = None) -> Iterator[None]:
    """The memory backend's maps copied without their tombstones as soon as
    they hold more deletions than entries (indexer/memory.py, "Tables"), most
    keys in one shard of each table so that a copy moves several entries."""
    import indexer.memory as memory

    names = ("REBUILD_MIN", "_rebuilt", "_SLOT_SHARD", "_SHARD_SLOTS")
    names += ("_HASH_SLOT_SHARD", "_HASH_SHARD_SLOTS")
    saved = {n: getattr(memory, n) for n in names}
    # The first slots keep naming each shard once (stats and dumps read them).
    slot_shard = tuple(range(memory.SHARDS)) + (0,) * (memory.SLOTS - memory.SHARDS)
    hash_shard = tuple(range(memory.HASH_SHARDS)) + (0,) * (memory.HASH_SLOTS - memory.HASH_SHARDS)
    memory.REBUILD_MIN = 1
    memory._SLOT_SHARD, memory._HASH_SLOT_SHARD = slot_shard, hash_shard
    memory._SHARD_SLOTS = memory._shard_slots(slot_shard, memory.SHARDS)
    memory._HASH_SHARD_SLOTS = memory._shard_slots(hash_shard, memory.HASH_SHARDS)
    if rebuilt is not None:
        memory._rebuilt = rebuilt  # type: ignore[assignment]
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(memory, n, v)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=case_st)
def test_memory_backend_with_maps_copied_often_matches_reference(case: Any) -> None:
    """Maps copied without their tombstones mid-batch keep the contract."""
    with maps_copied_often():
        run_case(lambda clock: MemoryIndex(clock=clock), case)


def test_a_copy_that_loses_an_entry_is_caught() -> None:
    from preshed.maps import PreshMap

    def lossy(old: Any, live: int) -> Any:
        new = PreshMap()
        for k, v in list(old.items())[1:]:
            new[k] = v
        return new

    with maps_copied_often(lossy):
        assert_counterexample()


def test_broken_slicing_is_caught() -> None:
    """A slicer that restarts each piece's chain at the namespace seed must fail the harness."""
    from dataclasses import replace

    real = MemoryIndex._slices

    def broken(self: MemoryIndex, inst: Any, ev: Any) -> Iterator[Any]:
        for piece in real(self, inst, ev):
            yield (
                replace(piece, parent_block_hash=None) if isinstance(piece, BlockStored) else piece
            )

    with sliced_applies(broken):
        assert_counterexample()


def _signature_violations(index: MemoryIndex) -> list[str]:
    """Shared blocks whose table entry is not the signature of their interned
    holder set, sets whose reference counts are not the blocks naming them,
    and sets no block names."""
    import functools
    import operator

    import indexer.memory as memory

    out = []
    named: dict[tuple[int, int], set[int]] = {}
    for ns, tables in index._blocks.items():
        nid = index._ns_ids[ns]
        for table in tables[: memory.SHARDS]:
            for mixed, entry in table.items():
                key = memory._unmixed(mixed)
                if entry < memory._SHARED:
                    continue
                named.setdefault((entry, nid), set()).add(key)
                held = index._sets.get(entry)
                if held is None or len(held) < 2:
                    out.append(f"{ns} {key}: shared entry, holders {held}")
                    continue
                sig = functools.reduce(
                    operator.xor, (memory._signature(n)[m] for n, m in held.items())
                )
                if entry != sig ^ memory._SHARED:
                    out.append(f"{ns} {key}: entry {entry}, holders' signature {sig}")
    members = {
        (sig, nid): set(keys)
        for sig, by_ns in index._members.items()
        for nid, keys in by_ns.items()
    }
    if members != named:
        out.append(f"set members {members}, blocks naming them {named}")
    if index._sets.keys() != index._members.keys():
        out.append(f"sets {sorted(index._sets)} but members of {sorted(index._members)}")
    return out


#: One long prompt that every worker stores runs of, on random tiers, and
#: drops blocks of: blocks move between holder sets that many blocks share.
_run_store_st = st.tuples(
    st.just("store"),
    st.just(0),
    st.one_of(st.just(0), st.just(0), st.integers(0, 11)),  # a run placed from its parent
    st.integers(1, 12),
    st.just(""),
    tier_st,
    st.booleans(),
)
_run_remove_st = st.tuples(
    st.just("remove"),
    st.just(0),
    st.lists(st.integers(0, 11), min_size=1, max_size=3),
    st.one_of(st.none(), tier_st),
    st.just(""),
)
_run_batch_st = st.tuples(
    st.just("batch"),
    inst_st,
    st.just(1),
    st.lists(st.one_of(_run_store_st, _run_store_st, _run_remove_st), min_size=1, max_size=3),
)
shared_runs_case_st = st.tuples(
    st.lists(
        st.lists(st.integers(0, 1), min_size=12 * BS, max_size=12 * BS), min_size=1, max_size=1
    ),
    st.just(1 << 64),
    st.lists(
        st.one_of(
            _run_batch_st,
            _run_batch_st,
            _run_batch_st,
            match_st,
            st.tuples(st.just("batch"), inst_st, st.just(1), st.just([("clear",)])),
        ),
        min_size=5,
        max_size=30,
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=shared_runs_case_st)
def test_memory_backend_shared_runs_match_reference(case: Any) -> None:
    """Holders joining and leaving runs of one long chain (sets shared by many
    blocks): the memory backend keeps the contract and the signature invariant."""
    test_shared_entries_are_their_holders_signatures.hypothesis.inner_test(case)  # type: ignore[attr-defined]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=case_st)
def test_shared_entries_are_their_holders_signatures(case: Any) -> None:
    """After any sequence, every shared block's entry is the signature of its
    interned holder set (Match walks a prefix held alike by comparing entries),
    and every set's members are exactly the blocks naming it."""
    made: list[MemoryIndex] = []

    def factory(clock: FakeClock) -> MemoryIndex:
        made.append(MemoryIndex(clock=clock))
        return made[-1]

    run_case(factory, case)
    assert _signature_violations(made[0]) == []


def _invariant_counterexample() -> None:
    """The signature invariant must fail within 500 shared-runs cases."""
    find_counterexample(
        test_shared_entries_are_their_holders_signatures.hypothesis.inner_test,  # type: ignore[attr-defined]
        shared_runs_case_st,
        500,
    )


def _match_through_a_shared_run(tier_of_w1_block2: Tier, drop_w1_block2: bool) -> Any:
    """w0, w1 and w2 store one 4-block chain on the GPU (w1's block 2 on
    ``tier_of_w1_block2``); w1 may then drop block 2, which w0 and w2 still
    share. Match's answer: instance -> (depth, GPU blocks, CPU blocks)."""
    tokens = list(range(4 * BS))
    hashes = [101, 102, 103, 104]

    async def go() -> Any:
        index = MemoryIndex(clock=FakeClock())
        for iid in (W0, W1, W2):
            await index.register(InstanceSpec(iid, "m", f"http://{iid}", 30.0, "a"))
        whole = (BlockStored(tuple(hashes), None, tuple(tokens), BS),)
        await index.apply(EventBatch(W0, 0, whole))
        await index.apply(EventBatch(W2, 0, whole))
        tiers = [Tier.GPU, Tier.GPU, tier_of_w1_block2, Tier.GPU]
        evs: list[Any] = []
        parent = None
        for i, tier in enumerate(tiers):
            chunk = tuple(tokens[i * BS : (i + 1) * BS])
            evs.append(BlockStored((hashes[i],), parent, chunk, BS, tier=tier))
            parent = hashes[i]
        if drop_w1_block2:
            evs.append(BlockRemoved((hashes[2],)))
        await index.apply(EventBatch(W1, 0, tuple(evs)))
        keys = block_keys(tokens, BS, "m", "")
        return {
            m.instance: (m.depth, m.gpu_blocks, m.cpu_blocks)
            for m in await index.match(Namespace("m"), keys)
        }

    return asyncio.run(go())


W0, W1, W2 = InstanceId("w0", 0), InstanceId("w1", 0), InstanceId("w2", 0)


def test_a_run_held_alike_is_walked_exactly() -> None:
    """The run scan stops where the holders differ: a dropped block or another tier."""
    full = (4, 4, 0)
    assert _match_through_a_shared_run(Tier.GPU, False) == {W0: full, W1: full, W2: full}
    assert _match_through_a_shared_run(Tier.GPU, True) == {W0: full, W1: (2, 2, 0), W2: full}
    assert _match_through_a_shared_run(Tier.CPU, False) == {W0: full, W1: (4, 3, 1), W2: full}


def test_a_set_changed_in_place_is_caught() -> None:
    """A holder set is shared by every block with those holders: a change made
    to it in place (not to a copy) must fail the invariant, and Match then
    answers for the other blocks of the set what one block's change said."""
    real = MemoryIndex._moved

    def in_place(
        self: MemoryIndex, nid: int, key: int, old: int, new: int, held: Any, no: int, mask: int
    ) -> int:
        if not old or new in self._sets:
            return real(self, nid, key, old, new, held, no, mask)
        if mask:
            held[no] = mask
        else:
            del held[no]
        self._sets[new] = held
        self._members[new] = {nid: {key: 1}}
        self._unref(nid, old, key)
        return new

    MemoryIndex._moved = in_place  # type: ignore[method-assign]
    try:
        _invariant_counterexample()
        with pytest.raises(AssertionError):
            test_a_run_held_alike_is_walked_exactly()
    finally:
        MemoryIndex._moved = real  # type: ignore[method-assign]


def test_a_signature_blind_to_tiers_is_caught() -> None:
    """Signatures that do not tell a holder's tiers apart: a block held on the
    CPU would count in a run held alike on the GPU."""
    import indexer.memory as memory

    real = memory._share

    def blind(no: int, mask: int) -> int:
        return real(no, 1)

    memory._share = blind  # type: ignore[assignment]
    try:
        with pytest.raises(AssertionError):
            test_a_run_held_alike_is_walked_exactly()
    finally:
        memory._share = real  # type: ignore[assignment]


def test_the_same_block_keys_in_two_namespaces_keep_their_own_sets() -> None:
    """A client giving block keys may give two namespaces the same ones (here
    two LoRA names of one model, so the same holders): each namespace's blocks
    are members of the holder set there, and a drop in one leaves the other's
    answers and the invariant whole."""
    keys = (11, 12, 13)

    async def go() -> tuple[Any, Any, MemoryIndex]:
        index = MemoryIndex(clock=FakeClock())
        for iid in (W0, W1):
            await index.register(InstanceSpec(iid, "m", f"http://{iid}", 30.0, "a"))
            evs = tuple(
                BlockStored(hashes, None, (), BS, lora, block_keys=keys, position_known=False)
                for hashes, lora in (((1, 2, 3), ""), ((4, 5, 6), "x"))
            )
            await index.apply(EventBatch(iid, 0, evs))
        await index.apply(EventBatch(W1, 1, (BlockRemoved((5,)),)))
        base = {x.instance: x.depth for x in await index.match(Namespace("m"), keys)}
        lora = {x.instance: x.depth for x in await index.match(Namespace("m", "x"), keys)}
        return base, lora, index

    base, lora, index = asyncio.run(go())
    assert base == {W0: 3, W1: 3}
    assert lora == {W0: 3, W1: 1}
    assert _signature_violations(index) == []
