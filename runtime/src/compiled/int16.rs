//! Matrix products with int16 operands and int32 sums: AVX2's `VPMADDWD` (16 products of
//! 16-bit integers, summed in pairs into 8 int32 lanes, per instruction), for CPUs
//! without AVX-512 (AMD Zen 2 and Zen 3, Intel before Skylake-SP), where it
//! multiplies-adds at about 1.75 times the rate of f32 FMAs (measured 2026-11-28 on a
//! Zen 3 VM: 4.47 G `VPMADDWD` + `VPADDD` a second on one core, against 5.11 G
//! `VFMADD231PS`). Opt-in, as the other 16-bit kernels (`--gemm-type int16`,
//! `KILN_CPU_BF16=int16`): the fixed point of Marian's `intgemm16`, with a scale per row
//! and per column.
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
//! `b` and the broadcast of `a` and its two products.

use std::arch::asm;
use std::arch::x86_64::*;

use rayon::prelude::*;

use super::bf16::{Epilogue, Member, Rhs};
use super::gemm::{ColumnSums, Mat, SUM_AXES};

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
    if m * pow2_f64(e) > LIMIT as f64 {
        e -= 1;
    }
    e.min(127)
}

/// `2^e` as f64, for `-1022 ≤ e ≤ 1023`: its exponent field (`powi`, a call for each
/// row and column of every product, was 0.3 % of a training step).
fn pow2_f64(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// `2^e` as f32, for `-149 ≤ e ≤ 127` (exact: a power of two in f32's range).
fn pow2(e: i32) -> f32 {
    pow2_f64(e) as f32
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

/// Buffers of one thread's products: the operands' int16 panels (`b`'s, one a member of
/// a group).
#[derive(Default)]
struct Scratch {
    qa: Vec<i16>,
    qb: Vec<Vec<i16>>,
}

thread_local! {
    /// Taken out while a product runs (so a product inside another allocates its own).
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// A float's bits without its sign: its magnitude, as an integer that orders
/// non-negative floats as their values do.
const MAGNITUDE: u32 = 0x7fff_ffff;
/// The least magnitude bits of an infinity or a NaN (above every finite value's).
const NON_FINITE: u32 = 0x7f80_0000;

/// The largest magnitude of `x`, or `None` where it holds an infinity or a NaN.
///
/// Magnitudes are compared as the integers of their bits (sign cleared), which order
/// non-negative floats as their values do and put an infinity or a NaN (bits at least
/// [`NON_FINITE`]) above every finite value: one integer maximum a vector, in four
/// independent chains.
#[target_feature(enable = "avx2,fma")]
unsafe fn max_abs(x: &[f32]) -> Option<f32> {
    let abs = _mm256_set1_epi32(MAGNITUDE as i32);
    let mut m = [_mm256_setzero_si256(); 4];
    let mut chunks = x.chunks_exact(32);
    for c in &mut chunks {
        for (v, m) in m.iter_mut().enumerate() {
            // SAFETY: `c` holds 32 floats.
            let b = unsafe { _mm256_loadu_si256(c.as_ptr().add(8 * v) as *const __m256i) };
            *m = _mm256_max_epu32(*m, _mm256_and_si256(b, abs));
        }
    }
    let mut rest = chunks.remainder().chunks_exact(8);
    for c in &mut rest {
        // SAFETY: `c` holds 8 floats.
        let b = unsafe { _mm256_loadu_si256(c.as_ptr() as *const __m256i) };
        m[0] = _mm256_max_epu32(m[0], _mm256_and_si256(b, abs));
    }
    let m = _mm256_max_epu32(_mm256_max_epu32(m[0], m[1]), _mm256_max_epu32(m[2], m[3]));
    let mut lanes = [0u32; 8];
    // SAFETY: 8 words.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, m) };
    let bits = lanes
        .into_iter()
        .chain(rest.remainder().iter().map(|v| v.to_bits() & MAGNITUDE))
        .max()
        .unwrap_or(0);
    (bits < NON_FINITE).then_some(f32::from_bits(bits))
}

/// Columns [`strip_stats`] takes at a time: eight vectors.
const STRIP: usize = 64;

/// How [`strip_stats`] visits the rows of `k`: nested axes `lead` (of `axes`), the last
/// outermost, row `Σ i_a · stride[a]`, each axis's sum from `0.0` in index order (so a
/// column's sum is the `sum_rows` kernel's, bit for bit: see [`ColumnSums`]); or, with no
/// sums asked, one axis of all `k` rows.
#[derive(Clone, Copy)]
struct Order {
    lead: [usize; SUM_AXES],
    stride: [usize; SUM_AXES],
    axes: usize,
}

impl Order {
    fn new(k: usize, sums: Option<&ColumnSums>) -> Order {
        let (mut lead, axes) = match sums {
            Some(s) => (s.lead, s.axes.clamp(1, SUM_AXES)),
            None => ([1; SUM_AXES], 1),
        };
        if sums.is_none() {
            lead[0] = k;
        }
        let mut stride = [1usize; SUM_AXES];
        for a in (0..axes - 1).rev() {
            stride[a] = stride[a + 1] * lead[a + 1];
        }
        Order { lead, stride, axes }
    }
}

/// Of the `w ≤ STRIP` columns from `j0` of `x` (row `p` the floats at `x.ptr + p·x.rs`,
/// its rows in `order`): each column's largest magnitude into `max[..w]`, and where
/// `sums`, each column's sum into `sums.dst[j0..j0 + w]`. `false` where a column holds an
/// infinity or a NaN (its maximum then means nothing; its sum is still the kernel's).
///
/// # Safety
/// The CPU must have AVX2; `x` must address the rows `order` visits, each with columns
/// `j0..j0 + w`; `sums.dst` must hold those columns.
#[target_feature(enable = "avx2,fma")]
unsafe fn strip_stats(
    x: Mat,
    order: Order,
    (j0, max): (usize, &mut [f32]),
    sums: Option<ColumnSums>,
) -> bool {
    const V: usize = STRIP / 8;
    let w = max.len().min(STRIP);
    let masks: [__m256i; V] = std::array::from_fn(|v| {
        let lanes = w.saturating_sub(8 * v).min(8) as i32;
        // Lane `l` on where `l < lanes` (its sign bit set).
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(lanes),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    });
    /// Each column's largest magnitude so far, as the integer of its bits (see
    /// [`max_abs`]: an infinity or a NaN above every finite value).
    struct Acc {
        max: [__m256i; V],
    }
    /// The sums over axis 0 of its rows from `row` on, their magnitudes into `acc`: the
    /// innermost loop, its accumulators in registers (`FULL`: all `STRIP` columns, read
    /// unmasked).
    #[inline(always)]
    unsafe fn rows<const FULL: bool>(
        x: Mat,
        (order, summed): (&Order, bool),
        row: usize,
        (j0, masks): (usize, &[__m256i; V]),
        acc: &mut Acc,
    ) -> [__m256; V] {
        let abs = _mm256_set1_epi32(MAGNITUDE as i32);
        let mut max = acc.max;
        let mut sum = [_mm256_setzero_ps(); V];
        for i in 0..order.lead[0] {
            // SAFETY: the row holds columns `j0..j0 + w` (the caller's); past `w`, masked.
            let at = unsafe {
                x.ptr
                    .offset((row + i * order.stride[0]) as isize * x.rs)
                    .add(j0)
            };
            for v in 0..V {
                // SAFETY: as above.
                let x = unsafe {
                    if FULL {
                        _mm256_loadu_ps(at.add(8 * v))
                    } else {
                        _mm256_maskload_ps(at.add(8 * v), masks[v])
                    }
                };
                let bits = _mm256_and_si256(_mm256_castps_si256(x), abs);
                max[v] = _mm256_max_epu32(max[v], bits);
                if summed {
                    sum[v] = _mm256_add_ps(sum[v], x);
                }
            }
        }
        acc.max = max;
        sum
    }
    /// The sums over axes `0..level` (`level ≥ 1`) of the rows from `row` on, the rows'
    /// magnitudes into `acc`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nested<const FULL: bool>(
        x: Mat,
        (order, summed): (&Order, bool),
        (level, row): (usize, usize),
        (j0, masks): (usize, &[__m256i; V]),
        acc: &mut Acc,
    ) -> [__m256; V] {
        if level == 1 {
            // SAFETY: as the caller's.
            return unsafe { rows::<FULL>(x, (order, summed), row, (j0, masks), acc) };
        }
        let axis = level - 1;
        let mut sum = [_mm256_setzero_ps(); V];
        for i in 0..order.lead[axis] {
            let row = row + i * order.stride[axis];
            // SAFETY: as the caller's.
            let t = unsafe { nested::<FULL>(x, (order, summed), (axis, row), (j0, masks), acc) };
            if summed {
                for (s, t) in sum.iter_mut().zip(t) {
                    *s = _mm256_add_ps(*s, t);
                }
            }
        }
        sum
    }
    let mut acc = Acc {
        max: [_mm256_setzero_si256(); V],
    };
    let how = (&order, sums.is_some());
    // SAFETY: as the caller's.
    let total = unsafe {
        if w == STRIP {
            nested::<true>(x, how, (order.axes, 0), (j0, &masks), &mut acc)
        } else {
            nested::<false>(x, how, (order.axes, 0), (j0, &masks), &mut acc)
        }
    };
    let mut lanes = [0u32; STRIP];
    for v in 0..V {
        // SAFETY: 8 words at `8v`.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().add(8 * v) as *mut __m256i, acc.max[v]) };
    }
    for (m, &bits) in max[..w].iter_mut().zip(&lanes) {
        *m = f32::from_bits(bits);
    }
    if let Some(s) = sums {
        for (v, t) in total.iter().enumerate() {
            // SAFETY: the masked lanes are columns below `j0 + w` of `sums.dst`.
            unsafe { _mm256_maskstore_ps(s.dst.add(j0 + 8 * v), masks[v], *t) };
        }
    }
    lanes[..w].iter().all(|&bits| bits < NON_FINITE)
}

/// `b`'s (`k × n`, row-major) column sums as `sums` asks, written whatever `b` holds.
///
/// # Safety
/// The CPU must have AVX2; `b` must address `k × n` floats, `k` the product of
/// `sums.lead`; `sums.dst` must hold `n` values, written by nothing else meanwhile.
unsafe fn column_sums(b: Mat, (k, n): (usize, usize), sums: ColumnSums) {
    let order = Order::new(k, Some(&sums));
    let (b, s) = (P(b.ptr, b.rs), S(sums));
    (0..n.div_ceil(STRIP)).into_par_iter().for_each(|t| {
        let (b, s) = (&b, &s);
        let j0 = t * STRIP;
        let mut max = [0f32; STRIP];
        let w = STRIP.min(n - j0);
        let b = Mat {
            ptr: b.0,
            rs: b.1,
            cs: 1,
        };
        // SAFETY: as the caller's; the sums are written whatever the columns hold.
        unsafe { strip_stats(b, order, (j0, &mut max[..w]), Some(s.0)) };
    });
}

/// A pointer and a row stride, to share with rayon's tasks.
struct P(*const f32, isize);
unsafe impl Send for P {}
unsafe impl Sync for P {}

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
    let base = P(x.ptr, x.rs);
    let ok = q
        .par_chunks_mut(W * 2 * pairs)
        .zip(exps.par_chunks_mut(W))
        .enumerate()
        .all(|(t, (panel, exps))| {
            let base = &base;
            // The panel's rows (as many as there are, at most `W`) and their scales.
            let mut lines: [&[f32]; W] = [&[]; W];
            let mut scales = [0f32; W];
            for (r, e) in exps.iter_mut().enumerate() {
                let i = t * W + r;
                // SAFETY: row `i < rows` holds `k` floats (the caller's contract).
                let v =
                    unsafe { std::slice::from_raw_parts(base.0.offset(i as isize * base.1), k) };
                // SAFETY: the CPU has AVX2 (checked before the kernel was set).
                let Some(max) = (unsafe { max_abs(v) }) else {
                    return false;
                };
                *e = exponent(max);
                (lines[r], scales[r]) = (v, pow2(*e));
            }
            let n = exps.len();
            // SAFETY: `n ≤ W` lines of `k` floats; the panel holds `W · 2 · pairs` int16;
            // the CPU has AVX2.
            unsafe { quantize_panel::<W>(&lines[..n], &scales[..n], k, panel) };
            true
        });
    ok.then_some(Quantized {
        ld: 2 * pairs,
        exps,
    })
}

/// `n ≤ W` lines of `k` floats (`lines[r]`, scaled by `scales[r]` and rounded to the
/// nearest int16, ties to even; `|x · s| ≤ 4095`) as one panel of [`quantize_rows`]: pair
/// `p` of line `r` (one int32, the even value low) in lane `r` of the panel's pair `p`
/// (`panel[2(W·p + r)..]`), lanes past `n` and the pad past `k` zero. Eight pairs of eight
/// lines at a time: each line's sixteen values rounded in registers, then an 8 × 8
/// transpose of int32 (six lines with two of zeros) stored as eight pairs of the panel.
///
/// # Safety
/// The CPU must have AVX2; every line must hold `k` floats; `panel` must hold
/// `W · 2 · ⌈k/2⌉` int16.
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_panel<const W: usize>(
    lines: &[&[f32]],
    scales: &[f32],
    k: usize,
    panel: &mut [i16],
) {
    debug_assert!((W == MR || W == NR) && lines.len() <= W && scales.len() == lines.len());
    let pairs = k.div_ceil(2);
    debug_assert!(panel.len() >= W * 2 * pairs);
    let dst = panel.as_mut_ptr() as *mut i32;
    let six = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);
    // Pairs whose sixteen values every line holds.
    let p8 = k / 16 * 8;
    for g in 0..W.div_ceil(8) {
        // Pairs `p..p + 8` of line `8g + r`, rounded (zero past the lines).
        let line = |r: usize, p: usize| {
            let Some(&x) = lines.get(8 * g + r) else {
                return _mm256_setzero_si256();
            };
            let s = _mm256_set1_ps(scales[8 * g + r]);
            // SAFETY: values `2p..2p + 16 ≤ k` of the line.
            unsafe {
                let at = x.as_ptr().add(2 * p);
                let lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(at), s));
                let hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(at.add(8)), s));
                // `packs` interleaves the 128-bit halves: lo 0–3, hi 0–3, lo 4–7, hi 4–7.
                _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(lo, hi))
            }
        };
        for p in (0..p8).step_by(8) {
            let r: [__m256i; 8] = std::array::from_fn(|i| line(i, p));
            // `t[2i]`, `t[2i + 1]`: lines `2i` and `2i + 1` interleaved, pairs 0, 1 and 4, 5
            // (low), 2, 3 and 6, 7 (high).
            let t: [__m256i; 8] = std::array::from_fn(|i| {
                let (x, y) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 {
                    _mm256_unpacklo_epi32(x, y)
                } else {
                    _mm256_unpackhi_epi32(x, y)
                }
            });
            // `u[c]`: pair `c` (low half) and pair `c + 4` (high half) of lines 0–3, and
            // `u[c + 4]` of lines 4–7.
            let u: [__m256i; 8] = std::array::from_fn(|i| {
                let (half, j) = (i / 4 * 4, i % 4);
                let (x, y) = (t[half + j / 2], t[half + j / 2 + 2]);
                if j % 2 == 0 {
                    _mm256_unpacklo_epi64(x, y)
                } else {
                    _mm256_unpackhi_epi64(x, y)
                }
            });
            for c in 0..8 {
                let v = if c < 4 {
                    _mm256_permute2x128_si256::<0x20>(u[c], u[c + 4])
                } else {
                    _mm256_permute2x128_si256::<0x31>(u[c - 4], u[c])
                };
                // SAFETY: pair `p + c`'s lanes `8g..` of the panel: all eight, or six
                // (eight where the next pair's first two follow, which it overwrites).
                unsafe {
                    let at = dst.add(W * (p + c) + 8 * g);
                    if W == NR || p + c + 1 < pairs {
                        _mm256_storeu_si256(at as *mut __m256i, v);
                    } else {
                        _mm256_maskstore_epi32(at, six, v);
                    }
                }
            }
        }
    }
    let round = |x: f32, s: f32| (x * s).round_ties_even() as i16 as u16 as u32;
    for p in p8..pairs {
        for r in 0..W {
            let lane = match (lines.get(r), scales.get(r)) {
                (Some(x), Some(&s)) => {
                    let hi = if 2 * p + 1 < k {
                        round(x[2 * p + 1], s)
                    } else {
                        0
                    };
                    round(x[2 * p], s) | hi << 16
                }
                _ => 0,
            };
            // SAFETY: lane `r < W` of the panel's pair `p < pairs`.
            unsafe { dst.add(W * p + r).write_unaligned(lane as i32) };
        }
    }
}

