//! CUDA code generation: kernels of the kernel graph as CUDA C text, compiled by NVRTC at
//! load.
//!
//! In: a [`crate::optimize::KernelGraph`] (the same input as the CPU backend,
//! [`crate::codegen::program::emit`]). Out: [`CudaCode`] ([`program::emit`]) — one
//! deterministic CUDA C function per distinct kernel body, a shared prelude, and per
//! kernel (by launch index) its functions by role, or the library call (cuBLAS GEMM,
//! attention) it stands for.
//!
//! One file per idea:
//! - [`text`] — the line writer, exact constants, the element type, the prelude;
//! - [`philox`] — Philox4x32-10 and the dropout mask, bit-identical to [`crate::rng`];
//! - [`region`] — elementwise regions and `embed_pe`;
//! - [`rows`] — softmaxes, layer norm and its backward, the label-smoothed cross-entropy;
//! - [`attention`] — flash-style attention, forward and backward (tiled, online softmax);
//! - [`tensor`] — the same on tensor cores (`mma.m16n8k16`) for bf16 programs;
//! - [`misc`] — Adam, bias sums, reductions, bias fill, relu, strided copy;
//! - [`storage`] — mixed precision: which buffers a bf16 program keeps in bf16;
//! - [`cast`] — f32 → bf16 for the GEMM operands of bf16 GEMMs;
//! - [`optim`] — gradient accumulation and Adam for training with state on the device;
//! - [`index`] — `causal_mask`, `pad_mask`, `arange`, `concat` (host kernels on the CPU);
//! - [`program`] — which functions each kernel kind gets ([`CudaCode`]);
//! - [`host`] — a C++ shim that compiles and runs the text on the host (tests).
//!
//! # The launch ABI
//!
//! Every generated function is
//!
//! ```text
//! extern "C" __global__ void <kind>_<n>(<T0>* a0, …, <Tk>* ak, const kiln_dims dims, long long items)
//! ```
//!
//! - the pointers are the buffers of the CPU kernel of the same kind, **in the same
//!   order** (operands, then results; a scalar operand is a pointer to one `float` in
//!   device memory; bools are `int` 0/1), each typed (`const float*`, `int*`, …), listed
//!   in [`CudaFunction::params`]; in a mixed-precision program a float buffer may be
//!   `kiln_bf16` instead, as [`CudaCode::storage`] says ([`storage`]);
//! - `dims` is the CPU kernel's `dims` array, **the same values** (the `*_dims` helpers of
//!   [`crate::codegen::region`], [`crate::codegen::rows`] and [`crate::codegen::misc`]
//!   build it; `xent_ls`'s extra kernels document theirs), copied into a by-value struct of
//!   [`text::MAX_DIMS`] `long long` (unused entries are ignored);
//! - `items` is the number of work items, which is **not always the CPU's**: see
//!   [`Work`] and each function's documentation. [`CudaFunction::items_rule`] says it in
//!   words.
//!
//! Work items map to the grid by [`Work`]: `Threads` — one thread per item, launched as
//! `grid = min(ceil(items / THREADS), MAX_GRID)` blocks of [`text::THREADS`];
//! `Blocks` — one block of [`text::THREADS`] threads per item (a row), `grid = min(items,
//! MAX_GRID)`. Every kernel loops over its items with a grid stride, so any grid size
//! computes the same result: an output element is always computed by one thread (or one
//! block, with a fixed reduction tree), never depending on the grid.
//!
//! # Numerics
//!
//! The arithmetic mirrors the CPU kernels' definitions step for step (same formulas,
//! same op order). Compile with [`nvrtc_options`] (`--fmad=false`, IEEE division and
//! square root, no flush to zero): then `adam_update`, `embed_pe`, the
//! reductions across rows, fills, copies and region arithmetic other than
//! `exp`/`log`/`sin`/`cos` are bit-identical to the CPU kernels, and the dropout masks are
//! identical to [`crate::rng`]'s. Row sums (softmax, layer norm, xent) use a block tree
//! instead of the CPU's four vector lanes, and bias gradients (`sum_rows`) partial sums
//! of 128-row chunks added in order (different rounding, deterministic), and
//! `expf`/`logf`/`sinf`/`cosf` are CUDA's (≤ 2 ulp), not the CPU's polynomials.

