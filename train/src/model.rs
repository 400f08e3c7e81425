//! A trained model on disk, and what it takes to use one without the spec.
//!
//! In: the entry-point graphs of a spec (compiled once, when training starts), the
//! tokenizer and the weights. Out: a *model directory* — `model.safetensors`,
//! `graphs.json` (the [`GraphSet`]: `train_step`, `loss`, `encode`, `decode_step`) and
//! `tokenizer.json` — which `kiln translate`, `kiln average` and a resumed training run
//! load without the DSL. Every checkpoint directory is a model directory (plus the
//! optimizer state), and so is the output of `kiln average`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::tensor::{load_safetensors, Tensor};

pub use kiln_exec::graphs::{logits_width, GraphSet, GraphsError, GRAPHS_FORMAT};

use crate::checkpoint::{self, MODEL_FILE};
use crate::data::Tokenizer;

pub const GRAPHS_FILE: &str = "graphs.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const CONFIG_FILE: &str = "config.yaml";
/// The tokenizer read from `path` must have one token per row of the model's embedding,
/// `vocab` (the logits' width, [`GraphSet::vocab`]; `None`: nothing to compare): a smaller
/// one gives garbage translations, a larger one ids out of range.
pub fn check_vocab(
    tokenizer: &Tokenizer,
    vocab: Option<usize>,
    path: &Path,
) -> Result<(), ModelError> {
    match vocab {
        Some(rows) if rows != tokenizer.vocab_size() => Err(ModelError::VocabMismatch {
            path: path.to_path_buf(),
            tokens: tokenizer.vocab_size(),
            rows,
        }),
        _ => Ok(()),
    }
}

/// Why a model directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(
        "`{path}` is not a kiln model: it has no `{file}`; give a checkpoint directory \
         (`<run>/checkpoints/step_N`), a run directory, or the output of `kiln average`"
    )]
    Missing { path: PathBuf, file: &'static str },
    #[error("`{path}`: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error(
        "`{path}` has {tokens} tokens but the model's embedding has {rows} rows; this \
         tokenizer belongs to another model: use the tokenizer.json saved with these weights \
         (every checkpoint holds its own)"
    )]
    VocabMismatch {
        path: PathBuf,
        tokens: usize,
        rows: usize,
    },
    #[error(transparent)]
    Graphs(#[from] GraphsError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    Checksum(#[from] crate::checksums::ChecksumError),
    #[error(transparent)]
    Tensor(#[from] kiln_compiler::tensor::TensorFileError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
}

/// A model loaded from a model directory.
pub struct LoadedModel {
    pub dir: PathBuf,
    pub graphs: GraphSet,
    pub params: BTreeMap<String, Tensor>,
    pub tokenizer: Tokenizer,
}

/// The model directory `path` names: itself, or the newest checkpoint of a run directory.
pub fn resolve(path: &Path) -> Result<PathBuf, ModelError> {
    if path.join(MODEL_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.join("checkpoints"), path.to_path_buf()] {
        if root.is_dir() {
            if let Some(c) = checkpoint::latest(&root)? {
                return Ok(c.dir);
            }
        }
    }
    Err(ModelError::Missing {
        path: path.to_path_buf(),
        file: MODEL_FILE,
    })
}

fn read(dir: &Path, file: &'static str) -> Result<Vec<u8>, ModelError> {
    let p = dir.join(file);
    std::fs::read(&p).map_err(|_| ModelError::Missing {
        path: dir.to_path_buf(),
        file,
    })
}

/// The graphs and tokenizer of a model directory, read and checked (as [`load`] does),
/// with the bytes of their files.
pub struct ModelFiles {
    pub graphs: GraphSet,
    pub tokenizer: Tokenizer,
    pub graphs_json: Vec<u8>,
    pub tokenizer_json: Vec<u8>,
}

/// Reads and checks `graphs.json` and `tokenizer.json` of the model directory `dir`
/// (not a run directory: see [`resolve`]), the tokenizer against the graphs' vocabulary.
pub fn read_files(dir: &Path) -> Result<ModelFiles, ModelError> {
    let graphs_json = read(dir, GRAPHS_FILE)?;
    let tokenizer_json = read(dir, TOKENIZER_FILE)?;
    // The files are checked against their record before any is parsed (a missing one is
    // named as missing first).
    crate::checksums::verify(dir, &[MODEL_FILE, GRAPHS_FILE, TOKENIZER_FILE])?;
    let graphs = GraphSet::from_json(&graphs_json, &dir.join(GRAPHS_FILE))?;
    let tok_text = std::str::from_utf8(&tokenizer_json).map_err(|_| ModelError::Invalid {
        path: dir.join(TOKENIZER_FILE),
        message: "not UTF-8".to_string(),
    })?;
    let tokenizer = Tokenizer::from_json(tok_text, &dir.join(TOKENIZER_FILE))?;
    check_vocab(&tokenizer, graphs.vocab(), &dir.join(TOKENIZER_FILE))?;
    Ok(ModelFiles {
        graphs,
        tokenizer,
        graphs_json,
        tokenizer_json,
    })
}

/// Loads a model directory (or the newest checkpoint of a run directory).
pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    let dir = resolve(path)?;
    let ModelFiles {
        graphs, tokenizer, ..
    } = read_files(&dir)?;
    let params = load_safetensors(&dir.join(MODEL_FILE))?;
    // The loss graph has every parameter.
    let file = dir.join(MODEL_FILE);
    kiln_exec::entry::check_weights(&graphs.loss, &file.display().to_string(), &params).map_err(
        |e| {
            // A new weights file from `kiln init`, the advice for a weights file of its
            // own, would throw a model directory's training away.
            let help = if e.help.contains("kiln init") {
                "restore the file from a copy, or use another checkpoint".to_string()
            } else {
                e.help
            };
            ModelError::Invalid {
                path: file.clone(),
                message: format!("{} ({help})", e.message),
            }
        },
    )?;
    Ok(LoadedModel {
        dir,
        graphs,
        params,
        tokenizer,
    })
}

