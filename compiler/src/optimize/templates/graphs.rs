//! Building template graphs: the prelude's layers, step for step, over symbolic inputs.

use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, ReduceOp, TensorType, UnaryOp};
use crate::optimize::lang::Attr;
use crate::shape::{Dim, Shape};

use super::{TemplateDef, TemplateKind, PAD_SENTINEL, STREAM_SENTINEL};

pub(super) struct TB {
    pub(super) g: Graph,
}

pub(super) fn sym_shape(dims: &[&str]) -> Shape {
    Shape(dims.iter().map(|d| Dim::sym(d)).collect())
}

impl TB {
    pub(super) fn new(name: &str) -> TB {
        TB {
            g: Graph::new(name),
        }
    }
    pub(super) fn input(&mut self, name: &str, dtype: DType, dims: &[&str]) -> NodeId {
        self.g
            .add_input(name, TensorType::new(dtype, sym_shape(dims)))
            .expect("template inputs are distinct")
    }
    pub(super) fn op(&mut self, op: Op, ins: &[NodeId]) -> NodeId {
        self.g.add(op, ins, "").expect("templates are well typed")
    }
    pub(super) fn shape(&self, x: NodeId) -> Shape {
        self.g.ty(x).shape.clone()
    }
    /// Broadcast `x` to the shape of `like`.
    pub(super) fn bc(&mut self, x: NodeId, like: NodeId) -> NodeId {
        let shape = self.shape(like);
        self.op(Op::Broadcast { shape }, &[x])
    }
    pub(super) fn bin(&mut self, op: BinaryOp, a: NodeId, b: NodeId) -> NodeId {
        self.op(Op::Binary(op), &[a, b])
    }
    pub(super) fn un(&mut self, op: UnaryOp, a: NodeId) -> NodeId {
        self.op(Op::Unary(op), &[a])
    }
    pub(super) fn reduce(&mut self, op: ReduceOp, x: NodeId, axis: usize) -> NodeId {
        self.op(Op::Reduce { op, axis }, &[x])
    }
    pub(super) fn matmul(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.op(Op::MatMul, &[a, b])
    }
    /// `x - amax(x)`, the shift both softmaxes start with.
    pub(super) fn shifted(&mut self, x: NodeId, axis: usize) -> NodeId {
        let m = self.reduce(ReduceOp::Max, x, axis);
        let mb = self.bc(m, x);
        self.bin(BinaryOp::Sub, x, mb)
    }
    /// `softmax(x, axis)`: `e = exp(x - amax(x)); e / sum(e)`.
    pub(super) fn softmax(&mut self, x: NodeId, axis: usize) -> NodeId {
        let s = self.shifted(x, axis);
        let e = self.un(UnaryOp::Exp, s);
        let z = self.reduce(ReduceOp::Sum, e, axis);
        let zb = self.bc(z, e);
        self.bin(BinaryOp::Div, e, zb)
    }
    /// `log_softmax(x, axis)`: `s = x - amax(x); s - log(sum(exp(s)))`.
    pub(super) fn log_softmax(&mut self, x: NodeId, axis: usize) -> NodeId {
        let s = self.shifted(x, axis);
        let e = self.un(UnaryOp::Exp, s);
        let z = self.reduce(ReduceOp::Sum, e, axis);
        let l = self.un(UnaryOp::Log, z);
        let lb = self.bc(l, s);
        self.bin(BinaryOp::Sub, s, lb)
    }
    /// The prelude's `normalize`: mean and variance over the last axis.
    pub(super) fn normalize(
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

    /// The prelude's `rms_norm`: `x · rsqrt(Σx² · inv_d + eps) · γ` over the last axis.
    pub(super) fn rms_normalize(
        &mut self,
        x: NodeId,
        gamma: NodeId,
        inv_d: NodeId,
        eps: NodeId,
    ) -> NodeId {
        let last = self.g.ty(x).shape.rank() - 1;
        let sq = self.bin(BinaryOp::Mul, x, x);
        let ssq = self.reduce(ReduceOp::Sum, sq, last);
        let inv = self.bc(inv_d, ssq);
        let ms = self.bin(BinaryOp::Mul, ssq, inv);
        let epsb = self.bc(eps, ms);
        let me = self.bin(BinaryOp::Add, ms, epsb);
        let r = self.un(UnaryOp::Rsqrt, me);
        let rb = self.bc(r, x);
        let xr = self.bin(BinaryOp::Mul, x, rb);
        let gb = self.bc(gamma, x);
        self.bin(BinaryOp::Mul, xr, gb)
    }
}

pub(super) fn lead_dims(rank: usize) -> Vec<String> {
    (0..rank).map(|i| format!("a{i}")).collect()
}

pub(super) fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

/// Which mask an attention or scale-mask-softmax template applies.
#[derive(Clone, Copy)]
pub(super) enum Mask {
    None,
    /// Key padding: `bool[b, 1, 1, tk]` (the prelude reshapes `key_mask[b, tk]`).
    Key,
    /// Causal: `bool[tq, tk]`.
    Causal,
}

impl Mask {
    pub(super) fn name(self) -> &'static str {
        match self {
            Mask::None => "none",
            Mask::Key => "key",
            Mask::Causal => "causal",
        }
    }
    pub(super) fn input(self, t: &mut TB) -> Option<NodeId> {
        match self {
            Mask::None => None,
            Mask::Key => Some(t.input("mask", DType::Bool, &["b", "1", "1", "tk"].map(|s| s))),
            Mask::Causal => Some(t.input("mask", DType::Bool, &["tq", "tk"])),
        }
    }
}

pub(super) fn shape_dims(t: &TB, dims: &[&str]) -> Shape {
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
    pub(super) fn input_shape(&mut self, name: &str, dtype: DType, shape: Shape) -> NodeId {
        self.g
            .add_input(name, TensorType::new(dtype, shape))
            .expect("template inputs are distinct")
    }
}

/// Scores `q @ kᵀ · scale`, masked: the front of `attention` and `scale_mask_softmax`.
pub(super) fn masked_scores(
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

pub(super) fn attention_graph(mask: Mask) -> (TB, Vec<NodeId>, NodeId) {
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

pub(super) fn def(
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
