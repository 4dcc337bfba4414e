//! The kernel launcher at the FFI edge: `cuLaunchKernel` called straight from libcuda,
//! so a cached launch costs one Python→Rust call instead of CuPy's per-argument boxing
//! (`Function.__call__` wraps every array and NumPy scalar in a Python object per call).
//!
//! Everything constant for one launch of one recipe (function handle, grid, block, dynamic
//! shared memory, the constant scalar arguments' bytes, where the per-call arguments go) is
//! packed once into a [`PreparedLaunch`]; a call copies the packed parameter buffer, writes
//! the device pointers and the per-call scalars (the fusion's scalar inputs, converted as
//! host.py's `np_scalar` converts them) into their slots and launches. libcuda is opened lazily, once, with
//! `libloading`, so the extension imports, and its CPU tests run, on machines without a
//! GPU; there every launch raises `KilnError` and host.py keeps CuPy's launch path.
//!
//! This is the only file of kiln with `unsafe`; every block says why it is sound.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_void, CStr};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use libloading::Library;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyCapsule, PyFloat, PyInt, PyString, PyTuple};
use smallvec::SmallVec;

use super::{guarded, to_py};
use crate::error::KilnError;
use crate::ir::dtype::{DataType, HostNumber};

type CuResult = c_int;
type CuFunction = *mut c_void;
type CuStream = *mut c_void;
type CuContext = *mut c_void;
type CuGraph = *mut c_void;
type CuGraphExec = *mut c_void;
type CuGraphNode = *mut c_void;

// Prototypes as cuda.h (CUDA 12 and 13) declares them; every name below is unversioned
// there (no `_v2` remapping), so dlsym of the plain name is the function cuda.h means.
type LaunchKernelFn = unsafe extern "C" fn(
    CuFunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CuStream,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CuResult;
type MemsetD8AsyncFn = unsafe extern "C" fn(u64, c_uchar, usize, CuStream) -> CuResult;
type GetErrorFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
type InitFn = unsafe extern "C" fn(c_uint) -> CuResult;
type CtxGetCurrentFn = unsafe extern "C" fn(*mut CuContext) -> CuResult;
type CtxSetCurrentFn = unsafe extern "C" fn(CuContext) -> CuResult;
type DeviceGetFn = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
type PrimaryCtxRetainFn = unsafe extern "C" fn(*mut CuContext, c_int) -> CuResult;
type FuncGetParamInfoFn = unsafe extern "C" fn(CuFunction, usize, *mut usize, *mut usize) -> CuResult;
/// `CUDA_KERNEL_NODE_PARAMS_v2` of cuda.h (CUDA 12.0 and later).
#[repr(C)]
struct KernelNodeParams {
    func: CuFunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem_bytes: c_uint,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
    kern: *mut c_void,
    ctx: CuContext,
}
/// `CUDA_MEMSET_NODE_PARAMS` of cuda.h.
#[repr(C)]
struct MemsetNodeParams {
    dst: u64,
    pitch: usize,
    value: c_uint,
    element_size: c_uint,
    width: usize,
    height: usize,
}
type GraphCreateFn = unsafe extern "C" fn(*mut CuGraph, c_uint) -> CuResult;
type GraphAddKernelNodeFn =
    unsafe extern "C" fn(*mut CuGraphNode, CuGraph, *const CuGraphNode, usize, *const KernelNodeParams) -> CuResult;
type GraphAddMemsetNodeFn = unsafe extern "C" fn(
    *mut CuGraphNode,
    CuGraph,
    *const CuGraphNode,
    usize,
    *const MemsetNodeParams,
    CuContext,
) -> CuResult;
type GraphInstantiateFn = unsafe extern "C" fn(*mut CuGraphExec, CuGraph, u64) -> CuResult;
type GraphExecKernelNodeSetParamsFn =
    unsafe extern "C" fn(CuGraphExec, CuGraphNode, *const KernelNodeParams) -> CuResult;
type GraphExecMemsetNodeSetParamsFn =
    unsafe extern "C" fn(CuGraphExec, CuGraphNode, *const MemsetNodeParams, CuContext) -> CuResult;
type GraphLaunchFn = unsafe extern "C" fn(CuGraphExec, CuStream) -> CuResult;
type GraphExecDestroyFn = unsafe extern "C" fn(CuGraphExec) -> CuResult;
type GraphDestroyFn = unsafe extern "C" fn(CuGraph) -> CuResult;
/// `cuStreamIsCapturing(CUstream, CUstreamCaptureStatus*)`.
type StreamIsCapturingFn = unsafe extern "C" fn(CuStream, *mut c_int) -> CuResult;
/// `cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode*)`.
type ThreadExchangeCaptureModeFn = unsafe extern "C" fn(*mut c_int) -> CuResult;

/// The CUDA graph entry points (drivers of CUDA 12.0 and later). cuda.h maps
/// `cuGraphAddKernelNode` and `cuGraphExecKernelNodeSetParams` to their `_v2` symbols (the
/// ones taking `CUDA_KERNEL_NODE_PARAMS_v2`) and `cuGraphInstantiate` to
/// `cuGraphInstantiateWithFlags`, so those are the names looked up.
struct GraphApi {
    create: GraphCreateFn,
    add_kernel_node: GraphAddKernelNodeFn,
    add_memset_node: GraphAddMemsetNodeFn,
    instantiate: GraphInstantiateFn,
    exec_kernel_node_set_params: GraphExecKernelNodeSetParamsFn,
    exec_memset_node_set_params: GraphExecMemsetNodeSetParamsFn,
    launch: GraphLaunchFn,
    exec_destroy: GraphExecDestroyFn,
    destroy: GraphDestroyFn,
    is_capturing: StreamIsCapturingFn,
    exchange_capture_mode: ThreadExchangeCaptureModeFn,
}

/// CuPy's `cupy_backends.cuda.stream.get_current_stream_ptr`, exported through Cython's
/// `__pyx_capi__` under exactly this C signature.
type StreamGetterFn = unsafe extern "C" fn() -> isize;

const STREAM_GETTER_SIGNATURE: &CStr = c"intptr_t (void)";
const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
const CUDA_ERROR_INVALID_CONTEXT: CuResult = 201;
/// The most kernel-parameter bytes any device takes (Volta and later with CUDA 12.1+;
/// older ones take 4 KiB and the driver refuses more at launch).
const MAX_PARAM_BYTES: usize = 32764;
/// Parameter-buffer words and parameters kept on the stack per call; more spill to the heap.
const INLINE_WORDS: usize = 32;
const INLINE_PARAMS: usize = 32;

#[cfg(not(windows))]
const LIBCUDA: &str = "libcuda.so.1";
#[cfg(windows)]
const LIBCUDA: &str = "nvcuda.dll";

/// The driver entry points kiln uses, resolved once.
struct Driver {
    launch_kernel: LaunchKernelFn,
    memset_d8_async: MemsetD8AsyncFn,
    init: InitFn,
    ctx_get_current: CtxGetCurrentFn,
    ctx_set_current: CtxSetCurrentFn,
    device_get: DeviceGetFn,
    primary_ctx_retain: PrimaryCtxRetainFn,
    get_error_name: Option<GetErrorFn>,
    get_error_string: Option<GetErrorFn>,
    /// Only in drivers of CUDA 12.4 and later.
    func_get_param_info: Option<FuncGetParamInfoFn>,
    /// None where the driver lacks any of them (before CUDA 12.0).
    graph: Option<GraphApi>,
    /// Keeps libcuda mapped, which keeps every function pointer above valid; the driver
    /// lives in a static, so it is never dropped.
    _lib: Library,
}

static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

fn load_driver() -> Result<Driver, String> {
    // SAFETY: libcuda is the CUDA driver every CUDA program (CuPy and torch included)
    // loads into its process; its initialisers expect exactly this. When CuPy already
    // loaded it, dlopen only bumps the reference count of the same mapping.
    let lib = unsafe { Library::new(LIBCUDA) }.map_err(|e| format!("cannot load {LIBCUDA}: {e}"))?;
    // SAFETY: each symbol is looked up by its exact, unversioned cuda.h name and given the
    // prototype cuda.h declares for that name (the type aliases above). The function
    // pointers are copied out of their `Symbol`s, which is sound because `_lib` is stored
    // next to them in a `Driver` that lives in a static and is never dropped or unloaded.
    unsafe {
        Ok(Driver {
            launch_kernel: sym::<LaunchKernelFn>(&lib, b"cuLaunchKernel\0")?,
            memset_d8_async: sym::<MemsetD8AsyncFn>(&lib, b"cuMemsetD8Async\0")?,
            init: sym::<InitFn>(&lib, b"cuInit\0")?,
            ctx_get_current: sym::<CtxGetCurrentFn>(&lib, b"cuCtxGetCurrent\0")?,
            ctx_set_current: sym::<CtxSetCurrentFn>(&lib, b"cuCtxSetCurrent\0")?,
            device_get: sym::<DeviceGetFn>(&lib, b"cuDeviceGet\0")?,
            primary_ctx_retain: sym::<PrimaryCtxRetainFn>(&lib, b"cuDevicePrimaryCtxRetain\0")?,
            get_error_name: sym::<GetErrorFn>(&lib, b"cuGetErrorName\0").ok(),
            get_error_string: sym::<GetErrorFn>(&lib, b"cuGetErrorString\0").ok(),
            func_get_param_info: sym::<FuncGetParamInfoFn>(&lib, b"cuFuncGetParamInfo\0").ok(),
            graph: graph_api(&lib).ok(),
            _lib: lib,
        })
    }
}

/// The CUDA graph entry points of `lib`.
///
/// # Safety
/// As [`sym`]: the result must not outlive `lib`.
unsafe fn graph_api(lib: &Library) -> Result<GraphApi, String> {
    // SAFETY: each name is the exact symbol cuda.h maps its API name to (see `GraphApi`),
    // given that symbol's prototype; the caller keeps `lib` loaded.
    unsafe {
        Ok(GraphApi {
            create: sym::<GraphCreateFn>(lib, b"cuGraphCreate\0")?,
            add_kernel_node: sym::<GraphAddKernelNodeFn>(lib, b"cuGraphAddKernelNode_v2\0")?,
            add_memset_node: sym::<GraphAddMemsetNodeFn>(lib, b"cuGraphAddMemsetNode\0")?,
            instantiate: sym::<GraphInstantiateFn>(lib, b"cuGraphInstantiateWithFlags\0")?,
            exec_kernel_node_set_params: sym::<GraphExecKernelNodeSetParamsFn>(
                lib,
                b"cuGraphExecKernelNodeSetParams_v2\0",
            )?,
            exec_memset_node_set_params: sym::<GraphExecMemsetNodeSetParamsFn>(
                lib,
                b"cuGraphExecMemsetNodeSetParams\0",
            )?,
            launch: sym::<GraphLaunchFn>(lib, b"cuGraphLaunch\0")?,
            exec_destroy: sym::<GraphExecDestroyFn>(lib, b"cuGraphExecDestroy\0")?,
            destroy: sym::<GraphDestroyFn>(lib, b"cuGraphDestroy\0")?,
            is_capturing: sym::<StreamIsCapturingFn>(lib, b"cuStreamIsCapturing\0")?,
            exchange_capture_mode: sym::<ThreadExchangeCaptureModeFn>(lib, b"cuThreadExchangeStreamCaptureMode\0")?,
        })
    }
}

/// The symbol `name` (NUL-terminated) of `lib` as a `T`.
///
/// # Safety
/// `T` must be the C prototype of `name`, and the value must not outlive `lib`.
unsafe fn sym<T: Copy>(lib: &Library, name: &[u8]) -> Result<T, String> {
    // SAFETY: upheld by the caller (see above).
    unsafe { lib.get::<T>(name) }.map(|s| *s).map_err(|e| {
        let n = String::from_utf8_lossy(&name[..name.len() - 1]).into_owned();
        format!("{LIBCUDA} has no {n}: {e}")
    })
}

/// The driver, loaded on first use; the load error (no libcuda) is kept and repeated.
fn driver() -> crate::Result<&'static Driver> {
    match DRIVER.get_or_init(load_driver) {
        Ok(d) => Ok(d),
        Err(msg) => Err(KilnError::value(format!("kiln's kernel launcher needs the CUDA driver: {msg}"))),
    }
}

