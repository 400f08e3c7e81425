//! The CUDA code of a kernel graph: which functions exist and what each kernel launches.
//!
//! In: a [`KernelGraph`]. Out: [`CudaCode`] — generated functions, deduplicated by body
//! and named `<kind>_<n>` in first-use order (the CPU backend's names,
//! [`crate::codegen::program`]), and per kernel (by launch index) its functions by role
//! and the library routine it stands for. The roles are the CPU backend's (`main`,
//! `bias`, `epilogue`, `softmax`, `softmax_bwd`, `finish`, `copy`), plus `count` for
//! `xent_ls` (see [`super::rows`]), `flash`, `flash_q`, `flash_kv`, `flash_short` for attention (see
//! [`super::attention`]) and, in a mixed-precision program ([`emit_with`]), `copy16`
//! (strided views of bf16 buffers). The text is deterministic: the same kernel graph
//! gives the same bytes.

use std::collections::BTreeMap;

use crate::codegen::clif::Reduce;
use crate::codegen::cuda::text::{prelude, Elem};
use crate::codegen::cuda::{
    attention, index, misc, region, rows, storage, tensor, CudaCode, CudaFunction, KernelLaunch,
    Library,
};
use crate::codegen::misc::ReduceLayout;
use crate::codegen::program::{inner_flags, mask_kind, region_inputs, Names};
use crate::codegen::rows::MaskKind;
use crate::ir::{Op, ReduceOp};
use crate::optimize::kernels::{KernelGraph, KernelOp};
use crate::optimize::lang::Attr;
use crate::optimize::templates::{registry, LnForm, TemplateKind};

/// Builds functions on demand, one per distinct key (named as the CPU emitter names).
struct Emitter {
    functions: Vec<CudaFunction>,
    names: Names,
    /// A bf16 program's attention on tensor cores where the heads allow.
    tensor_cores: bool,
}

impl Emitter {
    fn get(
        &mut self,
        kind: &str,
        key: String,
        build: impl FnOnce(&str) -> Result<CudaFunction, String>,
    ) -> Result<String, String> {
        let (name, built) = self.names.build(kind, key, build)?;
        self.functions.extend(built);
        Ok(name)
    }

    /// A function whose body depends on nothing but its kind.
    fn plain(&mut self, kind: &str, build: impl FnOnce(&str) -> CudaFunction) -> String {
        self.get(kind, kind.to_string(), |n| Ok(build(n)))
            .expect("infallible builder")
    }
}

/// The CUDA code of `kg`, float buffers as `f32`.
pub fn emit(kg: &KernelGraph) -> Result<CudaCode, String> {
    emit_with(kg, Elem::F32)
}

/// The CUDA code of `kg` with float activations stored as `elem`.
///
/// `Elem::F32` is [`emit`]. `Elem::Bf16` makes a mixed-precision program: the buffers
/// [`storage::plan`] chooses are bf16 (activations: what scales with the batch and
/// depends on its data), parameters, gradients Adam reads, moments, scalars and the loss stay
/// `float`; [`CudaCode::storage`] lists each buffer's type, and every generated
/// function reads and writes its buffers in theirs (arithmetic in `float`). The GEMMs
/// are the executor's: operands and results as stored, fp32 accumulation. A program
/// where one buffer would need two types is an error naming both kernels.
pub fn emit_with(kg: &KernelGraph, elem: Elem) -> Result<CudaCode, String> {
    emit_attention_on(kg, elem, true)
}

