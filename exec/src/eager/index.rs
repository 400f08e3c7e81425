//! Ops that move whole rows by index: `gather`, `scatter_add`, `one_hot`, `concat`.
//!
//! In: views (materialized row-major where a kernel needs it) and i32 ids. Out: row-major
//! results, or the reference executor's error for the first id (in flat order) that is
//! out of range — ids are all checked before anything is written.
//!
//! `scatter_add` adds the rows in id order, exactly like the reference: positions are
//! bucketed by target row (a stable counting sort), then each result row sums its
//! positions in increasing order. Threads split the result rows, which does not change
//! any element's order of additions, so the result is bit-identical to the reference.

use std::borrow::Cow;

use rayon::prelude::*;

use kiln_compiler::bind::check_id;

use super::pool::Pool;
use super::value::{Elem, View};
use super::walk::{chunked, to_vec, PAR_MIN};

/// The elements of `x` row-major, borrowed when they already are.
pub(crate) fn contiguous<'s, E: Elem>(x: View<'s, E>) -> Cow<'s, [E]> {
    match x.contiguous() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(to_vec(None, x)),
    }
}

/// Every id as an index into `0..len`, or the error for the first bad one.
fn check_ids(ids: &[i32], len: usize, what: &str) -> Result<Vec<usize>, String> {
    ids.iter()
        .enumerate()
        .map(|(p, &id)| check_id(id, len, p, what))
        .collect()
}

/// `gather(table[V, D...], ids[I...]) -> [I..., D...]`.
pub(crate) fn gather<E: Elem>(
    pool: Option<&Pool>,
    table: View<'_, E>,
    ids: View<'_, i32>,
) -> Result<Vec<E>, String> {
    let Some((&v, rest)) = table.shape().split_first() else {
        return Err("the table is a scalar".into());
    };
    let row: usize = rest.iter().product();
    let ids = contiguous(ids);
    let rows = check_ids(&ids, v, &format!("the table has {v} rows"))?;
    let table = contiguous(table);
    let mut out = E::alloc(pool, rows.len() * row);
    if row == 0 {
        return Ok(out);
    }
    let copy = |(p, dst): (usize, &mut [E])| {
        dst.copy_from_slice(&table[rows[p] * row..(rows[p] + 1) * row]);
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(row).enumerate().for_each(copy);
    } else {
        out.chunks_mut(row).enumerate().for_each(copy);
    }
    Ok(out)
}

/// `scatter_add(ids[I...], src[I..., D...]) -> [rows, D...]` (`shape` is the result's).
pub(crate) fn scatter_add(
    pool: Option<&Pool>,
    ids: View<'_, i32>,
    src: View<'_, f32>,
    shape: &[usize],
) -> Result<Vec<f32>, String> {
    let Some((&rows, rest)) = shape.split_first() else {
        return Err("the result is a scalar".into());
    };
    let row: usize = rest.iter().product();
    let k = ids.shape().len();
    if !src.shape().starts_with(ids.shape()) || src.shape()[k..].iter().product::<usize>() != row {
        return Err(format!(
            "internal: values {:?} do not fit ids {:?} and result {:?}",
            src.shape(),
            ids.shape(),
            shape
        ));
    }
    let mut out = f32::alloc(pool, rows * row);
    scatter_add_into(ids, src, row, &mut out)?;
    Ok(out)
}

/// [`scatter_add`] into `out` (`rows · row` elements, overwritten): the same sums in the
/// same order, so the compiled executor can write straight into its arena.
/// That `src` holds one row of `row` values per id (`n` ids): the scatters index it so.
fn check_src(src: &View<'_, f32>, n: usize, row: usize) -> Result<(), String> {
    let have = src.shape().iter().product::<usize>();
    if have != n * row {
        return Err(format!(
            "internal: {have} values do not fit {n} ids of rows of {row}"
        ));
    }
    Ok(())
}

/// A checked scatter of `src`'s rows of `row` elements to the rows `ids` name: the
/// contiguous sources, each id's target row, and by target row `r` the positions that
/// name it (`order[start[r]..start[r + 1]]`, in position order).
struct ScatterPlan<'s> {
    src: Cow<'s, [f32]>,
    targets: Vec<usize>,
    start: Vec<usize>,
    order: Vec<usize>,
}

