"""``kvmesh trace synth``: Mooncake-format traces of named families, seeded and reproducible.

A trace is written in the bundled trace's format (:mod:`lab.traces`): one
JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (one id per 512-token block, chained by
prefix, new ids consecutive in order of first use). What a family controls
(:class:`Family`, every field a flag):

- **shared prefix**: ``shared_blocks`` blocks every prompt starts with (a
  platform system prompt), then one of ``system_prompts`` prompts of
  ``system_blocks`` blocks each (an application's system prompt, or an
  agent's tool definitions: a long shared context), chosen with Zipf skew
  ``system_zipf``;
- **retrieved documents**: ``documents_per_session`` distinct documents of a
  corpus of ``documents`` (``document_blocks_min`` to ``document_blocks_max``
  blocks each, Zipf skew ``document_zipf``) after the system prompt, in the
  order they were drawn;
- **conversations**: a session has a geometric number of turns (mean
  ``turns_mean``, at most ``turns_max``; it also ends once its prompt would
  pass ``max_input_tokens``); each turn's prompt is the whole conversation so
  far, the previous answer and a new message (``user_tokens_*``: a user's
  text or a tool's output), so its full blocks are the previous turn's and
  more; answers are ``output_tokens_*`` long; the next turn arrives when the
  answer has streamed (``answer_ms_per_token``) and ``think_s_*`` seconds
  more have passed (reading and typing, or a tool call); lengths and think
  times are log-normal (median, sigma);
- **arrivals and burstiness**: sessions start in bursts that arrive as a
  Poisson process; a burst holds a geometric number of sessions (mean
  ``burst_size``; 1 is a plain Poisson stream) starting within about
  ``burst_spread_s`` of each other and sharing one system prompt (a batch
  job, an evaluation run, a launch), so a burst brings many requests with the
  same new prefix at once. ``rate`` is the mean request rate.

A prompt's last block is partial unless its length is a multiple of 512; a
partial block gets an id of its own (its content is not the full block's).
The trace is a window of a stationary stream (:func:`synthesize`). Arrivals,
structure (prompts, documents, turn counts) and lengths are drawn from three
streams seeded from ``--seed``: the same seed and fields give the same bytes.

:func:`measure` reads the structure back from a trace's fields alone (it
knows nothing of the generator), for the tests and for the summary the
command prints: the prefix every request shares, how deep a conversation's
first prompt shares with other conversations, conversations and their turns
(a turn is a request whose prompt extends an earlier request's full blocks
below the last point where conversations part), prompt lengths, the
burstiness index of arrivals and the block reuse an unbounded cache would
see. The format cannot tell a first turn that adds less than one full block
to a shared prompt from a request of its own, so such a turn starts a
conversation of its own in the measure (no block of it can be reused anyway).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gzip
import heapq
import itertools
import json
import math
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_mooncake

BLOCK = MOONCAKE_BLOCK_SIZE


def _f(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True, slots=True)
class Family:
    """A trace family's structure (see the module docstring); every field is a flag."""

    name: str = _f("custom", "family name")
    summary: str = _f("", "one line on what the family stands for")
    requests: int = _f(8000, "requests to write")
    rate: float = _f(12.0, "mean requests per second")
    shared_blocks: int = _f(1, "blocks every prompt starts with")
    system_prompts: int = _f(16, "distinct system prompts (or tool contexts) after them")
    system_blocks: int = _f(2, "blocks of each system prompt")
    system_zipf: float = _f(1.0, "Zipf skew of system prompt popularity (0: uniform)")
    documents: int = _f(0, "documents in the retrieval corpus")
    documents_per_session: int = _f(0, "documents retrieved into a session's prompt")
    document_blocks_min: int = _f(2, "fewest blocks of a document")
    document_blocks_max: int = _f(8, "most blocks of a document")
    document_zipf: float = _f(1.0, "Zipf skew of document popularity")
    turns_mean: float = _f(4.0, "mean turns per conversation (geometric)")
    turns_max: int = _f(50, "most turns of a conversation")
    user_tokens_median: float = _f(800.0, "median tokens of a turn's new message")
    user_tokens_sigma: float = _f(1.0, "log-normal sigma of a turn's new message")
    output_tokens_median: float = _f(300.0, "median tokens of an answer")
    output_tokens_sigma: float = _f(0.7, "log-normal sigma of an answer")
    answer_ms_per_token: float = _f(30.0, "how fast an answer streams, ms per token")
    think_s_median: float = _f(60.0, "median seconds from an answer's end to the next turn")
    think_s_sigma: float = _f(0.9, "log-normal sigma of that think time")
    burst_size: float = _f(1.0, "mean sessions per burst (1: Poisson arrivals)")
    burst_spread_s: float = _f(2.0, "mean spread of a burst's session starts, seconds")
    max_input_tokens: int = _f(131_072, "context limit: a conversation ends before passing it")

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        positive = ("requests", "rate", "turns_mean", "turns_max", "burst_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.turns_mean < 1:
            raise ValueError("turns_mean must be >= 1")
        if self.burst_size < 1:
            raise ValueError("burst_size must be >= 1")
        non_negative = (
            "shared_blocks",
            "system_prompts",
            "system_blocks",
            "system_zipf",
            "documents",
            "documents_per_session",
            "document_zipf",
            "user_tokens_sigma",
            "output_tokens_sigma",
            "answer_ms_per_token",
            "think_s_median",
            "think_s_sigma",
            "burst_spread_s",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.system_blocks > 0 and self.system_prompts == 0:
            raise ValueError("system_blocks > 0 needs system_prompts >= 1")
        if self.documents_per_session > self.documents:
            raise ValueError("documents_per_session must be <= documents")
        if not 1 <= self.document_blocks_min <= self.document_blocks_max:
            raise ValueError("need 1 <= document_blocks_min <= document_blocks_max")
        if self.user_tokens_median < 1 or self.output_tokens_median < 1:
            raise ValueError("user_tokens_median and output_tokens_median must be >= 1")
        context = self.shared_blocks + self.system_blocks
        context += self.documents_per_session * self.document_blocks_max
        if (context + 1) * BLOCK > self.max_input_tokens:
            raise ValueError("the shared context alone passes max_input_tokens")


#: The named families. ``chat`` is multi-turn chat (its turns come as slowly
#: as the bundled trace's, a median two minutes apart); ``agent`` and ``rag``
#: are the cache-friendly and the reuse-poor ends; ``bursty`` is chat whose
#: sessions arrive in bursts sharing a new prompt. Each ``rate`` keeps a fleet
#: of 16 engines of the default service model (:mod:`lab.sim.engine`) about
#: half busy under P2C routing, so ``kvmesh replay --load`` 0.5 to 0.9 runs a
#: family at 1-2x its own pace and turns keep their gaps.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="chat",
            summary="multi-turn chat behind a few system prompts, Poisson arrivals",
        ),
        Family(
            name="agent",
            summary="tool-using agents: long shared tool contexts, many quick turns "
            "appending tool output",
            rate=4.0,
            shared_blocks=2,
            system_prompts=6,
            system_blocks=24,
            system_zipf=0.8,
            turns_mean=10.0,
            turns_max=40,
            user_tokens_median=1200.0,
            user_tokens_sigma=1.0,
            output_tokens_median=120.0,
            output_tokens_sigma=0.8,
            think_s_median=2.0,
            think_s_sigma=0.8,
        ),
        Family(
            name="rag",
            summary="retrieval: a few popular documents among many after a short "
            "system prompt, mostly single questions",
            rate=9.0,
            system_prompts=2,
            documents=500,
            documents_per_session=4,
            document_zipf=1.1,
            turns_mean=1.5,
            user_tokens_median=120.0,
            user_tokens_sigma=0.6,
            output_tokens_median=250.0,
            think_s_median=45.0,
        ),
        Family(
            name="bursty",
            summary="chat arriving in bursts of sessions that share a new, longer system prompt",
            rate=16.0,
            system_prompts=64,
            system_blocks=8,
            system_zipf=0.5,
            turns_mean=2.0,
            think_s_median=30.0,
            burst_size=20.0,
            burst_spread_s=1.0,
        ),
    )
}


