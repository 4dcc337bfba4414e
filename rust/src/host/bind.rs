//! The input contract of a fusion: runtime arguments (arrays described by dtype, sizes
//! and strides; Python numbers) checked against the definition and turned into one bound
//! environment of sizes, strides and scalar values. The Python checks of `fd.execute` /
//! `fd.lower`, the GPU plan and the CPU interpreter all bind through [`bind_args`], so a
//! mistake gets the same `KilnError` on every path, before anything runs.

use rustc_hash::FxHashMap;

use crate::bail;
use crate::error::{KilnError, Result};
use crate::host::eval::{Bindings, InputDesc, ScalarArg};
use crate::ir::scalar::Val;
use crate::ir::{DataType, Fusion, IterDomainId, IterType, Op, Operand, ReductionOp, Symbol, TvId};

/// One runtime argument of a fusion.
#[derive(Clone, Debug)]
pub enum Arg {
    /// An array: its dtype (`Err(name)` for one kiln has no type for; `Ok(None)` when the
    /// caller has checked it already), sizes and element strides.
    Tensor { dtype: std::result::Result<Option<DataType>, String>, desc: InputDesc },
    /// A Python number.
    Scalar(ScalarArg),
    /// A number the caller has checked already, bound as given.
    Checked(ScalarArg),
    /// An integer outside the int64 range (its decimal text).
    BigInt(String),
    /// Anything else (its type name).
    Other(String),
}

impl Arg {
    fn kind(&self) -> &'static str {
        match self {
            Arg::Tensor { .. } => "an array",
            Arg::Scalar(ScalarArg::Bool(_)) => "a bool",
            Arg::Scalar(ScalarArg::Int(_)) | Arg::BigInt(_) => "an int",
            Arg::Scalar(ScalarArg::Float(_)) => "a float",
            Arg::Checked(_) => "a number",
            Arg::Other(_) => "something else",
        }
    }
}

/// `input {i} ({name})`: how every message names a fusion input.
fn input_name(f: &Fusion, i: usize) -> String {
    match f.inputs.get(i) {
        Some(Operand::Tensor(t)) => format!("input {i} ({})", f.tv_name(*t)),
        Some(Operand::Scalar(v)) => format!("input {i} ({})", f.scalars.render(*v)),
        None => format!("input {i}"),
    }
}

/// Check `args` (in `f.inputs` order) against `f` and bind sizes, strides and scalars.
pub fn bind_args(f: &Fusion, args: &[Arg]) -> Result<Bindings> {
    bind_args_for(f, args, false)
}

