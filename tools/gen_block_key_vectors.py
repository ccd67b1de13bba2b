"""Write docs/spec/block-key-vectors.json from the spec's formulas.

This is a second, deliberately plain implementation of docs/spec/block-keys.md
(struct packing, one block at a time); the unit tests check kvmesh.blockkeys
against the vectors it writes. Run: python tools/gen_block_key_vectors.py
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import xxhash

OUT = Path(__file__).resolve().parent.parent / "docs" / "spec" / "block-key-vectors.json"


def seed(model: str, lora: str) -> int:
    return xxhash.xxh3_64_intdigest(model.encode() + b"\x00" + lora.encode())


def keys(model: str, lora: str, tokens: list[int], block_size: int) -> list[int]:
    out, parent = [], seed(model, lora)
    for b in range(len(tokens) // block_size):
        block = tokens[b * block_size : (b + 1) * block_size]
        payload = struct.pack("<Q", parent) + struct.pack(f"<{block_size}I", *block)
        parent = xxhash.xxh3_64_intdigest(payload)
        out.append(parent)
    return out


LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
CASES = [
    ("empty prompt", LLAMA, "", [], 16),
    ("partial block only", LLAMA, "", list(range(15)), 16),
    ("one block", LLAMA, "", list(range(16)), 16),
    ("two blocks and a partial", LLAMA, "", list(range(1, 40)), 16),
    (
        "same tokens, LoRA namespace",
        "meta-llama/Llama-3.1-8B-Instruct",
        "sql-adapter",
        list(range(1, 40)),
        16,
    ),
    ("extreme token ids", "Qwen/Qwen2.5-7B", "", [0, 4294967295, 1, 4294967294] * 2, 4),
    ("block size 1", "Qwen/Qwen2.5-7B", "", [151643, 8, 9], 1),
    ("non-ascii model name", "mod\u00e8le-\u6a21\u578b", "", [7] * 64, 32),
]


def main() -> None:
    vectors = []
    for name, model, lora, tokens, bs in CASES:
        vectors.append(
            {
                "name": name,
                "model": model,
                "lora_name": lora,
                "block_size": bs,
                "token_ids": tokens,
                "namespace_seed": str(seed(model, lora)),
                "block_keys": [str(k) for k in keys(model, lora, tokens, bs)],
            }
        )
    doc = {
        "version": 1,
        "comment": "Keys are unsigned 64-bit integers written as decimal strings.",
        "vectors": vectors,
    }
    OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
