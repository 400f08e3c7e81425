//! Invariants of the tiny Transformer (`models/transformer_tiny.kiln`: the base
//! architecture at d_model = 32, 2 layers) run through the reference executor:
//! - every attention softmax row sums to 1, with exact zeros on padded and future keys;
//! - the softmax of the logits sums to 1 (through a derived model with an extra output);
//! - with the causal mask, the decoder output at position i does not change when target
//!   tokens after i change;
//! - padded source positions do not affect the output.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_compiler::init::init_params;
use kiln_compiler::ir::{BinaryOp, Graph, NodeId, Op};
use kiln_compiler::reference::{run, run_nodes, RunOptions};
use kiln_compiler::tensor::Tensor;
use kiln_dsl::Options;

const PAD: i32 = 0;

fn tiny() -> Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_tiny.kiln");
    let g = kiln_dsl::compile_file(&path, &Options::default()).expect("the tiny spec compiles");
    g.prune(&g.forward_outputs()).expect("forward entry")
}

fn params(g: &Graph) -> BTreeMap<String, Tensor> {
    init_params(g, 7).expect("init").into_iter().collect()
}

fn ids(rows: &[&[i32]]) -> Tensor {
    let len = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == len));
    Tensor::i32(vec![rows.len(), len], rows.concat()).unwrap()
}

fn feeds(src: &[&[i32]], tgt_in: &[&[i32]]) -> BTreeMap<String, Tensor> {
    let mut m = BTreeMap::new();
    m.insert("src".to_string(), ids(src));
    m.insert("tgt_in".to_string(), ids(tgt_in));
    m
}

fn logits(
    g: &Graph,
    p: &BTreeMap<String, Tensor>,
    f: &BTreeMap<String, Tensor>,
) -> (Vec<usize>, Vec<f32>) {
    let out = run(g, f, p, &RunOptions::default()).expect("runs");
    let (name, t) = &out[0];
    assert_eq!(name, "logits");
    (t.shape.clone(), t.as_f32().unwrap().to_vec())
}

/// The attention-weight nodes: the division that ends each `softmax` inside an attention.
fn attention_weights(g: &Graph) -> Vec<(NodeId, String)> {
    g.nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.op == Op::Binary(BinaryOp::Div) && n.scope.ends_with("attn.softmax"))
        .map(|(i, n)| (NodeId(i as u32), n.scope.to_string()))
        .collect()
}

