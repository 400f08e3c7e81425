//! Direct implementations of the fused kernels whose point is *how* they compute:
//! attention with an online softmax (forward) and a recomputing backward, the layer norm
//! and its backward in one pass over a row, and the label-smoothed cross-entropy with its
//! gradient in closed form.
//!
//! In: f32 host tensors, as the kernel's operands. Out: the kernel's outputs. These are
//! the algorithms the CPU and CUDA backends implement; each is tested against its
//! template's definition (the primitives it was recognized from) on random inputs, so a
//! backend has a per-kernel oracle that is not the unfused graph.
//!
//! - `attention`: for each query row, keys are visited in blocks of [`BLOCK`]; a running
//!   maximum `m`, a running denominator `l` and an unnormalized output row are rescaled
//!   by `exp(m_old − m_new)` when the maximum grows (Milakov & Gimelshein, 2018; the
//!   flash-attention forward). The `[tq, tk]` probability matrix is never stored.
//! - `attention_bwd`: the row's log-sum-exp is recomputed, then `p = exp(s − lse)`,
//!   `D = Σ dO∘O`, `dS = p∘(dO·v − D)` (zero where masked), `dq = scale·dS·k`,
//!   `dk = scale·dSᵀ·q`, `dv = pᵀ·dO`, one key at a time.
//! - `add_layer_norm` / `_bwd`: `s = x + y`; with `c` the kernel's `1/d` attribute,
//!   `mean = c·Σs`, `var = c·Σ(s − mean)²`, `r = 1/sqrt(var + eps)`; the backward is the
//!   exact derivative for any `c` (`ds_j = r(a_j − cΣa) − c r³ (xc_j − c Σxc) Σ a∘xc`,
//!   `a = g∘γ`), `dγ = Σ_rows g∘xc∘r`, `dβ = Σ_rows g`.
//! - `xent_ls`: per row `p = softmax(x)`, `loss = c_nll·(−log p_t) + c_smooth·(−inv_v Σ log p)`
//!   averaged over non-pad rows; `dx_j = keep·(seed·(1/N)) · (c_nll (p_j − [j = t]) +
//!   c_smooth·inv_v·(V p_j − 1))` (`seed` is 1 but in the `seeded` form).

use crate::tensor::Tensor;

/// Keys per block of the online softmax.
pub const BLOCK: usize = 16;

fn f32s(t: &Tensor, what: &str) -> Result<Vec<f32>, String> {
    t.as_f32()
        .map(|v| v.to_vec())
        .ok_or_else(|| format!("{what} must be f32, not {}", t.dtype_name()))
}

fn scalar(t: &Tensor, what: &str) -> Result<f32, String> {
    let v = f32s(t, what)?;
    if v.len() != 1 {
        return Err(format!("{what} must be a scalar"));
    }
    Ok(v[0])
}

/// A bool mask broadcast (numpy, right-aligned) to `[b, h, tq, tk]`: element strides.
struct Mask<'a> {
    data: &'a [bool],
    strides: [usize; 4],
}

