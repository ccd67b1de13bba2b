"""One SGLang engine's prefix cache, driven in lockstep for the conformance harness.

Run with the interpreter of a virtualenv that has SGLang 0.5.23 (``python -m
lab.engines.sglang_engine --scenario full --endpoint ipc://...
--replay-endpoint ipc://...`` with the repository on ``PYTHONPATH``);
``lab/conformance_sglang.py`` starts it. It imports the standard library,
SGLang and torch only, never kvmesh.

What runs is SGLang's own code: the server's default tree,
``UnifiedRadixCache`` (with its full-attention component, plus the SWA or
Mamba component for those layouts), over SGLang's own CPU allocators and
request-to-token pool; real ``Req`` objects matched, checkpointed and released
by SGLang's request-level functions (``Req.init_next_round_input``, which
calls ``match_kv_cache``; ``checkpoint_kv_cache``; ``release_kv_cache``;
``evict_from_tree_cache``); events published by SGLang's own
``ZmqEventPublisher`` as its scheduler publishes them (one
``KVEventBatch(ts, tree_cache.take_events())`` when there are any). Only the
loop around it is this module's: an event loop shaped like SGLang's
scheduler (a prefill batch when a request can be admitted, FCFS, at most one
chunked request, chunks ending on page boundaries, a checkpoint after every
chunk and after the prefill; otherwise one decode step of every running
request, retracting the newest when the pool runs dry; ``flush_cache`` when
idle), seeded and deterministic. One process is one engine instance.

**What SGLang reuses.** ``device_prefix_len`` of the match the scheduler
itself makes: the key is capped at ``num_tokens - 1`` tokens
(``Req._compute_max_prefix_len``: "the matched length is at most 1 less than
the input length"), then cut to whole pages (``RadixKey.page_aligned``). So an
``n``-token request reuses at most ``floor((n - 1) / page) x page`` tokens,
the same count as vLLM's; page size 1 makes that ``n - 1``.

**The router's hashes.** Each announcement carries the block hashes SGLang
publishes for the request's whole pages, computed by SGLang itself: the
request's key (tokens, LoRA namespace, ``cache_salt``) inserted into a
throwaway ``RadixCache`` with events on, its ``BlockStored`` hashes read back.
They are what ``keys: engine_hashes`` indexes, and what a router that hashes
prompts the way SGLang does would send.

**How SGLang scopes LoRA and salts** (``sglang/srt/mem_cache/events.py``,
``utils.py``, ``disaggregation/kv_events.py``). A LoRA request's
``extra_key`` is its adapter's ``lora_id`` (``LoRARef.deterministic_id`` of
name and path, as for ``--lora-paths``); the tree keeps each ``extra_key``
apart, and when the scheduler has registered the adapter's name
(``KvEventLoraNames``, as ``_record_kv_event_lora_name`` does on arrival) its
events carry ``lora_name`` and hashes namespaced by the ``lora_id``
(SHA-256 of a seed and the plain hash). ``cache_salt`` seeds the page chain
(its first page hashes on from a digest of the salt) and rides on every
``BlockStored`` as a field of its own (not vLLM's ``extra_keys``).

**Hybrid layouts.** ``swa``: a full-attention and a sliding-window layer over
SGLang's ``SWAKVPool`` and ``SWATokenToKVPoolAllocator`` with a small SWA
pool; SGLang frees sliding-window KV that left the window (at each
checkpoint, and every ``SWA_EVICTION_INTERVAL`` decoded tokens) and evicts SWA
values from its own LRU, keeping the nodes' full-attention KV. ``mamba``: a
Mamba2 layer in SGLang's ``HybridReqToTokenPool`` without the extra buffer
(so 1-token pages, states only where an insert ended), copy-on-write of a
matched state into the request's slot before the forward pass. Neither
component's frees or evictions produce an event.

Protocol (one JSON object per line; stdout is the protocol only, anything a
library prints goes to stderr): ``READY {...}`` with the engine's shape; then,
before each lookup, the engine publishes its pending events, matches, and
announces ``{"req", "tokens", "lora_name", "cache_salt", "mm": [], "hashes",
"seq", "truth", "resumed", "retry"}`` (``seq``: the last batch published, -1
for none; ``truth``: ``device_prefix_len``; ``hashes``: unsigned 64-bit) and
waits for ``{"go": true}`` on stdin; ``{"done": true, "stats": {...}}`` at the
end. Closing stdin stops the engine at its next read.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from array import array
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found]

from lab.engines.lockstep import (
    TOKEN_BASE,
    TRACE,
    TRACE_BLOCK_TOKENS,
    VOCAB,
    Protocol,
    id_tokens,
    trace_records,
)


def _declare_torchvision_ops() -> Any:
    """Declare torchvision's two operators when its own library did not load.

    The registry's torchvision 0.28.0 is a CUDA build: on a CPU-only torch its
    C++ operators are missing and ``import torchvision`` (which transformers,
    and so SGLang, import) fails registering fake kernels for them. Declaring
    the schemas is enough for the import; nothing here calls them.
    """
    try:
        torch.ops.torchvision.nms  # noqa: B018 - the lookup is the check
        return None
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return lib


_TORCHVISION_LIB = _declare_torchvision_ops()
# RadixCache's hash extension is compiled on first use; keep it with the
# interpreter so the second engine (and the next run) loads it at once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))

import sglang  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt import runtime_context  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.configs.mamba_utils import (  # type: ignore[import-not-found]  # noqa: E402
    Mamba2CacheParams,
    Mamba2StateShape,
)
from sglang.srt.disaggregation.kv_events import (  # type: ignore[import-not-found]  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from sglang.srt.lora.lora_registry import LoRARef  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.mem_cache.allocation import (  # type: ignore[import-not-found]  # noqa: E402
    alloc_paged_token_slots_decode,
    alloc_paged_token_slots_extend,
    alloc_req_slots,
    alloc_token_slots,
)
from sglang.srt.mem_cache.allocator.paged import (  # type: ignore[import-not-found]  # noqa: E402
    PagedTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.allocator.swa import (  # type: ignore[import-not-found]  # noqa: E402
    SWATokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.allocator.token import (  # type: ignore[import-not-found]  # noqa: E402
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found]  # noqa: E402
    InsertParams,
)
from sglang.srt.mem_cache.cache_init_params import (  # type: ignore[import-not-found]  # noqa: E402
    CacheInitParams,
)
from sglang.srt.mem_cache.common import (  # type: ignore[import-not-found]  # noqa: E402
    checkpoint_kv_cache,
    evict_from_tree_cache,
    release_kv_cache,
)
from sglang.srt.mem_cache.events import (  # type: ignore[import-not-found]  # noqa: E402
    KvEventLoraNames,
)
from sglang.srt.mem_cache.memory_pool import (  # type: ignore[import-not-found]  # noqa: E402
    HybridReqToTokenPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import (  # type: ignore[import-not-found]  # noqa: E402
    RadixCache,
    RadixKey,
)
from sglang.srt.mem_cache.swa_memory_pool import (  # type: ignore[import-not-found]  # noqa: E402
    SWAKVPool,
)
from sglang.srt.mem_cache.unified_cache.components import (  # type: ignore[import-not-found]  # noqa: E402
    ComponentType,
)
from sglang.srt.mem_cache.unified_radix_cache import (  # type: ignore[import-not-found]  # noqa: E402
    UnifiedRadixCache,
)
from sglang.srt.sampling.sampling_params import (  # type: ignore[import-not-found]  # noqa: E402
    SamplingParams,
)
from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found]  # noqa: E402

#: Longest context a request row holds (prompts stay far below it).
MAX_CONTEXT = 8192
#: A conversation stops growing here (its next turn is a new conversation), so
#: every prompt fits the smallest scenario pool with room to spare.
MAX_PROMPT_TOKENS = 4096
LORAS = (None, "sql-lora", "chat-lora")
TENANTS = ("tenant-a", "tenant-b")
TENANT_WEIGHTS = (0.7, 0.3)
#: Documents both tenants of the ``salt`` scenario put after the system prompt
#: (retrieved context), each 64 to 192 tokens, popularity ~ 1 / rank.
DOCUMENTS = 8
#: Tokens one prefill batch computes (SGLang's ``chunked_prefill_size``,
#: scaled down with the prompts): a longer prompt is prefilled in chunks.
CHUNKED_PREFILL_TOKENS = 1024
#: Share of a running request's remaining output the admission reserves
#: (SGLang's ``new_token_ratio``, here fixed): admission may overcommit, and
#: a decode step that finds no room retracts.
NEW_TOKEN_RATIO = 0.1
#: Tokens that slide out of a decoding request's window before its SWA slots
#: are freed (SGLang's ``SGLANG_SWA_EVICTION_INTERVAL`` default).
SWA_EVICTION_INTERVAL = 128


@dataclass(frozen=True, slots=True)
class Scenario:
    """What one engine instance is: its tree, pools and workload."""

    #: ``full`` (full attention only), ``swa`` (full + sliding window),
    #: ``mamba`` (full + Mamba2 state).
    layout: str
    page_size: int
    #: Tokens of the full-attention pool: small enough that a run evicts.
    pool_tokens: int
    #: ``plain``, ``lora`` (two adapters and the base model), ``salt`` (two tenants).
    kind: str = "plain"
    #: Admissions between two ``flush_cache`` calls (made when idle); 0: never.
    flush_every: int = 0
    max_running: int = 8
    #: Tokens of the SWA pool (``swa`` layout).
    swa_pool_tokens: int = 0
    #: Sliding window in tokens (``swa`` layout).
    sliding_window: int = 0
    #: Mamba state slots (``mamba`` layout).
    mamba_slots: int = 0


SCENARIOS: dict[str, Scenario] = {
    "full": Scenario("full", 16, 10_240, flush_every=120),
    "page1": Scenario("full", 1, 10_240),
    "lora": Scenario("full", 16, 10_240, kind="lora"),
    "salt": Scenario("full", 16, 10_240, kind="salt"),
    "multi": Scenario("full", 16, 7_680),
    "swa": Scenario("swa", 16, 10_240, swa_pool_tokens=3_072, sliding_window=128),
    # Without Mamba's extra buffer SGLang caches sequence-end states only and
    # requires 1-token pages.
    "mamba": Scenario("mamba", 1, 10_240, mamba_slots=24),
}


# -- the workload ------------------------------------------------------------------


@dataclass(slots=True)
class Plan:
    """One request before it becomes an SGLang ``Req``: its prompt and its future outputs."""

    rid: str
    prompt: list[int]
    outputs: list[int]
    lora: str | None = None
    salt: str | None = None


class Workload:
    """Requests shaped like the Mooncake conversation trace, plus follow-up turns.

    A root request takes the next trace record of this instance: each of its
    ``hash_ids`` (a 512-token block of the trace, chained by prefix, id 0 the
    shared system prompt) becomes ``unit_tokens`` tokens, and the prompt and
    output lengths are the trace's scaled by ``unit_tokens / 512``. A
    follow-up turn (probability ``follow_up``) continues a request that
    finished recently: its prompt is that request's prompt and outputs plus a
    new user message. ``lora`` picks the base model or one of two adapters per
    conversation; ``salt`` one of two tenants (70/30) and, mostly, one of
    eight shared documents after the system prompt.
    """

    def __init__(
        self,
        kind: str,
        requests: int,
        seed: int,
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
        self.unit_tokens = unit_tokens
        self.max_units = max_units
        self.follow_up = follow_up
        self.instance = instance
        self.rng = random.Random(f"kvmesh-conformance-sglang:{seed}:{kind}:{instance}")
        self._records = trace_records(trace, instance, instances)
        self._finished: deque[tuple[Plan, list[int]]] = deque(maxlen=8)
        self._count = 0

    def _tokens(self, n: int) -> list[int]:
        return [TOKEN_BASE + self.rng.randrange(VOCAB) for _ in range(n)]

    def finished(self, plan: Plan, all_tokens: Sequence[int]) -> None:
        """A request finished: its whole sequence may be continued by a follow-up turn."""
        self._finished.append((plan, list(all_tokens)))

    def next_plan(self) -> Plan | None:
        """The next arrival; None when the run's requests are all out."""
        if self.remaining <= 0:
            return None
        self.remaining -= 1
        self._count += 1
        rid = f"i{self.instance}-r{self._count}"
        if self._finished and self.rng.random() < self.follow_up:
            parent, tokens = self._finished[self.rng.randrange(len(self._finished))]
            if len(tokens) < MAX_PROMPT_TOKENS - 96:
                prompt = tokens + self._tokens(self.rng.randint(8, 96))
                outputs = self._tokens(self.rng.randint(1, 24))
                return Plan(rid, prompt, outputs, parent.lora, parent.salt)
        rec = next(self._records)
        ids = list(rec["hash_ids"])[: self.max_units]
        u = self.unit_tokens
        length = math.ceil(int(rec["input_length"]) * u / TRACE_BLOCK_TOKENS)
        length = max(1, min(length, len(ids) * u))
        prompt = [t for h in ids for t in id_tokens(int(h), u)][:length]
        out_len = max(1, min(48, round(int(rec["output_length"]) * u / TRACE_BLOCK_TOKENS)))
        lora = self.rng.choice(LORAS) if self.kind == "lora" else None
        salt = None
        if self.kind == "salt":
            salt = self.rng.choices(TENANTS, TENANT_WEIGHTS)[0]
            if self.rng.random() < 0.8:
                at = min(u, len(prompt))  # after the system prompt (trace id 0)
                weights = [1 / (d + 1) for d in range(DOCUMENTS)]
                doc = self.rng.choices(range(DOCUMENTS), weights)[0]
                prompt = prompt[:at] + self._document(doc) + prompt[at:]
        return Plan(rid, prompt, self._tokens(out_len), lora, salt)

    @staticmethod
    def _document(doc: int) -> list[int]:
        """Shared document ``doc``: the same tokens for every tenant and every run."""
        length = random.Random(f"document:{doc}").randint(64, 192)
        return id_tokens(-1 - doc, length)


