"""DiffusionGemma against transformers' own `DiffusionGemmaForBlockDiffusion` (a test dependency):
tiny checkpoints its class makes and saves (seeded random init, small dims, a few experts, sliding
and full layers, every norm, scale and scalar moved off its init), loaded by `fastdllm.load`.
Logits of the encoder's causal pass, of the decoder's pass over a canvas with and without the
self-conditioning signal, and of a later canvas after a committed one, with prompts longer than
the sliding window."""

from __future__ import annotations

import json

import pytest
import torch

import fastdllm

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("transformers without DiffusionGemma (the test extra asks for 5.25)", allow_module_level=True)

CANVAS = 8


def make_reference(tokenizer, folder, seed: int = 0, window: int = 6, images: bool = False, bidirectional=None):
    """A tiny DiffusionGemma made by transformers' class, saved with our tokenizer beside it. With
    `images`: its image tokens are the tokenizer's "<|image|>", "<|image>" and "<image|>" (Gemma 4's
    image, begin- and end-of-image tokens), its vision tower's weights moved off their init too,
    and images attend as `bidirectional` says (the text config's `use_bidirectional_attention`:
    None or "vision")."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    vocab = 64 * -(-tokenizer.vocab_size // 64)
    text = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.token_to_id("<|begin_of_text|>") or 0,
        final_logit_softcapping=30.0,
        use_bidirectional_attention=bidirectional,
    )
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
    )
    ids = {}
    if images:
        tokens = {"image_token_id": "<|image|>", "boi_token_id": "<|image>", "eoi_token_id": "<image|>"}
        ids = {name: tokenizer.token_to_id(token) for name, token in tokens.items()}
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS, **ids)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name and not images:
                continue
            if name.endswith("position_embedding_table"):
                p.copy_(torch.randn_like(p))
            elif p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
            else:
                p.mul_(6.0)  # sharper distributions: a stricter check
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1 + torch.rand_like(b) * 0.5)
    model.save_pretrained(folder)
    tokenizer.save(folder)
    return model


def reference_logits(model, prompt, canvases, sc_logits=None):
    """transformers' logits of the last canvas: the prompt encoded, each earlier canvas committed
    by the encoder, the last one denoised by the decoder."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        model.model.encoder(input_ids=torch.tensor([prompt]), cache=cache)
        for earlier in canvases[:-1]:
            model.model.encoder(input_ids=torch.tensor([earlier]), cache=cache)
        out = model(
            decoder_input_ids=torch.tensor([canvases[-1]]),
            cache=cache,
            self_conditioning_logits=None if sc_logits is None else sc_logits[None],
        )
    return out.logits[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("diffusion_gemma")
    reference = make_reference(tokenizer, folder)
    model, _ = fastdllm.load(str(folder), dtype="float32")
    return reference, model, folder


def test_the_encoders_causal_pass_gives_transformers_logits(checkpoint, tokenizer):
    reference, model, _ = checkpoint
    ids = tokenizer.encode("Question: Tom has 5 apples and buys 3 more. How many?")
    assert len(ids) > 2 * reference.config.text_config.sliding_window
    with torch.no_grad():
        hidden = reference.model.encoder(input_ids=torch.tensor([ids])).last_hidden_state
        theirs = reference.lm_head(hidden).float()
    cap = reference.config.text_config.final_logit_softcapping
    theirs = torch.tanh(theirs / cap) * cap
    ours = model(torch.tensor([ids]))
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


@pytest.mark.parametrize("signal", [False, True], ids=["first-step", "self-conditioned"])
@pytest.mark.parametrize("committed", [0, 1, 2], ids=["first-canvas", "second", "third"])
def test_the_decoders_pass_gives_transformers_logits(checkpoint, tokenizer, signal, committed):
    reference, model, _ = checkpoint
    g = torch.Generator().manual_seed(committed)
    vocab = model.args.vocab_size
    prompt = tokenizer.encode("Question: what is 12 + 30? Answer")
    canvases = [torch.randint(0, vocab, (CANVAS,), generator=g).tolist() for _ in range(committed + 1)]
    sc = torch.randn(CANVAS, vocab, generator=g) * 3 if signal else None
    theirs = reference_logits(reference, prompt, canvases, sc)
    x = torch.tensor([prompt + sum(canvases, [])])
    start, end = x.shape[1] - CANVAS, x.shape[1]
    embeds = None
    if signal:
        embeds = {0: (torch.arange(start, end), model.soft_input(sc))}
    with torch.no_grad():
        (ours,) = model.packed_logits(x, [(0, 0, end, end, start)], None, embeds=embeds)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


def test_rows_packed_together_give_each_rows_logits(checkpoint, tokenizer):
    _, model, _ = checkpoint
    a = tokenizer.encode("Question: 1 + 2?") + list(range(10, 10 + CANVAS))
    b = tokenizer.encode("Question: what is 40 + 2? Answer:") + list(range(20, 20 + CANVAS))
    width = max(len(a), len(b))
    x = torch.tensor([a + [0] * (width - len(a)), b + [0] * (width - len(b))])
    with torch.no_grad():
        both = model.packed_logits(
            x, [(0, 0, len(a), len(a), len(a) - CANVAS), (1, 0, len(b), len(b), len(b) - CANVAS)], None
        )
        alone = model.packed_logits(x[1:], [(0, 0, len(b), len(b), len(b) - CANVAS)], None)
    assert torch.allclose(both[1], alone[0], atol=1e-5)


def test_batch_invariant_rows_give_their_logits_alone_to_the_bit(checkpoint, tokenizer):
    """With `deterministic` (packed_logits' batch_invariant: its linear layers and experts in fixed
    tiles) a bfloat16 row's logits packed beside others are its logits alone, bit for bit. (On
    this CPU these rows are also invariant without it: the flag's path is what this checks.)"""
    import copy

    model = copy.deepcopy(checkpoint[1]).to(torch.bfloat16)
    texts = ["Question: 1 + 2?", "Question: what is 40 + 2? Answer:", "Tom has 5 apples and buys 3 more. He has"]
    rows = [tokenizer.encode(t) + list(range(10 + k, 10 + k + CANVAS)) for k, t in enumerate(texts)]
    width = max(map(len, rows))
    x = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    windows = [(i, 0, len(r), len(r), len(r) - CANVAS) for i, r in enumerate(rows)]
    with torch.no_grad():
        packed = model.packed_logits(x, windows, None, batch_invariant=True)
        for i in range(len(rows)):
            (alone,) = model.packed_logits(x[i : i + 1], [(0, *windows[i][1:])], None, batch_invariant=True)
            assert torch.equal(packed[i], alone), i


# settings of transformers' generate: its defaults (adaptive stopping on), stopping off, a colder
# schedule from 0 with a looser bound, and an early stop that fires
GENERATE = [
    dict(max_denoising_steps=48),
    dict(max_denoising_steps=16, confidence_threshold=None),
    dict(max_denoising_steps=12, t_min=0.0, t_max=1.0, entropy_bound=0.5),
    dict(max_denoising_steps=24, stability_threshold=0, confidence_threshold=7.0),
    dict(max_denoising_steps=24, t_min=0.01, t_max=0.05, stability_threshold=1, confidence_threshold=7.0),
]


def theirs_of(settings: dict) -> dict:
    """Our settings as its generate takes them: the bound inside its sampler's config."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    out = dict(settings)
    if "entropy_bound" in out:
        out["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=out.pop("entropy_bound"))
    return out


def in_float64(reference, folder):
    """Both models of a checkpoint in float64, where their arithmetic is the same to the last bit
    (the logits, rounded to float32 by both heads, are equal), so that nothing but the decoding can
    differ."""
    reference = type(reference).from_pretrained(folder, dtype=torch.float64, experts_implementation="eager").eval()
    model, _ = fastdllm.load(str(folder), dtype="float32")
    model = model.to(torch.float64)
    model.setup_rope()
    return reference, model


@pytest.fixture(scope="module")
def float64_pair(checkpoint):
    reference, _, folder = checkpoint
    return in_float64(reference, folder)


def test_float64_makes_the_logits_equal_to_the_last_bit(float64_pair, tokenizer):
    reference, model = float64_pair
    prompt, canvas = tokenizer.encode("Question: 2 + 3?"), list(range(100, 100 + CANVAS))
    theirs = reference_logits(reference, prompt, [canvas])
    x = torch.tensor([prompt + canvas])
    with torch.no_grad():
        (ours,) = model.packed_logits(x, [(0, 0, x.shape[1], x.shape[1], len(prompt))], None)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("part", [pytest.param("sample", id="sample"), pytest.param("all", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "settings", GENERATE, ids=["defaults", "no-stopping", "cold-loose", "confident-stop", "stable-stop"]
)
def test_generate_gives_transformers_tokens_and_forwards(float64_pair, tokenizer, settings, part):
    """Three canvases each: the same tokens and decoder forwards as
    `DiffusionGemmaForBlockDiffusion.generate` under the same torch seed (a row draws its canvas,
    samples and renoising tokens from its own generator in the reference's order). The default
    suite runs one prompt and seed per setting, the slow set three prompts and two seeds."""
    reference, model = float64_pair
    eos = tokenizer.eos_token_id
    stops, model.stop_token_ids = model.stop_token_ids, [eos]
    texts = ["Question: 2 + 3?", "Question: what is 12 + 30? Answer:", "Tom has 5 apples. He buys 3 more."]
    runs = [(t, seed) for t in texts for seed in (0, 1)] if part == "all" else [(texts[0], 0)]
    early = 0
    try:
        for text, seed in runs:
            ids = tokenizer.encode(text)
            config = fastdllm.GenerationConfig.for_model(model, gen_length=3 * CANVAS, seed=seed, **settings)
            ours = fastdllm.generate(model, [ids], config=config)
            torch.manual_seed(seed)
            theirs = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=3 * CANVAS,
                eos_token_id=eos,
                pad_token_id=eos,
                **theirs_of(settings),
            )
            answer = theirs.sequences[0, len(ids) :].tolist()
            assert ours.sequences[0].tolist()[: len(answer)] == answer, (text, seed)
            canvases = -(-len(answer) // CANVAS)
            forwards = round(len(answer) / float(theirs.tokens_per_forward[0])) if eos not in answer else None
            if forwards is not None:
                assert ours.nfe == forwards, (text, seed, ours.nfe, forwards)
            early += ours.nfe < canvases * settings["max_denoising_steps"]
    finally:
        model.stop_token_ids = stops
    if (settings.get("confidence_threshold") or 0) > 1:  # a bound above any entropy here: it stops
        assert early > 0  # the adaptive stop fired


@pytest.mark.parametrize(
    "cache", [dict(cache="none"), dict(cache="prefix"), dict(cache="dual", refresh="full"), dict(cache="dual")]
)
def test_every_cache_it_takes_gives_transformers_tokens(float64_pair, tokenizer, cache):
    """Uncached (every forward the whole sequence), the prefix cache, the dual cache with either
    refresh: the prompt and each finished canvas cached as the encoder computes them, so the same
    tokens and forwards as transformers, whose decoder reads its encoder's cache."""
    reference, model = float64_pair
    ids = tokenizer.encode("Question: what is 12 + 30? Answer:")
    settings = dict(max_denoising_steps=12)
    config = fastdllm.GenerationConfig.for_model(model, gen_length=3 * CANVAS, seed=3, stop_at_eos=False, **settings)
    ours = fastdllm.generate(model, [ids], config=config.replace(**cache))
    torch.manual_seed(3)
    theirs = reference.generate(torch.tensor([ids]), max_new_tokens=3 * CANVAS, **settings)
    assert ours.sequences[0].tolist() == theirs.sequences[0, len(ids) :].tolist()
    assert ours.nfe == round(3 * CANVAS / float(theirs.tokens_per_forward[0]))


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(max_denoising_steps=12), marks=pytest.mark.slow),
        dict(max_denoising_steps=24, t_min=0.01, t_max=0.05, confidence_threshold=7.0),
    ],
    ids=["every-step", "stops-apart"],
)
def test_rows_of_a_batch_decode_as_alone(float64_pair, tokenizer, settings):
    """Prompts of different lengths in one batch, their canvases ending at different steps where the
    adaptive stop fires: each row its own clock, its own random stream and its own self-conditioning,
    so each gives the tokens and forwards it gives alone (and so, by the tests above, transformers'
    for a batch of one; transformers draws a batch's rows from one stream)."""
    _, model = float64_pair
    texts = ("Question: 2 + 3?", "Tom has 5 apples. He buys 3 more. How many?", "Question: what is 12 + 30?")
    prompts = [tokenizer.encode(t) for t in texts]
    config = fastdllm.GenerationConfig.for_model(model, gen_length=3 * CANVAS, stop_at_eos=False, **settings)
    seeds = [5, 6, 7]
    batch = fastdllm.generate(model, prompts, config=config, row_seeds=seeds)
    forwards = []
    for i, (p, seed) in enumerate(zip(prompts, seeds)):
        alone = fastdllm.generate(model, [p], config=config.replace(seed=seed))
        assert batch.sequences[i].tolist() == alone.sequences[0].tolist()
        assert batch.nfe_per_row[i] == alone.nfe
        forwards.append(alone.nfe)
    if "confidence_threshold" in settings:
        assert len(set(forwards)) > 1  # the rows' clocks parted


