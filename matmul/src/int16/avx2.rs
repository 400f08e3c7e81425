//! AVX2's `VPMADDWD`: the 6 × 16 tile of int16 pair products summed in int32, as inline
//! assembly, and the store of its results with the scales undone.

use std::arch::asm;
use std::arch::x86_64::*;

use super::*;

/// One row of [`tile`]'s loop: the row's pair (at byte `$at` of the pair's 24) broadcast
/// into `ymm2`, multiplied with `b`'s two vectors (`ymm0`, `ymm1`) into `ymm3` and `ymm2`,
/// then added to the row's accumulators `ymm$lo` and `ymm$hi`. Both products come before
/// both additions: on Zen 3, whose `VPMADDWD` runs on two of the four vector pipes and
/// `VPADDD` on all four, this order ran the tile loop 7 % faster than a product followed
/// by its addition (a one-core loop in L1: 5.1 against 4.7 G `VPMADDWD` a second, 2026-11-29).
macro_rules! row {
    ($at:literal, $lo:literal, $hi:literal) => {
        concat!(
            "vpbroadcastd ymm2, dword ptr [{a} + ",
            $at,
            "]\n",
            "vpmaddwd ymm3, ymm2, ymm0\n",
            "vpmaddwd ymm2, ymm2, ymm1\n",
            "vpaddd ymm",
            $lo,
            ", ymm",
            $lo,
            ", ymm3\n",
            "vpaddd ymm",
            $hi,
            ", ymm",
            $hi,
            ", ymm2",
        )
    };
}

/// The end of one block of [`tile`]: accumulator `ymm$r` (eight int32 sums) converted to
/// f32, added to its eight floats at byte `$at` of `acc` and stored there, then zeroed.
macro_rules! fold {
    ($r:literal, $at:literal) => {
        concat!(
            "vcvtdq2ps ymm",
            $r,
            ", ymm",
            $r,
            "\n",
            "vaddps ymm",
            $r,
            ", ymm",
            $r,
            ", [{acc} + ",
            $at,
            "]\n",
            "vmovups [{acc} + ",
            $at,
            "], ymm",
            $r,
            "\n",
            "vpxor xmm",
            $r,
            ", xmm",
            $r,
            ", xmm",
            $r,
        )
    };
}

/// One 6 × 16 tile over `pairs ≥ 1` pairs, the rows' pairs at `a` (6 pairs, 24 bytes, a
/// pair of columns), the panel's at `b` (64 bytes a pair): the int32 sums of every
/// [`BLOCK`] pairs converted to f32 and added in order into `acc` (96 values,
/// `acc[16r + j]`), from zero. The whole loop is one piece of assembly, so
/// that a block's sums go into `acc` from their registers.
///
/// # Safety
/// The CPU must have AVX2; `a` must address `pairs` pairs of its panel, `b` `pairs` lanes
/// of its panel.
#[inline]
pub(super) unsafe fn tile(a: *const i16, b: *const i16, pairs: usize, acc: &mut [f32; 96]) {
    debug_assert!(pairs >= 1);
    // SAFETY: as the caller's; the loop reads `pairs` pairs of each row and lanes of `b`,
    // and writes the 96 floats of `acc`.
    unsafe {
        asm!(
            "vpxor xmm4, xmm4, xmm4",
            "vpxor xmm5, xmm5, xmm5",
            "vpxor xmm6, xmm6, xmm6",
            "vpxor xmm7, xmm7, xmm7",
            "vpxor xmm8, xmm8, xmm8",
            "vpxor xmm9, xmm9, xmm9",
            "vpxor xmm10, xmm10, xmm10",
            "vpxor xmm11, xmm11, xmm11",
            "vpxor xmm12, xmm12, xmm12",
            "vpxor xmm13, xmm13, xmm13",
            "vpxor xmm14, xmm14, xmm14",
            "vpxor xmm15, xmm15, xmm15",
            // `acc` zeroed (here: a `memset` call cost 2 % of a training step).
            "vmovups [{acc}], ymm4",
            "vmovups [{acc} + 32], ymm4",
            "vmovups [{acc} + 64], ymm4",
            "vmovups [{acc} + 96], ymm4",
            "vmovups [{acc} + 128], ymm4",
            "vmovups [{acc} + 160], ymm4",
            "vmovups [{acc} + 192], ymm4",
            "vmovups [{acc} + 224], ymm4",
            "vmovups [{acc} + 256], ymm4",
            "vmovups [{acc} + 288], ymm4",
            "vmovups [{acc} + 320], ymm4",
            "vmovups [{acc} + 352], ymm4",
            // A block: `c = min(BLOCK, n)` of the `n` pairs left.
            "3:",
            "mov {c}, {block}",
            "cmp {n}, {block}",
            "cmovb {c}, {n}",
            "sub {n}, {c}",
            "2:",
            "vmovdqu ymm0, [{b}]",
            "vmovdqu ymm1, [{b} + 32]",
            row!("0", "4", "5"),
            row!("4", "6", "7"),
            row!("8", "8", "9"),
            row!("12", "10", "11"),
            row!("16", "12", "13"),
            row!("20", "14", "15"),
            "add {a}, 24",
            "add {b}, 64",
            "dec {c}",
            "jnz 2b",
            fold!("4", "0"),
            fold!("5", "32"),
            fold!("6", "64"),
            fold!("7", "96"),
            fold!("8", "128"),
            fold!("9", "160"),
            fold!("10", "192"),
            fold!("11", "224"),
            fold!("12", "256"),
            fold!("13", "288"),
            fold!("14", "320"),
            fold!("15", "352"),
            "test {n}, {n}",
            "jnz 3b",
            block = const BLOCK,
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            n = inout(reg) pairs => _,
            c = out(reg) _,
            acc = in(reg) acc.as_mut_ptr(),
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack),
        );
    }
}

