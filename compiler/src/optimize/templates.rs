//! Fused-kernel templates: what each kernel computes, and the rewrites that find it.
//!
//! In: nothing (the templates are built once, from code). Out: the [`registry`] of
//! [`TemplateDef`]s and the egg rewrites of the template phase ([`rules`]).
//!
//! A template is a small graph of IR primitives over symbolic inputs, built by the same
//! steps the prelude elaborates to (`attention` is `softmax(where(mask, q @ kᵀ · scale,
//! fill)) @ v`, `add_layer_norm` is `normalize(x + y)`, …). That one graph is three
//! things at once:
//!
//! - the **left side** of the rewrite: the cone of each template output, with the
//!   template's inputs, shapes, dims and data integers as variables ([`TPattern`]), is
//!   matched against the e-graph as a DAG (a node shared inside the template must be one
//!   e-class in the match);
//! - the **backward** templates: the compiler's own autodiff pass, run on the forward
//!   template with an upstream-gradient input as the seed, produces exactly the nodes it
//!   produces in a real `train_step` — so the backward left sides are derived, not
//!   written by hand, and cannot drift from the autodiff rules;
//! - the kernel's **meaning**: a kernel node is expanded back into its template
//!   ([`TemplateDef::instantiate`]) to validate an optimized program against the
//!   unoptimized graph with the reference executor.
//!
//! Shape guards are structural: axes and permutations in a template are literals, so a
//! softmax template over the last axis of a rank-4 tensor does not match a softmax over
//! another axis; bias and norm parameters are rank-1 inputs broadcast along the last
//! axis, and a match binds them only when the e-graph's types agree.
//!
//! A multi-output kernel (an attention backward gives dq, dk and dv) is one e-node whose
//! e-class is a tuple; each output is a `proj` of it. One rule per output rewrites that
//! output's e-class; the rules of one match build the same e-node (hash-consed), so
//! extraction pays for the kernel once. An output whose cone does not reach every input
//! (dv does not depend on v) joins the kernel node another output's rule built.

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::OnceLock;

use egg::{Id, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Var};

use crate::ir::{Float, Graph, IrError, NodeId, Op, TensorType};
use crate::optimize::analysis::{Info, Types, EG};
pub use crate::optimize::kind::TemplateKind;
use crate::optimize::lang::{attr_of, op_parts, Attr, KNode, Kind};
use crate::shape::{Dim, Shape};

mod applier;
mod graphs;
mod registry;
pub use applier::TemplateApplier;

/// A fused kernel's definition.
pub struct TemplateDef {
    /// The kernel kind, which every backend matches exhaustively.
    pub kind: TemplateKind,
    /// Its name (`attention`, `attention_bwd`, `linear`, …).
    pub name: String,
    /// Which form of the kind (`mask=key`, `rank=3`), shown in the kernel graph.
    pub variant: String,
    /// The template graph: inputs with symbolic shapes, the forward nodes and, for a
    /// backward kernel, the gradient nodes.
    pub graph: Graph,
    /// The kernel's tensor operands, in e-node child order.
    pub inputs: Vec<NodeId>,
    /// Attribute operands (a pad id): placeholder values in the template graph, replaced
    /// by the matched values; e-node children after the tensor operands.
    pub attr_inputs: Vec<Attr>,
    /// The attribute operands' names (`pad`, `p`, `stream`).
    pub attr_names: Vec<&'static str>,
    /// The kernel's outputs.
    pub outputs: Vec<NodeId>,
}

/// The sentinel pad id of the `xent_ls` template (replaced by the matched pad id).
const PAD_SENTINEL: i64 = -1_000_003;
/// The sentinel dropout probability and stream of `embed_pe[dropout]`.
const P_SENTINEL: f64 = 0.123_456_789_012_345;
const STREAM_SENTINEL: i64 = 1_000_007;

/// What a layer-norm kernel (`add_layer_norm`, `add_layer_norm_bwd`) reads in its second
/// operand slot, `y`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LnForm {
    /// `normalize(x + y)`.
    Add,
    /// `normalize(x)` (the `plain` form); the slot is not read.
    Plain,
    /// `normalize(x)`, backward only (`plain carry`): the slot holds the gradient that
    /// reaches `x` from a later use (a pre-LN block's residual path), added to `dx`.
    Carry,
}

