//! The row kernels (`codegen::rows`: softmax, scale-mask-softmax, the softmax backward,
//! add + layer norm and its backward, the label-smoothed cross-entropy), JIT-compiled
//! from their CLIF text, against their templates' definitions expanded into primitives
//! and run by the reference executor, on random inputs (fixed seeds) of odd sizes: row
//! lengths 1, 3, 5, 17, 37 and a 37 003-entry vocabulary, single rows, fully masked
//! rows, several thread splits.
//!
//! Tolerance per output: `max|got − ref| ≤ 1e-5·max|ref| + 1e-6`. The reference runs in
//! `f64` ([`Precision::F64`], the same definition; inputs are f32 values, results rounded
//! to f32): over a 37 003-entry vocabulary the f32 reference's own sequential sums are off
//! by ~5e-4 relative in the cross-entropy gradient, while the kernels, with their
//! vector accumulators, stay within ~1e-7 of the f64 values.

use std::collections::BTreeMap;

use cranelift_codegen::ir::Function;
use kiln_compiler::autodiff::gradients_seeded;
use kiln_compiler::codegen::clif::text;
use kiln_compiler::codegen::jit::{self, JitModule, KernelFn};
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_compiler::ir::{DType, Graph, TensorType};
use kiln_compiler::optimize::lang::Attr;
use kiln_compiler::optimize::templates::LnForm;
use kiln_compiler::optimize::templates::{registry, TemplateDef};
use kiln_compiler::reference::{run, Precision, RunOptions};
use kiln_compiler::rng::uniform01;
use kiln_compiler::shape::Shape;
use kiln_compiler::tensor::Tensor;

fn template(name: &str, variant: &str) -> &'static TemplateDef {
    registry()
        .iter()
        .find(|d| d.name == name && d.variant == variant)
        .unwrap_or_else(|| panic!("no template {name}[{variant}]"))
}

fn randv(stream: u64, n: usize, lo: f64, hi: f64) -> Vec<f32> {
    (0..n)
        .map(|i| (lo + (hi - lo) * uniform01(23, stream, i as u64)) as f32)
        .collect()
}

fn f32t(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::f32(shape.to_vec(), v.to_vec()).unwrap()
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

/// The template's outputs on these operands (bound in the template's operand order, each
/// checked against its `source_name`), through the reference executor.
fn by_definition(def: &TemplateDef, operands: &[(&str, &Tensor)], attrs: &[Attr]) -> Vec<Tensor> {
    assert_eq!(
        def.inputs.len(),
        operands.len(),
        "{}: operand count",
        def.name
    );
    let mut g = Graph::new("def");
    let mut feeds = BTreeMap::new();
    let mut ids = Vec::new();
    for (&tid, (name, t)) in def.inputs.iter().zip(operands) {
        assert_eq!(
            def.graph.source_name(tid),
            Some(*name),
            "{}: operand",
            def.name
        );
        let shape = Shape::consts(&t.shape.iter().map(|&d| d as i64).collect::<Vec<_>>());
        ids.push(g.add_input(name, TensorType::new(dtype(t), shape)).unwrap());
        feeds.insert(name.to_string(), (*t).clone());
    }
    let outs = def.instantiate(&mut g, &ids, attrs, "").unwrap();
    for (i, o) in outs.iter().enumerate() {
        g.add_output(&format!("out{i}"), *o).unwrap();
    }
    reference(&g, &feeds)
}

/// The reference executor in `f64` (see the module documentation), results as `f32`.
fn reference(g: &Graph, feeds: &BTreeMap<String, Tensor>) -> Vec<Tensor> {
    let opts = RunOptions {
        precision: Precision::F64,
        ..RunOptions::default()
    };
    run(g, feeds, &BTreeMap::new(), &opts)
        .unwrap()
        .into_iter()
        .map(|(_, t)| match t.as_f64() {
            Some(v) => Tensor::f32(t.shape.clone(), v.iter().map(|&x| x as f32).collect()).unwrap(),
            None => t,
        })
        .collect()
}

/// `max|got − ref| ≤ 1e-5·max|ref| + 1e-6`.
fn close(what: &str, got: &[f32], want: &Tensor) {
    let w = want.as_f32().unwrap();
    assert_eq!(got.len(), w.len(), "{what}: length");
    let max_ref = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let max_diff = got
        .iter()
        .zip(w)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        max_diff <= 1e-5 * max_ref + 1e-6,
        "{what}: max diff {max_diff:e} against max |ref| {max_ref:e}"
    );
}

