//! Matrix products with 16-bit operands and f32 accumulation: the CPU's mixed precision
//! (`--gemm-type 16bit`), opt-in. Three kernels share the packing and the driver here:
//!
//! - [`Kernel::Tiles`]: Intel AMX tiles (`TDPBF16PS`, 16 × 16 results and 32 terms each
//!   per instruction), on Xeons of the 4th generation on;
//! - [`Kernel::Dot`]: AVX-512's `VDPBF16PS` (16 results, 2 terms each per instruction),
//!   on AMD Zen 4 and later, where it multiplies-adds at twice the rate of f32 FMAs;
//! - [`Kernel::Half`]: AVX512-FP16's `VFMADD231PH` (32 fp16 multiply-adds per
//!   instruction, twice an f32 FMA's), on Intel Xeons of the 4th generation on whose VM
//!   hides their AMX.
//!
//! In: the same strided f32 operands as [`crate::gemm_one`]. For the first two,
//! each operand is rounded to bf16 (to nearest, ties to even, a subnormal to zero) as it
//! is packed, by AVX512-BF16's `VCVTNE2PS2BF16` (so all three kernels need it); the
//! products of pairs are summed in f32, so a result differs from the f32 product by about
//! the inputs' rounding, at most 2⁻⁹ relative per operand, as with PyTorch's bf16
//! autocast or cuBLAS in bf16. Both instructions treat subnormal bf16 inputs as zero and
//! flush subnormal results. For fp16, each row of `a` and column of `b` is first scaled
//! by a power of two so that no fp16 sum can overflow ([`fp16_scale`]), then rounded to
//! fp16 (2⁻¹¹ relative); sums of 64 terms are kept in fp16 and added up in f32, and the
//! scales are undone exactly at the end (see [`half_block`]).
//!
//! Every result element is summed over `k` in the same order whatever the threads, so a
//! product gives the same bits on every run and with any number of threads (the
//! kernels may differ from each other in the last bits).
//!
//! No well-kept crate offers these products on stable Rust (the `gemm` crate's kernels
//! are f32/f64/f16-through-f32; the `x86_amx_intrinsics` are nightly-only), so the eight
//! tile instructions used here are written as inline assembly; `VDPBF16PS` and
//! `VFMADD231PH` are stable intrinsics.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::{ColumnSums, Kernel16, Mat, SUM_AXES};
pub use crate::{Epilogue, Member};
mod amx;
mod avx512_bf16;
mod avx512_fp16;
mod blocks;
mod detect;
mod pack;
mod round;
mod scale;
mod sums;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_fp16;

use amx::*;
pub(crate) use amx::{store_tiles, zero_tiles, CONFIG as TILE_CONFIG};
use avx512_bf16::*;
use avx512_fp16::*;
use blocks::*;
pub(crate) use detect::*;
pub use pack::PackedRhs;
use pack::*;
pub(crate) use round::*;
use scale::*;
use sums::*;

/// Rows and columns of a result tile; the `k` of one tile product is 32 (bf16 pairs).
const T: usize = 16;
const TK: usize = 32;
/// bf16 elements of one packed tile (16 rows of 64 bytes).
const TILE: usize = T * TK;

#[derive(Clone, Copy)]
struct Out(*mut f32);
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not its field).
    fn get(&self) -> *mut f32 {
        self.0
    }
}

impl Epilogue {
    fn is_some(&self) -> bool {
        self.bias.is_some() || self.relu
    }
}

/// [`Epilogue`] on the `h × w` block at `c` (row stride `ld`), whose first column is
/// column `j` of the result.
///
/// # Safety
/// The CPU must have AVX-512F; `c` must address the block; a bias must hold columns
/// `j..j + w`.
#[target_feature(enable = "avx512f")]
unsafe fn finish_block(c: *mut f32, ld: isize, (h, w): (usize, usize), j: usize, e: Epilogue) {
    let zero = _mm512_setzero_ps();
    for q in (0..w).step_by(T) {
        let mask: u16 = if w - q >= T { !0 } else { (1 << (w - q)) - 1 };
        // SAFETY: the bias holds columns `j + q..` up to `j + w` (masked).
        let bias = e
            .bias
            .map(|b| unsafe { _mm512_maskz_loadu_ps(mask, b.add(j + q)) });
        for r in 0..h {
            // SAFETY: row `r` of the block holds `w` columns (masked past them).
            unsafe {
                let at = c.offset(r as isize * ld).add(q);
                let mut v = _mm512_maskz_loadu_ps(mask, at);
                if let Some(b) = bias {
                    v = _mm512_add_ps(v, b);
                }
                if e.relu {
                    // Kept where `v > 0` or `v` is NaN ("not less or equal", unordered).
                    let keep = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(v, zero);
                    v = _mm512_maskz_mov_ps(keep, v);
                }
                _mm512_mask_storeu_ps(at, mask, v);
            }
        }
    }
}

