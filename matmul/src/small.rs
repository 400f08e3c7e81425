//! Small matrix products with AVX-512F or AVX2: attention's products of each head (`t ×
//! d_k · d_k × t`, `t × t · t × d_v`, and their gradients' transposed forms) and the
//! other single-threaded products of at most 128 columns.
//!
//! In: `dst[m, n] (row stride ld) = (read_dst ? dst : 0) + a[m, k]·b[k, n]`, both
//! operands strided (either may be stored transposed). Out: the result, each element the
//! f32 sum of its `k` products in order `p = 0, 1, …` with one fused multiply-add each
//! (`f32::mul_add` from 0), then added to `dst` where `read_dst`: the same bits with
//! either instruction set.
//!
//! `b` is first copied into a thread's scratch as `k` rows of `n` columns padded to a
//! multiple of the vector's lanes (16 or 8; a transposed `b` through register
//! transposes), unless (with AVX2) its rows are contiguous and whole vectors already;
//! then each block of rows of `a` keeps its results in registers over the whole `k`,
//! broadcasting one element of `a` to multiply a row of `b`. For these sizes
//! the `gemm` crate's packing and dispatch cost more than the multiply-adds (attention's
//! `q·kᵀ` at 25 tokens took 1.85 µs a head there).

use std::arch::x86_64::*;
use std::cell::RefCell;

use crate::float16::transpose16;
use crate::{Dst, Mat};

mod one_row;
pub(crate) use one_row::{row_products, takes_rows};

/// The widest `b` taken: 8 vectors of 16 columns.
const MAX_N: usize = 128;
/// The longest `k` taken (the scratch then holds at most 256 KB).
const MAX_K: usize = 512;

thread_local! {
    /// The padded copy of `b`, kept between products.
    static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The instruction set a product runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    /// 16 lanes, masked loads and stores.
    Avx512,
    /// 8 lanes with FMA (AMD Zen 1–3, Intel's client CPUs).
    Avx2,
}

/// The widest instruction set this CPU has for these products.
fn isa() -> Option<Isa> {
    if std::arch::is_x86_feature_detected!("avx512f") {
        Some(Isa::Avx512)
    } else if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        Some(Isa::Avx2)
    } else {
        None
    }
}

/// Whether [`gemm`] takes an `m × k · k × n` product: AVX-512F or AVX2 with FMA, `n ≤
/// 128`, `k ≤ 512`.
pub fn takes(k: usize, n: usize) -> bool {
    n <= MAX_N && k <= MAX_K && isa().is_some()
}

/// `dst[m, n] (row stride ld) = (read_dst ? dst : 0) + a[m, k]·b[k, n]` (see the module).
///
/// # Safety
/// [`takes`] must have returned `true`; every element the matrices address must be
/// valid; `dst` must not overlap `a`, `b`.
pub unsafe fn gemm((m, k, n): (usize, usize, usize), a: Mat, b: Mat, dst: Dst) {
    let isa = isa().expect("`takes` checked the CPU");
    // SAFETY: the caller's.
    unsafe { gemm_with(isa, (m, k, n), a, b, dst) }
}

/// [`gemm`] with `isa`, which the CPU must have.
///
/// # Safety
/// As [`gemm`].
unsafe fn gemm_with(isa: Isa, (m, k, n): (usize, usize, usize), a: Mat, b: Mat, dst: Dst) {
    debug_assert!(n <= MAX_N && k <= MAX_K);
    if m == 0 || n == 0 {
        return;
    }
    let lanes = match isa {
        Isa::Avx512 => 16,
        Isa::Avx2 => 8,
    };
    let nv = n.div_ceil(lanes);
    let np = nv * lanes;
    let mut pb = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
    if pb.len() < k * np {
        pb.resize(k * np, 0.0);
    }
    let op = Op { m, k, n, a, dst };
    // SAFETY: the caller's check found the instruction set; `b` addresses `k × n`; `pb`
    // holds `k · np`.
    unsafe {
        match isa {
            Isa::Avx512 => {
                // Rows of `b` read where they are when contiguous (attention's `p·v`, whose
                // `v` a copy would read twice), else from the copy.
                let src = if b.cs == 1 {
                    (b.ptr, b.rs)
                } else {
                    pack(b, (k, n), np, &mut pb);
                    (pb.as_ptr(), np as isize)
                };
                match nv {
                    1 => rows::<1, 8>(&op, src),
                    2 => rows::<2, 8>(&op, src),
                    3 => rows::<3, 6>(&op, src),
                    4 => rows::<4, 4>(&op, src),
                    5 => rows::<5, 4>(&op, src),
                    6 => rows::<6, 3>(&op, src),
                    7 => rows::<7, 2>(&op, src),
                    _ => rows::<8, 2>(&op, src),
                }
            }
            Isa::Avx2 => avx2::product(&op, b, np, &mut pb),
        }
    }
    PACKED.with(|p| *p.borrow_mut() = pb);
}

