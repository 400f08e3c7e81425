//! Matrix products in bf16 with f32 accumulation: the CPU's mixed precision
//! (`KILN_CPU_BF16=1`), opt-in. Two kernels share the packing and the driver here:
//!
//! - [`Kernel::Tiles`]: Intel AMX tiles (`TDPBF16PS`, 16 × 16 results and 32 terms each
//!   per instruction), on Xeons of the 4th generation on;
//! - [`Kernel::Dot`]: AVX-512's `VDPBF16PS` (16 results, 2 terms each per instruction),
//!   on AMD Zen 4 and later, where it multiplies-adds at twice the rate of f32 FMAs.
//!
//! In: the same strided f32 operands as [`super::gemm::gemm_one`]. Each operand is rounded
//! to bf16 (to nearest, ties to even) as it is packed; the products of pairs are summed in
//! f32, so a result differs from the f32 product by about the inputs' rounding, at most
//! 2⁻⁹ relative per operand, as with PyTorch's bf16 autocast or cuBLAS in bf16. Both
//! instructions treat subnormal bf16 inputs as zero and flush subnormal results.
//!
//! Every result element is summed over `k` in the same order whatever the threads, so a
//! product gives the same bits on every run and with any number of threads (the two
//! kernels may differ from each other in the last bits).
//!
//! No well-kept crate offers these products on stable Rust (the `gemm` crate's kernels
//! are f32/f64/f16-through-f32; the `x86_amx_intrinsics` are nightly-only), so the eight
//! tile instructions used here are written as inline assembly; `VDPBF16PS` is a stable
//! intrinsic.

use std::arch::asm;
use std::arch::x86_64::{
    __m512bh, _mm512_dpbf16_ps, _mm512_loadu_ps, _mm512_set1_epi32, _mm512_setzero_ps,
    _mm512_storeu_ps,
};
use std::sync::OnceLock;

use rayon::prelude::*;

use super::gemm::Mat;

/// Rows and columns of a result tile; the `k` of one tile product is 32 (bf16 pairs).
const T: usize = 16;
const TK: usize = 32;
/// bf16 elements of one packed tile (16 rows of 64 bytes).
const TILE: usize = T * TK;

pub(crate) use super::Bf16Kernel as Kernel;

/// The kernel that `KILN_CPU_BF16=1` runs on this CPU: the tiles where there are tiles,
/// else `VDPBF16PS` where it is faster than f32; `Err` says why neither.
pub(crate) fn kernel() -> Result<Kernel, String> {
    match (tiles_available(), dot_faster_than_f32()) {
        (Ok(()), _) => Ok(Kernel::Tiles),
        (Err(_), Ok(())) => Ok(Kernel::Dot),
        (Err(tiles), Err(dot)) => Err(format!("{tiles}, and {dot}")),
    }
}

/// Whether the CPU has `VDPBF16PS` (AVX512-BF16) and the AVX-512 that packs for it.
pub(crate) fn dot_available() -> Result<(), &'static str> {
    if !is_x86_feature_detected!("avx512bf16") {
        return Err("this CPU has no AVX-512 bf16 dot products (AVX512-BF16: AMD Zen 4 or later)");
    }
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
        return Err("this CPU has AVX512-BF16 but no AVX-512BW for packing the operands");
    }
    Ok(())
}

