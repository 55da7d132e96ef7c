"""Run inside a private network namespace (`unshare --net`): Ray binds every interface it finds,
so here it finds only loopback. `fastdllm serve --replicas 2` against one server process: the same
answers to 32 concurrent requests; one replica killed while 32 more arrive; Ray brings it back.
Writes what happened as JSON to argv[1]."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [f"Tom has {a} apples. He buys {b} more apples. How many apples does Tom have now?" for a, b in
             [(5, 3), (7, 2), (4, 9), (12, 6), (3, 3), (8, 1), (10, 5), (6, 7)]]  # fmt: skip


def start(args: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastdllm", "serve", "--dtype", "float32", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server never became ready")


def ask(port: int, question: str) -> tuple:
    body = {"model": "llada-arith", "messages": [{"role": "user", "content": question}], "max_tokens": 64, "seed": 0}
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    except httpx.HTTPError as e:
        return ("error", type(e).__name__)
    if r.status_code != 200:
        return ("status", r.status_code)
    return ("ok", r.json()["choices"][0]["message"]["content"])


def burst(port: int, n: int = 32) -> list[tuple]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: ask(port, QUESTIONS[i % len(QUESTIONS)]), range(n)))


def replica_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ServeReplica:fastdllm"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def main(out: str) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    report: dict = {}
    one = start([], 8101)
    try:
        want = burst(8101)
    finally:
        one.send_signal(signal.SIGTERM)
        one.wait(60)
    many = start(["--replicas", "2"], 8102)
    try:
        t0 = time.time()
        got = burst(8102)
        report["same_answers"] = sum(a == b for a, b in zip(got, want))
        report["answered"] = sum(a[0] == "ok" for a in got)
        report["burst_seconds"] = round(time.time() - t0, 2)
        before = replica_pids()
        report["replicas_before"] = len(before)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            during = pool.submit(burst, 8102)
            time.sleep(0.3)
            os.kill(before[0], signal.SIGKILL)
            t0 = time.time()
            results = during.result(timeout=180)
        report["during_kill"] = {
            "ok": sum(r[0] == "ok" for r in results),
            "failed": [r for r in results if r[0] != "ok"],
            "seconds": round(time.time() - t0, 2),
        }
        deadline, back = time.time() + 180, None
        while time.time() < deadline:
            now = replica_pids()
            if len(now) == 2 and before[0] not in now:
                back = round(time.time() - t0, 1)
                break
            time.sleep(1)
        report["replica_back_after_seconds"] = back
        after = burst(8102, 8)
        report["after"] = sum(r[0] == "ok" for r in after)
    finally:
        many.send_signal(signal.SIGTERM)
        try:
            many.wait(120)
        except subprocess.TimeoutExpired:
            many.kill()
    report["stopped_cleanly"] = many.returncode == 0
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
