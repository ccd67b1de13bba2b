"""Config layering (CLI > env > file > defaults), unknown keys, cross-field checks, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from indexer.config import ConfigError, IndexerConfig, load_config
from kvmesh.cli import main as kvmesh_main


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_are_documented_values() -> None:
    c = load_config(environ={})
    assert (c.host, c.port, c.metrics_port, c.backend) == ("127.0.0.1", 50051, 9464, "memory")
    assert c.block_size == 16 and c.limits.max_match_blocks == 16384
    assert c.limits.max_blocks_per_event == 16384
    assert c.limits.max_message_bytes == 16 * 1024 * 1024
    assert c.default_lease_ttl_s == 30


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    f = _write(
        tmp_path,
        "c.yaml",
        "port: 1111\nblock_size: 32\nmetrics_port: 2222\nredis:\n  url: redis://file:1/0\n"
        "  prefix: fromfile\n",
    )
    env = {
        "KVMESH_INDEXER_PORT": "3333",
        "KVMESH_INDEXER_BLOCK_SIZE": "64",
        "KVMESH_INDEXER_REDIS__URL": "redis://env:2/0",
        "UNRELATED": "x",
    }
    c = load_config(f, environ=env, cli={"port": 4444, "redis": {"url": None}})
    assert c.port == 4444  # cli
    assert c.block_size == 64  # env over file
    assert c.redis.url == "redis://env:2/0"  # env over file, cli None = not given
    assert c.redis.prefix == "fromfile"  # file over default, sibling of an env override
    assert c.metrics_port == 2222  # file
    assert c.host == "127.0.0.1"  # default


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "c.toml",
            'port = 1234\n[limits]\nmax_match_blocks = 100\n[model_block_sizes]\n"m/x" = 32\n',
        ),
        (
            "c.json",
            json.dumps(
                {
                    "port": 1234,
                    "limits": {"max_match_blocks": 100},
                    "model_block_sizes": {"m/x": 32},
                }
            ),
        ),
    ],
)
def test_toml_and_json_files(tmp_path: Path, name: str, text: str) -> None:
    c = load_config(_write(tmp_path, name, text), environ={})
    assert c.port == 1234 and c.limits.max_match_blocks == 100
    assert c.block_size_for("m/x") == 32 and c.block_size_for("other") == 16


def test_unknown_key_in_file_is_rejected_with_its_path(tmp_path: Path) -> None:
    f = _write(tmp_path, "c.yaml", "port: 1\nlimits:\n  max_match_blocs: 5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'limits\.max_match_blocs' \(config file"):
        load_config(f, environ={})


def test_unknown_env_key_is_rejected_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVMESH_INDEXER_PROT"):
        load_config(environ={"KVMESH_INDEXER_PROT": "1"})


def test_env_json_map_and_bad_values() -> None:
    c = load_config(environ={"KVMESH_INDEXER_MODEL_BLOCK_SIZES": '{"a/b": 64}'})
    assert c.block_size_for("a/b") == 64
    with pytest.raises(ConfigError, match="backend"):
        load_config(environ={"KVMESH_INDEXER_BACKEND": "etcd"})
    with pytest.raises(ConfigError, match="port"):
        load_config(environ={"KVMESH_INDEXER_PORT": "70000"})


def test_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match="metrics_port and port"):
        load_config(environ={}, cli={"port": 9000, "metrics_port": 9000})
    with pytest.raises(ConfigError, match="max_message_bytes"):
        load_config(
            environ={}, cli={"limits": {"max_message_bytes": 8192, "max_match_blocks": 100}}
        )
    with pytest.raises(ConfigError, match="max_lease_ttl_s"):
        load_config(environ={}, cli={"default_lease_ttl_s": 7200})
    with pytest.raises(ConfigError, match="model_block_sizes"):
        load_config(environ={}, cli={"model_block_sizes": {"m": 0}})
    with pytest.raises(ValueError, match="model_block_sizes"):
        IndexerConfig.model_validate({"model_block_sizes": {"m": 0}})


def test_default_match_cap_fits_a_message_at_every_block_size() -> None:
    """Defaults load with any model block size: the unset cap is lowered to what
    one message carries; a cap given explicitly is checked, never changed."""
    for bs in (1, 16, 64, 512, 4096):
        c = load_config(environ={}, cli={"model_block_sizes": {"m": bs}})
        cap = c.limits.max_match_blocks
        assert cap * bs * 5 + 1024 <= c.limits.max_message_bytes
        assert cap == min(16384, (c.limits.max_message_bytes - 1024) // (max(16, bs) * 5))
    c = load_config(environ={}, cli={"model_block_sizes": {"m": 512}})
    assert c.limits.max_match_blocks == 6553
    small = load_config(environ={}, cli={"limits": {"max_message_bytes": 8192}})
    assert small.limits.max_match_blocks == (8192 - 1024) // (16 * 5)
    with pytest.raises(ConfigError, match="max_match_blocks"):
        load_config(
            environ={},
            cli={"model_block_sizes": {"m": 512}, "limits": {"max_match_blocks": 16384}},
        )


def test_cli_print_config_applies_flags_over_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = _write(tmp_path, "c.yaml", "backend: redis\nport: 1\n")
    monkeypatch.setenv("KVMESH_INDEXER_PORT", "2")
    monkeypatch.setenv("KVMESH_INDEXER_BLOCK_SIZE", "8")
    code = kvmesh_main(
        [
            "indexer",
            "serve",
            "--config",
            str(f),
            "--port",
            "3",
            "--redis-url",
            "redis://x:1/0",
            "--print-config",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["port"], out["block_size"], out["backend"]) == (3, 8, "redis")
    assert out["redis"]["url"] == "redis://x:1/0"


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _write(tmp_path, "c.yaml", "bogus: 1\n")
    assert kvmesh_main(["indexer", "serve", "--config", str(f)]) == 2
    assert "unknown key 'bogus'" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvmesh_main(["version"]) == 0
    assert capsys.readouterr().out.startswith("kvmesh ")