/// [`bind_args`]; `any_layout`: the caller compiles kernels for the arrays' own layout
/// (the automatic path), so inputs without declared contiguity take any strides.
pub fn bind_args_for(f: &Fusion, args: &[Arg], any_layout: bool) -> Result<Bindings> {
    if f.outputs.is_empty() {
        bail!("the fusion has no outputs: add one with fd.add_output (an error inside its `with` block ends the definition early)");
    }
    if args.len() != f.inputs.len() {
        let tensors = f.inputs.iter().filter(|o| o.tensor().is_some()).count();
        let missing = if args.len() < f.inputs.len() {
            format!("; {} is missing", input_name(f, args.len()))
        } else {
            String::new()
        };
        bail!(
            "the fusion takes {} inputs but {} were given ({tensors} arrays and {} numbers, in definition order){missing}",
            f.inputs.len(),
            args.len(),
            f.inputs.len() - tensors
        );
    }
    let mut scalars: Vec<ScalarArg> = vec![ScalarArg::Int(0); f.scalar_input_dtypes.len()];
    let mut tensors: FxHashMap<TvId, (usize, &InputDesc)> = FxHashMap::default();
    for (i, (op, arg)) in f.inputs.iter().zip(args).enumerate() {
        match *op {
            Operand::Tensor(tv) => {
                let Arg::Tensor { dtype, desc } = arg else {
                    return Err(KilnError::type_error(format!(
                        "{}: expected an array (NumPy, CuPy or torch), got {}",
                        input_name(f, i),
                        match arg {
                            Arg::Other(t) => t.as_str(),
                            a => a.kind(),
                        }
                    )));
                };
                let want = f.tvs[tv].dtype;
                match dtype {
                    Err(name) => {
                        let known: Vec<&str> = DataType::ALL.iter().map(|d| d.numpy_name()).collect();
                        return Err(KilnError::type_error(format!(
                            "{}: unsupported dtype {name}; expected {} ({})",
                            input_name(f, i),
                            want.numpy_name(),
                            known.join(", ")
                        )));
                    }
                    Ok(Some(d)) if *d != want => {
                        return Err(KilnError::type_error(format!(
                            "{}: dtype {} does not match the definition's {}",
                            input_name(f, i),
                            d.enum_name(),
                            want.enum_name()
                        )))
                    }
                    Ok(_) => {}
                }
                check_shape(f, tv, i, desc)?;
                tensors.insert(tv, (i, desc));
            }
            Operand::Scalar(v) => {
                let Val::Symbol(Symbol::ScalarInput(n)) = f.scalars.get(v) else {
                    crate::bail_internal!("fusion input {i} is a scalar but not a scalar-input symbol");
                };
                let dt = f.scalar_input_dtypes.get(n as usize).copied().unwrap_or(DataType::Double);
                scalars[n as usize] = scalar_value(f, i, dt, arg)?;
            }
        }
    }
    // Sizes: each symbolic size is read from the input axis that defines it; every other
    // axis carrying the same symbol must agree.
    let mut extents = vec![-1i64; f.extent_sources.len()];
    for (n, &(tv, axis)) in f.extent_sources.iter().enumerate() {
        if let Some((_, d)) = tensors.get(&tv) {
            extents[n] = d.sizes[axis];
        }
    }
    let mut strides = FxHashMap::default();
    for (i, op) in f.inputs.iter().enumerate() {
        let Some(tv) = op.tensor() else { continue };
        let d = tensors[&tv].1;
        let logical = f.no_reduction_logical(tv);
        for (axis, &id) in logical.iter().enumerate() {
            if let Val::Symbol(Symbol::Extent(n)) = f.scalars.get(f.ids[id].extent) {
                let e = extents.get(n as usize).copied().unwrap_or(-1);
                if e >= 0 && e != d.sizes[axis] {
                    let (st, sa) = f.extent_sources[n as usize];
                    let other = tensors.get(&st).map_or(0, |x| x.0);
                    bail!(
                        "{}: axis {axis} has size {} but {} axis {sa} has size {e}; the definition makes them equal",
                        input_name(f, i),
                        d.sizes[axis],
                        input_name(f, other)
                    );
                }
            }
        }
        // Runtime strides, by position in the allocation domain (reductions skipped).
        let mut k = 0u32;
        for &id in f.tvs[tv].maybe_allocation() {
            if f.ids[id].iter_type == IterType::Reduction {
                continue;
            }
            let Some(axis) = logical.iter().position(|&l| l == id) else {
                bail!("{}: its allocation domain must be a permutation of its logical axes", input_name(f, i));
            };
            strides.insert((tv, k), d.strides[axis]);
            k += 1;
        }
        if !any_layout || f.tvs[tv].declared_contiguity {
            check_contiguity(f, tv, i, d)?;
        }
    }
    // A strided view reads its input's buffer through the input's strides (unless the view
    // is itself passed as an array, as a kernel's input is: then its own strides).
    for (view, axes) in &f.strided_views {
        let Some(&(_, src)) = f.input_views.iter().find(|(v, _)| v == view) else { continue };
        let Some((_, d)) = tensors.get(&src) else { continue };
        for (k, a) in axes.iter().enumerate() {
            let s = a.and_then(|a| d.strides.get(a).copied()).unwrap_or(0);
            strides.entry((*view, k as u32)).or_insert(s);
        }
    }
    check_mapped_sizes(f, &tensors)?;
    let mut b = Bindings { extents, strides, scalars };
    check_tensor_sizes(f, &b)?;
    bind_permuted_outputs(f, &mut b)?;
    Ok(b)
}

