//! PyO3 bindings: convert Python arguments, delegate to the Rust core, convert
//! errors. No compiler logic lives here. Every entry point runs under a panic guard
//! so a compiler bug surfaces as `KilnError`, never as a crashed interpreter.

use std::panic::{catch_unwind, AssertUnwindSafe};

mod interp;
mod launch;
mod mesh;
mod versioned;

use pyo3::prelude::*;
use pyo3::types::PyModule;

use crate::error::{ErrorKind, KilnError};
use crate::ir::ops::reduction_name;
use crate::ir::{
    BinaryOp, DataType, Fusion, IterDomainId, IterType, MemoryType, Operand, ParallelType, ReductionOp, TvId, UnaryOp,
    ValId,
};

/// Raise `err` as `kiln.KilnError`, `kiln.KilnTypeError` or, for a kiln bug,
/// `kiln.KilnInternalError`.
pub(crate) fn to_py(py: Python<'_>, err: KilnError) -> PyErr {
    let class = match err.kind {
        ErrorKind::Type => "KilnTypeError",
        ErrorKind::Internal => "KilnInternalError",
        _ => "KilnError",
    };
    match py.import("kiln._errors").and_then(|m| m.getattr(class)) {
        Ok(cls) => PyErr::from_value(
            cls.call1((err.to_string(),)).unwrap_or_else(|e| e.into_value(py).into_bound(py).into_any()),
        ),
        Err(e) => e,
    }
}

/// Per-input (sizes, strides) lists as input descriptions; the two lists must pair up.
fn input_descs(sizes: Vec<Vec<i64>>, strides: Vec<Vec<i64>>) -> crate::Result<Vec<crate::host::eval::InputDesc>> {
    if sizes.len() != strides.len() {
        return Err(KilnError::value(format!("{} size lists but {} stride lists", sizes.len(), strides.len())));
    }
    Ok(sizes.into_iter().zip(strides).map(|(sizes, strides)| crate::host::eval::InputDesc { sizes, strides }).collect())
}

/// Run `f`, turning both `KilnError`s and panics into Python exceptions.
pub(crate) fn guarded<T>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(to_py(py, KilnError::internal(format!("panic in the Rust core: {msg}"))))
        }
    }
}

fn parse_enum<T>(what: &str, name: &str, f: impl Fn(&str) -> Option<T>) -> crate::Result<T> {
    f(name).ok_or_else(|| KilnError::type_error(format!("unknown {what} {name:?}")))
}

/// An operand as Python passes it: (is_tensor, id).
type PyOperand = (bool, u32);

/// A tensor that reads an input at another shape: (name, input position, shape, the input
/// axis each view axis reads through its stride where the view is strided).
type InputView = (String, usize, Vec<i64>, Option<Vec<Option<usize>>>);

fn py_operand(o: Operand) -> PyOperand {
    match o {
        Operand::Tensor(t) => (true, t.as_u32()),
        Operand::Scalar(v) => (false, v.as_u32()),
    }
}

/// The fusion arena, owned by a Python `FusionDefinition`.
#[pyclass(name = "Fusion", module = "kiln._core")]
pub struct PyFusion {
    inner: versioned::Versioned,
}

impl PyFusion {
    fn tv(&self, t: u32) -> crate::Result<TvId> {
        if (t as usize) < self.inner.get().tvs.len() {
            Ok(TvId::from_u32(t))
        } else {
            Err(KilnError::value(format!("T{t} is not a tensor of this fusion")))
        }
    }
    fn val(&self, v: u32) -> crate::Result<ValId> {
        if (v as usize) < self.inner.get().scalars.len() {
            Ok(ValId::from_u32(v))
        } else {
            Err(KilnError::value(format!("scalar {v} is not a scalar of this fusion")))
        }
    }
    fn id(&self, i: u32) -> crate::Result<IterDomainId> {
        if (i as usize) < self.inner.get().ids.len() {
            Ok(IterDomainId::from_u32(i))
        } else {
            Err(KilnError::value(format!("iter domain {i} is not part of this fusion")))
        }
    }
    fn operand(&self, o: PyOperand) -> crate::Result<Operand> {
        Ok(if o.0 { Operand::Tensor(self.tv(o.1)?) } else { Operand::Scalar(self.val(o.1)?) })
    }
}

#[pymethods]
impl PyFusion {
    #[new]
    fn new() -> Self {
        Self { inner: versioned::Versioned::new(Fusion::new()) }
    }

    /// Declare a tensor input; returns its tensor id.
    #[pyo3(signature = (shape, dtype, contiguity=None))]
    fn define_tensor(
        &mut self,
        py: Python<'_>,
        shape: Vec<i64>,
        dtype: &str,
        contiguity: Option<Vec<Option<bool>>>,
    ) -> PyResult<u32> {
        guarded(py, || {
            let dt = Fusion::parse_dtype(dtype)?;
            Ok(self.inner.get_mut().define_tensor(&shape, dt, contiguity.as_deref())?.as_u32())
        })
    }

    /// Declare a runtime scalar input; returns its scalar id.
    fn define_scalar(&mut self, py: Python<'_>, dtype: &str) -> PyResult<u32> {
        guarded(py, || Ok(self.inner.get_mut().define_scalar_input(Fusion::parse_dtype(dtype)?).as_u32()))
    }

    /// An integer constant scalar.
    fn const_int(&mut self, v: i64) -> u32 {
        self.inner.get_mut().scalars.int(v).as_u32()
    }
    /// A float constant scalar.
    fn const_float(&mut self, v: f64) -> u32 {
        self.inner.get_mut().scalars.float(v).as_u32()
    }
    /// A bool constant scalar.
    fn const_bool(&mut self, v: bool) -> u32 {
        self.inner.get_mut().scalars.boolean(v).as_u32()
    }

    /// Element-wise unary op by name.
    fn unary(&mut self, py: Python<'_>, op: &str, x: PyOperand) -> PyResult<u32> {
        guarded(py, || {
            let u = parse_enum("unary op", op, UnaryOp::from_name)?;
            let x = self.operand(x)?;
            Ok(self.inner.get_mut().unary(u, x)?.as_u32())
        })
    }

    /// Element-wise unary op by name on any operand: (is_tensor, id) of the result (a
    /// constant folds to a scalar).
    fn unary_value(&mut self, py: Python<'_>, op: &str, x: PyOperand) -> PyResult<PyOperand> {
        guarded(py, || {
            let u = parse_enum("unary op", op, UnaryOp::from_name)?;
            let x = self.operand(x)?;
            Ok(py_operand(self.inner.get_mut().unary_value(u, x)?))
        })
    }

    /// Element-wise binary op by name on any operands: (is_tensor, id) of the result
    /// (constants fold, integer scalar arithmetic stays a scalar).
    fn binary_value(&mut self, py: Python<'_>, op: &str, a: PyOperand, b: PyOperand) -> PyResult<PyOperand> {
        guarded(py, || {
            let o = parse_enum("binary op", op, BinaryOp::from_name)?;
            let (a, b) = (self.operand(a)?, self.operand(b)?);
            Ok(py_operand(self.inner.get_mut().binary_value(o, a, b)?))
        })
    }

    /// The size of axis `dim` of tensor `t` (reduced axes not counted) as a scalar id.
    fn axis_size(&self, py: Python<'_>, t: u32, dim: i64) -> PyResult<u32> {
        guarded(py, || {
            let f = self.inner.get();
            let tv = self.tv(t)?;
            let axes = f.no_reduction_logical(tv);
            let rank = axes.len() as i64;
            let d = if dim < 0 { dim + rank } else { dim };
            if !(0..rank).contains(&d) {
                return Err(crate::error::KilnError::value(format!(
                    "size: axis {dim} is out of range for {} of rank {rank}",
                    f.tv_name(tv)
                )));
            }
            Ok(f.ids[axes[d as usize]].extent.as_u32())
        })
    }

    /// Element-wise binary op by name.
    fn binary(&mut self, py: Python<'_>, op: &str, a: PyOperand, b: PyOperand) -> PyResult<u32> {
        guarded(py, || {
            let o = parse_enum("binary op", op, BinaryOp::from_name)?;
            let (a, b) = (self.operand(a)?, self.operand(b)?);
            Ok(self.inner.get_mut().binary(o, a, b)?.as_u32())
        })
    }

