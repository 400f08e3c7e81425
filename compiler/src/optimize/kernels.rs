//! The kernel graph: the extracted program as a list of kernels.
//!
//! In: the e-graph, the extraction's choice per e-class, the output e-classes. Out: a
//! [`KernelGraph`]: sources, views (reshape / permute / broadcast — no kernel, a change of
//! indexing), kernels in a topological launch order (kind, operands, output types,
//! attributes, and for a region its scalar program), tuple projections, and the named
//! outputs. This is what scheduling and the backends consume, one kernel at a time.
//!
//! The text form ([`KernelGraph::text`]) is deterministic: values are numbered in a
//! depth-first post-order from the outputs, operands in order, so the same graph and
//! options give byte-identical text. [`KernelGraph::to_graph`] expands every kernel back
//! into IR primitives (each template through its definition), for validation.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;

use egg::{Id, Language};
use serde::{Deserialize, Serialize};

use crate::ir::{DType, Float, Graph, IrError, NodeId, Op, TensorType};
use crate::optimize::analysis::{Info, EG};
use crate::optimize::extract::{CostModel, Target};
use crate::optimize::lang::{attr_of, node_op, Attr, KNode, Kind};
use crate::optimize::regions::Expr;
use crate::optimize::templates::{describe, registry};
use crate::printer::op_attrs;

/// What a kernel computes.
///
/// Serialized with a template by its name and variant (not its registry index, which
/// changes when templates are added), resolved back through [`registry`] on load.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(into = "KernelOpRepr", try_from = "KernelOpRepr")]
pub enum KernelOp {
    /// One primitive op (a matmul, a reduction, a gather, …).
    Prim(Op),
    /// A fused template (index into [`registry`]) with its attribute operands.
    Template { id: u16, attrs: Vec<Attr> },
    /// An elementwise region.
    Region(Arc<Expr>),
}

/// How a value is defined.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Def {
    Input(String),
    Param(String),
    Const(Float, DType),
    /// A reshape, permute or broadcast of another value: indexing, not a kernel.
    View(Op, usize),
    Kernel {
        /// Launch position among the kernels.
        index: usize,
        op: KernelOp,
        inputs: Vec<usize>,
    },
    /// Output `i` of a multi-output kernel.
    Proj(usize, u8),
}

/// A value of the kernel graph.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Value {
    pub def: Def,
    /// One type, or one per output of a multi-output kernel.
    pub types: Vec<TensorType>,
    pub scope: String,
}

/// The extracted program.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KernelGraph {
    pub name: String,
    pub target: Target,
    pub dims: Vec<String>,
    pub values: Vec<Value>,
    pub outputs: Vec<(String, usize)>,
    pub objective: Option<String>,
    pub stages: Vec<String>,
    pub hparams: Vec<(String, String)>,
}

/// The serialized form of [`KernelOp`]: a template by name and variant.
#[derive(Serialize, Deserialize)]
#[serde(rename = "KernelOp")]
enum KernelOpRepr {
    Prim(Op),
    Template {
        name: String,
        variant: String,
        attrs: Vec<Attr>,
    },
    Region(Arc<Expr>),
}

impl From<KernelOp> for KernelOpRepr {
    fn from(op: KernelOp) -> KernelOpRepr {
        match op {
            KernelOp::Prim(op) => KernelOpRepr::Prim(op),
            KernelOp::Template { id, attrs } => {
                let t = &registry()[id as usize];
                KernelOpRepr::Template {
                    name: t.name.clone(),
                    variant: t.variant.clone(),
                    attrs,
                }
            }
            KernelOp::Region(e) => KernelOpRepr::Region(e),
        }
    }
}

impl TryFrom<KernelOpRepr> for KernelOp {
    type Error = String;

