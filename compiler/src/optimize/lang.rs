//! The e-graph language: the IR's primitives, fused kernels, elementwise regions.
//!
//! In: a [`Graph`]. Out: an [`egg::EGraph`] holding one e-node per IR node ([`to_egraph`]),
//! the e-class of every IR node, and the way back from an e-node to an IR [`Op`]
//! ([`node_op`]).
//!
//! An e-node is an operator ([`Kind`]) over child e-classes. Attributes — shapes, axes,
//! permutations, dtypes, constant values, names — are *leaf children* ([`Attr`]), so a
//! rewrite can bind them to variables, and two nodes that differ only in an attribute
//! differ in a child. Floats are wrapped in the bit-ordered [`Float`].
//!
//! Fused kernels are their own kinds ([`Kind::Kernel`], [`Kind::Region`]); kernels with
//! several outputs make a tuple e-class, read by [`Kind::Proj`].

use std::fmt;
use std::sync::Arc;

use egg::{Id, Language};

use crate::ir::{BinaryOp, CmpOp, DType, Float, Graph, Op, ReduceOp, TensorType, UnaryOp};
use crate::optimize::analysis::{Types, EG};
use crate::optimize::regions::Expr;
use crate::shape::{Dim, Shape};

/// An attribute, stored as a leaf e-node.
#[derive(
    Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, serde::Serialize, serde::Deserialize,
)]
pub enum Attr {
    Shape(Shape),
    Perm(Vec<usize>),
    /// A reduction or concatenation axis.
    Axis(usize),
    /// An integer that is data, not structure (a pad id, a dropout stream).
    Int(i64),
    F(Float),
    DType(DType),
    Dim(Dim),
    Name(String),
    /// The scalar program of an elementwise region.
    Expr(Arc<Expr>),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Shape(s) => write!(f, "{s}"),
            Attr::Perm(p) => write!(f, "{p:?}"),
            Attr::Axis(a) => write!(f, "axis{a}"),
            Attr::Int(i) => write!(f, "{i}"),
            Attr::F(x) => write!(f, "{x}"),
            Attr::DType(d) => write!(f, "{d}"),
            Attr::Dim(d) => write!(f, "{d}"),
            Attr::Name(n) => write!(f, "{n}"),
            Attr::Expr(e) => write!(f, "{{{}}}", e.text()),
        }
    }
}

/// What an e-node computes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub enum Kind {
    /// `[name, dtype, shape]`
    Input,
    /// `[name, dtype, shape]`
    Param,
    /// `[value, dtype]`
    Const,
    /// `[x, shape]`
    Reshape,
    /// `[x, perm]`
    Permute,
    /// `[x, shape]`
    Broadcast,
    Unary(UnaryOp),
    Binary(BinaryOp),
    Where,
    Compare(CmpOp),
    /// `[x, dtype]`
    Cast,
    /// `[x, axis]`
    Reduce(ReduceOp),
    MatMul,
    Gather,
    /// `[ids, src, rows]`
    ScatterAdd,
    /// `[x, p, stream]`
    Dropout,
    /// `[q, k]` (dims)
    CausalMask,
    /// `[ids, pad]`
    PadMask,
    /// `[start, len]` (dims)
    Arange,
    /// `[ids, depth]`
    OneHot,
    /// `[parts..., axis]`
    Concat,
    /// `[x, axis, start, len]`
    Slice,
    /// A fused kernel: the index of its template in [`crate::optimize::templates::registry`];
    /// children are the template's inputs, then its attribute inputs.
    Kernel(u16),
    /// An elementwise region: `[inputs..., expr]`.
    Region,
    /// Output `i` of a multi-output kernel: `[tuple]`.
    Proj(u8),
}

/// An e-node.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub enum KNode {
    Op(Kind, Vec<Id>),
    Attr(Attr),
}

impl Language for KNode {
    type Discriminant = (Option<Kind>, Option<Attr>);

    fn discriminant(&self) -> Self::Discriminant {
        match self {
            KNode::Op(k, _) => (Some(*k), None),
            KNode::Attr(a) => (None, Some(a.clone())),
        }
    }

    fn matches(&self, other: &Self) -> bool {
        match (self, other) {
            (KNode::Op(a, x), KNode::Op(b, y)) => a == b && x.len() == y.len(),
            (KNode::Attr(a), KNode::Attr(b)) => a == b,
            _ => false,
        }
    }

    fn children(&self) -> &[Id] {
        match self {
            KNode::Op(_, c) => c,
            KNode::Attr(_) => &[],
        }
    }

    fn children_mut(&mut self) -> &mut [Id] {
        match self {
            KNode::Op(_, c) => c,
            KNode::Attr(_) => &mut [],
        }
    }
}

