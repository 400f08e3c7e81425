//! What each kernel of a CUDA artifact entry launches, resolved once per executor.
//!
//! In: the entry's kernel graph and the manifest's per-kernel [`KernelLaunch`]es and
//! function list. Out: one [`Step`] per kernel, naming the generated functions by role
//! (checked to exist in the module) and the library routine, mirroring the CPU executor's
//! `launch::prepare`. Pure: runs without a GPU.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kiln_compiler::codegen::cuda::{KernelLaunch, Library};
use kiln_compiler::codegen::misc::ReduceLayout;
use kiln_compiler::codegen::program::mask_kind;
use kiln_compiler::codegen::rows::MaskKind;
use kiln_compiler::ir::{DType, Op};
use kiln_compiler::launch_plan::LaunchPlan;
use kiln_compiler::optimize::kernels::{KernelGraph, KernelOp};
use kiln_compiler::optimize::lang::Attr;
use kiln_compiler::optimize::regions::Expr;
use kiln_compiler::optimize::templates::{registry, LnForm, TemplateKind};
use kiln_compiler::shape::Dim;

use crate::compiled::fallback::{self, Fallback};
use crate::compiled::launch::{embed_pe_dropout, xent_pad};

/// One kernel, ready to launch.
pub(crate) struct Step {
    pub value: usize,
    pub kind: String,
    pub inputs: Vec<usize>,
    pub exec: Exec,
    /// For a bias gradient (`sum_rows`) and the weight-gradient GEMM that reads the same
    /// output gradient as its right operand: the other one's step index
    /// (the launch plan's). The GEMM may then compute both in one cuBLASLt call.
    pub bias_grad: Option<usize>,
}

/// How a kernel runs on the GPU (function names are the module's).
pub(crate) enum Exec {
    /// `Library::Gemm`: `out = x·w` through cuBLAS; with a bias pre-loaded by `bias`
    /// (`fill_rows`) and `beta = 1`; relu by `relu` after.
    Gemm {
        bias: Option<String>,
        relu: Option<String>,
    },
    Region {
        f: String,
        expr: Arc<Expr>,
        inner: Vec<bool>,
    },
    Softmax(String),
    ScaleMaskSoftmax(String, MaskKind),
    /// `Library::Attention` forward: the flash kernel (`flash`) when the module has one
    /// for these heads, else batched GEMMs and the generated masked softmax.
    Attention {
        softmax: String,
        mask: MaskKind,
        flash: Option<String>,
        /// The flash kernel writes its result through its strides
        /// (`Library::Attention::strided_results`).
        strided: bool,
    },
    /// Backward: the flash kernels (`flash_q`, then `flash_kv`) when present, else the
    /// batched-GEMM path; `short` (`flash_short`, absent from older artifacts) instead
    /// of the pair when both lengths fit its tile.
    AttentionBwd {
        softmax: String,
        softmax_bwd: String,
        mask: MaskKind,
        flash: Option<(String, String)>,
        short: Option<String>,
        /// As `Attention`'s.
        strided: bool,
    },
    /// `add`: whether `y` is an operand (every form but `plain`); `rms`: RMSNorm's (no
    /// β operand; its backward has no dβ output, which the launch sees).
    AddLayerNorm {
        f: String,
        add: bool,
        rms: bool,
    },
    AddLayerNormBwd {
        main: String,
        finish: String,
        form: LnForm,
    },
    XentLs {
        count: String,
        /// The rows' function: role `main` (loss and gradient) or, where nothing reads
        /// the gradient, role `loss` (`grad` false).
        main: String,
        finish: String,
        pad: i64,
        grad: bool,
    },
    EmbedPe {
        f: String,
        dropout: Option<(f64, u32)>,
    },
    SumRows {
        main: String,
        finish: String,
    },
    Adam(String),
    Reduce {
        f: String,
        axis: usize,
        layout: ReduceLayout,
    },
    CausalMask(String),
    PadMask(String, i64),
    /// `scatter_add` of f32 rows: the ids indexed on the host, then
    /// `kiln_compiler::codegen::cuda::index::scatter_rows`.
    ScatterAdd(String),
    /// `scatter_add_into(base, ids, src)`: the same host-built index, then
    /// `kiln_compiler::codegen::cuda::index::scatter_rows_onto_as` (in place when planned
    /// so).
    ScatterAddInto(String),
    Arange(String, Dim),
    Concat(String, usize),
    /// `Library::Host`: operands copied to the host, the CPU executor's fallback, results
    /// copied back.
    Host(Fallback),
}

