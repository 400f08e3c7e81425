//! How each kernel of the compiled executor runs: generated code, GEMM, or a fallback.
//!
//! In: the kernel graph, its CPU code and the compiled functions ([`prepare`], once per
//! executor); operand and result locations per run ([`run_step`]). Out: results written
//! into the arena.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_compiler::codegen::jit::{launch, JitModule, KernelFn};
use kiln_compiler::codegen::misc::{self, ReduceLayout};
use kiln_compiler::codegen::program::mask_kind;
use kiln_compiler::codegen::region;
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_compiler::ir::Op;
use kiln_compiler::launch_plan::{KernelKind, LaunchPlan};
use kiln_compiler::optimize::kernels::{KernelGraph, KernelOp};
use kiln_compiler::optimize::lang::Attr;
use kiln_compiler::optimize::regions::Expr;
use kiln_compiler::optimize::templates::{registry, TemplateKind};

use crate::eager::pool::Pool;
use crate::eager::value::Layout;

use super::fallback::{self, Fallback};
use super::gemm;
use super::{Keep, Loc};

mod attention;
mod grouped;
mod words;

use attention::*;
pub(crate) use grouped::*;
pub(crate) use words::*;

/// Per kernel kind: how its kernels compared with their definitions.
pub type CheckLog = BTreeMap<String, KernelErrors>;

/// An output is held to `1e-5·max|definition| + 1e-6`: relative where `max|definition|`
/// is at least this (where the two terms are equal), absolute below it.
pub const RELATIVE_FROM: f32 = 0.1;

/// How one kernel kind's kernels compared with their definitions (`max|kernel −
/// definition|` per output): the worst relative error among outputs of magnitude at
/// least [`RELATIVE_FROM`], the worst absolute error among smaller ones (gradients that
/// are zero up to rounding, say, where a relative error says nothing), how many kernel
/// outputs were checked and how many were outside the tolerance. A comparison that met a
/// NaN makes its figure NaN.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KernelErrors {
    pub relative: f64,
    pub absolute_small: f64,
    pub checked: usize,
    pub outside: usize,
}

/// What a run needs besides locations.
pub(crate) struct RunCtx<'a> {
    pub dims: &'a BTreeMap<String, i64>,
    /// The generated strided-copy kernel.
    pub copy: KernelFn,
    /// Per kernel kind: how its kernels compared with their definitions.
    pub checks: Option<&'a std::sync::Mutex<CheckLog>>,
    pub seed: u64,
    pub step: u32,
    pub pool: &'a Arc<Pool>,
    /// The kernel of the large matrix products in bf16, if they run so
    /// (`Compiled::set_bf16_products`).
    pub bf16: Option<kiln_matmul::Kernel16>,
    /// With `bf16`: a weight packed once for the products that read it while it is
    /// unchanged, by its value and its location (`Compiled::packed_weight`); `None` where
    /// it is not such a weight.
    pub packed: Option<&'a PackedFn<'a>>,
}

/// See [`RunCtx::packed`].
pub(crate) type PackedFn<'a> =
    dyn Fn(usize, &Loc) -> Option<Arc<kiln_matmul::float16::PackedRhs>> + Sync + 'a;

impl RunCtx<'_> {
    /// The right operand of `step`'s product (`ins[1]`) packed beforehand, where the
    /// product runs in bf16 (`rows` rows) and the operand is a weight that can be.
    fn packed_rhs(
        &self,
        step: &Step,
        ins: &[&Loc],
        rows: usize,
    ) -> Option<Arc<kiln_matmul::float16::PackedRhs>> {
        let (pack, &v) = (self.packed?, step.inputs.get(1)?);
        let (b, kernel) = (ins.get(1)?, self.bf16?);
        let shape = b.shape();
        if shape.len() != 2 || !gemm::takes_16bit(kernel, rows * shape[0] * shape[1], true) {
            return None;
        }
        pack(v, b)
    }
}

