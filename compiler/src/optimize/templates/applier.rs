//! The template rules' applier: builds a matched template's kernel e-node (or joins
//! the one another output's rule built) and equates the matched e-class with its output.

use egg::{Applier, Id, PatternAst, Subst, Symbol};

use super::*;

/// Builds (or joins) the kernel e-node and equates the matched e-class with its output.
pub struct TemplateApplier {
    pub(super) template: u16,
    pub(super) output: usize,
    pub(super) pat: &'static TPattern,
}

impl TemplateApplier {
    fn var_of(&self, p: Option<usize>) -> Option<Var> {
        p.map(|p| match &self.pat.nodes[p] {
            PNode::Var(slot) => self.pat.vars[*slot],
            _ => unreachable!("operands are variables"),
        })
    }
}

/// The e-class of a `kind` e-node whose children are the `known` operands where they
/// are known; among several, the lowest id (so the choice does not depend on the
/// e-graph's hashing).
fn joinable_kernel(eg: &EG, kind: Kind, known: &[Option<Id>]) -> Option<Id> {
    let matches = |n: &KNode| match n {
        KNode::Op(k, ch) => {
            *k == kind
                && ch.len() == known.len()
                && ch
                    .iter()
                    .zip(known)
                    .all(|(&a, b)| b.is_none_or(|b| eg.find(a) == b))
        }
        _ => false,
    };
    let anchor = known.iter().flatten().next()?;
    eg[*anchor]
        .parents()
        .map(|p| eg.find(p))
        .filter(|&p| eg[p].nodes.iter().any(matches))
        .min()
}

impl Applier<KNode, Types> for TemplateApplier {
    fn apply_one(
        &self,
        eg: &mut EG,
        eclass: Id,
        subst: &Subst,
        _ast: Option<&PatternAst<KNode>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let def = &registry()[self.template as usize];
        let known: Vec<Option<Id>> = self
            .pat
            .operand_nodes
            .iter()
            .chain(self.pat.attr_nodes.iter())
            .map(|&p| {
                self.var_of(p)
                    .and_then(|v| subst.get(v).copied())
                    .map(|i| eg.find(i))
            })
            .collect();
        let kind = Kind::Kernel(self.template);
        let kernel = if known.iter().all(Option::is_some) {
            let children: Vec<Id> = known.iter().map(|k| k.expect("checked")).collect();
            // Only build a kernel whose operands type-check against the template.
            let tys: Option<Vec<TensorType>> = children[..def.inputs.len()]
                .iter()
                .map(|&c| eg[c].data.ty().cloned())
                .collect();
            match tys.map(|t| def.output_types(&t)) {
                Some(Ok(_)) => eg.add(KNode::Op(kind, children)),
                _ => return vec![],
            }
        } else {
            // Join the kernel another output's rule built for the same operands: it is
            // a parent of each operand this rule knows.
            match joinable_kernel(eg, kind, &known) {
                Some(f) => f,
                None => return vec![],
            }
        };
        let result = if def.outputs.len() > 1 {
            eg.add(KNode::Op(Kind::Proj(self.output as u8), vec![kernel]))
        } else {
            kernel
        };
        let same_type = match (&eg[result].data, &eg[eclass].data) {
            (Info::Tensor { ty: a, .. }, Info::Tensor { ty: b, .. }) => a == b,
            _ => false,
        };
        if !same_type {
            let msg = format!(
                "template {} output {} does not have the type of the e-class it matched ({:?} vs {:?})",
                def.name, self.output, eg[result].data, eg[eclass].data
            );
            eg.analysis.errors.push(msg);
            return vec![];
        }
        if eg.union(eclass, result) {
            vec![eclass]
        } else {
            vec![]
        }
    }
}