def family(name: str, **overrides: Any) -> Family:
    """A named family with some fields replaced; raises ``ValueError`` for a bad one."""
    base = FAMILIES.get(name)
    if base is None:
        raise ValueError(f"unknown family {name!r} (choose from {', '.join(FAMILIES)})")
    unknown = set(overrides) - {f.name for f in fields(Family)}
    if unknown:
        raise ValueError(f"unknown family fields: {', '.join(sorted(unknown))}")
    fam = dataclasses.replace(base, **overrides)
    fam.check()
    return fam


# -- generation -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SynthTrace:
    """A generated trace and the generator's own record of it (the tests' ground truth)."""

    family: Family
    seed: int
    requests: list[TraceRequest]
    #: Session of every request, in trace order.
    session_of: list[int]


class _Ids:
    """Block ids chained by prefix: one per (parent id, block content)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int | None, tuple[Any, ...]], int] = {}
        self._next = itertools.count()

    def block(self, parent: int | None, content: tuple[Any, ...]) -> int:
        key = (parent, content)
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = next(self._next)
        return got

    def fresh(self) -> int:
        return next(self._next)


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss()) if sigma > 0 else median


def _zipf_table(n: int, skew: float) -> list[float]:
    """Cumulative weights of ranks ``0..n-1`` under Zipf skew ``skew``."""
    return list(itertools.accumulate(1.0 / (i + 1) ** skew for i in range(n)))


def _pick(rng: random.Random, cum: list[float]) -> int:
    return min(bisect.bisect_left(cum, rng.random() * cum[-1]), len(cum) - 1)


def _geometric(rng: random.Random, mean: float) -> int:
    """At least 1, mean ``mean``."""
    if mean <= 1:
        return 1
    p = 1.0 / mean
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


def synthesize(fam: Family, seed: int = 0) -> SynthTrace:
    """Generate ``fam.requests`` requests of ``fam``, the same for the same seed.

    The trace is a window of a stationary stream: sessions start from well
    before the window (three mean session lengths), so conversations are
    already under way at its start, and the window ends with its
    ``fam.requests``-th request (later turns of the sessions still open are
    cut off).
    """
    fam.check()
    arrivals = random.Random(f"{seed}/arrivals")
    structure = random.Random(f"{seed}/structure")
    lengths = random.Random(f"{seed}/lengths")
    ids = _Ids()
    shared: list[int] = []
    for b in range(fam.shared_blocks):
        shared.append(ids.block(shared[-1] if shared else None, ("shared", b)))
    system_cum = _zipf_table(fam.system_prompts, fam.system_zipf) if fam.system_prompts else []
    doc_cum = _zipf_table(fam.documents, fam.document_zipf) if fam.documents else []
    doc_blocks = [
        structure.randint(fam.document_blocks_min, fam.document_blocks_max)
        for _ in range(fam.documents)
    ]
    # Expected turns of the capped geometric, so that ``rate`` counts requests.
    p = 1.0 / fam.turns_mean
    turns_expected = (1.0 - (1.0 - p) ** fam.turns_max) / p if fam.turns_mean > 1 else 1.0
    burst_rate = fam.rate / (turns_expected * fam.burst_size)
    answer_s = fam.output_tokens_median * fam.answer_ms_per_token / 1000.0
    gap_mean = answer_s + fam.think_s_median * math.exp(fam.think_s_sigma**2 / 2)
    warmup = 3.0 * (turns_expected - 1.0) * gap_mean
    rows: list[tuple[float, int, int, int, int, list[int]]] = []
    # The window's latest times so far: a max-heap (negated) of the fam.requests smallest.
    window: list[float] = []
    t_burst = -warmup
    sid = 0
    while True:
        t_burst += arrivals.expovariate(burst_rate)
        if len(window) == fam.requests and -window[0] < t_burst:
            break  # every later session starts after the window's last request
        size = _geometric(arrivals, fam.burst_size)
        burst_prompt = _pick(structure, system_cum) if system_cum else 0
        for _ in range(size):
            offset = 0.0
            if size > 1 and fam.burst_spread_s > 0:
                offset = arrivals.expovariate(1.0 / fam.burst_spread_s)
            if fam.burst_size > 1:
                prompt = burst_prompt
            else:
                prompt = _pick(structure, system_cum) if system_cum else 0
            context = list(shared)
            for b in range(fam.system_blocks):
                context.append(ids.block(context[-1] if context else None, ("sys", prompt, b)))
            chosen: list[int] = []
            while len(chosen) < fam.documents_per_session:
                d = _pick(structure, doc_cum)
                if d not in chosen:
                    chosen.append(d)
            for d in chosen:
                for b in range(doc_blocks[d]):
                    context.append(ids.block(context[-1] if context else None, ("doc", d, b)))
            turns = min(_geometric(structure, fam.turns_mean), fam.turns_max)
            full = context
            tokens = len(context) * BLOCK
            t = t_burst + offset
            for turn in range(turns):
                user = max(1, round(_lognormal(lengths, fam.user_tokens_median,
                                               fam.user_tokens_sigma)))  # fmt: skip
                prompt_len = tokens + user
                if prompt_len > fam.max_input_tokens:
                    if turn:
                        break  # the conversation has filled the context
                    prompt_len = fam.max_input_tokens
                while len(full) < prompt_len // BLOCK:
                    full.append(ids.block(full[-1] if full else None, ("s", sid, len(full))))
                hash_ids = full[: prompt_len // BLOCK]
                if prompt_len % BLOCK:
                    hash_ids = [*hash_ids, ids.fresh()]
                out = max(1, round(_lognormal(lengths, fam.output_tokens_median,
                                              fam.output_tokens_sigma)))  # fmt: skip
                if t >= 0:
                    rows.append((t, sid, turn, prompt_len, out, hash_ids))
                    if len(window) < fam.requests:
                        heapq.heappush(window, -t)
                    elif t < -window[0]:
                        heapq.heapreplace(window, -t)
                tokens = prompt_len + out
                t += out * fam.answer_ms_per_token / 1000.0
                t += _lognormal(arrivals, fam.think_s_median, fam.think_s_sigma)
            sid += 1
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    del rows[fam.requests :]
    t0 = rows[0][0] if rows else 0.0
    # Ids renumbered in order of first use, as the Mooncake release numbers them.
    renumber: dict[int, int] = {}
    requests = []
    for t, _sid, _turn, prompt_len, out, hash_ids in rows:
        new = [renumber.setdefault(h, len(renumber)) for h in hash_ids]
        ms = round((t - t0) * 1000.0)
        requests.append(TraceRequest(float(ms), prompt_len, out, tuple(new)))
    return SynthTrace(fam, seed, requests, [r[1] for r in rows])


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write requests as Mooncake JSON lines (gzip-compressed for a ``.gz`` path)."""
    path = Path(path)
    lines = (
        json.dumps(
            {
                "timestamp": int(r.timestamp),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        + "\n"
        for r in requests
    )
    if path.suffix == ".gz":
        # No name, mtime 0: the same trace gives the same bytes.
        with (
            open(path, "wb") as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz,
        ):
            for line in lines:
                gz.write(line.encode("utf-8"))
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)


# -- measurement ------------------------------------------------------------------


def burstiness(gaps: Sequence[float]) -> float:
    """Goh and Barabasi's burstiness index of inter-arrival gaps: ``(s - m) / (s + m)``.

    -1 for a periodic stream, about 0 for a Poisson one, towards 1 for bursts;
    0 for fewer than two gaps or none longer than zero.
    """
    if len(gaps) < 2:
        return 0.0
    m = math.fsum(gaps) / len(gaps)
    s = math.sqrt(math.fsum((g - m) ** 2 for g in gaps) / len(gaps))
    return (s - m) / (s + m) if s + m > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TraceStructure:
    """What :func:`measure` reads back from a trace (see the module docstring)."""

    requests: int
    span_s: float
    rate: float
    input_tokens_mean: float
    input_tokens_p50: float
    input_tokens_p95: float
    output_tokens_mean: float
    #: Blocks every request's prompt starts with.
    common_prefix_blocks: int
    #: Median depth (blocks) to which a conversation's first prompt shares its
    #: prefix with another conversation's.
    shared_depth_p50: float
    shared_depth_mean: float
    conversations: int
    turns_mean: float
    turns_max: int
    single_turn_share: float
    #: Burstiness index of all arrivals and of conversation starts.
    burstiness: float
    start_burstiness: float
    #: Share of prompt blocks an unbounded cache fed the stream in order already holds.
    reuse: float
    #: Conversation of every request, numbered by first turn.
    conversation_of: list[int] = field(repr=False, compare=False, default_factory=list)

    def summary(self) -> dict[str, float]:
        """The figures, without the per-request conversation numbers."""
        out = dataclasses.asdict(self)
        del out["conversation_of"]
        return out


def _full_blocks(req: TraceRequest) -> tuple[int, ...]:
    """The ids of the prompt's full blocks (a partial last block dropped)."""
    n = req.input_length // BLOCK
    return req.hash_ids[: min(n, len(req.hash_ids))]


def measure(trace: Sequence[TraceRequest]) -> TraceStructure:
    """Read a trace's structure from its fields alone (see the module docstring)."""
    n = len(trace)
    fulls = [_full_blocks(r) for r in trace]
    children: dict[int | None, set[int]] = {}
    for path in fulls:
        parent: int | None = None
        for h in path:
            children.setdefault(parent, set()).add(h)
            parent = h
    branching = {h for h, kids in children.items() if len(kids) >= 2}
    # Deepest branching point on each path: 1 + its index (0 when none).
    parted = []
    for path in fulls:
        depth = 0
        for i, h in enumerate(path):
            if h in branching:
                depth = i + 1
        parted.append(depth)
    # Turns: the latest earlier request ending (full blocks) on the path, below the parting.
    last_end: dict[int, int] = {}
    conv: list[int] = []
    firsts: list[int] = []
    for j, path in enumerate(fulls):
        parent_req = None
        for i in range(len(path) - 1, parted[j] - 1, -1):
            got = last_end.get(path[i])
            if got is not None:
                parent_req = got
                break
        if parent_req is None:
            conv.append(len(firsts))
            firsts.append(j)
        else:
            conv.append(conv[parent_req])
        if path:
            last_end[path[-1]] = j
    sizes = [0] * len(firsts)
    for c in conv:
        sizes[c] += 1
    # A first prompt's depth shared with other conversations: to its parting point.
    first_depths = [float(min(parted[j], len(fulls[j]))) for j in firsts] or [0.0]
    common = 0
    if trace:
        first = trace[0].hash_ids
        common = len(first)
        for r in trace[1:]:
            k = 0
            limit = min(common, len(r.hash_ids))
            while k < limit and r.hash_ids[k] == first[k]:
                k += 1
            common = k
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        for k, h in enumerate(r.hash_ids):
            if h not in seen:
                hit += k  # the prefix before the first miss was cached
                break
        else:
            hit += len(r.hash_ids)
        seen.update(r.hash_ids)
        total += len(r.hash_ids)
    times = [r.timestamp / 1000.0 for r in trace]
    span = times[-1] - times[0] if n >= 2 else 0.0
    start_times = [times[j] for j in firsts]
    inputs = [float(r.input_length) for r in trace] or [0.0]
    return TraceStructure(
        requests=n,
        span_s=span,
        rate=(n - 1) / span if span > 0 else 0.0,
        input_tokens_mean=math.fsum(inputs) / len(inputs),
        input_tokens_p50=percentile(inputs, 0.5),
        input_tokens_p95=percentile(inputs, 0.95),
        output_tokens_mean=math.fsum(r.output_length for r in trace) / n if n else 0.0,
        common_prefix_blocks=common,
        shared_depth_p50=percentile(first_depths, 0.5),
        shared_depth_mean=math.fsum(first_depths) / len(first_depths),
        conversations=len(firsts),
        turns_mean=n / len(firsts) if firsts else 0.0,
        turns_max=max(sizes, default=0),
        single_turn_share=sum(1 for s in sizes if s == 1) / len(sizes) if sizes else 0.0,
        burstiness=burstiness([b - a for a, b in itertools.pairwise(times)]),
        start_burstiness=burstiness([b - a for a, b in itertools.pairwise(start_times)]),
        reuse=hit / total if total else 0.0,
        conversation_of=conv,
    )


def format_structure(s: TraceStructure) -> str:
    """The summary ``kvmesh trace synth`` prints."""
    return "\n".join(
        [
            f"{s.requests:,} requests over {s.span_s:,.0f} s ({s.rate:.2f}/s); "
            f"prompt tokens mean {s.input_tokens_mean:,.0f}, p50 {s.input_tokens_p50:,.0f}, "
            f"p95 {s.input_tokens_p95:,.0f}; answer tokens mean {s.output_tokens_mean:,.0f}",
            f"prefix shared by all: {s.common_prefix_blocks} blocks; first prompts share "
            f"with another conversation to {s.shared_depth_p50:g} blocks (median), "
            f"{s.shared_depth_mean:.1f} (mean)",
            f"{s.conversations:,} conversations, {s.turns_mean:.2f} turns on average "
            f"(max {s.turns_max}, {s.single_turn_share:.0%} single-turn)",
            f"burstiness index: arrivals {s.burstiness:+.2f}, conversation starts "
            f"{s.start_burstiness:+.2f} (0 Poisson, towards 1 bursty)",
            f"block reuse with an unbounded cache: {s.reuse:.1%}",
        ]
    )


# -- command ----------------------------------------------------------------------

#: Fields that are not flags (the family argument names the family).
_NOT_FLAGS = {"name", "summary"}


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh trace synth``."""
    p = argparse.ArgumentParser(
        prog="kvmesh trace synth",
        description="Write a Mooncake-format trace of a named family (chat, agent, rag, "
        "bursty), seeded; any field of the family can be set with its flag, and the "
        "trace's measured structure is printed. Families: "
        + "; ".join(f"{f.name}: {f.summary}" for f in FAMILIES.values())
        + ".",
        formatter_class=HelpFormatter,
    )
    p.add_argument("family", nargs="?", choices=sorted(FAMILIES), help="the family")
    p.add_argument("-o", "--out", default=None, help="write the trace here (.gz: compressed)")
    p.add_argument("--seed", type=int, default=0, help="seed of every draw")
    p.add_argument(
        "--print-spec",
        action="store_true",
        help="print the family's fields (after the flags) as JSON and exit",
    )
    p.add_argument(
        "--measure",
        default=None,
        metavar="TRACE",
        help="print the measured structure of an existing trace and exit",
    )
    for f in fields(Family):
        if f.name in _NOT_FLAGS:
            continue
        kind = type(f.default)
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=None,
            help=f"{f.metadata['help']} (default: the family's)",
        )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh trace synth``; returns the exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.measure is not None:
        try:
            trace = load_mooncake(args.measure)
        except (OSError, ValueError) as e:
            print(f"kvmesh trace synth: {e}", file=sys.stderr)
            return 2
        print(format_structure(measure(trace)))
        return 0
    if args.family is None:
        print("kvmesh trace synth: name a family or give --measure TRACE", file=sys.stderr)
        return 2
    overrides = {
        f.name: getattr(args, f.name)
        for f in fields(Family)
        if f.name not in _NOT_FLAGS and getattr(args, f.name) is not None
    }
    try:
        fam = family(args.family, **overrides)
    except ValueError as e:
        print(f"kvmesh trace synth: {e}", file=sys.stderr)
        return 2
    if args.print_spec:
        print(json.dumps(dataclasses.asdict(fam), indent=2))
        return 0
    if args.out is None:
        print("kvmesh trace synth: give -o PATH (or --print-spec)", file=sys.stderr)
        return 2
    synth = synthesize(fam, args.seed)
    try:
        write_trace(synth.requests, args.out)
    except OSError as e:
        print(f"kvmesh trace synth: {e}", file=sys.stderr)
        return 2
    print(f"{fam.name} (seed {args.seed}) -> {args.out}")
    print(format_structure(measure(synth.requests)))
    return 0
