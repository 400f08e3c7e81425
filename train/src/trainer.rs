//! The trainer: the paper's recipe, run to the letter and resumable to the bit.
//!
//! In: a [`Config`], a tokenizer and the spec's graphs (compiled by the caller, which owns
//! the DSL) or a compiled artifact (`model.artifact`: its graphs, first weights and
//! generated kernels), or a run directory to resume. Out: a run directory —
//!
//! ```text
//! <run>/config.yaml            the resolved configuration
//! <run>/tokenizer.json         the shared BPE vocabulary
//! <run>/tokenizer.source.yaml  what it was trained on (vocab_size, the data's digests)
//! <run>/checkpoints/step_N/    model.safetensors, optimizer.safetensors, state.yaml,
//!                              graphs.json, tokenizer.json, config.yaml
//! <run>/metrics.jsonl          one record per log interval and per validation
//! <run>/training.png           train/validation loss and validation BLEU
//! ```
//!
//! Each step: `update_freq` token-based batches go through `train_step` (forward, label-
//! smoothed loss, gradients); their gradients are summed with weights = target tokens,
//! so the update is that of one big batch; then Adam with the warmup schedule. Dropout
//! masks come from Philox keyed by (seed, micro-batch counter), the batch order from
//! (seed, epoch): parameters, moments, step and data position are all a resumed run
//! needs to continue exactly. A NaN or infinity in the loss or a gradient stops the run
//! naming the step and the tensor; the last good checkpoint stays.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

mod keep;
mod report;
mod resume_digest;
mod setup;
mod step;
use kiln_compiler::ir::Graph;
use kiln_compiler::tensor::Tensor;
use report::Report;
pub(crate) use resume_digest::{digest, digest_changes};
use setup::*;
use step::*;

use crate::checkpoint::{self, TrainState};
use crate::config::Config;
use crate::data::{BatchPlan, Example, ParallelCorpus, Tokenizer};
use crate::metrics::{read_metrics, Kind, Record};
use crate::model::{GraphSet, CONFIG_FILE, GRAPHS_FORMAT};
use crate::optim::Adam;
use kiln_exec::artifact::Artifact;
use kiln_exec::cuda::parallel::DataParallel;
use kiln_exec::entry::{entry_graph, Entry};
use kiln_exec::executor::Exec;

/// Why training stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Setup(String),
    #[error("step {step}: {what} is not finite ({value}); stopping — {kept}")]
    NonFinite {
        step: u64,
        what: String,
        value: f32,
        kept: Kept,
    },
    #[error(
        "step {step}: {what} overflowed at every loss scale down to {}, below \
         `train.loss_scale.min` ({min}); stopping — {kept}. The gradients are not finite \
         even unscaled: lower the learning rate, check the data, or lower `min` if a \
         smaller scale is wanted",
        scale_text(*scale)
    )]
    LossScale {
        step: u64,
        what: String,
        scale: f64,
        min: f64,
        kept: Kept,
    },
    #[error(
        "step {step}: the training loss, {loss:.4}, has been above {factor} times the lowest \
         it reached ({lowest:.4}) for {steps} steps: the run diverged; stopping — {kept}. \
         Lower the learning rate (schedule.factor, or schedule.lr) or raise schedule.warmup; \
         train.divergence sets when this stops a run (factor: 0 never)"
    )]
    Diverged {
        step: u64,
        loss: f64,
        lowest: f64,
        factor: f64,
        steps: u64,
        kept: Kept,
    },
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error("running the model failed at step {step}: {source}")]
    Exec {
        step: u64,
        source: kiln_compiler::reference::ExecError,
    },
    #[error(transparent)]
    Decode(#[from] kiln_decode::search::DecodeError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Translate(#[from] kiln_decode::translate::TranslateError),
    #[error("cannot write `{path}`: {message}")]
    Write { path: PathBuf, message: String },
}

