//! Matrix products with 16-bit operands and f32 accumulation: the CPU's mixed precision
//! (`KILN_CPU_BF16=1`), opt-in. Three kernels share the packing and the driver here:
//!
//! - [`Kernel::Tiles`]: Intel AMX tiles (`TDPBF16PS`, 16 × 16 results and 32 terms each
//!   per instruction), on Xeons of the 4th generation on;
//! - [`Kernel::Dot`]: AVX-512's `VDPBF16PS` (16 results, 2 terms each per instruction),
//!   on AMD Zen 4 and later, where it multiplies-adds at twice the rate of f32 FMAs;
//! - [`Kernel::Half`]: AVX512-FP16's `VFMADD231PH` (32 fp16 multiply-adds per
//!   instruction, twice an f32 FMA's), on Intel Xeons of the 4th generation on whose VM
//!   hides their AMX.
//!
//! In: the same strided f32 operands as [`super::gemm::gemm_one`]. For the first two,
//! each operand is rounded to bf16 (to nearest, ties to even, a subnormal to zero) as it
//! is packed, by AVX512-BF16's `VCVTNE2PS2BF16` (so all three kernels need it); the
//! products of pairs are summed in f32, so a result differs from the f32 product by about
//! the inputs' rounding, at most 2⁻⁹ relative per operand, as with PyTorch's bf16
//! autocast or cuBLAS in bf16. Both instructions treat subnormal bf16 inputs as zero and
//! flush subnormal results. For fp16, each row of `a` and column of `b` is first scaled
//! by a power of two so that no fp16 sum can overflow ([`fp16_scale`]), then rounded to
//! fp16 (2⁻¹¹ relative); sums of 64 terms are kept in fp16 and added up in f32, and the
//! scales are undone exactly at the end (see [`half_block`]).
//!
//! Every result element is summed over `k` in the same order whatever the threads, so a
//! product gives the same bits on every run and with any number of threads (the
//! kernels may differ from each other in the last bits).
//!
//! No well-kept crate offers these products on stable Rust (the `gemm` crate's kernels
//! are f32/f64/f16-through-f32; the `x86_amx_intrinsics` are nightly-only), so the eight
//! tile instructions used here are written as inline assembly; `VDPBF16PS` and
//! `VFMADD231PH` are stable intrinsics.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::gemm::{ColumnSums, Mat, SUM_AXES};
pub(crate) use super::gemm::{Epilogue, Member};

/// Rows and columns of a result tile; the `k` of one tile product is 32 (bf16 pairs).
const T: usize = 16;
const TK: usize = 32;
/// bf16 elements of one packed tile (16 rows of 64 bytes).
const TILE: usize = T * TK;

pub(crate) use super::Bf16Kernel as Kernel;

/// The kernel that `KILN_CPU_BF16=1` runs on this CPU: the tiles where there are tiles,
/// else `VDPBF16PS` where it is faster than f32, else `VFMADD231PH` where there is
/// AVX512-FP16; `Err` says why none.
pub(crate) fn kernel() -> Result<Kernel, String> {
    match (tiles_available(), dot_faster_than_f32(), half_available()) {
        (Ok(()), _, _) => Ok(Kernel::Tiles),
        (Err(_), Ok(()), _) => Ok(Kernel::Dot),
        (Err(_), Err(_), Ok(())) => Ok(Kernel::Half),
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
/// `KILN_CPU_BF16=dot` runs it all the same.
fn dot_faster_than_f32() -> Result<(), String> {
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
             (KILN_CPU_BF16=dot runs them all the same)",
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

/// `x` rounded to bf16 as AVX512-BF16's `VCVTNEPS2BF16` rounds it (the packing loops'
/// vectors use that instruction; this is their scalar edge): to nearest, ties to even; a
/// NaN stays a NaN (made quiet); a subnormal `x` becomes a zero of its sign. As its bits.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    (if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else if b & 0x7f80_0000 == 0 {
        (b >> 16) & 0x8000
    } else {
        rounded
    }) as u16
}

/// `x` rounded to bf16 and back: what a product on the tiles reads of an operand.
#[cfg(test)]
fn round_bf16(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// `x` rounded to fp16 (to nearest, ties to even; subnormals kept, past 65504 infinite),
/// as its bits.
#[inline(always)]
fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// The 16-bit value a kernel multiplies for the operand element `x`: `x` rounded to bf16,
/// or (`HALF`) `x · s` rounded to fp16, `s` its row's or column's power-of-two scale.
#[inline(always)]
fn to16<const HALF: bool>(x: f32, s: f32) -> u16 {
    if HALF {
        f16_bits(x * s)
    } else {
        bf16_bits(x)
    }
}

/// The 16-bit values ([`to16`]) of 16 elements `x` with their scales `s` (read only
/// where `HALF`), in order: one instruction each, `VCVTNEPS2BF16` (bf16) or
/// `VCVTPS2PH` (fp16, after the scaling).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
fn to16x16<const HALF: bool>(x: __m512, s: __m512) -> __m256i {
    if HALF {
        _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, s))
    } else {
        // SAFETY: 16 bf16 values are 256 bits, as `__m256i`.
        unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x)) }
    }
}

/// Lane `i` of the 16-bit pairs a packed tile row holds: [`to16x16`] of `lo`'s element
/// `i` in the low half, of `hi`'s in the high half (`s` as there).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
fn pairs16x16<const HALF: bool>(lo: __m512, hi: __m512, s: __m512) -> __m512i {
    // `lo`'s 16 values, then `hi`'s.
    let both = if HALF {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(to16x16::<HALF>(lo, s)),
            to16x16::<HALF>(hi, s),
        )
    } else {
        // SAFETY: 32 bf16 values are 512 bits, as `__m512i`.
        unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
    };
    // Element `2i` from `i`, `2i + 1` from `16 + i`.
    let order = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    _mm512_permutexvar_epi16(order, both)
}

/// The 16 × 16 32-bit elements of `z` transposed: lane `j` of row `r` of the result is
/// lane `r` of `z[j]`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn transpose16(z: &[__m512i; 16]) -> [__m512i; 16] {
    // Pairs of rows interleaved by 32 bits, then by 64: `u[4i + c]`, in its 128-bit lane
    // `l`, holds lane `4l + c` of `z[4i..4i + 4]`.
    let t: [__m512i; 16] = std::array::from_fn(|q| {
        let (a, b) = (z[q & !1], z[q | 1]);
        if q % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    let u: [__m512i; 16] = std::array::from_fn(|q| {
        let (i, c) = (q / 4, q % 4);
        let (a, b) = (t[4 * i + c / 2], t[4 * i + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // Then 128-bit lanes: row `4l + c` gathers lane `l` of `u[c]`, `u[4 + c]`, `u[8 + c]`,
    // `u[12 + c]`.
    let mut out = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let (a, b, cc, d) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
        let (p0, p1) = (
            _mm512_shuffle_i32x4::<0x44>(a, b),
            _mm512_shuffle_i32x4::<0xee>(a, b),
        );
        let (q0, q1) = (
            _mm512_shuffle_i32x4::<0x44>(cc, d),
            _mm512_shuffle_i32x4::<0xee>(cc, d),
        );
        out[c] = _mm512_shuffle_i32x4::<0x88>(p0, q0);
        out[4 + c] = _mm512_shuffle_i32x4::<0xdd>(p0, q0);
        out[8 + c] = _mm512_shuffle_i32x4::<0x88>(p1, q1);
        out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(p1, q1);
    }
    out
}

/// `dst[i] = to16::<HALF>(src[i], s)` for the `src.len()` elements of a run.
///
/// # Safety
/// The CPU must have AVX-512F, BW and BF16; `dst` holds `src.len()` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn convert<const HALF: bool>(src: &[f32], s: f32, dst: &mut [u16]) {
    let n = src.len();
    assert!(dst.len() >= n);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: elements `i..i + 16` of `src` and `dst` exist (checked).
        unsafe {
            let h = to16x16::<HALF>(_mm512_loadu_ps(src.as_ptr().add(i)), _mm512_set1_ps(s));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, h);
        }
        i += 16;
    }
    for i in i..n {
        dst[i] = to16::<HALF>(src[i], s);
    }
}

/// Terms each fp16 sum of [`half_block`] takes before it is added to its f32 sum: four
/// packed tiles' 16 pair rows (each lane sums the even or the odd `k` of its column).
const FLUSH_TILES: usize = 4;
/// The operands' fp16 scales bring each row of `a`'s largest magnitude into
/// `[2^(TOP_A - 1), 2^TOP_A)` and each column of `b`'s into `[2^(TOP_B - 1), 2^TOP_B)`,
/// so that no term reaches `2^(TOP_A + TOP_B)` and no fp16 sum of `FLUSH_TILES · 16`
/// terms reaches 2^15 (fp16 overflows past 65504).
const TOP_A: i32 = 5;
const TOP_B: i32 = 4;
const _: () = assert!((FLUSH_TILES * T) << (TOP_A + TOP_B) <= 1 << 15);

/// The bits of the largest magnitude in `x`: the order of non-negative floats is their
/// bits' order (a NaN is above infinity).
#[target_feature(enable = "avx512f")]
fn max_bits(x: &[f32]) -> u32 {
    x.iter().fold(0, |m, &v| m.max(v.to_bits() & 0x7fff_ffff))
}

/// `max[i]` raised to the bits of `|x[i]|` where those are larger.
#[target_feature(enable = "avx512f")]
fn max_bits_into(max: &mut [u32], x: &[f32]) {
    for (m, &v) in max.iter_mut().zip(x) {
        *m = (*m).max(v.to_bits() & 0x7fff_ffff);
    }
}

/// The fp16 scale (a power of two: `s` and `1 / s`, both exact) of a row or column
/// whose largest magnitude has the bits `max` ([`max_bits`]): `s` brings the largest
/// into `[2^(top - 1), 2^top)`. A row of zeros, or with an infinity or a NaN, keeps 1
/// (the infinity or NaN then reaches its results, as in f32).
fn fp16_scale(max: u32, top: i32) -> (f32, f32) {
    if max == 0 || max >= 0x7f80_0000 {
        return (1.0, 1.0);
    }
    // `max` is in [2^e, 2^(e + 1)) (below for a subnormal, which is then brought into
    // range from below); both scales stay normal floats.
    let e = (max >> 23) as i32 - 127;
    let shift = (top - 1 - e).clamp(-126, 126);
    (
        f32::from_bits(((127 + shift) as u32) << 23),
        f32::from_bits(((127 - shift) as u32) << 23),
    )
}

/// The 64-byte tile configuration (palette 1) that `LDTILECFG` loads: tiles 0–3 the
/// 16 × 16 f32 results, 4–5 the left operand's 16 × 32 bf16, 6–7 the right operand's
/// 16 pair rows × 16 columns.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut c = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    let mut t = 0;
    while t < 8 {
        c.colsb[t] = 64;
        c.rows[t] = 16;
        t += 1;
    }
    c
};

/// Packs rows `[i0, i0 + 16)` of `a` (`m × k`) as `kb` tiles of 16 rows × 32 16-bit
/// values ([`to16`]), zero past `m` and `k`. Where `HALF`, each row is scaled by its
/// [`fp16_scale`] (`TOP_A`), whose `1 / s` goes to `unscale` (one a row, 1 past `m`).
///
/// # Safety
/// The CPU must have AVX-512F, BW and BF16; `a` must address `m × k` valid elements; `out`
/// holds `kb · TILE`; with `HALF`, `unscale` holds 16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a<const HALF: bool>(
    a: Mat,
    (m, k): (usize, usize),
    i0: usize,
    unscale: &mut [f32],
    out: &mut [u16],
) {
    let rows = m.saturating_sub(i0).min(T);
    let unscale = if HALF { &mut unscale[..T] } else { unscale };
    // SAFETY: `a` addresses the tile's rows, `k` elements each; as the caller's.
    unsafe {
        with_line_scales::<HALF>((a, i0..i0 + rows, k, TOP_A), unscale, |scale| {
            pack_a_scaled::<HALF>(a, (m, k), i0, scale, out)
        })
    }
}

/// [`pack_a`] with the rows' scales given (`scale[r]` for row `i0 + r`; unread unless
/// `HALF`).
///
/// # Safety
/// As [`pack_a`]'s; `scale` holds 16 values.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a_scaled<const HALF: bool>(
    a: Mat,
    (m, k): (usize, usize),
    i0: usize,
    scale: &[f32],
    out: &mut [u16],
) {
    let kb = out.len() / TILE;
    let rows = m.saturating_sub(i0).min(T);
    let scale = &scale[..T];
    if a.cs != 1 {
        // Strided: element by element (a transposed `a` takes `pack_a_columns`).
        out.fill(0);
        for p in 0..k {
            let (t, q) = (p / TK, p % TK);
            let col = unsafe { a.ptr.offset(i0 as isize * a.rs + p as isize * a.cs) };
            for (r, &s) in scale.iter().enumerate().take(rows) {
                let x = unsafe { *col.offset(r as isize * a.rs) };
                out[t * TILE + r * TK + q] = to16::<HALF>(x, s);
            }
        }
        return;
    }
    for (r, &s) in scale.iter().enumerate() {
        if r >= rows {
            for t in 0..kb {
                out[t * TILE + r * TK..t * TILE + (r + 1) * TK].fill(0);
            }
            continue;
        }
        // SAFETY: row `i0 + r` of `a` holds `k` elements (and is in the first-level cache
        // after its scan, where `HALF`).
        let row = unsafe { std::slice::from_raw_parts(a.ptr.offset((i0 + r) as isize * a.rs), k) };
        for t in 0..kb {
            let dst = &mut out[t * TILE + r * TK..t * TILE + (r + 1) * TK];
            let src = &row[(t * TK).min(k)..((t + 1) * TK).min(k)];
            if src.len() < TK {
                dst.fill(0);
            }
            unsafe { convert::<HALF>(src, s, dst) };
        }
    }
}

/// Packs the row tiles of `a` from row `i0` on into `out` (whole panels of `kb` tiles,
/// as [`pack_a`]) where `a` is stored transposed (`rs == 1`: each `k` index is a row of
/// `m` contiguous elements, as the input of a weight gradient `xᵀ·dy`). It reads each of
/// those rows a whole group of panels wide (contiguous, which the prefetchers follow),
/// where [`pack_a`] would read 64 bytes of each row per panel.
///
/// Where `HALF`, each row is scaled by its [`fp16_scale`] (`TOP_A`), found from a first
/// pass over the group's rows (which leaves them in the core's cache for the second),
/// and its `1 / s` goes to `unscale` (one a row of the group, 1 past `m`).
///
/// # Safety
/// The CPU must have AVX-512F, BW and BF16; `a` must address `m × k` valid elements with
/// `a.rs == 1`; with `HALF`, `unscale` holds a value for each row of `out`'s panels.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a_columns<const HALF: bool>(
    a: Mat,
    (m, k): (usize, usize),
    i0: usize,
    unscale: &mut [f32],
    (panel, out): (usize, &mut [u16]),
) {
    let rows = m.saturating_sub(i0).min(out.len() / panel * T);
    // SAFETY: `a` addresses the group's rows, `k` elements each; as the caller's.
    unsafe {
        with_line_scales::<HALF>((a, i0..i0 + rows, k, TOP_A), unscale, |scale| {
            pack_a_columns_scaled::<HALF>(a, (m, k), i0, scale, (panel, out))
        })
    }
}

