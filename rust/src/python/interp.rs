//! Bindings of the CPU interpreter (`kiln._core.execute_cpu`).

use pyo3::prelude::*;

/// Register the interpreter's functions on the extension module.
pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
