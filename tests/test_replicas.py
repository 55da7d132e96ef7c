"""`fastdllm serve --replicas N`: copies of the server behind one endpoint with Ray Serve, run in a
private network namespace that holds only loopback (Ray binds every interface it finds)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

SCENARIO = Path(__file__).parent / "distributed" / "ray_replicas.py"


def private_network_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_two_replicas_answer_as_one_server_and_survive_a_killed_replica(tmp_path):
    pytest.importorskip("ray.serve", reason="the ray extra is not installed: pip install 'fastdllm[ray]'")
    if not private_network_works():
        pytest.skip("needs `unshare --net` (a private network namespace) and `ip`")
    out = tmp_path / "report.json"
    run = subprocess.run(
        ["unshare", "--net", sys.executable, str(SCENARIO), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["replicas_before"] == 2
    assert report["answered"] == 32 and report["same_answers"] == 32  # one server's answers
    during = report["during_kill"]
    # every request came back (none hangs); those that failed got an error, the rest their answer
    assert during["ok"] + len(during["failed"]) == 32 and during["ok"] >= 16, during
    assert report["replica_back_after_seconds"] is not None  # Ray started the replica again
    assert report["after"] == 8 and report["stopped_cleanly"]


def test_replicas_without_ray_say_how_to_install_it(monkeypatch, capsys):
    from fastdllm.cli.main import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    assert main(["serve", "--replicas", "2"]) == 2
    assert "pip install 'fastdllm[ray]'" in capsys.readouterr().err


def test_replicas_refuse_tp(capsys):
    from fastdllm.cli.main import main

    assert main(["serve", "--replicas", "2", "--tp", "2"]) == 2
    assert "--replicas: each replica is one process" in capsys.readouterr().err
