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
use kiln_compiler::ir::{DType, Op};
use kiln_compiler::launch_plan::{KernelKind, LaunchPlan};
use kiln_compiler::optimize::kernels::{KernelGraph, KernelOp};
use kiln_compiler::optimize::lang::Attr;
use kiln_compiler::optimize::regions::Expr;
use kiln_compiler::optimize::templates::{registry, TemplateKind};
use rayon::prelude::*;

use super::fallback::{self, Fallback};
use super::gemm;
use super::{Keep, Loc};
use crate::eager::pool::Pool;
use crate::eager::value::Layout;
use ::gemm::Parallelism;
use kiln_matmul::Mat;

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

/// The column sums of a bias gradient's `dy` (`[lead…, n]`, contiguous) into `dst`, for
/// a product whose right operand `b` is `dy` itself seen as rows (`[Π lead, n]`, the
/// same address); `None` where it is not.
pub(crate) fn bias_sums(dy: &Loc, b: &Loc, dst: *mut f32) -> Option<kiln_matmul::ColumnSums> {
    let (sy, sb) = (dy.shape(), b.shape());
    let axes = sy.len().checked_sub(1)?;
    if !(1..=kiln_matmul::SUM_AXES).contains(&axes)
        || !dy.is_contiguous()
        || !b.is_contiguous()
        || dy.dtype != DType::F32
        || b.dtype != DType::F32
        || dy.base() != b.base()
        || sb != [sy[..axes].iter().product(), sy[axes]]
    {
        return None;
    }
    let mut lead = [1; kiln_matmul::SUM_AXES];
    lead[..axes].copy_from_slice(&sy[..axes]);
    Some(kiln_matmul::ColumnSums { dst, lead, axes })
}

/// `step`'s product (an [`Exec::Matmul`] not checked) with the column sums `sums` of its
/// right operand, as one 16-bit product that sums each column while it packs it
/// ([`gemm::matmul_epilogue`]); `false`, with nothing written, where the product does
/// not run so.
pub(crate) fn product_with_sums(
    step: &Step,
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    sums: kiln_matmul::ColumnSums,
) -> bool {
    if !matches!(step.exec, Exec::Matmul) || step.check.is_some() || ctx.bf16.is_none() {
        return false;
    }
    let out = &outs[0];
    let rows = out.numel() / out.shape().last().copied().unwrap_or(1).max(1);
    let packed = ctx.packed_rhs(step, ins, rows);
    let e = kiln_matmul::Epilogue::default();
    gemm::matmul_epilogue(
        ins[0],
        ins[1],
        out,
        ctx.bf16,
        packed.as_deref(),
        e,
        Some(sums),
    )
    .is_some()
}

