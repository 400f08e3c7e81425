//! Whether a directory can take a new run: what a configuration must say before anything
//! is written (the executor and its artifact, the checkpoint directory, the validation
//! set), and whether a directory already holds training.

use std::path::Path;

use crate::checkpoint;
use crate::config::Config;
use crate::data::{load_parallel, ParallelCorpus};
use crate::model::CONFIG_FILE;
use crate::trainer::{config_yaml, digest, digest_changes, gemm_kernel, TrainError};

/// Checks that a new run may start in `cfg.checkpoint.dir`: that nothing there would be
/// lost. A directory with checkpoints is a run to resume. A `config.yaml` is overwritten
/// only when kiln wrote it for a start of this same configuration that stopped before its
/// first checkpoint (how long to train, logging, checkpoints and validation may differ),
/// and so is that start's `metrics.jsonl`; without a `config.yaml`, a non-empty
/// `metrics.jsonl` is the log of some earlier run. Also that this CPU runs
/// `train.gemm_type` ([`gemm_kernel`]). [`crate::trainer::Trainer::new`] checks this; call it before
/// preparing the tokenizer to fail early.
pub fn check_new_run_dir(cfg: &Config) -> Result<(), TrainError> {
    // A kernel this CPU lacks fails the start before anything is written.
    gemm_kernel(cfg)?;
    cuda_has_artifact(cfg)?;
    let dir = &cfg.checkpoint.dir;
    if dir.as_os_str().is_empty() {
        return Err(TrainError::Setup(
            "checkpoint.dir is empty, which would write the run into the current directory; \
             name a directory of its own (e.g. `runs/base`, or `--dir runs/base`)"
                .to_string(),
        ));
    }
    if dir.exists() && !dir.is_dir() {
        return Err(TrainError::Setup(format!(
            "checkpoint.dir `{}` is a file, not a directory; name a directory for the run \
             (it is created if missing)",
            dir.display()
        )));
    }
    check_valid_set(
        cfg,
        &load_parallel(&cfg.data.valid_src, &cfg.data.valid_tgt)?,
    )?;
    let ckpts = dir.join("checkpoints");
    if ckpts.is_dir() && checkpoint::latest(&ckpts)?.is_some() {
        return Err(TrainError::Setup(format!(
            "`{}` already holds checkpoints; continue it with `kiln train --resume {}`, or choose another `checkpoint.dir`",
            dir.display(),
            dir.display()
        )));
    }
    let fix = "move it away (or delete it) to start a new run in this directory, or choose \
               another `checkpoint.dir`";
    let path = dir.join(CONFIG_FILE);
    let Ok(text) = std::fs::read(&path) else {
        // No configuration (a directory named so is refused when it is written): a
        // metrics log is some other run's.
        let log = dir.join(crate::metrics::FILE_NAME);
        return match std::fs::metadata(&log) {
            Ok(meta) if !meta.is_file() || meta.len() > 0 => Err(TrainError::Setup(format!(
                "`{}` is the metrics log of an earlier run ({} bytes; the directory has no \
                 `{CONFIG_FILE}` and no checkpoints), which a new run would overwrite; {fix}",
                log.display(),
                meta.len()
            ))),
            _ => Ok(()),
        };
    };
    if text == config_yaml(cfg).as_bytes() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&text);
    let trained = holds_training(dir)?;
    let why = match Config::parse(&text) {
        Ok(old) if config_yaml(&old) == text => {
            let changed = digest_changes(&digest(&old), &digest(cfg));
            if changed.is_empty() || !trained {
                return Ok(());
            }
            format!(
                "it is the configuration of another run (it differs in {})",
                changed.join(", ")
            )
        }
        _ => "it is not one kiln wrote (if it is the configuration given to `--config`, \
              keep that outside the run directory: the run writes its resolved \
              configuration there)"
            .to_string(),
    };
    Err(TrainError::Setup(format!(
        "`{}` would be overwritten by the new run's configuration, and {why}; {fix}",
        path.display()
    )))
}

/// Whether run directory `dir` holds some training: a checkpoint, or a logged step. A
/// start that failed before either left nothing worth keeping.
pub(crate) fn holds_training(dir: &Path) -> Result<bool, TrainError> {
    let ckpts = dir.join("checkpoints");
    if ckpts.is_dir() && checkpoint::latest(&ckpts)?.is_some() {
        return Ok(true);
    }
    let log = std::fs::metadata(dir.join(crate::metrics::FILE_NAME));
    Ok(log.is_ok_and(|m| !m.is_file() || m.len() > 0))
}

/// `train.executor: cuda` runs a compiled CUDA artifact, so a run needs one.
pub(crate) const CUDA_NEEDS_ARTIFACT: &str =
    "`train.executor: cuda` runs a compiled `--target cuda` \
    artifact: compile one with `kiln compile --config CONFIG --target cuda -o DIR` and start \
    the run with `--artifact DIR`";

pub(crate) fn cuda_has_artifact(cfg: &Config) -> Result<(), TrainError> {
    if cfg.train.executor_kind() == kiln_exec::executor::ExecutorKind::Cuda
        && cfg.model.artifact.is_none()
    {
        return Err(TrainError::Setup(CUDA_NEEDS_ARTIFACT.to_string()));
    }
    Ok(())
}

/// The validation set picks `best/` and stops a run early, so it needs a pair: an empty
/// one would report a loss of 0 and keep a "best" model judged on nothing.
pub(crate) fn check_valid_set(cfg: &Config, valid: &ParallelCorpus) -> Result<(), TrainError> {
    if (0..valid.len()).all(|i| valid.is_empty_pair(i)) {
        return Err(TrainError::Setup(format!(
            "the validation set `{}` / `{}` has no pair to validate on ({} line(s), all \
             empty); data.valid_src and data.valid_tgt must hold at least one pair with both \
             sides non-empty",
            cfg.data.valid_src.display(),
            cfg.data.valid_tgt.display(),
            valid.len()
        )));
    }
    Ok(())
}

/// Removes what writes killed by a signal left in run directory `dir`: temporary files of
/// the run's own files (`training.png`, `metrics.jsonl`, `config.yaml`, …) and of its
/// `best/` model directory. (Checkpoints remove theirs when one is saved.)
pub(crate) fn remove_stale_temps(dir: &Path) -> Result<(), TrainError> {
    for d in [dir.to_path_buf(), dir.join("best")] {
        kiln_compiler::fsync::remove_stale_temps(&d, None).map_err(|e| TrainError::Write {
            path: d.clone(),
            message: format!("cannot remove a stale temporary file: {e}"),
        })?;
    }
    Ok(())
}
