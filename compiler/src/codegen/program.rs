//! The CPU code of a kernel graph: which CLIF functions exist and which each kernel runs.
//!
//! In: a [`KernelGraph`]. Out: [`CpuCode`] — CLIF functions as text, deduplicated (two
//! kernels with the same body share one function: dims are arguments, so every
//! `add_layer_norm` of a model runs the same code), named `<kind>_<n>` in first-use
//! order, plus for every kernel (by launch index) its functions by role (`main`,
//! `finish`, `epilogue`, …). The text is deterministic: the same kernel graph gives the
//! same bytes.
//!
//! Which kinds get generated code, and the argument layouts, are documented with each
//! emitter ([`super::region`], [`super::rows`], [`super::misc`]); the executor
//! (`kiln_exec::compiled`) launches them. A kernel with no function runs a library
//! path there (GEMM, gathers and scatters, masks).

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use cranelift_codegen::ir::Function;

use crate::codegen::clif::{text, Reduce};
use crate::codegen::rows::MaskKind;
use crate::codegen::{misc, region, rows};
use crate::ir::{DType, Op, ReduceOp};
use crate::optimize::kernels::{Def, KernelGraph, KernelOp};
use crate::optimize::lang::Attr;
use crate::optimize::templates::{registry, LnForm, TemplateKind};
use crate::shape::Shape;

/// Generated CPU code of one kernel graph.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuCode {
    /// Function name → CLIF text, in first-use order.
    pub functions: Vec<(String, String)>,
    /// Per kernel launch index: role → function name.
    pub kernels: Vec<BTreeMap<String, String>>,
}

impl CpuCode {
    /// All functions as one CLIF text (what the JIT compiles).
    pub fn text(&self) -> String {
        let mut s = String::new();
        for (_, t) in &self.functions {
            s.push_str(t);
            if !t.ends_with('\n') {
                s.push('\n');
            }
            s.push('\n');
        }
        s
    }

    /// The text of function `name`.
    pub fn function(&self, name: &str) -> Option<&str> {
        self.functions
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }
}

/// Function names of one program: one per distinct key (a full description of the
/// body), `<kind>_<n>` numbered per kind in first-use order. Shared by the CPU and CUDA
/// emitters so both name their functions alike.
#[derive(Default)]
pub struct Names {
    by_key: HashMap<String, String>,
    per_kind: BTreeMap<String, usize>,
}

impl Names {
    /// The name for `key`, and whether it is new (its function must be built).
    pub fn name(&mut self, kind: &str, key: String) -> (String, bool) {
        if let Some(n) = self.by_key.get(&key) {
            return (n.clone(), false);
        }
        let n = self.per_kind.entry(kind.to_string()).or_insert(0);
        let name = format!("{kind}_{n}");
        *n += 1;
        self.by_key.insert(key, name.clone());
        (name, true)
    }

    /// The name for `key`, and the function `build(name)` makes when the key is new.
    pub fn build<F>(
        &mut self,
        kind: &str,
        key: String,
        build: impl FnOnce(&str) -> Result<F, String>,
    ) -> Result<(String, Option<F>), String> {
        let (name, new) = self.name(kind, key);
        let built = if new { Some(build(&name)?) } else { None };
        Ok((name, built))
    }
}

/// Builds functions on demand, sharing one per distinct key.
pub struct Emitter {
    code: CpuCode,
    names: Names,
}

impl Emitter {
    fn new() -> Emitter {
        Emitter {
            code: CpuCode::default(),
            names: Names::default(),
        }
    }

    /// The function for `key` (a full description of the body), built by `build(name)`
    /// the first time.
    pub fn get(
        &mut self,
        kind: &str,
        key: String,
        build: impl FnOnce(&str) -> Result<Function, String>,
    ) -> Result<String, String> {
        let (name, built) = self.names.build(kind, key, build)?;
        if let Some(f) = built {
            self.code.functions.push((name.clone(), text(&f)));
        }
        Ok(name)
    }
}

/// The CPU code of `kg`.
pub fn emit(kg: &KernelGraph) -> Result<CpuCode, String> {
    let mut em = Emitter::new();
    let kernels = kg.kernels();
    let mut roles = Vec::with_capacity(kernels.len());
    for (v, op, inputs) in kernels {
        let r = kernel_functions(&mut em, kg, v, op, inputs)
            .map_err(|e| format!("kernel %{v} ({}): {e}", op.kind()))?;
        roles.push(r);
    }
    em.code.kernels = roles;
    Ok(em.code)
}

/// The mask variant of an attention-family template.
pub fn mask_kind(variant: &str) -> MaskKind {
    if variant.contains("mask=key") {
        MaskKind::Key
    } else if variant.contains("mask=causal") {
        MaskKind::Causal
    } else {
        MaskKind::None
    }
}

