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

use super::bf16::{Kernel, PackedRhs, Rhs};
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

impl Mat {
    /// The same elements read transposed: element `(i, j)` is this one's `(j, i)`.
    #[cfg_attr(
        not(all(target_arch = "x86_64", target_os = "linux")),
        allow(dead_code)
    )]
    pub fn transposed(self) -> Mat {
        Mat {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

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
    // A small single-threaded product (attention's of each head): AVX-512F or AVX2 registers
    // over the whole `k`, without the crate's packing and dispatch.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    if matches!(par, Parallelism::None) && super::small::takes(k, n) {
        // SAFETY: as the caller's; `takes` checked the CPU and the sizes.
        unsafe { super::small::gemm((m, k, n), dst, ld, a, b, read_dst) };
        return;
    }
    // A right operand stored transposed (`b[p, j]` at `p + j·cs`): the crate would pack it
    // with a scalar gather of stride `cs` for every row block, which runs the product
    // 15–30 % slower than on a row-major operand. Where the product is large enough to
    // pay for it, one cache-blocked transposed copy comes first.
    let mut scratch = Vec::new();
    let b = if b.rs == 1 && b.cs != 1 && m >= TRANSPOSE_MIN_ROWS && k * n <= TRANSPOSE_MAX {
        scratch = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
        scratch.clear();
        scratch.reserve(k * n);
        // SAFETY: `b` addresses `k·n` valid elements; the spare capacity is `k·n` floats,
        // each written once by `transpose_into` before `set_len`.
        unsafe {
            transpose_into(b.ptr, b.cs, k, n, scratch.as_mut_ptr(), &par);
            scratch.set_len(k * n);
        }
        Mat {
            ptr: scratch.as_ptr(),
            rs: n as isize,
            cs: 1,
        }
    } else {
        b
    };
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
    if scratch.capacity() > 0 {
        SCRATCH.with(|s| *s.borrow_mut() = scratch);
    }
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

/// The most leading axes [`ColumnSums`] takes.
pub(crate) const SUM_AXES: usize = 4;

/// The column sums of a product's right operand, which a 16-bit product writes while it
/// packs the operand (its rows still in the core's cache; [`matmul_epilogue`]): the bias
/// gradient of a weight gradient `xᵀ·dy` (`dy`'s column sums, the `sum_rows` kernel's
/// result, which then needs no pass of its own over `dy`). `b` (`k × n`, row-major) is
/// seen as `dy` of shape
/// `[lead[0], …, lead[axes − 1], n]` (`k` the product of `lead`), and each column summed
/// exactly as `sum_rows` sums it: one sum an axis, from `0.0` in index order, the last
/// axis's loop outermost. So `dst[j]` has the kernel's bits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ColumnSums {
    /// `n` values.
    pub dst: *mut f32,
    pub lead: [usize; SUM_AXES],
    pub axes: usize,
}

unsafe impl Send for ColumnSums {}
unsafe impl Sync for ColumnSums {}

/// What a 16-bit product ([`bf16::gemm`](super::bf16::gemm)) does to each result block
/// after its last sums, while the block is in the core's first-level cache: add a bias
/// (one value a column, `bias[j]` for column `j`), then apply a ReLU (`x` where `x > 0`
/// or NaN, else `+0.0`, as the `relu` kernel). A `linear` kernel's bias and activation
/// this way cost no pass of their own over the result (DESIGN §5: activations as a fused
/// epilogue). Defined here, on every platform, for the `bf16` module and its stub alike.
#[derive(Clone, Copy, Debug, Default)]
#[cfg_attr(
    not(all(target_arch = "x86_64", target_os = "linux")),
    allow(dead_code)
)]
pub(crate) struct Epilogue {
    pub bias: Option<*const f32>,
    pub relu: bool,
}

unsafe impl Send for Epilogue {}
unsafe impl Sync for Epilogue {}

/// One product of [`bf16::gemm_group`](super::bf16::gemm_group): `dst[m, n]` (row stride
/// `ld`) `= (read_dst ? dst : 0) + a·b`, then `epilogue`, and `b`'s `sums` where asked, as
/// [`bf16::gemm`](super::bf16::gemm)'s arguments.
#[derive(Clone, Copy)]
#[cfg_attr(
    not(all(target_arch = "x86_64", target_os = "linux")),
    allow(dead_code)
)]
pub(crate) struct Member<'a> {
    pub n: usize,
    pub dst: *mut f32,
    pub ld: isize,
    pub b: Rhs<'a>,
    pub read_dst: bool,
    pub epilogue: Epilogue,
    pub sums: Option<ColumnSums>,
}

unsafe impl Send for Member<'_> {}
unsafe impl Sync for Member<'_> {}

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
/// [`INT16_PACKED_MIN`]); `packed`: its right operand is a weight packed beforehand.
pub(crate) fn takes_16bit(kernel: Kernel, work: usize, packed: bool) -> bool {
    work >= BF16_MIN || (packed && kernel.is_int16() && work >= INT16_PACKED_MIN)
}

