//! The reference executor: the oracle every optimized path is tested against.
//!
//! In: any [`Graph`], host tensors for its inputs and parameters, and [`RunOptions`]
//! (working precision, seed, step). Out: the values of the graph's outputs ([`run`]) or of
//! any requested nodes ([`run_nodes`]), as host [`Tensor`]s.
//!
//! Everything is plain row-major loops, written to be obviously correct rather than fast.
//! Only the nodes the requested values need are computed, in graph order, and each buffer
//! is dropped after its last use.
//!
//! # Precision
//!
//! Float tensors are computed in `f32` ([`Precision::F32`]) or `f64`
//! ([`Precision::F64`]) — the same code, generic over the float type — and come back as
//! `F32` or `F64` tensors respectively. `i32` values come back as `I32`, `bool` as `Bool`.
//! `bf16`/`f16` values are not supported here (an error names the node).
//!
//! # Binding
//!
//! (The checks live in [`crate::bind`], shared with the other executors, so every
//! executor accepts the same tensors and reports the same errors.)
//!
//! - Every graph input must be given (tensors with other names are ignored). An `i32`
//!   input takes `I32` or `I64` tensors (every `I64` value must fit in i32); a float
//!   input takes `F32` or `F64` tensors in either precision (converted to the working
//!   precision: widening is exact, narrowing rounds to nearest); a `bool` input takes
//!   `Bool`.
//! - Ranks must match. An axis whose dim is a single symbol (`batch`) binds that symbol;
//!   two inputs that disagree on it are an error naming both. Constant dims must match
//!   exactly. Composite dims (`t + 1`) are evaluated once every input is bound and
//!   checked. Every node's shape is then its symbolic shape evaluated under these
//!   bindings.
//! - Every parameter the requested values need must be given with exactly its shape and
//!   a float dtype (`F32` or `F64`, converted as for inputs); other tensors are ignored.
//!
//! # Semantics (see the op docs in [`crate::ir`])
//!
//! - `i32` `add`/`sub`/`mul`/`neg` and `sum` wrap on overflow.
//! - `max` and `reduce_max` propagate NaN; `relu(NaN)` is NaN; `reduce_max` over an
//!   empty axis is `-inf` (`i32::MIN` for i32), `sum` over an empty axis is 0.
//! - `cast` float→i32 truncates toward zero and saturates (NaN becomes 0); bool→number
//!   is 0/1; number→bool is `x != 0` (so NaN is true); i32→float rounds to nearest.
//! - `sum` and `matmul` accumulate sequentially (in index order) in the working
//!   precision, starting from 0, without fused multiply-add.
//! - `dropout`: element `i` is kept iff [`rng::dropout_keep`]`(seed, step, stream, i,
//!   dropout_threshold(p))`; a kept value is `x * s` where `s = 1/(1-p)` is computed in
//!   f64 and then rounded to the working precision; a dropped value is 0 (even if `x` is
//!   NaN or infinite).
//! - `gather`, `scatter_add` and `one_hot` report an id outside their range as an error
//!   naming the node, the id and the range.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::{Add, Div, Mul, Neg, Sub};

use crate::bind::{check_id, fmt_dims, liveness, Binder, Source};
use crate::ir::{BinaryOp, CmpOp, DType, Graph, IrError, NodeId, Op, ReduceOp, UnaryOp};
use crate::rng;
use crate::tensor::{Feeds, Outputs, Tensor, TensorData};

mod ops;

use ops::*;

/// The working precision of float values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    F32,
    F64,
}

/// How to run a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RunOptions {
    pub precision: Precision,
    /// The run's seed (the Philox key for dropout).
    pub seed: u64,
    /// The training step (a Philox counter word for dropout).
    pub step: u32,
    /// A promise about the parameters: runs given the same `Some(version)` are given the
    /// same parameter values (same names, same tensors, unchanged contents), so an
    /// executor that copies parameters to a device may keep the copies between them.
    /// `None` (the default): no promise, every run reads its parameters afresh.
    pub params_version: Option<u64>,
}

