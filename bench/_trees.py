"""Running a benchmark's processes from another checkout (`--baseline DIR`)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def started_from(cwd: str, pythonpath: str) -> Iterator[None]:
    """Processes started inside see this working directory and PYTHONPATH; both restored after.
    (Both matter: `python -m` puts the working directory first on sys.path.)"""
    saved_cwd, saved_path = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(cwd)
    os.environ["PYTHONPATH"] = pythonpath
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path
