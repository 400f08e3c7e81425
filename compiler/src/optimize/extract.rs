//! Extraction: choosing one e-node per needed e-class, by a cost model, without
//! double-counting shared subgraphs.
//!
//! In: the saturated e-graph, the root e-classes (the graph's outputs) and a
//! [`CostModel`] ([`super::cost`]). Out: the chosen e-node of every e-class the roots
//! need.
//!
//! The cost of a choice is the summed own cost of every e-class it needs, each counted
//! once: a subgraph shared by two children (the residual stream feeding Q, K, V and
//! the skip connection) is paid once. Every e-class keeps the *set* of e-classes its
//! best choice needs ([`set::CostSet`], persistent and shared, so a union costs what
//! differs). E-classes are settled cheapest first (Knuth's generalization of
//! Dijkstra's algorithm): an e-node is weighed once, when its last child is settled,
//! and a class is settled at the lowest cost among its weighed e-nodes — no e-node
//! weighed later can be cheaper, since a choice costs at least what each child costs.
//! A cycle made by an identity rewrite is never taken: a child is settled before its
//! parent. [`improve`] then corrects what a greedy choice cannot see.

mod improve;
mod set;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use egg::{Id, Language};

use crate::optimize::analysis::{Info, EG};
pub use crate::optimize::cost::{CostModel, Target, ESTIMATE_DIM};
use crate::optimize::lang::KNode;
use set::CostSet;

/// The chosen e-node per e-class (canonical ids).
pub struct Choice {
    pub node: HashMap<Id, KNode>,
    /// The estimated cost (seconds) of everything the roots need.
    pub cost: f64,
}

/// The e-graph as indices: e-class `c` is `ids[c]`; its e-nodes' own costs and
/// distinct children.
pub(crate) struct Indexed<'a> {
    pub eg: &'a EG,
    pub ids: Vec<Id>,
    pub costs: Vec<Vec<f64>>,
    pub kids: Vec<Vec<Vec<usize>>>,
}

impl<'a> Indexed<'a> {
    fn new(eg: &'a EG, model: &CostModel) -> Indexed<'a> {
        let mut ids: Vec<Id> = eg.classes().map(|c| c.id).collect();
        ids.sort();
        let index: HashMap<Id, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let mut costs = Vec::with_capacity(ids.len());
        let mut kids = Vec::with_capacity(ids.len());
        for &id in &ids {
            let c = &eg[id];
            costs.push(
                c.nodes
                    .iter()
                    .map(|nd| model.cost(eg, nd, &c.data))
                    .collect(),
            );
            kids.push(
                c.nodes
                    .iter()
                    .map(|nd| {
                        let mut ks: Vec<usize> =
                            nd.children().iter().map(|&k| index[&eg.find(k)]).collect();
                        ks.sort_unstable();
                        ks.dedup();
                        ks
                    })
                    .collect(),
            );
        }
        Indexed {
            eg,
            ids,
            costs,
            kids,
        }
    }

    fn len(&self) -> usize {
        self.ids.len()
    }

    fn index_of(&self, id: Id) -> usize {
        self.ids
            .binary_search(&self.eg.find(id))
            .expect("every canonical id is a class")
    }
}

/// The greedy choice: every class's cheapest e-node given its children's choices,
/// settled cheapest first. Returns the choices and the order classes were settled in
/// (children before parents).
fn settle(g: &Indexed) -> (Vec<Option<usize>>, Vec<usize>) {
    let n = g.len();
    // For every class, the (class, e-node) pairs that have it as a child.
    let mut parents: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
    let mut waiting: Vec<Vec<usize>> = Vec::with_capacity(n);
    for c in 0..n {
        let valid = !matches!(g.eg[g.ids[c]].data, Info::Invalid(_));
        waiting.push(
            g.kids[c]
                .iter()
                .enumerate()
                .map(|(ni, ks)| {
                    if valid {
                        for &k in ks {
                            parents[k].push((c, ni));
                        }
                        ks.len()
                    } else {
                        usize::MAX
                    }
                })
                .collect(),
        );
    }
    let mut sets: Vec<Option<CostSet>> = vec![None; n];
    let mut weighed: Weighed = g.costs.iter().map(|c| vec![None; c.len()]).collect();
    let mut best = vec![f64::INFINITY; n];
    let mut chosen: Vec<Option<usize>> = vec![None; n];
    let mut order = Vec::new();
    // Costs are finite and non-negative, so their bits order as they do.
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    // The e-nodes without children first.
    let leaves: Vec<(usize, usize)> = (0..n)
        .flat_map(|c| (0..waiting[c].len()).map(move |ni| (c, ni)))
        .filter(|&(c, ni)| waiting[c][ni] == 0)
        .collect();
    for at in leaves {
        weigh(g, at, &sets, &mut weighed, &mut best, &mut heap);
    }
    while let Some(Reverse((bits, c))) = heap.pop() {
        if chosen[c].is_some() || bits != best[c].to_bits() {
            continue;
        }
        // Among the weighed e-nodes, the first that is cheaper than every earlier one.
        let mut pick: Option<(usize, f64)> = None;
        for (ni, w) in weighed[c].iter().enumerate() {
            if let Some((t, _)) = w {
                if pick.is_none_or(|(_, b)| *t < b - 1e-15) {
                    pick = Some((ni, *t));
                }
            }
        }
        let ni = pick.expect("a class on the heap has a weighed e-node").0;
        let (_, u) = weighed[c][ni].take().expect("picked");
        weighed[c].clear();
        sets[c] = Some(u.with(c as u32, g.costs[c][ni]));
        chosen[c] = Some(ni);
        order.push(c);
        for &(p, pni) in &parents[c] {
            if chosen[p].is_some() {
                continue;
            }
            waiting[p][pni] -= 1;
            if waiting[p][pni] == 0 {
                weigh(g, (p, pni), &sets, &mut weighed, &mut best, &mut heap);
            }
        }
    }
    (chosen, order)
}

type Weighed = Vec<Vec<Option<(f64, CostSet)>>>;

/// Weighs e-node `ni` of class `c`, whose children are all settled.
fn weigh(
    g: &Indexed,
    (c, ni): (usize, usize),
    sets: &[Option<CostSet>],
    weighed: &mut Weighed,
    best: &mut [f64],
    heap: &mut BinaryHeap<Reverse<(u64, usize)>>,
) {
    let mut u = CostSet::default();
    for &k in &g.kids[c][ni] {
        u = u.union(
            sets[k]
                .as_ref()
                .expect("a weighed e-node's children are settled"),
        );
    }
    let t = u.sum() + g.costs[c][ni];
    weighed[c][ni] = Some((t, u));
    if t < best[c] {
        best[c] = t;
        heap.push(Reverse((t.to_bits(), c)));
    }
}

/// DAG extraction of the `roots`.
pub fn extract(eg: &EG, roots: &[Id], model: &CostModel) -> Result<Choice, String> {
    let g = Indexed::new(eg, model);
    let (chosen, order) = settle(&g);
    let root_idx: Vec<usize> = roots.iter().map(|&r| g.index_of(r)).collect();
    let mut fix = improve::Improve::new(&g, chosen, &order, &root_idx)?;
    fix.run();
    let (chosen, needed) = fix.into_choice();
    let mut node = HashMap::new();
    let mut cost = 0.0;
    for c in 0..g.len() {
        if needed[c] {
            let ni = chosen[c].expect("needed classes are chosen");
            cost += g.costs[c][ni];
            node.insert(g.ids[c], eg[g.ids[c]].nodes[ni].clone());
        }
    }
    Ok(Choice { node, cost })
}