    /// `where(cond, a, b)`.
    fn where_(&mut self, py: Python<'_>, c: PyOperand, a: PyOperand, b: PyOperand) -> PyResult<u32> {
        guarded(py, || {
            let (c, a, b) = (self.operand(c)?, self.operand(a)?, self.operand(b)?);
            Ok(self.inner.get_mut().where_(c, a, b)?.as_u32())
        })
    }

    /// Cast to a dtype.
    fn cast(&mut self, py: Python<'_>, x: PyOperand, dtype: &str) -> PyResult<u32> {
        guarded(py, || {
            let x = self.operand(x)?;
            Ok(self.inner.get_mut().cast(x, Fusion::parse_dtype(dtype)?)?.as_u32())
        })
    }

    /// Reduction (`sum`, `max`, `min`) over dims.
    #[pyo3(signature = (op, x, dims, keepdim, dtype=None))]
    fn reduction(
        &mut self,
        py: Python<'_>,
        op: &str,
        x: u32,
        dims: Vec<i64>,
        keepdim: bool,
        dtype: Option<&str>,
    ) -> PyResult<u32> {
        guarded(py, || {
            let r = parse_enum("reduction", op, |n| {
                [ReductionOp::Sum, ReductionOp::Max, ReductionOp::Min, ReductionOp::Prod, ReductionOp::LogSumExp]
                    .into_iter()
                    .find(|&r| reduction_name(r) == n)
            })?;
            let dt = dtype.map(Fusion::parse_dtype).transpose()?;
            let x = self.tv(x)?;
            Ok(self.inner.get_mut().reduction(r, x, &dims, keepdim, dt)?.as_u32())
        })
    }

    /// nvFuser-style broadcast_in_dim.
    fn broadcast_in_dim(&mut self, py: Python<'_>, x: u32, shape: Vec<i64>, broadcast_dims: Vec<i64>) -> PyResult<u32> {
        guarded(py, || {
            let x = self.tv(x)?;
            Ok(self.inner.get_mut().broadcast_in_dim(x, &shape, &broadcast_dims)?.as_u32())
        })
    }

    /// Permute axes.
    fn permute(&mut self, py: Python<'_>, x: u32, dims: Vec<i64>) -> PyResult<u32> {
        guarded(py, || {
            let x = self.tv(x)?;
            Ok(self.inner.get_mut().permute(x, &dims)?.as_u32())
        })
    }

    /// Drop size-one axes.
    fn squeeze(&mut self, py: Python<'_>, x: u32, dims: Vec<i64>) -> PyResult<u32> {
        guarded(py, || {
            let x = self.tv(x)?;
            Ok(self.inner.get_mut().squeeze(x, &dims)?.as_u32())
        })
    }

    /// index_select along dim.
    fn index_select(&mut self, py: Python<'_>, x: u32, index: u32, dim: i64) -> PyResult<u32> {
        guarded(py, || {
            let (x, i) = (self.tv(x)?, self.tv(index)?);
            Ok(self.inner.get_mut().index_select(x, i, dim)?.as_u32())
        })
    }

    /// `x` in a new shape (scalar ids; `None` is the inferred size).
    fn reshape(&mut self, py: Python<'_>, x: u32, shape: Vec<Option<u32>>) -> PyResult<u32> {
        guarded(py, || {
            let x = self.tv(x)?;
            let shape =
                shape.into_iter().map(|s| s.map(|v| self.val(v)).transpose()).collect::<crate::Result<Vec<_>>>()?;
            Ok(self.inner.get_mut().reshape(x, &shape)?.as_u32())
        })
    }

    /// Requires `x`'s sizes to be `sizes` (scalar ids; `None` is not checked), as `op` was told.
    fn require_shape(&mut self, py: Python<'_>, x: u32, sizes: Vec<Option<u32>>, op: &str) -> PyResult<()> {
        guarded(py, || {
            let x = self.tv(x)?;
            let sizes =
                sizes.into_iter().map(|s| s.map(|v| self.val(v)).transpose()).collect::<crate::Result<Vec<_>>>()?;
            self.inner.get_mut().require_shape(x, &sizes, op)
        })
    }

    /// `x[start:end:step]` per axis (scalar ids; an end of `None` is the size).
    fn slice(
        &mut self,
        py: Python<'_>,
        x: u32,
        start: Vec<u32>,
        end: Vec<Option<u32>>,
        step: Vec<i64>,
    ) -> PyResult<u32> {
        guarded(py, || {
            let x = self.tv(x)?;
            let start = start.into_iter().map(|v| self.val(v)).collect::<crate::Result<Vec<_>>>()?;
            let end = end.into_iter().map(|e| e.map(|v| self.val(v)).transpose()).collect::<crate::Result<Vec<_>>>()?;
            Ok(self.inner.get_mut().slice(x, &start, &end, &step)?.as_u32())
        })
    }

    /// `x` padded by (before, after) scalar ids per axis, with `value`.
    fn pad(&mut self, py: Python<'_>, x: u32, widths: Vec<(u32, u32)>, value: PyOperand) -> PyResult<u32> {
        guarded(py, || {
            let x = self.tv(x)?;
            let widths =
                widths.into_iter().map(|(a, b)| Ok((self.val(a)?, self.val(b)?))).collect::<crate::Result<Vec<_>>>()?;
            let value = self.operand(value)?;
            Ok(self.inner.get_mut().pad(x, &widths, value)?.as_u32())
        })
    }

    /// `x` at `index` (a scalar id) of axis `dim`, that axis removed.
    fn select(&mut self, py: Python<'_>, x: u32, dim: i64, index: u32) -> PyResult<u32> {
        guarded(py, || {
            let (x, i) = (self.tv(x)?, self.val(index)?);
            Ok(self.inner.get_mut().select(x, dim, i)?.as_u32())
        })
    }

    /// `xs` joined along `dim`.
    fn cat(&mut self, py: Python<'_>, xs: Vec<u32>, dim: i64) -> PyResult<u32> {
        guarded(py, || {
            let xs = xs.into_iter().map(|x| self.tv(x)).collect::<crate::Result<Vec<_>>>()?;
            Ok(self.inner.get_mut().cat(&xs, dim)?.as_u32())
        })
    }

    /// The upper triangle of the last two axes.
    fn triu(&mut self, py: Python<'_>, x: u32, diagonal: i64) -> PyResult<u32> {
        guarded(py, || {
            let x = self.tv(x)?;
            Ok(self.inner.get_mut().triu(x, diagonal)?.as_u32())
        })
    }

    /// `x` read along `dim` at `index`'s positions; `index` has `x`'s rank (size-one axes broadcast).
    fn take_along_axis(&mut self, py: Python<'_>, x: u32, index: u32, dim: i64) -> PyResult<u32> {
        guarded(py, || {
            let (x, i) = (self.tv(x)?, self.tv(index)?);
            Ok(self.inner.get_mut().take_along_axis(x, i, dim)?.as_u32())
        })
    }

    /// A filled tensor; `shape` holds scalar ids of the extents.
    fn full(&mut self, py: Python<'_>, shape: Vec<u32>, value: PyOperand, dtype: &str) -> PyResult<u32> {
        guarded(py, || {
            let shape = shape.into_iter().map(|v| self.val(v)).collect::<crate::Result<Vec<_>>>()?;
            let value = self.operand(value)?;
            Ok(self.inner.get_mut().full(&shape, value, Fusion::parse_dtype(dtype)?)?.as_u32())
        })
    }

    /// `length` (a scalar id) elements `start + i * step`.
    fn iota(&mut self, py: Python<'_>, length: u32, start: PyOperand, step: PyOperand, dtype: &str) -> PyResult<u32> {
        guarded(py, || {
            let (length, start, step) = (self.val(length)?, self.operand(start)?, self.operand(step)?);
            Ok(self.inner.get_mut().iota(length, start, step, Fusion::parse_dtype(dtype)?)?.as_u32())
        })
    }

