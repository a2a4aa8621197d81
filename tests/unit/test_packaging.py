"""`python -m build`: an sdist that builds the native ring, and from it a wheel with all an
install needs (py.typed, the SPDX license, the entry points; torch only in its extras).

Built without build isolation, so with no network: the test extra brings `build` and a
setuptools that knows PEP 639 (pyproject.toml's build-system.requires). The build runs on a
copy of the build's inputs, so the checkout gains no build/ or egg-info. Installing the wheel
and the sdist in fresh venvs needs an index for the dependencies: docs/operations.md has
that check.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: What the build reads: pyproject.toml names README.md and LICENSE, setup.py native/.
INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "native", "transfer")
NATIVE = {f"native/{p.name}" for p in (ROOT / "native").iterdir() if p.suffix in (".c", ".h")}


def _modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "transfer").rglob("*.py")}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("build", reason="`build` comes with the test extra")
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates PEP 639 (the test extra brings >= 77)")
    tmp = tmp_path_factory.mktemp("build")
    src, out = tmp / "src", tmp / "dist"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    src.mkdir()
    for name in INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    # No arguments: the sdist, then the wheel built from the unpacked sdist (so it proves the
    # sdist complete).
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, f"python -m build failed:\n{r.stdout[-4000:]}{r.stderr[-4000:]}"
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


def test_the_sdist_has_the_package_and_the_native_sources(dists: tuple[Path, Path]) -> None:
    with tarfile.open(dists[0]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    want = {"pyproject.toml", "setup.py", "README.md", "LICENSE", "transfer/py.typed"} | NATIVE | _modules()
    assert want <= names, f"missing from the sdist: {sorted(want - names)}"
    assert not {n for n in names if n.startswith("tests/") or n.endswith(".so")}, "tests or binaries in the sdist"


def test_the_wheel_is_typed_licensed_and_has_the_native_ring(dists: tuple[Path, Path]) -> None:
    with zipfile.ZipFile(dists[1]) as zf:
        names = set(zf.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = zf.read(f"{info}/METADATA").decode()
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{info}/entry_points.txt").decode())
    want = {"transfer/py.typed", f"{info}/licenses/LICENSE"} | _modules()
    assert want <= names, f"missing from the wheel: {sorted(want - names)}"
    assert any(n.startswith("transfer/_native.") and n.endswith(".so") for n in names), "the wheel lacks the native core"
    assert "transfer/_native.pyi" in names, "the wheel lacks the native core's stub"
    lines = meta.splitlines()
    assert "License-Expression: Apache-2.0" in lines and "License-File: LICENSE" in lines
    always = [ln for ln in lines if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert always and not [ln for ln in always if any(p in ln for p in ("torch", "cupy", "mypy", "pytest"))], always
    assert dict(entry_points["console_scripts"]) == {
        "transferd": "transfer.cli.transferd:main", "transfer-bench": "transfer.cli.bench:main"}


def test_a_build_without_a_compiler_fails_naming_it(tmp_path: Path) -> None:
    """The native core is required: with no working C compiler the build fails (no package
    without it), and says what is missing and how to get it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "native"):
        path = ROOT / name
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, src / name)  # type: ignore[operator]
    (src / "transfer").mkdir()
    env = {**__import__("os").environ, "CC": "/nonexistent/cc"}
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "t"), "--build-lib", str(tmp_path / "l")],
                       cwd=src, env=env, capture_output=True, text=True, timeout=110)
    assert r.returncode != 0
    assert "cannot build its native core" in r.stderr and "C11 compiler" in r.stderr and "python3-dev" in r.stderr, r.stderr[-2000:]


def test_wheels_are_configured_for_both_architectures() -> None:
    """cibuildwheel builds manylinux wheels for x86_64 and aarch64 (docs/operations.md)."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["cibuildwheel"]
    assert set(cfg["linux"]["archs"]) == {"x86_64", "aarch64"} and "musllinux" in cfg["skip"]
    assert "transfer._native" in cfg["test-command"]
