//! Loading compiled artifacts (written by `kiln compile --entries …`): no DSL, no optimizer.
//!
//! In: an artifact directory (format in `kiln_compiler::artifact`). Out: an [`Artifact`]
//! — the manifest's metadata, per entry a ready-to-build executor ([`Artifact::executor`])
//! and the weights ([`Artifact::weights`]).
//!
//! [`Artifact::load`] checks, in order: the directory and `manifest.json` exist; the
//! manifest is JSON with `format` = `kiln-artifact` and the `version` this kiln reads;
//! the manifest's SHA-256 is the `manifest_hash` it records (every manifest records one);
//! every file the manifest lists is present with its recorded size and SHA-256 (so a
//! truncated or edited file is named, not run); each entry's CLIF text splits back into
//! the functions the manifest lists; each graph verifies; each memory plan is the one its
//! kernel graph gives. The CLIF itself is parsed and compiled by [`Artifact::executor`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::artifact::{
    split_functions, Manifest, ManifestEntry, ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST_FILE,
    TOKENIZER_FILE, WEIGHTS_FILE,
};
use kiln_compiler::codegen::program::CpuCode;
use kiln_compiler::options::Precision as CompilePrecision;
use kiln_compiler::reference::ExecError;
use kiln_compiler::tensor::{load_safetensors, Tensor, TensorFileError};

use crate::compiled::Compiled;
use crate::graphs::{GraphSet, GRAPHS_FORMAT};

/// Why an artifact could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error(
        "no artifact at `{path}`: the directory does not exist; check the path, or write \
         one with `kiln compile SPEC --entries forward,... -o {path}`"
    )]
    NotFound { path: PathBuf },
    #[error(
        "`{path}` is a file, not an artifact: an artifact is the directory that `kiln compile \
         --entries … -o DIR` wrote"
    )]
    NotADirectory { path: PathBuf },
    #[error(
        "`{dir}` is not a kiln artifact: it has no `{file}`; give the directory that \
         `kiln compile --entries … -o DIR` wrote, or recompile"
    )]
    MissingManifest { dir: PathBuf, file: &'static str },
    #[error(transparent)]
    Io(#[from] kiln_compiler::io_error::PathIoError),
    #[error(
        "`{path}` is not a valid artifact manifest ({message}); recompile with `kiln compile`"
    )]
    BadManifest { path: PathBuf, message: String },
    #[error(
        "`{path}` has format `{found}`, not `{ARTIFACT_FORMAT}`: it is not a kiln artifact \
         manifest; give the directory that `kiln compile --entries … -o DIR` wrote"
    )]
    WrongFormat { path: PathBuf, found: String },
    #[error(
        "`{path}` is artifact format version {found}, but this kiln reads version \
         {ARTIFACT_VERSION}; recompile the spec with this kiln (`kiln compile SPEC \
         --entries … -o DIR`)"
    )]
    Version { path: PathBuf, found: u64 },
    #[error(
        "artifact file `{path}` is missing; the artifact is incomplete (copied partially?) — \
         copy it again or recompile with `kiln compile`"
    )]
    MissingFile { path: PathBuf },
    #[error(
        "artifact file `{path}` is corrupt: {what}; it was truncated or modified after \
         `kiln compile` wrote it — copy it again or recompile"
    )]
    Corrupt { path: PathBuf, what: String },
    #[error(transparent)]
    Tensor(#[from] TensorFileError),
    #[error(
        "the artifact has no entry `{entry}`; it has {available}; recompile with \
         `--entries` including it"
    )]
    NoEntry { entry: String, available: String },
    #[error(
        "the artifact `{path}` lacks the entries {missing} that training needs; compile it \
         from the training configuration: `kiln compile --config CONFIG.yaml -o {path}`"
    )]
    MissingEntries { path: PathBuf, missing: String },
    #[error("cannot build the executor of entry `{entry}`: {source}")]
    Executor {
        entry: String,
        source: Box<ExecError>,
    },
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> ArtifactError + 'a {
    kiln_compiler::io_error::PathIoError::at(action, path)
}

