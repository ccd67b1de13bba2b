"""The hand-written MatchResponse encoder against the protobuf runtime."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from indexer.convert import MatchResponseEncoder, match_result_to_pb
from indexer.model import InstanceId, InstanceMatch, MatchResult
from kvmesh.api.indexer.v1 import indexer_pb2 as pb

counts = st.integers(0, 70_000)
match_st = st.builds(
    InstanceMatch,
    instance=st.builds(InstanceId, st.text(min_size=1, max_size=20), st.integers(0, 2**32 - 1)),
    address=st.text(max_size=40),
    depth=counts,
    gpu_blocks=counts,
    cpu_blocks=counts,
    disk_blocks=counts,
    stale=st.booleans(),
    tokens=counts,
    predicted_depth=counts,
)
result_st = st.builds(
    MatchResult,
    matches=st.lists(match_st, max_size=20),
    total_blocks=counts,
    block_size=st.integers(0, 2**32 - 1),
    pending=st.none()
    | st.dictionaries(
        st.builds(InstanceId, st.text(min_size=1, max_size=20), st.integers(0, 2**32 - 1)),
        counts,
        max_size=8,
    ),
)


@given(result=result_st)
def test_encoder_writes_the_runtime_bytes(result: MatchResult) -> None:
    enc = MatchResponseEncoder()
    want = match_result_to_pb(result)
    got = enc.encode(result)
    assert pb.MatchResponse.FromString(got) == want
    assert got == want.SerializeToString(deterministic=True)
    assert enc.encode(result) == got  # second call is served from the caches


def test_caches_are_bounded() -> None:
    enc = MatchResponseEncoder()
    enc.MAX_CACHED = 4
    ms = [InstanceMatch(InstanceId(f"w{i}", 0), "a", 1, 1, 0, 0, False) for i in range(10)]
    for m in ms:
        enc.encode(MatchResult([m], 1, 0))
    assert len(enc._entries) <= 4 and len(enc._prefixes) <= 4
    res = MatchResult(ms, 1, 0)
    assert pb.MatchResponse.FromString(enc.encode(res)) == match_result_to_pb(res)
