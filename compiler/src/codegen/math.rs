//! Transcendental functions as polynomials in CLIF, for `F32X4` and `F32` alike.
//!
//! No per-element libcalls: `exp`, `log`, `sin` and `cos` are the Cephes single-precision
//! algorithms (range reduction, a minimax polynomial evaluated with FMA, reconstruction
//! by exponent bits), accurate to about 2 ulp on their main range:
//!
//! - `exp`: `x = n·ln2 + r` (two-part `ln2`), degree-6 polynomial in `r`, scaled by
//!   `2^n` built in the exponent field; `x < −87.34` gives `0`, `x > 88.72` gives `+inf`,
//!   NaN stays NaN.
//! - `log`: `x = m·2^e` with `m ∈ [√½, √2)`, degree-9 polynomial in `m − 1`; `log 0 =
//!   −inf`, `log x<0 = NaN`, `log inf = inf`. Subnormal inputs are not special-cased.
//! - `sin`/`cos`: reduction by `π/4` in three parts (exact for |x| up to a few thousand,
//!   enough for sinusoidal positions), then the sine or cosine polynomial by octant.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, InstBuilder, Value};

use crate::codegen::clif::{int_of, lanes, Kb};

/// `e^x`.
pub fn exp(kb: &mut Kb, x: Value) -> Value {
    exp_with(kb, x, true)
}

/// `e^x` for an argument known not to exceed 88.72, such as a softmax's `x − max x ≤ 0`:
/// [`exp`] without its overflow test (a comparison and two selects), the same bits
/// wherever `x ≤ 88.72` (NaN and `−inf` included). Past 88.72 the result is garbage,
/// not `+inf`.
pub fn exp_nonpositive(kb: &mut Kb, x: Value) -> Value {
    exp_with(kb, x, false)
}

/// [`exp`], or without its upper clamp ([`exp_nonpositive`]).
fn exp_with(kb: &mut Kb, x: Value, upper: bool) -> Value {
    let ty = kb.ty(x);
    let ity = int_of(ty);
    let hi = upper.then(|| kb.fconst(ty, 88.722_83));
    let lo = kb.fconst(ty, -87.336_54);
    let too_big = hi.map(|hi| kb.b.ins().fcmp(FloatCC::GreaterThan, x, hi));
    let too_small = kb.b.ins().fcmp(FloatCC::LessThan, x, lo);
    let xc = match too_big.zip(hi) {
        Some((too_big, hi)) => kb.select(too_big, hi, x),
        None => x,
    };
    let xc = kb.select(too_small, lo, xc);

    let log2e = kb.fconst(ty, std::f32::consts::LOG2_E);
    let t = kb.b.ins().fmul(xc, log2e);
    // n = nearest(t) by the magic-number trick: adding 1.5·2²³ rounds t to an integer
    // (to nearest, ties to even — exactly what `nearest` does) and leaves n in the low
    // mantissa bits. Cheaper than `nearest` plus a saturating conversion, and the same
    // bits for |t| < 2²², which the clamp above guarantees.
    let magic = kb.fconst(ty, 12_582_912.0);
    let tm = kb.b.ins().fadd(t, magic);
    let fx = kb.b.ins().fsub(tm, magic);
    let c1 = kb.fconst(ty, -0.693_359_4);
    let c2 = kb.fconst(ty, 2.121_944_4e-4);
    let r = kb.fma(fx, c1, xc);
    let r = kb.fma(fx, c2, r);
    let z = kb.b.ins().fmul(r, r);
    let mut y = kb.fconst(ty, 1.987_569_1e-4);
    for c in [
        1.398_2e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        let k = kb.fconst(ty, c);
        y = kb.fma(y, r, k);
    }
    let y = kb.fma(y, z, r);
    let one = kb.fconst(ty, 1.0);
    let y = kb.b.ins().fadd(y, one);

    // bits(tm) = 0x4B40_0000 + n; shifted left by 23 the constant part leaves the word
    // (its lowest set bit is bit 22), so (bits(tm) + 127) << 23 is 2^n's bits.
    let n = kb.b.ins().bitcast(ity, lanes(), tm);
    let bias = kb.i32const(ity, 127);
    let e = kb.b.ins().iadd(n, bias);
    let e = kb.b.ins().ishl_imm_u(e, 23);
    let pow2 = kb.b.ins().bitcast(ty, lanes(), e);
    let res = kb.b.ins().fmul(y, pow2);

    let inf = upper.then(|| kb.fconst(ty, f32::INFINITY));
    let zero = kb.fconst(ty, 0.0);
    let res = match too_big.zip(inf) {
        Some((too_big, inf)) => kb.select(too_big, inf, res),
        None => res,
    };
    kb.select(too_small, zero, res)
}