/// The columns of `x` (`k × cols`: row `p` the `cols` floats at `x.ptr + p·x.rs`) in
/// panels of `W` columns: for each pair `p` of rows (`2p`, `2p + 1`), `W` int32 lanes of
/// `(x[2p][j], x[2p+1][j])` as int16, low half first; `ld = 2·⌈k/2⌉` int16 a column of a
/// panel. With the columns' exponents; `None` where a column holds an infinity or a NaN.
/// `b`'s columns as the kernel's panels of [`NR`], or `a`'s rows, where `a` is stored
/// transposed, as its panels of [`MR`]. Where `sums` asks, also the columns' sums (see
/// [`strip_stats`]).
///
/// # Safety
/// `x` must address its `k` rows of `cols` floats (`x.cs == 1`); `sums.dst` must hold
/// `cols` values, written by nothing else meanwhile, and `k` be the product of its
/// `lead`.
unsafe fn pack_columns<const W: usize>(
    x: Mat,
    (k, cols): (usize, usize),
    buf: &mut Vec<i16>,
    sums: Option<ColumnSums>,
) -> Option<Quantized> {
    const { assert!(W <= NR) };
    let pairs = k.div_ceil(2);
    let panels = cols.div_ceil(W);
    // The columns' largest magnitudes (a column's maximum is the same whatever the order
    // of its rows): read along the rows; or, where sums are asked, strip by strip with
    // them, in the order their bits need.
    let maxima = match sums {
        // SAFETY: the caller's contract; the CPU has AVX2.
        None => unsafe { column_maxima(x, (k, cols)) }?,
        Some(sums) => {
            let order = Order::new(k, Some(&sums));
            let sums = S(sums);
            let mut maxima = vec![0f32; cols];
            let ok = maxima.par_chunks_mut(STRIP).enumerate().all(|(s, max)| {
                let sums = &sums;
                // SAFETY: the CPU has AVX2; the caller's contract.
                unsafe { strip_stats(x, order, (s * STRIP, max), Some(sums.0)) }
            });
            if !ok {
                return None;
            }
            maxima
        }
    };
    let exps: Vec<i32> = maxima.iter().map(|&m| exponent(m)).collect();
    // Scales, padded so that eight can be read from any column.
    let mut scales = vec![0f32; cols + 16];
    for (s, &e) in scales.iter_mut().zip(&exps) {
        *s = pow2(e);
    }
    let ld = 2 * pairs;
    let q = sized(buf, panels * W * ld);
    // Jobs of `PACK_PAIRS` pairs of the panels of `PACK_COLUMNS` columns.
    let chunk = (PACK_COLUMNS / W).max(1);
    let jobs: Vec<(usize, usize)> = (0..pairs.div_ceil(PACK_PAIRS))
        .flat_map(|b| (0..panels.div_ceil(chunk)).map(move |c| (b * PACK_PAIRS, c * chunk)))
        .collect();
    let (out, base, scales) = (Q(q.as_mut_ptr()), P(x.ptr, x.rs), &scales);
    jobs.par_iter().for_each(|&(p0, t0)| {
        let (out, base) = (&out, &base);
        let rows = Mat {
            ptr: base.0,
            rs: base.1,
            cs: 1,
        };
        // SAFETY: each job writes its own pairs of its own panels, which `q` holds; rows
        // `0..k` hold `cols` floats; `scales` holds `cols + 16`; the CPU has AVX2.
        unsafe {
            pack_block::<W>(
                rows,
                (k, cols),
                scales,
                (out.0, ld),
                (p0, (p0 + PACK_PAIRS).min(pairs)),
                (t0, (t0 + chunk).min(panels)),
            )
        };
    });
    Some(Quantized { ld, exps })
}

