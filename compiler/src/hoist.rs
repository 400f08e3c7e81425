//! Per-sentence values of a decoder step, hoisted out of it.
//!
//! In: a `decode_step` graph and which of its inputs change at every step (the newest
//! tokens and the key/value caches); the `encode` graph. Out: the step graph with every
//! value that depends only on the other inputs (the encoder memory, the source) and on
//! parameters replaced by an input named `static.<scope>.<i>`, and the `encode` graph
//! extended to compute those values once per sentence ([`hoist_static`]).
//!
//! In the Transformer these are the cross-attention's keys and values — `memory·W_K + b_K`
//! and `memory·W_V + b_V` in every decoder layer: without
//! hoisting, every step of beam search recomputes them over every source position, most
//! of a step's multiply-adds (fairseq and Marian cache them the same way). Only
//! floating-point values are hoisted (the source mask stays in the step). Views (reshape,
//! permute, broadcast) are never hoisted: their source is, and the view stays in the step,
//! so the step's kernels keep their shape (the heads' split feeds the fused attention as
//! before). One layout is chosen, though: a value the step reads only as the transposed
//! right operand of products (the keys, in `q·kᵀ`) is stored transposed (`kᵀ`, the heads'
//! split applied), so that a step's product reads its rows as they are instead of copying
//! them transposed at every step ([`Stored`]).

use std::collections::BTreeMap;

use crate::ir::{Graph, IrError, NodeId, Op};
use crate::shape::Dim;

/// Prefix of the inputs that [`hoist_static`] gives the step (and outputs it gives
/// `encode`).
pub const STATIC_PREFIX: &str = "static.";

/// The `encode` and `decode_step` graphs after hoisting.
#[derive(Clone, Debug)]
pub struct Hoisted {
    pub encode: Graph,
    pub step: Graph,
    /// The names of the hoisted values, in node order.
    pub names: Vec<String>,
}

fn is_view(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape { .. } | Op::Permute { .. } | Op::Broadcast { .. }
    )
}

/// Symbols a list of dims names.
fn symbols<'a>(dims: impl IntoIterator<Item = &'a Dim>) -> Vec<String> {
    dims.into_iter()
        .flat_map(|d| d.symbols())
        .map(|s| s.to_string())
        .collect()
}

/// Symbols an op's attributes name (dims that can change between steps hide there).
fn attr_symbols(op: &Op) -> Vec<String> {
    let dims: Vec<&Dim> = match op {
        Op::Reshape { shape } | Op::Broadcast { shape } => shape.dims().iter().collect(),
        Op::ScatterAdd { rows } => vec![rows],
        Op::CausalMask { q, k } => vec![q, k],
        Op::Arange { start, len } | Op::Slice { start, len, .. } => vec![start, len],
        Op::OneHot { depth } => vec![depth],
        _ => vec![],
    };
    symbols(dims)
}

/// Hoists out of `step` every value computed from parameters, constants and the inputs
/// for which `per_step` is false, and adds their computation to `encode`: each input the
/// hoisted values read must be an output of `encode` (a stage, such as the memory) or an
/// input of it (such as the source). `None` when nothing is worth hoisting (no value
/// reads such an input through an op other than a view).
pub fn hoist_static(
    encode: &Graph,
    step: &Graph,
    per_step: &dyn Fn(&str) -> bool,
) -> Result<Option<Hoisted>, IrError> {
    let hoisted = frontier(step, per_step);
    if hoisted.is_empty() {
        return Ok(None);
    }
    // Names: `static.<scope>.<i>`, numbered within each scope in node order.
    let mut per_scope: BTreeMap<&str, usize> = BTreeMap::new();
    let names: Vec<String> = hoisted
        .iter()
        .map(|&h| {
            let scope = step.node(h).scope.as_ref();
            let k = per_scope.entry(scope).or_insert(0);
            *k += 1;
            if scope.is_empty() {
                format!("{STATIC_PREFIX}{}", *k - 1)
            } else {
                format!("{STATIC_PREFIX}{scope}.{}", *k - 1)
            }
        })
        .collect();

    let stored: Vec<Stored> = hoisted.iter().map(|&h| Stored::of(step, h)).collect();
    let enc = extend_encode(encode, step, &stored, &names)?;
    // The step: each hoisted value an input, what only they needed pruned away.
    let replace: Vec<(NodeId, String, Option<Vec<usize>>)> = stored
        .iter()
        .zip(&names)
        .map(|(s, n)| (s.node, n.clone(), s.perm.clone()))
        .collect();
    let step = step.replace_with_inputs(&replace)?;
    enc.verify()?;
    step.verify()?;
    Ok(Some(Hoisted {
        encode: enc,
        step,
        names,
    }))
}

