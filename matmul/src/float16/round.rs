//! Rounding f32 to bf16 (AVX512-BF16's `VCVTNE2PS2BF16`) and to fp16 (`VCVTPS2PH`), and
//! the 16 × 16 transpose of 32-bit lanes (AVX-512F).

use std::arch::x86_64::*;

/// `x` rounded to bf16 as AVX512-BF16's `VCVTNEPS2BF16` rounds it (the packing loops'
/// vectors use that instruction; this is their scalar edge): to nearest, ties to even; a
/// NaN stays a NaN (made quiet); a subnormal `x` becomes a zero of its sign. As its bits.
#[inline(always)]
pub(super) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    (if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else if b & 0x7f80_0000 == 0 {
        (b >> 16) & 0x8000
    } else {
        rounded
    }) as u16
}

/// `x` rounded to bf16 and back: what a product on the tiles reads of an operand.
#[cfg(test)]
pub(super) fn round_bf16(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// `x` rounded to fp16 (to nearest, ties to even; subnormals kept, past 65504 infinite),
/// as its bits.
#[inline(always)]
pub(super) fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// The 16-bit value a kernel multiplies for the operand element `x`: `x` rounded to bf16,
/// or (`HALF`) `x · s` rounded to fp16, `s` its row's or column's power-of-two scale.
#[inline(always)]
pub(super) fn to16<const HALF: bool>(x: f32, s: f32) -> u16 {
    if HALF {
        f16_bits(x * s)
    } else {
        bf16_bits(x)
    }
}

/// The 16-bit values ([`to16`]) of 16 elements `x` with their scales `s` (read only
/// where `HALF`), in order: one instruction each, `VCVTNEPS2BF16` (bf16) or
/// `VCVTPS2PH` (fp16, after the scaling).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) fn to16x16<const HALF: bool>(x: __m512, s: __m512) -> __m256i {
    if HALF {
        _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, s))
    } else {
        // SAFETY: 16 bf16 values are 256 bits, as `__m256i`.
        unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x)) }
    }
}

/// Lane `i` of the 16-bit pairs a packed tile row holds: [`to16x16`] of `lo`'s element
/// `i` in the low half, of `hi`'s in the high half (`s` as there).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) fn pairs16x16<const HALF: bool>(lo: __m512, hi: __m512, s: __m512) -> __m512i {
    // `lo`'s 16 values, then `hi`'s.
    let both = if HALF {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(to16x16::<HALF>(lo, s)),
            to16x16::<HALF>(hi, s),
        )
    } else {
        // SAFETY: 32 bf16 values are 512 bits, as `__m512i`.
        unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
    };
    // Element `2i` from `i`, `2i + 1` from `16 + i`.
    let order = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    _mm512_permutexvar_epi16(order, both)
}

/// The 16 × 16 32-bit elements of `z` transposed: lane `j` of row `r` of the result is
/// lane `r` of `z[j]`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn transpose16(z: &[__m512i; 16]) -> [__m512i; 16] {
    // Pairs of rows interleaved by 32 bits, then by 64: `u[4i + c]`, in its 128-bit lane
    // `l`, holds lane `4l + c` of `z[4i..4i + 4]`.
    let t: [__m512i; 16] = std::array::from_fn(|q| {
        let (a, b) = (z[q & !1], z[q | 1]);
        if q % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    let u: [__m512i; 16] = std::array::from_fn(|q| {
        let (i, c) = (q / 4, q % 4);
        let (a, b) = (t[4 * i + c / 2], t[4 * i + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // Then 128-bit lanes: row `4l + c` gathers lane `l` of `u[c]`, `u[4 + c]`, `u[8 + c]`,
    // `u[12 + c]`.
    let mut out = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let (a, b, cc, d) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
        let (p0, p1) = (
            _mm512_shuffle_i32x4::<0x44>(a, b),
            _mm512_shuffle_i32x4::<0xee>(a, b),
        );
        let (q0, q1) = (
            _mm512_shuffle_i32x4::<0x44>(cc, d),
            _mm512_shuffle_i32x4::<0xee>(cc, d),
        );
        out[c] = _mm512_shuffle_i32x4::<0x88>(p0, q0);
        out[4 + c] = _mm512_shuffle_i32x4::<0xdd>(p0, q0);
        out[8 + c] = _mm512_shuffle_i32x4::<0x88>(p1, q1);
        out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(p1, q1);
    }
    out
}

/// `dst[i] = to16::<HALF>(src[i], s)` for the `src.len()` elements of a run.
///
/// # Safety
/// The CPU must have AVX-512F, BW and BF16; `dst` holds `src.len()` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn convert<const HALF: bool>(src: &[f32], s: f32, dst: &mut [u16]) {
    let n = src.len();
    assert!(dst.len() >= n);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: elements `i..i + 16` of `src` and `dst` exist (checked).
        unsafe {
            let h = to16x16::<HALF>(_mm512_loadu_ps(src.as_ptr().add(i)), _mm512_set1_ps(s));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, h);
        }
        i += 16;
    }
    for i in i..n {
        dst[i] = to16::<HALF>(src[i], s);
    }
}
