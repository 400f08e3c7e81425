//! Decoding: greedy and beam search over any step model.
//!
//! In: a batch of source sentences (token ids) and a [`StepModel`] that, given the last
//! token of every live hypothesis and which earlier row it continues, returns
//! log-probabilities for the next token. Out: for each sentence, the best hypothesis
//! (tokens without `<eos>`) and its length-normalized score.
//!
//! Two step models:
//! - [`CachedStep`]: the `encode` entry runs once; each step runs `decode_step`, which
//!   reads one new token per row and keeps every causal attention's keys and values in a
//!   cache that grows by one position (reordered when beams are reordered);
//! - [`FullStep`]: runs the `forward` entry on the whole prefix at every step — slow,
//!   the check that the cached path computes the same thing.
//!
//! Beam search follows the paper and fairseq: beam size K, scores are summed
//! log-probabilities, `K` best non-final continuations kept out of the `2K` best
//! candidates, a hypothesis finishes when it emits `<eos>` (its score is divided by the
//! length penalty), every hypothesis is forced to finish at the maximum length
//! `a · src_len + b`, and a sentence stops early once no live hypothesis can beat its
//! `K` finished ones. Ties are broken by hypothesis order, then token id, so results
//! are deterministic.

use std::collections::BTreeMap;

use kiln_compiler::ir::Graph;
use kiln_compiler::reference::{ExecError, RunOptions};
use kiln_compiler::tensor::{Tensor, TensorData};

use crate::exec::Exec;

/// Length normalization of finished hypotheses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LengthPenalty {
    /// Wu et al. (2016): ((5 + len) / 6)^α — the paper's choice with α = 0.6.
    Gnmt(f64),
    /// len^α, as fairseq and CTranslate2 do.
    LenPow(f64),
    /// No normalization.
    None,
}

impl LengthPenalty {
    pub fn parse(kind: &str, alpha: f64) -> Option<LengthPenalty> {
        match kind {
            "gnmt" => Some(LengthPenalty::Gnmt(alpha)),
            "len_pow" => Some(LengthPenalty::LenPow(alpha)),
            "none" => Some(LengthPenalty::None),
            _ => None,
        }
    }

    /// The divisor for a hypothesis of `len` tokens (`<eos>` included).
    pub fn divisor(self, len: usize) -> f64 {
        match self {
            LengthPenalty::Gnmt(a) => ((5.0 + len as f64) / 6.0).powf(a),
            LengthPenalty::LenPow(a) => (len as f64).powf(a),
            LengthPenalty::None => 1.0,
        }
    }

    /// Whether the divisor grows with length (so a longer hypothesis is divided by more).
    fn grows(self) -> bool {
        match self {
            LengthPenalty::Gnmt(a) | LengthPenalty::LenPow(a) => a > 0.0,
            LengthPenalty::None => false,
        }
    }
}

/// Decoding settings.
#[derive(Clone, Debug)]
pub struct DecodeOptions {
    /// Beam size; 1 with `greedy` is plain argmax decoding.
    pub beam: usize,
    pub greedy: bool,
    pub penalty: LengthPenalty,
    /// Maximum output length `a · src_len + b` (tokens, `<eos>` included).
    pub max_len_a: f64,
    pub max_len_b: usize,
    /// The most target positions the model takes (`<bos>` is position 0), if it has a
    /// limit ([`max_target_positions`]): the output length (`<eos>` included) is capped
    /// there, as fairseq caps it by the decoder's maximum positions. Without a cap a huge
    /// `max_len_a` would never let beam search prove it is done.
    pub max_positions: Option<usize>,
    pub bos: i32,
    pub eos: i32,
    pub pad: i32,
}

impl Default for DecodeOptions {
    /// The paper's settings: beam 4, α = 0.6 (GNMT penalty), max length src + 50.
    fn default() -> DecodeOptions {
        DecodeOptions {
            beam: 4,
            greedy: false,
            penalty: LengthPenalty::Gnmt(0.6),
            max_len_a: 1.0,
            max_len_b: 50,
            max_positions: None,
            bos: 1,
            eos: 2,
            pad: 0,
        }
    }
}

