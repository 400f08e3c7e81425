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

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) mod bf16;
/// The bf16 kernels are written for x86-64 (AMX tiles, whose state is requested from
/// Linux, and AVX-512's `VDPBF16PS`): elsewhere the bf16 products are never available,
/// and `gemm` is never reached.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
#[allow(dead_code)] // The real module's interface, which only its callers there read.
pub(crate) mod bf16 {
    pub(crate) use super::gemm::{Epilogue, Member};
    pub(crate) use super::Bf16Kernel as Kernel;

    const WHY: &str = "kiln's bf16 products run only on x86-64 CPUs under Linux";

    pub(crate) fn kernel() -> Result<Kernel, String> {
        Err(WHY.to_string())
    }

    pub(crate) fn tiles_available() -> Result<(), &'static str> {
        Err(WHY)
    }

    pub(crate) fn dot_available() -> Result<(), &'static str> {
        Err(WHY)
    }

    pub(crate) fn half_available() -> Result<(), &'static str> {
        Err(WHY)
    }

    /// Never made: no kernel is available.
    pub(crate) struct PackedRhs;

    impl PackedRhs {
        /// # Safety
        /// Never called: no kernel is available.
        pub(crate) unsafe fn new(_: Kernel, _: (usize, usize), _: super::gemm::Mat) -> PackedRhs {
            unreachable!("bf16 products are only set where a bf16 kernel is available")
        }

        pub(crate) fn is(&self, _: Kernel, _: (usize, usize)) -> bool {
            false
        }

        pub(crate) fn bytes(&self) -> usize {
            0
        }
    }

    #[derive(Clone, Copy)]
    pub(crate) enum Rhs<'a> {
        Mat(super::gemm::Mat),
        Packed(&'a PackedRhs, super::gemm::Mat),
    }

    /// # Safety
    /// Never called: no kernel is available.
    pub(crate) unsafe fn gemm_group(
        _: Kernel,
        _: (usize, usize),
        _: super::gemm::Mat,
        _: &[Member<'_>],
    ) {
        unreachable!("bf16 products are only set where a bf16 kernel is available")
    }

    /// # Safety
    /// Never called: no kernel is available.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm(
        _: Kernel,
        _: (usize, usize, usize),
        _: *mut f32,
        _: isize,
        _: super::gemm::Mat,
        _: Rhs<'_>,
        _: bool,
        _: Epilogue,
        _: Option<super::gemm::ColumnSums>,
    ) {
        unreachable!("bf16 products are only set where a bf16 kernel is available")
    }
}

pub(crate) mod fallback;
pub(crate) mod gemm;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) mod int16;
pub(crate) mod launch;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) mod small;

pub use launch::{KernelErrors, RELATIVE_FROM};

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kiln_compiler::bind::{Binder, Source};
use kiln_compiler::codegen::jit::JitModule;
use kiln_compiler::codegen::program::CpuCode;
use kiln_compiler::ir::{DType, Graph, Op};
use kiln_compiler::launch_plan::LaunchPlan;
use kiln_compiler::optimize::kernels::{Def, KernelGraph, KernelOp};
use kiln_compiler::options::CompileOptions;
use kiln_compiler::pipeline::EntryProgram;
use kiln_compiler::plan::{direct_output, LayoutCache, MemoryPlan, ALIGN};
use kiln_compiler::reference::{ExecError, Precision, RunOptions};
use kiln_compiler::tensor::{Tensor, TensorData};

use crate::eager::pool::Pool;
use crate::eager::value::Layout;
use crate::exec::{How, Launched, Product, Timing};

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

/// The instructions that multiply in 16 bits (operands rounded to bf16 or scaled into
/// fp16) where the large matrix products run in 16 bits (`--gemm-type`,
/// [`Compiled::set_bf16_products`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// Intel AMX tiles (`TDPBF16PS`): Xeons of the 4th generation on.
    Tiles,
    /// AVX-512's `VDPBF16PS`: fast on AMD Zen 4 and later.
    Dot,
    /// AVX512-FP16's `VFMADD231PH`: fp16 operands (each row of the left one and column
    /// of the right one scaled by a power of two, so that no sum overflows) and sums of
    /// 64 terms in fp16, added up in f32; Intel Xeons of the 4th generation on, where
    /// it multiplies-adds at twice the rate of f32 FMAs (for VMs that hide their AMX).
    Half,
    /// AVX2's `VPMADDWD`: int16 operands (each row of the left one and column of the right
    /// one scaled by a power of two into ±4095 and rounded) and sums of 128 terms in int32,
    /// added up in f32; CPUs without AVX-512 (AMD Zen 2 and 3), where it multiplies-adds
    /// at about 1.75 times the rate of f32 FMAs. With the other kernels' driver features:
    /// groups of one left operand, column sums, weights packed beforehand, the bias and
    /// ReLU epilogue.
    Int16,
}

impl Bf16Kernel {
    /// Every kernel, available here or not.
    pub const ALL: [Bf16Kernel; 4] = [
        Bf16Kernel::Tiles,
        Bf16Kernel::Dot,
        Bf16Kernel::Half,
        Bf16Kernel::Int16,
    ];

    /// The instructions' name, for messages and benchmark labels.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Kernel::Tiles => "AMX tiles",
            Bf16Kernel::Dot => "AVX-512 VDPBF16PS",
            Bf16Kernel::Half => "AVX512-FP16 VFMADD231PH",
            Bf16Kernel::Int16 => "AVX2 VPMADDWD (int16)",
        }
    }

    /// Its name for `--gemm-type` and `train.gemm_type`.
    pub fn key(self) -> &'static str {
        match self {
            Bf16Kernel::Tiles => "amx",
            Bf16Kernel::Dot => "dot",
            Bf16Kernel::Half => "fp16",
            Bf16Kernel::Int16 => "int16",
        }
    }

    /// `Ok` where this CPU (and system) can run the kernel, fast or not; else why not.
    pub fn available(self) -> Result<(), String> {
        match self {
            Bf16Kernel::Tiles => bf16::tiles_available(),
            Bf16Kernel::Dot => bf16::dot_available(),
            Bf16Kernel::Half => bf16::half_available(),
            Bf16Kernel::Int16 => int16_available(),
        }
        .map_err(|why| format!("{} cannot run here: {why}", self.name()))
    }

    /// The kernel this CPU runs best: the tiles where there are tiles, else `VDPBF16PS`
    /// where it is faster than f32 products, else `VFMADD231PH` where there is
    /// AVX512-FP16, else `VPMADDWD` where there is AVX2 but no AVX-512; else why there is
    /// none, as a sentence.
    pub fn best() -> Result<Bf16Kernel, String> {
        bf16::kernel().or_else(|why| match int16_faster_than_f32() {
            Ok(()) => Ok(Bf16Kernel::Int16),
            Err(int16) => Err(format!(
                "16-bit matrix products need AMX tiles, fast AVX-512 bf16 dot products, \
                 AVX512-FP16 or AVX2 without AVX-512: {why}, and {int16}"
            )),
        })
    }

    /// Whether the kernel sums in int32 ([`Bf16Kernel::Int16`]: `int16`'s driver).
    #[cfg_attr(
        not(all(target_arch = "x86_64", target_os = "linux")),
        allow(dead_code)
    )]
    pub(crate) fn is_int16(self) -> bool {
        self == Bf16Kernel::Int16
    }
}

