//! What `kiln check` reports about a graph.
//!
//! In: a [`Graph`]. Out: a [`Summary`] — parameter count, dims, inputs, outputs, node
//! count and per-op counts — printable as text or JSON (the JSON `parameters` field is
//! an integer).

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::ir::{Graph, Op};

#[derive(Clone, Debug, Serialize)]
pub struct TensorSig {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub model: String,
    /// Total number of trainable scalars (`u64::MAX`: that many or more).
    pub parameters: u64,
    /// Number of parameter tensors.
    pub parameter_tensors: usize,
    pub dims: Vec<String>,
    pub inputs: Vec<TensorSig>,
    pub outputs: Vec<TensorSig>,
    pub objective: Option<String>,
    /// Outputs that end the `encode` entry point (`stage` in the spec).
    pub stages: Vec<String>,
    /// Nodes in the graph (sources included).
    pub nodes: usize,
    /// How many nodes of each op.
    pub ops: BTreeMap<String, usize>,
}

fn sig(g: &Graph, name: &str, id: crate::NodeId) -> TensorSig {
    let ty = g.ty(id);
    TensorSig {
        name: name.to_string(),
        dtype: ty.dtype.to_string(),
        shape: ty.shape.dims().iter().map(|d| d.to_string()).collect(),
    }
}

impl Summary {
    pub fn of(g: &Graph) -> Summary {
        let mut ops = BTreeMap::new();
        for n in &g.nodes {
            *ops.entry(n.op.name().to_string()).or_insert(0) += 1;
        }
        Summary {
            model: g.name.clone(),
            parameters: g.num_parameters(),
            parameter_tensors: g.params.len(),
            dims: g.dims.clone(),
            inputs: g
                .inputs
                .iter()
                .map(|&i| match &g.node(i).op {
                    Op::Input { name } => sig(g, name, i),
                    _ => unreachable!("inputs are input nodes"),
                })
                .collect(),
            outputs: g.outputs.iter().map(|o| sig(g, &o.name, o.node)).collect(),
            objective: g.objective.clone(),
            stages: g.stages.clone(),
            nodes: g.nodes.len(),
            ops,
        }
    }

    /// Human-readable text.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let shape = |t: &TensorSig| format!("{}[{}]", t.dtype, t.shape.join(", "));
        writeln!(s, "model       {}", self.model).unwrap();
        writeln!(
            s,
            "parameters  {}{} in {} tensors",
            if self.parameters == u64::MAX {
                "at least "
            } else {
                ""
            },
            group_digits(self.parameters),
            self.parameter_tensors
        )
        .unwrap();
        writeln!(s, "dims        {}", self.dims.join(", ")).unwrap();
        let width = self
            .inputs
            .iter()
            .chain(self.outputs.iter())
            .map(|t| t.name.len())
            .max()
            .unwrap_or(0);
        for (i, t) in self.inputs.iter().enumerate() {
            let head = if i == 0 { "inputs" } else { "" };
            writeln!(s, "{head:<11} {:<width$}  {}", t.name, shape(t)).unwrap();
        }
        for (i, t) in self.outputs.iter().enumerate() {
            let head = if i == 0 { "outputs" } else { "" };
            let mark = if Some(&t.name) == self.objective.as_ref() {
                "  (objective)"
            } else if self.stages.contains(&t.name) {
                "  (stage)"
            } else {
                ""
            };
            writeln!(s, "{head:<11} {:<width$}  {}{mark}", t.name, shape(t)).unwrap();
        }
        writeln!(s, "nodes       {}", self.nodes).unwrap();
        s
    }
}

/// `63082496` → `63,082,496`.
pub fn group_digits(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn groups_digits() {
        assert_eq!(super::group_digits(63082496), "63,082,496");
        assert_eq!(super::group_digits(999), "999");
        assert_eq!(super::group_digits(1000), "1,000");
        assert_eq!(super::group_digits(0), "0");
    }
}