/// Whether `VDPBF16PS` is there and multiplies-adds faster than f32 FMAs. AMD's cores
/// (Zen 4, Zen 5) issue it at the rate of an f32 FMA, with twice the terms (by published
/// instruction tables; not yet measured by kiln on one); Intel's
/// without AMX are left out: on a Xeon VM that has AVX512-BF16 but no tiles it issued at
/// a quarter of the FMA's rate, half its multiply-adds (measured 2026-11-27, see
/// `docs/PERFORMANCE.md`), so bf16 products there would be slower than f32 ones.
/// `KILN_CPU_BF16=dot` runs it all the same.
fn dot_faster_than_f32() -> Result<(), String> {
    dot_available().map_err(|why| why.to_string())?;
    // CPUID leaf 0: the vendor string in EBX, EDX, ECX.
    let leaf = std::arch::x86_64::__cpuid(0);
    let vendor: Vec<u8> = [leaf.ebx, leaf.edx, leaf.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    if vendor != b"AuthenticAMD" {
        return Err(format!(
            "its AVX-512 bf16 dot products are slower than f32 FMAs on {} CPUs without AMX \
             (KILN_CPU_BF16=dot runs them all the same)",
            String::from_utf8_lossy(&vendor)
        ));
    }
    Ok(())
}

/// Whether this CPU has AMX tiles with bf16 products and the kernel lets the process use
/// them (Linux grants the tile data state on request: `arch_prctl(ARCH_REQ_XCOMP_PERM)`).
/// `Err` says why not.
pub(crate) fn tiles_available() -> Result<(), &'static str> {
    static AVAILABLE: OnceLock<Result<(), &'static str>> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // CPUID leaf 7, sub-leaf 0: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
        let leaf = std::arch::x86_64::__cpuid_count(7, 0);
        if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
            return Err("this CPU has no AMX bf16 tiles (Intel Xeon 4th generation or later)");
        }
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
            return Err("this CPU has AMX but no AVX-512 for packing the operands");
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call with integer arguments.
        let r = unsafe {
            libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
        };
        if r != 0 {
            return Err("the operating system did not grant the AMX tile state (Linux 5.16 or later grants it)");
        }
        Ok(())
    })
}

/// `x` rounded to bf16 (to nearest, ties to even; a NaN stays a NaN), as its bits.
/// Without branches, so that the packing loops vectorize.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    (if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

/// `x` rounded to bf16 and back: what a product on the tiles reads of an operand.
#[cfg(test)]
fn round_bf16(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// The 64-byte tile configuration (palette 1) that `LDTILECFG` loads: tiles 0–3 the
/// 16 × 16 f32 results, 4–5 the left operand's 16 × 32 bf16, 6–7 the right operand's
/// 16 pair rows × 16 columns.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut c = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    let mut t = 0;
    while t < 8 {
        c.colsb[t] = 64;
        c.rows[t] = 16;
        t += 1;
    }
    c
};

/// Packs rows `[i0, i0 + 16)` of `a` (`m × k`) as `kb` tiles of 16 rows × 32 bf16, zero
/// past `m` and `k`.
///
/// # Safety
/// `a` must address `m × k` valid elements; `out` holds `kb · TILE`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_a(a: Mat, m: usize, k: usize, i0: usize, out: &mut [u16]) {
    let kb = out.len() / TILE;
    if a.cs != 1 {
        // Strided: element by element (a transposed `a` takes `pack_a_columns`).
        out.fill(0);
        let rows = m.saturating_sub(i0).min(T);
        for p in 0..k {
            let (t, q) = (p / TK, p % TK);
            let col = unsafe { a.ptr.offset(i0 as isize * a.rs + p as isize * a.cs) };
            for r in 0..rows {
                out[t * TILE + r * TK + q] = bf16_bits(unsafe { *col.offset(r as isize * a.rs) });
            }
        }
        return;
    }
    for r in 0..T {
        let i = i0 + r;
        if i >= m {
            for t in 0..kb {
                out[t * TILE + r * TK..t * TILE + (r + 1) * TK].fill(0);
            }
            continue;
        }
        // SAFETY: row `i` of `a` holds `k` elements.
        let row = unsafe { std::slice::from_raw_parts(a.ptr.offset(i as isize * a.rs), k) };
        for t in 0..kb {
            let dst = &mut out[t * TILE + r * TK..t * TILE + (r + 1) * TK];
            let src = &row[(t * TK).min(k)..((t + 1) * TK).min(k)];
            if src.len() == TK {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = bf16_bits(x);
                }
            } else {
                dst.fill(0);
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = bf16_bits(x);
                }
            }
        }
    }
}

/// Packs the row tiles of `a` from row `i0` on into `out` (whole panels of `kb` tiles,
/// as [`pack_a`]) where `a` is stored transposed (`rs == 1`: each `k` index is a row of
/// `m` contiguous elements, as the input of a weight gradient `xᵀ·dy`). It reads each of
/// those rows a whole group of panels wide (contiguous, which the prefetchers follow),
/// where [`pack_a`] would read 64 bytes of each row per panel.
///
/// # Safety
/// `a` must address `m × k` valid elements with `a.rs == 1`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_a_columns(a: Mat, m: usize, k: usize, i0: usize, panel: usize, out: &mut [u16]) {
    out.fill(0);
    let rows = m.saturating_sub(i0).min(out.len() / panel * T);
    for p in 0..k {
        let (t, q) = (p / TK, p % TK);
        // SAFETY: index `p` holds the `m` elements of its row.
        let src =
            unsafe { std::slice::from_raw_parts(a.ptr.offset(p as isize * a.cs).add(i0), rows) };
        for (r, &x) in src.iter().enumerate() {
            out[(r / T) * panel + t * TILE + (r % T) * TK + q] = bf16_bits(x);
        }
    }
}

