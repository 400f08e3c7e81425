//! Elementwise region kernels, and the `embed_pe` kernel.
//!
//! In: a region's scalar program ([`Expr`]) and, per input, whether its innermost stride
//! is 1 or 0. Out: one CLIF kernel (see [`crate::codegen::clif`] for the ABI) that
//! computes the region's output, plus the `dims` array it expects ([`region_dims`]).
//!
//! # Region kernels ([`region`], [`region_typed`])
//!
//! The output is contiguous and row-major, of rank `r` (0..=5), viewed as `R` rows of `C`
//! columns (`C` = the last dim, `R` = the product of the `L = r − 1` leading dims; rank 0
//! is one row of one column, rank 1 one row). Work items are rows.
//!
//! - `args`: the inputs in order, then the output. Every element is 4 bytes: `f32`,
//!   `i32`, and `bool` stored as `i32` 0/1.
//! - `dims` (`i64`), built by [`region_dims`]:
//!
//!   ```text
//!   [0]                      C        columns (the last output dim; 1 for rank 0)
//!   [1 .. 1+L]               n_k      the leading output dims
//!   [1+L+i·L .. 1+L+(i+1)·L] s_i,k    input i's element strides over the leading dims
//!   then, if the program has a dropout:
//!   [1+L+I·L]                seed     (the u64's bits)
//!   [2+L+I·L]                step
//!   ```
//!
//! Input `i` is read through element strides over the output's dims (0 along broadcast
//! axes, anything along leading axes — a permuted view works as long as its last axis
//! stays innermost). Its innermost stride is static: `inner[i]` = stride 1 (read a row
//! slice), or stride 0 (read one element per row and splat it). The row offset of input
//! `i` at row `ρ` is `Σ_k j_k·s_i,k` for the leading multi-index `j` of `ρ`; the kernel
//! unravels `begin` once and then steps the multi-index row by row (no division per
//! row).
//!
//! Columns run as in [`Kb::map_elems`]: four `F32X4` vectors per iteration, then one
//! vector, then scalars. Values live in registers as `F32X4` (f32), `I32X4` (i32) or an
//! `I32X4` lane mask (bool); in the scalar tail as `f32`, `i32` or an `i8` condition.
//! Steps that read only constants are computed once per call, steps that read only
//! constants and splatted (stride-0) inputs once per row.
//!
//! Semantics are the reference executor's ([`crate::reference`]): `max` and `relu`
//! propagate NaN; i32 `add`/`sub`/`mul`/`neg` wrap; `cast` f32→i32 truncates and
//! saturates (NaN → 0), number→bool is `x != 0`, bool→number is 0/1; `recip` is `1/x`;
//! `exp`, `log`, `sin`, `cos` are [`crate::codegen::math`]'s polynomials (≤ 2 ulp on
//! their main range, not bit-exact with libm). `dropout` keeps element `ρ·C + c` as
//! [`crate::rng::dropout_keep`] does, bit for bit, and scales by `1/(1−p)` computed in
//! f64 and rounded to f32. The kernel draws those masks by calling `kiln_dropout_masks`
//! ([`crate::codegen::masks`], the one function a kernel calls) once per
//! [`masks::MASK_CHUNK`] elements of a row, into a buffer on its stack: drawn there with
//! AVX-512, they cost a region about a quarter of drawing them in its own 128-bit CLIF
//! (`cargo bench --bench kernels`, `dropout region 32x25x512`: 0.82 → 0.21 ms).
//!
//! Not supported (an `Err`): `bf16`/`f16` values, and what the reference itself rejects
//! (`exp` of i32, `div` of i32, arithmetic or comparisons on bool, dropout of non-f32).
//!
//! # `embed_pe` ([`embed_pe`])
//!
//! `out[b, t, :] = table[ids[b, t], :] · scale + pe[t, :]`, optionally followed by
//! dropout (element index = flat output index), as the `embed_pe` template computes it
//! in f32 (a product, then a sum: no FMA). See [`embed_pe`] for its args and dims.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{
    types, ExtFuncData, ExternalName, FuncRef, Function, InstBuilder, StackSlot, StackSlotData,
    StackSlotKind, Type, Value,
};
use cranelift_codegen::isa::CallConv;

use crate::codegen::clif::{build_kernel, lanes, Kb, VF, VI};
use crate::codegen::{masks, math};
use crate::ir::{BinaryOp, CmpOp, DType, UnaryOp};
use crate::optimize::regions::{Expr, Inst};
use crate::rng;

/// Which inputs have innermost stride 1 (`true`) or 0 (`false`); `None` if some input's
/// innermost stride is neither (the caller materializes it first). A rank-0 output has
/// no innermost axis: its inputs count as stride 0. (Where the output's last dim is 1
/// the stride along it is never used: callers pass 0 there.)
pub fn region_inner(in_strides: &[Vec<isize>]) -> Option<Vec<bool>> {
    in_strides
        .iter()
        .map(|s| match s.last() {
            None | Some(0) => Some(false),
            Some(1) => Some(true),
            _ => None,
        })
        .collect()
}