/// The allocation order of `tv` (reductions left out) where it differs from its logical
/// order, else None.
pub fn stored_permuted(f: &Fusion, tv: TvId) -> Option<Vec<IterDomainId>> {
    let alloc = f.tvs[tv].allocation.as_ref()?;
    let alloc: Vec<IterDomainId> =
        alloc.iter().copied().filter(|&id| f.ids[id].iter_type != IterType::Reduction).collect();
    (alloc != f.no_reduction_logical(tv)).then_some(alloc)
}

/// Strides, by logical axis, of the outputs stored in another order than their logical one
/// (`stride_order`): a later kernel of the host program that reads one reads it as an input
/// of these strides (see `segment::segment_fusion`).
fn bind_permuted_outputs(f: &Fusion, b: &mut Bindings) -> Result<()> {
    for &tv in &f.outputs {
        let Some(alloc) = stored_permuted(f, tv) else { continue };
        if f.is_input(tv) {
            continue;
        }
        let logical = f.no_reduction_logical(tv);
        let mut st = vec![0i64; logical.len()];
        let mut next = 1i64;
        for &id in alloc.iter().rev() {
            let Some(axis) = logical.iter().position(|&l| l == id) else { continue };
            st[axis] = next;
            next = next.saturating_mul(b.eval(&f.scalars, f.ids[id].extent)?.max(1));
        }
        for (k, s) in st.into_iter().enumerate() {
            b.strides.entry((tv, k as u32)).or_insert(s);
        }
    }
    Ok(())
}

/// Input axes that the definition's ops align element by element (the exact map: an add of
/// two inputs, a broadcast operand against the axis it is broadcast along) must have one
/// size. Checked against the definition itself, so every path names the inputs.
fn check_mapped_sizes(f: &Fusion, tensors: &FxHashMap<TvId, (usize, &InputDesc)>) -> Result<()> {
    if tensors.len() < 2 {
        return Ok(());
    }
    let exact = crate::analysis::id_graph::IdGraph::exact(f);
    let mut seen: Vec<(IterDomainId, usize, usize, i64)> = Vec::new();
    for (i, op) in f.inputs.iter().enumerate() {
        let Some(tv) = op.tensor() else { continue };
        let Some(&(_, d)) = tensors.get(&tv) else { continue };
        for (axis, &id) in f.no_reduction_logical(tv).iter().enumerate() {
            if f.ids[id].iter_type == IterType::Broadcast {
                continue;
            }
            let size = d.sizes[axis];
            if let Some(&(_, j, ja, js)) = seen.iter().find(|(o, ..)| exact.same(*o, id)) {
                if js != size {
                    bail!(
                        "{}: axis {axis} has size {size} but {} axis {ja} has size {js}; the definition makes them equal",
                        input_name(f, i),
                        input_name(f, j)
                    );
                }
            } else {
                seen.push((id, i, axis, size));
            }
        }
    }
    Ok(())
}

/// Rank, sizes and broadcast axes of one array against its definition.
fn check_shape(f: &Fusion, tv: TvId, i: usize, d: &InputDesc) -> Result<()> {
    let logical = f.no_reduction_logical(tv);
    if d.sizes.len() != logical.len() || d.strides.len() != d.sizes.len() {
        bail!("{}: rank {} does not match the definition's rank {}", input_name(f, i), d.sizes.len(), logical.len());
    }
    for (axis, &id) in logical.iter().enumerate() {
        let want = &f.ids[id];
        let size = d.sizes[axis];
        if size < 0 {
            bail!("{}: axis {axis} has negative size {size}", input_name(f, i));
        }
        if want.iter_type == IterType::Broadcast && size != 1 {
            bail!("{}: axis {axis} has size {size} but is declared a broadcast (size 1)", input_name(f, i));
        }
        if let Some(c) = f.scalars.as_int(want.extent) {
            if c != size {
                bail!("{}: axis {axis} has size {size} but the definition fixes it to {c}", input_name(f, i));
            }
        }
    }
    let mut n = 1i64;
    for &s in &d.sizes {
        n = n.checked_mul(s).ok_or_else(|| {
            KilnError::value(format!("{}: {:?} has more than 2^63 elements", input_name(f, i), d.sizes))
        })?;
    }
    Ok(())
}

