"""``kvmesh bench peer``, tiny: real vLLM publishers into kvmesh's memory backend and into
Dynamo's standalone indexer, every answer checked.

The peer is included: its virtualenv (``ai-dynamo-runtime``, ``make peer-venvs``;
``make setup`` and ``make test`` create it) installs in about 15 to 30 s, and
the bench installs it itself on first use. The run takes 4 publishers in 2
processes, 200 trace requests at 64-token blocks and 150 sequential query
rounds; most of its time is the publishers importing vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lab.bench.peer import build_stream, cpu_calibration_ms, expected_answer, main, ratios
from lab.engines.vllm_publishers import engine_hashes, trace_tokens
from lab.traces import load_mooncake

#: Figures every side writes in this run.
FIGURES = (
    "ingest_blocks_per_s",
    "ingest_blocks_per_cpu_s",
    "rss_mb",
    "floor_p50_us",
    "match_tokens_p50_us",
    "match_tokens_p99_us",
    "match_keys_p50_us",
    "match_keys_p99_us",
    "ingest_probed_blocks_per_s",
    "match_during_ingest_p99_ms",
    "health_during_ingest_p99_ms",
)
WRONG = ("wrong_tokens", "wrong_keys", "wrong_during_ingest")


@pytest.mark.timeout(900)
def test_bench_peer_tiny(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "peer.json"
    args = ["--publishers", "4", "--publisher-procs", "2", "--requests", "200"]
    args += ["--queries", "150", "--prompts", "20", "--backend", "memory", "--block-size", "64"]
    assert main([*args, "--pin", "--json", str(out)]) == 0
    printed = capfd.readouterr().out
    assert "mem/dyn" in printed and "wrong answers, keys" in printed
    doc = json.loads(out.read_text())
    figures = doc["figures"]
    for side in ("dynamo", "memory"):
        for name in FIGURES:
            assert figures[f"peer_{side}_{name}"] > 0, (side, name)
        for name in WRONG:
            assert figures[f"peer_{side}_{name}"] == 0, (side, name)
        assert figures[f"peer_{side}_answers_checked"] >= 300
    assert figures["ratio_memory_match_keys_p50_us"] > 0
    for side in ("dynamo", "memory"):
        for suffix in ("", "_probed"):
            assert 0 <= figures[f"peer_{side}_kernel_cpu_share{suffix}"] <= 1, (side, suffix)
        for suffix in ("", "_probed"):
            assert figures[f"peer_{side}_page_faults_per_block_instance{suffix}"] >= 0
    assert "share in the kernel" in printed
    assert doc["params"]["free_page_reporting"] in (True, False, None)
    cal = doc["params"]["cpu_calibration_ms"]
    assert len(cal) == 2 and all(1 < c < 60_000 for c in cal), cal
    assert f"a fixed Python loop took {cal[0]} ms at the start" in printed
    mem = doc["params"]["memory_calibration_ms"]
    assert len(mem) == 2 and all(1 < c < 60_000 for c in mem), mem
    assert doc["params"]["block_size"] == 64 and doc["params"]["publishers"] == 4
    # --pin: each indexer under test alone on the first CPU, the publishers on the rest.
    cpus = sorted(os.sched_getaffinity(0))
    params = doc["params"]
    assert params["pin"] is True
    assert params["cpus_memory"] == params["cpus_dynamo"] == cpus[:1]
    assert params["cpus_publishers"] == cpus[1:]
    # Every thread of the bench (grpc's own too) off the indexer's CPU.
    assert params["cpus_bench_memory"] == params["cpus_bench_dynamo"] == cpus[1:]


def test_bench_peer_asks_a_query_replica_that_ingests_nothing(tmp_path: Path) -> None:
    out, logs = tmp_path / "peer.json", tmp_path / "logs"
    args = ["--publishers", "4", "--publisher-procs", "2", "--requests", "120", "--queries", "40"]
    args += ["--prompts", "10", "--backend", "redis", "--block-size", "64", "--peer", "none"]
    args += ["--duration", "2", "--query-replica", "--log-dir", str(logs)]
    assert main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    figures, params = doc["figures"], doc["params"]
    assert params["query_replica"] is True
    for name in WRONG:
        assert figures[f"peer_redis_{name}"] == 0, name
    assert figures["peer_redis_match_during_ingest_p50_ms"] > 0
    # The query replica subscribes to no engine; the other to every one.
    query = json.loads((logs / "indexer-redis-query.json").read_text())
    ingest = json.loads((logs / "indexer-redis.json").read_text())
    assert query["engine_events"]["endpoints"] == []
    assert len(ingest["engine_events"]["endpoints"]) == 2 * 4
    assert query["redis"] == ingest["redis"] and query["port"] != ingest["port"]
    # It answered the probes (and the sentinel's polls), and its CPU is counted.
    assert figures["peer_redis_query_replica_matches_probed"] >= 20
    assert figures["peer_redis_query_replica_cpu_s_probed"] > 0


def test_stream_and_reference_model() -> None:
    trace = load_mooncake(limit=300)
    stream = build_stream(trace, 4, 8, 16)
    # Every instance holds block 0 (the shared system prompt), each block once.
    assert all(trace[0].hash_ids[0] in held for held in stream.held)
    assert stream.pairs == 32 * sum(len(h) for h in stream.held)
    prompt = list(trace[0].hash_ids[:4])
    want = expected_answer(stream.held, prompt, 32)
    assert set(want) == {0, 1, 2, 3} and max(want.values()) == 32 * len(prompt)
    # Tokens and engine hashes are deterministic and distinct per (id, position).
    assert (trace_tokens([7]) == trace_tokens([7])).all()
    assert len(set(engine_hashes(range(100), 32))) == 3200
    figures = {"peer_dynamo_floor_p50_us": 100.0, "peer_memory_floor_p50_us": 250.0}
    assert ratios(figures, ["memory"]) == {"ratio_memory_floor_p50_us": 2.5}


def test_calibration_runs_where_asked_and_puts_the_affinity_back() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})
    try:
        ms = cpu_calibration_ms({cpus[-1]})
        assert os.sched_getaffinity(0) == {cpus[0]}
    finally:
        os.sched_setaffinity(0, set(cpus))
    assert 1 < ms < 60_000