/// Whether the program draws random numbers (its dims then carry the seed and step).
pub fn has_dropout(expr: &Expr) -> bool {
    expr.insts.iter().any(|i| matches!(i, Inst::Dropout(..)))
}

/// The `dims` array of a region kernel (layout in the module documentation) and its
/// number of work items (rows; 0 when the output is empty).
///
/// `out_shape` is the output's concrete shape (its rank must be the program's);
/// `in_strides[i]` has one element stride per output axis for input `i`.
pub fn region_dims(
    expr: &Expr,
    out_shape: &[usize],
    in_strides: &[Vec<isize>],
    seed: u64,
    step: u32,
) -> (Vec<i64>, usize) {
    let rank = out_shape.len();
    assert_eq!(
        rank,
        expr.out.shape.rank(),
        "region_dims: the output shape's rank is not the program's"
    );
    assert_eq!(
        in_strides.len(),
        expr.inputs,
        "region_dims: one stride list per input"
    );
    let lead = rank.saturating_sub(1);
    let cols = out_shape.last().copied().unwrap_or(1);
    let rows: usize = out_shape[..lead].iter().product();
    let mut dims = Vec::with_capacity(1 + lead * (1 + in_strides.len()) + 2);
    dims.push(cols as i64);
    dims.extend(out_shape[..lead].iter().map(|&n| n as i64));
    for s in in_strides {
        assert_eq!(
            s.len(),
            rank,
            "region_dims: an input's strides must cover every output axis"
        );
        dims.extend(s[..lead].iter().map(|&x| x as i64));
    }
    if has_dropout(expr) {
        dims.push(seed as i64);
        dims.push(i64::from(step));
    }
    let items = if cols == 0 { 0 } else { rows };
    (dims, items)
}

/// The region kernel for `expr`, with input dtypes inferred from the program (an `Err`
/// when they cannot be — e.g. `cast<f32>(in0)` does not say whether `in0` is f32 or i32;
/// use [`region_typed`] then).
pub fn region(name: &str, expr: &Expr, inner: &[bool]) -> Result<Function, String> {
    let (types, inputs) = infer(expr, None)?;
    build_region(name, expr, inner, &types, &inputs)
}

/// The region kernel for `expr` whose inputs have dtypes `in_dtypes`.
pub fn region_typed(
    name: &str,
    expr: &Expr,
    inner: &[bool],
    in_dtypes: &[DType],
) -> Result<Function, String> {
    if in_dtypes.len() != expr.inputs {
        return Err(format!(
            "region `{name}`: {} input dtypes for {} inputs",
            in_dtypes.len(),
            expr.inputs
        ));
    }
    let (types, inputs) = infer(expr, Some(in_dtypes))?;
    build_region(name, expr, inner, &types, &inputs)
}

/// The dtypes of a program's inputs, as far as the program determines them.
pub fn input_dtypes(expr: &Expr) -> Result<Vec<DType>, String> {
    infer(expr, None).map(|(_, i)| i)
}

// ---------------------------------------------------------------------------------------
// Types.

