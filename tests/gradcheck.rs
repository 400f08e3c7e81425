//! Gradient check of the tiny Transformer's `train_step` (`models/transformer_tiny.kiln`,
//! elaborated in training mode, so with dropout p = 0.1 and label smoothing).
//!
//! In: the spec, parameters from `init_params`, a small batch of random ids with padded
//! target positions, fixed dropout seed and step. Out: pass/fail —
//! - `train_step` verifies, its outputs are the objective then `grad.<param>` for every
//!   parameter, and its loss equals the loss entry's;
//! - for up to 4 elements of every parameter tensor (first, last and two in between,
//!   picked deterministically), the analytic gradient (f64) matches a central difference
//!   of the loss (f64) within `|analytic − numeric| ≤ 1e-8 + 1e-6·|numeric|`, h = 1e-5;
//! - an f32 run of `train_step` agrees with the f64 run: loss within 1e-5 relative, every
//!   gradient element within 1e-4 of the largest |element| of its tensor, plus 1e-7.
//!
//! # Tolerances
//!
//! The loss is ≈ ln 64 ≈ 4, computed through a few thousand f64 operations, so its
//! rounding error is ≲ 1e-14; divided by 2h = 2e-5 that is ≲ 1e-9 in the numeric
//! derivative. The truncation error of the central difference, ≈ h²·|L'''|/6, is of the
//! same order or below for these smooth O(1) functions. The absolute term 1e-8 is an order
//! of magnitude above that noise (the largest error seen is ≈ 1e-10), and the relative
//! term covers the largest gradients (≈ 0.1); sampled gradient elements range from exact
//! zeros to 0.1, and a wrong rule misses by far more. The dropout masks are the same in
//! every run (fixed seed and step), so the loss is a deterministic, piecewise smooth
//! function; none of the sampled perturbations crosses a relu kink or changes an argmax
//! (it would show as a failure, not as noise).
//!
//! For f32 against f64: f32 rounds at ≈ 6e-8 relative per operation; through ~10 layers of
//! matmuls, softmaxes and norms the loss differs by ≈ 2e-7 relative and the gradients by
//! ≤ 3e-6 of their tensor's scale (seen), so the bounds leave a margin of 30 or more.
//! The key biases `b_k` have a gradient that is exactly zero in exact arithmetic (adding
//! the same amount to every score of a query row does not change its softmax): their
//! computed values are rounding noise (≈ 1e-18 in f64, ≈ 1e-9 in f32), which the absolute
//! term 1e-7 covers.

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use kiln_compiler::autodiff::train_step;
use kiln_compiler::init::init_params;
use kiln_compiler::ir::{Graph, Op};
use kiln_compiler::reference::{run, Precision, RunOptions};
use kiln_compiler::tensor::Tensor;
use kiln_dsl::{Mode, Options};

const H: f64 = 1e-5;

/// The allowed |analytic − numeric| (see the module docs).
fn tol(numeric: f64) -> f64 {
    1e-8 + 1e-6 * numeric.abs()
}

fn train_model() -> Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_tiny.kiln");
    let opts = Options {
        mode: Mode::Train,
        ..Default::default()
    };
    kiln_dsl::compile_file(&path, &opts).expect("the tiny spec compiles")
}

/// Philox draws (`rng::uniform01`) in sequence, for the ids.
struct Rng {
    seed: u64,
    index: u64,
}

impl Rng {
    /// Ids in 3..64 (0 is the pad id; 1 and 2 are left alone too).
    fn ids(&mut self, n: usize) -> Vec<i32> {
        (0..n)
            .map(|_| {
                self.index += 1;
                3 + (kiln_compiler::rng::uniform01(self.seed, 0, self.index) * 61.0) as i32
            })
            .collect()
    }
}

fn feeds() -> BTreeMap<String, Tensor> {
    let mut rng = Rng {
        seed: 2024,
        index: 0,
    };
    let src = rng.ids(10);
    let tgt_in = rng.ids(8);
    let mut tgt_out = rng.ids(8);
    // The second sentence is two tokens shorter: its last two targets are padding.
    tgt_out[6] = 0;
    tgt_out[7] = 0;
    let mut m = BTreeMap::new();
    m.insert("src".into(), Tensor::i32(vec![2, 5], src).unwrap());
    m.insert("tgt_in".into(), Tensor::i32(vec![2, 4], tgt_in).unwrap());
    m.insert("tgt_out".into(), Tensor::i32(vec![2, 4], tgt_out).unwrap());
    m
}