/// What a run stopped by an error leaves behind: its newest checkpoint, if it has one.
#[derive(Clone, Debug, Default)]
pub struct Kept(pub Option<PathBuf>);

impl std::fmt::Display for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(dir) => write!(f, "the last good checkpoint, `{}`, is kept", dir.display()),
            None => write!(
                f,
                "the run has no checkpoint yet (none was due before this step)"
            ),
        }
    }
}

/// The three graphs of a spec the trainer cuts its entry points from.
pub struct ModelGraphs {
    /// Training mode (dropout kept).
    pub train: Graph,
    /// Inference mode.
    pub eval: Graph,
    /// One incremental decoder step.
    pub decode: Graph,
}

impl ModelGraphs {
    /// The entry points: `train_step` by differentiation, the others by pruning.
    pub fn entries(&self) -> Result<GraphSet, TrainError> {
        self.entries_with(false)
    }

    /// [`ModelGraphs::entries`]; with `loss_scale`, `train_step`'s backward pass is
    /// seeded by the scalar input `loss_scale` (`train.loss_scale` in the configuration).
    pub fn entries_with(&self, loss_scale: bool) -> Result<GraphSet, TrainError> {
        let e = |r: Result<Graph, kiln_exec::RuntimeError>| {
            r.map_err(|e| TrainError::Setup(format!("{} ({})", e.message, e.help)))
        };
        let options = kiln_compiler::autodiff::TrainStepOptions { loss_scale };
        let train_step = kiln_compiler::autodiff::train_step_with(&self.train, options)
            .map_err(|e| TrainError::Setup(format!("differentiating the model failed: {e}")))?;
        let (encode, decode_step) = kiln_exec::entry::decoder_entries(&self.eval, &self.decode)
            .map_err(|e| TrainError::Setup(format!("{} ({})", e.message, e.help)))?;
        Ok(GraphSet {
            format: GRAPHS_FORMAT,
            model: self.eval.name.clone(),
            train_step,
            loss: e(entry_graph(&self.eval, Entry::Loss))?,
            encode,
            decode_step,
        })
    }
}

/// The training loss and tokens of the steps since the last log.
struct Interval {
    loss: f64,
    tokens: usize,
    start: Instant,
}

impl Interval {
    fn starting() -> Interval {
        Interval {
            loss: 0.0,
            tokens: 0,
            start: Instant::now(),
        }
    }
}

/// Where the trainer reports progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// An indicatif bar on a terminal, plain lines otherwise.
    Auto,
    /// Plain lines.
    Lines,
    /// Nothing (tests).
    Quiet,
}

/// What a finished run reports.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub steps: u64,
    pub last_loss: f64,
    pub valid_loss: Option<f64>,
    pub valid_bleu: Option<f64>,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub checkpoint: Option<PathBuf>,
    /// Steps skipped in this run because their gradients overflowed (loss scaling).
    pub overflows: u64,
    /// The loss scale at the end (loss scaling).
    pub loss_scale: Option<f64>,
    /// Why the run stopped before `train.max_steps` for `valid.patience`.
    pub early_stop: Option<String>,
    /// Optimizer steps this call took (`steps` counts from the run's start).
    pub steps_taken: u64,
    /// `<run>/best/` when this run wrote it.
    pub best: Option<PathBuf>,
}

/// A loss scale as people write it: `2^16`, `2^-3` (a power of two, as the scale
/// always is), else the number.
pub fn scale_text(s: f64) -> String {
    let k = s.log2().round();
    if s > 0.0 && 2f64.powi(k as i32) == s {
        format!("2^{k}")
    } else {
        s.to_string()
    }
}

/// The run directory's `config.yaml` of `cfg`.
pub(crate) fn config_yaml(cfg: &Config) -> String {
    serde_yaml::to_string(cfg).expect("config serializes")
}

