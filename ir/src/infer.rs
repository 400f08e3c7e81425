//! Shape and dtype inference for the primitives.
//!
//! In: an [`Op`] and the types of its operands. Out: the type of its result, or an
//! [`IrError::Type`] whose message names the op, the rule that failed, and the shapes
//! involved — front ends show it next to the source that produced the op.

use crate::ir::{BinaryOp, DType, IrError, Op, TensorType, UnaryOp};
use crate::shape::{Dim, Shape};

fn err<T>(msg: String) -> Result<T, IrError> {
    Err(IrError::Type(msg))
}

fn want_arity(op: &Op, types: &[&TensorType]) -> Result<(), IrError> {
    match op.arity() {
        Some(n) if n != types.len() => err(format!(
            "{} takes {n} operand{}, got {}",
            op.name(),
            if n == 1 { "" } else { "s" },
            types.len()
        )),
        None if types.is_empty() => err(format!("{} needs at least one operand", op.name())),
        _ => Ok(()),
    }
}

fn want_float(op: &Op, t: &TensorType) -> Result<(), IrError> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        err(format!(
            "{} needs a floating-point operand, got {}",
            op.name(),
            t
        ))
    }
}

/// The result type of `op` applied to operands of `types`.
pub fn infer_type(op: &Op, types: &[&TensorType]) -> Result<TensorType, IrError> {
    want_arity(op, types)?;
    match op {
        Op::Reshape { .. } | Op::Permute { .. } | Op::Broadcast { .. } => view_type(op, types[0]),
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Compare(_) => elementwise_type(op, types),
        Op::Slice { .. } | Op::Gather | Op::ScatterAdd { .. } | Op::Concat { .. } => {
            indexing_type(op, types)
        }
        Op::Input { .. } | Op::Param { .. } => err(format!(
            "{} nodes carry their type; it is not inferred",
            op.name()
        )),
        Op::Const { dtype, .. } => Ok(TensorType::new(*dtype, Shape::scalar())),
        Op::Cast { to } => Ok(TensorType::new(*to, types[0].shape.clone())),
        Op::Reduce { axis, .. } => {
            let t = types[0];
            if *axis >= t.shape.rank() {
                return err(format!(
                    "{} over axis {} of a rank-{} tensor {}",
                    op.name(),
                    axis,
                    t.shape.rank(),
                    t.shape
                ));
            }
            if !(t.dtype.is_float() || t.dtype == DType::I32) {
                return err(format!("{} is not defined for {}", op.name(), t.dtype));
            }
            let mut dims = t.shape.0.clone();
            dims[*axis] = Dim::c(1);
            Ok(TensorType::new(t.dtype, Shape(dims)))
        }
        Op::MatMul => matmul_type(types[0], types[1]),
        Op::Dropout { p, .. } => {
            want_float(op, types[0])?;
            let p = p.get();
            if !(0.0..1.0).contains(&p) {
                return err(format!("dropout probability must be in [0, 1), got {p}"));
            }
            Ok(types[0].clone())
        }
        Op::CausalMask { q, k } => Ok(TensorType::new(
            DType::Bool,
            Shape(vec![q.clone(), k.clone()]),
        )),
        Op::PadMask { .. } => {
            if types[0].dtype != DType::I32 {
                return err(format!("pad_mask needs i32 token ids, got {}", types[0]));
            }
            Ok(TensorType::new(DType::Bool, types[0].shape.clone()))
        }
        Op::Arange { len, .. } => Ok(TensorType::new(DType::I32, Shape(vec![len.clone()]))),
        Op::OneHot { depth } => {
            if types[0].dtype != DType::I32 {
                return err(format!("one_hot needs i32 ids, got {}", types[0]));
            }
            let mut dims = types[0].shape.0.clone();
            dims.push(depth.clone());
            Ok(TensorType::new(DType::F32, Shape(dims)))
        }
    }
}