/// What `kiln inspect` says of a model directory (a checkpoint, a run's newest
/// checkpoint, or the output of `kiln average`), after loading and checking it as
/// `kiln translate` does.
#[derive(Clone, Debug)]
pub struct ModelSummary {
    /// The model directory read.
    pub dir: PathBuf,
    /// When a run directory was given: its checkpoints' steps, oldest first.
    pub run_steps: Option<Vec<u64>>,
    /// The model's name in the spec.
    pub model: String,
    /// `config.yaml`'s `model.spec` and `model.set`, when the directory has one.
    pub spec: Option<(PathBuf, BTreeMap<String, String>)>,
    /// Parameter tensors, their elements and bytes.
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
    /// The tokenizer's vocabulary and the logits' width.
    pub tokenizer_vocab: usize,
    pub vocab: Option<usize>,
    /// The positions the model takes: a learned table's rows on the source side (`None`:
    /// computed positions, any length), and the longest output decoding writes
    /// ([`kiln_decode::search::max_target_positions`]; `None`: no cap but `max_len_a`,
    /// `max_len_b`).
    pub source_positions: Option<usize>,
    pub output_positions: Option<usize>,
    /// Nodes of each entry point's graph.
    pub graphs: Vec<(&'static str, usize)>,
    /// The training state of a checkpoint (`None` for an averaged model).
    pub state: Option<checkpoint::TrainState>,
    /// Extra files saved in the checkpoint.
    pub extra_files: Vec<String>,
}

/// Loads and checks the model directory `path` names (see [`resolve`]) and summarizes
/// it. A checkpoint's optimizer state is loaded and checked too.
pub fn summarize(path: &Path) -> Result<ModelSummary, ModelError> {
    let dir = resolve(path)?;
    let run_steps = if dir != path {
        let root = if path.join("checkpoints").is_dir() {
            path.join("checkpoints")
        } else {
            path.to_path_buf()
        };
        Some(checkpoint::list(&root)?.iter().map(|c| c.step).collect())
    } else {
        None
    };
    let m = load(&dir)?;
    let (state, extra_files) = if dir.join(checkpoint::STATE_FILE).is_file() {
        let c = checkpoint::load(&dir)?;
        let extra = c
            .extra_files
            .into_iter()
            .filter(|f| ![GRAPHS_FILE, TOKENIZER_FILE, CONFIG_FILE].contains(&f.as_str()))
            .collect();
        (Some(c.state), extra)
    } else {
        (None, Vec::new())
    };
    let spec = match std::fs::read_to_string(dir.join(CONFIG_FILE)) {
        Ok(text) => {
            let cfg: crate::config::Config =
                serde_yaml::from_str(&text).map_err(|e| ModelError::Invalid {
                    path: dir.join(CONFIG_FILE),
                    message: format!("not a kiln training configuration ({e})"),
                })?;
            let set = cfg
                .model
                .set
                .iter()
                .map(|(k, v)| {
                    let v = serde_yaml::to_string(v).unwrap_or_default();
                    (k.clone(), v.trim().to_string())
                })
                .collect();
            Some((cfg.model.spec, set))
        }
        Err(_) => None,
    };
    let g = &m.graphs;
    Ok(ModelSummary {
        run_steps,
        model: g.model.clone(),
        spec,
        tensors: m.params.len(),
        parameters: m.params.values().map(|t| t.numel() as u64).sum(),
        bytes: m
            .params
            .values()
            .map(|t| {
                let width = match t.dtype_name() {
                    "f64" | "i64" => 8,
                    "bool" => 1,
                    _ => 4,
                };
                (t.numel() * width) as u64
            })
            .sum(),
        tokenizer_vocab: m.tokenizer.vocab_size(),
        vocab: g.vocab(),
        source_positions: g.encode.position_table("src_len").map(|t| t.rows),
        output_positions: kiln_decode::search::max_target_positions(&g.decode_step),
        graphs: vec![
            ("train_step", g.train_step.len()),
            ("loss", g.loss.len()),
            ("encode", g.encode.len()),
            ("decode_step", g.decode_step.len()),
        ],
        state,
        extra_files,
        dir,
    })
}

/// Writes a model directory: weights, graphs, tokenizer and `extra` files (atomically,
/// file by file), then their checksums ([`crate::checksums`]).
pub fn save_dir(
    dir: &Path,
    params: &BTreeMap<String, Tensor>,
    graphs_json: &[u8],
    tokenizer_json: &[u8],
    extra: &[(&str, &[u8])],
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::Invalid {
        path: dir.to_path_buf(),
        message: format!("cannot create the directory: {e}"),
    })?;
    let list: Vec<(String, Tensor)> = params.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    kiln_compiler::tensor::save_safetensors(&dir.join(MODEL_FILE), &list, None)?;
    let files = [(GRAPHS_FILE, graphs_json), (TOKENIZER_FILE, tokenizer_json)];
    for &(name, bytes) in files.iter().chain(extra) {
        write_atomic(&dir.join(name), bytes).map_err(|e| ModelError::Invalid {
            path: dir.join(name),
            message: format!("cannot write: {e}"),
        })?;
    }
    let mut names = vec![MODEL_FILE];
    names.extend(files.iter().chain(extra).map(|(n, _)| *n));
    crate::checksums::write(dir, &names).map_err(|e| ModelError::Invalid {
        path: dir.join(crate::checksums::CHECKSUMS_FILE),
        message: format!("cannot write: {e}"),
    })
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
