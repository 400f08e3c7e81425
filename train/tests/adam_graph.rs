//! The `adam_update` graph, run by the reference executor, agrees bit for bit with the
//! host optimizer (`Adam::step`) over several updates.

use std::collections::BTreeMap;

use kiln_compiler::adam::adam_update_graph;
use kiln_compiler::reference::{run, RunOptions};
use kiln_compiler::rng::uniform01;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{DType, Shape, TensorType};
use kiln_train::optim::Adam;

/// Deterministic pseudo-random values in (lo, hi).
fn values(stream: u64, n: usize, lo: f64, hi: f64) -> Vec<f32> {
    (0..n)
        .map(|i| (lo + (hi - lo) * uniform01(2024, stream, i as u64)) as f32)
        .collect()
}

/// The range of parameter `k`'s initial values: the second one is about the size of an
/// update, so that a different rounding of the update shows in the parameter.
fn scale(k: usize) -> f64 {
    [1.0, 2e-3][k]
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn adam_graph_matches_adam_step() {
    let (beta1, beta2, eps) = (0.9f64, 0.98f64, 1e-9f64);
    let shapes: [(&str, Vec<usize>); 2] = [("layer.w", vec![3, 5]), ("layer.b", vec![7])];

    let mut params: BTreeMap<String, Tensor> = BTreeMap::new();
    for (k, (name, dims)) in shapes.iter().enumerate() {
        let n = dims.iter().product();
        let data = values(100 + k as u64, n, -scale(k), scale(k));
        params.insert(name.to_string(), Tensor::f32(dims.clone(), data).unwrap());
    }
    // The graph side keeps its own copies of the parameters and moments.
    let mut g_params: BTreeMap<String, Vec<f32>> = params
        .iter()
        .map(|(k, t)| (k.clone(), t.as_f32().unwrap().to_vec()))
        .collect();
    let cfg = kiln_train::config::OptimizerConfig {
        beta1,
        beta2,
        eps,
        ..Default::default()
    };
    let mut adam = Adam::new(&cfg, &params);
    let mut g_m = adam.m.clone();
    let mut g_v = adam.v.clone();

    let signature: Vec<(String, TensorType)> = shapes
        .iter()
        .map(|(name, dims)| {
            let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
            (
                name.to_string(),
                TensorType::new(DType::F32, Shape::consts(&dims)),
            )
        })
        .collect();
    let graph = adam_update_graph(&signature, beta1, beta2, eps).unwrap();
    graph.verify().unwrap();

    for (step, lr) in [1e-3f64, 7e-4, 5e-4].into_iter().enumerate() {
        let mut grads: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        for (k, (name, dims)) in shapes.iter().enumerate() {
            let n = dims.iter().product();
            let stream = 1000 * (step as u64 + 1) + k as u64;
            grads.insert(name.to_string(), values(stream, n, -0.5, 0.5));
        }

        // The scalars, computed exactly as `Adam::step` computes them for update t.
        let t = (adam.t + 1) as i32;
        let step_size = (lr / (1.0 - beta1.powi(t))) as f32;
        let inv_sqrt_bc2 = (1.0 / (1.0 - beta2.powi(t)).sqrt()) as f32;
        let mut inputs: BTreeMap<String, Tensor> = BTreeMap::new();
        inputs.insert("step_size".to_string(), Tensor::scalar_f32(step_size));
        inputs.insert("inv_sqrt_bc2".to_string(), Tensor::scalar_f32(inv_sqrt_bc2));
        for (name, dims) in &shapes {
            let name = name.to_string();
            let tensor = |x: &Vec<f32>| Tensor::f32(dims.clone(), x.clone()).unwrap();
            inputs.insert(name.clone(), tensor(&g_params[&name]));
            inputs.insert(format!("grad.{name}"), tensor(&grads[&name]));
            inputs.insert(format!("m.{name}"), tensor(&g_m[&name]));
            inputs.insert(format!("v.{name}"), tensor(&g_v[&name]));
        }
        let outputs = run(&graph, &inputs, &BTreeMap::new(), &RunOptions::default()).unwrap();
        assert_eq!(outputs.len(), 3 * shapes.len());
        for (out, tensor) in outputs {
            let data = tensor.as_f32().unwrap().to_vec();
            if let Some(name) = out.strip_prefix("m.") {
                g_m.insert(name.to_string(), data);
            } else if let Some(name) = out.strip_prefix("v.") {
                g_v.insert(name.to_string(), data);
            } else {
                g_params.insert(out, data);
            }
        }

        adam.step(&mut params, &grads, lr).unwrap();
        assert_eq!(adam.t, t as u64);

        for (name, _) in &shapes {
            let name = name.to_string();
            let host = params[&name].as_f32().unwrap();
            assert_eq!(
                bits(host),
                bits(&g_params[&name]),
                "step {}: parameter `{name}`: {host:?} vs {:?}",
                t,
                g_params[&name]
            );
            assert_eq!(
                bits(&adam.m[&name]),
                bits(&g_m[&name]),
                "step {t}: m.{name}"
            );
            assert_eq!(
                bits(&adam.v[&name]),
                bits(&g_v[&name]),
                "step {t}: v.{name}"
            );
        }
    }
    // The parameters did move over the three updates.
    for (k, (name, dims)) in shapes.iter().enumerate() {
        let start = values(100 + k as u64, dims.iter().product(), -scale(k), scale(k));
        assert_ne!(bits(&start), bits(&g_params[*name]), "{name}");
    }
}
