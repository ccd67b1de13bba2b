"""Operations of the fault harness, their vocabulary, and the seeded schedule.

An operation is a small frozen dataclass that names everything it does in
concrete values (instance, model, address, chain and block range, replica,
deadline...), and whatever depends on the state at that point in a run
(the next sequence number of an instance, its model) by a mode such as
``seq="next"``. So an operation keeps its meaning when operations before it
are deleted, which is what shrinking a failing run needs.

:func:`generate` yields the operations of a run from ``(seed, profile,
target, replicas)`` alone (a seeded :class:`random.Random` and a rough plan of
what is registered), never from what the system answered: the same seed
always yields the same sequence, and ``keep`` indices into it name a
sub-sequence exactly.

Vocabulary: prompts are chains of 2-token blocks over a small alphabet;
several chains share prefixes with chain 0, so instances hold shared blocks
and Matches walk past shared first blocks. Engine block hashes are content
hashes of the chain prefix (as vLLM's are), so the same prompt gives the same
hashes on every engine.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Literal

from indexer.model import InstanceId, Tier
from kvmesh.blockkeys import block_keys

# -- vocabulary ----------------------------------------------------------------------

#: Tokens per block: tiny, so prompts are short and share prefixes often.
BLOCK_SIZE = 2
#: Distinct prompt chains and blocks per chain.
CHAINS = 6
CHAIN_BLOCKS = 8
#: How many leading blocks each chain shares with chain 0.
SHARED_WITH_CHAIN0 = (CHAIN_BLOCKS, 3, 3, 1, 0, 5)

#: Instances fed through kvmesh.indexer.v1, and their models and LoRA names.
INSTANCES = (InstanceId("w0", 0), InstanceId("w0", 1), InstanceId("w1", 0), InstanceId("w2", 0))
MODELS = ("m", "m2")
LORAS = ("", "l")
INCARNATIONS = ("a", "b", "c")
#: Lease TTLs of registrations, in lease-clock seconds.
TTLS = (5.0, 20.0, 60.0)
ADDRESS_PORTS = (8000, 8001)

#: Workers fed through SGLang's kv_indexer.v1, their epochs, and the namespace they live in.
SG_WORKERS = ("s0", "s1", "s2")
SG_EPOCHS = ("", "e1", "e2")
SG_MODEL = "sg"
#: Lease of SGLang-fed workers (``sglang.lease_ttl_s`` of the harness replicas).
SG_TTL_S = 30.0

#: ZMQ engines: worker ids, their ``keys`` setting, and their namespace.
ZMQ_ENGINES = (("z0", "tokens"), ("z1", "engine_hashes"))
ZMQ_MODEL = "zmq"

#: A sequence number from which Lua doubles no longer count by one (2^53).
HUGE_SEQ = 1 << 53


def block_tokens(chain: int, j: int) -> tuple[int, ...]:
    """Token ids of block ``j`` of ``chain``."""
    src = 0 if j < SHARED_WITH_CHAIN0[chain % CHAINS] else chain
    return tuple((src * 37 + j * 11 + t * 5 + 1) % 97 for t in range(BLOCK_SIZE))


def chain_tokens(chain: int, n: int) -> list[int]:
    """Token ids of the first ``n`` blocks of ``chain``."""
    out: list[int] = []
    for j in range(n):
        out.extend(block_tokens(chain, j))
    return out


def ehash(tag: str, chain: int, j: int, lora: str = "") -> int:
    """Engine hash of block ``j`` of ``chain``: a content hash of the prefix (64 bits)."""
    data = f"{tag}|{lora}|{chain_tokens(chain, j + 1)}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def content_keys(chain: int, n: int, model: str, lora: str = "") -> list[int]:
    """kvmesh content keys of the first ``n`` blocks of ``chain`` in ``(model, lora)``."""
    return block_keys(chain_tokens(chain, n), BLOCK_SIZE, model, lora)


def default_address(inst: InstanceId, port: int = ADDRESS_PORTS[0]) -> str:
    """The address of a kvmesh-fed instance (``port`` picks one of two)."""
    return f"http://{inst.worker_id}-{inst.dp_rank}:{port}"


# -- operations ---------------------------------------------------------------------------

Via = Literal["grpc", "logic"]
SeqMode = Literal["next", "dup", "gap", "huge", "zero"]


@dataclass(frozen=True, slots=True)
class Register:
    """RegisterInstance."""

    replica: int
    inst: InstanceId
    model: str
    address: str
    ttl: float
    incarnation: str
    via: Via = "grpc"
    deadline_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Heartbeat."""

    replica: int
    inst: InstanceId
    via: Via = "grpc"
    deadline_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Remove:
    """RemoveInstance (admin)."""

    replica: int
    inst: InstanceId
    via: Via = "grpc"
    deadline_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Reap:
    """One pass of the reaper on a replica (``IndexerLogic.reap_once``)."""

    replica: int


