//! The tensor graph IR.
//!
//! In: primitive ops added one at a time by a front end (the DSL elaborator, autodiff).
//! Out: a [`Graph`] — a DAG of [`Node`]s in topological order, each with a checked
//! [`TensorType`] (dtype + symbolic [`Shape`]), plus the graph's signature: its symbolic
//! dims, inputs, parameters and named outputs.
//!
//! The primitive set is deliberately small (DESIGN §3): sources (inputs, parameters,
//! scalar constants), views (`reshape`, `permute`, `broadcast`), elementwise ops, two
//! reductions, a batched `matmul`, `gather`/`scatter_add`, `dropout` (counter-based RNG),
//! the `causal`/`padding` masks, and `arange`/`one_hot`/`concat`. Every layer of the
//! prelude is written on top of these; fusing them back into kernels is the optimizer's
//! job, never the front end's.
//!
//! Elementwise ops take operands of identical shape: broadcasting is always an explicit
//! `broadcast` node, so later passes see every implicit copy.
//!
//! [`Graph::add`] hash-conses: adding an op that already exists with the same inputs
//! returns the existing node. Nodes carry the scope of the layer instance that made them
//! (`encoder.layers.0.self_attn`), which names kernels and diagnostics later on.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dedup::Dedup;
use crate::infer::infer_type;
use crate::shape::{Dim, Shape};

/// Element types. `F32` is the working precision; `BF16`/`F16` are for the CUDA
/// mixed-precision path; `I32` holds token ids and indices; `Bool` holds masks.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub enum DType {
    F32,
    BF16,
    F16,
    I32,
    Bool,
}

impl DType {
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::Bool => "bool",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            "f16" => DType::F16,
            "i32" => DType::I32,
            "bool" => DType::Bool,
            _ => return None,
        })
    }

    pub const ALL: [DType; 5] = [DType::F32, DType::BF16, DType::F16, DType::I32, DType::Bool];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A dtype and a symbolic shape.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Shape) -> TensorType {
        TensorType { dtype, shape }
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

impl fmt::Debug for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

/// An `f64` that can be hashed and compared by its bits (attributes must be hashable).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Float(u64);

impl Float {
    pub fn new(v: f64) -> Float {
        // One zero: -0.0 and 0.0 mean the same attribute.
        Float(if v == 0.0 {
            0.0f64.to_bits()
        } else {
            v.to_bits()
        })
    }
    pub fn get(self) -> f64 {
        f64::from_bits(self.0)
    }
}

impl fmt::Display for Float {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_f64(self.get(), f)
    }
}

impl fmt::Debug for Float {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_f64(self.get(), f)
    }
}

/// Shortest round-trip text of a float, always with a `.` or exponent so it reads as one.
pub fn fmt_f64(v: f64, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    if v.is_infinite() {
        return f.write_str(if v > 0.0 { "inf" } else { "-inf" });
    }
    if v.is_nan() {
        return f.write_str("nan");
    }
    let s = format!("{v}");
    if s.contains(['.', 'e', 'E']) {
        f.write_str(&s)
    } else {
        write!(f, "{s}.0")
    }
}

/// How a parameter is initialized (see `kiln_compiler::init`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Init {
    Zeros,
    Ones,
    Constant(Float),
    /// Glorot & Bengio: U(-a, a) with a = sqrt(6 / (fan_in + fan_out)).
    XavierUniform,
    Normal {
        std: Float,
    },
    Uniform {
        a: Float,
    },
}

impl fmt::Display for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Zeros => write!(f, "zeros"),
            Init::Ones => write!(f, "ones"),
            Init::Constant(v) => write!(f, "constant({v})"),
            Init::XavierUniform => write!(f, "xavier_uniform"),
            Init::Normal { std } => write!(f, "normal(std={std})"),
            Init::Uniform { a } => write!(f, "uniform(a={a})"),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Recip,
    Relu,
    Sin,
    Cos,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Max,
}

