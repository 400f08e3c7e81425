//! Compiled artifacts: an optimized, planned, code-generated model on disk.
//!
//! In: per entry point its source [`Graph`], [`KernelGraph`], [`MemoryPlan`] and
//! [`CpuCode`], the initial weights, and metadata (model, spec hash, hparams). Out: a
//! directory that `kiln_exec::artifact::Artifact::load` runs without the DSL:
//!
//! - `manifest.json` — [`Manifest`]: `format` ([`ARTIFACT_FORMAT`]), `version`
//!   ([`ARTIFACT_VERSION`]), the compile options ([`CompileOptions`]: target, CUDA
//!   architecture, precision, buffer reuse), model, spec hash, hparams, seed; per entry the
//!   graph, the kernel graph, the memory plan and the launch plan ([`LaunchPlan`]: every
//!   kernel in launch order with its kind, the functions it runs by role, the buffers it
//!   reads and writes, and the fusions); the size and SHA-256 of every other
//!   file;
//! - `kernels/<entry>.clif` — the entry's CLIF functions ([`CpuCode::text`]); the loader
//!   rebuilds the function list by splitting it at `function %name` lines
//!   ([`split_functions`]), so the text is the source of truth;
//! - `kernels/<entry>.cu` — for target `cuda` only: the entry's CUDA C, one NVRTC
//!   compilation unit ([`crate::codegen::cuda::CudaCode::source`]); the manifest entry's
//!   `cuda` field records the architecture, the NVRTC options, each function's launch
//!   metadata and what every kernel launches ([`CudaManifest`]). A CUDA artifact carries
//!   the CLIF of the same kernel graph too, so it runs on any machine;
//! - `weights.safetensors` — the parameters (the union over the entries);
//! - optional extra files at the top level, hashed like the rest: `tokenizer.json`
//!   ([`TOKENIZER_FILE`]) when the artifact was compiled from a training configuration or
//!   a trained model, so that `kiln train` and `kiln translate` need nothing else.
//!
//! The write is atomic: everything goes into `DIR.tmp-<pid>`, is flushed, and is renamed
//! to `DIR`; an existing artifact at `DIR` is moved aside only once the new one is
//! complete, and removed after the rename. A `DIR` that exists but is not an artifact (and
//! is not empty) is never touched. The bytes are deterministic: the same inputs give
//! byte-identical files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::codegen::cuda::{CudaCode, KernelLaunch, Param, Work};
use crate::codegen::program::CpuCode;
use crate::ir::Graph;
use crate::launch_plan::LaunchPlan;
use crate::optimize::kernels::KernelGraph;
use crate::optimize::Target;
use crate::options::CompileOptions;
use crate::plan::MemoryPlan;
use crate::tensor::{save_safetensors, Tensor, TensorFileError};

/// The `format` field of every manifest.
pub const ARTIFACT_FORMAT: &str = "kiln-artifact";
/// The manifest layout this kiln writes and reads; bumped on any incompatible change
/// (2: the compile options replace the target; 3: the launch plan replaces the roles and
/// the kernel summary; 4: SHA-256 digests of every file and of the manifest, which every
/// manifest has).
pub const ARTIFACT_VERSION: u32 = 4;
pub const MANIFEST_FILE: &str = "manifest.json";
pub const WEIGHTS_FILE: &str = "weights.safetensors";
pub const KERNELS_DIR: &str = "kernels";
/// The shared BPE vocabulary (the `tokenizers` JSON), when the artifact carries one.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The 64-bit FNV-1a hash of nothing: where [`fnv1a64_update`] starts.
pub const FNV1A64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// The 64-bit FNV-1a hash of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_update(FNV1A64_OFFSET, bytes)
}

/// The hash `h` of some bytes, continued over `bytes` (a file hashed chunk by chunk).
pub fn fnv1a64_update(h: u64, bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

/// The hash as it appears in a manifest: 16 lowercase hex digits.
pub fn hash_hex(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a64(bytes))
}