#[test]
fn attention_rows_sum_to_one_with_exact_zeros_where_masked() {
    let g = tiny();
    let p = params(&g);
    // Sentence 0 has 2 padded positions; sentence 1 none.
    let src: [&[i32]; 2] = [&[5, 6, 7, PAD, PAD], &[8, 9, 10, 11, 12]];
    let tgt: [&[i32]; 2] = [&[1, 7, 6, 5], &[1, 12, 11, 10]];
    let f = feeds(&src, &tgt);
    let nodes = attention_weights(&g);
    // 2 layers x (encoder self + decoder self + decoder cross).
    assert_eq!(nodes.len(), 6, "{nodes:?}");
    let ids: Vec<NodeId> = nodes.iter().map(|(n, _)| *n).collect();
    let vals = run_nodes(&g, &f, &p, &RunOptions::default(), &ids).unwrap();
    for ((_, scope), t) in nodes.iter().zip(&vals) {
        let [b, h, tq, tk] = t.shape[..] else {
            panic!("attention weights are 4-d: {:?}", t.shape)
        };
        assert_eq!((b, h), (2, 4));
        let w = t.as_f32().unwrap();
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..tq {
                    let row = &w[((bi * h + hi) * tq + i) * tk..][..tk];
                    let s: f64 = row.iter().map(|&x| x as f64).sum();
                    assert!((s - 1.0).abs() < 1e-6, "{scope}: row sums to {s}");
                    assert!(row.iter().all(|&x| x >= 0.0));
                    let keys_are_source =
                        scope.starts_with("encoder") || scope.contains("cross_attn");
                    for (j, &x) in row.iter().enumerate() {
                        if keys_are_source && src[bi][j] == PAD {
                            assert_eq!(x, 0.0, "{scope}: padded key {j} gets weight {x}");
                        }
                        if !keys_are_source && j > i {
                            assert_eq!(x, 0.0, "{scope}: future key {j} seen from {i}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn output_probabilities_sum_to_one() {
    // A derived model adds an output to the tiny transformer without copying it.
    let spec = "import \"models/transformer_tiny.kiln\"\n\
                model probe = transformer_tiny() {\n  output probs = softmax(logits)\n}\n";
    let opts = Options {
        model: Some("probe".to_string()),
        ..Options::default()
    };
    let full = kiln_dsl::compile_str("probe.kiln", spec, &opts).expect("the probe compiles");
    let g = full.prune(&["probs".to_string()]).unwrap();
    let p = params(&g);
    let f = feeds(&[&[5, 6, 7, 8]], &[&[1, 9, 10]]);
    let out = run(&g, &f, &p, &RunOptions::default()).unwrap();
    let t = &out[0].1;
    assert_eq!(t.shape, vec![1, 3, 64]);
    for row in t.as_f32().unwrap().chunks(64) {
        let s: f64 = row.iter().map(|&x| x as f64).sum();
        assert!((s - 1.0).abs() < 1e-5, "row sums to {s}");
    }
}

#[test]
fn decoder_output_at_i_ignores_later_target_tokens() {
    let g = tiny();
    let p = params(&g);
    let src: &[i32] = &[5, 6, 7, 8, 9];
    let base: Vec<i32> = vec![1, 20, 21, 22, 23, 24];
    let (shape, reference) = logits(&g, &p, &feeds(&[src], &[&base]));
    let v = shape[2];
    let t = base.len();
    for i in 0..t - 1 {
        // Change every target token after position i.
        let mut changed = base.clone();
        for (k, tok) in changed.iter_mut().enumerate().skip(i + 1) {
            *tok = 30 + (k as i32 * 7) % 30;
        }
        let (_, out) = logits(&g, &p, &feeds(&[src], &[&changed]));
        for pos in 0..t {
            let a = &reference[pos * v..(pos + 1) * v];
            let b = &out[pos * v..(pos + 1) * v];
            if pos <= i {
                assert_eq!(a, b, "position {pos} changed when tokens after {i} changed");
            } else {
                assert_ne!(a, b, "position {pos} should see its own (changed) input");
            }
        }
    }
}

#[test]
fn padded_source_positions_do_not_affect_the_output() {
    let g = tiny();
    let p = params(&g);
    let short: &[i32] = &[5, 6, 7];
    let long: &[i32] = &[8, 9, 10, 11, 12];
    let tgt: &[i32] = &[1, 13, 14, 15];
    // Alone and unpadded.
    let (_, alone) = logits(&g, &p, &feeds(&[short], &[tgt]));
    // Padded to length 5, and batched with a longer sentence.
    let padded: &[i32] = &[5, 6, 7, PAD, PAD];
    let (_, solo_padded) = logits(&g, &p, &feeds(&[padded], &[tgt]));
    let (shape, batched) = logits(&g, &p, &feeds(&[padded, long], &[tgt, tgt]));
    let per = shape[1] * shape[2];
    assert_eq!(alone, solo_padded, "padding changed the output");
    assert_eq!(
        &alone[..],
        &batched[..per],
        "batching with a longer sentence changed the output"
    );
    // And the longer sentence is unaffected by its shorter neighbour.
    let (_, long_alone) = logits(&g, &p, &feeds(&[long], &[tgt]));
    assert_eq!(&long_alone[..], &batched[per..]);
    // Sanity: the source does matter.
    let (_, other) = logits(&g, &p, &feeds(&[&[5, 6, 9]], &[tgt]));
    assert_ne!(alone, other);
}

#[test]
fn the_loss_at_initialization_is_near_the_uniform_guess() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_tiny.kiln");
    let g = kiln_dsl::compile_file(&path, &Options::default()).unwrap();
    let lg = g.prune(&[g.objective.clone().unwrap()]).unwrap();
    let p = params(&lg);
    let mut f = feeds(
        &[&[5, 6, 7, 8], &[9, 10, 11, PAD]],
        &[&[1, 8, 7, 6, 5], &[1, 11, 10, 9, PAD]],
    );
    f.insert(
        "tgt_out".to_string(),
        ids(&[&[8, 7, 6, 5, 2], &[11, 10, 9, 2, PAD]]),
    );
    let out = run(&lg, &f, &p, &RunOptions::default()).unwrap();
    let loss = out[0].1.as_f32().unwrap()[0] as f64;
    // Logits have unit scale at init (normal(d^-0.5) embeddings, tied), so the loss is
    // about ln(64) + 1/2; anything far from it means a broken graph.
    assert!(
        loss > 64f64.ln() - 0.5 && loss < 64f64.ln() + 1.5,
        "loss {loss}"
    );
}
