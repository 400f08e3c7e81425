//! Intel AMX: the tile configuration and one block of tile products (`TDPBF16PS`),
//! written as inline assembly (the tile intrinsics are nightly-only).

use std::arch::asm;

use super::*;

/// The 64-byte tile configuration (palette 1) that `LDTILECFG` loads: tiles 0–3 the
/// 16 × 16 f32 results, 4–5 the left operand's 16 × 32 bf16, 6–7 the right operand's
/// 16 pair rows × 16 columns.
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

pub(crate) const CONFIG: TileConfig = {
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

/// One 32 × 32 result block over the whole `k`: `c` (row stride `ldc` floats) is loaded
/// into tiles 0–3 if `load`, else they start at zero; `a0`, `a1` are the two row tiles'
/// packed panels, `b0`, `b1` the two column tiles', each `kb` tiles long.
///
/// # Safety
/// The tile configuration must be loaded; every pointer addresses what it says.
#[inline(always)]
pub(super) unsafe fn block(
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
            zero_tiles();
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
        store_tiles(c as *mut u8, cs);
    }
}

/// Tiles 0–3 (a block's results) set to zero.
///
/// # Safety
/// The tile configuration must be loaded.
#[inline(always)]
pub(crate) unsafe fn zero_tiles() {
    // SAFETY: as the caller's.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        )
    };
}

/// Tiles 0–3, a 32 × 32 block of 4-byte results, stored at `c` (`stride` bytes a row):
/// tile 0 the top left 16 × 16, 1 the top right, 2 and 3 the bottom ones.
///
/// # Safety
/// The tile configuration must be loaded; `c` must address the block.
#[inline(always)]
pub(crate) unsafe fn store_tiles(c: *mut u8, stride: usize) {
    // SAFETY: as the caller's.
    unsafe {
        let c2 = c.add(16 * stride);
        asm!(
            "tilestored [{c0} + {s}*1], tmm0",
            "tilestored [{c1} + {s}*1], tmm1",
            "tilestored [{c2} + {s}*1], tmm2",
            "tilestored [{c3} + {s}*1], tmm3",
            c0 = in(reg) c, c1 = in(reg) c.add(64), c2 = in(reg) c2, c3 = in(reg) c2.add(64),
            s = in(reg) stride, options(nostack),
        );
    }
}
