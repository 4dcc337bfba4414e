"""kiln's kernel launcher (``kiln._core.PreparedLaunch``, issue 5 point 9): the packed
parameter buffer against NumPy's C struct layout, errors without libcuda, the CuPy stream
getter, the launcher host.py generates (on a stand-in CuPy, CPU only), the ``fd.execute``
fast path, and real launches on the GPU against NumPy float64."""

from __future__ import annotations

import ctypes
import sys
import threading
import types

import kiln.execute as execute_mod
import numpy as np
import pytest
import scenarios
from gpu_util import cupy_or_skip, plan_without_resets
from kiln import (
    DataType,
    FusionDefinition,
    KilnError,
    KilnInternalError,
    KilnTypeError,
    ParallelType,
    _core,
    host,
)
from kiln.runtime.kernel_executor import np_scalar


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _packed_reference(params):
    """The bytes of ``params`` (("ptr", address) or NumPy scalars) as a C struct: NumPy's
    aligned struct layout is the CUDA parameter-buffer layout (natural alignment)."""
    fields, values = [], []
    for i, p in enumerate(params):
        if isinstance(p, tuple):
            fields.append((f"f{i}", np.uint64))
            values.append(p[1])
        else:
            fields.append((f"f{i}", p.dtype))
            values.append(p)
    dt = np.dtype(fields, align=True)
    rec = np.zeros(1, dtype=dt)
    for i, v in enumerate(values):
        rec[f"f{i}"] = v
    return dt, rec.tobytes()


def _prepared(params, **kw):
    spec = [None if isinstance(p, tuple) else np.asarray(p).tobytes() for p in params]
    return _core.PreparedLaunch(0xDEAD0, (3, 2, 1), (128, 1, 1), 1024, spec, **kw)


LAYOUTS = {
    "pointers_then_index32": [("ptr", 0x7F0000001000), ("ptr", 0x7F0000002000), np.int32(1024)],
    "every_dtype": [
        np.bool_(True), ("ptr", 0x1234_5678_9ABC), np_scalar(3, "Int32"), np_scalar(-7, "Int"),
        np_scalar(1.5, "Half"), np_scalar(2.25, "Float"), np_scalar(2.5, "BFloat16"),
        np_scalar(-0.125, "Double"), np_scalar(False, "Bool"), ("ptr", 0xFFFF_0000_0000_0008),
    ],
    "small_scalars_only": [np.bool_(True), np.float16(0.5), np.int32(-1)],
    "grid_reduction": [("ptr", 1 << 40), ("ptr", 2 << 40), ("ptr", 3 << 40), ("ptr", 3 << 40 | 24576),
                       np.int32(61), np.int32(300)],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packs_every_parameter_at_its_natural_alignment(name):
    params = LAYOUTS[name]
    pl = _prepared(params)
    dt, want = _packed_reference(params)
    assert pl.layout == [(dt.fields[f"f{i}"][1], dt.fields[f"f{i}"][0].itemsize) for i in range(len(params))]
    ptrs = [p[1] for p in params if isinstance(p, tuple)]
    assert pl.pointer_count == len(ptrs)
    got = pl.packed(*ptrs)
    assert len(got) % 8 == 0 and len(got) >= dt.itemsize
    assert got[: dt.itemsize] == want
    assert not any(got[dt.itemsize:])
    assert pl.dims == ([3, 2, 1], [128, 1, 1], 1024)


def test_pointers_are_per_call_and_scalars_stay():
    params = LAYOUTS["pointers_then_index32"]
    pl = _prepared(params)
    a = pl.packed(1, 2)
    b = pl.packed(3, 4)
    assert np.frombuffer(a[:16], np.uint64).tolist() == [1, 2]
    assert np.frombuffer(b[:16], np.uint64).tolist() == [3, 4]
    assert a[16:20] == b[16:20] == np.int32(1024).tobytes()


def test_half_and_bfloat16_scalars_are_two_bytes():
    assert np_scalar(1.5, "Half").tobytes() == np.float16(1.5).tobytes()
    bf = {1.0: 0x3F80, -2.0: 0xC000, 3.140625: 0x4049, 1.00390625: 0x3F80, 1.01171875: 0x3F82, 1e39: 0x7F80}
    for v, bits in bf.items():
        s = np_scalar(v, "BFloat16")
        assert s.dtype == np.uint16 and int(s) == bits, (v, hex(int(s)))
    assert int(np_scalar(float("nan"), "BFloat16")) & 0x7FFF > 0x7F80


# Per-call scalar slots: (kiln dtype, values a call may pass), bytes checked against np_scalar.
_PER_CALL = {
    "Float": [0.1, -3.5e38, 1e39, 2**53 + 2**29 + 1, True, -7, float("nan")],
    "Double": [0.1, -0.0, 1e308, 2**64 + 1, False, -(2**70), float("inf")],
    "Half": [1 + 2**-11 + 2**-40, 65519.99, 65520.0, 2049.0, 1e-8, 3e-8, -6.1e-5, 2**-25, float("-inf"), 7,
             True],
    "BFloat16": [1.00390625, 1.01171875, 1e39, -2.0, 3.140625, float("nan"), -(2**20) - 1, False],
    "Int": [-1, 2**63 - 1, -(2**63), True, 0, 2.9, -2.9],
    "Int32": [-1, 2**31 - 1, -(2**31), False, 12345, -7.5],
    "Bool": [True, False, 0, -3, 0.0, 0.5, float("nan"), 2**80],
}


def test_per_call_scalars_are_packed_at_their_offsets_like_np_scalar():
    names = sorted(_PER_CALL)
    # Pointers and constants between the per-call scalars: every alignment and padding.
    params = [None, "Half"] + [n for n in names] + [np.int32(7).tobytes(), None, "Bool", "Double"]
    pl = _core.PreparedLaunch(0xDEAD0, (1, 1, 1), (32, 1, 1), 0, params)
    assert pl.pointer_count == 2 and pl.scalar_count == len(names) + 3
    rows = max(len(v) for v in _PER_CALL.values())
    for r in range(rows):
        vals = {n: _PER_CALL[n][r % len(_PER_CALL[n])] for n in names}
        half, flag, dbl = -(r + 0.25), r % 2 == 0, r * -1e-3
        ptrs = (0x7000_0000 + r * 256, 0xFFFF_0000_0000_0000 + r)
        args = [ptrs[0], half] + [vals[n] for n in names] + [ptrs[1], flag, dbl]
        with np.errstate(over="ignore", invalid="ignore"):
            ref = [("p", ptrs[0]), np_scalar(half, "Half")] + [np_scalar(vals[n], n) for n in names]
            ref += [np.int32(7), ("p", ptrs[1]), np_scalar(flag, "Bool"), np_scalar(dbl, "Double")]
        dt, want = _packed_reference(ref)
        assert pl.layout == [(dt.fields[f"f{i}"][1], dt.fields[f"f{i}"][0].itemsize) for i in range(len(ref))]
        got = pl.packed(*args)
        assert got[: dt.itemsize] == want, (r, vals)


def test_per_call_half_rounds_straight_from_the_double_like_numpy():
    pl = _core.PreparedLaunch(0x1000, (1, 1, 1), (32, 1, 1), 0, ["Half"])
    rng = np.random.default_rng(3)
    vals = rng.standard_normal(3000) * np.exp2(rng.integers(-30, 20, 3000))
    # Halfway cases in every binade, nudged by a double ulp either way.
    ties = [(1024 + k + 0.5) * 2.0**e for k in range(4) for e in range(-24, 6)]
    vals = list(vals) + ties + [np.nextafter(t, 0) for t in ties] + [np.nextafter(t, np.inf) for t in ties]
    with np.errstate(over="ignore"):
        for v in vals:
            assert pl.packed(float(v))[:2] == np.float16(v).tobytes(), v


def test_per_call_scalar_errors_are_kiln_errors():
    pl = _core.PreparedLaunch(0x1000, (1, 1, 1), (32, 1, 1), 0, [None, "Int32", "Int", "Float"])
    assert pl.packed(1, 2, 3, 4.0)
    with pytest.raises(KilnTypeError, match="takes 1 device pointers and 3 scalars, got 2 arguments"):
        pl.packed(1, 2)
    with pytest.raises(KilnError, match=r"argument 1 \(Int32 parameter\): the value does not fit in int32"):
        pl.packed(1, 2**31, 3, 4.0)
    with pytest.raises(KilnError, match="does not fit in int64"):
        pl.launch(0, 1, 2, 2**63, 4.0)
    with pytest.raises(KilnError, match="NaN"):
        pl.packed(1, float("nan"), 3, 4.0)
    with pytest.raises(KilnError, match="int too large to convert to float"):
        pl.packed(1, 2, 3, 10**400)
    with pytest.raises(KilnTypeError, match="argument 3: expected a Python int, float or bool, got str"):
        pl.packed(1, 2, 3, "4")
    with pytest.raises(KilnTypeError, match='unknown dtype "Float8"'):
        _core.PreparedLaunch(0x1000, (1, 1, 1), (32, 1, 1), 0, ["Float8"])
    with pytest.raises(KilnTypeError, match="must be None, bytes or a dtype name, got float"):
        _core.PreparedLaunch(0x1000, (1, 1, 1), (32, 1, 1), 0, [1.5])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"params": [b"abc"]}, "parameter 0 has 3 bytes"),
        ({"params": [None] * 4096}, "exceed the 32764"),
        ({"params": [None], "memsets": [(1, 8)]}, "memset of pointer 1"),
        ({"params": [None], "grid": (0, 1, 1)}, "at least 1"),
        ({"params": [None], "function": 0}, "null"),
    ],
)
def test_bad_launches_are_refused_when_packed(kwargs, match):
    args = {"function": 0x1000, "grid": (1, 1, 1), "block": (32, 1, 1), "smem": 0, **kwargs}
    with pytest.raises(KilnError, match=match):
        _core.PreparedLaunch(args["function"], args["grid"], args["block"], args["smem"], args["params"],
                             args.get("memsets", []))


