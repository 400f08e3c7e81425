//! The compiler's one driver: an entry point's graph and the [`CompileOptions`] in, the
//! program that runs out. The command line, the trainer, the executors built from a
//! graph, the tests and the benches all compile through [`compile_entry`].
//!
//! The passes, in order:
//! 1. [`optimize`](crate::optimize::optimize) — the e-graph rewrites (canonical forms,
//!    templates, elementwise regions), extraction into a kernel graph, and its launch
//!    order ([`crate::schedule::reorder`]);
//! 2. validation, when asked ([`crate::optimize::validate`]) — the kernel graph against
//!    the source graph on random inputs, through the reference executor;
//! 3. the memory plan ([`MemoryPlan`]) — buffers, lifetimes and arena slots;
//! 4. emission — the CLIF of every kernel (every artifact carries it, so that any
//!    machine runs it) and, for target `cuda`, the CUDA C in the options' precision
//!    (for `mixed`, with its buffers' element types and their plan);
//! 5. the launch plan ([`LaunchPlan`]) — every launch in order with its functions and
//!    buffers, and the fusions decided after extraction ([`crate::fuse`]).

use crate::codegen::cuda::text::Elem;
use crate::codegen::cuda::CudaCode;
use crate::codegen::program::CpuCode;
use crate::ir::Graph;
use crate::launch_plan::LaunchPlan;
use crate::optimize::validate::{Validation, DEFAULT_ABS, DEFAULT_REL};
use crate::optimize::{KernelGraph, Report, Target};
use crate::options::{CompileOptions, Precision};
use crate::plan::{MemoryPlan, ELEM_BYTES};

/// Everything the passes made of one entry point.
#[derive(Clone, Debug)]
pub struct EntryProgram {
    pub kernel_graph: KernelGraph,
    /// The plan of the CPU program (every buffer in 4-byte elements).
    pub plan: MemoryPlan,
    pub cpu: CpuCode,
    /// What runs, in order, with the fusions.
    pub launch: LaunchPlan,
    /// Target `cuda`: the CUDA program in the options' precision.
    pub cuda: Option<CudaCode>,
    /// What the optimizer did (for `kiln explain` and `kiln compile`'s report).
    pub report: Report,
    /// The comparison with the source graph, when one was asked for.
    pub validation: Option<Validation>,
}

/// Which pass failed, and why.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("{0}")]
    Options(String),
    #[error(transparent)]
    Optimize(#[from] crate::optimize::OptError),
    #[error("validation: {0}")]
    Validate(String),
    #[error("code generation (CLIF): {0}")]
    Cpu(String),
    #[error("code generation (CUDA C): {0}")]
    Cuda(String),
}

/// Compiles `graph` with `opts`; with `validate_seed`, also runs the optimized program and
/// the source graph on random inputs and weights of that seed and reports how they
/// compare (the caller decides what a mismatch means).
pub fn compile_entry(
    graph: &Graph,
    opts: &CompileOptions,
    validate_seed: Option<u64>,
) -> Result<EntryProgram, PipelineError> {
    opts.check().map_err(PipelineError::Options)?;
    let optimizer = crate::optimize::Options {
        target: opts.target,
        ..crate::optimize::Options::default()
    };
    let (kernel_graph, report) = crate::optimize::optimize(graph, &optimizer)?;
    let validation = match validate_seed {
        Some(seed) => Some(
            crate::optimize::validate::validate(
                graph,
                &kernel_graph,
                seed,
                DEFAULT_REL,
                DEFAULT_ABS,
            )
            .map_err(PipelineError::Validate)?,
        ),
        None => None,
    };
    let plan = MemoryPlan::build_reusing(&kernel_graph, &|_, _| ELEM_BYTES, opts.buffer_reuse);
    let cpu = crate::codegen::program::emit(&kernel_graph).map_err(PipelineError::Cpu)?;
    let launch = LaunchPlan::build(&kernel_graph, &cpu, &plan, opts).map_err(PipelineError::Cpu)?;
    let cuda = match opts.target {
        Target::Cpu => None,
        Target::Cuda => Some(cuda_program(&kernel_graph, opts.precision)?),
    };
    Ok(EntryProgram {
        kernel_graph,
        plan,
        cpu,
        launch,
        cuda,
        report,
        validation,
    })
}

/// The CUDA program of `kg` in `precision`: the f32 program (whose GEMMs the executor
/// runs in f32, TF32 or bf16), or the mixed-precision one with bf16 activations.
pub fn cuda_program(kg: &KernelGraph, precision: Precision) -> Result<CudaCode, PipelineError> {
    let elem = match precision {
        Precision::Mixed => Elem::Bf16,
        Precision::F32 | Precision::Tf32 | Precision::Bf16 | Precision::Int8 => Elem::F32,
    };
    let code = crate::codegen::cuda::program::emit_with(kg, elem).map_err(PipelineError::Cuda)?;
    if precision == Precision::Mixed {
        mixed_attention_is_flash(kg, &code)?;
    }
    Ok(code)
}

/// Mixed precision runs attention only as the flash kernels (the batched-GEMM path keeps
/// its scores in f32 scratch): an attention without them is refused here, at compile
/// time, with the precisions that take it.
fn mixed_attention_is_flash(kg: &KernelGraph, code: &CudaCode) -> Result<(), PipelineError> {
    use crate::codegen::cuda::Library;
    for ((v, op, _), l) in kg.kernels().into_iter().zip(&code.kernels) {
        let Some(Library::Attention { backward, .. }) = &l.library else {
            continue;
        };
        let roles: &[&str] = if *backward {
            &["flash_q", "flash_kv"]
        } else {
            &["flash"]
        };
        if !roles.iter().all(|r| l.functions.contains_key(*r)) {
            return Err(PipelineError::Options(format!(
                "kernel %{v} ({}) has no flash kernels (heads wider than {} or of another \
                 shape): --precision mixed runs attention only as flash kernels; compile \
                 this model with --precision f32, tf32 or bf16",
                op.kind(),
                crate::codegen::cuda::attention::MAX_HEAD
            )));
        }
    }
    Ok(())
}