/// One kernel, ready to launch.
pub(crate) struct Step {
    /// The kernel's value number.
    pub value: usize,
    /// Its kind (`matmul`, `region`, `attention`, …), for profiles and messages.
    pub kind: String,
    pub inputs: Vec<usize>,
    pub exec: Exec,
    /// With `KILN_CHECK_KERNELS=1`: the kernel's definition, run after it on the same
    /// operands and compared (a debugging aid; see `check`).
    pub check: Option<Fallback>,
    /// The outputs the check compares: those something reads (a kernel need not write
    /// an output nothing reads, as the `loss` entry's cross-entropy writes no gradient).
    pub read: Vec<bool>,
    /// A bias gradient's `sum_rows` and the weight gradient's product that can write it
    /// while it packs `dy` (16-bit products only): each step's partner, from the launch
    /// plan ([`kiln_compiler::fuse::bias_grad_pairs`], [`product_with_sums`]).
    pub bias_grad: Option<usize>,
}

/// How a kernel runs.
pub(crate) enum Exec {
    /// A primitive matmul through GEMM.
    Matmul,
    /// `x·w + b` (then relu): the bias pre-loaded into the result by a generated kernel,
    /// GEMM with `dst = dst + x·w`, relu as a generated epilogue.
    Linear {
        bias: KernelFn,
        relu: Option<KernelFn>,
    },
    Region {
        f: KernelFn,
        expr: Arc<Expr>,
        inner: Vec<bool>,
    },
    Softmax(KernelFn),
    ScaleMaskSoftmax(KernelFn, MaskKind),
    /// Per head: GEMM for `q·kᵀ`, the generated masked softmax, GEMM for `p·v`.
    Attention {
        softmax: KernelFn,
        mask: MaskKind,
    },
    AttentionBwd {
        softmax: KernelFn,
        softmax_bwd: KernelFn,
        mask: MaskKind,
    },
    AddLayerNorm(KernelFn),
    AddLayerNormBwd {
        main: KernelFn,
        finish: KernelFn,
    },
    XentLs {
        f: KernelFn,
        pad: i64,
        /// Whether the function writes the logits' gradient (role `main`), or only the
        /// loss (role `loss`: nothing reads the gradient).
        grad: bool,
    },
    EmbedPe {
        f: KernelFn,
        dropout: Option<(f64, u32)>,
    },
    SumRows(KernelFn),
    Adam(KernelFn),
    Reduce {
        f: KernelFn,
        axis: usize,
        layout: ReduceLayout,
    },
    /// The eager executor's kernels (see `fallback.rs`).
    Fallback(Fallback),
}

impl Exec {
    /// Whether this kernel runs code of its own — generated, GEMM, or a kernel written
    /// for it in Rust (`scatter_add_into`) — rather than the eager executor's kernel of a
    /// primitive or its definition expanded (which a check would compare with itself).
    pub fn is_native(&self) -> bool {
        !matches!(self, Exec::Fallback(f) if !matches!(f, Fallback::ScatterAddInto))
    }
}