/// `pack(scale)` with the fp16 scales of rows `rows` of `a` (at most 256; [`line_scales`]
/// over `k`, largest magnitude brought below `2^top`) where `HALF`: `scale[r]` the `s` of
/// row `rows.start + r` (1 past the rows), `unscale[r]` its `1 / s`. Without `HALF`
/// every scale is 1 and `unscale` is left alone.
///
/// # Safety
/// As [`line_scales`]' where `HALF`; `unscale` holds a value for each row `pack` reads.
#[target_feature(enable = "avx512f")]
unsafe fn with_line_scales<const HALF: bool>(
    (a, rows, k, top): (Mat, std::ops::Range<usize>, usize, i32),
    unscale: &mut [f32],
    pack: impl FnOnce(&[f32]),
) {
    let mut scale = [1f32; GROUP * T];
    if HALF {
        unscale.fill(1.0);
        // SAFETY: the caller's.
        unsafe { line_scales(a, rows, k, top, (&mut scale, unscale)) };
    }
    pack(&scale)
}

/// [`pack_a_columns`] with the rows' scales given (`scale[r]` for row `i0 + r`, one for
/// each row of `out`'s panels, padded to a multiple of 16; unread unless `HALF`).
///
/// # Safety
/// As [`pack_a_columns`]'s; `scale` holds a value for each row of `out`'s panels.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a_columns_scaled<const HALF: bool>(
    a: Mat,
    (m, k): (usize, usize),
    i0: usize,
    scale: &[f32],
    (panel, out): (usize, &mut [u16]),
) {
    let rows = m.saturating_sub(i0).min(out.len() / panel * T);
    let kb = panel / TILE;
    // SAFETY (the slices of `a` below): index `p` holds the `m` elements of its row.
    let src = |p: usize| unsafe {
        std::slice::from_raw_parts(a.ptr.offset(p as isize * a.cs).add(i0), rows)
    };
    // By 32 `k` indices (a tile's) and 16 rows: the rows' 16 values at each index, as
    // 16-bit, paired by index (even in the low half), transposed into the tile's 16 rows
    // of 16 pairs.
    for t in 0..kb {
        for r0 in (0..rows.next_multiple_of(T)).step_by(T) {
            let mask: u16 = if rows - r0 >= T {
                !0
            } else {
                (1 << (rows - r0)) - 1
            };
            let s = if HALF {
                // SAFETY: `scale` holds the panels' rows.
                unsafe { _mm512_loadu_ps(scale.as_ptr().add(r0)) }
            } else {
                _mm512_set1_ps(1.0)
            };
            let value = |q: usize| {
                let p = t * TK + q;
                if p >= k {
                    return _mm512_setzero_ps();
                }
                // SAFETY: index `p` holds rows `i0 + r0..` up to `rows` (masked).
                unsafe { _mm512_maskz_loadu_ps(mask, src(p).as_ptr().add(r0)) }
            };
            let z: [__m512i; 16] =
                std::array::from_fn(|j| pairs16x16::<HALF>(value(2 * j), value(2 * j + 1), s));
            let tile = &mut out[(r0 / T) * panel + t * TILE..][..TILE];
            for (r, row) in transpose16(&z).iter().enumerate() {
                // SAFETY: row `r` of the tile is 16 pairs, 64 bytes.
                unsafe { _mm512_storeu_si512(tile.as_mut_ptr().add(r * TK) as *mut _, *row) };
            }
        }
    }
    // Row tiles past `m` (the group's last panels) are zero.
    for r0 in (rows.next_multiple_of(T)..out.len() / panel * T).step_by(T) {
        out[(r0 / T) * panel..(r0 / T + 1) * panel].fill(0);
    }
}

/// Packs columns `[j0, j0 + 16)` of `b` (`k × n`) as `kb` tiles of 16 pair rows: row `r`
/// of tile `t` holds `b[32t + 2r, j], b[32t + 2r + 1, j]` for its 16 columns `j` (the
/// pairs `TDPBF16PS` multiplies), as 16-bit values ([`to16`]; where `HALF`, each column
/// scaled by its `scales[c]`, `c` from 0 at `j0`), zero past `k` and `n`. (A row-major
/// `b` a whole tile wide is packed by [`pack_b_group_scaled`], a group of panels at once.)
///
/// # Safety
/// The CPU must have AVX-512F, BW and BF16; `b` must address `k × n` valid elements; `out`
/// holds `kb · TILE`; with `HALF`, `scales` holds 16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b<const HALF: bool>(
    b: Mat,
    (k, n): (usize, usize),
    j0: usize,
    scales: &[f32],
    out: &mut [u16],
) {
    let cols = n.saturating_sub(j0).min(T);
    let at = |p: usize, j: usize| unsafe { *b.ptr.offset(p as isize * b.rs + j as isize * b.cs) };
    let s = |j: usize| if HALF { scales[j - j0] } else { 1.0 };
    if b.rs == 1 {
        // Stored transposed: a column's `k` values are contiguous. By tile: each column's
        // 32 values, as 16-bit, are 16 pairs; transposed, the tile's 16 pair rows.
        let kb = out.len() / TILE;
        for t in 0..kb {
            let z: [__m512i; 16] = std::array::from_fn(|c| {
                if c >= cols {
                    return _mm512_setzero_si512();
                }
                let s = _mm512_set1_ps(s(j0 + c));
                let half = |h: usize| {
                    let p = t * TK + h * T;
                    let left = k.saturating_sub(p).min(T);
                    let mask: u16 = if left == T { !0 } else { (1 << left) - 1 };
                    // SAFETY: column `j0 + c` holds `k` elements (masked past them).
                    let x = unsafe {
                        _mm512_maskz_loadu_ps(mask, b.ptr.offset((j0 + c) as isize * b.cs).add(p))
                    };
                    to16x16::<HALF>(x, s)
                };
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(half(0)), half(1))
            });
            for (j, row) in transpose16(&z).iter().enumerate() {
                // SAFETY: pair row `j` of tile `t` is 64 bytes of `out`.
                unsafe {
                    _mm512_storeu_si512(out.as_mut_ptr().add(t * TILE + j * TK) as *mut _, *row)
                };
            }
        }
        return;
    }
    out.fill(0);
    for p in 0..k {
        let base = (p / TK) * TILE + ((p % TK) / 2) * TK + (p & 1);
        for c in 0..cols {
            out[base + 2 * c] = to16::<HALF>(at(p, j0 + c), s(j0 + c));
        }
    }
}

/// Packs the column panels of `out` (whole panels of `panel` elements) from column `j0`
/// on. A row-major `b` is packed by pairs of rows, each row read the group's width at once
/// (contiguous, which the prefetchers follow) where one panel at a time would read 64
/// bytes of each row (the vocabulary projection's rows are 148 KB apart).
///
/// Where `HALF`, each column is scaled by its [`fp16_scale`] (`TOP_B`), found from a
/// first pass over the group's columns, and its `1 / s` goes to `unscale` (one a column
/// of the group, 1 past `n`).
///
/// # Safety
/// As [`pack_b`]; with `HALF`, `unscale` holds a value for each column of `out`'s panels.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b_group<const HALF: bool>(
    b: Mat,
    (k, n): (usize, usize),
    j0: usize,
    unscale: &mut [f32],
    (panel, out): (usize, &mut [u16]),
) {
    let cols = n.saturating_sub(j0).min(out.len() / panel * T);
    // `b`'s columns are the rows of `bᵀ`.
    let bt = b.transposed();
    // SAFETY: `b` addresses the group's columns, `k` elements each; as the caller's.
    unsafe {
        with_line_scales::<HALF>((bt, j0..j0 + cols, k, TOP_B), unscale, |scale| {
            pack_b_group_scaled::<HALF>(b, (k, n), j0, scale, (panel, out))
        })
    }
}

/// [`pack_b_group`] with the columns' scales given (`scale[c]` for column `j0 + c`, one
/// for each column of `out`'s panels; unread unless `HALF`).
///
/// # Safety
/// As [`pack_b`]'s; `scale` holds a value for each column of `out`'s panels.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b_group_scaled<const HALF: bool>(
    b: Mat,
    (k, n): (usize, usize),
    j0: usize,
    scale: &[f32],
    (panel, out): (usize, &mut [u16]),
) {
    let kb = panel / TILE;
    // Row-major panels a whole tile wide (the first `wide`): by pairs of rows, each row
    // read the width of those panels at once, its two rows' 16 columns of each panel
    // interleaved into the panel's pair row.
    let wide = if b.cs == 1 {
        (n.saturating_sub(j0) / T).min(out.len() / panel)
    } else {
        0
    };
    if wide > 0 {
        let width = wide * T;
        for pair in 0..kb * T {
            let p = 2 * pair;
            if p + 1 >= k {
                for q in 0..wide {
                    let dst = &mut out[q * panel + pair * 2 * T..][..2 * T];
                    for (c, d) in dst.chunks_exact_mut(2).enumerate() {
                        // SAFETY: row `p` (where `p < k`) holds columns `j0..j0 + width`.
                        let x = (p < k).then(|| unsafe {
                            *b.ptr.offset(p as isize * b.rs).add(j0 + q * T + c)
                        });
                        d[0] = x.map_or(0, |x| to16::<HALF>(x, scale[q * T + c]));
                        d[1] = 0;
                    }
                }
                continue;
            }
            // SAFETY: rows `p`, `p + 1` hold columns `j0..j0 + width`; `out` holds the
            // panels' pair rows, 64 bytes each; `scale` a value for each column.
            unsafe {
                let out_ptr = out.as_mut_ptr();
                let r0 = b.ptr.offset(p as isize * b.rs).add(j0);
                let r1 = r0.offset(b.rs);
                debug_assert!(j0 + width <= n);
                for q in 0..wide {
                    let s = if HALF {
                        _mm512_loadu_ps(scale.as_ptr().add(q * T))
                    } else {
                        _mm512_setzero_ps()
                    };
                    let pairs = pairs16x16::<HALF>(
                        _mm512_loadu_ps(r0.add(q * T)),
                        _mm512_loadu_ps(r1.add(q * T)),
                        s,
                    );
                    _mm512_storeu_si512(out_ptr.add(q * panel + pair * 2 * T) as *mut _, pairs);
                }
            }
        }
    }
    for (q, o) in out.chunks_exact_mut(panel).enumerate().skip(wide) {
        // SAFETY: as the caller's.
        unsafe { pack_b::<HALF>(b, (k, n), j0 + q * T, &scale[q * T..], o) }
    }
}

/// One 32 × 32 result block over the whole `k`: `c` (row stride `ldc` floats) is loaded
/// into tiles 0–3 if `load`, else they start at zero; `a0`, `a1` are the two row tiles'
/// packed panels, `b0`, `b1` the two column tiles', each `kb` tiles long.
///
/// # Safety
/// The tile configuration must be loaded; every pointer addresses what it says.
#[inline(always)]
unsafe fn block(
    c: *mut f32,
    ldc: usize,
    load: bool,
    (a0, a1, b0, b1): (*const u16, *const u16, *const u16, *const u16),
    kb: usize,
) {
    let cs = ldc * 4;
    let c1 = unsafe { c.add(T) };
    let c2 = unsafe { c.add(T * ldc) };
    let c3 = unsafe { c.add(T * ldc + T) };
    unsafe {
        if load {
            asm!(
                "tileloadd tmm0, [{c0} + {s}*1]",
                "tileloadd tmm1, [{c1} + {s}*1]",
                "tileloadd tmm2, [{c2} + {s}*1]",
                "tileloadd tmm3, [{c3} + {s}*1]",
                c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
                s = in(reg) cs, options(nostack, readonly),
            );
        } else {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
        }
        for t in 0..kb {
            let o = t * TILE;
            asm!(
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0.add(o), a1 = in(reg) a1.add(o),
                b0 = in(reg) b0.add(o), b1 = in(reg) b1.add(o),
                s = in(reg) 64usize, options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{c0} + {s}*1], tmm0",
            "tilestored [{c1} + {s}*1], tmm1",
            "tilestored [{c2} + {s}*1], tmm2",
            "tilestored [{c3} + {s}*1], tmm3",
            c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
            s = in(reg) cs, options(nostack),
        );
    }
}

/// The multiply-adds of one strip of 8 result rows × 32 columns over the packed `tiles`
/// of `a` (its 8 rows from row `in_tile` of each tile) and of the two column tiles `b0`,
/// `b1`: each pair row `p` of a tile is one 64-byte line of each column tile (16 columns
/// × 2 values of `k`), and each row's pair `p` (4 bytes at `2p` of its 32) is broadcast
/// to every lane pair (`broadcast`) and multiplied with them (`fma(acc, a, b)`). Shared
/// by [`dot_block`] and [`half_block`], inlined into each with its instructions.
///
/// # Safety
/// Every panel holds the tiles; `V` is a 64-byte vector (the lines are 64-byte aligned,
/// `Line`).
#[inline(always)]
unsafe fn strip_steps<A: Copy, V: Copy>(
    acc: &mut [[A; 2]; 8],
    (a, b0, b1): (*const u16, *const u16, *const u16),
    in_tile: usize,
    tiles: std::ops::Range<usize>,
    broadcast: impl Fn(i32) -> V,
    fma: impl Fn(A, V, V) -> A,
) {
    for t in tiles {
        // SAFETY: each panel holds the tiles.
        let (at, bt0, bt1) = unsafe {
            (
                a.add(t * TILE + in_tile * TK),
                b0.add(t * TILE),
                b1.add(t * TILE),
            )
        };
        for p in 0..T {
            // SAFETY: pair row `p` of a tile is one 64-byte line on a 64-byte boundary.
            let (v0, v1) = unsafe {
                (
                    (bt0.add(p * TK) as *const V).read(),
                    (bt1.add(p * TK) as *const V).read(),
                )
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row `r`'s pair `p` is 4 bytes at `2p` of its 32.
                let va = broadcast(unsafe { (at.add(r * TK + 2 * p) as *const i32).read() });
                acc[0] = fma(acc[0], va, v0);
                acc[1] = fma(acc[1], va, v1);
            }
        }
    }
}

/// Prefetches rows `rows` of a 32-column result block at `c` (row stride `ldc`) into the
/// first-level cache (`PREFETCHT0`), so that the block's stores find them there (see
/// [`half_block`]): a line no other core holds arrives exclusive, and the store needs no
/// second request. A row's 32 values span two or three 64-byte lines: its first, the one
/// 64 bytes on and its last 4 bytes'. Never faults, wherever it points. (`PREFETCHW`,
/// which would also take a line another core holds, needs the `prfchw` target feature,
/// unstable in Rust 1.95; as inline assembly it measured within this VM's noise.)
#[target_feature(enable = "sse")]
#[inline]
fn prefetch_for_write(c: *mut f32, ldc: usize, rows: std::ops::Range<usize>) {
    for r in rows {
        let row = c.wrapping_add(r * ldc) as *const i8;
        for at in [0, 64, 124] {
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(at));
        }
    }
}