/// The result type of a view: a reshape, a permutation or a broadcast.
fn view_type(op: &Op, t: &TensorType) -> Result<TensorType, IrError> {
    match op {
        Op::Reshape { shape } => {
            let from = &t.shape;
            if from.numel() != shape.numel() {
                return err(format!(
                    "cannot reshape {} into {}: {} elements vs {}",
                    from,
                    shape,
                    from.numel(),
                    shape.numel()
                ));
            }
            Ok(TensorType::new(t.dtype, shape.clone()))
        }
        Op::Permute { perm } => {
            let dims = t.shape.dims();
            let mut seen = vec![false; dims.len()];
            let valid = perm.len() == dims.len()
                && perm
                    .iter()
                    .all(|&p| p < dims.len() && !std::mem::replace(&mut seen[p], true));
            if !valid {
                return err(format!(
                    "permutation {:?} does not fit a tensor of rank {} ({})",
                    perm,
                    dims.len(),
                    t.shape
                ));
            }
            Ok(TensorType::new(
                t.dtype,
                Shape(perm.iter().map(|&p| dims[p].clone()).collect()),
            ))
        }
        Op::Broadcast { shape } => {
            broadcast_ok(&t.shape, shape)?;
            Ok(TensorType::new(t.dtype, shape.clone()))
        }
        _ => err(format!(
            "internal: {} is not an op of the view kind",
            op.name()
        )),
    }
}

/// The result type of an elementwise op: unary, binary, `where` or a comparison.
fn elementwise_type(op: &Op, types: &[&TensorType]) -> Result<TensorType, IrError> {
    match op {
        Op::Unary(u) => {
            let t = types[0];
            match u {
                UnaryOp::Neg | UnaryOp::Relu if t.dtype == DType::I32 => {}
                _ => want_float(op, t)?,
            }
            Ok(t.clone())
        }
        Op::Binary(b) => {
            let (a, c) = (types[0], types[1]);
            if a.shape != c.shape {
                return err(format!(
                    "{} needs operands of one shape, got {} and {}",
                    op.name(),
                    a.shape,
                    c.shape
                ));
            }
            if a.dtype != c.dtype {
                return err(format!(
                    "{} needs operands of one dtype, got {} and {}",
                    op.name(),
                    a.dtype,
                    c.dtype
                ));
            }
            let int_ok = matches!(
                b,
                BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Max
            );
            if !(a.dtype.is_float() || (a.dtype == DType::I32 && int_ok)) {
                return err(format!("{} is not defined for {}", op.name(), a.dtype));
            }
            Ok(a.clone())
        }
        Op::Where => {
            let (c, a, b) = (types[0], types[1], types[2]);
            if c.dtype != DType::Bool {
                return err(format!("where needs a bool condition, got {c}"));
            }
            if a.shape != c.shape || b.shape != c.shape {
                return err(format!(
                    "where needs condition and values of one shape, got {}, {} and {}",
                    c.shape, a.shape, b.shape
                ));
            }
            if a.dtype != b.dtype {
                return err(format!(
                    "where needs values of one dtype, got {} and {}",
                    a.dtype, b.dtype
                ));
            }
            Ok(a.clone())
        }
        Op::Compare(_) => {
            let (a, c) = (types[0], types[1]);
            if a.shape != c.shape || a.dtype != c.dtype {
                return err(format!(
                    "{} needs operands of one type, got {} and {}",
                    op.name(),
                    a,
                    c
                ));
            }
            if !(a.dtype.is_float() || a.dtype == DType::I32) {
                return err(format!("{} is not defined for {}", op.name(), a.dtype));
            }
            Ok(TensorType::new(DType::Bool, a.shape.clone()))
        }
        _ => err(format!(
            "internal: {} is not an op of the elementwise kind",
            op.name()
        )),
    }
}

