"""Redis backend: one index shared by every indexer replica.

Key schema, script protocol and round-trip costs: indexer/redis/KEYS.md. Key names:
indexer/redis/keys.py. Scripts: indexer/redis/lua/ (``lib.lua`` is prepended to each,
indexer/redis/scripts.py).

- A Match is one EVALSHA (``match.lua``) that walks the prefix and stops at the
  first block no candidate holds. Which instances to leave out (lease expired
  per ``clock``, stale, retired) comes from a cached instance table, passed as
  ARGV. The table is refreshed when the script reports a new generation (at
  most every ``instance_cache_ttl_s``), when a cached lease seems to have run
  out, and at once when the script names an instance id it does not know.
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
blocks are copied on every master, so a Match is still one EVALSHA on one
node. An apply is one control script plus one script per data node touched.

Every method raises :class:`~kvmesh.errors.Unavailable` when Redis cannot be
reached (after at most ``socket_timeout_s`` per round trip) and recovers by
itself once Redis is back, reloading scripts after NOSCRIPT.

Security (SECURITY.md, "Redis"): credentials, TLS and the ACL rights the
backend needs are in :mod:`indexer.redis.connection`; refused credentials, a
missing ACL right and a failed TLS verification raise
:class:`~indexer.redis.connection.BackendAuthError`. The Lua scripts and the
tracing of the commands that run them are in :mod:`indexer.redis.scripts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from opentelemetry import trace
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    NoScriptError,
    RedisError,
    ResponseError,
)

from indexer.index import Index
from indexer.model import (
    ALL_TIERS_MASK,
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    EventBatch,
    IndexDump,
    IndexStats,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    Namespace,
    NamespaceStats,
)
from indexer.redis import keys as K
from indexer.redis.connection import (
    CLIENT_ERRORS,
    RETRY_ONCE_ON_CONNECTION_ERROR,
    BackendAuthError,
    Credentials,
    PasswordFileError,
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
from kvmesh.blockkeys import chain_keys, namespace_seed
from kvmesh.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvmesh.tracing import tracing_enabled

#: Entries dropped per purge script. Each costs ~4 Redis calls (~1-2 us), so a
#: chunk holds Redis for about a millisecond: long enough to amortise the round
#: trip, short enough that Matches queued behind it barely notice.
PURGE_CHUNK = 512

#: Attempts of one apply when the script rejects the caller's cached view
#: (parent mapping, model, int id changed by another replica). The second
#: attempt reads everything from Redis, so more than two is only ever needed
#: under concurrent writes to the same instance.
_APPLY_ATTEMPTS = 4

#: Keys fetched per HGETALL pipeline in dump(): bounds client memory per step.
_DUMP_BATCH = 1000

#: Cluster mode: node tags tried per master. Each slot is hit by about one in
#: 16,384 tags, so a few hundred thousand cover every layout with certainty.
_NODE_TAG_SEARCH = 1 << 20

# Redis replies that mean "not serving right now" rather than "bad request".
_TRANSIENT = (b"LOADING", b"BUSY", b"MASTERDOWN", b"READONLY", b"TRYAGAIN", b"CLUSTERDOWN")

_OP_STORE = b"S"
_OP_REMOVE = b"R"
_OP_CLEAR = b"C"


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


def _pack(values: Sequence[int], what: str) -> bytes:
    try:
        return struct.pack(f">{len(values)}Q", *values)
    except struct.error:
        raise InvalidArgument("values must be unsigned 64-bit integers", field=what) from None


class RedisIndex(Index):
    """The Redis backend (see the module docstring and indexer/redis/KEYS.md).

    ``url`` is a redis:// URL; ``prefix`` starts every key name, so several
    indexes can share one Redis. ``clock`` returns seconds and judges leases
    (lease expiry stamps in Redis are absolute ``clock()`` values).
    ``instance_cache_ttl_s`` bounds how often the cached instance table is
    refreshed; ``parent_cache_size`` caps the local engine-hash LRU.
    ``cluster`` talks to a Redis Cluster through ``url`` (any node);
    ``anchor_depth`` is then the depth of the block whose tag places a chain
    (blocks above it are copied on every master; 0 tags chains by their root).

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
        parent_cache_size: int = 200_000,
        cluster: bool = False,
        anchor_depth: int = 1,
        username: str = "",
        password: str | None = None,
        password_file: str = "",
        tls_ca_file: str = "",
        tls_cert_file: str = "",
        tls_key_file: str = "",
        tls_check_hostname: bool = True,
    ) -> None:
        if anchor_depth < 0 or anchor_depth > 255:
            raise ValueError("anchor_depth must be in 0..255")
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
        if url.lower().startswith("rediss://"):
            conn.update({k: v for k, v in tls_files.items() if v})
            conn["ssl_check_hostname"] = tls_check_hostname
            self._tls_without_client_cert = not tls_cert_file
        elif any(tls_files.values()):
            raise ValueError(f"TLS files are set but {self.where} is not a rediss:// URL")
        self._clock = clock
        self._prefix = prefix
        self.cluster = cluster
        self._anchor = anchor_depth if cluster else 0
        # Control names: one slot in cluster mode. Block names keep the plain base.
        self._base = K.cluster_base(prefix) if cluster else K.base(prefix)
        self._ctl_prefix = self._base[:-1].decode("utf-8")
        self._gen_key = self._base + K.GEN
        # Scripts that need no key still name one, so that a cluster client
        # routes them to the control slot.
        self._ctl_keys: tuple[bytes, ...] = (self._gen_key,) if cluster else ()
        self._cache_ttl = instance_cache_ttl_s
        self._parent_cap = parent_cache_size
        # Connections open lazily on the first command, retried once on a
        # connection error only (RETRY_ONCE_ON_CONNECTION_ERROR says why).
        self._r: Any
        if cluster:
            from redis.asyncio.cluster import RedisCluster

            self._r = RedisCluster.from_url(
                url,
                decode_responses=False,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry=RETRY_ONCE_ON_CONNECTION_ERROR,
                health_check_interval=0,
                # A master may be down: the others keep serving their slots.
                require_full_coverage=False,
                **conn,
            )
        else:
            self._r = aioredis.Redis.from_url(
                url,
                decode_responses=False,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry=RETRY_ONCE_ON_CONNECTION_ERROR,
                health_check_interval=0,
                **conn,
            )
        # redis.asyncio leaves execute_command untyped; every call goes through this.
        self._exec = cast(Callable[..., Awaitable[Any]], self._r.execute_command)
        self._scripts = load_scripts(cluster)
        self._tracer = trace.get_tracer(TRACER_NAME) if tracing_enabled() else None
        if self._tracer is not None:
            # Bound once here, so that tracing off adds nothing to the call path.
            self._exec = traced_exec(self._exec, self._tracer, url, self._scripts.values())
        # cluster topology: node name -> node tag, slot -> node tag (see _topology)
        self._node_tags: dict[str, bytes] = {}
        self._slot_tags: list[bytes] = []
        self._tag_slots: dict[bytes, int] = {}
        self._rr = 0
        #: Requests sent to Redis (a pipeline counts once): the cost figure that
        #: KEYS.md promises, exposed for tests and benchmarks.
        self.round_trips = 0
        self._s_match = self._scripts["match"]
        self._s_apply = self._scripts["capply" if cluster else "apply"]
        # instance table cache
        self._by_name: dict[InstanceId, _Inst] = {}
        self._by_id: dict[bytes, _Inst] = {}
        self._dead: set[bytes] = set()
        self._gen: bytes | None = None
        self._refreshed_at = float("-inf")  # time.monotonic() of the last snapshot
        self._excl_all: list[bytes] = []
        self._excl_stale_ok: list[bytes] = []
        self._excl_until = float("-inf")  # clock() at which a cached lease runs out
        self._excl_dirty = True
        # per-namespace constants
        self._ns_cache: dict[tuple[str, str], tuple[bytes, bytes, bytes]] = {}
        self._ns_names: dict[bytes, Namespace] = {}
        # (instance name, engine hash) -> ns id + block key, as last written
        self._parents: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()

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
        self.round_trips += 1
        try:
            try:
                res = await self._exec("EVALSHA", script.sha, numkeys, *args)
            except NoScriptError:
                # Redis restarted or SCRIPT FLUSH: load and run again.
                self.round_trips += 2
                if self.cluster:
                    node = self._r.get_node_from_key(args[0])
                    await self._exec("SCRIPT", "LOAD", script.text, target_nodes=node)
                else:
                    await self._exec("SCRIPT", "LOAD", script.text)
                res = await self._exec("EVALSHA", script.sha, numkeys, *args)
        except CLIENT_ERRORS as exc:
            if self.cluster:
                self._slot_tags = []  # reload the topology on the next call
            raise self._map_error(exc) from exc
        if self.cluster and script.name in CLUSTER_CONTROL:
            reply, bumped = res if len(res) == 2 else (res[0], None)
            if bumped is not None:
                await self._spread_gen(bumped)
            return reply
        return res

    # -- cluster topology ----------------------------------------------------------

    async def _topology(self) -> None:
        """Load which master serves each slot and pick a node tag per master."""
        from redis.crc import key_slot

        self.round_trips += 1
        try:
            await self._r.initialize()
        except CLIENT_ERRORS as exc:
            raise self._map_error(exc) from exc
        owner: list[str] = [""] * 16384
        for slot, nodes in self._r.nodes_manager.slots_cache.items():
            if nodes:
                owner[slot] = nodes[0].name
        tags: dict[str, bytes] = {}
        want = {n.name for n in self._r.get_primaries()}
        for i in range(_NODE_TAG_SEARCH):
            t = K.node_tag(i)
            name = owner[key_slot(t)]
            if name in want and name not in tags:
                tags[name] = t
                if len(tags) == len(want):
                    break
        self._node_tags = tags
        self._slot_tags = [tags.get(name, b"") for name in owner]

    async def _node_tag_list(self) -> list[bytes]:
        if not self._slot_tags:
            await self._topology()
        return sorted(self._node_tags.values())

    def _slot_of_tag(self, tag: bytes) -> int:
        slot = self._tag_slots.get(tag)
        if slot is None:
            from redis.crc import key_slot

            slot = self._tag_slots[tag] = key_slot(tag)
        return slot

    async def _spread_gen(self, gen: Any) -> None:
        """Copy a new generation to every master (a Match reads its node's copy)."""
        tags = await self._node_tag_list()
        script = self._scripts["cgen"]
        await asyncio.gather(
            *(
                self._eval(script, 1, K.node_key(self._prefix, K.NODE_GEN, t), self._base, gen)
                for t in tags
            ),
            return_exceptions=True,  # a master that is down gets it from a later refresh
        )

    async def _write_blocks(self, ops: Sequence[Any]) -> None:
        """Cluster: write block entries (location, suffix, id, mask quadruples), one
        script per data node, all nodes at once."""
        if not ops:
            return
        tags = await self._node_tag_list()
        per_node: dict[bytes, list[Any]] = {}
        plain = K.base(self._prefix) + K.BLOCK
        for j in range(0, len(ops), 4):
            loc, suf, int_id, mask = ops[j], ops[j + 1], ops[j + 2], ops[j + 3]
            ns = suf[:8]
            if loc[:1] == b"s":
                for t in tags:
                    name = plain + b"{" + t + b"}" + suf
                    per_node.setdefault(t, []).extend((name, int_id, mask, b"s" + ns))
            else:
                tag = loc[1:]
                t = self._slot_tags[self._slot_of_tag(b"{" + tag + b"}")]
                name = plain + b"{" + tag + b"}" + suf
                per_node.setdefault(t, []).extend((name, int_id, mask, b"d" + ns))
        script = self._scripts["cblocks"]
        await asyncio.gather(
            *(
                self._eval(script, 1, K.node_key(self._prefix, K.NODE_COUNTS, t), self._base, *a)
                for t, a in per_node.items()
            )
        )

    async def _cmd(self, *args: Any) -> Any:
        self.round_trips += 1
        try:
            return await self._exec(*args)
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
            async with self._r.pipeline(transaction=False) as p:
                for c in commands:
                    cast(Any, p).execute_command(*c)
                return list(await p.execute())
        except CLIENT_ERRORS as exc:
            raise self._map_error(exc) from exc

    def _ns(self, model: str, lora: str) -> tuple[bytes, bytes, bytes]:
        """(ns id, block name prefix, ns registry value), cached."""
        got = self._ns_cache.get((model, lora))
        if got is None:
            nid = K.ns_id(model, lora)
            got = (nid, K.block_prefix(self._prefix, nid), K.ns_name(model, lora))
            self._ns_cache[(model, lora)] = got
            self._ns_names[nid] = Namespace(model, lora)
        return got

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

    async def _refresh(self) -> None:
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
        self._excl_dirty = True

    def _recompute_exclusions(self, now: float) -> None:
        excl_all = list(self._dead)
        excl_stale_ok = list(self._dead)
        until = float("inf")
        for inst in self._by_name.values():
            if inst.exp <= now:
                excl_all.append(inst.int_id)
                excl_stale_ok.append(inst.int_id)
            else:
                until = min(until, inst.exp)
                if inst.stale:
                    excl_all.append(inst.int_id)
        self._excl_all, self._excl_stale_ok = excl_all, excl_stale_ok
        self._excl_until = until
        self._excl_dirty = False

    async def _exclusions(self, now: float, include_stale: bool) -> list[bytes]:
        if self._excl_dirty or now >= self._excl_until:
            if now >= self._excl_until and time.monotonic() - self._refreshed_at >= self._cache_ttl:
                # A cached lease ran out; another replica may have renewed it.
                await self._refresh()
            self._recompute_exclusions(now)
        return self._excl_stale_ok if include_stale else self._excl_all

    # -- instances -------------------------------------------------------------

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """Create, renew or reset an instance (see :mod:`indexer.index`)."""
        now = self._clock()
        name, ikey = self._inst_key(spec.instance)
        reset, dead, row = await self._eval(
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
        )
        inst = self._install(_parse_inst(row))
        if dead:
            self._dead.add(dead)
            await self._purge(dead)
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
        dropped = await self._remove(instance, b"remove", self._clock())
        if dropped is None:
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
        """Drop every instance whose lease has expired; return their ids."""
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
        fields whose entries may be gone: the next purge repeats them."""
        script = self._scripts["cpurge"]
        done: list[bytes] = []
        while True:
            res = await self._eval(
                script, 1, *self._ctl_keys, self._base, int_id, PURGE_CHUNK, *done
            )
            chunk = res[1:]
            if not chunk:
                return
            ops: list[Any] = []
            for j in range(0, len(chunk), 2):
                ops += (chunk[j + 1][1:], chunk[j], int_id, b"0")
            await self._write_blocks(ops)
            done = chunk[0::2]

    # -- events ----------------------------------------------------------------

    def _encode(
        self,
        inst: _Inst,
        batch: EventBatch,
        fetched: dict[int, bytes | None],
        use_lru: bool,
    ) -> tuple[list[Any], set[int], list[tuple[int, bytes]]]:
        """Build the apply ARGV tail; return (args, parents to fetch, mappings written).

        Parent mappings come from, in order: this batch's earlier stores, the
        LRU (when ``use_lru``), ``fetched`` (HMGET). Those from the last two
        are "beliefs" the script checks before writing anything.
        """
        model = inst.spec.model
        name = inst.name
        lru = self._parents
        overlay: dict[int, bytes] = {}
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
                    value: bytes | None
                    if not 0 <= parent < 1 << 64:
                        # No such engine hash can be mapped: orphans, as for any unknown parent.
                        parent_arg, value = b"\xff" * 9, None
                    elif (parent_arg := K.u64(parent)) and parent in overlay:
                        value = overlay[parent]
                    elif cleared:
                        value = None
                    elif parent in beliefs:
                        value = beliefs[parent] or None
                    elif use_lru and (name, parent) in lru:
                        value = lru[(name, parent)]
                        beliefs[parent] = value
                    elif parent in fetched:
                        value = fetched[parent]
                        beliefs[parent] = value or b""
                    else:
                        missing.add(parent)
                        continue
                    if value is None or value[:8] != nid:
                        ks = ()  # the script counts the orphans
                    else:
                        ks = self._chain(int.from_bytes(value[8:], "big"), ev)
                kb = _pack(ks, "block_keys")
                hb = _pack(hashes, "block_hashes")
                ops += (_OP_STORE, nid, ev.tier.bit, parent_arg, hb, kb)
                if self.cluster:
                    # The engine hash whose location the chain continues.
                    ops.append(
                        K.u64(parent) if parent is not None and 0 <= parent < 1 << 64 else b""
                    )
                if ks:
                    for i in range(min(len(hashes), len(ks))):
                        overlay[hashes[i]] = nid + kb[8 * i : 8 * i + 8]
            elif isinstance(ev, BlockRemoved):
                mask = ALL_TIERS_MASK if ev.tier is None else ev.tier.bit
                ops += (_OP_REMOVE, mask, _pack(ev.block_hashes, "block_hashes"))
                for h in ev.block_hashes:
                    lru.pop((name, h), None)
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
        return args, missing, list(overlay.items())

    @staticmethod
    def _chain(parent_key: int, ev: BlockStored) -> list[int]:
        try:
            return chain_keys(parent_key, ev.token_ids, ev.block_size)
        except ValueError as exc:  # TokenIdError is a ValueError
            raise InvalidArgument(str(exc), field="token_ids") from None

    def _remember(self, name: bytes, written: list[tuple[int, bytes]]) -> None:
        lru = self._parents
        for h, v in written:
            k = (name, h)
            if k in lru:
                lru.move_to_end(k)
            lru[k] = v
        while len(lru) > self._parent_cap:
            lru.popitem(last=False)

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch atomically (see :mod:`indexer.index`); one EVALSHA when warm."""
        instance = batch.instance
        inst = self._by_name.get(instance)
        if inst is None:
            await self._refresh()
            inst = self._by_name.get(instance)
            if inst is None:
                raise FailedPrecondition(f"instance {instance} is not registered", field="instance")
        fetched: dict[int, bytes | None] = {}
        use_lru = True
        for _attempt in range(_APPLY_ATTEMPTS):
            args, missing, written = self._encode(inst, batch, fetched, use_lru)
            while missing:
                emap = K.emap_key(self._ctl_prefix, inst.int_id)
                order = sorted(missing)
                vals = await self._cmd("HMGET", emap, *(K.u64(h) for h in order))
                fetched.update(zip(order, vals, strict=True))
                args, missing, written = self._encode(inst, batch, fetched, use_lru)
            now = self._clock()
            res = await self._eval(
                self._s_apply,
                1,
                K.instance_key(self._ctl_prefix, inst.name),
                self._base,
                repr(float(now)),
                str(batch.sequence),
                inst.spec.model.encode(),
                inst.name,
                *((self._anchor,) if self.cluster else ()),
                *args,
            )
            status = res[0]
            if status == b"ok":
                if self.cluster:
                    _, gap, stale, exp, bits, stored, removed, orphaned, int_id, retired, ops = res
                    await self._write_blocks(ops)
                else:
                    _, gap, stale, exp, bits, stored, removed, orphaned, int_id, *retired = res
                if inst.exp <= now:
                    self._excl_dirty = True  # a lapsed lease was renewed
                inst.exp = float(exp)
                inst.bits = int(bits)
                inst.seq = batch.sequence
                if bool(stale) != inst.stale:
                    inst.stale = bool(stale)
                    self._excl_dirty = True
                if int_id != inst.int_id:
                    self._by_id.pop(inst.int_id, None)
                    self._dead.add(inst.int_id)
                    inst.int_id = int_id
                    self._by_id[int_id] = inst
                    self._excl_dirty = True
                self._remember(inst.name, written)
                for dead in retired:
                    await self._purge(dead)
                return ApplyResult(
                    outcome=BatchOutcome.APPLIED_AFTER_GAP if gap else BatchOutcome.APPLIED,
                    applied_sequence=batch.sequence,
                    blocks_stored=int(stored),
                    blocks_removed=int(removed),
                    blocks_orphaned=int(orphaned),
                    stale=bool(stale),
                )
            if status == b"dup":
                _, seq, stale, exp, bits = res
                if inst.exp <= now:
                    self._excl_dirty = True
                inst.exp = float(exp)
                return ApplyResult(BatchOutcome.DUPLICATE, int(seq), stale=bool(stale))
            # Our view of the instance is outdated: reread and retry from Redis.
            await self._refresh()
            got = self._by_name.get(instance)
            if status == b"noreg" or got is None:
                raise FailedPrecondition(f"instance {instance} is not registered", field="instance")
            inst = got
            use_lru = False
            fetched = {}
        raise Unavailable(f"apply for {instance}: concurrent updates, retry later")

    # -- reads -----------------------------------------------------------------

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        """Per-instance longest gap-free prefix of ``keys``, deepest first (one EVALSHA)."""
        if not keys:
            return []
        ns = self._ns_cache.get((namespace.model, namespace.lora_name))
        if ns is None:
            ns = self._ns(namespace.model, namespace.lora_name)
        blob = _pack(keys, "keys")
        now = self._clock()
        excl = (
            (self._excl_stale_ok if include_stale else self._excl_all)
            if not self._excl_dirty and now < self._excl_until
            else await self._exclusions(now, include_stale)
        )
        if self.cluster:
            res = await self._match_cluster(ns[0], keys, blob, excl)
        else:
            res = await self._eval(
                self._s_match, 0, self._base, self._gen_key, ns[1], ns[1], 0, blob, *excl
            )
        refreshed = False
        if res[0] != self._gen and time.monotonic() - self._refreshed_at >= self._cache_ttl:
            await self._refresh()
            refreshed = True
            if self.cluster and res[0] != self._gen and self._gen:
                await self._spread_gen(self._gen)  # a restarted master lost its copy
        # (int id, gpu, cpu, disk): candidates the script walked past block 1,
        # then the other holders of block 0, which matched exactly one block.
        rows = [(res[j], res[j + 1], res[j + 2], res[j + 3]) for j in range(2, len(res), 4)]
        first = res[1]
        skip = {r[0] for r in rows}
        skip.update(excl)
        for j in range(0, len(first), 2):
            if first[j] not in skip:
                rows.append((first[j], *_DEPTH1_TIERS[int(first[j + 1])]))
        by_id = self._by_id
        out: list[InstanceMatch] = []
        for int_id, g, c, d in rows:
            inst = by_id.get(int_id)
            if inst is None and not refreshed:
                await self._refresh()  # a new (or re-keyed) instance
                refreshed = True
                by_id = self._by_id
                inst = by_id.get(int_id)
            if inst is None:
                continue
            if refreshed and (inst.exp <= now or (inst.stale and not include_stale)):
                continue
            out.append(
                InstanceMatch(inst.instance, inst.spec.address, g + c + d, g, c, d, inst.stale)
            )
        # Sort (-depth, instance, hit) tuples: C-level comparisons, no key calls
        # (instances are unique, so hits themselves are never compared).
        ranked = [(-m.depth, m.instance, m) for m in out]
        ranked.sort()
        return [r[2] for r in ranked]

    async def _match_cluster(
        self, nid: bytes, keys: Sequence[int], blob: bytes, excl: Sequence[bytes]
    ) -> Any:
        """Cluster: the one EVALSHA of a Match, on the node of the chain's anchor.

        A prompt no deeper than the anchor reads only shallow blocks, which
        every master holds: those Matches go round robin, spreading the hot
        root's reads over all masters.
        """
        if not self._slot_tags:
            await self._topology()
        na = self._anchor
        plain = K.base(self._prefix) + K.BLOCK
        if len(keys) > na:
            tag = K.anchor_tag(keys[na])
            dp = plain + b"{" + tag + b"}" + nid
            nt = self._slot_tags[self._slot_of_tag(b"{" + tag + b"}")]
            declared = dp + blob[8 * na : 8 * na + 8]
        else:
            tags = self._node_tag_list_cached()
            self._rr = (self._rr + 1) % len(tags)
            nt = tags[self._rr]
            dp = b""
            declared = K.node_key(self._prefix, K.NODE_GEN, nt)
        sp = plain + b"{" + nt + b"}" + nid
        gen_copy = K.node_key(self._prefix, K.NODE_GEN, nt)
        return await self._eval(
            self._s_match, 1, declared, self._base, gen_copy, sp, dp, na, blob, *excl
        )

    def _node_tag_list_cached(self) -> list[bytes]:
        return sorted(self._node_tags.values())

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
        if self.cluster:
            blocks = await self._cluster_block_counts()
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

    async def _cluster_block_counts(self) -> dict[bytes, int]:
        """Cluster: block keys per namespace, from the per-node counters: every
        node's deep blocks plus one node's copies of the shallow ones."""
        tags = await self._node_tag_list()
        got = await asyncio.gather(
            *(self._cmd("HGETALL", K.node_key(self._prefix, K.NODE_COUNTS, t)) for t in tags)
        )
        out: dict[bytes, int] = {}
        shallow: dict[bytes, int] = {}
        for counts in got:
            for field, v in counts.items():
                if field[:1] == b"d":
                    out[field[1:]] = out.get(field[1:], 0) + int(v)
                else:
                    shallow[field[1:]] = max(shallow.get(field[1:], 0), int(v))
        for nid, v in shallow.items():
            out[nid] = out.get(nid, 0) + v
        return out

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
                    suffix = suffix[suffix.index(b"}") + 1 :]
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
        """Raise Unavailable when Redis does not answer."""
        await self._cmd("PING")

    async def close(self) -> None:
        """Close the connection pool (the index can not be used afterwards)."""
        with contextlib.suppress(RedisError, OSError):
            await self._r.aclose()
