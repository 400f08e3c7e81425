//! Training configuration (YAML).
//!
//! In: a YAML file. Out: a [`Config`] with the paper's recipe as defaults — Adam
//! β = (0.9, 0.98), ε = 1e-9; lr = factor · d_model^-0.5 · min(step^-0.5, step ·
//! warmup^-1.5) with warmup 4000; batches of about 25,000 source and 25,000 target
//! tokens; checkpoints and validation every 1000 steps; beam 4, α = 0.6. Label
//! smoothing and dropout are parameters of the spec (`eps_ls`, `p_drop`) and are set
//! with `model.set`.
//!
//! Unknown keys are errors that name the key and its line (serde's
//! `deny_unknown_fields`); paths are relative to the configuration file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use kiln_exec::executor::ExecutorKind;

mod schedule;
pub use schedule::{ScheduleConfig, ScheduleKind};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub data: DataConfig,
    #[serde(default)]
    pub batch: BatchConfig,
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    #[serde(default)]
    pub schedule: ScheduleConfig,
    #[serde(default)]
    pub train: TrainConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub valid: ValidConfig,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The `.kiln` spec (not needed when `artifact` is given).
    #[serde(default, skip_serializing_if = "is_empty_path")]
    pub spec: PathBuf,
    /// A compiled artifact (`kiln compile --config CONFIG.yaml -o DIR`): the trainer
    /// takes its graphs, first weights and tokenizer, and runs its generated kernels
    /// (with `train.executor: compiled`) instead of compiling the spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<PathBuf>,
    /// The model in the spec, when it defines several.
    #[serde(default)]
    pub name: Option<String>,
    /// Parameter overrides, as `--set` would give them. `vocab` is set from the BPE
    /// vocabulary.
    #[serde(default)]
    pub set: BTreeMap<String, serde_yaml::Value>,
}

fn is_empty_path(p: &Path) -> bool {
    p.as_os_str().is_empty()
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub train_src: PathBuf,
    pub train_tgt: PathBuf,
    pub valid_src: PathBuf,
    pub valid_tgt: PathBuf,
    /// Size of the shared BPE vocabulary (special tokens included).
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    /// A new vocabulary spells a character it has never seen as its UTF-8 bytes (256
    /// byte tokens, counted in `vocab_size`) rather than `<unk>`, so no character of a
    /// source is lost.
    #[serde(default = "default_byte_fallback")]
    pub byte_fallback: bool,
    /// Training pairs with more tokens than this on either side are dropped.
    #[serde(default = "default_max_len")]
    pub max_len: usize,
    /// A directory `kiln preprocess` wrote (its `-o`, by default `<run>/binarized`): the
    /// training pairs are read from its token ids, mapped from disk, instead of encoded
    /// from `train_src`/`train_tgt` into memory (corpora of any size). The same pairs in
    /// the same order: the run is the same either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binarized: Option<PathBuf>,
}