/// The most target positions a decoder step graph takes (`<bos>` is position 0): the
/// rows of a table it reads at target positions (a learned positional embedding,
/// [`Graph::position_table`]) and the spec's `max_len` parameter (the transformer specs'
/// maximum positions, as fairseq's `max_target_positions`), whichever is smaller.
pub fn max_target_positions(step: &Graph) -> Option<usize> {
    let table = step.position_table("tgt_len").map(|t| t.rows);
    let declared = step.hparam("max_len").and_then(|v| v.parse::<usize>().ok());
    match (table, declared) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The best hypothesis of one sentence.
#[derive(Clone, Debug, PartialEq)]
pub struct Hypothesis {
    /// Output tokens, without `<bos>` and `<eos>`.
    pub tokens: Vec<i32>,
    /// Sum of log-probabilities (`<eos>` included) divided by the length penalty.
    pub score: f64,
    /// Sum of log-probabilities.
    pub log_prob: f64,
}

/// An error while decoding.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("running the model failed: {0}")]
    Exec(#[from] ExecError),
    #[error("{0}")]
    Model(String),
}

/// The widest beam a search takes: wider ones cost memory in proportion (every live
/// row's scores over the vocabulary) and find nothing better in practice.
pub const MAX_BEAM: usize = 256;

/// Which tokens of each row beam search reads ([`StepModel::step_top`]).
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
fn ranks_before(a: &(f64, i32), b: &(f64, i32)) -> std::cmp::Ordering {
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

/// A model that extends hypotheses one token at a time.
pub trait StepModel {
    /// Prepares for `src` (`[B, S]`); row `i` of the first step continues sentence `i`.
    fn start(&mut self, src: &Tensor) -> Result<(), DecodeError>;
    /// Extends every row: `parents[r]` is the row of the previous step (or, at the first
    /// step, the sentence) that row `r` continues, `tokens[r]` its newest token. Returns
    /// row-major log-probabilities, `rows × vocab`.
    fn step(&mut self, tokens: &[i32], parents: &[usize]) -> Result<Vec<f64>, DecodeError>;
    fn vocab(&self) -> usize;
    /// [`StepModel::step`], returning per row only what beam search reads: the best
    /// `spec.k` tokens and the end of sentence ([`row_top`] of each row of `step`, unless
    /// a model selects them where its logits are, as the GPU decoder does).
    fn step_top(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
        spec: &TopSpec<'_>,
    ) -> Result<Vec<RowTop>, DecodeError> {
        let logp = self.step(tokens, parents)?;
        let v = self.vocab();
        if logp.len() != tokens.len() * v {
            return Err(DecodeError::Model(format!(
                "the step model returned {} scores for {} rows of vocabulary {v}",
                logp.len(),
                tokens.len()
            )));
        }
        Ok(logp.chunks(v.max(1)).map(|r| row_top(r, spec)).collect())
    }
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
fn row_lse(row: &[f32]) -> f64 {
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
unsafe fn row_lse_avx512(row: &[f32]) -> f64 {
    row_lse_lanes(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_lse_avx2(row: &[f32]) -> f64 {
    row_lse_lanes(row)
}

/// [`row_lse`] in eight lanes: lane `i` takes the logits `i, i + 8, …` (the remainder's
/// to the first lanes), and the lanes are combined in order.
#[inline(always)]
fn row_lse_lanes(row: &[f32]) -> f64 {
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
fn exp_nonpositive(d: f64) -> f64 {
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
fn log_softmax_rows(logits: &[f32], v: usize) -> Vec<f64> {
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
fn top_of_logits(row: &[f32], spec: &TopSpec<'_>) -> RowTop {
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
unsafe fn top_of_logits_avx512(row: &[f32], spec: &TopSpec<'_>) -> RowTop {
    top_of_logits_lanes(row, spec)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn top_of_logits_avx2(row: &[f32], spec: &TopSpec<'_>) -> RowTop {
    top_of_logits_lanes(row, spec)
}

/// [`top_of_logits`]: the row's log-sum-exp, then one pass that keeps the best `spec.k`
/// in order. Once `k` are kept, a block of sixteen logits whose every log-probability is
/// below the `k`-th best is passed over whole (a branch-free test that vectorizes): most
/// of a row, since the `k`-th best soon lies near the top.
#[inline(always)]
fn top_of_logits_lanes(row: &[f32], spec: &TopSpec<'_>) -> RowTop {
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

/// The rows `rows` of `t` along axis 0, in that order.
pub fn take_rows(t: &Tensor, rows: &[usize]) -> Tensor {
    let row = if t.shape.is_empty() || t.shape[0] == 0 {
        0
    } else {
        t.numel() / t.shape[0]
    };
    fn pick<E: Copy>(v: &[E], rows: &[usize], row: usize) -> Vec<E> {
        let mut out = Vec::with_capacity(rows.len() * row);
        for &r in rows {
            out.extend_from_slice(&v[r * row..(r + 1) * row]);
        }
        out
    }
    let data = match &t.data {
        TensorData::F32(v) => TensorData::F32(pick(v, rows, row)),
        TensorData::F64(v) => TensorData::F64(pick(v, rows, row)),
        TensorData::I32(v) => TensorData::I32(pick(v, rows, row)),
        TensorData::I64(v) => TensorData::I64(pick(v, rows, row)),
        TensorData::Bool(v) => TensorData::Bool(pick(v, rows, row)),
    };
    let mut shape = t.shape.clone();
    if !shape.is_empty() {
        shape[0] = rows.len();
    }
    Tensor { shape, data }
}

fn logits_of(
    out: &mut BTreeMap<String, Tensor>,
    rows: usize,
) -> Result<(Vec<f32>, usize), DecodeError> {
    let t = out
        .remove("logits")
        .ok_or_else(|| DecodeError::Model("the model has no `logits` output".to_string()))?;
    let TensorData::F32(v) = t.data else {
        return Err(DecodeError::Model("logits are not f32".to_string()));
    };
    let [r, len, vocab] = t.shape[..] else {
        return Err(DecodeError::Model(format!(
            "logits have shape {:?}, expected [rows, len, vocab]",
            t.shape
        )));
    };
    if r != rows {
        return Err(DecodeError::Model(format!(
            "logits have {r} rows, expected {rows}"
        )));
    }
    if len == 1 {
        // A decoding step: the logits are those of the newest position already.
        return Ok((v, vocab));
    }
    // The last position of every row.
    let mut last = Vec::with_capacity(rows * vocab);
    for i in 0..rows {
        let start = (i * len + len - 1) * vocab;
        last.extend_from_slice(&v[start..start + vocab]);
    }
    Ok((last, vocab))
}

/// The [`StepModel`] methods of a host step model with a `step_logits` method and a
/// `vocab` field: log-probabilities of whole rows, or each row's best tokens straight
/// from the logits ([`rows_top`]).
macro_rules! host_step_methods {
    () => {
        fn step(&mut self, tokens: &[i32], parents: &[usize]) -> Result<Vec<f64>, DecodeError> {
            let (logits, vocab) = self.step_logits(tokens, parents)?;
            Ok(log_softmax_rows(&logits, vocab))
        }

        fn step_top(
            &mut self,
            tokens: &[i32],
            parents: &[usize],
            spec: &TopSpec<'_>,
        ) -> Result<Vec<RowTop>, DecodeError> {
            let (logits, vocab) = self.step_logits(tokens, parents)?;
            Ok(rows_top(&logits, vocab, spec))
        }

        fn vocab(&self) -> usize {
            self.vocab
        }
    };
}

/// How a step's rows continue the rows of the step before (`parents`), given the
/// sentence of each earlier row: rows in the same order (greedy decoding until a sentence
/// ends) keep every state tensor as it is; in any other order the caches are gathered,
/// and the per-sentence values too unless every row continues a row of its own sentence.
struct RowLayout {
    same: bool,
    same_sentences: bool,
    /// The sentence of each new row.
    sentences: Vec<usize>,
}

impl RowLayout {
    fn new(before: &[usize], parents: &[usize]) -> Result<RowLayout, DecodeError> {
        if let Some(&p) = parents.iter().find(|&&p| p >= before.len()) {
            return Err(DecodeError::Model(format!(
                "row {p} continued, but the step before had {} rows",
                before.len()
            )));
        }
        let sentences: Vec<usize> = parents.iter().map(|&p| before[p]).collect();
        Ok(RowLayout {
            same: parents.iter().enumerate().all(|(i, &p)| i == p),
            same_sentences: sentences == before,
            sentences,
        })
    }

    /// Whether state tensor `name` (first axis `first`) stays as it is for `rows` rows.
    fn stays(&self, name: &str, first: Option<&usize>, rows: usize) -> bool {
        first == Some(&rows)
            && (self.same
                || (self.same_sentences && !name.starts_with(kiln_compiler::ir::CACHE_PREFIX)))
    }
}

/// Decoding with the `encode` and `decode_step` entry points and a key/value cache.
pub struct CachedStep<'a> {
    encode: &'a dyn Exec,
    step: &'a dyn Exec,
    params: &'a BTreeMap<String, Tensor>,
    opts: RunOptions,
    /// Per row: the source, the stage values (encoder memory), the caches.
    state: BTreeMap<String, Tensor>,
    /// The sentence of each row of `state`. What is not a cache is the same for every
    /// row of a sentence, so a step whose rows continue the same sentences in the same
    /// places (beam search between two steps where no sentence ends) keeps it as it is.
    sentences: Vec<usize>,
    vocab: usize,
}

impl<'a> CachedStep<'a> {
    pub fn new(
        encode: &'a dyn Exec,
        step: &'a dyn Exec,
        params: &'a BTreeMap<String, Tensor>,
        vocab: usize,
    ) -> CachedStep<'a> {
        CachedStep {
            encode,
            step,
            params,
            // `params` is borrowed for the decoder's life: unchanged between its runs.
            opts: RunOptions {
                params_version: Some(crate::exec::fresh_params_version()),
                ..RunOptions::default()
            },
            state: BTreeMap::new(),
            sentences: Vec::new(),
            vocab,
        }
    }

    /// One step: the state's rows gathered in the order `parents`, the step run on the
    /// newest `tokens`, the grown caches kept as the next state. Returns the logits of
    /// the newest position, `rows × vocab`.
    fn step_logits(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
    ) -> Result<(Vec<f32>, usize), DecodeError> {
        use rayon::prelude::*;
        let rows = tokens.len();
        let layout = RowLayout::new(&self.sentences, parents)?;
        let tgt_in = Tensor::i32(vec![rows, 1], tokens.to_vec())
            .map_err(|e| DecodeError::Model(e.to_string()))?;
        let sentences = layout.sentences.clone();
        let keep = |k: &str, t: &Tensor| layout.stays(k, t.shape.first(), rows);
        // What must be reordered: the step reads some of it with its rows gathered (the
        // caches, which only its concatenations read), the rest is copied here.
        let step = self.step;
        let folded: std::collections::BTreeSet<String> = self
            .state
            .iter()
            .filter(|(k, t)| !keep(k, t) && step.folds_row_gather(k))
            .map(|(k, _)| k.clone())
            .collect();
        let mut inputs: BTreeMap<String, Tensor> = std::mem::take(&mut self.state)
            .into_par_iter()
            .map(|(k, t)| {
                if keep(&k, &t) || folded.contains(&k) {
                    (k, t)
                } else {
                    (k, take_rows(&t, parents))
                }
            })
            .collect();
        inputs.insert("tgt_in".to_string(), tgt_in);
        let out = self
            .step
            .run_map_gathered(&inputs, &folded, parents, self.params, &self.opts);
        inputs.remove("tgt_in");
        let mut out = match out {
            Ok(out) => out,
            Err(e) => {
                // The state as this step read it: the decoder stays usable.
                for k in &folded {
                    if let Some(t) = inputs.get_mut(k) {
                        *t = take_rows(t, parents);
                    }
                }
                self.state = inputs;
                self.sentences = sentences;
                return Err(e.into());
            }
        };
        let logits = logits_of(&mut out, rows);
        for (name, t) in out {
            if name.starts_with(kiln_compiler::ir::CACHE_PREFIX) {
                inputs.insert(name, t);
            }
        }
        self.state = inputs;
        self.sentences = sentences;
        let (logits, vocab) = logits?;
        self.vocab = vocab;
        Ok((logits, vocab))
    }
}

impl StepModel for CachedStep<'_> {
    fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
        let mut inputs = BTreeMap::new();
        inputs.insert("src".to_string(), src.clone());
        let stages = self.encode.run_map(&inputs, self.params, &self.opts)?;
        self.state = stages;
        self.state.insert("src".to_string(), src.clone());
        // Only what the step reads is kept (and reordered at every step): a step whose
        // per-sentence values `encode` computed (`static.…`) no longer reads the memory.
        let g = self.step.graph();
        self.state.retain(|name, _| g.input(name).is_some());
        self.sentences = (0..src.shape.first().copied().unwrap_or(0)).collect();
        // Empty caches: the decode graph's cache inputs with 0 past positions.
        let b = src.shape[0];
        for name in g.cache_outputs() {
            let id = g
                .input(&name)
                .ok_or_else(|| DecodeError::Model(format!("cache `{name}` has no input")))?;
            let ty = g.ty(id);
            let mut shape = Vec::new();
            for (i, d) in ty.shape.dims().iter().enumerate() {
                shape.push(match (i, d.as_const()) {
                    (0, _) => b,
                    (_, Some(c)) => c as usize,
                    _ => 0, // the `past` axis starts empty
                });
            }
            self.state.insert(
                name,
                Tensor::f32(shape, vec![]).map_err(|e| DecodeError::Model(e.to_string()))?,
            );
        }
        Ok(())
    }

    host_step_methods!();
}

/// [`CachedStep`] with the state on the GPU: the `decode_step` entry runs on a CUDA
/// executor, which holds the encoder's output, the source and the key/value caches
/// between steps. Each step uploads only the newest tokens, reorders the state's rows on
/// the device (`CudaExecutor::take_rows`), runs the step with that state bound in place
/// (`CudaExecutor::run_resident`, the grown caches kept on the device) and, in beam
/// search ([`StepModel::step_top`]), selects each row's best tokens on the device too
/// (`CudaExecutor::row_top_k`): `2·beam` tokens a row come back instead of the logits.
/// The same computation as [`CachedStep`] on the same executor (the log-softmax's sum in
/// another order: scores within rounding, the same tokens but for exact ties).
pub struct DeviceCachedStep<'a> {
    /// The encoder, the parameters, the run options and the vocabulary; its host state
    /// only between `start` and the upload.
    host: CachedStep<'a>,
    step: &'a crate::cuda::CudaExecutor,
    state: BTreeMap<String, crate::cuda::DeviceTensor>,
}

impl<'a> DeviceCachedStep<'a> {
    pub fn new(
        encode: &'a dyn Exec,
        step: &'a crate::cuda::CudaExecutor,
        params: &'a BTreeMap<String, Tensor>,
        vocab: usize,
    ) -> DeviceCachedStep<'a> {
        DeviceCachedStep {
            host: CachedStep::new(encode, step, params, vocab),
            step,
            state: BTreeMap::new(),
        }
    }

    /// One step on the device: the state's rows gathered in the order `parents`, the
    /// newest `tokens` uploaded, the grown caches kept on the device as the next state.
    /// Returns the outputs that came back and, with `keep_logits`, the logits left on
    /// the device instead.
    fn advance(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
        keep_logits: bool,
    ) -> Result<(BTreeMap<String, Tensor>, Option<crate::cuda::DeviceTensor>), DecodeError> {
        let rows = tokens.len();
        // What stays and what is gathered (on the device) as on the host.
        let layout = RowLayout::new(&self.host.sentences, parents)?;
        let (mut resident, moved): (BTreeMap<_, _>, BTreeMap<_, _>) =
            std::mem::take(&mut self.state)
                .into_iter()
                .partition(|(k, t)| layout.stays(k, t.shape.first(), rows));
        let names: Vec<String> = moved.keys().cloned().collect();
        let held: Vec<&crate::cuda::DeviceTensor> = moved.values().collect();
        if !held.is_empty() {
            let gathered = self.step.take_rows(&held, parents)?;
            resident.extend(names.into_iter().zip(gathered));
        }
        drop(moved);
        self.host.sentences = layout.sentences;
        let mut inputs = BTreeMap::new();
        inputs.insert(
            "tgt_in".to_string(),
            Tensor::i32(vec![rows, 1], tokens.to_vec())
                .map_err(|e| DecodeError::Model(e.to_string()))?,
        );
        let keep = |name: &str| {
            name.starts_with(kiln_compiler::ir::CACHE_PREFIX) || (keep_logits && name == "logits")
        };
        let (out, mut kept) =
            self.step
                .run_resident(&inputs, &resident, self.host.params, &self.host.opts, &keep)?;
        let logits = kept.remove("logits");
        resident.extend(kept);
        self.state = resident;
        Ok((out.into_iter().collect(), logits))
    }
}

impl StepModel for DeviceCachedStep<'_> {
    fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
        self.host.start(src)?;
        let host = std::mem::take(&mut self.host.state);
        self.state = host
            .iter()
            .map(|(k, t)| Ok((k.clone(), self.step.to_device(t)?)))
            .collect::<Result<_, DecodeError>>()?;
        Ok(())
    }

    fn step(&mut self, tokens: &[i32], parents: &[usize]) -> Result<Vec<f64>, DecodeError> {
        let (mut out, _) = self.advance(tokens, parents, false)?;
        let (logits, vocab) = logits_of(&mut out, tokens.len())?;
        self.host.vocab = vocab;
        Ok(log_softmax_rows(&logits, vocab))
    }

    /// The step with its logits left on the GPU: the best tokens of each row are
    /// selected there (`CudaExecutor::row_top_k`), so only `k` tokens a row come back.
    fn step_top(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
        spec: &TopSpec<'_>,
    ) -> Result<Vec<RowTop>, DecodeError> {
        let (_, logits) = self.advance(tokens, parents, true)?;
        let logits = logits
            .ok_or_else(|| DecodeError::Model("the model has no `logits` output".to_string()))?;
        match logits.shape[..] {
            [r, _, vocab] if r == tokens.len() => self.host.vocab = vocab,
            _ => {
                return Err(DecodeError::Model(format!(
                    "logits have shape {:?}, expected [{}, len, vocab]",
                    logits.shape,
                    tokens.len()
                )))
            }
        }
        let top = self
            .step
            .row_top_k(&logits, spec.k, spec.banned, spec.eos)?;
        Ok((0..tokens.len())
            .map(|r| RowTop {
                best: (0..top.k)
                    .map(|j| (top.vals[r * top.k + j], top.ids[r * top.k + j]))
                    .take_while(|&(_, id)| id >= 0)
                    .collect(),
                eos: top.eos[r],
            })
            .collect())
    }

    fn vocab(&self) -> usize {
        self.host.vocab
    }
}

/// The cached decoder for `encode` and `step`: [`DeviceCachedStep`] when `step` is a
/// CUDA executor (the state stays on the GPU), [`CachedStep`] otherwise.
pub fn cached_step<'a>(
    encode: &'a dyn Exec,
    step: &'a dyn Exec,
    params: &'a BTreeMap<String, Tensor>,
    vocab: usize,
) -> Box<dyn StepModel + 'a> {
    cached_step_with_version(
        encode,
        step,
        params,
        vocab,
        crate::exec::fresh_params_version(),
    )
}

/// [`cached_step`] for decoders that run at once on the same `params` (decoding
/// workers): they promise the same parameters `version`, so the programs' copies derived
/// from the parameters are made once and serve them all.
pub fn cached_step_with_version<'a>(
    encode: &'a dyn Exec,
    step: &'a dyn Exec,
    params: &'a BTreeMap<String, Tensor>,
    vocab: usize,
    version: u64,
) -> Box<dyn StepModel + 'a> {
    match step.as_cuda() {
        Some(cuda) => Box::new(DeviceCachedStep::new(encode, cuda, params, vocab)),
        None => {
            let mut m = CachedStep::new(encode, step, params, vocab);
            m.opts.params_version = Some(version);
            Box::new(m)
        }
    }
}

