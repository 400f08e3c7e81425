//! The eager CPU executor: any IR graph, one primitive at a time, fast enough to train on.
//!
//! In: a [`Graph`] (checked and planned once by [`Eager::new`]), host tensors for its
//! inputs and parameters, and [`RunOptions`] (f32 only; seed and step for dropout). Out:
//! the values of the graph's outputs ([`Eager::run`]) or of any nodes
//! ([`Eager::run_nodes`]), as host [`Tensor`]s.
//!
//! It computes exactly what the reference executor (`kiln_compiler::reference`) computes
//! — same binding rules and error messages (shared through `kiln_compiler::bind`), same
//! op semantics — with kernels meant for speed:
//!
//! - **Matmuls** go to the `gemm` crate, reading transposed operands through their
//!   strides (`matmul.rs`).
//! - **Everything else** is a loop over slices that LLVM vectorizes, parallel with rayon
//!   above a size threshold (`walk.rs`, `reduce.rs`, `index.rs`).
//! - **Views** (`reshape` of row-major data, `permute`, `broadcast`, `slice`) change a
//!   value's strides, never its elements (`value.rs`); kernels read any strides.
//! - **Memory**: parameters and inputs are borrowed, never copied; each buffer is freed
//!   after its last reader (planned in `new`); an elementwise op whose operand dies with
//!   it writes into that operand's buffer; large freed buffers go to a pool (`pool.rs`)
//!   and are reused by later nodes and runs instead of being page-faulted in again.
//!
//! # Numerics and determinism
//!
//! Results equal the reference's up to rounding: matmuls use FMA and `gemm`'s blocking,
//! and last-axis sums add in 16 interleaved lanes (see `reduce.rs`). Everything else —
//! elementwise ops, `reduce_max` (up to the sign of a zero maximum), other reductions,
//! gathers, `scatter_add`, dropout masks — is bit-identical to the reference in f32.
//! Every kernel splits work between threads only by *which* output elements a task
//! computes, never by how one element is computed, and chooses its loop shape from the
//! problem size, not the thread count; `gemm` splits its work the same way (its k
//! blocking does not depend on threads). So a run's bits do not depend on the number of
//! threads or on scheduling: the tests compare 1, 2, 3 and 4 threads bit for bit.

pub(crate) mod index;
mod matmul;
pub(crate) mod ops;
pub(crate) mod pool;
mod reduce;
pub(crate) mod value;
pub(crate) mod walk;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use kiln_compiler::bind::{liveness, Binder, Source};
use kiln_compiler::ir::{DType, Graph, NodeId, Op};
use kiln_compiler::reference::{ExecError, Precision, RunOptions};
use kiln_compiler::tensor::{Feeds, Tensor, TensorData};

use ops::{compute, Ctx};
use pool::Pool;
use value::{Data, Value};

/// How the executor names itself in messages.
const EXECUTOR: &str = "the eager executor";

/// Which nodes a set of requested values needs and when each buffer can be freed.
#[derive(Clone, Debug)]
struct Plan {
    requested: Vec<NodeId>,
    /// Nodes computed, in graph order.
    order: Vec<usize>,
    /// For each node, the index of the last node that reads it.
    last_use: Vec<usize>,
    /// Requested nodes: never freed.
    keep: Vec<bool>,
}

impl Plan {
    fn new(graph: &Graph, requested: &[NodeId]) -> Result<Plan, ExecError> {
        let n = graph.len();
        for &id in requested {
            if id.index() >= n {
                return Err(ExecError::NoSuchNode { id, len: n });
            }
        }
        let (live, last_use) = liveness(graph, requested);
        let mut keep = vec![false; n];
        for &id in requested {
            keep[id.index()] = true;
        }
        Ok(Plan {
            requested: requested.to_vec(),
            order: (0..n).filter(|&i| live[i]).collect(),
            last_use,
            keep,
        })
    }
}

pub use kiln_compiler::tensor::Outputs;

/// Where one run spent its time, per op kind (see [`Eager::run_profiled`]).
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// The op's name in the text form (`matmul`, `exp`, …).
    pub op: &'static str,
    /// Wall-clock seconds spent in nodes of this op.
    pub seconds: f64,
    /// How many nodes of this op ran.
    pub nodes: usize,
}

