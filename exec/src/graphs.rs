//! The entry points of one model as graphs (`graphs.json` of a model directory, or cut
//! from an artifact's kernel graphs): what the trainer, the decoder and `kiln translate`
//! run, without the spec.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use kiln_compiler::ir::Graph;

/// Bumped when the layout of `graphs.json` changes.
pub const GRAPHS_FORMAT: u32 = 1;

/// The entry points of one model, cut from the graphs of one spec.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GraphSet {
    pub format: u32,
    pub model: String,
    pub train_step: Graph,
    pub loss: Graph,
    pub encode: Graph,
    pub decode_step: Graph,
}

impl GraphSet {
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("graphs serialize")
    }

    pub fn from_json(bytes: &[u8], origin: &Path) -> Result<GraphSet, GraphsError> {
        let g: GraphSet = serde_json::from_slice(bytes).map_err(|e| GraphsError {
            path: origin.to_path_buf(),
            message: format!("not a kiln graph set ({e})"),
        })?;
        if g.format != GRAPHS_FORMAT {
            return Err(GraphsError {
                path: origin.to_path_buf(),
                message: format!(
                    "graph format {} is not the format {GRAPHS_FORMAT} of this kiln; retrain or use the kiln that wrote it",
                    g.format
                ),
            });
        }
        for (name, graph) in [
            ("train_step", &g.train_step),
            ("loss", &g.loss),
            ("encode", &g.encode),
            ("decode_step", &g.decode_step),
        ] {
            graph.verify().map_err(|e| GraphsError {
                path: origin.to_path_buf(),
                message: format!("the `{name}` graph is corrupt: {e}"),
            })?;
        }
        Ok(g)
    }

    /// The vocabulary size: the last axis of the logits.
    pub fn vocab(&self) -> Option<usize> {
        logits_width(&self.decode_step)
    }
}

/// The last axis of a graph's `logits` output (the vocabulary size).
pub fn logits_width(g: &Graph) -> Option<usize> {
    let id = g.output("logits")?;
    g.ty(id).shape.dims().last()?.as_const().map(|v| v as usize)
}

/// A `graphs.json` that cannot be used: unreadable, of another format, or corrupt.
#[derive(Debug, thiserror::Error)]
#[error("`{path}`: {message}")]
pub struct GraphsError {
    pub path: PathBuf,
    pub message: String,
}
