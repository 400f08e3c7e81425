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

mod math;
mod shape;
mod sources;
mod values;

/// The most copies one `repeat` makes (each copy is a layer with its own weights).
pub const MAX_REPEAT: i64 = 10_000;

/// The symbolic dim of positions already decoded (the key/value cache length).
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
    ("tanh", &["x"]),
    ("sigmoid", &["x"]),
    ("erf", &["x"]),
    ("rsqrt", &["x"]),
    ("silu", &["x"]),
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
    ("kv_cache", &["x", "axis", "name", "transposed?"]),
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
        "tanh" => x.tanh(),
        "sigmoid" => 1.0 / (1.0 + (-x).exp()),
        "erf" => libm::erf(x),
        "rsqrt" if x <= 0.0 => return domain("rsqrt needs a positive number"),
        "rsqrt" => 1.0 / x.sqrt(),
        "silu" => x / (1.0 + (-x).exp()),
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
    match name {
        "exp" | "log" | "sqrt" | "sin" | "cos" | "relu" | "recip" | "neg" | "tanh" | "sigmoid"
        | "erf" | "rsqrt" | "silu" | "max" | "min" | "sum" | "amax" | "mean" => {
            math::call(e, frame, name, &a, span)
        }
        "reshape" | "broadcast" | "permute" | "transpose" | "where" | "cast" | "gather"
        | "scatter_add" | "slice" | "concat" | "matmul" => shape::call(e, frame, name, &a, span),
        "dropout" | "causal_mask" | "padding_mask" | "arange" | "one_hot" | "kv_cache"
        | "past_len" => sources::call(e, frame, name, &a, span),
        "dim" | "rank" | "float" | "int" | "decoding" | "repeat" | "normal" | "uniform"
        | "constant" | "xavier_uniform" | "zeros" | "ones" => values::call(e, name, &a),
        _ => {
            let _ = a.span;
            unreachable!("builtin `{name}` has no implementation")
        }
    }
}
