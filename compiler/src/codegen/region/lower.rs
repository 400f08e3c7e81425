//! How each step of a region program lowers to CLIF: loads and stores by dtype, splats,
//! constants, and the unary, binary, comparison, select and cast operations.

use super::*;

/// Loads a `d` element at element `index` of `base` (`vector`: four).
pub(super) fn load_value(kb: &mut Kb, d: DType, vector: bool, base: Value, index: Value) -> Value {
    match d {
        DType::F32 => kb.load(reg_type(d, vector), base, index),
        DType::I32 => kb.load(reg_type(d, vector), base, index),
        _ => {
            let ty = if vector { VI } else { types::I32 };
            let v = kb.load(ty, base, index);
            if vector {
                let z = kb.i32const(VI, 0);
                kb.b.ins().icmp(IntCC::NotEqual, v, z)
            } else {
                kb.b.ins().icmp_imm_u(IntCC::NotEqual, v, 0)
            }
        }
    }
}

/// Stores a `d` value at element `index` of `base`.
pub(super) fn store_value(kb: &mut Kb, d: DType, v: Value, base: Value, index: Value) {
    let v = if d == DType::Bool {
        if kb.ty(v).is_vector() {
            let one = kb.i32const(VI, 1);
            kb.b.ins().band(v, one)
        } else {
            kb.b.ins().uextend(types::I32, v)
        }
    } else {
        v
    };
    kb.store(v, base, index);
}

/// A scalar value as its vector form (a bool `i8` becomes a lane mask).
pub(super) fn splat(kb: &mut Kb, d: DType, v: Value) -> Value {
    match d {
        DType::F32 => kb.b.ins().splat(VF, v),
        DType::I32 => kb.b.ins().splat(VI, v),
        _ => {
            let t = kb.b.ins().iconst(types::I32, -1);
            let f = kb.b.ins().iconst(types::I32, 0);
            let m = kb.b.ins().select(v, t, f);
            kb.b.ins().splat(VI, m)
        }
    }
}

/// A constant of dtype `d` (scalar), as the reference builds it.
pub(super) fn constant(kb: &mut Kb, d: DType, v: f64) -> Value {
    match d {
        DType::F32 => kb.b.ins().f32const(v as f32),
        DType::I32 => kb.b.ins().iconst(types::I32, i64::from(v as i32)),
        _ => kb.b.ins().iconst(types::I8, i64::from(v != 0.0)),
    }
}

/// `c ? x : y` over values of the same kind.
pub(super) fn pick(kb: &mut Kb, c: Value, x: Value, y: Value) -> Value {
    kb.select(c, x, y)
}

pub(super) fn unary(kb: &mut Kb, u: UnaryOp, d: DType, x: Value) -> Value {
    let ty = kb.ty(x);
    if d == DType::I32 {
        return match u {
            UnaryOp::Neg => kb.b.ins().ineg(x),
            _ => {
                let z = kb.i32const(ty, 0);
                kb.b.ins().smax(x, z)
            }
        };
    }
    match u {
        UnaryOp::Neg => kb.b.ins().fneg(x),
        UnaryOp::Exp => kb.exp(x),
        UnaryOp::Log => kb.log(x),
        UnaryOp::Sqrt => kb.b.ins().sqrt(x),
        UnaryOp::Recip => {
            let one = kb.fconst(ty, 1.0);
            kb.b.ins().fdiv(one, x)
        }
        UnaryOp::Relu => {
            // NaN or positive: x; otherwise +0.
            let z = kb.fconst(ty, 0.0);
            let nan = kb.b.ins().fcmp(FloatCC::Unordered, x, x);
            let pos = kb.b.ins().fcmp(FloatCC::GreaterThan, x, z);
            let keep = kb.b.ins().bor(nan, pos);
            pick(kb, keep, x, z)
        }
        UnaryOp::Sin => math::sincos(kb, x, false),
        UnaryOp::Cos => math::sincos(kb, x, true),
        UnaryOp::Tanh => math::tanh(kb, x),
        UnaryOp::Sigmoid => math::sigmoid(kb, x),
        UnaryOp::Erf => math::erf(kb, x),
        UnaryOp::Rsqrt => {
            // Exactly rounded sqrt, then a division: the same bits on every ISA (no
            // approximate reciprocal-root instruction).
            let one = kb.fconst(ty, 1.0);
            let s = kb.b.ins().sqrt(x);
            kb.b.ins().fdiv(one, s)
        }
        UnaryOp::Silu => math::silu(kb, x),
    }
}