impl Driver {
    fn text(f: Option<GetErrorFn>, code: CuResult) -> Option<String> {
        let f = f?;
        let mut s: *const c_char = ptr::null();
        // SAFETY: cuGetErrorName/cuGetErrorString store a pointer to a static
        // NUL-terminated string, or return an error for an unknown code; the string is
        // read only after success and only when the pointer is non-null.
        unsafe {
            if f(code, &mut s) != CUDA_SUCCESS || s.is_null() {
                return None;
            }
            Some(CStr::from_ptr(s).to_string_lossy().into_owned())
        }
    }

    /// `what` failed with `code`, as a KilnError with the CUresult's name and description.
    fn error(&self, what: &str, code: CuResult) -> KilnError {
        let name = Self::text(self.get_error_name, code).unwrap_or_else(|| "CUDA_ERROR_UNKNOWN_CODE".into());
        let desc = Self::text(self.get_error_string, code).map(|d| format!(": {d}")).unwrap_or_default();
        KilnError::value(format!("{what} failed with {name} (CUresult {code}){desc}"))
    }

    /// Run the driver call `f`; when it fails for want of a context on this thread, adopt
    /// `device`'s primary context and run it once more.
    fn in_context(&self, device: c_int, mut f: impl FnMut() -> CuResult) -> CuResult {
        let rc = f();
        if (rc == CUDA_ERROR_INVALID_CONTEXT || rc == CUDA_ERROR_NOT_INITIALIZED) && self.adopt_primary_context(device)
        {
            return f();
        }
        rc
    }