fn default_vocab() -> usize {
    37000
}
fn default_byte_fallback() -> bool {
    true
}
fn default_max_len() -> usize {
    256
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct BatchConfig {
    /// Padded source tokens per batch (rows × longest row).
    pub max_src_tokens: usize,
    /// Padded target tokens per batch.
    pub max_tgt_tokens: usize,
    /// Batches whose gradients are summed before one optimizer step.
    pub update_freq: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_src_tokens: 25_000,
            max_tgt_tokens: 25_000,
            update_freq: 1,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Clip the gradients to this global L2 norm before each update (fairseq's
    /// `--clip-norm`, PyTorch's `clip_grad_norm_`); 0, the default, never clips. Left out
    /// of a written configuration when 0 (as `weight_decay`), so runs from before the
    /// option keep their digest.
    #[serde(skip_serializing_if = "is_zero")]
    pub clip_norm: f64,
    /// Decoupled weight decay (AdamW, Loshchilov & Hutter): every parameter times
    /// `1 − lr · weight_decay` before Adam's update; 0, the default (the paper's), none.
    #[serde(skip_serializing_if = "is_zero")]
    pub weight_decay: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-9,
            clip_norm: 0.0,
            weight_decay: 0.0,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps to run.
    pub max_steps: u64,
    pub seed: u64,
    /// `compiled` (generated kernels; the default), `eager`, `reference`, or `cuda` (the
    /// GPU: needs a `--target cuda` artifact, `model.artifact` / `kiln train --artifact`).
    pub executor: String,
    /// How the compiled executor runs its large matrix products (`kiln train
    /// --gemm-type`): `f32`, `16bit` (the best 16-bit kernel this CPU has), or a kernel:
    /// `amx`, `dot`, `fp16`, `int16` (see `docs/PERFORMANCE.md`; not `int8`, which is for
    /// inference). Absent: f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_type: Option<String>,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Print a progress line (or redraw the bar) every this many steps.
    pub log_every: u64,
    /// Stop after this many seconds of training (0: no limit); a checkpoint is written.
    pub max_seconds: u64,
    /// Dynamic loss scaling (absent: none). The backward pass is seeded with the scale,
    /// the gradients are unscaled before the update; a step whose gradients overflow is
    /// skipped and the scale halved, and after `window` good steps in a row it doubles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScaleConfig>,
    /// Data-parallel training over these GPUs (their ordinals, e.g. `[0, 1, 2, 3]`), the
    /// gradients summed by NCCL (`--features nccl`); needs `executor: cuda`. Each step
    /// then takes `batch.update_freq` batches per GPU. Absent: one GPU (0), no NCCL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<usize>>,
    /// When a finite loss counts as diverged ([`DivergenceConfig`]).
    #[serde(default, skip_serializing_if = "DivergenceConfig::is_default")]
    pub divergence: DivergenceConfig,
}

/// `train.divergence`: a run whose training loss stays above `factor` times the lowest
/// it reached (or 1 nat a token, if that is more), for `steps` steps in a row, has diverged (a learning rate too high, say)
/// and stops with an error naming the step, as a loss that is not finite does, instead
/// of training on and keeping a `best/` of it. `factor: 0` turns the check off.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DivergenceConfig {
    pub factor: f64,
    pub steps: u64,
}

impl Default for DivergenceConfig {
    fn default() -> Self {
        DivergenceConfig {
            factor: 4.0,
            steps: 100,
        }
    }
}

impl DivergenceConfig {
    fn is_default(&self) -> bool {
        *self == DivergenceConfig::default()
    }
}

/// `train.loss_scale`: fairseq's `--fp16-init-scale`, `--fp16-scale-window` and
/// `--min-loss-scale`, PyTorch's `GradScaler`. The scale stays a power of two, so
/// scaling and unscaling are exact.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LossScaleConfig {
    /// The first scale: a power of two from 2^-126 to 2^127.
    pub init: f64,
    /// Good steps in a row after which the scale doubles (at most to 2^127).
    pub window: u64,
    /// Training stops with an error when an overflow would take the scale below this.
    pub min: f64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig {
            init: 65536.0,
            window: 2000,
            min: 1e-4,
        }
    }
}