@pytest.mark.parametrize(
    "cache",
    [
        dict(cache="dual"),
        dict(cache="none"),
        pytest.param(dict(cache="prefix"), marks=pytest.mark.slow),
        pytest.param(dict(cache="dual", refresh="full"), marks=pytest.mark.slow),
    ],
    ids=["dual", "none", "prefix", "dual-full"],
)
def test_the_fixed_shape_step_decodes_as_the_eager_one(float64_pair, tokenizer, cache, monkeypatch):
    """`cuda_graphs`, its fixed-shape step run eagerly: rows of different lengths, whose clocks
    part (the adaptive stop), decode as without it, every step after the rows' first through it
    (windows padded to one width, rows to a bucket, keys to whole buckets)."""
    from fastdllm.engine.kv.runner import KVRunner

    from .conftest import run_eagerly

    _, model = float64_pair
    calls = run_eagerly(monkeypatch)
    texts = ("Question: 2 + 3?", "Tom has 5 apples. He buys 3 more. How many?", "Question: what is 12 + 30?")
    prompts = [tokenizer.encode(t) for t in texts]
    settings = dict(max_denoising_steps=24, t_min=0.01, t_max=0.05, confidence_threshold=7.0)
    config = fastdllm.GenerationConfig.for_model(model, gen_length=3 * CANVAS, stop_at_eos=False, **settings, **cache)
    runner = KVRunner(model).record()
    eager = fastdllm.generate(model, prompts, config=config, row_seeds=[5, 6, 7], kv=runner)
    graphed = fastdllm.generate(model, prompts, config=config.replace(cuda_graphs=True), row_seeds=[5, 6, 7])
    assert graphed.sequences.tolist() == eager.sequences.tolist()
    assert graphed.nfe_per_row == eager.nfe_per_row
    assert len(set(eager.nfe_per_row)) > 1  # the rows' clocks parted
    # every step of windows of one width at least (one far wider than the others' may stay eager)
    alike = [w for w in runner.history[1:] if len({hi - lo for _, lo, hi, _, _ in w}) == 1]
    assert len(calls) >= len(alike) > 0


