//! Expressions: evaluation to values, field access, unary and binary operators, with
//! checked integer arithmetic and the hints of a division that does not divide.

use std::rc::Rc;

use kiln_ir::ir::{Op, UnaryOp};

use crate::builtins;
use crate::diagnostics::{did_you_mean, Diag};
use crate::source::Span;
use crate::values::Value;

use super::*;

impl<'p> Elab<'p> {
    pub(crate) fn eval(&mut self, frame: &mut Frame, e: &Expr) -> R<Value> {
        match &e.kind {
            ExprKind::Int(v) => Ok(Value::Int(*v)),
            ExprKind::Float(v) => Ok(Value::Float(*v)),
            ExprKind::Bool(v) => Ok(Value::Bool(*v)),
            ExprKind::Str(s) => Ok(Value::Str(Rc::from(s.as_str()))),
            ExprKind::None => Ok(Value::None),
            ExprKind::Var(n) => self.lookup(frame, n, e.span),
            ExprKind::List(items) => {
                let mut out = Vec::with_capacity(items.len());
                for i in items {
                    out.push(self.eval(frame, i)?);
                }
                Ok(Value::List(Rc::new(out)))
            }
            ExprKind::Unary(op, x) => {
                let v = self.eval(frame, x)?;
                self.unary(frame, *op, v, x.span, e.span)
            }
            ExprKind::Binary(op, a, b) => self.binary(frame, *op, a, b, e.span),
            ExprKind::Call { callee, args, site } => self.call(frame, callee, args, *site, e.span),
            ExprKind::Field(base, field) => self.field(frame, base, field),
            ExprKind::If {
                cond,
                then,
                otherwise,
            } => {
                let c = self.eval(frame, cond)?;
                let Value::Bool(c) = c else {
                    return Err(Diag::new(
                        "kiln::type",
                        format!("`if` needs a bool, got {}", c.kind()),
                    )
                    .at(cond.span, format!("this is {}", c.kind()))
                    .help("compare explicitly, e.g. `x != none` or `n > 0`"));
                };
                let flow = if c {
                    self.exec_block(frame, then)?
                } else {
                    match otherwise.as_deref() {
                        None => Flow {
                            value: None,
                            returned: false,
                        },
                        Some(Else::Block(b)) => self.exec_block(frame, b)?,
                        Some(Else::If(ei)) => Flow {
                            value: Some(self.eval(frame, ei)?),
                            returned: false,
                        },
                    }
                };
                Ok(flow.value.unwrap_or(Value::None))
            }
        }
    }

    pub(super) fn field(&mut self, frame: &mut Frame, base: &Expr, field: &Ident) -> R<Value> {
        if let ExprKind::Var(n) = &base.kind {
            if n == "prim" && !frame.vars.contains_key("prim") {
                if builtins::is_builtin(&field.name) {
                    return Ok(Value::Layer(Rc::from(
                        format!("prim.{}", field.name).as_str(),
                    )));
                }
                return Err(Diag::new(
                    "kiln::unknown-name",
                    format!("unknown primitive `prim.{}`", field.name),
                )
                .at(field.span, "no such primitive")
                .help_opt(did_you_mean(&field.name, builtins::names())));
            }
        }
        let v = self.eval(frame, base)?;
        let Value::Instance(inst) = v else {
            return Err(Diag::new(
                "kiln::type",
                format!(
                    "`.{}` needs a layer instance, but this is {}",
                    field.name,
                    v.kind()
                ),
            )
            .at(base.span, format!("this is {}", v.kind()))
            .help("fields name the parameters and sub-layers of an instance, as in `emb.weight`"));
        };
        let state = inst.state.borrow();
        if let Some(id) = state.params.get(&field.name) {
            return Ok(Value::Tensor(*id));
        }
        if let Some(c) = state.children.get(&field.name) {
            return Ok(Value::Instance(c.clone()));
        }
        if let Some(h) = inst.hyper(&field.name) {
            return Ok(h);
        }
        if inst.deferred.contains(&field.name) {
            return Err(Diag::new(
                "kiln::unknown-field",
                format!(
                    "`{}` of `{}` is not known yet: it comes from the shape of the instance's input",
                    field.name,
                    inst.display_name()
                ),
            )
            .at(field.span, "read before the instance is first applied")
            .help(format!(
                "apply `{}` first, or give `{}` where the instance is made",
                inst.display_name(),
                field.name
            )));
        }
        let mut cands: Vec<&str> = state.params.keys().map(|s| s.as_str()).collect();
        cands.extend(state.children.keys().map(|s| s.as_str()));
        cands.extend(inst.hyper.iter().map(|(n, _)| n.as_str()));
        let mut d = Diag::new(
            "kiln::unknown-field",
            format!(
                "`{}` (an instance of `{}`) has no field `{}`",
                inst.display_name(),
                inst.kind,
                field.name
            ),
        )
        .at(field.span, "unknown field");
        d = match did_you_mean(&field.name, cands.iter().copied()) {
            Some(h) => d.help(h),
            None if !state.applied => d.help(format!(
                "the parameters of `{}` are created when it is first applied; apply it before using its weights",
                inst.display_name()
            )),
            None => d.help(format!("its fields are: {}", cands.join(", "))),
        };
        Err(d)
    }

