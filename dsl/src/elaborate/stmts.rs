//! The statements of a model's body: dims, inputs, outputs, stages, parameters and checks.

use kiln_ir::ir::{DType, Init, TensorType};
use kiln_ir::shape::{Dim, Shape};

use crate::diagnostics::{did_you_mean, Diag};
use crate::source::Span;
use crate::values::Value;

use super::*;

impl<'p> Elab<'p> {
    pub(super) fn stmt_dims(&mut self, frame: &mut Frame, names: &[Ident], span: Span) -> R<()> {
        if !frame.is_model {
            return Err(
                Diag::new("kiln::dims", "`dims` belongs in a model, not in a layer")
                    .at(span, "declared in a layer")
                    .help("layers get their dims from their arguments' shapes: `(x: [b, t, d])`"),
            );
        }
        for n in names {
            if self.graph.dims.contains(&n.name) || frame.vars.contains_key(&n.name) {
                return Err(Diag::new(
                    "kiln::duplicate",
                    format!("`{}` is already defined", n.name),
                )
                .at(n.span, "declared again")
                .help("each dim and parameter needs its own name"));
            }
            self.graph.add_dim(&n.name);
            frame
                .vars
                .insert(n.name.clone(), Value::Dim(Dim::sym(&n.name)));
        }
        Ok(())
    }

    pub(super) fn stmt_input(
        &mut self,
        frame: &mut Frame,
        name: &Ident,
        ty: &TensorTypeExpr,
        span: Span,
    ) -> R<()> {
        if !frame.is_model {
            return Err(
                Diag::new("kiln::input", "`input` belongs in a model, not in a layer")
                    .at(span, "declared in a layer")
                    .help(
                        "a layer takes tensors as arguments: `layer f(...)(x: f32[b, d]) { ... }`",
                    ),
            );
        }
        let Some(dt) = &ty.dtype else {
            return Err(Diag::new(
                "kiln::type",
                format!("input `{}` needs an element type", name.name),
            )
            .at(ty.span, "no element type")
            .help("write it before the shape: `i32[batch, src_len]` or `f32[batch, d]`"));
        };
        let dtype = parse_dtype(dt)?;
        let dims = self.fixed_dims(frame, ty, true)?;
        if frame.vars.contains_key(&name.name) {
            return Err(Diag::new(
                "kiln::duplicate",
                format!("`{}` is already defined", name.name),
            )
            .at(name.span, "defined again")
            .help("inputs need names of their own"));
        }
        let id = self
            .graph
            .add_input(&name.name, TensorType::new(dtype, Shape(dims)))
            .map_err(|e| Diag::new("kiln::duplicate", e.to_string()).at(name.span, ""))?;
        frame.vars.insert(name.name.clone(), Value::Tensor(id));
        Ok(())
    }

    /// The dims of an input type (`symbolic_ok`) or a parameter type: no `...` patterns.
    pub(super) fn fixed_dims(
        &mut self,
        frame: &mut Frame,
        ty: &TensorTypeExpr,
        symbolic_ok: bool,
    ) -> R<Vec<Dim>> {
        let mut dims = Vec::new();
        for item in &ty.dims {
            match item {
                ShapeItem::Ellipsis(s) => {
                    return Err(Diag::new(
                        "kiln::type",
                        "`...` is only allowed in layer argument patterns",
                    )
                    .at(*s, "not allowed here")
                    .help("list every axis: inputs and parameters have fixed ranks"))
                }
                ShapeItem::Expr(e) => dims.push(self.dim_item(frame, e, symbolic_ok)?),
            }
        }
        Ok(dims)
    }

