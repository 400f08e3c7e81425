//! Builtins: elementwise math on numbers and tensors, and reductions.

use super::*;

pub(super) fn call(e: &mut Elab, frame: &mut Frame, name: &str, a: &Args, span: Span) -> R<Value> {
    let node =
        |e: &mut Elab, op: Op, ins: &[NodeId]| e.node(frame, op, ins, span).map(Value::Tensor);
    match name {
        "exp" | "log" | "sqrt" | "sin" | "cos" | "relu" | "recip" | "neg" | "tanh" | "sigmoid"
        | "erf" | "rsqrt" | "silu" => {
            let (v, s) = a.req("x").clone();
            match v {
                Value::Int(_) | Value::Float(_) => {
                    Ok(Value::Float(math(name, v.as_f64().unwrap_or(0.0), s)?))
                }
                Value::Tensor(t) => {
                    let u = match name {
                        "exp" => UnaryOp::Exp,
                        "log" => UnaryOp::Log,
                        "sqrt" => UnaryOp::Sqrt,
                        "sin" => UnaryOp::Sin,
                        "cos" => UnaryOp::Cos,
                        "tanh" => UnaryOp::Tanh,
                        "sigmoid" => UnaryOp::Sigmoid,
                        "erf" => UnaryOp::Erf,
                        "rsqrt" => UnaryOp::Rsqrt,
                        "silu" => UnaryOp::Silu,
                        "relu" => UnaryOp::Relu,
                        "recip" => UnaryOp::Recip,
                        _ => UnaryOp::Neg,
                    };
                    node(e, Op::Unary(u), &[t])
                }
                _ => Err(a.wrong("x", "a tensor or a number")),
            }
        }
        "max" | "min" => {
            let (va, sa) = a.req("a").clone();
            let (vb, sb) = a.req("b").clone();
            match (va.as_f64(), vb.as_f64()) {
                (Some(x), Some(y)) => {
                    let r = if name == "max" { x.max(y) } else { x.min(y) };
                    Ok(match (&va, &vb) {
                        (Value::Int(_), Value::Int(_)) => Value::Int(r as i64),
                        _ => Value::Float(r),
                    })
                }
                _ if name == "max" => Ok(Value::Tensor(e.elementwise(
                    frame,
                    Op::Binary(BinaryOp::Max),
                    (&va, sa),
                    (&vb, sb),
                    span,
                    "take the max of",
                )?)),
                _ => Err(Diag::new(
                    "kiln::type",
                    "`min` works on numbers; for tensors write `-max(-a, -b)`",
                )
                .at(span, "")),
            }
        }
        "sum" | "amax" | "mean" => {
            let (x, _) = a.tensor("x")?;
            let ty = e.ty(x);
            let op = if name == "amax" {
                ReduceOp::Max
            } else {
                ReduceOp::Sum
            };
            let axes: Vec<usize> = match a.axis("axis", ty.shape.rank())? {
                Some(ax) => vec![ax],
                None => (0..ty.shape.rank()).collect(),
            };
            let mut y = x;
            for &ax in &axes {
                y = e.node(frame, Op::Reduce { op, axis: ax }, &[y], span)?;
            }
            if a.get("axis").is_none() && ty.shape.rank() > 0 {
                y = e.node(
                    frame,
                    Op::Reshape {
                        shape: Shape::scalar(),
                    },
                    &[y],
                    span,
                )?;
            }
            if name == "mean" {
                let n = axes
                    .iter()
                    .try_fold(Dim::c(1), |acc, &ax| acc.checked_mul(&ty.shape.dims()[ax]))
                    .ok_or_else(|| {
                        Diag::new("kiln::overflow", "the count of `mean` overflows").at(span, "")
                    })?;
                let Some(n) = n.as_const() else {
                    return Err(Diag::new(
                        "kiln::shape",
                        format!("`mean` over a symbolic size ({n}) is not supported"),
                    )
                    .at(span, "")
                    .help("divide a `sum` by a count you compute, e.g. from a mask"));
                };
                let yty = e.ty(y);
                let c = e.graph.add_const(1.0 / n as f64, yty.dtype);
                let c = e.broadcast(frame, c, &yty.shape, span)?;
                y = e.node(frame, Op::Binary(BinaryOp::Mul), &[y, c], span)?;
            }
            Ok(Value::Tensor(y))
        }
        _ => unreachable!("builtin `{name}` is not math"),
    }
}