/// Prepares every launch of `plan`, the launch plan of `kg`.
pub(crate) fn prepare(
    kg: &KernelGraph,
    plan: &LaunchPlan,
    jit: &JitModule,
    checks: bool,
) -> Result<(Vec<Step>, KernelFn), String> {
    let mut steps = Vec::new();
    let kernels = kg.kernels();
    if plan.launches.len() != kernels.len() {
        return Err(format!(
            "the launch plan lists {} kernels, the kernel graph has {}",
            plan.launches.len(),
            kernels.len()
        ));
    }
    let mut copy = None;
    for (launch, (v, op, inputs)) in plan.launches.iter().zip(kernels) {
        if launch.value != v || launch.inputs != inputs {
            return Err(format!(
                "the launch plan's kernel %{} is not the kernel graph's %{v}",
                launch.value
            ));
        }
        let kind = launch.kind.name().to_string();
        let roles = &launch.functions;
        let f = |role: &str| -> Result<KernelFn, String> {
            let name = roles
                .get(role)
                .ok_or_else(|| format!("kernel %{v} ({kind}) has no `{role}` function"))?;
            jit.get(name)
                .ok_or_else(|| format!("kernel %{v}: function `{name}` is missing from the code"))
        };
        if copy.is_none() {
            copy = Some(f("copy")?);
        }
        let exec = match op {
            KernelOp::Prim(Op::MatMul) if is_f32(kg, inputs) => Exec::Matmul,
            KernelOp::Prim(Op::Reduce { axis, .. }) if roles.contains_key("main") => {
                let rank = kg.values[inputs[0]].types[0].shape.rank();
                Exec::Reduce {
                    f: f("main")?,
                    axis: *axis,
                    layout: if axis + 1 == rank {
                        ReduceLayout::Rows
                    } else {
                        ReduceLayout::Across
                    },
                }
            }
            KernelOp::Region(expr) => Exec::Region {
                f: f("main")?,
                expr: expr.clone(),
                inner: static_inner(roles),
            },
            KernelOp::Template { id, attrs } => {
                let def = &registry()[*id as usize];
                let KernelKind::Template(template) = launch.kind else {
                    return Err(format!("kernel %{v}: the launch plan calls it `{kind}`"));
                };
                match template {
                    TemplateKind::Linear => Exec::Linear {
                        bias: f("bias")?,
                        relu: None,
                    },
                    TemplateKind::LinearRelu => Exec::Linear {
                        bias: f("bias")?,
                        relu: Some(f("epilogue")?),
                    },
                    TemplateKind::Softmax => Exec::Softmax(f("main")?),
                    TemplateKind::ScaleMaskSoftmax => {
                        Exec::ScaleMaskSoftmax(f("softmax")?, mask_kind(&def.variant))
                    }
                    TemplateKind::Attention => Exec::Attention {
                        softmax: f("softmax")?,
                        mask: mask_kind(&def.variant),
                    },
                    TemplateKind::AttentionBwd => Exec::AttentionBwd {
                        softmax: f("softmax")?,
                        softmax_bwd: f("softmax_bwd")?,
                        mask: mask_kind(&def.variant),
                    },
                    TemplateKind::AddLayerNorm => Exec::AddLayerNorm(f("main")?),
                    TemplateKind::AddLayerNormBwd => Exec::AddLayerNormBwd {
                        main: f("main")?,
                        finish: f("finish")?,
                    },
                    // Role `loss`: nothing reads the gradient; the function writes none.
                    TemplateKind::XentLs => Exec::XentLs {
                        f: f(if roles.contains_key("loss") {
                            "loss"
                        } else {
                            "main"
                        })?,
                        pad: xent_pad(v, attrs)?,
                        grad: !roles.contains_key("loss"),
                    },
                    TemplateKind::EmbedPe => Exec::EmbedPe {
                        f: f("main")?,
                        dropout: embed_pe_dropout(v, attrs)?,
                    },
                    TemplateKind::SumRows => Exec::SumRows(f("main")?),
                    TemplateKind::AdamUpdate => Exec::Adam(f("main")?),
                    // Runs in Rust: it touches only the rows the ids name.
                    TemplateKind::ScatterAddInto => {
                        Exec::Fallback(fallback::build(kg, v, op, inputs)?)
                    }
                }
            }
            _ => Exec::Fallback(fallback::build(kg, v, op, inputs)?),
        };
        let check = if checks && exec.is_native() {
            Some(fallback::build_expanded(kg, v, op, inputs)?)
        } else {
            None
        };
        let outputs = kg.values[v].types.len();
        let read = (0..outputs)
            .map(|k| outputs == 1 || kg.output_is_read(v, k))
            .collect();
        steps.push(Step {
            value: v,
            kind,
            inputs: inputs.to_vec(),
            exec,
            check,
            read,
            bias_grad: launch.bias_grad,
        });
    }
    let copy = match copy {
        Some(c) => c,
        None => jit
            .get("copy_strided_0")
            .ok_or("the code has no copy kernel")?,
    };
    Ok((steps, copy))
}

/// The region's static inner-stride flags, which the emitter records in its roles
/// (`inner`: one `0`/`1` per operand).
fn static_inner(roles: &BTreeMap<String, String>) -> Vec<bool> {
    roles
        .get("inner")
        .map(|s| s.chars().map(|c| c == '1').collect())
        .unwrap_or_default()
}

fn is_f32(kg: &KernelGraph, inputs: &[usize]) -> bool {
    inputs
        .iter()
        .all(|&x| kg.values[x].types[0].dtype == kiln_compiler::ir::DType::F32)
}

