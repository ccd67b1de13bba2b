"""One vLLM engine's scheduler-side KV cache, driven in lockstep for the conformance harness.

Run with the interpreter of a virtualenv that has vLLM (``python -m
lab.engines.vllm_engine --scenario full --endpoint ipc://... --replay-endpoint
ipc://...`` with the repository on ``PYTHONPATH``); ``lab/conformance.py``
starts it. It imports the standard library, vLLM and torch only, never
kvmesh: vLLM's pins are its own, and kvmesh's environment never imports
vLLM or torch.

What runs is vLLM's own code: a ``KVCacheManager`` (its block pool, its
coordinator for one or several KV-cache groups, its hashing of requests
through ``get_request_block_hasher``) over a small pool so that blocks are
evicted, with its events published by vLLM's own ``ZmqEventPublisher`` (PUB
plus replay ROUTER, vLLM's wire). Only the scheduler around it is this
module's: a continuous-batching loop that calls the manager the way
``vllm/v1/core/sched/scheduler.py`` does (admission: ``get_computed_blocks``
then ``allocate_slots`` with the hit; running requests: ``allocate_slots``
per step, preempting the newest running request when the pool is full;
``free`` when done; ``reset_prefix_cache`` after preempting everything; the
Mamba block-aligned chunk split is vLLM's own method), seeded and
deterministic. One process is one engine instance.

The publisher binds ``ipc://`` endpoints: vLLM binds wildcard and ``ipc``
endpoints and *connects* to any other (``tcp://127.0.0.1:PORT`` would make
it a client), so an ``ipc`` socket gives vLLM's default topology (the engine
binds, subscribers connect, several may) while listening on no network
interface.

Protocol (one JSON object per line; stdout is the protocol only, anything a
library prints goes to stderr):

- ``READY {...}``: the engine's shape (scenario, block sizes, groups, pool).
- Before admitting a request (a new one, a resumed one after preemption, or
  one whose earlier admission found no room), the engine publishes every
  pending event as one batch, asks ``get_computed_blocks`` and announces
  ``{"req", "tokens", "lora_name", "cache_salt", "mm": [[identifier, offset,
  length], ...], "hashes", "seq", "truth", "resumed", "retry"}``: ``seq`` is
  the sequence of the last batch published (-1: none yet), ``truth`` the
  computed tokens vLLM reuses, ``hashes`` its block hashes at the first
  group's block size as its events carry them (64-bit ints). It then waits for
  ``{"go": true}`` on stdin and schedules the request.
- ``{"done": true, "stats": {...}}`` when every request has finished; what
  the engine did and published (preemptions, evictions, event shapes), for
  the report.

Closing stdin stops the engine at its next read.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import types
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found]
import vllm  # type: ignore[import-not-found]
from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.lora.request import LoRARequest  # type: ignore[import-not-found]
from vllm.multimodal.inputs import (  # type: ignore[import-not-found]
    MultiModalFeatureSpec,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found]
from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-not-found]
from vllm.v1.core.kv_cache_manager import KVCacheManager  # type: ignore[import-not-found]
from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
    resolve_block_hashes,
)
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # type: ignore[import-not-found]

from lab.engines.lockstep import (
    TOKEN_BASE,
    TRACE,
    TRACE_BLOCK_TOKENS,
    VOCAB,
    Protocol,
    id_tokens,
    trace_records,
)

#: Sliding window of the ``swa`` scenario's second group, in tokens.
SLIDING_WINDOW = 128
#: Longest context the manager is told about (prompts stay far below it).
MAX_MODEL_LEN = 8192
#: A conversation stops growing here (its next turn is a new conversation), so
#: every prompt fits the smallest scenario pool with room to spare.
MAX_PROMPT_TOKENS = 4096
#: The image placeholder token of the ``mm`` scenario: every image's
#: placeholder run is the same ids, only its identifier differs (as in vLLM,
#: where the processor expands an image into one repeated placeholder id).
IMAGE_PLACEHOLDER = 99
IMAGE_TOKENS = 48
IMAGES = ("image-a", "image-b", "image-c", "image-d")
#: How often each image is sent: skewed, so a rarely sent image's blocks are
#: evicted while a popular one's with the same tokens stay cached.
IMAGE_WEIGHTS = (0.55, 0.25, 0.12, 0.08)
LORAS = (None, "sql-lora", "chat-lora")
TENANTS = ("tenant-a", "tenant-b")
TENANT_WEIGHTS = (0.7, 0.3)
#: Documents both tenants of the ``salt`` scenario put after the system prompt
#: (retrieved context), each 64 to 192 tokens, popularity ~ 1 / rank.
DOCUMENTS = 8
#: Parallel samples of one prompt in the ``fanout`` scenario (SamplingParams.n).
FANOUT = 3


@dataclass(frozen=True, slots=True)
class Scenario:
    """What one engine instance is: its KV-cache layout, pool and workload."""

    #: ``full`` (one full-attention group), ``swa`` (full attention + sliding
    #: window), ``mamba`` (full attention + Mamba2 in ``align`` mode).
    layout: str
    block_size: int
    #: Tokens per hash unit (vLLM's ``hash_block_size``); 0: the block size.
    hash_block_size: int
    #: Blocks of the shared pool (every group allocates from it): small enough
    #: that a run evicts, preempts and reuses.
    num_blocks: int
    #: ``plain``, ``fanout`` (n parallel samples), ``lora``, ``salt``, ``mm``.
    kind: str = "plain"
    #: Admissions between two ``reset_prefix_cache`` calls; 0: never.
    reset_every: int = 0
    max_running: int = 8


SCENARIOS: dict[str, Scenario] = {
    "full": Scenario("full", 16, 0, 640, reset_every=800),
    "fanout": Scenario("full", 16, 0, 640, kind="fanout"),
    "swa": Scenario("swa", 16, 0, 960),
    "mamba": Scenario("mamba", 64, 16, 320),
    "mamba64": Scenario("mamba", 64, 64, 320),
    "lora": Scenario("full", 16, 0, 640, kind="lora"),
    "salt": Scenario("full", 16, 0, 640, kind="salt"),
    "mm": Scenario("full", 16, 0, 640, kind="mm"),
    "multi": Scenario("full", 16, 0, 480),
}


# -- the workload ------------------------------------------------------------------


@dataclass(slots=True)
class Plan:
    """One request before it becomes a vLLM ``Request``: its prompt and its future outputs."""

    rid: str
    prompt: list[int]
    outputs: list[int]
    lora: str | None = None
    salt: str | None = None
    #: (identifier, offset, length) of each image in the prompt.
    mm: list[tuple[str, int, int]] = field(default_factory=list)


class Workload:
    """Requests shaped like the Mooncake conversation trace, plus follow-up turns.

    A root request takes the next trace record of this instance: each of its
    ``hash_ids`` (a 512-token block of the trace, chained by prefix, id 0 the
    shared system prompt) becomes ``unit_tokens`` tokens, the prompt length
    and the output length are the trace's scaled by ``unit_tokens / 512``, so
    prefix sharing keeps the trace's shape at a size where a run takes
    seconds. A follow-up turn (probability ``follow_up``) continues a request
    that finished recently: its prompt is that request's prompt, its outputs
    and a new user message, so decode blocks are reused too. Scenario kinds
    decorate root requests (follow-ups inherit): ``lora`` picks the base
    model or one of two LoRA adapters; ``salt`` one of two tenants' cache
    salts (70/30) and, mostly, one of eight shared documents after the
    system prompt; ``mm`` inserts one of four images (popular ones more
    often) with identical placeholder tokens after the system prompt;
    ``fanout`` submits ``n=3`` samples of the prompt whose outputs share a
    random number of first tokens and whose prompt is often a whole number of
    blocks (so a sample recomputes the last block another sample also holds).
    """

    def __init__(
        self,
        kind: str,
        requests: int,
        seed: int,
        block_size: int,
        *,
        instance: int = 0,
        instances: int = 1,
        unit_tokens: int = 32,
        max_units: int = 48,
        follow_up: float = 0.35,
        trace: Path = TRACE,
    ) -> None:
        self.kind = kind
        self.remaining = requests
        self.block_size = block_size
        self.unit_tokens = unit_tokens
        self.max_units = max_units
        self.follow_up = follow_up
        self.instance = instance
        self.rng = random.Random(f"kvmesh-conformance:{seed}:{kind}:{instance}")
        self._records = trace_records(trace, instance, instances)
        self._finished: deque[tuple[Plan, list[int]]] = deque(maxlen=24)
        self._count = 0

    def _rid(self) -> str:
        self._count += 1
        return f"i{self.instance}-r{self._count}"

    def _tokens(self, n: int) -> list[int]:
        return [TOKEN_BASE + self.rng.randrange(VOCAB) for _ in range(n)]

    def _outputs(self, n: int) -> list[int]:
        return self._tokens(n)

    def finished(self, plan: Plan, all_tokens: Sequence[int]) -> None:
        """A request finished: its whole sequence may be continued by a follow-up turn."""
        self._finished.append((plan, list(all_tokens)))

    def next_group(self) -> list[Plan]:
        """The next arrival: one request, or ``FANOUT`` samples of one prompt; [] when done."""
        if self.remaining <= 0:
            return []
        parent: tuple[Plan, list[int]] | None = None
        if self._finished and self.rng.random() < self.follow_up:
            parent = self._finished[self.rng.randrange(len(self._finished))]
        if parent is not None and len(parent[1]) < MAX_PROMPT_TOKENS - 96:
            plan, tokens = parent
            prompt = tokens + self._tokens(self.rng.randint(8, 96))
            group = self._group(prompt, plan.lora, plan.salt, plan.mm, self.rng.randint(1, 24))
        else:
            group = self._root()
        self.remaining -= len(group)
        return group

    def _root(self) -> list[Plan]:
        rec = next(self._records)
        ids = list(rec["hash_ids"])[: self.max_units]
        u = self.unit_tokens
        length = math.ceil(int(rec["input_length"]) * u / TRACE_BLOCK_TOKENS)
        length = max(1, min(length, len(ids) * u))
        prompt = [t for h in ids for t in id_tokens(int(h), u)][:length]
        out_len = max(1, min(48, round(int(rec["output_length"]) * u / TRACE_BLOCK_TOKENS)))
        lora = self.rng.choice(LORAS) if self.kind == "lora" else None
        salt = None
        at = min(u, len(prompt))  # after the system prompt (trace id 0)
        if self.kind == "salt":
            salt = self.rng.choices(TENANTS, TENANT_WEIGHTS)[0]
            if self.rng.random() < 0.8:
                doc = self.rng.choices(range(DOCUMENTS), [1 / (d + 1) for d in range(DOCUMENTS)])
                prompt = prompt[:at] + self._document(doc[0]) + prompt[at:]
        mm: list[tuple[str, int, int]] = []
        if self.kind == "mm":
            prompt = prompt[:at] + [IMAGE_PLACEHOLDER] * IMAGE_TOKENS + prompt[at:]
            mm = [(self.rng.choices(IMAGES, IMAGE_WEIGHTS)[0], at, IMAGE_TOKENS)]
        if self.kind == "fanout" and self.rng.random() < 0.5:
            bs = self.block_size
            prompt = prompt[: max(bs, len(prompt) // bs * bs)]
        return self._group(prompt, lora, salt, mm, out_len)

    @staticmethod
    def _document(doc: int) -> list[int]:
        """Shared document ``doc``: the same tokens for every tenant and every run."""
        length = random.Random(f"document:{doc}").randint(64, 192)
        return id_tokens(-1 - doc, length)

    def _group(
        self,
        prompt: list[int],
        lora: str | None,
        salt: str | None,
        mm: list[tuple[str, int, int]],
        out_len: int,
    ) -> list[Plan]:
        if self.kind != "fanout":
            return [Plan(self._rid(), prompt, self._outputs(out_len), lora, salt, list(mm))]
        shared = self._outputs(min(out_len, self.rng.choice((0, 4, 16, 48))))
        rid = self._rid()
        return [
            Plan(f"{rid}.{k}", list(prompt), shared + self._outputs(out_len - len(shared)))
            for k in range(FANOUT)
        ]


# -- the engine ----------------------------------------------------------------------


def kv_cache_config(scenario: Scenario, block_size: int, hash_block_size: int) -> Any:
    """vLLM's KV-cache config of a scenario's layout (the tensors are never allocated)."""
    attn = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    groups = [
        KVCacheGroupSpec(["model.layers.0.attn"], FullAttentionSpec(block_size=block_size, **attn))
    ]
    if scenario.layout == "swa":
        swa = SlidingWindowSpec(block_size=block_size, sliding_window=SLIDING_WINDOW, **attn)
        groups.append(KVCacheGroupSpec(["model.layers.1.attn"], swa))
    elif scenario.layout == "mamba":
        # What vllm/model_executor/layers/mamba/mamba_mixer2.py gives a Mamba2
        # layer in align mode (the state can be exported inside a prefill).
        mamba = MambaSpec(
            block_size=block_size,
            shapes=((4, 4), (2, 4, 4)),
            dtypes=(torch.float16, torch.float16),
            mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=1,
        )
        groups.append(KVCacheGroupSpec(["model.layers.1.mixer"], mamba))
    return KVCacheConfig(
        num_blocks=scenario.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        hash_block_size=hash_block_size,
    )


@dataclass(slots=True)
class Stats:
    """What the engine did and published, for the harness's report."""

    requests: int = 0
    lookups: int = 0
    resumed_lookups: int = 0
    retry_lookups: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    preemptions: int = 0
    resets: int = 0
    cow_copies: int = 0
    steps: int = 0
    batches: int = 0
    events: Counter[str] = field(default_factory=Counter)
    examples: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k not in ("events", "examples")}
        out["events"] = dict(sorted(self.events.items()))
        out["examples"] = self.examples
        return out


