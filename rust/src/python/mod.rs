//! PyO3 bindings: convert Python arguments, delegate to the Rust core, convert
//! errors. No compiler logic lives here. Every entry point runs under a panic guard
//! so a compiler bug surfaces as `KilnError`, never as a crashed interpreter.

use std::panic::{catch_unwind, AssertUnwindSafe};

mod interp;
mod launch;
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
                [ReductionOp::Sum, ReductionOp::Max, ReductionOp::Min, ReductionOp::Prod]
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

    /// Memory type name and inline position of a tensor.
    fn tv_memory(&self, py: Python<'_>, t: u32) -> PyResult<(&'static str, usize)> {
        guarded(py, || {
            let tv = &self.inner.get().tvs[self.tv(t)?];
            Ok((tv.memory.enum_name(), tv.inline_pos))
        })
    }

    /// (extent text, iter type, parallel type, label) of an id.
    fn id_info(&self, py: Python<'_>, i: u32) -> PyResult<(String, &'static str, &'static str, String)> {
        guarded(py, || {
            let id = self.id(i)?;
            let d = &self.inner.get().ids[id];
            let it = match d.iter_type {
                IterType::Iteration => "Iteration",
                IterType::Reduction => "Reduction",
                IterType::Broadcast => "Broadcast",
            };
            Ok((self.inner.get().scalars.render(d.extent), it, d.parallel.enum_name(), self.inner.get().id_label(id)))
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

    /// Each input as (kind, name, dtype, shape) with kind "tensor" or "scalar".
    fn input_specs(&self) -> Vec<(&'static str, String, &'static str, Vec<i64>)> {
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
                    ("tensor", f.tv_name(t), f.tvs[t].dtype.enum_name(), shape)
                }
                Operand::Scalar(v) => {
                    ("scalar", f.scalars.render(v), f.scalars.dtype(v, &f.scalar_input_dtypes).enum_name(), Vec::new())
                }
            })
            .collect()
    }

    /// Check runtime arguments against the definition, the input contract of every path:
    /// each is `(kind, text, sizes, strides, scalar)` with kind `tensor` (text: dtype name),
    /// `scalar`, `bigint` (text: the integer) or `other` (text: its type name).
    /// `any_layout`: kernels will be compiled for the arrays' strides (the automatic path).
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (args, any_layout = false))]
    fn check_inputs(
        &self,
        py: Python<'_>,
        args: Vec<(String, String, Vec<i64>, Vec<i64>, Option<PyScalarArg>)>,
        any_layout: bool,
    ) -> PyResult<()> {
        use crate::host::bind::{bind_args_for, Arg};
        use crate::host::eval::InputDesc;
        guarded(py, || {
            let args: Vec<Arg> = args
                .into_iter()
                .map(|(kind, text, sizes, strides, scalar)| match (kind.as_str(), scalar) {
                    ("tensor", _) => Arg::Tensor {
                        dtype: DataType::from_numpy_name(&text).map(Some).ok_or(text),
                        desc: InputDesc { sizes, strides },
                    },
                    ("scalar", Some(s)) => Arg::Scalar(s.to_arg()),
                    ("bigint", _) => Arg::BigInt(text),
                    _ => Arg::Other(text),
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

    /// True once a scheduling primitive was used.
    #[getter]
    fn manually_scheduled(&self) -> bool {
        self.inner.get().manually_scheduled
    }

    /// Split a loop axis.
    fn split(&mut self, py: Python<'_>, t: u32, axis: i64, factor: i64, inner_split: bool) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().split(t, axis, factor, inner_split)
        })
    }

    /// Merge two loop axes.
    fn merge(&mut self, py: Python<'_>, t: u32, a: i64, b: i64) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().merge(t, a, b)
        })
    }

    /// Reorder loop axes.
    fn reorder(&mut self, py: Python<'_>, t: u32, moves: Vec<(i64, i64)>) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().reorder(t, &moves)
        })
    }

    /// Parallelize a loop axis.
    fn parallelize(&mut self, py: Python<'_>, t: u32, axis: i64, pt: &str) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            let p = parse_enum("parallel type", pt, ParallelType::from_enum_name)?;
            self.inner.get_mut().parallelize(t, axis, p)
        })
    }

    /// Set the memory type.
    fn set_memory_type(&mut self, py: Python<'_>, t: u32, mt: &str) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
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

    /// A copy of the fusion scheduled automatically for inputs of `sizes`, with the
    /// heuristic's (kind, params).
    fn auto_scheduled(&self, py: Python<'_>, sizes: Vec<Vec<i64>>) -> PyResult<(PyFusion, &'static str, Vec<i64>)> {
        guarded(py, || {
            let mut f = self.inner.get().clone();
            let h = crate::sched::auto::schedule(&mut f, &sizes)?;
            Ok((PyFusion { inner: versioned::Versioned::new(f) }, h.kind(), h.values()))
        })
    }

    /// The host program the automatic schedulers (and, failing them, the segmenter) pick
    /// for inputs of `sizes`, with the heuristic's (kind, params); `aligned_bases`: every
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
    ) -> PyResult<AutoProgram> {
        guarded(py, || {
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
        })
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
    fn circular_buffer(&mut self, py: Python<'_>, t: u32, stages: i64) -> PyResult<()> {
        guarded(py, || {
            let t = self.tv(t)?;
            self.inner.get_mut().circular_buffer(t, stages)
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

/// `auto_program`'s result: the program, its heuristic (kind, params) and the contiguity
/// each tensor input was compiled for.
type AutoProgram = (PyHostProgram, &'static str, Vec<i64>, Vec<Vec<Option<bool>>>);

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

    /// CUDA source (runtime header + kernel) and its parameters as (name, kind, index, dtype).
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (index32=false))]
    fn cuda(
        &self,
        py: Python<'_>,
        index32: bool,
    ) -> PyResult<(String, String, Vec<(String, &'static str, i64, i64, &'static str)>)> {
        guarded(py, || {
            let k = self.cuda_kernel(index32)?;
            let params = k
                .params
                .iter()
                .map(|(name, kind, dt)| {
                    use crate::codegen::ParamKind as P;
                    let (kname, a, b) = match kind {
                        P::Input(i) => ("input", *i as i64, 0),
                        P::Output(i) => ("output", *i as i64, 0),
                        P::Buffer(i) => ("buffer", *i as i64, 0),
                        P::Scalar(n) => ("scalar", *n as i64, 0),
                        P::Extent(n) => ("extent", *n as i64, 0),
                        P::Stride(t, a) => ("stride", t.as_u32() as i64, *a as i64),
                    };
                    (name.clone(), kname, a, b, dt.enum_name())
                })
                .collect();
            Ok((k.source(), k.name.clone(), params))
        })
    }

    /// Concrete launch plan for input sizes/strides (elements) and scalar inputs:
    /// (outputs [(sizes, layout, dtype)], buffers [(name, elements, dtype, zero_init, resets_to_zero)],
    /// scalar args, grid, block, smem bytes).
    #[allow(clippy::type_complexity)]
    fn plan(
        &self,
        py: Python<'_>,
        sizes: Vec<Vec<i64>>,
        strides: Vec<Vec<i64>>,
        scalars: Vec<PyScalarArg>,
    ) -> PyResult<(
        Vec<(Vec<i64>, Vec<usize>, &'static str)>,
        Vec<(String, i64, &'static str, bool, bool)>,
        Vec<PyObject>,
        [i64; 3],
        [i64; 3],
        i64,
        bool,
    )> {
        use crate::host::eval::{plan, InputDesc, ScalarArg};
        let p = guarded(py, || {
            // Both index variants take the same parameters; the 64-bit one names them.
            let k = self.cuda_kernel(false)?;
            let inputs: Vec<InputDesc> =
                sizes.into_iter().zip(strides).map(|(sizes, strides)| InputDesc { sizes, strides }).collect();
            let sc: Vec<ScalarArg> = scalars.iter().map(PyScalarArg::to_arg).collect();
            plan(&self.inner, k, &inputs, &sc)
        })?;
        let args = p.scalar_args.iter().map(|a| scalar_to_py(py, a)).collect::<PyResult<Vec<_>>>()?;
        Ok((
            p.outputs.into_iter().map(|o| (o.sizes, o.layout, o.dtype.enum_name())).collect(),
            p.buffers
                .into_iter()
                .map(|b| (b.name, b.elements, b.dtype.enum_name(), b.zero_init, b.resets_to_zero))
                .collect(),
            args,
            p.grid,
            p.block,
            p.smem_bytes,
            p.index32,
        ))
    }

    /// Launch configuration as expressions: (grid, block, dynamic shared memory bytes).
    fn launch(&self) -> (Vec<String>, Vec<String>, String) {
        let sc = &self.inner.fusion.scalars;
        let l = &self.inner.launch;
        (
            l.grid.iter().map(|&v| sc.render(v)).collect(),
            l.block.iter().map(|&v| sc.render(v)).collect(),
            sc.render(l.smem_bytes),
        )
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
                zero_init: a.zero_init,
                resets_to_zero: a.resets_to_zero,
            })
            .collect()
    }

    /// The kernel's gathers: (site id, index tensor, selected-from tensor).
    fn gathers(&self) -> Vec<(u32, String, String)> {
        let f = &self.inner.fusion;
        self.inner.gathers().into_iter().map(|(id, ix, table)| (id, f.tv_name(ix), f.tv_name(table))).collect()
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

/// One buffer of a concrete plan as Python sees it:
/// (name, dtype, sizes, layout, elements, bytes, zero_init, resets_to_zero, place, offset_or_index).
type PyBufferAlloc = (String, &'static str, Vec<i64>, Vec<usize>, i64, i64, bool, bool, &'static str, i64);

/// One launch: (kernel, arg buffer ids, memset buffer ids, scalar args [(value, dtype)], grid, block, smem,
/// 32-bit indexing).
type PyLaunch = (usize, Vec<usize>, Vec<usize>, Vec<(PyObject, &'static str)>, [i64; 3], [i64; 3], i64, bool);

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

    /// Instructions as (op, kernel or -1, buffers, outputs, intermediates): Allocate and
    /// Deallocate name one buffer; LaunchKernel lists inputs, outputs and intermediates.
    #[allow(clippy::type_complexity)]
    fn instructions(&self) -> Vec<(&'static str, i64, Vec<String>, Vec<String>, Vec<String>)> {
        use crate::host::ir::HostInstr as I;
        let names = |bs: &[usize]| -> Vec<String> { bs.iter().map(|b| self.inner.buffers[*b].name.clone()).collect() };
        self.inner
            .instrs
            .iter()
            .map(|i| match i {
                I::Allocate(b) => ("Allocate", -1, names(&[*b]), vec![], vec![]),
                I::Deallocate(b) => ("Deallocate", -1, names(&[*b]), vec![], vec![]),
                I::LaunchKernel { kernel, inputs, outputs, intermediates } => {
                    ("LaunchKernel", *kernel as i64, names(inputs), names(outputs), names(intermediates))
                }
            })
            .collect()
    }

    /// Names of the fusion's tensor inputs, in order.
    fn input_names(&self) -> Vec<String> {
        let f = &self.inner.fusion;
        f.inputs.iter().filter_map(|o| o.tensor()).map(|t| f.tv_name(t)).collect()
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

    /// Concrete plan for input sizes/strides (elements) and scalar inputs:
    /// (buffers, launches, peak_bytes, arena_bytes, zero_pool_bytes); cached per signature.
    #[allow(clippy::type_complexity)]
    fn plan(
        &self,
        py: Python<'_>,
        sizes: Vec<Vec<i64>>,
        strides: Vec<Vec<i64>>,
        scalars: Vec<PyScalarArg>,
    ) -> PyResult<(Vec<PyBufferAlloc>, Vec<PyLaunch>, i64, i64, i64)> {
        use crate::host::eval::{InputDesc, ScalarArg};
        use crate::host::plan::Place;
        let p = guarded(py, || {
            if sizes.len() != strides.len() {
                return Err(KilnError::value(format!("{} size lists but {} stride lists", sizes.len(), strides.len())));
            }
            let inputs: Vec<InputDesc> =
                sizes.into_iter().zip(strides).map(|(sizes, strides)| InputDesc { sizes, strides }).collect();
            let sc: Vec<ScalarArg> = scalars.iter().map(PyScalarArg::to_arg).collect();
            self.cache.get(&self.inner, &inputs, &sc)
        })?;
        let buffers = p
            .buffers
            .iter()
            .map(|b| {
                let (kind, v) = match b.place {
                    Place::Input(n) => ("input", n as i64),
                    Place::Output(n) => ("output", n as i64),
                    Place::Arena(o) => ("arena", o),
                    Place::ZeroPool(o) => ("zero_pool", o),
                    Place::ErrorWord(n) => ("error", n as i64),
                };
                (
                    b.name.clone(),
                    b.dtype.enum_name(),
                    b.sizes.clone(),
                    b.layout.clone(),
                    b.elements,
                    b.bytes,
                    b.zero_init,
                    b.resets_to_zero,
                    kind,
                    v,
                )
            })
            .collect();
        let mut launches = Vec::with_capacity(p.launches.len());
        for l in &p.launches {
            let args = l
                .launch
                .scalar_args
                .iter()
                .map(|(a, d)| Ok((scalar_to_py(py, a)?, d.enum_name())))
                .collect::<PyResult<Vec<_>>>()?;
            launches.push((
                l.kernel,
                l.args.clone(),
                l.memsets.clone(),
                args,
                l.launch.grid,
                l.launch.block,
                l.launch.smem_bytes,
                l.launch.index32,
            ));
        }
        Ok((buffers, launches, p.peak_bytes, p.arena_bytes, p.zero_pool_bytes))
    }
}

fn scalar_to_py(py: Python<'_>, a: &crate::host::eval::ScalarArg) -> PyResult<PyObject> {
    use crate::host::eval::ScalarArg;
    Ok(match a {
        ScalarArg::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        ScalarArg::Float(x) => x.into_pyobject(py)?.into_any().unbind(),
        ScalarArg::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
    })
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
    m.add_class::<PyKernel>()?;
    m.add_class::<PyHostProgram>()?;
    m.add_class::<PyAllocation>()?;
    m.add_class::<PyGlobalBuffer>()?;
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
