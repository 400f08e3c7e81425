//! Extraction: choosing one e-node per needed e-class, by a cost model, without
//! double-counting shared subgraphs.
//!
//! In: the saturated e-graph, the root e-classes (the graph's outputs) and a
//! [`CostModel`]. Out: the chosen e-node of every e-class the roots need.
//!
//! Cost of one kernel: `launch + max(bytes / bandwidth, flops / peak)` ([`CostModel`]),
//! one constant set per target. Views (reshape, broadcast, permute), sources, constants,
//! attributes and tuple projections are free: they launch nothing.
//!
//! The algorithm is the greedy DAG extractor (as in extraction-gym's `greedy-dag`):
//! every e-class keeps the *set* of e-classes its best choice needs, and the cost of a
//! choice is the sum of the own costs over the union of its children's sets plus its
//! own — a subgraph shared by two children (the residual stream feeding Q, K, V and the
//! skip connection) is paid once. Sets are bitsets, so a union is a few hundred word
//! operations. Passes repeat until nothing improves; a choice whose set contains its
//! own e-class (a cycle made by an identity rewrite) is never taken.

use std::collections::{BTreeMap, HashMap};

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

/// A fixed-size set of e-classes.
#[derive(Clone)]
struct BitSet(Vec<u64>);

impl BitSet {
    fn new(n: usize) -> BitSet {
        BitSet(vec![0; n.div_ceil(64)])
    }
    fn insert(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    fn contains(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
    fn union(&mut self, o: &BitSet) {
        for (a, b) in self.0.iter_mut().zip(&o.0) {
            *a |= b;
        }
    }
    fn sum(&self, own: &[f64]) -> f64 {
        let mut s = 0.0;
        for (w, &bits) in self.0.iter().enumerate() {
            let mut b = bits;
            while b != 0 {
                let t = b.trailing_zeros() as usize;
                s += own[w * 64 + t];
                b &= b - 1;
            }
        }
        s
    }
}

/// The chosen e-node per e-class (canonical ids).
pub struct Choice {
    pub node: HashMap<Id, KNode>,
    /// The estimated cost (seconds) of everything the roots need.
    pub cost: f64,
}

/// Greedy DAG extraction of the `roots`.
pub fn extract(eg: &EG, roots: &[Id], model: &CostModel) -> Result<Choice, String> {
    let mut ids: Vec<Id> = eg.classes().map(|c| c.id).collect();
    ids.sort();
    let index: HashMap<Id, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let n = ids.len();
    // Own cost of every e-node, computed once.
    let costs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&id| {
            let c = &eg[id];
            c.nodes
                .iter()
                .map(|nd| model.cost(eg, nd, &c.data))
                .collect()
        })
        .collect();
    let mut own = vec![0.0f64; n];
    let mut total = vec![f64::INFINITY; n];
    let mut chosen: Vec<Option<usize>> = vec![None; n];
    let mut sets: Vec<Option<BitSet>> = vec![None; n];
    for _pass in 0..100 {
        let mut changed = false;
        for (ci, &id) in ids.iter().enumerate() {
            let class = &eg[id];
            if matches!(class.data, Info::Invalid(_)) {
                continue;
            }
            for (ni, node) in class.nodes.iter().enumerate() {
                let kids = node.children();
                let mut set = BitSet::new(n);
                let mut ok = true;
                for &k in kids {
                    let k = index[&eg.find(k)];
                    match &sets[k] {
                        Some(s) => set.union(s),
                        None => {
                            ok = false;
                            break;
                        }
                    }
                }
                if !ok || set.contains(ci) {
                    continue;
                }
                let c = costs[ci][ni];
                let t = set.sum(&own) + c;
                if t < total[ci] - 1e-15 {
                    total[ci] = t;
                    own[ci] = c;
                    chosen[ci] = Some(ni);
                    set.insert(ci);
                    sets[ci] = Some(set);
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    // The greedy choice cannot see that a multi-output kernel chosen for one output is
    // already paid for when it weighs another output (an attention backward chosen for
    // dq and dk still looks expensive from dv). Improve: switch a needed e-class to a
    // cheaper e-node whose children are all needed anyway (and do not need the class),
    // or to one as cheap when that frees something (a loss-scaled cross-entropy's loss
    // taken from the seeded kernel the gradient needs, not from an unseeded one), until
    // nothing changes.
    let root_idx: Vec<usize> = roots.iter().map(|&r| index[&eg.find(r)]).collect();
    let kids = |ci: usize, ni: usize| -> Vec<usize> {
        eg[ids[ci]].nodes[ni]
            .children()
            .iter()
            .map(|&k| index[&eg.find(k)])
            .collect()
    };
    let reach = |chosen: &[Option<usize>], from: &[usize]| -> Result<Vec<bool>, String> {
        let mut seen = vec![false; n];
        let mut stack: Vec<usize> = from.to_vec();
        while let Some(c) = stack.pop() {
            if std::mem::replace(&mut seen[c], true) {
                continue;
            }
            let ni = chosen[c].ok_or_else(|| {
                format!(
                    "e-class {} has no extractable e-node ({:?})",
                    ids[c], eg[ids[c]].data
                )
            })?;
            stack.extend(kids(c, ni));
        }
        Ok(seen)
    };
    // The summed own cost of the needed classes' chosen e-nodes.
    let total_of = |needed: &[bool], chosen: &[Option<usize>]| -> f64 {
        (0..n)
            .filter(|&c| needed[c])
            .map(|c| chosen[c].map_or(0.0, |ni| costs[c][ni]))
            .sum()
    };
    // Consumers (larger ids) first, and the needed set recomputed after every switch, so
    // a value a switch frees is not then used to justify another switch.
    for _round in 0..50 {
        let mut needed = reach(&chosen, &root_idx)?;
        let mut changed = false;
        for c in (0..n).rev() {
            if !needed[c] {
                continue;
            }
            let cur = chosen[c].expect("needed classes are chosen");
            for ni in 0..costs[c].len() {
                if ni == cur || costs[c][ni] > costs[c][cur] + 1e-15 {
                    continue;
                }
                let cheaper = costs[c][ni] < costs[c][cur] - 1e-15;
                let ks = kids(c, ni);
                if ks.iter().any(|&k| !needed[k] || k == c) {
                    continue;
                }
                if reach(&chosen, &ks)?[c] {
                    continue;
                }
                chosen[c] = Some(ni);
                let after = reach(&chosen, &root_idx)?;
                if !cheaper && total_of(&after, &chosen) >= total_of(&needed, &chosen) - 1e-15 {
                    // As cheap and freeing nothing: keep the greedy choice.
                    chosen[c] = Some(cur);
                    continue;
                }
                changed = true;
                needed = after;
                break;
            }
        }
        if !changed {
            break;
        }
    }
    let needed = reach(&chosen, &root_idx)?;
    let mut node = HashMap::new();
    let mut cost = 0.0;
    for c in 0..n {
        if needed[c] {
            let ni = chosen[c].expect("needed classes are chosen");
            cost += costs[c][ni];
            node.insert(ids[c], eg[ids[c]].nodes[ni].clone());
        }
    }
    let _ = &own;
    Ok(Choice { node, cost })
}

use egg::Language;
