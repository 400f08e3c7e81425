//! Canonicalization: rewrites that make equal things look equal, before templates.
//!
//! In: the e-graph of a graph. Out: the same e-graph with more equalities: identities
//! (`x·1`, `x+0`, `−(−x)`, a reshape/broadcast/permute that changes nothing),
//! `permute∘permute` and `reshape∘reshape` and `broadcast∘broadcast` collapsed, a
//! transposed matrix product `(a·b)ᵀ` also written `bᵀ·aᵀ`, and constant scales folded
//! (`(x·a)·b = x·(ab)`, and a scale applied to a matmul operand moved onto its result,
//! where a GEMM applies it as `alpha`).
//!
//! No blanket associativity or commutativity: those make the e-graph grow without
//! bound and no template needs them. Every rule is checked against the analysis' types:
//! a rule that would build an ill-typed node does nothing.

use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol, Var};

use crate::ir::{BinaryOp, DType, Op};
use crate::optimize::analysis::{Info, Types, EG};
use crate::optimize::lang::{add_op, attr_of, Attr};

type Rule = Box<dyn Fn(&mut EG, Id, &Subst) -> Option<Id> + Send + Sync>;

struct FnApplier(Rule);

impl Applier<KNode, Types> for FnApplier {
    fn apply_one(
        &self,
        eg: &mut EG,
        eclass: Id,
        subst: &Subst,
        _a: Option<&PatternAst<KNode>>,
        _r: Symbol,
    ) -> Vec<Id> {
        let Some(new) = (self.0)(eg, eclass, subst) else {
            return vec![];
        };
        // Equal e-classes must have equal types; a mismatch is a bug in the rule.
        let ok = match (&eg[new].data, &eg[eclass].data) {
            (Info::Tensor { ty: a, .. }, Info::Tensor { ty: b, .. }) => a == b,
            _ => false,
        };
        if !ok {
            return vec![];
        }
        if eg.union(eclass, new) {
            vec![eclass]
        } else {
            vec![]
        }
    }
}

use crate::optimize::lang::KNode;

fn var(s: &str) -> Var {
    s.parse().expect("a variable")
}

fn rule(name: &str, lhs: &str, f: Rule) -> Rewrite<KNode, Types> {
    let pat: Pattern<KNode> = lhs.parse().expect("canonicalization patterns parse");
    Rewrite::new(name, pat, FnApplier(f)).expect("canonicalization rules are well formed")
}

fn get(s: &Subst, v: &str) -> Id {
    s[var(v)]
}

fn shape_of(eg: &EG, id: Id) -> Option<crate::shape::Shape> {
    eg[id].data.ty().map(|t| t.shape.clone())
}

fn attr_shape(eg: &EG, id: Id) -> Option<crate::shape::Shape> {
    match attr_of(eg, id) {
        Some(Attr::Shape(s)) => Some(s.clone()),
        _ => None,
    }
}

fn attr_perm(eg: &EG, id: Id) -> Option<Vec<usize>> {
    match attr_of(eg, id) {
        Some(Attr::Perm(p)) => Some(p.clone()),
        _ => None,
    }
}

/// A constant of `like`'s type: a scalar const broadcast to its shape.
fn splat(eg: &mut EG, value: f64, like: Id) -> Option<Id> {
    let ty = eg[like].data.ty()?.clone();
    let c = add_op(
        eg,
        &Op::Const {
            value: crate::ir::Float::new(value),
            dtype: ty.dtype,
        },
        &[],
    );
    if ty.shape.rank() == 0 {
        Some(c)
    } else {
        Some(add_op(eg, &Op::Broadcast { shape: ty.shape }, &[c]))
    }
}

fn is_float(eg: &EG, id: Id) -> bool {
    eg[id].data.ty().is_some_and(|t| t.dtype == DType::F32)
}

