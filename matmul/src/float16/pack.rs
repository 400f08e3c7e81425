//! Packing f32 operands into 16-bit panels of tile rows, and right operands packed once
//! beforehand ([`PackedRhs`]).

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::*;

/// Packs rows `[i0, i0 + 16)` of `a` (`m × k`) as `kb` tiles of 16 rows × 32 16-bit
/// values ([`to16`]), zero past `m` and `k`. Where `HALF`, each row is scaled by its
/// [`fp16_scale`] (`TOP_A`), whose `1 / s` goes to `unscale` (one a row, 1 past `m`).
///
/// # Safety
/// The CPU must have AVX-512F, BW and BF16; `a` must address `m × k` valid elements; `out`
/// holds `kb · TILE`; with `HALF`, `unscale` holds 16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_a<const HALF: bool>(
    a: Mat,
    (m, k): (usize, usize),
    i0: usize,
    unscale: &mut [f32],
    out: &mut [u16],
) {
    let rows = m.saturating_sub(i0).min(T);
    let unscale = if HALF { &mut unscale[..T] } else { unscale };
    // SAFETY: `a` addresses the tile's rows, `k` elements each; as the caller's.
    unsafe {
        with_line_scales::<HALF>((a, i0..i0 + rows, k, TOP_A), unscale, |scale| {
            pack_a_scaled::<HALF>(a, (m, k), i0, scale, out)
        })
    }
}

/// [`pack_a`] with the rows' scales given (`scale[r]` for row `i0 + r`; unread unless
/// `HALF`).
///
/// # Safety
/// As [`pack_a`]'s; `scale` holds 16 values.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_a_scaled<const HALF: bool>(
    a: Mat,
    (m, k): (usize, usize),
    i0: usize,
    scale: &[f32],
    out: &mut [u16],
) {
    let kb = out.len() / TILE;
    let rows = m.saturating_sub(i0).min(T);
    let scale = &scale[..T];
    if a.cs != 1 {
        // Strided: element by element (a transposed `a` takes `pack_a_columns`).
        out.fill(0);
        for p in 0..k {
            let (t, q) = (p / TK, p % TK);
            let col = unsafe { a.ptr.offset(i0 as isize * a.rs + p as isize * a.cs) };
            for (r, &s) in scale.iter().enumerate().take(rows) {
                let x = unsafe { *col.offset(r as isize * a.rs) };
                out[t * TILE + r * TK + q] = to16::<HALF>(x, s);
            }
        }
        return;
    }
    for (r, &s) in scale.iter().enumerate() {
        if r >= rows {
            for t in 0..kb {
                out[t * TILE + r * TK..t * TILE + (r + 1) * TK].fill(0);
            }
            continue;
        }
        // SAFETY: row `i0 + r` of `a` holds `k` elements (and is in the first-level cache
        // after its scan, where `HALF`).
        let row = unsafe { std::slice::from_raw_parts(a.ptr.offset((i0 + r) as isize * a.rs), k) };
        for t in 0..kb {
            let dst = &mut out[t * TILE + r * TK..t * TILE + (r + 1) * TK];
            let src = &row[(t * TK).min(k)..((t + 1) * TK).min(k)];
            if src.len() < TK {
                dst.fill(0);
            }
            unsafe { convert::<HALF>(src, s, dst) };
        }
    }
}

/// Packs the row tiles of `a` from row `i0` on into `out` (whole panels of `kb` tiles,
/// as [`pack_a`]) where `a` is stored transposed (`rs == 1`: each `k` index is a row of
/// `m` contiguous elements, as the input of a weight gradient `xᵀ·dy`). It reads each of
/// those rows a whole group of panels wide (contiguous, which the prefetchers follow),
/// where [`pack_a`] would read 64 bytes of each row per panel.
///
/// Where `HALF`, each row is scaled by its [`fp16_scale`] (`TOP_A`), found from a first
/// pass over the group's rows (which leaves them in the core's cache for the second),
/// and its `1 / s` goes to `unscale` (one a row of the group, 1 past `m`).
///
/// # Safety
/// The CPU must have AVX-512F, BW and BF16; `a` must address `m × k` valid elements with
/// `a.rs == 1`; with `HALF`, `unscale` holds a value for each row of `out`'s panels.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_a_columns<const HALF: bool>(
    a: Mat,
    (m, k): (usize, usize),
    i0: usize,
    unscale: &mut [f32],
    (panel, out): (usize, &mut [u16]),
) {
    let rows = m.saturating_sub(i0).min(out.len() / panel * T);
    // SAFETY: `a` addresses the group's rows, `k` elements each; as the caller's.
    unsafe {
        with_line_scales::<HALF>((a, i0..i0 + rows, k, TOP_A), unscale, |scale| {
            pack_a_columns_scaled::<HALF>(a, (m, k), i0, scale, (panel, out))
        })
    }
}