/// The kernel of `train.gemm_type` on this CPU: `None` where the key is absent, `Some(None)`
/// for f32; an error where this CPU cannot run it.
pub fn gemm_kernel(
    cfg: &Config,
) -> Result<Option<Option<kiln_exec::compiled::Kernel16>>, TrainError> {
    let Some(name) = &cfg.train.gemm_type else {
        return Ok(None);
    };
    kiln_exec::compiled::GemmType::parse(name)
        .ok_or_else(|| format!("`{name}` is not a known GEMM type"))
        .and_then(|t| t.kernel())
        .map(Some)
        .map_err(|why| {
            TrainError::Setup(format!(
                "train.gemm_type is `{name}`, but {why}; use `gemm_type: f32` (or `kiln \
                 train --gemm-type f32`)"
            ))
        })
}

/// A training run in progress.
pub struct Trainer {
    cfg: Config,
    dir: PathBuf,
    tokenizer: Tokenizer,
    train: Box<dyn crate::data::Pairs + Send>,
    plan: BatchPlan,
    valid: Vec<Example>,
    valid_plan: BatchPlan,
    valid_corpus: ParallelCorpus,
    valid_lines: Vec<usize>,
    graphs: GraphSet,
    graphs_json: Vec<u8>,
    train_exec: TrainExec,
    /// Where the parameters and moments are current (device training only).
    device: DeviceState,
    loss_exec: Box<dyn Exec>,
    encode_exec: Box<dyn Exec>,
    step_exec: Box<dyn Exec>,
    params: BTreeMap<String, Tensor>,
    adam: Adam,
    state: TrainState,
    d_model: f64,
    progress: Progress,
    notes: Vec<String>,
}

/// What runs the training step.
enum TrainExec {
    /// Any executor: the gradients come back to the host, which accumulates them and
    /// runs Adam ([`Adam::step`]).
    Host(Box<dyn Exec>),
    /// `train.executor: cuda`: parameters, gradient accumulators and Adam's moments stay
    /// on the GPU (`CudaExecutor::train_begin`); only the loss comes back per
    /// micro-batch. The host's parameters and moments are refreshed
    /// ([`Trainer::sync_device`]) for validation, checkpoints and at the end.
    Device(Box<kiln_exec::cuda::CudaExecutor>),
    /// `train.devices`: device training on every listed GPU, the gradients summed by
    /// NCCL before each optimizer step (`kiln_exec::cuda::parallel`).
    Parallel(Box<DataParallel>),
}

/// Device training: whether the device holds the state, and whether it is ahead of the
/// host's copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DeviceState {
    /// Nothing on the device yet (or host training).
    Off,
    /// The device's parameters and moments equal the host's.
    InSync,
    /// The device has taken optimizer steps the host has not seen.
    Ahead,
}

/// What the trainer runs: the entry graphs, and the artifact whose kernels run them
/// (with the compiled executor).
struct Program<'a> {
    graphs: GraphSet,
    artifact: Option<&'a Artifact>,
}

