//! Products of one row, many at once: decoding's attention, one query a head (`q·kᵀ`
//! over the cached keys, then `p·v`). Alone, such a product keeps one chain of sums a
//! vector of columns, and each fused multiply-add waits on the one before it (`q·kᵀ` over
//! 16 keys: 64 dependent steps); here up to eight products share the loop over `k`, so
//! their chains overlap. Each element is still the f32 sum of its `k` products in order
//! with one fused multiply-add each, from 0: the same bits as [`super::gemm`].

use std::arch::x86_64::*;

use super::{Isa, MAX_K, MAX_N};
use crate::{Dst, RowProduct};

/// Whether [`row_products`] runs `k × n` right operands in groups here: AVX-512F, and
/// sizes [`super::gemm`] takes.
pub(crate) fn takes_rows(k: usize, n: usize) -> bool {
    k > 0 && n > 0 && n <= MAX_N && k <= MAX_K && super::isa() == Some(Isa::Avx512)
}

/// Every product of `items` (`1 × k · k × n` each), as [`super::gemm`] computes it.
///
/// # Safety
/// [`takes_rows`] must have returned `true`; each item's operands address their elements
/// and its `dst` `n` of its own.
pub(crate) unsafe fn row_products((k, n): (usize, usize), items: &[RowProduct]) {
    // Rows of `b` read in place need contiguous columns; else one at a time.
    if items.iter().any(|it| it.b.cs != 1) {
        for it in items {
            let dst = Dst::new(it.dst, 0, false);
            // SAFETY: as the caller's; `takes_rows` checked the CPU and the sizes.
            unsafe { super::gemm_with(Isa::Avx512, (1, k, n), it.a, it.b, dst) };
        }
        return;
    }
    // As many products as keep their sums, a row of `b` each and a broadcast in
    // registers, with at least eight chains where `n` allows.
    // SAFETY: as the caller's; every `b` has contiguous rows.
    unsafe {
        match n.div_ceil(16) {
            1 => groups::<1, 8>((k, n), items),
            2 => groups::<2, 4>((k, n), items),
            3 => groups::<3, 3>((k, n), items),
            4 => groups::<4, 2>((k, n), items),
            5 => groups::<5, 2>((k, n), items),
            6 => groups::<6, 1>((k, n), items),
            7 => groups::<7, 1>((k, n), items),
            _ => groups::<8, 1>((k, n), items),
        }
    }
}

/// `items` by `G`, the rest one at a time.
///
/// # Safety
/// As [`row_products`]; every `b` has contiguous rows; `n ≤ 16·NV`.
#[target_feature(enable = "avx512f")]
unsafe fn groups<const NV: usize, const G: usize>((k, n): (usize, usize), items: &[RowProduct]) {
    let mut chunks = items.chunks_exact(G);
    for c in &mut chunks {
        // SAFETY: as the caller's.
        unsafe { group::<NV, G>((k, n), c) };
    }
    for it in chunks.remainder() {
        // SAFETY: as the caller's.
        unsafe { group::<NV, 1>((k, n), std::slice::from_ref(it)) };
    }
}

/// The `G` products of `items`, their `NV` vectors of sums each in registers over the
/// whole `k`.
///
/// # Safety
/// As [`groups`]; `items` holds `G`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn group<const NV: usize, const G: usize>((k, n): (usize, usize), items: &[RowProduct]) {
    let masks: [u16; NV] = std::array::from_fn(|v| {
        let left = n.saturating_sub(16 * v);
        if left >= 16 {
            !0
        } else {
            (1u16 << left) - 1
        }
    });
    let mut a: [*const f32; G] = std::array::from_fn(|g| items[g].a.ptr);
    let mut b: [*const f32; G] = std::array::from_fn(|g| items[g].b.ptr);
    let a_step: [isize; G] = std::array::from_fn(|g| items[g].a.cs);
    let b_step: [isize; G] = std::array::from_fn(|g| items[g].b.rs);
    let mut acc = [[_mm512_setzero_ps(); NV]; G];
    for _ in 0..k {
        for g in 0..G {
            // SAFETY: `a[g]` is element `p` of the row and `b[g]` row `p` of `b`, whose
            // `n` values are read (masked past them).
            unsafe {
                let x = _mm512_set1_ps(*a[g]);
                for (v, acc) in acc[g].iter_mut().enumerate() {
                    let y = _mm512_maskz_loadu_ps(masks[v], b[g].wrapping_add(16 * v));
                    *acc = _mm512_fmadd_ps(x, y, *acc);
                }
            }
            a[g] = a[g].wrapping_offset(a_step[g]);
            b[g] = b[g].wrapping_offset(b_step[g]);
        }
    }
    for (it, acc) in items.iter().zip(&acc) {
        for (v, &sum) in acc.iter().enumerate() {
            // SAFETY: `dst` holds `n` values (masked past them).
            unsafe { _mm512_mask_storeu_ps(it.dst.wrapping_add(16 * v), masks[v], sum) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Mat;

    fn values(len: usize, seed: &mut u64) -> Vec<f32> {
        (0..len)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Grouped, each product equals [`super::super::gemm`]'s of it alone, bit for bit:
    /// one to eleven products (whole groups and remainders) at every width of vectors,
    /// `a` contiguous or strided, `b` row-major with a gap between rows (a cache with
    /// room), and a set with one transposed `b` (all then one at a time).
    #[test]
    fn grouped_row_products_equal_the_products_alone() {
        if !takes_rows(1, 1) {
            println!("skipped: no AVX-512F");
            return;
        }
        let mut seed = 5u64;
        for (k, n) in [
            (64, 1),
            (64, 14),
            (64, 16),
            (64, 17),
            (14, 64),
            (3, 40),
            (25, 80),
            (100, 100),
            (512, 128),
            (1, 113),
        ] {
            for count in [1, 2, 3, 7, 8, 11] {
                for transposed_one in [false, true] {
                    let (a_cs, b_rs) = (2isize, n as isize + 5);
                    let a = values(count * k * 2, &mut seed);
                    let b = values(count * k * b_rs as usize, &mut seed);
                    let mut items = Vec::new();
                    let mut got = vec![f32::NAN; count * n];
                    for c in 0..count {
                        let b = if transposed_one && c == count / 2 {
                            // Column `j` of this one's `b` at `j·k`: stored transposed.
                            Mat {
                                ptr: b[c * k * b_rs as usize..].as_ptr(),
                                rs: 1,
                                cs: k as isize,
                            }
                        } else {
                            Mat {
                                ptr: b[c * k * b_rs as usize..].as_ptr(),
                                rs: b_rs,
                                cs: 1,
                            }
                        };
                        let a = Mat {
                            ptr: a[c * k * 2..].as_ptr(),
                            rs: 0,
                            cs: a_cs,
                        };
                        items.push(RowProduct {
                            a,
                            b,
                            dst: got[c * n..].as_mut_ptr(),
                        });
                    }
                    // SAFETY: the CPU has AVX-512F; each operand addresses its elements
                    // and each `dst` its `n`.
                    unsafe { row_products((k, n), &items) };
                    for (c, it) in items.iter().enumerate() {
                        let mut want = vec![0f32; n];
                        // SAFETY: as above.
                        unsafe {
                            super::super::gemm(
                                (1, k, n),
                                it.a,
                                it.b,
                                Dst::new(want.as_mut_ptr(), n as isize, false),
                            )
                        };
                        let got = &got[c * n..(c + 1) * n];
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(same, "{count} products of 1×{k}·{k}×{n} (one transposed: {transposed_one}): product {c}");
                    }
                }
            }
        }
    }
}
