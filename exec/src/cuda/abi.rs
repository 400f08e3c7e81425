//! The launch ABI of the generated CUDA functions and the cuBLAS operand mapping, as pure
//! functions (tested on machines without a GPU).
//!
//! In: what a kernel launch needs — the CPU kernel's `dims` (built by the compiler's
//! `*_dims` helpers, exactly as `exec/src/compiled/launch.rs` does), shapes and strides
//! of GEMM operands. Out: the by-value `kiln_dims` struct ([`pack_dims`]), the number of
//! work items of each GPU function where it differs from the CPU kernel's ([`Launch`]
//! constructors; see `codegen::cuda::misc`, `region` and `rows`), the grid ([`grid`]), and
//! the arguments of a row-major GEMM as a column-major cuBLAS `sgemm` ([`sgemm_args`],
//! `plan_matmul`).

use kiln_compiler::codegen::cuda::misc as cuda_misc;
use kiln_compiler::codegen::cuda::rows as cuda_rows;
use kiln_compiler::codegen::cuda::text::MAX_DIMS;
use kiln_compiler::codegen::cuda::Work;
use kiln_compiler::codegen::misc::{self, ReduceLayout};
use kiln_compiler::codegen::{region, rows};
use kiln_compiler::optimize::regions::Expr;

use crate::compiled::gemm::{entry_offsets, merged_stride};
use crate::eager::value::Layout;

/// The `kiln_dims` struct of the prelude: `long long d[KILN_MAX_DIMS]`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KilnDims(pub [i64; MAX_DIMS]);

/// `dims` as the by-value struct: the values first, zeros after (ignored by the kernels).
pub fn pack_dims(dims: &[i64]) -> Result<KilnDims, String> {
    if dims.len() > MAX_DIMS {
        return Err(format!(
            "{} dims do not fit the kernels' kiln_dims struct of {MAX_DIMS}",
            dims.len()
        ));
    }
    let mut d = [0i64; MAX_DIMS];
    d[..dims.len()].copy_from_slice(dims);
    Ok(KilnDims(d))
}

/// `(grid, block)` for `items` work items of a function of `work`; `None` when there is
/// nothing to do (no launch).
pub fn grid(work: Work, items: usize) -> Option<(u32, u32)> {
    (items > 0).then(|| work.grid(items as u64))
}

/// The `dims` and GPU work items of one launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub dims: Vec<i64>,
    pub items: usize,
}

impl Launch {
    /// A launch whose items are the CPU helper's.
    pub fn same(d: (Vec<i64>, usize)) -> Launch {
        Launch {
            dims: d.0,
            items: d.1,
        }
    }

    /// `fill_rows` over `[rows, n]`: the CPU's dims, items elements `rows·n`.
    pub fn fill_rows(rows: usize, n: usize) -> Launch {
        Launch {
            dims: misc::rows_dims(rows, n).0,
            items: rows * n,
        }
    }

    /// `relu` over `n` elements: items `n`.
    pub fn relu(n: usize) -> Launch {
        Launch {
            dims: misc::relu_dims(n).0,
            items: n,
        }
    }

    /// `adam_update` over `n` elements: items `n`.
    pub fn adam(n: usize) -> Launch {
        Launch {
            dims: misc::adam_update_dims(n).0,
            items: n,
        }
    }

    /// `sum_rows` of `x[…, n]`: the partial sums (items row chunks × column tiles), then
    /// their sum (items column tiles).
    pub fn sum_rows(shape: &[usize]) -> (Launch, Launch) {
        let dims = misc::sum_rows_dims(shape).0;
        let n = shape.last().copied().unwrap_or(1);
        let rows = shape[..shape.len().saturating_sub(1)].iter().product();
        (
            Launch {
                dims: dims.clone(),
                items: cuda_misc::sum_rows_items(rows, n),
            },
            Launch {
                dims,
                items: cuda_misc::sum_rows_finish_items(n),
            },
        )
    }

    /// `add_layer_norm_bwd_finish` over rows of `d`: the CPU's dims, items column tiles
    /// of `dγ` then `dβ`.
    pub fn ln_bwd_finish(rows: usize, d: usize) -> Launch {
        Launch {
            dims: rows::add_layer_norm_bwd_finish_dims(rows, d).0,
            items: cuda_rows::add_layer_norm_bwd_finish_items(d),
        }
    }

