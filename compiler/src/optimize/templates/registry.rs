//! The templates, family by family, in the registry's fixed order (the e-node kind
//! `Kernel(i)` indexes it): each built from the prelude's own steps, each backward
//! derived by the compiler's autodiff from its forward.

use crate::autodiff::{gradients, gradients_carried, gradients_seeded};
use crate::ir::{BinaryOp, DType, Float, NodeId, Op, ReduceOp, UnaryOp};
use crate::optimize::lang::Attr;
use crate::shape::{Dim, Shape};

use super::graphs::{
    attention_graph, def, lead_dims, masked_scores, shape_dims, strs, sym_shape, Mask, TB,
};
use super::{LnForm, TemplateDef, TemplateKind, PAD_SENTINEL, P_SENTINEL, STREAM_SENTINEL};

/// Every template, in the registry's order.
pub(super) fn build() -> Vec<TemplateDef> {
    let mut out = Vec::new();
    linear(&mut out);
    softmax(&mut out);
    scale_mask_softmax(&mut out);
    attention(&mut out);
    add_layer_norm(&mut out);
    xent_ls(&mut out);
    embed_pe(&mut out);
    sum_rows(&mut out);
    scatter_add_into(&mut out);
    adam_update(&mut out);
    out
}

/// linear / linear_relu: x[..., k] @ w[k, n] + b[n] (then relu).
fn linear(out: &mut Vec<TemplateDef>) {
    for relu in [false, true] {
        for rank in 2..=4 {
            let mut t = TB::new("linear");
            let mut dims = lead_dims(rank - 1);
            dims.push("k".into());
            let x = t.input("x", DType::F32, &strs(&dims));
            let w = t.input("w", DType::F32, &["k", "n"]);
            let b = t.input("b", DType::F32, &["n"]);
            let y = t.matmul(x, w);
            let bb = t.bc(b, y);
            let mut y = t.bin(BinaryOp::Add, y, bb);
            if relu {
                y = t.un(UnaryOp::Relu, y);
            }
            let kind = if relu {
                TemplateKind::LinearRelu
            } else {
                TemplateKind::Linear
            };
            out.push(def(
                kind,
                format!("rank={rank}"),
                t,
                vec![x, w, b],
                vec![],
                vec![y],
            ));
        }
    }
}

/// softmax over the last axis.
fn softmax(out: &mut Vec<TemplateDef>) {
    for rank in 2..=4 {
        let mut t = TB::new("softmax");
        let x = t.input("x", DType::F32, &strs(&lead_dims(rank)));
        let y = t.softmax(x, rank - 1);
        out.push(def(
            TemplateKind::Softmax,
            format!("rank={rank}"),
            t,
            vec![x],
            vec![],
            vec![y],
        ));
    }
}

/// scale_mask_softmax over attention scores [b, h, tq, tk].
fn scale_mask_softmax(out: &mut Vec<TemplateDef>) {
    for mask in [Mask::None, Mask::Key, Mask::Causal] {
        let mut t = TB::new("scale_mask_softmax");
        let x = t.input("x", DType::F32, &["b", "h", "tq", "tk"]);
        let m = match mask {
            Mask::Key => {
                let sh = shape_dims(&t, &["b", "1", "1", "tk"]);
                Some(t.input_shape("mask", DType::Bool, sh))
            }
            other => other.input(&mut t),
        };
        let scale = t.input("scale", DType::F32, &[]);
        let fill = m.map(|_| t.input("fill", DType::F32, &[]));
        let s = masked_scores(&mut t, x, scale, m, fill);
        let y = t.softmax(s, 3);
        let mut inputs = vec![x];
        inputs.extend(m);
        inputs.push(scale);
        inputs.extend(fill);
        out.push(def(
            TemplateKind::ScaleMaskSoftmax,
            format!("mask={}", mask.name()),
            t,
            inputs,
            vec![],
            vec![y],
        ));
    }
}