    /// Random numbers (`dist` "uniform" or "normal"); `shape` holds scalar ids.
    #[allow(clippy::too_many_arguments)]
    fn random(
        &mut self,
        py: Python<'_>,
        dist: &str,
        shape: Vec<u32>,
        a: PyOperand,
        b: PyOperand,
        seed: PyOperand,
        offset: PyOperand,
        dtype: &str,
    ) -> PyResult<u32> {
        guarded(py, || {
            let dist = match dist {
                "uniform" => crate::ir::RandomDist::Uniform,
                "normal" => crate::ir::RandomDist::Normal,
                other => return Err(crate::error::KilnError::value(format!("unknown distribution {other:?}"))),
            };
            let shape = shape.into_iter().map(|v| self.val(v)).collect::<crate::Result<Vec<_>>>()?;
            let (a, b) = (self.operand(a)?, self.operand(b)?);
            let (seed, offset) = (self.operand(seed)?, self.operand(offset)?);
            let dt = Fusion::parse_dtype(dtype)?;
            Ok(self.inner.get_mut().random(dist, &shape, a, b, seed, offset, dt)?.as_u32())
        })
    }

    /// Mark `t` as an output written into input `inp`'s buffer.
    fn add_output_alias(&mut self, py: Python<'_>, t: u32, inp: u32) -> PyResult<()> {
        guarded(py, || {
            let (t, inp) = (self.tv(t)?, self.tv(inp)?);
            self.inner.get_mut().add_output_alias(t, inp)
        })
    }

    /// In-place outputs: (output position, input position) pairs.
    fn aliases(&self) -> Vec<(usize, usize)> {
        let f = self.inner.get();
        f.aliases
            .iter()
            .filter_map(|&(o, i)| {
                let op = f.outputs.iter().position(|&x| x == o)?;
                let ip = f.inputs.iter().position(|&x| x == Operand::Tensor(i))?;
                Some((op, ip))
            })
            .collect()
    }

