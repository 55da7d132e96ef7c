"""The unmasking strategy: a proposal, a selection rule, editing and lookahead, returning one
`Decision` per step."""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ... import config as config_names
from ..registry import PROPOSALS, SELECTION_RULES
from .decision import Decision, SoftTokens
from .dmax import DMaxProposal
from .dparallel import EntropyLookahead
from .dream import DreamProposal
from .fast_dllm import FirstPositionAtBlockStart
from .fast_dllm_v2 import SubBlocks
from .llada import LLaDAProposal
from .llada2 import Editing
from .lookahead import Lookahead
from .proposals import Proposal
from .rules import BlockClock, SelectionRule
from .sampling import NEG_INF


class UnmaskingStrategy:
    """One unmasking policy: a proposal (tokens and confidences), a factory of the selection
    rule (`rule`: one object, as rules keep no state), whether it draws
    randomness (then each row gets a generator), its token editing (`Editing`, or None) and its
    multi-block decoding (`Lookahead`, or None: one block at a time).
    `confidence_temperature`: the confidences the rules read come from logits divided by it,
    the tokens from the logits as they are (a benchmark's calibrated view; greedy only)."""

    def __init__(
        self,
        proposal: Proposal,
        make_rule,
        draws_randomness: bool,
        editing: Editing | None = None,
        confidence_temperature: float = 1.0,
        lookahead: Lookahead | None = None,
    ):
        self.proposal, self.make_rule, self.draws_randomness = proposal, make_rule, draws_randomness
        self.editing, self.confidence_temperature = editing, confidence_temperature
        self.lookahead = lookahead
        self._rule: SelectionRule | None = None

    @property
    def fills_after_eos(self) -> bool:
        """Whether `eos_early_stop` fills the window after the first EOS (d3LLM's rule) rather than
        stopping the row at it (LLaDA2.0's): the lookahead's (`Lookahead.fills_after_eos`)."""
        return self.lookahead is not None and self.lookahead.fills_after_eos

    @classmethod
    def from_config(cls, config, rules=None) -> UnmaskingStrategy:
        """`rules`: the model family's `DecodingRules` (its own proposal, where it has one, and
        which of d3LLM's codes its multi-block decoding follows); None: LLaDA's."""
        rule = SELECTION_RULES[config_names.selection_rule_name(config)]
        proposal = proposal_for(config, rule, None if rules is None else rules.proposal)
        return cls(
            proposal,
            lambda: rule.from_config(config),
            proposal.draws_randomness() or rule.draws_randomness(config),
            Editing.from_config(config),
            config.confidence_temperature,
            lookahead_for(config, "llada" if rules is None else rules.d3llm_code),
        )

    def propose(self, logits: torch.Tensor, generators, draws, clock=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, confidence), each (B, T), for logits (B, T, V). `draws[i]` names the generator
        of batch row i, or is None for a row with nothing to reveal (it draws nothing)."""
        logits = logits if self.proposal.model_dtype else logits.float()
        tokens, conf = self.proposal(logits, generators, draws, clock)
        if self.confidence_temperature != 1.0:  # greedy (checked by the config): no randomness drawn twice
            _, conf = self.proposal(logits / self.confidence_temperature, generators, draws, clock)
        return tokens, conf

    def decide(
        self,
        logits: torch.Tensor,
        block: torch.Tensor,
        clock: BlockClock,
        generators,
        mask_id: int,
        later: torch.Tensor | None = None,
        editable: torch.Tensor | None = None,
        constraints: dict | None = None,
        carry: list | None = None,
    ) -> Decision:
        """One step's decision for every row: `logits` (B, W, V) of the current block (B, T) and,
        with multi-block decoding, of the blocks after it (`later`, (B, W - T) their tokens);
        `editable` (B, T) the revealed positions an editing rule may rewrite; `constraints`
        {row: grammar} the rows whose answers follow one. Every row takes part."""
        rule = self.rule
        blk = block.shape[1]
        masked = block == mask_id
        raw_logits = logits  # before the [MASK] guard: DMax's top probabilities include the mask
        drawing = None if generators is None else list(range(block.shape[0]))
        with record_function("fastdllm.propose"):
            tokens, conf = self.propose(logits, generators, drawing, clock)
        proposed_mask = tokens == mask_id
        # A model may rank [MASK] first (an untrained one does): revealing it would leave the
        # position masked for ever. Those positions get the best other token instead; the
        # references would loop or keep the mask there, and no other position changes. Greedy
        # proposals draw nothing, so the other token is proposed every step and no host read
        # decides it; sampled ones propose again only when needed, and only the rows that proposed
        # it draw again, so that each row's random stream advances as in the reference and as when
        # it decodes alone (one whose reference draws once per step takes the best other token
        # without drawing again: `Proposal.redraws`).
        if generators is None or bool(proposed_mask.any()):
            logits = logits.clone()
            logits[..., mask_id] = NEG_INF
            again = self.proposal.redraws and generators is not None
            redraw = None
            if again:
                redraw = [r if needs else None for r, needs in zip(drawing, proposed_mask.any(-1).tolist())]
            others, others_conf = self.propose(logits, generators if again else None, redraw, clock)
            tokens = torch.where(proposed_mask, others, tokens)
            conf = torch.where(proposed_mask, others_conf, conf)
        constraints = constraints or {}
        ahead_tokens = ahead = None
        if later is not None:  # the blocks after the current one: what the lookahead rule reveals
            ahead_tokens = tokens[:, blk:]
            later_masked = later == mask_id
            if constraints:  # a grammar reveals left to right: its later blocks wait
                later_masked[list(constraints)] = False
            ahead = self.lookahead.select(conf[:, blk:], later_masked, masked, conf[:, :blk]) & later_masked
            logits, tokens, conf = logits[:, :blk], tokens[:, :blk], conf[:, :blk]
        with record_function("fastdllm.select"):
            chosen = rule.select(conf, masked, clock, generators, drawing) & masked
        for i, constraint in constraints.items():  # the grammar's say: left to right, each token accepted
            constraint.amend(logits[i], tokens[i], chosen[i], masked[i])
        edited = None
        if self.editing is not None:
            if constraints:  # a checked token is never rewritten
                editable = editable.clone()
                editable[list(constraints)] = False
            edited = self.editing.select(tokens, conf, block, editable)
        top_token = top_prob = None
        if self.editing is not None and self.editing.needs_top:  # DMax's _get_prob_stats, float32
            lf = raw_logits[:, :blk].float()
            top_logit, top_token = lf.max(-1)
            top_prob = (top_logit - torch.logsumexp(lf, -1)).exp()
        decision = Decision(tokens, chosen, edited, ahead_tokens, ahead, top_token, top_prob)
        if self.editing is not None and self.editing.soft_embeddings:  # every revealed position, fed back
            decision.signal = SoftTokens(top_token, top_prob, editable | chosen)
        if self.editing is not None:
            decision.block_done, decision.carry = self.editing.block_done(
                block, decision, editable, clock, carry, mask_id
            )
        return decision

    @property
    def rule(self) -> SelectionRule:
        """The selection rule (rules keep no state: one serves every generation)."""
        if self._rule is None:
            self._rule = self.make_rule()
        return self._rule

    # Whether each block's first position is revealed at its block-start step, so that no later
    # step of the block reads that position's logit (`revealing_first_at_block_start`).
    reveals_first_at_block_start = False

    def _with_rule(self, make_rule) -> UnmaskingStrategy:
        strategy = UnmaskingStrategy(
            self.proposal, make_rule, self.draws_randomness, self.editing, self.confidence_temperature, self.lookahead
        )
        strategy.reveals_first_at_block_start = self.reveals_first_at_block_start
        return strategy

    def new_rule(self) -> SelectionRule:
        """A fresh selection rule."""
        return self.make_rule()

    def in_sub_blocks(self, size: int) -> UnmaskingStrategy:
        """The same strategy, revealing each block sub-block by sub-block (`SubBlocks`)."""
        inner = self.make_rule
        return self._with_rule(lambda: SubBlocks(inner(), size))

    def revealing_first_at_block_start(self) -> UnmaskingStrategy:
        """The same strategy whose block-start step reveals the block's first position
        (`FirstPositionAtBlockStart`: Fast-dLLM's Dream with a block cache, Fast-dLLM v2)."""
        inner = self.make_rule
        strategy = self._with_rule(lambda: FirstPositionAtBlockStart(inner()))
        strategy.reveals_first_at_block_start = True
        return strategy


def proposal_for(config, rule: type[SelectionRule], family_proposal: str | None = None) -> Proposal:
    """LLaDA's proposal without `alg`, Dream's with it. Only Dream's own schedule reads `alg` as
    a score: the parallel rules (threshold, factor) compare probabilities (Fast-dLLM's Dream
    "confidence_threshold"); a margin or a negative entropy is on another scale (an entropy score
    is never >= 0.9, so every step would reveal one token)."""
    if getattr(rule, "score", None) == "entropy":  # dParallel's entropy, in its LLaDA or Dream form
        return LLaDAProposal(config, "entropy") if config.alg is None else DreamProposal(config, "unfiltered_entropy")
    if getattr(rule, "score", None) == "logsumexp":
        return DMaxProposal(config)
    if getattr(rule, "proposal", None) is not None:  # a rule that comes with its reference's proposal
        return PROPOSALS[rule.proposal](config)
    if family_proposal is not None:
        return PROPOSALS[family_proposal](config)
    if config.alg is None:
        return LLaDAProposal(config)
    score = "probability"
    if rule.uses_steps:
        score = {"topk_margin": "margin", "entropy": "entropy"}.get(config.alg, "probability")
    return DreamProposal(config, score)


def lookahead_for(config, d3llm_code: str = "llada") -> Lookahead | None:
    """The lookahead a config asks for (None: one block at a time): d3LLM's entropy form with
    `unmasking="entropy"`, else the threshold form; `d3llm_code`: which of d3LLM's codes the model
    family follows (`DecodingRules`)."""
    if config.parallel_blocks == 1:
        return None
    args = (config.parallel_blocks, config.block_add_threshold, config.decoded_token_threshold)
    if config.unmasking == "entropy":
        return EntropyLookahead(*args, config.threshold, keeps_lowest=d3llm_code == "llada")
    return Lookahead(*args, config.lookahead_threshold)
