//! The best tokens of each row of logits: the log-softmax and the top `k` with ties
//! broken by the lower id, vectorized with AVX-512 or AVX2 where the CPU has them.

/// Which tokens of each row beam search reads ([`StepModel::step_top`](super::StepModel::step_top)).
#[derive(Clone, Copy, Debug)]
pub struct TopSpec<'a> {
    /// How many of the best tokens (beam search needs `2·beam`).
    pub k: usize,
    /// Tokens never chosen (padding, beginning of sentence).
    pub banned: &'a [i32],
    /// The end-of-sentence token, whose log-probability every row also reports.
    pub eos: i32,
}

/// What beam search reads of one row of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct RowTop {
    /// `(log-probability, token)` of the best tokens, best first, ties to the smaller
    /// token; at most `k`, fewer when fewer tokens are neither banned nor NaN.
    pub best: Vec<(f64, i32)>,
    /// The end-of-sentence token's log-probability (`−∞` if it is outside the vocabulary).
    pub eos: f64,
}

/// The order of a row's candidates `(log-probability, token)`: the higher
/// log-probability first, ties to the smaller token.
pub(super) fn ranks_before(a: &(f64, i32), b: &(f64, i32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The [`RowTop`] of one row of log-probabilities: NaN and banned tokens left out.
pub fn row_top(row: &[f64], spec: &TopSpec<'_>) -> RowTop {
    let mut ids: Vec<(f64, i32)> = row
        .iter()
        .enumerate()
        .filter(|(t, lp)| !lp.is_nan() && !spec.banned.contains(&(*t as i32)))
        .map(|(t, &lp)| (lp, t as i32))
        .collect();
    let better = ranks_before;
    if ids.len() > spec.k {
        if spec.k == 0 {
            ids.clear();
        } else {
            ids.select_nth_unstable_by(spec.k - 1, better);
            ids.truncate(spec.k);
        }
    }
    ids.sort_by(better);
    let eos = usize::try_from(spec.eos)
        .ok()
        .and_then(|e| row.get(e))
        .copied()
        .unwrap_or(f64::NEG_INFINITY);
    RowTop { best: ids, eos }
}

/// The log-sum-exp of one row of logits, in f64, over its non-NaN values (a NaN logit
/// does not spoil the others), as the GPU decoder's `row_top_k` computes it (there in
/// another order of summation, so within rounding).
///
/// The maximum and the sum run in eight interleaved lanes with [`exp_nonpositive`], so
/// the loops vectorize: with AVX-512 or AVX2, and FMA, where the CPU has them (detected
/// at run time), four times faster than one libm `exp` per logit with AVX-512. The
/// series' multiply-adds are fused on every path (FMA instructions, else libm's `fma`,
/// slow but rounded the same), so every path gives the same bits; fused, the series
/// takes half the instructions (`row_lse` of 8000 logits 1.7 times as fast with AVX2).
pub(super) fn row_lse(row: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F and FMA, checked just above.
            return unsafe { row_lse_avx512(row) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 and FMA, checked just above.
            return unsafe { row_lse_avx2(row) };
        }
    }
    row_lse_lanes(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn row_lse_avx512(row: &[f32]) -> f64 {
    row_lse_lanes(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn row_lse_avx2(row: &[f32]) -> f64 {
    row_lse_lanes(row)
}

/// [`row_lse`] in eight lanes: lane `i` takes the logits `i, i + 8, …` (the remainder's
/// to the first lanes), and the lanes are combined in order.
#[inline(always)]
pub(super) fn row_lse_lanes(row: &[f32]) -> f64 {
    const L: usize = 8;
    let mut top = [f64::NEG_INFINITY; L];
    let mut chunks = row.chunks_exact(L);
    for c in &mut chunks {
        for i in 0..L {
            top[i] = top[i].max(c[i] as f64);
        }
    }
    for (t, &x) in top.iter_mut().zip(chunks.remainder()) {
        *t = t.max(x as f64);
    }
    let m = top.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    let term = |x: f32| {
        let e = exp_nonpositive(x as f64 - m);
        if x.is_nan() {
            0.0
        } else {
            e
        }
    };
    let mut acc = [0.0f64; L];
    let mut chunks = row.chunks_exact(L);
    for c in &mut chunks {
        let mut e = [0.0f64; L];
        for i in 0..L {
            e[i] = term(c[i]);
        }
        for i in 0..L {
            acc[i] += e[i];
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += term(x);
    }
    m + acc.iter().sum::<f64>().ln()
}

/// `exp(d)` for `d ≤ 0` in f64 without a libm `exp` call, so that a loop over a row
/// vectorizes: `2^n · e^r` with `n = round(d / ln 2)`, `|r| ≤ ln 2 / 2`, and `e^r` by its
/// Taylor series to `r^13 / 13!` in fused multiply-adds (truncated below 1e-17 relative;
/// within a few units in the last place of `f64::exp`). NaN stays NaN. Below −708, where
/// `exp` leaves the normal range, it returns `exp(−708)` ≈ 3e−308: nothing next to a
/// row's largest term, 1.
#[inline(always)]
pub(super) fn exp_nonpositive(d: f64) -> f64 {
    // 1.5 · 2^52: adding it rounds to an integer, which its low bits then hold.
    const ROUND: f64 = 6_755_399_441_055_744.0;
    // ln 2 in two parts; `n · LN2_HI` is exact for |n| < 2^11.
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000); // 0.693147180369…
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76); // 1.9082149292…e-10
    let d = if d < -708.0 { -708.0 } else { d };
    let t = d * std::f64::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (d - n * LN2_HI) - n * LN2_LO;
    // 1/k! for k = 13 down to 1.
    const INV_FACT: [f64; 13] = [
        1.0 / 6_227_020_800.0,
        1.0 / 479_001_600.0,
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        1.0 / 2.0,
        1.0,
    ];
    let mut p = INV_FACT[0];
    for &c in &INV_FACT[1..] {
        p = p.mul_add(r, c);
    }
    p = p.mul_add(r, 1.0);
    // 2^n: the biased exponent n + 1023 (in 1 ..= 1023 here) in the exponent bits.
    let scale = f64::from_bits(t.to_bits().wrapping_add(1023) << 52);
    p * scale
}

/// Log-softmax of each row of `logits` (`rows × v`), in f64 ([`row_lse`]; a NaN logit
/// stays NaN).
pub(super) fn log_softmax_rows(logits: &[f32], v: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(logits.len());
    for row in logits.chunks(v.max(1)) {
        let lse = row_lse(row);
        out.extend(row.iter().map(|&x| x as f64 - lse));
    }
    out
}

/// [`row_top`] of every row of `log_softmax_rows(logits, v)`, bit for bit, without
/// the log-probabilities of the whole vocabulary in memory: per row its log-sum-exp, then
/// one pass that keeps the best `spec.k` in order. The rows run in parallel.
pub fn rows_top(logits: &[f32], v: usize, spec: &TopSpec<'_>) -> Vec<RowTop> {
    use rayon::prelude::*;
    if v == 0 {
        return Vec::new();
    }
    logits
        .par_chunks(v)
        .with_min_len(4)
        .map(|row| top_of_logits(row, spec))
        .collect()
}

/// [`row_top`] of the log-softmax of one row of logits, with AVX-512 or AVX2 where the
/// CPU has them (the same bits on every path: the vector code only skips what the scalar
/// code would skip).
pub(super) fn top_of_logits(row: &[f32], spec: &TopSpec<'_>) -> RowTop {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { top_of_logits_avx512(row, spec) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { top_of_logits_avx2(row, spec) };
        }
    }
    top_of_logits_lanes(row, spec)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn top_of_logits_avx512(row: &[f32], spec: &TopSpec<'_>) -> RowTop {
    top_of_logits_lanes(row, spec)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn top_of_logits_avx2(row: &[f32], spec: &TopSpec<'_>) -> RowTop {
    top_of_logits_lanes(row, spec)
}

/// [`top_of_logits`]: the row's log-sum-exp, then one pass that keeps the best `spec.k`
/// in order. Once `k` are kept, a block of sixteen logits whose every log-probability is
/// below the `k`-th best is passed over whole (a branch-free test that vectorizes): most
/// of a row, since the `k`-th best soon lies near the top.
#[inline(always)]
pub(super) fn top_of_logits_lanes(row: &[f32], spec: &TopSpec<'_>) -> RowTop {
    use std::cmp::Ordering;
    const BLOCK: usize = 16;
    let lse = row_lse(row);
    let better = ranks_before;
    let mut best: Vec<(f64, i32)> = Vec::with_capacity(spec.k + 1);
    if spec.k > 0 {
        let mut start = 0;
        while start < row.len() {
            let end = (start + BLOCK).min(row.len());
            if best.len() == spec.k && end - start == BLOCK {
                let kth = best[spec.k - 1].0;
                let mut below = true;
                for &x in &row[start..end] {
                    below &= (x as f64 - lse) < kth;
                }
                if below {
                    start = end;
                    continue;
                }
            }
            for (t, &x) in row.iter().enumerate().take(end).skip(start) {
                let c = (x as f64 - lse, t as i32);
                if c.0.is_nan() {
                    continue;
                }
                if best.len() == spec.k
                    // Numerically below the k-th: after it in the total order too.
                    && (c.0 < best[spec.k - 1].0
                        || better(&c, &best[spec.k - 1]) != Ordering::Less)
                {
                    continue;
                }
                if spec.banned.contains(&c.1) {
                    continue;
                }
                let at = best.partition_point(|b| better(b, &c) == Ordering::Less);
                best.insert(at, c);
                best.truncate(spec.k);
            }
            start = end;
        }
    }
    let eos = usize::try_from(spec.eos)
        .ok()
        .and_then(|e| row.get(e))
        .map(|&x| x as f64 - lse)
        .unwrap_or(f64::NEG_INFINITY);
    RowTop { best, eos }
}
