"""The help text of every kvmesh command: defaults shown, paragraphs kept, no reST markup.

Each part's parser passes ``formatter_class=HelpFormatter``. It appends
``(default: …)`` to every option that has one and whose help does not state it
already, rewraps each paragraph of a description (a module docstring reads as
prose), and prints reST markup as plain text (````literal```` and
``:role:`target```), so one docstring serves both the docs and ``--help``.

A service's flags default to None (a flag not given leaves the setting to the
environment, then the config file, then the config's own default), so argparse
knows no default to show. :func:`show_config_defaults` gives each flag the
default of the config setting it overrides.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel

__all__ = ["HelpFormatter", "plain", "show_config_defaults", "show_default"]

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`<]*?)\s*(?:<[^>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)

#: Attribute of an :class:`argparse.Action` holding the default its help shows
#: when argparse's own default is None (set by :func:`show_config_defaults`).
SHOWN_DEFAULT_ATTR = "kvmesh_shown_default"


def plain(text: str) -> str:
    """``text`` with reST markup as plain text.

    ````x```` becomes ``x``; ``:class:`a.B```` becomes ``a.B`` and
    ``:func:`~a.f```` becomes ``f`` (the tilde shows the last name only).
    """

    def role(m: re.Match[str]) -> str:
        target = m.group(1)
        return target.rsplit(".", 1)[-1] if m.group(0).find("`~") >= 0 else target

    return _LITERAL.sub(r"\1", _ROLE.sub(role, text))


def show_default(value: Any) -> str:
    """How help shows a default: lists space-separated, floats without a trailing .0."""
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, list | tuple):
        return " ".join(show_default(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return '""'
    return str(value)


def _is_switch(action: argparse.Action) -> bool:
    """A flag that takes no value (store_true and the like): its default is just "off"."""
    return action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default, keeps the paragraphs of descriptions, drops reST markup.

    An option's help gets ``(default: X)`` unless it already says
    ``(default``; no default is shown for None, for the "off" of a flag that
    takes no value, or for an option without help text.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = re.split(r"\n\s*\n", textwrap.dedent(plain(text)).strip())
        return "\n\n".join(
            textwrap.fill(
                " ".join(p.split()),
                width,
                initial_indent=indent,
                subsequent_indent=indent,
                break_on_hyphens=False,  # keep --flag-names whole
            )
            for p in paragraphs
        )

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain(action.help or "")
        if "(default" in text or not action.option_strings:
            return text
        shown = getattr(action, SHOWN_DEFAULT_ATTR, None)
        if shown is None and not _is_switch(action):
            default = action.default
            if default is not None and default is not argparse.SUPPRESS:
                shown = show_default(default)
        if shown is None:
            return text
        note = f"(default: {shown})".replace("%", "%%")
        return f"{text} {note}" if text else note


class _Marker:
    """Stands for one flag's value while :func:`show_config_defaults` traces where it lands."""


def _path_of(tree: Any, marker: _Marker, prefix: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    if tree is marker:
        return prefix
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            found = _path_of(value, marker, (*prefix, str(key)))
            if found is not None:
                return found
    return None


def _default_at(config: type[BaseModel], path: tuple[str, ...]) -> Any:
    """The default of the setting at ``path`` (None when it has none)."""
    value: Any = config.model_construct()
    for part in path:
        if not isinstance(value, BaseModel):
            return None
        field = type(value).model_fields.get(part)
        if field is None:
            return None
        if part in value.__dict__:
            value = value.__dict__[part]
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            value = field.annotation.model_construct()  # a required section: its defaults
        else:
            return None
    return value


def show_config_defaults(
    parser: argparse.ArgumentParser,
    config: type[BaseModel],
    overrides: Callable[[argparse.Namespace], Mapping[str, Any]],
) -> None:
    """Show, in ``parser``'s help, the ``config`` default of the setting each flag overrides.

    ``overrides`` is the function the command turns its parsed flags into
    config overrides with; the setting of a flag is read off it, so help shows
    the default of the very setting the flag sets: each flag in turn holds a
    marker while every other is None, and where the marker lands in the
    result is its setting. A flag whose value the function parses rather than
    passes on (a list of endpoints), and a setting whose default is empty or
    None, show nothing.
    """
    dests = {a.dest: None for a in parser._actions}
    for action in parser._actions:
        if not action.option_strings or action.default is not None or _is_switch(action):
            continue
        marker = _Marker()
        try:
            tree = overrides(argparse.Namespace(**{**dests, action.dest: marker}))
        except Exception:  # the function parses this flag's value: no single setting
            continue
        path = _path_of(tree, marker)
        if not path:
            continue
        value = _default_at(config, path)
        if value is None or value == "" or value == [] or isinstance(value, BaseModel):
            continue
        setattr(action, SHOWN_DEFAULT_ATTR, show_default(value))
