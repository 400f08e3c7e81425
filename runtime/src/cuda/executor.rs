//! The CUDA executor: one entry of a `--target cuda` artifact run on the GPU.
//!
//! In: an [`Artifact`] and an entry name. Out: [`CudaExecutor`], an [`Exec`] whose runs
//! give the entry's outputs as host tensors, the values of the CPU compiled executor
//! within the tolerances of `codegen::cuda` (fp32, cuBLAS in pedantic math: no TF32).
//!
//! Building one:
//! 1. the guard [`cuda_available`]: without CUDA, an error naming the reason and pointing
//!    at the CPU executor (never a panic: no CUDA call is made before it);
//! 2. the steps: what each kernel launches (`cuda::steps`, from the manifest);
//! 3. NVRTC compiles the entry's `.cu` unit with the manifest's options (a failure
//!    reports NVRTC's log); the module and every listed function are loaded; cuBLAS is
//!    set up on the same stream.
//!
//! A run mirrors the CPU executor (`compiled/mod.rs`):
//! 1. binds inputs and parameters (`kiln_compiler::bind`), which gives the dims;
//! 2. lays out the arena from the memory plan for those dims — the **same byte offsets**
//!    as the CPU arena, in one device allocation (kept between runs, grown when needed);
//!    a mixed-precision program plans its own, with bf16 buffers in 2-byte elements;
//! 3. uploads inputs, parameters and constants (bools as 4-byte 0/1, f64 as f32) into
//!    device buffers of their own; parameters are kept on the device between runs that
//!    give the same `RunOptions::params_version` (the caller's promise that they did
//!    not change: the decoder's steps, the trainer between optimizer steps);
//! 4. gives every value a location: a device address and a strided layout (views
//!    re-describe their source; a reshape of a non-contiguous view is copied by the
//!    generated `copy_strided` when first read);
//! 5. launches the kernels in order on one stream (see `Run::exec`);
//! 6. copies the outputs back.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use kiln_compiler::bind::{Binder, Source};
use kiln_compiler::codegen::cuda::attention::{self, Part};
use kiln_compiler::codegen::cuda::index;
use kiln_compiler::codegen::cuda::misc as cuda_misc;
use kiln_compiler::codegen::cuda::resident as gather;
use kiln_compiler::codegen::cuda::storage::{self, Storage};
use kiln_compiler::codegen::cuda::text::Elem;
use kiln_compiler::codegen::cuda::{cast, optim, CudaCode, Work};
use kiln_compiler::codegen::misc::{ReduceLayout, MAX_COPY_RANK};
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_compiler::ir::{DType, Graph, NodeId, Op};
use kiln_compiler::optimize::kernels::{Def, KernelGraph};
use kiln_compiler::options::Precision as CompilePrecision;
use kiln_compiler::plan::{LayoutCache, MemoryPlan};
use kiln_compiler::reference::{ExecError, Precision, RunOptions};
use kiln_compiler::tensor::{Tensor, TensorData};

use super::abi::{blas_operand, even_stride, plan_matmul, sgemm_args, Launch, MatDesc, MatmulPlan};
use super::cuda_available;
use super::device::{self, Buf, Device};
use super::steps::{self, Exec as StepExec, Step};
use crate::artifact::Artifact;
use crate::compiled::fallback::{self, HostCtx};
use crate::compiled::launch::region_operand;
use crate::compiled::Loc;
use crate::eager::pool::Pool;
use crate::eager::value::Layout;
use crate::exec::{Exec, How, Launched, Product, Timing};

const EXECUTOR: &str = "the CUDA executor";

/// Why a CUDA executor could not be built.
#[derive(Debug, thiserror::Error)]
pub enum CudaExecError {
    /// No usable GPU (the guard's reason).
    #[error(
        "{reason}; the CUDA executor cannot run entry `{entry}` here: use the CPU compiled \
         executor instead (the artifact's CPU code, `Artifact::executor`, which `kiln run` uses)"
    )]
    Unavailable { entry: String, reason: String },
    /// The artifact has no such entry, or no CUDA code for it.
    #[error("{0}")]
    Artifact(String),
    /// The entry's launches cannot be run by this executor.
    #[error("entry `{entry}`: {message}")]
    Unsupported { entry: String, message: String },
    /// NVRTC rejected the entry's CUDA C.
    #[error("NVRTC cannot compile `{file}`: {log}")]
    Nvrtc { file: String, log: String },
    /// The driver or cuBLAS failed while setting up.
    #[error("CUDA: {0}")]
    Driver(String),
}

/// The device and the arena, used by one run at a time.
/// What [`Run::bias_grad_pair`] did with a step of a bias-gradient pair.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Paired {
    /// Nothing: the step runs as usual.
    No,
    /// The `sum_rows`' work is left to (or was done by) its GEMM.
    Left,
    /// The GEMM ran and summed the bias gradient in its epilogue.
    Summed,
    /// The GEMM ran, then the `sum_rows` left to it.
    RanBoth,
}

impl Paired {
    /// The launches of step `s` (partner `other`) this accounts for, in the order they
    /// ran.
    fn launched(self, s: usize, other: Option<usize>) -> Vec<Launched> {
        let alone = |launch| Launched {
            launch,
            how: How::Alone,
        };
        match (self, other) {
            (Paired::No, _) => vec![alone(s)],
            (Paired::Left, _) => vec![],
            (Paired::Summed, Some(o)) => vec![
                alone(s),
                Launched {
                    launch: o,
                    how: How::SummedBy { product: s },
                },
            ],
            (Paired::RanBoth, Some(o)) => vec![alone(s), alone(o)],
            (_, None) => vec![alone(s)],
        }
    }
}

struct State {
    device: Device,
    arena: Option<Buf>,
    /// Device copies of the parameters of the last run that gave a `params_version`.
    params: Option<ParamCache>,
    /// Training with its state on the device ([`CudaExecutor::train_begin`]).
    training: Option<Training>,
    /// `linear` kernels with a bias run so far: (in one cuBLASLt call, separately).
    epilogues: (usize, usize),
    /// Bias gradients paired with a weight-gradient GEMM so far: (in its cuBLASLt
    /// epilogue, as a separate `sum_rows`).
    bias_grads: (usize, usize),
    /// The last run's view copies: how many, and their bytes in all.
    view_copies: (usize, usize),
    /// The views' and kernel results' locations by dims (at most [`Bound::KEPT`]; it
    /// starts over when full).
    bound: HashMap<BTreeMap<String, i64>, Arc<Bound>>,
    /// Runs so far that bound their views and kernel results afresh, and that reused
    /// those kept for their dims.
    binds: (usize, usize),
    /// With [`CudaExecutor::record_launches`]: the last run's launches.
    launches: Option<Vec<Launched>>,
}

/// Parameters, gradient accumulators and Adam's moments on the device, by parameter
/// name (the trainer's order), for [`CudaExecutor::train_micro`] and
/// [`CudaExecutor::train_update`].
struct Training {
    params: BTreeMap<String, TrainParam>,
    /// One word per parameter (in name order): 1 when a micro-batch's gradient of that
    /// parameter had an element that is not finite.
    bad: Buf,
    /// Word 0: the micro-batch weight; words 1–8: `optim::ADAM_CONSTANTS`.
    scalars: Buf,
    /// `optim::ADAM_STEP_MANY`'s table: each parameter's `p`, `acc`, `m`, `v` and length,
    /// in name order (the buffers are fixed from `train_begin` on).
    adam_table: Buf,
}

struct TrainParam {
    /// Position in name order (the parameter's word of `Training::bad`).
    index: usize,
    shape: Vec<usize>,
    p: Buf,
    acc: Buf,
    m: Buf,
    v: Buf,
}

/// A micro-batch of device training: its weight (target tokens), and whether it is the
/// first of the optimizer step (the accumulators are assigned, not added to).
#[derive(Clone, Copy, Debug)]
struct Micro {
    weight: f32,
    first: bool,
}

/// What one micro-batch of device training gave back.
#[derive(Debug)]
pub struct MicroOut {
    /// The entry's outputs other than the parameters' gradients (the loss, …), in
    /// `graph.outputs` order.
    pub outputs: Vec<(String, Tensor)>,
    /// The first parameter (in name order) whose gradient had an element that is not
    /// finite, and the first such element: the step must not be applied.
    pub non_finite: Option<(String, f32)>,
}

/// A tensor in one CUDA executor's device memory: a decoder's state (encoder output,
/// key/value caches) kept there between steps ([`CudaExecutor::run_resident`]). 4-byte
/// elements (f32, i32, bools as 0/1), contiguous.
pub struct DeviceTensor {
    buf: Buf,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceTensor({:?} {:?})", self.dtype, self.shape)
    }
}

impl DeviceTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What [`CudaExecutor::run_resident`] gives back: the host outputs (in `graph.outputs`
/// order) and the outputs kept on the device, by name.
pub type ResidentOut = (Vec<(String, Tensor)>, BTreeMap<String, DeviceTensor>);

/// A run's device-resident inputs, and which outputs stay on the device.
struct Resident<'a> {
    inputs: &'a BTreeMap<String, DeviceTensor>,
    keep: &'a dyn Fn(&str) -> bool,
}

/// What a run gives back: the host outputs, a non-finite gradient of device training, and
/// the outputs kept on the device.
struct RunOut {
    outputs: Vec<(String, Tensor)>,
    non_finite: Option<(String, f32)>,
    kept: BTreeMap<String, DeviceTensor>,
}

/// Parameters kept on the device between runs of one `RunOptions::params_version`:
/// by name, the host slice they were copied from (address, length) and the copy.
struct ParamCache {
    version: u64,
    bufs: BTreeMap<String, ((usize, usize), DType, Buf)>,
    /// bf16 copies of spans of these parameters (see [`Run::casts`]), kept for the next
    /// run of the version while no parameter is uploaded again.
    casts: HashMap<CastKey, Buf>,
}

/// A span of an f32 buffer cast to bf16: (buffer, first element, elements).
type CastKey = (u64, usize, usize);

/// A bound input or parameter as 4-byte words (f32 and i32 reinterpreted in place;
/// f64 narrowed, bools as 0/1), its dtype, and the host slice it came from.
fn source_words<'s>(src: &'s Source<'_>) -> (std::borrow::Cow<'s, [u32]>, DType, (usize, usize)) {
    use std::borrow::Cow;
    match src {
        Source::F32(v) => (
            // SAFETY: f32 and u32 have the same size and alignment; every bit pattern is a u32.
            Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u32, v.len()) }),
            DType::F32,
            (v.as_ptr() as usize, v.len()),
        ),
        Source::F64(v) => (
            Cow::Owned(v.iter().map(|&x| (x as f32).to_bits()).collect()),
            DType::F32,
            (v.as_ptr() as usize, v.len()),
        ),
        Source::I32(v) => (
            // SAFETY: i32 and u32 have the same size and alignment.
            Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u32, v.len()) }),
            DType::I32,
            // A converted (owned) id tensor has a temporary address: never a cache hit.
            match v {
                Cow::Borrowed(b) => (b.as_ptr() as usize, b.len()),
                Cow::Owned(_) => (0, usize::MAX),
            },
        ),
        Source::Bool(v) => (
            Cow::Owned(v.iter().map(|&b| b as u32).collect()),
            DType::Bool,
            (v.as_ptr() as usize, v.len()),
        ),
    }
}

/// [`CudaExecutor::row_top_k`]'s results: row `r`'s `j`-th best token is `ids[r·k + j]`
/// (`−1` past the last candidate) with log-probability `vals[r·k + j]`; `eos[r]` is the
/// end of sentence's.
#[derive(Clone, Debug, PartialEq)]
pub struct RowsTopK {
    pub k: usize,
    pub vals: Vec<f64>,
    pub ids: Vec<i32>,
    pub eos: Vec<f64>,
}

/// An entry of a CUDA artifact, ready to run on the GPU.
pub struct CudaExecutor {
    graph: Graph,
    kg: KernelGraph,
    plan: MemoryPlan,
    /// The plan's buffer of each kernel result (value, output), looked up at every bind.
    buffer_at: std::collections::HashMap<(usize, usize), usize>,
    /// The attention results stored with their heads merged, `[b, t, h, d]`
    /// ([`KernelGraph::heads_merged`], where a flash kernel that writes through its
    /// results' strides makes them): the output projection reads them without a copy.
    merged: std::collections::HashSet<(usize, usize)>,
    /// The plan's layouts by dims.
    layouts: LayoutCache,
    /// The inputs, parameters and constants of `kg`, in value order, with the graph's
    /// node of each input and parameter (looked up once: by name, a parameter's lookup
    /// scans the graph's ~250 parameters).
    sources: Vec<(usize, Option<NodeId>)>,
    steps: Vec<Step>,
    copy: Option<String>,
    /// The 2-byte strided copy ([`CudaOptions::mixed`]).
    copy16: Option<String>,
    /// Each buffer's element type ([`CudaOptions::mixed`]; `None`: every float is f32).
    storage: Option<Storage>,
    state: Mutex<State>,
    pool: Arc<Pool>,
    /// GEMM operands converted to bf16 ([`CudaOptions::bf16`]).
    bf16: bool,
    /// [`CudaOptions::separate_epilogues`].
    separate_epilogues: bool,
    /// [`CudaOptions::separate_bias_grads`] or `separate_epilogues`.
    separate_bias_grads: bool,
    /// The artifact's NVRTC options (for the optimizer's unit, compiled on first use).
    nvrtc_options: Vec<String>,
}

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaExecutor({}, {} kernels)",
            self.kg.name,
            self.steps.len()
        )
    }
}

/// The entry's CUDA source and manifest section, checked (no CUDA call).
fn cuda_parts<'a>(
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
struct EntryProgram {
    /// What NVRTC errors name: the artifact's file, or the generated bf16 program.
    file: String,
    source: String,
    functions: Vec<(String, Work, usize)>,
    steps: Vec<Step>,
    copy: Option<String>,
    /// The 2-byte strided copy of a mixed-precision program.
    copy16: Option<String>,
    storage: Option<Storage>,
    /// The arena's plan with bf16 buffers in 2-byte elements (the artifact's plan sizes
    /// every buffer in 4-byte words).
    plan: Option<MemoryPlan>,
}