impl TrainConfig {
    /// `executor` as a kind; `compiled` where it names none (which [`Config::check`]
    /// refuses before anything runs).
    pub fn executor_kind(&self) -> ExecutorKind {
        ExecutorKind::parse(&self.executor).unwrap_or(ExecutorKind::Compiled)
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            max_steps: 100_000,
            seed: 1,
            executor: "compiled".to_string(),
            gemm_type: None,
            threads: 0,
            log_every: 100,
            max_seconds: 0,
            loss_scale: None,
            devices: None,
            divergence: DivergenceConfig::default(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// The run directory (checkpoints, tokenizer, metrics, plot), relative to the
    /// configuration file.
    pub dir: PathBuf,
    pub every: u64,
    /// How many checkpoints to keep (the paper averages the last 5 or 20).
    pub keep: usize,
    /// Keep the model of the best validation (`valid.metric`) in `<run>/best/`, a model
    /// directory that `kiln translate` reads (fairseq's `checkpoint_best.pt`).
    pub best: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            dir: PathBuf::from("runs/run"),
            every: 1000,
            keep: 5,
            best: true,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ValidConfig {
    pub every: u64,
    /// Compute BLEU by decoding the validation set (else only the loss).
    pub bleu: bool,
    pub beam: usize,
    pub alpha: f64,
    /// `gnmt`, `len_pow` or `none`.
    pub length_penalty: String,
    /// `k-finished` (the default) or `exact` (`decode::EarlyStop`).
    pub early_stop: String,
    pub max_len_a: f64,
    pub max_len_b: usize,
    /// Validate on the first this many validation pairs (0: all of them).
    pub max_sentences: usize,
    /// What "best" means for `checkpoint.best` and `patience`: `loss` (the validation
    /// loss, lower is better) or `bleu` (higher is better; needs `bleu: true`). By
    /// default `bleu` when BLEU is computed, else `loss` ([`ValidConfig::best_metric`]):
    /// late in training the two disagree, and BLEU is what the model is for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    /// Stop training after this many validations in a row without a better `metric`
    /// (fairseq's `--patience`, Marian's `--early-stopping`); 0 never stops early.
    pub patience: u64,
}

impl ValidConfig {
    /// The metric "best" is judged by: `metric`, else `bleu` when BLEU is computed and
    /// `loss` when it is not.
    pub fn best_metric(&self) -> &str {
        match &self.metric {
            Some(m) => m,
            None if self.bleu => "bleu",
            None => "loss",
        }
    }
}

impl Default for ValidConfig {
    fn default() -> Self {
        ValidConfig {
            every: 1000,
            bleu: true,
            beam: 4,
            alpha: 0.6,
            length_penalty: "gnmt".to_string(),
            early_stop: "k-finished".to_string(),
            max_len_a: 1.0,
            max_len_b: 50,
            max_sentences: 0,
            metric: None,
            patience: 0,
        }
    }
}

/// A configuration error: the file, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the configuration `{path}`: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{path}`: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The largest configuration file read (the shipped ones are about 2 KiB; a read without a
/// bound never ends on a device such as `/dev/zero`).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// How deep `[`/`{` may nest (100,000 levels took the YAML parser 42 s to reject).
pub const MAX_CONFIG_NESTING: usize = 32;

/// The UTF-8 text of `path`, or `Ok(None)` where it holds more than
/// [`MAX_CONFIG_BYTES`].
fn read_bounded(path: &Path) -> std::io::Result<Option<String>> {
    use std::io::Read as _;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)?;
    Ok((text.len() as u64 <= MAX_CONFIG_BYTES).then_some(text))
}

/// The deepest nesting of flow lists and maps in `text` (brackets in quotes or comments
/// counted too: an over-estimate, which only a pathological file reaches), `None` for
/// none.
fn flow_depth(text: &str) -> Option<usize> {
    let (mut depth, mut max) = (0usize, 0usize);
    for b in text.bytes() {
        match b {
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    (max > 0).then_some(max)
}

impl Config {
    /// Reads and checks a configuration; relative paths become relative to its folder.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = read_bounded(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let Some(text) = text else {
            return Err(invalid(format!(
                "larger than {} KiB, too large for a configuration",
                MAX_CONFIG_BYTES >> 10
            )));
        };
        if let Some(depth) = flow_depth(&text).filter(|&d| d > MAX_CONFIG_NESTING) {
            return Err(invalid(format!(
                "lists and maps are nested {depth} deep, more than the {MAX_CONFIG_NESTING} a \
                 configuration may nest"
            )));
        }
        let mut c = Config::parse(&text).map_err(invalid)?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [
            &mut c.model.spec,
            &mut c.data.train_src,
            &mut c.data.train_tgt,
            &mut c.data.valid_src,
            &mut c.data.valid_tgt,
            &mut c.checkpoint.dir,
        ]
        .into_iter()
        .chain(c.model.artifact.as_mut())
        .chain(c.data.binarized.as_mut())
        {
            if p.is_relative() && !p.as_os_str().is_empty() {
                *p = base.join(&*p);
            }
        }
        Ok(c)
    }

    /// Parses YAML text and checks the values.
    pub fn parse(text: &str) -> Result<Config, String> {
        let c: Config = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        c.check()?;
        Ok(c)
    }

    /// Checks the values (what [`Config::parse`] does after reading them): every problem,
    /// `; `-separated.
    pub fn check(&self) -> Result<(), String> {
        let mut bad = Vec::new();
        if self.model.spec.as_os_str().is_empty() && self.model.artifact.is_none() {
            bad.push(
                "model.spec is missing: give the `.kiln` spec (or `model.artifact`, a \
                 directory written by `kiln compile --config`)"
                    .to_string(),
            );
        }
        for (key, beta) in [
            ("optimizer.beta1", self.optimizer.beta1),
            ("optimizer.beta2", self.optimizer.beta2),
        ] {
            if !(0.0..1.0).contains(&beta) {
                bad.push(format!("{key} is {beta}; give a number in [0, 1)"));
            }
        }
        // NaN fails every comparison, so these are written to reject it as well.
        let positive = |key: &str, value: f64, bad: &mut Vec<String>| {
            if !(value.is_finite() && value > 0.0) {
                bad.push(format!("{key} is {value}; give a positive finite number"));
            }
        };
        positive("optimizer.eps", self.optimizer.eps, &mut bad);
        for (key, value) in [
            ("optimizer.clip_norm", self.optimizer.clip_norm),
            ("optimizer.weight_decay", self.optimizer.weight_decay),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                bad.push(format!(
                    "{key} is {value}; give a finite number, 0 (off) or more"
                ));
            }
        }
        self.schedule.check(&mut bad);
        if self.train.max_steps == 0 {
            bad.push(
                "train.max_steps is 0, so the run would take no step and write no \
                 checkpoint; give at least 1"
                    .to_string(),
            );
        }
        if self.batch.update_freq == 0 {
            bad.push("batch.update_freq must be at least 1".to_string());
        }
        if self.data.max_len == 0 {
            bad.push(
                "data.max_len is 0, which leaves no pair to train on (a sentence's tokens \
                 and its <eos>); give the length of the longest pair to keep, e.g. 256"
                    .to_string(),
            );
        }
        if self.batch.max_src_tokens == 0 || self.batch.max_tgt_tokens == 0 {
            bad.push("batch.max_src_tokens and max_tgt_tokens must be positive".to_string());
        }
        if self.checkpoint.every == 0 || self.valid.every == 0 || self.train.log_every == 0 {
            bad.push(
                "checkpoint.every, valid.every and train.log_every must be positive".to_string(),
            );
        }
        if self.checkpoint.keep == 0 {
            bad.push("checkpoint.keep must be at least 1".to_string());
        }
        self.check_valid(&mut bad);
        self.check_train(&mut bad);
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("; "))
        }
    }

    /// The `valid` section's values.
    fn check_valid(&self, bad: &mut Vec<String>) {
        if self.valid.beam == 0 || self.valid.beam > kiln_decode::search::MAX_BEAM {
            bad.push(format!(
                "valid.beam must be 1 to {}, not {}",
                kiln_decode::search::MAX_BEAM,
                self.valid.beam
            ));
        }
        if !self.valid.alpha.is_finite() {
            bad.push(format!(
                "valid.alpha is {}; give a finite number",
                self.valid.alpha
            ));
        }
        if !(self.valid.max_len_a.is_finite() && self.valid.max_len_a >= 0.0) {
            bad.push(format!(
                "valid.max_len_a is {}; give a finite number, 0 or more",
                self.valid.max_len_a
            ));
        }
        if !["gnmt", "len_pow", "none"].contains(&self.valid.length_penalty.as_str()) {
            bad.push(format!(
                "valid.length_penalty is `{}`; use gnmt, len_pow or none",
                self.valid.length_penalty
            ));
        }
        if kiln_decode::search::EarlyStop::parse(&self.valid.early_stop).is_none() {
            bad.push(format!(
                "valid.early_stop is `{}`; use {}",
                self.valid.early_stop,
                kiln_decode::search::EarlyStop::NAMES.join(" or ")
            ));
        }
        match self.valid.best_metric() {
            "loss" => {}
            "bleu" if self.valid.bleu => {}
            "bleu" => bad.push(
                "valid.metric is `bleu` but valid.bleu is false: set `bleu: true` to \
             compute it, or use `metric: loss`"
                    .to_string(),
            ),
            other => bad.push(format!("valid.metric is `{other}`; use loss or bleu")),
        }
    }

    /// The `train` section's executor, products, loss scale, divergence and devices, and
    /// the vocabulary's lower bound.
    fn check_train(&self, bad: &mut Vec<String>) {
        match ExecutorKind::parse(&self.train.executor) {
            None => bad.push(format!(
                "train.executor is `{}`; use compiled, eager, reference or cuda",
                self.train.executor
            )),
            // The device optimizer is Adam alone (its kernel and constants).
            Some(ExecutorKind::Cuda)
                if self.optimizer.clip_norm != 0.0 || self.optimizer.weight_decay != 0.0 =>
            {
                bad.push(
                    "optimizer.clip_norm and optimizer.weight_decay run in the host optimizer,                      not yet with train.executor: cuda; drop them or train on the CPU"
                        .to_string(),
                )
            }
            Some(_) => {}
        }
        if let Some(g) = &self.train.gemm_type {
            match kiln_exec::compiled::GemmType::parse(g) {
                None => bad.push(format!(
                    "train.gemm_type is `{g}`; use {}",
                    kiln_exec::compiled::GemmType::NAMES.join(", ")
                )),
                Some(kiln_exec::compiled::GemmType::Kernel(
                    kiln_exec::compiled::Kernel16::Int8,
                )) => bad.push(format!(
                    "train.gemm_type `{g}` rounds every product's operands to 8 bits, which \
                     translation takes and training does not: use f32 or 16bit here, and \
                     `kiln translate --gemm-type int8` for the trained model"
                )),
                Some(t)
                    if t != kiln_exec::compiled::GemmType::F32
                        && self.train.executor_kind() != ExecutorKind::Compiled =>
                {
                    bad.push(format!(
                        "train.gemm_type `{g}` chooses the compiled CPU executor's matrix \
                     products, but train.executor is `{}`: set train.executor to \
                     compiled, or leave train.gemm_type out",
                        self.train.executor
                    ))
                }
                Some(_) => {}
            }
        }
        if self.data.vocab_size < 8 {
            bad.push("data.vocab_size must be at least 8".to_string());
        }
        if let Some(ls) = &self.train.loss_scale {
            let pow2 = ls.init.is_finite()
                && ls.init > 0.0
                && (ls.init as f32) as f64 == ls.init
                && (ls.init as f32).to_bits() & 0x007f_ffff == 0
                && (ls.init as f32).is_normal();
            if !pow2 {
                bad.push(format!(
                    "train.loss_scale.init is {}; use a power of two from 2^-126 to 2^127, \
                 e.g. 65536",
                    ls.init
                ));
            }
            if ls.window == 0 {
                bad.push("train.loss_scale.window must be at least 1".to_string());
            }
            if !(ls.min.is_finite() && ls.min > 0.0 && ls.min <= ls.init) {
                bad.push(format!(
                    "train.loss_scale.min is {}; use a positive number no larger than init ({})",
                    ls.min, ls.init
                ));
            }
        }
        let dv = &self.train.divergence;
        if !(dv.factor == 0.0 || dv.factor.is_finite() && dv.factor > 1.0) {
            bad.push(format!(
                "train.divergence.factor is {}; use a number above 1 (4: the default), or 0 \
             to turn the check off",
                dv.factor
            ));
        }
        if dv.steps == 0 {
            bad.push("train.divergence.steps must be at least 1".to_string());
        }
        if let Some(devices) = &self.train.devices {
            if let Err(e) = kiln_exec::cuda::parallel::check_devices(devices) {
                bad.push(e);
            }
            if self.train.executor_kind() != ExecutorKind::Cuda {
                bad.push(format!(
                    "train.devices lists GPUs for data-parallel training, which runs on the \
                 GPU: set train.executor to cuda (it is `{}`), or leave train.devices out",
                    self.train.executor
                ));
            }
        }
    }

    /// `model.set` as `key=value` strings for the spec compiler.
    pub fn overrides(&self) -> Vec<String> {
        self.model
            .set
            .iter()
            .map(|(k, v)| {
                let text = match v {
                    serde_yaml::Value::String(s) => s.clone(),
                    serde_yaml::Value::Bool(b) => b.to_string(),
                    serde_yaml::Value::Number(n) => n.to_string(),
                    other => serde_yaml::to_string(other)
                        .unwrap_or_default()
                        .trim()
                        .to_string(),
                };
                format!("{k}={text}")
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
