//! The column sums of a row-major right operand (a bias gradient's), in the order of
//! the `sum_rows` kernel.

use std::arch::x86_64::*;

use super::*;

/// Vectors of 16 columns [`column_sums`] sums at a time.
pub(super) const SUM_VECTORS: usize = 8;

/// [`ColumnSums`] of columns `cols` of `b` (`k × n` with `cs == 1`).
///
/// # Safety
/// The CPU must have AVX-512F; `b` must address `k × n` valid elements, `k` the product
/// of `sums.lead`; `sums.dst` must hold `cols.end` values, written by nothing else
/// meanwhile.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn column_sums(b: Mat, cols: std::ops::Range<usize>, sums: ColumnSums) {
    debug_assert_eq!(b.cs, 1);
    let lead = &sums.lead[..sums.axes];
    // Rows between consecutive indices of each axis.
    let mut stride = [1usize; SUM_AXES];
    for a in (0..lead.len().saturating_sub(1)).rev() {
        stride[a] = stride[a + 1] * lead[a + 1];
    }
    // The sums over axes `0..level` of the rows from `row` on, for the vectors of
    // columns `j..` (`masks` their lanes): axis `level − 1` is the outer loop.
    #[target_feature(enable = "avx512f")]
    unsafe fn nested(
        b: Mat,
        (lead, stride): (&[usize], &[usize; SUM_AXES]),
        level: usize,
        row: usize,
        j: usize,
        masks: &[u16; SUM_VECTORS],
    ) -> [__m512; SUM_VECTORS] {
        if level == 0 {
            // SAFETY: row `row` holds the masked lanes of columns `j..` (the caller's).
            return std::array::from_fn(|v| unsafe {
                let at = b.ptr.offset(row as isize * b.rs).add(j + v * T);
                _mm512_maskz_loadu_ps(masks[v], at)
            });
        }
        let axis = level - 1;
        let mut acc = [_mm512_setzero_ps(); SUM_VECTORS];
        for i in 0..lead[axis] {
            let row = row + i * stride[axis];
            // SAFETY: as the caller's.
            let t = unsafe { nested(b, (lead, stride), axis, row, j, masks) };
            for (acc, t) in acc.iter_mut().zip(t) {
                *acc = _mm512_add_ps(*acc, t);
            }
        }
        acc
    }
    for j in cols.clone().step_by(SUM_VECTORS * T) {
        let masks: [u16; SUM_VECTORS] = std::array::from_fn(|v| {
            let left = cols.end.saturating_sub(j + v * T).min(T);
            ((1u32 << left) - 1) as u16
        });
        // SAFETY: as the caller's; the masks keep to columns below `cols.end`.
        unsafe {
            let acc = nested(b, (lead, &stride), lead.len(), 0, j, &masks);
            for (v, acc) in acc.into_iter().enumerate() {
                _mm512_mask_storeu_ps(sums.dst.add(j + v * T), masks[v], acc);
            }
        }
    }
}