/// The dtype of every step and every input (cells `0..n` are steps, then inputs).
fn infer(expr: &Expr, given: Option<&[DType]>) -> Result<(Vec<DType>, Vec<DType>), String> {
    let n = expr.insts.len();
    if n == 0 {
        return Err("a region program with no steps".into());
    }
    let mut cells: Vec<Option<DType>> = vec![None; n + expr.inputs];
    if let Some(g) = given {
        for (i, &d) in g.iter().enumerate() {
            cells[n + i] = Some(d);
        }
    }
    // Operand references must point backwards.
    for (k, inst) in expr.insts.iter().enumerate() {
        let ops: Vec<usize> = match *inst {
            Inst::In(i) => {
                if i >= expr.inputs {
                    return Err(format!("step {k} reads input {i} of {}", expr.inputs));
                }
                vec![]
            }
            Inst::Const(..) => vec![],
            Inst::Un(_, a) | Inst::Cast(_, a) | Inst::Dropout(_, _, a) => vec![a],
            Inst::Bin(_, a, b) | Inst::Cmp(_, a, b) => vec![a, b],
            Inst::Where(c, a, b) => vec![c, a, b],
        };
        if let Some(&bad) = ops.iter().find(|&&o| o >= k) {
            return Err(format!("step {k} reads step {bad}, which is not before it"));
        }
    }
    fn unify(cells: &mut [Option<DType>], ids: &[usize]) -> Result<bool, String> {
        let known: Vec<DType> = ids.iter().filter_map(|&i| cells[i]).collect();
        let Some(&d) = known.first() else {
            return Ok(false);
        };
        if let Some(&e) = known.iter().find(|&&e| e != d) {
            return Err(format!("a value is both {d} and {e}"));
        }
        let mut changed = false;
        for &i in ids {
            if cells[i].is_none() {
                cells[i] = Some(d);
                changed = true;
            }
        }
        Ok(changed)
    }
    let set = |cells: &mut [Option<DType>], i: usize, d: DType| -> Result<bool, String> {
        match cells[i] {
            Some(e) if e != d => Err(format!("step {i} is both {d} and {e}")),
            Some(_) => Ok(false),
            None => {
                cells[i] = Some(d);
                Ok(true)
            }
        }
    };
    set(&mut cells, n - 1, expr.out.dtype)?;
    loop {
        let mut changed = false;
        for (k, inst) in expr.insts.iter().enumerate() {
            changed |= match *inst {
                Inst::In(i) => unify(&mut cells, &[k, n + i])?,
                Inst::Const(_, d) | Inst::Cast(d, _) => set(&mut cells, k, d)?,
                Inst::Un(_, a) => unify(&mut cells, &[k, a])?,
                Inst::Bin(_, a, b) => unify(&mut cells, &[k, a, b])?,
                Inst::Cmp(_, a, b) => {
                    set(&mut cells, k, DType::Bool)? | unify(&mut cells, &[a, b])?
                }
                Inst::Where(c, a, b) => {
                    set(&mut cells, c, DType::Bool)? | unify(&mut cells, &[k, a, b])?
                }
                Inst::Dropout(_, _, a) => {
                    set(&mut cells, k, DType::F32)? | set(&mut cells, a, DType::F32)?
                }
            };
        }
        if !changed {
            break;
        }
    }
    // Report an unknown input before the steps it leaves unknown.
    let order = (n..cells.len()).chain(0..n);
    for i in order {
        let c = &cells[i];
        match c {
            Some(DType::F32 | DType::I32 | DType::Bool) => {}
            Some(d) => {
                return Err(format!(
                    "{d} values are not supported by CPU region kernels"
                ))
            }
            None if i >= n => {
                return Err(format!(
                    "the dtype of region input {} cannot be inferred from the program `{}`; \
                     give the input dtypes (region_typed)",
                    i - n,
                    expr.text()
                ))
            }
            None => {
                return Err(format!(
                    "the dtype of step {i} cannot be inferred from the program `{}`",
                    expr.text()
                ))
            }
        }
    }
    let mut out: Vec<DType> = cells.iter().map(|c| c.expect("checked above")).collect();
    let inputs = out.split_off(n);
    // What the reference executor rejects.
    for (k, inst) in expr.insts.iter().enumerate() {
        let bad = match *inst {
            Inst::Un(u, a) => match out[a] {
                DType::F32 => None,
                DType::I32 if matches!(u, UnaryOp::Neg | UnaryOp::Relu) => None,
                d => Some(format!("{u:?} of {d}")),
            },
            Inst::Bin(b, a, _) => match out[a] {
                DType::F32 => None,
                DType::I32 if b != BinaryOp::Div => None,
                d => Some(format!("{b:?} of {d}")),
            },
            Inst::Cmp(c, a, _) if out[a] == DType::Bool => Some(format!("{c:?} of bool")),
            _ => None,
        };
        if let Some(b) = bad {
            return Err(format!("region step {k}: {b} is not defined"));
        }
    }
    Ok((out, inputs))
}

/// The register type of a `dtype` value (`vector`: in the vector loop).
fn reg_type(d: DType, vector: bool) -> Type {
    match (d, vector) {
        (DType::F32, true) => VF,
        (DType::F32, false) => types::F32,
        (DType::Bool, false) => types::I8,
        (_, true) => VI,
        (_, false) => types::I32,
    }
}

// ---------------------------------------------------------------------------------------
// Lowering.

