//! AVX-VNNI's `VPDPBUSD` on 256 bits (CPUs with VNNI but without AVX-512): sub-tiles of
//! 6 rows and 16 columns, each instruction summing four products of unsigned and signed
//! bytes into each of 8 int32 lanes.

use std::arch::x86_64::*;

use super::*;

/// Rows of a sub-tile: 12 accumulators, `b`'s two vectors and the broadcast quad of `a`
/// in the 16 registers.
const ROWS: usize = 6;

/// The int32 sums of rows `0..rows` (rounded up to sub-tiles) of the tile over `ld`
/// quads into `acc[NR·r + j]`: `Σ (q_a + 128) · q_b`.
///
/// # Safety
/// The CPU must have AVX2 and AVX-VNNI; the panels as [`super::avx512_vnni::tile`]'s.
#[target_feature(enable = "avx2,avxvnni")]
pub(super) unsafe fn tile(
    a: *const u8,
    b: *const i8,
    ld: usize,
    rows: usize,
    acc: &mut [i32; MR * NR],
) {
    const { assert!(MR.is_multiple_of(ROWS) && NR.is_multiple_of(16)) };
    for r0 in (0..rows).step_by(ROWS) {
        for j0 in (0..NR).step_by(16) {
            let mut c = [[_mm256_setzero_si256(); 2]; ROWS];
            for t in 0..ld {
                // SAFETY: quad `t` of the panels (the caller's).
                unsafe {
                    let bt = b.add(t * NR * QUAD + QUAD * j0);
                    let b0 = _mm256_loadu_si256(bt as *const __m256i);
                    let b1 = _mm256_loadu_si256(bt.add(32) as *const __m256i);
                    let at = a.add((t * MR + r0) * QUAD);
                    for (r, c) in c.iter_mut().enumerate() {
                        let x =
                            _mm256_set1_epi32((at.add(QUAD * r) as *const i32).read_unaligned());
                        c[0] = _mm256_dpbusd_avx_epi32(c[0], x, b0);
                        c[1] = _mm256_dpbusd_avx_epi32(c[1], x, b1);
                    }
                }
            }
            // SAFETY: the CPU has AVX2; rows `r0..r0 + ROWS ≤ MR`.
            unsafe { super::avx2::spill(&c, (r0, j0), acc) };
        }
    }
}