impl fmt::Display for KNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KNode::Op(k, _) => write!(f, "{}", kind_name(*k)),
            KNode::Attr(a) => write!(f, "{a}"),
        }
    }
}

/// The text name of a kind (`matmul`, `attention`, `region`, …).
pub fn kind_name(k: Kind) -> String {
    match k {
        Kind::Kernel(t) => crate::optimize::templates::registry()[t as usize]
            .name
            .clone(),
        Kind::Region => "region".to_string(),
        Kind::Proj(i) => format!("proj{i}"),
        other => match prim_op_stub(other) {
            Some(op) => op.name().to_string(),
            None => format!("{other:?}"),
        },
    }
}

/// An op of the kind with placeholder attributes (for its name).
fn prim_op_stub(k: Kind) -> Option<Op> {
    let d = Dim::c(0);
    Some(match k {
        Kind::Input => Op::Input {
            name: String::new(),
        },
        Kind::Param => Op::Param {
            name: String::new(),
            init: crate::ir::Init::Zeros,
        },
        Kind::Const => Op::Const {
            value: Float::new(0.0),
            dtype: DType::F32,
        },
        Kind::Reshape => Op::Reshape {
            shape: Shape::scalar(),
        },
        Kind::Permute => Op::Permute { perm: vec![] },
        Kind::Broadcast => Op::Broadcast {
            shape: Shape::scalar(),
        },
        Kind::Unary(u) => Op::Unary(u),
        Kind::Binary(b) => Op::Binary(b),
        Kind::Where => Op::Where,
        Kind::Compare(c) => Op::Compare(c),
        Kind::Cast => Op::Cast { to: DType::F32 },
        Kind::Reduce(op) => Op::Reduce { op, axis: 0 },
        Kind::MatMul => Op::MatMul,
        Kind::Gather => Op::Gather,
        Kind::ScatterAdd => Op::ScatterAdd { rows: d },
        Kind::Dropout => Op::Dropout {
            p: Float::new(0.0),
            stream: 0,
        },
        Kind::CausalMask => Op::CausalMask { q: d.clone(), k: d },
        Kind::PadMask => Op::PadMask { pad: 0 },
        Kind::Arange => Op::Arange {
            start: d.clone(),
            len: d,
        },
        Kind::OneHot => Op::OneHot { depth: d },
        Kind::Concat => Op::Concat { axis: 0 },
        Kind::Slice => Op::Slice {
            axis: 0,
            start: d.clone(),
            len: d,
        },
        Kind::Kernel(_) | Kind::Region | Kind::Proj(_) => return None,
    })
}

/// Whether a kind is an elementwise primitive (what regions are made of).
pub fn is_elementwise(k: Kind) -> bool {
    matches!(
        k,
        Kind::Unary(_)
            | Kind::Binary(_)
            | Kind::Where
            | Kind::Compare(_)
            | Kind::Cast
            | Kind::Dropout
    )
}

/// Whether a kind is one of the IR's primitives.
pub fn is_primitive(k: Kind) -> bool {
    !matches!(k, Kind::Kernel(_) | Kind::Region | Kind::Proj(_))
}

/// Splits an IR op into its kind and attribute leaves (in child order, after operands).
pub fn op_parts(op: &Op) -> (Kind, Vec<Attr>) {
    match op {
        Op::Input { .. } | Op::Param { .. } => unreachable!("sources are added by to_egraph"),
        Op::Const { value, dtype } => (Kind::Const, vec![Attr::F(*value), Attr::DType(*dtype)]),
        Op::Reshape { shape } => (Kind::Reshape, vec![Attr::Shape(shape.clone())]),
        Op::Permute { perm } => (Kind::Permute, vec![Attr::Perm(perm.clone())]),
        Op::Broadcast { shape } => (Kind::Broadcast, vec![Attr::Shape(shape.clone())]),
        Op::Unary(u) => (Kind::Unary(*u), vec![]),
        Op::Binary(b) => (Kind::Binary(*b), vec![]),
        Op::Where => (Kind::Where, vec![]),
        Op::Compare(c) => (Kind::Compare(*c), vec![]),
        Op::Cast { to } => (Kind::Cast, vec![Attr::DType(*to)]),
        Op::Reduce { op, axis } => (Kind::Reduce(*op), vec![Attr::Axis(*axis)]),
        Op::MatMul => (Kind::MatMul, vec![]),
        Op::Gather => (Kind::Gather, vec![]),
        Op::ScatterAdd { rows } => (Kind::ScatterAdd, vec![Attr::Dim(rows.clone())]),
        Op::Dropout { p, stream } => (
            Kind::Dropout,
            vec![Attr::F(*p), Attr::Int(i64::from(*stream))],
        ),
        Op::CausalMask { q, k } => (
            Kind::CausalMask,
            vec![Attr::Dim(q.clone()), Attr::Dim(k.clone())],
        ),
        Op::PadMask { pad } => (Kind::PadMask, vec![Attr::Int(*pad)]),
        Op::Arange { start, len } => (
            Kind::Arange,
            vec![Attr::Dim(start.clone()), Attr::Dim(len.clone())],
        ),
        Op::OneHot { depth } => (Kind::OneHot, vec![Attr::Dim(depth.clone())]),
        Op::Concat { axis } => (Kind::Concat, vec![Attr::Axis(*axis)]),
        Op::Slice { axis, start, len } => (
            Kind::Slice,
            vec![
                Attr::Axis(*axis),
                Attr::Dim(start.clone()),
                Attr::Dim(len.clone()),
            ],
        ),
    }
}