@pytest.mark.slow
def test_the_compiled_fixed_shape_step_gives_the_eager_logits(checkpoint, tokenizer):
    """The fixed-shape step through torch.compile (the function a GPU captures; its float32
    experts run eagerly between compiled parts): the eager step's logits within float32 rounding,
    and the same K/V written."""
    from fastdllm.engine.cache.base import SequenceView
    from fastdllm.engine.kv.pages import PagedKVCache
    from fastdllm.engine.kv.runner import FixedForm

    _, model, _ = checkpoint
    ids = [tokenizer.encode("Question: 3 + 4 = ?"), tokenizer.encode("Tom has 5 apples and buys 3 more.")]
    ends = [len(p) + CANVAS for p in ids]
    x = torch.tensor([p + [5] * (max(ends) - len(p)) for p in ids])
    seq = SequenceView(x, tuple(map(len, ids)), tuple(ends), (0, 0), (CANVAS, CANVAS), (CANVAS, CANVAS))
    windows = [(i, len(p), end, end, len(p)) for i, (p, end) in enumerate(zip(ids, ends))]
    form = FixedForm.of(model, seq, windows)
    outs = []
    for step in (model.window_logits_static, model.graphed_window_logits()):
        cache = PagedKVCache.for_rows(model, 2, x.shape[1])
        cache.k.normal_(generator=torch.Generator().manual_seed(0))  # the prompts' K/V, alike in both
        cache.v.normal_(generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            outs.append((step(*form.inputs(x, cache, None)), cache.k.clone()))
    (eager, k_eager), (compiled, k_compiled) = outs
    assert eager.shape == compiled.shape and (eager - compiled).abs().max() < 1e-4
    torch.testing.assert_close(k_compiled, k_eager)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(cache="delayed"), "cache"),
        (dict(refresh="adaptive"), "refresh"),
        (dict(block_length=2 * CANVAS, gen_length=2 * CANVAS), "block_length"),
        (dict(fixed=((0, (5,)),)), "fixed"),
        (dict(suffix=(5, 6)), "suffix"),
        (dict(unmasking="threshold", threshold=0.9), "unmasking"),
    ],
)
def test_what_the_canvas_cannot_do_is_refused_by_name(checkpoint, tokenizer, change, field):
    _, model, _ = checkpoint
    config = fastdllm.GenerationConfig.for_model(model, gen_length=CANVAS).replace(**change)
    with pytest.raises(ValueError, match=f"^{field}:"):
        fastdllm.generate(model, [tokenizer.encode("hi")], config=config)


