//! How a product's blocks are split among threads: each thread packing all of `b`
//! (`local`), or one packing streamed through (`stream`), and the runs of blocks a task takes.

use std::arch::asm;
use std::arch::x86_64::*;

use rayon::prelude::*;

use super::*;

/// The multiply-adds of one strip of 8 result rows × 32 columns over the packed `tiles`
/// of `a` (its 8 rows from row `in_tile` of each tile) and of the two column tiles `b0`,
/// `b1`: each pair row `p` of a tile is one 64-byte line of each column tile (16 columns
/// × 2 values of `k`), and each row's pair `p` (4 bytes at `2p` of its 32) is broadcast
/// to every lane pair (`broadcast`) and multiplied with them (`fma(acc, a, b)`). Shared
/// by [`dot_block`] and [`half_block`], inlined into each with its instructions.
///
/// # Safety
/// Every panel holds the tiles; `V` is a 64-byte vector (the lines are 64-byte aligned,
/// `Line`).
#[inline(always)]
pub(super) unsafe fn strip_steps<A: Copy, V: Copy>(
    acc: &mut [[A; 2]; 8],
    (a, b0, b1): (*const u16, *const u16, *const u16),
    in_tile: usize,
    tiles: std::ops::Range<usize>,
    broadcast: impl Fn(i32) -> V,
    fma: impl Fn(A, V, V) -> A,
) {
    for t in tiles {
        // SAFETY: each panel holds the tiles.
        let (at, bt0, bt1) = unsafe {
            (
                a.add(t * TILE + in_tile * TK),
                b0.add(t * TILE),
                b1.add(t * TILE),
            )
        };
        for p in 0..T {
            // SAFETY: pair row `p` of a tile is one 64-byte line on a 64-byte boundary.
            let (v0, v1) = unsafe {
                (
                    (bt0.add(p * TK) as *const V).read(),
                    (bt1.add(p * TK) as *const V).read(),
                )
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row `r`'s pair `p` is 4 bytes at `2p` of its 32.
                let va = broadcast(unsafe { (at.add(r * TK + 2 * p) as *const i32).read() });
                acc[0] = fma(acc[0], va, v0);
                acc[1] = fma(acc[1], va, v1);
            }
        }
    }
}

/// Prefetches rows `rows` of a 32-column result block at `c` (row stride `ldc`) into the
/// first-level cache (`PREFETCHT0`), so that the block's stores find them there (see
/// [`half_block`]): a line no other core holds arrives exclusive, and the store needs no
/// second request. A row's 32 values span two or three 64-byte lines: its first, the one
/// 64 bytes on and its last 4 bytes'. Never faults, wherever it points. (`PREFETCHW`,
/// which would also take a line another core holds, needs the `prfchw` target feature,
/// unstable in Rust 1.95; as inline assembly it measured within this VM's noise.)
#[target_feature(enable = "sse")]
#[inline]
pub(super) fn prefetch_for_write(c: *mut f32, ldc: usize, rows: std::ops::Range<usize>) {
    for r in rows {
        let row = c.wrapping_add(r * ldc) as *const i8;
        for at in [0, 64, 124] {
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(at));
        }
    }
}

/// Elements of a narrow right operand (fewer column groups than two per thread) that
/// [`local`] packs whole on each thread: 1 M (up to a 2048 × 512 `b`, 2 MB packed, as
/// much as a core's second-level cache on the Xeons measured). In the base step the
/// FFN's `800×2048·2048×512` products ran 3–4 % faster this way than with `b` packed
/// once and shared.
pub(super) const LOCAL_B: usize = 1024 * 1024;

