//! Matrix products with int16 operands and int32 sums: AVX2's `VPMADDWD` (16 products of
//! 16-bit integers, summed in pairs into 8 int32 lanes, per instruction), for CPUs
//! without AVX-512 (AMD Zen 2 and Zen 3, Intel before Skylake-SP), where it
//! multiplies-adds at about 1.75 times the rate of f32 FMAs (measured 2026-11-28 on a
//! Zen 3 VM: 4.47 G `VPMADDWD` + `VPADDD` a second on one core, against 5.11 G
//! `VFMADD231PS`). Opt-in, as the other 16-bit kernels (`KILN_CPU_BF16=1` or `=int16`):
//! the fixed point of Marian's `intgemm16`, with a scale per row and per column.
//!
//! In: the same strided f32 operands as [`super::gemm::gemm_one`]. Each row of `a` and
//! each column of `b` is scaled by the power of two that brings its largest magnitude into
//! `(2047.5, 4095]` ([`exponent`]) and rounded to the nearest integer (ties to even): at
//! least 11 significant bits for the largest values, and an absolute error of at most
//! half a unit, `2⁻¹²` of the largest, for every other. The products of
//! pairs are summed exactly in int32, [`BLOCK`] pairs at a time (`2·64·4095² < 2³¹`, so no
//! sum can overflow), each block's sum converted to f32 and added up in f32 over a
//! [`KC`]-pair part of `k`; the scales are undone exactly (`× 2^-e_a × 2^-e_b`) and the
//! parts added into `dst` in order. A row or column holding an infinity or a NaN sends
//! the whole product to the f32 kernel instead, so these propagate as in f32.
//!
//! Every result element is computed in the same order whatever the threads, so a product
//! gives the same bits on every run and with any number of threads.
//!
//! No well-kept crate multiplies int16 matrices on stable Rust (the `gemm` crate's
//! kernels are floating point); the inner loop is inline assembly so that its sixteen
//! vector registers hold exactly the 6 × 16 tile's twelve accumulators, the two vectors of
//! `b` and the broadcast and product of `a`.

use std::arch::asm;
use std::arch::x86_64::*;

use rayon::prelude::*;

use super::gemm::Mat;

/// The largest magnitude after scaling.
const LIMIT: f32 = 4095.0;
/// Pairs summed in int32 before the f32 sum: `2 · BLOCK · LIMIT² < 2³¹`.
const BLOCK: usize = 64;
const _: () = assert!(2 * BLOCK as u64 * 4095 * 4095 < 1 << 31);
/// Pairs of one part of `k`: a panel of `b` is `KC · 64` bytes (16 KiB), in L1.
const KC: usize = 256;
/// Rows of `a` and columns of `b` of one tile.
const MR: usize = 6;
const NR: usize = 16;
/// Rows of `a` whose part of `k` the threads share while they run their panels (in L2).
const MC: usize = 240;

/// Whether this CPU runs the kernel: AVX2 (and FMA, which every AVX2 CPU has).
pub(crate) fn available() -> Result<(), &'static str> {
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        Ok(())
    } else {
        Err("this CPU has no AVX2")
    }
}

/// Whether the kernel multiplies-adds faster than f32 here: AVX2 without AVX-512F (with
/// AVX-512, an f32 FMA does 16 multiply-adds, as many as a `VPMADDWD` of 256 bits).
pub(crate) fn faster_than_f32() -> Result<(), &'static str> {
    available()?;
    if is_x86_feature_detected!("avx512f") {
        return Err("with AVX-512, f32 FMAs multiply-add as fast as AVX2's VPMADDWD");
    }
    Ok(())
}