/// Packs columns `[j0, j0 + 16)` of `b` (`k × n`) as `kb` tiles of 16 pair rows: row `r`
/// of tile `t` holds `b[32t + 2r, j], b[32t + 2r + 1, j]` for its 16 columns `j` (the
/// pairs `TDPBF16PS` multiplies), zero past `k` and `n`. A row-major `b` a whole tile
/// wide packs only the tiles of `tiles` (see [`pack_b_group`]); otherwise all of them.
///
/// # Safety
/// `b` must address `k × n` valid elements; `out` holds `kb · TILE`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_b(
    b: Mat,
    k: usize,
    n: usize,
    j0: usize,
    out: &mut [u16],
    tiles: std::ops::Range<usize>,
) {
    let cols = n.saturating_sub(j0).min(T);
    let at = |p: usize, j: usize| unsafe { *b.ptr.offset(p as isize * b.rs + j as isize * b.cs) };
    if b.cs == 1 && cols == T {
        // Row-major, a whole tile wide: two rows' 16 columns interleaved.
        for pair in tiles.start * T..tiles.end * T {
            let dst = &mut out[pair * 2 * T..(pair + 1) * 2 * T];
            let p = 2 * pair;
            if p + 1 < k {
                // SAFETY: rows `p`, `p + 1` hold columns `j0..j0 + 16`.
                let (r0, r1) = unsafe {
                    (
                        std::slice::from_raw_parts(b.ptr.offset(p as isize * b.rs).add(j0), T),
                        std::slice::from_raw_parts(
                            b.ptr.offset((p + 1) as isize * b.rs).add(j0),
                            T,
                        ),
                    )
                };
                for c in 0..T {
                    dst[2 * c] = bf16_bits(r0[c]);
                    dst[2 * c + 1] = bf16_bits(r1[c]);
                }
            } else {
                for c in 0..T {
                    dst[2 * c] = if p < k { bf16_bits(at(p, j0 + c)) } else { 0 };
                    dst[2 * c + 1] = 0;
                }
            }
        }
        return;
    }
    if b.rs == 1 {
        // Stored transposed: a column's `k` values are contiguous.
        out.fill(0);
        for c in 0..cols {
            // SAFETY: column `j0 + c` holds `k` elements.
            let col =
                unsafe { std::slice::from_raw_parts(b.ptr.offset((j0 + c) as isize * b.cs), k) };
            for (p, &x) in col.iter().enumerate() {
                out[(p / TK) * TILE + ((p % TK) / 2) * TK + 2 * c + (p & 1)] = bf16_bits(x);
            }
        }
        return;
    }
    out.fill(0);
    for p in 0..k {
        let base = (p / TK) * TILE + ((p % TK) / 2) * TK + (p & 1);
        for c in 0..cols {
            out[base + 2 * c] = bf16_bits(at(p, j0 + c));
        }
    }
}

/// Packs the column panels of `out` (whole panels of `panel` elements) from column `j0`
/// on. A row-major `b` is packed one `k` tile of every panel at a time, so that each row
/// is read the group's width at once (contiguous, which the prefetchers follow) where one
/// panel at a time would read 64 bytes of each row (the vocabulary projection's rows are
/// 148 KB apart).
///
/// # Safety
/// As [`pack_b`].
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_b_group(b: Mat, k: usize, n: usize, j0: usize, panel: usize, out: &mut [u16]) {
    let kb = panel / TILE;
    let whole = |q: usize| b.cs == 1 && j0 + (q + 1) * T <= n;
    for t in 0..kb {
        for (q, o) in out.chunks_exact_mut(panel).enumerate() {
            if whole(q) {
                // SAFETY: as the caller's.
                unsafe { pack_b(b, k, n, j0 + q * T, o, t..t + 1) }
            }
        }
    }
    for (q, o) in out.chunks_exact_mut(panel).enumerate() {
        if !whole(q) {
            // SAFETY: as the caller's.
            unsafe { pack_b(b, k, n, j0 + q * T, o, 0..kb) }
        }
    }
}

