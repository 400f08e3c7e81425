//! AVX-512 VNNI's `VPDPBUSD`: a tile of `R` rows (of a panel of [`MR`]) and [`NR`]
//! columns, each 512-bit instruction summing four products of unsigned and signed bytes
//! into each of 16 int32 lanes.

use std::arch::x86_64::*;

use super::*;

/// The int32 sums of rows `0..R` of the tile over `ld` quads into `acc[NR·r + j]`:
/// `Σ (q_a + 128) · q_b`. Its `2R` accumulators stay in registers (`R ≤ 12`: 24 of the
/// 32, beside `b`'s two vectors and the broadcast quad of `a`).
///
/// # Safety
/// The CPU must have AVX-512F, BW and VNNI; `a` must address `MR · ld` quads (the panel's
/// layout: quad `t` of row `r` at byte `4·(MR·t + r)`), `b` `NR · ld` (quad `t` of column
/// `j` at byte `4·(NR·t + j)`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile<const R: usize>(
    a: *const u8,
    b: *const i8,
    ld: usize,
    acc: &mut [i32; MR * NR],
) {
    const { assert!(R <= MR) };
    let mut c = [[_mm512_setzero_si512(); 2]; R];
    for t in 0..ld {
        // SAFETY: quad `t` of the panels (the caller's).
        unsafe {
            let bt = b.add(t * NR * QUAD);
            let b0 = _mm512_loadu_si512(bt as *const __m512i);
            let b1 = _mm512_loadu_si512(bt.add(64) as *const __m512i);
            let at = a.add(t * MR * QUAD);
            for (r, c) in c.iter_mut().enumerate() {
                let x = _mm512_set1_epi32((at.add(QUAD * r) as *const i32).read_unaligned());
                c[0] = _mm512_dpbusd_epi32(c[0], x, b0);
                c[1] = _mm512_dpbusd_epi32(c[1], x, b1);
            }
        }
    }
    for (r, c) in c.iter().enumerate() {
        for (h, &v) in c.iter().enumerate() {
            // SAFETY: 16 of `acc`'s lanes, at `NR·r + 16h`.
            unsafe {
                _mm512_storeu_si512(acc.as_mut_ptr().add(NR * r + 16 * h) as *mut __m512i, v)
            };
        }
    }
}

/// [`super::store`] in 16 lanes (the same operations on each element, so the same bits):
/// `f32(S − comp) · inv_a · inv_b`, the destination added where `read_dst`, the bias, the
/// ReLU (kept where `x > 0` or NaN).
///
/// # Safety
/// The CPU must have AVX-512F; `d` must address the block's rows and columns (row
/// stride `ld`).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn store(acc: &[i32], b: &Block<'_>, d: *mut f32, ld: isize, read_dst: bool) {
    let w = b.inv_b.len();
    let zero = _mm512_setzero_ps();
    for h in 0..w.div_ceil(16) {
        let lanes = (w - 16 * h).min(16);
        let mask: u16 = if lanes == 16 { !0 } else { (1 << lanes) - 1 };
        // SAFETY (all loads of the columns' values): `lanes` values from `16h` (masked).
        let (inv_b, comp, bias) = unsafe {
            let at = |p: *const f32| _mm512_maskz_loadu_ps(mask, p.add(16 * h));
            (
                at(b.inv_b.as_ptr()),
                b.comp
                    .map(|c| _mm512_maskz_loadu_epi32(mask, c.as_ptr().add(16 * h))),
                b.bias.map(|v| at(v.as_ptr())),
            )
        };
        for (r, &ia) in b.inv_a.iter().enumerate() {
            assert!(acc.len() >= NR * r + 16 * h + 16);
            // SAFETY: 16 sums of row `r` at `NR·r + 16h`; the row's columns of the block
            // at `d` (masked past `w`).
            unsafe {
                let mut s = _mm512_loadu_si512(acc.as_ptr().add(NR * r + 16 * h) as *const __m512i);
                if let Some(c) = comp {
                    s = _mm512_sub_epi32(s, c);
                }
                let mut x = _mm512_mul_ps(
                    _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(ia)),
                    inv_b,
                );
                let p = d.offset(r as isize * ld).add(16 * h);
                if read_dst {
                    x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, p));
                }
                if let Some(v) = bias {
                    x = _mm512_add_ps(x, v);
                }
                if b.relu {
                    let keep = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(x, zero);
                    x = _mm512_maskz_mov_ps(keep, x);
                }
                _mm512_mask_storeu_ps(p, mask, x);
            }
        }
    }
}
