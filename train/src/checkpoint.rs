//! Training checkpoints: atomic save, load with validation, keep-last-k, averaging.
//!
//! In: the parameters, the Adam moments and the [`TrainState`] of a run, plus any files
//! the caller wants alongside (`tokenizer.json`, `graphs.json`, ...). Out: a directory
//! `step_<N>` (N zero-padded to 8 digits) under a checkpoints root:
//!
//! ```text
//! checkpoints/step_00000100/
//!   model.safetensors      parameters under their model names (`kiln run --weights`)
//!   optimizer.safetensors  Adam moments: `m.<param>` and `v.<param>`
//!   state.yaml             TrainState: step, epoch, batch_in_epoch, seed, ...
//!   tokenizer.json ...     the caller's extra files, byte for byte
//! ```
//!
//! [`save`] writes everything into `step_<N>.tmp-<pid>`, flushes it, and renames the
//! directory into place, so a process killed at any moment leaves either the complete new
//! checkpoint or none. [`latest`] and [`list`] only see `step_<N>` directories; leftover
//! `.tmp-*` directories are removed by the next [`save`]. [`load`] checks that every file
//! is there and readable, and names the file and the fix when one is not. [`prune`] keeps
//! the last k checkpoints; [`average`] averages the parameters of several (the paper
//! averages the last 5 or 20).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::tensor::{load_safetensors, save_safetensors, Tensor};
use serde::{Deserialize, Serialize};

mod average;
mod error;

pub use average::*;
pub use error::*;

/// The parameters, under their model names.
pub const MODEL_FILE: &str = "model.safetensors";
/// The Adam moments, `m.<param>` and `v.<param>`.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The [`TrainState`] as YAML.
pub const STATE_FILE: &str = "state.yaml";
const RESERVED: [&str; 3] = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE];

/// Where a run stands: everything besides tensors that an exact resume needs.
///
/// The fields every kiln has written since checkpoints exist (step through
/// `config_digest`, and `extra`: see [`STATE_FIELDS`]) are required, so a `state.yaml`
/// cut short is refused instead of resuming with zeros; the fields added later
/// (`best_step` and after) have defaults, so the state of an older kiln still loads.
/// Unknown fields are ignored, so a newer kiln's state loads too; put new ad-hoc values
/// in `extra`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer updates done (also Adam's bias-correction step).
    pub step: u64,
    /// The epoch in progress (0-based).
    pub epoch: u64,
    /// Batches of `epoch` already done: resume at position `batch_in_epoch` of the
    /// epoch's batch order.
    pub batch_in_epoch: u64,
    /// The run's seed (batch order, dropout).
    pub seed: u64,
    /// Non-pad source tokens trained on so far.
    pub src_tokens_seen: u64,
    /// Non-pad target tokens (with `<eos>`) trained on so far.
    pub tgt_tokens_seen: u64,
    /// The learning rate of the last update.
    pub lr: f64,
    /// The schedule's parameters, e.g. `warmup_steps`, `d_model`, `factor`.
    pub lr_schedule: BTreeMap<String, f64>,
    /// The best validation loss so far.
    pub best_val_loss: Option<f64>,
    /// The best validation BLEU so far.
    pub best_bleu: Option<f64>,
    /// The step of the best validation so far (by `valid.metric`). Added later: optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_step: Option<u64>,
    /// Validations in a row since the last better one (`valid.patience` stops the run).
    /// Added later: optional.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bad_validations: u64,
    /// A digest of the training configuration, to refuse resuming under another one.
    pub config_digest: String,
    /// Dynamic loss scaling (`train.loss_scale`): the scale of the next step. Added
    /// later, and absent without loss scaling: optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Good steps since the scale last changed (it doubles after `window` of them).
    /// Added later: optional.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub loss_scale_good_steps: u64,
    /// Steps skipped because their gradients overflowed. Added later: optional.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overflows: u64,
    /// Anything else.
    pub extra: BTreeMap<String, String>,
}

