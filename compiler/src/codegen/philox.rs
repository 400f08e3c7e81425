//! Philox4x32-10 in CLIF: the dropout mask of [`crate::rng`], bit for bit, in kernels.
//! The `embed_pe` kernel draws its masks with it; region kernels call
//! [`super::masks`] instead (AVX-512, a quarter of the time).
//!
//! In: CLIF values for the run's seed (`i64`), the training step and the dropout node's
//! stream and threshold (`i32`), and element flat indices (`i64`). Out: whether each
//! element is kept — an `i8` condition for scalar code, an `I32X4` lane mask for four
//! consecutive elements (both usable with [`Kb::select`]).
//!
//! The generator is scalar `i32` arithmetic (`imul` for the low half of each product,
//! `umulhi` for the high half), exactly [`crate::rng::philox4x32_10`]. Everything that
//! does not depend on the element — the ten round keys, and the parts of the first
//! round that only read the stream and step counter words — is computed once by
//! [`Dropout::new`], where the caller places it (the kernel's entry block), so one draw
//! costs nine full rounds and half of the first.
//!
//! Element `i` reads word `i % 4` of counter block `i / 4` (see [`crate::rng`]). Four
//! consecutive elements starting at a multiple of 4 share one call; a run of four that
//! straddles two blocks takes two calls and picks its words by `i % 4` (see
//! [`Dropout::keep_mask4`]).
//!
//! Sixteen consecutive elements starting at a multiple of 4 (four whole blocks) are drawn
//! four blocks at a time in `I32X4` lanes ([`Dropout::keep_masks16`]): each 32×32→64-bit
//! product is two `pmuludq` (`imul` of `uwiden_low`/`uwiden_high`) and two `shufps`
//! that gather the low and high halves, and a 4×4 transpose turns the words of four
//! blocks into the masks of four consecutive vectors. Same bits, about a third of the
//! instructions per element of the scalar generator.

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{types, ConstantData, InstBuilder, Value};

use crate::codegen::clif::{lanes, Kb, VI};

/// Philox multipliers and Weyl increments (as in [`crate::rng`]).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn c32(kb: &mut Kb, v: u32) -> Value {
    kb.b.ins().iconst(types::I32, i64::from(v))
}

/// One Philox round on `i32` values (key words `k`).
fn round(kb: &mut Kb, c: [Value; 4], k: [Value; 2]) -> [Value; 4] {
    let m0 = c32(kb, M0);
    let m1 = c32(kb, M1);
    let hi0 = kb.b.ins().umulhi(m0, c[0]);
    let lo0 = kb.b.ins().imul(m0, c[0]);
    let hi1 = kb.b.ins().umulhi(m1, c[2]);
    let lo1 = kb.b.ins().imul(m1, c[2]);
    let a = kb.b.ins().bxor(hi1, c[1]);
    let a = kb.b.ins().bxor(a, k[0]);
    let b = kb.b.ins().bxor(hi0, c[3]);
    let b = kb.b.ins().bxor(b, k[1]);
    [a, lo1, b, lo0]
}

/// The ten round keys for `key` (`i32` words): key `r` is `key + r·(W0, W1)`.
pub fn round_keys(kb: &mut Kb, key: [Value; 2]) -> Vec<[Value; 2]> {
    let mut keys = vec![key];
    for r in 1..10u32 {
        let k0 = c32(kb, W0.wrapping_mul(r));
        let k1 = c32(kb, W1.wrapping_mul(r));
        let a = kb.b.ins().iadd(key[0], k0);
        let b = kb.b.ins().iadd(key[1], k1);
        keys.push([a, b]);
    }
    keys
}

/// Philox4x32-10 of counter `ctr` under `key` (all `i32` values), as
/// [`crate::rng::philox4x32_10`].
pub fn philox4x32_10(kb: &mut Kb, ctr: [Value; 4], key: [Value; 2]) -> [Value; 4] {
    let keys = round_keys(kb, key);
    let mut c = ctr;
    for k in keys {
        c = round(kb, c, k);
    }
    c
}

/// A dropout node's generator state for one kernel call: round keys and first-round
/// invariants (from the seed, step and stream), and the threshold.
#[derive(Clone, Debug)]
pub struct Dropout {
    keys: Vec<[Value; 2]>,
    /// First round, counter words 2 and 3 only: `umulhi(M1, stream) ^ key0`,
    /// `M1 · stream`, `step ^ key1`.
    r0_a: Value,
    r0_lo1: Value,
    r0_b: Value,
    /// `i32`: an element is kept iff `(word >> 8) >= threshold` (unsigned).
    threshold: Value,
}

