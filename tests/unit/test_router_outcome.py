"""router_client turns a MatchResponse into a MatchOutcome: reused hits, same answer.

The conversion keeps the WorkerMatches it made and hands the same one out for
the same fields (a shared prefix's holders get the same hit Match after
Match). Checked against a plain conversion on random responses, through the
cache's clearing; and the check fails for a cache keyed by too little.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from router_client import indexer_client as ic
from router_client.indexer_client import MatchOutcome, MatchStatus, WorkerMatch

Hit = tuple[str, int, int, int, int, int, int, int]

_HIT = st.tuples(
    st.sampled_from(["w0", "w1", "w2", "a/b"]),
    st.integers(0, 3),  # dp rank
    st.integers(0, 40),  # depth
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(0, 700),  # tokens
    st.integers(0, 50),  # predicted depth
)


def _response(hits: list[Hit]) -> pb.MatchResponse:
    resp = pb.MatchResponse()
    for worker, rank, *fields in hits:
        m = resp.matches.add()
        m.instance.worker_id = worker
        m.instance.dp_rank = rank
        m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks, m.tokens, m.predicted_depth = fields
    return resp


def _plain(resp: pb.MatchResponse) -> MatchOutcome:
    """The conversion without reuse: a new WorkerMatch for every hit."""
    return MatchOutcome(
        MatchStatus.OK,
        {
            ic.instance_name(m.instance.worker_id, m.instance.dp_rank): WorkerMatch(
                m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks, m.tokens, m.predicted_depth
            )
            for m in resp.matches
        },
        None,
    )


def _keyed_by_depth(resp: pb.MatchResponse) -> MatchOutcome:
    """A broken model: hits reused by depth alone."""
    made: dict[int, WorkerMatch] = {}
    hits = {}
    for m in resp.matches:
        hit = made.setdefault(
            m.depth,
            WorkerMatch(
                m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks, m.tokens, m.predicted_depth
            ),
        )
        hits[ic.instance_name(m.instance.worker_id, m.instance.dp_rank)] = hit
    return MatchOutcome(MatchStatus.OK, hits, None)


def _agrees(convert: Callable[[pb.MatchResponse], MatchOutcome], rounds: list[list[Hit]]) -> None:
    for hits in rounds:
        resp = _response(hits)
        assert convert(resp) == _plain(resp)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_HIT, max_size=8), min_size=1, max_size=6))
def test_reused_hits_give_the_plain_answer(rounds: list[list[Hit]]) -> None:
    _agrees(ic.outcome_from_response, rounds)


def test_the_same_fields_give_the_same_hit_and_the_cache_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ic, "_HITS", {})
    monkeypatch.setattr(ic, "_HITS_MAX", 16)
    one = ic.outcome_from_response(_response([("w0", 0, 1, 1, 0, 0, 16, 0)]))
    two = ic.outcome_from_response(_response([("w1", 0, 1, 1, 0, 0, 16, 0)]))
    assert one.matches["w0"] is two.matches["w1"]
    rounds = [[("w0", 0, d, d, 0, 0, 16 * d, 0)] for d in range(100)]
    _agrees(ic.outcome_from_response, rounds)
    assert len(ic._HITS) <= 16


def test_the_check_catches_a_cache_keyed_by_too_little() -> None:
    with pytest.raises(AssertionError):
        _agrees(_keyed_by_depth, [[("w0", 0, 3, 3, 0, 0, 48, 0), ("w1", 1, 3, 1, 2, 0, 48, 0)]])
