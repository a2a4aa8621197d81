"""docs/guide.md: every Python block runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


def test_guide_snippets_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 8
    ns: dict[str, object] = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{GUIDE.name} block {i + 1}", "exec"), ns)
        except Exception as exc:  # pragma: no cover - the message is the point
            raise AssertionError(f"docs/guide.md block {i + 1} failed: {exc!r}\n{code}") from exc


def api_table() -> dict[str, str]:
    """docs/guide.md's API reference: method or property name -> its "waits" column."""
    text = GUIDE.read_text().split("### API reference", 1)[1]
    table = text.split("| method | returns | waits |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, str] = {}
    for row in table.strip().splitlines()[1:]:
        first, *_, waits = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)", first):
            assert name not in out, f"{name} listed twice"
            out[name] = waits
    return out


def test_api_reference_lists_every_method_of_the_three_clients() -> None:
    """The table names exactly the public API, and says which calls are awaited."""
    import inspect

    import transfer
    from transfer.client._session import Session

    table = api_table()
    for cls in (transfer.Client, transfer.TrioClient, transfer.AsyncioClient):
        public = {n for n in dir(cls) if not n.startswith("_")}
        assert set(table) == public, (cls.__name__, set(table) ^ public)
    for name, waits in table.items():
        attr = inspect.getattr_static(Session, name, None)
        wrapped = getattr(attr, "__wrapped__", None)
        awaited = name in ("fence", "close") or (wrapped is not None and wrapped.__name__ == f"_op_{name}")
        assert waits == ("await" if awaited else "at once"), (name, waits)
        if name == "close":
            assert inspect.iscoroutinefunction(transfer.TrioClient.close) and inspect.iscoroutinefunction(transfer.AsyncioClient.close)


def section(title: str) -> str:
    text = GUIDE.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_deployment_excerpts_are_the_example_programs() -> None:
    """Each `py` block of the deployment section is a contiguous run of lines of
    examples/deployment/trainer.py or producer.py (which tests/integration/test_examples.py runs)."""
    here = GUIDE.parent.parent / "examples" / "deployment"
    sources = [(here / name).read_text().splitlines() for name in ("trainer.py", "producer.py")]
    blocks = re.findall(r"```py\n(.*?)```", section("The main deployment"), flags=re.S)
    assert len(blocks) >= 3
    for block in blocks:
        lines = block.rstrip("\n").splitlines()
        assert any(
            src[i : i + len(lines)] == lines for src in sources for i in range(len(src) - len(lines) + 1)
        ), f"not in examples/deployment word for word:\n{block}"


def test_guide_torch_block_runs() -> None:
    import pytest

    pytest.importorskip("torch")
    blocks = re.findall(r"```py\n(.*?)```", section("PyTorch"), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], f"{GUIDE.name} PyTorch block", "exec"), {})


def test_troubleshooting_messages_are_the_code_s() -> None:
    """Every message the troubleshooting table quotes is made by the code, piece by piece
    (placeholders such as N, X, PATH, ADDR:PORT, numbers and '...' stand for what varies)."""
    root = GUIDE.parent.parent
    code = "\n".join(p.read_text() for p in (root / "transfer").rglob("*.py"))
    table = section("Troubleshooting").split("| what you see | why | what to do |", 1)[1]
    checked = 0
    for row in table.strip().splitlines()[1:]:
        seen = row.strip("|").split("|")[0]
        for quote in re.findall(r"`([^`]+)`", seen):
            if " " not in quote:
                continue  # a name (`ShuttingDown`, `pool.drain()`), not a message
            quote = re.sub(r"^\w+: ", "", quote)  # the exception's class name
            for piece in re.split(r"\.\.\.|\b(?:N|X|M|PATH|FILE:LINE|ADDR:PORT|KEY|VALUE|SOURCE|\d+(?:\.\d+)?s?)\b|'[^']*'|Address already in use|ext4", quote):
                piece = piece.strip(" :,()")
                if len(piece) >= 8:
                    assert piece in code, f"{piece!r} (from {quote!r}) is not in transfer/"
                    checked += 1
    assert checked >= 20