/// A graph ready to run eagerly on the CPU.
#[derive(Clone, Debug)]
pub struct Eager {
    graph: Graph,
    /// The plan of [`Eager::run`]: every output of the graph.
    outputs: Plan,
    /// Large buffers kept between nodes and runs (see `pool.rs`).
    pool: Arc<Pool>,
}

impl Eager {
    /// Checks the graph ([`Graph::verify`]) and plans the run of its outputs.
    pub fn new(graph: Graph) -> Result<Eager, ExecError> {
        graph.verify()?;
        let ids: Vec<NodeId> = graph.outputs.iter().map(|o| o.node).collect();
        let outputs = Plan::new(&graph, &ids)?;
        Ok(Eager {
            graph,
            outputs,
            pool: Arc::new(Pool::default()),
        })
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// [`Eager::run`], also returning the time spent per op kind, slowest first.
    pub fn run_profiled(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
    ) -> Result<(Outputs, Vec<OpTime>), ExecError> {
        let mut times: BTreeMap<&'static str, OpTime> = BTreeMap::new();
        let mut record = |op: &'static str, seconds: f64| {
            let t = times.entry(op).or_insert(OpTime {
                op,
                seconds: 0.0,
                nodes: 0,
            });
            t.seconds += seconds;
            t.nodes += 1;
        };
        let values = self.execute(&self.outputs, inputs, params, opts, Some(&mut record))?;
        let named = self
            .graph
            .outputs
            .iter()
            .map(|o| o.name.clone())
            .zip(values)
            .collect();
        let mut times: Vec<OpTime> = times.into_values().collect();
        times.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        Ok((named, times))
    }

    /// Runs the graph and returns the values of `nodes`, in the order requested
    /// (intermediate nodes included). Every graph input must still be given.
    pub fn run_nodes(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
        nodes: &[NodeId],
    ) -> Result<Vec<Tensor>, ExecError> {
        let plan = match Plan::new(&self.graph, nodes) {
            Ok(plan) => plan,
            Err(e) => {
                // The reference binds the inputs before it looks at the requested ids;
                // report a binding error first, as it does.
                self.check_options(opts)?;
                Binder::new(&self.graph, inputs, params, EXECUTOR)?;
                return Err(e);
            }
        };
        self.execute(&plan, inputs, params, opts, None)
    }

    fn check_options(&self, opts: &RunOptions) -> Result<(), ExecError> {
        if opts.precision != Precision::F32 {
            return Err(ExecError::Unsupported(format!(
                "the eager executor computes in f32 only, but {:?} precision was requested; \
                 run it in f32, or use the reference executor for f64",
                opts.precision
            )));
        }
        Ok(())
    }

