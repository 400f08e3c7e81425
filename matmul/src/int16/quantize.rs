//! Scaling rows and columns to int16 and packing them into the kernel's panels, with
//! their maxima, column sums and the check for infinities and NaNs.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::*;

/// A float's bits without its sign: its magnitude, as an integer that orders
/// non-negative floats as their values do.
pub(super) const MAGNITUDE: u32 = 0x7fff_ffff;
/// The least magnitude bits of an infinity or a NaN (above every finite value's).
pub(super) const NON_FINITE: u32 = 0x7f80_0000;

/// The largest magnitude of `x`, or `None` where it holds an infinity or a NaN.
///
/// Magnitudes are compared as the integers of their bits (sign cleared), which order
/// non-negative floats as their values do and put an infinity or a NaN (bits at least
/// [`NON_FINITE`]) above every finite value: one integer maximum a vector, in four
/// independent chains.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn max_abs(x: &[f32]) -> Option<f32> {
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
pub(super) const STRIP: usize = 64;

/// How [`strip_stats`] visits the rows of `k`: nested axes `lead` (of `axes`), the last
/// outermost, row `Σ i_a · stride[a]`, each axis's sum from `0.0` in index order (so a
/// column's sum is the `sum_rows` kernel's, bit for bit: see [`ColumnSums`]); or, with no
/// sums asked, one axis of all `k` rows.
#[derive(Clone, Copy)]
pub(super) struct Order {
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
pub(super) unsafe fn strip_stats(
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
pub(crate) unsafe fn column_sums(b: Mat, (k, n): (usize, usize), sums: ColumnSums) {
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
pub(super) struct P(*const f32, isize);
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
pub(super) unsafe fn quantize_rows<const W: usize>(
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
pub(super) unsafe fn quantize_panel<const W: usize>(
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
pub(super) unsafe fn pack_columns<const W: usize>(
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
pub(super) struct S(ColumnSums);
unsafe impl Send for S {}
unsafe impl Sync for S {}

/// Rows of one job of [`column_maxima`].
pub(super) const MAXIMA_ROWS: usize = 64;

/// The largest magnitude of each column of `x` (`k × cols`, row `p` the `cols` floats at
/// `x.ptr + p·x.rs`), or `None` where a column holds an infinity or a NaN. Rows are read
/// along their columns, [`PACK_COLUMNS`] at a time, by jobs of [`MAXIMA_ROWS`] rows whose
/// maxima are then combined (a maximum is the same in any order).
///
/// # Safety
/// The CPU must have AVX2; `x` must address `k` rows of `cols` floats.
pub(super) unsafe fn column_maxima(x: Mat, (k, cols): (usize, usize)) -> Option<Vec<f32>> {
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
pub(super) unsafe fn block_maxima(x: Mat, (r0, r1): (usize, usize), j0: usize, max: &mut [u32]) {
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
pub(super) const PACK_COLUMNS: usize = 512;
/// Pairs of rows [`pack_block`] packs at a time.
pub(super) const PACK_PAIRS: usize = 32;

/// A pointer to the panels, shared by the jobs that write their own parts of them.
pub(super) struct Q(*mut i16);
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
pub(super) unsafe fn pack_block<const W: usize>(
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
