from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdllm.embedded.recipe import build_tokenizer, new_model
from fastdllm.engine.kv.runner import KVRunner
from fastdllm.models.loading import save_pretrained
from fastdllm.models.transformer import ModelArgs

REPO = Path(__file__).resolve().parents[1]

torch.set_num_threads(2)


def sandbox_processes() -> list[str]:
    """Live processes of the uids that this test process's sandbox runs used."""
    import subprocess

    from fastdllm.sandbox.box import own_uids

    uids = own_uids()
    out = subprocess.run(["ps", "-eo", "uid=,stat=,pid="], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if line.split() and int(line.split()[0]) in uids and not line.split()[1].startswith("Z")
    ]


def sandbox_files() -> list[str]:
    """Files owned by one of those uids in the host's shared scratch folders."""
    import os

    from fastdllm.sandbox.box import own_uids

    uids, found = own_uids(), []
    for top in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        for root, dirs, files in os.walk(top):
            keep = []
            for name in dirs + files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if st.st_uid in uids:
                    found.append(os.path.join(root, name))
                # a sandbox uid writes only in folders it owns or that others may write: the rest
                # (a virtual environment, a clone) cannot hold its files and is not walked
                if name in dirs and (st.st_uid in uids or st.st_mode & 0o022):
                    keep.append(name)
            dirs[:] = keep
    return found


@pytest.fixture(scope="session", autouse=True)
def nothing_of_the_sandbox_survives():
    """After the whole suite: no process of a sandbox uid, no file one wrote outside its folder."""
    yield
    import time

    time.sleep(0.2)
    assert sandbox_processes() == []
    assert sandbox_files() == []


# Exactness anchor: caches refreshed at every step must decode as no cache.
class RefreshingRunner(KVRunner):
    """Before every windowed step, refill the cache with a full forward of the current canvas, then
    take the logits from the window: with a fresh cache the window must reproduce the full forward."""

    def logits(self, pages, seq, policy, steps):
        if any(steps):
            super().logits(pages, seq, policy, [0] * len(steps))  # refresh every cached position
            pages.take_work()  # the anchor's own forward: not the policy's work
        return super().logits(pages, seq, policy, steps)


def write_kv(cache, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write row `row`'s K/V (layers, kv_heads, T, head_dim) of columns [lo, lo + T) into a
    `PagedKVCache` as a forward does: pages another holder shares copied first (`own`)."""
    cache.own(row, lo, lo + k.shape[2])
    where = cache.span(row, lo, lo + k.shape[2])
    cache.k[:, :, where] = k
    cache.v[:, :, where] = v


def random_prompts(model, lengths, seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids (no mask token) of the given lengths, for a random model."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, model.args.vocab_size, (n,), generator=g)
        ids[ids == model.mask_token_id] = 0
        out.append(ids.tolist())
    return out


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def random_model(arch: str, tokenizer, seed: int = 0, **overrides):
    """A tiny random model of a family, in fp32, with GQA for Dream (as the real one has)."""
    model = new_model(arch, "micro", tokenizer, seed=seed)
    if overrides:
        args = ModelArgs(**{**model.args.__dict__, **overrides})
        fam = model.family
        torch.manual_seed(seed)
        from fastdllm.models import Transformer

        model = (fam.model_class or Transformer)(
            args, family=fam, config=model.config, stop_token_ids=tokenizer.stop_token_ids()
        )
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    # Norm weights and biases away from their init values, so a mix-up cannot go unnoticed.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(8.0)  # larger weights: sharper distributions, a stricter parity check
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # a router bias that changes which experts are chosen
                b.copy_(torch.randn_like(b) * 0.3)
    assert model.stop_token_ids == tokenizer.stop_token_ids()
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_llada(tokenizer):
    return random_model("llada", tokenizer, seed=1)


@pytest.fixture(scope="session")
def tiny_dream(tokenizer):
    return random_model("dream", tokenizer, seed=2, n_heads=4, n_kv_heads=2)


@pytest.fixture(scope="session")
def tiny_sdar(tokenizer):
    # an explicit head_dim unlike dim // n_heads, as Qwen3's
    return random_model("sdar", tokenizer, seed=3, n_heads=4, n_kv_heads=2, head_size=16, block_size=4)


@pytest.fixture(scope="session")
def tiny_v2(tokenizer):
    return random_model("fast_dllm_qwen", tokenizer, seed=4, n_heads=4, n_kv_heads=2, block_size=8)


@pytest.fixture(scope="session")
def tiny_llada2(tokenizer):
    # head_dim 16 of which 8 rotate; every row of the experts' matrices 16-byte aligned
    return random_model("llada2_moe", tokenizer, seed=5, n_heads=2, n_kv_heads=1, block_size=8)


@pytest.fixture(scope="session")
def tiny_llada_moe(tokenizer):
    return random_model("lladamoe", tokenizer, seed=6, router_bias=True)


@pytest.fixture(scope="session")
def tiny_rnd1(tokenizer):
    return random_model("rnd1", tokenizer, seed=7, n_kv_heads=1)


@pytest.fixture(scope="session")
def tiny_nemotron(tokenizer):
    return random_model("nemotron_labs_diffusion", tokenizer, seed=10, n_heads=4, n_kv_heads=2, head_size=16)


@pytest.fixture(scope="session")
def tiny_llada_dir(tmp_path_factory, tiny_llada, tokenizer):
    return save_pretrained(
        tiny_llada, tmp_path_factory.mktemp("llada"), tokenizer, dtype=torch.float32, max_shard_bytes=20_000
    )


@pytest.fixture(scope="session")
def tiny_dream_dir(tmp_path_factory, tiny_dream, tokenizer):
    return save_pretrained(tiny_dream, tmp_path_factory.mktemp("dream"), tokenizer, dtype=torch.float32)


def run_eagerly(monkeypatch) -> list[tuple]:
    """The fixed-shape step run eagerly (no compile) from now on; the arguments of each of its
    calls, in order."""
    calls = []

    def eager(self):
        def run(*args):
            calls.append(args)
            return self.window_logits_static(*args)

        return run

    from fastdllm.models.transformer import Transformer

    monkeypatch.setattr(Transformer, "graphed_window_logits", eager)
    return calls
