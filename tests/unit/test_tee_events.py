"""Wire forms of routed events and the tee's counting without a network."""

from __future__ import annotations

import json

import pytest

from tee.errors import InvalidEvent, TooLarge
from tee.events import EventKind, RoutedEvent, extend, from_body, ingest
from tee.logic import SinkLane, Tee


def test_body_omits_absent_fields_never_null() -> None:
    ev = ingest("m", [1, 2, 3], "r1", worker="w0")
    body = json.loads(ev.body_bytes())
    assert body == {"model": "m", "input_ids": [1, 2, 3], "request_id": "r1"}
    assert "null" not in ev.body_bytes().decode()
    assert ev.headers()["x-kvmesh-worker"] == "w0"
    ext = extend("m", [1, 2], [3, 4, 5], "r1", choice_index=0, choice_count=2)
    body = json.loads(ext.body_bytes())
    assert body["input_ids"] == [1, 2, 3, 4, 5]
    assert body["prompt_len"] == 2 and body["output_tokens"] == 3
    assert body["choice_index"] == 0 and body["choice_count"] == 2
    assert "x-kvmesh-worker" not in ext.headers()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "body"),
        ({"input_ids": [1]}, "model"),
        ({"model": "", "input_ids": [1]}, "model"),
        ({"model": "m", "input_ids": "abc"}, "input_ids"),
        ({"model": "m", "input_ids": [1, -1]}, "input_ids"),
        ({"model": "m", "input_ids": [1, 2**32]}, "input_ids"),
        ({"model": "m", "input_ids": [1.5]}, "input_ids"),
        ({"model": "m", "input_ids": [1], "prompt_len": 5}, "prompt_len"),
        ({"model": "m", "input_ids": [1], "choice_index": "x"}, "choice_index"),
        ({"model": "m", "input_ids": [1], "bogus": 1}, "bogus"),
        ({"model": 7, "input_ids": [1]}, "model"),
    ],
)
def test_from_body_names_the_bad_field(body: object, field: str) -> None:
    with pytest.raises(InvalidEvent) as info:
        from_body(EventKind.INGEST, body)
    assert info.value.field == field


def test_from_body_caps_input_ids_and_takes_null_as_absent() -> None:
    with pytest.raises(TooLarge):
        from_body(EventKind.INGEST, {"model": "m", "input_ids": [0] * 11}, max_input_ids=10)
    ev = from_body(
        EventKind.EXTEND, {"model": "m", "input_ids": [1], "prompt_len": None}, worker="w"
    )
    assert ev.prompt_len is None and ev.worker == "w" and ev.kind is EventKind.EXTEND


class _NeverSink:
    name = "never"

    async def send(self, event: RoutedEvent) -> None:  # pragma: no cover - never started
        raise AssertionError

    async def close(self) -> None:
        return None


def test_offer_before_start_and_when_full_is_a_counted_drop() -> None:
    lane = SinkLane(_NeverSink(), queue_size=2)
    assert lane.offer(ingest("m", [1])) is False  # not started: closed
    lane._closed = False  # queue only, no drain loop (no event loop needed)
    assert lane.offer(ingest("m", [1])) is True
    assert lane.offer(ingest("m", [2])) is True
    assert lane.offer(ingest("m", [3])) is False
    assert lane.offer(None) is False  # type: ignore[arg-type]  # never raises
    s = lane.stats()
    # The non-event found the queue full first.
    assert (s.offered, s.queued, s.dropped_full, s.dropped_closed, s.dropped_invalid) == (
        5,
        2,
        2,
        1,
        0,
    )
    assert s.balanced()


def test_oversized_event_is_dropped_invalid() -> None:
    lane = SinkLane(_NeverSink(), max_input_ids=4)
    lane._closed = False
    assert lane.offer(ingest("m", [0] * 5)) is False
    assert lane.stats().dropped_invalid == 1 and lane.stats().balanced()


def test_tee_rejects_duplicate_sink_names_and_bad_settings() -> None:
    with pytest.raises(ValueError):
        Tee([_NeverSink(), _NeverSink()])
    with pytest.raises(ValueError):
        SinkLane(_NeverSink(), concurrency=0)


def test_cli_print_config_and_no_sinks(capsys: pytest.CaptureFixture[str]) -> None:
    from tee import cli

    assert (
        cli.main(["--sink-http", "http://a:1", "--send-concurrency", "32", "--print-config"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["send_concurrency"] == 32 and out["sinks"][0]["url"] == "http://a:1"
    assert cli.main(["--port", "0"]) == 2
    assert cli.main(["--queue-size", "0"]) == 2