impl Trainer {
    /// What setting up the run found (data sizes, resume point).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    pub fn params(&self) -> &BTreeMap<String, Tensor> {
        &self.params
    }

    pub fn state(&self) -> &TrainState {
        &self.state
    }

    pub fn graphs(&self) -> &GraphSet {
        &self.graphs
    }

    fn vocab(&self) -> usize {
        self.graphs.vocab().unwrap_or(self.tokenizer.vocab_size())
    }

    /// Trains until `train.max_steps` (or `train.max_seconds`, or `valid.patience`).
    pub fn run(&mut self) -> Result<Summary, TrainError> {
        let total = self.cfg.train.max_steps;
        if self.state.step > total {
            return Err(TrainError::Setup(format!(
                "train.max_steps is {total} (`--max-steps`, or the run's {CONFIG_FILE}), but \
                 the run is at step {} already (`{}`): there is nothing to train, and a run \
                 does not go back; give a --max-steps above {} to train on",
                self.state.step,
                self.checkpoint_root()
                    .join(checkpoint::dir_name(self.state.step))
                    .display(),
                self.state.step
            )));
        }
        let started = Instant::now();
        let mut grads: BTreeMap<String, Vec<f32>> = self
            .params
            .iter()
            .map(|(k, t)| (k.clone(), vec![0.0; t.numel()]))
            .collect();
        let mut report = Report::open(&self.dir, self.progress, total, self.state.step)?;
        let mut summary = Summary::default();
        let mut interval = Interval::starting();
        let (mut all_tokens, mut train_time) = (0usize, 0.0f64);
        let first_step = self.state.step;
        // A resumed run whose patience was already spent stays stopped.
        if let Some(why) = self.patience_spent() {
            summary.steps = self.state.step;
            summary.early_stop = Some(format!(
                "{why}; raise valid.patience to train on from this checkpoint"
            ));
            return Ok(summary);
        }
        let mut watch = crate::divergence::Watch::new(&self.cfg.train.divergence);
        while self.state.step < total {
            if self.cfg.train.max_seconds > 0
                && started.elapsed().as_secs() >= self.cfg.train.max_seconds
            {
                break;
            }
            let t0 = Instant::now();
            let outcome = match self.step(&mut grads) {
                Ok(o) => o,
                Err(e) => return Err(self.naming_the_kept_checkpoint(e)),
            };
            let (loss, tokens, src_tokens) = match outcome {
                StepOutcome::Update(loss, tokens, src_tokens) => (loss, tokens, src_tokens),
                StepOutcome::Overflow { what, from, to } => {
                    summary.overflows += 1;
                    report.say(&format!(
                        "step {}: {what} overflowed at loss scale {}; step skipped, scale {}",
                        self.state.step + 1,
                        scale_text(from),
                        scale_text(to)
                    ));
                    continue;
                }
            };
            train_time += t0.elapsed().as_secs_f64();
            all_tokens += tokens + src_tokens;
            interval.loss += loss * tokens as f64;
            interval.tokens += tokens;
            summary.last_loss = loss;
            let step = self.state.step;
            if let Some(d) = watch.observe(loss) {
                return Err(self.naming_the_kept_checkpoint(TrainError::Diverged {
                    step,
                    loss: d.loss,
                    lowest: d.lowest,
                    factor: d.factor,
                    steps: d.steps,
                    kept: Kept::default(),
                }));
            }
            report.bar(step, || {
                let tps = all_tokens as f64 / train_time.max(1e-9);
                format!("loss {loss:.4} lr {:.2e} {tps:.0} tok/s", self.state.lr)
            });
            if step.is_multiple_of(self.cfg.train.log_every) || step == total {
                if let Err(e) = self.log_interval(&mut report, &mut interval, started) {
                    return Err(self.keeping_the_step(e));
                }
            }
            let last = step == total;
            // Some(improved) when this step was validated.
            let mut validated = None;
            if step.is_multiple_of(self.cfg.valid.every) || last {
                self.sync_device()?;
                match self.validate_step(&mut report, &mut summary) {
                    Ok(improved) => validated = Some(improved),
                    Err(e) => return Err(self.keeping_the_step(e)),
                }
            }
            if step.is_multiple_of(self.cfg.checkpoint.every) || last {
                self.sync_device()?;
                summary.checkpoint = Some(self.save_checkpoint()?);
            }
            // After the checkpoint, so that neither can cost the steps since the last one.
            if let Some(improved) = validated {
                if self.after_validation(improved, &report, &mut summary)? {
                    break;
                }
            }
        }
        // The host's parameters and moments are the run's from here on.
        self.sync_device()?;
        // Stopped by the time limit or for patience: keep what was done.
        if self.state.step < total
            && summary
                .checkpoint
                .as_ref()
                .map(|c| !c.ends_with(checkpoint::dir_name(self.state.step)))
                .unwrap_or(true)
            && self.state.step > 0
        {
            summary.checkpoint = Some(self.save_checkpoint()?);
        }
        report.finish();
        summary.steps = self.state.step;
        summary.steps_taken = self.state.step - first_step;
        summary.loss_scale = self.state.loss_scale;
        summary.seconds = started.elapsed().as_secs_f64();
        summary.tokens_per_second = all_tokens as f64 / train_time.max(1e-9);
        Ok(summary)
    }

    /// Logs the training loss and speed of the steps since the last log, and starts the
    /// next interval.
    fn log_interval(
        &self,
        report: &mut Report,
        interval: &mut Interval,
        started: Instant,
    ) -> Result<(), TrainError> {
        let (step, total) = (self.state.step, self.cfg.train.max_steps);
        let secs = interval.start.elapsed().as_secs_f64().max(1e-9);
        let avg = interval.loss / interval.tokens.max(1) as f64;
        let tps = interval.tokens as f64 / secs;
        report.record(&Record {
            step,
            kind: Kind::Train,
            loss: Some(avg),
            lr: Some(self.state.lr),
            tokens_per_s: Some(tps),
            bleu: None,
            bleu_signature: None,
        })?;
        if report.lines() {
            report.warn(&format!(
                "step {step}/{total}  loss {avg:.4}  lr {:.3e}  {:.0} target tok/s  epoch {}  {:.0}s",
                self.state.lr,
                tps,
                self.state.epoch + 1,
                started.elapsed().as_secs_f64()
            ));
        }
        *interval = Interval::starting();
        Ok(())
    }

    /// Validates the current weights, keeps the best so far in the state and logs the
    /// result: whether the step improved on the best.
    fn validate_step(
        &mut self,
        report: &mut Report,
        summary: &mut Summary,
    ) -> Result<bool, TrainError> {
        let step = self.state.step;
        let (vl, vb) = self.validate()?;
        summary.valid_loss = Some(vl);
        summary.valid_bleu = vb;
        let best = (self.state.best_val_loss, self.state.best_bleu);
        let improved = improves(self.cfg.valid.best_metric(), (vl, vb), best);
        if improved {
            self.state.best_step = Some(step);
            self.state.bad_validations = 0;
        } else {
            self.state.bad_validations += 1;
        }
        self.state.best_val_loss = Some(self.state.best_val_loss.map_or(vl, |b| b.min(vl)));
        if let Some(b) = vb {
            self.state.best_bleu = Some(self.state.best_bleu.map_or(b, |x| x.max(b)));
        }
        report.record(&Record {
            step,
            kind: Kind::Valid,
            loss: Some(vl),
            lr: None,
            tokens_per_s: None,
            bleu: vb,
            bleu_signature: vb.map(|_| self.bleu_signature()),
        })?;
        report.say(&format!(
            "step {step}: validation loss {vl:.4}{}",
            vb.map(|b| format!(", BLEU {b:.2}")).unwrap_or_default()
        ));
        Ok(improved)
    }

    /// After a validation (and the step's checkpoint): the plot redrawn, the best weights
    /// saved when they improved; whether the run stops for patience.
    fn after_validation(
        &mut self,
        improved: bool,
        report: &Report,
        summary: &mut Summary,
    ) -> Result<bool, TrainError> {
        // The plot is a picture of metrics.jsonl: a failure to draw it is said, even with
        // --quiet, and training goes on.
        if let Err(e) = self.plot() {
            report.warn(&format!(
                "warning: {e}; training goes on (the plot is drawn again at the next \
                 validation)"
            ));
        }
        if improved && self.cfg.checkpoint.best {
            match self.save_best() {
                Ok(dir) => summary.best = Some(dir),
                Err(e) => return Err(self.keeping_the_step(e)),
            }
        }
        if let Some(why) = self.patience_spent() {
            summary.early_stop = Some(why);
            return Ok(true);
        }
        Ok(false)
    }

    /// Redraws `training.png` from `metrics.jsonl`.
    pub fn plot(&self) -> Result<(), TrainError> {
        let path = self.dir.join(crate::metrics::FILE_NAME);
        let records = read_metrics(&path).unwrap_or_default();
        let mut train = Vec::new();
        let mut vloss = Vec::new();
        let mut vbleu = Vec::new();
        for r in records {
            match r.kind {
                Kind::Train => train.extend(r.loss.map(|l| (r.step, l))),
                Kind::Valid => {
                    vloss.extend(r.loss.map(|l| (r.step, l)));
                    vbleu.extend(r.bleu.map(|b| (r.step, b)));
                }
            }
        }
        let png = self.dir.join("training.png");
        crate::plot::plot_training(
            &png,
            &train,
            &vloss,
            &vbleu,
            &format!("kiln: {}", self.graphs.model),
        )
        .map_err(|e| TrainError::Write {
            path: png,
            message: e.to_string(),
        })
    }
}

