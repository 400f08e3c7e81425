//! The reference executor's operations, one function each: plain loops over flat
//! element vectors, in the precision the run asks for.

use super::*;

/// A bound source's elements in the executor's representation.
pub(super) fn source_data<T: Real>(src: Source<'_>) -> Data<T> {
    match src {
        Source::F32(v) => Data::F(v.iter().map(|&x| T::from_f64(f64::from(x))).collect()),
        Source::F64(v) => Data::F(v.iter().map(|&x| T::from_f64(x)).collect()),
        Source::I32(v) => Data::I(v.into_owned()),
        Source::Bool(v) => Data::B(v.to_vec()),
    }
}

pub(super) fn unary<T: Real>(u: UnaryOp, x: &Data<T>) -> NodeResult<Data<T>> {
    Ok(match x {
        Data::F(v) => {
            let f: fn(T) -> T = match u {
                UnaryOp::Neg => |a| -a,
                UnaryOp::Exp => T::exp,
                UnaryOp::Log => T::ln,
                UnaryOp::Sqrt => T::sqrt,
                UnaryOp::Recip => |a| T::ONE / a,
                UnaryOp::Relu => |a| {
                    if a.is_nan() || a > T::ZERO {
                        a
                    } else {
                        T::ZERO
                    }
                },
                UnaryOp::Sin => T::sin,
                UnaryOp::Cos => T::cos,
                UnaryOp::Tanh => T::tanh,
                UnaryOp::Sigmoid => |a| T::ONE / (T::ONE + (-a).exp()),
                UnaryOp::Erf => T::erf,
                UnaryOp::Rsqrt => |a| T::ONE / a.sqrt(),
                UnaryOp::Silu => |a| a / (T::ONE + (-a).exp()),
            };
            Data::F(v.iter().map(|&a| f(a)).collect())
        }
        Data::I(v) => match u {
            UnaryOp::Neg => Data::I(v.iter().map(|a| a.wrapping_neg()).collect()),
            UnaryOp::Relu => Data::I(v.iter().map(|&a| a.max(0)).collect()),
            _ => return Err(format!("{u:?} is not defined for i32")),
        },
        Data::B(_) => return Err(format!("{u:?} is not defined for bool")),
    })
}

pub(super) fn binary<T: Real>(b: BinaryOp, x: &Data<T>, y: &Data<T>) -> NodeResult<Data<T>> {
    Ok(match (x, y) {
        (Data::F(x), Data::F(y)) => {
            let f: fn(T, T) -> T = match b {
                BinaryOp::Add => |a, b| a + b,
                BinaryOp::Sub => |a, b| a - b,
                BinaryOp::Mul => |a, b| a * b,
                BinaryOp::Div => |a, b| a / b,
                BinaryOp::Max => fmax,
            };
            Data::F(x.iter().zip(y).map(|(&a, &b)| f(a, b)).collect())
        }
        (Data::I(x), Data::I(y)) => {
            let f: fn(i32, i32) -> i32 = match b {
                BinaryOp::Add => i32::wrapping_add,
                BinaryOp::Sub => i32::wrapping_sub,
                BinaryOp::Mul => i32::wrapping_mul,
                BinaryOp::Max => std::cmp::max,
                BinaryOp::Div => return Err("div is not defined for i32".into()),
            };
            Data::I(x.iter().zip(y).map(|(&a, &b)| f(a, b)).collect())
        }
        (x, y) => return Err(format!("{b:?} of {} and {} values", x.kind(), y.kind())),
    })
}

