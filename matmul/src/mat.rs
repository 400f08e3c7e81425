//! The operands of the products: strided matrices, and what a 16-bit product does to
//! each result block (bias, ReLU, column sums).

use crate::float16::Rhs;

/// A matrix in memory: element `(i, j)` at `ptr + 4·(i·rs + j·cs)`.
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

unsafe impl Send for Mat {}
unsafe impl Sync for Mat {}

impl Mat {
    /// The same elements read transposed: element `(i, j)` is this one's `(j, i)`.
    pub fn transposed(self) -> Mat {
        Mat {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// Where a product's `m × n` result goes: element `(i, j)` at `ptr + 4·(i·ld + j)`, the
/// sum added to what is there when `read`, else written over it.
#[derive(Clone, Copy, Debug)]
pub struct Dst {
    pub ptr: *mut f32,
    pub ld: isize,
    pub read: bool,
}

unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

impl Dst {
    pub fn new(ptr: *mut f32, ld: isize, read: bool) -> Dst {
        Dst { ptr, ld, read }
    }
}

/// The most leading axes [`ColumnSums`] takes.
pub const SUM_AXES: usize = 4;

/// The column sums of a product's right operand, which a 16-bit product writes while it
/// packs the operand (its rows still in the core's cache; [`matmul_epilogue`]): the bias
/// gradient of a weight gradient `xᵀ·dy` (`dy`'s column sums, the `sum_rows` kernel's
/// result, which then needs no pass of its own over `dy`). `b` (`k × n`, row-major) is
/// seen as `dy` of shape
/// `[lead[0], …, lead[axes − 1], n]` (`k` the product of `lead`), and each column summed
/// exactly as `sum_rows` sums it: one sum an axis, from `0.0` in index order, the last
/// axis's loop outermost. So `dst[j]` has the kernel's bits.
#[derive(Clone, Copy, Debug)]
pub struct ColumnSums {
    /// `n` values.
    pub dst: *mut f32,
    pub lead: [usize; SUM_AXES],
    pub axes: usize,
}

unsafe impl Send for ColumnSums {}
unsafe impl Sync for ColumnSums {}

/// What a 16-bit product ([`bf16::gemm`](crate::float16::gemm)) does to each result block
/// after its last sums, while the block is in the core's first-level cache: add a bias
/// (one value a column, `bias[j]` for column `j`), then apply a ReLU (`x` where `x > 0`
/// or NaN, else `+0.0`, as the `relu` kernel). A `linear` kernel's bias and activation
/// this way cost no pass of their own over the result (DESIGN §5: activations as a fused
/// epilogue). Defined here, on every platform, for the `bf16` module and its stub alike.
#[derive(Clone, Copy, Debug, Default)]
pub struct Epilogue {
    pub bias: Option<*const f32>,
    pub relu: bool,
}

unsafe impl Send for Epilogue {}
unsafe impl Sync for Epilogue {}

/// One product of [`bf16::gemm_group`](crate::float16::gemm_group) or
/// [`bf16::gemm`](crate::float16::gemm): `dst[m, n] = (dst.read ? dst : 0) + a·b`, then
/// `epilogue`, and `b`'s `sums` where asked.
#[derive(Clone, Copy)]
pub struct Member<'a> {
    pub n: usize,
    pub dst: Dst,
    pub b: Rhs<'a>,
    pub epilogue: Epilogue,
    pub sums: Option<ColumnSums>,
}

impl<'a> Member<'a> {
    /// `dst[m, n] = (dst.read ? dst : 0) + a·b`, no epilogue, no sums.
    pub fn plain(n: usize, b: Rhs<'a>, dst: Dst) -> Member<'a> {
        Member {
            n,
            dst,
            b,
            epilogue: Epilogue::default(),
            sums: None,
        }
    }
}

unsafe impl Send for Member<'_> {}
unsafe impl Sync for Member<'_> {}

/// The tasks of a group of products run side by side: `(member, panel)` for every panel
/// of `width` columns of every member whose right operand is `ready` (the others run
/// elsewhere).
pub(crate) fn panel_tasks<T>(
    ready: &[Option<T>],
    members: &[Member<'_>],
    width: usize,
) -> Vec<(usize, usize)> {
    ready
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_some())
        .flat_map(|(i, _)| (0..members[i].n.div_ceil(width)).map(move |t| (i, t)))
        .collect()
}