@pytest.mark.slow
def test_compiled_layers_give_the_eager_logits(checkpoint, tokenizer):
    """compile=True runs each layer's dense math through torch.compile (dynamic shapes): the eager
    logits within float32 rounding, for packed rows of two widths (this random checkpoint's
    canvases are near-uniform draws, so its tokens are compared on a trained model: the slow set)."""
    _, model, _ = checkpoint
    ids = [tokenizer.encode("Question: 3 + 4 = ?"), tokenizer.encode("Tom has 5 apples and buys 3 more.")]
    width = max(map(len, ids)) + CANVAS
    x = torch.tensor([p + [5] * (width - len(p)) for p in ids])
    windows = [(i, 0, len(p) + CANVAS, len(p) + CANVAS, len(p)) for i, p in enumerate(ids)]
    with torch.inference_mode():
        eager = model.packed_logits(x, windows, None)
        compiled = model.packed_logits(x, windows, None, compiled=True)
    for a, b in zip(eager, compiled):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_layers_decode_gemma_arith_as_eager(tokenizer):
    """The same answers compiled as eager; a canvas's last step may come one forward apart (its
    stop rule compares a mean entropy with 0.005, which float rounding can cross)."""
    model, tok = fastdllm.load("gemma-arith")
    from fastdllm.evaluation.tasks import arith

    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:4]]
    config = fastdllm.GenerationConfig.for_model(model).replace(seed=0)
    eager = fastdllm.generate(model, ids, config=config)
    compiled = fastdllm.generate(model, ids, config=config.replace(compile=True))
    assert torch.equal(compiled.sequences, eager.sequences)
    assert all(abs(a - b) <= 1 for a, b in zip(compiled.nfe_per_row, eager.nfe_per_row))


