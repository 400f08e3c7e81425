//! Matrix products with int16 operands and int32 sums: AVX2's `VPMADDWD` (16 products of
//! 16-bit integers, summed in pairs into 8 int32 lanes, per instruction), for CPUs
//! without AVX-512 (AMD Zen 2 and Zen 3, Intel before Skylake-SP), where it
//! multiplies-adds at about 1.75 times the rate of f32 FMAs (measured 2026-11-28 on a
//! Zen 3 VM: 4.47 G `VPMADDWD` + `VPADDD` a second on one core, against 5.11 G
//! `VFMADD231PS`). Opt-in, as the other 16-bit kernels (`--gemm-type int16`,
//! `train.gemm_type: int16`): the fixed point of Marian's `intgemm16`, with a scale per row
//! and per column.
//!
//! In: the same strided f32 operands as [`crate::gemm_one`]. Each row of `a` and
//! each column of `b` is scaled by the power of two that brings its largest magnitude into
//! `(2047.5, 4095]` ([`exponent`]) and rounded to the nearest integer (ties to even): at
//! least 11 significant bits for the largest values, and an absolute error of at most
//! half a unit, `2⁻¹²` of the largest, for every other. The products of
//! pairs are summed exactly in int32, [`BLOCK`] pairs at a time (`2·64·4095² < 2³¹`, so no
//! sum can overflow), each block's sum converted to f32 and added up in f32 over a
//! [`KC`]-pair part of `k`; the scales are undone exactly (`× 2^-e_a × 2^-e_b`) and the
//! parts added into `dst` in order. A row or column holding an infinity or a NaN sends
//! the whole product to the f32 kernel instead, so these propagate as in f32.
//!
//! Every result element is computed in the same order whatever the threads, so a product
//! gives the same bits on every run and with any number of threads.
//!
//! No well-kept crate multiplies int16 matrices on stable Rust (the `gemm` crate's
//! kernels are floating point); the inner loop is inline assembly so that its sixteen
//! vector registers hold exactly the 6 × 16 tile's twelve accumulators, the two vectors of
//! `b` and the broadcast of `a` and its two products.

use std::arch::x86_64::*;

use rayon::prelude::*;

use crate::float16::Rhs;
use crate::{ColumnSums, Mat, Member, SUM_AXES};
mod avx2;
mod quantize;
#[cfg(test)]
mod tests;

pub(crate) use avx2::relu;
use avx2::*;
use quantize::*;
pub(crate) use quantize::{column_sums, max_abs};

/// The largest magnitude after scaling.
const LIMIT: f32 = 4095.0;
/// Pairs summed in int32 before the f32 sum: `2 · BLOCK · LIMIT² < 2³¹`.
const BLOCK: usize = 64;
const _: () = assert!(2 * BLOCK as u64 * 4095 * 4095 < 1 << 31);
/// Pairs of one part of `k`: a panel of `b` is `KC · 64` bytes (16 KiB), in L1.
const KC: usize = 256;
/// Rows of `a` and columns of `b` of one tile.
const MR: usize = 6;
const NR: usize = 16;
/// Rows of `a` whose part of `k` the threads share while they run their panels (in L2).
const MC: usize = 240;

/// Whether this CPU runs the kernel: AVX2 (and FMA, which every AVX2 CPU has).
pub(crate) fn available() -> Result<(), &'static str> {
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        Ok(())
    } else {
        Err("this CPU has no AVX2")
    }
}

/// Whether the kernel multiplies-adds faster than f32 here: AVX2 without AVX-512F (with
/// AVX-512, an f32 FMA does 16 multiply-adds, as many as a `VPMADDWD` of 256 bits).
pub(crate) fn faster_than_f32() -> Result<(), &'static str> {
    available()?;
    if is_x86_feature_detected!("avx512f") {
        return Err("with AVX-512, f32 FMAs multiply-add as fast as AVX2's VPMADDWD");
    }
    Ok(())
}

