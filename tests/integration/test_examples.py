"""The examples run, in a small configuration, and check their own results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(script: str, *args: str) -> str:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_image_pipeline_small() -> None:
    out = run("image_pipeline.py", "--producers", "3", "--batches", "6", "--batch", "4", "--size", "32", "--backend", "numpy")
    assert "all 18 batches verified" in out


def test_dataloader_comparison_small() -> None:
    pytest.importorskip("torch")
    out = run("dataloader.py", "--batches", "8", "--batch", "4", "--size", "32", "--workers", "2", "--backend", "numpy")
    assert "outputs agree" in out


def test_mlp_forward_small() -> None:
    out = run("mlp_forward.py", "--batches", "20", "--batch", "16", "--backend", "numpy", "--compare")
    assert "max abs error" in out and "one request per operator" in out


def test_image_preprocess_small() -> None:
    out = run("image_preprocess.py", "--batches", "6", "--batch", "4", "--size", "32", "--backend", "numpy")
    assert "all 12 batches verified" in out


def test_deployment_standalone_daemon_trainer_and_producers(tmp_path) -> None:
    """docs/guide.md's main deployment, as separate programs: a transferd process, the
    trainer, two producers started on their own; then the daemon's metrics name them."""
    import os
    import re
    import socket
    import urllib.request

    from transfer.testing import run_daemon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with run_daemon(["--backend", "numpy", "--metrics-port", str(port)]) as d:
        env = {**os.environ, "TRANSFER_ENDPOINT": d.endpoint}
        rendezvous = f"ipc://{d.workdir}/trainer.sock"
        here = EXAMPLES / "deployment"

        def start(script: str, *args: str) -> subprocess.Popen[str]:
            return subprocess.Popen([sys.executable, str(here / script), "--rendezvous", rendezvous, *args],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        procs = [start("trainer.py", "--producers", "2", "--steps", "30"), start("producer.py", "--name", "decoder-0"), start("producer.py", "--name", "decoder-1")]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], outs
        assert "all 30 batches verified" in outs[0] and "per producer [15, 15]" in outs[0], outs[0]
        assert "decoder-0: 15 batches" in outs[1] and "decoder-1: 15 batches" in outs[2]
        assert not (d.workdir / "trainer.sock").exists(), "the trainer leaves its rendezvous socket behind"
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        moved = dict(re.findall(r'^transfer_session_moved_bytes_total\{client="([^"]+)"\} (\S+)$', text, flags=re.M))
        per_batch = 8 * 3 * 64 * 64 * 5  # normalize reads uint8 and writes float32
        assert float(moved["decoder-0"]) == float(moved["decoder-1"]) == 15 * per_batch, moved
        assert re.search(r"^transfer_sessions 0\.0$", text, flags=re.M), "every session ended"
