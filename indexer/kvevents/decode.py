"""Decoding of vLLM's and SGLang's ZMQ KV-event frames into kvmesh domain events.

Wire layout (vLLM ``vllm/distributed/kv_events.py``, SGLang
``sglang/srt/disaggregation/kv_events.py``):

- A live message is three frames: ``[topic, seq, payload]``. ``seq`` is an
  8-byte big-endian unsigned counter that starts at 0 when the publisher
  starts; ``payload`` is one msgpack-encoded batch.
- A batch is ``[ts, events]`` or ``[ts, events, data_parallel_rank]`` (older
  vLLM and SGLang encode it as an array) or a map ``{"ts", "events",
  "data_parallel_rank"}`` (current vLLM); SGLang names the rank
  ``attn_dp_rank``.
- An event is a tagged map ``{"type": "BlockStored", ...}`` (current vLLM) or a
  tagged array ``["BlockStored", field1, field2, ...]`` with fields in
  declaration order (older vLLM, SGLang). Trailing fields left at their
  defaults may be missing in either form; unknown fields are ignored.

  ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window (then locality, ownership, session_id,
  lookahead_token_ids: read in map form, see below).
  ``BlockRemoved``: block_hashes, medium, group_idx. ``AllBlocksCleared``:
  nothing.

Conversions, defined here once:

- **Hashes** are ints or bytes. An int is taken modulo 2^64 (a signed 64-bit
  hash becomes its two's-complement unsigned value). Bytes (vLLM's sha256
  block hashes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is off) become
  the big-endian integer of the bytes modulo 2^64, i.e. their **last** 8
  bytes: the same value vLLM itself publishes when that flag is on, so a
  fleet mixing both settings names each block identically.
- **Medium** → tier: ``GPU`` (or absent) → GPU; ``CPU``, ``CPU_PINNED`` →
  CPU; ``STORAGE``, ``DISK``, ``EXTERNAL`` and any medium this module does
  not know → DISK (valuing an unknown tier as the slowest is the safe error).
  Case-insensitive.
- **LoRA**: ``lora_name`` when given, else ``lora_id`` as a decimal string
  (older publishers send only the id), else the base model.
- **Extra keys** (vLLM ``extra_keys``: per block, untagged, in the order LoRA
  name, ``(mm identifier, offset)`` pairs, cache salt, prompt-embedding
  digests): the LoRA name is dropped (the namespace carries it), a 2-item
  array of a string and an int is a multimodal item, a string the salt,
  anything else an opaque extra (its msgpack bytes). They enter the content
  keys (docs/spec/block-keys.md, "Extra keys"), so a salted or multimodal
  block is keyed as the router keys the request.
- **Groups**: ``group_idx`` (None: 0), ``kv_cache_spec_kind`` (None: ''),
  ``kv_cache_spec_sliding_window`` (None: 0), for indexer/groups.py.
- **Partial-block entries** (vLLM with a ``hash_block_size`` below its block,
  Mamba ``align`` mode): a ``BlockStored`` whose ``block_size`` is the hash
  unit, with one hash per unit (the prefix's hash at that unit), the unit's
  tokens and the previous unit's hash as parent. Decoded as they are; the
  service keeps them for the hybrid hit rule (indexer/groups.py).
- ``session_id`` names the request that stored the block, not an owner of it;
  ``lookahead_token_ids`` are tokens past the block that entered its hash
  (speculative lookahead hashing). Neither changes what a block is: the first
  is not used, the second makes the block's key unknowable from its tokens, so
  such an event is decoded with ``lookahead`` set and skipped by the service.

A frame that cannot be a batch at all raises :class:`MalformedFrame`; an
event that cannot be decoded is counted in ``malformed_events`` and skipped,
the rest of its batch still applies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import msgspec

from indexer.model import (
    AllBlocksCleared,
    BlockExtras,
    BlockRemoved,
    BlockStored,
    Event,
    Tier,
)

_U64 = (1 << 64) - 1

#: Medium names (upper-cased) -> tier; anything else is DISK.
MEDIUM_TIERS: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "CPU_TIER1": Tier.CPU,
    "CPU_TIER2": Tier.CPU,
    "STORAGE": Tier.DISK,
    "DISK": Tier.DISK,
    "FS": Tier.DISK,
    "OBJ": Tier.DISK,
    "EXTERNAL": Tier.DISK,
}

#: Field order of the array encoding, after the tag.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedFrame(ValueError):
    """A frame that is not a KV-event batch (or not a sequence number)."""


class MalformedEvent(ValueError):
    """One event of a batch that cannot be decoded."""


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """One decoded batch: its events in order and what the publisher said about itself."""

    timestamp: float
    events: tuple[Event, ...]
    dp_rank: int | None
    malformed_events: int = 0


_ONLY_INT = {int}

#: Untyped msgpack decoding into the same Python objects as ``msgpack.unpackb``
#: (lists, dicts with keys of any type, str, bytes, ints, floats). msgspec makes
#: them about 1.7 times faster, which is most of a batch's decoding: at
#: 512-token blocks one int object per token id.
_unpack = msgspec.msgpack.Decoder().decode


def decode_seq(frame: bytes) -> int:
    """The sequence number of a live message: 8 bytes, big-endian, unsigned."""
    if len(frame) != 8:
        raise MalformedFrame(f"sequence frame has {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big")


def engine_hash(value: object) -> int:
    """An engine block hash (int or bytes) as an unsigned 64-bit int (see module doc)."""
    if isinstance(value, bool):  # bool is an int subclass, never a hash
        raise MalformedEvent("block hash is a bool")
    if isinstance(value, int):
        return value & _U64
    if isinstance(value, bytes | bytearray | memoryview):
        b = bytes(value)
        if not b:
            raise MalformedEvent("block hash is empty bytes")
        return int.from_bytes(b[-8:], "big")
    raise MalformedEvent(f"block hash of type {type(value).__name__}")


def medium_tier(medium: object) -> Tier:
    """The tier of a medium name (None: GPU, the publishers' default)."""
    if medium is None:
        return Tier.GPU
    if not isinstance(medium, str):
        raise MalformedEvent(f"medium of type {type(medium).__name__}")
    return MEDIUM_TIERS.get(medium.upper(), Tier.DISK)


def _fields(raw: Any, names: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """(tag, fields by name) of a tagged map or a tagged array."""
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise MalformedEvent("event map has no string 'type'")
        return tag, dict(raw)
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:], strict=False))
    raise MalformedEvent(f"event is a {type(raw).__name__}, not a tagged map or array")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise MalformedEvent("block_hashes is not a list")
    # vLLM's usual case, checked at C speed: every hash an int in [0, 2^64).
    if value and set(map(type, value)) == _ONLY_INT and min(value) >= 0 and max(value) <= _U64:
        return tuple(value)
    return tuple(engine_hash(h) for h in value)


