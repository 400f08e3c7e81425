//! The compiled CPU executor: a kernel graph run as JIT-compiled kernels over one arena.
//!
//! In: an entry-point [`Graph`] (for binding and messages), its optimized
//! [`KernelGraph`], the [`MemoryPlan`] and the CPU code ([`CpuCode`]: CLIF functions and
//! which ones each kernel launches), all of which an artifact carries. Out: the graph's
//! outputs as host tensors — the same values as the reference executor's, within the
//! stated tolerances.
//!
//! A run:
//! 1. binds inputs and parameters exactly as every executor does
//!    (`kiln_compiler::bind`), which gives the symbolic dims their values;
//! 2. lays out the arena from the plan for those dims (reused between runs, grown when a
//!    larger batch comes);
//! 3. gives every value a location — a base pointer and a strided layout: sources point
//!    into the caller's tensors (bools converted to the 4-byte form kernels use), views
//!    re-describe their source, kernel results live at their buffer's arena offset;
//! 4. launches the kernels in order: JIT functions split over rows with rayon
//!    ([`launch`](kiln_compiler::codegen::jit::launch)), matrix products through the
//!    `gemm` crate (see `gemm.rs`), and the few primitives without generated code
//!    (gathers, scatters, masks, `arange`, `concat`) through the eager executor's kernels
//!    (see `fallback.rs`);
//! 5. copies the outputs out.
//!
//! Determinism: every kernel splits work by output rows or fixed-size blocks, never by the
//! thread count, so the bits do not depend on how many threads run.

pub(crate) mod arena;
pub(crate) mod fallback;
pub(crate) mod gemm;
pub(crate) mod launch;
mod place;
pub(crate) mod products;
mod run;
mod steps;

pub(crate) use arena::*;
pub use launch::{KernelErrors, RELATIVE_FROM};
pub use products::*;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kiln_compiler::codegen::jit::JitModule;
use kiln_compiler::codegen::program::CpuCode;
use kiln_compiler::ir::{DType, Graph, Op};
use kiln_compiler::launch_plan::LaunchPlan;
use kiln_compiler::optimize::kernels::{Def, KernelGraph, KernelOp};
use kiln_compiler::options::CompileOptions;
use kiln_compiler::pipeline::EntryProgram;
use kiln_compiler::plan::{LayoutCache, MemoryPlan};
use kiln_compiler::reference::{ExecError, RunOptions};
use kiln_compiler::tensor::{Feeds, Outputs, Tensor, TensorData};

use crate::eager::pool::Pool;
use crate::executor::{Launched, Timing};

const EXECUTOR: &str = "the compiled executor";