/// The products `steps` — all `linear` kernels or all `matmul` kernels, consecutive in
/// launch order, each with its operands `ins` and results `outs` — all of one left
/// operand `x`, as one group of 16-bit products ([`gemm::group_epilogue`]: `x` packed
/// once for all): the attention's query, key and value projections, every decoder
/// layer's keys and values of the encoder's output, or weight gradients `xᵀ·dy` of one
/// input. A `linear`'s bias and ReLU are its product's epilogue; a `matmul` writes the
/// column sums `sums` asks of its right operand (a bias gradient, as
/// [`product_with_sums`]). `false`, with nothing written, where they do not run so (a
/// kernel checked, kernels of two kinds or another left operand, f32 products, a bias not
/// of one contiguous value a column, sums of an operand not read in place, results
/// overlapping operands); the caller then runs each on its own. The same bits as each
/// on its own.
pub(crate) fn product_group(
    steps: &[&Step],
    ins: &[Vec<&Loc>],
    outs: &[&[Loc]],
    sums: &[Option<kiln_matmul::ColumnSums>],
    ctx: &RunCtx<'_>,
) -> bool {
    let Some(&x) = ins.first().and_then(|i| i.first()) else {
        return false;
    };
    let same_x = |i: &Vec<&Loc>| {
        i.first()
            .is_some_and(|y| y.ptr == x.ptr && y.layout == x.layout)
    };
    let lengths = [ins.len(), outs.len(), sums.len()] == [steps.len(); 3];
    if steps.len() < 2 || !lengths || ctx.bf16.is_none() || !ins.iter().all(same_x) {
        return false;
    }
    let linear = matches!(steps[0].exec, Exec::Linear { .. });
    let mut packed = Vec::with_capacity(steps.len());
    for ((step, ins), (outs, sums)) in steps.iter().zip(ins).zip(outs.iter().zip(sums)) {
        let out = &outs[0];
        let n = out.shape().last().copied().unwrap_or(1);
        let epilogue = match &step.exec {
            Exec::Linear { relu, .. } if linear && sums.is_none() => {
                let bias = ins[2];
                if !bias.is_contiguous() || bias.numel() != n {
                    return false;
                }
                kiln_matmul::Epilogue {
                    bias: Some(bias.base() as *const f32),
                    relu: relu.is_some(),
                }
            }
            Exec::Matmul if !linear => kiln_matmul::Epilogue::default(),
            _ => return false,
        };
        if step.check.is_some() {
            return false;
        }
        let rows = out.numel() / n.max(1);
        // A right operand whose columns are summed is packed here (it is `dy`).
        let p = if sums.is_some() {
            None
        } else {
            ctx.packed_rhs(step, ins, rows)
        };
        packed.push((p, epilogue));
    }
    let members: Vec<gemm::GroupMember<'_>> = ins
        .iter()
        .zip(outs)
        .zip(packed.iter().zip(sums))
        .map(|((ins, outs), ((p, e), s))| (ins[1], &outs[0], p.as_deref(), *e, *s))
        .collect();
    gemm::group_epilogue(x, &members, ctx.bf16).is_some()
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

/// A raw pointer that may cross threads (each task touches its own elements).
#[derive(Clone, Copy)]
struct P(*mut u8);
unsafe impl Send for P {}
unsafe impl Sync for P {}

/// The mask pointer for batch entry `bi` (key: row `bi` of `[b, tk]`; causal: the
/// `[tq, tk]` matrix), or null.
fn mask_at(mask: Option<&Loc>, kind: MaskKind, bi: usize, tk: usize) -> *mut u8 {
    match (mask, kind) {
        (Some(m), MaskKind::Key) => m.base().wrapping_add(4 * bi * tk),
        (Some(m), MaskKind::Causal) => m.base(),
        _ => std::ptr::null_mut(),
    }
}

/// Checks that the attention kernels' score blocks fit in memory before they are
/// allocated: `blocks` `[tq, tk]` f32 matrices per worker thread (a sentence of 100,000
/// tokens asks 40 GB of each; the allocation would abort the process).
fn scores_fit(kind: &str, blocks: usize, tq: usize, tk: usize) -> Result<(), String> {
    let threads = rayon::current_num_threads().max(1) as u64;
    let need = (blocks as u64)
        .saturating_mul(threads)
        .saturating_mul(tq as u64)
        .saturating_mul(tk as u64)
        .saturating_mul(4);
    kiln_compiler::memory::ensure(
        need,
        || {
            format!(
                "the compiled executor's `{kind}` ({blocks} f32 [{tq}, {tk}] score block(s) \
                 for each of {threads} threads)"
            )
        },
        || kiln_compiler::memory::SMALLER_RUN.into(),
    )
    .map_err(|e| e.to_string())
}

/// Attention forward: per (batch, head), `s = q·kᵀ` (GEMM), the masked scaled softmax
/// in place (generated), `o = s·v` (GEMM). Heads run in parallel.
fn attention(
    ins: &[&Loc],
    out: &Loc,
    softmax: KernelFn,
    mask: MaskKind,
    keep: &mut Keep,
    contig: &mut dyn FnMut(&Loc, &mut Keep) -> Result<Loc, String>,
) -> Result<(), String> {
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let (m, scale, fill) = if mask == MaskKind::None {
        (None, ins[3], None)
    } else {
        (Some(contig(ins[3], keep)?), ins[4], Some(ins[5]))
    };
    let qs = q.shape();
    let (b, h, tq, dk) = (qs[0], qs[1], qs[2], qs[3]);
    let tk = k.shape()[2];
    let dv = v.shape()[3];
    let (sp, fp) = (
        P(scale.base()),
        P(fill.map(|f| f.base()).unwrap_or(std::ptr::null_mut())),
    );
    let o = HeadsOut::of(out)?;
    scores_fit("attention", 1, tq, tk)?;
    let (dims, _) = rows::scale_mask_softmax_dims(1, 1, tq, tk);
    (0..b * h).into_par_iter().for_each_init(
        || vec![0f32; tq * tk],
        |s, bh| {
            let (bi, hi) = (bh / h, bh % h);
            let (sp, fp, o) = (sp, fp, &o);
            let qm = head(q, bi, hi, 2, 3);
            let kt = head(k, bi, hi, 3, 2);
            // SAFETY: each task writes its own scratch and its own head of `out`.
            unsafe {
                kiln_matmul::gemm_one(
                    (tq, dk, tk),
                    s.as_mut_ptr(),
                    tk as isize,
                    qm,
                    kt,
                    false,
                    Parallelism::None,
                );
                let sptr = s.as_mut_ptr() as *mut u8;
                let ptrs: Vec<*mut u8> = if mask == MaskKind::None {
                    vec![sptr, sp.0, sptr]
                } else {
                    vec![sptr, mask_at(m.as_ref(), mask, bi, tk), sp.0, fp.0, sptr]
                };
                softmax(ptrs.as_ptr(), dims.as_ptr(), 0, tq as i64);
                let pm = Mat {
                    ptr: s.as_ptr(),
                    rs: tk as isize,
                    cs: 1,
                };
                let vm = head(v, bi, hi, 2, 3);
                kiln_matmul::gemm_one(
                    (tq, tk, dv),
                    o.at(bi, hi),
                    o.rs,
                    pm,
                    vm,
                    false,
                    Parallelism::None,
                );
            }
        },
    );
    let _ = dk;
    Ok(())
}

/// Where an attention kernel writes head (bi, hi) of a `[b, h, t, d]` result: contiguous,
/// or with the heads merged (`[b, t, h, d]` storage, [`Layout::heads_merged`]); rows of
/// `d` contiguous elements either way.
#[derive(Clone, Copy)]
struct HeadsOut {
    ptr: P,
    sb: usize,
    sh: usize,
    /// The row stride.
    rs: isize,
}

impl HeadsOut {
    fn of(l: &Loc) -> Result<HeadsOut, String> {
        let st = &l.layout.strides;
        if st.len() != 4 || (st[3] != 1 && l.layout.shape[3] > 1) {
            return Err(format!(
                "internal: an attention result of layout {:?} (rows of contiguous elements expected)",
                l.layout
            ));
        }
        Ok(HeadsOut {
            ptr: P(l.base()),
            sb: st[0],
            sh: st[1],
            rs: st[2] as isize,
        })
    }

    /// The first element of head (bi, hi).
    fn at(&self, bi: usize, hi: usize) -> *mut f32 {
        (self.ptr.0 as *mut f32).wrapping_add(bi * self.sb + hi * self.sh)
    }
}

/// The `[rows, cols]` matrix of head (bi, hi) of a `[b, h, t, d]` location, with rows
/// along axis `r` and columns along axis `c` (`r = 3, c = 2` reads it transposed).
fn head(l: &Loc, bi: usize, hi: usize, r: usize, c: usize) -> Mat {
    let st = &l.layout.strides;
    let off = l.layout.offset + bi * st[0] + hi * st[1];
    Mat {
        ptr: (l.ptr as *const f32).wrapping_add(off),
        rs: st[r] as isize,
        cs: st[c] as isize,
    }
}

/// Attention backward: per (batch, head), recompute `p` (GEMM + generated softmax),
/// `dv = pᵀ·g`, `dp = g·vᵀ`, `ds = softmax_bwd(p, dp)·scale` (generated; zero where
/// masked), `dq = ds·k`, `dk = dsᵀ·q`.
fn attention_bwd(
    ins: &[&Loc],
    outs: &[Loc],
    softmax: KernelFn,
    softmax_bwd: KernelFn,
    mask: MaskKind,
    keep: &mut Keep,
    contig: &mut dyn FnMut(&Loc, &mut Keep) -> Result<Loc, String>,
) -> Result<(), String> {
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let (m, g, scale, fill) = if mask == MaskKind::None {
        (None, ins[3], ins[4], None)
    } else {
        (Some(contig(ins[3], keep)?), ins[4], ins[5], Some(ins[6]))
    };
    let qs = q.shape();
    let (b, h, tq, dk) = (qs[0], qs[1], qs[2], qs[3]);
    let tk = k.shape()[2];
    let dv = v.shape()[3];
    let (sp, fp) = (
        P(scale.base()),
        P(fill.map(|f| f.base()).unwrap_or(std::ptr::null_mut())),
    );
    let (dq, dkk, dvv) = (
        HeadsOut::of(&outs[0])?,
        HeadsOut::of(&outs[1])?,
        HeadsOut::of(&outs[2])?,
    );
    scores_fit("attention_bwd", 2, tq, tk)?;
    let (dims, _) = rows::scale_mask_softmax_dims(1, 1, tq, tk);
    let (bdims, _) = rows::softmax_bwd_dims(tq, tk);
    let mloc = m.as_ref();
    (0..b * h).into_par_iter().for_each_init(
        || (vec![0f32; tq * tk], vec![0f32; tq * tk]),
        |(s, dp), bh| {
            let (bi, hi) = (bh / h, bh % h);
            let (sp, fp, dq, dkk, dvv) = (sp, fp, &dq, &dkk, &dvv);
            let mp = mask_at(mloc, mask, bi, tk);
            // SAFETY: each task writes its own scratch and its own heads of the results.
            unsafe {
                kiln_matmul::gemm_one(
                    (tq, dk, tk),
                    s.as_mut_ptr(),
                    tk as isize,
                    head(q, bi, hi, 2, 3),
                    head(k, bi, hi, 3, 2),
                    false,
                    Parallelism::None,
                );
                let sptr = s.as_mut_ptr() as *mut u8;
                let ptrs: Vec<*mut u8> = if mask == MaskKind::None {
                    vec![sptr, sp.0, sptr]
                } else {
                    vec![sptr, mp, sp.0, fp.0, sptr]
                };
                softmax(ptrs.as_ptr(), dims.as_ptr(), 0, tq as i64);
                let pm = Mat {
                    ptr: s.as_ptr(),
                    rs: tk as isize,
                    cs: 1,
                };
                let pt = Mat {
                    ptr: s.as_ptr(),
                    rs: 1,
                    cs: tk as isize,
                };
                let gm = head(g, bi, hi, 2, 3);
                // dv = pᵀ·g
                kiln_matmul::gemm_one(
                    (tk, tq, dv),
                    dvv.at(bi, hi),
                    dvv.rs,
                    pt,
                    gm,
                    false,
                    Parallelism::None,
                );
                // dp = g·vᵀ
                kiln_matmul::gemm_one(
                    (tq, dv, tk),
                    dp.as_mut_ptr(),
                    tk as isize,
                    gm,
                    head(v, bi, hi, 3, 2),
                    false,
                    Parallelism::None,
                );
                let dpp = dp.as_mut_ptr() as *mut u8;
                let bp = [sptr, dpp, sp.0, dpp];
                softmax_bwd(bp.as_ptr(), bdims.as_ptr(), 0, tq as i64);
                let _ = pm;
                if !mp.is_null() {
                    let mi = mp as *const i32;
                    for i in 0..tq {
                        let row = if mask == MaskKind::Key { 0 } else { i * tk };
                        for j in 0..tk {
                            if *mi.add(row + j) == 0 {
                                dp[i * tk + j] = 0.0;
                            }
                        }
                    }
                }
                let ds = Mat {
                    ptr: dp.as_ptr(),
                    rs: tk as isize,
                    cs: 1,
                };
                let dst = Mat {
                    ptr: dp.as_ptr(),
                    rs: 1,
                    cs: tk as isize,
                };
                kiln_matmul::gemm_one(
                    (tq, tk, dk),
                    dq.at(bi, hi),
                    dq.rs,
                    ds,
                    head(k, bi, hi, 2, 3),
                    false,
                    Parallelism::None,
                );
                kiln_matmul::gemm_one(
                    (tk, tq, dk),
                    dkk.at(bi, hi),
                    dkk.rs,
                    dst,
                    head(q, bi, hi, 2, 3),
                    false,
                    Parallelism::None,
                );
            }
        },
    );
    Ok(())
}

/// The elements of a location in row-major order, as 4-byte words.
pub(crate) fn gather_words(loc: &Loc) -> Vec<u32> {
    let n = loc.numel();
    let mut out = Vec::with_capacity(n);
    let p = loc.ptr as *const u32;
    if loc.is_contiguous() {
        // SAFETY: a contiguous layout covers `offset .. offset + n`.
        unsafe { out.extend_from_slice(std::slice::from_raw_parts(p.add(loc.layout.offset), n)) };
        return out;
    }
    let shape = &loc.layout.shape;
    let strides = &loc.layout.strides;
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let off = loc.layout.offset + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
        // SAFETY: every multi-index of the layout is inside the location's buffer.
        out.push(unsafe { *p.add(off) });
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Writes row-major words into a contiguous location.
pub(crate) fn write_words(loc: &Loc, words: &[u32]) {
    debug_assert!(loc.is_contiguous() && words.len() == loc.numel());
    // SAFETY: the location is a contiguous buffer of `numel` elements.
    unsafe {
        std::ptr::copy_nonoverlapping(
            words.as_ptr(),
            loc.base() as *mut u32,
            words.len().min(loc.numel()),
        )
    };
}

/// Copies a strided location into a contiguous buffer at `dst` with the generated copy
/// kernel (rank ≤ 5; a plain loop otherwise).
pub(crate) fn copy_with(copy: KernelFn, src: &Loc, dst: *mut u8) {
    if src.layout.shape.len() > misc::MAX_COPY_RANK {
        return copy_to_contiguous(src, dst);
    }
    let strides: Vec<i64> = src.layout.strides.iter().map(|&s| s as i64).collect();
    let (dims, items) = misc::copy_strided_dims(src.shape(), &strides);
    let row = src.shape().last().copied().unwrap_or(1);
    call(copy, &[src.base(), dst], &dims, items, grain(row));
}

/// Copies a strided location into a fresh contiguous buffer at `dst`.
pub(crate) fn copy_to_contiguous(src: &Loc, dst: *mut u8) {
    let w = gather_words(src);
    // SAFETY: the caller allocated `numel` elements at `dst`.
    unsafe { std::ptr::copy_nonoverlapping(w.as_ptr(), dst as *mut u32, w.len()) };
}