/// Prints a progress line: above the bar, or on standard error. A stream that cannot be
/// written (a closed pipe: `kiln train … 2>&1 | head`) does not stop the run, which goes
/// on to its checkpoints; `eprintln!` would panic.
#[cfg(test)]
mod tests {
    use super::*;

    fn config(devices: Option<Vec<usize>>) -> Config {
        let mut c = Config::parse(
            "model:\n  spec: m.kiln\ndata:\n  train_src: a\n  train_tgt: b\n  valid_src: c\n  \
             valid_tgt: d\ntrain:\n  executor: cuda\n",
        )
        .unwrap();
        c.train.devices = devices;
        c
    }

    #[test]
    fn the_number_of_gpus_is_part_of_the_trajectory() {
        let one = digest(&config(None));
        // One GPU through NCCL is the run without it; which GPUs does not matter.
        assert_eq!(digest(&config(Some(vec![0]))), one);
        let two = digest(&config(Some(vec![0, 1])));
        assert_eq!(digest(&config(Some(vec![2, 3]))), two);
        assert_eq!(
            digest_changes(&one, &two),
            vec!["the number of GPUs in `train.devices`".to_string()]
        );
        assert_eq!(
            digest_changes(&two, &digest(&config(Some(vec![0, 1, 2])))),
            vec!["the number of GPUs in `train.devices`".to_string()]
        );
    }
}

