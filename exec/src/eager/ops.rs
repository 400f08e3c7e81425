//! One primitive at a time: the eager executor's semantics of every non-source op.
//!
//! In: an [`Op`], its operand values (moved in when this node is their last reader, so
//! their buffers can be reused), the node's concrete shape and the run's seed, step and
//! dim bindings. Out: the node's value, or a message the caller completes with the
//! node's label.
//!
//! The semantics are the reference executor's (`kiln_compiler::reference`), op for op:
//! NaN-propagating `max`/`reduce_max`, `relu(NaN) = NaN`, wrapping i32 arithmetic,
//! saturating float→i32 casts, dropout keeping `x * s` with `s = 1/(1-p)` computed in
//! f64 and rounded to f32 (dropped elements are exactly 0), and out-of-range ids as
//! errors. Views (`reshape` of a row-major value, `permute`, `broadcast`, `slice`, a
//! cast to the same dtype) copy nothing. Elementwise ops write into an operand's buffer
//! when this node is the operand's last reader and nothing else shares it.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_compiler::ir::{BinaryOp, CmpOp, DType, Op, ReduceOp, UnaryOp};
use kiln_compiler::rng;

use super::index::{concat, gather, generate, one_hot, scatter_add};
use super::matmul::matmul;
use super::pool::Pool;
use super::reduce::{fmax, fold_row, max_row, reduce};
use super::value::{Data, Elem, Layout, Value, View};
use super::walk::{chunked, map1, map2, map3, to_vec, update1, update_with};

/// What a node needs besides its operands.
pub(crate) struct Ctx<'a> {
    pub dims: &'a BTreeMap<String, i64>,
    pub seed: u64,
    pub step: u32,
    /// Where large f32 buffers come from and go back to.
    pub pool: &'a Arc<Pool>,
}

impl Ctx<'_> {
    fn p(&self) -> Option<&Pool> {
        Some(self.pool)
    }

    /// A row-major value over a kernel's output buffer.
    fn value<'t, E: Elem>(&self, shape: &[usize], v: Vec<E>) -> Value<'t> {
        Value::owned(shape, v, Some(self.pool))
    }
}

type R<T> = Result<T, String>;

fn view<'v, E: Elem>(v: &'v Value<'_>, what: &str) -> R<View<'v, E>> {
    v.view::<E>().ok_or_else(|| {
        format!(
            "internal: {what} holds {} values, not {}",
            v.data.kind(),
            std::any::type_name::<E>()
        )
    })
}

/// The value's elements row-major in a fresh buffer.
fn materialize<'t>(x: &Value<'t>, ctx: &Ctx<'_>) -> Value<'t> {
    fn copy<'t, E: Elem>(ctx: &Ctx<'_>, shape: &[usize], data: &[E], layout: &Layout) -> Value<'t> {
        ctx.value(shape, to_vec(ctx.p(), View { data, layout }))
    }
    let (shape, l) = (x.shape(), &x.layout);
    match &x.data {
        Data::F(s) => copy(ctx, shape, s.as_slice(), l),
        Data::I(s) => copy(ctx, shape, s.as_slice(), l),
        Data::B(s) => copy(ctx, shape, s.as_slice(), l),
    }
}

/// `f` of each element, in `x`'s own buffer when it may be overwritten.
fn unary_op<'t, E: Elem>(
    ctx: &Ctx<'_>,
    x: Value<'t>,
    shape: &[usize],
    f: impl Fn(E) -> E + Sync,
) -> R<Value<'t>> {
    match x.into_unique::<E>() {
        Ok(mut v) => {
            update1(&mut v, f);
            Ok(ctx.value(shape, v))
        }
        Err(x) => Ok(ctx.value(shape, map1(ctx.p(), view::<E>(&x, "the operand")?, f))),
    }
}

