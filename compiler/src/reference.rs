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
use crate::tensor::{Tensor, TensorData};

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
    inputs: &BTreeMap<String, Tensor>,
    params: &BTreeMap<String, Tensor>,
    opts: &RunOptions,
) -> Result<Vec<(String, Tensor)>, ExecError> {
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
    inputs: &BTreeMap<String, Tensor>,
    params: &BTreeMap<String, Tensor>,
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
    fn is_nan(self) -> bool;
    /// The values as a host tensor of the matching dtype.
    fn into_data(v: Vec<Self>) -> TensorData;
}

macro_rules! impl_real {
    ($t:ty, $variant:ident) => {
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
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            fn cos(self) -> Self {
                <$t>::cos(self)
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

impl_real!(f32, F32);
impl_real!(f64, F64);

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
            Op::Permute { perm } => {
                let x = args[0];
                let fits = perm.len() == x.shape.len()
                    && perm.len() == shape.len()
                    && perm
                        .iter()
                        .zip(shape)
                        .all(|(&p, &d)| x.shape.get(p) == Some(&d));
                if !fits {
                    return Err(format!(
                        "permutation {perm:?} does not take {} to {}",
                        fmt_dims(&x.shape),
                        fmt_dims(shape)
                    ));
                }
                let in_strides = strides(&x.shape);
                let mut o = vec![0; shape.len()];
                let idx: Vec<usize> = (0..numel)
                    .map(|flat| {
                        unravel(flat, shape, &mut o);
                        (0..shape.len()).map(|i| o[i] * in_strides[perm[i]]).sum()
                    })
                    .collect();
                x.data.select(&idx)
            }
            Op::Broadcast { .. } => {
                let x = args[0];
                let rank = shape.len();
                let ok = x.shape.len() <= rank
                    && x.shape
                        .iter()
                        .enumerate()
                        .all(|(j, &d)| d == 1 || d == shape[rank - x.shape.len() + j]);
                if !ok {
                    return Err(format!(
                        "cannot broadcast {} to {}",
                        fmt_dims(&x.shape),
                        fmt_dims(shape)
                    ));
                }
                let off = rank - x.shape.len();
                let in_strides = strides(&x.shape);
                let mut o = vec![0; rank];
                let idx: Vec<usize> = (0..numel)
                    .map(|flat| {
                        unravel(flat, shape, &mut o);
                        x.shape
                            .iter()
                            .enumerate()
                            .map(|(j, &d)| {
                                if d == 1 {
                                    0
                                } else {
                                    o[off + j] * in_strides[j]
                                }
                            })
                            .sum()
                    })
                    .collect();
                x.data.select(&idx)
            }
            Op::Unary(u) => unary(*u, &args[0].data)?,
            Op::Binary(b) => {
                let (x, y) = (args[0], args[1]);
                if x.shape != y.shape {
                    return Err(format!(
                        "operands have shapes {} and {}",
                        fmt_dims(&x.shape),
                        fmt_dims(&y.shape)
                    ));
                }
                binary(*b, &x.data, &y.data)?
            }
            Op::Compare(c) => {
                let (x, y) = (args[0], args[1]);
                if x.shape != y.shape {
                    return Err(format!(
                        "operands have shapes {} and {}",
                        fmt_dims(&x.shape),
                        fmt_dims(&y.shape)
                    ));
                }
                compare(*c, &x.data, &y.data)?
            }
            Op::Slice { axis, start, .. } => {
                let x = args[0];
                let start = start
                    .eval(&self.bind.dims)
                    .ok()
                    .and_then(|v| usize::try_from(v).ok())
                    .ok_or_else(|| format!("slice start {start} is not a valid index"))?;
                let (axis, len) = (*axis, shape.get(*axis).copied().unwrap_or(0));
                let full = x.shape.get(axis).copied().unwrap_or(0);
                if start + len > full {
                    return Err(format!(
                        "slice {start}..{} is outside axis {axis} of size {full}",
                        start + len
                    ));
                }
                let outer = product(&x.shape[..axis]);
                let inner = product(&x.shape[axis + 1..]);
                let mut idx = Vec::with_capacity(numel);
                for o in 0..outer {
                    let base = o * full * inner + start * inner;
                    idx.extend(base..base + len * inner);
                }
                x.data.select(&idx)
            }
            Op::Where => {
                let (c, a, b) = (args[0], args[1], args[2]);
                if a.shape != c.shape || b.shape != c.shape {
                    return Err(format!(
                        "condition and values have shapes {}, {} and {}",
                        fmt_dims(&c.shape),
                        fmt_dims(&a.shape),
                        fmt_dims(&b.shape)
                    ));
                }
                let Data::B(c) = &c.data else {
                    return Err(format!("condition is {}, not bool", c.data.kind()));
                };
                fn pick<E: Copy>(c: &[bool], a: &[E], b: &[E]) -> Vec<E> {
                    c.iter()
                        .zip(a.iter().zip(b))
                        .map(|(&c, (&a, &b))| if c { a } else { b })
                        .collect()
                }
                match (&a.data, &b.data) {
                    (Data::F(a), Data::F(b)) => Data::F(pick(c, a, b)),
                    (Data::I(a), Data::I(b)) => Data::I(pick(c, a, b)),
                    (Data::B(a), Data::B(b)) => Data::B(pick(c, a, b)),
                    (a, b) => return Err(format!("values are {} and {}", a.kind(), b.kind())),
                }
            }
            Op::Cast { to } => cast(&args[0].data, *to),
            Op::Reduce { op, axis } => reduce(*op, *axis, args[0])?,
            Op::MatMul => matmul(args[0], args[1])?,
            Op::Gather => {
                let (table, ids) = (args[0], args[1]);
                let Data::I(ids) = &ids.data else {
                    return Err(format!("ids are {}, not i32", ids.data.kind()));
                };
                let Some((&v, rest)) = table.shape.split_first() else {
                    return Err("the table is a scalar".into());
                };
                let row = product(rest);
                let mut idx = Vec::with_capacity(ids.len() * row);
                for (p, &id) in ids.iter().enumerate() {
                    let r = check_id(id, v, p, format_args!("the table has {v} rows"))?;
                    idx.extend(r * row..(r + 1) * row);
                }
                table.data.select(&idx)
            }
            Op::ScatterAdd { .. } => {
                let (ids, src) = (args[0], args[1]);
                let Data::I(id_vals) = &ids.data else {
                    return Err(format!("ids are {}, not i32", ids.data.kind()));
                };
                let Data::F(src_vals) = &src.data else {
                    return Err(format!("values are {}, not float", src.data.kind()));
                };
                let Some((&rows, rest)) = shape.split_first() else {
                    return Err("the result is a scalar".into());
                };
                let row = product(rest);
                if !src.shape.starts_with(&ids.shape)
                    || product(&src.shape[ids.shape.len()..]) != row
                {
                    return Err(format!(
                        "values {} do not fit ids {} and result {}",
                        fmt_dims(&src.shape),
                        fmt_dims(&ids.shape),
                        fmt_dims(shape)
                    ));
                }
                let mut out = vec![T::ZERO; numel];
                for (p, &id) in id_vals.iter().enumerate() {
                    let r = check_id(id, rows, p, format_args!("the result has {rows} rows"))?;
                    for d in 0..row {
                        out[r * row + d] = out[r * row + d] + src_vals[p * row + d];
                    }
                }
                Data::F(out)
            }
            Op::Dropout { p, stream } => {
                let Data::F(x) = &args[0].data else {
                    return Err(format!("dropout of {} values", args[0].data.kind()));
                };
                let p = p.get();
                let threshold = rng::dropout_threshold(p);
                let scale = T::from_f64(1.0 / (1.0 - p));
                let (seed, step) = (self.opts.seed, self.opts.step);
                Data::F(
                    x.iter()
                        .enumerate()
                        .map(|(i, &v)| {
                            if rng::dropout_keep(seed, step, *stream, i as u64, threshold) {
                                v * scale
                            } else {
                                T::ZERO
                            }
                        })
                        .collect(),
                )
            }
            Op::CausalMask { .. } => {
                let [q, k] = shape else {
                    return Err(format!("a mask of shape {}", fmt_dims(shape)));
                };
                let offset = *k as i128 - *q as i128;
                let mut out = Vec::with_capacity(numel);
                for i in 0..*q {
                    for j in 0..*k {
                        out.push(j as i128 <= i as i128 + offset);
                    }
                }
                Data::B(out)
            }
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
            Op::OneHot { .. } => {
                let Data::I(ids) = &args[0].data else {
                    return Err(format!("ids are {}, not i32", args[0].data.kind()));
                };
                let depth = shape.last().copied().unwrap_or(0);
                if ids.len().checked_mul(depth) != Some(numel) {
                    return Err(format!(
                        "ids {} do not fit the result {}",
                        fmt_dims(&args[0].shape),
                        fmt_dims(shape)
                    ));
                }
                let mut out = vec![T::ZERO; numel];
                for (p, &id) in ids.iter().enumerate() {
                    let c = check_id(id, depth, p, format_args!("the depth is {depth}"))?;
                    out[p * depth + c] = T::ONE;
                }
                Data::F(out)
            }
            Op::Concat { axis } => concat(*axis, args, shape)?,
        })
    }
}