class Engine:
    """The scheduler loop around one ``KVCacheManager`` (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, protocol: Protocol) -> None:
        sc = SCENARIOS[args.scenario]
        self.scenario = sc
        self.block_size = int(args.block_size or sc.block_size)
        self.hash_block_size = int(args.hash_block_size or sc.hash_block_size or self.block_size)
        self.protocol = protocol
        self.max_running = sc.max_running
        self.token_budget = int(args.max_batched_tokens)
        config = kv_cache_config(sc, self.block_size, self.hash_block_size)
        sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
        self.scheduler_block_size = math.lcm(*sizes)
        self.manager = KVCacheManager(
            config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(self.hash_block_size, hash_fn)
        self.groups = [
            {"kind": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size}
            for g in config.kv_cache_groups
        ]
        self.split = self._mamba_split() if sc.layout == "mamba" else None
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=0, endpoint=args.endpoint, replay_endpoint=args.replay_endpoint
        )
        self.workload = Workload(
            sc.kind,
            int(args.requests),
            int(args.seed),
            self.block_size,
            instance=int(args.instance),
            instances=int(args.instances),
        )
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self.plans: dict[str, Plan] = {}
        self.seq = -1
        self.admissions = 0
        self.stats = Stats()
        self._loras: dict[str, Any] = {}
        #: Requests looked up at least once (a second lookup without a preemption
        #: between is a retry: the first admission found no room).
        self._looked_up: set[str] = set()
        #: Cached copies per (group, hash), as the published events count them.
        self._copies: Counter[tuple[int, int]] = Counter()

    def _mamba_split(self) -> Any:
        """vLLM's own Mamba block-aligned chunk split, bound to the attributes it reads.

        In ``align`` mode a Mamba state is only cached where a chunk ends, so
        where the scheduler ends prefill chunks decides which prefixes vLLM
        can reuse; the split is ``Scheduler._mamba_block_aligned_split``
        itself, not a copy.
        """
        from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]

        coordinator = self.manager.coordinator
        shim = types.SimpleNamespace(
            block_size=self.scheduler_block_size,
            cache_config=types.SimpleNamespace(block_size=self.block_size),
            hash_block_size=self.hash_block_size,
            mamba_partial_cache_hit=(
                self.hash_block_size < self.block_size and coordinator.enable_partial_hash_hits
            ),
            use_eagle_block_drop=False,
            num_hash_lookahead_tokens=0,
            mamba_has_prefill_checkpoint_blocks=True,
            mamba_prefill_checkpoint_alignment=1,
            max_num_scheduled_tokens=self.token_budget,
            scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
            mamba_shared_prefix_checkpoint=False,
        )
        return types.MethodType(Scheduler._mamba_block_aligned_split, shim)

    # -- requests ------------------------------------------------------------

    def _lora(self, name: str | None) -> Any:
        if name is None:
            return None
        if name not in self._loras:
            self._loras[name] = LoRARequest(
                name, len(self._loras) + 1, f"/adapters/{name}", base_model_name="conformance"
            )
        return self._loras[name]

    def _request(self, plan: Plan) -> Any:
        mm = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=offset, length=length),
                mm_hash=ident,
            )
            for ident, offset, length in plan.mm
        ]
        self.plans[plan.rid] = plan
        return Request(
            plan.rid,
            list(plan.prompt),
            SamplingParams(max_tokens=len(plan.outputs)),
            None,
            mm_features=mm or None,
            lora_request=self._lora(plan.lora),
            cache_salt=plan.salt,
            block_hasher=self.hasher,
        )

    def _top_up(self) -> None:
        while len(self.waiting) < 2:
            group = self.workload.next_group()
            if not group:
                return
            self.stats.requests += len(group)
            self.waiting.extend(self._request(p) for p in group)

    # -- events --------------------------------------------------------------

    def publish_pending(self) -> None:
        """Publish every pending event as one batch (as vLLM does after a step)."""
        events = self.manager.take_events()
        if not events:
            return
        for ev in events:
            self._count(ev)
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        self.seq += 1
        self.stats.batches += 1

    def _count(self, ev: Any) -> None:
        c = self.stats.events
        name = type(ev).__name__
        if isinstance(ev, BlockStored):
            g = ev.group_idx
            c[f"stored_g{g}"] += 1
            c[f"stored_g{g}_blocks"] += len(ev.block_hashes)
            if ev.block_size != self.block_size:
                c[f"stored_g{g}_block_size_{ev.block_size}"] += 1
                self.stats.examples.setdefault(f"stored_block_size_{ev.block_size}", _brief(ev))
            if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
                c[f"stored_g{g}_tokens_not_hashes_x_size"] += 1
                self.stats.examples.setdefault(f"stored_g{g}_tokens_not_hashes_x_size", _brief(ev))
            keys = [k for k in ev.extra_keys or () if k is not None]
            if keys:
                c[f"stored_g{g}_extra_keys"] += 1
                self.stats.examples.setdefault(f"extra_keys_{self.scenario.kind}", _plain(keys[0]))
            for h in ev.block_hashes:
                self._copies[(g, _u64(h))] += 1
        elif isinstance(ev, BlockRemoved):
            g = ev.group_idx
            c[f"removed_g{g}"] += 1
            c[f"removed_g{g}_blocks"] += len(ev.block_hashes)
            for h in ev.block_hashes:
                key = (g, _u64(h))
                # What the stream itself tells a consumer that counts copies:
                # the hash is still cached in another physical block of the
                # group, or in another group.
                if self._copies[key] > 1:
                    c[f"removed_g{g}_copy_remains"] += 1
                if any(self._copies[(o, key[1])] for o in range(len(self.groups)) if o != g):
                    c[f"removed_g{g}_other_group_holds"] += 1
                self._copies[key] -= 1
                if self._copies[key] <= 0:
                    del self._copies[key]
        elif isinstance(ev, AllBlocksCleared):
            c["cleared"] += 1
            self._copies.clear()
        else:  # pragma: no cover - vLLM has no other kind today
            c[name] += 1

    # -- the lookup the harness checks -------------------------------------------

    def _announce(self, req: Any, truth: int, *, retry: bool) -> None:
        plan = self.plans[req.request_id]
        bs = self.block_size
        view = resolve_block_hashes(req.block_hashes, self.hash_block_size, bs)
        n_blocks = min(len(view), req.num_tokens // bs)
        self.protocol.send(
            {
                "req": req.request_id,
                "tokens": list(req.all_token_ids),
                "lora_name": plan.lora,
                "cache_salt": plan.salt,
                "mm": [list(m) for m in plan.mm],
                "hashes": [_u64(maybe_convert_block_hash(view[i])) for i in range(n_blocks)],
                "seq": self.seq,
                "truth": truth,
                "resumed": req.num_preemptions > 0,
                "retry": retry,
            }
        )

    def _lookup(self, req: Any) -> tuple[Any, int]:
        self.publish_pending()
        blocks, hit, boundary = self.manager.get_computed_blocks(req)
        req.shared_prefix_boundary = boundary
        retry = req.request_id in self._looked_up and req.num_preemptions == 0
        self._looked_up.add(req.request_id)
        st = self.stats
        st.lookups += 1
        st.resumed_lookups += int(req.num_preemptions > 0)
        st.retry_lookups += int(retry)
        st.hit_tokens += int(hit)
        st.lookup_tokens += int(req.num_tokens)
        self._announce(req, int(hit), retry=retry)
        self.protocol.wait_go()
        return blocks, int(hit)

    # -- scheduling ------------------------------------------------------------

    def _preempt(self, req: Any) -> None:
        """vLLM's ``_preempt_request``: free the blocks, back to the front of the queue."""
        self.manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _reset(self) -> None:
        """``reset_prefix_cache`` after preempting every running request, as vLLM's reset does."""
        while self.running:
            self._preempt(self.running.pop())
        if self.manager.reset_prefix_cache():
            self.stats.resets += 1

    def _chunk(self, req: Any, n: int, hit: int = 0) -> int:
        """The chunk vLLM's scheduler would run: ``n`` tokens, Mamba-aligned where due."""
        if self.split is None:
            return n
        return int(self.split(req, n, hit, 0))

    def step(self) -> None:
        """One scheduler step: running requests first, then admissions, then the forward pass."""
        if self.scenario.reset_every and self.admissions >= self.scenario.reset_every:
            # Between two steps, as vLLM's engine core calls it.
            self.admissions = 0
            self._reset()
        self.manager.new_step_starts()
        self.stats.steps += 1
        budget = self.token_budget
        scheduled: list[tuple[Any, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if n <= 0:
                i += 1
                continue
            while self.manager.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted
        while (
            not preempted and self.waiting and len(self.running) < self.max_running and budget > 0
        ):
            req = self.waiting[0]
            blocks, hit = self._lookup(req)
            n = self._chunk(req, min(req.num_tokens - hit, budget), hit)
            if n <= 0:
                break
            new = self.manager.allocate_slots(
                req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks
            )
            if new is None:
                break  # no room: it stays first in line and is looked up again
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
            self.admissions += 1
        if not scheduled and not self.running and self.waiting:
            # Nothing runs that could free blocks: retrying would spin forever.
            raise SystemExit(
                f"request {self.waiting[0].request_id} ({self.waiting[0].num_tokens} tokens) "
                f"cannot be admitted into an idle pool of {self.scenario.num_blocks} blocks"
            )
        # What vLLM's schedule() drains before the step runs: boundary-state
        # offers (for a connector; none here), new block ids to zero, and the
        # copy-on-write copies of partial hits, whose retained source and copy
        # go back to the pool once the step has run the copy.
        self.manager.take_boundary_state_offloads()
        self.manager.take_new_block_ids()
        copies, retained = self.manager.take_kv_cache_block_copies()
        self.stats.cow_copies += len(copies)
        if retained:
            self.manager.block_pool.free_blocks(retained)
        # The forward pass: every scheduled token is computed, each request
        # whose sequence is now computed samples its next planned token.
        for req, n in scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue
            plan = self.plans[req.request_id]
            req.append_output_token_ids(plan.outputs[req.num_output_tokens])
            if req.num_output_tokens >= len(plan.outputs):
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self.running.remove(req)
                self.manager.free(req)
                self.workload.finished(plan, req.all_token_ids)
                del self.plans[req.request_id]
                self._looked_up.discard(req.request_id)

    def run(self) -> None:
        """Run every request to its end, then publish what is left and report."""
        self.protocol.ready(
            {
                "scenario": next(k for k, v in SCENARIOS.items() if v is self.scenario),
                "vllm": str(vllm.__version__),
                "block_size": self.block_size,
                "hash_block_size": self.hash_block_size,
                "scheduler_block_size": self.scheduler_block_size,
                "groups": self.groups,
                "num_blocks": self.scenario.num_blocks,
                "partial_hash_hits": bool(self.manager.coordinator.enable_partial_hash_hits),
            }
        )
        while True:
            self._top_up()
            if not self.waiting and not self.running:
                break
            self.step()
        self.publish_pending()
        self.protocol.send({"done": True, "seq": self.seq, "stats": self.stats.as_dict()})
        self.publisher.shutdown()


def _u64(value: Any) -> int:
    """An engine hash as the unsigned 64-bit int the events carry (bytes: the last 8)."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(bytes(value)[-8:], "big")
    return int(value) & ((1 << 64) - 1)


def _plain(value: Any) -> Any:
    """An extra-keys entry as JSON can carry it (tuples as lists, bytes as hex)."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    return value


def _brief(ev: Any) -> dict[str, Any]:
    """An event's shape for the report (hash and token counts, not their values)."""
    return {
        "group_idx": ev.group_idx,
        "kv_cache_spec_kind": ev.kv_cache_spec_kind,
        "block_size": ev.block_size,
        "block_hashes": len(ev.block_hashes),
        "token_ids": len(ev.token_ids),
        "parent_block_hash": ev.parent_block_hash is not None,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line of the engine program."""
    p = argparse.ArgumentParser(prog="python -m lab.engines.vllm_engine", description=__doc__)
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--endpoint", required=True, help="PUB endpoint (ipc:// binds)")
    p.add_argument("--replay-endpoint", required=True, help="replay ROUTER endpoint (binds)")
    p.add_argument("--requests", type=int, default=2000, help="requests this engine runs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--block-size", type=int, default=0, help="0: the scenario's")
    p.add_argument("--hash-block-size", type=int, default=0, help="0: the scenario's")
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--instance", type=int, default=0, help="this engine's index (multi)")
    p.add_argument("--instances", type=int, default=1, help="engines sharing the trace")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one engine instance until its requests are done (or stdin closes)."""
    args = build_parser().parse_args(argv)
    # The protocol owns stdout; whatever vLLM or torch print goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    Engine(args, Protocol(out)).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