/// [`gemm`] for a narrow, small `b` (see [`LOCAL_B`]) and at least 256 rows a thread:
/// `parts` tasks, one a thread, each an equal share of the 32 × 32 blocks in row-major
/// order ([`block_runs`]): whole row blocks against every column, and where the shares
/// do not end on a row block's edge, part of a row block's columns (the 25 row blocks of
/// 800 rows are 12½ a thread, not 13 and 12). Each task packs all of `b` into its
/// thread's buffer (a second packing of a small operand), then its rows of `a` 256 at a
/// time, each just before their blocks (a row block two tasks share, by both). So every
/// panel a core reads is one it wrote, still in its own cache, and the product is one
/// parallel step: two tasks with local operands ran an 800 × 512 · 512 × 512 product in
/// 0.95 ms where shared packing and a grid of tasks took 1.06–1.09 ms. The same sums as
/// the other path, so the same bits. [`ColumnSums`] asked for are split between the
/// tasks by vectors of 16 columns, each summed just after the task packed `b`.
///
/// # Safety
/// As [`gemm`]'s.
pub(super) unsafe fn local(
    (m, k): (usize, usize),
    (a, b, parts): (Mat, Mat, usize),
    ops: Blocks<'_>,
    sums: Option<ColumnSums>,
) {
    let (kernel, n) = (ops.kernel, ops.n);
    let half = kernel == Kernel16::Half;
    let panel = ops.kb * TILE;
    let (row_blocks, col_blocks) = (m.div_ceil(2 * T), n.div_ceil(2 * T));
    let blocks = row_blocks * col_blocks;
    (0..parts).into_par_iter().for_each(|task| {
        let share = (task * blocks / parts, (task + 1) * blocks / parts);
        let mut lines_b = PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let panels_b = n.div_ceil(T).next_multiple_of(2);
        let pb = lines(&mut lines_b, panels_b * panel);
        let mut b_unscale = vec![1f32; if half { panels_b * T } else { 0 }];
        for (g, out) in pb.chunks_mut(GROUP * panel).enumerate() {
            let u = if half {
                &mut b_unscale[g * GROUP * T..][..out.len() / panel * T]
            } else {
                &mut []
            };
            // SAFETY: the kernel's check found AVX-512; `b` addresses `k × n`.
            unsafe {
                if half {
                    pack_b_group::<true>(b, (k, n), g * GROUP * T, u, (panel, out))
                } else {
                    pack_b_group::<false>(b, (k, n), g * GROUP * T, u, (panel, out))
                }
            };
        }
        // Every task packed all of `b`: each sums its share of the columns (by vectors).
        if let Some(sums) = sums {
            let vectors = n.div_ceil(T);
            let (lo, hi) = (task * vectors / parts * T, (task + 1) * vectors / parts * T);
            // SAFETY: as the caller's.
            unsafe { column_sums(b, lo..hi.min(n), sums) };
        }
        let mut lines_a = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let runs = block_runs(share, col_blocks);
        // SAFETY: as the caller's; `pb` holds every column panel, `b_unscale` their scales.
        unsafe { pack_rows_and_run(&ops, &runs, (a, m, k), (pb, &b_unscale), None, &mut lines_a) };
        PACKED.with(|p| *p.borrow_mut() = lines_a);
        PACKED_B.with(|p| *p.borrow_mut() = lines_b);
    });
}