/// A bound source's elements in the executor's representation.
fn source_data<T: Real>(src: Source<'_>) -> Data<T> {
    match src {
        Source::F32(v) => Data::F(v.iter().map(|&x| T::from_f64(f64::from(x))).collect()),
        Source::F64(v) => Data::F(v.iter().map(|&x| T::from_f64(x)).collect()),
        Source::I32(v) => Data::I(v.into_owned()),
        Source::Bool(v) => Data::B(v.to_vec()),
    }
}

fn unary<T: Real>(u: UnaryOp, x: &Data<T>) -> NodeResult<Data<T>> {
    Ok(match x {
        Data::F(v) => {
            let f: fn(T) -> T = match u {
                UnaryOp::Neg => |a| -a,
                UnaryOp::Exp => T::exp,
                UnaryOp::Log => T::ln,
                UnaryOp::Sqrt => T::sqrt,
                UnaryOp::Recip => |a| T::ONE / a,
                UnaryOp::Relu => |a| {
                    if a.is_nan() || a > T::ZERO {
                        a
                    } else {
                        T::ZERO
                    }
                },
                UnaryOp::Sin => T::sin,
                UnaryOp::Cos => T::cos,
            };
            Data::F(v.iter().map(|&a| f(a)).collect())
        }
        Data::I(v) => match u {
            UnaryOp::Neg => Data::I(v.iter().map(|a| a.wrapping_neg()).collect()),
            UnaryOp::Relu => Data::I(v.iter().map(|&a| a.max(0)).collect()),
            _ => return Err(format!("{u:?} is not defined for i32")),
        },
        Data::B(_) => return Err(format!("{u:?} is not defined for bool")),
    })
}