/// `f` of corresponding elements, in an operand's buffer when one may be overwritten.
fn binary_op<'t, E: Elem>(
    ctx: &Ctx<'_>,
    x: Value<'t>,
    y: Value<'t>,
    shape: &[usize],
    f: impl Fn(E, E) -> E + Sync,
) -> R<Value<'t>> {
    let x = match x.into_unique::<E>() {
        Ok(mut v) => {
            update_with(&mut v, view::<E>(&y, "the right operand")?, f);
            return Ok(ctx.value(shape, v));
        }
        Err(x) => x,
    };
    let y = match y.into_unique::<E>() {
        Ok(mut v) => {
            update_with(&mut v, view::<E>(&x, "the left operand")?, |b, a| f(a, b));
            return Ok(ctx.value(shape, v));
        }
        Err(y) => y,
    };
    Ok(ctx.value(
        shape,
        map2(
            ctx.p(),
            view::<E>(&x, "the left operand")?,
            view::<E>(&y, "the right operand")?,
            f,
        ),
    ))
}

fn unary<'t>(ctx: &Ctx<'_>, u: UnaryOp, x: Value<'t>, shape: &[usize]) -> R<Value<'t>> {
    match &x.data {
        Data::F(_) => match u {
            UnaryOp::Neg => unary_op(ctx, x, shape, |a: f32| -a),
            UnaryOp::Exp => unary_op(ctx, x, shape, f32::exp),
            UnaryOp::Log => unary_op(ctx, x, shape, f32::ln),
            UnaryOp::Sqrt => unary_op(ctx, x, shape, f32::sqrt),
            UnaryOp::Recip => unary_op(ctx, x, shape, |a: f32| 1.0 / a),
            UnaryOp::Relu => unary_op(
                ctx,
                x,
                shape,
                |a: f32| if a.is_nan() || a > 0.0 { a } else { 0.0 },
            ),
            UnaryOp::Sin => unary_op(ctx, x, shape, f32::sin),
            UnaryOp::Cos => unary_op(ctx, x, shape, f32::cos),
            UnaryOp::Tanh => unary_op(ctx, x, shape, f32::tanh),
            UnaryOp::Sigmoid => unary_op(ctx, x, shape, |a: f32| 1.0 / (1.0 + (-a).exp())),
            UnaryOp::Erf => unary_op(ctx, x, shape, libm::erff),
            UnaryOp::Rsqrt => unary_op(ctx, x, shape, |a: f32| 1.0 / a.sqrt()),
            UnaryOp::Silu => unary_op(ctx, x, shape, |a: f32| a / (1.0 + (-a).exp())),
        },
        Data::I(_) => match u {
            UnaryOp::Neg => unary_op(ctx, x, shape, i32::wrapping_neg),
            UnaryOp::Relu => unary_op(ctx, x, shape, |a: i32| a.max(0)),
            _ => Err(format!("{u:?} is not defined for i32")),
        },
        Data::B(_) => Err(format!("{u:?} is not defined for bool")),
    }
}

fn binary<'t>(
    ctx: &Ctx<'_>,
    b: BinaryOp,
    x: Value<'t>,
    y: Value<'t>,
    shape: &[usize],
) -> R<Value<'t>> {
    match (&x.data, &y.data) {
        (Data::F(_), Data::F(_)) => match b {
            BinaryOp::Add => binary_op(ctx, x, y, shape, |a: f32, b| a + b),
            BinaryOp::Sub => binary_op(ctx, x, y, shape, |a: f32, b| a - b),
            BinaryOp::Mul => binary_op(ctx, x, y, shape, |a: f32, b| a * b),
            BinaryOp::Div => binary_op(ctx, x, y, shape, |a: f32, b| a / b),
            BinaryOp::Max => binary_op(ctx, x, y, shape, fmax),
        },
        (Data::I(_), Data::I(_)) => match b {
            BinaryOp::Add => binary_op(ctx, x, y, shape, i32::wrapping_add),
            BinaryOp::Sub => binary_op(ctx, x, y, shape, i32::wrapping_sub),
            BinaryOp::Mul => binary_op(ctx, x, y, shape, i32::wrapping_mul),
            BinaryOp::Max => binary_op(ctx, x, y, shape, std::cmp::max::<i32>),
            BinaryOp::Div => Err("div is not defined for i32".into()),
        },
        (a, c) => Err(format!("{b:?} of {} and {} values", a.kind(), c.kind())),
    }
}