    pub(super) fn unary(
        &mut self,
        frame: &mut Frame,
        op: UnOp,
        v: Value,
        vspan: Span,
        span: Span,
    ) -> R<Value> {
        match (op, v) {
            (UnOp::Neg, Value::Int(x)) => x.checked_neg().map(Value::Int).ok_or_else(|| {
                Diag::new("kiln::overflow", format!("`-({x})` overflows")).at(span, "")
            }),
            (UnOp::Neg, Value::Float(x)) => Ok(Value::Float(-x)),
            (UnOp::Neg, Value::Dim(d)) => d.checked_neg().map(Value::from_dim).ok_or_else(|| {
                Diag::new("kiln::overflow", format!("`-({d})` overflows")).at(span, "")
            }),
            (UnOp::Neg, Value::Tensor(t)) => Ok(Value::Tensor(self.node(
                frame,
                Op::Unary(UnaryOp::Neg),
                &[t],
                span,
            )?)),
            (UnOp::Not, Value::Bool(b)) => Ok(Value::Bool(!b)),
            (op, v) => Err(Diag::new(
                "kiln::type",
                format!(
                    "cannot apply `{}` to {}",
                    if op == UnOp::Neg { "-" } else { "not" },
                    v.kind()
                ),
            )
            .at(vspan, format!("this is {}", v.kind()))),
        }
    }