/// What [`store`] does after a tile's last part: the [`Epilogue`]'s bias (the tile's
/// columns of it) and ReLU.
#[derive(Clone, Copy)]
pub(super) struct Finish<'a> {
    pub(super) bias: Option<&'a [f32]>,
    pub(super) relu: bool,
}

/// `v` as the `relu` kernel leaves it: kept where `v > 0` or `v` is NaN ("not less or
/// equal", unordered), else `+0.0`.
pub(crate) fn relu(v: f32) -> f32 {
    if v > 0.0 || v.is_nan() {
        v
    } else {
        0.0
    }
}

/// A tile's sums, unscaled (`acc[16r + j] · inv_a[r] · inv_b[j]`), written into the
/// `inv_a.len()` rows and `inv_b.len()` columns at `d` (row stride `ld`), or added to
/// what they hold unless `fresh`; then, after the last part of `k` (`finish`), the bias
/// added to the whole sum and the ReLU applied, as a pass after the product would.
///
/// # Safety
/// `d` must address those rows and columns; a bias must hold the tile's columns; the CPU
/// must have AVX2.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn store(
    acc: &[f32; 96],
    (inv_a, inv_b): (&[f32], &[f32]),
    (d, ld): (*mut f32, isize),
    fresh: bool,
    finish: Option<Finish<'_>>,
) {
    let w = inv_b.len();
    let (bias, relu_on) = finish.map_or((None, false), |f| (f.bias, f.relu));
    let zero = _mm256_setzero_ps();
    for (r, &sa) in inv_a.iter().enumerate() {
        // SAFETY: row `r` of the tile, as the caller's.
        let row = unsafe { d.offset(r as isize * ld) };
        let acc = &acc[NR * r..NR * (r + 1)];
        if w == NR {
            for h in 0..2 {
                // SAFETY: 8 values at `8h` of each (a bias holds the tile's 16 columns);
                // columns `8h..8h + 8` of the row.
                unsafe {
                    let mut v = _mm256_mul_ps(
                        _mm256_mul_ps(_mm256_loadu_ps(acc.as_ptr().add(8 * h)), _mm256_set1_ps(sa)),
                        _mm256_loadu_ps(inv_b.as_ptr().add(8 * h)),
                    );
                    let p = row.add(8 * h);
                    if !fresh {
                        v = _mm256_add_ps(_mm256_loadu_ps(p), v);
                    }
                    if let Some(b) = bias {
                        v = _mm256_add_ps(v, _mm256_loadu_ps(b.as_ptr().add(8 * h)));
                    }
                    if relu_on {
                        let keep = _mm256_cmp_ps::<_CMP_NLE_UQ>(v, zero);
                        v = _mm256_and_ps(v, keep);
                    }
                    _mm256_storeu_ps(p, v);
                }
            }
        } else {
            for j in 0..w {
                // SAFETY: column `j < w` of the row.
                let p = unsafe { row.add(j) };
                let mut v = acc[j] * sa * inv_b[j];
                if !fresh {
                    // SAFETY: as above.
                    v += unsafe { *p };
                }
                if let Some(b) = bias {
                    v += b[j];
                }
                if relu_on {
                    v = relu(v);
                }
                // SAFETY: as above.
                unsafe { *p = v };
            }
        }
    }
}
