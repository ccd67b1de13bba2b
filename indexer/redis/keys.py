"""Every Redis key of the redis backend, in one place (schema: indexer/redis/KEYS.md).

All names start with ``<prefix>:``. Block keys and engine hashes are written
as 8 raw big-endian bytes, namespaces as the 8 raw bytes of their seed, so a
block key name is ``<prefix>:b:`` + 16 bytes. The Lua scripts receive
``<prefix>:`` and build the per-id and per-block names themselves with the
same layout; :func:`block_key`, :func:`emap_key` and the constants below are
the single definition, mirrored by ``indexer/redis/lua/lib.lua``.

Redis Cluster (KEYS.md, "Redis Cluster"): every name above moves under the
control tag, ``{<prefix>}:`` (:func:`cluster_base`), except block keys, which
are ``<prefix>:b:{<tag>}`` + 16 bytes: ``<tag>`` is the anchor's 4 hex digits
(:func:`anchor_tag`) for a deep block, a node tag (:func:`node_tag`) for the
copy of a shallow block on that node. Per node, ``<prefix>:g:{<node tag>}``
copies the generation and ``<prefix>:c:{<node tag>}`` marks unplaced copies.
"""

from __future__ import annotations

import struct

from kvmesh.blockkeys import namespace_seed

#: Version of the layout below; stored at :func:`schema_key`, bumped on change.
#: 2: Cluster copy tags, pending records and write epochs (KEYS.md, "Redis
#: Cluster"); every replica of one Cluster index must run the same version.
#: 3: the writes carry an incarnation fence; Cluster counts block keys in the
#: control slot (KHOLDERS) instead of per data node.
#: 4: per-identity quota counts (QUOTA, LORAS; instance fields o, qn, q),
#: kept by every write: a replica of version 3 would not keep them.
SCHEMA_VERSION = 4

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
ANCHOR = b"anchor"  # string: the Cluster layout's anchor rule (KEYS.md, "Redis Cluster")
INSTANCE = b"i:"  # + instance name -> hash of instance metadata
EMAP = b"e:"  # + decimal int id -> hash engine hash (8 bytes) -> ns id + block key
KMAP = b"k:"  # cluster: + decimal int id -> hash ns id + block key -> mask digit + location
NODE_GEN = b"g:"  # cluster: + {node tag} -> copy of GEN on that node
NODE_COUNTS = b"c:"  # cluster: + {node tag} -> hash 'U' + ns id -> 1 when unplaced copies exist
KHOLDERS = b"kh"  # cluster: hash ns id + block key -> number of ids holding it (for NS_BLOCKS)
BLOCK = b"b:"  # + ns id + block key -> hash int id -> tier mask
PREDICTED = b"pr:"  # + ns id + block key -> hash int id -> prediction expiry (KEYS.md)
PREDICTED_ORDER = (
    b"po:"  # + decimal int id -> list of its predicted ns id + block key, oldest first
)
QUOTA = b"q:"  # + identity -> hash of what its instances hold (KEYS.md, "Quotas")
LORAS = b"l:"  # + decimal int id -> set of the LoRA ns ids it stored in (quotas)
# Cluster control keys of the two-phase apply and the copy-tag registry. The
# scripts also build, from the same base: 'p:<id>' (hash: the id's pending
# data-node writes, '#' -> write epoch), 'wv' (hash: id -> last write epoch)
# and, per data node, 'v:{<copy tag>}' (hash: id -> highest epoch written there).
TAGS = b"tags"  # cluster: hash copy tag -> 'r' ready | 's<unix time>' seeding; '#' -> version
PENDING = b"pend"  # cluster: set of int ids with a pending record
NODE_COPIES = b"x:"  # cluster: + {copy tag} -> hash copy name after the tag -> 1 (for seeding)

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


def anchor_key(prefix: str) -> bytes:
    """Name of the Cluster layout's anchor rule (a replica under another refuses)."""
    return base(prefix) + ANCHOR


# -- Redis Cluster ---------------------------------------------------------------


def cluster_base(prefix: str) -> bytes:
    """Start ``{<prefix>}:`` of every control name in cluster mode (one slot)."""
    return b"{" + prefix.encode("utf-8") + b"}:"


def anchor_tag(key: int) -> bytes:
    """Hash tag of a chain's anchor block: its top 16 bits as 4 hex digits.

    16 bits are plenty to spread anchors over the 16,384 slots, keep names
    short, and hex can not contain a brace.
    """
    return b"%04x" % (key >> 48)


def node_tag(n: int) -> bytes:
    """Candidate node tag number ``n`` (the backend picks one per master)."""
    return b"n%d" % n


def tagged_block_prefix(prefix: str, tag: bytes, ns: bytes) -> bytes:
    """Cluster: start of the block names under hash tag ``tag`` (append the u64 key)."""
    return base(prefix) + BLOCK + b"{" + tag + b"}" + ns


def node_key(prefix: str, what: bytes, tag: bytes) -> bytes:
    """Cluster: per-node key :data:`NODE_GEN` or :data:`NODE_COUNTS` of node tag ``tag``."""
    return base(prefix) + what + b"{" + tag + b"}"
