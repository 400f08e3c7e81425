//! Builtins: reshaping, selecting and combining tensors, and the matrix product.

use super::*;

pub(super) fn call(e: &mut Elab, frame: &mut Frame, name: &str, a: &Args, span: Span) -> R<Value> {
    let node =
        |e: &mut Elab, op: Op, ins: &[NodeId]| e.node(frame, op, ins, span).map(Value::Tensor);
    match name {
        "reshape" => {
            let (x, _) = a.tensor("x")?;
            let dims = a.dims_list("shape")?;
            node(e, Op::Reshape { shape: Shape(dims) }, &[x])
        }
        "broadcast" => {
            let (x, _) = a.tensor("x")?;
            let dims = a.dims_list("shape")?;
            node(e, Op::Broadcast { shape: Shape(dims) }, &[x])
        }
        "permute" => {
            let (x, _) = a.tensor("x")?;
            let rank = e.ty(x).shape.rank();
            let (v, s) = a.req("perm");
            let Value::List(items) = v else {
                return Err(a.wrong("perm", "a list of axes such as [0, 2, 1, 3]"));
            };
            let mut perm = Vec::new();
            for i in items.iter() {
                let Value::Int(ax) = i else {
                    return Err(a.wrong("perm", "a list of ints"));
                };
                perm.push(norm_axis(*ax, rank, *s)?);
            }
            node(e, Op::Permute { perm }, &[x])
        }
        "transpose" => {
            let (x, xs) = a.tensor("x")?;
            let rank = e.ty(x).shape.rank();
            if rank < 2 {
                return Err(Diag::new(
                    "kiln::shape",
                    format!("`transpose` needs two axes, got {}", e.ty(x)),
                )
                .at(xs, "fewer than two axes"));
            }
            let i = a.axis("a", rank)?.unwrap_or(rank - 2);
            let j = a.axis("b", rank)?.unwrap_or(rank - 1);
            let mut perm: Vec<usize> = (0..rank).collect();
            perm.swap(i, j);
            node(e, Op::Permute { perm }, &[x])
        }
        "where" => {
            let (c, _) = a.tensor("cond")?;
            let (va, sa) = a.req("a").clone();
            let (vb, sb) = a.req("b").clone();
            let dtype = match (&va, &vb) {
                (Value::Tensor(t), _) | (_, Value::Tensor(t)) => e.ty(*t).dtype,
                _ => DType::F32,
            };
            let ta = e.as_tensor(&va, dtype, sa)?;
            let tb = e.as_tensor(&vb, dtype, sb)?;
            let (yc, ya, yb) = (e.ty(c), e.ty(ta), e.ty(tb));
            if yc.dtype != DType::Bool {
                return Err(a.wrong("cond", "a bool tensor (a mask)"));
            }
            let shape = kiln_ir::infer::broadcast_shapes(&yc.shape, &ya.shape)
                .and_then(|s| kiln_ir::infer::broadcast_shapes(&s, &yb.shape));
            let Some(shape) = shape else {
                return Err(Diag::new(
                    "kiln::shape",
                    format!(
                        "shape mismatch in `where`: {}, {} and {} do not broadcast together",
                        yc, ya, yb
                    ),
                )
                .at(span, "")
                .label(a.req("cond").1, format!("this is {yc}"))
                .label(sa, format!("this is {ya}"))
                .label(sb, format!("this is {yb}")));
            };
            let bc = e.broadcast(frame, c, &shape, span)?;
            let ba = e.broadcast(frame, ta, &shape, sa)?;
            let bb = e.broadcast(frame, tb, &shape, sb)?;
            node(e, Op::Where, &[bc, ba, bb])
        }
        "cast" => {
            let (x, _) = a.tensor("x")?;
            let to = match a.req("dtype") {
                (Value::DType(d), _) => *d,
                _ => return Err(a.wrong("dtype", "an element type (f32, i32, bool, bf16, f16)")),
            };
            if e.ty(x).dtype == to {
                return Ok(Value::Tensor(x));
            }
            node(e, Op::Cast { to }, &[x])
        }
        "gather" => {
            let (t, _) = a.tensor("table")?;
            let (i, _) = a.tensor("ids")?;
            node(e, Op::Gather, &[t, i])
        }
        "scatter_add" => {
            let (i, _) = a.tensor("ids")?;
            let (s, _) = a.tensor("src")?;
            let rows = a.dim("rows")?;
            node(e, Op::ScatterAdd { rows }, &[i, s])
        }
        "slice" => {
            let (x, _) = a.tensor("x")?;
            let axis = a.axis("axis", e.ty(x).shape.rank())?.expect("required");
            let start = a.size("start", 0)?;
            let len = a.size("len", 0)?;
            node(e, Op::Slice { axis, start, len }, &[x])
        }
        "concat" => {
            let (v, s) = a.req("xs").clone();
            let Value::List(items) = v else {
                return Err(a.wrong("xs", "a list of tensors"));
            };
            let mut ids = Vec::new();
            for it in items.iter() {
                let Value::Tensor(t) = it else {
                    return Err(Diag::new(
                        "kiln::type",
                        format!("`concat` needs a list of tensors, found {}", it.kind()),
                    )
                    .at(s, "this list"));
                };
                ids.push(*t);
            }
            if ids.is_empty() {
                return Err(
                    Diag::new("kiln::argument", "`concat` needs at least one tensor")
                        .at(s, "empty list"),
                );
            }
            let rank = e.ty(ids[0]).shape.rank();
            let axis = a.axis("axis", rank)?.unwrap_or(0);
            node(e, Op::Concat { axis }, &ids)
        }
        "matmul" => {
            let (va, sa) = a.req("a").clone();
            let (vb, sb) = a.req("b").clone();
            Ok(Value::Tensor(e.matmul(frame, &va, sa, &vb, sb, span)?))
        }
        _ => unreachable!("builtin `{name}` is not shape"),
    }
}
