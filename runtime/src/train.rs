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
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln_compiler::autodiff::LOSS_SCALE;
use kiln_compiler::ir::Graph;
use kiln_compiler::reference::RunOptions;
use kiln_compiler::tensor::{Tensor, TensorData};

use crate::artifact::Artifact;
use crate::bleu::{corpus_bleu, BleuOptions};
use crate::checkpoint::{self, AdamMoments, TrainState};
use crate::config::Config;
use crate::cuda::parallel::{micro_counter, DataParallel, RankJob};
use crate::data::{
    load_parallel, BatchConfig, BatchPlan, Dataset, Example, ParallelCorpus, Tokenizer,
};
use crate::decode::{DecodeOptions, LengthPenalty};
use crate::entry::{entry_graph, Entry};
use crate::exec::{executor, Exec, ExecutorKind};
use crate::metrics::{read_metrics, truncate_after, Kind, MetricsWriter, Record};
use crate::model::{
    write_atomic, GraphSet, CONFIG_FILE, GRAPHS_FILE, GRAPHS_FORMAT, TOKENIZER_FILE,
};
use crate::optim::Adam;
use crate::run_dir::{check_new_run_dir, check_valid_set, remove_stale_temps, CUDA_NEEDS_ARTIFACT};
use crate::translate::{check_positions, decode_workers, translate_ids, TRANSLATE_BATCH};

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
         Lower the learning rate (schedule.factor) or raise schedule.warmup_steps; \
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
    Decode(#[from] crate::decode::DecodeError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
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
        let e = |r: Result<Graph, crate::RuntimeError>| {
            r.map_err(|e| TrainError::Setup(format!("{} ({})", e.message, e.help)))
        };
        let options = kiln_compiler::autodiff::TrainStepOptions { loss_scale };
        let train_step = kiln_compiler::autodiff::train_step_with(&self.train, options)
            .map_err(|e| TrainError::Setup(format!("differentiating the model failed: {e}")))?;
        let (encode, decode_step) = crate::entry::decoder_entries(&self.eval, &self.decode)
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

/// `train.loss_scale` needs a `train_step` seeded by the `loss_scale` input.
fn loss_scale_fits(
    cfg: &Config,
    graphs: &GraphSet,
    artifact: Option<&Artifact>,
) -> Result<(), TrainError> {
    if cfg.train.loss_scale.is_none() || graphs.train_step.input(LOSS_SCALE).is_some() {
        return Ok(());
    }
    let fix = match artifact {
        Some(art) => format!(
            "the artifact `{}` was compiled without it: recompile it from this \
             configuration (`kiln compile --config CONFIG -o DIR`)",
            art.dir.display()
        ),
        None => "this run's graphs were built without it: start a new run with \
                 `kiln train --config`"
            .to_string(),
    };
    Err(TrainError::Setup(format!(
        "`train.loss_scale` needs a train_step whose backward pass is seeded by the input \
         `{LOSS_SCALE}`; {fix}"
    )))
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

/// The largest loss scale: 2^127, the largest power of two in f32.
const MAX_LOSS_SCALE: f64 = 1.7014118346046923e38;

/// What one call of `Trainer::step` did.
enum StepOutcome {
    /// An optimizer update: the token-weighted loss, target and source tokens.
    Update(f64, usize, usize),
    /// Loss scaling: a gradient overflowed, the update was skipped and the scale halved.
    Overflow { what: String, from: f64, to: f64 },
}

/// The run directory's `config.yaml` of `cfg`.
pub(crate) fn config_yaml(cfg: &Config) -> String {
    serde_yaml::to_string(cfg).expect("config serializes")
}

/// The kernel of `train.gemm_type` on this CPU: `None` where the key is absent, `Some(None)`
/// for f32; an error where this CPU cannot run it.
pub fn gemm_kernel(cfg: &Config) -> Result<Option<Option<crate::compiled::Kernel16>>, TrainError> {
    let Some(name) = &cfg.train.gemm_type else {
        return Ok(None);
    };
    crate::compiled::GemmType::parse(name)
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
    train: Vec<Example>,
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
    Device(Box<crate::cuda::CudaExecutor>),
    /// `train.devices`: device training on every listed GPU, the gradients summed by
    /// NCCL before each optimizer step (`crate::cuda::parallel`).
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

/// The artifact's vocabulary (the logits' width) must be the tokenizer's.
fn check_artifact_vocab(
    set: &GraphSet,
    tokenizer: &Tokenizer,
    art: &Artifact,
) -> Result<(), TrainError> {
    match set.vocab() {
        Some(v) if v != tokenizer.vocab_size() => Err(TrainError::Setup(format!(
            "the artifact `{}` was compiled for a vocabulary of {v} tokens, but the run's BPE \
             vocabulary has {}; compile the artifact from this configuration (`kiln compile \
             --config CONFIG.yaml -o {}`), which also stores its tokenizer",
            art.dir.display(),
            tokenizer.vocab_size(),
            art.dir.display()
        ))),
        _ => Ok(()),
    }
}

fn setup<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> TrainError + '_ {
    move |e| TrainError::Setup(format!("{what}: {e}"))
}

impl Trainer {
    /// Starts a new run in `cfg.checkpoint.dir`, which must not hold checkpoints yet.
    pub fn new(
        cfg: Config,
        tokenizer: Tokenizer,
        graphs: &ModelGraphs,
        progress: Progress,
    ) -> Result<Trainer, TrainError> {
        let set = graphs.entries_with(cfg.train.loss_scale.is_some())?;
        let params: BTreeMap<String, Tensor> =
            kiln_compiler::init::init_params(&set.loss, cfg.train.seed)
                .map_err(setup("initializing the parameters"))?
                .into_iter()
                .collect();
        Trainer::start(cfg, tokenizer, set, params, None, progress)
    }

    /// Starts a new run from a compiled artifact (`kiln compile --config … -o DIR`): its
    /// graphs, its weights as the first parameters, and — with `train.executor: compiled`
    /// — its generated kernels as they are (no optimizer, no code generator at start).
    pub fn from_artifact(
        cfg: Config,
        tokenizer: Tokenizer,
        art: &Artifact,
        progress: Progress,
    ) -> Result<Trainer, TrainError> {
        let set = art.graph_set().map_err(setup("using the artifact"))?;
        check_artifact_vocab(&set, &tokenizer, art)?;
        let params = art
            .weights()
            .map_err(setup("reading the artifact's weights"))?;
        let file = art.dir.join(kiln_compiler::artifact::WEIGHTS_FILE);
        crate::entry::check_weights(&set.loss, &file.display().to_string(), &params)
            .map_err(|e| TrainError::Setup(format!("{} ({})", e.message, e.help)))?;
        let mut t = Trainer::start(cfg, tokenizer, set, params, Some(art), progress)?;
        t.notes.push(format!(
            "from the artifact {} (seed {}, {} parameter tensors)",
            art.dir.display(),
            art.manifest.seed,
            t.params.len()
        ));
        Ok(t)
    }

    fn start(
        cfg: Config,
        tokenizer: Tokenizer,
        set: GraphSet,
        params: BTreeMap<String, Tensor>,
        artifact: Option<&Artifact>,
        progress: Progress,
    ) -> Result<Trainer, TrainError> {
        loss_scale_fits(&cfg, &set, artifact)?;
        check_new_run_dir(&cfg)?;
        let dir = cfg.checkpoint.dir.clone();
        let adam = Adam::new(
            cfg.optimizer.beta1,
            cfg.optimizer.beta2,
            cfg.optimizer.eps,
            &params,
        );
        let state = TrainState {
            seed: cfg.train.seed,
            config_digest: digest(&cfg),
            loss_scale: cfg.train.loss_scale.as_ref().map(|l| l.init),
            ..TrainState::default()
        };
        let cfg_yaml = config_yaml(&cfg);
        let program = Program {
            graphs: set,
            artifact,
        };
        // The data, the executors and the schedule are checked before the run directory
        // gets its configuration: a start that fails leaves no run behind.
        let trainer = Trainer::assemble(cfg, tokenizer, program, params, adam, state, progress)?;
        std::fs::create_dir_all(&dir).map_err(|e| TrainError::Write {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        remove_stale_temps(&dir)?;
        write_atomic(&dir.join(CONFIG_FILE), cfg_yaml.as_bytes()).map_err(|e| {
            TrainError::Write {
                path: dir.join(CONFIG_FILE),
                message: e.to_string(),
            }
        })?;
        // A fresh run starts a fresh log.
        let _ = std::fs::remove_file(dir.join(crate::metrics::FILE_NAME));
        Ok(trainer)
    }

    /// Continues the run in `dir` from its newest checkpoint.
    pub fn resume(dir: &Path, progress: Progress) -> Result<Trainer, TrainError> {
        let cfg_path = dir.join(CONFIG_FILE);
        if !cfg_path.is_file() {
            return Err(TrainError::Setup(format!(
                "`{}` is not a run directory: it has no `{CONFIG_FILE}`; give the `checkpoint.dir` of a run",
                dir.display()
            )));
        }
        remove_stale_temps(dir)?;
        let text =
            std::fs::read_to_string(&cfg_path).map_err(setup("reading the run's configuration"))?;
        let mut cfg = Config::parse(&text)
            .map_err(|m| TrainError::Setup(format!("`{}`: {m}", cfg_path.display())))?;
        cfg.checkpoint.dir = dir.to_path_buf();
        let Some(ck) = checkpoint::latest(&dir.join("checkpoints"))? else {
            return Err(TrainError::Setup(format!(
                "`{}` has no checkpoint to resume from; start it with `kiln train --config`",
                dir.display()
            )));
        };
        // The graphs first: the weights are checked against them before the optimizer
        // state is compared with the weights, so each damaged file is named as such.
        let graphs_bytes = checkpoint::read_extra(&ck.dir, GRAPHS_FILE)?;
        let set = GraphSet::from_json(&graphs_bytes, &ck.dir.join(GRAPHS_FILE))?;
        let loaded = checkpoint::load_checked(&ck.dir, &|file, params| {
            crate::entry::check_weights_fit(&set.loss, &file.display().to_string(), params)
                .map_err(|e| e.message)
        })?;
        let changed = digest_changes(&loaded.state.config_digest, &digest(&cfg));
        if !changed.is_empty() {
            return Err(TrainError::Setup(format!(
                "`{}` differs in {} from the configuration {} was trained with; an exact \
                 resume needs the same model, data, batch, optimizer, schedule, seed and \
                 executor (how long to train, logging, checkpoints and validation may \
                 change): undo the edit, or start a new run with `kiln train --config`",
                cfg_path.display(),
                changed.join(", "),
                ck.dir.display()
            )));
        }
        // A run started from an artifact continues on its kernels, if it still matches.
        let artifact = match &cfg.model.artifact {
            Some(path) => {
                let art = Artifact::load(path).map_err(setup("loading `model.artifact`"))?;
                let same = art
                    .graph_set()
                    .map(|g| g.to_json() == set.to_json())
                    .unwrap_or(false);
                if !same {
                    return Err(TrainError::Setup(format!(
                        "the artifact `{}` no longer holds the graphs this run was trained \
                         with (checkpoint {}); recompile it from the run's configuration \
                         (`kiln compile --config {} -o {}`) or point `model.artifact` at \
                         the original",
                        path.display(),
                        ck.dir.display(),
                        cfg_path.display(),
                        path.display()
                    )));
                }
                Some(art)
            }
            None => None,
        };
        let tok_bytes = checkpoint::read_extra(&ck.dir, TOKENIZER_FILE)?;
        let tokenizer = Tokenizer::from_json(
            &String::from_utf8_lossy(&tok_bytes),
            &ck.dir.join(TOKENIZER_FILE),
        )?;
        crate::model::check_vocab(&tokenizer, set.vocab(), &ck.dir.join(TOKENIZER_FILE))?;
        let mut adam = Adam::new(
            cfg.optimizer.beta1,
            cfg.optimizer.beta2,
            cfg.optimizer.eps,
            &loaded.params,
        );
        let mut moments: BTreeMap<String, Tensor> = BTreeMap::new();
        for (k, t) in &loaded.moments.m {
            moments.insert(format!("m.{k}"), t.clone());
        }
        for (k, t) in &loaded.moments.v {
            moments.insert(format!("v.{k}"), t.clone());
        }
        adam.load_state(loaded.state.step, &loaded.params, &moments)
            .map_err(setup("restoring the optimizer"))?;
        // Records written after this checkpoint belong to the run that is being redone.
        let _ = truncate_after(&dir.join(crate::metrics::FILE_NAME), loaded.state.step);
        let program = Program {
            graphs: set,
            artifact: artifact.as_ref(),
        };
        let mut t = Trainer::assemble(
            cfg,
            tokenizer,
            program,
            loaded.params,
            adam,
            loaded.state,
            progress,
        )?;
        t.notes.push(format!(
            "resumed from {} (step {})",
            ck.dir.display(),
            ck.step
        ));
        Ok(t)
    }

    fn assemble(
        cfg: Config,
        tokenizer: Tokenizer,
        program: Program<'_>,
        params: BTreeMap<String, Tensor>,
        adam: Adam,
        mut state: TrainState,
        progress: Progress,
    ) -> Result<Trainer, TrainError> {
        let Program { graphs, artifact } = program;
        let mut notes = Vec::new();
        loss_scale_fits(&cfg, &graphs, artifact)?;
        if let Some(ls) = &cfg.train.loss_scale {
            state.loss_scale.get_or_insert(ls.init);
            notes.push(format!(
                "dynamic loss scaling: scale {} (init {}, doubled after {} good steps, \
                 minimum {})",
                scale_text(state.loss_scale.unwrap_or(ls.init)),
                scale_text(ls.init),
                ls.window,
                ls.min
            ));
        }
        let corpus = load_parallel(&cfg.data.train_src, &cfg.data.train_tgt)?;
        let train = Dataset::build(&corpus, &tokenizer, Some(cfg.data.max_len))?;
        if train.examples.is_empty() {
            return Err(TrainError::Setup(format!(
                "no training pairs left in `{}` (empty: {}, longer than {}: {})",
                cfg.data.train_src.display(),
                train.skipped_empty,
                cfg.data.max_len,
                train.dropped_too_long
            )));
        }
        notes.push(format!(
            "{} training pairs ({} skipped as empty, {} longer than {} tokens)",
            train.examples.len(),
            train.skipped_empty,
            train.dropped_too_long,
            cfg.data.max_len
        ));
        let bcfg = BatchConfig {
            max_src_tokens: cfg.batch.max_src_tokens,
            max_tgt_tokens: cfg.batch.max_tgt_tokens,
        };
        let plan = BatchPlan::new(&train.examples, bcfg)?;
        let valid_corpus = load_parallel(&cfg.data.valid_src, &cfg.data.valid_tgt)?;
        let mut valid = Dataset::build(&valid_corpus, &tokenizer, None)?;
        if cfg.valid.max_sentences > 0 {
            valid.examples.truncate(cfg.valid.max_sentences);
            valid.lines.truncate(cfg.valid.max_sentences);
        }
        // (Checked before a new run starts; a resumed run's data may have changed since.)
        check_valid_set(&cfg, &valid_corpus)?;
        // A learned positional table covers `max_len` positions of the model; a pair
        // beyond it would stop the run at its first batch or validation.
        for (ds, src_path, tgt_path, fix) in [
            (
                &train,
                &cfg.data.train_src,
                &cfg.data.train_tgt,
                "set `data.max_len` to that or less (longer pairs are left out)",
            ),
            (
                &valid,
                &cfg.data.valid_src,
                &cfg.data.valid_tgt,
                "remove the pair from the validation set",
            ),
        ] {
            let ex = &ds.examples;
            let line = |i: usize| ds.lines[i] + 1;
            check_positions(
                &graphs.loss,
                "src_len",
                ex.len(),
                &|i| ex[i].src_positions(),
                &|i| format!("`{}` line {}", src_path.display(), line(i)),
                fix,
            )
            .and_then(|()| {
                check_positions(
                    &graphs.loss,
                    "tgt_len",
                    ex.len(),
                    &|i| ex[i].tgt_positions(),
                    &|i| {
                        format!(
                            "`{}` line {} (its tokens and <bos> or <eos>)",
                            tgt_path.display(),
                            line(i)
                        )
                    },
                    fix,
                )
            })
            .map_err(TrainError::Setup)?;
        }
        let valid_plan = BatchPlan::new(&valid.examples, bcfg)?;
        notes.push(format!(
            "{} batches per epoch; {} validation pairs",
            plan.len(),
            valid.examples.len()
        ));
        let kind = ExecutorKind::parse(&cfg.train.executor).unwrap_or(ExecutorKind::Compiled);
        // With an artifact and the compiled executor, its kernels run as they are;
        // otherwise the executor is built from the graph now.
        let cuda = cfg.train.executor == "cuda";
        let ex = |name: &str, g: &Graph| -> Result<Box<dyn Exec>, TrainError> {
            match artifact {
                Some(art) if cuda => {
                    // Validation and decoding run on the first GPU of the run.
                    let device = cfg
                        .train
                        .devices
                        .as_ref()
                        .and_then(|d| d.first())
                        .copied()
                        .unwrap_or(0);
                    let options = crate::cuda::CudaOptions {
                        device,
                        ..crate::cuda::CudaOptions::default()
                    };
                    crate::cuda::CudaExecutor::with_options(art, name, options)
                        .map(|e| Box::new(e) as Box<dyn Exec>)
                        .map_err(|e| TrainError::Setup(e.to_string()))
                }
                None if cuda => Err(TrainError::Setup(CUDA_NEEDS_ARTIFACT.to_string())),
                Some(art) if kind == ExecutorKind::Compiled => Ok(Box::new(
                    art.executor(name).map_err(setup("preparing an executor"))?,
                )),
                _ => executor(kind, g.clone()).map_err(setup("preparing an executor")),
            }
        };
        let d_model = match cfg.schedule.d_model {
            Some(d) => d,
            None => graphs
                .loss
                .hparam("d_model")
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or_else(|| {
                    TrainError::Setup(
                        "the spec has no `d_model` parameter for the learning-rate schedule; set `schedule.d_model`"
                            .to_string(),
                    )
                })?,
        };
        let mut train_exec = match (artifact, &cfg.train.devices) {
            (Some(art), Some(devices)) if cuda => {
                let dp = DataParallel::new(
                    art,
                    "train_step",
                    devices,
                    crate::cuda::CudaOptions::default(),
                )
                .map_err(TrainError::Setup)?;
                notes.push(format!(
                    "data parallel on GPUs {} ({}): each step takes {} batch(es) per GPU",
                    devices
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    dp.engine(),
                    cfg.batch.update_freq
                ));
                TrainExec::Parallel(Box::new(dp))
            }
            (Some(art), _) if cuda => TrainExec::Device(Box::new(
                crate::cuda::CudaExecutor::with_options(
                    art,
                    "train_step",
                    crate::cuda::CudaOptions::default(),
                )
                .map_err(|e| TrainError::Setup(e.to_string()))?,
            )),
            _ => TrainExec::Host(ex("train_step", &graphs.train_step)?),
        };
        let mut loss_exec = ex("loss", &graphs.loss)?;
        let mut encode_exec = ex("encode", &graphs.encode)?;
        let mut step_exec = ex("decode_step", &graphs.decode_step)?;
        // `train.gemm_type`: the compiled executors' large products (absent: as
        // `KILN_CPU_BF16` says, which the executors read themselves).
        if let Some(kernel) = gemm_kernel(&cfg)? {
            let host = match &mut train_exec {
                TrainExec::Host(e) => Some(e),
                _ => None,
            };
            for e in host
                .into_iter()
                .chain([&mut loss_exec, &mut encode_exec, &mut step_exec])
            {
                if let Some(c) = e.as_compiled_mut() {
                    c.set_bf16_kernel(kernel)
                        .map_err(|e| TrainError::Setup(e.to_string()))?;
                }
            }
            notes.push(format!(
                "matrix products: {}",
                kernel.map_or("f32".to_string(), |k| k.name().to_string())
            ));
        }
        // Training, validation and decoding never run at once: compiled CPU programs
        // share the training step's arena.
        if let TrainExec::Host(train) = &mut train_exec {
            if let Some(shared) = train.as_compiled_mut() {
                for e in [&mut loss_exec, &mut encode_exec, &mut step_exec] {
                    if let Some(c) = e.as_compiled_mut() {
                        c.share_arena_with(shared);
                    }
                }
            }
        }
        Ok(Trainer {
            train_exec,
            device: DeviceState::Off,
            loss_exec,
            encode_exec,
            step_exec,
            graphs_json: graphs.to_json(),
            graphs,
            dir: cfg.checkpoint.dir.clone(),
            cfg,
            tokenizer,
            train: train.examples,
            plan,
            valid: valid.examples,
            valid_plan,
            valid_lines: valid.lines,
            valid_corpus,
            params,
            adam,
            state,
            d_model,
            progress,
            notes,
        })
    }

    /// Changes the stopping point (e.g. to continue a finished run for more steps).
    pub fn set_limits(&mut self, max_steps: Option<u64>, max_seconds: Option<u64>) {
        if let Some(n) = max_steps {
            self.cfg.train.max_steps = n;
        }
        if let Some(s) = max_seconds {
            self.cfg.train.max_seconds = s;
        }
    }

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

    /// Where this run writes its checkpoints (`<run dir>/checkpoints`).
    pub fn checkpoint_root(&self) -> PathBuf {
        self.dir.join("checkpoints")
    }

    /// The next batch, advancing the data position (epochs wrap around).
    fn next_batch(&mut self) -> crate::data::Batch {
        if self.state.batch_in_epoch as usize >= self.plan.len() {
            self.state.epoch += 1;
            self.state.batch_in_epoch = 0;
        }
        let order = self.plan.epoch_order(self.state.seed, self.state.epoch);
        let b = order[self.state.batch_in_epoch as usize];
        self.state.batch_in_epoch += 1;
        self.plan
            .batch(&self.train, b)
            .expect("batch index from the plan")
    }

    /// The value of the `loss_scale` input, when `train_step` has one: the run's scale
    /// (`train.loss_scale`), or 1 for a loss-scaled graph trained without scaling.
    fn scale_input(&self) -> Option<f32> {
        self.graphs.train_step.input(LOSS_SCALE)?;
        Some(self.state.loss_scale.unwrap_or(1.0) as f32)
    }

    /// One optimizer step: the token-weighted loss and the target and source tokens; or,
    /// with dynamic loss scaling, a skipped step whose gradients overflowed.
    fn step(&mut self, grads: &mut BTreeMap<String, Vec<f32>>) -> Result<StepOutcome, TrainError> {
        let step = self.state.step + 1;
        let objective = self
            .graphs
            .train_step
            .objective
            .clone()
            .unwrap_or_else(|| "loss".to_string());
        let (mut loss_sum, mut tokens, mut src_tokens) = (0.0f64, 0usize, 0usize);
        let scale = self.scale_input();
        // A gradient that is not finite: the parameter and the value.
        let mut overflow: Option<(String, f32)> = None;
        // The parameters stay as they are until the optimizer step below.
        let params_version = Some(crate::exec::fresh_params_version());
        let update_freq = self.cfg.batch.update_freq;
        let world = self.world_size();
        for round in 0..update_freq {
            // Round `round`: one micro-batch per rank (one rank but in data parallel).
            let mut jobs = Vec::with_capacity(world);
            // Each micro-batch's target and source tokens.
            let mut counts = Vec::with_capacity(world);
            for rank in 0..world {
                let batch = self.next_batch();
                let mut inputs = BTreeMap::new();
                inputs.insert("src".to_string(), batch.src);
                inputs.insert("tgt_in".to_string(), batch.tgt_in);
                inputs.insert("tgt_out".to_string(), batch.tgt_out);
                if let Some(s) = scale {
                    let t = Tensor::f32(vec![], vec![s]).map_err(setup("the loss scale"))?;
                    inputs.insert(LOSS_SCALE.to_string(), t);
                }
                let counter = micro_counter(step, update_freq, world, round, rank);
                let opts = RunOptions {
                    seed: self.state.seed,
                    step: counter as u32,
                    params_version,
                    ..RunOptions::default()
                };
                // The gradients come scaled: unscaled by the weight (exact for a power of
                // two).
                let weight = batch.n_tgt_tokens as f32 / scale.unwrap_or(1.0);
                jobs.push(RankJob {
                    inputs,
                    opts,
                    weight,
                });
                counts.push((batch.n_tgt_tokens, batch.n_src_tokens));
            }
            let first = round == 0;
            let losses: Vec<f32> = match &self.train_exec {
                TrainExec::Host(exec) => {
                    let j = &jobs[0];
                    let out = exec
                        .run_map(&j.inputs, &self.params, &j.opts)
                        .map_err(|source| TrainError::Exec { step, source })?;
                    let loss = finite_loss(&out, &objective, step)?;
                    let acc = accumulate(grads, &out, j.weight, first);
                    // The outputs' storage goes back to the executor for the next run.
                    exec.recycle(out.into_values().collect());
                    match acc {
                        Ok(()) => {}
                        Err(Accumulate::Missing(name)) => {
                            return Err(TrainError::Setup(format!(
                                "train_step has no gradient for `{name}`"
                            )))
                        }
                        Err(Accumulate::NonFinite(name, value)) => {
                            overflow = Some((name, value));
                        }
                    }
                    vec![loss]
                }
                TrainExec::Device(exec) => {
                    if self.device == DeviceState::Off {
                        exec.train_begin(&self.params, &self.adam.m, &self.adam.v)
                            .map_err(|source| TrainError::Exec { step, source })?;
                        self.device = DeviceState::InSync;
                    }
                    let j = &jobs[0];
                    let out = exec
                        .train_micro(&j.inputs, &self.params, &j.opts, j.weight, first, None)
                        .map_err(|source| TrainError::Exec { step, source })?;
                    overflow = out.non_finite;
                    vec![finite_loss(
                        &out.outputs.into_iter().collect(),
                        &objective,
                        step,
                    )?]
                }
                TrainExec::Parallel(dp) => {
                    if self.device == DeviceState::Off {
                        dp.train_begin(&self.params, &self.adam.m, &self.adam.v)
                            .map_err(|source| TrainError::Exec { step, source })?;
                        self.device = DeviceState::InSync;
                    }
                    let outs = dp
                        .train_micro(&jobs, &self.params, first)
                        .map_err(|source| TrainError::Exec { step, source })?;
                    let mut losses = Vec::with_capacity(outs.len());
                    for out in outs {
                        // The first rank (in rank order) whose gradients overflowed.
                        if overflow.is_none() {
                            overflow = out.non_finite;
                        }
                        losses.push(finite_loss(
                            &out.outputs.into_iter().collect(),
                            &objective,
                            step,
                        )?);
                    }
                    losses
                }
            };
            if let Some((name, value)) = overflow.take() {
                return self.overflowed(step, name, value);
            }
            for (loss, (tgt, src)) in losses.into_iter().zip(counts) {
                loss_sum += loss as f64 * tgt as f64;
                tokens += tgt;
                src_tokens += src;
            }
        }
        let inv = 1.0 / tokens.max(1) as f32;
        let lr = self.cfg.schedule.lr(self.d_model, step);
        // Device training: the same constants and op order as `Adam::step` (see
        // `optim::constants`).
        let constants = self.adam.constants(self.adam.t + 1, lr);
        let on_device = match &self.train_exec {
            TrainExec::Host(_) => {
                use rayon::prelude::*;
                grads.par_iter_mut().for_each(|(_, g)| {
                    g.par_chunks_mut(ACC_CHUNK)
                        .for_each(|c| c.iter_mut().for_each(|x| *x *= inv))
                });
                self.adam
                    .step(&mut self.params, grads, lr)
                    .map_err(setup("the optimizer step"))?;
                None
            }
            TrainExec::Device(exec) => Some(exec.train_update(constants, inv)),
            TrainExec::Parallel(dp) => Some(dp.train_update(constants, inv)),
        };
        if let Some(done) = on_device {
            done.map_err(|source| TrainError::Exec { step, source })?;
            self.adam.t += 1;
            self.device = DeviceState::Ahead;
        }
        if let (Some(ls), Some(s)) = (&self.cfg.train.loss_scale, self.state.loss_scale) {
            self.state.loss_scale_good_steps += 1;
            if self.state.loss_scale_good_steps >= ls.window {
                self.state.loss_scale = Some((s * 2.0).min(MAX_LOSS_SCALE));
                self.state.loss_scale_good_steps = 0;
            }
        }
        self.state.step = step;
        self.state.lr = lr;
        self.state.tgt_tokens_seen += tokens as u64;
        self.state.src_tokens_seen += src_tokens as u64;
        Ok(StepOutcome::Update(
            loss_sum / tokens.max(1) as f64,
            tokens,
            src_tokens,
        ))
    }

    /// A gradient that is not finite at step `step`: with dynamic loss scaling, the step
    /// is skipped (nothing was updated; the next step's first micro-batch overwrites the
    /// accumulated gradients) and the scale halved, unless that goes below the minimum;
    /// without it, an error.
    fn overflowed(
        &mut self,
        step: u64,
        name: String,
        value: f32,
    ) -> Result<StepOutcome, TrainError> {
        let what = format!("the gradient of `{name}`");
        let (Some(ls), Some(from)) = (&self.cfg.train.loss_scale, self.state.loss_scale) else {
            return Err(TrainError::NonFinite {
                step,
                what,
                value,
                kept: Kept::default(),
            });
        };
        let to = from / 2.0;
        if to < ls.min {
            return Err(TrainError::LossScale {
                step,
                what,
                scale: from,
                min: ls.min,
                kept: Kept::default(),
            });
        }
        self.state.loss_scale = Some(to);
        self.state.loss_scale_good_steps = 0;
        self.state.overflows += 1;
        Ok(StepOutcome::Overflow { what, from, to })
    }

    /// Device training: copies the device's parameters and Adam moments to the host
    /// when the device is ahead (before validation, checkpoints and at the end of
    /// [`Trainer::run`]); nothing otherwise.
    fn sync_device(&mut self) -> Result<(), TrainError> {
        if self.device != DeviceState::Ahead {
            return Ok(());
        }
        let (params, m, v) = (&mut self.params, &mut self.adam.m, &mut self.adam.v);
        let done = match &self.train_exec {
            TrainExec::Host(_) => Ok(()),
            TrainExec::Device(exec) => exec.train_download(params, m, v),
            TrainExec::Parallel(dp) => dp.train_download(params, m, v),
        };
        done.map_err(|source| TrainError::Exec {
            step: self.state.step,
            source,
        })?;
        self.device = DeviceState::InSync;
        Ok(())
    }

    /// Ranks of data-parallel training (GPUs); 1 otherwise.
    fn world_size(&self) -> usize {
        match &self.train_exec {
            TrainExec::Parallel(dp) => dp.world_size(),
            _ => 1,
        }
    }

    /// Validation loss (token-weighted) and, if configured, BLEU of beam search.
    pub fn validate(&self) -> Result<(f64, Option<f64>), TrainError> {
        let objective = self
            .graphs
            .loss
            .objective
            .clone()
            .unwrap_or_else(|| "loss".to_string());
        let (mut sum, mut tokens) = (0.0f64, 0usize);
        // `&self`: the parameters cannot change during the pass.
        let opts = RunOptions {
            params_version: Some(crate::exec::fresh_params_version()),
            ..RunOptions::default()
        };
        for b in 0..self.valid_plan.len() {
            let batch = self.valid_plan.batch(&self.valid, b).expect("valid batch");
            let mut inputs = BTreeMap::new();
            inputs.insert("src".to_string(), batch.src);
            inputs.insert("tgt_in".to_string(), batch.tgt_in);
            inputs.insert("tgt_out".to_string(), batch.tgt_out);
            let out = self
                .loss_exec
                .run_map(&inputs, &self.params, &opts)
                .map_err(|source| TrainError::Exec {
                    step: self.state.step,
                    source,
                })?;
            let l = scalar(&out, &objective).unwrap_or(f32::NAN) as f64;
            sum += l * batch.n_tgt_tokens as f64;
            tokens += batch.n_tgt_tokens;
        }
        let loss = sum / tokens.max(1) as f64;
        if !self.cfg.valid.bleu {
            return Ok((loss, None));
        }
        let v = &self.cfg.valid;
        let opts = DecodeOptions {
            beam: v.beam,
            greedy: false,
            penalty: LengthPenalty::parse(&v.length_penalty, v.alpha)
                .unwrap_or(LengthPenalty::Gnmt(v.alpha)),
            max_len_a: v.max_len_a,
            max_len_b: v.max_len_b,
            ..DecodeOptions::default()
        };
        let n = self.valid.len();
        let srcs: Vec<Vec<i32>> = self.valid[..n].iter().map(|e| e.src.clone()).collect();
        let hyps = translate_ids(
            &*self.encode_exec,
            &*self.step_exec,
            &self.params,
            &srcs,
            &opts,
            self.vocab(),
            TRANSLATE_BATCH,
            decode_workers(&*self.step_exec),
            &mut |_| {},
        )?;
        let hyps: Vec<String> = hyps.iter().map(|h| self.tokenizer.decode(h)).collect();
        let refs: Vec<String> = self.valid_lines[..n]
            .iter()
            .map(|&l| self.valid_corpus.tgt[l].clone())
            .collect();
        let bleu = corpus_bleu(&hyps, &[refs], &BleuOptions::default())
            .map_err(|e| TrainError::Setup(format!("BLEU: {e}")))?;
        Ok((loss, Some(bleu.score)))
    }

    fn vocab(&self) -> usize {
        self.graphs.vocab().unwrap_or(self.tokenizer.vocab_size())
    }

    /// Writes a checkpoint of the current state and keeps the last `keep`.
    pub fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        let mut m = BTreeMap::new();
        let mut v = BTreeMap::new();
        for (name, p) in &self.params {
            let t = |x: &Vec<f32>| Tensor {
                shape: p.shape.clone(),
                data: TensorData::F32(x.clone()),
            };
            m.insert(name.clone(), t(&self.adam.m[name]));
            v.insert(name.clone(), t(&self.adam.v[name]));
        }
        let tok = self.tokenizer.to_json()?;
        let cfg_yaml = serde_yaml::to_string(&self.cfg).expect("config serializes");
        let files: [(&str, &[u8]); 3] = [
            (GRAPHS_FILE, &self.graphs_json),
            (TOKENIZER_FILE, tok.as_bytes()),
            (CONFIG_FILE, cfg_yaml.as_bytes()),
        ];
        let root = self.dir.join("checkpoints");
        let ck = checkpoint::save(
            &root,
            &self.state,
            &self.params,
            &AdamMoments { m, v },
            &files,
        )?;
        checkpoint::prune(&root, self.cfg.checkpoint.keep)?;
        Ok(ck.dir)
    }

    /// Writes the current parameters as the model directory `<run>/best/`.
    fn save_best(&self) -> Result<PathBuf, TrainError> {
        let dir = self.dir.join("best");
        let tok = self.tokenizer.to_json()?;
        crate::model::save_dir(&dir, &self.params, &self.graphs_json, tok.as_bytes()).map_err(
            |e| TrainError::Write {
                path: dir.clone(),
                message: e.to_string(),
            },
        )?;
        let cfg_yaml = serde_yaml::to_string(&self.cfg).expect("config serializes");
        write_atomic(&dir.join(CONFIG_FILE), cfg_yaml.as_bytes()).map_err(|e| {
            TrainError::Write {
                path: dir.join(CONFIG_FILE),
                message: e.to_string(),
            }
        })?;
        Ok(dir)
    }

    /// What `valid.patience` says of the validations so far: `Some(why)` once that many
    /// in a row were no better than the best.
    fn patience_spent(&self) -> Option<String> {
        let patience = self.cfg.valid.patience;
        if patience == 0 || self.state.bad_validations < patience {
            return None;
        }
        let (name, best) = if self.cfg.valid.metric == "bleu" {
            ("BLEU", self.state.best_bleu.map(|b| format!("{b:.2}")))
        } else {
            ("loss", self.state.best_val_loss.map(|l| format!("{l:.4}")))
        };
        Some(format!(
            "stopped early at step {}: {} validation{} in a row without a better {name} than \
             {} (step {}); valid.patience is {patience}",
            self.state.step,
            self.state.bad_validations,
            if self.state.bad_validations == 1 {
                ""
            } else {
                "s"
            },
            best.unwrap_or_else(|| "none".into()),
            self.state
                .best_step
                .map_or_else(|| "?".to_string(), |s| s.to_string()),
        ))
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
        let metrics_path = self.dir.join(crate::metrics::FILE_NAME);
        let mut metrics = MetricsWriter::open(&metrics_path).map_err(|e| TrainError::Write {
            path: metrics_path.clone(),
            message: e.to_string(),
        })?;
        let bar = match self.progress {
            Progress::Auto if std::io::stderr().is_terminal() => {
                let b = indicatif::ProgressBar::new(total);
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{elapsed_precise} [{bar:30}] step {pos}/{len} {msg}",
                    )
                    .expect("valid template")
                    .progress_chars("=> "),
                );
                b.set_position(self.state.step);
                Some(b)
            }
            _ => None,
        };
        let lines = matches!(self.progress, Progress::Auto | Progress::Lines) && bar.is_none();
        let mut summary = Summary::default();
        let (mut interval_loss, mut interval_tokens, mut interval_steps) = (0.0f64, 0usize, 0u64);
        let mut interval_start = Instant::now();
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
        let mut stop_early = false;
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
                    let msg = format!(
                        "step {}: {what} overflowed at loss scale {}; step skipped, scale {}",
                        self.state.step + 1,
                        scale_text(from),
                        scale_text(to)
                    );
                    if bar.is_some() || lines {
                        progress_line(&bar, &msg);
                    }
                    continue;
                }
            };
            train_time += t0.elapsed().as_secs_f64();
            all_tokens += tokens + src_tokens;
            interval_loss += loss * tokens as f64;
            interval_tokens += tokens;
            interval_steps += 1;
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
            if let Some(b) = &bar {
                b.set_position(step);
                let tps = all_tokens as f64 / train_time.max(1e-9);
                b.set_message(format!(
                    "loss {loss:.4} lr {:.2e} {:.0} tok/s",
                    self.state.lr, tps
                ));
            }
            if step.is_multiple_of(self.cfg.train.log_every) || step == total {
                let secs = interval_start.elapsed().as_secs_f64().max(1e-9);
                let avg = interval_loss / interval_tokens.max(1) as f64;
                let tps = interval_tokens as f64 / secs;
                let logged = metrics.write(&Record {
                    step,
                    kind: Kind::Train,
                    loss: Some(avg),
                    lr: Some(self.state.lr),
                    tokens_per_s: Some(tps),
                    bleu: None,
                });
                if let Err(e) = logged {
                    return Err(self.keeping_the_step(TrainError::Write {
                        path: metrics_path.clone(),
                        message: e.to_string(),
                    }));
                }
                if lines {
                    progress_line(
                        &bar,
                        &format!(
                            "step {step}/{total}  loss {avg:.4}  lr {:.3e}  {:.0} target tok/s  epoch {}  {:.0}s",
                            self.state.lr,
                            tps,
                            self.state.epoch,
                            started.elapsed().as_secs_f64()
                        ),
                    );
                }
                (interval_loss, interval_tokens, interval_steps) = (0.0, 0, 0);
                interval_start = Instant::now();
            }
            let _ = interval_steps;
            let last = step == total;
            // Some(improved) when this step was validated.
            let mut validated = None;
            if step.is_multiple_of(self.cfg.valid.every) || last {
                self.sync_device()?;
                let (vl, vb) = match self.validate() {
                    Ok(v) => v,
                    Err(e) => return Err(self.keeping_the_step(e)),
                };
                summary.valid_loss = Some(vl);
                summary.valid_bleu = vb;
                let improved = if self.cfg.valid.metric == "bleu" {
                    vb.is_some_and(|b| self.state.best_bleu.is_none_or(|x| b > x))
                } else {
                    self.state.best_val_loss.is_none_or(|x| vl < x)
                };
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
                let logged = metrics.write(&Record {
                    step,
                    kind: Kind::Valid,
                    loss: Some(vl),
                    lr: None,
                    tokens_per_s: None,
                    bleu: vb,
                });
                if let Err(e) = logged {
                    return Err(self.keeping_the_step(TrainError::Write {
                        path: metrics_path.clone(),
                        message: e.to_string(),
                    }));
                }
                let msg = format!(
                    "step {step}: validation loss {vl:.4}{}",
                    vb.map(|b| format!(", BLEU {b:.2}")).unwrap_or_default()
                );
                if bar.is_some() || lines {
                    progress_line(&bar, &msg);
                }
                validated = Some(improved);
            }
            if step.is_multiple_of(self.cfg.checkpoint.every) || last {
                self.sync_device()?;
                summary.checkpoint = Some(self.save_checkpoint()?);
            }
            // After the checkpoint, so that neither can cost the steps since the last one.
            if let Some(improved) = validated {
                // The plot is a picture of metrics.jsonl: a failure to draw it is said,
                // even with --quiet, and training goes on.
                if let Err(e) = self.plot() {
                    let msg = format!(
                        "warning: {e}; training goes on (the plot is drawn again at the next \
                         validation)"
                    );
                    progress_line(&bar, &msg);
                }
                if improved && self.cfg.checkpoint.best {
                    match self.save_best() {
                        Ok(dir) => summary.best = Some(dir),
                        Err(e) => return Err(self.keeping_the_step(e)),
                    }
                }
                if let Some(why) = self.patience_spent() {
                    summary.early_stop = Some(why);
                    stop_early = true;
                }
            }
            if stop_early {
                break;
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
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        summary.steps = self.state.step;
        summary.steps_taken = self.state.step - first_step;
        summary.loss_scale = self.state.loss_scale;
        summary.seconds = started.elapsed().as_secs_f64();
        summary.tokens_per_second = all_tokens as f64 / train_time.max(1e-9);
        Ok(summary)
    }

    /// An error after a step was taken (writing the metrics log or `best/`, validating):
    /// the step's checkpoint is written first, unless it is on disk already, so that the
    /// error costs no training; a write error then says where the training is kept.
    fn keeping_the_step(&mut self, e: TrainError) -> TrainError {
        let step = self.state.step;
        let root = self.checkpoint_root();
        let saved = match checkpoint::latest(&root) {
            Ok(Some(c)) if c.step == step => Ok(c.dir),
            _ => self.sync_device().and_then(|()| self.save_checkpoint()),
        };
        match (e, saved) {
            (TrainError::Write { path, message }, Ok(dir)) => TrainError::Write {
                path,
                message: format!(
                    "{message}; the training up to step {step} is kept in `{}`: fix that, then \
                     continue with `kiln train --resume {}`",
                    dir.display(),
                    self.dir.display()
                ),
            },
            (e, _) => e,
        }
    }

    /// A training error that says what is kept: fills in the run's newest checkpoint.
    fn naming_the_kept_checkpoint(&self, mut e: TrainError) -> TrainError {
        if let TrainError::NonFinite { kept, .. }
        | TrainError::LossScale { kept, .. }
        | TrainError::Diverged { kept, .. } = &mut e
        {
            let newest = checkpoint::latest(&self.checkpoint_root()).ok().flatten();
            *kept = Kept(newest.map(|c| c.dir));
        }
        e
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
fn progress_line(bar: &Option<indicatif::ProgressBar>, msg: &str) {
    use std::io::Write;
    match bar {
        Some(b) => b.println(msg),
        None => {
            let _ = writeln!(std::io::stderr().lock(), "{msg}");
        }
    }
}

/// The scalar loss `name` of a training run's outputs; an error when it is missing or
/// not finite.
fn finite_loss(out: &BTreeMap<String, Tensor>, name: &str, step: u64) -> Result<f32, TrainError> {
    let loss = scalar(out, name)
        .ok_or_else(|| TrainError::Setup("train_step has no scalar loss".to_string()))?;
    if !loss.is_finite() {
        return Err(TrainError::NonFinite {
            step,
            what: "the loss".to_string(),
            value: loss,
            kept: Kept::default(),
        });
    }
    Ok(loss)
}

fn scalar(out: &BTreeMap<String, Tensor>, name: &str) -> Option<f32> {
    let t = out.get(name)?;
    match &t.data {
        TensorData::F32(v) if v.len() == 1 => Some(v[0]),
        TensorData::F64(v) if v.len() == 1 => Some(v[0] as f32),
        _ => None,
    }
}

/// FNV-1a of a value's YAML text.
fn fnv(value: &impl serde::Serialize) -> String {
    let text = serde_yaml::to_string(value).unwrap_or_default();
    kiln_compiler::artifact::hash_hex(text.as_bytes())
}

/// A digest of each part of the configuration that decides the training trajectory
/// (`model=… data=… batch=… optimizer=… schedule=… run=…`, `run` being the seed and the
/// executor). How long to train, how often to log, checkpoint or validate are left out:
/// a resumed run may change those.
pub(crate) fn digest(cfg: &Config) -> String {
    [
        ("model", fnv(&cfg.model)),
        ("data", fnv(&cfg.data)),
        ("batch", fnv(&cfg.batch)),
        ("optimizer", fnv(&cfg.optimizer)),
        ("schedule", fnv(&cfg.schedule)),
        ("run", fnv(&(cfg.train.seed, &cfg.train.executor))),
    ]
    .into_iter()
    // Runs without loss scaling keep the digest they had before it existed.
    .chain(
        cfg.train
            .loss_scale
            .as_ref()
            .map(|l| ("loss_scale", fnv(l))),
    )
    // Products in 16 bits change the trajectory (f32, the default, keeps the digest).
    .chain(
        cfg.train
            .gemm_type
            .as_ref()
            .filter(|g| g.as_str() != "f32")
            .map(|g| ("gemm", fnv(g))),
    )
    // Data parallel over several GPUs multiplies the batch (which GPUs does not matter,
    // and one GPU through NCCL is the run without it).
    .chain(
        cfg.train
            .devices
            .as_ref()
            .filter(|d| d.len() > 1)
            .map(|d| ("gpus", fnv(&d.len()))),
    )
    .map(|(k, v)| format!("{k}={v}"))
    .collect::<Vec<_>>()
    .join(" ")
}

/// The parts whose digests differ between two [`digest`] texts (none when either is
/// not in that form).
pub(crate) fn digest_changes(saved: &str, now: &str) -> Vec<String> {
    let parts = |s: &str| -> Option<BTreeMap<String, String>> {
        s.split(' ')
            .map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect()
    };
    let (Some(a), Some(b)) = (parts(saved), parts(now)) else {
        return Vec::new();
    };
    a.keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            if k == "run" {
                "`train.seed`/`train.executor`".to_string()
            } else if k == "loss_scale" {
                "`train.loss_scale`".to_string()
            } else if k == "gemm" {
                "`train.gemm_type`".to_string()
            } else if k == "gpus" {
                "the number of GPUs in `train.devices`".to_string()
            } else {
                format!("`{k}`")
            }
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Elements per parallel task of the gradient passes.
const ACC_CHUNK: usize = 1 << 16;

/// Why a micro-batch's gradients could not be accumulated.
enum Accumulate {
    /// The step's outputs have no gradient for this parameter.
    Missing(String),
    /// This parameter's gradient has a non-finite element (the first one found).
    NonFinite(String, f32),
}

/// `acc = w·g` (`first`) or `acc += w·g` for every parameter's accumulator, with `g` the
/// micro-batch's `grad.NAME` output, checking that `g` is finite on the way: one pass
/// over the gradients, split across the threads. The results do not depend on the
/// split (every element is its own sum).
fn accumulate(
    grads: &mut BTreeMap<String, Vec<f32>>,
    out: &BTreeMap<String, Tensor>,
    w: f32,
    first: bool,
) -> Result<(), Accumulate> {
    use rayon::prelude::*;
    let pairs: Vec<(&String, &mut Vec<f32>, &[f32])> = grads
        .iter_mut()
        .map(|(name, acc)| {
            out.get(&format!("grad.{name}"))
                .and_then(|t| t.as_f32())
                .filter(|g| g.len() == acc.len())
                .map(|g| (name, acc, g))
                .ok_or_else(|| Accumulate::Missing(name.clone()))
        })
        .collect::<Result<_, _>>()?;
    let bad = pairs
        .into_par_iter()
        .filter_map(|(name, acc, g)| {
            acc.par_chunks_mut(ACC_CHUNK)
                .zip(g.par_chunks(ACC_CHUNK))
                .filter_map(|(a, g)| {
                    if let Some(x) = g.iter().find(|x| !x.is_finite()) {
                        return Some(*x);
                    }
                    if first {
                        a.iter_mut().zip(g).for_each(|(a, x)| *a = w * x);
                    } else {
                        a.iter_mut().zip(g).for_each(|(a, x)| *a += w * x);
                    }
                    None
                })
                .find_first(|_| true)
                .map(|x| (name, x))
        })
        .find_first(|_| true);
    match bad {
        Some((name, x)) => Err(Accumulate::NonFinite(name.clone(), x)),
        None => Ok(()),
    }
}

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