def _int(value: Any, name: str, default: int = 0) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedEvent(f"{name} is not an int")
    return value


def _lora_name(fields: Mapping[str, Any]) -> str:
    name = fields.get("lora_name")
    if isinstance(name, str) and name:
        return name
    lora_id = fields.get("lora_id")
    if isinstance(lora_id, int) and not isinstance(lora_id, bool) and lora_id:
        return str(lora_id)
    return ""


def _extras(value: Any, n: int, lora_name: str) -> tuple[BlockExtras | None, ...] | None:
    """vLLM's per-block ``extra_keys`` (see the module docstring)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise MalformedEvent("extra_keys is not a list")
    if len(value) != n:
        raise MalformedEvent(f"extra_keys has {len(value)} entries for {n} block hashes")
    out: list[BlockExtras | None] = []
    for entry in value:
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, list):
            raise MalformedEvent("an extra_keys entry is not a list")
        items = entry
        if lora_name and items and items[0] == lora_name:
            items = items[1:]
        salt = ""
        media: list[tuple[str, int]] = []
        other: list[bytes] = []
        for item in items:
            if (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], int)
                and not isinstance(item[1], bool)
            ):
                media.append((item[0], item[1]))
            elif isinstance(item, str) and not salt:
                salt = item
            else:
                other.append(msgpack.packb(item))
        out.append(
            BlockExtras(salt, tuple(media), tuple(other)) if salt or media or other else None
        )
    return tuple(out) if any(e is not None for e in out) else None


def _str(value: Any, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise MalformedEvent(f"{name} is not a string")
    return value


def decode_event(raw: Any, *, engine_hash_keys: bool = False) -> Event:
    """One event (map or array form). ``engine_hash_keys``: use the engine's hashes as keys."""
    tag, _ = _fields(raw, ())
    if tag == "BlockStored":
        _, f = _fields(raw, _STORED_FIELDS)
        hashes = _hashes(f.get("block_hashes"))
        parent_raw = f.get("parent_block_hash")
        token_ids = f.get("token_ids") or []
        if not isinstance(token_ids, list):
            raise MalformedEvent("token_ids is not a list")
        lora = _lora_name(f)
        extras = _extras(f.get("extra_keys"), len(hashes), lora)
        salt = f.get("cache_salt")
        if extras is None and parent_raw is None and hashes and isinstance(salt, str) and salt:
            # SGLang names the salt in a field of its own; like vLLM's, it keys
            # the chain from its first block (a continued chain has it in its parent).
            extras = (BlockExtras(salt=salt), *(None,) * (len(hashes) - 1))
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent_raw is None else engine_hash(parent_raw),
            # Range and type of each id are checked by the service (naming the index).
            token_ids=tuple(token_ids),
            block_size=_int(f.get("block_size"), "block_size"),
            lora_name=lora,
            tier=medium_tier(f.get("medium")),
            block_keys=hashes if engine_hash_keys else None,
            extras=extras,
            group=_int(f.get("group_idx"), "group_idx"),
            group_kind=_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
            sliding_window=_int(
                f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
            ),
            lookahead=bool(f.get("lookahead_token_ids")),
        )
    if tag == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_FIELDS)
        medium = f.get("medium")
        # No medium: the publisher predates tiers and means the GPU copy; the
        # index then clears only that tier's bit.
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes")),
            tier=medium_tier(medium),
            group=_int(f.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise MalformedEvent(f"unknown event type {tag!r}")


class _MapBatch(msgspec.Struct):
    """A batch in map form, its events left encoded (``msgspec.Raw``, views of
    the payload). UNSET: the key is absent (a rank of nil is not absent)."""

    events: list[msgspec.Raw]
    ts: Any = None
    data_parallel_rank: Any = msgspec.UNSET
    attn_dp_rank: Any = msgspec.UNSET


class _ArrayBatch(msgspec.Struct, array_like=True):
    """A batch in array form, ``[ts, events]`` or ``[ts, events, rank]``."""

    ts: Any
    events: list[msgspec.Raw]
    rank: Any = None


#: Each reads the batch's top level in one pass over the payload: its events
#: are skipped once, not once as the top level's value and again as a list
#: (1.5-1.9 ms against 0.76 ms for a 400 KB batch of 512-token blocks, where
#: unpacking its events takes 4 ms).
_split_map = msgspec.msgpack.Decoder(_MapBatch).decode
_split_array = msgspec.msgpack.Decoder(_ArrayBatch).decode


def _split_batch(payload: bytes) -> tuple[float, int | None, list[msgspec.Raw]] | None:
    """``(ts, rank, encoded events)`` of a well-formed batch with string keys;
    None for anything else (:func:`decode_batch` then judges it)."""
    if not payload:
        return None
    first = payload[0]
    try:
        if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):  # a map
            m = _split_map(payload)
            ts, events = m.ts, m.events
            rank = m.data_parallel_rank
            if rank is msgspec.UNSET:
                rank = None if m.attn_dp_rank is msgspec.UNSET else m.attn_dp_rank
        else:
            a = _split_array(payload)
            ts, events, rank = a.ts, a.events, a.rank
    except Exception:  # not the shape this path reads: decode_batch says why
        return None
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        return None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        rank = None  # an unreadable rank is informational only
    return float(ts), rank, events