/// The exponent `e` that scales a row or column whose largest magnitude is `max`: the
/// largest with `max · 2^e ≤ 4095`, at most 127 (so that `2^e` and `2^-e` are f32 values;
/// a row of magnitudes below `2⁻¹¹⁵` keeps fewer bits). 0 for a row of zeros.
pub(crate) fn exponent(max: f32) -> i32 {
    if max == 0.0 {
        return 0;
    }
    let m = max as f64;
    // ⌊log₂ m⌋ from the exponent field: every f32, subnormal or not, is a normal f64.
    let log2 = ((m.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let mut e = 11 - log2;
    if m * pow2_f64(e) > LIMIT as f64 {
        e -= 1;
    }
    e.min(127)
}

/// `2^e` as f64, for `-1022 ≤ e ≤ 1023`: its exponent field (`powi`, a call for each
/// row and column of every product, was 0.3 % of a training step).
fn pow2_f64(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// `2^e` as f32, for `-149 ≤ e ≤ 127` (exact: a power of two in f32's range).
fn pow2(e: i32) -> f32 {
    pow2_f64(e) as f32
}

/// How an operand was packed into its int16 buffer: panels of [`MR`] rows or [`NR`]
/// columns, `ld` int16 a row or column (`k` rounded up to pairs, zero past `k`; padding
/// rows and columns hold whatever the buffer held, and their results are never stored);
/// the rows' or columns' exponents.
struct Quantized {
    ld: usize,
    exps: Vec<i32>,
}

/// `v` holding `len` values: what it held where it did, zeros past that (a buffer reused
/// between products, so that large ones do not map and clear fresh pages every time).
fn sized(v: &mut Vec<i16>, len: usize) -> &mut [i16] {
    if v.len() < len {
        v.resize(len, 0);
    }
    &mut v[..len]
}

/// Buffers of one thread's products: the operands' int16 panels (`b`'s, one a member of
/// a group).
#[derive(Default)]
struct Scratch {
    qa: Vec<i16>,
    qb: Vec<Vec<i16>>,
}

thread_local! {
    /// Taken out while a product runs (so a product inside another allocates its own).
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// A right operand `[k, n]` quantized once, for the products that read it while it is
/// unchanged (an inference program's weights, `Compiled::packed_weight`): its panels of
/// [`NR`] columns and the columns' `2^-e`. The same values as quantizing it for each
/// product, so the same bits.
pub(crate) struct Panels {
    k: usize,
    n: usize,
    ld: usize,
    inv: Vec<f32>,
    q: Vec<i16>,
}

impl Panels {
    /// `b` (`k × n`) quantized over rayon's threads; `None` where its strides are not the
    /// kernel's or a column holds an infinity or a NaN (its products then read it as it
    /// is and go to the f32 kernel).
    ///
    /// # Safety
    /// [`available`] must have returned `Ok`; `b` must address `k × n` valid elements.
    pub(crate) unsafe fn new(b: Mat, (k, n): (usize, usize)) -> Option<Panels> {
        if k == 0 || n == 0 {
            return None;
        }
        let mut q = Vec::new();
        // SAFETY: as the caller's.
        let quantized = unsafe { panels::<NR>(b.ptr, (b.cs, b.rs), (n, k), &mut q, None) }?;
        Some(Panels {
            k,
            n,
            ld: quantized.ld,
            inv: quantized.exps.iter().map(|&e| pow2(-e)).collect(),
            q,
        })
    }

    /// Whether it is a quantized `[k, n]` operand.
    pub(crate) fn is(&self, (k, n): (usize, usize)) -> bool {
        (self.k, self.n) == (k, n)
    }

    /// Its size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.q.len() * 2 + self.inv.len() * 4
    }
}

/// `one`'s `dst[m, n] = (dst.read ? dst : 0) + a[m, k]·b[k, n]`, then the
/// [`Epilogue`] (its bias added to the whole sum), with int16 operands (see the module's
/// comment), and `b`'s [`ColumnSums`] where asked. A member whose operands are neither
/// row-major nor stored transposed, or hold an infinity or a NaN, goes to the f32 kernel.
///
/// # Safety
/// As [`gemm_group`]'s for the one member.
pub(crate) unsafe fn gemm((m, k): (usize, usize), a: Mat, one: Member<'_>) {
    // SAFETY: as the caller's.
    unsafe { gemm_group((m, k), a, std::slice::from_ref(&one)) }
}

/// The products `a·b` of every member of `members` (see [`Member`]), each as [`gemm`]
/// computes it alone, with `a` (`m × k`) quantized once for all and the members' columns
/// run side by side: the same sums as each member's own [`gemm`], so the same bits.
///
/// # Safety
/// [`available`] must have returned `Ok`; as [`crate::gemm_one`] for each member,
/// whose bias holds `n` values and whose sums (of a row-major `b`, `k` the product of
/// their `lead`) `n`; no member's result overlaps another's, `a`, or any member's `b`,
/// bias or sums; a packed `b` is one of `k × n` for this kernel.
pub(crate) unsafe fn gemm_group((m, k): (usize, usize), a: Mat, members: &[Member<'_>]) {
    let mut scratch = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    // SAFETY: as the caller's.
    unsafe { general((m, k), a, members, &mut scratch) };
    SCRATCH.with(|s| *s.borrow_mut() = scratch);
}

/// A member's `b` as a matrix (a packed one's too: the f32 kernel reads it).
fn matrix(b: Rhs<'_>) -> Mat {
    match b {
        Rhs::Mat(b) | Rhs::Packed(_, b) => b,
    }
}

/// One member as the f32 kernel computes it: the product, the [`Epilogue`] as a pass
/// after it, and the column sums.
///
/// # Safety
/// As [`gemm_group`]'s for the member.
pub(crate) unsafe fn f32_member((m, k): (usize, usize), a: Mat, mb: &Member<'_>) {
    let (n, b) = (mb.n, matrix(mb.b));
    let par = crate::parallelism(m * k * n);
    // SAFETY: as the caller's.
    unsafe { crate::gemm_one((m, k, n), a, b, mb.dst, par) };
    let e = mb.epilogue;
    if e.bias.is_some() || e.relu {
        // SAFETY: the caller's bias holds `n` values.
        let bias = e.bias.map(|p| unsafe { std::slice::from_raw_parts(p, n) });
        for i in 0..m {
            // SAFETY: row `i` of the result holds `n` values.
            let row = unsafe {
                std::slice::from_raw_parts_mut(mb.dst.ptr.offset(i as isize * mb.dst.ld), n)
            };
            for (j, v) in row.iter_mut().enumerate() {
                if let Some(bias) = bias {
                    *v += bias[j];
                }
                if e.relu {
                    *v = relu(*v);
                }
            }
        }
    }
    if let Some(s) = mb.sums {
        // SAFETY: as the caller's (a row-major `b` where sums are asked).
        unsafe { column_sums(b, (k, n), s) };
    }
}

/// The kernel's panels of `W` lines of `k` values: line `i`'s value `p` at
/// `ptr + i·line + p·step`. From the lines where their values are contiguous
/// ([`quantize_rows`]), else from the rows of the matrix they are the columns of
/// ([`pack_columns`]); `None` for other strides, or where a line holds an infinity or a
/// NaN. Where `sums` asks (only of lines that are the columns of a row-major matrix),
/// also their sums, whatever the result.
///
/// # Safety
/// `ptr` must address every value at those strides; as [`pack_columns`]' for `sums`.
unsafe fn panels<const W: usize>(
    ptr: *const f32,
    (line, step): (isize, isize),
    (lines, k): (usize, usize),
    buf: &mut Vec<i16>,
    sums: Option<ColumnSums>,
) -> Option<Quantized> {
    let rows = |rs: isize| Mat { ptr, rs, cs: 1 };
    let (by_rows, by_columns) = (step == 1 || k == 1, line == 1 || lines == 1);
    // SAFETY (all): as the caller's, read with the strides given here.
    if by_columns && (!by_rows || sums.is_some()) {
        unsafe { pack_columns::<W>(rows(step), (k, lines), buf, sums) }
    } else if by_rows {
        unsafe { quantize_rows::<W>(rows(line), (lines, k), buf) }
    } else {
        None
    }
}

/// A member's quantized `b`: its panels (`ld` int16 a column), the columns' `2^-e`.
struct Quantized16<'a> {
    q: &'a [i16],
    ld: usize,
    inv: std::borrow::Cow<'a, [f32]>,
}

/// [`gemm_group`] with `scratch`'s buffers.
///
/// # Safety
/// As [`gemm_group`]'s.
unsafe fn general((m, k): (usize, usize), a: Mat, members: &[Member<'_>], scratch: &mut Scratch) {
    // SAFETY (all `f32_member`s): as the caller's.
    let to_f32 = |mb: &Member<'_>| unsafe { f32_member((m, k), a, mb) };
    // `a`'s lines are its rows (a line's values `a.cs` apart).
    let qa = if m == 0 || k == 0 {
        None
    } else {
        // SAFETY: `a` addresses its elements (the caller's contract).
        unsafe { panels::<MR>(a.ptr, (a.rs, a.cs), (m, k), &mut scratch.qa, None) }
    };
    let Some(qa) = qa else {
        members.iter().for_each(to_f32);
        return;
    };
    if scratch.qb.len() < members.len() {
        scratch.qb.resize_with(members.len(), Vec::new);
    }
    // Each member's `b` quantized here (its exponents), or packed beforehand; `None` for
    // a member that goes to the f32 kernel (run below, after the others).
    enum Got<'p> {
        Here(Quantized),
        Packed(&'p Panels),
    }
    let mut got: Vec<Option<Got<'_>>> = Vec::with_capacity(members.len());
    for (mb, buf) in members.iter().zip(scratch.qb.iter_mut()) {
        got.push(match mb.b {
            _ if mb.n == 0 => None,
            // (Column sums are asked of a matrix read in place, not of a packed one; were
            // they, the f32 kernel's member would take them.)
            Rhs::Packed(p, _) => match p.int16() {
                Some(p) if p.is((k, mb.n)) && mb.sums.is_none() => Some(Got::Packed(p)),
                _ => None,
            },
            // `b`'s lines are its columns.
            // SAFETY: `b` addresses its elements; sums as the caller's.
            Rhs::Mat(b) => unsafe {
                panels::<NR>(b.ptr, (b.cs, b.rs), (mb.n, k), buf, mb.sums).map(Got::Here)
            },
        });
    }
    let views: Vec<Option<Quantized16<'_>>> = got
        .iter()
        .zip(&scratch.qb)
        .map(|(g, buf)| match g {
            None => None,
            Some(Got::Here(qb)) => Some(Quantized16 {
                q: buf.as_slice(),
                ld: qb.ld,
                inv: qb.exps.iter().map(|&e| pow2(-e)).collect(),
            }),
            Some(Got::Packed(p)) => Some(Quantized16 {
                q: &p.q,
                ld: p.ld,
                inv: std::borrow::Cow::Borrowed(&p.inv),
            }),
        })
        .collect();
    let inv_a: Vec<f32> = qa.exps.iter().map(|&e| pow2(-e)).collect();
    // Tasks: every column panel of every member quantized, side by side.
    let tasks = crate::mat::panel_tasks(&views, members, NR);
    let pairs = k.div_ceil(2);
    let qa_buf = &scratch.qa;
    let threads = rayon::current_num_threads();
    for p0 in (0..pairs).step_by(KC) {
        let p1 = (p0 + KC).min(pairs);
        for i0 in (0..m).step_by(MC) {
            let i1 = (i0 + MC).min(m);
            let run = |&(i, t): &(usize, usize)| {
                let (mb, Some(v)) = (&members[i], &views[i]) else {
                    return;
                };
                let j0 = t * NR;
                let w = NR.min(mb.n - j0);
                let panel = &v.q[t * NR * v.ld..(t + 1) * NR * v.ld];
                let finish = (p1 == pairs).then(|| Finish {
                    // SAFETY: the caller's bias holds `n` values.
                    bias: mb
                        .epilogue
                        .bias
                        .map(|b| unsafe { std::slice::from_raw_parts(b.add(j0), w) }),
                    relu: mb.epilogue.relu,
                });
                let fresh = p0 == 0 && !mb.dst.read;
                let mut acc = [0f32; 96];
                for r0 in (i0..i1).step_by(MR) {
                    let rows = MR.min(i1 - r0);
                    // The tile's rows of the result fetched while it computes: their stores
                    // had missed the caches (`store` took 4 % of a step; with this, products
                    // of 800 × 512 · 512 × 512 to 800 × 2048 · 2048 × 512 took 2–8 % less
                    // time, 2026-11-29).
                    for r in r0..r0 + rows {
                        // SAFETY: columns `j0` and `j0 + w - 1` of row `r < m` of the
                        // member's result.
                        unsafe {
                            let row = mb.dst.ptr.offset(r as isize * mb.dst.ld);
                            _mm_prefetch::<_MM_HINT_ET0>(row.add(j0) as *const i8);
                            _mm_prefetch::<_MM_HINT_ET0>(row.add(j0 + w - 1) as *const i8);
                        }
                    }
                    // SAFETY: `qa` holds whole tiles of rows of `ld` int16 (`pairs`
                    // pairs); the panel holds `pairs` lanes; the CPU has AVX2.
                    unsafe {
                        tile(
                            qa_buf.as_ptr().add(r0 * qa.ld + 2 * MR * p0),
                            panel.as_ptr().add(2 * NR * p0),
                            p1 - p0,
                            &mut acc,
                        )
                    };
                    let scales = (&inv_a[r0..r0 + rows], &v.inv[j0..j0 + w]);
                    // SAFETY: rows `r0..r0 + rows` (< m) and columns `j0..j0 + w` of the
                    // member's result; each task writes only its own columns; the CPU has
                    // AVX2.
                    unsafe {
                        let d = mb.dst.ptr.offset(r0 as isize * mb.dst.ld).add(j0);
                        store(&acc, scales, (d, mb.dst.ld), fresh, finish)
                    };
                }
            };
            if threads > 1 && tasks.len() > 1 {
                tasks.par_iter().for_each(run);
            } else {
                tasks.iter().for_each(run);
            }
        }
    }
    for (mb, v) in members.iter().zip(&views) {
        if v.is_none() && mb.n > 0 {
            to_f32(mb);
        }
    }
}