/// Runs one kernel.
pub(crate) fn run_step(
    step: &Step,
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
) -> Result<(), String> {
    let Some(fb) = &step.check else {
        return run_exec(step, ins, outs, ctx, keep);
    };
    // The definition reads the operands after the kernel ran: keep a copy of each one
    // the kernel may overwrite (an output planned in place of it).
    let spans = |l: &Loc| (l.ptr as usize, l.ptr as usize + 4 * l.extent());
    let saved: Vec<Loc> = ins
        .iter()
        .map(|&l| {
            let (a0, a1) = spans(l);
            let hit = outs.iter().any(|o| {
                let (o0, o1) = spans(o);
                a0 < o1 && o0 < a1
            });
            if !hit {
                return l.clone();
            }
            let p = keep.alloc(l.numel());
            copy_to_contiguous(l, p);
            Loc {
                ptr: p,
                layout: Layout::contiguous(l.shape()),
                dtype: l.dtype,
            }
        })
        .collect();
    run_exec(step, ins, outs, ctx, keep)?;
    let ins: Vec<&Loc> = saved.iter().collect();
    {
        let tmp: Vec<Loc> = outs
            .iter()
            .map(|o| Loc {
                ptr: keep.alloc(o.numel()),
                // The definition writes row-major (a result may be stored otherwise,
                // attention's with its heads merged).
                layout: Layout::contiguous(o.shape()),
                dtype: o.dtype,
            })
            .collect();
        fallback::run(fb, &ins, &tmp, ctx)?;
        for (k, (o, t)) in outs.iter().zip(&tmp).enumerate() {
            if !step.read[k] {
                continue;
            }
            let (a, b) = (gather_words(o), gather_words(t));
            let (mut diff, mut max) = (0f32, 0f32);
            for (x, y) in a.iter().zip(&b) {
                let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
                diff = diff.max((x - y).abs());
                max = max.max(y.abs());
            }
            let within = diff <= 1e-5 * max + 1e-6;
            if let Some(log) = ctx.checks {
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                let e = log.entry(step.kind.clone()).or_default();
                let worst = |w: f64, x: f64| {
                    if x.is_nan() || w.is_nan() {
                        f64::NAN
                    } else {
                        w.max(x)
                    }
                };
                if max >= RELATIVE_FROM || max.is_nan() {
                    e.relative = worst(e.relative, f64::from(diff / max));
                } else {
                    e.absolute_small = worst(e.absolute_small, f64::from(diff));
                }
                e.checked += 1;
                e.outside += usize::from(!within);
            }
            if diff > 1e-5 * max + 1e-6 || diff.is_nan() {
                eprintln!(
                    "KILN_CHECK_KERNELS: %{} {} output {k}: max diff {diff:.3e}, max |def| {max:.3e}",
                    step.value, step.kind
                );
            }
        }
    }
    Ok(())
}

