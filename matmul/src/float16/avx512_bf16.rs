//! AVX-512's `VDPBF16PS`: one block of bf16 pair products summed in f32.

use std::arch::x86_64::*;

use super::*;

/// One 32 × 32 result block over the whole `k` with `VDPBF16PS`, from the same packed
/// panels as [`block`]: each 8 rows × 32 columns of the result are 16 vectors of 16 f32
/// held in registers over the whole `k`; each step broadcasts a row's bf16 pair to every
/// lane and multiplies it with a pair row of the two column tiles (16 columns × 2 terms,
/// one 64-byte line of a packed tile).
///
/// # Safety
/// [`dot_available`] must have returned `Ok`; every pointer addresses what it says.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn dot_block(
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