    pub(super) fn binary(
        &mut self,
        frame: &mut Frame,
        op: BinOp,
        a: &Expr,
        b: &Expr,
        span: Span,
    ) -> R<Value> {
        // Short-circuit logic first.
        if matches!(op, BinOp::And | BinOp::Or) {
            let va = self.eval(frame, a)?;
            let Value::Bool(x) = va else {
                return Err(Diag::new(
                    "kiln::type",
                    format!("`{}` needs bools, got {}", op.symbol(), va.kind()),
                )
                .at(a.span, format!("this is {}", va.kind())));
            };
            if (op == BinOp::And && !x) || (op == BinOp::Or && x) {
                return Ok(Value::Bool(x));
            }
            let vb = self.eval(frame, b)?;
            return match vb {
                Value::Bool(y) => Ok(Value::Bool(y)),
                other => Err(Diag::new(
                    "kiln::type",
                    format!("`{}` needs bools, got {}", op.symbol(), other.kind()),
                )
                .at(b.span, format!("this is {}", other.kind()))),
            };
        }
        let va = self.eval(frame, a)?;
        let vb = self.eval(frame, b)?;
        self.binary_values(frame, op, va, a, vb, b, span)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn binary_values(
        &mut self,
        frame: &mut Frame,
        op: BinOp,
        va: Value,
        a: &Expr,
        vb: Value,
        b: &Expr,
        span: Span,
    ) -> R<Value> {
        use Value::*;
        const EQ: BinOp = BinOp::Cmp(CmpOp::Eq);
        let equality = matches!(op, BinOp::Cmp(c) if c.is_equality());
        let text = |e: &Expr| self.prog.sources.text(e.span).to_string();
        match (&va, &vb) {
            (Tensor(_), _) | (_, Tensor(_)) => {
                self.tensor_binary(frame, op, va, a.span, vb, b.span, span)
            }
            (None, _) | (_, None) if equality => {
                let same = matches!((&va, &vb), (None, None));
                Ok(Bool(same == (op == EQ)))
            }
            (Int(x), Int(y)) => int_op(op, *x, *y, &text(a), &text(b), b.span, span),
            (Int(_) | Float(_), Int(_) | Float(_)) => float_op(
                op,
                va.as_f64().unwrap_or(0.0),
                vb.as_f64().unwrap_or(0.0),
                &text(b),
                b.span,
                span,
            ),
            (Int(_) | Dim(_), Int(_) | Dim(_)) => {
                let (x, y) = (
                    va.as_dim().unwrap_or_default(),
                    vb.as_dim().unwrap_or_default(),
                );
                let overflow = || {
                    Diag::new(
                        "kiln::overflow",
                        format!("`{x} {} {y}` overflows", op.symbol()),
                    )
                    .at(span, "")
                };
                let dim = |d: Option<kiln_ir::Dim>| d.map(Value::from_dim).ok_or_else(overflow);
                match op {
                    BinOp::Add => dim(x.checked_add(&y)),
                    BinOp::Sub => dim(x.checked_sub(&y)),
                    BinOp::Mul => dim(x.checked_mul(&y)),
                    BinOp::Cmp(c) if c.is_equality() => Ok(Bool(c.holds(&x, &y))),
                    _ => Err(Diag::new(
                        "kiln::type",
                        format!("`{}` is not defined on symbolic dims (`{x}` {} `{y}`)", op.symbol(), op.symbol()),
                    )
                    .at(span, "symbolic dims can be added, subtracted, multiplied and compared for equality")),
                }
            }
            (Bool(x), Bool(y)) if equality => Ok(Bool((x == y) == (op == EQ))),
            (Str(x), Str(y)) if equality => Ok(Bool((x == y) == (op == EQ))),
            (Str(x), Str(y)) if op == BinOp::Add => Ok(Str(Rc::from(format!("{x}{y}").as_str()))),
            _ => Err(Diag::new(
                "kiln::type",
                format!(
                    "cannot apply `{}` to {} and {}",
                    op.symbol(),
                    va.kind(),
                    vb.kind()
                ),
            )
            .at(span, "")
            .label(a.span, format!("this is {}", va.kind()))
            .label(b.span, format!("this is {}", vb.kind()))),
        }
    }
}

pub(super) fn int_op(
    op: BinOp,
    x: i64,
    y: i64,
    ta: &str,
    tb: &str,
    sb: Span,
    span: Span,
) -> R<Value> {
    let overflow = || {
        Diag::new(
            "kiln::overflow",
            format!("`{ta} {} {tb}` overflows", op.symbol()),
        )
        .at(span, "")
    };
    Ok(match op {
        BinOp::Add => Value::Int(x.checked_add(y).ok_or_else(overflow)?),
        BinOp::Sub => Value::Int(x.checked_sub(y).ok_or_else(overflow)?),
        BinOp::Mul => Value::Int(x.checked_mul(y).ok_or_else(overflow)?),
        BinOp::Div => {
            if y == 0 {
                return Err(
                    Diag::new("kiln::arith", format!("division by zero: `{tb}` is 0"))
                        .at(sb, "this is 0"),
                );
            }
            let rem = x.checked_rem(y).ok_or_else(overflow)?;
            if rem != 0 {
                let near: Vec<String> = divisors_near(x, y).iter().map(|d| d.to_string()).collect();
                let shown = |t: &str, v: i64| {
                    if t == v.to_string() {
                        format!("`{t}`")
                    } else {
                        format!("`{t}` ({v})")
                    }
                };
                return Err(Diag::new(
                    "kiln::divisibility",
                    format!("{} is not divisible by {}", shown(ta, x), shown(tb, y)),
                )
                .at(span, format!("{x} / {y} leaves a remainder of {rem}"))
                .help(if near.is_empty() {
                    format!("`{tb}` must divide `{ta}`; for a fraction write `{ta} * 1.0 / {tb}`")
                } else {
                    format!(
                        "`{tb}` must divide `{ta}`: divisors of {x} near {y} are {}",
                        near.join(" and ")
                    )
                }));
            }
            Value::Int(x.checked_div(y).ok_or_else(overflow)?)
        }
        BinOp::Rem => {
            if y == 0 {
                return Err(
                    Diag::new("kiln::arith", format!("remainder by zero: `{tb}` is 0"))
                        .at(sb, "this is 0"),
                );
            }
            Value::Int(x.checked_rem_euclid(y).ok_or_else(overflow)?)
        }
        BinOp::Pow => {
            if y >= 0 {
                let e = u32::try_from(y).map_err(|_| overflow())?;
                Value::Int(x.checked_pow(e).ok_or_else(overflow)?)
            } else {
                Value::Float((x as f64).powf(y as f64))
            }
        }
        BinOp::Cmp(c) => Value::Bool(c.holds(&x, &y)),
        BinOp::MatMul => return Err(matmul_of_numbers(span)),
        BinOp::And | BinOp::Or => unreachable!("handled before"),
    })
}

/// The error for `@` between two numbers at `span`.
fn matmul_of_numbers(span: Span) -> Diag {
    Diag::new("kiln::type", "`@` multiplies tensors, not numbers")
        .at(span, "")
        .help("use `*` for numbers")
}

/// Divisors of `x` closest to `y` (one below, one above), found by trial division up to
/// `√x`, so at most 2²⁰ steps (`x` up to 2⁴⁰; none suggested beyond).
pub(super) fn divisors_near(x: i64, y: i64) -> Vec<i64> {
    if x <= 0 || y <= 0 || x > 1 << 40 {
        return vec![];
    }
    let (mut below, mut above) = (None::<i64>, None::<i64>);
    let mut d = 1;
    while d * d <= x {
        if x % d == 0 {
            for q in [d, x / d] {
                if q < y && below.is_none_or(|b| q > b) {
                    below = Some(q);
                }
                if q > y && above.is_none_or(|a| q < a) {
                    above = Some(q);
                }
            }
        }
        d += 1;
    }
    below.into_iter().chain(above).collect()
}

pub(super) fn float_op(op: BinOp, x: f64, y: f64, tb: &str, sb: Span, span: Span) -> R<Value> {
    let v = match op {
        BinOp::Add => x + y,
        BinOp::Sub => x - y,
        BinOp::Mul => x * y,
        BinOp::Div | BinOp::Rem if y == 0.0 => {
            return Err(
                Diag::new("kiln::arith", format!("division by zero: `{tb}` is 0"))
                    .at(sb, "this is 0"),
            )
        }
        BinOp::Div => x / y,
        BinOp::Rem => x.rem_euclid(y),
        BinOp::Pow => x.powf(y),
        BinOp::Cmp(c) => return Ok(Value::Bool(c.holds(&x, &y))),
        BinOp::MatMul => return Err(matmul_of_numbers(span)),
        BinOp::And | BinOp::Or => unreachable!("handled before"),
    };
    if !v.is_finite() {
        return Err(
            Diag::new("kiln::arith", format!("`{}` is not a finite number", v))
                .at(span, "result is not finite"),
        );
    }
    Ok(Value::Float(v))
}