/// The fields of `state.yaml` that every kiln has written (the first checkpoints had
/// them all): one missing means the file was cut short or edited. The `Option` ones
/// (`best_val_loss`, `best_bleu`) are written as `null` when unset; serde alone would
/// take their absence for `None`.
pub const STATE_FIELDS: [&str; 12] = [
    "step",
    "epoch",
    "batch_in_epoch",
    "seed",
    "src_tokens_seen",
    "tgt_tokens_seen",
    "lr",
    "lr_schedule",
    "best_val_loss",
    "best_bleu",
    "config_digest",
    "extra",
];

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Adam's first (`m`) and second (`v`) moments, one tensor per parameter.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AdamMoments {
    pub m: BTreeMap<String, Tensor>,
    pub v: BTreeMap<String, Tensor>,
}

/// A complete checkpoint directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub step: u64,
}

/// Everything read back from a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedCheckpoint {
    pub dir: PathBuf,
    pub params: BTreeMap<String, Tensor>,
    pub moments: AdamMoments,
    pub state: TrainState,
    /// The names of the extra files (read them with [`read_extra`]).
    pub extra_files: Vec<String>,
}

/// The directory name of step `step`: `step_00000100`.
pub fn dir_name(step: u64) -> String {
    format!("step_{step:08}")
}

/// The step of a complete checkpoint's directory name (`step_<digits>`), else `None`.
pub fn parse_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step_")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The complete checkpoints under `root`, oldest (lowest step) first. A missing root
/// holds none.
pub fn list(root: &Path) -> Result<Vec<Checkpoint>, CheckpointError> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("list", root)(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("list", root))?;
        let Some(step) = entry.file_name().to_str().and_then(parse_dir_name) else {
            continue;
        };
        if entry.path().is_dir() {
            out.push(Checkpoint {
                dir: entry.path(),
                step,
            });
        }
    }
    out.sort_by_key(|c| c.step);
    Ok(out)
}

/// The newest complete checkpoint under `root`, or `None` when there is none.
/// Unfinished `.tmp-*` directories are ignored. A newest checkpoint that lacks one of
/// its files is an error (naming the file), not a silent fall-back on an older one.
pub fn latest(root: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
    let Some(newest) = list(root)?.pop() else {
        return Ok(None);
    };
    for file in RESERVED {
        if !newest.dir.join(file).is_file() {
            return Err(CheckpointError::MissingFile {
                dir: newest.dir,
                file: file.to_string(),
            });
        }
    }
    Ok(Some(newest))
}

fn check_extra_name(name: &str) -> Result<(), CheckpointError> {
    let bad = |why| {
        Err(CheckpointError::BadFileName {
            name: name.to_string(),
            why,
        })
    };
    if name.is_empty() || name == "." || name == ".." {
        return bad("it is not a file name");
    }
    if name.contains(['/', '\\']) || name.contains('\0') {
        return bad("it must be a plain file name, without directories");
    }
    if RESERVED.contains(&name) || name == crate::checksums::CHECKSUMS_FILE {
        return bad("the checkpoint writes that file itself");
    }
    Ok(())
}

/// Checks that `moments` has an f32 `m` and `v` tensor for every parameter, of its
/// shape, and nothing else. `origin` says whose moments (`… does not fit …`), `fix` what
/// to do.
fn check_moments(
    params: &BTreeMap<String, Tensor>,
    moments: &AdamMoments,
    origin: &str,
    fix: &str,
) -> Result<(), CheckpointError> {
    let bad = |what: String| CheckpointError::Moments {
        message: format!("{origin}: {what}; {fix}"),
    };
    for (kind, map) in [("m", &moments.m), ("v", &moments.v)] {
        let missing: Vec<&str> = params
            .keys()
            .filter(|k| !map.contains_key(*k))
            .map(String::as_str)
            .collect();
        let unknown: Vec<&str> = map
            .keys()
            .filter(|k| !params.contains_key(*k))
            .map(String::as_str)
            .collect();
        let mut wrong = Vec::new();
        if !missing.is_empty() {
            wrong.push(format!(
                "it has no moment `{kind}` of the parameter{} {}",
                if missing.len() == 1 { "" } else { "s" },
                list_names(&missing)
            ));
        }
        if !unknown.is_empty() {
            wrong.push(format!(
                "it has moments `{kind}` of {}, which {}",
                list_names(&unknown),
                if unknown.len() == 1 {
                    "is not a parameter"
                } else {
                    "are not parameters"
                }
            ));
        }
        if !wrong.is_empty() {
            return Err(bad(wrong.join(", and ")));
        }
        for (name, p) in params {
            let t = &map[name];
            if t.shape != p.shape {
                return Err(bad(format!(
                    "moment `{kind}.{name}` has shape {:?}, but the parameter has {:?}",
                    t.shape, p.shape
                )));
            }
            if t.as_f32().is_none() {
                return Err(bad(format!(
                    "moment `{kind}.{name}` is {}, but Adam moments are f32",
                    t.dtype_name()
                )));
            }
        }
    }
    Ok(())
}