@dataclass(frozen=True, slots=True)
class Store:
    """A BlockStored of blocks ``[lo, hi)`` of a chain.

    ``parent``: ``chain`` names block ``lo - 1`` (none for ``lo == 0``),
    ``unknown`` a hash nobody stored, ``none`` no parent (the blocks then start a
    prompt and key as a chain of their own, by tokens or by precomputed keys alike).
    ``keys``: send precomputed block keys.
    """

    chain: int
    lo: int
    hi: int
    tier: Tier = Tier.GPU
    lora: str = ""
    keys: bool = False
    parent: Literal["chain", "unknown", "none"] = "chain"


@dataclass(frozen=True, slots=True)
class Drop:
    """A BlockRemoved of some blocks of a chain (indices past the chain: unknown hashes)."""

    chain: int
    blocks: tuple[int, ...]
    tier: Tier | None = None
    lora: str = ""


@dataclass(frozen=True, slots=True)
class Clear:
    """An AllBlocksCleared."""


EventSpec = Store | Drop | Clear


@dataclass(frozen=True, slots=True)
class Publish:
    """PublishEvents (``stream``: one batch on PublishEventsStream)."""

    replica: int
    inst: InstanceId
    seq: SeqMode
    events: tuple[EventSpec, ...]
    via: Via = "grpc"
    deadline_ms: float = 0.0
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Match:
    """Match of the first ``blocks`` blocks of a chain (by tokens or by keys)."""

    replica: int
    model: str
    lora: str
    chain: int
    blocks: int
    by_keys: bool = False
    include_stale: bool = False
    max_instances: int = 0
    via: Via = "grpc"
    deadline_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class ListInstances:
    """ListInstances (all models, or one)."""

    replica: int
    model: str = ""
    via: Via = "grpc"


@dataclass(frozen=True, slots=True)
class GetStats:
    """GetStats."""

    replica: int
    via: Via = "grpc"


@dataclass(frozen=True, slots=True)
class DumpIndex:
    """DumpIndex (admin)."""

    replica: int
    via: Via = "grpc"


@dataclass(frozen=True, slots=True)
class SgAction:
    """One ExternalKvAction: REPORT / REVOKE blocks ``[lo, hi)`` of a chain, or CLEAR."""

    kind: Literal["report", "revoke", "clear"]
    tier: Tier = Tier.GPU
    chain: int = 0
    lo: int = 0
    hi: int = 0


@dataclass(frozen=True, slots=True)
class SgApply:
    """ApplyExternalKvBatch."""

    replica: int
    worker: str
    seq: SeqMode
    actions: tuple[SgAction, ...]
    address: str
    epoch: str = ""
    enforce: bool = False
    via: Via = "grpc"
    deadline_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class SgSnapshot:
    """ReplaceExternalKvSnapshot of the first ``blocks`` blocks of a chain on one tier."""

    replica: int
    worker: str
    address: str
    epoch: str
    seq: int
    chain: int
    blocks: int
    tier: Tier = Tier.GPU
    via: Via = "grpc"


@dataclass(frozen=True, slots=True)
class SgConfigure:
    """ConfigureExpectedWorkers."""

    replica: int
    workers: tuple[tuple[str, str], ...]
    via: Via = "grpc"