/// One 32 × 32 result block over the whole `k`: `c` (row stride `ldc` floats) is loaded
/// into tiles 0–3 if `load`, else they start at zero; `a0`, `a1` are the two row tiles'
/// packed panels, `b0`, `b1` the two column tiles', each `kb` tiles long.
///
/// # Safety
/// The tile configuration must be loaded; every pointer addresses what it says.
#[inline(always)]
unsafe fn block(
    c: *mut f32,
    ldc: usize,
    load: bool,
    (a0, a1, b0, b1): (*const u16, *const u16, *const u16, *const u16),
    kb: usize,
) {
    let cs = ldc * 4;
    let c1 = unsafe { c.add(T) };
    let c2 = unsafe { c.add(T * ldc) };
    let c3 = unsafe { c.add(T * ldc + T) };
    unsafe {
        if load {
            asm!(
                "tileloadd tmm0, [{c0} + {s}*1]",
                "tileloadd tmm1, [{c1} + {s}*1]",
                "tileloadd tmm2, [{c2} + {s}*1]",
                "tileloadd tmm3, [{c3} + {s}*1]",
                c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
                s = in(reg) cs, options(nostack, readonly),
            );
        } else {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
        }
        for t in 0..kb {
            let o = t * TILE;
            asm!(
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0.add(o), a1 = in(reg) a1.add(o),
                b0 = in(reg) b0.add(o), b1 = in(reg) b1.add(o),
                s = in(reg) 64usize, options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{c0} + {s}*1], tmm0",
            "tilestored [{c1} + {s}*1], tmm1",
            "tilestored [{c2} + {s}*1], tmm2",
            "tilestored [{c3} + {s}*1], tmm3",
            c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
            s = in(reg) cs, options(nostack),
        );
    }
}

/// One 32 × 32 result block over the whole `k` with `VDPBF16PS`, from the same packed
/// panels as [`block`]: each 8 rows × 32 columns of the result are 16 vectors of 16 f32
/// held in registers over the whole `k`; each step broadcasts a row's bf16 pair to every
/// lane and multiplies it with a pair row of the two column tiles (16 columns × 2 terms,
/// one 64-byte line of a packed tile).
///
/// # Safety
/// [`dot_available`] must have returned `Ok`; every pointer addresses what it says.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot_block(
    c: *mut f32,
    ldc: usize,
    load: bool,
    (a0, a1, b0, b1): (*const u16, *const u16, *const u16, *const u16),
    kb: usize,
) {
    const R: usize = 8;
    for (chunk, a) in [a0, a0, a1, a1].into_iter().enumerate() {
        let (row0, in_tile) = (chunk * R, (chunk % 2) * R);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: the block's rows hold 32 columns at `c`, `ldc` apart.
            let row = unsafe { c.add((row0 + r) * ldc) };
            if load {
                *acc = unsafe { [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(T))] };
            }
        }
        for t in 0..kb {
            // SAFETY: each panel holds `kb` tiles.
            let (at, bt0, bt1) = unsafe {
                (
                    a.add(t * TILE + in_tile * TK),
                    b0.add(t * TILE),
                    b1.add(t * TILE),
                )
            };
            for p in 0..T {
                // SAFETY: pair row `p` of a tile is one 64-byte line on a 64-byte boundary
                // (`Line`); a row's pair `p` is 4 bytes at `2p` of its 32.
                let (v0, v1) = unsafe {
                    (
                        (bt0.add(p * TK) as *const __m512bh).read(),
                        (bt1.add(p * TK) as *const __m512bh).read(),
                    )
                };
                for (r, acc) in acc.iter_mut().enumerate() {
                    let pair = unsafe { (at.add(r * TK + 2 * p) as *const i32).read() };
                    // SAFETY: the same 512 bits seen as 32 bf16.
                    let va: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(pair)) };
                    acc[0] = _mm512_dpbf16_ps(acc[0], va, v0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], va, v1);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            unsafe {
                let row = c.add((row0 + r) * ldc);
                _mm512_storeu_ps(row, acc[0]);
                _mm512_storeu_ps(row.add(T), acc[1]);
            }
        }
    }
}

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

