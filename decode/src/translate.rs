//! Translation and scoring with host step models: batches of sentences through beam
//! search (or greedy search), in input order, on one or several workers, and
//! teacher-forced log-probabilities of reference translations.

use std::collections::BTreeMap;

use kiln_compiler::ir::Graph;
use kiln_compiler::tensor::Tensor;

use kiln_exec::executor::Exec;

use crate::search::{decode_nbest, DecodeError, DecodeOptions, Hypothesis};

/// Why a batch of sentences could not be translated or scored.
#[derive(Debug, thiserror::Error)]
pub enum TranslateError {
    /// The request itself is wrong (empty sentences, positions the model lacks, ...).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// Sentences a batch of [`translate_ids`] by default: the fastest on the 2-core machine
/// (`kiln translate` of Multi30k val: 16 → 26.6 s, 32 → 21.8 s, 64 → 23.6 s, 128 → 26.4
/// s, with RSS growing with the batch).
pub const TRANSLATE_BATCH: usize = 32;

/// How sentences sorted by length are cut into batches: at most `sentences` a batch and,
/// with `max_tokens`, at most that many padded source tokens (its sentences times the
/// longest of them), as fairseq's `--max-tokens`. A sentence longer than `max_tokens` is
/// a batch on its own rather than an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batching {
    pub sentences: usize,
    pub max_tokens: Option<usize>,
}

impl Batching {
    /// Batches of `n` sentences, whatever their length.
    pub fn sentences(n: usize) -> Batching {
        Batching {
            sentences: n,
            max_tokens: None,
        }
    }

    /// `order` cut into consecutive batches; `len(i)` is sentence `i`'s length in tokens
    /// (a batch is at least 1 wide, as [`padded_rows`] pads it).
    pub fn split<'a>(&self, order: &'a [usize], len: &dyn Fn(usize) -> usize) -> Vec<&'a [usize]> {
        let cap = self.sentences.max(1);
        let mut out = Vec::new();
        let (mut start, mut width) = (0, 0);
        for (j, &i) in order.iter().enumerate() {
            let w = width.max(len(i).max(1));
            let rows = j - start + 1;
            let over = self.max_tokens.is_some_and(|t| rows * w > t);
            if j > start && (rows > cap || over) {
                out.push(&order[start..j]);
                start = j;
                width = len(i).max(1);
            } else {
                width = w;
            }
        }
        if start < order.len() {
            out.push(&order[start..]);
        }
        out
    }
}

/// Beam-decodes token-id sentences in batches of similar length ([`Batching`]), the
/// batches shared out among `workers` (see [`decode_workers`]); results in input order,
/// the same for any number of workers. `done(n)` is called after each batch with the
/// number of sentences decoded so far (for a progress bar).
pub fn translate_ids(
    models: StepModels<'_>,
    srcs: &[Vec<i32>],
    opts: &DecodeOptions,
    schedule: Schedule,
    done: &mut dyn FnMut(usize),
) -> Result<Vec<Vec<i32>>, TranslateError> {
    let best = translate_nbest_ids(models, srcs, opts, 1, schedule, done)?;
    Ok(best
        .into_iter()
        .map(|hyps| {
            hyps.into_iter()
                .next()
                .map(|h| h.tokens)
                .unwrap_or_default()
        })
        .collect())
}

