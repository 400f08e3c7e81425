//! Matrix products of the compiled executor, through the `gemm` crate.
//!
//! In: strided operand locations `a [..., m, k]` and `b [..., k, n]` (or a shared
//! `[k, n]`), a contiguous destination `[..., m, n]`. Out: `dst = alpha·dst + beta·a·b`
//! with `alpha = 1` when `read_dst` (a bias already in `dst` is folded in this way, as
//! DESIGN §5 asks), else `dst = a·b`.
//!
//! Transposed operands are read through their strides, except a transposed right operand
//! of a product with many rows, which is copied row-major first (see `gemm_one`). A
//! shared right operand with a left operand whose batch and row axes merge makes one
//! large GEMM (`Parallelism::Rayon`); otherwise the batch is looped over, in parallel
//! when each product is small (each single-threaded), else one after another.

use gemm::Parallelism;
use rayon::prelude::*;

use super::Loc;
use crate::eager::value::Layout;
use kiln_matmul::float16::{PackedRhs, Rhs};
use kiln_matmul::{gemm_one, parallelism, ColumnSums, Dst, Epilogue, Kernel16, Mat, Member};

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

/// Element offsets of every batch entry of `a` `[..., m, k]` and of `b` (`[..., k, n]`,
/// or `[k, n]`: then the same matrix for every entry).
pub(crate) fn entry_offsets(
    sa: &[usize],
    la: &Layout,
    sb: &[usize],
    lb: &Layout,
) -> (Vec<usize>, Vec<usize>) {
    let offs_a = batch_offsets(sa, &la.strides, la.offset);
    let offs_b = if sb.len() == 2 {
        vec![lb.offset; offs_a.len()]
    } else {
        batch_offsets(sb, &lb.strides, lb.offset)
    };
    (offs_a, offs_b)
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

/// Products with fewer multiply-adds than this stay f32 with `bf16` (packing and the
/// tiles' setup would cost more than they save: the demo's model, `d_model` 48, trained
/// 300 steps in 6.3 s with its 800 × 48 · 48 × 48 products on the tiles, 5.2 s without).
pub(crate) const BF16_MIN: usize = 1 << 22;

/// With the int16 kernel, the floor of a product whose right operand is a weight packed
/// beforehand (once a parameters version): only the left operand is then packed at the
/// call, `m·k` values for `m·k·n` multiply-adds, so the products of a few rows take it.
/// Those are decoding's: 4 to 60 rows (a batch's sentences finish at different steps)
/// by `256 × 256` or `256 × 1024` weights, which the f32 crate runs while packing the
/// weight anew at every call. `kiln translate --gemm-type int16` of Multi30k's validation
/// set (`multi30k_small`, 2 threads) took 7 % less CPU time with this floor.
pub(crate) const INT16_PACKED_MIN: usize = 1 << 16;

/// Whether a product of `work` multiply-adds runs with the 16-bit `kernel` ([`BF16_MIN`],
/// [`INT16_PACKED_MIN`]); `packed`: its right operand is a weight packed beforehand. The
/// int8 kernel runs only the products of packed weights (CTranslate2's scheme: the
/// products of two activations, attention's, stay f32), whatever their size: so that
/// whether a row's product runs in int8 does not depend on how many rows its batch has
/// (batch invariance, #60).
pub(crate) fn takes_16bit(kernel: Kernel16, work: usize, packed: bool) -> bool {
    match kernel {
        Kernel16::Int8 => packed,
        _ => work >= BF16_MIN || (packed && kernel.is_int16() && work >= INT16_PACKED_MIN),
    }
}

/// `dst = (dst.read ? dst : 0) + a·b`: [`gemm_one`], or with a `bf16` kernel and a large
/// enough product, [`bf16::gemm`](super::bf16::gemm) (16-bit operands, bf16 or scaled
/// fp16 by the kernel, sums in f32; a kernel is only set where it is available), reading
/// `b` from `packed` where the caller packed it beforehand.
///
/// # Safety
/// As [`gemm_one`].
unsafe fn product(
    (m, k, n): (usize, usize, usize),
    (a, b): (Mat, Mat),
    dst: Dst,
    bf16: Option<Kernel16>,
    packed: Option<&PackedRhs>,
) {
    match bf16 {
        Some(kernel) if takes_16bit(kernel, m * k * n, packed.is_some()) => {
            let b = packed.map_or(Rhs::Mat(b), |p| Rhs::Packed(p, b));
            // SAFETY: as the caller's; a kernel is set only after its check.
            unsafe { kiln_matmul::float16::gemm(kernel, (m, k), a, Member::plain(n, b, dst)) }
        }
        _ => unsafe { gemm_one((m, k, n), a, b, dst, parallelism(m * k * n)) },
    }
}

/// The one 16-bit product that [`matmul`] would run for `a·b` into `out`, where it runs
/// one: a 2-D `b`, `a`'s batch and row axes merged into rows, a contiguous `out` of those
/// rows and `b`'s columns, and enough multiply-adds ([`takes_16bit`]). Its kernel, left
/// operand and `(rows, k, n)`. Only such a product takes an [`Epilogue`]
/// ([`matmul_epilogue`]).
fn one_16bit_product(
    a: &Loc,
    b: &Loc,
    out: &Loc,
    bf16: Option<Kernel16>,
    packed: bool,
) -> Option<(Kernel16, Mat, (usize, usize, usize))> {
    let kernel = bf16?;
    let (sa, sb) = (a.shape(), b.shape());
    let ra = sa.len();
    if ra < 2 || sb.len() != 2 || sa[ra - 1] != sb[0] {
        return None;
    }
    let (rows, k, n) = (sa[..ra - 1].iter().product::<usize>(), sb[0], sb[1]);
    let so = out.shape();
    if !out.is_contiguous() || so.last() != Some(&n) || out.numel() != rows * n {
        return None;
    }
    let la = &a.layout;
    let rs = merged_stride(&sa[..ra - 1], &la.strides[..ra - 1])?;
    takes_16bit(kernel, rows * k * n, packed).then(|| {
        let lhs = Mat {
            ptr: (a.ptr as *const f32).wrapping_add(la.offset),
            rs: rs as isize,
            cs: la.strides[ra - 1] as isize,
        };
        (kernel, lhs, (rows, k, n))
    })
}

/// `out = epilogue(a·b)` (its bias added, its ReLU applied) as one 16-bit product, where
/// [`matmul`] would run one ([`one_16bit_product`]); `None` otherwise, with nothing
/// written (the caller then adds the bias and applies the ReLU itself). A bias must
/// hold `n` values. With `sums`, also `b`'s [`ColumnSums`] (`n` values at `sums.dst`,
/// `k` the product of its leading axes), where `b` is row-major and not `packed`
/// (otherwise `None`, with nothing written).
pub(crate) fn matmul_epilogue(
    a: &Loc,
    b: &Loc,
    out: &Loc,
    bf16: Option<Kernel16>,
    packed: Option<&PackedRhs>,
    epilogue: Epilogue,
    sums: Option<ColumnSums>,
) -> Option<()> {
    let (kernel, lhs, (rows, k, n)) = one_16bit_product(a, b, out, bf16, packed.is_some())?;
    let lb = &b.layout;
    if let Some(s) = sums {
        let lead = &s.lead[..s.axes];
        if packed.is_some() || lb.strides[1] != 1 || lead.iter().product::<usize>() != k {
            return None;
        }
    }
    let rhs = Mat {
        ptr: (b.ptr as *const f32).wrapping_add(lb.offset),
        rs: lb.strides[0] as isize,
        cs: lb.strides[1] as isize,
    };
    let rhs = packed.map_or(Rhs::Mat(rhs), |p| Rhs::Packed(p, rhs));
    let member = Member {
        n,
        dst: Dst::new(out.base() as *mut f32, n as isize, false),
        b: rhs,
        epilogue,
        sums,
    };
    // SAFETY: the locations describe valid buffers of their shapes; `out` is a fresh
    // arena buffer that does not overlap the operands; a kernel is set only after its
    // check; the caller's bias holds `n` values.
    unsafe { kiln_matmul::float16::gemm(kernel, (rows, k), lhs, member) };
    Some(())
}

/// One product of [`group_epilogue`]: its right operand, result, `b` packed beforehand
/// where the caller did, [`Epilogue`], and `b`'s [`ColumnSums`] where asked.
pub(crate) type GroupMember<'a> = (
    &'a Loc,
    &'a Loc,
    Option<&'a PackedRhs>,
    Epilogue,
    Option<ColumnSums>,
);

