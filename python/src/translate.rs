//! `kiln.Translator`: a trained model (checkpoint, run, average or compiled artifact)
//! translating and scoring text, as `kiln translate` and `kiln score` do.

use std::path::PathBuf;

use kiln::translator::Translator as Loaded;
use kiln_decode::search::{DecodeOptions, EarlyStop, Hypothesis, LengthPenalty, MAX_BEAM};
use kiln_decode::translate::{decode_workers, score_ids, Batching, Schedule};
use kiln_exec::compiled::GemmType;
use kiln_exec::executor::ExecutorKind;
use pyo3::prelude::*;

use crate::{kiln_error, plain_error, set_threads};

/// One hypothesis: its text, pieces, score (log-probability over the length penalty)
/// and log-probability.
type Hyp = (String, Vec<String>, f64, f64);

#[pyclass(frozen, module = "kiln._kiln")]
pub(crate) struct Translator {
    inner: Loaded,
    workers: usize,
}

/// The products `precision` names (`f32`, `16bit`, `int8`, …) for the whole process.
fn set_precision(precision: Option<&str>, executor: ExecutorKind) -> PyResult<()> {
    let Some(name) = precision else {
        return Ok(());
    };
    let t = GemmType::parse(name).ok_or_else(|| {
        plain_error(
            "kiln::gemm",
            format!(
                "precision `{name}` is not one of {}",
                GemmType::NAMES.join(", ")
            ),
        )
    })?;
    if t != GemmType::F32 && executor != ExecutorKind::Compiled {
        return Err(plain_error(
            "kiln::gemm",
            format!("precision `{name}` chooses the compiled executor's products"),
        ));
    }
    kiln_exec::compiled::set_process_gemm_type(t)
        .map(|_| ())
        .map_err(|why| plain_error("kiln::gemm", format!("precision `{name}`: {why}")))
}

impl Translator {
    fn schedule(&self, batch: usize) -> Schedule {
        Schedule {
            batching: Batching::sentences(batch.max(1)),
            workers: self.workers,
        }
    }

    fn hyp(&self, h: &Hypothesis) -> Hyp {
        let t = &self.inner.tokenizer;
        let pieces = h
            .tokens
            .iter()
            .map(|&id| t.id_to_token(id).unwrap_or_default())
            .collect();
        (t.decode(&h.tokens), pieces, h.score, h.log_prob)
    }
}

#[pymethods]
impl Translator {
    /// Loads `model`; `threads` sizes kiln's thread pool (once per process),
    /// `precision` the compiled executor's products (`f32`, `16bit`, `int8`, …).
    #[new]
    #[pyo3(signature = (model, threads=None, precision=None, executor="compiled"))]
    fn new(
        py: Python<'_>,
        model: PathBuf,
        threads: Option<usize>,
        precision: Option<&str>,
        executor: &str,
    ) -> PyResult<Translator> {
        let kind = ExecutorKind::parse(executor).ok_or_else(|| {
            plain_error(
                "kiln::executor",
                format!("executor `{executor}` is not compiled, eager, reference or cuda"),
            )
        })?;
        set_threads(threads)?;
        set_precision(precision, kind)?;
        let inner = py
            .detach(|| Loaded::load(&model, kind))
            .map_err(kiln_error)?;
        let workers = decode_workers(&*inner.step);
        Ok(Translator { inner, workers })
    }