/// Elementwise comparisons; the result is a bool tensor.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// A primitive operation. Attributes that fix an output shape (a reshape target, a mask
/// size) are part of the op; everything else follows from the inputs' types.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Op {
    /// A graph input, fed by the caller (`src`, `tgt_in`, …).
    Input {
        name: String,
    },
    /// A trainable parameter with a stable dotted name (`encoder.layers.0.self_attn.w_q`).
    Param {
        name: String,
        init: Init,
    },
    /// A scalar constant (shape `[]`); broadcast it to use it elementwise.
    Const {
        value: Float,
        dtype: DType,
    },
    /// Same elements, new shape (row-major); element counts must agree.
    Reshape {
        shape: Shape,
    },
    /// Axis permutation: output axis `i` is input axis `perm[i]`.
    Permute {
        perm: Vec<usize>,
    },
    /// Numpy-style broadcast to `shape` (right-aligned; size-1 or missing axes expand).
    Broadcast {
        shape: Shape,
    },
    Unary(UnaryOp),
    /// Two operands of identical type.
    Binary(BinaryOp),
    /// `where(cond, a, b)`: `cond` is bool, `a` and `b` share its shape and a dtype.
    Where,
    /// Two operands of identical type compared elementwise; the result is bool.
    Compare(CmpOp),
    Cast {
        to: DType,
    },
    /// Reduction over one axis, which is kept with size 1.
    Reduce {
        op: ReduceOp,
        axis: usize,
    },
    /// `[..., m, k] x [..., k, n] -> [..., m, n]`; the right operand may also be a plain
    /// `[k, n]` matrix shared by every batch entry.
    MatMul,
    /// `gather(table[V, D...], ids[I...]) -> [I..., D...]` (embedding lookup).
    Gather,
    /// `scatter_add(ids[I...], src[I..., D...]) -> [rows, D...]`, the gradient of gather.
    ScatterAdd {
        rows: Dim,
    },
    /// Inverted dropout: keep with probability `1 - p`, scale kept values by `1/(1-p)`.
    /// The mask is drawn from Philox keyed by (seed, step, `stream`, element index).
    Dropout {
        p: Float,
        stream: u32,
    },
    /// `[q, k]` bool: query `i` may see key `j` iff `j <= i + (k - q)`.
    CausalMask {
        q: Dim,
        k: Dim,
    },
    /// Same shape as the ids, true where the id is not `pad`.
    PadMask {
        pad: i64,
    },
    /// `[len]` i32: start, start + 1, …, start + len - 1.
    Arange {
        start: Dim,
        len: Dim,
    },
    /// `ids[I...] -> f32[I..., depth]`, 1.0 at the id.
    OneHot {
        depth: Dim,
    },
    /// Concatenation along `axis`; all other dims agree.
    Concat {
        axis: usize,
    },
    /// Elements `start .. start + len` along `axis` (the gradient of `concat`; also how a
    /// key/value cache is read).
    Slice {
        axis: usize,
        start: Dim,
        len: Dim,
    },
}

impl Op {
    /// The op's name in the text form (`add`, `matmul`, …).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param { .. } => "param",
            Op::Const { .. } => "const",
            Op::Reshape { .. } => "reshape",
            Op::Permute { .. } => "permute",
            Op::Broadcast { .. } => "broadcast",
            Op::Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Exp => "exp",
                UnaryOp::Log => "log",
                UnaryOp::Sqrt => "sqrt",
                UnaryOp::Recip => "recip",
                UnaryOp::Relu => "relu",
                UnaryOp::Sin => "sin",
                UnaryOp::Cos => "cos",
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::Max => "max",
            },
            Op::Where => "where",
            Op::Compare(c) => match c {
                CmpOp::Eq => "eq",
                CmpOp::Ne => "ne",
                CmpOp::Lt => "lt",
                CmpOp::Le => "le",
                CmpOp::Gt => "gt",
                CmpOp::Ge => "ge",
            },
            Op::Cast { .. } => "cast",
            Op::Reduce { op, .. } => match op {
                ReduceOp::Sum => "sum",
                ReduceOp::Max => "reduce_max",
            },
            Op::MatMul => "matmul",
            Op::Gather => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::Dropout { .. } => "dropout",
            Op::CausalMask { .. } => "causal_mask",
            Op::PadMask { .. } => "pad_mask",
            Op::Arange { .. } => "arange",
            Op::OneHot { .. } => "one_hot",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
        }
    }

    /// How many inputs the op takes (`None`: one or more).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Input { .. }
            | Op::Param { .. }
            | Op::Const { .. }
            | Op::CausalMask { .. }
            | Op::Arange { .. } => 0,
            Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::Broadcast { .. }
            | Op::Unary(_)
            | Op::Cast { .. }
            | Op::Reduce { .. }
            | Op::Dropout { .. }
            | Op::PadMask { .. }
            | Op::OneHot { .. }
            | Op::Slice { .. } => 1,
            Op::Binary(_) | Op::Compare(_) | Op::MatMul | Op::Gather | Op::ScatterAdd { .. } => 2,
            Op::Where => 3,
            Op::Concat { .. } => return None,
        })
    }

    /// Ops that are views or elementwise over their operand(s).
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::Compare(_)
                | Op::Where
                | Op::Cast { .. }
                | Op::Dropout { .. }
        )
    }
}

