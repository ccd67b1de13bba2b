"""Read the steps of the repository's Dockerfile that the install test reproduces.

Only what the image build does to the Python environment is reproduced: the
build stage's ``COPY`` and ``pip wheel``, the runtime stage's ``ARG``
defaults, ``ENV`` and ``pip install`` commands (``if [ "$ARG" = "v" ]; then
...; fi`` guards are evaluated on the ``ARG`` defaults). Any other shell
command makes :func:`pip_commands` fail, naming it, unless it is one of
:data:`NOT_REPRODUCED`: the test must then learn to reproduce it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

#: Commands of a RUN line the test knowingly leaves out, with the reason.
NOT_REPRODUCED: dict[str, str] = {
    "rm": "removes the wheels once installed; the test's are in a temporary folder",
    "useradd": "creates the image's uid 10001; processes here run as the test's user",
}

_GUARD = re.compile(
    r'^if \[ "?\$\{?(?P<var>\w+)\}?"? = "?(?P<value>[^" \]]*)"? \]; then (?P<body>.+?);? fi$'
)


@dataclass
class Stage:
    """One ``FROM`` stage: its base image, name and instructions in order."""

    base: str
    name: str = ""
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    copies: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    workdir: str = "/"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuations joined, comment lines dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:
            continue
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        current += line
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    if current.strip():
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(text: str) -> list[Stage]:
    """The stages of a Dockerfile's text, in order."""
    result: list[Stage] = []
    for word, rest in instructions(text):
        if word == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
            result.append(Stage(base=parts[0], name=name))
            continue
        if not result:
            continue  # ARG before the first FROM: only used in FROM lines
        stage = result[-1]
        if word == "ARG":
            key, _, default = rest.partition("=")
            stage.args[key.strip()] = default.strip().strip('"')
        elif word == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                stage.env[key] = value
        elif word == "COPY":
            stage.copies.append(rest)
        elif word == "RUN":
            stage.runs.append(rest)
        elif word == "WORKDIR":
            stage.workdir = rest
    return result


def pip_commands(stage: Stage) -> list[list[str]]:
    """The arguments after ``pip`` of every pip command the stage's RUN lines run.

    ``$VAR`` guards are evaluated on the stage's ARG defaults; any command
    that is neither pip nor in :data:`NOT_REPRODUCED` raises ``ValueError``.
    """
    commands: list[list[str]] = []
    for run in stage.runs:
        for segment in (s.strip() for s in run.split("&&")):
            guard = _GUARD.match(segment)
            if guard:
                if stage.args.get(guard["var"], "") != guard["value"]:
                    continue
                segment = guard["body"].strip()
            if any(ch in segment for ch in ";|<>`$"):
                raise ValueError(f"the Dockerfile runs {segment!r}, which is not reproduced")
            words = shlex.split(segment)
            if not words:
                continue
            if words[0] == "pip":
                commands.append(words[1:])
            elif words[0] not in NOT_REPRODUCED:
                raise ValueError(f"the Dockerfile runs {segment!r}, which is not reproduced")
    return commands
