"""examples/ as modules for the bench scripts: what they measure is the examples' own code."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def load(name: str) -> Any:
    """examples/<name>.py, imported under a private name."""
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"transfer_example_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
