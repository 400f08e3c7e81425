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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use kiln_compiler::bind::Source;
use kiln_compiler::codegen::cuda::cast;
use kiln_compiler::codegen::cuda::storage::Storage;
use kiln_compiler::ir::{DType, Graph, NodeId};
use kiln_compiler::optimize::kernels::{Def, KernelGraph};
use kiln_compiler::options::Precision as CompilePrecision;
use kiln_compiler::plan::{LayoutCache, MemoryPlan};
use kiln_compiler::reference::{ExecError, RunOptions};
use kiln_compiler::tensor::{Feeds, Outputs, Tensor};

use super::cuda_available;
use super::device::{self, Buf, Device};
use super::steps::Step;
use crate::artifact::Artifact;
use crate::eager::pool::Pool;
use crate::executor::{Exec, How, Launched, Timing};

mod binding;
mod bound;
mod dloc;
mod entry_run;
mod outputs;
mod phases;
mod program;
mod resident;
mod run;
mod sources;
mod training;

use bound::*;
use dloc::*;
use phases::*;
pub use phases::{GPU_IDLE, HOST_ISSUE};
use program::*;
pub use program::{launch_plan, memory_plan, program_source};
use run::*;

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
        CompilePrecision::Int8 => "int8",
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
            // (A CUDA artifact is never int8: `CompileOptions::check` refuses it.)
            CompilePrecision::F32 | CompilePrecision::Int8 => device::GemmMath::F32,
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

    /// The run state, locked (taken back from a thread that panicked holding it).
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
        self.state().epilogues
    }

    /// How the bias gradients paired with their weight-gradient GEMM ran so far, over
    /// every run: `(fused, separate)` — summed by the GEMM's cuBLASLt epilogue, or by
    /// their own `sum_rows` kernel ([`CudaOptions::separate_bias_grads`] or
    /// `separate_epilogues`, no cuBLASLt algorithm, a single row, or a GEMM that does not
    /// read the output gradient in place).
    pub fn bias_grad_counts(&self) -> (usize, usize) {
        self.state().bias_grads
    }

    /// With `on`, every run records the launches of the launch plan it ran, in order, and
    /// how ([`CudaExecutor::last_launches`]), as the compiled executor does.
    pub fn record_launches(&self, on: bool) {
        let mut guard = self.state();
        guard.launches = on.then(Vec::new);
    }

    /// The launches of the last run ([`CudaExecutor::record_launches`]; empty without).
    pub fn last_launches(&self) -> Vec<Launched> {
        self.state().launches.clone().unwrap_or_default()
    }

    /// Runs so far that bound the views' and kernel results' locations afresh, and that
    /// reused those kept from an earlier run at the same dims (see `Bound`).
    pub fn binding_counts(&self) -> (usize, usize) {
        self.state().binds
    }

    /// The last run's view copies (reshapes of non-contiguous views, copied before their
    /// first reader): how many, and their bytes in all. Attention's results are stored
    /// with their heads merged, so a Transformer's program makes none.
    pub fn view_copies(&self) -> (usize, usize) {
        self.state().view_copies
    }

    /// Bytes of the device arena allocated so far (the memory plan's layout for the
    /// largest dims run; 0 before the first run).
    pub fn arena_bytes(&self) -> usize {
        self.state().arena.as_ref().map_or(0, |a| a.words * 4)
    }

    /// How many bf16 casts of parameter spans the executor keeps for the next run of
    /// the last parameters version (mixed precision or bf16 GEMMs; see `Run::casts`).
    pub fn parameter_casts(&self) -> usize {
        self.state().params.as_ref().map_or(0, |c| c.casts.len())
    }
}

impl Exec for CudaExecutor {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Runs the entry; outputs in `graph.outputs` order.
    fn run(&self, inputs: &Feeds, params: &Feeds, opts: &RunOptions) -> Result<Outputs, ExecError> {
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
    fn run_profiled(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
        rec: &mut dyn FnMut(&Timing<'_>),
    ) -> Result<Outputs, ExecError> {
        Ok(self
            .run_with(inputs, params, opts, Some(rec), None, None)?
            .outputs)
    }

    fn on_device(&self) -> bool {
        true
    }

    fn as_resident(&self) -> Option<&dyn crate::executor::DeviceResident> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eager::value::Layout;

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