    /// A dim in an input or parameter type: a declared dim (inputs only) or a positive int.
    pub(super) fn dim_item(&mut self, frame: &mut Frame, e: &Expr, symbolic_ok: bool) -> R<Dim> {
        if let ExprKind::Var(n) = &e.kind {
            if !frame.vars.contains_key(n) {
                let mut cands: Vec<&str> = self.graph.dims.iter().map(|s| s.as_str()).collect();
                let ints: Vec<String> = frame
                    .vars
                    .iter()
                    .filter(|(_, v)| matches!(v, Value::Int(_)))
                    .map(|(k, _)| k.clone())
                    .collect();
                cands.extend(ints.iter().map(|s| s.as_str()));
                let help = did_you_mean(n, cands).unwrap_or_else(|| {
                    if frame.is_model {
                        format!("declare it first: `dims {n}`")
                    } else {
                        "use a layer parameter or a dim bound by an argument pattern".to_string()
                    }
                });
                return Err(Diag::new("kiln::unknown-dim", format!("unknown dim `{n}`"))
                    .at(e.span, "not a declared dim")
                    .help(help));
            }
        }
        let v = self.eval(frame, e)?;
        match v {
            Value::Int(n) if n > 0 => Ok(Dim::c(n)),
            Value::Int(n) => Err(Diag::new(
                "kiln::type",
                format!("a dim must be positive, got {n}"),
            )
            .at(e.span, format!("this is {n}"))),
            Value::Dim(d) if symbolic_ok && d.as_sym().is_some() => Ok(d),
            Value::Dim(d) if symbolic_ok => Err(Diag::new(
                "kiln::type",
                format!("input dims must be declared dims or numbers, not `{d}`"),
            )
            .at(e.span, "composite dim")
            .help("declare a new dim for this axis")),
            Value::Dim(d) => Err(Diag::new(
                "kiln::type",
                format!("parameter shapes must be numbers, but `{d}` is a symbolic dim"),
            )
            .at(e.span, "symbolic")
            .help("parameters have fixed sizes; use layer parameters such as `d_model`")),
            other => Err(Diag::new(
                "kiln::type",
                format!("a dim must be an int, got {}", other.kind()),
            )
            .at(e.span, format!("this is {}", other.kind()))),
        }
    }

    pub(super) fn stmt_output(
        &mut self,
        frame: &mut Frame,
        name: &Ident,
        e: Option<&Expr>,
        objective: bool,
        span: Span,
    ) -> R<()> {
        let what = if objective { "objective" } else { "output" };
        if !frame.is_model {
            return Err(Diag::new(
                "kiln::output",
                format!("`{what}` belongs in a model, not in a layer"),
            )
            .at(span, "declared in a layer")
            .help("a layer returns its last expression"));
        }
        let (v, vspan) = match e {
            Some(e) => (self.eval(frame, e)?, e.span),
            None => (self.lookup(frame, &name.name, name.span)?, name.span),
        };
        let Value::Tensor(id) = v else {
            return Err(Diag::new(
                "kiln::type",
                format!("{what} `{}` must be a tensor, got {}", name.name, v.kind()),
            )
            .at(vspan, format!("this is {}", v.kind())));
        };
        if objective {
            let ty = self.graph.ty(id).clone();
            if ty.shape.rank() != 0 || !ty.dtype.is_float() {
                return Err(Diag::new(
                    "kiln::type",
                    format!("the objective must be a float scalar, got {ty}"),
                )
                .at(vspan, format!("this is {ty}"))
                .help(
                    "reduce it to one number, e.g. with `label_smoothed_xent(...)` or `sum(...)`",
                ));
            }
            if let Some(prev) = &self.graph.objective {
                return Err(Diag::new(
                    "kiln::duplicate",
                    format!("a second objective `{}` (the first is `{prev}`)", name.name),
                )
                .at(span, "second objective")
                .help("a model trains on one objective"));
            }
        }
        self.graph.add_output(&name.name, id).map_err(|e| {
            Diag::new("kiln::duplicate", e.to_string()).at(name.span, "declared again")
        })?;
        if objective {
            self.graph.objective = Some(name.name.clone());
        }
        frame.vars.insert(name.name.clone(), Value::Tensor(id));
        Ok(())
    }

    /// `stage memory = expr`: an output that ends the `encode` entry point; in `Decode`
    /// mode the value is an input of the same type instead.
    pub(super) fn stmt_stage(
        &mut self,
        frame: &mut Frame,
        name: &Ident,
        e: &Expr,
        span: Span,
    ) -> R<()> {
        if !frame.is_model {
            return Err(
                Diag::new("kiln::stage", "`stage` belongs in a model, not in a layer")
                    .at(span, "declared in a layer")
                    .help("mark the boundary between encoder and decoder in the model body"),
            );
        }
        let v = self.eval(frame, e)?;
        let Value::Tensor(id) = v else {
            return Err(Diag::new(
                "kiln::type",
                format!("stage `{}` must be a tensor, got {}", name.name, v.kind()),
            )
            .at(e.span, format!("this is {}", v.kind())));
        };
        if frame.vars.contains_key(&name.name) || self.graph.input(&name.name).is_some() {
            return Err(Diag::new(
                "kiln::duplicate",
                format!("`{}` is already defined", name.name),
            )
            .at(name.span, "defined again")
            .help("a stage needs a name of its own"));
        }
        let bound = if self.mode == Mode::Decode {
            let ty = self.graph.ty(id).clone();
            if let Some(bad) = ty
                .shape
                .dims()
                .iter()
                .find(|d| !d.is_const() && d.as_sym().is_none())
            {
                return Err(Diag::new(
                    "kiln::stage",
                    format!(
                        "stage `{}` has the composite dim `{bad}`; stages become decoder inputs",
                        name.name
                    ),
                )
                .at(e.span, format!("this is {ty}"))
                .help("give the stage a shape of declared dims and numbers"));
            }
            self.graph
                .add_input(&name.name, ty)
                .map_err(|err| Diag::new("kiln::duplicate", err.to_string()).at(name.span, ""))?
        } else {
            self.graph.add_output(&name.name, id).map_err(|err| {
                Diag::new("kiln::duplicate", err.to_string()).at(name.span, "declared again")
            })?;
            self.graph.stages.push(name.name.clone());
            id
        };
        frame.vars.insert(name.name.clone(), Value::Tensor(bound));
        Ok(())
    }