/// A layer norm's operands in the adding form's order, `[x, y, …]`: a `plain` one's `x`
/// stands in for the `y` its kernel does not read, so every backend launches every form
/// with one argument list.
/// An RMSNorm forward's `γ` stands in for the `β` (slot 3) it does not read.
pub fn layer_norm_operands<T: Copy>(
    ins: &[T],
    form: LnForm,
    rms_forward: bool,
) -> std::borrow::Cow<'_, [T]> {
    if (form != LnForm::Plain && !rms_forward) || ins.is_empty() {
        return std::borrow::Cow::Borrowed(ins);
    }
    let mut v = Vec::with_capacity(ins.len() + 2);
    v.push(ins[0]);
    if form == LnForm::Plain {
        v.push(ins[0]);
    }
    v.extend_from_slice(&ins[1..]);
    if rms_forward && v.len() > 2 {
        v.insert(3, v[2]);
    }
    std::borrow::Cow::Owned(v)
}

impl TemplateDef {
    /// The form of an `add_layer_norm` or its backward, from its variant (`plain`,
    /// `plain carry`, else adding).
    pub fn layer_norm_form(&self) -> LnForm {
        let has = |w: &str| self.variant.split_whitespace().any(|v| v == w);
        match (has("plain"), has("carry")) {
            (false, _) => LnForm::Add,
            (true, false) => LnForm::Plain,
            (true, true) => LnForm::Carry,
        }
    }

    /// Whether an `add_layer_norm` (or its backward) is RMSNorm's (`rms`: no mean, no β).
    pub fn layer_norm_rms(&self) -> bool {
        self.variant.split_whitespace().any(|w| w == "rms")
    }

    /// Whether an `add_layer_norm` adds `y` to `x` before normalizing.
    pub fn layer_norm_adds(&self) -> bool {
        self.layer_norm_form() == LnForm::Add
    }

    /// Binds the template's symbolic dims to the dims of actual operand types.
    pub fn unify(&self, tys: &[TensorType]) -> Result<BTreeMap<String, Dim>, String> {
        if tys.len() != self.inputs.len() {
            return Err(format!(
                "{} takes {} operands, got {}",
                self.name,
                self.inputs.len(),
                tys.len()
            ));
        }
        let mut map: BTreeMap<String, Dim> = BTreeMap::new();
        for (&i, ty) in self.inputs.iter().zip(tys) {
            let want = self.graph.ty(i);
            if want.dtype != ty.dtype || want.shape.rank() != ty.shape.rank() {
                return Err(format!(
                    "{} operand {} must be {want}, got {ty}",
                    self.name,
                    self.graph.source_name(i).unwrap_or("?")
                ));
            }
            for (w, d) in want.shape.dims().iter().zip(ty.shape.dims()) {
                if let Some(s) = w.as_sym() {
                    match map.get(s) {
                        Some(prev) if prev != d => {
                            return Err(format!("{}: dim `{s}` is both {prev} and {d}", self.name))
                        }
                        _ => {
                            map.insert(s.to_string(), d.clone());
                        }
                    }
                } else if w != d {
                    return Err(format!("{}: dim {w} does not fit {d}", self.name));
                }
            }
        }
        Ok(map)
    }

    /// The output types for operands of the given types.
    pub fn output_types(&self, tys: &[TensorType]) -> Result<Vec<TensorType>, String> {
        let map = self.unify(tys)?;
        Ok(self
            .outputs
            .iter()
            .map(|&o| {
                let t = self.graph.ty(o);
                TensorType::new(t.dtype, subst_shape(&t.shape, &map))
            })
            .collect())
    }