fn compare<'t>(
    ctx: &Ctx<'_>,
    c: CmpOp,
    x: &Value<'t>,
    y: &Value<'t>,
    shape: &[usize],
) -> R<Value<'t>> {
    fn cmp<E: Elem + PartialOrd>(
        pool: Option<&Pool>,
        c: CmpOp,
        x: View<'_, E>,
        y: View<'_, E>,
    ) -> Vec<bool> {
        match c {
            CmpOp::Eq => map2(pool, x, y, |a, b| a == b),
            CmpOp::Ne => map2(pool, x, y, |a, b| a != b),
            CmpOp::Lt => map2(pool, x, y, |a, b| a < b),
            CmpOp::Le => map2(pool, x, y, |a, b| a <= b),
            CmpOp::Gt => map2(pool, x, y, |a, b| a > b),
            CmpOp::Ge => map2(pool, x, y, |a, b| a >= b),
        }
    }
    let out = match (&x.data, &y.data) {
        (Data::F(_), Data::F(_)) => cmp(ctx.p(), c, view::<f32>(x, "x")?, view::<f32>(y, "y")?),
        (Data::I(_), Data::I(_)) => cmp(ctx.p(), c, view::<i32>(x, "x")?, view::<i32>(y, "y")?),
        _ => {
            return Err(format!(
                "compare needs two float or two i32 operands, got {} and {}",
                x.data.kind(),
                y.data.kind()
            ))
        }
    };
    Ok(ctx.value(shape, out))
}

fn cast<'t>(ctx: &Ctx<'_>, x: Value<'t>, to: DType, shape: &[usize]) -> R<Value<'t>> {
    let to_float = to.is_float();
    Ok(match &x.data {
        Data::F(_) if to_float => x,
        Data::I(_) if to == DType::I32 => x,
        Data::B(_) if to == DType::Bool => x,
        Data::F(_) => {
            let v = view::<f32>(&x, "the operand")?;
            if to == DType::I32 {
                // Saturating, NaN -> 0: Rust's `as`, like the reference's.
                ctx.value(shape, map1(ctx.p(), v, |a| a as i32))
            } else {
                ctx.value(shape, map1(ctx.p(), v, |a| a != 0.0))
            }
        }
        Data::I(_) => {
            let v = view::<i32>(&x, "the operand")?;
            if to_float {
                ctx.value(shape, map1(ctx.p(), v, |a| a as f32))
            } else {
                ctx.value(shape, map1(ctx.p(), v, |a| a != 0))
            }
        }
        Data::B(_) => {
            let v = view::<bool>(&x, "the operand")?;
            if to_float {
                ctx.value(shape, map1(ctx.p(), v, |a| if a { 1.0f32 } else { 0.0 }))
            } else {
                ctx.value(shape, map1(ctx.p(), v, i32::from))
            }
        }
    })
}

/// Inverted dropout on a row-major buffer whose first element has flat index `lo`.
fn dropout_mask(o: &mut [f32], lo: usize, (seed, step, stream): (u64, u32, u32), thr: u32, s: f32) {
    let end = lo + o.len();
    let mut i = lo;
    while i < end {
        let block = (i / 4) as u64;
        let words = rng::dropout_words(seed, step, stream, block);
        let stop = ((i / 4 + 1) * 4).min(end);
        for j in i..stop {
            let v = &mut o[j - lo];
            *v = if (words[j % 4] >> 8) >= thr {
                *v * s
            } else {
                0.0
            };
        }
        i = stop;
    }
}

