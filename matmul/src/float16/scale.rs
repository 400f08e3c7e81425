//! The powers of two that scale rows and columns into fp16 so that no fp16 sum overflows.

use super::*;

/// Terms each fp16 sum of [`half_block`] takes before it is added to its f32 sum: four
/// packed tiles' 16 pair rows (each lane sums the even or the odd `k` of its column).
pub(super) const FLUSH_TILES: usize = 4;
/// The operands' fp16 scales bring each row of `a`'s largest magnitude into
/// `[2^(TOP_A - 1), 2^TOP_A)` and each column of `b`'s into `[2^(TOP_B - 1), 2^TOP_B)`,
/// so that no term reaches `2^(TOP_A + TOP_B)` and no fp16 sum of `FLUSH_TILES · 16`
/// terms reaches 2^15 (fp16 overflows past 65504).
pub(super) const TOP_A: i32 = 5;
pub(super) const TOP_B: i32 = 4;
const _: () = assert!((FLUSH_TILES * T) << (TOP_A + TOP_B) <= 1 << 15);

/// The bits of the largest magnitude in `x`: the order of non-negative floats is their
/// bits' order (a NaN is above infinity).
#[target_feature(enable = "avx512f")]
pub(super) fn max_bits(x: &[f32]) -> u32 {
    x.iter().fold(0, |m, &v| m.max(v.to_bits() & 0x7fff_ffff))
}

/// `max[i]` raised to the bits of `|x[i]|` where those are larger.
#[target_feature(enable = "avx512f")]
pub(super) fn max_bits_into(max: &mut [u32], x: &[f32]) {
    for (m, &v) in max.iter_mut().zip(x) {
        *m = (*m).max(v.to_bits() & 0x7fff_ffff);
    }
}

/// The fp16 scale (a power of two: `s` and `1 / s`, both exact) of a row or column
/// whose largest magnitude has the bits `max` ([`max_bits`]): `s` brings the largest
/// into `[2^(top - 1), 2^top)`. A row of zeros, or with an infinity or a NaN, keeps 1
/// (the infinity or NaN then reaches its results, as in f32).
pub(super) fn fp16_scale(max: u32, top: i32) -> (f32, f32) {
    if max == 0 || max >= 0x7f80_0000 {
        return (1.0, 1.0);
    }
    // `max` is in [2^e, 2^(e + 1)) (below for a subnormal, which is then brought into
    // range from below); both scales stay normal floats.
    let e = (max >> 23) as i32 - 127;
    let shift = (top - 1 - e).clamp(-126, 126);
    (
        f32::from_bits(((127 + shift) as u32) << 23),
        f32::from_bits(((127 - shift) as u32) << 23),
    )
}

/// The [`fp16_scale`]s (`top`) of rows `rows` of `a` (at most 256) over its `k`
/// indices: row `rows.start + r`'s `s` into `scale[r]`, its `1 / s` into `unscale[r]`.
///
/// # Safety
/// As [`max_rows`]'; `scale` and `unscale` hold a value for each row.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn line_scales(
    a: Mat,
    rows: std::ops::Range<usize>,
    k: usize,
    top: i32,
    (scale, unscale): (&mut [f32], &mut [f32]),
) {
    let mut max = [0u32; GROUP * T];
    let max = &mut max[..rows.len()];
    // SAFETY: the caller's.
    unsafe { max_rows(a, rows, 0..k, max) };
    for ((s, u), &max) in scale.iter_mut().zip(unscale.iter_mut()).zip(&*max) {
        (*s, *u) = fp16_scale(max, top);
    }
}

/// Raises `max[r]` to the bits of the largest magnitude ([`max_bits`]) of row
/// `rows.start + r` of `a` over the indices `ks` of `k`.
///
/// # Safety
/// The CPU must have AVX-512F; `a` must address those rows at those indices; `max` holds
/// a value for each row.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn max_rows(
    a: Mat,
    rows: std::ops::Range<usize>,
    ks: std::ops::Range<usize>,
    max: &mut [u32],
) {
    let max = &mut max[..rows.len()];
    if a.cs == 1 {
        for (r, max) in rows.zip(max.iter_mut()) {
            // SAFETY: row `r` holds the indices `ks`, contiguous.
            let row = unsafe {
                std::slice::from_raw_parts(a.ptr.offset(r as isize * a.rs).add(ks.start), ks.len())
            };
            *max = (*max).max(max_bits(row));
        }
    } else if a.rs == 1 {
        for p in ks {
            // SAFETY: index `p` holds the rows, contiguous.
            let col = unsafe {
                std::slice::from_raw_parts(
                    a.ptr.offset(p as isize * a.cs).add(rows.start),
                    rows.len(),
                )
            };
            max_bits_into(max, col);
        }
    } else {
        for (r, max) in rows.zip(max.iter_mut()) {
            for p in ks.clone() {
                // SAFETY: the caller's.
                let x = unsafe { *a.ptr.offset(r as isize * a.rs + p as isize * a.cs) };
                *max = (*max).max(x.to_bits() & 0x7fff_ffff);
            }
        }
    }
}
