//! The eager executor on the tiny Transformer (`models/transformer_tiny.kiln`), against
//! the reference executor.
//!
//! In: the tiny spec elaborated in eval and train mode, parameters from
//! `init_params(seed 7)`, a batch with padded sources and targets. Out: pass/fail —
//!
//! - forward (`logits`) and loss entries agree with the reference within
//!   `|eager - ref| <= 1e-4 * (1 + |ref|)`. Each logit is the end of a chain of ~30
//!   matmuls (k ≤ 64), layer norms and softmaxes, every one of which may round
//!   differently in the last bit (FMA and blocked sums in `gemm`, 16-lane row sums);
//!   measured differences are around 1e-6, so 1e-4 leaves room without hiding a wrong
//!   op (those give O(0.1) differences);
//! - the same in train mode, where dropout masks (pure functions of seed, step, stream
//!   and index) must be the same in both executors, so the outputs still agree;
//! - eager runs are bit-for-bit repeatable;
//! - a missing input and out-of-range ids give the reference's error text.

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;
use std::path::Path;

use kiln_compiler::init::init_params;
use kiln_compiler::reference::{self, RunOptions};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::Graph;
use kiln_dsl::{Mode, Options};
use kiln_exec::Eager;

fn tiny(mode: Mode) -> Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_tiny.kiln");
    let opts = Options {
        mode,
        ..Options::default()
    };
    kiln_dsl::compile_file(&path, &opts).expect("the tiny spec compiles")
}

fn forward(g: &Graph) -> Graph {
    g.prune(&g.forward_outputs()).expect("forward entry")
}

fn loss(g: &Graph) -> Graph {
    g.prune(&[g.objective.clone().expect("an objective")])
        .expect("loss entry")
}

fn params(g: &Graph) -> BTreeMap<String, Tensor> {
    init_params(g, 7).expect("init").into_iter().collect()
}

fn ids(rows: &[&[i32]]) -> Tensor {
    Tensor::i32(vec![rows.len(), rows[0].len()], rows.concat()).unwrap()
}

/// Two sentences; the first source has two pads, the first target one.
fn feeds() -> BTreeMap<String, Tensor> {
    let mut m = BTreeMap::new();
    m.insert(
        "src".to_string(),
        ids(&[&[5, 6, 7, 8, 9, 0, 0], &[10, 11, 12, 13, 14, 15, 16]]),
    );
    m.insert(
        "tgt_in".to_string(),
        ids(&[&[1, 20, 21, 22, 0], &[1, 30, 31, 32, 33]]),
    );
    m.insert(
        "tgt_out".to_string(),
        ids(&[&[20, 21, 22, 2, 0], &[30, 31, 32, 33, 2]]),
    );
    m
}

fn opts() -> RunOptions {
    RunOptions {
        seed: 99,
        step: 3,
        ..RunOptions::default()
    }
}

/// Runs both executors on `g` and checks every output within the stated tolerance.
/// Returns the eager outputs.
fn compare(g: &Graph, p: &BTreeMap<String, Tensor>) -> Vec<(String, Tensor)> {
    let f = feeds();
    let eager = Eager::new(g.clone()).expect("eager plan");
    let e = eager.run(&f, p, &opts()).expect("eager runs");
    let r = reference::run(g, &f, p, &opts()).expect("reference runs");
    assert_eq!(e.len(), r.len());
    for ((ne, te), (nr, tr)) in e.iter().zip(&r) {
        assert_eq!(ne, nr);
        assert_eq!(te.shape, tr.shape, "{ne}");
        let (ev, rv) = (te.as_f32().unwrap(), tr.as_f32().unwrap());
        let mut worst = 0.0f64;
        for (i, (&a, &b)) in ev.iter().zip(rv).enumerate() {
            let d = (f64::from(a) - f64::from(b)).abs();
            worst = worst.max(d / (1.0 + f64::from(b).abs()));
            assert!(
                d <= 1e-4 * (1.0 + f64::from(b).abs()),
                "{ne}[{i}]: eager {a} vs reference {b}"
            );
        }
        eprintln!("{ne}: worst relative difference {worst:.2e}");
    }
    // Repeatable to the bit.
    let again = eager.run(&f, p, &opts()).expect("eager runs again");
    assert_eq!(e, again, "two eager runs differ");
    e
}

#[test]
fn forward_and_loss_match_the_reference() {
    let g = tiny(Mode::default());
    let p = params(&g);
    let fwd = compare(&forward(&g), &p);
    assert_eq!(fwd[0].0, "logits");
    assert_eq!(fwd[0].1.shape, vec![2, 5, 64]);
    let l = compare(&loss(&g), &p);
    assert_eq!(l[0].1.shape, Vec::<usize>::new());
    assert!(l[0].1.as_f32().unwrap()[0].is_finite());
}

#[test]
fn training_mode_with_dropout_matches_the_reference() {
    let g = tiny(Mode::Train);
    assert!(
        g.nodes
            .iter()
            .any(|n| matches!(n.op, kiln_compiler::Op::Dropout { .. })),
        "train mode has dropout"
    );
    let p = params(&g);
    compare(&forward(&g), &p);
    compare(&loss(&g), &p);
    // Another step draws other masks, and still agrees.
    let f = feeds();
    let lg = loss(&g);
    let eager = Eager::new(lg.clone()).unwrap();
    let step4 = RunOptions { step: 4, ..opts() };
    let a = eager.run(&f, &p, &opts()).unwrap();
    let b = eager.run(&f, &p, &step4).unwrap();
    assert_ne!(a, b, "a new step draws new dropout masks");
    let r = reference::run(&lg, &f, &p, &step4).unwrap();
    let (x, y) = (b[0].1.as_f32().unwrap()[0], r[0].1.as_f32().unwrap()[0]);
    assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{x} vs {y}");
}

#[test]
fn errors_are_the_references() {
    let g = forward(&tiny(Mode::default()));
    let p = params(&g);
    let eager = Eager::new(g.clone()).unwrap();

    let mut f = feeds();
    f.remove("tgt_in");
    let e = eager.run(&f, &p, &opts()).unwrap_err().to_string();
    let r = reference::run(&g, &f, &p, &opts()).unwrap_err().to_string();
    assert_eq!(e, r);
    assert!(e.contains("missing input `tgt_in`"), "{e}");

    let mut f = feeds();
    f.insert("src".to_string(), ids(&[&[5, 64, 7], &[1, 2, 3]]));
    let e = eager.run(&f, &p, &opts()).unwrap_err().to_string();
    let r = reference::run(&g, &f, &p, &opts()).unwrap_err().to_string();
    assert_eq!(e, r);
    assert!(e.contains("id 64"), "{e}");

    let mut q = p.clone();
    q.remove("emb.weight");
    let e = eager.run(&feeds(), &q, &opts()).unwrap_err().to_string();
    let r = reference::run(&g, &feeds(), &q, &opts())
        .unwrap_err()
        .to_string();
    assert_eq!(e, r);
}