/// Column sums, to share with rayon's tasks.
struct S(ColumnSums);
unsafe impl Send for S {}
unsafe impl Sync for S {}

/// Rows of one job of [`column_maxima`].
const MAXIMA_ROWS: usize = 64;

/// The largest magnitude of each column of `x` (`k × cols`, row `p` the `cols` floats at
/// `x.ptr + p·x.rs`), or `None` where a column holds an infinity or a NaN. Rows are read
/// along their columns, [`PACK_COLUMNS`] at a time, by jobs of [`MAXIMA_ROWS`] rows whose
/// maxima are then combined (a maximum is the same in any order).
///
/// # Safety
/// The CPU must have AVX2; `x` must address `k` rows of `cols` floats.
unsafe fn column_maxima(x: Mat, (k, cols): (usize, usize)) -> Option<Vec<f32>> {
    let blocks = k.div_ceil(MAXIMA_ROWS);
    let base = P(x.ptr, x.rs);
    // Each job's maxima of its rows, as bits (see [`max_abs`]), `cols` a block.
    let mut partial = vec![0u32; blocks * cols];
    partial
        .par_chunks_mut(cols)
        .enumerate()
        .flat_map_iter(|(b, part)| {
            part.chunks_mut(PACK_COLUMNS)
                .enumerate()
                .map(move |(c, p)| (b, c, p))
        })
        .for_each(|(b, c, part)| {
            let base = &base;
            let r0 = b * MAXIMA_ROWS;
            // SAFETY: rows `r0..` (< k) hold columns `c·PACK_COLUMNS..` (< cols); the CPU
            // has AVX2.
            unsafe {
                block_maxima(
                    Mat {
                        ptr: base.0,
                        rs: base.1,
                        cs: 1,
                    },
                    (r0, (r0 + MAXIMA_ROWS).min(k)),
                    c * PACK_COLUMNS,
                    part,
                )
            };
        });
    let mut max = vec![0u32; cols];
    for part in partial.chunks(cols) {
        for (m, &p) in max.iter_mut().zip(part) {
            *m = (*m).max(p);
        }
    }
    max.iter()
        .all(|&bits| bits < NON_FINITE)
        .then(|| max.into_iter().map(f32::from_bits).collect())
}

/// The maxima of rows `r0..r1` of columns `j0..j0 + max.len()`, as bits (see
/// [`max_abs`]), into `max`.
///
/// # Safety
/// The CPU must have AVX2; rows `r0..r1` of `x` must hold those columns.
#[target_feature(enable = "avx2,fma")]
unsafe fn block_maxima(x: Mat, (r0, r1): (usize, usize), j0: usize, max: &mut [u32]) {
    let abs = _mm256_set1_epi32(MAGNITUDE as i32);
    let w = max.len();
    let w8 = w / 8 * 8;
    for r in r0..r1 {
        // SAFETY: row `r` holds columns `j0..j0 + w`.
        let row = unsafe { x.ptr.offset(r as isize * x.rs).add(j0) };
        for j in (0..w8).step_by(8) {
            // SAFETY: eight columns of the row and of `max`.
            unsafe {
                let v = _mm256_and_si256(_mm256_loadu_si256(row.add(j) as *const __m256i), abs);
                let m = max.as_mut_ptr().add(j) as *mut __m256i;
                _mm256_storeu_si256(m, _mm256_max_epu32(_mm256_loadu_si256(m), v));
            }
        }
        for (j, m) in max.iter_mut().enumerate().skip(w8) {
            // SAFETY: column `j0 + j` of the row.
            let bits = unsafe { (*row.add(j)).to_bits() } & MAGNITUDE;
            *m = (*m).max(bits);
        }
    }
}

