//! The CUDA device emulated on the host: the CUDA executor's whole host side (binding,
//! the device arena, views, launches, cuBLAS and cuBLASLt calls, the device optimizer,
//! the resident decoder) run on a machine without a GPU, for tests.
//!
//! In: the emulation turned on for the process ([`configure`]: the command line and the
//! tests' helpers do, from `KILN_CUDA_EMULATE=1` at their edge), then what
//! `device::Device` is asked for. Out: `HostDevice` — the same operations on
//! host memory (with `KILN_CUDA_EMULATE=dry`, only checked, see [`dry`]: what is
//! left to time is the executor's own host work):
//! - **memory**: every buffer is host memory at its real address, registered with its
//!   length; every copy, GEMM operand and launch pointer is checked to lie inside one
//!   live buffer (an error naming the call, not a corrupted heap);
//! - **kernels**: the unit's CUDA C is compiled by the host C++ compiler ([`configure`]'s,
//!   from `$CXX`; else `g++`) under `codegen::cuda::host::FIBER_SHIM` into a shared library (cached by
//!   the source's hash in `$TMPDIR/kiln-cuda-emulate`), with one `extern "C"`
//!   trampoline per function; a launch runs `min(grid, 2)` blocks of `min(block, 32)`
//!   threads, each thread a fiber that runs to its next barrier in turn — the kernels
//!   loop over their items with a grid stride and take any power-of-two block, so the
//!   barriers, block reductions, one warp's lanes and the grid strides all run (more
//!   threads cost more than they show: 64 doubles the time of a training run);
//! - **cuBLAS / cuBLASLt**: column-major `C = op(A)·op(B) + β·C` (batched with element
//!   strides; bias along `m` and ReLU for the cuBLASLt epilogue, or the bias gradient
//!   `Σ_k op(A)` along `m`), f64 accumulation,
//!   bf16 operands and results rounded as the kernels' `kiln_f32_to_bf16` (the bias of the
//!   epilogue in the result's type), TF32 math
//!   rounding the f32 operands to 10 mantissa bits; the leading dimensions are checked
//!   as cuBLAS checks them.
//!
//! Slow, and for tiny models: it proves the executor's logic, not the GPU's numbers, and
//! with fibers no two GPU threads run at once (`compiler/tests/cuda_host.rs` runs the
//! kernels on real threads for that). NCCL is not emulated
//! (`nccl_available` still needs the library).
//!
//! The device itself (`emulate/host.rs`) is test support: it is built only with the
//! `emulate` feature, which the workspace's tests turn on. Without it this module is the
//! switch alone, and asking for the emulation makes [`missing`] say how to build it in.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Mutex;

#[cfg(feature = "emulate")]
mod host;
#[cfg(feature = "emulate")]
pub(crate) use host::{HostDevice, HostMem};

/// The variable the command line and the tests' helpers read to turn the emulation on
/// (`1`, or `dry`): test support, read at their edge, never by this crate.
pub const EMULATE_ENV: &str = "KILN_CUDA_EMULATE";

/// With the emulation on, any value (read as [`EMULATE_ENV`] is) makes the emulated
/// cuBLASLt refuse bias-gradient epilogues (no algorithm), so that the executor's
/// fallback for a GPU without one runs.
pub const REFUSE_BIAS_GRAD_ENV: &str = "KILN_CUDA_EMULATE_NO_BIAS_GRAD";

/// 0: off, 1: the full emulation, 2: dry, 3: asked for in a build without it.
static MODE: AtomicU8 = AtomicU8::new(0);
pub(crate) static REFUSE_BIAS_GRADS: AtomicBool = AtomicBool::new(false);
static CXX: Mutex<Option<String>> = Mutex::new(None);

/// Sets this process's emulation before any CUDA call: `emulate` is the value of
/// [`EMULATE_ENV`] (`1` on, `dry` dry, else off), `refuse_bias_grads` whether
/// [`REFUSE_BIAS_GRAD_ENV`] is set, `cxx` the host C++ compiler (`None`: `g++`).
pub fn configure(emulate: Option<&str>, refuse_bias_grads: bool, cxx: Option<String>) {
    let mode = match emulate.map(str::trim) {
        Some("1" | "dry") if !cfg!(feature = "emulate") => 3,
        Some("1") => 1,
        Some("dry") => 2,
        _ => 0,
    };
    MODE.store(mode, Ordering::Relaxed);
    REFUSE_BIAS_GRADS.store(refuse_bias_grads, Ordering::Relaxed);
    *CXX.lock().unwrap_or_else(|p| p.into_inner()) = cxx.filter(|c| !c.is_empty());
}

/// The host C++ compiler the emulation compiles kernels with.
pub fn cxx() -> String {
    CXX.lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_else(|| "g++".to_string())
}

/// Whether this process emulates the CUDA device ([`configure`]).
pub fn emulated() -> bool {
    mode().is_some()
}

/// Whether the emulation is *dry* (`KILN_CUDA_EMULATE=dry`): every call is checked as
/// in the full emulation (buffers, launch parameters, leading dimensions) and host
/// copies are made, but no kernel, GEMM, memset or device-to-device copy runs. What
/// remains is the CUDA executor's own host work per step — binding, planning views,
/// issuing launches — which `kiln bench --executor cuda` then times at full size (the
/// device's memory is allocated lazily and never touched by the skipped work). The
/// results are not the computation's.
pub fn dry() -> bool {
    mode() == Some(true)
}

/// Why the emulation asked for ([`configure`]) cannot run: this build leaves it out.
pub fn missing() -> Option<String> {
    (MODE.load(Ordering::Relaxed) == 3).then(|| {
        format!(
            "{EMULATE_ENV} asks for the emulated CUDA device, which this build of kiln \
             leaves out (it is test support); build with `--features emulate`"
        )
    })
}

/// `Some(dry)` when emulating.
fn mode() -> Option<bool> {
    match MODE.load(Ordering::Relaxed) {
        1 => Some(false),
        2 => Some(true),
        _ => None,
    }
}