    /// The `nbest` best hypotheses of each sentence, best first (one for an empty one:
    /// the empty translation), as (text, pieces, score, log_prob).
    #[pyo3(signature = (texts, beam=4, alpha=0.6, nbest=1, greedy=false,
                        length_penalty="gnmt", early_stop="k-finished", max_len_a=1.0,
                        max_len_b=50, allow_unk=false, batch=32))]
    #[allow(clippy::too_many_arguments)]
    fn translate(
        &self,
        py: Python<'_>,
        texts: Vec<String>,
        beam: usize,
        alpha: f64,
        nbest: usize,
        greedy: bool,
        length_penalty: &str,
        early_stop: &str,
        max_len_a: f64,
        max_len_b: usize,
        allow_unk: bool,
        batch: usize,
    ) -> PyResult<Vec<Vec<Hyp>>> {
        let bad = |why: String| plain_error("kiln::translate", why);
        if !(1..=MAX_BEAM).contains(&beam) {
            return Err(bad(format!("beam is {beam}: give 1 to {MAX_BEAM}")));
        }
        let keep = if greedy { 1 } else { beam };
        if nbest == 0 || nbest > keep {
            return Err(bad(format!(
                "nbest is {nbest}: give 1 to {keep}, the hypotheses the search keeps"
            )));
        }
        if !(max_len_a >= 0.0 && max_len_a.is_finite() && alpha.is_finite()) {
            return Err(bad(format!(
                "alpha ({alpha}) must be finite and max_len_a ({max_len_a}) finite and 0 or more"
            )));
        }
        let penalty = LengthPenalty::parse(length_penalty, alpha).ok_or_else(|| {
            bad(format!(
                "unknown length penalty `{length_penalty}`: use gnmt, len_pow or none"
            ))
        })?;
        let early_stop = EarlyStop::parse(early_stop).ok_or_else(|| {
            bad(format!(
                "unknown stopping rule `{early_stop}`: use {}",
                EarlyStop::NAMES.join(" or ")
            ))
        })?;
        let opts = DecodeOptions {
            beam,
            greedy,
            penalty,
            early_stop,
            max_len_a,
            max_len_b,
            allow_unk,
            ..DecodeOptions::default()
        };
        let run = (nbest, self.schedule(batch));
        let hyps = py
            .detach(|| self.inner.translate(&texts, &opts, run, &mut |_| {}))
            .map_err(kiln_error)?;
        let empty = Hypothesis {
            tokens: vec![],
            score: 0.0,
            log_prob: 0.0,
        };
        Ok(hyps
            .iter()
            .map(|hs| match hs.is_empty() {
                true => vec![self.hyp(&empty)],
                false => hs.iter().map(|h| self.hyp(h)).collect(),
            })
            .collect())
    }

    /// Teacher-forced log-probability of each reference given its source (`<eos>`
    /// included); None where the source is empty. `normalize`: divided by the
    /// reference's length in tokens (`<eos>` included).
    #[pyo3(signature = (src, refs, normalize=false, batch=32))]
    fn score(
        &self,
        py: Python<'_>,
        src: Vec<String>,
        refs: Vec<String>,
        normalize: bool,
        batch: usize,
    ) -> PyResult<Vec<Option<f64>>> {
        if src.len() != refs.len() {
            return Err(plain_error(
                "kiln::score",
                format!(
                    "{} sources but {} references: give one reference per source",
                    src.len(),
                    refs.len()
                ),
            ));
        }
        let sources = self
            .inner
            .encode_lines(&src, &|i| format!("source {}", i + 1))
            .map_err(kiln_error)?;
        let mut ids = Vec::new();
        for &i in &sources.which {
            let r = self
                .inner
                .tokenizer
                .encode(&refs[i])
                .map_err(|e| plain_error("kiln::score", format!("reference {}: {e}", i + 1)))?;
            ids.push(r);
        }
        let schedule = self.schedule(batch);
        let models = self.inner.step_models();
        let opts = DecodeOptions::default();
        let scores = py
            .detach(|| score_ids(models, (&sources.ids, &ids), &opts, schedule, &mut |_| {}))
            .map_err(|e| plain_error("kiln::score", e.to_string()))?;
        let mut out = vec![None; src.len()];
        for ((&i, s), r) in sources.which.iter().zip(scores).zip(&ids) {
            let len = (r.len() + 1) as f64;
            out[i] = Some(if normalize { s / len } else { s });
        }
        Ok(out)
    }

    /// The vocabulary's size (the tokenizer's).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.tokenizer.vocab_size()
    }

    /// Whether the model was loaded from a compiled artifact.
    #[getter]
    fn is_artifact(&self) -> bool {
        self.inner.from_artifact
    }
}