    /// Expands the kernel into primitives in `g`: the nodes of its outputs' cones, with
    /// the template's dims and attribute placeholders replaced. Returns the outputs.
    pub fn instantiate(
        &self,
        g: &mut Graph,
        operands: &[NodeId],
        attrs: &[Attr],
        scope: &str,
    ) -> Result<Vec<NodeId>, IrError> {
        let tys: Vec<TensorType> = operands.iter().map(|&o| g.ty(o).clone()).collect();
        let map = self.unify(&tys).map_err(IrError::Type)?;
        let mut live = vec![false; self.graph.len()];
        let mut stack: Vec<NodeId> = self.outputs.clone();
        while let Some(id) = stack.pop() {
            if !std::mem::replace(&mut live[id.index()], true) {
                stack.extend(self.graph.node(id).inputs.iter().copied());
            }
        }
        let mut val: Vec<Option<NodeId>> = vec![None; self.graph.len()];
        for (&i, &o) in self.inputs.iter().zip(operands) {
            val[i.index()] = Some(o);
        }
        for (i, node) in self.graph.nodes.iter().enumerate() {
            if !live[i] || val[i].is_some() {
                continue;
            }
            if matches!(node.op, Op::Input { .. } | Op::Param { .. }) {
                return Err(IrError::Malformed(format!(
                    "{}: template input {} has no operand",
                    self.name,
                    self.graph.source_name(NodeId(i as u32)).unwrap_or("?")
                )));
            }
            let op = subst_op(&node.op, &map, &self.attr_inputs, attrs);
            let ins: Vec<NodeId> = node
                .inputs
                .iter()
                .map(|x| val[x.index()].expect("operands come first"))
                .collect();
            val[i] = Some(g.add(op, &ins, scope)?);
        }
        Ok(self
            .outputs
            .iter()
            .map(|o| val[o.index()].expect("outputs are live"))
            .collect())
    }
}

fn subst_shape(s: &Shape, map: &BTreeMap<String, Dim>) -> Shape {
    Shape(s.dims().iter().map(|d| d.subst(map)).collect())
}

/// The matched value of an attribute placeholder.
fn replaced(a: &Attr, from: &[Attr], to: &[Attr]) -> Option<Attr> {
    from.iter()
        .zip(to)
        .find(|(f, _)| *f == a)
        .map(|(_, t)| t.clone())
}

fn subst_op(op: &Op, map: &BTreeMap<String, Dim>, from: &[Attr], to: &[Attr]) -> Op {
    let d = |x: &Dim| x.subst(map);
    let s = |x: &Shape| subst_shape(x, map);
    match op {
        Op::Reshape { shape } => Op::Reshape { shape: s(shape) },
        Op::Broadcast { shape } => Op::Broadcast { shape: s(shape) },
        Op::ScatterAdd { rows } => Op::ScatterAdd { rows: d(rows) },
        Op::CausalMask { q, k } => Op::CausalMask { q: d(q), k: d(k) },
        Op::Arange { start, len } => Op::Arange {
            start: d(start),
            len: d(len),
        },
        Op::OneHot { depth } => Op::OneHot { depth: d(depth) },
        Op::Slice { axis, start, len } => Op::Slice {
            axis: *axis,
            start: d(start),
            len: d(len),
        },
        Op::PadMask { pad } => Op::PadMask {
            pad: match replaced(&Attr::Int(*pad), from, to) {
                Some(Attr::Int(t)) => t,
                _ => *pad,
            },
        },
        Op::Dropout { p, stream } => Op::Dropout {
            p: match replaced(&Attr::F(*p), from, to) {
                Some(Attr::F(t)) => t,
                _ => *p,
            },
            stream: match replaced(&Attr::Int(i64::from(*stream)), from, to) {
                Some(Attr::Int(t)) => u32::try_from(t).unwrap_or(*stream),
                _ => *stream,
            },
        },
        other => other.clone(),
    }
}

/// Every template, in a fixed order (the e-node kind `Kernel(i)` indexes it).
pub fn registry() -> &'static [TemplateDef] {
    static REG: OnceLock<Vec<TemplateDef>> = OnceLock::new();
    REG.get_or_init(registry::build)
}

// ---------------------------------------------------------------------------------------
// Patterns: a template output's cone as a DAG to match against the e-graph.

/// A pattern node.
#[derive(Clone, Debug)]
enum PNode {
    /// A variable (template input, shape, dim or data integer), by slot.
    Var(usize),
    Attr(Attr),
    Op(Kind, Vec<usize>),
}