pub(super) fn compare<T: Real>(c: CmpOp, x: &Data<T>, y: &Data<T>) -> NodeResult<Data<T>> {
    fn cmp<E: PartialOrd + Copy>(c: CmpOp, a: &[E], b: &[E]) -> Vec<bool> {
        let f: fn(&E, &E) -> bool = match c {
            CmpOp::Eq => |a, b| a == b,
            CmpOp::Ne => |a, b| a != b,
            CmpOp::Lt => |a, b| a < b,
            CmpOp::Le => |a, b| a <= b,
            CmpOp::Gt => |a, b| a > b,
            CmpOp::Ge => |a, b| a >= b,
        };
        a.iter().zip(b).map(|(a, b)| f(a, b)).collect()
    }
    Ok(match (x, y) {
        (Data::F(a), Data::F(b)) => Data::B(cmp(c, a, b)),
        (Data::I(a), Data::I(b)) => Data::B(cmp(c, a, b)),
        _ => {
            return Err(format!(
                "compare needs two float or two i32 operands, got {} and {}",
                x.kind(),
                y.kind()
            ))
        }
    })
}

pub(super) fn cast<T: Real>(x: &Data<T>, to: DType) -> Data<T> {
    match (x, to) {
        (Data::F(v), DType::I32) => Data::I(v.iter().map(|&a| a.to_f64() as i32).collect()),
        (Data::F(v), DType::Bool) => Data::B(v.iter().map(|&a| a != T::ZERO).collect()),
        (Data::F(v), _) => Data::F(v.clone()),
        (Data::I(v), DType::I32) => Data::I(v.clone()),
        (Data::I(v), DType::Bool) => Data::B(v.iter().map(|&a| a != 0).collect()),
        (Data::I(v), _) => Data::F(v.iter().map(|&a| T::from_f64(f64::from(a))).collect()),
        (Data::B(v), DType::I32) => Data::I(v.iter().map(|&a| i32::from(a)).collect()),
        (Data::B(v), DType::Bool) => Data::B(v.clone()),
        (Data::B(v), _) => Data::F(
            v.iter()
                .map(|&a| if a { T::ONE } else { T::ZERO })
                .collect(),
        ),
    }
}

pub(super) fn reduce<T: Real>(op: ReduceOp, axis: usize, x: &Buf<T>) -> NodeResult<Data<T>> {
    if axis >= x.shape.len() {
        return Err(format!(
            "axis {axis} of a tensor of shape {}",
            fmt_dims(&x.shape)
        ));
    }
    let outer = product(&x.shape[..axis]);
    let len = x.shape[axis];
    let inner = product(&x.shape[axis + 1..]);
    fn fold<E: Copy>(
        v: &[E],
        (outer, len, inner): (usize, usize, usize),
        init: E,
        f: impl Fn(E, E) -> E,
    ) -> Vec<E> {
        let mut out = Vec::with_capacity(outer * inner);
        for o in 0..outer {
            for r in 0..inner {
                let mut acc = init;
                for a in 0..len {
                    acc = f(acc, v[(o * len + a) * inner + r]);
                }
                out.push(acc);
            }
        }
        out
    }
    let dims = (outer, len, inner);
    Ok(match (&x.data, op) {
        (Data::F(v), ReduceOp::Sum) => Data::F(fold(v, dims, T::ZERO, |a, b| a + b)),
        (Data::F(v), ReduceOp::Max) => Data::F(fold(v, dims, T::NEG_INFINITY, fmax)),
        (Data::I(v), ReduceOp::Sum) => Data::I(fold(v, dims, 0, i32::wrapping_add)),
        (Data::I(v), ReduceOp::Max) => Data::I(fold(v, dims, i32::MIN, std::cmp::max)),
        (Data::B(_), _) => return Err("reducing bool values".into()),
    })
}