/// How a hoisted value is stored: the step's `node` (the hoisted value, or a view of it),
/// permuted by `perm` when given.
struct Stored {
    node: NodeId,
    perm: Option<Vec<usize>>,
}

impl Stored {
    /// `h` as it is, unless the step reads it only through one chain of views whose end
    /// is read only transposed (its last two axes swapped) as the right operand of
    /// products: then that end, stored transposed.
    fn of(step: &Graph, h: NodeId) -> Stored {
        let users = |x: NodeId| -> Vec<(NodeId, usize)> {
            let mut u = Vec::new();
            for (i, node) in step.nodes.iter().enumerate() {
                for (k, &y) in node.inputs.iter().enumerate() {
                    if y == x {
                        u.push((NodeId(i as u32), k));
                    }
                }
            }
            u
        };
        // The permutation that swaps the last two of `rank` axes.
        let swap = |rank: usize| -> Vec<usize> {
            let mut p: Vec<usize> = (0..rank).collect();
            p.swap(rank - 2, rank - 1);
            p
        };
        // `x` a transpose, read only as a product's right operand.
        let is_key = |x: NodeId| {
            let rank = step.ty(x).shape.rank();
            rank >= 2
                && matches!(&step.node(x).op, Op::Permute { perm } if perm == &swap(rank))
                && users(x)
                    .iter()
                    .all(|&(u, k)| k == 1 && matches!(step.node(u).op, Op::MatMul))
        };
        let in_output = |x: NodeId| step.outputs.iter().any(|o| o.node == x);
        let mut end = h;
        loop {
            let us = users(end);
            match us.as_slice() {
                [(u, _)] if is_view(&step.node(*u).op) && !is_key(*u) => end = *u,
                _ => break,
            }
        }
        let us = users(end);
        let keys = !us.is_empty()
            && !in_output(end)
            && us.iter().all(|&(u, _)| is_key(u))
            && (end == h || !in_output(h));
        match keys {
            true => Stored {
                node: end,
                perm: Some(swap(step.ty(end).shape.rank())),
            },
            false => Stored {
                node: h,
                perm: None,
            },
        }
    }
}

/// The values worth hoisting, in node order: per-sentence values read by a per-step one
/// (or returned), each taken back through views to the value under them.
fn frontier(step: &Graph, per_step: &dyn Fn(&str) -> bool) -> Vec<NodeId> {
    let n = step.nodes.len();
    // Symbols the per-sentence inputs carry: a value whose type or attributes name any
    // other (the cache length, the step's own length) is not per-sentence.
    let mut allowed: Vec<String> = Vec::new();
    for &i in &step.inputs {
        let node = step.node(i);
        if let Op::Input { name } = &node.op {
            if !per_step(name) {
                allowed.extend(symbols(node.ty.shape.dims()));
            }
        }
    }
    let fits = |syms: Vec<String>| syms.iter().all(|s| allowed.contains(s));
    // inv: computed from per-sentence inputs, parameters and constants; dep: reads at
    // least one per-sentence input.
    let mut inv = vec![false; n];
    let mut dep = vec![false; n];
    for (i, node) in step.nodes.iter().enumerate() {
        (inv[i], dep[i]) = match &node.op {
            Op::Input { name } => (!per_step(name), !per_step(name)),
            Op::Param { .. } | Op::Const { .. } => (true, false),
            Op::Dropout { .. } => (false, false),
            op => {
                let ok = !node.inputs.is_empty()
                    && node.inputs.iter().all(|x| inv[x.index()])
                    && fits(symbols(node.ty.shape.dims()))
                    && fits(attr_symbols(op));
                (ok, ok && node.inputs.iter().any(|x| dep[x.index()]))
            }
        };
    }
    let root = |mut x: NodeId| {
        while is_view(&step.node(x).op) {
            x = step.node(x).inputs[0];
        }
        x
    };
    let mut frontier = vec![false; n];
    let mut mark = |x: NodeId| {
        let r = root(x);
        let node = step.node(r);
        // Floating-point values only: a mask is cheap to recompute, and every executor
        // already takes the integer source it comes from.
        if inv[r.index()]
            && dep[r.index()]
            && node.ty.dtype.is_float()
            && !matches!(node.op, Op::Input { .. })
        {
            frontier[r.index()] = true;
        }
    };
    for (i, node) in step.nodes.iter().enumerate() {
        if !inv[i] {
            for &x in &node.inputs {
                if inv[x.index()] {
                    mark(x);
                }
            }
        }
    }
    for o in &step.outputs {
        if inv[o.node.index()] {
            mark(o.node);
        }
    }
    (0..n)
        .filter(|&i| frontier[i])
        .map(|i| NodeId(i as u32))
        .collect()
}

