//! Builtin functions: the IR primitives as the DSL sees them, plus number helpers,
//! `repeat` and the parameter initializers.
//!
//! In: a builtin's name and its evaluated arguments. Out: a [`Value`] — usually a new IR
//! node — or a diagnostic. Builtins bind arguments like layers do (positional, then by
//! name, with suggestions for unknown names). Every builtin is also reachable as
//! `prim.<name>`, which is how the prelude's `dropout` layer reaches the primitive of the
//! same name.

use std::rc::Rc;

use kiln_ir::ir::{BinaryOp, DType, Float, Init, NodeId, Op, ReduceOp, UnaryOp};
use kiln_ir::shape::{Dim, Shape};

use crate::diagnostics::{did_you_mean, Diag};
use crate::elaborate::{EArg, Elab, Frame, Mode, R};
use crate::source::Span;
use crate::values::{Partial, Value};

/// The symbolic dim of positions already decoded (the key/value cache length).
/// The most copies one `repeat` makes (each copy is a layer with its own weights).
pub const MAX_REPEAT: i64 = 10_000;

pub const PAST: &str = "past";

/// Name and parameters (`?` marks optional ones).
const BUILTINS: &[(&str, &[&str])] = &[
    ("exp", &["x"]),
    ("log", &["x"]),
    ("sqrt", &["x"]),
    ("sin", &["x"]),
    ("cos", &["x"]),
    ("relu", &["x"]),
    ("recip", &["x"]),
    ("neg", &["x"]),
    ("max", &["a", "b"]),
    ("min", &["a", "b"]),
    ("sum", &["x", "axis?"]),
    ("amax", &["x", "axis?"]),
    ("mean", &["x", "axis?"]),
    ("reshape", &["x", "shape"]),
    ("permute", &["x", "perm"]),
    ("transpose", &["x", "a?", "b?"]),
    ("broadcast", &["x", "shape"]),
    ("where", &["cond", "a", "b"]),
    ("cast", &["x", "dtype"]),
    ("gather", &["table", "ids"]),
    ("scatter_add", &["ids", "src", "rows"]),
    ("dropout", &["x", "p"]),
    ("causal_mask", &["q", "k"]),
    ("padding_mask", &["ids", "pad?"]),
    ("arange", &["n", "start?"]),
    ("slice", &["x", "axis", "start", "len"]),
    ("one_hot", &["ids", "depth"]),
    ("concat", &["xs", "axis?"]),
    ("matmul", &["a", "b"]),
    ("dim", &["x", "axis"]),
    ("rank", &["x"]),
    ("float", &["x"]),
    ("int", &["x"]),
    ("repeat", &["n", "layer"]),
    ("kv_cache", &["x", "axis", "name"]),
    ("past_len", &[]),
    ("decoding", &[]),
    ("normal", &["std"]),
    ("uniform", &["a"]),
    ("constant", &["value"]),
    ("xavier_uniform", &[]),
    ("zeros", &[]),
    ("ones", &[]),
];

pub fn is_builtin(name: &str) -> bool {
    BUILTINS.iter().any(|(n, _)| *n == name)
}

pub fn names() -> impl Iterator<Item = &'static str> {
    BUILTINS.iter().map(|(n, _)| *n)
}

/// Initializers that can be named without a call (`init zeros`).
pub fn named_init(name: &str) -> Option<Init> {
    match name {
        "xavier_uniform" => Some(Init::XavierUniform),
        "zeros" => Some(Init::Zeros),
        "ones" => Some(Init::Ones),
        _ => None,
    }
}

/// Arguments bound to a builtin's parameters.
struct Args {
    name: &'static str,
    params: &'static [&'static str],
    vals: Vec<Option<(Value, Span)>>,
    span: Span,
}