/// The exponent `e` that scales a row or column whose largest magnitude is `max`: the
/// largest with `max · 2^e ≤ 4095`, at most 127 (so that `2^e` and `2^-e` are f32 values;
/// a row of magnitudes below `2⁻¹¹⁵` keeps fewer bits). 0 for a row of zeros.
pub(crate) fn exponent(max: f32) -> i32 {
    if max == 0.0 {
        return 0;
    }
    let m = max as f64;
    // ⌊log₂ m⌋ from the exponent field: every f32, subnormal or not, is a normal f64.
    let log2 = ((m.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let mut e = 11 - log2;
    if m * 2f64.powi(e) > LIMIT as f64 {
        e -= 1;
    }
    e.min(127)
}

/// `2^e` as f32, for `-149 ≤ e ≤ 127`.
fn pow2(e: i32) -> f32 {
    2f64.powi(e) as f32
}

/// How an operand was packed into its int16 buffer: panels of [`MR`] rows or [`NR`]
/// columns, `ld` int16 a row or column (`k` rounded up to pairs, zero past `k`; padding
/// rows and columns hold whatever the buffer held, and their results are never stored);
/// the rows' or columns' exponents.
struct Quantized {
    ld: usize,
    exps: Vec<i32>,
}

/// `v` holding `len` values: what it held where it did, zeros past that (a buffer reused
/// between products, so that large ones do not map and clear fresh pages every time).
fn sized(v: &mut Vec<i16>, len: usize) -> &mut [i16] {
    if v.len() < len {
        v.resize(len, 0);
    }
    &mut v[..len]
}

/// Buffers of one thread's products: the operands' int16 panels.
#[derive(Default)]
struct Scratch {
    qa: Vec<i16>,
    qb: Vec<i16>,
}

thread_local! {
    /// Taken out while a product runs (so a product inside another allocates its own).
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// The largest magnitude of `x`, or `None` where it holds an infinity or a NaN.
#[target_feature(enable = "avx2,fma")]
unsafe fn max_abs(x: &[f32]) -> Option<f32> {
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let (mut m, mut bad) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        // SAFETY: `c` holds 8 floats.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        m = _mm256_max_ps(m, _mm256_and_ps(v, abs));
        // `x · 0` is a NaN exactly for an infinity or a NaN.
        bad = _mm256_fmadd_ps(v, _mm256_setzero_ps(), bad);
    }
    let mut lanes = [0f32; 8];
    let mut bads = [0f32; 8];
    // SAFETY: 8 floats each.
    unsafe {
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        _mm256_storeu_ps(bads.as_mut_ptr(), bad);
    }
    let mut max = lanes.iter().fold(0f32, |a, &b| a.max(b));
    for &v in chunks.remainder() {
        if !v.is_finite() {
            return None;
        }
        max = max.max(v.abs());
    }
    (bads.iter().all(|b| *b == 0.0)).then_some(max)
}

/// `max[j] = max(max[j], |x[j]|)`, and `bad[j]` a NaN once an `x[j]` is an infinity or
/// a NaN.
#[target_feature(enable = "avx2,fma")]
unsafe fn max_abs_into(max: &mut [f32], bad: &mut [f32], x: &[f32]) {
    let n = x.len().min(max.len()).min(bad.len());
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let n8 = n / 8 * 8;
    let mut j = 0;
    while j < n8 {
        // SAFETY: `j + 8 ≤ n` for each slice.
        unsafe {
            let v = _mm256_loadu_ps(x.as_ptr().add(j));
            let m = _mm256_loadu_ps(max.as_ptr().add(j));
            let b = _mm256_loadu_ps(bad.as_ptr().add(j));
            _mm256_storeu_ps(
                max.as_mut_ptr().add(j),
                _mm256_max_ps(m, _mm256_and_ps(v, abs)),
            );
            let b = _mm256_fmadd_ps(v, _mm256_setzero_ps(), b);
            _mm256_storeu_ps(bad.as_mut_ptr().add(j), b);
        }
        j += 8;
    }
    for j in n8..n {
        max[j] = max[j].max(x[j].abs());
        bad[j] += x[j] * 0.0;
    }
}

/// `dst[i] = round(x[i] · s)` (ties to even) for the `x.len()` values; `|x · s| ≤ 4095`.
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row(x: &[f32], s: f32, dst: &mut [i16]) {
    let sv = _mm256_set1_ps(s);
    let n16 = x.len() / 16 * 16;
    let mut i = 0;
    while i < n16 {
        // SAFETY: `i + 16 ≤ x.len() ≤ dst.len()`.
        unsafe {
            let lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), sv));
            let hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i + 8)), sv));
            // `packs` interleaves the 128-bit halves: lo 0–3, hi 0–3, lo 4–7, hi 4–7.
            let q = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(lo, hi));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, q);
        }
        i += 16;
    }
    for (d, &v) in dst[n16..x.len()].iter_mut().zip(&x[n16..]) {
        *d = (v * s).round_ties_even() as i16;
    }
}