/// The emitter's key of a layer-norm function: the adding form keeps its old key, so
/// its programs' text does not change.
fn ln_key(base: &str, form: LnForm, rms: bool) -> String {
    let mut key = match form {
        LnForm::Add => base.to_string(),
        LnForm::Plain => format!("{base} plain"),
        LnForm::Carry => format!("{base} carry"),
    };
    if rms {
        key.push_str(" rms");
    }
    key
}

/// The functions of one kernel, by role.
fn kernel_functions(
    em: &mut Emitter,
    kg: &KernelGraph,
    v: usize,
    op: &KernelOp,
    inputs: &[usize],
) -> Result<BTreeMap<String, String>, String> {
    let mut r = BTreeMap::new();
    let mut put = |role: &str, name: String| {
        r.insert(role.to_string(), name);
    };
    match op {
        KernelOp::Region(expr) => {
            let (inner, dtypes) = region_inputs(kg, v, inputs);
            let key = format!(
                "region {} inner={inner:?} in={dtypes:?} out={}",
                expr.text(),
                expr.out
            );
            put(
                "main",
                em.get("region", key, |n| {
                    region::region_typed(n, expr, &inner, &dtypes)
                })?,
            );
            put("inner", inner_flags(&inner));
        }
        KernelOp::Template { id, attrs } => {
            template_functions(em, kg, v, *id, attrs, inputs, &mut put)?;
        }
        KernelOp::Prim(Op::Reduce { op, axis })
            if kg.values[inputs[0]].types[0].dtype == DType::F32 =>
        {
            let rank = kg.values[inputs[0]].types[0].shape.rank();
            let layout = if *axis + 1 == rank {
                misc::ReduceLayout::Rows
            } else {
                misc::ReduceLayout::Across
            };
            let rop = match op {
                ReduceOp::Sum => Reduce::Sum,
                ReduceOp::Max => Reduce::Max,
            };
            put(
                "main",
                em.get("reduce", format!("reduce {rop:?} {layout:?}"), |n| {
                    Ok(misc::reduce(n, rop, layout))
                })?,
            );
        }
        KernelOp::Prim(_) => {}
    }
    // Any operand a kernel needs contiguous may arrive as a strided view: one copy
    // kernel serves them all.
    r.insert(
        "copy".to_string(),
        em.get("copy_strided", "copy_strided gather".into(), |n| {
            Ok(misc::copy_strided(n, false))
        })?,
    );
    Ok(r)
}

/// The functions of a template kernel, by role (each given to `put`).
fn template_functions(
    em: &mut Emitter,
    kg: &KernelGraph,
    v: usize,
    id: u16,
    attrs: &[Attr],
    inputs: &[usize],
    put: &mut dyn FnMut(&str, String),
) -> Result<(), String> {
    let def = &registry()[id as usize];
    match def.kind {
        TemplateKind::Linear => put(
            "bias",
            em.get("fill_rows", "fill_rows".into(), |n| Ok(misc::fill_rows(n)))?,
        ),
        TemplateKind::LinearRelu => {
            put(
                "bias",
                em.get("fill_rows", "fill_rows".into(), |n| Ok(misc::fill_rows(n)))?,
            );
            put(
                "epilogue",
                em.get("relu", "relu".into(), |n| Ok(misc::relu(n)))?,
            );
        }
        TemplateKind::Softmax => put(
            "main",
            em.get("softmax", "softmax".into(), |n| Ok(rows::softmax(n)))?,
        ),
        TemplateKind::ScaleMaskSoftmax | TemplateKind::Attention | TemplateKind::AttentionBwd => {
            let m = mask_kind(&def.variant);
            put(
                "softmax",
                em.get(
                    "scale_mask_softmax",
                    format!("scale_mask_softmax {m:?}"),
                    |n| Ok(rows::scale_mask_softmax(n, m)),
                )?,
            );
            if def.kind == TemplateKind::AttentionBwd {
                put(
                    "softmax_bwd",
                    em.get("softmax_bwd", "softmax_bwd".into(), |n| {
                        Ok(rows::softmax_bwd(n))
                    })?,
                );
            }
        }
        TemplateKind::AddLayerNorm => {
            let (form, rms) = (def.layer_norm_form(), def.layer_norm_rms());
            put(
                "main",
                em.get("add_layer_norm", ln_key("add_layer_norm", form, rms), |n| {
                    Ok(rows::add_layer_norm(n, form == LnForm::Add, rms))
                })?,
            )
        }
        TemplateKind::AddLayerNormBwd => {
            let (form, rms) = (def.layer_norm_form(), def.layer_norm_rms());
            put(
                "main",
                em.get(
                    "add_layer_norm_bwd",
                    ln_key("add_layer_norm_bwd", form, rms),
                    |n| Ok(rows::add_layer_norm_bwd(n, form, rms)),
                )?,
            );
            put(
                "finish",
                em.get(
                    "add_layer_norm_bwd_finish",
                    "add_layer_norm_bwd_finish".into(),
                    |n| Ok(rows::add_layer_norm_bwd_finish(n)),
                )?,
            );
        }
        // Where nothing reads the gradient (the `loss` entry), the kernel computes
        // only the loss: role `loss` instead of `main`.
        TemplateKind::XentLs if !kg.output_is_read(v, 1) => put(
            "loss",
            em.get("xent_ls_loss", "xent_ls_loss".into(), |n| {
                Ok(rows::xent_ls_loss(n))
            })?,
        ),
        TemplateKind::XentLs => put(
            "main",
            em.get("xent_ls", "xent_ls".into(), |n| Ok(rows::xent_ls(n)))?,
        ),
        TemplateKind::EmbedPe => {
            let dropout = !attrs.is_empty();
            put(
                "main",
                em.get("embed_pe", format!("embed_pe dropout={dropout}"), |n| {
                    Ok(region::embed_pe(n, dropout))
                })?,
            );
        }
        TemplateKind::SumRows => {
            let lead = kg.values[inputs[0]].types[0].shape.rank() - 1;
            put(
                "main",
                em.get("sum_rows", format!("sum_rows lead={lead}"), |n| {
                    Ok(misc::sum_rows(n, lead))
                })?,
            );
        }
        TemplateKind::AdamUpdate => put(
            "main",
            em.get("adam_update", "adam_update".into(), |n| {
                Ok(misc::adam_update(n))
            })?,
        ),
        // Runs in Rust (the runtime's fallback): it touches only the rows the
        // ids name.
        TemplateKind::ScatterAddInto => {}
    }
    Ok(())
}