fn binary<T: Real>(b: BinaryOp, x: &Data<T>, y: &Data<T>) -> NodeResult<Data<T>> {
    Ok(match (x, y) {
        (Data::F(x), Data::F(y)) => {
            let f: fn(T, T) -> T = match b {
                BinaryOp::Add => |a, b| a + b,
                BinaryOp::Sub => |a, b| a - b,
                BinaryOp::Mul => |a, b| a * b,
                BinaryOp::Div => |a, b| a / b,
                BinaryOp::Max => fmax,
            };
            Data::F(x.iter().zip(y).map(|(&a, &b)| f(a, b)).collect())
        }
        (Data::I(x), Data::I(y)) => {
            let f: fn(i32, i32) -> i32 = match b {
                BinaryOp::Add => i32::wrapping_add,
                BinaryOp::Sub => i32::wrapping_sub,
                BinaryOp::Mul => i32::wrapping_mul,
                BinaryOp::Max => std::cmp::max,
                BinaryOp::Div => return Err("div is not defined for i32".into()),
            };
            Data::I(x.iter().zip(y).map(|(&a, &b)| f(a, b)).collect())
        }
        (x, y) => return Err(format!("{b:?} of {} and {} values", x.kind(), y.kind())),
    })
}

fn compare<T: Real>(c: CmpOp, x: &Data<T>, y: &Data<T>) -> NodeResult<Data<T>> {
    fn cmp<E: PartialOrd + Copy>(c: CmpOp, a: &[E], b: &[E]) -> Vec<bool> {
        let f: fn(&E, &E) -> bool = match c {
            CmpOp::Eq => |a, b| a == b,
            CmpOp::Ne => |a, b| a != b,
            CmpOp::Lt => |a, b| a < b,
            CmpOp::Le => |a, b| a <= b,
            CmpOp::Gt => |a, b| a > b,
            CmpOp::Ge => |a, b| a >= b,
        };
        a.iter().zip(b).map(|(a, b)| f(a, b)).collect()
    }
    Ok(match (x, y) {
        (Data::F(a), Data::F(b)) => Data::B(cmp(c, a, b)),
        (Data::I(a), Data::I(b)) => Data::B(cmp(c, a, b)),
        _ => {
            return Err(format!(
                "compare needs two float or two i32 operands, got {} and {}",
                x.kind(),
                y.kind()
            ))
        }
    })
}

