//! Fused-kernel templates: what each kernel computes, and the rewrites that find it.
//!
//! In: nothing (the templates are built once, from code). Out: the [`registry`] of
//! [`TemplateDef`]s and the egg rewrites of the template phase ([`rules`]).
//!
//! A template is a small graph of IR primitives over symbolic inputs, built by the same
//! steps the prelude elaborates to (`attention` is `softmax(where(mask, q @ kᵀ · scale,
//! fill)) @ v`, `add_layer_norm` is `normalize(x + y)`, …). That one graph is three
//! things at once:
//!
//! - the **left side** of the rewrite: the cone of each template output, with the
//!   template's inputs, shapes, dims and data integers as variables ([`TPattern`]), is
//!   matched against the e-graph as a DAG (a node shared inside the template must be one
//!   e-class in the match);
//! - the **backward** templates: the compiler's own autodiff pass, run on the forward
//!   template with an upstream-gradient input as the seed, produces exactly the nodes it
//!   produces in a real `train_step` — so the backward left sides are derived, not
//!   written by hand, and cannot drift from the autodiff rules;
//! - the kernel's **meaning**: a kernel node is expanded back into its template
//!   ([`TemplateDef::instantiate`]) to validate an optimized program against the
//!   unoptimized graph with the reference executor.
//!
//! Shape guards are structural: axes and permutations in a template are literals, so a
//! softmax template over the last axis of a rank-4 tensor does not match a softmax over
//! another axis; bias and norm parameters are rank-1 inputs broadcast along the last
//! axis, and a match binds them only when the e-graph's types agree.
//!
//! A multi-output kernel (an attention backward gives dq, dk and dv) is one e-node whose
//! e-class is a tuple; each output is a `proj` of it. One rule per output rewrites that
//! output's e-class; the rules of one match build the same e-node (hash-consed), so
//! extraction pays for the kernel once. An output whose cone does not reach every input
//! (dv does not depend on v) joins the kernel node another output's rule built.

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::OnceLock;

use egg::{Id, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Var};

use crate::autodiff::{gradients, gradients_seeded};
use crate::ir::{
    BinaryOp, DType, Float, Graph, IrError, NodeId, Op, ReduceOp, TensorType, UnaryOp,
};
use crate::optimize::analysis::{Info, Types, EG};
pub use crate::optimize::kind::TemplateKind;
use crate::optimize::lang::{attr_of, op_parts, Attr, KNode, Kind};
use crate::shape::{Dim, Shape};

mod applier;
pub use applier::TemplateApplier;

/// A fused kernel's definition.
pub struct TemplateDef {
    /// The kernel kind, which every backend matches exhaustively.
    pub kind: TemplateKind,
    /// Its name (`attention`, `attention_bwd`, `linear`, …).
    pub name: String,
    /// Which form of the kind (`mask=key`, `rank=3`), shown in the kernel graph.
    pub variant: String,
    /// The template graph: inputs with symbolic shapes, the forward nodes and, for a
    /// backward kernel, the gradient nodes.
    pub graph: Graph,
    /// The kernel's tensor operands, in e-node child order.
    pub inputs: Vec<NodeId>,
    /// Attribute operands (a pad id): placeholder values in the template graph, replaced
    /// by the matched values; e-node children after the tensor operands.
    pub attr_inputs: Vec<Attr>,
    /// The attribute operands' names (`pad`, `p`, `stream`).
    pub attr_names: Vec<&'static str>,
    /// The kernel's outputs.
    pub outputs: Vec<NodeId>,
}

/// The sentinel pad id of the `xent_ls` template (replaced by the matched pad id).
const PAD_SENTINEL: i64 = -1_000_003;
/// The sentinel dropout probability and stream of `embed_pe[dropout]`.
const P_SENTINEL: f64 = 0.123_456_789_012_345;
const STREAM_SENTINEL: i64 = 1_000_007;

impl TemplateDef {
    /// Binds the template's symbolic dims to the dims of actual operand types.
    pub fn unify(&self, tys: &[TensorType]) -> Result<BTreeMap<String, Dim>, String> {
        if tys.len() != self.inputs.len() {
            return Err(format!(
                "{} takes {} operands, got {}",
                self.name,
                self.inputs.len(),
                tys.len()
            ));
        }
        let mut map: BTreeMap<String, Dim> = BTreeMap::new();
        for (&i, ty) in self.inputs.iter().zip(tys) {
            let want = self.graph.ty(i);
            if want.dtype != ty.dtype || want.shape.rank() != ty.shape.rank() {
                return Err(format!(
                    "{} operand {} must be {want}, got {ty}",
                    self.name,
                    self.graph.source_name(i).unwrap_or("?")
                ));
            }
            for (w, d) in want.shape.dims().iter().zip(ty.shape.dims()) {
                if let Some(s) = w.as_sym() {
                    match map.get(s) {
                        Some(prev) if prev != d => {
                            return Err(format!("{}: dim `{s}` is both {prev} and {d}", self.name))
                        }
                        _ => {
                            map.insert(s.to_string(), d.clone());
                        }
                    }
                } else if w != d {
                    return Err(format!("{}: dim {w} does not fit {d}", self.name));
                }
            }
        }
        Ok(map)
    }

