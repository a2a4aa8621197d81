"""The README's commands are the ones CI runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_starts_with_the_two_commands() -> None:
    cmds = readme_commands()
    assert len(cmds) >= 2
    assert cmds[0].endswith("transfer-bench")
    assert cmds[1].endswith("python -m pytest && .venv/bin/python -m pytest -m slow")


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_readme_producer_snippet_runs() -> None:
    """The README's example as written, against a real (embedded) daemon that $TRANSFER_ENDPOINT names."""
    import numpy as np

    import transfer

    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)[0]
    assert "/run/user/" not in code  # no one user's path: connect() finds the daemon
    code = code.replace("decode_images()", "np.random.default_rng(0).integers(0, 256, batch.shape, dtype=np.uint8)")
    with transfer.serve_in_process(backend="numpy") as daemon:
        old = os.environ.get("TRANSFER_ENDPOINT")
        os.environ["TRANSFER_ENDPOINT"] = daemon.endpoint
        try:
            exec(compile(code, "README.md", "exec"), {"np": np, "transfer": transfer})
        finally:
            if old is None:
                del os.environ["TRANSFER_ENDPOINT"]
            else:
                os.environ["TRANSFER_ENDPOINT"] = old


def test_benchmark_tables_are_generated_from_the_recorded_results() -> None:
    """docs/benchmarks.md's tables are what bench/results_doc.py makes of bench/results/ (so
    they cannot drift from the files), the page stays a reference of about 300 lines, and
    every result file it names exists."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "bench" / "results_doc.py"), "--check"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= 320
    for rel in re.findall(r"bench/results/[\w./{},*-]+", page):
        name = re.sub(r"\{([^}]*)\}", lambda m: m.group(1).split(",")[0], rel).rstrip(".,)`")
        assert list(ROOT.glob(name)), name


def test_no_doc_narrates_how_it_was_built() -> None:
    """Reference pages describe the product as it is: no work sessions, no issue numbers,
    no file outside the repository."""
    for doc in (ROOT / "docs").glob("*.md"):
        text = doc.read_text()
        assert not re.search(r"\bsession \d{2}\b|\bissue \d+\b|\.\./shared/", text, re.I), doc.name