/// attention and its backward.
fn attention(out: &mut Vec<TemplateDef>) {
    for mask in [Mask::None, Mask::Key, Mask::Causal] {
        let (t, inputs, o) = attention_graph(mask);
        out.push(def(
            TemplateKind::Attention,
            format!("mask={}", mask.name()),
            t,
            inputs,
            vec![],
            vec![o],
        ));

        let (mut t, mut inputs, o) = attention_graph(mask);
        let g = t.input("g", DType::F32, &["b", "h", "tq", "dv"]);
        let wrt = inputs[..3].to_vec();
        let (graph, grads) =
            gradients_seeded(&t.g, o, Some(g), &wrt).expect("attention differentiates");
        t.g = graph;
        let pos = if matches!(mask, Mask::None) { 3 } else { 4 };
        inputs.insert(pos, g);
        out.push(def(
            TemplateKind::AttentionBwd,
            format!("mask={}", mask.name()),
            t,
            inputs,
            vec![],
            grads,
        ));
    }
}

/// add_layer_norm: normalize(x + y) over the last axis, and its backward; the `plain`
/// form normalizes `x` alone (a pre-LN block's norms, a stack's final norm), and its
/// backward's `plain carry` form adds the gradient that reaches `x` from a later use (the
/// residual path past a pre-LN norm), which the walk sums first.
fn add_layer_norm(out: &mut Vec<TemplateDef>) {
    for rms in [false, true] {
        for form in [LnForm::Add, LnForm::Plain] {
            for rank in 2..=4 {
                add_layer_norm_forms(out, rank, form, rms);
            }
        }
    }
}

/// One rank and form of `add_layer_norm` (`rms`: RMSNorm's `x · rsqrt(mean(x²) + eps) · γ`,
/// no β) and its backward forms.
fn add_layer_norm_forms(out: &mut Vec<TemplateDef>, rank: usize, form: LnForm, rms: bool) {
    let add = form == LnForm::Add;
    let build = || {
        let mut t = TB::new("add_layer_norm");
        let mut dims = lead_dims(rank - 1);
        dims.push("d".into());
        let x = t.input("x", DType::F32, &strs(&dims));
        let y = add.then(|| t.input("y", DType::F32, &strs(&dims)));
        let gamma = t.input("gamma", DType::F32, &["d"]);
        let beta = (!rms).then(|| t.input("beta", DType::F32, &["d"]));
        let inv_d = t.input("inv_d", DType::F32, &[]);
        let eps = t.input("eps", DType::F32, &[]);
        let s = match y {
            Some(y) => t.bin(BinaryOp::Add, x, y),
            None => x,
        };
        let o = match beta {
            Some(beta) => t.normalize(s, gamma, beta, inv_d, eps),
            None => t.rms_normalize(s, gamma, inv_d, eps),
        };
        (t, x, y, gamma, beta, [inv_d, eps], o, dims)
    };
    let (t, x, y, gamma, beta, [inv_d, eps], o, _) = build();
    let mut inputs = vec![x];
    inputs.extend(y);
    inputs.push(gamma);
    inputs.extend(beta);
    inputs.extend([inv_d, eps]);
    let mut variant = format!("rank={rank}");
    if !add {
        variant.push_str(" plain");
    }
    if rms {
        variant.push_str(" rms");
    }
    out.push(def(
        TemplateKind::AddLayerNorm,
        variant.clone(),
        t,
        inputs,
        vec![],
        vec![o],
    ));
    let backward_forms = if add {
        vec![LnForm::Add]
    } else {
        vec![LnForm::Plain, LnForm::Carry]
    };
    for bwd in backward_forms {
        let (mut t, x, y, gamma, beta, [inv_d, eps], o, dims) = build();
        let g = t.input("g", DType::F32, &strs(&dims));
        // The carried gradient takes `y`'s operand slot.
        let carried = (bwd == LnForm::Carry).then(|| t.input("g_carry", DType::F32, &strs(&dims)));
        let carry: Vec<(NodeId, NodeId)> = carried.iter().map(|&c| (x, c)).collect();
        let mut wrt = vec![x, gamma];
        wrt.extend(beta);
        let (graph, grads) =
            gradients_carried(&t.g, o, Some(g), &wrt, &carry).expect("layer norm differentiates");
        t.g = graph;
        let mut inputs = vec![x];
        inputs.extend(y.or(carried));
        inputs.extend([gamma, g, inv_d, eps]);
        let variant = match bwd {
            LnForm::Carry => format!("{variant} carry"),
            _ => variant.clone(),
        };
        out.push(def(
            TemplateKind::AddLayerNormBwd,
            variant,
            t,
            inputs,
            vec![],
            grads,
        ));
    }
}

