//! Kernels without generated code, run through the eager executor's kernels.
//!
//! In: a kernel of the kernel graph and its operand locations. Out: its results written
//! into the arena. Two forms:
//! - a primitive (gather, scatter_add, concat, masks, arange, one_hot, slice, a lone
//!   reduction…): the eager executor's kernel for that op, reading the operands in place
//!   (bools converted), its result copied into the arena;
//! - any other kernel: its definition expanded to primitives (a small graph built once)
//!   and run by the eager executor — used only for a kernel kind that has no generated
//!   code yet; `kiln inspect` lists how many kernels run this way.

use std::collections::BTreeMap;

use kiln_compiler::ir::{DType, Graph, Op, TensorType};
use kiln_compiler::optimize::kernels::{KernelGraph, KernelOp};
use kiln_compiler::optimize::templates::registry;
use kiln_compiler::reference::{Precision, RunOptions};
use kiln_compiler::shape::{Dim, Shape};
use kiln_compiler::tensor::Tensor;

use super::launch::{gather_words, write_words, RunCtx};
use super::{to_tensor, Loc};
use crate::eager::ops::{compute, Ctx};
use crate::eager::value::{Data, Store, Value};
use crate::eager::Eager;
use crate::executor::Exec;

/// A kernel of the kernel graph: its value, op and inputs ([`KernelGraph::kernels`]).
pub(crate) type Kernel<'a> = (usize, &'a KernelOp, &'a [usize]);

/// How a kernel without generated code runs.
pub(crate) enum Fallback {
    Prim(Op),
    /// `scatter_add_into(base, ids, src)`: the rows added onto the base, in place when
    /// the plan put the result over it ([`crate::eager::index::scatter_add_onto`]).
    ScatterAddInto,
    Graph(Box<Eager>),
}

/// The fallback of kernel value `v`.
pub(crate) fn build(kg: &KernelGraph, kernel: Kernel<'_>) -> Result<Fallback, String> {
    match kernel.1 {
        KernelOp::Template { id, .. } if registry()[*id as usize].name == "scatter_add_into" => {
            Ok(Fallback::ScatterAddInto)
        }
        _ => build_expanded(kg, kernel),
    }
}

/// Kernel value `v` expanded to primitives, run by the eager executor.
pub(crate) fn build_expanded(
    kg: &KernelGraph,
    (v, op, inputs): Kernel<'_>,
) -> Result<Fallback, String> {
    match op {
        KernelOp::Prim(p) => Ok(Fallback::Prim(p.clone())),
        _ => {
            let mut g = Graph::new("kernel");
            g.dims = kg.dims.clone();
            // A composite dim (`past + tgt_len`) cannot be bound from one input axis:
            // each distinct one becomes a fresh symbol of the small graph.
            let mut fresh: Vec<(Dim, Dim)> = Vec::new();
            let mut ins = Vec::new();
            for (i, &x) in inputs.iter().enumerate() {
                let ty = &kg.values[x].types[0];
                let dims: Vec<Dim> = ty
                    .shape
                    .dims()
                    .iter()
                    .map(|d| {
                        if d.is_const() || d.as_sym().is_some() {
                            return d.clone();
                        }
                        if let Some((_, f)) = fresh.iter().find(|(c, _)| c == d) {
                            return f.clone();
                        }
                        let name = format!("_d{}", fresh.len());
                        g.dims.push(name.clone());
                        fresh.push((d.clone(), Dim::sym(&name)));
                        Dim::sym(&name)
                    })
                    .collect();
                ins.push(
                    g.add_input(&format!("in{i}"), TensorType::new(ty.dtype, Shape(dims)))
                        .map_err(|e| e.to_string())?,
                );
            }
            let scope = kg.values[v].scope.clone();
            let outs = match op {
                KernelOp::Region(e) => vec![e
                    .instantiate(&mut g, &ins, &scope)
                    .map_err(|e| e.to_string())?],
                KernelOp::Template { id, attrs } => registry()[*id as usize]
                    .instantiate(&mut g, &ins, attrs, &scope)
                    .map_err(|e| e.to_string())?,
                KernelOp::Prim(_) => unreachable!(),
            };
            for (k, o) in outs.iter().enumerate() {
                g.add_output(&format!("out{k}"), *o)
                    .map_err(|e| e.to_string())?;
            }
            Ok(Fallback::Graph(Box::new(
                Eager::new(g).map_err(|e| e.to_string())?,
            )))
        }
    }
}