/// A scalar argument converted to the scalar input's dtype, or the reason it cannot be.
fn scalar_value(f: &Fusion, i: usize, dt: DataType, arg: &Arg) -> Result<ScalarArg> {
    let what = || input_name(f, i);
    let v = match (dt, arg) {
        (_, Arg::Checked(s)) => return Ok(*s),
        (_, Arg::BigInt(s)) => bail!("{}: {s} does not fit a {} scalar", what(), dt.enum_name()),
        (_, Arg::Tensor { .. } | Arg::Other(_)) => {
            let got = match arg {
                Arg::Other(t) => t.clone(),
                a => a.kind().to_string(),
            };
            return Err(KilnError::type_error(format!(
                "{}: expected a Python scalar ({}), got {got}",
                what(),
                dt.enum_name()
            )));
        }
        (DataType::Bool, Arg::Scalar(ScalarArg::Bool(b))) => ScalarArg::Bool(*b),
        (DataType::Bool, Arg::Scalar(s)) => {
            return Err(KilnError::type_error(format!("{}: got {s:?} for a Bool scalar; expected a bool", what())))
        }
        (d, Arg::Scalar(ScalarArg::Float(x))) if !d.is_float() => {
            let name = d.enum_name();
            let article = if name.starts_with(['A', 'E', 'I', 'O', 'U']) { "an" } else { "a" };
            return Err(KilnError::type_error(format!("{}: got float {x} for {article} {name} scalar", what())));
        }
        (d, Arg::Scalar(ScalarArg::Int(x))) if d.is_float() => ScalarArg::Float(*x as f64),
        (d, Arg::Scalar(ScalarArg::Bool(x))) if d.is_float() => ScalarArg::Float(f64::from(u8::from(*x))),
        (_, Arg::Scalar(ScalarArg::Bool(x))) => ScalarArg::Int(i64::from(*x)),
        (_, Arg::Scalar(s)) => *s,
    };
    if let (DataType::Int32, ScalarArg::Int(x)) = (dt, v) {
        if i32::try_from(x).is_err() {
            bail!("{}: {x} does not fit an Int32 scalar", what());
        }
    }
    Ok(v)
}

/// Strides must match what the definition's contiguity promises.
fn check_contiguity(f: &Fusion, tv: TvId, i: usize, d: &InputDesc) -> Result<()> {
    // An array without elements has no layout to keep (NumPy gives some of its axes
    // stride 0).
    if d.sizes.contains(&0) {
        return Ok(());
    }
    let t = &f.tvs[tv];
    let logical = f.no_reduction_logical(tv);
    let mut expected = 1i64;
    for (&id, &c) in t.maybe_allocation().iter().zip(&t.contiguity).rev() {
        if f.ids[id].iter_type == IterType::Reduction {
            continue;
        }
        let Some(axis) = logical.iter().position(|&l| l == id) else {
            continue;
        };
        let (size, stride) = (d.sizes[axis], d.strides[axis]);
        match c {
            Some(true) => {
                if size > 1 && stride != expected {
                    // A set allocation domain is the layout the kernel indexes; without one or
                    // a declaration, a hand schedule is compiled for row-major arrays.
                    let order: Vec<usize> =
                        t.maybe_allocation().iter().filter_map(|id| logical.iter().position(|l| l == id)).collect();
                    let (why, fix) = if t.allocation.is_some() && order.windows(2).any(|w| w[0] > w[1]) {
                        (
                            format!("must be contiguous in the layout its allocation domain sets (axes {order:?}, outermost first)"),
                            "pass an array in that layout, or give the allocation domain contiguity False",
                        )
                    } else if t.declared_contiguity {
                        ("is declared contiguous".to_string(), "pass a contiguous array or declare contiguity=False")
                    } else {
                        (
                            "must be contiguous: the hand schedule was compiled for row-major arrays, the definition's default layout".to_string(),
                            "pass a contiguous array or declare contiguity=False",
                        )
                    };
                    bail!(
                        "{}: axis {axis} has stride {stride} but {why} (expected stride {expected}); {fix}",
                        input_name(f, i)
                    );
                }
                expected = expected.saturating_mul(size.max(1));
            }
            Some(false) => expected = stride.saturating_mul(size.max(1)),
            None => {}
        }
    }
    Ok(())
}