/// xent_ls: log-softmax + label-smoothed NLL averaged over non-pad targets, fused with
/// the gradient of the logits (output 1; used by train_step). The `seeded` form is a
/// loss-scaled train_step's: the gradient is seeded by the scalar operand `seed`.
fn xent_ls(out: &mut Vec<TemplateDef>) {
    for seeded in [false, true] {
        let mut t = TB::new("xent_ls");
        let logits = t.input("logits", DType::F32, &["b", "t", "v"]);
        let target = t.input("target", DType::I32, &["b", "t"]);
        let c_nll = t.input("c_nll", DType::F32, &[]);
        let c_smooth = t.input("c_smooth", DType::F32, &[]);
        let inv_v = t.input("inv_v", DType::F32, &[]);
        let lp = t.log_softmax(logits, 2);
        let oh = t.op(
            Op::OneHot {
                depth: Dim::sym("v"),
            },
            &[target],
        );
        let picked = t.bin(BinaryOp::Mul, lp, oh);
        let ps = t.reduce(ReduceOp::Sum, picked, 2);
        let nll = t.un(UnaryOp::Neg, ps);
        let sl = t.reduce(ReduceOp::Sum, lp, 2);
        let nsl = t.un(UnaryOp::Neg, sl);
        let ivb = t.bc(inv_v, nsl);
        let smooth = t.bin(BinaryOp::Mul, nsl, ivb);
        let cnb = t.bc(c_nll, nll);
        let a = t.bin(BinaryOp::Mul, nll, cnb);
        let csb = t.bc(c_smooth, smooth);
        let bterm = t.bin(BinaryOp::Mul, smooth, csb);
        let loss = t.bin(BinaryOp::Add, a, bterm);
        let pm = t.op(Op::PadMask { pad: PAD_SENTINEL }, &[target]);
        let pf = t.op(Op::Cast { to: DType::F32 }, &[pm]);
        let keep = t.op(
            Op::Reshape {
                shape: shape_dims(&t, &["b", "t", "1"]),
            },
            &[pf],
        );
        let lk = t.bin(BinaryOp::Mul, loss, keep);
        let full_sum = |t: &mut TB, x: NodeId| {
            let a = t.reduce(ReduceOp::Sum, x, 0);
            let b = t.reduce(ReduceOp::Sum, a, 1);
            let c = t.reduce(ReduceOp::Sum, b, 2);
            t.op(
                Op::Reshape {
                    shape: Shape::scalar(),
                },
                &[c],
            )
        };
        let num = full_sum(&mut t, lk);
        let den = full_sum(&mut t, keep);
        let mean = t.bin(BinaryOp::Div, num, den);
        let mut operands = vec![logits, target, c_nll, c_smooth, inv_v];
        let (graph, grads) = if seeded {
            let seed = t.input("seed", DType::F32, &[]);
            operands.push(seed);
            gradients_seeded(&t.g, mean, Some(seed), &[logits])
        } else {
            gradients(&t.g, mean, &[logits])
        }
        .expect("xent differentiates");
        t.g = graph;
        let variant = if seeded { "rank=3 seeded" } else { "rank=3" };
        out.push(def(
            TemplateKind::XentLs,
            variant.to_string(),
            t,
            operands,
            vec![Attr::Int(PAD_SENTINEL)],
            vec![mean, grads[0]],
        ));
    }
}

/// embed_pe: gather(table, ids) · scale + positions, and in training the dropout
/// that follows (the mask is the same: dropout's element index is the output's).
fn embed_pe(out: &mut Vec<TemplateDef>) {
    for dropout in [false, true] {
        let mut t = TB::new("embed_pe");
        let table = t.input("table", DType::F32, &["vocab", "d"]);
        let ids = t.input("ids", DType::I32, &["b", "t"]);
        let pe = t.input("pe", DType::F32, &["t", "d"]);
        let scale = t.input("scale", DType::F32, &[]);
        let e = t.op(Op::Gather, &[table, ids]);
        let sb = t.bc(scale, e);
        let es = t.bin(BinaryOp::Mul, e, sb);
        let pb = t.bc(pe, es);
        let mut y = t.bin(BinaryOp::Add, es, pb);
        let mut attrs = vec![];
        if dropout {
            y = t.op(
                Op::Dropout {
                    p: Float::new(P_SENTINEL),
                    stream: STREAM_SENTINEL as u32,
                },
                &[y],
            );
            attrs = vec![Attr::F(Float::new(P_SENTINEL)), Attr::Int(STREAM_SENTINEL)];
        }
        let variant = if dropout { "rank=2 dropout" } else { "rank=2" };
        out.push(def(
            TemplateKind::EmbedPe,
            variant.to_string(),
            t,
            vec![table, ids, pe, scale],
            attrs,
            vec![y],
        ));
    }
}