/// Columns of the panels [`pack_block`] packs at a time: rows read 2 KiB at a time.
const PACK_COLUMNS: usize = 512;
/// Pairs of rows [`pack_block`] packs at a time.
const PACK_PAIRS: usize = 32;

/// A pointer to the panels, shared by the jobs that write their own parts of them.
struct Q(*mut i16);
unsafe impl Send for Q {}
unsafe impl Sync for Q {}

/// Pairs `p0..p1` of panels `t0..t1` of [`pack_columns`], row after row: the two rows of
/// a pair read along the columns of the panels, each panel's `W` lanes of the pair
/// written in turn, eight a vector (six as four and two, not into the next pair's); value
/// by value for a panel narrower than `W` or whose vector would read past the row's end.
///
/// Read this way, a job's rows stream through the caches 2 KiB at a time; read a panel at
/// a time (64 or 24 bytes of each row, the next row kilobytes away), they had kept the
/// prefetchers from running ahead (see `docs/PERFORMANCE.md`).
///
/// # Safety
/// The CPU must have AVX2; `x` must address `k` rows of `cols` floats; `scales` must hold
/// `cols + 16` values; `q` must address the panels' `W · ld` int16 each, and no other
/// thread write pairs `p0..p1` of panels `t0..t1` meanwhile.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_block<const W: usize>(
    x: Mat,
    (k, cols): (usize, usize),
    scales: &[f32],
    (q, ld): (*mut i16, usize),
    (p0, p1): (usize, usize),
    (t0, t1): (usize, usize),
) {
    debug_assert!(scales.len() >= cols + 16);
    let low = _mm256_set1_epi32(0xffff);
    for p in p0..p1 {
        // SAFETY: row `2p < k` (and `2p + 1` where `< k`) of `x`.
        let even = unsafe { x.ptr.offset(2 * p as isize * x.rs) };
        let odd = (2 * p + 1 < k).then(|| unsafe { even.offset(x.rs) });
        for t in t0..t1 {
            let j0 = t * W;
            let w = W.min(cols - j0);
            // SAFETY: pair `p` of panel `t`: `W` int32 lanes.
            let out = unsafe { q.add(t * W * ld + 2 * W * p) };
            if w == W && j0 + 8 * W.div_ceil(8) <= cols {
                for h in 0..W.div_ceil(8) {
                    // SAFETY: columns `j0 + 8h .. + 8 ≤ cols` of the rows; eight scales.
                    let v = unsafe {
                        let sv = _mm256_loadu_ps(scales.as_ptr().add(j0 + 8 * h));
                        let e = _mm256_cvtps_epi32(_mm256_mul_ps(
                            _mm256_loadu_ps(even.add(j0 + 8 * h)),
                            sv,
                        ));
                        let o = match odd {
                            Some(odd) => _mm256_cvtps_epi32(_mm256_mul_ps(
                                _mm256_loadu_ps(odd.add(j0 + 8 * h)),
                                sv,
                            )),
                            None => _mm256_setzero_si256(),
                        };
                        _mm256_or_si256(_mm256_and_si256(e, low), _mm256_slli_epi32::<16>(o))
                    };
                    // SAFETY: lanes `8h..` of the pair: eight, or the six of a six-wide
                    // panel (four and two, not into the next pair's).
                    unsafe {
                        let at = out.add(16 * h) as *mut __m256i;
                        if W == NR {
                            _mm256_storeu_si256(at, v);
                        } else {
                            _mm_storeu_si128(at as *mut __m128i, _mm256_castsi256_si128(v));
                            _mm_storel_epi64(
                                (out.add(8)) as *mut __m128i,
                                _mm256_extracti128_si256::<1>(v),
                            );
                        }
                    }
                }
                continue;
            }
            for j in 0..W {
                let (e, o) = if j < w {
                    let s = scales[j0 + j];
                    // SAFETY: column `j0 + j < cols` of the rows.
                    unsafe {
                        (
                            (*even.add(j0 + j) * s).round_ties_even() as i16,
                            odd.map_or(0, |odd| (*odd.add(j0 + j) * s).round_ties_even() as i16),
                        )
                    }
                } else {
                    (0, 0)
                };
                // SAFETY: lane `j < W` of the pair.
                unsafe {
                    *out.add(2 * j) = e;
                    *out.add(2 * j + 1) = o;
                }
            }
        }
    }
}

/// One row of [`tile`]'s loop: the row's pair (at byte `$at` of the pair's 24) broadcast
/// into `ymm2`, multiplied with `b`'s two vectors (`ymm0`, `ymm1`) into `ymm3` and `ymm2`,
/// then added to the row's accumulators `ymm$lo` and `ymm$hi`. Both products come before
/// both additions: on Zen 3, whose `VPMADDWD` runs on two of the four vector pipes and
/// `VPADDD` on all four, this order ran the tile loop 7 % faster than a product followed
/// by its addition (a one-core loop in L1: 5.1 against 4.7 G `VPMADDWD` a second, 2026-11-29).
macro_rules! row {
    ($at:literal, $lo:literal, $hi:literal) => {
        concat!(
            "vpbroadcastd ymm2, dword ptr [{a} + ",
            $at,
            "]\n",
            "vpmaddwd ymm3, ymm2, ymm0\n",
            "vpmaddwd ymm2, ymm2, ymm1\n",
            "vpaddd ymm",
            $lo,
            ", ymm",
            $lo,
            ", ymm3\n",
            "vpaddd ymm",
            $hi,
            ", ymm",
            $hi,
            ", ymm2",
        )
    };
}

/// The end of one block of [`tile`]: accumulator `ymm$r` (eight int32 sums) converted to
/// f32, added to its eight floats at byte `$at` of `acc` and stored there, then zeroed.
macro_rules! fold {
    ($r:literal, $at:literal) => {
        concat!(
            "vcvtdq2ps ymm",
            $r,
            ", ymm",
            $r,
            "\n",
            "vaddps ymm",
            $r,
            ", ymm",
            $r,
            ", [{acc} + ",
            $at,
            "]\n",
            "vmovups [{acc} + ",
            $at,
            "], ymm",
            $r,
            "\n",
            "vpxor xmm",
            $r,
            ", xmm",
            $r,
            ", xmm",
            $r,
        )
    };
}

