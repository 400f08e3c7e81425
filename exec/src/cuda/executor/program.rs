//! The program of an artifact entry (no CUDA call): its CUDA source as it is, the steps
//! its launch plan and manifest give, and for a mixed-precision artifact its buffers'
//! element types and the memory plan they give.

use std::collections::BTreeSet;

use kiln_compiler::codegen::cuda::storage::{self, Storage};
use kiln_compiler::codegen::cuda::Work;
use kiln_compiler::options::Precision as CompilePrecision;
use kiln_compiler::plan::MemoryPlan;

use super::*;
use crate::artifact::Artifact;
use crate::cuda::steps::{self, Exec as StepExec, Step};

/// The entry's CUDA source and manifest section, checked (no CUDA call).
pub(crate) fn cuda_parts<'a>(
    art: &'a Artifact,
    entry: &str,
) -> Result<
    (
        &'a crate::artifact::ArtifactEntry,
        &'a kiln_compiler::artifact::CudaManifest,
        &'a str,
    ),
    CudaExecError,
> {
    let e = art
        .entry(entry)
        .map_err(|e| CudaExecError::Artifact(e.to_string()))?;
    let (Some(m), Some(src)) = (&e.manifest.cuda, &e.cuda_source) else {
        return Err(CudaExecError::Artifact(format!(
            "entry `{entry}` has no CUDA code: the artifact's target is `{}`; compile it with \
             `kiln compile --target cuda`",
            art.manifest.target().name()
        )));
    };
    Ok((e, m, src))
}

/// What an executor of one entry runs: the CUDA unit and its functions, the steps, the
/// strided-copy functions and, for a mixed-precision program, its storage plan and the
/// memory plan sized by it.
pub(crate) struct EntryProgram {
    /// What NVRTC errors name: the artifact's file, or the generated bf16 program.
    pub(crate) file: String,
    pub(crate) source: String,
    pub(crate) functions: Vec<(String, Work, usize)>,
    pub(crate) steps: Vec<Step>,
    pub(crate) copy: Option<String>,
    /// The 2-byte strided copy of a mixed-precision program.
    pub(crate) copy16: Option<String>,
    pub(crate) storage: Option<Storage>,
    /// The arena's plan with bf16 buffers in 2-byte elements (the artifact's plan sizes
    /// every buffer in 4-byte words).
    pub(crate) plan: Option<MemoryPlan>,
}

/// The program of entry `entry` (no CUDA call): the artifact's CUDA code as it is, with,
/// for a mixed-precision artifact, its buffers' element types and the memory plan they
/// give.
pub(crate) fn entry_program(art: &Artifact, entry: &str) -> Result<EntryProgram, CudaExecError> {
    let (e, m, src) = cuda_parts(art, entry)?;
    let unsupported = |message: String| CudaExecError::Unsupported {
        entry: entry.to_string(),
        message,
    };
    let kg = &e.manifest.kernel_graph;
    let names: BTreeSet<String> = m.functions.iter().map(|f| f.name.clone()).collect();
    let (steps, copy) =
        steps::prepare(kg, &e.manifest.launch, &m.kernels, &names).map_err(unsupported)?;
    let mut program = EntryProgram {
        file: m.source.clone(),
        source: src.to_string(),
        functions: m
            .functions
            .iter()
            .map(|f| (f.name.clone(), f.work, f.params.len()))
            .collect(),
        steps,
        copy,
        copy16: None,
        storage: None,
        plan: None,
    };
    if art.manifest.options.precision != CompilePrecision::Mixed {
        return Ok(program);
    }
    if m.storage.is_empty() {
        return Err(CudaExecError::Artifact(format!(
            "entry `{entry}` is compiled for mixed precision but its manifest lists no \
             buffer types; the artifact is damaged (recompile it)"
        )));
    }
    // The batched-GEMM attention path computes its scores in f32 scratch: mixed
    // precision runs attention as the flash kernels only.
    if let Some(s) = program.steps.iter().find(|s| {
        matches!(
            s.exec,
            StepExec::Attention { flash: None, .. } | StepExec::AttentionBwd { flash: None, .. }
        )
    }) {
        return Err(unsupported(format!(
            "kernel %{} ({}) has no flash kernels (heads wider than {} or of another \
             shape): mixed precision runs attention only as flash kernels; compile this \
             model with `--precision f32`, `tf32` or `bf16`",
            s.value,
            s.kind,
            kiln_compiler::codegen::cuda::attention::MAX_HEAD
        )));
    }
    program.copy16 = m
        .kernels
        .iter()
        .find_map(|l| l.functions.get("copy16").cloned());
    program.plan = Some(storage::memory_plan(kg, &m.storage));
    program.storage = Some(m.storage.clone());
    Ok(program)
}

/// The CUDA C the executor of entry `entry` compiles (no CUDA call): the artifact's.
pub fn program_source(art: &Artifact, entry: &str) -> Result<String, CudaExecError> {
    Ok(entry_program(art, entry)?.source)
}

/// What every kernel of entry `entry` runs as on the GPU, in launch order: its kind and
/// `generated`, `gemm` (cuBLAS), `attention` (batched cuBLAS + generated softmaxes) or
/// `host` (the CPU fallback between copies). Needs no GPU.
pub fn launch_plan(
    art: &Artifact,
    entry: &str,
) -> Result<Vec<(String, &'static str)>, CudaExecError> {
    Ok(entry_program(art, entry)?
        .steps
        .iter()
        .map(|s| (s.kind.clone(), s.exec.how()))
        .collect())
}

/// The memory plan of entry `entry`'s arena (needs no GPU): the artifact's, or for a
/// mixed-precision artifact the one that sizes its bf16 buffers in 2-byte elements.
pub fn memory_plan(art: &Artifact, entry: &str) -> Result<MemoryPlan, CudaExecError> {
    let program = entry_program(art, entry)?;
    match program.plan {
        Some(p) => Ok(p),
        None => Ok(cuda_parts(art, entry)?.0.manifest.plan.clone()),
    }
}
