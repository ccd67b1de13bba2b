"""The harness catches deliberately broken backends, and shrinks what it finds.

Each variant of ``broken.py`` breaks one rule of indexer/CONSISTENCY.md; the
round that catches it is the CI's memory-backend ``core`` round
(``test_ci.py``), which the unbroken backend passes.
"""

from __future__ import annotations

import pytest

from indexer.index import Index
from lab.faults.driver import RunParams, format_round, run_round, shrink
from lab.faults.faults import Target
from tests.faults.broken import BROKEN, ListsTwice

#: The CI round the unbroken memory backend passes (tests/faults/test_ci.py).
SEED, PROFILE, OPS = 8, "core", 400


@pytest.mark.parametrize("bug", sorted(BROKEN))
async def test_broken_backend_is_caught(bug: str, memory: Target) -> None:
    wrapper, caught_by = BROKEN[bug]

    def wrap(index: Index, replica: int) -> Index:
        return wrapper(index)

    res = await run_round(memory, RunParams(seed=SEED, profile=PROFILE, ops=OPS, wrap=wrap))
    assert res.violations, f"{bug}: {res.operations} operations and no violation"
    assert res.violations[0].invariant in caught_by, format_round(res)


async def test_unbroken_backend_passes_the_same_round(memory: Target) -> None:
    res = await run_round(memory, RunParams(seed=SEED, profile=PROFILE, ops=OPS))
    assert not res.violations, format_round(res)
    assert res.operations == OPS


async def test_a_violation_shrinks_to_a_replayable_minimal_sequence(memory: Target) -> None:
    def wrap(index: Index, replica: int) -> Index:
        return ListsTwice(index)

    p = RunParams(seed=SEED, profile=PROFILE, ops=OPS, wrap=wrap)
    res = await run_round(memory, p)
    assert res.violations and len(res.ran) > 3
    small = await shrink(memory, res, budget_s=20.0)
    assert small.violations[0].invariant == "listed_twice"
    # A Match naming two holders needs a registration, a batch and the Match:
    # nothing else may be left.
    assert len(small.ran) <= 3, format_round(small)
    keep = tuple(i for i, _ in small.ran)
    again = await run_round(
        memory, RunParams(seed=SEED, profile=PROFILE, ops=OPS, keep=keep, wrap=wrap)
    )
    assert [i for i, _ in again.ran] == list(keep)
    assert again.violations and again.violations[0].invariant == "listed_twice"
    assert "--keep " + ",".join(map(str, keep)) in format_round(again)