fn run_exec(
    step: &Step,
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
) -> Result<(), String> {
    let copy = ctx.copy;
    // An operand as a contiguous location (copied by the generated copy kernel if not).
    let mut contig = |l: &Loc, keep: &mut Keep| -> Result<Loc, String> {
        if l.is_contiguous() {
            return Ok(l.clone());
        }
        if l.layout.shape.len() > misc::MAX_COPY_RANK {
            let p = keep.alloc(l.numel());
            copy_to_contiguous(l, p);
            return Ok(Loc {
                ptr: p,
                layout: Layout::contiguous(l.shape()),
                dtype: l.dtype,
            });
        }
        let p = keep.alloc(l.numel());
        let strides: Vec<i64> = l.layout.strides.iter().map(|&s| s as i64).collect();
        let (dims, items) = misc::copy_strided_dims(l.shape(), &strides);
        call(copy, &[l.base(), p], &dims, items, 64);
        Ok(Loc {
            ptr: p,
            layout: Layout::contiguous(l.shape()),
            dtype: l.dtype,
        })
    };
    let last = |l: &Loc| l.shape().last().copied().unwrap_or(1);
    match &step.exec {
        Exec::Matmul => {
            let rows = outs[0].numel() / last(&outs[0]).max(1);
            let packed = ctx.packed_rhs(step, ins, rows);
            gemm::matmul(ins[0], ins[1], &outs[0], false, ctx.bf16, packed.as_deref())
        }
        Exec::Linear { bias, relu } => {
            let out = &outs[0];
            let n = last(out);
            let rows = out.numel() / n.max(1);
            let b = contig(ins[2], keep)?;
            if b.numel() != n {
                return Err(format!(
                    "a bias of shape {:?} for a result of {n} columns (one value a column)",
                    b.shape()
                ));
            }
            let packed = ctx.packed_rhs(step, ins, rows);
            // A 16-bit product adds the bias and applies the ReLU to each block of its
            // result while the block is in cache.
            let epilogue = kiln_matmul::Epilogue {
                bias: Some(b.base() as *const f32),
                relu: relu.is_some(),
            };
            let fused = gemm::matmul_epilogue(
                ins[0],
                ins[1],
                out,
                ctx.bf16,
                packed.as_deref(),
                epilogue,
                None,
            );
            if fused.is_some() {
                return Ok(());
            }
            let (dims, items) = misc::rows_dims(rows, n);
            call(*bias, &[b.base(), out.base()], &dims, items, grain(n));
            gemm::matmul(ins[0], ins[1], out, true, ctx.bf16, packed.as_deref())?;
            if let Some(relu) = relu {
                let (dims, items) = misc::relu_dims(out.numel());
                call(*relu, &[out.base()], &dims, items, 32);
            }
            Ok(())
        }
        Exec::Region { f, expr, inner } => {
            let out = &outs[0];
            let shape = out.shape().to_vec();
            let c = shape.last().copied().unwrap_or(1);
            let mut ptrs = Vec::with_capacity(ins.len() + 1);
            let mut strides = Vec::with_capacity(ins.len());
            for (k, l) in ins.iter().enumerate() {
                let want_unit = inner.get(k).copied().unwrap_or(true);
                let mut l = (*l).clone();
                let b = match region_operand(&l.layout, &shape, want_unit)? {
                    Some(b) => b,
                    None => {
                        l = contig(&l, keep)?;
                        l.layout.broadcast(&shape)
                    }
                };
                ptrs.push(l.ptr.wrapping_add(4 * b.offset));
                strides.push(b.strides.iter().map(|&s| s as isize).collect::<Vec<_>>());
            }
            ptrs.push(out.base());
            let (dims, items) = region::region_dims(expr, &shape, &strides, ctx.seed, ctx.step);
            call(*f, &ptrs, &dims, items, grain(c));
            Ok(())
        }
        Exec::Softmax(f) => {
            let x = contig(ins[0], keep)?;
            let c = last(&x);
            let (dims, items) = rows::softmax_dims(x.numel() / c.max(1), c);
            call(*f, &[x.base(), outs[0].base()], &dims, items, grain(c));
            Ok(())
        }
        Exec::ScaleMaskSoftmax(f, mask) => {
            let x = contig(ins[0], keep)?;
            let s = x.shape().to_vec();
            let (dims, items) = rows::scale_mask_softmax_dims(s[0], s[1], s[2], s[3]);
            let ptrs = if *mask == MaskKind::None {
                vec![x.base(), ins[1].base(), outs[0].base()]
            } else {
                let m = contig(ins[1], keep)?;
                vec![
                    x.base(),
                    m.base(),
                    ins[2].base(),
                    ins[3].base(),
                    outs[0].base(),
                ]
            };
            call(*f, &ptrs, &dims, items, grain(s[3]));
            Ok(())
        }
        Exec::Attention { softmax, mask } => {
            attention(ins, &outs[0], *softmax, *mask, keep, &mut contig)
        }
        Exec::AttentionBwd {
            softmax,
            softmax_bwd,
            mask,
        } => attention_bwd(ins, outs, *softmax, *softmax_bwd, *mask, keep, &mut contig),
        Exec::AddLayerNorm(f) => {
            let x = contig(ins[0], keep)?;
            let y = contig(ins[1], keep)?;
            let g = contig(ins[2], keep)?;
            let b = contig(ins[3], keep)?;
            let d = last(&x);
            let (dims, items) = rows::add_layer_norm_dims(x.numel() / d.max(1), d);
            call(
                *f,
                &[
                    x.base(),
                    y.base(),
                    g.base(),
                    b.base(),
                    ins[4].base(),
                    ins[5].base(),
                    outs[0].base(),
                ],
                &dims,
                items,
                grain(d),
            );
            Ok(())
        }
        Exec::AddLayerNormBwd { main, finish } => {
            let x = contig(ins[0], keep)?;
            let y = contig(ins[1], keep)?;
            let g = contig(ins[2], keep)?;
            let dy = contig(ins[3], keep)?;
            let d = last(&x);
            let rows_n = x.numel() / d.max(1);
            let scratch = keep.alloc(rows::add_layer_norm_bwd_scratch(rows_n, d));
            let (dims, items) = rows::add_layer_norm_bwd_dims(rows_n, d);
            call(
                *main,
                &[
                    x.base(),
                    y.base(),
                    g.base(),
                    dy.base(),
                    ins[4].base(),
                    ins[5].base(),
                    outs[0].base(),
                    scratch,
                ],
                &dims,
                items,
                (grain(d) / rows::LN_BWD_BLOCK).max(1),
            );
            let (dims, items) = rows::add_layer_norm_bwd_finish_dims(rows_n, d);
            call(
                *finish,
                &[scratch, outs[1].base(), outs[2].base()],
                &dims,
                items,
                64,
            );
            Ok(())
        }
        Exec::XentLs { f, pad, grad } => {
            let logits = contig(ins[0], keep)?;
            let target = contig(ins[1], keep)?;
            let v = last(&logits);
            let rows_n = logits.numel() / v.max(1);
            let t = gather_words(&target);
            kiln_compiler::bind::check_targets(&t, v, *pad)?;
            let den = t.iter().filter(|&&w| w as i32 as i64 != *pad).count() as f32;
            // The gradient's weight per non-pad row: `1/den`, times the seed in the
            // `seeded` form (a loss-scaled train_step), as `native::xent_ls`.
            let w = match ins.get(5) {
                Some(seed) => match gather_words(seed).as_slice() {
                    [s] => f32::from_bits(*s) * (1.0 / den),
                    s => return Err(format!("xent_ls: the seed has {} elements, not 1", s.len())),
                },
                None => 1.0 / den,
            };
            let inv = keep.alloc(1);
            // SAFETY: a fresh one-element buffer.
            unsafe { *(inv as *mut f32) = w };
            let row_loss = keep.alloc(rows_n);
            let (dims, items) = rows::xent_ls_dims(rows_n, v, *pad);
            let args = rows::xent_ls_buffers(
                [
                    logits.base(),
                    target.base(),
                    ins[2].base(),
                    ins[3].base(),
                    ins[4].base(),
                ],
                row_loss,
                grad.then(|| (inv, outs[1].base())),
            );
            call(*f, &args, &dims, items, grain(v));
            // SAFETY: `row_loss` holds `rows_n` elements the kernel wrote.
            let rl = unsafe { std::slice::from_raw_parts(row_loss as *const f32, rows_n) };
            let mean = rows::xent_ls_finish(rl, den);
            write_words(&outs[0], &[mean.to_bits()]);
            Ok(())
        }
        Exec::EmbedPe { f, dropout } => {
            let table = contig(ins[0], keep)?;
            let ids = contig(ins[1], keep)?;
            let pe = contig(ins[2], keep)?;
            let vocab = table.shape()[0];
            for (i, w) in gather_words(&ids).iter().enumerate() {
                kiln_compiler::bind::check_id(
                    *w as i32,
                    vocab,
                    i,
                    format_args!("the embedding table has {vocab} rows"),
                )?;
            }
            let s = outs[0].shape().to_vec();
            let (b, t, d) = (s[0], s[1], s[2]);
            let (dims, items) = region::embed_pe_dims(d, t, b, *dropout, ctx.seed, ctx.step);
            call(
                *f,
                &[
                    table.base(),
                    ids.base(),
                    pe.base(),
                    ins[3].base(),
                    outs[0].base(),
                ],
                &dims,
                items,
                grain(d),
            );
            Ok(())
        }
        Exec::SumRows(f) => {
            let x = contig(ins[0], keep)?;
            let (dims, items) = misc::sum_rows_dims(x.shape());
            let rows_n = x.numel() / last(&x).max(1);
            call(
                *f,
                &[x.base(), outs[0].base()],
                &dims,
                items,
                (grain(rows_n * 16) / 16).max(1),
            );
            Ok(())
        }
        Exec::Adam(f) => {
            let mut ptrs = Vec::with_capacity(14);
            for l in ins.iter().take(4) {
                ptrs.push(contig(l, keep)?.base());
            }
            for l in ins.iter().skip(4) {
                ptrs.push(l.base());
            }
            for o in outs {
                ptrs.push(o.base());
            }
            let (dims, items) = misc::adam_update_dims(outs[0].numel());
            call(*f, &ptrs, &dims, items, 32);
            Ok(())
        }
        Exec::Reduce { f, axis, layout } => {
            let x = contig(ins[0], keep)?;
            let s = x.shape();
            let outer: usize = s[..*axis].iter().product();
            let len = s[*axis];
            let inner: usize = s[axis + 1..].iter().product();
            let (layout, f) = match (layout, inner) {
                (ReduceLayout::Rows, 1) => (ReduceLayout::Rows, *f),
                (ReduceLayout::Across, _) => (ReduceLayout::Across, *f),
                _ => return Err("internal: a row reduction over a non-last axis".into()),
            };
            let (dims, items) = misc::reduce_dims(layout, outer, len, inner);
            call(f, &[x.base(), outs[0].base()], &dims, items, grain(len));
            Ok(())
        }
        Exec::Fallback(fb) => fallback::run(fb, ins, outs, ctx),
    }
}

