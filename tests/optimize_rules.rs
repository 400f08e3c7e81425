//! One test per optimizer rule, on minimal graphs: what it should fuse, and what it must
//! leave alone.
//!
//! Template rules are exercised on specs written with the prelude's own layers (the
//! templates' left sides are what the prelude elaborates to, so this is the test that
//! they agree); canonicalization rules on graphs built node by node. Every optimized
//! program is also validated against its source graph (reference executor, random
//! inputs, `max|opt − ref| ≤ 1e-4·max|ref| + 1e-6`).

use std::collections::BTreeMap;

use kiln_compiler::ir::{BinaryOp, DType, Graph, Op, TensorType, UnaryOp};
use kiln_compiler::optimize::kernels::{Def, KernelGraph};
use kiln_compiler::optimize::validate::{validate, DEFAULT_ABS, DEFAULT_REL};
use kiln_compiler::optimize::{optimize, Options, Report};
use kiln_compiler::shape::{Dim, Shape};
use kiln_dsl::{Mode, Options as DslOptions};

fn run(g: &Graph) -> (KernelGraph, Report) {
    let (kg, report) = optimize(g, &Options::default()).expect("optimizes");
    let v = validate(g, &kg, 7, DEFAULT_REL, DEFAULT_ABS).expect("validation runs");
    assert!(v.ok(), "{}\n{}", v.text(), kg.text());
    (kg, report)
}