    /// The output types for operands of the given types.
    pub fn output_types(&self, tys: &[TensorType]) -> Result<Vec<TensorType>, String> {
        let map = self.unify(tys)?;
        Ok(self
            .outputs
            .iter()
            .map(|&o| {
                let t = self.graph.ty(o);
                TensorType::new(t.dtype, subst_shape(&t.shape, &map))
            })
            .collect())
    }

    /// Expands the kernel into primitives in `g`: the nodes of its outputs' cones, with
    /// the template's dims and attribute placeholders replaced. Returns the outputs.
    pub fn instantiate(
        &self,
        g: &mut Graph,
        operands: &[NodeId],
        attrs: &[Attr],
        scope: &str,
    ) -> Result<Vec<NodeId>, IrError> {
        let tys: Vec<TensorType> = operands.iter().map(|&o| g.ty(o).clone()).collect();
        let map = self.unify(&tys).map_err(IrError::Type)?;
        let mut live = vec![false; self.graph.len()];
        let mut stack: Vec<NodeId> = self.outputs.clone();
        while let Some(id) = stack.pop() {
            if !std::mem::replace(&mut live[id.index()], true) {
                stack.extend(self.graph.node(id).inputs.iter().copied());
            }
        }
        let mut val: Vec<Option<NodeId>> = vec![None; self.graph.len()];
        for (&i, &o) in self.inputs.iter().zip(operands) {
            val[i.index()] = Some(o);
        }
        for (i, node) in self.graph.nodes.iter().enumerate() {
            if !live[i] || val[i].is_some() {
                continue;
            }
            if matches!(node.op, Op::Input { .. } | Op::Param { .. }) {
                return Err(IrError::Malformed(format!(
                    "{}: template input {} has no operand",
                    self.name,
                    self.graph.source_name(NodeId(i as u32)).unwrap_or("?")
                )));
            }
            let op = subst_op(&node.op, &map, &self.attr_inputs, attrs);
            let ins: Vec<NodeId> = node
                .inputs
                .iter()
                .map(|x| val[x.index()].expect("operands come first"))
                .collect();
            val[i] = Some(g.add(op, &ins, scope)?);
        }
        Ok(self
            .outputs
            .iter()
            .map(|o| val[o.index()].expect("outputs are live"))
            .collect())
    }
}

fn subst_shape(s: &Shape, map: &BTreeMap<String, Dim>) -> Shape {
    Shape(s.dims().iter().map(|d| d.subst(map)).collect())
}

/// The matched value of an attribute placeholder.
fn replaced(a: &Attr, from: &[Attr], to: &[Attr]) -> Option<Attr> {
    from.iter()
        .zip(to)
        .find(|(f, _)| *f == a)
        .map(|(_, t)| t.clone())
}

fn subst_op(op: &Op, map: &BTreeMap<String, Dim>, from: &[Attr], to: &[Attr]) -> Op {
    let d = |x: &Dim| x.subst(map);
    let s = |x: &Shape| subst_shape(x, map);
    match op {
        Op::Reshape { shape } => Op::Reshape { shape: s(shape) },
        Op::Broadcast { shape } => Op::Broadcast { shape: s(shape) },
        Op::ScatterAdd { rows } => Op::ScatterAdd { rows: d(rows) },
        Op::CausalMask { q, k } => Op::CausalMask { q: d(q), k: d(k) },
        Op::Arange { start, len } => Op::Arange {
            start: d(start),
            len: d(len),
        },
        Op::OneHot { depth } => Op::OneHot { depth: d(depth) },
        Op::Slice { axis, start, len } => Op::Slice {
            axis: *axis,
            start: d(start),
            len: d(len),
        },
        Op::PadMask { pad } => Op::PadMask {
            pad: match replaced(&Attr::Int(*pad), from, to) {
                Some(Attr::Int(t)) => t,
                _ => *pad,
            },
        },
        Op::Dropout { p, stream } => Op::Dropout {
            p: match replaced(&Attr::F(*p), from, to) {
                Some(Attr::F(t)) => t,
                _ => *p,
            },
            stream: match replaced(&Attr::Int(i64::from(*stream)), from, to) {
                Some(Attr::Int(t)) => u32::try_from(t).unwrap_or(*stream),
                _ => *stream,
            },
        },
        other => other.clone(),
    }
}

// ---------------------------------------------------------------------------------------
// Building template graphs: the prelude's layers, step for step.

struct TB {
    g: Graph,
}

fn sym_shape(dims: &[&str]) -> Shape {
    Shape(dims.iter().map(|d| Dim::sym(d)).collect())
}