/// Every tensor of `f` whose size the bound inputs determine has non-negative sizes and
/// at most 2^63 elements (a `full` of a runtime size, a broadcast to static sizes).
fn check_tensor_sizes(f: &Fusion, b: &Bindings) -> Result<()> {
    let mut zero_division: Option<KilnError> = None;
    for (tv, t) in f.tvs.iter() {
        let mut n = 1i64;
        let mut sizes = Vec::with_capacity(t.logical.len());
        for &id in &t.logical {
            if f.ids[id].iter_type == IterType::Reduction {
                continue;
            }
            let s = match b.eval(&f.scalars, f.ids[id].extent) {
                Ok(s) => s,
                // A size the inputs do determine, divided by a runtime zero: raised after the
                // definition's own checks, which say why where they apply (a reshape's `-1`
                // of an empty tensor).
                Err(e) if e.to_string().contains("divide by zero") => {
                    zero_division.get_or_insert_with(|| {
                        KilnError::value(format!(
                            "{} axis {}: its size {} divides by zero for these inputs ({e})",
                            f.tv_name(tv),
                            sizes.len(),
                            f.scalars.render(f.ids[id].extent)
                        ))
                    });
                    sizes.clear();
                    break;
                }
                // A size the inputs do determine, past 2^63 (a pad of huge widths).
                Err(e) if e.to_string().contains("overflow") => bail!(
                    "{} axis {}: its size {} has no 64-bit value for these inputs ({e})",
                    f.tv_name(tv),
                    sizes.len(),
                    f.scalars.render(f.ids[id].extent)
                ),
                // A size these bindings do not determine (a symbol of another kernel).
                Err(_) => {
                    sizes.clear();
                    break;
                }
            };
            if s < 0 {
                bail!(
                    "{} axis {}: size {s} is negative (a size computed from the inputs; a runtime size must be >= 0)",
                    f.tv_name(tv),
                    sizes.len()
                );
            }
            sizes.push(s);
            n = n.checked_mul(s).ok_or_else(|| {
                KilnError::value(format!("{}: sizes {sizes:?}... have more than 2^63 elements", f.tv_name(tv)))
            })?;
        }
    }
    // Sizes the definition needs equal (reshape's element counts, cat's kept axes).
    for c in &f.size_checks {
        if b.eval(&f.scalars, c.holds) == Ok(0) {
            let shown: Vec<String> = c
                .values
                .iter()
                .map(|&v| {
                    let val = b.eval(&f.scalars, v).map(|x| x.to_string()).unwrap_or_else(|_| "?".into());
                    format!("{} = {val}", f.scalars.render(v))
                })
                .collect();
            bail!("{} ({} for these inputs)", c.what, shown.join(", "));
        }
    }
    if let Some(e) = zero_division {
        return Err(e);
    }
    check_aligned_sizes(f, b)?;
    // An index into an empty axis selects nothing that exists.
    for e in f.exprs.values() {
        let (Op::IndexSelect { dim }, Some(Operand::Tensor(table))) = (&e.op, e.inputs.first()) else { continue };
        let Some(&sel) = f.no_reduction_logical(*table).get(*dim) else { continue };
        let count: Option<i64> = f
            .no_reduction_logical(e.output)
            .iter()
            .try_fold(1i64, |a, &id| b.eval(&f.scalars, f.ids[id].extent).ok().map(|n| a.saturating_mul(n)));
        if b.eval(&f.scalars, f.ids[sel].extent) == Ok(0) && count.is_some_and(|n| n > 0) {
            bail!(
                "{} = index_select({}, dim={dim}): axis {dim} of {} is empty, so no index selects an entry",
                f.tv_name(e.output),
                f.tv_name(*table),
                f.tv_name(*table)
            );
        }
    }
    // max and min of no elements have no value (PyTorch raises too); a sum is 0.
    for e in f.exprs.values() {
        let Op::Reduction { op: op @ (ReductionOp::Max | ReductionOp::Min), .. } = e.op else { continue };
        let out = &f.tvs[e.output];
        for (axis, &id) in out.logical.iter().enumerate() {
            if f.ids[id].iter_type == IterType::Reduction && b.eval(&f.scalars, f.ids[id].extent) == Ok(0) {
                bail!(
                    "{} = {}(...): axis {axis} it reduces has size 0; {} of no elements is undefined (reduce a non-empty axis)",
                    f.tv_name(e.output),
                    if op == ReductionOp::Max { "max" } else { "min" },
                    if op == ReductionOp::Max { "the max" } else { "the min" }
                );
            }
        }
    }
    Ok(())
}