    /// When no context is current on this thread, make `device`'s primary context current
    /// (what the CUDA runtime does on a thread's first runtime call, and what CuPy's
    /// `_ensure_context` triggers before its launches). True if it made one current.
    fn adopt_primary_context(&self, device: c_int) -> bool {
        if device < 0 {
            return false;
        }
        let mut cur: CuContext = ptr::null_mut();
        let mut dev: c_int = 0;
        let mut ctx: CuContext = ptr::null_mut();
        // SAFETY: plain driver calls with out-pointers to live locals; cuInit is
        // idempotent; the retained primary context is never released, like the runtime's.
        unsafe {
            if (self.ctx_get_current)(&mut cur) == CUDA_SUCCESS && !cur.is_null() {
                return false;
            }
            (self.init)(0) == CUDA_SUCCESS
                && (self.device_get)(&mut dev, device) == CUDA_SUCCESS
                && (self.primary_ctx_retain)(&mut ctx, dev) == CUDA_SUCCESS
                && !ctx.is_null()
                && (self.ctx_set_current)(ctx) == CUDA_SUCCESS
        }
    }
}

/// Open libcuda now: returns None, or raises `KilnError` saying why it cannot be used.
#[pyfunction]
fn load_cuda_driver(py: Python<'_>) -> PyResult<()> {
    guarded(py, || driver().map(|_| ()))
}

/// Whether raw stream `stream` is being captured into a CUDA graph (torch.cuda.graph,
/// CuPy's stream capture); False where the driver cannot say.
#[pyfunction]
fn stream_is_capturing(stream: usize) -> bool {
    let Ok(d) = driver() else { return false };
    let Some(g) = &d.graph else { return false };
    let mut status: c_int = 0;
    // SAFETY: a stream handle the caller owns and an out-pointer to a local.
    let rc = unsafe { (g.is_capturing)(stream as CuStream, &mut status) };
    rc == CUDA_SUCCESS && status != 0
}

/// Set this thread's stream-capture mode to `mode` (0 global, 1 thread-local, 2 relaxed, as
/// `CUstreamCaptureMode`) and return the mode it had; None where the driver cannot.
#[pyfunction]
fn exchange_capture_mode(mode: i32) -> Option<i32> {
    let d = driver().ok()?;
    let g = d.graph.as_ref()?;
    let mut m: c_int = mode;
    // SAFETY: an in/out pointer to a local, as cuda.h declares it.
    let rc = unsafe { (g.exchange_capture_mode)(&mut m) };
    (rc == CUDA_SUCCESS).then_some(m)
}

/// What a per-call argument slot holds: a device pointer, or a scalar of a kiln dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Pointer,
    Scalar(DataType),
}

impl Slot {
    /// The slot of a per-call scalar of kiln dtype `name` (as `np_scalar` names them).
    fn scalar(name: &str) -> Option<Self> {
        DataType::from_enum_name(name).map(Slot::Scalar)
    }

    fn size(self) -> usize {
        match self {
            Slot::Pointer => 8,
            Slot::Scalar(d) => d.size_bytes(),
        }
    }
}

/// The bytes of `v` as a parameter of `slot` (see [`DataType::param_bytes`]).
fn scalar_bytes(slot: Slot, v: HostNumber, to_f64: impl FnOnce() -> crate::Result<f64>) -> crate::Result<[u8; 8]> {
    match slot {
        Slot::Pointer => Err(KilnError::internal("scalar_bytes of a pointer slot")),
        Slot::Scalar(d) => d.param_bytes(v, to_f64),
    }
}

/// Write the low `size` bytes of `src` at byte `off` of the parameter buffer `words`
/// (no unsafe: the word holding them is rebuilt from its bytes).
fn write_bytes(words: &mut [u64], off: usize, size: usize, src: &[u8; 8]) {
    let w = &mut words[off / 8];
    let mut b = w.to_ne_bytes();
    let at = off % 8;
    b[at..at + size].copy_from_slice(&src[..size]);
    *w = u64::from_ne_bytes(b);
}

/// CuPy's current stream, read through `getter` (CuPy's exported C function).
fn read_current_stream(py: Python<'_>, getter: &Option<(usize, Py<PyCapsule>)>) -> PyResult<usize> {
    let Some((getter, _)) = getter else {
        let msg = "this launch was built without CuPy's stream getter; pass the stream";
        return Err(to_py(py, KilnError::value(msg)));
    };
    // SAFETY: the address came from the capsule CuPy exports for
    // `get_current_stream_ptr`, whose name (checked in `PreparedLaunch::new`) is its exact
    // C signature `intptr_t (void)`; the capsule is held by the caller's launch object,
    // and extension modules are never
    // unloaded. The function touches Python state, so it needs the GIL: `py` proves we
    // hold it.
    let s = unsafe {
        let f = std::mem::transmute::<usize, StreamGetterFn>(*getter);
        f()
    };
    // Cython reports an exception through the return value -1 (`except? -1`).
    if s == -1 {
        if let Some(e) = PyErr::take(py) {
            return Err(e);
        }
    }
    Ok(s as usize)
}

/// One kernel launch of one recipe, packed once: function handle, dims, dynamic shared
/// memory and the kernel's parameter buffer with every constant scalar in place; the
/// device pointers and the per-call scalars (the fusion's scalar inputs) are the per-call
/// arguments.
///
/// The function handle is trusted, as every raw CUDA handle is: host.py passes the `ptr`
/// of a CuPy `Function` it keeps alive. Bad device pointers fault on the device (a CUDA
/// error), never in host memory.
#[pyclass(name = "PreparedLaunch", module = "kiln._core", frozen)]
pub struct PreparedLaunch {
    /// The CUfunction handle (CuPy's `Function.ptr`).
    function: usize,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    /// Byte offset and size of every kernel parameter in parameter order, laid out as the
    /// CUDA ABI lays out a parameter buffer: each at its natural alignment.
    layout: Vec<(usize, usize)>,
    /// The parameter buffer with the constant scalars in place and per-call slots zero, in
    /// 8-byte words so that every offset is aligned for the type stored there.
    template: Vec<u64>,
    /// Byte offset and kind of each per-call argument, in call-argument (parameter) order.
    slots: Vec<(usize, Slot)>,
    /// Word index of each per-call pointer, in call-argument order.
    pointer_words: Vec<usize>,
    /// (per-call pointer index, bytes) that `zero` clears.
    memsets: Vec<(usize, usize)>,
    /// CUDA device ordinal whose primary context a thread without a context adopts.
    device: c_int,
    /// CuPy's C function returning its current stream, checked against its signature.
    stream_getter: Option<(usize, Py<PyCapsule>)>,
}

/// Per-call pointers, copied out of the argument tuple.
type Pointers = SmallVec<[u64; 8]>;
/// One call's parameter buffer (on the stack up to `INLINE_WORDS` words).
type Words = SmallVec<[u64; INLINE_WORDS]>;

