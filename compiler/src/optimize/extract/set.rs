//! A persistent set of e-class indices that knows the summed cost of its members: a
//! big-endian Patricia trie (Okasaki and Gill, "Fast Mergeable Integer Maps") whose
//! nodes are shared between sets and cache their sum.
//!
//! Why: the set an e-class's best choice needs is its children's sets united plus
//! itself. In a deep model those sets hold most of the graph, but two children's sets
//! share nearly all of it (the residual stream below them), and a shared subtree is
//! the same pointer — so a union costs the size of what differs, not of the sets.
//! The trie's shape depends only on its members, so the sum is the same for the same
//! members however the set was built.

use std::rc::Rc;

/// An immutable set of `u32` keys, each with the cost it adds.
#[derive(Clone, Debug, Default)]
pub struct CostSet(Option<Rc<Node>>);

#[derive(Debug)]
enum Node {
    Leaf {
        key: u32,
        cost: f64,
    },
    /// Keys that agree with `prefix` above `bit`; `zero` holds those with `bit` clear.
    Branch {
        prefix: u32,
        bit: u32,
        zero: Rc<Node>,
        one: Rc<Node>,
        sum: f64,
    },
}

impl Node {
    fn sum(&self) -> f64 {
        match self {
            Node::Leaf { cost, .. } => *cost,
            Node::Branch { sum, .. } => *sum,
        }
    }

    fn prefix(&self) -> u32 {
        match self {
            Node::Leaf { key, .. } => *key,
            Node::Branch { prefix, .. } => *prefix,
        }
    }
}

/// The bits of `key` above `bit`.
fn mask(key: u32, bit: u32) -> u32 {
    key & !(bit | (bit - 1))
}

fn branching_bit(a: u32, b: u32) -> u32 {
    1 << (31 - (a ^ b).leading_zeros())
}

fn branch(prefix: u32, bit: u32, zero: Rc<Node>, one: Rc<Node>) -> Rc<Node> {
    let sum = zero.sum() + one.sum();
    Rc::new(Node::Branch {
        prefix,
        bit,
        zero,
        one,
        sum,
    })
}

/// A branch over `zero` and `one`, reusing `old` when neither changed.
fn rebranch(old: &Rc<Node>, zero: Rc<Node>, one: Rc<Node>) -> Rc<Node> {
    match &**old {
        Node::Branch {
            prefix,
            bit,
            zero: z,
            one: o,
            ..
        } => {
            if Rc::ptr_eq(z, &zero) && Rc::ptr_eq(o, &one) {
                old.clone()
            } else {
                branch(*prefix, *bit, zero, one)
            }
        }
        Node::Leaf { .. } => unreachable!("rebranch of a leaf"),
    }
}

/// Two tries whose prefixes disagree, as one.
fn join(a: Rc<Node>, b: Rc<Node>) -> Rc<Node> {
    let (pa, pb) = (a.prefix(), b.prefix());
    let bit = branching_bit(pa, pb);
    if pa & bit == 0 {
        branch(mask(pa, bit), bit, a, b)
    } else {
        branch(mask(pa, bit), bit, b, a)
    }
}

fn insert(t: &Rc<Node>, key: u32, cost: f64) -> Rc<Node> {
    match &**t {
        Node::Leaf { key: k, .. } if *k == key => t.clone(),
        Node::Leaf { .. } => join(Rc::new(Node::Leaf { key, cost }), t.clone()),
        Node::Branch {
            prefix,
            bit,
            zero,
            one,
            ..
        } => {
            if mask(key, *bit) != *prefix {
                join(Rc::new(Node::Leaf { key, cost }), t.clone())
            } else if key & bit == 0 {
                rebranch(t, insert(zero, key, cost), one.clone())
            } else {
                rebranch(t, zero.clone(), insert(one, key, cost))
            }
        }
    }
}

fn union(a: &Rc<Node>, b: &Rc<Node>) -> Rc<Node> {
    if Rc::ptr_eq(a, b) {
        return a.clone();
    }
    match (&**a, &**b) {
        (Node::Leaf { key, cost }, _) => insert(b, *key, *cost),
        (_, Node::Leaf { key, cost }) => insert(a, *key, *cost),
        (
            Node::Branch {
                prefix: p,
                bit: m,
                zero: a0,
                one: a1,
                ..
            },
            Node::Branch {
                prefix: q,
                bit: n,
                zero: b0,
                one: b1,
                ..
            },
        ) => {
            if m == n && p == q {
                rebranch(a, union(a0, b0), union(a1, b1))
            } else if m > n && mask(*q, *m) == *p {
                // `b` lies inside one half of `a`.
                if q & m == 0 {
                    rebranch(a, union(a0, b), a1.clone())
                } else {
                    rebranch(a, a0.clone(), union(a1, b))
                }
            } else if m < n && mask(*p, *n) == *q {
                if p & n == 0 {
                    rebranch(b, union(a, b0), b1.clone())
                } else {
                    rebranch(b, b0.clone(), union(a, b1))
                }
            } else {
                join(a.clone(), b.clone())
            }
        }
    }
}

impl CostSet {
    /// The set with `key` added (its cost counted once, however often it is added).
    pub fn with(&self, key: u32, cost: f64) -> CostSet {
        match &self.0 {
            None => CostSet(Some(Rc::new(Node::Leaf { key, cost }))),
            Some(t) => CostSet(Some(insert(t, key, cost))),
        }
    }

    pub fn union(&self, other: &CostSet) -> CostSet {
        match (&self.0, &other.0) {
            (None, _) => other.clone(),
            (_, None) => self.clone(),
            (Some(a), Some(b)) => CostSet(Some(union(a, b))),
        }
    }

    /// The summed cost of the members.
    pub fn sum(&self) -> f64 {
        self.0.as_ref().map_or(0.0, |t| t.sum())
    }

    #[cfg(test)]
    pub fn keys(&self) -> Vec<u32> {
        fn walk(t: &Node, out: &mut Vec<u32>) {
            match t {
                Node::Leaf { key, .. } => out.push(*key),
                Node::Branch { zero, one, .. } => {
                    walk(zero, out);
                    walk(one, out);
                }
            }
        }
        let mut out = Vec::new();
        if let Some(t) = &self.0 {
            walk(t, &mut out);
        }
        out
    }
}