fn spec(text: &str, mode: Mode) -> Graph {
    let g = kiln_dsl::compile_str(
        "rule.kiln",
        text,
        &DslOptions {
            mode,
            ..DslOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}", e.render(false)));
    match mode {
        Mode::Train => kiln_compiler::autodiff::train_step(&g).expect("differentiates"),
        _ => g,
    }
}

fn count(kg: &KernelGraph, kind: &str) -> usize {
    kg.counts().get(kind).copied().unwrap_or(0)
}

fn fired(r: &Report, rule: &str) -> usize {
    r.phases
        .iter()
        .map(|p| p.fired.get(rule).copied().unwrap_or(0))
        .sum()
}

fn views(kg: &KernelGraph, name: &str) -> usize {
    kg.values
        .iter()
        .filter(|v| matches!(&v.def, Def::View(op, _) if op.name() == name))
        .count()
}

fn shape(dims: &[&str]) -> Shape {
    Shape(
        dims.iter()
            .map(|d| d.parse::<i64>().map(Dim::c).unwrap_or_else(|_| Dim::sym(d)))
            .collect(),
    )
}

/// A graph over one input `x: f32[dims]`; `body` adds nodes and returns the outputs.
fn graph(
    dims: &[&str],
    body: impl FnOnce(&mut Graph, kiln_compiler::NodeId) -> Vec<kiln_compiler::NodeId>,
) -> Graph {
    let mut g = Graph::new("rule");
    for d in dims {
        if d.parse::<i64>().is_err() {
            g.add_dim(d);
        }
    }
    let x = g
        .add_input("x", TensorType::new(DType::F32, shape(dims)))
        .unwrap();
    for (i, o) in body(&mut g, x).into_iter().enumerate() {
        g.add_output(&format!("y{i}"), o).unwrap();
    }
    g.verify().unwrap();
    g
}

fn konst(g: &mut Graph, v: f64, like: kiln_compiler::NodeId) -> kiln_compiler::NodeId {
    let c = g.add_const(v, DType::F32);
    let s = g.ty(like).shape.clone();
    g.add(Op::Broadcast { shape: s }, &[c], "").unwrap()
}

// ---- canonicalization -------------------------------------------------------------------

#[test]
fn permute_of_permute_collapses() {
    // Inverse permutations vanish.
    let g = graph(&["a", "b", "4"], |g, x| {
        let p = g
            .add(
                Op::Permute {
                    perm: vec![1, 0, 2],
                },
                &[x],
                "",
            )
            .unwrap();
        let q = g
            .add(
                Op::Permute {
                    perm: vec![1, 0, 2],
                },
                &[p],
                "",
            )
            .unwrap();
        vec![g.add(Op::Unary(UnaryOp::Exp), &[q], "").unwrap()]
    });
    let (kg, r) = run(&g);
    assert_eq!(fired(&r, "permute-permute"), 1);
    assert_eq!(views(&kg, "permute"), 0, "{}", kg.text());
    // Two that do not cancel become one.
    let g = graph(&["a", "b", "4"], |g, x| {
        let p = g
            .add(
                Op::Permute {
                    perm: vec![1, 0, 2],
                },
                &[x],
                "",
            )
            .unwrap();
        let q = g
            .add(
                Op::Permute {
                    perm: vec![0, 2, 1],
                },
                &[p],
                "",
            )
            .unwrap();
        vec![g.add(Op::Unary(UnaryOp::Exp), &[q], "").unwrap()]
    });
    let (kg, _) = run(&g);
    assert_eq!(views(&kg, "permute"), 1, "{}", kg.text());
    assert!(kg.text().contains("perm=[1, 2, 0]"), "{}", kg.text());
}

#[test]
fn reshape_of_reshape_collapses_and_noop_views_vanish() {
    let g = graph(&["2", "3", "4"], |g, x| {
        let a = g
            .add(
                Op::Reshape {
                    shape: shape(&["6", "4"]),
                },
                &[x],
                "",
            )
            .unwrap();
        let b = g
            .add(
                Op::Reshape {
                    shape: shape(&["2", "3", "4"]),
                },
                &[a],
                "",
            )
            .unwrap();
        vec![g.add(Op::Unary(UnaryOp::Exp), &[b], "").unwrap()]
    });
    let (kg, r) = run(&g);
    assert_eq!(fired(&r, "reshape-reshape"), 1);
    assert_eq!(views(&kg, "reshape"), 0, "{}", kg.text());
    // A reshape that changes the shape stays.
    let g = graph(&["2", "3", "4"], |g, x| {
        let a = g
            .add(
                Op::Reshape {
                    shape: shape(&["6", "4"]),
                },
                &[x],
                "",
            )
            .unwrap();
        vec![g.add(Op::Unary(UnaryOp::Exp), &[a], "").unwrap()]
    });
    let (kg, r) = run(&g);
    assert_eq!(fired(&r, "reshape-noop"), 0);
    assert_eq!(views(&kg, "reshape"), 1);
}

#[test]
fn identities_are_removed_but_real_constants_stay() {
    let g = graph(&["n"], |g, x| {
        let one = konst(g, 1.0, x);
        let zero = konst(g, 0.0, x);
        let a = g.add(Op::Binary(BinaryOp::Mul), &[x, one], "").unwrap();
        let b = g.add(Op::Binary(BinaryOp::Add), &[a, zero], "").unwrap();
        let n1 = g.add(Op::Unary(UnaryOp::Neg), &[b], "").unwrap();
        let n2 = g.add(Op::Unary(UnaryOp::Neg), &[n1], "").unwrap();
        vec![n2]
    });
    let (kg, r) = run(&g);
    assert_eq!(fired(&r, "mul-one"), 1);
    assert_eq!(fired(&r, "add-zero"), 1);
    assert_eq!(fired(&r, "neg-neg"), 1);
    // The output is the input itself: no kernel at all.
    assert_eq!(kg.kernels().len(), 0, "{}", kg.text());

    let g = graph(&["n"], |g, x| {
        let two = konst(g, 2.0, x);
        vec![g.add(Op::Binary(BinaryOp::Mul), &[x, two], "").unwrap()]
    });
    let (kg, r) = run(&g);
    assert_eq!(fired(&r, "mul-one"), 0);
    assert_eq!(count(&kg, "region"), 1);
}

#[test]
fn constant_scales_fold_and_move_onto_matmul_results() {
    let g = graph(&["m", "8"], |g, x| {
        let two = konst(g, 2.0, x);
        let three = konst(g, 3.0, x);
        let a = g.add(Op::Binary(BinaryOp::Mul), &[x, two], "").unwrap();
        vec![g.add(Op::Binary(BinaryOp::Mul), &[a, three], "").unwrap()]
    });
    let (_, r) = run(&g);
    assert_eq!(fired(&r, "scale-fold"), 1);

    let g = graph(&["m", "8"], |g, x| {
        let w = g
            .add_input("w", TensorType::new(DType::F32, shape(&["8", "5"])))
            .unwrap();
        let half = konst(g, 0.5, x);
        let a = g.add(Op::Binary(BinaryOp::Mul), &[x, half], "").unwrap();
        vec![g.add(Op::MatMul, &[a, w], "").unwrap()]
    });
    let (_, r) = run(&g);
    assert_eq!(fired(&r, "scale-out-of-matmul-lhs"), 1);

    // A scale that is not a constant does not move.
    let g = graph(&["m", "8"], |g, x| {
        let y = g
            .add_input("y", TensorType::new(DType::F32, shape(&["m", "8"])))
            .unwrap();
        let w = g
            .add_input("w", TensorType::new(DType::F32, shape(&["8", "5"])))
            .unwrap();
        let a = g.add(Op::Binary(BinaryOp::Mul), &[x, y], "").unwrap();
        vec![g.add(Op::MatMul, &[a, w], "").unwrap()]
    });
    let (_, r) = run(&g);
    assert_eq!(fired(&r, "scale-out-of-matmul-lhs"), 0);
    assert_eq!(fired(&r, "scale-fold"), 0);
}

// ---- templates ---------------------------------------------------------------------------

const LIN: &str = "model m() {\n  dims b, t\n  input x: f32[b, t, 8]\n  lin = linear(d_in = 8, d_out = 4)\n  output y = BODY\n}\n";

#[test]
fn linear_fuses_matmul_and_bias_and_relu() {
    let (kg, r) = run(&spec(&LIN.replace("BODY", "lin(x)"), Mode::Eval));
    assert_eq!(fired(&r, "linear[rank=3]"), 1);
    assert_eq!(count(&kg, "linear"), 1);
    assert_eq!(kg.kernels().len(), 1, "{}", kg.text());

    let (kg, _) = run(&spec(&LIN.replace("BODY", "relu(lin(x))"), Mode::Eval));
    assert_eq!(count(&kg, "linear_relu"), 1);
    assert_eq!(kg.kernels().len(), 1, "{}", kg.text());
}

#[test]
fn linear_leaves_a_shared_matmul_and_a_scalar_bias_alone() {
    // The matmul's result is used twice: fusing the bias would compute the GEMM twice.
    let text = "layer two()(x: [b, t, 8]) {\n  param w: f32[8, 4] init xavier_uniform\n  \
                param c: f32[4] init zeros\n  y = x @ w\n  (y + c) * exp(y)\n}\n\
                model m() {\n  dims b, t\n  input x: f32[b, t, 8]\n  l = two()\n  output y = l(x)\n}\n";
    let (kg, r) = run(&spec(text, Mode::Eval));
    assert_eq!(fired(&r, "linear[rank=3]"), 1, "the rule matches…");
    assert_eq!(
        count(&kg, "linear"),
        0,
        "…but extraction keeps one GEMM:\n{}",
        kg.text()
    );
    assert_eq!(count(&kg, "matmul"), 1);

    // A bias of shape [1] is not a per-column bias.
    let text = "layer one()(x: [b, t, 8]) {\n  param w: f32[8, 4] init xavier_uniform\n  \
                param c: f32[1] init zeros\n  x @ w + c\n}\n\
                model m() {\n  dims b, t\n  input x: f32[b, t, 8]\n  l = one()\n  output y = l(x)\n}\n";
    let (kg, _) = run(&spec(text, Mode::Eval));
    assert_eq!(count(&kg, "linear"), 0, "{}", kg.text());
}

const SM: &str = "model m() {\n  dims b, t\n  input x: f32[b, t, 6]\n  output y = BODY\n}\n";

#[test]
fn softmax_over_the_last_axis_only() {
    let (kg, _) = run(&spec(&SM.replace("BODY", "softmax(x)"), Mode::Eval));
    assert_eq!(count(&kg, "softmax"), 1);
    assert_eq!(kg.kernels().len(), 1, "{}", kg.text());

    let (kg, r) = run(&spec(
        &SM.replace("BODY", "softmax(x, axis = 1)"),
        Mode::Eval,
    ));
    assert_eq!(fired(&r, "softmax[rank=3]"), 0);
    assert_eq!(count(&kg, "softmax"), 0, "{}", kg.text());
    assert_eq!(count(&kg, "reduce_max"), 1);
}

const ATT: &str =
    "model m() {\n  dims b, s\n  input x: f32[b, s, 16]\n  input keep: bool[b, s]\n  \
                   att = attention(d_model = 16, h = 2)\n  y = att(x, x, key_mask = keep)\n  \
                   output o = y\n  objective loss = sum(y * y)\n}\n";

#[test]
fn attention_forward_and_backward_fuse() {
    let (kg, r) = run(&spec(ATT, Mode::Eval));
    assert_eq!(fired(&r, "attention[mask=key]"), 1);
    assert_eq!(count(&kg, "attention"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "linear"), 4);
    assert_eq!(count(&kg, "scale_mask_softmax"), 0);

    let (kg, r) = run(&spec(ATT, Mode::Train));
    for out in 0..3 {
        assert_eq!(fired(&r, &format!("attention_bwd[mask=key]/{out}")), 1);
    }
    assert_eq!(count(&kg, "attention_bwd"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "attention"), 1);
    assert_eq!(count(&kg, "exp"), 0);
}

#[test]
fn attention_with_a_softmax_over_queries_is_left_alone() {
    let text = "layer odd(d: int)(x: f32[b, s, d]) {\n  param w: f32[d, d] init xavier_uniform\n  \
                q = split_heads(x @ w, h = 2)\n  scores = (q @ transpose(q)) * 0.5\n  \
                merge_heads(softmax(scores, axis = 2) @ q)\n}\n\
                model m() {\n  dims b, s\n  input x: f32[b, s, 16]\n  l = odd(d = 16)\n  output y = l(x)\n}\n";
    let (kg, r) = run(&spec(text, Mode::Eval));
    assert_eq!(fired(&r, "attention[mask=none]"), 0);
    assert_eq!(count(&kg, "attention"), 0, "{}", kg.text());
}

const NORM: &str = "model m() {\n  dims b, t\n  input x: f32[b, t, 16]\n  input z: f32[b, t, 16]\n  \
                    norm = residual_norm(d = 16, p_drop = 0.0)\n  lin = linear(d_in = 16, d_out = 16)\n  \
                    y = norm(lin(x), z)\n  output o = y\n  objective loss = sum(y * y)\n}\n";

#[test]
fn add_layer_norm_forward_and_backward_fuse() {
    let g = spec(NORM, Mode::Eval).prune(&["o".to_string()]).unwrap();
    let (kg, _) = run(&g);
    assert_eq!(count(&kg, "add_layer_norm"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "sum"), 0);

    let (kg, r) = run(&spec(NORM, Mode::Train));
    for out in 0..3 {
        assert_eq!(fired(&r, &format!("add_layer_norm_bwd[rank=3]/{out}")), 1);
    }
    assert_eq!(count(&kg, "add_layer_norm_bwd"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "recip"), 0);
}

#[test]
fn a_norm_whose_mean_and_variance_scale_differently_is_left_alone() {
    let text = "layer odd_norm(d: int)(x: [b, t, d], y: [b, t, d]) {\n  \
                param gamma: f32[d] init ones\n  param beta: f32[d] init zeros\n  s = x + y\n  \
                mean = sum(s, axis = -1) * (1.0 / d)\n  sc = s - mean\n  \
                var = sum(sc * sc, axis = -1) * 0.5\n  sc * recip(sqrt(var + 0.00001)) * gamma + beta\n}\n\
                model m() {\n  dims b, t\n  input x: f32[b, t, 16]\n  input z: f32[b, t, 16]\n  \
                n = odd_norm(d = 16)\n  output y = n(x, z)\n}\n";
    let (kg, r) = run(&spec(text, Mode::Eval));
    assert_eq!(fired(&r, "add_layer_norm[rank=3]"), 0);
    assert_eq!(count(&kg, "add_layer_norm"), 0, "{}", kg.text());
}

const XENT: &str =
    "model m() {\n  dims b, t\n  input x: f32[b, t, 8]\n  input target: i32[b, t]\n  \
                    lin = linear(d_in = 8, d_out = 11)\n  logits = lin(x)\n  output l = logits\n  \
                    objective loss = label_smoothed_xent(logits, target, eps = 0.1, pad = 0)\n}\n";

#[test]
fn label_smoothed_cross_entropy_fuses_with_its_gradient() {
    let mut g = spec(XENT, Mode::Eval);
    g = g.prune(&["loss".to_string()]).unwrap();
    let (kg, _) = run(&g);
    assert_eq!(count(&kg, "xent_ls"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "one_hot"), 0);

    let (kg, r) = run(&spec(XENT, Mode::Train));
    assert_eq!(fired(&r, "xent_ls[rank=3]/0"), 1);
    assert_eq!(fired(&r, "xent_ls[rank=3]/1"), 1);
    assert_eq!(count(&kg, "xent_ls"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "exp"), 0);
    assert!(kg.text().contains("pad=0"), "{}", kg.text());
}

#[test]
fn a_loss_scaled_train_step_fuses_the_seeded_cross_entropy() {
    let g = kiln_dsl::compile_str(
        "rule.kiln",
        XENT,
        &DslOptions {
            mode: Mode::Train,
            ..DslOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}", e.render(false)));
    let options = kiln_compiler::autodiff::TrainStepOptions { loss_scale: true };
    let step = kiln_compiler::autodiff::train_step_with(&g, options).expect("differentiates");
    assert!(step.input(kiln_compiler::autodiff::LOSS_SCALE).is_some());
    let (kg, r) = run(&step);
    assert_eq!(fired(&r, "xent_ls[rank=3 seeded]/1"), 1);
    assert_eq!(count(&kg, "xent_ls"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "exp"), 0);
    assert!(kg.text().contains("seeded"), "{}", kg.text());
    // The same kernels as without the scale: the seed costs no extra launch.
    let (plain, _) = run(&spec(XENT, Mode::Train));
    assert_eq!(
        kg.counts(),
        plain.counts(),
        "{}\n{}",
        kg.text(),
        plain.text()
    );
}

#[test]
fn embedding_and_positions_fuse() {
    let text = "model m() {\n  dims b, t\n  input ids: i32[b, t]\n  emb = embedding(vocab = 20, d = 8)\n  \
                pos = sinusoidal(d = 8)\n  output y = pos(emb(ids))\n}\n";
    let (kg, _) = run(&spec(text, Mode::Eval));
    assert_eq!(count(&kg, "embed_pe"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "gather"), 0);
}

#[test]
fn adam_update_is_one_kernel_per_parameter() {
    let ty = |d: &[i64]| TensorType::new(DType::F32, Shape::consts(d));
    let g = kiln_compiler::adam::adam_update_graph(
        &[("w".to_string(), ty(&[4, 8])), ("b".to_string(), ty(&[8]))],
        0.9,
        0.98,
        1e-9,
    )
    .unwrap();
    let (kg, r) = run(&g);
    assert_eq!(count(&kg, "adam_update"), 2, "{}", kg.text());
    assert_eq!(kg.kernels().len(), 2, "{}", kg.text());
    assert_eq!(fired(&r, "adam_update[rank=2]/0"), 1);
    assert_eq!(fired(&r, "adam_update[rank=1]/0"), 1);
}

// ---- regions -----------------------------------------------------------------------------

#[test]
fn elementwise_chains_become_one_region() {
    let (kg, _) = run(&spec(&SM.replace("BODY", "exp(x) * 2.0 + x"), Mode::Eval));
    assert_eq!(kg.kernels().len(), 1, "{}", kg.text());
    assert!(kg.text().contains("region{"), "{}", kg.text());
}

#[test]
fn regions_do_not_inline_a_shared_value() {
    // e = exp(x) feeds two ops: inlining it into both would compute it twice.
    let g = graph(&["n"], |g, x| {
        let e = g.add(Op::Unary(UnaryOp::Exp), &[x], "").unwrap();
        let a = g.add(Op::Binary(BinaryOp::Mul), &[e, x], "").unwrap();
        let b = g.add(Op::Unary(UnaryOp::Sin), &[e], "").unwrap();
        vec![a, b]
    });
    let (kg, _) = run(&g);
    assert_eq!(count(&kg, "region"), 3, "{}", kg.text());
    let text = kg.text();
    assert_eq!(text.matches("exp(").count(), 1, "{text}");
}

#[test]
fn a_value_read_only_inside_one_region_is_computed_in_it_once() {
    // s = sigmoid(x) read twice, both times by the region of s·(1 − s)·x (a SiLU's
    // gradient has this shape): one kernel, one sigmoid.
    let g = graph(&["n"], |g, x| {
        let s = g.add(Op::Unary(UnaryOp::Sigmoid), &[x], "").unwrap();
        let one = konst(g, 1.0, x);
        let c = g.add(Op::Binary(BinaryOp::Sub), &[one, s], "").unwrap();
        let p = g.add(Op::Binary(BinaryOp::Mul), &[s, c], "").unwrap();
        vec![g.add(Op::Binary(BinaryOp::Mul), &[p, x], "").unwrap()]
    });
    let (kg, _) = run(&g);
    assert_eq!(kg.kernels().len(), 1, "{}", kg.text());
    assert_eq!(kg.text().matches("sigmoid(").count(), 1, "{}", kg.text());
}

#[test]
fn regions_are_depth_capped() {
    let g = graph(&["n"], |g, x| {
        let mut y = x;
        for i in 0..60 {
            let op = if i % 2 == 0 {
                UnaryOp::Sin
            } else {
                UnaryOp::Cos
            };
            y = g.add(Op::Unary(op), &[y], "").unwrap();
        }
        vec![y]
    });
    let (kg, _) = run(&g);
    let regions = count(&kg, "region");
    assert!(
        (3..=6).contains(&regions),
        "{regions} regions:\n{}",
        kg.text()
    );
}

// ---- extraction and the analysis ---------------------------------------------------------

#[test]
fn extraction_pays_for_a_shared_value_once() {
    // A residual-like value used by a matmul and by an add: computed once.
    let g = graph(&["m", "8"], |g, x| {
        let w = g
            .add_input("w", TensorType::new(DType::F32, shape(&["8", "8"])))
            .unwrap();
        let h = g.add(Op::Unary(UnaryOp::Relu), &[x], "").unwrap();
        let p = g.add(Op::MatMul, &[h, w], "").unwrap();
        vec![g.add(Op::Binary(BinaryOp::Add), &[h, p], "").unwrap()]
    });
    let (kg, _) = run(&g);
    assert_eq!(kg.text().matches("relu(").count(), 1, "{}", kg.text());
    assert_eq!(count(&kg, "matmul"), 1);
}

#[test]
fn a_merge_of_disagreeing_types_is_reported_not_a_panic() {
    use kiln_compiler::optimize::analysis::{Types, EG};
    use kiln_compiler::optimize::lang::{add_source, Kind};
    let mut eg = EG::new(Types::default());
    let a = add_source(
        &mut eg,
        Kind::Input,
        "a",
        &TensorType::new(DType::F32, shape(&["2"])),
    );
    let b = add_source(
        &mut eg,
        Kind::Input,
        "b",
        &TensorType::new(DType::F32, shape(&["3"])),
    );
    eg.union(a, b);
    eg.rebuild();
    assert_eq!(eg.analysis.errors.len(), 1, "{:?}", eg.analysis.errors);
    assert!(eg.analysis.errors[0].contains("disagree"));
}

#[test]
fn every_template_is_well_formed() {
    // Each template's graph verifies, its operands are inputs, and its output types
    // follow from its own input types.
    for def in kiln_compiler::optimize::templates::registry() {
        def.graph.verify().unwrap();
        let tys: Vec<TensorType> = def
            .inputs
            .iter()
            .map(|&i| def.graph.ty(i).clone())
            .collect();
        let outs = def.output_types(&tys).unwrap();
        let want: Vec<TensorType> = def
            .outputs
            .iter()
            .map(|&o| def.graph.ty(o).clone())
            .collect();
        assert_eq!(outs, want, "{} {}", def.name, def.variant);
        let names: BTreeMap<_, _> = def
            .inputs
            .iter()
            .map(|&i| (def.graph.source_name(i).unwrap().to_string(), ()))
            .collect();
        assert_eq!(
            names.len(),
            def.inputs.len(),
            "{}: duplicate operand names",
            def.name
        );
    }
}

#[test]
fn bias_gradients_become_one_row_sum() {
    let g = graph(&["a", "b", "6"], |g, x| {
        let s0 = g
            .add(
                Op::Reduce {
                    op: kiln_compiler::ir::ReduceOp::Sum,
                    axis: 0,
                },
                &[x],
                "",
            )
            .unwrap();
        let s1 = g
            .add(
                Op::Reduce {
                    op: kiln_compiler::ir::ReduceOp::Sum,
                    axis: 1,
                },
                &[s0],
                "",
            )
            .unwrap();
        vec![g
            .add(
                Op::Reshape {
                    shape: shape(&["6"]),
                },
                &[s1],
                "",
            )
            .unwrap()]
    });
    let (kg, _) = run(&g);
    assert_eq!(count(&kg, "sum_rows"), 1, "{}", kg.text());
    assert_eq!(kg.kernels().len(), 1);
    // Summed in the other order, it is left as it is.
    let g = graph(&["a", "b", "6"], |g, x| {
        let s1 = g
            .add(
                Op::Reduce {
                    op: kiln_compiler::ir::ReduceOp::Sum,
                    axis: 1,
                },
                &[x],
                "",
            )
            .unwrap();
        let s0 = g
            .add(
                Op::Reduce {
                    op: kiln_compiler::ir::ReduceOp::Sum,
                    axis: 0,
                },
                &[s1],
                "",
            )
            .unwrap();
        vec![g
            .add(
                Op::Reshape {
                    shape: shape(&["6"]),
                },
                &[s0],
                "",
            )
            .unwrap()]
    });
    let (kg, _) = run(&g);
    assert_eq!(count(&kg, "sum_rows"), 0, "{}", kg.text());
    assert_eq!(count(&kg, "sum"), 2);
}

#[test]
fn noop_views_and_view_chains_are_simplified() {
    // permute-identity, reshape-noop, broadcast-noop: views that change nothing.
    let g = graph(&["a", "4"], |g, x| {
        let p = g.add(Op::Permute { perm: vec![0, 1] }, &[x], "").unwrap();
        let r = g
            .add(
                Op::Reshape {
                    shape: shape(&["a", "4"]),
                },
                &[p],
                "",
            )
            .unwrap();
        let b = g
            .add(
                Op::Broadcast {
                    shape: shape(&["a", "4"]),
                },
                &[r],
                "",
            )
            .unwrap();
        vec![g.add(Op::Unary(UnaryOp::Exp), &[b], "").unwrap()]
    });
    let (kg, r) = run(&g);
    assert_eq!(fired(&r, "permute-identity"), 1);
    assert_eq!(fired(&r, "reshape-noop"), 1);
    assert_eq!(fired(&r, "broadcast-noop"), 1);
    assert_eq!(
        views(&kg, "permute") + views(&kg, "reshape") + views(&kg, "broadcast"),
        0,
        "{}",
        kg.text()
    );
    // broadcast-broadcast: [4] -> [3, 4] -> [2, 3, 4] is one broadcast.
    let g = graph(&["4"], |g, x| {
        let a = g
            .add(
                Op::Broadcast {
                    shape: shape(&["3", "4"]),
                },
                &[x],
                "",
            )
            .unwrap();
        let b = g
            .add(
                Op::Broadcast {
                    shape: shape(&["2", "3", "4"]),
                },
                &[a],
                "",
            )
            .unwrap();
        let y = g
            .add_input("y", TensorType::new(DType::F32, shape(&["2", "3", "4"])))
            .unwrap();
        vec![g.add(Op::Binary(BinaryOp::Add), &[y, b], "").unwrap()]
    });
    let (kg, r) = run(&g);
    assert_eq!(fired(&r, "broadcast-broadcast"), 1);
    assert!(views(&kg, "broadcast") <= 1, "{}", kg.text());
}

#[test]
fn zero_on_the_left_and_scales_on_the_right_operand() {
    let g = graph(&["n"], |g, x| {
        let zero = konst(g, 0.0, x);
        vec![g.add(Op::Binary(BinaryOp::Add), &[zero, x], "").unwrap()]
    });
    let (kg, r) = run(&g);
    assert_eq!(fired(&r, "zero-add"), 1);
    assert_eq!(kg.kernels().len(), 0, "{}", kg.text());

    let g = graph(&["m", "8"], |g, x| {
        let w = g
            .add_input("w", TensorType::new(DType::F32, shape(&["8", "5"])))
            .unwrap();
        let half = konst(g, 0.5, w);
        let ws = g.add(Op::Binary(BinaryOp::Mul), &[w, half], "").unwrap();
        vec![g.add(Op::MatMul, &[x, ws], "").unwrap()]
    });
    let (_, r) = run(&g);
    assert_eq!(fired(&r, "scale-out-of-matmul-rhs"), 1);
}

#[test]
fn scale_mask_softmax_when_the_weights_are_dropped_out() {
    // Dropout on the attention weights (p_attn > 0) sits between the softmax and the
    // product with v: no `attention` kernel, but the scale-mask-softmax rule matches.
    let text = "model m() {\n  dims b, s\n  input x: f32[b, s, 16]\n  input keep: bool[b, s]\n  \
                att = attention(d_model = 16, h = 2, p_attn = 0.2)\n  y = att(x, x, key_mask = keep)\n  \
                output o = y\n  objective loss = sum(y * y)\n}\n";
    let (kg, r) = run(&spec(text, Mode::Train));
    assert_eq!(fired(&r, "attention[mask=key]"), 0);
    assert_eq!(fired(&r, "scale_mask_softmax[mask=key]"), 1);
    assert_eq!(count(&kg, "attention"), 0, "{}", kg.text());
    // The softmax backward reads the masked scores, so extraction keeps them and fuses
    // only the softmax itself.
    assert_eq!(count(&kg, "softmax"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "exp"), 0, "{}", kg.text());
}

#[test]
fn causal_attention_fuses_in_training_and_in_a_decoding_step() {
    let text = "model m() {\n  dims b, t\n  input x: f32[b, t, 16]\n  \
                att = attention(d_model = 16, h = 4, causal = true)\n  y = att(x, x)\n  \
                output o = y\n  objective loss = sum(y * y)\n}\n";
    let (kg, _) = run(&spec(text, Mode::Train));
    assert_eq!(count(&kg, "attention"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "attention_bwd"), 1, "{}", kg.text());
    assert!(kg.text().contains("attention[mask=causal"), "{}", kg.text());
    // Decoding: the keys and values are the cache plus the new positions.
    let g = spec(text, Mode::Decode);
    let mut outs = g.forward_outputs();
    outs.extend(g.cache_outputs());
    let (kg, _) = run(&g.prune(&outs).unwrap());
    assert_eq!(count(&kg, "attention"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "concat"), 2, "{}", kg.text());
}

#[test]
fn embedding_positions_and_their_dropout_fuse_in_training() {
    let text = "model m() {\n  dims b, t\n  input ids: i32[b, t]\n  emb = embedding(vocab = 20, d = 8)\n  \
                pos = sinusoidal(d = 8)\n  y = dropout(pos(emb(ids)), p = 0.1)\n  output o = y\n  \
                objective loss = sum(y * y)\n}\n";
    let (kg, r) = run(&spec(text, Mode::Train));
    assert_eq!(fired(&r, "embed_pe[rank=2 dropout]"), 1);
    assert_eq!(count(&kg, "embed_pe"), 1, "{}", kg.text());
    assert_eq!(count(&kg, "gather"), 0, "{}", kg.text());
    assert!(kg.text().contains("p=0.1 stream="), "{}", kg.text());
}