pub(super) fn matmul<T: Real>(a: &Buf<T>, b: &Buf<T>) -> NodeResult<Data<T>> {
    let (Data::F(av), Data::F(bv)) = (&a.data, &b.data) else {
        return Err(format!(
            "matmul of {} and {} values",
            a.data.kind(),
            b.data.kind()
        ));
    };
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let fits = ra >= 2
        && rb >= 2
        && a.shape[ra - 1] == b.shape[rb - 2]
        && (rb == 2 || a.shape[..ra - 2] == b.shape[..rb - 2]);
    if !fits {
        return Err(format!(
            "cannot multiply {} by {}",
            fmt_dims(&a.shape),
            fmt_dims(&b.shape)
        ));
    }
    let (m, k, n) = (a.shape[ra - 2], a.shape[ra - 1], b.shape[rb - 1]);
    let batch = product(&a.shape[..ra - 2]);
    let shared = rb == 2;
    // Each out[i, j] is the sum over p = 0, 1, …, k-1 in that order (a plain dot product);
    // the loops run i, p, j so that rows of `b` are read contiguously, which keeps the
    // per-element order while touching memory in a cache-friendly way.
    let mut out = vec![T::ZERO; batch * m * n];
    for bi in 0..batch {
        let a0 = bi * m * k;
        let b0 = if shared { 0 } else { bi * k * n };
        for i in 0..m {
            let row = &mut out[(bi * m + i) * n..(bi * m + i + 1) * n];
            for p in 0..k {
                let x = av[a0 + i * k + p];
                let brow = &bv[b0 + p * n..b0 + (p + 1) * n];
                for (o, &y) in row.iter_mut().zip(brow) {
                    *o = *o + x * y;
                }
            }
        }
    }
    Ok(Data::F(out))
}

pub(super) fn concat<T: Real>(
    axis: usize,
    args: &[&Buf<T>],
    shape: &[usize],
) -> NodeResult<Data<T>> {
    if axis >= shape.len() {
        return Err(format!(
            "axis {axis} of a result of shape {}",
            fmt_dims(shape)
        ));
    }
    for x in args {
        let fits = x.shape.len() == shape.len()
            && x.shape
                .iter()
                .zip(shape)
                .enumerate()
                .all(|(i, (a, b))| i == axis || a == b);
        if !fits {
            return Err(format!(
                "part of shape {} does not fit the result {}",
                fmt_dims(&x.shape),
                fmt_dims(shape)
            ));
        }
    }
    if args.iter().map(|x| x.shape[axis]).sum::<usize>() != shape[axis] {
        return Err(format!(
            "parts do not add up to the result {}",
            fmt_dims(shape)
        ));
    }
    let outer = product(&shape[..axis]);
    let inner = product(&shape[axis + 1..]);
    fn join<E: Copy>(parts: &[(&[E], usize)], outer: usize) -> Vec<E> {
        let mut out = Vec::new();
        for o in 0..outer {
            for &(v, chunk) in parts {
                out.extend_from_slice(&v[o * chunk..(o + 1) * chunk]);
            }
        }
        out
    }
    let chunk = |x: &Buf<T>| x.shape[axis] * inner;
    macro_rules! parts {
        ($variant:ident) => {{
            let mut parts = Vec::with_capacity(args.len());
            for x in args {
                match &x.data {
                    Data::$variant(v) => parts.push((v.as_slice(), chunk(x))),
                    other => {
                        return Err(format!(
                            "parts are {} and {}",
                            args[0].data.kind(),
                            other.kind()
                        ))
                    }
                }
            }
            Data::$variant(join(&parts, outer))
        }};
    }
    Ok(match &args[0].data {
        Data::F(_) => parts!(F),
        Data::I(_) => parts!(I),
        Data::B(_) => parts!(B),
    })
}

/// `x` with its axes permuted by `perm`.
pub(super) fn permute<T: Real>(
    args: &[&Buf<T>],
    shape: &[usize],
    perm: &[usize],
) -> NodeResult<Data<T>> {
    let numel = product(shape);
    Ok({
        let x = args[0];
        let fits = perm.len() == x.shape.len()
            && perm.len() == shape.len()
            && perm
                .iter()
                .zip(shape)
                .all(|(&p, &d)| x.shape.get(p) == Some(&d));
        if !fits {
            return Err(format!(
                "permutation {perm:?} does not take {} to {}",
                fmt_dims(&x.shape),
                fmt_dims(shape)
            ));
        }
        let in_strides = strides(&x.shape);
        let mut o = vec![0; shape.len()];
        let idx: Vec<usize> = (0..numel)
            .map(|flat| {
                unravel(flat, shape, &mut o);
                (0..shape.len()).map(|i| o[i] * in_strides[perm[i]]).sum()
            })
            .collect();
        x.data.select(&idx)
    })
}