impl Dropout {
    /// Sets up the generator: `seed` is an `i64` (the `u64` seed's bits), `step`,
    /// `stream` and `threshold` are `i32` values. Call it where the result dominates every
    /// use (the kernel's entry block).
    pub fn new(kb: &mut Kb, seed: Value, step: Value, stream: Value, threshold: Value) -> Self {
        let k0 = kb.b.ins().ireduce(types::I32, seed);
        let hi = kb.b.ins().ushr_imm_u(seed, 32);
        let k1 = kb.b.ins().ireduce(types::I32, hi);
        let keys = round_keys(kb, [k0, k1]);
        let m1 = c32(kb, M1);
        let hi1 = kb.b.ins().umulhi(m1, stream);
        let r0_lo1 = kb.b.ins().imul(m1, stream);
        let r0_a = kb.b.ins().bxor(hi1, keys[0][0]);
        let r0_b = kb.b.ins().bxor(step, keys[0][1]);
        Dropout {
            keys,
            r0_a,
            r0_lo1,
            r0_b,
            threshold,
        }
    }

    /// [`Dropout::new`] with a stream and threshold known when the kernel is built.
    pub fn with_consts(kb: &mut Kb, seed: Value, step: Value, stream: u32, threshold: u32) -> Self {
        let stream = c32(kb, stream);
        let threshold = c32(kb, threshold);
        Dropout::new(kb, seed, step, stream, threshold)
    }

    /// The four words of counter block `block` (`i64`).
    pub fn block(&self, kb: &mut Kb, block: Value) -> [Value; 4] {
        let c0 = kb.b.ins().ireduce(types::I32, block);
        let hi = kb.b.ins().ushr_imm_u(block, 32);
        let c1 = kb.b.ins().ireduce(types::I32, hi);
        // Round 0 with the invariant half precomputed.
        let m0 = c32(kb, M0);
        let hi0 = kb.b.ins().umulhi(m0, c0);
        let lo0 = kb.b.ins().imul(m0, c0);
        let a = kb.b.ins().bxor(self.r0_a, c1);
        let b = kb.b.ins().bxor(hi0, self.r0_b);
        let mut c = [a, self.r0_lo1, b, lo0];
        for &k in &self.keys[1..] {
            c = round(kb, c, k);
        }
        c
    }

    /// Whether word `w` (`i32`) keeps its element: an `i8` condition.
    pub fn keep_word(&self, kb: &mut Kb, w: Value) -> Value {
        let top = kb.b.ins().ushr_imm_u(w, 8);
        kb.b.ins()
            .icmp(IntCC::UnsignedGreaterThanOrEqual, top, self.threshold)
    }

    /// Whether element `index` (`i64`) is kept: an `i8` condition (see
    /// [`crate::rng::dropout_keep`]).
    pub fn keep(&self, kb: &mut Kb, index: Value) -> Value {
        let blk = kb.b.ins().ushr_imm_u(index, 2);
        let w = self.block(kb, blk);
        let r = kb.b.ins().band_imm_u(index, 3);
        let r = kb.b.ins().ireduce(types::I32, r);
        let word = pick(kb, r, &w);
        self.keep_word(kb, word)
    }

    /// The lane mask (`I32X4`, all ones where kept) of elements `index .. index + 4`.
    /// One Philox call when `index` is a multiple of 4; otherwise two (the run straddles
    /// two blocks), chosen by a branch.
    pub fn keep_mask4(&self, kb: &mut Kb, index: Value) -> Value {
        let blk = kb.b.ins().ushr_imm_u(index, 2);
        let r = kb.b.ins().band_imm_u(index, 3);
        let r = kb.b.ins().ireduce(types::I32, r);
        let aligned = kb.b.create_block();
        let straddle = kb.b.create_block();
        let join = kb.b.create_block();
        kb.b.append_block_param(join, VI);
        kb.b.ins().brif(r, straddle, &[], aligned, &[]);

        kb.b.switch_to_block(aligned);
        let w = self.block(kb, blk);
        let m = self.mask_of_words(kb, w);
        kb.b.ins().jump(join, &[m.into()]);

        kb.b.switch_to_block(straddle);
        let w0 = self.block(kb, blk);
        let blk1 = kb.b.ins().iadd_imm_s(blk, 1);
        let w1 = self.block(kb, blk1);
        let all = [w0[0], w0[1], w0[2], w0[3], w1[0], w1[1], w1[2], w1[3]];
        // r ∈ {1, 2, 3}: lane l reads word r + l of the eight.
        let is1 = kb.b.ins().icmp_imm_u(IntCC::Equal, r, 1);
        let is2 = kb.b.ins().icmp_imm_u(IntCC::Equal, r, 2);
        let mut lanes = [w0[0]; 4];
        for (l, lane) in lanes.iter_mut().enumerate() {
            let r3 = kb.b.ins().select(is2, all[l + 2], all[l + 3]);
            *lane = kb.b.ins().select(is1, all[l + 1], r3);
        }
        let m = self.mask_of_words(kb, lanes);
        kb.b.ins().jump(join, &[m.into()]);

        kb.b.switch_to_block(join);
        kb.b.block_params(join)[0]
    }