impl TB {
    fn new(name: &str) -> TB {
        TB {
            g: Graph::new(name),
        }
    }
    fn input(&mut self, name: &str, dtype: DType, dims: &[&str]) -> NodeId {
        self.g
            .add_input(name, TensorType::new(dtype, sym_shape(dims)))
            .expect("template inputs are distinct")
    }
    fn op(&mut self, op: Op, ins: &[NodeId]) -> NodeId {
        self.g.add(op, ins, "").expect("templates are well typed")
    }
    fn shape(&self, x: NodeId) -> Shape {
        self.g.ty(x).shape.clone()
    }
    /// Broadcast `x` to the shape of `like`.
    fn bc(&mut self, x: NodeId, like: NodeId) -> NodeId {
        let shape = self.shape(like);
        self.op(Op::Broadcast { shape }, &[x])
    }
    fn bin(&mut self, op: BinaryOp, a: NodeId, b: NodeId) -> NodeId {
        self.op(Op::Binary(op), &[a, b])
    }
    fn un(&mut self, op: UnaryOp, a: NodeId) -> NodeId {
        self.op(Op::Unary(op), &[a])
    }
    fn reduce(&mut self, op: ReduceOp, x: NodeId, axis: usize) -> NodeId {
        self.op(Op::Reduce { op, axis }, &[x])
    }
    fn matmul(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.op(Op::MatMul, &[a, b])
    }
    /// `x - amax(x)`, the shift both softmaxes start with.
    fn shifted(&mut self, x: NodeId, axis: usize) -> NodeId {
        let m = self.reduce(ReduceOp::Max, x, axis);
        let mb = self.bc(m, x);
        self.bin(BinaryOp::Sub, x, mb)
    }
    /// `softmax(x, axis)`: `e = exp(x - amax(x)); e / sum(e)`.
    fn softmax(&mut self, x: NodeId, axis: usize) -> NodeId {
        let s = self.shifted(x, axis);
        let e = self.un(UnaryOp::Exp, s);
        let z = self.reduce(ReduceOp::Sum, e, axis);
        let zb = self.bc(z, e);
        self.bin(BinaryOp::Div, e, zb)
    }
    /// `log_softmax(x, axis)`: `s = x - amax(x); s - log(sum(exp(s)))`.
    fn log_softmax(&mut self, x: NodeId, axis: usize) -> NodeId {
        let s = self.shifted(x, axis);
        let e = self.un(UnaryOp::Exp, s);
        let z = self.reduce(ReduceOp::Sum, e, axis);
        let l = self.un(UnaryOp::Log, z);
        let lb = self.bc(l, s);
        self.bin(BinaryOp::Sub, s, lb)
    }
    /// The prelude's `normalize`: mean and variance over the last axis.
    fn normalize(
        &mut self,
        x: NodeId,
        gamma: NodeId,
        beta: NodeId,
        inv_d: NodeId,
        eps: NodeId,
    ) -> NodeId {
        let last = self.g.ty(x).shape.rank() - 1;
        let sx = self.reduce(ReduceOp::Sum, x, last);
        let inv = self.bc(inv_d, sx);
        let mean = self.bin(BinaryOp::Mul, sx, inv);
        let meanb = self.bc(mean, x);
        let xc = self.bin(BinaryOp::Sub, x, meanb);
        let sq = self.bin(BinaryOp::Mul, xc, xc);
        let ssq = self.reduce(ReduceOp::Sum, sq, last);
        let var = self.bin(BinaryOp::Mul, ssq, inv);
        let epsb = self.bc(eps, var);
        let ve = self.bin(BinaryOp::Add, var, epsb);
        let sd = self.un(UnaryOp::Sqrt, ve);
        let rstd = self.un(UnaryOp::Recip, sd);
        let rstdb = self.bc(rstd, x);
        let xhat = self.bin(BinaryOp::Mul, xc, rstdb);
        let gb = self.bc(gamma, x);
        let scaled = self.bin(BinaryOp::Mul, xhat, gb);
        let bb = self.bc(beta, x);
        self.bin(BinaryOp::Add, scaled, bb)
    }
}

fn lead_dims(rank: usize) -> Vec<String> {
    (0..rank).map(|i| format!("a{i}")).collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

/// Which mask an attention or scale-mask-softmax template applies.
#[derive(Clone, Copy)]
enum Mask {
    None,
    /// Key padding: `bool[b, 1, 1, tk]` (the prelude reshapes `key_mask[b, tk]`).
    Key,
    /// Causal: `bool[tq, tk]`.
    Causal,
}

impl Mask {
    fn name(self) -> &'static str {
        match self {
            Mask::None => "none",
            Mask::Key => "key",
            Mask::Causal => "causal",
        }
    }
    fn input(self, t: &mut TB) -> Option<NodeId> {
        match self {
            Mask::None => None,
            Mask::Key => Some(t.input("mask", DType::Bool, &["b", "1", "1", "tk"].map(|s| s))),
            Mask::Causal => Some(t.input("mask", DType::Bool, &["tq", "tk"])),
        }
    }
}

fn shape_dims(t: &TB, dims: &[&str]) -> Shape {
    let _ = t;
    Shape(
        dims.iter()
            .map(|d| match d.parse::<i64>() {
                Ok(n) => Dim::c(n),
                Err(_) => Dim::sym(d),
            })
            .collect(),
    )
}

