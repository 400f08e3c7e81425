//! The optimizer: Adam (Kingma & Ba, 2015), as the paper uses it.
//!
//! In: parameters, their gradients (already averaged over the tokens of an update) and
//! the learning rate of this step. Out: the parameters updated in place, and the moment
//! estimates, which checkpoints save so a resumed run continues exactly:
//!
//! m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
//! p ← p − lr · (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + ε)
//!
//! Every element is updated independently (in parallel over parameters and chunks), so
//! the result does not depend on the number of threads.

use std::collections::BTreeMap;

use rayon::prelude::*;

use kiln_compiler::tensor::{Tensor, TensorData};

use crate::config::OptimizerConfig;

/// Adam's hyper-parameters and state.
pub struct Adam {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay (AdamW): each parameter times `1 − lr · weight_decay`
    /// before the update; 0 leaves the update Adam's, bit for bit.
    pub weight_decay: f64,
    /// Updates taken so far.
    pub t: u64,
    pub m: BTreeMap<String, Vec<f32>>,
    pub v: BTreeMap<String, Vec<f32>>,
}

/// A parameter, gradient or moment that does not fit.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct OptimError(pub String);

const CHUNK: usize = 1 << 14;

impl Adam {
    /// Zero moments for every parameter, with the configuration's β, ε and weight decay.
    pub fn new(cfg: &OptimizerConfig, params: &BTreeMap<String, Tensor>) -> Adam {
        let zeros: BTreeMap<String, Vec<f32>> = params
            .iter()
            .map(|(k, t)| (k.clone(), vec![0.0; t.numel()]))
            .collect();
        Adam {
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
            t: 0,
            m: zeros.clone(),
            v: zeros,
        }
    }

    /// The `f32` constants of update number `t` (counting from 1) with learning rate
    /// `lr`: `[beta1, beta2, 1 − beta1, 1 − beta2, eps, lr / (1 − beta1^t),
    /// 1 / sqrt(1 − beta2^t)]`, computed in `f64` and rounded once. [`Adam::step`] uses
    /// them, and so does the device optimizer (`codegen::cuda::optim`), which therefore
    /// updates with the same bits.
    pub fn constants(&self, t: u64, lr: f64) -> [f32; 7] {
        let t = t.min(i32::MAX as u64) as i32;
        let (b1, b2) = (self.beta1, self.beta2);
        let bc1 = 1.0 - b1.powi(t);
        let bc2 = 1.0 - b2.powi(t);
        [
            b1 as f32,
            b2 as f32,
            (1.0 - b1) as f32,
            (1.0 - b2) as f32,
            self.eps as f32,
            (lr / bc1) as f32,
            (1.0 / bc2.sqrt()) as f32,
        ]
    }

    /// One update with learning rate `lr`.
    pub fn step(
        &mut self,
        params: &mut BTreeMap<String, Tensor>,
        grads: &BTreeMap<String, Vec<f32>>,
        lr: f64,
    ) -> Result<(), OptimError> {
        self.t += 1;
        let [b1f, b2f, c1, c2, eps, step_size, inv_sqrt_bc2] = self.constants(self.t, lr);
        if self.m.len() != params.len()
            || self.v.len() != params.len()
            || !params.keys().zip(self.m.keys()).all(|(a, b)| a == b)
            || !params.keys().zip(self.v.keys()).all(|(a, b)| a == b)
        {
            return Err(OptimError(
                "the optimizer state does not match the parameters (another model?)".to_string(),
            ));
        }
        let mut work = Vec::new();
        for ((name, p), (m, v)) in params
            .iter_mut()
            .zip(self.m.values_mut().zip(self.v.values_mut()))
        {
            let g = grads
                .get(name)
                .ok_or_else(|| OptimError(format!("no gradient for parameter `{name}`")))?;
            let TensorData::F32(pv) = &mut p.data else {
                return Err(OptimError(format!("parameter `{name}` is not f32")));
            };
            if g.len() != pv.len() || m.len() != pv.len() || v.len() != pv.len() {
                return Err(OptimError(format!(
                    "parameter `{name}` has {} elements but its gradient/moments have {}/{}/{}",
                    pv.len(),
                    g.len(),
                    m.len(),
                    v.len()
                )));
            }
            work.push((
                pv.as_mut_slice(),
                g.as_slice(),
                m.as_mut_slice(),
                v.as_mut_slice(),
            ));
        }
        let decay = (self.weight_decay != 0.0).then_some((1.0 - lr * self.weight_decay) as f32);
        work.into_par_iter().for_each(|(p, g, m, v)| {
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
                .for_each(|((p, g), (m, v))| {
                    if let Some(d) = decay {
                        p.iter_mut().for_each(|x| *x *= d);
                    }
                    let k = [b1f, b2f, c1, c2, eps, step_size, inv_sqrt_bc2];
                    update(p, g, m, v, &k)
                });
        });
        Ok(())
    }

    /// The moments as tensors named `m.<param>` and `v.<param>` (for checkpoints).
    pub fn state_tensors(&self, params: &BTreeMap<String, Tensor>) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (name, p) in params {
            for (prefix, store) in [("m", &self.m), ("v", &self.v)] {
                if let Some(x) = store.get(name) {
                    out.push((
                        format!("{prefix}.{name}"),
                        Tensor {
                            shape: p.shape.clone(),
                            data: TensorData::F32(x.clone()),
                        },
                    ));
                }
            }
        }
        out
    }

    /// Restores the moments saved by [`Adam::state_tensors`]; every parameter must have
    /// both, of its size.
    pub fn load_state(
        &mut self,
        t: u64,
        params: &BTreeMap<String, Tensor>,
        state: &BTreeMap<String, Tensor>,
    ) -> Result<(), OptimError> {
        for (name, p) in params {
            for prefix in ["m", "v"] {
                let key = format!("{prefix}.{name}");
                let x = state.get(&key).ok_or_else(|| {
                    OptimError(format!(
                        "the optimizer state lacks `{key}`; it belongs to another model"
                    ))
                })?;
                let data = x
                    .as_f32()
                    .ok_or_else(|| OptimError(format!("`{key}` is not f32")))?;
                if data.len() != p.numel() {
                    return Err(OptimError(format!(
                        "`{key}` has {} elements, the parameter {}",
                        data.len(),
                        p.numel()
                    )));
                }
                let store = if prefix == "m" {
                    &mut self.m
                } else {
                    &mut self.v
                };
                store.insert(name.clone(), data.to_vec());
            }
        }
        self.t = t;
        Ok(())
    }
}

/// Scales every gradient by `max_norm / (norm + 1e-6)` when their global L2 norm exceeds
/// `max_norm` (PyTorch's `clip_grad_norm_`, fairseq's `--clip-norm`); returns the norm
/// before clipping. The norm is summed in f64, each parameter's in order and the
/// parameters in name order, so it does not depend on the number of threads.
pub fn clip_global_norm(grads: &mut BTreeMap<String, Vec<f32>>, max_norm: f64) -> f64 {
    let squares: Vec<f64> = grads
        .par_iter()
        .map(|(_, g)| g.iter().map(|&x| x as f64 * x as f64).sum::<f64>())
        .collect();
    let norm = squares.iter().sum::<f64>().sqrt();
    if norm > max_norm {
        let scale = (max_norm / (norm + 1e-6)) as f32;
        grads.par_iter_mut().for_each(|(_, g)| {
            g.par_chunks_mut(CHUNK)
                .for_each(|c| c.iter_mut().for_each(|x| *x *= scale))
        });
    }
    norm
}

/// One chunk of [`Adam::step`] with its constants `k` (`b1, b2, 1 − b1, 1 − b2, eps, step
/// size, 1/√(bias correction 2)`): with AVX where the CPU has it (eight lanes for the
/// square roots and divisions, which two SSE lanes' worth of issue otherwise bound), the
/// same bits either way (no fused multiply-add; IEEE's square root and division).
fn update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &[f32; 7]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX, checked just above.
        return unsafe { update_avx(p, g, m, v, k) };
    }
    update_lanes(p, g, m, v, k)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn update_avx(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &[f32; 7]) {
    update_lanes(p, g, m, v, k)
}

#[inline(always)]
fn update_lanes(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &[f32; 7]) {
    let [b1f, b2f, c1, c2, eps, step_size, inv_sqrt_bc2] = *k;
    let n = p.len().min(g.len()).min(m.len()).min(v.len());
    let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let gi = g[i];
        m[i] = b1f * m[i] + c1 * gi;
        v[i] = b2f * v[i] + c2 * gi * gi;
        let denom = v[i].sqrt() * inv_sqrt_bc2 + eps;
        p[i] -= step_size * m[i] / denom;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_steps_by_hand() {
        let mut params = BTreeMap::new();
        params.insert(
            "w".to_string(),
            Tensor::f32(vec![2], vec![1.0, -2.0]).unwrap(),
        );
        let mut adam = Adam::new(&OptimizerConfig::default(), &params);
        let mut grads = BTreeMap::new();
        grads.insert("w".to_string(), vec![0.5f32, -0.25]);
        adam.step(&mut params, &grads, 0.1).unwrap();
        // Step 1: m̂ = g, v̂ = g², so the update is lr · sign(g) (up to ε).
        let w = params["w"].as_f32().unwrap();
        assert!((w[0] - 0.9).abs() < 1e-6, "{w:?}");
        assert!((w[1] + 1.9).abs() < 1e-6, "{w:?}");
        // Step 2 with g = 0: m = 0.9·0.05 = 0.045, m̂ = 0.045/0.19; v = 0.98·0.0025·0.02...
        grads.insert("w".to_string(), vec![0.0, 0.0]);
        adam.step(&mut params, &grads, 0.1).unwrap();
        let m_hat = 0.9 * 0.1 * 0.5 / (1.0 - 0.81);
        let v_hat = 0.98 * 0.02 * 0.25 / (1.0 - 0.98f64 * 0.98);
        let want = 0.9 - 0.1 * m_hat / (v_hat.sqrt() + 1e-9);
        let w = params["w"].as_f32().unwrap();
        assert!((w[0] as f64 - want).abs() < 1e-6, "{} vs {want}", w[0]);
    }

    /// The update with AVX (where the CPU has it) gives the bits of the plain loop, over
    /// a length that leaves a remainder of the vectors.
    #[test]
    fn update_gives_the_same_bits_with_and_without_avx() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |scale: f32| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        };
        let n = 1037;
        let p: Vec<f32> = (0..n).map(|_| next(2.0)).collect();
        let g: Vec<f32> = (0..n).map(|_| next(0.1)).collect();
        let m: Vec<f32> = (0..n).map(|_| next(0.01)).collect();
        let v: Vec<f32> = (0..n).map(|_| next(1e-4).abs()).collect();
        let mut adam = Adam::new(&OptimizerConfig::default(), &BTreeMap::new());
        adam.t = 7;
        let k = adam.constants(7, 3e-4);
        let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
        let (mut p2, mut m2, mut v2) = (p.clone(), m.clone(), v.clone());
        update(&mut p1, &g, &mut m1, &mut v1, &k);
        update_lanes(&mut p2, &g, &mut m2, &mut v2, &k);
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&p1), bits(&p2));
        assert_eq!(bits(&m1), bits(&m2));
        assert_eq!(bits(&v1), bits(&v2));
        assert!(
            p1.iter().zip(&p).all(|(a, b)| a != b),
            "every parameter moved"
        );
    }

    #[test]
    fn state_round_trip_and_errors() {
        let mut params = BTreeMap::new();
        params.insert(
            "a".to_string(),
            Tensor::f32(vec![3], vec![1.0, 2.0, 3.0]).unwrap(),
        );
        let mut adam = Adam::new(&OptimizerConfig::default(), &params);
        let mut grads = BTreeMap::new();
        grads.insert("a".to_string(), vec![0.1f32, 0.2, 0.3]);
        adam.step(&mut params, &grads, 0.01).unwrap();
        let saved: BTreeMap<String, Tensor> = adam.state_tensors(&params).into_iter().collect();
        let mut b = Adam::new(&OptimizerConfig::default(), &params);
        b.load_state(adam.t, &params, &saved).unwrap();
        assert_eq!(b.m, adam.m);
        assert_eq!(b.v, adam.v);
        let mut missing = saved.clone();
        missing.remove("v.a");
        assert!(b
            .load_state(1, &params, &missing)
            .unwrap_err()
            .to_string()
            .contains("v.a"));
        grads.clear();
        assert!(adam
            .step(&mut params, &grads, 0.01)
            .unwrap_err()
            .to_string()
            .contains("no gradient"));
    }

    #[test]
    fn clipping_scales_to_the_global_norm() {
        let mut grads = BTreeMap::new();
        grads.insert("a".to_string(), vec![3.0f32, 0.0]);
        grads.insert("b".to_string(), vec![4.0f32]);
        // Norm 5, under 10: untouched.
        assert_eq!(clip_global_norm(&mut grads, 10.0), 5.0);
        assert_eq!(grads["a"], vec![3.0, 0.0]);
        // Over 1: every gradient times 1 / (5 + 1e-6).
        assert_eq!(clip_global_norm(&mut grads, 1.0), 5.0);
        let s = (1.0 / (5.0 + 1e-6)) as f32;
        assert_eq!(grads["a"], vec![3.0 * s, 0.0]);
        assert_eq!(grads["b"], vec![4.0 * s]);
        let norm = clip_global_norm(&mut grads, 10.0);
        assert!((norm - 1.0).abs() < 1e-6, "{norm}");
    }

    /// AdamW: the parameter decays by `1 − lr·wd` first, then takes Adam's update; with
    /// no decay the bits are plain Adam's.
    #[test]
    fn weight_decay_is_decoupled() {
        let params = || {
            let mut p = BTreeMap::new();
            p.insert(
                "w".to_string(),
                Tensor::f32(vec![2], vec![1.0, -2.0]).unwrap(),
            );
            p
        };
        let mut grads = BTreeMap::new();
        grads.insert("w".to_string(), vec![0.5f32, -0.25]);
        let (mut plain, mut decayed) = (params(), params());
        let mut adam = Adam::new(&OptimizerConfig::default(), &plain);
        adam.step(&mut plain, &grads, 0.1).unwrap();
        let cfg = OptimizerConfig {
            weight_decay: 0.01,
            ..OptimizerConfig::default()
        };
        let mut adamw = Adam::new(&cfg, &decayed);
        adamw.step(&mut decayed, &grads, 0.1).unwrap();
        let (p, d) = (plain["w"].as_f32().unwrap(), decayed["w"].as_f32().unwrap());
        // Adam's first step moves each weight by lr·sign(g) (up to ε): 1 − 0.1, −2 + 0.1.
        let decay = (1.0 - 0.1 * 0.01) as f32;
        assert_eq!(d[0], 1.0 * decay - (1.0 - p[0]));
        assert_eq!(d[1], -2.0 * decay - (-2.0 - p[1]));
        assert_ne!(d, p);
        assert_eq!(adamw.m, adam.m, "the moments do not see the decay");
    }
}