/// Loads a `d` element at element `index` of `base` (`vector`: four).
fn load_value(kb: &mut Kb, d: DType, vector: bool, base: Value, index: Value) -> Value {
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
fn store_value(kb: &mut Kb, d: DType, v: Value, base: Value, index: Value) {
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
fn splat(kb: &mut Kb, d: DType, v: Value) -> Value {
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
fn constant(kb: &mut Kb, d: DType, v: f64) -> Value {
    match d {
        DType::F32 => kb.b.ins().f32const(v as f32),
        DType::I32 => kb.b.ins().iconst(types::I32, i64::from(v as i32)),
        _ => kb.b.ins().iconst(types::I8, i64::from(v != 0.0)),
    }
}

/// `c ? x : y` over values of the same kind.
fn pick(kb: &mut Kb, c: Value, x: Value, y: Value) -> Value {
    kb.select(c, x, y)
}

fn unary(kb: &mut Kb, u: UnaryOp, d: DType, x: Value) -> Value {
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
    }
}

fn binary(kb: &mut Kb, op: BinaryOp, d: DType, a: Value, b: Value) -> Value {
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

fn compare(kb: &mut Kb, c: CmpOp, d: DType, a: Value, b: Value) -> Value {
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

fn cast(kb: &mut Kb, from: DType, to: DType, x: Value) -> Value {
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

/// A dropout step of a kernel: `kiln_dropout_masks`'s arguments but the index and the
/// count (`seed i64, step, stream, threshold i32`), and the stack buffer its masks go to
/// (see [`mask_slot`]).
#[derive(Clone, Copy)]
struct DropoutMasks {
    args: [Value; 4],
    slot: StackSlot,
}

/// A stack buffer for the keep masks of [`masks::MASK_CHUNK`] elements.
fn mask_slot(kb: &mut Kb) -> StackSlot {
    kb.b.create_sized_stack_slot(StackSlotData::new(
        StackSlotKind::ExplicitSlot,
        (4 * masks::MASK_CHUNK) as u32,
        4,
    ))
}

/// Runs `elems(lo, hi)` over the chunks `[lo, hi)` of a row's elements `[0, len)`
/// ([`masks::MASK_CHUNK`] each, the last shorter), each after `func` (the kernel's
/// import of `kiln_dropout_masks`) has drawn the chunk's masks of every step of `drops`;
/// `first` is the row's first flat index.
fn in_mask_chunks(
    kb: &mut Kb,
    func: FuncRef,
    drops: &[DropoutMasks],
    (first, len): (Value, Value),
    mut elems: impl FnMut(&mut Kb, Value, Value),
) {
    let zero = kb.iconst(0);
    let span = kb.b.ins().iadd_imm_s(len, masks::MASK_CHUNK - 1);
    kb.for_range(zero, span, masks::MASK_CHUNK, &[], |kb, lo, _| {
        let next = kb.b.ins().iadd_imm_s(lo, masks::MASK_CHUNK);
        let hi = kb.b.ins().umin(next, len);
        let count = kb.b.ins().isub(hi, lo);
        let index = kb.b.ins().iadd(first, lo);
        for d in drops {
            let out = kb.b.ins().stack_addr(types::I64, d.slot, 0);
            let [seed, step, stream, threshold] = d.args;
            kb.b.ins()
                .call(func, &[seed, step, stream, threshold, index, count, out]);
        }
        elems(kb, lo, hi);
        vec![]
    });
}

/// The keep mask of element `c` of the chunk from `lo` whose masks `slot` holds: a lane
/// mask of four elements for a vector step, an `i8` condition for a scalar one.
fn chunk_keep(kb: &mut Kb, slot: StackSlot, (c, lo): (Value, Value), vector: bool) -> Value {
    let at = kb.b.ins().isub(c, lo);
    let base = kb.b.ins().stack_addr(types::I64, slot, 0);
    if vector {
        kb.load(VI, base, at)
    } else {
        let m = kb.load(types::I32, base, at);
        kb.b.ins().icmp_imm_u(IntCC::NotEqual, m, 0)
    }
}

/// Declares `kiln_dropout_masks` (see [`masks`]) in the kernel: `(seed i64, step i32,
/// stream i32, threshold i32, index i64, count i64, out i64)`, the C ABI.
fn import_masks(kb: &mut Kb) -> FuncRef {
    let signature = kb.b.import_signature(masks::signature(CallConv::SystemV));
    kb.b.import_function(ExtFuncData {
        name: ExternalName::testcase(masks::SYMBOL),
        signature,
        colocated: false,
        patchable: false,
    })
}

/// `keep ? x·scale : 0` for a keep condition (`i8`) or lane mask.
fn apply_dropout(kb: &mut Kb, keep: Value, x: Value, scale: f32) -> Value {
    let ty = kb.ty(x);
    let s = kb.fconst(ty, scale);
    let y = kb.b.ins().fmul(x, s);
    let z = kb.fconst(ty, 0.0);
    kb.select(keep, y, z)
}

/// Lowers one non-input, non-constant, non-dropout step.
fn lower(kb: &mut Kb, inst: &Inst, types: &[DType], v: &[Value]) -> Value {
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

/// When a step can be computed: once per call (0), once per row (1), per element (2).
fn levels(expr: &Expr, inner: &[bool]) -> Vec<u8> {
    let mut lv: Vec<u8> = Vec::with_capacity(expr.insts.len());
    for inst in &expr.insts {
        let l = match *inst {
            Inst::In(i) => {
                if inner[i] {
                    2
                } else {
                    1
                }
            }
            Inst::Const(..) => 0,
            Inst::Dropout(..) => 2,
            Inst::Un(_, a) | Inst::Cast(_, a) => lv[a],
            Inst::Bin(_, a, b) | Inst::Cmp(_, a, b) => lv[a].max(lv[b]),
            Inst::Where(c, a, b) => lv[c].max(lv[a]).max(lv[b]),
        };
        lv.push(l);
    }
    lv
}

fn build_region(
    name: &str,
    expr: &Expr,
    inner: &[bool],
    types: &[DType],
    in_types: &[DType],
) -> Result<Function, String> {
    if inner.len() != expr.inputs {
        return Err(format!(
            "region `{name}`: {} inner flags for {} inputs",
            inner.len(),
            expr.inputs
        ));
    }
    let rank = expr.out.shape.rank();
    if rank > 5 {
        return Err(format!(
            "region `{name}`: rank {rank} outputs are not supported"
        ));
    }
    let lead = rank.saturating_sub(1);
    let n_in = expr.inputs;
    let n = expr.insts.len();
    let out_d = types[n - 1];
    let lv = levels(expr, inner);
    // Which lower-level values the per-element code reads (as vectors).
    let mut need_vec = vec![false; n];
    for (k, inst) in expr.insts.iter().enumerate() {
        if lv[k] < 2 {
            continue;
        }
        let ops: Vec<usize> = match *inst {
            Inst::Un(_, a) | Inst::Cast(_, a) | Inst::Dropout(_, _, a) => vec![a],
            Inst::Bin(_, a, b) | Inst::Cmp(_, a, b) => vec![a, b],
            Inst::Where(c, a, b) => vec![c, a, b],
            _ => vec![],
        };
        for o in ops {
            if lv[o] < 2 {
                need_vec[o] = true;
            }
        }
    }
    if lv[n - 1] < 2 {
        need_vec[n - 1] = true;
    }
    let mut used = vec![false; n_in];
    for inst in &expr.insts {
        if let Inst::In(i) = *inst {
            used[i] = true;
        }
    }
    let dropout = has_dropout(expr);

    Ok(build_kernel(name, |kb| {
        let in_ptr: Vec<Value> = (0..n_in).map(|i| kb.ptr(i)).collect();
        let out_ptr = kb.ptr(n_in);
        let cols = kb.dim(0);
        let sizes: Vec<Value> = (0..lead).map(|k| kb.dim(1 + k)).collect();
        let strides: Vec<Vec<Value>> = (0..n_in)
            .map(|i| {
                if used[i] {
                    (0..lead).map(|k| kb.dim(1 + lead + i * lead + k)).collect()
                } else {
                    vec![]
                }
            })
            .collect();
        // Dropout steps: each a stack buffer for the keep masks of `MASK_CHUNK` elements
        // of a row, filled by `kiln_dropout_masks` (see `masks`) before the elements'
        // loop over them.
        let mut gens: Vec<Option<(DropoutMasks, f32)>> = vec![None; n];
        let mut draw = None;
        if dropout {
            let base = 1 + lead + n_in * lead;
            let seed = kb.dim(base);
            let step = kb.dim(base + 1);
            let step = kb.b.ins().ireduce(types::I32, step);
            draw = Some(import_masks(kb));
            for (k, inst) in expr.insts.iter().enumerate() {
                if let Inst::Dropout(p, stream, _) = *inst {
                    let p = p.get();
                    let stream = kb.b.ins().iconst(types::I32, i64::from(stream));
                    let t = rng::dropout_threshold(p);
                    let threshold = kb.b.ins().iconst(types::I32, i64::from(t));
                    let masks = DropoutMasks {
                        args: [seed, step, stream, threshold],
                        slot: mask_slot(kb),
                    };
                    gens[k] = Some((masks, (1.0 / (1.0 - p)) as f32));
                }
            }
        }
        // Level 0: constants, once per call.
        let mut scal: Vec<Option<Value>> = vec![None; n];
        let mut vecs: Vec<Option<Value>> = vec![None; n];
        let eval_level = |kb: &mut Kb,
                          level: u8,
                          scal: &mut Vec<Option<Value>>,
                          vecs: &mut Vec<Option<Value>>,
                          rowptr: &[Option<Value>]| {
            let zero = kb.iconst(0);
            for (k, inst) in expr.insts.iter().enumerate() {
                if lv[k] != level {
                    continue;
                }
                let v = match *inst {
                    Inst::In(i) => {
                        let p = rowptr[i].expect("a read input has a row pointer");
                        load_value(kb, in_types[i], false, p, zero)
                    }
                    Inst::Const(c, d) => constant(kb, d, c.get()),
                    _ => {
                        let ops: Vec<Value> = scal.iter().map(|o| o.unwrap_or(zero)).collect();
                        lower(kb, inst, types, &ops)
                    }
                };
                scal[k] = Some(v);
                if need_vec[k] {
                    vecs[k] = Some(splat(kb, types[k], v));
                }
            }
        };
        eval_level(kb, 0, &mut scal, &mut vecs, &[]);

        // Unravel `begin` into the leading multi-index.
        let mut js: Vec<Value> = vec![kb.begin; lead];
        if lead > 0 {
            let mut rest = kb.begin;
            for k in (1..lead).rev() {
                let one = kb.iconst(1);
                let z = kb.b.ins().icmp_imm_u(IntCC::Equal, sizes[k], 0);
                let nk = kb.b.ins().select(z, one, sizes[k]);
                js[k] = kb.b.ins().urem(rest, nk);
                rest = kb.b.ins().udiv(rest, nk);
            }
            js[0] = rest;
        }
        let (begin, end) = (kb.begin, kb.end);
        kb.for_range(begin, end, 1, &js, |kb, row, js| {
            // Row pointers.
            let mut rowptr: Vec<Option<Value>> = vec![None; n_in];
            for i in 0..n_in {
                if !used[i] {
                    continue;
                }
                let mut off: Option<Value> = None;
                for k in 0..lead {
                    let t = kb.b.ins().imul(js[k], strides[i][k]);
                    off = Some(match off {
                        Some(o) => kb.b.ins().iadd(o, t),
                        None => t,
                    });
                }
                rowptr[i] = Some(match off {
                    Some(o) => kb.elem_addr(in_ptr[i], o),
                    None => in_ptr[i],
                });
            }
            let first = kb.b.ins().imul(row, cols);
            let out_row = kb.elem_addr(out_ptr, first);
            // Level 1: once per row.
            let mut scal = scal.clone();
            let mut vecs = vecs.clone();
            eval_level(kb, 1, &mut scal, &mut vecs, &rowptr);

            let zero = kb.iconst(0);
            // The row's elements `[lo, hi)` (where dropout draws its masks first: a chunk).
            let elems = |kb: &mut Kb, lo: Value, hi: Value| {
                kb.map_elems_unrolled(lo, hi, |kb, c, ty, _| {
                    let vector = ty.is_vector();
                    let mut v: Vec<Value> = Vec::with_capacity(n);
                    let mut loaded: Vec<Option<Value>> = vec![None; n_in];
                    for (k, inst) in expr.insts.iter().enumerate() {
                        if lv[k] < 2 {
                            let x = if vector { vecs[k] } else { scal[k] };
                            // Lower-level values no element step reads are never used.
                            v.push(x.unwrap_or(zero));
                            continue;
                        }
                        let x = match *inst {
                            Inst::In(i) => match loaded[i] {
                                Some(x) => x,
                                None => {
                                    let p = rowptr[i].expect("a read input has a row pointer");
                                    let x = load_value(kb, in_types[i], vector, p, c);
                                    loaded[i] = Some(x);
                                    x
                                }
                            },
                            Inst::Dropout(_, _, a) => {
                                let (g, scale) = gens[k].expect("a mask buffer per dropout");
                                let keep = chunk_keep(kb, g.slot, (c, lo), vector);
                                apply_dropout(kb, keep, v[a], scale)
                            }
                            _ => lower(kb, inst, types, &v),
                        };
                        v.push(x);
                    }
                    store_value(kb, out_d, v[n - 1], out_row, c);
                });
            };
            match draw {
                None => elems(kb, zero, cols),
                Some(func) => {
                    let drops: Vec<DropoutMasks> = gens.iter().flatten().map(|g| g.0).collect();
                    in_mask_chunks(kb, func, &drops, (first, cols), elems);
                }
            }

            // Step the multi-index (the outermost index never wraps).
            let mut next = js.to_vec();
            if lead > 0 {
                let mut carry = kb.iconst(1);
                for k in (1..lead).rev() {
                    let j = kb.b.ins().iadd(js[k], carry);
                    let wrap = kb.b.ins().icmp(IntCC::Equal, j, sizes[k]);
                    let z = kb.iconst(0);
                    next[k] = kb.b.ins().select(wrap, z, j);
                    carry = kb.b.ins().uextend(types::I64, wrap);
                }
                next[0] = kb.b.ins().iadd(js[0], carry);
            }
            next
        });
    }))
}

// ---------------------------------------------------------------------------------------
// embed_pe.

/// The `embed_pe` kernel: `out[r, :] = table[ids[r], :] · scale + pe[r mod t, :]` for rows
/// `r` of the flattened `[b·t]` positions, then (if `dropout`) inverted dropout keyed by
/// the flat output index `r·d + c`.
///
/// - `args`: `[table f32 [vocab, d], ids i32 [b, t], pe f32 [t, d], scale f32 (a pointer
///   to one element), out f32 [b, t, d]]`.
/// - `dims` ([`embed_pe_dims`]): `[d, t]`, and with dropout `[d, t, seed (u64 bits),
///   step, stream, threshold (dropout_threshold(p)), keep scale (the f32 bits of
///   (1/(1−p)) computed in f64)]`.
/// - Items: rows, `b·t`. Ids must be in `0..vocab` (the caller checks them).
pub fn embed_pe(name: &str, dropout: bool) -> Function {
    build_kernel(name, |kb| {
        let table = kb.ptr(0);
        let ids = kb.ptr(1);
        let pe = kb.ptr(2);
        let scale_p = kb.ptr(3);
        let out = kb.ptr(4);
        let d = kb.dim(0);
        let t = kb.dim(1);
        let zero = kb.iconst(0);
        let scale = kb.load(types::F32, scale_p, zero);
        let scale_v = kb.b.ins().splat(VF, scale);
        // With dropout: the masks' function, its arguments but the index and count, a
        // stack buffer for a chunk's masks, and the kept elements' scale.
        let gen = if dropout {
            let seed = kb.dim(2);
            let dims: Vec<Value> = (3..7)
                .map(|i| {
                    let v = kb.dim(i);
                    kb.b.ins().ireduce(types::I32, v)
                })
                .collect();
            let func = import_masks(kb);
            let drop = DropoutMasks {
                args: [seed, dims[0], dims[1], dims[2]],
                slot: mask_slot(kb),
            };
            let ks = kb.b.ins().bitcast(types::F32, lanes(), dims[3]);
            let ks_v = kb.b.ins().splat(VF, ks);
            Some((func, drop, ks, ks_v))
        } else {
            None
        };
        // Position of `begin` within its sequence.
        let one = kb.iconst(1);
        let tz = kb.b.ins().icmp_imm_u(IntCC::Equal, t, 0);
        let tn = kb.b.ins().select(tz, one, t);
        let pos = kb.b.ins().urem(kb.begin, tn);
        let (begin, end) = (kb.begin, kb.end);
        kb.for_range(begin, end, 1, &[pos], |kb, row, p| {
            let pos = p[0];
            let id = kb.load(types::I32, ids, row);
            let id = kb.b.ins().sextend(types::I64, id);
            let src = kb.b.ins().imul(id, d);
            let src = kb.elem_addr(table, src);
            let pr = kb.b.ins().imul(pos, d);
            let pr = kb.elem_addr(pe, pr);
            let first = kb.b.ins().imul(row, d);
            let dst = kb.elem_addr(out, first);
            let zero = kb.iconst(0);
            // Elements `[lo, hi)` of the row (with dropout, a chunk whose masks are drawn).
            let elems = |kb: &mut Kb, lo: Value, hi: Value| {
                kb.map_elems(lo, hi, |kb, c, ty| {
                    let vector = ty.is_vector();
                    let x = kb.load(ty, src, c);
                    let s = if vector { scale_v } else { scale };
                    let x = kb.b.ins().fmul(x, s);
                    let q = kb.load(ty, pr, c);
                    let mut y = kb.b.ins().fadd(x, q);
                    if let Some((_, drop, ks, ks_v)) = &gen {
                        let keep = chunk_keep(kb, drop.slot, (c, lo), vector);
                        let k = if vector { *ks_v } else { *ks };
                        let kept = kb.b.ins().fmul(y, k);
                        let z = kb.fconst(ty, 0.0);
                        y = kb.select(keep, kept, z);
                    }
                    kb.store(y, dst, c);
                });
            };
            match &gen {
                None => elems(kb, zero, d),
                Some((func, drop, _, _)) => in_mask_chunks(kb, *func, &[*drop], (first, d), elems),
            }
            let p1 = kb.b.ins().iadd_imm_s(pos, 1);
            let wrap = kb.b.ins().icmp(IntCC::Equal, p1, t);
            let z = kb.iconst(0);
            vec![kb.b.ins().select(wrap, z, p1)]
        });
    })
}

/// The `dims` of [`embed_pe`] and its items (`b·t` rows): `d` and `t` are the embedding
/// width and sequence length, `b` the batch; `dropout` is `(p, stream)` when the kernel
/// was built with dropout (`seed` and `step` are then the run's).
pub fn embed_pe_dims(
    d: usize,
    t: usize,
    b: usize,
    dropout: Option<(f64, u32)>,
    seed: u64,
    step: u32,
) -> (Vec<i64>, usize) {
    let mut dims = vec![d as i64, t as i64];
    if let Some((p, stream)) = dropout {
        dims.push(seed as i64);
        dims.push(i64::from(step));
        dims.push(i64::from(stream));
        dims.push(i64::from(rng::dropout_threshold(p)));
        dims.push(i64::from(((1.0 / (1.0 - p)) as f32).to_bits()));
    }
    let items = if d == 0 { 0 } else { b * t };
    (dims, items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::clif::text;
    use crate::codegen::jit::{compile, launch};
    use crate::ir::Float;

    /// Two dropout steps in one region, over rows longer than a chunk of masks
    /// (`MASK_CHUNK`), of a length that is no multiple of 4 (so rows start inside a
    /// counter block, and each chunk ends in vector and scalar tails): every element as
    /// `rng::dropout_keep` decides, with the kept ones scaled.
    #[test]
    fn dropout_masks_every_chunk_of_long_rows_as_the_generator_decides() {
        let (rows, cols) = (3usize, 2 * masks::MASK_CHUNK as usize + 455);
        let expr = Expr {
            out: crate::TensorType {
                dtype: DType::F32,
                shape: crate::Shape::consts(&[rows as i64, cols as i64]),
            },
            inputs: 1,
            insts: vec![
                Inst::In(0),
                Inst::Dropout(Float::new(0.3), 11, 0),
                Inst::Dropout(Float::new(0.2), 12, 1),
            ],
        };
        let f = region("drop2", &expr, &[true]).expect("region builds");
        let m = compile(&text(&f)).expect("region compiles");
        let n = rows * cols;
        let x: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut y = vec![f32::NAN; n];
        let (seed, step) = (0x5eed_0000_0000_0042u64, 9u32);
        let strides: Vec<isize> = vec![cols as isize, 1];
        let (dims, items) = region_dims(&expr, &[rows, cols], &[strides], seed, step);
        let k = m.get("drop2").expect("the kernel");
        // SAFETY: the buffers hold the shapes `dims` describe.
        unsafe {
            launch(
                k,
                &[x.as_ptr() as *mut u8, y.as_mut_ptr() as *mut u8],
                &dims,
                items,
                1,
            )
        };
        let (t1, t2) = (rng::dropout_threshold(0.3), rng::dropout_threshold(0.2));
        let (s1, s2) = ((1.0 / (1.0 - 0.3)) as f32, (1.0 / (1.0 - 0.2)) as f32);
        let mut dropped = 0;
        for (i, (&x, &y)) in x.iter().zip(&y).enumerate() {
            let i64_ = i as u64;
            let a = if rng::dropout_keep(seed, step, 11, i64_, t1) {
                x * s1
            } else {
                0.0
            };
            let want = if rng::dropout_keep(seed, step, 12, i64_, t2) {
                a * s2
            } else {
                0.0
            };
            dropped += usize::from(want == 0.0);
            assert_eq!(
                y.to_bits(),
                want.to_bits(),
                "element {i} (row {})",
                i / cols
            );
        }
        // About 1 − 0.7 · 0.8 = 44 % dropped.
        assert!(
            (n * 40 / 100..n * 48 / 100).contains(&dropped),
            "{dropped} of {n}"
        );
    }

    /// `embed_pe` with dropout over rows longer than a chunk of masks, of a length that
    /// is no multiple of 4: each element `table[id]·scale + pe`, kept as
    /// `rng::dropout_keep` decides for its flat index and scaled.
    #[test]
    fn embed_pe_drops_out_every_chunk_of_long_rows_as_the_generator_decides() {
        let (b, t, d, vocab) = (2usize, 3usize, 2 * masks::MASK_CHUNK as usize + 455, 5usize);
        let f = embed_pe("emb", true);
        let m = compile(&text(&f)).expect("embed_pe compiles");
        let table: Vec<f32> = (0..vocab * d)
            .map(|i| (i % 11) as f32 * 0.5 - 2.0)
            .collect();
        let ids: Vec<i32> = vec![3, 0, 4, 1, 1, 2];
        let pe: Vec<f32> = (0..t * d).map(|i| (i % 5) as f32 * 0.125).collect();
        let scale = [1.5f32];
        let mut out = vec![f32::NAN; b * t * d];
        let (p, stream, seed, step) = (0.25, 17u32, 99u64, 4u32);
        let (dims, items) = embed_pe_dims(d, t, b, Some((p, stream)), seed, step);
        let k = m.get("emb").expect("the kernel");
        // SAFETY: the buffers hold the shapes `dims` describe.
        unsafe {
            launch(
                k,
                &[
                    table.as_ptr() as *mut u8,
                    ids.as_ptr() as *mut u8,
                    pe.as_ptr() as *mut u8,
                    scale.as_ptr() as *mut u8,
                    out.as_mut_ptr() as *mut u8,
                ],
                &dims,
                items,
                1,
            )
        };
        let threshold = rng::dropout_threshold(p);
        let keep_scale = (1.0 / (1.0 - p)) as f32;
        let mut dropped = 0;
        for r in 0..b * t {
            for c in 0..d {
                let i = r * d + c;
                let y = table[ids[r] as usize * d + c] * scale[0] + pe[(r % t) * d + c];
                let want = if rng::dropout_keep(seed, step, stream, i as u64, threshold) {
                    y * keep_scale
                } else {
                    dropped += 1;
                    0.0
                };
                assert_eq!(out[i].to_bits(), want.to_bits(), "row {r}, column {c}");
            }
        }
        let n = b * t * d;
        assert!(
            (n * 21 / 100..n * 29 / 100).contains(&dropped),
            "{dropped} of {n}"
        );
    }
}