/// A right operand `[k, n]` packed once (every column panel, as a shared right operand is
/// packed in [`gemm`]), for the products that read it while it is unchanged: an inference
/// program's weights (see `Compiled::packed_weight`). The same bf16 values as packing it
/// for each product, so the same bits.
pub(crate) struct PackedRhs {
    k: usize,
    n: usize,
    lines: Vec<Line>,
}

impl PackedRhs {
    /// Packs `b` (`k × n`) over rayon's threads.
    ///
    /// # Safety
    /// A kernel's check must have returned `Ok` (they check AVX-512BW); `b` must address
    /// `k × n` valid elements.
    pub(crate) unsafe fn new((k, n): (usize, usize), b: Mat) -> PackedRhs {
        let panel = k.div_ceil(TK).max(1) * TILE;
        let mut buf = Vec::new();
        let pb = lines(&mut buf, n.div_ceil(T).next_multiple_of(2) * panel);
        pb.par_chunks_mut(GROUP * panel)
            .enumerate()
            .for_each(|(g, out)| {
                // SAFETY: as the caller's.
                unsafe { pack_b_group(b, k, n, g * GROUP * T, panel, out) }
            });
        PackedRhs { k, n, lines: buf }
    }

    /// Whether it is a packed `[k, n]` operand.
    pub(crate) fn is(&self, (k, n): (usize, usize)) -> bool {
        (self.k, self.n) == (k, n)
    }

    /// Its size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<Line>()
    }

    /// The packed panels.
    fn panels(&self) -> &[u16] {
        // SAFETY: as in `lines`: the vector's initialized elements as bf16.
        unsafe {
            std::slice::from_raw_parts(self.lines.as_ptr() as *const u16, self.lines.len() * TK)
        }
    }
}

/// The right operand of [`gemm`]: strided f32, or packed beforehand.
#[derive(Clone, Copy)]
pub(crate) enum Rhs<'a> {
    Mat(Mat),
    Packed(&'a PackedRhs),
}