/// The rows of `x` (`rows × k`: row `i` the `k` floats at `x.ptr + i·x.rs`) in panels of
/// `W` rows: for each pair `p` of columns (`2p`, `2p + 1`), `W` int32 lanes of
/// `(x[i][2p], x[i][2p+1])` as int16, low half first (a row's pairs are its int16 values
/// in order); `ld = 2·⌈k/2⌉` int16 a row of a panel. With the rows' exponents; `None`
/// where a row holds an infinity or a NaN. `a`'s rows as the kernel's panels of [`MR`]
/// rows, or `b`'s columns, where `b` is stored transposed, as its panels of [`NR`].
///
/// # Safety
/// `x` must address its `rows` rows of `k` floats.
unsafe fn quantize_rows<const W: usize>(
    x: Mat,
    (rows, k): (usize, usize),
    buf: &mut Vec<i16>,
) -> Option<Quantized> {
    let pairs = k.div_ceil(2);
    let panels = rows.div_ceil(W);
    let q = sized(buf, panels * W * 2 * pairs);
    let mut exps = vec![0i32; rows];
    struct P(*const f32);
    unsafe impl Send for P {}
    unsafe impl Sync for P {}
    let base = P(x.ptr);
    let ok = q
        .par_chunks_mut(W * 2 * pairs)
        .zip(exps.par_chunks_mut(W))
        .enumerate()
        .all(|(t, (panel, exps))| {
            let base = &base;
            let mut row = vec![0i16; 2 * pairs];
            for (r, e) in exps.iter_mut().enumerate() {
                let i = t * W + r;
                // SAFETY: row `i < rows` holds `k` floats (the caller's contract).
                let v = unsafe { std::slice::from_raw_parts(base.0.offset(i as isize * x.rs), k) };
                // SAFETY: the CPU has AVX2 (checked before the kernel was set).
                let Some(max) = (unsafe { max_abs(v) }) else {
                    return false;
                };
                *e = exponent(max);
                // SAFETY: as above; `row` holds `k` int16 and more (its pad stays zero).
                unsafe { quantize_row(v, pow2(*e), &mut row) };
                // Each pair as one int32, into lane `r` of its pair's `W` lanes.
                let (src, dst) = (row.as_ptr() as *const i32, panel.as_mut_ptr() as *mut i32);
                for p in 0..pairs {
                    // SAFETY: pair `p < pairs` of `row`; lane `r < W` of pair `p` of the
                    // panel (`W · pairs` lanes).
                    unsafe {
                        dst.add(W * p + r)
                            .write_unaligned(src.add(p).read_unaligned())
                    };
                }
            }
            true
        });
    ok.then_some(Quantized {
        ld: 2 * pairs,
        exps,
    })
}

/// The columns of `x` (`k × cols`: row `p` the `cols` floats at `x.ptr + p·x.rs`) in
/// panels of `W` columns: for each pair `p` of rows (`2p`, `2p + 1`), `W` int32 lanes of
/// `(x[2p][j], x[2p+1][j])` as int16, low half first; `ld = 2·⌈k/2⌉` int16 a column of a
/// panel. With the columns' exponents; `None` where a column holds an infinity or a NaN.
/// `b`'s columns as the kernel's panels of [`NR`], or `a`'s rows, where `a` is stored
/// transposed, as its panels of [`MR`].
///
/// # Safety
/// `x` must address its `k` rows of `cols` floats.
unsafe fn pack_columns<const W: usize>(
    x: Mat,
    (k, cols): (usize, usize),
    buf: &mut Vec<i16>,
) -> Option<Quantized> {
    const { assert!(W <= NR) };
    let pairs = k.div_ceil(2);
    let panels = cols.div_ceil(W);
    struct P(*const f32);
    unsafe impl Send for P {}
    unsafe impl Sync for P {}
    let base = P(x.ptr);
    let row = |p: usize| -> &[f32] {
        let base = &base;
        // SAFETY: row `p < k` holds `cols` floats (the caller's contract).
        unsafe { std::slice::from_raw_parts(base.0.offset(p as isize * x.rs), cols) }
    };
    // Each strip's largest magnitudes, one row after another (a column's maximum is the
    // same whatever the order).
    const STRIP: usize = 256;
    let mut maxima = vec![0f32; cols];
    let ok = maxima.par_chunks_mut(STRIP).enumerate().all(|(s, max)| {
        let j0 = s * STRIP;
        let mut bad = [0f32; STRIP];
        for p in 0..k {
            // SAFETY: the CPU has AVX2.
            unsafe { max_abs_into(max, &mut bad[..max.len()], &row(p)[j0..j0 + max.len()]) };
        }
        bad.iter().all(|b| *b == 0.0)
    });
    if !ok {
        return None;
    }
    let exps: Vec<i32> = maxima.iter().map(|&m| exponent(m)).collect();
    let ld = 2 * pairs;
    let q = sized(buf, panels * W * ld);
    q.par_chunks_mut(W * ld).enumerate().for_each(|(t, panel)| {
        let j0 = t * W;
        let w = W.min(cols - j0);
        let mut s = [0f32; NR];
        for (s, &e) in s.iter_mut().zip(&exps[j0..j0 + w]) {
            *s = pow2(e);
        }
        let zeros = [0f32; NR];
        for p in 0..pairs {
            let even = &row(2 * p)[j0..j0 + w];
            let odd = if 2 * p + 1 < k {
                &row(2 * p + 1)[j0..j0 + w]
            } else {
                &zeros[..w]
            };
            let lanes = &mut panel[p * 2 * W..(p + 1) * 2 * W];
            if w == W && (W == NR || W == MR) {
                // SAFETY: `W` floats each, `2W` int16 lanes; the CPU has AVX2.
                unsafe { pair_lanes(even, odd, &s, lanes) };
            } else {
                for j in 0..w {
                    lanes[2 * j] = (even[j] * s[j]).round_ties_even() as i16;
                    lanes[2 * j + 1] = (odd[j] * s[j]).round_ties_even() as i16;
                }
            }
        }
    });
    Some(Quantized { ld, exps })
}