def test_wrong_pointer_arguments_raise_type_errors():
    pl = _prepared(LAYOUTS["pointers_then_index32"])
    with pytest.raises(KilnTypeError, match="takes 2 device pointers, got 1"):
        pl.launch(0, 5)
    with pytest.raises(KilnTypeError, match="device pointer 1: expected an int address, got str"):
        pl.launch(0, 5, "x")
    with pytest.raises(KilnError, match="without CuPy's stream getter"):
        pl.launch_current(1, 2)


@pytest.mark.skipif(_libcuda_loads(), reason="libcuda is present here")
def test_without_libcuda_launching_raises_kiln_error_and_host_keeps_cupy(monkeypatch):
    for _ in range(2):  # the failed load is remembered, and raised again
        with pytest.raises(KilnError, match=r"needs the CUDA driver: cannot load libcuda\.so\.1"):
            _core.load_cuda_driver()
    pl = _prepared(LAYOUTS["pointers_then_index32"], memsets=[(0, 64)])
    with pytest.raises(KilnError, match="cannot load libcuda"):
        pl.launch(0, 1, 2)
    with pytest.raises(KilnError, match="cannot load libcuda"):
        pl.zero(0, 1, 2)
    with pytest.raises(KilnError, match="cannot load libcuda"):
        pl.verify()
    monkeypatch.delenv("KILN_LAUNCHER", raising=False)
    assert host.launcher_kind() == "cupy"
    monkeypatch.setenv("KILN_LAUNCHER", "rust")
    with pytest.raises(KilnError, match="cannot load libcuda"):
        host.launcher_kind()


def test_launcher_env_var_is_checked(monkeypatch):
    monkeypatch.setenv("KILN_LAUNCHER", "cupy")
    assert host.launcher_kind() == "cupy"
    monkeypatch.setenv("KILN_LAUNCHER", "ptx")
    with pytest.raises(KilnError, match="KILN_LAUNCHER must be 'rust' or 'cupy'"):
        host.launcher_kind()