/// `x` broadcast to `shape` (numpy's rules: missing and size-1 axes repeat).
pub(super) fn broadcast<T: Real>(args: &[&Buf<T>], shape: &[usize]) -> NodeResult<Data<T>> {
    let numel = product(shape);
    Ok({
        let x = args[0];
        let rank = shape.len();
        let ok = x.shape.len() <= rank
            && x.shape
                .iter()
                .enumerate()
                .all(|(j, &d)| d == 1 || d == shape[rank - x.shape.len() + j]);
        if !ok {
            return Err(format!(
                "cannot broadcast {} to {}",
                fmt_dims(&x.shape),
                fmt_dims(shape)
            ));
        }
        let off = rank - x.shape.len();
        let in_strides = strides(&x.shape);
        let mut o = vec![0; rank];
        let idx: Vec<usize> = (0..numel)
            .map(|flat| {
                unravel(flat, shape, &mut o);
                x.shape
                    .iter()
                    .enumerate()
                    .map(|(j, &d)| {
                        if d == 1 {
                            0
                        } else {
                            o[off + j] * in_strides[j]
                        }
                    })
                    .sum()
            })
            .collect();
        x.data.select(&idx)
    })
}

/// Positions `start..start + len` of `x` along `axis`.
pub(super) fn slice<T: Real>(
    args: &[&Buf<T>],
    shape: &[usize],
    (axis, start): (&usize, &crate::shape::Dim),
    dims: &BTreeMap<String, i64>,
) -> NodeResult<Data<T>> {
    let numel = product(shape);
    Ok({
        let x = args[0];
        let start = start
            .eval(dims)
            .ok()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| format!("slice start {start} is not a valid index"))?;
        let (axis, len) = (*axis, shape.get(*axis).copied().unwrap_or(0));
        let full = x.shape.get(axis).copied().unwrap_or(0);
        if start + len > full {
            return Err(format!(
                "slice {start}..{} is outside axis {axis} of size {full}",
                start + len
            ));
        }
        let outer = product(&x.shape[..axis]);
        let inner = product(&x.shape[axis + 1..]);
        let mut idx = Vec::with_capacity(numel);
        for o in 0..outer {
            let base = o * full * inner + start * inner;
            idx.extend(base..base + len * inner);
        }
        x.data.select(&idx)
    })
}

/// `where(c, a, b)`: `a` where `c` holds, else `b`.
pub(super) fn select<T: Real>(args: &[&Buf<T>]) -> NodeResult<Data<T>> {
    Ok({
        let (c, a, b) = (args[0], args[1], args[2]);
        if a.shape != c.shape || b.shape != c.shape {
            return Err(format!(
                "condition and values have shapes {}, {} and {}",
                fmt_dims(&c.shape),
                fmt_dims(&a.shape),
                fmt_dims(&b.shape)
            ));
        }
        let Data::B(c) = &c.data else {
            return Err(format!("condition is {}, not bool", c.data.kind()));
        };
        fn pick<E: Copy>(c: &[bool], a: &[E], b: &[E]) -> Vec<E> {
            c.iter()
                .zip(a.iter().zip(b))
                .map(|(&c, (&a, &b))| if c { a } else { b })
                .collect()
        }
        match (&a.data, &b.data) {
            (Data::F(a), Data::F(b)) => Data::F(pick(c, a, b)),
            (Data::I(a), Data::I(b)) => Data::I(pick(c, a, b)),
            (Data::B(a), Data::B(b)) => Data::B(pick(c, a, b)),
            (a, b) => return Err(format!("values are {} and {}", a.kind(), b.kind())),
        }
    })
}

/// The table's rows at `ids`.
pub(super) fn gather<T: Real>(args: &[&Buf<T>]) -> NodeResult<Data<T>> {
    Ok({
        let (table, ids) = (args[0], args[1]);
        let Data::I(ids) = &ids.data else {
            return Err(format!("ids are {}, not i32", ids.data.kind()));
        };
        let Some((&v, rest)) = table.shape.split_first() else {
            return Err("the table is a scalar".into());
        };
        let row = product(rest);
        let mut idx = Vec::with_capacity(ids.len() * row);
        for (p, &id) in ids.iter().enumerate() {
            let r = check_id(id, v, p, format_args!("the table has {v} rows"))?;
            idx.extend(r * row..(r + 1) * row);
        }
        table.data.select(&idx)
    })
}

