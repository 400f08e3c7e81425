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

/// How a kernel without generated code runs.
pub(crate) enum Fallback {
    Prim(Op),
    Graph(Box<Eager>),
}

/// The fallback of kernel value `v`.
pub(crate) fn build(
    kg: &KernelGraph,
    v: usize,
    op: &KernelOp,
    inputs: &[usize],
) -> Result<Fallback, String> {
    match op {
        KernelOp::Prim(p) => Ok(Fallback::Prim(p.clone())),
        _ => build_expanded(kg, v, op, inputs),
    }
}

/// Kernel value `v` expanded to primitives, run by the eager executor.
pub(crate) fn build_expanded(
    kg: &KernelGraph,
    v: usize,
    op: &KernelOp,
    inputs: &[usize],
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
    let words: Vec<u32> = match &v.data {
        Data::F(_) => {
            let view = v.view::<f32>().expect("f32");
            crate::eager::walk::to_vec(None, view)
                .iter()
                .map(|x| x.to_bits())
                .collect()
        }
        Data::I(_) => {
            let view = v.view::<i32>().expect("i32");
            crate::eager::walk::to_vec(None, view)
                .iter()
                .map(|&x| x as u32)
                .collect()
        }
        Data::B(_) => {
            let view = v.view::<bool>().expect("bool");
            crate::eager::walk::to_vec(None, view)
                .iter()
                .map(|&x| x as u32)
                .collect()
        }
    };
    write_words(out, &words);
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