    /// Mark a tensor as output.
    fn add_output(&mut self, py: Python<'_>, t: u32) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().add_output(t)
        })
    }

    /// Dtype name of a tensor.
    fn tv_dtype(&self, py: Python<'_>, t: u32) -> PyResult<&'static str> {
        guarded(py, || Ok(self.inner.get().tvs[self.tv(t)?].dtype.enum_name()))
    }

    /// Dtype name of a scalar.
    fn scalar_dtype(&self, py: Python<'_>, v: u32) -> PyResult<&'static str> {
        guarded(py, || {
            Ok(self.inner.get().scalars.dtype(self.val(v)?, &self.inner.get().scalar_input_dtypes).enum_name())
        })
    }

    /// A scalar as the fusion prints it (`s0`, `2.5`, `i0 + 1`).
    fn scalar_text(&self, py: Python<'_>, v: u32) -> PyResult<String> {
        guarded(py, || Ok(self.inner.get().scalars.render(self.val(v)?)))
    }

    /// Shape of a tensor: -1 symbolic, 1 broadcast, n static (reduced axes dropped).
    fn tv_shape(&self, py: Python<'_>, t: u32) -> PyResult<Vec<i64>> {
        guarded(py, || {
            let t = self.tv(t)?;
            Ok(self
                .inner
                .get()
                .no_reduction_logical(t)
                .iter()
                .map(|&id| {
                    let d = &self.inner.get().ids[id];
                    if d.iter_type == IterType::Broadcast {
                        1
                    } else {
                        self.inner.get().scalars.as_int(d.extent).unwrap_or(-1)
                    }
                })
                .collect())
        })
    }

    /// Loop domain ids of a tensor.
    fn tv_loop(&self, py: Python<'_>, t: u32) -> PyResult<Vec<u32>> {
        guarded(py, || Ok(self.inner.get().tvs[self.tv(t)?].loop_domain.iter().map(|i| i.as_u32()).collect()))
    }

    /// Logical domain ids of a tensor.
    fn tv_logical(&self, py: Python<'_>, t: u32) -> PyResult<Vec<u32>> {
        guarded(py, || Ok(self.inner.get().tvs[self.tv(t)?].logical.iter().map(|i| i.as_u32()).collect()))
    }

    /// Memory type and inline position of a tensor.
    fn tv_memory(&self, py: Python<'_>, t: u32) -> PyResult<PyTensorMemory> {
        guarded(py, || {
            let tv = &self.inner.get().tvs[self.tv(t)?];
            let memory_type = if tv.tensor_memory { "Tensor" } else { tv.memory.enum_name() };
            Ok(PyTensorMemory { memory_type, inline_position: tv.inline_pos })
        })
    }

    /// Extent, iter type, parallel type and label of an id.
    fn id_info(&self, py: Python<'_>, i: u32) -> PyResult<PyIterDomainInfo> {
        guarded(py, || {
            let id = self.id(i)?;
            let f = self.inner.get();
            let d = &f.ids[id];
            let iter_type = match d.iter_type {
                IterType::Iteration => "Iteration",
                IterType::Reduction => "Reduction",
                IterType::Broadcast => "Broadcast",
            };
            Ok(PyIterDomainInfo {
                extent: f.scalars.render(d.extent),
                iter_type,
                parallel_type: if f.meshes.keys().any(|&t| f.is_device_parallel(t, id)) {
                    "DIDx"
                } else {
                    d.parallel.enum_name()
                },
                label: f.id_label(id),
            })
        })
    }

    /// The math dump.
    fn math(&self, py: Python<'_>) -> PyResult<String> {
        guarded(py, || Ok(self.inner.get().math_string()))
    }

    /// The transform dump of one tensor.
    fn transforms(&self, py: Python<'_>, t: u32) -> PyResult<String> {
        guarded(py, || Ok(self.inner.get().transforms_string(self.tv(t)?)))
    }

    /// Label of a tensor (`T3_l_float[...]`).
    fn tv_label(&self, py: Python<'_>, t: u32) -> PyResult<String> {
        guarded(py, || Ok(self.inner.get().tv_label(self.tv(t)?)))
    }

    /// Each input's kind, name, dtype and shape, in order.
    fn input_specs(&self) -> Vec<PyInputSpec> {
        let f = self.inner.get();
        f.inputs
            .iter()
            .map(|&op| match op {
                Operand::Tensor(t) => {
                    let shape = f
                        .no_reduction_logical(t)
                        .iter()
                        .map(|&id| {
                            let d = &f.ids[id];
                            if d.iter_type == IterType::Broadcast {
                                1
                            } else {
                                f.scalars.as_int(d.extent).unwrap_or(-1)
                            }
                        })
                        .collect();
                    PyInputSpec { kind: "tensor", name: f.tv_name(t), dtype: f.tvs[t].dtype.enum_name(), shape }
                }
                Operand::Scalar(v) => PyInputSpec {
                    kind: "scalar",
                    name: f.scalars.render(v),
                    dtype: f.scalars.dtype(v, &f.scalar_input_dtypes).enum_name(),
                    shape: Vec::new(),
                },
            })
            .collect()
    }

    /// Check runtime arguments (see `RuntimeArg`) against the definition, the input contract
    /// of every path. `any_layout`: kernels will be compiled for the arrays' strides (the
    /// automatic path).
    #[pyo3(signature = (args, any_layout = false))]
    fn check_inputs(&self, py: Python<'_>, args: Vec<Bound<'_, PyRuntimeArg>>, any_layout: bool) -> PyResult<()> {
        use crate::host::bind::{bind_args_for, Arg};
        use crate::host::eval::InputDesc;
        guarded(py, || {
            let args: Vec<Arg> = args
                .iter()
                .map(|a| {
                    let a = a.get();
                    match (a.kind.as_str(), &a.scalar) {
                        ("tensor", _) => Arg::Tensor {
                            dtype: DataType::from_numpy_name(&a.text).map(Some).ok_or_else(|| a.text.clone()),
                            desc: InputDesc { sizes: a.sizes.clone(), strides: a.strides.clone() },
                        },
                        ("scalar", Some(s)) => Arg::Scalar(s.to_arg()),
                        ("bigint", _) => Arg::BigInt(a.text.clone()),
                        _ => Arg::Other(a.text.clone()),
                    }
                })
                .collect();
            bind_args_for(self.inner.get(), &args, any_layout).map(|_| ())
        })
    }

    /// Mutation counter (changes whenever the definition or schedule changes).
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version()
    }

    /// Number of outputs marked so far.
    #[getter]
    fn num_outputs(&self) -> usize {
        self.inner.get().outputs.len()
    }

    /// Number of tensors created so far (the next tensor is `T{n}`).
    #[getter]
    fn num_tensors(&self) -> usize {
        self.inner.get().tvs.len()
    }

    /// Put tensor `t` on a device mesh (replicated until an axis is parallelized over DIDx).
    fn set_device_mesh(&mut self, py: Python<'_>, t: u32, devices: Vec<i64>) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().set_device_mesh(t, &devices)
        })
    }

    /// Tensor `t`'s mesh devices and DIDx-sharded logical axis, if it is on a mesh.
    fn tv_mesh(&self, t: u32) -> Option<(Vec<i64>, Option<usize>)> {
        let f = self.inner.get();
        f.meshes.get(&TvId::from_u32(t)).map(|m| (m.devices.clone(), m.axis))
    }

    /// True when some tensor is on a device mesh (the fusion then runs per rank).
    #[getter]
    fn has_mesh(&self) -> bool {
        self.inner.get().has_mesh()
    }

    /// The sharded fusion decomposed into local stages and collectives.
    fn mesh_program(&self, py: Python<'_>) -> PyResult<mesh::PyMeshProgram> {
        let p = guarded(py, || crate::host::multidevice::decompose(self.inner.get()))?;
        Ok(mesh::PyMeshProgram { inner: std::sync::Arc::new(p) })
    }

    /// True once a scheduling primitive was used.
    #[getter]
    fn manually_scheduled(&self) -> bool {
        self.inner.get().manually_scheduled
    }

    /// Split a loop axis.
    fn split(&mut self, py: Python<'_>, t: u32, axis: i64, factor: i64, inner_split: bool) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            if !inner_split && self.inner.get().meshes.contains_key(&t) {
                // An outer split of a tensor on a mesh shards it (inputs included).
                return self.inner.get_mut().mesh_split(t, axis, factor);
            }
            // The loop domain of an input is never lowered: a transform of it would be ignored.
            let f = self.inner.get();
            if f.is_input(t) && f.meshes.contains_key(&t) {
                return Err(KilnError::value(format!(
                    "split {}: an input on a device mesh is sharded by an outer split: split(axis, mesh size, inner_split=False), then parallelize the outer axis on DIDx; an inner split of an input is not a schedule (inputs are read as given)",
                    f.tv_name(t)
                )));
            }
            f.check_not_input(t, "split")?;
            self.inner.get_mut().split(t, axis, factor, inner_split)
        })
    }

    /// Merge two loop axes.
    fn merge(&mut self, py: Python<'_>, t: u32, a: i64, b: i64) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            // The loop domain of an input is never lowered: a transform of it would be ignored.
            self.inner.get().check_not_input(t, "merge")?;
            self.inner.get_mut().merge(t, a, b)
        })
    }

    /// Reorder loop axes.
    fn reorder(&mut self, py: Python<'_>, t: u32, moves: Vec<(i64, i64)>) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            // The loop domain of an input is never lowered: a transform of it would be ignored.
            self.inner.get().check_not_input(t, "reorder")?;
            self.inner.get_mut().reorder(t, &moves)
        })
    }

    /// Parallelize a loop axis.
    fn parallelize(&mut self, py: Python<'_>, t: u32, axis: i64, pt: &str) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            if pt == "DIDx" {
                return self.inner.get_mut().shard_axis(t, axis);
            }
            let p = parse_enum("parallel type", pt, ParallelType::from_enum_name)?;
            self.inner.get().check_not_input(t, "parallelize")?;
            self.inner.get_mut().parallelize(t, axis, p)
        })
    }

    /// Set the memory type.
    fn set_memory_type(&mut self, py: Python<'_>, t: u32, mt: &str) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            if mt == "Tensor" {
                return self.inner.get_mut().set_tensor_memory(t);
            }
            let m = parse_enum("memory type", mt, MemoryType::from_enum_name)?;
            self.inner.get_mut().set_memory_type(t, m)
        })
    }

    /// Read cache.
    fn cache_after(&mut self, py: Python<'_>, t: u32) -> PyResult<u32> {
        guarded(py, || {
            let t = self.tv(t)?;
            Ok(self.inner.get_mut().cache_after(t)?.as_u32())
        })
    }

    /// Write cache.
    fn cache_before(&mut self, py: Python<'_>, t: u32) -> PyResult<u32> {
        guarded(py, || {
            let t = self.tv(t)?;
            Ok(self.inner.get_mut().cache_before(t)?.as_u32())
        })
    }

    /// Inline at a position.
    fn inline_at(&mut self, py: Python<'_>, t: u32, pos: i64) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().inline_at(t, pos)
        })
    }

    /// Set the allocation domain from id numbers.
    fn set_allocation_domain(
        &mut self,
        py: Python<'_>,
        t: u32,
        ids: Vec<u32>,
        contiguity: Vec<Option<bool>>,
    ) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            let ids = ids.into_iter().map(|i| self.id(i)).collect::<crate::Result<Vec<_>>>()?;
            self.inner.get_mut().set_allocation_domain(t, &ids, &contiguity)
        })
    }

    /// Mark `t` as an output stored dense in `stride_order`.
    fn add_output_ordered(&mut self, py: Python<'_>, t: u32, stride_order: Vec<usize>) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().add_output_ordered(t, &stride_order)
        })
    }

    /// A copy of the fusion scheduled automatically for inputs of `sizes`, with the
    /// heuristic that scheduled it.
    fn auto_scheduled(&self, py: Python<'_>, sizes: Vec<Vec<i64>>) -> PyResult<PyAutoSchedule> {
        let (f, heuristic, params) = guarded(py, || {
            let mut f = self.inner.get().clone();
            let h = crate::sched::auto::schedule(&mut f, &sizes)?;
            Ok((f, h.kind(), h.values()))
        })?;
        let fusion = Py::new(py, PyFusion { inner: versioned::Versioned::new(f) })?;
        Ok(PyAutoSchedule { fusion, heuristic, params })
    }

    /// The host program the automatic schedulers (and, failing them, the segmenter) pick
    /// for inputs of `sizes`, with its heuristic and input layout; `aligned_bases`: every
    /// tensor input starts at a 16-byte aligned address.
    /// `device`: (SM count, max threads per block, Shared bytes per block, registers per
    /// block, compute capability) of the target; None for the default (H100/H200 class).
    /// `scalars`: values of the integer scalar inputs that shapes read (see
    /// `shape_scalars`), None for the others.
    /// `strides`: element strides of each tensor input's array (empty: row-major); inputs
    /// without declared contiguity get kernels for that layout.
    #[pyo3(signature = (sizes, aligned_bases = false, device = None, scalars = Vec::new(), strides = Vec::new()))]
    fn auto_program(
        &self,
        py: Python<'_>,
        sizes: Vec<Vec<i64>>,
        aligned_bases: bool,
        device: Option<(i64, i64, i64, i64, i64)>,
        scalars: Vec<Option<i64>>,
        strides: Vec<Vec<i64>>,
    ) -> PyResult<PyAutoProgram> {
        let (program, heuristic, params, contiguity) = guarded(py, || {
            let device = match device {
                Some((sm_count, max_threads_per_block, shared_per_block, registers_per_block, arch)) => {
                    crate::sched::auto::DeviceProps {
                        sm_count,
                        max_threads_per_block,
                        shared_per_block,
                        registers_per_block,
                        arch,
                    }
                }
                None => crate::sched::auto::DeviceProps::default(),
            };
            let seen = crate::compile::InputsSeen { sizes, strides, scalars, aligned_bases, device };
            let c = crate::compile::compile(self.inner.get(), &crate::compile::Schedule::Automatic(seen))?;
            let Some(h) = c.heuristic else { crate::bail_internal!("an automatic compile without a heuristic") };
            let p = c.program;
            let layout =
                p.fusion.inputs.iter().filter_map(|o| o.tensor()).map(|t| p.fusion.tvs[t].contiguity.clone()).collect();
            Ok((
                PyHostProgram { inner: p, cache: crate::host::plan::PlanCache::default() },
                h.kind(),
                h.values(),
                layout,
            ))
        })?;
        Ok(PyAutoProgram { program: Py::new(py, program)?, heuristic, params, contiguity })
    }

    /// Positions of the runtime scalar inputs that some tensor shape reads.
    fn shape_scalars(&self) -> Vec<u32> {
        crate::sched::auto::shape_scalars(self.inner.get())
    }

    /// Lower the fusion to one kernel.
    fn lower(&self, py: Python<'_>) -> PyResult<PyKernel> {
        guarded(py, || Ok(PyKernel::new(crate::lower::lower(&crate::sched::propagate::completed(self.inner.get()))?)))
    }

    /// Start a new segment (kernel) after the definition of tensor `t`.
    fn segment_after(&mut self, py: Python<'_>, t: u32) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().mark_segment_after(t)
        })
    }

    /// Launch the kernel's blocks in clusters along a block dimension.
    fn set_cluster(&mut self, py: Python<'_>, pt: &str, size: u32) -> PyResult<()> {
        guarded(py, || {
            let p = parse_enum("parallel type", pt, ParallelType::from_enum_name)?;
            self.inner.get_mut().set_cluster(p, size)
        })
    }

    /// Lower the fusion to its kernels (one per segment) and host program.
    fn lower_program(&self, py: Python<'_>) -> PyResult<PyHostProgram> {
        guarded(py, || {
            let p = crate::compile::compile(self.inner.get(), &crate::compile::Schedule::AsScheduled)?.program;
            Ok(PyHostProgram { inner: p, cache: crate::host::plan::PlanCache::default() })
        })
    }

    /// Mark a copy of a fusion input as read once (its vector loads skip L1).
    fn set_streaming_load(&mut self, py: Python<'_>, t: u32) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().set_streaming_load(t)
        })
    }

    /// Mark a tensor that reads a fusion input directly as kept in L2 (evict_last loads).
    fn set_evict_last(&mut self, py: Python<'_>, t: u32) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().set_evict_last(t)
        })
    }

    /// Request the serial grid-reduction protocol.
    fn set_serial_grid_reduction(&mut self, py: Python<'_>, t: u32) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().set_serial_grid_reduction(t)
        })
    }

    /// Circular-buffer a tensor.
    #[pyo3(signature = (t, stages, prefetch=None))]
    fn circular_buffer(&mut self, py: Python<'_>, t: u32, stages: i64, prefetch: Option<i64>) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().circular_buffer(t, stages, prefetch)
        })
    }
}