    /// The `I32X4` keep mask of four words (lane `l` from `w[l]`).
    fn mask_of_words(&self, kb: &mut Kb, w: [Value; 4]) -> Value {
        let mut v = kb.b.ins().scalar_to_vector(VI, w[0]);
        for (l, &x) in w.iter().enumerate().skip(1) {
            v = kb.b.ins().insertlane(v, x, l as u8);
        }
        let top = kb.b.ins().ushr_imm_u(v, 8);
        let t = kb.b.ins().splat(VI, self.threshold);
        kb.b.ins().icmp(IntCC::UnsignedGreaterThanOrEqual, top, t)
    }
}

impl Dropout {
    /// The lane masks (`I32X4`, all ones where kept) of the sixteen elements
    /// `index .. index + 16`, four per vector in order. One vectorized call for four
    /// blocks when `index` is a multiple of 4; otherwise four [`Dropout::keep_mask4`]s,
    /// chosen by a branch.
    pub fn keep_masks16(&self, kb: &mut Kb, index: Value) -> [Value; 4] {
        let r = kb.b.ins().band_imm_u(index, 3);
        let aligned = kb.b.create_block();
        let straddle = kb.b.create_block();
        let join = kb.b.create_block();
        for _ in 0..4 {
            kb.b.append_block_param(join, VI);
        }
        kb.b.ins().brif(r, straddle, &[], aligned, &[]);

        kb.b.switch_to_block(aligned);
        let blk = kb.b.ins().ushr_imm_u(index, 2);
        let w = self.blocks4(kb, blk);
        let m = w.map(|w| {
            let top = kb.b.ins().ushr_imm_u(w, 8);
            let t = kb.b.ins().splat(VI, self.threshold);
            kb.b.ins().icmp(IntCC::UnsignedGreaterThanOrEqual, top, t)
        });
        // Lane j of word vector w holds word w of block j; element 4j + w is lane w of
        // mask vector j: a 4×4 transpose.
        let t0 = shuffle32(kb, m[0], m[1], [0, 4, 1, 5]);
        let t1 = shuffle32(kb, m[2], m[3], [0, 4, 1, 5]);
        let t2 = shuffle32(kb, m[0], m[1], [2, 6, 3, 7]);
        let t3 = shuffle32(kb, m[2], m[3], [2, 6, 3, 7]);
        let out = [
            shuffle32(kb, t0, t1, [0, 1, 4, 5]),
            shuffle32(kb, t0, t1, [2, 3, 6, 7]),
            shuffle32(kb, t2, t3, [0, 1, 4, 5]),
            shuffle32(kb, t2, t3, [2, 3, 6, 7]),
        ];
        let args: Vec<_> = out.iter().map(|&v| v.into()).collect();
        kb.b.ins().jump(join, &args);

        kb.b.switch_to_block(straddle);
        let mut out = [index; 4];
        for (j, o) in out.iter_mut().enumerate() {
            let at = kb.b.ins().iadd_imm_s(index, 4 * j as i64);
            *o = self.keep_mask4(kb, at);
        }
        let args: Vec<_> = out.iter().map(|&v| v.into()).collect();
        kb.b.ins().jump(join, &args);

        kb.b.switch_to_block(join);
        let p = kb.b.block_params(join);
        [p[0], p[1], p[2], p[3]]
    }

