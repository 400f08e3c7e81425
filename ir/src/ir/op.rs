//! Element types, tensor types and the primitive ops.

use std::fmt;

use serde::{Deserialize, Serialize};

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
    Tanh,
    /// `1 / (1 + exp(-x))`.
    Sigmoid,
    /// The error function, `2/√π ∫₀ˣ exp(-t²) dt`.
    Erf,
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// `x · sigmoid(x)` (SiLU, "swish").
    Silu,
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

impl CmpOp {
    /// The operator as C, Rust and the DSL write it (`==`, `<`, …).
    pub fn symbol(self) -> &'static str {
        match self {
            CmpOp::Eq => "==",
            CmpOp::Ne => "!=",
            CmpOp::Lt => "<",
            CmpOp::Le => "<=",
            CmpOp::Gt => ">",
            CmpOp::Ge => ">=",
        }
    }

    /// Whether `a op b` holds.
    pub fn holds<T: PartialOrd + ?Sized>(self, a: &T, b: &T) -> bool {
        match self {
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
        }
    }

    /// Whether this is `==` or `!=`, the comparisons defined on every kind of value.
    pub fn is_equality(self) -> bool {
        matches!(self, CmpOp::Eq | CmpOp::Ne)
    }
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
                UnaryOp::Tanh => "tanh",
                UnaryOp::Sigmoid => "sigmoid",
                UnaryOp::Erf => "erf",
                UnaryOp::Rsqrt => "rsqrt",
                UnaryOp::Silu => "silu",
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
