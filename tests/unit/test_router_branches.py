"""A prompt's own part weighs ``private_weight`` in the "ttft" cost, its shared part
``prefill_weight``: the shared part ends after the deepest block key the prompts a
router saw continued in three or more ways (router_client.branches)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from router_client import MatchOutcome, MatchStatus, Router, RouteRequest, WorkerMatch, parse_config
from router_client.branches import FANOUT, PrefixBranches
from router_client.cost import predicted_ttft_s, predicted_ttft_split_s
from router_client.load import WorkerLoad
from tests.conftest import FakeClock

BS = 16


class NaiveBranches:
    """Reference: every prompt kept; a key's continuations recounted over all of them."""

    def __init__(self, fanout: int = FANOUT) -> None:
        self.prompts: list[list[int]] = []
        self.fanout = fanout

    def observe(self, keys: Sequence[int]) -> int:
        self.prompts.append(list(keys))
        shared = 0
        for i in range(len(keys) - 1):
            nexts = {p[j + 1] for p in self.prompts for j in range(len(p) - 1) if p[j] == keys[i]}
            if len(nexts) >= self.fanout:
                shared = i + 1
        return shared


# Prompts as chains over a small key space: shared roots, then branches, so keys
# repeat with several continuations (and a key may recur inside a chain).
prompts = st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=8), min_size=1, max_size=25)


# Prompts whose keys never repeat within a prompt (keys that name their prefix
# never do) take the tracker's walk in C, the others its key-at-a-time one.
distinct_prompts = st.lists(
    st.lists(st.integers(0, 12), min_size=0, max_size=8, unique=True), min_size=1, max_size=25
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(prompts, distinct_prompts))
def test_shared_part_matches_a_naive_recount(seq: list[list[int]]) -> None:
    tracker, naive = PrefixBranches(), NaiveBranches()
    for keys in seq:
        assert tracker.observe(keys) == naive.observe(keys)


@pytest.mark.parametrize("repeat", [False, True])
def test_continuations_carry_over_from_the_older_generation(repeat: bool) -> None:
    """Capacity 3: each prompt fills a generation, so every key is read back from
    the older one, and its continuations still add up to a shared key."""
    t = PrefixBranches(capacity=3)
    tail = [9, 8, 9] if repeat else []  # a repeated key: the key-at-a-time walk
    assert t.observe([1, 2, 3, 4, *tail]) == 0
    assert t._old and not t._new
    assert t.observe([1, 2, 3, 5, *tail]) == 0
    assert t.observe([1, 2, 3, 6, *tail]) == 3
    assert t.observe([1, 2, 3, 4]) == 3


def test_a_broken_model_fails_the_recount() -> None:
    """Two continuations making a key shared (every turn boundary of a conversation
    would) disagree with the reference: the property can tell."""
    broken, naive = PrefixBranches(fanout=2), NaiveBranches()
    answers = [(broken.observe(p), naive.observe(p)) for p in ([1, 2, 3], [1, 2, 4])]
    assert answers[0] == (0, 0)
    assert answers[1] == (2, 0)


def test_a_conversation_stays_private_and_a_document_becomes_shared() -> None:
    t = PrefixBranches()
    system = [1, 2]
    # One conversation, three turns: each turn continues the last one's last block
    # another way (its partial block filled), so a boundary branches in two only.
    assert t.observe([*system, 10, 11]) == 0
    assert t.observe([*system, 10, 12, 13]) == 0
    assert t.observe([*system, 10, 12, 14, 15]) == 0
    # A third conversation after the system prompt: it is shared, the rest is not.
    assert t.observe([*system, 20, 21]) == 0  # key 2 has 10, 20
    assert t.observe([*system, 30, 31]) == len(system)
    assert t.observe([*system, 10, 12, 14, 16]) == len(system)
    # A document many questions follow.
    doc = [*system, 40, 41, 42]
    for q in (50, 60, 70):
        got = t.observe([*doc, q, q + 1])
    assert got == len(doc)


def test_memory_is_bounded_and_a_hot_prefix_stays() -> None:
    t = PrefixBranches(capacity=64)
    hot = [1, 2, 3]
    for q in range(3):
        t.observe([*hot, 1000 + q])
    for i in range(2_000):
        chain = [100_000 + 10 * i + j for j in range(5)]
        assert len(t) <= 2 * 64 + len(hot) + len(chain)  # each generation: one prompt over
        # The hot prefix, seen with every request, keeps its continuations.
        assert t.observe([*hot, *chain]) == len(hot)
        t.observe(chain)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        PrefixBranches(capacity=0)
    with pytest.raises(ValueError, match="fanout"):
        PrefixBranches(fanout=1)