fn list_names(names: &[&str]) -> String {
    if names.is_empty() {
        return "none".to_string();
    }
    let shown: Vec<String> = names.iter().take(8).map(|n| format!("`{n}`")).collect();
    if names.len() > 8 {
        format!("{} and {} more", shown.join(", "), names.len() - 8)
    } else {
        shown.join(", ")
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    kiln_compiler::fsync::write_synced(path, bytes).map_err(|(action, e)| io_err(action, path)(e))
}

use kiln_compiler::fsync::sync_dir;

use kiln_compiler::fsync::pid_alive;

/// Removes `step_*.tmp-<pid>*` directories left by processes that are gone.
fn clean_stale(root: &Path) -> Result<(), CheckpointError> {
    for entry in std::fs::read_dir(root).map_err(io_err("list", root))? {
        let entry = entry.map_err(io_err("list", root))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some((_, rest)) = name.split_once(".tmp-") else {
            continue;
        };
        if !name.starts_with("step_") {
            continue;
        }
        let pid: Option<u32> = rest
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|d| d.parse().ok());
        // Ours are stale too: a save in progress in this process is not running now.
        if pid.is_some_and(|p| p != std::process::id() && pid_alive(p)) {
            continue;
        }
        std::fs::remove_dir_all(entry.path()).map_err(io_err("remove the stale", &entry.path()))?;
    }
    Ok(())
}