/// An operand as an eager value: f32/i32 read in place, bools converted.
fn value<'a>(l: &'a Loc) -> Value<'a> {
    let n = l.extent();
    match l.dtype {
        DType::I32 => Value {
            // SAFETY: the location's layout stays inside `extent` elements.
            data: Data::I(Store::Borrowed(unsafe {
                std::slice::from_raw_parts(l.ptr as *const i32, n)
            })),
            layout: l.layout.clone(),
        },
        DType::Bool => {
            let w = gather_words(l);
            Value::owned(
                l.shape(),
                w.iter().map(|&x| x != 0).collect::<Vec<bool>>(),
                None,
            )
        }
        _ => Value {
            // SAFETY: as above.
            data: Data::F(Store::Borrowed(unsafe {
                std::slice::from_raw_parts(l.ptr as *const f32, n)
            })),
            layout: l.layout.clone(),
        },
    }
}

/// Writes an eager value into a contiguous location.
fn store(v: &Value<'_>, out: &Loc) -> Result<(), String> {
    if v.shape() != out.shape() {
        return Err(format!(
            "internal: result shape {:?}, expected {:?}",
            v.shape(),
            out.shape()
        ));
    }
    // f32 and i32 results are copied once, straight from the value where it is
    // contiguous; bools become 0/1 words.
    fn copy_in<E: crate::eager::value::Elem>(view: crate::eager::value::View<'_, E>, out: &Loc) {
        let data = crate::eager::index::contiguous(view);
        debug_assert!(out.is_contiguous() && data.len() == out.numel());
        debug_assert_eq!(std::mem::size_of::<E>(), 4);
        // SAFETY: the location is a contiguous buffer of `numel` 4-byte elements, and `E`
        // is a 4-byte element (f32 or i32).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr() as *const u32,
                out.base() as *mut u32,
                data.len().min(out.numel()),
            )
        };
    }
    match &v.data {
        Data::F(_) => copy_in(v.view::<f32>().ok_or("internal: not f32")?, out),
        Data::I(_) => copy_in(v.view::<i32>().ok_or("internal: not i32")?, out),
        Data::B(_) => {
            let view = v.view::<bool>().ok_or("internal: not bool")?;
            let words: Vec<u32> = crate::eager::walk::to_vec(None, view)
                .iter()
                .map(|&x| x as u32)
                .collect();
            write_words(out, &words);
        }
    }
    Ok(())
}

/// Runs a fallback kernel.
pub(crate) fn run(
    fb: &Fallback,
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
) -> Result<(), String> {
    let host = HostCtx {
        dims: ctx.dims,
        seed: ctx.seed,
        step: ctx.step,
        pool: ctx.pool,
    };
    run_host(fb, ins, outs, &host)
}

/// What a fallback kernel needs of a run (host locations only; the CUDA executor copies
/// operands to the host and calls [`run_host`] too).
pub(crate) struct HostCtx<'a> {
    pub dims: &'a BTreeMap<String, i64>,
    pub seed: u64,
    pub step: u32,
    pub pool: &'a std::sync::Arc<crate::eager::pool::Pool>,
}