@dataclass(frozen=True, slots=True)
class SgMatch:
    """MatchExternalKvPrefix of the first ``blocks`` hashes of a chain."""

    replica: int
    chain: int
    blocks: int
    via: Via = "grpc"


@dataclass(frozen=True, slots=True)
class ZPublish:
    """A ZMQ engine publishes one batch (``drop_first``: ZMQ loses it live; an empty
    batch follows, so the subscriber sees the gap and replays it)."""

    engine: int
    events: tuple[EventSpec, ...]
    drop_first: bool = False


@dataclass(frozen=True, slots=True)
class ZTruncate:
    """The engine's replay buffer keeps only its last ``keep`` batches."""

    engine: int
    keep: int


@dataclass(frozen=True, slots=True)
class ZRestart:
    """The engine's publisher restarts: empty cache, sequence from 0, same ports."""

    engine: int


@dataclass(frozen=True, slots=True)
class ZLateJoin:
    """The subscribing replica is down while the engine publishes ``batches``
    (``truncate``: and its replay buffer forgets them), then comes back."""

    engine: int
    batches: int
    truncate: bool = False


@dataclass(frozen=True, slots=True)
class ZRemove:
    """An operator removes the engine's instance (RemoveInstance, admin)."""

    replica: int
    engine: int
    via: Via = "grpc"


@dataclass(frozen=True, slots=True)
class ZBurst:
    """The engine publishes ``batches`` at once while a router sends a Match."""

    engine: int
    batches: int


@dataclass(frozen=True, slots=True)
class Pause:
    """``CLIENT PAUSE ms ALL`` on Redis (cluster: master ``node`` now, -1: every master)."""

    ms: int
    node: int = -1


@dataclass(frozen=True, slots=True)
class RestartRedis:
    """Redis killed and restarted empty (standalone)."""


@dataclass(frozen=True, slots=True)
class Migrate:
    """A Cluster slot moves to another master (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE).

    ``what``: the control slot, a master's node-tag slot, or a block chain's
    anchor slot. ``split``: half the keys move, a pause, then the rest (ASK
    redirections and TRYAGAIN in between).
    """

    what: Literal["control", "node", "block"]
    to: int
    split: bool = False


@dataclass(frozen=True, slots=True)
class Failover:
    """``CLUSTER FAILOVER`` on a replica of master ``master`` (index among masters now)."""

    master: int


@dataclass(frozen=True, slots=True)
class RestartReplica:
    """An indexer replica stopped (in-flight calls cancelled) and started again."""

    replica: int


@dataclass(frozen=True, slots=True)
class ClockJump:
    """The lease clock jumps forward."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Settle:
    """Real time passes beyond every replica's lag bound."""


@dataclass(frozen=True, slots=True)
class InventNames:
    """Clients invent ``n`` names of each kind (models, workers...): memory must not grow."""

    n: int


FaultOp = Pause | RestartRedis | Migrate | Failover | RestartReplica
CallOp = Register | Heartbeat | Remove | Publish | Match | SgApply


@dataclass(frozen=True, slots=True)
class During:
    """A fault injected ``delay_ms`` after a call was sent, while it is in flight."""

    fault: FaultOp
    op: CallOp
    delay_ms: float = 1.0


Op = (
    Register
    | Heartbeat
    | Remove
    | Reap
    | Publish
    | Match
    | ListInstances
    | GetStats
    | DumpIndex
    | SgApply
    | SgSnapshot
    | SgConfigure
    | SgMatch
    | ZPublish
    | ZTruncate
    | ZRestart
    | ZLateJoin
    | ZRemove
    | ZBurst
    | Pause
    | RestartRedis
    | Migrate
    | Failover
    | RestartReplica
    | ClockJump
    | Settle
    | InventNames
    | During
)

#: Fault kinds, as counted in a run's figures.
FAULT_KINDS = (
    "pause",
    "restart_redis",
    "deadline",
    "migrate",
    "failover",
    "restart_replica",
    "clock_jump",
    "zmq_drop",
    "zmq_truncate",
    "zmq_publisher_restart",
    "zmq_late_join",
)


