//! The table behind [`Graph::add`](crate::Graph::add)'s hash-consing: an op applied to
//! operands it was already applied to returns the existing node.
//!
//! The table holds node ids with their hashes, not `(op, operands)` keys: the graph's
//! nodes are the keys, so adding a node clones nothing, and growing the table rehashes
//! nothing (a graph of a million nodes spent a third of its elaboration in both).

use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};

use hashbrown::HashTable;

use crate::ir::{Node, NodeId, Op};

#[derive(Clone, Debug, Default)]
pub(crate) struct Dedup {
    table: HashTable<(u64, NodeId)>,
}

fn hash(op: &Op, inputs: &[NodeId]) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one((op, inputs))
}

impl Dedup {
    /// The node of `nodes` that applies `op` to `inputs`, if the table holds one.
    pub fn find(&self, nodes: &[Node], op: &Op, inputs: &[NodeId]) -> Option<NodeId> {
        let h = hash(op, inputs);
        self.table
            .find(h, |&(eh, id)| {
                let n = &nodes[id.index()];
                eh == h && n.op == *op && n.inputs == inputs
            })
            .map(|&(_, id)| id)
    }

    /// Records `nodes[id]`, which [`Dedup::find`] did not find.
    pub fn insert(&mut self, nodes: &[Node], id: NodeId) {
        let n = &nodes[id.index()];
        let h = hash(&n.op, &n.inputs);
        self.table.insert_unique(h, (h, id), |e| e.0);
    }
}
