//! Scaling the left operand's rows and the right operand's columns to int8, into the
//! kernels' panels, with the check for infinities and NaNs.

use std::arch::x86_64::*;

use super::*;

/// The left operand quantized: panels of [`MR`] rows, `ld` quads a row (quad `t` of row
/// `r` of a panel at byte `4·(MR·t + r)`), each value stored as `q + 128`; the rows'
/// `max / 127`.
pub(crate) struct Rows {
    pub(crate) q: Vec<u8>,
    pub(crate) ld: usize,
    pub(crate) inv: Vec<f32>,
}

/// A float's bits without its sign: integers that order non-negative floats as their
/// values do, an infinity or a NaN (at least [`NON_FINITE`]) above every finite value.
const MAGNITUDE: u32 = 0x7fff_ffff;
const NON_FINITE: u32 = 0x7f80_0000;

/// `x · s` rounded to the nearest integer, ties to even: what `VCVTPS2DQ` does to the
/// same f32 product under the default rounding. `CVTSS2SI` (SSE, in every x86-64) rounds
/// the same way inline, where `round_ties_even` without SSE4.1 calls libm's `rintf`.
pub(crate) fn round(x: f32, s: f32) -> i8 {
    // SAFETY: SSE is in every x86-64 CPU.
    unsafe { _mm_cvtss_si32(_mm_set_ss(x * s)) as i8 }
}

/// `a` (`m × k`, any strides) in [`Rows`] (their bytes in `q`'s storage, a buffer reused
/// between products), or `None` where a row holds an infinity or a NaN. `flat`: for the tiles instead, rows one after another (`4 · ld` bytes each, quad
/// `t` of row `i` at byte `4·(ld·i + t)`), as many as [`amx::ROWS`] blocks hold.
///
/// # Safety
/// `a` must address `m × k` valid elements; the CPU must have AVX2.
pub(crate) unsafe fn quantize_rows(
    a: Mat,
    (m, k): (usize, usize),
    flat: bool,
    mut q: Vec<u8>,
) -> Option<Rows> {
    let ld = quads(k);
    let rows = if flat {
        m.next_multiple_of(super::amx::ROWS)
    } else {
        m.next_multiple_of(MR)
    };
    // Padding (past `k`, and rows past `m`) holds the offset of a zero.
    q.clear();
    q.resize(rows * QUAD * ld, 128);
    let mut inv = vec![0f32; m];
    let mut row = Vec::new();
    for (i, i_inv) in inv.iter_mut().enumerate() {
        let values: &[f32] = if a.cs == 1 {
            // SAFETY: row `i` holds `k` contiguous values (the caller's).
            unsafe { std::slice::from_raw_parts(a.ptr.offset(i as isize * a.rs), k) }
        } else {
            row.resize(k, 0.0);
            for (p, v) in row.iter_mut().enumerate() {
                // SAFETY: as the caller's.
                *v = unsafe { *a.ptr.offset(i as isize * a.rs + p as isize * a.cs) };
            }
            &row
        };
        // SAFETY: the CPU has AVX2 (the caller's).
        let max = unsafe { crate::int16::max_abs(values) }?;
        let s;
        (*i_inv, s) = scales(max);
        let (base, stride) = if flat {
            (i * QUAD * ld, QUAD)
        } else {
            ((i / MR) * MR * QUAD * ld + QUAD * (i % MR), MR * QUAD)
        };
        // SAFETY: the CPU has AVX2; the buffer holds `ld` quads of the row.
        unsafe { quantize_row(values, s, &mut q[base..], stride) };
    }
    Some(Rows { q, ld, inv })
}