impl TB {
    fn input_shape(&mut self, name: &str, dtype: DType, shape: Shape) -> NodeId {
        self.g
            .add_input(name, TensorType::new(dtype, shape))
            .expect("template inputs are distinct")
    }
}

/// Scores `q @ kᵀ · scale`, masked: the front of `attention` and `scale_mask_softmax`.
fn masked_scores(
    t: &mut TB,
    s: NodeId,
    scale: NodeId,
    mask: Option<NodeId>,
    fill: Option<NodeId>,
) -> NodeId {
    let sb = t.bc(scale, s);
    let mut s = t.bin(BinaryOp::Mul, s, sb);
    if let (Some(m), Some(f)) = (mask, fill) {
        let mb = t.bc(m, s);
        let fb = t.bc(f, s);
        s = t.op(Op::Where, &[mb, s, fb]);
    }
    s
}

fn attention_graph(mask: Mask) -> (TB, Vec<NodeId>, NodeId) {
    let mut t = TB::new("attention");
    let q = t.input("q", DType::F32, &["b", "h", "tq", "dk"]);
    let k = t.input("k", DType::F32, &["b", "h", "tk", "dk"]);
    let v = t.input("v", DType::F32, &["b", "h", "tk", "dv"]);
    let m = match mask {
        Mask::None => None,
        Mask::Key => {
            let sh = shape_dims(&t, &["b", "1", "1", "tk"]);
            Some(t.input_shape("mask", DType::Bool, sh))
        }
        Mask::Causal => Mask::Causal.input(&mut t),
    };
    let scale = t.input("scale", DType::F32, &[]);
    let fill = m.map(|_| t.input("fill", DType::F32, &[]));
    let kt = t.op(
        Op::Permute {
            perm: vec![0, 1, 3, 2],
        },
        &[k],
    );
    let raw = t.matmul(q, kt);
    let s = masked_scores(&mut t, raw, scale, m, fill);
    let p = t.softmax(s, 3);
    let o = t.matmul(p, v);
    let mut inputs = vec![q, k, v];
    inputs.extend(m);
    inputs.push(scale);
    inputs.extend(fill);
    (t, inputs, o)
}

fn def(
    kind: TemplateKind,
    variant: String,
    t: TB,
    inputs: Vec<NodeId>,
    attr_inputs: Vec<Attr>,
    outputs: Vec<NodeId>,
) -> TemplateDef {
    let attr_names = attr_inputs
        .iter()
        .map(|a| match a {
            Attr::Int(PAD_SENTINEL) => "pad",
            Attr::Int(STREAM_SENTINEL) => "stream",
            _ => "p",
        })
        .collect();
    TemplateDef {
        kind,
        name: kind.name().to_string(),
        variant,
        graph: t.g,
        inputs,
        attr_inputs,
        attr_names,
        outputs,
    }
}