# -- the FFI calls themselves, against a stand-in libcuda (CPU, in a subprocess) ------------
_FAKE_LIBCUDA = r"""
#include <stddef.h>
#include <string.h>
typedef int CUresult;
static size_t sizes[256], nparams, launches, memsets, zeroed_n[16];
static unsigned char last[32768];
static unsigned long long zeroed_at[16], zeroed_stream[16];
static unsigned dims[7];
static void *last_fn, *last_stream;
static int need_ctx, ctx_set;
static size_t off_of(size_t i) {
  size_t off = 0;
  for (size_t j = 0; j <= i; j++) {
    off = (off + sizes[j] - 1) / sizes[j] * sizes[j];
    if (j < i) off += sizes[j];
  }
  return off;
}
void fake_set_layout(const size_t *s, size_t n) { memcpy(sizes, s, n * sizeof(size_t)); nparams = n; }
void fake_require_context(int v) { need_ctx = v; ctx_set = 0; }
size_t fake_launches(void) { return launches; }
size_t fake_memsets(void) { return memsets; }
const unsigned char *fake_last_params(void) { return last; }
const unsigned *fake_last_dims(void) { return dims; }
void *fake_last_fn(void) { return last_fn; }
void *fake_last_stream(void) { return last_stream; }
unsigned long long fake_zeroed(size_t i, int what) {
  return what == 0 ? zeroed_at[i] : what == 1 ? zeroed_n[i] : zeroed_stream[i];
}
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuCtxGetCurrent(void **c) { *c = ctx_set ? (void *)0x1 : NULL; return 0; }
CUresult cuCtxSetCurrent(void *c) { ctx_set = c != NULL; return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = o; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)(size_t)(0x100 + d); return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) {
  if (e == 1) { *s = "CUDA_ERROR_INVALID_VALUE"; return 0; }
  if (e == 201) { *s = "CUDA_ERROR_INVALID_CONTEXT"; return 0; }
  return 1;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
  if (e == 1) { *s = "invalid argument"; return 0; }
  return 1;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void *stream, void **params, void **extra) {
  if (need_ctx && !ctx_set) return 201;
  if (bx * by * bz > 1024 || extra != NULL) return 1;
  if (nparams) memset(last, 0, off_of(nparams - 1) + sizes[nparams - 1]);
  for (size_t i = 0; i < nparams; i++) memcpy(last + off_of(i), params[i], sizes[i]);
  unsigned d[7] = {gx, gy, gz, bx, by, bz, smem};
  memcpy(dims, d, sizeof d);
  last_fn = f; last_stream = stream;
  __atomic_fetch_add(&launches, 1, __ATOMIC_SEQ_CST); /* launches come from several threads at once */
  return 0;
}
CUresult cuMemsetD8Async(unsigned long long dst, unsigned char v, size_t n, void *stream) {
  if (need_ctx && !ctx_set) return 201;
  if (v != 0 || memsets >= 16) return 1;
  zeroed_at[memsets] = dst;
  zeroed_n[memsets] = n;
  zeroed_stream[memsets] = (unsigned long long)(size_t)stream;
  memsets++;
  return 0;
}
CUresult cuFuncGetParamInfo(void *f, size_t i, size_t *off, size_t *size) {
  (void)f;
  if (i >= nparams) return 1;
  *off = off_of(i); *size = sizes[i];
  return 0;
}
"""

_FAKE_DRIVER_SCRIPT = r"""
import ctypes, threading
import numpy as np
from kiln import KilnError, KilnInternalError, _core, host

fake = ctypes.CDLL("libcuda.so.1")  # the stand-in: LD_LIBRARY_PATH puts it first
for name in ("fake_last_params", "fake_last_dims", "fake_last_fn", "fake_last_stream"):
    getattr(fake, name).restype = ctypes.c_void_p
for name in ("fake_launches", "fake_memsets"):
    getattr(fake, name).restype = ctypes.c_size_t
fake.fake_zeroed.restype = ctypes.c_ulonglong
fake.fake_zeroed.argtypes = [ctypes.c_size_t, ctypes.c_int]

def set_layout(sizes):
    arr = (ctypes.c_size_t * len(sizes))(*sizes)
    fake.fake_set_layout(arr, ctypes.c_size_t(len(sizes)))

_core.load_cuda_driver()
assert host.launcher_kind() == "rust"
scal = [np.int32(1000), np.float64(-1.25), np.bool_(True), np.float16(0.5), np.int64(-3)]
params = [None, None] + [v.tobytes() for v in scal]
set_layout([8, 8, 4, 8, 1, 2, 8])
pl = _core.PreparedLaunch(0xABC0, (3, 2, 1), (64, 2, 1), 96, params, [(1, 40)], 0)
assert pl.verify() == pl.layout == [(0, 8), (8, 8), (16, 4), (24, 8), (32, 1), (34, 2), (40, 8)], pl.verify()

x, y = 0x7F00_0000_1000, 0x7F00_0000_2000
pl.launch(0x77, x, y)
assert fake.fake_launches() == 1
assert fake.fake_last_fn() == 0xABC0 and fake.fake_last_stream() == 0x77
assert list((ctypes.c_uint * 7).from_address(fake.fake_last_dims())) == [3, 2, 1, 64, 2, 1, 96]
fields = [("x", np.uint64), ("y", np.uint64)] + [(f"s{i}", v.dtype) for i, v in enumerate(scal)]
dt = np.dtype(fields, align=True)
rec = np.zeros(1, dt)
rec["x"], rec["y"] = x, y
for i, v in enumerate(scal):
    rec[f"s{i}"] = v
got = ctypes.string_at(fake.fake_last_params(), dt.itemsize)
assert got == rec.tobytes(), (got.hex(), rec.tobytes().hex())

pl.zero(0x78, x, y)
assert fake.fake_memsets() == 1
assert [fake.fake_zeroed(0, w) for w in range(3)] == [y, 40, 0x78]

try:
    _core.PreparedLaunch(0xABC0, (1, 1, 1), (2048, 1, 1), 0, params).launch(0, x, y)
    raise AssertionError("an oversized block must fail")
except KilnError as e:
    assert "cuLaunchKernel failed with CUDA_ERROR_INVALID_VALUE (CUresult 1): invalid argument" in str(e), e

# No context on this thread: the launcher adopts the device's primary context once.
fake.fake_require_context(1)
pl.launch(0x79, x, y)
assert fake.fake_launches() == 2 and fake.fake_last_stream() == 0x79
fake.fake_require_context(1)
no_device = _core.PreparedLaunch(0xABC0, (1, 1, 1), (32, 1, 1), 0, params)  # device -1: cannot adopt
try:
    no_device.launch(0, x, y)
    raise AssertionError("without a context and a device the launch must fail")
except KilnError as e:
    assert "CUDA_ERROR_INVALID_CONTEXT (CUresult 201)" in str(e), e
fake.fake_require_context(0)

# CuPy's stream through a C getter.
getter = ctypes.CFUNCTYPE(ctypes.c_ssize_t)(lambda: 0x5150)
new = ctypes.pythonapi.PyCapsule_New
new.restype = ctypes.py_object
new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
name = b"intptr_t (void)"
cap = new(ctypes.cast(getter, ctypes.c_void_p), name, None)
cur = _core.PreparedLaunch(0xABC0, (1, 1, 1), (32, 1, 1), 0, params, [(0, 8)], 0, cap)
cur.launch_current(x, y)
assert fake.fake_last_stream() == 0x5150
cur.zero_current(x, y)
assert fake.fake_zeroed(1, 2) == 0x5150 and fake.fake_zeroed(1, 0) == x

# Launches from other threads (the GIL is released around the driver call).
def many():
    for _ in range(200):
        pl.launch(0x7A, x, y)
threads = [threading.Thread(target=many) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert fake.fake_launches() == 3 + 800

set_layout([8, 8, 4, 8, 1, 2])
try:
    pl.verify()
    raise AssertionError("a kernel with fewer parameters must fail verify")
except KilnInternalError as e:  # a launcher that disagrees with its kernel is a kiln bug
    assert "sizes [8, 8, 4, 8, 1, 2], but the launcher packs [8, 8, 4, 8, 1, 2, 8]" in str(e), e
print("FAKE-DRIVER-OK")
"""


