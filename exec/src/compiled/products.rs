//! How the compiled executor runs its large matrix products: in f32 through `gemm`, or
//! with 16-bit operands on one of the kernels this CPU has ([`Kernel16`],
//! [`GemmType`]), chosen per executor or for the process (`--gemm-type`).

use std::sync::Mutex;

pub use kiln_matmul::{matmul16, Kernel16};

/// How the compiled executor runs its large matrix products (`matmul`, `linear`): in f32,
/// or with 16-bit operands on one of the [`Kernel16`]s. `kiln … --gemm-type` and
/// `train.gemm_type` choose it, as Marian's `--gemm-type` and fairseq's `--bf16` do (f32
/// where neither does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmType {
    /// f32 operands and sums: the compiled executor's default.
    F32,
    /// The best 16-bit kernel this CPU has ([`Kernel16::best`]).
    Best16,
    /// This kernel, where the CPU can run it, fast or not (for measuring).
    Kernel(Kernel16),
}

impl GemmType {
    /// The names [`GemmType::parse`] takes, for `--gemm-type` and `train.gemm_type`.
    pub const NAMES: [&'static str; 7] = ["f32", "16bit", "amx", "dot", "fp16", "int16", "int8"];

    /// `f32`, `16bit` (the best 16-bit kernel), or a kernel's [key](Kernel16::key).
    pub fn parse(name: &str) -> Option<GemmType> {
        match name {
            "f32" => Some(GemmType::F32),
            "16bit" => Some(GemmType::Best16),
            _ => Kernel16::ALL
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
    pub fn kernel(self) -> Result<Option<Kernel16>, String> {
        match self {
            GemmType::F32 => Ok(None),
            GemmType::Best16 => Kernel16::best().map(Some),
            GemmType::Kernel(k) => k.available().map(|()| Some(k)),
        }
    }
}

/// The products of the compiled executors this process builds, where
/// [`set_process_gemm_type`] chose them.
pub(crate) static PROCESS_GEMM: Mutex<Option<Option<Kernel16>>> = Mutex::new(None);

/// Makes every compiled executor this process builds from now on run its large products
/// as `t` says (what the CLI's `--gemm-type` does). Returns
/// the kernel (`None`: f32), or why this CPU cannot run it, and then changes nothing.
pub fn set_process_gemm_type(t: GemmType) -> Result<Option<Kernel16>, String> {
    let kernel = t.kernel()?;
    *PROCESS_GEMM.lock().unwrap_or_else(|p| p.into_inner()) = Some(kernel);
    Ok(kernel)
}

/// The process's choice of products ([`set_process_gemm_type`]; `Some(None)`: f32), where
/// it made one: it overrides what an artifact records (`--precision int8`).
pub fn process_choice() -> Option<Option<Kernel16>> {
    *PROCESS_GEMM.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a new compiled executor runs its large products with (`None`: f32): the
/// process's choice ([`set_process_gemm_type`]), else f32.
pub fn default_products() -> Option<Kernel16> {
    PROCESS_GEMM
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .flatten()
}
