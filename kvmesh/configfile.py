"""Configuration loading shared by every kvmesh service.

Each service has one typed pydantic model built on :class:`StrictModel`
(``indexer/config.py``, ``tee/config.py``, ``tee/cachesim/config.py``,
``xfer/config.py``, ``router_client/config.py``) and one loader,
:func:`load_layered`, with the same precedence everywhere: CLI flag >
environment (``KVMESH_<SERVICE>_…``, nested keys joined by ``__``) > config
file (YAML, TOML or JSON) > defaults.

One rule for unknown keys: every model forbids them, and an unknown key is
an error naming the key and the layer that holds it (the file, the
environment variable or the command line), never silently dropped, so a
typo cannot fall back to a default. Every problem becomes one
:class:`ConfigError` listing each of them as ``field.path: message``.
"""

from __future__ import annotations

import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "ENV_NESTED_SEP",
    "ConfigError",
    "StrictModel",
    "env_overrides",
    "field_path",
    "format_validation_error",
    "load_layered",
    "merge",
    "read_config_file",
    "validation_problems",
]

#: Separator of nested keys in environment variable names.
ENV_NESTED_SEP = "__"

#: Prefix every service's environment prefix starts with (``KVMESH_INDEXER_``).
_ENV_ROOT = "KVMESH_"

#: What pydantic calls a key that the model does not define.
_EXTRA_FORBIDDEN = "extra_forbidden"

_M = TypeVar("_M", bound=BaseModel)

#: A field path as pydantic gives it: keys and list indices.
_Loc = tuple[int | str, ...]


class ConfigError(ValueError):
    """The configuration is invalid; the message lists every problem.

    ``problems`` holds ``(field path, text)`` per problem when the error comes
    from validation (empty otherwise, e.g. for an unreadable file); ``field``
    is the path of the first one.
    """

    def __init__(self, message: str, *, problems: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)

    @property
    def field(self) -> str:
        """Path of the first offending field (``""`` when the error names none)."""
        return self.problems[0][0] if self.problems else ""


class StrictModel(BaseModel):
    """Base of every configuration model: unknown keys are errors, values are immutable.

    A loaded config never changes under the code holding it: a changed config
    is a new one (``model_copy(update=…)`` or a new load).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


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


def _env_layer(
    prefix: str, environ: Mapping[str, str] | None
) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """The nested dict of the ``{prefix}…`` variables, and each key path's variable."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    names: dict[tuple[str, ...], str] = {}
    for name, raw in env.items():
        if not name.startswith(prefix):
            continue
        path = tuple(part.lower() for part in name[len(prefix) :].split(ENV_NESTED_SEP))
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
        names[path] = name
    return out, names


