"""What every benchmark writes and prints: the JSON report and the table cells.

A report is one JSON object: ``figures`` (name -> number, the values a
benchmark is judged by), ``params`` (what was run: sizes, versions, the
machine) and any sections of a benchmark's own (``ratios`` and ``rounds`` of
``kvmesh bench indexer --tls``, ``flood`` of its ``--flood``). Every report
is written the same way by :func:`write_report`: indented, keys sorted, a
final newline, so two runs diff line by line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def write_report(
    path: str | Path,
    figures: Mapping[str, Any] | None,
    params: Mapping[str, Any] | None,
    **sections: Any,
) -> None:
    """Write ``{"figures": figures, "params": params, **sections}`` to ``path`` as JSON.

    A ``None`` figures or params is left out (a report whose figures are a
    section of their own, such as ``flood``).
    """
    doc: dict[str, Any] = {}
    if figures is not None:
        doc["figures"] = figures
    if params is not None:
        doc["params"] = params
    doc.update(sections)
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def fmt(v: float | None) -> str:
    """A figure in a table cell: thousands separated from 1,000, one decimal from 10,
    three significant digits below; ``-`` for a missing or non-finite figure."""
    if v is None or not math.isfinite(v):
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def table(head: str, rows: Iterable[str], footer: Iterable[str] = ()) -> str:
    """A table as printed: the header line, a rule as wide, the rows, then ``footer`` lines."""
    return "\n".join([head, "-" * len(head), *rows, *footer])