/// Receives each kernel's kind and seconds.
type Profile<'a> = &'a mut (dyn FnMut(&Timing<'_>) + Send);

/// Runs `f` on one of rayon's worker threads (in place when already on one). A run
/// launches hundreds of kernels, each split over the pool: from a worker, the split goes
/// to its own queue and the worker takes part, where from any other thread every launch
/// is injected into the pool and the caller sleeps until it is done — two futex
/// round-trips per kernel, which cost the demo's small model a third of its speed.
fn on_worker<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// A compiled program's arena, shared by programs that run one at a time (the trainer's
/// training step, validation and decoder; a translator's encoder and decoder step): one
/// arena, as large as the largest layout, serves them all instead of one each. A run
/// that finds the arena taken by another still runs, in an arena of its own.
#[derive(Clone)]
pub struct SharedArena(Arc<Mutex<Vec<f32>>>);

/// A graph compiled for the CPU, ready to run.
pub struct Compiled {
    graph: Graph,
    kg: KernelGraph,
    plan: MemoryPlan,
    /// The plan's layouts by dims.
    layouts: LayoutCache,
    code: CpuCode,
    jit: Arc<JitModule>,
    /// What runs, in order, with the fusions (the compiler's; the artifact's).
    launch: LaunchPlan,
    /// Per kernel launch index: how it runs.
    steps: Vec<launch::Step>,
    /// The generated strided-copy kernel.
    copy: kiln_compiler::codegen::jit::KernelFn,
    /// The arena, possibly shared with programs that never run at the same time as this
    /// one ([`Exec::share_arena`]).
    arena: Arc<Mutex<Vec<f32>>>,
    /// Arenas of runs that found `arena` taken by a concurrent run (decoding workers),
    /// kept for the next such run instead of allocated again every run.
    idle_arenas: Mutex<Vec<Vec<f32>>>,
    /// Buffers of earlier runs' [`Keep`]s.
    scratch: Mutex<Vec<Vec<u32>>>,
    /// The last run's view copies: how many, and their bytes in all.
    view_copies: Mutex<(usize, usize)>,
    /// Output storage handed back by [`Compiled::recycle`], reused by later runs.
    spare: Mutex<Vec<Vec<f32>>>,
    /// Per graph output: the kernel result (value, output) written straight into the
    /// returned tensor's storage, if it is one (f32, not a view, the first output naming
    /// it). Its buffer is left out of the arena.
    direct: Vec<Option<(usize, usize)>>,
    /// Where each kernel result lives: the graph output it is written into, or its
    /// buffer in the plan.
    home: std::collections::HashMap<(usize, usize), Home>,
    /// The attention results stored with their heads merged, `[b, t, h, d]`
    /// ([`KernelGraph::heads_merged`]): the output projection reads them without a copy.
    merged: std::collections::HashSet<(usize, usize)>,
    /// Views of a parameter that a matrix product reads as its right operand (the tied
    /// output projection reads the embedding `[vocab, d]` transposed), and their
    /// contiguous copies (see [`Transposed`]).
    transposed: Mutex<std::collections::HashMap<usize, Transposed>>,
    /// Parameters (or views of one) that a matrix product reads as its right operand, in
    /// an inference program, and their copies packed for the bf16 products (see
    /// [`Compiled::packed_weight`]).
    packed: Mutex<std::collections::HashMap<usize, PackedWeight>>,
    /// Kernel checks (see [`Compiled::from_graph_checked`]).
    checks: Mutex<launch::CheckLog>,
    /// The f32 inputs that only concatenations along a later axis read, directly: a run
    /// can read them with their rows gathered ([`Compiled::run_map_gathered`]).
    gatherable: std::collections::BTreeSet<String>,
    pool: Arc<Pool>,
    /// The kernel of the large matrix products in bf16, f32 sums, if they run so
    /// ([`Compiled::set_bf16_products`]).
    bf16_products: Option<Kernel16>,
    /// [`Compiled::bias_grad_counts`].
    bias_grads: Mutex<(usize, usize)>,
    /// [`Compiled::product_groups`].
    product_groups: Mutex<(usize, usize)>,
    /// Whether runs record their launches ([`Compiled::record_launches`]), and the last
    /// run's.
    tracing: bool,
    trace: Mutex<Vec<Launched>>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Compiled({}, {} kernels, {} functions)",
            self.kg.name,
            self.steps.len(),
            self.jit.len()
        )
    }
}

impl Compiled {
    /// Builds the executor: checks that the kernel graph belongs to `graph` and compiles
    /// every CLIF function of `code` for this machine.
    pub fn new(
        graph: Graph,
        kg: KernelGraph,
        plan: MemoryPlan,
        code: CpuCode,
        launch: LaunchPlan,
    ) -> Result<Compiled, ExecError> {
        Compiled::build(graph, kg, plan, code, launch, false)
    }

    /// [`Compiled::from_graph`] with every generated kernel checked after it runs: its
    /// definition (expanded to primitives) runs on the same operands through the eager
    /// executor and the worst relative error per kernel kind is recorded
    /// ([`Compiled::kernel_errors`]). Slow; for tests.
    pub fn from_graph_checked(graph: Graph) -> Result<Compiled, ExecError> {
        let p = Compiled::lower(&graph, &CompileOptions::default())?;
        Compiled::build(graph, p.kernel_graph, p.plan, p.cpu, p.launch, true)
    }

