"""Unmasking policies: given the current block's logits, which masked positions become tokens.

The files: the shared parts (`decision`: what a strategy returns; `sampling`: per-row draws;
`rules` and `proposals`: the two bases; `lookahead`: several blocks at once; `strategy`: the
`UnmaskingStrategy` that joins them), then one file per published decoder: `fast_dllm`
(threshold, factor), `llada` (its proposal and linear schedule), `dream` (its `alg` scores and
timestep schedule), `dparallel` (the entropy threshold, d3LLM's lookahead), `sdar`,
`fast_dllm_v2` (sub-blocks), `dmax`, `llada2` (LLaDA2.1's editing), `rnd1`, `renoising`
(DiffusionGemma's canvas without a mask token), `wedlm` (its sliding window) and
`nemotron_labs_diffusion` (its proposal) and `linear_spec` (its self-speculation).

An `UnmaskingStrategy` is one policy, built once from a config (`UnmaskingStrategy.from_config`)
and passed to the loop. Two separate choices make it, each an object:

1. **Proposal and confidence** (a `Proposal`: `LLaDAProposal` or `DreamProposal`): the token
   proposed for each masked position and a confidence score.
   - LLaDA (`alg=None`): argmax of the logits, with Gumbel-max noise in float64 when
     temperature > 0; confidence = softmax probability of the proposed token
     (`remasking='low_confidence'`) or uniform noise (`remasking='random'`).
   - Dream (`alg` = 'origin' | 'maskgit_plus' | 'topk_margin' | 'entropy'): tokens sampled from
     softmax(logits / temperature) (argmax at temperature 0, after optional top-p / top-k);
     confidence = that token's probability (maskgit_plus, and origin when combined with a
     threshold), top-1 minus top-2 probability (topk_margin), or negative entropy (entropy).
     With a threshold or factor rule the confidence is always the token's probability, whatever
     `alg` says: those rules are defined on probabilities, as in Fast-dLLM's Dream code.
2. **How many / which** (a `SelectionRule`, registered by name in `registry.SELECTION_RULES`; which one a
   config means is `config.selection_rule_name`, the one statement of the precedence
   unmasking > factor > threshold > schedule; a new rule is one class and
   `register_selection_rule`):
   - `Threshold` (Fast-dLLM): every masked position with confidence >= threshold, and always at
     least the most confident one.
   - `Factor` (Fast-dLLM, Theorem 1): sort confidences c_1 >= c_2 >= ...; take the top n for the
     largest n such that c_m >= 1 - factor / (m + 1) for every m <= n, i.e. (m + 1)(1 - c_m) <=
     factor; always at least one. *Deliberate difference*: the reference code also takes every
     token when the first failing rank is the last one (an off-by-one in its loop); we take
     exactly the ranks that pass, as the paper's rule says.
   - `LinearSchedule` (LLaDA): step i of a block unmasks the k_i most confident positions, the
     block's masks split evenly over its steps, the remainder going to the first steps.
   - `Quota` (SDAR): step i's quota is the block length split over the block's steps; every
     masked position strictly above the threshold if they fill the quota, else the quota's
     top-k; with SDAR's models, confidences from the unfiltered probabilities (`SDARProposal`).
   - `DreamSchedule` (Dream): timesteps linspace(1, eps, steps + 1); step i unmasks
     int(n_masked * (1 - s / t)) positions (all of them at the last step), by top-k confidence or,
     with `alg_temp` > 0, sampled from softmax(confidence / alg_temp). With alg='origin' each
     masked position is instead revealed independently with probability 1 - s / t.
     *Deliberate difference*: Dream averages the mask count over the batch; we count per row, so
     that a row decodes the same in a batch as alone.

Ties in confidence are broken towards the leftmost position. LLaDA's confidence (the proposed
token's softmax probability) is computed in float64, as the reference does: it decides a top-k
ranking, and confident positions that tie in float32 (0.99999237 for several at once) are
ordered by their float64 values, as there. It is the reference's own expression (softmax in
float64, gathered at the token), not the equal-in-exact-arithmetic exp(logit - logsumexp): the two
round near-certain probabilities differently (1 - 2e-16 against 1.0) and so rank them differently.
Dream's confidences are float32, as in Dream's code.
Randomness comes from one generator per row, drawn only for rows that still have masks in the
block, so batched and single runs consume identical random streams.
"""

from .base import DECODERS, Decoder, DecodeView, register_decoder
from .decision import Decision, SelfConditioning, Signal, SoftTokens, token_logprobs
from .dmax import DMaxProposal, LeftToRight
from .dparallel import EntropyLookahead, EntropyThreshold
from .dream import DreamProposal, DreamSchedule
from .fast_dllm import Factor, FirstPositionAtBlockStart, Threshold
from .fast_dllm_v2 import FastDLLMv2Proposal, SubBlocks
from .linear_spec import LinearSpec
from .llada import LinearSchedule, LLaDAProposal
from .llada2 import Editing, LLaDA2Proposal
from .lookahead import Lookahead
from .nemotron_labs_diffusion import NemotronLabsDiffusionProposal
from .proposals import Proposal
from .renoising import RenoisingStrategy, check_canvas
from .rnd1 import RND1Proposal, RND1Schedule
from .rules import BlockClock, SelectionRule, linear_schedule_at, register_selection_rule
from .sdar import Quota, SDARProposal
from .strategy import UnmaskingStrategy, lookahead_for, proposal_for
from .wedlm import WeDLMRule, WeDLMStrategy

__all__ = [
    "DECODERS",
    "BlockClock",
    "DecodeView",
    "Decoder",
    "SelfConditioning",
    "Signal",
    "register_decoder",
    "DMaxProposal",
    "Decision",
    "DreamProposal",
    "DreamSchedule",
    "Editing",
    "EntropyLookahead",
    "EntropyThreshold",
    "Factor",
    "FastDLLMv2Proposal",
    "FirstPositionAtBlockStart",
    "LLaDA2Proposal",
    "LLaDAProposal",
    "LeftToRight",
    "LinearSchedule",
    "LinearSpec",
    "Lookahead",
    "NemotronLabsDiffusionProposal",
    "Proposal",
    "Quota",
    "RND1Proposal",
    "RND1Schedule",
    "RenoisingStrategy",
    "SDARProposal",
    "SelectionRule",
    "SoftTokens",
    "SubBlocks",
    "Threshold",
    "UnmaskingStrategy",
    "WeDLMRule",
    "WeDLMStrategy",
    "check_canvas",
    "linear_schedule_at",
    "lookahead_for",
    "proposal_for",
    "register_selection_rule",
    "token_logprobs",
]
