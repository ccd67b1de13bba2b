"""Bucket configuration: valid files in three formats, and every bad input naming its field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router_client import ConfigError, load_config, parse_config


def good() -> dict[str, Any]:
    return {
        "workers": ["p0", "p1", "d0"],
        "buckets": [
            {"id": "short", "stage": "prefill", "workers": ["p0"], "max_tokens": 1000},
            {
                "id": "long",
                "stage": "prefill",
                "workers": ["p1"],
                "min_tokens": 1000,
                "max_tokens": 9000,
            },
            {"id": "dec", "stage": "decode", "workers": ["d0"], "max_tokens": 20000},
        ],
    }


def test_valid_config_parses() -> None:
    cfg = parse_config(good())
    assert [b.id for b in cfg.buckets] == ["short", "long", "dec"]
    assert cfg.balance == pytest.approx(0.02)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml"])
def test_three_formats(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"b{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(good()))
    elif suffix == ".yaml":
        import yaml

        path.write_text(yaml.safe_dump(good()))
    else:
        lines = ['workers = ["p0", "p1", "d0"]']
        for b in good()["buckets"]:
            lines.append("[[buckets]]")
            for k, v in b.items():
                lines.append(f"{k} = {json.dumps(v)}")
        path.write_text("\n".join(lines) + "\n")
    assert len(load_config(path).buckets) == 3


def test_no_buckets_is_one_global_domain() -> None:
    cfg = parse_config({})
    assert cfg.buckets == []


def _bad(mutate: Any) -> ConfigError:
    data = good()
    mutate(data)
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    return exc.value


def test_overlapping_ranges_name_the_field() -> None:
    def m(d: dict[str, Any]) -> None:
        d["buckets"][1]["min_tokens"] = 500

    err = _bad(m)
    assert err.field == "buckets[1].min_tokens"
    assert "overlaps" in str(err)


def test_overlap_across_ranks_is_allowed() -> None:
    data = good()
    data["buckets"][1]["min_tokens"] = 500
    data["buckets"][1]["rank"] = 1
    assert parse_config(data).buckets[1].rank == 1


def test_empty_range() -> None:
    def m(d: dict[str, Any]) -> None:
        d["buckets"][1]["max_tokens"] = 1000

    err = _bad(m)
    assert err.field == "buckets[1].max_tokens"
    assert "empty range" in str(err)


def test_unknown_worker_id() -> None:
    def m(d: dict[str, Any]) -> None:
        d["buckets"][2]["workers"] = ["d0", "d9"]

    err = _bad(m)
    assert err.field == "buckets[2].workers[1]"
    assert "d9" in str(err)


def test_no_decode_bucket() -> None:
    def m(d: dict[str, Any]) -> None:
        del d["buckets"][2]

    err = _bad(m)
    assert err.field == "buckets"
    assert "no decode bucket" in str(err)


def test_negative_limit() -> None:
    def m(d: dict[str, Any]) -> None:
        d["buckets"][0]["limits"] = {"max_pending_prefill_tokens": -1}

    err = _bad(m)
    assert err.field == "buckets[0].limits.max_pending_prefill_tokens"


def test_unknown_key() -> None:
    def m(d: dict[str, Any]) -> None:
        d["buckets"][0]["max_tokenz"] = 5

    err = _bad(m)
    assert err.field == "buckets[0].max_tokenz"


def test_unknown_top_level_key_and_bad_balance() -> None:
    assert _bad(lambda d: d.update(balanse=0.3)).field == "balanse"
    assert _bad(lambda d: d.update(balance=1.5)).field == "balance"


def test_duplicate_ids() -> None:
    def m(d: dict[str, Any]) -> None:
        d["buckets"][1]["id"] = "short"

    assert _bad(m).field == "buckets[1].id"


def test_unreadable_and_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "b.ini"
    p.write_text("x")
    with pytest.raises(ConfigError, match="extension"):
        load_config(p)