/// How many trailing children of a primitive kind are attributes.
pub fn attr_count(k: Kind) -> usize {
    match k {
        Kind::Input | Kind::Param => 3,
        Kind::Const | Kind::Dropout | Kind::CausalMask | Kind::Arange => 2,
        Kind::Reshape
        | Kind::Permute
        | Kind::Broadcast
        | Kind::Cast
        | Kind::Reduce(_)
        | Kind::ScatterAdd
        | Kind::PadMask
        | Kind::OneHot
        | Kind::Concat => 1,
        Kind::Slice => 3,
        Kind::Region => 1,
        _ => 0,
    }
}

/// The attribute stored in a leaf e-class, if it is one.
pub fn attr_of(eg: &EG, id: Id) -> Option<&Attr> {
    eg[id].nodes.iter().find_map(|n| match n {
        KNode::Attr(a) => Some(a),
        _ => None,
    })
}

/// Rebuilds the IR op of a primitive e-node and returns it with its tensor operands.
pub fn node_op(eg: &EG, node: &KNode) -> Result<(Op, Vec<Id>), String> {
    let KNode::Op(kind, children) = node else {
        return Err("an attribute is not an op".to_string());
    };
    let kind = *kind;
    if !is_primitive(kind) {
        return Err(format!("{} is not a primitive", kind_name(kind)));
    }
    let n_attr = attr_count(kind);
    if children.len() < n_attr {
        return Err(format!("{} has too few children", kind_name(kind)));
    }
    let split = children.len() - n_attr;
    let attrs: Vec<&Attr> = children[split..]
        .iter()
        .map(|&c| {
            attr_of(eg, c)
                .ok_or_else(|| format!("{} has a non-attribute attribute", kind_name(kind)))
        })
        .collect::<Result<_, _>>()?;
    let bad = || format!("{} has malformed attributes {attrs:?}", kind_name(kind));
    let op = match (kind, attrs.as_slice()) {
        (Kind::Input, [Attr::Name(name), _, _]) => Op::Input { name: name.clone() },
        (Kind::Param, [Attr::Name(name), _, _]) => Op::Param {
            name: name.clone(),
            init: crate::ir::Init::Zeros,
        },
        (Kind::Const, [Attr::F(value), Attr::DType(dtype)]) => Op::Const {
            value: *value,
            dtype: *dtype,
        },
        (Kind::Reshape, [Attr::Shape(s)]) => Op::Reshape { shape: s.clone() },
        (Kind::Permute, [Attr::Perm(p)]) => Op::Permute { perm: p.clone() },
        (Kind::Broadcast, [Attr::Shape(s)]) => Op::Broadcast { shape: s.clone() },
        (Kind::Unary(u), []) => Op::Unary(u),
        (Kind::Binary(b), []) => Op::Binary(b),
        (Kind::Where, []) => Op::Where,
        (Kind::Compare(c), []) => Op::Compare(c),
        (Kind::Cast, [Attr::DType(to)]) => Op::Cast { to: *to },
        (Kind::Reduce(op), [Attr::Axis(axis)]) => Op::Reduce { op, axis: *axis },
        (Kind::MatMul, []) => Op::MatMul,
        (Kind::Gather, []) => Op::Gather,
        (Kind::ScatterAdd, [Attr::Dim(rows)]) => Op::ScatterAdd { rows: rows.clone() },
        (Kind::Dropout, [Attr::F(p), Attr::Int(stream)]) => Op::Dropout {
            p: *p,
            stream: u32::try_from(*stream).map_err(|_| bad())?,
        },
        (Kind::CausalMask, [Attr::Dim(q), Attr::Dim(k)]) => Op::CausalMask {
            q: q.clone(),
            k: k.clone(),
        },
        (Kind::PadMask, [Attr::Int(pad)]) => Op::PadMask { pad: *pad },
        (Kind::Arange, [Attr::Dim(start), Attr::Dim(len)]) => Op::Arange {
            start: start.clone(),
            len: len.clone(),
        },
        (Kind::OneHot, [Attr::Dim(depth)]) => Op::OneHot {
            depth: depth.clone(),
        },
        (Kind::Concat, [Attr::Axis(axis)]) => Op::Concat { axis: *axis },
        (Kind::Slice, [Attr::Axis(axis), Attr::Dim(start), Attr::Dim(len)]) => Op::Slice {
            axis: *axis,
            start: start.clone(),
            len: len.clone(),
        },
        _ => return Err(bad()),
    };
    Ok((op, children[..split].to_vec()))
}

