"""Request traces bundled with kvmesh, for the quickstart, benchmarks and replays.

The Mooncake conversation trace (``lab/data/``, see its NOTICE.md) names
each 512-token block of a prompt by an id that is chained by prefix: equal ids
mean equal prefixes. Those ids are small consecutive integers; real block keys
(docs/spec/block-keys.md) are uniform 64-bit values, which is what hash tables
and Redis key sizes see, so :func:`trace_block_key` spreads an id over 64 bits
the same way for publishers and for matchers.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import xxhash

#: Tokens per block in the Mooncake traces.
MOONCAKE_BLOCK_SIZE = 512

#: File name of the bundled conversation trace inside the ``lab/data`` folder.
MOONCAKE_CONVERSATION_TRACE = "mooncake_conversation_trace.jsonl.gz"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``timestamp`` is the arrival time in milliseconds since the first request;
    ``hash_ids`` names the prompt's blocks, chained by prefix.
    """

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def trace_block_key(hash_id: int) -> int:
    """The 64-bit block key kvmesh uses for a trace block id.

    ``XXH3_64(LE64(hash_id))``: deterministic and, for the trace's id range,
    collision-free, so prefix equality of ids carries over to keys.
    """
    return xxhash.xxh3_64_intdigest(hash_id.to_bytes(8, "little"))


def _open_default() -> Iterator[str]:
    ref = resources.files("lab").joinpath("data", MOONCAKE_CONVERSATION_TRACE)
    with ref.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
        yield from text


def _open_path(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as text:
        yield from text


def load_mooncake(path: str | Path | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Load a Mooncake-format trace (JSON lines, optionally gzip-compressed).

    ``path`` defaults to the bundled conversation trace. ``limit`` keeps only
    the first ``limit`` requests. Raises ``ValueError`` naming the line of a
    malformed record.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    lines = _open_default() if path is None else _open_path(Path(path))
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            req = TraceRequest(
                timestamp=float(rec["timestamp"]),
                input_length=int(rec["input_length"]),
                output_length=int(rec["output_length"]),
                hash_ids=tuple(int(h) for h in rec["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace line {lineno}: {exc}") from exc
        out.append(req)
    return out