/// One 6 × 16 tile over `pairs ≥ 1` pairs, the rows' pairs at `a` (6 pairs, 24 bytes, a
/// pair of columns), the panel's at `b` (64 bytes a pair): the int32 sums of every
/// [`BLOCK`] pairs converted to f32 and added in order into `acc` (96 values,
/// `acc[16r + j]`), from zero. The whole loop is one piece of assembly, so
/// that a block's sums go into `acc` from their registers.
///
/// # Safety
/// The CPU must have AVX2; `a` must address `pairs` pairs of its panel, `b` `pairs` lanes
/// of its panel.
#[inline]
unsafe fn tile(a: *const i16, b: *const i16, pairs: usize, acc: &mut [f32; 96]) {
    debug_assert!(pairs >= 1);
    // SAFETY: as the caller's; the loop reads `pairs` pairs of each row and lanes of `b`,
    // and writes the 96 floats of `acc`.
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
            // `acc` zeroed (here: a `memset` call cost 2 % of a training step).
            "vmovups [{acc}], ymm4",
            "vmovups [{acc} + 32], ymm4",
            "vmovups [{acc} + 64], ymm4",
            "vmovups [{acc} + 96], ymm4",
            "vmovups [{acc} + 128], ymm4",
            "vmovups [{acc} + 160], ymm4",
            "vmovups [{acc} + 192], ymm4",
            "vmovups [{acc} + 224], ymm4",
            "vmovups [{acc} + 256], ymm4",
            "vmovups [{acc} + 288], ymm4",
            "vmovups [{acc} + 320], ymm4",
            "vmovups [{acc} + 352], ymm4",
            // A block: `c = min(BLOCK, n)` of the `n` pairs left.
            "3:",
            "mov {c}, {block}",
            "cmp {n}, {block}",
            "cmovb {c}, {n}",
            "sub {n}, {c}",
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
            "dec {c}",
            "jnz 2b",
            fold!("4", "0"),
            fold!("5", "32"),
            fold!("6", "64"),
            fold!("7", "96"),
            fold!("8", "128"),
            fold!("9", "160"),
            fold!("10", "192"),
            fold!("11", "224"),
            fold!("12", "256"),
            fold!("13", "288"),
            fold!("14", "320"),
            fold!("15", "352"),
            "test {n}, {n}",
            "jnz 3b",
            block = const BLOCK,
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            n = inout(reg) pairs => _,
            c = out(reg) _,
            acc = in(reg) acc.as_mut_ptr(),
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack),
        );
    }
}

/// What [`store`] does after a tile's last part: the [`Epilogue`]'s bias (the tile's
/// columns of it) and ReLU.
#[derive(Clone, Copy)]
struct Finish<'a> {
    bias: Option<&'a [f32]>,
    relu: bool,
}

/// `v` as the `relu` kernel leaves it: kept where `v > 0` or `v` is NaN ("not less or
/// equal", unordered), else `+0.0`.
fn relu(v: f32) -> f32 {
    if v > 0.0 || v.is_nan() {
        v
    } else {
        0.0
    }
}

/// A tile's sums, unscaled (`acc[16r + j] · inv_a[r] · inv_b[j]`), written into the
/// `inv_a.len()` rows and `inv_b.len()` columns at `d` (row stride `ld`), or added to
/// what they hold unless `fresh`; then, after the last part of `k` (`finish`), the bias
/// added to the whole sum and the ReLU applied, as a pass after the product would.
///
/// # Safety
/// `d` must address those rows and columns; a bias must hold the tile's columns; the CPU
/// must have AVX2.
#[target_feature(enable = "avx2,fma")]
unsafe fn store(
    acc: &[f32; 96],
    (inv_a, inv_b): (&[f32], &[f32]),
    (d, ld): (*mut f32, isize),
    fresh: bool,
    finish: Option<Finish<'_>>,
) {
    let w = inv_b.len();
    let (bias, relu_on) = finish.map_or((None, false), |f| (f.bias, f.relu));
    let zero = _mm256_setzero_ps();
    for (r, &sa) in inv_a.iter().enumerate() {
        // SAFETY: row `r` of the tile, as the caller's.
        let row = unsafe { d.offset(r as isize * ld) };
        let acc = &acc[NR * r..NR * (r + 1)];
        if w == NR {
            for h in 0..2 {
                // SAFETY: 8 values at `8h` of each (a bias holds the tile's 16 columns);
                // columns `8h..8h + 8` of the row.
                unsafe {
                    let mut v = _mm256_mul_ps(
                        _mm256_mul_ps(_mm256_loadu_ps(acc.as_ptr().add(8 * h)), _mm256_set1_ps(sa)),
                        _mm256_loadu_ps(inv_b.as_ptr().add(8 * h)),
                    );
                    let p = row.add(8 * h);
                    if !fresh {
                        v = _mm256_add_ps(_mm256_loadu_ps(p), v);
                    }
                    if let Some(b) = bias {
                        v = _mm256_add_ps(v, _mm256_loadu_ps(b.as_ptr().add(8 * h)));
                    }
                    if relu_on {
                        let keep = _mm256_cmp_ps::<_CMP_NLE_UQ>(v, zero);
                        v = _mm256_and_ps(v, keep);
                    }
                    _mm256_storeu_ps(p, v);
                }
            }
        } else {
            for j in 0..w {
                // SAFETY: column `j < w` of the row.
                let p = unsafe { row.add(j) };
                let mut v = acc[j] * sa * inv_b[j];
                if !fresh {
                    // SAFETY: as above.
                    v += unsafe { *p };
                }
                if let Some(b) = bias {
                    v += b[j];
                }
                if relu_on {
                    v = relu(v);
                }
                // SAFETY: as above.
                unsafe { *p = v };
            }
        }
    }
}

/// A right operand `[k, n]` quantized once, for the products that read it while it is
/// unchanged (an inference program's weights, `Compiled::packed_weight`): its panels of
/// [`NR`] columns and the columns' `2^-e`. The same values as quantizing it for each
/// product, so the same bits.
pub(crate) struct Panels {
    k: usize,
    n: usize,
    ld: usize,
    inv: Vec<f32>,
    q: Vec<i16>,
}

impl Panels {
    /// `b` (`k × n`) quantized over rayon's threads; `None` where its strides are not the
    /// kernel's or a column holds an infinity or a NaN (its products then read it as it
    /// is and go to the f32 kernel).
    ///
    /// # Safety
    /// [`available`] must have returned `Ok`; `b` must address `k × n` valid elements.
    pub(crate) unsafe fn new(b: Mat, (k, n): (usize, usize)) -> Option<Panels> {
        if k == 0 || n == 0 {
            return None;
        }
        let mut q = Vec::new();
        // SAFETY: as the caller's.
        let quantized = unsafe { panels::<NR>(b.ptr, (b.cs, b.rs), (n, k), &mut q, None) }?;
        Some(Panels {
            k,
            n,
            ld: quantized.ld,
            inv: quantized.exps.iter().map(|&e| pow2(-e)).collect(),
            q,
        })
    }

    /// Whether it is a quantized `[k, n]` operand.
    pub(crate) fn is(&self, (k, n): (usize, usize)) -> bool {
        (self.k, self.n) == (k, n)
    }

    /// Its size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.q.len() * 2 + self.inv.len() * 4
    }
}

/// `dst[m, n] (row stride ld) = (read_dst ? dst : 0) + a[m, k]·b[k, n]`, then the
/// [`Epilogue`] (its bias added to the whole sum), with int16 operands (see the module's
/// comment), and `b`'s [`ColumnSums`] where asked. A member whose operands are neither
/// row-major nor stored transposed, or hold an infinity or a NaN, goes to the f32 kernel.
///
/// # Safety
/// As [`gemm_group`]'s for the one member.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    (m, k, n): (usize, usize, usize),
    dst: *mut f32,
    ld: isize,
    a: Mat,
    b: Rhs<'_>,
    read_dst: bool,
    epilogue: Epilogue,
    sums: Option<ColumnSums>,
) {
    let one = Member {
        n,
        dst,
        ld,
        b,
        read_dst,
        epilogue,
        sums,
    };
    // SAFETY: as the caller's.
    unsafe { gemm_group((m, k), a, std::slice::from_ref(&one)) }
}

