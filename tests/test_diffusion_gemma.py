"""DiffusionGemma against transformers' own `DiffusionGemmaForBlockDiffusion` (a test dependency):
tiny checkpoints its class makes and saves (seeded random init, small dims, a few experts, sliding
and full layers, every norm, scale and scalar moved off its init), loaded by `fastdllm.load`.
Logits of the encoder's causal pass, of the decoder's pass over a canvas with and without the
self-conditioning signal, and of a later canvas after a committed one, with prompts longer than
the sliding window."""

from __future__ import annotations

import pytest
import torch

import fastdllm

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("transformers without DiffusionGemma (5.2 or later)", allow_module_level=True)

CANVAS = 8


def make_reference(tokenizer, folder, seed: int = 0, window: int = 6):
    """A tiny DiffusionGemma made by transformers' class, saved with our tokenizer beside it."""
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
        final_logit_softcapping=3.0,
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
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if p.dim() == 1:
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

    cap = model.config.text_config.final_logit_softcapping
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
    del cap
    return out.logits[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("diffusion_gemma")
    reference = make_reference(tokenizer, folder)
    model, _ = fastdllm.load(str(folder), dtype="float32")
    return reference, model


def test_the_encoders_causal_pass_gives_transformers_logits(checkpoint, tokenizer):
    reference, model = checkpoint
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
    reference, model = checkpoint
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
    _, model = checkpoint
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
