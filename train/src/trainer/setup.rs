//! Starting a run: a new one, one from an artifact, a resumed one, and the executors and
//! state a run assembles before its first step.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_compiler::ir::Graph;
use kiln_compiler::tensor::Tensor;

use crate::checkpoint::{self, TrainState};
use crate::config::Config;
use crate::data::binarized::{self, Binarized};
use crate::data::{
    load_parallel, BatchConfig, BatchPlan, Dataset, Pairs, ParallelCorpus, Tokenizer,
};
use crate::metrics::truncate_after;
use crate::model::{write_atomic, GraphSet, ModelError, CONFIG_FILE, GRAPHS_FILE, TOKENIZER_FILE};
use crate::optim::Adam;
use crate::run_dir::{check_new_run_dir, check_valid_set, remove_stale_temps, CUDA_NEEDS_ARTIFACT};
use kiln_decode::translate::check_positions;
use kiln_exec::artifact::Artifact;
use kiln_exec::cuda::parallel::DataParallel;
use kiln_exec::executor::{executor, Exec, ExecutorKind};

use super::*;

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
        kiln_exec::entry::check_weights(&set.loss, &file.display().to_string(), &params)
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

    pub(super) fn start(
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
        let adam = Adam::new(&cfg.optimizer, &params);
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
        let set = GraphSet::from_json(&graphs_bytes, &ck.dir.join(GRAPHS_FILE))
            .map_err(ModelError::from)?;
        let loaded = checkpoint::load_checked(&ck.dir, &|file, params| {
            kiln_exec::entry::check_weights_fit(&set.loss, &file.display().to_string(), params)
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
        let mut adam = Adam::new(&cfg.optimizer, &loaded.params);
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

    pub(super) fn assemble(
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
        let Datasets {
            train,
            plan,
            valid,
            valid_plan,
            valid_corpus,
        } = datasets(&cfg, &tokenizer, &graphs, &mut notes)?;
        let d_model = match cfg.schedule.d_model {
            Some(d) => d,
            // Only the paper's schedule reads the width.
            None if !cfg.schedule.needs_d_model() => 0.0,
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
        let Executors {
            train_exec,
            loss_exec,
            encode_exec,
            step_exec,
        } = executors(&cfg, &graphs, artifact, &mut notes)?;
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
            train,
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
}

/// The artifact's vocabulary (the logits' width) must be the tokenizer's.
pub(super) fn check_artifact_vocab(
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

pub(super) fn setup<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> TrainError + '_ {
    move |e| TrainError::Setup(format!("{what}: {e}"))
}

/// The training and validation sets of a run, read and checked against the model's
/// positions, and their batches.
struct Datasets {
    train: Box<dyn Pairs + Send>,
    plan: BatchPlan,
    valid: Dataset,
    valid_plan: BatchPlan,
    valid_corpus: ParallelCorpus,
}

/// The training pairs: mapped from the binarized corpus `data.binarized` names (encoded
/// by this run's tokenizer, with this `data.max_len`), else encoded from the text files.
fn training_pairs(
    cfg: &Config,
    tokenizer: &Tokenizer,
    notes: &mut Vec<String>,
) -> Result<Box<dyn Pairs + Send>, TrainError> {
    let (pairs, skipped, dropped, from): (Box<dyn Pairs + Send>, u64, u64, String) = match &cfg
        .data
        .binarized
    {
        Some(dir) => {
            let digest = binarized::digest(&tokenizer.to_json()?);
            let b = Binarized::open(dir, &digest)?;
            if b.meta.max_len != cfg.data.max_len {
                return Err(TrainError::Setup(format!(
                        "the binarized corpus `{}` kept pairs of at most {} tokens, but                          `data.max_len` is {}; encode it again with `kiln preprocess --config                          CONFIG.yaml`",
                        dir.display(),
                        b.meta.max_len,
                        cfg.data.max_len
                    )));
            }
            let (s, d) = (b.meta.skipped_empty, b.meta.dropped_too_long);
            let from = format!(" (binarized: {})", dir.display());
            (Box::new(b), s, d, from)
        }
        None => {
            let corpus = load_parallel(&cfg.data.train_src, &cfg.data.train_tgt)?;
            let d = Dataset::build(&corpus, tokenizer, Some(cfg.data.max_len))?;
            let (s, k) = (d.skipped_empty as u64, d.dropped_too_long as u64);
            (Box::new(d), s, k, String::new())
        }
    };
    if pairs.is_empty() {
        return Err(TrainError::Setup(format!(
            "no training pairs left in `{}` (empty: {skipped}, longer than {}: {dropped})",
            cfg.data.train_src.display(),
            cfg.data.max_len,
        )));
    }
    notes.push(format!(
        "{} training pairs{from} ({skipped} skipped as empty, {dropped} longer than {} tokens)",
        pairs.len(),
        cfg.data.max_len
    ));
    Ok(pairs)
}

fn datasets(
    cfg: &Config,
    tokenizer: &Tokenizer,
    graphs: &GraphSet,
    notes: &mut Vec<String>,
) -> Result<Datasets, TrainError> {
    let train = training_pairs(cfg, tokenizer, notes)?;
    let bcfg = BatchConfig {
        max_src_tokens: cfg.batch.max_src_tokens,
        max_tgt_tokens: cfg.batch.max_tgt_tokens,
    };
    let plan = BatchPlan::new(train.as_ref(), bcfg)?;
    let valid_corpus = load_parallel(&cfg.data.valid_src, &cfg.data.valid_tgt)?;
    let mut valid = Dataset::build(&valid_corpus, tokenizer, None)?;
    if cfg.valid.max_sentences > 0 {
        valid.examples.truncate(cfg.valid.max_sentences);
        valid.lines.truncate(cfg.valid.max_sentences);
    }
    // (Checked before a new run starts; a resumed run's data may have changed since.)
    check_valid_set(cfg, &valid_corpus)?;
    // A learned positional table covers `max_len` positions of the model; a pair
    // beyond it would stop the run at its first batch or validation.
    for (ds, src_path, tgt_path, fix) in [
        (
            train.as_ref() as &dyn Pairs,
            &cfg.data.train_src,
            &cfg.data.train_tgt,
            "set `data.max_len` to that or less (longer pairs are left out)",
        ),
        (
            &valid as &dyn Pairs,
            &cfg.data.valid_src,
            &cfg.data.valid_tgt,
            "remove the pair from the validation set",
        ),
    ] {
        let line = |i: usize| ds.line(i) + 1;
        check_positions(
            &graphs.loss,
            "src_len",
            ds.len(),
            &|i| ds.src_positions(i),
            &|i| format!("`{}` line {}", src_path.display(), line(i)),
            fix,
        )
        .and_then(|()| {
            check_positions(
                &graphs.loss,
                "tgt_len",
                ds.len(),
                &|i| ds.tgt_positions(i),
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
    Ok(Datasets {
        train,
        plan,
        valid,
        valid_plan,
        valid_corpus,
    })
}

/// The executors of a run's entry points: the training step's on the host, one GPU or
/// several, and those of the loss, the encoder and the decoder step.
struct Executors {
    train_exec: TrainExec,
    loss_exec: Box<dyn Exec>,
    encode_exec: Box<dyn Exec>,
    step_exec: Box<dyn Exec>,
}

fn executors(
    cfg: &Config,
    graphs: &GraphSet,
    artifact: Option<&Artifact>,
    notes: &mut Vec<String>,
) -> Result<Executors, TrainError> {
    let kind = cfg.train.executor_kind();
    // With an artifact and the compiled executor, its kernels run as they are;
    // otherwise the executor is built from the graph now.
    let cuda = kind == ExecutorKind::Cuda;
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
                let options = kiln_exec::cuda::CudaOptions {
                    device,
                    ..kiln_exec::cuda::CudaOptions::default()
                };
                kiln_exec::cuda::CudaExecutor::with_options(art, name, options)
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
    let mut train_exec = match (artifact, &cfg.train.devices) {
        (Some(art), Some(devices)) if cuda => {
            let dp = DataParallel::new(
                art,
                "train_step",
                devices,
                kiln_exec::cuda::CudaOptions::default(),
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
            kiln_exec::cuda::CudaExecutor::with_options(
                art,
                "train_step",
                kiln_exec::cuda::CudaOptions::default(),
            )
            .map_err(|e| TrainError::Setup(e.to_string()))?,
        )),
        _ => TrainExec::Host(ex("train_step", &graphs.train_step)?),
    };
    let mut loss_exec = ex("loss", &graphs.loss)?;
    let mut encode_exec = ex("encode", &graphs.encode)?;
    let mut step_exec = ex("decode_step", &graphs.decode_step)?;
    // `train.gemm_type`: the compiled executors' large products (absent: the
    // executors' own).
    if let Some(kernel) = gemm_kernel(cfg)? {
        let host = match &mut train_exec {
            TrainExec::Host(e) => Some(e),
            _ => None,
        };
        for e in host
            .into_iter()
            .chain([&mut loss_exec, &mut encode_exec, &mut step_exec])
        {
            e.set_product_kernel(kernel)
                .map_err(|e| TrainError::Setup(e.to_string()))?;
        }
        notes.push(format!(
            "matrix products: {}",
            kernel.map_or("f32".to_string(), |k| k.name().to_string())
        ));
    }
    // Training, validation and decoding never run at once: compiled CPU programs
    // share the training step's arena.
    if let TrainExec::Host(train) = &train_exec {
        if let Some(arena) = train.arena() {
            for e in [&mut loss_exec, &mut encode_exec, &mut step_exec] {
                e.share_arena(&arena);
            }
        }
    }
    Ok(Executors {
        train_exec,
        loss_exec,
        encode_exec,
        step_exec,
    })
}