def env_overrides(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The nested dict given by the ``{prefix}…`` variables of ``environ``.

    ``KVMESH_INDEXER_REDIS__URL`` with prefix ``KVMESH_INDEXER_`` becomes
    ``{"redis": {"url": …}}``. Values stay strings (pydantic converts them),
    except that a value starting with ``{`` or ``[`` is parsed as JSON (maps
    and lists).
    """
    return _env_layer(prefix, environ)[0]


def merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for nested mappings (neither is changed)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def _drop_none(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` without ``None`` values (a flag not given) and the sections left empty."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            sub = _drop_none(value)
            if sub:
                out[key] = sub
        elif value is not None:
            out[key] = value
    return out


def field_path(loc: Sequence[int | str]) -> str:
    """A field path as text: keys joined by ``.``, list indices in brackets
    (``buckets[1].max_tokens``); ``""`` for the whole config."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# -- validation problems ---------------------------------------------------------


def _has_child(node: Any, part: int | str) -> bool:
    """Whether ``node[part]`` exists in parsed config data (a mapping key or a list index)."""
    if isinstance(node, Mapping):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


@dataclass(frozen=True, slots=True)
class _Layer:
    """One layer of a layered config: where it came from and the dict it gave."""

    source: str
    data: Mapping[str, Any]
    #: Environment layer only: nested key path -> the variable that set it.
    env_names: Mapping[tuple[str, ...], str] | None = None

    def holds(self, path: _Loc) -> bool:
        """Whether this layer's data has a value at ``path``."""
        node: Any = self.data
        for part in path:
            if not _has_child(node, part):
                return False
            node = node[part]
        return True

    def describe(self, path: _Loc) -> str:
        """The layer as the origin of ``path`` (the variable's name for the environment)."""
        if self.env_names is None:
            return self.source
        keys: list[str] = []
        for part in path:
            if not isinstance(part, str):
                break
            keys.append(part)
        # The variable that set the value holding ``path``: a prefix of it (a
        # JSON value carries the rest of the path inside).
        for n in range(len(keys), 0, -1):
            name = self.env_names.get(tuple(keys[:n]))
            if name is not None:
                return f"environment variable {name}"
        return self.source


def _data_path(data: Mapping[str, Any], loc: _Loc) -> _Loc:
    """``loc`` without the parts that are no key of ``data``.

    pydantic puts the member of a union into the location (the tag of a
    discriminated union, e.g. ``sinks.0.http.url``); the data has no such key.
    """
    node: Any = data
    out: list[int | str] = []
    for part in loc:
        if _has_child(node, part):
            node = node[part]
            out.append(part)
    return tuple(out)


def _model_of(annotation: Any, part: int | str) -> Any:
    """The type that location ``part`` selects inside a value of type ``annotation``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _model_of(args[0], part)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(str(part))
        return None if field is None else field.annotation
    if origin in (list, tuple, set, frozenset, Sequence) and isinstance(part, int) and args:
        return args[0]
    if origin in (dict, Mapping) and len(args) == 2:
        return args[1]
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        for member in members:
            # A union member is named by its class (smart unions) or its tag.
            if getattr(member, "__name__", None) == part or _has_tag(member, part):
                return member
        if len(members) == 1:
            return _model_of(members[0], part)
    return None


def _has_tag(member: Any, tag: int | str) -> bool:
    """Whether model ``member`` has a ``Literal`` field allowing ``tag`` (its discriminator)."""
    if not (isinstance(member, type) and issubclass(member, BaseModel)):
        return False
    for field in member.model_fields.values():
        if typing.get_origin(field.annotation) is typing.Literal and tag in typing.get_args(
            field.annotation
        ):
            return True
    return False


def _valid_keys(model_cls: type[BaseModel] | None, loc: _Loc) -> tuple[str, ...]:
    """The keys the model at ``loc`` (a parent location) accepts, () when unknown."""
    tp: Any = model_cls
    for part in loc:
        if tp is None:
            return ()
        tp = _model_of(tp, part)
    while typing.get_origin(tp) in (typing.Annotated, typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is typing.Annotated or len(members) == 1:
            tp = members[0]
        else:
            return ()
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tuple(sorted(tp.model_fields))
    return ()


def _problems(
    err: ValidationError,
    model_cls: type[BaseModel] | None = None,
    layers: Sequence[_Layer] = (),
    merged: Mapping[str, Any] | None = None,
) -> list[tuple[str, str]]:
    """``(field path, text)`` per problem of ``err``; unknown keys name their layers."""
    out: list[tuple[str, str]] = []
    hinted: set[_Loc] = set()  # parents whose valid keys were listed already
    for item in err.errors():
        loc: _Loc = tuple(item["loc"])
        if item["type"] != _EXTRA_FORBIDDEN or not loc:
            path = field_path(loc)
            out.append((path, f"{path or 'config'}: {item['msg']}"))
            continue
        data_loc = _data_path(merged, loc) if merged is not None else loc
        key = field_path(data_loc)
        notes = [layer.describe(data_loc) for layer in layers if layer.holds(data_loc)]
        valid = () if loc[:-1] in hinted else _valid_keys(model_cls, loc[:-1])
        if valid:
            hinted.add(loc[:-1])
            parent = field_path(data_loc[:-1])
            where = f"valid keys of {parent}" if parent else "valid top-level keys"
            notes.append(f"{where}: {', '.join(valid)}")
        out.append((key, f"unknown key {key!r}" + (f" ({'; '.join(notes)})" if notes else "")))
    return out


def validation_problems(
    err: ValidationError, model_cls: type[BaseModel] | None = None
) -> list[tuple[str, str]]:
    """``(field path, text)`` per problem of ``err``, text ``field.path: message``.

    An unknown key is ``unknown key 'path'`` (with the keys valid there when
    ``model_cls``, the validated model, is given), the same wording
    :func:`load_layered` uses.
    """
    return _problems(err, model_cls)


def format_validation_error(err: ValidationError, what: str) -> str:
    """One line per problem, ``field.path: message``, after ``invalid {what} config: ``."""
    return f"invalid {what} config: " + "; ".join(text for _, text in _problems(err))


# -- the layered loader ------------------------------------------------------------


def _service_name(env_prefix: str) -> str:
    """``indexer`` for ``KVMESH_INDEXER_``: the name error messages give the config."""
    return env_prefix.removeprefix(_ENV_ROOT).strip("_").lower() or env_prefix


def load_layered(
    model_cls: type[_M],
    *,
    path: str | os.PathLike[str] | None,
    env_prefix: str,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> _M:
    """``model_cls`` built from defaults < the file at ``path`` < ``{env_prefix}…``
    variables of ``environ`` (``os.environ`` when None) < ``overrides``.

    ``overrides`` is the nested dict the command line gives; a ``None`` value
    there is a flag not given and is skipped (in the file, ``null`` is a
    value). Nested mappings merge key by key; any other value, lists
    included, replaces the lower layer's. Raises :class:`ConfigError` listing
    every problem: an unreadable file, and each invalid value as
    ``field.path: message`` after ``invalid <service> config: `` (the service
    named by ``env_prefix``), an unknown key as ``unknown key 'path'`` with the
    layer that holds it and the keys valid there.
    """
    layers: list[_Layer] = []
    if path is not None:
        layers.append(_Layer(f"config file {path}", read_config_file(path)))
    env_data, env_names = _env_layer(env_prefix, environ)
    layers.append(_Layer("environment", env_data, env_names))
    if overrides:
        layers.append(_Layer("command line", _drop_none(overrides)))
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = merge(merged, layer.data)
    try:
        return model_cls.model_validate(merged)
    except ValidationError as e:
        problems = _problems(e, model_cls, layers, merged)
        what = _service_name(env_prefix)
        message = f"invalid {what} config: " + "; ".join(text for _, text in problems)
        raise ConfigError(message, problems=problems) from e
