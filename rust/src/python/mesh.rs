//! Python view of a sharded fusion's mesh program (`host::multidevice`).

use std::sync::Arc;

use pyo3::prelude::*;

use super::{guarded, versioned, PyFusion};
use crate::host::multidevice::{MeshInstr, MeshProgram};
use crate::ir::TvId;

/// A sharded fusion decomposed into local stages and collectives.
#[pyclass(name = "MeshProgram", module = "kiln._core", frozen)]
pub struct PyMeshProgram {
    pub(super) inner: Arc<MeshProgram>,
}

fn ids(ts: &[TvId]) -> Vec<u32> {
    ts.iter().map(|t| t.as_u32()).collect()
}

#[pymethods]
impl PyMeshProgram {
    /// Device ids of the mesh, in mesh order.
    #[getter]
    fn devices(&self) -> Vec<i64> {
        self.inner.devices.clone()
    }

    /// Number of local stages.
    #[getter]
    fn num_stages(&self) -> usize {
        self.inner.stages.len()
    }

    /// Stage `k` as a fusion of its own (automatically scheduled like any definition).
    fn stage_fusion(&self, py: Python<'_>, k: usize) -> PyResult<Py<PyFusion>> {
        let f = guarded(py, || match self.inner.stages.get(k) {
            Some(st) => Ok(st.fusion.clone()),
            None => crate::bail_internal!("stage {k} out of range"),
        })?;
        Py::new(py, PyFusion { inner: versioned::Versioned::new(f) })
    }

    /// Tensor ids of stage `k`'s tensor inputs, in its order.
    fn stage_inputs(&self, k: usize) -> Vec<u32> {
        self.inner.stages.get(k).map(|s| ids(&s.inputs)).unwrap_or_default()
    }

    /// Tensor ids of stage `k`'s outputs, in its order.
    fn stage_outputs(&self, k: usize) -> Vec<u32> {
        self.inner.stages.get(k).map(|s| ids(&s.outputs)).unwrap_or_default()
    }

    /// The host program as (kind, index): `run` stage, `allocate` tensor, `comm` /
    /// `wait` collective, `free` tensor.
    fn instructions(&self) -> Vec<(&'static str, u32)> {
        self.inner
            .instrs
            .iter()
            .map(|i| match *i {
                MeshInstr::RunStage(k) => ("run", k as u32),
                MeshInstr::Allocate(t) => ("allocate", t.as_u32()),
                MeshInstr::Communication(c) => ("comm", c as u32),
                MeshInstr::Wait(c) => ("wait", c as u32),
                MeshInstr::Deallocate(t) => ("free", t.as_u32()),
            })
            .collect()
    }

    /// Collective `c`: (kind, reduction op or "", input tensor, output tensor, in place).
    fn communication(&self, c: usize) -> Option<(&'static str, &'static str, u32, u32, bool)> {
        self.inner.comms.get(c).map(|x| {
            let op = match x.op {
                Some(crate::ir::ReductionOp::Sum) => "sum",
                Some(crate::ir::ReductionOp::Max) => "max",
                Some(crate::ir::ReductionOp::Min) => "min",
                Some(crate::ir::ReductionOp::Prod) => "prod",
                Some(crate::ir::ReductionOp::LogSumExp) => "logsumexp",
                Some(crate::ir::ReductionOp::LogSumExpFloored) => "logsumexp_floored",
                None => "",
            };
            (x.kind.name(), op, x.input.as_u32(), x.output.as_u32(), x.in_place)
        })
    }

    /// True when the stages take the rank's position in the mesh as a last scalar input.
    #[getter]
    fn takes_rank(&self) -> bool {
        self.inner.takes_rank
    }

    /// Number of collectives.
    #[getter]
    fn num_communications(&self) -> usize {
        self.inner.comms.len()
    }

    /// Tensor ids of the fusion's tensor inputs, in order.
    fn inputs(&self) -> Vec<u32> {
        self.inner.local.inputs.iter().filter_map(|o| o.tensor()).map(|t| t.as_u32()).collect()
    }

    /// Tensor ids handed back, in output order.
    fn outputs(&self) -> Vec<u32> {
        ids(&self.inner.outputs)
    }

    /// Name of tensor `t` (`T5`).
    fn name(&self, t: u32) -> String {
        self.inner.local.tv_name(TvId::from_u32(t))
    }

    /// Dtype of tensor `t` (the enum name).
    fn dtype(&self, t: u32) -> String {
        self.inner.local.tvs[TvId::from_u32(t)].dtype.enum_name().to_string()
    }

    /// Sizes of every tensor the program moves, for local input `sizes` and scalar values.
    fn shapes(
        &self,
        py: Python<'_>,
        sizes: Vec<Vec<i64>>,
        scalars: Vec<Option<i64>>,
    ) -> PyResult<Vec<(u32, Vec<i64>)>> {
        guarded(py, || Ok(self.inner.shapes(&sizes, &scalars)?.into_iter().map(|(t, s)| (t.as_u32(), s)).collect()))
    }

    /// The program as text, with each stage's host program inlined.
    fn text(&self, stage_texts: Vec<String>) -> String {
        self.inner.to_text(&stage_texts)
    }

    /// How each tensor of the definition is spread over the mesh.
    fn spreads(&self) -> String {
        self.inner.spreads_text()
    }
}