/// The spec hash of a manifest: FNV-1a 64 over the spec's source text (the CLI passes
/// every file it reads: the spec, its imports and the prelude, each with its name), then
/// each override (NUL-separated so `a` + `bc` differs from `ab` + `c`).
pub fn spec_hash(spec_text: &str, overrides: &[String], model: Option<&str>) -> String {
    let mut bytes = spec_text.as_bytes().to_vec();
    for o in overrides {
        bytes.push(0);
        bytes.extend_from_slice(o.as_bytes());
    }
    if let Some(m) = model {
        bytes.extend_from_slice(b"\0model=");
        bytes.extend_from_slice(m.as_bytes());
    }
    hash_hex(&bytes)
}

/// The relative path of an entry's CLIF file.
pub fn clif_path(entry: &str) -> String {
    format!("{KERNELS_DIR}/{entry}.clif")
}

/// Size and hash of one file of the artifact.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    pub bytes: u64,
    /// SHA-256, 64 hex digits.
    pub sha256: String,
}

impl FileRecord {
    /// The record of a file with these bytes.
    pub fn of(bytes: &[u8]) -> FileRecord {
        FileRecord {
            bytes: bytes.len() as u64,
            sha256: crate::fsync::sha256_hex(bytes),
        }
    }
}

/// The CUDA C file of an entry, relative to the artifact (`kernels/<name>.cu`).
pub fn cuda_path(entry: &str) -> String {
    format!("{KERNELS_DIR}/{entry}.cu")
}

/// One generated CUDA function as the manifest lists it (its text is in the `.cu` file).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaFunctionInfo {
    pub name: String,
    /// Buffer parameters in order (then `dims` and `items`).
    pub params: Vec<Param>,
    pub work: Work,
    /// What `items` counts.
    pub items_rule: String,
}

/// The CUDA half of a manifest entry (target `cuda`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaManifest {
    /// The CUDA C file, relative to the artifact (`kernels/<name>.cu`).
    pub source: String,
    /// The GPU architecture NVRTC compiles for (`sm_90`).
    pub arch: String,
    /// The NVRTC options the kernels are written for.
    pub nvrtc_options: Vec<String>,
    /// Functions in the order of the file.
    pub functions: Vec<CudaFunctionInfo>,
    /// Per kernel launch index: its functions by role, or the library call it is.
    pub kernels: Vec<KernelLaunch>,
    /// A mixed-precision program's buffers: per kernel value, each output's element type
    /// ([`CudaCode::storage`]); empty for an f32 program.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub storage: crate::codegen::cuda::storage::Storage,
}

/// Every `__global__` function name defined in CUDA C text, in order.
pub fn cuda_function_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split("__global__ void ").nth(1) {
            // (`__launch_bounds__(N)` may come before the name.)
            let rest = match rest.strip_prefix("__launch_bounds__(") {
                Some(r) => r
                    .split_once(')')
                    .map_or("", |(_, after)| after)
                    .trim_start(),
                None => rest,
            };
            if let Some(name) = rest.split('(').next() {
                names.push(name.trim().to_string());
            }
        }
    }
    names
}

/// One entry point in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ManifestEntry {
    pub name: String,
    /// The CLIF file, relative to the artifact (`kernels/<name>.clif`).
    pub clif: String,
    /// Target `cuda`: the CUDA C code (absent for `cpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaManifest>,
    /// Function names in the order of the CLIF file.
    pub functions: Vec<String>,
    /// What runs, in order ([`LaunchPlan`]).
    pub launch: LaunchPlan,
    pub graph: Graph,
    pub kernel_graph: KernelGraph,
    pub plan: MemoryPlan,
}