/// `dst = (read_dst ? dst : 0) + a·b`: [`gemm_one`], or with a `bf16` kernel and a large
/// enough product, [`bf16::gemm`](super::bf16::gemm) (16-bit operands, bf16 or scaled
/// fp16 by the kernel, sums in f32; a kernel is only set where it is available), reading
/// `b` from `packed` where the caller packed it beforehand.
///
/// # Safety
/// As [`gemm_one`].
unsafe fn product(
    (m, k, n): (usize, usize, usize),
    dst: *mut f32,
    ld: isize,
    (a, b): (Mat, Mat),
    read_dst: bool,
    bf16: Option<Kernel>,
    packed: Option<&PackedRhs>,
) {
    match bf16 {
        Some(kernel) if takes_16bit(kernel, m * k * n, packed.is_some()) => {
            let b = packed.map_or(Rhs::Mat(b), |p| Rhs::Packed(p, b));
            let e = Epilogue::default();
            // SAFETY: as the caller's; a kernel is set only after its check.
            unsafe { super::bf16::gemm(kernel, (m, k, n), dst, ld, a, b, read_dst, e, None) }
        }
        _ => unsafe { gemm_one((m, k, n), dst, ld, a, b, read_dst, parallelism(m * k * n)) },
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
    bf16: Option<Kernel>,
    packed: bool,
) -> Option<(Kernel, Mat, (usize, usize, usize))> {
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
    bf16: Option<Kernel>,
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
    let dst = out.base() as *mut f32;
    // SAFETY: the locations describe valid buffers of their shapes; `out` is a fresh
    // arena buffer that does not overlap the operands; a kernel is set only after its
    // check; the caller's bias holds `n` values.
    unsafe {
        super::bf16::gemm(
            kernel,
            (rows, k, n),
            dst,
            n as isize,
            lhs,
            rhs,
            false,
            epilogue,
            sums,
        )
    };
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
    bf16: Option<Kernel>,
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
            dst: out.base() as *mut f32,
            ld: n as isize,
            b: packed.map_or(Rhs::Mat(rhs), |p| Rhs::Packed(p, rhs)),
            read_dst: false,
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
    unsafe { super::bf16::gemm_group(kernel, (rows, k), lhs, &group) };
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
    bf16: Option<Kernel>,
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
                product(
                    (rows, k, n),
                    dst,
                    n as isize,
                    (lhs, mat(lb, b.ptr, lb.offset, rb)),
                    read_dst,
                    bf16,
                    packed,
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
    } else if bf16.is_some() && per >= BF16_MIN {
        for i in 0..batch {
            // SAFETY: as `one`'s.
            unsafe {
                product(
                    (m, k, n),
                    d.0.add(i * m * n),
                    n as isize,
                    (mat(la, a.ptr, offs_a[i], ra), mat(lb, b.ptr, offs_b[i], rb)),
                    read_dst,
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

/// Products with fewer left rows than this read a transposed right operand in place.
const TRANSPOSE_MIN_ROWS: usize = 256;
/// Right operands with more elements than this are read in place too (the vocabulary
/// projection's 19M: its copy costs about what it saves).
const TRANSPOSE_MAX: usize = 1 << 23;

thread_local! {
    /// The transposed copy's storage, kept between products (taken out while in use, so
    /// a product that runs inside another on the same thread allocates its own).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `dst[p·n + j] = src[p + j·cs]` for `p < k`, `j < n`: a transposed copy in 64×64 tiles
/// (8×8 AVX blocks where the CPU has AVX2), row blocks in parallel when `par` is.
///
/// # Safety
/// `src` must address every `p + j·cs` (`cs ≥ 0`); `dst` must hold `k·n` floats and not
/// overlap it.
unsafe fn transpose_into(
    src: *const f32,
    cs: isize,
    k: usize,
    n: usize,
    dst: *mut f32,
    par: &Parallelism,
) {
    struct P(*const f32, *mut f32);
    unsafe impl Send for P {}
    unsafe impl Sync for P {}
    let ptrs = P(src, dst);
    let cs = cs as usize;
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    let block = |pb: usize| {
        let ptrs = &ptrs;
        let (p0, p1) = (pb * TILE, (pb * TILE + TILE).min(k));
        for j0 in (0..n).step_by(TILE) {
            let j1 = (j0 + TILE).min(n);
            // SAFETY: in bounds by the caller's contract; row block `pb` writes only its
            // own rows of `dst`.
            unsafe {
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    x86::tile(ptrs.0, cs, ptrs.1, n, (p0, p1), (j0, j1));
                    continue;
                }
                tile_scalar(ptrs.0, cs, ptrs.1, n, (p0, p1), (j0, j1));
            }
        }
    };
    let blocks = k.div_ceil(TILE);
    if matches!(par, Parallelism::Rayon(_)) {
        (0..blocks).into_par_iter().for_each(block);
    } else {
        (0..blocks).for_each(block);
    }
}

/// Rows and columns of `transpose_into`'s tiles.
const TILE: usize = 64;

/// One tile of `transpose_into`, element by element.
///
/// # Safety
/// As `transpose_into`, for rows `p0..p1` and columns `j0..j1` of `dst`.
unsafe fn tile_scalar(
    src: *const f32,
    cs: usize,
    dst: *mut f32,
    n: usize,
    (p0, p1): (usize, usize),
    (j0, j1): (usize, usize),
) {
    for p in p0..p1 {
        for j in j0..j1 {
            unsafe { *dst.add(p * n + j) = *src.add(p + j * cs) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// One tile of `transpose_into` in 8×8 blocks, the edges element by element.
    ///
    /// # Safety
    /// As `super::tile_scalar`, on a CPU with AVX2.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn tile(
        src: *const f32,
        cs: usize,
        dst: *mut f32,
        n: usize,
        (p0, p1): (usize, usize),
        (j0, j1): (usize, usize),
    ) {
        let mut p = p0;
        while p + 8 <= p1 {
            let mut j = j0;
            while j + 8 <= j1 {
                unsafe { block8(src.add(p + j * cs), cs, dst.add(p * n + j), n) };
                j += 8;
            }
            unsafe { super::tile_scalar(src, cs, dst, n, (p, p + 8), (j, j1)) };
            p += 8;
        }
        unsafe { super::tile_scalar(src, cs, dst, n, (p, p1), (j0, j1)) };
    }

    /// `dst[r·n + c] = src[r + c·cs]` for `r, c < 8`.
    #[target_feature(enable = "avx2")]
    unsafe fn block8(src: *const f32, cs: usize, dst: *mut f32, n: usize) {
        unsafe {
            let rows = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * cs)));
            for (i, v) in transpose8(rows).into_iter().enumerate() {
                _mm256_storeu_ps(dst.add(i * n), v);
            }
        }
    }

    /// The 8 × 8 transpose of `r`: lane `c` of result `i` is lane `i` of `r[c]`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(crate) fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        // Rows 2i and 2i + 1 interleaved: their low and their high pairs of each half.
        let [(t0, t1), (t2, t3), (t4, t5), (t6, t7)]: [(__m256, __m256); 4] =
            std::array::from_fn(|i| {
                let (a, b) = (r[2 * i], r[2 * i + 1]);
                (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b))
            });
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn transpose_into_copies_every_element_at_any_size_and_stride() {
        for &(k, n, pad) in &[
            (1, 1, 0),
            (7, 9, 3),
            (8, 8, 0),
            (64, 64, 0),
            (67, 130, 5),
            (130, 67, 1),
        ] {
            let cs = k + pad;
            let src = values(cs * n, (k * 1000 + n) as u64);
            for par in [Parallelism::None, Parallelism::Rayon(2)] {
                let mut dst = vec![f32::NAN; k * n];
                // SAFETY: `src` holds `n` rows of `cs ≥ k` floats; `dst` holds `k·n`.
                unsafe { transpose_into(src.as_ptr(), cs as isize, k, n, dst.as_mut_ptr(), &par) };
                for p in 0..k {
                    for j in 0..n {
                        assert_eq!(
                            dst[p * n + j].to_bits(),
                            src[p + j * cs].to_bits(),
                            "k {k} n {n} cs {cs}: element ({p}, {j})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_transposed_right_operand_gives_the_bits_of_a_row_major_one() {
        // Above TRANSPOSE_MIN_ROWS, so the transposed operand is copied first; sizes that
        // are no multiple of the 8×8 blocks or the tiles.
        let (m, k, n) = (TRANSPOSE_MIN_ROWS + 45, 70, 37);
        let a = values(m * k, 1);
        let b = values(k * n, 2); // row-major [k, n]
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect(); // [n, k]
        let bias = values(n, 3);
        for read_dst in [false, true] {
            let run = |b: Mat| {
                let mut out: Vec<f32> = (0..m * n).map(|i| bias[i % n]).collect();
                let lhs = Mat {
                    ptr: a.as_ptr(),
                    rs: k as isize,
                    cs: 1,
                };
                // SAFETY: the operands hold `m·k` and `k·n` floats; `out` holds `m·n`.
                unsafe {
                    gemm_one(
                        (m, k, n),
                        out.as_mut_ptr(),
                        n as isize,
                        lhs,
                        b,
                        read_dst,
                        Parallelism::Rayon(2),
                    )
                };
                out
            };
            let plain = run(Mat {
                ptr: b.as_ptr(),
                rs: n as isize,
                cs: 1,
            });
            let viewed = run(Mat {
                ptr: bt.as_ptr(),
                rs: 1,
                cs: k as isize,
            });
            let same = plain
                .iter()
                .zip(&viewed)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "read_dst {read_dst}: the transposed operand changed bits"
            );
            for i in 0..m {
                for j in 0..n {
                    let mut want = if read_dst { bias[j] as f64 } else { 0.0 };
                    for p in 0..k {
                        want += a[i * k + p] as f64 * b[p * n + j] as f64;
                    }
                    let got = viewed[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "({i}, {j}): {got} against {want}"
                    );
                }
            }
        }
    }
}