/// [`gemm`] for a long `k` (more than [`K_TILES`] tiles) and a narrow `b` whose whole
/// packed copy would not fit [`LOCAL_B`], but whose [`K_TILES`] tiles of `k` do: the
/// vocabulary projection's input gradient `800×37000·37000×512` of the base step. The
/// shared path would pack all of `a` (59 MB there) and `b` (38 MB) into memory before
/// any product and stream them back; here each of `parts` tasks (one a thread) takes an
/// equal share of the 32 × 32 result blocks, as in [`local`], and goes through `k` by
/// [`K_TILES`] tiles: it packs that part of `b` whole and of its rows of `a` 256 at a
/// time into its core's cache, and adds their products to its blocks. In fp16 the
/// scales are the whole rows' and columns' ([`fp16_scale`]), found by a first pass over
/// both operands (split between the tasks), and the blocks are summed over `k` in the
/// same parts as in [`Blocks::run`]: the same bits as the shared path. [`ColumnSums`]
/// asked for are split between the tasks by vectors of 16 columns, in the first pass.
///
/// # Safety
/// As [`gemm`]'s.
pub(super) unsafe fn stream(
    (m, k): (usize, usize),
    (a, b, parts): (Mat, Mat, usize),
    ops: Blocks<'_>,
    sums: Option<ColumnSums>,
) {
    let (kernel, n) = (ops.kernel, ops.n);
    let half = kernel == Kernel16::Half;
    // The rows' and columns' fp16 scales and their inverses (all 1 for bf16), padded to
    // whole blocks.
    let (mut a_scale, mut a_unscale) = (
        vec![1f32; m.next_multiple_of(2 * T)],
        vec![1f32; m.next_multiple_of(2 * T)],
    );
    let (mut b_scale, mut b_unscale) = (
        vec![1f32; n.next_multiple_of(2 * T)],
        vec![1f32; n.next_multiple_of(2 * T)],
    );
    if half || sums.is_some() {
        // `b`'s columns are the rows of `bᵀ`.
        let bt = b.transposed();
        let maxima: Vec<(Vec<u32>, Vec<u32>)> = (0..parts)
            .into_par_iter()
            .map(|task| {
                let share = |len: usize| task * len / parts..(task + 1) * len / parts;
                if let Some(sums) = sums {
                    let vectors = share(n.div_ceil(T));
                    // SAFETY: as the caller's.
                    unsafe { column_sums(b, vectors.start * T..(vectors.end * T).min(n), sums) };
                }
                if !half {
                    return Default::default();
                }
                let (rows, ks) = (share(m), share(k));
                let (mut a_max, mut b_max) = (vec![0; rows.len()], vec![0; n]);
                // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k`, `b`
                // `k × n`.
                unsafe {
                    max_rows(a, rows, 0..k, &mut a_max);
                    max_rows(bt, 0..n, ks, &mut b_max);
                }
                (a_max, b_max)
            })
            .collect();
        if half {
            let mut b_max = vec![0; n];
            let a_max = maxima.iter().flat_map(|(a_max, _)| a_max);
            for ((s, u), &max) in a_scale.iter_mut().zip(a_unscale.iter_mut()).zip(a_max) {
                (*s, *u) = fp16_scale(max, TOP_A);
            }
            for (_, part) in &maxima {
                for (max, &x) in b_max.iter_mut().zip(part) {
                    *max = (*max).max(x);
                }
            }
            for ((s, u), &max) in b_scale.iter_mut().zip(b_unscale.iter_mut()).zip(&b_max) {
                (*s, *u) = fp16_scale(max, TOP_B);
            }
        }
    }
    let (a_scale, a_unscale, b_scale) = (&a_scale, &a_unscale, &b_scale);
    let b_unscale: &[f32] = if half { &b_unscale } else { &[] };
    let (row_blocks, col_blocks) = (m.div_ceil(2 * T), n.div_ceil(2 * T));
    let blocks = row_blocks * col_blocks;
    let panels_b = n.div_ceil(T).next_multiple_of(2);
    (0..parts).into_par_iter().for_each(|task| {
        // The whole operands (not their fields, which are not `Sync`).
        let (a_whole, b_whole) = (a, b);
        let runs = block_runs(
            (task * blocks / parts, (task + 1) * blocks / parts),
            col_blocks,
        );
        let mut lines_a = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let mut lines_b = PACKED_B.with(|p| std::mem::take(&mut *p.borrow_mut()));
        for p0 in (0..k).step_by(K_TILES * TK) {
            // This part of `k`, and the operands from its first index.
            let kc = (K_TILES * TK).min(k - p0);
            let panel = kc.div_ceil(TK) * TILE;
            let a = Mat {
                ptr: a_whole.ptr.wrapping_offset(p0 as isize * a_whole.cs),
                ..a_whole
            };
            let b = Mat {
                ptr: b_whole.ptr.wrapping_offset(p0 as isize * b_whole.rs),
                ..b_whole
            };
            let pb = lines(&mut lines_b, panels_b * panel);
            for (g, out) in pb.chunks_mut(GROUP * panel).enumerate() {
                let (j0, o) = (g * GROUP * T, (panel, out));
                // SAFETY: the kernel's check found AVX-512; `b` addresses `kc × n`; the
                // scales hold every column of the panels.
                unsafe {
                    if half {
                        pack_b_group_scaled::<true>(b, (kc, n), j0, &b_scale[j0..], o)
                    } else {
                        pack_b_group_scaled::<false>(b, (kc, n), j0, &b_scale[j0..], o)
                    }
                };
            }
            // The blocks are added to from the second part of `k` on; the epilogue is the
            // last part's.
            let part = ops.part(kc.div_ceil(TK), p0 > 0, p0 + kc == k);
            let scales = Some((&a_scale[..], &a_unscale[..]));
            // SAFETY: as the caller's; `a` addresses `m × kc`; `pb` holds every column
            // panel of this part of `k`, the scales every row and column.
            unsafe {
                pack_rows_and_run(
                    &part,
                    &runs,
                    (a, m, kc),
                    (pb, b_unscale),
                    scales,
                    &mut lines_a,
                )
            };
        }
        PACKED.with(|p| *p.borrow_mut() = lines_a);
        PACKED_B.with(|p| *p.borrow_mut() = lines_b);
    });
}