/// The right operand of [`gemm`]: strided f32, or packed beforehand.
#[derive(Clone, Copy)]
pub enum Rhs<'a> {
    Mat(Mat),
    /// Packed beforehand, with the matrix it was packed from (read by the int16 products
    /// where the other operand sends them to the f32 kernel).
    Packed(&'a PackedRhs, Mat),
}

/// `member`'s `dst[m, n] = (dst.read ? dst : 0) + a[m, k]·b[k, n]`, then the
/// [`Epilogue`] on each block (its bias added to the whole sum), with the
/// operands rounded to 16 bits and the sums in f32, with `kernel`'s instructions, over
/// rayon's threads: bf16 for the tiles and `VDPBF16PS`; fp16 for `VFMADD231PH`, each row
/// of `a` and column of `b` scaled by a power of two first ([`fp16_scale`]) and the
/// sums of every [`FLUSH_TILES`] · 16 terms in fp16. Where `sums` asks, also `b`'s
/// [`ColumnSums`], each column's by the task that packs it. [`Kernel16::Int16`]'s products
/// are [`crate::int16::gemm`]'s (and [`gemm_group`]'s, `crate::int16::gemm_group`'s).
///
/// # Safety
/// The kernel's check ([`tiles_available`], [`dot_available`], [`half_available`], or
/// int16's) must have returned `Ok`; every element the matrices address must be valid;
/// `dst` must not overlap `a`, `b`; a bias must hold `n` values; with `sums`, `b` must be a
/// row-major [`Rhs::Mat`] (`cs == 1`) and [`column_sums`]' conditions must hold.
pub unsafe fn gemm(kernel: Kernel16, (m, k): (usize, usize), a: Mat, member: Member<'_>) {
    if kernel.is_int16() {
        // SAFETY: as the caller's.
        return unsafe { crate::int16::gemm((m, k), a, member) };
    }
    let Member { n, b, sums, .. } = member;
    if kernel == Kernel16::Int8 {
        // SAFETY: as the caller's.
        return unsafe { crate::int8::gemm(m, k, a, member) };
    }
    if sums.is_some() {
        assert!(
            matches!(b, Rhs::Mat(b) if b.cs == 1),
            "column sums of a right operand that is not a row-major matrix"
        );
    }
    if m == 0 || n == 0 {
        if let (Some(sums), Rhs::Mat(b)) = (sums, b) {
            // SAFETY: as the caller's.
            unsafe { column_sums(b, 0..n, sums) };
        }
        return;
    }
    if let Rhs::Packed(p, _) = b {
        assert!(
            p.is(kernel, (k, n)),
            "a packed {}×{} operand (fp16: {}) for a {m}×{k}·{k}×{n} product with {kernel:?}",
            p.k,
            p.n,
            p.half
        );
    }
    if let Rhs::Mat(b) = b {
        let kb = k.div_ceil(TK).max(1);
        let cols_b = n.div_ceil(GROUP * T);
        let threads = rayon::current_num_threads();
        // Each thread's rows: at least 256, or packing `b` again costs what it saves.
        let parts = threads.min(m / (GROUP * T));
        // A narrow `b` small enough to pack on each thread (`local`), or too large for
        // that but with a long `k`: then each thread packs both operands a part of `k`
        // at a time (`stream`).
        let small = k * n <= LOCAL_B;
        let long = kb > K_TILES && K_TILES * TK * n <= LOCAL_B;
        if cols_b < 2 * threads && parts > 1 && (small || long) {
            let pad = member.bias_pad(kernel);
            let ops = member.blocks(kernel, kb, &pad);
            // SAFETY: as the caller's.
            unsafe {
                if small {
                    local((m, k), (a, b, parts), ops, sums)
                } else {
                    stream((m, k), (a, b, parts), ops, sums)
                }
            };
            return;
        }
    }
    // SAFETY: as the caller's.
    unsafe { general(kernel, (m, k), a, std::slice::from_ref(&member)) }
}