/// One 32 × 32 result block over the whole `k` with `VDPBF16PS`, from the same packed
/// panels as [`block`]: each 8 rows × 32 columns of the result are 16 vectors of 16 f32
/// held in registers over the whole `k`; each step broadcasts a row's bf16 pair to every
/// lane and multiplies it with a pair row of the two column tiles (16 columns × 2 terms,
/// one 64-byte line of a packed tile).
///
/// # Safety
/// [`dot_available`] must have returned `Ok`; every pointer addresses what it says.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot_block(
    c: *mut f32,
    ldc: usize,
    load: bool,
    (a0, a1, b0, b1): (*const u16, *const u16, *const u16, *const u16),
    kb: usize,
) {
    const R: usize = 8;
    for (chunk, a) in [a0, a0, a1, a1].into_iter().enumerate() {
        let (row0, in_tile) = (chunk * R, (chunk % 2) * R);
        // The strip's rows, for its stores after its whole `k` (on this Intel VM the
        // products of the base step took 1973–2026 ms instead of 2005–2141 with it).
        prefetch_for_write(c, ldc, row0..row0 + R);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: the block's rows hold 32 columns at `c`, `ldc` apart.
            let row = unsafe { c.add((row0 + r) * ldc) };
            if load {
                *acc = unsafe { [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(T))] };
            }
        }
        // SAFETY: as the caller's; the same 512 bits seen as 32 bf16.
        unsafe {
            strip_steps(
                &mut acc,
                (a, b0, b1),
                in_tile,
                0..kb,
                |pair| std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair)),
                |acc, a, b| _mm512_dpbf16_ps(acc, a, b),
            )
        };
        for (r, acc) in acc.iter().enumerate() {
            unsafe {
                let row = c.add((row0 + r) * ldc);
                _mm512_storeu_ps(row, acc[0]);
                _mm512_storeu_ps(row.add(T), acc[1]);
            }
        }
    }
}

/// One 32 × 32 result block over the whole `k` with AVX512-FP16's `VFMADD231PH`, from
/// panels packed in fp16 with power-of-two scales by row of `a` and column of `b` (the
/// packing of [`block`], the values of [`to16`]`::<true>`). Each 8 rows × 32 columns of
/// the result are 16 vectors of 32 fp16 sums in registers: as in [`dot_block`], each
/// step broadcasts a row's pair of `k` values to every lane pair and multiplies it with a
/// pair row of the two column tiles, so that a column's even `k` are summed in one lane
/// and its odd `k` in the next. Every [`FLUSH_TILES`] tiles those sums are widened and
/// added to f32 sums (in memory); at the end each column's two f32 sums are added,
/// unscaled by `unscale` (`1 / s` of the block's 32 rows and 32 columns) and stored
/// (added to `c` where `load`), with the block's 32 values of a bias added where `bias`
/// is not null and a ReLU applied where `relu` (an [`Epilogue`] in registers).
///
/// # Safety
/// [`half_available`] must have returned `Ok`; every pointer addresses what it says.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512fp16")]
unsafe fn half_block(
    c: *mut f32,
    ldc: usize,
    load: bool,
    (a0, a1, b0, b1): (*const u16, *const u16, *const u16, *const u16),
    kb: usize,
    (row_unscale, col_unscale): (*const f32, *const f32),
    (bias, relu): (*const f32, bool),
) {
    const R: usize = 8;
    // The block's rows of `c` are prefetched, a share before each strip's steps, so that
    // they are in the cache by the stores at the end: `c` is a result buffer the step has
    // not touched in a while, and 32 rows of stores that each miss held up the kernel (in
    // the base step the products took 710–750 ms instead of 760–780; see
    // docs/PERFORMANCE.md).
    let steps = kb.div_ceil(FLUSH_TILES) * 4;
    let mut step = 0;
    // SAFETY (all transmutes): 512 bits seen as 32 fp16, 16 i32 or 8 i64.
    let zero: __m512h = unsafe { std::mem::transmute(_mm512_setzero_si512()) };
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    // SAFETY: the block's 32 columns have their scales.
    let cols = unsafe {
        [
            _mm512_loadu_ps(col_unscale),
            _mm512_loadu_ps(col_unscale.add(T)),
        ]
    };
    // Per row, per column tile: the f32 sums of columns 0–7 and 8–15, each column's
    // even and odd `k` side by side.
    let mut wide = [[_mm512_setzero_ps(); 4]; 4 * R];
    // A step of `FLUSH_TILES` tiles of every strip of 8 rows at a time, so that the
    // step's 4 KB of `b` stay in the core's first cache for the four strips.
    for t0 in (0..kb).step_by(FLUSH_TILES) {
        for (strip, a) in [a0, a0, a1, a1].into_iter().enumerate() {
            prefetch_for_write(c, ldc, step * 4 * R / steps..(step + 1) * 4 * R / steps);
            step += 1;
            let in_tile = (strip % 2) * R;
            let mut acc = [[zero; 2]; R];
            // SAFETY: as the caller's; the same 512 bits seen as 32 fp16.
            unsafe {
                strip_steps(
                    &mut acc,
                    (a, b0, b1),
                    in_tile,
                    t0..(t0 + FLUSH_TILES).min(kb),
                    |pair| std::mem::transmute::<__m512i, __m512h>(_mm512_set1_epi32(pair)),
                    |acc, a, b| _mm512_fmadd_ph(a, b, acc),
                )
            };
            for (wide, acc) in wide[strip * R..(strip + 1) * R].iter_mut().zip(&acc) {
                for (q, &h) in acc.iter().enumerate() {
                    let h: __m512i = unsafe { std::mem::transmute(h) };
                    let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
                    let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h));
                    wide[2 * q] = _mm512_add_ps(wide[2 * q], lo);
                    wide[2 * q + 1] = _mm512_add_ps(wide[2 * q + 1], hi);
                }
            }
        }
    }
    for (r, wide) in wide.iter().enumerate() {
        // SAFETY: the block's rows have their scales and hold 32 columns at `c`.
        unsafe {
            let rows = _mm512_set1_ps(*row_unscale.add(r));
            let row = c.add(r * ldc);
            for q in 0..2 {
                let (lo, hi) = (wide[2 * q], wide[2 * q + 1]);
                let sum = _mm512_add_ps(
                    _mm512_permutex2var_ps(lo, even, hi),
                    _mm512_permutex2var_ps(lo, odd, hi),
                );
                let mut v = _mm512_mul_ps(_mm512_mul_ps(sum, rows), cols[q]);
                if load {
                    v = _mm512_add_ps(_mm512_loadu_ps(row.add(q * T)), v);
                }
                // The epilogue (see `Epilogue`), as `finish_block` would apply it.
                if !bias.is_null() {
                    v = _mm512_add_ps(v, _mm512_loadu_ps(bias.add(q * T)));
                }
                if relu {
                    let keep = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(v, _mm512_setzero_ps());
                    v = _mm512_maskz_mov_ps(keep, v);
                }
                _mm512_storeu_ps(row.add(q * T), v);
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Out(*mut f32);
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not its field).
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// A right operand `[k, n]` packed once (every column panel, as a shared right operand is
/// packed in [`gemm`]) for `kernel`'s products, for the products that read it while it
/// is unchanged: an inference program's weights (see `Compiled::packed_weight`). The same
/// 16-bit values as packing it for each product, so the same bits. For
/// [`Kernel::Int16`], its int16 panels ([`super::int16::Panels`]) instead.
pub(crate) struct PackedRhs {
    k: usize,
    n: usize,
    /// Whether it is in fp16 ([`Kernel::Half`]), else in bf16.
    half: bool,
    /// With `half`, the columns' `1 / s` (see [`fp16_scale`]), padded to the panels.
    unscale: Vec<f32>,
    lines: Vec<Line>,
    /// For [`Kernel::Int16`]: its panels, or `None` where `b` cannot be quantized (a
    /// column holding an infinity or a NaN: its products read it as it is).
    int16: Option<Option<super::int16::Panels>>,
}

impl PackedRhs {
    /// Packs `b` (`k × n`) for `kernel` over rayon's threads.
    ///
    /// # Safety
    /// The kernel's check must have returned `Ok` (they check AVX-512BW, or AVX2 for
    /// int16); `b` must address `k × n` valid elements.
    pub(crate) unsafe fn new(kernel: Kernel, (k, n): (usize, usize), b: Mat) -> PackedRhs {
        if kernel.is_int16() {
            return PackedRhs {
                k,
                n,
                half: false,
                unscale: Vec::new(),
                lines: Vec::new(),
                // SAFETY: as the caller's.
                int16: Some(unsafe { super::int16::Panels::new(b, (k, n)) }),
            };
        }
        let half = kernel == Kernel::Half;
        let panel = k.div_ceil(TK).max(1) * TILE;
        let mut buf = Vec::new();
        let pb = lines(&mut buf, n.div_ceil(T).next_multiple_of(2) * panel);
        // SAFETY: as the caller's.
        let unscale = unsafe { pack_b_all(half, b, (k, n), panel, pb, None) };
        PackedRhs {
            k,
            n,
            half,
            unscale,
            lines: buf,
            int16: None,
        }
    }

    /// Whether it is a packed `[k, n]` operand for `kernel` (an int16 one only where
    /// its panels were made).
    pub(crate) fn is(&self, kernel: Kernel, (k, n): (usize, usize)) -> bool {
        let packing = match &self.int16 {
            Some(panels) => kernel.is_int16() && panels.is_some(),
            None => !kernel.is_int16() && self.half == (kernel == Kernel::Half),
        };
        (self.k, self.n) == (k, n) && packing
    }

    /// Its int16 panels, where it was packed for [`Kernel::Int16`].
    pub(crate) fn int16(&self) -> Option<&super::int16::Panels> {
        self.int16.as_ref()?.as_ref()
    }

    /// Its size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<Line>()
            + self.unscale.len() * 4
            + self.int16().map_or(0, |p| p.bytes())
    }

    /// The packed panels.
    fn panels(&self) -> &[u16] {
        // SAFETY: as in `lines`: the vector's initialized elements as bf16.
        unsafe {
            std::slice::from_raw_parts(self.lines.as_ptr() as *const u16, self.lines.len() * TK)
        }
    }
}

/// Packs every column panel of `b` (`k × n`) into `pb` (panels of `panel` elements), in
/// fp16 with the columns' scales where `half` (returning their `1 / s`, padded to the
/// panels), else in bf16 (returning nothing); each group's [`ColumnSums`] just after
/// packing it, where asked.
///
/// # Safety
/// As [`pack_b`]'s, and as [`column_sums`]' for `sums`.
unsafe fn pack_b_all(
    half: bool,
    b: Mat,
    (k, n): (usize, usize),
    panel: usize,
    pb: &mut [u16],
    sums: Option<ColumnSums>,
) -> Vec<f32> {
    // SAFETY: as the caller's.
    let sum = |j0: usize| unsafe {
        if let Some(sums) = sums {
            column_sums(b, j0..(j0 + GROUP * T).min(n), sums)
        }
    };
    if !half {
        pb.par_chunks_mut(GROUP * panel)
            .enumerate()
            .for_each(|(g, out)| {
                // SAFETY: as the caller's.
                unsafe { pack_b_group::<false>(b, (k, n), g * GROUP * T, &mut [], (panel, out)) };
                sum(g * GROUP * T);
            });
        return Vec::new();
    }
    let mut unscale = vec![1f32; pb.len() / panel * T];
    pb.par_chunks_mut(GROUP * panel)
        .zip(unscale.par_chunks_mut(GROUP * T))
        .enumerate()
        .for_each(|(g, (out, u))| {
            // SAFETY: as the caller's.
            unsafe { pack_b_group::<true>(b, (k, n), g * GROUP * T, u, (panel, out)) };
            sum(g * GROUP * T);
        });
    unscale
}

impl Epilogue {
    fn is_some(&self) -> bool {
        self.bias.is_some() || self.relu
    }
}

/// Vectors of 16 columns [`column_sums`] sums at a time.
const SUM_VECTORS: usize = 8;

/// [`ColumnSums`] of columns `cols` of `b` (`k × n` with `cs == 1`).
///
/// # Safety
/// The CPU must have AVX-512F; `b` must address `k × n` valid elements, `k` the product
/// of `sums.lead`; `sums.dst` must hold `cols.end` values, written by nothing else
/// meanwhile.
#[target_feature(enable = "avx512f")]
unsafe fn column_sums(b: Mat, cols: std::ops::Range<usize>, sums: ColumnSums) {
    debug_assert_eq!(b.cs, 1);
    let lead = &sums.lead[..sums.axes];
    // Rows between consecutive indices of each axis.
    let mut stride = [1usize; SUM_AXES];
    for a in (0..lead.len().saturating_sub(1)).rev() {
        stride[a] = stride[a + 1] * lead[a + 1];
    }
    // The sums over axes `0..level` of the rows from `row` on, for the vectors of
    // columns `j..` (`masks` their lanes): axis `level − 1` is the outer loop.
    #[target_feature(enable = "avx512f")]
    unsafe fn nested(
        b: Mat,
        (lead, stride): (&[usize], &[usize; SUM_AXES]),
        level: usize,
        row: usize,
        j: usize,
        masks: &[u16; SUM_VECTORS],
    ) -> [__m512; SUM_VECTORS] {
        if level == 0 {
            // SAFETY: row `row` holds the masked lanes of columns `j..` (the caller's).
            return std::array::from_fn(|v| unsafe {
                let at = b.ptr.offset(row as isize * b.rs).add(j + v * T);
                _mm512_maskz_loadu_ps(masks[v], at)
            });
        }
        let axis = level - 1;
        let mut acc = [_mm512_setzero_ps(); SUM_VECTORS];
        for i in 0..lead[axis] {
            let row = row + i * stride[axis];
            // SAFETY: as the caller's.
            let t = unsafe { nested(b, (lead, stride), axis, row, j, masks) };
            for (acc, t) in acc.iter_mut().zip(t) {
                *acc = _mm512_add_ps(*acc, t);
            }
        }
        acc
    }
    for j in cols.clone().step_by(SUM_VECTORS * T) {
        let masks: [u16; SUM_VECTORS] = std::array::from_fn(|v| {
            let left = cols.end.saturating_sub(j + v * T).min(T);
            ((1u32 << left) - 1) as u16
        });
        // SAFETY: as the caller's; the masks keep to columns below `cols.end`.
        unsafe {
            let acc = nested(b, (lead, &stride), lead.len(), 0, j, &masks);
            for (v, acc) in acc.into_iter().enumerate() {
                _mm512_mask_storeu_ps(sums.dst.add(j + v * T), masks[v], acc);
            }
        }
    }
}

/// [`Epilogue`] on the `h × w` block at `c` (row stride `ld`), whose first column is
/// column `j` of the result.
///
/// # Safety
/// The CPU must have AVX-512F; `c` must address the block; a bias must hold columns
/// `j..j + w`.
#[target_feature(enable = "avx512f")]
unsafe fn finish_block(c: *mut f32, ld: isize, (h, w): (usize, usize), j: usize, e: Epilogue) {
    let zero = _mm512_setzero_ps();
    for q in (0..w).step_by(T) {
        let mask: u16 = if w - q >= T { !0 } else { (1 << (w - q)) - 1 };
        // SAFETY: the bias holds columns `j + q..` up to `j + w` (masked).
        let bias = e
            .bias
            .map(|b| unsafe { _mm512_maskz_loadu_ps(mask, b.add(j + q)) });
        for r in 0..h {
            // SAFETY: row `r` of the block holds `w` columns (masked past them).
            unsafe {
                let at = c.offset(r as isize * ld).add(q);
                let mut v = _mm512_maskz_loadu_ps(mask, at);
                if let Some(b) = bias {
                    v = _mm512_add_ps(v, b);
                }
                if e.relu {
                    // Kept where `v > 0` or `v` is NaN ("not less or equal", unordered).
                    let keep = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(v, zero);
                    v = _mm512_maskz_mov_ps(keep, v);
                }
                _mm512_mask_storeu_ps(at, mask, v);
            }
        }
    }
}

/// The right operand of [`gemm`]: strided f32, or packed beforehand.
#[derive(Clone, Copy)]
pub(crate) enum Rhs<'a> {
    Mat(Mat),
    /// Packed beforehand, with the matrix it was packed from (read by the int16 products
    /// where the other operand sends them to the f32 kernel).
    Packed(&'a PackedRhs, Mat),
}

/// `dst[m, n] (row stride ld) = (read_dst ? dst : 0) + a[m, k]·b[k, n]`, then the
/// [`Epilogue`] on each block (its bias added to the whole sum), with the
/// operands rounded to 16 bits and the sums in f32, with `kernel`'s instructions, over
/// rayon's threads: bf16 for the tiles and `VDPBF16PS`; fp16 for `VFMADD231PH`, each row
/// of `a` and column of `b` scaled by a power of two first ([`fp16_scale`]) and the
/// sums of every [`FLUSH_TILES`] · 16 terms in fp16. Where `sums` asks, also `b`'s
/// [`ColumnSums`], each column's by the task that packs it. [`Kernel::Int16`]'s products
/// are [`super::int16::gemm`]'s (and [`gemm_group`]'s, `super::int16::gemm_group`'s).
///
/// # Safety
/// The kernel's check ([`tiles_available`], [`dot_available`], [`half_available`], or
/// int16's) must have returned `Ok`; every element the matrices address must be valid;
/// `dst` must not overlap `a`, `b`; a bias must hold `n` values; with `sums`, `b` must be a
/// row-major [`Rhs::Mat`] (`cs == 1`) and [`column_sums`]' conditions must hold.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    dst: *mut f32,
    ld: isize,
    a: Mat,
    b: Rhs<'_>,
    read_dst: bool,
    epilogue: Epilogue,
    sums: Option<ColumnSums>,
) {
    if kernel.is_int16() {
        // SAFETY: as the caller's.
        return unsafe { super::int16::gemm((m, k, n), dst, ld, a, b, read_dst, epilogue, sums) };
    }
    if sums.is_some() {
        assert!(
            matches!(b, Rhs::Mat(b) if b.cs == 1),
            "column sums of a right operand that is not a row-major matrix"
        );
    }
    if m == 0 || n == 0 {
        if let (Some(sums), Rhs::Mat(b)) = (sums, b) {
            // SAFETY: as the caller's.
            unsafe { column_sums(b, 0..n, sums) };
        }
        return;
    }
    if let Rhs::Packed(p, _) = b {
        assert!(
            p.is(kernel, (k, n)),
            "a packed {}×{} operand (fp16: {}) for a {m}×{k}·{k}×{n} product with {kernel:?}",
            p.k,
            p.n,
            p.half
        );
    }
    let member = Member {
        n,
        dst,
        ld,
        b,
        read_dst,
        epilogue,
        sums,
    };
    if let Rhs::Mat(b) = b {
        let kb = k.div_ceil(TK).max(1);
        let cols_b = n.div_ceil(GROUP * T);
        let threads = rayon::current_num_threads();
        // Each thread's rows: at least 256, or packing `b` again costs what it saves.
        let parts = threads.min(m / (GROUP * T));
        // A narrow `b` small enough to pack on each thread (`local`), or too large for
        // that but with a long `k`: then each thread packs both operands a part of `k`
        // at a time (`stream`).
        let small = k * n <= LOCAL_B;
        let long = kb > K_TILES && K_TILES * TK * n <= LOCAL_B;
        if cols_b < 2 * threads && parts > 1 && (small || long) {
            let pad = member.bias_pad(kernel);
            let ops = member.blocks(kernel, kb, &pad);
            // SAFETY: as the caller's.
            unsafe {
                if small {
                    local(kernel, (m, k, n), (a, b, parts), ops, sums)
                } else {
                    stream(kernel, (m, k, n), (a, b, parts), ops, sums)
                }
            };
            return;
        }
    }
    // SAFETY: as the caller's.
    unsafe { general(kernel, (m, k), a, std::slice::from_ref(&member)) }
}