/// The blocks of `runs` ([`block_runs`]) for [`local`] and [`stream`]: the rows of `a`
/// (`m × k`) packed 256 at a time into `lines_a`, each group just before its blocks,
/// then `ops`' blocks against `pb` (every column panel of `b`, with their `1 / s` in
/// `b_unscale`, both from column 0). In fp16 the rows' scales are `scales` (each row's
/// `s` and `1 / s`, from row 0, padded to whole blocks) where given, else each tile's
/// own rows' ([`pack_a`], [`pack_a_columns`]).
///
/// # Safety
/// The kernel's check must have returned `Ok`; `a` addresses `m × k` valid elements;
/// `pb`, `b_unscale` and `scales` hold every panel and value the blocks read; nothing
/// else writes these blocks of the result meanwhile.
pub(super) unsafe fn pack_rows_and_run(
    ops: &Blocks<'_>,
    runs: &[(std::ops::Range<usize>, std::ops::Range<usize>)],
    (a, m, k): (Mat, usize, usize),
    (pb, b_unscale): (&[u16], &[f32]),
    scales: Option<(&[f32], &[f32])>,
    lines_a: &mut Vec<Line>,
) {
    let half = ops.kernel == Kernel16::Half;
    let panel = ops.kb * TILE;
    let columns = a.rs == 1 && a.cs != 1;
    for (rows, cols) in runs {
        let (i0, i1) = (rows.start * 2 * T, (rows.end * 2 * T).min(m));
        let (j0, j1) = (cols.start * 2 * T, (cols.end * 2 * T).min(ops.n));
        // The run's columns of the packed `b` and their `1 / s`.
        let pb = &pb[(j0 / T) * panel..];
        let b_unscale = b_unscale.get(j0..).unwrap_or(&[]);
        for r0 in (i0..i1).step_by(GROUP * T) {
            let r1 = (r0 + GROUP * T).min(i1);
            // The rows' tiles, an even count (rows past `r1` packed as zeros: `a` seen as
            // `r1` rows).
            let tiles = (r1 - r0).div_ceil(T).next_multiple_of(2);
            let pa = lines(lines_a, tiles * panel);
            // The rows' `1 / s` where the packing finds them.
            let mut found = [1f32; GROUP * T];
            // SAFETY: the kernel's check found AVX-512; `a` addresses `m × k` (and so its
            // first `r1` rows); the scales hold the tiles' rows.
            unsafe {
                match (scales, columns) {
                    (Some((s, _)), true) => {
                        let (s, o) = (&s[r0..], (panel, &mut *pa));
                        if half {
                            pack_a_columns_scaled::<true>(a, (r1, k), r0, s, o)
                        } else {
                            pack_a_columns_scaled::<false>(a, (r1, k), r0, s, o)
                        }
                    }
                    (None, true) => {
                        let (u, o) = (&mut found[..tiles * T], (panel, &mut *pa));
                        if half {
                            pack_a_columns::<true>(a, (r1, k), r0, u, o)
                        } else {
                            pack_a_columns::<false>(a, (r1, k), r0, u, o)
                        }
                    }
                    (Some((s, _)), false) => {
                        for (t, out) in pa.chunks_mut(panel).enumerate() {
                            let (i, s) = (r0 + t * T, &s[r0 + t * T..]);
                            if half {
                                pack_a_scaled::<true>(a, (r1, k), i, s, out)
                            } else {
                                pack_a_scaled::<false>(a, (r1, k), i, s, out)
                            }
                        }
                    }
                    (None, false) => {
                        for (t, out) in pa.chunks_mut(panel).enumerate() {
                            let (i, u) = (r0 + t * T, &mut found[t * T..]);
                            if half {
                                pack_a::<true>(a, (r1, k), i, u, out)
                            } else {
                                pack_a::<false>(a, (r1, k), i, u, out)
                            }
                        }
                    }
                }
                let a_unscale: &[f32] = match scales {
                    _ if !half => &[],
                    Some((_, u)) => &u[r0..],
                    None => &found,
                };
                ops.run((r0, r1, j0, j1), (pa, pb), (a_unscale, b_unscale))
            };
        }
    }
}

