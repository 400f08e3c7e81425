//! Every spec shipped in `models/` (found by listing the folder, so a new spec is covered
//! without editing this file) runs on the eager executor with the reference executor's
//! results, for the `forward` entry (eval mode) and the `train_step` entry (train mode,
//! dropout on, objective plus the gradient of every parameter).
//!
//! In: each spec at its own architecture (layers, widths, heads, dropout, label
//! smoothing, positions) with `--set vocab=48` so that the embedding stays small, weights
//! from `init_params(seed 3)`, random token ids (seeded by the file name) for 2
//! sentences of 5 source and 4 target tokens, the second of each padded. Out: pass/fail —
//!
//! Tolerance, per output tensor `r` (reference) and `e` (eager):
//! `max|e - r| <= 1e-3 * max|r| + 1e-6`. Both executors compute in f32 but sum in
//! different orders (blocked FMA sums in `gemm` against plain loops), and the gradients
//! are the ends of chains of ~100 ops: measured worst ratios are 4e-7 to 2.4e-6 for
//! `forward` and 1.7e-6 to 2.6e-5 for `train_step` (tensors whose largest element is
//! below 1e-4 left out of the ratio: those are gradients that are zero in exact
//! arithmetic, like the key bias's, and sit on the 1e-6 floor). A wrong op
//! or a mask applied in one executor and not the other changes a tensor by a sizeable
//! fraction of its largest element, far above the bound.

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;
use std::path::Path;

use kiln_compiler::autodiff;
use kiln_compiler::init::init_params;
use kiln_compiler::reference::{self, RunOptions};
use kiln_compiler::rng::uniform01;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::Graph;
use kiln_dsl::{Mode, Options};
use kiln_exec::Eager;
use rayon::prelude::*;

const VOCAB: i32 = 48;

mod common;
use common::shipped_specs as specs;

fn compile(path: &Path, mode: Mode) -> Graph {
    let opts = Options {
        overrides: vec![format!("vocab={VOCAB}")],
        mode,
        model: None,
    };
    kiln_dsl::compile_file(path, &opts)
        .unwrap_or_else(|e| panic!("{} does not compile: {e:?}", path.display()))
}

/// Token ids in 3..VOCAB (not pad/bos/eos), with the tail of row 1 padded.
fn ids(seed: u64, stream: u64, rows: usize, cols: usize, first: Option<i32>) -> Tensor {
    let mut v = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let id = if let (0, Some(f)) = (c, first) {
                f
            } else if r == 1 && c + 1 == cols {
                0
            } else {
                3 + (uniform01(seed, stream, (r * cols + c) as u64) * f64::from(VOCAB - 3)) as i32
            };
            v.push(id);
        }
    }
    Tensor::i32(vec![rows, cols], v).unwrap()
}

fn feeds(seed: u64) -> BTreeMap<String, Tensor> {
    let mut m = BTreeMap::new();
    m.insert("src".to_string(), ids(seed, 0, 2, 5, None));
    m.insert("tgt_in".to_string(), ids(seed, 1, 2, 4, Some(1)));
    m.insert("tgt_out".to_string(), ids(seed, 2, 2, 4, None));
    m
}