/// The name of `a`'s type, for error messages.
fn type_name(a: &Bound<'_, PyAny>) -> String {
    a.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

impl PreparedLaunch {
    fn pointers(&self, py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<Pointers> {
        let want = self.pointer_words.len();
        if args.len() != want {
            let msg = format!("this launch takes {want} device pointers, got {}", args.len());
            return Err(to_py(py, KilnError::type_error(msg)));
        }
        let mut out = Pointers::with_capacity(want);
        for (i, a) in args.iter().enumerate() {
            match a.extract::<u64>() {
                Ok(p) => out.push(p),
                Err(_) => {
                    let msg = format!("device pointer {i}: expected an int address, got {}", type_name(&a));
                    return Err(to_py(py, KilnError::type_error(msg)));
                }
            }
        }
        Ok(out)
    }

    /// The parameter buffer of one call: the template with the per-call arguments `args`
    /// (device pointers and scalars, in parameter order) written into their slots.
    fn fill(&self, py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<Words> {
        if args.len() != self.slots.len() {
            let p = self.pointer_words.len();
            let msg = match self.slots.len() - p {
                0 => format!("this launch takes {p} device pointers, got {}", args.len()),
                s => format!("this launch takes {p} device pointers and {s} scalars, got {} arguments", args.len()),
            };
            return Err(to_py(py, KilnError::type_error(msg)));
        }
        let mut words = Words::from_slice(&self.template);
        for (i, (a, &(off, slot))) in args.iter().zip(&self.slots).enumerate() {
            if slot == Slot::Pointer {
                match a.extract::<u64>() {
                    Ok(p) => words[off / 8] = p,
                    Err(_) => {
                        let msg = format!("device pointer {i}: expected an int address, got {}", type_name(&a));
                        return Err(to_py(py, KilnError::type_error(msg)));
                    }
                }
                continue;
            }
            let bytes = Self::scalar(py, i, &a, slot)?;
            write_bytes(&mut words, off, slot.size(), &bytes);
        }
        Ok(words)
    }

    /// Per-call scalar argument `i` (a Python bool, int or float) as `slot`'s bytes.
    fn scalar(py: Python<'_>, i: usize, a: &Bound<'_, PyAny>, slot: Slot) -> PyResult<[u8; 8]> {
        // bool before int: Python's bool is an int subclass.
        let v = if let Ok(b) = a.downcast::<PyBool>() {
            HostNumber::Bool(b.is_true())
        } else if a.is_instance_of::<PyInt>() {
            HostNumber::Int(a.extract::<i64>().ok())
        } else if let Ok(f) = a.downcast::<PyFloat>() {
            HostNumber::Float(f.value())
        } else {
            let msg = format!("scalar argument {i}: expected a Python int, float or bool, got {}", type_name(a));
            return Err(to_py(py, KilnError::type_error(msg)));
        };
        let to_f64 = || {
            a.extract::<f64>()
                .map_err(|e| KilnError::value(format!("int too large to convert to float ({})", e.value(py))))
        };
        scalar_bytes(slot, v, to_f64).map_err(|e| {
            let kind = match slot {
                Slot::Scalar(d) => d.enum_name(),
                Slot::Pointer => "pointer",
            };
            let msg = format!("scalar argument {i} ({kind} parameter): {e}");
            to_py(py, KilnError::value(msg))
        })
    }

    /// kernelParams for cuLaunchKernel: one pointer per parameter into `words`.
    fn param_pointers(&self, words: &mut [u64]) -> SmallVec<[*mut c_void; INLINE_PARAMS]> {
        let base = words.as_mut_ptr().cast::<u8>();
        // wrapping_add: plain address arithmetic, in bounds by construction (offset + size
        // <= template bytes), so no unsafe `add` is needed.
        self.layout.iter().map(|&(off, _)| base.wrapping_add(off).cast::<c_void>()).collect()
    }

    fn current_stream(&self, py: Python<'_>) -> PyResult<usize> {
        read_current_stream(py, &self.stream_getter)
    }

    fn launch_on(&self, py: Python<'_>, stream: usize, args: &Bound<'_, PyTuple>) -> PyResult<()> {
        let words = self.fill(py, args)?;
        guarded(py, || {
            let d = driver()?;
            // The launch only enqueues work, but it blocks when the launch queue is full:
            // let other Python threads run meanwhile (as CuPy does).
            py.allow_threads(|| self.launch_raw(d, stream, words))
        })
    }

    fn launch_raw(&self, d: &Driver, stream: usize, mut words: Words) -> crate::Result<()> {
        let mut params = self.param_pointers(&mut words);
        let call = |params: &mut [*mut c_void]| {
            // SAFETY: `function` is a CUfunction of a module that host.py keeps loaded for
            // as long as this object is reachable (the evaluator caches the CuPy Function,
            // which owns its Module, next to the recipe holding this launch). kernelParams
            // has one entry per kernel parameter, each pointing at `size` initialised bytes
            // inside `words`, which outlives the call; the driver copies the parameters
            // before returning and never writes through them. `extra` is null, as allowed.
            unsafe {
                (d.launch_kernel)(
                    self.function as CuFunction,
                    self.grid[0],
                    self.grid[1],
                    self.grid[2],
                    self.block[0],
                    self.block[1],
                    self.block[2],
                    self.smem,
                    stream as CuStream,
                    params.as_mut_ptr(),
                    ptr::null_mut(),
                )
            }
        };
        let rc = d.in_context(self.device, || call(&mut params));
        if rc != CUDA_SUCCESS {
            return Err(d.error("cuLaunchKernel", rc));
        }
        Ok(())
    }

    fn zero_on(&self, py: Python<'_>, stream: usize, args: &Bound<'_, PyTuple>) -> PyResult<()> {
        let ptrs = self.pointers(py, args)?;
        guarded(py, || {
            let d = driver()?;
            py.allow_threads(|| {
                for &(k, nbytes) in &self.memsets {
                    let call = || {
                        // SAFETY: clears `nbytes` at a device address the caller passes
                        // for a buffer of at least `nbytes` bytes (the plan's size for it),
                        // asynchronously on `stream`; no host memory is touched.
                        unsafe { (d.memset_d8_async)(ptrs[k], 0, nbytes, stream as CuStream) }
                    };
                    let rc = d.in_context(self.device, call);
                    if rc != CUDA_SUCCESS {
                        return Err(d.error("cuMemsetD8Async", rc));
                    }
                }
                Ok(())
            })
        })
    }
}

#[pymethods]
impl PreparedLaunch {
    /// Pack a launch: ``params`` has one entry per kernel parameter, ``None`` for a device
    /// pointer passed per call, a kiln dtype name (``"Float"``, ``"Double"``, ``"Half"``,
    /// ``"BFloat16"``, ``"Int"``, ``"Int32"``, ``"Bool"``) for a scalar passed per call (a
    /// Python bool, int or float, converted as ``np_scalar`` converts it), or a constant
    /// scalar's bytes (1, 2, 4 or 8 of them); a call passes its per-call arguments in
    /// parameter order; ``memsets`` lists (pointer index, bytes) for ``zero``; ``device`` is the CUDA device
    /// ordinal; ``stream_getter`` is CuPy's ``get_current_stream_ptr`` capsule, for
    /// ``launch_current``.
    #[new]
    #[pyo3(signature = (function, grid, block, smem, params, memsets=Vec::new(), device=-1, stream_getter=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        function: usize,
        grid: [u32; 3],
        block: [u32; 3],
        smem: u32,
        params: Vec<Option<Bound<'_, PyAny>>>,
        memsets: Vec<(usize, usize)>,
        device: c_int,
        stream_getter: Option<Bound<'_, PyCapsule>>,
    ) -> PyResult<Self> {
        let getter = match stream_getter {
            None => None,
            Some(cap) => {
                if cap.name()? != Some(STREAM_GETTER_SIGNATURE) {
                    let msg = format!("stream_getter: expected a capsule named {STREAM_GETTER_SIGNATURE:?}");
                    return Err(to_py(py, KilnError::type_error(msg)));
                }
                let p = cap.pointer();
                if p.is_null() {
                    return Err(to_py(py, KilnError::type_error("stream_getter: the capsule holds no function")));
                }
                Some((p as usize, cap.unbind()))
            }
        };
        // Each parameter: Err(slot) for a per-call argument, Ok(bytes) for a constant.
        let mut specs: Vec<Result<Vec<u8>, Slot>> = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let spec = match p {
                None => Err(Slot::Pointer),
                Some(b) if b.is_instance_of::<PyBytes>() => Ok(b.downcast::<PyBytes>()?.as_bytes().to_vec()),
                Some(s) if s.is_instance_of::<PyString>() => {
                    let name = s.downcast::<PyString>()?.to_cow()?;
                    Err(Slot::scalar(&name).ok_or_else(|| {
                        let msg =
                            format!("PreparedLaunch: parameter {i} is a per-call scalar of unknown dtype {name:?}");
                        to_py(py, KilnError::type_error(msg))
                    })?)
                }
                Some(o) => {
                    let msg = format!(
                        "PreparedLaunch: parameter {i} must be None, bytes or a dtype name, got {}",
                        type_name(o)
                    );
                    return Err(to_py(py, KilnError::type_error(msg)));
                }
            };
            specs.push(spec);
        }
        guarded(py, || {
            if function == 0 {
                return Err(KilnError::value("PreparedLaunch: the function handle is null"));
            }
            if grid.contains(&0) || block.contains(&0) {
                return Err(KilnError::value(format!(
                    "PreparedLaunch: grid {grid:?} and block {block:?} must be at least 1 in every dimension"
                )));
            }
            let mut layout = Vec::with_capacity(specs.len());
            let mut bytes: Vec<u8> = Vec::new();
            let mut pointer_offsets = Vec::new();
            let mut slots = Vec::new();
            for (i, p) in specs.iter().enumerate() {
                let size = match p {
                    Ok(b) => b.len(),
                    Err(slot) => slot.size(),
                };
                if !matches!(size, 1 | 2 | 4 | 8) {
                    return Err(KilnError::value(format!(
                        "PreparedLaunch: parameter {i} has {size} bytes; expected 1, 2, 4 or 8"
                    )));
                }
                // Natural alignment, as in the kernel's own parameter buffer.
                let off = bytes.len().div_ceil(size) * size;
                bytes.resize(off + size, 0);
                match p {
                    Ok(v) => bytes[off..off + size].copy_from_slice(v),
                    Err(slot) => {
                        if *slot == Slot::Pointer {
                            pointer_offsets.push(off);
                        }
                        slots.push((off, *slot));
                    }
                }
                layout.push((off, size));
            }
            if bytes.len() > MAX_PARAM_BYTES {
                return Err(KilnError::value(format!(
                    "PreparedLaunch: {} bytes of kernel parameters exceed the {MAX_PARAM_BYTES} any device takes",
                    bytes.len()
                )));
            }
            for &(k, _) in &memsets {
                if k >= pointer_offsets.len() {
                    return Err(KilnError::value(format!(
                        "PreparedLaunch: memset of pointer {k}, but the launch takes {} pointers",
                        pointer_offsets.len()
                    )));
                }
            }
            bytes.resize(bytes.len().div_ceil(8) * 8, 0);
            let template = bytes.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().unwrap_or([0; 8]))).collect();
            Ok(Self {
                function,
                grid,
                block,
                smem,
                layout,
                template,
                slots,
                pointer_words: pointer_offsets.iter().map(|o| o / 8).collect(),
                memsets,
                device,
                stream_getter: getter,
            })
        })
    }

    /// Launch on ``stream`` (a CUstream handle; 0 is the legacy default stream) with the
    /// per-call arguments (device pointers and scalars) in parameter order.
    #[pyo3(signature = (stream, *args))]
    fn launch(&self, py: Python<'_>, stream: usize, args: &Bound<'_, PyTuple>) -> PyResult<()> {
        self.launch_on(py, stream, args)
    }

    /// Launch on CuPy's current stream (read through CuPy's C API, as CuPy's own launches do).
    #[pyo3(signature = (*args))]
    fn launch_current(&self, py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<()> {
        let stream = self.current_stream(py)?;
        self.launch_on(py, stream, args)
    }

    /// Zero the ``memsets`` buffers on ``stream`` (``cuMemsetD8Async``), before a launch;
    /// takes the device pointers only (no scalars).
    #[pyo3(signature = (stream, *pointers))]
    fn zero(&self, py: Python<'_>, stream: usize, pointers: &Bound<'_, PyTuple>) -> PyResult<()> {
        self.zero_on(py, stream, pointers)
    }

    /// ``zero`` on CuPy's current stream.
    #[pyo3(signature = (*pointers))]
    fn zero_current(&self, py: Python<'_>, pointers: &Bound<'_, PyTuple>) -> PyResult<()> {
        let stream = self.current_stream(py)?;
        self.zero_on(py, stream, pointers)
    }

    /// CuPy's current stream as ``launch_current`` reads it (a test hook).
    fn stream(&self, py: Python<'_>) -> PyResult<usize> {
        self.current_stream(py)
    }

    /// The parameter buffer a launch with these per-call arguments passes, read back through
    /// the very kernelParams pointers handed to the driver (a test hook: CUDA ABI layout).
    #[pyo3(signature = (*args))]
    fn packed<'py>(&self, py: Python<'py>, args: &Bound<'py, PyTuple>) -> PyResult<Bound<'py, PyBytes>> {
        let mut words = self.fill(py, args)?;
        let params = self.param_pointers(&mut words);
        let mut out = vec![0u8; self.template.len() * 8];
        for (&p, &(off, size)) in params.iter().zip(&self.layout) {
            // SAFETY: `p` points `off` bytes into `words` (built just above and still
            // alive), and `off + size` is within its length by construction of `layout`;
            // a byte read has no alignment requirement.
            let src = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), size) };
            out[off..off + size].copy_from_slice(src);
        }
        Ok(PyBytes::new(py, &out))
    }

    /// (offset, size) of every kernel parameter in the packed buffer.
    #[getter]
    fn layout(&self) -> Vec<(usize, usize)> {
        self.layout.clone()
    }

    /// Device pointers a call takes.
    #[getter]
    fn pointer_count(&self) -> usize {
        self.pointer_words.len()
    }

    /// Per-call scalars a call takes (after, or among, the pointers in parameter order).
    #[getter]
    fn scalar_count(&self) -> usize {
        self.slots.len() - self.pointer_words.len()
    }

    /// Whether ``launch_current`` can read CuPy's current stream itself.
    #[getter]
    fn stream_getter_used(&self) -> bool {
        self.stream_getter.is_some()
    }

    /// (grid, block, dynamic shared memory bytes).
    #[getter]
    fn dims(&self) -> ([u32; 3], [u32; 3], u32) {
        (self.grid, self.block, self.smem)
    }

    /// The kernel's own parameter layout, [(offset, size)] from ``cuFuncGetParamInfo``
    /// (drivers of CUDA 12.4+; None on older ones). Raises ``KilnError`` when its parameter
    /// count or sizes differ from the packed ones: the driver copies each parameter with the
    /// kernel's size, so those must match; offsets are the driver's business.
    fn verify(&self, py: Python<'_>) -> PyResult<Option<Vec<(usize, usize)>>> {
        guarded(py, || {
            let d = driver()?;
            let Some(info) = d.func_get_param_info else { return Ok(None) };
            let mut kernel: Vec<(usize, usize)> = Vec::new();
            // Only indices below the packed count: probing one past the end would tell a
            // kernel that takes more, but fails a driver call, which compute-sanitizer reports
            // as an error on every prepared launch (kiln's parameter list comes from the same
            // codegen as the kernel, so "more" cannot happen short of a bug).
            while kernel.len() < self.layout.len() {
                let (mut off, mut size) = (0usize, 0usize);
                // SAFETY: a query of a live function handle (see `launch_raw`) with
                // out-pointers to locals; an index past the last parameter is an error
                // return (CUDA_ERROR_INVALID_VALUE), not undefined behaviour.
                let i = kernel.len();
                let rc =
                    d.in_context(self.device, || unsafe { info(self.function as CuFunction, i, &mut off, &mut size) });
                match rc {
                    CUDA_SUCCESS => kernel.push((off, size)),
                    CUDA_ERROR_INVALID_VALUE => break,
                    _ => return Err(d.error(&format!("cuFuncGetParamInfo(parameter {i})"), rc)),
                }
            }
            let sizes = |l: &[(usize, usize)]| l.iter().map(|&(_, s)| s).collect::<Vec<_>>();
            if sizes(&kernel) != sizes(&self.layout) {
                return Err(KilnError::internal(format!(
                    "the kernel's parameters have sizes {:?}, but the launcher packs {:?}",
                    sizes(&kernel),
                    sizes(&self.layout)
                )));
            }
            Ok(Some(kernel))
        })
    }
}