    /// A reduction of `[outer, len, inner]` over `len`: items rows `outer` (one block
    /// each) for `Rows`, outputs `outer·inner` for `Across`.
    pub fn reduce(layout: ReduceLayout, outer: usize, len: usize, inner: usize) -> Launch {
        Launch {
            dims: misc::reduce_dims(layout, outer, len, inner).0,
            items: match layout {
                ReduceLayout::Rows => outer,
                ReduceLayout::Across => outer * inner,
            },
        }
    }

    /// `copy_strided` of a view (rank ≤ `MAX_COPY_RANK`): items elements.
    pub fn copy(shape: &[usize], strides: &[i64]) -> Launch {
        Launch {
            dims: misc::copy_strided_dims(shape, strides).0,
            items: shape.iter().product(),
        }
    }

    /// A region writing `out_shape`: items elements `R·C` (the CPU's are rows).
    pub fn region(
        expr: &Expr,
        out_shape: &[usize],
        in_strides: &[Vec<isize>],
        seed: u64,
        step: u32,
    ) -> Launch {
        Launch {
            dims: region::region_dims(expr, out_shape, in_strides, seed, step).0,
            items: out_shape.iter().product(),
        }
    }

    /// `embed_pe` into `[b, t, d]`: items elements `b·t·d`.
    pub fn embed_pe(
        [b, t, d]: [usize; 3],
        dropout: Option<(f64, u32)>,
        (seed, step): (u64, u32),
    ) -> Launch {
        Launch {
            dims: region::embed_pe_dims([b, t, d], dropout, (seed, step)).0,
            items: b * t * d,
        }
    }

    /// `xent_ls_count`: dims `[rows, pad]`, one block.
    pub fn xent_count(rows: usize, pad: i64) -> Launch {
        Launch {
            dims: vec![rows as i64, pad],
            items: 1,
        }
    }

    /// `xent_ls_finish`: dims `[rows]`, one block.
    pub fn xent_finish(rows: usize) -> Launch {
        Launch {
            dims: vec![rows as i64],
            items: 1,
        }
    }
}

/// A row-major matrix operand: element `(i, j)` at `i·rs + j·cs` elements from its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatDesc {
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

/// How column-major cuBLAS reads a row-major operand: as its transpose stored with
/// leading dimension `ld` (`trans = false`), or as itself (`trans = true`, the operand's
/// columns are contiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlasOperand {
    pub trans: bool,
    pub ld: usize,
}

/// The cuBLAS view of `m`, or `None` when neither axis has unit stride with the other's
/// stride large enough (broadcast rows, doubly strided views): copy it first.
pub fn blas_operand(m: &MatDesc) -> Option<BlasOperand> {
    let (r, c) = (m.rows, m.cols);
    if (c <= 1 || m.cs == 1) && (r <= 1 || m.rs >= c.max(1)) {
        let ld = if r <= 1 { c.max(1) } else { m.rs };
        return Some(BlasOperand { trans: false, ld });
    }
    if (r <= 1 || m.rs == 1) && (c <= 1 || m.cs >= r.max(1)) {
        let ld = if c <= 1 { r.max(1) } else { m.cs };
        return Some(BlasOperand { trans: true, ld });
    }
    None
}

/// Where one row-major product `c = a·b + beta·c` reads and writes (device addresses);
/// with `batch = Some((count, stride_a, stride_b, stride_c))` one strided-batched call
/// (element strides).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmPtrs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub beta: f32,
    pub batch: Option<(usize, i64, i64, i64)>,
}

/// The device addresses of a GEMM with a cuBLASLt epilogue: row-major `c = a·b` (the
/// operands as in [`GemmPtrs`]) and the epilogue's vector, one element per output column
/// (a bias, or the bias gradient it receives).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpiloguePtrs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub vector: u64,
}

