//! Whole-graph transformations: sources substituted for nodes, pruning to outputs, and
//! the structural check every pass's result must pass.

use std::collections::BTreeMap;

use super::*;

impl Graph {
    /// A new graph in which each node of `replace` is an input of the given name (what it
    /// read is no longer needed for it), with the same outputs, pruned to them: nodes only
    /// the replaced ones read are dropped. A replacement with a permutation `p` is an input
    /// stored permuted (`permute(node, p)`'s type), read back through `permute(input, p⁻¹)`.
    pub fn replace_with_inputs(
        &self,
        replace: &[(NodeId, String, Option<Vec<usize>>)],
    ) -> Result<Graph, IrError> {
        let by_node: BTreeMap<NodeId, (&str, Option<&Vec<usize>>)> = replace
            .iter()
            .map(|(id, n, p)| (*id, (n.as_str(), p.as_ref())))
            .collect();
        let mut g = Graph::new(&self.name);
        g.dims = self.dims.clone();
        let mut remap: Vec<NodeId> = Vec::with_capacity(self.nodes.len());
        for (i, node) in self.nodes.iter().enumerate() {
            let new = match (by_node.get(&NodeId(i as u32)), &node.op) {
                (Some((name, None)), _) => g.add_input(name, node.ty.clone())?,
                (Some((name, Some(perm))), _) => {
                    let dims = node.ty.shape.dims();
                    let stored = Shape(perm.iter().map(|&a| dims[a].clone()).collect());
                    let x = g.add_input(name, TensorType::new(node.ty.dtype, stored))?;
                    let mut back = vec![0; perm.len()];
                    for (k, &a) in perm.iter().enumerate() {
                        back[a] = k;
                    }
                    g.add(Op::Permute { perm: back }, &[x], &node.scope)?
                }
                (None, Op::Input { name }) => g.add_input(name, node.ty.clone())?,
                (None, Op::Param { name, init }) => {
                    g.add_param(name, node.ty.clone(), *init, &node.scope)?
                }
                (None, op) => {
                    let inputs: Vec<NodeId> =
                        node.inputs.iter().map(|x| remap[x.index()]).collect();
                    let id = g.push(op.clone(), inputs, node.ty.clone(), &node.scope);
                    g.dedup.insert(&g.nodes, id);
                    id
                }
            };
            remap.push(new);
        }
        for o in &self.outputs {
            g.outputs.push(Output {
                name: o.name.clone(),
                node: remap[o.node.index()],
            });
        }
        g.objective = self.objective.clone();
        g.hparams = self.hparams.clone();
        g.stages = self.stages.clone();
        let names: Vec<String> = self.outputs.iter().map(|o| o.name.clone()).collect();
        g.prune(&names)
    }

    /// A new graph with only the named outputs and the nodes they need, renumbered in the
    /// same relative order. Inputs and parameters they do not use are dropped.
    pub fn prune(&self, outputs: &[String]) -> Result<Graph, IrError> {
        let mut live = vec![false; self.nodes.len()];
        let mut stack = Vec::new();
        for name in outputs {
            let id = self.output(name).ok_or_else(|| {
                IrError::Malformed(format!(
                    "no output named `{name}` (outputs: {})",
                    self.outputs
                        .iter()
                        .map(|o| o.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            stack.push(id);
        }
        while let Some(id) = stack.pop() {
            if !live[id.index()] {
                live[id.index()] = true;
                stack.extend(self.node(id).inputs.iter().copied());
            }
        }
        let mut remap: BTreeMap<NodeId, NodeId> = BTreeMap::new();
        let mut out = Graph::new(&self.name);
        out.dims = self.dims.clone();
        for (i, node) in self.nodes.iter().enumerate() {
            if !live[i] {
                continue;
            }
            let new_id = NodeId(out.nodes.len() as u32);
            remap.insert(NodeId(i as u32), new_id);
            let inputs: Vec<NodeId> = node.inputs.iter().map(|x| remap[x]).collect();
            out.nodes.push(Node {
                op: node.op.clone(),
                inputs,
                ty: node.ty.clone(),
                scope: node.scope.clone(),
            });
            out.dedup.insert(&out.nodes, new_id);
        }
        out.inputs = self
            .inputs
            .iter()
            .filter_map(|i| remap.get(i).copied())
            .collect();
        out.params = self
            .params
            .iter()
            .filter_map(|i| remap.get(i).copied())
            .collect();
        for name in outputs {
            let node = remap[&self.output(name).expect("checked above")];
            out.outputs.push(Output {
                name: name.clone(),
                node,
            });
        }
        out.objective = self
            .objective
            .clone()
            .filter(|o| outputs.iter().any(|n| n == o));
        out.hparams = self.hparams.clone();
        out.stages = self
            .stages
            .iter()
            .filter(|s| outputs.iter().any(|n| n == *s))
            .cloned()
            .collect();
        Ok(out)
    }

    /// Re-checks every node: operands exist and come earlier, arities hold, and each
    /// node's type is what inference says. Passes that rewrite graphs call this.
    pub fn verify(&self) -> Result<(), IrError> {
        for (i, node) in self.nodes.iter().enumerate() {
            let here = NodeId(i as u32);
            for &inp in &node.inputs {
                if inp.index() >= i {
                    return Err(IrError::Malformed(format!(
                        "{here} uses {inp}, which does not come before it"
                    )));
                }
            }
            match &node.op {
                Op::Input { .. } | Op::Param { .. } => {
                    if !node.inputs.is_empty() {
                        return Err(IrError::Malformed(format!(
                            "{here} is a source with operands"
                        )));
                    }
                }
                op => {
                    let types: Vec<&TensorType> = node.inputs.iter().map(|&x| self.ty(x)).collect();
                    let ty = infer_type(op, &types)
                        .map_err(|e| IrError::Malformed(format!("{here} ({}): {e}", op.name())))?;
                    if ty != node.ty {
                        return Err(IrError::Malformed(format!(
                            "{here} ({}) is typed {} but its operands give {}",
                            op.name(),
                            node.ty,
                            ty
                        )));
                    }
                }
            }
        }
        for o in &self.outputs {
            if o.node.index() >= self.nodes.len() {
                return Err(IrError::Malformed(format!(
                    "output `{}` points nowhere",
                    o.name
                )));
            }
        }
        // The signature's lists: each entry an input (a parameter) node, listed once.
        for (list, a, ids) in [
            ("input", "an", &self.inputs),
            ("parameter", "a", &self.params),
        ] {
            let mut seen = std::collections::HashSet::new();
            for (k, &id) in ids.iter().enumerate() {
                let Some(node) = self.nodes.get(id.index()) else {
                    return Err(IrError::Malformed(format!(
                        "{list} list entry {k} is {id}, which points nowhere (the graph has {} \
                         nodes)",
                        self.nodes.len()
                    )));
                };
                let kind_ok = match &node.op {
                    Op::Input { .. } => list == "input",
                    Op::Param { .. } => list == "parameter",
                    _ => false,
                };
                if !kind_ok {
                    return Err(IrError::Malformed(format!(
                        "{list} list entry {k} is {id}, a `{}` node, not {a} {list}",
                        node.op.name()
                    )));
                }
                if !seen.insert(id) {
                    return Err(IrError::Malformed(format!(
                        "{id} is listed twice as {a} {list}"
                    )));
                }
            }
        }
        Ok(())
    }
}
