"""The test suite's fake CUDA driver (fakecuda.c): built once per run, loaded by a daemon
through TRANSFER_CUDA_DRIVER, read back through its report file."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fakecuda.c")
_built: Path | None = None


def build() -> Path:
    """The shared library, compiled on first use (a C compiler is already needed for the core)."""
    global _built
    if _built is None or not _built.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
        out = Path(tempfile.mkdtemp(prefix="fakecuda-")) / "libfakecuda.so"
        subprocess.run([cc, "-O2", "-Wall", "-shared", "-fPIC", "-pthread", "-o", str(out), str(SOURCE)], check=True)
        _built = out
    return _built


def report(path: Path) -> dict[str, object]:
    """What the fake wrote: {"violations": [lines], "violation_count": n, and its counts at exit:
    "executed", "launches", "captures", "priority_streams": n}."""
    lines = path.read_text().splitlines() if path.exists() else []
    out: dict[str, object] = {"violations": [ln for ln in lines if ln.startswith("violation:")]}
    for ln in lines:
        key, _, value = ln.partition(" ")
        if value.isdigit() and not ln.startswith("violation:"):
            out["violation_count" if key == "violations" else key] = int(value)
    return out