/// Decoding by running the `forward` entry on the whole prefix at every step.
pub struct FullStep<'a> {
    forward: &'a dyn Exec,
    params: &'a BTreeMap<String, Tensor>,
    src: Option<Tensor>,
    prefixes: Vec<Vec<i32>>,
    src_rows: Vec<usize>,
    vocab: usize,
}

impl<'a> FullStep<'a> {
    pub fn new(
        forward: &'a dyn Exec,
        params: &'a BTreeMap<String, Tensor>,
        vocab: usize,
    ) -> FullStep<'a> {
        FullStep {
            forward,
            params,
            src: None,
            prefixes: vec![],
            src_rows: vec![],
            vocab,
        }
    }

    /// One step on the whole prefix of every row: the logits of its newest position.
    fn step_logits(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
    ) -> Result<(Vec<f32>, usize), DecodeError> {
        let rows = tokens.len();
        let mut prefixes = Vec::with_capacity(rows);
        let mut src_rows = Vec::with_capacity(rows);
        for (r, &p) in parents.iter().enumerate() {
            let mut pre = self.prefixes[p].clone();
            pre.push(tokens[r]);
            prefixes.push(pre);
            src_rows.push(self.src_rows[p]);
        }
        let len = prefixes.first().map(|p| p.len()).unwrap_or(0);
        let flat: Vec<i32> = prefixes.concat();
        let src = self
            .src
            .as_ref()
            .ok_or_else(|| DecodeError::Model("step before start".to_string()))?;
        let mut inputs = BTreeMap::new();
        inputs.insert("src".to_string(), take_rows(src, &src_rows));
        inputs.insert(
            "tgt_in".to_string(),
            Tensor::i32(vec![rows, len], flat).map_err(|e| DecodeError::Model(e.to_string()))?,
        );
        let mut out = self
            .forward
            .run_map(&inputs, self.params, &RunOptions::default())?;
        let (logits, vocab) = logits_of(&mut out, rows)?;
        self.prefixes = prefixes;
        self.src_rows = src_rows;
        self.vocab = vocab;
        Ok((logits, vocab))
    }
}

