//! The GPU tests' helpers, shared by `tests/common` and `tests/train_common` (and so
//! by every test binary that runs GPU tests, on a GPU or on the emulated device).

/// For a test that needs a GPU: `Some(info)` when CUDA is usable; otherwise prints
/// `skipped: <reason>` and returns `None`, or fails when `KILN_REQUIRE_CUDA=1` (what a GPU
/// runner sets, so that a broken installation cannot pass as a skip).
pub fn require_cuda_or_skip() -> Option<kiln_exec::cuda::CudaInfo> {
    let require = std::env::var(kiln_exec::cuda::REQUIRE_CUDA_ENV).ok();
    kiln_exec::cuda::skip_or_fail(cuda_available(), require.as_deref())
}

/// Turns the emulated CUDA device on for this test process when `KILN_CUDA_EMULATE` says
/// so (as the command line does for the `kiln` it starts), once, before any CUDA call.
pub fn emulation() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        use kiln_exec::cuda::emulate;
        let var = |k: &str| std::env::var(k).ok();
        emulate::configure(
            var(emulate::EMULATE_ENV).as_deref(),
            var(emulate::REFUSE_BIAS_GRAD_ENV).is_some(),
            var("CXX"),
        );
    });
}

/// Whether this test process emulates the CUDA device ([`emulation`]).
pub fn emulated() -> bool {
    emulation();
    kiln_exec::cuda::emulate::emulated()
}

/// [`kiln_exec::cuda::cuda_available`], the emulation set first ([`emulation`]).
pub fn cuda_available() -> Result<kiln_exec::cuda::CudaInfo, String> {
    emulation();
    kiln_exec::cuda::cuda_available()
}
