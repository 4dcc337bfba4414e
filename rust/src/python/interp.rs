//! Bindings of the CPU interpreter (`kiln._core.execute_cpu`): NumPy arrays in, NumPy
//! arrays out. Conversion only; the interpreter lives in `crate::interp`.

use half::{bf16, f16};
use numpy::ndarray::{ArrayD, IxDyn, ShapeBuilder};
use numpy::{Element, PyArray, PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt};

use super::{guarded, to_py, PyKernel};
use crate::error::KilnError;
use crate::interp::{execute, Data, HostTensor, HostValue, ScalarValue};

/// Read a NumPy array of element type `T`, keeping its (non-negative) strides.
fn read_array<T: Element + Copy + Default>(
    x: &Bound<'_, PyAny>,
    what: &str,
    wrap: impl Fn(Vec<T>) -> Data,
) -> PyResult<HostTensor> {
    let arr = x.downcast::<PyArrayDyn<T>>()?;
    let ro = arr.readonly();
    let view = ro.as_array();
    let shape: Vec<usize> = view.shape().to_vec();
    let strides: Vec<isize> = view.strides().to_vec();
    // A huge (say, broadcast) view would take forever to copy: the interpreter's limit.
    let count = shape.iter().try_fold(1usize, |a, &n| a.checked_mul(n));
    if count.is_none_or(|n| n as i64 > crate::interp::MAX_HOST_ELEMENTS) {
        return Err(crate::python::to_py(
            x.py(),
            KilnError::value(format!(
                "{what}: an array of shape {shape:?}; the CPU interpreter takes at most 2^31 elements per tensor (run it on a GPU)"
            )),
        ));
    }
    if let Some(s) = view.as_slice() {
        return Ok(HostTensor::contiguous(wrap(s.to_vec()), shape));
    }
    if strides.iter().any(|&s| s < 0) || shape.contains(&0) {
        let v: Vec<T> = view.iter().copied().collect();
        return Ok(HostTensor::contiguous(wrap(v), shape));
    }
    // A strided view: keep its layout so the kernel's runtime strides are the array's.
    let span = shape
        .iter()
        .zip(&strides)
        .try_fold(1usize, |a, (&n, &s)| (n - 1).checked_mul(s as usize).and_then(|x| a.checked_add(x)));
    let too_far = |n: String| {
        crate::python::to_py(
            x.py(),
            KilnError::value(format!(
                "{what}: a strided view of shape {shape:?} whose elements lie {n} places apart end to end; the CPU interpreter keeps a view's layout and takes at most 2^31 places (pass a contiguous copy, or run it on a GPU)"
            )),
        )
    };
    let span = match span {
        Some(n) if n as i64 <= crate::interp::MAX_HOST_ELEMENTS => n,
        Some(n) => return Err(too_far(n.to_string())),
        None => return Err(too_far("more than 2^64".into())),
    };
    // (An allocation that fails is an error, not an abort of the process.)
    let mut data: Vec<T> = Vec::new();
    data.try_reserve_exact(span).map_err(|_| too_far(format!("{span} (more than this machine can hold)")))?;
    data.resize(span, T::default());
    for (idx, &v) in view.indexed_iter() {
        let off: usize = (0..shape.len()).map(|k| idx[k] * strides[k] as usize).sum();
        data[off] = v;
    }
    Ok(HostTensor { data: wrap(data), shape, strides: strides.iter().map(|&s| s as i64).collect() })
}

fn to_value(py: Python<'_>, i: usize, what: &str, x: &Bound<'_, PyAny>, bf16_bits: bool) -> PyResult<HostValue> {
    if let Ok(a) = x.downcast::<PyUntypedArray>() {
        if a.ndim() > MAX_RANK {
            return Err(to_py(py, rank_error(what, a.ndim())));
        }
        let name: String = x.getattr("dtype")?.getattr("name")?.extract()?;
        // Without ml_dtypes a bfloat16 result comes back as its uint16 bits; the next kernel
        // of a host program reads it so.
        let name = if bf16_bits && name == "uint16" { "bfloat16".to_string() } else { name };
        let t = match name.as_str() {
            "float32" => read_array::<f32>(x, what, Data::F32)?,
            "float64" => read_array::<f64>(x, what, Data::F64)?,
            "int64" => read_array::<i64>(x, what, Data::I64)?,
            "int32" => read_array::<i32>(x, what, Data::I32)?,
            // Read as bytes: NumPy counts any nonzero byte as true (a uint8 array viewed as
            // bool), while a Rust bool must be 0 or 1.
            "bool" => read_array::<u8>(&x.call_method1("view", ("uint8",))?, what, |v| {
                Data::Bool(v.into_iter().map(|b| b != 0).collect())
            })?,
            "float16" => read_array::<u16>(&x.call_method1("view", ("uint16",))?, what, |v| {
                Data::F16(v.into_iter().map(f16::from_bits).collect())
            })?,
            "bfloat16" => read_array::<u16>(&x.call_method1("view", ("uint16",))?, what, |v| {
                Data::BF16(v.into_iter().map(bf16::from_bits).collect())
            })?,
            other => {
                return Err(to_py(
                    py,
                    KilnError::type_error(format!(
                        "input {i}: unsupported dtype {other}; expected float32, float64, float16, bfloat16, int64, int32 or bool"
                    )),
                ))
            }
        };
        return Ok(HostValue::Tensor(t));
    }
    if x.is_instance_of::<PyBool>() {
        return Ok(HostValue::Scalar(ScalarValue::Bool(x.extract()?)));
    }
    if x.is_instance_of::<PyInt>() {
        return Ok(HostValue::Scalar(ScalarValue::Int(x.extract()?)));
    }
    if x.is_instance_of::<PyFloat>() {
        return Ok(HostValue::Scalar(ScalarValue::Float(x.extract()?)));
    }
    Err(to_py(
        py,
        KilnError::type_error(format!(
            "input {i}: expected a NumPy array or a Python number, got {}",
            x.get_type().name()?
        )),
    ))
}

