//! Weights in PyTorch `nn.Transformer` naming, both ways.
//!
//! In: the parameters of a kiln encoder-decoder transformer (the names of
//! `models/transformer_base.kiln`), or a PyTorch state dict in `nn.Transformer` naming.
//! Out: the same numbers under the other naming ([`to_torch`], [`from_torch`]); the round
//! trip is bit-exact, since values are only moved and transposed, never computed.
//!
//! | kiln | PyTorch |
//! |---|---|
//! | `emb.weight` `[V, d]` | `embedding.weight` `[V, d]` (an `nn.Embedding` beside the `nn.Transformer`) |
//! | `….self_attn.w_q`, `w_k`, `w_v` `[d, d]` | `….self_attn.in_proj_weight` `[3d, d]` = w_qᵀ; w_kᵀ; w_vᵀ |
//! | `….self_attn.b_q`, `b_k`, `b_v` `[d]` | `….self_attn.in_proj_bias` `[3d]` = b_q ‖ b_k ‖ b_v |
//! | `….self_attn.w_o`, `b_o` | `….self_attn.out_proj.weight` = w_oᵀ, `….out_proj.bias` |
//! | decoder `….cross_attn.*` | decoder `….multihead_attn.*` (same layout) |
//! | `….ffn.linear1.w` `[d, f]`, `.b` | `….linear1.weight` `[f, d]` = wᵀ, `….linear1.bias` |
//! | `….ffn.linear2.w` `[f, d]`, `.b` | `….linear2.weight` `[d, f]` = wᵀ, `….linear2.bias` |
//! | `….norm{1,2,3}.gamma`, `.beta` | `….norm{1,2,3}.weight`, `.bias` |
//!
//! (`…` is `encoder.layers.{i}` or `decoder.layers.{i}`.) PyTorch's `Linear` stores
//! `[out, in]` and computes `x Wᵀ`; kiln stores `[in, out]` and computes `x W`: hence the
//! transposes.
//!
//! What the PyTorch side must match, since the keys do not say it: `nhead` = the spec's
//! `h`, `norm_first=False` (kiln is post-LN), `activation="relu"`, `layer_norm_eps=1e-5`.
//! kiln has no final encoder/decoder LayerNorm, which `nn.Transformer` adds by default
//! (`encoder.norm.*`, `decoder.norm.*`): build the PyTorch model with
//! `custom_encoder=nn.TransformerEncoder(layer, n, norm=None)` (and the decoder alike), or
//! set `model.encoder.norm = nn.Identity()` before `load_state_dict`. The embedding's
//! `sqrt(d)` scale, the sinusoidal positions and the tied output projection live outside
//! `nn.Transformer` and must be written there by hand; `examples/pytorch_interop.py` is
//! that model written out (`tests/pytorch_interop.rs` compares its logits, loss and
//! gradients with kiln's).
//!
//! Not expressible, and refused with the reason: attention with `h·d_k ≠ d_model` or
//! `h·d_v ≠ d_model` (`in_proj_weight` is square per block), layers with different
//! feed-forward sizes, and learned positional tables (`src_pos.table`, `tgt_pos.table`:
//! `nn.Transformer` has no positions at all).

use std::collections::{BTreeMap, BTreeSet};

use kiln_compiler::tensor::{Tensor, TensorData};

/// Why weights could not be renamed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum InteropError {
    #[error("{}", names_message(.direction, .unknown, .missing))]
    Names {
        /// "kiln" or "PyTorch": the naming of the input.
        direction: &'static str,
        unknown: Vec<String>,
        missing: Vec<String>,
    },
    #[error(
        "the weights have learned positional tables ({}), which nn.Transformer cannot hold: \
         it has no positional encoding; train with sinusoidal positions (`learned_pos = \
         false`), or export the table separately and add it to the inputs by hand",
        .names.join(", ")
    )]
    LearnedPositions { names: Vec<String> },
    #[error("tensor `{name}` has shape {shape:?}, but {expected}")]
    Shape {
        name: String,
        shape: Vec<usize>,
        expected: String,
    },
    #[error("`{name}` cannot be expressed in nn.Transformer: {why}")]
    Unexpressible { name: String, why: String },
    #[error(
        "tensors `{a}` ({a_dtype}) and `{b}` ({b_dtype}) must share a dtype to be packed together"
    )]
    DType {
        a: String,
        a_dtype: &'static str,
        b: String,
        b_dtype: &'static str,
    },
}