impl<'a> Mask<'a> {
    fn new(t: &'a Tensor, full: [usize; 4]) -> Result<Mask<'a>, String> {
        let data = t.as_bool().ok_or("the attention mask must be bool")?;
        if t.shape.len() > 4 {
            return Err("the attention mask has more than 4 axes".to_string());
        }
        let pad = 4 - t.shape.len();
        let mut strides = [0usize; 4];
        let mut s = 1usize;
        for ax in (0..t.shape.len()).rev() {
            let n = t.shape[ax];
            let target = full[pad + ax];
            if n != 1 && n != target {
                return Err(format!("mask {:?} does not broadcast to {full:?}", t.shape));
            }
            strides[pad + ax] = if n == 1 { 0 } else { s };
            s *= n;
        }
        Ok(Mask { data, strides })
    }

    fn get(&self, i: [usize; 4]) -> bool {
        self.data[i[0] * self.strides[0]
            + i[1] * self.strides[1]
            + i[2] * self.strides[2]
            + i[3] * self.strides[3]]
    }
}

struct Dims {
    b: usize,
    h: usize,
    tq: usize,
    tk: usize,
    dk: usize,
    dv: usize,
}

fn attention_dims(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Dims, String> {
    let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Err("attention operands must be [b, h, t, d]".to_string());
    }
    if ks[..2] != qs[..2] || vs[..2] != qs[..2] || ks[3] != qs[3] || vs[2] != ks[2] {
        return Err(format!(
            "attention shapes do not fit: q {qs:?}, k {ks:?}, v {vs:?}"
        ));
    }
    Ok(Dims {
        b: qs[0],
        h: qs[1],
        tq: qs[2],
        tk: ks[2],
        dk: qs[3],
        dv: vs[3],
    })
}

/// Scaled, masked score of query `i` against key `j` of head `(b, h)`.
#[allow(clippy::too_many_arguments)]
fn score(
    q: &[f32],
    k: &[f32],
    d: &Dims,
    bh: usize,
    i: usize,
    j: usize,
    scale: f32,
    fill: f32,
    mask: &Option<Mask>,
) -> f32 {
    if let Some(m) = mask {
        if !m.get([bh / d.h, bh % d.h, i, j]) {
            return fill;
        }
    }
    let qr = &q[(bh * d.tq + i) * d.dk..][..d.dk];
    let kr = &k[(bh * d.tk + j) * d.dk..][..d.dk];
    let mut acc = 0.0f32;
    for p in 0..d.dk {
        acc += qr[p] * kr[p];
    }
    acc * scale
}

/// Attention forward with an online softmax (never stores the `[tq, tk]` scores).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: &Tensor,
    fill: Option<&Tensor>,
) -> Result<Tensor, String> {
    let d = attention_dims(q, k, v)?;
    let (qv, kv, vv) = (f32s(q, "q")?, f32s(k, "k")?, f32s(v, "v")?);
    let scale = scalar(scale, "scale")?;
    let fill = match fill {
        Some(f) => scalar(f, "fill")?,
        None => 0.0,
    };
    let mask = mask
        .map(|m| Mask::new(m, [d.b, d.h, d.tq, d.tk]))
        .transpose()?;
    let mut out = vec![0.0f32; d.b * d.h * d.tq * d.dv];
    let mut s = [0.0f32; BLOCK];
    for bh in 0..d.b * d.h {
        for i in 0..d.tq {
            let o = &mut out[(bh * d.tq + i) * d.dv..][..d.dv];
            let mut m = f32::NEG_INFINITY;
            let mut l = 0.0f32;
            let mut j0 = 0;
            while j0 < d.tk {
                let n = BLOCK.min(d.tk - j0);
                let mut bmax = f32::NEG_INFINITY;
                for (t, sj) in s.iter_mut().enumerate().take(n) {
                    *sj = score(&qv, &kv, &d, bh, i, j0 + t, scale, fill, &mask);
                    bmax = bmax.max(*sj);
                }
                let m_new = m.max(bmax);
                let alpha = if m == f32::NEG_INFINITY {
                    0.0
                } else {
                    (m - m_new).exp()
                };
                l *= alpha;
                for x in o.iter_mut() {
                    *x *= alpha;
                }
                for (t, &sj) in s.iter().enumerate().take(n) {
                    let p = (sj - m_new).exp();
                    l += p;
                    let vr = &vv[(bh * d.tk + j0 + t) * d.dv..][..d.dv];
                    for (x, &y) in o.iter_mut().zip(vr) {
                        *x += p * y;
                    }
                }
                m = m_new;
                j0 += n;
            }
            for x in o.iter_mut() {
                *x /= l;
            }
        }
    }
    Tensor::f32(vec![d.b, d.h, d.tq, d.dv], out).map_err(|e| e.to_string())
}