/// Why a graph could not be run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    #[error("missing input `{name}`; the graph expects the inputs {expected}")]
    MissingInput { name: String, expected: String },
    #[error("input `{name}` {message}")]
    Input { name: String, message: String },
    #[error(
        "dim `{dim}` is {first_value} in input `{first}` (axis {first_axis}) but \
         {second_value} in input `{second}` (axis {second_axis}); inputs must agree on \
         every dim they share"
    )]
    DimConflict {
        dim: String,
        first: String,
        first_axis: usize,
        first_value: usize,
        second: String,
        second_axis: usize,
        second_value: usize,
    },
    #[error("parameter `{name}` {message}")]
    Param { name: String, message: String },
    /// A node could not be computed; `node` reads like `%12 gather in scope `emb``.
    #[error("{node}: {message}")]
    Node { node: String, message: String },
    #[error("node {id} was requested, but the graph has only {len} nodes")]
    NoSuchNode { id: NodeId, len: usize },
    #[error("cannot run a malformed graph: {0}")]
    Graph(#[from] IrError),
    /// An executor cannot honour a run option (the eager executor runs in f32 only).
    #[error("{0}")]
    Unsupported(String),
    /// A run needs more memory than the machine leaves it ([`crate::memory::ensure`]).
    #[error(transparent)]
    Memory(#[from] crate::memory::OutOfMemory),
}

/// Runs `graph` and returns every output in `graph.outputs` order, with its name.
pub fn run(
    graph: &Graph,
    inputs: &Feeds,
    params: &Feeds,
    opts: &RunOptions,
) -> Result<Outputs, ExecError> {
    let ids: Vec<NodeId> = graph.outputs.iter().map(|o| o.node).collect();
    let values = run_nodes(graph, inputs, params, opts, &ids)?;
    Ok(graph
        .outputs
        .iter()
        .map(|o| o.name.clone())
        .zip(values)
        .collect())
}

/// Runs `graph` and returns the values of `nodes`, in the order requested (intermediate
/// nodes included). Every graph input must still be given.
pub fn run_nodes(
    graph: &Graph,
    inputs: &Feeds,
    params: &Feeds,
    opts: &RunOptions,
    nodes: &[NodeId],
) -> Result<Vec<Tensor>, ExecError> {
    match opts.precision {
        Precision::F32 => Executor::<f32>::new(graph, inputs, params, opts)?.run(nodes),
        Precision::F64 => Executor::<f64>::new(graph, inputs, params, opts)?.run(nodes),
    }
}

// ---------------------------------------------------------------------------------------
// The working float type.

/// The float operations the executor needs, for `f32` and `f64`.
trait Real:
    Copy
    + PartialOrd
    + Debug
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
    fn erf(self) -> Self;
    fn is_nan(self) -> bool;
    /// The values as a host tensor of the matching dtype.
    fn into_data(v: Vec<Self>) -> TensorData;
}

/// `fn m(self) -> Self` for each method `m` of the float type `$t` of that name.
macro_rules! forward_float_methods {
    ($t:ty: $($m:ident),*) => {
        $(
            fn $m(self) -> Self {
                <$t>::$m(self)
            }
        )*
    };
}

macro_rules! impl_real {
    ($t:ty, $variant:ident, $erf:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            forward_float_methods!($t: exp, ln, sqrt, sin, cos, tanh);
            fn erf(self) -> Self {
                $erf(self)
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn into_data(v: Vec<Self>) -> TensorData {
                TensorData::$variant(v)
            }
        }
    };
}

impl_real!(f32, F32, libm::erff);
impl_real!(f64, F64, libm::erf);

/// NaN-propagating maximum.
fn fmax<T: Real>(a: T, b: T) -> T {
    if a.is_nan() {
        a
    } else if b.is_nan() || b > a {
        b
    } else {
        a
    }
}

// ---------------------------------------------------------------------------------------
// Values.

/// The elements of a computed value.
#[derive(Clone, Debug)]
enum Data<T> {
    F(Vec<T>),
    I(Vec<i32>),
    B(Vec<bool>),
}