/// `dst[m, n] (row stride ld) = (read_dst ? dst : 0) + a[m, k]·b[k, n]` with the
/// operands rounded to bf16 and the sums in f32, with `kernel`'s instructions, over
/// rayon's threads.
///
/// # Safety
/// The kernel's check ([`tiles_available`], [`dot_available`]) must have returned `Ok`;
/// every element the matrices address must be valid; `dst` must not overlap `a`, `b`.
pub(crate) unsafe fn gemm(
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    dst: *mut f32,
    ld: isize,
    a: Mat,
    b: Rhs<'_>,
    read_dst: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let (b, prepacked) = match b {
        Rhs::Mat(b) => (Some(b), None),
        Rhs::Packed(p) => {
            assert!(
                p.k == k && p.n == n,
                "a packed {}×{} operand for a {m}×{k}·{k}×{n} product",
                p.k,
                p.n
            );
            (None, Some(p.panels()))
        }
    };
    let kb = k.div_ceil(TK).max(1);
    let mt = m.div_ceil(T);
    // `a` packed once, by 16-row tiles: a panel of `kb` tiles each (an odd count gets an
    // all-zero panel beside it). A wide `b` is packed by each task, its 256 columns (16
    // panels) into a buffer of its thread that stays in the core's cache: the packed copy
    // of the vocabulary projection's `b` (38 MB) never goes to memory and back. Otherwise
    // `b` is packed once and shared (below).
    let panel = kb * TILE;
    let mut lines_a = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
    // Every element is written by the packing below (zeros past the operand's edges).
    let pa = lines(&mut lines_a, mt.next_multiple_of(2) * panel);
    if a.rs == 1 && a.cs != 1 {
        pa.par_chunks_mut(GROUP * panel)
            .enumerate()
            .for_each(|(g, out)| {
                // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k`, `rs == 1`.
                unsafe { pack_a_columns(a, m, k, g * GROUP * T, panel, out) }
            });
    } else {
        pa.par_chunks_mut(panel).enumerate().for_each(|(i, out)| {
            // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k`.
            unsafe { pack_a(a, m, k, i * T, out) }
        });
    }
    // Tasks: the column blocks, each split into row blocks (multiples of 32 rows) only
    // as far as it takes to give every thread two tasks. Where there are fewer column
    // blocks than that (a narrow `b`, which several tasks would pack again), `b` is
    // packed once beforehand and shared.
    // So is a `b` whose tasks would each stream a packed `a` too large for a core's
    // cache (over 2 MB): then the tasks are blocks of at most 256 rows. A `b` the caller
    // packed beforehand (`Rhs::Packed`) is read as a shared one.
    let cols_b = n.div_ceil(GROUP * T);
    let mut lines_shared = Vec::new();
    let pb_shared: &[u16] = match (b, prepacked) {
        (_, Some(panels)) => panels,
        (Some(b), None) if cols_b < 2 * rayon::current_num_threads() || pa.len() * 2 > 2 << 20 => {
            lines_shared = PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()));
            let pb = lines(&mut lines_shared, n.div_ceil(T).next_multiple_of(2) * panel);
            pb.par_chunks_mut(GROUP * panel)
                .enumerate()
                .for_each(|(g, out)| {
                    // SAFETY: the kernel's check found AVX-512; `b` addresses `k × n`.
                    unsafe { pack_b_group(b, k, n, g * GROUP * T, panel, out) }
                });
            pb
        }
        _ => &[],
    };
    // Whether every task reads `b` packed beforehand (here or by the caller).
    let shared = !pb_shared.is_empty();
    let split = (2 * rayon::current_num_threads())
        .div_ceil(cols_b)
        .clamp(1, m.div_ceil(2 * T));
    let mut rows_per = m.div_ceil(split).next_multiple_of(2 * T);
    if shared {
        rows_per = rows_per.min(GROUP * T);
    }
    let rows_b = m.div_ceil(rows_per);
    let out = Out(dst);
    let pa_ref = &pa;
    (0..rows_b * cols_b).into_par_iter().for_each(|task| {
        let (i0, j0) = ((task % rows_b) * rows_per, (task / rows_b) * GROUP * T);
        let (i1, j1) = ((i0 + rows_per).min(m), (j0 + GROUP * T).min(n));
        let mut lines_b = Vec::new();
        let pb: &[u16] = if let (false, Some(b)) = (shared, b) {
            lines_b = PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()));
            let pb = lines(&mut lines_b, (j1 - j0).div_ceil(T).next_multiple_of(2) * panel);
            // SAFETY: the kernel's check found AVX-512; `b` addresses `k × n`.
            unsafe { pack_b_group(b, k, n, j0, panel, pb) };
            pb
        } else {
            &pb_shared[(j0 / T) * panel..]
        };
        let mut edge = [0f32; 4 * T * T];
        let tiles = kernel == Kernel::Tiles;
        let block = |c: *mut f32, ldc: usize, ops, kb: usize| unsafe {
            if tiles {
                block(c, ldc, read_dst, ops, kb)
            } else {
                dot_block(c, ldc, read_dst, ops, kb)
            }
        };
        // SAFETY: the configuration is a valid palette-1 layout; each task writes its own
        // block of `dst`; the panels hold every tile the loops address.
        unsafe {
            if tiles {
                asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack, readonly));
            }
            for i in (i0..i1).step_by(2 * T) {
                let (a0, a1) = (
                    pa_ref.as_ptr().add((i / T) * panel),
                    pa_ref.as_ptr().add((i / T + 1) * panel),
                );
                for j in (j0..j1).step_by(2 * T) {
                    let q = (j - j0) / T;
                    let ops = (
                        a0,
                        a1,
                        pb.as_ptr().add(q * panel),
                        pb.as_ptr().add((q + 1) * panel),
                    );
                    let c = out.get().offset(i as isize * ld + j as isize);
                    if i + 2 * T <= m && j + 2 * T <= n {
                        block(c, ld as usize, ops, kb);
                    } else {
                        // A block past the matrix's edge: through a 32 × 32 scratch.
                        let (h, w) = ((m - i).min(2 * T), (n - j).min(2 * T));
                        edge.fill(0.0);
                        if read_dst {
                            for r in 0..h {
                                for q in 0..w {
                                    edge[r * 2 * T + q] = *c.offset(r as isize * ld + q as isize);
                                }
                            }
                        }
                        block(edge.as_mut_ptr(), 2 * T, ops, kb);
                        for r in 0..h {
                            for q in 0..w {
                                *c.offset(r as isize * ld + q as isize) = edge[r * 2 * T + q];
                            }
                        }
                    }
                }
            }
            if tiles {
                asm!("tilerelease", options(nostack, nomem));
            }
        }
        if !shared {
            PACKED_B.with(|p| *p.borrow_mut() = lines_b);
        }
    });
    PACKED.with(|p| *p.borrow_mut() = lines_a);
    if prepacked.is_none() && shared {
        PACKED_B.with(|p| *p.borrow_mut() = lines_shared);
    }
}