fn cast<T: Real>(x: &Data<T>, to: DType) -> Data<T> {
    match (x, to) {
        (Data::F(v), DType::I32) => Data::I(v.iter().map(|&a| a.to_f64() as i32).collect()),
        (Data::F(v), DType::Bool) => Data::B(v.iter().map(|&a| a != T::ZERO).collect()),
        (Data::F(v), _) => Data::F(v.clone()),
        (Data::I(v), DType::I32) => Data::I(v.clone()),
        (Data::I(v), DType::Bool) => Data::B(v.iter().map(|&a| a != 0).collect()),
        (Data::I(v), _) => Data::F(v.iter().map(|&a| T::from_f64(f64::from(a))).collect()),
        (Data::B(v), DType::I32) => Data::I(v.iter().map(|&a| i32::from(a)).collect()),
        (Data::B(v), DType::Bool) => Data::B(v.clone()),
        (Data::B(v), _) => Data::F(
            v.iter()
                .map(|&a| if a { T::ONE } else { T::ZERO })
                .collect(),
        ),
    }
}

fn reduce<T: Real>(op: ReduceOp, axis: usize, x: &Buf<T>) -> NodeResult<Data<T>> {
    if axis >= x.shape.len() {
        return Err(format!(
            "axis {axis} of a tensor of shape {}",
            fmt_dims(&x.shape)
        ));
    }
    let outer = product(&x.shape[..axis]);
    let len = x.shape[axis];
    let inner = product(&x.shape[axis + 1..]);
    fn fold<E: Copy>(
        v: &[E],
        (outer, len, inner): (usize, usize, usize),
        init: E,
        f: impl Fn(E, E) -> E,
    ) -> Vec<E> {
        let mut out = Vec::with_capacity(outer * inner);
        for o in 0..outer {
            for r in 0..inner {
                let mut acc = init;
                for a in 0..len {
                    acc = f(acc, v[(o * len + a) * inner + r]);
                }
                out.push(acc);
            }
        }
        out
    }
    let dims = (outer, len, inner);
    Ok(match (&x.data, op) {
        (Data::F(v), ReduceOp::Sum) => Data::F(fold(v, dims, T::ZERO, |a, b| a + b)),
        (Data::F(v), ReduceOp::Max) => Data::F(fold(v, dims, T::NEG_INFINITY, fmax)),
        (Data::I(v), ReduceOp::Sum) => Data::I(fold(v, dims, 0, i32::wrapping_add)),
        (Data::I(v), ReduceOp::Max) => Data::I(fold(v, dims, i32::MIN, std::cmp::max)),
        (Data::B(_), _) => return Err("reducing bool values".into()),
    })
}