/// Runs both executors and checks every output; returns the worst ratio seen, or what
/// was out of tolerance.
fn compare(
    what: &str,
    g: &Graph,
    p: &BTreeMap<String, Tensor>,
    f: &BTreeMap<String, Tensor>,
) -> Result<f64, String> {
    let opts = RunOptions {
        seed: 11,
        step: 5,
        ..RunOptions::default()
    };
    let inputs: BTreeMap<String, Tensor> = f
        .iter()
        .filter(|(k, _)| {
            g.inputs.iter().any(
                |&i| matches!(&g.nodes[i.index()].op, kiln_compiler::Op::Input { name } if name == *k),
            )
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let e = Eager::new(g.clone())
        .unwrap_or_else(|err| panic!("{what}: eager plan: {err}"))
        .run(&inputs, p, &opts)
        .unwrap_or_else(|err| panic!("{what}: eager: {err}"));
    let r = reference::run(g, &inputs, p, &opts)
        .unwrap_or_else(|err| panic!("{what}: reference: {err}"));
    assert_eq!(e.len(), r.len(), "{what}");
    let mut worst = 0.0f64;
    for ((ne, te), (nr, tr)) in e.iter().zip(&r) {
        assert_eq!(ne, nr, "{what}");
        assert_eq!(te.shape, tr.shape, "{what}: {ne}");
        let (ev, rv) = (te.as_f32().unwrap(), tr.as_f32().unwrap());
        let scale = rv.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
        let diff = ev.iter().zip(rv).fold(0.0f64, |m, (&a, &b)| {
            m.max((f64::from(a) - f64::from(b)).abs())
        });
        assert!(
            ev.iter().all(|x| x.is_finite()),
            "{what}: {ne} is not finite"
        );
        if diff > 1e-3 * scale + 1e-6 {
            return Err(format!(
                "{what}: {ne}: max |eager - reference| = {diff:e} against max |reference| = {scale:e}"
            ));
        }
        // Gradients that are zero in exact arithmetic (the key projection's bias:
        // softmax ignores a shift) are rounding noise of ~1e-9, covered by the 1e-6
        // floor; the ratio is reported for the others.
        if scale >= 1e-4 {
            worst = worst.max(diff / scale);
        }
    }
    Ok(worst)
}

/// A seed from the spec's file name (not its path, which differs between checkouts).
fn seed_of(name: &str, draw: u64) -> u64 {
    name.bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
        .wrapping_add(draw)
}

#[test]
fn eager_equals_reference_on_every_shipped_spec() {
    let all = specs();
    assert!(all.len() >= 22, "expected the paper's specs, found {all:?}");
    // The reference executor is single-threaded: the specs run side by side.
    let failures: Vec<String> = all.par_iter().filter_map(|path| {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let eval = compile(path, Mode::Eval);
        let params: BTreeMap<String, Tensor> = init_params(&eval, 3).unwrap().into_iter().collect();
        let fwd = eval.prune(&eval.forward_outputs()).unwrap();
        let train = compile(path, Mode::Train);
        let step = autodiff::train_step(&train).unwrap();
        let grads = step
            .outputs
            .iter()
            .filter(|o| o.name.starts_with("grad."))
            .count();
        assert_eq!(
            grads,
            train.params.len(),
            "{name}: a gradient per parameter"
        );
        // relu's gradient jumps at 0: when a pre-activation lies within rounding of 0,
        // the executors may take different sides, and every gradient upstream of that
        // unit then differs by ~1e-2 (seen once in ~40 spec/input pairs: one hidden unit
        // of one FFN). A second draw of inputs settles it; a real defect fails both.
        let mut failures = Vec::new();
        let mut result = None;
        for draw in 0..2 {
            let f = feeds(seed_of(&name, draw));
            let r = compare(&format!("{name} forward"), &fwd, &params, &f).and_then(|w_fwd| {
                compare(&format!("{name} train_step"), &step, &params, &f)
                    .map(|w_step| (w_fwd, w_step))
            });
            match r {
                Ok(w) => {
                    result = Some(w);
                    break;
                }
                Err(e) => {
                    eprintln!("draw {draw}: {e}");
                    failures.push(e);
                }
            }
        }
        let Some((w_fwd, w_step)) = result else {
            return Some(format!(
                "{name}: eager and reference differ on both draws:\n{}",
                failures.join("\n")
            ));
        };
        eprintln!(
            "{name}: {} parameters; worst max-diff/max-value forward {w_fwd:.1e}, train_step {w_step:.1e}",
            params.values().map(|t| t.numel()).sum::<usize>()
        );
        None
    }).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
