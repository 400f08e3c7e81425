//! Which of the 16-bit float kernels this CPU and system can run, and which runs best.

use super::*;

/// The kernel that `--gemm-type 16bit` runs on this CPU: the tiles where there are tiles,
/// else `VDPBF16PS` where it is faster than f32, else `VFMADD231PH` where there is
/// AVX512-FP16; `Err` says why none.
pub(crate) fn kernel() -> Result<Kernel16, String> {
    match (tiles_available(), dot_faster_than_f32(), half_available()) {
        (Ok(()), _, _) => Ok(Kernel16::Tiles),
        (Err(_), Ok(()), _) => Ok(Kernel16::Dot),
        (Err(_), Err(_), Ok(())) => Ok(Kernel16::Half),
        (Err(tiles), Err(dot), Err(half)) => Err(format!("{tiles}, {dot}, and {half}")),
    }
}

/// Whether the CPU has `VDPBF16PS` (AVX512-BF16) and the AVX-512 that packs for it.
pub(crate) fn dot_available() -> Result<(), &'static str> {
    if !is_x86_feature_detected!("avx512bf16") {
        return Err("this CPU has no AVX-512 bf16 dot products (AVX512-BF16: AMD Zen 4 or later)");
    }
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
        return Err("this CPU has AVX512-BF16 but no AVX-512BW for packing the operands");
    }
    Ok(())
}

/// Whether the CPU has AVX512-FP16 (`VFMADD231PH`: Intel Xeons of the 4th generation
/// on) and the AVX-512 that packs for it.
pub(crate) fn half_available() -> Result<(), &'static str> {
    if !is_x86_feature_detected!("avx512fp16") {
        return Err("this CPU has no AVX-512 fp16 arithmetic (AVX512-FP16: Intel Xeon 4th generation or later)");
    }
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16"))
    {
        return Err("this CPU has AVX512-FP16 but not the AVX-512 (F, BW, VL, BF16) that packs the operands");
    }
    Ok(())
}

/// Whether `VDPBF16PS` is there and multiplies-adds faster than f32 FMAs. AMD's cores
/// (Zen 4, Zen 5) issue it at the rate of an f32 FMA, with twice the terms (by published
/// instruction tables; not yet measured by kiln on one); Intel's
/// without AMX are left out: on a Xeon VM that has AVX512-BF16 but no tiles it issued at
/// a quarter of the FMA's rate, half its multiply-adds (measured 2026-11-27, see
/// `docs/PERFORMANCE.md`), so bf16 products there would be slower than f32 ones.
/// `--gemm-type dot` runs it all the same.
pub(super) fn dot_faster_than_f32() -> Result<(), String> {
    dot_available().map_err(|why| why.to_string())?;
    // CPUID leaf 0: the vendor string in EBX, EDX, ECX.
    let leaf = std::arch::x86_64::__cpuid(0);
    let vendor: Vec<u8> = [leaf.ebx, leaf.edx, leaf.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    if vendor != b"AuthenticAMD" {
        return Err(format!(
            "its AVX-512 bf16 dot products are slower than f32 FMAs on {} CPUs without AMX \
             (--gemm-type dot runs them all the same)",
            String::from_utf8_lossy(&vendor)
        ));
    }
    Ok(())
}

/// Whether this CPU has AMX tiles with bf16 products and the kernel lets the process use
/// them (Linux grants the tile data state on request: `arch_prctl(ARCH_REQ_XCOMP_PERM)`).
/// `Err` says why not.
pub(crate) fn tiles_available() -> Result<(), &'static str> {
    static AVAILABLE: OnceLock<Result<(), &'static str>> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // CPUID leaf 7, sub-leaf 0: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
        let leaf = std::arch::x86_64::__cpuid_count(7, 0);
        if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
            return Err("this CPU has no AMX bf16 tiles (Intel Xeon 4th generation or later)");
        }
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16"))
        {
            return Err("this CPU has AMX but not the AVX-512 (F, BW, BF16) that packs the operands");
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call with integer arguments.
        let r = unsafe {
            libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
        };
        if r != 0 {
            return Err("the operating system did not grant the AMX tile state (Linux 5.16 or later grants it)");
        }
        Ok(())
    })
}