/// The canonicalization rules.
pub fn rules() -> Vec<Rewrite<KNode, Types>> {
    vec![
        rule(
            "permute-permute",
            "(permute (permute ?x ?p) ?q)",
            Box::new(|eg, _, s| {
                let p = attr_perm(eg, get(s, "?p"))?;
                let q = attr_perm(eg, get(s, "?q"))?;
                let composed: Vec<usize> = q.iter().map(|&i| p[i]).collect();
                let x = get(s, "?x");
                if composed.iter().enumerate().all(|(i, &a)| i == a) {
                    Some(x)
                } else {
                    Some(add_op(eg, &Op::Permute { perm: composed }, &[x]))
                }
            }),
        ),
        rule(
            "permute-identity",
            "(permute ?x ?p)",
            Box::new(|eg, _, s| {
                let p = attr_perm(eg, get(s, "?p"))?;
                p.iter()
                    .enumerate()
                    .all(|(i, &a)| i == a)
                    .then(|| get(s, "?x"))
            }),
        ),
        // (a·b)ᵀ = bᵀ·aᵀ for matrices: the product of the transposed operands writes the
        // transposed result contiguous (a tied embedding's gradient `[vocab, d]` from the
        // output projection's `[d, vocab]` product), and a kernel reading it needs no
        // strided view.
        rule(
            "permute-matmul",
            "(permute (matmul ?a ?b) ?p)",
            Box::new(|eg, _, s| {
                if attr_perm(eg, get(s, "?p"))? != [1, 0] {
                    return None;
                }
                let (a, b) = (get(s, "?a"), get(s, "?b"));
                if shape_of(eg, a)?.rank() != 2 || shape_of(eg, b)?.rank() != 2 {
                    return None;
                }
                let t = Op::Permute { perm: vec![1, 0] };
                let bt = add_op(eg, &t, &[b]);
                let at = add_op(eg, &t, &[a]);
                Some(add_op(eg, &Op::MatMul, &[bt, at]))
            }),
        ),
        rule(
            "reshape-reshape",
            "(reshape (reshape ?x ?a) ?b)",
            Box::new(|eg, _, s| {
                let b = attr_shape(eg, get(s, "?b"))?;
                let x = get(s, "?x");
                if shape_of(eg, x)? == b {
                    Some(x)
                } else {
                    Some(add_op(eg, &Op::Reshape { shape: b }, &[x]))
                }
            }),
        ),
        rule(
            "reshape-noop",
            "(reshape ?x ?s)",
            Box::new(|eg, _, s| {
                let x = get(s, "?x");
                (shape_of(eg, x)? == attr_shape(eg, get(s, "?s"))?).then_some(x)
            }),
        ),
        rule(
            "broadcast-noop",
            "(broadcast ?x ?s)",
            Box::new(|eg, _, s| {
                let x = get(s, "?x");
                (shape_of(eg, x)? == attr_shape(eg, get(s, "?s"))?).then_some(x)
            }),
        ),
        rule(
            "broadcast-broadcast",
            "(broadcast (broadcast ?x ?a) ?b)",
            Box::new(|eg, _, s| {
                let b = attr_shape(eg, get(s, "?b"))?;
                let x = get(s, "?x");
                let ty = eg[x].data.ty()?.clone();
                crate::infer::infer_type(&Op::Broadcast { shape: b.clone() }, &[&ty]).ok()?;
                Some(add_op(eg, &Op::Broadcast { shape: b }, &[x]))
            }),
        ),
        rule(
            "mul-one",
            "(mul ?x ?c)",
            Box::new(|eg, _, s| (eg[get(s, "?c")].data.konst()? == 1.0).then(|| get(s, "?x"))),
        ),
        rule(
            "add-zero",
            "(add ?x ?c)",
            Box::new(|eg, _, s| (eg[get(s, "?c")].data.konst()? == 0.0).then(|| get(s, "?x"))),
        ),
        rule(
            "zero-add",
            "(add ?c ?x)",
            Box::new(|eg, _, s| (eg[get(s, "?c")].data.konst()? == 0.0).then(|| get(s, "?x"))),
        ),
        rule(
            "neg-neg",
            "(neg (neg ?x))",
            Box::new(|_, _, s| Some(get(s, "?x"))),
        ),
        rule(
            "scale-fold",
            "(mul (mul ?x ?a) ?b)",
            Box::new(|eg, _, s| {
                let x = get(s, "?x");
                if !is_float(eg, x) {
                    return None;
                }
                let a = eg[get(s, "?a")].data.konst()?;
                let b = eg[get(s, "?b")].data.konst()?;
                let ab = f64::from((a as f32) * (b as f32));
                let c = splat(eg, ab, x)?;
                Some(add_op(eg, &Op::Binary(BinaryOp::Mul), &[x, c]))
            }),
        ),
        rule(
            "scale-out-of-matmul-lhs",
            "(matmul (mul ?a ?c) ?b)",
            Box::new(|eg, here, s| {
                let c = eg[get(s, "?c")].data.konst()?;
                let m = add_op(eg, &Op::MatMul, &[get(s, "?a"), get(s, "?b")]);
                let k = splat(eg, c, here)?;
                Some(add_op(eg, &Op::Binary(BinaryOp::Mul), &[m, k]))
            }),
        ),
        rule(
            "scale-out-of-matmul-rhs",
            "(matmul ?a (mul ?b ?c))",
            Box::new(|eg, here, s| {
                let c = eg[get(s, "?c")].data.konst()?;
                let m = add_op(eg, &Op::MatMul, &[get(s, "?a"), get(s, "?b")]);
                let k = splat(eg, c, here)?;
                Some(add_op(eg, &Op::Binary(BinaryOp::Mul), &[m, k]))
            }),
        ),
    ]
}