/// A product's operands but `b` (read from its padded copy).
struct Op {
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    dst: Dst,
}

/// Copies `b` (`k × n`) into `out` as `k` rows of `np` columns (zeros past `n`).
///
/// # Safety
/// The CPU must have AVX-512F; `b` must address `k × n` valid elements; `out` holds
/// `k · np`, `np` a multiple of 16 at least `n`.
#[target_feature(enable = "avx512f")]
unsafe fn pack(b: Mat, (k, n): (usize, usize), np: usize, out: &mut [f32]) {
    let mask = |left: usize| -> u16 {
        if left >= 16 {
            !0
        } else {
            (1u16 << left) - 1
        }
    };
    if b.cs == 1 {
        for p in 0..k {
            for j0 in (0..np).step_by(16) {
                let m = mask(n.saturating_sub(j0));
                // SAFETY: row `p` holds `n` columns (masked past them); `out` holds the row.
                unsafe {
                    let x = _mm512_maskz_loadu_ps(m, b.ptr.offset(p as isize * b.rs).add(j0));
                    _mm512_storeu_ps(out.as_mut_ptr().add(p * np + j0), x);
                }
            }
        }
    } else if b.rs == 1 {
        // Stored transposed: column `j`'s `k` values are contiguous. By 16 × 16 blocks:
        // 16 columns' 16 values, transposed into 16 rows of the copy.
        for j0 in (0..np).step_by(16) {
            for p0 in (0..k).step_by(16) {
                let mp = mask(k - p0);
                let z: [__m512i; 16] = std::array::from_fn(|c| {
                    if j0 + c >= n {
                        return _mm512_setzero_si512();
                    }
                    // SAFETY: column `j0 + c` holds `k` values (masked past them).
                    unsafe {
                        let col = b.ptr.offset((j0 + c) as isize * b.cs).add(p0);
                        _mm512_castps_si512(_mm512_maskz_loadu_ps(mp, col))
                    }
                });
                let t = transpose16(&z);
                for (q, row) in t.iter().enumerate().take((k - p0).min(16)) {
                    // SAFETY: row `p0 + q` of the copy holds columns `j0..j0 + 16`.
                    unsafe {
                        _mm512_storeu_si512(
                            out.as_mut_ptr().add((p0 + q) * np + j0) as *mut _,
                            *row,
                        )
                    };
                }
            }
        }
    } else {
        // SAFETY: the caller's.
        unsafe { pack_strided(b, (k, n), np, out) };
    }
}

/// [`pack`] for a `b` neither row-major nor stored transposed, element by element (either
/// instruction set's copy).
///
/// # Safety
/// `b` must address `k × n` valid elements; `out` holds `k · np`, `np ≥ n`.
unsafe fn pack_strided(b: Mat, (k, n): (usize, usize), np: usize, out: &mut [f32]) {
    for p in 0..k {
        for j in 0..np {
            out[p * np + j] = if j < n {
                // SAFETY: `b` addresses element `(p, j)`.
                unsafe { *b.ptr.offset(p as isize * b.rs + j as isize * b.cs) }
            } else {
                0.0
            };
        }
    }
}

/// Every row of the result, `R` rows at a time (then one at a time), each row's `NV`
/// vectors of 16 sums in registers over the whole `k`.
///
/// # Safety
/// The CPU must have AVX-512F; `b` is `b`'s rows (`n` values each, `b.1` apart: `b`
/// itself, or its copy, [`pack`]); `op`'s pointers address what they say.
#[target_feature(enable = "avx512f")]
unsafe fn rows<const NV: usize, const R: usize>(op: &Op, b: (*const f32, isize)) {
    let mut i = 0;
    while i + R <= op.m {
        // SAFETY: as the caller's; rows `i..i + R` exist.
        unsafe { block::<NV, R>(op, b, i) };
        i += R;
    }
    while i < op.m {
        // SAFETY: as above, row `i`.
        unsafe { block::<NV, 1>(op, b, i) };
        i += 1;
    }
}