    /// Checks that the machine has room for node `id`'s result before it is computed
    /// ([`kiln_compiler::memory::ensure`]): a value larger than the memory left would
    /// otherwise abort the process ("memory allocation of N bytes failed") or get it
    /// killed. Views allocate nothing; a result that a pooled buffer or a dying operand's
    /// buffer can hold allocates nothing new either.
    fn ensure_memory(
        &self,
        id: NodeId,
        shape: &[usize],
        args: &[Value<'_>],
        dims: &BTreeMap<String, i64>,
    ) -> Result<(), ExecError> {
        let node = self.graph.node(id);
        if matches!(
            node.op,
            Op::Input { .. }
                | Op::Param { .. }
                | Op::Reshape { .. }
                | Op::Permute { .. }
                | Op::Broadcast { .. }
                | Op::Slice { .. }
        ) {
            return Ok(());
        }
        let elem: u64 = if node.ty.dtype == DType::Bool { 1 } else { 4 };
        let n = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .unwrap_or(u64::MAX);
        let bytes = n.saturating_mul(elem);
        if bytes < kiln_compiler::memory::CHECK_MIN {
            return Ok(());
        }
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if elem == 4 && (self.pool.has_fit(n) || args.iter().any(|a| a.owns_f32_buffer_of(n))) {
            return Ok(());
        }
        kiln_compiler::memory::ensure_node(bytes, EXECUTOR, node, shape, dims)?;
        Ok(())
    }

    fn execute<'t>(
        &self,
        plan: &Plan,
        inputs: &'t BTreeMap<String, Tensor>,
        params: &'t BTreeMap<String, Tensor>,
        opts: &RunOptions,
        mut profile: Option<&mut dyn FnMut(&'static str, f64)>,
    ) -> Result<Vec<Tensor>, ExecError> {
        self.check_options(opts)?;
        let graph = &self.graph;
        let bind = Binder::new(graph, inputs, params, EXECUTOR)?;
        let ctx = Ctx {
            dims: &bind.dims,
            seed: opts.seed,
            step: opts.step,
            pool: &self.pool,
        };
        let mut values: Vec<Option<Value<'t>>> = vec![None; graph.len()];
        for &i in &plan.order {
            let id = NodeId(i as u32);
            let node = graph.node(id);
            let shape = bind.node_shape(id)?;
            // Operands: moved out when this is their last reader (so their buffers can
            // be reused), shared otherwise.
            let mut args = Vec::with_capacity(node.inputs.len());
            for (pos, inp) in node.inputs.iter().enumerate() {
                let j = inp.index();
                let dies_here =
                    plan.last_use[j] == i && !plan.keep[j] && !node.inputs[pos + 1..].contains(inp);
                let v = if dies_here {
                    values[j].take()
                } else {
                    values[j].clone()
                };
                args.push(v.ok_or_else(|| {
                    bind.node_err(id, format!("internal: operand {inp} was not computed"))
                })?);
            }
            self.ensure_memory(id, &shape, &args, &bind.dims)?;
            let started = profile.as_ref().map(|_| Instant::now());
            let v = match &node.op {
                Op::Input { name } => source_value(bind.input(id, name)?, &shape),
                Op::Param { name, .. } => source_value(bind.param(id, name, &shape)?, &shape),
                op => compute(op, args, &shape, &ctx).map_err(|m| bind.node_err(id, m))?,
            };
            if v.shape() != shape.as_slice() {
                return Err(bind.node_err(
                    id,
                    format!(
                        "internal: computed shape {:?}, expected {shape:?}",
                        v.shape()
                    ),
                ));
            }
            if let (Some(record), Some(t0)) = (profile.as_mut(), started) {
                record(node.op.name(), t0.elapsed().as_secs_f64());
            }
            values[i] = Some(v);
        }
        let mut out = Vec::with_capacity(plan.requested.len());
        for (k, &id) in plan.requested.iter().enumerate() {
            let again = plan.requested[k + 1..].contains(&id);
            let v = if again {
                values[id.index()].clone()
            } else {
                values[id.index()].take()
            };
            let v = v.ok_or_else(|| bind.node_err(id, "internal: value was freed".into()))?;
            out.push(into_tensor(v));
        }
        Ok(out)
    }
}

impl crate::executor::Exec for Eager {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Runs the graph and returns every output in `graph.outputs` order, with its name.
    fn run(&self, inputs: &Feeds, params: &Feeds, opts: &RunOptions) -> Result<Outputs, ExecError> {
        let values = self.execute(&self.outputs, inputs, params, opts, None)?;
        Ok(self
            .graph
            .outputs
            .iter()
            .map(|o| o.name.clone())
            .zip(values)
            .collect())
    }
}

/// A bound input or parameter as a value: borrowed unless it had to be converted.
fn source_value<'t>(src: Source<'t>, shape: &[usize]) -> Value<'t> {
    match src {
        Source::F32(v) => Value::borrowed(shape, v),
        Source::F64(v) => Value::owned(shape, v.iter().map(|&x| x as f32).collect(), None),
        Source::I32(Cow::Borrowed(v)) => Value::borrowed(shape, v),
        Source::I32(Cow::Owned(v)) => Value::owned(shape, v, None),
        Source::Bool(v) => Value::borrowed(shape, v),
    }
}

/// A value as a host tensor, reusing its buffer when nothing else holds it.
fn into_tensor(v: Value<'_>) -> Tensor {
    let Value { data, layout } = v;
    let data = match data {
        Data::F(s) => TensorData::F32(s.into_vec(&layout)),
        Data::I(s) => TensorData::I32(s.into_vec(&layout)),
        Data::B(s) => TensorData::Bool(s.into_vec(&layout)),
    };
    Tensor {
        shape: layout.shape,
        data,
    }
}
