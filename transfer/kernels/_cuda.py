"""GPU kernels compiled from CUDA source through CuPy, one build per dtype signature.

Importable and testable without CuPy: nothing here imports it. The CuPy backend
passes its module (`cp`) in, and each `_build_*` is cached per (module, dtypes),
so a kernel is generated and compiled once per dtype (CuPy then caches the
binary per device and on disk).

Every kernel's logic is a `__device__` function in a *preamble*; the CuPy glue
(`ElementwiseKernel`, `ReductionKernel` bodies) only calls it. That keeps all
the arithmetic in complete C++ that `tests/unit/kernels/test_cuda_sources.py` compiles with
nvcc where there is one, with no GPU.

16-bit floats travel as their bits (`uint16` views): CuPy has no bfloat16, and
one conversion path for both halves is simpler than CuPy's `float16` class. They
are loaded to float32 (`f16_load`: the PTX conversion; `bf16_load`: a shift),
computed in float32 and stored rounding to nearest even, as ml_dtypes and
NumPy do. int8 GEMMs accumulate in int32.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import numpy as np

from ._tensors import DTYPES

__all__ = ["CType", "ctype", "storage", "constant", "CONVERSIONS", "elementwise_source", "gemm_source", "sources", "gemm",
           "unary", "cast", "normalize", "reduce_sum", "softmax", "layer_norm", "fill"]


class CType(NamedTuple):
    """How one dtype appears in a CUDA kernel."""

    c: str  # the C type of its storage
    param: str  # CuPy's name for that storage in a kernel's parameter list
    acc: str  # the C type arithmetic on it is done in
    load: str  # C expression template turning storage `{}` into `acc`
    store: str  # C expression template turning an `acc` `{}` into storage


_CTYPES: dict[str, CType] = {
    "float16": CType("unsigned short", "uint16", "float", "f16_load({})", "f16_store({})"),
    "bfloat16": CType("unsigned short", "uint16", "float", "bf16_load({})", "bf16_store({})"),
    "float32": CType("float", "float32", "float", "({})", "({})"),
    "float64": CType("double", "float64", "double", "({})", "({})"),
    "int8": CType("signed char", "int8", "int", "((int)({}))", "((signed char)({}))"),
    "int32": CType("int", "int32", "int", "({})", "({})"),
    "uint8": CType("unsigned char", "uint8", "float", "((float)({}))", "((unsigned char)({}))"),
}


def ctype(dtype: str) -> CType:
    return _CTYPES[dtype]


def constant(table: np.ndarray, cp: Any) -> Any:
    """A small read-only table (normalize's per-channel factors, a batched GEMM's offsets) on
    the current device, uploaded once per distinct contents and kept.

    `cp.asarray` of host memory blocks the issuing thread (a pinned staging buffer, then a
    copy on the current stream); per launch it cost the GPU path its pipelining. The first
    upload waits for its copy, so any stream may read the table from then on. Tables over
    `CONSTANT_BYTES` (a GEMM batched a million ways) are uploaded each time, not kept."""
    if table.nbytes > CONSTANT_BYTES:
        return cp.asarray(table)
    return _constant(cp, cp.cuda.runtime.getDevice(), table.dtype.str, table.shape, table.tobytes())


#: The largest table `constant` keeps (256 of them at most: 16 MiB per device).
CONSTANT_BYTES = 64 << 10


@functools.lru_cache(maxsize=256)
def _constant(cp: Any, device: int, dtype: str, shape: tuple[int, ...], data: bytes) -> Any:
    arr = cp.asarray(np.frombuffer(data, dtype=dtype).reshape(shape))
    cp.cuda.get_current_stream().synchronize()
    return arr


def storage(arr: Any, dtype: str, cp: Any) -> Any:
    """A CuPy array as its kernels see it: 16-bit floats as their uint16 bits (bfloat16 already is)."""
    return arr.view(cp.uint16) if dtype == "float16" else arr


#: Conversions every kernel's preamble starts with (no headers: NVRTC needs none of them).
CONVERSIONS = r"""
__device__ __forceinline__ float f16_load(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f16_store(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float bf16_load(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short bf16_store(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest, ties to even */
    return (unsigned short)(u >> 16);
}
"""


# --- elementwise --------------------------------------------------------------------------------
#: Unary maps computed in the accumulation type `A` (float or double): x -> y.
_UNARY = {
    "relu": "return (v > (A)0 || v != v) ? v : (A)0;",  # NaN stays NaN, as np.maximum(x, 0)
    "gelu": "return (A)0.5 * v * ((A)1 + erf(v * (A)0.70710678118654752));",
    "gelu_tanh": "return (A)0.5 * v * ((A)1 + tanh((A)0.79788456080286536 * (v + (A)0.044715 * v * v * v)));",
    "scale_add": "return a * v + b;",
}


def elementwise_source(name: str, x: str, y: str) -> str:
    """The preamble of a unary kernel `name` from dtype x to dtype y: `<name>_fn(x, a, b)`."""
    cx, cy = ctype(x), ctype(y)
    a = "double" if "double" in (cx.acc, cy.acc) else "float"
    body = _UNARY.get(name, "return v;")  # cast: convert only
    mapped = f"{name}_map((A){cx.load.format('x')}, a, b)"
    return (
        f"{CONVERSIONS}\ntypedef {a} A;\n"
        f"__device__ __forceinline__ A {name}_map(A v, A a, A b) {{ {body} }}\n"
        f"__device__ __forceinline__ {cy.c} {name}_fn({cx.c} x, A a, A b) {{\n"
        f"    return {cy.store.format(mapped)};\n}}\n"
    )


@functools.lru_cache(maxsize=None)
def _build_unary(cp: Any, name: str, x: str, y: str) -> Any:
    cx, cy = ctype(x), ctype(y)
    a = "float64" if "double" in (cx.acc, cy.acc) else "float32"
    return cp.ElementwiseKernel(
        f"{cx.param} x, {a} a, {a} b", f"{cy.param} y", f"y = {name}_fn(x, a, b)",
        f"transfer_{name}_{x}_{y}", preamble=elementwise_source(name, x, y),
    )


def unary(name: str, x: Any, y: Any, sig: tuple[str, str], cp: Any, a: float = 0.0, b: float = 0.0) -> None:
    """y = name(x) (relu, gelu, gelu_tanh, scale_add with a and b, or a cast)."""
    k = _build_unary(cp, name, sig[0], sig[1])
    acc = np.float64 if "float64" in sig else np.float32
    k(storage(x, sig[0], cp), acc(a), acc(b), storage(y, sig[1], cp))


def cast(x: Any, y: Any, sig: tuple[str, str], cp: Any) -> None:
    unary("cast", x, y, sig, cp)


def fill(y: Any, value: float, dtype: str, cp: Any) -> None:
    """A 16-bit float fill: the value's bits, rounded on the host as NumPy rounds."""
    bits = np.array(value, dtype=DTYPES[dtype]).view(np.uint16)
    storage(y, dtype, cp).fill(bits)


def _normalize_source(y: str) -> str:
    cy = ctype(y)
    return (
        f"{CONVERSIONS}\n__device__ __forceinline__ {cy.c} normalize_fn(unsigned char x, float a, float b) {{\n"
        f"    return {cy.store.format('(float)x * a - b')};\n}}\n"
    )


@functools.lru_cache(maxsize=None)
def _build_normalize(cp: Any, y: str) -> Any:
    return cp.ElementwiseKernel(
        "uint8 x, float32 a, float32 b", f"{ctype(y).param} y", "y = normalize_fn(x, a, b)",
        f"transfer_normalize_{y}", preamble=_normalize_source(y),
    )


def normalize(x: Any, a: Any, b: Any, y: Any, ydtype: str, cp: Any) -> None:
    """y = x * a - b in float32 (a = scale/std, b = mean/std, broadcast per channel), stored as ydtype."""
    _build_normalize(cp, ydtype)(x, a, b, storage(y, ydtype, cp))


# --- reductions ---------------------------------------------------------------------------------
def _reduce_source(x: str, y: str) -> str:
    cx, cy = ctype(x), ctype(y)
    a = "double" if "double" in (cx.acc, cy.acc) else "float"
    return (
        f"{CONVERSIONS}\ntypedef {a} A;\n"
        f"__device__ __forceinline__ A sum_load({cx.c} x) {{ return (A){cx.load.format('x')}; }}\n"
        f"__device__ __forceinline__ {cy.c} sum_store(A a, A n) {{ return {cy.store.format('a / n')}; }}\n"
        f"__device__ __forceinline__ A sq_dev({cx.c} x, A m) {{ A d = (A){cx.load.format('x')} - m; return d * d; }}\n"
        f"__device__ __forceinline__ A exp_dev({cx.c} x, A m) {{ return exp((A){cx.load.format('x')} - m); }}\n"
        f"__device__ __forceinline__ A max_of(A a, A b) {{ return (a != a || a > b) ? a : b; }}\n"
    )


@functools.lru_cache(maxsize=None)
def _build_sum(cp: Any, x: str, y: str, mean: bool) -> Any:
    """sum (or mean) of x into y, accumulated in float32 (double for float64)."""
    cx, cy = ctype(x), ctype(y)
    acc = "double" if "double" in (cx.acc, cy.acc) else "float"
    n = "((A)_in_ind.size() / (A)_out_ind.size())" if mean else "(A)1"
    return cp.ReductionKernel(
        f"{cx.param} x", f"{cy.param} y", "sum_load(x)", "a + b", f"y = sum_store(a, {n})", "0",
        f"transfer_{'mean' if mean else 'sum'}_{x}_{y}", reduce_type=acc, preamble=_reduce_source(x, y),
    )


def reduce_sum(x: Any, y: Any, axis: Any, sig: tuple[str, str], cp: Any, mean: bool) -> None:
    _build_sum(cp, sig[0], sig[1], mean)(storage(x, sig[0], cp), storage(y, sig[1], cp), axis=axis)


@functools.lru_cache(maxsize=None)
def _build_rows(cp: Any, x: str) -> tuple[Any, Any, Any, Any]:
    """The reductions softmax and layer norm share, for one dtype: max, sum of exp(x - m),
    mean, and mean of (x - m)^2, each into the accumulation type."""
    cx = ctype(x)
    acc = "float64" if cx.acc == "double" else "float32"
    pre = _reduce_source(x, "float64" if cx.acc == "double" else "float32")
    neg_inf = "-__longlong_as_double(0x7ff0000000000000LL)" if cx.acc == "double" else "-__int_as_float(0x7f800000)"
    k = functools.partial(cp.ReductionKernel, reduce_type=cx.acc, preamble=pre)
    return (
        k(f"{cx.param} x", f"{acc} m", "sum_load(x)", "max_of(a, b)", "m = a", neg_inf, f"transfer_max_{x}"),
        k(f"{cx.param} x, {acc} m", f"{acc} s", "exp_dev(x, m)", "a + b", "s = a", "0", f"transfer_sumexp_{x}"),
        k(f"{cx.param} x", f"{acc} m", "sum_load(x)", "a + b", "m = a / ((A)_in_ind.size() / (A)_out_ind.size())", "0", f"transfer_mean_{x}"),
        k(f"{cx.param} x, {acc} m", f"{acc} v", "sq_dev(x, m)", "a + b", "v = a / ((A)_in_ind.size() / (A)_out_ind.size())", "0", f"transfer_var_{x}"),
    )


def _rows_out_source(x: str) -> str:
    cx = ctype(x)
    xv, gv, bv = (f"(A){cx.load.format(v)}" for v in "xgb")
    soft, norm = cx.store.format(f"exp({xv} - m) / s"), cx.store.format(f"r * {gv} + {bv}")
    return (
        f"{CONVERSIONS}\ntypedef {cx.acc} A;\n"
        f"__device__ __forceinline__ {cx.c} softmax_fn({cx.c} x, A m, A s) {{ return {soft}; }}\n"
        f"__device__ __forceinline__ {cx.c} layer_norm_fn({cx.c} x, A m, A v, {cx.c} g, {cx.c} b, A eps) {{\n"
        f"    A r = ({xv} - m) / sqrt(v + eps);\n"
        f"    return {norm};\n}}\n"
    )


@functools.lru_cache(maxsize=None)
def _build_rows_out(cp: Any, x: str) -> tuple[Any, Any]:
    cx = ctype(x)
    acc = "float64" if cx.acc == "double" else "float32"
    pre = _rows_out_source(x)
    return (
        cp.ElementwiseKernel(f"{cx.param} x, {acc} m, {acc} s", f"{cx.param} y", "y = softmax_fn(x, m, s)", f"transfer_softmax_{x}", preamble=pre),
        cp.ElementwiseKernel(
            f"{cx.param} x, {acc} m, {acc} v, {cx.param} g, {cx.param} b, {acc} eps", f"{cx.param} y",
            "y = layer_norm_fn(x, m, v, g, b, eps)", f"transfer_layer_norm_{x}", preamble=pre,
        ),
    )


def softmax(x: Any, y: Any, axis: int, dtype: str, cp: Any) -> None:
    if y.size == 0:
        return
    mx, sumexp, _, _ = _build_rows(cp, dtype)
    out, _ = _build_rows_out(cp, dtype)
    xs = storage(x, dtype, cp)
    m = mx(xs, axis=axis, keepdims=True)
    s = sumexp(xs, m, axis=axis, keepdims=True)
    out(xs, m, s, storage(y, dtype, cp))


def layer_norm(x: Any, g: Any, b: Any, y: Any, axes: tuple[int, ...], eps: float, dtype: str, cp: Any) -> None:
    if y.size == 0:
        return
    _, _, mean, var = _build_rows(cp, dtype)
    _, out = _build_rows_out(cp, dtype)
    xs = storage(x, dtype, cp)
    m = mean(xs, axis=axes, keepdims=True)
    v = var(xs, m, axis=axes, keepdims=True)
    acc = np.float64 if dtype == "float64" else np.float32
    out(xs, m, v, storage(g, dtype, cp), storage(b, dtype, cp), acc(eps), storage(y, dtype, cp))


# --- GEMM ---------------------------------------------------------------------------------------
TILE = 16
#: The most blocks one grid dimension takes (y and z); larger problems are launched in chunks.
MAX_GRID = 65535


def gemm_source(a: str, y: str, bias: str) -> str:
    """A batched, strided, tiled GEMM with bias: C[z] = A[z] @ B[z] + bias, accumulating in
    float32 (16-bit floats) or int32 (int8). Strides are in elements; per-batch base offsets
    come from arrays, so any broadcast of batch dimensions is one launch."""
    ca, cy, cb = ctype(a), ctype(y), ctype(bias)
    acc = ca.acc
    return (
        f"{CONVERSIONS}\n#define TILE {TILE}\ntypedef {acc} A;\n"
        f'extern "C" __global__ void transfer_gemm_{a}_{y}(\n'
        f"    const {ca.c}* __restrict__ pa, const {ca.c}* __restrict__ pb, const {cb.c}* __restrict__ pbias, {cy.c}* __restrict__ pc,\n"
        "    const long long* __restrict__ aoff, const long long* __restrict__ boff, const long long* __restrict__ coff,\n"
        "    long long M, long long N, long long K, long long m0,\n"
        "    long long sam, long long sak, long long sbk, long long sbn, long long scm, long long scn, long long sbias) {\n"
        "    __shared__ A As[TILE][TILE + 1];\n"
        "    __shared__ A Bs[TILE][TILE + 1];\n"
        "    const int tx = threadIdx.x, ty = threadIdx.y;\n"
        "    const long long row = m0 + (long long)blockIdx.y * TILE + ty;\n"
        "    const long long col = (long long)blockIdx.x * TILE + tx;\n"
        f"    const {ca.c}* a = pa + aoff[blockIdx.z];\n"
        f"    const {ca.c}* b = pb + boff[blockIdx.z];\n"
        "    A acc = (A)0;\n"
        "    for (long long k0 = 0; k0 < K; k0 += TILE) {\n"
        "        const long long ka = k0 + tx, kb = k0 + ty;\n"
        f"        As[ty][tx] = (row < M && ka < K) ? (A){ca.load.format('a[row * sam + ka * sak]')} : (A)0;\n"
        f"        Bs[ty][tx] = (kb < K && col < N) ? (A){ca.load.format('b[kb * sbk + col * sbn]')} : (A)0;\n"
        "        __syncthreads();\n"
        "        #pragma unroll\n"
        "        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Bs[k][tx];\n"
        "        __syncthreads();\n"
        "    }\n"
        "    if (row < M && col < N) {\n"
        f"        acc += (A){cb.load.format('pbias[col * sbias]')};\n"
        f"        pc[coff[blockIdx.z] + row * scm + col * scn] = {cy.store.format('acc')};\n"
        "    }\n"
        "}\n"
    )


@functools.lru_cache(maxsize=None)
def _build_gemm(cp: Any, a: str, y: str, bias: str) -> Any:
    return cp.RawKernel(gemm_source(a, y, bias), f"transfer_gemm_{a}_{y}")


def _elements(arr: Any) -> tuple[int, ...]:
    return tuple(s // arr.itemsize for s in arr.strides)


def gemm(a: Any, b: Any, bias: Any, c: Any, sig: tuple[str, ...], cp: Any) -> None:
    """c[..., M, N] = a[..., M, K] @ b[..., K, N] + bias[N], batch dims already broadcast to c's.

    `sig` is (a, b, bias, c) dtypes; a and b share one. Element strides of any sign-free
    layout (transposed views included) are read in place: no copies."""
    M, N, K = c.shape[-2], c.shape[-1], a.shape[-1]
    batch = c.shape[:-2]
    kern = _build_gemm(cp, sig[0], sig[3], sig[2])
    a, b, bias, c = (storage(arr, dt, cp) for arr, dt in zip((a, b, bias, c), sig))

    def offsets(arr: Any) -> np.ndarray:
        st = _elements(arr)[:-2]
        idx = np.indices(batch, dtype=np.int64).reshape(len(batch), -1) if batch else np.zeros((0, 1), np.int64)
        offs: np.ndarray = (np.asarray(st, dtype=np.int64).reshape(-1, 1) * idx).sum(axis=0, dtype=np.int64).reshape(-1)
        return offs

    offs = [constant(offsets(arr), cp) for arr in (a, b, c)]
    nb = len(offs[0])
    sam, sak = _elements(a)[-2:]
    sbk, sbn = _elements(b)[-2:]
    scm, scn = _elements(c)[-2:]
    (sbias,) = _elements(bias)[-1:]
    i64 = np.int64
    rows = MAX_GRID * TILE
    for z0 in range(0, nb, MAX_GRID):
        z = min(MAX_GRID, nb - z0)
        for m0 in range(0, M, rows):
            grid = (-(-N // TILE), -(-min(rows, M - m0) // TILE), z)
            kern(grid, (TILE, TILE), (
                a, b, bias, c, offs[0][z0:], offs[1][z0:], offs[2][z0:],
                i64(M), i64(N), i64(K), i64(m0), i64(sam), i64(sak), i64(sbk), i64(sbn), i64(scm), i64(scn), i64(sbias),
            ))


#: Every source this module generates, for the nvcc compile test: name -> complete C++.
def sources() -> Mapping[str, str]:
    out: dict[str, str] = {}
    for name in ("relu", "gelu", "gelu_tanh", "scale_add"):
        for dt in ("float16", "bfloat16", "float32", "float64"):
            out[f"{name}_{dt}"] = elementwise_source(name, dt, dt)
    for x, y in (("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "bfloat16"), ("bfloat16", "float64")):
        out[f"cast_{x}_{y}"] = elementwise_source("cast", x, y)
    for y in ("float16", "bfloat16", "float32"):
        out[f"normalize_{y}"] = _normalize_source(y)
    for x, y in (("float16", "float32"), ("bfloat16", "bfloat16"), ("float64", "float64")):
        out[f"reduce_{x}_{y}"] = _reduce_source(x, y)
    for x in ("float16", "bfloat16", "float32", "float64"):
        out[f"rows_{x}"] = _rows_out_source(x)
    for a, y, bias in (("int8", "int32", "int32"), ("float16", "float16", "float16"), ("bfloat16", "bfloat16", "bfloat16")):
        out[f"gemm_{a}"] = gemm_source(a, y, bias)
    return out