/// Adds an attribute leaf.
pub fn add_attr(eg: &mut EG, a: Attr) -> Id {
    eg.add(KNode::Attr(a))
}

/// Adds a primitive op over operand e-classes.
pub fn add_op(eg: &mut EG, op: &Op, operands: &[Id]) -> Id {
    let (kind, attrs) = op_parts(op);
    let mut children = operands.to_vec();
    for a in attrs {
        children.push(add_attr(eg, a));
    }
    eg.add(KNode::Op(kind, children))
}

/// Adds a source (input or parameter) with its type.
pub fn add_source(eg: &mut EG, kind: Kind, name: &str, ty: &TensorType) -> Id {
    let children = vec![
        add_attr(eg, Attr::Name(name.to_string())),
        add_attr(eg, Attr::DType(ty.dtype)),
        add_attr(eg, Attr::Shape(ty.shape.clone())),
    ];
    eg.add(KNode::Op(kind, children))
}

/// The e-graph of a graph, and the e-class of each IR node (by node index).
pub fn to_egraph(g: &Graph) -> (EG, Vec<Id>) {
    let mut eg = EG::new(Types::default());
    let mut class = Vec::with_capacity(g.len());
    for node in &g.nodes {
        let id = match &node.op {
            Op::Input { name } => add_source(&mut eg, Kind::Input, name, &node.ty),
            Op::Param { name, .. } => add_source(&mut eg, Kind::Param, name, &node.ty),
            op => {
                let operands: Vec<Id> = node.inputs.iter().map(|i| class[i.index()]).collect();
                add_op(&mut eg, op, &operands)
            }
        };
        class.push(id);
    }
    eg.rebuild();
    (eg, class)
}

/// Every primitive kind (for parsing pattern text).
fn primitive_kinds() -> Vec<Kind> {
    use UnaryOp::*;
    let mut v = vec![
        Kind::Input,
        Kind::Param,
        Kind::Const,
        Kind::Reshape,
        Kind::Permute,
        Kind::Broadcast,
        Kind::Where,
        Kind::Cast,
        Kind::MatMul,
        Kind::Gather,
        Kind::ScatterAdd,
        Kind::Dropout,
        Kind::CausalMask,
        Kind::PadMask,
        Kind::Arange,
        Kind::OneHot,
        Kind::Concat,
        Kind::Slice,
        Kind::Reduce(ReduceOp::Sum),
        Kind::Reduce(ReduceOp::Max),
    ];
    v.extend(
        [
            Neg, Exp, Log, Sqrt, Recip, Relu, Sin, Cos, Tanh, Sigmoid, Erf, Rsqrt, Silu,
        ]
        .map(Kind::Unary),
    );
    v.extend(
        [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Max,
        ]
        .map(Kind::Binary),
    );
    v.extend(
        [
            CmpOp::Eq,
            CmpOp::Ne,
            CmpOp::Lt,
            CmpOp::Le,
            CmpOp::Gt,
            CmpOp::Ge,
        ]
        .map(Kind::Compare),
    );
    v
}

/// Pattern text: primitives by their IR names (`(permute (permute ?x ?p) ?q)`); leaves
/// `f32`/`i32`/`bool` are dtypes, `#1.5` a float.
impl egg::FromOp for KNode {
    type Error = String;

    fn from_op(op: &str, children: Vec<Id>) -> Result<Self, String> {
        if children.is_empty() {
            if let Some(d) = DType::parse(op) {
                return Ok(KNode::Attr(Attr::DType(d)));
            }
            if let Some(x) = op.strip_prefix('#') {
                let v: f64 = x.parse().map_err(|_| format!("bad float `{op}`"))?;
                return Ok(KNode::Attr(Attr::F(Float::new(v))));
            }
        }
        primitive_kinds()
            .into_iter()
            .find(|&k| kind_name(k) == op)
            .map(|k| KNode::Op(k, children))
            .ok_or_else(|| format!("unknown op `{op}` in a pattern"))
    }
}