/// The products `a·b` of every member of `members` (see [`Member`]), each as [`gemm`]
/// computes it alone, with `a` (`m × k`) quantized once for all and the members' columns
/// run side by side: the same sums as each member's own [`gemm`], so the same bits.
///
/// # Safety
/// [`available`] must have returned `Ok`; as [`super::gemm::gemm_one`] for each member,
/// whose bias holds `n` values and whose sums (of a row-major `b`, `k` the product of
/// their `lead`) `n`; no member's result overlaps another's, `a`, or any member's `b`,
/// bias or sums; a packed `b` is one of `k × n` for this kernel.
pub(crate) unsafe fn gemm_group((m, k): (usize, usize), a: Mat, members: &[Member<'_>]) {
    let mut scratch = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    // SAFETY: as the caller's.
    unsafe { general((m, k), a, members, &mut scratch) };
    SCRATCH.with(|s| *s.borrow_mut() = scratch);
}

/// A member's `b` as a matrix (a packed one's too: the f32 kernel reads it).
fn matrix(b: Rhs<'_>) -> Mat {
    match b {
        Rhs::Mat(b) | Rhs::Packed(_, b) => b,
    }
}

/// One member as the f32 kernel computes it: the product, the [`Epilogue`] as a pass
/// after it, and the column sums.
///
/// # Safety
/// As [`gemm_group`]'s for the member.
unsafe fn f32_member((m, k): (usize, usize), a: Mat, mb: &Member<'_>) {
    let (n, b) = (mb.n, matrix(mb.b));
    let par = super::gemm::parallelism(m * k * n);
    // SAFETY: as the caller's.
    unsafe { super::gemm::gemm_one((m, k, n), mb.dst, mb.ld, a, b, mb.read_dst, par) };
    let e = mb.epilogue;
    if e.bias.is_some() || e.relu {
        // SAFETY: the caller's bias holds `n` values.
        let bias = e.bias.map(|p| unsafe { std::slice::from_raw_parts(p, n) });
        for i in 0..m {
            // SAFETY: row `i` of the result holds `n` values.
            let row =
                unsafe { std::slice::from_raw_parts_mut(mb.dst.offset(i as isize * mb.ld), n) };
            for (j, v) in row.iter_mut().enumerate() {
                if let Some(bias) = bias {
                    *v += bias[j];
                }
                if e.relu {
                    *v = relu(*v);
                }
            }
        }
    }
    if let Some(s) = mb.sums {
        // SAFETY: as the caller's (a row-major `b` where sums are asked).
        unsafe { column_sums(b, (k, n), s) };
    }
}

/// The kernel's panels of `W` lines of `k` values: line `i`'s value `p` at
/// `ptr + i·line + p·step`. From the lines where their values are contiguous
/// ([`quantize_rows`]), else from the rows of the matrix they are the columns of
/// ([`pack_columns`]); `None` for other strides, or where a line holds an infinity or a
/// NaN. Where `sums` asks (only of lines that are the columns of a row-major matrix),
/// also their sums, whatever the result.
///
/// # Safety
/// `ptr` must address every value at those strides; as [`pack_columns`]' for `sums`.
unsafe fn panels<const W: usize>(
    ptr: *const f32,
    (line, step): (isize, isize),
    (lines, k): (usize, usize),
    buf: &mut Vec<i16>,
    sums: Option<ColumnSums>,
) -> Option<Quantized> {
    let rows = |rs: isize| Mat { ptr, rs, cs: 1 };
    let (by_rows, by_columns) = (step == 1 || k == 1, line == 1 || lines == 1);
    // SAFETY (all): as the caller's, read with the strides given here.
    if by_columns && (!by_rows || sums.is_some()) {
        unsafe { pack_columns::<W>(rows(step), (k, lines), buf, sums) }
    } else if by_rows {
        unsafe { quantize_rows::<W>(rows(line), (lines, k), buf) }
    } else {
        None
    }
}

/// A member's quantized `b`: its panels (`ld` int16 a column), the columns' `2^-e`.
struct Quantized16<'a> {
    q: &'a [i16],
    ld: usize,
    inv: std::borrow::Cow<'a, [f32]>,
}

