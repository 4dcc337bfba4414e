"""runtime.cuh and kiln.runtime: NVRTC compile checks (CPU) and GPU checks (-m gpu).

The runtime modules are loaded from this source tree under a private package name
(``_kiln_src``) without running ``kiln/__init__.py``, so this file needs neither the
compiled extension ``kiln._core`` nor an installed kiln. On a GPU machine where kiln is
not built or installed, run it with ``--noconftest`` (tests/conftest.py imports kiln):

    PYTHONPATH=python python3 -m pytest --noconftest -m gpu tests/test_runtime_header.py
"""

from __future__ import annotations

import importlib
import sys
import types
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "rust" / "src" / "codegen" / "runtime.cuh"
KERNEL_DIR = Path(__file__).resolve().parent / "runtime_kernels"
KERNEL_FILES = sorted(KERNEL_DIR.glob("*.cu"))


def _load_runtime() -> types.ModuleType:
    if "_kiln_src" not in sys.modules:
        pkg = types.ModuleType("_kiln_src")
        pkg.__path__ = [str(ROOT / "python" / "kiln")]
        sys.modules["_kiln_src"] = pkg
    return importlib.import_module("_kiln_src.runtime")


rt = _load_runtime()
nvrtc_mod = importlib.import_module("_kiln_src.runtime.nvrtc")
KilnError = importlib.import_module("_kiln_src._errors").KilnError

needs_nvrtc = pytest.mark.skipif(
    not nvrtc_mod.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc not installed"
)


@lru_cache(maxsize=1)
def _gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # no driver
        return f"no CUDA device ({e})"
    return None


def gpu(fn):
    """Mark a test as a GPU test and skip it where CuPy or a device is missing."""
    reason = _gpu_reason()
    fn = pytest.mark.gpu(fn)
    return pytest.mark.skipif(reason is not None, reason=reason or "")(fn)


def source_of(path: Path) -> str:
    """What codegen emits: the header text, then the kernel."""
    return HEADER.read_text() + "\n" + path.read_text()


# --------------------------------------------------------------------------------------
# CPU: NVRTC compile checks


@needs_nvrtc
def test_header_compiles_alone():
    res = rt.compile_cubin(HEADER.read_text(), "runtime.cuh")
    assert res.cubin[:4] == b"\x7fELF"


@needs_nvrtc
@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.name for p in KERNEL_FILES])
def test_runtime_kernels_compile_without_spills(path):
    res = rt.compile_cubin(source_of(path), path.name, arch="sm_90")
    assert res.cubin[:4] == b"\x7fELF"
    assert res.registers, f"ptxas reported no entry functions:\n{res.log}"
    assert "warning" not in res.log.lower(), res.log
    spilled = {k: v for k, v in res.spills.items() if v}
    assert not spilled, f"spills in {path.name}: {spilled}"
    for k, regs in res.registers.items():
        assert 0 < regs <= 255, (k, regs)


def test_kernel_files_cover_the_runtime():
    text = "\n".join(p.read_text() for p in KERNEL_FILES)
    for fn in (
        "abs neg exp log sqrt rsqrt reciprocal sin cos tanh sigmoid relu pow maximum minimum "
        "cast loadVec storeVec blockReduce blockAllReduce gridReduce gridReduceSerial ceilDiv "
        "to_float from_float"
    ).split():
        assert f"kiln::{fn}" in text, fn
    for dtype in ("bool", "int", "int64_t", "__half", "__nv_bfloat16", "float", "double"):
        assert "cast_from_" in text and dtype in text


@needs_nvrtc
def test_compile_error_names_the_line():
    src = HEADER.read_text() + '\nextern "C" __global__ void bad(float* a) {\n  a[0] = undefined_thing;\n}\n'
    bad_line = src.splitlines().index("  a[0] = undefined_thing;") + 1
    with pytest.raises(KilnError) as ei:
        rt.compile_cubin(src, "bad.cu")
    msg = str(ei.value)
    assert "undefined_thing" in msg
    assert f"bad.cu({bad_line})" in msg
    assert f">{bad_line:6d} |" in msg