impl Member<'_> {
    /// With fp16 and a bias: the bias padded to the blocks' columns, for the fp16
    /// kernel's registers ([`half_block`]); else empty.
    fn bias_pad(&self, kernel: Kernel16) -> Vec<f32> {
        match self.epilogue.bias {
            // SAFETY: the caller's bias holds `n` values.
            Some(b) if kernel == Kernel16::Half => {
                let mut v = unsafe { std::slice::from_raw_parts(b, self.n) }.to_vec();
                v.resize(self.n.next_multiple_of(2 * T), 0.0);
                v
            }
            _ => Vec::new(),
        }
    }

    /// The product's [`Blocks`] over `kb` tiles of `k`, with its [`Member::bias_pad`].
    fn blocks<'p>(&self, kernel: Kernel16, kb: usize, bias_pad: &'p [f32]) -> Blocks<'p> {
        Blocks {
            kernel,
            kb,
            n: self.n,
            out: Out(self.dst.ptr),
            ld: self.dst.ld,
            read_dst: self.dst.read,
            epilogue: self.epilogue,
            bias_pad,
        }
    }
}

/// The products `a·b` of every member of `members` (see [`Member`]), each as [`gemm`]
/// computes it alone, with `a` (`m × k`) packed once for all: the attention's query,
/// key and value projections of one input, or the keys and values of every decoder
/// layer from the encoder's output, run as one product of their columns side by side.
/// The same sums as each member's own [`gemm`], so the same bits.
///
/// # Safety
/// As [`gemm`]'s for each member; no member's result overlaps another's, `a`, or any
/// member's `b`, bias or sums.
pub unsafe fn gemm_group(kernel: Kernel16, (m, k): (usize, usize), a: Mat, members: &[Member<'_>]) {
    if kernel.is_int16() {
        // SAFETY: as the caller's.
        return unsafe { crate::int16::gemm_group((m, k), a, members) };
    }
    if kernel == Kernel16::Int8 {
        // SAFETY: as the caller's.
        return unsafe { crate::int8::gemm_group((m, k), a, members) };
    }
    if let [one] = members {
        // SAFETY: as the caller's.
        return unsafe { gemm(kernel, (m, k), a, *one) };
    }
    for mb in members {
        match mb.b {
            Rhs::Packed(p, _) => assert!(
                p.is(kernel, (k, mb.n)) && mb.sums.is_none(),
                "a packed {}×{} operand (fp16: {}) in a group of {m}×{k} products with {kernel:?}",
                p.k,
                p.n,
                p.half
            ),
            Rhs::Mat(b) => assert!(
                mb.sums.is_none() || b.cs == 1,
                "column sums of a right operand that is not a row-major matrix"
            ),
        }
    }
    if m == 0 {
        for mb in members {
            if let (Some(sums), Rhs::Mat(b)) = (mb.sums, mb.b) {
                // SAFETY: as the caller's.
                unsafe { column_sums(b, 0..mb.n, sums) };
            }
        }
        return;
    }
    // SAFETY: as the caller's.
    unsafe { general(kernel, (m, k), a, members) }
}

/// [`gemm`] and [`gemm_group`] on the shared path: `a` packed once, by 16-row tiles (a
/// panel of `kb` tiles each; an odd count gets an all-zero panel beside it), then one
/// task a column group (256 columns of a member's `b`) and block of rows. A wide `b` is
/// packed by each task, its 256 columns (16 panels) into a buffer of its thread that
/// stays in the core's cache: the packed copy of the vocabulary projection's `b` (38 MB)
/// never goes to memory and back. Otherwise `b` is packed once and shared (below). In
/// fp16 each row's `1 / s` goes to `a_unscale`.
///
/// # Safety
/// As [`gemm_group`]'s; `m > 0`.
unsafe fn general(kernel: Kernel16, (m, k): (usize, usize), a: Mat, members: &[Member<'_>]) {
    let half = kernel == Kernel16::Half;
    let kb = k.div_ceil(TK).max(1);
    let mt = m.div_ceil(T);
    let panel = kb * TILE;
    let threads = rayon::current_num_threads();
    let mut lines_a = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
    // Every element is written by the packing below (zeros past the operand's edges).
    let pa = lines(&mut lines_a, mt.next_multiple_of(2) * panel);
    let mut a_unscale = if half {
        vec![1f32; mt.next_multiple_of(2) * T]
    } else {
        Vec::new()
    };
    // SAFETY: as the caller's.
    unsafe { pack_a_all(half, a, (m, k), panel, pa, &mut a_unscale) };
    // Tasks: the column groups of every member, each split into row blocks (multiples
    // of 32 rows) only as far as it takes to give every thread two tasks. Where there
    // are fewer column groups than that (a narrow `b`, which several tasks would pack
    // again), `b` is packed once beforehand and shared.
    // So is a `b` whose tasks would each stream a packed `a` too large for a core's
    // cache (over 2 MB): then the tasks are blocks of at most 256 rows. A `b` the caller
    // packed beforehand (`Rhs::Packed`) is read as a shared one. In fp16 the columns'
    // `1 / s` are in the shared scales for a shared `b`, else in each task's own.
    let groups: Vec<(usize, usize)> = members
        .iter()
        .enumerate()
        .flat_map(|(i, mb)| (0..mb.n).step_by(GROUP * T).map(move |j0| (i, j0)))
        .collect();
    let cols_b = groups.len();
    let share = cols_b < 2 * threads || pa.len() * 2 > 2 << 20;
    // Each member's `b` packed here to be shared, and its columns' `1 / s`.
    let mut packed_here: Vec<Option<(Vec<Line>, Vec<f32>)>> = Vec::with_capacity(members.len());
    for (i, mb) in members.iter().enumerate() {
        packed_here.push(match mb.b {
            Rhs::Mat(b) if share => {
                let mut buf = if i == 0 {
                    PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()))
                } else {
                    Vec::new()
                };
                let pb = lines(&mut buf, mb.n.div_ceil(T).next_multiple_of(2) * panel);
                // SAFETY: the kernel's check found AVX-512; `b` addresses `k × n`.
                let unscale = unsafe { pack_b_all(half, b, (k, mb.n), panel, pb, mb.sums) };
                Some((buf, unscale))
            }
            _ => None,
        });
    }
    // Each member's shared panels and scales (empty where its tasks pack their own).
    let shared: Vec<(&[u16], &[f32])> = members
        .iter()
        .zip(packed_here.iter_mut())
        .map(|(mb, here)| match (mb.b, here) {
            (Rhs::Packed(p, _), _) => (p.panels(), p.unscale.as_slice()),
            (_, Some((buf, unscale))) => {
                let len = mb.n.div_ceil(T).next_multiple_of(2) * panel;
                (&*lines(buf, len), unscale.as_slice())
            }
            _ => (&[][..], &[][..]),
        })
        .collect();
    let pads: Vec<Vec<f32>> = members.iter().map(|mb| mb.bias_pad(kernel)).collect();
    let ops: Vec<Blocks<'_>> = members
        .iter()
        .zip(&pads)
        .map(|(mb, pad)| mb.blocks(kernel, kb, pad))
        .collect();
    let rhs: Vec<(Rhs<'_>, Option<ColumnSums>)> =
        members.iter().map(|mb| (mb.b, mb.sums)).collect();
    let split = (2 * threads).div_ceil(cols_b).clamp(1, m.div_ceil(2 * T));
    let mut rows_per = m.div_ceil(split).next_multiple_of(2 * T);
    if shared.iter().any(|(pb, _)| !pb.is_empty()) {
        rows_per = rows_per.min(GROUP * T);
    }
    let rows_b = m.div_ceil(rows_per);
    let (ops, shared, rhs, groups) = (&ops, &shared, &rhs, &groups);
    let pa_ref = &pa;
    let a_unscale = &a_unscale;
    (0..rows_b * cols_b).into_par_iter().for_each(|task| {
        let (member, j0) = groups[task / rows_b];
        let (ops, (pb_shared, b_unscale), (b, sums)) = (&ops[member], shared[member], rhs[member]);
        let i0 = (task % rows_b) * rows_per;
        let (i1, j1) = ((i0 + rows_per).min(m), (j0 + GROUP * T).min(ops.n));
        let mut lines_b = Vec::new();
        // The columns' `1 / s` in fp16, from column `j0` on.
        let mut own_unscale = [1f32; GROUP * T];
        let own = pb_shared.is_empty();
        let (pb, b_unscale): (&[u16], &[f32]) = if let (true, Rhs::Mat(b)) = (own, b) {
            lines_b = PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()));
            let panels = (j1 - j0).div_ceil(T).next_multiple_of(2);
            let pb = lines(&mut lines_b, panels * panel);
            let u = &mut own_unscale[..panels * T];
            // SAFETY: the kernel's check found AVX-512; `b` addresses `k × n`.
            unsafe {
                if half {
                    pack_b_group::<true>(b, (k, ops.n), j0, u, (panel, pb))
                } else {
                    pack_b_group::<false>(b, (k, ops.n), j0, u, (panel, pb))
                }
            };
            // The columns' sums by the task of their first rows (each group's columns are
            // packed by every task of the group).
            if let (Some(sums), 0) = (sums, i0) {
                // SAFETY: as the caller's.
                unsafe { column_sums(b, j0..j1, sums) };
            }
            (pb, &own_unscale)
        } else {
            (
                &pb_shared[(j0 / T) * panel..],
                &b_unscale[j0.min(b_unscale.len())..],
            )
        };
        // SAFETY: the panels hold the task's rows and columns, packed above or before;
        // each task writes its own block of its member's result.
        unsafe {
            ops.run(
                (i0, i1, j0, j1),
                (&pa_ref[(i0 / T) * panel..], pb),
                (a_unscale.get(i0..).unwrap_or(&[]), b_unscale),
            )
        };
        if own {
            PACKED_B.with(|p| *p.borrow_mut() = lines_b);
        }
    });
    PACKED.with(|p| *p.borrow_mut() = lines_a);
    if let Some(Some((buf, _))) = packed_here.into_iter().next() {
        PACKED_B.with(|p| *p.borrow_mut() = buf);
    }
}

