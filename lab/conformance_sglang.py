"""Conformance of the indexer's answers with SGLang 0.5.23's own radix cache.

The harness of ``lab/conformance.py`` (lockstep, real indexers on the memory
and Redis backends subscribed over ZMQ, Match over gRPC, exact / over /
under), with SGLang's engine program ``lab/engines/sglang_engine.py`` run by
the interpreter of a separate virtualenv (:func:`sglang_python`): SGLang's
``UnifiedRadixCache`` over its CPU allocators, real ``Req`` objects matched,
checkpointed and released by SGLang's own functions, events published by
SGLang's own ``ZmqEventPublisher``.

**Indexer settings for an SGLang stream** (docs/engines.md, "SGLang"): one
``engine_events.endpoints`` entry per engine, ``block_size`` the engine's
``--page-size`` (1 included: the indexer's block size is the page size, so a
1-token-page stream is keyed token by token), and ``keys: engine_hashes``:
SGLang's block hashes (SHA-256 chained page by page, namespaced by LoRA and
salted by ``cache_salt``) become the block keys, and the router queries with
the hashes SGLang would publish for its prompt (the engine announces them).
The single-engine full-attention scenarios are also measured with ``keys:
tokens`` (kvmesh content keys from the events' ``token_ids``, the router
querying with token ids, its LoRA name and its ``cache_salt``), row
``<scenario>``; the ``engine_hashes`` row is ``<scenario>_engine_hashes``.
Media names (``GPU``, ``CPU_PINNED``, ``DISK``, ``EXTERNAL``) are tiers to the
decoder (indexer/kvevents/decode.py); these CPU engines publish ``GPU`` only
(SGLang's host tier needs its cache controller, which needs a device).

**How tokens are counted.** The scheduler matches at most ``n - 1`` tokens of
an ``n``-token request and the tree answers whole pages
(``device_prefix_len``), so SGLang reuses ``floor((n - 1) / P) x P`` tokens at
most for page size ``P``: the count vLLM's hit has, so
:func:`lab.conformance.predicted_tokens` applies as it is (with ``P = 1``,
``min(depth, n - 1)``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from lab.conformance import ROOT, EngineKind, EngineMissing, Spec

#: Environment variable naming the SGLang virtualenv's interpreter.
SGLANG_PYTHON_ENV = "KVMESH_SGLANG_PYTHON"
#: The SGLang virtualenv ``make setup`` creates.
LOCAL_SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


class SglangMissing(EngineMissing):
    """The SGLang virtualenv the engines run in is not there."""


def sglang_python(environ: Mapping[str, str] | None = None) -> Path:
    """The interpreter of the SGLang virtualenv: ``$KVMESH_SGLANG_PYTHON`` (read
    from ``environ``, this process's by default), else ``.venv-sglang``
    (``make setup``).

    Raises :class:`SglangMissing` saying how to make it.
    """
    env = (os.environ if environ is None else environ).get(SGLANG_PYTHON_ENV)
    candidates = [Path(env)] if env else [LOCAL_SGLANG_PYTHON]
    for path in candidates:
        if path.exists():
            return path
    raise SglangMissing(
        "no SGLang interpreter at " + " or ".join(str(p) for p in candidates) + "; run "
        f"`make setup` (it creates .venv-sglang with SGLang 0.5.23) or set {SGLANG_PYTHON_ENV}"
    )


#: Both key modes, the one docs/engines.md prescribes for SGLang first.
KEYS = ("engine_hashes", "tokens")

SPECS: dict[str, Spec] = {
    s.scenario: s
    for s in (
        Spec(
            "sglang_full",
            16,
            keys=KEYS,
            engine_scenario="full",
            what="16-token pages, trace-shaped multi-turn conversations, eviction, flushes",
        ),
        Spec(
            "sglang_page1",
            1,
            keys=KEYS,
            engine_scenario="page1",
            what="1-token pages (SGLang's default page size), eviction",
        ),
        Spec(
            "sglang_lora",
            16,
            keys=KEYS,
            engine_scenario="lora",
            what="base model and two LoRA adapters on the same prompts",
        ),
        Spec(
            "sglang_salt",
            16,
            keys=KEYS,
            engine_scenario="salt",
            what="two tenants' cache_salt on a shared system prompt and documents",
        ),
        Spec(
            "sglang_multi",
            16,
            engines=3,
            keys=("engine_hashes",),
            engine_scenario="multi",
            what="3 engine instances sharing the trace",
        ),
        Spec(
            "sglang_swa",
            16,
            keys=("engine_hashes",),
            engine_scenario="swa",
            what="full attention + sliding window 128 (UnifiedRadixCache FULL+SWA), small SWA pool",
        ),
        Spec(
            "sglang_mamba",
            1,
            keys=("engine_hashes",),
            engine_scenario="mamba",
            what="full attention + Mamba2 (UnifiedRadixCache FULL+MAMBA, no extra buffer), "
            "1-token pages, 24 state slots",
        ),
    )
}

#: Every SGLang scenario, in the order the table prints them.
SCENARIOS = tuple(SPECS)

#: SGLang 0.5.23, the engine of :data:`SPECS`.
SGLANG = EngineKind(
    "SGLang",
    "lab.engines.sglang_engine",
    "sglang",
    SPECS,
    sglang_python,
    # The engine loads no model and must never reach for the hub.
    {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
)