/// `pack(scale)` with the fp16 scales of rows `rows` of `a` (at most 256; [`line_scales`]
/// over `k`, largest magnitude brought below `2^top`) where `HALF`: `scale[r]` the `s` of
/// row `rows.start + r` (1 past the rows), `unscale[r]` its `1 / s`. Without `HALF`
/// every scale is 1 and `unscale` is left alone.
///
/// # Safety
/// As [`line_scales`]' where `HALF`; `unscale` holds a value for each row `pack` reads.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn with_line_scales<const HALF: bool>(
    (a, rows, k, top): (Mat, std::ops::Range<usize>, usize, i32),
    unscale: &mut [f32],
    pack: impl FnOnce(&[f32]),
) {
    let mut scale = [1f32; GROUP * T];
    if HALF {
        unscale.fill(1.0);
        // SAFETY: the caller's.
        unsafe { line_scales(a, rows, k, top, (&mut scale, unscale)) };
    }
    pack(&scale)
}

/// [`pack_a_columns`] with the rows' scales given (`scale[r]` for row `i0 + r`, one for
/// each row of `out`'s panels, padded to a multiple of 16; unread unless `HALF`).
///
/// # Safety
/// As [`pack_a_columns`]'s; `scale` holds a value for each row of `out`'s panels.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_a_columns_scaled<const HALF: bool>(
    a: Mat,
    (m, k): (usize, usize),
    i0: usize,
    scale: &[f32],
    (panel, out): (usize, &mut [u16]),
) {
    let rows = m.saturating_sub(i0).min(out.len() / panel * T);
    let kb = panel / TILE;
    // SAFETY (the slices of `a` below): index `p` holds the `m` elements of its row.
    let src = |p: usize| unsafe {
        std::slice::from_raw_parts(a.ptr.offset(p as isize * a.cs).add(i0), rows)
    };
    // By 32 `k` indices (a tile's) and 16 rows: the rows' 16 values at each index, as
    // 16-bit, paired by index (even in the low half), transposed into the tile's 16 rows
    // of 16 pairs.
    for t in 0..kb {
        for r0 in (0..rows.next_multiple_of(T)).step_by(T) {
            let mask: u16 = if rows - r0 >= T {
                !0
            } else {
                (1 << (rows - r0)) - 1
            };
            let s = if HALF {
                // SAFETY: `scale` holds the panels' rows.
                unsafe { _mm512_loadu_ps(scale.as_ptr().add(r0)) }
            } else {
                _mm512_set1_ps(1.0)
            };
            let value = |q: usize| {
                let p = t * TK + q;
                if p >= k {
                    return _mm512_setzero_ps();
                }
                // SAFETY: index `p` holds rows `i0 + r0..` up to `rows` (masked).
                unsafe { _mm512_maskz_loadu_ps(mask, src(p).as_ptr().add(r0)) }
            };
            let z: [__m512i; 16] =
                std::array::from_fn(|j| pairs16x16::<HALF>(value(2 * j), value(2 * j + 1), s));
            let tile = &mut out[(r0 / T) * panel + t * TILE..][..TILE];
            for (r, row) in transpose16(&z).iter().enumerate() {
                // SAFETY: row `r` of the tile is 16 pairs, 64 bytes.
                unsafe { _mm512_storeu_si512(tile.as_mut_ptr().add(r * TK) as *mut _, *row) };
            }
        }
    }
    // Row tiles past `m` (the group's last panels) are zero.
    for r0 in (rows.next_multiple_of(T)..out.len() / panel * T).step_by(T) {
        out[(r0 / T) * panel..(r0 / T + 1) * panel].fill(0);
    }
}

