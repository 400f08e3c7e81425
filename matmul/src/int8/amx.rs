//! Intel AMX's `TDPBUSD`: blocks of 32 rows and [`NR`] columns in four 16 × 16 int32
//! tiles, each instruction summing 64 products of unsigned and signed bytes into each of
//! a tile's 256 results. Inline assembly, as the bf16 tiles' (the tile intrinsics are
//! nightly-only); the same tile configuration (every tile 16 rows of 64 bytes).

use std::arch::asm;

use super::*;

/// Rows of a block: two tiles of 16.
pub(crate) const ROWS: usize = 32;
/// Quads of `k` one tile product takes (16 rows of 64 bytes).
pub(crate) const QUADS: usize = 16;

/// Whether this CPU and system run the tiles' int8 products: AMX-INT8 (CPUID leaf 7,
/// EDX bit 25) and the tile state granted (the bf16 tiles' check).
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let leaf = std::arch::x86_64::__cpuid_count(7, 0);
        leaf.edx & (1 << 25) != 0 && crate::float16::tiles_available().is_ok()
    })
}

/// Loads the tile configuration on this thread.
///
/// # Safety
/// [`available`] must have returned `true`.
pub(super) unsafe fn configure() {
    let config = &crate::float16::TILE_CONFIG as *const _;
    // SAFETY: a valid palette-1 configuration; the CPU has the tiles.
    unsafe { asm!("ldtilecfg [{}]", in(reg) config, options(nostack, readonly)) };
}

/// Releases the tiles of this thread.
///
/// # Safety
/// [`configure`] must have run on this thread.
pub(super) unsafe fn release() {
    // SAFETY: the tiles are configured.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The int32 sums `Σ (q_a + 128) · q_b` of one block over `ld` quads (a multiple of
/// [`QUADS`]) into `acc[NR·r + j]`: `a` the block's first row, [`ROWS`] rows `lda` bytes
/// apart (quad `t` at byte `4t`), `b` a panel (quad `t` of column `j` at byte
/// `4·(NR·t + j)`).
///
/// # Safety
/// [`configure`] must have run on this thread; `a` and `b` must address what they say.
pub(super) unsafe fn block(
    a: *const u8,
    lda: usize,
    b: *const i8,
    ld: usize,
    acc: &mut [i32; ROWS * NR],
) {
    debug_assert!(ld.is_multiple_of(QUADS));
    let rs = NR * QUAD;
    // SAFETY: as the caller's; each step reads 16 rows of 64 bytes of each operand tile.
    unsafe {
        crate::float16::zero_tiles();
        for t in (0..ld).step_by(QUADS) {
            let (a0, b0) = (a.add(QUAD * t), b.add(rs * t));
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tdpbusd tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbusd tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tdpbusd tmm2, tmm5, tmm6",
                "tdpbusd tmm3, tmm5, tmm7",
                a0 = in(reg) a0, a1 = in(reg) a0.add(16 * lda),
                b0 = in(reg) b0, b1 = in(reg) b0.add(64),
                sa = in(reg) lda, sb = in(reg) rs, options(nostack, readonly),
            );
        }
        crate::float16::store_tiles(acc.as_mut_ptr() as *mut u8, NR * 4);
    }
}