pub(super) fn binary(kb: &mut Kb, op: BinaryOp, d: DType, a: Value, b: Value) -> Value {
    if d == DType::I32 {
        return match op {
            BinaryOp::Add => kb.b.ins().iadd(a, b),
            BinaryOp::Sub => kb.b.ins().isub(a, b),
            BinaryOp::Mul => kb.b.ins().imul(a, b),
            _ => kb.b.ins().smax(a, b),
        };
    }
    match op {
        BinaryOp::Add => kb.b.ins().fadd(a, b),
        BinaryOp::Sub => kb.b.ins().fsub(a, b),
        BinaryOp::Mul => kb.b.ins().fmul(a, b),
        BinaryOp::Div => kb.b.ins().fdiv(a, b),
        BinaryOp::Max => {
            // The reference's NaN-propagating max: a NaN `a` wins, then a NaN or larger `b`.
            let b_nan = kb.b.ins().fcmp(FloatCC::Unordered, b, b);
            let gt = kb.b.ins().fcmp(FloatCC::GreaterThan, b, a);
            let pick_b = kb.b.ins().bor(b_nan, gt);
            pick(kb, pick_b, b, a)
        }
    }
}

pub(super) fn compare(kb: &mut Kb, c: CmpOp, d: DType, a: Value, b: Value) -> Value {
    if d == DType::F32 {
        let cc = match c {
            CmpOp::Eq => FloatCC::Equal,
            CmpOp::Ne => FloatCC::NotEqual,
            CmpOp::Lt => FloatCC::LessThan,
            CmpOp::Le => FloatCC::LessThanOrEqual,
            CmpOp::Gt => FloatCC::GreaterThan,
            CmpOp::Ge => FloatCC::GreaterThanOrEqual,
        };
        kb.b.ins().fcmp(cc, a, b)
    } else {
        let cc = match c {
            CmpOp::Eq => IntCC::Equal,
            CmpOp::Ne => IntCC::NotEqual,
            CmpOp::Lt => IntCC::SignedLessThan,
            CmpOp::Le => IntCC::SignedLessThanOrEqual,
            CmpOp::Gt => IntCC::SignedGreaterThan,
            CmpOp::Ge => IntCC::SignedGreaterThanOrEqual,
        };
        kb.b.ins().icmp(cc, a, b)
    }
}

pub(super) fn cast(kb: &mut Kb, from: DType, to: DType, x: Value) -> Value {
    let vector = kb.ty(x).is_vector();
    match (from, to) {
        (a, b) if a == b => x,
        (DType::F32, DType::I32) => {
            let ty = reg_type(DType::I32, vector);
            kb.b.ins().fcvt_to_sint_sat(ty, x)
        }
        (DType::F32, _) => {
            let z = kb.fconst(kb.ty(x), 0.0);
            kb.b.ins().fcmp(FloatCC::NotEqual, x, z)
        }
        (DType::I32, DType::F32) => {
            let ty = reg_type(DType::F32, vector);
            kb.b.ins().fcvt_from_sint(ty, x)
        }
        (DType::I32, _) => {
            if vector {
                let z = kb.i32const(VI, 0);
                kb.b.ins().icmp(IntCC::NotEqual, x, z)
            } else {
                kb.b.ins().icmp_imm_u(IntCC::NotEqual, x, 0)
            }
        }
        (_, DType::I32) => {
            if vector {
                let one = kb.i32const(VI, 1);
                kb.b.ins().band(x, one)
            } else {
                kb.b.ins().uextend(types::I32, x)
            }
        }
        _ => {
            // bool → f32: 1.0 or 0.0.
            if vector {
                let one = kb.i32const(VI, 1.0f32.to_bits() as i32);
                let bits = kb.b.ins().band(x, one);
                kb.b.ins().bitcast(VF, lanes(), bits)
            } else {
                let one = kb.b.ins().f32const(1.0);
                let z = kb.b.ins().f32const(0.0);
                kb.b.ins().select(x, one, z)
            }
        }
    }
}

/// Lowers one non-input, non-constant, non-dropout step.
pub(super) fn lower(kb: &mut Kb, inst: &Inst, types: &[DType], v: &[Value]) -> Value {
    match *inst {
        Inst::Un(u, a) => unary(kb, u, types[a], v[a]),
        Inst::Bin(op, a, b) => binary(kb, op, types[a], v[a], v[b]),
        Inst::Cmp(c, a, b) => compare(kb, c, types[a], v[a], v[b]),
        Inst::Where(c, a, b) => pick(kb, v[c], v[a], v[b]),
        Inst::Cast(d, a) => cast(kb, types[a], d, v[a]),
        Inst::In(_) | Inst::Const(..) | Inst::Dropout(..) => {
            unreachable!("inputs, constants and dropout are lowered by the caller")
        }
    }
}
