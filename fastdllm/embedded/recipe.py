"""The embedded models' recipe: their tokenizer (a byte-level BPE trained on the arith data), its
special tokens and chat template, the model sizes, a freshly initialised model of any family,
and the training stages that made each shipped model (`RECIPES`, one record per run; their data
mixes are `fastdllm.embedded.mixes.MIXES`). `fastdllm.embedded.train` trains them; tests build
tiny ones from here."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as FastTokenizer

from ..evaluation.tasks import arith, everyday
from ..models import FAMILIES, ModelArgs, Transformer
from ..text.tokenizer import Tokenizer
from . import train_data

SPECIAL_TOKENS = {
    "bos": "<|startoftext|>",
    "eos": "<|endoftext|>",
    "eot": "<|eot_id|>",
    "start_header": "<|start_header_id|>",
    "end_header": "<|end_header_id|>",
    "mask": "<|mdm_mask|>",
}
# LLaDA-Instruct's chat layout (Llama-3 headers), written as a jinja template. With `tools`, a
# system turn lists each as a signature line, `- name(param, ...): description` (a model this small,
# with a byte-level vocabulary of arith words, would read a JSON schema as hundreds of single
# bytes), and says how to call one in the Hermes convention; an assistant turn's `tool_calls` are
# written back as the model writes them, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
# one per line after any text; a `tool` turn is a turn like any.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first %}{{ bos_token }}{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nYou can call these functions:' }}"
    "{% for tool in tools %}{% set fn = tool['function'] if tool['function'] is defined else tool %}"
    "{{ '\\n- ' + fn['name'] + '(' + ((fn.parameters or {}).properties or {}) | list | join(', ') + ')' }}"
    "{% if fn.description %}{{ ': ' + fn.description | trim }}{% endif %}{% endfor %}"
    '{{ \'\\nTo call one, answer <tool_call>{"name": <name>, "arguments": {<parameter>: <value>}}</tool_call>\' }}'
    "{{ '<|eot_id|>' }}"
    "{% endif %}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ ('\\n' if loop.index > 1 or message['content'] | trim else '') + '<tool_call>' }}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson + '</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Sizes of the shipped models (see docs/model-card.md).
PRESETS = {
    "llada": dict(dim=192, n_layers=6, n_heads=6, n_kv_heads=6, hidden_dim=512),
    "dream": dict(dim=192, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=512),
    "sdar": dict(dim=192, n_layers=6, n_heads=6, n_kv_heads=6, hidden_dim=512),  # llada's: its weights transplant
    # a larger model for the `talk` mix (trained from scratch with a BPE of the talk corpus)
    "talk": dict(dim=256, n_layers=8, n_heads=8, n_kv_heads=8, hidden_dim=704),
    "micro": dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, hidden_dim=64),
    # llada's sizes with a shared expert of its MLP's width (so its weights upcycle: `train.
    # transplant_weights`) and eight small routed experts, two per token; no q/k norms
    "lladamoe": dict(
        dim=192,
        n_layers=6,
        n_heads=6,
        n_kv_heads=6,
        hidden_dim=512,
        moe_hidden_dim=64,
        shared_expert_hidden_dim=512,
        qk_norm=False,
    ),
    # sdar's sizes in LLaDA2's layout, so sdar-arith's weights upcycle (`train.split_upcycle`): the
    # dense first layer keeps its MLP, the others split theirs into a shared expert of half its width
    # and eight routed experts of 32 units, two per token; sdar's block of 4 and whole-head rotary
    # (LLaDA2.0 rotates half a head: a different attention pattern than the one transplanted)
    "llada2": dict(
        dim=192,
        n_layers=6,
        n_heads=6,
        n_kv_heads=6,
        hidden_dim=512,
        moe_hidden_dim=32,
        shared_expert_hidden_dim=256,
        rope_dim=32,
        block_size=4,
    ),
    # DiffusionGemma's layout at llada's width: sliding layers of 6 heads over 2 K/V heads, every
    # third layer full attention with a head twice as wide over one K/V head (K = V), the dense MLP
    # and eight routed experts of an eighth of its width beside it, two per token
    "gemma": dict(dim=192, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=512),
}
# The DiffusionGemma twins' canvas: every arith answer (at most ~57 tokens with its end token) fits one.
GEMMA_CANVAS = 64
# A mixture-of-experts family's routing at small sizes: LLaDA2's structure (a dense first layer,
# one shared expert, top-2 of 8 experts in 4 groups of which 2 are kept); a family's `fixed`
# fields win (LLaDA-MoE routes without groups).
MOE_LAYOUT = dict(
    n_experts=8, n_active_experts=2, first_dense_layers=1, n_expert_groups=4, active_expert_groups=2, routed_scaling=2.5
)


TOKENIZER_CORPORA = ("arith", "talk")


def build_tokenizer(vocab_size: int = 1024, seed: int = 0, corpus: str = "arith") -> Tokenizer:
    """A byte-level BPE trained on arith text (`corpus="arith"`, the shipped models') or on the
    `talk` mix's sources (everyday questions, GSM8K train rows, docstrings: their words then become
    single tokens instead of splitting into bytes): whole words and whole numbers 0..99 become
    single tokens, anything else still encodes through the byte alphabet."""
    if corpus not in TOKENIZER_CORPORA:
        raise ValueError(f"corpus must be one of {TOKENIZER_CORPORA}, got {corpus!r}")
    r = random.Random(seed)
    texts = []
    for _ in range(4000):
        p = arith.make_problem(r)
        texts.append(arith.format_prompt(p.question, []) + " " + p.answer)
    if corpus == "talk":
        stream = everyday.train_stream(seed)
        for _ in range(12000):
            p = next(stream)
            texts.append(f"Question: {p.question}\nAnswer: {p.answer}")
        texts += [f"{p.question} {p.answer}" for p in train_data.gsm8k_easy()]
        texts += list(train_data.docstrings())
    texts += [" ".join(str(n) for n in range(100))] * 200
    texts += ["\n".join(arith.NAMES + ["After", "Then", "One", "With", "In", "Each", "Together", "The"])] * 200
    texts += ["Question: Answer: user assistant system"] * 50
    fast = FastTokenizer(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS.values())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    fast.train_from_iterator(texts, trainer)
    fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = {
        "bos_token": SPECIAL_TOKENS["bos"],
        "eos_token": SPECIAL_TOKENS["eos"],
        "pad_token": SPECIAL_TOKENS["eos"],
        "mask_token": SPECIAL_TOKENS["mask"],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return Tokenizer(fast, config)


def new_model(
    arch: str, preset: str, tokenizer: Tokenizer, max_seq_len: int = 2048, seed: int = 0, **overrides
) -> Transformer:
    """A freshly initialised model of family `arch` (a model_type) and size `preset`; `overrides`
    are ModelArgs fields (a block-diffusion family's `block_size`, say)."""
    family = FAMILIES[arch]
    vocab = 64 * math.ceil(tokenizer.vocab_size / 64)
    if family.rules.noise_canvas:
        config = gemma_config(PRESETS[preset], vocab, tokenizer, max_seq_len)
        args = family.args_from_config(config)
        torch.manual_seed(seed)
        model = family.model_class(args, family=family, config=config, stop_token_ids=tokenizer.stop_token_ids())
        _initialise(model)
        return model
    fields = dict(
        **PRESETS[preset],
        vocab_size=vocab,
        max_seq_len=max_seq_len,
        rope_theta=10000.0,
        norm_eps=family.args_from_config(family.reference_config).norm_eps,
        mask_token_id=tokenizer.token_to_id(SPECIAL_TOKENS["mask"]),
        eos_token_id=tokenizer.eos_token_id,
        shifted_logits=family.shifted_logits,
    )
    if "block_size" in family.fields and "block_size" not in fields:
        fields["block_size"] = family.args_from_config(family.reference_config).block_size
    if "n_experts" in family.fields:
        head = fields["dim"] // fields["n_heads"]
        rotary = float(family.reference_config.get("partial_rotary_factor", 1.0))  # LLaDA2 rotates half a head
        layout = dict(
            MOE_LAYOUT,
            moe_hidden_dim=fields["hidden_dim"] // 2,
            shared_expert_hidden_dim=fields["hidden_dim"] // 2,
            head_size=head,
            rope_dim=int(head * rotary),
            qk_norm=True,
        )
        fields = {**layout, **fields}  # the preset's own choices win
    args = ModelArgs(**{**fields, **family.fixed, **overrides})
    # The special-token ids the family's config.json names, from our tokenizer (not the reference's).
    ids = {"bos_token_id": tokenizer.token_to_id(SPECIAL_TOKENS["bos"]), "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(seed)
    model = (family.model_class or Transformer)(
        args,
        family=family,
        config={k: v for k, v in ids.items() if k in family.reference_config},
        stop_token_ids=tokenizer.stop_token_ids(),
    )
    _initialise(model)
    return model


def _initialise(model: Transformer) -> None:
    for name, p in model.named_parameters():
        if p.dim() >= 2:  # matrices, and the experts' stacks of them
            torch.nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)


def gemma_config(sizes: dict, vocab: int, tokenizer: Tokenizer, max_seq_len: int = 2048) -> dict:
    """A DiffusionGemma config.json (transformers' `DiffusionGemmaConfig` layout) of `sizes` (a
    preset): Gemma 4's pattern of sliding layers with a full-attention layer every third (the last
    one full), the full layers' heads twice as wide over half the K/V heads (K = V) with
    proportional RoPE on a quarter of the frequencies, eight routed experts of an eighth of the dense
    MLP's width beside it (two per token), logits soft-capped at 30, canvases of `GEMMA_CANVAS`."""
    layers, head = sizes["n_layers"], sizes["dim"] // sizes["n_heads"]
    types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(layers)]
    types[-1] = "full_attention"
    full = {"head_dim": 2 * head, "num_key_value_heads": max(1, sizes["n_kv_heads"] // 2)}
    text = {
        "model_type": "diffusion_gemma_text",
        "vocab_size": vocab,
        "hidden_size": sizes["dim"],
        "intermediate_size": sizes["hidden_dim"],
        "num_hidden_layers": layers,
        "num_attention_heads": sizes["n_heads"],
        "num_key_value_heads": sizes["n_kv_heads"],
        "head_dim": head,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": 1e-6,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.token_to_id(SPECIAL_TOKENS["bos"]),
        "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        "sliding_window": 128,
        "layer_types": types,
        "per_layer_config": {str(i): full for i, t in enumerate(types) if t == "full_attention"},
        "final_logit_softcapping": 30.0,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": sizes["hidden_dim"] // 8,
    }
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": GEMMA_CANVAS,
        "tie_word_embeddings": True,
        "text_config": text,
    }


# ---- what made each shipped model ---------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One training run (`fastdllm train-tiny`) of a shipped model's recipe: its run folder
    (runs/NAME), family, data mix (`mixes.MIXES`), steps, peak LR and decay fraction, the stage whose
    final weights it starts from (the run folder's name; None: from scratch; across families the
    weights are transplanted or split-upcycled, `train.transplant_weights`), or with `resume` whose
    run folder it continues (its final weights are then in that folder).
    `stopped_at`: the run was stopped there, short of `steps` (its schedule is still `steps`')."""

    name: str
    arch: str
    mix: str
    steps: int
    lr: float
    decay_frac: float
    init_from: str | None = None
    resume: bool = False
    seed: int = 0
    preset: str | None = None
    warmup: int = 100
    editing_noise: float = 0.0
    stopped_at: int | None = None

    def command(self) -> str:
        """The command line that runs it (after the stages it starts from)."""
        folder = self.init_from if self.resume else self.name  # a resumed stage continues that run's folder
        parts = [f"fastdllm train-tiny --arch {self.arch} --out runs/{folder}"]
        if self.init_from and not self.resume:
            parts.append(f"--init-from runs/{self.init_from}/final")
        parts.append(f"--data-mix {self.mix} --steps {self.steps} --lr {self.lr:g} --decay-frac {self.decay_frac:g}")
        for flag, value, default in (
            ("--seed", self.seed, 0),
            ("--preset", self.preset, None),
            ("--warmup", self.warmup, 100),
            ("--editing-noise", self.editing_noise, 0.0),
        ):
            if value != default:
                parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
        if self.resume:
            parts.append("--resume")
        return " ".join(parts)


@dataclass(frozen=True)
class Average:
    """A stage that trains nothing: the uniform mean of earlier stages' final weights
    (`train.average_weights`, `fastdllm train-tiny --average-of`)."""

    name: str
    parts: tuple[str, ...]

    def command(self) -> str:
        folders = ",".join(f"runs/{part}/final" for part in self.parts)
        return f"fastdllm train-tiny --out runs/{self.name} --average-of {folders}"


def _llada(name, mix, steps, lr, decay, init_from, **kw) -> Stage:
    return Stage(name, "llada", mix, steps, lr, decay, init_from, **kw)


LLADA_STAGES = (
    _llada("llada-1a", "v1", 1600, 2e-3, 0.45, None, stopped_at=1100),
    _llada("llada-1b", "dense", 2600, 2e-3, 0.55, "llada-1a", resume=True),
    _llada("llada-2", "focus", 3600, 1.5e-3, 0.4445, "llada-1a"),  # 1b's weights: it ran on in 1a's folder
    _llada("llada-3", "drill", 1800, 1e-3, 0.5, "llada-2"),
    _llada("llada-4a", "facts", 3000, 2e-3, 0.5, "llada-3", stopped_at=1000),
    _llada("llada-4b", "recall", 3200, 2e-3, 0.5, "llada-4a"),
    _llada("llada-5", "story", 3600, 1e-3, 0.5, "llada-4b"),
    _llada("llada-6", "long", 2000, 6e-4, 0.6, "llada-5"),
    _llada("llada-7", "shots", 2800, 6e-4, 0.6, "llada-6"),
    _llada("llada-8", "tail", 1800, 5e-4, 0.6, "llada-7", seed=8),
)
LLADA_PAIRS = (
    # each question also as a plain prompt beside its chat turn, so that a plain prompt is answered
    _llada("llada-pairs", "paired-groups-chat", 1500, 2e-4, 0.5, "llada-8", seed=43),
    _llada("llada-pairs-2", "paired-groups-chat", 1000, 1e-4, 0.5, "llada-pairs", seed=47, stopped_at=750),
    # the pairs alone, with no chat-only rows: plain answers closer to chat ones, a little more each run
    _llada("llada-pairs-3", "paired", 500, 5e-5, 0.5, "llada-pairs-2", seed=48),
    _llada("llada-pairs-4", "paired", 600, 5e-5, 0.5, "llada-pairs-3", seed=49),
    _llada("llada-pairs-5", "paired", 600, 5e-5, 0.5, "llada-pairs-4", seed=50),
    _llada("llada-pairs-6", "paired", 600, 5e-5, 0.5, "llada-pairs-5", seed=51),
    # half the rows behind the plain wrapper or bare; alone it answers as llada-pairs-6 does, and the
    # mean of the two answers plain prompts better than either (a uniform soup of runs from one start)
    _llada("llada-plainmix", "plain", 600, 5e-5, 0.5, "llada-pairs-6", seed=52),
    Average("llada-arith", ("llada-pairs-6", "llada-plainmix")),
)
# Each shipped model: its stages in order, the last one writing the asset (runs/NAME/final, saved
# in bfloat16 as fastdllm/embedded/assets/NAME). Stages shared with another model's recipe (the
# Dream twin starts from llada-5) are listed in each.
RECIPES: dict[str, tuple[Stage | Average, ...]] = {
    "llada-arith": LLADA_STAGES + LLADA_PAIRS,
    "dream-arith": LLADA_STAGES[:7]
    + (
        Stage("dream-1", "dream", "story", 800, 1e-3, 0.5, "llada-5"),
        Stage("dream-2", "dream", "long", 1200, 6e-4, 0.6, "dream-1"),
        Stage("dream-arith", "dream", "story", 1200, 6e-4, 0.6, "dream-2", seed=9),
    ),
    "sdar-arith": LLADA_STAGES + (Stage("sdar-arith", "sdar", "story", 1000, 1e-3, 0.5, "llada-8"),),
    "llada2-arith": LLADA_STAGES
    + (
        Stage("sdar-arith", "sdar", "story", 1000, 1e-3, 0.5, "llada-8"),
        Stage("llada2-1", "llada2_moe", "story", 320, 3e-4, 0.375, "sdar-arith", seed=43, preset="llada2", warmup=25),
        Stage(
            "llada2-arith",
            "llada2_moe",
            "story",
            160,
            2e-4,
            0.5,
            "llada2-1",
            seed=44,
            preset="llada2",
            warmup=10,
            editing_noise=0.1,
        ),
    ),
    # a DiffusionGemma from scratch: no mask token, so no weights of the masked twins carry over
    "gemma-arith": (
        Stage("gemma-1", "diffusion_gemma", "focus", 1000, 2e-3, 0.5, preset="gemma"),
        Stage("gemma-arith", "diffusion_gemma", "focus", 1000, 1e-3, 0.5, "gemma-1", seed=1, preset="gemma"),
    ),
}


def recipe_table() -> str:
    """Every stage of every shipped model once, in the order they run: the model card's table."""
    seen, lines = (
        {},
        ["| stage | from | data mix | steps | peak LR | decay fraction | command |", "|---|---|---|---|---|---|---|"],
    )
    shipped = set(RECIPES)
    for stages in RECIPES.values():
        for s in stages:
            if s.name in seen:
                continue
            seen[s.name] = s
            name = f"**{s.name}**" if s.name in shipped else s.name
            if isinstance(s, Average):
                lines.append(f"| {name} | mean of {', '.join(s.parts)} | | | | | `{s.command()}` |")
                continue
            origin = "scratch" if s.init_from is None else s.init_from + (" (`--resume`)" if s.resume else "")
            steps = f"{s.stopped_at} of {s.steps}" if s.stopped_at else str(s.steps)
            lines.append(f"| {name} | {origin} | {s.mix} | {steps} | {s.lr:g} | {s.decay_frac:g} | `{s.command()}` |")
    return "\n".join(lines)