/// One entry point of a loaded artifact.
#[derive(Clone, Debug)]
pub struct ArtifactEntry {
    pub manifest: ManifestEntry,
    /// The CPU code, rebuilt from `kernels/<entry>.clif`.
    pub code: CpuCode,
    /// The CLIF file's size in bytes.
    pub clif_bytes: usize,
    /// Target `cuda`: the CUDA C of `kernels/<entry>.cu` (checked to define exactly the
    /// manifest's functions); its launch metadata is `manifest.cuda`.
    pub cuda_source: Option<String>,
}

/// A loaded, checked artifact.
#[derive(Clone, Debug)]
pub struct Artifact {
    pub dir: PathBuf,
    /// Format, version, target, model, spec hash, hparams, files (entries moved out into
    /// [`Artifact::entries`]).
    pub manifest: Manifest,
    entries: Vec<ArtifactEntry>,
    /// The files that are neither weights nor kernels (e.g. `tokenizer.json`), checked.
    extras: BTreeMap<String, Vec<u8>>,
}

/// Is `dir` an artifact directory (rather than a spec file or a model directory)?
pub fn is_artifact_dir(dir: &Path) -> bool {
    dir.is_dir() && dir.join(MANIFEST_FILE).is_file()
}

impl Artifact {
    /// Loads and checks the artifact at `dir` (see the module documentation).
    pub fn load(dir: &Path) -> Result<Artifact, ArtifactError> {
        let (mut manifest, mpath) = read_manifest(dir)?;
        let mut contents = read_files(dir, &manifest, &mpath)?;
        let mut entries = Vec::with_capacity(manifest.entries.len());
        let mut clif_files: Vec<String> = manifest.entries.iter().map(|e| e.clif.clone()).collect();
        clif_files.extend(
            manifest
                .entries
                .iter()
                .filter_map(|e| e.cuda.as_ref().map(|c| c.source.clone())),
        );
        for e in std::mem::take(&mut manifest.entries) {
            entries.push(load_entry(dir, &mpath, &manifest, e, &contents)?);
        }
        contents.retain(|rel, _| !clif_files.contains(rel));
        Ok(Artifact {
            dir: dir.to_path_buf(),
            manifest,
            entries,
            extras: contents,
        })
    }

    /// An extra file of the artifact (checked against the manifest when loaded).
    pub fn file(&self, name: &str) -> Option<&[u8]> {
        self.extras.get(name).map(|v| v.as_slice())
    }

    /// The tokenizer JSON, when the artifact carries one (compiled from a training
    /// configuration or a trained model).
    pub fn tokenizer_json(&self) -> Option<&[u8]> {
        self.file(TOKENIZER_FILE)
    }

    /// The graph of every entry a trainer needs (`train_step`, `loss`, `encode`,
    /// `decode_step`), or an error that names the missing ones and the fix.
    pub fn graph_set(&self) -> Result<GraphSet, ArtifactError> {
        let need = ["train_step", "loss", "encode", "decode_step"];
        let missing: Vec<&str> = need
            .iter()
            .copied()
            .filter(|n| !self.has_entry(n))
            .collect();
        if !missing.is_empty() {
            return Err(ArtifactError::MissingEntries {
                path: self.dir.clone(),
                missing: missing.join(", "),
            });
        }
        let g = |n: &str| self.entry(n).map(|e| e.manifest.graph.clone());
        Ok(GraphSet {
            format: GRAPHS_FORMAT,
            model: self.manifest.model.clone(),
            train_step: g("train_step")?,
            loss: g("loss")?,
            encode: g("encode")?,
            decode_step: g("decode_step")?,
        })
    }

    /// Whether the artifact has an entry `name`.
    pub fn has_entry(&self, name: &str) -> bool {
        self.entries.iter().any(|e| e.manifest.name == name)
    }

    pub fn model(&self) -> &str {
        &self.manifest.model
    }

    pub fn hparams(&self) -> &[(String, String)] {
        &self.manifest.hparams
    }