fn owned<'py, T: Element>(
    py: Python<'py>,
    what: &str,
    v: Vec<T>,
    shape: &[usize],
    strides: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    // NumPy refuses (and its refusal, unchecked by the bindings, crashed the process) an array
    // whose non-empty axes span more than isize::MAX bytes, even with another axis empty.
    let span = shape
        .iter()
        .filter(|&&n| n != 0)
        .try_fold(std::mem::size_of::<T>(), |a, &n| a.checked_mul(n))
        .filter(|&b| b <= isize::MAX as usize);
    if span.is_none() {
        return Err(to_py(
            py,
            KilnError::value(format!(
                "{what} of shape {shape:?}: NumPy cannot hold an array whose non-empty axes span more than \
                 2^63 bytes, even with no element"
            )),
        ));
    }
    // ndarray refuses explicit strides for an empty shape: an empty array takes its default.
    let a = if shape.contains(&0) {
        ArrayD::from_shape_vec(IxDyn(shape), v)
    } else {
        ArrayD::from_shape_vec(IxDyn(shape).strides(IxDyn(strides)), v)
    }
    .map_err(|e| {
        to_py(py, KilnError::internal(format!("interpreter output layout: {e} (shape {shape:?}, strides {strides:?})")))
    })?;
    Ok(PyArray::from_owned_array(py, a).into_any())
}

/// The most axes an array the interpreter reads or returns may have (what the NumPy
/// bindings convert; NumPy 2 arrays may have up to 64).
const MAX_RANK: usize = 32;

fn rank_error(what: &str, rank: usize) -> KilnError {
    KilnError::value(format!("{what} has {rank} axes; the CPU interpreter takes arrays of at most {MAX_RANK} axes"))
}

fn to_numpy(py: Python<'_>, what: &str, t: HostTensor) -> PyResult<PyObject> {
    if t.shape.len() > MAX_RANK {
        return Err(to_py(py, rank_error("an output", t.shape.len())));
    }
    let strides: Vec<usize> = t.strides.iter().map(|&s| s.max(0) as usize).collect();
    let shape = t.shape;
    let a = match t.data {
        Data::F32(v) => owned(py, what, v, &shape, &strides)?,
        Data::F64(v) => owned(py, what, v, &shape, &strides)?,
        Data::I64(v) => owned(py, what, v, &shape, &strides)?,
        Data::I32(v) => owned(py, what, v, &shape, &strides)?,
        Data::Bool(v) => owned(py, what, v, &shape, &strides)?,
        Data::F16(v) => {
            let bits: Vec<u16> = v.into_iter().map(f16::to_bits).collect();
            owned(py, what, bits, &shape, &strides)?.call_method1("view", ("float16",))?
        }
        Data::BF16(v) => {
            let bits: Vec<u16> = v.into_iter().map(bf16::to_bits).collect();
            let a = owned(py, what, bits, &shape, &strides)?;
            match py.import("ml_dtypes").and_then(|m| m.getattr("bfloat16")) {
                Ok(dt) => a.call_method1("view", (dt,))?,
                Err(_) => a,
            }
        }
    };
    Ok(a.unbind())
}

/// Run a lowered kernel on the CPU: NumPy arrays (and Python numbers for scalar
/// inputs) in fusion-input order; returns the outputs as NumPy arrays.
#[pyfunction]
fn execute_cpu(py: Python<'_>, kernel: &PyKernel, inputs: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<PyObject>> {
    let f = &kernel.inner.fusion;
    let tensor_dtypes: Vec<crate::ir::DataType> =
        f.inputs.iter().filter_map(|o| o.tensor()).map(|t| f.tvs[t].dtype).collect();
    let mut vals = Vec::with_capacity(inputs.len());
    for (i, x) in inputs.iter().enumerate() {
        let bf16_bits = tensor_dtypes.get(i) == Some(&crate::ir::DataType::BFloat16);
        let what = match f.inputs.get(i) {
            Some(crate::ir::Operand::Tensor(t)) => format!("input {i} ({})", f.user_tv_name(*t)),
            _ => format!("input {i}"),
        };
        vals.push(to_value(py, i, &what, x, bf16_bits)?);
    }
    let outs = guarded(py, || execute(&kernel.inner, vals))?;
    let names: Vec<String> = f.outputs.iter().map(|&t| format!("output {}", f.user_tv_name(t))).collect();
    outs.into_iter()
        .enumerate()
        .map(|(i, t)| to_numpy(py, names.get(i).map_or("an output", String::as_str), t))
        .collect()
}

/// Register the interpreter's functions on the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(execute_cpu, m)?)?;
    Ok(())
}
