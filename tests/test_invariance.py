"""Batch invariance: with `deterministic=True` a row's logits and tokens are bit for bit those it
gets alone, in bfloat16, whatever else is in its batch (mixed prompt lengths, rows that join a
running batch), for every family."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fastdllm import GenerationConfig, generate
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.engine.rows import prepare_inputs

from .test_continuous import config_for

FAMILIES = ["tiny_llada", "tiny_dream", "tiny_sdar", "tiny_v2", "tiny_llada2", "tiny_llada_moe", "tiny_nemotron"]


# Decoding in bfloat16 is slow on a CPU: two families decode in the default suite, all in the slow set.
DECODED = [pytest.param(f, marks=() if f in ("tiny_dream", "tiny_llada2") else pytest.mark.slow) for f in FAMILIES]


@pytest.fixture(scope="module", params=FAMILIES)
def bf16(request):
    """A random model of each family in bfloat16: its near-uniform confidences make a rounding flip
    a different token."""
    return copy.deepcopy(request.getfixturevalue(request.param)).to(torch.bfloat16)


def prompts(model, lengths=(5, 19, 33, 58)):
    g = torch.Generator().manual_seed(len(lengths))
    return [torch.randint(0, 700, (n,), generator=g).tolist() for n in lengths]


def test_a_padded_rows_logits_are_its_logits_alone(bf16):
    rows = prompts(bf16)
    ids, mask = prepare_inputs(bf16, rows, None, GenerationConfig(gen_length=8, block_length=8))
    width = ids.shape[1]
    with torch.no_grad():
        loose = bf16(ids, attention_mask=mask)
        exact = bf16(ids, attention_mask=mask, batch_invariant=True)
        alone = [bf16(torch.tensor([r]), batch_invariant=True)[0] for r in rows]
        plain_alone = [bf16(torch.tensor([r]))[0] for r in rows]
    assert all(torch.equal(exact[i, width - len(r) :], alone[i]) for i, r in enumerate(rows))
    # what the flag is for: without it a padded row's bfloat16 logits move
    assert any(not torch.equal(loose[i, width - len(r) :], plain_alone[i]) for i, r in enumerate(rows))


def _config(model, **changes):
    return GenerationConfig.for_model(
        model,
        GenerationConfig(gen_length=8, block_length=8, threshold=0.2, stop_at_eos=False, deterministic=True),
        **changes,
    )


@pytest.mark.parametrize("bf16", DECODED, indirect=True)
def test_mixed_length_batches_decode_every_row_as_alone(bf16):
    """With each family's default cache, and (masked-diffusion families) with the prefix cache
    and with none."""
    caches = ["dual"] if bf16.args.block_size else ["dual", "prefix", "none"]
    rows = prompts(bf16)
    for cache in caches:
        config = _config(bf16, cache=cache)
        batch = generate(bf16, rows, config=config)
        for i, r in enumerate(rows):
            assert torch.equal(batch.sequences[i], generate(bf16, [r], config=config).sequences[0]), (cache, i)


@pytest.mark.parametrize("bf16", DECODED, indirect=True)
def test_rows_that_join_a_running_batch_decode_as_alone(bf16):
    base = _config(bf16)
    first, late = prompts(bf16, (7, 40)), prompts(bf16, (25,))
    decoder = BlockDecoder(bf16, base)
    rows = decoder.add(first, row_seeds=[0, 1], config=config_for(base, 16))
    decoder.step()
    rows += decoder.add(late, row_seeds=[2], config=base)
    while decoder.active:
        decoder.step()
    for row, prompt, gen in zip(rows, first + late, (16, 16, 8)):
        alone = generate(bf16, [prompt], config=config_for(base, gen))
        assert torch.equal(row.answer, alone.sequences[0])


def test_the_server_answers_alone_and_under_load_alike(request, tokenizer):
    """`fastdllm serve --deterministic` on a bfloat16 model: requests of mixed lengths (one with
    n=2, one streamed) sent all at once and staggered get the answers they get alone."""
    import threading
    import time

    from .test_server import LiveServer

    model = copy.deepcopy(request.getfixturevalue("tiny_llada2")).to(torch.bfloat16)
    defaults = GenerationConfig.for_model(
        model, GenerationConfig(gen_length=16, block_length=8, threshold=0.2, deterministic=True)
    )
    server = LiveServer(model, tokenizer, defaults=defaults, max_batch_size=16)
    words = ["one", "two three", "four five six seven", "eight nine ten eleven twelve thirteen fourteen"]
    bodies = [
        {
            "model": "llada-arith",
            "prompt": " ".join(words[: i % 4 + 1]) * (1 + i // 4),
            "max_tokens": 16,
            "temperature": 0,
            "n": 2 if i == 1 else 1,
            "stream": i == 2,
        }
        for i in range(6)
    ]

    def ask(body, delay=0.0):
        time.sleep(delay)
        r = server.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        if body["stream"]:
            return [
                json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines() if line.startswith("data: {")
            ]
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def all_at_once(delays):
        out = [None] * len(bodies)

        def run(i):
            out[i] = ask(bodies[i], delays[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return out

    try:
        alone = [ask(b) for b in bodies]
        assert all_at_once([0.0] * len(bodies)) == alone
        assert all_at_once([0.05 * i for i in range(len(bodies))]) == alone
        assert server.health()["max_batch_rows"] > 1
    finally:
        server.stop()