/// The axes each element-wise op or broadcast of the definition lines up have equal sizes
/// for these inputs: a runtime size (`full` of a
/// scalar) that disagrees with an input's is refused before any schedule is picked,
/// naming the tensors as the definition does.
fn check_aligned_sizes(f: &Fusion, b: &Bindings) -> Result<()> {
    // Only what the outputs need runs (a definition's unused op is not even sharded).
    for e in f.topo_exprs() {
        let ex = &f.exprs[e];
        // Element-wise ops and broadcasts line their operands up axis by axis; the others
        // (reductions keep their reduced ids, gathers and remaps read computed positions)
        // are the lowering's to check.
        if !matches!(ex.op, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Set | Op::Broadcast { .. }) {
            continue;
        }
        for (pos, op) in ex.inputs.iter().enumerate() {
            let Some(p) = op.tensor() else { continue };
            for (pid, cid) in crate::ir::mapping::logical_pairs(f, e, pos) {
                let (a, c) = (&f.ids[pid], &f.ids[cid]);
                if a.iter_type == IterType::Broadcast || c.iter_type == IterType::Broadcast || a.extent == c.extent {
                    continue;
                }
                let (Ok(x), Ok(y)) = (b.eval(&f.scalars, a.extent), b.eval(&f.scalars, c.extent)) else { continue };
                if x != y {
                    let axis = f.tvs[ex.output].logical.iter().position(|&i| i == cid).unwrap_or(0);
                    // An input's size against a size the definition wrote down: name the input.
                    for (sym, size, fixed) in [(a.extent, x, c.extent), (c.extent, y, a.extent)] {
                        if let (Some((i, in_axis)), Some(k)) = (input_axis(f, sym), f.scalars.as_int(fixed)) {
                            bail!(
                                "{}: axis {in_axis} has size {size} but the definition fixes it to {k} ({} axis {axis}: {})",
                                input_name(f, i),
                                f.tv_name(ex.output),
                                f.expr_short(ex)
                            );
                        }
                    }
                    bail!(
                        "{} axis {axis} and its input {} ({}): sizes {y}{} and {x}{} must be equal",
                        f.tv_name(ex.output),
                        f.tv_name(p),
                        f.expr_short(ex),
                        extent_origin(f, c.extent),
                        extent_origin(f, a.extent)
                    );
                }
            }
        }
    }
    Ok(())
}

/// Where a size comes from, for messages: ` (input 0 (T0) axis 1)`, ` (s0)`, or nothing for a
/// constant or a computed size.
fn extent_origin(f: &Fusion, v: crate::ir::ValId) -> String {
    if let Some((i, axis)) = input_axis(f, v) {
        return format!(" ({} axis {axis})", input_name(f, i));
    }
    match f.scalars.get(v) {
        Val::Symbol(Symbol::ScalarInput(_)) => format!(" ({})", f.scalars.render(v)),
        _ => String::new(),
    }
}

