//! How each kernel of the compiled executor runs: generated code, GEMM, or a fallback.
//!
//! In: the kernel graph, its CPU code and the compiled functions ([`prepare`], once per
//! executor); operand and result locations per run ([`run_step`]). Out: results written
//! into the arena.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_compiler::codegen::jit::{launch, JitModule, KernelFn};
use kiln_compiler::codegen::misc::ReduceLayout;
use kiln_compiler::codegen::program::mask_kind;
use kiln_compiler::codegen::rows::MaskKind;
use kiln_compiler::ir::Op;
use kiln_compiler::launch_plan::{KernelKind, LaunchPlan};
use kiln_compiler::optimize::kernels::{KernelGraph, KernelOp};
use kiln_compiler::optimize::lang::Attr;
use kiln_compiler::optimize::regions::Expr;
use kiln_compiler::optimize::templates::{registry, LnForm, TemplateKind};

use crate::eager::pool::Pool;
use crate::eager::value::Layout;

use super::fallback::{self, Fallback};
use super::gemm;
use super::{Keep, Loc};

mod attention;
mod exec;
mod grouped;
mod words;

use attention::*;
use exec::run_exec;
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
    /// `add`: whether `y` is an operand (every form but `plain`); `rms`: RMSNorm's (no
    /// β operand; its backward has no dβ output, which the launch sees).
    AddLayerNorm {
        f: KernelFn,
        add: bool,
        rms: bool,
    },
    AddLayerNormBwd {
        main: KernelFn,
        finish: KernelFn,
        form: LnForm,
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
                    TemplateKind::AddLayerNorm => Exec::AddLayerNorm {
                        f: f("main")?,
                        add: def.layer_norm_adds(),
                        rms: def.layer_norm_rms(),
                    },
                    TemplateKind::AddLayerNormBwd => Exec::AddLayerNormBwd {
                        main: f("main")?,
                        finish: f("finish")?,
                        form: def.layer_norm_form(),
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
                        Exec::Fallback(fallback::build(kg, (v, op, inputs))?)
                    }
                }
            }
            _ => Exec::Fallback(fallback::build(kg, (v, op, inputs))?),
        };
        let check = if checks && exec.is_native() {
            Some(fallback::build_expanded(kg, (v, op, inputs))?)
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

/// The layout a region kernel reads operand `layout` with, broadcast to the output
/// `shape`, or `None` when the operand must be made contiguous first: the kernel was
/// built for a unit innermost stride (`want_unit`) or a broadcast one (0). Shared by the
/// CPU and CUDA executors.
fn region_operand(
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

/// The address and element strides of each region operand over the output `shape`: read
/// through its own strides where the kernel was built for them (`inner`, see
/// [`region_operand`]), else through the contiguous copy `contig` makes; `at(l, offset)`
/// is the address of element `offset` of `l`. Shared by the CPU and CUDA executors.
pub(crate) fn region_operands<L: Clone, P>(
    ins: &[&L],
    shape: &[usize],
    inner: &[bool],
    layout: impl Fn(&L) -> &Layout,
    mut contig: impl FnMut(&L) -> Result<L, String>,
    at: impl Fn(&L, usize) -> P,
) -> Result<(Vec<P>, Vec<Vec<isize>>), String> {
    let mut ptrs = Vec::with_capacity(ins.len() + 1);
    let mut strides = Vec::with_capacity(ins.len());
    for (k, &l) in ins.iter().enumerate() {
        let want_unit = inner.get(k).copied().unwrap_or(true);
        let (l, b) = match region_operand(layout(l), shape, want_unit)? {
            Some(b) => (l.clone(), b),
            None => {
                let c = contig(l)?;
                let b = layout(&c).broadcast(shape);
                (c, b)
            }
        };
        ptrs.push(at(&l, b.offset));
        strides.push(b.strides.iter().map(|&s| s as isize).collect());
    }
    Ok((ptrs, strides))
}

/// The buffers of a row kernel, in its parameters' order: the first `contiguous` inputs
/// made contiguous (`contig`), the other inputs as they are, then `outs`; with the first
/// input's contiguous location, whose shape sets the rows. Shared by the CPU and CUDA
/// executors.
pub(crate) fn row_buffers<L: Clone, P>(
    (ins, outs): (&[&L], &[L]),
    contiguous: usize,
    mut contig: impl FnMut(&L) -> Result<L, String>,
    base: impl Fn(&L) -> P,
) -> Result<(Vec<P>, L), String> {
    let mut ptrs = Vec::with_capacity(ins.len() + outs.len() + 1);
    let mut first = None;
    for (k, &l) in ins.iter().enumerate() {
        if k < contiguous {
            let c = contig(l)?;
            ptrs.push(base(&c));
            first.get_or_insert(c);
        } else {
            ptrs.push(base(l));
        }
    }
    ptrs.extend(outs.iter().map(&base));
    let first = first.ok_or("internal: a row kernel without a contiguous input")?;
    Ok((ptrs, first))
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