/// Packs columns `[j0, j0 + 16)` of `b` (`k × n`) as `kb` tiles of 16 pair rows: row `r`
/// of tile `t` holds `b[32t + 2r, j], b[32t + 2r + 1, j]` for its 16 columns `j` (the
/// pairs `TDPBF16PS` multiplies), as 16-bit values ([`to16`]; where `HALF`, each column
/// scaled by its `scales[c]`, `c` from 0 at `j0`), zero past `k` and `n`. (A row-major
/// `b` a whole tile wide is packed by [`pack_b_group_scaled`], a group of panels at once.)
///
/// # Safety
/// The CPU must have AVX-512F, BW and BF16; `b` must address `k × n` valid elements; `out`
/// holds `kb · TILE`; with `HALF`, `scales` holds 16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_b<const HALF: bool>(
    b: Mat,
    (k, n): (usize, usize),
    j0: usize,
    scales: &[f32],
    out: &mut [u16],
) {
    let cols = n.saturating_sub(j0).min(T);
    let at = |p: usize, j: usize| unsafe { *b.ptr.offset(p as isize * b.rs + j as isize * b.cs) };
    let s = |j: usize| if HALF { scales[j - j0] } else { 1.0 };
    if b.rs == 1 {
        // Stored transposed: a column's `k` values are contiguous. By tile: each column's
        // 32 values, as 16-bit, are 16 pairs; transposed, the tile's 16 pair rows.
        let kb = out.len() / TILE;
        for t in 0..kb {
            let z: [__m512i; 16] = std::array::from_fn(|c| {
                if c >= cols {
                    return _mm512_setzero_si512();
                }
                let s = _mm512_set1_ps(s(j0 + c));
                let half = |h: usize| {
                    let p = t * TK + h * T;
                    let left = k.saturating_sub(p).min(T);
                    let mask: u16 = if left == T { !0 } else { (1 << left) - 1 };
                    // SAFETY: column `j0 + c` holds `k` elements (masked past them).
                    let x = unsafe {
                        _mm512_maskz_loadu_ps(mask, b.ptr.offset((j0 + c) as isize * b.cs).add(p))
                    };
                    to16x16::<HALF>(x, s)
                };
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(half(0)), half(1))
            });
            for (j, row) in transpose16(&z).iter().enumerate() {
                // SAFETY: pair row `j` of tile `t` is 64 bytes of `out`.
                unsafe {
                    _mm512_storeu_si512(out.as_mut_ptr().add(t * TILE + j * TK) as *mut _, *row)
                };
            }
        }
        return;
    }
    out.fill(0);
    for p in 0..k {
        let base = (p / TK) * TILE + ((p % TK) / 2) * TK + (p & 1);
        for c in 0..cols {
            out[base + 2 * c] = to16::<HALF>(at(p, j0 + c), s(j0 + c));
        }
    }
}

/// Packs the column panels of `out` (whole panels of `panel` elements) from column `j0`
/// on. A row-major `b` is packed by pairs of rows, each row read the group's width at once
/// (contiguous, which the prefetchers follow) where one panel at a time would read 64
/// bytes of each row (the vocabulary projection's rows are 148 KB apart).
///
/// Where `HALF`, each column is scaled by its [`fp16_scale`] (`TOP_B`), found from a
/// first pass over the group's columns, and its `1 / s` goes to `unscale` (one a column
/// of the group, 1 past `n`).
///
/// # Safety
/// As [`pack_b`]; with `HALF`, `unscale` holds a value for each column of `out`'s panels.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_b_group<const HALF: bool>(
    b: Mat,
    (k, n): (usize, usize),
    j0: usize,
    unscale: &mut [f32],
    (panel, out): (usize, &mut [u16]),
) {
    let cols = n.saturating_sub(j0).min(out.len() / panel * T);
    // `b`'s columns are the rows of `bᵀ`.
    let bt = b.transposed();
    // SAFETY: `b` addresses the group's columns, `k` elements each; as the caller's.
    unsafe {
        with_line_scales::<HALF>((bt, j0..j0 + cols, k, TOP_B), unscale, |scale| {
            pack_b_group_scaled::<HALF>(b, (k, n), j0, scale, (panel, out))
        })
    }
}