/// [`emit_with`], with a bf16 program's attention on tensor cores ([`tensor`]) where its
/// heads allow (`tensor_cores`, the default) or on the CUDA cores ([`attention`]) as an
/// f32 program's: for comparisons.
pub fn emit_attention_on(
    kg: &KernelGraph,
    elem: Elem,
    tensor_cores: bool,
) -> Result<CudaCode, String> {
    let plan = storage::plan(kg, elem)?;
    let mut em = Emitter {
        functions: Vec::new(),
        names: Names::default(),
        tensor_cores,
    };
    let mut kernels = Vec::new();
    let at = Stored { kg, plan: &plan };
    for (v, op, inputs) in kg.kernels() {
        let k = launch(&mut em, &at, v, op, inputs, elem)
            .map_err(|e| format!("kernel %{v} ({}): {e}", op.kind()))?;
        kernels.push(k);
    }
    Ok(CudaCode {
        prelude: prelude(),
        functions: em.functions,
        kernels,
        storage: if elem == Elem::F32 { Vec::new() } else { plan },
    })
}

/// The element types of a program's buffers.
struct Stored<'a> {
    kg: &'a KernelGraph,
    plan: &'a storage::Storage,
}

impl Stored<'_> {
    /// The element type of value `v`.
    fn of(&self, v: usize) -> Elem {
        storage::of(self.plan, self.kg, v)
    }
}

/// The last dim of value `x` where it is a constant (a layer norm's `d_model`).
fn static_last(kg: &KernelGraph, x: usize) -> Option<usize> {
    let t = kg.values.get(x)?.types.first()?;
    usize::try_from(t.shape.dims().last()?.as_const()?).ok()
}

/// The head sizes `(dk, dv)` of an attention kernel (inputs `q, k, v, …`) when they are
/// constants the flash kernels take.
fn flash_heads(kg: &KernelGraph, inputs: &[usize]) -> Option<(usize, usize)> {
    let last = |x: usize| {
        let dims = kg.values[*inputs.get(x)?].types[0].shape.dims().to_vec();
        usize::try_from(dims.last()?.as_const()?).ok()
    };
    let (dk, dv) = (last(0)?, last(2)?);
    [
        attention::Part::Forward,
        attention::Part::BackwardQ,
        attention::Part::BackwardKv,
    ]
    .iter()
    .all(|&p| attention::tile(p, dk, dv).is_some())
    .then_some((dk, dv))
}