def test_ffi_calls_against_a_stand_in_libcuda(tmp_path):
    import os
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in libcuda")
    src = tmp_path / "fake_libcuda.c"
    src.write_text(_FAKE_LIBCUDA)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    env.pop("KILN_LAUNCHER", None)
    res = subprocess.run([sys.executable, "-c", _FAKE_DRIVER_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "FAKE-DRIVER-OK" in res.stdout, res.stdout + res.stderr


# -- CuPy's current stream through its C API ------------------------------------------------
_GETTER = ctypes.CFUNCTYPE(ctypes.c_ssize_t)


def _capsule(fn, name: bytes):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    keep = ctypes.create_string_buffer(name)  # a capsule stores the pointer, not a copy
    return new(ctypes.cast(fn, ctypes.c_void_p), ctypes.addressof(keep), None), keep


def test_stream_getter_capsule_is_called_for_the_stream():
    streams = iter([0x5150, 0x7000])
    fn = _GETTER(lambda: next(streams))
    cap, keep = _capsule(fn, b"intptr_t (void)")
    pl = _prepared(LAYOUTS["pointers_then_index32"], stream_getter=cap)
    assert pl.stream_getter_used
    assert pl.stream() == 0x5150
    assert pl.stream() == 0x7000  # read per call: a user's stream switch is seen
    del keep


def test_stream_getter_with_another_signature_is_refused():
    fn = _GETTER(lambda: 1)
    cap, keep = _capsule(fn, b"intptr_t (int)")
    with pytest.raises(KilnTypeError, match="capsule named"):
        _prepared(LAYOUTS["pointers_then_index32"], stream_getter=cap)
    del keep


# -- the generated launcher, on a stand-in CuPy (CPU) ---------------------------------------
class _Mem:
    """A ``MemoryPointer``: ``ptr``, ``device_id`` and the memory object it holds."""

    def __init__(self, ptr):
        self.ptr = ptr
        self.device_id = 0
        self.mem = types.SimpleNamespace(ptr=ptr)


class FakeArray:
    """Just enough of ``cupy.ndarray`` for the host path: shape, strides, dtype, data.ptr."""

    __module__ = "cupy._fake"
    _next = 0x7000_0000_0000

    def __init__(self, shape, dtype=np.float32):
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        st, acc = [], self.itemsize
        for s in reversed(self.shape):
            st.append(acc)
            acc *= max(s, 1)
        self.strides = tuple(reversed(st))
        FakeArray._next += 1 << 20
        self.data = _Mem(FakeArray._next)

    def fill(self, _v):
        pass


class Recorder:
    """Wraps a real PreparedLaunch (real packing), recording calls instead of launching."""

    def __init__(self, pl, memsets):
        self.pl, self.memsets, self.calls = pl, memsets, []
        self.stream_getter_used = False

    def launch(self, stream, *args):
        self.calls.append(("launch", stream, args, self.pl.packed(*args)))

    def zero(self, stream, *ptrs):
        self.calls.append(("zero", stream, ptrs, [(ptrs[k], n) for k, n in self.memsets]))


@pytest.fixture
def fake_gpu(monkeypatch):
    """CuPy replaced by a stand-in, the Rust launcher chosen and recording, no compiles."""
    cp = types.ModuleType("cupy")
    stream = types.SimpleNamespace(ptr=0x51)
    cp.ndarray = FakeArray
    cp.uint8 = np.uint8
    cp.empty = lambda n, dtype=np.uint8: FakeArray(n, dtype)
    cp.zeros = cp.empty
    entered = []  # raw streams made CuPy's current one (pool / arena growth, memsets)

    class FakeExternalStream:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            entered.append(self.ptr)

        def __exit__(self, *exc):
            return None

    device = [0]  # CuPy's current device (tests switch it)
    cp.cuda = types.SimpleNamespace(get_current_stream=lambda: stream,
                                    Device=lambda: types.SimpleNamespace(id=device[0]),
                                    ExternalStream=FakeExternalStream)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(host, "_EXTERNAL", {})
    monkeypatch.setattr(host, "launcher_kind", lambda: "rust")
    # These tests follow the kernel-by-kernel launcher; test_graph_host.py the graph one.
    monkeypatch.setenv("KILN_CUDA_GRAPHS", "0")
    made = []

    def prepare(fn, grid, block, smem, pointers, scalars, memsets=(), device=-1):
        params = [None] * pointers + [v if isinstance(v, str) else np.asarray(v).tobytes() for v in scalars]
        rec = Recorder(_core.PreparedLaunch(fn.ptr, grid, block, smem, params, list(memsets), device),
                       list(memsets))
        made.append(rec)
        return rec

    monkeypatch.setattr(host, "prepare_launch", prepare)
    monkeypatch.setattr(host.HostEvaluator, "_function",
                        lambda self, k, smem, index32=False, threads=0: types.SimpleNamespace(ptr=0xF00 + k))
    return types.SimpleNamespace(made=made, stream=stream, entered=entered, device=device)


def _bench_fusion():
    """The fusion ``benches/host_latency.py`` measures (``exp(x) * 2 - 1.5``, scheduled by hand)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benches" / "host_latency.py"
    spec = importlib.util.spec_from_file_location("_kiln_host_latency", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build()


def test_generated_launcher_passes_device_pointers_and_packed_scalars(fake_gpu):
    fd = _bench_fusion()
    x = FakeArray(1000)
    (out,) = fd.execute([x])
    assert isinstance(out, FakeArray) and out.shape == (1000,)
    (rec,) = fake_gpu.made
    ((kind, stream, ptrs, packed),) = rec.calls
    assert (kind, stream, ptrs) == ("launch", 0x51, (x.data.ptr, out.data.ptr))
    assert rec.pl.dims == ([8, 1, 1], [128, 1, 1], 0)
    _, want = _packed_reference([("p", x.data.ptr), ("p", out.data.ptr), np.int32(1000)])
    assert packed[: len(want)] == want
    ev = fd._lowered().evaluator()
    assert ev.launches == 1
    fake_gpu.stream.ptr = 0x52  # the user switched streams: the next call launches there
    (out2,) = fd.execute([x])
    assert rec.calls[-1][:3] == ("launch", 0x52, (x.data.ptr, out2.data.ptr))
    assert out2.data.ptr != out.data.ptr, "every call gets a fresh output"
    assert len(fake_gpu.made) == 1 and ev.launches == 2


def _launched_out(rec):
    """The output pointer of the last recorded launch."""
    return rec.calls[-1][2][1]


def test_a_dropped_output_is_reused_on_the_same_stream(fake_gpu):
    fd = _bench_fusion()
    x = FakeArray(1000)
    fd.execute([x])  # first call of the signature: kernel by kernel
    (rec,) = fake_gpu.made
    (out,) = fd.execute([x])
    p = out.data.ptr
    del out  # nothing references it now: the next call writes into it
    (out,) = fd.execute([x])
    assert out.data.ptr == p and _launched_out(rec) == p
    # Held by the caller: the next call gets a fresh array.
    (out2,) = fd.execute([x])
    assert out2.data.ptr != p and _launched_out(rec) == out2.data.ptr
    del out2
    # Another stream: out may still be written on the old one, so it is not reused.
    del out
    fake_gpu.stream.ptr = 0x52
    (out3,) = fd.execute([x])
    assert out3.data.ptr != p and rec.calls[-1][1] == 0x52


@pytest.mark.parametrize("hold", ["data", "mem", "shape"])
def test_an_output_still_referenced_is_not_reused(fake_gpu, hold):
    fd = _bench_fusion()
    x = FakeArray(1000)
    fd.execute([x])
    (out,) = fd.execute([x])
    p = out.data.ptr
    kept = None
    if hold == "data":  # its memory pointer, e.g. a raw-pointer wrapper around it
        kept = out.data
    elif hold == "mem":
        kept = out.data.mem
    else:  # reshaped in place, then dropped: the shape kiln made it with is gone
        out.shape = (10, 100)
    del out
    (out2,) = fd.execute([x])
    assert out2.data.ptr != p and out2.shape == (1000,)
    assert kept is None or kept is not out2.data


def test_output_reuse_can_be_turned_off_and_skips_large_outputs(fake_gpu, monkeypatch):
    monkeypatch.setenv("KILN_REUSE_OUTPUTS", "0")
    fd = _bench_fusion()
    for n in (1000, (host.REUSE_MAX_BYTES // 4) + 128):
        if n != 1000:
            monkeypatch.delenv("KILN_REUSE_OUTPUTS")  # on, but the output is over the limit
        x = FakeArray(n)
        ptrs = []
        for _ in range(3):
            (out,) = fd.execute([x])
            ptrs.append(out.data.ptr)
            del out
        assert len(set(ptrs)) == 3, ptrs


class _FakeDtype:
    def __str__(self):
        return "torch.float32"


class FakeTensor:
    """Just enough of a torch CUDA tensor for the host path."""

    __module__ = "torch._fake"
    is_cuda = True
    device = "cuda:0"
    dtype = _FakeDtype()

    def __init__(self, shape):
        self.a = FakeArray(shape)
        self.shape = self.a.shape

    def stride(self):
        return tuple(st // 4 for st in self.a.strides)

    def get_device(self):
        return 0

    def data_ptr(self):
        return self.a.data.ptr

    requires_grad = False

    def _use_count(self):
        return 1  # handles on this tensor's TensorImpl (its Python object's)

    def untyped_storage(self):
        return types.SimpleNamespace(_cdata=self.a.data.mem)


@pytest.fixture
def fake_torch(monkeypatch):
    """A stand-in torch whose current stream the test sets (``.stream[0]``)."""
    torch = types.ModuleType("torch")
    current = [0x77]
    torch.float32 = "float32"
    torch.empty = lambda shape, dtype=None, device=None: FakeTensor(shape)
    # A storage's use count: one for the tensor, one for each Python storage object alive.
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device: current[0],
                                     _storage_Use_Count=lambda mem: sys.getrefcount(mem))
    monkeypatch.setitem(sys.modules, "torch", torch)
    return types.SimpleNamespace(stream=current)


def test_torch_inputs_launch_on_torch_s_current_stream(fake_gpu, fake_torch):
    # CuPy's current stream (0x51) is not where torch's work on the inputs is queued: a call
    # inside `with torch.cuda.stream(s)` must run on s, after what produced its inputs.
    fd = _bench_fusion()
    x = FakeTensor(1000)
    (out,) = fd.execute([x])
    assert isinstance(out, FakeTensor)
    (rec,) = fake_gpu.made
    assert rec.calls[-1][:3] == ("launch", 0x77, (x.data_ptr(), out.data_ptr()))
    fake_torch.stream[0] = 0x78  # the user entered another torch stream
    (out2,) = fd.execute([x])
    assert rec.calls[-1][:3] == ("launch", 0x78, (x.data_ptr(), out2.data_ptr()))
    assert len(fake_gpu.made) == 1, "one recipe serves both streams"


def test_torch_outputs_are_reused_only_when_nothing_holds_them(fake_gpu, fake_torch):
    fd = _bench_fusion()
    x = FakeTensor(1000)
    fd.execute([x])
    (rec,) = fake_gpu.made
    (out,) = fd.execute([x])
    p = out.data_ptr()
    del out
    (out,) = fd.execute([x])
    assert out.data_ptr() == p and _launched_out(rec) == p
    storage = out.untyped_storage()  # a view's or an export's hold on the storage
    del out
    (out,) = fd.execute([x])
    assert out.data_ptr() != p
    del storage
    p = out.data_ptr()
    out.requires_grad = True  # changed in place by the caller, then dropped
    del out
    (out,) = fd.execute([x])
    assert out.data_ptr() != p and not out.requires_grad
    p = out.data_ptr()
    del out
    fake_torch.stream[0] = 0x79
    (out,) = fd.execute([x])
    assert out.data_ptr() != p and rec.calls[-1][1] == 0x79


def test_torch_grid_reduction_zeroes_its_pool_on_torch_s_stream(fake_gpu, fake_torch, monkeypatch):
    sc = scenarios.h_grid_column_sum()
    x = FakeTensor((61, 300))
    sc.fd.execute([x])
    ev = sc.fd._lowered().evaluator()
    (rec,) = fake_gpu.made
    assert [c[:2] for c in rec.calls] == [("launch", 0x77)]
    # The pool was zeroed (and the arena allocated) with torch's stream current for CuPy.
    assert ev.pool.stats()["zero_fills"] == 1 and set(fake_gpu.entered) == {0x77}
    # Buffers that kernels leave dirty are zeroed through the launcher on the same stream.
    plan_without_resets(monkeypatch)
    sc2 = scenarios.h_grid_column_sum()
    sc2.fd.execute([x])
    kinds = [c[:2] for c in fake_gpu.made[-1].calls]
    assert kinds == [("zero", 0x77), ("launch", 0x77)], kinds


def test_each_device_gets_its_own_arena_and_zeroed_pool(fake_gpu):
    # A column sum across blocks: a work buffer in the arena, a semaphore in the zeroed pool.
    # The same fusion on a second device must not be handed the first device's memory.
    sc = scenarios.h_grid_column_sum()
    x0 = FakeArray((61, 300))
    sc.fd.execute([x0])
    fake_gpu.device[0] = 1
    x1 = FakeArray((61, 300))
    x1.data.device_id = 1
    sc.fd.execute([x1])
    ev = sc.fd._lowered().evaluator()
    (first,), (second,) = (rec.calls for rec in fake_gpu.made)
    work0, sync0 = first[2][2:]
    work1, sync1 = second[2][2:]
    assert work0 == ev.arena_for(0).mem.data.ptr and work1 == ev.arena_for(1).mem.data.ptr
    assert work0 != work1 and sync0 != sync1
    assert [ev.pool_for(d).stats()["zero_fills"] for d in (0, 1)] == [1, 1]


def test_compiled_kernels_are_loaded_per_device(monkeypatch):
    # A CUfunction belongs to the context of the device that loaded its module: device 1
    # must get its own (on two H200s, device 0's gave CUDA_ERROR_INVALID_HANDLE).
    from kiln.runtime import executor

    device = [0]
    cp = types.ModuleType("cupy")
    cp.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=device[0]))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    loads = []

    def load_module(source, name, threads=0):
        loads.append(device[0])
        return types.SimpleNamespace(function=f"fn@{device[0]}", max_dynamic_smem=0)

    monkeypatch.setattr(executor, "load_module", load_module)
    ev = scenarios.h_grid_column_sum().fd._lowered().evaluator()
    got = []
    for d in (0, 1, 0, 1):
        device[0] = d
        got.append(ev._function(0, 0))
    assert got == ["fn@0", "fn@1", "fn@0", "fn@1"] and loads == [0, 1]


def test_repeat_call_dispatches_without_the_full_path(fake_gpu, monkeypatch):
    fd = _bench_fusion()
    x = FakeArray(1000)
    fd.execute([x])
    ev = fd._lowered().evaluator()

    def no_full_path(*_a, **_k):
        raise AssertionError("a repeat signature must not take the full path")

    monkeypatch.setattr(execute_mod, "execute", no_full_path)
    monkeypatch.setattr(ev, "_prepare", no_full_path)
    for _ in range(3):
        fd.execute([x])
        fd.execute((x,), device="cuda")
    assert ev.launches == 7
    assert ev.run_cached([x]) is not None and ev.launches == 8


def test_new_signature_is_validated_before_its_first_launch(fake_gpu):
    fd = _bench_fusion()
    fd.execute([FakeArray(1000)])
    ev = fd._lowered().evaluator()
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\): dtype Double"):
        fd.execute([FakeArray(1000, np.float64)])
    with pytest.raises(KilnError, match=r"input 0 \(T0\): rank 2"):
        fd.execute([FakeArray((4, 250))])
    with pytest.raises(KilnError, match="takes 1 inputs but 2"):
        fd.execute([FakeArray(1000), FakeArray(1000)])
    with pytest.raises(KilnTypeError, match="inputs must be a list"):
        fd.execute(FakeArray(1000))
    with pytest.raises(KilnError, match="device must be 'cpu' or 'cuda'"):
        fd.execute([FakeArray(1000)], device="tpu")
    assert ev.launches == 1
    fd.execute([FakeArray(3000)])  # a new size: validated, prepared, launched
    assert ev.launches == 2 and len(fake_gpu.made) == 2


def test_changed_schedule_is_not_served_from_the_old_signature(fake_gpu):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        y = fd.ops.neg(x)
        fd.add_output(y)
    y.split(0, 128)
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(1).parallelize(ParallelType.TIDx)
    a = FakeArray(512)
    fd.execute([a])
    y.split(1, 32)  # the fusion changed: the old launcher must not run
    y.axis(2).parallelize(ParallelType.TIDx)
    fd.execute([a])
    assert [rec.pl.dims[1][0] for rec in fake_gpu.made] == [128, 32]


@pytest.mark.parametrize("serial", [False, True])
def test_grid_reduction_semaphores_are_not_cleared_per_launch(fake_gpu, serial):
    sc = scenarios.h_serial_grid_column_sum() if serial else scenarios.h_grid_column_sum()
    x = FakeArray((61, 300))
    sc.fd.execute([x])
    sc.fd.execute([x])
    ev = sc.fd._lowered().evaluator()
    (rec,) = fake_gpu.made
    # Both protocols leave the semaphore at zero: it comes from the zeroed pool.
    assert [c[0] for c in rec.calls] == ["launch", "launch"] and ev.memsets == 0
    assert ev.pool.stats()["zero_fills"] == 1


def test_memsets_of_semaphores_that_stay_dirty_go_through_the_launcher(fake_gpu, monkeypatch):
    plan_without_resets(monkeypatch)
    sc = scenarios.h_grid_column_sum()
    x = FakeArray((61, 300))
    sc.fd.execute([x])
    sc.fd.execute([x])
    ev = sc.fd._lowered().evaluator()
    (rec,) = fake_gpu.made
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["zero", "launch", "zero", "launch"] and ev.memsets == 2
    base = ev._arena.data.ptr
    _, stream, ptrs, regions = rec.calls[0]
    assert ptrs[2:] == (base, base + 24576)  # T1_work, T1_sync: arena regions
    assert regions == [(base + 24576, 24)]  # only the zero_init semaphore, its planned bytes
    ev.zero_per_launch = False
    sc.fd.execute([x])
    assert rec.calls[-1][0] == "launch" and rec.calls[-2][0] == "launch" and ev.memsets == 2


def test_scalar_values_are_per_call_arguments_of_one_recipe(fake_gpu, monkeypatch):
    fd = _scalar_fusion()
    x = FakeArray(1000)
    ab = [(0.5, -2.0), (3.0, 1e-3), (-1e-7, 12345.678)]
    fd.execute([x, *ab[0]])
    ev = fd._lowered().evaluator()

    def no_full_path(*_a, **_k):
        raise AssertionError("a new scalar value must not take the full path")

    monkeypatch.setattr(execute_mod, "execute", no_full_path)
    monkeypatch.setattr(ev, "_prepare", no_full_path)
    outs = [fd.execute([x, a, b])[0] for a, b in ab[1:]]
    assert len(ev._recipes) == 1 and len(fake_gpu.made) == 1 and ev.launches == 3
    (rec,) = fake_gpu.made
    for (a, b), (kind, _s, args, packed) in zip(ab, rec.calls):
        assert kind == "launch" and args[2:] == (a, b)
        ptrs, n = args[:2], np.int32(1000)  # kernel parameters: T0, T2, s0, s1, i0
        _, want = _packed_reference([("p", ptrs[0]), ("p", ptrs[1]), np.float32(a), np.float64(b), n])
        assert packed[: len(want)] == want
    assert rec.calls[-1][2][1] == outs[-1].data.ptr


def test_scalar_of_a_new_type_is_validated_before_launching(fake_gpu):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        s = fd.define_scalar(dtype=DataType.Int32)
        y = fd.ops.mul(x, s)
        fd.add_output(y)
    y.split(0, 128)
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(1).parallelize(ParallelType.TIDx)
    x = FakeArray(256)
    fd.execute([x, 3])
    fd.execute([x, -4])
    with pytest.raises(KilnTypeError, match=r"input 1 \(s0\): got float 2.5 for an Int32 scalar"):
        fd.execute([x, 2.5])
    with pytest.raises(KilnTypeError, match=r"input 1 \(s0\): expected a Python scalar \(Int32\), got str"):
        fd.execute([x, "3"])
    with pytest.raises(KilnError, match=r"argument 2 \(Int32 parameter\): the value does not fit in int32"):
        fd.execute([x, 2**31])  # same type as before: the launcher refuses it
    fd.execute([x, True])  # a new type (bool), validated and prepared: 1
    ev = fd._lowered().evaluator()
    assert len(ev._recipes) == 2 and ev.launches == 3
    assert [c[2][2:] for c in fake_gpu.made[0].calls] == [(3,), (-4,)]
    assert fake_gpu.made[1].calls[0][3][16:20] == np.int32(1).tobytes()


def test_plan_reading_an_int_scalar_keys_on_its_value(fake_gpu):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        n = fd.define_scalar(dtype=DataType.Int)
        f = fd.ops.full([n], 2.0, DataType.Float)
        y = fd.ops.add(f, 1.0)
        fd.add_output(y)
        fd.add_output(fd.ops.neg(x))
    for t in (f, y):
        t.split(0, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    f.inline_at(-1)
    xa = FakeArray(5)
    shapes = [fd.execute([xa, v], device="cuda")[0].shape for v in (300, 1000, 300)]
    assert shapes == [(300,), (1000,), (300,)]
    ev = fd._lowered().evaluator()
    assert ev._by_value and len(ev._recipes) == 2 and ev.launcher_for([xa, 300]) is None


# -- on the GPU -----------------------------------------------------------------------------
def _scalar_fusion():
    """``y = x * a + b`` with runtime scalars a (Float) and b (Double)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        a = fd.define_scalar(dtype=DataType.Float)
        b = fd.define_scalar(dtype=DataType.Double)
        xa = fd.ops.mul(x, a)
        y = fd.ops.add(xa, b)
        fd.add_output(y)
    for t in (xa, y):
        t.split(0, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    xa.inline_at(-1)
    return fd


@pytest.mark.gpu
def test_rust_launcher_runs_generated_kernels_like_numpy(monkeypatch):
    cp = cupy_or_skip()
    monkeypatch.delenv("KILN_LAUNCHER", raising=False)
    assert host.launcher_kind() == "rust"
    xs = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    x = cp.asarray(xs)
    fd = _bench_fusion()
    for _ in range(3):
        (out,) = fd.execute([x])
        ref = np.exp(xs.astype(np.float64)) * 2 - 1.5
        np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-5, atol=1e-5)
    ev = fd._lowered().evaluator()
    assert [r.launcher for r in ev._recipes.values()] == ["rust"]
    sfd = _scalar_fusion()
    for a, b in ((0.5, -2.0), (3.0, 1e-3)):
        (out,) = sfd.execute([x, a, b])
        np.testing.assert_allclose(cp.asnumpy(out), xs.astype(np.float64) * a + b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rust", "cupy"])
def test_changing_scalars_reuse_one_recipe_on_the_gpu(monkeypatch, kind):
    cp = cupy_or_skip()
    monkeypatch.setenv("KILN_LAUNCHER", kind)
    if kind == "rust" and host.launcher_kind() != "rust":
        pytest.skip("libcuda does not load")
    xs = np.random.default_rng(9).standard_normal(3001).astype(np.float32)
    x = cp.asarray(xs)
    fd = _scalar_fusion()
    for a, b in ((0.5, -2.0), (3.0, 1e-3), (-1.25, 7.0), (1e-4, -1e6), (2.0, 0.0)):
        (out,) = fd.execute([x, a, b])
        ref = xs.astype(np.float64) * np.float64(np.float32(a)) + b
        np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-5, atol=1e-5 * max(1.0, abs(b)))
    ev = fd._lowered().evaluator()
    assert len(ev._recipes) == 1 and [r.launcher for r in ev._recipes.values()] == [kind]
    assert ev.launches == 5


@pytest.mark.gpu
def test_rust_launcher_uses_the_current_stream_and_other_threads(monkeypatch):
    cp = cupy_or_skip()
    monkeypatch.delenv("KILN_LAUNCHER", raising=False)
    xs = np.random.default_rng(6).standard_normal(5000).astype(np.float32)
    ref = np.exp(xs.astype(np.float64)) * 2 - 1.5
    fd = _bench_fusion()
    x = cp.asarray(xs)
    fd.execute([x])
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        (out,) = fd.execute([x])
        s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-5, atol=1e-5)
    got = []
    t = threading.Thread(target=lambda: got.append(cp.asnumpy(fd.execute([x])[0])))
    t.start()
    t.join()
    np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-5)


