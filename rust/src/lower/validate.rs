//! Schedule validation before lowering.
//! Consumes: a scheduled fusion. Produces: nothing. Guarantees: every tensor has at
//! least one output, a vectorized axis is innermost, inline positions are valid, and
//! features this build cannot lower are rejected by name.

use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, ParallelType};

/// Check `f` can be lowered.
pub fn run(f: &Fusion) -> Result<()> {
    if f.outputs.is_empty() {
        bail!("the fusion has no outputs; call fd.add_output(t)");
    }
    for e in f.topo_exprs() {
        let tv = f.exprs[e].output;
        let t = &f.tvs[tv];
        let name = f.tv_name(tv);
        let n = t.loop_domain.len();
        for (a, &id) in t.loop_domain.iter().enumerate() {
            if f.ids[id].parallel == ParallelType::Vectorize && a + 1 != n {
                bail!(
                    "{name}: axis {a} is vectorized but is not the innermost axis ({})",
                    n - 1
                );
            }
        }
        if t.inline_pos > 0 {
            f.check_inline(tv, t.inline_pos)?;
        }
        if let Some(stages) = t.circular_buffer {
            bail!("{name}: circular buffering ({stages} stages) is not supported by this build's lowering yet");
        }
    }
    Ok(())
}