/// The blocks `[lo, hi)` of a grid `width` blocks wide, numbered in row-major order, as
/// runs of `(row blocks, column blocks)`: a part of a first row block (from the column
/// `lo` starts at), whole row blocks, a part of a last one (up to the column `hi` ends
/// at); each block in exactly one run.
pub(super) fn block_runs(
    (lo, hi): (usize, usize),
    width: usize,
) -> Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let mut runs = Vec::new();
    let mut at = lo;
    while at < hi {
        let (row, col) = (at / width, at % width);
        if col > 0 || hi - at < width {
            let end = (col + (hi - at)).min(width);
            runs.push((row..row + 1, col..end));
            at += end - col;
        } else {
            let rows = (hi - at) / width;
            runs.push((row..row + rows, 0..width));
            at += rows * width;
        }
    }
    runs
}

/// What the blocks of one product share (see [`Blocks::run`]).
pub(super) struct Blocks<'a> {
    pub(super) kernel: Kernel16,
    /// Tiles of `k`.
    pub(super) kb: usize,
    /// Columns of the result.
    pub(super) n: usize,
    pub(super) out: Out,
    pub(super) ld: isize,
    pub(super) read_dst: bool,
    pub(super) epilogue: Epilogue,
    /// With fp16 and a bias: the bias padded to the blocks' columns.
    pub(super) bias_pad: &'a [f32],
}