    /// Per kernel kind, how its kernels compared with their definitions so far
    /// ([`KernelErrors`]: the worst relative error of outputs of magnitude at
    /// least 0.1, the worst absolute error of smaller ones, how many outputs were
    /// checked, how many were outside `1e-5·max|definition| + 1e-6`).
    pub fn kernel_errors(&self) -> BTreeMap<String, KernelErrors> {
        self.checks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The CPU program of `graph`, compiled by the compiler's driver with `opts` (what
    /// `kiln compile --target cpu` writes).
    fn lower(graph: &Graph, opts: &CompileOptions) -> Result<EntryProgram, ExecError> {
        kiln_compiler::pipeline::compile_entry(graph, opts, None)
            .map_err(|e| ExecError::Unsupported(e.to_string()))
    }

    fn build(
        graph: Graph,
        kg: KernelGraph,
        plan: MemoryPlan,
        code: CpuCode,
        launch: LaunchPlan,
        checks: bool,
    ) -> Result<Compiled, ExecError> {
        graph.verify()?;
        let jit = kiln_compiler::codegen::jit::compile(&code.text()).map_err(|e| {
            ExecError::Unsupported(format!("cannot compile the program's kernels: {e}"))
        })?;
        let (steps, copy) =
            launch::prepare(&kg, &launch, &jit, checks).map_err(ExecError::Unsupported)?;
        for (n, _) in &kg.outputs {
            if !graph.outputs.iter().any(|o| &o.name == n) {
                return Err(ExecError::Unsupported(format!(
                    "the program computes `{n}`, which the graph does not declare"
                )));
            }
        }
        let direct = direct_outputs(&graph, &kg);
        if let Some((v, k)) = direct
            .iter()
            .flatten()
            .find(|(v, k)| plan.buffer_of(*v, *k).is_none())
        {
            return Err(ExecError::Unsupported(format!(
                "the memory plan has no buffer for output {k} of kernel value %{v}"
            )));
        }
        let external = plan.output_buffers(&kg);
        let mut home: std::collections::HashMap<(usize, usize), Home> = plan
            .buffers
            .iter()
            .enumerate()
            .map(|(b, buf)| ((buf.value, buf.output), Home::Arena(b)))
            .collect();
        for (i, d) in direct.iter().enumerate() {
            if let Some(vk) = d {
                home.insert(*vk, Home::Output(i));
                // The buffers the output is written in place of live in its storage too
                // (when the layout keeps them out of the arena).
                if let Some(b) = plan.buffer_of(vk.0, vk.1) {
                    for c in plan.chain(b).into_iter().filter(|&c| external[c]) {
                        let buf = &plan.buffers[c];
                        home.insert((buf.value, buf.output), Home::Output(i));
                    }
                }
            }
        }
        // Inference only: a training step reads every weight transposed in its backward
        // pass, and copying them all would cost what it saves (and their size again).
        let training = graph.outputs.iter().any(|o| o.name.starts_with("grad."));
        let transposed = weight_operands(&kg, &steps, true)
            .into_iter()
            .filter(|_| !training)
            .map(|v| (v, Transposed::default()))
            .collect();
        let packed = weight_operands(&kg, &steps, false)
            .into_iter()
            .filter(|_| !training)
            .map(|v| (v, PackedWeight::default()))
            .collect();
        let gatherable = gatherable_inputs(&kg);
        let merged = kg
            .heads_merged()
            .into_iter()
            .filter(|vk| matches!(home.get(vk), Some(Home::Arena(_))))
            .collect();
        Ok(Compiled {
            gatherable,
            merged,
            graph,
            kg,
            plan,
            transposed: Mutex::new(transposed),
            packed: Mutex::new(packed),
            layouts: LayoutCache::with_external(external),
            direct,
            home,
            code,
            jit: Arc::new(jit),
            launch,
            steps,
            copy,
            arena: Arc::new(Mutex::new(Vec::new())),
            idle_arenas: Mutex::new(Vec::new()),
            scratch: Mutex::new(Vec::new()),
            view_copies: Mutex::new((0, 0)),
            spare: Mutex::new(Vec::new()),
            checks: Mutex::new(BTreeMap::new()),
            pool: Arc::new(Pool::with_limit(
                crate::eager::pool::COMPILED_POOL_MAX_BYTES,
            )),
            bf16_products: default_products(),
            bias_grads: Mutex::new((0, 0)),
            product_groups: Mutex::new((0, 0)),
            tracing: false,
            trace: Mutex::new(Vec::new()),
        })
    }

    /// The product groups of the launch plan that ran as one (with 16-bit products, each
    /// packs its left operand once, with the bits each product would give on its own),
    /// over every run so far: `(groups, kernels in them)`.
    pub fn product_groups(&self) -> (usize, usize) {
        *self
            .product_groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// How the bias gradients paired with a weight-gradient product ran, over every run so
    /// far: `(summed, separate)` — summed by the product as it packed `dy`, or by their own
    /// `sum_rows` kernel (f32 products, a product
    /// that does not read `dy` in place as its rows, or one too small for 16 bits).
    pub fn bias_grad_counts(&self) -> (usize, usize) {
        *self.bias_grads.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the large matrix products (`matmul`, `linear`; not attention's per-head
    /// products) with 16-bit operands: rounded to bf16 with their sums in f32, on the AMX
    /// tiles of Intel Xeons of the 4th generation on, or with AVX-512's `VDPBF16PS` on AMD
    /// Zen 4 and later; else, where the CPU has AVX512-FP16 (Intel Xeons whose VM hides
    /// AMX), scaled into fp16 with sums of 64 terms in fp16 added up in f32 ([`Kernel16::Half`]).
    /// `--gemm-type 16bit` sets it for every executor a process builds. Mixed precision,
    /// as a GPU's `--precision mixed`: everything else stays f32. An error where the CPU
    /// has none of them.
    pub fn set_bf16_products(&mut self, on: bool) -> Result<(), ExecError> {
        if on {
            let kernel = Kernel16::best()
                .map_err(|why| ExecError::Unsupported(format!("{why}; run the products in f32")))?;
            self.set_bf16_kernel(Some(kernel))
        } else {
            self.set_bf16_kernel(None)
        }
    }

    /// Runs the large matrix products in bf16 with `kernel`'s instructions (`None`: in
    /// f32), as [`Compiled::set_bf16_products`] does with the kernel it chooses. An error
    /// where the CPU cannot run the kernel.
    pub fn set_bf16_kernel(&mut self, kernel: Option<Kernel16>) -> Result<(), ExecError> {
        if let Some(kernel) = kernel {
            kernel
                .available()
                .map_err(|why| ExecError::Unsupported(format!("{why}; run the products in f32")))?;
        }
        self.bf16_products = kernel;
        Ok(())
    }

    /// Whether the large matrix products run in bf16 ([`Compiled::set_bf16_products`]).
    pub fn bf16_products(&self) -> bool {
        self.bf16_products.is_some()
    }

    /// The instructions of the bf16 products, where they run in bf16.
    pub fn bf16_kernel(&self) -> Option<Kernel16> {
        self.bf16_products
    }

    /// Optimizes `graph` for the CPU, plans it, generates its code and builds the
    /// executor — what `kiln compile` + loading the artifact do, in one process.
    pub fn from_graph(graph: Graph) -> Result<Compiled, ExecError> {
        Compiled::from_graph_with(graph, &CompileOptions::default())
    }

    /// [`Compiled::from_graph`] with the compiler's options `opts` (whose target must be
    /// `cpu`): without product groups or bias-gradient fusion, say, for comparisons.
    pub fn from_graph_with(graph: Graph, opts: &CompileOptions) -> Result<Compiled, ExecError> {
        let p = Compiled::lower(&graph, opts)?;
        Compiled::new(graph, p.kernel_graph, p.plan, p.cpu, p.launch)
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn kernel_graph(&self) -> &KernelGraph {
        &self.kg
    }

    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    pub fn code(&self) -> &CpuCode {
        &self.code
    }

    /// What runs, in order ([`LaunchPlan`]).
    pub fn launch_plan(&self) -> &LaunchPlan {
        &self.launch
    }

    /// With `on`, every run records the launches it ran, in order, and how
    /// ([`Compiled::last_launches`]): what checks that the executor replays its launch
    /// plan.
    pub fn record_launches(&mut self, on: bool) {
        self.tracing = on;
    }

    /// The launches of the last run ([`Compiled::record_launches`]).
    pub fn last_launches(&self) -> Vec<Launched> {
        self.trace.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether [`Compiled::run_map_gathered`] can read input `name` with its rows gathered:
    /// an f32 input that only concatenations along a later axis read (a decoder's
    /// key/value caches).
    pub fn folds_row_gather(&self, name: &str) -> bool {
        self.gatherable.contains(name)
    }

    /// Runs the program and returns every value of the kernel graph (a debugging aid:
    /// compile with `--no-buffer-reuse` so that no buffer is overwritten before the end).
    pub fn run_all_values(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
    ) -> Result<Vec<Vec<Tensor>>, ExecError> {
        let mut dump = Vec::new();
        on_worker(|| self.run_inner(inputs, params, opts, None, Some(&mut dump), None))?;
        Ok(dump)
    }

    /// Bytes of the shared arena: the memory plan's layout at the largest dims run so far
    /// (0 before the first run).
    pub fn arena_bytes(&self) -> usize {
        arena_len(&self.arena.lock().unwrap_or_else(|p| p.into_inner())) * 4
    }

    /// Bytes held between runs outside the arena: the buffers the last run used for
    /// converted inputs, view copies and kernel scratch, kept for the next run. Copies
    /// and scratch are freed after their last reader, so this is what was live at once,
    /// not the sum of every copy ([`Compiled::view_copies`]).
    pub fn scratch_bytes(&self) -> usize {
        self.scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|b| b.capacity() * 4)
            .sum()
    }

    /// Checks what a run at `dims` is about to allocate — the arena's growth from
    /// `held` to `arena` bytes, and its outputs less the recycled storage there is —
    /// against what the machine leaves this process ([`kiln_compiler::memory`]): a batch
    /// too large for the machine is an error that says so, not an abort or a kill.
    fn ensure_memory(
        &self,
        dims: &BTreeMap<String, i64>,
        arena: usize,
        held: usize,
    ) -> Result<(), ExecError> {
        let outputs: u64 = self
            .graph
            .outputs
            .iter()
            .filter_map(|o| self.graph.node(o.node).ty.shape.eval(dims).ok())
            .map(|s| {
                s.iter()
                    .try_fold(4u64, |a, &d| a.checked_mul(d as u64))
                    .unwrap_or(u64::MAX)
            })
            .fold(0u64, u64::saturating_add);
        let recycled: u64 = self
            .spare
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|v| v.len() as u64 * 4)
            .sum();
        let need =
            (arena.saturating_sub(held) as u64).saturating_add(outputs.saturating_sub(recycled));
        kiln_compiler::memory::ensure(
            need,
            || {
                let at: Vec<String> = dims.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!(
                    "running `{}` at {} (arena {}, outputs {})",
                    self.kg.name,
                    at.join(", "),
                    kiln_compiler::memory::size(arena as u64),
                    kiln_compiler::memory::size(outputs)
                )
            },
            || {
                "run smaller batches (fewer sentences or tokens per batch) or shorter sequences"
                    .into()
            },
        )?;
        Ok(())
    }

    /// The last run's copies of non-contiguous views that a reshape reads (which the
    /// memory plan does not place): how many, and their bytes in all.
    pub fn view_copies(&self) -> (usize, usize) {
        *self.view_copies.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many transposed weight copies the program holds (see `Compiled::weight_copy`:
    /// an inference program run on a `params_version` makes them).
    pub fn weight_copies(&self) -> usize {
        self.transposed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|t| t.copy.is_some())
            .count()
    }

    /// The weights the program holds packed for its bf16 products (see
    /// `Compiled::packed_weight`: an inference program run in bf16 on a `params_version`
    /// packs them): how many, and their bytes in all.
    pub fn packed_weights(&self) -> (usize, usize) {
        let cache = self.packed.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .values()
            .filter_map(|w| w.copy.as_ref())
            // An int16 packing of a weight that cannot be quantized holds nothing.
            .filter(|r| r.bytes() > 0)
            .fold((0, 0), |(n, bytes), r| (n + 1, bytes + r.bytes()))
    }

    /// Hands output tensors of an earlier run back: later runs store outputs of the same
    /// sizes in their storage instead of fresh allocations (for a training step's
    /// gradients, a fresh 250 MB is page-faulted in on every step otherwise). Tensors of
    /// other types or small ones are dropped. Storage no output of the next run takes is
    /// freed then.
    pub fn recycle(&self, tensors: impl IntoIterator<Item = Tensor>) {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        for t in tensors {
            if let TensorData::F32(v) = t.data {
                if v.len() >= RECYCLE_MIN {
                    spare.push(v);
                }
            }
        }
    }

    /// [`Compiled::run`], reporting each kernel's kind, seconds and (for a matrix
    /// product) shape to `profile`.
    pub fn run_profiled(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
        profile: &mut (dyn FnMut(&Timing<'_>) + Send),
    ) -> Result<Outputs, ExecError> {
        on_worker(|| self.run_inner(inputs, params, opts, Some(profile), None, None))
    }

    /// A contiguous copy of the transposed weight view `v` (at `loc`), when this run
    /// promises unchanged parameters (`params_version`): products read it row by row
    /// instead of with a stride of the model width. The copy is made by the first run of
    /// a version and kept for the version's later runs, so every run of a version — a
    /// decoder's steps, whichever batch or worker they decode, a validation pass — reads
    /// the same operand and gives the same bits (the `gemm` crate picks other kernels for
    /// a strided right operand, rounding differently). Only inference programs have such
    /// views (a training step reads every weight transposed; copying them all each step
    /// would cost what it saves).
    fn weight_copy(&self, v: usize, loc: &Loc, version: Option<u64>) -> Option<Arc<Vec<f32>>> {
        let version = version?;
        if loc.is_contiguous() || loc.dtype != DType::F32 || loc.shape().len() != 2 {
            return None;
        }
        let mut cache = self.transposed.lock().unwrap_or_else(|p| p.into_inner());
        Some(cache.get_mut(&v)?.get(version, || {
            let mut c = zeroed(loc.numel());
            launch::copy_with(self.copy, loc, c.as_mut_ptr() as *mut u8);
            c
        }))
    }

    /// Weight `v` (at `loc`, `[k, n]`) packed for the bf16 products, when this run
    /// promises unchanged parameters (`params_version`), as [`Compiled::weight_copy`]
    /// keeps a transposed copy: packed by the first bf16 product of a version and read by
    /// every later one of that version, so a decoder's steps and a repeated forward pass
    /// round and lay out each weight once, not once a product. The same bf16 values as
    /// packing it for each product, so the same bits. Only inference programs (a training
    /// step changes its weights every step).
    fn packed_weight(
        &self,
        v: usize,
        loc: &Loc,
        version: Option<u64>,
    ) -> Option<Arc<kiln_matmul::float16::PackedRhs>> {
        let version = version?;
        let shape = loc.shape();
        let kernel = self.bf16_products?;
        if loc.dtype != DType::F32 || shape.len() != 2 {
            return None;
        }
        let mut cache = self.packed.lock().unwrap_or_else(|p| p.into_inner());
        let packed = cache.get_mut(&v)?.get(version, || {
            let b = kiln_matmul::Mat {
                ptr: (loc.ptr as *const f32).wrapping_add(loc.layout.offset),
                rs: loc.layout.strides[0] as isize,
                cs: loc.layout.strides[1] as isize,
            };
            // SAFETY: a kernel is set only after its check; `loc` addresses the weight's
            // `k × n` elements, which stay unchanged while the version does.
            unsafe { kiln_matmul::float16::PackedRhs::new(kernel, (shape[0], shape[1]), b) }
        });
        // Parameters of another shape under the same version (a caller breaking the
        // version's promise), or a copy packed for another kernel, are read as they are,
        // not through a copy of the wrong size or values.
        packed.is(kernel, (shape[0], shape[1])).then_some(packed)
    }
}

/// Inputs read with their rows gathered, and the rows ([`Compiled::run_map_gathered`]).
type Gather<'a> = (&'a std::collections::BTreeSet<String>, &'a [usize]);

/// The f32 inputs of `kg` that only concatenations along an axis after the first read,
/// each as a direct operand (not through a view), and that no output returns.
fn gatherable_inputs(kg: &KernelGraph) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    'inputs: for (v, val) in kg.values.iter().enumerate() {
        let Def::Input(name) = &val.def else { continue };
        if val.types[0].dtype != DType::F32 || kg.outputs.iter().any(|(_, o)| *o == v) {
            continue;
        }
        let mut read = false;
        for other in &kg.values {
            match &other.def {
                Def::View(_, x) | Def::Proj(x, _) if *x == v => continue 'inputs,
                Def::Kernel { op, inputs, .. } if inputs.contains(&v) => match op {
                    KernelOp::Prim(Op::Concat { axis }) if *axis >= 1 => read = true,
                    _ => continue 'inputs,
                },
                _ => {}
            }
        }
        if read {
            out.insert(name.clone());
        }
    }
    out
}

impl crate::executor::Exec for Compiled {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Runs the program; outputs in `graph.outputs` order.
    fn run(&self, inputs: &Feeds, params: &Feeds, opts: &RunOptions) -> Result<Outputs, ExecError> {
        on_worker(|| self.run_inner(inputs, params, opts, None, None, None))
    }

    fn recycle(&self, tensors: Vec<Tensor>) {
        Compiled::recycle(self, tensors)
    }

    fn folds_row_gather(&self, name: &str) -> bool {
        Compiled::folds_row_gather(self, name)
    }

    /// [`Exec::run_map`] with each input named in `gathered` read as if it were
    /// `decode::take_rows(t, rows)` — its rows along axis 0 in the order `rows` — without
    /// that copy: the concatenations reading it copy each row from its source row. Every
    /// name must be one [`Compiled::folds_row_gather`] accepts, and every row index must
    /// be inside its tensor.
    fn run_map_gathered(
        &self,
        inputs: &Feeds,
        gathered: &std::collections::BTreeSet<String>,
        rows: &[usize],
        params: &Feeds,
        opts: &RunOptions,
    ) -> Result<BTreeMap<String, Tensor>, ExecError> {
        let gather = (!gathered.is_empty()).then_some((gathered, rows));
        let outputs = on_worker(|| self.run_inner(inputs, params, opts, None, None, gather))?;
        Ok(outputs.into_iter().collect())
    }

    fn set_product_kernel(&mut self, kernel: Option<Kernel16>) -> Result<(), ExecError> {
        self.set_bf16_kernel(kernel)
    }

    fn arena(&self) -> Option<SharedArena> {
        Some(SharedArena(Arc::clone(&self.arena)))
    }

    fn share_arena(&mut self, arena: &SharedArena) {
        self.arena = Arc::clone(&arena.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::plan::ALIGN;

    #[test]
    fn gemm_type_names_round_trip() {
        for name in GemmType::NAMES {
            let t = GemmType::parse(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(t.name(), name);
        }
        assert_eq!(
            GemmType::parse("int16"),
            Some(GemmType::Kernel(Kernel16::Int16))
        );
        assert_eq!(
            GemmType::parse("int8"),
            Some(GemmType::Kernel(Kernel16::Int8))
        );
        assert_eq!(GemmType::parse("16bit"), Some(GemmType::Best16));
        for other in ["", "1", "bf16", "int4", "F32"] {
            assert_eq!(GemmType::parse(other), None, "{other}");
        }
        assert_eq!(GemmType::F32.kernel(), Ok(None));
    }

    #[test]
    fn arenas_start_their_plans_on_a_cache_line_whatever_the_allocation() {
        let mut v = vec![0f32; 64];
        let start = v.as_ptr() as usize;
        // Every 4-byte start a slice can have against a 64-byte line.
        for shift in 0..16 {
            let arena = &mut v[shift..];
            let from = arena.as_ptr() as usize;
            let base = aligned_base(arena) as usize;
            assert_eq!(base % ALIGN, 0, "shift {shift}");
            assert!(base >= from && base < from + ALIGN, "shift {shift}");
            assert!(
                base + arena_len(arena) * 4 <= start + 64 * 4,
                "shift {shift}"
            );
        }
        assert_eq!(arena_len(&v), 48);
        assert_eq!(arena_len(&v[60..]), 0);
    }
}