/// A node id: the index of the node in [`Graph::nodes`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One operation in the graph.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub ty: TensorType,
    /// The layer instance that created the node (`encoder.layers.0.ffn`), `""` at top;
    /// shared with the nodes around it that have the same scope.
    pub scope: Arc<str>,
}

/// An error found while building or checking a graph.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IrError {
    /// The operand types do not fit the op; the message says how.
    #[error("{0}")]
    Type(String),
    /// Two sources with one name.
    #[error("{kind} `{name}` is defined twice")]
    Duplicate { kind: &'static str, name: String },
    /// A structural problem (bad node reference, wrong arity, unknown output).
    #[error("malformed graph: {0}")]
    Malformed(String),
}

/// A parameter table read at positions along a dim ([`Graph::position_table`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PositionTable {
    /// The parameter's name (`tgt_pos.table`).
    pub param: String,
    /// Its rows: positions `0 .. rows` can be read.
    pub rows: usize,
}

/// Inputs and outputs named `cache.<scope>.<name>` carry a decoder's key/value cache:
/// the input holds the previous positions, the output of the same name all of them.
pub const CACHE_PREFIX: &str = "cache.";

/// A named graph output.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Output {
    pub name: String,
    pub node: NodeId,
}

/// A tensor graph: nodes in topological order plus the graph's signature.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Graph {
    /// The model the graph was elaborated from.
    pub name: String,
    /// Symbolic dims, in declaration order.
    pub dims: Vec<String>,
    pub nodes: Vec<Node>,
    /// Input nodes in declaration order.
    pub inputs: Vec<NodeId>,
    /// Parameter nodes in creation order.
    pub params: Vec<NodeId>,
    pub outputs: Vec<Output>,
    /// The output that is the training objective (a scalar), if the model declares one.
    pub objective: Option<String>,
    /// Outputs that mark a pipeline stage (`stage memory = ...`): the `encode` entry point
    /// computes them; `decode_step` takes them as inputs.
    #[serde(default)]
    pub stages: Vec<String>,
    /// The model's parameters after overrides, as text (`d_model` → `512`): metadata
    /// for the runtime (the learning-rate schedule reads `d_model`) and for artifacts.
    #[serde(default)]
    pub hparams: Vec<(String, String)>,
    #[serde(skip)]
    dedup: Dedup,
    /// The names of `params`, for [`Graph::add_param`]'s duplicate check (a search of
    /// `params` made elaborating `repeat(n, …)` quadratic in `n`); rebuilt from `params`
    /// when they differ in number (a graph read back, or `params` set directly).
    #[serde(skip)]
    param_names: std::collections::HashSet<String>,
}