/// One node of a [`GraphLaunch`]: a prepared launch and, per call argument of that launch
/// (pointers then scalars, as `PreparedLaunch.launch` takes them), the index of the graph
/// call's argument that fills it.
struct GraphNode {
    launch: Py<PreparedLaunch>,
    args: Vec<usize>,
    /// (graph argument index, bytes) of each buffer zeroed right before this kernel.
    memsets: Vec<(usize, usize)>,
}

/// The driver objects of an instantiated graph plus the parameters its nodes hold now.
struct GraphState {
    graph: CuGraph,
    exec: CuGraphExec,
    ctx: CuContext,
    kernels: Vec<CuGraphNode>,
    /// Per kernel node: its memset nodes.
    memsets: Vec<Vec<CuGraphNode>>,
    /// Per kernel node: the parameter buffer it holds.
    words: Vec<Words>,
    /// Per kernel node: the address each of its memset nodes clears.
    memset_ptrs: Vec<SmallVec<[u64; 2]>>,
}

// SAFETY: the handles are opaque driver objects that the CUDA driver lets any thread use
// (its API is thread-safe); `GraphLaunch` only touches them with its mutex held.
unsafe impl Send for GraphState {}

impl GraphState {
    /// Build and instantiate the graph of `nodes` with the parameters `words` and memset
    /// addresses `memset_ptrs`: every node depends on the one before (memsets before their
    /// kernel), the order a stream would run them in.
    fn build(
        d: &Driver,
        g: &GraphApi,
        device: c_int,
        nodes: &[GraphNode],
        words: Vec<Words>,
        memset_ptrs: Vec<SmallVec<[u64; 2]>>,
    ) -> crate::Result<Self> {
        let mut ctx: CuContext = ptr::null_mut();
        // SAFETY: an out-pointer to a local.
        let rc = unsafe { (d.ctx_get_current)(&mut ctx) };
        if rc != CUDA_SUCCESS || ctx.is_null() {
            d.adopt_primary_context(device);
            // SAFETY: as above.
            let rc = unsafe { (d.ctx_get_current)(&mut ctx) };
            if rc != CUDA_SUCCESS || ctx.is_null() {
                return Err(KilnError::value("a CUDA graph needs a current CUDA context; none is current"));
            }
        }
        let mut state = GraphState {
            graph: ptr::null_mut(),
            exec: ptr::null_mut(),
            ctx,
            kernels: Vec::with_capacity(nodes.len()),
            memsets: Vec::with_capacity(nodes.len()),
            words,
            memset_ptrs,
        };
        // SAFETY: an out-pointer to the state's field; flags must be 0.
        let rc = unsafe { (g.create)(&mut state.graph, 0) };
        if rc != CUDA_SUCCESS {
            return Err(d.error("cuGraphCreate", rc));
        }
        // From here on, `state` owns the graph: an early return drops (destroys) it.
        let mut last: CuGraphNode = ptr::null_mut();
        for (k, node) in nodes.iter().enumerate() {
            let mut mine = Vec::new();
            for &dst in &state.memset_ptrs[k] {
                let nbytes = node.memsets[mine.len()].1;
                let p = memset_params(dst, nbytes);
                let mut n: CuGraphNode = ptr::null_mut();
                let deps = usize::from(!last.is_null());
                // SAFETY: `state.graph` is a live graph; `deps` is 0 or 1 nodes at `&last`,
                // a node of this graph; the driver copies the parameters before returning.
                let rc = unsafe { (g.add_memset_node)(&mut n, state.graph, &last, deps, &p, state.ctx) };
                if rc != CUDA_SUCCESS {
                    return Err(d.error("cuGraphAddMemsetNode", rc));
                }
                mine.push(n);
                last = n;
            }
            state.memsets.push(mine);
            let pl = node.launch.get();
            let mut words = state.words[k].clone();
            let mut params = pl.param_pointers(&mut words);
            let p = pl.node_params(&mut params);
            let mut n: CuGraphNode = ptr::null_mut();
            let deps = usize::from(!last.is_null());
            // SAFETY: as for the memset node; `p.kernel_params` points at one pointer per
            // kernel parameter into `words`, alive across the call, which copies them
            // (the function handle is kept loaded as for `PreparedLaunch::launch_raw`).
            let rc = unsafe { (g.add_kernel_node)(&mut n, state.graph, &last, deps, &p) };
            if rc != CUDA_SUCCESS {
                return Err(d.error("cuGraphAddKernelNode", rc));
            }
            state.kernels.push(n);
            last = n;
        }
        // SAFETY: an out-pointer to the state's field and the live graph; flags 0.
        let rc = unsafe { (g.instantiate)(&mut state.exec, state.graph, 0) };
        if rc != CUDA_SUCCESS {
            state.exec = ptr::null_mut();
            return Err(d.error("cuGraphInstantiateWithFlags", rc));
        }
        Ok(state)
    }