fn names_message(direction: &str, unknown: &[String], missing: &[String]) -> String {
    let show = |v: &[String]| {
        let mut s: Vec<String> = v.iter().take(12).map(|n| format!("`{n}`")).collect();
        if v.len() > 12 {
            s.push(format!("and {} more", v.len() - 12));
        }
        s.join(", ")
    };
    let mut parts = Vec::new();
    if !unknown.is_empty() {
        parts.push(format!(
            "{} name(s) that are not {direction} transformer parameters: {}",
            unknown.len(),
            show(unknown)
        ));
    }
    if !missing.is_empty() {
        parts.push(format!(
            "{} missing parameter(s): {}",
            missing.len(),
            show(missing)
        ));
    }
    let mut msg = format!(
        "the weights do not have the layout of a {direction} encoder-decoder transformer: {}",
        parts.join("; ")
    );
    if unknown
        .iter()
        .any(|n| n.starts_with("encoder.norm.") || n.starts_with("decoder.norm."))
    {
        msg.push_str(
            "; `encoder.norm`/`decoder.norm` are nn.Transformer's final LayerNorms, which \
             kiln's post-LN model does not have: export from a model built with \
             `custom_encoder=nn.TransformerEncoder(layer, n, norm=None)` (and the decoder \
             alike)",
        );
    }
    if unknown
        .iter()
        .any(|n| n.contains("q_proj_weight") || n.contains("bias_k") || n.contains("bias_v"))
    {
        msg.push_str(
            "; separate q/k/v projections (kdim/vdim ≠ d_model) and add_bias_kv are not \
             supported",
        );
    }
    msg
}

/// The two stacks and what each layer holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Encoder,
    Decoder,
}

impl Side {
    fn prefix(self) -> &'static str {
        match self {
            Side::Encoder => "encoder.layers.",
            Side::Decoder => "decoder.layers.",
        }
    }

    /// (kiln block, PyTorch block) of each attention.
    fn attentions(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Side::Encoder => &[("self_attn", "self_attn")],
            Side::Decoder => &[("self_attn", "self_attn"), ("cross_attn", "multihead_attn")],
        }
    }

    fn norms(self) -> &'static [&'static str] {
        match self {
            Side::Encoder => &["norm1", "norm2"],
            Side::Decoder => &["norm1", "norm2", "norm3"],
        }
    }
}

const SIDES: [Side; 2] = [Side::Encoder, Side::Decoder];

/// How one tensor maps: copied or transposed, or one third of a packed projection.
enum Rule {
    Copy { kiln: String, torch: String },
    Transpose { kiln: String, torch: String },
}

