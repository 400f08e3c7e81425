//! The tensor graph IR.
//!
//! In: primitive ops added one at a time by a front end (the DSL elaborator, autodiff).
//! Out: a [`Graph`] — a DAG of [`Node`]s in topological order, each with a checked
//! [`TensorType`] (dtype + symbolic [`Shape`](crate::shape::Shape)), plus the graph's
//! signature: its symbolic dims, inputs, parameters and named outputs. The types and ops
//! are in `ir/op.rs`, whole-graph transformations in `ir/transform.rs`.
//!
//! The primitive set is deliberately small (DESIGN §3): sources (inputs, parameters,
//! scalar constants), views (`reshape`, `permute`, `broadcast`), elementwise ops, two
//! reductions, a batched `matmul`, `gather`/`scatter_add`, `dropout` (counter-based RNG),
//! the `causal`/`padding` masks, and `arange`/`one_hot`/`concat`. Every layer of the
//! prelude is written on top of these; fusing them back into kernels is the optimizer's
//! job, never the front end's.
//!
//! Elementwise ops take operands of identical shape: broadcasting is always an explicit
//! `broadcast` node, so later passes see every implicit copy.
//!
//! [`Graph::add`] hash-conses: adding an op that already exists with the same inputs
//! returns the existing node. Nodes carry the scope of the layer instance that made them
//! (`encoder.layers.0.self_attn`), which names kernels and diagnostics later on.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dedup::Dedup;
use crate::infer::infer_type;
use crate::shape::Shape;

mod op;
mod transform;

pub use op::*;

/// A node id: the index of the node in [`Graph::nodes`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One operation in the graph.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub ty: TensorType,
    /// The layer instance that created the node (`encoder.layers.0.ffn`), `""` at top;
    /// shared with the nodes around it that have the same scope.
    pub scope: Arc<str>,
}

/// An error found while building or checking a graph.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IrError {
    /// The operand types do not fit the op; the message says how.
    #[error("{0}")]
    Type(String),
    /// Two sources with one name.
    #[error("{kind} `{name}` is defined twice")]
    Duplicate { kind: &'static str, name: String },
    /// A structural problem (bad node reference, wrong arity, unknown output).
    #[error("malformed graph: {0}")]
    Malformed(String),
}

/// A parameter table read at positions along a dim ([`Graph::position_table`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PositionTable {
    /// The parameter's name (`tgt_pos.table`).
    pub param: String,
    /// Its rows: positions `0 .. rows` can be read.
    pub rows: usize,
}

/// Inputs and outputs named `cache.<scope>.<name>` carry a decoder's key/value cache:
/// the input holds the previous positions, the output of the same name all of them.
pub const CACHE_PREFIX: &str = "cache.";

/// A named graph output.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Output {
    pub name: String,
    pub node: NodeId,
}

/// A tensor graph: nodes in topological order plus the graph's signature.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Graph {
    /// The model the graph was elaborated from.
    pub name: String,
    /// Symbolic dims, in declaration order.
    pub dims: Vec<String>,
    pub nodes: Vec<Node>,
    /// Input nodes in declaration order.
    pub inputs: Vec<NodeId>,
    /// Parameter nodes in creation order.
    pub params: Vec<NodeId>,
    pub outputs: Vec<Output>,
    /// The output that is the training objective (a scalar), if the model declares one.
    pub objective: Option<String>,
    /// Outputs that mark a pipeline stage (`stage memory = ...`): the `encode` entry point
    /// computes them; `decode_step` takes them as inputs.
    #[serde(default)]
    pub stages: Vec<String>,
    /// The model's parameters after overrides, as text (`d_model` → `512`): metadata
    /// for the runtime (the learning-rate schedule reads `d_model`) and for artifacts.
    #[serde(default)]
    pub hparams: Vec<(String, String)>,
    #[serde(skip)]
    dedup: Dedup,
    /// The names of `params`, for [`Graph::add_param`]'s duplicate check (a search of
    /// `params` made elaborating `repeat(n, …)` quadratic in `n`); rebuilt from `params`
    /// when they differ in number (a graph read back, or `params` set directly).
    #[serde(skip)]
    param_names: std::collections::HashSet<String>,
}