impl Member<'_> {
    /// With fp16 and a bias: the bias padded to the blocks' columns, for the fp16
    /// kernel's registers ([`half_block`]); else empty.
    fn bias_pad(&self, kernel: Kernel) -> Vec<f32> {
        match self.epilogue.bias {
            // SAFETY: the caller's bias holds `n` values.
            Some(b) if kernel == Kernel::Half => {
                let mut v = unsafe { std::slice::from_raw_parts(b, self.n) }.to_vec();
                v.resize(self.n.next_multiple_of(2 * T), 0.0);
                v
            }
            _ => Vec::new(),
        }
    }

    /// The product's [`Blocks`] over `kb` tiles of `k`, with its [`Member::bias_pad`].
    fn blocks<'p>(&self, kernel: Kernel, kb: usize, bias_pad: &'p [f32]) -> Blocks<'p> {
        Blocks {
            kernel,
            kb,
            n: self.n,
            out: Out(self.dst),
            ld: self.ld,
            read_dst: self.read_dst,
            epilogue: self.epilogue,
            bias_pad,
        }
    }
}

/// The products `a·b` of every member of `members` (see [`Member`]), each as [`gemm`]
/// computes it alone, with `a` (`m × k`) packed once for all: the attention's query,
/// key and value projections of one input, or the keys and values of every decoder
/// layer from the encoder's output, run as one product of their columns side by side.
/// The same sums as each member's own [`gemm`], so the same bits.
///
/// # Safety
/// As [`gemm`]'s for each member; no member's result overlaps another's, `a`, or any
/// member's `b`, bias or sums.
pub(crate) unsafe fn gemm_group(
    kernel: Kernel,
    (m, k): (usize, usize),
    a: Mat,
    members: &[Member<'_>],
) {
    if kernel.is_int16() {
        // SAFETY: as the caller's.
        return unsafe { super::int16::gemm_group((m, k), a, members) };
    }
    if let [one] = members {
        // SAFETY: as the caller's.
        return unsafe {
            gemm(
                kernel,
                (m, k, one.n),
                one.dst,
                one.ld,
                a,
                one.b,
                one.read_dst,
                one.epilogue,
                one.sums,
            )
        };
    }
    for mb in members {
        match mb.b {
            Rhs::Packed(p, _) => assert!(
                p.is(kernel, (k, mb.n)) && mb.sums.is_none(),
                "a packed {}×{} operand (fp16: {}) in a group of {m}×{k} products with {kernel:?}",
                p.k,
                p.n,
                p.half
            ),
            Rhs::Mat(b) => assert!(
                mb.sums.is_none() || b.cs == 1,
                "column sums of a right operand that is not a row-major matrix"
            ),
        }
    }
    if m == 0 {
        for mb in members {
            if let (Some(sums), Rhs::Mat(b)) = (mb.sums, mb.b) {
                // SAFETY: as the caller's.
                unsafe { column_sums(b, 0..mb.n, sums) };
            }
        }
        return;
    }
    // SAFETY: as the caller's.
    unsafe { general(kernel, (m, k), a, members) }
}

/// [`gemm`] and [`gemm_group`] on the shared path: `a` packed once, by 16-row tiles (a
/// panel of `kb` tiles each; an odd count gets an all-zero panel beside it), then one
/// task a column group (256 columns of a member's `b`) and block of rows. A wide `b` is
/// packed by each task, its 256 columns (16 panels) into a buffer of its thread that
/// stays in the core's cache: the packed copy of the vocabulary projection's `b` (38 MB)
/// never goes to memory and back. Otherwise `b` is packed once and shared (below). In
/// fp16 each row's `1 / s` goes to `a_unscale`.
///
/// # Safety
/// As [`gemm_group`]'s; `m > 0`.
unsafe fn general(kernel: Kernel, (m, k): (usize, usize), a: Mat, members: &[Member<'_>]) {
    let half = kernel == Kernel::Half;
    let kb = k.div_ceil(TK).max(1);
    let mt = m.div_ceil(T);
    let panel = kb * TILE;
    let threads = rayon::current_num_threads();
    let mut lines_a = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
    // Every element is written by the packing below (zeros past the operand's edges).
    let pa = lines(&mut lines_a, mt.next_multiple_of(2) * panel);
    let mut a_unscale = if half {
        vec![1f32; mt.next_multiple_of(2) * T]
    } else {
        Vec::new()
    };
    if a.rs == 1 && a.cs != 1 {
        let pack = |g: usize, out: &mut [u16], u: &mut [f32]| {
            let (i0, o) = (g * GROUP * T, (panel, out));
            // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k`, `rs == 1`.
            unsafe {
                if half {
                    pack_a_columns::<true>(a, (m, k), i0, u, o)
                } else {
                    pack_a_columns::<false>(a, (m, k), i0, u, o)
                }
            }
        };
        if half {
            pa.par_chunks_mut(GROUP * panel)
                .zip(a_unscale.par_chunks_mut(GROUP * T))
                .enumerate()
                .for_each(|(g, (out, u))| pack(g, out, u));
        } else {
            pa.par_chunks_mut(GROUP * panel)
                .enumerate()
                .for_each(|(g, out)| pack(g, out, &mut []));
        }
    } else {
        let pack = |i: usize, out: &mut [u16], u: &mut [f32]| {
            // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k`.
            unsafe {
                if half {
                    pack_a::<true>(a, (m, k), i * T, u, out)
                } else {
                    pack_a::<false>(a, (m, k), i * T, u, out)
                }
            }
        };
        if half {
            pa.par_chunks_mut(panel)
                .zip(a_unscale.par_chunks_mut(T))
                .enumerate()
                .for_each(|(i, (out, u))| pack(i, out, u));
        } else {
            pa.par_chunks_mut(panel)
                .enumerate()
                .for_each(|(i, out)| pack(i, out, &mut []));
        }
    }
    // Tasks: the column groups of every member, each split into row blocks (multiples
    // of 32 rows) only as far as it takes to give every thread two tasks. Where there
    // are fewer column groups than that (a narrow `b`, which several tasks would pack
    // again), `b` is packed once beforehand and shared.
    // So is a `b` whose tasks would each stream a packed `a` too large for a core's
    // cache (over 2 MB): then the tasks are blocks of at most 256 rows. A `b` the caller
    // packed beforehand (`Rhs::Packed`) is read as a shared one. In fp16 the columns'
    // `1 / s` are in the shared scales for a shared `b`, else in each task's own.
    let groups: Vec<(usize, usize)> = members
        .iter()
        .enumerate()
        .flat_map(|(i, mb)| (0..mb.n).step_by(GROUP * T).map(move |j0| (i, j0)))
        .collect();
    let cols_b = groups.len();
    let share = cols_b < 2 * threads || pa.len() * 2 > 2 << 20;
    // Each member's `b` packed here to be shared, and its columns' `1 / s`.
    let mut packed_here: Vec<Option<(Vec<Line>, Vec<f32>)>> = Vec::with_capacity(members.len());
    for (i, mb) in members.iter().enumerate() {
        packed_here.push(match mb.b {
            Rhs::Mat(b) if share => {
                let mut buf = if i == 0 {
                    PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()))
                } else {
                    Vec::new()
                };
                let pb = lines(&mut buf, mb.n.div_ceil(T).next_multiple_of(2) * panel);
                // SAFETY: the kernel's check found AVX-512; `b` addresses `k × n`.
                let unscale = unsafe { pack_b_all(half, b, (k, mb.n), panel, pb, mb.sums) };
                Some((buf, unscale))
            }
            _ => None,
        });
    }
    // Each member's shared panels and scales (empty where its tasks pack their own).
    let shared: Vec<(&[u16], &[f32])> = members
        .iter()
        .zip(packed_here.iter_mut())
        .map(|(mb, here)| match (mb.b, here) {
            (Rhs::Packed(p, _), _) => (p.panels(), p.unscale.as_slice()),
            (_, Some((buf, unscale))) => {
                let len = mb.n.div_ceil(T).next_multiple_of(2) * panel;
                (&*lines(buf, len), unscale.as_slice())
            }
            _ => (&[][..], &[][..]),
        })
        .collect();
    let pads: Vec<Vec<f32>> = members.iter().map(|mb| mb.bias_pad(kernel)).collect();
    let ops: Vec<Blocks<'_>> = members
        .iter()
        .zip(&pads)
        .map(|(mb, pad)| mb.blocks(kernel, kb, pad))
        .collect();
    let rhs: Vec<(Rhs<'_>, Option<ColumnSums>)> =
        members.iter().map(|mb| (mb.b, mb.sums)).collect();
    let split = (2 * threads).div_ceil(cols_b).clamp(1, m.div_ceil(2 * T));
    let mut rows_per = m.div_ceil(split).next_multiple_of(2 * T);
    if shared.iter().any(|(pb, _)| !pb.is_empty()) {
        rows_per = rows_per.min(GROUP * T);
    }
    let rows_b = m.div_ceil(rows_per);
    let (ops, shared, rhs, groups) = (&ops, &shared, &rhs, &groups);
    let pa_ref = &pa;
    let a_unscale = &a_unscale;
    (0..rows_b * cols_b).into_par_iter().for_each(|task| {
        let (member, j0) = groups[task / rows_b];
        let (ops, (pb_shared, b_unscale), (b, sums)) = (&ops[member], shared[member], rhs[member]);
        let i0 = (task % rows_b) * rows_per;
        let (i1, j1) = ((i0 + rows_per).min(m), (j0 + GROUP * T).min(ops.n));
        let mut lines_b = Vec::new();
        // The columns' `1 / s` in fp16, from column `j0` on.
        let mut own_unscale = [1f32; GROUP * T];
        let own = pb_shared.is_empty();
        let (pb, b_unscale): (&[u16], &[f32]) = if let (true, Rhs::Mat(b)) = (own, b) {
            lines_b = PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()));
            let panels = (j1 - j0).div_ceil(T).next_multiple_of(2);
            let pb = lines(&mut lines_b, panels * panel);
            let u = &mut own_unscale[..panels * T];
            // SAFETY: the kernel's check found AVX-512; `b` addresses `k × n`.
            unsafe {
                if half {
                    pack_b_group::<true>(b, (k, ops.n), j0, u, (panel, pb))
                } else {
                    pack_b_group::<false>(b, (k, ops.n), j0, u, (panel, pb))
                }
            };
            // The columns' sums by the task of their first rows (each group's columns are
            // packed by every task of the group).
            if let (Some(sums), 0) = (sums, i0) {
                // SAFETY: as the caller's.
                unsafe { column_sums(b, j0..j1, sums) };
            }
            (pb, &own_unscale)
        } else {
            (
                &pb_shared[(j0 / T) * panel..],
                &b_unscale[j0.min(b_unscale.len())..],
            )
        };
        // SAFETY: the panels hold the task's rows and columns, packed above or before;
        // each task writes its own block of its member's result.
        unsafe {
            ops.run(
                (i0, i1, j0, j1),
                (&pa_ref[(i0 / T) * panel..], pb),
                (a_unscale.get(i0..).unwrap_or(&[]), b_unscale),
            )
        };
        if own {
            PACKED_B.with(|p| *p.borrow_mut() = lines_b);
        }
    });
    PACKED.with(|p| *p.borrow_mut() = lines_a);
    if let Some(Some((buf, _))) = packed_here.into_iter().next() {
        PACKED_B.with(|p| *p.borrow_mut() = buf);
    }
}

/// Elements of a narrow right operand (fewer column groups than two per thread) that
/// [`local`] packs whole on each thread: 1 M (up to a 2048 × 512 `b`, 2 MB packed, as
/// much as a core's second-level cache on the Xeons measured). In the base step the
/// FFN's `800×2048·2048×512` products ran 3–4 % faster this way than with `b` packed
/// once and shared.
const LOCAL_B: usize = 1024 * 1024;

