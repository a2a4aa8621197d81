"""The GPU kernels without a GPU: their CUDA compiles, and CuPy builds each once per dtype.

`transfer.kernels._cuda` never imports CuPy; the backend hands its module in. Here a
recording stand-in takes its place, so the tests see exactly which kernels are built,
from which source, with which parameters, and how often. nvcc (where installed, as on
the project's machines) compiles every generated source to PTX with a probe kernel
that calls each device function, so a typo or a type error in a kernel fails here
rather than on the first GPU request. Results on a real GPU: tests/unit/kernels/test_kernels.py
(marked gpu).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from transfer.kernels import REGISTRY, _cuda

NVCC = shutil.which("nvcc")


def _probe(name: str, src: str) -> str:
    """A __global__ kernel calling every __device__ function the source defines (so each is
    code-generated, inline asm included), with arguments of its parameter types."""
    calls = []
    for ret, fn, params in re.findall(r"__device__ __forceinline__ ([\w ]+?) (\w+)\(([^)]*)\)", src):
        args = ", ".join(f"({p.rsplit(' ', 1)[0]})k" for p in params.split(", "))
        calls.append(f"    sink[{len(calls)}] = (double)({fn}({args}));")
    return f'extern "C" __global__ void probe_{name}(double* sink, int k) {{\n' + "\n".join(calls) + "\n}\n"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_every_generated_source_compiles(tmp_path: Path) -> None:
    srcs = _cuda.sources()
    assert {"relu_bfloat16", "gemm_int8", "rows_float16", "normalize_bfloat16"} <= set(srcs)
    unit = "\n".join(f"namespace s_{n} {{\n{s}\n{_probe(n, s)}}}\n" for n, s in srcs.items())
    (tmp_path / "all.cu").write_text(unit)
    run = subprocess.run([NVCC, "-arch=sm_80", "-ptx", "-o", "all.ptx", "all.cu"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    ptx = (tmp_path / "all.ptx").read_text()
    for n in srcs:  # every probe and GEMM really became code
        assert f"probe_{n}" in ptx
    assert "cvt.rn.f16.f32" in ptx and "cvt.f32.f16" in ptx  # the half conversions were emitted
    for dt in ("int8", "float16", "bfloat16"):
        assert f".entry transfer_gemm_{dt}_" in ptx


class _Built:
    """What a kernel constructor was called with; calling it records the call."""

    def __init__(self, fake: "FakeCupy", kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.kind, self.args, self.kwargs, self.calls = kind, args, kwargs, []
        fake.built.append(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return FakeArray((1,), np.float32)


class FakeArray:
    def __init__(self, shape: tuple[int, ...], dtype: Any, strides: tuple[int, ...] | None = None) -> None:
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = strides or tuple(int(s) for s in np.empty(shape, self.dtype).strides)
        self.size = int(np.prod(shape))
        self.ndim = len(shape)

    def view(self, dtype: Any) -> "FakeArray":
        return FakeArray(self.shape, dtype, self.strides)

    def fill(self, v: Any) -> None:
        self.filled = v


class FakeCupy:
    """The part of CuPy's API `_cuda` uses, recording instead of compiling."""

    uint16 = np.uint16

    def __init__(self) -> None:
        self.built: list[_Built] = []
        self.uploads = self.syncs = 0
        stream = SimpleNamespace(synchronize=self._sync)
        self.cuda = SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 0), get_current_stream=lambda: stream)

    def _sync(self) -> None:
        self.syncs += 1

    def ElementwiseKernel(self, *a: Any, **k: Any) -> _Built:  # noqa: N802 (CuPy's name)
        return _Built(self, "elementwise", a, k)

    def ReductionKernel(self, *a: Any, **k: Any) -> _Built:  # noqa: N802
        return _Built(self, "reduction", a, k)

    def RawKernel(self, *a: Any, **k: Any) -> _Built:  # noqa: N802
        return _Built(self, "raw", a, k)

    def asarray(self, a: Any) -> Any:
        self.uploads += 1
        return np.array(a)


