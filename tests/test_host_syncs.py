"""A decoding step is arithmetic: per step one host read (does any row still have a mask?), per
block a handful (the block's tokens and statistics in one read, a family's block-start rule),
whatever the family. `engine.host_syncs.HostSyncs` counts every point where a GPU would make the
host wait (value reads, boolean-mask indexing), here on the CPU."""

from __future__ import annotations

import pytest
import torch

from fastdllm import GenerationConfig, generate
from fastdllm.engine.host_syncs import HostSyncs

FAMILIES = ["tiny_llada", "tiny_dream", "tiny_sdar", "tiny_v2", "tiny_llada2", "tiny_llada_moe"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(
    "cache,blocks",
    [("dual", 1), pytest.param("dual", 3, marks=pytest.mark.slow), pytest.param("none", 1, marks=pytest.mark.slow)],
)
def test_a_step_reads_the_device_once(name, cache, blocks, request, tokenizer):
    """Also when later blocks are decoded in the same forwards (`parallel_blocks`)."""
    model = request.getfixturevalue(name)
    base = GenerationConfig(gen_length=32, block_length=8, threshold=0.2, stop_at_eos=False)
    lookahead = dict(parallel_blocks=blocks, block_add_threshold=0.0, lookahead_threshold=0.3)
    config = GenerationConfig.for_model(model, base, checkpoint_defaults=False, **lookahead)
    if not model.args.block_size:
        config = config.replace(cache=cache)
    prompts = [tokenizer.encode("Question: 3 + 4 = ?"), tokenizer.encode("Question: what is 12 + 30?\nAnswer:")]
    kinds = []
    with HostSyncs(sites=True) as syncs:
        generate(model, prompts, config=config, on_step=lambda e: kinds.append(e.kind))
    steps, blocks = kinds.count("step"), kinds.count("block")
    # input checks and the final count of tokens; per row its prompt, and its leaving the layout
    setup = 4 + 3 * len(prompts)
    assert steps >= blocks and syncs.count <= steps + 3 * blocks + setup, syncs.by_site.most_common()


@pytest.mark.parametrize("name", ["gemma-arith", "llada-arith"])
def test_steps_that_hand_a_signal_on_read_the_device_once(name):
    """Decoders that condition the next forward on this one (DiffusionGemma's self-conditioning,
    DMax's soft embeddings) read nothing of their own: DiffusionGemma's forward and decisions place
    and decide everything on the device, DMax's fed-back columns are placed by index, and neither
    asks which rows' blocks are over before the step's one read of the rows' windows."""
    import fastdllm
    from fastdllm.evaluation.tasks import arith

    model, tok = fastdllm.load(name)
    prompts = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:2]]
    config = GenerationConfig.for_model(model, seed=0) if name == "gemma-arith" else GenerationConfig.dmax()
    kinds = []
    with HostSyncs(sites=True) as syncs:
        generate(model, prompts, config.fit_to_model(model), on_step=lambda e: kinds.append(e.kind))
    steps = kinds.count("step")
    assert not [site for site in syncs.by_site if "boolean index" in site], syncs.by_site.most_common()
    in_the_loop = sum(n for site, n in syncs.by_site.items() if "engine/decoder.py" in site)
    assert in_the_loop == steps, syncs.by_site.most_common()
    # besides: each prompt read once as it joins, the inputs checked, the answers counted
    assert syncs.count <= steps + 2 * len(prompts) + 3, syncs.by_site.most_common()


def test_the_counter_sees_every_kind_of_host_read():
    x = torch.arange(6)
    with HostSyncs() as syncs:
        bool(x.any())
        x.sum().item()
        x.tolist()
        x[x > 2] = 0
        x.nonzero()
        y = x + 1  # arithmetic reads nothing
    assert syncs.count == 5 and y.shape == (6,)
    assert torch.Tensor.tolist is not None and x.tolist() == [0, 1, 2, 0, 0, 0]