/// Panels a packing task or a product task takes: 16 (256 rows or columns).
const GROUP: usize = 16;

thread_local! {
    /// The packed left operand of the thread's last product, kept for its next.
    static PACKED: std::cell::RefCell<Vec<Line>> = Default::default();
    /// A task's packed columns of the right operand, kept for the thread's next task.
    static PACKED_B: std::cell::RefCell<Vec<Line>> = Default::default();
}

/// 64 bytes on a 64-byte boundary: a tile's row. Tiles loaded from addresses that are
/// not 64-byte aligned read twice the cache lines, and `TILELOADD` runs about three
/// times slower (measured on a Sapphire Rapids VM: 7 against 19 ns a tile product).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([u16; TK]);

/// `buf` grown to hold `len` bf16 (a multiple of 32), as a slice on a 64-byte boundary.
fn lines(buf: &mut Vec<Line>, len: usize) -> &mut [u16] {
    debug_assert_eq!(len % TK, 0);
    buf.resize(len / TK, Line::default());
    // SAFETY: `Line` is 32 `u16` without padding (`repr(C)`, 64 bytes); the slice covers
    // exactly the vector's initialized elements.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u16, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `rows × cols` matrix in `v`: row-major, or stored transposed (column-major).
    fn stored(v: &[f32], rows: usize, cols: usize, transposed: bool) -> Mat {
        let (rs, cs) = if transposed { (1, rows) } else { (cols, 1) };
        Mat {
            ptr: v.as_ptr(),
            rs: rs as isize,
            cs: cs as isize,
        }
    }

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn rounding_to_bf16_is_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to the even upper one.
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_bits(1.0 + 1.5 / 256.0), 0x3f81);
        assert_eq!(bf16_bits(-2.0), 0xc000);
        assert!(f32::from_bits((bf16_bits(f32::NAN) as u32) << 16).is_nan());
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(round_bf16(3.0e38), f32::from_bits(0x7f62 << 16));
    }

    /// The tiles' product against f64 sums of the bf16-rounded operands: only the f32
    /// accumulation differs, so the results agree to a few f32 ulps of the sums'
    /// magnitudes, at sizes that are and are not whole tiles, transposed operands and a
    /// destination read first.
    /// `f` on a pool of `threads` threads.
    fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    /// The kernels this CPU can run, each with its name; a line for each it cannot.
    fn kernels() -> Vec<Kernel> {
        let mut v = Vec::new();
        match tiles_available() {
            Ok(()) => v.push(Kernel::Tiles),
            Err(why) => println!("AMX tiles skipped: {why}"),
        }
        match dot_available() {
            Ok(()) => v.push(Kernel::Dot),
            Err(why) => println!("VDPBF16PS skipped: {why}"),
        }
        v
    }

    #[test]
    fn bf16_products_equal_the_sums_of_the_rounded_operands() {
        for kernel in kernels() {
            products_equal_the_sums_of_the_rounded_operands(kernel);
        }
    }

    fn products_equal_the_sums_of_the_rounded_operands(kernel: Kernel) {
        let mut seed = 7u64;
        for &(m, k, n, ta, tb, read) in &[
            (32, 32, 32, false, false, false),
            (1, 1, 1, false, false, false),
            (45, 70, 33, false, false, true),
            (300, 512, 270, false, true, false),
            (64, 800, 96, true, false, true),
            (300, 70, 40, true, false, false),
            (40, 100, 300, false, false, true),
            (70, 64, 700, false, true, false),
            (17, 2049, 5, true, true, false),
        ] {
            let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
            let (am, bm) = (stored(&a, m, k, ta), stored(&b, k, n, tb));
            let at = |i: usize, p: usize| unsafe {
                *am.ptr.offset(i as isize * am.rs + p as isize * am.cs)
            };
            let bt = |p: usize, j: usize| unsafe {
                *bm.ptr.offset(p as isize * bm.rs + j as isize * bm.cs)
            };
            // On one thread, a `b` of two column blocks or more is packed by each task; on
            // four, it is packed beforehand and shared: both must give the same bits.
            let run = |threads: usize| {
                let mut c = c0.clone();
                on_threads(threads, || unsafe {
                    gemm(
                        kernel,
                        (m, k, n),
                        c.as_mut_ptr(),
                        n as isize,
                        am,
                        Rhs::Mat(bm),
                        read,
                    )
                });
                c
            };
            let c = run(1);
            assert!(
                c.iter()
                    .zip(run(4))
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{kernel:?}: {m}×{k}·{k}×{n}: one thread and four differ"
            );
            // Against f64 sums of the rounded operands (`worst`) and of the operands as
            // they are (`off`): the first differ only by the f32 accumulation; the second
            // by the operands' rounding, about 2^-9 relative per term, so they must be
            // clearly apart (the operands really are rounded).
            let (mut worst, mut off) = (0f64, 0f64);
            for i in 0..m {
                for j in 0..n {
                    let init = if read { c0[i * n + j] as f64 } else { 0.0 };
                    let (mut s, mut x, mut mag) = (init, init, 0f64);
                    for p in 0..k {
                        let t = round_bf16(at(i, p)) as f64 * round_bf16(bt(p, j)) as f64;
                        s += t;
                        x += at(i, p) as f64 * bt(p, j) as f64;
                        mag += t.abs();
                    }
                    let got = c[i * n + j] as f64;
                    worst = worst.max((got - s).abs() / (mag + init.abs()));
                    off = off.max((got - x).abs() / (mag + init.abs()));
                }
            }
            let what = format!("{kernel:?}: {m}×{k}·{k}×{n} (ta {ta}, tb {tb}, read {read})");
            assert!(
                worst < 1e-6,
                "{what}: {worst:e} from the rounded operands' sums"
            );
            if m * n * k > 1 {
                assert!(off > 1e-4, "{what}: only {off:e} from the exact sums");
            }
        }
    }

    /// Subnormal bf16 operands count as zero (both instructions compute as if DAZ were
    /// set, whatever MXCSR says), while the least normal operands multiply as they are
    /// and a NaN operand gives a NaN.
    #[test]
    fn bf16_products_flush_subnormals_and_keep_nans() {
        let tiny = f32::from_bits(0x0040_0000); // 2^-127: subnormal, exact in bf16
        let least = f32::MIN_POSITIVE; // 2^-126: normal
        for kernel in kernels() {
            let run = |a: f32, b: f32| {
                let (av, bv) = (vec![a; 32 * 64], vec![b; 64 * 32]);
                let mut c = vec![0f32; 32 * 32];
                unsafe {
                    gemm(
                        kernel,
                        (32, 64, 32),
                        c.as_mut_ptr(),
                        32,
                        stored(&av, 32, 64, false),
                        Rhs::Mat(stored(&bv, 64, 32, false)),
                        false,
                    )
                };
                c
            };
            assert!(
                run(tiny, 1.0).iter().all(|&x| x == 0.0),
                "{kernel:?}: a subnormal operand"
            );
            // 2^-126 · 2 summed 64 times: 2^-119, exact.
            assert!(
                run(least, 2.0).iter().all(|&x| x == least * 128.0),
                "{kernel:?}: the least normal operand"
            );
            assert!(
                run(f32::NAN, 1.0).iter().all(|x| x.is_nan()),
                "{kernel:?}: a NaN"
            );
        }
    }

    /// The same operands give the same bits with one thread and with several.
    #[test]
    fn bf16_products_give_the_same_bits_on_any_number_of_threads() {
        for kernel in kernels() {
            same_bits_on_any_number_of_threads(kernel);
        }
    }

    fn same_bits_on_any_number_of_threads(kernel: Kernel) {
        let (m, k, n) = (600, 300, 530);
        let mut seed = 3u64;
        let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
        let run = |threads: usize| {
            let mut c = vec![0f32; m * n];
            on_threads(threads, || unsafe {
                gemm(
                    kernel,
                    (m, k, n),
                    c.as_mut_ptr(),
                    n as isize,
                    stored(&a, m, k, false),
                    Rhs::Mat(stored(&b, k, n, false)),
                    false,
                )
            });
            c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(3));
    }
}