@needs_nvrtc
def test_mangled_names_and_name_expressions():
    src = HEADER.read_text() + "\n__global__ void plain_cpp(float* a) { a[threadIdx.x] = kiln::exp(a[0]); }\n"
    res = rt.compile_cubin(src, "cpp.cu", name_expressions=["plain_cpp"])
    low = res.lowered_names["plain_cpp"]
    assert low.startswith("_Z")
    assert res.registers["plain_cpp"] == res.registers[low]


def test_the_floored_log_sum_exp_threshold_is_above_the_floor_in_float():
    """``kiln::lseAddBlockRaised`` skips raising a block's elements when its maximum is far
    enough above -2^32 that a raised element's term is zero. The threshold must stay above
    the floor once rounded to float (spacing 512 at 2^32): -2^32 + 128 rounded back onto it,
    and rows masked whole with -1e30 then summed to a fifth of their count on the GPU."""
    import re

    src = HEADER.read_text()
    body = src[src.index("lseAddBlockRaised(LseAcc<T> a"):]
    m = re.search(r"m >= T\(-4294967296\.0 \+ ([0-9.]+)\)", body)
    assert m, "threshold not found"
    margin = float(m.group(1))
    floor = np.float32(-4294967296.0)
    threshold = np.float32(-4294967296.0 + margin)
    assert threshold > floor
    # A raised element's term at the threshold is zero in float, as its raw term is.
    assert np.exp(np.float64(floor) - np.float64(threshold)) < np.finfo(np.float32).tiny


