//! The 16-bit kernels ([`Kernel16`]): which this CPU can run, which runs best, and a
//! safe product on slices ([`matmul16`]).

/// The instructions that multiply in 16 bits (operands rounded to bf16 or scaled into
/// fp16) where the large matrix products run in 16 bits (kiln's `--gemm-type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel16 {
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
    /// int8 operands (each column of the right one, a weight's output channel, and each
    /// row of the left one scaled by `127 / max|·|` and rounded) and exact int32 sums over
    /// the whole of `k`, for inference: AMX tiles' `TDPBUSD`, AVX-512 VNNI's `VPDPBUSD`,
    /// AVX-VNNI's, or AVX2's
    /// `VPMADDUBSW` (the same sums, so the same bits). Never [`Kernel16::best`]: it
    /// rounds each operand to 8 bits, which a translation takes (within 0.3 BLEU) and
    /// training does not. No column sums: a product that asks for them runs in f32.
    Int8,
}

impl Kernel16 {
    /// The 16-bit kernels (training's and inference's mixed precision), available here or
    /// not.
    pub const SIXTEEN_BIT: [Kernel16; 4] = [
        Kernel16::Tiles,
        Kernel16::Dot,
        Kernel16::Half,
        Kernel16::Int16,
    ];

    /// Every kernel, available here or not: the 16-bit ones and [`Kernel16::Int8`].
    pub const ALL: [Kernel16; 5] = [
        Kernel16::Tiles,
        Kernel16::Dot,
        Kernel16::Half,
        Kernel16::Int16,
        Kernel16::Int8,
    ];

    /// The instructions' name, for messages and benchmark labels.
    pub fn name(self) -> &'static str {
        match self {
            Kernel16::Tiles => "AMX tiles",
            Kernel16::Dot => "AVX-512 VDPBF16PS",
            Kernel16::Half => "AVX512-FP16 VFMADD231PH",
            Kernel16::Int16 => "AVX2 VPMADDWD (int16)",
            Kernel16::Int8 => int8_name(),
        }
    }

    /// Its name for `--gemm-type` and `train.gemm_type`.
    pub fn key(self) -> &'static str {
        match self {
            Kernel16::Tiles => "amx",
            Kernel16::Dot => "dot",
            Kernel16::Half => "fp16",
            Kernel16::Int16 => "int16",
            Kernel16::Int8 => "int8",
        }
    }

    /// `Ok` where this CPU (and system) can run the kernel, fast or not; else why not.
    pub fn available(self) -> Result<(), String> {
        match self {
            Kernel16::Tiles => crate::float16::tiles_available(),
            Kernel16::Dot => crate::float16::dot_available(),
            Kernel16::Half => crate::float16::half_available(),
            Kernel16::Int16 => int16_available(),
            Kernel16::Int8 => int8_available(),
        }
        .map_err(|why| format!("{} cannot run here: {why}", self.name()))
    }

    /// The kernel this CPU runs best: the tiles where there are tiles, else `VDPBF16PS`
    /// where it is faster than f32 products, else `VFMADD231PH` where there is
    /// AVX512-FP16, else `VPMADDWD` where there is AVX2 but no AVX-512; else why there is
    /// none, as a sentence.
    pub fn best() -> Result<Kernel16, String> {
        crate::float16::kernel().or_else(|why| match int16_faster_than_f32() {
            Ok(()) => Ok(Kernel16::Int16),
            Err(int16) => Err(format!(
                "16-bit matrix products need AMX tiles, fast AVX-512 bf16 dot products, \
                 AVX512-FP16 or AVX2 without AVX-512: {why}, and {int16}"
            )),
        })
    }

    /// Whether the kernel sums in int32 ([`Kernel16::Int16`]: `int16`'s driver).
    pub fn is_int16(self) -> bool {
        self == Kernel16::Int16
    }

    /// Whether its operands are integers ([`Kernel16::Int16`], [`Kernel16::Int8`]).
    pub fn is_integer(self) -> bool {
        matches!(self, Kernel16::Int16 | Kernel16::Int8)
    }
}

/// [`Kernel16::Int8`]'s instructions on this CPU.
fn int8_name() -> &'static str {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return match crate::int8::Isa::best() {
        Some(crate::int8::Isa::Amx) => "AMX TDPBUSD (int8)",
        Some(crate::int8::Isa::Vnni512) => "AVX-512 VNNI VPDPBUSD (int8)",
        Some(crate::int8::Isa::AvxVnni) => "AVX-VNNI VPDPBUSD (int8)",
        _ => "AVX2 VPMADDUBSW (int8)",
    };
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    "int8"
}

/// Whether this CPU runs [`Kernel16::Int8`].
fn int8_available() -> Result<(), &'static str> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return crate::int8::available();
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    Err("kiln's int8 products run only on x86-64 CPUs under Linux")
}

/// Whether this CPU runs [`Kernel16::Int16`].
fn int16_available() -> Result<(), &'static str> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return crate::int16::available();
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    Err("kiln's int16 products run only on x86-64 CPUs under Linux")
}

/// Whether [`Kernel16::Int16`] runs here and faster than f32 products.
fn int16_faster_than_f32() -> Result<(), &'static str> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return crate::int16::faster_than_f32();
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    Err("kiln's int16 products run only on x86-64 CPUs under Linux")
}

/// `c[m × n] = a[m × k]·b[k × n]` (row-major, contiguous) with the operands rounded to
/// bf16 and the sums in f32 (scaled into fp16 or int16 for those kernels), with `kernel`'s
/// instructions: the products that kiln's `--gemm-type 16bit` runs, for benchmarks and
/// for users' own products. An error where the CPU cannot run the kernel, or where a slice's
/// length is not its matrix's.
pub fn matmul16(
    kernel: Kernel16,
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
    let mat = |p: &[f32], cols: usize| crate::Mat {
        ptr: p.as_ptr(),
        rs: cols as isize,
        cs: 1,
    };
    // SAFETY: the kernel can run; the slices hold the matrices (checked above) and `c`, a
    // unique borrow, overlaps neither operand.
    unsafe {
        let b = crate::float16::Rhs::Mat(mat(b, n));
        let dst = crate::Dst::new(c.as_mut_ptr(), n as isize, false);
        crate::float16::gemm(kernel, (m, k), mat(a, k), crate::Member::plain(n, b, dst))
    };
    Ok(())
}