/// Writes the checkpoint of `state.step` under `root` (created if missing) and returns
/// it. `files` are extra `(name, bytes)` to store alongside, e.g. `("tokenizer.json",
/// ...)`.
///
/// Atomic: everything goes into `step_<N>.tmp-<pid>`, is flushed, and the directory is
/// renamed to `step_<N>`. An existing `step_<N>` is replaced (moved aside first, then
/// removed). Stale `.tmp-*` directories of dead processes are removed first. One process
/// at a time should save into a root.
pub fn save(
    root: &Path,
    state: &TrainState,
    params: &BTreeMap<String, Tensor>,
    moments: &AdamMoments,
    files: &[(&str, &[u8])],
) -> Result<Checkpoint, CheckpointError> {
    check_moments(
        params,
        moments,
        "cannot save the checkpoint",
        "the optimizer state must hold one f32 `m` and `v` tensor per parameter, of its shape",
    )?;
    let mut seen = Vec::new();
    for (name, _) in files {
        check_extra_name(name)?;
        if seen.contains(name) {
            return Err(CheckpointError::BadFileName {
                name: name.to_string(),
                why: "it is given twice",
            });
        }
        seen.push(name);
    }
    let yaml = serde_yaml::to_string(state).map_err(|e| CheckpointError::BadState {
        path: PathBuf::from(STATE_FILE),
        message: e.to_string(),
    })?;

    std::fs::create_dir_all(root).map_err(io_err("create the checkpoints directory", root))?;
    clean_stale(root)?;
    let name = dir_name(state.step);
    let pid = std::process::id();
    let final_dir = root.join(&name);
    let tmp = root.join(format!("{name}.tmp-{pid}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err("remove", &tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err("create", &tmp))?;

    let written = (|| {
        let named: Vec<(String, Tensor)> =
            params.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
        save_safetensors(&tmp.join(MODEL_FILE), &named, None)?;
        let mut opt: Vec<(String, Tensor)> = Vec::with_capacity(2 * params.len());
        for (prefix, map) in [("m", &moments.m), ("v", &moments.v)] {
            opt.extend(
                map.iter()
                    .map(|(k, t)| (format!("{prefix}.{k}"), t.clone())),
            );
        }
        save_safetensors(&tmp.join(OPTIMIZER_FILE), &opt, None)?;
        write_synced(&tmp.join(STATE_FILE), yaml.as_bytes())?;
        for (fname, bytes) in files {
            write_synced(&tmp.join(fname), bytes)?;
        }
        let mut names: Vec<&str> = RESERVED.to_vec();
        names.extend(files.iter().map(|(n, _)| *n));
        crate::checksums::write(&tmp, &names).map_err(io_err("write the checksums in", &tmp))?;
        sync_dir(&tmp);

        let old = root.join(format!("{name}.tmp-{pid}-old"));
        let replaced = final_dir.exists();
        if replaced {
            std::fs::rename(&final_dir, &old).map_err(io_err("move aside", &final_dir))?;
        }
        if let Err(e) = std::fs::rename(&tmp, &final_dir) {
            if replaced {
                // Put the previous checkpoint of this step back.
                let _ = std::fs::rename(&old, &final_dir);
            }
            return Err(io_err("rename into place", &tmp)(e));
        }
        sync_dir(root);
        if replaced {
            let _ = std::fs::remove_dir_all(&old);
        }
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(Checkpoint {
        dir: final_dir,
        step: state.step,
    })
}

fn require_file(dir: &Path, file: &str) -> Result<PathBuf, CheckpointError> {
    let path = dir.join(file);
    if path.is_file() {
        Ok(path)
    } else {
        Err(CheckpointError::MissingFile {
            dir: dir.to_path_buf(),
            file: file.to_string(),
        })
    }
}

fn load_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
    load_safetensors(path).map_err(|source| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        source,
    })
}

/// A `state.yaml`: empty (or only comments) and incomplete files are told apart from
/// malformed ones, since they are what a write cut short leaves.
fn parse_state(text: &str, path: &Path) -> Result<TrainState, CheckpointError> {
    let bad = |e: serde_yaml::Error| CheckpointError::BadState {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    match serde_yaml::from_str::<serde_yaml::Value>(text).map_err(bad)? {
        serde_yaml::Value::Null => {
            return Err(CheckpointError::EmptyState {
                path: path.to_path_buf(),
            })
        }
        serde_yaml::Value::Mapping(m) => {
            let missing: Vec<&str> = STATE_FIELDS
                .into_iter()
                .filter(|f| !m.contains_key(*f))
                .collect();
            if !missing.is_empty() {
                return Err(CheckpointError::IncompleteState {
                    path: path.to_path_buf(),
                    missing: missing
                        .iter()
                        .map(|f| format!("`{f}`"))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        // Not a mapping: serde says what it is, below.
        _ => {}
    }
    serde_yaml::from_str(text).map_err(bad)
}

/// Reads and validates a checkpoint directory: all three files present and readable,
/// the state's step equal to the directory's, f32 parameters, and one f32 `m` and `v`
/// moment per parameter.
pub fn load(dir: &Path) -> Result<LoadedCheckpoint, CheckpointError> {
    load_checked(dir, &|_, _| Ok(()))
}

/// What [`load_checked`] runs on a checkpoint's parameters: `check(file, params)`.
pub type ParamsCheck<'a> = dyn Fn(&Path, &BTreeMap<String, Tensor>) -> Result<(), String> + 'a;

/// [`load`], with `check(file, params)` run on the parameters as soon as they are read,
/// before the moments are compared with them: a caller that knows the model (its graphs)
/// checks the weights against it there, so that a damaged `model.safetensors` is named as
/// such rather than as moments that do not fit it. An `Err(message)` of `check` becomes
/// [`CheckpointError::Weights`].
pub fn load_checked(dir: &Path, check: &ParamsCheck) -> Result<LoadedCheckpoint, CheckpointError> {
    if !dir.is_dir() {
        return Err(CheckpointError::NotACheckpoint {
            path: dir.to_path_buf(),
        });
    }
    let model = require_file(dir, MODEL_FILE)?;
    let optimizer = require_file(dir, OPTIMIZER_FILE)?;
    let state_path = require_file(dir, STATE_FILE)?;
    crate::checksums::verify(dir, &RESERVED)?;

    let text = std::fs::read_to_string(&state_path).map_err(io_err("read", &state_path))?;
    let state = parse_state(&text, &state_path)?;
    if let Some(dir_step) = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_dir_name)
    {
        if dir_step != state.step {
            return Err(CheckpointError::StepMismatch {
                path: state_path,
                dir_step,
                state_step: state.step,
            });
        }
    }

    let params = load_tensors(&model)?;
    check(&model, &params).map_err(|message| CheckpointError::Weights { message })?;
    if let Some((name, t)) = params.iter().find(|(_, t)| t.as_f32().is_none()) {
        return Err(CheckpointError::ParamDtype {
            path: model,
            name: name.clone(),
            dtype: t.dtype_name(),
        });
    }
    let mut moments = AdamMoments::default();
    let mut stray = Vec::new();
    for (name, t) in load_tensors(&optimizer)? {
        if let Some(p) = name.strip_prefix("m.") {
            moments.m.insert(p.to_string(), t);
        } else if let Some(p) = name.strip_prefix("v.") {
            moments.v.insert(p.to_string(), t);
        } else {
            stray.push(name);
        }
    }
    if !stray.is_empty() {
        let names: Vec<&str> = stray.iter().map(String::as_str).collect();
        return Err(CheckpointError::Moments {
            message: format!(
                "`{}` holds tensors that are not Adam moments ({}); its names must be \
                 `m.<param>` or `v.<param>` — re-create the checkpoint",
                optimizer.display(),
                list_names(&names)
            ),
        });
    }
    check_moments(
        &params,
        &moments,
        &format!(
            "`{}` does not fit the parameters in `{}`",
            optimizer.display(),
            model.display()
        ),
        "restore it, or delete the checkpoint directory to fall back on an earlier one",
    )?;
    let finite =
        |file: &Path, tensors: &BTreeMap<String, Tensor>, label: &dyn Fn(&str) -> String| {
            kiln_exec::entry::check_finite_named(&file.display().to_string(), tensors, label)
                .map_err(|e| CheckpointError::NonFinite {
                    message: format!("{}: {}", e.message, e.help),
                })
        };
    finite(&model, &params, &|n| format!("parameter `{n}`"))?;
    finite(&optimizer, &moments.m, &|n| format!("moment `m.{n}`"))?;
    finite(&optimizer, &moments.v, &|n| format!("moment `v.{n}`"))?;

    let mut extra_files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err("list", dir))? {
        let entry = entry.map_err(io_err("list", dir))?;
        if let Some(name) = entry.file_name().to_str() {
            if !RESERVED.contains(&name)
                && name != crate::checksums::CHECKSUMS_FILE
                && entry.path().is_file()
            {
                extra_files.push(name.to_string());
            }
        }
    }
    extra_files.sort();
    Ok(LoadedCheckpoint {
        dir: dir.to_path_buf(),
        params,
        moments,
        state,
        extra_files,
    })
}

/// The bytes of an extra file stored in a checkpoint.
pub fn read_extra(dir: &Path, name: &str) -> Result<Vec<u8>, CheckpointError> {
    let path = require_file(dir, name)?;
    std::fs::read(&path).map_err(io_err("read", &path))
}

/// Deletes all but the newest `keep` checkpoints under `root`; returns the directories
/// removed. Each is first renamed to `<name>.tmp-<pid>-del`, so a half-deleted checkpoint
/// is never taken for a complete one.
pub fn prune(root: &Path, keep: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    if keep == 0 {
        return Err(CheckpointError::KeepZero);
    }
    let all = list(root)?;
    let n_remove = all.len().saturating_sub(keep);
    let mut removed = Vec::new();
    for c in all.into_iter().take(n_remove) {
        let doomed = root.join(format!(
            "{}.tmp-{}-del",
            dir_name(c.step),
            std::process::id()
        ));
        std::fs::rename(&c.dir, &doomed).map_err(io_err("move aside", &c.dir))?;
        std::fs::remove_dir_all(&doomed).map_err(io_err("remove", &doomed))?;
        removed.push(c.dir);
    }
    if !removed.is_empty() {
        sync_dir(root);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests;