/// Rows `i0..i0 + R` of the result.
///
/// # Safety
/// As [`rows`]; the rows exist.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block<const NV: usize, const R: usize>(
    op: &Op,
    (b, brs): (*const f32, isize),
    i0: usize,
) {
    let a = op.a;
    let masks: [u16; NV] = std::array::from_fn(|v| {
        let left = op.n.saturating_sub(16 * v);
        if left >= 16 {
            !0
        } else {
            (1u16 << left) - 1
        }
    });
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    for p in 0..op.k {
        // SAFETY: row `p` of `b` holds `n` values (masked past them); `a` addresses
        // `(i0 + r, p)`.
        unsafe {
            let bp = b.offset(p as isize * brs);
            let bv: [__m512; NV] =
                std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], bp.add(16 * v)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = *a.ptr.offset((i0 + r) as isize * a.rs + p as isize * a.cs);
                let x = _mm512_set1_ps(x);
                for (acc, &b) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_fmadd_ps(x, b, *acc);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (v, &sum) in acc.iter().enumerate() {
            let j0 = 16 * v;
            let left = op.n - j0.min(op.n);
            let mask: u16 = if left >= 16 { !0 } else { (1u16 << left) - 1 };
            // SAFETY: row `i0 + r` of `dst` holds `n` columns (masked past them).
            unsafe {
                let at = op.dst.ptr.offset((i0 + r) as isize * op.dst.ld).add(j0);
                let v = if op.dst.read {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(mask, at), sum)
                } else {
                    sum
                };
                _mm512_mask_storeu_ps(at, mask, v);
            }
        }
    }
}

