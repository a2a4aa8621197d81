"""docs/guide.md: every Python block runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"


def test_guide_snippets_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 8
    ns: dict[str, object] = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{GUIDE.name} block {i + 1}", "exec"), ns)
        except Exception as exc:  # pragma: no cover - the message is the point
            raise AssertionError(f"docs/guide.md block {i + 1} failed: {exc!r}\n{code}") from exc