impl Exec {
    /// A short name of how the kernel runs (`gemm`, `generated`, `flash` — the flash
    /// attention kernels —, `attention` — batched GEMMs and a softmax —, `host`).
    pub fn how(&self) -> &'static str {
        match self {
            Exec::Gemm { .. } => "gemm",
            Exec::Attention { flash: Some(_), .. } | Exec::AttentionBwd { flash: Some(_), .. } => {
                "flash"
            }
            Exec::Attention { .. } | Exec::AttentionBwd { .. } => "attention",
            Exec::Host(_) => "host",
            _ => "generated",
        }
    }
}

fn mask_of(name: &str) -> Result<MaskKind, String> {
    match name {
        "none" => Ok(MaskKind::None),
        "key" => Ok(MaskKind::Key),
        "causal" => Ok(MaskKind::Causal),
        other => Err(format!("unknown attention mask `{other}`")),
    }
}

/// The steps of `kg` from its launches; `functions` are the module's function names.
/// Also returns the strided-copy function (`None` when no kernel names one).
pub(crate) fn prepare(
    kg: &KernelGraph,
    plan: &LaunchPlan,
    launches: &[KernelLaunch],
    functions: &BTreeSet<String>,
) -> Result<(Vec<Step>, Option<String>), String> {
    let kernels = kg.kernels();
    if launches.len() != kernels.len() || plan.launches.len() != kernels.len() {
        return Err(format!(
            "the CUDA manifest lists {} kernel launches, the kernel graph has {} kernels",
            launches.len(),
            kernels.len()
        ));
    }
    let mut copy = None;
    let mut steps = Vec::with_capacity(kernels.len());
    for ((v, op, inputs), l) in kernels.into_iter().zip(launches) {
        let kind = op.kind();
        if l.kind != kind {
            return Err(format!(
                "kernel %{v}: the manifest launches a `{}`, the kernel graph has a `{kind}`",
                l.kind
            ));
        }
        let role = |r: &str| -> Result<String, String> {
            let name = l
                .functions
                .get(r)
                .ok_or_else(|| format!("kernel %{v} ({kind}) has no `{r}` function"))?;
            if !functions.contains(name) {
                return Err(format!(
                    "kernel %{v} ({kind}): function `{name}` is not in the CUDA module"
                ));
            }
            Ok(name.clone())
        };
        if copy.is_none() && l.functions.contains_key("copy") {
            copy = Some(role("copy")?);
        }
        let f32s = inputs
            .iter()
            .all(|&x| kg.values[x].types[0].dtype == DType::F32);
        let exec = match (&l.library, op) {
            (Some(Library::Host), _) => Exec::Host(fallback::build(kg, (v, op, inputs))?),
            (Some(Library::Gemm { x, w, bias, relu }), _) => {
                if (*x, *w) != (0, 1) || bias.is_some_and(|b| b != 2) {
                    return Err(format!(
                        "kernel %{v} ({kind}): unsupported GEMM operand order x={x} w={w} \
                         bias={bias:?} (the executor expects 0, 1, 2)"
                    ));
                }
                if !f32s {
                    // An integer matmul: cuBLAS sgemm is f32 only.
                    Exec::Host(fallback::build(kg, (v, op, inputs))?)
                } else {
                    Exec::Gemm {
                        bias: if bias.is_some() {
                            Some(role("bias")?)
                        } else {
                            None
                        },
                        relu: if *relu { Some(role("epilogue")?) } else { None },
                    }
                }
            }
            (
                Some(Library::Attention {
                    mask,
                    backward,
                    strided_results,
                }),
                _,
            ) => attention_step(v, mask, *backward, *strided_results, &l.functions, &role)?,
            (None, KernelOp::Region(expr)) => Exec::Region {
                f: role("main")?,
                expr: expr.clone(),
                inner: l
                    .functions
                    .get("inner")
                    .map(|s| s.chars().map(|c| c == '1').collect())
                    .unwrap_or_default(),
            },
            (None, KernelOp::Template { id, attrs }) => {
                template_step(v, *id, attrs, &l.functions, &role)?
            }
            (None, KernelOp::Prim(Op::Reduce { axis, .. })) => {
                let rank = kg.values[inputs[0]].types[0].shape.rank();
                Exec::Reduce {
                    f: role("main")?,
                    axis: *axis,
                    layout: if axis + 1 == rank {
                        ReduceLayout::Rows
                    } else {
                        ReduceLayout::Across
                    },
                }
            }
            (None, KernelOp::Prim(Op::CausalMask { .. })) => Exec::CausalMask(role("main")?),
            (None, KernelOp::Prim(Op::PadMask { pad })) => Exec::PadMask(role("main")?, *pad),
            (None, KernelOp::Prim(Op::Arange { start, .. })) => {
                Exec::Arange(role("main")?, start.clone())
            }
            (None, KernelOp::Prim(Op::Concat { axis })) => Exec::Concat(role("main")?, *axis),
            (None, KernelOp::Prim(Op::ScatterAdd { .. })) => Exec::ScatterAdd(role("main")?),
            (None, KernelOp::Prim(p)) => {
                return Err(format!(
                    "kernel %{v}: the CUDA executor has no launch for primitive `{}` without \
                     a library routine",
                    p.name()
                ))
            }
        };
        steps.push(Step {
            value: v,
            kind,
            inputs: inputs.to_vec(),
            exec,
            bias_grad: None,
        });
    }
    take_bias_grad_pairs(plan, &mut steps)?;
    Ok((steps, copy))
}

