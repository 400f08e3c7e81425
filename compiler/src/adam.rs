//! The optimizer as a graph: one Adam update of every parameter, built from primitives.
//!
//! In: the trainable parameters (name and type, in order) and Adam's hyper-parameters
//! `beta1`, `beta2`, `eps`. Out: a [`Graph`] named `adam_update` ([`adam_update_graph`])
//! that computes exactly what `kiln_train::optim::Adam::step` computes, op by op in
//! `f32`, so any executor of the graph reproduces the host optimizer bit for bit. A later
//! pass is expected to fuse each parameter's nodes into a single `adam_update` kernel.
//!
//! # Signature
//!
//! Inputs, in this order:
//! - `step_size` and `inv_sqrt_bc2`, scalar `f32[]`, shared by every parameter: the
//!   caller computes them in `f64` for update `t` (counting from 1) and rounds them to
//!   `f32`, as `Adam::step` does: `step_size = lr / (1 − beta1^t)`,
//!   `inv_sqrt_bc2 = 1 / sqrt(1 − beta2^t)`;
//! - then for each parameter `NAME`: `NAME` (the parameter), `grad.NAME`, `m.NAME` and
//!   `v.NAME`, all of the parameter's type.
//!
//! Outputs, for each parameter in order: the new `NAME`, `m.NAME` and `v.NAME`.
//!
//! # Math (every op in `f32`, in this order)
//!
//! With the constants `b1 = beta1`, `b2 = beta2`, `c1 = 1 − beta1`, `c2 = 1 − beta2`
//! (the differences taken in `f64`) and `eps`, each rounded to `f32` and broadcast to the
//! parameter's shape:
//!
//! ```text
//! m'    = b1·m + c1·g
//! v'    = b2·v + (c2·g)·g
//! denom = sqrt(v')·inv_sqrt_bc2 + eps
//! p'    = p − (step_size·m') / denom
//! ```
//!
//! # Scopes
//!
//! The nodes of parameter `NAME` get the scope `adam.NAME`. Inputs and scalar constants
//! have the empty scope (their constructors give them no other), and since
//! [`Graph::add`] hash-conses, a broadcast shared by parameters of one shape keeps the
//! scope of the first parameter that made it.

use crate::ir::{BinaryOp, DType, Graph, IrError, NodeId, Op, TensorType, UnaryOp};
use crate::shape::Shape;

/// The graph of one Adam update of `params` (see the module docs for its signature).
///
/// Every parameter must be `f32`; a name used twice (or clashing with another input, such
/// as `step_size` or `grad.x` next to `x`) is an [`IrError::Duplicate`].
pub fn adam_update_graph(
    params: &[(String, TensorType)],
    beta1: f64,
    beta2: f64,
    eps: f64,
) -> Result<Graph, IrError> {
    let mut g = Graph::new("adam_update");
    let scalar = TensorType::new(DType::F32, Shape::scalar());
    let step_size = g.add_input("step_size", scalar.clone())?;
    let inv_sqrt_bc2 = g.add_input("inv_sqrt_bc2", scalar)?;
    let consts = Consts {
        b1: g.add_const(beta1, DType::F32),
        b2: g.add_const(beta2, DType::F32),
        c1: g.add_const(1.0 - beta1, DType::F32),
        c2: g.add_const(1.0 - beta2, DType::F32),
        eps: g.add_const(eps, DType::F32),
        step_size,
        inv_sqrt_bc2,
    };
    for (name, ty) in params {
        if ty.dtype != DType::F32 {
            return Err(IrError::Type(format!(
                "parameter `{name}` is {ty}; the Adam update graph works in f32"
            )));
        }
        let p = g.add_input(name, ty.clone())?;
        let grad = g.add_input(&format!("grad.{name}"), ty.clone())?;
        let m = g.add_input(&format!("m.{name}"), ty.clone())?;
        let v = g.add_input(&format!("v.{name}"), ty.clone())?;
        let (p, m, v) = update(&mut g, &consts, p, grad, m, v, &ty.shape, name)?;
        g.add_output(name, p)?;
        g.add_output(&format!("m.{name}"), m)?;
        g.add_output(&format!("v.{name}"), v)?;
    }
    Ok(g)
}

/// The scalar nodes every parameter's update uses.
pub(crate) struct Consts {
    pub b1: NodeId,
    pub b2: NodeId,
    pub c1: NodeId,
    pub c2: NodeId,
    pub eps: NodeId,
    pub step_size: NodeId,
    pub inv_sqrt_bc2: NodeId,
}

