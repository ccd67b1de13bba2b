"""Hybrid SGLang workers (FULL / SWA / Mamba components) on kv_indexer.v1, against a
naive reference of the prefix rule (indexer/sglang/components.py).

Workers with and without a WorkerCacheSpec report, re-report (a component
evicted), revoke and clear pages on every tier through a real in-process
indexer (memory backend, and a real redis-server); after each step every
worker's MatchExternalKvPrefix over random prompts must equal the reference's.
The reference keeps, per worker, the component mask of each (page, tier)
placement, as SGLang's own index does, and evaluates the rule by its
definition. Deliberately broken references (one rule left out each) must
disagree on the same streams, so the streams exercise every rule.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from indexer.memory import MemoryIndex
from indexer.redis.backend import RedisIndex
from indexer.sglang.components import (
    COMPONENT_FULL,
    COMPONENT_MAMBA,
    COMPONENT_SWA,
    CacheSpec,
    component_hash,
)
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2 as spb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2_grpc as spb_grpc
from tests.grpc.conftest import Harness, close_harness, expect_status, make_config, open_harness

PAGE = 4
TIERS = (spb.TIER_HBM, spb.TIER_DRAM, spb.TIER_SSD)
SERVABLE = {spb.TIER_HBM, spb.TIER_DRAM}
# Prompts share their first pages, then fork: pages are (chain, index) hashes.
CHAINS, PAGES = 3, 10


def page_hash(chain: int, i: int) -> int:
    """Signed 64-bit page hash (chains share their first two pages)."""
    c = 0 if i < 2 else chain
    h = (c * 1_000_003 + i * 7_919 + 1) * 0x9E3779B97F4A7C15 % (1 << 64)
    return h - (1 << 64) if h >= 1 << 63 else h


def spec_pb(s: CacheSpec) -> spb.WorkerCacheSpec:
    return spb.WorkerCacheSpec(
        version=s.version,
        components=s.components,
        swa_window_tokens=s.swa_window_tokens,
        full_tier_mask=s.full_tier_mask,
        swa_tier_mask=s.swa_tier_mask,
        mamba_tier_mask=s.mamba_tier_mask,
    )


# -- the reference ---------------------------------------------------------------------


@dataclass
class RefWorker:
    spec: CacheSpec | None
    place: dict[tuple[int, int], int] = field(default_factory=dict)  # (hash, tier) -> mask


Rule = Callable[[RefWorker, list[int]], int]


def available(w: RefWorker, h: int, bit: int, mask_of: Callable[[CacheSpec, int], int]) -> bool:
    assert w.spec is not None
    return any(
        w.place.get((h, t), 0) & bit and t in SERVABLE and mask_of(w.spec, bit) >> t & 1
        for t in TIERS
    )


def tier_mask(s: CacheSpec, bit: int) -> int:
    return {COMPONENT_FULL: s.full_tier_mask, COMPONENT_SWA: s.swa_tier_mask}.get(
        bit, s.mamba_tier_mask
    )


def reference(
    w: RefWorker,
    hashes: list[int],
    *,
    swa_rule: bool = True,
    mamba_rule: bool = True,
    tiers_rule: bool = True,
) -> int:
    """SGLang's prefix rule by its definition (the keyword flags break it for the
    sanity check)."""
    if w.spec is None:
        n = 0
        for h in hashes:
            if not any((h, t) in w.place for t in TIERS):
                break
            n += 1
        return n
    s = w.spec
    if (
        s.components == 0
        or s.version > 1
        or (s.components & COMPONENT_SWA and not s.swa_window_tokens)
    ):
        return 0
    mask_of = tier_mask if tiers_rule else (lambda _s, _b: 0b1110)
    best = 0
    for n in range(1, len(hashes) + 1):
        if not all(available(w, h, COMPONENT_FULL, mask_of) for h in hashes[:n]):
            break
        ok = True
        if s.components & COMPONENT_SWA and swa_rule:
            run, i = 0, n - 1
            while i >= 0 and available(w, hashes[i], COMPONENT_SWA, mask_of):
                run += PAGE
                i -= 1
            ok = run > 0 and (i < 0 or run >= s.swa_window_tokens)
        if s.components & COMPONENT_MAMBA and mamba_rule:
            ok = ok and available(w, hashes[n - 1], COMPONENT_MAMBA, mask_of)
        if ok:
            best = n
    return best


BROKEN: dict[str, Rule] = {
    "no SWA window rule": lambda w, h: reference(w, h, swa_rule=False),
    "no Mamba state rule": lambda w, h: reference(w, h, mamba_rule=False),
    "every tier servable": lambda w, h: reference(w, h, tiers_rule=False),
}


# -- the stream -------------------------------------------------------------------------


def random_spec(r: random.Random) -> CacheSpec | None:
    x = r.random()
    if x < 0.2:
        return None
    comps = COMPONENT_FULL | r.choice(
        (COMPONENT_SWA, COMPONENT_MAMBA, COMPONENT_SWA | COMPONENT_MAMBA)
    )
    if x > 0.95:
        comps = r.choice((0, COMPONENT_FULL | COMPONENT_SWA))  # unusable: no component / no window
        return CacheSpec(1, comps, 0, 6, 6, 6)
    masks = [r.choice((6, 2, 4, 14)) for _ in range(3)]
    return CacheSpec(r.choice((0, 1)), comps, r.choice((4, 8, 12)), *masks)


@dataclass
class Step:
    worker: str
    actions: list[spb.ExternalKvAction]
    spec: CacheSpec | None  # sent with the batch (None: not sent)


def random_step(r: random.Random, workers: dict[str, RefWorker]) -> Step:
    wid = r.choice(sorted(workers))
    w = workers[wid]
    spec = w.spec if r.random() < 0.95 else random_spec(r)
    actions = []
    for _ in range(r.randint(1, 3)):
        chain, lo = r.randrange(CHAINS), r.randrange(PAGES)
        hashes = [page_hash(chain, i) for i in range(lo, min(PAGES, lo + r.randint(1, 5)))]
        tier = r.choice((spb.TIER_HBM,) * 5 + (spb.TIER_DRAM,) * 3 + (spb.TIER_SSD,) * 2)
        kind = r.random()
        if kind < 0.7:
            a = spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=tier, hashes=hashes)
            if spec is not None:
                full = r.random() < 0.9
                a.component_masks.extend(
                    (COMPONENT_FULL if full or r.random() < 0.5 else 0)
                    | (spec.components & ~COMPONENT_FULL & r.choice((0, 2, 4, 6, 6, 6)))
                    for _ in hashes
                )
                if r.random() < 0.5:
                    a.block_sizes.extend(PAGE for _ in hashes)
            actions.append(a)
        elif kind < 0.95:
            actions.append(spb.ExternalKvAction(type=spb.ACTION_REVOKE, tier=tier, hashes=hashes))
        else:
            actions.append(spb.ExternalKvAction(type=spb.ACTION_CLEAR_ALL_AT_TIER, tier=tier))
    return Step(wid, actions, spec if spec != w.spec or r.random() < 0.3 else None)


def apply_ref(workers: dict[str, RefWorker], step: Step) -> None:
    w = workers[step.worker]
    if step.spec is not None and step.spec != w.spec:
        w.spec, w.place = step.spec, {}  # another layout resets the worker
    for a in step.actions:
        if a.type == spb.ACTION_CLEAR_ALL_AT_TIER:
            w.place.clear()  # the index clears a worker on every tier
        elif a.type == spb.ACTION_REVOKE:
            for h in a.hashes:
                w.place.pop((h, a.tier), None)
        else:
            masks = list(a.component_masks) or [0] * len(a.hashes)
            for h, m in zip(a.hashes, masks, strict=True):
                w.place[(h, a.tier)] = m


# -- the runs ---------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def sg(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    config = make_config(sglang={"page_size": PAGE})
    if request.param == "memory":
        index: Any = MemoryIndex()
    else:
        server = request.getfixturevalue("redis_server")
        index = RedisIndex(server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
    h: Harness = await open_harness(config, index)
    try:
        yield spb_grpc.KVIndexerStub(h.channel)
    finally:
        await close_harness(h)


async def prefixes(sg: Any, hashes: list[int]) -> dict[str, int]:
    resp = await sg.MatchExternalKvPrefix(spb.MatchExternalKvPrefixRequest(hashes=hashes))
    return {m.worker_id: m.matched_prefix_blocks for m in resp.matches}


def expected(workers: dict[str, RefWorker], hashes: list[int], rule: Rule) -> dict[str, int]:
    out = {wid: rule(w, hashes) for wid, w in workers.items()}
    return {wid: n for wid, n in out.items() if n}


@pytest.mark.parametrize("seed", range(4))
async def test_prefixes_follow_the_component_rule(sg: Any, seed: int) -> None:
    r = random.Random(seed)
    # One worker of each layout to begin with, each serving some component from
    # one tier only (later steps may change them).
    layouts = [
        (COMPONENT_SWA, (6, 2, 6)),
        (COMPONENT_MAMBA, (2, 6, 4)),
        (COMPONENT_SWA | COMPONENT_MAMBA, (6, 4, 2)),
    ]
    workers = {"w0": RefWorker(None)}
    for i, (extra, masks) in enumerate(layouts, 1):
        spec = CacheSpec(1, COMPONENT_FULL | extra, r.choice((8, 12)), *masks)
        workers[f"w{i}"] = RefWorker(spec)
    seqs = dict.fromkeys(workers, 0)
    for wid, w in workers.items():  # every worker announces its layout first
        hello = spb.ApplyExternalKvBatchRequest(
            worker_id=wid, seq=0, worker_address=f"http://{wid}:30000"
        )
        if w.spec is not None:
            hello.cache_spec.CopyFrom(spec_pb(w.spec))
        await sg.ApplyExternalKvBatch(hello)
        seqs[wid] = 1
    disagreed = dict.fromkeys(BROKEN, 0)
    for _ in range(80):
        step = random_step(r, workers)
        req = spb.ApplyExternalKvBatchRequest(
            worker_id=step.worker,
            seq=seqs[step.worker],
            actions=step.actions,
            worker_address=f"http://{step.worker}:30000",
        )
        if step.spec is not None:
            req.cache_spec.CopyFrom(spec_pb(step.spec))
        await sg.ApplyExternalKvBatch(req)
        seqs[step.worker] += 1
        apply_ref(workers, step)
        for chain in range(CHAINS):
            hashes = [page_hash(chain, i) for i in range(r.randint(1, PAGES))]
            got = await prefixes(sg, hashes)
            assert got == expected(workers, hashes, reference), (step, chain, hashes)
            for name, broken in BROKEN.items():
                disagreed[name] += got != expected(workers, hashes, broken)
    # Each broken reference must have been caught by these streams.
    assert all(disagreed.values()), disagreed


async def test_an_evicted_component_cuts_the_prefix_and_others_are_unaffected(sg: Any) -> None:
    spec = CacheSpec(1, COMPONENT_FULL | COMPONENT_SWA | COMPONENT_MAMBA, 8, 6, 6, 6)
    hashes = [page_hash(1, i) for i in range(6)]
    all3 = COMPONENT_FULL | COMPONENT_SWA | COMPONENT_MAMBA
    report = spb.ExternalKvAction(
        type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=hashes, component_masks=[all3] * 6
    )
    await sg.ApplyExternalKvBatch(
        spb.ApplyExternalKvBatchRequest(
            worker_id="h",
            seq=0,
            actions=[report],
            worker_address="http://h:1",
            cache_spec=spec_pb(spec),
        )
    )
    legacy = spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=hashes)
    await sg.ApplyExternalKvBatch(
        spb.ApplyExternalKvBatchRequest(
            worker_id="l", seq=0, actions=[legacy], worker_address="http://l:1"
        )
    )
    assert await prefixes(sg, hashes) == {"h": 6, "l": 6}
    # The engine evicts the Mamba state of the last two pages and SWA of page 3.
    masks = [all3, all3, all3, COMPONENT_FULL | COMPONENT_MAMBA, COMPONENT_FULL | COMPONENT_SWA]
    masks.append(COMPONENT_FULL | COMPONENT_SWA)
    again = spb.ExternalKvAction(
        type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=hashes, component_masks=masks
    )
    await sg.ApplyExternalKvBatch(
        spb.ApplyExternalKvBatchRequest(
            worker_id="h", seq=1, actions=[again], worker_address="http://h:1"
        )
    )
    # Page 3 lacks SWA: no boundary at 4..6 has a window of SWA (8 tokens) ending
    # there with a Mamba state; page 2 (boundary 3) has both.
    assert await prefixes(sg, hashes) == {"h": 3, "l": 6}
    each = await sg.MatchExternalKv(spb.MatchExternalKvRequest(hashes=hashes[3:4]))
    rows = {m.worker_id: list(m.hashes_by_tier) for m in each.matches}
    assert [list(t.component_masks) for t in rows["h"]] == [[COMPONENT_FULL | COMPONENT_MAMBA]]
    assert [list(t.block_sizes) for t in rows["h"]] == [[PAGE]]
    assert [list(t.component_masks) for t in rows["l"]] == [[]]  # a legacy answer stays as it was


async def test_components_without_a_spec_and_wrong_page_sizes_are_refused(sg: Any) -> None:
    hashes = [page_hash(0, i) for i in range(3)]
    bad = spb.ExternalKvAction(
        type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=hashes, component_masks=[1, 1, 1]
    )
    err = await expect_status(
        sg.ApplyExternalKvBatch(
            spb.ApplyExternalKvBatchRequest(
                worker_id="x", seq=0, actions=[bad], worker_address="http://x:1"
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "actions[0].component_masks" in (err.details() or "")
    spec = spec_pb(CacheSpec(1, COMPONENT_FULL | COMPONENT_SWA, 8, 6, 6, 6))
    sized = spb.ExternalKvAction(
        type=spb.ACTION_REPORT,
        tier=spb.TIER_HBM,
        hashes=hashes,
        component_masks=[3, 3, 3],
        block_sizes=[PAGE, PAGE * 4, PAGE],
    )
    err = await expect_status(
        sg.ApplyExternalKvBatch(
            spb.ApplyExternalKvBatchRequest(
                worker_id="x", seq=1, actions=[sized], worker_address="http://x:1", cache_spec=spec
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "actions[0].block_sizes[1]" in (err.details() or "")
    short = spb.ExternalKvAction(
        type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=hashes, component_masks=[3]
    )
    err = await expect_status(
        sg.ApplyExternalKvBatch(
            spb.ApplyExternalKvBatchRequest(
                worker_id="x", seq=1, actions=[short], worker_address="http://x:1", cache_spec=spec
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "actions[0].component_masks" in (err.details() or "")
    # Nothing of the refused batches was applied; the service still answers.
    assert await prefixes(sg, hashes) == {}


def test_component_hashes_differ_from_pages_and_each_other() -> None:
    for h in (0, 1, (1 << 64) - 1, 0x9E3779B97F4A7C15):
        derived = {component_hash(h, b) for b in (COMPONENT_FULL, COMPONENT_SWA, COMPONENT_MAMBA)}
        assert len(derived) == 3 and h not in derived