/// [`gemm_group`] with `scratch`'s buffers.
///
/// # Safety
/// As [`gemm_group`]'s.
unsafe fn general((m, k): (usize, usize), a: Mat, members: &[Member<'_>], scratch: &mut Scratch) {
    // SAFETY (all `f32_member`s): as the caller's.
    let to_f32 = |mb: &Member<'_>| unsafe { f32_member((m, k), a, mb) };
    // `a`'s lines are its rows (a line's values `a.cs` apart).
    let qa = if m == 0 || k == 0 {
        None
    } else {
        // SAFETY: `a` addresses its elements (the caller's contract).
        unsafe { panels::<MR>(a.ptr, (a.rs, a.cs), (m, k), &mut scratch.qa, None) }
    };
    let Some(qa) = qa else {
        members.iter().for_each(to_f32);
        return;
    };
    if scratch.qb.len() < members.len() {
        scratch.qb.resize_with(members.len(), Vec::new);
    }
    // Each member's `b` quantized here (its exponents), or packed beforehand; `None` for
    // a member that goes to the f32 kernel (run below, after the others).
    enum Got<'p> {
        Here(Quantized),
        Packed(&'p Panels),
    }
    let mut got: Vec<Option<Got<'_>>> = Vec::with_capacity(members.len());
    for (mb, buf) in members.iter().zip(scratch.qb.iter_mut()) {
        got.push(match mb.b {
            _ if mb.n == 0 => None,
            // (Column sums are asked of a matrix read in place, not of a packed one; were
            // they, the f32 kernel's member would take them.)
            Rhs::Packed(p, _) => match p.int16() {
                Some(p) if p.is((k, mb.n)) && mb.sums.is_none() => Some(Got::Packed(p)),
                _ => None,
            },
            // `b`'s lines are its columns.
            // SAFETY: `b` addresses its elements; sums as the caller's.
            Rhs::Mat(b) => unsafe {
                panels::<NR>(b.ptr, (b.cs, b.rs), (mb.n, k), buf, mb.sums).map(Got::Here)
            },
        });
    }
    let views: Vec<Option<Quantized16<'_>>> = got
        .iter()
        .zip(&scratch.qb)
        .map(|(g, buf)| match g {
            None => None,
            Some(Got::Here(qb)) => Some(Quantized16 {
                q: buf.as_slice(),
                ld: qb.ld,
                inv: qb.exps.iter().map(|&e| pow2(-e)).collect(),
            }),
            Some(Got::Packed(p)) => Some(Quantized16 {
                q: &p.q,
                ld: p.ld,
                inv: std::borrow::Cow::Borrowed(&p.inv),
            }),
        })
        .collect();
    let inv_a: Vec<f32> = qa.exps.iter().map(|&e| pow2(-e)).collect();
    // Tasks: every column panel of every member quantized, side by side.
    let tasks: Vec<(usize, usize)> = views
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_some())
        .flat_map(|(i, _)| (0..members[i].n.div_ceil(NR)).map(move |t| (i, t)))
        .collect();
    let pairs = k.div_ceil(2);
    let qa_buf = &scratch.qa;
    let threads = rayon::current_num_threads();
    for p0 in (0..pairs).step_by(KC) {
        let p1 = (p0 + KC).min(pairs);
        for i0 in (0..m).step_by(MC) {
            let i1 = (i0 + MC).min(m);
            let run = |&(i, t): &(usize, usize)| {
                let (mb, Some(v)) = (&members[i], &views[i]) else {
                    return;
                };
                let j0 = t * NR;
                let w = NR.min(mb.n - j0);
                let panel = &v.q[t * NR * v.ld..(t + 1) * NR * v.ld];
                let finish = (p1 == pairs).then(|| Finish {
                    // SAFETY: the caller's bias holds `n` values.
                    bias: mb
                        .epilogue
                        .bias
                        .map(|b| unsafe { std::slice::from_raw_parts(b.add(j0), w) }),
                    relu: mb.epilogue.relu,
                });
                let fresh = p0 == 0 && !mb.read_dst;
                let mut acc = [0f32; 96];
                for r0 in (i0..i1).step_by(MR) {
                    let rows = MR.min(i1 - r0);
                    // The tile's rows of the result fetched while it computes: their stores
                    // had missed the caches (`store` took 4 % of a step; with this, products
                    // of 800 × 512 · 512 × 512 to 800 × 2048 · 2048 × 512 took 2–8 % less
                    // time, 2026-11-29).
                    for r in r0..r0 + rows {
                        // SAFETY: columns `j0` and `j0 + w - 1` of row `r < m` of the
                        // member's result.
                        unsafe {
                            let row = mb.dst.offset(r as isize * mb.ld);
                            _mm_prefetch::<_MM_HINT_ET0>(row.add(j0) as *const i8);
                            _mm_prefetch::<_MM_HINT_ET0>(row.add(j0 + w - 1) as *const i8);
                        }
                    }
                    // SAFETY: `qa` holds whole tiles of rows of `ld` int16 (`pairs`
                    // pairs); the panel holds `pairs` lanes; the CPU has AVX2.
                    unsafe {
                        tile(
                            qa_buf.as_ptr().add(r0 * qa.ld + 2 * MR * p0),
                            panel.as_ptr().add(2 * NR * p0),
                            p1 - p0,
                            &mut acc,
                        )
                    };
                    let scales = (&inv_a[r0..r0 + rows], &v.inv[j0..j0 + w]);
                    // SAFETY: rows `r0..r0 + rows` (< m) and columns `j0..j0 + w` of the
                    // member's result; each task writes only its own columns; the CPU has
                    // AVX2.
                    unsafe {
                        let d = mb.dst.offset(r0 as isize * mb.ld).add(j0);
                        store(&acc, scales, (d, mb.ld), fresh, finish)
                    };
                }
            };
            if threads > 1 && tasks.len() > 1 {
                tasks.par_iter().for_each(run);
            } else {
                tasks.iter().for_each(run);
            }
        }
    }
    for (mb, v) in members.iter().zip(&views) {
        if v.is_none() && mb.n > 0 {
            to_f32(mb);
        }
    }
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
        unsafe {
            gemm(
                (m, k, n),
                dst.as_mut_ptr(),
                n as isize,
                a,
                Rhs::Mat(b),
                read,
                Epilogue::default(),
                None,
            )
        };
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

    /// The f32 kernel's product of row-major `a` and `b`.
    fn f32_product((m, k, n): (usize, usize, usize), a: &[f32], b: &[f32]) -> Vec<f32> {
        let mat = |p: &[f32], cols: usize| Mat {
            ptr: p.as_ptr(),
            rs: cols as isize,
            cs: 1,
        };
        let mut c = vec![0f32; m * n];
        // SAFETY: the buffers hold the matrices.
        unsafe {
            super::super::gemm::gemm_one(
                (m, k, n),
                c.as_mut_ptr(),
                n as isize,
                mat(a, k),
                mat(b, n),
                false,
                super::super::gemm::parallelism(m * k * n),
            )
        };
        c
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
        for e in -149..=127 {
            assert_eq!(pow2(e).to_bits(), (2f64.powi(e) as f32).to_bits(), "2^{e}");
        }
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
            // Operands read along their rows in more than one chunk of columns: `b`'s
            // 530 columns, `a`'s 520 rows stored transposed (the last panels of both
            // narrower than a whole one).
            (7, 67, 530, false, false, true),
            (520, 20, 9, true, false, false),
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
            let want = f32_product((m, k, n), &a, &b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&got) == bits(&want), "{what}");
            assert!(
                got.iter().any(|x| !x.is_finite()),
                "{what}: no infinity or NaN"
            );
        }
    }

    /// An infinity or a NaN in an operand whose lines are its columns (read along its
    /// rows, in chunks of columns) also sends the product to the f32 kernel: a NaN in `a`
    /// stored transposed, an infinity in `b`, each past the first chunk of 512 columns.
    #[test]
    fn int16_products_find_infinities_and_nans_in_every_chunk_of_columns() {
        if skip() {
            return;
        }
        let (m, k, n) = (530, 70, 530);
        let mut seed = 4u64;
        for (what, at_a) in [("NaN in a stored transposed", true), ("-inf in b", false)] {
            let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            let mut b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
            // Row 515 of `a` (a column of the stored matrix), column 521 of `b`.
            if at_a {
                a[515 * k + 33] = f32::NAN;
            } else {
                b[41 * n + 521] = f32::NEG_INFINITY;
            }
            let mut got = vec![0f32; m * n];
            product((m, k, n), (&a, &b), (at_a, false), &mut got, false);
            let want = f32_product((m, k, n), &a, &b);
            for i in 0..m {
                for j in 0..n {
                    let (g, w) = (got[i * n + j], want[i * n + j]);
                    if w.is_finite() {
                        // The f32 kernel's rounding, not the 2⁻¹² of int16 operands.
                        assert!(
                            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{what} ({i}, {j}): {g} against {w}"
                        );
                    } else {
                        assert!(
                            g.is_nan() == w.is_nan() && (g.is_nan() || g == w),
                            "{what} ({i}, {j}): {g} against {w}"
                        );
                    }
                }
            }
            let bad = if at_a {
                (0..n).map(|j| got[515 * n + j]).collect::<Vec<_>>()
            } else {
                (0..m).map(|i| got[i * n + 521]).collect()
            };
            assert!(
                bad.iter().all(|x| !x.is_finite()),
                "{what}: a finite result where the operand was not"
            );
        }
    }

    /// `b`'s column sums as the `sum_rows` kernel computes them (scalar): `b` (`k × n`,
    /// row-major) seen as `[lead[0], …, lead[axes − 1], n]`, one sum an axis from `0.0`
    /// in index order, the last axis's loop outermost.
    fn nested_sums(b: &[f32], n: usize, lead: &[usize]) -> Vec<f32> {
        fn level(
            b: &[f32],
            n: usize,
            lead: &[usize],
            stride: &[usize],
            l: usize,
            row: usize,
            j: usize,
        ) -> f32 {
            if l == 0 {
                return b[row * n + j];
            }
            let mut s = 0f32;
            for i in 0..lead[l - 1] {
                s += level(b, n, lead, stride, l - 1, row + i * stride[l - 1], j);
            }
            s
        }
        let mut stride = vec![1usize; lead.len()];
        for a in (0..lead.len() - 1).rev() {
            stride[a] = stride[a + 1] * lead[a + 1];
        }
        (0..n)
            .map(|j| level(b, n, lead, &stride, lead.len(), 0, j))
            .collect()
    }

    fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        if let Some(q) = (0..got.len()).find(|&q| got[q].to_bits() != want[q].to_bits()) {
            panic!("{what}: element {q} is {:e}, not {:e}", got[q], want[q]);
        }
    }

    /// A product with an [`Epilogue`] gives the bits of the product without one, its bias
    /// then added and its ReLU applied as a pass: with partial tiles and `k` in three
    /// parts (1100), a result added to, on 1 and 2 threads, NaNs in the bias (kept by the
    /// ReLU); with a row of NaNs (the f32 kernel's product, the pass after it).
    #[test]
    fn int16_products_add_the_bias_and_apply_the_relu_as_a_pass_after_them_would() {
        if skip() {
            return;
        }
        for ((m, k, n), nan) in [
            ((45, 37, 51), false),
            ((250, 1100, 70), false),
            ((13, 40, 20), true),
        ] {
            let mut seed = 9u64;
            let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            if nan {
                a[3 * k] = f32::NAN;
            }
            let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
            let mut bias: Vec<f32> = (0..n).map(|_| rng(&mut seed) * 4.0).collect();
            // A NaN bias in a whole tile's columns and in a partial tile's: kept by the
            // ReLU.
            bias[1] = f32::NAN;
            bias[n - 1] = f32::NAN;
            let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
            let (am, bm) = (stored(&a, (m, k), false), stored(&b, (k, n), false));
            let mat = |(v, (rs, cs)): &(Vec<f32>, (isize, isize))| Mat {
                ptr: v.as_ptr(),
                rs: *rs,
                cs: *cs,
            };
            for read in [false, true] {
                for relu_on in [false, true] {
                    for threads in [1, 2] {
                        let run = |e: Epilogue| {
                            on_threads(threads, || {
                                let mut c = c0.clone();
                                // SAFETY: the CPU has AVX2; the buffers hold the matrices
                                // and the bias `n` values.
                                unsafe {
                                    gemm(
                                        (m, k, n),
                                        c.as_mut_ptr(),
                                        n as isize,
                                        mat(&am),
                                        Rhs::Mat(mat(&bm)),
                                        read,
                                        e,
                                        None,
                                    )
                                };
                                c
                            })
                        };
                        let want: Vec<f32> = run(Epilogue::default())
                            .iter()
                            .enumerate()
                            .map(|(q, &x)| {
                                let v = x + bias[q % n];
                                if relu_on {
                                    relu(v)
                                } else {
                                    v
                                }
                            })
                            .collect();
                        let got = run(Epilogue {
                            bias: Some(bias.as_ptr()),
                            relu: relu_on,
                        });
                        let what =
                            format!("{m}×{k}·{k}×{n} read {read} relu {relu_on} on {threads}");
                        assert_same_bits(&got, &want, &what);
                        assert!(
                            (0..m).all(|i| got[i * n + 1].is_nan() && got[i * n + n - 1].is_nan()),
                            "{what}"
                        );
                        if nan {
                            assert!(got[3 * n..4 * n].iter().all(|x| x.is_nan()), "{what}");
                        } else if relu_on {
                            assert!(got.contains(&0.0), "{what}: a ReLU zero");
                        }
                    }
                }
            }
        }
        assert_eq!(relu(-0.0).to_bits(), 0f32.to_bits());
        assert!(relu(f32::NAN).is_nan());
        assert_eq!(relu(-3.0), 0.0);
        assert_eq!(relu(2.5), 2.5);
    }

    /// A group of products of one left operand ([`gemm_group`]) gives each member the
    /// bits of its own [`gemm`]: results with their own row strides, a bias and ReLU, a
    /// result added to, column sums (the `sum_rows` kernel's bits, over one axis and over
    /// two), a right operand stored transposed and one packed beforehand (the bits of one
    /// quantized for the product); `a` row-major and transposed, `k` in one part and in
    /// two, on 1 and 2 threads.
    #[test]
    fn grouped_int16_products_give_each_member_the_bits_of_its_own_product() {
        if skip() {
            return;
        }
        for ((m, k), widths) in [((100, 512), [64, 300, 40]), ((37, 600), [70, 17, 33])] {
            let mut seed = 17u64;
            for a_transposed in [false, true] {
                let av: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
                let sa = stored(&av, (m, k), a_transposed);
                let a = Mat {
                    ptr: sa.0.as_ptr(),
                    rs: sa.1 .0,
                    cs: sa.1 .1,
                };
                // Member `q`: `b` transposed for 1, packed beforehand for 2 (else
                // row-major); bias and ReLU for 0, bias for 2; `c` added to for 1; column
                // sums for 0, over `[4, k / 4]`.
                let bs: Vec<Vec<f32>> = widths
                    .iter()
                    .map(|&n| (0..k * n).map(|_| rng(&mut seed) * 8.0).collect())
                    .collect();
                let sb: Vec<(Vec<f32>, (isize, isize))> = bs
                    .iter()
                    .zip(widths)
                    .enumerate()
                    .map(|(q, (b, n))| stored(b, (k, n), q == 1))
                    .collect();
                let bm: Vec<Mat> = sb
                    .iter()
                    .map(|(v, (rs, cs))| Mat {
                        ptr: v.as_ptr(),
                        rs: *rs,
                        cs: *cs,
                    })
                    .collect();
                let biases: Vec<Vec<f32>> = widths
                    .iter()
                    .map(|&n| (0..n).map(|_| rng(&mut seed)).collect())
                    .collect();
                let c0: Vec<Vec<f32>> = widths
                    .iter()
                    .map(|&n| (0..m * (n + 3)).map(|_| rng(&mut seed)).collect())
                    .collect();
                let lead = [4, k / 4, 1, 1];
                let int16 = super::super::Bf16Kernel::Int16;
                // SAFETY (both): the CPU has AVX2 and `bm[2]` addresses `k × n`.
                let packed =
                    unsafe { super::super::bf16::PackedRhs::new(int16, (k, widths[2]), bm[2]) };
                let quantized = unsafe { Panels::new(bm[2], (k, widths[2])) }.expect("finite");
                assert!(packed.is(int16, (k, widths[2])));
                assert_eq!(packed.bytes(), quantized.bytes());
                for threads in [1, 2] {
                    let mut got = c0.clone();
                    let mut want = c0.clone();
                    let mut sums = [vec![f32::NAN; widths[0]], vec![f32::NAN; widths[0]]];
                    let members =
                        |cs: &mut [Vec<f32>], sums: &mut Vec<f32>, pack: bool| -> Vec<Member<'_>> {
                            cs.iter_mut()
                                .enumerate()
                                .map(|(q, c)| Member {
                                    n: widths[q],
                                    dst: c.as_mut_ptr(),
                                    ld: widths[q] as isize + 3,
                                    b: if q == 2 && pack {
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
                                        axes: 2,
                                    }),
                                })
                                .collect()
                        };
                    let [sums_got, sums_want] = &mut sums;
                    let group = members(&mut got, sums_got, true);
                    // SAFETY: the CPU has AVX2; every result holds `m` rows of its `ld`;
                    // nothing overlaps.
                    on_threads(threads, || unsafe { gemm_group((m, k), a, &group) });
                    for one in members(&mut want, sums_want, false) {
                        // SAFETY: as above.
                        on_threads(threads, || unsafe {
                            gemm_group((m, k), a, std::slice::from_ref(&one))
                        });
                    }
                    let what =
                        format!("{m}×{k} (transposed {a_transposed}) by {widths:?} on {threads}");
                    for q in 0..widths.len() {
                        assert_same_bits(&got[q], &want[q], &format!("{what}: member {q}"));
                        assert!(got[q] != c0[q], "{what}: member {q} written");
                    }
                    assert_same_bits(
                        sums_got,
                        &nested_sums(&bs[0], widths[0], &lead[..2]),
                        &format!("{what}: sums"),
                    );
                    assert_same_bits(sums_want, sums_got, &format!("{what}: sums alone"));
                }
            }
        }
    }

    /// A right operand that cannot be quantized is not packed (its products read it as it
    /// is); a packed one read with a left operand holding a NaN gives the f32 product of
    /// the matrix it was packed from, and its column sums where asked.
    #[test]
    fn int16_packed_operands_of_infinities_and_nans() {
        if skip() {
            return;
        }
        let (m, k, n) = (20, 64, 40);
        let mut seed = 4u64;
        let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
        let mut b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
        let mat = |p: &[f32], cols: usize| Mat {
            ptr: p.as_ptr(),
            rs: cols as isize,
            cs: 1,
        };
        let int16 = super::super::Bf16Kernel::Int16;
        b[5 * n + 1] = f32::INFINITY;
        // SAFETY (both): the CPU has AVX2; `b` holds `k × n`.
        let unpackable = unsafe { super::super::bf16::PackedRhs::new(int16, (k, n), mat(&b, n)) };
        assert!(!unpackable.is(int16, (k, n)) && unpackable.bytes() == 0);
        b[5 * n + 1] = 0.5;
        a[2 * k + 7] = f32::NAN;
        let packed = unsafe { super::super::bf16::PackedRhs::new(int16, (k, n), mat(&b, n)) };
        assert!(packed.is(int16, (k, n)) && packed.bytes() > 2 * k * n);
        let mut sums = vec![0f32; n];
        let mut got = vec![0f32; m * n];
        // SAFETY: the CPU has AVX2; the buffers hold the matrices.
        unsafe {
            gemm(
                (m, k, n),
                got.as_mut_ptr(),
                n as isize,
                mat(&a, k),
                Rhs::Packed(&packed, mat(&b, n)),
                false,
                Epilogue::default(),
                Some(ColumnSums {
                    dst: sums.as_mut_ptr(),
                    lead: [k, 1, 1, 1],
                    axes: 1,
                }),
            )
        };
        let want = f32_product((m, k, n), &a, &b);
        assert_same_bits(&got, &want, "a NaN in a");
        assert!(got[2 * n..3 * n].iter().all(|x| x.is_nan()));
        assert_same_bits(&sums, &nested_sums(&b, n, &[k]), "sums");
    }
}