/// `manifest.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// What the artifact was compiled for and how ([`CompileOptions`]).
    pub options: CompileOptions,
    /// The kiln that wrote it (informational).
    pub kiln: String,
    pub model: String,
    pub spec_hash: String,
    pub seed: u64,
    pub hparams: Vec<(String, String)>,
    /// Every file besides the manifest, by relative path.
    pub files: BTreeMap<String, FileRecord>,
    /// The manifest's own SHA-256 ([`Manifest::digest`]): a manifest changed or damaged
    /// after it was written — its graphs, kernels or memory plans, which the runtime
    /// trusts — is refused at load. Every manifest has one.
    pub manifest_hash: String,
    pub entries: Vec<ManifestEntry>,
}

impl Manifest {
    /// The machine the artifact was compiled for.
    pub fn target(&self) -> Target {
        self.options.target
    }

    /// The digest of everything in the manifest but [`Manifest::manifest_hash`]: SHA-256
    /// over its compact JSON with that field left out.
    pub fn digest(&self) -> Result<String, ArtifactError> {
        let mut value = serde_json::to_value(self)
            .map_err(|e| ArtifactError::Invalid(format!("the manifest does not serialize: {e}")))?;
        if let Some(map) = value.as_object_mut() {
            map.remove("manifest_hash");
        }
        let bytes = serde_json::to_vec(&value)
            .map_err(|e| ArtifactError::Invalid(format!("the manifest does not serialize: {e}")))?;
        Ok(crate::fsync::sha256_hex(&bytes))
    }
}

/// One entry point to write.
#[derive(Clone, Debug)]
pub struct EntrySpec {
    pub name: String,
    pub graph: Graph,
    pub kernel_graph: KernelGraph,
    pub plan: MemoryPlan,
    pub code: CpuCode,
    pub launch: LaunchPlan,
    /// Target `cuda`: the CUDA code of the same kernel graph, for `arch`.
    pub cuda: Option<CudaEntrySpec>,
}

/// The CUDA code of one entry to write.
#[derive(Clone, Debug)]
pub struct CudaEntrySpec {
    pub code: CudaCode,
    /// `sm_90`, …
    pub arch: String,
}

/// Everything an artifact holds.
#[derive(Clone, Debug)]
pub struct ArtifactSpec {
    pub model: String,
    pub spec_hash: String,
    pub seed: u64,
    pub hparams: Vec<(String, String)>,
    /// The options it was compiled with; with target `cuda` every entry has
    /// [`EntrySpec::cuda`].
    pub options: CompileOptions,
    pub entries: Vec<EntrySpec>,
    /// Parameters by name.
    pub weights: BTreeMap<String, Tensor>,
    /// Extra top-level files by name (e.g. [`TOKENIZER_FILE`]).
    pub extras: BTreeMap<String, Vec<u8>>,
}

/// Why an artifact could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error(transparent)]
    Io(#[from] crate::io_error::PathIoError),
    #[error(transparent)]
    Tensor(#[from] TensorFileError),
    #[error(
        "`{path}` exists and is not a kiln artifact (it has no `{MANIFEST_FILE}` and is not \
         empty); choose another output directory, or remove it first"
    )]
    NotAnArtifact { path: PathBuf },
    #[error("cannot write the artifact: {0}")]
    Invalid(String),
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> ArtifactError + 'a {
    crate::io_error::PathIoError::at(action, path)
}

/// Splits CLIF text (as [`CpuCode::text`] writes it) into `(name, text)` per function at
/// every line that starts with `function %`. Errors when there is text before the first
/// function, a header has no name, or a name repeats.
pub fn split_functions(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (n, line) in text.split_inclusive('\n').enumerate() {
        if let Some(rest) = line.strip_prefix("function %") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() {
                return Err(format!("line {}: a function header without a name", n + 1));
            }
            if out.iter().any(|(m, _)| *m == name) {
                return Err(format!(
                    "line {}: function `%{name}` is defined twice",
                    n + 1
                ));
            }
            out.push((name, String::new()));
        }
        match out.last_mut() {
            Some((_, t)) => t.push_str(line),
            None if line.trim().is_empty() => {}
            None => {
                return Err(format!(
                    "line {}: text before the first `function %name` line",
                    n + 1
                ))
            }
        }
    }
    // Undo the blank separator line `CpuCode::text` puts after every function.
    for (_, t) in &mut out {
        while t.ends_with("\n\n") {
            t.pop();
        }
    }
    Ok(out)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), ArtifactError> {
    crate::fsync::write_synced(path, bytes).map_err(|(action, e)| io_err(action, path)(e))
}

