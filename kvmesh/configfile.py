"""Configuration loading shared by every kvmesh service.

Each service has one typed pydantic model (``indexer/config.py``,
``tee/config.py``, ``xfer/config.py``) and the same precedence: CLI flag >
environment (``KVMESH_<SERVICE>_…``, nested keys joined by ``__``) > config
file (YAML, TOML or JSON) > defaults. This module holds the parts that do not
depend on the model: reading a file, turning environment variables into a
nested dict, and formatting validation errors one problem per field.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

#: Separator of nested keys in environment variable names.
ENV_NESTED_SEP = "__"


class ConfigError(ValueError):
    """The configuration is invalid; the message lists every problem."""


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML (.yaml/.yml), TOML (.toml) or JSON (.json) config file to a dict."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from e
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data: Any = yaml.safe_load(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {p}: unknown extension (use .yaml, .toml or .json)")
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {p}: cannot parse: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping")
    return data


def env_overrides(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The nested dict given by the ``{prefix}…`` variables of ``environ``.

    ``KVMESH_INDEXER_REDIS__URL`` with prefix ``KVMESH_INDEXER_`` becomes
    ``{"redis": {"url": …}}``. Values stay strings (pydantic converts them),
    except that a value starting with ``{`` or ``[`` is parsed as JSON (maps
    and lists).
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(prefix):
            continue
        path = [part.lower() for part in name[len(prefix) :].split(ENV_NESTED_SEP)]
        value: Any = raw
        if raw.lstrip()[:1] in ("{", "["):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"environment {name}: invalid JSON: {e}") from e
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment {name}: {part} is both a value and a section")
            node = child
        node[path[-1]] = value
    return out


def merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for nested mappings (neither is changed)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def format_validation_error(err: ValidationError, what: str) -> str:
    """One line per problem, ``field.path: message``, after ``invalid {what} config: ``."""
    lines = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"]) or "config"
        lines.append(f"{loc}: {item['msg']}")
    return f"invalid {what} config: " + "; ".join(lines)
