"""The processes a benchmark starts: from another checkout (`--baseline DIR`), and their CPU time."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

_TICK = os.sysconf("SC_CLK_TCK")


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


def main_thread_cpu_s(pid: int) -> float:
    """utime + stime of the process's main thread, in seconds (`/proc/PID/task/PID/stat`)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK
