//! Seeded, deterministic parameter initialization.
//!
//! In: a parameter's name, type and [`Init`] rule, and the run's seed (or a whole
//! [`Graph`]). Out: its starting values as an f32 host [`Tensor`].
//!
//! A parameter's values depend only on (seed, name, shape, init): its random stream is
//! the 64-bit FNV-1a hash of its name ([`param_stream`]), and element `i` (row-major) is
//! drawn from Philox at counter `(i, stream)` with the seed as key (see [`crate::rng`]).
//! Adding, removing or reordering other parameters never changes it.
//!
//! Rules (values are computed in f64 and rounded to f32 once):
//! - `zeros`, `ones`, `constant(v)`;
//! - `uniform(a)`: `-a + 2a·u` with `u = uniform01(seed, stream, i)`, i.e. U(-a, a);
//! - `normal(std)`: `std · standard_normal(seed, stream, i)`;
//! - `xavier_uniform`: `uniform(a)` with `a = sqrt(6 / (fan_in + fan_out))`. kiln stores a
//!   linear layer's weight as `[d_in, d_out]` (used as `x @ W`), so for a matrix
//!   `fan_in = shape[0]`, `fan_out = shape[1]`. For rank > 2 it follows PyTorch's rule:
//!   `fan_in = shape[1]·r`, `fan_out = shape[0]·r`, where `r` is the product of dims 2..
//!   (the receptive field). Vectors and scalars are an error.

use crate::ir::{Graph, Init, Op, TensorType};
use crate::rng::{standard_normal, uniform01};
use crate::tensor::Tensor;

/// Why a parameter could not be initialized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InitError {
    #[error(
        "parameter `{name}` has shape {shape}, which is not concrete; parameter shapes must \
         be numbers"
    )]
    SymbolicShape { name: String, shape: String },
    #[error("parameter `{name}` is {dtype}; parameters must be floating point (f32)")]
    NotFloat { name: String, dtype: String },
    #[error(
        "parameter `{name}` has shape {shape}: xavier_uniform needs a matrix (rank 2 or \
         more); use `normal(std=…)`, `uniform(a=…)` or `zeros` for it instead"
    )]
    NeedsMatrix { name: String, shape: String },
    #[error("parameter `{name}`: {message}")]
    BadRule { name: String, message: String },
    #[error("malformed graph: {node} is listed as a parameter but is {what}")]
    NotAParam { node: String, what: String },
    #[error(transparent)]
    Memory(#[from] crate::memory::OutOfMemory),
}

/// The 64-bit FNV-1a hash of a parameter name: its random stream.
pub fn param_stream(name: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    name.bytes()
        .fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

/// `(fan_in, fan_out)` of a weight of `shape` (see the module documentation).
pub fn xavier_fans(shape: &[usize]) -> Option<(usize, usize)> {
    if shape.len() < 2 {
        return None;
    }
    if shape.len() == 2 {
        return Some((shape[0], shape[1]));
    }
    let receptive = shape[2..]
        .iter()
        .fold(1usize, |acc, &d| acc.saturating_mul(d));
    Some((
        shape[1].saturating_mul(receptive),
        shape[0].saturating_mul(receptive),
    ))
}

/// The starting values of one parameter.
pub fn init_param(name: &str, ty: &TensorType, init: Init, seed: u64) -> Result<Tensor, InitError> {
    let shape = ty
        .shape
        .as_consts()
        .ok_or_else(|| InitError::SymbolicShape {
            name: name.to_string(),
            shape: ty.shape.to_string(),
        })?;
    if !ty.dtype.is_float() {
        return Err(InitError::NotFloat {
            name: name.to_string(),
            dtype: ty.dtype.to_string(),
        });
    }
    let bad = |message: String| InitError::BadRule {
        name: name.to_string(),
        message,
    };
    let n = crate::tensor::shape_numel(&shape)
        .ok_or_else(|| bad(format!("shape {} has too many elements", ty.shape)))?;
    let stream = param_stream(name);
    let uniform = |a: f64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| (-a + 2.0 * a * uniform01(seed, stream, i)) as f32)
            .collect()
    };
    let data: Vec<f32> = match init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Constant(v) => {
            let v = v.get();
            if !v.is_finite() {
                return Err(bad(format!(
                    "constant({v}) is not a finite number; give a finite value"
                )));
            }
            vec![v as f32; n]
        }
        Init::Uniform { a } => {
            let a = a.get();
            if !(a.is_finite() && a >= 0.0) {
                return Err(bad(format!(
                    "uniform(a={a}) needs a finite bound a >= 0 (values are drawn from U(-a, a))"
                )));
            }
            uniform(a)
        }
        Init::Normal { std } => {
            let std = std.get();
            if !(std.is_finite() && std >= 0.0) {
                return Err(bad(format!(
                    "normal(std={std}) needs a finite standard deviation >= 0"
                )));
            }
            (0..n as u64)
                .map(|i| (std * standard_normal(seed, stream, i)) as f32)
                .collect()
        }
        Init::XavierUniform => {
            let (fan_in, fan_out) = xavier_fans(&shape).ok_or_else(|| InitError::NeedsMatrix {
                name: name.to_string(),
                shape: ty.shape.to_string(),
            })?;
            let fans = fan_in as f64 + fan_out as f64;
            if fans == 0.0 {
                return Err(bad(format!(
                    "xavier_uniform of shape {} has no fan-in or fan-out",
                    ty.shape
                )));
            }
            uniform((6.0 / fans).sqrt())
        }
    };
    Ok(Tensor {
        shape,
        data: crate::tensor::TensorData::F32(data),
    })
}