fn build_registry() -> Vec<TemplateDef> {
    let mut out = Vec::new();
    // linear / linear_relu: x[..., k] @ w[k, n] + b[n] (then relu).
    for relu in [false, true] {
        for rank in 2..=4 {
            let mut t = TB::new("linear");
            let mut dims = lead_dims(rank - 1);
            dims.push("k".into());
            let x = t.input("x", DType::F32, &strs(&dims));
            let w = t.input("w", DType::F32, &["k", "n"]);
            let b = t.input("b", DType::F32, &["n"]);
            let y = t.matmul(x, w);
            let bb = t.bc(b, y);
            let mut y = t.bin(BinaryOp::Add, y, bb);
            if relu {
                y = t.un(UnaryOp::Relu, y);
            }
            let kind = if relu {
                TemplateKind::LinearRelu
            } else {
                TemplateKind::Linear
            };
            out.push(def(
                kind,
                format!("rank={rank}"),
                t,
                vec![x, w, b],
                vec![],
                vec![y],
            ));
        }
    }
    // softmax over the last axis.
    for rank in 2..=4 {
        let mut t = TB::new("softmax");
        let x = t.input("x", DType::F32, &strs(&lead_dims(rank)));
        let y = t.softmax(x, rank - 1);
        out.push(def(
            TemplateKind::Softmax,
            format!("rank={rank}"),
            t,
            vec![x],
            vec![],
            vec![y],
        ));
    }
    // scale_mask_softmax over attention scores [b, h, tq, tk].
    for mask in [Mask::None, Mask::Key, Mask::Causal] {
        let mut t = TB::new("scale_mask_softmax");
        let x = t.input("x", DType::F32, &["b", "h", "tq", "tk"]);
        let m = match mask {
            Mask::Key => {
                let sh = shape_dims(&t, &["b", "1", "1", "tk"]);
                Some(t.input_shape("mask", DType::Bool, sh))
            }
            other => other.input(&mut t),
        };
        let scale = t.input("scale", DType::F32, &[]);
        let fill = m.map(|_| t.input("fill", DType::F32, &[]));
        let s = masked_scores(&mut t, x, scale, m, fill);
        let y = t.softmax(s, 3);
        let mut inputs = vec![x];
        inputs.extend(m);
        inputs.push(scale);
        inputs.extend(fill);
        out.push(def(
            TemplateKind::ScaleMaskSoftmax,
            format!("mask={}", mask.name()),
            t,
            inputs,
            vec![],
            vec![y],
        ));
    }
    // attention and its backward.
    for mask in [Mask::None, Mask::Key, Mask::Causal] {
        let (t, inputs, o) = attention_graph(mask);
        out.push(def(
            TemplateKind::Attention,
            format!("mask={}", mask.name()),
            t,
            inputs,
            vec![],
            vec![o],
        ));

        let (mut t, mut inputs, o) = attention_graph(mask);
        let g = t.input("g", DType::F32, &["b", "h", "tq", "dv"]);
        let wrt = inputs[..3].to_vec();
        let (graph, grads) =
            gradients_seeded(&t.g, o, Some(g), &wrt).expect("attention differentiates");
        t.g = graph;
        let pos = if matches!(mask, Mask::None) { 3 } else { 4 };
        inputs.insert(pos, g);
        out.push(def(
            TemplateKind::AttentionBwd,
            format!("mask={}", mask.name()),
            t,
            inputs,
            vec![],
            grads,
        ));
    }
    // add_layer_norm: normalize(x + y) over the last axis, and its backward.
    for rank in 2..=4 {
        let build = || {
            let mut t = TB::new("add_layer_norm");
            let mut dims = lead_dims(rank - 1);
            dims.push("d".into());
            let x = t.input("x", DType::F32, &strs(&dims));
            let y = t.input("y", DType::F32, &strs(&dims));
            let gamma = t.input("gamma", DType::F32, &["d"]);
            let beta = t.input("beta", DType::F32, &["d"]);
            let inv_d = t.input("inv_d", DType::F32, &[]);
            let eps = t.input("eps", DType::F32, &[]);
            let s = t.bin(BinaryOp::Add, x, y);
            let o = t.normalize(s, gamma, beta, inv_d, eps);
            (t, [x, y, gamma, beta, inv_d, eps], o)
        };
        let (t, [x, y, gamma, beta, inv_d, eps], o) = build();
        out.push(def(
            TemplateKind::AddLayerNorm,
            format!("rank={rank}"),
            t,
            vec![x, y, gamma, beta, inv_d, eps],
            vec![],
            vec![o],
        ));

        let (mut t, [x, y, gamma, beta, inv_d, eps], o) = build();
        let dims: Vec<String> =
            t.g.ty(x)
                .shape
                .dims()
                .iter()
                .map(|d| d.to_string())
                .collect();
        let g = t.input("g", DType::F32, &strs(&dims));
        let (graph, grads) = gradients_seeded(&t.g, o, Some(g), &[x, gamma, beta])
            .expect("layer norm differentiates");
        t.g = graph;
        out.push(def(
            TemplateKind::AddLayerNormBwd,
            format!("rank={rank}"),
            t,
            vec![x, y, gamma, g, inv_d, eps],
            vec![],
            grads,
        ));
    }
    // xent_ls: log-softmax + label-smoothed NLL averaged over non-pad targets, fused with
    // the gradient of the logits (output 1; used by train_step). The `seeded` form is a
    // loss-scaled train_step's: the gradient is seeded by the scalar operand `seed`.
    for seeded in [false, true] {
        let mut t = TB::new("xent_ls");
        let logits = t.input("logits", DType::F32, &["b", "t", "v"]);
        let target = t.input("target", DType::I32, &["b", "t"]);
        let c_nll = t.input("c_nll", DType::F32, &[]);
        let c_smooth = t.input("c_smooth", DType::F32, &[]);
        let inv_v = t.input("inv_v", DType::F32, &[]);
        let lp = t.log_softmax(logits, 2);
        let oh = t.op(
            Op::OneHot {
                depth: Dim::sym("v"),
            },
            &[target],
        );
        let picked = t.bin(BinaryOp::Mul, lp, oh);
        let ps = t.reduce(ReduceOp::Sum, picked, 2);
        let nll = t.un(UnaryOp::Neg, ps);
        let sl = t.reduce(ReduceOp::Sum, lp, 2);
        let nsl = t.un(UnaryOp::Neg, sl);
        let ivb = t.bc(inv_v, nsl);
        let smooth = t.bin(BinaryOp::Mul, nsl, ivb);
        let cnb = t.bc(c_nll, nll);
        let a = t.bin(BinaryOp::Mul, nll, cnb);
        let csb = t.bc(c_smooth, smooth);
        let bterm = t.bin(BinaryOp::Mul, smooth, csb);
        let loss = t.bin(BinaryOp::Add, a, bterm);
        let pm = t.op(Op::PadMask { pad: PAD_SENTINEL }, &[target]);
        let pf = t.op(Op::Cast { to: DType::F32 }, &[pm]);
        let keep = t.op(
            Op::Reshape {
                shape: shape_dims(&t, &["b", "t", "1"]),
            },
            &[pf],
        );
        let lk = t.bin(BinaryOp::Mul, loss, keep);
        let full_sum = |t: &mut TB, x: NodeId| {
            let a = t.reduce(ReduceOp::Sum, x, 0);
            let b = t.reduce(ReduceOp::Sum, a, 1);
            let c = t.reduce(ReduceOp::Sum, b, 2);
            t.op(
                Op::Reshape {
                    shape: Shape::scalar(),
                },
                &[c],
            )
        };
        let num = full_sum(&mut t, lk);
        let den = full_sum(&mut t, keep);
        let mean = t.bin(BinaryOp::Div, num, den);
        let mut operands = vec![logits, target, c_nll, c_smooth, inv_v];
        let (graph, grads) = if seeded {
            let seed = t.input("seed", DType::F32, &[]);
            operands.push(seed);
            gradients_seeded(&t.g, mean, Some(seed), &[logits])
        } else {
            gradients(&t.g, mean, &[logits])
        }
        .expect("xent differentiates");
        t.g = graph;
        let variant = if seeded { "rank=3 seeded" } else { "rank=3" };
        out.push(def(
            TemplateKind::XentLs,
            variant.to_string(),
            t,
            operands,
            vec![Attr::Int(PAD_SENTINEL)],
            vec![mean, grads[0]],
        ));
    }
    // embed_pe: gather(table, ids) · scale + positions, and in training the dropout
    // that follows (the mask is the same: dropout's element index is the output's).
    for dropout in [false, true] {
        let mut t = TB::new("embed_pe");
        let table = t.input("table", DType::F32, &["vocab", "d"]);
        let ids = t.input("ids", DType::I32, &["b", "t"]);
        let pe = t.input("pe", DType::F32, &["t", "d"]);
        let scale = t.input("scale", DType::F32, &[]);
        let e = t.op(Op::Gather, &[table, ids]);
        let sb = t.bc(scale, e);
        let es = t.bin(BinaryOp::Mul, e, sb);
        let pb = t.bc(pe, es);
        let mut y = t.bin(BinaryOp::Add, es, pb);
        let mut attrs = vec![];
        if dropout {
            y = t.op(
                Op::Dropout {
                    p: Float::new(P_SENTINEL),
                    stream: STREAM_SENTINEL as u32,
                },
                &[y],
            );
            attrs = vec![Attr::F(Float::new(P_SENTINEL)), Attr::Int(STREAM_SENTINEL)];
        }
        let variant = if dropout { "rank=2 dropout" } else { "rank=2" };
        out.push(def(
            TemplateKind::EmbedPe,
            variant.to_string(),
            t,
            vec![table, ids, pe, scale],
            attrs,
            vec![y],
        ));
    }
    // sum_rows: the sum over every leading axis, as autodiff writes the gradient of a
    // broadcast bias (one `sum` per axis, then a reshape to the bias' shape).
    for rank in 2..=4 {
        let mut t = TB::new("sum_rows");
        let mut dims = lead_dims(rank - 1);
        dims.push("n".into());
        let x = t.input("x", DType::F32, &strs(&dims));
        let mut y = x;
        for axis in 0..rank - 1 {
            y = t.reduce(ReduceOp::Sum, y, axis);
        }
        let y = t.op(
            Op::Reshape {
                shape: sym_shape(&["n"]),
            },
            &[y],
        );
        out.push(def(
            TemplateKind::SumRows,
            format!("rank={rank}"),
            t,
            vec![x],
            vec![],
            vec![y],
        ));
    }
    // scatter_add_into: `base + scatter_add(ids, src)`, as autodiff accumulates the
    // gradient of a table read by several gathers (a tied embedding: the projection's
    // weight gradient, then one scatter per embedding). Its kernels add the rows onto the
    // base (in place where the plan allows, `plan::in_place`) rather than make a
    // vocabulary-sized zero tensor per scatter and sum them afterwards.
    for rank in 1..=2 {
        let mut t = TB::new("scatter_add_into");
        let lead = lead_dims(rank);
        let mut src_dims = lead.clone();
        src_dims.push("d".into());
        let base = t.input("base", DType::F32, &["v", "d"]);
        let ids = t.input("ids", DType::I32, &strs(&lead));
        let src = t.input("src", DType::F32, &strs(&src_dims));
        let s = t.op(
            Op::ScatterAdd {
                rows: Dim::sym("v"),
            },
            &[ids, src],
        );
        let y = t.bin(BinaryOp::Add, base, s);
        out.push(def(
            TemplateKind::ScatterAddInto,
            format!("rank={rank}"),
            t,
            vec![base, ids, src],
            vec![],
            vec![y],
        ));
    }
    // adam_update: the whole optimizer step of one parameter (crate::adam's nodes).
    for rank in 0..=2 {
        let mut t = TB::new("adam_update");
        let dims = lead_dims(rank);
        let p = t.input("p", DType::F32, &strs(&dims));
        let g = t.input("g", DType::F32, &strs(&dims));
        let m = t.input("m", DType::F32, &strs(&dims));
        let v = t.input("v", DType::F32, &strs(&dims));
        let mut scalar = |name: &str| t.input(name, DType::F32, &[]);
        let k = crate::adam::Consts {
            b1: scalar("b1"),
            b2: scalar("b2"),
            c1: scalar("c1"),
            c2: scalar("c2"),
            eps: scalar("eps"),
            step_size: scalar("step_size"),
            inv_sqrt_bc2: scalar("inv_sqrt_bc2"),
        };
        let shape = t.shape(p);
        let (p2, m2, v2) = crate::adam::update(&mut t.g, &k, p, g, m, v, &shape, "p")
            .expect("the Adam template is well typed");
        let inputs = vec![
            p,
            g,
            m,
            v,
            k.b1,
            k.b2,
            k.c1,
            k.c2,
            k.eps,
            k.step_size,
            k.inv_sqrt_bc2,
        ];
        out.push(def(
            TemplateKind::AdamUpdate,
            format!("rank={rank}"),
            t,
            inputs,
            vec![],
            vec![p2, m2, v2],
        ));
    }
    out
}