/// [`run`] with only what a fallback reads of the run.
pub(crate) fn run_host(
    fb: &Fallback,
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &HostCtx<'_>,
) -> Result<(), String> {
    match fb {
        // The embedding gradient (a vocabulary-sized result): summed straight into the
        // arena rather than into a fresh buffer that is then copied.
        Fallback::Prim(Op::ScatterAdd { .. })
            if outs[0].dtype == DType::F32 && outs[0].is_contiguous() && ins.len() == 2 =>
        {
            let (ids, src) = (value(ins[0]), value(ins[1]));
            let out = &outs[0];
            let row: usize = out.shape().iter().skip(1).product();
            // SAFETY: a contiguous f32 location of `numel` elements that this kernel alone
            // writes.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(out.base() as *mut f32, out.numel()) };
            crate::eager::index::scatter_add_into(
                ids.view::<i32>()
                    .ok_or("internal: scatter_add ids are not i32")?,
                src.view::<f32>()
                    .ok_or("internal: scatter_add values are not f32")?,
                row,
                dst,
            )
        }
        Fallback::ScatterAddInto => {
            let out = &outs[0];
            if out.dtype != DType::F32 || !out.is_contiguous() || ins.len() != 3 {
                return Err("internal: scatter_add_into needs a contiguous f32 result".into());
            }
            let row: usize = out.shape().iter().skip(1).product();
            // SAFETY: a contiguous f32 location of `numel` elements that this kernel alone
            // writes (its base, when planned in place, is read here first).
            let dst =
                unsafe { std::slice::from_raw_parts_mut(out.base() as *mut f32, out.numel()) };
            let base = ins[0];
            let in_place = base.dtype == DType::F32
                && base.is_contiguous()
                && base.base() == out.base()
                && base.numel() == out.numel();
            if !in_place {
                let b = value(base);
                let b = b
                    .view::<f32>()
                    .ok_or("internal: scatter_add_into base is not f32")?;
                let b = crate::eager::index::contiguous(b);
                if b.len() != dst.len() {
                    return Err(format!(
                        "internal: scatter_add_into onto {} elements into {}",
                        b.len(),
                        dst.len()
                    ));
                }
                dst.copy_from_slice(&b);
            }
            crate::eager::index::scatter_add_onto(
                value(ins[1])
                    .view::<i32>()
                    .ok_or("internal: scatter_add_into ids are not i32")?,
                value(ins[2])
                    .view::<f32>()
                    .ok_or("internal: scatter_add_into values are not f32")?,
                row,
                dst,
            )
        }
        // A decoding step's key/value caches grow by a concat: written straight into its
        // result, not built in a fresh value that is then copied twice.
        Fallback::Prim(Op::Concat { axis })
            if outs[0].is_contiguous()
                && matches!(outs[0].dtype, DType::F32 | DType::I32)
                && *axis < outs[0].shape().len() =>
        {
            concat_into(ins, &outs[0], *axis)
        }
        Fallback::Prim(op) => {
            let args: Vec<Value<'_>> = ins.iter().map(|l| value(l)).collect();
            let c = Ctx {
                dims: ctx.dims,
                seed: ctx.seed,
                step: ctx.step,
                pool: ctx.pool,
            };
            let v = compute(op, args, outs[0].shape(), &c)?;
            store(&v, &outs[0])
        }
        Fallback::Graph(eager) => {
            let inputs: BTreeMap<String, Tensor> = ins
                .iter()
                .enumerate()
                .map(|(i, l)| (format!("in{i}"), to_tensor(l)))
                .collect();
            let opts = RunOptions {
                precision: Precision::F32,
                seed: ctx.seed,
                step: ctx.step,
                ..RunOptions::default()
            };
            let res = eager
                .run(&inputs, &BTreeMap::new(), &opts)
                .map_err(|e| e.to_string())?;
            for (k, (_, t)) in res.iter().enumerate() {
                let out = outs.get(k).ok_or("internal: too many results")?;
                let words: Vec<u32> = match &t.data {
                    kiln_compiler::tensor::TensorData::F32(v) => {
                        v.iter().map(|x| x.to_bits()).collect()
                    }
                    kiln_compiler::tensor::TensorData::I32(v) => {
                        v.iter().map(|&x| x as u32).collect()
                    }
                    kiln_compiler::tensor::TensorData::Bool(v) => {
                        v.iter().map(|&x| x as u32).collect()
                    }
                    other => return Err(format!("internal: a {} result", other.dtype_name())),
                };
                write_words(out, &words);
            }
            Ok(())
        }
    }
}

/// `concat` along `axis` of f32 or i32 locations `parts` into the contiguous `out` of
/// the same type: the eager kernel ([`crate::eager::index::concat_into`]) reading the
/// parts in place and writing the result where it lives.
fn concat_into(parts: &[&Loc], out: &Loc, axis: usize) -> Result<(), String> {
    let shape = out.shape();
    let logical: Vec<(&[usize], DType)> = parts.iter().map(|p| (p.shape(), p.dtype)).collect();
    check_concat(&logical, shape, out.dtype, axis)?;
    let values: Vec<Value<'_>> = parts.iter().map(|l| value(l)).collect();
    fn views<'a, E: crate::eager::value::Elem>(
        values: &'a [Value<'_>],
    ) -> Option<Vec<crate::eager::value::View<'a, E>>> {
        values.iter().map(|v| v.view::<E>()).collect()
    }
    let n = out.numel();
    match out.dtype {
        DType::F32 => {
            let parts = views::<f32>(&values).ok_or("internal: concat of non-f32 parts")?;
            // SAFETY: a contiguous f32 location of `numel` elements that this kernel alone
            // writes; the parts are other values (a kernel never reads its own result).
            let dst = unsafe { std::slice::from_raw_parts_mut(out.base() as *mut f32, n) };
            crate::eager::index::concat_into(&parts, axis, shape, dst);
        }
        DType::I32 => {
            let parts = views::<i32>(&values).ok_or("internal: concat of non-i32 parts")?;
            // SAFETY: as above, for i32.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.base() as *mut i32, n) };
            crate::eager::index::concat_into(&parts, axis, shape, dst);
        }
        other => return Err(format!("internal: a direct concat of {other:?}")),
    }
    Ok(())
}