/// The fusion input (position) and axis whose size the symbolic extent `v` is.
fn input_axis(f: &Fusion, v: crate::ir::ValId) -> Option<(usize, usize)> {
    let Val::Symbol(Symbol::Extent(n)) = f.scalars.get(v) else { return None };
    let &(tv, axis) = f.extent_sources.get(n as usize)?;
    Some((f.inputs.iter().position(|o| *o == Operand::Tensor(tv))?, axis))
}

/// The runtime sizes of each symbolic extent and stride of tensor inputs given as
/// (sizes, strides) descriptions and scalars (in their own order): [`bind_args`] for a
/// caller that has checked dtypes and kinds already.
pub fn bind(f: &Fusion, inputs: &[InputDesc], scalars: &[ScalarArg]) -> Result<Bindings> {
    let (mut ti, mut si) = (inputs.iter(), scalars.iter());
    let mut args = Vec::with_capacity(f.inputs.len());
    for op in &f.inputs {
        let next = match op {
            Operand::Tensor(_) => ti.next().map(|d| Arg::Tensor { dtype: Ok(None), desc: d.clone() }),
            Operand::Scalar(_) => si.next().map(|s| Arg::Checked(*s)),
        };
        match next {
            Some(a) => args.push(a),
            None => bail!(
                "the fusion takes {} tensor inputs and {} scalars but {} and {} were given",
                f.inputs.iter().filter(|o| o.tensor().is_some()).count(),
                f.inputs.iter().filter(|o| o.tensor().is_none()).count(),
                inputs.len(),
                scalars.len()
            ),
        }
    }
    if ti.next().is_some() || si.next().is_some() {
        bail!(
            "the fusion takes {} tensor inputs and {} scalars but {} and {} were given",
            f.inputs.iter().filter(|o| o.tensor().is_some()).count(),
            f.inputs.iter().filter(|o| o.tensor().is_none()).count(),
            inputs.len(),
            scalars.len()
        );
    }
    bind_args(f, &args)
}

/// The contiguity flags (per allocation axis, reductions and broadcasts `None`) that
/// arrays of these sizes and strides satisfy: an axis is contiguous when its stride is
/// the extent-weighted stride of the next inner axis (or 1 innermost), as
/// [`check_contiguity`] reads them.
fn observed_contiguity(f: &Fusion, tv: TvId, d: &InputDesc) -> Vec<Option<bool>> {
    let t = &f.tvs[tv];
    let logical = f.no_reduction_logical(tv);
    let mut out = vec![None; t.maybe_allocation().len()];
    let mut expected = 1i64;
    for (k, &id) in t.maybe_allocation().iter().enumerate().rev() {
        let it = f.ids[id].iter_type;
        if it == IterType::Reduction || it == IterType::Broadcast {
            continue;
        }
        let Some(axis) = logical.iter().position(|&l| l == id) else { continue };
        let (Some(&size), Some(&stride)) = (d.sizes.get(axis), d.strides.get(axis)) else { continue };
        let dense = size <= 1 || stride == expected;
        out[k] = Some(dense);
        expected = if dense { expected.saturating_mul(size.max(1)) } else { stride.saturating_mul(size.max(1)) };
    }
    out
}

/// Give every tensor input without declared contiguity the layout of its array (`inputs`
/// in tensor-input order): strided, sliced, transposed and expanded arrays are read
/// through runtime strides. Returns the flags set, per input (the kernel cache key).
pub fn specialize_layout(f: &mut Fusion, inputs: &[InputDesc]) -> Vec<Vec<Option<bool>>> {
    let tensors: Vec<TvId> = f.inputs.iter().filter_map(|o| o.tensor()).collect();
    let mut key = Vec::with_capacity(tensors.len());
    for (tv, d) in tensors.into_iter().zip(inputs) {
        if f.tvs[tv].declared_contiguity {
            key.push(f.tvs[tv].contiguity.clone());
            continue;
        }
        let c = observed_contiguity(f, tv, d);
        f.tvs[tv].contiguity = c.clone();
        // Kernels of this fusion are compiled for that layout: arrays must match it.
        f.tvs[tv].declared_contiguity = true;
        key.push(c);
    }
    key
}