/// Rows `rows` of `srcs` as one `[rows, width]` batch, right-padded with `pad` to the
/// longest (at least 1 wide).
fn padded_rows(srcs: &[Vec<i32>], rows: &[usize], pad: i32) -> Result<Tensor, TranslateError> {
    let width = rows
        .iter()
        .map(|&i| srcs[i].len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut ids = Vec::with_capacity(rows.len() * width);
    for &i in rows {
        ids.extend(&srcs[i]);
        ids.extend(std::iter::repeat_n(pad, width - srcs[i].len()));
    }
    Tensor::i32(vec![rows.len(), width], ids).map_err(|e| TranslateError::Invalid(e.to_string()))
}

/// [`translate_ids`], keeping each sentence's `n` best hypotheses with their scores
/// ([`crate::search::decode_nbest`]), best first.
pub fn translate_nbest_ids(
    models: StepModels<'_>,
    srcs: &[Vec<i32>],
    opts: &DecodeOptions,
    n: usize,
    schedule: Schedule,
    done: &mut dyn FnMut(usize),
) -> Result<Vec<Vec<Hypothesis>>, TranslateError> {
    check_sources(models.encode, srcs, &nth_source).map_err(TranslateError::Invalid)?;
    let mut opts = opts.clone();
    if let Some(p) = crate::search::max_target_positions(models.step.graph()) {
        opts.max_positions = Some(opts.max_positions.map_or(p, |q| q.min(p)));
    }
    let opts = &opts;
    per_sentence(
        models,
        (srcs, opts.pad),
        &|_| 0,
        schedule,
        done,
        &|model, _, src| Ok(decode_nbest(model, src, opts, n)?),
    )
}

/// [`check_positions`] of token-id sources against the encoder, source `i` named `what(i)`.
pub fn check_sources(
    encode: &dyn Exec,
    srcs: &[Vec<i32>],
    what: &dyn Fn(usize) -> String,
) -> Result<(), String> {
    let len = |i: usize| srcs[i].len();
    check_positions(
        encode.graph(),
        "src_len",
        srcs.len(),
        &len,
        what,
        "shorten it",
    )
}

/// [`check_positions`] of teacher-forced references (after `<bos>`) against the decoder
/// step, reference `i` named `what(i)`.
pub fn check_references(
    step: &dyn Exec,
    refs: &[Vec<i32>],
    what: &dyn Fn(usize) -> String,
) -> Result<(), String> {
    let len = |i: usize| refs[i].len() + 1;
    check_positions(
        step.graph(),
        "tgt_len",
        refs.len(),
        &len,
        what,
        "shorten it",
    )
}

fn nth_source(i: usize) -> String {
    format!("source sentence {}", i + 1)
}

/// Checks that each of `n` sentences fits the positions `g` reads from a table along
/// `dim` ([`Graph::position_table`], a learned positional embedding): sentence `i`
/// takes `positions(i)` of them. The error names the sentence (`what(i)`), the table and
/// `fix`; graphs without such a table take any length.
pub fn check_positions(
    g: &Graph,
    dim: &str,
    n: usize,
    positions: &dyn Fn(usize) -> usize,
    what: &dyn Fn(usize) -> String,
    fix: &str,
) -> Result<(), String> {
    let Some(t) = g.position_table(dim) else {
        return Ok(());
    };
    let Some(i) = (0..n).find(|&i| positions(i) > t.rows) else {
        return Ok(());
    };
    let p = positions(i);
    // The transformer specs size their tables by `max_len`; another spec, its own way.
    let larger = if g.hparam("max_len").is_some() {
        format!("a model with `max_len` {p} or more")
    } else {
        format!("a model whose `{}` has {p} rows or more", t.param)
    };
    Err(format!(
        "{} takes {p} positions, but the model's table `{}` covers only {}: {fix}, or train \
         {larger}",
        what(i),
        t.param,
        t.rows,
    ))
}

/// How many workers [`translate_ids`], [`translate_nbest_ids`] and [`score_ids`] share
/// the batches out among by default: on the CPU one per thread of the current rayon pool,
/// each running its batches single-threaded (as Marian's `--cpu-threads` and
/// CTranslate2's `inter_threads` do: a decoder step's products are too small to split
/// well, and a batch's beam bookkeeping is serial); one on the GPU.
pub fn decode_workers(step: &dyn Exec) -> usize {
    if step.on_device() {
        1
    } else {
        rayon::current_num_threads().max(1)
    }
}

/// The model the batch functions decode with: the `encode` and `decode_step` programs,
/// the parameters and the vocabulary size.
#[derive(Clone, Copy)]
pub struct StepModels<'a> {
    pub encode: &'a dyn Exec,
    pub step: &'a dyn Exec,
    pub params: &'a BTreeMap<String, Tensor>,
    pub vocab: usize,
}

/// How the batch functions cut and share their work: batches by `batching`, shared out
/// among `workers` ([`decode_workers`] gives the default).
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    pub batching: Batching,
    pub workers: usize,
}

/// What [`per_sentence`] runs on each batch: the decoder, the batch's sentences and the
/// batch itself; one result per sentence.
type SentenceJob<'a, R> = dyn Fn(&mut dyn crate::search::StepModel, &[usize], &Tensor) -> Result<Vec<R>, TranslateError>
    + Sync
    + 'a;

/// What [`over_batches`] runs on each batch: the decoder and the batch's sentences.
type BatchJob<'a, T> =
    dyn Fn(&mut dyn crate::search::StepModel, &[usize]) -> Result<T, TranslateError> + Sync + 'a;

/// `job` over the sentences of `srcs` sorted by length (then by `then(i)`, then by index),
/// in batches cut by `batching` padded with `pad` ([`padded_rows`]), on `workers` (see
/// [`over_batches`]); `job(decoder, sentences, batch)` gives one result per sentence of
/// its batch, returned here at the sentence's index.
fn per_sentence<R: Send + Default>(
    models: StepModels<'_>,
    (srcs, pad): (&[Vec<i32>], i32),
    then: &dyn Fn(usize) -> usize,
    schedule: Schedule,
    done: &mut dyn FnMut(usize),
    job: &SentenceJob<'_, R>,
) -> Result<Vec<R>, TranslateError> {
    let mut order: Vec<usize> = (0..srcs.len()).collect();
    order.sort_by_key(|&i| (srcs[i].len(), then(i), i));
    let chunks = schedule.batching.split(&order, &|i| srcs[i].len());
    let per_batch = over_batches(
        models,
        &chunks,
        schedule.workers,
        &|model, chunk| job(model, chunk, &padded_rows(srcs, chunk, pad)?),
        done,
    )?;
    let mut out: Vec<R> = (0..order.len()).map(|_| R::default()).collect();
    for (chunk, results) in chunks.iter().zip(per_batch) {
        for (&i, r) in chunk.iter().zip(results) {
            out[i] = r;
        }
    }
    Ok(out)
}