/// `ln x`.
pub fn log(kb: &mut Kb, x: Value) -> Value {
    let ty = kb.ty(x);
    let ity = int_of(ty);
    let bits = kb.b.ins().bitcast(ity, lanes(), x);
    let e = kb.b.ins().sshr_imm_u(bits, 23);
    let e = {
        let mask = kb.i32const(ity, 0xff);
        kb.b.ins().band(e, mask)
    };
    let bias = kb.i32const(ity, 127);
    let e = kb.b.ins().isub(e, bias);
    let mant = kb.i32const(ity, 0x007f_ffff);
    let m = kb.b.ins().band(bits, mant);
    let one_bits = kb.i32const(ity, 0x3f80_0000);
    let m = kb.b.ins().bor(m, one_bits);
    let m = kb.b.ins().bitcast(ty, lanes(), m);
    // m in [1, 2): fold to [√½, √2).
    let sqrt2 = kb.fconst(ty, std::f32::consts::SQRT_2);
    let big = kb.b.ins().fcmp(FloatCC::GreaterThan, m, sqrt2);
    let half = kb.fconst(ty, 0.5);
    let mh = kb.b.ins().fmul(m, half);
    let m = kb.select(big, mh, m);
    let one_i = kb.i32const(ity, 1);
    let e1 = kb.b.ins().iadd(e, one_i);
    let big_i = if ty.is_vector() {
        kb.b.ins().bitcast(ity, lanes(), big)
    } else {
        big
    };
    let e = if ty.is_vector() {
        kb.b.ins().bitselect(big_i, e1, e)
    } else {
        kb.b.ins().select(big_i, e1, e)
    };
    let one = kb.fconst(ty, 1.0);
    let xm = kb.b.ins().fsub(m, one);
    let z = kb.b.ins().fmul(xm, xm);
    let mut y = kb.fconst(ty, 7.037_683_6e-2);
    for c in [
        -1.151_461e-1,
        1.167_699_9e-1,
        -1.242_014_1e-1,
        1.424_932_3e-1,
        -1.666_805_8e-1,
        2.000_071_5e-1,
        -2.499_999_4e-1,
        0.333_333_33,
    ] {
        let k = kb.fconst(ty, c);
        y = kb.fma(y, xm, k);
    }
    let y = kb.b.ins().fmul(y, xm);
    let y = kb.b.ins().fmul(y, z);
    let fe = kb.b.ins().fcvt_from_sint(ty, e);
    let c2 = kb.fconst(ty, -2.121_944_4e-4);
    let y = kb.fma(fe, c2, y);
    let mhalf = kb.fconst(ty, -0.5);
    let y = kb.fma(z, mhalf, y);
    let r = kb.b.ins().fadd(xm, y);
    let c1 = kb.fconst(ty, 0.693_359_4);
    let r = kb.fma(fe, c1, r);

    // Special values.
    let zero = kb.fconst(ty, 0.0);
    let inf = kb.fconst(ty, f32::INFINITY);
    let ninf = kb.fconst(ty, f32::NEG_INFINITY);
    let nan = kb.fconst(ty, f32::NAN);
    let is_zero = kb.b.ins().fcmp(FloatCC::Equal, x, zero);
    let is_neg = kb.b.ins().fcmp(FloatCC::LessThan, x, zero);
    let is_inf = kb.b.ins().fcmp(FloatCC::Equal, x, inf);
    let is_nan = kb.b.ins().fcmp(FloatCC::Unordered, x, x);
    let r = kb.select(is_zero, ninf, r);
    let r = kb.select(is_neg, nan, r);
    let r = kb.select(is_inf, inf, r);
    kb.select(is_nan, x, r)
}

