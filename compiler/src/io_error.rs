//! The one error for a failed file operation, shared by every file format kiln writes or
//! reads (tensors, artifacts, checkpoints, corpora): what was being done, on which path.

use std::path::{Path, PathBuf};

/// `cannot {action} `{path}`: {source}`.
#[derive(Debug, thiserror::Error)]
#[error("cannot {action} `{path}`: {source}")]
pub struct PathIoError {
    pub action: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

impl PathIoError {
    pub fn new(action: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self {
            action,
            path: path.to_path_buf(),
            source,
        }
    }

    /// For `map_err`: the failure of `action` on `path`, as any error that wraps it.
    pub fn at<'a, E: From<PathIoError>>(
        action: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(std::io::Error) -> E + 'a {
        move |source| Self::new(action, path, source).into()
    }
}