#: An encoded event longer than this is unpacked and read in two steps of
#: decode_batch_paced, a turn of the loop between them: an event of 7,680
#: 16-token blocks is 576 KB, 3 to 5 ms to unpack and 1 to 2 ms to read.
LONG_EVENT_BYTES = 65536


async def decode_batch_paced(
    payload: bytes, pace: Callable[[], Awaitable[None]], *, engine_hash_keys: bool = False
) -> DecodedBatch:
    """:func:`decode_batch`, awaiting ``pace()`` between two events.

    Decoding a whole batch is one step no caller can cut: at 16-token blocks
    vLLM's batches reach 16 k blocks and 256 k token ids, 10 to 40 ms of
    decoding. Here the batch's frame is split first (its events left encoded,
    views of the payload), then each event is decoded on its own, a long one
    (:data:`LONG_EVENT_BYTES`) in two steps. The result,
    and the error for a frame that is not a batch, are those of
    :func:`decode_batch`.
    """
    parts = _split_batch(payload)
    if parts is None:
        return decode_batch(payload, engine_hash_keys=engine_hash_keys)
    ts, rank, events = parts
    out: list[Event] = []
    bad = 0
    for i, raw in enumerate(events):
        if i:
            await pace()
        try:
            unpacked = _unpack(raw)
            if len(raw) > LONG_EVENT_BYTES:
                await pace()
            out.append(decode_event(unpacked, engine_hash_keys=engine_hash_keys))
        except MalformedEvent:
            bad += 1
    return DecodedBatch(ts, tuple(out), rank, bad)


def decode_batch(payload: bytes, *, engine_hash_keys: bool = False) -> DecodedBatch:
    """Decode one msgpack batch; raises :class:`MalformedFrame` when it is not one."""
    try:
        raw = _unpack(payload)
    except Exception as e:  # decoders raise several unrelated types for bad input
        raise MalformedFrame(f"not msgpack: {e}") from e
    if isinstance(raw, Mapping):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise MalformedFrame(f"batch is a {type(raw).__name__}, not [ts, events, ...]")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise MalformedFrame("batch ts is not a number")
    if not isinstance(events, list):
        raise MalformedFrame("batch events is not a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        rank = None  # an unreadable rank is informational only
    out: list[Event] = []
    bad = 0
    for ev in events:
        try:
            out.append(decode_event(ev, engine_hash_keys=engine_hash_keys))
        except MalformedEvent:
            bad += 1
    return DecodedBatch(float(ts), tuple(out), rank, bad)
