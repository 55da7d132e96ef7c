"""Cache policies: which part of each row each decoding step recomputes.

Every policy answers one question for the generation loop: "which window of each row does this
step compute?" The runner computes them (`kv.runner.KVRunner.logits`), all rows' windows in one
packed forward (`Transformer.packed_logits`): no padding, each row attending over its own keys:

- `NoCache`: the whole sequence at every step (LLaDA's baseline).
- `PrefixCache`: at a block's first step a full forward fills the cache (and decodes); later steps
  recompute [block start, end of sequence) against the cached prefix (Fast-dLLM prefix cache).
- `DualCache`: the same, but later steps recompute only the block, against the cached prefix *and*
  the cached masked suffix (Fast-dLLM DualCache).
- `SubBlockCache`: DualCache, and with sub-blocks, later steps of a sub-block recompute only that
  sub-block against the cached block (Fast-dLLM v2's block cache).
- `DelayedCache`: a committed prefix that takes a finished block only `cache_delay` forwards after
  it finished, full forwards while one waits (d3LLM's KV cache for decoding several blocks at once).

Rows are on their own clocks: in one step some rows are at their block's first step and others in
the middle of theirs; each gets its own window in the same forward. The cache is refreshed when a
row's new block starts, i.e. when its previous one completed. How much a block-start forward
recomputes is the policy's refresh rule (a `RefreshRule`, named in `REFRESH_RULES`):
- "full" (Fast-dLLM): the whole sequence;
- "vicinity" (after dInfer's vicinity refresh): only from the just-finished block (blocks, when
  multi-block decoding finished more than one since the last block start) to the end
  (its tokens just became final, and the current block and what follows it see them), against
  the cached K/V of everything before it; the prompt's K/V are computed once per generation, at
  the first block. `refresh_every` N adds a full refresh every N blocks (1: every block, which is
  "full"). A row that joins gets a full forward at its first block;
- "adaptive": the vicinity refresh, then a test of whether it sufficed. The current block's
  positions are all still masked, so their tokens did not change since their keys were cached:
  any change of their last-layer keys, cached against recomputed now, is the effect of the
  just-finished block's tokens through attention, the same effect that leaves the older prefix's
  cached K/V stale. A row whose relative change exceeds `refresh_tol` gets a full forward at once
  (its logits and cache replaced). The test is per row, so a row decodes the same in a batch as
  alone.
"""

from .base import CachePolicy, SequenceView, cache_policy, register_cache_policy
from .delayed import DelayedCache
from .none import NoCache
from .prefix import DualCache, PrefixCache
from .refresh import RefreshRule, register_refresh_rule
from .sub_block import SubBlockCache

__all__ = [
    "CachePolicy",
    "DelayedCache",
    "DualCache",
    "NoCache",
    "PrefixCache",
    "RefreshRule",
    "SequenceView",
    "SubBlockCache",
    "cache_policy",
    "register_cache_policy",
    "register_refresh_rule",
]
