//! Philox4x32-10 and the dropout mask in CUDA C, bit-identical to [`crate::rng`].
//!
//! In: nothing (fixed text). Out: prelude functions:
//!
//! - `kiln_dropout_block(seed, step, stream, blk)` — the four words (`kiln_words4`) of
//!   Philox4x32-10 with counter `(blk low, blk high, stream, step)` and key `(seed low,
//!   seed high)` ([`crate::rng::dropout_words`]): the words of elements `4·blk` to
//!   `4·blk + 3`;
//! - `kiln_word_of(b, u)` — word `u` (0..4) of a block, selected without indexing (the
//!   four words stay in registers);
//! - `kiln_dropout_word(seed, step, stream, i)` — word `i % 4` of block `i / 4`;
//! - `kiln_keep(seed, step, stream, i, threshold)` — `(word >> 8) >= threshold`
//!   ([`crate::rng::dropout_keep`]; the threshold is [`crate::rng::dropout_threshold`]),
//!   and `kiln_keep_word(word, threshold)`, the same test of a word already drawn.
//!
//! The 32×32→64 multiplications are `__umulhi` (high half) and the wrapping `unsigned`
//! product (low half). Kernels that own four consecutive elements per thread (regions,
//! `embed_pe`: [`super::Work::Quads`]) draw one block for the four; others draw a block
//! per element and keep one word.

use crate::codegen::cuda::text::W;

/// The Philox constants of [`crate::rng`] (Salmon et al.: multipliers, Weyl increments).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Writes the Philox and dropout-mask functions.
pub fn write(w: &mut W) {
    w.l("// Philox4x32-10 (crate::rng): the four words of block blk of a dropout stream.");
    w.l("typedef struct { unsigned w0, w1, w2, w3; } kiln_words4;");
    w.open("__device__ kiln_words4 kiln_dropout_block(unsigned long long seed, unsigned step, unsigned stream, unsigned long long blk)");
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
    w.l("kiln_words4 b;");
    w.l("b.w0 = c0;");
    w.l("b.w1 = c1;");
    w.l("b.w2 = c2;");
    w.l("b.w3 = c3;");
    w.l("return b;");
    w.close();
    w.l("// Word u (0..4) of a block.");
    w.open("__device__ __forceinline__ unsigned kiln_word_of(kiln_words4 b, unsigned u)");
    w.l("return u == 0 ? b.w0 : u == 1 ? b.w1 : u == 2 ? b.w2 : b.w3;");
    w.close();
    w.l("// Word i % 4 of the block i / 4.");
    w.open("__device__ __forceinline__ unsigned kiln_dropout_word(unsigned long long seed, unsigned step, unsigned stream, unsigned long long i)");
    w.l("return kiln_word_of(kiln_dropout_block(seed, step, stream, i >> 2), (unsigned)(i & 3));");
    w.close();
    w.l("// Whether an element whose word is `word` survives.");
    w.open("__device__ __forceinline__ bool kiln_keep_word(unsigned word, unsigned threshold)");
    w.l("return (word >> 8) >= threshold;");
    w.close();
    w.l("// Whether element i of a dropout node survives (crate::rng::dropout_keep).");
    w.open("__device__ __forceinline__ bool kiln_keep(unsigned long long seed, unsigned step, unsigned stream, unsigned long long i, unsigned threshold)");
    w.l("return kiln_keep_word(kiln_dropout_word(seed, step, stream, i), threshold);");
    w.close();
}
