//! AVX512-FP16's `VFMADD231PH`: one block of fp16 products, sums of 64 terms in fp16
//! added up in f32.

use std::arch::x86_64::*;

use super::*;

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
pub(super) unsafe fn half_block(
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