def test_a_masked_family_refuses_the_renoising_rule(tiny_llada, tokenizer):
    config = fastdllm.GenerationConfig(gen_length=32, unmasking="entropy_bound", threshold=None)
    with pytest.raises(ValueError, match="^unmasking:"):
        fastdllm.generate(tiny_llada, [tokenizer.encode("hi")], config=config)


def test_the_server_decodes_it_and_refuses_what_it_cannot_do(checkpoint, tokenizer):
    """Its published decoding by default; a request naming a cache it cannot take or a suffix is a
    400 naming the field, and the next request is served (with log-probabilities); a multi-turn chat
    (prompts holding its stop tokens) decodes."""
    from tests.test_server import MODEL, LiveServer

    _, model, _ = checkpoint
    config = fastdllm.GenerationConfig.for_model(model, gen_length=CANVAS, max_denoising_steps=4)
    server = LiveServer(model, tokenizer, defaults=config)
    try:
        name = MODEL
        for field, value in (("cache", "delayed"), ("suffix", " The end."), ("preset", "wedlm")):
            r = server.post("/v1/completions", {"model": name, "prompt": "Q", "max_tokens": 4, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = server.post("/v1/completions", {"model": name, "prompt": "Q", "max_tokens": 4, "logprobs": 2})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4, r.text
        chat = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "2 + 2?"},
        ]
        r = server.post("/v1/chat/completions", {"model": name, "messages": chat, "max_tokens": 6})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
    finally:
        server.stop()