/// `sin x` (`cos = false`) or `cos x` (`cos = true`).
pub fn sincos(kb: &mut Kb, x: Value, cos: bool) -> Value {
    let ty = kb.ty(x);
    let ity = int_of(ty);
    let ax = kb.b.ins().fabs(x);
    let four_over_pi = kb.fconst(ty, std::f32::consts::FRAC_2_PI * 2.0);
    let t = kb.b.ins().fmul(ax, four_over_pi);
    let y = kb.b.ins().floor(t);
    let j = kb.b.ins().fcvt_to_sint_sat(ity, y);
    let one_i = kb.i32const(ity, 1);
    let odd = kb.b.ins().band(j, one_i);
    let j = kb.b.ins().iadd(j, odd);
    let fodd = kb.b.ins().fcvt_from_sint(ty, odd);
    let y = kb.b.ins().fadd(y, fodd);
    let seven = kb.i32const(ity, 7);
    let j = kb.b.ins().band(j, seven);

    // z = ((|x| − y·DP1) − y·DP2) − y·DP3
    let dp1 = kb.fconst(ty, -0.785_156_25);
    let dp2 = kb.fconst(ty, -2.418_756_5e-4);
    let dp3 = kb.fconst(ty, -3.774_895e-8);
    let z = kb.fma(y, dp1, ax);
    let z = kb.fma(y, dp2, z);
    let z = kb.fma(y, dp3, z);

    let three = kb.i32const(ity, 3);
    let upper = kb.b.ins().icmp(IntCC::SignedGreaterThan, j, three);
    let four = kb.i32const(ity, 4);
    let jm4 = kb.b.ins().isub(j, four);
    let j = if ty.is_vector() {
        kb.b.ins().bitselect(upper, jm4, j)
    } else {
        kb.b.ins().select(upper, jm4, j)
    };
    // Octants 1 and 2 (after folding) use the other polynomial.
    let is1 = kb.b.ins().icmp(IntCC::Equal, j, one_i);
    let two = kb.i32const(ity, 2);
    let is2 = kb.b.ins().icmp(IntCC::Equal, j, two);
    let other = kb.b.ins().bor(is1, is2);

    let zz = kb.b.ins().fmul(z, z);
    // sine polynomial: z + z·zz·(s0 + zz·(s1 + zz·s2))
    let mut ps = kb.fconst(ty, -1.951_529_6e-4);
    for c in [8.332_161e-3, -1.666_665_5e-1] {
        let k = kb.fconst(ty, c);
        ps = kb.fma(ps, zz, k);
    }
    let ps = kb.b.ins().fmul(ps, zz);
    let ps = kb.fma(ps, z, z);
    // cosine polynomial: 1 − zz/2 + zz²·(c0 + zz·(c1 + zz·c2))
    let mut pc = kb.fconst(ty, 2.443_315_7e-5);
    for c in [-1.388_731_6e-3, 4.166_664_6e-2] {
        let k = kb.fconst(ty, c);
        pc = kb.fma(pc, zz, k);
    }
    let zz2 = kb.b.ins().fmul(zz, zz);
    let pc = kb.b.ins().fmul(pc, zz2);
    let mhalf = kb.fconst(ty, -0.5);
    let pc = kb.fma(zz, mhalf, pc);
    let one = kb.fconst(ty, 1.0);
    let pc = kb.b.ins().fadd(pc, one);

    let (r, flip) = if cos {
        // cos: the cosine polynomial unless in octants 1, 2; negative when the folded
        // octant is above 1 xor the octant was above 3.
        let r = kb.select(other, ps, pc);
        let gt1 = kb.b.ins().icmp(IntCC::SignedGreaterThan, j, one_i);
        let flip = kb.b.ins().bxor(gt1, upper);
        (r, flip)
    } else {
        // sin: the sine polynomial unless in octants 1, 2; negative when x < 0 xor the
        // octant was above 3.
        let r = kb.select(other, pc, ps);
        let zero = kb.fconst(ty, 0.0);
        let neg = kb.b.ins().fcmp(FloatCC::LessThan, x, zero);
        let neg = if ty.is_vector() {
            kb.b.ins().bitcast(ity, lanes(), neg)
        } else {
            neg
        };
        let flip = kb.b.ins().bxor(neg, upper);
        (r, flip)
    };
    let nr = kb.b.ins().fneg(r);
    let res = kb.select(flip, nr, r);
    let is_nan = kb.b.ins().fcmp(FloatCC::Unordered, x, x);
    let _ = types::F32;
    kb.select(is_nan, x, res)
}

/// `1 / (1 + e^(−x))`: `e^(−x)` overflows to `+inf` below −88.7, giving `0`; NaN stays NaN.
pub fn sigmoid(kb: &mut Kb, x: Value) -> Value {
    let ty = kb.ty(x);
    let one = kb.fconst(ty, 1.0);
    let d = one_plus_exp_neg(kb, x);
    kb.b.ins().fdiv(one, d)
}

/// `x · sigmoid(x)` as `x / (1 + e^(−x))`.
pub fn silu(kb: &mut Kb, x: Value) -> Value {
    let d = one_plus_exp_neg(kb, x);
    kb.b.ins().fdiv(x, d)
}

