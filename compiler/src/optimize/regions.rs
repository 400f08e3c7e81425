//! Elementwise regions: chains of elementwise ops fused into one kernel.
//!
//! In: the e-graph after the template phase, and how many consumers each e-class has in
//! the source graph. Out: for every e-class that an elementwise primitive computes, one
//! more e-node — a `region` over the region's inputs, carrying the scalar program
//! ([`Expr`]) that computes one output element from one element of each input.
//!
//! A region grows from its root through elementwise operands whose every consumer is in
//! the region (inlining a value read elsewhere would compute it twice; one read by several
//! of the region's ops, as a sigmoid by a SiLU's gradient, is computed once in it), up to
//! [`MAX_OPS`] ops and [`MAX_INPUTS`] inputs. A `broadcast` operand is read in place (the region reads its
//! source with broadcast indexing); a constant becomes a literal. Regions are built from
//! primitive nodes only — a region is its own node kind, so the phase cannot re-match its
//! own output, and one pass reaches a fixpoint.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;

use egg::{Applier, Id, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol, Var};

use crate::ir::{BinaryOp, CmpOp, DType, Float, Graph, IrError, NodeId, Op, TensorType, UnaryOp};
use crate::optimize::analysis::{Info, Types, EG};
use crate::optimize::lang::{add_attr, node_op, Attr, KNode, Kind};

/// Most elementwise ops in one region.
pub const MAX_OPS: usize = 24;
/// Most inputs of one region.
pub const MAX_INPUTS: usize = 8;

/// One step of a region's scalar program; operands are earlier steps.
#[derive(
    Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, serde::Serialize, serde::Deserialize,
)]
pub enum Inst {
    /// Element of input `i` (broadcast to the region's shape).
    In(usize),
    Const(Float, DType),
    Un(UnaryOp, usize),
    Bin(BinaryOp, usize, usize),
    Cmp(CmpOp, usize, usize),
    Where(usize, usize, usize),
    Cast(DType, usize),
    /// Inverted dropout keyed by the element's index in the region's output.
    Dropout(Float, u32, usize),
}

/// A region's scalar program: the last step is the output.
#[derive(
    Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, serde::Serialize, serde::Deserialize,
)]
pub struct Expr {
    pub out: TensorType,
    pub inputs: usize,
    pub insts: Vec<Inst>,
}

impl Expr {
    /// How many ops (not counting inputs and constants).
    pub fn ops(&self) -> usize {
        self.insts
            .iter()
            .filter(|i| !matches!(i, Inst::In(_) | Inst::Const(..)))
            .count()
    }

    /// The program as one line: `t0 = exp(in0); t1 = mul(t0, 0.5)` with operands named
    /// `in<i>`, constants inline, and the result last.
    pub fn text(&self) -> String {
        // Temporaries are numbered by op, from t0.
        let mut temp = vec![0usize; self.insts.len()];
        let mut n = 0;
        for (i, inst) in self.insts.iter().enumerate() {
            if !matches!(inst, Inst::In(_) | Inst::Const(..)) {
                temp[i] = n;
                n += 1;
            }
        }
        let name = |i: usize| -> String {
            match &self.insts[i] {
                Inst::In(k) => format!("in{k}"),
                Inst::Const(v, _) => format!("{v}"),
                _ => format!("t{}", temp[i]),
            }
        };
        let mut s = String::new();
        for (i, inst) in self.insts.iter().enumerate() {
            let rhs = match inst {
                Inst::In(_) | Inst::Const(..) => continue,
                Inst::Un(u, a) => format!("{}({})", Op::Unary(*u).name(), name(*a)),
                Inst::Bin(b, a, c) => {
                    format!("{}({}, {})", Op::Binary(*b).name(), name(*a), name(*c))
                }
                Inst::Cmp(c, a, b) => {
                    format!("{}({}, {})", Op::Compare(*c).name(), name(*a), name(*b))
                }
                Inst::Where(c, a, b) => format!("where({}, {}, {})", name(*c), name(*a), name(*b)),
                Inst::Cast(d, a) => format!("cast<{d}>({})", name(*a)),
                Inst::Dropout(p, st, a) => format!("dropout<p={p},stream={st}>({})", name(*a)),
            };
            if !s.is_empty() {
                s.push_str("; ");
            }
            let _ = write!(s, "t{} = {rhs}", temp[i]);
        }
        if s.is_empty() {
            s = name(self.insts.len() - 1);
        }
        s
    }