    /// Give every node whose parameters differ from `words` / `memset_ptrs` the new ones;
    /// returns how many nodes changed.
    fn update(
        &mut self,
        d: &Driver,
        g: &GraphApi,
        nodes: &[GraphNode],
        words: &[Words],
        memset_ptrs: &[SmallVec<[u64; 2]>],
    ) -> crate::Result<u64> {
        let mut changed = 0;
        for (k, node) in nodes.iter().enumerate() {
            for (j, &dst) in memset_ptrs[k].iter().enumerate() {
                if self.memset_ptrs[k][j] == dst {
                    continue;
                }
                let p = memset_params(dst, node.memsets[j].1);
                // SAFETY: a memset node of the graph `exec` was instantiated from, with
                // parameters the driver copies; `ctx` is the context it was built in.
                let rc = unsafe { (g.exec_memset_node_set_params)(self.exec, self.memsets[k][j], &p, self.ctx) };
                if rc != CUDA_SUCCESS {
                    return Err(d.error("cuGraphExecMemsetNodeSetParams", rc));
                }
                self.memset_ptrs[k][j] = dst;
                changed += 1;
            }
            if self.words[k] == words[k] {
                continue;
            }
            let pl = node.launch.get();
            let mut w = words[k].clone();
            let mut params = pl.param_pointers(&mut w);
            let p = pl.node_params(&mut params);
            // SAFETY: a kernel node of the graph `exec` was instantiated from, same function;
            // the parameter pointers point into `w`, alive across the call, which copies them.
            // Launches already enqueued keep their old parameters (the driver's contract).
            let rc = unsafe { (g.exec_kernel_node_set_params)(self.exec, self.kernels[k], &p) };
            if rc != CUDA_SUCCESS {
                return Err(d.error("cuGraphExecKernelNodeSetParams", rc));
            }
            self.words[k] = words[k].clone();
            changed += 1;
        }
        Ok(changed)
    }
}

