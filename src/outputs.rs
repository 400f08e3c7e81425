//! Where a command that writes may put its output. It never writes over a training
//! checkpoint, into a run directory, into a model directory or an artifact (whose files
//! belong together), or over one of its own inputs. Any other existing file is replaced
//! through a temporary file and a rename, so a failed write leaves it as it was.

use std::path::{Path, PathBuf};

use kiln_dsl::Error;
use kiln_train::{checkpoint, metrics, model};

use crate::plain;

/// What the output of a command is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Output {
    /// One file (weights, outputs, a kernel graph's text).
    File,
    /// A whole artifact directory (`kiln compile -o DIR`), which may replace an earlier
    /// artifact as a whole.
    Artifact,
    /// A whole model directory (`kiln average -o DIR`), which may replace an earlier
    /// average that lies outside any run.
    Model,
}

/// A directory whose files belong together, so that no command writes into it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Owned {
    Checkpoint,
    Run,
    Model,
    Artifact,
}

impl Owned {
    fn of(dir: &Path) -> Option<Owned> {
        let file = |name: &str| dir.join(name).is_file();
        if file(checkpoint::STATE_FILE) && file(checkpoint::MODEL_FILE) {
            Some(Owned::Checkpoint)
        } else if file(model::CONFIG_FILE)
            && (dir.join("checkpoints").is_dir() || dir.join(metrics::FILE_NAME).exists())
        {
            Some(Owned::Run)
        } else if file(model::GRAPHS_FILE) && file(checkpoint::MODEL_FILE) {
            Some(Owned::Model)
        } else if kiln_exec::artifact::is_artifact_dir(dir) {
            Some(Owned::Artifact)
        } else {
            None
        }
    }

    fn name(self) -> &'static str {
        match self {
            Owned::Checkpoint => "a training checkpoint",
            Owned::Run => "a training run's directory",
            Owned::Model => "a model directory",
            Owned::Artifact => "a compiled artifact",
        }
    }
}

/// `path` made absolute with its symbolic links resolved, as far as it exists: the
/// canonical parent joined with the name when only the parent exists; `None` when that
/// does not exist either (nothing there to overwrite).
pub fn canonical(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Some(p);
    }
    let name = path.file_name()?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Some(std::fs::canonicalize(parent).ok()?.join(name))
}

/// Refuses an `output` of command `code` that is one of its `inputs`, or that is (or lies inside) a checkpoint, a run, a model directory or an artifact —
/// except that an [`Output::Artifact`] may replace an artifact and an [`Output::Model`] a
/// model directory, each as a whole, where nothing holds them.
pub fn check(
    code: &'static str,
    output: &Path,
    inputs: &[&Path],
    kind: Output,
) -> Result<(), Error> {
    let Some(out) = canonical(output) else {
        return Ok(());
    };
    let shown = output.display();
    let refuse = |message: String| {
        Err(plain(
            code,
            message,
            Some("choose another -o, outside it: nothing there is written over".to_string()),
        ))
    };
    for input in inputs {
        let Some(c) = canonical(input) else { continue };
        if out == c {
            return refuse(format!(
                "`-o {shown}` is one of the inputs (`{}`), which the output would overwrite",
                input.display()
            ));
        }
    }
    for (depth, dir) in out.ancestors().enumerate() {
        let Some(owned) = Owned::of(dir) else {
            continue;
        };
        // (Whatever holds it is checked next.)
        let replaces_whole = depth == 0
            && matches!(
                (kind, owned),
                (Output::Artifact, Owned::Artifact) | (Output::Model, Owned::Model)
            );
        if replaces_whole {
            continue;
        }
        return refuse(if depth == 0 {
            format!(
                "`-o {shown}` is {}, whose files the output would overwrite",
                owned.name()
            )
        } else {
            format!(
                "`-o {shown}` is inside {} (`{}`), whose files belong together",
                owned.name(),
                dir.display()
            )
        });
    }
    Ok(())
}