# -- the protocol --------------------------------------------------------------------


@dataclass(slots=True)
class Stats:
    """What the engine did and published, for the harness's report."""

    requests: int = 0
    lookups: int = 0
    resumed_lookups: int = 0
    retry_lookups: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    #: Retracted running requests (SGLang's name for a preemption).
    preemptions: int = 0
    #: ``flush_cache`` calls (the harness's table calls them resets).
    resets: int = 0
    chunks: int = 0
    steps: int = 0
    batches: int = 0
    events: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "events"}
        out["events"] = dict(sorted(self.events.items()))
        return out


# -- the engine ----------------------------------------------------------------------


def _install_process_config(page_size: int) -> None:
    """The process-wide config SGLang's request and cache code reads (``get_serving()``…).

    A scheduler gets it from its launcher; here it is the defaults of a
    ``ServerArgs`` for a CPU engine with this page size, installed without
    resolving the model (there is no model: only its cache runs).
    """
    args = ServerArgs(model_path="kvmesh-conformance", device="cpu", page_size=page_size)
    # The Mamba caching grid comes from the model's config; with no model, the
    # value SGLang's own test fixtures pre-seed (its FLA chunk size).
    args._mamba_cache_chunk_size = max(64, page_size)
    runtime_context.get_context().set_server_args(args)


