//! The launch order: kernels reordered so that buffers die sooner.
//!
//! In: a [`KernelGraph`] in the extractor's order, a depth-first walk from each graph
//! output in turn. For a training step that order computes the whole backward pass for
//! the first gradient that needs it (the embedding's) and only then the weight gradients
//! of every layer, so each layer's output gradient and input stay alive until the end of
//! the step. Out: the same values, renumbered, with the kernels in a list-scheduled order
//! — of the kernels whose operands are computed, the one that frees the most bytes less
//! the bytes it allocates (every dim estimated as in the memory plan), the earlier one in
//! the old order on a tie — when that order's estimated live peak is lower, or the same
//! with fewer bytes held over the launches; otherwise the graph unchanged. Sources, views
//! and projections come just before their first reader. Values, kernels and their
//! results do not change: only where the memory plan can reuse memory (and so the
//! arena's size) does.

use std::collections::BTreeMap;

use crate::optimize::kernels::{Def, KernelGraph, Value};

/// Reorders `kg`'s kernels when that lowers the estimated memory (see the module).
pub fn reorder(kg: KernelGraph) -> KernelGraph {
    let s = Schedule::of(&kg);
    let old: Vec<usize> = (0..s.kernels.len()).collect();
    let new = s.greedy();
    let (a, b) = (s.memory(&new), s.memory(&old));
    if a.0 < b.0 || (a.0 == b.0 && a.1 < b.1) {
        renumber(kg, &new.iter().map(|&i| s.kernels[i]).collect::<Vec<_>>())
    } else {
        kg
    }
}

/// The kernels of a graph and the buffers they read and write.
struct Schedule {
    /// Kernel values in the old launch order.
    kernels: Vec<usize>,
    /// Per kernel: its buffers (index into `size`), one per output.
    writes: Vec<Vec<usize>>,
    /// Per kernel: the buffers it reads (distinct).
    reads: Vec<Vec<usize>>,
    /// Per kernel: the kernels whose results it reads (distinct).
    deps: Vec<Vec<usize>>,
    /// Estimated bytes of each buffer.
    size: Vec<f64>,
    /// Buffers a graph output reads: alive to the end.
    pinned: Vec<bool>,
}

impl Schedule {
    fn of(kg: &KernelGraph) -> Schedule {
        let mut kernels = Vec::new();
        let mut kernel_of = BTreeMap::new();
        let mut buffer = BTreeMap::new();
        let mut size = Vec::new();
        let mut writes = Vec::new();
        for (v, val) in kg.values.iter().enumerate() {
            if let Def::Kernel { .. } = val.def {
                kernel_of.insert(v, kernels.len());
                kernels.push(v);
                let mut w = Vec::new();
                for (k, ty) in val.types.iter().enumerate() {
                    buffer.insert((v, k), size.len());
                    w.push(size.len());
                    size.push(crate::plan::estimate(&ty.shape.numel()) * 4.0);
                }
                writes.push(w);
            }
        }
        let mut reads = Vec::new();
        let mut deps = Vec::new();
        for &v in &kernels {
            let Def::Kernel { inputs, .. } = &kg.values[v].def else {
                unreachable!("a kernel")
            };
            let mut r: Vec<usize> = Vec::new();
            let mut d: Vec<usize> = Vec::new();
            for &x in inputs {
                if let Some((kv, k)) = kg.result_of(x) {
                    r.push(buffer[&(kv, k)]);
                    d.push(kernel_of[&kv]);
                }
            }
            r.sort_unstable();
            r.dedup();
            d.sort_unstable();
            d.dedup();
            reads.push(r);
            deps.push(d);
        }
        let mut pinned = vec![false; size.len()];
        for (_, v) in &kg.outputs {
            if let Some(r) = kg.result_of(*v) {
                pinned[buffer[&r]] = true;
            }
        }
        Schedule {
            kernels,
            writes,
            reads,
            deps,
            size,
            pinned,
        }
    }