/// The starting values of every parameter of `graph`, in the graph's parameter order.
pub fn init_params(graph: &Graph, seed: u64) -> Result<Vec<(String, Tensor)>, InitError> {
    // The parameters' bytes in all, checked against what the machine has before any is
    // made (a vocabulary or a width too large for it is an error, not an abort).
    let bytes = graph
        .params
        .iter()
        .filter_map(|p| graph.nodes.get(p.index()))
        .filter_map(|n| n.ty.shape.as_consts())
        .map(|s| crate::tensor::shape_numel(&s).map_or(u64::MAX, |n| n as u64))
        .fold(0u64, |a, n| a.saturating_add(n.saturating_mul(4)));
    crate::memory::ensure(
        bytes,
        || format!("initializing {} parameters", graph.params.len()),
        || "make the model smaller (its vocabulary, width or layers)".to_string(),
    )?;
    let mut out = Vec::with_capacity(graph.params.len());
    for &p in &graph.params {
        let node = graph.nodes.get(p.index());
        let (name, init, ty) = match node {
            Some(n) => match &n.op {
                Op::Param { name, init } => (name, *init, &n.ty),
                other => {
                    return Err(InitError::NotAParam {
                        node: p.to_string(),
                        what: format!("a {} node", other.name()),
                    })
                }
            },
            None => {
                return Err(InitError::NotAParam {
                    node: p.to_string(),
                    what: "not in the graph".to_string(),
                })
            }
        };
        out.push((name.clone(), init_param(name, ty, init, seed)?));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Float};
    use crate::shape::{Dim, Shape};

    fn f32_ty(dims: &[i64]) -> TensorType {
        TensorType::new(DType::F32, Shape::consts(dims))
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn fnv1a_known_values() {
        // Reference values of 64-bit FNV-1a.
        assert_eq!(param_stream(""), 0xcbf29ce484222325);
        assert_eq!(param_stream("a"), 0xaf63dc4c8601ec8c);
        assert_eq!(param_stream("foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn deterministic_per_seed() {
        let ty = f32_ty(&[16, 8]);
        let a = init_param("enc.w", &ty, Init::XavierUniform, 7).unwrap();
        let b = init_param("enc.w", &ty, Init::XavierUniform, 7).unwrap();
        let c = init_param("enc.w", &ty, Init::XavierUniform, 8).unwrap();
        assert_eq!(bits(&a), bits(&b));
        assert_ne!(bits(&a), bits(&c));
        assert_eq!(a.shape, vec![16, 8]);
        // A different name is a different stream.
        let d = init_param("dec.w", &ty, Init::XavierUniform, 7).unwrap();
        assert_ne!(bits(&a), bits(&d));
    }

    #[test]
    fn order_independent() {
        let build = |names: &[&str]| {
            let mut g = Graph::new("m");
            for n in names {
                g.add_param(
                    n,
                    f32_ty(&[4, 4]),
                    Init::Normal {
                        std: Float::new(0.02),
                    },
                    "",
                )
                .unwrap();
            }
            init_params(&g, 123).unwrap()
        };
        let ab = build(&["a", "b"]);
        let ba = build(&["b", "a", "c"]);
        assert_eq!(ab[0].0, "a");
        assert_eq!(ba[0].0, "b");
        assert_eq!(bits(&ab[0].1), bits(&ba[1].1));
        assert_eq!(bits(&ab[1].1), bits(&ba[0].1));
    }

    #[test]
    fn xavier_bounds_and_variance() {
        let t = init_param("w", &f32_ty(&[512, 512]), Init::XavierUniform, 1).unwrap();
        let a = (6.0f64 / 1024.0).sqrt();
        let v = t.as_f32().unwrap();
        assert!(v.iter().all(|&x| f64::from(x.abs()) <= a));
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        let want = a * a / 3.0;
        // The sample variance's relative std here is ~0.18%; allow 1% (~5.7 sigma).
        assert!(
            (var / want - 1.0).abs() < 0.01,
            "variance {var} vs {want} (a = {a})"
        );
        assert!(mean.abs() < 0.001, "mean {mean}");
    }

    #[test]
    fn xavier_fan_rules() {
        assert_eq!(xavier_fans(&[3, 5]), Some((3, 5)));
        assert_eq!(xavier_fans(&[8, 4, 3, 3]), Some((36, 72)));
        assert_eq!(xavier_fans(&[7]), None);
        let err = init_param("bias", &f32_ty(&[7]), Init::XavierUniform, 0).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`bias`"), "{msg}");
        assert!(msg.contains("xavier_uniform needs a matrix"), "{msg}");
    }

    #[test]
    fn normal_mean_and_std() {
        let t = init_param(
            "emb",
            &f32_ty(&[512, 512]),
            Init::Normal {
                std: Float::new(0.02),
            },
            5,
        )
        .unwrap();
        let v = t.as_f32().unwrap();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let std = (v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n)
            .sqrt();
        // Standard errors: mean 0.02/512 ~ 4e-5, std ~0.14% relative.
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((std / 0.02 - 1.0).abs() < 0.01, "std {std}");
    }

    #[test]
    fn simple_rules_and_errors() {
        let ty = f32_ty(&[2, 3]);
        let z = init_param("z", &ty, Init::Zeros, 0).unwrap();
        assert_eq!(z.as_f32().unwrap(), &[0.0; 6]);
        let o = init_param("o", &ty, Init::Ones, 0).unwrap();
        assert_eq!(o.as_f32().unwrap(), &[1.0; 6]);
        let c = init_param("c", &ty, Init::Constant(Float::new(0.5)), 0).unwrap();
        assert_eq!(c.as_f32().unwrap(), &[0.5; 6]);
        let u = init_param(
            "u",
            &f32_ty(&[1000]),
            Init::Uniform { a: Float::new(0.1) },
            0,
        )
        .unwrap();
        let v = u.as_f32().unwrap();
        assert!(v.iter().all(|x| x.abs() <= 0.1));
        assert!(v.iter().any(|&x| x > 0.05) && v.iter().any(|&x| x < -0.05));
        let s = init_param("s", &f32_ty(&[]), Init::Ones, 0).unwrap();
        assert_eq!(s.shape, Vec::<usize>::new());
        assert_eq!(s.as_f32().unwrap(), &[1.0]);

        let sym = TensorType::new(DType::F32, Shape(vec![Dim::sym("b")]));
        let msg = init_param("p", &sym, Init::Zeros, 0)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`p`") && msg.contains("[b]"), "{msg}");
        let ids = TensorType::new(DType::I32, Shape::consts(&[2]));
        assert!(init_param("q", &ids, Init::Zeros, 0).is_err());
        let msg = init_param(
            "r",
            &ty,
            Init::Normal {
                std: Float::new(-1.0),
            },
            0,
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("`r`") && msg.contains("std"), "{msg}");
    }
}