/// How one tensor is laid out and where the kernel allocates it.
#[pyclass(name = "Allocation", module = "kiln._core", frozen, get_all)]
pub struct PyAllocation {
    tensor: String,
    memory_type: &'static str,
    /// Allocated ids (after loop promotion), outermost first.
    ids: Vec<String>,
    extents: Vec<String>,
    strides: Vec<String>,
    contiguity: Vec<bool>,
    position: usize,
    /// Buffers of this layout the kernel allocates (circular-buffer stages; 1 otherwise).
    stages: u32,
    zero_init: bool,
    resets_to_zero: bool,
}

/// A Global buffer a kernel needs besides its inputs and outputs.
#[pyclass(name = "GlobalBuffer", module = "kiln._core", frozen, get_all)]
pub struct PyGlobalBuffer {
    name: String,
    dtype: &'static str,
    shape: Vec<String>,
    zero_init: bool,
    resets_to_zero: bool,
}

/// Where a tensor lives and how far it is inlined into its consumers' loops.
#[pyclass(name = "TensorMemory", module = "kiln._core", frozen, get_all)]
pub struct PyTensorMemory {
    /// Memory type name (`Local`, `Shared`, `Global`).
    memory_type: &'static str,
    /// How many outer loop axes the tensor shares with its consumers.
    inline_position: usize,
}

/// One iter domain of a fusion.
#[pyclass(name = "IterDomainInfo", module = "kiln._core", frozen, get_all)]
pub struct PyIterDomainInfo {
    /// The symbolic extent as text (`ceilDiv(i1, 128)`).
    extent: String,
    /// `Iteration`, `Reduction` or `Broadcast`.
    iter_type: &'static str,
    /// The parallel type name the axis is mapped to (`Serial` when none).
    parallel_type: &'static str,
    /// The id as the dumps print it.
    label: String,
}

/// One input of a fusion definition.
#[pyclass(name = "InputSpec", module = "kiln._core", frozen, get_all)]
pub struct PyInputSpec {
    /// `tensor` or `scalar`.
    kind: &'static str,
    /// The tensor's name (`T0`) or the scalar's (`s0`).
    name: String,
    dtype: &'static str,
    /// Per axis: -1 symbolic, 1 broadcast, n static (empty for a scalar).
    shape: Vec<i64>,
}

/// One runtime argument as `Fusion.check_inputs` takes it.
#[pyclass(name = "RuntimeArg", module = "kiln._core", frozen, get_all)]
pub struct PyRuntimeArg {
    /// `tensor`, `scalar`, `bigint` (an int beyond 64 bits) or `other` (anything else).
    kind: String,
    /// A tensor's dtype name, a bigint's digits or another argument's type name (empty for a scalar).
    text: String,
    /// A tensor's sizes (empty otherwise).
    sizes: Vec<i64>,
    /// A tensor's element strides (empty otherwise).
    strides: Vec<i64>,
    /// A scalar's value (None otherwise).
    scalar: Option<PyScalarArg>,
}

#[pymethods]
impl PyRuntimeArg {
    #[new]
    #[pyo3(signature = (kind, text = String::new(), sizes = Vec::new(), strides = Vec::new(), scalar = None))]
    fn new(kind: String, text: String, sizes: Vec<i64>, strides: Vec<i64>, scalar: Option<PyScalarArg>) -> Self {
        Self { kind, text, sizes, strides, scalar }
    }
}

/// `Fusion.auto_scheduled`'s result: the scheduled copy and its heuristic.
#[pyclass(name = "AutoSchedule", module = "kiln._core", frozen, get_all)]
pub struct PyAutoSchedule {
    /// A copy of the fusion with the automatic schedule applied.
    fusion: Py<PyFusion>,
    /// The heuristic's kind (`pointwise`, `normalization`, ...).
    heuristic: &'static str,
    /// The heuristic's parameters (what kernels may depend on besides the kind).
    params: Vec<i64>,
}

/// `Fusion.auto_program`'s result: the program, its heuristic and the input layout.
#[pyclass(name = "AutoProgram", module = "kiln._core", frozen, get_all)]
pub struct PyAutoProgram {
    program: Py<PyHostProgram>,
    /// The heuristic's kind (`pointwise`, `normalization`, ...).
    heuristic: &'static str,
    /// The heuristic's parameters (what kernels may depend on besides the kind).
    params: Vec<i64>,
    /// The contiguity each tensor input was compiled for, in input order.
    contiguity: Vec<Vec<Option<bool>>>,
}

/// One parameter of a generated kernel, in parameter order.
#[pyclass(name = "KernelParam", module = "kiln._core", frozen, get_all)]
pub struct PyKernelParam {
    name: String,
    /// `input`, `output`, `buffer`, `scalar`, `extent` or `stride`.
    kind: &'static str,
    /// Input, output or buffer number, scalar `s{n}` or extent `i{n}` number, or a stride's tensor id.
    number: i64,
    /// A stride's axis (0 for the other kinds).
    axis: i64,
    dtype: &'static str,
}

/// A kernel's generated CUDA.
#[pyclass(name = "CudaSource", module = "kiln._core", frozen, get_all)]
pub struct PyCudaSource {
    /// The translation unit: runtime header + kernel.
    source: String,
    /// Name of the `__global__` function.
    name: String,
    params: Vec<Py<PyKernelParam>>,
}

/// A kernel's launch configuration as expressions of the input sizes.
#[pyclass(name = "LaunchConfig", module = "kiln._core", frozen, get_all)]
pub struct PyLaunchConfig {
    grid: Vec<String>,
    block: Vec<String>,
    /// Dynamic shared memory bytes.
    smem_bytes: String,
}

/// One `index_select` site of a kernel.
#[pyclass(name = "Gather", module = "kiln._core", frozen, get_all)]
pub struct PyGather {
    /// The site id an out-of-range index is reported under.
    site: u32,
    /// The index tensor.
    index: String,
    /// The tensor selected from.
    table: String,
}