/// The step of an attention kernel, from its launch's functions by role.
fn attention_step(
    v: usize,
    mask: &str,
    backward: bool,
    strided: bool,
    functions: &BTreeMap<String, String>,
    role: &dyn Fn(&str) -> Result<String, String>,
) -> Result<Exec, String> {
    let mask = mask_of(mask).map_err(|e| format!("kernel %{v}: {e}"))?;
    let has = |r: &str| functions.contains_key(r);
    Ok(if backward {
        Exec::AttentionBwd {
            softmax: role("softmax")?,
            softmax_bwd: role("softmax_bwd")?,
            mask,
            flash: if has("flash_q") || has("flash_kv") {
                Some((role("flash_q")?, role("flash_kv")?))
            } else {
                None
            },
            short: if has("flash_short") {
                Some(role("flash_short")?)
            } else {
                None
            },
            strided,
        }
    } else {
        Exec::Attention {
            softmax: role("softmax")?,
            mask,
            flash: if has("flash") {
                Some(role("flash")?)
            } else {
                None
            },
            strided,
        }
    })
}

/// The step of a template kernel without a library routine, from its launch's functions
/// by role.
fn template_step(
    v: usize,
    id: u16,
    attrs: &[Attr],
    functions: &BTreeMap<String, String>,
    role: &dyn Fn(&str) -> Result<String, String>,
) -> Result<Exec, String> {
    let def = &registry()[id as usize];
    Ok(match def.kind {
        TemplateKind::Softmax => Exec::Softmax(role("main")?),
        TemplateKind::ScaleMaskSoftmax => {
            Exec::ScaleMaskSoftmax(role("softmax")?, mask_kind(&def.variant))
        }
        TemplateKind::AddLayerNorm => Exec::AddLayerNorm {
            f: role("main")?,
            add: def.layer_norm_adds(),
            rms: def.layer_norm_rms(),
        },
        TemplateKind::AddLayerNormBwd => Exec::AddLayerNormBwd {
            main: role("main")?,
            finish: role("finish")?,
            form: def.layer_norm_form(),
        },
        TemplateKind::XentLs => {
            let grad = !functions.contains_key("loss");
            Exec::XentLs {
                count: role("count")?,
                main: role(if grad { "main" } else { "loss" })?,
                finish: role("finish")?,
                pad: xent_pad(v, attrs)?,
                grad,
            }
        }
        TemplateKind::EmbedPe => Exec::EmbedPe {
            f: role("main")?,
            dropout: embed_pe_dropout(v, attrs)?,
        },
        TemplateKind::SumRows => Exec::SumRows {
            main: role("main")?,
            finish: role("finish")?,
        },
        TemplateKind::AdamUpdate => Exec::Adam(role("main")?),
        TemplateKind::ScatterAddInto => Exec::ScatterAddInto(role("main")?),
        // Their launches are library routines (above).
        TemplateKind::Linear
        | TemplateKind::LinearRelu
        | TemplateKind::Attention
        | TemplateKind::AttentionBwd => {
            return Err(format!(
                "kernel %{v}: the CUDA executor has no launch for template `{}` \
                 without a library routine",
                def.name
            ))
        }
    })
}

/// The launch plan's bias-gradient pairs ([`kiln_compiler::fuse::bias_grad_pairs`]): each
/// a `sum_rows` and a `matmul` GEMM without bias or ReLU, as the plan says.
fn take_bias_grad_pairs(plan: &LaunchPlan, steps: &mut [Step]) -> Result<(), String> {
    let sum_rows = |st: &Step| matches!(st.exec, Exec::SumRows { .. });
    let product = |st: &Step| {
        matches!(
            st.exec,
            Exec::Gemm {
                bias: None,
                relu: None
            }
        ) && st.kind == "matmul"
    };
    for (s, l) in plan.launches.iter().enumerate() {
        let Some(p) = l.bias_grad else { continue };
        let (a, b) = (
            &steps[s],
            steps.get(p).ok_or("a bias-gradient pair out of range")?,
        );
        if !(sum_rows(a) && product(b) || product(a) && sum_rows(b)) {
            return Err(format!(
                "the launch plan pairs kernels %{} ({}) and %{} ({}) as a bias gradient and \
                 its product, which the CUDA program does not run as such",
                a.value, a.kind, b.value, b.kind
            ));
        }
        steps[s].bias_grad = Some(p);
    }
    Ok(())
}