/// The program of entry `entry` (no CUDA call): the artifact's CUDA code as it is, with,
/// for a mixed-precision artifact, its buffers' element types and the memory plan they
/// give.
fn entry_program(art: &Artifact, entry: &str) -> Result<EntryProgram, CudaExecError> {
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

/// A device failure (driver, cuBLAS, a launch) as an execution error.
fn dev_err(message: String) -> ExecError {
    ExecError::Node {
        node: "the GPU".into(),
        message,
    }
}

/// What a profiled run calls per timed part.
type Recorder<'a> = &'a mut dyn FnMut(&Timing<'_>);

/// The phases of a profiled run — the upload, each kernel (with the copies it reads),
/// the download — between marks in the stream ([`device::Mark`]), recorded without
/// waiting for the device so the run is timed as it runs unprofiled.
struct Phases {
    on: bool,
    /// `(what, begin, end, product)`, in issue order.
    done: Vec<(String, device::Mark, device::Mark, Option<Product>)>,
    open: Option<device::Mark>,
    /// When the host began issuing each phase's work, and how long that took in all.
    issue: (std::time::Instant, f64),
}

/// [`Phases::report`]'s name for the time the GPU spent between phases: waiting for
/// the host to issue the next launch.
pub const GPU_IDLE: &str = "[gpu idle, waiting for the host]";
/// [`Phases::report`]'s name for the host's time issuing the phases (it overlaps the
/// GPU's work, except where the host waits for the device).
pub const HOST_ISSUE: &str = "[host issuing the launches]";

impl Phases {
    fn new(on: bool) -> Phases {
        Phases {
            on,
            done: Vec::new(),
            open: None,
            issue: (std::time::Instant::now(), 0.0),
        }
    }

    fn begin(&mut self, dev: &device::Device) -> Result<(), String> {
        if self.on {
            self.issue.0 = std::time::Instant::now();
            self.open = Some(dev.mark()?);
        }
        Ok(())
    }

    fn end(&mut self, dev: &device::Device, what: &str) -> Result<(), String> {
        self.end_product(dev, what, None)
    }

    /// [`Phases::end`] of a kernel that ran a matrix product of this shape.
    fn end_product(
        &mut self,
        dev: &device::Device,
        what: &str,
        product: Option<Product>,
    ) -> Result<(), String> {
        if let Some(begin) = self.open.take() {
            let end = dev.mark()?;
            self.issue.1 += self.issue.0.elapsed().as_secs_f64();
            self.done.push((what.to_string(), begin, end, product));
        }
        Ok(())
    }

    /// After the device has reached every mark: a [`Timing`] per phase (the device's
    /// time from its begin to its end mark), then [`GPU_IDLE`] (the sum of the gaps
    /// between one phase's end and the next one's begin) and [`HOST_ISSUE`].
    fn report(&self, rec: &mut dyn FnMut(&Timing<'_>)) -> Result<(), String> {
        let mut idle = 0.0;
        for (i, (what, begin, end, product)) in self.done.iter().enumerate() {
            rec(&Timing {
                what,
                seconds: begin.seconds_to(end)?.max(0.0),
                product: *product,
            });
            if let Some((_, _, before, _)) = i.checked_sub(1).map(|j| &self.done[j]) {
                idle += before.seconds_to(begin)?.max(0.0);
            }
        }
        if !self.done.is_empty() {
            for (what, seconds) in [(GPU_IDLE, idle), (HOST_ISSUE, self.issue.1)] {
                rec(&Timing {
                    what,
                    seconds,
                    product: None,
                });
            }
        }
        Ok(())
    }
}

/// How the CUDA executor runs an artifact. Its arithmetic is the artifact's
/// ([`kiln_compiler::options::Precision`], written by `kiln compile --precision`):
/// pedantic f32 GEMMs; TF32 GEMMs (tensor cores, 10-bit mantissa, fp32 accumulation);
/// bf16 GEMM operands (the f32 operands rounded by a generated kernel before each GEMM,
/// fp32 accumulation and results; everything else f32); or the mixed-precision program
/// (activations stored in bf16, GEMMs on bf16 operands with fp32 accumulation, parameters,
/// gradients, Adam's moments and the loss in f32; float inputs the plan keeps in bf16
/// rounded when uploaded, outputs returned as f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// The GPU (the driver's ordinal; 0, the first, by default).
    pub device: usize,
    /// Run `linear` and `linear_relu` as a bias fill, a cuBLAS GEMM and a ReLU pass
    /// instead of one cuBLASLt GEMM with a bias (+ ReLU) epilogue (the default, where
    /// cuBLASLt has an algorithm for the problem). For comparisons.
    pub separate_epilogues: bool,
    /// Sum each bias gradient by its own `sum_rows` kernel instead of in the epilogue of
    /// its weight gradient's GEMM (the default where cuBLASLt has an algorithm; also off
    /// with `separate_epilogues`). For comparisons.
    pub separate_bias_grads: bool,
}

/// The arithmetic of a precision in words, for reports: `fp32`, `tf32` or `bf16` (the
/// GEMMs'), or `mixed-bf16` (bf16 activations and GEMMs).
pub fn precision_label(p: CompilePrecision) -> &'static str {
    match p {
        CompilePrecision::F32 => "fp32",
        CompilePrecision::Tf32 => "tf32",
        CompilePrecision::Bf16 => "bf16",
        CompilePrecision::Mixed => "mixed-bf16",
    }
}

impl CudaExecutor {
    /// The executor of entry `entry` of `art` (see the module documentation), pedantic
    /// fp32.
    pub fn from_artifact_entry(art: &Artifact, entry: &str) -> Result<CudaExecutor, CudaExecError> {
        CudaExecutor::with_options(art, entry, CudaOptions::default())
    }

    /// [`CudaExecutor::from_artifact_entry`] with `options`.
    pub fn with_options(
        art: &Artifact,
        entry: &str,
        options: CudaOptions,
    ) -> Result<CudaExecutor, CudaExecError> {
        let (e, m, _) = cuda_parts(art, entry)?;
        let info = cuda_available().map_err(|reason| CudaExecError::Unavailable {
            entry: entry.to_string(),
            reason,
        })?;
        if options.device >= info.device_count {
            return Err(CudaExecError::Unavailable {
                entry: entry.to_string(),
                reason: format!(
                    "there is no GPU {}: the driver reports {} (numbered from 0)",
                    options.device, info.device_count
                ),
            });
        }
        let kg = e.manifest.kernel_graph.clone();
        let program = entry_program(art, entry)?;
        let precision = art.manifest.options.precision;
        let bf16 = matches!(precision, CompilePrecision::Bf16 | CompilePrecision::Mixed);
        let ptx = device::compile(&program.source, &m.nvrtc_options).map_err(|log| {
            CudaExecError::Nvrtc {
                file: program.file.clone(),
                log,
            }
        })?;
        let funcs = program.functions;
        let math = match precision {
            CompilePrecision::Bf16 | CompilePrecision::Mixed => device::GemmMath::Bf16,
            CompilePrecision::Tf32 => device::GemmMath::Tf32,
            CompilePrecision::F32 => device::GemmMath::F32,
        };
        let mut device =
            Device::new(options.device, ptx, &funcs, math).map_err(CudaExecError::Driver)?;
        if bf16 {
            load_unit_once(&mut device, cast::TO_BF16, cast::code, &m.nvrtc_options).map_err(
                |log| CudaExecError::Nvrtc {
                    file: "the bf16 conversion unit".into(),
                    log,
                },
            )?;
        }
        let graph = e.manifest.graph.clone();
        graph
            .verify()
            .map_err(|err| CudaExecError::Artifact(format!("entry `{entry}`: {err}")))?;
        let plan = program.plan.unwrap_or_else(|| e.manifest.plan.clone());
        let buffer_at = plan
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| ((b.value, b.output), i))
            .collect();
        let merged = heads_merged(&kg, &program.steps);
        let sources = kg
            .values
            .iter()
            .enumerate()
            .filter_map(|(v, val)| match &val.def {
                Def::Input(name) => Some((v, graph.input(name))),
                Def::Param(name) => Some((v, graph.param(name))),
                Def::Const(..) => Some((v, None)),
                _ => None,
            })
            .collect();
        Ok(CudaExecutor {
            graph,
            kg,
            plan,
            buffer_at,
            merged,
            layouts: LayoutCache::default(),
            sources,
            steps: program.steps,
            copy: program.copy,
            copy16: program.copy16,
            storage: program.storage,
            state: Mutex::new(State {
                device,
                arena: None,
                params: None,
                training: None,
                epilogues: (0, 0),
                bias_grads: (0, 0),
                view_copies: (0, 0),
                bound: HashMap::new(),
                binds: (0, 0),
                launches: None,
            }),
            pool: Arc::new(Pool::default()),
            bf16,
            separate_epilogues: options.separate_epilogues,
            separate_bias_grads: options.separate_bias_grads || options.separate_epilogues,
            nvrtc_options: m.nvrtc_options.clone(),
        })
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Binds the views and kernel results (every value but the sources, whose locations
    /// `locs` already holds) at dims `dims`, the arena at `base`.
    fn bind_derived(
        &self,
        dims: &BTreeMap<String, i64>,
        base: u64,
        layout: &kiln_compiler::plan::ArenaLayout,
        locs: &mut [Vec<DLoc>],
    ) -> Result<Derived, ExecError> {
        let node_err = |v: usize, m: String| ExecError::Node {
            node: format!("kernel value %{v} ({})", self.kg.values[v].scope),
            message: m,
        };
        let n = self.kg.values.len();
        let mut d = Derived {
            needs: vec![Vec::new(); n],
            copies: Vec::new(),
            roots: vec![Root::Source; n],
        };
        // The copy whose buffer each value's location starts at.
        let mut origin: Vec<Option<usize>> = vec![None; n];
        for (v, val) in self.kg.values.iter().enumerate() {
            if matches!(val.def, Def::Input(_) | Def::Param(_) | Def::Const(..)) {
                continue;
            }
            let shapes: Vec<Vec<usize>> = val
                .types
                .iter()
                .map(|t| t.shape.eval(dims))
                .collect::<Result<_, _>>()
                .map_err(|m| node_err(v, m))?;
            let mut need = Vec::new();
            let mut from: Option<usize> = None;
            let (loc, root) = match &val.def {
                Def::View(op, x) => {
                    let src = locs[*x][0].clone();
                    need = d.needs[*x].clone();
                    from = origin[*x];
                    let layout = match op {
                        Op::Reshape { .. } => src.layout.reshape(&shapes[0]),
                        Op::Permute { perm } => Some(src.layout.permute(perm)),
                        Op::Broadcast { .. } => Some(src.layout.broadcast(&shapes[0])),
                        other => {
                            return Err(node_err(v, format!("`{}` is not a view", other.name())))
                        }
                    };
                    // A view of a bf16 buffer is bf16.
                    let dtype = if src.is_bf16() {
                        DType::BF16
                    } else {
                        val.types[0].dtype
                    };
                    let root = match d.roots[*x] {
                        Root::Source => Root::Of(*x),
                        r => r,
                    };
                    match layout {
                        Some(layout) => (
                            vec![DLoc {
                                ptr: src.ptr,
                                layout,
                                dtype,
                            }],
                            root,
                        ),
                        None => {
                            // Placed when it is made.
                            d.copies.push(CopyPlan {
                                src: *x,
                                words: words_of(dtype, src.numel()),
                                users: Vec::new(),
                            });
                            from = Some(d.copies.len() - 1);
                            need.push(d.copies.len() - 1);
                            (
                                vec![DLoc {
                                    ptr: 0,
                                    layout: Layout::contiguous(&shapes[0]),
                                    dtype,
                                }],
                                root,
                            )
                        }
                    }
                }
                Def::Proj(t, k) => {
                    need = d.needs[*t].clone();
                    let root = match d.roots[*t] {
                        Root::Source => Root::Of(*t),
                        r => r,
                    };
                    (vec![locs[*t][*k as usize].clone()], root)
                }
                Def::Kernel { .. } => (
                    (0..val.types.len())
                        .map(|k| {
                            let b = *self.buffer_at.get(&(v, k)).ok_or_else(|| {
                                node_err(v, "internal: no buffer in the memory plan".into())
                            })?;
                            Ok(DLoc {
                                ptr: base + layout.offsets[b] as u64,
                                layout: if self.merged.contains(&(v, k)) {
                                    Layout::heads_merged(&shapes[k])
                                } else {
                                    Layout::contiguous(&shapes[k])
                                },
                                dtype: self.stored(v, k),
                            })
                        })
                        .collect::<Result<_, ExecError>>()?,
                    Root::Arena,
                ),
                Def::Input(_) | Def::Param(_) | Def::Const(..) => unreachable!("skipped above"),
            };
            if let Some(c) = from {
                d.copies[c].users.push(v);
            }
            d.needs[v] = need;
            d.roots[v] = if from.is_some() { Root::Copy } else { root };
            origin[v] = from;
            locs[v] = loc;
        }
        Ok(d)
    }

    /// The device dtype of output `k` of kernel-graph value `v`: `BF16` where the
    /// mixed-precision plan keeps it in bf16 ([`CudaOptions::mixed`]), else its dtype.
    fn stored(&self, v: usize, k: usize) -> DType {
        let dtype = self.kg.values[v].types[k].dtype;
        let bf16 = self
            .storage
            .as_ref()
            .and_then(|st| st.get(v))
            .and_then(|e| e.get(k))
            == Some(&Elem::Bf16);
        if bf16 && dtype == DType::F32 {
            DType::BF16
        } else {
            dtype
        }
    }

    /// Per kernel: its kind and how it runs (`generated`, `gemm`, `attention`, `host`).
    pub fn launches(&self) -> Vec<(String, &'static str)> {
        self.steps
            .iter()
            .map(|s| (s.kind.clone(), s.exec.how()))
            .collect()
    }

    /// How the `linear` kernels with a bias ran so far, over every run: `(fused,
    /// separate)` — in one cuBLASLt call with a bias (+ ReLU) epilogue, or as a bias
    /// fill, a GEMM and a ReLU pass ([`CudaOptions::separate_epilogues`], or no
    /// cuBLASLt algorithm for the problem).
    pub fn epilogue_counts(&self) -> (usize, usize) {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.epilogues
    }

    /// How the bias gradients paired with their weight-gradient GEMM ran so far, over
    /// every run: `(fused, separate)` — summed by the GEMM's cuBLASLt epilogue, or by
    /// their own `sum_rows` kernel ([`CudaOptions::separate_bias_grads`] or
    /// `separate_epilogues`, no cuBLASLt algorithm, a single row, or a GEMM that does not
    /// read the output gradient in place).
    pub fn bias_grad_counts(&self) -> (usize, usize) {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.bias_grads
    }

    /// With `on`, every run records the launches of the launch plan it ran, in order, and
    /// how ([`CudaExecutor::last_launches`]), as the compiled executor does.
    pub fn record_launches(&self, on: bool) {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.launches = on.then(Vec::new);
    }

    /// The launches of the last run ([`CudaExecutor::record_launches`]; empty without).
    pub fn last_launches(&self) -> Vec<Launched> {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.launches.clone().unwrap_or_default()
    }

    /// Runs so far that bound the views' and kernel results' locations afresh, and that
    /// reused those kept from an earlier run at the same dims (see `Bound`).
    pub fn binding_counts(&self) -> (usize, usize) {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.binds
    }

    /// The last run's view copies (reshapes of non-contiguous views, copied before their
    /// first reader): how many, and their bytes in all. Attention's results are stored
    /// with their heads merged, so a Transformer's program makes none.
    pub fn view_copies(&self) -> (usize, usize) {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.view_copies
    }

    /// Bytes of the device arena allocated so far (the memory plan's layout for the
    /// largest dims run; 0 before the first run).
    pub fn arena_bytes(&self) -> usize {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.arena.as_ref().map_or(0, |a| a.words * 4)
    }

    /// How many bf16 casts of parameter spans the executor keeps for the next run of
    /// the last parameters version (mixed precision or bf16 GEMMs; see `Run::casts`).
    pub fn parameter_casts(&self) -> usize {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.params.as_ref().map_or(0, |c| c.casts.len())
    }

    /// Runs the entry; outputs in `graph.outputs` order.
    pub fn run(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        Ok(self
            .run_with(inputs, params, opts, None, None, None)?
            .outputs)
    }

    /// [`CudaExecutor::run`] with every phase timed on the device by events around it,
    /// without waiting between phases: `rec(what, seconds)` for the uploads (`upload`),
    /// each kernel (`kind (how)`, see [`CudaExecutor::launches`]) and the downloads
    /// (`download`), then [`GPU_IDLE`], the time the GPU sat between phases waiting for
    /// the host's next launch, and [`HOST_ISSUE`], the host's time issuing them. For
    /// `kiln bench --profile`.
    pub fn run_profiled(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        rec: &mut dyn FnMut(&Timing<'_>),
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        Ok(self
            .run_with(inputs, params, opts, Some(rec), None, None)?
            .outputs)
    }

    /// A run; with `micro`, one micro-batch of device training (the parameters are the
    /// device's, the gradients go into its accumulators instead of to the host).
    fn run_with(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        mut rec: Option<Recorder<'_>>,
        micro: Option<Micro>,
        resident: Option<&Resident<'_>>,
    ) -> Result<RunOut, ExecError> {
        let profiling = rec.is_some();
        if opts.precision != Precision::F32 {
            return Err(ExecError::Unsupported(format!(
                "the CUDA executor computes in f32 only, but {:?} precision was requested",
                opts.precision
            )));
        }
        // A bf16 device tensor stands for an f32 input of the graph (a mixed-precision
        // program's caches): the binder sees f32, and the placement below checks the
        // dtype against the storage plan.
        let held: BTreeMap<String, (Vec<usize>, DType)> = resident
            .map(|r| {
                r.inputs
                    .iter()
                    .map(|(n, t)| {
                        let seen = if t.dtype == DType::BF16 {
                            DType::F32
                        } else {
                            t.dtype
                        };
                        (n.clone(), (t.shape.clone(), seen))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let bind = Binder::with_resident(&self.graph, inputs, &held, params, EXECUTOR)?;
        let dims = bind.dims.clone();
        let layout = self.layouts.get(&self.plan, &dims)?;
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.bind().map_err(dev_err)?;
        let words = layout.total / 4;
        if guard.arena.as_ref().is_none_or(|a| a.words < words) {
            guard.arena = None;
            let what = || {
                let at: Vec<String> = dims.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!(
                    "the device arena of `{}` at {}",
                    self.kg.name,
                    at.join(", ")
                )
            };
            let fix = "run smaller batches (fewer sentences or tokens per batch) or shorter \
                       sequences";
            // The emulated device's memory is the host's: checked as the CPU's arena is.
            if guard.device.memory_info().is_none() {
                kiln_compiler::memory::ensure(layout.total as u64, what, || fix.to_string())?;
            }
            let a = guard.device.alloc(words).map_err(|e| {
                let free = match guard.device.memory_info() {
                    Some((free, total)) => format!(
                        " (the GPU has {} free of {})",
                        kiln_compiler::memory::size(free as u64),
                        kiln_compiler::memory::size(total as u64)
                    ),
                    None => String::new(),
                };
                dev_err(format!(
                    "{} needs {}{free}: {e}; {fix}",
                    what(),
                    kiln_compiler::memory::size(layout.total as u64)
                ))
            })?;
            guard.arena = Some(a);
        }
        // The parameters' device copies are kept for runs of the same version (taken out
        // here, put back after a successful run).
        let mut cache = match (opts.params_version, guard.params.take()) {
            (Some(v), Some(c)) if c.version == v => Some(c),
            (Some(v), _) => Some(ParamCache {
                version: v,
                bufs: BTreeMap::new(),
                casts: HashMap::new(),
            }),
            (None, _) => None,
        };
        let st = &*guard;
        let training = match micro {
            None => None,
            Some(mb) => {
                let t = st.training.as_ref().ok_or_else(|| {
                    ExecError::Unsupported(
                        "a training micro-batch before `train_begin` put the parameters on \
                         the device"
                            .to_string(),
                    )
                })?;
                st.device
                    .write(t.scalars.ptr, &[mb.weight.to_bits()])
                    .map_err(dev_err)?;
                st.device.zero(t.bad.ptr, t.params.len()).map_err(dev_err)?;
                Some(t)
            }
        };
        // Profiled runs: marks in the stream around each phase, read at the end.
        let mut phases = Phases::new(profiling);
        phases.begin(&st.device).map_err(dev_err)?;
        let base = st.arena.as_ref().expect("allocated").ptr;
        let mut r = Run {
            dev: &st.device,
            copy: self.copy.as_deref(),
            copy16: self.copy16.as_deref(),
            keep: Vec::new(),
            dims: &dims,
            seed: opts.seed,
            step: opts.step,
            pool: &self.pool,
            bf16: self.bf16,
            fused_epilogues: !self.separate_epilogues,
            fused_bias_grads: !self.separate_bias_grads,
            epilogues: (0, 0),
            bias_grads: (0, 0),
            bias_deferred: HashMap::new(),
            bias_ready: HashMap::new(),
            mirror: HashMap::new(),
            params: std::collections::HashSet::new(),
            casts: HashMap::new(),
        };
        // Whether a parameter was uploaded in this run (kept bf16 casts are then stale).
        let mut param_uploaded = false;
        let node_err = |v: usize, m: String| ExecError::Node {
            node: format!("kernel value %{v} ({})", self.kg.values[v].scope),
            message: m,
        };
        // Locations by value. The sources (inputs, parameters, constants) are bound at
        // every run; the views and kernel results are made once per dims and sources'
        // dtypes (`State::bound`) and placed at this run's addresses.
        let mut locs: Vec<Vec<DLoc>> = vec![Vec::new(); self.kg.values.len()];
        let kept = st.bound.get(&dims).cloned();
        for &(v, node) in &self.sources {
            let val = &self.kg.values[v];
            let shape = match &kept {
                Some(b) => b.locs[v][0].layout.shape.clone(),
                None => val.types[0].shape.eval(&dims).map_err(|m| node_err(v, m))?,
            };
            let loc = match &val.def {
                Def::Input(name) => {
                    let id = node
                        .ok_or_else(|| node_err(v, format!("the graph has no input `{name}`")))?;
                    if let Some(t) = resident.and_then(|r| r.inputs.get(name.as_str())) {
                        if t.shape != shape {
                            return Err(node_err(
                                v,
                                format!(
                                    "the device's `{name}` has shape {:?}, the entry needs {:?}",
                                    t.shape, shape
                                ),
                            ));
                        }
                        let held = DLoc {
                            ptr: t.buf.ptr,
                            layout: Layout::contiguous(&shape),
                            dtype: t.dtype,
                        };
                        let want = self.stored(v, 0);
                        if want == DType::BF16 && held.dtype == DType::F32 {
                            // An f32 tensor (`to_device`) for a bf16 input: rounded here.
                            r.rounded_to_bf16(&held).map_err(|m| node_err(v, m))?
                        } else if held.dtype != want {
                            return Err(node_err(
                                v,
                                format!(
                                    "the device's `{name}` holds {:?}, the entry reads {want:?}",
                                    held.dtype
                                ),
                            ));
                        } else {
                            held
                        }
                    } else {
                        let src = bind.input(id, name)?;
                        let bf16 = self.stored(v, 0) == DType::BF16;
                        r.source(src, &shape, bf16).map_err(|m| node_err(v, m))?
                    }
                }
                Def::Param(name) => {
                    let id = node.ok_or_else(|| {
                        node_err(v, format!("the graph has no parameter `{name}`"))
                    })?;
                    let src = bind.param(id, name, &shape)?;
                    if let Some(t) = training {
                        let tp = t.params.get(name).ok_or_else(|| {
                            node_err(
                                v,
                                format!("parameter `{name}` is not among the trained ones"),
                            )
                        })?;
                        if tp.shape != shape {
                            return Err(node_err(
                                v,
                                format!(
                                    "parameter `{name}` is trained with shape {:?}, the entry \
                                     needs {:?}",
                                    tp.shape, shape
                                ),
                            ));
                        }
                        r.params.insert(tp.p.ptr);
                        DLoc {
                            ptr: tp.p.ptr,
                            layout: Layout::contiguous(&shape),
                            dtype: DType::F32,
                        }
                    } else {
                        let loc = match cache.as_mut() {
                            None => r.source(src, &shape, false).map_err(|m| node_err(v, m))?,
                            Some(c) => {
                                let (words, dtype, key) = source_words(&src);
                                let hit = c.bufs.get(name).is_some_and(|(k, _, _)| *k == key);
                                if !hit {
                                    let b = st.device.upload(&words).map_err(|m| node_err(v, m))?;
                                    c.bufs.insert(name.to_string(), (key, dtype, b));
                                    param_uploaded = true;
                                }
                                let (_, dtype, b) = &c.bufs[name];
                                DLoc {
                                    ptr: b.ptr,
                                    layout: Layout::contiguous(&shape),
                                    dtype: *dtype,
                                }
                            }
                        };
                        r.params.insert(loc.ptr);
                        loc
                    }
                }
                Def::Const(c, dtype) => {
                    let bits = match dtype {
                        DType::I32 => c.get() as i32 as u32,
                        DType::Bool => (c.get() != 0.0) as u32,
                        _ => (c.get() as f32).to_bits(),
                    };
                    // In stream order, without a wait (four bytes, staged by the driver).
                    let ptr = r.upload_enqueued(&[bits]).map_err(|m| node_err(v, m))?;
                    DLoc {
                        ptr,
                        layout: Layout::contiguous(&[]),
                        dtype: *dtype,
                    }
                }
                _ => {
                    return Err(node_err(
                        v,
                        "internal: not an input, parameter or constant".into(),
                    ))
                }
            };
            locs[v] = vec![loc];
        }
        let dtypes: Vec<DType> = self
            .sources
            .iter()
            .map(|&(v, _)| locs[v][0].dtype)
            .collect();
        // Reshapes of non-contiguous views: copied when first read, freed after their last
        // reader; `needs[v]` lists the copies value `v` reads through.
        let (needs, copies, made) = match kept.filter(|b| b.dtypes == dtypes) {
            Some(b) => {
                b.place(&mut locs, base);
                (b.needs.clone(), b.copies.clone(), None)
            }
            None => {
                let d = self.bind_derived(&dims, base, &layout, &mut locs)?;
                let b = Bound::of(&d, &locs, base, dtypes);
                (d.needs, d.copies, Some(b))
            }
        };
        let mut copies: Vec<DevCopy> = copies
            .into_iter()
            .map(|plan| DevCopy { plan, buf: None })
            .collect();
        phases.end(&st.device, "upload").map_err(dev_err)?;
        // The casts kept from the last run of this version, unless a parameter changed
        // buffers (a freed buffer's address may come back with other contents).
        if let Some(c) = cache.as_mut() {
            let kept = std::mem::take(&mut c.casts);
            if !param_uploaded && training.is_none() {
                r.casts = kept;
            }
        }
        let freed = crate::exec::copies_freed_after(
            copies.len(),
            &needs,
            self.steps.iter().map(|s| s.inputs.as_slice()),
            self.kg.outputs.iter().map(|(_, v)| *v),
        );
        let mut launches = st.launches.as_ref().map(|_| Vec::new());
        for (s, step) in self.steps.iter().enumerate() {
            phases.begin(&st.device).map_err(dev_err)?;
            for &x in &step.inputs {
                r.materialize(&needs[x], &mut copies, &mut locs)
                    .map_err(|m| node_err(step.value, m))?;
            }
            let ins: Vec<&DLoc> = step.inputs.iter().map(|&x| &locs[x][0]).collect();
            let outs = &locs[step.value];
            let held = r.keep.len();
            let paired = match step.bias_grad {
                Some(other) if r.fused_bias_grads => {
                    r.bias_grad_pair(&self.steps, s, other, &ins, outs, &locs, &needs)
                }
                _ => Ok(Paired::No),
            };
            let paired = paired.map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?;
            if paired == Paired::No {
                r.exec(step, &ins, outs)
                    .map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?;
            }
            if let Some(t) = launches.as_mut() {
                t.extend(paired.launched(s, step.bias_grad));
            }
            // The kernel's scratch and the copies no later kernel reads (freed in stream
            // order: the memory is reused by later launches only).
            r.keep.truncate(held);
            for &c in &freed[s] {
                copies[c].buf = None;
            }
            if profiling {
                let what = format!("{} ({})", step.kind, step.exec.how());
                let product = match step.kind.as_str() {
                    "matmul" | "linear" | "linear_relu" if ins.len() >= 2 => {
                        Product::of(&ins[0].layout, &ins[1].layout)
                    }
                    _ => None,
                };
                phases
                    .end_product(&st.device, &what, product)
                    .map_err(dev_err)?;
            }
        }
        if let Some(g) = r.bias_deferred.keys().next() {
            return Err(dev_err(format!(
                "internal: a bias gradient was left for step {g}, which did not take it"
            )));
        }
        phases.begin(&st.device).map_err(dev_err)?;
        let mut out = Vec::with_capacity(self.graph.outputs.len());
        let mut kept = BTreeMap::new();
        // Device training: each parameter's gradient, contiguous, as accumulated.
        let mut grads: BTreeMap<&str, DLoc> = BTreeMap::new();
        // ... by one launch over a table of the gradients (optim::GRAD_ENTRY a row).
        let mut grad_table: Vec<u64> = Vec::new();
        let (mut grad_largest, mut first_micro) = (0usize, true);
        for o in &self.graph.outputs {
            let (_, v) = self
                .kg
                .outputs
                .iter()
                .find(|(n, _)| n == &o.name)
                .ok_or_else(|| ExecError::Unsupported(format!("no program output `{}`", o.name)))?;
            r.materialize(&needs[*v], &mut copies, &mut locs)
                .map_err(dev_err)?;
            let trained = training.zip(micro).and_then(|(t, mb)| {
                let name = o.name.strip_prefix("grad.")?;
                let (key, tp) = t.params.get_key_value(name)?;
                Some((t, mb, key.as_str(), tp))
            });
            if let Some((t, mb, name, tp)) = trained {
                let g = r.contig(&locs[*v][0]).map_err(dev_err)?;
                let n = g.numel();
                if g.dtype != DType::F32 || g.shape() != tp.shape.as_slice() {
                    return Err(dev_err(format!(
                        "the gradient of `{name}` is {:?} {:?}, the parameter f32 {:?}",
                        g.dtype,
                        g.shape(),
                        tp.shape
                    )));
                }
                let flag = t.bad.ptr + 4 * tp.index as u64;
                grad_table.extend([g.base(), tp.acc.ptr, flag, n as u64]);
                grad_largest = grad_largest.max(n);
                first_micro = mb.first;
                grads.insert(name, g);
                continue;
            }
            if resident.is_some_and(|res| (res.keep)(&o.name)) {
                let l = &locs[*v][0];
                let buf = st.device.alloc(l.numel()).map_err(dev_err)?;
                r.copy_to(l, buf.ptr).map_err(dev_err)?;
                let t = DeviceTensor {
                    buf,
                    shape: l.shape().to_vec(),
                    dtype: l.dtype,
                };
                kept.insert(o.name.clone(), t);
                continue;
            }
            let t = r.download(&locs[*v][0]).map_err(dev_err)?;
            out.push((o.name.clone(), t));
        }
        if let (Some(t), false) = (training, grad_table.is_empty()) {
            let f = if first_micro {
                optim::GRAD_ASSIGN_MANY
            } else {
                optim::GRAD_ACCUMULATE_MANY
            };
            let tab = r
                .upload_enqueued(&optim::table_words(&grad_table))
                .map_err(dev_err)?;
            let count = grad_table.len() / optim::GRAD_ENTRY;
            st.device
                .launch(
                    f,
                    &[tab, t.scalars.ptr],
                    &[count as i64],
                    optim::many_items(grad_largest),
                )
                .map_err(dev_err)?;
        }
        let mut non_finite = None;
        if let Some(t) = training {
            if let Some(missing) = t.params.keys().find(|n| !grads.contains_key(n.as_str())) {
                return Err(ExecError::Unsupported(format!(
                    "the entry has no gradient output `grad.{missing}` for a trained parameter"
                )));
            }
            let flags = st.device.read(t.bad.ptr, t.params.len()).map_err(dev_err)?;
            // The first flagged parameter in name order, and its first bad element.
            if let Some((name, _)) = t.params.iter().find(|(_, tp)| flags[tp.index] != 0) {
                let words = r.words(&grads[name.as_str()]).map_err(dev_err)?;
                let x = words
                    .into_iter()
                    .map(f32::from_bits)
                    .find(|x| !x.is_finite())
                    .unwrap_or(f32::NAN);
                non_finite = Some((name.clone(), x));
            }
        }
        phases.end(&st.device, "download").map_err(dev_err)?;
        st.device.sync().map_err(dev_err)?;
        if let Some(rec) = rec.as_mut() {
            phases.report(&mut **rec).map_err(dev_err)?;
        }
        let (fused, separate) = r.epilogues;
        let bias_grads = r.bias_grads;
        // Casts of parameters kept on the device outlive the run; a trained parameter
        // changes with the step, so its casts do not.
        if let Some(c) = cache.as_mut().filter(|_| training.is_none()) {
            c.casts = std::mem::take(&mut r.casts);
        }
        drop(r);
        if launches.is_some() {
            guard.launches = launches;
        }
        guard.epilogues.0 += fused;
        guard.epilogues.1 += separate;
        guard.bias_grads.0 += bias_grads.0;
        guard.bias_grads.1 += bias_grads.1;
        guard.view_copies = (copies.len(), copies.iter().map(|c| c.plan.words * 4).sum());
        guard.params = cache;
        match made {
            None => guard.binds.1 += 1,
            Some(b) => {
                guard.binds.0 += 1;
                if guard.bound.len() >= Bound::KEPT {
                    guard.bound.clear();
                }
                guard.bound.insert(dims.clone(), Arc::new(b));
            }
        }
        Ok(RunOut {
            outputs: out,
            non_finite,
            kept,
        })
    }

    /// Starts training with its state on the device: uploads `params` and Adam's moments
    /// `m`, `v` (by parameter name, f32, the moments as long as their parameter) and
    /// zeroes the gradient accumulators. Replaces any earlier training state. Compiles
    /// and loads the optimizer's kernels (`codegen::cuda::optim`) on first use.
    pub fn train_begin(
        &self,
        params: &BTreeMap<String, Tensor>,
        m: &BTreeMap<String, Vec<f32>>,
        v: &BTreeMap<String, Vec<f32>>,
    ) -> Result<(), ExecError> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.bind().map_err(dev_err)?;
        guard.training = None;
        load_unit_once(
            &mut guard.device,
            optim::ADAM_STEP,
            optim::code,
            &self.nvrtc_options,
        )
        .map_err(|log| dev_err(format!("NVRTC cannot compile the optimizer: {log}")))?;
        let dev = &guard.device;
        let mut tps = BTreeMap::new();
        for (index, (name, t)) in params.iter().enumerate() {
            let TensorData::F32(p) = &t.data else {
                return Err(ExecError::Unsupported(format!(
                    "parameter `{name}` is not f32: device training keeps f32 parameters"
                )));
            };
            let moment = |which: &str, x: &BTreeMap<String, Vec<f32>>| {
                x.get(name)
                    .filter(|x| x.len() == p.len())
                    .ok_or_else(|| {
                        ExecError::Unsupported(format!(
                            "no Adam moment `{which}` of {} elements for parameter `{name}`",
                            p.len()
                        ))
                    })
                    .map(|x| x.iter().map(|f| f.to_bits()).collect::<Vec<u32>>())
            };
            let (mw, vw) = (moment("m", m)?, moment("v", v)?);
            let bits: Vec<u32> = p.iter().map(|f| f.to_bits()).collect();
            tps.insert(
                name.clone(),
                TrainParam {
                    index,
                    shape: t.shape.clone(),
                    p: dev.upload(&bits).map_err(dev_err)?,
                    acc: dev.alloc(p.len()).map_err(dev_err)?,
                    m: dev.upload(&mw).map_err(dev_err)?,
                    v: dev.upload(&vw).map_err(dev_err)?,
                },
            );
        }
        let bad = dev.alloc(tps.len()).map_err(dev_err)?;
        let rows: Vec<u64> = tps
            .values()
            .flat_map(|tp| {
                [
                    tp.p.ptr,
                    tp.acc.ptr,
                    tp.m.ptr,
                    tp.v.ptr,
                    tp.acc.words as u64,
                ]
            })
            .collect();
        let adam_table = dev.upload(&optim::table_words(&rows)).map_err(dev_err)?;
        let scalars = dev
            .alloc(1 + optim::ADAM_CONSTANTS.len())
            .map_err(dev_err)?;
        dev.sync().map_err(dev_err)?;
        guard.training = Some(Training {
            params: tps,
            bad,
            scalars,
            adam_table,
        });
        Ok(())
    }

    /// One micro-batch of device training: runs the entry on the device's parameters
    /// (`params` gives only the shapes, as the bound dims need them) and adds
    /// `weight·grad.NAME` to each parameter's accumulator (assigns it when `first`).
    /// The other outputs come back to the host. A gradient that is not finite is
    /// reported in [`MicroOut::non_finite`] (its accumulator is then not usable: the
    /// caller stops or starts the step over).
    pub fn train_micro(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        weight: f32,
        first: bool,
        rec: Option<Recorder<'_>>,
    ) -> Result<MicroOut, ExecError> {
        let out = self.run_with(
            inputs,
            params,
            opts,
            rec,
            Some(Micro { weight, first }),
            None,
        )?;
        Ok(MicroOut {
            outputs: out.outputs,
            non_finite: out.non_finite,
        })
    }

    /// One Adam update of every parameter from its accumulated gradient times `scale`
    /// (`1 / tokens`); `constants` are the first seven `optim::ADAM_CONSTANTS`, as
    /// `Adam::constants` rounds them. Waits for the update to finish.
    pub fn train_update(&self, constants: [f32; 7], scale: f32) -> Result<(), ExecError> {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.bind().map_err(dev_err)?;
        let t = guard.training.as_ref().ok_or_else(|| {
            ExecError::Unsupported("an optimizer step before `train_begin`".to_string())
        })?;
        let mut k: Vec<u32> = constants.iter().map(|c| c.to_bits()).collect();
        k.push(scale.to_bits());
        let dev = &guard.device;
        dev.write(t.scalars.ptr + 4, &k).map_err(dev_err)?;
        // One launch over the table of every parameter's buffers (train_begin's).
        let count = t.params.len();
        let largest = t.params.values().map(|tp| tp.acc.words).max().unwrap_or(0);
        dev.launch(
            optim::ADAM_STEP_MANY,
            &[t.adam_table.ptr, t.scalars.ptr + 4],
            &[count as i64],
            optim::many_items(largest),
        )
        .map_err(dev_err)?;
        dev.sync().map_err(dev_err)
    }

    /// Copies the device's parameters and Adam moments into `params`, `m` and `v`
    /// (which must have every trained parameter, of its size).
    pub fn train_download(
        &self,
        params: &mut BTreeMap<String, Tensor>,
        m: &mut BTreeMap<String, Vec<f32>>,
        v: &mut BTreeMap<String, Vec<f32>>,
    ) -> Result<(), ExecError> {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.bind().map_err(dev_err)?;
        let t = guard.training.as_ref().ok_or_else(|| {
            ExecError::Unsupported("no training state on the device to download".to_string())
        })?;
        let dev = &guard.device;
        let read = |b: &Buf, into: &mut [f32]| -> Result<(), ExecError> {
            let w = dev.read(b.ptr, into.len()).map_err(dev_err)?;
            into.iter_mut()
                .zip(w)
                .for_each(|(d, x)| *d = f32::from_bits(x));
            Ok(())
        };
        for (name, tp) in &t.params {
            let missing = || ExecError::Unsupported(format!("no host copy of `{name}`"));
            let p = params.get_mut(name).ok_or_else(missing)?;
            let n = p.numel();
            let (Some(TensorData::F32(pv)), Some(mv), Some(vv)) = (
                Some(&mut p.data),
                m.get_mut(name).filter(|x| x.len() == n),
                v.get_mut(name).filter(|x| x.len() == n),
            ) else {
                return Err(missing());
            };
            if pv.len() != tp.acc.words {
                return Err(missing());
            }
            read(&tp.p, pv)?;
            read(&tp.m, mv)?;
            read(&tp.v, vv)?;
        }
        Ok(())
    }

    /// The device's stream, for an NCCL communicator ([`super::parallel`]).
    #[cfg(feature = "nccl")]
    pub(crate) fn stream(&self) -> Result<std::sync::Arc<cudarc::driver::CudaStream>, String> {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.stream()
    }

    /// Enqueues an NCCL sum of every gradient accumulator (in name order) over the ranks
    /// of `comm`, in place; the next [`CudaExecutor::train_update`] follows it on the
    /// stream. With several ranks driven from one thread, call it for every rank between
    /// `cudarc::nccl::group_start` and `group_end`.
    #[cfg(feature = "nccl")]
    pub(crate) fn train_all_reduce(&self, comm: &cudarc::nccl::Comm) -> Result<(), ExecError> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;
        st.device.bind().map_err(dev_err)?;
        let t = st.training.as_mut().ok_or_else(|| {
            ExecError::Unsupported("an all-reduce before `train_begin`".to_string())
        })?;
        for tp in t.params.values_mut() {
            st.device
                .all_reduce_sum(comm, &mut tp.acc)
                .map_err(dev_err)?;
        }
        Ok(())
    }

    /// A host tensor copied to the device (f32, f64 narrowed to f32, i32, i64 checked
    /// to fit i32, bools as 0/1).
    pub fn to_device(&self, t: &Tensor) -> Result<DeviceTensor, ExecError> {
        let numel = t.numel();
        if !t.is_consistent() {
            return Err(ExecError::Unsupported(format!(
                "a tensor of shape {:?} holding {} values",
                t.shape,
                t.data.len()
            )));
        }
        let (words, dtype): (Vec<u32>, DType) = match &t.data {
            TensorData::F32(v) => (v.iter().map(|x| x.to_bits()).collect(), DType::F32),
            TensorData::F64(v) => (
                v.iter().map(|&x| (x as f32).to_bits()).collect(),
                DType::F32,
            ),
            TensorData::I32(v) => (v.iter().map(|&x| x as u32).collect(), DType::I32),
            TensorData::I64(v) => (
                v.iter()
                    .map(|&x| {
                        i32::try_from(x).map(|x| x as u32).map_err(|_| {
                            ExecError::Unsupported(format!("the id {x} does not fit in i32"))
                        })
                    })
                    .collect::<Result<_, _>>()?,
                DType::I32,
            ),
            TensorData::Bool(v) => (v.iter().map(|&b| b as u32).collect(), DType::Bool),
        };
        debug_assert_eq!(words.len(), numel);
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.bind().map_err(dev_err)?;
        let buf = guard.device.upload(&words).map_err(dev_err)?;
        Ok(DeviceTensor {
            buf,
            shape: t.shape.clone(),
            dtype,
        })
    }

    /// A device tensor copied to the host.
    pub fn to_host(&self, t: &DeviceTensor) -> Result<Tensor, ExecError> {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.bind().map_err(dev_err)?;
        let n = t.numel();
        let w = guard
            .device
            .read(t.buf.ptr, words_of(t.dtype, n))
            .map_err(dev_err)?;
        let data = match t.dtype {
            DType::I32 => TensorData::I32(w.into_iter().map(|x| x as i32).collect()),
            DType::Bool => TensorData::Bool(w.iter().map(|&x| x != 0).collect()),
            DType::BF16 => TensorData::F32(unpack_bf16(&w, n)),
            _ => TensorData::F32(w.into_iter().map(f32::from_bits).collect()),
        };
        Ok(Tensor {
            shape: t.shape.clone(),
            data,
        })
    }

    /// The device, bound to this thread, with the resident decoder's unit
    /// (`codegen::cuda::resident`: the row gather and the top-k) compiled and loaded on
    /// first use.
    fn decoder_unit(&self) -> Result<std::sync::MutexGuard<'_, State>, ExecError> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.bind().map_err(dev_err)?;
        load_unit_once(
            &mut guard.device,
            gather::TAKE_ROWS,
            gather::code,
            &self.nvrtc_options,
        )
        .map_err(|log| dev_err(format!("NVRTC cannot compile the decoder's unit: {log}")))?;
        Ok(guard)
    }

    /// Every tensor of `ts` with its rows (axis 0) taken in the order `rows` (repeats
    /// allowed): row `r` of each result is row `rows[r]` of its source, bit for bit (the
    /// host's `decode::take_rows`). One upload of the indices, one launch per tensor of
    /// the generated `kiln_take_rows` (compiled on first use), one synchronization.
    pub fn take_rows(
        &self,
        ts: &[&DeviceTensor],
        rows: &[usize],
    ) -> Result<Vec<DeviceTensor>, ExecError> {
        let guard = self.decoder_unit()?;
        let dev = &guard.device;
        let idx: Vec<u32> = rows
            .iter()
            .map(|&r| u32::try_from(r).map_err(|_| ExecError::Unsupported(format!("row {r}"))))
            .collect::<Result<_, _>>()?;
        let idx = dev.upload(&idx).map_err(dev_err)?;
        let mut out = Vec::with_capacity(ts.len());
        for t in ts {
            let Some((&n0, rest)) = t.shape.split_first() else {
                return Err(ExecError::Unsupported(
                    "rows of a scalar on the device".to_string(),
                ));
            };
            if let Some(&bad) = rows.iter().find(|&&r| r >= n0) {
                return Err(ExecError::Unsupported(format!(
                    "row {bad} of a device tensor of shape {:?}",
                    t.shape
                )));
            }
            let elems: usize = rest.iter().product();
            // The gather moves words: a bf16 row is half as many (rows of an even width).
            let width = if t.dtype == DType::BF16 {
                if !elems.is_multiple_of(2) {
                    return Err(ExecError::Unsupported(format!(
                        "rows of {elems} bf16 values (an odd count) on the device"
                    )));
                }
                elems / 2
            } else {
                elems
            };
            let mut shape = t.shape.clone();
            shape[0] = rows.len();
            let buf = dev.alloc(rows.len() * width).map_err(dev_err)?;
            let (dims, items) = gather::take_rows_dims(rows.len(), width);
            if items > 0 {
                dev.launch(
                    gather::TAKE_ROWS,
                    &[idx.ptr, t.buf.ptr, buf.ptr],
                    &dims,
                    items,
                )
                .map_err(dev_err)?;
            }
            out.push(DeviceTensor {
                buf,
                shape,
                dtype: t.dtype,
            });
        }
        dev.sync().map_err(dev_err)?;
        Ok(out)
    }

    /// What beam search reads of a step's logits, selected on the device
    /// (`codegen::cuda::resident::row_top_k`, compiled on first use): per row of
    /// `logits` (`[rows, len, vocab]` f32 or bf16, its last position), the best `k` tokens
    /// other than `banned` and NaN, best first with ties to the smaller id, their
    /// log-probabilities (f64 log-softmax over the row's non-NaN values), and `eos`'s.
    /// Downloads `12·k + 8` bytes a row instead of the row.
    pub fn row_top_k(
        &self,
        logits: &DeviceTensor,
        k: usize,
        banned: &[i32],
        eos: i32,
    ) -> Result<RowsTopK, ExecError> {
        let [rows, len, vocab] = logits.shape[..] else {
            return Err(ExecError::Unsupported(format!(
                "logits of shape {:?}: the top-k reads [rows, len, vocab]",
                logits.shape
            )));
        };
        let f = match logits.dtype {
            DType::F32 => gather::TOP_K,
            DType::BF16 => gather::TOP_K_BF16,
            other => {
                return Err(ExecError::Unsupported(format!(
                    "{other:?} logits for the top-k"
                )))
            }
        };
        let mut out = RowsTopK {
            k,
            vals: vec![f64::NEG_INFINITY; rows * k],
            ids: vec![-1; rows * k],
            eos: vec![f64::NEG_INFINITY; rows],
        };
        if rows == 0 || len == 0 {
            return Ok(out);
        }
        let guard = self.decoder_unit()?;
        let dev = &guard.device;
        let mut ban: Vec<u32> = banned.iter().map(|&b| b as u32).collect();
        let nb = ban.len();
        ban.push(0);
        let ban = dev.upload(&ban).map_err(dev_err)?;
        let vals = dev.alloc(2 * rows * k.max(1)).map_err(dev_err)?;
        let ids = dev.alloc(rows * k.max(1)).map_err(dev_err)?;
        let eos_buf = dev.alloc(2 * rows).map_err(dev_err)?;
        let (dims, items) =
            gather::row_top_k_dims(rows, (vocab, len * vocab, (len - 1) * vocab), k, nb, eos);
        dev.launch(
            f,
            &[logits.buf.ptr, ban.ptr, vals.ptr, ids.ptr, eos_buf.ptr],
            &dims,
            items,
        )
        .map_err(dev_err)?;
        let f64s = |w: Vec<u32>| -> Vec<f64> {
            w.chunks(2)
                .map(|p| f64::from_bits(u64::from(p[0]) | (u64::from(p[1]) << 32)))
                .collect()
        };
        if k > 0 {
            out.vals = f64s(dev.read(vals.ptr, 2 * rows * k).map_err(dev_err)?);
            out.ids = dev
                .read(ids.ptr, rows * k)
                .map_err(dev_err)?
                .into_iter()
                .map(|w| w as i32)
                .collect();
        }
        out.eos = f64s(dev.read(eos_buf.ptr, 2 * rows).map_err(dev_err)?);
        Ok(out)
    }

    /// A run with some inputs already on the device (`resident`, by input name; the other
    /// inputs from the host as in [`CudaExecutor::run`]); the outputs `keep` names stay on
    /// the device (copied out of the arena), the others come back to the host, in
    /// `graph.outputs` order. What the GPU decoder runs each step: its encoder output and
    /// key/value caches never leave the device.
    pub fn run_resident(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        resident: &BTreeMap<String, DeviceTensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<ResidentOut, ExecError> {
        let res = Resident {
            inputs: resident,
            keep,
        };
        let out = self.run_with(inputs, params, opts, None, None, Some(&res))?;
        Ok((out.outputs, out.kept))
    }

    /// Frees the training state on the device.
    pub fn train_end(&self) {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.training = None;
    }
}

impl Exec for CudaExecutor {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    fn run(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        CudaExecutor::run(self, inputs, params, opts)
    }

    fn run_profiled(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        rec: &mut dyn FnMut(&Timing<'_>),
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        CudaExecutor::run_profiled(self, inputs, params, opts, rec)
    }

    fn as_cuda(&self) -> Option<&CudaExecutor> {
        Some(self)
    }
}

/// Where a value's elements are on the device: element `i` of the layout at
/// `ptr + 4·i` (4-byte elements: f32, i32, bools as 0/1).
#[derive(Clone, Debug)]
pub(crate) struct DLoc {
    pub ptr: u64,
    pub layout: Layout,
    pub dtype: DType,
}

impl DLoc {
    fn base(&self) -> u64 {
        self.at(self.layout.offset)
    }

    fn at(&self, elem: usize) -> u64 {
        self.ptr + elem_bytes(self.dtype) * elem as u64
    }

    /// Whether the elements are 2-byte bf16 (a mixed-precision program's activations).
    fn is_bf16(&self) -> bool {
        self.dtype == DType::BF16
    }

    fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    fn numel(&self) -> usize {
        self.layout.numel()
    }

    fn last(&self) -> usize {
        self.shape().last().copied().unwrap_or(1)
    }
}

/// The elements of `layout` (row-major) from `host`, the words of its whole buffer; an
/// element outside the buffer is an internal error.
fn gather_words(host: &[u32], layout: &Layout) -> Result<Vec<u32>, String> {
    let n = layout.numel();
    if n == 0 {
        return Ok(Vec::new());
    }
    // The farthest element read, checked once.
    let far = layout.offset
        + layout
            .shape
            .iter()
            .zip(&layout.strides)
            .map(|(d, s)| (d - 1) * s)
            .sum::<usize>();
    if far >= host.len() {
        return Err(format!(
            "internal: a view reads element {far} of an input of {}",
            host.len()
        ));
    }
    let Some((&inner, outer_shape)) = layout.shape.split_last() else {
        return Ok(vec![host[layout.offset]]);
    };
    let step = layout.strides[outer_shape.len()];
    let mut out = Vec::with_capacity(n);
    // Row by row (the last dim), the rows' starts as an odometer over the others.
    let mut idx = vec![0usize; outer_shape.len()];
    let mut start = layout.offset;
    for _ in 0..n / inner {
        if step == 1 {
            out.extend_from_slice(&host[start..start + inner]);
        } else {
            out.extend((0..inner).map(|i| host[start + i * step]));
        }
        for k in (0..idx.len()).rev() {
            idx[k] += 1;
            start += layout.strides[k];
            if idx[k] < outer_shape[k] {
                break;
            }
            start -= idx[k] * layout.strides[k];
            idx[k] = 0;
        }
    }
    Ok(out)
}

/// Bytes per element of a device buffer of `dtype`: 2 for bf16 (a mixed-precision
/// program's activations), else 4 (f32, i32, bools as 0/1).
fn elem_bytes(dtype: DType) -> u64 {
    if dtype == DType::BF16 {
        2
    } else {
        4
    }
}

/// Words (4 bytes) that hold `n` elements of `dtype`.
fn words_of(dtype: DType, n: usize) -> usize {
    if dtype == DType::BF16 {
        n.div_ceil(2)
    } else {
        n
    }
}

/// f32 values rounded to bf16 (the `half` crate's round to nearest even, as the device's
/// conversion), two to a word, little end first (an odd count pads with zero).
pub(crate) fn pack_bf16(v: impl ExactSizeIterator<Item = f32>) -> Vec<u32> {
    let mut out = Vec::with_capacity(v.len().div_ceil(2));
    let mut half_word: Option<u32> = None;
    for x in v {
        let h = u32::from(half::bf16::from_f32(x).to_bits());
        match half_word.take() {
            None => half_word = Some(h),
            Some(lo) => out.push(lo | (h << 16)),
        }
    }
    out.extend(half_word);
    out
}

/// The first `n` bf16 values of `words` (as [`pack_bf16`] lays them out), widened.
pub(crate) fn unpack_bf16(words: &[u32], n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let w = words[i / 2];
            let h = if i % 2 == 0 { w & 0xffff } else { w >> 16 };
            half::bf16::from_bits(h as u16).to_f32()
        })
        .collect()
}

/// Where a GEMM operand's element `e` is: `base + size·(e − lo)`.
struct Addr {
    base: u64,
    lo: usize,
    size: u64,
}

impl Addr {
    fn at(&self, e: usize) -> u64 {
        self.base + self.size * (e - self.lo) as u64
    }
}

/// A matrix per (batch, head): element offsets of each, and the row and column strides.
struct Heads {
    ptr: u64,
    offsets: Vec<usize>,
    rs: usize,
    cs: usize,
}

/// The `[rows, cols]` matrices of every head of a `[b, h, t, d]` location, rows along
/// axis `r` and columns along axis `c` (`r = 3, c = 2` reads them transposed).
fn heads(l: &DLoc, r: usize, c: usize) -> Heads {
    let (s, st) = (&l.layout.shape, &l.layout.strides);
    let mut offsets = Vec::with_capacity(s[0] * s[1]);
    for bi in 0..s[0] {
        for hi in 0..s[1] {
            offsets.push(l.layout.offset + bi * st[0] + hi * st[1]);
        }
    }
    Heads {
        ptr: l.ptr,
        offsets,
        rs: st[r],
        cs: st[c],
    }
}

/// Contiguous `[count, rows, cols]` scratch as per-head matrices (`transposed`: read
/// as `[cols, rows]`).
fn scratch_heads(ptr: u64, count: usize, rows: usize, cols: usize, transposed: bool) -> Heads {
    Heads {
        ptr,
        offsets: (0..count).map(|i| i * rows * cols).collect(),
        rs: if transposed { 1 } else { cols },
        cs: if transposed { cols } else { 1 },
    }
}

/// Compiles (NVRTC, `options`) and loads the generated unit `code` unless its function
/// `marker` is loaded already: the extra units (bf16 casts, the device optimizer, the row
/// gather) are built on first use. The error is NVRTC's log or the driver's message.
fn load_unit_once(
    device: &mut Device,
    marker: &str,
    code: fn() -> CudaCode,
    options: &[String],
) -> Result<(), String> {
    if device.has(marker) {
        return Ok(());
    }
    let code = code();
    let unit = device::compile(&code.source(), options)?;
    device.load_module(unit, &signatures(&code))
}

/// What `Device::load_module` needs of a generated unit's functions: name, work
/// division and parameter count.
fn signatures(code: &CudaCode) -> Vec<(String, Work, usize)> {
    code.functions
        .iter()
        .map(|f| (f.name.clone(), f.work, f.params.len()))
        .collect()
}

/// A reshape of a non-contiguous view, as binding plans it (see the CPU executor's
/// `ViewCopy`): the value copied, its size, and the values whose locations start at the
/// copy (itself and views of it), which get its address when it is made.
#[derive(Clone, Debug)]
struct CopyPlan {
    src: usize,
    words: usize,
    users: Vec<usize>,
}

/// Where a bound location's address comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Root {
    /// A source (input, parameter, constant), bound at every run.
    Source,
    /// The arena: the plan's offset from its start.
    Arena,
    /// A view of source value `.0`: its address.
    Of(usize),
    /// A view copy (or a view of one): set when the copy is made.
    Copy,
}

/// [`CudaExecutor::bind_derived`]'s results besides the locations.
struct Derived {
    needs: Vec<Vec<usize>>,
    copies: Vec<CopyPlan>,
    roots: Vec<Root>,
}

/// The views' and kernel results' locations at one dims, kept for the next run at those
/// dims: binding ~1,400 values (evaluating their shapes, building their layouts) took
/// about 2 ms of host time before a base training step's first launch, while the GPU
/// waited. Addresses are kept relative to their [`Root`].
struct Bound {
    /// The sources' dtypes (in [`CudaExecutor::sources`] order) it was made with: a run
    /// whose sources differ (an f64 input, a bf16 device tensor) binds afresh.
    dtypes: Vec<DType>,
    locs: Vec<Vec<DLoc>>,
    roots: Vec<Root>,
    needs: Vec<Vec<usize>>,
    copies: Vec<CopyPlan>,
}

impl Bound {
    /// At most this many dims are kept (each about 0.2 MB for the base model).
    const KEPT: usize = 64;

    /// The bound locations `locs` (arena at `base`) with addresses made relative.
    fn of(d: &Derived, locs: &[Vec<DLoc>], base: u64, dtypes: Vec<DType>) -> Bound {
        let locs = locs
            .iter()
            .zip(&d.roots)
            .map(|(ls, root)| {
                let from = match *root {
                    Root::Source | Root::Copy => None,
                    Root::Arena => Some(base),
                    Root::Of(s) => Some(locs[s][0].ptr),
                };
                ls.iter()
                    .map(|l| DLoc {
                        ptr: from.map_or(0, |f| l.ptr.wrapping_sub(f)),
                        layout: l.layout.clone(),
                        dtype: l.dtype,
                    })
                    .collect()
            })
            .collect();
        Bound {
            dtypes,
            locs,
            roots: d.roots.clone(),
            needs: d.needs.clone(),
            copies: d.copies.clone(),
        }
    }

    /// Places the kept locations at this run's addresses: the arena at `base`, the
    /// sources as `locs` holds them.
    fn place(&self, locs: &mut [Vec<DLoc>], base: u64) {
        for (v, (kept, root)) in self.locs.iter().zip(&self.roots).enumerate() {
            let at = match *root {
                Root::Source => continue,
                Root::Arena => base,
                Root::Of(s) => locs[s][0].ptr,
                Root::Copy => 0,
            };
            locs[v] = kept
                .iter()
                .map(|l| DLoc {
                    ptr: at.wrapping_add(l.ptr),
                    layout: l.layout.clone(),
                    dtype: l.dtype,
                })
                .collect();
        }
    }
}

/// A [`CopyPlan`] in a run: copied into a buffer of its own when a kernel first reads
/// it, freed after the last one does.
struct DevCopy {
    plan: CopyPlan,
    buf: Option<Buf>,
}

/// One run's device work: launches, GEMMs, copies, and the buffers they need.
struct Run<'a> {
    dev: &'a Device,
    copy: Option<&'a str>,
    /// The 2-byte strided copy (mixed precision).
    copy16: Option<&'a str>,
    keep: Vec<Buf>,
    dims: &'a BTreeMap<String, i64>,
    seed: u64,
    step: u32,
    pool: &'a Arc<Pool>,
    /// GEMM operands as bf16 ([`CudaOptions::bf16`]).
    bf16: bool,
    /// Bias (+ ReLU) of `linear` kernels in cuBLASLt's epilogue where it can.
    fused_epilogues: bool,
    /// Bias gradients in their weight gradient's GEMM epilogue where it can.
    fused_bias_grads: bool,
    /// `linear` kernels with a bias so far: (fused by cuBLASLt, run separately).
    epilogues: (usize, usize),
    /// Paired bias gradients so far ([`CudaExecutor::bias_grad_counts`]).
    bias_grads: (usize, usize),
    /// Bias gradients whose weight-gradient GEMM comes later, by the GEMM's step: the
    /// `sum_rows` step, the rows it sums (`dy`) and its result. The GEMM writes the
    /// result, or runs the `sum_rows` after itself where cuBLASLt cannot.
    bias_deferred: HashMap<usize, (usize, DLoc, DLoc)>,
    /// Bias gradients an earlier GEMM computed, by the `sum_rows` step: the buffer
    /// holding them, copied into the step's result when it comes.
    bias_ready: HashMap<usize, Buf>,
    /// The host words of each integer input this run uploaded, by device buffer: inputs
    /// are only read on the device, so [`Run::words`] of an i32 view of one (ids checked
    /// against the vocabulary, targets, the embedding gradient's row index) gathers them
    /// here instead of synchronizing the stream mid-step for a download.
    mirror: HashMap<u64, Vec<u32>>,
    /// The device buffers of this run's parameters: f32 data no kernel of the run writes.
    params: std::collections::HashSet<u64>,
    /// bf16 GEMM operands cast from spans of those parameters, made once a run (a weight
    /// is read by its forward and its backward products) or, for a decoder's or a
    /// validation's parameters kept on the device, once a parameters version.
    casts: HashMap<CastKey, Buf>,
}

/// A planned GEMM: the plan and where its operands are (f32 in place, or bf16 copies).
struct MatmulOps {
    plan: MatmulPlan,
    a: Addr,
    b: Addr,
    elem: device::GemmElem,
}

impl Run<'_> {
    /// Makes the copies in `cs` not made yet, in order (a copy of a view of a copy comes
    /// after the copy it reads).
    fn materialize(
        &mut self,
        cs: &[usize],
        copies: &mut [DevCopy],
        locs: &mut [Vec<DLoc>],
    ) -> Result<(), String> {
        for &c in cs {
            if copies[c].buf.is_some() {
                continue;
            }
            let b = self.dev.alloc(copies[c].plan.words)?;
            for &u in &copies[c].plan.users {
                locs[u][0].ptr = b.ptr;
            }
            let src = locs[copies[c].plan.src][0].clone();
            self.copy_to(&src, b.ptr)?;
            copies[c].buf = Some(b);
        }
        Ok(())
    }

    /// A fresh zeroed buffer of `words` words, alive until the run ends.
    fn alloc(&mut self, words: usize) -> Result<u64, String> {
        let b = self.dev.alloc(words)?;
        let p = b.ptr;
        self.keep.push(b);
        Ok(p)
    }

    /// [`Run::upload`] in stream order, without waiting for the stream where the copy is
    /// small ([`device::Device::write_enqueued`]): for data made mid-step.
    fn upload_enqueued(&mut self, words: &[u32]) -> Result<u64, String> {
        let b = self.dev.alloc(words.len())?;
        self.dev.write_enqueued(b.ptr, words)?;
        let p = b.ptr;
        self.keep.push(b);
        Ok(p)
    }

    /// A bound input or parameter on the device (`bf16`: a float input the program keeps
    /// in bf16, rounded on the host).
    fn source(&mut self, src: Source<'_>, shape: &[usize], bf16: bool) -> Result<DLoc, String> {
        let (words, dtype, _) = source_words(&src);
        // Inputs are uploaded as the launch order reaches them (just before their first
        // reader, possibly mid-step): small ones in stream order without a wait.
        if bf16 && dtype == DType::F32 {
            let packed = pack_bf16(words.iter().map(|&w| f32::from_bits(w)));
            return Ok(DLoc {
                ptr: self.upload_enqueued(&packed)?,
                layout: Layout::contiguous(shape),
                dtype: DType::BF16,
            });
        }
        let ptr = self.upload_enqueued(&words)?;
        if dtype == DType::I32 {
            self.mirror.insert(ptr, words.into_owned());
        }
        Ok(DLoc {
            ptr,
            layout: Layout::contiguous(shape),
            dtype,
        })
    }

    /// `l` (contiguous f32) rounded to bf16 in a fresh buffer.
    fn rounded_to_bf16(&mut self, l: &DLoc) -> Result<DLoc, String> {
        let n = l.numel();
        let dst = self.alloc(n.div_ceil(2).max(1))?;
        if n > 0 {
            self.dev
                .launch(cast::TO_BF16, &[l.base(), dst], &[n as i64], n)?;
        }
        Ok(DLoc {
            ptr: dst,
            layout: Layout::contiguous(l.shape()),
            dtype: DType::BF16,
        })
    }

    fn launch(&self, f: &str, ptrs: &[u64], l: Launch) -> Result<(), String> {
        self.dev.launch(f, ptrs, &l.dims, l.items)
    }

    /// Copies a strided location into the contiguous buffer at `dst` (generated
    /// `copy_strided`, rank ≤ `MAX_COPY_RANK`).
    fn copy_to(&mut self, src: &DLoc, dst: u64) -> Result<(), String> {
        if src.numel() == 0 {
            return Ok(());
        }
        if src.layout.is_contiguous() {
            let bytes = elem_bytes(src.dtype) as usize * src.numel();
            return self.dev.copy_bytes(dst, src.base(), bytes);
        }
        if src.shape().len() > MAX_COPY_RANK {
            return Err(format!(
                "unsupported: a strided view of rank {} (copy_strided takes at most {MAX_COPY_RANK})",
                src.shape().len()
            ));
        }
        let f = if src.is_bf16() {
            self.copy16
                .ok_or("the CUDA module has no strided copy of bf16 elements")?
        } else {
            self.copy
                .ok_or("the CUDA module has no copy_strided function")?
        };
        let strides: Vec<i64> = src.layout.strides.iter().map(|&s| s as i64).collect();
        self.launch(f, &[src.base(), dst], Launch::copy(src.shape(), &strides))
    }

    /// The row index of a scatter of `src` by `ids` into `out`'s rows, on the device:
    /// `(start, order, src, launch)` for `index::scatter_rows` and its `onto` form. Ids are
    /// checked on the host, as on the CPU (the kernels do not).
    fn scatter_index(
        &mut self,
        ids: &DLoc,
        src: &DLoc,
        out: &DLoc,
    ) -> Result<(u64, u64, u64, Launch), String> {
        let rows = out.shape().first().copied().unwrap_or(1);
        let width: usize = out.shape().iter().skip(1).product();
        let ids: Vec<i32> = self.words(ids)?.iter().map(|&w| w as i32).collect();
        let src = self.contig(src)?;
        if src.numel() != ids.len() * width {
            return Err(format!(
                "scatter_add of {} ids with {} values into rows of {width}",
                ids.len(),
                src.numel()
            ));
        }
        for (i, &id) in ids.iter().enumerate() {
            kiln_compiler::bind::check_id(id, rows, i, format_args!("the result has {rows} rows"))?;
        }
        let (start, order) = index::scatter_index(&ids, rows)
            .map_err(|(p, id)| format!("internal: id {id} at {p} passed the check"))?;
        let start = self.upload_enqueued(&start.iter().map(|&x| x as u32).collect::<Vec<_>>())?;
        let mut order: Vec<u32> = order.iter().map(|&x| x as u32).collect();
        if order.is_empty() {
            order.push(0);
        }
        let order = self.upload_enqueued(&order)?;
        Ok((
            start,
            order,
            src.base(),
            Launch::same(index::scatter_rows_dims(rows, width)),
        ))
    }

    /// `l` as a contiguous location (copied if it is not).
    fn contig(&mut self, l: &DLoc) -> Result<DLoc, String> {
        if l.layout.is_contiguous() {
            return Ok(l.clone());
        }
        let dst = self.alloc(words_of(l.dtype, l.numel()))?;
        self.copy_to(l, dst)?;
        Ok(DLoc {
            ptr: dst,
            layout: Layout::contiguous(l.shape()),
            dtype: l.dtype,
        })
    }

    /// `l`'s elements in row-major order, on the host (bf16 elements two to a word, as
    /// [`pack_bf16`] lays them out).
    fn words(&mut self, l: &DLoc) -> Result<Vec<u32>, String> {
        if let Some(host) = self.mirror.get(&l.ptr).filter(|_| l.dtype == DType::I32) {
            return gather_words(host, &l.layout);
        }
        let c = self.contig(l)?;
        self.dev.read(c.base(), words_of(c.dtype, c.numel()))
    }

    fn download(&mut self, l: &DLoc) -> Result<Tensor, String> {
        let w = self.words(l)?;
        // Same-size maps over an owned vector reuse its allocation (no copy).
        let data = match l.dtype {
            DType::I32 => TensorData::I32(w.into_iter().map(|x| x as i32).collect()),
            DType::Bool => TensorData::Bool(w.iter().map(|&x| x != 0).collect()),
            DType::BF16 => TensorData::F32(unpack_bf16(&w, l.numel())),
            _ => TensorData::F32(w.into_iter().map(f32::from_bits).collect()),
        };
        Ok(Tensor {
            shape: l.shape().to_vec(),
            data,
        })
    }

    /// `out = a·b` (`beta = 1`: `out += a·b`, a bias already loaded), `out` contiguous.
    fn matmul(&mut self, a: &DLoc, b: &DLoc, out: &DLoc, beta: f32) -> Result<(), String> {
        let plan = self.matmul_plan(a, b)?;
        let (a, b, plan) = plan;
        if out.numel() == 0 {
            return Ok(());
        }
        if plan.empty_k {
            return if beta == 0.0 {
                self.dev.zero(out.base(), words_of(out.dtype, out.numel()))
            } else {
                Ok(())
            };
        }
        let ops = self.matmul_ops(&a, &b, plan)?;
        self.matmul_launch(&ops, out, beta)
    }

    /// The plan of `a·b`, with the operands cuBLAS cannot read as they are copied
    /// contiguous first (the returned locations).
    fn matmul_plan(&mut self, a: &DLoc, b: &DLoc) -> Result<(DLoc, DLoc, MatmulPlan), String> {
        let (mut a, mut b) = (a.clone(), b.clone());
        let plan = match plan_matmul(&a.layout, &b.layout) {
            Ok(p) => p,
            Err(Err(m)) => return Err(m),
            Err(Ok(need)) => {
                if need.a {
                    a = self.contig(&a)?;
                }
                if need.b {
                    b = self.contig(&b)?;
                }
                plan_matmul(&a.layout, &b.layout).map_err(|e| match e {
                    Ok(n) => format!("internal: cuBLAS cannot read contiguous operands ({n:?})"),
                    Err(m) => m,
                })?
            }
        };
        Ok((a, b, plan))
    }

    /// The operands' addresses: f32 in place, or as bf16 — in place when stored in
    /// bf16 (mixed precision), else bf16 copies (element `e` of the f32 location at
    /// `base + 2·(e − lo)`).
    fn matmul_ops(&mut self, a: &DLoc, b: &DLoc, plan: MatmulPlan) -> Result<MatmulOps, String> {
        if !self.bf16 && (a.is_bf16() || b.is_bf16()) {
            return Err("internal: a bf16 operand of an f32 GEMM".to_string());
        }
        Ok(if self.bf16 {
            let (pa, la) = self.bf16_span(a)?;
            let (pb, lb) = self.bf16_span(b)?;
            MatmulOps {
                plan,
                a: Addr {
                    base: pa,
                    lo: la,
                    size: 2,
                },
                b: Addr {
                    base: pb,
                    lo: lb,
                    size: 2,
                },
                elem: device::GemmElem::Bf16,
            }
        } else {
            MatmulOps {
                plan,
                a: Addr {
                    base: a.ptr,
                    lo: 0,
                    size: 4,
                },
                b: Addr {
                    base: b.ptr,
                    lo: 0,
                    size: 4,
                },
                elem: device::GemmElem::F32,
            }
        })
    }

    /// The cuBLAS calls of a planned GEMM into `out` (`beta`: 1 adds to what `out`
    /// holds), f32 or, in a mixed-precision program, bf16.
    fn matmul_launch(&mut self, ops: &MatmulOps, out: &DLoc, beta: f32) -> Result<(), String> {
        let plan = &ops.plan;
        let out_elem = if out.is_bf16() {
            device::GemmElem::Bf16
        } else {
            device::GemmElem::F32
        };
        match plan.strided {
            Some((sa, sb)) => self.dev.gemm(
                &plan.gemm,
                ops.elem,
                out_elem,
                ops.a.at(plan.a_offsets[0]),
                ops.b.at(plan.b_offsets[0]),
                out.base(),
                beta,
                Some((plan.a_offsets.len(), sa, sb, plan.c_stride as i64)),
            ),
            None => {
                for (i, (&oa, &ob)) in plan.a_offsets.iter().zip(&plan.b_offsets).enumerate() {
                    self.dev.gemm(
                        &plan.gemm,
                        ops.elem,
                        out_elem,
                        ops.a.at(oa),
                        ops.b.at(ob),
                        out.at(out.layout.offset + i * plan.c_stride),
                        beta,
                        None,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// `out[j] = Σ_rows x[…, j]`: a chunk's partial sums, then their finish.
    fn sum_rows(&mut self, main: &str, finish: &str, x: &DLoc, out: &DLoc) -> Result<(), String> {
        let x = self.contig(x)?;
        let n = x.last();
        let rows = x.numel() / n.max(1);
        let part = self.alloc(cuda_misc::sum_rows_chunks(rows) * n)?;
        let (main_l, finish_l) = Launch::sum_rows(x.shape());
        self.launch(main, &[x.base(), part], main_l)?;
        self.launch(finish, &[part, out.base()], finish_l)
    }

    /// Step `s` of a bias-gradient pair (the launch plan's; `other` is the other
    /// step): what this did of the step's work ([`Paired`]).
    /// - A `sum_rows` before its GEMM is deferred to it (unless its rows are a view copy,
    ///   which may be freed by then); one after its GEMM copies what the GEMM computed.
    /// - The GEMM computes the bias gradient in its epilogue ([`Run::gemm_bias_grad`]):
    ///   into the `sum_rows`'s result when that came first — its slot is planned from the
    ///   `sum_rows` on, and no kernel between reads it — or into a buffer of its own when
    ///   the `sum_rows` comes later. Where it cannot, a deferred `sum_rows` runs after it.
    #[allow(clippy::too_many_arguments)]
    fn bias_grad_pair(
        &mut self,
        steps: &[Step],
        s: usize,
        other: usize,
        ins: &[&DLoc],
        outs: &[DLoc],
        locs: &[Vec<DLoc>],
        needs: &[Vec<usize>],
    ) -> Result<Paired, String> {
        let step = &steps[s];
        match &step.exec {
            StepExec::SumRows { .. } if other > s => {
                if !needs[step.inputs[0]].is_empty() {
                    return Ok(Paired::No);
                }
                self.bias_deferred
                    .insert(other, (s, ins[0].clone(), outs[0].clone()));
                Ok(Paired::Left)
            }
            StepExec::SumRows { .. } => {
                let Some(buf) = self.bias_ready.remove(&s) else {
                    return Ok(Paired::No);
                };
                let out = &outs[0];
                let bytes = elem_bytes(out.dtype) as usize * out.numel();
                self.dev.copy_bytes(out.base(), buf.ptr, bytes)?;
                // Freed in stream order, as a kernel's scratch.
                self.keep.push(buf);
                Ok(Paired::Left)
            }
            StepExec::Gemm { .. } if other < s => {
                let Some((sum, dy, db)) = self.bias_deferred.remove(&s) else {
                    return Ok(Paired::No);
                };
                if self.gemm_bias_grad(ins[0], ins[1], &outs[0], &dy, &db)? {
                    self.bias_grads.0 += 1;
                    return Ok(Paired::Summed);
                }
                self.exec(step, ins, outs)?;
                let StepExec::SumRows { main, finish } = &steps[sum].exec else {
                    return Err(format!("internal: step {sum} deferred as a bias gradient"));
                };
                self.bias_grads.1 += 1;
                self.sum_rows(main, finish, &dy, &db)?;
                Ok(Paired::RanBoth)
            }
            StepExec::Gemm { .. } => {
                let sum = &steps[other];
                if !needs[sum.inputs[0]].is_empty() {
                    return Ok(Paired::No);
                }
                let (dy, db) = (&locs[sum.inputs[0]][0], &locs[sum.value][0]);
                // Every element is written by the epilogue: no need to zero it.
                let buf = self
                    .dev
                    .alloc_uninit(words_of(db.dtype, db.numel()).max(1))?;
                let to = DLoc {
                    ptr: buf.ptr,
                    layout: Layout::contiguous(db.shape()),
                    dtype: db.dtype,
                };
                if self.gemm_bias_grad(ins[0], ins[1], &outs[0], dy, &to)? {
                    self.bias_grads.0 += 1;
                    self.bias_ready.insert(other, buf);
                    return Ok(Paired::Summed);
                }
                Ok(Paired::No)
            }
            _ => Ok(Paired::No),
        }
    }

    /// `out = x·w` and `db[j] = Σ_rows dy[…, j]` in one cuBLASLt call, where the GEMM
    /// reads `dy` in place as its right operand (`w` is `dy` as `[rows, n]`: cuBLAS's
    /// first operand, summed along `k` by the `BGRADA` epilogue). `Ok(false)`, with
    /// nothing launched, where it does not (a copy, a batched or empty product, a bf16
    /// cast of an f32 `dy`), for a single row, or where cuBLASLt has no algorithm.
    fn gemm_bias_grad(
        &mut self,
        x: &DLoc,
        w: &DLoc,
        out: &DLoc,
        dy: &DLoc,
        db: &DLoc,
    ) -> Result<bool, String> {
        let n = dy.last();
        let rows = dy.numel() / n.max(1);
        // One row (`k = 1`) stays apart: OneFlow found cuBLASLt's bias gradient wrong there
        // (its `cublas_fused_matmul_bias_add_grad.cu` copies the row instead).
        if out.numel() == 0
            || rows < 2
            || !dy.layout.is_contiguous()
            || !db.layout.is_contiguous()
            || db.numel() != n
            || w.dtype != dy.dtype
            || (self.bf16 && !w.is_bf16())
        {
            return Ok(false);
        }
        let (a, b, plan) = self.matmul_plan(x, w)?;
        let g = plan.gemm;
        let in_place = plan.a_offsets.len() == 1
            && plan.strided.is_none()
            && !plan.empty_k
            && b.ptr == w.ptr
            && b.at(plan.b_offsets[0]) == dy.base()
            && !g.transa
            && g.lda as usize == n
            && g.m as usize == n
            && g.k as usize == rows;
        if !in_place {
            return Ok(false);
        }
        let out_elem = if out.is_bf16() {
            device::GemmElem::Bf16
        } else {
            device::GemmElem::F32
        };
        let ops = self.matmul_ops(&a, &b, plan)?;
        let p = &ops.plan;
        self.dev.gemm_bias_grad(
            &p.gemm,
            (ops.elem, out_elem),
            ops.a.at(p.a_offsets[0]),
            ops.b.at(p.b_offsets[0]),
            out.base(),
            db.base(),
            db.is_bf16(),
        )
    }

    /// A `linear` kernel: `out = x·w + bias` (`relu`: then `max(·, 0)`); `bias_fill`
    /// and `relu` are the generated kernels of the separate path. One cuBLASLt call with
    /// a bias epilogue where it can (one GEMM over every row, cuBLASLt has an algorithm);
    /// otherwise the bias rows, a GEMM adding to them, and a ReLU pass.
    fn linear(
        &mut self,
        ins: &[&DLoc],
        out: &DLoc,
        bias_fill: Option<&str>,
        relu: Option<&str>,
    ) -> Result<(), String> {
        let Some(fill) = bias_fill else {
            self.matmul(ins[0], ins[1], out, 0.0)?;
            if let Some(f) = relu {
                self.launch(f, &[out.base()], Launch::relu(out.numel()))?;
            }
            return Ok(());
        };
        let bias = self.contig(ins[2])?;
        let (a, b, plan) = self.matmul_plan(ins[0], ins[1])?;
        let n = out.last();
        let rows = out.numel() / n.max(1);
        let one_gemm = plan.a_offsets.len() == 1 && plan.strided.is_none() && !plan.empty_k;
        if out.numel() == 0 {
            return Ok(());
        }
        let ops = self.matmul_ops(&a, &b, plan)?;
        // cuBLASLt's epilogue writes the result in its element type and reads the bias in
        // the same: a bf16 result (mixed precision, bf16 operands) takes the f32 bias
        // rounded to bf16, as the separate path's bias fill rounds it.
        let out_elem = if out.is_bf16() {
            device::GemmElem::Bf16
        } else {
            device::GemmElem::F32
        };
        let fusable = out_elem == device::GemmElem::F32 || ops.elem == device::GemmElem::Bf16;
        if self.fused_epilogues && one_gemm && bias.dtype == DType::F32 && fusable {
            let bias_ptr = if out_elem == device::GemmElem::Bf16 {
                // Contiguous: its first element is at the span's start (a parameter's
                // cast is made once a run, or once a parameters version).
                self.bf16_span(&bias)?.0
            } else {
                bias.base()
            };
            let p = &ops.plan;
            let fused = self.dev.gemm_bias(
                &p.gemm,
                (ops.elem, out_elem),
                ops.a.at(p.a_offsets[0]),
                ops.b.at(p.b_offsets[0]),
                out.base(),
                bias_ptr,
                relu.is_some(),
            )?;
            if fused {
                self.epilogues.0 += 1;
                return Ok(());
            }
        }
        self.epilogues.1 += 1;
        self.launch(fill, &[bias.base(), out.base()], Launch::fill_rows(rows, n))?;
        if !ops.plan.empty_k {
            self.matmul_launch(&ops, out, 1.0)?;
        }
        if let Some(f) = relu {
            self.launch(f, &[out.base()], Launch::relu(out.numel()))?;
        }
        Ok(())
    }

    /// The elements `l` can address, `lo..hi` of its buffer, converted to bf16 in a
    /// fresh buffer: its address and `lo`.
    fn bf16_span(&mut self, l: &DLoc) -> Result<(u64, usize), String> {
        if l.is_bf16() {
            // Stored in bf16 already: element `e` at `ptr + 2·e`.
            return Ok((l.ptr, 0));
        }
        if l.dtype != DType::F32 {
            return Err(format!("a {:?} GEMM operand", l.dtype));
        }
        let lo = l.layout.offset;
        let hi = lo
            + l.layout
                .shape
                .iter()
                .zip(&l.layout.strides)
                .map(|(&d, &s)| d.saturating_sub(1) * s)
                .sum::<usize>()
            + 1;
        let n = hi - lo;
        let key = (l.ptr, lo, n);
        if let Some(b) = self.casts.get(&key) {
            return Ok((b.ptr, lo));
        }
        // Every element of the copy is written: no need to zero it.
        let buf = self.dev.alloc_uninit(n.div_ceil(2))?;
        let dst = buf.ptr;
        self.dev
            .launch(cast::TO_BF16, &[l.at(lo), dst], &[n as i64], n)?;
        if self.params.contains(&l.ptr) {
            self.casts.insert(key, buf);
        } else {
            self.keep.push(buf);
        }
        Ok((dst, lo))
    }

    /// Per head `i`: `c_i[m, n] = a_i[m, k]·b_i[k, n]` into contiguous `c` (`m·n` per
    /// head); one strided-batched call when the heads are evenly spaced.
    fn head_gemms(
        &self,
        (m, k, n): (usize, usize, usize),
        a: &Heads,
        b: &Heads,
        c: u64,
    ) -> Result<(), String> {
        let count = a.offsets.len();
        if count == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            return self.dev.zero(c, count * m * n);
        }
        let da = MatDesc {
            rows: m,
            cols: k,
            rs: a.rs,
            cs: a.cs,
        };
        let db = MatDesc {
            rows: k,
            cols: n,
            rs: b.rs,
            cs: b.cs,
        };
        let g = sgemm_args((m, k, n), &da, &db, n).map_err(|e| match e {
            Ok(need) => format!("internal: attention operands cuBLAS cannot read ({need:?})"),
            Err(m) => m,
        })?;
        let at = |h: &Heads, i: usize| h.ptr + 4 * h.offsets[i] as u64;
        match (even_stride(&a.offsets), even_stride(&b.offsets)) {
            (Some(sa), Some(sb)) => self.dev.sgemm(
                &g,
                at(a, 0),
                at(b, 0),
                c,
                0.0,
                Some((count, sa, sb, (m * n) as i64)),
            ),
            _ => {
                for i in 0..count {
                    self.dev.sgemm(
                        &g,
                        at(a, i),
                        at(b, i),
                        c + 4 * (i * m * n) as u64,
                        0.0,
                        None,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// A `[b, h, t, d]` operand whose matrices cuBLAS can read (copied if not).
    fn blas_ready(&mut self, l: &DLoc) -> Result<DLoc, String> {
        let (s, st) = (&l.layout.shape, &l.layout.strides);
        let d = MatDesc {
            rows: s[2],
            cols: s[3],
            rs: st[2],
            cs: st[3],
        };
        if blas_operand(&d).is_some() {
            Ok(l.clone())
        } else {
            self.contig(l)
        }
    }

    /// Zeroes `ds[b, h, tq, tk]` where the mask is false (the CPU executor's rule), on
    /// the host: no generated function does it yet.
    fn zero_masked(
        &mut self,
        ds: u64,
        mask: &DLoc,
        kind: MaskKind,
        (b, h, tq, tk): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        let m = self.words(mask)?;
        let mut d = self.dev.read(ds, b * h * tq * tk)?;
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..tq {
                    let row = if kind == MaskKind::Key {
                        bi * tk
                    } else {
                        i * tk
                    };
                    for j in 0..tk {
                        if m[row + j] == 0 {
                            d[((bi * h + hi) * tq + i) * tk + j] = 0f32.to_bits();
                        }
                    }
                }
            }
        }
        self.dev.write(ds, &d)
    }

    /// Runs one kernel (the CPU executor's `launch::run_exec`, on the device).
    fn exec(&mut self, step: &Step, ins: &[&DLoc], outs: &[DLoc]) -> Result<(), String> {
        match &step.exec {
            StepExec::Gemm { bias, relu } => {
                self.linear(ins, &outs[0], bias.as_deref(), relu.as_deref())
            }
            StepExec::Region { f, expr, inner } => {
                let out = &outs[0];
                let shape = out.shape().to_vec();
                let mut ptrs = Vec::with_capacity(ins.len() + 1);
                let mut strides = Vec::with_capacity(ins.len());
                for (k, l) in ins.iter().enumerate() {
                    let want_unit = inner.get(k).copied().unwrap_or(true);
                    let mut l = (*l).clone();
                    let b = match region_operand(&l.layout, &shape, want_unit)? {
                        Some(b) => b,
                        None => {
                            l = self.contig(&l)?;
                            l.layout.broadcast(&shape)
                        }
                    };
                    ptrs.push(l.at(b.offset));
                    strides.push(b.strides.iter().map(|&s| s as isize).collect::<Vec<_>>());
                }
                ptrs.push(out.base());
                let launch = Launch::region(expr, &shape, &strides, self.seed, self.step);
                self.launch(f, &ptrs, launch)
            }
            StepExec::Softmax(f) => {
                let x = self.contig(ins[0])?;
                let c = x.last();
                let l = Launch::same(rows::softmax_dims(x.numel() / c.max(1), c));
                self.launch(f, &[x.base(), outs[0].base()], l)
            }
            StepExec::ScaleMaskSoftmax(f, mask) => {
                let x = self.contig(ins[0])?;
                let s = x.shape().to_vec();
                let l = Launch::same(rows::scale_mask_softmax_dims(s[0], s[1], s[2], s[3]));
                let ptrs = if *mask == MaskKind::None {
                    vec![x.base(), ins[1].base(), outs[0].base()]
                } else {
                    let m = self.contig(ins[1])?;
                    vec![
                        x.base(),
                        m.base(),
                        ins[2].base(),
                        ins[3].base(),
                        outs[0].base(),
                    ]
                };
                self.launch(f, &ptrs, l)
            }
            StepExec::Attention {
                flash: Some(f),
                mask,
                ..
            } => self.flash_forward(ins, &outs[0], f, *mask),
            StepExec::Attention { softmax, mask, .. } => {
                self.attention(ins, &outs[0], softmax, *mask)
            }
            StepExec::AttentionBwd {
                flash: Some((fq, fkv)),
                mask,
                short,
                ..
            } => self.flash_backward(ins, outs, (fq, fkv, short.as_deref()), *mask),
            StepExec::AttentionBwd {
                softmax,
                softmax_bwd,
                mask,
                ..
            } => self.attention_bwd(ins, outs, softmax, softmax_bwd, *mask),
            StepExec::AddLayerNorm(f) => {
                let x = self.contig(ins[0])?;
                let y = self.contig(ins[1])?;
                let g = self.contig(ins[2])?;
                let b = self.contig(ins[3])?;
                let d = x.last();
                let l = Launch::same(rows::add_layer_norm_dims(x.numel() / d.max(1), d));
                let ptrs = [
                    x.base(),
                    y.base(),
                    g.base(),
                    b.base(),
                    ins[4].base(),
                    ins[5].base(),
                    outs[0].base(),
                ];
                self.launch(f, &ptrs, l)
            }
            StepExec::AddLayerNormBwd { main, finish } => {
                let x = self.contig(ins[0])?;
                let y = self.contig(ins[1])?;
                let g = self.contig(ins[2])?;
                let dy = self.contig(ins[3])?;
                let d = x.last();
                let rows_n = x.numel() / d.max(1);
                let scratch = self.alloc(rows::add_layer_norm_bwd_scratch(rows_n, d))?;
                let ptrs = [
                    x.base(),
                    y.base(),
                    g.base(),
                    dy.base(),
                    ins[4].base(),
                    ins[5].base(),
                    outs[0].base(),
                    scratch,
                ];
                self.launch(
                    main,
                    &ptrs,
                    Launch::same(rows::add_layer_norm_bwd_dims(rows_n, d)),
                )?;
                self.launch(
                    finish,
                    &[scratch, outs[1].base(), outs[2].base()],
                    Launch::ln_bwd_finish(rows_n, d),
                )
            }
            StepExec::XentLs {
                count,
                main,
                finish,
                pad,
                grad,
            } => {
                let logits = self.contig(ins[0])?;
                let target = self.contig(ins[1])?;
                let v = logits.last();
                let rows_n = logits.numel() / v.max(1);
                // Targets are checked on the host, as on the CPU (the kernels read one out
                // of range as no class).
                kiln_compiler::bind::check_targets(&self.words(&target)?, v, *pad)?;
                let stats = self.alloc(2)?;
                let row_loss = self.alloc(rows_n)?;
                // The `seeded` form (a loss-scaled train_step) has the seed as operand 5.
                let count_bufs = match ins.get(5) {
                    Some(seed) => vec![target.base(), self.contig(seed)?.base(), stats],
                    None => vec![target.base(), stats],
                };
                self.launch(count, &count_bufs, Launch::xent_count(rows_n, *pad))?;
                let ptrs = rows::xent_ls_buffers(
                    [
                        logits.base(),
                        target.base(),
                        ins[2].base(),
                        ins[3].base(),
                        ins[4].base(),
                    ],
                    row_loss,
                    grad.then(|| (stats + 4, outs[1].base())),
                );
                self.launch(
                    main,
                    &ptrs,
                    Launch::same(rows::xent_ls_dims(rows_n, v, *pad)),
                )?;
                self.launch(
                    finish,
                    &[row_loss, stats, outs[0].base()],
                    Launch::xent_finish(rows_n),
                )
            }
            StepExec::EmbedPe { f, dropout } => {
                let table = self.contig(ins[0])?;
                let ids = self.contig(ins[1])?;
                let pe = self.contig(ins[2])?;
                let vocab = table.shape()[0];
                // Ids are checked on the host, as on the CPU (the kernel does not).
                for (i, w) in self.words(&ids)?.iter().enumerate() {
                    kiln_compiler::bind::check_id(
                        *w as i32,
                        vocab,
                        i,
                        format_args!("the embedding table has {vocab} rows"),
                    )?;
                }
                let s = outs[0].shape().to_vec();
                let l = Launch::embed_pe(s[2], s[1], s[0], *dropout, self.seed, self.step);
                let ptrs = [
                    table.base(),
                    ids.base(),
                    pe.base(),
                    ins[3].base(),
                    outs[0].base(),
                ];
                self.launch(f, &ptrs, l)
            }
            StepExec::SumRows { main, finish } => {
                if step.bias_grad.is_some() {
                    self.bias_grads.1 += 1;
                }
                self.sum_rows(main, finish, ins[0], &outs[0])
            }
            StepExec::Adam(f) => {
                let mut ptrs = Vec::with_capacity(14);
                for l in ins.iter().take(4) {
                    ptrs.push(self.contig(l)?.base());
                }
                for l in ins.iter().skip(4) {
                    ptrs.push(l.base());
                }
                for o in outs {
                    ptrs.push(o.base());
                }
                self.launch(f, &ptrs, Launch::adam(outs[0].numel()))
            }
            StepExec::Reduce { f, axis, layout } => {
                let x = self.contig(ins[0])?;
                let s = x.shape();
                let outer: usize = s[..*axis].iter().product();
                let len = s[*axis];
                let inner: usize = s[axis + 1..].iter().product();
                if *layout == ReduceLayout::Rows && inner != 1 {
                    return Err("internal: a row reduction over a non-last axis".into());
                }
                let l = Launch::reduce(*layout, outer, len, inner);
                self.launch(f, &[x.base(), outs[0].base()], l)
            }
            StepExec::CausalMask(f) => {
                let s = outs[0].shape();
                let l = Launch::same(index::causal_mask_dims(s[0], s[1]));
                self.launch(f, &[outs[0].base()], l)
            }
            StepExec::PadMask(f, pad) => {
                let ids = self.contig(ins[0])?;
                let l = Launch::same(index::pad_mask_dims(ids.numel(), *pad));
                self.launch(f, &[ids.base(), outs[0].base()], l)
            }
            StepExec::Arange(f, start) => {
                let start = start
                    .eval(self.dims)
                    .map_err(|e| format!("arange start: {e}"))?;
                let n = outs[0].numel();
                let end = start + n as i64;
                if n > 0 && (start < i64::from(i32::MIN) || end - 1 > i64::from(i32::MAX)) {
                    return Err(format!("the range {start}..{end} does not fit in i32"));
                }
                self.launch(
                    f,
                    &[outs[0].base()],
                    Launch::same(index::arange_dims(n, start)),
                )
            }
            StepExec::Concat(f, axis) => {
                let out = &outs[0];
                let s = out.shape().to_vec();
                if *axis >= s.len() {
                    return Err(format!("internal: concat axis {axis} of {s:?}"));
                }
                let outer: usize = s[..*axis].iter().product();
                let inner: usize = s[axis + 1..].iter().product();
                let mut ptrs = Vec::with_capacity(ins.len() + 1);
                let mut sizes = Vec::with_capacity(ins.len());
                for l in ins {
                    sizes.push(l.shape()[*axis]);
                    ptrs.push(self.contig(l)?.base());
                }
                ptrs.push(out.base());
                self.launch(
                    f,
                    &ptrs,
                    Launch::same(index::concat_dims(outer, inner, &sizes)),
                )
            }
            StepExec::ScatterAdd(f) => {
                let out = &outs[0];
                let (start, order, src, l) = self.scatter_index(ins[0], ins[1], out)?;
                self.launch(f, &[start, order, src, out.base()], l)
            }
            StepExec::ScatterAddInto(f) => {
                let out = &outs[0];
                // A strided base is read through a contiguous copy; one planned in place
                // is `out` itself.
                let base = self.contig(ins[0])?;
                if base.numel() != out.numel() {
                    return Err(format!(
                        "scatter_add_into onto {} elements into {}",
                        base.numel(),
                        out.numel()
                    ));
                }
                let (start, order, src, l) = self.scatter_index(ins[1], ins[2], out)?;
                self.launch(f, &[start, order, base.base(), src, out.base()], l)
            }
            StepExec::Host(fb) => self.host(fb, ins, outs),
        }
    }

    /// A kernel without CUDA code: operands to the host, the CPU executor's fallback,
    /// results back into the arena.
    fn host(
        &mut self,
        fb: &fallback::Fallback,
        ins: &[&DLoc],
        outs: &[DLoc],
    ) -> Result<(), String> {
        if ins.iter().any(|l| l.is_bf16()) || outs.iter().any(|l| l.is_bf16()) {
            return Err("internal: a host kernel with a bf16 buffer".into());
        }
        let mut host_ins: Vec<Vec<u32>> = Vec::with_capacity(ins.len());
        for l in ins {
            host_ins.push(self.words(l)?);
        }
        let mut host_outs: Vec<Vec<u32>> =
            outs.iter().map(|o| vec![0u32; o.numel().max(1)]).collect();
        let in_locs: Vec<Loc> = host_ins
            .iter_mut()
            .zip(ins)
            .map(|(w, l)| Loc {
                ptr: w.as_mut_ptr() as *mut u8,
                layout: Layout::contiguous(l.shape()),
                dtype: l.dtype,
            })
            .collect();
        let out_locs: Vec<Loc> = host_outs
            .iter_mut()
            .zip(outs)
            .map(|(w, o)| Loc {
                ptr: w.as_mut_ptr() as *mut u8,
                layout: Layout::contiguous(o.shape()),
                dtype: o.dtype,
            })
            .collect();
        let in_refs: Vec<&Loc> = in_locs.iter().collect();
        let ctx = HostCtx {
            dims: self.dims,
            seed: self.seed,
            step: self.step,
            pool: self.pool,
        };
        fallback::run_host(fb, &in_refs, &out_locs, &ctx)?;
        for (o, w) in outs.iter().zip(&host_outs) {
            if !o.layout.is_contiguous() {
                return Err("internal: a strided kernel result".into());
            }
            self.dev.write(o.base(), &w[..o.numel()])?;
        }
        Ok(())
    }

    /// Flash attention forward ([`attention::forward`]): operands read through their
    /// strides, the mask made contiguous, `out` contiguous.
    fn flash_forward(
        &mut self,
        ins: &[&DLoc],
        out: &DLoc,
        f: &str,
        mask: MaskKind,
    ) -> Result<(), String> {
        let (q, k, v) = (ins[0], ins[1], ins[2]);
        let (b, h, tq, tk, dk, dv) = attention_sizes(q, k, v)?;
        let mut ptrs = vec![q.base(), k.base(), v.base()];
        if mask == MaskKind::None {
            ptrs.push(ins[3].base());
        } else {
            let m = self.contig(ins[3])?;
            ptrs.extend([m.base(), ins[4].base(), ins[5].base()]);
        }
        ptrs.push(out.base());
        let t = attention::tile(Part::Forward, dk, dv).ok_or("internal: no flash tile")?;
        let dims = attention::dims(
            b,
            h,
            tq,
            tk,
            &[strides4(q)?, strides4(k)?, strides4(v)?, strides4(out)?],
        );
        let items = attention::items(Part::Forward, t, b, h, tq, tk);
        self.launch(f, &ptrs, Launch { dims, items })
    }

    /// Flash attention backward: [`attention::backward_short`] (one block per head) when
    /// the module has it and both lengths fit its tile, else [`attention::backward_q`]
    /// (`dq` and the row statistics into scratch), then [`attention::backward_kv`] (`dk`,
    /// `dv`).
    fn flash_backward(
        &mut self,
        ins: &[&DLoc],
        outs: &[DLoc],
        (fq, fkv, short): (&str, &str, Option<&str>),
        mask: MaskKind,
    ) -> Result<(), String> {
        let (q, k, v) = (ins[0], ins[1], ins[2]);
        let (b, h, tq, tk, dk, dv) = attention_sizes(q, k, v)?;
        let mut ptrs = vec![q.base(), k.base(), v.base()];
        let g = if mask == MaskKind::None {
            ptrs.extend([ins[3].base(), ins[4].base()]);
            ins[3]
        } else {
            let m = self.contig(ins[3])?;
            ptrs.extend([m.base(), ins[4].base(), ins[5].base(), ins[6].base()]);
            ins[4]
        };
        let dims = attention::dims(
            b,
            h,
            tq,
            tk,
            &[
                strides4(q)?,
                strides4(k)?,
                strides4(v)?,
                strides4(g)?,
                strides4(&outs[0])?,
                strides4(&outs[1])?,
                strides4(&outs[2])?,
            ],
        );
        if let Some(fs) = short.filter(|_| attention::fits_short(tq, tk, dk, dv)) {
            ptrs.extend([outs[0].base(), outs[1].base(), outs[2].base()]);
            let items = attention::items(Part::Short, 0, b, h, tq, tk);
            return self.launch(fs, &ptrs, Launch { dims, items });
        }
        let stats = self.alloc(b * h * tq * 3)?;
        let tile = |p| attention::tile(p, dk, dv).ok_or("internal: no flash tile");
        let mut pq = ptrs.clone();
        pq.extend([outs[0].base(), stats]);
        let items = attention::items(Part::BackwardQ, tile(Part::BackwardQ)?, b, h, tq, tk);
        self.launch(
            fq,
            &pq,
            Launch {
                dims: dims.clone(),
                items,
            },
        )?;
        ptrs.extend([stats, outs[1].base(), outs[2].base()]);
        let items = attention::items(Part::BackwardKv, tile(Part::BackwardKv)?, b, h, tq, tk);
        self.launch(fkv, &ptrs, Launch { dims, items })
    }

    /// Attention forward on `[b, h, t, d]` operands: `s = q·kᵀ` for every head (batched
    /// GEMM into scratch), the generated masked softmax over all `b·h·tq` rows in place,
    /// `o = s·v` (batched GEMM into the contiguous result).
    fn attention(
        &mut self,
        ins: &[&DLoc],
        out: &DLoc,
        softmax: &str,
        mask: MaskKind,
    ) -> Result<(), String> {
        results_contiguous(std::slice::from_ref(out))?;
        let q = self.blas_ready(ins[0])?;
        let k = self.blas_ready(ins[1])?;
        let v = self.blas_ready(ins[2])?;
        let (m, scale, fill) = if mask == MaskKind::None {
            (None, ins[3], None)
        } else {
            (Some(self.contig(ins[3])?), ins[4], Some(ins[5]))
        };
        let qs = q.shape();
        let (b, h, tq, dk) = (qs[0], qs[1], qs[2], qs[3]);
        let tk = k.shape()[2];
        let dv = v.shape()[3];
        let s = self.alloc(b * h * tq * tk)?;
        self.head_gemms((tq, dk, tk), &heads(&q, 2, 3), &heads(&k, 3, 2), s)?;
        self.softmax_rows(s, softmax, m.as_ref(), scale, fill, (b, h, tq, tk))?;
        let p = scratch_heads(s, b * h, tq, tk, false);
        self.head_gemms((tq, tk, dv), &p, &heads(&v, 2, 3), out.base())
    }

    /// The generated masked scaled softmax over `s[b, h, tq, tk]`, in place.
    fn softmax_rows(
        &self,
        s: u64,
        f: &str,
        mask: Option<&DLoc>,
        scale: &DLoc,
        fill: Option<&DLoc>,
        (b, h, tq, tk): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        let l = Launch::same(rows::scale_mask_softmax_dims(b, h, tq, tk));
        let ptrs = match (mask, fill) {
            (Some(m), Some(fl)) => vec![s, m.base(), scale.base(), fl.base(), s],
            _ => vec![s, scale.base(), s],
        };
        self.launch(f, &ptrs, l)
    }

    /// Attention backward, as the CPU executor: recompute `p`, `dv = pᵀ·g`,
    /// `dp = g·vᵀ`, `ds = softmax_bwd(p, dp)·scale` (zero where masked), `dq = ds·k`,
    /// `dk = dsᵀ·q`, every GEMM batched over the heads.
    fn attention_bwd(
        &mut self,
        ins: &[&DLoc],
        outs: &[DLoc],
        softmax: &str,
        softmax_bwd: &str,
        mask: MaskKind,
    ) -> Result<(), String> {
        results_contiguous(outs)?;
        let q = self.blas_ready(ins[0])?;
        let k = self.blas_ready(ins[1])?;
        let v = self.blas_ready(ins[2])?;
        let (m, g, scale, fill) = if mask == MaskKind::None {
            (None, ins[3], ins[4], None)
        } else {
            (Some(self.contig(ins[3])?), ins[4], ins[5], Some(ins[6]))
        };
        let g = self.blas_ready(g)?;
        let qs = q.shape();
        let (b, h, tq, dk) = (qs[0], qs[1], qs[2], qs[3]);
        let tk = k.shape()[2];
        let dv = v.shape()[3];
        let n = b * h;
        let s = self.alloc(n * tq * tk)?;
        let dp = self.alloc(n * tq * tk)?;
        self.head_gemms((tq, dk, tk), &heads(&q, 2, 3), &heads(&k, 3, 2), s)?;
        self.softmax_rows(s, softmax, m.as_ref(), scale, fill, (b, h, tq, tk))?;
        // dv = pᵀ·g
        let pt = scratch_heads(s, n, tq, tk, true);
        self.head_gemms((tk, tq, dv), &pt, &heads(&g, 2, 3), outs[2].base())?;
        // dp = g·vᵀ
        self.head_gemms((tq, dv, tk), &heads(&g, 2, 3), &heads(&v, 3, 2), dp)?;
        let l = Launch::same(rows::softmax_bwd_dims(n * tq, tk));
        self.launch(softmax_bwd, &[s, dp, scale.base(), dp], l)?;
        if let Some(m) = &m {
            self.zero_masked(dp, m, mask, (b, h, tq, tk))?;
        }
        let ds = scratch_heads(dp, n, tq, tk, false);
        self.head_gemms((tq, tk, dk), &ds, &heads(&k, 2, 3), outs[0].base())?;
        let dst = scratch_heads(dp, n, tq, tk, true);
        self.head_gemms((tk, tq, dk), &dst, &heads(&q, 2, 3), outs[1].base())
    }
}

/// `(b, h, tq, tk, dk, dv)` of attention operands `q [b, h, tq, dk]`, `k [b, h, tk, dk]`,
/// `v [b, h, tk, dv]`.
fn attention_sizes(
    q: &DLoc,
    k: &DLoc,
    v: &DLoc,
) -> Result<(usize, usize, usize, usize, usize, usize), String> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Err(format!(
            "attention takes [b, h, t, d] operands, not {qs:?}, {ks:?}, {vs:?}"
        ));
    }
    Ok((qs[0], qs[1], qs[2], ks[2], qs[3], vs[3]))
}

/// The attention results the batched-GEMM path writes must be contiguous (it writes
/// each head's matrix whole; only the flash kernels take merged heads).
fn results_contiguous(outs: &[DLoc]) -> Result<(), String> {
    match outs.iter().find(|o| !o.layout.is_contiguous()) {
        Some(o) => Err(format!(
            "internal: the batched-GEMM attention writes contiguous results, not {:?}",
            o.layout
        )),
        None => Ok(()),
    }
}

/// [`KernelGraph::heads_merged`] where the kernel runs as flash kernels that write
/// through their results' strides.
fn heads_merged(kg: &KernelGraph, steps: &[Step]) -> std::collections::HashSet<(usize, usize)> {
    let strided: BTreeSet<usize> = steps
        .iter()
        .filter(|s| {
            matches!(
                s.exec,
                StepExec::Attention {
                    flash: Some(_),
                    strided: true,
                    ..
                } | StepExec::AttentionBwd {
                    flash: Some(_),
                    strided: true,
                    ..
                }
            )
        })
        .map(|s| s.value)
        .collect();
    kg.heads_merged()
        .into_iter()
        .filter(|(v, _)| strided.contains(v))
        .collect()
}

/// The element strides of a rank-4 location.
fn strides4(l: &DLoc) -> Result<[usize; 4], String> {
    <[usize; 4]>::try_from(l.layout.strides.as_slice())
        .map_err(|_| format!("a rank-4 operand was expected, not {:?}", l.shape()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An integer input's views read from its host words as the device would give them:
    /// the targets (a column slice), a transposed view, a broadcast; past the buffer is
    /// an error, not a panic.
    #[test]
    fn views_of_an_input_gather_from_its_host_words() {
        // [3, 4] ids: 0..12.
        let host: Vec<u32> = (0..12).collect();
        let full = Layout::contiguous(&[3, 4]);
        assert_eq!(gather_words(&host, &full).unwrap(), host);
        let cols = full.slice(1, 1, 3);
        assert_eq!(
            gather_words(&host, &cols).unwrap(),
            [1, 2, 3, 5, 6, 7, 9, 10, 11]
        );
        let t = full.permute(&[1, 0]);
        assert_eq!(
            gather_words(&host, &t).unwrap(),
            [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
        );
        let row = Layout::contiguous(&[4]).broadcast(&[2, 4]);
        assert_eq!(gather_words(&host, &row).unwrap(), [0, 1, 2, 3, 0, 1, 2, 3]);
        let past = Layout {
            shape: vec![2],
            strides: vec![12],
            offset: 0,
        };
        assert!(gather_words(&host, &past)
            .unwrap_err()
            .contains("element 12"));
        assert!(gather_words(&host, &Layout::contiguous(&[0, 3]))
            .unwrap()
            .is_empty());
        // Rank 0, and views of rank 3 against the element-by-element definition.
        let one = Layout {
            shape: vec![],
            strides: vec![],
            offset: 7,
        };
        assert_eq!(gather_words(&host, &one).unwrap(), [7]);
        let host: Vec<u32> = (0..120).map(|i| i * 3 + 1).collect();
        let cube = Layout::contiguous(&[4, 5, 6]);
        for view in [
            cube.clone(),
            cube.permute(&[2, 0, 1]),
            cube.slice(2, 1, 4).permute(&[1, 0, 2]),
            Layout::contiguous(&[5, 1]).broadcast(&[3, 5, 4]),
        ] {
            let mut want = Vec::new();
            let (sh, st) = (&view.shape, &view.strides);
            for i in 0..sh[0] {
                for j in 0..sh[1] {
                    for k in 0..sh[2] {
                        want.push(host[view.offset + i * st[0] + j * st[1] + k * st[2]]);
                    }
                }
            }
            assert_eq!(gather_words(&host, &view).unwrap(), want, "{view:?}");
        }
    }

    /// bf16 buffers hold two values per word, the first in the low half, rounded to
    /// nearest even as the device's `kiln_f32_to_bf16` and the `half` crate round; an odd
    /// count pads the last word with zero.
    #[test]
    fn bf16_values_pack_two_to_a_word() {
        let v = [1.0f32, -2.0, 1.0 + 1.0 / 256.0, 3.0e38, f32::NAN];
        let w = pack_bf16(v.iter().copied());
        assert_eq!(w.len(), 3);
        assert_eq!(w[0], 0x3f80 | (0xc000 << 16));
        // 1 + 2⁻⁸ is a tie between 1 and 1 + 2⁻⁷: to even, 1.
        assert_eq!(w[1] & 0xffff, 0x3f80);
        assert_eq!(
            w[1] >> 16,
            u32::from(half::bf16::from_f32(3.0e38).to_bits())
        );
        assert_eq!(w[2] >> 16, 0, "the pad");
        let back = unpack_bf16(&w, v.len());
        assert_eq!(&back[..3], &[1.0, -2.0, 1.0]);
        assert_eq!(back[3], half::bf16::from_f32(3.0e38).to_f32());
        assert!(back[4].is_nan());
        assert!(pack_bf16(std::iter::empty()).is_empty());
        assert_eq!((words_of(DType::BF16, 5), words_of(DType::F32, 5)), (3, 5));
        assert_eq!((elem_bytes(DType::BF16), elem_bytes(DType::I32)), (2, 4));
        let l = DLoc {
            ptr: 1000,
            layout: Layout::contiguous(&[2, 3]),
            dtype: DType::BF16,
        };
        assert_eq!(l.at(5), 1010);
    }
}