use crate::fsync::sync_dir;

/// `<dir><suffix>` next to `dir`.
fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.as_os_str().to_os_string();
    name.push(suffix);
    PathBuf::from(name)
}

/// The CLIF files of `art` (relative path → bytes), after checking the entry names and
/// that each text splits back into its functions.
fn clif_files(art: &ArtifactSpec) -> Result<Vec<(String, Vec<u8>)>, ArtifactError> {
    let mut files = Vec::new();
    for e in &art.entries {
        if e.name.is_empty()
            || !e
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(ArtifactError::Invalid(format!(
                "entry name `{}` is not a plain name (letters, digits, `_`, `-`)",
                e.name
            )));
        }
        if art.entries.iter().filter(|o| o.name == e.name).count() > 1 {
            return Err(ArtifactError::Invalid(format!(
                "entry `{}` is given twice",
                e.name
            )));
        }
        let text = e.code.text();
        // The loader rebuilds the functions from the text: check that it will.
        let split = split_functions(&text).map_err(|m| {
            ArtifactError::Invalid(format!("the CLIF text of `{}` does not split: {m}", e.name))
        })?;
        let names: Vec<&String> = split.iter().map(|(n, _)| n).collect();
        let want: Vec<&String> = e.code.functions.iter().map(|(n, _)| n).collect();
        if names != want {
            return Err(ArtifactError::Invalid(format!(
                "the CLIF text of `{}` splits into functions {names:?}, not {want:?}",
                e.name
            )));
        }
        files.push((clif_path(&e.name), text.into_bytes()));
    }
    Ok(files)
}

/// The `.cu` files of a `cuda` artifact (none for `cpu`), checked: the target and the
/// entries agree, and the text defines exactly the listed functions, in order.
fn cuda_files(art: &ArtifactSpec) -> Result<Vec<(String, Vec<u8>)>, ArtifactError> {
    let cuda = art.options.target == Target::Cuda;
    let mut files = Vec::new();
    for e in &art.entries {
        match (&e.cuda, cuda) {
            (None, false) => continue,
            (Some(_), false) => {
                return Err(ArtifactError::Invalid(format!(
                    "entry `{}` has CUDA code but the target is `{}`",
                    e.name,
                    art.options.target.name()
                )))
            }
            (None, true) => {
                return Err(ArtifactError::Invalid(format!(
                    "target `cuda`, but entry `{}` has no CUDA code",
                    e.name
                )))
            }
            (Some(c), true) => {
                let text = c.code.source();
                let names = cuda_function_names(&text);
                let want: Vec<String> = c.code.functions.iter().map(|f| f.name.clone()).collect();
                if names != want {
                    return Err(ArtifactError::Invalid(format!(
                        "the CUDA C of `{}` defines functions {names:?}, not {want:?}",
                        e.name
                    )));
                }
                files.push((cuda_path(&e.name), text.into_bytes()));
            }
        }
    }
    Ok(files)
}