/// The [`ScatterPlan`] into `len` elements, or `None` when nothing is added.
fn scatter_plan<'s>(
    ids: View<'_, i32>,
    src: View<'s, f32>,
    row: usize,
    len: usize,
) -> Result<Option<ScatterPlan<'s>>, String> {
    let (rows, targets) = scatter_targets(ids, row, len)?;
    check_src(&src, targets.len(), row)?;
    if row == 0 || targets.is_empty() {
        return Ok(None);
    }
    let src = contiguous(src);
    let (start, order) = by_row(&targets, rows);
    Ok(Some(ScatterPlan {
        src,
        targets,
        start,
        order,
    }))
}

pub(crate) fn scatter_add_into(
    ids: View<'_, i32>,
    src: View<'_, f32>,
    row: usize,
    out: &mut [f32],
) -> Result<(), String> {
    let plan = scatter_plan(ids, src, row, out.len())?;
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(PAR_MIN).for_each(|c| c.fill(0.0));
    } else {
        out.fill(0.0);
    }
    let Some(ScatterPlan {
        src,
        start,
        order,
        targets,
    }) = plan
    else {
        return Ok(());
    };
    let body = |(r, dst): (usize, &mut [f32])| {
        for &p in &order[start[r]..start[r + 1]] {
            for (d, &s) in dst.iter_mut().zip(&src[p * row..(p + 1) * row]) {
                *d += s;
            }
        }
    };
    if targets.len() * row >= PAR_MIN {
        out.par_chunks_mut(row).enumerate().for_each(body);
    } else {
        out.chunks_mut(row).enumerate().for_each(body);
    }
    Ok(())
}

/// `ids[I...] -> f32[I..., depth]`, 1.0 at the id.
pub(crate) fn one_hot(
    pool: Option<&Pool>,
    ids: View<'_, i32>,
    depth: usize,
) -> Result<Vec<f32>, String> {
    let ids = contiguous(ids);
    let cols = check_ids(&ids, depth, &format!("the depth is {depth}"))?;
    let mut out = f32::alloc(pool, cols.len() * depth);
    if depth == 0 {
        return Ok(out);
    }
    let set = |(p, row): (usize, &mut [f32])| {
        row.fill(0.0);
        row[cols[p]] = 1.0;
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(depth).enumerate().for_each(set);
    } else {
        out.chunks_mut(depth).enumerate().for_each(set);
    }
    Ok(out)
}