/// How the compiled executor runs its large matrix products (`matmul`, `linear`): in f32,
/// or with 16-bit operands on one of the [`Bf16Kernel`]s. `kiln … --gemm-type` and
/// `train.gemm_type` choose it, as Marian's `--gemm-type` and fairseq's `--bf16` do (f32
/// where neither does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmType {
    /// f32 operands and sums: the compiled executor's default.
    F32,
    /// The best 16-bit kernel this CPU has ([`Bf16Kernel::best`]).
    Best16,
    /// This kernel, where the CPU can run it, fast or not (for measuring).
    Kernel(Bf16Kernel),
}

impl GemmType {
    /// The names [`GemmType::parse`] takes, for `--gemm-type` and `train.gemm_type`.
    pub const NAMES: [&'static str; 6] = ["f32", "16bit", "amx", "dot", "fp16", "int16"];

    /// `f32`, `16bit` (the best 16-bit kernel), or a kernel's [key](Bf16Kernel::key).
    pub fn parse(name: &str) -> Option<GemmType> {
        match name {
            "f32" => Some(GemmType::F32),
            "16bit" => Some(GemmType::Best16),
            _ => Bf16Kernel::ALL
                .into_iter()
                .find(|k| k.key() == name)
                .map(GemmType::Kernel),
        }
    }

    /// The name [`GemmType::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            GemmType::F32 => "f32",
            GemmType::Best16 => "16bit",
            GemmType::Kernel(k) => k.key(),
        }
    }

    /// The kernel it runs on this CPU (`None`: f32), or why it cannot run here.
    pub fn kernel(self) -> Result<Option<Bf16Kernel>, String> {
        match self {
            GemmType::F32 => Ok(None),
            GemmType::Best16 => Bf16Kernel::best().map(Some),
            GemmType::Kernel(k) => k.available().map(|()| Some(k)),
        }
    }
}

/// The products of the compiled executors this process builds, where
/// [`set_process_gemm_type`] chose them.
static PROCESS_GEMM: Mutex<Option<Option<Bf16Kernel>>> = Mutex::new(None);

/// Makes every compiled executor this process builds from now on run its large products
/// as `t` says (what the CLI's `--gemm-type` does). Returns
/// the kernel (`None`: f32), or why this CPU cannot run it, and then changes nothing.
pub fn set_process_gemm_type(t: GemmType) -> Result<Option<Bf16Kernel>, String> {
    let kernel = t.kernel()?;
    *PROCESS_GEMM.lock().unwrap_or_else(|p| p.into_inner()) = Some(kernel);
    Ok(kernel)
}

/// What a new compiled executor runs its large products with (`None`: f32): the
/// process's choice ([`set_process_gemm_type`]), else f32.
pub fn default_products() -> Option<Bf16Kernel> {
    PROCESS_GEMM
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .flatten()
}

/// Whether this CPU runs [`Bf16Kernel::Int16`].
fn int16_available() -> Result<(), &'static str> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return int16::available();
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    Err("kiln's int16 products run only on x86-64 CPUs under Linux")
}

/// Whether [`Bf16Kernel::Int16`] runs here and faster than f32 products.
fn int16_faster_than_f32() -> Result<(), &'static str> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return int16::faster_than_f32();
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    Err("kiln's int16 products run only on x86-64 CPUs under Linux")
}

/// `c[m × n] = a[m × k]·b[k × n]` (row-major, contiguous) with the operands rounded to
/// bf16 and the sums in f32 (scaled into fp16 or int16 for those kernels), with `kernel`'s
/// instructions: the products that
/// `--gemm-type 16bit` runs (see [`Compiled::set_bf16_products`]), for benchmarks and for
/// users' own products. An error where the CPU cannot run the kernel, or where a slice's
/// length is not its matrix's.
pub fn bf16_matmul(
    kernel: Bf16Kernel,
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) -> Result<(), String> {
    kernel.available()?;
    for (name, len, want) in [
        ("a", a.len(), m.checked_mul(k)),
        ("b", b.len(), k.checked_mul(n)),
        ("c", c.len(), m.checked_mul(n)),
    ] {
        let Some(want) = want else {
            return Err(format!("a {m}×{k}·{k}×{n} product is too large to address"));
        };
        if len != want {
            return Err(format!(
                "`{name}` holds {len} elements; a {m}×{k}·{k}×{n} product needs {want}"
            ));
        }
    }
    let mat = |p: &[f32], cols: usize| gemm::Mat {
        ptr: p.as_ptr(),
        rs: cols as isize,
        cs: 1,
    };
    // SAFETY: the kernel can run; the slices hold the matrices (checked above) and `c`, a
    // unique borrow, overlaps neither operand.
    unsafe {
        bf16::gemm(
            kernel,
            (m, k, n),
            c.as_mut_ptr(),
            n as isize,
            mat(a, k),
            bf16::Rhs::Mat(mat(b, n)),
            false,
            bf16::Epilogue::default(),
            None,
        )
    };
    Ok(())
}

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
    /// one ([`Compiled::share_arena_with`]).
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
    /// can read them with their rows gathered ([`Compiled::run_gathered`]).
    gatherable: std::collections::BTreeSet<String>,
    pool: Arc<Pool>,
    /// The kernel of the large matrix products in bf16, f32 sums, if they run so
    /// ([`Compiled::set_bf16_products`]).
    bf16_products: Option<Bf16Kernel>,
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

/// A copy of a weight made for one parameters version (a transposed view's contiguous
/// copy, a weight packed for the bf16 products), by the first run of the version that
/// needs it, for the version's later runs.
struct Versioned<T> {
    /// The `params_version` of the last run that read the weight.
    version: Option<u64>,
    /// The copy, made by the first run of that version that needed it.
    copy: Option<Arc<T>>,
}

impl<T> Default for Versioned<T> {
    fn default() -> Self {
        Versioned {
            version: None,
            copy: None,
        }
    }
}

impl<T> Versioned<T> {
    /// The copy for `version`: the one kept, or `make`'s (dropping an older version's).
    fn get(&mut self, version: u64, make: impl FnOnce() -> T) -> Arc<T> {
        if self.version != Some(version) {
            self.version = Some(version);
            self.copy = None;
        }
        self.copy.get_or_insert_with(|| Arc::new(make())).clone()
    }
}

/// A transposed weight view's contiguous copy.
type Transposed = Versioned<Vec<f32>>;

/// A weight packed for the bf16 products.
type PackedWeight = Versioned<bf16::PackedRhs>;

