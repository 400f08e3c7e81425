//! Validation: an optimized program against the unoptimized graph, on random inputs.
//!
//! In: the source graph, its [`KernelGraph`], a seed. Out: per output, the largest
//! difference and the largest reference magnitude, and whether every output is within
//! the tolerance `max|opt − ref| ≤ rel · max|ref| + abs`.
//!
//! Both sides run on the reference executor: the source graph as it is, the program
//! with every kernel expanded into primitives ([`KernelGraph::to_graph`]). They differ by
//! the rewrites (a scale folded into another, a masked maximum dropped from a softmax
//! backward), so they agree to rounding: [`DEFAULT_REL`] is far above what rounding
//! gives and far below what a wrong fusion gives.
//!
//! Random inputs: every symbolic dim gets a small size (2, 5, 4, 3, …, in declaration
//! order), token ids are drawn from `1..vocab` (`vocab` from the graph's parameters, else
//! the smallest table an id indexes), bool inputs at random, float inputs in [-1, 1);
//! parameters from [`crate::init::init_params`].

use std::collections::BTreeMap;

use crate::init::init_params;
use crate::ir::{DType, Graph, Op};
use crate::optimize::kernels::KernelGraph;
use crate::reference::{self, RunOptions};
use crate::rng::uniform01;
use crate::tensor::Tensor;

/// Relative tolerance (of the output's largest magnitude).
pub const DEFAULT_REL: f64 = 1e-4;
/// Absolute floor.
pub const DEFAULT_ABS: f64 = 1e-6;

/// One output's comparison.
#[derive(Clone, Debug)]
pub struct OutputCheck {
    pub name: String,
    pub max_abs_diff: f64,
    pub max_abs_ref: f64,
    pub ok: bool,
}

/// The result of a validation.
#[derive(Clone, Debug)]
pub struct Validation {
    pub outputs: Vec<OutputCheck>,
    pub rel: f64,
    pub abs: f64,
}

impl Validation {
    pub fn ok(&self) -> bool {
        self.outputs.iter().all(|o| o.ok)
    }

    pub fn text(&self) -> String {
        let mut s = format!(
            "validation (max|opt - ref| <= {:e}·max|ref| + {:e}): {}\n",
            self.rel,
            self.abs,
            if self.ok() { "passed" } else { "FAILED" }
        );
        for o in &self.outputs {
            s.push_str(&format!(
                "  {:<48} max diff {:.3e}  max |ref| {:.3e}  {}\n",
                o.name,
                o.max_abs_diff,
                o.max_abs_ref,
                if o.ok { "ok" } else { "MISMATCH" }
            ));
        }
        s
    }
}

/// Small sizes for the graph's dims, in declaration order.
pub fn dim_sizes(g: &Graph) -> BTreeMap<String, i64> {
    const SIZES: [i64; 6] = [2, 5, 4, 3, 3, 2];
    g.dims
        .iter()
        .enumerate()
        .map(|(i, d)| (d.clone(), SIZES[i % SIZES.len()]))
        .collect()
}

pub use crate::tensor::Feeds;

/// Random inputs and initialized parameters for `g`.
pub fn random_feeds(g: &Graph, seed: u64) -> Result<(Feeds, Feeds), String> {
    random_feeds_with(g, seed, &dim_sizes(g))
}