fn opts(precision: Precision) -> RunOptions {
    RunOptions {
        precision,
        seed: 17,
        step: 3,
        ..RunOptions::default()
    }
}

#[test]
fn tiny_transformer_gradients_match_finite_differences() {
    let started = Instant::now();
    let model = train_model();
    assert!(
        model
            .nodes
            .iter()
            .any(|n| matches!(&n.op, Op::Dropout { p, .. } if p.get() == 0.1)),
        "a training graph has dropout"
    );
    let objective = model.objective.clone().expect("the model has an objective");
    let loss_graph = model.prune(std::slice::from_ref(&objective)).unwrap();
    let step = train_step(&model).unwrap();
    step.verify().unwrap();
    eprintln!(
        "loss graph: {} nodes; train_step: {} nodes; {} parameter tensors",
        loss_graph.len(),
        step.len(),
        model.params.len()
    );

    // Outputs: the objective, then a gradient per parameter in model order.
    let names: Vec<String> = step.outputs.iter().map(|o| o.name.clone()).collect();
    let mut want = vec![objective.clone()];
    want.extend(
        model
            .params
            .iter()
            .map(|&p| format!("grad.{}", model.source_name(p).unwrap())),
    );
    assert_eq!(names, want);
    assert_eq!(step.objective.as_ref(), Some(&objective));

    // Parameters in f64, so that a perturbation of 1e-5 is represented exactly enough.
    let params: BTreeMap<String, Tensor> = init_params(&step, 7)
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let v = t.to_f64_vec().unwrap();
            (n, Tensor::f64(t.shape.clone(), v).unwrap())
        })
        .collect();
    let inputs = feeds();

    let out64 = run(&step, &inputs, &params, &opts(Precision::F64)).unwrap();
    let loss64 = out64[0].1.to_f64_vec().unwrap()[0];
    let direct = run(&loss_graph, &inputs, &params, &opts(Precision::F64)).unwrap();
    assert_eq!(direct[0].1.to_f64_vec().unwrap()[0], loss64);
    assert!(loss64.is_finite() && loss64 > 1.0, "loss {loss64}");

    // Central differences for 3 elements of every parameter tensor.
    let loss_at = |params: &BTreeMap<String, Tensor>| -> f64 {
        let out = run(&loss_graph, &inputs, params, &opts(Precision::F64)).unwrap();
        out[0].1.to_f64_vec().unwrap()[0]
    };
    let mut checked = 0;
    let mut worst = 0.0f64;
    for (k, (gname, grad)) in out64[1..].iter().enumerate() {
        let name = gname.strip_prefix("grad.").unwrap();
        let analytic = grad.to_f64_vec().unwrap();
        let Some(base) = params.get(name) else {
            // Not used by the objective: the gradient is zero.
            assert!(analytic.iter().all(|v| *v == 0.0), "{gname}");
            continue;
        };
        assert_eq!(grad.shape, base.shape, "{gname}");
        assert!(analytic.iter().all(|v| v.is_finite()), "{gname}");
        let values = base.to_f64_vec().unwrap();
        let n = values.len();
        let mut picks = vec![0, n - 1, (k * 7919 + 13) % n, (k * 104_729 + n / 2) % n];
        picks.sort_unstable();
        picks.dedup();
        for e in picks {
            let at = |delta: f64| {
                let mut moved = values.clone();
                moved[e] += delta;
                let mut p = params.clone();
                p.insert(
                    name.to_string(),
                    Tensor::f64(base.shape.clone(), moved).unwrap(),
                );
                loss_at(&p)
            };
            let numeric = (at(H) - at(-H)) / (2.0 * H);
            let a = analytic[e];
            let err = (a - numeric).abs();
            worst = worst.max(err / tol(numeric));
            assert!(
                err <= tol(numeric),
                "d loss / d {name}[{e}]: analytic {a:e}, numeric {numeric:e}"
            );
            checked += 1;
        }
    }
    eprintln!(
        "checked {checked} elements; worst error / tolerance = {worst:.3}; {:.1?}",
        started.elapsed()
    );
    assert!(checked >= 3 * loss_graph.params.len());

    // One f32 run agrees with the f64 run.
    let out32 = run(&step, &inputs, &params, &opts(Precision::F32)).unwrap();
    let loss32 = out32[0].1.to_f64_vec().unwrap()[0];
    assert!(
        (loss32 - loss64).abs() <= 1e-5 * loss64.abs(),
        "f32 loss {loss32} vs f64 loss {loss64}"
    );
    for ((name, g32), (_, g64)) in out32[1..].iter().zip(&out64[1..]) {
        let (a, b) = (g32.to_f64_vec().unwrap(), g64.to_f64_vec().unwrap());
        let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-4 * scale + 1e-7,
                "{name}: f32 {x} vs f64 {y} (scale {scale})"
            );
        }
    }
}