/// The left side of a template rule.
pub struct TPattern {
    nodes: Vec<PNode>,
    root: usize,
    vars: Vec<Var>,
    /// Pattern node of each kernel operand (`None`: not in this output's cone).
    operand_nodes: Vec<Option<usize>>,
    attr_nodes: Vec<Option<usize>>,
}

/// Attributes that are data (shapes, dims, integers) match any value; axes, permutations,
/// dtypes and constants are structure and must be equal.
fn attr_is_var(a: &Attr, kind: Kind) -> bool {
    match a {
        Attr::Shape(_) | Attr::Dim(_) | Attr::Int(_) => true,
        Attr::F(_) => kind == Kind::Dropout,
        _ => false,
    }
}

impl TPattern {
    fn new(def: &TemplateDef, output: usize) -> TPattern {
        let g = &def.graph;
        let mut nodes: Vec<PNode> = Vec::new();
        let mut vars: Vec<Var> = Vec::new();
        let mut of_node: HashMap<NodeId, usize> = HashMap::new();
        let mut of_attr: HashMap<Attr, usize> = HashMap::new();
        let mut lit_attr: HashMap<Attr, usize> = HashMap::new();
        fn new_var(nodes: &mut Vec<PNode>, vars: &mut Vec<Var>) -> usize {
            let slot = vars.len();
            vars.push(Var::from_str(&format!("?v{slot}")).expect("a valid variable name"));
            nodes.push(PNode::Var(slot));
            nodes.len() - 1
        }
        // Post-order walk of the cone (explicit stack: templates can be deep).
        let root = def.outputs[output];
        let mut stack = vec![(root, false)];
        while let Some((id, expanded)) = stack.pop() {
            if of_node.contains_key(&id) {
                continue;
            }
            let node = g.node(id);
            if matches!(node.op, Op::Input { .. }) {
                let p = new_var(&mut nodes, &mut vars);
                of_node.insert(id, p);
                continue;
            }
            if !expanded {
                stack.push((id, true));
                for &c in node.inputs.iter().rev() {
                    stack.push((c, false));
                }
                continue;
            }
            let (kind, attrs) = op_parts(&node.op);
            let mut kids: Vec<usize> = node.inputs.iter().map(|c| of_node[c]).collect();
            for a in attrs {
                let p = if attr_is_var(&a, kind) {
                    match of_attr.get(&a) {
                        Some(&p) => p,
                        None => {
                            let p = new_var(&mut nodes, &mut vars);
                            of_attr.insert(a, p);
                            p
                        }
                    }
                } else {
                    match lit_attr.get(&a) {
                        Some(&p) => p,
                        None => {
                            nodes.push(PNode::Attr(a.clone()));
                            lit_attr.insert(a, nodes.len() - 1);
                            nodes.len() - 1
                        }
                    }
                };
                kids.push(p);
            }
            nodes.push(PNode::Op(kind, kids));
            of_node.insert(id, nodes.len() - 1);
        }
        let operand_nodes = def.inputs.iter().map(|i| of_node.get(i).copied()).collect();
        let attr_nodes = def
            .attr_inputs
            .iter()
            .map(|a| of_attr.get(a).copied())
            .collect();
        TPattern {
            root: of_node[&root],
            nodes,
            vars,
            operand_nodes,
            attr_nodes,
        }
    }

    fn root_kind(&self) -> Kind {
        match &self.nodes[self.root] {
            PNode::Op(k, _) => *k,
            _ => unreachable!("template roots are ops"),
        }
    }