/// Writes the artifact `art` to `dir` (see the module documentation).
pub fn write_artifact(dir: &Path, art: &ArtifactSpec) -> Result<(), ArtifactError> {
    if art.entries.is_empty() {
        return Err(ArtifactError::Invalid(
            "no entry points; give at least one".to_string(),
        ));
    }
    let clifs = clif_files(art)?;
    let cudas = cuda_files(art)?;
    check_extras(art)?;
    prepare_destination(dir)?;
    let pid = std::process::id();
    let tmp = sibling(dir, &format!(".tmp-{pid}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err("remove", &tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err("create", &tmp))?;
    let written = write_files(&tmp, art, clifs.iter().chain(&cudas))
        .and_then(|()| replace_with(dir, &tmp, pid));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(())
}

/// Extra files are plain top-level names that are not the artifact's own.
fn check_extras(art: &ArtifactSpec) -> Result<(), ArtifactError> {
    let reserved = [MANIFEST_FILE, WEIGHTS_FILE, KERNELS_DIR];
    for name in art.extras.keys() {
        if name.is_empty()
            || name.contains(['/', '\\'])
            || name.starts_with('.')
            || reserved.contains(&name.as_str())
        {
            return Err(ArtifactError::Invalid(format!(
                "extra file `{name}` must be a plain top-level name other than {}",
                reserved.join(", ")
            )));
        }
    }
    Ok(())
}

/// Refuses a destination that is neither an artifact nor empty, creates its parent, and
/// removes what a write killed before left beside it (`DIR.tmp-PID`, `DIR.tmp-PID-old`).
fn prepare_destination(dir: &Path) -> Result<(), ArtifactError> {
    if dir.exists() {
        let is_artifact = dir.join(MANIFEST_FILE).is_file();
        let empty = dir.is_dir()
            && std::fs::read_dir(dir)
                .map_err(io_err("read", dir))?
                .next()
                .is_none();
        if !is_artifact && !empty {
            return Err(ArtifactError::NotAnArtifact {
                path: dir.to_path_buf(),
            });
        }
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_err("create", parent))?;
    }
    if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name().and_then(|n| n.to_str())) {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        crate::fsync::remove_stale_temps(parent, Some(name)).map_err(io_err("clean", parent))?;
    }
    Ok(())
}

/// Writes the kernels, the weights, the extras and last the manifest (which records the
/// digest of each) into the temporary directory `tmp`, each synced.
fn write_files<'a>(
    tmp: &Path,
    art: &ArtifactSpec,
    kernels: impl Iterator<Item = &'a (String, Vec<u8>)>,
) -> Result<(), ArtifactError> {
    let kdir = tmp.join(KERNELS_DIR);
    std::fs::create_dir(&kdir).map_err(io_err("create", &kdir))?;
    let mut files: BTreeMap<String, FileRecord> = BTreeMap::new();
    for (rel, bytes) in kernels {
        write_synced(&tmp.join(rel), bytes)?;
        files.insert(rel.clone(), FileRecord::of(bytes));
    }
    let named: Vec<(String, Tensor)> = art
        .weights
        .iter()
        .map(|(k, t)| (k.clone(), t.clone()))
        .collect();
    let wpath = tmp.join(WEIGHTS_FILE);
    save_safetensors(&wpath, &named, None)?;
    let wbytes = std::fs::read(&wpath).map_err(io_err("read back", &wpath))?;
    files.insert(WEIGHTS_FILE.to_string(), FileRecord::of(&wbytes));
    for (name, bytes) in &art.extras {
        write_synced(&tmp.join(name), bytes)?;
        files.insert(name.clone(), FileRecord::of(bytes));
    }
    let mut manifest = Manifest {
        format: ARTIFACT_FORMAT.to_string(),
        version: ARTIFACT_VERSION,
        options: art.options.clone(),
        kiln: format!("kiln {}", env!("CARGO_PKG_VERSION")),
        model: art.model.clone(),
        spec_hash: art.spec_hash.clone(),
        seed: art.seed,
        hparams: art.hparams.clone(),
        files,
        manifest_hash: String::new(),
        entries: art.entries.iter().map(manifest_entry).collect(),
    };
    manifest.manifest_hash = manifest.digest()?;
    let mut json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| ArtifactError::Invalid(format!("the manifest does not serialize: {e}")))?;
    json.push(b'\n');
    write_synced(&tmp.join(MANIFEST_FILE), &json)?;
    sync_dir(&kdir);
    sync_dir(tmp);
    Ok(())
}