/// Computes a non-source op.
pub(crate) fn compute<'t>(
    op: &Op,
    args: Vec<Value<'t>>,
    shape: &[usize],
    ctx: &Ctx<'_>,
) -> R<Value<'t>> {
    let numel: usize = shape.iter().product();
    let nargs = args.len();
    let mut args = args.into_iter();
    // The operands, in order.
    let mut arg = move || -> R<Value<'t>> {
        args.next()
            .ok_or_else(|| "internal: an operand is missing".to_string())
    };
    Ok(match op {
        Op::Input { .. } | Op::Param { .. } => {
            return Err("internal: sources are bound, not computed".into())
        }
        Op::Const { value, dtype } => {
            let v = value.get();
            match dtype {
                DType::I32 => ctx.value(&[], vec![v as i32]),
                DType::Bool => ctx.value(&[], vec![v != 0.0]),
                _ => ctx.value(&[], vec![v as f32]),
            }
        }
        Op::Reshape { .. } | Op::Permute { .. } | Op::Broadcast { .. } | Op::Slice { .. } => {
            view_op(op, arg()?, shape, ctx)?
        }
        Op::Unary(u) => unary(ctx, *u, arg()?, shape)?,
        Op::Binary(b) => {
            let (x, y) = (arg()?, arg()?);
            binary(ctx, *b, x, y, shape)?
        }
        Op::Compare(c) => {
            let (x, y) = (arg()?, arg()?);
            compare(ctx, *c, &x, &y, shape)?
        }
        Op::Where => select(ctx, arg()?, arg()?, arg()?, shape)?,
        Op::Cast { to } => cast(ctx, arg()?, *to, shape)?,
        Op::Reduce { op, axis } => reduce_op(ctx, *op, *axis, arg()?, shape)?,
        Op::MatMul => {
            let (a, b) = (arg()?, arg()?);
            ctx.value(
                shape,
                matmul(ctx.p(), view::<f32>(&a, "a")?, view::<f32>(&b, "b")?)?,
            )
        }
        Op::Gather => {
            let (table, ids) = (arg()?, arg()?);
            let ids = view::<i32>(&ids, "the ids")?;
            match &table.data {
                Data::F(_) => ctx.value(shape, gather(ctx.p(), view::<f32>(&table, "t")?, ids)?),
                Data::I(_) => ctx.value(shape, gather(ctx.p(), view::<i32>(&table, "t")?, ids)?),
                Data::B(_) => ctx.value(shape, gather(ctx.p(), view::<bool>(&table, "t")?, ids)?),
            }
        }
        Op::ScatterAdd { .. } => {
            let (ids, src) = (arg()?, arg()?);
            ctx.value(
                shape,
                scatter_add(
                    ctx.p(),
                    view::<i32>(&ids, "the ids")?,
                    view::<f32>(&src, "the values")?,
                    shape,
                )?,
            )
        }
        Op::Dropout { p, stream } => dropout(ctx, arg()?, (p.get(), *stream), shape)?,
        Op::CausalMask { .. } => {
            let [q, k] = shape else {
                return Err(format!("internal: a mask of shape {shape:?}"));
            };
            let (q, k) = (*q, *k);
            let offset = k as i128 - q as i128;
            ctx.value(
                shape,
                generate(ctx.p(), numel, |f| {
                    let (i, j) = (f / k, f % k);
                    j as i128 <= i as i128 + offset
                }),
            )
        }
        Op::PadMask { pad } => {
            let ids = arg()?;
            let pad = *pad;
            ctx.value(
                shape,
                map1(ctx.p(), view::<i32>(&ids, "the ids")?, |id| {
                    i64::from(id) != pad
                }),
            )
        }
        Op::Arange { start, .. } => {
            let start = start
                .eval(ctx.dims)
                .map_err(|e| format!("arange start: {e}"))?;
            let end = start + numel as i64;
            if start < i64::from(i32::MIN) || end - 1 > i64::from(i32::MAX) {
                return Err(format!("the range {start}..{end} does not fit in i32"));
            }
            ctx.value(
                shape,
                generate(ctx.p(), numel, |i| (start + i as i64) as i32),
            )
        }
        Op::OneHot { .. } => {
            let ids = arg()?;
            let depth = shape.last().copied().unwrap_or(0);
            ctx.value(
                shape,
                one_hot(ctx.p(), view::<i32>(&ids, "the ids")?, depth)?,
            )
        }
        Op::Concat { axis } => {
            let axis = *axis;
            if axis >= shape.len() {
                return Err(format!(
                    "internal: axis {axis} of a result of shape {shape:?}"
                ));
            }
            let parts: Vec<Value<'t>> = (0..nargs).map(|_| arg()).collect::<R<_>>()?;
            match parts.first().map(|p| &p.data) {
                Some(Data::F(_)) => ctx.value(shape, concat_as::<f32>(ctx, &parts, axis, shape)?),
                Some(Data::I(_)) => ctx.value(shape, concat_as::<i32>(ctx, &parts, axis, shape)?),
                Some(Data::B(_)) => ctx.value(shape, concat_as::<bool>(ctx, &parts, axis, shape)?),
                None => return Err("internal: concat of nothing".into()),
            }
        }
    })
}