/// Whether a validation's `(loss, bleu)` beats the best so far (`best`: the lowest loss
/// and the highest BLEU seen) by `metric` (`bleu` or `loss`); the first validation
/// always does, a tie does not.
pub(crate) fn improves(
    metric: &str,
    (loss, bleu): (f64, Option<f64>),
    best: (Option<f64>, Option<f64>),
) -> bool {
    if metric == "bleu" {
        bleu.is_some_and(|b| best.1.is_none_or(|x| b > x))
    } else {
        best.0.is_none_or(|x| loss < x)
    }
}

#[cfg(test)]
mod best_tests {
    use super::improves;

    /// Late in training the loss rises while BLEU still climbs: the best step by BLEU
    /// is not the best by loss.
    #[test]
    fn the_pick_by_bleu_differs_from_the_pick_by_loss_when_they_disagree() {
        let validations = [
            (4.2, 20.1),
            (3.9, 26.0),
            (3.7, 31.5),
            (3.8, 33.9),
            (3.95, 33.2),
        ];
        let pick = |metric: &str| {
            let (mut best, mut step) = ((None, None), 0);
            for (i, &(loss, bleu)) in validations.iter().enumerate() {
                if improves(metric, (loss, Some(bleu)), best) {
                    step = i;
                }
                best = (
                    Some(best.0.map_or(loss, |b: f64| b.min(loss))),
                    Some(best.1.map_or(bleu, |b: f64| b.max(bleu))),
                );
            }
            step
        };
        assert_eq!(pick("loss"), 2);
        assert_eq!(pick("bleu"), 3);
        // No BLEU computed never improves by BLEU; a tie is no improvement.
        assert!(!improves("bleu", (1.0, None), (None, None)));
        assert!(!improves("loss", (3.7, None), (Some(3.7), None)));
        assert!(improves("loss", (9.0, None), (None, None)));
    }
}