/// The same products in 8-lane vectors.
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Mat, Op};

    /// Computes `op`'s rows from `b` as it is where its rows are contiguous and whole
    /// vectors (attention's `p·v`: `v` is read once a row of `p`, so a copy would double
    /// its reads, which at decoding come from memory), else from its copy in `pb` (`k`
    /// rows of `np` columns, a multiple of 8; [`pack`]).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; as [`super::gemm`]; `pb` holds `k · np`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(op: &Op, b: Mat, np: usize, pb: &mut [f32]) {
        // SAFETY: the caller's.
        unsafe {
            let (bp, brs) = if b.cs == 1 && b.rs >= 0 && op.n == np {
                (b.ptr, b.rs as usize)
            } else {
                pack(b, (op.k, op.n), np, pb);
                (pb.as_ptr(), np)
            };
            // Panels of at most 4 vectors (32 columns), each over every row, with as many
            // rows as keep their sums, the panel's row of `b` and the broadcast in the 16
            // registers (a spilled sum waits on a store and a load each step: three rows
            // of 4 vectors ran `25 × 25 · 25 × 64` in 2.2 µs, two rows in 1.1 µs).
            for v0 in (0..np / 8).step_by(4) {
                match (np / 8 - v0).min(4) {
                    1 => rows::<1, 8>(op, bp, brs, v0),
                    2 => rows::<2, 6>(op, bp, brs, v0),
                    3 => rows::<3, 3>(op, bp, brs, v0),
                    _ => rows::<4, 2>(op, bp, brs, v0),
                }
            }
        }
    }

    /// Lanes `0..left` (all where `left ≥ 8`) as a `maskload` mask.
    #[inline(always)]
    unsafe fn mask(left: usize) -> __m256i {
        let left = left.min(8) as i32;
        unsafe {
            _mm256_cmpgt_epi32(
                _mm256_set1_epi32(left),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            )
        }
    }

    /// Copies `b` (`k × n`) into `out` as `k` rows of `np` columns (zeros past `n`).
    ///
    /// # Safety
    /// The CPU must have AVX2; `b` must address `k × n` valid elements; `out` holds
    /// `k · np`, `np` a multiple of 8 at least `n`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pack(b: Mat, (k, n): (usize, usize), np: usize, out: &mut [f32]) {
        if b.cs == 1 {
            for p in 0..k {
                for j0 in (0..np).step_by(8) {
                    // SAFETY: row `p` holds `n` columns (masked past them); `out` holds
                    // the row.
                    unsafe {
                        let row = b.ptr.offset(p as isize * b.rs).add(j0);
                        let x = if j0 + 8 <= n {
                            _mm256_loadu_ps(row)
                        } else {
                            _mm256_maskload_ps(row, mask(n.saturating_sub(j0)))
                        };
                        _mm256_storeu_ps(out.as_mut_ptr().add(p * np + j0), x);
                    }
                }
            }
        } else if b.rs == 1 {
            // SAFETY: the caller's.
            unsafe { pack_transposed(b.ptr, b.cs as usize, (k, n), np, out) };
        } else {
            // SAFETY: the caller's.
            unsafe { super::pack_strided(b, (k, n), np, out) };
        }
    }

    /// [`pack`] of a `b` stored transposed (column `j`'s `k` values contiguous from
    /// `src + j·cs`): 8 × 8 register transposes over every block of 8 columns of the
    /// copy, the last one's columns past `n` transposed from zeros (no scalar edge, no
    /// separate fill: attention's `kᵀ` at decoding has a few keys, rarely a multiple of
    /// 8); the rows past the last multiple of 8 element by element.
    ///
    /// # Safety
    /// The CPU must have AVX2; `src` addresses `p + j·cs` for `p < k`, `j < n`; `out`
    /// holds `k · np`, `np` a multiple of 8 at least `n`.
    #[target_feature(enable = "avx2")]
    unsafe fn pack_transposed(
        src: *const f32,
        cs: usize,
        (k, n): (usize, usize),
        np: usize,
        out: &mut [f32],
    ) {
        let dst = out.as_mut_ptr();
        let mut p = 0;
        while p + 8 <= k {
            for j0 in (0..np).step_by(8) {
                // SAFETY: columns `j0 + i < n` hold rows `p..p + 8`; `out` holds rows
                // `p..p + 8` of `np ≥ j0 + 8` columns.
                unsafe {
                    let cols = std::array::from_fn(|i| {
                        if j0 + i < n {
                            _mm256_loadu_ps(src.add(p + (j0 + i) * cs))
                        } else {
                            _mm256_setzero_ps()
                        }
                    });
                    let rows = crate::transpose::x86::transpose8(cols);
                    for (i, v) in rows.into_iter().enumerate() {
                        _mm256_storeu_ps(dst.add((p + i) * np + j0), v);
                    }
                }
            }
            p += 8;
        }
        for p in p..k {
            for j in 0..np {
                // SAFETY: as above, element by element.
                out[p * np + j] = if j < n {
                    unsafe { *src.add(p + j * cs) }
                } else {
                    0.0
                };
            }
        }
    }

    /// Every row of the result's vectors `v0..v0 + NV`, `R` rows at a time (then one at a
    /// time), each row's `NV` vectors of 8 sums in registers over the whole `k`.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `bp` addresses `b` or its copy ([`pack`]): `k`
    /// rows `brs` apart of at least `8 · (v0 + NV)` values; `op`'s pointers address what
    /// they say.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows<const NV: usize, const R: usize>(
        op: &Op,
        bp: *const f32,
        brs: usize,
        v0: usize,
    ) {
        let mut i = 0;
        while i + R <= op.m {
            // SAFETY: as the caller's; rows `i..i + R` exist.
            unsafe { block::<NV, R>(op, bp, brs, v0, i) };
            i += R;
        }
        while i < op.m {
            // SAFETY: as above, row `i`.
            unsafe { block::<NV, 1>(op, bp, brs, v0, i) };
            i += 1;
        }
    }

    /// Rows `i0..i0 + R` of the result's vectors `v0..v0 + NV`.
    ///
    /// # Safety
    /// As [`rows`]; the rows exist.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn block<const NV: usize, const R: usize>(
        op: &Op,
        bp: *const f32,
        brs: usize,
        v0: usize,
        i0: usize,
    ) {
        let a = op.a;
        let mut acc = [[_mm256_setzero_ps(); NV]; R];
        for p in 0..op.k {
            // SAFETY: row `p` of `b` holds `8 · (v0 + NV)` values from `bp + p·brs`; `a`
            // addresses `(i0 + r, p)`.
            unsafe {
                let bp = bp.add(p * brs + 8 * v0);
                let bv: [__m256; NV] = std::array::from_fn(|v| _mm256_loadu_ps(bp.add(8 * v)));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = *a.ptr.offset((i0 + r) as isize * a.rs + p as isize * a.cs);
                    let x = _mm256_set1_ps(x);
                    for (acc, &b) in acc.iter_mut().zip(&bv) {
                        *acc = _mm256_fmadd_ps(x, b, *acc);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, &sum) in acc.iter().enumerate() {
                let j0 = 8 * (v0 + v);
                let left = op.n - j0.min(op.n);
                // SAFETY: row `i0 + r` of `dst` holds `n` columns: 8 from `j0` where
                // `left ≥ 8`, else `left` (AMD's masked stores are microcoded, several
                // times slower than a scalar copy of the few columns past the last 8).
                unsafe {
                    let at = op.dst.ptr.offset((i0 + r) as isize * op.dst.ld).add(j0);
                    if left >= 8 {
                        let v = if op.dst.read {
                            _mm256_add_ps(_mm256_loadu_ps(at), sum)
                        } else {
                            sum
                        };
                        _mm256_storeu_ps(at, v);
                    } else {
                        let mut lanes = [0f32; 8];
                        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
                        for (c, &x) in lanes.iter().enumerate().take(left) {
                            *at.add(c) = if op.dst.read { *at.add(c) + x } else { x };
                        }
                    }
                }
            }
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
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The products equal, bit for bit, the scalar sums in order with one fused
    /// multiply-add each (then added to `dst` where read), for operands stored row-major,
    /// transposed and with other strides, at widths around the 16-column vectors, the
    /// widest and longest taken, and one to five rows (the row blocks' remainders).
    #[test]
    fn small_products_are_the_fused_sums_in_order() {
        let mut isas = vec![];
        if std::arch::is_x86_feature_detected!("avx512f") {
            isas.push(Isa::Avx512);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            isas.push(Isa::Avx2);
        }
        if isas.is_empty() {
            println!("skipped: neither AVX-512F nor AVX2 with FMA");
            return;
        }
        for isa in isas {
            println!("{isa:?}");
            products_are_the_fused_sums_in_order(isa);
        }
    }

    fn products_are_the_fused_sums_in_order(isa: Isa) {
        let mut seed = 9u64;
        for (m, k, n) in [
            (25, 64, 25),
            (25, 25, 64),
            (1, 1, 1),
            (5, 7, 15),
            (9, 17, 16),
            (3, 33, 17),
            (4, 100, 100),
            (13, 512, 128),
            (2, 3, 113),
            // Decoding's attention of one query a row: `q·kᵀ` and `p·v` over a few keys.
            (1, 64, 14),
            (1, 14, 64),
            (2, 30, 64),
        ] {
            // Each operand stored row-major (0), transposed (1) or with a gap between its
            // rows and columns (2: strides `2·cols + 1` and 2).
            for (la, lb) in [(0, 0), (1, 0), (0, 1), (1, 1), (2, 2), (0, 2)] {
                let store = |rows: usize, cols: usize, l: usize, seed: &mut u64| {
                    let (rs, cs, len) = match l {
                        0 => (cols, 1, rows * cols),
                        1 => (1, rows, rows * cols),
                        _ => (2 * cols + 1, 2, rows * (2 * cols + 1)),
                    };
                    let v: Vec<f32> = (0..len).map(|_| rng(seed)).collect();
                    (v, rs as isize, cs as isize)
                };
                let (av, ars, acs) = store(m, k, la, &mut seed);
                let (bv, brs, bcs) = store(k, n, lb, &mut seed);
                let a = Mat {
                    ptr: av.as_ptr(),
                    rs: ars,
                    cs: acs,
                };
                let b = Mat {
                    ptr: bv.as_ptr(),
                    rs: brs,
                    cs: bcs,
                };
                let ld = n + 3;
                let c0: Vec<f32> = (0..m * ld).map(|_| rng(&mut seed)).collect();
                for read in [false, true] {
                    let mut c = c0.clone();
                    // SAFETY: the CPU has `isa`; the operands address their elements and
                    // `c` holds `m` rows of `ld`.
                    unsafe {
                        let dst = Dst::new(c.as_mut_ptr(), ld as isize, read);
                        gemm_with(isa, (m, k, n), a, b, dst)
                    };
                    for i in 0..m {
                        for j in 0..ld {
                            let want = if j >= n {
                                c0[i * ld + j]
                            } else {
                                let mut s = 0f32;
                                for p in 0..k {
                                    let x = av[(i as isize * ars + p as isize * acs) as usize];
                                    let y = bv[(p as isize * brs + j as isize * bcs) as usize];
                                    s = x.mul_add(y, s);
                                }
                                if read {
                                    c0[i * ld + j] + s
                                } else {
                                    s
                                }
                            };
                            assert_eq!(
                                c[i * ld + j].to_bits(),
                                want.to_bits(),
                                "{isa:?} {m}×{k}·{k}×{n} layouts {la} {lb} read {read}: ({i}, {j})"
                            );
                        }
                    }
                }
            }
        }
    }
}
