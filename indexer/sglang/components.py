"""KV components of hybrid-attention SGLang workers: the cache spec and the prefix rule.

A hybrid model's SGLang cache holds up to three *components* per page: full
attention (FULL), sliding-window attention (SWA) and the Mamba state (MAMBA).
A worker says which it has in ``WorkerCacheSpec`` (``components`` bits 1, 2
and 4, ``swa_window_tokens``, and per component the tiers it may be served
from, as ``1 << TierType`` bits); each REPORT says per hash which components
of that page it holds (``component_masks``). Evicting one component of a page
leaves the others: the engine revokes and reports the page again with the
mask it has left.

The reusable prefix of a worker (SGLang's rule, which this module follows):
the largest ``N`` such that

- FULL is held on every page ``0..N``;
- if the worker has SWA: page ``N - 1`` holds SWA, and the pages holding SWA
  without a break up to ``N - 1`` cover ``swa_window_tokens`` tokens or
  reach the prompt's first page;
- if the worker has MAMBA: page ``N - 1`` holds the Mamba state;

counting only placements on a tier the spec allows for that component, and
only GPU (HBM) and CPU (DRAM): a page on SSD is not servable in this version.
A spec with no component, a version above :data:`SPEC_VERSION`, or SWA
without a window makes the worker's prefix 0 (fail closed: a spec this build
cannot read must not route requests to a cold worker).

A worker without a spec is *legacy*: every page it reports counts whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from indexer.model import Tier

COMPONENT_FULL = 1
COMPONENT_SWA = 2
COMPONENT_MAMBA = 4
#: Each component, in bit order, with the label of its namespace.
COMPONENTS: tuple[tuple[int, str], ...] = (
    (COMPONENT_FULL, "full"),
    (COMPONENT_SWA, "swa"),
    (COMPONENT_MAMBA, "mamba"),
)
#: Highest WorkerCacheSpec.version read here (0, the proto default, reads as 1).
SPEC_VERSION = 1
#: The ``TierType`` number of each servable tier (HBM, DRAM); SSD is not servable.
SERVABLE_TIERS: dict[Tier, int] = {Tier.GPU: 1, Tier.CPU: 2}


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """``WorkerCacheSpec`` in domain form (tier masks in ``1 << TierType`` bits)."""

    version: int = 0
    components: int = 0
    swa_window_tokens: int = 0
    full_tier_mask: int = 0
    swa_tier_mask: int = 0
    mamba_tier_mask: int = 0

    @property
    def usable(self) -> bool:
        """Whether the prefix rule can be applied (else the worker's prefix is 0)."""
        if self.components == 0 or self.version > SPEC_VERSION:
            return False
        return not (self.components & COMPONENT_SWA and self.swa_window_tokens == 0)

    def tier_mask(self, component: int) -> int:
        """The tiers ``component`` may be served from, as ``1 << TierType`` bits."""
        if component == COMPONENT_FULL:
            return self.full_tier_mask
        if component == COMPONENT_SWA:
            return self.swa_tier_mask
        return self.mamba_tier_mask

    def servable(self, component: int, tier: Tier) -> bool:
        """Whether a placement of ``component`` on ``tier`` counts for a prefix."""
        number = SERVABLE_TIERS.get(tier)
        return (
            number is not None
            and bool(self.components & component)
            and bool(self.tier_mask(component) >> number & 1)
        )

    def encode(self) -> str:
        """The spec as six decimal numbers (kept in the worker's incarnation)."""
        return ",".join(
            str(v)
            for v in (
                self.version,
                self.components,
                self.swa_window_tokens,
                self.full_tier_mask,
                self.swa_tier_mask,
                self.mamba_tier_mask,
            )
        )

    @classmethod
    def decode(cls, text: str) -> CacheSpec | None:
        """The spec :meth:`encode` wrote; None for anything else."""
        parts = text.split(",")
        if len(parts) != 6 or not all(p.isdigit() for p in parts):
            return None
        v = [int(p) for p in parts]
        return cls(v[0], v[1], v[2], v[3], v[4], v[5])


#: The 64-bit odd constant each component's engine hashes are derived with.
_DERIVE = {COMPONENT_FULL: 0x9E3779B97F4A7C15, COMPONENT_SWA: 0xC2B2AE3D27D4EB4F}
_DERIVE[COMPONENT_MAMBA] = 0x165667B19E3779F9


def component_hash(page_hash: int, component: int) -> int:
    """The engine hash under which one component of a page is stored.

    Each component of a page is a block of its own in the index (its own
    namespace, the page's hash as its key), and an instance maps each engine
    hash to one block: so each component gets a hash of its own, derived
    from the page's.
    """
    x = (page_hash ^ _DERIVE[component]) & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def prefix_blocks(
    spec: CacheSpec,
    full_depth: int,
    swa: Sequence[bool],
    mamba: Sequence[bool],
    page_tokens: int,
) -> int:
    """The worker's reusable prefix in pages, by the rule in the module docstring.

    ``full_depth``: how many leading pages hold FULL (servably); ``swa[i]`` and
    ``mamba[i]``: whether page ``i`` holds that component (servably), for
    ``i < full_depth`` (ignored when the spec lacks the component).
    """
    if not spec.usable:
        return 0
    has_swa = bool(spec.components & COMPONENT_SWA)
    has_mamba = bool(spec.components & COMPONENT_MAMBA)
    best = 0
    run = 0  # SWA tokens held without a break, ending at page i
    head_broken = False
    for i in range(full_depth):
        ok = True
        if has_swa:
            if swa[i]:
                run += page_tokens
                ok = not head_broken or run >= spec.swa_window_tokens
            else:
                run = 0
                head_broken = True
                ok = False
        if has_mamba and not mamba[i]:
            ok = False
        if ok:
            best = i + 1
    return best
