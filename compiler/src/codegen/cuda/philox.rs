//! Philox4x32-10 and the dropout mask in CUDA C, bit-identical to [`crate::rng`].
//!
//! In: nothing (fixed text). Out: two prelude functions:
//!
//! - `kiln_dropout_word(seed, step, stream, i)` — word `i % 4` of Philox4x32-10 with
//!   counter `(i/4 low, i/4 high, stream, step)` and key `(seed low, seed high)`
//!   ([`crate::rng::dropout_words`]);
//! - `kiln_keep(seed, step, stream, i, threshold)` — `(word >> 8) >= threshold`
//!   ([`crate::rng::dropout_keep`]; the threshold is [`crate::rng::dropout_threshold`]).
//!
//! The 32×32→64 multiplications are `__umulhi` (high half) and the wrapping `unsigned`
//! product (low half). Each element computes its own block's four words and keeps one:
//! four times the arithmetic of sharing them, but no cross-thread traffic.

use crate::codegen::cuda::text::W;

/// The Philox constants of [`crate::rng`] (Salmon et al.: multipliers, Weyl increments).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Writes the Philox and dropout-mask functions.
pub fn write(w: &mut W) {
    w.l("// Philox4x32-10 (crate::rng): word i % 4 of the block i / 4 of a dropout stream.");
    w.open("__device__ unsigned kiln_dropout_word(unsigned long long seed, unsigned step, unsigned stream, unsigned long long i)");
    w.l("const unsigned long long blk = i >> 2;");
    w.l("unsigned c0 = (unsigned)blk, c1 = (unsigned)(blk >> 32), c2 = stream, c3 = step;");
    w.l("unsigned k0 = (unsigned)seed, k1 = (unsigned)(seed >> 32);");
    w.open("for (int r = 0; r < 10; ++r)");
    w.open("if (r > 0)");
    w.l(format!("k0 += 0x{W0:08x}u;"));
    w.l(format!("k1 += 0x{W1:08x}u;"));
    w.close();
    w.l(format!("const unsigned hi0 = __umulhi(0x{M0:08x}u, c0);"));
    w.l(format!("const unsigned lo0 = 0x{M0:08x}u * c0;"));
    w.l(format!("const unsigned hi1 = __umulhi(0x{M1:08x}u, c2);"));
    w.l(format!("const unsigned lo1 = 0x{M1:08x}u * c2;"));
    w.l("c0 = hi1 ^ c1 ^ k0;");
    w.l("c1 = lo1;");
    w.l("c2 = hi0 ^ c3 ^ k1;");
    w.l("c3 = lo0;");
    w.close();
    w.l("const unsigned lane = (unsigned)(i & 3);");
    w.l("return lane == 0 ? c0 : lane == 1 ? c1 : lane == 2 ? c2 : c3;");
    w.close();
    w.l("// Whether element i of a dropout node survives (crate::rng::dropout_keep).");
    w.open("__device__ __forceinline__ bool kiln_keep(unsigned long long seed, unsigned step, unsigned stream, unsigned long long i, unsigned threshold)");
    w.l("return (kiln_dropout_word(seed, step, stream, i) >> 8) >= threshold;");
    w.close();
}
