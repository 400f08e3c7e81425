//! Reductions over one axis (`sum`, `reduce_max`), keeping the axis with size 1.
//!
//! In: a view of any layout (materialized row-major first when it is not), the axis, and
//! the fold (`+`, NaN-propagating max, wrapping i32 `+`, i32 max). Out: the row-major
//! result with the axis reduced to size 1.
//!
//! Two loop shapes, both deterministic whatever the number of threads (every output
//! element is folded by one task in a fixed order; tasks only split *which* elements):
//!
//! - **Last axis** (`inner == 1`): each row is folded with [`LANES`] interleaved
//!   accumulators (element `i` goes to lane `i % LANES`), combined pairwise, then the
//!   tail in order; this vectorizes. Rows shorter than [`LANES`] are folded in order.
//!   For floats the result can differ from a strictly sequential sum in the last bits.
//! - **Other axes**: the output row is initialized and each slice along the axis is
//!   folded into it in index order, vectorized across the inner elements; this is
//!   exactly the reference's order.

use std::borrow::Cow;

use rayon::prelude::*;

use super::pool::Pool;
use super::value::{Elem, View};
use super::walk::{to_vec, PAR_MIN};

/// Accumulators per row in last-axis reductions.
pub(crate) const LANES: usize = 16;

/// Folds `x` along `axis` with `f`, starting every output element from `init`; a whole
/// contiguous row (last-axis reductions) is folded by `row`.
pub(crate) fn reduce<E: Elem>(
    pool: Option<&Pool>,
    x: View<'_, E>,
    axis: usize,
    init: E,
    f: impl Fn(E, E) -> E + Sync + Copy,
    row: impl Fn(&[E]) -> E + Sync,
) -> Vec<E> {
    let shape = x.shape();
    let outer: usize = shape[..axis].iter().product();
    let len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let v: Cow<'_, [E]> = match x.contiguous() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(to_vec(pool, x)),
    };
    let mut out = E::alloc(pool, outer * inner);
    out.fill(init);
    if out.is_empty() {
        return out;
    }
    if len == 0 {
        return out;
    }
    let work = outer * len * inner;
    if inner == 1 {
        let rows_per_task = (PAR_MIN / len.max(1)).max(1);
        let body = |(t, o): (usize, &mut [E])| {
            for (j, o) in o.iter_mut().enumerate() {
                let r = t * rows_per_task + j;
                *o = row(&v[r * len..(r + 1) * len]);
            }
        };
        if work >= PAR_MIN && outer > 1 {
            out.par_chunks_mut(rows_per_task).enumerate().for_each(body);
        } else {
            out.chunks_mut(rows_per_task).enumerate().for_each(body);
        }
        return out;
    }
    // out[o, r] = fold over a of x[o, a, r], a in order.
    let fold_block = |o: usize, cols: std::ops::Range<usize>, acc: &mut [E]| {
        for a in 0..len {
            let row = &v[(o * len + a) * inner..(o * len + a + 1) * inner][cols.clone()];
            for (acc, &x) in acc.iter_mut().zip(row) {
                *acc = f(*acc, x);
            }
        }
    };
    if work < PAR_MIN {
        for (o, acc) in out.chunks_mut(inner).enumerate() {
            fold_block(o, 0..inner, acc);
        }
    } else if outer >= 2 * rayon::current_num_threads() {
        out.par_chunks_mut(inner)
            .enumerate()
            .for_each(|(o, acc)| fold_block(o, 0..inner, acc));
    } else {
        // Few outer rows: split the columns instead.
        let cols = (PAR_MIN / len.max(1)).clamp(64, inner.max(64));
        for (o, acc) in out.chunks_mut(inner).enumerate() {
            acc.par_chunks_mut(cols)
                .enumerate()
                .for_each(|(c, acc)| fold_block(o, c * cols..c * cols + acc.len(), acc));
        }
    }
    out
}

/// One row folded with [`LANES`] interleaved accumulators (in order when short).
#[inline]
pub(crate) fn fold_row<E: Copy>(row: &[E], init: E, f: impl Fn(E, E) -> E) -> E {
    if row.len() < LANES {
        return row.iter().fold(init, |a, &b| f(a, b));
    }
    let mut acc = [init; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = f(acc[j], c[j]);
        }
    }
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for j in 0..w {
            acc[j] = f(acc[j], acc[j + w]);
        }
    }
    tail.iter().fold(acc[0], |a, &b| f(a, b))
}

/// The NaN-propagating maximum of a row, exactly as the reference's in-order fold gives
/// it for rows with a NaN (the first NaN), and the same value for other rows (up to the
/// sign of a zero maximum). The lanes take a plain maximum, which vectorizes, and note
/// whether they saw a NaN; a row with one is folded again in order.
#[inline]
pub(crate) fn max_row(row: &[f32]) -> f32 {
    let ordered = |row: &[f32]| row.iter().fold(f32::NEG_INFINITY, |a, &b| fmax(a, b));
    if row.len() < LANES {
        return ordered(row);
    }
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut nan = [false; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            let b = c[j];
            acc[j] = if b > acc[j] { b } else { acc[j] };
            nan[j] |= b.is_nan();
        }
    }
    if nan.iter().any(|&n| n) || tail.iter().any(|b| b.is_nan()) {
        return ordered(row);
    }
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for j in 0..w {
            acc[j] = if acc[j + w] > acc[j] {
                acc[j + w]
            } else {
                acc[j]
            };
        }
    }
    tail.iter().fold(acc[0], |a, &b| if b > a { b } else { a })
}

/// NaN-propagating maximum (the reference's `max`).
#[inline(always)]
pub(crate) fn fmax(a: f32, b: f32) -> f32 {
    if a.is_nan() {
        a
    } else if b.is_nan() || b > a {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eager::value::Layout;

    #[test]
    fn rows_fold_in_lanes_and_columns_in_order() {
        let data: Vec<f32> = (0..40).map(|v| v as f32).collect();
        let l = Layout::contiguous(&[2, 20]);
        let v = View {
            data: &data,
            layout: &l,
        };
        let add = |a: f32, b: f32| a + b;
        let rows = reduce(None, v, 1, 0.0, add, |r| fold_row(r, 0.0, add));
        assert_eq!(rows, vec![190.0, 590.0]);
        let cols = reduce(None, v, 0, 0.0, add, |r| fold_row(r, 0.0, add));
        assert_eq!(cols.len(), 20);
        assert_eq!(cols[3], 3.0 + 23.0);
        let m = reduce(None, v, 1, f32::NEG_INFINITY, fmax, max_row);
        assert_eq!(m, vec![19.0, 39.0]);
        // A NaN anywhere in a row wins, whichever lane holds it.
        for at in [0, 5, 17, 33, 39] {
            let mut row: Vec<f32> = (0..40).map(|v| v as f32).collect();
            row[at] = f32::NAN;
            assert!(max_row(&row).is_nan(), "NaN at {at}");
        }
    }
}