/// The functions of a template kernel, by role, into `f`; the library routine it
/// launches, if any.
#[allow(clippy::too_many_arguments)]
fn template_launch(
    em: &mut Emitter,
    at: &Stored<'_>,
    v: usize,
    id: u16,
    attrs: &[Attr],
    inputs: &[usize],
    e: Elem,
    f: &mut BTreeMap<String, String>,
) -> Result<Option<Library>, String> {
    let kg = at.kg;
    let mut library = None;
    let def = &registry()[id as usize];
    match def.kind {
        TemplateKind::Linear | TemplateKind::LinearRelu => {
            let relu = def.kind == TemplateKind::LinearRelu;
            f.insert(
                "bias".into(),
                em.plain("fill_rows", |n| misc::fill_rows(n, e)),
            );
            if relu {
                f.insert("epilogue".into(), em.plain("relu", |n| misc::relu(n, e)));
            }
            library = Some(Library::Gemm {
                x: 0,
                w: 1,
                bias: Some(2),
                relu,
            });
        }
        TemplateKind::Softmax => {
            f.insert("main".into(), em.plain("softmax", |n| rows::softmax(n, e)));
        }
        TemplateKind::ScaleMaskSoftmax | TemplateKind::Attention | TemplateKind::AttentionBwd => {
            library = attention_launch(em, kg, def.kind, &def.variant, inputs, e, f)?;
        }
        TemplateKind::AddLayerNorm => {
            let lane = rows::row_lane(static_last(kg, inputs[0]));
            let (add, rms) = (def.layer_norm_adds(), def.layer_norm_rms());
            let plain = if add { "" } else { " plain" };
            let rms_key = if rms { " rms" } else { "" };
            let name = em.get(
                "add_layer_norm",
                format!("add_layer_norm lane={lane}{plain}{rms_key}"),
                |n| Ok(rows::add_layer_norm_with(n, e, lane, add, rms)),
            )?;
            f.insert("main".into(), name);
        }
        TemplateKind::AddLayerNormBwd => {
            let lane = rows::bwd_row_lane(static_last(kg, inputs[0]));
            let (form, rms) = (def.layer_norm_form(), def.layer_norm_rms());
            let mut key = match form {
                LnForm::Add => format!("add_layer_norm_bwd lane={lane}"),
                LnForm::Plain => format!("add_layer_norm_bwd lane={lane} plain"),
                LnForm::Carry => format!("add_layer_norm_bwd lane={lane} carry"),
            };
            if rms {
                key.push_str(" rms");
            }
            let name = em.get("add_layer_norm_bwd", key, |n| {
                Ok(rows::add_layer_norm_bwd_with(n, e, lane, form, rms))
            })?;
            f.insert("main".into(), name);
            f.insert(
                "finish".into(),
                em.plain("add_layer_norm_bwd_finish", rows::add_layer_norm_bwd_finish),
            );
        }
        TemplateKind::XentLs => {
            let count = if def.variant.split_whitespace().any(|w| w == "seeded") {
                em.plain("xent_ls_count_seeded", rows::xent_ls_count_seeded)
            } else {
                em.plain("xent_ls_count", rows::xent_ls_count)
            };
            f.insert("count".into(), count);
            // Where nothing reads the gradient (the `loss` entry), the kernel
            // computes only the loss: role `loss` instead of `main`.
            if kg.output_is_read(v, 1) {
                let keep = rows::xent_keep(static_last(kg, inputs[0]), e);
                let name = em.get("xent_ls", format!("xent_ls keep={keep}"), |n| {
                    Ok(rows::xent_ls_with(n, e, keep))
                })?;
                f.insert("main".into(), name);
            } else {
                f.insert(
                    "loss".into(),
                    em.plain("xent_ls_loss", |n| rows::xent_ls_loss(n, e)),
                );
            }
            f.insert(
                "finish".into(),
                em.plain("xent_ls_finish", rows::xent_ls_finish),
            );
        }
        TemplateKind::EmbedPe => {
            let dropout = !attrs.is_empty();
            let (pe, out) = (at.of(inputs[2]), at.of(v));
            let key = format!("embed_pe dropout={dropout} pe={pe:?} out={out:?}");
            let name = em.get("embed_pe", key, |n| {
                Ok(region::embed_pe_as(n, dropout, pe, out))
            })?;
            f.insert("main".into(), name);
        }
        TemplateKind::SumRows => {
            let lead = kg.values[inputs[0]].types[0].shape.rank() - 1;
            let (x, y) = (at.of(inputs[0]), at.of(v));
            let name = em.get("sum_rows", format!("sum_rows lead={lead} x={x:?}"), |n| {
                misc::sum_rows_as(n, lead, x)
            })?;
            f.insert("main".into(), name);
            let name = em.get(
                "sum_rows_finish",
                format!("sum_rows_finish lead={lead} y={y:?}"),
                |n| misc::sum_rows_finish_as(n, lead, y),
            )?;
            f.insert("finish".into(), name);
        }
        TemplateKind::AdamUpdate => {
            f.insert(
                "main".into(),
                // f32 master weights, moments and gradients in every mode.
                em.plain("adam_update", |n| misc::adam_update(n, Elem::F32)),
            );
        }
        TemplateKind::ScatterAddInto => {
            let (base, src, out) = (at.of(inputs[0]), at.of(inputs[2]), at.of(v));
            let key = format!("scatter_rows_onto base={base:?} src={src:?} out={out:?}");
            let name = em.get("scatter_rows_onto", key, |n| {
                Ok(index::scatter_rows_onto_as(n, base, src, out))
            })?;
            f.insert("main".into(), name);
        }
    }
    Ok(library)
}