impl Blocks<'_> {
    /// The blocks of one part of `k`, `kb` tiles of it: added to the result where they
    /// are not the first part (or where `read_dst`), with the epilogue only where they
    /// are the `last`.
    pub(super) fn part(&self, kb: usize, later: bool, last: bool) -> Self {
        Blocks {
            kb,
            read_dst: self.read_dst || later,
            epilogue: if last {
                self.epilogue
            } else {
                Epilogue::default()
            },
            ..*self
        }
    }

    /// The product's 32 × 32 blocks of rows `[i0, i1)` and columns `[j0, j1)` (`i0`, `j0`
    /// multiples of 32), from the row tiles of `pa` (its first panel row `i0`'s) and the
    /// column tiles of `pb` (its first column `j0`'s), each a panel of `kb` tiles; in
    /// fp16 with the rows' and columns' `1 / s` from `i0` and `j0` on. A block past `i1`
    /// or `n` goes through a scratch block (rows of `pa` past `i1` packed as zeros).
    ///
    /// # Safety
    /// The kernel's check must have returned `Ok`; the panels and scales hold every tile
    /// and value the blocks read; nothing else writes these blocks of `dst` meanwhile.
    pub(super) unsafe fn run(
        &self,
        (i0, i1, j0, j1): (usize, usize, usize, usize),
        (pa, pb): (&[u16], &[u16]),
        (a_unscale, b_unscale): (&[f32], &[f32]),
    ) {
        let Blocks {
            kernel,
            kb,
            n,
            out,
            ld,
            read_dst,
            epilogue,
            bias_pad,
        } = *self;
        let half = kernel == Kernel16::Half;
        let panel = kb * TILE;
        let mut edge = [0f32; 4 * T * T];
        // One 32 × 32 block at rows `i`, columns `j` of the result, over `kc` tiles of `k`,
        // added to the result where `load`.
        let block =
            |c: *mut f32, ldc: usize, ops, (i, j), (kc, load, last): (usize, bool, bool)| unsafe {
                match kernel {
                    Kernel16::Tiles => block(c, ldc, load, ops, kc),
                    Kernel16::Dot => dot_block(c, ldc, load, ops, kc),
                    Kernel16::Half => {
                        let unscale = (
                            a_unscale.as_ptr().add(i - i0),
                            b_unscale.as_ptr().add(j - j0),
                        );
                        let epi = match (last, epilogue.bias) {
                            (true, Some(_)) => (bias_pad.as_ptr().add(j), epilogue.relu),
                            (last, _) => (std::ptr::null(), last && epilogue.relu),
                        };
                        half_block(c, ldc, load, ops, kc, unscale, epi)
                    }
                    Kernel16::Int16 | Kernel16::Int8 => {
                        unreachable!("integer products run in int16/ and int8/")
                    }
                }
            };
        let tiles = kernel == Kernel16::Tiles;
        // SAFETY: the configuration is a valid palette-1 layout; the caller's for the rest.
        unsafe {
            if tiles {
                asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack, readonly));
            }
            // A long `k` by `K_TILES` tiles, every block of the task for each, so that the
            // task's rows and columns of that part stay in the core's cache.
            for t0 in (0..kb).step_by(K_TILES) {
                let kc = (kb - t0).min(K_TILES);
                let load = read_dst || t0 > 0;
                let last = t0 + kc == kb;
                for i in (i0..i1).step_by(2 * T) {
                    let (a0, a1) = (
                        pa.as_ptr().add(((i - i0) / T) * panel + t0 * TILE),
                        pa.as_ptr().add(((i - i0) / T + 1) * panel + t0 * TILE),
                    );
                    for j in (j0..j1).step_by(2 * T) {
                        let q = (j - j0) / T;
                        let ops = (
                            a0,
                            a1,
                            pb.as_ptr().add(q * panel + t0 * TILE),
                            pb.as_ptr().add((q + 1) * panel + t0 * TILE),
                        );
                        let c = out.get().offset(i as isize * ld + j as isize);
                        let (h, w) = ((i1 - i).min(2 * T), (n - j).min(2 * T));
                        if h == 2 * T && w == 2 * T {
                            block(c, ld as usize, ops, (i, j), (kc, load, last));
                        } else {
                            // A block past the matrix's edge: through a 32 × 32 scratch.
                            edge.fill(0.0);
                            if load {
                                for r in 0..h {
                                    for q in 0..w {
                                        edge[r * 2 * T + q] =
                                            *c.offset(r as isize * ld + q as isize);
                                    }
                                }
                            }
                            block(edge.as_mut_ptr(), 2 * T, ops, (i, j), (kc, load, last));
                            for r in 0..h {
                                for q in 0..w {
                                    *c.offset(r as isize * ld + q as isize) = edge[r * 2 * T + q];
                                }
                            }
                        }
                        if last && epilogue.is_some() && !half {
                            finish_block(c, ld, (h, w), j, epilogue);
                        }
                    }
                }
            }
            if tiles {
                asm!("tilerelease", options(nostack, nomem));
            }
        }
    }
}

thread_local! {
    /// The packed left operand of the thread's last product, kept for its next.
    pub(super) static PACKED: std::cell::RefCell<Vec<Line>> = Default::default();
    /// A task's packed columns of the right operand, kept for the thread's next task.
    pub(super) static PACKED_B: std::cell::RefCell<Vec<Line>> = Default::default();
}