/// [`pack_b_group`] with the columns' scales given (`scale[c]` for column `j0 + c`, one
/// for each column of `out`'s panels; unread unless `HALF`).
///
/// # Safety
/// As [`pack_b`]'s; `scale` holds a value for each column of `out`'s panels.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_b_group_scaled<const HALF: bool>(
    b: Mat,
    (k, n): (usize, usize),
    j0: usize,
    scale: &[f32],
    (panel, out): (usize, &mut [u16]),
) {
    let kb = panel / TILE;
    // Row-major panels a whole tile wide (the first `wide`): by pairs of rows, each row
    // read the width of those panels at once, its two rows' 16 columns of each panel
    // interleaved into the panel's pair row.
    let wide = if b.cs == 1 {
        (n.saturating_sub(j0) / T).min(out.len() / panel)
    } else {
        0
    };
    if wide > 0 {
        let width = wide * T;
        for pair in 0..kb * T {
            let p = 2 * pair;
            if p + 1 >= k {
                for q in 0..wide {
                    let dst = &mut out[q * panel + pair * 2 * T..][..2 * T];
                    for (c, d) in dst.chunks_exact_mut(2).enumerate() {
                        // SAFETY: row `p` (where `p < k`) holds columns `j0..j0 + width`.
                        let x = (p < k).then(|| unsafe {
                            *b.ptr.offset(p as isize * b.rs).add(j0 + q * T + c)
                        });
                        d[0] = x.map_or(0, |x| to16::<HALF>(x, scale[q * T + c]));
                        d[1] = 0;
                    }
                }
                continue;
            }
            // SAFETY: rows `p`, `p + 1` hold columns `j0..j0 + width`; `out` holds the
            // panels' pair rows, 64 bytes each; `scale` a value for each column.
            unsafe {
                let out_ptr = out.as_mut_ptr();
                let r0 = b.ptr.offset(p as isize * b.rs).add(j0);
                let r1 = r0.offset(b.rs);
                debug_assert!(j0 + width <= n);
                for q in 0..wide {
                    let s = if HALF {
                        _mm512_loadu_ps(scale.as_ptr().add(q * T))
                    } else {
                        _mm512_setzero_ps()
                    };
                    let pairs = pairs16x16::<HALF>(
                        _mm512_loadu_ps(r0.add(q * T)),
                        _mm512_loadu_ps(r1.add(q * T)),
                        s,
                    );
                    _mm512_storeu_si512(out_ptr.add(q * panel + pair * 2 * T) as *mut _, pairs);
                }
            }
        }
    }
    for (q, o) in out.chunks_exact_mut(panel).enumerate().skip(wide) {
        // SAFETY: as the caller's.
        unsafe { pack_b::<HALF>(b, (k, n), j0 + q * T, &scale[q * T..], o) }
    }
}

/// A right operand `[k, n]` packed once (every column panel, as a shared right operand is
/// packed in [`gemm`]) for `kernel`'s products, for the products that read it while it
/// is unchanged: an inference program's weights (see `Compiled::packed_weight`). The same
/// 16-bit values as packing it for each product, so the same bits. For
/// [`Kernel16::Int16`], its int16 panels ([`crate::int16::Panels`]) instead.
pub struct PackedRhs {
    pub(super) k: usize,
    pub(super) n: usize,
    /// Whether it is in fp16 ([`Kernel16::Half`]), else in bf16.
    pub(super) half: bool,
    /// With `half`, the columns' `1 / s` (see [`fp16_scale`]), padded to the panels.
    pub(super) unscale: Vec<f32>,
    pub(super) lines: Vec<Line>,
    /// For [`Kernel16::Int16`]: its panels, or `None` where `b` cannot be quantized (a
    /// column holding an infinity or a NaN: its products read it as it is).
    pub(super) int16: Option<Option<crate::int16::Panels>>,
    /// For [`Kernel16::Int8`]: as `int16`.
    pub(super) int8: Option<Option<crate::int8::Panels>>,
}

impl PackedRhs {
    /// Packs `b` (`k × n`) for `kernel` over rayon's threads.
    ///
    /// # Safety
    /// The kernel's check must have returned `Ok` (they check AVX-512BW, or AVX2 for
    /// int16); `b` must address `k × n` valid elements.
    pub unsafe fn new(kernel: Kernel16, (k, n): (usize, usize), b: Mat) -> PackedRhs {
        if kernel.is_integer() {
            let int = kernel == Kernel16::Int16;
            return PackedRhs {
                k,
                n,
                half: false,
                unscale: Vec::new(),
                lines: Vec::new(),
                // SAFETY (both): as the caller's.
                int16: int.then(|| unsafe { crate::int16::Panels::new(b, (k, n)) }),
                int8: (!int).then(|| unsafe { crate::int8::Panels::new(b, (k, n)) }),
            };
        }
        let half = kernel == Kernel16::Half;
        let panel = k.div_ceil(TK).max(1) * TILE;
        let mut buf = Vec::new();
        let pb = lines(&mut buf, n.div_ceil(T).next_multiple_of(2) * panel);
        // SAFETY: as the caller's.
        let unscale = unsafe { pack_b_all(half, b, (k, n), panel, pb, None) };
        PackedRhs {
            k,
            n,
            half,
            unscale,
            lines: buf,
            int16: None,
            int8: None,
        }
    }