    /// Expands the region into primitives in `g` over its input nodes.
    pub fn instantiate(
        &self,
        g: &mut Graph,
        inputs: &[NodeId],
        scope: &str,
    ) -> Result<NodeId, IrError> {
        let shape = self.out.shape.clone();
        let mut v: Vec<NodeId> = Vec::with_capacity(self.insts.len());
        let fit = |g: &mut Graph, x: NodeId| g.broadcast_to(x, &shape, scope);
        for inst in &self.insts {
            let id = match inst {
                Inst::In(k) => {
                    let x = *inputs
                        .get(*k)
                        .ok_or_else(|| IrError::Malformed(format!("region input {k} missing")))?;
                    fit(g, x)?
                }
                Inst::Const(c, d) => {
                    let c = g.add(
                        Op::Const {
                            value: *c,
                            dtype: *d,
                        },
                        &[],
                        scope,
                    )?;
                    fit(g, c)?
                }
                Inst::Un(u, a) => g.add(Op::Unary(*u), &[v[*a]], scope)?,
                Inst::Bin(b, a, c) => g.add(Op::Binary(*b), &[v[*a], v[*c]], scope)?,
                Inst::Cmp(c, a, b) => g.add(Op::Compare(*c), &[v[*a], v[*b]], scope)?,
                Inst::Where(c, a, b) => g.add(Op::Where, &[v[*c], v[*a], v[*b]], scope)?,
                Inst::Cast(d, a) => g.add(Op::Cast { to: *d }, &[v[*a]], scope)?,
                Inst::Dropout(p, st, a) => {
                    g.add(Op::Dropout { p: *p, stream: *st }, &[v[*a]], scope)?
                }
            };
            v.push(id);
        }
        Ok(*v.last().expect("a region has a result"))
    }
}

use crate::optimize::lang::is_elementwise;

/// The first elementwise primitive e-node of a class.
fn elementwise_node(eg: &EG, id: Id) -> Option<&KNode> {
    eg[id]
        .nodes
        .iter()
        .find(|n| matches!(n, KNode::Op(k, _) if is_elementwise(*k)))
}

/// The e-classes a region rooted at `root` may compute inline: elementwise classes of
/// its `shape`, reached from the root through such classes, each of whose consumers in
/// the source graph is one of them (every consumer in the region).
fn inlinable(
    eg: &EG,
    consumers: &HashMap<Id, usize>,
    root: Id,
    shape: &crate::shape::Shape,
) -> HashSet<Id> {
    let operands = |id: Id| -> Vec<Id> {
        let Some(node) = elementwise_node(eg, id) else {
            return Vec::new();
        };
        let mut ops: Vec<Id> = node_op(eg, node)
            .map(|(_, o)| o.into_iter().map(|x| eg.find(x)).collect())
            .unwrap_or_default();
        ops.sort();
        ops.dedup();
        ops
    };
    let fits = |id: Id| match &eg[id].data {
        Info::Tensor { ty, konst } => {
            konst.is_none() && &ty.shape == shape && elementwise_node(eg, id).is_some()
        }
        _ => false,
    };
    // Candidates, at most a few regions' worth: a long chain is cut by MAX_OPS anyway.
    let root = eg.find(root);
    let mut set: HashSet<Id> = HashSet::from([root]);
    let mut stack = vec![root];
    while let Some(id) = stack.pop() {
        for o in operands(id) {
            if set.len() < 4 * MAX_OPS && fits(o) && set.insert(o) {
                stack.push(o);
            }
        }
    }
    // Drop each class read from outside what remains, until none is.
    loop {
        let mut reads: HashMap<Id, usize> = HashMap::new();
        for &id in &set {
            for o in operands(id) {
                *reads.entry(o).or_insert(0) += 1;
            }
        }
        let before = set.len();
        set.retain(|id| {
            let read = reads.get(id).copied().unwrap_or(0);
            *id == root || consumers.get(id).is_some_and(|&c| read >= c)
        });
        if set.len() == before {
            return set;
        }
    }
}

struct Builder<'a> {
    eg: &'a EG,
    inline: HashSet<Id>,
    shape: &'a crate::shape::Shape,
    inputs: Vec<Id>,
    insts: Vec<Inst>,
    ops: usize,
    memo: HashMap<Id, usize>,
}