/// The result type of an op that indexes: a slice, a gather, a scatter or a concatenation.
fn indexing_type(op: &Op, types: &[&TensorType]) -> Result<TensorType, IrError> {
    match op {
        Op::Slice { axis, start, len } => {
            let t = types[0];
            if *axis >= t.shape.rank() {
                return err(format!(
                    "slice along axis {} of a rank-{} tensor {}",
                    axis,
                    t.shape.rank(),
                    t.shape
                ));
            }
            let full = &t.shape.dims()[*axis];
            if let (Some(s), Some(l), Some(f)) = (start.as_const(), len.as_const(), full.as_const())
            {
                if s < 0 || l < 0 || s + l > f {
                    return err(format!(
                        "slice {s}..{} is outside axis {axis} of {}",
                        s + l,
                        t.shape
                    ));
                }
            }
            let mut dims = t.shape.0.clone();
            dims[*axis] = len.clone();
            Ok(TensorType::new(t.dtype, Shape(dims)))
        }
        Op::Gather => {
            let (table, ids) = (types[0], types[1]);
            if ids.dtype != DType::I32 {
                return err(format!("gather needs i32 indices, got {ids}"));
            }
            if table.shape.rank() < 1 {
                return err("gather needs a table of rank 1 or more, got a scalar".to_string());
            }
            let mut dims = ids.shape.0.clone();
            dims.extend(table.shape.0[1..].iter().cloned());
            Ok(TensorType::new(table.dtype, Shape(dims)))
        }
        Op::ScatterAdd { rows } => {
            let (ids, src) = (types[0], types[1]);
            if ids.dtype != DType::I32 {
                return err(format!("scatter_add needs i32 indices, got {ids}"));
            }
            want_float(op, src)?;
            let k = ids.shape.rank();
            if src.shape.rank() < k || src.shape.0[..k] != ids.shape.0[..] {
                return err(format!(
                    "scatter_add values {} must start with the index shape {}",
                    src.shape, ids.shape
                ));
            }
            let mut dims = vec![rows.clone()];
            dims.extend(src.shape.0[k..].iter().cloned());
            Ok(TensorType::new(src.dtype, Shape(dims)))
        }
        Op::Concat { axis } => {
            let first = types[0];
            if *axis >= first.shape.rank() {
                return err(format!(
                    "concat along axis {} of rank-{} tensors",
                    axis,
                    first.shape.rank()
                ));
            }
            let mut total = Dim::c(0);
            for t in types {
                let same_rest = t.shape.rank() == first.shape.rank()
                    && t.shape
                        .0
                        .iter()
                        .zip(first.shape.0.iter())
                        .enumerate()
                        .all(|(i, (a, b))| i == *axis || a == b);
                if !same_rest || t.dtype != first.dtype {
                    return err(format!(
                        "concat along axis {} needs tensors that agree elsewhere, got {} and {}",
                        axis, first, t
                    ));
                }
                total = total.add(&t.shape.0[*axis]);
            }
            let mut dims = first.shape.0.clone();
            dims[*axis] = total;
            Ok(TensorType::new(first.dtype, Shape(dims)))
        }
        _ => err(format!(
            "internal: {} is not an op of the indexing kind",
            op.name()
        )),
    }
}

/// Checks that `from` broadcasts to `to` (numpy rules, right-aligned).
pub fn broadcast_ok(from: &Shape, to: &Shape) -> Result<(), IrError> {
    if from.rank() > to.rank() {
        return err(format!("cannot broadcast {from} to {to}: it has more axes"));
    }
    let off = to.rank() - from.rank();
    for (i, d) in from.dims().iter().enumerate() {
        let target = &to.dims()[off + i];
        if d != target && d.as_const() != Some(1) {
            return err(format!(
                "cannot broadcast {from} to {to}: axis {i} is {d}, not 1 or {target}"
            ));
        }
    }
    Ok(())
}

/// The common shape two shapes broadcast to, if any (numpy rules).
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Option<Shape> {
    let rank = a.rank().max(b.rank());
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = (i + a.rank()).checked_sub(rank).map(|j| &a.dims()[j]);
        let db = (i + b.rank()).checked_sub(rank).map(|j| &b.dims()[j]);
        let d = match (da, db) {
            (Some(x), Some(y)) if x == y => x.clone(),
            (Some(x), Some(y)) if x.as_const() == Some(1) => y.clone(),
            (Some(x), Some(y)) if y.as_const() == Some(1) => x.clone(),
            (Some(_), Some(_)) => return None,
            (Some(x), None) | (None, Some(x)) => x.clone(),
            (None, None) => unreachable!("i < rank"),
        };
        out.push(d);
    }
    Some(Shape(out))
}