/// `W = even.len()` (16 or 6) columns of two rows, scaled by `s` and rounded, as `W`
/// int32 lanes of int16 pairs.
#[target_feature(enable = "avx2,fma")]
unsafe fn pair_lanes(even: &[f32], odd: &[f32], s: &[f32; NR], lanes: &mut [i16]) {
    let w = even.len();
    debug_assert!((w == NR || w == MR) && odd.len() == w && lanes.len() == 2 * w);
    let low = _mm256_set1_epi32(0xffff);
    // Eight lanes at `8h`: all of them, or the first six.
    let mut lanes8 = |h: usize, mask: Option<__m256i>| {
        // SAFETY: 8 (or, masked, 6) floats at `8h` of each; as many int32 at `16h` int16
        // of `lanes`.
        unsafe {
            let load = |v: &[f32]| match mask {
                None => _mm256_loadu_ps(v.as_ptr().add(8 * h)),
                Some(m) => _mm256_maskload_ps(v.as_ptr().add(8 * h), m),
            };
            let sv = _mm256_loadu_ps(s.as_ptr().add(8 * h));
            let x = _mm256_cvtps_epi32(_mm256_mul_ps(load(even), sv));
            let y = _mm256_cvtps_epi32(_mm256_mul_ps(load(odd), sv));
            let v = _mm256_or_si256(_mm256_and_si256(x, low), _mm256_slli_epi32::<16>(y));
            let at = lanes.as_mut_ptr().add(16 * h) as *mut i32;
            match mask {
                None => _mm256_storeu_si256(at as *mut __m256i, v),
                Some(m) => _mm256_maskstore_epi32(at, m, v),
            }
        }
    };
    if w == NR {
        lanes8(0, None);
        lanes8(1, None);
    } else {
        lanes8(0, Some(_mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0)));
    }
}

/// One row of [`tile_sums`]' loop: the row's pair (at byte `$at` of the pair's 24)
/// broadcast into `ymm2`, multiplied with `b`'s two vectors (`ymm0`, `ymm1`) and added to
/// the row's accumulators `ymm$lo` and `ymm$hi`.
macro_rules! row {
    ($at:literal, $lo:literal, $hi:literal) => {
        concat!(
            "vpbroadcastd ymm2, dword ptr [{a} + ",
            $at,
            "]\n",
            "vpmaddwd ymm3, ymm2, ymm0\n",
            "vpaddd ymm",
            $lo,
            ", ymm",
            $lo,
            ", ymm3\n",
            "vpmaddwd ymm3, ymm2, ymm1\n",
            "vpaddd ymm",
            $hi,
            ", ymm",
            $hi,
            ", ymm3",
        )
    };
}

/// The int32 sums of one 6 × 16 tile over `pairs ≥ 1` pairs: the rows' pairs at `a` (6
/// pairs, 24 bytes, a pair of columns), the panel's at `b` (64 bytes a pair);
/// `out[16r + j]`.
///
/// # Safety
/// The CPU must have AVX2; `a` must address `pairs` pairs of its panel, `b` `pairs` lanes
/// of its panel, `out` 96 int32.
#[inline]
unsafe fn tile_sums(a: *const i16, b: *const i16, pairs: usize, out: &mut [i32; 96]) {
    debug_assert!(pairs >= 1);
    // SAFETY: as the caller's; the loop reads `pairs` pairs of each row and lanes of `b`.
    unsafe {
        asm!(
            "vpxor xmm4, xmm4, xmm4",
            "vpxor xmm5, xmm5, xmm5",
            "vpxor xmm6, xmm6, xmm6",
            "vpxor xmm7, xmm7, xmm7",
            "vpxor xmm8, xmm8, xmm8",
            "vpxor xmm9, xmm9, xmm9",
            "vpxor xmm10, xmm10, xmm10",
            "vpxor xmm11, xmm11, xmm11",
            "vpxor xmm12, xmm12, xmm12",
            "vpxor xmm13, xmm13, xmm13",
            "vpxor xmm14, xmm14, xmm14",
            "vpxor xmm15, xmm15, xmm15",
            "2:",
            "vmovdqu ymm0, [{b}]",
            "vmovdqu ymm1, [{b} + 32]",
            row!("0", "4", "5"),
            row!("4", "6", "7"),
            row!("8", "8", "9"),
            row!("12", "10", "11"),
            row!("16", "12", "13"),
            row!("20", "14", "15"),
            "add {a}, 24",
            "add {b}, 64",
            "dec {n}",
            "jnz 2b",
            "vmovdqu [{out}], ymm4",
            "vmovdqu [{out} + 32], ymm5",
            "vmovdqu [{out} + 64], ymm6",
            "vmovdqu [{out} + 96], ymm7",
            "vmovdqu [{out} + 128], ymm8",
            "vmovdqu [{out} + 160], ymm9",
            "vmovdqu [{out} + 192], ymm10",
            "vmovdqu [{out} + 224], ymm11",
            "vmovdqu [{out} + 256], ymm12",
            "vmovdqu [{out} + 288], ymm13",
            "vmovdqu [{out} + 320], ymm14",
            "vmovdqu [{out} + 352], ymm15",
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            n = inout(reg) pairs => _,
            out = in(reg) out.as_mut_ptr(),
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack),
        );
    }
}