    /// The words of the four counter blocks `blk .. blk + 4` (`blk` an `i64`): vector
    /// `w` holds word `w` of block `blk + j` in lane `j`.
    fn blocks4(&self, kb: &mut Kb, blk: Value) -> [Value; 4] {
        let lo = kb.b.ins().ireduce(types::I32, blk);
        let hi = kb.b.ins().ushr_imm_u(blk, 32);
        let hi = kb.b.ins().ireduce(types::I32, hi);
        let lo_v = kb.b.ins().splat(VI, lo);
        let steps = vconst_i32(kb, [0, 1, 2, 3]);
        let c0 = kb.b.ins().iadd(lo_v, steps);
        // A lane whose low word wrapped carries into the high word (all ones = −1).
        let carry = kb.b.ins().icmp(IntCC::UnsignedLessThan, c0, lo_v);
        let hi_v = kb.b.ins().splat(VI, hi);
        let c1 = kb.b.ins().isub(hi_v, carry);
        // Round 0 with the invariant half precomputed (as `block`).
        let (hi0, lo0) = mulhilo4(kb, M0, c0);
        let r0_a = kb.b.ins().splat(VI, self.r0_a);
        let a = kb.b.ins().bxor(r0_a, c1);
        let r0_b = kb.b.ins().splat(VI, self.r0_b);
        let b = kb.b.ins().bxor(hi0, r0_b);
        let r0_lo1 = kb.b.ins().splat(VI, self.r0_lo1);
        let mut c = [a, r0_lo1, b, lo0];
        for &[k0, k1] in &self.keys[1..] {
            let (hi0, lo0) = mulhilo4(kb, M0, c[0]);
            let (hi1, lo1) = mulhilo4(kb, M1, c[2]);
            let k0 = kb.b.ins().splat(VI, k0);
            let k1 = kb.b.ins().splat(VI, k1);
            let a = kb.b.ins().bxor(hi1, c[1]);
            let a = kb.b.ins().bxor(a, k0);
            let b = kb.b.ins().bxor(hi0, c[3]);
            let b = kb.b.ins().bxor(b, k1);
            c = [a, lo1, b, lo0];
        }
        c
    }
}

/// The high and low words of `m · x` in each `i32` lane of `x` (unsigned).
fn mulhilo4(kb: &mut Kb, m: u32, x: Value) -> (Value, Value) {
    let mv = vconst_i32(kb, [m; 4]);
    let xl = kb.b.ins().uwiden_low(x);
    let ml = kb.b.ins().uwiden_low(mv);
    let p01 = kb.b.ins().imul(xl, ml);
    let xh = kb.b.ins().uwiden_high(x);
    let mh = kb.b.ins().uwiden_high(mv);
    let p23 = kb.b.ins().imul(xh, mh);
    let p01 = kb.b.ins().bitcast(VI, lanes(), p01);
    let p23 = kb.b.ins().bitcast(VI, lanes(), p23);
    let lo = shuffle32(kb, p01, p23, [0, 2, 4, 6]);
    let hi = shuffle32(kb, p01, p23, [1, 3, 5, 7]);
    (hi, lo)
}

/// An `I32X4` constant.
fn vconst_i32(kb: &mut Kb, v: [u32; 4]) -> Value {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let c = kb.b.func.dfg.constants.insert(ConstantData::from(bytes));
    kb.b.ins().vconst(VI, c)
}

/// Lanes `sel` (0–3 from `a`, 4–7 from `b`) of two `I32X4` values.
fn shuffle32(kb: &mut Kb, a: Value, b: Value, sel: [u8; 4]) -> Value {
    let bytes: Vec<u8> = sel
        .iter()
        .flat_map(|&l| (0..4).map(move |k| 4 * l + k))
        .collect();
    let imm = kb.b.func.dfg.immediates.push(ConstantData::from(bytes));
    let a8 = kb.b.ins().bitcast(types::I8X16, lanes(), a);
    let b8 = kb.b.ins().bitcast(types::I8X16, lanes(), b);
    let s = kb.b.ins().shuffle(a8, b8, imm);
    kb.b.ins().bitcast(VI, lanes(), s)
}

/// `w[r]` for an `i32` `r` in `0..4` (selects, no memory).
fn pick(kb: &mut Kb, r: Value, w: &[Value; 4]) -> Value {
    let is1 = kb.b.ins().icmp_imm_u(IntCC::Equal, r, 1);
    let is2 = kb.b.ins().icmp_imm_u(IntCC::Equal, r, 2);
    let is3 = kb.b.ins().icmp_imm_u(IntCC::Equal, r, 3);
    let a = kb.b.ins().select(is1, w[1], w[0]);
    let a = kb.b.ins().select(is2, w[2], a);
    kb.b.ins().select(is3, w[3], a)
}