/// `train_step` with dynamic loss scaling's seed: every gradient is the scale times the
/// unscaled one — bit for bit for a power of two, in the reference executor and in the
/// compiled one (its fused cross-entropy takes the seed) — and the loss is not scaled.
#[test]
fn a_loss_scaled_train_step_scales_every_gradient_exactly() {
    use kiln_compiler::autodiff::{train_step_with, TrainStepOptions, LOSS_SCALE};
    use kiln_exec::compiled::Compiled;
    let model = train_model();
    let plain = train_step(&model).unwrap();
    let scaled = train_step_with(&model, TrainStepOptions { loss_scale: true }).unwrap();
    assert!(plain.input(LOSS_SCALE).is_none());
    assert!(scaled.input(LOSS_SCALE).is_some());
    let params: BTreeMap<String, Tensor> = init_params(&plain, 7).unwrap().into_iter().collect();
    let inputs = feeds();
    let with_scale = |s: f32| {
        let mut m = feeds();
        m.insert(LOSS_SCALE.into(), Tensor::f32(vec![], vec![s]).unwrap());
        m
    };
    let f32s = |out: &[(String, Tensor)]| -> Vec<(String, Vec<f32>)> {
        out.iter()
            .map(|(n, t)| (n.clone(), t.as_f32().unwrap().to_vec()))
            .collect()
    };
    let check = |what: &str, a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)], s: f32| {
        assert_eq!(a.len(), b.len());
        assert_eq!(a[0].1[0].to_bits(), b[0].1[0].to_bits(), "{what}: the loss");
        let mut nonzero = 0;
        for ((name, x), (_, y)) in a[1..].iter().zip(&b[1..]) {
            for (u, v) in x.iter().zip(y) {
                assert_eq!(
                    (s * u).to_bits(),
                    v.to_bits(),
                    "{what}: {name}: {s}·{u} vs {v}"
                );
                nonzero += usize::from(*u != 0.0);
            }
        }
        assert!(
            nonzero > 1000,
            "{what}: {nonzero} non-zero gradient elements"
        );
    };
    let f = opts(Precision::F32);
    let want = f32s(&run(&plain, &inputs, &params, &f).unwrap());
    for s in [1024.0f32, 2f32.powi(-20)] {
        let got = f32s(&run(&scaled, &with_scale(s), &params, &f).unwrap());
        check(&format!("reference, scale {s}"), &want, &got, s);
    }
    let cp = Compiled::from_graph(plain).unwrap();
    let cs = Compiled::from_graph(scaled).unwrap();
    let want = f32s(&cp.run(&inputs, &params, &f).unwrap());
    let got = f32s(&cs.run(&with_scale(1024.0), &params, &f).unwrap());
    check("compiled, scale 1024", &want, &got, 1024.0);
    // Any other scale: the same within rounding, against the largest gradient (the key
    // biases' gradients are rounding noise around an exact zero, see the module docs).
    let got = f32s(&cs.run(&with_scale(1000.0), &params, &f).unwrap());
    let big = want[1..]
        .iter()
        .flat_map(|(_, x)| x.iter())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    for ((name, x), (_, y)) in want[1..].iter().zip(&got[1..]) {
        for (u, v) in x.iter().zip(y) {
            assert!(
                (1000.0 * u - v).abs() <= 1e-5 * 1000.0 * big,
                "{name}: {u} vs {v}"
            );
        }
    }
}
