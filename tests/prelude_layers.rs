//! The prelude's activation layers (#61): `gelu` (exact and tanh), `silu`, `rms_norm` and
//! `swiglu_ffn`, on known inputs, in the reference executor and in generated kernels,
//! against values computed independently (Python's `math.erf`, `math.tanh`, `math.exp`).

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;

use kiln_compiler::reference::{self, RunOptions};
use kiln_compiler::tensor::Tensor;
use kiln_exec::compiled::Compiled;

const SPEC: &str = "model m() {
  dims n
  input x: f32[n, 6]
  output g = gelu(x)
  output gt = gelu(x, approximate = \"tanh\")
  output s = silu(x)
  output r = rms_norm(x)
  output f = swiglu_ffn(x, d_ff = 4)
}";

const X: [f32; 6] = [-2.5, -0.7, 0.0, 0.3, 1.1, 3.0];

fn want() -> [(&'static str, [f64; 6]); 4] {
    [
        (
            "g",
            [
                -0.015524163314440398,
                -0.1693745565561511,
                0.0,
                0.18537342665668577,
                0.9507673329589791,
                2.99595030590511,
            ],
        ),
        (
            "gt",
            [
                -0.015084266089998577,
                -0.16942986529488321,
                0.0,
                0.18537092354275922,
                0.9505810461745109,
                2.996362607918227,
            ],
        ),
        (
            "s",
            [
                -0.18964545005310887,
                -0.2322685594822837,
                0.0,
                0.1723327550434977,
                0.8252861161546294,
                2.8577223804672998,
            ],
        ),
        (
            "r",
            [
                -1.4834768115668446,
                -0.4153735072387165,
                0.0,
                0.17801721738802137,
                0.6527297970894117,
                1.7801721738802136,
            ],
        ),
    ]
}

fn feeds(g: &kiln_compiler::Graph) -> (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>) {
    let inputs = BTreeMap::from([(
        "x".to_string(),
        Tensor::f32(vec![1, 6], X.to_vec()).unwrap(),
    )]);
    let (_, params) = kiln_compiler::optimize::validate::random_feeds(g, 3).unwrap();
    (inputs, params)
}

#[test]
fn activation_layers_give_their_formulas_in_both_executors() {
    let g = kiln_dsl::compile_str("t.kiln", SPEC, &kiln_dsl::Options::default())
        .unwrap_or_else(|e| panic!("{}", e.render(false)));
    // swiglu_ffn: three bias-free matrices, the hidden width d_ff, d_model from x.
    for (p, shape) in [
        ("swiglu_ffn.gate.w", "f32[6, 4]"),
        ("swiglu_ffn.up.w", "f32[6, 4]"),
    ] {
        assert_eq!(g.ty(g.param(p).expect(p)).to_string(), shape);
    }
    assert_eq!(
        g.ty(g.param("swiglu_ffn.down.w").unwrap()).to_string(),
        "f32[4, 6]"
    );
    assert!(g.param("swiglu_ffn.gate.b").is_none());
    let (inputs, params) = feeds(&g);
    let opts = RunOptions::default();
    let reference = reference::run(&g, &inputs, &params, &opts).unwrap();
    let compiled = Compiled::from_graph(g.clone())
        .unwrap()
        .run(&inputs, &params, &opts)
        .unwrap();
    let get = |outs: &[(String, Tensor)], name: &str| -> Vec<f64> {
        outs.iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .to_f64_vec()
            .unwrap()
    };
    for (name, want) in want() {
        for (who, outs) in [("reference", &reference), ("compiled", &compiled)] {
            let got = get(outs, name);
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs() + 1e-7,
                    "{who} {name}[{i}] = {g}, want {w}"
                );
            }
        }
    }
    // swiglu_ffn: (silu(x·gate) ⊙ (x·up))·down from the same parameters, in f64.
    let w = |p: &str| params[p].to_f64_vec().unwrap();
    let (gate, up, down) = (
        w("swiglu_ffn.gate.w"),
        w("swiglu_ffn.up.w"),
        w("swiglu_ffn.down.w"),
    );
    let mut h = [0f64; 4];
    for (j, hj) in h.iter_mut().enumerate() {
        let (mut a, mut b) = (0.0, 0.0);
        for (k, &x) in X.iter().enumerate() {
            a += x as f64 * gate[k * 4 + j];
            b += x as f64 * up[k * 4 + j];
        }
        *hj = a / (1.0 + (-a).exp()) * b;
    }
    let want: Vec<f64> = (0..6)
        .map(|i| (0..4).map(|j| h[j] * down[j * 6 + i]).sum())
        .collect();
    for (who, outs) in [("reference", &reference), ("compiled", &compiled)] {
        for (i, (g, w)) in get(outs, "f").iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs() + 1e-6,
                "{who} f[{i}] = {g}, want {w}"
            );
        }
    }
}

#[test]
fn bad_activation_names_are_errors() {
    for (call, want) in [
        ("gelu(x, approximate = \"fast\")", "gelu's approximate is"),
        (
            "ffn(x, d_ff = 8, activation = \"tanh\")",
            "ffn's activation is",
        ),
    ] {
        let spec = format!("model m() {{\n  dims n\n  input x: f32[n, 6]\n  output y = {call}\n}}");
        let e = match kiln_dsl::compile_str("t.kiln", &spec, &kiln_dsl::Options::default()) {
            Ok(_) => panic!("`{call}` should be an error"),
            Err(e) => e.render(false),
        };
        assert!(e.contains(want), "{e}");
    }
}