/// [`gemm`] for a narrow, small `b` (see [`LOCAL_B`]) and at least 256 rows a thread:
/// `parts` tasks, one a thread, each an equal share of the 32 × 32 blocks in row-major
/// order ([`block_runs`]): whole row blocks against every column, and where the shares
/// do not end on a row block's edge, part of a row block's columns (the 25 row blocks of
/// 800 rows are 12½ a thread, not 13 and 12). Each task packs all of `b` into its
/// thread's buffer (a second packing of a small operand), then its rows of `a` 256 at a
/// time, each just before their blocks (a row block two tasks share, by both). So every
/// panel a core reads is one it wrote, still in its own cache, and the product is one
/// parallel step: two tasks with local operands ran an 800 × 512 · 512 × 512 product in
/// 0.95 ms where shared packing and a grid of tasks took 1.06–1.09 ms. The same sums as
/// the other path, so the same bits. [`ColumnSums`] asked for are split between the
/// tasks by vectors of 16 columns, each summed just after the task packed `b`.
///
/// # Safety
/// As [`gemm`]'s.
unsafe fn local(
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    (a, b, parts): (Mat, Mat, usize),
    ops: Blocks<'_>,
    sums: Option<ColumnSums>,
) {
    let half = kernel == Kernel::Half;
    let panel = ops.kb * TILE;
    let (row_blocks, col_blocks) = (m.div_ceil(2 * T), n.div_ceil(2 * T));
    let blocks = row_blocks * col_blocks;
    (0..parts).into_par_iter().for_each(|task| {
        let share = (task * blocks / parts, (task + 1) * blocks / parts);
        let mut lines_b = PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let panels_b = n.div_ceil(T).next_multiple_of(2);
        let pb = lines(&mut lines_b, panels_b * panel);
        let mut b_unscale = vec![1f32; if half { panels_b * T } else { 0 }];
        for (g, out) in pb.chunks_mut(GROUP * panel).enumerate() {
            let u = if half {
                &mut b_unscale[g * GROUP * T..][..out.len() / panel * T]
            } else {
                &mut []
            };
            // SAFETY: the kernel's check found AVX-512; `b` addresses `k × n`.
            unsafe {
                if half {
                    pack_b_group::<true>(b, (k, n), g * GROUP * T, u, (panel, out))
                } else {
                    pack_b_group::<false>(b, (k, n), g * GROUP * T, u, (panel, out))
                }
            };
        }
        // Every task packed all of `b`: each sums its share of the columns (by vectors).
        if let Some(sums) = sums {
            let vectors = n.div_ceil(T);
            let (lo, hi) = (task * vectors / parts * T, (task + 1) * vectors / parts * T);
            // SAFETY: as the caller's.
            unsafe { column_sums(b, lo..hi.min(n), sums) };
        }
        let mut lines_a = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let runs = block_runs(share, col_blocks);
        // SAFETY: as the caller's; `pb` holds every column panel, `b_unscale` their scales.
        unsafe { pack_rows_and_run(&ops, &runs, (a, m, k), (pb, &b_unscale), None, &mut lines_a) };
        PACKED.with(|p| *p.borrow_mut() = lines_a);
        PACKED_B.with(|p| *p.borrow_mut() = lines_b);
    });
}

/// [`gemm`] for a long `k` (more than [`K_TILES`] tiles) and a narrow `b` whose whole
/// packed copy would not fit [`LOCAL_B`], but whose [`K_TILES`] tiles of `k` do: the
/// vocabulary projection's input gradient `800×37000·37000×512` of the base step. The
/// shared path would pack all of `a` (59 MB there) and `b` (38 MB) into memory before
/// any product and stream them back; here each of `parts` tasks (one a thread) takes an
/// equal share of the 32 × 32 result blocks, as in [`local`], and goes through `k` by
/// [`K_TILES`] tiles: it packs that part of `b` whole and of its rows of `a` 256 at a
/// time into its core's cache, and adds their products to its blocks. In fp16 the
/// scales are the whole rows' and columns' ([`fp16_scale`]), found by a first pass over
/// both operands (split between the tasks), and the blocks are summed over `k` in the
/// same parts as in [`Blocks::run`]: the same bits as the shared path. [`ColumnSums`]
/// asked for are split between the tasks by vectors of 16 columns, in the first pass.
///
/// # Safety
/// As [`gemm`]'s.
unsafe fn stream(
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    (a, b, parts): (Mat, Mat, usize),
    ops: Blocks<'_>,
    sums: Option<ColumnSums>,
) {
    let half = kernel == Kernel::Half;
    // The rows' and columns' fp16 scales and their inverses (all 1 for bf16), padded to
    // whole blocks.
    let (mut a_scale, mut a_unscale) = (
        vec![1f32; m.next_multiple_of(2 * T)],
        vec![1f32; m.next_multiple_of(2 * T)],
    );
    let (mut b_scale, mut b_unscale) = (
        vec![1f32; n.next_multiple_of(2 * T)],
        vec![1f32; n.next_multiple_of(2 * T)],
    );
    if half || sums.is_some() {
        // `b`'s columns are the rows of `bᵀ`.
        let bt = b.transposed();
        let maxima: Vec<(Vec<u32>, Vec<u32>)> = (0..parts)
            .into_par_iter()
            .map(|task| {
                let share = |len: usize| task * len / parts..(task + 1) * len / parts;
                if let Some(sums) = sums {
                    let vectors = share(n.div_ceil(T));
                    // SAFETY: as the caller's.
                    unsafe { column_sums(b, vectors.start * T..(vectors.end * T).min(n), sums) };
                }
                if !half {
                    return Default::default();
                }
                let (rows, ks) = (share(m), share(k));
                let (mut a_max, mut b_max) = (vec![0; rows.len()], vec![0; n]);
                // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k`, `b`
                // `k × n`.
                unsafe {
                    max_rows(a, rows, 0..k, &mut a_max);
                    max_rows(bt, 0..n, ks, &mut b_max);
                }
                (a_max, b_max)
            })
            .collect();
        if half {
            let mut b_max = vec![0; n];
            let a_max = maxima.iter().flat_map(|(a_max, _)| a_max);
            for ((s, u), &max) in a_scale.iter_mut().zip(a_unscale.iter_mut()).zip(a_max) {
                (*s, *u) = fp16_scale(max, TOP_A);
            }
            for (_, part) in &maxima {
                for (max, &x) in b_max.iter_mut().zip(part) {
                    *max = (*max).max(x);
                }
            }
            for ((s, u), &max) in b_scale.iter_mut().zip(b_unscale.iter_mut()).zip(&b_max) {
                (*s, *u) = fp16_scale(max, TOP_B);
            }
        }
    }
    let (a_scale, a_unscale, b_scale) = (&a_scale, &a_unscale, &b_scale);
    let b_unscale: &[f32] = if half { &b_unscale } else { &[] };
    let (row_blocks, col_blocks) = (m.div_ceil(2 * T), n.div_ceil(2 * T));
    let blocks = row_blocks * col_blocks;
    let panels_b = n.div_ceil(T).next_multiple_of(2);
    (0..parts).into_par_iter().for_each(|task| {
        // The whole operands (not their fields, which are not `Sync`).
        let (a_whole, b_whole) = (a, b);
        let runs = block_runs(
            (task * blocks / parts, (task + 1) * blocks / parts),
            col_blocks,
        );
        let mut lines_a = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let mut lines_b = PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()));
        for p0 in (0..k).step_by(K_TILES * TK) {
            // This part of `k`, and the operands from its first index.
            let kc = (K_TILES * TK).min(k - p0);
            let panel = kc.div_ceil(TK) * TILE;
            let a = Mat {
                ptr: a_whole.ptr.wrapping_offset(p0 as isize * a_whole.cs),
                ..a_whole
            };
            let b = Mat {
                ptr: b_whole.ptr.wrapping_offset(p0 as isize * b_whole.rs),
                ..b_whole
            };
            let pb = lines(&mut lines_b, panels_b * panel);
            for (g, out) in pb.chunks_mut(GROUP * panel).enumerate() {
                let (j0, o) = (g * GROUP * T, (panel, out));
                // SAFETY: the kernel's check found AVX-512; `b` addresses `kc × n`; the
                // scales hold every column of the panels.
                unsafe {
                    if half {
                        pack_b_group_scaled::<true>(b, (kc, n), j0, &b_scale[j0..], o)
                    } else {
                        pack_b_group_scaled::<false>(b, (kc, n), j0, &b_scale[j0..], o)
                    }
                };
            }
            // The blocks are added to from the second part of `k` on; the epilogue is the
            // last part's.
            let part = ops.part(kc.div_ceil(TK), p0 > 0, p0 + kc == k);
            let scales = Some((&a_scale[..], &a_unscale[..]));
            // SAFETY: as the caller's; `a` addresses `m × kc`; `pb` holds every column
            // panel of this part of `k`, the scales every row and column.
            unsafe {
                pack_rows_and_run(
                    &part,
                    &runs,
                    (a, m, kc),
                    (pb, b_unscale),
                    scales,
                    &mut lines_a,
                )
            };
        }
        PACKED.with(|p| *p.borrow_mut() = lines_a);
        PACKED_B.with(|p| *p.borrow_mut() = lines_b);
    });
}

/// The blocks of `runs` ([`block_runs`]) for [`local`] and [`stream`]: the rows of `a`
/// (`m × k`) packed 256 at a time into `lines_a`, each group just before its blocks,
/// then `ops`' blocks against `pb` (every column panel of `b`, with their `1 / s` in
/// `b_unscale`, both from column 0). In fp16 the rows' scales are `scales` (each row's
/// `s` and `1 / s`, from row 0, padded to whole blocks) where given, else each tile's
/// own rows' ([`pack_a`], [`pack_a_columns`]).
///
/// # Safety
/// The kernel's check must have returned `Ok`; `a` addresses `m × k` valid elements;
/// `pb`, `b_unscale` and `scales` hold every panel and value the blocks read; nothing
/// else writes these blocks of the result meanwhile.
unsafe fn pack_rows_and_run(
    ops: &Blocks<'_>,
    runs: &[(std::ops::Range<usize>, std::ops::Range<usize>)],
    (a, m, k): (Mat, usize, usize),
    (pb, b_unscale): (&[u16], &[f32]),
    scales: Option<(&[f32], &[f32])>,
    lines_a: &mut Vec<Line>,
) {
    let half = ops.kernel == Kernel::Half;
    let panel = ops.kb * TILE;
    let columns = a.rs == 1 && a.cs != 1;
    for (rows, cols) in runs {
        let (i0, i1) = (rows.start * 2 * T, (rows.end * 2 * T).min(m));
        let (j0, j1) = (cols.start * 2 * T, (cols.end * 2 * T).min(ops.n));
        // The run's columns of the packed `b` and their `1 / s`.
        let pb = &pb[(j0 / T) * panel..];
        let b_unscale = b_unscale.get(j0..).unwrap_or(&[]);
        for r0 in (i0..i1).step_by(GROUP * T) {
            let r1 = (r0 + GROUP * T).min(i1);
            // The rows' tiles, an even count (rows past `r1` packed as zeros: `a` seen as
            // `r1` rows).
            let tiles = (r1 - r0).div_ceil(T).next_multiple_of(2);
            let pa = lines(lines_a, tiles * panel);
            // The rows' `1 / s` where the packing finds them.
            let mut found = [1f32; GROUP * T];
            // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k` (and so its
            // first `r1` rows); the scales hold the tiles' rows.
            unsafe {
                match (scales, columns) {
                    (Some((s, _)), true) => {
                        let (s, o) = (&s[r0..], (panel, &mut *pa));
                        if half {
                            pack_a_columns_scaled::<true>(a, (r1, k), r0, s, o)
                        } else {
                            pack_a_columns_scaled::<false>(a, (r1, k), r0, s, o)
                        }
                    }
                    (None, true) => {
                        let (u, o) = (&mut found[..tiles * T], (panel, &mut *pa));
                        if half {
                            pack_a_columns::<true>(a, (r1, k), r0, u, o)
                        } else {
                            pack_a_columns::<false>(a, (r1, k), r0, u, o)
                        }
                    }
                    (Some((s, _)), false) => {
                        for (t, out) in pa.chunks_mut(panel).enumerate() {
                            let (i, s) = (r0 + t * T, &s[r0 + t * T..]);
                            if half {
                                pack_a_scaled::<true>(a, (r1, k), i, s, out)
                            } else {
                                pack_a_scaled::<false>(a, (r1, k), i, s, out)
                            }
                        }
                    }
                    (None, false) => {
                        for (t, out) in pa.chunks_mut(panel).enumerate() {
                            let (i, u) = (r0 + t * T, &mut found[t * T..]);
                            if half {
                                pack_a::<true>(a, (r1, k), i, u, out)
                            } else {
                                pack_a::<false>(a, (r1, k), i, u, out)
                            }
                        }
                    }
                }
                let a_unscale: &[f32] = match scales {
                    _ if !half => &[],
                    Some((_, u)) => &u[r0..],
                    None => &found,
                };
                ops.run((r0, r1, j0, j1), (pa, pb), (a_unscale, b_unscale))
            };
        }
    }
}

/// The [`fp16_scale`]s (`top`) of rows `rows` of `a` (at most 256) over its `k`
/// indices: row `rows.start + r`'s `s` into `scale[r]`, its `1 / s` into `unscale[r]`.
///
/// # Safety
/// As [`max_rows`]'; `scale` and `unscale` hold a value for each row.
#[target_feature(enable = "avx512f")]
unsafe fn line_scales(
    a: Mat,
    rows: std::ops::Range<usize>,
    k: usize,
    top: i32,
    (scale, unscale): (&mut [f32], &mut [f32]),
) {
    let mut max = [0u32; GROUP * T];
    let max = &mut max[..rows.len()];
    // SAFETY: the caller's.
    unsafe { max_rows(a, rows, 0..k, max) };
    for ((s, u), &max) in scale.iter_mut().zip(unscale.iter_mut()).zip(&*max) {
        (*s, *u) = fp16_scale(max, top);
    }
}

/// Raises `max[r]` to the bits of the largest magnitude ([`max_bits`]) of row
/// `rows.start + r` of `a` over the indices `ks` of `k`.
///
/// # Safety
/// The CPU must have AVX-512F; `a` must address those rows at those indices; `max` holds
/// a value for each row.
#[target_feature(enable = "avx512f")]
unsafe fn max_rows(
    a: Mat,
    rows: std::ops::Range<usize>,
    ks: std::ops::Range<usize>,
    max: &mut [u32],
) {
    let max = &mut max[..rows.len()];
    if a.cs == 1 {
        for (r, max) in rows.zip(max.iter_mut()) {
            // SAFETY: row `r` holds the indices `ks`, contiguous.
            let row = unsafe {
                std::slice::from_raw_parts(a.ptr.offset(r as isize * a.rs).add(ks.start), ks.len())
            };
            *max = (*max).max(max_bits(row));
        }
    } else if a.rs == 1 {
        for p in ks {
            // SAFETY: index `p` holds the rows, contiguous.
            let col = unsafe {
                std::slice::from_raw_parts(
                    a.ptr.offset(p as isize * a.cs).add(rows.start),
                    rows.len(),
                )
            };
            max_bits_into(max, col);
        }
    } else {
        for (r, max) in rows.zip(max.iter_mut()) {
            for p in ks.clone() {
                // SAFETY: the caller's.
                let x = unsafe { *a.ptr.offset(r as isize * a.rs + p as isize * a.cs) };
                *max = (*max).max(x.to_bits() & 0x7fff_ffff);
            }
        }
    }
}