impl StepModel for FullStep<'_> {
    fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
        self.src = Some(src.clone());
        self.prefixes = vec![vec![]; src.shape[0]];
        self.src_rows = (0..src.shape[0]).collect();
        Ok(())
    }

    host_step_methods!();
}

/// The number of non-pad tokens of each row of `src`.
fn source_lengths(src: &Tensor, pad: i32) -> Result<Vec<usize>, DecodeError> {
    let ids: Vec<i64> = match &src.data {
        TensorData::I32(v) => v.iter().map(|&x| x as i64).collect(),
        TensorData::I64(v) => v.clone(),
        _ => {
            return Err(DecodeError::Model(
                "source ids must be integers".to_string(),
            ))
        }
    };
    let s = if src.shape.len() == 2 {
        src.shape[1]
    } else {
        0
    };
    Ok(ids
        .chunks(s.max(1))
        .take(src.shape.first().copied().unwrap_or(0))
        .map(|row| row.iter().filter(|&&x| x != pad as i64).count())
        .collect())
}

/// The log-probability the model gives each reference translation under teacher
/// forcing: Σₜ log p(refₜ | ref₍<ₜ₎, src) over the reference's tokens and the final
/// `<eos>`, what fairseq's `--score-reference` and `marian-scorer` compute. `refs[i]`
/// (token ids, without `<bos>` and `<eos>`) is the reference of row `i` of `src`
/// (`[B, S]`, right-padded). The rows are fed through the same cached steps as beam
/// search, so a hypothesis that search found scores its reported log-probability.
pub fn score(
    model: &mut dyn StepModel,
    src: &Tensor,
    refs: &[Vec<i32>],
    opts: &DecodeOptions,
) -> Result<Vec<f64>, DecodeError> {
    let b = source_lengths(src, opts.pad)?.len();
    if refs.len() != b {
        return Err(DecodeError::Model(format!(
            "{} references for {b} source sentences",
            refs.len()
        )));
    }
    model.start(src)?;
    let v = model.vocab();
    let mut total = vec![0.0f64; b];
    // The sentence each row scores; at the first step a row continues its sentence.
    let mut rows: Vec<usize> = (0..b).collect();
    let mut parents: Vec<usize> = (0..b).collect();
    let mut t = 0usize;
    while !rows.is_empty() {
        let tokens: Vec<i32> = rows
            .iter()
            .map(|&s| if t == 0 { opts.bos } else { refs[s][t - 1] })
            .collect();
        let logp = model.step(&tokens, &parents)?;
        if logp.len() != rows.len() * v {
            return Err(DecodeError::Model(format!(
                "the step model returned {} scores for {} rows of vocabulary {v}",
                logp.len(),
                rows.len()
            )));
        }
        let (mut next_rows, mut next_parents) = (Vec::new(), Vec::new());
        for (r, &s) in rows.iter().enumerate() {
            let target = refs[s].get(t).copied().unwrap_or(opts.eos);
            let Some(col) = usize::try_from(target).ok().filter(|&c| c < v) else {
                return Err(DecodeError::Model(format!(
                    "reference {s} has token id {target} at position {t}, outside the \
                     vocabulary of {v}"
                )));
            };
            total[s] += logp[r * v + col];
            if t < refs[s].len() {
                next_rows.push(s);
                next_parents.push(r);
            }
        }
        rows = next_rows;
        parents = next_parents;
        t += 1;
    }
    Ok(total)
}

