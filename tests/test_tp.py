"""Tensor parallelism on torch.distributed: 2 ranks (gloo, loopback) started by torchrun, as users
start them; every family split by `fastdllm.models.tp` against one process."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import REPO

WORKER = Path(__file__).parent / "distributed" / "tp_worker.py"
FAMILIES = [
    "tiny_llada",
    "tiny_dream",
    "tiny_sdar",
    "tiny_v2",
    "tiny_llada2",
    "tiny_llada_moe",
    "tiny_rnd1",
    "tiny_wedlm",
    "tiny_nemotron",
]
QUESTION = "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def torchrun(*args: str, ranks: int = 2, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def run_worker(tmp_path, **env) -> dict:
    out = tmp_path / "tp.json"
    run = torchrun(str(WORKER), str(out), *FAMILIES, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results.pop("ranks_agree") is True
    assert set(results) == set(FAMILIES)
    for name, r in results.items():
        assert r["max_logit_diff"] < 1e-4 and r["same_tokens"], (name, r)
        assert r["all_reduces_per_layer"] == 2  # one after attention, one after the MLP
        assert r["read_parts_equal"]  # a rank reading only its parts from the files gets the same
        assert r["weight_bytes_per_rank"] < r["weight_bytes"]
        for bits, q in r["quantized"].items():  # int8 per channel, int4 in groups of 32 columns
            # A float32 model's int8 / int4 kernels compute in bfloat16 (`quant.linear.kernel_dtype_for`):
            # a row-parallel layer's partial products are rounded to it on each rank before the
            # all-reduce sums them, so the split model is the whole one to bfloat16's precision, not
            # to the bit, and a random tiny model's near-tie may then decide otherwise.
            assert q["max_logit_diff"] < 0.03 * q["max_logit"], (name, bits, q)
    assert results["tiny_llada2"]["kv_heads_per_rank"] == 1 and results["tiny_v2"]["heads_per_rank"] == 2
    # expert parallelism: each rank holds half the routed experts whole, read alone from the files
    for name in ("tiny_llada2", "tiny_llada_moe", "tiny_rnd1"):
        for dispatch, e in results[name]["experts"].items():
            assert e["max_logit_diff"] < 1e-4 and e["same_tokens"] and e["read_parts_equal"], (name, dispatch, e)
            share = e["moe_layer_share"]  # their first layer is dense
            per_layer = {"all_reduce": 2, "all_to_all_single": 4 * share if dispatch == "all-to-all" else 0}
            assert e["collectives_per_layer"] == per_layer, (name, dispatch)  # counts, tokens, ids, outputs
    return results


@pytest.mark.slow
def test_every_family_split_over_two_ranks_decodes_as_one_process(tmp_path):
    """Logits within float32 rounding of the whole model's, the same tokens for a batch of two, and
    every rank deciding alike; GQA with fewer kv heads than ranks (tiny_llada2) included; and the
    same for int8 checkpoints, each rank reading its part of the quantized layers, and for expert
    parallelism with the all-reduce dispatch."""
    results = run_worker(tmp_path, TP_WORKER_BITS="8", TP_WORKER_DISPATCHES="all-reduce")
    assert set(results["tiny_llada2"]["quantized"]) == {"int8"} and set(results["tiny_llada2"]["experts"]) == {
        "all-reduce"
    }


@pytest.mark.slow
def test_int4_checkpoints_and_the_all_to_all_dispatch_split_over_two_ranks(tmp_path):
    results = run_worker(tmp_path)
    assert set(results["tiny_llada_moe"]["quantized"]) == {"int8", "int4"}
    assert set(results["tiny_llada_moe"]["experts"]) == {"all-reduce", "all-to-all"}


@pytest.mark.slow
def test_diffusion_gemma_split_over_two_ranks_decodes_as_one_process(tmp_path):
    """A DiffusionGemma made by transformers' class, split by its own cuts (sliding and full
    layers' heads, the full layers' one K = V head replicated, the dense MLP and every expert by
    hidden units): logits within float32 rounding, the same renoised canvases for a batch of two,
    two all-reduces a layer (attention; both MLPs in one), each rank reading its parts alone."""
    out = tmp_path / "tp.json"
    run = torchrun(str(WORKER), str(out), "tiny_diffusion_gemma", env={"TP_WORKER_BITS": "8"})
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results.pop("ranks_agree") is True
    r = results["tiny_diffusion_gemma"]
    assert r["max_logit_diff"] < 1e-4 and r["same_tokens"] and r["read_parts_equal"], r
    assert r["all_reduces_per_layer"] == 2 and r["heads_per_rank"] == 2
    assert r["weight_bytes_per_rank"] < r["weight_bytes"]
    q = r["quantized"]["int8"]  # its kernels round to bfloat16 on each rank before the sum
    assert q["max_logit_diff"] < 0.03 * q["max_logit"], q


@pytest.mark.slow
def test_generate_with_tp_prints_one_processes_answer():
    one = subprocess.run(
        [sys.executable, "-m", "fastdllm", "generate", "--dtype", "float32", "--json", QUESTION],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    two = torchrun("-m", "fastdllm", "generate", "--tp", "2", "--dtype", "float32", "--json", QUESTION)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert json.loads(two.stdout)["text"] == json.loads(one.stdout)["text"]  # printed once, by rank 0
    wrong = torchrun("-m", "fastdllm", "generate", "--tp", "4", QUESTION)
    assert wrong.returncode != 0 and "tp: 4, but torchrun started 2 processes" in wrong.stderr


@pytest.mark.slow
def test_generate_with_tp_reads_an_image_as_one_process(tmp_path):
    """A DiffusionGemma with a vision tower split over two ranks: `generate --image` prints the
    answer one process prints (each rank reads the picture; the tower is whole on each)."""
    from .test_diffusion_gemma_images import image_checkpoint, picture, with_image_tokens

    image_checkpoint(tmp_path / "model", with_image_tokens())
    picture(40, 60, seed=11).save(tmp_path / "photo.png")
    flags = ["generate", "--model", str(tmp_path / "model"), "--dtype", "float32", "--json", "--seed", "0"]
    flags += ["--max-new-tokens", "16", "--max-denoising-steps", "6", "--image", str(tmp_path / "photo.png"), "what?"]
    one = subprocess.run([sys.executable, "-m", "fastdllm", *flags], capture_output=True, text=True, cwd=REPO)
    two = torchrun("-m", "fastdllm", *flags[:1], "--tp", "2", *flags[1:])
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-3000:])
    assert json.loads(two.stdout)["text"] == json.loads(one.stdout)["text"] and json.loads(one.stdout)["tokens"] > 0


@pytest.mark.slow
def test_chat_with_tp_answers_as_one_process():
    turns = f"{QUESTION}\n/reset\nAnn has 2 pens. She buys 4 more pens. How many pens does Ann have now?\n"
    flags = ["--dtype", "float32", "--no-stats"]
    one = subprocess.run(
        [sys.executable, "-m", "fastdllm", "chat", *flags], input=turns, capture_output=True, text=True, cwd=REPO
    )
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), "-m", "fastdllm", "chat", "--tp", "2", *flags]
    two = subprocess.run(cmd, input=turns, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.count("####") == 2  # two turns, printed once


@pytest.mark.slow
def test_generate_with_expert_parallelism_prints_one_processes_answer():
    flags = ["--model", "llada2-arith", "--dtype", "float32", "--json", QUESTION]
    one = subprocess.run(
        [sys.executable, "-m", "fastdllm", "generate", *flags], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert one.returncode == 0, one.stderr[-3000:]
    for dispatch in ("all-reduce", "all-to-all"):
        two = torchrun("-m", "fastdllm", "generate", "--tp", "2", "--ep", "2", "--ep-dispatch", dispatch, *flags)
        assert two.returncode == 0, two.stderr[-3000:]
        assert json.loads(two.stdout)["text"] == json.loads(one.stdout)["text"], dispatch


def test_ep_must_match_tp(capsys):
    from fastdllm.cli.main import main

    assert main(["generate", "--tp", "2", "--ep", "3", QUESTION]) == 2
    assert "--ep: must be 1 or the --tp ranks (2); got 3" in capsys.readouterr().err


def test_tp_says_how_to_launch_and_which_commands_take_it(capsys, monkeypatch):
    from fastdllm.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["generate", "--tp", "2", QUESTION]) == 2
    assert "torchrun --nproc-per-node 2 -m fastdllm <command> --tp 2" in capsys.readouterr().err
    assert main(["tune", "--tp", "2", "--task", "arith", "--out", "unused"]) == 2
    assert "--tp: this command does not run tensor-parallel (generate, chat" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_with_tp_decodes_every_sample_on_every_rank(tmp_path):
    """Not sharded by sample: both ranks decode all of them with their halves of the model; rank 0
    writes the results, which are one process's."""
    flags = ["--task", "arith", "--limit", "6", "--dtype", "float32"]
    one = subprocess.run(
        [sys.executable, "-m", "fastdllm", "eval", *flags, "--log-samples", str(tmp_path / "1.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    two = torchrun("-m", "fastdllm", "eval", *flags, "--tp", "2", "--log-samples", str(tmp_path / "2.jsonl"))
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    outputs = [
        [json.loads(line)["output"] for line in (tmp_path / f).read_text().splitlines()] for f in ("1.jsonl", "2.jsonl")
    ]
    assert len(outputs[0]) == 6 and outputs[0] == outputs[1]
    assert two.stdout.count("accuracy") == 1  # printed once


# ---- serve --tp ---------------------------------------------------------------------------------
def start(cmd: list[str], port: int, env: dict | None = None) -> subprocess.Popen:
    """A server process (its own process group, so that torchrun and its ranks go together), once
    /ready answers."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env, start_new_session=True
    )
    deadline = time.time() + 180
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("the server never became ready")


def serve_tp(port: int) -> subprocess.Popen:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), "-m", "fastdllm", "serve", "--tp", "2", "--dtype", "float32"]
    return start(cmd + ["--port", str(port), "--max-batch-size", "2"], port, env)


def ask(port: int) -> list[str]:
    """Answers through the official client: plain, streamed, JSON-constrained, several blocks at
    once, and scored."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": QUESTION}]
    out = [client.chat.completions.create(model="llada-arith", messages=msgs, max_tokens=64).choices[0].message.content]
    stream = client.chat.completions.create(model="llada-arith", messages=msgs, max_tokens=64, stream=True)
    out.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    fmt = {"type": "json_object"}
    r = client.chat.completions.create(model="llada-arith", messages=msgs, max_tokens=64, response_format=fmt)
    out.append(r.choices[0].message.content)
    extra = {"parallel_blocks": 2}
    r = client.chat.completions.create(model="llada-arith", messages=msgs, max_tokens=96, extra_body=extra)
    out.append(r.choices[0].message.content)
    r = client.completions.create(model="llada-arith", prompt="Question: 2 + 3?", max_tokens=1, echo=True, logprobs=1)
    out.append(json.dumps([round(x, 3) for x in r.choices[0].logprobs.token_logprobs[1:]]))

    def one(i: int) -> str:  # at once: rows join the running batch at block boundaries
        q = f"Ann has {i + 2} pens. She buys {i + 3} more pens. How many pens does Ann have now?"  # one length
        r = client.chat.completions.create(
            model="llada-arith", messages=[{"role": "user", "content": q}], max_tokens=64
        )
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        out += list(pool.map(one, range(6)))
    return out


@pytest.mark.slow
def test_serve_with_tp_answers_the_openai_client_as_one_process():
    one_port, two_port = free_port(), free_port()
    one = start([sys.executable, "-m", "fastdllm", "serve", "--dtype", "float32", "--port", str(one_port)], one_port)
    try:
        want = ask(one_port)
    finally:
        os.killpg(one.pid, signal.SIGTERM)
        one.wait(60)
    two = serve_tp(two_port)
    try:
        assert ask(two_port) == want
    finally:
        os.killpg(two.pid, signal.SIGTERM)
        two.wait(60)
    assert json.loads(want[2]) is not None and "####" in want[0]


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_requests_with_503_and_stops_the_server():
    port = free_port()
    server = serve_tp(port)
    results: list = []

    def request(i: int) -> None:
        body = {"model": "llada-arith", "prompt": f"Question: Tom has {i} apples.\nAnswer:", "max_tokens": 256}
        body.update(threshold=None, cache="none")  # one token per step: long enough to be cut short
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
            results.append((r.status_code, r.json()))
        except httpx.HTTPError as e:
            results.append((type(e).__name__, None))

    threads = [threading.Thread(target=request, args=(i,)) for i in range(6)]
    try:
        for t in threads:
            t.start()
        time.sleep(2.0)
        ranks = subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True).stdout.split()
        rank1 = [p for p in ranks if "RANK=1" in Path(f"/proc/{p}/environ").read_text(errors="ignore").split("\0")]
        assert len(rank1) == 1
        os.kill(int(rank1[0]), signal.SIGKILL)
        for t in threads:
            t.join(60)
            assert not t.is_alive()  # no request hangs
        server.wait(60)  # and the server stops
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    _, err = server.communicate()
    assert server.returncode != 0
    failed = [body for status, body in results if status == 503]
    assert failed and all(b["error"]["type"] == "server_error" for b in failed), results
    assert all(status in (200, 503) for status, _ in results), results
    assert "a tensor-parallel rank is gone" in failed[0]["error"]["message"]
    assert "a tensor-parallel rank is gone" in err
