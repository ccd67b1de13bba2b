"""Synthesized trace families: the structure asked for, measured back from the trace's fields."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest

from kvmesh.cli import main as kvmesh_main
from lab.synth import FAMILIES, Family, burstiness, family, measure, synthesize, write_trace
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_mooncake

#: Chat whose every turn adds at least one full block, and whose conversations are
#: short beside the trace's window: its turns can be read back exactly.
EXACT = {
    "user_tokens_median": 700.0,
    "user_tokens_sigma": 0.0,
    "think_s_median": 1.0,
    "answer_ms_per_token": 1.0,
    "requests": 3000,
}


def _partition(labels: list[int]) -> list[list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, label in enumerate(labels):
        groups[label].append(i)
    return sorted(groups.values())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_is_well_formed_mooncake(name: str) -> None:
    fam = family(name, requests=1500)
    reqs = synthesize(fam, seed=1).requests
    assert len(reqs) == 1500
    assert reqs[0].timestamp == 0.0
    assert all(a.timestamp <= b.timestamp for a, b in itertools.pairwise(reqs))
    parent: dict[int, int | None] = {}
    next_new = 0
    for r in reqs:
        assert len(r.hash_ids) == -(-r.input_length // MOONCAKE_BLOCK_SIZE)
        assert 1 <= r.input_length <= fam.max_input_tokens and r.output_length >= 1
        for k, h in enumerate(r.hash_ids):
            before = r.hash_ids[k - 1] if k else None
            # chained by prefix: an id always follows the same id
            assert parent.setdefault(h, before) == before
            if h >= next_new:
                assert h == next_new  # new ids consecutive in order of first use
                next_new += 1


def test_same_seed_same_bytes_other_seed_other_trace(tmp_path: Path) -> None:
    fam = family("agent", requests=800)
    a, b, c = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz", tmp_path / "c.jsonl"
    write_trace(synthesize(fam, 7).requests, a)
    write_trace(synthesize(fam, 7).requests, b)
    write_trace(synthesize(fam, 8).requests, c)
    assert a.read_bytes() == b.read_bytes()
    assert load_mooncake(a) == synthesize(fam, 7).requests
    assert load_mooncake(c) != load_mooncake(a)
    first = json.loads(c.read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}


@pytest.mark.parametrize(("shared", "system"), [(1, 2), (5, 0), (3, 12)])
def test_shared_prefix_depth_is_what_was_asked(shared: int, system: int) -> None:
    fam = family("chat", shared_blocks=shared, system_blocks=system, requests=2000)
    m = measure(synthesize(fam, 0).requests)
    assert m.common_prefix_blocks == shared
    # a first prompt shares the platform prompt and its system prompt, no more
    assert m.shared_depth_p50 == shared + system


def test_agent_contexts_are_long_and_shared() -> None:
    agent = measure(synthesize(family("agent", requests=3000), 0).requests)
    rag = measure(synthesize(family("rag", requests=3000), 0).requests)
    assert agent.shared_depth_p50 == 2 + 24
    assert agent.input_tokens_p50 > 2 * rag.input_tokens_p50
    assert agent.reuse > 0.85 > rag.reuse


@pytest.mark.parametrize("turns", [1.0, 3.0, 8.0])
def test_conversations_and_turns_are_read_back(turns: float) -> None:
    synth = synthesize(family("chat", turns_mean=turns, **EXACT), 2)
    m = measure(synth.requests)
    assert _partition(m.conversation_of) == _partition(synth.session_of)
    assert m.turns_mean == pytest.approx(turns, rel=0.1)
    if turns == 1.0:
        assert m.single_turn_share == 1.0


def test_a_trace_without_chains_has_no_turns() -> None:
    """The measure sees turns only where the prompts say so: the same trace with
    every request's private blocks renamed reads as single requests."""
    reqs = synthesize(family("chat", **EXACT), 2).requests
    shared = family("chat").shared_blocks + family("chat").system_blocks
    fresh = iter(range(10**9, 2 * 10**9))
    broken = [
        TraceRequest(
            r.timestamp,
            r.input_length,
            r.output_length,
            r.hash_ids[:shared] + tuple(next(fresh) for _ in r.hash_ids[shared:]),
        )
        for r in reqs
    ]
    assert measure(reqs).turns_mean > 3
    assert measure(broken).turns_mean == 1.0


def test_rate_and_burstiness_are_what_was_asked() -> None:
    poisson = measure(synthesize(family("chat", rate=10.0, requests=4000), 0).requests)
    assert poisson.rate == pytest.approx(10.0, rel=0.1)
    assert abs(poisson.burstiness) < 0.1 and abs(poisson.start_burstiness) < 0.1
    starts = []
    for size in (1.0, 5.0, 20.0):
        fam = family("bursty", burst_size=size, requests=4000)
        starts.append(measure(synthesize(fam, 0).requests).start_burstiness)
    assert starts[0] < 0.1 < starts[1] < starts[2]
    assert starts[2] > 0.25


def test_burstiness_index() -> None:
    assert burstiness([1.0] * 10) == -1.0
    assert burstiness([0.0, 0.0, 0.0, 9.0]) > 0.2
    assert burstiness([]) == 0.0


def test_bad_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="turns_mean"):
        family("chat", turns_mean=0.5)
    with pytest.raises(ValueError, match="unknown"):
        family("chat", no_such_field=1)
    with pytest.raises(ValueError, match="unknown family"):
        family("nope")
    with pytest.raises(ValueError, match="documents_per_session"):
        Family(documents=2, documents_per_session=3).check()


def test_cli_writes_prints_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rag.jsonl"
    args = ["trace", "synth", "rag", "-o", str(out), "--requests", "300", "--seed", "3"]
    assert kvmesh_main(args) == 0
    printed = capsys.readouterr().out
    assert "conversations" in printed and "burstiness" in printed
    assert load_mooncake(out) == synthesize(family("rag", requests=300), 3).requests
    assert kvmesh_main(["trace", "synth", "chat", "--turns-mean", "6", "--print-spec"]) == 0
    assert json.loads(capsys.readouterr().out)["turns_mean"] == 6.0
    assert kvmesh_main(["trace", "synth", "--measure", str(out)]) == 0
    assert "300 requests" in capsys.readouterr().out
    assert kvmesh_main(["trace", "synth", "chat", "--turns-mean", "0.5", "-o", str(out)]) == 2
    assert kvmesh_main(["trace", "synth", "chat"]) == 2  # no -o
    with pytest.raises(SystemExit):
        kvmesh_main(["trace", "synth", "nope"])