/// `encode` extended with the computation of the hoisted values, reading its stages and
/// inputs, each hoisted value an output under its name.
fn extend_encode(
    encode: &Graph,
    step: &Graph,
    hoisted: &[Stored],
    names: &[String],
) -> Result<Graph, IrError> {
    let n = step.nodes.len();
    let mut enc = encode.clone();
    let mut map: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    let mut need = vec![false; n];
    for h in hoisted {
        need[h.node.index()] = true;
    }
    for i in (0..n).rev() {
        if need[i] {
            for x in &step.nodes[i].inputs {
                need[x.index()] = true;
            }
        }
    }
    for (i, node) in step.nodes.iter().enumerate() {
        if !need[i] {
            continue;
        }
        let id = NodeId(i as u32);
        let new = match &node.op {
            Op::Input { name } => {
                enc.output(name)
                    .or_else(|| enc.input(name))
                    .ok_or_else(|| {
                        IrError::Malformed(format!(
                    "the decoder's per-sentence input `{name}` is neither an output nor an \
                     input of the encode graph"
                ))
                    })?
            }
            Op::Param { name, init } => match enc.param(name) {
                Some(p) => p,
                None => enc.add_param(name, node.ty.clone(), *init, &node.scope)?,
            },
            op => {
                let inputs: Vec<NodeId> = node.inputs.iter().map(|x| map[x]).collect();
                enc.add(op.clone(), &inputs, &node.scope)?
            }
        };
        if enc.ty(new) != &node.ty {
            return Err(IrError::Type(format!(
                "`{}` is {} in the encode graph but {} in the decoder step",
                step.source_name(id).unwrap_or("a hoisted value"),
                enc.ty(new),
                node.ty
            )));
        }
        map.insert(id, new);
    }
    for (h, name) in hoisted.iter().zip(names) {
        let value = match &h.perm {
            Some(perm) => {
                let scope = step.node(h.node).scope.clone();
                enc.add(Op::Permute { perm: perm.clone() }, &[map[&h.node]], &scope)?
            }
            None => map[&h.node],
        };
        enc.add_output(name, value)?;
    }
    Ok(enc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Init, TensorType, UnaryOp};
    use crate::reference::{run, RunOptions};
    use crate::shape::Shape;
    use crate::tensor::Tensor;

    fn f32_ty(dims: &[Dim]) -> TensorType {
        TensorType::new(DType::F32, Shape(dims.to_vec()))
    }

    /// `encode`: memory = exp(x). The step: scores = tgt_in · (memory·w)ᵀ.
    fn graphs() -> (Graph, Graph) {
        let (b, s, t) = (Dim::sym("batch"), Dim::sym("src_len"), Dim::sym("tgt_len"));
        let mut enc = Graph::new("m");
        let x = enc
            .add_input("x", f32_ty(&[b.clone(), s.clone(), Dim::c(4)]))
            .unwrap();
        let m = enc.add(Op::Unary(UnaryOp::Exp), &[x], "enc").unwrap();
        enc.add_output("memory", m).unwrap();
        let mut step = Graph::new("m");
        let mem = step
            .add_input("memory", f32_ty(&[b.clone(), s.clone(), Dim::c(4)]))
            .unwrap();
        let tok = step
            .add_input("tgt_in", f32_ty(&[b, t, Dim::c(4)]))
            .unwrap();
        let w = step
            .add_param(
                "w",
                f32_ty(&[Dim::c(4), Dim::c(4)]),
                Init::XavierUniform,
                "dec.cross",
            )
            .unwrap();
        let k = step.add(Op::MatMul, &[mem, w], "dec.cross").unwrap();
        let kt = step
            .add(
                Op::Permute {
                    perm: vec![0, 2, 1],
                },
                &[k],
                "dec.cross",
            )
            .unwrap();
        let scores = step.add(Op::MatMul, &[tok, kt], "dec.cross").unwrap();
        step.add_output("scores", scores).unwrap();
        (enc, step)
    }

    fn tensor(shape: &[usize], seed: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v = (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
        Tensor::f32(shape.to_vec(), v).unwrap()
    }

    #[test]
    fn the_keys_move_to_encode_and_the_view_stays_in_the_step() {
        let (enc, step) = graphs();
        let per_step = |n: &str| enc.output(n).is_none() && enc.input(n).is_none();
        let h = hoist_static(&enc, &step, &per_step)
            .unwrap()
            .expect("hoists");
        assert_eq!(h.names, ["static.dec.cross.0"]);
        let names = |g: &Graph| -> Vec<String> {
            g.inputs
                .iter()
                .map(|&i| g.source_name(i).unwrap().to_string())
                .collect()
        };
        assert_eq!(names(&h.step), ["tgt_in", "static.dec.cross.0"]);
        // The keys, read only transposed by the scores' product, stored as `kᵀ`.
        let keys = h.step.input("static.dec.cross.0").unwrap();
        assert_eq!(h.step.ty(keys).to_string(), "f32[batch, 4, src_len]");
        assert!(h.step.param("w").is_none() && h.encode.param("w").is_some());
        assert!(h
            .step
            .nodes
            .iter()
            .any(|n| matches!(n.op, Op::Permute { .. })));
        let outs: Vec<&str> = h.encode.outputs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(outs, ["memory", "static.dec.cross.0"]);

        // Same scores, to the bit, through either pair.
        let opts = RunOptions::default();
        let params: BTreeMap<String, Tensor> = [("w".to_string(), tensor(&[4, 4], 0.5))].into();
        let enc_in: BTreeMap<String, Tensor> = [("x".to_string(), tensor(&[2, 3, 4], 1.0))].into();
        let tgt = tensor(&[2, 1, 4], 2.0);
        let before: BTreeMap<String, Tensor> = run(&enc, &enc_in, &params, &opts)
            .unwrap()
            .into_iter()
            .chain([("tgt_in".to_string(), tgt.clone())])
            .collect();
        let want = run(&step, &before, &params, &opts).unwrap();
        let after: BTreeMap<String, Tensor> = run(&h.encode, &enc_in, &params, &opts)
            .unwrap()
            .into_iter()
            .filter(|(n, _)| n.starts_with(STATIC_PREFIX))
            .chain([("tgt_in".to_string(), tgt)])
            .collect();
        let got = run(&h.step, &after, &params, &opts).unwrap();
        assert_eq!(format!("{want:?}"), format!("{got:?}"));
    }

    #[test]
    fn keys_read_otherwise_too_are_stored_as_they_are() {
        let (enc, mut step) = graphs();
        // `memory·w` also returned as it is: stored untransposed.
        let k = step
            .nodes
            .iter()
            .position(|n| matches!(n.op, Op::MatMul))
            .unwrap();
        step.add_output("keys", NodeId(k as u32)).unwrap();
        let per_step = |n: &str| enc.output(n).is_none() && enc.input(n).is_none();
        let h = hoist_static(&enc, &step, &per_step).unwrap().unwrap();
        let keys = h.step.input("static.dec.cross.0").unwrap();
        assert_eq!(h.step.ty(keys).to_string(), "f32[batch, src_len, 4]");
    }

    #[test]
    fn nothing_to_hoist_and_an_input_encode_lacks() {
        let (enc, step) = graphs();
        // Everything per step: nothing is hoisted.
        assert!(hoist_static(&enc, &step, &|_| true).unwrap().is_none());
        // `tgt_in` taken for per-sentence: encode cannot compute the scores.
        let e = hoist_static(&enc, &step, &|_| false).unwrap_err();
        assert!(
            e.to_string()
                .contains("per-sentence input `tgt_in` is neither an output nor an input"),
            "{e}"
        );
    }
}