/// Concatenation of `parts` along `axis` into the row-major `shape`.
pub(crate) fn concat<E: Elem>(
    pool: Option<&Pool>,
    parts: &[View<'_, E>],
    axis: usize,
    shape: &[usize],
) -> Vec<E> {
    let mut out = E::alloc(pool, shape.iter().product());
    concat_into(parts, axis, shape, &mut out);
    out
}

/// [`concat()`] into `out`, a row-major buffer of `shape` (the compiled executor's arena or
/// output): each part's block of every index of the axes before `axis`, those indices in
/// parallel when large. The caller checks that the parts fit `shape`.
pub(crate) fn concat_into<E: Elem>(
    parts: &[View<'_, E>],
    axis: usize,
    shape: &[usize],
    out: &mut [E],
) {
    let inner: usize = shape[axis + 1..].iter().product();
    let total = shape[axis] * inner;
    if total == 0 || out.is_empty() {
        return;
    }
    let parts: Vec<(Cow<'_, [E]>, usize)> = parts
        .iter()
        .map(|p| (contiguous(*p), p.shape()[axis] * inner))
        .collect();
    let body = |(o, dst): (usize, &mut [E])| {
        let mut at = 0;
        for (v, chunk) in &parts {
            dst[at..at + chunk].copy_from_slice(&v[o * chunk..(o + 1) * chunk]);
            at += chunk;
        }
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(total).enumerate().for_each(body);
    } else {
        out.chunks_mut(total).enumerate().for_each(body);
    }
}

/// `out[i] = f(i)` for every flat index, in parallel when large.
pub(crate) fn generate<E: Elem>(
    pool: Option<&Pool>,
    n: usize,
    f: impl Fn(usize) -> E + Sync,
) -> Vec<E> {
    let mut out = E::alloc(pool, n);
    chunked(&mut out, |o, lo| {
        for (i, o) in o.iter_mut().enumerate() {
            *o = f(lo + i);
        }
    });
    out
}

/// The result rows of a scatter into `len` elements in rows of `row`, and each id as a
/// row index (or the error for the first id outside them).
fn scatter_targets(
    ids: View<'_, i32>,
    row: usize,
    len: usize,
) -> Result<(usize, Vec<usize>), String> {
    let rows = len.checked_div(row).unwrap_or(0);
    let ids = contiguous(ids);
    let targets = check_ids(&ids, rows, &format!("the result has {rows} rows"))?;
    Ok((rows, targets))
}

/// The positions that land on each result row, in increasing order (a counting sort), so
/// every row can be summed independently in the reference's order: row `r`'s positions
/// are `order[start[r]..start[r + 1]]`.
fn by_row(targets: &[usize], rows: usize) -> (Vec<usize>, Vec<usize>) {
    let mut start = vec![0usize; rows + 1];
    for &r in targets {
        start[r + 1] += 1;
    }
    for r in 0..rows {
        start[r + 1] += start[r];
    }
    let mut fill = start.clone();
    let mut order = vec![0usize; targets.len()];
    for (p, &r) in targets.iter().enumerate() {
        order[fill[r]] = p;
        fill[r] += 1;
    }
    (start, order)
}

/// `out += scatter_add(ids, src)` (`out`: `rows · row` elements, holding the base): each
/// row an id names gets the sum of its positions' rows, summed from `0.0` in increasing
/// position order as [`scatter_add`] sums them, added once — the reference's
/// `base + scatter_add(ids, src)` element for element. Rows no id names are left as they
/// are (the reference adds `0.0` to them: the same value, though a `-0.0` stays `-0.0`).
/// Only the named rows are touched, so a vocabulary-sized gradient costs a few hundred
/// rows, not a pass over the table.
pub(crate) fn scatter_add_onto(
    ids: View<'_, i32>,
    src: View<'_, f32>,
    row: usize,
    out: &mut [f32],
) -> Result<(), String> {
    let Some(ScatterPlan {
        src,
        start,
        order,
        targets,
    }) = scatter_plan(ids, src, row, out.len())?
    else {
        return Ok(());
    };
    let body = |acc: &mut Vec<f32>, (r, dst): (usize, &mut [f32])| {
        let at = &order[start[r]..start[r + 1]];
        if at.is_empty() {
            return;
        }
        acc.clear();
        acc.resize(row, 0.0);
        for &p in at {
            for (a, &s) in acc.iter_mut().zip(&src[p * row..(p + 1) * row]) {
                *a += s;
            }
        }
        for (d, &a) in dst.iter_mut().zip(acc.iter()) {
            *d += a;
        }
    };
    if targets.len() * row >= PAR_MIN {
        out.par_chunks_mut(row)
            .enumerate()
            .for_each_init(Vec::new, body);
    } else {
        let mut acc = Vec::new();
        out.chunks_mut(row)
            .enumerate()
            .for_each(|x| body(&mut acc, x));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eager::value::Layout;

    /// Both scatters sum each id's row of `src` into its row of `out`, and refuse a
    /// `src` that does not hold one row per id (an internal error, not a panic or a read
    /// past the rows).
    #[test]
    fn scatters_sum_rows_and_check_the_source_size() {
        let ids = [2i32, 0, 2];
        let il = Layout::contiguous(&[3]);
        let src: Vec<f32> = (1..=6).map(|x| x as f32).collect();
        let sl = Layout::contiguous(&[3, 2]);
        let iv = View {
            data: &ids[..],
            layout: &il,
        };
        fn view<'a>(data: &'a [f32], layout: &'a Layout) -> View<'a, f32> {
            View { data, layout }
        }
        let mut out = vec![9.0f32; 6];
        scatter_add_into(iv, view(&src[..], &sl), 2, &mut out).unwrap();
        assert_eq!(out, [3.0, 4.0, 0.0, 0.0, 6.0, 8.0]);
        let mut onto = vec![1.0f32; 6];
        scatter_add_onto(iv, view(&src[..], &sl), 2, &mut onto).unwrap();
        assert_eq!(onto, [4.0, 5.0, 1.0, 1.0, 7.0, 9.0]);
        let short = Layout::contiguous(&[2, 2]);
        for into in [true, false] {
            let mut out = vec![0.0f32; 6];
            let e = if into {
                scatter_add_into(iv, view(&src[..4], &short), 2, &mut out)
            } else {
                scatter_add_onto(iv, view(&src[..4], &short), 2, &mut out)
            }
            .unwrap_err();
            assert!(e.contains("4 values do not fit 3 ids of rows of 2"), "{e}");
        }
    }
}