/// One tile over pairs `p0..p1`: the int32 sums of every [`BLOCK`] pairs converted to f32
/// and added in order into `acc` (96 values, `acc[16r + j]`), which starts at zero.
///
/// # Safety
/// As [`tile_sums`] for pairs `p0..p1` (`p0 < p1`) of rows at `a` and of the panel at `b`.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile(a: *const i16, b: *const i16, (p0, p1): (usize, usize), acc: &mut [f32; 96]) {
    let mut sums = [0i32; 96];
    let mut f = [_mm256_setzero_ps(); 12];
    let mut p = p0;
    while p < p1 {
        let n = BLOCK.min(p1 - p);
        // SAFETY: as the caller's, for pairs `p..p + n`.
        unsafe { tile_sums(a.add(2 * MR * p), b.add(2 * NR * p), n, &mut sums) };
        for (v, s) in f.iter_mut().zip(sums.chunks_exact(8)) {
            // SAFETY: 8 int32.
            let s = unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) };
            *v = _mm256_add_ps(*v, _mm256_cvtepi32_ps(s));
        }
        p += n;
    }
    for (v, out) in f.iter().zip(acc.chunks_exact_mut(8)) {
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *v) };
    }
}

/// A tile's sums, unscaled (`acc[16r + j] · inv_a[r] · inv_b[j]`), written into the
/// `inv_a.len()` rows and `inv_b.len()` columns at `d` (row stride `ld`), or added to
/// what they hold unless `fresh`.
///
/// # Safety
/// `d` must address those rows and columns; the CPU must have AVX2.
#[target_feature(enable = "avx2,fma")]
unsafe fn store(
    acc: &[f32; 96],
    (inv_a, inv_b): (&[f32], &[f32]),
    d: *mut f32,
    ld: isize,
    fresh: bool,
) {
    let w = inv_b.len();
    for (r, &sa) in inv_a.iter().enumerate() {
        // SAFETY: row `r` of the tile, as the caller's.
        let row = unsafe { d.offset(r as isize * ld) };
        let acc = &acc[NR * r..NR * (r + 1)];
        if w == NR {
            for h in 0..2 {
                // SAFETY: 8 values at `8h` of each; columns `8h..8h + 8` of the row.
                unsafe {
                    let v = _mm256_mul_ps(
                        _mm256_mul_ps(_mm256_loadu_ps(acc.as_ptr().add(8 * h)), _mm256_set1_ps(sa)),
                        _mm256_loadu_ps(inv_b.as_ptr().add(8 * h)),
                    );
                    let p = row.add(8 * h);
                    let v = if fresh {
                        v
                    } else {
                        _mm256_add_ps(_mm256_loadu_ps(p), v)
                    };
                    _mm256_storeu_ps(p, v);
                }
            }
        } else {
            for j in 0..w {
                let v = acc[j] * sa * inv_b[j];
                // SAFETY: column `j < w` of the row.
                unsafe { *row.add(j) = if fresh { v } else { *row.add(j) + v } };
            }
        }
    }
}

/// `dst[m, n] (row stride ld) = (read_dst ? dst : 0) + a[m, k]·b[k, n]` with int16
/// operands (see the module's comment); operands that are neither row-major nor stored
/// transposed, or that hold an infinity or a NaN, go to the f32 kernel.
///
/// # Safety
/// As [`super::gemm::gemm_one`]; [`available`] must have returned `Ok`.
pub(crate) unsafe fn gemm(
    (m, k, n): (usize, usize, usize),
    dst: *mut f32,
    ld: isize,
    a: Mat,
    b: Mat,
    read_dst: bool,
) {
    let f32_product = || {
        let par = super::gemm::parallelism(m * k * n);
        // SAFETY: as the caller's.
        unsafe { super::gemm::gemm_one((m, k, n), dst, ld, a, b, read_dst, par) }
    };
    if m == 0 || n == 0 || k == 0 {
        return f32_product();
    }
    let mut scratch = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    // SAFETY: as the caller's.
    let done = unsafe { quantized((m, k, n), dst, ld, (a, b), read_dst, &mut scratch) };
    SCRATCH.with(|s| *s.borrow_mut() = scratch);
    if done.is_none() {
        f32_product();
    }
}

