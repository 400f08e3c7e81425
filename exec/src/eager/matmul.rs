//! Matrix products through the `gemm` crate.
//!
//! In: a left view `[..., m, k]` and a right view `[..., k, n]` (same batch dims) or a
//! plain `[k, n]` shared by every batch entry, in any strided layout — a transposed
//! operand is read through its strides, never copied. Out: the row-major `[..., m, n]`
//! product.
//!
//! - A shared `[k, n]` right operand and a left operand whose batch and row axes merge
//!   into one (any row-major left operand) make one GEMM of `[batch*m, k] x [k, n]`.
//! - Otherwise the batch is looped over; when each product is small and the batch is
//!   large, batch entries run in parallel (each GEMM single-threaded), else the GEMMs run
//!   one after the other, each parallel with `Parallelism::Rayon`.
//! - `k = 0` gives zeros; `m = 0` or `n = 0` an empty result.
//!
//! The products use FMA and `gemm`'s own blocking, so they differ from the reference's
//! sequential sums in the last bits (see the tolerances in the tests).

use gemm::Parallelism;
use rayon::prelude::*;

use super::pool::Pool;
use super::value::{Elem, View};
use crate::compiled::gemm::{entry_offsets, merged_stride};

/// Products with fewer multiply-adds than this run single-threaded.
const GEMM_PAR_MIN: usize = 1 << 16;

/// A matrix inside a strided buffer: element `(i, j)` at `offset + i*rs + j*cs`.
#[derive(Clone, Copy, Debug)]
struct Mat {
    offset: usize,
    rs: usize,
    cs: usize,
}

/// `dst[m, n] = lhs[m, k] * rhs[k, n]` (dst row-major). The caller guarantees the
/// matrices lie inside their slices (checked again here, cheaply).
fn gemm_into(
    dst: &mut [f32],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    a: Mat,
    rhs: &[f32],
    b: Mat,
    par: Parallelism,
) -> Result<(), String> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        dst.fill(0.0);
        return Ok(());
    }
    let inside = |s: &[f32], x: Mat, rows: usize, cols: usize| {
        x.offset + (rows - 1) * x.rs + (cols - 1) * x.cs < s.len()
    };
    if dst.len() != m * n || !inside(lhs, a, m, k) || !inside(rhs, b, k, n) {
        return Err("internal: matmul operands do not fit their buffers".into());
    }
    let as_isize = |v: usize| isize::try_from(v).map_err(|_| "internal: stride overflow");
    let (a_rs, a_cs, b_rs, b_cs, n_i) = (
        as_isize(a.rs)?,
        as_isize(a.cs)?,
        as_isize(b.rs)?,
        as_isize(b.cs)?,
        as_isize(n)?,
    );
    // SAFETY: every element gemm reads, `offset + i*rs + j*cs` for i < rows and j < cols,
    // is inside its slice (checked above; strides are non-negative), and it writes the
    // `m * n` elements of `dst` at `i*n + j`, which is exactly `dst`'s length. The slices
    // outlive the call, and `dst` does not alias the operands (it is a fresh buffer).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n_i,
            false,
            lhs.as_ptr().add(a.offset),
            a_cs,
            a_rs,
            rhs.as_ptr().add(b.offset),
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

fn parallelism(work: usize) -> Parallelism {
    if work >= GEMM_PAR_MIN {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    }
}

/// The product of `a` `[..., m, k]` and `b` (`[..., k, n]` or `[k, n]`), row-major.
pub(crate) fn matmul(
    pool: Option<&Pool>,
    a: View<'_, f32>,
    b: View<'_, f32>,
) -> Result<Vec<f32>, String> {
    let (sa, sb) = (a.shape(), b.shape());
    let (ra, rb) = (sa.len(), sb.len());
    let fits =
        ra >= 2 && rb >= 2 && sa[ra - 1] == sb[rb - 2] && (rb == 2 || sa[..ra - 2] == sb[..rb - 2]);
    if !fits {
        return Err(format!("internal: cannot multiply {sa:?} by {sb:?}"));
    }
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    let batch: usize = sa[..ra - 2].iter().product();
    // gemm writes every element (it does not read the destination).
    let mut out = f32::alloc(pool, batch * m * n);
    if out.is_empty() || k == 0 {
        out.fill(0.0);
        return Ok(out);
    }
    let (la, lb) = (a.layout, b.layout);
    let mat_a = |offset| Mat {
        offset,
        rs: la.strides[ra - 2],
        cs: la.strides[ra - 1],
    };
    let mat_b = |offset| Mat {
        offset,
        rs: lb.strides[rb - 2],
        cs: lb.strides[rb - 1],
    };

    if rb == 2 {
        // One GEMM when the batch and row axes of `a` merge into one row axis.
        if let Some(rs) = merged_stride(&sa[..ra - 1], &la.strides[..ra - 1]) {
            let lhs = Mat {
                offset: la.offset,
                rs,
                cs: la.strides[ra - 1],
            };
            let rows = batch * m;
            return gemm_into(
                &mut out,
                (rows, k, n),
                a.data,
                lhs,
                b.data,
                mat_b(lb.offset),
                parallelism(rows * k * n),
            )
            .map(|()| out);
        }
    }
    let (offs_a, offs_b) = entry_offsets(sa, la, sb, lb);
    let per = m * k * n;
    let one = |(i, dst): (usize, &mut [f32]), par: Parallelism| {
        gemm_into(
            dst,
            (m, k, n),
            a.data,
            mat_a(offs_a[i]),
            b.data,
            mat_b(offs_b[i]),
            par,
        )
    };
    if batch > 1 && per < GEMM_PAR_MIN * 4 {
        out.par_chunks_mut(m * n)
            .enumerate()
            .try_for_each(|c| one(c, Parallelism::None))?;
    } else {
        for c in out.chunks_mut(m * n).enumerate() {
            one(c, parallelism(per))?;
        }
    }
    Ok(out)
}