/// Attention backward: `(dq, dk, dv)` for upstream gradient `g` of the output.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    g: &Tensor,
    scale: &Tensor,
    fill: Option<&Tensor>,
) -> Result<[Tensor; 3], String> {
    let d = attention_dims(q, k, v)?;
    let (qv, kv, vv, gv) = (f32s(q, "q")?, f32s(k, "k")?, f32s(v, "v")?, f32s(g, "g")?);
    let scale_v = scalar(scale, "scale")?;
    let fill_v = match fill {
        Some(f) => scalar(f, "fill")?,
        None => 0.0,
    };
    let mask_m = mask
        .map(|m| Mask::new(m, [d.b, d.h, d.tq, d.tk]))
        .transpose()?;
    let o = attention(q, k, v, mask, scale, fill)?;
    let ov = f32s(&o, "o")?;
    let mut dq = vec![0.0f32; qv.len()];
    let mut dk = vec![0.0f32; kv.len()];
    let mut dv = vec![0.0f32; vv.len()];
    for bh in 0..d.b * d.h {
        for i in 0..d.tq {
            // Log-sum-exp of the row.
            let mut m = f32::NEG_INFINITY;
            for j in 0..d.tk {
                m = m.max(score(&qv, &kv, &d, bh, i, j, scale_v, fill_v, &mask_m));
            }
            let mut l = 0.0f32;
            for j in 0..d.tk {
                l += (score(&qv, &kv, &d, bh, i, j, scale_v, fill_v, &mask_m) - m).exp();
            }
            let go = &gv[(bh * d.tq + i) * d.dv..][..d.dv];
            let orow = &ov[(bh * d.tq + i) * d.dv..][..d.dv];
            let big_d: f32 = go.iter().zip(orow).map(|(a, b)| a * b).sum();
            let qr = &qv[(bh * d.tq + i) * d.dk..][..d.dk];
            for j in 0..d.tk {
                let p = (score(&qv, &kv, &d, bh, i, j, scale_v, fill_v, &mask_m) - m).exp() / l;
                let vr = &vv[(bh * d.tk + j) * d.dv..][..d.dv];
                let dp: f32 = go.iter().zip(vr).map(|(a, b)| a * b).sum();
                let masked = mask_m
                    .as_ref()
                    .is_some_and(|mm| !mm.get([bh / d.h, bh % d.h, i, j]));
                let ds = if masked {
                    0.0
                } else {
                    p * (dp - big_d) * scale_v
                };
                let dvr = &mut dv[(bh * d.tk + j) * d.dv..][..d.dv];
                for (x, &y) in dvr.iter_mut().zip(go) {
                    *x += p * y;
                }
                let kr = &kv[(bh * d.tk + j) * d.dk..][..d.dk];
                let dqr = &mut dq[(bh * d.tq + i) * d.dk..][..d.dk];
                for (x, &y) in dqr.iter_mut().zip(kr) {
                    *x += ds * y;
                }
                let dkr = &mut dk[(bh * d.tk + j) * d.dk..][..d.dk];
                for (x, &y) in dkr.iter_mut().zip(qr) {
                    *x += ds * y;
                }
            }
        }
    }
    let t =
        |shape: &[usize], v: Vec<f32>| Tensor::f32(shape.to_vec(), v).map_err(|e| e.to_string());
    Ok([t(&q.shape, dq)?, t(&k.shape, dk)?, t(&v.shape, dv)?])
}

struct Rows {
    rows: usize,
    d: usize,
}

fn rows_of(x: &Tensor, gamma: &Tensor) -> Result<Rows, String> {
    let d = *x
        .shape
        .last()
        .ok_or("a layer norm needs at least one axis")?;
    if gamma.shape != [d] {
        return Err(format!("gamma {:?} does not fit rows of {d}", gamma.shape));
    }
    Ok(Rows {
        rows: x.data.len() / d.max(1),
        d,
    })
}

/// `normalize(x + y)` with the kernel's `1/d` and `eps`.
pub fn add_layer_norm(
    x: &Tensor,
    y: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    inv_d: &Tensor,
    eps: &Tensor,
) -> Result<Tensor, String> {
    let r = rows_of(x, gamma)?;
    let (xv, yv, gv, bv) = (
        f32s(x, "x")?,
        f32s(y, "y")?,
        f32s(gamma, "gamma")?,
        f32s(beta, "beta")?,
    );
    let (c, eps) = (scalar(inv_d, "inv_d")?, scalar(eps, "eps")?);
    let mut out = vec![0.0f32; xv.len()];
    for row in 0..r.rows {
        let s: Vec<f32> = (0..r.d)
            .map(|j| xv[row * r.d + j] + yv[row * r.d + j])
            .collect();
        let mean = s.iter().sum::<f32>() * c;
        let var = s.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() * c;
        let rstd = 1.0 / (var + eps).sqrt();
        for j in 0..r.d {
            out[row * r.d + j] = (s[j] - mean) * rstd * gv[j] + bv[j];
        }
    }
    Tensor::f32(x.shape.clone(), out).map_err(|e| e.to_string())
}