    pub(super) fn stmt_param(
        &mut self,
        frame: &mut Frame,
        name: &Ident,
        ty: &TensorTypeExpr,
        init: Option<&Expr>,
    ) -> R<()> {
        if !frame.declared_params.insert(name.name.clone()) {
            return Err(Diag::new(
                "kiln::duplicate",
                format!("parameter `{}` is declared twice", name.name),
            )
            .at(name.span, "declared again")
            .help("give each parameter its own name"));
        }
        let dtype = match &ty.dtype {
            Some(d) => parse_dtype(d)?,
            None => DType::F32,
        };
        let dims = self.fixed_dims(frame, ty, false)?;
        let tt = TensorType::new(dtype, Shape(dims));
        let init = match init {
            None => {
                if tt.shape.rank() >= 2 {
                    Init::XavierUniform
                } else {
                    Init::Zeros
                }
            }
            Some(e) => match self.eval(frame, e)? {
                Value::Init(i) => i,
                Value::Int(v) => Init::Constant(kiln_ir::ir::Float::new(v as f64)),
                Value::Float(v) => Init::Constant(kiln_ir::ir::Float::new(v)),
                other => {
                    return Err(Diag::new("kiln::type", format!("`init` needs an initializer, got {}", other.kind()))
                        .at(e.span, "not an initializer")
                        .help("use xavier_uniform, normal(std = 0.02), uniform(a = 0.1), zeros, ones or a number"))
                }
            },
        };
        if init == Init::XavierUniform && tt.shape.rank() < 2 {
            return Err(Diag::new(
                "kiln::init",
                format!(
                    "xavier_uniform needs a matrix, but `{}` is {}",
                    name.name, tt
                ),
            )
            .at(name.span, "not a matrix")
            .help("use zeros, ones or normal(std = ...) for vectors"));
        }
        let existing = frame.inst.state.borrow().params.get(&name.name).copied();
        let id = match existing {
            Some(id) => id,
            None => {
                let full = frame.inst.child_name(&name.name);
                let id = self
                    .graph
                    .add_param(&full, tt, init, &frame.inst.name)
                    .map_err(|e| match e {
                        kiln_ir::IrError::Duplicate { .. } => Diag::new(
                            "kiln::duplicate",
                            format!("two parameters are named `{full}`"),
                        )
                        .at(name.span, "this parameter")
                        .help("two instances share a name; bind one of them to another name"),
                        other => Diag::new("kiln::type", other.to_string()).at(name.span, ""),
                    })?;
                frame
                    .inst
                    .state
                    .borrow_mut()
                    .params
                    .insert(name.name.clone(), id);
                id
            }
        };
        frame.vars.insert(name.name.clone(), Value::Tensor(id));
        Ok(())
    }

    pub(super) fn stmt_check(
        &mut self,
        frame: &mut Frame,
        cond: &Expr,
        message: Option<&str>,
    ) -> R<()> {
        let v = self.eval(frame, cond)?;
        match v {
            Value::Bool(true) => Ok(()),
            Value::Bool(false) => {
                let mut detail = String::new();
                let mut notes: Vec<String> = Vec::new();
                cond.walk(&mut |e| {
                    if let ExprKind::Var(n) = &e.kind {
                        if let Some(v) = frame.vars.get(n) {
                            if matches!(
                                v,
                                Value::Int(_) | Value::Float(_) | Value::Bool(_) | Value::Dim(_)
                            ) {
                                let s = format!("{n} = {v}");
                                if !notes.contains(&s) {
                                    notes.push(s);
                                }
                            }
                        }
                    }
                });
                if !notes.is_empty() {
                    detail = format!(" ({})", notes.join(", "));
                }
                let msg = message.unwrap_or("check failed");
                Err(Diag::new("kiln::check", msg.to_string())
                    .at(cond.span, format!("this is false{detail}")))
            }
            other => Err(Diag::new(
                "kiln::type",
                format!("`check` needs a bool, got {}", other.kind()),
            )
            .at(cond.span, format!("this is {}", other.kind()))),
        }
    }
}