/// How to allocate one output of a kernel launch.
#[pyclass(name = "OutputPlan", module = "kiln._core", frozen, get_all)]
pub struct PyOutputPlan {
    /// Logical sizes.
    sizes: Vec<i64>,
    /// Storage order: `layout[k]` is the logical axis stored k-th (outermost first).
    layout: Vec<usize>,
    dtype: &'static str,
}

/// A Global buffer of a kernel launch, sized for concrete inputs.
#[pyclass(name = "GlobalBufferPlan", module = "kiln._core", frozen, get_all)]
pub struct PyGlobalBufferPlan {
    name: String,
    elements: i64,
    dtype: &'static str,
    zero_init: bool,
    resets_to_zero: bool,
}

/// One kernel's launch plan for concrete inputs (`Kernel.plan`).
#[pyclass(name = "KernelPlan", module = "kiln._core", frozen, get_all)]
pub struct PyKernelPlan {
    outputs: Vec<Py<PyOutputPlan>>,
    /// The Global buffers in parameter order.
    buffers: Vec<Py<PyGlobalBufferPlan>>,
    /// Values of the scalar parameters in parameter order (after the tensor parameters).
    scalar_args: Vec<PyObject>,
    grid: (i64, i64, i64),
    block: (i64, i64, i64),
    /// Dynamic shared memory bytes.
    smem_bytes: i64,
    /// Every offset fits in 32 bits: the 32-bit index variant of the kernel is safe.
    index32: bool,
}

/// One instruction of a host program.
#[pyclass(name = "Instruction", module = "kiln._core", frozen, get_all)]
pub struct PyInstruction {
    /// `Allocate`, `Deallocate` or `LaunchKernel`.
    op: &'static str,
    /// The kernel a LaunchKernel launches (None otherwise).
    kernel: Option<usize>,
    /// The buffer an Allocate or Deallocate names (None for a LaunchKernel).
    buffer: Option<String>,
    /// A LaunchKernel's input buffers (empty otherwise).
    inputs: Vec<String>,
    /// A LaunchKernel's output buffers (empty otherwise).
    outputs: Vec<String>,
    /// A LaunchKernel's intermediate (work) buffers (empty otherwise).
    intermediates: Vec<String>,
}

/// One buffer of a host program's concrete plan.
#[pyclass(name = "BufferAlloc", module = "kiln._core", frozen, get_all)]
pub struct PyBufferAlloc {
    name: String,
    dtype: &'static str,
    /// Logical sizes (outputs and intermediates) or `[elements]` (kernel buffers).
    sizes: Vec<i64>,
    /// Storage order of `sizes` (`layout[k]` is the axis stored k-th).
    layout: Vec<usize>,
    elements: i64,
    nbytes: i64,
    zero_init: bool,
    resets_to_zero: bool,
    /// `input`, `output`, `arena`, `zero_pool` or `error` (an error word).
    place: &'static str,
    /// Byte offset in the arena or zeroed pool; input, output or error word number.
    offset: i64,
}

/// One kernel launch of a host program's concrete plan.
#[pyclass(name = "KernelLaunch", module = "kiln._core", frozen, get_all)]
pub struct PyKernelLaunch {
    /// The kernel (index into `HostProgram.kernels()`).
    kernel: usize,
    /// Buffer ids (indices into `HostPlan.buffers`) in kernel parameter order.
    args: Vec<usize>,
    /// Buffer ids to zero right before the launch (`zero_init` without `resets_to_zero`).
    memsets: Vec<usize>,
    /// (value, dtype) of every scalar parameter, in parameter order.
    scalars: Vec<(PyObject, &'static str)>,
    grid: (i64, i64, i64),
    block: (i64, i64, i64),
    /// Dynamic shared memory bytes.
    smem_bytes: i64,
    /// The launch uses the kernel's 32-bit index variant.
    index32: bool,
}

/// A host program evaluated for concrete inputs (`HostProgram.plan`).
#[pyclass(name = "HostPlan", module = "kiln._core", frozen, get_all)]
pub struct PyHostPlan {
    buffers: Vec<Py<PyBufferAlloc>>,
    launches: Vec<Py<PyKernelLaunch>>,
    /// Largest total of simultaneously live buffers (bytes, unaligned), outputs included.
    peak_bytes: i64,
    /// Bytes of the workspace arena.
    arena_bytes: i64,
    /// Bytes of the zeroed pool.
    zero_pool_bytes: i64,
}

/// A lowered kernel: kernel IR text, allocation records, global buffers.
#[pyclass(name = "Kernel", module = "kiln._core", frozen)]
pub struct PyKernel {
    pub(crate) inner: crate::kernel::Kernel,
    /// Generated CUDA with 64-bit and 32-bit index arithmetic, produced on first use.
    cuda: [std::sync::OnceLock<crate::codegen::CudaKernel>; 2],
}

impl PyKernel {
    pub(crate) fn new(inner: crate::kernel::Kernel) -> Self {
        Self { inner, cuda: [std::sync::OnceLock::new(), std::sync::OnceLock::new()] }
    }

    /// Generated CUDA, produced once per kernel and index type.
    fn cuda_kernel(&self, index32: bool) -> crate::Result<&crate::codegen::CudaKernel> {
        let slot = &self.cuda[index32 as usize];
        if let Some(k) = slot.get() {
            return Ok(k);
        }
        let k = crate::codegen::generate(&self.inner, index32)?;
        Ok(slot.get_or_init(|| k))
    }
}

/// A scalar argument as Python passes it.
#[derive(FromPyObject)]
enum PyScalarArg {
    Bool(bool),
    Int(i64),
    Float(f64),
}

#[pymethods]
impl PyKernel {
    /// Kernel IR as text.
    fn kernel_ir(&self) -> String {
        self.inner.to_text()
    }

    /// Kernel IR after the passes lowering was asked to dump: (pass, text) in pass order.
    fn pass_dumps(&self) -> Vec<(String, String)> {
        self.inner.pass_dumps.clone()
    }

    /// CUDA source (runtime header + kernel), kernel name and parameters.
    #[pyo3(signature = (index32=false))]
    fn cuda(&self, py: Python<'_>, index32: bool) -> PyResult<PyCudaSource> {
        let (source, name, params) = guarded(py, || {
            let k = self.cuda_kernel(index32)?;
            let params: Vec<PyKernelParam> = k
                .params
                .iter()
                .map(|(name, kind, dt)| {
                    use crate::codegen::ParamKind as P;
                    let (kname, number, axis) = match kind {
                        P::Input(i) => ("input", *i as i64, 0),
                        P::Output(i) => ("output", *i as i64, 0),
                        P::Buffer(i) => ("buffer", *i as i64, 0),
                        P::Scalar(n) => ("scalar", *n as i64, 0),
                        P::Extent(n) => ("extent", *n as i64, 0),
                        P::Stride(t, a) => ("stride", t.as_u32() as i64, *a as i64),
                    };
                    PyKernelParam { name: name.clone(), kind: kname, number, axis, dtype: dt.enum_name() }
                })
                .collect();
            Ok((k.source(), k.name.clone(), params))
        })?;
        let params = params.into_iter().map(|p| Py::new(py, p)).collect::<PyResult<Vec<_>>>()?;
        Ok(PyCudaSource { source, name, params })
    }