/// `out = epilogue(a·b)` for every member of `members` (all of one left operand `a`) as
/// one group of 16-bit products ([`gemm_group`](super::bf16::gemm_group): `a` packed
/// once for all), where each would run as one 16-bit product ([`one_16bit_product`]) and
/// no result overlaps an operand or another result; `None` otherwise, with nothing
/// written. A bias must hold `n` values. Column sums as [`matmul_epilogue`]'s: of a
/// row-major `b` not packed, `k` the product of their leading axes.
pub(crate) fn group_epilogue(
    a: &Loc,
    members: &[GroupMember<'_>],
    bf16: Option<Kernel16>,
) -> Option<()> {
    let span = |l: &Loc| (l.ptr as usize, l.ptr as usize + 4 * l.extent());
    let overlap = |x: (usize, usize), y: (usize, usize)| x.0 < y.1 && y.0 < x.1;
    let mut lhs = None;
    let mut group = Vec::with_capacity(members.len());
    // What the group reads or writes besides its results: `a`, and every member's `b`,
    // bias and sums.
    let mut operands = vec![span(a)];
    for &(b, out, packed, epilogue, sums) in members {
        let (kernel, l, (rows, k, n)) = one_16bit_product(a, b, out, bf16, packed.is_some())?;
        if let Some(s) = sums {
            let lead = &s.lead[..s.axes];
            if packed.is_some() || b.layout.strides[1] != 1 || lead.iter().product::<usize>() != k {
                return None;
            }
        }
        match lhs {
            None => lhs = Some((kernel, l, rows, k)),
            Some((_, l0, rows0, k0)) => {
                if (l0.ptr, l0.rs, l0.cs, rows0, k0) != (l.ptr, l.rs, l.cs, rows, k) {
                    return None;
                }
            }
        }
        operands.push(span(b));
        for p in [epilogue.bias, sums.map(|s| s.dst as *const f32)]
            .into_iter()
            .flatten()
        {
            operands.push((p as usize, p as usize + 4 * n));
        }
        let lb = &b.layout;
        let rhs = Mat {
            ptr: (b.ptr as *const f32).wrapping_add(lb.offset),
            rs: lb.strides[0] as isize,
            cs: lb.strides[1] as isize,
        };
        group.push(Member {
            n,
            dst: Dst::new(out.base() as *mut f32, n as isize, false),
            b: packed.map_or(Rhs::Mat(rhs), |p| Rhs::Packed(p, rhs)),
            epilogue,
            sums,
        });
    }
    for (q, m) in members.iter().enumerate() {
        let o = span(m.1);
        let others = members.iter().enumerate().filter(|&(r, _)| r != q);
        if operands.iter().any(|&x| overlap(x, o))
            || others.clone().any(|(_, m)| overlap(span(m.1), o))
        {
            return None;
        }
    }
    let (kernel, lhs, rows, k) = lhs?;
    // SAFETY: the locations describe valid buffers of their shapes; no result overlaps
    // an operand or another result (checked above); a kernel is set only after its
    // check; the caller's biases hold `n` values.
    unsafe { kiln_matmul::float16::gemm_group(kernel, (rows, k), lhs, &group) };
    Some(())
}

/// `out = a·b` (or `out += a·b` when `read_dst`), batched; `out` contiguous. With a `bf16`
/// kernel, the large products run in bf16 ([`product`]), a 2-D `b` read from `packed`
/// where the caller packed it beforehand.
pub(crate) fn matmul(
    a: &Loc,
    b: &Loc,
    out: &Loc,
    read_dst: bool,
    bf16: Option<Kernel16>,
    packed: Option<&PackedRhs>,
) -> Result<(), String> {
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
    let mat = |l: &Layout, ptr: *mut u8, off: usize, r: usize| Mat {
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
                product(
                    (rows, k, n),
                    (lhs, mat(lb, b.ptr, lb.offset, rb)),
                    Dst::new(dst, n as isize, read_dst),
                    bf16,
                    packed,
                )
            };
            return Ok(());
        }
    }
    let (offs_a, offs_b) = entry_offsets(sa, la, sb, lb);
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
                mat(la, a.ptr, offs_a[i], ra),
                mat(lb, b.ptr, offs_b[i], rb),
                Dst::new(d.0.add(i * m * n), n as isize, read_dst),
                par,
            )
        }
    };
    if batch > 1 && per < kiln_matmul::PAR_MIN * 4 {
        (0..batch)
            .into_par_iter()
            .for_each(|i| one(i, Parallelism::None));
    } else if bf16.is_some() && per >= BF16_MIN {
        for i in 0..batch {
            // SAFETY: as `one`'s.
            unsafe {
                product(
                    (m, k, n),
                    (mat(la, a.ptr, offs_a[i], ra), mat(lb, b.ptr, offs_b[i], rb)),
                    Dst::new(d.0.add(i * m * n), n as isize, read_dst),
                    bf16,
                    None,
                )
            }
        }
    } else {
        for i in 0..batch {
            one(i, parallelism(per));
        }
    }
    Ok(())
}