fn matmul<T: Real>(a: &Buf<T>, b: &Buf<T>) -> NodeResult<Data<T>> {
    let (Data::F(av), Data::F(bv)) = (&a.data, &b.data) else {
        return Err(format!(
            "matmul of {} and {} values",
            a.data.kind(),
            b.data.kind()
        ));
    };
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let fits = ra >= 2
        && rb >= 2
        && a.shape[ra - 1] == b.shape[rb - 2]
        && (rb == 2 || a.shape[..ra - 2] == b.shape[..rb - 2]);
    if !fits {
        return Err(format!(
            "cannot multiply {} by {}",
            fmt_dims(&a.shape),
            fmt_dims(&b.shape)
        ));
    }
    let (m, k, n) = (a.shape[ra - 2], a.shape[ra - 1], b.shape[rb - 1]);
    let batch = product(&a.shape[..ra - 2]);
    let shared = rb == 2;
    // Each out[i, j] is the sum over p = 0, 1, …, k-1 in that order (a plain dot product);
    // the loops run i, p, j so that rows of `b` are read contiguously, which keeps the
    // per-element order while touching memory in a cache-friendly way.
    let mut out = vec![T::ZERO; batch * m * n];
    for bi in 0..batch {
        let a0 = bi * m * k;
        let b0 = if shared { 0 } else { bi * k * n };
        for i in 0..m {
            let row = &mut out[(bi * m + i) * n..(bi * m + i + 1) * n];
            for p in 0..k {
                let x = av[a0 + i * k + p];
                let brow = &bv[b0 + p * n..b0 + (p + 1) * n];
                for (o, &y) in row.iter_mut().zip(brow) {
                    *o = *o + x * y;
                }
            }
        }
    }
    Ok(Data::F(out))
}

fn concat<T: Real>(axis: usize, args: &[&Buf<T>], shape: &[usize]) -> NodeResult<Data<T>> {
    if axis >= shape.len() {
        return Err(format!(
            "axis {axis} of a result of shape {}",
            fmt_dims(shape)
        ));
    }
    for x in args {
        let fits = x.shape.len() == shape.len()
            && x.shape
                .iter()
                .zip(shape)
                .enumerate()
                .all(|(i, (a, b))| i == axis || a == b);
        if !fits {
            return Err(format!(
                "part of shape {} does not fit the result {}",
                fmt_dims(&x.shape),
                fmt_dims(shape)
            ));
        }
    }
    if args.iter().map(|x| x.shape[axis]).sum::<usize>() != shape[axis] {
        return Err(format!(
            "parts do not add up to the result {}",
            fmt_dims(shape)
        ));
    }
    let outer = product(&shape[..axis]);
    let inner = product(&shape[axis + 1..]);
    fn join<E: Copy>(parts: &[(&[E], usize)], outer: usize) -> Vec<E> {
        let mut out = Vec::new();
        for o in 0..outer {
            for &(v, chunk) in parts {
                out.extend_from_slice(&v[o * chunk..(o + 1) * chunk]);
            }
        }
        out
    }
    let chunk = |x: &Buf<T>| x.shape[axis] * inner;
    macro_rules! parts {
        ($variant:ident) => {{
            let mut parts = Vec::with_capacity(args.len());
            for x in args {
                match &x.data {
                    Data::$variant(v) => parts.push((v.as_slice(), chunk(x))),
                    other => {
                        return Err(format!(
                            "parts are {} and {}",
                            args[0].data.kind(),
                            other.kind()
                        ))
                    }
                }
            }
            Data::$variant(join(&parts, outer))
        }};
    }
    Ok(match &args[0].data {
        Data::F(_) => parts!(F),
        Data::I(_) => parts!(I),
        Data::B(_) => parts!(B),
    })
}