impl<T: Real> Data<T> {
    fn len(&self) -> usize {
        match self {
            Data::F(v) => v.len(),
            Data::I(v) => v.len(),
            Data::B(v) => v.len(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Data::F(_) => "float",
            Data::I(_) => "i32",
            Data::B(_) => "bool",
        }
    }

    /// The elements at `idx`, in that order (every index must be in range).
    fn select(&self, idx: &[usize]) -> Data<T> {
        fn pick<E: Copy>(v: &[E], idx: &[usize]) -> Vec<E> {
            idx.iter().map(|&i| v[i]).collect()
        }
        match self {
            Data::F(v) => Data::F(pick(v, idx)),
            Data::I(v) => Data::I(pick(v, idx)),
            Data::B(v) => Data::B(pick(v, idx)),
        }
    }

    fn into_tensor_data(self) -> TensorData {
        match self {
            Data::F(v) => T::into_data(v),
            Data::I(v) => TensorData::I32(v),
            Data::B(v) => TensorData::Bool(v),
        }
    }
}

/// A computed value: a concrete shape and row-major elements.
#[derive(Clone, Debug)]
struct Buf<T> {
    shape: Vec<usize>,
    data: Data<T>,
}

/// The operands of an elementwise binary op, which must have the same shape.
fn same_shapes<'a, T>(x: &'a Buf<T>, y: &'a Buf<T>) -> NodeResult<(&'a Buf<T>, &'a Buf<T>)> {
    if x.shape != y.shape {
        return Err(format!(
            "operands have shapes {} and {}",
            fmt_dims(&x.shape),
            fmt_dims(&y.shape)
        ));
    }
    Ok((x, y))
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The multi-index of row-major position `flat` in `shape`.
fn unravel(mut flat: usize, shape: &[usize], out: &mut [usize]) {
    for i in (0..shape.len()).rev() {
        out[i] = flat % shape[i];
        flat /= shape[i];
    }
}

fn product(dims: &[usize]) -> usize {
    dims.iter().product()
}

// ---------------------------------------------------------------------------------------
// The executor.

struct Executor<'a, T> {
    graph: &'a Graph,
    opts: &'a RunOptions,
    /// The checked inputs and parameters, with every symbolic dim bound.
    bind: Binder<'a, 'a>,
    _float: std::marker::PhantomData<T>,
}

/// A node error: the message is completed by the caller with the node's label.
type NodeResult<V> = Result<V, String>;

impl<'a, T: Real> Executor<'a, T> {
    fn new(
        graph: &'a Graph,
        inputs: &'a BTreeMap<String, Tensor>,
        params: &'a BTreeMap<String, Tensor>,
        opts: &'a RunOptions,
    ) -> Result<Self, ExecError> {
        graph.verify()?;
        Ok(Executor {
            graph,
            opts,
            bind: Binder::new(graph, inputs, params, "the reference executor")?,
            _float: std::marker::PhantomData,
        })
    }

    /// Computes the requested nodes and everything they need.
    fn run(&self, requested: &[NodeId]) -> Result<Vec<Tensor>, ExecError> {
        let n = self.graph.len();
        for &id in requested {
            if id.index() >= n {
                return Err(ExecError::NoSuchNode { id, len: n });
            }
        }
        // Which nodes are needed, and the last node that reads each one.
        let (live, last_use) = liveness(self.graph, requested);
        let mut keep = vec![false; n];
        for &id in requested {
            keep[id.index()] = true;
        }

        let mut values: Vec<Option<Buf<T>>> = vec![None; n];
        for i in 0..n {
            if !live[i] {
                continue;
            }
            let id = NodeId(i as u32);
            let buf = self.eval(id, &values)?;
            values[i] = Some(buf);
            for inp in &self.graph.node(id).inputs {
                let j = inp.index();
                if last_use[j] == i && !keep[j] {
                    values[j] = None;
                }
            }
        }

        requested
            .iter()
            .map(|&id| {
                let buf = values[id.index()]
                    .clone()
                    .ok_or_else(|| self.node_err(id, "internal: value was freed".into()))?;
                Ok(Tensor {
                    shape: buf.shape,
                    data: buf.data.into_tensor_data(),
                })
            })
            .collect()
    }

    fn node_err(&self, id: NodeId, message: String) -> ExecError {
        self.bind.node_err(id, message)
    }