/// The kernel's panels of `W` lines of `k` values: line `i`'s value `p` at
/// `ptr + i·line + p·step`. From the lines where their values are contiguous
/// ([`quantize_rows`]), else from the rows of the matrix they are the columns of
/// ([`pack_columns`]); `None` for other strides, or where a line holds an infinity or a
/// NaN.
///
/// # Safety
/// `ptr` must address every value at those strides.
unsafe fn panels<const W: usize>(
    ptr: *const f32,
    (line, step): (isize, isize),
    (lines, k): (usize, usize),
    buf: &mut Vec<i16>,
) -> Option<Quantized> {
    let rows = |rs: isize| Mat { ptr, rs, cs: 1 };
    // SAFETY (both): as the caller's, read with the strides given here.
    if step == 1 || k == 1 {
        unsafe { quantize_rows::<W>(rows(line), (lines, k), buf) }
    } else if line == 1 || lines == 1 {
        unsafe { pack_columns::<W>(rows(step), (k, lines), buf) }
    } else {
        None
    }
}

/// [`gemm`] with `scratch`'s buffers; `None`, with nothing written, where the operands'
/// strides or values send the product to the f32 kernel.
///
/// # Safety
/// As [`gemm`]'s.
unsafe fn quantized(
    (m, k, n): (usize, usize, usize),
    dst: *mut f32,
    ld: isize,
    (a, b): (Mat, Mat),
    read_dst: bool,
    scratch: &mut Scratch,
) -> Option<()> {
    // SAFETY (both): the operands address their elements (the caller's contract).
    // `a`'s lines are its rows (a line's values `a.cs` apart), `b`'s its columns.
    let qa = unsafe { panels::<MR>(a.ptr, (a.rs, a.cs), (m, k), &mut scratch.qa) }?;
    let qb = unsafe { panels::<NR>(b.ptr, (b.cs, b.rs), (n, k), &mut scratch.qb) }?;
    let (qa_buf, qb_buf) = (&scratch.qa, &scratch.qb);
    let pairs = k.div_ceil(2);
    let panels = n.div_ceil(NR);
    let inv_a: Vec<f32> = qa.exps.iter().map(|&e| pow2(-e)).collect();
    let inv_b: Vec<f32> = qb.exps.iter().map(|&e| pow2(-e)).collect();
    struct Out(*mut f32);
    unsafe impl Send for Out {}
    unsafe impl Sync for Out {}
    let out = Out(dst);
    let threads = rayon::current_num_threads();
    for p0 in (0..pairs).step_by(KC) {
        let p1 = (p0 + KC).min(pairs);
        let first = p0 == 0;
        for i0 in (0..m).step_by(MC) {
            let i1 = (i0 + MC).min(m);
            let run = |t: usize| {
                let out = &out;
                let j0 = t * NR;
                let w = NR.min(n - j0);
                let panel = &qb_buf[t * NR * qb.ld..(t + 1) * NR * qb.ld];
                let mut acc = [0f32; 96];
                for r0 in (i0..i1).step_by(MR) {
                    let rows = MR.min(i1 - r0);
                    // SAFETY: `qa` holds whole tiles of rows of `ld` int16 (`pairs`
                    // pairs); the panel holds `pairs` lanes; the CPU has AVX2.
                    unsafe {
                        tile(
                            qa_buf.as_ptr().add(r0 * qa.ld),
                            panel.as_ptr(),
                            (p0, p1),
                            &mut acc,
                        )
                    };
                    let scales = (&inv_a[r0..r0 + rows], &inv_b[j0..j0 + w]);
                    // SAFETY: rows `r0..r0 + rows` (< m) and columns `j0..j0 + w` of `dst`;
                    // each panel's task writes only its own columns; the CPU has AVX2.
                    unsafe {
                        let d = out.0.offset(r0 as isize * ld).add(j0);
                        store(&acc, scales, d, ld, first && !read_dst)
                    };
                }
            };
            if threads > 1 && panels > 1 {
                (0..panels).into_par_iter().for_each(run);
            } else {
                (0..panels).for_each(run);
            }
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    /// `v` (`rows × cols`, row-major) stored as asked: row-major, or transposed.
    fn stored(
        v: &[f32],
        (rows, cols): (usize, usize),
        transposed: bool,
    ) -> (Vec<f32>, (isize, isize)) {
        if transposed {
            let mut t = vec![0f32; v.len()];
            for i in 0..rows {
                for j in 0..cols {
                    t[j * rows + i] = v[i * cols + j];
                }
            }
            (t, (1, rows as isize))
        } else {
            (v.to_vec(), (cols as isize, 1))
        }
    }

    fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    /// `dst = (read ? dst : 0) + a·b` by [`gemm`], `a` and `b` given row-major and stored
    /// as asked.
    fn product(
        (m, k, n): (usize, usize, usize),
        (a, b): (&[f32], &[f32]),
        (ta, tb): (bool, bool),
        dst: &mut [f32],
        read: bool,
    ) {
        let (sa, (ars, acs)) = stored(a, (m, k), ta);
        let (sb, (brs, bcs)) = stored(b, (k, n), tb);
        let a = Mat {
            ptr: sa.as_ptr(),
            rs: ars,
            cs: acs,
        };
        let b = Mat {
            ptr: sb.as_ptr(),
            rs: brs,
            cs: bcs,
        };
        // SAFETY: the buffers hold the matrices; the CPU has AVX2 (checked by the callers).
        unsafe { gemm((m, k, n), dst.as_mut_ptr(), n as isize, a, b, read) };
    }

    /// What [`gemm`] computes, in scalar arithmetic: each row of `a` and column of `b`
    /// scaled by `2^exponent(max)` and rounded to even; per element, the exact integer sums
    /// of every 64 pairs of a 256-pair part, converted to f32 and added in order; the part
    /// unscaled (`× 2^-e_a × 2^-e_b`) and added to the result.
    fn reference(
        (m, k, n): (usize, usize, usize),
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        read: bool,
    ) {
        let max_row = |i: usize| (0..k).map(|p| a[i * k + p].abs()).fold(0f32, f32::max);
        let max_col = |j: usize| (0..k).map(|p| b[p * n + j].abs()).fold(0f32, f32::max);
        let ea: Vec<i32> = (0..m).map(|i| exponent(max_row(i))).collect();
        let eb: Vec<i32> = (0..n).map(|j| exponent(max_col(j))).collect();
        let q = |x: f32, e: i32| (x * pow2(e)).round_ties_even() as i64;
        for i in 0..m {
            for j in 0..n {
                let term = |p: usize| {
                    if p < k {
                        q(a[i * k + p], ea[i]) * q(b[p * n + j], eb[j])
                    } else {
                        0
                    }
                };
                let pairs = k.div_ceil(2);
                for p0 in (0..pairs).step_by(KC) {
                    let mut acc = 0f32;
                    for b0 in (p0..(p0 + KC).min(pairs)).step_by(BLOCK) {
                        let b1 = (b0 + BLOCK).min((p0 + KC).min(pairs));
                        let s: i64 = (2 * b0..2 * b1).map(term).sum();
                        assert!(s.unsigned_abs() < 1 << 31, "an int32 sum overflows");
                        acc += s as i32 as f32;
                    }
                    let v = acc * pow2(-ea[i]) * pow2(-eb[j]);
                    let d = &mut c[i * n + j];
                    *d = if p0 == 0 && !read { v } else { *d + v };
                }
            }
        }
    }

    fn skip() -> bool {
        match available() {
            Ok(()) => false,
            Err(why) => {
                println!("skipped: {why}");
                true
            }
        }
    }

    #[test]
    fn exponents_bring_the_largest_magnitude_into_2048_to_4095() {
        for max in [
            1.0f32,
            3.0,
            4095.0,
            4095.5,
            2047.5,
            0.1,
            1e-30,
            7.5e20,
            f32::MAX,
        ] {
            let e = exponent(max);
            let scaled = max as f64 * 2f64.powi(e);
            assert!(
                scaled > 2047.5 && scaled <= 4095.0,
                "{max:e}: 2^{e} gives {scaled}"
            );
        }
        assert_eq!(exponent(1.0), 11);
        assert_eq!(exponent(4095.0), 0);
        assert_eq!(exponent(4095.5), -1);
        assert_eq!(exponent(0.0), 0);
        // Below 2⁻¹¹⁵ the exponent stops at 127, so that `2^e` is an f32.
        assert_eq!(exponent(1e-40), 127);
        assert_eq!(pow2(127), 2f32.powi(127));
        assert_eq!(pow2(-127), f32::from_bits(1 << 22));
    }

    /// The kernel against [`reference`], bit for bit: sizes that are and are not whole
    /// tiles, panels, blocks of 64 pairs and parts of 256 pairs (odd `k`, `m` past the
    /// 240 rows the threads share), operands stored transposed, a destination read first,
    /// and rows and columns of zeros and of tiny values.
    #[test]
    fn int16_products_equal_their_scalar_steps() {
        if skip() {
            return;
        }
        let mut seed = 3u64;
        for &(m, k, n, ta, tb, read) in &[
            (1, 1, 1, false, false, false),
            (7, 3, 5, false, false, true),
            (13, 129, 33, true, false, false),
            (6, 1030, 16, false, true, true),
            (250, 70, 40, true, true, false),
            (12, 513, 17, false, false, false),
        ] {
            let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            let mut b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed) * 300.0).collect();
            if m > 2 {
                // A row of zeros, and one of tiny values.
                a[k..2 * k].fill(0.0);
                a[2 * k..3 * k].iter_mut().for_each(|x| *x *= 1e-38);
            }
            if n > 1 {
                (0..k).for_each(|p| b[p * n + 1] *= 1e-20);
            }
            let init: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
            let mut got = init.clone();
            product((m, k, n), (&a, &b), (ta, tb), &mut got, read);
            let mut want = init.clone();
            reference((m, k, n), &a, &b, &mut want, read);
            for (x, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{m}×{k}·{k}×{n} (ta {ta}, tb {tb}, read {read}) [{x}]: {g:e} against {w:e}"
                );
            }
        }
    }

    /// Against f64 sums of the f32 operands, every result is within the rounding the
    /// scales allow: half a unit of each operand's row or column, `Σ_p (u_a·|b_pj| +
    /// |a_ip|·u_b + u_a·u_b)`, plus f32 sums (2⁻²⁰ of `Σ|a·b|`).
    #[test]
    fn int16_products_are_within_half_a_unit_of_each_operand() {
        if skip() {
            return;
        }
        let (m, k, n) = (37, 700, 45);
        let mut seed = 9u64;
        // Rows and columns of very different magnitudes.
        let a: Vec<f32> = (0..m * k)
            .map(|x| rng(&mut seed) * 10f32.powi((x / k) as i32 % 7 - 3))
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|x| rng(&mut seed) * 10f32.powi((x % n) as i32 % 5 - 2))
            .collect();
        let mut c = vec![0f32; m * n];
        product((m, k, n), (&a, &b), (false, false), &mut c, false);
        let ua: Vec<f64> = (0..m)
            .map(|i| {
                let max = (0..k).map(|p| a[i * k + p].abs()).fold(0f32, f32::max);
                0.5 * 2f64.powi(-exponent(max))
            })
            .collect();
        let ub: Vec<f64> = (0..n)
            .map(|j| {
                let max = (0..k).map(|p| b[p * n + j].abs()).fold(0f32, f32::max);
                0.5 * 2f64.powi(-exponent(max))
            })
            .collect();
        let mut worst = 0f64;
        for i in 0..m {
            for j in 0..n {
                let (mut exact, mut bound, mut abs) = (0f64, 0f64, 0f64);
                for p in 0..k {
                    let (x, y) = (a[i * k + p] as f64, b[p * n + j] as f64);
                    exact += x * y;
                    abs += (x * y).abs();
                    bound += ua[i] * y.abs() + x.abs() * ub[j] + ua[i] * ub[j];
                }
                let err = (c[i * n + j] as f64 - exact).abs();
                assert!(
                    err <= bound + abs * 2f64.powi(-20),
                    "[{i}, {j}]: {:e} against {exact:e}, beyond {bound:e}",
                    c[i * n + j]
                );
                worst = worst.max(err / bound);
            }
        }
        // The bound is reached in part: the rounding is real.
        assert!(worst > 0.01, "worst error {worst} of the bound");
    }

    /// The same bits on 1, 2 and 3 threads.
    #[test]
    fn int16_products_give_the_same_bits_on_any_number_of_threads() {
        if skip() {
            return;
        }
        let (m, k, n) = (300, 520, 70);
        let mut seed = 5u64;
        let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
        let run = |threads| {
            on_threads(threads, || {
                let mut c = vec![0f32; m * n];
                product((m, k, n), (&a, &b), (false, true), &mut c, false);
                c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            })
        };
        let one = run(1);
        assert!(run(2) == one && run(3) == one);
    }

    /// An infinity or a NaN in an operand sends the product to the f32 kernel: the
    /// result is the f32 product's, bit for bit, infinities and NaNs included.
    #[test]
    fn int16_products_of_infinities_and_nans_are_the_f32_products() {
        if skip() {
            return;
        }
        let (m, k, n) = (9, 40, 20);
        let mut seed = 2u64;
        for (what, at_a, v) in [
            ("inf in a", true, f32::INFINITY),
            ("NaN in b", false, f32::NAN),
        ] {
            let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            let mut b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
            if at_a {
                a[3 * k + 5] = v;
            } else {
                b[7 * n + 2] = v;
            }
            let mut got = vec![0f32; m * n];
            product((m, k, n), (&a, &b), (false, false), &mut got, false);
            let mut want = vec![0f32; m * n];
            let mat = |p: &[f32], cols: usize| Mat {
                ptr: p.as_ptr(),
                rs: cols as isize,
                cs: 1,
            };
            // SAFETY: the buffers hold the matrices.
            unsafe {
                super::super::gemm::gemm_one(
                    (m, k, n),
                    want.as_mut_ptr(),
                    n as isize,
                    mat(&a, k),
                    mat(&b, n),
                    false,
                    super::super::gemm::parallelism(m * k * n),
                )
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&got) == bits(&want), "{what}");
            assert!(
                got.iter().any(|x| !x.is_finite()),
                "{what}: no infinity or NaN"
            );
        }
    }
}
