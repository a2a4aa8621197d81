"""The package type-checks: `mypy --strict` on transfer/, with pyproject.toml's [tool.mypy].

torch is read as Any whether it is installed or not (follow_imports = "skip"), so the result
is the same with or without the torch and examples extras. The cache lives in the checkout
(.mypy_cache, git-ignored; not a predictable name in the shared temp dir), so a second run only
rechecks what changed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # (mypy --strict over the package: `pytest -m slow`, which CI runs after the default suite)

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_strict_is_clean() -> None:
    pytest.importorskip("mypy", reason="mypy comes with the test extra")
    cache = ROOT / ".mypy_cache"
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "transfer"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )
    assert r.returncode == 0, f"mypy --strict transfer:\n{r.stdout}{r.stderr}"