    /// Concrete launch plan for input sizes/strides (elements) and scalar inputs.
    fn plan(
        &self,
        py: Python<'_>,
        sizes: Vec<Vec<i64>>,
        strides: Vec<Vec<i64>>,
        scalars: Vec<PyScalarArg>,
    ) -> PyResult<PyKernelPlan> {
        use crate::host::eval::{plan, ScalarArg};
        let p = guarded(py, || {
            // Both index variants take the same parameters; the 64-bit one names them.
            let k = self.cuda_kernel(false)?;
            let inputs = input_descs(sizes, strides)?;
            let sc: Vec<ScalarArg> = scalars.iter().map(PyScalarArg::to_arg).collect();
            plan(&self.inner, k, &inputs, &sc)
        })?;
        let outputs = p
            .outputs
            .into_iter()
            .map(|o| Py::new(py, PyOutputPlan { sizes: o.sizes, layout: o.layout, dtype: o.dtype.enum_name() }))
            .collect::<PyResult<Vec<_>>>()?;
        let buffers = p
            .buffers
            .into_iter()
            .map(|b| {
                let b = PyGlobalBufferPlan {
                    name: b.name,
                    elements: b.elements,
                    dtype: b.dtype.enum_name(),
                    zero_init: b.zero_init,
                    resets_to_zero: b.resets_to_zero,
                };
                Py::new(py, b)
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyKernelPlan {
            outputs,
            buffers,
            scalar_args: p.scalar_args.iter().map(|a| scalar_to_py(py, a)).collect::<PyResult<Vec<_>>>()?,
            grid: dims(p.grid),
            block: dims(p.block),
            smem_bytes: p.smem_bytes,
            index32: p.index32,
        })
    }

    /// Launch configuration as expressions of the input sizes.
    fn launch(&self) -> PyLaunchConfig {
        let sc = &self.inner.fusion.scalars;
        let l = &self.inner.launch;
        PyLaunchConfig {
            grid: l.grid.iter().map(|&v| sc.render(v)).collect(),
            block: l.block.iter().map(|&v| sc.render(v)).collect(),
            smem_bytes: sc.render(l.smem_bytes),
        }
    }

    /// The allocation table as text.
    fn allocations_text(&self) -> String {
        self.inner.allocations_text()
    }

    /// The allocation record of every tensor the kernel allocates, in tensor order.
    fn allocations(&self) -> Vec<PyAllocation> {
        let f = &self.inner.fusion;
        self.inner
            .allocation_list()
            .into_iter()
            .map(|a| PyAllocation {
                tensor: f.tv_name(a.tv),
                memory_type: a.memory.enum_name(),
                ids: a.ids.iter().map(|&i| f.id_label(i)).collect(),
                extents: a.ids.iter().map(|&i| f.scalars.render(f.ids[i].extent)).collect(),
                strides: a.strides.iter().map(|&s| f.scalars.render(s)).collect(),
                contiguity: a.contiguity.clone(),
                position: a.position,
                stages: a.stages,
                zero_init: a.zero_init,
                resets_to_zero: a.resets_to_zero,
            })
            .collect()
    }

    /// The kernel's gathers (`index_select` sites).
    fn gathers(&self) -> Vec<PyGather> {
        let f = &self.inner.fusion;
        self.inner
            .gathers()
            .into_iter()
            .map(|(site, ix, table)| PyGather { site, index: f.index_name(ix), table: f.table_name(table) })
            .collect()
    }

    /// The Global buffers the kernel needs besides its inputs and outputs (KernelSummary).
    fn global_allocations(&self) -> Vec<PyGlobalBuffer> {
        let f = &self.inner.fusion;
        self.inner
            .summary
            .global_allocations
            .iter()
            .map(|b| PyGlobalBuffer {
                name: b.name.clone(),
                dtype: b.dtype.enum_name(),
                shape: b.shape.iter().map(|&v| f.scalars.render(v)).collect(),
                zero_init: b.zero_init,
                resets_to_zero: b.resets_to_zero,
            })
            .collect()
    }
}

/// A lowered fusion's host program with its per-signature plan cache.
#[pyclass(name = "HostProgram", module = "kiln._core", frozen)]
pub struct PyHostProgram {
    inner: crate::host::ir::HostProgram,
    cache: crate::host::plan::PlanCache,
}

#[pymethods]
impl PyHostProgram {
    /// The program as text.
    fn text(&self) -> String {
        self.inner.to_text()
    }

    /// How the automatic segmenter grouped the fusion (empty for the user's segments).
    fn segmentation(&self) -> String {
        self.inner.segmentation.clone()
    }

    /// The kernels, one per segment, in launch order.
    fn kernels(&self) -> Vec<PyKernel> {
        self.inner
            .kernels
            .iter()
            .zip(&self.inner.cuda)
            .map(|(k, c)| {
                let pk = PyKernel::new(k.clone());
                if let Ok(c) = c {
                    let _ = pk.cuda[0].set(c.clone());
                }
                pk
            })
            .collect()
    }

    /// The program's instructions, in order.
    fn instructions(&self) -> Vec<PyInstruction> {
        use crate::host::ir::HostInstr as I;
        let name = |b: usize| self.inner.buffers[b].name.clone();
        let names = |bs: &[usize]| -> Vec<String> { bs.iter().map(|&b| name(b)).collect() };
        let buffer_op = |op, b| PyInstruction {
            op,
            kernel: None,
            buffer: Some(name(b)),
            inputs: Vec::new(),
            outputs: Vec::new(),
            intermediates: Vec::new(),
        };
        self.inner
            .instrs
            .iter()
            .map(|i| match i {
                I::Allocate(b) => buffer_op("Allocate", *b),
                I::Deallocate(b) => buffer_op("Deallocate", *b),
                I::LaunchKernel { kernel, inputs, outputs, intermediates } => PyInstruction {
                    op: "LaunchKernel",
                    kernel: Some(*kernel),
                    buffer: None,
                    inputs: names(inputs),
                    outputs: names(outputs),
                    intermediates: names(intermediates),
                },
            })
            .collect()
    }

    /// Names of the fusion's tensor inputs, in order.
    fn input_names(&self) -> Vec<String> {
        let f = &self.inner.fusion;
        f.inputs.iter().filter_map(|o| o.tensor()).map(|t| f.tv_name(t)).collect()
    }

    /// The shape each output is handed back in where its kernel computes it at another
    /// (None elsewhere), for inputs of these sizes (elements) and scalar inputs.
    fn output_views(
        &self,
        py: Python<'_>,
        sizes: Vec<Vec<i64>>,
        scalars: Vec<PyScalarArg>,
    ) -> PyResult<Vec<Option<Vec<i64>>>> {
        use crate::host::eval::{InputDesc, ScalarArg};
        use crate::host::ir::BufferRole;
        let p = &self.inner;
        guarded(py, || {
            let mut views = vec![None; p.fusion.outputs.len()];
            if !p.buffers.iter().any(|b| b.view.is_some()) {
                return Ok(views);
            }
            let inputs: Vec<InputDesc> = sizes
                .into_iter()
                .map(|sizes| {
                    let mut strides = vec![1i64; sizes.len()];
                    for a in (0..sizes.len().saturating_sub(1)).rev() {
                        strides[a] = strides[a + 1] * sizes[a + 1].max(1);
                    }
                    InputDesc { sizes, strides }
                })
                .collect();
            let sc: Vec<ScalarArg> = scalars.iter().map(PyScalarArg::to_arg).collect();
            let b = crate::host::bind::bind(&p.fusion, &inputs, &sc)?;
            for hb in &p.buffers {
                if let (BufferRole::Output(n), Some(v)) = (hb.role, &hb.view) {
                    let sc = &p.kernels[hb.kernel].fusion.scalars;
                    views[n] = Some(v.iter().map(|&e| b.eval(sc, e)).collect::<crate::Result<Vec<i64>>>()?);
                }
            }
            Ok(views)
        })
    }

    /// Per output, the order it is handed back in where that is its stored order
    /// (`Fusion::stored_outputs`): stored axis k is logical axis `layout[k]`; None elsewhere.
    fn output_layouts(&self) -> Vec<Option<Vec<usize>>> {
        let f = &self.inner.fusion;
        f.outputs
            .iter()
            .map(|&o| {
                if !f.stored_outputs.contains(&o) {
                    return None;
                }
                let logical = f.no_reduction_logical(o);
                f.tvs[o]
                    .maybe_allocation()
                    .iter()
                    .filter(|&&id| f.ids[id].iter_type != crate::ir::IterType::Reduction)
                    .map(|id| logical.iter().position(|l| l == id))
                    .collect()
            })
            .collect()
    }