def test_constant_tables_are_uploaded_once_per_contents() -> None:
    """normalize's factors and a GEMM's offsets go up once per distinct contents, waited for
    once (any stream may read them after); a table past CONSTANT_BYTES is not kept."""
    cp = FakeCupy()
    a = np.arange(4, dtype=np.float32)
    first = _cuda.constant(a, cp)
    assert np.array_equal(first, a) and (cp.uploads, cp.syncs) == (1, 1)
    assert _cuda.constant(a.copy(), cp) is first and (cp.uploads, cp.syncs) == (1, 1)
    assert np.array_equal(_cuda.constant(a + 1, cp), a + 1) and cp.uploads == 2
    big = np.zeros(_cuda.CONSTANT_BYTES // 8 + 1, np.int64)
    _cuda.constant(big, cp)
    _cuda.constant(big, cp)
    assert cp.uploads == 4 and cp.syncs == 2


def test_kernels_are_built_once_per_dtype_and_reused() -> None:
    cp = FakeCupy()
    x16, y16 = FakeArray((4,), np.float16), FakeArray((4,), np.float16)
    for _ in range(3):
        _cuda.unary("relu", x16, y16, ("float16", "float16"), cp)
    _cuda.unary("relu", FakeArray((4,), np.uint16), FakeArray((4,), np.uint16), ("bfloat16", "bfloat16"), cp)
    _cuda.unary("relu", FakeArray((4,), np.float32), FakeArray((4,), np.float32), ("float32", "float32"), cp)
    assert [b.kind for b in cp.built] == ["elementwise"] * 3  # one per dtype, not per call
    f16, bf16, f32 = cp.built
    assert len(f16.calls) == 3 and len(bf16.calls) == 1
    # 16-bit floats travel as their bits: float16 arrays are viewed as uint16 ...
    args, _ = f16.calls[0]
    assert args[0].dtype == np.uint16 and args[-1].dtype == np.uint16 and args[1].dtype == np.float32
    # ... and the source converts them, computing in float32.
    assert f16.args[0].startswith("uint16 x, float32 a") and "f16_load" in f16.kwargs["preamble"]
    assert "bf16_store" in bf16.kwargs["preamble"] and not re.search(r"\bf16_load\(", bf16.kwargs["preamble"].split("typedef")[1])
    assert f32.args[0].startswith("float32 x") and "typedef float A" in f32.kwargs["preamble"]


def test_gemm_launch_covers_the_grid_and_broadcast_batches() -> None:
    """The int8 GEMM: int32 accumulation in the source; per-batch offsets from strides (a
    broadcast operand's stride-0 batch dimension reads the same matrix for every batch)."""
    cp = FakeCupy()
    a = FakeArray((3, 40, 70), np.int8)  # batch 3, M 40, K 70
    b = FakeArray((3, 70, 20), np.int8, strides=(0, 20, 1))  # one (K, N) matrix broadcast
    bias = FakeArray((20,), np.int32, strides=(0,))
    c = FakeArray((3, 40, 20), np.int32)
    _cuda.gemm(a, b, bias, c, ("int8", "int8", "int32", "int32"), cp)
    (raw,) = cp.built
    assert raw.kind == "raw" and "typedef int A" in raw.args[0] and raw.args[1] == "transfer_gemm_int8_int32"
    (grid, block, args), _ = raw.calls[0]
    assert block == (16, 16) and grid == (2, 3, 3)  # ceil(20/16) column tiles, ceil(40/16) row tiles, 3 batches
    aoff, boff, coff = (np.asarray(x) for x in args[4:7])
    assert aoff.tolist() == [0, 2800, 5600] and boff.tolist() == [0, 0, 0] and coff.tolist() == [0, 800, 1600]
    assert [int(v) for v in args[7:]] == [40, 20, 70, 0, 70, 1, 20, 1, 20, 1, 0]


def test_kernel_run_takes_the_cuda_kernel_only_for_cupy_arrays() -> None:
    k = REGISTRY.lookup("relu", ("bfloat16", "bfloat16"), "gpu")
    assert k.cuda is not None and k.sig == ("bfloat16", "bfloat16")
    seen: list[Any] = []
    fake = type(k)(k.op, k.device_kind, lambda *a: seen.append(("fn", a[-1])), lambda *a: seen.append(("cuda", a[-1])), k.sig)
    fake.run([], [], {}, np)
    fake.run([], [], {}, FakeCupy())
    assert seen[0] == ("fn", np) and seen[1] == ("cuda", ("bfloat16", "bfloat16"))
