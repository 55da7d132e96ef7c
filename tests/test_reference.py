"""Token-for-token agreement with the references, each run by its own code (its loops and its
modeling file) in its own interpreter, on our checkpoints saved in the real layout:

- NVlabs/Fast-dLLM's `llada/generate.py` on the embedded LLaDA: set FASTDLLM_REFERENCE to a
  checkout and FASTDLLM_REFERENCE_PYTHON to an interpreter with what it pins (transformers==4.49.0,
  einops, torch);
- JetAstra/SDAR's evaluation routine (`block_diffusion_generate`) with its modeling file, on
  block-diffusion checkpoints in SDAR's layout: set FASTDLLM_SDAR_REFERENCE to a checkout and
  FASTDLLM_SDAR_PYTHON to an interpreter with transformers==4.52.4, einops and torch;
- Fast-dLLM v2's `batch_sample` with the modeling file its checkpoints ship, on a tiny checkpoint
  in its layout: set FASTDLLM_V2_REFERENCE to a folder holding `generation_functions.py` (NVlabs/
  Fast-dLLM's v2/), `modeling.py` and `configuration.py` (a Fast_dLLM_v2 checkpoint's), and
  FASTDLLM_V2_PYTHON to an interpreter with transformers==4.53.1, einops and torch; the same
  modeling file's own `generate(use_block_cache=True)` needs only the last two files;
- LLaDA2.0's modeling file and `generate` (as the LLaDA2.0 checkpoints ship them) on a tiny
  mixture-of-experts checkpoint in their layout: set FASTDLLM_LLADA2_REFERENCE to a folder holding
  `modeling_llada2_moe.py` and `configuration_llada2_moe.py`, and FASTDLLM_LLADA2_PYTHON to an
  interpreter with transformers==4.57.1 and torch.

- dParallel's `LLaDA/generate.py` (its entropy threshold, with no cache, the prefix cache and the
  dual cache) with its own `modeling_llada.py`, on the embedded LLaDA, and its Dream decoding
  (`alg="entropy_threshold"`) with its own `modeling_dream.py` on the embedded Dream twin: set
  FASTDLLM_DPARALLEL_REFERENCE to a czg1225/dParallel checkout and FASTDLLM_DPARALLEL_PYTHON to an
  interpreter with transformers==4.49.0, numpy and torch.

- d3LLM's `generate_multi_block` and `generate_multi_block_kv_cache` (`d3llm/d3llm_LLaDA/
  d3llm_llada_generate_util.py`) with the `modeling_llada.py` of its `utils/utils_LLaDA/model`, on
  the embedded LLaDA (the KV-cache loop at a third of its confidence): set FASTDLLM_D3LLM_REFERENCE
  to a hao-ai-lab/d3LLM checkout and FASTDLLM_D3LLM_PYTHON to an interpreter with
  transformers==4.49.0 and torch;
- RND1's `generate` (`rnd/sampling.py`'s `diffusion_sample`) with its own `modeling_rnd.py` on a
  tiny seeded mixture-of-experts checkpoint its classes load strictly: set FASTDLLM_RND1_REFERENCE
  to a vz415/RND1 checkout at 520473c (upstream's last merge) and FASTDLLM_RND1_PYTHON to an
  interpreter with transformers==4.57.1, accelerate and torch;
- WeDLM's engine decoder (`wedlm/engine/wedlm_decoder.py` and its `Sampler`, driven as its model
  runner drives them, on the CPU) with its transformers model (`hf_compat/modeling_wedlm.py`), on
  tiny seeded checkpoints in its Qwen2.5 and Qwen3 layouts: set FASTDLLM_WEDLM_REFERENCE to a
  Tencent/WeDLM checkout and FASTDLLM_WEDLM_PYTHON to an interpreter with transformers==4.57.1 and
  torch;
- DMax's step, `ThresholdParallelDecoder.decode_uniform` of its vendored dInfer (`dInfer/python/
  dinfer/decoding/parallel_strategy.py`, pure PyTorch: loaded here without the package, whose other
  modules need vLLM), on the same logits as our policies: set FASTDLLM_DMAX_REFERENCE to a
  czg1225/DMax checkout.

Without them each test replays what the reference's run recorded (`tests/fixtures/parity/`:
the spec it ran, a digest of the checkpoint's weights, and its tokens and NFE per run), so the
default suite checks token parity on every change; a fixture whose spec or weights no longer match
fails and asks to be recorded again: run the test with the reference set up and
FASTDLLM_RECORD_FIXTURES=1 (`tests/fixtures/parity/README.md`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.evaluation.tasks import get_task
from fastdllm.models.loading import save_pretrained

CHECKOUT = os.environ.get("FASTDLLM_REFERENCE")
PYTHON = os.environ.get("FASTDLLM_REFERENCE_PYTHON")
RUNNER = Path(__file__).parent / "reference" / "llada_generate.py"

SDAR_CHECKOUT = os.environ.get("FASTDLLM_SDAR_REFERENCE")
SDAR_PYTHON = os.environ.get("FASTDLLM_SDAR_PYTHON")
SDAR_RUNNER = Path(__file__).parent / "reference" / "sdar_bd3.py"
SDAR_MODEL_FILES = Path("training", "model", "SDAR-4B-Chat")

V2_REFERENCE = os.environ.get("FASTDLLM_V2_REFERENCE")
V2_PYTHON = os.environ.get("FASTDLLM_V2_PYTHON")
V2_RUNNER = Path(__file__).parent / "reference" / "fast_dllm_v2.py"

LLADA2_REFERENCE = os.environ.get("FASTDLLM_LLADA2_REFERENCE")
LLADA2_PYTHON = os.environ.get("FASTDLLM_LLADA2_PYTHON")
LLADA2_RUNNER = Path(__file__).parent / "reference" / "llada2_moe.py"
LLADA2_FILES = ("configuration_llada2_moe.py", "modeling_llada2_moe.py")

DPARALLEL_CHECKOUT = os.environ.get("FASTDLLM_DPARALLEL_REFERENCE")
DPARALLEL_PYTHON = os.environ.get("FASTDLLM_DPARALLEL_PYTHON")
DPARALLEL_DREAM_RUNNER = Path(__file__).parent / "reference" / "dparallel_dream.py"
FAST_DLLM_DREAM_RUNNER = Path(__file__).parent / "reference" / "fast_dllm_dream.py"

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
RECORD = os.environ.get("FASTDLLM_RECORD_FIXTURES") == "1"
FAST_DLLM_LIVE = bool(CHECKOUT and PYTHON and Path(CHECKOUT, "llada", "generate.py").exists())
SDAR_LIVE = bool(SDAR_CHECKOUT and SDAR_PYTHON and Path(SDAR_CHECKOUT, SDAR_MODEL_FILES, "modeling_sdar.py").exists())


def live_or_recorded(live: bool, *fixtures: str, reason: str):
    """Run where the reference is set up, else where every fixture the test replays is recorded."""
    recorded = all((FIXTURES / f"{name}.json").is_file() for name in fixtures)
    return pytest.mark.skipif(not (live or recorded), reason=f"{reason}, or record {', '.join(fixtures)}")


needs_fast_dllm = live_or_recorded(
    FAST_DLLM_LIVE, "fast_dllm_llada", reason="set FASTDLLM_REFERENCE (a NVlabs/Fast-dLLM checkout) and _PYTHON"
)


def _reference_checkpoint(
    name: str | None,
    folder: Path,
    modeling: Path | None,
    files: tuple[str, ...],
    dtype="float32",
    temperature: float = 1.0,
):
    """The embedded model `name` (in `dtype`), saved in float32 in its real layout with the
    reference's own modeling files beside it (None: replaying recorded runs, no files); and three
    held-out arith prompts. `temperature` > 1 divides its output head (untied) by it: a less
    confident model, decoding in more forwards."""
    model, tok = fastdllm.load(name, dtype=dtype)
    if temperature != 1.0:
        with torch.no_grad():
            model.output.weight /= temperature
    save_pretrained(model, folder, tok, dtype=torch.float32)
    for f in files if modeling is not None else ():
        shutil.copy(modeling / f, folder / f)
    task = get_task("arith")
    return model, [task.encode(tok, doc, []) for doc in task.load(limit=3)]


_LIVE_RUNS: dict = {}
# what a live runner printed beside its runs (logits, say), by (fixture, weights)
_LIVE_RESULTS: dict = {}


def weights_digest(folder: Path) -> str:
    """sha256 of a checkpoint's tensors (names, dtypes, shapes, values), whatever the files' layout."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _reference_runs(
    python: str | None, runner: Path, code: str | None, folder: Path, spec: dict, fixture: str, env=None, timeout=1200
):
    """The reference's runs of `spec` on the checkpoint in `folder`, one per config and prompt: its
    runner in its own interpreter where the reference is set up (recorded as `fixture` with
    FASTDLLM_RECORD_FIXTURES=1), else the runs recorded, for the same spec and weights."""
    path, weights = FIXTURES / f"{fixture}.json", weights_digest(folder)
    if (fixture, weights) in _LIVE_RUNS:  # the other part of the same test
        return iter(_LIVE_RUNS[fixture, weights])
    if not (python and code):
        recorded = json.loads(path.read_text())
        stale = [k for k, v in (("spec", spec), ("weights_sha256", weights)) if recorded[k] != v]
        assert not stale, f"{path.name}: the {' and '.join(stale)} changed since it was recorded; record it again"
        return iter(recorded["runs"])
    job = folder.parent / "job.json"
    job.write_text(json.dumps(spec))
    out = subprocess.run(
        [python, str(runner), code, str(folder), str(job)], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = _LIVE_RESULTS[fixture, weights] = json.loads(out.stdout.strip().splitlines()[-1])
    runs = _LIVE_RUNS[fixture, weights] = result["runs"]
    if RECORD:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        record = {"runner": runner.name, "weights_sha256": weights, "spec": spec, "runs": runs}
        path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return iter(runs)


# Each recorded test runs twice: its sample in the default suite (the first prompt, under the
# configs that first show each value of each setting), and every run in the slow set.
PARTS = [pytest.param("sample", id="sample"), pytest.param("all", id="all", marks=pytest.mark.slow)]


def compared(configs: list[dict], prompts: list, theirs, part: str):
    """(config, prompt, the reference's run) in the reference's order; for the "sample" part only
    the first prompt, under each config that shows a setting's value no earlier config showed."""
    seen: set = set()
    for c in configs:
        values = {(k, str(v)) for k, v in c.items()}
        sampled, seen = not values <= seen, seen | values
        for k, prompt in enumerate(prompts):
            ref = next(theirs)
            if part == "all" or (k == 0 and sampled):
                yield c, prompt, ref


def _finished_at_start(ours, config: dict) -> int:
    """Blocks whose block-start forward revealed them whole: after each, a LLaDA reference's cached
    loops run one more forward, revealing nothing; we stop there (see `fastdllm.engine.decoder`)."""
    if config["cache"] == "none":
        return 0
    blocks = ours.unmask_step[0].view(-1, config["block_length"])
    return sum(len(set(b.tolist())) == 1 for b in blocks)


LLADA_FILES = ("configuration_llada.py", "modeling_llada.py")

CONFIGS = [
    dict(gen_length=gen, block_length=32, steps=steps, cache=cache, threshold=threshold)
    for gen, steps in ((64, 64), (128, 64))
    for cache in ("none", "prefix", "dual")
    for threshold in (None, 0.9)
]


@needs_fast_dllm
@pytest.mark.parametrize("part", PARTS)
def test_the_embedded_llada_decodes_as_the_reference_does(tmp_path, part):
    code = Path(CHECKOUT or "", "llada")
    modeling = code / "model" if FAST_DLLM_LIVE else None
    model, prompts = _reference_checkpoint(None, tmp_path / "llada", modeling, LLADA_FILES)
    spec = {"mask_id": model.args.mask_token_id, "prompts": prompts, "configs": CONFIGS}
    theirs = _reference_runs(PYTHON, RUNNER, modeling and str(code), tmp_path / "llada", spec, "fast_dllm_llada")
    for c, prompt, ref in compared(CONFIGS, prompts, theirs, part):
        config = GenerationConfig.fast_dllm(suffix_window=None, refresh="full", stop_at_eos=False, **c)
        ours = fastdllm.generate(model, [prompt], config=config)
        assert ours.sequences[0].tolist() == ref["tokens"], (str(c), prompt)
        assert ref["nfe"] == ours.nfe + _finished_at_start(ours, c), (c, ref["nfe"], ours.nfe)


DPARALLEL_CONFIGS = [
    dict(gen_length=gen, block_length=32, cache=cache, threshold=threshold)
    for gen in (64, 128)
    for cache in ("none", "prefix", "dual")
    for threshold in (0.5, 0.2)
]


DPARALLEL_LIVE = bool(
    DPARALLEL_CHECKOUT and DPARALLEL_PYTHON and Path(DPARALLEL_CHECKOUT, "LLaDA", "generate.py").exists()
)
DPARALLEL_REASON = "set FASTDLLM_DPARALLEL_REFERENCE (a czg1225/dParallel checkout) and FASTDLLM_DPARALLEL_PYTHON"


@live_or_recorded(DPARALLEL_LIVE, "dparallel_llada", reason=DPARALLEL_REASON)
@pytest.mark.parametrize("part", PARTS)
def test_the_entropy_rule_decodes_as_dparallels_llada_code(tmp_path, part):
    code = Path(DPARALLEL_CHECKOUT or "", "LLaDA")
    modeling = code / "model" if DPARALLEL_LIVE else None
    model, prompts = _reference_checkpoint(None, tmp_path / "llada", modeling, LLADA_FILES)
    spec = {"mask_id": model.args.mask_token_id, "prompts": prompts, "configs": DPARALLEL_CONFIGS}
    theirs = _reference_runs(
        DPARALLEL_PYTHON, RUNNER, modeling and str(code), tmp_path / "llada", spec, "dparallel_llada"
    )
    for c, prompt, ref in compared(DPARALLEL_CONFIGS, prompts, theirs, part):
        config = GenerationConfig.dparallel(stop_at_eos=False, **c)
        ours = fastdllm.generate(model, [prompt], config=config)
        assert ours.sequences[0].tolist() == ref["tokens"], (str(c), prompt)
        assert ref["nfe"] == ours.nfe + _finished_at_start(ours, c), (c, ref["nfe"], ours.nfe)


D3LLM_CHECKOUT = os.environ.get("FASTDLLM_D3LLM_REFERENCE")
D3LLM_PYTHON = os.environ.get("FASTDLLM_D3LLM_PYTHON")
D3LLM_RUNNER = Path(__file__).parent / "reference" / "d3llm_llada.py"
D3LLM_CONFIGS = [
    dict(
        gen_length=gen, block_length=32, threshold=t, block_add_threshold=a, decoded_token_threshold=0.95, early_stop=e
    )
    for gen in (64, 128)
    for t in (0.5, 0.2)
    for a in (0.1, 0.5)
    for e in (True, False)
]
D3LLM_KV_CACHE_CONFIGS = [
    dict(
        gen_length=gen,
        block_length=32,
        threshold=0.5,
        block_add_threshold=0.1,
        decoded_token_threshold=0.95,
        early_stop=e,
        cache_delay_iter=d,
        refresh_interval=r,
    )
    for gen in (64, 128)
    for e in (True, False)
    for d, r in ((0, 10000), (1, 10000), (2, 10000), (2, 3))
]
D3LLM_LIVE = bool(D3LLM_CHECKOUT and D3LLM_PYTHON and Path(D3LLM_CHECKOUT, "d3llm", "d3llm_LLaDA").is_dir())
D3LLM_REASON = "set FASTDLLM_D3LLM_REFERENCE (a hao-ai-lab/d3LLM checkout) and FASTDLLM_D3LLM_PYTHON"


D3LLM_DREAM_RUNNER = Path(__file__).parent / "reference" / "d3llm_dream.py"


def _decodes_as_d3llm(
    folder: Path, configs: list[dict], fixture: str, part: str, temperature: float = 1.0, dream: bool = False
):
    """Ours against d3LLM's code on the embedded LLaDA (or Dream twin), token for token; with its
    output head divided by `temperature`."""
    if dream:
        modeling, runner = Path(D3LLM_CHECKOUT or "", "utils", "utils_Dream", "model"), D3LLM_DREAM_RUNNER
        files, name = ("configuration_dream.py", "modeling_dream.py"), "dream-arith"
    else:
        modeling, runner = Path(D3LLM_CHECKOUT or "", "utils", "utils_LLaDA", "model"), D3LLM_RUNNER
        files, name = LLADA_FILES, None
    modeling = modeling if D3LLM_LIVE else None
    model, prompts = _reference_checkpoint(name, folder, modeling, files, "float32", temperature)
    spec = {"mask_id": model.mask_token_id, "eos_id": model.args.eos_token_id, "prompts": prompts}
    code = D3LLM_CHECKOUT if D3LLM_LIVE else None
    theirs = _reference_runs(D3LLM_PYTHON, runner, code, folder, {**spec, "configs": configs}, fixture)
    diverged = set()
    for c, prompt, ref in compared(configs, prompts, theirs, part):
        config = GenerationConfig.d3llm(
            gen_length=c["gen_length"],
            threshold=c["threshold"],
            block_add_threshold=c["block_add_threshold"],
            decoded_token_threshold=c["decoded_token_threshold"],
            parallel_blocks=c["gen_length"] // c["block_length"],
            stop_at_eos=c["early_stop"],
            eos_early_stop=c["early_stop"],
        )
        if "cache_delay_iter" in c:
            config = config.replace(
                cache="delayed", cache_delay=c["cache_delay_iter"], refresh_interval=c["refresh_interval"]
            )
        ours = fastdllm.generate(model, [prompt], config=config)
        # its Dream cache can attend some K/V twice (`DelayedCache`), which we do not: these
        # settings never lead it there, so that every run compares
        assert not ref.get("twice"), (str(c), prompt)
        if ours.sequences[0].tolist() != ref["tokens"]:
            diverged.add((frozenset(c.items()), prompts.index(prompt)))
            continue
        if not c["early_stop"]:
            assert ref["nfe"] == ours.nfe, (c, ref["nfe"], ours.nfe)
            continue
        # With its early stop, its counter adds one forward that never runs when the answer
        # ends, and it runs forwards that reveal nothing (see the runner): we run neither.
        assert ref["nfe"] - ref["idle"] - ours.nfe in (0, 1), (c, ref["nfe"], ref["idle"], ours.nfe)
    # With its early stop d3LLM decodes a forward with the masks it read before filling after a new
    # EOS (docs/decoding.md, a deliberate difference): where its forced token lands on a filled
    # position, its next reveals come a step later than ours and can change tokens. No run here
    # comes to that; one that does fails this.
    assert not diverged, diverged


@live_or_recorded(D3LLM_LIVE, "d3llm_llada", reason=D3LLM_REASON)
@pytest.mark.parametrize("part", PARTS)
def test_the_entropy_rule_over_several_blocks_decodes_as_d3llms_code(tmp_path, part):
    _decodes_as_d3llm(tmp_path / "llada", D3LLM_CONFIGS, "d3llm_llada", part)


@live_or_recorded(D3LLM_LIVE, "d3llm_llada_kv_cache", reason=D3LLM_REASON)
@pytest.mark.parametrize("part", PARTS)
def test_the_delayed_cache_decodes_as_d3llms_kv_cache_loop(tmp_path, part):
    # at a third of its confidence the model decodes in many forwards, so that when the cache
    # commits a block, and which forwards are full, decide tokens
    _decodes_as_d3llm(tmp_path / "llada", D3LLM_KV_CACHE_CONFIGS, "d3llm_llada_kv_cache", part, temperature=3.0)


D3LLM_DREAM_CONFIGS = [
    dict(
        gen_length=gen, block_length=32, threshold=t, block_add_threshold=a, decoded_token_threshold=0.95, early_stop=e
    )
    for gen in (64,)
    for t in (0.5, 0.2)
    for a in (0.1, 0.5)
    for e in (True, False)
]


@live_or_recorded(D3LLM_LIVE, "d3llm_dream", reason=D3LLM_REASON)
@pytest.mark.parametrize("part", PARTS)
def test_the_entropy_rule_over_several_blocks_decodes_as_d3llms_dream_code(tmp_path, part):
    # at a third of its confidence, so that where the lowest-entropy position may be revealed decides
    _decodes_as_d3llm(tmp_path / "dream", D3LLM_DREAM_CONFIGS, "d3llm_dream", part, temperature=3.0, dream=True)


@live_or_recorded(D3LLM_LIVE, "d3llm_dream_kv_cache", reason=D3LLM_REASON)
@pytest.mark.parametrize("part", PARTS)
def test_the_delayed_cache_decodes_as_d3llms_dream_kv_cache_loop(tmp_path, part):
    configs = [c for c in D3LLM_KV_CACHE_CONFIGS if c["gen_length"] == 64]
    _decodes_as_d3llm(tmp_path / "dream", configs, "d3llm_dream_kv_cache", part, temperature=3.0, dream=True)


DMAX_CHECKOUT = os.environ.get("FASTDLLM_DMAX_REFERENCE")


def _dmax_strategy_module():
    """DMax's parallel_strategy.py and the utils.py it imports, as a package of their own."""
    import importlib.util
    import sys
    import types

    folder = Path(DMAX_CHECKOUT, "dInfer", "python", "dinfer", "decoding")
    package = types.ModuleType("dmax_decoding")
    package.__path__ = [str(folder)]
    sys.modules["dmax_decoding"] = package
    for name in ("utils", "parallel_strategy"):
        spec = importlib.util.spec_from_file_location(f"dmax_decoding.{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["dmax_decoding.parallel_strategy"]


DMAX_LIVE = bool(
    DMAX_CHECKOUT and Path(DMAX_CHECKOUT, "dInfer", "python", "dinfer", "decoding", "parallel_strategy.py").exists()
)
DMAX_SEEDS = range(6)
DMAX_VOCAB, DMAX_BLOCK, DMAX_DIM, DMAX_MASK = 12, 8, 6, 11


def _dmax_inputs(seed: int):
    """The seed's embedding table and its stream of logits, one (1, block, vocab) tensor a step:
    sharp for some positions, flat for others, the mask never the most likely."""
    gen = torch.Generator().manual_seed(seed)
    embedding = torch.nn.Embedding(DMAX_VOCAB, DMAX_DIM)
    torch.nn.init.normal_(embedding.weight, generator=gen)

    def logits():
        while True:
            out = torch.randn(1, DMAX_BLOCK, DMAX_VOCAB, generator=gen)
            out = out * (1 + 4 * torch.rand(1, DMAX_BLOCK, 1, generator=gen))
            out[..., DMAX_MASK] = -20.0
            yield out

    return embedding, logits()


def _dmax_traces() -> dict:
    """DMax's `decode_uniform` step after step from a block of masks (its first position a prompt
    token), per seed: the block's tokens, whether it stopped, and the next step's input embeddings.
    Live where the checkout is set (recorded as `dmax` with FASTDLLM_RECORD_FIXTURES=1), else
    the recorded traces."""
    path = FIXTURES / "dmax.json"
    if not DMAX_LIVE:
        return json.loads(path.read_text())["traces"]
    reference = _dmax_strategy_module()
    traces = {}
    for seed in DMAX_SEEDS:
        embedding, logits = _dmax_inputs(seed)
        theirs = reference.ThresholdParallelDecoder(temperature=0.0, threshold=0.5, mask_id=DMAX_MASK, eos_id=10)
        x = torch.full((1, DMAX_BLOCK), DMAX_MASK)
        x[0, 0] = 3
        active, embeds, trace = x == DMAX_MASK, None, []
        for step in range(DMAX_BLOCK):
            stop, embeds = theirs.decode_uniform(
                next(logits), 0, DMAX_BLOCK, x, active, embedding, prev_embeddings=embeds
            )
            trace.append({"tokens": x[0].tolist(), "stop": bool(stop), "embeds": embeds.float()[0].tolist()})
            if stop or step + 1 >= DMAX_BLOCK:
                break
        traces[str(seed)] = trace
    if RECORD:
        path.write_text(json.dumps({"runner": "decode_uniform", "traces": traces}, separators=(",", ":")) + "\n")
    return traces


@live_or_recorded(DMAX_LIVE, "dmax", reason="set FASTDLLM_DMAX_REFERENCE (a czg1225/DMax checkout)")
@pytest.mark.parametrize("seed", DMAX_SEEDS)
def test_the_dmax_policies_step_as_dmaxs_decode_uniform(seed):
    """Step after step on the same random logits, from a block of masks (its first position a prompt
    token): the same tokens revealed and revised, the same end of the block, the same soft
    embeddings."""
    from fastdllm.engine.decode import BlockClock, DecodeView, UnmaskingStrategy
    from fastdllm.models.transformer import soft_embeddings

    trace = _dmax_traces()[str(seed)]
    embedding, logits = _dmax_inputs(seed)
    blk, mask_id = DMAX_BLOCK, DMAX_MASK
    config = GenerationConfig.dmax(block_length=blk, gen_length=blk)
    strategy = UnmaskingStrategy.from_config(config)
    ours = torch.full((1, blk), mask_id)
    ours[0, 0] = 3  # a prompt token inside the block (block-causal lead): never revised
    region = torch.full((1, blk), -1)
    for step, theirs in enumerate(trace):
        masked = ours == mask_id
        editable = (region >= 0) & ~masked
        clock = BlockClock.uniform(masked, blk, step)
        d = strategy.decide(next(logits), DecodeView(ours, clock, mask_id, editable=editable))
        ours = torch.where(d.edited, d.tokens, ours)
        ours = torch.where(d.chosen, d.tokens, ours)
        region = torch.where(d.chosen, torch.full_like(region, step), region)
        done = d.block_done  # the strategy's own end of the block (`Editing.block_done`)
        assert ours[0].tolist() == theirs["tokens"], step
        # its runner (`BlockRunner.decode_uniform`) stops a block after block_length forwards
        their_done = theirs["stop"] or step + 1 >= blk
        assert bool(done[0]) == their_done, step
        if their_done:
            assert step == len(trace) - 1
            break
        soft = (region >= 0) & (ours != mask_id)
        mixed = soft_embeddings(embedding, d.top_token, d.top_prob, mask_id)
        want = torch.where(soft[..., None], mixed, embedding(ours).float())
        torch.testing.assert_close(torch.tensor(theirs["embeds"])[None], want, rtol=1e-5, atol=1e-6)


DPARALLEL_DREAM_CONFIGS = [
    dict(gen_length=gen, block_length=32, threshold=threshold) for gen in (64, 128) for threshold in (0.5, 0.2)
]


@live_or_recorded(DPARALLEL_LIVE, "dparallel_dream", reason=DPARALLEL_REASON)
@pytest.mark.parametrize("part", PARTS)
def test_the_entropy_rule_decodes_as_dparallels_dream_code(tmp_path, part):
    modeling = Path(DPARALLEL_CHECKOUT or "", "Dream", "model") if DPARALLEL_LIVE else None
    files = ("configuration_dream.py", "modeling_dream.py")
    model, prompts = _reference_checkpoint("dream-arith", tmp_path / "dream", modeling, files, dtype="float32")
    spec = {"prompts": prompts, "configs": DPARALLEL_DREAM_CONFIGS}
    code = DPARALLEL_CHECKOUT if DPARALLEL_LIVE else None
    theirs = _reference_runs(
        DPARALLEL_PYTHON, DPARALLEL_DREAM_RUNNER, code, tmp_path / "dream", spec, "dparallel_dream"
    )
    for c, prompt, ref in compared(DPARALLEL_DREAM_CONFIGS, prompts, theirs, part):
        # Dream's form of the rule (a config with `alg`): float32 entropy of the raw logits, strictly below
        config = GenerationConfig.dparallel(stop_at_eos=False, alg="entropy", **c)
        ours = fastdllm.generate(model, [prompt], config=config)
        assert ours.sequences[0].tolist() == ref["tokens"], (str(c), prompt)
        assert ref["nfe"] == ours.nfe, (c, ref["nfe"], ours.nfe)


FAST_DLLM_DREAM_CONFIGS = [
    dict(gen_length=gen, block_length=32, cache=cache, threshold=threshold)
    for gen in (64, 128)
    for cache in ("prefix", "dual")
    for threshold in (0.9, 0.5)
]
FAST_DLLM_DREAM_LIVE = bool(
    CHECKOUT and PYTHON and Path(CHECKOUT, "dream", "model", "generation_utils_block.py").exists()
)


@live_or_recorded(
    FAST_DLLM_DREAM_LIVE, "fast_dllm_dream", reason="set FASTDLLM_REFERENCE (a NVlabs/Fast-dLLM checkout) and _PYTHON"
)
@pytest.mark.parametrize("part", PARTS)
def test_the_embedded_dream_decodes_as_fast_dllms_dream_code(tmp_path, part):
    """Fast-dLLM's Dream loop: a block-start forward over the whole sequence that fills the cache
    and reveals the block's first position, then cached forwards (the rest of the sequence, or the
    block alone with the dual cache; each opening at the block, its first column's logit its own
    output) revealing every position at or above the threshold (always the most confident) until
    the block is full."""
    modeling = Path(CHECKOUT or "", "dream", "model") if FAST_DLLM_DREAM_LIVE else None
    files = ("configuration_dream.py", "modeling_dream.py")
    model, prompts = _reference_checkpoint("dream-arith", tmp_path / "dream", modeling, files, dtype="float32")
    spec = {"prompts": prompts, "configs": FAST_DLLM_DREAM_CONFIGS}
    code = CHECKOUT if FAST_DLLM_DREAM_LIVE else None
    theirs = _reference_runs(PYTHON, FAST_DLLM_DREAM_RUNNER, code, tmp_path / "dream", spec, "fast_dllm_dream")
    for c, prompt, ref in compared(FAST_DLLM_DREAM_CONFIGS, prompts, theirs, part):
        config = GenerationConfig.fast_dllm(stop_at_eos=False, **c)
        ours = fastdllm.generate(model, [prompt], config=config)
        assert ours.sequences[0].tolist() == ref["tokens"], (str(c), prompt)
        assert ref["nfe"] == ours.nfe, (c, ref["nfe"], ours.nfe)


SDAR_CONFIGS = [
    dict(gen_length=g, steps_per_block=s, threshold=t) for g in (32, 64) for s in (4, 2) for t in (None, 0.9, 0.5)
]


def sdar_models():
    from fastdllm.models.loading import EMBEDDED_MODELS

    return ["tiny_sdar"] + [name for name in EMBEDDED_MODELS if name.startswith("sdar")]


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("name", sdar_models())
def test_block_diffusion_decodes_as_sdars_own_routine(name, part, request, tokenizer, tmp_path):
    """Greedy, with the quota rule (static and with thresholds), prompts ending anywhere in a block,
    up to and including the first stop token (the reference leaves what follows masked); in the
    model's training block and in a decoding block twice as long."""
    if name.startswith("tiny"):
        model, tok = request.getfixturevalue(name), tokenizer
    else:
        model, tok = fastdllm.load(name, dtype=torch.float32)
    fixture = f"sdar_{name.replace('-', '_')}"
    if not (SDAR_LIVE or (FIXTURES / f"{fixture}.json").is_file()):
        pytest.skip(
            f"set FASTDLLM_SDAR_REFERENCE (a JetAstra/SDAR checkout) and FASTDLLM_SDAR_PYTHON, or record {fixture}"
        )
    folder = save_pretrained(model, tmp_path / "sdar", tok, dtype=torch.float32)
    for f in ("configuration_sdar.py", "modeling_sdar.py") if SDAR_LIVE else ():
        shutil.copy(Path(SDAR_CHECKOUT, SDAR_MODEL_FILES, f), folder / f)
    # its training loss needs triton; decoding never calls it
    (folder / "fused_linear_diffusion_cross_entropy.py").write_text(
        "class FusedLinearDiffusionCrossEntropyLoss:\n    pass\n"
    )
    task = get_task("arith")
    prompts = [task.encode(tok, doc, []) for doc in task.load(limit=4)]
    blk = model.args.block_size
    # its training block, and a decoding block twice as long (its evaluation builds the mask from it)
    configs = [dict(c, block_length=b) for b in (blk, 2 * blk) for c in SDAR_CONFIGS]
    stop = sorted(model.stop_token_ids)
    spec = {"mask_id": model.mask_token_id, "stop": stop, "prompts": prompts, "configs": configs}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent / "reference" / "cpu_shims"))
    code = SDAR_CHECKOUT if SDAR_LIVE else None
    theirs = _reference_runs(SDAR_PYTHON, SDAR_RUNNER, code, folder, spec, fixture, env=env, timeout=1800)

    def upto_stop(tokens):
        for k, t in enumerate(tokens):
            if t in stop:
                return tokens[: k + 1]
        return tokens

    parallel = 0
    for c, prompt, ref in compared(configs, prompts, theirs, part):
        steps = c["gen_length"] // c["block_length"] * c["steps_per_block"]
        config = GenerationConfig.for_model(
            model,
            GenerationConfig(gen_length=c["gen_length"], steps=steps, threshold=c["threshold"]),
            temperature=0.0,
            block_length=c["block_length"],
        )
        ours = fastdllm.generate(model, [prompt], config=config)
        assert upto_stop(ours.sequences[0].tolist()) == upto_stop(ref["tokens"][: c["gen_length"]]), (c, prompt)
        parallel += max(ours.tokens_per_step[0]) > 1
    if not name.startswith("tiny"):  # a trained model: the thresholds did reveal several tokens at once
        assert parallel > 0