/// Every template, in a fixed order (the e-node kind `Kernel(i)` indexes it).
pub fn registry() -> &'static [TemplateDef] {
    static REG: OnceLock<Vec<TemplateDef>> = OnceLock::new();
    REG.get_or_init(build_registry)
}

// ---------------------------------------------------------------------------------------
// Patterns: a template output's cone as a DAG to match against the e-graph.

/// A pattern node.
#[derive(Clone, Debug)]
enum PNode {
    /// A variable (template input, shape, dim or data integer), by slot.
    Var(usize),
    Attr(Attr),
    Op(Kind, Vec<usize>),
}

/// The left side of a template rule.
pub struct TPattern {
    nodes: Vec<PNode>,
    root: usize,
    vars: Vec<Var>,
    /// Pattern node of each kernel operand (`None`: not in this output's cone).
    operand_nodes: Vec<Option<usize>>,
    attr_nodes: Vec<Option<usize>>,
}

/// Attributes that are data (shapes, dims, integers) match any value; axes, permutations,
/// dtypes and constants are structure and must be equal.
fn attr_is_var(a: &Attr, kind: Kind) -> bool {
    match a {
        Attr::Shape(_) | Attr::Dim(_) | Attr::Int(_) => true,
        Attr::F(_) => kind == Kind::Dropout,
        _ => false,
    }
}