impl Drop for GraphState {
    fn drop(&mut self) {
        let Ok(d) = driver() else { return };
        let Some(g) = &d.graph else { return };
        // SAFETY: handles this state created and nobody else holds; the driver frees an
        // executable graph that is still running once it completes. Errors (a context
        // already torn down at exit) leave nothing to do.
        unsafe {
            if !self.exec.is_null() {
                (g.exec_destroy)(self.exec);
            }
            if !self.graph.is_null() {
                (g.destroy)(self.graph);
            }
        }
    }
}

/// 1-byte memset node parameters clearing `nbytes` at `dst`.
fn memset_params(dst: u64, nbytes: usize) -> MemsetNodeParams {
    MemsetNodeParams { dst, pitch: nbytes, value: 0, element_size: 1, width: nbytes, height: 1 }
}

impl PreparedLaunch {
    /// The kernel node parameters of this launch with parameter pointers `params`.
    fn node_params(&self, params: &mut [*mut c_void]) -> KernelNodeParams {
        KernelNodeParams {
            func: self.function as CuFunction,
            grid: self.grid,
            block: self.block,
            shared_mem_bytes: self.smem,
            kernel_params: params.as_mut_ptr(),
            extra: ptr::null_mut(),
            kern: ptr::null_mut(),
            ctx: ptr::null_mut(),
        }
    }
}

/// Several prepared launches replayed as one CUDA graph: built and instantiated at the
/// first launch, then each launch updates only the nodes whose arguments (device pointers,
/// scalar values) differ from the ones the graph holds (`cuGraphExecKernelNodeSetParams`,
/// `cuGraphExecMemsetNodeSetParams`) and launches the graph on the given stream. The
/// memsets of each prepared launch are memset nodes right before its kernel.
#[pyclass(name = "GraphLaunch", module = "kiln._core", frozen)]
pub struct GraphLaunch {
    nodes: Vec<GraphNode>,
    /// The kind of each call argument.
    kinds: Vec<Slot>,
    device: c_int,
    stream_getter: Option<(usize, Py<PyCapsule>)>,
    state: Mutex<Option<GraphState>>,
    instantiations: AtomicU64,
    node_updates: AtomicU64,
    replays: AtomicU64,
}

