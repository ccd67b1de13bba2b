"""A router wired to a tee: routed prompts reach a real HTTP sink with their worker."""

from __future__ import annotations

import asyncio

from lab.bench.testsink import TestSink
from router_client import Router, RouteRequest
from tee.hooks import routed_request_hook
from tee.logic import Tee
from tee.sinks import HttpSink


async def test_routed_prompts_are_teed_with_the_prefill_worker() -> None:
    sink = await TestSink().start()
    tee = await Tee([HttpSink(sink.url)], concurrency=4).start()
    router = Router(workers=["w0", "w1", "w2"], seed=1, on_decision=routed_request_hook(tee, "m"))
    try:
        chosen = {}
        for i in range(6):
            req = RouteRequest(
                request_id=f"r{i}", input_tokens=32, token_ids=list(range(i, i + 32))
            )
            decision = await router.route(req)
            chosen[f"r{i}"] = decision.prefill.worker
        # a request routed by keys alone has no tokens to tee
        await router.route(RouteRequest(request_id="keys", input_tokens=32, block_keys=[1, 2]))
        for _ in range(200):
            if len(sink.received) >= 6:
                break
            await asyncio.sleep(0.01)
    finally:
        await tee.close(deadline_s=2.0)
        await sink.stop()
    got = {body["request_id"]: (path, body, headers) for path, body, headers in sink.received}
    assert set(got) == set(chosen)
    for rid, (path, body, headers) in got.items():
        assert path == "ingest_ids"
        assert body["model"] == "m" and len(body["input_ids"]) == 32
        assert headers["x-kvmesh-worker"] == chosen[rid]
    assert router.hook_errors == 0


async def test_a_failing_hook_never_fails_routing() -> None:
    def broken(req: object, decision: object) -> None:
        raise RuntimeError("sink wiring broken")

    router = Router(workers=["w0"], on_decision=broken)
    decision = await router.route(RouteRequest(request_id="r", input_tokens=8))
    assert decision.prefill.worker == "w0"
    assert router.hook_errors == 1