impl Args {
    fn bind(name: &str, args: Vec<EArg>, span: Span) -> R<Args> {
        let (name, params) = BUILTINS
            .iter()
            .find(|(n, _)| *n == name)
            .copied()
            .expect("checked by is_builtin");
        let clean = |p: &str| p.trim_end_matches('?').to_string();
        let usage = format!(
            "`{name}({})`",
            params
                .iter()
                .map(|p| clean(p))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut vals: Vec<Option<(Value, Span)>> = params.iter().map(|_| None).collect();
        let mut next = 0;
        for a in args {
            let i = match &a.name {
                None => {
                    if next >= params.len() {
                        return Err(Diag::new(
                            "kiln::argument",
                            format!(
                                "`{name}` takes {} argument{}, got more",
                                params.len(),
                                if params.len() == 1 { "" } else { "s" }
                            ),
                        )
                        .at(a.span, "one too many")
                        .help(usage));
                    }
                    next += 1;
                    next - 1
                }
                Some(n) => match params.iter().position(|p| clean(p) == n.name) {
                    Some(i) => i,
                    None => {
                        let cands: Vec<String> = params.iter().map(|p| clean(p)).collect();
                        return Err(Diag::new(
                            "kiln::argument",
                            format!("`{name}` has no parameter `{}`", n.name),
                        )
                        .at(n.span, "unknown parameter")
                        .help(
                            did_you_mean(&n.name, cands.iter().map(|s| s.as_str()))
                                .unwrap_or_else(|| format!("`{name}({})`", cands.join(", "))),
                        ));
                    }
                },
            };
            if vals[i].is_some() {
                return Err(Diag::new(
                    "kiln::argument",
                    format!("argument `{}` of `{name}` is given twice", clean(params[i])),
                )
                .at(a.span, "given again")
                .help("pass each argument once"));
            }
            vals[i] = Some((a.value, a.span));
        }
        for (i, p) in params.iter().enumerate() {
            if vals[i].is_none() && !p.ends_with('?') {
                return Err(Diag::new(
                    "kiln::argument",
                    format!("missing argument `{p}` of `{name}`"),
                )
                .at(span, format!("`{p}` is not given"))
                .help(usage));
            }
        }
        Ok(Args {
            name,
            params,
            vals,
            span,
        })
    }

    fn get(&self, p: &str) -> Option<&(Value, Span)> {
        let i = self
            .params
            .iter()
            .position(|q| q.trim_end_matches('?') == p)
            .expect("known parameter");
        self.vals[i].as_ref()
    }

    fn req(&self, p: &str) -> &(Value, Span) {
        self.get(p).expect("required arguments are checked in bind")
    }

    fn wrong(&self, p: &str, want: &str) -> Diag {
        let (v, s) = self.req(p);
        Diag::new(
            "kiln::type",
            format!(
                "argument `{p}` of `{}` must be {want}, got {}",
                self.name,
                v.kind()
            ),
        )
        .at(*s, format!("this is {}", v.kind()))
    }

    fn tensor(&self, p: &str) -> R<(NodeId, Span)> {
        match self.req(p) {
            (Value::Tensor(t), s) => Ok((*t, *s)),
            _ => Err(self.wrong(p, "a tensor")),
        }
    }

    fn int(&self, p: &str) -> R<i64> {
        match self.req(p) {
            (Value::Int(v), _) => Ok(*v),
            _ => Err(self.wrong(p, "an int")),
        }
    }

    fn number(&self, p: &str) -> R<f64> {
        self.req(p)
            .0
            .as_f64()
            .ok_or_else(|| self.wrong(p, "a number"))
    }

    fn dim(&self, p: &str) -> R<Dim> {
        self.req(p)
            .0
            .as_dim()
            .ok_or_else(|| self.wrong(p, "an int or a dim"))
    }

    /// A size argument ([`Args::dim`]) that is at least `min` where it is a constant: a
    /// negative length would give a shape no tensor has, found only when it runs.
    fn size(&self, p: &str, min: i64) -> R<Dim> {
        let d = self.dim(p)?;
        match d.as_const() {
            Some(n) if n < min => {
                let (_, s) = self.req(p);
                Err(Diag::new(
                    "kiln::shape",
                    format!(
                        "argument `{p}` of `{}` is {n}, but a size must be at least {min}",
                        self.name
                    ),
                )
                .at(*s, format!("this is {n}")))
            }
            _ => Ok(d),
        }
    }

    /// An axis argument, negative counting from the end.
    fn axis(&self, p: &str, rank: usize) -> R<Option<usize>> {
        let Some((v, s)) = self.get(p) else {
            return Ok(None);
        };
        let Value::Int(a) = v else {
            return Err(self.wrong(p, "an int"));
        };
        Ok(Some(norm_axis(*a, rank, *s)?))
    }

    fn dims_list(&self, p: &str) -> R<Vec<Dim>> {
        let (v, s) = self.req(p);
        let Value::List(items) = v else {
            return Err(self.wrong(p, "a list such as [b, t, 512]"));
        };
        items
            .iter()
            .map(|i| {
                if let Some(d) = i.as_dim() {
                    nonnegative(&d, *s)?;
                }
                i.as_dim().ok_or_else(|| {
                    Diag::new(
                        "kiln::type",
                        format!("`{p}` must list ints or dims, but has {}", i.kind()),
                    )
                    .at(*s, "this list")
                })
            })
            .collect()
    }
}

fn nonnegative(d: &Dim, s: Span) -> R<()> {
    match d.as_const() {
        Some(v) if v < 0 => Err(Diag::new(
            "kiln::shape",
            format!("a dim cannot be negative, got {v}"),
        )
        .at(s, "negative")
        .help("every axis needs a size of 0 or more")),
        _ => Ok(()),
    }
}

fn norm_axis(a: i64, rank: usize, s: Span) -> R<usize> {
    let r = rank as i64;
    if a < -r || a >= r {
        return Err(Diag::new(
            "kiln::shape",
            format!("axis {a} is out of range for a tensor with {rank} axes"),
        )
        .at(s, "out of range")
        .help(format!("axes run from {} to {}", -r, r - 1)));
    }
    Ok(if a < 0 { (a + r) as usize } else { a as usize })
}

fn math(name: &str, x: f64, s: Span) -> R<f64> {
    let domain = |why: &str| {
        Err(Diag::new("kiln::arith", format!("{name}({x}): {why}")).at(s, "argument out of domain"))
    };
    Ok(match name {
        "exp" => x.exp(),
        "log" if x <= 0.0 => return domain("log needs a positive number"),
        "log" => x.ln(),
        "sqrt" if x < 0.0 => return domain("sqrt needs a non-negative number"),
        "sqrt" => x.sqrt(),
        "sin" => x.sin(),
        "cos" => x.cos(),
        "relu" => x.max(0.0),
        "recip" if x == 0.0 => return domain("division by zero"),
        "recip" => 1.0 / x,
        "neg" => -x,
        _ => unreachable!("math builtin {name}"),
    })
}

pub(crate) fn call(
    e: &mut Elab,
    frame: &mut Frame,
    name: &str,
    args: Vec<EArg>,
    span: Span,
    _callee: Span,
) -> R<Value> {
    let a = Args::bind(name, args, span)?;
    let node =
        |e: &mut Elab, op: Op, ins: &[NodeId]| e.node(frame, op, ins, span).map(Value::Tensor);
    match name {
        "exp" | "log" | "sqrt" | "sin" | "cos" | "relu" | "recip" | "neg" => {
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
                    BinaryOp::Max,
                    &va,
                    sa,
                    &vb,
                    sb,
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
        "dropout" => {
            let (x, _) = a.tensor("x")?;
            let p = a.number("p")?;
            if !(0.0..1.0).contains(&p) {
                return Err(Diag::new(
                    "kiln::range",
                    format!("dropout probability must be in [0, 1), got {p}"),
                )
                .at(a.req("p").1, "out of range")
                .help("0 disables dropout; the paper uses 0.1 (base) and 0.3 (big)"));
            }
            if e.mode != Mode::Train || p == 0.0 {
                return Ok(Value::Tensor(x));
            }
            let stream = e.next_stream;
            e.next_stream += 1;
            node(
                e,
                Op::Dropout {
                    p: Float::new(p),
                    stream,
                },
                &[x],
            )
        }
        "causal_mask" => {
            let q = a.dim("q")?;
            let k = a.dim("k")?;
            node(e, Op::CausalMask { q, k }, &[])
        }
        "padding_mask" => {
            let (i, _) = a.tensor("ids")?;
            let pad = if a.get("pad").is_some() {
                a.int("pad")?
            } else {
                0
            };
            node(e, Op::PadMask { pad }, &[i])
        }
        "arange" => {
            let len = a.size("n", 0)?;
            let start = if a.get("start").is_some() {
                a.dim("start")?
            } else {
                Dim::c(0)
            };
            node(e, Op::Arange { start, len }, &[])
        }
        "slice" => {
            let (x, _) = a.tensor("x")?;
            let axis = a.axis("axis", e.ty(x).shape.rank())?.expect("required");
            let start = a.size("start", 0)?;
            let len = a.size("len", 0)?;
            node(e, Op::Slice { axis, start, len }, &[x])
        }
        "one_hot" => {
            let (i, _) = a.tensor("ids")?;
            let depth = a.size("depth", 1)?;
            node(e, Op::OneHot { depth }, &[i])
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
        "dim" => {
            let (x, _) = a.tensor("x")?;
            let ty = e.ty(x);
            let ax = a.axis("axis", ty.shape.rank())?.expect("required");
            Ok(Value::from_dim(ty.shape.dims()[ax].clone()))
        }
        "rank" => {
            let (x, _) = a.tensor("x")?;
            Ok(Value::Int(e.ty(x).shape.rank() as i64))
        }
        "float" => Ok(Value::Float(a.number("x")?)),
        "int" => match a.req("x") {
            (Value::Int(v), _) => Ok(Value::Int(*v)),
            (Value::Float(v), s) if v.fract() == 0.0 && v.abs() < 9.0e15 => {
                let _ = s;
                Ok(Value::Int(*v as i64))
            }
            (Value::Float(v), s) => Err(Diag::new(
                "kiln::type",
                format!("int({v}): not a whole number"),
            )
            .at(*s, "has a fraction")
            .help("round it yourself, e.g. write the whole number you mean")),
            _ => Err(a.wrong("x", "a number")),
        },
        "kv_cache" => {
            let (x, _) = a.tensor("x")?;
            let ty = e.ty(x);
            let axis = a.axis("axis", ty.shape.rank())?.expect("required");
            let cname = match a.req("name") {
                (Value::Str(n), _) => n.to_string(),
                _ => return Err(a.wrong("name", "a string naming the cache, such as \"k\"")),
            };
            if e.mode != Mode::Decode {
                return Ok(Value::Tensor(x));
            }
            let full = if frame.inst.name.is_empty() {
                format!("{}{cname}", kiln_ir::ir::CACHE_PREFIX)
            } else {
                format!("{}{}.{cname}", kiln_ir::ir::CACHE_PREFIX, frame.inst.name)
            };
            e.graph.add_dim(PAST);
            let mut dims = ty.shape.0.clone();
            dims[axis] = Dim::sym(PAST);
            let past = e
                .graph
                .add_input(&full, kiln_ir::ir::TensorType::new(ty.dtype, Shape(dims)))
                .map_err(|err| {
                    Diag::new(
                        "kiln::duplicate",
                        format!("{err}; one layer instance can hold one cache per name"),
                    )
                    .at(span, "second cache of this name")
                })?;
            let all = e.node(frame, Op::Concat { axis }, &[past, x], span)?;
            e.graph
                .add_output(&full, all)
                .map_err(|err| Diag::new("kiln::duplicate", err.to_string()).at(span, ""))?;
            Ok(Value::Tensor(all))
        }
        "past_len" => {
            if e.mode == Mode::Decode {
                e.graph.add_dim(PAST);
                Ok(Value::Dim(Dim::sym(PAST)))
            } else {
                Ok(Value::Int(0))
            }
        }
        "decoding" => Ok(Value::Bool(e.mode == Mode::Decode)),
        "repeat" => {
            let n = a.int("n")?;
            if n < 0 {
                return Err(
                    Diag::new("kiln::range", format!("`repeat` needs n >= 0, got {n}"))
                        .at(a.req("n").1, "negative"),
                );
            }
            if n > MAX_REPEAT {
                return Err(Diag::new(
                    "kiln::range",
                    format!("`repeat` makes at most {MAX_REPEAT} copies, got {n}"),
                )
                .at(a.req("n").1, "too many")
                .help("the paper stacks 6 layers (base and big); check the value of n"));
            }
            match a.req("layer") {
                (Value::Partial(p), _) if p.repeat.is_none() => Ok(Value::Partial(Rc::new(Partial {
                    layer: p.layer.clone(),
                    hyper: p.hyper.clone(),
                    repeat: Some(n as usize),
                }))),
                (v, s) => Err(Diag::new(
                    "kiln::type",
                    format!("`repeat` needs a layer with its hyper-parameters bound, got {}", v.kind()),
                )
                .at(*s, format!("this is {}", v.kind()))
                .help("write `repeat(n, encoder_layer(d_model = 512, ...))`: each copy gets its own weights")),
            }
        }
        "normal" => {
            let std = a.number("std")?;
            if std.is_nan() || std < 0.0 {
                return Err(
                    Diag::new("kiln::range", format!("normal needs std >= 0, got {std}"))
                        .at(a.req("std").1, ""),
                );
            }
            Ok(Value::Init(Init::Normal {
                std: Float::new(std),
            }))
        }
        "uniform" => Ok(Value::Init(Init::Uniform {
            a: Float::new(a.number("a")?),
        })),
        "constant" => Ok(Value::Init(Init::Constant(Float::new(a.number("value")?)))),
        "xavier_uniform" | "zeros" | "ones" => {
            Ok(Value::Init(named_init(name).expect("named init")))
        }
        _ => {
            let _ = a.span;
            unreachable!("builtin `{name}` has no implementation")
        }
    }
}