/// The arguments of `cublasSgemm` computing row-major `C[m, n] = A[m, k]·B[k, n]`
/// (row stride of `C`: `ldc`) as column-major `Cᵀ = Bᵀ·Aᵀ`: cuBLAS's first operand is
/// `B` (`transa`, `lda`), its second `A` (`transb`, `ldb`), and its `m, n` are our `n, m`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sgemm {
    pub transa: bool,
    pub transb: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub lda: i32,
    pub ldb: i32,
    pub ldc: i32,
}

/// Which operands cuBLAS cannot read as they are (copy them contiguous and plan again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NeedsCopy {
    pub a: bool,
    pub b: bool,
}

fn int(v: usize, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} {v} exceeds cuBLAS's 32-bit sizes"))
}

/// [`Sgemm`] for `(m, k, n)` with operands `a [m, k]`, `b [k, n]` and `C`'s row stride
/// `ldc`. `Err(Ok(copy))` names the operands to copy; `Err(Err(msg))` sizes cuBLAS
/// cannot take.
pub fn sgemm_args(
    (m, k, n): (usize, usize, usize),
    a: &MatDesc,
    b: &MatDesc,
    ldc: usize,
) -> Result<Sgemm, Result<NeedsCopy, String>> {
    let (oa, ob) = (blas_operand(a), blas_operand(b));
    let (Some(oa), Some(ob)) = (oa, ob) else {
        return Err(Ok(NeedsCopy {
            a: oa.is_none(),
            b: ob.is_none(),
        }));
    };
    let args = || -> Result<Sgemm, String> {
        Ok(Sgemm {
            transa: ob.trans,
            transb: oa.trans,
            m: int(n, "n")?,
            n: int(m, "m")?,
            k: int(k, "k")?,
            lda: int(ob.ld, "ld")?,
            ldb: int(oa.ld, "ld")?,
            ldc: int(ldc.max(1), "ldc")?,
        })
    };
    args().map_err(Err)
}

/// The common difference of `offsets` (0 for one entry), if they are evenly spaced and
/// non-decreasing.
pub fn even_stride(offsets: &[usize]) -> Option<i64> {
    match offsets {
        [] | [_] => Some(0),
        [a, b, ..] => {
            let d = b.checked_sub(*a)?;
            offsets
                .windows(2)
                .all(|w| w[1].checked_sub(w[0]) == Some(d))
                .then_some(d as i64)
        }
    }
}

/// How a batched matmul runs: products of [`Sgemm`] at element offsets `a_offsets[i]`,
/// `b_offsets[i]`, `i·m·n` of the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatmulPlan {
    pub gemm: Sgemm,
    pub a_offsets: Vec<usize>,
    pub b_offsets: Vec<usize>,
    /// Output elements per product.
    pub c_stride: usize,
    /// `(stride_a, stride_b)` when one `cublasSgemmStridedBatched` call does every
    /// product (`None`: one call per product).
    pub strided: Option<(i64, i64)>,
    /// `k == 0`: no GEMM; the output is zero (or left as it is when a bias was loaded).
    pub empty_k: bool,
}