/// A kernel JIT-compiled from its text (the module keeps the code mapped).
struct Jit {
    _m: JitModule,
    f: KernelFn,
}

fn jit_of(func: &Function) -> Jit {
    let src = text(func);
    let name = func.name.to_string().trim_start_matches('%').to_string();
    let m = jit::compile(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let f = m.get(&name).expect("the kernel is in the module");
    Jit { _m: m, f }
}

/// An operand's pointer (the kernel only reads through it).
fn p<T>(v: &[T]) -> *mut u8 {
    v.as_ptr() as *mut u8
}

/// A result's pointer.
fn pw<T>(v: &mut [T]) -> *mut u8 {
    v.as_mut_ptr() as *mut u8
}

fn launch(k: &Jit, ptrs: &[*mut u8], dims: &[i64], items: usize, grain: usize) {
    // SAFETY: every test sizes its buffers for the kernel's documented layout.
    unsafe { jit::launch(k.f, ptrs, dims, items, grain) }
}

#[test]
fn softmax_matches_its_definition() {
    let k = jit_of(&rows::softmax("softmax"));
    let def = template("softmax", "rank=2");
    for (s, &(nrows, c)) in [
        (1, 1),
        (4, 3),
        (3, 5),
        (7, 17),
        (9, 37),
        (1, 64),
        (2, 37_003),
    ]
    .iter()
    .enumerate()
    {
        let x = randv(s as u64, nrows * c, -6.0, 6.0);
        let want = by_definition(def, &[("x", &f32t(&[nrows, c], &x))], &[]);
        let mut out = vec![0f32; x.len()];
        let (dims, items) = rows::softmax_dims(nrows, c);
        launch(&k, &[p(&x), pw(&mut out)], &dims, items, 2);
        close(&format!("softmax {nrows}x{c}"), &out, &want[0]);
        // In place.
        let mut y = x.clone();
        let yp = pw(&mut y);
        launch(&k, &[yp, yp], &dims, items, 1);
        assert_eq!(y, out, "softmax {nrows}x{c} in place");
    }
}

fn causal(tq: usize, tk: usize) -> Vec<bool> {
    let mut v = Vec::new();
    for i in 0..tq {
        for j in 0..tk {
            // tq > tk leaves the first rows fully masked.
            v.push(j as i64 <= i as i64 + tk as i64 - tq as i64);
        }
    }
    v
}

fn key_mask(b: usize, tk: usize) -> Vec<bool> {
    // Batch 0 keeps every other key; batch 1 keeps none (fully masked rows); batch 2 all.
    (0..b * tk)
        .map(|i| match i / tk {
            0 => i % 2 == 0,
            1 => false,
            _ => true,
        })
        .collect()
}

fn as_i32(m: &[bool]) -> Vec<i32> {
    m.iter().map(|&b| i32::from(b)).collect()
}

#[test]
fn scale_mask_softmax_matches_its_definition() {
    let (scale, fill) = (0.37f32, -1e9f32);
    let mut stream = 100;
    for mask in [MaskKind::None, MaskKind::Key, MaskKind::Causal] {
        let variant = match mask {
            MaskKind::None => "mask=none",
            MaskKind::Key => "mask=key",
            MaskKind::Causal => "mask=causal",
        };
        let def = template("scale_mask_softmax", variant);
        let k = jit_of(&rows::scale_mask_softmax("sms", mask));
        for (b, h, tq, tk) in [
            (1, 1, 1, 1),
            (2, 3, 5, 17),
            (3, 2, 3, 5),
            (1, 2, 4, 37),
            (3, 1, 6, 3),
        ] {
            stream += 1;
            let n = b * h * tq * tk;
            let x = randv(stream, n, -8.0, 8.0);
            let xt = f32t(&[b, h, tq, tk], &x);
            let (st, ft) = (scalar(scale), scalar(fill));
            let m = match mask {
                MaskKind::None => None,
                MaskKind::Key => Some((vec![b, 1, 1, tk], key_mask(b, tk))),
                MaskKind::Causal => Some((vec![tq, tk], causal(tq, tk))),
            };
            let mt = m
                .as_ref()
                .map(|(sh, v)| Tensor::bool(sh.clone(), v.clone()).unwrap());
            let mut ops: Vec<(&str, &Tensor)> = vec![("x", &xt)];
            if let Some(mt) = &mt {
                ops.push(("mask", mt));
            }
            ops.push(("scale", &st));
            if mt.is_some() {
                ops.push(("fill", &ft));
            }
            let want = by_definition(def, &ops, &[]);
            let mi = m.as_ref().map(|(_, v)| as_i32(v)).unwrap_or_default();
            let (sv, fv) = ([scale], [fill]);
            let what = format!("scale_mask_softmax[{variant}] {b}x{h}x{tq}x{tk}");
            let (dims, items) = rows::scale_mask_softmax_dims(b, h, tq, tk);
            let args = |x: *mut u8, out: *mut u8| -> Vec<*mut u8> {
                match mask {
                    MaskKind::None => vec![x, p(&sv), out],
                    _ => vec![x, p(&mi), p(&sv), p(&fv), out],
                }
            };

            let mut out = vec![0f32; n];
            launch(&k, &args(p(&x), pw(&mut out)), &dims, items, 3);
            close(&what, &out, &want[0]);

            // In place: out = x.
            let mut y = x.clone();
            let yp = pw(&mut y);
            launch(&k, &args(yp, yp), &dims, items, 1);
            assert_eq!(y, out, "{what} in place");

            // One head at a time: shifted pointers, b = h = 1.
            let mut per_head = vec![0f32; n];
            let (hd, hitems) = rows::scale_mask_softmax_dims(1, 1, tq, tk);
            for bh in 0..b * h {
                let off = bh * tq * tk;
                let xh = x[off..].as_ptr() as *mut u8;
                let oh = pw(&mut per_head[off..]);
                let a = match mask {
                    MaskKind::None => vec![xh, p(&sv), oh],
                    MaskKind::Key => {
                        let mh = mi[(bh / h) * tk..].as_ptr() as *mut u8;
                        vec![xh, mh, p(&sv), p(&fv), oh]
                    }
                    MaskKind::Causal => vec![xh, p(&mi), p(&sv), p(&fv), oh],
                };
                launch(&k, &a, &hd, hitems, 1);
            }
            assert_eq!(per_head, out, "{what} per head");
        }
    }
}

#[test]
fn softmax_bwd_matches_the_softmax_gradient() {
    let k = jit_of(&rows::softmax_bwd("softmax_bwd"));
    let def = template("softmax", "rank=2");
    for (s, &(nrows, c)) in [(1, 1), (4, 3), (3, 5), (7, 17), (5, 37), (1, 3001)]
        .iter()
        .enumerate()
    {
        // p = softmax(x), dx = the gradient of softmax for upstream gradient g.
        let mut g = Graph::new("softmax_grad");
        let shape = Shape::consts(&[nrows as i64, c as i64]);
        let xi = g
            .add_input("x", TensorType::new(DType::F32, shape.clone()))
            .unwrap();
        let gi = g
            .add_input("g", TensorType::new(DType::F32, shape))
            .unwrap();
        let pi = def.instantiate(&mut g, &[xi], &[], "").unwrap()[0];
        let (mut g, grads) = gradients_seeded(&g, pi, Some(gi), &[xi]).unwrap();
        g.add_output("p", pi).unwrap();
        g.add_output("dx", grads[0]).unwrap();
        let x = randv(200 + s as u64, nrows * c, -4.0, 4.0);
        let up = randv(300 + s as u64, nrows * c, -1.0, 1.0);
        let mut feeds = BTreeMap::new();
        feeds.insert("x".to_string(), f32t(&[nrows, c], &x));
        feeds.insert("g".to_string(), f32t(&[nrows, c], &up));
        let res = reference(&g, &feeds);
        let (pt, dx) = (&res[0], &res[1]);
        let pv = pt.as_f32().unwrap().to_vec();
        let (dims, items) = rows::softmax_bwd_dims(nrows, c);
        for mult in [1.0f32, -0.37] {
            let mv = [mult];
            let want = f32t(
                &[nrows, c],
                &dx.as_f32()
                    .unwrap()
                    .iter()
                    .map(|v| v * mult)
                    .collect::<Vec<_>>(),
            );
            let mut ds = vec![0f32; pv.len()];
            launch(&k, &[p(&pv), p(&up), p(&mv), pw(&mut ds)], &dims, items, 2);
            close(&format!("softmax_bwd {nrows}x{c} ·{mult}"), &ds, &want);
            // In place into dP.
            let mut dp = up.clone();
            let dpp = pw(&mut dp);
            launch(&k, &[p(&pv), dpp, p(&mv), dpp], &dims, items, 1);
            assert_eq!(dp, ds, "softmax_bwd {nrows}x{c} in place");
        }
    }
}

#[test]
fn add_layer_norm_matches_its_definition() {
    let k = jit_of(&rows::add_layer_norm("ln", true, false));
    for (s, &(nrows, d)) in [
        (1, 1),
        (4, 3),
        (3, 5),
        (6, 17),
        (5, 37),
        (1, 1024),
        (33, 64),
    ]
    .iter()
    .enumerate()
    {
        let s = s as u64;
        let x = randv(400 + s, nrows * d, -3.0, 5.0);
        let y = randv(500 + s, nrows * d, -1.0, 1.0);
        let gamma = randv(600 + s, d, 0.5, 1.5);
        let beta = randv(700 + s, d, -0.5, 0.5);
        let (inv_d, eps) = (1.0 / d as f32, 1e-5f32);
        let (it, et) = (scalar(inv_d), scalar(eps));
        let (xt, yt) = (f32t(&[nrows, d], &x), f32t(&[nrows, d], &y));
        let (gt, bt) = (f32t(&[d], &gamma), f32t(&[d], &beta));
        let want = by_definition(
            template("add_layer_norm", "rank=2"),
            &[
                ("x", &xt),
                ("y", &yt),
                ("gamma", &gt),
                ("beta", &bt),
                ("inv_d", &it),
                ("eps", &et),
            ],
            &[],
        );
        let (iv, ev) = ([inv_d], [eps]);
        let (dims, items) = rows::add_layer_norm_dims(nrows, d);
        let args = |x: *mut u8, y: *mut u8, out: *mut u8| {
            vec![x, y, p(&gamma), p(&beta), p(&iv), p(&ev), out]
        };
        let mut out = vec![0f32; x.len()];
        launch(&k, &args(p(&x), p(&y), pw(&mut out)), &dims, items, 2);
        close(&format!("add_layer_norm {nrows}x{d}"), &out, &want[0]);
        // In place into x, and into y.
        let mut x2 = x.clone();
        let xp = pw(&mut x2);
        launch(&k, &args(xp, p(&y), xp), &dims, items, 1);
        assert_eq!(x2, out, "add_layer_norm {nrows}x{d} into x");
        let mut y2 = y.clone();
        let yp = pw(&mut y2);
        launch(&k, &args(p(&x), yp, yp), &dims, items, 1);
        assert_eq!(y2, out, "add_layer_norm {nrows}x{d} into y");
    }
}

#[test]
fn add_layer_norm_bwd_matches_its_definition_and_is_split_independent() {
    let k = jit_of(&rows::add_layer_norm_bwd("ln_bwd", LnForm::Add, false));
    let fin = jit_of(&rows::add_layer_norm_bwd_finish("ln_bwd_finish"));
    for (s, &(nrows, d, c_scale)) in [
        (1, 1, 1.0f32),
        (4, 3, 1.0),
        (16, 5, 1.0),
        (17, 17, 1.0),
        (40, 37, 1.0),
        (3, 64, 0.9),
        (50, 5, 1.1),
    ]
    .iter()
    .enumerate()
    {
        let s = s as u64;
        let x = randv(800 + s, nrows * d, -3.0, 5.0);
        let y = randv(900 + s, nrows * d, -1.0, 1.0);
        let gamma = randv(1000 + s, d, 0.5, 1.5);
        let up = randv(1100 + s, nrows * d, -1.0, 1.0);
        let (inv_d, eps) = (c_scale / d as f32, 1e-5f32);
        let (it, et) = (scalar(inv_d), scalar(eps));
        let (xt, yt, ut) = (
            f32t(&[nrows, d], &x),
            f32t(&[nrows, d], &y),
            f32t(&[nrows, d], &up),
        );
        let gt = f32t(&[d], &gamma);
        let want = by_definition(
            template("add_layer_norm_bwd", "rank=2"),
            &[
                ("x", &xt),
                ("y", &yt),
                ("gamma", &gt),
                ("g", &ut),
                ("inv_d", &it),
                ("eps", &et),
            ],
            &[],
        );
        let what = format!("add_layer_norm_bwd {nrows}x{d} c={c_scale}/d");
        let (iv, ev) = ([inv_d], [eps]);
        let (dims, items) = rows::add_layer_norm_bwd_dims(nrows, d);
        let (fdims, fitems) = rows::add_layer_norm_bwd_finish_dims(nrows, d);
        let mut first: Option<(Vec<f32>, Vec<f32>, Vec<f32>)> = None;
        for grain in [1, 2, 1000] {
            let mut dx = vec![0f32; x.len()];
            let mut scratch = vec![f32::NAN; rows::add_layer_norm_bwd_scratch(nrows, d)];
            let (mut dg, mut db) = (vec![0f32; d], vec![0f32; d]);
            launch(
                &k,
                &[
                    p(&x),
                    p(&y),
                    p(&gamma),
                    p(&up),
                    p(&iv),
                    p(&ev),
                    pw(&mut dx),
                    pw(&mut scratch),
                ],
                &dims,
                items,
                grain,
            );
            launch(
                &fin,
                &[p(&scratch), pw(&mut dg), pw(&mut db)],
                &fdims,
                fitems,
                grain,
            );
            close(&format!("{what}: dx"), &dx, &want[0]);
            close(&format!("{what}: dgamma"), &dg, &want[1]);
            close(&format!("{what}: dbeta"), &db, &want[2]);
            match &first {
                None => first = Some((dx, dg, db)),
                Some(f) => assert!(
                    f.0 == dx && f.1 == dg && f.2 == db,
                    "{what}: results depend on the split (grain {grain})"
                ),
            }
        }
        // dx in place into g.
        let (dx, _, _) = first.unwrap();
        let mut g2 = up.clone();
        let gp = pw(&mut g2);
        let mut scratch = vec![0f32; rows::add_layer_norm_bwd_scratch(nrows, d)];
        launch(
            &k,
            &[
                p(&x),
                p(&y),
                p(&gamma),
                gp,
                p(&iv),
                p(&ev),
                gp,
                pw(&mut scratch),
            ],
            &dims,
            items,
            1,
        );
        assert_eq!(g2, dx, "{what}: dx into g");
    }
}

#[test]
fn xent_ls_matches_its_definition() {
    let k = jit_of(&rows::xent_ls("xent"));
    let loss_only = jit_of(&rows::xent_ls_loss("xent_loss"));
    let def = template("xent_ls", "rank=3");
    let (c_nll, c_smooth) = (0.9f32, 0.1f32);
    for (s, &(b, t, v, pad)) in [
        (2usize, 3usize, 5usize, 0i64),
        (1, 1, 1, -1),
        (1, 4, 17, 3),
        (3, 5, 3, 0),
        (2, 7, 37, 1),
        (1, 3, 37_003, 0),
    ]
    .iter()
    .enumerate()
    {
        let s = s as u64;
        let nrows = b * t;
        let logits = randv(1200 + s, nrows * v, -5.0, 5.0);
        // Targets in [0, v); every third row is the pad id (where it is one).
        let target: Vec<i32> = randv(1300 + s, nrows, 0.0, v as f64)
            .iter()
            .enumerate()
            .map(|(i, &u)| {
                if i % 3 == 1 && pad >= 0 {
                    pad as i32
                } else {
                    (u as i32).min(v as i32 - 1)
                }
            })
            .collect();
        let inv_v = 1.0 / v as f32;
        let lt = f32t(&[b, t, v], &logits);
        let tt = Tensor::i32(vec![b, t], target.clone()).unwrap();
        let (cnt, cst, ivt) = (scalar(c_nll), scalar(c_smooth), scalar(inv_v));
        let want = by_definition(
            def,
            &[
                ("logits", &lt),
                ("target", &tt),
                ("c_nll", &cnt),
                ("c_smooth", &cst),
                ("inv_v", &ivt),
            ],
            &[Attr::Int(pad)],
        );
        let den = target.iter().filter(|&&x| i64::from(x) != pad).count() as f32;
        let what = format!("xent_ls {b}x{t}x{v} pad={pad}");
        let (cn, cs, iv, id) = ([c_nll], [c_smooth], [inv_v], [1.0 / den]);
        let (dims, items) = rows::xent_ls_dims(nrows, v, pad);
        let args = |x: *mut u8, rl: *mut u8, dl: *mut u8| {
            vec![x, p(&target), p(&cn), p(&cs), p(&iv), p(&id), rl, dl]
        };
        let mut row_loss = vec![f32::NAN; nrows];
        let mut dl = vec![f32::NAN; logits.len()];
        launch(
            &k,
            &args(p(&logits), pw(&mut row_loss), pw(&mut dl)),
            &dims,
            items,
            2,
        );
        let loss = rows::xent_ls_finish(&row_loss, den);
        close(&format!("{what}: loss"), &[loss], &want[0]);
        close(&format!("{what}: dlogits"), &dl, &want[1]);
        for (r, &tg) in target.iter().enumerate() {
            if i64::from(tg) == pad {
                assert_eq!(row_loss[r], 0.0, "{what}: pad row {r} has a loss");
            }
        }
        // In place: dlogits = logits.
        let mut x2 = logits.clone();
        let mut rl2 = vec![0f32; nrows];
        let xp = pw(&mut x2);
        launch(&k, &args(xp, pw(&mut rl2), xp), &dims, items, 1);
        assert_eq!(x2, dl, "{what}: dlogits in place");
        assert_eq!(rl2, row_loss, "{what}: row losses in place");
        // Without the gradient (the `loss` entry): the same row losses, bit for bit, and
        // the logits untouched.
        let mut rl3 = vec![f32::NAN; nrows];
        let before = logits.clone();
        launch(
            &loss_only,
            &[p(&logits), p(&target), p(&cn), p(&cs), p(&iv), pw(&mut rl3)],
            &dims,
            items,
            2,
        );
        assert_eq!(
            rl3.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            row_loss.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{what}: the loss-only kernel's row losses"
        );
        assert_eq!(
            logits, before,
            "{what}: the loss-only kernel writes no logits"
        );
    }
}

#[test]
fn xent_ls_finish_sums_in_row_order() {
    let rl = [1.0f32, 1e8, -1e8, 3.0];
    // ((1 + 1e8) − 1e8) + 3 in f32 is 3, not 4: the order is the rows'.
    assert_eq!(rows::xent_ls_finish(&rl, 2.0), 1.5);
    assert!(rows::xent_ls_finish(&[0.0, 0.0], 0.0).is_nan());
}

#[test]
fn kernel_text_is_deterministic() {
    let build = || -> Vec<String> {
        [
            rows::softmax("a"),
            rows::scale_mask_softmax("b", MaskKind::None),
            rows::scale_mask_softmax("c", MaskKind::Key),
            rows::scale_mask_softmax("d", MaskKind::Causal),
            rows::softmax_bwd("e"),
            rows::add_layer_norm("f", true, false),
            rows::add_layer_norm_bwd("g", LnForm::Add, false),
            rows::add_layer_norm_bwd_finish("h"),
            rows::xent_ls("i"),
        ]
        .iter()
        .map(text)
        .collect()
    };
    let (a, b) = (build(), build());
    assert_eq!(a, b);
    for t in &a {
        assert!(!t.contains("call"), "a kernel calls out:\n{t}");
    }
    // All of them in one module, as the artifact stores them.
    let m = jit::compile(&a.join("\n")).unwrap();
    assert_eq!(m.len(), 9);
}