impl GraphLaunch {
    /// Every node's parameter buffer and memset addresses for the call arguments `args`.
    #[allow(clippy::type_complexity)]
    fn fill(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
    ) -> PyResult<(SmallVec<[Words; 4]>, SmallVec<[SmallVec<[u64; 2]>; 4]>)> {
        if args.len() != self.kinds.len() {
            let msg = format!("this graph takes {} arguments, got {}", self.kinds.len(), args.len());
            return Err(to_py(py, KilnError::type_error(msg)));
        }
        let mut vals: SmallVec<[[u8; 8]; 16]> = SmallVec::with_capacity(args.len());
        for (i, (a, &kind)) in args.iter().zip(&self.kinds).enumerate() {
            if kind == Slot::Pointer {
                match a.extract::<u64>() {
                    Ok(p) => vals.push(p.to_ne_bytes()),
                    Err(_) => {
                        let msg = format!("argument {i}: expected an int device address, got {}", type_name(&a));
                        return Err(to_py(py, KilnError::type_error(msg)));
                    }
                }
            } else {
                vals.push(PreparedLaunch::scalar(py, i, &a, kind)?);
            }
        }
        let mut words = SmallVec::with_capacity(self.nodes.len());
        let mut memsets = SmallVec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            let pl = node.launch.get();
            let mut w = Words::from_slice(&pl.template);
            for (&(off, slot), &a) in pl.slots.iter().zip(&node.args) {
                write_bytes(&mut w, off, slot.size(), &vals[a]);
            }
            words.push(w);
            memsets.push(node.memsets.iter().map(|&(a, _)| u64::from_ne_bytes(vals[a])).collect());
        }
        Ok((words, memsets))
    }

    /// Enqueue every node on `stream` as plain memsets and kernel launches.
    fn launch_nodes(
        &self,
        d: &Driver,
        stream: usize,
        words: SmallVec<[Words; 4]>,
        memset_ptrs: &[SmallVec<[u64; 2]>],
    ) -> crate::Result<()> {
        for ((node, w), ptrs) in self.nodes.iter().zip(words).zip(memset_ptrs) {
            for (&dst, &(_, nbytes)) in ptrs.iter().zip(&node.memsets) {
                // SAFETY: as `PreparedLaunch::zero_on`: `dst` is a buffer of at least
                // `nbytes` bytes that the call passed, cleared asynchronously on `stream`.
                let rc =
                    d.in_context(self.device, || unsafe { (d.memset_d8_async)(dst, 0, nbytes, stream as CuStream) });
                if rc != CUDA_SUCCESS {
                    return Err(d.error("cuMemsetD8Async", rc));
                }
            }
            node.launch.get().launch_raw(d, stream, w)?;
        }
        Ok(())
    }

    fn launch_on(&self, py: Python<'_>, stream: usize, args: &Bound<'_, PyTuple>) -> PyResult<()> {
        let (words, memset_ptrs) = self.fill(py, args)?;
        guarded(py, || {
            let d = driver()?;
            let Some(g) = &d.graph else {
                return Err(KilnError::value("this CUDA driver has no CUDA graph API (CUDA 12.0 or later)"));
            };
            py.allow_threads(|| {
                // Node updates and graph builds need a current context: a thread that has
                // none yet adopts the device's primary context first (a no-op otherwise).
                d.adopt_primary_context(self.device);
                let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let fresh = match guard.as_mut() {
                    None => true,
                    // A node the driver refuses to update (it should not happen: same
                    // functions, same context) gets a freshly built graph instead.
                    Some(st) => match st.update(d, g, &self.nodes, &words, &memset_ptrs) {
                        Ok(n) => {
                            self.node_updates.fetch_add(n, Ordering::Relaxed);
                            false
                        }
                        Err(_) => true,
                    },
                };
                // A stream being captured (torch.cuda.graph, CuPy's stream capture) cannot
                // launch a graph: the kernels and memsets are enqueued one by one instead,
                // so that the caller's capture records them.
                let mut status: c_int = 0;
                // SAFETY: a stream handle the caller owns and an out-pointer to a local.
                let rc = unsafe { (g.is_capturing)(stream as CuStream, &mut status) };
                if rc == CUDA_SUCCESS && status != 0 {
                    drop(guard);
                    return self.launch_nodes(d, stream, words, &memset_ptrs);
                }
                if fresh {
                    *guard = None;
                    let st = GraphState::build(d, g, self.device, &self.nodes, words.to_vec(), memset_ptrs.to_vec())?;
                    *guard = Some(st);
                    self.instantiations.fetch_add(1, Ordering::Relaxed);
                }
                let Some(st) = guard.as_ref() else { return Err(KilnError::internal("graph state missing")) };
                // SAFETY: a live executable graph and a stream handle the caller owns (as
                // for `cuLaunchKernel`); the launch is ordered on `stream`.
                let rc = d.in_context(self.device, || unsafe { (g.launch)(st.exec, stream as CuStream) });
                if rc != CUDA_SUCCESS {
                    return Err(d.error("cuGraphLaunch", rc));
                }
                self.replays.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
        })
    }
}

#[pymethods]
impl GraphLaunch {
    /// A graph of ``nodes``: (``PreparedLaunch``, argument indices) pairs in launch order,
    /// where entry ``j`` of the indices says which call argument fills the launch's call
    /// argument ``j`` (pointers then scalars, as ``PreparedLaunch.launch`` takes them); the
    /// stream getter of the first launch serves ``launch_current``.
    #[new]
    fn new(py: Python<'_>, nodes: Vec<(Py<PreparedLaunch>, Vec<usize>)>) -> PyResult<Self> {
        let mut kinds: Vec<Option<Slot>> = Vec::new();
        let mut out = Vec::with_capacity(nodes.len());
        let mut device = -1;
        let mut stream_getter = None;
        for (k, (launch, args)) in nodes.into_iter().enumerate() {
            let pl = launch.get();
            if args.len() != pl.slots.len() {
                let msg =
                    format!("GraphLaunch: node {k} takes {} arguments, got {} indices", pl.slots.len(), args.len());
                return Err(to_py(py, KilnError::value(msg)));
            }
            for (&a, &(_, slot)) in args.iter().zip(&pl.slots) {
                if a >= kinds.len() {
                    kinds.resize(a + 1, None);
                }
                match kinds[a] {
                    None => kinds[a] = Some(slot),
                    Some(s) if s == slot => {}
                    Some(s) => {
                        let msg =
                            format!("GraphLaunch: argument {a} is a {s:?} in one launch and a {slot:?} in another");
                        return Err(to_py(py, KilnError::value(msg)));
                    }
                }
            }
            let pointer_args: Vec<usize> =
                args.iter().zip(&pl.slots).filter(|(_, s)| s.1 == Slot::Pointer).map(|(&a, _)| a).collect();
            let memsets = pl.memsets.iter().map(|&(p, n)| (pointer_args[p], n)).collect();
            if k == 0 {
                device = pl.device;
                stream_getter = pl.stream_getter.as_ref().map(|(f, c)| (*f, c.clone_ref(py)));
            }
            out.push(GraphNode { launch, args, memsets });
        }
        if out.is_empty() {
            return Err(to_py(py, KilnError::value("GraphLaunch: a graph needs at least one launch")));
        }
        let Some(kinds) = kinds.into_iter().collect::<Option<Vec<_>>>() else {
            return Err(to_py(py, KilnError::value("GraphLaunch: an argument index is used by no launch")));
        };
        Ok(Self {
            nodes: out,
            kinds,
            device,
            stream_getter,
            state: Mutex::new(None),
            instantiations: AtomicU64::new(0),
            node_updates: AtomicU64::new(0),
            replays: AtomicU64::new(0),
        })
    }

    /// Launch the graph on ``stream`` with this call's arguments.
    #[pyo3(signature = (stream, *args))]
    fn launch(&self, py: Python<'_>, stream: usize, args: &Bound<'_, PyTuple>) -> PyResult<()> {
        self.launch_on(py, stream, args)
    }

    /// Launch the graph on CuPy's current stream.
    #[pyo3(signature = (*args))]
    fn launch_current(&self, py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<()> {
        let stream = read_current_stream(py, &self.stream_getter)?;
        self.launch_on(py, stream, args)
    }

    /// Whether ``launch_current`` can read CuPy's current stream itself.
    #[getter]
    fn stream_getter_used(&self) -> bool {
        self.stream_getter.is_some()
    }

    /// Arguments a call takes.
    #[getter]
    fn argument_count(&self) -> usize {
        self.kinds.len()
    }

    /// Kernel nodes of the graph.
    #[getter]
    fn kernel_count(&self) -> usize {
        self.nodes.len()
    }

    /// Times the graph was built and instantiated.
    #[getter]
    fn instantiations(&self) -> u64 {
        self.instantiations.load(Ordering::Relaxed)
    }

    /// Node parameter updates made so far (kernel and memset nodes).
    #[getter]
    fn node_updates(&self) -> u64 {
        self.node_updates.load(Ordering::Relaxed)
    }

    /// Graph launches so far.
    #[getter]
    fn replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// The parameter buffer of each kernel node for these call arguments (a test hook,
    /// no driver call).
    #[pyo3(signature = (*args))]
    fn packed<'py>(&self, py: Python<'py>, args: &Bound<'py, PyTuple>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let (words, _) = self.fill(py, args)?;
        Ok(words
            .iter()
            .map(|w| {
                let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_ne_bytes()).collect();
                PyBytes::new(py, &bytes)
            })
            .collect())
    }

    /// (argument index, bytes) of each memset node, per kernel node.
    #[getter]
    fn memsets(&self) -> Vec<Vec<(usize, usize)>> {
        self.nodes.iter().map(|n| n.memsets.clone()).collect()
    }
}

/// Register the launcher on the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PreparedLaunch>()?;
    m.add_class::<GraphLaunch>()?;
    m.add_function(wrap_pyfunction!(load_cuda_driver, m)?)?;
    m.add_function(wrap_pyfunction!(stream_is_capturing, m)?)?;
    m.add_function(wrap_pyfunction!(exchange_capture_mode, m)?)?;
    Ok(())
}
