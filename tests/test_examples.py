"""The examples run, in a small configuration, and check their own results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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