    pub fn entries(&self) -> &[ArtifactEntry] {
        &self.entries
    }

    /// The entry named `name`.
    pub fn entry(&self, name: &str) -> Result<&ArtifactEntry, ArtifactError> {
        self.entries
            .iter()
            .find(|e| e.manifest.name == name)
            .ok_or_else(|| ArtifactError::NoEntry {
                entry: name.to_string(),
                available: self
                    .entries
                    .iter()
                    .map(|e| format!("`{}`", e.manifest.name))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The compiled executor of entry `name` (JIT-compiles its CLIF for this machine).
    pub fn executor(&self, name: &str) -> Result<Compiled, ArtifactError> {
        let e = self.entry(name)?;
        let failed = |source| ArtifactError::Executor {
            entry: name.to_string(),
            source: Box::new(source),
        };
        let mut c = Compiled::new(
            e.manifest.graph.clone(),
            e.manifest.kernel_graph.clone(),
            e.manifest.plan.clone(),
            e.code.clone(),
            e.manifest.launch.clone(),
        )
        .map_err(failed)?;
        // `--precision int8`: the weights' products in int8, unless the run chose its own
        // (`--gemm-type`, which says so).
        let int8 = self.manifest.options.precision == CompilePrecision::Int8;
        if int8 && crate::compiled::process_choice().is_none() {
            c.set_bf16_kernel(Some(crate::compiled::Kernel16::Int8))
                .map_err(failed)?;
        }
        Ok(c)
    }

    /// The weights (`weights.safetensors`; its hash was checked by [`Artifact::load`]).
    pub fn weights(&self) -> Result<BTreeMap<String, Tensor>, ArtifactError> {
        Ok(load_safetensors(&self.dir.join(WEIGHTS_FILE))?)
    }

    /// The byte size of `weights.safetensors` as recorded in the manifest.
    pub fn weights_file_bytes(&self) -> u64 {
        self.manifest
            .files
            .get(WEIGHTS_FILE)
            .map(|r| r.bytes)
            .unwrap_or(0)
    }
}

/// Reads `dir`'s manifest and checks its format, version and own digest.
fn read_manifest(dir: &Path) -> Result<(Manifest, PathBuf), ArtifactError> {
    if dir.exists() && !dir.is_dir() {
        return Err(ArtifactError::NotADirectory {
            path: dir.to_path_buf(),
        });
    }
    if !dir.is_dir() {
        return Err(ArtifactError::NotFound {
            path: dir.to_path_buf(),
        });
    }
    let mpath = dir.join(MANIFEST_FILE);
    if !mpath.is_file() {
        return Err(ArtifactError::MissingManifest {
            dir: dir.to_path_buf(),
            file: MANIFEST_FILE,
        });
    }
    let bytes = std::fs::read(&mpath).map_err(io_err("read", &mpath))?;
    // Format and version first, from an untyped parse: a newer layout must give the
    // version error, not a schema error.
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| ArtifactError::BadManifest {
            path: mpath.clone(),
            message: format!("not JSON: {e}"),
        })?;
    let format = value.get("format").and_then(|f| f.as_str()).unwrap_or("");
    if format != ARTIFACT_FORMAT {
        return Err(ArtifactError::WrongFormat {
            path: mpath,
            found: format.to_string(),
        });
    }
    let version = value
        .get("version")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| ArtifactError::BadManifest {
            path: mpath.clone(),
            message: "no `version` number".to_string(),
        })?;
    if version != u64::from(ARTIFACT_VERSION) {
        return Err(ArtifactError::Version {
            path: mpath,
            found: version,
        });
    }
    let manifest: Manifest =
        serde_json::from_value(value).map_err(|e| ArtifactError::BadManifest {
            path: mpath.clone(),
            message: e.to_string(),
        })?;
    // The manifest itself: its graphs, kernels and memory plans are trusted by the
    // executors (a damaged plan would place buffers over each other).
    let recorded = &manifest.manifest_hash;
    let found = manifest.digest().map_err(|e| ArtifactError::BadManifest {
        path: mpath.clone(),
        message: e.to_string(),
    })?;
    if &found != recorded {
        return Err(ArtifactError::BadManifest {
            path: mpath.clone(),
            message: format!(
                "its SHA-256 is {found}, not the `{recorded}` recorded in it: it was \
                 modified or damaged after `kiln compile` wrote it"
            ),
        });
    }
    Ok((manifest, mpath))
}

/// Reads every file the manifest lists, each checked to be inside the artifact, present,
/// of the recorded size and SHA-256; returns all but the weights.
fn read_files(
    dir: &Path,
    manifest: &Manifest,
    mpath: &Path,
) -> Result<BTreeMap<String, Vec<u8>>, ArtifactError> {
    // Every listed file: present, same size, same hash.
    let mut contents: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (rel, rec) in &manifest.files {
        if rel.split('/').any(|c| c == ".." || c.is_empty()) || rel.starts_with('/') {
            return Err(ArtifactError::BadManifest {
                path: mpath.to_path_buf(),
                message: format!("file `{rel}` is not a path inside the artifact"),
            });
        }
        let path = dir.join(rel);
        if !path.is_file() {
            return Err(ArtifactError::MissingFile { path });
        }
        let data = std::fs::read(&path).map_err(io_err("read", &path))?;
        if data.len() as u64 != rec.bytes {
            return Err(ArtifactError::Corrupt {
                path,
                what: format!(
                    "it has {} bytes, the manifest records {}",
                    data.len(),
                    rec.bytes
                ),
            });
        }
        let h = kiln_compiler::fsync::sha256_hex(&data);
        if h != rec.sha256 {
            return Err(ArtifactError::Corrupt {
                path,
                what: format!("its SHA-256 is {h}, the manifest records {}", rec.sha256),
            });
        }
        if rel != WEIGHTS_FILE {
            contents.insert(rel.clone(), data);
        }
    }
    if !manifest.files.contains_key(WEIGHTS_FILE) {
        return Err(ArtifactError::BadManifest {
            path: mpath.to_path_buf(),
            message: format!("`{WEIGHTS_FILE}` is not in the files table"),
        });
    }
    if manifest.entries.is_empty() {
        return Err(ArtifactError::BadManifest {
            path: mpath.to_path_buf(),
            message: "it lists no entry points".to_string(),
        });
    }
    Ok(contents)
}

/// One entry of the manifest with its code: the CLIF (and CUDA C) defining exactly the
/// listed functions, the graphs verified, the memory and launch plans those the kernel
/// graph gives.
fn load_entry(
    dir: &Path,
    mpath: &Path,
    manifest: &Manifest,
    e: ManifestEntry,
    contents: &BTreeMap<String, Vec<u8>>,
) -> Result<ArtifactEntry, ArtifactError> {
    let (text, cpath) = entry_text(dir, mpath, contents, (&e.name, "CLIF", &e.clif))?;
    let corrupt = |what: String| ArtifactError::Corrupt {
        path: cpath.clone(),
        what,
    };
    let functions = split_functions(text).map_err(corrupt)?;
    let names: Vec<&String> = functions.iter().map(|(n, _)| n).collect();
    let want: Vec<&String> = e.functions.iter().collect();
    if names != want {
        return Err(corrupt(format!(
            "it defines functions {names:?}, the manifest lists {want:?}"
        )));
    }
    e.graph.verify().map_err(|err| ArtifactError::BadManifest {
        path: mpath.to_path_buf(),
        message: format!("entry `{}`: the graph is corrupt: {err}", e.name),
    })?;
    e.kernel_graph
        .verify()
        .map_err(|err| ArtifactError::BadManifest {
            path: mpath.to_path_buf(),
            message: format!("entry `{}`: the kernel graph is corrupt: {err}", e.name),
        })?;
    // The memory plan is a function of the kernel graph; the executors place every
    // buffer by it, so one that differs (a manifest edited and hashed again) is
    // refused rather than trusted.
    let planned = kiln_compiler::plan::MemoryPlan::build_reusing(
        &e.kernel_graph,
        &|_, _| kiln_compiler::plan::ELEM_BYTES,
        manifest.options.buffer_reuse,
    );
    // A plan derived from the kernel graph that the manifest records otherwise.
    let edited = |what: &str| ArtifactError::BadManifest {
        path: mpath.to_path_buf(),
        message: format!(
            "entry `{}`: the {what} is not the one its kernel graph gives; it was \
             modified or damaged",
            e.name
        ),
    };
    if e.plan != planned {
        return Err(edited("memory plan"));
    }
    let code = CpuCode {
        functions,
        kernels: e
            .launch
            .launches
            .iter()
            .map(|l| l.functions.clone())
            .collect(),
    };
    // So is the launch plan, with the code's functions: what the executors replay
    // must be what the compiler decided, not an edited list.
    let launch = kiln_compiler::launch_plan::LaunchPlan::build(
        &e.kernel_graph,
        &code,
        &e.plan,
        &manifest.options,
    );
    if launch.as_ref() != Ok(&e.launch) {
        return Err(edited("launch plan"));
    }
    let cuda_source = match (
        &e.cuda,
        manifest.target() == kiln_compiler::optimize::Target::Cuda,
    ) {
        (None, false) => None,
        (Some(_), false) | (None, true) => {
            return Err(ArtifactError::BadManifest {
                path: mpath.to_path_buf(),
                message: format!(
                    "entry `{}` {} CUDA code, but the target is `{}`",
                    e.name,
                    if e.cuda.is_some() { "has" } else { "lacks" },
                    manifest.target().name()
                ),
            })
        }
        (Some(c), true) => Some(cuda_source(dir, mpath, &e, c, contents)?),
    };
    Ok(ArtifactEntry {
        clif_bytes: text.len(),
        manifest: e,
        code,
        cuda_source,
    })
}

/// The text of an entry's `kind` code file `rel` (with its path): listed in the files
/// table, and UTF-8.
fn entry_text<'a>(
    dir: &Path,
    mpath: &Path,
    contents: &'a BTreeMap<String, Vec<u8>>,
    (entry, kind, rel): (&str, &str, &str),
) -> Result<(&'a str, PathBuf), ArtifactError> {
    let path = dir.join(rel);
    let Some(data) = contents.get(rel) else {
        return Err(ArtifactError::BadManifest {
            path: mpath.to_path_buf(),
            message: format!("entry `{entry}`: its {kind} file `{rel}` is not in the files table"),
        });
    };
    match std::str::from_utf8(data) {
        Ok(text) => Ok((text, path)),
        Err(err) => Err(ArtifactError::Corrupt {
            path,
            what: format!("not UTF-8 text ({err})"),
        }),
    }
}

/// An entry's CUDA C, checked to define exactly the manifest's functions, with one launch
/// per kernel of the launch plan.
fn cuda_source(
    dir: &Path,
    mpath: &Path,
    e: &ManifestEntry,
    c: &kiln_compiler::artifact::CudaManifest,
    contents: &BTreeMap<String, Vec<u8>>,
) -> Result<String, ArtifactError> {
    let (text, upath) = entry_text(dir, mpath, contents, (&e.name, "CUDA", &c.source))?;
    let corrupt = |what: String| ArtifactError::Corrupt {
        path: upath.clone(),
        what,
    };
    let names = kiln_compiler::artifact::cuda_function_names(text);
    let want: Vec<String> = c.functions.iter().map(|f| f.name.clone()).collect();
    if names != want {
        return Err(corrupt(format!(
            "it defines functions {names:?}, the manifest lists {want:?}"
        )));
    }
    if c.kernels.len() != e.launch.launches.len() {
        return Err(ArtifactError::BadManifest {
            path: mpath.to_path_buf(),
            message: format!(
                "entry `{}`: {} CUDA kernel launches for {} kernels",
                e.name,
                c.kernels.len(),
                e.launch.launches.len()
            ),
        });
    }
    Ok(text.to_string())
}
