"""Docker's ``.dockerignore`` rules, to compute an image's build context without Docker.

The rules (Docker's patternmatcher, which ``docker build`` applies):

- a line starting with ``#`` is a comment; blank lines are skipped; a line is
  trimmed, cleaned like a path (``a//b/`` is ``a/b``: a trailing slash means
  nothing) and a leading ``/`` is dropped: every pattern is anchored at the
  root of the context;
- ``*`` is any run of characters but ``/``, ``?`` one character but ``/``,
  ``[...]`` a class, ``\\`` escapes; ``**`` is any number of path segments,
  none included (``**/x`` matches ``x`` at any depth, ``a/**`` all under ``a``);
- a pattern that matches a directory excludes everything under it;
- ``!pattern`` re-includes what it matches; the last matching line wins.

Unlike ``.gitignore``, a name without a slash matches at the root only
(``*.egg-info`` is ``/*.egg-info``).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: Regex characters that have no meaning in a Docker pattern and are matched literally.
_LITERAL = set(".+()|{}$^")


@dataclass(frozen=True)
class Pattern:
    """One line of a ``.dockerignore``: the cleaned pattern and whether it is a ``!`` line."""

    text: str
    exception: bool
    regex: re.Pattern[str]

    def matches(self, path: str) -> bool:
        """Whether the pattern matches ``path`` (slash-separated, relative to the context)."""
        return self.regex.match(path) is not None


def _compile(pattern: str) -> re.Pattern[str]:
    """The regex of a cleaned pattern, as Docker's patternmatcher builds it."""
    out = ["^"]
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "*":
            if i + 1 < n and pattern[i + 1] == "*":
                i += 2
                if i < n and pattern[i] == "/":
                    i += 1  # ``**/`` is ``**``
                # ``**`` at the end is everything; elsewhere any number of segments.
                out.append(".*" if i >= n else "(.*/)?")
                continue
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "\\":
            if i + 1 < n:
                i += 1
                out.append(re.escape(pattern[i]))
            else:
                out.append(re.escape("\\"))
        elif ch in _LITERAL:
            out.append("\\" + ch)
        else:
            # ``[`` and ``]`` pass through: character classes, as in filepath.Match.
            out.append(ch)
        i += 1
    out.append("$")
    return re.compile("".join(out), re.DOTALL)


def parse(text: str) -> list[Pattern]:
    """The patterns of a ``.dockerignore`` file's text, in order."""
    patterns: list[Pattern] = []
    for number, raw in enumerate(text.splitlines()):
        line = raw.lstrip("\ufeff") if number == 0 else raw
        if line.startswith("#"):
            continue
        line = line.strip()
        if not line:
            continue
        exception = line.startswith("!")
        if exception:
            line = line[1:].strip()
            if not line:
                raise ValueError(f".dockerignore line {number + 1}: '!' alone is not a pattern")
        line = posixpath.normpath(line)
        if len(line) > 1 and line.startswith("/"):
            line = line.lstrip("/") or "/"
        patterns.append(Pattern(line, exception, _compile(line)))
    return patterns


class DockerIgnore:
    """The patterns of one ``.dockerignore`` and the questions ``docker build`` asks them."""

    def __init__(self, patterns: Iterable[Pattern]) -> None:
        self.patterns = list(patterns)

    @classmethod
    def from_text(cls, text: str) -> DockerIgnore:
        """Parse a ``.dockerignore``'s text."""
        return cls(parse(text))

    @classmethod
    def from_file(cls, path: Path) -> DockerIgnore:
        """Read a ``.dockerignore`` (a missing file excludes nothing)."""
        return cls(parse(path.read_text("utf-8")) if path.exists() else [])

    def excluded(self, path: str) -> bool:
        """Whether ``path`` (relative, slash-separated) is left out of the context.

        A pattern matches a path when it matches the path or one of its parent
        directories; the last matching pattern decides.
        """
        path = posixpath.normpath(path)
        parents = path.split("/")[:-1]
        excluded = False
        for p in self.patterns:
            # Only a pattern that could flip the answer is looked at (Docker does the same).
            if p.exception != excluded:
                continue
            hit = p.matches(path) or any(
                p.matches("/".join(parents[: i + 1])) for i in range(len(parents))
            )
            if hit:
                excluded = not p.exception
        return excluded

    def _may_reinclude_under(self, directory: str) -> bool:
        """Whether an excluded ``directory`` must still be entered.

        Docker enters it only when a ``!`` pattern starts with the directory's
        path (``!tests/keep.py`` for ``tests``); a wildcard exception such as
        ``!**/keep.py`` re-includes nothing below an excluded directory.
        """
        prefix = directory + "/"
        return any(p.exception and (p.text + "/").startswith(prefix) for p in self.patterns)

    def context_files(self, root: Path) -> Iterator[str]:
        """Every file (or symlink) of the build context of ``root``, relative, sorted.

        Excluded directories are not entered unless a ``!`` pattern may
        re-include something below them, as ``docker build`` walks the context.
        """
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = Path(dirpath).relative_to(root).as_posix()
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            kept: list[str] = []
            for d in sorted(dirnames):
                rel = rel_dir + d
                if (root / rel).is_symlink():
                    filenames.append(d)
                elif not self.excluded(rel) or self._may_reinclude_under(rel):
                    kept.append(d)
            dirnames[:] = kept
            for f in sorted(filenames):
                rel = rel_dir + f
                if not self.excluded(rel):
                    yield rel
