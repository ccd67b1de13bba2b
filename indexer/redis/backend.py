"""Redis backend: one index shared by every indexer replica.

Key schema, script protocol and round-trip costs: indexer/redis/KEYS.md. Key names:
indexer/redis/keys.py. Scripts: indexer/redis/lua/ (``lib.lua`` is prepended to each,
indexer/redis/scripts.py).

- A Match is one EVALSHA (``match.lua``) that walks the prefix and stops at the
  first block no candidate holds. Which instances to leave out (lease expired
  per ``clock``, stale, retired) comes from a cached instance table, passed as
  ARGV. Once the table is older than ``instance_cache_ttl_s`` the script
  checks its generation against ``P:gen`` (bumped by every change of the
  table but ordinary lease renewals) and answers nothing on a mismatch, so
  the Match rereads the table and asks again; the table is also reread when a
  cached lease has run out since it was read (it may have been renewed
  elsewhere), and at once when the script names an instance id it does not
  know. So a replica's view lags the table in Redis by at most
  ``instance_cache_ttl_s`` plus one round trip (:class:`RedisIndex`).
- An apply is one EVALSHA (``apply.lua``): sequence check, lease renewal and
  every mutation, atomically. Content keys are chained here in Python; parent
  keys come from a local LRU of engine hash -> (namespace, key), verified by
  the script (an outdated entry makes it refuse before writing, and we retry
  with the authoritative value).
- Clearing, resetting, removing and reaping an instance retire its interned
  int id in O(1); its entries are then purged in chunks (``purge.lua``) so a
  huge instance never blocks Redis for long.

With ``cluster=True`` the same index lives in a Redis Cluster (KEYS.md,
"Redis Cluster"): control keys share one slot, block keys carry their chain's
anchor (the block at depth ``anchor_depth``) as hash tag, and the shallower
blocks (and those whose chain position is unknown) are copied under every
registered copy tag, so a Match is still one EVALSHA on one node. An apply
has two phases: one control script, which records the data-node writes as
pending, one script per data node touched, then a confirmation; writes a
failure cut off are finished by the retry, the instance's next batch or
:meth:`RedisIndex.maintain`. The slot map and the copy tags follow slots that
move.

Every method raises :class:`~kvmesh.errors.Unavailable` when Redis cannot be
reached and recovers by itself once Redis is back, reloading scripts after
NOSCRIPT. How long a round trip may take: ``socket_timeout_s`` for what a
router waits on (Match, the instance table it reads, PING), ``write_timeout_s``
for the rest. One apply of a long engine event (vLLM stores a whole prompt in
one: thousands of blocks at 16 tokens) can hold a loaded Redis for most of a
second; a write given up on then still completes, its retry finds a
duplicate and re-drives it, and on a Cluster those retries piled up until
ingest stopped (1,893 blocks/s at 16-token blocks with 1 s for everything,
11,845 with 10 s for writes).

Security (SECURITY.md, "Redis"): credentials, TLS and the ACL rights the
backend needs are in :mod:`indexer.redis.connection`; refused credentials, a
missing ACL right and a failed TLS verification raise
:class:`~indexer.redis.connection.BackendAuthError`. The Lua scripts and the
tracing of the commands that run them are in :mod:`indexer.redis.scripts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import ssl
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from opentelemetry import trace
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)

from indexer.bridge import wire
from indexer.index import Index
from indexer.model import (
    ALL_TIERS_MASK,
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    IndexDump,
    IndexStats,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    Namespace,
    NamespaceStats,
    Quota,
    QuotaUsage,
    Tier,
    encoded_extras,
    event_piece,
    fenced_out,
)
from indexer.redis import keys as K
from indexer.redis.connection import (
    CLIENT_ERRORS,
    RETRY_ONCE_ON_CONNECTION_ERROR,
    BackendAuthError,
    Credentials,
    PasswordFileError,
    client_cert_refusal,
    glob_escape,
    redact_url,
    split_url_credentials,
    tls_reason,
)
from indexer.redis.scripts import (
    CLUSTER_CONTROL,
    DB_ATTRS,
    TRACER_NAME,
    Script,
    load_scripts,
    traced_exec,
)
from indexer.watch import keyed_stores
from kvmesh.blockkeys import chain_keys, namespace_seed
from kvmesh.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvmesh.tasks import stop_tasks
from kvmesh.tracing import tracing_enabled

#: How long a replica reuses the pending prefill it read (per model), in
#: seconds: counting it costs Redis about 1.2 us and this process about 3 us
#: per live instance (0.26 ms a Match at 64), and a router's own dispatches
#: reach the index a PredictPlacement round trip late anyway. Within it a
#: Match with predictions asks pmatch.lua for the depths only.
PENDING_REUSE_S = 0.005

#: Entries dropped per purge script. Each costs ~4 Redis calls (~1-2 us), so a
#: chunk holds Redis for about a millisecond: long enough to amortise the round
#: trip, short enough that Matches queued behind it barely notice.
PURGE_CHUNK = 512

#: Attempts of one apply when the script rejects the caller's cached view
#: (parent mapping, model, int id changed by another replica). The second
#: attempt reads everything from Redis, so more than two is only ever needed
#: under concurrent writes to the same instance.
_APPLY_ATTEMPTS = 4
#: Blocks one apply script handles at most: a longer batch goes in parts, so
#: that no script holds the server (a Cluster's control master) for long
#: (KEYS.md, "Apply in parts"; about 5 µs of Redis time a block). 0: every
#: batch in one script.
APPLY_PART_BLOCKS = 1024

#: Namespaces whose constants (id, block-name prefix, registry value) a
#: replica keeps, least recently used first out. One costs about 520 bytes, so
#: the default holds 2 MB at most; a namespace is a model or a LoRA adapter, and
#: real fleets have far fewer. Only namespaces Redis holds blocks of are kept,
#: so names a client invents in Matches never enter it.
NS_CACHE_SIZE = 4096


def _check_anchor(depth: int) -> int:
    """``depth`` as an anchor depth (the scripts carry it in one byte)."""
    if depth < 0 or depth > 255:
        raise ValueError(f"anchor_depth must be in 0..255, got {depth}")
    return depth


#: Keys fetched per HGETALL pipeline in dump(): bounds client memory per step.
_DUMP_BATCH = 1000

#: Cluster mode: node tags tried per master. Each slot is hit by about one in
#: 16,384 tags, so a few hundred thousand cover every layout with certainty.
_NODE_TAG_SEARCH = 1 << 20

#: Cluster mode: seconds between reloads of the slot map and the copy-tag
#: registry (KEYS.md, "Copy tags"), on the next cluster call. MOVED replies keep
#: the slot map current in between and a copy tag this node lost is found at
#: once (match.lua answers that it serves none), so this only bounds how long
#: a master that lost its copy tag to a resharding waits for a new one. A
#: reload is one CLUSTER SLOTS and one HGETALL.
_TOPOLOGY_REFRESH_S = 5.0
#: Cluster mode: after a failed call, the slot map is reloaded at most this
#: often (a master that is down makes every call to it fail; one reload per
#: call would add a round trip to each).
_TOPOLOGY_RETRY_S = 0.2
#: Cluster mode: a copy tag still being seeded after this many seconds belongs
#: to a replica that died while seeding it; another one seeds it again. Far
#: above a seeding's duration (a copy of the shallow and unplaced blocks).
_SEED_STALE_S = 60.0
#: Cluster mode: copies read per step when seeding a copy tag, and pending
#: records re-driven per control script: both bound a script's and a reply's size.
_SEED_CHUNK = 512
#: Cluster mode: attempts to write one batch's data-node writes when a newer
#: write for the same instance superseded them meanwhile (each attempt re-reads
#: the pending record). Two writers of one instance at once is rare; three is
#: plenty.
_DRIVE_ATTEMPTS = 3

# Redis replies that mean "not serving right now" rather than "bad request".
_TRANSIENT = (b"LOADING", b"BUSY", b"MASTERDOWN", b"READONLY", b"TRYAGAIN", b"CLUSTERDOWN")

_OP_STORE = b"S"
_OP_REMOVE = b"R"
# The same for a batch that counts copies (EventBatch.counts_copies).
_OP_STORE_COPY = b"T"
_OP_REMOVE_COPY = b"Q"
_OP_CLEAR = b"C"

_NO_QUOTA = Quota()


def _over_quota(identity: str, kind: bytes, held: int) -> ResourceExhausted:
    """The refusal of a registration by a quota (register.lua's ``{'quota', kind, held}``)."""
    what, name = (
        ("instances", "max_instances_per_identity")
        if kind == b"i"
        else ("namespaces", "max_namespaces_per_identity")
    )
    return ResourceExhausted(
        f"identity {identity!r} already holds {held} {what}, its quota",
        field=f"quotas.{name}",
    )


@dataclass(slots=True)
class _Inst:
    """Cached view of one instance (a row of the instance table)."""

    instance: InstanceId
    name: bytes
    int_id: bytes
    spec: InstanceSpec
    exp: float
    stale: bool
    seq: int | None
    bits: int

    def state(self, now: float) -> InstanceState:
        return InstanceState(
            spec=self.spec,
            lease_expires_at=self.exp,
            live=self.exp > now,
            stale=self.stale,
            applied_sequence=self.seq,
            blocks=self.bits,
        )


def _parse_inst(row: Sequence[bytes | None]) -> _Inst:
    int_id, w, r, m, a, ttl, inc, exp, seq, st, n = row
    assert int_id is not None and w is not None and r is not None and m is not None
    instance = InstanceId(w.decode(), int(r))
    spec = InstanceSpec(
        instance=instance,
        model=m.decode(),
        address=(a or b"").decode(),
        lease_ttl_s=float(ttl or 0),
        incarnation=(inc or b"").decode(),
    )
    return _Inst(
        instance=instance,
        name=K.instance_name(instance.worker_id, instance.dp_rank),
        int_id=int_id,
        spec=spec,
        exp=float(exp or 0),
        stale=st == b"1",
        seq=None if seq is None else int(seq),
        bits=int(n or 0),
    )


# (gpu, cpu, disk) block counts of a one-block prefix, by tier mask 0..7.
_DEPTH1_TIERS: tuple[tuple[int, int, int], ...] = (
    (0, 0, 0),
    (1, 0, 0),
    (0, 1, 0),
    (1, 0, 0),
    (0, 0, 1),
    (1, 0, 0),
    (0, 1, 0),
    (1, 0, 0),
)


_T = TypeVar("_T")


async def _shielded(coro: Coroutine[Any, Any, _T]) -> _T:
    """Await ``coro`` to its end even when the caller is cancelled (``asyncio.shield``).

    A caller that gave up no longer reads the outcome: the task's own callback
    does, so a failure there is neither lost in a "never retrieved" report nor
    raised anywhere (the caller's cancellation is what it sees).
    """
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.shield(task)


#: What redis-py's cluster client has been seen to raise from inside its own
#: bookkeeping while its slot map is being rebuilt (a node gone, a failover).
_CLUSTER_CLIENT_FAULTS = (RuntimeError, AttributeError, KeyError, IndexError, TypeError)


def _client_faults_as_cluster_errors(
    exec_: Callable[..., Awaitable[Any]],
) -> Callable[..., Awaitable[Any]]:
    """``exec_`` raising RedisClusterException for the client's internal faults.

    The call did not get an answer from Redis either way: such a fault is a
    moment of a topology change, and the caller sees it as Unavailable (and
    retries), like any other failed round trip, instead of an internal error
    that would end the subscriber or answer UNKNOWN.
    """

    async def call(*args: Any, **kw: Any) -> Any:
        try:
            return await exec_(*args, **kw)
        except _CLUSTER_CLIENT_FAULTS as exc:
            raise RedisClusterException(
                f"cluster client fault: {exc.__class__.__name__}: {exc}"
            ) from exc

    return call


def _closed_transport_as_connection_error(
    exec_: Callable[..., Awaitable[Any]],
) -> Callable[..., Awaitable[Any]]:
    """``exec_`` raising a redis ConnectionError where the event loop refused a
    write to a connection that closed under it.

    A Redis server killed while redis-py reconnects (its HELLO in flight) makes
    uvloop raise ``RuntimeError: unable to perform operation on <TCPTransport
    closed=True ...>; the handler is closed``, which redis-py lets through. It
    is a failed round trip, Unavailable to the caller (who retries), not an
    internal error: a soak that killed Redis every 4 s saw two batches of a
    stream acknowledged INTERNAL.
    """

    async def call(*args: Any, **kw: Any) -> Any:
        try:
            return await exec_(*args, **kw)
        except RuntimeError as exc:
            if "closed" not in str(exc):
                raise
            raise RedisConnectionError(f"connection closed: {exc}") from exc

    return call


def _gated(
    exec_: Callable[..., Awaitable[Any]], gate: asyncio.Semaphore
) -> Callable[..., Awaitable[Any]]:
    """``exec_`` run while holding ``gate``: at most its size in flight."""

    async def call(*args: Any, **kw: Any) -> Any:
        async with gate:
            return await exec_(*args, **kw)

    return call


#: Scripts that only read, which a router waits on: ``socket_timeout_s`` bounds them.
_READ_SCRIPTS = frozenset({"match", "snapshot"})
#: Writes of a few commands that do not take turns with the applies
#: (``redis.max_writes_in_flight``): a lease renewal waits for the script Redis
#: runs, not for every engine's batch queued before it (an idle engine whose
#: renewals waited out ``write_timeout_s`` behind a burst of other engines'
#: batches lost its lease, and dropped out of every Match). A registration
#: still takes its turn: it may reset an instance whose batches are queued.
_PROMPT_SCRIPTS = frozenset({"heartbeat"})


def _turns(
    exec_: Callable[..., Awaitable[Any]], gate: asyncio.Semaphore, wait_s: float
) -> Callable[..., Awaitable[Any]]:
    """``exec_`` run while holding ``gate``, waiting for it ``wait_s`` at most: a
    write that waited its turn that long fails unsent (TimeoutError), so a
    stalled Redis fails a queue of writes after one timeout, not one after the
    other."""

    async def call(*args: Any, **kw: Any) -> Any:
        try:
            async with asyncio.timeout(wait_s):
                await gate.acquire()
        except TimeoutError:
            raise TimeoutError(
                f"no turn to write within {wait_s:g} s (redis.max_writes_in_flight)"
            ) from None
        try:
            return await exec_(*args, **kw)
        finally:
            gate.release()

    return call


#: Write scripts a replica over a standalone Redis has in flight at once by
#: default (``redis.max_writes_in_flight``). ``kvmesh bench peer --block-size 16
#: --backend redis``, two runs each way: with one, Match p50 during ingest 34 to 51
#: ms against 80 to 98 unbounded, p99 0.53 to 1.4 s against 1.2 to 2.1 s, no probe past its
#: 1 s timeout (219 unbounded in one run), ingest the same within run-to-run noise
#: (with 2 and 4: p50 59 and 130 ms). At 512-token blocks, one run each: Match p50
#: 42.6 ms against 3,110, ingest 17,030 blocks/s against 18,200.
DEFAULT_WRITES_IN_FLIGHT = 1
#: The same over a Cluster, about one per master of the usual three. Unbounded,
#: the 64 engines' applies of ``kvmesh bench peer --block-size 512 --backend
#: cluster`` were all in flight at once, their decoding and encoding queued on
#: the replica's loop, and a Match during the ingest waited 5.3 to 6.5 s (p50;
#: health p50 0.7 to 1.1 s). With 3: Match p50 9 to 14 ms, health p50 5 to 7 ms,
#: ingest the same (14.0 to 16.5 k blocks/s against 16.1). At 16-token blocks,
#: one run each: Match p50 19 ms against 333, p99 383 against 1,131, health p99
#: 87 against 524 ms, ingest 59.7 k against 67.7 k blocks/s (with 6: Match p50
#: 41 ms, ingest 53.5 k). A cluster of more masters may raise it.
DEFAULT_CLUSTER_WRITES_IN_FLIGHT = 3


class _ParentCache:
    """(instance name, engine hash) -> (ns id, block key) as last written, about
    ``cap`` entries at most: two generations, the newer filled until it holds
    half of them, then the older dropped whole. A batch's mappings go in with
    one ``dict.update``. (An LRU moved and evicted entry by entry took 11 % of
    an ingesting replica's CPU at 16-token blocks, as much as computing the
    keys.) A hit in the older generation moves to the newer one. A mapping
    here is only a belief: the apply script checks it before writing."""

    __slots__ = ("_half", "_old", "_young")

    def __init__(self, cap: int) -> None:
        self._half = cap // 2  # 0: nothing is kept
        self._young: dict[tuple[bytes, int], tuple[bytes, int]] = {}
        self._old: dict[tuple[bytes, int], tuple[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def get(self, k: tuple[bytes, int]) -> tuple[bytes, int] | None:
        v = self._young.get(k)
        if v is None:
            v = self._old.pop(k, None)
            if v is not None:
                self._young[k] = v
                self._rotate()
        return v

    def put(self, name: bytes, written: dict[int, tuple[bytes, int]]) -> None:
        if not self._half:
            return
        keys = zip(itertools.repeat(name), written)
        self._young.update(zip(keys, written.values(), strict=False))
        self._rotate()

    def pop(self, k: tuple[bytes, int]) -> None:
        self._young.pop(k, None)
        self._old.pop(k, None)

    def _rotate(self) -> None:
        if len(self._young) >= self._half:
            self._old = self._young
            self._young = {}


def _mapping(value: bytes | None) -> tuple[bytes, int] | None:
    """An engine-hash mapping as Redis holds it (ns id, then the block key) as a pair."""
    if not value:
        return None
    return value[:8], int.from_bytes(value[8:], "big")


def _slot_moved(exc: BaseException) -> bool:
    """Whether a cluster error says that a slot is not where the slot map put it
    (a script touched a name its node does not serve)."""
    text = str(exc)
    return "non local key" in text or "hash slot" in text


def _unpack_locations(packed: bytes) -> list[bytes]:
    """The locations of a pending record's value (each prefixed by its length)."""
    out, i = [], 0
    while i < len(packed):
        n = packed[i]
        out.append(packed[i + 1 : i + 1 + n])
        i += n + 1
    return out


def _pack(values: Sequence[int], what: str) -> bytes:
    try:
        return struct.pack(f">{len(values)}Q", *values)
    except struct.error:
        raise InvalidArgument("values must be unsigned 64-bit integers", field=what) from None


def _event_blocks(ev: Event) -> int:
    return len(ev.block_hashes) if isinstance(ev, BlockStored | BlockRemoved) else 0


def _blocks_of(batch: EventBatch) -> int:
    return sum(map(_event_blocks, batch.events))


def _in_parts(batch: EventBatch, limit: int) -> bool:
    """Whether ``batch`` goes in parts: more than ``limit`` blocks, and no
    clear (a clear rotates the instance's id mid-script; KEYS.md, "Apply in parts")."""
    events = batch.events
    if len(events) <= limit and _blocks_of(batch) <= limit:
        return False
    return not any(isinstance(ev, AllBlocksCleared) for ev in events)


def _cut(
    events: Sequence[Event], start: tuple[int, int], limit: int
) -> tuple[tuple[Event, ...], tuple[int, int]]:
    """The part of ``events`` from position ``start`` (event, block) holding
    at most ``limit`` blocks (an event without any counts as one), and the
    position after it."""
    i, o = start
    left = limit
    part: list[Event] = []
    while i < len(events) and left > 0:
        ev = events[i]
        n = _event_blocks(ev)
        if n == 0:
            part.append(ev)
            i, o, left = i + 1, 0, left - 1
            continue
        take = min(n - o, left)
        assert isinstance(ev, BlockStored | BlockRemoved)
        part.append(event_piece(ev, o, o + take))
        left -= take
        o += take
        if o >= n:
            i, o = i + 1, 0
    return tuple(part), (i, o)


def _position(got: bytes, events: Sequence[Event]) -> tuple[int, int]:
    """A position Redis holds for a batch (``b'event:block'``), checked against ``events``."""
    try:
        i, o = (int(x) for x in got.split(b":"))
    except ValueError:
        i, o = -1, -1
    inside = 0 <= i < len(events) and 0 <= o < max(1, _event_blocks(events[i]))
    if not inside and (i, o) != (0, 0):
        raise Unavailable(
            f"apply: Redis holds position {got!r} of this batch, which it does not have "
            "(another batch sent with the same sequence?)"
        )
    return i, o


class RedisIndex(Index):
    """The Redis backend (see the module docstring and indexer/redis/KEYS.md).

    ``url`` is a redis:// URL; ``prefix`` starts every key name, so several
    indexes can share one Redis. ``clock`` returns seconds and judges leases
    (lease expiry stamps in Redis are absolute ``clock()`` values).
    ``instance_cache_ttl_s`` bounds how often the cached instance table is
    refreshed and, with it, how far this replica's view may lag: the instance
    table a Match answers from (ids, addresses, stale flags, leases) lags the
    one in Redis by at most ``instance_cache_ttl_s`` plus one round trip. A
    live instance is never hidden past that bound (a cached lease that ran out
    is read again once the bound allows), and an instance that expired, was
    removed or was registered again is never answered with its old id,
    address or flags past it (KEYS.md, "Instance table, leases, staleness").
    ``parent_cache_size`` caps the local engine-hash cache; ``ns_cache_size``
    the namespaces whose constants are kept (:data:`NS_CACHE_SIZE`).
    ``cluster`` talks to a Redis Cluster through ``url`` (any node);
    ``anchor_depth`` is then the depth of the block whose tag places a chain
    (blocks above it are copied on every master; 0 tags chains by their root),
    for every model, or a function of the model (the config's
    ``cluster_anchor_for``: a depth in tokens, whatever each model's block size)
    named by ``anchor_rule``. The first replica records its rule in the index
    (``anchor_depth`` when no rule is named); a replica under another refuses
    every call with FAILED_PRECONDITION.

    Credentials: ``username`` (else the URL's; none is Redis's default user)
    and a password from ``password_file`` (read at each new connection), else
    ``password``, else the URL. TLS: a ``rediss://`` URL, verified against
    ``tls_ca_file`` (else the system CAs) with ``tls_check_hostname``;
    ``tls_cert_file`` and ``tls_key_file`` are the client certificate. In
    cluster mode every node connection uses the same settings.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvm",
        clock: Callable[[], float] = time.time,
        instance_cache_ttl_s: float = 0.25,
        socket_timeout_s: float = 1.0,
        write_timeout_s: float = 10.0,
        max_connections: int = 64,
        max_writes_in_flight: int | None = None,
        parent_cache_size: int = 200_000,
        ns_cache_size: int = NS_CACHE_SIZE,
        apply_part_blocks: int = APPLY_PART_BLOCKS,
        cluster: bool = False,
        anchor_depth: int | Callable[[str], int] = 1,
        anchor_rule: str = "",
        username: str = "",
        password: str | None = None,
        password_file: str = "",
        tls_ca_file: str = "",
        tls_cert_file: str = "",
        tls_key_file: str = "",
        tls_check_hostname: bool = True,
    ) -> None:
        if isinstance(anchor_depth, int):
            _check_anchor(anchor_depth)
        #: The URL as it may be shown (password redacted).
        self.where = redact_url(url)
        url, url_user, url_password = split_url_credentials(url)
        self.username = username or url_user
        creds: Credentials | None = None
        if self.username or password_file or password is not None or url_password is not None:
            creds = Credentials(
                self.username,
                password if password is not None else url_password,
                password_file,
            )
        conn: dict[str, Any] = {"credential_provider": creds} if creds is not None else {}
        tls_files = {
            "ssl_ca_certs": tls_ca_file,
            "ssl_certfile": tls_cert_file,
            "ssl_keyfile": tls_key_file,
        }
        self._tls_without_client_cert = False
        #: Whether the server refuses our client certificate, asked where a
        #: first contact ends in a reset (connection.client_cert_refusal).
        self._cert_probe: Callable[[], Awaitable[BaseException | None]] | None = None
        if url.lower().startswith("rediss://"):
            conn.update({k: v for k, v in tls_files.items() if v})
            conn["ssl_check_hostname"] = tls_check_hostname
            self._tls_without_client_cert = not tls_cert_file
            if tls_cert_file:
                self._cert_probe = functools.partial(
                    client_cert_refusal,
                    url,
                    ca_file=tls_ca_file,
                    cert_file=tls_cert_file,
                    key_file=tls_key_file,
                    check_hostname=tls_check_hostname,
                    timeout_s=min(socket_timeout_s, 2.0),
                )
        elif any(tls_files.values()):
            raise ValueError(f"TLS files are set but {self.where} is not a rediss:// URL")
        self._clock = clock
        self._prefix = prefix
        self.cluster = cluster
        if apply_part_blocks < 0:
            raise ValueError(f"apply_part_blocks must be >= 0, got {apply_part_blocks}")
        #: Blocks per apply script (:data:`APPLY_PART_BLOCKS`).
        self.apply_part_blocks = apply_part_blocks
        #: Batches applied in parts, and their parts (figures for the metrics).
        self.batches_in_parts = 0
        self.apply_parts = 0
        self._anchor_depth = anchor_depth
        #: How this replica places chains, as recorded in the index (the first
        #: replica's rule is kept; another refuses): ``anchor_rule``, else the depth.
        if not anchor_rule and not isinstance(anchor_depth, int):
            raise ValueError("an anchor given as a function needs an anchor_rule naming it")
        self._anchor_rule = anchor_rule or f"depth {anchor_depth}"
        #: Anchor depth per model, as used (a function's answer is checked once).
        self._anchors: dict[str, int] = {}
        # Control names: one slot in cluster mode. Block names keep the plain base.
        self._base = K.cluster_base(prefix) if cluster else K.base(prefix)
        self._ctl_prefix = self._base[:-1].decode("utf-8")
        self._gen_key = self._base + K.GEN
        # Scripts that need no key still name one, so that a cluster client
        # routes them to the control slot.
        self._ctl_keys: tuple[bytes, ...] = (self._gen_key,) if cluster else ()
        self._cache_ttl = instance_cache_ttl_s
        # Connections open lazily on the first command, retried once on a
        # connection error only (RETRY_ONCE_ON_CONNECTION_ERROR says why).
        self._r: Any
        if cluster:
            from redis.asyncio.cluster import RedisCluster

            self._r = RedisCluster.from_url(
                url,
                decode_responses=False,
                socket_timeout=max(socket_timeout_s, write_timeout_s),
                socket_connect_timeout=socket_timeout_s,
                retry=RETRY_ONCE_ON_CONNECTION_ERROR,
                health_check_interval=0,
                max_connections=2 * max_connections,
                # A master may be down: the others keep serving their slots.
                require_full_coverage=False,
                **conn,
            )
        else:
            self._r = aioredis.Redis.from_url(
                url,
                decode_responses=False,
                socket_timeout=max(socket_timeout_s, write_timeout_s),
                socket_connect_timeout=socket_timeout_s,
                retry=RETRY_ONCE_ON_CONNECTION_ERROR,
                health_check_interval=0,
                max_connections=2 * max_connections,
                **conn,
            )
        # redis.asyncio leaves execute_command untyped; every call goes through this.
        self._exec = cast(Callable[..., Awaitable[Any]], self._r.execute_command)
        if cluster:
            self._exec = _client_faults_as_cluster_errors(self._exec)
        else:
            self._exec = _closed_transport_as_connection_error(self._exec)
        # The pools raise MaxConnectionsError at once when every connection is
        # in use; calls beyond max_connections wait here instead (FIFO). The
        # pools may hold twice as many: the cluster client releases a connection
        # it reconnects (after a topology change) only once that is done, and
        # meanwhile it counts against the pool.
        self._gate = asyncio.Semaphore(max_connections)
        #: Reads a router waits on give up after this (the sockets wait for writes).
        self._read_timeout = socket_timeout_s if write_timeout_s > socket_timeout_s else None
        #: How long a command may wait on its socket (a blocking read must wait less).
        self.socket_wait_s = max(socket_timeout_s, write_timeout_s)
        self._exec = _gated(self._exec, self._gate)
        #: Write scripts in flight at once (0: no bound of their own; None:
        #: DEFAULT_WRITES_IN_FLIGHT standalone, DEFAULT_CLUSTER_WRITES_IN_FLIGHT
        #: in cluster mode, where the masters apply in parallel). Redis runs one
        #: script at a time and a read queues behind every script sent before
        #: it: this bounds how many a Match waits for while ingest runs, and
        #: how many engines' batches the replica's loop works on at once.
        if max_writes_in_flight is None:
            max_writes_in_flight = (
                DEFAULT_CLUSTER_WRITES_IN_FLIGHT if cluster else DEFAULT_WRITES_IN_FLIGHT
            )
        self.max_writes_in_flight = max_writes_in_flight
        self._scripts = load_scripts(cluster)
        self._tracer = trace.get_tracer(TRACER_NAME) if tracing_enabled() else None
        if self._tracer is not None:
            # Bound once here, so that tracing off adds nothing to the call path.
            self._exec = traced_exec(self._exec, self._tracer, url, self._scripts.values())
        self._write = (
            _turns(self._exec, asyncio.Semaphore(max_writes_in_flight), write_timeout_s)
            if max_writes_in_flight > 0
            else self._exec
        )
        # cluster topology (see _topology): the copy-tag registry, its version,
        # each master's first ready copy tag, the probe list match.lua tries.
        self._tags: list[bytes] = []
        self._tag_state: dict[bytes, bytes] = {}
        self._tags_version: bytes | None = None
        self._tags_arg: list[Any] = [0]
        self._ready: list[bytes] = []
        self._node_ready: dict[str, bytes] = {}
        self._probes: dict[bytes, bytes] = {}
        self._tag_slots: dict[bytes, int] = {}
        self._topo_at = float("-inf")  # time.monotonic() of the last reload
        self._topo_loaded = False
        self._topo_busy = False
        self._upkeep: asyncio.Future[None] | None = None  # background re-drive (Match path)
        self._rr = 0
        self._plain_block = K.base(prefix) + K.BLOCK
        self._tags_key = K.key(self._ctl_prefix, K.TAGS)
        self._pend_key = K.key(self._ctl_prefix, K.PENDING)
        #: Requests sent to Redis (a pipeline counts once): the cost figure that
        #: KEYS.md promises, exposed for tests and benchmarks.
        self.round_trips = 0
        self._s_match = self._scripts["match"]
        self._s_apply = self._scripts["capply" if cluster else "apply"]
        #: Whether a replica watches this Redis (KEYS.md, "Watching"): its
        #: applies then carry the batch for the stream. Each apply's reply says;
        #: an apply without it while one watches is answered
        #: ``watch``, writing nothing, and sent again with the batch.
        self._watched = False
        # instance table cache
        self._by_name: dict[InstanceId, _Inst] = {}
        self._by_id: dict[bytes, _Inst] = {}
        #: The pending prefill last read, per model: (time.monotonic(), counts)
        #: (PENDING_REUSE_S). One entry per model Matched with predictions.
        self._pending_read: dict[str, tuple[float, dict[InstanceId, int]]] = {}
        #: Seconds the pending prefill read is reused (0: read at every Match).
        self.pending_reuse_s = PENDING_REUSE_S
        self._dead: set[bytes] = set()
        self._schema_ok = False
        self._gen: bytes | None = None
        self._refreshed_at = float("-inf")  # time.monotonic() of the last snapshot
        #: The instance-table read in flight, and the one queued after it for
        #: the callers that came meanwhile (see _refresh).
        self._reading: asyncio.Future[None] | None = None
        self._read_next: asyncio.Future[None] | None = None
        self._snap_clock = float("-inf")  # clock() just before the last snapshot
        # clock() from which a cached lease has run out since it was read: the
        # table must then be read again (another replica may have renewed it).
        self._recheck_at = float("-inf")
        self._excl_all: list[bytes] = []
        self._excl_stale_ok: list[bytes] = []
        self._excl_until = float("-inf")  # clock() at which a cached lease runs out
        self._excl_dirty = True
        # per-namespace constants: a bounded LRU (NS_CACHE_SIZE says why)
        self._ns_cache: OrderedDict[tuple[str, str], tuple[bytes, bytes, bytes]] = OrderedDict()
        self._ns_cap = ns_cache_size
        self._ns_names: dict[bytes, Namespace] = {}
        # (instance name, engine hash) -> (ns id, block key), as last written
        self._parents = _ParentCache(parent_cache_size)

    # -- plumbing ------------------------------------------------------------

    def _map_error(self, exc: Exception) -> KvmeshError:
        refused = self._refusal(exc)
        if refused is not None:
            return refused
        if isinstance(exc, ResponseError):
            msg = str(exc)
            head = msg.split(" ", 1)[0].encode()
            if head in _TRANSIENT:
                return Unavailable(f"redis: {msg}")
            if head == b"OOM":
                return ResourceExhausted(f"redis: {msg}")
            if "non local key" in msg or "hash slot" in msg:
                # Cluster slots moved under us: the topology is reloaded on the next call.
                return Unavailable(f"redis cluster: {msg}")
            return KvmeshError(f"redis: {msg}")
        hint = ""
        if self._tls_without_client_cert and "reset by peer" in str(exc):
            # A Redis with tls-auth-clients yes drops a client without a
            # certificate after the handshake: all we see is a reset.
            hint = (
                " (no client certificate is configured: a Redis with tls-auth-clients yes "
                "resets such connections; set redis.tls_cert_file and redis.tls_key_file)"
            )
        return Unavailable(f"redis unreachable: {exc.__class__.__name__}: {exc}{hint}")

    def _refusal(self, exc: BaseException) -> BackendAuthError | None:
        """A clear :class:`BackendAuthError` when ``exc`` (or its cause) means that
        Redis refused our credentials, ACL rights or TLS identity, else None."""
        user = self.username or "default"
        seen: set[int] = set()
        e: BaseException | None = exc
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            text = str(e)
            # redis-py keeps the reply's error code apart from the message.
            head = getattr(e, "status_code", None) or text.split(" ", 1)[0]
            if isinstance(e, PasswordFileError):
                return BackendAuthError(f"redis: {text}")
            in_script = "user executing the script can't" in text
            if in_script or isinstance(e, NoPermissionError) or head == "NOPERM":
                detail = text.rstrip(". ")
                if in_script:
                    # Redis names the script by SHA1 only; say which of ours it is.
                    detail = detail.split(" script: ", 1)[0]
                    sha = text.split(" script: ", 1)[-1].split(",", 1)[0].strip()
                    names = [sc.name for sc in self._scripts.values() if sc.sha == sha]
                    if names:
                        detail += f" (in the {names[0]} script)"
                return BackendAuthError(
                    f"redis: user {user!r} lacks an ACL permission at {self.where} "
                    f"(NOPERM: {detail}): grant it with ACL SETUSER {user} "
                    "(SECURITY.md lists the rule the indexer needs)"
                )
            if head == "NOAUTH" or (
                isinstance(e, AuthenticationError) and "authentication required" in text.lower()
            ):
                return BackendAuthError(
                    f"redis: authentication required at {self.where} (NOAUTH): "
                    "set redis.username and redis.password_file"
                )
            if (
                isinstance(e, AuthenticationError | AuthenticationWrongNumberOfArgsError)
                or head == "WRONGPASS"
            ):
                return BackendAuthError(
                    f"redis: authentication failed for user {user!r} at {self.where} "
                    "(WRONGPASS): check redis.username / redis.password_file"
                )
            if isinstance(e, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
                return BackendAuthError(
                    f"redis: TLS certificate of {self.where} does not verify "
                    f"({tls_reason(text)}): check redis.tls_ca_file / redis.tls_check_hostname"
                )
            if "CERTIFICATE_REQUIRED" in text or "certificate required" in text:
                return BackendAuthError(
                    f"redis: {self.where} requires a client certificate: "
                    "set redis.tls_cert_file and redis.tls_key_file"
                )
            if "alert bad certificate" in text.lower() or "UNKNOWN_CA" in text:
                return BackendAuthError(
                    f"redis: {self.where} refused our client certificate ({tls_reason(text)}): "
                    "check redis.tls_cert_file (it must be signed by a CA the server trusts)"
                )
            e = e.__cause__  # redis-py wraps with `raise ... from` (cluster discovery)
        return None

    async def _eval(self, script: Script, numkeys: int, *args: Any) -> Any:
        if self.cluster and script.name in CLUSTER_CONTROL:
            # Shielded: a caller that gives up (a deadline) while the script
            # runs must not skip spreading the generation it bumped, or
            # Matches on other replicas trust an old instance table.
            return await _shielded(self._eval_now(script, numkeys, *args))
        return await self._eval_now(script, numkeys, *args)

    async def _eval_now(self, script: Script, numkeys: int, *args: Any) -> Any:
        if not self._schema_ok:
            await self._check_schema()  # before this process's first script
        self.round_trips += 1
        try:
            try:
                name = script.name
                run = (
                    self._read
                    if name in _READ_SCRIPTS
                    else self._exec
                    if name in _PROMPT_SCRIPTS
                    else self._write
                )
                res = await run("EVALSHA", script.sha, numkeys, *args)
            except NoScriptError:
                # Redis restarted or SCRIPT FLUSH: load and run again.
                self.round_trips += 2
                if self.cluster:
                    node = self._r.get_node_from_key(args[0])
                    await self._exec("SCRIPT", "LOAD", script.text, target_nodes=node)
                else:
                    await self._exec("SCRIPT", "LOAD", script.text)
                res = await run("EVALSHA", script.sha, numkeys, *args)
        except CLIENT_ERRORS as exc:
            if self.cluster:
                # Reload the slot map soon: a slot may have moved, a master failed.
                soon = time.monotonic() - _TOPOLOGY_REFRESH_S + _TOPOLOGY_RETRY_S
                self._topo_at = min(self._topo_at, soon)
            raise self._map_error(exc) from exc
        if self.cluster and script.name in CLUSTER_CONTROL:
            reply, bumped = res if len(res) == 2 else (res[0], None)
            if bumped is not None:
                await self._spread_gen(bumped)
            return reply
        return res

    # -- cluster topology ----------------------------------------------------------

    def _slot_of_tag(self, tag: bytes) -> int:
        """Hash slot of the names tagged ``{tag}`` (cached)."""
        slot = self._tag_slots.get(tag)
        if slot is None:
            from redis.crc import key_slot

            slot = self._tag_slots[tag] = key_slot(b"{" + tag + b"}")
        return slot

    def _owner(self, slot: int) -> str | None:
        """The master serving ``slot`` in the client's slot map, which MOVED
        replies keep current between reloads; None when no master serves it."""
        nodes = self._r.nodes_manager.slots_cache.get(slot)
        return cast(str, nodes[0].name) if nodes else None

    def _served_owner(self, slot: int) -> str:
        owner = self._owner(slot)
        if owner is None:
            raise Unavailable(f"redis cluster: no master serves slot {slot}")
        return owner

    async def _topology(self) -> None:
        """Reload the slot map and the copy-tag registry, and give a copy tag to
        every master that serves none (KEYS.md, "Copy tags")."""
        self._topo_at = time.monotonic()
        try:
            await self._reload_topology()
        except KvmeshError:
            self._topo_at = time.monotonic() - _TOPOLOGY_REFRESH_S + _TOPOLOGY_RETRY_S
            raise
        if self._topo_busy:
            return  # called while seeding: the slot map and the tags are enough
        masters = sorted(n.name for n in self._r.get_primaries())
        if not self._tags:
            # A new index: one copy tag per master, with nothing to copy yet.
            cmds: list[Sequence[Any]] = []
            for m in masters:
                t = self._pick_tag(m)
                if t is not None:
                    cmds.append(("HSETNX", self._tags_key, t, b"r"))
            if cmds:
                cmds.append(("HINCRBY", self._tags_key, b"#", 1))
                await self._pipe(cmds)
                await self._load_tags()
        served = {self._owner(self._slot_of_tag(t)) for t in self._tags}
        due = [self._pick_tag(m) for m in masters if m not in served]
        now = time.time()
        for t, state in self._tag_state.items():
            if state[:1] == b"s" and now - float(state[1:] or 0) > _SEED_STALE_S:
                due.append(t)  # its seeder died
        for t in dict.fromkeys(due):
            if t is not None:
                await self._seed(t)

    async def _reload_topology(self) -> None:
        """The slot map (CLUSTER SLOTS) and the copy-tag registry."""
        self.round_trips += 1
        try:
            if self._topo_loaded:
                await self._r.nodes_manager.initialize()
            else:
                await self._r.initialize()
        except CLIENT_ERRORS as exc:
            raise self._map_error(exc) from exc
        except _CLUSTER_CLIENT_FAULTS as exc:
            raise Unavailable(
                f"redis cluster client fault: {exc.__class__.__name__}: {exc}"
            ) from exc
        self._topo_loaded = True
        await self._load_tags()

    def _pick_tag(self, master: str) -> bytes | None:
        """The first candidate tag whose slot ``master`` serves."""
        from redis.crc import key_slot

        for i in range(_NODE_TAG_SEARCH):
            t = K.node_tag(i)
            if self._owner(key_slot(t)) == master:  # not cached: most are tried once
                return t
        return None

    async def _load_tags(self) -> None:
        """Read the copy-tag registry; derive the probe lists of match.lua."""
        raw = dict(await self._cmd("HGETALL", self._tags_key))
        self._tags_version = raw.pop(b"#", b"")
        self._tag_state = raw
        self._tags = sorted(raw)
        self._tags_arg = [len(self._tags), *self._tags]
        ready = [t for t in self._tags if raw[t] == b"r"]
        self._ready = ready or self._tags
        order = ready + [t for t in self._tags if raw[t] != b"r"]
        self._node_ready = {}
        for t in reversed(ready):
            owner = self._owner(self._slot_of_tag(t))
            if owner is not None:
                self._node_ready[owner] = t
        self._probes = {b"": b" ".join(order)}
        for t in order:
            self._probes[t] = b" ".join([t, *(x for x in order if x != t)])

    def _probe(self, guess: bytes) -> bytes:
        """match.lua's copy tags: ``guess`` first, then the ready ones, then
        those being seeded."""
        got = self._probes.get(guess)
        return got if got is not None else self._probes.get(b"", b"")

    async def _seed(self, tag: bytes) -> None:
        """Give a master the copy tag ``tag`` and a full copy set under it.

        Registered first (as being seeded), so that every write from then on
        includes it; the writes still pending from before are re-driven; then
        the copies of a ready tag are merged in (never over a newer write) and
        checked against the control node ('k:'), which removes any copy a
        concurrent removal deleted before the merge wrote it; then it is ready.
        """
        self._topo_busy = True
        try:
            stamp = b"s%d" % int(time.time())
            await self._pipe(
                [("HSET", self._tags_key, tag, stamp), ("HINCRBY", self._tags_key, b"#", 1)]
            )
            await self._load_tags()
            with contextlib.suppress(Unavailable):
                await self._redrive_all()  # what stays pending is re-driven to tag later
            sources = [t for t in self._ready if t != tag and self._tag_state.get(t) == b"r"]
            for src in sources:
                try:
                    await self._copy_tag(src, tag)
                    break
                except Unavailable:
                    continue  # its master is down: try another copy
            gen = await self._cmd("GET", self._gen_key)
            if gen is not None:
                await self._eval(
                    self._scripts["cgen"],
                    1,
                    K.node_key(self._prefix, K.NODE_GEN, tag),
                    self._base,
                    gen,
                )
            await self._pipe(
                [("HSET", self._tags_key, tag, b"r"), ("HINCRBY", self._tags_key, b"#", 1)]
            )
            await self._load_tags()
        except KvmeshError:
            # Left half seeded: stamped as long dead, the next reload seeds it again.
            with contextlib.suppress(KvmeshError):
                await self._cmd("HSET", self._tags_key, tag, b"s0")
            raise
        finally:
            self._topo_busy = False

    async def _copy_tag(self, src: bytes, dst: bytes) -> None:
        """Merge the copies under ``src`` into ``dst``, then check them (``_seed``)."""
        index = K.node_key(self._prefix, K.NODE_COPIES, src)
        owner = self._served_owner(self._slot_of_tag(dst))
        dst_counts = K.node_key(self._prefix, K.NODE_COUNTS, dst)
        src_names = self._plain_block + b"{" + src + b"}"
        dst_names = self._plain_block + b"{" + dst + b"}"
        cursor: Any = 0
        while True:
            cursor, fields = await self._cmd("HSCAN", index, cursor, "COUNT", _SEED_CHUNK)
            names = list(fields)
            if names:
                copies = await self._pipe([("HGETALL", src_names + f) for f in names])
                ops: list[Any] = []
                checks: list[Any] = []
                for f, holders in zip(names, copies, strict=True):
                    kind = b"u" if len(f) == 17 else b"s"
                    suf = f[-16:]
                    for int_id, mask in holders.items():
                        ops += (dst_names + f, int_id, mask, kind + suf[:8])
                        checks += (int_id, suf, kind, mask)
                if ops:
                    await self._run_groups({owner: (dst_counts, ops)}, b"m")
                    await self._check_copies(checks)
            if int(cursor) == 0:
                return

    async def _check_copies(self, checks: list[Any]) -> None:
        """Fix merged copies that 'k:' contradicts; again for the ids whose fix a
        newer write superseded."""
        for _ in range(_DRIVE_ATTEMPTS):
            res = await self._eval(
                self._s_apply, 1, self._gen_key, self._base, b"", b"", b"v", *checks
            )
            epoch, _ids, tver, ops = res[1]
            if not ops:
                return
            dropped = await self._write_blocks(ops, epoch, tver)
            if not dropped:
                return
            checks = [
                x for j in range(0, len(checks), 4) if checks[j] in dropped
                for x in checks[j : j + 4]
            ]  # fmt: skip
        raise Unavailable("redis cluster: copies kept changing while seeding; retry later")

    async def _spread_gen(self, gen: Any) -> None:
        """Copy a new generation under every copy tag (a Match reads its node's copy)."""
        if not self._tags:
            await self._topology()
        script = self._scripts["cgen"]
        await asyncio.gather(
            *(
                self._eval(script, 1, K.node_key(self._prefix, K.NODE_GEN, t), self._base, gen)
                for t in self._tags
            ),
            return_exceptions=True,  # a master that is down gets it from a later refresh
        )

    async def maintain(self) -> None:
        """Cluster upkeep (KEYS.md, "Redis Cluster"): reload the slot map and the
        copy tags, seeding a master that serves none, then finish every write
        left pending (a replica that died, or a caller that gave up, between
        the two halves of an apply). The cluster code paths reload the slot map
        by themselves every few seconds, and an instance's next batch finishes
        its pending writes first; this is for everything else, and the reaper
        runs it. It also copies the current generation under every copy tag
        again, which bounds how long a copy a spread missed (its master was
        down, the process died in between) can hide a change from Matches.
        Nothing to do with a single Redis. Raises Unavailable when a write
        still fails: it stays pending, for the next call."""
        if not self.cluster:
            return
        await self._topology()
        gen = await self._cmd("GET", self._gen_key)
        if gen is not None:
            await self._spread_gen(gen)
        await self._redrive_all()

    async def _redrive_quietly(self) -> None:
        with contextlib.suppress(Unavailable):  # still pending: the next round
            await self._redrive_all()

    async def _redrive(self, *ids: bytes) -> None:
        """Finish the pending writes of these int ids, if they have any."""
        res = await self._eval(self._s_apply, 1, self._gen_key, self._base, b"", b"", b"r", *ids)
        await self._drive(res[1])

    async def _redrive_all(self) -> None:
        """Re-drive the pending record of every id that has one."""
        ids = sorted(await self._cmd("SMEMBERS", self._pend_key))
        failed: Unavailable | None = None
        for i in range(0, len(ids), _SEED_CHUNK):
            try:
                await self._redrive(*ids[i : i + _SEED_CHUNK])
            except Unavailable as exc:
                failed = exc  # the others still go
        if failed is not None:
            raise failed

    async def _drive(self, w: Sequence[Any]) -> None:
        """Write the data-node writes of a capply.lua reply (``W``) and confirm
        them, which drops the pending records they came from. When a newer
        write of the same instance superseded some of them (cblocks.lua drops
        writes under an older epoch), the records are re-driven under a new
        epoch, so that the batch is on the data nodes before it is acknowledged.
        Raises Unavailable when a write fails: the records stay pending."""
        for _ in range(_DRIVE_ATTEMPTS):
            epoch, ids, tver, ops = w
            if not epoch:
                return
            dropped = await self._write_blocks(ops, epoch, tver)
            if not dropped:
                await self._eval(
                    self._s_apply, 1, self._gen_key, self._base, b"", b"", b"c", epoch, *ids
                )
                return
            res = await self._eval(
                self._s_apply, 1, self._gen_key, self._base, b"", b"", b"r", *ids
            )
            w = res[1]
        raise Unavailable("redis cluster: concurrent writes for one instance; retry later")

    def _group(self, ops: Sequence[Any]) -> dict[str, tuple[bytes, list[Any]]]:
        """Block writes (location, suffix, id, mask quadruples) per master: the
        name to route by and cblocks.lua's quadruples. Shallow and unplaced
        entries go under every copy tag, deep ones under their anchor's tag."""
        plain = self._plain_block
        groups: dict[str, tuple[bytes, list[Any]]] = {}
        for j in range(0, len(ops), 4):
            loc, suf, int_id, mask = ops[j], ops[j + 1], ops[j + 2], ops[j + 3]
            c = loc[:1]
            if c == b"d":
                tag = loc[1:]
                name = plain + b"{" + tag + b"}" + suf
                owner = self._served_owner(self._slot_of_tag(tag))
                got = groups.get(owner)
                if got is None:
                    got = groups[owner] = (name, [])
                got[1].extend((name, int_id, mask, b"d" + suf[:8]))
            else:
                mid, cf = (b"}u", b"u" + suf[:8]) if c == b"u" else (b"}", b"s" + suf[:8])
                for t in self._tags:
                    served = self._owner(self._slot_of_tag(t))
                    if served is None:
                        continue  # no master serves it: no Match reads that copy either
                    name = plain + b"{" + t + mid + suf
                    got = groups.get(served)
                    if got is None:
                        got = groups[served] = (name, [])
                    got[1].extend((name, int_id, mask, cf))
        return groups

    async def _run_groups(
        self, groups: dict[str, tuple[bytes, list[Any]]], epoch: bytes
    ) -> set[bytes]:
        """One cblocks.lua per master, all at once; the ids whose writes a newer
        epoch superseded. Every script runs to its end before the first error
        is raised (none is left in flight behind the caller)."""
        script = self._scripts["cblocks"]
        got = await asyncio.gather(
            *(
                self._eval(script, 1, key, self._base, epoch, *self._tags_arg, *quads)
                for key, quads in groups.values()
            ),
            return_exceptions=True,
        )
        dropped: set[bytes] = set()
        for r in got:
            if isinstance(r, BaseException):
                raise r
            dropped.update(r)
        return dropped

    async def _write_blocks(
        self, ops: Sequence[Any], epoch: bytes = b"", tags_version: bytes | None = None
    ) -> set[bytes]:
        """Cluster: write block entries (location, suffix, id, mask quadruples)
        under write epoch ``epoch`` ('' unconditionally); return the ids whose
        writes were dropped as superseded. ``tags_version`` is the copy-tag
        registry version the control script saw: the tags are reread first
        when it is not ours. A write that meets a slot somewhere else than the
        slot map said reloads it and runs again (the writes are idempotent)."""
        if not ops:
            return set()
        if time.monotonic() - self._topo_at >= _TOPOLOGY_REFRESH_S:
            await self._topology()
        elif tags_version is not None and tags_version != self._tags_version:
            await self._load_tags()
        try:
            return await self._run_groups(self._group(ops), epoch)
        except Unavailable as exc:
            if not _slot_moved(exc):
                raise
        await self._topology()
        return await self._run_groups(self._group(ops), epoch)

    async def _cmd(self, *args: Any, read: bool = False) -> Any:
        """One command; ``read``: one a router waits on (``socket_timeout_s``)."""
        self.round_trips += 1
        try:
            return await (self._read(*args) if read else self._exec(*args))
        except CLIENT_ERRORS as exc:
            raise self._map_error(exc) from exc

    async def _pipe(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        if self._tracer is not None:
            with self._tracer.start_as_current_span(
                "pipeline",
                kind=trace.SpanKind.CLIENT,
                attributes={
                    **DB_ATTRS,
                    "db.operation.name": "pipeline",
                    "db.operation.batch.size": len(commands),
                },
            ):
                return await self._pipe_call(commands)
        return await self._pipe_call(commands)

    async def _pipe_call(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        self.round_trips += 1
        try:
            async with self._gate, self._r.pipeline(transaction=False) as p:
                for c in commands:
                    cast(Any, p).execute_command(*c)
                return list(await p.execute())
        except CLIENT_ERRORS as exc:
            raise self._map_error(exc) from exc
        except _CLUSTER_CLIENT_FAULTS as exc:
            if not self.cluster:
                raise
            raise Unavailable(
                f"redis cluster client fault: {exc.__class__.__name__}: {exc}"
            ) from exc

    def _anchor(self, model: str) -> int:
        """Depth of the anchor of ``model``'s chains (cluster layout; 0 standalone)."""
        if not self.cluster:
            return 0
        got = self._anchors.get(model)
        if got is None:
            a = self._anchor_depth
            got = _check_anchor(a if isinstance(a, int) else a(model))
            if len(self._anchors) >= self._ns_cap:
                self._anchors.clear()  # bounded by models in use, like the namespace LRU
            self._anchors[model] = got
        return got

    def _ns(self, model: str, lora: str) -> tuple[bytes, bytes, bytes]:
        """(ns id, block name prefix, ns registry value) of a namespace being
        written (so Redis holds it), kept in the namespace LRU."""
        key = (model, lora)
        got = self._ns_cache.get(key)
        if got is None:
            got = self._ns_make(model, lora)
            self._ns_keep(key, got)
        else:
            self._ns_cache.move_to_end(key)
        return got

    def _ns_make(self, model: str, lora: str) -> tuple[bytes, bytes, bytes]:
        nid = K.ns_id(model, lora)
        return nid, K.block_prefix(self._prefix, nid), K.ns_name(model, lora)

    def _ns_keep(self, key: tuple[str, str], got: tuple[bytes, bytes, bytes]) -> None:
        cache = self._ns_cache
        cache[key] = got
        self._ns_names[got[0]] = Namespace(*key)
        while len(cache) > self._ns_cap:
            _, (nid, _, _) = cache.popitem(last=False)
            self._ns_names.pop(nid, None)

    def _inst_key(self, instance: InstanceId) -> tuple[bytes, bytes]:
        name = K.instance_name(instance.worker_id, instance.dp_rank)
        return name, K.instance_key(self._ctl_prefix, name)

    # -- instance table cache --------------------------------------------------

    def _install(self, inst: _Inst) -> _Inst:
        old = self._by_name.get(inst.instance)
        if old is not None and old.int_id != inst.int_id:
            self._by_id.pop(old.int_id, None)
            self._dead.add(old.int_id)
        self._by_name[inst.instance] = inst
        self._by_id[inst.int_id] = inst
        self._excl_dirty = True
        return inst

    def _forget(self, instance: InstanceId) -> None:
        old = self._by_name.pop(instance, None)
        if old is not None:
            self._by_id.pop(old.int_id, None)
            self._dead.add(old.int_id)
        self._excl_dirty = True

    async def _check_schema(self) -> None:
        """Claim the key schema for this version, or refuse an index written by another."""
        key = K.schema_key(self._ctl_prefix)
        mine = str(K.SCHEMA_VERSION).encode()
        try:
            _, got = await self._pipe([("SET", key, mine, "NX"), ("GET", key)])
        except Unavailable as e:
            if self._cert_probe is None or "reset by peer" not in str(e):
                raise
            # The first contact: a refused client certificate can read as a
            # reset (client_cert_refusal says when); ask once, sending nothing.
            refused = await self._cert_probe()
            if refused is None:
                raise
            raise (self._refusal(refused) or e) from e
        if got != mine:
            raise FailedPrecondition(
                f"the index at this key prefix has key schema {got.decode(errors='replace')}, "
                f"this indexer uses {K.SCHEMA_VERSION} (indexer/redis/KEYS.md): run one version "
                "on one index, or give this one its own prefix",
                field="redis.prefix",
            )
        if self.cluster:
            # A Match looks for a chain's deep blocks under the tag its own
            # anchor names: replicas under two rules answer each other's chains
            # short, silently. The first replica's rule is the index's.
            akey = K.anchor_key(self._ctl_prefix)
            rule = self._anchor_rule.encode()
            _, held = await self._pipe([("SET", akey, rule, "NX"), ("GET", akey)])
            if held != rule:
                raise FailedPrecondition(
                    f"the index at this key prefix places chains by anchor rule "
                    f"{held.decode(errors='replace')!r}, this replica by {self._anchor_rule!r} "
                    "(redis.cluster_anchor_depth / redis.cluster_anchor_tokens; KEYS.md, "
                    '"Redis Cluster"): give every replica the same, or this one its own prefix',
                    field="redis.cluster_anchor_depth",
                )
        self._schema_ok = True

    async def _refresh(self) -> None:
        """Read the whole instance table (``snapshot.lua``) into the cache.

        Callers at once share reads: each waits for a read that starts after
        its call (the one in flight may have read the table before a change
        the caller already saw), so at most one read is in flight and one
        queued, whatever the number of callers. A fleet's engines registering
        together each read the table (the capacity check), and each first
        batch did again: 128 reads at once at the start of a 64-engine ingest,
        80 ms each on the loop and in Redis, and O(N^2) rows for N engines.
        """
        nxt = self._read_next
        if nxt is None:
            nxt = self._read_next = asyncio.get_running_loop().create_future()
            # A failed read reaches every caller still waiting; none may be left.
            nxt.add_done_callback(lambda f: f.cancelled() or f.exception())
            if self._reading is None:
                self._start_read()
        await asyncio.shield(nxt)

    def _start_read(self) -> None:
        """Start the queued read (:meth:`_refresh`); the next waits for its end."""
        fut, self._read_next = self._read_next, None
        if fut is None:
            return
        self._reading = fut
        task = asyncio.ensure_future(self._read_table())

        def done(t: asyncio.Task[None]) -> None:
            self._reading = None
            if t.cancelled():
                fut.cancel()
            elif (exc := t.exception()) is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(None)
            self._start_read()

        task.add_done_callback(done)

    async def _read_table(self) -> None:
        snap_clock = self._clock()
        res = await self._eval(
            self._scripts["snapshot"], len(self._ctl_keys), *self._ctl_keys, self._base
        )
        gen, dead, *rows = res
        by_name: dict[InstanceId, _Inst] = {}
        by_id: dict[bytes, _Inst] = {}
        for row in rows:
            if row[0] is None:
                continue  # removed between ZRANGE and HMGET cannot happen in a script
            inst = _parse_inst(row)
            by_name[inst.instance] = inst
            by_id[inst.int_id] = inst
        self._by_name, self._by_id = by_name, by_id
        self._dead = set(dead)
        self._gen = gen
        self._refreshed_at = time.monotonic()
        self._snap_clock = snap_clock
        self._excl_dirty = True

    def _recompute_exclusions(self, now: float) -> None:
        """Exclusion lists at ``now``, when they next change, and when a cached
        lease next runs out after it was read (``_recheck_at``).

        A lease that had already run out when the snapshot was taken needs no
        second look: reviving it bumps the generation. One that ran out since
        may have been renewed elsewhere (renewals do not bump it), so the
        table is read again at the first Match the bound allows.
        """
        excl_all = list(self._dead)
        excl_stale_ok = list(self._dead)
        until = recheck = float("inf")
        snap = self._snap_clock
        for inst in self._by_name.values():
            exp = inst.exp
            if exp > snap and exp < recheck:
                recheck = exp
            if exp <= now:
                excl_all.append(inst.int_id)
                excl_stale_ok.append(inst.int_id)
            else:
                if exp < until:
                    until = exp
                if inst.stale:
                    excl_all.append(inst.int_id)
        self._excl_all, self._excl_stale_ok = excl_all, excl_stale_ok
        self._excl_until = until
        self._recheck_at = recheck if self._gen is not None else float("-inf")
        self._excl_dirty = False

    def _exclusions(self, now: float, include_stale: bool) -> list[bytes]:
        """The int ids a Match at ``now`` leaves out (retired, lease run out per
        the cache, stale unless ``include_stale``)."""
        if self._excl_dirty or now >= self._excl_until:
            self._recompute_exclusions(now)
        return self._excl_stale_ok if include_stale else self._excl_all

    # -- instances -------------------------------------------------------------

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """Create, renew or reset an instance (see :mod:`indexer.index`)."""
        if self.cluster:
            # A reset's old id must be purged from the data nodes even when the
            # caller gives up: a Match there cannot tell a retired id (KEYS.md).
            return await _shielded(self._register(spec))
        return await self._register(spec)

    async def _register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        now = self._clock()
        name, ikey = self._inst_key(spec.instance)
        q = spec.quota or _NO_QUOTA
        res = await self._eval(
            self._scripts["register"],
            1,
            ikey,
            self._base,
            name,
            spec.instance.worker_id.encode(),
            str(spec.instance.dp_rank),
            spec.model.encode(),
            spec.address.encode(),
            repr(float(spec.lease_ttl_s)),
            spec.incarnation.encode(),
            repr(float(now)),
            q.identity.encode(),
            q.max_instances,
            q.max_namespaces,
            K.ns_id(spec.model),
        )
        if res[0] == b"quota":
            raise _over_quota(q.identity, res[1], int(res[2]))
        reset, dead, row = res
        inst = self._install(_parse_inst(row))
        if dead:
            self._dead.add(dead)
            await self._purge(dead)
        else:
            # Perhaps the retry of a reset whose caller gave up while its purge ran.
            await self._purge_leftovers()
        return inst.state(now), bool(reset)

    async def heartbeat(self, instance: InstanceId) -> InstanceState:
        """Renew the lease; NotFound for an unknown instance."""
        now = self._clock()
        name, ikey = self._inst_key(instance)
        row = await self._eval(
            self._scripts["heartbeat"], 1, ikey, self._base, name, repr(float(now))
        )
        if row is None:
            self._forget(instance)
            raise NotFound(f"instance {instance} is not registered", field="instance")
        return self._install(_parse_inst(row)).state(now)

    async def _remove(self, instance: InstanceId, mode: bytes, now: float) -> int | None:
        name, ikey = self._inst_key(instance)
        res = await self._eval(
            self._scripts["remove"], 1, ikey, self._base, name, repr(float(now)), mode
        )
        if res is None:
            return None
        dead, row = res
        self._forget(instance)
        if dead:
            self._dead.add(dead)
            await self._purge(dead)
        return int(row[10] or 0)

    async def remove_instance(self, instance: InstanceId) -> int:
        """Drop an instance and its blocks; return the (key, tier) entries dropped."""
        call = self._remove(instance, b"remove", self._clock())
        dropped = await (_shielded(call) if self.cluster else call)
        if dropped is None:
            # Perhaps the retry of a removal whose caller gave up while its
            # purge ran: that removal is acknowledged by this answer, so the
            # purges left unfinished are done first (no blocks of it reported after).
            await self._purge_leftovers()
            raise NotFound(f"instance {instance} is not registered", field="instance")
        return dropped

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        """Registered instances (of ``model`` when given), sorted by id."""
        await self._refresh()
        now = self._clock()
        return [
            inst.state(now)
            for _, inst in sorted(self._by_name.items())
            if not model or inst.spec.model == model
        ]

    async def reap_expired(self) -> list[InstanceId]:
        """Drop every instance whose lease has expired; return their ids.

        In Cluster mode it first finishes data-node writes left pending (by a
        stalled master, a timeout or a cancelled caller), so a replica that
        serves no Match still drives them.
        """
        if self.cluster:
            with contextlib.suppress(Unavailable):
                await self.maintain()
        now = self._clock()
        for dead in await self._cmd("SMEMBERS", K.key(self._ctl_prefix, K.DEAD)):
            await self._purge(dead)  # left over by an interrupted purge
        names = await self._cmd(
            "ZRANGEBYSCORE", K.key(self._ctl_prefix, K.LEASES), "-inf", repr(float(now))
        )
        reaped: list[InstanceId] = []
        for name in names:
            worker, _, rank = bytes(name).rpartition(b"\x00")
            instance = InstanceId(worker.decode(), int(rank))
            if await self._remove(instance, b"reap", now) is not None:
                reaped.append(instance)
        return sorted(reaped)

    async def _purge_leftovers(self) -> None:
        """Finish every purge left unfinished (``P:dead``).

        The retry of a write cut after it retired an id (a removal, a reset, a
        clear) acknowledges that write, so the old id's entries go first; a
        purge is idempotent. One SMEMBERS when nothing is left.
        """
        for dead in await self._cmd("SMEMBERS", K.key(self._ctl_prefix, K.DEAD)):
            await self._purge(dead)

    async def _purge(self, int_id: bytes) -> None:
        if self.cluster:
            await self._purge_cluster(int_id)
            return
        script = self._scripts["purge"]
        while await self._eval(script, 0, self._base, int_id, PURGE_CHUNK):
            pass

    async def _purge_cluster(self, int_id: bytes) -> None:
        """Cluster: delete a chunk's data-node entries first, then its control
        fields (next call), so an interrupted purge only ever leaves control
        fields whose entries may be gone: the next purge repeats them. Once
        'k:<id>' is empty, the same for the id's pending record (entries whose
        place only it knows), then the id's version on each data node goes."""
        script = self._scripts["cpurge"]
        phase: bytes = b""
        done: list[bytes] = []
        while True:
            res = await self._eval(
                script, 1, *self._ctl_keys, self._base, int_id, PURGE_CHUNK, phase, *done
            )
            phase = res[0]
            if not phase:
                break
            tver = res[1]
            chunk = res[3:] if phase == b"k" else res[2:]
            ops: list[Any] = []
            for j in range(0, len(chunk), 2):
                if phase == b"k":
                    ops += (chunk[j + 1][1:], chunk[j], int_id, b"0")
                else:
                    for loc in _unpack_locations(chunk[j + 1]):
                        ops += (loc, chunk[j], int_id, b"0")
            await self._write_blocks(ops, b"", tver)
            done = chunk[0::2]
        groups: dict[str, tuple[bytes, list[Any]]] = {}
        for t in self._tags:
            owner = self._owner(self._slot_of_tag(t))
            if owner is not None and owner not in groups:
                key = K.node_key(self._prefix, K.NODE_COUNTS, t)
                groups[owner] = (key, [b"", int_id, b"", b""])
        with contextlib.suppress(Unavailable):  # a version left behind costs a few bytes
            await self._run_groups(groups, b"")

    # -- events ----------------------------------------------------------------

    def _encode(
        self,
        inst: _Inst,
        batch: EventBatch,
        fetched: dict[int, bytes | None],
        use_cache: bool,
    ) -> tuple[list[Any], set[int], dict[int, tuple[bytes, int]]]:
        """Build the apply ARGV tail; return (args, parents to fetch, mappings written).

        Parent mappings come from, in order: this batch's earlier stores, the
        cache (when ``use_cache``), ``fetched`` (HMGET). Those from the last two
        are "beliefs" the script checks before writing anything.
        """
        model = inst.spec.model
        name = inst.name
        cache = self._parents
        overlay: dict[int, tuple[bytes, int]] = {}
        beliefs: dict[int, bytes] = {}
        missing: set[int] = set()
        namespaces: dict[bytes, bytes] = {}
        ops: list[Any] = []
        cleared = False
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                nid, _, nsname = self._ns(model, ev.lora_name)
                namespaces[nid] = nsname
                hashes = ev.block_hashes
                parent = ev.parent_block_hash
                if ev.block_keys is not None:
                    ks: Sequence[int] = ev.block_keys
                    parent_arg = b""
                elif parent is None:
                    ks = self._chain(namespace_seed(model, ev.lora_name), ev)
                    parent_arg = b""
                else:
                    # (ns id, block key) the parent maps to
                    value: tuple[bytes, int] | None
                    if not 0 <= parent < 1 << 64:
                        # No such engine hash can be mapped: orphans, as for any unknown parent.
                        parent_arg, value = b"\xff" * 9, None
                    elif (parent_arg := K.u64(parent)) and parent in overlay:
                        value = overlay[parent]
                    elif cleared:
                        value = None
                    elif parent in beliefs:
                        value = _mapping(beliefs[parent])
                    elif use_cache and (value := cache.get((name, parent))) is not None:
                        beliefs[parent] = value[0] + K.u64(value[1])
                    elif parent in fetched:
                        got = fetched[parent]
                        value = _mapping(got)
                        beliefs[parent] = got or b""
                    else:
                        missing.add(parent)
                        continue
                    # () where the parent is unknown: the script counts the orphans
                    ks = () if value is None or value[0] != nid else self._chain(value[1], ev)
                kb = _pack(ks, "block_keys")
                hb = _pack(hashes, "block_hashes")
                ops += (
                    _OP_STORE_COPY if batch.counts_copies else _OP_STORE,
                    nid,
                    ev.tier.bit,
                    parent_arg,
                    hb,
                    kb,
                )
                if self.cluster:
                    # The engine hash whose location the chain continues; b"" for
                    # a chain that starts a prompt, b"?" where the event does not
                    # say (KEYS.md, "Unplaced blocks").
                    if parent is None:
                        ops.append(b"" if ev.position_known else b"?")
                    else:
                        ops.append(K.u64(parent) if 0 <= parent < 1 << 64 else b"?")
                if ks:
                    # an event may carry fewer keys than hashes (or more): pairs as far as both go
                    overlay.update(zip(hashes, zip(itertools.repeat(nid), ks), strict=False))
            elif isinstance(ev, BlockRemoved):
                mask = ALL_TIERS_MASK if ev.tier is None else ev.tier.bit
                op = _OP_REMOVE_COPY if batch.counts_copies else _OP_REMOVE
                ops += (op, mask, _pack(ev.block_hashes, "block_hashes"))
                for h in ev.block_hashes:
                    cache.pop((name, h))
            elif isinstance(ev, AllBlocksCleared):
                ops.append(_OP_CLEAR)
                overlay.clear()
                cleared = True
            else:  # pragma: no cover - exhaustive over Event
                raise InvalidArgument(f"unknown event {type(ev).__name__}", field="events")
        args: list[Any] = [len(beliefs)]
        for h, v in beliefs.items():
            args += (K.u64(h), v)
        args.append(len(namespaces))
        for nid, nsname in namespaces.items():
            args += (nid, nsname)
        args += ops
        return args, missing, overlay

    def _quota_args(self, quota: Quota | None, model: str) -> list[Any]:
        """The quota's part of an apply's ARGV (lib.lua ``q_begin``)."""
        q = quota or _NO_QUOTA
        base = self._ns(model, "")[0]
        free = b"".join(self._ns(model, lora)[0] for lora in q.free_loras)
        return [q.max_blocks_per_instance, q.max_blocks, q.max_namespaces, base, free]

    async def quota_usage(self, identity: str) -> QuotaUsage:
        """See :meth:`Index.quota_usage`."""
        got = await self._cmd(
            "HMGET",
            K.key(self._ctl_prefix, K.QUOTA + identity.encode()),
            "i",
            "n",
            "b",
            read=True,
        )
        i, n, b = (int(v or 0) for v in got)
        return QuotaUsage(i, n, b)

    @staticmethod
    def _chain(parent_key: int, ev: BlockStored) -> list[int]:
        try:
            return chain_keys(parent_key, ev.token_ids, ev.block_size, encoded_extras(ev.extras))
        except ValueError as exc:  # TokenIdError is a ValueError
            raise InvalidArgument(str(exc), field="token_ids") from None

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch (see :mod:`indexer.index`); one EVALSHA when warm, a
        long one in parts of :attr:`apply_part_blocks` (KEYS.md, "Apply in parts")."""
        if self.cluster:
            # A clear's old id must be purged from the data nodes, and the
            # batch's data-node half written, even when the caller gives up.
            return await _shielded(self._apply_batch(batch))
        return await self._apply_batch(batch)

    async def _apply_batch(self, batch: EventBatch) -> ApplyResult:
        # A batch in parts goes on to its last even when the caller gives up (a
        # deadline, a closed stream), as a memory replica's sliced apply does:
        # only a replica that dies leaves one midway.
        if self.apply_part_blocks and _in_parts(batch, self.apply_part_blocks):
            return await _shielded(self._apply_parts(batch, (0, 0)))
        got = await self._apply(batch)
        if isinstance(got, bytes):
            # Parts of it are in (a replica that cut it otherwise was cut off): go on.
            return await _shielded(self._apply_parts(batch, _position(got, batch.events)))
        return got

    def part_counters(self) -> dict[str, int | dict[str, int]]:
        """Batches applied in parts and their parts, for the replica's metrics
        (``kvmesh_indexer_<name>_total``)."""
        return {
            "redis_batches_in_parts": self.batches_in_parts,
            "redis_apply_parts": self.apply_parts,
        }

    async def _apply_parts(self, batch: EventBatch, pos: tuple[int, int]) -> ApplyResult:
        """Apply ``batch`` a part at a time, each part one script.

        Redis keeps how far the batch got (``pp``), so each part applies once
        whichever replica sends it, and a retry of a batch cut off midway (the
        caller gave up, a connection failed) goes on where it stopped: a part
        that does not start there is answered with the position. Readers
        meanwhile see the batch applied up to some part, as on a replica
        applying a long batch a slice at a time. The sequence, the gap and the
        stale flag are recorded by the last part, which answers the whole
        batch's counts (Redis adds each part's to ``pp``, whichever replica
        applied it). ``pos``: where to start (event, block).
        """
        self.batches_in_parts += 1
        limit = self.apply_part_blocks or APPLY_PART_BLOCKS
        events = batch.events
        for _ in range(4 * _blocks_of(batch) // limit + 2 * _APPLY_ATTEMPTS + 8):
            part, end = _cut(events, pos, limit)
            last = end[0] >= len(events)
            stop = "end" if last else f"{end[0]}:{end[1]}"
            marker = f"{batch.sequence} {pos[0]}:{pos[1]} {stop}"
            self.apply_parts += 1
            got = await self._apply(dataclasses.replace(batch, events=part), marker)
            if isinstance(got, bytes):
                # Where the batch stands (another replica's parts, a retry).
                pos = _position(got, events)
                continue
            if got.outcome is BatchOutcome.DUPLICATE or last:
                # (The last part's counts are the whole batch's, every part's.)
                return got
            pos = end
        raise Unavailable(f"apply for {batch.instance}: its parts did not go in order, retry later")

    async def _apply(self, batch: EventBatch, part: str = "") -> ApplyResult | bytes:
        """Apply ``batch`` in one script: the whole batch, or one ``part`` of a
        long one (``'seq start stop'``, see :meth:`_apply_parts`; then the
        position Redis holds for the batch, where the part does not start there)."""
        instance = batch.instance
        inst = self._by_name.get(instance)
        if inst is None:
            await self._refresh()
            inst = self._by_name.get(instance)
            if inst is None:
                raise FailedPrecondition(f"instance {instance} is not registered", field="instance")
        fetched: dict[int, bytes | None] = {}
        use_cache = True
        watched: tuple[bytes, bytes] | tuple[()] = ()
        if self._watched:
            watched = self._watch_op(batch)
        for _attempt in range(_APPLY_ATTEMPTS):
            quota_args = self._quota_args(batch.quota, inst.spec.model)
            args, missing, written = self._encode(inst, batch, fetched, use_cache)
            while missing:
                emap = K.emap_key(self._ctl_prefix, inst.int_id)
                order = sorted(missing)
                vals = await self._cmd("HMGET", emap, *(K.u64(h) for h in order))
                fetched.update(zip(order, vals, strict=True))
                args, missing, written = self._encode(inst, batch, fetched, use_cache)
            now = self._clock()
            res = await self._eval(
                self._s_apply,
                1,
                K.instance_key(self._ctl_prefix, inst.name),
                self._base,
                repr(float(now)),
                part or str(batch.sequence),
                inst.spec.model.encode(),
                inst.name,
                batch.incarnation.encode(),
                batch.address.encode(),
                *((self._anchor(inst.spec.model),) if self.cluster else ()),
                *quota_args,
                *args,
                *watched,
            )
            status = res[0]
            if status == b"ok":
                writes: Sequence[Any] = ()
                # Cluster: retired ids as one list, then the data-node writes;
                # standalone: the retired ids last, one by one.
                if self.cluster:
                    retired, writes, watching = res[10], res[11], res[12]
                else:
                    watching, retired = res[10], res[11:]
                _, gap, stale, exp, bits, stored, removed, orphaned, int_id, over = res[:10]
                self._watched = bool(watching)
                if inst.exp <= now:
                    self._excl_dirty = True  # a lapsed lease was renewed
                inst.exp = float(exp)
                inst.bits = int(bits)
                if not part or part.endswith(" end"):  # (the last part records it)
                    inst.seq = batch.sequence
                if batch.address and batch.address != inst.spec.address:
                    # The address fence held: Redis has this address, which
                    # another replica registered since our read. This replica's
                    # own write shows it at once, not after the next reread.
                    inst.spec = dataclasses.replace(inst.spec, address=batch.address)
                if bool(stale) != inst.stale:
                    inst.stale = bool(stale)
                    self._excl_dirty = True
                if int_id != inst.int_id:
                    self._by_id.pop(inst.int_id, None)
                    self._dead.add(inst.int_id)
                    inst.int_id = int_id
                    self._by_id[int_id] = inst
                    self._excl_dirty = True
                if not over:
                    # (A store cut by a quota did not write every mapping it chained.)
                    self._parents.put(inst.name, written)
                if writes:
                    # The data-node half; acknowledged only once it is written. On
                    # failure the writes stay pending (KEYS.md, "Apply: two phases").
                    await self._drive(writes)
                for dead in retired:
                    await self._purge(dead)
                return ApplyResult(
                    outcome=BatchOutcome.APPLIED_AFTER_GAP if gap else BatchOutcome.APPLIED,
                    applied_sequence=batch.sequence,
                    blocks_stored=int(stored),
                    blocks_removed=int(removed),
                    blocks_orphaned=int(orphaned),
                    stale=bool(stale),
                    blocks_over_quota=int(over),
                )
            if status == b"part":
                if inst.exp <= now:
                    self._excl_dirty = True
                inst.exp = float(res[2])
                if self.cluster:
                    # The data-node writes an earlier part left pending, first.
                    await self._drive(res[3])
                return bytes(res[1])
            if status == b"watch":
                # A replica watches: the batch goes to the change stream with it.
                self._watched = True
                watched = self._watch_op(batch)
                continue
            if status == b"inc":
                raise fenced_out(batch)
            if status == b"addr":
                raise fenced_out(batch, "address")
            if status == b"dup":
                _, seq, stale, exp, bits, *pending = res
                if inst.exp <= now:
                    self._excl_dirty = True
                inst.exp = float(exp)
                if bool(stale) != inst.stale:
                    # Acknowledged with the stale flag Redis holds (another
                    # replica's gap or resync): this replica's Matches show it at once.
                    inst.stale = bool(stale)
                    self._excl_dirty = True
                if pending:
                    # Cluster: writes the instance left pending (a retry of a batch
                    # cut off after its control half) are written before the ack.
                    await self._drive(pending[0])
                # Perhaps the retry of a clear whose caller gave up while its purge ran.
                await self._purge_leftovers()
                return ApplyResult(BatchOutcome.DUPLICATE, int(seq), stale=bool(stale))
            # Our view of the instance is outdated: reread and retry from Redis.
            await self._refresh()
            got = self._by_name.get(instance)
            if status == b"noreg" or got is None:
                raise FailedPrecondition(f"instance {instance} is not registered", field="instance")
            inst = got
            use_cache = False
            fetched = {}
        raise Unavailable(f"apply for {instance}: concurrent updates, retry later")

    # -- watching (KEYS.md, "Watching") ----------------------------------------

    @staticmethod
    def _watch_op(batch: EventBatch) -> tuple[bytes, bytes]:
        """The apply's ``W`` op: the batch as applied (without its fences), for the stream."""
        applied = dataclasses.replace(batch, incarnation="", address="", quota=None)
        return b"W", wire.batch_to_pb(applied).SerializeToString()

    async def watch_start(self, backlog: int, lease_s: float) -> tuple[int, bytes]:
        """Start (or go on) watching: every change is appended to the stream, which
        keeps about ``backlog`` entries, for ``lease_s`` unless renewed, route-time
        predictions included. Returns the number and stream id of its last entry
        (a reader reads after them)."""
        n, last = await self._eval(
            self._scripts["wstart"],
            len(self._ctl_keys),
            *self._ctl_keys,
            self._base,
            str(backlog),
            str(max(1, round(lease_s * 1000))),
            repr(float(self._clock())),
        )
        self._watched = True
        return int(n), bytes(last)

    async def watch_names(self) -> list[bytes]:
        """Every registered instance's name (``P:lease``)."""
        return list(await self._cmd("ZRANGE", self._base + b"lease", 0, -1))

    async def watch_read(
        self, name: bytes
    ) -> tuple[
        int, InstanceState | None, EventBatch | None, list[tuple[str, list[int], float, float]]
    ]:
        """Instance ``name`` as a watching replica copies it, read at once, with the
        number of the stream's last entry then: ``(number, state, content,
        predicted)``; state and content None when it is not registered.
        ``content`` holds its blocks as stores of keys (and its copies), as
        MemoryIndex.load_instance takes them; ``predicted`` its route-time
        predictions unexpired as ``(lora name, keys, expiry, pending until)`` runs
        (pending until 0: while predicted), soonest to
        expire first (one of a namespace no instance ever stored in, whose
        name Redis does not hold, is left out: advice, gone at its expiry)."""
        got = await self._eval(
            self._scripts["wread"],
            len(self._ctl_keys),
            *self._ctl_keys,
            self._base,
            name,
            repr(float(self._clock())),
        )
        n = int(got[0]) if got[0] else 0
        if len(got) == 1:
            return n, None, None, []
        inst = _parse_inst(got[1])
        names = got[4]
        lora_of: dict[bytes, str] = {}
        named: set[bytes] = set()  # ns ids whose name Redis holds
        for i in range(0, len(names), 2):
            nsname = bytes(names[i + 1])
            lora_of[bytes(names[i])] = nsname.partition(b"\0")[2].decode("utf-8")
            if nsname:
                named.add(bytes(names[i]))
        runs: dict[tuple[str, Tier], tuple[list[int], list[int]]] = {}
        entries = got[2]
        keyed: dict[int, bytes] = {}
        for i in range(0, len(entries), 3):
            h = int.from_bytes(entries[i], "big")
            suf = keyed[h] = bytes(entries[i + 1])
            mask = int(entries[i + 2])
            lora = lora_of.get(suf[:8], "")
            key = int.from_bytes(suf[8:], "big")
            for tier in Tier:
                if mask & tier.bit:
                    run = runs.setdefault((lora, tier), ([], []))
                    run[0].append(h)
                    run[1].append(key)
        copies = []
        flat = got[3]
        for i in range(0, len(flat), 2):
            field = bytes(flat[i])
            count = int(flat[i + 1])
            h = int.from_bytes(field[:8], "big")
            held = keyed.get(h)
            if held is not None and count > 0:
                tier = next(t for t in Tier if t.bit == int(field[8:]))
                copies.append(
                    (h, int.from_bytes(held[8:], "big"), lora_of.get(held[:8], ""), tier, count)
                )
        events = keyed_stores(runs, copies)
        state = inst.state(self._clock())
        content = EventBatch(inst.spec.instance, inst.seq or 0, tuple(events), counts_copies=True)
        predicted: list[tuple[str, list[int], float, float]] = []
        flat = got[5]
        last: tuple[bytes, float, float] | None = None
        for i in range(0, len(flat), 3):
            suf = bytes(flat[i])
            expiry = float(flat[i + 1])
            # Its pending deadline: the expiry when none is shorter (or none recorded).
            until = float(flat[i + 2]) if flat[i + 2] else expiry
            at = (suf[:8], expiry, 0.0 if until >= expiry else until)
            if suf[:8] not in named:
                continue
            if at != last:
                predicted.append((lora_of[suf[:8]], [], at[1], at[2]))
                last = at
            predicted[-1][1].append(int.from_bytes(suf[8:], "big"))
        return n, state, content, predicted

    async def watch_tail(
        self, after: bytes, count: int, block_ms: int | None
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The stream's entries after id ``after``, at most ``count``, waiting up to
        ``block_ms`` for the first (None: not at all): ``[(id, fields)]``."""
        block = ("BLOCK", block_ms) if block_ms is not None else ()
        got = await self._cmd("XREAD", "COUNT", count, *block, "STREAMS", self._base + b"w", after)
        if not got:
            return []
        # [[stream, [(id, {field: value}), ...]]] as redis-py parses it (a flat
        # [f, v, ...] list without its reply callbacks).
        out = []
        for eid, fields in got[0][1]:
            if not isinstance(fields, dict):
                it = iter(fields)
                fields = dict(zip(it, it, strict=False))
            out.append((bytes(eid), {bytes(k): bytes(v) for k, v in fields.items()}))
        return out

    # -- reads -----------------------------------------------------------------

    async def match(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        include_stale: bool = False,
        include_predicted: bool = False,
    ) -> list[InstanceMatch]:
        """Per-instance longest gap-free prefix of ``keys``, deepest first (one EVALSHA).

        The instance table comes from the cache, read again first when a
        cached lease has run out since it was read, and checked by the script
        against ``P:gen`` once it is older than ``instance_cache_ttl_s``: a
        moved generation makes the script answer nothing, and the Match reads
        the table and asks again (three round trips instead of one).
        ``include_predicted``: see :meth:`_match_predicted`.
        """
        if include_predicted:
            return (await self._match_predicted(namespace, keys, include_stale, False))[0]
        if not keys:
            return []
        nskey = (namespace.model, namespace.lora_name)
        ns = self._ns_cache.get(nskey)
        known_ns = ns is not None
        if ns is None:
            ns = self._ns_make(*nskey)  # kept below only if Redis holds it
        else:
            self._ns_cache.move_to_end(nskey)
        blob = _pack(keys, "keys")
        now = self._clock()
        # Past the bound the cached table may be outdated: check or reread it.
        due = time.monotonic() - self._refreshed_at >= self._cache_ttl
        refreshed = False
        excl = self._exclusions(now, include_stale)
        if due and now >= self._recheck_at:
            await self._refresh()  # a cached lease ran out (or nothing was read yet)
            refreshed, due = True, False
            excl = self._exclusions(now, include_stale)
        if self.cluster:
            na = self._anchor(namespace.model)
            res = await self._match_cluster(ns[0], na, keys, blob, excl)
            if res[0] != self._gen and due:
                await self._refresh()
                refreshed = True
                if res[0] != self._gen and self._gen:
                    await self._spread_gen(self._gen)  # a restarted master lost its copy
                fresh = self._exclusions(now, include_stale)
                if list(fresh) != list(excl):
                    # The answer left out what the old table excluded (an
                    # instance revived elsewhere): ask again with the new one.
                    excl = fresh
                    res = await self._match_cluster(ns[0], na, keys, blob, excl)
        else:
            check = (b"=" + self._gen,) if due and self._gen is not None else ()
            args = (self._base, self._gen_key, ns[1], ns[1], 0, blob)
            res = await self._eval(self._s_match, 0, *args, *check, *excl)
            if len(res) == 1:
                # The table changed since our snapshot: our exclusions may hide
                # a live instance or keep a removed one. Reread, ask again.
                await self._refresh()
                refreshed = True
                excl = self._exclusions(now, include_stale)
                res = await self._eval(self._s_match, 0, *args, *excl)
        first = res[1]
        if first and not known_ns:
            self._ns_keep(nskey, ns)  # Redis holds blocks of it: a real namespace
        # (int id, gpu, cpu, disk): candidates the script walked past block 1,
        # then the other holders of block 0, which matched exactly one block.
        rows = [(res[j], res[j + 1], res[j + 2], res[j + 3]) for j in range(2, len(res), 4)]
        skip = {r[0] for r in rows}
        skip.update(excl)
        for j in range(0, len(first), 2):
            if first[j] not in skip:
                rows.append((first[j], *_DEPTH1_TIERS[int(first[j + 1])]))
        out = self._hits(rows, now, include_stale, checked=refreshed)
        if out is None:
            # An id the cache does not know: a new instance, or one another
            # replica re-keyed (reset, clear) after our snapshot. Every row is
            # resolved again from the new table, so no instance is ever named
            # under two ids or with an address from two tables.
            await self._refresh()
            out = cast(list[InstanceMatch], self._hits(rows, now, include_stale, checked=True))
            by_id = self._by_id
            ghosts = [r[0] for r in rows if r[0] not in by_id]
            if ghosts:
                # Entries of ids the table does not hold (left behind by a purge
                # in progress elsewhere): leave them out until the next snapshot
                # instead of reading the table again at every Match.
                self._dead.update(ghosts)
                self._excl_dirty = True
        # Sort (-depth, instance, hit) tuples: C-level comparisons, no key calls
        # (instances are unique, so hits themselves are never compared).
        ranked = [(-m.depth, m.instance, m) for m in out]
        ranked.sort()
        return [r[2] for r in ranked]

    async def match_with_pending(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> tuple[list[InstanceMatch], dict[InstanceId, int] | None]:
        """See :meth:`Index.match_with_pending`: the pending prefill is counted
        by the same ``pmatch.lua`` as the predicted depths (no round trip more)."""
        return await self._match_predicted(namespace, keys, include_stale, True)

    async def _match_predicted(
        self, namespace: Namespace, keys: Sequence[int], include_stale: bool, pending: bool
    ) -> tuple[list[InstanceMatch], dict[InstanceId, int] | None]:
        """Match with predictions (indexer/index.py, "Predictions"): the Match,
        then one ``pmatch.lua`` for every hit's predicted depth and the holders
        of block 0 by prediction alone (two EVALSHAs; KEYS.md, "Predictions");
        with ``pending``, the same script also counts each live instance's
        unconfirmed predictions (:meth:`pending_predicted`; None when not asked,
        or when the user may not ZCOUNT).

        Cluster: ``pmatch.lua`` runs on the control slot, where predictions
        live beside the authoritative entries (``k:<id>``).
        """
        hits = await self.match(namespace, keys, include_stale=include_stale) if keys else []
        if not keys and not pending:
            return hits, None
        by_name = self._by_name
        now = self._clock()
        reused = None
        if pending:
            read = self._pending_read.get(namespace.model)
            if read is not None and 0 <= time.monotonic() - read[0] < self.pending_reuse_s:
                reused = read[1]
                if not keys:
                    return hits, reused
        live = self._pending_candidates(namespace.model, now) if pending and reused is None else []
        pairs: list[bytes | int] = [len(live), *(i.int_id for i in live)]
        for h in hits:
            pairs += (by_name[h.instance].int_id, h.depth)
        res = await self._eval(
            self._scripts["pmatch"],
            len(self._ctl_keys),
            *self._ctl_keys,
            self._base,
            K.ns_id(namespace.model, namespace.lora_name),
            repr(float(now)),
            _pack(keys, "keys"),
            *pairs,
        )
        counted = int(res[0])
        head = 1 + 2 * max(counted, 0)
        counts: dict[InstanceId, int] | None = reused
        if pending and reused is None and counted >= 0:
            by_id = self._by_id
            counts = {by_id[res[j]].instance: int(res[j + 1]) for j in range(1, head, 2)}
            self._pending_read[namespace.model] = (time.monotonic(), counts)
        res = res[head:]
        depths = {res[j]: int(res[j + 1]) for j in range(0, 2 * len(hits), 2)}
        out = [h._replace(predicted_depth=depths[by_name[h.instance].int_id]) for h in hits]
        extra = [(res[j], int(res[j + 1])) for j in range(2 * len(hits), len(res), 2)]
        if any(int_id not in self._by_id for int_id, _ in extra):
            await self._refresh()  # an instance registered after our snapshot
        for int_id, d in extra:
            inst = self._by_id.get(int_id)
            if inst is None or inst.exp <= now or (inst.stale and not include_stale):
                continue
            out.append(
                InstanceMatch(inst.instance, inst.spec.address, 0, 0, 0, 0, inst.stale, 0, d)
            )
        ranked = [(-m.depth, -m.predicted_depth, m.instance, m) for m in out]
        ranked.sort()
        return [r[3] for r in ranked], counts

    def _pending_candidates(self, model: str, now: float) -> list[_Inst]:
        """The instances whose pending prefill a Match reports: live, not stale,
        of ``model``, in the replica's instance table."""
        return [
            i
            for i in self._by_name.values()
            if i.spec.model == model and i.exp > now and not i.stale
        ]

    async def pending_predicted(self, model: str) -> dict[InstanceId, int] | None:
        """See :meth:`Index.pending_predicted`: ``pmatch.lua`` with no keys, which
        ZCOUNTs ``P:po:<id> (now +inf`` for each live instance of ``model`` in
        the replica's instance table (one EVALSHA; Cluster: the control slot).
        Members are scored by their expiry and a store drops the stored block's
        (``apply.lua``, ``capply.lua``), so what counts is unexpired and
        unconfirmed. None when the user may not ZCOUNT (an older ACL rule)."""
        if not self._by_name:
            await self._refresh()  # never read yet (a Match reads it first)
        return (await self._match_predicted(Namespace(model), (), False, True))[1]

    async def predict(
        self,
        namespace: Namespace,
        instance: InstanceId,
        keys: Sequence[int],
        ttl_s: float,
        max_per_instance: int,
        pending_s: float | None = None,
    ) -> int:
        """See :meth:`Index.predict`: one ``predict.lua`` (KEYS.md, "Predictions").

        Cluster: the same script on the control slot (the instance hash routes it).
        """
        name, ikey = self._inst_key(instance)
        now = self._clock()
        ttl_ms = max(1, round(ttl_s * 1000))
        res = await self._eval(
            self._scripts["predict"],
            1,
            ikey,
            self._base,
            repr(float(now)),
            namespace.model,
            K.ns_id(namespace.model, namespace.lora_name),
            "%.17g" % (now + ttl_s),
            ttl_ms,
            max_per_instance,
            _pack(keys, "block_keys"),
            namespace.lora_name,
            name,
            ""
            if pending_s is None or pending_s >= ttl_s
            else "%.17g" % (now + max(0.0, pending_s)),
        )
        if res[0] == b"nf":
            raise NotFound(f"instance {instance} is not registered and live", field="instance")
        if res[0] == b"model":
            raise FailedPrecondition(
                f"instance {instance} serves model {res[1].decode('utf-8', 'replace')!r}, "
                f"not {namespace.model!r}",
                field="model",
            )
        return int(res[1])

    def _hits(
        self,
        rows: Sequence[tuple[bytes, int, int, int]],
        now: float,
        include_stale: bool,
        *,
        checked: bool,
    ) -> list[InstanceMatch] | None:
        """Match rows resolved from the cached table, or None at the first id it
        does not know. ``checked``: the table is newer than the Match's
        exclusions, so skip unknown ids and judge lease and staleness again."""
        by_id = self._by_id
        out: list[InstanceMatch] = []
        for int_id, g, c, d in rows:
            inst = by_id.get(int_id)
            if inst is None:
                if not checked:
                    return None
                continue
            if checked and (inst.exp <= now or (inst.stale and not include_stale)):
                continue
            out.append(
                InstanceMatch(inst.instance, inst.spec.address, g + c + d, g, c, d, inst.stale)
            )
        return out

    async def _match_cluster(
        self, nid: bytes, na: int, keys: Sequence[int], blob: bytes, excl: Sequence[bytes]
    ) -> Any:
        """Cluster: the one EVALSHA of a Match, on the node of the chain's anchor
        (the block at depth ``na``).

        A prompt no deeper than the anchor reads only copies (shallow and
        unplaced blocks), which every master holds: those Matches go round
        robin, spreading the hot root's reads over all masters. The script
        picks this node's copy tag itself (the first of the tags we pass that
        it serves); a node that serves none gets one (``_topology``) and the
        Match runs again. So does a Match that met a slot elsewhere than the
        slot map said.
        """
        if time.monotonic() - self._topo_at >= _TOPOLOGY_REFRESH_S:
            await self._topology()
            task = self._upkeep
            if task is None or task.done():
                # Writes left pending by anyone: finished beside this Match, not
                # in its way (a master that hangs would hold it).
                self._upkeep = asyncio.ensure_future(self._redrive_quietly())
        if not self._ready:
            raise Unavailable("redis cluster: no copy tag is registered yet")
        for attempt in range(2):
            try:
                res = await self._match_once(nid, na, keys, blob, excl)
            except Unavailable as exc:
                if attempt or not _slot_moved(exc):
                    raise
                await self._topology()
                continue
            if res[0] != 0:
                return res
            await self._topology()  # the node serves no copy tag: seed it one
        return [b"", []]

    async def _match_once(
        self, nid: bytes, na: int, keys: Sequence[int], blob: bytes, excl: Sequence[bytes]
    ) -> Any:
        if len(keys) > na:
            tag = K.anchor_tag(keys[na])
            dp = self._plain_block + b"{" + tag + b"}" + nid
            owner = self._owner(self._slot_of_tag(tag))
            guess = self._node_ready.get(owner, b"") if owner is not None else b""
            declared = dp + blob[8 * na : 8 * na + 8]
        else:
            ready = self._ready
            self._rr = (self._rr + 1) % len(ready)
            guess = ready[self._rr]
            dp = b""
            declared = K.node_key(self._prefix, K.NODE_GEN, guess)
        probe = self._probe(guess)
        return await self._eval(
            self._s_match, 1, declared, self._base, probe, nid, dp, na, blob, *excl
        )

    async def stats(self) -> IndexStats:
        """Sizes of the whole index, from counters the scripts maintain (no SCAN)."""
        await self._refresh()
        now = self._clock()
        nsmap, blocks, pairs = await self._pipe(
            [
                ("HGETALL", K.key(self._ctl_prefix, K.NAMESPACES)),
                ("HGETALL", K.key(self._ctl_prefix, K.NS_BLOCKS)),
                ("HGETALL", K.key(self._ctl_prefix, K.NS_PAIRS)),
            ]
        )
        st = IndexStats(backend=self.name, instances=len(self._by_name))
        for inst in self._by_name.values():
            st.instances_live += inst.exp > now
            st.instances_stale += inst.stale
        per_ns: list[NamespaceStats] = []
        for nid, nb in blocks.items():
            b = int(nb)
            if b <= 0:
                continue
            per_ns.append(NamespaceStats(self._namespace(nid, nsmap), b, int(pairs.get(nid, 0))))
        per_ns.sort(key=lambda s: str(s.namespace))
        st.namespaces = per_ns
        st.blocks = sum(s.blocks for s in per_ns)
        st.block_instances = sum(s.block_instances for s in per_ns)
        return st

    def _namespace(self, nid: bytes, nsmap: dict[bytes, bytes]) -> Namespace:
        ns = self._ns_names.get(nid)
        if ns is None:
            raw = nsmap.get(nid)
            if raw is None:
                return Namespace(f"?{nid.hex()}")
            model, _, lora = raw.partition(b"\x00")
            ns = Namespace(model.decode(), lora.decode())
            self._ns_names[nid] = ns
        return ns

    async def dump_blocks(
        self, model: str, cap: int
    ) -> tuple[list[tuple[Namespace, int, dict[InstanceId, int]]], bool]:
        """See :meth:`Index.dump_blocks`: SCANs the block keys and keeps the
        names of the first ``cap`` + 1 blocks in order (trimmed as it goes, so
        the client holds O(cap) names), then reads the holders of those alone,
        :data:`_DUMP_BATCH` keys per pipeline. Not one moment of the index: a
        write between two steps shows in the answer or not."""
        await self._refresh()
        by_id = dict(self._by_id)
        nsmap = await self._cmd("HGETALL", K.key(self._ctl_prefix, K.NAMESPACES))
        plain = K.base(self._prefix) + K.BLOCK
        pattern = glob_escape(plain) + b"*"
        start = len(plain)
        # (namespace, key, name); a Cluster may hold a block under two names
        # (its placed and unplaced copies), read together as one block
        kept: list[tuple[Namespace, int, bytes]] = []
        dropped = False

        def trim() -> bool:
            """Keep the names of the first cap + 1 blocks; whether more were dropped."""
            kept.sort()
            distinct = 0
            last: tuple[Namespace, int] | None = None
            for i, (ns, key, _) in enumerate(kept):
                if (ns, key) != last:
                    distinct += 1
                    last = (ns, key)
                    if distinct > cap + 1:
                        del kept[i:]
                        return True
            return False

        targets: list[Any] = self._r.get_primaries() if self.cluster else [None]
        for node in targets:
            kw = {"target_nodes": node} if node is not None else {}
            cursor: int = 0
            while True:
                self.round_trips += 1
                try:
                    got = await self._exec("SCAN", cursor, "MATCH", pattern, "COUNT", 1000, **kw)
                    cursor, chunk = got
                    if isinstance(cursor, dict):  # a cluster client keys it by node
                        (cursor,) = cursor.values()
                except CLIENT_ERRORS as exc:
                    raise self._map_error(exc) from exc
                for n in chunk:
                    suffix = n[start:]
                    if self.cluster:
                        suffix = suffix[suffix.index(b"}") + 1 :][-16:]
                    ns = self._namespace(suffix[:8], nsmap)
                    if model and ns.model != model:
                        continue
                    kept.append((ns, int.from_bytes(suffix[8:16], "big"), n))
                if len(kept) > 2 * (cap + 1) + 1000:
                    dropped |= trim()
                if int(cursor) == 0:
                    break
        dropped |= trim()
        merged: dict[tuple[Namespace, int], dict[InstanceId, int]] = {}
        for i in range(0, len(kept), _DUMP_BATCH):
            part = kept[i : i + _DUMP_BATCH]
            got = await self._pipe([("HGETALL", n) for _, _, n in part])
            for (ns, key, _), holders in zip(part, got, strict=True):
                entry = merged.setdefault((ns, key), {})
                for int_id, mask in holders.items():
                    inst = by_id.get(int_id)
                    if inst is not None:
                        entry[inst.instance] = int(mask)
        # a block whose every holder is gone (a removed instance's leftovers
        # the reaper has not reached) is no block, as in dump()
        blocks = [(ns, key, h) for (ns, key), h in merged.items() if h]
        return blocks[:cap], len(blocks) > cap or dropped

    async def dump(self) -> IndexDump:
        """The whole content in canonical form (SCANs the keyspace; for tests)."""
        await self._refresh()
        now = self._clock()
        by_id = dict(self._by_id)
        nsmap = await self._cmd("HGETALL", K.key(self._ctl_prefix, K.NAMESPACES))
        plain = K.base(self._prefix) + K.BLOCK
        pattern = glob_escape(plain) + b"*"
        start = len(plain)
        names: list[bytes] = []
        targets: list[Any] = self._r.get_primaries() if self.cluster else [None]
        for node in targets:
            kw = {"target_nodes": node} if node is not None else {}
            cursor: int = 0
            while True:
                self.round_trips += 1
                try:
                    got = await self._exec("SCAN", cursor, "MATCH", pattern, "COUNT", 1000, **kw)
                    cursor, chunk = got
                    if isinstance(cursor, dict):  # a cluster client keys it by node
                        (cursor,) = cursor.values()
                except CLIENT_ERRORS as exc:
                    raise self._map_error(exc) from exc
                names.extend(chunk)
                if int(cursor) == 0:
                    break
        blocks: dict[Namespace, dict[int, dict[InstanceId, int]]] = {}
        for i in range(0, len(names), _DUMP_BATCH):
            part = names[i : i + _DUMP_BATCH]
            got = await self._pipe([("HGETALL", n) for n in part])
            for n, holders in zip(part, got, strict=True):
                suffix = n[start:]
                if self.cluster:
                    # after the tag; an unplaced copy has a 'u' before ns id and key
                    suffix = suffix[suffix.index(b"}") + 1 :][-16:]
                ns = self._namespace(suffix[:8], nsmap)
                key = int.from_bytes(suffix[8:16], "big")
                for int_id, mask in holders.items():
                    inst = by_id.get(int_id)
                    if inst is not None:
                        blocks.setdefault(ns, {}).setdefault(key, {})[inst.instance] = int(mask)
        insts = list(self._by_name.values())
        emaps = await self._pipe(
            [("HGETALL", K.emap_key(self._ctl_prefix, inst.int_id)) for inst in insts]
        )
        engine_hashes: dict[InstanceId, dict[int, tuple[Namespace, int]]] = {}
        for inst, emap in zip(insts, emaps, strict=True):
            if emap:
                engine_hashes[inst.instance] = {
                    int.from_bytes(h, "big"): (
                        self._namespace(v[:8], nsmap),
                        int.from_bytes(v[8:16], "big"),
                    )
                    for h, v in emap.items()
                }
        return IndexDump(
            blocks=blocks,
            engine_hashes=engine_hashes,
            instances={inst.instance: inst.state(now) for inst in insts},
        )

    async def ping(self) -> None:
        """Raise Unavailable when Redis does not answer within ``socket_timeout_s``."""
        await self._cmd("PING", read=True)

    async def generation(self) -> int | None:
        """``P:gen``, which every script that changes the instance table bumps (one GET)."""
        raw = await self._cmd("GET", self._gen_key, read=True)
        return int(raw) if raw is not None else 0

    async def _read(self, *args: Any) -> Any:
        """A command a router waits on: TimeoutError past ``socket_timeout_s`` (the
        connection is then dropped: its reply would come later)."""
        if self._read_timeout is None:
            return await self._exec(*args)
        try:
            async with asyncio.timeout(self._read_timeout):
                return await self._exec(*args)
        except TimeoutError:
            raise TimeoutError(
                f"no reply within {self._read_timeout:g} s (redis.socket_timeout_s)"
            ) from None

    async def close(self) -> None:
        """Close the connection pool (the index can not be used afterwards)."""
        if self._read_next is not None:
            self._read_next.cancel()  # (a read in flight fails on the closed pool)
            self._read_next = None
        if self._upkeep is not None:
            await stop_tasks(self._upkeep, what="redis cluster: re-driving pending writes")
        with contextlib.suppress(RedisError, OSError):
            await self._r.aclose()