pub mod attention;
pub mod cast;
#[cfg(feature = "emulate")]
pub mod host;
pub mod index;
pub mod misc;
pub mod optim;
pub mod philox;
pub mod program;
pub mod region;
pub mod resident;
pub mod rows;
pub mod storage;
pub mod tensor;
pub mod text;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use program::emit;

/// The largest grid a launcher should use (kernels stride over the rest).
pub const MAX_GRID: u64 = 65_535 * 16;

/// The NVRTC options the kernels are written for, for `arch` (`sm_90` by default).
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "--ftz=false".to_string(),
    ]
}

/// The default target architecture (H100).
pub const DEFAULT_ARCH: &str = "sm_90";

/// How a function's work items map to the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Work {
    /// One thread per item.
    Threads,
    /// One block of [`text::THREADS`] threads per item.
    Blocks,
    /// One thread per four consecutive items (`4g` to `4g + 3`, [`FOR_QUADS`]): what
    /// they share — a row's index arithmetic, a Philox block of four dropout words — is
    /// computed once.
    Quads,
    /// One warp per item ([`FOR_WARPS`]): `THREADS / 32` items a block, a row's sums by
    /// shuffles without a barrier.
    Warps,
}

impl Work {
    /// `(grid, block)` for `items` work items.
    pub fn grid(self, items: u64) -> (u32, u32) {
        let t = u64::from(text::THREADS);
        let g = match self {
            Work::Threads => items.div_ceil(t),
            Work::Blocks => items,
            Work::Quads => items.div_ceil(4).div_ceil(t),
            Work::Warps => items.div_ceil(t / 32),
        };
        (g.clamp(1, MAX_GRID) as u32, text::THREADS)
    }
}

/// One parameter of a generated function.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Param {
    pub name: String,
    /// The C type (`const float*`, `int*`, …).
    pub c_type: String,
}

/// One generated `__global__` function.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaFunction {
    pub name: String,
    /// The buffer parameters, in order (then `dims` and `items`).
    pub params: Vec<Param>,
    pub work: Work,
    /// What `items` counts, in words (`rows`, `elements b·t·d`, …).
    pub items_rule: String,
    /// The function's text (needs the prelude before it).
    pub text: String,
}

impl CudaFunction {
    /// The function `name` whose text `w` holds; `items` says what its `items` counts.
    pub(crate) fn new(name: &str, params: Vec<Param>, work: Work, items: &str, w: text::W) -> Self {
        CudaFunction {
            name: name.to_string(),
            params,
            work,
            items_rule: items.to_string(),
            text: w.finish(),
        }
    }
}

/// A kernel that runs a library routine rather than (only) generated code.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Library {
    /// A GEMM through cuBLAS / cuBLASLt (row-major by swapping operands):
    /// `out = x · w (+ bias) (then relu)`, operands by their index among the kernel's
    /// inputs. The `bias` and `epilogue` roles hold generated kernels for a plain cuBLAS
    /// path (bias pre-loaded into `out`, GEMM with `beta = 1`, relu after); cuBLASLt can
    /// fuse both as its epilogue instead.
    Gemm {
        x: usize,
        w: usize,
        bias: Option<usize>,
        relu: bool,
    },
    /// Attention. With heads of at most [`attention::MAX_HEAD`] the flash kernels
    /// ([`attention`]): role `flash` forward, `flash_q` and `flash_kv` backward (with a
    /// `f32[b·h·tq, 3]` statistics scratch between them), and `flash_short`, the whole
    /// backward in one block per head for lengths that fit its tile. Always also the batched-GEMM
    /// path the CPU executor runs: GEMMs and the generated masked softmax (role
    /// `softmax`) and, backward, its gradient (role `softmax_bwd`).
    Attention {
        mask: String,
        backward: bool,
        /// The flash kernels write their results through the strides their dims give
        /// (every artifact since heads were stored merged, `[b, t, h, d]`); an older
        /// artifact's write them contiguous, and its results are stored so. (Left out
        /// when false, so that an older manifest still hashes to what it records.)
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        strided_results: bool,
    },
    /// No CUDA code yet: the kind runs on the host (`gather`, `scatter_add`, `slice`,
    /// `one_hot`, integer reductions, …, as the CPU backend's fallback kernels).
    Host,
}