/// The blocks `[lo, hi)` of a grid `width` blocks wide, numbered in row-major order, as
/// runs of `(row blocks, column blocks)`: a part of a first row block (from the column
/// `lo` starts at), whole row blocks, a part of a last one (up to the column `hi` ends
/// at); each block in exactly one run.
fn block_runs(
    (lo, hi): (usize, usize),
    width: usize,
) -> Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let mut runs = Vec::new();
    let mut at = lo;
    while at < hi {
        let (row, col) = (at / width, at % width);
        if col > 0 || hi - at < width {
            let end = (col + (hi - at)).min(width);
            runs.push((row..row + 1, col..end));
            at += end - col;
        } else {
            let rows = (hi - at) / width;
            runs.push((row..row + rows, 0..width));
            at += rows * width;
        }
    }
    runs
}

/// What the blocks of one product share (see [`Blocks::run`]).
struct Blocks<'a> {
    kernel: Kernel,
    /// Tiles of `k`.
    kb: usize,
    /// Columns of the result.
    n: usize,
    out: Out,
    ld: isize,
    read_dst: bool,
    epilogue: Epilogue,
    /// With fp16 and a bias: the bias padded to the blocks' columns.
    bias_pad: &'a [f32],
}

impl Blocks<'_> {
    /// The blocks of one part of `k`, `kb` tiles of it: added to the result where they
    /// are not the first part (or where `read_dst`), with the epilogue only where they
    /// are the `last`.
    fn part(&self, kb: usize, later: bool, last: bool) -> Self {
        Blocks {
            kb,
            read_dst: self.read_dst || later,
            epilogue: if last {
                self.epilogue
            } else {
                Epilogue::default()
            },
            ..*self
        }
    }

    /// The product's 32 × 32 blocks of rows `[i0, i1)` and columns `[j0, j1)` (`i0`, `j0`
    /// multiples of 32), from the row tiles of `pa` (its first panel row `i0`'s) and the
    /// column tiles of `pb` (its first column `j0`'s), each a panel of `kb` tiles; in
    /// fp16 with the rows' and columns' `1 / s` from `i0` and `j0` on. A block past `i1`
    /// or `n` goes through a scratch block (rows of `pa` past `i1` packed as zeros).
    ///
    /// # Safety
    /// The kernel's check must have returned `Ok`; the panels and scales hold every tile
    /// and value the blocks read; nothing else writes these blocks of `dst` meanwhile.
    unsafe fn run(
        &self,
        (i0, i1, j0, j1): (usize, usize, usize, usize),
        (pa, pb): (&[u16], &[u16]),
        (a_unscale, b_unscale): (&[f32], &[f32]),
    ) {
        let Blocks {
            kernel,
            kb,
            n,
            out,
            ld,
            read_dst,
            epilogue,
            bias_pad,
        } = *self;
        let half = kernel == Kernel::Half;
        let panel = kb * TILE;
        let mut edge = [0f32; 4 * T * T];
        // One 32 × 32 block at rows `i`, columns `j` of the result, over `kc` tiles of `k`,
        // added to the result where `load`.
        let block =
            |c: *mut f32, ldc: usize, ops, (i, j), (kc, load, last): (usize, bool, bool)| unsafe {
                match kernel {
                    Kernel::Tiles => block(c, ldc, load, ops, kc),
                    Kernel::Dot => dot_block(c, ldc, load, ops, kc),
                    Kernel::Half => {
                        let unscale = (
                            a_unscale.as_ptr().add(i - i0),
                            b_unscale.as_ptr().add(j - j0),
                        );
                        let epi = match (last, epilogue.bias) {
                            (true, Some(_)) => (bias_pad.as_ptr().add(j), epilogue.relu),
                            (last, _) => (std::ptr::null(), last && epilogue.relu),
                        };
                        half_block(c, ldc, load, ops, kc, unscale, epi)
                    }
                    Kernel::Int16 => unreachable!("int16 products run in int16.rs"),
                }
            };
        let tiles = kernel == Kernel::Tiles;
        // SAFETY: the configuration is a valid palette-1 layout; the caller's for the rest.
        unsafe {
            if tiles {
                asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack, readonly));
            }
            // A long `k` by `K_TILES` tiles, every block of the task for each, so that the
            // task's rows and columns of that part stay in the core's cache.
            for t0 in (0..kb).step_by(K_TILES) {
                let kc = (kb - t0).min(K_TILES);
                let load = read_dst || t0 > 0;
                let last = t0 + kc == kb;
                for i in (i0..i1).step_by(2 * T) {
                    let (a0, a1) = (
                        pa.as_ptr().add(((i - i0) / T) * panel + t0 * TILE),
                        pa.as_ptr().add(((i - i0) / T + 1) * panel + t0 * TILE),
                    );
                    for j in (j0..j1).step_by(2 * T) {
                        let q = (j - j0) / T;
                        let ops = (
                            a0,
                            a1,
                            pb.as_ptr().add(q * panel + t0 * TILE),
                            pb.as_ptr().add((q + 1) * panel + t0 * TILE),
                        );
                        let c = out.get().offset(i as isize * ld + j as isize);
                        let (h, w) = ((i1 - i).min(2 * T), (n - j).min(2 * T));
                        if h == 2 * T && w == 2 * T {
                            block(c, ld as usize, ops, (i, j), (kc, load, last));
                        } else {
                            // A block past the matrix's edge: through a 32 × 32 scratch.
                            edge.fill(0.0);
                            if load {
                                for r in 0..h {
                                    for q in 0..w {
                                        edge[r * 2 * T + q] =
                                            *c.offset(r as isize * ld + q as isize);
                                    }
                                }
                            }
                            block(edge.as_mut_ptr(), 2 * T, ops, (i, j), (kc, load, last));
                            for r in 0..h {
                                for q in 0..w {
                                    *c.offset(r as isize * ld + q as isize) = edge[r * 2 * T + q];
                                }
                            }
                        }
                        if last && epilogue.is_some() && !half {
                            finish_block(c, ld, (h, w), j, epilogue);
                        }
                    }
                }
            }
            if tiles {
                asm!("tilerelease", options(nostack, nomem));
            }
        }
    }
}

/// Panels a packing task or a product task takes: 16 (256 rows or columns).
const GROUP: usize = 16;

/// Tiles of `k` (32 each) a product task runs all its blocks over at a time: 1024 values
/// of `k`, so that a task's 256 rows and 256 columns of them (1 MB in all, 16-bit) stay
/// in the core's second-level cache. (Parts of 256 or 128, which the first-level cache
/// would hold, were no faster on the AMX VM of 2026-11-29, and slowed the vocabulary's
/// products by a third.) Only a longer `k` is split (the vocabulary projection's
/// gradient, `k` 37000).
const K_TILES: usize = 32;

thread_local! {
    /// The packed left operand of the thread's last product, kept for its next.
    static PACKED: std::cell::RefCell<Vec<Line>> = Default::default();
    /// A task's packed columns of the right operand, kept for the thread's next task.
    static PACKED_B: std::cell::RefCell<Vec<Line>> = Default::default();
}

/// 64 bytes on a 64-byte boundary: a tile's row. Tiles loaded from addresses that are
/// not 64-byte aligned read twice the cache lines, and `TILELOADD` runs about three
/// times slower (measured on a Sapphire Rapids VM: 7 against 19 ns a tile product).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([u16; TK]);