/// A view op: the operand's data under a new layout (a reshape the layout cannot express
/// is a contiguous copy).
fn view_op<'t>(op: &Op, x: Value<'t>, shape: &[usize], ctx: &Ctx<'_>) -> R<Value<'t>> {
    let numel: usize = shape.iter().product();
    Ok(match op {
        Op::Reshape { .. } => {
            if x.layout.numel() != numel {
                return Err(format!(
                    "internal: cannot reshape {:?} into {shape:?}",
                    x.shape()
                ));
            }
            match x.layout.reshape(shape) {
                Some(l) => Value {
                    data: x.data,
                    layout: l,
                },
                None => {
                    let m = materialize(&x, ctx);
                    Value {
                        data: m.data,
                        layout: Layout::contiguous(shape),
                    }
                }
            }
        }
        Op::Permute { perm } => {
            let fits = perm.len() == x.shape().len()
                && perm
                    .iter()
                    .zip(shape)
                    .all(|(&p, &d)| x.shape().get(p) == Some(&d));
            if !fits {
                return Err(format!(
                    "internal: permutation {perm:?} does not take {:?} to {shape:?}",
                    x.shape()
                ));
            }
            let l = x.layout.permute(perm);
            Value {
                data: x.data,
                layout: l,
            }
        }
        Op::Broadcast { .. } => {
            let rank = shape.len();
            let xs = x.shape();
            let ok = xs.len() <= rank
                && xs
                    .iter()
                    .enumerate()
                    .all(|(j, &d)| d == 1 || d == shape[rank - xs.len() + j]);
            if !ok {
                return Err(format!("internal: cannot broadcast {xs:?} to {shape:?}"));
            }
            let l = x.layout.broadcast(shape);
            Value {
                data: x.data,
                layout: l,
            }
        }
        Op::Slice { axis, start, .. } => {
            let start = start
                .eval(ctx.dims)
                .ok()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| format!("slice start {start} is not a valid index"))?;
            let (axis, len) = (*axis, shape.get(*axis).copied().unwrap_or(0));
            let full = x.shape().get(axis).copied().unwrap_or(0);
            if start + len > full {
                return Err(format!(
                    "slice {start}..{} is outside axis {axis} of size {full}",
                    start + len
                ));
            }
            let l = x.layout.slice(axis, start, len);
            Value {
                data: x.data,
                layout: l,
            }
        }
        other => return Err(format!("internal: `{}` is not a view", other.name())),
    })
}

