"""What every engine program of the conformance harness shares: the trace's tokens
and the lockstep line protocol (``vllm_engine.py``'s docstring).

Standard library only: each engine program imports it into its own
virtualenv, beside that engine's code, and none of them imports kvmesh.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: The bundled Mooncake trace (``lab/data``), read with the standard library.
TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_trace.jsonl.gz"
#: Tokens per block of the trace's ``hash_ids``.
TRACE_BLOCK_TOKENS = 512
#: Token ids of prompts and outputs are drawn from [TOKEN_BASE, TOKEN_BASE + VOCAB).
TOKEN_BASE = 100
VOCAB = 50_000


def id_tokens(hash_id: int, n: int) -> list[int]:
    """The tokens a trace block id stands for: equal ids, equal tokens (ids chain by prefix)."""
    out: list[int] = []
    counter = 0
    while len(out) < n:
        digest = hashlib.blake2b(f"{hash_id}:{counter}".encode(), digest_size=64).digest()
        out += [
            TOKEN_BASE + int.from_bytes(digest[i : i + 2], "little") % VOCAB
            for i in range(0, 64, 2)
        ]
        counter += 1
    return out[:n]


def trace_records(path: Path, instance: int, instances: int) -> Iterator[dict[str, Any]]:
    """The trace's records this instance serves (every ``instances``-th), in order, forever."""
    while True:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i % instances == instance and line.strip():
                    yield json.loads(line)


class Protocol:
    """The lockstep line protocol: JSON lines out on a private copy of stdout, ``go`` in."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def send(self, obj: object) -> None:
        self.out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.out.flush()

    def ready(self, payload: object) -> None:
        self.out.write("READY " + json.dumps(payload, separators=(",", ":")) + "\n")
        self.out.flush()

    def wait_go(self) -> None:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit(0)  # the harness closed stdin: stop
        msg = json.loads(line)
        if not isinstance(msg, dict) or msg.get("go") is not True:
            raise SystemExit(f"expected {{'go': true}}, got {line.strip()!r}")