/// The layer count of a stack: one more than the highest `{prefix}{i}.` index among
/// `names` (at least 1, so that an absent stack shows up as missing names).
fn layer_count<'a>(names: impl Iterator<Item = &'a String>, prefix: &str) -> usize {
    names
        .filter_map(|n| n.strip_prefix(prefix))
        .filter_map(|rest| rest.split('.').next())
        .filter(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
        .filter(|i| i.len() == 1 || !i.starts_with('0'))
        .filter_map(|i| i.parse::<usize>().ok())
        .map(|i| i + 1)
        .max()
        .unwrap_or(1)
}

/// Every tensor of the kiln layout, with its PyTorch counterpart, except the packed
/// q/k/v projections, which [`packed`] lists.
fn rules(n: [usize; 2]) -> Vec<Rule> {
    let mut out = vec![Rule::Copy {
        kiln: "emb.weight".to_string(),
        torch: "embedding.weight".to_string(),
    }];
    for (side, &layers) in SIDES.iter().zip(&n) {
        for i in 0..layers {
            let at = format!("{}{i}.", side.prefix());
            for &(k, t) in side.attentions() {
                out.push(Rule::Transpose {
                    kiln: format!("{at}{k}.w_o"),
                    torch: format!("{at}{t}.out_proj.weight"),
                });
                out.push(Rule::Copy {
                    kiln: format!("{at}{k}.b_o"),
                    torch: format!("{at}{t}.out_proj.bias"),
                });
            }
            for lin in ["linear1", "linear2"] {
                out.push(Rule::Transpose {
                    kiln: format!("{at}ffn.{lin}.w"),
                    torch: format!("{at}{lin}.weight"),
                });
                out.push(Rule::Copy {
                    kiln: format!("{at}ffn.{lin}.b"),
                    torch: format!("{at}{lin}.bias"),
                });
            }
            for norm in side.norms() {
                out.push(Rule::Copy {
                    kiln: format!("{at}{norm}.gamma"),
                    torch: format!("{at}{norm}.weight"),
                });
                out.push(Rule::Copy {
                    kiln: format!("{at}{norm}.beta"),
                    torch: format!("{at}{norm}.bias"),
                });
            }
        }
    }
    out
}

/// One packed attention input projection: the kiln weights and biases of q, k, v and the
/// PyTorch `in_proj_weight`/`in_proj_bias`.
struct Packed {
    /// The kiln block, e.g. `decoder.layers.0.cross_attn` (for messages).
    block: String,
    w: [String; 3],
    b: [String; 3],
    torch_w: String,
    torch_b: String,
}

fn packed(n: [usize; 2]) -> Vec<Packed> {
    let mut out = Vec::new();
    for (side, &layers) in SIDES.iter().zip(&n) {
        for i in 0..layers {
            let at = format!("{}{i}.", side.prefix());
            for &(k, t) in side.attentions() {
                out.push(Packed {
                    block: format!("{at}{k}"),
                    w: ["w_q", "w_k", "w_v"].map(|p| format!("{at}{k}.{p}")),
                    b: ["b_q", "b_k", "b_v"].map(|p| format!("{at}{k}.{p}")),
                    torch_w: format!("{at}{t}.in_proj_weight"),
                    torch_b: format!("{at}{t}.in_proj_bias"),
                });
            }
        }
    }
    out
}

/// Checks the names of `params` against the layout; returns the layer counts.
fn check_names(params: &BTreeMap<String, Tensor>, torch: bool) -> Result<[usize; 2], InteropError> {
    if !torch {
        let learned: Vec<String> = params
            .keys()
            .filter(|k| k.ends_with("_pos.table"))
            .cloned()
            .collect();
        if !learned.is_empty() {
            return Err(InteropError::LearnedPositions { names: learned });
        }
    }
    let n = SIDES.map(|s| layer_count(params.keys(), s.prefix()));
    let mut expected: BTreeSet<String> = BTreeSet::new();
    for r in rules(n) {
        let (Rule::Copy { kiln, torch: t } | Rule::Transpose { kiln, torch: t }) = r;
        expected.insert(if torch { t } else { kiln });
    }
    for p in packed(n) {
        if torch {
            expected.insert(p.torch_w);
            expected.insert(p.torch_b);
        } else {
            expected.extend(p.w);
            expected.extend(p.b);
        }
    }
    let unknown: Vec<String> = params
        .keys()
        .filter(|k| !expected.contains(*k))
        .cloned()
        .collect();
    let missing: Vec<String> = expected
        .iter()
        .filter(|k| !params.contains_key(*k))
        .cloned()
        .collect();
    if unknown.is_empty() && missing.is_empty() {
        Ok(n)
    } else {
        Err(InteropError::Names {
            direction: if torch { "PyTorch" } else { "kiln" },
            unknown,
            missing,
        })
    }
}

fn shape_err(name: &str, t: &Tensor, expected: String) -> InteropError {
    InteropError::Shape {
        name: name.to_string(),
        shape: t.shape.clone(),
        expected,
    }
}

fn expect_shape(name: &str, t: &Tensor, want: &[usize]) -> Result<(), InteropError> {
    if t.shape == want && t.is_consistent() {
        Ok(())
    } else {
        Err(shape_err(name, t, format!("{want:?} was expected")))
    }
}

/// d_model, from the embedding `[V, d]`.
fn model_dim(name: &str, emb: &Tensor) -> Result<usize, InteropError> {
    match emb.shape[..] {
        [_, d] if emb.is_consistent() => Ok(d),
        _ => Err(shape_err(
            name,
            emb,
            "the embedding must be [vocab, d_model]".to_string(),
        )),
    }
}

/// The feed-forward size, from the first encoder layer's `linear1`.
fn ffn_dim(name: &str, t: &Tensor, d: usize, torch: bool) -> Result<usize, InteropError> {
    match (&t.shape[..], torch) {
        ([f, dd], true) | ([dd, f], false) if *dd == d => Ok(*f),
        _ => Err(shape_err(
            name,
            t,
            format!(
                "linear1 must map d_model = {d} to d_ff ({})",
                if torch {
                    "[d_ff, d_model]"
                } else {
                    "[d_model, d_ff]"
                }
            ),
        )),
    }
}

/// The expected shape of a copied or transposed tensor, given d and f, in its own naming.
fn rule_shape(name: &str, d: usize, f: usize) -> Vec<usize> {
    let last = name.rsplit('.').next().unwrap_or("");
    if name == "emb.weight" || name == "embedding.weight" {
        return vec![]; // checked by model_dim
    }
    // kiln's linear1 and PyTorch's linear2 are [d, f]; the other two are [f, d].
    if name.ends_with("ffn.linear1.w") || name.ends_with("linear2.weight") {
        vec![d, f]
    } else if name.ends_with("ffn.linear2.w") || name.ends_with("linear1.weight") {
        vec![f, d]
    } else if name.ends_with("ffn.linear1.b") || name.ends_with("linear1.bias") {
        vec![f]
    } else if last == "w_o" || name.ends_with("out_proj.weight") {
        vec![d, d]
    } else {
        // b_o, out_proj.bias, linear2 biases, norms.
        vec![d]
    }
}

/// Copies of `data` rows `[start, end)` of a row-major matrix with `cols` columns.
fn rows(data: &TensorData, cols: usize, start: usize, end: usize) -> TensorData {
    let (a, b) = (start * cols, end * cols);
    match data {
        TensorData::F32(v) => TensorData::F32(v[a..b].to_vec()),
        TensorData::F64(v) => TensorData::F64(v[a..b].to_vec()),
        TensorData::I32(v) => TensorData::I32(v[a..b].to_vec()),
        TensorData::I64(v) => TensorData::I64(v[a..b].to_vec()),
        TensorData::Bool(v) => TensorData::Bool(v[a..b].to_vec()),
    }
}

fn transpose_vec<T: Copy>(v: &[T], r: usize, c: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    for j in 0..c {
        for i in 0..r {
            out.push(v[i * c + j]);
        }
    }
    out
}

/// The transpose of a consistent rank-2 tensor.
fn transpose(t: &Tensor) -> Tensor {
    let (r, c) = (t.shape[0], t.shape[1]);
    let data = match &t.data {
        TensorData::F32(v) => TensorData::F32(transpose_vec(v, r, c)),
        TensorData::F64(v) => TensorData::F64(transpose_vec(v, r, c)),
        TensorData::I32(v) => TensorData::I32(transpose_vec(v, r, c)),
        TensorData::I64(v) => TensorData::I64(transpose_vec(v, r, c)),
        TensorData::Bool(v) => TensorData::Bool(transpose_vec(v, r, c)),
    };
    Tensor {
        shape: vec![c, r],
        data,
    }
}

/// The concatenation of same-dtype tensors' elements (`None` when dtypes differ).
fn concat(parts: [&TensorData; 3]) -> Option<TensorData> {
    macro_rules! cat {
        ($variant:ident) => {{
            let mut out = Vec::new();
            for p in parts {
                match p {
                    TensorData::$variant(v) => out.extend_from_slice(v),
                    _ => return None,
                }
            }
            Some(TensorData::$variant(out))
        }};
    }
    match parts[0] {
        TensorData::F32(_) => cat!(F32),
        TensorData::F64(_) => cat!(F64),
        TensorData::I32(_) => cat!(I32),
        TensorData::I64(_) => cat!(I64),
        TensorData::Bool(_) => cat!(Bool),
    }
}

fn same_dtype(names: &[String; 3], ts: [&Tensor; 3]) -> Result<(), InteropError> {
    for k in 1..3 {
        if std::mem::discriminant(&ts[k].data) != std::mem::discriminant(&ts[0].data) {
            return Err(InteropError::DType {
                a: names[0].clone(),
                a_dtype: ts[0].dtype_name(),
                b: names[k].clone(),
                b_dtype: ts[k].dtype_name(),
            });
        }
    }
    Ok(())
}

/// kiln names → `nn.Transformer` state-dict keys (plus `embedding.weight`).
pub fn to_torch(
    params: &BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>, InteropError> {
    let n = check_names(params, false)?;
    let d = model_dim("emb.weight", &params["emb.weight"])?;
    let f_name = "encoder.layers.0.ffn.linear1.w";
    let f = ffn_dim(f_name, &params[f_name], d, false)?;
    let mut out = BTreeMap::new();

    for p in packed(n) {
        let ws = p.w.clone().map(|k| &params[&k]);
        let bs = p.b.clone().map(|k| &params[&k]);
        for (k, t) in p.w.iter().zip(ws) {
            match t.shape[..] {
                [dd, x] if dd == d && t.is_consistent() => {
                    if x != d {
                        let which = if k.ends_with("w_v") {
                            "h·d_v"
                        } else {
                            "h·d_k"
                        };
                        return Err(InteropError::Unexpressible {
                            name: p.block.clone(),
                            why: format!(
                                "`{k}` projects to {which} = {x}, but d_model = {d}; \
                                 nn.MultiheadAttention needs h·d_k = h·d_v = d_model \
                                 (use d_k = d_v = d_model / h)"
                            ),
                        });
                    }
                }
                _ => return Err(shape_err(k, t, format!("[{d}, {d}] was expected"))),
            }
        }
        for (k, t) in p.b.iter().zip(bs) {
            expect_shape(k, t, &[d])?;
        }
        same_dtype(&p.w, ws)?;
        same_dtype(&p.b, bs)?;
        let wt = ws.map(transpose);
        let w = concat([&wt[0].data, &wt[1].data, &wt[2].data]).expect("dtypes checked");
        let b = concat(bs.map(|t| &t.data)).expect("dtypes checked");
        out.insert(
            p.torch_w,
            Tensor {
                shape: vec![3 * d, d],
                data: w,
            },
        );
        out.insert(
            p.torch_b,
            Tensor {
                shape: vec![3 * d],
                data: b,
            },
        );
    }
    for r in rules(n) {
        match r {
            Rule::Copy { kiln, torch } => {
                let t = &params[&kiln];
                if kiln != "emb.weight" {
                    expect_shape(&kiln, t, &rule_shape(&kiln, d, f))?;
                }
                out.insert(torch, t.clone());
            }
            Rule::Transpose { kiln, torch } => {
                let t = &params[&kiln];
                check_ffn_or_square(&kiln, t, d, f)?;
                out.insert(torch, transpose(t));
            }
        }
    }
    Ok(out)
}

/// Shape checks of transposed tensors, telling a per-layer d_ff apart from a plain error.
fn check_ffn_or_square(name: &str, t: &Tensor, d: usize, f: usize) -> Result<(), InteropError> {
    let want = rule_shape(name, d, f);
    if t.shape == want && t.is_consistent() {
        return Ok(());
    }
    let is_ffn = name.contains("linear1") || name.contains("linear2");
    if is_ffn && t.shape.len() == 2 && t.shape.contains(&d) && t.is_consistent() {
        return Err(InteropError::Unexpressible {
            name: name.to_string(),
            why: format!(
                "its feed-forward size differs from the first encoder layer's ({f}); \
                 nn.Transformer uses one dim_feedforward for every layer"
            ),
        });
    }
    Err(shape_err(name, t, format!("{want:?} was expected")))
}

/// `nn.Transformer` state-dict keys (plus `embedding.weight`) → kiln names.
pub fn from_torch(
    params: &BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>, InteropError> {
    let n = check_names(params, true)?;
    let d = model_dim("embedding.weight", &params["embedding.weight"])?;
    let f_name = "encoder.layers.0.linear1.weight";
    let f = ffn_dim(f_name, &params[f_name], d, true)?;
    let mut out = BTreeMap::new();

    for p in packed(n) {
        let w = &params[&p.torch_w];
        let b = &params[&p.torch_b];
        if w.shape != [3 * d, d] || !w.is_consistent() {
            let why = match w.shape[..] {
                [r, c] if c == d && r % 3 == 0 && r != 3 * d => format!(
                    "{}: the packed projection has {} rows per block but d_model = {d}; \
                     kiln's transformer spec needs h·d_k = d_model here too",
                    p.torch_w,
                    r / 3
                ),
                _ => format!("[{}, {d}] (3·d_model × d_model) was expected", 3 * d),
            };
            return Err(shape_err(&p.torch_w, w, why));
        }
        expect_shape(&p.torch_b, b, &[3 * d])?;
        for k in 0..3 {
            let block = Tensor {
                shape: vec![d, d],
                data: rows(&w.data, d, k * d, (k + 1) * d),
            };
            out.insert(p.w[k].clone(), transpose(&block));
            out.insert(
                p.b[k].clone(),
                Tensor {
                    shape: vec![d],
                    data: rows(&b.data, 1, k * d, (k + 1) * d),
                },
            );
        }
    }
    for r in rules(n) {
        match r {
            Rule::Copy { kiln, torch } => {
                let t = &params[&torch];
                if torch != "embedding.weight" {
                    expect_shape(&torch, t, &rule_shape(&torch, d, f))?;
                }
                out.insert(kiln, t.clone());
            }
            Rule::Transpose { kiln, torch } => {
                let t = &params[&torch];
                check_ffn_or_square(&torch, t, d, f)?;
                out.insert(kiln, transpose(t));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
