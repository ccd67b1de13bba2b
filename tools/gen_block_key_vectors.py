"""Write docs/spec/block-key-vectors.json from the spec's formulas.

This is a second, deliberately plain implementation of docs/spec/block-keys.md
(struct packing, one block at a time, the extra keys of each block worked out
from the prompt's salt and multimodal items on the spot); the unit tests check
kvmesh.blockkeys against the vectors it writes.
Run: python tools/gen_block_key_vectors.py
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import xxhash

OUT = Path(__file__).resolve().parent.parent / "docs" / "spec" / "block-key-vectors.json"

#: Version of the key derivation the vectors are for (docs/spec/block-keys.md).
VERSION = 2

#: A multimodal item of a prompt: identifier, offset and length of its placeholder tokens.
Media = tuple[str, int, int]


def seed(model: str, lora: str) -> int:
    return xxhash.xxh3_64_intdigest(model.encode() + b"\x00" + lora.encode())


def item(tag: int, data: bytes) -> bytes:
    return struct.pack("<BI", tag, len(data)) + data


def extras(salt: str, media: list[Media], start: int, end: int) -> bytes:
    """``E_i`` of the block of tokens ``[start, end)``; the salt is passed for block 0 only."""
    out = item(0x01, salt.encode()) if salt else b""
    for ident, offset, length in media:
        if offset < end and start < offset + length:
            out += item(0x02, ident.encode() + struct.pack("<q", offset - start))
    return out


def keys(
    model: str,
    lora: str,
    tokens: list[int],
    block_size: int,
    salt: str = "",
    media: list[Media] | None = None,
) -> list[int]:
    out, parent = [], seed(model, lora)
    for b in range(len(tokens) // block_size):
        start, end = b * block_size, (b + 1) * block_size
        payload = struct.pack("<Q", parent) + struct.pack(f"<{block_size}I", *tokens[start:end])
        payload += extras(salt if b == 0 else "", media or [], start, end)
        parent = xxhash.xxh3_64_intdigest(payload)
        out.append(parent)
    return out


LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN_VL = "Qwen/Qwen2.5-VL-7B-Instruct"
PAD = 151655  # Qwen2.5-VL's image placeholder token


def text(n: int, first: int = 1) -> list[int]:
    return list(range(first, first + n))


def placeholders(n: int) -> list[int]:
    return [PAD] * n


# name, model, lora, tokens, block size, cache salt, media
CASES: list[tuple[str, str, str, list[int], int, str, list[Media]]] = [
    ("empty prompt", LLAMA, "", [], 16, "", []),
    ("partial block only", LLAMA, "", list(range(15)), 16, "", []),
    ("one block", LLAMA, "", list(range(16)), 16, "", []),
    ("two blocks and a partial", LLAMA, "", list(range(1, 40)), 16, "", []),
    ("same tokens, LoRA namespace", LLAMA, "sql-adapter", list(range(1, 40)), 16, "", []),
    ("extreme token ids", "Qwen/Qwen2.5-7B", "", [0, 4294967295, 1, 4294967294] * 2, 4, "", []),
    ("block size 1", "Qwen/Qwen2.5-7B", "", [151643, 8, 9], 1, "", []),
    ("non-ascii model name", "mod\u00e8le-\u6a21\u578b", "", [7] * 64, 32, "", []),
    ("salted prompt", LLAMA, "", list(range(1, 40)), 16, "tenant-a", []),
    ("same prompt, another salt", LLAMA, "", list(range(1, 40)), 16, "\u00e9quipe-\u03b2", []),
    (
        "one image over several blocks",
        QWEN_VL,
        "",
        text(16) + placeholders(32) + text(20, 100),
        16,
        "",
        [("img-7c1f09a2", 16, 32)],
    ),
    (
        "image beginning mid-block",
        QWEN_VL,
        "",
        text(10) + placeholders(12) + text(18, 100),
        16,
        "",
        [("img-7c1f09a2", 10, 12)],
    ),
    (
        "two images, same placeholders, different identifiers",
        QWEN_VL,
        "",
        text(4) + placeholders(8) + text(2, 50) + placeholders(8) + text(10, 100),
        16,
        "",
        [("img-a", 4, 8), ("img-b", 14, 8)],
    ),
    (
        "the same two images swapped",
        QWEN_VL,
        "",
        text(4) + placeholders(8) + text(2, 50) + placeholders(8) + text(10, 100),
        16,
        "",
        [("img-b", 4, 8), ("img-a", 14, 8)],
    ),
    (
        "salt and an image",
        QWEN_VL,
        "",
        text(8) + placeholders(24) + text(10, 100),
        16,
        "tenant-a",
        [("img-7c1f09a2", 8, 24)],
    ),
]


def main() -> None:
    vectors = []
    for name, model, lora, tokens, bs, salt, media in CASES:
        vectors.append(
            {
                "name": name,
                "model": model,
                "lora_name": lora,
                "block_size": bs,
                "token_ids": tokens,
                "cache_salt": salt,
                "media": [list(m) for m in media],
                "namespace_seed": str(seed(model, lora)),
                "block_keys": [str(k) for k in keys(model, lora, tokens, bs, salt, media)],
            }
        )
    doc = {
        "version": VERSION,
        "comment": (
            "Keys are unsigned 64-bit integers written as decimal strings. "
            "media: [identifier, offset, length] of each multimodal item in the prompt."
        ),
        "vectors": vectors,
    }
    OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