/// sum_rows: the sum over every leading axis, as autodiff writes the gradient of a
/// broadcast bias (one `sum` per axis, then a reshape to the bias' shape).
fn sum_rows(out: &mut Vec<TemplateDef>) {
    for rank in 2..=4 {
        let mut t = TB::new("sum_rows");
        let mut dims = lead_dims(rank - 1);
        dims.push("n".into());
        let x = t.input("x", DType::F32, &strs(&dims));
        let mut y = x;
        for axis in 0..rank - 1 {
            y = t.reduce(ReduceOp::Sum, y, axis);
        }
        let y = t.op(
            Op::Reshape {
                shape: sym_shape(&["n"]),
            },
            &[y],
        );
        out.push(def(
            TemplateKind::SumRows,
            format!("rank={rank}"),
            t,
            vec![x],
            vec![],
            vec![y],
        ));
    }
}

/// scatter_add_into: `base + scatter_add(ids, src)`, as autodiff accumulates the
/// gradient of a table read by several gathers (a tied embedding: the projection's
/// weight gradient, then one scatter per embedding). Its kernels add the rows onto the
/// base (in place where the plan allows, `plan::in_place`) rather than make a
/// vocabulary-sized zero tensor per scatter and sum them afterwards.
fn scatter_add_into(out: &mut Vec<TemplateDef>) {
    for rank in 1..=2 {
        let mut t = TB::new("scatter_add_into");
        let lead = lead_dims(rank);
        let mut src_dims = lead.clone();
        src_dims.push("d".into());
        let base = t.input("base", DType::F32, &["v", "d"]);
        let ids = t.input("ids", DType::I32, &strs(&lead));
        let src = t.input("src", DType::F32, &strs(&src_dims));
        let s = t.op(
            Op::ScatterAdd {
                rows: Dim::sym("v"),
            },
            &[ids, src],
        );
        let y = t.bin(BinaryOp::Add, base, s);
        out.push(def(
            TemplateKind::ScatterAddInto,
            format!("rank={rank}"),
            t,
            vec![base, ids, src],
            vec![],
            vec![y],
        ));
    }
}

/// adam_update: the whole optimizer step of one parameter (crate::adam's nodes).
fn adam_update(out: &mut Vec<TemplateDef>) {
    for rank in 0..=2 {
        let mut t = TB::new("adam_update");
        let dims = lead_dims(rank);
        let p = t.input("p", DType::F32, &strs(&dims));
        let g = t.input("g", DType::F32, &strs(&dims));
        let m = t.input("m", DType::F32, &strs(&dims));
        let v = t.input("v", DType::F32, &strs(&dims));
        let mut scalar = |name: &str| t.input(name, DType::F32, &[]);
        let k = crate::adam::Consts {
            b1: scalar("b1"),
            b2: scalar("b2"),
            c1: scalar("c1"),
            c2: scalar("c2"),
            eps: scalar("eps"),
            step_size: scalar("step_size"),
            inv_sqrt_bc2: scalar("inv_sqrt_bc2"),
        };
        let shape = t.shape(p);
        let (p2, m2, v2) = crate::adam::update(&mut t.g, &k, p, g, m, v, &shape, "p")
            .expect("the Adam template is well typed");
        let inputs = vec![
            p,
            g,
            m,
            v,
            k.b1,
            k.b2,
            k.c1,
            k.c2,
            k.eps,
            k.step_size,
            k.inv_sqrt_bc2,
        ];
        out.push(def(
            TemplateKind::AdamUpdate,
            format!("rank={rank}"),
            t,
            inputs,
            vec![],
            vec![p2, m2, v2],
        ));
    }
}