/// Random inputs and initialized parameters for `g` with the given dim sizes.
pub fn random_feeds_with(
    g: &Graph,
    seed: u64,
    dims: &BTreeMap<String, i64>,
) -> Result<(Feeds, Feeds), String> {
    let dims = dims.clone();
    let vocab = g.hparam("vocab").and_then(|v| v.parse::<i64>().ok());
    // Every input's bytes, checked against what the machine has before any is made.
    let mut bytes = 0u64;
    for &id in &g.inputs {
        let node = g.node(id);
        let n = node
            .ty
            .shape
            .eval(&dims)?
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .unwrap_or(u64::MAX);
        let width = if node.ty.dtype == DType::Bool { 1 } else { 4 };
        bytes = bytes.saturating_add(n.saturating_mul(width));
    }
    crate::memory::ensure(
        bytes,
        || {
            let at: Vec<String> = dims.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("the random inputs at {}", at.join(", "))
        },
        || "use a smaller batch or shorter lengths".to_string(),
    )
    .map_err(|e| e.to_string())?;
    let mut inputs = BTreeMap::new();
    for (k, &id) in g.inputs.iter().enumerate() {
        let node = g.node(id);
        let Op::Input { name } = &node.op else {
            continue;
        };
        let shape = node.ty.shape.eval(&dims)?;
        let n: usize = shape.iter().product();
        let r = |i: usize| uniform01(seed, 1000 + k as u64, i as u64);
        let t = match node.ty.dtype {
            DType::I32 => {
                // The smallest table this input indexes (gather rows, one-hot depth).
                let mut bound = vocab.unwrap_or(i64::MAX);
                for u in &g.nodes {
                    if u.inputs.contains(&id) {
                        match &u.op {
                            Op::Gather => {
                                if let Some(rows) = g.ty(u.inputs[0]).shape.dims()[0].as_const() {
                                    bound = bound.min(rows);
                                }
                            }
                            Op::OneHot { depth } => {
                                if let Some(d) = depth.as_const() {
                                    bound = bound.min(d);
                                }
                            }
                            _ => {}
                        }
                    }
                }
                // Ids from 1 (0 is usually the padding), but 0 where the table has one
                // row (a vocabulary of 1).
                let bound = if bound == i64::MAX { 8 } else { bound.max(1) };
                let v = (0..n)
                    .map(|i| match bound {
                        1 => 0,
                        _ => 1 + (r(i) * (bound - 1) as f64) as i32,
                    })
                    .collect();
                Tensor::i32(shape, v)
            }
            DType::Bool => Tensor::bool(shape, (0..n).map(|i| r(i) < 0.8).collect()),
            _ => Tensor::f32(shape, (0..n).map(|i| (2.0 * r(i) - 1.0) as f32).collect()),
        }
        .map_err(|e| e.to_string())?;
        inputs.insert(name.clone(), t);
    }
    let params = init_params(g, seed)
        .map_err(|e| e.to_string())?
        .into_iter()
        .collect();
    Ok((inputs, params))
}

/// Runs both on the reference executor and compares every output.
pub fn validate(
    source: &Graph,
    program: &KernelGraph,
    seed: u64,
    rel: f64,
    abs: f64,
) -> Result<Validation, String> {
    let reference = |g: &Graph, i: &Feeds, p: &Feeds, o: &RunOptions| {
        reference::run(g, i, p, o).map_err(|e| e.to_string())
    };
    validate_with(source, program, seed, rel, abs, &reference)
}

/// An executor: runs a graph on inputs and parameters, returns its outputs in order.
pub type Executor<'a> = &'a (dyn Fn(&Graph, &Feeds, &Feeds, &RunOptions) -> Result<Vec<(String, Tensor)>, String>
         + Sync);

/// Runs both on `exec` (the reference executor in [`validate`]; a faster executor lets
/// the test suite cover every shipped spec at full width) and compares every output.
pub fn validate_with(
    source: &Graph,
    program: &KernelGraph,
    seed: u64,
    rel: f64,
    abs: f64,
    exec: Executor<'_>,
) -> Result<Validation, String> {
    let (inputs, params) = random_feeds(source, seed)?;
    let expanded = program
        .to_graph(source)
        .map_err(|e| format!("expanding the kernels: {e}"))?;
    let opts = RunOptions {
        seed,
        step: 1,
        ..RunOptions::default()
    };
    let want = exec(source, &inputs, &params, &opts).map_err(|e| format!("source run: {e}"))?;
    let got =
        exec(&expanded, &inputs, &params, &opts).map_err(|e| format!("optimized run: {e}"))?;
    let mut outputs = Vec::new();
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        let (Some(w), Some(g)) = (w.to_f64_vec(), g.to_f64_vec()) else {
            return Err(format!("output `{name}` is not numeric"));
        };
        if w.len() != g.len() {
            return Err(format!(
                "output `{name}` has {} elements, expected {}",
                g.len(),
                w.len()
            ));
        }
        let max_abs_ref = w.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let max_abs_diff = w.iter().zip(&g).fold(0.0f64, |m, (a, b)| {
            // Equal non-finite values agree (a NaN from sqrt of a negative random
            // moment is a NaN on both sides); a NaN on one side only does not.
            let d = if a == b || (a.is_nan() && b.is_nan()) {
                0.0
            } else {
                (a - b).abs()
            };
            if d.is_nan() {
                f64::INFINITY
            } else {
                m.max(d)
            }
        });
        outputs.push(OutputCheck {
            name: name.clone(),
            max_abs_diff,
            max_abs_ref,
            ok: max_abs_diff <= rel * max_abs_ref + abs,
        });
    }
    Ok(Validation { outputs, rel, abs })
}