/// Appends one parameter's update; returns the new (parameter, m, v).
#[allow(clippy::too_many_arguments)]
pub(crate) fn update(
    g: &mut Graph,
    k: &Consts,
    p: NodeId,
    grad: NodeId,
    m: NodeId,
    v: NodeId,
    shape: &Shape,
    name: &str,
) -> Result<(NodeId, NodeId, NodeId), IrError> {
    let scope = format!("adam.{name}");
    let s = scope.as_str();
    // A scalar node made elementwise-compatible with the parameter.
    let splat = |g: &mut Graph, x: NodeId| g.broadcast_to(x, shape, s);
    let bin = |g: &mut Graph, op: BinaryOp, a: NodeId, b: NodeId| g.add(Op::Binary(op), &[a, b], s);
    use BinaryOp::{Add, Div, Mul, Sub};

    // m' = b1·m + c1·g
    let b1 = splat(g, k.b1)?;
    let c1 = splat(g, k.c1)?;
    let b1m = bin(g, Mul, b1, m)?;
    let c1g = bin(g, Mul, c1, grad)?;
    let m_new = bin(g, Add, b1m, c1g)?;

    // v' = b2·v + (c2·g)·g
    let b2 = splat(g, k.b2)?;
    let c2 = splat(g, k.c2)?;
    let b2v = bin(g, Mul, b2, v)?;
    let c2g = bin(g, Mul, c2, grad)?;
    let c2gg = bin(g, Mul, c2g, grad)?;
    let v_new = bin(g, Add, b2v, c2gg)?;

    // denom = sqrt(v')·inv_sqrt_bc2 + eps
    let inv_sqrt_bc2 = splat(g, k.inv_sqrt_bc2)?;
    let eps = splat(g, k.eps)?;
    let root = g.add(Op::Unary(UnaryOp::Sqrt), &[v_new], s)?;
    let scaled = bin(g, Mul, root, inv_sqrt_bc2)?;
    let denom = bin(g, Add, scaled, eps)?;

    // p' = p − (step_size·m') / denom
    let step_size = splat(g, k.step_size)?;
    let num = bin(g, Mul, step_size, m_new)?;
    let delta = bin(g, Div, num, denom)?;
    let p_new = bin(g, Sub, p, delta)?;
    Ok((p_new, m_new, v_new))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::reference::{run, RunOptions};
    use crate::rng::uniform01;
    use crate::tensor::Tensor;

    fn f32_type(dims: &[i64]) -> TensorType {
        TensorType::new(DType::F32, Shape::consts(dims))
    }

    fn params() -> Vec<(String, TensorType)> {
        vec![
            ("enc.w".to_string(), f32_type(&[4, 8])),
            ("enc.b".to_string(), f32_type(&[16])),
            ("scale".to_string(), f32_type(&[])),
        ]
    }

    /// Deterministic values in (lo, hi).
    fn values(stream: u64, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..n)
            .map(|i| (lo + (hi - lo) * uniform01(7, stream, i as u64)) as f32)
            .collect()
    }

    fn input_names(g: &Graph) -> Vec<String> {
        g.inputs
            .iter()
            .map(|&i| g.source_name(i).unwrap().to_string())
            .collect()
    }

    #[test]
    fn adam_graph_signature() {
        let g = adam_update_graph(&params(), 0.9, 0.98, 1e-9).unwrap();
        g.verify().unwrap();
        assert_eq!(g.name, "adam_update");
        assert_eq!(
            input_names(&g),
            [
                "step_size",
                "inv_sqrt_bc2",
                "enc.w",
                "grad.enc.w",
                "m.enc.w",
                "v.enc.w",
                "enc.b",
                "grad.enc.b",
                "m.enc.b",
                "v.enc.b",
                "scale",
                "grad.scale",
                "m.scale",
                "v.scale",
            ]
        );
        let outputs: Vec<&str> = g.outputs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(
            outputs,
            [
                "enc.w", "m.enc.w", "v.enc.w", "enc.b", "m.enc.b", "v.enc.b", "scale", "m.scale",
                "v.scale"
            ]
        );
        for (name, ty) in params() {
            for key in [
                name.clone(),
                format!("grad.{name}"),
                format!("m.{name}"),
                format!("v.{name}"),
            ] {
                assert_eq!(g.ty(g.input(&key).unwrap()), &ty, "{key}");
            }
            for key in [name.clone(), format!("m.{name}"), format!("v.{name}")] {
                let out = g.output(&key).unwrap();
                assert_eq!(g.ty(out), &ty, "{key}");
                assert_eq!(*g.node(out).scope, format!("adam.{name}"), "{key}");
            }
        }
        assert!(g.params.is_empty());
        // Only the allowed primitives, and every computed node carries a parameter scope.
        for node in &g.nodes {
            match &node.op {
                Op::Input { .. } | Op::Const { .. } => assert_eq!(&*node.scope, ""),
                Op::Broadcast { .. }
                | Op::Unary(UnaryOp::Sqrt)
                | Op::Binary(BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div) => {
                    assert!(node.scope.starts_with("adam."), "{node:?}")
                }
                other => panic!("unexpected op {other:?}"),
            }
        }
    }

    #[test]
    fn adam_graph_rejects_bad_params() {
        let bf16 = vec![(
            "w".to_string(),
            TensorType::new(DType::BF16, Shape::consts(&[2])),
        )];
        let e = adam_update_graph(&bf16, 0.9, 0.98, 1e-9).unwrap_err();
        assert!(e.to_string().contains("`w`"), "{e}");
        let twice = vec![
            ("w".to_string(), f32_type(&[2])),
            ("w".to_string(), f32_type(&[2])),
        ];
        assert!(matches!(
            adam_update_graph(&twice, 0.9, 0.98, 1e-9),
            Err(IrError::Duplicate { .. })
        ));
        let clash = vec![("step_size".to_string(), f32_type(&[2]))];
        assert!(matches!(
            adam_update_graph(&clash, 0.9, 0.98, 1e-9),
            Err(IrError::Duplicate { .. })
        ));
        let empty = adam_update_graph(&[], 0.9, 0.98, 1e-9).unwrap();
        empty.verify().unwrap();
        assert!(empty.outputs.is_empty());
    }

    #[test]
    fn adam_graph_matches_hand_computation() {
        let (beta1, beta2, eps) = (0.9f64, 0.98f64, 1e-9f64);
        let g = adam_update_graph(&params(), beta1, beta2, eps).unwrap();
        // Update 3 with lr = 1e-3, the scalars computed as `Adam::step` does.
        let (lr, t) = (1e-3f64, 3);
        let step_size = (lr / (1.0 - beta1.powi(t))) as f32;
        let inv_sqrt_bc2 = (1.0 / (1.0 - beta2.powi(t)).sqrt()) as f32;

        let mut inputs = BTreeMap::new();
        inputs.insert("step_size".to_string(), Tensor::scalar_f32(step_size));
        inputs.insert("inv_sqrt_bc2".to_string(), Tensor::scalar_f32(inv_sqrt_bc2));
        let mut want: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        for (k, (name, ty)) in params().iter().enumerate() {
            let dims = ty.shape.as_consts().unwrap();
            let n = dims.iter().product::<usize>();
            let s = 4 * k as u64;
            // Magnitudes close to those of the update, so that a different rounding in
            // any op of the update shows in the results.
            let p = values(s, n, -0.01, 0.01);
            let gr = values(s + 1, n, -0.5, 0.5);
            let m = values(s + 2, n, -0.01, 0.01);
            let v = values(s + 3, n, 0.0, 1e-4);
            for (key, x) in [
                (name.clone(), &p),
                (format!("grad.{name}"), &gr),
                (format!("m.{name}"), &m),
                (format!("v.{name}"), &v),
            ] {
                inputs.insert(key, Tensor::f32(dims.clone(), x.clone()).unwrap());
            }
            // The expected values: plain f32 loops in the graph's op order.
            let (b1, b2, e) = (beta1 as f32, beta2 as f32, eps as f32);
            let (c1, c2) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32);
            let (mut p2, mut m2, mut v2) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            for i in 0..n {
                m2[i] = b1 * m[i] + c1 * gr[i];
                v2[i] = b2 * v[i] + (c2 * gr[i]) * gr[i];
                let denom = v2[i].sqrt() * inv_sqrt_bc2 + e;
                p2[i] = p[i] - (step_size * m2[i]) / denom;
            }
            want.insert(name.clone(), p2);
            want.insert(format!("m.{name}"), m2);
            want.insert(format!("v.{name}"), v2);
        }

        let got = run(&g, &inputs, &BTreeMap::new(), &RunOptions::default()).unwrap();
        assert_eq!(got.len(), want.len());
        for (name, tensor) in &got {
            let expect = &want[name];
            let got = tensor.as_f32().unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got), bits(expect), "{name}: {got:?} vs {expect:?}");
            // The update actually moved something.
            let old = inputs[name].as_f32().unwrap();
            assert_ne!(bits(got), bits(old), "{name}");
        }
    }
}
