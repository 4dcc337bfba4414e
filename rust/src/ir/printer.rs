//! Readable dumps of the fusion IR: the math (`str(fd)`) and each tensor's
//! logical -> loop transforms (`t.print_transforms()`).

use std::fmt::Write as _;

use crate::ir::ops::reduction_name;
use crate::ir::{Expr, Fusion, IterDomainId, Op, Operand, ParallelType, Transform, TvId};

impl Fusion {
    /// An id as `iS7{i0}`: iter type, parallel type, number, extent.
    pub fn id_label(&self, id: IterDomainId) -> String {
        let d = &self.ids[id];
        let p = if d.parallel == ParallelType::Serial { "S" } else { d.parallel.tag() };
        format!("{}{}{}{{{}}}", d.iter_type.tag(), p, id.as_u32(), self.scalars.render(d.extent))
    }

    /// A tensor as `T3_l_float[iS6{i0}, rS7{i1}]` (its loop domain, `ca` marks the inline position).
    pub fn tv_label(&self, tv: TvId) -> String {
        let t = &self.tvs[tv];
        let tag = if t.tensor_memory { "t" } else { t.memory.tag() };
        let mut s = format!("T{}_{}_{}[", tv.as_u32(), tag, t.dtype);
        for (i, &id) in t.loop_domain.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            s.push_str(&self.id_label(id));
        }
        s.push(']');
        if t.inline_pos > 0 {
            let _ = write!(s, " ca_pos({})", t.inline_pos);
        }
        if t.streaming_load {
            s.push_str(" streaming");
        }
        if t.evict_last_load {
            s.push_str(" evict_last");
        }
        if let Some(cb) = t.circular_buffer {
            let _ = write!(s, " circular_buffer(stages={}, prefetch={})", cb.stages, cb.prefetch);
        }
        s
    }

    fn operand_label(&self, o: Operand) -> String {
        match o {
            Operand::Tensor(t) => self.tv_label(t),
            Operand::Scalar(v) => self.scalars.render(v),
        }
    }

    /// One line of math for an expr.
    pub fn expr_line(&self, e: &Expr) -> String {
        let out = self.tv_label(e.output);
        let args: Vec<String> = e.inputs.iter().map(|&o| self.operand_label(o)).collect();
        let rhs = match &e.op {
            Op::Unary(u) => format!("{}({})", u.name(), args[0]),
            Op::Binary(b) => format!("{}({}, {})", b.name(), args[0], args[1]),
            Op::Where => format!("where({}, {}, {})", args[0], args[1], args[2]),
            Op::Cast(d) => format!("cast({}, {})", args[0], d.enum_name()),
            Op::Reduction { op, init } => {
                format!("reduction({}, op = {}, init = {})", args[0], reduction_name(*op), self.scalars.render(*init))
            }
            Op::Broadcast { is_new } => format!("broadcast({}, is_new = {:?})", args[0], is_new),
            Op::Permute { perm } => format!("permute({}, dims = {:?})", args[0], perm),
            Op::Squeeze { removed } => format!("squeeze({}, removed = {:?})", args[0], removed),
            Op::IndexSelect { dim } => format!("index_select({}, dim = {dim}, index = {})", args[0], args[1]),
            Op::Set => format!("set({})", args[0]),
            Op::Remap { name, index, valid } => {
                let at: Vec<String> = index.iter().map(|&v| self.scalars.render(v)).collect();
                let guard = valid.map(|v| format!(" where {}, else 0", self.scalars.render(v))).unwrap_or_default();
                format!("{name}({}) = {}[{}]{guard}", args[0], args[0], at.join(", "))
            }
            Op::Full { value } => format!("full(value = {})", self.scalars.render(*value)),
            Op::Mask { valid } => format!("mask({})", self.scalars.render(*valid)),
            Op::Iota { start, step } => {
                format!("iota(start = {}, step = {})", self.scalars.render(*start), self.scalars.render(*step))
            }
            Op::Random { dist, a, b, seed, offset } => format!(
                "{}({}, {}, seed = {}, offset = {})",
                if *dist == crate::ir::RandomDist::Uniform { "uniform" } else { "normal" },
                self.scalars.render(*a),
                self.scalars.render(*b),
                self.scalars.render(*seed),
                self.scalars.render(*offset)
            ),
        };
        format!("{out}\n   = {rhs}")
    }

    /// One line of math with tensor names only (`T2 = mul(T1, 2.0)`), for kernel IR.
    pub fn expr_short(&self, e: &Expr) -> String {
        let name = |o: &Operand| match *o {
            Operand::Tensor(t) => self.tv_name(t),
            Operand::Scalar(v) => self.scalars.render(v),
        };
        let args: Vec<String> = e.inputs.iter().map(name).collect();
        let op = match &e.op {
            Op::Unary(u) => u.name().to_string(),
            Op::Binary(b) => b.name().to_string(),
            Op::Where => "where".into(),
            Op::Cast(d) => format!("cast<{}>", d.enum_name()),
            Op::Reduction { op, .. } => format!("reduce_{}", reduction_name(*op)),
            Op::Broadcast { .. } => "broadcast".into(),
            Op::Permute { perm } => format!("permute{perm:?}"),
            Op::Squeeze { .. } => "squeeze".into(),
            Op::IndexSelect { dim } => format!("index_select<dim={dim}>"),
            Op::Set => "set".into(),
            Op::Remap { name, .. } => (*name).into(),
            Op::Full { value } => format!("full<{}>", self.scalars.render(*value)),
            Op::Mask { .. } => "mask".into(),
            Op::Iota { .. } => "iota".into(),
            Op::Random { dist, .. } => format!("{dist:?}").to_lowercase(),
        };
        format!("{} = {op}({})", self.tv_name(e.output), args.join(", "))
    }

    /// The whole fusion as text: inputs, outputs and the math in dependency order.
    pub fn math_string(&self) -> String {
        let mut s = String::from("Inputs:\n");
        for &i in &self.inputs {
            let _ = writeln!(s, "  {}", self.operand_label(i));
        }
        s.push_str("Outputs:\n");
        for &o in &self.outputs {
            let _ = writeln!(s, "  {}", self.tv_label(o));
        }
        s.push_str("\n%kernel_math {\n");
        for e in self.topo_exprs() {
            let _ = writeln!(s, "{}", self.expr_line(&self.exprs[e]));
        }
        s.push_str("} // %kernel_math\n");
        s
    }

    /// `tv`'s domains and the transforms between them.
    pub fn transforms_string(&self, tv: TvId) -> String {
        let t = &self.tvs[tv];
        let ids = |v: &[IterDomainId]| v.iter().map(|&i| self.id_label(i)).collect::<Vec<_>>().join(", ");
        let mut s = format!("{}\n", self.tv_label(tv));
        if let Some(r) = &t.root {
            let _ = writeln!(s, " root domain : ({})", ids(r));
        }
        let _ = writeln!(s, " logical domain : ({})", ids(&t.logical));
        let _ = writeln!(
            s,
            " contiguity: {}",
            t.contiguity
                .iter()
                .map(|c| match c {
                    Some(true) => "t",
                    Some(false) => "f",
                    None => "n",
                })
                .collect::<Vec<_>>()
                .join(" ")
        );
        for tr in self.transforms_of(tv) {
            match self.transforms[tr] {
                Transform::Split { input, factor, inner_split, outer, inner } => {
                    let _ = writeln!(
                        s,
                        "  Split: {} by factor {} -> {}, {}{}",
                        self.id_label(input),
                        self.scalars.render(factor),
                        self.id_label(outer),
                        self.id_label(inner),
                        if inner_split { "" } else { " (outer split)" }
                    );
                }
                Transform::Merge { outer, inner, out } => {
                    let _ = writeln!(
                        s,
                        "  Merge: {} and {} -> {}",
                        self.id_label(outer),
                        self.id_label(inner),
                        self.id_label(out)
                    );
                }
            }
        }
        if let Some(a) = &t.allocation {
            let _ = writeln!(s, " allocation domain : ({})", ids(a));
        }
        let _ = writeln!(s, " loop domain : ({})", ids(&t.loop_domain));
        s
    }
}
