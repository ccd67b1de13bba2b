"""Dynamo's local block hashes of token sequences, for its ``/query_by_hash``.

Run with the interpreter of the virtualenv that has ``ai-dynamo-runtime``
(``python -m lab.engines.dynamo_hashes --block-size B IN OUT`` with the
repository on ``PYTHONPATH``); ``kvmesh bench peer`` runs it before its clock
starts. ``IN`` holds the queries: for each, a little-endian uint32 count and
that many uint32 token ids. ``OUT`` gets a JSON list with, per query, the
hashes ``dynamo.llm.compute_block_hash_for_seq`` gives its full blocks, as
the signed 64-bit integers ``/query_by_hash`` takes. Imports the standard
library and Dynamo only, never kvmesh.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from array import array
from collections.abc import Sequence


def read_queries(path: str) -> list[list[int]]:
    """The token lists of an ``IN`` file."""
    with open(path, "rb") as f:
        data = f.read()
    out: list[list[int]] = []
    off = 0
    while off < len(data):
        (n,) = struct.unpack_from("<I", data, off)
        off += 4
        tokens = array("I")
        tokens.frombytes(data[off : off + 4 * n])
        if sys.byteorder != "little":  # pragma: no cover - no such machine here
            tokens.byteswap()
        out.append(tokens.tolist())
        off += 4 * n
    return out


def write_queries(path: str, queries: Sequence[Sequence[int]]) -> None:
    """Write token lists as an ``IN`` file (what the bench's side calls)."""
    with open(path, "wb") as f:
        for q in queries:
            tokens = array("I", q)
            if sys.byteorder != "little":  # pragma: no cover
                tokens.byteswap()
            f.write(struct.pack("<I", len(tokens)) + tokens.tobytes())


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def main(argv: Sequence[str] | None = None) -> int:
    """Hash every query of ``IN`` into ``OUT``."""
    p = argparse.ArgumentParser(prog="python -m lab.engines.dynamo_hashes", description=__doc__)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("queries", help="IN: the token lists")
    p.add_argument("out", help="OUT: their hashes (JSON)")
    args = p.parse_args(argv)
    from dynamo.llm import compute_block_hash_for_seq  # type: ignore[import-not-found]

    hashes = [
        [_signed(int(h)) for h in compute_block_hash_for_seq(q, args.block_size)]
        for q in read_queries(args.queries)
    ]
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(hashes, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