/// What one kernel of the kernel graph launches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelLaunch {
    /// The kernel kind (`region`, `attention`, `matmul`, …).
    pub kind: String,
    /// Role → function name (`main`, `count`, `finish`, `bias`, `softmax`, `copy`, …).
    pub functions: BTreeMap<String, String>,
    pub library: Option<Library>,
}

/// The CUDA code of one kernel graph.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaCode {
    /// Text shared by every function ([`text::prelude`]).
    pub prelude: String,
    /// Functions in first-use order, deduplicated by body.
    pub functions: Vec<CudaFunction>,
    /// Per kernel launch index.
    pub kernels: Vec<KernelLaunch>,
    /// A mixed-precision program's buffers: per value of the kernel graph, the element
    /// type of each output ([`storage::plan`]). Empty for an f32 program: every buffer
    /// is `float` (or a 4-byte integer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub storage: storage::Storage,
}

impl CudaCode {
    /// The whole program as one NVRTC compilation unit: the prelude, then every function.
    pub fn source(&self) -> String {
        let mut s = self.prelude.clone();
        for f in &self.functions {
            s.push('\n');
            s.push_str(&f.text);
        }
        s
    }

    /// One function with the prelude (a unit of its own).
    pub fn unit(&self, name: &str) -> Option<String> {
        self.function(name)
            .map(|f| format!("{}\n{}", self.prelude, f.text))
    }

    /// The function called `name`.
    pub fn function(&self, name: &str) -> Option<&CudaFunction> {
        self.functions.iter().find(|f| f.name == name)
    }
}

/// Writes `extern "C" __global__ void name(params…, const kiln_dims dims, long long items)`
/// and opens its body.
pub(crate) fn signature(w: &mut text::W, name: &str, params: &[Param]) {
    let mut ps: Vec<String> = params
        .iter()
        .map(|p| format!("{} {}", p.c_type, p.name))
        .collect();
    ps.push("const kiln_dims dims".into());
    ps.push("long long items".into());
    w.open(format!(
        "extern \"C\" __global__ void {name}({})",
        ps.join(", ")
    ));
}

/// A parameter.
pub(crate) fn param(name: &str, c_type: &str) -> Param {
    Param {
        name: name.to_string(),
        c_type: c_type.to_string(),
    }
}

/// The grid-stride loop heads.
pub(crate) const FOR_THREADS: &str = "for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < items; i += (long long)gridDim.x * blockDim.x)";
/// The grid-stride loop over groups `g` of four items (`Work::Quads`), the first item
/// `i0 = 4g`; the body runs `u` over the group's items below `items`.
pub(crate) const FOR_QUADS: &str = "for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < ((items + 3) >> 2); g += (long long)gridDim.x * blockDim.x)";
/// The warps' loop (`Work::Warps`): warp `wi` of a block takes item `r = r0 + wi`, `live`
/// when that is an item. Every thread of the block runs the same iterations (a warp past
/// the end makes the same shuffle calls with nothing to sum), as the host shim's
/// shuffles need. Declares `width` (lanes a warp), `warps`, `wi` and `lane` first; a block
/// of fewer than 32 threads is one warp of `blockDim.x` lanes.
pub(crate) const WARPS_HEAD: &str = "const unsigned width = kiln_width();
const unsigned warps = blockDim.x < 32u ? 1u : blockDim.x / 32u;
const unsigned wi = threadIdx.x / width;
const unsigned lane = threadIdx.x % width;";
pub(crate) const FOR_WARPS: &str = "for (long long r0 = (long long)blockIdx.x * warps; r0 < items; r0 += (long long)gridDim.x * warps)";
pub(crate) const FOR_BLOCKS: &str = "for (long long r = blockIdx.x; r < items; r += gridDim.x)";
/// The loop over a row's elements owned by this thread.
pub(crate) fn for_cols(n: &str) -> String {
    format!("for (long long j = threadIdx.x; j < {n}; j += blockDim.x)")
}