# Every parameter size and a padded offset: y 0, x 8, n 16, a 24, flag 32, h 34, c 40.
_RAW = r"""
extern "C" __global__ void kiln_raw(float* y, const float* x, int n, double a, bool flag, short h,
                                    long long c) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = (float)(x[i] * a + (flag ? 1.0 : 0.0) + (double)h + (double)c);
}
"""


@pytest.mark.gpu
def test_prepared_launch_of_a_raw_kernel_on_explicit_and_current_streams():
    cp = cupy_or_skip()
    from kiln.runtime import executor

    if host.launcher_kind() != "rust":
        pytest.skip("the Rust launcher is off (KILN_LAUNCHER=cupy)")
    fn = executor.load_module(_RAW, "kiln_raw").function
    n = 777
    xs = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    x = cp.asarray(xs)
    y = cp.zeros(n, dtype=cp.float32)
    scal = [np.int32(n), np.float64(-1.25), np.bool_(True), np.int16(-2), np.int64(3)]
    pl = host.prepare_launch(fn, (7, 1, 1), (128, 1, 1), 0, 2, scal, [(0, n * 4)], cp.cuda.Device().id)
    ref = xs.astype(np.float64) * -1.25 + 1 - 2 + 3
    s = cp.cuda.Stream(non_blocking=True)
    pl.launch(s.ptr, y.data.ptr, x.data.ptr)
    s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(y), ref, rtol=1e-6, atol=1e-6)
    with s:
        if pl.stream_getter_used:
            assert pl.stream() == s.ptr
        pl.zero(s.ptr, y.data.ptr, x.data.ptr)
        s.synchronize()
        assert not cp.asnumpy(y).any()
        if pl.stream_getter_used:
            pl.launch_current(y.data.ptr, x.data.ptr)
        else:
            pl.launch(s.ptr, y.data.ptr, x.data.ptr)
        s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(y), ref, rtol=1e-6, atol=1e-6)
    kernel_layout = pl.verify()  # None on drivers before CUDA 12.4 (no cuFuncGetParamInfo)
    if kernel_layout is not None:
        assert kernel_layout == pl.layout == [(0, 8), (8, 8), (16, 4), (24, 8), (32, 1), (34, 2), (40, 8)]
        wide = [None, None] + [v.tobytes() for v in scal[:-1]] + [np.int32(3).tobytes()]
        with pytest.raises(KilnInternalError, match=r"sizes \[8, 8, 4, 8, 1, 2, 8\], but the launcher packs"):
            _core.PreparedLaunch(fn.ptr, (7, 1, 1), (128, 1, 1), 0, wide).verify()
    with pytest.raises(KilnError, match="cuLaunchKernel failed with CUDA_ERROR_"):
        too_big = [None, None] + [v.tobytes() for v in scal]
        _core.PreparedLaunch(fn.ptr, (1, 1, 1), (4096, 1, 1), 0, too_big).launch(0, y.data.ptr, x.data.ptr)