@given(
    st.floats(0, 1e5),
    st.integers(0, 4096),
    st.floats(0, 4096),
    st.floats(1, 1e5),
    st.floats(1, 10),
)
def test_one_weight_for_both_parts_is_the_plain_cost(
    pending: float, tokens: int, cached: float, rate: float, weight: float
) -> None:
    """The split cost is the plain one whatever the split when both weights agree,
    and never less with a heavier own part."""
    cached = min(cached, tokens)
    plain = predicted_ttft_s(pending, tokens - cached, rate, weight)
    for shared in (0, tokens // 3, tokens, tokens + 16):
        split = predicted_ttft_split_s(pending, tokens, cached, shared, rate, weight, weight)
        assert split == pytest.approx(plain, rel=1e-9, abs=1e-12)
        heavier = predicted_ttft_split_s(pending, tokens, cached, shared, rate, weight, weight * 2)
        assert heavier >= split - 1e-12


def make_router(config: dict[str, Any], workers: list[str], clock: FakeClock) -> Router:
    return Router(
        parse_config({"cost": "ttft", "prefill_tokens_per_s": 1000.0, **config}),
        workers=workers,
        block_size=BS,
        seed=1,
        clock=clock,
        registry=CollectorRegistry(),
    )


def _choose(r: Router, clock: FakeClock, keys: list[int]) -> str:
    """Route a 10-block prompt: worker a holds its first 8 blocks and has 300
    prefill tokens queued, worker b holds nothing and is idle."""
    r.load.report("a", WorkerLoad(pending_prefill_tokens=300), at=clock())
    r.load.report("b", WorkerLoad(), at=clock())
    req = RouteRequest("q", len(keys) * BS, block_keys=keys)
    matches = {"a": WorkerMatch(depth=8, gpu_blocks=8)}
    return r.decide(req, MatchOutcome(MatchStatus.OK, matches), decode=False).prefill.worker


def test_a_history_holds_its_worker_and_a_shared_prefix_is_replicated() -> None:
    clock = FakeClock(100.0)
    prompt = list(range(10))
    # The 8 cached blocks are the prompt's own (no prompt seen continues them
    # otherwise): 300 + 4 x 32 tokens on a against 4 x 160 on b.
    r = make_router({"private_weight": 4.0}, ["a", "b"], clock)
    assert _choose(r, clock, prompt) == "a"
    # One weight for the whole prompt (the cost before): 300 + 1.5 x 32 against
    # 1.5 x 160, so the history moves to b.
    flat = make_router({"private_weight": 1.5}, ["a", "b"], clock)
    assert flat.branches is None
    assert _choose(flat, clock, prompt) == "b"
    # The same cache and load, but the 8 blocks are a prefix three other prompts
    # continued: a shared prefix, weighed 1.5: 300 + 4 x 32 against 1.5 x 128 + 4 x 32.
    shared = make_router({"private_weight": 4.0}, ["a", "b"], clock)
    assert shared.branches is not None
    for tail in (100, 200, 300):
        shared.branches.observe([*prompt[:8], tail, tail + 1])
    assert _choose(shared, clock, prompt) == "b"


def test_prompt_blocks_are_counted_by_part() -> None:
    clock = FakeClock(100.0)
    counts = {}
    for private in (4.0, 1.5):
        registry = CollectorRegistry()
        r = Router(
            parse_config(
                {"cost": "ttft", "prefill_tokens_per_s": 1000.0, "private_weight": private}
            ),
            workers=["a", "b"],
            block_size=BS,
            seed=1,
            clock=clock,
            registry=registry,
        )
        for tail in (100, 200, 300):
            _choose(r, clock, [*range(8), tail, tail + 1])
        counts[private] = tuple(
            registry.get_sample_value("kvmesh_router_prompt_blocks_total", {"part": part})
            for part in ("shared", "own")
        )
    # The first two prompts: all 10 blocks their own; the third: 8 shared, 2 own.
    # With one weight the parts are not told apart, nor counted.
    assert counts == {4.0: (8.0, 22.0), 1.5: (None, None)}


async def test_token_ids_are_keyed_once_a_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys route() matched are the ones the tracker reads: a prompt given as
    token ids is hashed once, not again for its shared part."""
    import router_client.router as router_mod

    calls = []
    real = router_mod.compute_block_keys

    def counting(*args: Any, **kwargs: Any) -> list[int]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(router_mod, "compute_block_keys", counting)
    clock = FakeClock(100.0)
    r = make_router({"private_weight": 4.0}, ["a", "b"], clock)
    assert r.branches is not None
    req = RouteRequest("q", 10 * BS, token_ids=list(range(10 * BS)))
    await r.route(req, decode=False)
    assert len(calls) == 1
    assert len(r.branches) == 9  # the prompt's 10 keys, each but the last with its next