fn one_plus_exp_neg(kb: &mut Kb, x: Value) -> Value {
    let ty = kb.ty(x);
    let nx = kb.b.ins().fneg(x);
    let e = exp(kb, nx);
    let one = kb.fconst(ty, 1.0);
    kb.b.ins().fadd(one, e)
}

/// `tanh x`, as Cephes' `tanhf`: below |x| = 0.625 an odd polynomial (no cancellation
/// near 0), above it `1 − 2 / (e^(2|x|) + 1)` with the sign of `x` (`e^(2|x|)` overflowing
/// gives exactly ±1). NaN stays NaN (it takes the polynomial).
pub fn tanh(kb: &mut Kb, x: Value) -> Value {
    let ty = kb.ty(x);
    let ax = kb.b.ins().fabs(x);
    let z = kb.b.ins().fmul(x, x);
    let mut p = kb.fconst(ty, -5.704_988_7e-3);
    for c in [2.063_909e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328e-1] {
        let k = kb.fconst(ty, c);
        p = kb.fma(p, z, k);
    }
    let pz = kb.b.ins().fmul(p, z);
    let small = kb.fma(pz, x, x);
    let two_ax = kb.b.ins().fadd(ax, ax);
    let e = exp(kb, two_ax);
    let one = kb.fconst(ty, 1.0);
    let two = kb.fconst(ty, 2.0);
    let e1 = kb.b.ins().fadd(e, one);
    let q = kb.b.ins().fdiv(two, e1);
    let large = kb.b.ins().fsub(one, q);
    let large = with_sign_of(kb, large, x);
    let cut = kb.fconst(ty, 0.625);
    let is_large = kb.b.ins().fcmp(FloatCC::GreaterThanOrEqual, ax, cut);
    kb.select(is_large, large, small)
}

/// `erf x`: below |x| = 1 Cephes' `erff` polynomial `x · P(x²)` (relative error near
/// 1e-9 before rounding), above it Abramowitz–Stegun 7.1.26, `1 − t·Q(t)·e^(−x²)` with
/// `t = 1 / (1 + 0.3275911·|x|)` (absolute error 1.5e-7, where erf > 0.84), with the sign
/// of `x`. NaN stays NaN.
pub fn erf(kb: &mut Kb, x: Value) -> Value {
    let ty = kb.ty(x);
    let ax = kb.b.ins().fabs(x);
    let z = kb.b.ins().fmul(x, x);
    let mut p = kb.fconst(ty, 7.853_861_4e-5);
    for c in [
        -8.010_193_6e-4,
        5.188_327_7e-3,
        -2.685_381_2e-2,
        1.128_358_5e-1,
        -3.761_262_6e-1,
        std::f32::consts::FRAC_2_SQRT_PI,
    ] {
        let k = kb.fconst(ty, c);
        p = kb.fma(p, z, k);
    }
    let small = kb.b.ins().fmul(x, p);
    let one = kb.fconst(ty, 1.0);
    let pc = kb.fconst(ty, 0.327_591_1);
    let d = kb.fma(pc, ax, one);
    let t = kb.b.ins().fdiv(one, d);
    let mut q = kb.fconst(ty, 1.061_405_4);
    for c in [-1.453_152, 1.421_413_7, -0.284_496_74, 0.254_829_6] {
        let k = kb.fconst(ty, c);
        q = kb.fma(q, t, k);
    }
    let tq = kb.b.ins().fmul(t, q);
    let nz = kb.b.ins().fneg(z);
    let e = exp(kb, nz);
    let tqe = kb.b.ins().fmul(tq, e);
    let large = kb.b.ins().fsub(one, tqe);
    let large = with_sign_of(kb, large, x);
    let is_large = kb.b.ins().fcmp(FloatCC::GreaterThanOrEqual, ax, one);
    kb.select(is_large, large, small)
}

/// `mag` (non-negative) with the sign bit of `x`: Cranelift has no vector `fcopysign` on
/// x86, so the bit is moved by integer ops.
fn with_sign_of(kb: &mut Kb, mag: Value, x: Value) -> Value {
    let ty = kb.ty(x);
    let ity = int_of(ty);
    let xb = kb.b.ins().bitcast(ity, lanes(), x);
    let mb = kb.b.ins().bitcast(ity, lanes(), mag);
    let sign = kb.i32const(ity, i32::MIN);
    let s = kb.b.ins().band(xb, sign);
    let r = kb.b.ins().bor(mb, s);
    kb.b.ins().bitcast(ty, lanes(), r)
}