/// `x`'s values times `s`, rounded, offset by 128, into a row from its first byte
/// `out[0]`: value `p` at `stride·(p / 4) + p % 4` (`stride` 4 for a flat row, `4·MR` in a
/// panel).
///
/// # Safety
/// The CPU must have AVX2; `out` must hold the row's quads.
#[target_feature(enable = "avx2")]
unsafe fn quantize_row(x: &[f32], s: f32, out: &mut [u8], stride: usize) {
    let k = x.len();
    assert!(out.len() >= stride * (k.div_ceil(QUAD) - 1) + QUAD);
    let vs = _mm256_set1_ps(s);
    let offset = _mm256_set1_epi8(-128);
    // The lanes of two `packs` back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let mut p = 0;
    while p + 32 <= k {
        // SAFETY: 32 values from `p`.
        let bytes = unsafe {
            let v: [__m256i; 4] = std::array::from_fn(|u| {
                _mm256_cvtps_epi32(_mm256_mul_ps(
                    _mm256_loadu_ps(x.as_ptr().add(p + 8 * u)),
                    vs,
                ))
            });
            let lo = _mm256_packs_epi32(v[0], v[1]);
            let hi = _mm256_packs_epi32(v[2], v[3]);
            let b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
            _mm256_xor_si256(b, offset)
        };
        let mut quads = [0u32; 8];
        // SAFETY: 32 bytes.
        unsafe { _mm256_storeu_si256(quads.as_mut_ptr() as *mut __m256i, bytes) };
        for (u, &w) in quads.iter().enumerate() {
            let at = stride * (p / QUAD + u);
            out[at..at + QUAD].copy_from_slice(&w.to_le_bytes());
        }
        p += 32;
    }
    for (p, &v) in x.iter().enumerate().skip(p) {
        out[stride * (p / QUAD) + p % QUAD] = (round(v, s) as u8) ^ 0x80;
    }
}

/// `b` (`k × n`, any strides) in [`Panels`], over rayon's threads, or `None` where a
/// column holds an infinity or a NaN.
///
/// # Safety
/// `b` must address `k × n` valid elements.
pub(crate) unsafe fn quantize_columns(b: Mat, (k, n): (usize, usize)) -> Option<Panels> {
    let at = |p: usize, j: usize| b.ptr.wrapping_offset(p as isize * b.rs + j as isize * b.cs);
    // Each column's largest magnitude, along the contiguous direction (a row-major
    // weight's rows, a transposed one's columns).
    let mut max = vec![0u32; n];
    along_contiguous(b, (k, n), |p, j| {
        // SAFETY: as the caller's.
        let v = unsafe { *at(p, j) };
        max[j] = max[j].max(v.to_bits() & MAGNITUDE);
    });
    if max.iter().any(|&m| m >= NON_FINITE) {
        return None;
    }
    let ld = quads(k);
    let panels = n.div_ceil(NR);
    let (mut inv, mut scale) = (vec![0f32; panels * NR], vec![0f32; panels * NR]);
    for (j, &m) in max.iter().enumerate() {
        (inv[j], scale[j]) = scales(f32::from_bits(m));
    }
    let mut q = vec![0i8; panels * NR * QUAD * ld];
    let mut comp = vec![0i32; panels * NR];
    #[derive(Clone, Copy)]
    struct B(Mat);
    unsafe impl Send for B {}
    unsafe impl Sync for B {}
    let src = B(b);
    q.par_chunks_mut(NR * QUAD * ld)
        .zip(comp.par_chunks_mut(NR))
        .enumerate()
        .for_each(|(t, (panel, comp))| {
            let b = src;
            let cols = NR.min(n - t * NR);
            let mut sums = [0i32; NR];
            // Integer sums: the same in either order.
            along_contiguous(b.0, (k, cols), |p, j| {
                let col = t * NR + j;
                // SAFETY: as the caller's.
                let v = unsafe { *b.0.ptr.offset(p as isize * b.0.rs + col as isize * b.0.cs) };
                let x = round(v, scale[col]);
                panel[QUAD * (NR * (p / QUAD) + j) + p % QUAD] = x;
                sums[j] += x as i32;
            });
            for (c, s) in comp.iter_mut().zip(&sums[..cols]) {
                *c = 128 * s;
            }
        });
    Some(Panels {
        k,
        n,
        ld,
        q,
        inv,
        comp,
    })
}

/// `f(p, j)` for every element of a `k × n` operand with `b`'s strides, along its
/// contiguous direction: a row-major weight's rows, a transposed one's columns (the tied
/// output projection).
fn along_contiguous(b: Mat, (k, n): (usize, usize), mut f: impl FnMut(usize, usize)) {
    if b.rs.unsigned_abs() < b.cs.unsigned_abs() {
        (0..n).for_each(|j| (0..k).for_each(|p| f(p, j)));
    } else {
        (0..k).for_each(|p| (0..n).for_each(|j| f(p, j)));
    }
}