impl TPattern {
    fn new(def: &TemplateDef, output: usize) -> TPattern {
        let g = &def.graph;
        let mut nodes: Vec<PNode> = Vec::new();
        let mut vars: Vec<Var> = Vec::new();
        let mut of_node: HashMap<NodeId, usize> = HashMap::new();
        let mut of_attr: HashMap<Attr, usize> = HashMap::new();
        let mut lit_attr: HashMap<Attr, usize> = HashMap::new();
        fn new_var(nodes: &mut Vec<PNode>, vars: &mut Vec<Var>) -> usize {
            let slot = vars.len();
            vars.push(Var::from_str(&format!("?v{slot}")).expect("a valid variable name"));
            nodes.push(PNode::Var(slot));
            nodes.len() - 1
        }
        // Post-order walk of the cone (explicit stack: templates can be deep).
        let root = def.outputs[output];
        let mut stack = vec![(root, false)];
        while let Some((id, expanded)) = stack.pop() {
            if of_node.contains_key(&id) {
                continue;
            }
            let node = g.node(id);
            if matches!(node.op, Op::Input { .. }) {
                let p = new_var(&mut nodes, &mut vars);
                of_node.insert(id, p);
                continue;
            }
            if !expanded {
                stack.push((id, true));
                for &c in node.inputs.iter().rev() {
                    stack.push((c, false));
                }
                continue;
            }
            let (kind, attrs) = op_parts(&node.op);
            let mut kids: Vec<usize> = node.inputs.iter().map(|c| of_node[c]).collect();
            for a in attrs {
                let p = if attr_is_var(&a, kind) {
                    match of_attr.get(&a) {
                        Some(&p) => p,
                        None => {
                            let p = new_var(&mut nodes, &mut vars);
                            of_attr.insert(a, p);
                            p
                        }
                    }
                } else {
                    match lit_attr.get(&a) {
                        Some(&p) => p,
                        None => {
                            nodes.push(PNode::Attr(a.clone()));
                            lit_attr.insert(a, nodes.len() - 1);
                            nodes.len() - 1
                        }
                    }
                };
                kids.push(p);
            }
            nodes.push(PNode::Op(kind, kids));
            of_node.insert(id, nodes.len() - 1);
        }
        let operand_nodes = def.inputs.iter().map(|i| of_node.get(i).copied()).collect();
        let attr_nodes = def
            .attr_inputs
            .iter()
            .map(|a| of_attr.get(a).copied())
            .collect();
        TPattern {
            root: of_node[&root],
            nodes,
            vars,
            operand_nodes,
            attr_nodes,
        }
    }