impl Builder<'_> {
    fn input(&mut self, id: Id) -> usize {
        let k = match self.inputs.iter().position(|&i| i == id) {
            Some(k) => k,
            None => {
                self.inputs.push(id);
                self.inputs.len() - 1
            }
        };
        self.insts.push(Inst::In(k));
        self.insts.len() - 1
    }

    fn operand(&mut self, id: Id, root: bool) -> Option<usize> {
        let id = self.eg.find(id);
        if let Some(&i) = self.memo.get(&id) {
            return Some(i);
        }
        let data = &self.eg[id].data;
        let Info::Tensor { ty, konst } = data else {
            return None;
        };
        let idx = if let (Some(k), false) = (konst, root) {
            self.insts.push(Inst::Const(*k, ty.dtype));
            self.insts.len() - 1
        } else {
            let inline = root
                || (self.inline.contains(&id)
                    && self.ops < MAX_OPS
                    && self.inputs.len() < MAX_INPUTS
                    && &ty.shape == self.shape);
            match (inline, elementwise_node(self.eg, id)) {
                (true, Some(node)) => {
                    let (op, operands) = node_op(self.eg, node).ok()?;
                    self.ops += 1;
                    let mut a = Vec::with_capacity(operands.len());
                    for o in operands {
                        a.push(self.operand(o, false)?);
                    }
                    let inst = match op {
                        Op::Unary(u) => Inst::Un(u, a[0]),
                        Op::Binary(b) => Inst::Bin(b, a[0], a[1]),
                        Op::Compare(c) => Inst::Cmp(c, a[0], a[1]),
                        Op::Where => Inst::Where(a[0], a[1], a[2]),
                        Op::Cast { to } => Inst::Cast(to, a[0]),
                        Op::Dropout { p, stream } => Inst::Dropout(p, stream, a[0]),
                        _ => return None,
                    };
                    self.insts.push(inst);
                    self.insts.len() - 1
                }
                _ => {
                    // Read a broadcast's source in place.
                    let src = self.eg[id].nodes.iter().find_map(|n| match n {
                        KNode::Op(Kind::Broadcast, ch) => Some(self.eg.find(ch[0])),
                        _ => None,
                    });
                    if self.inputs.len() >= MAX_INPUTS && !self.inputs.contains(&src.unwrap_or(id))
                    {
                        return None;
                    }
                    self.input(src.unwrap_or(id))
                }
            }
        };
        self.memo.insert(id, idx);
        Some(idx)
    }
}

/// Builds the region rooted at e-class `root` (`alone`: the root op only).
fn build_region(
    eg: &EG,
    consumers: &HashMap<Id, usize>,
    root: Id,
    alone: bool,
) -> Option<(Expr, Vec<Id>)> {
    let ty = eg[root].data.ty()?.clone();
    let shape = ty.shape.clone();
    let inline = if alone {
        HashSet::new()
    } else {
        inlinable(eg, consumers, root, &shape)
    };
    let mut b = Builder {
        eg,
        inline,
        shape: &shape,
        inputs: Vec::new(),
        insts: Vec::new(),
        ops: 0,
        memo: HashMap::new(),
    };
    b.operand(root, true)?;
    let inputs = b.inputs.clone();
    Some((
        Expr {
            out: ty,
            inputs: inputs.len(),
            insts: b.insts,
        },
        inputs,
    ))
}

struct RegionSearcher;

impl Searcher<KNode, Types> for RegionSearcher {
    fn search_eclass_with_limit(
        &self,
        eg: &EG,
        eclass: Id,
        _limit: usize,
    ) -> Option<SearchMatches<'_, KNode>> {
        elementwise_node(eg, eclass)?;
        Some(SearchMatches {
            eclass,
            substs: vec![Subst::default()],
            ast: None::<std::borrow::Cow<'_, PatternAst<KNode>>>,
        })
    }

    fn vars(&self) -> Vec<Var> {
        vec![]
    }
}

struct RegionApplier {
    consumers: Arc<HashMap<Id, usize>>,
}

impl Applier<KNode, Types> for RegionApplier {
    fn apply_one(
        &self,
        eg: &mut EG,
        eclass: Id,
        _s: &Subst,
        _a: Option<&PatternAst<KNode>>,
        _r: Symbol,
    ) -> Vec<Id> {
        // The largest region, and the root op alone (so that extraction can also cut
        // the chain right below the root, e.g. to keep a bias add inside a `linear`).
        let mut changed = false;
        for alone in [false, true] {
            let Some((expr, inputs)) = build_region(eg, &self.consumers, eclass, alone) else {
                continue;
            };
            let mut children = inputs;
            children.push(add_attr(eg, Attr::Expr(Arc::new(expr))));
            let r = eg.add(KNode::Op(Kind::Region, children));
            changed |= eg.union(eclass, r);
        }
        if changed {
            vec![eclass]
        } else {
            vec![]
        }
    }
}

/// The region phase's one rewrite. `consumers`: how many nodes (and graph outputs) of
/// the source graph use each e-class.
pub fn rules(consumers: HashMap<Id, usize>) -> Vec<Rewrite<KNode, Types>> {
    vec![Rewrite::new(
        "elementwise_region",
        RegionSearcher,
        RegionApplier {
            consumers: Arc::new(consumers),
        },
    )
    .expect("the region rule is well formed")]
}