impl Graph {
    pub fn new(name: &str) -> Graph {
        Graph {
            name: name.to_string(),
            ..Graph::default()
        }
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn ty(&self, id: NodeId) -> &TensorType {
        &self.nodes[id.index()].ty
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Declares a symbolic dim (idempotent).
    pub fn add_dim(&mut self, name: &str) {
        if !self.dims.iter().any(|d| d == name) {
            self.dims.push(name.to_string());
        }
    }

    fn push(&mut self, op: Op, inputs: Vec<NodeId>, ty: TensorType, scope: &str) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        // A layer adds its nodes one after another, so the last node's scope is the
        // one to share.
        let scope = match self.nodes.last() {
            Some(last) if *last.scope == *scope => last.scope.clone(),
            _ => Arc::from(scope),
        };
        self.nodes.push(Node {
            op,
            inputs,
            ty,
            scope,
        });
        id
    }

    /// Declares a graph input.
    pub fn add_input(&mut self, name: &str, ty: TensorType) -> Result<NodeId, IrError> {
        if self.input(name).is_some() {
            return Err(IrError::Duplicate {
                kind: "input",
                name: name.to_string(),
            });
        }
        let id = self.push(
            Op::Input {
                name: name.to_string(),
            },
            vec![],
            ty,
            "",
        );
        self.inputs.push(id);
        Ok(id)
    }

    /// Declares a parameter. Parameter shapes must be concrete and floating point.
    pub fn add_param(
        &mut self,
        name: &str,
        ty: TensorType,
        init: Init,
        scope: &str,
    ) -> Result<NodeId, IrError> {
        if self.param_names.len() != self.params.len() {
            self.param_names = self
                .params
                .iter()
                .filter_map(|&p| match &self.nodes.get(p.index())?.op {
                    Op::Param { name, .. } => Some(name.clone()),
                    _ => None,
                })
                .collect();
        }
        if self.param_names.contains(name) {
            return Err(IrError::Duplicate {
                kind: "parameter",
                name: name.to_string(),
            });
        }
        if !ty.dtype.is_float() {
            return Err(IrError::Type(format!(
                "parameter `{name}` must be floating point, not {}",
                ty.dtype
            )));
        }
        if let Some(bad) = ty.shape.dims().iter().find(|d| !d.is_const()) {
            return Err(IrError::Type(format!(
                "parameter `{name}` has symbolic dim `{bad}`; parameter shapes must be numbers"
            )));
        }
        if let Some(bad) = ty
            .shape
            .dims()
            .iter()
            .find(|d| d.as_const().unwrap_or(0) <= 0)
        {
            return Err(IrError::Type(format!(
                "parameter `{name}` has dim {bad}; parameter dims must be positive"
            )));
        }
        let id = self.push(
            Op::Param {
                name: name.to_string(),
                init,
            },
            vec![],
            ty,
            scope,
        );
        self.params.push(id);
        self.param_names.insert(name.to_string());
        Ok(id)
    }

    /// Adds a scalar constant of `dtype`.
    pub fn add_const(&mut self, value: f64, dtype: DType) -> NodeId {
        let op = Op::Const {
            value: Float::new(value),
            dtype,
        };
        self.add(op, &[], "")
            .expect("a scalar constant is always well typed")
    }

    /// `x` broadcast to `shape`, or `x` itself when it has that shape already.
    pub fn broadcast_to(
        &mut self,
        x: NodeId,
        shape: &Shape,
        scope: &str,
    ) -> Result<NodeId, IrError> {
        if self.ty(x).shape == *shape {
            return Ok(x);
        }
        let op = Op::Broadcast {
            shape: shape.clone(),
        };
        self.add(op, &[x], scope)
    }

    /// Adds a non-source op, inferring its type; returns an existing node for a repeat.
    pub fn add(&mut self, op: Op, inputs: &[NodeId], scope: &str) -> Result<NodeId, IrError> {
        if matches!(op, Op::Input { .. } | Op::Param { .. }) {
            return Err(IrError::Malformed(format!(
                "{} nodes are added with their own constructor",
                op.name()
            )));
        }
        for &i in inputs {
            if i.index() >= self.nodes.len() {
                return Err(IrError::Malformed(format!("operand {i} does not exist")));
            }
        }
        if let Some(id) = self.dedup.find(&self.nodes, &op, inputs) {
            return Ok(id);
        }
        let types: Vec<&TensorType> = inputs.iter().map(|&i| self.ty(i)).collect();
        let ty = infer_type(&op, &types)?;
        let id = self.push(op, inputs.to_vec(), ty, scope);
        self.dedup.insert(&self.nodes, id);
        Ok(id)
    }

    /// Names a node as a graph output.
    pub fn add_output(&mut self, name: &str, node: NodeId) -> Result<(), IrError> {
        if self.outputs.iter().any(|o| o.name == name) {
            return Err(IrError::Duplicate {
                kind: "output",
                name: name.to_string(),
            });
        }
        self.outputs.push(Output {
            name: name.to_string(),
            node,
        });
        Ok(())
    }

    pub fn input(&self, name: &str) -> Option<NodeId> {
        self.inputs
            .iter()
            .copied()
            .find(|&i| matches!(&self.node(i).op, Op::Input { name: n } if n == name))
    }

    pub fn param(&self, name: &str) -> Option<NodeId> {
        self.params
            .iter()
            .copied()
            .find(|&i| matches!(&self.node(i).op, Op::Param { name: n, .. } if n == name))
    }

    pub fn output(&self, name: &str) -> Option<NodeId> {
        self.outputs.iter().find(|o| o.name == name).map(|o| o.node)
    }

    /// The name of an input or parameter node.
    pub fn source_name(&self, id: NodeId) -> Option<&str> {
        match &self.node(id).op {
            Op::Input { name } | Op::Param { name, .. } => Some(name),
            _ => None,
        }
    }

    /// Total number of parameter elements (parameter shapes are concrete); `u64::MAX`
    /// where that does not fit in 64 bits.
    pub fn num_parameters(&self) -> u64 {
        self.params
            .iter()
            .map(|&p| {
                self.ty(p)
                    .shape
                    .as_consts()
                    .map(|s| s.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64)))
                    .unwrap_or(0)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// A model parameter's value as text, if the graph records it.
    pub fn hparam(&self, name: &str) -> Option<&str> {
        self.hparams
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The smallest parameter table the graph reads at the positions of `dim`: a `gather`
    /// of a `[rows, …]` parameter at `arange(start, len = dim)`, as a learned positional
    /// embedding is read. Positions `start .. start + dim` must stay below its `rows`.
    /// `None` when no parameter is indexed by positions along `dim` (a sinusoidal
    /// encoding computes its values and has no such limit).
    pub fn position_table(&self, dim: &str) -> Option<PositionTable> {
        self.nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Gather) && n.inputs.len() == 2)
            .filter_map(|n| {
                let Op::Param { name, .. } = &self.node(n.inputs[0]).op else {
                    return None;
                };
                let Op::Arange { len, .. } = &self.node(n.inputs[1]).op else {
                    return None;
                };
                if len.as_sym() != Some(dim) {
                    return None;
                }
                let rows = self.ty(n.inputs[0]).shape.dims().first()?.as_const()?;
                Some(PositionTable {
                    param: name.clone(),
                    rows: usize::try_from(rows).ok()?,
                })
            })
            .min_by(|a, b| a.rows.cmp(&b.rows).then_with(|| a.param.cmp(&b.param)))
    }

    /// Names of the model's own outputs: not the objective, not a stage, not a cache.
    pub fn forward_outputs(&self) -> Vec<String> {
        self.outputs
            .iter()
            .filter(|o| {
                Some(&o.name) != self.objective.as_ref()
                    && !self.stages.contains(&o.name)
                    && !o.name.starts_with(CACHE_PREFIX)
            })
            .map(|o| o.name.clone())
            .collect()
    }

    /// Names of the key/value cache outputs of a `decode_step` graph; each is also the
    /// name of the input that takes the previous step's value.
    pub fn cache_outputs(&self) -> Vec<String> {
        self.outputs
            .iter()
            .filter(|o| o.name.starts_with(CACHE_PREFIX))
            .map(|o| o.name.clone())
            .collect()
    }
}