fn matmul_type(a: &TensorType, b: &TensorType) -> Result<TensorType, IrError> {
    let fail = |why: &str| err(format!("cannot multiply {} by {}: {why}", a.shape, b.shape));
    if !a.dtype.is_float() || a.dtype != b.dtype {
        return err(format!(
            "matmul needs two floating-point operands of one dtype, got {} and {}",
            a.dtype, b.dtype
        ));
    }
    let (ra, rb) = (a.shape.rank(), b.shape.rank());
    if ra < 2 || rb < 2 {
        return fail("both operands need at least two axes");
    }
    let (m, k1) = (&a.shape.0[ra - 2], &a.shape.0[ra - 1]);
    let (k2, n) = (&b.shape.0[rb - 2], &b.shape.0[rb - 1]);
    if k1 != k2 {
        return fail(&format!("inner dims {k1} and {k2} differ"));
    }
    if rb != 2 && (rb != ra || a.shape.0[..ra - 2] != b.shape.0[..rb - 2]) {
        return fail(
            "batch dims differ (the right operand must be a matrix or have the same batch dims)",
        );
    }
    let mut dims = a.shape.0[..ra - 2].to_vec();
    dims.push(m.clone());
    dims.push(n.clone());
    Ok(TensorType::new(a.dtype, Shape(dims)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Float;

    fn t(dtype: DType, dims: &[&str]) -> TensorType {
        TensorType::new(
            dtype,
            Shape(
                dims.iter()
                    .map(|d| d.parse::<i64>().map(Dim::c).unwrap_or_else(|_| Dim::sym(d)))
                    .collect(),
            ),
        )
    }

    #[test]
    fn matmul_shapes() {
        let x = t(DType::F32, &["b", "s", "512"]);
        let w = t(DType::F32, &["512", "2048"]);
        assert_eq!(
            infer_type(&Op::MatMul, &[&x, &w]).unwrap().to_string(),
            "f32[b, s, 2048]"
        );
        let bad = t(DType::F32, &["256", "2048"]);
        assert_eq!(
            infer_type(&Op::MatMul, &[&x, &bad])
                .unwrap_err()
                .to_string(),
            "cannot multiply [b, s, 512] by [256, 2048]: inner dims 512 and 256 differ"
        );
        let q = t(DType::F32, &["b", "8", "tq", "64"]);
        let k = t(DType::F32, &["b", "8", "64", "tk"]);
        assert_eq!(
            infer_type(&Op::MatMul, &[&q, &k]).unwrap().to_string(),
            "f32[b, 8, tq, tk]"
        );
    }

    #[test]
    fn reshape_checks_element_count() {
        let x = t(DType::F32, &["b", "s", "512"]);
        let ok = Op::Reshape {
            shape: Shape(vec![Dim::sym("b").mul(&Dim::sym("s")), Dim::c(512)]),
        };
        assert_eq!(infer_type(&ok, &[&x]).unwrap().to_string(), "f32[b*s, 512]");
        let bad = Op::Reshape {
            shape: Shape(vec![Dim::sym("b"), Dim::c(512)]),
        };
        assert!(infer_type(&bad, &[&x])
            .unwrap_err()
            .to_string()
            .contains("512*b*s elements vs 512*b"));
    }

    #[test]
    fn broadcast_rules() {
        let a = Shape(vec![Dim::sym("b"), Dim::c(1), Dim::c(4)]);
        let b = Shape(vec![Dim::c(3), Dim::c(1)]);
        assert_eq!(broadcast_shapes(&a, &b).unwrap().to_string(), "[b, 3, 4]");
        assert!(broadcast_shapes(&Shape::consts(&[2]), &Shape::consts(&[3])).is_none());
        assert!(broadcast_ok(&Shape::consts(&[4]), &a).is_ok());
        assert!(broadcast_ok(&Shape::consts(&[5]), &a).is_err());
    }

    #[test]
    fn dtype_rules() {
        let ids = t(DType::I32, &["b", "s"]);
        let table = t(DType::F32, &["100", "16"]);
        assert_eq!(
            infer_type(&Op::Gather, &[&table, &ids])
                .unwrap()
                .to_string(),
            "f32[b, s, 16]"
        );
        assert!(infer_type(&Op::Gather, &[&table, &table]).is_err());
        assert!(infer_type(&Op::Unary(UnaryOp::Exp), &[&ids]).is_err());
        let drop = Op::Dropout {
            p: Float::new(1.0),
            stream: 0,
        };
        assert!(infer_type(&drop, &[&table]).is_err());
        let cat = Op::Concat { axis: 1 };
        let a = t(DType::F32, &["b", "t", "4"]);
        let one = t(DType::F32, &["b", "1", "4"]);
        assert_eq!(
            infer_type(&cat, &[&a, &one]).unwrap().to_string(),
            "f32[b, t + 1, 4]"
        );
    }
}