impl Graph {
    pub fn new(name: &str) -> Graph {
        Graph {
            name: name.to_string(),
            ..Graph::default()
        }
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn ty(&self, id: NodeId) -> &TensorType {
        &self.nodes[id.index()].ty
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Declares a symbolic dim (idempotent).
    pub fn add_dim(&mut self, name: &str) {
        if !self.dims.iter().any(|d| d == name) {
            self.dims.push(name.to_string());
        }
    }

    fn push(&mut self, op: Op, inputs: Vec<NodeId>, ty: TensorType, scope: &str) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        // A layer adds its nodes one after another, so the last node's scope is the
        // one to share.
        let scope = match self.nodes.last() {
            Some(last) if *last.scope == *scope => last.scope.clone(),
            _ => Arc::from(scope),
        };
        self.nodes.push(Node {
            op,
            inputs,
            ty,
            scope,
        });
        id
    }

    /// Declares a graph input.
    pub fn add_input(&mut self, name: &str, ty: TensorType) -> Result<NodeId, IrError> {
        if self.input(name).is_some() {
            return Err(IrError::Duplicate {
                kind: "input",
                name: name.to_string(),
            });
        }
        let id = self.push(
            Op::Input {
                name: name.to_string(),
            },
            vec![],
            ty,
            "",
        );
        self.inputs.push(id);
        Ok(id)
    }

    /// Declares a parameter. Parameter shapes must be concrete and floating point.
    pub fn add_param(
        &mut self,
        name: &str,
        ty: TensorType,
        init: Init,
        scope: &str,
    ) -> Result<NodeId, IrError> {
        if self.param_names.len() != self.params.len() {
            self.param_names = self
                .params
                .iter()
                .filter_map(|&p| match &self.nodes.get(p.index())?.op {
                    Op::Param { name, .. } => Some(name.clone()),
                    _ => None,
                })
                .collect();
        }
        if self.param_names.contains(name) {
            return Err(IrError::Duplicate {
                kind: "parameter",
                name: name.to_string(),
            });
        }
        if !ty.dtype.is_float() {
            return Err(IrError::Type(format!(
                "parameter `{name}` must be floating point, not {}",
                ty.dtype
            )));
        }
        if let Some(bad) = ty.shape.dims().iter().find(|d| !d.is_const()) {
            return Err(IrError::Type(format!(
                "parameter `{name}` has symbolic dim `{bad}`; parameter shapes must be numbers"
            )));
        }
        if let Some(bad) = ty
            .shape
            .dims()
            .iter()
            .find(|d| d.as_const().unwrap_or(0) <= 0)
        {
            return Err(IrError::Type(format!(
                "parameter `{name}` has dim {bad}; parameter dims must be positive"
            )));
        }
        let id = self.push(
            Op::Param {
                name: name.to_string(),
                init,
            },
            vec![],
            ty,
            scope,
        );
        self.params.push(id);
        self.param_names.insert(name.to_string());
        Ok(id)
    }

    /// Adds a scalar constant of `dtype`.
    pub fn add_const(&mut self, value: f64, dtype: DType) -> NodeId {
        let op = Op::Const {
            value: Float::new(value),
            dtype,
        };
        self.add(op, &[], "")
            .expect("a scalar constant is always well typed")
    }

    /// Adds a non-source op, inferring its type; returns an existing node for a repeat.
    pub fn add(&mut self, op: Op, inputs: &[NodeId], scope: &str) -> Result<NodeId, IrError> {
        if matches!(op, Op::Input { .. } | Op::Param { .. }) {
            return Err(IrError::Malformed(format!(
                "{} nodes are added with their own constructor",
                op.name()
            )));
        }
        for &i in inputs {
            if i.index() >= self.nodes.len() {
                return Err(IrError::Malformed(format!("operand {i} does not exist")));
            }
        }
        if let Some(id) = self.dedup.find(&self.nodes, &op, inputs) {
            return Ok(id);
        }
        let types: Vec<&TensorType> = inputs.iter().map(|&i| self.ty(i)).collect();
        let ty = infer_type(&op, &types)?;
        let id = self.push(op, inputs.to_vec(), ty, scope);
        self.dedup.insert(&self.nodes, id);
        Ok(id)
    }

    /// Names a node as a graph output.
    pub fn add_output(&mut self, name: &str, node: NodeId) -> Result<(), IrError> {
        if self.outputs.iter().any(|o| o.name == name) {
            return Err(IrError::Duplicate {
                kind: "output",
                name: name.to_string(),
            });
        }
        self.outputs.push(Output {
            name: name.to_string(),
            node,
        });
        Ok(())
    }

    pub fn input(&self, name: &str) -> Option<NodeId> {
        self.inputs
            .iter()
            .copied()
            .find(|&i| matches!(&self.node(i).op, Op::Input { name: n } if n == name))
    }

    pub fn param(&self, name: &str) -> Option<NodeId> {
        self.params
            .iter()
            .copied()
            .find(|&i| matches!(&self.node(i).op, Op::Param { name: n, .. } if n == name))
    }

    pub fn output(&self, name: &str) -> Option<NodeId> {
        self.outputs.iter().find(|o| o.name == name).map(|o| o.node)
    }

    /// The name of an input or parameter node.
    pub fn source_name(&self, id: NodeId) -> Option<&str> {
        match &self.node(id).op {
            Op::Input { name } | Op::Param { name, .. } => Some(name),
            _ => None,
        }
    }

    /// Total number of parameter elements (parameter shapes are concrete); `u64::MAX`
    /// where that does not fit in 64 bits.
    pub fn num_parameters(&self) -> u64 {
        self.params
            .iter()
            .map(|&p| {
                self.ty(p)
                    .shape
                    .as_consts()
                    .map(|s| s.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64)))
                    .unwrap_or(0)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// A model parameter's value as text, if the graph records it.
    pub fn hparam(&self, name: &str) -> Option<&str> {
        self.hparams
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The smallest parameter table the graph reads at the positions of `dim`: a `gather`
    /// of a `[rows, …]` parameter at `arange(start, len = dim)`, as a learned positional
    /// embedding is read. Positions `start .. start + dim` must stay below its `rows`.
    /// `None` when no parameter is indexed by positions along `dim` (a sinusoidal
    /// encoding computes its values and has no such limit).
    pub fn position_table(&self, dim: &str) -> Option<PositionTable> {
        self.nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Gather) && n.inputs.len() == 2)
            .filter_map(|n| {
                let Op::Param { name, .. } = &self.node(n.inputs[0]).op else {
                    return None;
                };
                let Op::Arange { len, .. } = &self.node(n.inputs[1]).op else {
                    return None;
                };
                if len.as_sym() != Some(dim) {
                    return None;
                }
                let rows = self.ty(n.inputs[0]).shape.dims().first()?.as_const()?;
                Some(PositionTable {
                    param: name.clone(),
                    rows: usize::try_from(rows).ok()?,
                })
            })
            .min_by(|a, b| a.rows.cmp(&b.rows).then_with(|| a.param.cmp(&b.param)))
    }

    /// Names of the model's own outputs: not the objective, not a stage, not a cache.
    pub fn forward_outputs(&self) -> Vec<String> {
        self.outputs
            .iter()
            .filter(|o| {
                Some(&o.name) != self.objective.as_ref()
                    && !self.stages.contains(&o.name)
                    && !o.name.starts_with(CACHE_PREFIX)
            })
            .map(|o| o.name.clone())
            .collect()
    }

    /// Names of the key/value cache outputs of a `decode_step` graph; each is also the
    /// name of the input that takes the previous step's value.
    pub fn cache_outputs(&self) -> Vec<String> {
        self.outputs
            .iter()
            .filter(|o| o.name.starts_with(CACHE_PREFIX))
            .map(|o| o.name.clone())
            .collect()
    }

    /// A new graph in which each node of `replace` is an input of the given name (what it
    /// read is no longer needed for it), with the same outputs, pruned to them: nodes only
    /// the replaced ones read are dropped.
    pub fn replace_with_inputs(&self, replace: &[(NodeId, String)]) -> Result<Graph, IrError> {
        let by_node: BTreeMap<NodeId, &str> =
            replace.iter().map(|(id, n)| (*id, n.as_str())).collect();
        let mut g = Graph::new(&self.name);
        g.dims = self.dims.clone();
        let mut remap: Vec<NodeId> = Vec::with_capacity(self.nodes.len());
        for (i, node) in self.nodes.iter().enumerate() {
            let new = match (by_node.get(&NodeId(i as u32)), &node.op) {
                (Some(name), _) => g.add_input(name, node.ty.clone())?,
                (None, Op::Input { name }) => g.add_input(name, node.ty.clone())?,
                (None, Op::Param { name, init }) => {
                    g.add_param(name, node.ty.clone(), *init, &node.scope)?
                }
                (None, op) => {
                    let inputs: Vec<NodeId> =
                        node.inputs.iter().map(|x| remap[x.index()]).collect();
                    let id = g.push(op.clone(), inputs, node.ty.clone(), &node.scope);
                    g.dedup.insert(&g.nodes, id);
                    id
                }
            };
            remap.push(new);
        }
        for o in &self.outputs {
            g.outputs.push(Output {
                name: o.name.clone(),
                node: remap[o.node.index()],
            });
        }
        g.objective = self.objective.clone();
        g.hparams = self.hparams.clone();
        g.stages = self.stages.clone();
        let names: Vec<String> = self.outputs.iter().map(|o| o.name.clone()).collect();
        g.prune(&names)
    }

    /// A new graph with only the named outputs and the nodes they need, renumbered in the
    /// same relative order. Inputs and parameters they do not use are dropped.
    pub fn prune(&self, outputs: &[String]) -> Result<Graph, IrError> {
        let mut live = vec![false; self.nodes.len()];
        let mut stack = Vec::new();
        for name in outputs {
            let id = self.output(name).ok_or_else(|| {
                IrError::Malformed(format!(
                    "no output named `{name}` (outputs: {})",
                    self.outputs
                        .iter()
                        .map(|o| o.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            stack.push(id);
        }
        while let Some(id) = stack.pop() {
            if !live[id.index()] {
                live[id.index()] = true;
                stack.extend(self.node(id).inputs.iter().copied());
            }
        }
        let mut remap: BTreeMap<NodeId, NodeId> = BTreeMap::new();
        let mut out = Graph::new(&self.name);
        out.dims = self.dims.clone();
        for (i, node) in self.nodes.iter().enumerate() {
            if !live[i] {
                continue;
            }
            let new_id = NodeId(out.nodes.len() as u32);
            remap.insert(NodeId(i as u32), new_id);
            let inputs: Vec<NodeId> = node.inputs.iter().map(|x| remap[x]).collect();
            out.nodes.push(Node {
                op: node.op.clone(),
                inputs,
                ty: node.ty.clone(),
                scope: node.scope.clone(),
            });
            out.dedup.insert(&out.nodes, new_id);
        }
        out.inputs = self
            .inputs
            .iter()
            .filter_map(|i| remap.get(i).copied())
            .collect();
        out.params = self
            .params
            .iter()
            .filter_map(|i| remap.get(i).copied())
            .collect();
        for name in outputs {
            let node = remap[&self.output(name).expect("checked above")];
            out.outputs.push(Output {
                name: name.clone(),
                node,
            });
        }
        out.objective = self
            .objective
            .clone()
            .filter(|o| outputs.iter().any(|n| n == o));
        out.hparams = self.hparams.clone();
        out.stages = self
            .stages
            .iter()
            .filter(|s| outputs.iter().any(|n| n == *s))
            .cloned()
            .collect();
        Ok(out)
    }

    /// Re-checks every node: operands exist and come earlier, arities hold, and each
    /// node's type is what inference says. Passes that rewrite graphs call this.
    pub fn verify(&self) -> Result<(), IrError> {
        for (i, node) in self.nodes.iter().enumerate() {
            let here = NodeId(i as u32);
            for &inp in &node.inputs {
                if inp.index() >= i {
                    return Err(IrError::Malformed(format!(
                        "{here} uses {inp}, which does not come before it"
                    )));
                }
            }
            match &node.op {
                Op::Input { .. } | Op::Param { .. } => {
                    if !node.inputs.is_empty() {
                        return Err(IrError::Malformed(format!(
                            "{here} is a source with operands"
                        )));
                    }
                }
                op => {
                    let types: Vec<&TensorType> = node.inputs.iter().map(|&x| self.ty(x)).collect();
                    let ty = infer_type(op, &types)
                        .map_err(|e| IrError::Malformed(format!("{here} ({}): {e}", op.name())))?;
                    if ty != node.ty {
                        return Err(IrError::Malformed(format!(
                            "{here} ({}) is typed {} but its operands give {}",
                            op.name(),
                            node.ty,
                            ty
                        )));
                    }
                }
            }
        }
        for o in &self.outputs {
            if o.node.index() >= self.nodes.len() {
                return Err(IrError::Malformed(format!(
                    "output `{}` points nowhere",
                    o.name
                )));
            }
        }
        // The signature's lists: each entry an input (a parameter) node, listed once.
        for (list, a, ids) in [
            ("input", "an", &self.inputs),
            ("parameter", "a", &self.params),
        ] {
            let mut seen = std::collections::HashSet::new();
            for (k, &id) in ids.iter().enumerate() {
                let Some(node) = self.nodes.get(id.index()) else {
                    return Err(IrError::Malformed(format!(
                        "{list} list entry {k} is {id}, which points nowhere (the graph has {} \
                         nodes)",
                        self.nodes.len()
                    )));
                };
                let kind_ok = match &node.op {
                    Op::Input { .. } => list == "input",
                    Op::Param { .. } => list == "parameter",
                    _ => false,
                };
                if !kind_ok {
                    return Err(IrError::Malformed(format!(
                        "{list} list entry {k} is {id}, a `{}` node, not {a} {list}",
                        node.op.name()
                    )));
                }
                if !seen.insert(id) {
                    return Err(IrError::Malformed(format!(
                        "{id} is listed twice as {a} {list}"
                    )));
                }
            }
        }
        Ok(())
    }
}
