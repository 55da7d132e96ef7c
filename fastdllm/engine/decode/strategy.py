"""The masked decoder: a proposal, a selection rule, editing, lookahead and an early stop, returning
one complete `Decision` per step."""

from __future__ import annotations

import copy

import torch
from torch.profiler import record_function

from ... import config as config_names
from ..registry import PROPOSALS, SELECTION_RULES
from .base import Decoder, DecodeView, register_decoder
from .decision import Decision, SoftTokens
from .dmax import DMaxProposal
from .dparallel import EntropyLookahead
from .dream import DreamProposal
from .fast_dllm import FirstPositionAtBlockStart
from .fast_dllm_v2 import SubBlocks
from .llada import LLaDAProposal
from .llada2 import Editing, stop_at_first_stop
from .lookahead import Lookahead
from .proposals import Proposal
from .rnd1 import closing_tokens
from .rules import SelectionRule
from .sampling import NEG_INF


@register_decoder()
class UnmaskingStrategy(Decoder):
    """The masked decoder: a proposal (tokens and confidences), a factory of the selection rule
    (`rule`: one object, as rules keep no state), whether it draws randomness (then each row gets a
    generator), its token editing (`Editing`, or None), its multi-block decoding (`Lookahead`, or
    None: one block at a time) and its early stop (LLaDA2.0's, or the lookahead's: d3LLM's).
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
        self.depth = 1 if lookahead is None else lookahead.depth
        self.edits = editing is not None
        self.later_blocks_final = editing is None or editing.max_post_steps == 0
        if editing is not None:  # editing may still rewrite an early stop: `llada2.stop_at_first_stop`
            self.early_stop = None
        elif lookahead is not None and lookahead.early_stop is not None:
            self.early_stop = lookahead.early_stop
        else:
            self.early_stop = stop_at_first_stop
        self._rule: SelectionRule | None = None

    @classmethod
    def from_config(cls, config, model=None, cache=None) -> UnmaskingStrategy:
        """With `model`, its family's rules: its own proposal, which of d3LLM's codes its multi-block
        decoding follows, the token its reference closes the answer with, and the block start of
        Dream's cached loops and of every Fast-dLLM v2 loop (the block's first position revealed by
        the block-start step); `sub_block_length` reveals blocks sub-block by sub-block."""
        family = None if model is None else getattr(model, "family", None)
        rules = None if family is None else family.rules
        rule = SELECTION_RULES[config_names.selection_rule_name(config)]
        proposal = proposal_for(config, rule, None if rules is None else rules.proposal)
        strategy = cls(
            proposal,
            lambda: rule.from_config(config),
            proposal.draws_randomness() or rule.draws_randomness(config),
            Editing.from_config(config),
            config.confidence_temperature,
            lookahead_for(config, "llada" if rules is None else rules.d3llm_code),
        )
        if rules is None:
            return strategy
        strategy.closing_tokens = closing_tokens(model)
        if config.sub_block_length is not None:
            strategy = strategy.in_sub_blocks(config.sub_block_length)
        # Dream's rule belongs to its cached loops; a block-causal family's (Fast-dLLM v2's) to every loop
        if rules.block_start_reveals_first and (
            model.args.block_size or (cache is not None and cache.refreshes_at_block_start)
        ):
            strategy = strategy.revealing_first_at_block_start()
        return strategy

    def propose(self, logits: torch.Tensor, generators, draws, clock=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, confidence), each (B, T), for logits (B, T, V). `draws[i]` names the generator
        of batch row i, or is None for a row with nothing to reveal (it draws nothing)."""
        logits = logits if self.proposal.model_dtype else logits.float()
        tokens, conf = self.proposal(logits, generators, draws, clock)
        if self.confidence_temperature != 1.0:  # greedy (checked by the config): no randomness drawn twice
            _, conf = self.proposal(logits / self.confidence_temperature, generators, draws, clock)
        return tokens, conf

    def decide(self, logits: torch.Tensor, view: DecodeView) -> Decision:
        """One step's decision for every row: `logits` (B, W, V) of the current block and, with
        multi-block decoding, of the blocks after it (`view.later`); `view.editable` the revealed
        positions an editing rule may rewrite; `view.constraints` the rows whose answers follow a
        grammar. Every row takes part."""
        rule, block, clock, generators, mask_id = self.rule, view.block, view.clock, view.generators, view.mask_id
        later, editable, constraints = view.later, view.editable, view.constraints
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
                block, decision, editable, clock, view.carry, mask_id
            )
        decision.fill = self._early_stop(decision, view)
        return decision

    def _early_stop(self, decision: Decision, view: DecodeView) -> torch.Tensor | None:
        """The positions this step's early stop fills with EOS, for the rows whose config asks for
        it (`eos_early_stop`); None where none does."""
        if self.early_stop is None or view.configs is None or not any(c.eos_early_stop for c in view.configs):
            return None
        before = view.block if view.later is None else torch.cat([view.block, view.later], 1)
        window, steps = decision.applied(
            before, view.steps_of, torch.zeros_like(before[:, 0]), view.eos_id, view.mask_id
        )
        asking = torch.tensor([c.eos_early_stop for c in view.configs], device=window.device)
        return self.early_stop(window, steps >= 0, view, asking)

    @property
    def rule(self) -> SelectionRule:
        """The selection rule (rules keep no state: one serves every generation)."""
        if self._rule is None:
            self._rule = self.make_rule()
        return self._rule

    def _with_rule(self, make_rule) -> UnmaskingStrategy:
        strategy = copy.copy(self)
        strategy.make_rule, strategy._rule = make_rule, None
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