/// The manifest's record of one entry point.
fn manifest_entry(e: &EntrySpec) -> ManifestEntry {
    ManifestEntry {
        name: e.name.clone(),
        clif: clif_path(&e.name),
        cuda: e.cuda.as_ref().map(|c| CudaManifest {
            source: cuda_path(&e.name),
            arch: c.arch.clone(),
            nvrtc_options: crate::codegen::cuda::nvrtc_options(&c.arch),
            functions: c
                .code
                .functions
                .iter()
                .map(|f| CudaFunctionInfo {
                    name: f.name.clone(),
                    params: f.params.clone(),
                    work: f.work,
                    items_rule: f.items_rule.clone(),
                })
                .collect(),
            kernels: c.code.kernels.clone(),
            storage: c.code.storage.clone(),
        }),
        functions: e.code.functions.iter().map(|(n, _)| n.clone()).collect(),
        launch: e.launch.clone(),
        graph: e.graph.clone(),
        kernel_graph: e.kernel_graph.clone(),
        plan: e.plan.clone(),
    }
}

/// Moves the finished `tmp` to `dir`: a previous artifact there is moved aside first and
/// put back if the rename fails, so `dir` always holds a whole artifact.
fn replace_with(dir: &Path, tmp: &Path, pid: u32) -> Result<(), ArtifactError> {
    let old = sibling(dir, &format!(".tmp-{pid}-old"));
    let replaced = dir.exists();
    if replaced {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io_err("remove", &old))?;
        }
        std::fs::rename(dir, &old).map_err(io_err("move aside", dir))?;
    }
    if let Err(e) = std::fs::rename(tmp, dir) {
        if replaced {
            let _ = std::fs::rename(&old, dir);
        }
        return Err(io_err("rename into place", tmp)(e));
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent);
    }
    if replaced {
        let _ = std::fs::remove_dir_all(&old);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_undoes_text() {
        let code = CpuCode {
            functions: vec![
                (
                    "a_0".to_string(),
                    "function %a_0() {\nblock0:\n    return\n}\n".to_string(),
                ),
                (
                    "b_1".to_string(),
                    "function %b_1() {\nblock0:\n    return\n}\n".to_string(),
                ),
            ],
            kernels: vec![],
        };
        assert_eq!(split_functions(&code.text()).unwrap(), code.functions);
        assert!(split_functions("junk\nfunction %a() {}\n").is_err());
        assert!(split_functions("function %a() {}\nfunction %a() {}\n").is_err());
    }

    #[test]
    fn templates_are_unique_by_name_and_variant() {
        let reg = crate::optimize::templates::registry();
        let mut seen = std::collections::BTreeSet::new();
        for t in reg {
            assert!(
                seen.insert((t.name.clone(), t.variant.clone())),
                "template {} [{}] is registered twice",
                t.name,
                t.variant
            );
        }
    }

    #[test]
    fn cuda_function_names_skip_launch_bounds() {
        let text = "__global__ void a_0(float* x) {}\n\
                    extern \"C\" __global__ void __launch_bounds__(KILN_THREADS, 2) b_1(int n) {}\n";
        assert_eq!(cuda_function_names(text), ["a_0", "b_1"]);
    }

    #[test]
    fn spec_hash_is_stable() {
        assert_eq!(hash_hex(b""), "cbf29ce484222325");
        let a = spec_hash("x", &["a=1".to_string()], None);
        assert_eq!(a, spec_hash("x", &["a=1".to_string()], None));
        assert_ne!(a, spec_hash("x", &["a=2".to_string()], None));
    }
}