    /// The tensors that read an input at another shape (`View` lines of the host program),
    /// as (name, input position among the arrays, shape, strided axes) for arrays of these
    /// sizes and strides (elements) and scalar inputs.
    fn input_views(
        &self,
        py: Python<'_>,
        sizes: Vec<Vec<i64>>,
        strides: Vec<Vec<i64>>,
        scalars: Vec<PyScalarArg>,
    ) -> PyResult<Vec<InputView>> {
        use crate::host::eval::ScalarArg;
        use crate::host::ir::BufferRole;
        let p = &self.inner;
        guarded(py, || {
            if !p.buffers.iter().any(|b| matches!(b.role, BufferRole::InputView(_))) {
                return Ok(Vec::new());
            }
            let inputs = input_descs(sizes, strides)?;
            let sc: Vec<ScalarArg> = scalars.iter().map(PyScalarArg::to_arg).collect();
            let b = crate::host::bind::bind(&p.fusion, &inputs, &sc)?;
            let mut views = Vec::new();
            for hb in &p.buffers {
                if let BufferRole::InputView(n) = hb.role {
                    let sc = &p.kernels[hb.kernel].fusion.scalars;
                    let shape = hb.shape.iter().map(|&e| b.eval(sc, e)).collect::<crate::Result<Vec<i64>>>()?;
                    let axes = hb.tv.and_then(|t| p.fusion.strided_view_axes(t)).map(<[_]>::to_vec);
                    views.push((hb.name.clone(), n, shape, axes));
                }
            }
            Ok(views)
        })
    }

    /// Names of the fusion's outputs, in order.
    fn output_names(&self) -> Vec<String> {
        let f = &self.inner.fusion;
        f.outputs.iter().map(|&t| f.tv_name(t)).collect()
    }

    /// Number of plans evaluated so far (misses of the per-signature cache).
    #[getter]
    fn plan_misses(&self) -> u64 {
        self.cache.misses.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Concrete plan for input sizes/strides (elements) and scalar inputs; cached per signature.
    fn plan(
        &self,
        py: Python<'_>,
        sizes: Vec<Vec<i64>>,
        strides: Vec<Vec<i64>>,
        scalars: Vec<PyScalarArg>,
    ) -> PyResult<PyHostPlan> {
        use crate::host::eval::ScalarArg;
        use crate::host::plan::Place;
        let p = guarded(py, || {
            let inputs = input_descs(sizes, strides)?;
            let sc: Vec<ScalarArg> = scalars.iter().map(PyScalarArg::to_arg).collect();
            self.cache.get(&self.inner, &inputs, &sc)
        })?;
        let buffers = p
            .buffers
            .iter()
            .map(|b| {
                let (place, offset) = match b.place {
                    Place::Input(n) => ("input", n as i64),
                    Place::Output(n) => ("output", n as i64),
                    Place::Arena(o) => ("arena", o),
                    Place::ZeroPool(o) => ("zero_pool", o),
                    Place::ErrorWord(n) => ("error", n as i64),
                };
                let b = PyBufferAlloc {
                    name: b.name.clone(),
                    dtype: b.dtype.enum_name(),
                    sizes: b.sizes.clone(),
                    layout: b.layout.clone(),
                    elements: b.elements,
                    nbytes: b.bytes,
                    zero_init: b.zero_init,
                    resets_to_zero: b.resets_to_zero,
                    place,
                    offset,
                };
                Py::new(py, b)
            })
            .collect::<PyResult<Vec<_>>>()?;
        let launches = p
            .launches
            .iter()
            .map(|l| {
                let scalars = l
                    .launch
                    .scalar_args
                    .iter()
                    .map(|(a, d)| Ok((scalar_to_py(py, a)?, d.enum_name())))
                    .collect::<PyResult<Vec<_>>>()?;
                let l = PyKernelLaunch {
                    kernel: l.kernel,
                    args: l.args.clone(),
                    memsets: l.memsets.clone(),
                    scalars,
                    grid: dims(l.launch.grid),
                    block: dims(l.launch.block),
                    smem_bytes: l.launch.smem_bytes,
                    index32: l.launch.index32,
                };
                Py::new(py, l)
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyHostPlan {
            buffers,
            launches,
            peak_bytes: p.peak_bytes,
            arena_bytes: p.arena_bytes,
            zero_pool_bytes: p.zero_pool_bytes,
        })
    }
}

/// Grid or block dimensions as Python's `(x, y, z)`.
fn dims([x, y, z]: [i64; 3]) -> (i64, i64, i64) {
    (x, y, z)
}

fn scalar_to_py(py: Python<'_>, a: &crate::host::eval::ScalarArg) -> PyResult<PyObject> {
    use crate::host::eval::ScalarArg;
    Ok(match a {
        ScalarArg::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        ScalarArg::Float(x) => x.into_pyobject(py)?.into_any().unbind(),
        ScalarArg::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
    })
}

impl<'py> IntoPyObject<'py> for &PyScalarArg {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(scalar_to_py(py, &self.to_arg())?.into_bound(py))
    }
}

impl PyScalarArg {
    fn to_arg(&self) -> crate::host::eval::ScalarArg {
        use crate::host::eval::ScalarArg;
        match self {
            PyScalarArg::Bool(b) => ScalarArg::Bool(*b),
            PyScalarArg::Int(i) => ScalarArg::Int(*i),
            PyScalarArg::Float(x) => ScalarArg::Float(*x),
        }
    }
}

/// The extension module `kiln._core`.
/// Set what every later lowering records: IR dumps after the named passes, and whether the
/// kernel-IR verifier runs after every pass.
#[pyfunction]
#[pyo3(signature = (dump_after, verify))]
fn set_lower_options(py: Python<'_>, dump_after: Vec<String>, verify: bool) -> PyResult<()> {
    guarded(py, || crate::lower::set_options(crate::lower::LowerOptions { dump_after, verify }))
}

/// The names of the kernel-IR passes, in order.
#[pyfunction]
fn lower_passes() -> Vec<&'static str> {
    crate::lower::PASSES.iter().map(|p| p.name).collect()
}

/// One element-wise op of the op table, as `fd.ops` exposes it.
#[pyclass(name = "ElementwiseOp", module = "kiln._core", frozen, get_all)]
pub struct PyElementwiseOp {
    name: &'static str,
    /// Number of operands (1 or 2).
    arity: usize,
    doc: &'static str,
}

/// The element-wise ops of the op table, unary first, in table order.
#[pyfunction]
fn elementwise_ops() -> Vec<PyElementwiseOp> {
    let unary = UnaryOp::ALL.iter().map(|u| PyElementwiseOp { name: u.name(), arity: 1, doc: u.doc() });
    let binary = BinaryOp::ALL.iter().map(|b| PyElementwiseOp { name: b.name(), arity: 2, doc: b.doc() });
    unary.chain(binary).collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFusion>()?;
    m.add_class::<mesh::PyMeshProgram>()?;
    m.add_class::<PyKernel>()?;
    m.add_class::<PyHostProgram>()?;
    m.add_class::<PyAllocation>()?;
    m.add_class::<PyGlobalBuffer>()?;
    m.add_class::<PyTensorMemory>()?;
    m.add_class::<PyIterDomainInfo>()?;
    m.add_class::<PyInputSpec>()?;
    m.add_class::<PyRuntimeArg>()?;
    m.add_class::<PyAutoSchedule>()?;
    m.add_class::<PyAutoProgram>()?;
    m.add_class::<PyKernelParam>()?;
    m.add_class::<PyCudaSource>()?;
    m.add_class::<PyLaunchConfig>()?;
    m.add_class::<PyGather>()?;
    m.add_class::<PyOutputPlan>()?;
    m.add_class::<PyGlobalBufferPlan>()?;
    m.add_class::<PyKernelPlan>()?;
    m.add_class::<PyInstruction>()?;
    m.add_class::<PyBufferAlloc>()?;
    m.add_class::<PyKernelLaunch>()?;
    m.add_class::<PyHostPlan>()?;
    m.add_function(wrap_pyfunction!(set_lower_options, m)?)?;
    m.add_function(wrap_pyfunction!(lower_passes, m)?)?;
    m.add_class::<PyElementwiseOp>()?;
    m.add_function(wrap_pyfunction!(elementwise_ops, m)?)?;
    interp::register(m)?;
    launch::register(m)?;
    m.add("DTYPES", DataType::ALL.iter().map(|d| d.enum_name()).collect::<Vec<_>>())?;
    let numpy: std::collections::HashMap<&str, &str> =
        DataType::ALL.iter().map(|d| (d.enum_name(), d.numpy_name())).collect();
    m.add("DTYPE_NUMPY_NAMES", numpy)?;
    Ok(())
}