/// What a region kernel of value `v` is built for: per input, whether its innermost
/// stride is nonzero ([`static_inner`]) and its element type.
pub fn region_inputs(kg: &KernelGraph, v: usize, inputs: &[usize]) -> (Vec<bool>, Vec<DType>) {
    let out = &kg.values[v].types[0].shape;
    let inner = inputs.iter().map(|&x| static_inner(kg, x, out)).collect();
    let dtypes = inputs
        .iter()
        .map(|&x| kg.values[x].types[0].dtype)
        .collect();
    (inner, dtypes)
}

/// The `inner` role of a region kernel: the inner-stride flags its function was built
/// for (`1`: unit, `0`: broadcast), one per input.
pub fn inner_flags(inner: &[bool]) -> String {
    inner.iter().map(|&b| if b { '1' } else { '0' }).collect()
}

/// With every symbolic dim at 7: the element strides of value `v` seen through its view
/// chain, broadcast to `out`; whether the innermost one is nonzero (1, or a layout the
/// executor copies to contiguous first).
pub fn static_inner(kg: &KernelGraph, v: usize, out: &Shape) -> bool {
    let (shape, strides) = static_layout(kg, v);
    let out_rank = out.rank();
    if out_rank == 0 || shape.is_empty() {
        return false;
    }
    // Right-aligned broadcast: the input's last axis meets the output's last axis.
    let last = shape.len() - 1;
    !(shape[last] == 1 || strides[last] == 0)
}

fn static_layout(kg: &KernelGraph, v: usize) -> (Vec<i64>, Vec<i64>) {
    let seven = |s: &Shape| -> Vec<i64> {
        s.dims()
            .iter()
            .map(|d| {
                let b: std::collections::BTreeMap<String, i64> =
                    d.symbols().iter().map(|x| (x.to_string(), 7)).collect();
                d.eval(&b).unwrap_or(7)
            })
            .collect()
    };
    let contiguous = |shape: Vec<i64>| {
        let mut st = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            st[i] = st[i + 1] * shape[i + 1];
        }
        (shape, st)
    };
    let val = &kg.values[v];
    match &val.def {
        Def::View(op, x) => {
            let (sh, st) = static_layout(kg, *x);
            let shape = seven(&val.types[0].shape);
            match op {
                Op::Permute { perm } => (
                    perm.iter().map(|&p| sh[p]).collect(),
                    perm.iter().map(|&p| st[p]).collect(),
                ),
                Op::Broadcast { .. } => {
                    let off = shape.len() - sh.len();
                    let strides = (0..shape.len())
                        .map(|i| {
                            if i < off || sh[i - off] == 1 {
                                0
                            } else {
                                st[i - off]
                            }
                        })
                        .collect();
                    (shape, strides)
                }
                // A reshape keeps a contiguous layout contiguous; the executor copies
                // any other first.
                _ => contiguous(shape),
            }
        }
        _ => contiguous(seven(&val.types[0].shape)),
    }
}