/// `where(c, a, b)`: `a` where `c` holds, else `b`.
fn select<'t>(
    ctx: &Ctx<'_>,
    c: Value<'t>,
    a: Value<'t>,
    b: Value<'t>,
    shape: &[usize],
) -> R<Value<'t>> {
    Ok({
        let cv = view::<bool>(&c, "the condition")?;
        match (&a.data, &b.data) {
            (Data::F(_), Data::F(_)) => ctx.value(
                shape,
                map3(
                    ctx.p(),
                    cv,
                    view::<f32>(&a, "a")?,
                    view::<f32>(&b, "b")?,
                    |c, a, b| if c { a } else { b },
                ),
            ),
            (Data::I(_), Data::I(_)) => ctx.value(
                shape,
                map3(
                    ctx.p(),
                    cv,
                    view::<i32>(&a, "a")?,
                    view::<i32>(&b, "b")?,
                    |c, a, b| if c { a } else { b },
                ),
            ),
            (Data::B(_), Data::B(_)) => ctx.value(
                shape,
                map3(
                    ctx.p(),
                    cv,
                    view::<bool>(&a, "a")?,
                    view::<bool>(&b, "b")?,
                    |c, a, b| if c { a } else { b },
                ),
            ),
            (x, y) => return Err(format!("values are {} and {}", x.kind(), y.kind())),
        }
    })
}

/// A sum or max over `axis`.
fn reduce_op<'t>(
    ctx: &Ctx<'_>,
    op: ReduceOp,
    axis: usize,
    x: Value<'t>,
    shape: &[usize],
) -> R<Value<'t>> {
    Ok({
        if axis >= x.shape().len() {
            return Err(format!(
                "internal: axis {axis} of a tensor of shape {:?}",
                x.shape()
            ));
        }
        match (&x.data, op) {
            (Data::F(_), ReduceOp::Sum) => {
                let add = |a: f32, b: f32| a + b;
                let row = |r: &[f32]| fold_row(r, 0.0, add);
                ctx.value(
                    shape,
                    reduce(ctx.p(), view::<f32>(&x, "x")?, axis, 0.0, add, row),
                )
            }
            (Data::F(_), ReduceOp::Max) => {
                let ninf = f32::NEG_INFINITY;
                ctx.value(
                    shape,
                    reduce(ctx.p(), view::<f32>(&x, "x")?, axis, ninf, fmax, max_row),
                )
            }
            (Data::I(_), ReduceOp::Sum) => {
                let add = i32::wrapping_add;
                let row = |r: &[i32]| fold_row(r, 0, add);
                ctx.value(
                    shape,
                    reduce(ctx.p(), view::<i32>(&x, "x")?, axis, 0, add, row),
                )
            }
            (Data::I(_), ReduceOp::Max) => {
                let max = std::cmp::max::<i32>;
                let row = |r: &[i32]| fold_row(r, i32::MIN, max);
                ctx.value(
                    shape,
                    reduce(ctx.p(), view::<i32>(&x, "x")?, axis, i32::MIN, max, row),
                )
            }
            (Data::B(_), _) => return Err("reducing bool values".into()),
        }
    })
}

/// Inverted dropout with probability `p`, in place where the operand is not shared.
fn dropout<'t>(
    ctx: &Ctx<'_>,
    x: Value<'t>,
    (p, stream): (f64, u32),
    shape: &[usize],
) -> R<Value<'t>> {
    Ok({
        let thr = rng::dropout_threshold(p);
        let scale = (1.0 / (1.0 - p)) as f32;
        let key = (ctx.seed, ctx.step, stream);
        let mut v = match x.into_unique::<f32>() {
            Ok(v) => v,
            Err(x) => to_vec(ctx.p(), view::<f32>(&x, "the operand")?),
        };
        chunked(&mut v, |o, lo| dropout_mask(o, lo, key, thr, scale));
        ctx.value(shape, v)
    })
}