/// The values that matrix products read as their right operand (`x·w`, `x·w + b`) and
/// that are a parameter or a view of one: with `views_only`, only the views (those a
/// transposed copy can serve, see `Compiled::weight_copy`); else the parameters read as
/// they are too (those the bf16 products can pack once, see `Compiled::packed_weight`).
fn weight_operands(kg: &KernelGraph, steps: &[launch::Step], views_only: bool) -> Vec<usize> {
    let mut out: Vec<usize> = steps
        .iter()
        .filter(|s| matches!(s.exec, launch::Exec::Matmul | launch::Exec::Linear { .. }))
        .filter_map(|s| s.inputs.get(1).copied())
        .filter(|&w| {
            let mut v = w;
            loop {
                match &kg.values[v].def {
                    Def::View(Op::Permute { .. } | Op::Reshape { .. }, x) => v = *x,
                    Def::Param(_) => return !views_only || v != w,
                    _ => return false,
                }
            }
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Where a kernel result is stored during a run.
#[derive(Clone, Copy, Debug)]
enum Home {
    /// In the arena, as buffer `b` of the memory plan.
    Arena(usize),
    /// In the storage of graph output `i` (see `Compiled::direct`).
    Output(usize),
}

/// Where a value's elements are during a run.
#[derive(Clone, Debug)]
pub(crate) struct Loc {
    pub ptr: *mut u8,
    pub layout: Layout,
    pub dtype: DType,
}

// SAFETY: a run's locations point into memory the run owns or borrows for its duration;
// kernels that share them across threads write disjoint elements.
unsafe impl Send for Loc {}
unsafe impl Sync for Loc {}

impl Loc {
    /// Element `offset + i` as a pointer (4-byte elements).
    pub fn at(&self, elem: usize) -> *mut u8 {
        self.ptr.wrapping_add(4 * elem)
    }

    /// The pointer to the first element of the layout.
    pub fn base(&self) -> *mut u8 {
        self.at(self.layout.offset)
    }

    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// One past the largest element offset the layout reaches.
    pub fn extent(&self) -> usize {
        if self.numel() == 0 {
            return self.layout.offset;
        }
        self.layout.offset
            + self
                .layout
                .shape
                .iter()
                .zip(&self.layout.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }
}

/// Memory a run owns besides the arena: converted inputs, constants, copies of strided
/// views, kernels' scratch. Buffers come from (and go back to) a pool kept between runs,
/// so a run does not page-fault fresh memory in for every copy; a buffer handed back
/// during the run ([`Keep::release_since`], [`Keep::give_back`]) serves later requests of
/// the same run.
#[derive(Default)]
pub(crate) struct Keep {
    /// In use until the run ends (or until released).
    bufs: Vec<Vec<u32>>,
    /// Free, handed back during this run.
    free: Vec<Vec<u32>>,
    /// Free, left by earlier runs; what this run does not take is dropped at its end, so
    /// the pool never holds more than one run used.
    old: Vec<Vec<u32>>,
}

impl Keep {
    /// A keep whose requests are served first from `pool` (an earlier run's buffers).
    fn with_pool(pool: Vec<Vec<u32>>) -> Keep {
        Keep {
            bufs: Vec::new(),
            free: Vec::new(),
            old: pool,
        }
    }

    /// A buffer of at least `n` 4-byte elements (contents unspecified), owned by the
    /// caller: the smallest free one that holds `n`, else a fresh one.
    fn take(&mut self, n: usize) -> Vec<u32> {
        let n = n.max(1);
        let best = |v: &Vec<Vec<u32>>| {
            v.iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= n)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, b)| (i, b.capacity()))
        };
        let mut b = match (best(&self.free), best(&self.old)) {
            (Some((i, a)), Some((_, o))) if a <= o => self.free.swap_remove(i),
            (_, Some((j, _))) => self.old.swap_remove(j),
            (Some((i, _)), None) => self.free.swap_remove(i),
            (None, None) => Vec::with_capacity(n),
        };
        // Filled once, when first grown: a buffer's length only ever grows, so reusing
        // it writes nothing.
        if b.len() < n {
            b.resize(n, 0);
        }
        b
    }

    /// A buffer of `n` 4-byte elements that lives as long as the run (contents
    /// unspecified).
    pub fn alloc(&mut self, n: usize) -> *mut u8 {
        let b = self.take(n);
        self.bufs.push(b);
        self.bufs.last_mut().expect("pushed").as_mut_ptr() as *mut u8
    }

    /// How many buffers are in use: a mark for [`Keep::release_since`].
    fn mark(&self) -> usize {
        self.bufs.len()
    }

    /// Frees every buffer allocated since `mark` (a kernel's scratch, once it has run).
    fn release_since(&mut self, mark: usize) {
        let done = self.bufs.drain(mark..);
        self.free.extend(done);
    }

    /// Frees a buffer [`Keep::take`] gave out.
    fn give_back(&mut self, b: Vec<u32>) {
        self.free.push(b);
    }

    /// The pool for the next run: every buffer this run used.
    fn into_pool(self) -> Vec<Vec<u32>> {
        let mut pool = self.bufs;
        pool.extend(self.free);
        pool
    }
}

/// A reshape of a non-contiguous view, which cannot be another view of its source: its
/// elements are copied into a buffer of their own when a kernel first reads them, and
/// the buffer is freed after the last kernel that reads them.
struct ViewCopy {
    /// The value copied (a strided view).
    src: usize,
    words: usize,
    buf: Option<Vec<u32>>,
    /// The values that start at the copy: itself and views of it. Their locations get
    /// its address when it is made.
    users: Vec<usize>,
}

/// Makes the copies in `cs` that are not made yet (in order: a copy of a view of a copy
/// comes after the copy it reads).
fn materialize(
    copy: kiln_compiler::codegen::jit::KernelFn,
    cs: &[usize],
    copies: &mut [ViewCopy],
    locs: &mut [Vec<Loc>],
    keep: &mut Keep,
) {
    for &c in cs {
        if copies[c].buf.is_some() {
            continue;
        }
        let mut b = keep.take(copies[c].words);
        let p = b.as_mut_ptr() as *mut u8;
        for &u in &copies[c].users {
            locs[u][0].ptr = p;
        }
        launch::copy_with(copy, &locs[copies[c].src][0], p);
        copies[c].buf = Some(b);
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
    /// AMX), scaled into fp16 with sums of 64 terms in fp16 added up in f32 ([`Bf16Kernel::Half`]).
    /// `--gemm-type 16bit` sets it for every executor a process builds. Mixed precision,
    /// as a GPU's `--precision mixed`: everything else stays f32. An error where the CPU
    /// has none of them.
    pub fn set_bf16_products(&mut self, on: bool) -> Result<(), ExecError> {
        if on {
            let kernel = Bf16Kernel::best()
                .map_err(|why| ExecError::Unsupported(format!("{why}; run the products in f32")))?;
            self.set_bf16_kernel(Some(kernel))
        } else {
            self.set_bf16_kernel(None)
        }
    }

    /// Runs the large matrix products in bf16 with `kernel`'s instructions (`None`: in
    /// f32), as [`Compiled::set_bf16_products`] does with the kernel it chooses. An error
    /// where the CPU cannot run the kernel.
    pub fn set_bf16_kernel(&mut self, kernel: Option<Bf16Kernel>) -> Result<(), ExecError> {
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
    pub fn bf16_kernel(&self) -> Option<Bf16Kernel> {
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

    /// Runs the program; outputs in `graph.outputs` order.
    pub fn run(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        on_worker(|| self.run_inner(inputs, params, opts, None, None, None))
    }

    /// Whether [`Compiled::run_gathered`] can read input `name` with its rows gathered:
    /// an f32 input that only concatenations along a later axis read (a decoder's
    /// key/value caches).
    pub fn folds_row_gather(&self, name: &str) -> bool {
        self.gatherable.contains(name)
    }

    /// [`Compiled::run`] with each input named in `gathered` read as if it were
    /// `decode::take_rows(t, rows)` — its rows along axis 0 in the order `rows` — without
    /// that copy: the concatenations reading it copy each row from its source row. Every
    /// name must be one [`Compiled::folds_row_gather`] accepts, and every row index must
    /// be inside its tensor.
    pub fn run_gathered(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        gathered: &std::collections::BTreeSet<String>,
        rows: &[usize],
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        let gather = (!gathered.is_empty()).then_some((gathered, rows));
        on_worker(|| self.run_inner(inputs, params, opts, None, None, gather))
    }

    /// Runs the program and returns every value of the kernel graph (a debugging aid:
    /// compile with `--no-buffer-reuse` so that no buffer is overwritten before the end).
    pub fn run_all_values(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<Vec<Tensor>>, ExecError> {
        let mut dump = Vec::new();
        on_worker(|| self.run_inner(inputs, params, opts, None, Some(&mut dump), None))?;
        Ok(dump)
    }

    /// Runs this program in `other`'s arena from now on (the trainer's programs — the
    /// training step, validation and the decoder — run one at a time, so one arena, as
    /// large as the largest layout, serves them all instead of one each). A run that finds
    /// the arena taken by another still runs, in an arena of its own.
    pub fn share_arena_with(&mut self, other: &Compiled) {
        self.arena = Arc::clone(&other.arena);
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
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        profile: &mut (dyn FnMut(&Timing<'_>) + Send),
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
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
    ) -> Option<Arc<bf16::PackedRhs>> {
        let version = version?;
        let shape = loc.shape();
        let kernel = self.bf16_products?;
        if loc.dtype != DType::F32 || shape.len() != 2 {
            return None;
        }
        let mut cache = self.packed.lock().unwrap_or_else(|p| p.into_inner());
        let packed = cache.get_mut(&v)?.get(version, || {
            let b = gemm::Mat {
                ptr: (loc.ptr as *const f32).wrapping_add(loc.layout.offset),
                rs: loc.layout.strides[0] as isize,
                cs: loc.layout.strides[1] as isize,
            };
            // SAFETY: a kernel is set only after its check; `loc` addresses the weight's
            // `k × n` elements, which stay unchanged while the version does.
            unsafe { bf16::PackedRhs::new(kernel, (shape[0], shape[1]), b) }
        });
        // Parameters of another shape under the same version (a caller breaking the
        // version's promise), or a copy packed for another kernel, are read as they are,
        // not through a copy of the wrong size or values.
        packed.is(kernel, (shape[0], shape[1])).then_some(packed)
    }

    fn run_inner(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        mut profile: Option<Profile<'_>>,
        dump: Option<&mut Vec<Vec<Tensor>>>,
        gather: Option<Gather<'_>>,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        if opts.precision != Precision::F32 {
            return Err(ExecError::Unsupported(format!(
                "the compiled executor computes in f32 only, but {:?} precision was \
                 requested; use the reference executor for f64",
                opts.precision
            )));
        }
        // Inputs read with their rows gathered bind their dims at the shape they are
        // read with.
        let mut as_read: BTreeMap<String, (Vec<usize>, DType)> = BTreeMap::new();
        if let Some((names, rows)) = gather {
            for name in names {
                let err = |message: String| ExecError::Input {
                    name: name.clone(),
                    message,
                };
                if !self.gatherable.contains(name) {
                    return Err(ExecError::Unsupported(format!(
                        "input `{name}` cannot be read with its rows gathered: a kernel other \
                         than a concatenation reads it"
                    )));
                }
                let t = inputs.get(name).ok_or_else(|| ExecError::MissingInput {
                    name: name.clone(),
                    expected: format!("`{name}` (to gather its rows)"),
                })?;
                if !matches!(t.data, TensorData::F32(_)) || t.shape.is_empty() {
                    return Err(err(format!(
                        "has rows gathered, so it must be f32 of rank ≥ 1, got shape {:?}",
                        t.shape
                    )));
                }
                if let Some(&r) = rows.iter().find(|&&r| r >= t.shape[0]) {
                    return Err(err(format!(
                        "row {r} is gathered, but the tensor has {} rows",
                        t.shape[0]
                    )));
                }
                let mut shape = t.shape.clone();
                shape[0] = rows.len();
                as_read.insert(name.clone(), (shape, DType::F32));
            }
        }
        if gather.is_some() && dump.is_some() {
            return Err(ExecError::Unsupported(
                "a run that dumps every value reads no gathered rows".into(),
            ));
        }
        let bind = Binder::with_resident(&self.graph, inputs, &as_read, params, EXECUTOR)?;
        let dims = bind.dims.clone();
        let layout = self.layouts.get(&self.plan, &dims)?;
        // The shared arena, or one of this run's own while another run holds it (an idle
        // one of an earlier such run if there is one). Never wait for it: runs go on
        // rayon's workers, and a worker waiting for its kernels may take up a second run
        // of this program (rayon steals whole jobs), which would then wait on the worker
        // itself.
        let mut shared = match self.arena.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let mut own = match shared {
            Some(_) => Vec::new(),
            None => self
                .idle_arenas
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop()
                .unwrap_or_default(),
        };
        let arena: &mut Vec<f32> = match shared.as_deref_mut() {
            Some(a) => a,
            None => &mut own,
        };
        let words = layout.total / 4 + ARENA_PAD;
        self.ensure_memory(&dims, layout.total, arena_len(arena) * 4)?;
        if arena.len() < words {
            // The old arena goes before the new one comes: never both at once.
            *arena = Vec::new();
            *arena = zeroed(words);
        }
        let base = aligned_base(arena);
        let mut keep = Keep::with_pool(std::mem::take(
            &mut *self.scratch.lock().unwrap_or_else(|p| p.into_inner()),
        ));
        // Outputs written in place: their storage, taken from recycled outputs of the
        // same length where there are some, else fresh.
        let mut spare = std::mem::take(&mut *self.spare.lock().unwrap_or_else(|p| p.into_inner()));
        let mut direct: Vec<Option<Vec<f32>>> = vec![None; self.direct.len()];
        // Contiguous copies of transposed weights this run reads (kept alive by it).
        let mut held: Vec<Arc<Vec<f32>>> = Vec::new();
        let mut locs: Vec<Vec<Loc>> = Vec::with_capacity(self.kg.values.len());
        // Reshapes of non-contiguous views become copies, made when first read (their
        // source is computed by then, and still alive: views extend liveness) and freed
        // after their last reader. `needs[v]`: the copies value `v` reads through;
        // `origin[v]`: the copy whose buffer `v`'s location starts at.
        let mut copies: Vec<ViewCopy> = Vec::new();
        let mut needs: Vec<Vec<usize>> = Vec::with_capacity(self.kg.values.len());
        let mut origin: Vec<Option<usize>> = Vec::with_capacity(self.kg.values.len());
        let node_err = |v: usize, m: String| ExecError::Node {
            node: format!("kernel value %{v} ({})", self.kg.values[v].scope),
            message: m,
        };
        for (v, val) in self.kg.values.iter().enumerate() {
            let shapes: Vec<Vec<usize>> = val
                .types
                .iter()
                .map(|t| t.shape.eval(&dims))
                .collect::<Result<_, _>>()
                .map_err(|m| node_err(v, m))?;
            let loc = match &val.def {
                // Read with rows gathered: the tensor as it is (its own shape), the rows
                // given to the concatenations that read it.
                Def::Input(name) if as_read.contains_key(name) => {
                    let t = &inputs[name];
                    let TensorData::F32(data) = &t.data else {
                        return Err(node_err(v, "internal: a gathered input not f32".into()));
                    };
                    vec![Loc {
                        ptr: data.as_ptr() as *mut u8,
                        layout: Layout::contiguous(&t.shape),
                        dtype: DType::F32,
                    }]
                }
                Def::Input(name) => {
                    let id = self
                        .graph
                        .input(name)
                        .ok_or_else(|| node_err(v, format!("the graph has no input `{name}`")))?;
                    vec![source_loc(bind.input(id, name)?, &shapes[0], &mut keep)]
                }
                Def::Param(name) => {
                    let id = self.graph.param(name).ok_or_else(|| {
                        node_err(v, format!("the graph has no parameter `{name}`"))
                    })?;
                    vec![source_loc(
                        bind.param(id, name, &shapes[0])?,
                        &shapes[0],
                        &mut keep,
                    )]
                }
                Def::Const(c, dtype) => {
                    let p = keep.alloc(1);
                    let bits = match dtype {
                        DType::I32 => c.get() as i32 as u32,
                        DType::Bool => (c.get() != 0.0) as u32,
                        _ => (c.get() as f32).to_bits(),
                    };
                    // SAFETY: `p` is a fresh one-element buffer.
                    unsafe { *(p as *mut u32) = bits };
                    vec![Loc {
                        ptr: p,
                        layout: Layout::contiguous(&[]),
                        dtype: *dtype,
                    }]
                }
                Def::View(op, x) => {
                    let src = &locs[*x][0];
                    let mut need = needs[*x].clone();
                    let mut from = origin[*x];
                    let layout = match op {
                        Op::Reshape { .. } => src.layout.reshape(&shapes[0]),
                        Op::Permute { perm } => Some(src.layout.permute(perm)),
                        Op::Broadcast { .. } => Some(src.layout.broadcast(&shapes[0])),
                        other => {
                            return Err(node_err(v, format!("`{}` is not a view", other.name())))
                        }
                    };
                    let loc = match layout {
                        Some(layout) => {
                            needs.push(need);
                            let loc = Loc {
                                ptr: src.ptr,
                                layout,
                                dtype: val.types[0].dtype,
                            };
                            match self.weight_copy(v, &loc, opts.params_version) {
                                Some(copy) => {
                                    let l = Loc {
                                        ptr: copy.as_ptr() as *mut u8,
                                        layout: Layout::contiguous(&shapes[0]),
                                        dtype: DType::F32,
                                    };
                                    held.push(copy);
                                    from = None;
                                    vec![l]
                                }
                                None => vec![loc],
                            }
                        }
                        None => {
                            // A reshape of a non-contiguous view: a copy, placed when
                            // it is made.
                            copies.push(ViewCopy {
                                src: *x,
                                words: src.numel(),
                                buf: None,
                                users: Vec::new(),
                            });
                            from = Some(copies.len() - 1);
                            need.push(copies.len() - 1);
                            needs.push(need);
                            vec![Loc {
                                ptr: std::ptr::null_mut(),
                                layout: Layout::contiguous(&shapes[0]),
                                dtype: val.types[0].dtype,
                            }]
                        }
                    };
                    if let Some(c) = from {
                        copies[c].users.push(v);
                    }
                    origin.push(from);
                    loc
                }
                Def::Proj(t, k) => {
                    needs.push(needs[*t].clone());
                    vec![locs[*t][*k as usize].clone()]
                }
                Def::Kernel { .. } => (0..val.types.len())
                    .map(|k| {
                        let ptr = match self.home.get(&(v, k)) {
                            // The first result of an in-place chain places the storage;
                            // the later ones write over it.
                            Some(Home::Output(i)) => match &mut direct[*i] {
                                Some(store) => store.as_mut_ptr() as *mut u8,
                                slot => {
                                    let n: usize = shapes[k].iter().product();
                                    let mut store = take_storage(&mut spare, n);
                                    let ptr = store.as_mut_ptr() as *mut u8;
                                    *slot = Some(store);
                                    ptr
                                }
                            },
                            Some(Home::Arena(b)) => base.wrapping_add(layout.offsets[*b]),
                            None => {
                                return Err(node_err(
                                    v,
                                    "internal: no buffer in the memory plan".into(),
                                ))
                            }
                        };
                        let layout = if self.merged.contains(&(v, k)) {
                            Layout::heads_merged(&shapes[k])
                        } else {
                            Layout::contiguous(&shapes[k])
                        };
                        Ok(Loc {
                            ptr,
                            layout,
                            dtype: val.types[k].dtype,
                        })
                    })
                    .collect::<Result<_, ExecError>>()?,
            };
            if needs.len() < locs.len() + 1 {
                needs.push(Vec::new());
            }
            if origin.len() < locs.len() + 1 {
                origin.push(None);
            }
            locs.push(loc);
        }
        // Which copies each step is the last to read (none while dumping every value).
        let freed = if dump.is_some() {
            vec![Vec::new(); self.steps.len()]
        } else {
            crate::exec::copies_freed_after(
                copies.len(),
                &needs,
                self.steps.iter().map(|s| s.inputs.as_slice()),
                self.kg.outputs.iter().map(|(_, v)| *v),
            )
        };
        let packer = |v: usize, loc: &Loc| self.packed_weight(v, loc, opts.params_version);
        let ctx = launch::RunCtx {
            dims: &dims,
            copy: self.copy,
            checks: Some(&self.checks),
            seed: opts.seed,
            step: opts.step,
            pool: &self.pool,
            bf16: self.bf16_products,
            packed: Some(&packer),
        };
        // Bias gradients written by their weight gradient's product (16-bit products,
        // `launch::product_with_sums`): the `sum_rows` launches left for a later product,
        // and the sums a product wrote for a later `sum_rows`, by the `sum_rows` launch.
        let mut deferred: Vec<usize> = Vec::new();
        let mut summed: Vec<(usize, Vec<f32>)> = Vec::new();
        let fuse_bias = self.bf16_products.is_some();
        // (summed by a product, by their own kernel), for `bias_grad_counts`.
        let mut bias_counts = (0, 0);
        // Groups of products run as one (`launch::product_group`), and the kernels in
        // them; the kernels up to `grouped_until` ran in the last group.
        let mut group_counts = (0, 0);
        let mut grouped_until = 0;
        let mut trace: Option<Vec<Launched>> = self.tracing.then(Vec::new);
        for (s, step) in self.steps.iter().enumerate() {
            if s < grouped_until {
                continue;
            }
            for &x in &step.inputs {
                materialize(self.copy, &needs[x], &mut copies, &mut locs, &mut keep);
            }
            // The launch plan's product group this starts, run as one where the products
            // run in 16 bits (`launch::product_group`).
            let end = match self.launch.group_at(s) {
                Some(g) if self.bf16_products.is_some() => s + g.len,
                _ => s + 1,
            };
            if end > s + 1 {
                for t in &self.steps[s + 1..end] {
                    for &x in &t.inputs {
                        materialize(self.copy, &needs[x], &mut copies, &mut locs, &mut keep);
                    }
                }
                let started = profile.as_ref().map(|_| std::time::Instant::now());
                let group: Vec<&launch::Step> = self.steps[s..end].iter().collect();
                let ins: Vec<Vec<&Loc>> = group
                    .iter()
                    .map(|t| t.inputs.iter().map(|&x| &locs[x][0]).collect())
                    .collect();
                let outs: Vec<&[Loc]> = group.iter().map(|t| locs[t.value].as_slice()).collect();
                // Each weight gradient's bias gradient, as a product on its own would sum
                // it (below): into the `sum_rows` result where that launch was left for
                // this product, else into a buffer of its own that the launch copies.
                let mut plans = Vec::new();
                let mut sums = Vec::with_capacity(group.len());
                for (q, t) in group.iter().enumerate() {
                    let matmul = matches!(t.exec, launch::Exec::Matmul);
                    let Some(other) = t.bias_grad.filter(|_| matmul) else {
                        sums.push(None);
                        continue;
                    };
                    let sum = &self.steps[other];
                    let (dy, db) = (&locs[sum.inputs[0]][0], &locs[sum.value][0]);
                    let (at, own) = if other < s + q {
                        if !deferred.contains(&other) {
                            sums.push(None);
                            continue;
                        }
                        (db.base() as *mut f32, None)
                    } else if fuse_bias && needs[sum.inputs[0]].is_empty() && sum.check.is_none() {
                        let mut own = vec![0f32; db.numel()];
                        (own.as_mut_ptr(), Some(own))
                    } else {
                        sums.push(None);
                        continue;
                    };
                    sums.push(launch::bias_sums(dy, ins[q][1], at));
                    plans.push((other, own, sums[q].is_some()));
                }
                let planned = plans.iter().all(|&(_, _, ok)| ok);
                if planned && launch::product_group(&group, &ins, &outs, &sums, &ctx) {
                    group_counts.0 += 1;
                    group_counts.1 += group.len();
                    if let Some(t) = trace.as_mut() {
                        let first = s;
                        t.extend((s..end).map(|launch| Launched {
                            launch,
                            how: How::InGroup { first },
                        }));
                        t.extend(plans.iter().map(|&(other, _, _)| Launched {
                            launch: other,
                            how: How::SummedBy {
                                product: self.steps[other].bias_grad.unwrap_or(other),
                            },
                        }));
                    }
                    for (other, own, _) in plans {
                        bias_counts.0 += 1;
                        match own {
                            Some(own) => summed.push((other, own)),
                            None => deferred.retain(|&d| d != other),
                        }
                    }
                    if let (Some(p), Some(t0)) = (profile.as_mut(), started) {
                        // The group's time shared by the kernels' multiply-adds.
                        let seconds = t0.elapsed().as_secs_f64();
                        let products: Vec<Option<Product>> = ins
                            .iter()
                            .map(|i| Product::of(&i[0].layout, &i[1].layout))
                            .collect();
                        let flops = |p: &Option<Product>| p.map_or(0.0, |p| p.flops());
                        let total: f64 = products.iter().map(flops).sum();
                        for (t, product) in group.iter().zip(products) {
                            let share = if total > 0.0 {
                                flops(&product) / total
                            } else {
                                1.0 / group.len() as f64
                            };
                            p(&Timing {
                                what: &t.kind,
                                seconds: seconds * share,
                                product,
                            });
                        }
                    }
                    for freed in &freed[s..end] {
                        for &c in freed {
                            if let Some(b) = copies[c].buf.take() {
                                keep.give_back(b);
                            }
                        }
                    }
                    grouped_until = end;
                    continue;
                }
            }
            // A `sum_rows` left out here reads `dy` without a view copy (`needs[dy]` is
            // empty), so it frees none.
            if let (Some(other), launch::Exec::SumRows(_)) = (step.bias_grad, &step.exec) {
                let dy = step.inputs[0];
                if other > s {
                    // Its product sums `dy` later (if it can: else it runs this then).
                    if fuse_bias && step.check.is_none() && needs[dy].is_empty() {
                        deferred.push(s);
                        continue;
                    }
                } else if let Some(i) = summed.iter().position(|(at, _)| *at == s) {
                    let (_, sums) = summed.swap_remove(i);
                    let out = &locs[step.value][0];
                    // SAFETY: the result is a contiguous buffer of `n` values, the sums'
                    // count (`launch::bias_sums` checked `dy`'s shape, whose rows it sums).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            sums.as_ptr(),
                            out.base() as *mut f32,
                            sums.len().min(out.numel()),
                        )
                    };
                    continue;
                }
                bias_counts.1 += 1;
            }
            let started = profile.as_ref().map(|_| std::time::Instant::now());
            let ins: Vec<&Loc> = step.inputs.iter().map(|&x| &locs[x][0]).collect();
            let product = match step.exec {
                launch::Exec::Matmul | launch::Exec::Linear { .. } if profile.is_some() => {
                    Product::of(&ins[0].layout, &ins[1].layout)
                }
                _ => None,
            };
            let outs = &locs[step.value];
            let mark = keep.mark();
            // The operands read with their rows gathered (a concatenation's).
            let gathered: Vec<Option<&[usize]>> = match gather {
                Some((_, rows)) => step
                    .inputs
                    .iter()
                    .map(|&x| match &self.kg.values[x].def {
                        Def::Input(n) if as_read.contains_key(n) => Some(rows),
                        _ => None,
                    })
                    .collect(),
                None => Vec::new(),
            };
            // This product's bias gradient: the `sum_rows` step, `dy`, and where the sums go.
            // (Only concatenations read gathered rows, never a product.)
            let bias = match (step.bias_grad, &step.exec) {
                (Some(other), launch::Exec::Matmul) => {
                    let sum = &self.steps[other];
                    let (dy, db) = (&locs[sum.inputs[0]][0], &locs[sum.value][0]);
                    if other < s {
                        deferred
                            .iter()
                            .position(|&d| d == other)
                            .map(|i| (deferred.swap_remove(i), dy, db.base() as *mut f32, None))
                    } else if fuse_bias && needs[sum.inputs[0]].is_empty() && sum.check.is_none() {
                        // Into a buffer of its own: the result's slot may be this
                        // product's operand's until then.
                        let mut own = vec![0f32; db.numel()];
                        let at = own.as_mut_ptr();
                        Some((other, dy, at, Some(own)))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            let summing = bias.map(|(other, dy, at, own)| {
                let sums = launch::bias_sums(dy, ins[1], at);
                let done = sums
                    .is_some_and(|sums| launch::product_with_sums(step, &ins, outs, &ctx, sums));
                (other, own, done)
            });
            let alone = Launched {
                launch: s,
                how: How::Alone,
            };
            match summing {
                Some((other, own, true)) => {
                    bias_counts.0 += 1;
                    summed.extend(own.map(|own| (other, own)));
                    if let Some(t) = trace.as_mut() {
                        t.push(alone);
                        t.push(Launched {
                            launch: other,
                            how: How::SummedBy { product: s },
                        });
                    }
                }
                // Left for this product, which could not sum it: the kernel after it.
                Some((other, None, false)) => {
                    bias_counts.1 += 1;
                    if let Some(t) = trace.as_mut() {
                        t.push(alone);
                        t.push(Launched {
                            launch: other,
                            how: How::Alone,
                        });
                    }
                    let sum = &self.steps[other];
                    let sum_ins = [&locs[sum.inputs[0]][0]];
                    launch::run_step(step, &ins, outs, &ctx, &mut keep)
                        .and_then(|()| {
                            launch::run_step(sum, &sum_ins, &locs[sum.value], &ctx, &mut keep)
                        })
                        .map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?;
                }
                _ if gathered.iter().any(Option::is_some) => {
                    if let Some(t) = trace.as_mut() {
                        t.push(alone);
                    }
                    fallback::concat_gathered(&step.exec, &ins, &gathered, outs)
                        .map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?
                }
                _ => {
                    if let Some(t) = trace.as_mut() {
                        t.push(alone);
                    }
                    launch::run_step(step, &ins, outs, &ctx, &mut keep)
                        .map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?
                }
            }
            // The kernel's scratch and the copies no later kernel reads.
            keep.release_since(mark);
            for &c in &freed[s] {
                if let Some(b) = copies[c].buf.take() {
                    keep.give_back(b);
                }
            }
            if let (Some(p), Some(t0)) = (profile.as_mut(), started) {
                p(&Timing {
                    what: &step.kind,
                    seconds: t0.elapsed().as_secs_f64(),
                    product,
                });
            }
        }
        if let Some(&s) = deferred.first() {
            return Err(node_err(
                self.steps[s].value,
                "internal: a bias gradient was left for a product that did not take it".into(),
            ));
        }
        if let Some(t) = trace {
            *self.trace.lock().unwrap_or_else(|p| p.into_inner()) = t;
        }
        {
            let mut counts = self.bias_grads.lock().unwrap_or_else(|p| p.into_inner());
            counts.0 += bias_counts.0;
            counts.1 += bias_counts.1;
            let mut groups = self
                .product_groups
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            groups.0 += group_counts.0;
            groups.1 += group_counts.1;
        }
        if let Some(dump) = dump {
            let all: Vec<usize> = (0..copies.len()).collect();
            materialize(self.copy, &all, &mut copies, &mut locs, &mut keep);
            for l in &locs {
                dump.push(l.iter().map(to_tensor).collect());
            }
        }
        let mut out = Vec::with_capacity(self.graph.outputs.len());
        for (i, o) in self.graph.outputs.iter().enumerate() {
            if let (Some(mut store), Some((v, k))) = (direct[i].take(), self.direct[i]) {
                let shape = locs[v][k].layout.shape.clone();
                let n: usize = shape.iter().product();
                if store.len() < n {
                    if store.capacity() < n {
                        return Err(ExecError::Unsupported(format!(
                            "internal: output `{}` has storage for {} of its {n} elements",
                            o.name,
                            store.capacity()
                        )));
                    }
                    // SAFETY: the storage holds `n` elements (the capacity was asked for
                    // them), and the kernel this output is the result of has written
                    // every one: a `direct_output` is a whole kernel result.
                    unsafe { store.set_len(n) };
                }
                out.push((
                    o.name.clone(),
                    Tensor {
                        shape,
                        data: TensorData::F32(store),
                    },
                ));
                continue;
            }
            let (_, v) = self
                .kg
                .outputs
                .iter()
                .find(|(n, _)| n == &o.name)
                .ok_or_else(|| ExecError::Unsupported(format!("no program output `{}`", o.name)))?;
            materialize(self.copy, &needs[*v], &mut copies, &mut locs, &mut keep);
            out.push((o.name.clone(), to_tensor_into(&locs[*v][0], &mut spare)));
        }
        // What no output took is not kept: its sizes no longer match.
        drop(spare);
        *self.view_copies.lock().unwrap_or_else(|p| p.into_inner()) =
            (copies.len(), copies.iter().map(|c| c.words * 4).sum());
        for c in copies {
            if let Some(b) = c.buf {
                keep.give_back(b);
            }
        }
        *self.scratch.lock().unwrap_or_else(|p| p.into_inner()) = keep.into_pool();
        drop(shared);
        if !own.is_empty() {
            let mut idle = self.idle_arenas.lock().unwrap_or_else(|p| p.into_inner());
            // As many as runs have overlapped; none is kept past that.
            idle.push(own);
        }
        Ok(out)
    }
}

/// Per graph output, the kernel result written straight into the returned tensor's
/// storage ([`direct_output`]), for the first output naming it only.
fn direct_outputs(graph: &Graph, kg: &KernelGraph) -> Vec<Option<(usize, usize)>> {
    let mut seen = std::collections::HashSet::new();
    graph
        .outputs
        .iter()
        .map(|o| direct_output(kg, &o.name).filter(|vk| seen.insert(*vk)))
        .collect()
}

/// Storage for `n` f32 elements: a vector of exactly that length from `spare` (taken
/// out of it) when there is one and it is worth it, else a fresh zeroed one.
fn take_spare(spare: &mut Vec<Vec<f32>>, n: usize) -> Vec<f32> {
    let reused = if n >= RECYCLE_MIN {
        spare
            .iter()
            .position(|v| v.len() == n)
            .map(|i| spare.swap_remove(i))
    } else {
        None
    };
    reused.unwrap_or_else(|| zeroed(n))
}

/// Storage for an output a kernel writes whole: a recycled vector of exactly `n`
/// elements, else an empty one with room for `n` — its elements are written by the run
/// and its length set after ([`Compiled::run`]), so it is never zeroed first (the
/// decoder's caches are fresh every step, and zeroing them was 3 % of a translation).
/// Large ones ask for transparent huge pages, as [`zeroed`].
fn take_storage(spare: &mut Vec<Vec<f32>>, n: usize) -> Vec<f32> {
    if n >= RECYCLE_MIN {
        if let Some(i) = spare.iter().position(|v| v.len() == n) {
            return spare.swap_remove(i);
        }
    }
    let mut v: Vec<f32> = Vec::with_capacity(n);
    advise_huge_pages(v.as_mut_ptr(), n * 4);
    v
}

/// Words an arena holds past its memory plan's bytes: room to start the plan's offset 0
/// on an [`ALIGN`]-byte boundary ([`aligned_base`]).
const ARENA_PAD: usize = ALIGN / 4;

/// The words of `arena` its memory plan may use (less [`ARENA_PAD`]).
fn arena_len(arena: &[f32]) -> usize {
    arena.len().saturating_sub(ARENA_PAD)
}

/// Where the memory plan's offset 0 is in `arena` (at least [`ARENA_PAD`] words long):
/// its first [`ALIGN`]-byte (64-byte) boundary. The plan's offsets are multiples of
/// [`ALIGN`], so every buffer then starts on a cache line, as a 512-bit load or store
/// of a row wants. A large `Vec` from the allocator starts 16 bytes past a page (glibc's
/// header before an `mmap`ed block), which put every buffer 16 bytes off a line: each
/// 64-byte load and store of the 16-bit products' packing and results touched two lines.
/// On this Xeon an 800×512·512×512 fp16 product took 857–876 µs with its operands 16
/// bytes off a line against 817–854 µs with them on one (each the fastest of a round of
/// 200 runs, hot in cache).
fn aligned_base(arena: &mut [f32]) -> *mut u8 {
    let pad = arena.as_ptr().align_offset(ALIGN);
    assert!(
        pad <= ARENA_PAD,
        "an f32 arena is 4-byte aligned, so at most 15 words from a 64-byte boundary"
    );
    arena[pad..].as_mut_ptr() as *mut u8
}

/// A zeroed vector of `n` f32. Large ones ask for transparent huge pages before the
/// first touch (Linux `madvise(MADV_HUGEPAGE)`, which the default `madvise` THP mode
/// honours): a fresh 118 MB of logits is otherwise page-faulted in 4 KiB at a time by
/// the kernel writing it — 29,000 faults, a quarter of the output projection's time.
pub(crate) fn zeroed(n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    advise_huge_pages(v.as_mut_ptr(), n * 4);
    v
}

/// Asks for transparent huge pages under the `bytes` bytes at `ptr` (an allocation of
/// the caller's).
#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: *mut f32, bytes: usize) {
    const HUGE: usize = 2 << 20;
    let start = ptr as usize;
    if bytes < 2 * HUGE {
        return;
    }
    let (from, to) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
    if to > from {
        // SAFETY: the range lies inside the caller's allocation; the advice changes how
        // its pages are backed, never their contents.
        // Failure (no THP in this kernel) leaves ordinary pages.
        unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_: *mut f32, _: usize) {}

/// A bound source as a location: f32 and i32 read in place, others converted.
fn source_loc(src: Source<'_>, shape: &[usize], keep: &mut Keep) -> Loc {
    let layout = Layout::contiguous(shape);
    match src {
        Source::F32(v) => Loc {
            ptr: v.as_ptr() as *mut u8,
            layout,
            dtype: DType::F32,
        },
        Source::F64(v) => {
            let p = keep.alloc(v.len());
            for (i, x) in v.iter().enumerate() {
                // SAFETY: `p` holds `v.len()` elements.
                unsafe { *(p as *mut f32).add(i) = *x as f32 };
            }
            Loc {
                ptr: p,
                layout,
                dtype: DType::F32,
            }
        }
        Source::I32(v) => match v {
            std::borrow::Cow::Borrowed(s) => Loc {
                ptr: s.as_ptr() as *mut u8,
                layout,
                dtype: DType::I32,
            },
            std::borrow::Cow::Owned(s) => {
                let p = keep.alloc(s.len());
                // SAFETY: `p` holds `s.len()` elements.
                unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), p as *mut i32, s.len()) };
                Loc {
                    ptr: p,
                    layout,
                    dtype: DType::I32,
                }
            }
        },
        Source::Bool(v) => {
            let p = keep.alloc(v.len());
            for (i, &b) in v.iter().enumerate() {
                // SAFETY: `p` holds `v.len()` elements.
                unsafe { *(p as *mut u32).add(i) = b as u32 };
            }
            Loc {
                ptr: p,
                layout,
                dtype: DType::Bool,
            }
        }
    }
}

/// Reads a location into a host tensor (row-major).
pub(crate) fn to_tensor(loc: &Loc) -> Tensor {
    to_tensor_into(loc, &mut Vec::new())
}

/// Outputs at least this long (in elements) are worth recycling (see
/// [`Compiled::recycle`]); smaller ones are cheap to allocate.
const RECYCLE_MIN: usize = 1 << 14;

/// [`to_tensor`], storing an f32 output in a vector of `spare` of exactly its length
/// when there is one (taken out of `spare`).
pub(crate) fn to_tensor_into(loc: &Loc, spare: &mut Vec<Vec<f32>>) -> Tensor {
    let shape = loc.layout.shape.clone();
    if loc.is_contiguous() && loc.dtype == DType::F32 {
        // SAFETY: a contiguous layout covers `offset .. offset + numel` of f32 elements.
        let src = unsafe {
            std::slice::from_raw_parts((loc.ptr as *const f32).add(loc.layout.offset), loc.numel())
        };
        // Large outputs (logits, gradients) are copied by all threads: a fresh
        // allocation's first touch costs as much as the copy, which recycled storage
        // does not pay.
        const CHUNK: usize = 1 << 16;
        let mut v = take_spare(spare, src.len());
        if src.len() > 4 * CHUNK {
            use rayon::prelude::*;
            v.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s));
        } else {
            v.copy_from_slice(src);
        }
        return Tensor {
            shape,
            data: TensorData::F32(v),
        };
    }
    let words = launch::gather_words(loc);
    let data = match loc.dtype {
        DType::I32 => TensorData::I32(words.iter().map(|&w| w as i32).collect()),
        DType::Bool => TensorData::Bool(words.iter().map(|&w| w != 0).collect()),
        _ => TensorData::F32(words.iter().map(|&w| f32::from_bits(w)).collect()),
    };
    Tensor { shape, data }
}

/// Inputs read with their rows gathered, and the rows ([`Compiled::run_gathered`]).
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

impl crate::exec::Exec for Compiled {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    fn run(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        Compiled::run(self, inputs, params, opts)
    }

    fn recycle(&self, tensors: Vec<Tensor>) {
        Compiled::recycle(self, tensors)
    }

    fn folds_row_gather(&self, name: &str) -> bool {
        Compiled::folds_row_gather(self, name)
    }

    fn run_map_gathered(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        gathered: &std::collections::BTreeSet<String>,
        rows: &[usize],
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<BTreeMap<String, Tensor>, ExecError> {
        Ok(
            Compiled::run_gathered(self, inputs, gathered, rows, params, opts)?
                .into_iter()
                .collect(),
        )
    }

    fn as_compiled_mut(&mut self) -> Option<&mut Compiled> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_type_names_round_trip() {
        for name in GemmType::NAMES {
            let t = GemmType::parse(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(t.name(), name);
        }
        assert_eq!(
            GemmType::parse("int16"),
            Some(GemmType::Kernel(Bf16Kernel::Int16))
        );
        assert_eq!(GemmType::parse("16bit"), Some(GemmType::Best16));
        for other in ["", "1", "bf16", "int8", "F32"] {
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