/// The functions of a softmax or attention kernel, by role, into `f` (the flash
/// kernels where the heads fit); the attention routine it launches, if any.
fn attention_launch(
    em: &mut Emitter,
    kg: &KernelGraph,
    kind: TemplateKind,
    variant: &str,
    inputs: &[usize],
    e: Elem,
    f: &mut BTreeMap<String, String>,
) -> Result<Option<Library>, String> {
    let mut library = None;
    let m = mask_kind(variant);
    let name = em.get(
        "scale_mask_softmax",
        format!("scale_mask_softmax {m:?}"),
        |n| Ok(rows::scale_mask_softmax(n, m, e)),
    )?;
    f.insert("softmax".into(), name);
    if kind == TemplateKind::AttentionBwd {
        f.insert(
            "softmax_bwd".into(),
            em.plain("softmax_bwd", |n| rows::softmax_bwd(n, e)),
        );
    }
    if kind != TemplateKind::ScaleMaskSoftmax {
        if let Some((dk, dv)) = flash_heads(kg, inputs) {
            // Keys name the function kind: one key space for all.
            let key = |name: &str| format!("{name} {m:?} dk={dk} dv={dv}");
            // A bf16 program's heads of multiples of 16 run on tensor
            // cores (same ABI, tiles and work items).
            let on = em.tensor_cores;
            let tc = |p| on && e == Elem::Bf16 && tensor::fits(p, dk, dv);
            if kind == TemplateKind::Attention {
                let n = if tc(attention::Part::Forward) {
                    em.get("attention_tc", key("attention_tc"), |n| {
                        Ok(tensor::forward(n, m, dk, dv))
                    })?
                } else {
                    em.get("attention", key("attention"), |n| {
                        Ok(attention::forward(n, m, dk, dv, e))
                    })?
                };
                f.insert("flash".into(), n);
            } else {
                let (nq, nkv) = if tc(attention::Part::BackwardQ) && tc(attention::Part::BackwardKv)
                {
                    (
                        em.get("attention_bwd_q_tc", key("attention_bwd_q_tc"), |n| {
                            Ok(tensor::backward_q(n, m, dk, dv))
                        })?,
                        em.get("attention_bwd_kv_tc", key("attention_bwd_kv_tc"), |n| {
                            Ok(tensor::backward_kv(n, m, dk, dv))
                        })?,
                    )
                } else {
                    (
                        em.get("attention_bwd_q", key("attention_bwd_q"), |n| {
                            Ok(attention::backward_q(n, m, dk, dv, e))
                        })?,
                        em.get("attention_bwd_kv", key("attention_bwd_kv"), |n| {
                            Ok(attention::backward_kv(n, m, dk, dv, e))
                        })?,
                    )
                };
                f.insert("flash_q".into(), nq);
                f.insert("flash_kv".into(), nkv);
                if tc(attention::Part::Short) {
                    let n = em.get(
                        "attention_bwd_short_tc",
                        key("attention_bwd_short_tc"),
                        |n| Ok(tensor::backward_short(n, m, dk, dv)),
                    )?;
                    f.insert("flash_short".into(), n);
                } else if attention::tile(attention::Part::Short, dk, dv).is_some() {
                    let n = em.get("attention_bwd_short", key("attention_bwd_short"), |n| {
                        Ok(attention::backward_short(n, m, dk, dv, e))
                    })?;
                    f.insert("flash_short".into(), n);
                }
            }
        }
        library = Some(Library::Attention {
            mask: mask_name(m).to_string(),
            backward: kind == TemplateKind::AttentionBwd,
            strided_results: true,
        });
    }
    Ok(library)
}

fn mask_name(m: MaskKind) -> &'static str {
    match m {
        MaskKind::None => "none",
        MaskKind::Key => "key",
        MaskKind::Causal => "causal",
    }
}