    /// Computes one node from its (already computed) operands.
    fn eval(&self, id: NodeId, values: &[Option<Buf<T>>]) -> Result<Buf<T>, ExecError> {
        let node = self.graph.node(id);
        let shape = self.bind.node_shape(id)?;
        let mut args: Vec<&Buf<T>> = Vec::with_capacity(node.inputs.len());
        for inp in &node.inputs {
            let v = values[inp.index()].as_ref().ok_or_else(|| {
                self.node_err(id, format!("internal: operand {inp} was not computed"))
            })?;
            args.push(v);
        }
        if !matches!(node.op, Op::Input { .. } | Op::Param { .. }) {
            // Every node gets a buffer of its own here (views included), of T per element
            // at most.
            let bytes = shape
                .iter()
                .try_fold(std::mem::size_of::<T>() as u64, |a, &d| {
                    a.checked_mul(d as u64)
                })
                .unwrap_or(u64::MAX);
            crate::memory::ensure_node(
                bytes,
                "the reference executor",
                node,
                &shape,
                &self.bind.dims,
            )?;
        }
        let data = match &node.op {
            Op::Input { name } => source_data(self.bind.input(id, name)?),
            Op::Param { name, .. } => source_data(self.bind.param(id, name, &shape)?),
            op => self
                .compute(op, &args, &shape)
                .map_err(|m| self.node_err(id, m))?,
        };
        if data.len() != product(&shape) {
            return Err(self.node_err(
                id,
                format!(
                    "internal: computed {} elements for shape {}",
                    data.len(),
                    fmt_dims(&shape)
                ),
            ));
        }
        Ok(Buf { shape, data })
    }

    /// Computes a non-source op. Errors are completed with the node's label by the caller.
    fn compute(&self, op: &Op, args: &[&Buf<T>], shape: &[usize]) -> NodeResult<Data<T>> {
        let numel = product(shape);
        Ok(match op {
            Op::Input { .. } | Op::Param { .. } => {
                return Err("internal: sources are bound, not computed".into())
            }
            Op::Const { value, dtype } => {
                let v = value.get();
                match dtype {
                    DType::I32 => Data::I(vec![v as i32]),
                    DType::Bool => Data::B(vec![v != 0.0]),
                    _ => Data::F(vec![T::from_f64(v)]),
                }
            }
            Op::Reshape { .. } => {
                let x = args[0];
                if product(&x.shape) != numel {
                    return Err(format!(
                        "cannot reshape {} into {}",
                        fmt_dims(&x.shape),
                        fmt_dims(shape)
                    ));
                }
                x.data.clone()
            }
            Op::Permute { perm } => permute(args, shape, perm)?,
            Op::Broadcast { .. } => broadcast(args, shape)?,
            Op::Unary(u) => unary(*u, &args[0].data)?,
            Op::Binary(b) => {
                let (x, y) = same_shapes(args[0], args[1])?;
                binary(*b, &x.data, &y.data)?
            }
            Op::Compare(c) => {
                let (x, y) = same_shapes(args[0], args[1])?;
                compare(*c, &x.data, &y.data)?
            }
            Op::Slice { axis, start, .. } => slice(args, shape, (axis, start), &self.bind.dims)?,
            Op::Where => select(args)?,
            Op::Cast { to } => cast(&args[0].data, *to),
            Op::Reduce { op, axis } => reduce(*op, *axis, args[0])?,
            Op::MatMul => matmul(args[0], args[1])?,
            Op::Gather => gather(args)?,
            Op::ScatterAdd { .. } => scatter_add(args, shape)?,
            Op::Dropout { p, stream } => dropout(args, (p.get(), *stream), self.opts)?,
            Op::CausalMask { .. } => causal_mask(shape)?,
            Op::PadMask { pad } => {
                let Data::I(ids) = &args[0].data else {
                    return Err(format!("ids are {}, not i32", args[0].data.kind()));
                };
                Data::B(ids.iter().map(|&id| i64::from(id) != *pad).collect())
            }
            Op::Arange { start, .. } => {
                let start = start
                    .eval(&self.bind.dims)
                    .map_err(|e| format!("arange start: {e}"))?;
                let end = start + numel as i64;
                if start < i64::from(i32::MIN) || end - 1 > i64::from(i32::MAX) {
                    return Err(format!("the range {start}..{end} does not fit in i32"));
                }
                Data::I((start..end).map(|i| i as i32).collect())
            }
            Op::OneHot { .. } => one_hot(args, shape)?,
            Op::Concat { axis } => concat(*axis, args, shape)?,
        })
    }
}