def test_parse_ptxas_log():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function '_Z2k2Pf' for 'sm_90'
ptxas info    : Function properties for _Z2k2Pf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
"""
    stats = nvrtc_mod.parse_ptxas_log(log)
    assert stats["k1"] == {
        "entry": 1,
        "registers": 40,
        "spill_stores": 4,
        "spill_loads": 12,
        "stack_frame": 8,
    }
    assert stats["_Z2k2Pf"]["registers"] == 10


def test_runtime_imports_without_core():
    assert "_kiln_src._core" not in sys.modules
    assert rt.cuda_include_dir() is None or (Path(rt.cuda_include_dir()) / "cuda_fp16.h").is_file()


# --------------------------------------------------------------------------------------
# GPU


def _executor():
    return importlib.import_module("_kiln_src.runtime.executor")


def _kernel(file: str, name: str):
    return _executor().load_module(source_of(KERNEL_DIR / file), name)


def _launch(kernel, grid, block, smem, args):
    _executor().launch(kernel, grid, block, smem, args)


BLOCK_CASES = [
    # (mask, block dims): covers warp-multiple, sub-warp power-of-two and generic paths
    ("100", (64, 2, 2)),
    ("100", (32, 4, 1)),
    ("100", (16, 4, 2)),
    ("100", (7, 3, 5)),
    ("100", (1024, 1, 1)),
    ("010", (1, 64, 2)),
    ("010", (4, 8, 4)),
    ("001", (2, 2, 16)),
    ("001", (1, 1, 32)),
    ("110", (32, 32, 1)),
    ("110", (3, 5, 4)),
    ("101", (4, 1, 8)),
    ("101", (4, 3, 8)),
    ("011", (1, 8, 8)),
    ("011", (3, 4, 4)),
    ("111", (8, 4, 4)),
    ("111", (5, 5, 5)),
]
BLOCK_DTYPES = [
    # (op, dtype name, numpy dtype, input generator)
    ("sum", "f32", np.float32, lambda rng, n: rng.random(n, dtype=np.float32)),
    ("max", "f32", np.float32, lambda rng, n: rng.standard_normal(n).astype(np.float32)),
    ("min", "f32", np.float32, lambda rng, n: rng.standard_normal(n).astype(np.float32)),
    ("sum", "f64", np.float64, lambda rng, n: rng.standard_normal(n)),
    ("sum", "f16", np.float16, lambda rng, n: rng.integers(0, 2, n).astype(np.float16)),
    ("sum", "i64", np.int64, lambda rng, n: rng.integers(-1000, 1000, n)),
    ("max", "i32", np.int32, lambda rng, n: rng.integers(-(2**30), 2**30, n).astype(np.int32)),
]
NP_OPS = {"sum": np.sum, "max": np.max, "min": np.min}


def _block_reference(x, nblocks, dims, mask, op):
    bx, by, bz = dims
    a = x.astype(np.float64 if x.dtype.kind == "f" else np.int64).reshape(nblocks, bz, by, bx)
    axes = tuple(ax for ax, flag in zip((3, 2, 1), mask) if flag == "1")
    r = NP_OPS[op](a, axis=axes, keepdims=True)
    return r, r.reshape(nblocks, -1)


@gpu
def test_gpu_block_reduce():
    import cupy as cp

    rng = np.random.default_rng(0)
    nblocks = 3
    failures = []
    for op, dname, npdt, gen in BLOCK_DTYPES:
        for mask, dims in BLOCK_CASES:
            nthreads = int(np.prod(dims))
            x = np.asarray(gen(rng, nblocks * nthreads)).astype(npdt)
            full, ref = _block_reference(x, nblocks, dims, mask, op)
            smem = nthreads * x.itemsize
            for kind in ("reduce", "allreduce"):
                k = _kernel("block_reduce.cu", f"block_{kind}_{op}_{dname}_{mask}")
                out_n = ref.size if kind == "reduce" else x.size
                d_in, d_out = cp.asarray(x), cp.zeros(out_n, dtype=npdt)
                _launch(k, (nblocks, 1, 1), dims, smem, [d_in, d_out])
                got = cp.asnumpy(d_out).astype(np.float64)
                want = ref if kind == "reduce" else np.broadcast_to(full, (nblocks, *dims[::-1]))
                want = np.asarray(want, dtype=np.float64).reshape(-1)
                rtol = 1e-5 if npdt == np.float32 else 1e-12
                if not np.allclose(got, want, rtol=rtol, atol=0):
                    failures.append((kind, op, dname, mask, dims, np.abs(got - want).max()))
    # bf16 max through uint16 bits
    for mask, dims in BLOCK_CASES:
        nthreads = int(np.prod(dims))
        x = rng.standard_normal(nblocks * nthreads).astype(np.float32)
        bits = _f32_to_bf16_bits(x)
        xb = _bf16_bits_to_f32(bits)
        _, ref = _block_reference(xb, nblocks, dims, mask, "max")
        k = _kernel("block_reduce.cu", f"block_reduce_max_bf16_{mask}")
        d_out = cp.zeros(ref.size, dtype=cp.uint16)
        _launch(k, (nblocks, 1, 1), dims, nthreads * 2, [cp.asarray(bits), d_out])
        got = _bf16_bits_to_f32(cp.asnumpy(d_out)).astype(np.float64)
        if not np.array_equal(got, ref.reshape(-1)):
            failures.append(("reduce", "max", "bf16", mask, dims))
    # the two-template-argument form (x only)
    dims = (48, 3, 2)
    x = rng.random(2 * 48 * 6, dtype=np.float32)
    _, ref = _block_reference(x, 2, dims, "100", "sum")
    k = _kernel("block_reduce.cu", "block_reduce_x_default_f32")
    d_out = cp.zeros(ref.size, dtype=cp.float32)
    _launch(k, (2, 1, 1), dims, 48 * 6 * 4, [cp.asarray(x), d_out])
    if not np.allclose(cp.asnumpy(d_out), ref.reshape(-1), rtol=1e-5):
        failures.append(("default", dims))
    assert not failures, failures


def _f32_to_bf16_bits(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def _bf16_bits_to_f32(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@gpu
def test_gpu_grid_sum_1m_both_protocols():
    import cupy as cp

    rng = np.random.default_rng(1)
    n = 1 << 20
    x = rng.random(n, dtype=np.float32)
    want = x.astype(np.float64).sum()
    d_in = cp.asarray(x)
    grid, block = (264, 1, 1), (256, 1, 1)
    smem = 256 * 4
    results = {}
    for name, work_elems, runs in (("grid_sum_f32", 264, 3), ("grid_sum_serial_f32", 1, 10)):
        k = _kernel("grid_reduce.cu", name)
        work = cp.full(work_elems, np.nan, dtype=cp.float32)  # no initialisation needed
        sems = cp.zeros(1, dtype=cp.int64)
        outs = []
        for _ in range(runs):
            out = cp.zeros(1, dtype=cp.float32)
            _launch(k, grid, block, smem, [d_in, out, work, sems, np.int64(n)])
            cp.cuda.Device().synchronize()
            assert int(sems.get()[0]) == 0, f"{name}: semaphore not reset"
            outs.append(float(out.get()[0]))
        results[name] = outs
        np.testing.assert_allclose(outs, want, rtol=1e-5)
    # the serial protocol combines in blockIdx order: bitwise deterministic
    assert len(set(results["grid_sum_serial_f32"])) == 1


@gpu
def test_gpu_grid_row_reductions_semaphores_reset():
    import cupy as cp

    rng = np.random.default_rng(2)
    rows, cols = 1001, 4999
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    d_in = cp.asarray(x)
    bx, by, gx = 32, 4, 8
    gy = -(-rows // by)
    for op, ref in (("sum", x.astype(np.float64).sum(1)), ("max", x.max(1).astype(np.float64))):
        for serial in (False, True):
            name = f"grid_row{op}{'_serial' if serial else ''}_f32"
            k = _kernel("grid_reduce.cu", name)
            work = cp.full(gy * by * (1 if serial else gx), np.nan, dtype=cp.float32)
            sems = cp.zeros(gy, dtype=cp.int64)
            runs = 10 if serial else 3
            first = None
            for _ in range(runs):
                out = cp.full(rows, np.nan, dtype=cp.float32)
                _launch(
                    k,
                    (gx, gy, 1),
                    (bx, by, 1),
                    bx * by * 4,
                    [d_in, out, work, sems, np.int64(rows), np.int64(cols)],
                )
                got = cp.asnumpy(out)
                assert not cp.any(sems != 0), f"{name}: semaphores not all zero after a run"
                np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3, err_msg=name)
                if serial:
                    first = got if first is None else first
                    assert np.array_equal(first, got), f"{name} not deterministic"


MATH_FUNCS = [
    ("abs", lambda x, y: np.abs(x)),
    ("neg", lambda x, y: -x),
    ("exp", lambda x, y: np.exp(x)),
    ("log", lambda x, y: np.log(x)),
    ("sqrt", lambda x, y: np.sqrt(x)),
    ("rsqrt", lambda x, y: 1 / np.sqrt(x)),
    ("reciprocal", lambda x, y: 1 / x),
    ("sin", lambda x, y: np.sin(x)),
    ("cos", lambda x, y: np.cos(x)),
    ("tanh", lambda x, y: np.tanh(x)),
    ("sigmoid", lambda x, y: 1 / (1 + np.exp(-x))),
    ("relu", lambda x, y: np.where(x <= 0, 0.0, x)),
    ("pow", lambda x, y: np.power(x, y)),
    ("maximum", lambda x, y: np.maximum(x, y)),
    ("minimum", lambda x, y: np.minimum(x, y)),
    ("add", lambda x, y: x + y),
    ("sub", lambda x, y: x - y),
    ("mul", lambda x, y: x * y),
    ("div", lambda x, y: x / y),
    ("where_lt", lambda x, y: np.where(x < y, x, y)),
]


@gpu
def test_gpu_math_all_dtypes():
    import cupy as cp

    rng = np.random.default_rng(3)
    n = 4096
    x64 = rng.uniform(-3, 3, n)
    y64 = rng.uniform(-3, 3, n)
    y64[::7] = np.round(y64[::7])  # integral exponents for negative bases
    x64[0], y64[1] = np.nan, np.nan
    failures = []
    for dname, npdt, rtol, atol in (
        ("f32", np.float32, 2e-6, 1e-6),
        ("f64", np.float64, 1e-13, 1e-13),
        ("f16", np.float16, 2e-3, 1e-3),
        ("bf16", None, 1.6e-2, 1e-2),
    ):
        if npdt is None:
            xb, yb = _f32_to_bf16_bits(x64.astype(np.float32)), _f32_to_bf16_bits(y64.astype(np.float32))
            x, y = _bf16_bits_to_f32(xb).astype(np.float64), _bf16_bits_to_f32(yb).astype(np.float64)
            d_x, d_y = cp.asarray(xb), cp.asarray(yb)
            d_out = cp.zeros(len(MATH_FUNCS) * n, dtype=cp.uint16)
        else:
            x, y = x64.astype(npdt).astype(np.float64), y64.astype(npdt).astype(np.float64)
            d_x, d_y = cp.asarray(x64.astype(npdt)), cp.asarray(y64.astype(npdt))
            d_out = cp.zeros(len(MATH_FUNCS) * n, dtype=npdt)
        _launch(
            _kernel("math.cu", f"math_{dname}"),
            ((n + 255) // 256, 1, 1),
            (256, 1, 1),
            0,
            [d_x, d_y, d_out, np.int64(n)],
        )
        out = cp.asnumpy(d_out)
        got_all = (
            (_bf16_bits_to_f32(out) if npdt is None else out).astype(np.float64).reshape(len(MATH_FUNCS), n)
        )
        with np.errstate(all="ignore"):
            for k, (fname, ref) in enumerate(MATH_FUNCS):
                want = ref(x, y)
                if npdt is not None:
                    want = want.astype(npdt).astype(np.float64)
                else:
                    want = _bf16_bits_to_f32(_f32_to_bf16_bits(want.astype(np.float32))).astype(np.float64)
                big = np.abs(want) > 1e4  # reciprocal/div near zero: relative only
                ok = np.isclose(got_all[k], want, rtol=rtol, atol=atol, equal_nan=True)
                ok |= big & np.isclose(got_all[k], want, rtol=rtol * 4, atol=0)
                if not ok.all():
                    i = int(np.argmin(ok))
                    failures.append((dname, fname, x[i], y[i], got_all[k][i], want[i]))
    assert not failures, failures


@gpu
def test_gpu_math_integers():
    import cupy as cp

    rng = np.random.default_rng(4)
    n = 1000
    for dname, npdt in (("i32", np.int32), ("i64", np.int64)):
        x = rng.integers(-20, 20, n).astype(npdt)
        y = rng.integers(0, 6, n).astype(npdt)
        d_out = cp.zeros(11 * n, dtype=npdt)
        _launch(
            _kernel("math.cu", f"math_{dname}"),
            (4, 1, 1),
            (256, 1, 1),
            0,
            [cp.asarray(x), cp.asarray(y), d_out, np.int64(n)],
        )
        got = cp.asnumpy(d_out).reshape(11, n)
        want = [
            np.abs(x),
            -x,
            np.maximum(x, 0),
            np.power(x, y),
            np.maximum(x, y),
            np.minimum(x, y),
            x + y,
            x - y,
            x * y,
            np.where(x >= y, x, y),
        ]
        for k, w in enumerate(want):
            np.testing.assert_array_equal(got[k], w.astype(npdt), err_msg=f"{dname} #{k}")
        pos = x >= 0
        np.testing.assert_array_equal(got[10][pos], (x[pos] + 2) // 3)


CAST_TYPES = [
    ("bool", np.bool_),
    ("i32", np.int32),
    ("i64", np.int64),
    ("f16", np.float16),
    ("bf16", None),
    ("f32", np.float32),
    ("f64", np.float64),
]


def _to_host_values(arr, npdt):
    return _bf16_bits_to_f32(arr).astype(np.float64) if npdt is None else arr.astype(np.float64)


def _convert(v64, npdt):
    """Reference conversion of float64 values (already representable in the source type)."""
    if npdt is None:
        return _bf16_bits_to_f32(_f32_to_bf16_bits(v64.astype(np.float32))).astype(np.float64)
    if npdt == np.bool_:
        return (v64 != 0).astype(np.float64)
    return v64.astype(npdt).astype(np.float64)


@gpu
def test_gpu_casts_all_pairs():
    import cupy as cp

    base = np.array([-3.7, -1.0, -0.5, 0.0, 0.25, 1.0, 2.5, 3.5, 100.3, 1000.7, -255.9, 7.0])
    n = base.size
    failures = []
    for sname, sdt in CAST_TYPES:
        src64 = _convert(base, sdt)
        if sdt is None:
            d_in = cp.asarray(_f32_to_bf16_bits(src64.astype(np.float32)))
        else:
            d_in = cp.asarray(src64.astype(sdt))
        outs = [cp.zeros(n, dtype=(np.uint16 if t is None else t)) for _, t in CAST_TYPES]
        _launch(
            _kernel("cast.cu", f"cast_from_{sname}"), (1, 1, 1), (32, 1, 1), 0, [d_in, *outs, np.int64(n)]
        )
        for (dname, ddt), d_out in zip(CAST_TYPES, outs):
            got = _to_host_values(cp.asnumpy(d_out), ddt)
            want = np.trunc(src64) if ddt in (np.int32, np.int64) else src64
            want = _convert(want, ddt)
            if not np.array_equal(got, want):
                failures.append((sname, dname, got.tolist(), want.tolist()))
    assert not failures, failures


@gpu
def test_gpu_vector_copies_and_identities():
    import cupy as cp

    src = (KERNEL_DIR / "vector.cu").read_text()
    cases = [
        line[len("KILN_VEC_KERNEL(") : -1].split(", ")
        for line in src.splitlines()
        if line.startswith("KILN_VEC_KERNEL(") and "NAME" not in line
    ]
    assert len(cases) >= 15
    sizes = {"bool": 1, "f16": 2, "bf16": 2, "f32": 4, "i32": 4, "f64": 8, "i64": 8}
    rng = np.random.default_rng(5)
    for name, _ctype, n in cases:
        n = int(n)
        nvec = 300
        nbytes = nvec * n * sizes[name]
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        if name == "bool":
            data &= 1
        d_in, d_out = cp.asarray(data), cp.zeros(nbytes, dtype=cp.uint8)
        _launch(
            _kernel("vector.cu", f"vec_copy_{name}x{n}"),
            (3, 1, 1),
            (128, 1, 1),
            0,
            [d_in, d_out, np.int64(nvec)],
        )
        np.testing.assert_array_equal(cp.asnumpy(d_out), data, err_msg=f"{name}x{n}")

    bufs = [
        cp.zeros(4, cp.float32),
        cp.zeros(3, cp.float64),
        cp.zeros(3, cp.float16),
        cp.zeros(3, cp.uint16),
        cp.zeros(3, cp.int32),
        cp.zeros(3, cp.int64),
        cp.zeros(2, cp.bool_),
    ]
    _launch(_kernel("cast.cu", "identities"), (1, 1, 1), (1, 1, 1), 0, bufs)
    f, d, h, bf, i, ll, b = (cp.asnumpy(a) for a in bufs)
    inf = np.inf
    assert f.tolist() == [0, -inf, inf, 4.0] and d.tolist() == [0, -inf, inf]
    assert h.astype(np.float64).tolist() == [0, -inf, inf]
    assert _bf16_bits_to_f32(bf).tolist() == [0, -inf, inf]
    assert i.tolist() == [0, -(2**31), 2**31 - 1] and ll.tolist() == [0, -(2**63), 2**63 - 1]
    assert b.tolist() == [False, True]


@gpu
def test_gpu_executor_caches(tmp_path, monkeypatch):
    ex = _executor()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    ex.clear_memory_cache()
    src = source_of(KERNEL_DIR / "cast.cu")
    k1 = ex.load_module(src, "cast_from_f32")
    assert k1.arch == ex.device_arch()
    assert ex.load_module(src, "cast_from_f32") is k1
    files = list(tmp_path.glob("*.cubin"))
    assert [p.name for p in files] == [f"{k1.key}.cubin"]
    assert files[0].read_bytes()[:4] == b"\x7fELF"
    ex.clear_memory_cache()
    k2 = ex.load_module(src, "cast_from_f64")  # same source: served from disk
    assert k2.key == k1.key and k2.registers is None
    with pytest.raises(KilnError):
        ex.load_module(src, "no_such_kernel")
    buf = ex.zeroed_buffer(100)
    assert buf.nbytes == 100 and int(buf.sum()) == 0
    assert ex.empty_buffer(0).nbytes == 1


@gpu
def test_gpu_cupy_nvrtc_fallback_produces_cubin(tmp_path, monkeypatch):
    import cupy as cp

    ex = _executor()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvrtc_mod, "nvrtc_available", lambda: False)
    ex.clear_memory_cache()
    k = ex.load_module(source_of(KERNEL_DIR / "cast.cu"), "cast_from_f32")
    assert next(tmp_path.glob("*.cubin")).read_bytes()[:4] == b"\x7fELF"
    x = cp.asarray(np.array([1.5, -2.25, 0.0], dtype=np.float32))
    outs = [cp.zeros(3, dtype=(np.uint16 if t is None else t)) for _, t in CAST_TYPES]
    ex.launch(k, (1, 1, 1), (32, 1, 1), 0, [x, *outs, np.int64(3)])
    assert cp.asnumpy(outs[6]).tolist() == [1.5, -2.25, 0.0]
    assert cp.asnumpy(outs[1]).tolist() == [1, -2, 0]
    ex.clear_memory_cache()
