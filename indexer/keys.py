"""Every Redis key of the redis backend, in one place (schema: indexer/KEYS.md).

All names start with ``<prefix>:``. Block keys and engine hashes are written
as 8 raw big-endian bytes, namespaces as the 8 raw bytes of their seed, so a
block key name is ``<prefix>:b:`` + 16 bytes. The Lua scripts receive
``<prefix>:`` and build the per-id and per-block names themselves with the
same layout; :func:`block_key`, :func:`emap_key` and the constants below are
the single definition, mirrored by ``indexer/lua/lib.lua``.

Redis Cluster (not implemented): the hash tag will be the chain root block, so
:func:`block_key` gains a ``root`` argument and every name in the scripts is
built through the matching Lua helper; nothing else changes shape.
"""

from __future__ import annotations

import struct

from kvmesh.blockkeys import namespace_seed

#: Version of the layout below; stored at :func:`schema_key`, bumped on change.
SCHEMA_VERSION = 1

# Suffixes after "<prefix>:". One or two letters keep key names short: the
# per-block names are the bulk of the keyspace.
GEN = b"gen"  # string: generation of the instance table (bumped on membership change)
LEASES = b"lease"  # zset: instance name -> lease expiry (clock seconds)
DEAD = b"dead"  # set: retired instance int ids whose entries are still being purged
ID_COUNTER = b"ids"  # string: last interned instance int id (INCR)
NAMESPACES = b"ns"  # hash: ns id (8 bytes) -> model \0 lora_name
NS_BLOCKS = b"nsb"  # hash: ns id -> number of block keys with at least one holder
NS_PAIRS = b"nsbi"  # hash: ns id -> number of (block key, instance) entries
SCHEMA = b"schema"  # string: SCHEMA_VERSION
INSTANCE = b"i:"  # + instance name -> hash of instance metadata
EMAP = b"e:"  # + decimal int id -> hash engine hash (8 bytes) -> ns id + block key
BLOCK = b"b:"  # + ns id + block key -> hash int id -> tier mask

#: Field order of an instance hash as the scripts return it (HMGET order).
INSTANCE_FIELDS = (b"id", b"w", b"r", b"m", b"a", b"ttl", b"inc", b"exp", b"seq", b"st", b"n")

_U64 = struct.Struct(">Q")


def base(prefix: str) -> bytes:
    """The common start ``<prefix>:`` of every name."""
    return prefix.encode("utf-8") + b":"


def ns_id(model: str, lora_name: str = "") -> bytes:
    """Compact namespace id: the 8 big-endian bytes of the namespace seed."""
    return _U64.pack(namespace_seed(model, lora_name))


def ns_name(model: str, lora_name: str = "") -> bytes:
    """Value stored under the ns id in :data:`NAMESPACES`."""
    return model.encode("utf-8") + b"\x00" + lora_name.encode("utf-8")


def u64(value: int) -> bytes:
    """A block key or engine hash as 8 big-endian bytes."""
    return _U64.pack(value)


def block_prefix(prefix: str, ns: bytes) -> bytes:
    """Start of every block key name of namespace ``ns`` (append :func:`u64` of the key)."""
    return base(prefix) + BLOCK + ns


def block_key(prefix: str, ns: bytes, key: int) -> bytes:
    """Name of the hash holding ``{int id: tier mask}`` for one block key."""
    return block_prefix(prefix, ns) + _U64.pack(key)


def instance_name(worker_id: str, dp_rank: int) -> bytes:
    """Stable name of an instance: UTF-8 worker id, NUL, decimal dp rank."""
    return worker_id.encode("utf-8") + b"\x00" + str(dp_rank).encode()


def instance_key(prefix: str, name: bytes) -> bytes:
    """Name of the metadata hash of an instance."""
    return base(prefix) + INSTANCE + name


def emap_key(prefix: str, int_id: bytes) -> bytes:
    """Name of the engine-hash map (the reverse index) of an interned id."""
    return base(prefix) + EMAP + int_id


def key(prefix: str, suffix: bytes) -> bytes:
    """Name of one of the singleton keys (:data:`GEN`, :data:`LEASES`, ...)."""
    return base(prefix) + suffix


def schema_key(prefix: str) -> bytes:
    """Name of the schema-version string."""
    return base(prefix) + SCHEMA