/// The plan of `out = a·b` (shapes `[..., m, k]`, `[..., k, n]` or a shared `[k, n]`) into
/// a contiguous output, as the CPU executor's `gemm::matmul` splits it: a shared right
/// operand with a left operand whose batch and row axes merge is one GEMM over
/// `batch·m` rows; otherwise one product per batch entry, strided-batched when the
/// entries are evenly spaced.
pub(crate) fn plan_matmul(a: &Layout, b: &Layout) -> Result<MatmulPlan, Result<NeedsCopy, String>> {
    let (sa, sb) = (&a.shape, &b.shape);
    let (ra, rb) = (sa.len(), sb.len());
    let fits =
        ra >= 2 && rb >= 2 && sa[ra - 1] == sb[rb - 2] && (rb == 2 || sa[..ra - 2] == sb[..rb - 2]);
    if !fits {
        return Err(Err(format!("cannot multiply {sa:?} by {sb:?}")));
    }
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    let batch: usize = sa[..ra - 2].iter().product();
    let bdesc = MatDesc {
        rows: k,
        cols: n,
        rs: b.strides[rb - 2],
        cs: b.strides[rb - 1],
    };
    if rb == 2 {
        if let Some(rs) = merged_stride(&sa[..ra - 1], &a.strides[..ra - 1]) {
            let rows = batch * m;
            let adesc = MatDesc {
                rows,
                cols: k,
                rs,
                cs: a.strides[ra - 1],
            };
            if let Ok(gemm) = sgemm_args((rows, k, n), &adesc, &bdesc, n) {
                return Ok(MatmulPlan {
                    gemm,
                    a_offsets: vec![a.offset],
                    b_offsets: vec![b.offset],
                    c_stride: rows * n,
                    strided: None,
                    empty_k: k == 0,
                });
            }
        }
    }
    let adesc = MatDesc {
        rows: m,
        cols: k,
        rs: a.strides[ra - 2],
        cs: a.strides[ra - 1],
    };
    let gemm = sgemm_args((m, k, n), &adesc, &bdesc, n)?;
    let (a_offsets, b_offsets) = entry_offsets(sa, a, sb, b);
    let strided = match (even_stride(&a_offsets), even_stride(&b_offsets)) {
        (Some(x), Some(y)) if batch > 1 => Some((x, y)),
        _ => None,
    };
    Ok(MatmulPlan {
        gemm,
        a_offsets,
        b_offsets,
        c_stride: m * n,
        strided,
        empty_k: k == 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::codegen::cuda::text::THREADS;
    use kiln_compiler::codegen::cuda::MAX_GRID;

    #[test]
    fn dims_pack_first_and_zero_after() {
        let d = pack_dims(&[7, -3, 1 << 40]).unwrap();
        assert_eq!(&d.0[..4], &[7, -3, 1 << 40, 0]);
        assert!(d.0[3..].iter().all(|&x| x == 0));
        assert_eq!(std::mem::size_of::<KilnDims>(), 48 * 8);
        assert_eq!(MAX_DIMS, 48);
        let full: Vec<i64> = (0..48).collect();
        assert_eq!(pack_dims(&full).unwrap().0[47], 47);
        let e = pack_dims(&[0; 49]).unwrap_err();
        assert!(e.contains("49 dims") && e.contains("48"), "{e}");
    }

    #[test]
    fn grids_follow_the_work_kind() {
        assert_eq!(grid(Work::Threads, 0), None);
        assert_eq!(grid(Work::Threads, 1), Some((1, THREADS)));
        assert_eq!(grid(Work::Threads, 256), Some((1, 256)));
        assert_eq!(grid(Work::Threads, 257), Some((2, 256)));
        assert_eq!(grid(Work::Blocks, 5), Some((5, 256)));
        assert_eq!(grid(Work::Quads, 1), Some((1, 256)));
        assert_eq!(grid(Work::Quads, 1024), Some((1, 256)));
        assert_eq!(grid(Work::Quads, 1025), Some((2, 256)));
        assert_eq!(grid(Work::Warps, 8), Some((1, 256)));
        assert_eq!(grid(Work::Warps, 9), Some((2, 256)));
        let huge = (MAX_GRID as usize) * 1000;
        assert_eq!(grid(Work::Blocks, huge), Some((MAX_GRID as u32, 256)));
        assert_eq!(grid(Work::Threads, huge), Some((MAX_GRID as u32, 256)));
    }

    #[test]
    fn gpu_items_differ_from_the_cpu_where_documented() {
        // fill_rows: CPU items rows, GPU elements.
        assert_eq!(misc::rows_dims(3, 5), (vec![5], 3));
        assert_eq!(
            Launch::fill_rows(3, 5),
            Launch {
                dims: vec![5],
                items: 15
            }
        );
        assert_eq!(Launch::relu(1000).items, 1000);
        assert_eq!(Launch::relu(1000).dims, misc::relu_dims(1000).0);
        assert_eq!(Launch::adam(77).items, 77);
        assert_eq!(Launch::adam(77).dims, misc::adam_update_dims(77).0);
        // sum_rows: CPU items column groups, GPU chunks of 128 rows × tiles of 128 columns.
        let (s, f) = Launch::sum_rows(&[2, 300, 9]);
        assert_eq!(
            (s.dims.clone(), s.items),
            (misc::sum_rows_dims(&[2, 300, 9]).0, 5)
        );
        assert_eq!((f.dims, f.items), (s.dims, 1));
        assert_eq!(Launch::sum_rows(&[0, 40]).0.items, 1);
        assert_eq!(Launch::sum_rows(&[7, 300]).0.items, 3);
        assert_eq!(Launch::sum_rows(&[7, 65]).1.items, 3);
        // add_layer_norm_bwd_finish: CPU items columns, GPU tiles of dγ then dβ.
        let l = Launch::ln_bwd_finish(40, 70);
        assert_eq!(l.dims, rows::add_layer_norm_bwd_finish_dims(40, 70).0);
        assert_eq!(l.items, 6);
        assert_eq!(
            Launch::reduce(ReduceLayout::Across, 2, 3, 7),
            Launch {
                dims: vec![2, 3, 7],
                items: 14
            }
        );
        assert_eq!(Launch::reduce(ReduceLayout::Rows, 4, 6, 1).items, 4);
        let c = Launch::copy(&[2, 3], &[1, 2]);
        assert_eq!(c.items, 6);
        assert_eq!(c.dims, misc::copy_strided_dims(&[2, 3], &[1, 2]).0);
        let e = Launch::embed_pe([2, 5, 8], None, (1, 2));
        assert_eq!(e.items, 80);
        assert_eq!(e.dims, vec![8, 5]);
        assert_eq!(
            Launch::xent_count(6, 0),
            Launch {
                dims: vec![6, 0],
                items: 1
            }
        );
        assert_eq!(Launch::xent_finish(6).dims, vec![6]);
    }

    #[test]
    fn operands_map_to_cublas_ops() {
        // Row-major contiguous [3, 4]: cuBLAS reads it as its transpose, ld 4.
        let rm = MatDesc {
            rows: 3,
            cols: 4,
            rs: 4,
            cs: 1,
        };
        assert_eq!(
            blas_operand(&rm),
            Some(BlasOperand {
                trans: false,
                ld: 4
            })
        );
        // A transposed view of a contiguous [4, 3]: columns contiguous, ld 3.
        let tr = MatDesc {
            rows: 3,
            cols: 4,
            rs: 1,
            cs: 3,
        };
        assert_eq!(blas_operand(&tr), Some(BlasOperand { trans: true, ld: 3 }));
        // Rows of a wider buffer (a head of [t, h·d]): ld is the row stride.
        let padded = MatDesc {
            rows: 3,
            cols: 4,
            rs: 16,
            cs: 1,
        };
        assert_eq!(blas_operand(&padded).unwrap().ld, 16);
        // Broadcast rows (stride 0) or no unit stride: a copy.
        let bcast = MatDesc {
            rows: 3,
            cols: 4,
            rs: 0,
            cs: 1,
        };
        assert_eq!(blas_operand(&bcast), None);
        let both = MatDesc {
            rows: 3,
            cols: 4,
            rs: 8,
            cs: 2,
        };
        assert_eq!(blas_operand(&both), None);
        // One row: any row stride, ld = cols.
        let one = MatDesc {
            rows: 1,
            cols: 4,
            rs: 0,
            cs: 1,
        };
        assert_eq!(
            blas_operand(&one),
            Some(BlasOperand {
                trans: false,
                ld: 4
            })
        );
        // One column: its (unit) row stride serves as the transpose's ld.
        let col = MatDesc {
            rows: 5,
            cols: 1,
            rs: 1,
            cs: 0,
        };
        assert_eq!(
            blas_operand(&col),
            Some(BlasOperand {
                trans: false,
                ld: 1
            })
        );
        // Column-major storage with padding between columns: read as itself, ld = cs.
        let cm = MatDesc {
            rows: 5,
            cols: 2,
            rs: 1,
            cs: 8,
        };
        assert_eq!(blas_operand(&cm), Some(BlasOperand { trans: true, ld: 8 }));
        // A column stride smaller than the rows would overlap columns: a copy.
        let overlap = MatDesc {
            rows: 5,
            cols: 2,
            rs: 1,
            cs: 3,
        };
        assert_eq!(blas_operand(&overlap), None);
    }

    #[test]
    fn row_major_gemm_swaps_operands() {
        // C[2, 5] = A[2, 3]·B[3, 5], all contiguous: cuBLAS C'(5×2) = B'(5×3)·A'(3×2).
        let a = MatDesc {
            rows: 2,
            cols: 3,
            rs: 3,
            cs: 1,
        };
        let b = MatDesc {
            rows: 3,
            cols: 5,
            rs: 5,
            cs: 1,
        };
        assert_eq!(
            sgemm_args((2, 3, 5), &a, &b, 5),
            Ok(Sgemm {
                transa: false,
                transb: false,
                m: 5,
                n: 2,
                k: 3,
                lda: 5,
                ldb: 3,
                ldc: 5
            })
        );
        // q·kᵀ with k [5, 3] contiguous read transposed as B[3, 5] (rs 1, cs 3).
        let kt = MatDesc {
            rows: 3,
            cols: 5,
            rs: 1,
            cs: 3,
        };
        let g = sgemm_args((2, 3, 5), &a, &kt, 5).unwrap();
        assert_eq!((g.transa, g.transb, g.lda, g.ldb), (true, false, 3, 3));
        // Aᵀ·B with A stored [3, 2] (pᵀ·g in attention's backward).
        let at = MatDesc {
            rows: 2,
            cols: 3,
            rs: 1,
            cs: 2,
        };
        let g = sgemm_args((2, 3, 5), &at, &b, 5).unwrap();
        assert_eq!((g.transa, g.transb, g.lda, g.ldb), (false, true, 5, 2));
        let bad = MatDesc {
            rows: 3,
            cols: 5,
            rs: 0,
            cs: 1,
        };
        assert_eq!(
            sgemm_args((2, 3, 5), &a, &bad, 5),
            Err(Ok(NeedsCopy { a: false, b: true }))
        );
    }

    fn lay(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
        }
    }

    #[test]
    fn matmuls_merge_batch_or_stride_as_the_cpu_does() {
        // [2, 3, 4]·[4, 5] contiguous: one GEMM over 6 rows.
        let p = plan_matmul(&lay(&[2, 3, 4], &[12, 4, 1], 0), &lay(&[4, 5], &[5, 1], 7)).unwrap();
        assert_eq!((p.gemm.m, p.gemm.n, p.gemm.k), (5, 6, 4));
        assert_eq!((p.a_offsets, p.b_offsets), (vec![0], vec![7]));
        assert_eq!(p.strided, None);
        // Batched [2, 3, 4]·[2, 4, 5]: strided batched, strides 12 and 20.
        let p = plan_matmul(
            &lay(&[2, 3, 4], &[12, 4, 1], 0),
            &lay(&[2, 4, 5], &[20, 5, 1], 0),
        )
        .unwrap();
        assert_eq!(p.strided, Some((12, 20)));
        assert_eq!(p.c_stride, 15);
        assert_eq!((p.gemm.m, p.gemm.n), (5, 3));
        // A permuted left operand [b=2, h=3] whose batch axes do not merge into one
        // stride: a loop over the six products.
        let a = lay(&[2, 3, 4, 4], &[48, 4, 12, 1], 0);
        let b = lay(&[2, 3, 4, 4], &[48, 16, 4, 1], 0);
        let p = plan_matmul(&a, &b).unwrap();
        assert_eq!(p.strided, None);
        assert_eq!(p.a_offsets, vec![0, 4, 8, 48, 52, 56]);
        // A shared right operand with a non-mergeable left: strided with stride_b 0.
        let p = plan_matmul(&lay(&[2, 3, 4], &[4, 8, 1], 0), &lay(&[4, 5], &[5, 1], 0)).unwrap();
        assert_eq!(p.strided, Some((4, 0)));
        // A broadcast left operand cannot be read by cuBLAS.
        assert_eq!(
            plan_matmul(&lay(&[3, 4], &[0, 1], 0), &lay(&[4, 5], &[5, 1], 0)),
            Err(Ok(NeedsCopy { a: true, b: false }))
        );
        assert!(matches!(
            plan_matmul(&lay(&[3, 4], &[4, 1], 0), &lay(&[3, 5], &[5, 1], 0)),
            Err(Err(_))
        ));
        assert_eq!(even_stride(&[3, 5, 8]), None);
        assert_eq!(even_stride(&[9, 5]), None);
        assert_eq!(even_stride(&[4]), Some(0));
    }
}