    /// Whether it is a packed `[k, n]` operand for `kernel` (an int16 one only where
    /// its panels were made).
    pub fn is(&self, kernel: Kernel16, (k, n): (usize, usize)) -> bool {
        let packing = match (&self.int16, &self.int8) {
            (Some(panels), _) => kernel == Kernel16::Int16 && panels.is_some(),
            (_, Some(panels)) => kernel == Kernel16::Int8 && panels.is_some(),
            _ => !kernel.is_integer() && self.half == (kernel == Kernel16::Half),
        };
        (self.k, self.n) == (k, n) && packing
    }

    /// Its int16 panels, where it was packed for [`Kernel16::Int16`].
    pub(crate) fn int16(&self) -> Option<&crate::int16::Panels> {
        self.int16.as_ref()?.as_ref()
    }

    /// Its int8 panels, where it was packed for [`Kernel16::Int8`].
    pub(crate) fn int8(&self) -> Option<&crate::int8::Panels> {
        self.int8.as_ref()?.as_ref()
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<Line>()
            + self.unscale.len() * 4
            + self.int16().map_or(0, |p| p.bytes())
            + self.int8().map_or(0, |p| p.bytes())
    }

    /// The packed panels.
    pub(super) fn panels(&self) -> &[u16] {
        // SAFETY: as in `lines`: the vector's initialized elements as bf16.
        unsafe {
            std::slice::from_raw_parts(self.lines.as_ptr() as *const u16, self.lines.len() * TK)
        }
    }
}

/// Packs every column panel of `b` (`k × n`) into `pb` (panels of `panel` elements), in
/// fp16 with the columns' scales where `half` (returning their `1 / s`, padded to the
/// panels), else in bf16 (returning nothing); each group's [`ColumnSums`] just after
/// packing it, where asked.
///
/// # Safety
/// As [`pack_b`]'s, and as [`column_sums`]' for `sums`.
pub(super) unsafe fn pack_b_all(
    half: bool,
    b: Mat,
    (k, n): (usize, usize),
    panel: usize,
    pb: &mut [u16],
    sums: Option<ColumnSums>,
) -> Vec<f32> {
    // SAFETY: as the caller's.
    let sum = |j0: usize| unsafe {
        if let Some(sums) = sums {
            column_sums(b, j0..(j0 + GROUP * T).min(n), sums)
        }
    };
    if !half {
        pb.par_chunks_mut(GROUP * panel)
            .enumerate()
            .for_each(|(g, out)| {
                // SAFETY: as the caller's.
                unsafe { pack_b_group::<false>(b, (k, n), g * GROUP * T, &mut [], (panel, out)) };
                sum(g * GROUP * T);
            });
        return Vec::new();
    }
    let mut unscale = vec![1f32; pb.len() / panel * T];
    pb.par_chunks_mut(GROUP * panel)
        .zip(unscale.par_chunks_mut(GROUP * T))
        .enumerate()
        .for_each(|(g, (out, u))| {
            // SAFETY: as the caller's.
            unsafe { pack_b_group::<true>(b, (k, n), g * GROUP * T, u, (panel, out)) };
            sum(g * GROUP * T);
        });
    unscale
}

/// 64 bytes on a 64-byte boundary: a tile's row. Tiles loaded from addresses that are
/// not 64-byte aligned read twice the cache lines, and `TILELOADD` runs about three
/// times slower (measured on a Sapphire Rapids VM: 7 against 19 ns a tile product).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub(super) struct Line([u16; TK]);

/// The first `len` 16-bit values (a multiple of 32) of `buf`, grown where it is shorter,
/// as a slice on a 64-byte boundary. It is never shortened, so a buffer a larger product
/// left is not zeroed again for the next one: re-zeroing cost a base training step
/// 16 ms (7 of them the vocabulary gradient's 59 MB). Every packing writes each element
/// of its panels, padding included; a test runs a small product after a large one of
/// NaNs.
pub(super) fn lines(buf: &mut Vec<Line>, len: usize) -> &mut [u16] {
    debug_assert_eq!(len % TK, 0);
    if buf.len() < len / TK {
        buf.resize(len / TK, Line::default());
    }
    // SAFETY: `Line` is 32 `u16` without padding (`repr(C)`, 64 bytes); the slice covers
    // initialized elements of the vector (`len / TK` of them, at most its length).
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u16, len) }
}