# -- the engine's cache: SGLang's own pools, allocator and tree -----------------------


def make_req_pool(sc: Scenario) -> Any:
    """Request rows; for the ``mamba`` layout, with SGLang's Mamba2 state pool."""
    rows = sc.max_running + 2
    if sc.layout != "mamba":
        return ReqToTokenPool(rows, MAX_CONTEXT, "cpu", False)
    # One Mamba2 layer with the smallest state: the slots exist, their
    # bytes do not matter.
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=8,
        n_groups=1,
        num_heads=2,
        head_dim=4,
        state_size=4,
        conv_kernel=4,
    )
    return HybridReqToTokenPool(
        size=rows,
        mamba_size=sc.mamba_slots,
        mamba_spec_state_size=rows,
        max_context_len=MAX_CONTEXT,
        device="cpu",
        enable_memory_saver=False,
        cache_params=Mamba2CacheParams(shape=shape, layers=[1]),
        mamba_layer_ids=[1],
        enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False,
    )


def make_allocator(sc: Scenario, page: int, req_pool: Any) -> Any:
    """The allocator SGLang's configurator picks for this layout and page size."""
    size = sc.pool_tokens
    if sc.layout == "swa":
        # Two attention layers, one full and one sliding-window, with
        # the smallest KV shape: the pools exist, their bytes do not matter.
        pool = SWAKVPool(
            size,
            sc.swa_pool_tokens,
            page,
            torch.float16,
            head_num=1,
            head_dim=8,
            swa_attention_layer_ids=[1],
            full_attention_layer_ids=[0],
            device="cpu",
        )
        return SWATokenToKVPoolAllocator(
            size,
            sc.swa_pool_tokens,
            page,
            torch.float16,
            "cpu",
            pool,
            need_sort=False,
            req_to_token_pool=req_pool,
        )
    if page == 1:
        return TokenToKVPoolAllocator(size, torch.float16, "cpu", None, need_sort=False)
    return PagedTokenToKVPoolAllocator(size, page, torch.float16, "cpu", None, need_sort=False)


