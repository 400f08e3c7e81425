//! The fusions decided after extraction, over the kernels in launch order.
//!
//! Two, both recorded in the launch plan ([`crate::launch_plan`]) so that `kiln explain`,
//! the artifact and the executors agree on them:
//! - **product groups**: consecutive products of one left operand (the attention's query,
//!   key and value projections; every decoder layer's keys and values of the encoder's
//!   output; the weight gradients `xᵀ·dy` of one input). A backend that packs a left
//!   operand (the CPU's 16-bit products) packs it once for the group.
//! - **bias-gradient pairs**: a bias gradient — a `sum_rows` of an output gradient `dy`
//!   over its rows — and its layer's weight-gradient product `dW = xᵀ·dy`, which reads
//!   the same `dy` as its right operand and can sum its columns while it reads them.
//!
//! Both are proposals that keep the program's meaning: an executor that cannot run a
//! group or a pair as one (f32 products, operands not in place) runs each member on its
//! own, with the same bits.

use serde::{Deserialize, Serialize};

use crate::ir::{DType, Op};
use crate::optimize::kernels::{KernelGraph, KernelOp};
use crate::optimize::kind::TemplateKind;
use crate::optimize::templates::registry;

/// What a launch is to the fusions.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// A `sum_rows` (a bias gradient when it sums an output gradient).
    SumRows,
    /// A plain f32 `matmul` (a weight gradient can be one).
    Product,
    /// A `linear` or `linear_relu`: a product with its bias (and ReLU) as its epilogue.
    Linear,
    Other,
}

impl Role {
    /// The role of a kernel `op` reading `inputs`.
    pub fn of(kg: &KernelGraph, op: &KernelOp, inputs: &[usize]) -> Role {
        match op {
            KernelOp::Prim(Op::MatMul) if all_f32(kg, inputs) => Role::Product,
            KernelOp::Template { id, .. } => match registry()[*id as usize].kind {
                TemplateKind::SumRows => Role::SumRows,
                TemplateKind::Linear | TemplateKind::LinearRelu => Role::Linear,
                _ => Role::Other,
            },
            _ => Role::Other,
        }
    }
}

fn all_f32(kg: &KernelGraph, inputs: &[usize]) -> bool {
    inputs
        .iter()
        .all(|&x| kg.values[x].types[0].dtype == DType::F32)
}

/// One launch as the fusions see it: its value, its input values and its role.
pub type Described<'a> = (usize, &'a [usize], Role);

/// A run of consecutive launches that read one left operand.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProductGroup {
    /// The launch index of its first member.
    pub first: usize,
    /// How many launches, from `first` on (at least 2).
    pub len: usize,
    /// The value every member reads as its left operand.
    pub operand: usize,
}

/// The groups: maximal runs of two or more consecutive launches of one role (all
/// [`Role::Linear`] or all [`Role::Product`]) whose first operand is the same value.
pub fn product_groups(launches: &[Described<'_>]) -> Vec<ProductGroup> {
    let mut groups = Vec::new();
    let mut s = 0;
    while s < launches.len() {
        let (_, ins, role) = launches[s];
        let groupable = matches!(role, Role::Linear | Role::Product);
        let Some(&x) = ins.first().filter(|_| groupable) else {
            s += 1;
            continue;
        };
        let more = launches[s + 1..]
            .iter()
            .take_while(|(_, i, r)| *r == role && i.first() == Some(&x))
            .count();
        if more > 0 {
            groups.push(ProductGroup {
                first: s,
                len: more + 1,
                operand: x,
            });
        }
        s += more + 1;
    }
    groups
}

/// Pairs each bias gradient with the weight-gradient product of the same layer: a
/// [`Role::Product`] whose right operand is a view of the same value as the `sum_rows`'
/// `dy`, the first such product not paired yet. Where the `sum_rows` comes first, no
/// launch after it up to the product may read its result, and a launch after the product
/// or the entry's outputs must: the executor then writes the bias gradient when the
/// product runs instead (the memory plan keeps its slot from the `sum_rows` to its last
/// reader). Per launch, its partner's launch index.
pub fn bias_grad_pairs(kg: &KernelGraph, launches: &[Described<'_>]) -> Vec<Option<usize>> {
    let mut pairs = vec![None; launches.len()];
    for (s, &(db, inputs, role)) in launches.iter().enumerate() {
        let Some(&dy) = inputs.first().filter(|_| role == Role::SumRows) else {
            continue;
        };
        let root = kg.view_root(dy);
        let product = (0..launches.len()).find(|&g| {
            let (_, ins, role) = launches[g];
            pairs[g].is_none()
                && role == Role::Product
                && ins.get(1).is_some_and(|&w| kg.view_root(w) == root)
        });
        let Some(g) = product else {
            continue;
        };
        if s < g {
            let reads = |t: &Described<'_>| t.1.iter().any(|&x| kg.view_root(x) == db);
            let read_between = launches[s + 1..=g].iter().any(reads);
            let kept = kg.outputs.iter().any(|&(_, v)| kg.view_root(v) == db)
                || launches[g + 1..].iter().any(reads);
            if read_between || !kept {
                continue;
            }
        }
        pairs[s] = Some(g);
        pairs[g] = Some(s);
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_maximal_runs_of_one_role_and_one_left_operand() {
        let (a, b, c) = ([1usize, 10, 11], [1usize, 12, 13], [2usize, 14, 15]);
        let launches: Vec<Described<'_>> = vec![
            (20, &a, Role::Linear),
            (21, &b, Role::Linear),
            (22, &b, Role::Linear),
            // Same operand, another role: a group of its own starts.
            (23, &a, Role::Product),
            (24, &b, Role::Product),
            (25, &c, Role::Product),
            (26, &c, Role::Other),
            (27, &c, Role::Product),
        ];
        assert_eq!(
            product_groups(&launches),
            vec![
                ProductGroup {
                    first: 0,
                    len: 3,
                    operand: 1
                },
                ProductGroup {
                    first: 3,
                    len: 2,
                    operand: 1
                },
            ]
        );
        assert!(product_groups(&launches[5..]).is_empty());
    }
}
