//! Plain AVX2 (no VNNI): `VPMADDUBSW` multiplies the magnitudes of `b`'s bytes by `a`'s
//! carrying `b`'s signs (`VPSIGNB`) and sums pairs in int16 (at most `2 · 127² < 2¹⁵`, so
//! nothing saturates), `VPMADDWD` by ones sums those pairs into int32. Sub-tiles of 4
//! rows and 16 columns.

use std::arch::x86_64::*;

use super::*;

/// Rows of a sub-tile: 8 accumulators, `b`'s two vectors and their magnitudes, the ones,
/// the broadcast quad of `a` and a product in the 16 registers.
const ROWS: usize = 4;

/// The int32 sums of rows `0..rows` (rounded up to sub-tiles) of the tile over `ld`
/// quads into `acc[NR·r + j]`: `Σ q_a · q_b` (the offset taken off `a` in registers).
///
/// # Safety
/// The CPU must have AVX2; the panels as [`super::avx512_vnni::tile`]'s.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn tile(
    a: *const u8,
    b: *const i8,
    ld: usize,
    rows: usize,
    acc: &mut [i32; MR * NR],
) {
    const { assert!(MR.is_multiple_of(ROWS) && NR.is_multiple_of(16)) };
    let ones = _mm256_set1_epi16(1);
    let offset = _mm256_set1_epi8(-128);
    for r0 in (0..rows).step_by(ROWS) {
        for j0 in (0..NR).step_by(16) {
            let mut c = [[_mm256_setzero_si256(); 2]; ROWS];
            for t in 0..ld {
                // SAFETY: quad `t` of the panels (the caller's).
                unsafe {
                    let bt = b.add(t * NR * QUAD + QUAD * j0);
                    let b0 = _mm256_loadu_si256(bt as *const __m256i);
                    let b1 = _mm256_loadu_si256(bt.add(32) as *const __m256i);
                    let (m0, m1) = (_mm256_abs_epi8(b0), _mm256_abs_epi8(b1));
                    let at = a.add((t * MR + r0) * QUAD);
                    for (r, c) in c.iter_mut().enumerate() {
                        let q = (at.add(QUAD * r) as *const i32).read_unaligned();
                        // `q_a` itself: the stored `q_a + 128` with its top bit flipped.
                        let x = _mm256_xor_si256(_mm256_set1_epi32(q), offset);
                        let p0 = _mm256_maddubs_epi16(m0, _mm256_sign_epi8(x, b0));
                        let p1 = _mm256_maddubs_epi16(m1, _mm256_sign_epi8(x, b1));
                        c[0] = _mm256_add_epi32(c[0], _mm256_madd_epi16(p0, ones));
                        c[1] = _mm256_add_epi32(c[1], _mm256_madd_epi16(p1, ones));
                    }
                }
            }
            // SAFETY: the CPU has AVX2; rows `r0..r0 + ROWS ≤ MR`.
            unsafe { spill(&c, (r0, j0), acc) };
        }
    }
}

/// A sub-tile's accumulators (rows `r0..r0 + R`, columns `j0..j0 + 16`) into `acc`
/// (`acc[NR·r + j]`); the AVX-VNNI kernel's too.
///
/// # Safety
/// The CPU must have AVX2; `r0 + R ≤ MR`, `j0 + 16 ≤ NR`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn spill<const R: usize>(
    c: &[[__m256i; 2]; R],
    (r0, j0): (usize, usize),
    acc: &mut [i32; MR * NR],
) {
    assert!(r0 + R <= MR && j0 + 16 <= NR);
    for (r, c) in c.iter().enumerate() {
        for (h, &v) in c.iter().enumerate() {
            let at = NR * (r0 + r) + j0 + 8 * h;
            // SAFETY: 8 of `acc`'s lanes, at `at` (checked above).
            unsafe { _mm256_storeu_si256(acc.as_mut_ptr().add(at) as *mut __m256i, v) };
        }
    }
}
