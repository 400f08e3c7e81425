//! The direct kernel implementations (`optimize::native`: online-softmax attention and
//! its backward, the one-pass layer norm and its backward, the closed-form
//! cross-entropy gradient) against their templates' definitions, expanded into
//! primitives and run by the reference executor, on random inputs of odd sizes (key
//! counts across several online-softmax blocks, a query count that is not a multiple of
//! anything, fully masked rows).
//!
//! Tolerance per output: `max|native − ref| ≤ 1e-5·max|ref| + 1e-6` — one kernel, f32,
//! only the summation order differs.

use std::collections::BTreeMap;

use kiln_compiler::ir::{DType, Graph, TensorType};
use kiln_compiler::optimize::lang::Attr;
use kiln_compiler::optimize::native;
use kiln_compiler::optimize::templates::{registry, TemplateDef};
use kiln_compiler::reference::{run, RunOptions};
use kiln_compiler::rng::uniform01;
use kiln_compiler::shape::Shape;
use kiln_compiler::tensor::Tensor;

fn template(name: &str, variant: &str) -> &'static TemplateDef {
    registry()
        .iter()
        .find(|d| d.name == name && d.variant == variant)
        .unwrap_or_else(|| panic!("no template {name}[{variant}]"))
}

fn rand(stream: u64, shape: &[usize], lo: f64, hi: f64) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape.to_vec(),
        (0..n)
            .map(|i| (lo + (hi - lo) * uniform01(11, stream, i as u64)) as f32)
            .collect(),
    )
    .unwrap()
}

fn scalar(v: f32) -> Tensor {
    Tensor::f32(vec![], vec![v]).unwrap()
}

fn dtype(t: &Tensor) -> DType {
    match t.dtype_name() {
        "bool" => DType::Bool,
        "i32" => DType::I32,
        _ => DType::F32,
    }
}

/// The template's outputs on these operands, through the reference executor.
fn by_definition(def: &TemplateDef, operands: &[&Tensor], attrs: &[Attr]) -> Vec<Tensor> {
    let mut g = Graph::new("def");
    let mut feeds = BTreeMap::new();
    let mut ids = Vec::new();
    for (i, t) in operands.iter().enumerate() {
        let shape = Shape::consts(&t.shape.iter().map(|&d| d as i64).collect::<Vec<_>>());
        let name = format!("in{i}");
        ids.push(
            g.add_input(&name, TensorType::new(dtype(t), shape))
                .unwrap(),
        );
        feeds.insert(name, (*t).clone());
    }
    let outs = def.instantiate(&mut g, &ids, attrs, "").unwrap();
    for (i, o) in outs.iter().enumerate() {
        g.add_output(&format!("out{i}"), *o).unwrap();
    }
    run(&g, &feeds, &BTreeMap::new(), &RunOptions::default())
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect()
}

fn close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    let (g, w) = (got.as_f32().unwrap(), want.as_f32().unwrap());
    let max_ref = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let max_diff = g
        .iter()
        .zip(w)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        max_diff <= 1e-5 * max_ref + 1e-6,
        "{what}: max diff {max_diff:e} against max |ref| {max_ref:e}"
    );
}

fn causal(tq: usize, tk: usize) -> Tensor {
    let mut v = Vec::new();
    for i in 0..tq {
        for j in 0..tk {
            v.push(j <= i + (tk - tq));
        }
    }
    Tensor::bool(vec![tq, tk], v).unwrap()
}

fn key_mask(b: usize, tk: usize) -> Tensor {
    // Row 0 keeps every other key; row 1 keeps none (a fully masked row).
    let v = (0..b * tk).map(|i| i / tk == 0 && i % 2 == 0).collect();
    Tensor::bool(vec![b, 1, 1, tk], v).unwrap()
}

#[test]
fn attention_online_softmax_matches_its_definition() {
    let (b, h, tq, tk, dk, dv) = (2, 3, 5, 37, 4, 6);
    let q = rand(1, &[b, h, tq, dk], -2.0, 2.0);
    let k = rand(2, &[b, h, tk, dk], -2.0, 2.0);
    let v = rand(3, &[b, h, tk, dv], -1.0, 1.0);
    let g = rand(4, &[b, h, tq, dv], -1.0, 1.0);
    let scale = scalar(0.5);
    let fill = scalar(-1e9);
    for (variant, mask) in [
        ("mask=none", None),
        ("mask=key", Some(key_mask(b, tk))),
        ("mask=causal", Some(causal(tq, tk))),
    ] {
        let fwd = template("attention", variant);
        let bwd = template("attention_bwd", variant);
        let mut ops: Vec<&Tensor> = vec![&q, &k, &v];
        ops.extend(mask.as_ref());
        ops.push(&scale);
        if mask.is_some() {
            ops.push(&fill);
        }
        let want = by_definition(fwd, &ops, &[]);
        let got = native::attention(
            &q,
            &k,
            &v,
            mask.as_ref(),
            &scale,
            mask.as_ref().map(|_| &fill),
        )
        .unwrap();
        close(&format!("attention[{variant}]"), &got, &want[0]);

        let mut ops: Vec<&Tensor> = vec![&q, &k, &v];
        ops.extend(mask.as_ref());
        ops.push(&g);
        ops.push(&scale);
        if mask.is_some() {
            ops.push(&fill);
        }
        let want = by_definition(bwd, &ops, &[]);
        let got = native::attention_bwd(
            &q,
            &k,
            &v,
            mask.as_ref(),
            &g,
            &scale,
            mask.as_ref().map(|_| &fill),
        )
        .unwrap();
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            close(
                &format!("attention_bwd[{variant}] {name}"),
                &got[i],
                &want[i],
            );
        }
    }
}

