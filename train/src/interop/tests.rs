use super::*;
use kiln_compiler::rng::uniform01;

const D: usize = 8;
const F: usize = 12;
const V: usize = 11;

/// A 2-layer kiln transformer's parameters, named by hand, with random values.
fn kiln_params(layers: usize) -> BTreeMap<String, Tensor> {
    let mut shapes: Vec<(String, Vec<usize>)> = vec![("emb.weight".into(), vec![V, D])];
    for side in ["encoder", "decoder"] {
        for i in 0..layers {
            let at = format!("{side}.layers.{i}");
            let attns: &[&str] = if side == "encoder" {
                &["self_attn"]
            } else {
                &["self_attn", "cross_attn"]
            };
            for a in attns {
                for p in ["w_q", "w_k", "w_v", "w_o"] {
                    shapes.push((format!("{at}.{a}.{p}"), vec![D, D]));
                }
                for p in ["b_q", "b_k", "b_v", "b_o"] {
                    shapes.push((format!("{at}.{a}.{p}"), vec![D]));
                }
            }
            let norms: &[&str] = if side == "encoder" {
                &["norm1", "norm2"]
            } else {
                &["norm1", "norm2", "norm3"]
            };
            for nm in norms {
                shapes.push((format!("{at}.{nm}.gamma"), vec![D]));
                shapes.push((format!("{at}.{nm}.beta"), vec![D]));
            }
            shapes.push((format!("{at}.ffn.linear1.w"), vec![D, F]));
            shapes.push((format!("{at}.ffn.linear1.b"), vec![F]));
            shapes.push((format!("{at}.ffn.linear2.w"), vec![F, D]));
            shapes.push((format!("{at}.ffn.linear2.b"), vec![D]));
        }
    }
    shapes
        .into_iter()
        .enumerate()
        .map(|(s, (name, shape))| {
            let n: usize = shape.iter().product();
            let data = (0..n)
                .map(|i| (uniform01(99, s as u64, i as u64) * 4.0 - 2.0) as f32)
                .collect();
            (name, Tensor::f32(shape, data).unwrap())
        })
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn at(t: &Tensor, r: usize, c: usize) -> f32 {
    t.as_f32().unwrap()[r * t.shape[1] + c]
}

#[test]
fn round_trip_is_bit_exact() {
    let kiln = kiln_params(2);
    assert_eq!(kiln.len(), 1 + 2 * 16 + 2 * 26);
    let torch = to_torch(&kiln).unwrap();
    let back = from_torch(&torch).unwrap();
    assert_eq!(
        back.keys().collect::<Vec<_>>(),
        kiln.keys().collect::<Vec<_>>()
    );
    for (name, t) in &kiln {
        assert_eq!(back[name].shape, t.shape, "{name}");
        assert_eq!(bits(&back[name]), bits(t), "{name}");
    }
    // And torch -> kiln -> torch.
    let again = to_torch(&back).unwrap();
    for (name, t) in &torch {
        assert_eq!(bits(&again[name]), bits(t), "{name}");
    }
}

#[test]
fn torch_keys_and_layout() {
    let kiln = kiln_params(2);
    let torch = to_torch(&kiln).unwrap();
    let mut want = vec!["embedding.weight".to_string()];
    for i in 0..2 {
        for k in [
            "self_attn.in_proj_weight",
            "self_attn.in_proj_bias",
            "self_attn.out_proj.weight",
            "self_attn.out_proj.bias",
            "linear1.weight",
            "linear1.bias",
            "linear2.weight",
            "linear2.bias",
            "norm1.weight",
            "norm1.bias",
            "norm2.weight",
            "norm2.bias",
        ] {
            want.push(format!("encoder.layers.{i}.{k}"));
        }
        for k in [
            "self_attn.in_proj_weight",
            "self_attn.in_proj_bias",
            "self_attn.out_proj.weight",
            "self_attn.out_proj.bias",
            "multihead_attn.in_proj_weight",
            "multihead_attn.in_proj_bias",
            "multihead_attn.out_proj.weight",
            "multihead_attn.out_proj.bias",
            "linear1.weight",
            "linear1.bias",
            "linear2.weight",
            "linear2.bias",
            "norm1.weight",
            "norm1.bias",
            "norm2.weight",
            "norm2.bias",
            "norm3.weight",
            "norm3.bias",
        ] {
            want.push(format!("decoder.layers.{i}.{k}"));
        }
    }
    want.sort();
    assert_eq!(torch.keys().cloned().collect::<Vec<_>>(), want);

    // in_proj_weight rows: w_qᵀ, then w_kᵀ, then w_vᵀ.
    let inp = &torch["decoder.layers.1.multihead_attn.in_proj_weight"];
    assert_eq!(inp.shape, vec![3 * D, D]);
    for (k, p) in ["w_q", "w_k", "w_v"].iter().enumerate() {
        let w = &kiln[&format!("decoder.layers.1.cross_attn.{p}")];
        for r in 0..D {
            for c in 0..D {
                assert_eq!(at(inp, k * D + r, c).to_bits(), at(w, c, r).to_bits());
            }
        }
    }
    let bias = torch["encoder.layers.0.self_attn.in_proj_bias"]
        .as_f32()
        .unwrap();
    assert_eq!(
        &bias[D..2 * D],
        kiln["encoder.layers.0.self_attn.b_k"].as_f32().unwrap()
    );
    let l1 = &torch["encoder.layers.1.linear1.weight"];
    assert_eq!(l1.shape, vec![F, D]);
    let w1 = &kiln["encoder.layers.1.ffn.linear1.w"];
    assert_eq!(at(l1, 3, 5), at(w1, 5, 3));
    assert_eq!(
        torch["decoder.layers.0.norm3.weight"],
        kiln["decoder.layers.0.norm3.gamma"]
    );
}

#[test]
fn unknown_and_missing_names_are_listed() {
    let mut kiln = kiln_params(2);
    kiln.remove("decoder.layers.1.norm3.beta");
    kiln.remove("encoder.layers.0.self_attn.w_k");
    let t = kiln["emb.weight"].clone();
    kiln.insert("emb.wieght".to_string(), t);
    let msg = to_torch(&kiln).unwrap_err().to_string();
    assert!(msg.contains("`emb.wieght`"), "{msg}");
    assert!(msg.contains("`decoder.layers.1.norm3.beta`"), "{msg}");
    assert!(msg.contains("`encoder.layers.0.self_attn.w_k`"), "{msg}");

    // A gap in the layers: layer 0 of the decoder missing entirely.
    let kiln: BTreeMap<String, Tensor> = kiln_params(2)
        .into_iter()
        .filter(|(k, _)| !k.starts_with("decoder.layers.0."))
        .collect();
    let InteropError::Names {
        missing, unknown, ..
    } = to_torch(&kiln).unwrap_err()
    else {
        panic!("expected a names error")
    };
    assert!(unknown.is_empty());
    assert_eq!(missing.len(), 26);

    // nn.Transformer's final norms are explained.
    let mut torch = to_torch(&kiln_params(1)).unwrap();
    torch.insert(
        "encoder.norm.weight".to_string(),
        Tensor::f32(vec![D], vec![1.0; D]).unwrap(),
    );
    let msg = from_torch(&torch).unwrap_err().to_string();
    assert!(
        msg.contains("`encoder.norm.weight`") && msg.contains("norm=None"),
        "{msg}"
    );
}

#[test]
fn unexpressible_shapes_are_refused_with_the_reason() {
    // h·d_k = 4 ≠ d_model = 8.
    let mut kiln = kiln_params(1);
    for p in ["w_q", "w_k"] {
        kiln.insert(
            format!("encoder.layers.0.self_attn.{p}"),
            Tensor::f32(vec![D, 4], vec![0.5; D * 4]).unwrap(),
        );
    }
    let msg = to_torch(&kiln).unwrap_err().to_string();
    assert!(
        msg.contains("h·d_k = 4") && msg.contains("d_model = 8"),
        "{msg}"
    );

    // Learned positional tables.
    let mut kiln = kiln_params(1);
    kiln.insert(
        "src_pos.table".to_string(),
        Tensor::f32(vec![16, D], vec![0.0; 16 * D]).unwrap(),
    );
    let msg = to_torch(&kiln).unwrap_err().to_string();
    assert!(
        msg.contains("src_pos.table") && msg.contains("learned_pos = false"),
        "{msg}"
    );

    // Per-layer feed-forward sizes.
    let mut kiln = kiln_params(2);
    kiln.insert(
        "decoder.layers.1.ffn.linear1.w".to_string(),
        Tensor::f32(vec![D, 5], vec![0.0; D * 5]).unwrap(),
    );
    let msg = to_torch(&kiln).unwrap_err().to_string();
    assert!(msg.contains("dim_feedforward"), "{msg}");

    // A plainly wrong shape names the tensor.
    let mut kiln = kiln_params(1);
    kiln.insert(
        "encoder.layers.0.norm2.gamma".to_string(),
        Tensor::f32(vec![3], vec![1.0; 3]).unwrap(),
    );
    let msg = to_torch(&kiln).unwrap_err().to_string();
    assert!(
        msg.contains("`encoder.layers.0.norm2.gamma`") && msg.contains("[8]"),
        "{msg}"
    );

    // A torch in_proj_weight of the wrong size.
    let mut torch = to_torch(&kiln_params(1)).unwrap();
    torch.insert(
        "decoder.layers.0.self_attn.in_proj_weight".to_string(),
        Tensor::f32(vec![12, D], vec![0.0; 12 * D]).unwrap(),
    );
    let msg = from_torch(&torch).unwrap_err().to_string();
    assert!(
        msg.contains("in_proj_weight") && msg.contains("[12, 8]"),
        "{msg}"
    );
}