/// `job` over every batch of `chunks`, its results in the order of `chunks`. With one
/// worker (or one batch, or a GPU decoder) the batches run one after another here, with
/// one decoder; otherwise `workers` threads take the next batch as they finish one, each
/// with its own decoder on a one-thread rayon pool, so every kernel of a batch runs
/// single-threaded and a batch's results do not depend on which worker ran it. `done(n)`
/// is called here after each batch, with the sentences finished so far. The first error
/// stops the workers and is returned.
fn over_batches<T: Send>(
    StepModels {
        encode,
        step,
        params,
        vocab,
    }: StepModels<'_>,
    chunks: &[&[usize]],
    workers: usize,
    job: &BatchJob<'_, T>,
    done: &mut dyn FnMut(usize),
) -> Result<Vec<T>, TranslateError> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let workers = workers.clamp(1, chunks.len().max(1));
    let mut finished = 0;
    if workers == 1 || step.on_device() {
        // One decoder for every batch: the parameters stay the same, so its programs keep
        // what they derive from them (the transposed weight copies) from batch to batch.
        let mut model = crate::search::cached_step(encode, step, params, vocab);
        let mut out = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            out.push(job(model.as_mut(), chunk)?);
            finished += chunk.len();
            done(finished);
        }
        return Ok(out);
    }
    // One parameters version for every worker's decoder: one set of weight copies.
    let version = kiln_exec::executor::fresh_params_version();
    let (next, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<T, TranslateError>)>();
    let mut out: Vec<Option<T>> = (0..chunks.len()).map(|_| None).collect();
    let mut failed = None;
    std::thread::scope(|scope| {
        for _ in 0..workers {
            let (tx, next, stop) = (tx.clone(), &next, &stop);
            scope.spawn(move || {
                let pool = match rayon::ThreadPoolBuilder::new().num_threads(1).build() {
                    Ok(p) => p,
                    Err(e) => {
                        let why = format!("cannot start a decoding worker: {e}");
                        let _ = tx.send((0, Err(TranslateError::Invalid(why))));
                        return;
                    }
                };
                pool.install(|| {
                    let mut model = crate::search::cached_step_with_version(
                        encode, step, params, vocab, version,
                    );
                    while !stop.load(Relaxed) {
                        let c = next.fetch_add(1, Relaxed);
                        let Some(chunk) = chunks.get(c) else { break };
                        let r = job(model.as_mut(), chunk);
                        let bad = r.is_err();
                        if tx.send((c, r)).is_err() || bad {
                            break;
                        }
                    }
                });
            });
        }
        drop(tx);
        for (c, r) in rx {
            match r {
                Ok(t) => {
                    out[c] = Some(t);
                    finished += chunks[c].len();
                    done(finished);
                }
                Err(e) => {
                    stop.store(true, Relaxed);
                    failed.get_or_insert(e);
                }
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    out.into_iter()
        .map(|t| {
            t.ok_or_else(|| TranslateError::Invalid("internal: a batch was not decoded".into()))
        })
        .collect()
}

/// Scores reference translations ([`crate::search::score`]) in batches of sentence
/// pairs of similar source length ([`Batching`], counting source tokens); log-probabilities in input order. `done(n)`
/// is called after each batch with the number of pairs scored so far.
pub fn score_ids(
    models: StepModels<'_>,
    (srcs, refs): (&[Vec<i32>], &[Vec<i32>]),
    opts: &DecodeOptions,
    schedule: Schedule,
    done: &mut dyn FnMut(usize),
) -> Result<Vec<f64>, TranslateError> {
    if srcs.len() != refs.len() {
        return Err(TranslateError::Invalid(format!(
            "{} source sentences but {} references",
            srcs.len(),
            refs.len()
        )));
    }
    let nth_reference = |i: usize| format!("reference {} (<bos> and its tokens)", i + 1);
    check_sources(models.encode, srcs, &nth_source)
        .and_then(|()| check_references(models.step, refs, &nth_reference))
        .map_err(TranslateError::Invalid)?;
    per_sentence(
        models,
        (srcs, opts.pad),
        &|i| refs[i].len(),
        schedule,
        done,
        &|model, chunk, src| {
            let chunk_refs: Vec<Vec<i32>> = chunk.iter().map(|&i| refs[i].clone()).collect();
            Ok(crate::search::score(model, src, &chunk_refs, opts)?)
        },
    )
}

#[cfg(test)]
mod tests;