/// Packs `a` (`m × k`) into `pa` by 16-row tiles, `panel` values a tile, in parallel: by
/// groups of tiles where `a` is column-major (each task reads whole columns), else by
/// tile. In fp16 each row's `1 / s` goes to `a_unscale`.
///
/// # Safety
/// As [`general`]'s.
unsafe fn pack_a_all(
    half: bool,
    a: Mat,
    (m, k): (usize, usize),
    panel: usize,
    pa: &mut [u16],
    a_unscale: &mut [f32],
) {
    if a.rs == 1 && a.cs != 1 {
        let pack = |g: usize, out: &mut [u16], u: &mut [f32]| {
            let (i0, o) = (g * GROUP * T, (panel, out));
            // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k`, `rs == 1`.
            unsafe {
                if half {
                    pack_a_columns::<true>(a, (m, k), i0, u, o)
                } else {
                    pack_a_columns::<false>(a, (m, k), i0, u, o)
                }
            }
        };
        if half {
            pa.par_chunks_mut(GROUP * panel)
                .zip(a_unscale.par_chunks_mut(GROUP * T))
                .enumerate()
                .for_each(|(g, (out, u))| pack(g, out, u));
        } else {
            pa.par_chunks_mut(GROUP * panel)
                .enumerate()
                .for_each(|(g, out)| pack(g, out, &mut []));
        }
    } else {
        let pack = |i: usize, out: &mut [u16], u: &mut [f32]| {
            // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k`.
            unsafe {
                if half {
                    pack_a::<true>(a, (m, k), i * T, u, out)
                } else {
                    pack_a::<false>(a, (m, k), i * T, u, out)
                }
            }
        };
        if half {
            pa.par_chunks_mut(panel)
                .zip(a_unscale.par_chunks_mut(T))
                .enumerate()
                .for_each(|(i, (out, u))| pack(i, out, u));
        } else {
            pa.par_chunks_mut(panel)
                .enumerate()
                .for_each(|(i, out)| pack(i, out, &mut []));
        }
    }
}

/// Panels a packing task or a product task takes: 16 (256 rows or columns).
const GROUP: usize = 16;

/// Tiles of `k` (32 each) a product task runs all its blocks over at a time: 1024 values
/// of `k`, so that a task's 256 rows and 256 columns of them (1 MB in all, 16-bit) stay
/// in the core's second-level cache. (Parts of 256 or 128, which the first-level cache
/// would hold, were no faster on the AMX VM of 2026-11-29, and slowed the vocabulary's
/// products by a third.) Only a longer `k` is split (the vocabulary projection's
/// gradient, `k` 37000).
const K_TILES: usize = 32;