    /// Every way the pattern node `p` matches e-class `class`, extending `st`.
    fn match_node(
        &self,
        eg: &EG,
        p: usize,
        class: Id,
        st: Vec<Option<Id>>,
        out: &mut Vec<Vec<Option<Id>>>,
        budget: &mut usize,
    ) {
        if *budget == 0 {
            return;
        }
        *budget -= 1;
        let class = eg.find(class);
        if let Some(b) = st[p] {
            if b == class {
                out.push(st);
            }
            return;
        }
        match &self.nodes[p] {
            PNode::Var(_) => {
                let mut st = st;
                st[p] = Some(class);
                out.push(st);
            }
            PNode::Attr(a) => {
                if attr_of(eg, class) == Some(a) {
                    let mut st = st;
                    st[p] = Some(class);
                    out.push(st);
                }
            }
            PNode::Op(kind, kids) => {
                for n in &eg[class].nodes {
                    let KNode::Op(k2, ch) = n else { continue };
                    if k2 != kind || ch.len() != kids.len() {
                        continue;
                    }
                    let mut sols = {
                        let mut s = st.clone();
                        s[p] = Some(class);
                        vec![s]
                    };
                    for (i, &kp) in kids.iter().enumerate() {
                        let mut next = Vec::new();
                        for s in sols {
                            self.match_node(eg, kp, ch[i], s, &mut next, budget);
                        }
                        sols = next;
                        if sols.is_empty() {
                            break;
                        }
                    }
                    out.extend(sols);
                }
            }
        }
    }
}

/// Searches one template output's pattern.
pub struct TemplateSearcher {
    pat: &'static TPattern,
}

impl Searcher<KNode, Types> for TemplateSearcher {
    fn search_eclass_with_limit(
        &self,
        eg: &EG,
        eclass: Id,
        limit: usize,
    ) -> Option<SearchMatches<'_, KNode>> {
        let kind = self.pat.root_kind();
        if !eg[eclass]
            .nodes
            .iter()
            .any(|n| matches!(n, KNode::Op(k, _) if *k == kind))
        {
            return None;
        }
        let mut sols = Vec::new();
        let mut budget = 200_000;
        self.pat.match_node(
            eg,
            self.pat.root,
            eclass,
            vec![None; self.pat.nodes.len()],
            &mut sols,
            &mut budget,
        );
        if sols.is_empty() {
            return None;
        }
        let substs: Vec<Subst> = sols
            .into_iter()
            .take(limit.min(8))
            .map(|st| {
                let mut s = Subst::with_capacity(self.pat.vars.len());
                for (p, n) in self.pat.nodes.iter().enumerate() {
                    if let (PNode::Var(slot), Some(id)) = (n, st[p]) {
                        s.insert(self.pat.vars[*slot], id);
                    }
                }
                s
            })
            .collect();
        Some(SearchMatches {
            eclass,
            substs,
            ast: None::<std::borrow::Cow<'_, PatternAst<KNode>>>,
        })
    }

    fn vars(&self) -> Vec<Var> {
        self.pat.vars.clone()
    }
}

/// The template phase's rewrites: one per template output, named `kind[variant]/i`.
pub fn rules() -> Vec<Rewrite<KNode, Types>> {
    static PATS: OnceLock<Vec<(u16, usize, TPattern)>> = OnceLock::new();
    let pats = PATS.get_or_init(|| {
        let mut v = Vec::new();
        for (t, def) in registry().iter().enumerate() {
            for o in 0..def.outputs.len() {
                v.push((t as u16, o, TPattern::new(def, o)));
            }
        }
        v
    });
    pats.iter()
        .map(|(t, o, pat)| {
            let def = &registry()[*t as usize];
            let name = if def.outputs.len() > 1 {
                format!("{}[{}]/{}", def.name, def.variant, o)
            } else {
                format!("{}[{}]", def.name, def.variant)
            };
            Rewrite::new(
                name,
                TemplateSearcher { pat },
                TemplateApplier {
                    template: *t,
                    output: *o,
                    pat,
                },
            )
            .expect("template rules are well formed")
        })
        .collect()
}

/// The kernel's attribute text: its variant, constant scalar operands and attributes.
pub fn describe(def: &TemplateDef, operand_konst: &[Option<f64>], attrs: &[Attr]) -> String {
    let mut parts = vec![def.variant.clone()];
    for (i, &op) in def.inputs.iter().enumerate() {
        if def.graph.ty(op).shape.rank() == 0 {
            if let Some(k) = operand_konst.get(i).copied().flatten() {
                parts.push(format!(
                    "{}={}",
                    def.graph.source_name(op).unwrap_or("?"),
                    Float::new(k)
                ));
            }
        }
    }
    for (name, a) in def.attr_names.iter().zip(attrs) {
        parts.push(format!("{name}={a}"));
    }
    parts.join(" ")
}