/// Whether parts of these shapes (as read) and dtypes concatenate along `axis` into
/// `shape` of `dtype`: the same dtype and rank, equal on every other axis, their sizes
/// along `axis` summing to the result's.
fn check_concat(
    parts: &[(&[usize], DType)],
    shape: &[usize],
    dtype: DType,
    axis: usize,
) -> Result<(), String> {
    let mut sum = 0;
    for &(ps, d) in parts {
        if d != dtype
            || ps.len() != shape.len()
            || ps[..axis] != shape[..axis]
            || ps[axis + 1..] != shape[axis + 1..]
        {
            return Err(format!(
                "internal: concat of {ps:?} into {shape:?} along axis {axis}"
            ));
        }
        sum += ps[axis];
    }
    if sum != shape[axis] {
        return Err(format!(
            "internal: concat parts sum to {sum} along axis {axis}, the result has {}",
            shape[axis]
        ));
    }
    Ok(())
}

/// A concatenation (axis ≥ 1) some of whose operands are read with their rows gathered
/// (`Exec::run_map_gathered`): operand `k` with `rows[k] = Some(r)` is read as its rows
/// `r[0], r[1], …` along axis 0 (its own tensor, contiguous, may hold other rows and more
/// of them). Every result element is copied once, as [`concat_into`] copies it from the
/// gathered tensor.
pub(crate) fn concat_gathered(
    exec: &super::launch::Exec,
    ins: &[&Loc],
    rows: &[Option<&[usize]>],
    outs: &[Loc],
) -> Result<(), String> {
    use rayon::prelude::*;
    let super::launch::Exec::Fallback(Fallback::Prim(Op::Concat { axis })) = exec else {
        return Err("internal: gathered rows reach a kernel other than a concatenation".into());
    };
    let (axis, out) = (*axis, &outs[0]);
    let shape = out.shape().to_vec();
    if axis == 0 || axis >= shape.len() || out.dtype != DType::F32 || !out.is_contiguous() {
        return Err(format!(
            "internal: a gathered concatenation along axis {axis} into {shape:?}"
        ));
    }
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    // Blocks of the outer index per row of axis 0.
    let per_row: usize = shape[1..axis].iter().product();
    // Each operand's elements, its chunk of a result block, and its gathered rows.
    type Part<'a> = (std::borrow::Cow<'a, [f32]>, usize, Option<&'a [usize]>);
    let mut parts: Vec<Part<'_>> = Vec::new();
    let mut logical: Vec<(Vec<usize>, DType)> = Vec::new();
    for (p, r) in ins.iter().zip(rows) {
        let ps = p.shape();
        let mut shape_read = ps.to_vec();
        if let Some(r) = r {
            if !p.is_contiguous() || ps.is_empty() || r.iter().any(|&i| i >= ps[0]) {
                return Err(format!("internal: rows {r:?} gathered from {ps:?}"));
            }
            shape_read[0] = r.len();
        }
        logical.push((shape_read, p.dtype));
    }
    let read: Vec<(&[usize], DType)> = logical.iter().map(|(s, d)| (&s[..], *d)).collect();
    check_concat(&read, &shape, DType::F32, axis)?;
    for (p, r) in ins.iter().zip(rows) {
        let ps = p.shape();
        // Contiguous operands (every gathered one) are read in place, strided ones
        // through a row-major copy.
        let data = if p.is_contiguous() {
            // SAFETY: a contiguous f32 location of `numel` elements, borrowed for the call.
            std::borrow::Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(p.base() as *const f32, p.numel())
            })
        } else {
            let v = value(p);
            let view = v.view::<f32>().ok_or("internal: concat of non-f32 parts")?;
            std::borrow::Cow::Owned(crate::eager::index::contiguous(view).into_owned())
        };
        parts.push((data, ps[axis] * inner, *r));
    }
    let total = shape[axis] * inner;
    if total == 0 || outer == 0 {
        return Ok(());
    }
    // SAFETY: a contiguous f32 location of `numel` elements that this kernel alone
    // writes; the parts are other values.
    let dst = unsafe { std::slice::from_raw_parts_mut(out.base() as *mut f32, out.numel()) };
    let body = |(o, d): (usize, &mut [f32])| {
        let mut at = 0;
        for (v, chunk, r) in &parts {
            let from = match r {
                Some(r) => r[o / per_row] * per_row + o % per_row,
                None => o,
            };
            d[at..at + chunk].copy_from_slice(&v[from * chunk..(from + 1) * chunk]);
            at += chunk;
        }
    };
    if dst.len() >= crate::eager::walk::PAR_MIN {
        dst.par_chunks_mut(total).enumerate().for_each(body);
    } else {
        dst.chunks_mut(total).enumerate().for_each(body);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eager::value::Layout;

    fn loc(data: &mut [u32], layout: Layout, dtype: DType) -> Loc {
        Loc {
            ptr: data.as_mut_ptr() as *mut u8,
            layout,
            dtype,
        }
    }

    /// The element of `layout` at multi-index `idx`.
    fn at(data: &[u32], l: &Layout, idx: &[usize]) -> u32 {
        data[l.offset
            + idx
                .iter()
                .zip(&l.strides)
                .map(|(i, s)| i * s)
                .sum::<usize>()]
    }

    #[test]
    fn concat_into_copies_strided_and_contiguous_parts_along_every_axis() {
        // A [2, 3, 4] part read through a permutation (strided, offset 5), a contiguous
        // part, and an empty one (a cache with no past positions), along each axis.
        let mut a_data: Vec<u32> = (0..5 + 24).map(|i| 1000 + i).collect();
        let a_base = Layout {
            shape: vec![4, 2, 3],
            strides: vec![6, 3, 1],
            offset: 5,
        };
        let a_layout = a_base.permute(&[1, 2, 0]); // [2, 3, 4], innermost stride 6
        for axis in 0..3 {
            let mut b_shape = vec![2, 3, 4];
            b_shape[axis] = 3;
            let mut e_shape = vec![2, 3, 4];
            e_shape[axis] = 0;
            let mut b_data: Vec<u32> = (0..b_shape.iter().product::<usize>() as u32)
                .map(|i| 2000 + i)
                .collect();
            let mut out_shape = vec![2, 3, 4];
            out_shape[axis] += 3;
            let n: usize = out_shape.iter().product();
            let mut out_data = vec![0u32; n];
            let mut empty: Vec<u32> = vec![];
            let (b_layout, e_layout) = (Layout::contiguous(&b_shape), Layout::contiguous(&e_shape));
            let parts = [
                loc(&mut empty, e_layout, DType::F32),
                loc(&mut a_data, a_layout.clone(), DType::F32),
                loc(&mut b_data, b_layout.clone(), DType::F32),
            ];
            let out_layout = Layout::contiguous(&out_shape);
            let out = loc(&mut out_data, out_layout.clone(), DType::F32);
            let refs: Vec<&Loc> = parts.iter().collect();
            concat_into(&refs, &out, axis).unwrap();
            for i in 0..out_shape[0] {
                for j in 0..out_shape[1] {
                    for k in 0..out_shape[2] {
                        let mut idx = [i, j, k];
                        let want = if idx[axis] < a_layout.shape[axis] {
                            at(&a_data, &a_layout, &idx)
                        } else {
                            idx[axis] -= a_layout.shape[axis];
                            at(&b_data, &b_layout, &idx)
                        };
                        assert_eq!(
                            at(&out_data, &out_layout, &[i, j, k]),
                            want,
                            "axis {axis} at {:?}",
                            [i, j, k]
                        );
                    }
                }
            }
            // Parts that do not add up are an error, not a wild write.
            let short = loc(&mut out_data, Layout::contiguous(&out_shape), DType::F32);
            assert!(concat_into(&refs[1..2], &short, axis).is_err());
        }
    }
}