needs_v2 = pytest.mark.skipif(
    not (
        V2_REFERENCE
        and V2_PYTHON
        and all(Path(V2_REFERENCE, f).exists() for f in ("generation_functions.py", "modeling.py", "configuration.py"))
    ),
    reason="set FASTDLLM_V2_REFERENCE (v2's generation_functions.py with a checkpoint's modeling files) "
    "and FASTDLLM_V2_PYTHON",
)


@pytest.mark.slow
@needs_v2
def test_fast_dllm_v2_decodes_as_its_own_batch_sample(tiny_v2, tokenizer, tmp_path):
    """Greedy, thresholds from one token at a time to several, sub-blocks of the block and of half of it,
    prompts ending anywhere in a block and on a block boundary (the first token of the next block
    from the prompt's last logit). Not a prompt of exactly one block: batch_sample skips its
    prefill and decodes something else (a defect of the reference; see models/fast_dllm_v2.py)."""
    model = tiny_v2
    blk = model.args.block_size
    folder = save_pretrained(model, tmp_path / "v2", tokenizer, dtype=torch.float32)
    stop = tokenizer.token_to_id("<|eot_id|>")
    texts = [
        "Question: 3 + 4 = ? Answer: the sum",
        "Question: what is 12 + 30?\nAnswer:",
        "Question: 1 + 1",
        "Question: Tom has 5 apples and buys 3 more. How many apples does he",
        "Question: Tom has 5 apples and buys 3 more. How many apples does he have now?\nAnswer:",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len(prompts[3]) % blk == 0 and len(prompts[3]) > blk and all(len(p) != blk for p in prompts)
    # a random model is confident only at a few thousandths: those thresholds reveal several at once
    configs = [
        dict(gen_length=32, threshold=t, sub_block_length=s) for t in (0.9, 0.01, 0.005) for s in (blk, blk // 2)
    ]
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "mask_id": model.mask_token_id,
                "stop": stop,
                "pad": tokenizer.eos_token_id,
                "block_length": blk,
                "prompts": prompts,
                "configs": configs,
            }
        )
    )
    out = subprocess.run(
        [V2_PYTHON, str(V2_RUNNER), V2_REFERENCE, str(folder), str(job)], capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = iter(json.loads(out.stdout.strip().splitlines()[-1])["runs"])
    parallel = 0
    for c in configs:
        config = GenerationConfig.for_model(
            model,
            GenerationConfig(gen_length=c["gen_length"], threshold=c["threshold"], stop_at_eos=False),
            sub_block_length=c["sub_block_length"],
        )
        for prompt in prompts:
            ref = next(theirs)["tokens"]
            out = fastdllm.generate(model, [prompt], config=config)
            ours = out.sequences[0].tolist()
            parallel += max(out.tokens_per_step[0]) > 1
            # the reference decodes to the block boundary after prompt + gen_length - (its lead)
            n = min(len(ref), len(ours))
            if stop in ref[:n]:
                n = ref.index(stop) + 1
            assert ours[:n] == ref[:n], (c, len(prompt))
    assert parallel > 0  # the thresholds did reveal several tokens at once


@pytest.mark.slow
@pytest.mark.skipif(
    not (
        V2_REFERENCE and V2_PYTHON and all(Path(V2_REFERENCE, f).exists() for f in ("modeling.py", "configuration.py"))
    ),
    reason="set FASTDLLM_V2_REFERENCE and FASTDLLM_V2_PYTHON",
)
def test_fast_dllm_v2_block_cache_decodes_as_its_own_generate(tiny_v2, tokenizer, tmp_path):
    """cache="sub-block" against the checkpoints' own `generate(use_block_cache=True)`: unchanged
    over one block (the prompt's last one), and over three with its block cache emptied when a
    block starts (the one line `tests/reference/fast_dllm_v2_block_cache.py` adds; as published it
    reuses the previous block's). Thresholds from one token per step to several."""
    model = tiny_v2
    blk = model.args.block_size
    folder = save_pretrained(model, tmp_path / "v2", tokenizer, dtype=torch.float32)
    stop = tokenizer.token_to_id("<|eot_id|>")
    texts = [
        "Question: 3 + 4 = ? Answer: the sum",
        "Question: what is 12 + 30?\nAnswer:",
        "Question: 1 + 1",
        "Question: Tom has 5 apples and buys 3 more. How many apples does he",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    # a prompt within its first block is decoded without a prefill, one that fills it exactly gets
    # the next block's first token from its last logit
    assert any(len(p) % blk == 0 for p in prompts) and any(len(p) < blk for p in prompts)
    configs = [
        dict(blocks=blocks, threshold=t, sub_block_length=blk // 2, fresh_block_cache=blocks > 1)
        for blocks in (1, 3)
        for t in (0.9, 0.01, 0.005)
    ]
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {"mask_id": model.mask_token_id, "stop": stop, "block_length": blk, "prompts": prompts, "configs": configs}
        )
    )
    runner = Path(__file__).parent / "reference" / "fast_dllm_v2_block_cache.py"
    out = subprocess.run(
        [V2_PYTHON, str(runner), V2_REFERENCE, str(folder), str(job)], capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = iter(json.loads(out.stdout.strip().splitlines()[-1])["runs"])
    parallel = compared = 0
    for c in configs:
        for prompt in prompts:
            ref = next(theirs)["tokens"]
            # the reference's first block is the rest of the prompt's last one
            gen = (c["blocks"] - 1) * blk + (blk - len(prompt) % blk if len(prompt) % blk else blk)
            config = GenerationConfig.for_model(
                model,
                GenerationConfig(
                    gen_length=c["blocks"] * blk, block_length=blk, threshold=c["threshold"], stop_at_eos=False
                ),
                sub_block_length=c["sub_block_length"],
                cache="sub-block",
            )
            out = fastdllm.generate(model, [prompt], config=config)
            ours = out.sequences[0].tolist()[:gen]
            parallel += max(out.tokens_per_step[0]) > 1
            n = min(len(ref), len(ours))
            if stop in ref[:n]:
                n = ref.index(stop) + 1
            compared += n
            assert ours[:n] == ref[:n], (c, len(prompt))
    assert parallel > 0 and compared > 0


@pytest.mark.slow
@pytest.mark.skipif(
    not (LLADA2_REFERENCE and LLADA2_PYTHON and Path(LLADA2_REFERENCE, LLADA2_FILES[1]).exists()),
    reason="set FASTDLLM_LLADA2_REFERENCE (a folder with LLaDA2's modeling files) and FASTDLLM_LLADA2_PYTHON",
)
def test_llada2_logits_and_decoding_equal_its_published_code(tiny_llada2, tokenizer, tmp_path):
    """Logits of whole sequences (masked positions among them) under the block-causal mask, and the
    published generate (quota rule, threshold, stop after the block holding EOS) with its greedy
    sampler against our loop with the exact cache: prompts ending anywhere in a block and on a
    boundary, one token per step and several."""
    model = tiny_llada2
    blk = model.args.block_size
    folder = save_pretrained(model, tmp_path / "llada2", tokenizer, dtype=torch.float32)
    for name in LLADA2_FILES:
        shutil.copy(Path(LLADA2_REFERENCE, name), folder / name)
    eos = model.args.eos_token_id
    texts = [
        "Question: 3 + 4 = ? Answer: the sum",
        "Question: what is 2 + 2?",
        "Question: 1 + 1 =",
        "Question: Tom has 5 apples and buys 3 more. How many apples does he",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    assert any(len(p) % blk == 0 for p in prompts) and len({len(p) % blk for p in prompts}) > 2
    sequences = []
    for p in prompts:
        seq = p + [model.mask_token_id] * (3 * blk - len(p) % blk)
        seq[len(p) + 2 :: 3] = [tokenizer.encode(" 7")[0]] * len(seq[len(p) + 2 :: 3])
        sequences.append(seq)
    # a random model is confident only at a few thousandths: those thresholds reveal several at once
    configs = [dict(gen_length=3 * blk, steps=s, threshold=t) for s in (blk, blk // 2) for t in (0.95, 0.01, 0.004)]
    # each version's own stop rule: 2.0 inside a step, 2.1 (editing on) after the block
    configs += [dict(c, eos_early_stop=True) for c in configs[:3]]
    if "editing_threshold" in Path(LLADA2_REFERENCE, LLADA2_FILES[1]).read_text():  # LLaDA2.1's file
        configs += [
            dict(c, editing_threshold=e, max_post_steps=16, eos_early_stop=stop)
            for c in configs[:3]
            for e in (0.5, 0.0)
            for stop in (False, True)
        ]
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "mask_id": model.mask_token_id,
                "eos_id": eos,
                "block_length": blk,
                "logits": sequences,
                "prompts": prompts,
                "configs": configs,
            }
        )
    )
    out = subprocess.run(
        [LLADA2_PYTHON, str(LLADA2_RUNNER), str(folder), str(job)], capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for seq, theirs in zip(sequences, result["logits"]):
        assert torch.allclose(model(torch.tensor([seq]))[0], torch.tensor(theirs), atol=1e-4, rtol=1e-4)
    runs, parallel = iter(result["runs"]), 0
    model.stop_token_ids = [eos]  # the published loop stops at EOS only
    try:
        for c in configs:
            config = GenerationConfig.for_model(
                model,
                GenerationConfig(
                    gen_length=c["gen_length"],
                    block_length=blk,
                    steps=c["steps"] * c["gen_length"] // blk,
                    threshold=c["threshold"],
                    eos_early_stop=c.get("eos_early_stop", False),
                    editing_threshold=c.get("editing_threshold"),
                    max_post_steps=c.get("max_post_steps", 16),
                ),
            )
            for prompt in prompts:
                ref = next(runs)["tokens"]
                got = fastdllm.generate(model, [prompt], config=config)
                parallel += max(got.tokens_per_step[0]) > 1
                assert got.sequences[0].tolist()[: len(ref)] == ref, (c, len(prompt))
                assert len(ref) == c["gen_length"] or ref[-1] == eos
    finally:
        model.stop_token_ids = tokenizer.stop_token_ids()
    assert parallel > 0


RND1_CHECKOUT = os.environ.get("FASTDLLM_RND1_REFERENCE")
RND1_PYTHON = os.environ.get("FASTDLLM_RND1_PYTHON")
RND1_RUNNER = Path(__file__).parent / "reference" / "rnd1_sample.py"
RND1_LIVE = bool(RND1_CHECKOUT and RND1_PYTHON and Path(RND1_CHECKOUT, "rnd", "sampling.py").exists())
# schedules with more steps than masks (steps that reveal nothing), fewer, and as many; greedy
# (its temperature of 1e-8: every entropy ties at 0) and sampled; its own top-k / top-p; a suffix
RND1_CONFIGS = [
    dict(gen_length=g, steps=s, temperature=t, seed=k)
    for g, s in ((16, 16), (24, 8), (12, 30))
    for t, k in ((0.0, 0), (0.8, 11), (0.3, 2))
]
RND1_CONFIGS += [
    dict(gen_length=16, steps=16, temperature=0.8, seed=3, top_k=5),
    dict(gen_length=16, steps=8, temperature=0.8, seed=4, top_p=0.6),
    dict(gen_length=12, steps=12, temperature=0.0, seed=0, suffix=[7, 8, 9]),
    dict(gen_length=12, steps=6, temperature=0.8, seed=5, suffix=[7, 8, 9]),
]


@live_or_recorded(
    RND1_LIVE, "rnd1", reason="set FASTDLLM_RND1_REFERENCE (vz415/RND1 at 520473c) and FASTDLLM_RND1_PYTHON"
)
@pytest.mark.parametrize("part", PARTS)
def test_rnd1_decodes_as_its_published_sampler(tiny_rnd1, tokenizer, tmp_path, part):
    """RND1's `generate` (`diffusion_sample`: the answer in one block, the lowest-entropy positions
    revealed on its schedule, a pad after the answer) with its own modeling file, on a tiny
    mixture-of-experts checkpoint its classes load strictly: the same tokens and forwards, greedy
    and sampled under the same seed, with its top-k / top-p filters and a suffix (its infilling)."""
    model = tiny_rnd1
    folder = save_pretrained(model, tmp_path / "rnd1", tokenizer, dtype=torch.float32)
    texts = ["Question: 3 + 4 = ? Answer:", "Question: what is 2 + 2?", "Tom has 5 apples and buys 3 more. He has"]
    prompts = [tokenizer.encode(t) for t in texts]
    mask = model.mask_token_id
    sequences = [p + [mask] * 5 + p[:3] + [mask] * 4 for p in prompts]
    spec = {"logits": sequences, "prompts": prompts, "configs": RND1_CONFIGS}
    theirs = _reference_runs(RND1_PYTHON, RND1_RUNNER, RND1_CHECKOUT if RND1_LIVE else None, folder, spec, "rnd1")
    live = _LIVE_RESULTS.get(("rnd1", weights_digest(folder)))
    for seq, logits in zip(sequences, live["logits"] if live else ()):
        ours = model(torch.tensor([seq]))[0]
        assert torch.allclose(ours, torch.tensor(logits), atol=1e-4, rtol=1e-4), (
            (ours - torch.tensor(logits)).abs().max()
        )
    sampled = 0
    for c, prompt, ref in compared(RND1_CONFIGS, prompts, theirs, part):
        # a [MASK] it reveals as a token we never reveal (`RND1Proposal`): the seeds avoid one
        assert mask not in ref["tokens"], ("choose another seed", c, prompt)
        config = GenerationConfig.rnd1(stop_at_eos=False, **{k: tuple(v) if k == "suffix" else v for k, v in c.items()})
        ours = fastdllm.generate(model, [prompt], config=config)
        assert ours.sequences[0].tolist() == ref["tokens"], (c, prompt)
        assert ours.nfe == ref["nfe"], (c, ours.nfe, ref["nfe"])
        sampled += c["temperature"] > 0
    assert sampled > 0


WEDLM_CHECKOUT = os.environ.get("FASTDLLM_WEDLM_REFERENCE")
WEDLM_PYTHON = os.environ.get("FASTDLLM_WEDLM_PYTHON")
WEDLM_RUNNER = Path(__file__).parent / "reference" / "wedlm_decode.py"
WEDLM_LIVE = bool(
    WEDLM_CHECKOUT and WEDLM_PYTHON and Path(WEDLM_CHECKOUT, "wedlm", "engine", "wedlm_decoder.py").exists()
)
# its published settings (window 16, entropy under 0.4, 0.02 per position, greedy, stopping at EOS);
# thresholds that reveal many positions at once, none (one position per step), a steep penalty,
# windows of 4 and 1 (autoregressive), an answer shorter than the window; sampled, with its top-k
# and top-p
_WEDLM = dict(gen_length=24, window_size=16, threshold=0.4, pos_penalty_factor=0.02, temperature=0.0, seed=0)
WEDLM_CONFIGS = [
    dict(_WEDLM, stop_at_eos=True),
    dict(_WEDLM, stop_at_eos=False),
    dict(_WEDLM, threshold=3.0, window_size=4, stop_at_eos=False),
    dict(_WEDLM, threshold=None, window_size=8, gen_length=20, stop_at_eos=False),
    dict(_WEDLM, threshold=3.0, pos_penalty_factor=0.5, stop_at_eos=False),
    dict(_WEDLM, gen_length=6, stop_at_eos=False),
    dict(_WEDLM, window_size=1, gen_length=12, stop_at_eos=True),
    dict(_WEDLM, threshold=1.0, temperature=0.8, seed=3, stop_at_eos=False),
    dict(_WEDLM, threshold=1.0, temperature=0.8, seed=4, top_k=5, stop_at_eos=False),
    dict(_WEDLM, threshold=1.0, temperature=0.8, seed=5, top_p=0.6, stop_at_eos=True),
]
WEDLM_QK_NORM_CONFIGS = [
    dict(_WEDLM, stop_at_eos=False),
    dict(_WEDLM, threshold=1.0, temperature=0.8, seed=6, stop_at_eos=True),
]


def wedlm_model(tokenizer, layout: str):
    """A tiny WeDLM of seeded random weights in its Qwen2.5 layout (q/k/v biases) or its Qwen3
    layout (q/k norms, a head width of its own), its output head sharpened (many entropies under
    the thresholds) and EOS made likelier (answers that stop)."""
    from tests.conftest import random_model

    if layout == "qwen2.5":
        model = random_model("wedlm", tokenizer, seed=8, n_heads=4, n_kv_heads=2, qkv_bias=True)
    else:
        model = random_model("wedlm", tokenizer, seed=9, n_heads=4, n_kv_heads=2, head_size=16, qk_norm=True)
    with torch.no_grad():
        model.output.weight.mul_(6.0)
        model.output.weight[model.args.eos_token_id].mul_(2.0)
    return model


@live_or_recorded(
    WEDLM_LIVE,
    "wedlm",
    "wedlm_qk_norm",
    reason="set FASTDLLM_WEDLM_REFERENCE (a Tencent/WeDLM checkout) and FASTDLLM_WEDLM_PYTHON",
)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("layout", ["qwen2.5", "qwen3"])
def test_wedlm_decodes_as_its_engines_decoder(tokenizer, tmp_path, part, layout):
    """WeDLM's sliding window as its engine decodes (`wedlm_decoder.py`, `sampler.py`, with its own
    transformers model): the same logits, and the same tokens greedy and sampled under the same
    seed, with two forwards fewer per answer (its separate prefill, and its forward that only prunes
    the window's last final tokens: `engine.decode.wedlm`); greedy rows in a batch decode as alone."""
    model = wedlm_model(tokenizer, layout)
    folder = save_pretrained(model, tmp_path / "wedlm", tokenizer, dtype=torch.float32)
    texts = ["Question: 3 + 4 = ? Answer:", "Question: what is 2 + 2?", "Tom has 5 apples and buys 3 more. He has"]
    prompts = [tokenizer.encode(t) for t in texts]
    mask = model.mask_token_id
    # sequences with no mask before a token: plain causal attention in both (the reference's forward)
    sequences = [p + p[:4] + [mask] * 5 for p in prompts]
    configs = WEDLM_CONFIGS if layout == "qwen2.5" else WEDLM_QK_NORM_CONFIGS
    fixture = "wedlm" if layout == "qwen2.5" else "wedlm_qk_norm"
    spec = {"logits": sequences, "prompts": prompts, "configs": configs}
    code = WEDLM_CHECKOUT if WEDLM_LIVE else None
    theirs = list(_reference_runs(WEDLM_PYTHON, WEDLM_RUNNER, code, folder, spec, fixture))
    live = _LIVE_RESULTS.get((fixture, weights_digest(folder)))
    for seq, logits in zip(sequences, live["logits"] if live else ()):
        ours = model(torch.tensor([seq]))[0]
        assert torch.allclose(ours, torch.tensor(logits), atol=1e-4, rtol=1e-4), (
            (ours - torch.tensor(logits)).abs().max()
        )
    eos = model.args.eos_token_id
    runs = iter(theirs)
    stopped = parallel = 0
    for c, prompt, ref in compared(configs, prompts, runs, part):
        config = GenerationConfig.wedlm(**c)
        ours = fastdllm.generate(model, [prompt], config=config)
        tokens = ours.sequences[0].tolist()
        n = len(ref["tokens"])
        assert tokens[:n] == ref["tokens"], (c, prompt)
        assert tokens[n:] == [eos] * (c["gen_length"] - n)  # after a stop: EOS
        assert ours.nfe == ref["nfe"] - 2, (c, ours.nfe, ref["nfe"])
        stopped += n < c["gen_length"]
        parallel += max(ours.tokens_per_step[0]) > 1
    if part == "all" and layout == "qwen2.5":
        assert stopped and parallel  # some answers stopped at EOS, some steps revealed several positions
        # greedy rows in one batch: each as the reference decoded it alone
        for k, c in enumerate(configs):
            refs = theirs[k * len(prompts) : (k + 1) * len(prompts)]
            if c["temperature"] == 0:
                batch = fastdllm.generate(model, prompts, config=GenerationConfig.wedlm(**c))
                for row, ref in zip(batch.sequences.tolist(), refs):
                    assert row[: len(ref["tokens"])] == ref["tokens"], c


@pytest.mark.slow
@pytest.mark.skipif(
    not WEDLM_LIVE, reason="set FASTDLLM_WEDLM_REFERENCE (a Tencent/WeDLM checkout) and FASTDLLM_WEDLM_PYTHON"
)
def test_a_checkpoint_wedlms_own_classes_made_decodes_as_its_engine(tokenizer, tmp_path):
    """A tiny checkpoint WeDLM's transformers classes make and save (its config's own defaults
    written out: q/k/v biases, no q/k norm) loads here and decodes as its engine's decoder does."""
    folder = tmp_path / "made"
    folder.mkdir()
    tokenizer.save(folder)
    config = dict(
        vocab_size=tokenizer.vocab_size + 64 - tokenizer.vocab_size % 64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        mask_token_id=tokenizer.token_to_id("<|mdm_mask|>"),
        eos_token_id=tokenizer.eos_token_id,
    )
    prompts = [tokenizer.encode(t) for t in ("Question: 3 + 4 = ? Answer:", "Tom has 5 apples")]
    configs = [dict(_WEDLM, stop_at_eos=False), dict(_WEDLM, threshold=3.0, window_size=4, stop_at_eos=False)]
    spec = {"make": {"seed": 0, "config": config}, "logits": [p + p for p in prompts], "prompts": prompts}
    spec["configs"] = configs
    job = tmp_path / "job.json"
    job.write_text(json.dumps(spec))
    out = subprocess.run(
        [WEDLM_PYTHON, str(WEDLM_RUNNER), WEDLM_CHECKOUT, str(folder), str(job)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    model, _ = fastdllm.load(str(folder), dtype="float32")
    assert model.family.name == "WeDLM" and model.args.qkv_bias and not model.args.qk_norm
    for ids, logits in zip(spec["logits"], theirs["logits"]):
        assert torch.allclose(model(torch.tensor([ids]))[0], torch.tensor(logits), atol=1e-4, rtol=1e-4)
    runs = iter(theirs["runs"])
    for c in configs:
        for prompt in prompts:
            ref = next(runs)
            ours = fastdllm.generate(model, [prompt], config=GenerationConfig.wedlm(**c))
            assert ours.sequences[0].tolist()[: len(ref["tokens"])] == ref["tokens"], (c, prompt)
            assert ours.nfe == ref["nfe"] - 2


PEFT_RUNNER = Path(__file__).parent / "reference" / "peft_adapter.py"


def _peft_parity(model, folder, run, inputs) -> None:
    """The recorded PEFT adapter loaded here merged and by name: PEFT's logits and argmax."""
    from safetensors.torch import save_file

    adapter = folder.parent / "adapter"
    adapter.mkdir()
    save_file({k: torch.tensor(v) for k, v in run["adapter"].items()}, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps(run["config"]))
    merged, _ = fastdllm.load(folder, dtype="float32", adapters=[adapter])
    named, _ = fastdllm.load(folder, dtype="float32", lora_modules={"peft": adapter})
    for ids, logits, argmax in zip(inputs, run["logits"], run["argmax"]):
        x = torch.tensor([ids])
        for got in (merged(x)[0], named(x, adapters=["peft"])[0]):
            assert torch.allclose(got[:, :64], torch.tensor(logits), atol=2e-4, rtol=1e-4)
            assert got.argmax(-1).tolist() == argmax
        assert not torch.allclose(model(x)[0, :, :64], torch.tensor(logits), atol=1e-2)  # it adapts


PEFT_INPUTS = ["Question: 3 + 4 = ? Answer:", "Tom has 5 apples and buys 3 more"]


@live_or_recorded(
    FAST_DLLM_LIVE,
    "peft_llada",
    reason="set FASTDLLM_REFERENCE (NVlabs/Fast-dLLM) and FASTDLLM_REFERENCE_PYTHON with peft installed",
)
def test_a_peft_adapter_over_lladas_own_code_gives_its_logits_here(tiny_llada, tokenizer, tmp_path):
    """A LoRA adapter PEFT made over LLaDA's own modeling file (its module names: q_proj, v_proj,
    ff_out), run by PEFT there and by us, merged and by name: the same logits."""
    code = Path(CHECKOUT or "", "llada")
    modeling = code / "model" if FAST_DLLM_LIVE else None
    folder = save_pretrained(tiny_llada, tmp_path / "llada", tokenizer, dtype=torch.float32)
    for f in LLADA_FILES if modeling is not None else ():
        shutil.copy(modeling / f, folder / f)
    inputs = [tokenizer.encode(t) for t in PEFT_INPUTS]
    spec = {"seed": 0, "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "ff_out"], "inputs": inputs, "vocab": 64}
    (run,) = _reference_runs(PYTHON, PEFT_RUNNER, modeling and str(code), folder, spec, "peft_llada")
    _peft_parity(tiny_llada, folder, run, inputs)
    # its output head is adapted too: a batch mixing its rows and the base's decodes each as alone
    from fastdllm.engine.decoder import BlockDecoder

    named, _ = fastdllm.load(folder, dtype="float32", lora_modules={"peft": folder.parent / "adapter"})
    base = GenerationConfig(gen_length=16, block_length=8, threshold=0.5, stop_at_eos=False)
    configs = [base.replace(adapter="peft"), base, base.replace(adapter="peft")]
    decoder = BlockDecoder(named, base)
    rows = [decoder.add([p], config=c)[0] for p, c in zip([inputs[0], inputs[0], inputs[1]], configs)]
    while decoder.active:
        decoder.step()
    for r, p, c in zip(rows, [inputs[0], inputs[0], inputs[1]], configs):
        assert r.answer.tolist() == fastdllm.generate(named, [p], config=c).sequences[0].tolist()


@live_or_recorded(
    SDAR_LIVE,
    "peft_sdar",
    reason="set FASTDLLM_SDAR_REFERENCE (JetAstra/SDAR) and FASTDLLM_SDAR_PYTHON with peft installed",
)
def test_a_peft_adapter_over_sdars_own_code_gives_its_logits_here(tiny_sdar, tokenizer, tmp_path):
    """The same over SDAR's own modeling file (Qwen3 names, block-causal attention as its routine
    masks it), rsLoRA on attention and MLP projections."""
    folder = save_pretrained(tiny_sdar, tmp_path / "sdar", tokenizer, dtype=torch.float32)
    for f in ("configuration_sdar.py", "modeling_sdar.py") if SDAR_LIVE else ():
        shutil.copy(Path(SDAR_CHECKOUT, SDAR_MODEL_FILES, f), folder / f)
    (folder / "fused_linear_diffusion_cross_entropy.py").write_text(
        "class FusedLinearDiffusionCrossEntropyLoss:\n    pass\n"
    )
    inputs = [tokenizer.encode(t) for t in PEFT_INPUTS]
    spec = {"seed": 1, "r": 2, "alpha": 6, "targets": ["k_proj", "o_proj", "up_proj", "down_proj"], "inputs": inputs}
    spec.update(vocab=64, block_size=tiny_sdar.args.block_size)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent / "reference" / "cpu_shims"))
    (run,) = _reference_runs(
        SDAR_PYTHON, PEFT_RUNNER, SDAR_CHECKOUT if SDAR_LIVE else None, folder, spec, "peft_sdar", env
    )
    _peft_parity(tiny_sdar, folder, run, inputs)