/// The backward of [`add_layer_norm`]: `(ds, dgamma, dbeta)`; `ds` is the gradient of
/// both `x` and `y`.
pub fn add_layer_norm_bwd(
    x: &Tensor,
    y: &Tensor,
    gamma: &Tensor,
    g: &Tensor,
    inv_d: &Tensor,
    eps: &Tensor,
) -> Result<[Tensor; 3], String> {
    let r = rows_of(x, gamma)?;
    let (xv, yv, gam, gv) = (
        f32s(x, "x")?,
        f32s(y, "y")?,
        f32s(gamma, "gamma")?,
        f32s(g, "g")?,
    );
    let (c, eps) = (scalar(inv_d, "inv_d")?, scalar(eps, "eps")?);
    let mut ds = vec![0.0f32; xv.len()];
    let mut dgamma = vec![0.0f32; r.d];
    let mut dbeta = vec![0.0f32; r.d];
    for row in 0..r.rows {
        let at = |j: usize| row * r.d + j;
        let s: Vec<f32> = (0..r.d).map(|j| xv[at(j)] + yv[at(j)]).collect();
        let mean = s.iter().sum::<f32>() * c;
        let xc: Vec<f32> = s.iter().map(|v| v - mean).collect();
        let var = xc.iter().map(|v| v * v).sum::<f32>() * c;
        let rstd = 1.0 / (var + eps).sqrt();
        let a: Vec<f32> = (0..r.d).map(|j| gv[at(j)] * gam[j]).collect();
        let sum_a: f32 = a.iter().sum();
        let sum_axc: f32 = a.iter().zip(&xc).map(|(p, q)| p * q).sum();
        let sum_xc: f32 = xc.iter().sum();
        for j in 0..r.d {
            ds[at(j)] =
                rstd * (a[j] - c * sum_a) - c * rstd * rstd * rstd * (xc[j] - c * sum_xc) * sum_axc;
            dgamma[j] += gv[at(j)] * xc[j] * rstd;
            dbeta[j] += gv[at(j)];
        }
    }
    let t =
        |shape: &[usize], v: Vec<f32>| Tensor::f32(shape.to_vec(), v).map_err(|e| e.to_string());
    Ok([
        t(&x.shape, ds)?,
        t(&gamma.shape, dgamma)?,
        t(&gamma.shape, dbeta)?,
    ])
}

/// Label-smoothed cross-entropy averaged over non-pad targets, and its gradient; with a
/// `seed` (the `seeded` form: a loss-scaled `train_step`), the gradient is `seed` times
/// that (the weight `seed·(1/N)` per non-pad row), the loss is not scaled.
pub fn xent_ls(
    logits: &Tensor,
    target: &Tensor,
    c_nll: &Tensor,
    c_smooth: &Tensor,
    inv_v: &Tensor,
    seed: Option<&Tensor>,
    pad: i64,
) -> Result<[Tensor; 2], String> {
    let x = f32s(logits, "logits")?;
    let t = target.as_i32().ok_or("the targets must be i32")?;
    let v = *logits.shape.last().ok_or("logits need a vocabulary axis")?;
    if t.len() * v != x.len() {
        return Err(format!(
            "targets {:?} do not fit logits {:?}",
            target.shape, logits.shape
        ));
    }
    let (cn, cs, iv) = (
        scalar(c_nll, "c_nll")?,
        scalar(c_smooth, "c_smooth")?,
        scalar(inv_v, "inv_v")?,
    );
    let mut total = 0.0f32;
    let mut kept = 0.0f32;
    let mut probs = vec![0.0f32; x.len()];
    for (row, &tid) in t.iter().enumerate() {
        let xr = &x[row * v..][..v];
        let m = xr.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let z: f32 = xr.iter().map(|&a| (a - m).exp()).sum();
        let lse = z.ln();
        let keep = if i64::from(tid) == pad { 0.0 } else { 1.0 };
        let lp_t = if (0..v as i32).contains(&tid) {
            xr[tid as usize] - m - lse
        } else {
            0.0
        };
        let sum_lp: f32 = xr.iter().map(|&a| a - m - lse).sum();
        total += (-lp_t * cn + -sum_lp * iv * cs) * keep;
        kept += keep;
        for (p, &a) in probs[row * v..][..v].iter_mut().zip(xr) {
            *p = (a - m).exp() / z;
        }
    }
    let loss = total / kept;
    let w = match seed {
        Some(s) => scalar(s, "seed")? * (1.0 / kept),
        None => 1.0 / kept,
    };
    let mut dx = vec![0.0f32; x.len()];
    for (row, &tid) in t.iter().enumerate() {
        if i64::from(tid) == pad {
            continue;
        }
        for j in 0..v {
            let p = probs[row * v + j];
            let hit = if j as i32 == tid { 1.0 } else { 0.0 };
            dx[row * v + j] = (cn * (p - hit) + cs * iv * (v as f32 * p - 1.0)) * w;
        }
    }
    Ok([
        Tensor::f32(vec![], vec![loss]).map_err(|e| e.to_string())?,
        Tensor::f32(logits.shape.clone(), dx).map_err(|e| e.to_string())?,
    ])
}