    /// How many kernels read each buffer.
    fn readers(&self) -> Vec<usize> {
        let mut n = vec![0; self.size.len()];
        for r in &self.reads {
            for &b in r {
                n[b] += 1;
            }
        }
        n
    }

    /// The list-scheduled order (kernel indices).
    fn greedy(&self) -> Vec<usize> {
        let n = self.kernels.len();
        let mut left = self.readers();
        let mut waiting: Vec<usize> = self.deps.iter().map(Vec::len).collect();
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (k, d) in self.deps.iter().enumerate() {
            for &j in d {
                users[j].push(k);
            }
        }
        let mut ready: Vec<usize> = (0..n).filter(|&k| waiting[k] == 0).collect();
        let mut order = Vec::with_capacity(n);
        while !ready.is_empty() {
            let score = |k: usize| -> f64 {
                let freed: f64 = self.reads[k]
                    .iter()
                    .filter(|&&b| left[b] == 1 && !self.pinned[b])
                    .map(|&b| self.size[b])
                    .sum();
                let made: f64 = self.writes[k].iter().map(|&b| self.size[b]).sum();
                freed - made
            };
            let (at, _) = ready
                .iter()
                .enumerate()
                .map(|(i, &k)| (i, (score(k), k)))
                .max_by(|(_, (sa, ka)), (_, (sb, kb))| sa.total_cmp(sb).then(kb.cmp(ka)))
                .expect("not empty");
            let k = ready.swap_remove(at);
            order.push(k);
            for &b in &self.reads[k] {
                left[b] -= 1;
            }
            for &u in &users[k] {
                waiting[u] -= 1;
                if waiting[u] == 0 {
                    ready.push(u);
                }
            }
        }
        assert_eq!(order.len(), n, "the kernel graph is acyclic");
        order
    }

    /// The estimated memory of running the kernels in `order`: the live peak, and the
    /// live bytes summed over the launches (what is held over time, which decides how
    /// long memory outside the plan, such as view copies, stays in use). A buffer is live
    /// from the kernel that writes it through the last that reads it (graph outputs to
    /// the end).
    fn memory(&self, order: &[usize]) -> (f64, f64) {
        let mut left = self.readers();
        let (mut live, mut peak, mut area) = (0.0f64, 0.0f64, 0.0f64);
        for &k in order {
            for &b in &self.writes[k] {
                live += self.size[b];
            }
            peak = peak.max(live);
            area += live;
            for &b in &self.reads[k] {
                left[b] -= 1;
                if left[b] == 0 && !self.pinned[b] {
                    live -= self.size[b];
                }
            }
            for &b in &self.writes[k] {
                if left[b] == 0 && !self.pinned[b] {
                    live -= self.size[b];
                }
            }
        }
        (peak, area)
    }
}

