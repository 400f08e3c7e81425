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

mod build;
mod dropout;
mod embed_pe;
mod lower;
#[cfg(test)]
mod tests;

use build::*;
use dropout::*;
pub use embed_pe::{embed_pe, embed_pe_dims};
use lower::*;

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
