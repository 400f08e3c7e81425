//! The per-target cost model extraction minimizes: one kernel costs
//! `launch + max(bytes / bandwidth, flops / peak)`. Views (reshape, broadcast, permute),
//! sources, constants, attributes and tuple projections launch nothing.

use std::collections::BTreeMap;

use egg::Id;

use crate::optimize::analysis::{Info, EG};
use crate::optimize::lang::{KNode, Kind};
use crate::optimize::regions::Expr;
use crate::optimize::templates::registry;
use crate::shape::Shape;

/// What the optimizer targets; picks the cost constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Target {
    Cpu,
    Cuda,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }

    pub fn parse(s: &str) -> Option<Target> {
        match s {
            "cpu" => Some(Target::Cpu),
            "cuda" => Some(Target::Cuda),
            _ => None,
        }
    }
}

/// Per-kernel cost: `launch + max(bytes / bandwidth, flops / peak)`, in seconds, with
/// symbolic dims valued by `bindings` (the sizes the estimate is for).
#[derive(Clone, Debug)]
pub struct CostModel {
    pub launch_s: f64,
    pub bytes_per_s: f64,
    pub flops_per_s: f64,
    pub bindings: BTreeMap<String, i64>,
}

/// The size every symbolic dim has in cost estimates (a batch of 32 sentences of 32
/// tokens: the scale of the paper's batches per core).
pub const ESTIMATE_DIM: i64 = 32;

impl CostModel {
    /// The constants for a target: CPU — 2 cores of AVX-512 (~100 GFLOP/s fp32), ~15 GB/s
    /// from memory, ~5 µs to fork a parallel loop; CUDA — an H100 (TF32 ~400 TFLOP/s,
    /// ~3 TB/s HBM3, ~4 µs per launch).
    pub fn new(target: Target, dims: &[String]) -> CostModel {
        let bindings = dims.iter().map(|d| (d.clone(), ESTIMATE_DIM)).collect();
        match target {
            Target::Cpu => CostModel {
                launch_s: 5e-6,
                bytes_per_s: 15e9,
                flops_per_s: 100e9,
                bindings,
            },
            Target::Cuda => CostModel {
                launch_s: 4e-6,
                bytes_per_s: 3e12,
                flops_per_s: 400e12,
                bindings,
            },
        }
    }

    /// Elements of a shape under the bindings (unknown dims count as [`ESTIMATE_DIM`]).
    pub fn numel(&self, s: &Shape) -> f64 {
        s.dims()
            .iter()
            .map(|d| {
                d.eval(&self.bindings)
                    .or_else(|_| {
                        let mut b = self.bindings.clone();
                        for sym in d.symbols() {
                            b.entry(sym.to_string()).or_insert(ESTIMATE_DIM);
                        }
                        d.eval(&b)
                    })
                    .unwrap_or(ESTIMATE_DIM) as f64
            })
            .product()
    }

    fn bytes(&self, info: &Info) -> f64 {
        match info {
            Info::Tensor { ty, .. } => self.numel(&ty.shape) * 4.0,
            Info::Tuple(tys) => tys.iter().map(|t| self.numel(&t.shape) * 4.0).sum(),
            _ => 0.0,
        }
    }

    /// Bytes moved and flops of one e-node as a kernel; `None` for free nodes.
    pub fn work(&self, eg: &EG, node: &KNode, out: &Info) -> Option<(f64, f64)> {
        let KNode::Op(kind, ch) = node else {
            return None;
        };
        match kind {
            Kind::Input
            | Kind::Param
            | Kind::Const
            | Kind::Reshape
            | Kind::Broadcast
            | Kind::Permute
            | Kind::Proj(_) => return None,
            _ => {}
        }
        let mut seen: Vec<Id> = Vec::new();
        let mut bytes = self.bytes(out);
        for &c in ch {
            let c = eg.find(c);
            if !seen.contains(&c) {
                seen.push(c);
                // A broadcast operand is read in place: count its source.
                let src = eg[c].nodes.iter().find_map(|n| match n {
                    KNode::Op(Kind::Broadcast, b) => Some(eg.find(b[0])),
                    _ => None,
                });
                bytes += self.bytes(&eg[src.unwrap_or(c)].data);
            }
        }
        let out_numel = match out {
            Info::Tensor { ty, .. } => self.numel(&ty.shape),
            Info::Tuple(t) => t.iter().map(|t| self.numel(&t.shape)).sum(),
            _ => 0.0,
        };
        let in_numel = |i: usize| -> f64 {
            ch.get(i)
                .and_then(|&c| eg[c].data.ty().map(|t| self.numel(&t.shape)))
                .unwrap_or(0.0)
        };
        let last_dim = |i: usize| -> f64 {
            ch.get(i)
                .and_then(|&c| eg[c].data.ty().and_then(|t| t.shape.dims().last().cloned()))
                .map(|d| self.numel(&Shape(vec![d])))
                .unwrap_or(1.0)
        };
        let flops = match kind {
            Kind::MatMul => 2.0 * out_numel * last_dim(0),
            Kind::Region => {
                let ops = ch
                    .last()
                    .and_then(|&e| match crate::optimize::lang::attr_of(eg, e) {
                        Some(crate::optimize::lang::Attr::Expr(x)) => Some(Expr::ops(x)),
                        _ => None,
                    })
                    .unwrap_or(1);
                out_numel * ops as f64
            }
            Kind::Kernel(t) => {
                let def = &registry()[*t as usize];
                match def.name.as_str() {
                    "linear" | "linear_relu" => 2.0 * out_numel * last_dim(0),
                    // q·kᵀ and p·v: 2·(b·h·tq)·tk·(dk + dv), plus the softmax; the
                    // backward recomputes p and does four such products.
                    "attention" | "attention_bwd" => {
                        let rows = in_numel(0) / last_dim(0).max(1.0);
                        let tk = ch
                            .get(1)
                            .and_then(|&c| eg[c].data.ty().map(|t| t.shape.clone()))
                            .and_then(|s| s.dims().iter().rev().nth(1).cloned())
                            .map(|d| self.numel(&Shape(vec![d])))
                            .unwrap_or(ESTIMATE_DIM as f64);
                        let fwd = 2.0 * rows * tk * (last_dim(0) + last_dim(2)) + 5.0 * rows * tk;
                        if def.name == "attention" {
                            fwd
                        } else {
                            2.5 * fwd
                        }
                    }
                    _ => 10.0 * out_numel.max(in_numel(0)),
                }
            }
            Kind::Reduce(_) | Kind::ScatterAdd | Kind::Gather => in_numel(0).max(in_numel(1)),
            _ => out_numel,
        };
        Some((bytes, flops))
    }

    /// The cost of one e-node, in seconds.
    pub fn cost(&self, eg: &EG, node: &KNode, out: &Info) -> f64 {
        match self.work(eg, node, out) {
            // Views cost nothing to launch, but each one is indexing a kernel must do:
            // a token cost makes extraction prefer one view to a chain of them.
            None if matches!(
                node,
                KNode::Op(Kind::Reshape | Kind::Broadcast | Kind::Permute, _)
            ) =>
            {
                1e-12
            }
            None => 0.0,
            Some((bytes, flops)) => {
                let t = self.launch_s + (bytes / self.bytes_per_s).max(flops / self.flops_per_s);
                // A lone elementwise primitive and a one-op region cost the same; prefer
                // the region, so every elementwise kernel is a region.
                match node {
                    KNode::Op(k, _) if crate::optimize::lang::is_elementwise(*k) => {
                        t * (1.0 + 1e-9)
                    }
                    _ => t,
                }
            }
        }
    }
}
