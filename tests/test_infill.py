"""Infilling: tokens fixed at answer positions and a suffix after the answer region."""

from __future__ import annotations

import pytest
import torch

import fastdllm
from fastdllm import ConfigError, GenerationConfig, generate
from fastdllm.engine.decode import UnmaskingStrategy
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.engine.policies import Policies
from fastdllm.text.completion import complete
from fastdllm.text.infill import encode_infill

from .conftest import RefreshingRunner, random_prompts

BASELINE = dict(cache="none", threshold=None, suffix_window=None, refresh="full", stop_at_eos=False)


def plain_loop(model, prompt, gen_length, block_length, fixed, suffix):
    """LLaDA's low-confidence remasking over the whole sequence, written out: the prompt, the
    region (fixed tokens in place, masks elsewhere) and the suffix; each block's masks revealed over
    its steps by the linear schedule (one step per masked position of the block)."""
    mask = model.mask_token_id
    region = [mask] * gen_length
    for pos, t in fixed.items():
        region[pos] = t
    x = torch.tensor([prompt + region + suffix])
    start = len(prompt)
    for b in range(gen_length // block_length):
        lo, hi = start + b * block_length, start + (b + 1) * block_length
        steps = block_length
        masked = int((x[0, lo:hi] == mask).sum())
        counts = [masked // steps + (1 if i < masked % steps else 0) for i in range(steps)]
        for k in counts:
            with torch.inference_mode():
                logits = model(x)[0].double()
            p = torch.softmax(logits, -1)
            x0 = logits.argmax(-1)
            conf = torch.gather(p, -1, x0[:, None])[:, 0]
            conf[:lo] = -1
            conf[hi:] = -1
            conf[x[0] != mask] = -1
            if k:
                idx = conf.topk(k).indices
                x[0, idx] = x0[idx]
    return x[0, start : start + gen_length].tolist()


def test_fixed_tokens_and_a_suffix_decode_as_the_plain_loop_does(tiny_llada):
    model = tiny_llada
    prompt = random_prompts(model, [7], seed=3)[0]
    suffix = random_prompts(model, [5], seed=4)[0]
    fixed = {3: 17, 4: 18, 20: 99}
    config = GenerationConfig(
        gen_length=32, block_length=16, fixed=[(3, (17, 18)), (20, (99,))], suffix=suffix, **BASELINE
    )
    out = generate(model, [prompt], config=config)
    assert out.sequences[0].tolist() == plain_loop(model, prompt, 32, 16, fixed, suffix)
    assert out.sequences[0, [3, 4, 20]].tolist() == [17, 18, 99]
    assert (out.unmask_step[0, [3, 4, 20]] == -1).all() and (out.unmask_step[0].ne(-1).sum() == 29)
    # the suffix is seen: without it the answer differs
    assert (
        generate(model, [prompt], config=config.replace(suffix=None)).sequences[0].tolist() != out.sequences[0].tolist()
    )


@pytest.mark.parametrize("arch", ["tiny_llada", "tiny_dream"])
@pytest.mark.parametrize("cache", [pytest.param("prefix", marks=pytest.mark.slow), "dual"])
def test_caches_see_the_suffix_and_fixed_tokens(arch, cache, request):
    model = request.getfixturevalue(arch)
    prompts = random_prompts(model, [6, 11], seed=5)
    config = GenerationConfig(
        gen_length=32,
        block_length=8,
        threshold=0.3,
        fixed={9: (40, 41), 30: (7,)},
        suffix=(5, 6, 7, 8),
        cache=cache,
        refresh="full",
    )
    strategy = UnmaskingStrategy.from_config(config)
    plain = generate(model, prompts, config=config.replace(cache="none", suffix_window=None))
    full = config.replace(suffix_window=None)
    cached = generate(model, prompts, config=full, policies=Policies(strategy=strategy), kv=RefreshingRunner(model))
    assert torch.equal(plain.sequences, cached.sequences)
    # the default suffix window still shows a row its whole suffix
    windowed = generate(model, prompts, config=config, policies=Policies(strategy=strategy), kv=RefreshingRunner(model))
    assert torch.equal(plain.sequences, windowed.sequences)


def test_fixed_tokens_are_never_edited(tiny_llada):
    prompt = random_prompts(tiny_llada, [6], seed=1)[0]
    config = GenerationConfig(gen_length=16, block_length=8, editing_threshold=0.0, fixed={2: (3,), 9: (4, 5)})
    out = generate(tiny_llada, [prompt], config=config)
    assert out.sequences[0, [2, 9, 10]].tolist() == [3, 4, 5]


def test_a_stop_before_the_last_fixed_token_pads_the_fill(trained_llada):
    model, tok = trained_llada
    messages = [
        {"role": "user", "content": "Mia has 12 pencils and gives 2 to Ann. How many pencils does Mia have now?"}
    ]
    free = fastdllm.generate_text(model, tok, messages=messages, gen_length=128, block_length=32)
    out = fastdllm.generate_text(model, tok, messages=messages, gen_length=128, block_length=32, fixed={100: " done"})
    # the free answer stops before position 100; the fixed text still ends the infilled one
    assert free.num_tokens < 100 and out.text.endswith(" done") and out.text.startswith(free.text[:10])
    ids = tok.encode_chat(messages)
    config = encode_infill(GenerationConfig(gen_length=128, block_length=32, fixed={100: " done"}), tok)
    seq = generate(model, [ids], config=config).sequences[0]
    assert tok.decode(seq[100:102]) == " done"
    assert complete(tok, seq, model.stop_token_ids, fixed_end=config.fixed_end).text == out.text


@pytest.fixture(scope="module")
def trained_llada():
    return fastdllm.load(device="cpu")


def test_rows_with_different_infills_share_one_batch(tiny_llada):
    a = GenerationConfig(gen_length=16, block_length=8, fixed={1: (5,)}, suffix=(9, 9), deterministic=True)
    b = a.replace(fixed={}, suffix=None)
    decoder = BlockDecoder(tiny_llada, a)
    assert decoder.accepts(b)
    prompts = random_prompts(tiny_llada, [5, 8], seed=2)
    rows = decoder.add([prompts[0]], config=a) + decoder.add([prompts[1]], config=b)
    while decoder.step() is not None:
        pass
    alone = [generate(tiny_llada, [p], config=c).sequences[0] for p, c in zip(prompts, (a, b))]
    assert [r.answer.tolist() for r in rows] == [x.tolist() for x in alone] and alone[0][1] == 5


def test_infill_mistakes_name_the_field(tiny_llada, tiny_sdar, tokenizer):
    def refused(name, fn):
        with pytest.raises(ValueError, match=f"^{name}: ") as e:
            fn()
        return str(e.value)

    below = refused("fixed", lambda: GenerationConfig(gen_length=32, fixed={99999: "hello"}))
    assert below == "fixed: positions must be below gen_length=32 (got 99999)"  # the part at fault, no tuples
    refused("fixed", lambda: GenerationConfig(gen_length=32, fixed={30: (1, 2, 3)}))
    refused("fixed", lambda: GenerationConfig(fixed={-1: "x"}))
    refused("fixed", lambda: GenerationConfig(fixed={3: ""}))
    refused("fixed", lambda: GenerationConfig(fixed={3: (1, 2), 4: (5,)}))
    refused("fixed", lambda: GenerationConfig(fixed=[(3, "a"), (3, "b")]))
    refused("fixed", lambda: GenerationConfig(fixed="3:a"))
    refused("suffix", lambda: GenerationConfig(suffix=""))
    tok, mask = tokenizer, tiny_llada.mask_token_id
    assert "overlap" in refused(
        "fixed", lambda: encode_infill(GenerationConfig(fixed={3: " one two three", 4: " x"}), tok, mask)
    )
    assert "past" in refused("fixed", lambda: encode_infill(GenerationConfig(gen_length=32, fixed={31: " a b"}), tok))
    assert "mask" in refused("fixed", lambda: encode_infill(GenerationConfig(fixed={0: "<|mdm_mask|>"}), tok, mask))
    assert "mask" in refused("suffix", lambda: encode_infill(GenerationConfig(suffix="a<|mdm_mask|>"), tok, mask))
    prompt = random_prompts(tiny_llada, [4])[0]
    assert "token ids" in refused("fixed", lambda: generate(tiny_llada, [prompt], fixed={2: "text"}))
    assert "mask" in refused("fixed", lambda: generate(tiny_llada, [prompt], fixed={2: (mask,)}))
    assert "block-causal" in refused("suffix", lambda: generate(tiny_sdar, [prompt], suffix=(4, 5)))
    # fixed tokens work on a block-causal model: context inside their block
    cfg = GenerationConfig.for_model(tiny_sdar, gen_length=8, fixed={5: (7,)})
    assert generate(tiny_sdar, [prompt], config=cfg).sequences[0, 5] == 7
    # POS:TEXT, as the CLI and lm-eval's model_args give it
    assert GenerationConfig.parse("fixed", "5: apples") == ((5, " apples"),)
    with pytest.raises(ConfigError, match="^fixed: expected POS:TEXT"):
        GenerationConfig.parse("fixed", "apples")
    assert GenerationConfig(fixed={"5": "a"}).fixed == ((5, "a"),)  # JSON object keys