/// The layout a region kernel reads operand `layout` with, broadcast to the output
/// `shape`, or `None` when the operand must be made contiguous first: the kernel was
/// built for a unit innermost stride (`want_unit`) or a broadcast one (0). Shared by the
/// CPU and CUDA executors.
pub(crate) fn region_operand(
    layout: &Layout,
    shape: &[usize],
    want_unit: bool,
) -> Result<Option<Layout>, String> {
    let b = layout.broadcast(shape);
    let c = shape.last().copied().unwrap_or(1);
    let s_last = b.strides.last().copied().unwrap_or(0);
    if c <= 1 || (want_unit && s_last == 1) || (!want_unit && s_last == 0) {
        Ok(Some(b))
    } else if want_unit {
        Ok(None)
    } else {
        Err("internal: a broadcast region input is not broadcast".into())
    }
}

/// The padding id of `xent_ls` kernel `%v` from its attributes.
pub(crate) fn xent_pad(v: usize, attrs: &[Attr]) -> Result<i64, String> {
    match attrs.first() {
        Some(Attr::Int(pad)) => Ok(*pad),
        _ => Err(format!("kernel %{v}: xent_ls without its pad id")),
    }
}

/// The dropout `(p, stream)` of `embed_pe` kernel `%v` from its attributes (`None`:
/// no dropout).
pub(crate) fn embed_pe_dropout(v: usize, attrs: &[Attr]) -> Result<Option<(f64, u32)>, String> {
    match attrs {
        [] => Ok(None),
        [Attr::F(p), Attr::Int(stream)] => Ok(Some((p.get(), *stream as u32))),
        other => Err(format!("kernel %{v}: embed_pe attributes {other:?}")),
    }
}

/// Rows per task so that a task has at least ~32k elements of work.
fn grain(row_len: usize) -> usize {
    (32_768 / row_len.max(1)).max(1)
}

/// Launches a generated kernel over `items` (see `jit::launch`).
fn call(f: KernelFn, ptrs: &[*mut u8], dims: &[i64], items: usize, grain: usize) {
    if items == 0 {
        return;
    }
    // SAFETY: every caller passes the buffers and dims of the kernel's documented ABI,
    // sized by the shapes the run bound.
    unsafe { launch(f, ptrs, dims, items, grain) };
}