def describe(op: Op) -> str:
    """One line naming the operation and its fields that differ from their defaults."""
    parts = []
    for f in fields(op):
        v = getattr(op, f.name)
        if f.default is not v and f.default != v:
            if isinstance(v, Tier):
                v = v.name
            elif isinstance(v, InstanceId):
                v = str(v)
            elif isinstance(v, tuple) and v and hasattr(v[0], "__dataclass_fields__"):
                v = "[" + ", ".join(describe(x) for x in v) + "]"
            elif hasattr(v, "__dataclass_fields__"):
                v = describe(v)
            parts.append(f"{f.name}={v}")
    return f"{type(op).__name__}({', '.join(parts)})"


# -- profiles ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """Weights of operation kinds; chances that a fault lands during a call, that a
    call carries a short deadline, and that a batch jumps to a huge sequence."""

    weights: dict[str, int]
    during: float = 0.0
    deadline: float = 0.0
    huge_seq: float = 0.0
    #: ``engine_events.on_unrecoverable_gap`` of the replicas.
    zmq_policy: Literal["reset", "stale"] = "reset"


_CORE = {
    "register": 8,
    "heartbeat": 4,
    "remove": 3,
    "reap": 3,
    "publish": 30,
    "match": 22,
    "list": 3,
    "stats": 2,
    "dump": 2,
    "clock": 3,
    "settle": 4,
}


def _with(**extra: int) -> dict[str, int]:
    w = dict(_CORE)
    w.update(extra)
    return w


_ZMQ = {
    "z_publish": 24,
    "z_truncate": 3,
    "z_restart": 2,
    "z_late": 2,
    "z_remove": 2,
    "z_match": 14,
    "restart_redis": 1,
    "settle": 2,
    "dump": 1,
}

#: Named operation mixes. Each isolates one family of operations or one fault
#: kind on top of the core mix, so that a failing family does not hide the others.
PROFILES: dict[str, Profile] = {
    "core": Profile(_with()),
    "leases": Profile(_with(register=16, heartbeat=8, clock=10, reap=6, settle=6)),
    "bigseq": Profile(_with(), huge_seq=0.15),
    "pause": Profile(_with(pause=5), during=0.5),
    "restart": Profile(_with(restart_redis=3), during=0.3),
    "deadline": Profile(_with(), deadline=0.3),
    "replica": Profile(_with(restart_replica=4), during=0.4),
    "migrate": Profile(_with(migrate=4), during=0.5),
    "failover": Profile(_with(failover=3), during=0.4),
    "sglang": Profile(
        {
            "sg_apply": 30,
            "sg_snapshot": 4,
            "sg_configure": 2,
            "sg_match": 20,
            "list": 3,
            "clock": 2,
            "settle": 5,
            "reap": 1,
            "dump": 2,
        }
    ),
    "zmq": Profile(_ZMQ),
    "zmq_stale": Profile(_ZMQ, zmq_policy="stale"),
    "starve": Profile({"z_burst": 3, "z_publish": 3, "z_match": 2}),
    "names": Profile(_with(names=3)),
    "all": Profile(
        _with(
            pause=2,
            restart_redis=1,
            restart_replica=2,
            migrate=2,
            failover=1,
            sg_apply=8,
            sg_snapshot=1,
            sg_configure=1,
            sg_match=5,
            z_publish=6,
            z_truncate=1,
            z_restart=1,
            z_late=1,
            z_remove=1,
            z_match=4,
            names=1,
        ),
        during=0.4,
        deadline=0.08,
        huge_seq=0.02,
    ),
}

#: Operation kinds each target cannot run.
_UNSUPPORTED = {
    "memory": {"pause", "restart_redis", "migrate", "failover"},
    "standalone": {"migrate", "failover"},
    "cluster": {"restart_redis"},
}


def profile_ops(profile: str, target: str) -> dict[str, int]:
    """The weights of ``profile`` that ``target`` can run."""
    w = PROFILES[profile].weights
    return {k: v for k, v in w.items() if v > 0 and k not in _UNSUPPORTED[target]}


# -- the schedule ---------------------------------------------------------------------------


@dataclass
class _Plan:
    """What the generator believes the state is (its own bookkeeping, never the system's)."""

    reg: dict[InstanceId, tuple[str, str, float, str]] = field(default_factory=dict)
    depth: dict[tuple[InstanceId, int, str], int] = field(default_factory=dict)
    sg: dict[str, tuple[str, str]] = field(default_factory=dict)  # worker -> (epoch, address)
    sg_depth: dict[tuple[str, int], int] = field(default_factory=dict)
    z_depth: dict[tuple[int, int], int] = field(default_factory=dict)
    z_batches: dict[int, int] = field(default_factory=dict)


class _Gen:
    """The seeded generator behind :func:`generate` (one draw per decision, in order)."""

    def __init__(self, seed: int, profile: str, target: str, replicas: int) -> None:
        self.rng = random.Random(f"kvmesh-faults/{seed}/{profile}/{target}/{replicas}")
        self.p = PROFILES[profile]
        self.target = target
        self.n = replicas
        weights = profile_ops(profile, target)
        self.kinds = list(weights)
        self.cum: list[int] = []
        total = 0
        for k in self.kinds:
            total += weights[k]
            self.cum.append(total)
        self.total = total
        self.plan = _Plan()

    def replica(self) -> int:
        return self.rng.randrange(self.n)

    def via(self) -> Via:
        return "logic" if self.rng.random() < 0.3 else "grpc"

    def deadline(self, via: Via) -> float:
        if self.p.deadline and self.rng.random() < self.p.deadline:
            return self.rng.choice((0.5, 1.0, 2.0, 4.0, 8.0))
        return 0.0

    def kind(self) -> str:
        x = self.rng.randrange(self.total)
        for k, c in zip(self.kinds, self.cum, strict=True):
            if x < c:
                return k
        raise AssertionError("weights out of range")

    # -- kvmesh instances ---------------------------------------------------------

    def register(self) -> Register:
        r = self.rng
        inst = r.choice(INSTANCES)
        old = self.plan.reg.get(inst)
        if old is None or r.random() < 0.15:
            spec = (r.choice(MODELS[:1] * 3 + MODELS[1:]), default_address(inst), 20.0, "a")
        else:
            model, address, ttl, inc = old
            variant = r.choice(
                (
                    "renew",
                    "renew",
                    "incarnation",
                    "address",
                    "address",
                    "model",
                    "shorter",
                    "longer",
                )
            )
            if variant == "incarnation":
                inc = r.choice([i for i in INCARNATIONS if i != inc])
            elif variant == "address":
                address = default_address(
                    inst, ADDRESS_PORTS[1] if address.endswith(str(ADDRESS_PORTS[0])) else 8000
                )
            elif variant == "model":
                model = r.choice([m for m in MODELS if m != model])
            elif variant == "shorter":
                ttl = min([t for t in TTLS if t < ttl] or [TTLS[0]])
            elif variant == "longer":
                ttl = max([t for t in TTLS if t > ttl] or [TTLS[-1]])
            spec = (model, address, ttl, inc)
        if old is not None and (old[0] != spec[0] or old[3] != spec[3]):
            for key in [k for k in self.plan.depth if k[0] == inst]:
                del self.plan.depth[key]
        self.plan.reg[inst] = spec
        via = self.via()
        return Register(self.replica(), inst, *spec, via=via, deadline_ms=self.deadline(via))

    def some_inst(self) -> InstanceId:
        regs = list(self.plan.reg)
        if regs and self.rng.random() < 0.9:
            return self.rng.choice(regs)
        return self.rng.choice(INSTANCES)

    def store_spec(self, inst: InstanceId, tag_lora: bool = True) -> Store:
        r = self.rng
        chain = r.randrange(CHAINS)
        lora = r.choice(LORAS) if tag_lora and r.random() < 0.2 else ""
        have = self.plan.depth.get((inst, chain, lora), 0)
        lo = have if have < CHAIN_BLOCKS and r.random() < 0.75 else r.randrange(CHAIN_BLOCKS)
        hi = min(CHAIN_BLOCKS, lo + r.randint(1, 3))
        parent: Literal["chain", "unknown", "none"] = "chain"
        x = r.random()
        if x < 0.05:
            parent = "unknown"
        elif x < 0.08:
            parent = "none"
        tier = r.choice((Tier.GPU,) * 6 + (Tier.CPU, Tier.CPU, Tier.DISK))
        keys = r.random() < 0.15
        if parent == "chain" and lo <= have:
            self.plan.depth[(inst, chain, lora)] = max(have, hi)
        return Store(chain, lo, hi, tier, lora, keys, parent)

    def events(self, inst: InstanceId) -> tuple[EventSpec, ...]:
        r = self.rng
        out: list[EventSpec] = []
        for _ in range(r.choice((1, 1, 2, 3))):
            x = r.random()
            if x < 0.62:
                out.append(self.store_spec(inst))
            elif x < 0.72:  # a tier move: copy to CPU, drop the GPU copy
                s = self.store_spec(inst)
                out.append(Store(s.chain, s.lo, s.hi, Tier.CPU, s.lora, s.keys, s.parent))
                out.append(Drop(s.chain, tuple(range(s.lo, s.hi)), Tier.GPU, s.lora))
            elif x < 0.9:  # removals, often of a middle block
                chain = r.randrange(CHAINS)
                have = self.plan.depth.get((inst, chain, ""), 0)
                mid = r.randrange(max(1, have)) if have else r.randrange(CHAIN_BLOCKS + 2)
                blocks = (mid,) if r.random() < 0.7 else (mid, mid + 1)
                tier = r.choice((None, None, Tier.GPU, Tier.CPU))
                out.append(Drop(chain, blocks, tier))
                if have > mid and tier is None:
                    self.plan.depth[(inst, chain, "")] = mid
            else:
                out.append(Clear())
                for key in [k for k in self.plan.depth if k[0] == inst]:
                    del self.plan.depth[key]
        return tuple(out)

    def publish(self) -> Publish:
        r = self.rng
        inst = self.some_inst()
        x = r.random()
        seq: SeqMode = "next"
        if self.p.huge_seq and x < self.p.huge_seq:
            seq = "huge"
        elif x < 0.9:
            seq = "next"
        elif x < 0.95:
            seq = "dup"
        else:
            seq = "gap"
        via = self.via()
        return Publish(
            self.replica(),
            inst,
            seq,
            self.events(inst),
            via=via,
            deadline_ms=self.deadline(via),
            stream=via == "grpc" and r.random() < 0.15,
        )

    def match(self) -> Match:
        r = self.rng
        model = r.choice(MODELS[:1] * 3 + MODELS[1:])
        if self.plan.reg and r.random() < 0.7:
            model = r.choice([s[0] for s in self.plan.reg.values()])
        via = self.via()
        return Match(
            self.replica(),
            model,
            r.choice(LORAS) if r.random() < 0.15 else "",
            r.randrange(CHAINS),
            r.randint(1, CHAIN_BLOCKS),
            by_keys=r.random() < 0.3,
            include_stale=r.random() < 0.3,
            max_instances=r.choice((1, 2)) if r.random() < 0.15 else 0,
            via=via,
            deadline_ms=self.deadline(via) if r.random() < 0.3 else 0.0,
        )

    # -- SGLang ---------------------------------------------------------------------

    def sg_address(self, worker: str) -> str:
        if worker == "s2" and self.rng.random() < 0.3:
            return "http://s1:9000"  # two workers behind one address
        return f"http://{worker}:{self.rng.choice((9000, 9000, 9001))}"

    def sg_apply(self) -> SgApply:
        r = self.rng
        worker = r.choice(SG_WORKERS)
        epoch, address = self.plan.sg.get(worker, ("", ""))
        if not address or r.random() < 0.1:
            address = self.sg_address(worker)
        if r.random() < 0.1:
            epoch = r.choice(SG_EPOCHS)
        self.plan.sg[worker] = (epoch, address)
        enforce = bool(epoch) and r.random() < 0.3
        acts: list[SgAction] = []
        for _ in range(r.choice((1, 1, 2, 3))):
            x = r.random()
            chain = r.randrange(CHAINS)
            have = self.plan.sg_depth.get((worker, chain), 0)
            tier = r.choice((Tier.GPU,) * 4 + (Tier.CPU, Tier.DISK))
            if x < 0.7:
                lo = have if have < CHAIN_BLOCKS and r.random() < 0.8 else r.randrange(CHAIN_BLOCKS)
                hi = min(CHAIN_BLOCKS, lo + r.randint(1, 3))
                acts.append(SgAction("report", tier, chain, lo, hi))
                if lo <= have:
                    self.plan.sg_depth[(worker, chain)] = max(have, hi)
            elif x < 0.93:
                mid = r.randrange(max(1, have))
                acts.append(SgAction("revoke", tier, chain, mid, mid + 1))
            else:
                acts.append(SgAction("clear", tier))
        x = r.random()
        seq: SeqMode = "next" if x < 0.86 else "dup" if x < 0.92 else "gap" if x < 0.97 else "zero"
        via = self.via()
        return SgApply(
            self.replica(),
            worker,
            seq,
            tuple(acts),
            address,
            epoch,
            enforce,
            via=via,
            deadline_ms=self.deadline(via),
        )

    def sg_snapshot(self) -> SgSnapshot:
        r = self.rng
        worker = r.choice(SG_WORKERS)
        epoch = r.choice(SG_EPOCHS[1:])
        _, address = self.plan.sg.get(worker, ("", self.sg_address(worker)))
        self.plan.sg[worker] = (epoch, address or self.sg_address(worker))
        chain = r.randrange(CHAINS)
        blocks = r.randint(1, CHAIN_BLOCKS)
        for key in [k for k in self.plan.sg_depth if k[0] == worker]:
            del self.plan.sg_depth[key]
        self.plan.sg_depth[(worker, chain)] = blocks
        return SgSnapshot(
            self.replica(),
            worker,
            self.plan.sg[worker][1],
            epoch,
            r.randrange(100),
            chain,
            blocks,
            r.choice((Tier.GPU, Tier.CPU)),
            via=self.via(),
        )

    def sg_configure(self) -> SgConfigure:
        r = self.rng
        listed = [w for w in SG_WORKERS if r.random() < 0.8]
        for w in SG_WORKERS:
            if w not in listed:
                self.plan.sg.pop(w, None)
        return SgConfigure(
            self.replica(),
            tuple((w, self.plan.sg.get(w, ("", ""))[1]) for w in listed),
            via=self.via(),
        )

    # -- ZMQ ----------------------------------------------------------------------------

    def z_events(self, engine: int) -> tuple[EventSpec, ...]:
        r = self.rng
        out: list[EventSpec] = []
        for _ in range(r.choice((1, 1, 2))):
            x = r.random()
            chain = r.randrange(CHAINS)
            have = self.plan.z_depth.get((engine, chain), 0)
            if x < 0.7:
                lo = have if have < CHAIN_BLOCKS else r.randrange(CHAIN_BLOCKS)
                hi = min(CHAIN_BLOCKS, lo + r.randint(1, 3))
                tier = r.choice((Tier.GPU,) * 4 + (Tier.CPU, Tier.DISK))
                out.append(Store(chain, lo, hi, tier))
                self.plan.z_depth[(engine, chain)] = max(have, hi)
            elif x < 0.92:
                mid = r.randrange(max(1, have))
                out.append(Drop(chain, (mid,), r.choice((Tier.GPU, Tier.CPU))))
            else:
                out.append(Clear())
                for key in [k for k in self.plan.z_depth if k[0] == engine]:
                    del self.plan.z_depth[key]
        return tuple(out)

    def z_match(self) -> Match:
        r = self.rng
        engine = r.randrange(len(ZMQ_ENGINES))
        return Match(
            self.replica(),
            ZMQ_MODEL,
            "",
            r.randrange(CHAINS),
            r.randint(1, CHAIN_BLOCKS),
            by_keys=ZMQ_ENGINES[engine][1] == "engine_hashes",
            via=self.via(),
        )

    # -- faults -------------------------------------------------------------------------

    def fault(self, kind: str) -> FaultOp:
        r = self.rng
        if kind == "pause":
            return Pause(r.choice((60, 120, 400)), r.choice((-1, 0, 1, 2)))
        if kind == "restart_redis":
            return RestartRedis()
        if kind == "migrate":
            what: Literal["control", "node", "block"] = r.choice(("control", "node", "block"))
            return Migrate(what, r.randrange(2), split=r.random() < 0.5)
        if kind == "failover":
            return Failover(r.randrange(3))
        return RestartReplica(self.replica())

    def call_for_during(self) -> CallOp:
        x = self.rng.random()
        if x < 0.5:
            return self.publish()
        if x < 0.7:
            return self.register()
        if x < 0.8:
            return Heartbeat(self.replica(), self.some_inst(), via=self.via())
        if x < 0.9 and "sg_apply" in self.kinds:
            return self.sg_apply()
        return self.match()

    # -- one operation ---------------------------------------------------------------

    def next(self) -> Op:
        r = self.rng
        k = self.kind()
        if k == "register":
            return self.register()
        if k == "heartbeat":
            via = self.via()
            return Heartbeat(self.replica(), self.some_inst(), via, self.deadline(via))
        if k == "remove":
            inst = self.some_inst()
            self.plan.reg.pop(inst, None)
            for key in [key for key in self.plan.depth if key[0] == inst]:
                del self.plan.depth[key]
            via = self.via()
            return Remove(self.replica(), inst, via, self.deadline(via))
        if k == "reap":
            return Reap(self.replica())
        if k == "publish":
            return self.publish()
        if k == "match":
            return self.match()
        if k == "list":
            return ListInstances(self.replica(), r.choice(("", "", MODELS[0])), self.via())
        if k == "stats":
            return GetStats(self.replica(), self.via())
        if k == "dump":
            return DumpIndex(self.replica(), self.via())
        if k == "clock":
            return ClockJump(r.choice((1.0, 3.0, 6.0, 21.0, 61.0)))
        if k == "settle":
            return Settle()
        if k == "sg_apply":
            return self.sg_apply()
        if k == "sg_snapshot":
            return self.sg_snapshot()
        if k == "sg_configure":
            return self.sg_configure()
        if k == "sg_match":
            return SgMatch(self.replica(), r.randrange(CHAINS), r.randint(1, CHAIN_BLOCKS))
        if k == "z_publish":
            e = r.randrange(len(ZMQ_ENGINES))
            return ZPublish(e, self.z_events(e), drop_first=r.random() < 0.15)
        if k == "z_truncate":
            return ZTruncate(r.randrange(len(ZMQ_ENGINES)), r.choice((1, 2, 5)))
        if k == "z_restart":
            e = r.randrange(len(ZMQ_ENGINES))
            for zk in [zk for zk in self.plan.z_depth if zk[0] == e]:
                del self.plan.z_depth[zk]
            return ZRestart(e)
        if k == "z_late":
            return ZLateJoin(r.randrange(len(ZMQ_ENGINES)), r.randint(1, 4), r.random() < 0.4)
        if k == "z_remove":
            return ZRemove(self.replica(), r.randrange(len(ZMQ_ENGINES)), self.via())
        if k == "z_burst":
            return ZBurst(0, 3000)
        if k == "z_match":
            return self.z_match()
        if k == "names":
            return InventNames(200)
        fault = self.fault(k)
        if self.p.during and r.random() < self.p.during:
            return During(fault, self.call_for_during(), r.choice((0.0, 1.0, 3.0)))
        return fault


def generate(seed: int, profile: str, target: str, replicas: int) -> Iterator[Op]:
    """The (endless) operation sequence of a run; the same arguments always give the same one."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; one of {sorted(PROFILES)}")
    if target not in _UNSUPPORTED:
        raise ValueError(f"unknown target {target!r}; one of {sorted(_UNSUPPORTED)}")
    g = _Gen(seed, profile, target, replicas)
    while True:
        yield g.next()


def take(seed: int, profile: str, target: str, replicas: int, n: int) -> list[Op]:
    """The first ``n`` operations of :func:`generate`."""
    out: list[Op] = []
    for op in generate(seed, profile, target, replicas):
        if len(out) == n:
            break
        out.append(op)
    return out
