//! How the compiled executor runs its large matrix products: in f32 through `gemm`, or
//! with 16-bit operands on one of the kernels this CPU has ([`Bf16Kernel`],
//! [`GemmType`]), chosen per executor or for the process (`--gemm-type`).

use std::sync::Mutex;

use super::*;

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
pub(crate) static PROCESS_GEMM: Mutex<Option<Option<Bf16Kernel>>> = Mutex::new(None);

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
pub(crate) fn int16_available() -> Result<(), &'static str> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return int16::available();
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    Err("kiln's int16 products run only on x86-64 CPUs under Linux")
}

/// Whether [`Bf16Kernel::Int16`] runs here and faster than f32 products.
pub(crate) fn int16_faster_than_f32() -> Result<(), &'static str> {
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