    fn try_from(r: KernelOpRepr) -> Result<KernelOp, String> {
        match r {
            KernelOpRepr::Prim(op) => Ok(KernelOp::Prim(op)),
            KernelOpRepr::Region(e) => Ok(KernelOp::Region(e)),
            KernelOpRepr::Template {
                name,
                variant,
                attrs,
            } => {
                let id = registry()
                    .iter()
                    .position(|t| t.name == name && t.variant == variant)
                    .ok_or_else(|| {
                        format!(
                            "unknown kernel template `{name}` (variant `{variant}`): this kiln \
                             has no such template; recompile the program with this kiln"
                        )
                    })?;
                Ok(KernelOp::Template {
                    id: id as u16,
                    attrs,
                })
            }
        }
    }
}

impl KernelOp {
    /// The kernel kind's name (`matmul`, `region`, `attention`, …).
    pub fn kind(&self) -> String {
        match self {
            KernelOp::Prim(op) => op.name().to_string(),
            KernelOp::Template { id, .. } => registry()[*id as usize].name.clone(),
            KernelOp::Region(_) => "region".to_string(),
        }
    }
}

/// The e-classes a chosen node reads as values (its attribute leaves left out).
fn operands_of(eg: &EG, kind: Kind, ch: &[Id]) -> Vec<Id> {
    let values = match kind {
        Kind::Input | Kind::Param | Kind::Const => &ch[..0],
        Kind::Kernel(t) => &ch[..registry()[t as usize].inputs.len()],
        Kind::Region => &ch[..ch.len() - 1],
        Kind::Proj(_) => &ch[..1],
        _ => &ch[..ch.len() - crate::optimize::lang::attr_count(kind)],
    };
    values.iter().map(|&c| eg.find(c)).collect()
}

/// What a chosen node defines, given the numbers of its operands; `kernels` counts the
/// kernels so far (a kernel's launch position).
fn definition(eg: &EG, node: &KNode, args: Vec<usize>, kernels: &mut usize) -> Result<Def, String> {
    let KNode::Op(kind, ch) = node else {
        return Err("an attribute, not a value".to_string());
    };
    Ok(match kind {
        Kind::Input | Kind::Param => {
            let Some(Attr::Name(n)) = attr_of(eg, ch[0]) else {
                return Err("a source without a name".to_string());
            };
            if *kind == Kind::Input {
                Def::Input(n.clone())
            } else {
                Def::Param(n.clone())
            }
        }
        Kind::Const => {
            let (op, _) = node_op(eg, node)?;
            let Op::Const { value, dtype } = op else {
                unreachable!()
            };
            Def::Const(value, dtype)
        }
        Kind::Reshape | Kind::Permute | Kind::Broadcast => {
            let (op, _) = node_op(eg, node)?;
            Def::View(op, args[0])
        }
        Kind::Proj(i) => Def::Proj(args[0], *i),
        Kind::Region => {
            let Some(Attr::Expr(e)) = attr_of(eg, *ch.last().expect("expr")) else {
                return Err("a region without a program".to_string());
            };
            *kernels += 1;
            Def::Kernel {
                index: *kernels - 1,
                op: KernelOp::Region(e.clone()),
                inputs: args,
            }
        }
        Kind::Kernel(t) => {
            let n = registry()[*t as usize].inputs.len();
            let attrs: Vec<Attr> = ch[n..]
                .iter()
                .map(|&c| {
                    attr_of(eg, c)
                        .cloned()
                        .ok_or("a kernel attribute is not a leaf".to_string())
                })
                .collect::<Result<_, _>>()?;
            *kernels += 1;
            Def::Kernel {
                index: *kernels - 1,
                op: KernelOp::Template { id: *t, attrs },
                inputs: args,
            }
        }
        _ => {
            let (op, _) = node_op(eg, node)?;
            *kernels += 1;
            Def::Kernel {
                index: *kernels - 1,
                op: KernelOp::Prim(op),
                inputs: args,
            }
        }
    })
}

impl KernelGraph {
    /// The value of output `name`, if the graph has that output.
    pub fn output(&self, name: &str) -> Option<usize> {
        self.outputs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }

    /// Builds the kernel graph of the chosen e-nodes reachable from `roots`.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        source: &Graph,
        eg: &EG,
        choice: &HashMap<Id, KNode>,
        roots: &[(String, Id)],
        scopes: &HashMap<Id, String>,
        target: Target,
    ) -> Result<KernelGraph, String> {
        let mut values: Vec<Value> = Vec::new();
        let mut number: HashMap<Id, usize> = HashMap::new();
        let mut kernels = 0usize;
        for (_, root) in roots {
            let root = eg.find(*root);
            // Iterative post-order.
            let mut stack: Vec<(Id, bool)> = vec![(root, false)];
            let mut on_path: HashMap<Id, bool> = HashMap::new();
            while let Some((id, done)) = stack.pop() {
                if number.contains_key(&id) {
                    continue;
                }
                let node = choice
                    .get(&id)
                    .ok_or_else(|| format!("e-class {id} was not extracted"))?;
                let KNode::Op(kind, ch) = node else {
                    return Err(format!("e-class {id} is an attribute, not a value"));
                };
                let operands = operands_of(eg, *kind, ch);
                if !done {
                    if on_path.insert(id, true).is_some() {
                        return Err(format!(
                            "the extracted program has a cycle through e-class {id}"
                        ));
                    }
                    stack.push((id, true));
                    for &o in operands.iter().rev() {
                        if !number.contains_key(&o) {
                            stack.push((o, false));
                        }
                    }
                    continue;
                }
                let arg = |o: &Id| -> Result<usize, String> {
                    number
                        .get(o)
                        .copied()
                        .ok_or_else(|| format!("operand e-class {o} comes later"))
                };
                let args: Vec<usize> = operands.iter().map(arg).collect::<Result<_, _>>()?;
                // A node only a rewrite made (no source node in its e-class) takes the
                // scope of its first operand that has one.
                let scope = scopes
                    .get(&id)
                    .filter(|s| !s.is_empty())
                    .cloned()
                    .or_else(|| {
                        args.iter()
                            .map(|&a| &values[a].scope)
                            .find(|s| !s.is_empty())
                            .cloned()
                    })
                    .unwrap_or_default();
                let types = match &eg[id].data {
                    Info::Tensor { ty, .. } => vec![ty.clone()],
                    Info::Tuple(t) => t.clone(),
                    other => return Err(format!("e-class {id} has no type: {other:?}")),
                };
                let def = definition(eg, node, args, &mut kernels)?;
                number.insert(id, values.len());
                values.push(Value { def, types, scope });
            }
        }
        let outputs = roots
            .iter()
            .map(|(n, r)| (n.clone(), number[&eg.find(*r)]))
            .collect();
        Ok(KernelGraph {
            name: source.name.clone(),
            target,
            dims: source.dims.clone(),
            values,
            outputs,
            objective: source.objective.clone(),
            stages: source.stages.clone(),
            hparams: source.hparams.clone(),
        })
    }

    /// Checks the program's structure, as a loader must before trusting it: every value
    /// has a type, reads only values before it, and projects an existing output of a
    /// kernel; the kernels' launch positions are `0..n`, each after the kernels it reads;
    /// the outputs name existing values. (A manifest's hash guards its contents; this
    /// guards the executors from one without a hash.)
    pub fn verify(&self) -> Result<(), IrError> {
        let bad = |m: String| Err(IrError::Malformed(m));
        let n = self.values.len();
        let mut launch: Vec<Option<usize>> = vec![None; n];
        let mut positions = std::collections::BTreeSet::new();
        for (v, val) in self.values.iter().enumerate() {
            if val.types.is_empty() {
                return bad(format!("value %{v} has no type"));
            }
            let reads: Vec<usize> = match &val.def {
                Def::Input(_) | Def::Param(_) | Def::Const(..) => vec![],
                Def::View(_, x) => vec![*x],
                Def::Proj(t, _) => vec![*t],
                Def::Kernel { inputs, .. } => inputs.clone(),
            };
            if let Some(&x) = reads.iter().find(|&&x| x >= v) {
                return bad(format!(
                    "value %{v} reads %{x}, which does not come before it (the program has {n} \
                     values)"
                ));
            }
            match &val.def {
                Def::Proj(t, k) => {
                    let outputs = match &self.values[*t].def {
                        Def::Kernel { .. } => self.values[*t].types.len(),
                        _ => 0,
                    };
                    if usize::from(*k) >= outputs {
                        return bad(format!(
                            "value %{v} is output {k} of %{t}, which has {outputs} outputs"
                        ));
                    }
                }
                Def::Kernel { index, inputs, .. } => {
                    if !positions.insert(*index) {
                        return bad(format!("two kernels launch at position {index}"));
                    }
                    launch[v] = Some(*index);
                    for &x in inputs {
                        let read = self.result_of(x).and_then(|(k, _)| launch[k]);
                        if let Some(at) = read.filter(|&at| at >= *index) {
                            return bad(format!(
                                "kernel %{v} launches at position {index} but reads %{x}, \
                                 computed at position {at}"
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
        if let Some(last) = positions.last().filter(|&&p| p + 1 != positions.len()) {
            return bad(format!(
                "the launch positions of the {} kernels run to {last}; they must be 0..{}",
                positions.len(),
                positions.len()
            ));
        }
        if let Some((name, v)) = self.outputs.iter().find(|(_, v)| *v >= n) {
            return bad(format!("output `{name}` is %{v}, which does not exist"));
        }
        Ok(())
    }

    /// The value `v` is a view of, through every view (`v` itself when it is not one).
    pub fn view_root(&self, mut v: usize) -> usize {
        while let Def::View(_, x) = &self.values[v].def {
            v = *x;
        }
        v
    }

    /// The kernel result (kernel value, output) that value `v` reads, through views and
    /// projections; `None` for sources and views of them.
    pub fn result_of(&self, mut v: usize) -> Option<(usize, usize)> {
        loop {
            match &self.values[v].def {
                Def::View(_, x) => v = *x,
                Def::Proj(t, k) => return Some((*t, *k as usize)),
                Def::Kernel { .. } => return Some((v, 0)),
                _ => return None,
            }
        }
    }

    /// Whether anything reads output `i` of the multi-output kernel value `k`: a
    /// projection of it exists only when an operand or a named output needs it.
    pub fn output_is_read(&self, k: usize, i: usize) -> bool {
        self.values
            .iter()
            .any(|x| matches!(x.def, Def::Proj(t, j) if t == k && usize::from(j) == i))
    }

    /// The attention results to store with their heads merged, as (kernel value, output):
    /// each `[b, h, t, d]` result of an `attention` or `attention_bwd` kernel that is read
    /// only through the view `permute([0, 2, 1, 3])` and is not a named output. Every
    /// Transformer attention result is: the output projection (forward) and the
    /// projections' gradients (backward) read it as `[b·t, h·d]` rows. Stored in the
    /// `[b, t, h, d]` order (strides `[t·h·d, d, h·d, 1]`), that view is contiguous and its
    /// reshape to rows is a view too; stored `[b, h, t, d]`, each reader copies it first.
    /// The kernels write through their result's strides either way.
    pub fn heads_merged(&self) -> Vec<(usize, usize)> {
        let mut readers: Vec<Vec<&Def>> = vec![Vec::new(); self.values.len()];
        let mut named = vec![false; self.values.len()];
        for val in &self.values {
            match &val.def {
                Def::View(_, x) | Def::Proj(x, _) => readers[*x].push(&val.def),
                Def::Kernel { inputs, .. } => {
                    for &x in inputs {
                        readers[x].push(&val.def);
                    }
                }
                _ => {}
            }
        }
        for (_, v) in &self.outputs {
            named[*v] = true;
        }
        // Whether value `x` is read, and only through the head-merging permute.
        let merged_view = |x: usize| {
            !named[x]
                && !readers[x].is_empty()
                && readers[x].iter().all(|d| {
                    matches!(d, Def::View(Op::Permute { perm }, _) if perm.as_slice() == [0, 2, 1, 3])
                })
        };
        let mut out = Vec::new();
        for (v, op, _) in self.kernels() {
            let kind = op.kind();
            if kind != "attention" && kind != "attention_bwd" {
                continue;
            }
            let types = &self.values[v].types;
            if types.len() == 1 {
                if types[0].shape.rank() == 4 && merged_view(v) {
                    out.push((v, 0));
                }
                continue;
            }
            for (k, ty) in types.iter().enumerate() {
                // A multi-output kernel's results are read through its projections.
                let projs: Vec<usize> = (0..self.values.len())
                    .filter(|&p| {
                        matches!(self.values[p].def, Def::Proj(t, j) if t == v && usize::from(j) == k)
                    })
                    .collect();
                if ty.shape.rank() == 4
                    && !projs.is_empty()
                    && projs.iter().all(|&p| merged_view(p))
                {
                    out.push((v, k));
                }
            }
        }
        out
    }

    /// The kernels in launch order: (value number, kernel op, operands).
    pub fn kernels(&self) -> Vec<(usize, &KernelOp, &[usize])> {
        self.values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| match &v.def {
                Def::Kernel { op, inputs, .. } => Some((i, op, inputs.as_slice())),
                _ => None,
            })
            .collect()
    }

    /// How many kernels of each kind.
    pub fn counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for (_, op, _) in self.kernels() {
            *m.entry(op.kind()).or_insert(0) += 1;
        }
        m
    }

    /// Estimated bytes the kernels read and write (each operand and result once; a
    /// broadcast operand read at its source size), with every symbolic dim at
    /// [`crate::optimize::extract::ESTIMATE_DIM`].
    pub fn bytes_moved(&self, model: &CostModel) -> f64 {
        let size = |v: usize| -> f64 {
            let mut v = v;
            while let Def::View(Op::Broadcast { .. }, src) = &self.values[v].def {
                v = *src;
            }
            self.values[v]
                .types
                .iter()
                .map(|t| model.numel(&t.shape) * 4.0)
                .sum()
        };
        let mut total = 0.0;
        for (i, _, inputs) in self.kernels() {
            let mut seen = Vec::new();
            for &x in inputs {
                if !seen.contains(&x) {
                    seen.push(x);
                    total += size(x);
                }
            }
            total += self.values[i]
                .types
                .iter()
                .map(|t| model.numel(&t.shape) * 4.0)
                .sum::<f64>();
        }
        total
    }

    fn operand_text(&self, v: usize) -> String {
        format!("%{v}")
    }

    /// The deterministic text form.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "kernels {} target={}", self.name, self.target.name());
        if !self.dims.is_empty() {
            let _ = writeln!(s, "dims {}", self.dims.join(", "));
        }
        for (i, v) in self.values.iter().enumerate() {
            let ty = if v.types.len() == 1 {
                v.types[0].to_string()
            } else {
                format!(
                    "({})",
                    v.types
                        .iter()
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            let args = |xs: &[usize]| {
                xs.iter()
                    .map(|&x| self.operand_text(x))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let line = match &v.def {
                Def::Input(n) => format!("%{i} = input {n}"),
                Def::Param(n) => format!("%{i} = param {n}"),
                Def::Const(c, _) => format!("%{i} = const {c}"),
                Def::View(op, x) => {
                    let a = op_attrs(op);
                    format!(
                        "%{i} = {} %{x}{}{a}",
                        op.name(),
                        if a.is_empty() { "" } else { " " }
                    )
                }
                Def::Proj(t, k) => format!("%{i} = %{t}.{k}"),
                Def::Kernel { index, op, inputs } => {
                    let head = match op {
                        KernelOp::Prim(p) => {
                            let a = op_attrs(p);
                            if a.is_empty() {
                                p.name().to_string()
                            } else {
                                format!("{}[{a}]", p.name())
                            }
                        }
                        KernelOp::Region(e) => format!("region{{{}}}", e.text()),
                        KernelOp::Template { id, attrs } => {
                            let def = &registry()[*id as usize];
                            let konst: Vec<Option<f64>> = inputs
                                .iter()
                                .map(|&x| match &self.values[x].def {
                                    Def::Const(c, _) => Some(c.get()),
                                    Def::View(_, src) => match &self.values[*src].def {
                                        Def::Const(c, _) => Some(c.get()),
                                        _ => None,
                                    },
                                    _ => None,
                                })
                                .collect();
                            format!("{}[{}]", def.name, describe(def, &konst, attrs))
                        }
                    };
                    if inputs.is_empty() {
                        format!("k{index} %{i} = {head}")
                    } else {
                        format!("k{index} %{i} = {head} {}", args(inputs))
                    }
                }
            };
            let scope = if v.scope.is_empty() {
                String::new()
            } else {
                format!("  # {}", v.scope)
            };
            let _ = writeln!(s, "{line} : {ty}{scope}");
        }
        for (n, v) in &self.outputs {
            let _ = writeln!(s, "output {n} = %{v}");
        }
        s
    }

    /// The program as an IR graph: every kernel expanded into primitives (templates
    /// through their definitions, regions through their programs). Parameters keep the
    /// initializers of `source`. Used to validate the program against `source`.
    pub fn to_graph(&self, source: &Graph) -> Result<Graph, IrError> {
        self.to_graph_mapped(source).map(|(g, _)| g)
    }

    /// [`KernelGraph::to_graph`], also returning the nodes of every value (one per
    /// output of a multi-output kernel).
    pub fn to_graph_mapped(&self, source: &Graph) -> Result<(Graph, Vec<Vec<NodeId>>), IrError> {
        let mut g = Graph::new(&self.name);
        g.dims = self.dims.clone();
        let mut val: Vec<Vec<NodeId>> = Vec::with_capacity(self.values.len());
        for v in &self.values {
            let ids = match &v.def {
                Def::Input(n) => vec![g.add_input(n, v.types[0].clone())?],
                Def::Param(n) => {
                    let init = source
                        .param(n)
                        .and_then(|p| match &source.node(p).op {
                            Op::Param { init, .. } => Some(*init),
                            _ => None,
                        })
                        .unwrap_or(crate::ir::Init::Zeros);
                    vec![g.add_param(n, v.types[0].clone(), init, &v.scope)?]
                }
                Def::Const(c, d) => vec![g.add(
                    Op::Const {
                        value: *c,
                        dtype: *d,
                    },
                    &[],
                    "",
                )?],
                Def::View(op, x) => vec![g.add(op.clone(), &[val[*x][0]], &v.scope)?],
                Def::Proj(t, k) => vec![val[*t][*k as usize]],
                Def::Kernel { op, inputs, .. } => {
                    let ins: Vec<NodeId> = inputs.iter().map(|&x| val[x][0]).collect();
                    match op {
                        KernelOp::Prim(p) => vec![g.add(p.clone(), &ins, &v.scope)?],
                        KernelOp::Region(e) => vec![e.instantiate(&mut g, &ins, &v.scope)?],
                        KernelOp::Template { id, attrs } => {
                            registry()[*id as usize].instantiate(&mut g, &ins, attrs, &v.scope)?
                        }
                    }
                }
            };
            val.push(ids);
        }
        for (n, v) in &self.outputs {
            g.add_output(n, val[*v][0])?;
        }
        g.objective = self.objective.clone();
        g.stages = self.stages.clone();
        g.hparams = self.hparams.clone();
        g.verify()?;
        Ok((g, val))
    }
}

/// The scope of each e-class: the first non-empty scope of a source node in it; a tuple
/// takes the scope of its first projection.
pub fn class_scopes(source: &Graph, eg: &EG, classes: &[Id]) -> HashMap<Id, String> {
    let mut m: HashMap<Id, String> = HashMap::new();
    for (i, node) in source.nodes.iter().enumerate() {
        let c = eg.find(classes[i]);
        let e = m.entry(c).or_default();
        if e.is_empty() {
            *e = node.scope.to_string();
        }
    }
    let mut ids: Vec<Id> = eg.classes().map(|c| c.id).collect();
    ids.sort();
    for id in ids {
        for n in &eg[id].nodes {
            if let KNode::Op(Kind::Proj(_), ch) = n {
                let t = eg.find(ch[0]);
                if !m.contains_key(&t) {
                    let s = m.get(&id).cloned().unwrap_or_default();
                    m.insert(t, s);
                }
            }
        }
        let _ = eg[id].nodes.iter().map(|n| n.children().len());
    }
    m
}
