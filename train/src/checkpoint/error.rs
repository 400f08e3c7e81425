//! What can be wrong with a checkpoint, each with the file and the fix.

use std::path::{Path, PathBuf};

use kiln_compiler::tensor::TensorFileError;

/// Why a checkpoint could not be written, found, read or averaged.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Checksum(#[from] crate::checksums::ChecksumError),
    #[error(transparent)]
    Io(#[from] kiln_compiler::io_error::PathIoError),
    #[error(transparent)]
    Tensor(#[from] TensorFileError),
    #[error(
        "`{path}` is not a checkpoint directory; checkpoints are `step_<N>` directories \
         under the checkpoints root (see `latest`)"
    )]
    NotACheckpoint { path: PathBuf },
    #[error(
        "checkpoint `{dir}` has no `{file}`, so it is incomplete (copied or edited by hand?); \
         restore the file, or delete the directory to fall back on an earlier checkpoint"
    )]
    MissingFile { dir: PathBuf, file: String },
    #[error(
        "checkpoint file `{path}` is unreadable: {source}; delete its directory to fall \
         back on an earlier checkpoint"
    )]
    Corrupt {
        path: PathBuf,
        source: TensorFileError,
    },
    #[error(
        "`{path}` is not a valid train state ({message}); fix the YAML, or delete the \
         checkpoint directory to fall back on an earlier one"
    )]
    BadState { path: PathBuf, message: String },
    #[error(
        "`{path}` is empty (truncated?); restore it, or delete the checkpoint directory to \
         fall back on an earlier one"
    )]
    EmptyState { path: PathBuf },
    #[error(
        "`{path}` is incomplete (truncated?): it has no {missing}, which an exact resume \
         needs; restore it, or delete the checkpoint directory to fall back on an earlier one"
    )]
    IncompleteState { path: PathBuf, missing: String },
    #[error(
        "`{path}` says step {state_step}, but its directory is for step {dir_step}; \
         the checkpoint was renamed or mixed up — rename the directory to step_{state_step:08}"
    )]
    StepMismatch {
        path: PathBuf,
        dir_step: u64,
        state_step: u64,
    },
    #[error("{message}")]
    Moments { message: String },
    #[error(
        "{message}; the checkpoint's files do not fit together: restore them, or delete the \
         checkpoint directory to fall back on an earlier one"
    )]
    Weights { message: String },
    /// A parameter or moment with NaN or infinite values.
    #[error("{message}")]
    NonFinite { message: String },
    #[error(
        "`{path}`: parameter `{name}` is {dtype}, but a checkpoint's parameters are f32 (as \
         kiln writes them); restore the file, or delete the checkpoint directory to fall back \
         on an earlier one"
    )]
    ParamDtype {
        path: PathBuf,
        name: String,
        dtype: &'static str,
    },
    #[error("cannot store an extra file named `{name}` in a checkpoint: {why}")]
    BadFileName { name: String, why: &'static str },
    #[error("`keep` must be at least 1 (keeping 0 checkpoints would delete the newest one)")]
    KeepZero,
    #[error("nothing to average: give at least one checkpoint")]
    AverageNothing,
    #[error(
        "cannot average `{odd}` with `{reference}`: {message}; average checkpoints of one \
         model only"
    )]
    AverageMismatch {
        reference: PathBuf,
        odd: PathBuf,
        message: String,
    },
    #[error("tensor `{name}` in `{path}` is {dtype}; only f32 and f64 parameters can be averaged")]
    AverageDtype {
        path: PathBuf,
        name: String,
        dtype: &'static str,
    },
}

pub(super) fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> CheckpointError + 'a {
    kiln_compiler::io_error::PathIoError::at(action, path)
}