def test_the_cli_decodes_it_with_its_published_settings(checkpoint, capsys):
    from fastdllm.cli.main import main as cli

    _, _, folder = checkpoint
    argv = ["generate", "--model", str(folder), "--max-new-tokens", "6", "--max-denoising-steps", "5", "--json", "hi"]
    assert cli(argv) == 0
    captured = capsys.readouterr()
    assert "--preset diffusion_gemma" in captured.err
    result = json.loads(captured.out)
    assert result["config"]["unmasking"] == "entropy_bound" and result["config"]["block_length"] == CANVAS
    assert 1 <= result["nfe"] <= 5 and result["tokens"] <= 6


def test_lm_eval_decodes_it_with_its_published_settings(checkpoint):
    """The lm-eval plugin, given only the checkpoint, decodes as the CLI does: the model's own
    decoding (as for every recognised checkpoint), model_args on top."""
    from fastdllm import lm_eval_plugin
    from tests.test_eval import _FakeLM, _Req

    _, _, folder = checkpoint
    cls = lm_eval_plugin.make_model_class(_FakeLM, lambda name: lambda c: c)
    lm = cls(pretrained=str(folder), dtype="float32", max_denoising_steps=4)
    config = lm.base_config
    assert (config.unmasking, config.block_length, config.max_denoising_steps) == ("entropy_bound", CANVAS, 4)
    out = lm.generate_until([_Req("Question: 2 + 2?\nAnswer:", {"until": ["Question:"], "max_gen_toks": 6})])
    assert len(out) == 1 and isinstance(out[0], str)


def test_it_quantizes_saves_and_refuses_what_it_cannot_split(checkpoint, tmp_path, tokenizer):
    """int8 in memory decodes; a save loads back to the same weights; a split its heads do not
    allow, or expert parallelism, is refused by name (tensor parallelism itself: `tests/test_tp.py`)."""
    from fastdllm.models.loading import load_model, save_pretrained

    _, model, folder = checkpoint
    quantized, _ = fastdllm.load(str(folder), dtype="float32", quantize="int8")
    config = fastdllm.GenerationConfig.for_model(quantized, gen_length=CANVAS, max_denoising_steps=3)
    assert fastdllm.generate(quantized, [tokenizer.encode("hi")], config=config).nfe == 3
    saved = save_pretrained(model, tmp_path / "saved", tokenizer)
    again, _ = fastdllm.load(str(saved), dtype="float32")
    for name, p in model.state_dict().items():
        assert torch.equal(p, again.state_dict()[name]), name
    with pytest.raises(ValueError, match="^tp: 3 does not divide the 4 attention heads"):
        load_model(folder, tp=(0, 3))
    with pytest.raises(ValueError, match="^ep: not yet for DiffusionGemma"):
        load_model(folder, tp=(0, 2), ep=2)