/// What one kernel launches.
fn launch(
    em: &mut Emitter,
    at: &Stored<'_>,
    v: usize,
    op: &KernelOp,
    inputs: &[usize],
    e: Elem,
) -> Result<KernelLaunch, String> {
    let kg = at.kg;
    let mut f = BTreeMap::new();
    let mut library = None;
    match op {
        KernelOp::Region(expr) => {
            let (inner, dtypes) = region_inputs(kg, v, inputs);
            let elems: Vec<Elem> = inputs.iter().map(|&x| at.of(x)).collect();
            let out_elem = at.of(v);
            let key = format!(
                "region {} inner={inner:?} in={dtypes:?} out={} stored={elems:?}->{out_elem:?}",
                expr.text(),
                expr.out
            );
            let name = em.get("region", key, |n| {
                region::region_as(n, expr, &inner, &dtypes, &elems, out_elem)
            })?;
            f.insert("main".to_string(), name);
            f.insert("inner".to_string(), inner_flags(&inner));
        }
        KernelOp::Template { id, attrs } => {
            library = template_launch(em, at, v, *id, attrs, inputs, e, &mut f)?;
        }
        KernelOp::Prim(p) if !storage::on_device(kg, p, inputs) => library = Some(Library::Host),
        KernelOp::Prim(Op::Reduce { op, axis }) => {
            let rank = kg.values[inputs[0]].types[0].shape.rank();
            let layout = if *axis + 1 == rank {
                ReduceLayout::Rows
            } else {
                ReduceLayout::Across
            };
            let rop = match op {
                ReduceOp::Sum => Reduce::Sum,
                ReduceOp::Max => Reduce::Max,
            };
            let (x, y) = (at.of(inputs[0]), at.of(v));
            let key = format!("reduce {rop:?} {layout:?} x={x:?} y={y:?}");
            let name = em.get("reduce", key, |n| Ok(misc::reduce_as(n, rop, layout, x, y)))?;
            f.insert("main".into(), name);
        }
        KernelOp::Prim(Op::MatMul) => {
            library = Some(Library::Gemm {
                x: 0,
                w: 1,
                bias: None,
                relu: false,
            });
        }
        KernelOp::Prim(Op::CausalMask { .. }) => {
            f.insert("main".into(), em.plain("causal_mask", index::causal_mask));
        }
        KernelOp::Prim(Op::PadMask { .. }) => {
            f.insert("main".into(), em.plain("pad_mask", index::pad_mask));
        }
        KernelOp::Prim(Op::Arange { .. }) => {
            f.insert("main".into(), em.plain("arange", index::arange));
        }
        KernelOp::Prim(Op::Concat { .. }) => {
            let ins: Vec<Elem> = inputs.iter().map(|&x| at.of(x)).collect();
            let out = at.of(v);
            let name = em.get("concat", format!("concat {ins:?} -> {out:?}"), |name| {
                index::concat_as(name, &ins, out)
            })?;
            f.insert("main".into(), name);
        }
        KernelOp::Prim(Op::ScatterAdd { .. }) => {
            let (src, out) = (at.of(inputs[1]), at.of(v));
            let key = format!("scatter_rows src={src:?} out={out:?}");
            let name = em.get("scatter_rows", key, |n| {
                Ok(index::scatter_rows_as(n, src, out))
            })?;
            f.insert("main".into(), name);
        }
        KernelOp::Prim(other) => {
            return Err(format!("internal: no CUDA code for `{}`", other.name()));
        }
    }
    // Any operand a kernel needs contiguous may arrive as a strided view.
    f.insert("copy".into(), em.plain("copy_strided", misc::copy_strided));
    if e != Elem::F32 {
        // … of 2-byte elements too, in a program with bf16 buffers.
        let kind = "copy_strided16";
        f.insert(
            "copy16".into(),
            em.plain(kind, |n| misc::copy_strided_as(n, e)),
        );
    }
    Ok(KernelLaunch {
        kind: op.kind(),
        functions: f,
        library,
    })
}
