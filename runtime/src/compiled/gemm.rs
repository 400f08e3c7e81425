//! Matrix products of the compiled executor, through the `gemm` crate.
//!
//! In: strided operand locations `a [..., m, k]` and `b [..., k, n]` (or a shared
//! `[k, n]`), a contiguous destination `[..., m, n]`. Out: `dst = alpha·dst + beta·a·b`
//! with `alpha = 1` when `read_dst` (a bias already in `dst` is folded in this way, as
//! DESIGN §5 asks), else `dst = a·b`.
//!
//! Transposed operands are read through their strides (no copies). A shared right
//! operand with a left operand whose batch and row axes merge makes one large GEMM
//! (`Parallelism::Rayon`); otherwise the batch is looped over, in parallel when each
//! product is small (each single-threaded), else one after another.

use gemm::Parallelism;
use rayon::prelude::*;

use super::Loc;

/// Products with fewer multiply-adds than this run single-threaded.
const PAR_MIN: usize = 1 << 16;

/// A matrix in memory: element `(i, j)` at `ptr + 4·(i·rs + j·cs)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mat {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

unsafe impl Send for Mat {}
unsafe impl Sync for Mat {}

/// `dst[m, n] (row stride ld) = (read_dst ? dst : 0) + a[m, k]·b[k, n]`.
///
/// # Safety
/// Every element the matrices address must be valid; `dst` must not overlap `a`, `b`.
pub(crate) unsafe fn gemm_one(
    (m, k, n): (usize, usize, usize),
    dst: *mut f32,
    ld: isize,
    a: Mat,
    b: Mat,
    read_dst: bool,
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !read_dst {
            for i in 0..m {
                for j in 0..n {
                    unsafe { *dst.offset(i as isize * ld + j as isize) = 0.0 };
                }
            }
        }
        return;
    }
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            ld,
            read_dst,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            if read_dst { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            par,
        )
    };
}

pub(crate) fn parallelism(work: usize) -> Parallelism {
    if work >= PAR_MIN && rayon::current_num_threads() > 1 {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    }
}

/// Element offsets of every batch entry (the axes before the last two).
pub(crate) fn batch_offsets(shape: &[usize], strides: &[usize], offset: usize) -> Vec<usize> {
    let r = shape.len();
    let batch_dims = &shape[..r - 2];
    let count: usize = batch_dims.iter().product();
    let mut out = Vec::with_capacity(count);
    let mut idx = vec![0usize; batch_dims.len()];
    for _ in 0..count {
        out.push(offset + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>());
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < batch_dims[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// The stride of one axis that `shape` (with `strides`) merges into, if any.
pub(crate) fn merged_stride(shape: &[usize], strides: &[usize]) -> Option<usize> {
    let mut inner: Option<(usize, usize)> = None; // (stride, size) of the merged axes below
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d == 1 {
            continue;
        }
        inner = Some(match inner {
            None => (s, d),
            Some((is, id)) if s == is * id => (is, id * d),
            Some(_) => return None,
        });
    }
    Some(inner.map(|(s, _)| s).unwrap_or(1))
}

/// `out = a·b` (or `out += a·b` when `read_dst`), batched; `out` contiguous.
pub(crate) fn matmul(a: &Loc, b: &Loc, out: &Loc, read_dst: bool) -> Result<(), String> {
    let (sa, sb) = (a.shape(), b.shape());
    let (ra, rb) = (sa.len(), sb.len());
    let fits =
        ra >= 2 && rb >= 2 && sa[ra - 1] == sb[rb - 2] && (rb == 2 || sa[..ra - 2] == sb[..rb - 2]);
    if !fits || !out.is_contiguous() {
        return Err(format!(
            "cannot multiply {sa:?} by {sb:?} into {:?}",
            out.shape()
        ));
    }
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    let batch: usize = sa[..ra - 2].iter().product();
    let (la, lb) = (&a.layout, &b.layout);
    let mat = |l: &crate::eager::value::Layout, ptr: *mut u8, off: usize, r: usize| Mat {
        ptr: (ptr as *const f32).wrapping_add(off),
        rs: l.strides[r - 2] as isize,
        cs: l.strides[r - 1] as isize,
    };
    let dst = out.base() as *mut f32;
    if rb == 2 {
        if let Some(rs) = merged_stride(&sa[..ra - 1], &la.strides[..ra - 1]) {
            let lhs = Mat {
                ptr: (a.ptr as *const f32).wrapping_add(la.offset),
                rs: rs as isize,
                cs: la.strides[ra - 1] as isize,
            };
            let rows = batch * m;
            // SAFETY: the locations describe valid buffers of their shapes; `out` is a
            // fresh arena buffer that does not overlap the operands.
            unsafe {
                gemm_one(
                    (rows, k, n),
                    dst,
                    n as isize,
                    lhs,
                    mat(lb, b.ptr, lb.offset, rb),
                    read_dst,
                    parallelism(rows * k * n),
                )
            };
            return Ok(());
        }
    }
    let offs_a = batch_offsets(sa, &la.strides, la.offset);
    let offs_b = if rb == 2 {
        vec![lb.offset; batch]
    } else {
        batch_offsets(sb, &lb.strides, lb.offset)
    };
    let per = m * k * n;
    struct D(*mut f32);
    unsafe impl Send for D {}
    unsafe impl Sync for D {}
    let d = D(dst);
    let one = |i: usize, par: Parallelism| {
        let d = &d;
        // SAFETY: batch entry `i` writes its own `m·n` block of `out`.
        unsafe {
            gemm_one(
                (m, k, n),
                d.0.add(i * m * n),
                n as isize,
                mat(la, a.ptr, offs_a[i], ra),
                mat(lb, b.ptr, offs_b[i], rb),
                read_dst,
                par,
            )
        }
    };
    if batch > 1 && per < PAR_MIN * 4 {
        (0..batch)
            .into_par_iter()
            .for_each(|i| one(i, Parallelism::None));
    } else {
        for i in 0..batch {
            one(i, parallelism(per));
        }
    }
    Ok(())
}