#[test]
fn add_layer_norm_matches_its_definition() {
    let (rows, d) = (7, 13);
    let x = rand(5, &[rows, d], -3.0, 3.0);
    let y = rand(6, &[rows, d], -1.0, 1.0);
    let gamma = rand(7, &[d], 0.5, 1.5);
    let beta = rand(8, &[d], -0.5, 0.5);
    let g = rand(9, &[rows, d], -1.0, 1.0);
    let inv_d = scalar(1.0 / d as f32);
    let eps = scalar(1e-5);
    let want = by_definition(
        template("add_layer_norm", "rank=2"),
        &[&x, &y, &gamma, &beta, &inv_d, &eps],
        &[],
    );
    let got = native::add_layer_norm(&x, &y, &gamma, &beta, &inv_d, &eps).unwrap();
    close("add_layer_norm", &got, &want[0]);
    let want = by_definition(
        template("add_layer_norm_bwd", "rank=2"),
        &[&x, &y, &gamma, &g, &inv_d, &eps],
        &[],
    );
    let got = native::add_layer_norm_bwd(&x, &y, &gamma, &g, &inv_d, &eps).unwrap();
    for (i, name) in ["ds", "dgamma", "dbeta"].iter().enumerate() {
        close(&format!("add_layer_norm_bwd {name}"), &got[i], &want[i]);
    }
    // The backward is exact for any 1/d attribute, not only 1/d itself.
    let odd = scalar(0.1);
    let want = by_definition(
        template("add_layer_norm_bwd", "rank=2"),
        &[&x, &y, &gamma, &g, &odd, &eps],
        &[],
    );
    let got = native::add_layer_norm_bwd(&x, &y, &gamma, &g, &odd, &eps).unwrap();
    close("add_layer_norm_bwd ds (c = 0.1)", &got[0], &want[0]);
}

#[test]
fn label_smoothed_xent_and_its_gradient_match_the_definition() {
    let (b, t, v) = (3, 4, 11);
    let logits = rand(10, &[b, t, v], -4.0, 4.0);
    let ids: Vec<i32> = (0..b * t)
        .map(|i| {
            if i % 5 == 3 {
                0
            } else {
                1 + (i as i32 * 7) % (v as i32 - 1)
            }
        })
        .collect();
    let target = Tensor::i32(vec![b, t], ids).unwrap();
    let (cn, cs, iv) = (scalar(0.9), scalar(0.1), scalar(1.0 / v as f32));
    let want = by_definition(
        template("xent_ls", "rank=3"),
        &[&logits, &target, &cn, &cs, &iv],
        &[Attr::Int(0)],
    );
    let got = native::xent_ls(&logits, &target, &cn, &cs, &iv, None, 0).unwrap();
    close("xent_ls loss", &got[0], &want[0]);
    close("xent_ls dlogits", &got[1], &want[1]);

    // The seeded form (a loss-scaled train_step): the gradient scales, the loss not.
    let seed = scalar(1536.0);
    let want = by_definition(
        template("xent_ls", "rank=3 seeded"),
        &[&logits, &target, &cn, &cs, &iv, &seed],
        &[Attr::Int(0)],
    );
    let got = native::xent_ls(&logits, &target, &cn, &cs, &iv, Some(&seed), 0).unwrap();
    close("seeded xent_ls loss", &got[0], &want[0]);
    close("seeded xent_ls dlogits", &got[1], &want[1]);
    let unseeded = native::xent_ls(&logits, &target, &cn, &cs, &iv, None, 0).unwrap();
    assert_eq!(
        got[0].as_f32(),
        unseeded[0].as_f32(),
        "the loss is not scaled"
    );
    let (a, b) = (got[1].as_f32().unwrap(), unseeded[1].as_f32().unwrap());
    let big = a.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
    assert!(big > 1.0, "the seeded gradient is scaled: max |dx| = {big}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - 1536.0 * y).abs() <= 1e-5 * big, "{x} vs 1536·{y}");
    }
}