/// The rows of `src` added into a zero table at `ids`.
pub(super) fn scatter_add<T: Real>(args: &[&Buf<T>], shape: &[usize]) -> NodeResult<Data<T>> {
    let numel = product(shape);
    Ok({
        let (ids, src) = (args[0], args[1]);
        let Data::I(id_vals) = &ids.data else {
            return Err(format!("ids are {}, not i32", ids.data.kind()));
        };
        let Data::F(src_vals) = &src.data else {
            return Err(format!("values are {}, not float", src.data.kind()));
        };
        let Some((&rows, rest)) = shape.split_first() else {
            return Err("the result is a scalar".into());
        };
        let row = product(rest);
        if !src.shape.starts_with(&ids.shape) || product(&src.shape[ids.shape.len()..]) != row {
            return Err(format!(
                "values {} do not fit ids {} and result {}",
                fmt_dims(&src.shape),
                fmt_dims(&ids.shape),
                fmt_dims(shape)
            ));
        }
        let mut out = vec![T::ZERO; numel];
        for (p, &id) in id_vals.iter().enumerate() {
            let r = check_id(id, rows, p, format_args!("the result has {rows} rows"))?;
            for d in 0..row {
                out[r * row + d] = out[r * row + d] + src_vals[p * row + d];
            }
        }
        Data::F(out)
    })
}

/// Inverted dropout with probability `p`, keyed by the run's seed and step, the
/// stream and the element index.
pub(super) fn dropout<T: Real>(
    args: &[&Buf<T>],
    (p, stream): (f64, u32),
    opts: &RunOptions,
) -> NodeResult<Data<T>> {
    Ok({
        let Data::F(x) = &args[0].data else {
            return Err(format!("dropout of {} values", args[0].data.kind()));
        };
        let threshold = rng::dropout_threshold(p);
        let scale = T::from_f64(1.0 / (1.0 - p));
        let (seed, step) = (opts.seed, opts.step);
        Data::F(
            x.iter()
                .enumerate()
                .map(|(i, &v)| {
                    if rng::dropout_keep(seed, step, stream, i as u64, threshold) {
                        v * scale
                    } else {
                        T::ZERO
                    }
                })
                .collect(),
        )
    })
}

/// `j ≤ i + (k − q)`: a query sees the keys up to its own position.
pub(super) fn causal_mask<T: Real>(shape: &[usize]) -> NodeResult<Data<T>> {
    let numel = product(shape);
    Ok({
        let [q, k] = shape else {
            return Err(format!("a mask of shape {}", fmt_dims(shape)));
        };
        let offset = *k as i128 - *q as i128;
        let mut out = Vec::with_capacity(numel);
        for i in 0..*q {
            for j in 0..*k {
                out.push(j as i128 <= i as i128 + offset);
            }
        }
        Data::B(out)
    })
}

/// One row of `depth` per id, 1 at the id.
pub(super) fn one_hot<T: Real>(args: &[&Buf<T>], shape: &[usize]) -> NodeResult<Data<T>> {
    let numel = product(shape);
    Ok({
        let Data::I(ids) = &args[0].data else {
            return Err(format!("ids are {}, not i32", args[0].data.kind()));
        };
        let depth = shape.last().copied().unwrap_or(0);
        if ids.len().checked_mul(depth) != Some(numel) {
            return Err(format!(
                "ids {} do not fit the result {}",
                fmt_dims(&args[0].shape),
                fmt_dims(shape)
            ));
        }
        let mut out = vec![T::ZERO; numel];
        for (p, &id) in ids.iter().enumerate() {
            let c = check_id(id, depth, p, format_args!("the depth is {depth}"))?;
            out[p * depth + c] = T::ONE;
        }
        Data::F(out)
    })
}