/// `kg` with its kernels launched in `order` (kernel values): each source, view and
/// projection just before the first value that needs it (as the extractor places them);
/// values nothing reads at the end.
fn renumber(kg: KernelGraph, order: &[usize]) -> KernelGraph {
    let n = kg.values.len();
    let mut new_of: Vec<Option<usize>> = vec![None; n];
    let mut seq: Vec<usize> = Vec::with_capacity(n);
    // Places `v` after what it needs (sources, views and projections: kernels are placed
    // in `order`, so the kernels `v` needs already are).
    fn place(v: usize, kg: &KernelGraph, new_of: &mut [Option<usize>], seq: &mut Vec<usize>) {
        if new_of[v].is_some() {
            return;
        }
        match &kg.values[v].def {
            Def::View(_, x) | Def::Proj(x, _) => place(*x, kg, new_of, seq),
            Def::Kernel { inputs, .. } => {
                for &x in inputs {
                    place(x, kg, new_of, seq);
                }
            }
            _ => {}
        }
        new_of[v] = Some(seq.len());
        seq.push(v);
    }
    for &k in order {
        place(k, &kg, &mut new_of, &mut seq);
    }
    for v in 0..n {
        place(v, &kg, &mut new_of, &mut seq);
    }
    let map = |v: usize| new_of[v].expect("every value placed");
    let mut index = 0;
    let values: Vec<Value> = seq
        .iter()
        .map(|&v| {
            let val = &kg.values[v];
            let def = match &val.def {
                Def::View(op, x) => Def::View(op.clone(), map(*x)),
                Def::Proj(t, k) => Def::Proj(map(*t), *k),
                Def::Kernel { op, inputs, .. } => {
                    index += 1;
                    Def::Kernel {
                        index: index - 1,
                        op: op.clone(),
                        inputs: inputs.iter().map(|&x| map(x)).collect(),
                    }
                }
                other => other.clone(),
            };
            Value {
                def,
                types: val.types.clone(),
                scope: val.scope.clone(),
            }
        })
        .collect();
    KernelGraph {
        values,
        outputs: kg
            .outputs
            .iter()
            .map(|(s, v)| (s.clone(), map(*v)))
            .collect(),
        ..kg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Op, TensorType, UnaryOp};
    use crate::optimize::extract::Target;
    use crate::optimize::kernels::KernelOp;
    use crate::shape::Shape;

    fn value(def: Def, n: i64) -> Value {
        Value {
            def,
            types: vec![TensorType::new(DType::F32, Shape::consts(&[n]))],
            scope: String::new(),
        }
    }

    fn kernel(index: usize, inputs: &[usize], n: i64) -> Value {
        value(
            Def::Kernel {
                index,
                op: KernelOp::Prim(Op::Unary(UnaryOp::Relu)),
                inputs: inputs.to_vec(),
            },
            n,
        )
    }

    /// A backward pass as the extractor orders it: a chain of layer gradients `d1 → d2 →
    /// d3` (1000 elements each), then the weight gradients `w_i = f(d_i)` (10 elements,
    /// graph outputs) only at the end, so every `d_i` is alive until then.
    fn late_weight_gradients() -> KernelGraph {
        let values = vec![
            value(Def::Input("x".into()), 1000),
            kernel(0, &[0], 1000), // 1: d1
            kernel(1, &[1], 1000), // 2: d2
            kernel(2, &[2], 1000), // 3: d3
            value(
                Def::View(
                    Op::Reshape {
                        shape: Shape::consts(&[1000]),
                    },
                    3,
                ),
                1000,
            ),
            kernel(3, &[1], 10), // 5: w1
            kernel(4, &[2], 10), // 6: w2
            kernel(5, &[4], 10), // 7: w3, through a view
        ];
        KernelGraph {
            name: "backward".into(),
            target: Target::Cpu,
            dims: vec![],
            values,
            outputs: vec![("w1".into(), 5), ("w2".into(), 6), ("w3".into(), 7)],
            objective: None,
            stages: vec![],
            hparams: vec![],
        }
    }

    #[test]
    fn each_weight_gradient_runs_as_soon_as_it_frees_its_operand() {
        let kg = late_weight_gradients();
        let s = Schedule::of(&kg);
        assert_eq!(s.memory(&[0, 1, 2, 3, 4, 5]).0, 4.0 * (3000.0 + 10.0));
        let out = reorder(kg);
        let kinds: Vec<String> = out
            .values
            .iter()
            .map(|v| match &v.def {
                Def::Input(n) => n.clone(),
                Def::View(..) => "view".into(),
                Def::Kernel { index, inputs, .. } => format!("k{index}{inputs:?}"),
                _ => "?".into(),
            })
            .collect();
        // d1; w1 (it allocates least); d2, which frees d1; w2; d3, which frees d2; w3.
        assert_eq!(
            kinds,
            ["x", "k0[0]", "k1[1]", "k2[1]", "k3[3]", "k4[3]", "view", "k5[6]"],
            "{kinds:?}"
        );
        let names: Vec<(&str, usize)> = out.outputs.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        assert_eq!(names, [("w1", 2), ("w2", 4), ("w3", 7)]);
        let s = Schedule::of(&out);
        let order: Vec<usize> = (0..6).collect();
        // At most two layer gradients are alive at once, never three.
        assert_eq!(s.memory(&order).0, 4.0 * (2000.0 + 20.0));
    }
}
