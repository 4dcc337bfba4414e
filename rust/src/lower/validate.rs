//! Schedule validation before lowering.
//! Consumes: a scheduled fusion. Produces: nothing. Guarantees: every tensor has at
//! least one output, a vectorized axis is innermost, inline positions are valid, cache
//! hints sit on vectorized tensors, and features this build cannot lower are rejected by
//! name.

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, ParallelType};

/// A partly inlined tensor may not share loops that iterate a broadcast its consumer
/// concretizes: its private loops would cover only its own (size-one) extent of that
/// space. Fully inlined tensors are indexed through their consumer instead.
pub fn partial_inlining(f: &Fusion, lg: &LoopGraph, exact: &IdGraph) -> Result<()> {
    for (tv, t) in f.tvs.iter() {
        if t.inline_pos == 0 || t.inline_pos >= t.loop_domain.len() || t.uses.is_empty() {
            continue;
        }
        for a in 0..t.inline_pos {
            let own = t.loop_domain[a];
            let promoted = lg.promoted(tv, a);
            // A broadcast axis (or a split of one) is safe: the tensor does not vary along
            // it, so running it once per iteration of the concretized loop only repeats it.
            let plain_broadcast = f.ids[own].iter_type == crate::ir::IterType::Broadcast;
            if promoted != own
                && !plain_broadcast
                && !exact.same(own, promoted)
                && f.ids[own].extent != f.ids[promoted].extent
            {
                bail!(
                    "{}: inlined at position {} but axis {a} ({}) runs the concretized loop {}; inline it fully (inline_at(-1)) or at {a}",
                    f.tv_name(tv),
                    t.inline_pos,
                    f.id_label(own),
                    f.id_label(promoted)
                );
            }
        }
    }
    Ok(())
}

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
                bail!("{name}: axis {a} is vectorized but is not the innermost axis ({})", n - 1);
            }
        }
        if t.inline_pos > 0 {
            f.check_inline(tv, t.inline_pos)?;
        }
        // A Local (Shared) value lives in one thread (block): a consumer outside the
        // shared loops would read it from another one.
        if t.memory != crate::ir::MemoryType::Global && !t.uses.is_empty() {
            for (a, &id) in t.loop_domain.iter().enumerate().skip(t.inline_pos) {
                let p = f.ids[id].parallel;
                if f.ids[id].iter_type == crate::ir::IterType::Reduction {
                    continue; // a reduced axis leaves the result in every thread (all-reduce)
                }
                let partitions = match t.memory {
                    crate::ir::MemoryType::Local => p.is_thread_or_block(),
                    _ => p.is_block(),
                };
                if partitions {
                    bail!(
                        "{name} is in {} memory but its axis {a} ({}) is parallelized on {} outside its inline position {}; its consumers would read it from another {}: inline {name} past axis {a} or keep the axis serial",
                        t.memory.enum_name(),
                        f.id_label(id),
                        p.enum_name(),
                        t.inline_pos,
                        if p.is_block() { "block" } else { "thread" }
                    );
                }
            }
        }
        // The cache hints are properties of vector loads (`kiln::loadVec*`): on a tensor
        // without a vectorized axis they would change nothing, silently.
        let vectorized = t.loop_domain.iter().any(|&id| f.ids[id].parallel == ParallelType::Vectorize);
        for (set, what) in [(t.streaming_load, "set_streaming_load"), (t.evict_last_load, "set_evict_last")] {
            if set && !vectorized {
                bail!("{name}: {what} applies to vectorized loads, but no axis of {name} is vectorized; parallelize its innermost axis with Vectorize or leave the hint out");
            }
        }
        if let Some(stages) = t.circular_buffer {
            bail!("{name}: circular buffering ({stages} stages) is not supported by this build's lowering yet");
        }
    }
    Ok(())
}