    fn root_kind(&self) -> Kind {
        match &self.nodes[self.root] {
            PNode::Op(k, _) => *k,
            _ => unreachable!("template roots are ops"),
        }
    }

    /// Every way the pattern node `p` matches e-class `class`, extending `st`.
    fn match_node(
        &self,
        eg: &EG,
        p: usize,
        class: Id,
        st: Vec<Option<Id>>,
        out: &mut Vec<Vec<Option<Id>>>,
        budget: &mut usize,
    ) {
        if *budget == 0 {
            return;
        }
        *budget -= 1;
        let class = eg.find(class);
        if let Some(b) = st[p] {
            if b == class {
                out.push(st);
            }
            return;
        }
        match &self.nodes[p] {
            PNode::Var(_) => {
                let mut st = st;
                st[p] = Some(class);
                out.push(st);
            }
            PNode::Attr(a) => {
                if attr_of(eg, class) == Some(a) {
                    let mut st = st;
                    st[p] = Some(class);
                    out.push(st);
                }
            }
            PNode::Op(kind, kids) => {
                for n in &eg[class].nodes {
                    let KNode::Op(k2, ch) = n else { continue };
                    if k2 != kind || ch.len() != kids.len() {
                        continue;
                    }
                    let mut sols = {
                        let mut s = st.clone();
                        s[p] = Some(class);
                        vec![s]
                    };
                    for (i, &kp) in kids.iter().enumerate() {
                        let mut next = Vec::new();
                        for s in sols {
                            self.match_node(eg, kp, ch[i], s, &mut next, budget);
                        }
                        sols = next;
                        if sols.is_empty() {
                            break;
                        }
                    }
                    out.extend(sols);
                }
            }
        }
    }
}

/// Searches one template output's pattern.
pub struct TemplateSearcher {
    pat: &'static TPattern,
}

impl Searcher<KNode, Types> for TemplateSearcher {
    fn search_eclass_with_limit(
        &self,
        eg: &EG,
        eclass: Id,
        limit: usize,
    ) -> Option<SearchMatches<'_, KNode>> {
        let kind = self.pat.root_kind();
        if !eg[eclass]
            .nodes
            .iter()
            .any(|n| matches!(n, KNode::Op(k, _) if *k == kind))
        {
            return None;
        }
        let mut sols = Vec::new();
        let mut budget = 200_000;
        self.pat.match_node(
            eg,
            self.pat.root,
            eclass,
            vec![None; self.pat.nodes.len()],
            &mut sols,
            &mut budget,
        );
        if sols.is_empty() {
            return None;
        }
        let substs: Vec<Subst> = sols
            .into_iter()
            .take(limit.min(8))
            .map(|st| {
                let mut s = Subst::with_capacity(self.pat.vars.len());
                for (p, n) in self.pat.nodes.iter().enumerate() {
                    if let (PNode::Var(slot), Some(id)) = (n, st[p]) {
                        s.insert(self.pat.vars[*slot], id);
                    }
                }
                s
            })
            .collect();
        Some(SearchMatches {
            eclass,
            substs,
            ast: None::<std::borrow::Cow<'_, PatternAst<KNode>>>,
        })
    }

    fn vars(&self) -> Vec<Var> {
        self.pat.vars.clone()
    }
}

/// The template phase's rewrites: one per template output, named `kind[variant]/i`.
pub fn rules() -> Vec<Rewrite<KNode, Types>> {
    static PATS: OnceLock<Vec<(u16, usize, TPattern)>> = OnceLock::new();
    let pats = PATS.get_or_init(|| {
        let mut v = Vec::new();
        for (t, def) in registry().iter().enumerate() {
            for o in 0..def.outputs.len() {
                v.push((t as u16, o, TPattern::new(def, o)));
            }
        }
        v
    });
    pats.iter()
        .map(|(t, o, pat)| {
            let def = &registry()[*t as usize];
            let name = if def.outputs.len() > 1 {
                format!("{}[{}]/{}", def.name, def.variant, o)
            } else {
                format!("{}[{}]", def.name, def.variant)
            };
            Rewrite::new(
                name,
                TemplateSearcher { pat },
                TemplateApplier {
                    template: *t,
                    output: *o,
                    pat,
                },
            )
            .expect("template rules are well formed")
        })
        .collect()
}

/// The kernel's attribute text: its variant, constant scalar operands and attributes.
pub fn describe(def: &TemplateDef, operand_konst: &[Option<f64>], attrs: &[Attr]) -> String {
    let mut parts = vec![def.variant.clone()];
    for (i, &op) in def.inputs.iter().enumerate() {
        if def.graph.ty(op).shape.rank() == 0 {
            if let Some(k) = operand_konst.get(i).copied().flatten() {
                parts.push(format!(
                    "{}={}",
                    def.graph.source_name(op).unwrap_or("?"),
                    Float::new(k)
                ));
            }
        }
    }
    for (name, a) in def.attr_names.iter().zip(attrs) {
        parts.push(format!("{name}={a}"));
    }
    parts.join(" ")
}
