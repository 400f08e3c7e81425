//! f32 products through the `gemm` crate: small single-threaded ones through
//! [`crate::small`], a transposed right operand of a large one copied row-major first.

use gemm::Parallelism;

use crate::transpose::transpose_into;
use crate::{Dst, Mat};

/// Products with fewer multiply-adds than this run single-threaded.
pub const PAR_MIN: usize = 1 << 16;

/// `dst[m, n] = (dst.read ? dst : 0) + a[m, k]·b[k, n]`.
///
/// # Safety
/// Every element the matrices address must be valid; `dst` must not overlap `a`, `b`.
pub unsafe fn gemm_one(
    (m, k, n): (usize, usize, usize),
    a: Mat,
    b: Mat,
    dst: Dst,
    par: Parallelism,
) {
    let Dst { ptr, ld, read } = dst;
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !read {
            for i in 0..m {
                for j in 0..n {
                    unsafe { *ptr.offset(i as isize * ld + j as isize) = 0.0 };
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
        unsafe { super::small::gemm((m, k, n), a, b, dst) };
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
            ptr,
            1,
            ld,
            read,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            if read { 1.0 } else { 0.0 },
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

/// One product of a single row, `dst[0, 0..n] = a[0, 0..k]·b[k, n]` (`a`'s row stride
/// unread), for [`gemm_rows`].
#[derive(Clone, Copy, Debug)]
pub struct RowProduct {
    pub a: Mat,
    pub b: Mat,
    pub dst: *mut f32,
}

unsafe impl Send for RowProduct {}
unsafe impl Sync for RowProduct {}

/// Each of `items` (`1 × k · k × n`), single-threaded, with the bits [`gemm_one`] gives
/// it alone (with [`Parallelism::None`]); where the CPU has AVX-512F, several at once
/// (`small/one_row.rs`: decoding's attention, one query a head).
///
/// # Safety
/// Each item's operands address their elements and its `dst` `n` of its own, overlapping
/// no operand.
pub unsafe fn gemm_rows((k, n): (usize, usize), items: &[RowProduct]) {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    if super::small::takes_rows(k, n) {
        // SAFETY: as the caller's; `takes_rows` checked the CPU and the sizes.
        unsafe { super::small::row_products((k, n), items) };
        return;
    }
    for it in items {
        let dst = Dst::new(it.dst, n as isize, false);
        // SAFETY: as the caller's.
        unsafe { gemm_one((1, k, n), it.a, it.b, dst, Parallelism::None) };
    }
}

pub fn parallelism(work: usize) -> Parallelism {
    if work >= PAR_MIN && rayon::current_num_threads() > 1 {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    }
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

#[cfg(test)]
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
                    let dst = Dst::new(out.as_mut_ptr(), n as isize, read_dst);
                    gemm_one((m, k, n), lhs, b, dst, Parallelism::Rayon(2))
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