fn concat_as<E: Elem>(
    ctx: &Ctx<'_>,
    parts: &[Value<'_>],
    axis: usize,
    shape: &[usize],
) -> R<Vec<E>> {
    let views: Vec<View<'_, E>> = parts
        .iter()
        .map(|p| view::<E>(p, "a part"))
        .collect::<R<_>>()?;
    let fits = views.iter().all(|v| {
        v.shape().len() == shape.len()
            && v.shape()
                .iter()
                .zip(shape)
                .enumerate()
                .all(|(i, (a, b))| i == axis || a == b)
    }) && views.iter().map(|v| v.shape()[axis]).sum::<usize>() == shape[axis];
    if !fits {
        return Err(format!(
            "internal: parts do not add up to the result {shape:?}"
        ));
    }
    Ok(concat(ctx.p(), &views, axis, shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ptr(v: &Value<'_>) -> *const f32 {
        v.view::<f32>()
            .map_or(std::ptr::null(), |x| x.data.as_ptr())
    }

    fn ctx<'a>(dims: &'a BTreeMap<String, i64>, pool: &'a Arc<Pool>) -> Ctx<'a> {
        Ctx {
            dims,
            seed: 1,
            step: 0,
            pool,
        }
    }

    #[test]
    fn elementwise_ops_reuse_a_dying_operand_and_never_a_shared_one() {
        let dims = BTreeMap::new();
        let pool = Arc::new(Pool::default());
        let x = Value::owned(&[3], vec![1.0f32, 2.0, 3.0], None);
        let p = ptr(&x);
        // Sole owner: written in place.
        let y = compute(&Op::Unary(UnaryOp::Neg), vec![x], &[3], &ctx(&dims, &pool)).unwrap();
        assert_eq!(ptr(&y), p);
        assert_eq!(y.view::<f32>().unwrap().data, &[-1.0, -2.0, -3.0]);
        // Shared (another value still holds the buffer): a new buffer, the old intact.
        let keep = y.clone();
        let z = compute(&Op::Unary(UnaryOp::Neg), vec![y], &[3], &ctx(&dims, &pool)).unwrap();
        assert_ne!(ptr(&z), p);
        assert_eq!(keep.view::<f32>().unwrap().data, &[-1.0, -2.0, -3.0]);
        // A binary op writes into whichever operand it may overwrite.
        let borrowed = [10.0f32, 20.0, 30.0];
        let b = Value::borrowed(&[3], &borrowed[..]);
        let pz = ptr(&z);
        let s = compute(
            &Op::Binary(BinaryOp::Sub),
            vec![b, z],
            &[3],
            &ctx(&dims, &pool),
        )
        .unwrap();
        assert_eq!(ptr(&s), pz);
        assert_eq!(s.view::<f32>().unwrap().data, &[9.0, 18.0, 27.0]);
        // Views share storage.
        let ps = ptr(&s);
        let r = compute(
            &Op::Reshape {
                shape: kiln_compiler::Shape::consts(&[3, 1]),
            },
            vec![s],
            &[3, 1],
            &ctx(&dims, &pool),
        )
        .unwrap();
        assert_eq!(ptr(&r), ps);
        let t = compute(
            &Op::Permute { perm: vec![1, 0] },
            vec![r],
            &[1, 3],
            &ctx(&dims, &pool),
        )
        .unwrap();
        assert_eq!(ptr(&t), ps);
    }

    #[test]
    fn large_dead_buffers_go_back_to_the_pool_and_are_reused() {
        let dims = BTreeMap::new();
        let pool = Arc::new(Pool::default());
        let n = super::super::pool::POOL_MIN;
        let c = ctx(&dims, &pool);
        let x = c.value(&[n], vec![1.0f32; n]);
        let p = ptr(&x);
        let y = compute(&Op::Unary(UnaryOp::Exp), vec![x.clone()], &[n], &c).unwrap();
        assert_ne!(ptr(&y), p, "x is shared, so exp needs a new buffer");
        drop(x);
        assert_eq!(pool.len(), 1, "x's buffer is pooled once nothing reads it");
        let z = compute(&Op::Unary(UnaryOp::Neg), vec![y.clone()], &[n], &c).unwrap();
        assert_eq!(ptr(&z), p, "and reused for the next new buffer");
        assert_eq!(pool.len(), 0);
    }
}