@pytest.mark.gpu
def test_both_launchers_agree(monkeypatch):
    cp = cupy_or_skip()
    x = cp.asarray(np.random.default_rng(8).standard_normal((61, 300)).astype(np.float32))
    outs = {}
    for kind in ("cupy", "rust"):
        monkeypatch.setenv("KILN_LAUNCHER", kind)
        if kind == "rust" and host.launcher_kind() != "rust":
            pytest.skip("libcuda does not load")
        for build in (scenarios.h_grid_column_sum, scenarios.h_serial_grid_column_sum):
            sc = build()
            (o,) = sc.fd.execute([x])
            outs[kind, build.__name__] = cp.asnumpy(o)
            assert [r.launcher for r in sc.fd._lowered().evaluator()._recipes.values()] == [kind]
        (o,) = _scalar_fusion().execute([x[0], 1.5, 0.25])
        outs[kind, "scalars"] = cp.asnumpy(o)
    for key in [k for k in outs if k[0] == "rust"]:
        np.testing.assert_array_equal(outs[key], outs["cupy", key[1]])


@pytest.mark.gpu
def test_local_memory_the_device_cannot_reserve_is_refused_before_launch(monkeypatch):
    # The driver reserves a thread's Local memory for every thread the device holds: a
    # schedule within the per-thread limit can still need more than the whole device.
    cp = cupy_or_skip()
    from kiln.runtime import executor

    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[3, 32, 16], dtype=DataType.Float)
        fd.add_output(fd.ops.add(t0, t0))
    t2 = t0.cache_after()
    t2.split(0, 4)
    t2.inline_at(-1)
    x = np.random.default_rng(0).uniform(-1, 1, (3, 32, 16)).astype(np.float32)
    monkeypatch.setattr(executor, "local_bytes", lambda fn: 1 << 30)
    with pytest.raises(KilnError, match=r"1073741824 bytes of Local memory per thread \(Local tensors: T2 "):
        fd.execute([cp.asarray(x)])
    monkeypatch.undo()
    (y,) = fd.execute([cp.asarray(x)])
    np.testing.assert_allclose(cp.asnumpy(y), 2.0 * x.astype(np.float64), rtol=1e-6)
