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
//! Beam search as fairseq's: beam size K, scores are summed log-probabilities, `K` best
//! non-final continuations kept out of the `2K` best candidates, a hypothesis finishes
//! when it emits `<eos>` among the top `K` (its score is divided by the length penalty),
//! every hypothesis is forced to finish at the maximum length `a · src_len + b`. A
//! sentence stops once `K` hypotheses have finished ([`EarlyStop::KFinished`], fairseq's
//! and CTranslate2's rule), or — [`EarlyStop::Exact`] — only once no live hypothesis can
//! beat its `K` finished ones. Ties are broken by hypothesis order, then token id, so
//! results are deterministic.

use kiln_compiler::ir::Graph;
use kiln_compiler::reference::ExecError;
use kiln_compiler::tensor::{Tensor, TensorData};

mod steps;
mod top;

pub use steps::*;
pub use top::*;

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

/// When beam search is done with a sentence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EarlyStop {
    /// Once `K` hypotheses have finished (fairseq's and CTranslate2's rule): a live one
    /// could still end with a better normalized score, but rarely does.
    #[default]
    KFinished,
    /// Once no live hypothesis can beat the `K`-th finished one, its final score bounded
    /// by the length penalty at the maximum length: the search's own best, at the cost of
    /// the steps it takes to prove it.
    Exact,
}

impl EarlyStop {
    /// The names the command line and the configuration use.
    pub const NAMES: [&'static str; 2] = ["k-finished", "exact"];

    pub fn parse(name: &str) -> Option<EarlyStop> {
        match name {
            "k-finished" => Some(EarlyStop::KFinished),
            "exact" => Some(EarlyStop::Exact),
            _ => None,
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
    /// When a sentence's search stops (beam search only).
    pub early_stop: EarlyStop,
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
    /// The unknown token's id, never emitted unless `allow_unk` (Marian's `--allow-unk`):
    /// a translation should not lose a word to it.
    pub unk: i32,
    pub allow_unk: bool,
}

impl Default for DecodeOptions {
    /// The paper's settings: beam 4, α = 0.6 (GNMT penalty), max length src + 50.
    fn default() -> DecodeOptions {
        DecodeOptions {
            beam: 4,
            greedy: false,
            penalty: LengthPenalty::Gnmt(0.6),
            early_stop: EarlyStop::KFinished,
            max_len_a: 1.0,
            max_len_b: 50,
            max_positions: None,
            bos: 1,
            eos: 2,
            pad: 0,
            unk: 3,
            allow_unk: false,
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
    let keep = check_request(opts, n)?;
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
    let banned: &[i32] = if opts.allow_unk {
        &[opts.pad, opts.bos]
    } else {
        &[opts.pad, opts.bos, opts.unk]
    };
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
            banned,
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
            let rows = &tops[first..first + hyps.len()];
            (next[s], done[s]) =
                extend_sentence(hyps, rows, first, step, max_len[s], opts, &mut finished[s]);
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

/// Checks the beam and the number of hypotheses to keep: the most the search finds.
fn check_request(opts: &DecodeOptions, n: usize) -> Result<usize, DecodeError> {
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
    Ok(keep)
}

/// Step `step` of one sentence: its live hypotheses `hyps` (model rows `first..`, whose
/// best tokens are `rows`) extended by their best candidates, `<eos>` forced at `max_len`;
/// the finished ones go to `finished`. The hypotheses that live on, and whether the
/// sentence is done.
fn extend_sentence(
    hyps: &[Live],
    rows: &[RowTop],
    first: usize,
    step: usize,
    max_len: usize,
    opts: &DecodeOptions,
    finished: &mut Vec<Hypothesis>,
) -> (Vec<Live>, bool) {
    let k = if opts.greedy { 1 } else { opts.beam };
    let force_end = step >= max_len;
    let mut next: Vec<Live> = Vec::new();
    // Candidates (score, hyp index, token), best first; ties by hyp then token.
    let mut cands: Vec<(f64, usize, i32)> = Vec::with_capacity(hyps.len() * 2 * k);
    for (h, hyp) in hyps.iter().enumerate() {
        let top = &rows[h];
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
                finished.push(Hypothesis {
                    tokens,
                    score: score / opts.penalty.divisor(len),
                    log_prob: score,
                });
            }
        } else if next.len() < k {
            let mut tokens = hyps[h].tokens.clone();
            tokens.push(tok);
            next.push(Live {
                tokens,
                log_prob: score,
                row: first + h,
            });
        }
        if opts.greedy && (!finished.is_empty() || !next.is_empty()) {
            break;
        }
    }
    finished.sort_by(|a, b| b.score.total_cmp(&a.score));
    finished.truncate(k);
    let full = finished.len() >= k;
    let stop = match opts.early_stop {
        EarlyStop::KFinished => full,
        EarlyStop::Exact => full && !can_improve(&next, finished, max_len, opts.penalty),
    };
    if force_end || next.is_empty() || stop || (opts.greedy && !finished.is_empty()) {
        return (vec![], true);
    }
    (next, false)
}

/// Whether a live hypothesis of `next` could still beat the worst of the `finished` ones
/// (`max_len` the sentence's maximum length).
fn can_improve(
    next: &[Live],
    finished: &[Hypothesis],
    max_len: usize,
    penalty: LengthPenalty,
) -> bool {
    let worst = finished
        .last()
        .map(|h| h.score)
        .unwrap_or(f64::NEG_INFINITY);
    next.iter().any(|hyp| {
        // Log-probabilities only fall; a growing penalty divides by at most
        // lp(max_len), so this bounds the final normalized score.
        let bound = if penalty.grows() {
            hyp.log_prob / penalty.divisor(max_len)
        } else {
            hyp.log_prob / penalty.divisor(hyp.tokens.len() + 1)
        };
        bound > worst
    })
}

#[cfg(test)]
mod tests;