/// The first `len` 16-bit values (a multiple of 32) of `buf`, grown where it is shorter,
/// as a slice on a 64-byte boundary. It is never shortened, so a buffer a larger product
/// left is not zeroed again for the next one: re-zeroing cost a base training step
/// 16 ms (7 of them the vocabulary gradient's 59 MB). Every packing writes each element
/// of its panels, padding included; a test runs a small product after a large one of
/// NaNs.
fn lines(buf: &mut Vec<Line>, len: usize) -> &mut [u16] {
    debug_assert_eq!(len % TK, 0);
    if buf.len() < len / TK {
        buf.resize(len / TK, Line::default());
    }
    // SAFETY: `Line` is 32 `u16` without padding (`repr(C)`, 64 bytes); the slice covers
    // initialized elements of the vector (`len / TK` of them, at most its length).
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u16, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `rows × cols` matrix in `v`: row-major, or stored transposed (column-major).
    fn stored(v: &[f32], rows: usize, cols: usize, transposed: bool) -> Mat {
        let (rs, cs) = if transposed { (1, rows) } else { (cols, 1) };
        Mat {
            ptr: v.as_ptr(),
            rs: rs as isize,
            cs: cs as isize,
        }
    }

    /// Element `(i, j)` of a matrix of the tests.
    fn elem(m: Mat, i: usize, j: usize) -> f32 {
        // SAFETY: the tests' matrices address every element they index.
        unsafe { *m.ptr.offset(i as isize * m.rs + j as isize * m.cs) }
    }

    /// `kernel`'s product `a·b` (`m × k · k × n`) on `threads` threads, into a copy of
    /// `c0` (added to it where `read`).
    fn product(
        kernel: Kernel,
        (m, k, n): (usize, usize, usize),
        (a, b): (Mat, Mat),
        (c0, read): (&[f32], bool),
        threads: usize,
    ) -> Vec<f32> {
        let e = Epilogue::default();
        on_threads(threads, || {
            product_here(kernel, (m, k, n), (a, b), (c0, read), e)
        })
    }

    /// [`product`] on the current threads (the caller's pool), with `epilogue` (whose
    /// bias holds `n` values).
    fn product_here(
        kernel: Kernel,
        (m, k, n): (usize, usize, usize),
        (a, b): (Mat, Mat),
        (c0, read): (&[f32], bool),
        epilogue: Epilogue,
    ) -> Vec<f32> {
        let mut c = c0.to_vec();
        // SAFETY: the kernel runs here (the tests ask first); `c` holds `m × n`.
        unsafe {
            gemm(
                kernel,
                (m, k, n),
                c.as_mut_ptr(),
                n as isize,
                a,
                Rhs::Mat(b),
                read,
                epilogue,
                None,
            )
        };
        c
    }

    /// `kernel`'s product of a 32 × 64 matrix of `a`s and a 64 × 32 matrix of `b`s.
    fn constant_product(kernel: Kernel, a: f32, b: f32) -> Vec<f32> {
        let (av, bv) = (vec![a; 32 * 64], vec![b; 64 * 32]);
        let (am, bm) = (stored(&av, 32, 64, false), stored(&bv, 64, 32, false));
        product(kernel, (32, 64, 32), (am, bm), (&[0.0; 32 * 32], false), 1)
    }

    /// Asserts that `got` and `want` hold the same bits, naming the first element that
    /// differs.
    fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        if let Some((q, (x, y))) = got
            .iter()
            .zip(want)
            .enumerate()
            .find(|(_, (x, y))| x.to_bits() != y.to_bits())
        {
            panic!("{what}: element {q} is {x:e}, not {y:e}");
        }
    }

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `dy`'s column sums by the generated `sum_rows` kernel (`dy` of shape `[lead…, n]`).
    fn sum_rows_kernel(dy: &[f32], lead: &[usize], n: usize) -> Vec<f32> {
        use kiln_compiler::codegen::{clif, jit, misc};
        let name = "sum_rows_test";
        let m = jit::compile(&clif::text(&misc::sum_rows(name, lead.len()))).unwrap();
        let shape: Vec<usize> = lead.iter().copied().chain([n]).collect();
        let (dims, items) = misc::sum_rows_dims(&shape);
        let mut y = vec![f32::NAN; n];
        let ptrs = [dy.as_ptr() as *mut u8, y.as_mut_ptr() as *mut u8];
        // SAFETY: the kernel reads `dy` (`shape`) and writes `y` (`n`), as its dims say.
        unsafe { jit::launch(m.get(name).unwrap(), &ptrs, &dims, items, 1) };
        y
    }

    /// A product asked for its right operand's column sums ([`ColumnSums`], a bias
    /// gradient's) writes them with the bits of the `sum_rows` kernel on `dy` of shape
    /// `[lead…, n]`, on every path that packs `b` — each thread packing all of it
    /// (`local`), one packing shared by the tasks, each task packing its column group —
    /// and with no rows of `a`; the product is the one without sums. Values of
    /// magnitudes 2⁻²⁰ to 2²⁰ and both signs make the order of the sums show.
    #[test]
    fn products_write_their_right_operands_column_sums_as_sum_rows_does() {
        let kernels: Vec<Kernel> = kernels().into_iter().chain(half_kernel()).collect();
        if kernels.is_empty() {
            println!("skipped: this CPU runs none of the 16-bit kernels");
            return;
        }
        let mut seed = 7u64;
        // (rows of `a`, `dy`'s leading axes, columns, threads): the path each takes.
        let cases: [(usize, &[usize], usize, usize); 7] = [
            (512, &[32, 25], 512, 2),   // local: both tasks pack `b`, each sums half
            (530, &[70, 30], 520, 2),   // stream: each task sums its third of the vectors
            (530, &[4, 5, 6], 530, 2),  // local, a column tail of 2
            (96, &[32, 25], 530, 2),    // shared packing (one task of rows)
            (96, &[800], 1100, 2),      // each task packs its column group
            (96, &[3, 2, 2, 5], 70, 3), // shared, four leading axes, three threads
            (0, &[9, 7], 33, 2),        // no rows of `a`
        ];
        for kernel in kernels {
            for &(m, lead, n, threads) in &cases {
                let k: usize = lead.iter().product();
                let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
                let dy: Vec<f32> = (0..k * n)
                    .map(|_| rng(&mut seed) * 2f32.powi((rng(&mut seed) * 20.0) as i32))
                    .collect();
                let (am, bm) = (stored(&a, m, k, true), stored(&dy, k, n, false));
                let plain = product(kernel, (m, k, n), (am, bm), (&vec![0.0; m * n], false), 1);
                let mut sums = vec![f32::NAN; n];
                let mut spec = ColumnSums {
                    dst: sums.as_mut_ptr(),
                    lead: [1; SUM_AXES],
                    axes: lead.len(),
                };
                spec.lead[..lead.len()].copy_from_slice(lead);
                let mut c = vec![0f32; m * n];
                on_threads(threads, || unsafe {
                    // SAFETY: the kernel runs here; `c` holds `m × n`, `sums` `n`.
                    gemm(
                        kernel,
                        (m, k, n),
                        c.as_mut_ptr(),
                        n as isize,
                        am,
                        Rhs::Mat(bm),
                        false,
                        Epilogue::default(),
                        Some(spec),
                    )
                });
                let what = format!("{kernel:?}, {m} rows, dy {lead:?} × {n}, {threads} threads");
                assert_same_bits(&sums, &sum_rows_kernel(&dy, lead, n), &what);
                assert_same_bits(&c, &plain, &what);
            }
        }
    }

    /// The packing's vector conversions (`VCVTNEPS2BF16`, `VCVTNE2PS2BF16`; `VCVTPS2PH`
    /// after the scaling for fp16) give the bits of the scalar [`to16`] that packs the
    /// operands' edges, on ties, the carry from the largest subnormal, subnormals of both
    /// signs, NaNs with payloads, infinities and random bits, and pair them in order.
    #[test]
    fn vector_conversions_give_the_scalar_bits() {
        if let Err(why) = dot_available() {
            println!("skipped: {why}");
            return;
        }
        let mut seed = 7u64;
        let mut bits: Vec<u32> = vec![
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_7fff,
            0x3f80_8001,
            0x007f_ffff,
            0x007f_8000,
            0x0000_0001,
            0x8040_0000,
            0x807f_ffff,
            0x0080_0000,
            0x7f7f_ffff,
            0xff7f_8000,
            0x7f80_0000,
            0xff80_0000,
            0x7f80_0001,
            0xffc0_1234,
            0x7fbf_ffff,
            0x0000_0000,
            0x8000_0000,
        ];
        while !bits.len().is_multiple_of(32) || bits.len() < 4096 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            bits.push((seed >> 32) as u32);
        }
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        for half in [false, true] {
            let s = 0.25f32;
            let one = |v: f32| {
                if half {
                    to16::<true>(v, s)
                } else {
                    to16::<false>(v, 1.0)
                }
            };
            for (c, chunk) in x.chunks(32).enumerate() {
                // SAFETY: AVX-512F, BW and BF16 are there (checked); 32 elements each.
                let (lo, hi, pairs) = unsafe {
                    let sv = _mm512_set1_ps(s);
                    let (a, b) = (
                        _mm512_loadu_ps(chunk.as_ptr()),
                        _mm512_loadu_ps(chunk.as_ptr().add(16)),
                    );
                    let (lo, hi, pairs) = if half {
                        (
                            to16x16::<true>(a, sv),
                            to16x16::<true>(b, sv),
                            pairs16x16::<true>(a, b, sv),
                        )
                    } else {
                        (
                            to16x16::<false>(a, sv),
                            to16x16::<false>(b, sv),
                            pairs16x16::<false>(a, b, sv),
                        )
                    };
                    let mut out = ([0u16; 16], [0u16; 16], [0u16; 32]);
                    _mm256_storeu_si256(out.0.as_mut_ptr() as *mut __m256i, lo);
                    _mm256_storeu_si256(out.1.as_mut_ptr() as *mut __m256i, hi);
                    _mm512_storeu_si512(out.2.as_mut_ptr() as *mut _, pairs);
                    out
                };
                for i in 0..16 {
                    let (a, b) = (chunk[i], chunk[16 + i]);
                    let what = |v: f32| format!("fp16 {half}, chunk {c}: {:#010x}", v.to_bits());
                    assert_eq!(lo[i], one(a), "{}", what(a));
                    assert_eq!(hi[i], one(b), "{}", what(b));
                    assert_eq!(
                        (pairs[2 * i], pairs[2 * i + 1]),
                        (one(a), one(b)),
                        "pair {i}"
                    );
                }
            }
        }
        assert_eq!(bf16_bits(f32::from_bits(0x807f_ffff)), 0x8000);
        assert_eq!(bf16_bits(f32::from_bits(0x007f_ffff)), 0x0000);
        assert_eq!(bf16_bits(f32::from_bits(0xffc0_1234)), 0xffc0);
        assert_eq!(bf16_bits(f32::from_bits(0x7f80_0001)), 0x7fc0);
    }

    #[test]
    fn rounding_to_bf16_is_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to the even upper one.
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_bits(1.0 + 1.5 / 256.0), 0x3f81);
        assert_eq!(bf16_bits(-2.0), 0xc000);
        assert!(f32::from_bits((bf16_bits(f32::NAN) as u32) << 16).is_nan());
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(round_bf16(3.0e38), f32::from_bits(0x7f62 << 16));
    }

    /// The runs of a thread's share of blocks: the 25 × 16 blocks of an 800 × 512 result
    /// halved as 12½ row blocks each; and for shares of several grids, every block once,
    /// in order, each run within one row block or whole row blocks.
    #[test]
    fn block_runs_cover_a_share_in_order() {
        assert_eq!(
            block_runs((0, 200), 16),
            vec![(0..12, 0..16), (12..13, 0..8)]
        );
        assert_eq!(
            block_runs((200, 400), 16),
            vec![(12..13, 8..16), (13..25, 0..16)]
        );
        assert_eq!(block_runs((3, 5), 16), vec![(0..1, 3..5)]);
        assert_eq!(block_runs((5, 5), 16), vec![]);
        for (total, width, parts) in [(34, 2, 2), (170, 10, 2), (400, 16, 3), (7, 1, 4), (9, 4, 5)]
        {
            let mut seen = Vec::new();
            for task in 0..parts {
                let share = (task * total / parts, (task + 1) * total / parts);
                for (rows, cols) in block_runs(share, width) {
                    assert!(rows.len() == 1 || cols == (0..width), "{rows:?} × {cols:?}");
                    assert!(!cols.is_empty() && cols.end <= width);
                    for r in rows {
                        seen.extend(cols.clone().map(|c| r * width + c));
                    }
                }
            }
            assert_eq!(
                seen,
                (0..total).collect::<Vec<_>>(),
                "{total} blocks, {width} wide"
            );
        }
    }

    /// `f` on a pool of `threads` threads.
    fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    /// The kernels this CPU can run, each with its name; a line for each it cannot.
    fn kernels() -> Vec<Kernel> {
        let mut v = Vec::new();
        match tiles_available() {
            Ok(()) => v.push(Kernel::Tiles),
            Err(why) => println!("AMX tiles skipped: {why}"),
        }
        match dot_available() {
            Ok(()) => v.push(Kernel::Dot),
            Err(why) => println!("VDPBF16PS skipped: {why}"),
        }
        v
    }

    /// The tiles' product against f64 sums of the bf16-rounded operands: only the f32
    /// accumulation differs, so the results agree to a few f32 ulps of the sums'
    /// magnitudes, at sizes that are and are not whole tiles, transposed operands and a
    /// destination read first.
    #[test]
    fn bf16_products_equal_the_sums_of_the_rounded_operands() {
        for kernel in kernels() {
            products_equal_the_sums_of_the_rounded_operands(kernel);
        }
    }

    fn products_equal_the_sums_of_the_rounded_operands(kernel: Kernel) {
        let mut seed = 7u64;
        for &(m, k, n, ta, tb, read) in &[
            (32, 32, 32, false, false, false),
            (1, 1, 1, false, false, false),
            (45, 70, 33, false, false, true),
            (300, 512, 270, false, true, false),
            (64, 800, 96, true, false, true),
            (300, 70, 40, true, false, false),
            (40, 100, 300, false, false, true),
            (70, 64, 700, false, true, false),
            (17, 2049, 5, true, true, false),
            (530, 70, 45, true, false, true),
            (520, 64, 300, false, true, false),
            // An odd `k`: the last pair row of a row-major `b` half zero.
            (45, 71, 40, false, false, true),
            (530, 33, 45, false, false, false),
        ] {
            let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
            let (am, bm) = (stored(&a, m, k, ta), stored(&b, k, n, tb));
            let (at, bt) = (|i, p| elem(am, i, p), |p, j| elem(bm, p, j));
            // On one thread, a `b` of two column blocks or more is packed by each task; on
            // four, it is packed beforehand and shared: both must give the same bits.
            let run = |threads| product(kernel, (m, k, n), (am, bm), (&c0, read), threads);
            let c = run(1);
            let what = format!("{kernel:?}: {m}×{k}·{k}×{n} (ta {ta}, tb {tb}, read {read})");
            assert_same_bits(&c, &run(4), &format!("{what}: one thread and four"));
            // On two, 256 rows or more a thread: each packs its rows and all of `b`.
            assert_same_bits(&c, &run(2), &format!("{what}: one thread and two"));
            // Against f64 sums of the rounded operands (`worst`) and of the operands as
            // they are (`off`): the first differ only by the f32 accumulation; the second
            // by the operands' rounding, about 2^-9 relative per term, so they must be
            // clearly apart (the operands really are rounded).
            let (mut worst, mut off) = (0f64, 0f64);
            for i in 0..m {
                for j in 0..n {
                    let init = if read { c0[i * n + j] as f64 } else { 0.0 };
                    let (mut s, mut x, mut mag) = (init, init, 0f64);
                    for p in 0..k {
                        let t = round_bf16(at(i, p)) as f64 * round_bf16(bt(p, j)) as f64;
                        s += t;
                        x += at(i, p) as f64 * bt(p, j) as f64;
                        mag += t.abs();
                    }
                    let got = c[i * n + j] as f64;
                    worst = worst.max((got - s).abs() / (mag + init.abs()));
                    off = off.max((got - x).abs() / (mag + init.abs()));
                }
            }
            assert!(
                worst < 1e-6,
                "{what}: {worst:e} from the rounded operands' sums"
            );
            if m * n * k > 1 {
                assert!(off > 1e-4, "{what}: only {off:e} from the exact sums");
            }
        }
    }

    /// Subnormal bf16 operands count as zero (both instructions compute as if DAZ were
    /// set, whatever MXCSR says), while the least normal operands multiply as they are
    /// and a NaN operand gives a NaN.
    #[test]
    fn bf16_products_flush_subnormals_and_keep_nans() {
        let tiny = f32::from_bits(0x0040_0000); // 2^-127: subnormal, exact in bf16
        let least = f32::MIN_POSITIVE; // 2^-126: normal
        for kernel in kernels() {
            let run = |a, b| constant_product(kernel, a, b);
            assert!(
                run(tiny, 1.0).iter().all(|&x| x == 0.0),
                "{kernel:?}: a subnormal operand"
            );
            // 2^-126 · 2 summed 64 times: 2^-119, exact.
            assert!(
                run(least, 2.0).iter().all(|&x| x == least * 128.0),
                "{kernel:?}: the least normal operand"
            );
            assert!(
                run(f32::NAN, 1.0).iter().all(|x| x.is_nan()),
                "{kernel:?}: a NaN"
            );
        }
    }

    /// The fp16 kernel where this CPU has it; else a line saying why not.
    fn half_kernel() -> Option<Kernel> {
        half_available()
            .map_err(|why| println!("VFMADD231PH skipped: {why}"))
            .ok()
            .map(|()| Kernel::Half)
    }

    /// `x` (a sum of a few fp16 values and products, exact in f64) rounded to fp16 once,
    /// to nearest, ties to even (the `half` crate may round f64 through f32: twice); an
    /// infinity past fp16's largest value.
    fn round_f16(x: f64) -> f64 {
        if x == 0.0 {
            return x;
        }
        let e = ((x.abs().to_bits() >> 52) as i32) - 1023;
        // The unit in the last place, a power of two (so both operations are exact).
        let ulp = f64::from_bits((((e - 10).max(-24) + 1023) as u64) << 52);
        let r = (x * (1.0 / ulp)).round_ties_even() * ulp;
        if r.abs() >= 65536.0 {
            r.signum() * f64::INFINITY
        } else {
            r
        }
    }

    /// What [`Kernel::Half`] computes, step by step in scalar arithmetic: the scaled
    /// operands rounded to fp16, each column's even and odd `k` summed in fp16 (one
    /// rounding a term, as an FMA), `FLUSH_TILES · 32` values of `k` at a time, those
    /// sums added in f32, the two f32 sums added and unscaled, by parts of `K_TILES · 32`
    /// values of `k`.
    #[allow(clippy::too_many_arguments)]
    fn half_reference(
        (m, k, n): (usize, usize, usize),
        at: impl Fn(usize, usize) -> f32,
        bt: impl Fn(usize, usize) -> f32,
        c0: &[f32],
        read: bool,
    ) -> Vec<f32> {
        let bits = |x: f32| x.to_bits() & 0x7fff_ffff;
        let row_max: Vec<u32> = (0..m)
            .map(|i| (0..k).map(|p| bits(at(i, p))).max().unwrap_or(0))
            .collect();
        let col_max: Vec<u32> = (0..n)
            .map(|j| (0..k).map(|p| bits(bt(p, j))).max().unwrap_or(0))
            .collect();
        let (sa, ua): (Vec<f32>, Vec<f32>) = row_max.iter().map(|&x| fp16_scale(x, TOP_A)).unzip();
        let (sb, ub): (Vec<f32>, Vec<f32>) = col_max.iter().map(|&x| fp16_scale(x, TOP_B)).unzip();
        let h = |x: f32| half::f16::from_f32(x).to_f64();
        let kp = k.div_ceil(TK).max(1) * TK;
        // `b`'s scaled fp16 values by column, each rounded once.
        let bc: Vec<f64> = (0..n * kp)
            .map(|q| {
                let (j, p) = (q / kp, q % kp);
                if p < k {
                    h(bt(p, j) * sb[j])
                } else {
                    0.0
                }
            })
            .collect();
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            let ar: Vec<f64> = (0..kp)
                .map(|p| if p < k { h(at(i, p) * sa[i]) } else { 0.0 })
                .collect();
            for j in 0..n {
                let mut out = if read { c0[i * n + j] } else { 0.0 };
                // The driver's parts of `k` (`K_TILES` tiles), each added to the result
                // (stored, where it is the first and the result is not read).
                for (part, k0) in (0..kp).step_by(K_TILES * TK).enumerate() {
                    let k1 = (k0 + K_TILES * TK).min(kp);
                    let mut wide = [0f32; 2];
                    for chunk in (k0..k1).step_by(FLUSH_TILES * TK) {
                        // fp16 values, held in f64.
                        let mut acc = [0f64; 2];
                        for p in chunk..(chunk + FLUSH_TILES * TK).min(k1) {
                            acc[p % 2] = round_f16(acc[p % 2] + ar[p] * bc[j * kp + p]);
                        }
                        wide[0] += acc[0] as f32;
                        wide[1] += acc[1] as f32;
                    }
                    let v = (wide[0] + wide[1]) * ua[i] * ub[j];
                    out = if part == 0 && !read { v } else { out + v };
                }
                c[i * n + j] = out;
            }
        }
        c
    }

    /// The fp16 kernel gives the bits of [`half_reference`] at sizes that are and are not
    /// whole tiles, transposed operands, a destination read first, and operands whose
    /// magnitudes span 2^30 (small ones become fp16 subnormals after scaling); and it is
    /// within the expected error of the exact sums (fp16 operands and sums: about 2⁻¹¹
    /// relative), clearly closer than bf16 operands would be.
    #[test]
    fn fp16_products_equal_their_scalar_steps() {
        let Some(kernel) = half_kernel() else { return };
        let mut seed = 11u64;
        for &(m, k, n, ta, tb, read, wide) in &[
            (32, 32, 32, false, false, false, false),
            (1, 1, 1, false, false, false, false),
            (45, 70, 33, false, false, true, false),
            (300, 512, 270, false, true, false, false),
            (64, 800, 96, true, false, true, false),
            (40, 100, 300, false, false, true, true),
            (70, 64, 700, false, true, false, true),
            (17, 2049, 5, true, true, false, true),
            (530, 70, 45, true, false, true, false),
            (520, 64, 300, false, true, false, false),
        ] {
            let mut x = || {
                let v = rng(&mut seed);
                if wide {
                    v * (2f32).powi(-((rng(&mut seed).abs() * 30.0) as i32))
                } else {
                    v * 3.0e-3
                }
            };
            let a: Vec<f32> = (0..m * k).map(|_| x()).collect();
            let b: Vec<f32> = (0..k * n).map(|_| x()).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
            let (am, bm) = (stored(&a, m, k, ta), stored(&b, k, n, tb));
            let (at, bt) = (|i, p| elem(am, i, p), |p, j| elem(bm, p, j));
            let run = |threads| product(kernel, (m, k, n), (am, bm), (&c0, read), threads);
            let what = format!("{m}×{k}·{k}×{n} (ta {ta}, tb {tb}, read {read}, wide {wide})");
            let c = run(1);
            let want = half_reference((m, k, n), at, bt, &c0, read);
            assert_same_bits(&c, &want, &format!("{what}: against the scalar steps"));
            assert_same_bits(&c, &run(4), &format!("{what}: one thread and four"));
            assert_same_bits(&c, &run(2), &format!("{what}: one thread and two"));
            // Against the exact sums, relative to the terms' magnitudes.
            let (mut off, mut off_bf16) = (0f64, 0f64);
            for i in 0..m {
                for j in 0..n {
                    let (mut s, mut s_bf16, mut mag) = (0f64, 0f64, 0f64);
                    for p in 0..k {
                        let t = at(i, p) as f64 * bt(p, j) as f64;
                        s += t;
                        s_bf16 += round_bf16(at(i, p)) as f64 * round_bf16(bt(p, j)) as f64;
                        mag += t.abs();
                    }
                    let init = if read { c0[i * n + j] as f64 } else { 0.0 };
                    let got = c[i * n + j] as f64 - init;
                    off = off.max((got - s).abs() / (mag + init.abs() * 1e-7));
                    off_bf16 = off_bf16.max((s_bf16 - s).abs() / mag);
                }
            }
            // An fp16 sum rounds 64 times, each by at most 2⁻¹² of the terms'
            // magnitudes, and much less on the whole (measured: 2.2e-4 to 2.3e-3, where
            // bf16 operands are 1.5e-4 to 6.2e-3 off).
            assert!(off < 4e-3, "{what}: {off:e} from the exact sums");
            if m * n * k > 1 {
                assert!(
                    off < off_bf16,
                    "{what}: {off:e} from the exact sums, bf16 {off_bf16:e}"
                );
            }
        }
    }

    /// With a long `k` (three parts of it) and a narrow `b`, each task of `stream`
    /// packing its parts of `k` one at a time, the fp16 scales are still the whole
    /// rows' and columns': rows and columns whose magnitudes fall from 2⁰ to 2⁻²⁰ along
    /// `k`, or rise, give the bits of [`half_reference`] on two threads, with the
    /// operands stored either way, and the result read first (a scale from part of a row
    /// would overflow its largest values, or flush its smallest). Every 9th row is
    /// checked (the reference is slow; each row's scale is its own).
    #[test]
    fn fp16_products_scale_whole_rows_and_columns_when_k_is_long() {
        let Some(kernel) = half_kernel() else { return };
        let (m, k, n) = (530, 2100, 520);
        let mut seed = 17u64;
        // Magnitudes along `k`: falling in even rows and columns, rising in odd ones.
        let along = |line: usize, p: usize| {
            let f = p as f32 / k as f32;
            2f32.powf(-20.0 * if line.is_multiple_of(2) { f } else { 1.0 - f })
        };
        let a: Vec<f32> = (0..m * k)
            .map(|q| rng(&mut seed) * 60.0 * along(q / k, q % k))
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|q| rng(&mut seed) * 0.01 * along(q % n, q / n))
            .collect();
        let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
        let rows: Vec<usize> = (0..m).step_by(9).collect();
        for (transposed, read) in [(false, false), (true, true)] {
            // The same matrices, stored transposed (`a` by columns, `b` by rows).
            let store = |v: &[f32], r: usize, c: usize| -> Vec<f32> {
                if !transposed {
                    return v.to_vec();
                }
                (0..r * c).map(|q| v[(q % r) * c + q / r]).collect()
            };
            let (at, bt) = (store(&a, m, k), store(&b, k, n));
            let (am, bm) = (stored(&at, m, k, transposed), stored(&bt, k, n, transposed));
            let c = product(kernel, (m, k, n), (am, bm), (&c0, read), 2);
            let c0_rows: Vec<f32> = rows
                .iter()
                .flat_map(|&i| &c0[i * n..][..n])
                .copied()
                .collect();
            let want = half_reference(
                (rows.len(), k, n),
                |r, p| elem(am, rows[r], p),
                |p, j| elem(bm, p, j),
                &c0_rows,
                read,
            );
            let got: Vec<f32> = rows
                .iter()
                .flat_map(|&i| &c[i * n..][..n])
                .copied()
                .collect();
            assert_same_bits(
                &got,
                &want,
                &format!("transposed {transposed}, read {read}"),
            );
        }
    }

    /// An operand far past fp16's range (1e30, 1e-30) is scaled into it; an infinity or a
    /// NaN reaches the results, as in f32.
    #[test]
    fn fp16_products_scale_any_magnitude_and_keep_infinities() {
        let Some(kernel) = half_kernel() else { return };
        let run = |a, b| constant_product(kernel, a, b);
        // E.g. 1e30 · 3e-30 summed 64 times: 192, to fp16's precision of the operands
        // (2⁻¹¹ relative each at most).
        for (a, b) in [(1e30f32, 3e-30f32), (3e-30, 1e30), (1e-15, 3e-15)] {
            let want = 64.0 * a as f64 * b as f64;
            assert!(
                run(a, b)
                    .iter()
                    .all(|&x| ((x as f64 - want) / want).abs() < 3e-3),
                "{a:e}·{b:e}: {:e}, not {want:e}",
                run(a, b)[0]
            );
        }
        assert!(run(f32::INFINITY, 1.0).iter().all(|&x| x == f32::INFINITY));
        assert!(run(f32::NAN, 1.0).iter().all(|x| x.is_nan()));
    }

    /// The packing buffers a thread keeps between products hold what an earlier, larger
    /// product left there: a small product after a large one of NaNs (every packed
    /// panel, the padding included, full of them) gives the bits it gives on fresh
    /// threads, for every kernel, with the operands in each layout.
    #[test]
    fn products_ignore_what_an_earlier_product_left_in_the_buffers() {
        let all: Vec<Kernel> = kernels().into_iter().chain(half_kernel()).collect();
        for kernel in all {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let (m, k, n) = (45, 37, 51);
                let mut seed = 11u64;
                let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
                let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
                let ops = (stored(&a, m, k, ta), stored(&b, k, n, tb));
                let small =
                    |threads| product(kernel, (m, k, n), ops, (&[0.0; 45 * 51], false), threads);
                let (bm, bk, bn) = (300, 1100, 700);
                let (na, nb) = (vec![f32::NAN; bm * bk], vec![f32::NAN; bk * bn]);
                for threads in [1, 2] {
                    let fresh = small(threads);
                    // Both products on the same threads, one after the other.
                    let after = on_threads(threads, || {
                        let big = product_here(
                            kernel,
                            (bm, bk, bn),
                            (stored(&na, bm, bk, ta), stored(&nb, bk, bn, tb)),
                            (&vec![0.0; bm * bn], false),
                            Epilogue::default(),
                        );
                        assert!(big.iter().all(|x| x.is_nan()));
                        let e = Epilogue::default();
                        product_here(kernel, (m, k, n), ops, (&[0.0; 45 * 51], false), e)
                    });
                    assert!(fresh.iter().all(|x| x.is_finite()));
                    assert_same_bits(&after, &fresh, &format!("{kernel:?} {ta} {tb} {threads}"));
                }
            }
        }
    }

    /// A product with an [`Epilogue`] gives the bits of the product without one, its
    /// bias then added and its ReLU applied element by element: on every kernel, at sizes
    /// with partial blocks and with `k` in three parts (2100), on 1 and 3 threads, with a
    /// row of NaNs (kept by the ReLU).
    #[test]
    fn products_add_the_bias_and_apply_the_relu_as_a_pass_after_them_would() {
        let all: Vec<Kernel> = kernels().into_iter().chain(half_kernel()).collect();
        for kernel in all {
            for (m, k, n) in [
                (45, 37, 51),
                (64, 2100, 70),
                (530, 40, 70),
                (530, 2100, 520),
            ] {
                let mut seed = 5u64;
                let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
                a[3 * k] = f32::NAN;
                let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
                let bias: Vec<f32> = (0..n).map(|_| rng(&mut seed) * 4.0).collect();
                let ops = (stored(&a, m, k, false), stored(&b, k, n, false));
                let zero = vec![0.0; m * n];
                for relu in [false, true] {
                    for threads in [1, 2, 3] {
                        let plain = product(kernel, (m, k, n), ops, (&zero, false), threads);
                        let want: Vec<f32> = plain
                            .iter()
                            .enumerate()
                            .map(|(q, &x)| {
                                let v = x + bias[q % n];
                                if relu && !(v > 0.0 || v.is_nan()) {
                                    0.0
                                } else {
                                    v
                                }
                            })
                            .collect();
                        let e = Epilogue {
                            bias: Some(bias.as_ptr()),
                            relu,
                        };
                        let got = on_threads(threads, || {
                            product_here(kernel, (m, k, n), ops, (&zero, false), e)
                        });
                        assert!(got[3 * n..4 * n].iter().all(|x| x.is_nan()));
                        let what = format!("{kernel:?} {m}×{k}·{k}×{n} relu {relu}");
                        assert_same_bits(&got, &want, &what);
                    }
                }
            }
        }
    }

    /// A group of products of one left operand ([`gemm_group`]) gives each member the
    /// bits of its own [`gemm`]: results with their own row strides, a bias and ReLU, a
    /// result added to, column sums, a right operand stored transposed and one packed
    /// beforehand; with `a` row-major and transposed, a long `k` (parts of `K_TILES`
    /// tiles), few rows, and groups too narrow for their tasks to pack their own columns
    /// (then each member's `b` is packed once and shared).
    #[test]
    fn grouped_products_give_each_member_the_bits_of_its_own_product() {
        let all: Vec<Kernel> = kernels().into_iter().chain(half_kernel()).collect();
        for kernel in all {
            for ((m, k), widths) in [
                ((800, 512), &[512, 300, 512][..]),
                ((97, 2100), &[70, 33, 40][..]),
                ((530, 40), &[256, 17, 600][..]),
            ] {
                let mut seed = 17u64;
                for a_transposed in [false, true] {
                    let av: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
                    let a = stored(&av, m, k, a_transposed);
                    // Member `q`: `b` transposed for 1, packed beforehand for 2 (else
                    // row-major); bias and ReLU for 0, bias for 2; `c` added to for 1;
                    // column sums for 0.
                    let bs: Vec<Vec<f32>> = widths
                        .iter()
                        .map(|&n| (0..k * n).map(|_| rng(&mut seed) * 8.0).collect())
                        .collect();
                    let bm: Vec<Mat> = bs
                        .iter()
                        .zip(widths)
                        .enumerate()
                        .map(|(q, (b, &n))| stored(b, k, n, q == 1))
                        .collect();
                    // SAFETY: the kernel runs here; `bm[2]` addresses `k × n`.
                    let packed = unsafe { PackedRhs::new(kernel, (k, widths[2]), bm[2]) };
                    let biases: Vec<Vec<f32>> = widths
                        .iter()
                        .map(|&n| (0..n).map(|_| rng(&mut seed)).collect())
                        .collect();
                    let c0: Vec<Vec<f32>> = widths
                        .iter()
                        .map(|&n| (0..m * (n + 3)).map(|_| rng(&mut seed)).collect())
                        .collect();
                    let lead = {
                        let mut l = [1; SUM_AXES];
                        l[0] = k;
                        l
                    };
                    for threads in [1, 2, 3] {
                        let mut got = c0.clone();
                        let mut want = c0.clone();
                        let mut sums = [vec![f32::NAN; widths[0]], vec![f32::NAN; widths[0]]];
                        let members =
                            |cs: &mut [Vec<f32>], sums: &mut Vec<f32>| -> Vec<Member<'_>> {
                                cs.iter_mut()
                                    .enumerate()
                                    .map(|(q, c)| Member {
                                        n: widths[q],
                                        dst: c.as_mut_ptr(),
                                        ld: widths[q] as isize + 3,
                                        b: if q == 2 {
                                            Rhs::Packed(&packed, bm[2])
                                        } else {
                                            Rhs::Mat(bm[q])
                                        },
                                        read_dst: q == 1,
                                        epilogue: Epilogue {
                                            bias: (q != 1).then(|| biases[q].as_ptr()),
                                            relu: q == 0,
                                        },
                                        sums: (q == 0).then_some(ColumnSums {
                                            dst: sums.as_mut_ptr(),
                                            lead,
                                            axes: 1,
                                        }),
                                    })
                                    .collect()
                            };
                        let [sums_got, sums_want] = &mut sums;
                        let group = members(&mut got, sums_got);
                        // SAFETY: the kernel runs here; every result holds `m` rows of
                        // its `ld`; nothing overlaps.
                        on_threads(threads, || unsafe { gemm_group(kernel, (m, k), a, &group) });
                        for one in members(&mut want, sums_want) {
                            // SAFETY: as above.
                            on_threads(threads, || unsafe {
                                gemm_group(kernel, (m, k), a, std::slice::from_ref(&one))
                            });
                        }
                        let what = format!(
                            "{kernel:?} {m}×{k} ({}) by {widths:?} on {threads} threads",
                            if a_transposed {
                                "transposed"
                            } else {
                                "row-major"
                            }
                        );
                        for q in 0..widths.len() {
                            assert_same_bits(&got[q], &want[q], &format!("{what}: member {q}"));
                        }
                        assert_same_bits(sums_got, sums_want, &format!("{what}: sums"));
                        assert!(
                            sums_got.iter().all(|x| x.is_finite()),
                            "{what}: sums written"
                        );
                    }
                }
            }
        }
    }

    /// The epilogue's ReLU is the `relu` kernel's: `+0.0` for `-0.0` and negatives, a NaN
    /// kept; a bias only where given; nothing past the block's width.
    #[test]
    fn the_epilogue_relu_keeps_nans_and_gives_positive_zero() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            println!("skipped: no AVX-512F");
            return;
        }
        let mut c = [-0.0f32, f32::NAN, -3.0, 2.5, 7.0, -1.0];
        let e = Epilogue {
            bias: None,
            relu: true,
        };
        // SAFETY: AVX-512F is here; the block is 2 rows of 2 columns, row stride 3.
        unsafe { finish_block(c.as_mut_ptr(), 3, (2, 2), 0, e) };
        let bits: Vec<u32> = c.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits[0], 0.0f32.to_bits());
        assert!(c[1].is_nan());
        // Column 2 is past the block's width: untouched.
        assert_eq!((c[2], c[3], c[4], c[5]), (-3.0, 2.5, 7.0, -1.0));
        let bias = [1.0f32, -10.0, 100.0];
        let e = Epilogue {
            bias: Some(bias.as_ptr()),
            relu: false,
        };
        let mut c = [1.0f32, 2.0, 3.0];
        // SAFETY: as above; the block's column 0 is column 1 of the bias.
        unsafe { finish_block(c.as_mut_ptr(), 3, (1, 2), 1, e) };
        assert_eq!(c, [-9.0, 102.0, 3.0]);
    }

    /// The same operands give the same bits with one thread and with several (on two,
    /// each thread takes 161 or 162 of the 19 × 17 blocks: the 10th row block's columns
    /// are split between the threads, the second's from column 256 on, and the first
    /// thread packs its 9 whole row blocks in two parts, 256 rows and 32). Rows and
    /// columns of magnitudes 2⁻³ to 2³, so that their fp16 scales differ.
    #[test]
    fn bf16_products_give_the_same_bits_on_any_number_of_threads() {
        for kernel in kernels().into_iter().chain(half_kernel()) {
            same_bits_on_any_number_of_threads(kernel);
        }
    }

    fn same_bits_on_any_number_of_threads(kernel: Kernel) {
        // The second: a long `k` and a narrow `b`, which `stream` takes on 2 and 3
        // threads (the shared path on 1).
        for (m, k, n) in [(600, 300, 530), (530, 2100, 520)] {
            same_bits_at(kernel, (m, k, n));
        }
    }

    fn same_bits_at(kernel: Kernel, (m, k, n): (usize, usize, usize)) {
        let mut seed = 3u64;
        let magnitude = |i: usize| (2f32).powi((i % 7) as i32 - 3);
        let a: Vec<f32> = (0..m * k)
            .map(|i| rng(&mut seed) * magnitude(i / k))
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| rng(&mut seed) * magnitude(i % n))
            .collect();
        let ops = (stored(&a, m, k, false), stored(&b, k, n, false));
        let run = |threads: usize| {
            let c = product(kernel, (m, k, n), ops, (&vec![0f32; m * n], false), threads);
            c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        let one = run(1);
        assert!(one == run(2), "{kernel:?}: one thread and two");
        assert!(one == run(3), "{kernel:?}: one thread and three");
    }
}