def make_tree(sc: Scenario, page: int, req_pool: Any, allocator: Any, lora_names: Any) -> Any:
    """The server's default tree, ``UnifiedRadixCache``, with the layout's components
    and KV events on (as ``--kv-events-config`` turns them on)."""
    components = [ComponentType.FULL]
    if sc.layout == "swa":
        components.append(ComponentType.SWA)
    if sc.layout == "mamba":
        components.append(ComponentType.MAMBA)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page,
        enable_kv_cache_events=True,
        kv_event_lora_names=lora_names,
        chunked_prefill_size=CHUNKED_PREFILL_TOKENS,
        sliding_window_size=sc.sliding_window or None,
        tree_components=tuple(components),
    )
    return UnifiedRadixCache(params)


class Engine:
    """The scheduler loop around one ``UnifiedRadixCache`` (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, protocol: Protocol) -> None:
        sc = SCENARIOS[args.scenario]
        self.scenario = sc
        self.page = int(args.block_size or sc.page_size)
        self.protocol = protocol
        _install_process_config(self.page)
        self.lora_refs = {
            name: LoRARef(
                lora_id=LoRARef.deterministic_id(name, f"/adapters/{name}"),
                lora_name=name,
                lora_path=f"/adapters/{name}",
            )
            for name in LORAS
            if name is not None
        }
        # What the scheduler builds from --lora-paths, then fills per request.
        self.lora_names = KvEventLoraNames.from_lora_refs(self.lora_refs.values())
        self.req_pool = make_req_pool(sc)
        self.allocator = make_allocator(sc, self.page, self.req_pool)
        self.tree = make_tree(sc, self.page, self.req_pool, self.allocator, self.lora_names)
        # A second tree, never holding KV, that hashes a request's key as the
        # engine's events would (see the module docstring).
        self.hasher = RadixCache.create_simulated(
            page_size=self.page,
            enable_kv_cache_events=True,
            kv_event_lora_names=self.lora_names,
        )
        self.publisher = ZmqEventPublisher(
            attn_dp_rank=0, endpoint=args.endpoint, replay_endpoint=args.replay_endpoint
        )
        self.workload = Workload(
            sc.kind,
            int(args.requests),
            int(args.seed),
            instance=int(args.instance),
            instances=int(args.instances),
        )
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self.chunked: Any = None
        self.plans: dict[str, Plan] = {}
        self.seq = -1
        self.admissions = 0
        self.stats = Stats()
        #: Requests looked up at least once (a second lookup without a
        #: retraction between is a retry: the first admission found no room).
        self._looked_up: set[str] = set()
        self._started = False

    # -- requests ----------------------------------------------------------------

    def _req(self, plan: Plan) -> Any:
        params = SamplingParams(max_new_tokens=len(plan.outputs), ignore_eos=True)
        params.normalize(None)
        ref = self.lora_refs.get(plan.lora) if plan.lora else None
        req = Req(
            plan.rid,
            "",
            array("q", plan.prompt),
            params,
            lora_id=ref.lora_id if ref is not None else None,
            cache_salt=plan.salt,
        )
        if ref is not None:
            # The scheduler's _record_kv_event_lora_name, at arrival.
            self.lora_names.register(req, ref.lora_name)
        self.plans[plan.rid] = plan
        return req

    def _top_up(self) -> None:
        while len(self.waiting) < 2:
            plan = self.workload.next_plan()
            if plan is None:
                return
            self.stats.requests += 1
            self.waiting.append(self._req(plan))

    # -- events ------------------------------------------------------------------

    def publish_pending(self) -> None:
        """Publish every pending event as one batch (SGLang's ``publish_kv_events``)."""
        events = self.tree.take_events()
        if not events:
            return
        for ev in events:
            self._count(ev)
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        self.seq += 1
        self.stats.batches += 1

    def _count(self, ev: Any) -> None:
        c = self.stats.events
        if isinstance(ev, BlockStored):
            c["stored"] += 1
            c["stored_blocks"] += len(ev.block_hashes)
            if ev.cache_salt:
                c["stored_salted"] += 1
            if ev.lora_name:
                c["stored_lora"] += 1
        elif isinstance(ev, BlockRemoved):
            c["removed"] += 1
            c["removed_blocks"] += len(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            c["cleared"] += 1
        else:  # pragma: no cover - SGLang has no other kind today
            c[type(ev).__name__] += 1

    # -- the lookup the harness checks -------------------------------------------

    def _hashes(self, req: Any, tokens: array[int]) -> list[int]:
        """SGLang's published hashes of the request's whole pages (unsigned)."""
        whole = len(tokens) // self.page * self.page
        if whole == 0:
            return []
        self.hasher.reset()
        key = RadixKey(tokens[:whole], req.extra_key, cache_salt=req.cache_salt)
        self.hasher.insert(InsertParams(key=key))
        out: list[int] = []
        for ev in self.hasher.take_events():
            if isinstance(ev, BlockStored):
                out += [int(h) & ((1 << 64) - 1) for h in ev.block_hashes]
        return out

    def _lookup(self, req: Any) -> int:
        """Match as the scheduler does before admitting; announce; wait for ``go``."""
        if self._started:
            # Before the first ``go`` the harness's subscribers may still be
            # joining: what the tree recorded so far (the AllBlocksCleared of
            # its construction) goes out with the first batch after it.
            self.publish_pending()
        req.init_next_round_input(self.tree)
        hit = int(req.prefix_len)
        tokens = req.full_untruncated_fill_ids
        resumed = req.retraction_count > 0
        retry = req.rid in self._looked_up and not resumed
        self._looked_up.add(req.rid)
        st = self.stats
        st.lookups += 1
        st.resumed_lookups += int(resumed)
        st.retry_lookups += int(retry)
        st.hit_tokens += hit
        st.lookup_tokens += len(tokens)
        plan = self.plans[req.rid]
        self.protocol.send(
            {
                "req": req.rid,
                "tokens": list(tokens),
                "lora_name": plan.lora,
                "cache_salt": plan.salt,
                "mm": [],
                "hashes": self._hashes(req, tokens),
                "seq": self.seq,
                "truth": hit,
                "resumed": resumed,
                "retry": retry,
            }
        )
        self.protocol.wait_go()
        self._started = True
        return hit

    # -- memory ------------------------------------------------------------------

    def _paged(self, tokens: int) -> int:
        return -(-tokens // self.page) * self.page

    def _reserved(self) -> int:
        """Tokens already promised: the running requests' expected decode, and the
        rest of the chunked request (its prefill and its output)."""
        left = sum(r.sampling_params.max_new_tokens - len(r.output_ids) for r in self.running)
        held = int(left * NEW_TOKEN_RATIO)
        c = self.chunked
        if c is not None:
            held += self._paged(len(c.full_untruncated_fill_ids) - c.kv.kv_allocated_len)
            held += c.sampling_params.max_new_tokens
        return held

    def _fits(self, req: Any, hit: int) -> bool:
        """PrefillAdder's budget check (the whole request, not just its first chunk),
        with the matched prefix locked meanwhile."""
        lock = self.tree.lock(req.last_node)
        try:
            room = int(self.allocator.available_size() + self.tree.evictable_size())
        finally:
            self.tree.unlock(lock)
        n = len(req.full_untruncated_fill_ids)
        need = self._paged(n - hit) + req.sampling_params.max_new_tokens - len(req.output_ids)
        return bool(need + self._reserved() <= room)

    def _make_room(self, tokens: int, keep: Any) -> bool:
        """Evict, then retract the newest running requests but ``keep`` until
        ``tokens`` can be allocated (the scheduler's retract_decode)."""
        while True:
            evict_from_tree_cache(self.tree, tokens)
            if self.allocator.available_size() >= tokens:
                return True
            victims = [r for r in self.running if r is not keep]
            if not victims:
                return False
            self._retract(victims[-1])

    def _extend_row(self, req: Any, start: int, end: int) -> None:
        """Give ``req`` KV slots for positions ``[start, end)`` through SGLang's own
        allocation helpers (which evict from the tree first), as ``alloc_for_extend``
        and ``alloc_for_decode`` write them into the request's row."""
        row = self.req_pool.req_to_token[req.kv.req_pool_idx]
        if self.page == 1:
            slots = alloc_token_slots(self.tree, end - start)
        else:
            seq = torch.tensor([end], dtype=torch.int64)
            last = (
                row[start - 1 : start].to(torch.int64)
                if start
                else torch.tensor([-1], dtype=torch.int64)
            )
            if end - start == 1 and start:
                slots = alloc_paged_token_slots_decode(self.tree, seq, seq, last)
            else:
                pre = torch.tensor([start], dtype=torch.int64)
                slots = alloc_paged_token_slots_extend(
                    self.tree, pre, pre, seq, seq, last, end - start
                )
        row[start:end] = slots.to(row.dtype)
        req.kv.kv_allocated_len = end

    # -- scheduling ------------------------------------------------------------

    def _admit(self, budget: int) -> list[Any]:
        """Requests of the next prefill batch: the chunked one first, then FCFS admissions."""
        batch: list[Any] = []
        if self.chunked is not None:
            req = self.chunked
            start = req.kv.kv_committed_len
            end = self._chunk_end(start, len(req.full_untruncated_fill_ids), budget)
            if not self._make_room(self._paged(end - start), keep=req):
                raise SystemExit(f"no room for the next chunk of {req.rid} with nothing running")
            self._extend_row(req, start, end)
            req.extend_end = end
            batch.append(req)
            budget -= end - start
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(batch) < self.scenario.max_running
        ):
            if self._flush_due():
                break
            req = self.waiting[0]
            hit = self._lookup(req)
            n = len(req.full_untruncated_fill_ids)
            end = self._chunk_end(hit, n, budget)
            chunked = end < n
            if end <= hit or (chunked and self.chunked is not None):
                break  # only one chunked request at a time
            if not self._fits(req, hit):
                break  # no room: it stays first in line and is looked up again
            self.waiting.popleft()
            req.lock = self.tree.lock(req.last_node)
            alloc_req_slots(self.req_pool, [req], self.tree)
            prefix = self.tree.prefix_device_indices(req) if hit else None
            if prefix is not None:
                row = self.req_pool.req_to_token[req.kv.req_pool_idx]
                row[:hit] = prefix.to(row.dtype)
            self._extend_row(req, hit, end)
            req.extend_end = end
            batch.append(req)
            budget -= end - hit
            self.admissions += 1
            if chunked:
                self.chunked = req
        return batch

    def _chunk_end(self, start: int, n: int, budget: int) -> int:
        """Where this prefill stops: the whole prompt, or a page boundary within budget."""
        if n - start <= budget:
            return n
        return (start + budget) // self.page * self.page

    def _mamba_forward(self, batch: Sequence[Any]) -> None:
        """What the forward pass does with Mamba slots before it runs: the deferred
        copy-on-write of a matched state into the request's own slot
        (``ScheduleBatch._collect_deferred_mamba_cow_and_clear`` and the model
        runner's copy)."""
        if not self.tree.supports_mamba():
            return
        pool = self.req_pool
        for req in batch:
            if req.kv.mamba_cow_src_index is not None:
                src = pool.translate_mamba_indices(req.kv.mamba_cow_src_index.view(1))
                dst = pool.translate_mamba_indices(req.kv.mamba_pool_idx.view(1))
                pool.mamba_pool.copy_from(src, dst)
            req.kv.mamba_cow_src_index = None
            req.kv.mamba_needs_clear = False

    def _prefill(self, batch: Sequence[Any]) -> None:
        """The forward pass of a prefill batch, then SGLang's result processing."""
        self._mamba_forward(batch)
        for req in batch:
            req.kv.kv_committed_len = req.extend_end
            if req.extend_end < len(req.full_untruncated_fill_ids):
                checkpoint_kv_cache(req, self.tree)  # stash_chunked_request
                self.stats.chunks += 1
                continue
            if req is self.chunked:
                self.chunked = None
            self._sample(req)
            if req.finished():
                self._finish(req)
            else:
                checkpoint_kv_cache(req, self.tree)
                self.running.append(req)

    def _sample(self, req: Any) -> None:
        plan = self.plans[req.rid]
        req.output_ids.append(plan.outputs[len(req.output_ids)])
        req.update_finish_state()

    def _finish(self, req: Any) -> None:
        release_kv_cache(req, self.tree, checkpoint=True)
        plan = self.plans.pop(req.rid)
        self.workload.finished(plan, list(req.origin_input_ids) + list(req.output_ids))
        self._looked_up.discard(req.rid)

    def _retract(self, req: Any) -> None:
        """SGLang's retraction of a decoding request: back to the queue, KV released."""
        self.running.remove(req)
        release_kv_cache(req, self.tree, checkpoint=False)
        req.reset_for_retract()
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _decode(self) -> None:
        """One decode step of every running request (the newest retracted when out of room)."""
        for req in list(self.running):
            if req not in self.running:
                continue  # retracted by an earlier request of this step
            pos = req.kv.kv_committed_len
            if self.tree.supports_swa() and req.decode_batch_idx >= 1:
                # ScheduleBatch.maybe_evict_swa: the window has slid past these.
                window = self.tree.swa_retain_window
                if req.seqlen - 1 - window >= req.kv.get_evicted_seqlen(ComponentType.SWA) + (
                    SWA_EVICTION_INTERVAL
                ):
                    self.tree.evict_sliding_windows(req, req.seqlen - 1)
            if pos % self.page == 0 and not self._make_room(self.page, keep=req):
                self._retract(req)
                continue
            self._extend_row(req, pos, pos + 1)
            req.kv.kv_committed_len = pos + 1
            req.decode_batch_idx += 1
            self._sample(req)
            if req.finished():
                self.running.remove(req)
                self._finish(req)

    def _flush_due(self) -> bool:
        every = self.scenario.flush_every
        return bool(every) and self.admissions >= every

    def _flush(self) -> None:
        """SGLang's ``flush_cache`` (only ever called with nothing running)."""
        self.tree.reset()
        self.req_pool.clear()
        self.allocator.clear()
        self.req_pool.reset_aux_cache_allocator()
        self.admissions = 0
        self.stats.resets += 1

    def step(self) -> None:
        """One scheduler iteration: a prefill batch if one can be formed, else a decode
        step; then what the iteration recorded is published, as SGLang's event loop
        does once per iteration (lookups publish first, for the lockstep)."""
        self.stats.steps += 1
        if self._flush_due() and not self.running and self.chunked is None:
            self._flush()
        batch = self._admit(CHUNKED_PREFILL_TOKENS)
        ran = bool(batch) or bool(self.running)
        if batch:
            self._prefill(batch)
        elif self.running:
            self._decode()
        if self._started:
            self.publish_pending()
        if ran:
            return
        if self.waiting:
            req = self.waiting[0]
            raise SystemExit(
                f"request {req.rid} ({len(req.full_untruncated_fill_ids)} tokens) cannot be "
                f"admitted into an idle pool of {self.scenario.pool_tokens} tokens"
            )

    def run(self) -> None:
        """Run every request to its end, then publish what is left and report."""
        self.protocol.ready(
            {
                "scenario": next(k for k, v in SCENARIOS.items() if v is self.scenario),
                "sglang": str(sglang.__version__),
                "block_size": self.page,
                "layout": self.scenario.layout,
                "tree": type(self.tree).__name__,
                "components": [str(c.name) for c in self.tree.tree_components],
                "pool_tokens": self.scenario.pool_tokens,
            }
        )
        while True:
            self._top_up()
            if not self.waiting and not self.running and self.chunked is None:
                break
            self.step()
        self.publish_pending()
        self.protocol.send({"done": True, "seq": self.seq, "stats": self.stats.as_dict()})
        self.publisher.shutdown()


def build_parser() -> argparse.ArgumentParser:
    """The command line of the engine program."""
    p = argparse.ArgumentParser(prog="python -m lab.engines.sglang_engine", description=__doc__)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="required unless --warm-up")
    p.add_argument("--endpoint", help="PUB endpoint (ipc:// binds); required unless --warm-up")
    p.add_argument("--replay-endpoint", help="replay ROUTER endpoint (binds)")
    p.add_argument("--requests", type=int, default=2000, help="requests this engine runs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--block-size", type=int, default=0, help="page size; 0: the scenario's")
    p.add_argument("--instance", type=int, default=0, help="this engine's index (multi)")
    p.add_argument("--instances", type=int, default=1, help="engines sharing the trace")
    p.add_argument(
        "--warm-up",
        action="store_true",
        help="only build what the first engine would (SGLang's C++ hash extension, in "
        "$TORCH_EXTENSIONS_DIR) and check that every layout's tree constructs, then exit",
    )
    return p


def warm_up() -> None:
    """Hash a page and build every scenario's tree once: a broken virtualenv fails
    here (``make setup``), not in the middle of a conformance run."""
    _install_process_config(16)
    probe = RadixCache.create_simulated(page_size=16, enable_kv_cache_events=True)
    probe.insert(InsertParams(key=RadixKey(array("q", range(TOKEN_BASE, TOKEN_BASE + 16)))))
    if not any(isinstance(ev, BlockStored) for ev in probe.take_events()):
        raise SystemExit("SGLang's radix cache published no BlockStored")
    for sc in SCENARIOS.values():
        pool = make_req_pool(sc)
        allocator = make_allocator(sc, sc.page_size, pool)
        make_tree(sc, sc.page_size, pool, allocator, KvEventLoraNames())
    print(
        f"SGLang {sglang.__version__}: hash extension in {os.environ['TORCH_EXTENSIONS_DIR']}, "
        f"trees of {len(SCENARIOS)} scenarios built",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one engine instance until its requests are done (or stdin closes)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warm_up:
        warm_up()
        return 0
    if not (args.scenario and args.endpoint and args.replay_endpoint):
        parser.error("--scenario, --endpoint and --replay-endpoint are required")
    # The protocol owns stdout; whatever SGLang or torch print goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    Engine(args, Protocol(out)).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