#[derive(Clone, Debug)]
struct Live {
    tokens: Vec<i32>,
    log_prob: f64,
    row: usize,
}

/// Decodes every sentence of `src` (`[B, S]`, right-padded): each one's best hypothesis
/// (an empty one scored −∞ if none finished).
pub fn decode(
    model: &mut dyn StepModel,
    src: &Tensor,
    opts: &DecodeOptions,
) -> Result<Vec<Hypothesis>, DecodeError> {
    Ok(decode_nbest(model, src, opts, 1)?
        .into_iter()
        .map(|f| {
            f.into_iter().next().unwrap_or(Hypothesis {
                tokens: vec![],
                score: f64::NEG_INFINITY,
                log_prob: f64::NEG_INFINITY,
            })
        })
        .collect())
}

/// [`decode`], keeping each sentence's `n` best finished hypotheses, best first (as
/// fairseq's and Marian's `--nbest`). The beam holds at most `beam` finished hypotheses
/// (1 when greedy), so `n` must not exceed that; a sentence may end with fewer.
pub fn decode_nbest(
    model: &mut dyn StepModel,
    src: &Tensor,
    opts: &DecodeOptions,
    n: usize,
) -> Result<Vec<Vec<Hypothesis>>, DecodeError> {
    if opts.beam == 0 || opts.beam > MAX_BEAM {
        return Err(DecodeError::Model(format!(
            "the beam size must be 1 to {MAX_BEAM}, not {}",
            opts.beam
        )));
    }
    let keep = if opts.greedy { 1 } else { opts.beam };
    if n == 0 || n > keep {
        return Err(DecodeError::Model(format!(
            "cannot keep the {n} best hypotheses of a {}: it finds at most {keep}; \
             ask for 1 to {keep}{}",
            if opts.greedy {
                "greedy search".to_string()
            } else {
                format!("beam of {}", opts.beam)
            },
            if opts.greedy {
                ""
            } else {
                ", or widen the beam"
            }
        )));
    }
    let lens = source_lengths(src, opts.pad)?;
    let b = lens.len();
    let max_len: Vec<usize> = lens
        .iter()
        .map(|&l| {
            // `as` saturates: a huge `max_len_a` gives usize::MAX, then the cap.
            let len = ((opts.max_len_a * l as f64).floor() as usize).saturating_add(opts.max_len_b);
            // Step `i` (1-based) reads position `i − 1`; `<eos>` is forced at step
            // `max_len`, so positions 0 .. max_len − 1 are read.
            let cap = opts.max_positions.unwrap_or(usize::MAX);
            len.max(1).min(cap)
        })
        .collect();
    // A step holds every live row's log-probabilities over the vocabulary (f64) and the
    // model's logits (f32): refused up front where that cannot fit, not by an abort.
    let rows = (b as u64).saturating_mul(keep as u64);
    let need = rows.saturating_mul(model.vocab() as u64).saturating_mul(12);
    kiln_compiler::memory::ensure(
        need,
        || {
            format!(
                "a beam of {keep} over {b} sentence(s) and a vocabulary of {}",
                model.vocab()
            )
        },
        || "use a smaller --beam or --batch".to_string(),
    )
    .map_err(|e| DecodeError::Model(e.to_string()))?;
    model.start(src)?;
    let k = if opts.greedy { 1 } else { opts.beam };
    // Live hypotheses per sentence; all start from <bos>, continuing sentence row i.
    let mut live: Vec<Vec<Live>> = (0..b)
        .map(|i| {
            vec![Live {
                tokens: vec![],
                log_prob: 0.0,
                row: i,
            }]
        })
        .collect();
    let mut finished: Vec<Vec<Hypothesis>> = vec![vec![]; b];
    let mut done = vec![b == 0; b];
    let mut step = 0usize;
    while done.iter().any(|d| !d) {
        // Rows of this step: the live hypotheses of unfinished sentences.
        let mut tokens = Vec::new();
        let mut parents = Vec::new();
        let mut owner = Vec::new();
        for (s, hyps) in live.iter().enumerate() {
            if done[s] {
                continue;
            }
            for (h, hyp) in hyps.iter().enumerate() {
                tokens.push(*hyp.tokens.last().unwrap_or(&opts.bos));
                parents.push(hyp.row);
                owner.push((s, h));
            }
        }
        // Each sentence's best 2K candidates are among its rows' best 2K each (a row's
        // candidates share its hypothesis score), so the model reports only those.
        let spec = TopSpec {
            k: 2 * k,
            banned: &[opts.pad, opts.bos],
            eos: opts.eos,
        };
        let tops = model.step_top(&tokens, &parents, &spec)?;
        if tops.len() != tokens.len() {
            return Err(DecodeError::Model(format!(
                "the step model returned {} rows for {}",
                tops.len(),
                tokens.len()
            )));
        }
        step += 1;
        let mut next: Vec<Vec<Live>> = vec![vec![]; b];
        let mut r = 0;
        for s in 0..b {
            if done[s] {
                continue;
            }
            let hyps = &live[s];
            let first = r;
            r += hyps.len();
            let force_end = step >= max_len[s];
            // Candidates (score, hyp index, token), best first; ties by hyp then token.
            let mut cands: Vec<(f64, usize, i32)> = Vec::with_capacity(hyps.len() * 2 * k);
            for (h, hyp) in hyps.iter().enumerate() {
                let top = &tops[first + h];
                if force_end {
                    cands.push((hyp.log_prob + top.eos, h, opts.eos));
                } else {
                    for &(lp, tok) in &top.best {
                        cands.push((hyp.log_prob + lp, h, tok));
                    }
                }
            }
            // Only the best 2K candidates matter: select them (linear time), then sort
            // those. The order is total, so this is the full sort's prefix exactly.
            let better = |a: &(f64, usize, i32), b: &(f64, usize, i32)| {
                b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))
            };
            if cands.len() > 2 * k {
                cands.select_nth_unstable_by(2 * k - 1, better);
                cands.truncate(2 * k);
            }
            cands.sort_by(better);
            for (rank, &(score, h, tok)) in cands.iter().take(2 * k).enumerate() {
                if tok == opts.eos {
                    // A finished hypothesis counts only from the top K candidates.
                    if rank < k {
                        let mut tokens = hyps[h].tokens.clone();
                        let len = tokens.len() + 1;
                        tokens.shrink_to_fit();
                        finished[s].push(Hypothesis {
                            tokens,
                            score: score / opts.penalty.divisor(len),
                            log_prob: score,
                        });
                    }
                } else if next[s].len() < k {
                    let mut tokens = hyps[h].tokens.clone();
                    tokens.push(tok);
                    next[s].push(Live {
                        tokens,
                        log_prob: score,
                        row: first + h,
                    });
                }
                if opts.greedy && (!finished[s].is_empty() || !next[s].is_empty()) {
                    break;
                }
            }
            finished[s].sort_by(|a, b| b.score.total_cmp(&a.score));
            finished[s].truncate(k);
            // Stop when nothing live can still beat the K finished hypotheses.
            let full = finished[s].len() >= k;
            let worst = finished[s]
                .last()
                .map(|h| h.score)
                .unwrap_or(f64::NEG_INFINITY);
            let can_improve = next[s].iter().any(|hyp| {
                // Log-probabilities only fall; a growing penalty divides by at most
                // lp(max_len), so this bounds the final normalized score.
                let bound = if opts.penalty.grows() {
                    hyp.log_prob / opts.penalty.divisor(max_len[s])
                } else {
                    hyp.log_prob / opts.penalty.divisor(hyp.tokens.len() + 1)
                };
                bound > worst
            });
            if force_end
                || next[s].is_empty()
                || (full && !can_improve)
                || (opts.greedy && !finished[s].is_empty())
            {
                done[s] = true;
                next[s].clear();
            }
        }
        live = next;
    }
    Ok(finished
        .into_iter()
        .map(|mut f| {
            f.sort_by(|a, b| b.score.total_cmp(&a.score));
            f.truncate(n);
            f
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed-table step model: the log-probs of the next token depend only on the
    /// previous token, so the best paths can be worked out by hand.
    struct Table {
        rows: Vec<i32>,
        table: BTreeMap<i32, Vec<f64>>,
    }

    impl StepModel for Table {
        fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
            self.rows = vec![0; src.shape[0]];
            Ok(())
        }
        fn step(&mut self, tokens: &[i32], _parents: &[usize]) -> Result<Vec<f64>, DecodeError> {
            let mut out = Vec::new();
            for t in tokens {
                out.extend(self.table[t].iter().copied());
            }
            Ok(out)
        }
        fn vocab(&self) -> usize {
            5
        }
    }

    fn probs(p: [f64; 5]) -> Vec<f64> {
        p.iter()
            .map(|x| if *x == 0.0 { -1e9 } else { x.ln() })
            .collect()
    }

    /// Tokens: 0 pad, 1 bos, 2 eos, 3 "a", 4 "b". After bos: a 0.6, b 0.4. After a: eos
    /// 0.3, a 0.35, b 0.35. After b: eos 0.9, a 0.05, b 0.05.
    fn two_paths() -> Table {
        let mut table = BTreeMap::new();
        table.insert(1, probs([0.0, 0.0, 0.0, 0.6, 0.4]));
        table.insert(3, probs([0.0, 0.0, 0.3, 0.35, 0.35]));
        table.insert(4, probs([0.0, 0.0, 0.9, 0.05, 0.05]));
        Table {
            rows: vec![],
            table,
        }
    }

    #[test]
    fn beam_finds_a_better_path_than_greedy() {
        let mut m = two_paths();
        let src = Tensor::i32(vec![1, 3], vec![5, 6, 7]).unwrap();
        let greedy = DecodeOptions {
            greedy: true,
            beam: 1,
            penalty: LengthPenalty::None,
            ..DecodeOptions::default()
        };
        let g = decode(&mut m, &src, &greedy).unwrap();
        // Greedy: a (0.6), then a (0.35) beats eos (0.3)... follows a forever until the
        // max length of 3 + 50 forces eos; so greedy is long.
        assert_eq!(g[0].tokens[0], 3);
        assert!(g[0].tokens.len() > 2);
        let beam = DecodeOptions {
            beam: 2,
            penalty: LengthPenalty::None,
            ..DecodeOptions::default()
        };
        let r = decode(&mut m, &src, &beam).unwrap();
        // Beam 2: "b eos" = 0.4 * 0.9 = 0.36 beats "a eos" = 0.18 and every longer path.
        assert_eq!(r[0].tokens, vec![4]);
        assert!((r[0].log_prob - (0.36f64).ln()).abs() < 1e-12);
    }

    /// A model's maximum positions cap the output, even when `max_len_a` is so large
    /// that the search could never prove it is done: the step at position
    /// `max_positions − 1` forces `<eos>`, and no later position is read.
    #[test]
    fn max_positions_cap_the_output_length() {
        struct Counting(Table, usize);
        impl StepModel for Counting {
            fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
                self.1 = 0;
                self.0.start(src)
            }
            fn step(&mut self, tokens: &[i32], parents: &[usize]) -> Result<Vec<f64>, DecodeError> {
                self.1 += 1;
                self.0.step(tokens, parents)
            }
            fn vocab(&self) -> usize {
                self.0.vocab()
            }
        }
        let src = Tensor::i32(vec![1, 3], vec![5, 6, 7]).unwrap();
        for (greedy, beam) in [(true, 1), (false, 2)] {
            let mut m = Counting(two_paths(), 0);
            let opts = DecodeOptions {
                greedy,
                beam,
                // Greedy follows "a" (0.35 against <eos>'s 0.3) to the cap. The beam
                // with a strong length penalty keeps looking for longer paths.
                penalty: if greedy {
                    LengthPenalty::None
                } else {
                    LengthPenalty::Gnmt(5.0)
                },
                max_len_a: 1e300,
                max_positions: Some(6),
                ..DecodeOptions::default()
            };
            let r = decode(&mut m, &src, &opts).unwrap();
            // Positions 0 (<bos>) to 5 were read: six steps, at most five tokens.
            assert!(m.1 <= 6, "greedy {greedy}: {} steps", m.1);
            assert!(r[0].tokens.len() <= 5, "greedy {greedy}: {:?}", r[0].tokens);
            if greedy {
                assert_eq!(r[0].tokens, vec![3; 5]);
                assert_eq!(m.1, 6);
            }
        }
    }

    /// The n best of a beam, worked out by hand on the table of [`two_paths`]: with beam
    /// 2, "b eos" (0.4 · 0.9 = 0.36) finishes at step 2 and "a b eos" (0.6 · 0.35 · 0.9
    /// = 0.189) at step 3, when no live hypothesis (at most 0.6 · 0.35 · 0.35 = 0.0735)
    /// can beat either.
    #[test]
    fn nbest_keeps_the_finished_hypotheses_best_first() {
        let mut m = two_paths();
        let src = Tensor::i32(vec![2, 3], vec![5, 6, 7, 5, 0, 0]).unwrap();
        let beam = DecodeOptions {
            beam: 2,
            penalty: LengthPenalty::None,
            ..DecodeOptions::default()
        };
        let all = decode_nbest(&mut m, &src, &beam, 2).unwrap();
        assert_eq!(all.len(), 2);
        for hyps in &all {
            let got: Vec<(Vec<i32>, f64)> = hyps
                .iter()
                .map(|h| (h.tokens.clone(), h.log_prob))
                .collect();
            assert_eq!(got.len(), 2);
            assert_eq!(got[0].0, vec![4]);
            assert!((got[0].1 - 0.36f64.ln()).abs() < 1e-12);
            assert_eq!(got[1].0, vec![3, 4]);
            assert!((got[1].1 - 0.189f64.ln()).abs() < 1e-12);
        }
        // The first of the n best is decode's hypothesis, score and all.
        let one = decode(&mut m, &src, &beam).unwrap();
        assert_eq!(one[0], all[0][0]);
        let first = decode_nbest(&mut m, &src, &beam, 1).unwrap();
        assert_eq!(first[1], vec![all[1][0].clone()]);
        // With the GNMT penalty each score is its log-probability divided by
        // ((5 + len) / 6)^0.6, len counting <eos>, and the list is sorted by score.
        let gnmt = DecodeOptions {
            beam: 2,
            ..DecodeOptions::default()
        };
        let g = decode_nbest(&mut m, &src, &gnmt, 2).unwrap();
        let div = |len: f64| ((5.0 + len) / 6.0f64).powf(0.6);
        assert!(g[0][0].score >= g[0][1].score);
        for h in &g[0] {
            let len = h.tokens.len() as f64 + 1.0;
            assert!((h.score - h.log_prob / div(len)).abs() < 1e-12);
        }

        for (opts, n, want) in [
            (&beam, 3, "cannot keep the 3 best hypotheses of a beam of 2: it finds at most 2; ask for 1 to 2, or widen the beam"),
            (&beam, 0, "cannot keep the 0 best hypotheses of a beam of 2"),
            (
                &DecodeOptions {
                    greedy: true,
                    ..DecodeOptions::default()
                },
                2,
                "cannot keep the 2 best hypotheses of a greedy search: it finds at most 1; ask for 1 to 1",
            ),
        ] {
            let err = decode_nbest(&mut m, &src, opts, n).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    /// Teacher-forced scores, by hand on the table of [`two_paths`]; a hypothesis of beam search scores the
    /// log-probability the search reported.
    #[test]
    fn score_sums_the_log_probabilities_of_the_reference_and_eos() {
        let mut m = two_paths();
        let src = Tensor::i32(vec![3, 2], vec![5, 6, 5, 0, 7, 8]).unwrap();
        let opts = DecodeOptions::default();
        let refs = vec![vec![3, 3, 4], vec![], vec![4]];
        let got = score(&mut m, &src, &refs, &opts).unwrap();
        assert!(
            (got[0] - (0.6f64 * 0.35 * 0.35 * 0.9).ln()).abs() < 1e-12,
            "{got:?}"
        );
        // <eos> straight after <bos> has probability 0 in the table (log -1e9).
        assert_eq!(got[1], -1e9);
        assert!((got[2] - (0.4f64 * 0.9).ln()).abs() < 1e-12, "{got:?}");
        let beam = DecodeOptions {
            beam: 2,
            ..DecodeOptions::default()
        };
        let best = decode_nbest(&mut m, &src, &beam, 2).unwrap();
        for (i, hyps) in best.iter().enumerate() {
            for h in hyps {
                let mut one = src.clone();
                one.shape = vec![1, 2];
                let row = match &src.data {
                    TensorData::I32(v) => v[2 * i..2 * i + 2].to_vec(),
                    _ => unreachable!(),
                };
                one.data = TensorData::I32(row);
                let s = score(&mut m, &one, std::slice::from_ref(&h.tokens), &opts).unwrap();
                assert!((s[0] - h.log_prob).abs() < 1e-12);
            }
        }
        let err = score(&mut m, &src, &refs[..2], &opts).unwrap_err();
        assert!(err
            .to_string()
            .contains("2 references for 3 source sentences"));
        let bad = vec![vec![3], vec![9], vec![]];
        let err = score(&mut m, &src, &bad, &opts).unwrap_err();
        assert!(
            err.to_string()
                .contains("reference 1 has token id 9 at position 0, outside the vocabulary of 5"),
            "{err}"
        );
    }

    #[test]
    fn length_penalties() {
        assert_eq!(LengthPenalty::None.divisor(7), 1.0);
        assert!((LengthPenalty::Gnmt(0.6).divisor(1) - 1.0).abs() < 1e-15);
        assert!((LengthPenalty::Gnmt(0.6).divisor(7) - 2.0f64.powf(0.6)).abs() < 1e-15);
        assert!((LengthPenalty::LenPow(0.5).divisor(9) - 3.0).abs() < 1e-15);
    }

    /// `row_top` is the prefix of the full ranking (larger first, ties to the smaller
    /// token) without NaN and banned tokens, whatever `k`.
    #[test]
    fn row_top_is_the_prefix_of_the_full_ranking() {
        let row = [
            -1.0,
            -0.5,
            f64::NAN,
            -0.5,
            -3.0,
            f64::NEG_INFINITY,
            -0.25,
            -0.5,
        ];
        let spec = |k| TopSpec {
            k,
            banned: &[6],
            eos: 4,
        };
        let full: Vec<(f64, i32)> = vec![
            (-0.5, 1),
            (-0.5, 3),
            (-0.5, 7),
            (-1.0, 0),
            (-3.0, 4),
            (f64::NEG_INFINITY, 5),
        ];
        for k in 0..9 {
            let t = row_top(&row, &spec(k));
            assert_eq!(t.best, full[..k.min(full.len())], "k = {k}");
            assert_eq!(t.eos, -3.0);
        }
        let outside = TopSpec {
            k: 1,
            banned: &[],
            eos: 99,
        };
        assert_eq!(row_top(&row, &outside).eos, f64::NEG_INFINITY);
        // A NaN logit leaves the other log-probabilities finite.
        let lp = log_softmax_rows(&[0.0, f32::NAN, 0.0], 3);
        assert!(
            (lp[0] - (0.5f64).ln()).abs() < 1e-15 && lp[1].is_nan(),
            "{lp:?}"
        );
    }

    /// Beam search over each row's best `2·beam` tokens decodes exactly as over every
    /// token: a model reporting whole rows (`k` ignored) gives the same hypotheses on
    /// random tables, every beam size, greedy included.
    #[test]
    fn the_best_two_beam_tokens_of_each_row_decode_as_all_tokens() {
        struct Whole(Random);
        impl StepModel for Whole {
            fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
                self.0.start(src)
            }
            fn step(&mut self, t: &[i32], p: &[usize]) -> Result<Vec<f64>, DecodeError> {
                self.0.step(t, p)
            }
            fn vocab(&self) -> usize {
                self.0.vocab()
            }
            fn step_top(
                &mut self,
                t: &[i32],
                p: &[usize],
                spec: &TopSpec<'_>,
            ) -> Result<Vec<RowTop>, DecodeError> {
                let all = TopSpec {
                    k: self.vocab(),
                    ..*spec
                };
                let logp = self.step(t, p)?;
                Ok(logp
                    .chunks(self.vocab())
                    .map(|r| row_top(r, &all))
                    .collect())
            }
        }
        /// Log-probabilities that depend on the previous token and the step.
        struct Random {
            v: usize,
            seed: u64,
            calls: u64,
        }
        impl StepModel for Random {
            fn start(&mut self, _src: &Tensor) -> Result<(), DecodeError> {
                self.calls = 0;
                Ok(())
            }
            fn step(&mut self, tokens: &[i32], _p: &[usize]) -> Result<Vec<f64>, DecodeError> {
                self.calls += 1;
                let mut out = Vec::new();
                for &t in tokens {
                    let mut x = (t as u64 + 1) * 0x9e37_79b9
                        + self.calls * 0x85eb_ca6b
                        + self.seed * 0xc2b2_ae35;
                    let mut logits: Vec<f32> = (0..self.v)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            // Coarse values: ties happen.
                            ((x % 16) as f32) / 4.0
                        })
                        .collect();
                    // The end of sentence grows likelier step by step (and with the token).
                    logits[2] = self.calls as f32 * 0.75 - 1.5 + (t % 3) as f32 * 0.5;
                    out.extend(log_softmax_rows(&logits, self.v));
                }
                Ok(out)
            }
            fn vocab(&self) -> usize {
                self.v
            }
        }
        let src = Tensor::i32(vec![3, 4], vec![5, 6, 7, 8, 9, 10, 0, 0, 11, 0, 0, 0]).unwrap();
        for seed in 0..40 {
            for v in [5usize, 12, 40] {
                for (beam, greedy) in [(1, true), (1, false), (2, false), (4, false), (6, false)] {
                    let opts = DecodeOptions {
                        beam,
                        greedy,
                        max_len_b: 6,
                        ..DecodeOptions::default()
                    };
                    let mut top = Random { v, seed, calls: 0 };
                    let mut whole = Whole(Random { v, seed, calls: 0 });
                    let a = decode(&mut top, &src, &opts).unwrap();
                    let b = decode(&mut whole, &src, &opts).unwrap();
                    assert_eq!(a, b, "seed {seed}, vocab {v}, beam {beam}, greedy {greedy}");
                }
            }
        }
    }

    #[test]
    fn rows_top_is_row_top_of_the_log_softmax_bit_for_bit() {
        // Ties, NaN, infinities, banned tokens, k of 0, k past the vocabulary, and rows
        // of one value.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for case in 0..300 {
            // Every third row past the blocks of sixteen that the pass can skip whole.
            let v = if case % 3 == 0 {
                100 + (next() % 400) as usize
            } else {
                1 + (next() % 40) as usize
            };
            let rows = 1 + (next() % 5) as usize;
            let logits: Vec<f32> = (0..rows * v)
                .map(|_| match next() % 23 {
                    0 => f32::NAN,
                    1 if case % 7 == 0 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    3..=6 => 0.5, // ties
                    r => (r as f32 - 12.0) * 0.37 + (next() % 1000) as f32 * 1e-3,
                })
                .collect();
            let banned = [(next() % v as u64) as i32, 0];
            let spec = TopSpec {
                k: if case % 3 == 0 {
                    (next() % 9) as usize
                } else {
                    (next() % (v as u64 + 3)) as usize
                },
                banned: &banned,
                eos: (next() % (v as u64 + 2)) as i32 - 1,
            };
            let want: Vec<RowTop> = log_softmax_rows(&logits, v)
                .chunks(v)
                .map(|r| row_top(r, &spec))
                .collect();
            let got = rows_top(&logits, v, &spec);
            assert_eq!(got.len(), want.len(), "case {case}");
            for (g, w) in got.iter().zip(&want) {
                let bits = |r: &RowTop| {
                    let best: Vec<(u64, i32)> =
                        r.best.iter().map(|&(lp, t)| (lp.to_bits(), t)).collect();
                    (best, r.eos.to_bits())
                };
                assert_eq!(bits(g), bits(w), "case {case}: {logits:?} {spec:?}");
            }
        }
        assert!(rows_top(
            &[],
            0,
            &TopSpec {
                k: 2,
                banned: &[],
                eos: 0
            }
        )
        .is_empty());
    }

    #[test]
    fn exp_without_libm_is_within_a_few_ulp_of_libm() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let d = -708.0 * (i as f64 / 200_000.0).powi(3);
            let (got, want) = (exp_nonpositive(d), d.exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 4.0 * f64::EPSILON, "relative error {worst:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        assert!(exp_nonpositive(f64::NAN).is_nan());
        let tiny = exp_nonpositive(f64::NEG_INFINITY);
        assert!(tiny > 0.0 && tiny < 1e-307, "{tiny:e}");
        // A row's log-sum-exp against the libm one, and a NaN logit left out.
        let row: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.3)
            .collect();
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
        let want = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        assert!(
            (row_lse(&row) - want).abs() < 1e-13,
            "{} vs {want}",
            row_lse(&row)
        );
        // Every instruction set gives the same bits (fused multiply-adds on each: the
        // plain loop's are libm's `fma`).
        for len in [1, 7, 8, 9, 1000] {
            let r = &row[..len];
            let plain = row_lse_lanes(r).to_bits();
            assert_eq!(row_lse(r).to_bits(), plain, "length {len}");
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU has AVX2 and FMA.
                assert_eq!(unsafe { row_lse_avx2(r) }.to_bits(), plain, "length {len}");
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU has AVX-512F and FMA.
                assert_eq!(
                    unsafe { row_lse_avx512(r) }.to_bits(),
                    plain,
                    "length {len}"
                );
            }
        }
        let mut with_nan = row.clone();
        with_nan.push(f32::NAN);
        assert_eq!(row_lse(&with_nan).to_bits(), row_lse(&row).to_bits());
    }

    #[test]
    fn take_rows_reorders_and_repeats() {
        let t = Tensor::f32(vec![3, 2], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        let r = take_rows(&t, &[2, 0, 2]);
        assert_eq!(r.shape, vec![3, 2]);
        assert_eq!(r.as_f32().unwrap(), &[4.0, 5.0, 0.0, 1.0, 4.0, 5.0]);
        let empty = Tensor::f32(vec![2, 0], vec![]).unwrap();
        assert_eq!(take_rows(&empty, &[1, 1, 0]).shape, vec![3, 0]);
    }
}