@pytest.mark.parametrize("command", [["bench", "--quick"], ["tune", "--task", "arith", "--out", "x.json"]])
def test_bench_and_tune_say_why_they_do_not_apply(checkpoint, capsys, command):
    from fastdllm.cli.main import main as cli

    _, _, folder = checkpoint
    assert cli([command[0], "--model", str(folder), *command[1:]]) == 2
    assert "has no mask token" in capsys.readouterr().err


def test_logprobs_are_the_final_canvas_tokens_under_its_last_step(checkpoint, tokenizer):
    """Each answer token's log-probability under the logits of the step that ended its canvas: the
    canvas becomes that step's argmax, so each token is the most likely there."""
    _, model, _ = checkpoint
    config = fastdllm.GenerationConfig.for_model(model, gen_length=2 * CANVAS, max_denoising_steps=4, logprobs=2)
    out = fastdllm.generate(model, [tokenizer.encode("Question: 2 + 3?")], config=config.replace(seed=1))
    tokens, values, tops = out.sequences[0].tolist(), out.logprobs[0], out.top_logprobs[0]
    assert len(values) == len(tokens) == 2 * CANVAS
    for token, value, top in zip(tokens, values, tops):
        assert top[0][0] == token and top[0][1] == pytest.approx(value) and value <= 0


def test_plan_counts_its_active_experts_and_the_pool_it_holds(checkpoint):
    from fastdllm.models.loading import load_model, read_config
    from fastdllm.models.plan import plan

    _, model, folder = checkpoint
    p = plan(read_config(folder), max_len=100, dtype="float32")
    layers, heads, width = model.kv_shape
    assert p.kv_cache_bytes == 2 * layers * heads * width * 100 * 4  # the pool's flattened positions
    expert = model.layers[0].experts_gate_up.numel() + model.layers[0].experts_down.numel()
    n, active = model.args.n_experts, model.args.n_active_experts
    tower = sum(t.numel() for t in model.vision.parameters())  # run per image, not per token
    assert p.parameters - p.active_parameters == layers * expert // n * (n - active) + tower  # idle experts
    # a rank of two holds what the loader reads for it, and the pool its split layers need
    rank = load_model(folder, dtype="float32", tp=(0, 2))
    p2 = plan(read_config(folder), max_len=100, dtype="float32", tp=2)
    assert p2.sharded_bytes + p2.replicated_bytes == sum(t.numel() * 4 for t in rank.parameters())
    assert p2.sharded_bytes + p2.replicated_bytes < p.sharded_bytes + p.replicated_bytes
    layers, heads, width = rank.kv_shape
    assert p2.kv_cache_bytes == 2 * layers * heads * width * 100 * 4


def test_the_grouped_experts_add_up_as_the_reference_does(checkpoint):
    """Every (token, expert) pair through one grouped matmul per projection, a token's experts added
    in expert order: the reference's expert-by-expert sum (its eager path, which float64 runs)."""
    _, model, _ = checkpoint
    layer = model.layers[0]
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(37, model.args.dim, generator=g), torch.randn(37, model.args.dim, generator=g)
    with torch.no_grad():
        grouped = layer.experts(x, residual)
        h = layer.router_norm(residual) * layer.router_scale * (residual.shape[-1] ** -0.5)
        weights, chosen = layer.router(h).softmax(-1, dtype=torch.float32).topk(layer.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True) * layer.per_expert_scale[chosen]
        torch.testing.assert_close(grouped, layer._experts_one_by_one(x, chosen, weights), rtol=1e-6, atol=1e-7)
