//! Calls: builtins, layers and their hyperparameters, instances applied to their inputs,
//! and the patterns a layer's body matches.

use std::collections::HashMap;
use std::rc::Rc;

use kiln_ir::ir::NodeId;

use crate::builtins;
use crate::diagnostics::{did_you_mean, Diag};
use crate::source::Span;
use crate::values::{Instance, Partial, Value};

use super::inferred::{self, uses_any};

/// Bound hyper-parameters `(name, value)`, and the names deferred to the first application.
type BoundHyper = (Vec<(String, Value)>, Vec<String>);
use super::*;

impl<'p> Elab<'p> {
    pub(super) fn call(
        &mut self,
        frame: &mut Frame,
        callee: &Expr,
        args: &[Arg],
        site: u32,
        span: Span,
    ) -> R<Value> {
        enum Target {
            Layer(Rc<LayerDef>),
            Builtin(String),
            Partial(Rc<Partial>),
            Instance(Rc<Instance>),
        }
        let by_name = |me: &Self, name: &str| -> Option<Target> {
            if let Some(prim) = name.strip_prefix("prim.") {
                Some(Target::Builtin(prim.to_string()))
            } else if let Some(d) = me.prog.layers.get(name) {
                Some(Target::Layer(d.clone()))
            } else if builtins::is_builtin(name) {
                Some(Target::Builtin(name.to_string()))
            } else {
                None
            }
        };
        let target = match &callee.kind {
            ExprKind::Var(name) if !frame.vars.contains_key(name) => match by_name(self, name) {
                Some(t) => t,
                None => {
                    let mut cands: Vec<String> = self.prog.layers.keys().cloned().collect();
                    cands.extend(builtins::names().map(String::from));
                    cands.extend(
                        frame
                            .vars
                            .iter()
                            .filter(|(_, v)| {
                                matches!(
                                    v,
                                    Value::Instance(_) | Value::Partial(_) | Value::Layer(_)
                                )
                            })
                            .map(|(k, _)| k.clone()),
                    );
                    let is_model = self.prog.models.contains_key(name);
                    let mut d = Diag::new(
                        "kiln::unknown-layer",
                        format!("unknown layer or function `{name}`"),
                    )
                    .at(callee.span, "not defined");
                    d = if is_model {
                        d.help(format!("`{name}` is a model; models are not callable (use `model x = {name}(...)` to derive one)"))
                    } else {
                        d.help_opt(did_you_mean(name, cands.iter().map(|s| s.as_str())))
                    };
                    return Err(d);
                }
            },
            _ => match self.eval(frame, callee)? {
                Value::Layer(n) => by_name(self, &n).expect("layer values name layers or builtins"),
                Value::Partial(p) => Target::Partial(p),
                Value::Instance(i) => Target::Instance(i),
                other => {
                    return Err(Diag::new(
                        "kiln::type",
                        format!(
                            "`{}` is {}, which cannot be called",
                            self.prog.sources.text(callee.span),
                            other.kind()
                        ),
                    )
                    .at(callee.span, format!("this is {}", other.kind())))
                }
            },
        };
        // Evaluate the arguments in order.
        let mut eargs: Vec<EArg> = Vec::with_capacity(args.len());
        let mut seen_named: Option<Span> = None;
        for a in args {
            match &a.name {
                None => {
                    if let Some(ns) = seen_named {
                        return Err(Diag::new(
                            "kiln::argument",
                            "positional argument after a named one",
                        )
                        .at(a.span, "positional")
                        .label(ns, "named argument before it")
                        .help("put tensor arguments first, then named ones: `f(x, h = 8)`"));
                    }
                }
                Some(n) => {
                    seen_named = Some(a.span);
                    let twice = eargs
                        .iter()
                        .find(|p| p.name.as_ref().map(|m| &m.name) == Some(&n.name));
                    if let Some(prev) = twice {
                        return Err(Diag::new(
                            "kiln::argument",
                            format!("argument `{}` is given twice", n.name),
                        )
                        .at(a.span, "second time")
                        .label(prev.span, "first time")
                        .help("remove one of them"));
                    }
                }
            }
            let value = self.eval(frame, &a.value)?;
            eargs.push(EArg {
                name: a.name.clone(),
                value,
                span: a.span,
            });
        }
        match target {
            Target::Builtin(name) => builtins::call(self, frame, &name, eargs, span, callee.span),
            Target::Layer(def) => self.call_layer(frame, &def, eargs, site, span, callee.span),
            Target::Partial(p) => {
                let inst = self.anon_instance(frame, site, &p);
                self.apply(&inst, eargs, span)
            }
            Target::Instance(inst) => {
                if let Some(a) = eargs.iter().find(|a| {
                    a.name.as_ref().is_some_and(|n| {
                        inst.layer
                            .as_ref()
                            .is_some_and(|l| l.params.iter().any(|p| p.name.name == n.name))
                    })
                }) {
                    let n = &a.name.as_ref().expect("named").name;
                    return Err(Diag::new(
                        "kiln::argument",
                        format!("`{n}` is fixed when `{}` is created and cannot be passed when applying it", inst.display_name()),
                    )
                    .at(a.span, "hyper-parameter in an application")
                    .help(format!("pass it where the instance is made: `{} = {}({n} = ...)`", inst.display_name(), inst.kind)));
                }
                self.apply(&inst, eargs, span)
            }
        }
    }

    pub(super) fn call_layer(
        &mut self,
        frame: &mut Frame,
        def: &Rc<LayerDef>,
        args: Vec<EArg>,
        site: u32,
        span: Span,
        callee_span: Span,
    ) -> R<Value> {
        let mut hyper = Vec::new();
        let mut tensors = Vec::new();
        for a in args {
            match &a.name {
                Some(n) if def.params.iter().any(|p| p.name.name == n.name) => hyper.push(a),
                Some(n) if def.tensor_params.iter().any(|p| p.name.name == n.name) => {
                    tensors.push(a)
                }
                Some(n) => {
                    return Err(unknown_param(
                        &def.name.name,
                        n,
                        def.params
                            .iter()
                            .map(|p| p.name.name.as_str())
                            .chain(def.tensor_params.iter().map(|p| p.name.name.as_str())),
                    )
                    .note(
                        Some(def.name.span),
                        format!("`{}` is defined here", def.name.name),
                    ))
                }
                None => tensors.push(a),
            }
        }
        let bound = {
            let mut tmp = Frame::new(frame.inst.clone(), false, frame.anon.clone());
            self.stack.push((def.name.name.clone(), span));
            let r = self.bind_hyper(
                &def.name.name,
                &def.params,
                &def.tensor_params,
                hyper,
                callee_span,
                &mut tmp,
            );
            self.stack.pop();
            r.map_err(|mut d| {
                if d.stack.is_empty() {
                    d.stack = self.stack.clone();
                    d.stack.push((def.name.name.clone(), span));
                }
                d
            })?
        };
        let (hyper, deferred) = bound;
        let p = Rc::new(Partial {
            layer: def.clone(),
            hyper,
            deferred,
            repeat: None,
        });
        if tensors.is_empty() && !def.tensor_params.is_empty() {
            return Ok(Value::Partial(p));
        }
        let inst = self.anon_instance(frame, site, &p);
        self.apply(&inst, tensors, span)
    }

    /// The instance a call site makes inside `frame`'s instance (made once, then reused).
    pub(super) fn anon_instance(
        &mut self,
        frame: &mut Frame,
        site: u32,
        p: &Rc<Partial>,
    ) -> Rc<Instance> {
        if let Some(i) = frame.inst.state.borrow().anon.get(&site) {
            return i.clone();
        }
        let name = frame
            .anon
            .get(&site)
            .cloned()
            .unwrap_or_else(|| p.layer.name.name.clone());
        let inst = self.instantiate(&frame.inst.child_name(&name), p);
        frame
            .inst
            .state
            .borrow_mut()
            .anon
            .insert(site, inst.clone());
        inst
    }

    /// Binds hyper-parameters: given values (type-checked), then defaults in order. A
    /// layer's hyper-parameter that is not given, has no default and is named by one of
    /// `tensors`' patterns is deferred to the first application, as is one whose default
    /// uses a deferred one ([`Instance::deferred`]); the deferred names come second.
    pub(crate) fn bind_hyper(
        &mut self,
        owner: &str,
        params: &[HyperParam],
        tensors: &[TensorParam],
        given: Vec<EArg>,
        call_span: Span,
        frame: &mut Frame,
    ) -> R<BoundHyper> {
        let mut out: Vec<(String, Value)> = Vec::new();
        let mut deferred: Vec<String> = Vec::new();
        let mut given = given;
        for p in params {
            let pos = given
                .iter()
                .position(|g| g.name.as_ref().map(|n| &n.name) == Some(&p.name.name));
            let v = match pos {
                Some(i) => {
                    let g = given.remove(i);
                    check_type(p, g.value, g.span)?
                }
                None => match &p.default {
                    Some(d) if uses_any(d, &deferred) => {
                        deferred.push(p.name.name.clone());
                        continue;
                    }
                    Some(d) => {
                        for (k, v) in &out {
                            frame.vars.insert(k.clone(), v.clone());
                        }
                        let v = self.eval(frame, d)?;
                        check_type(p, v, d.span)?
                    }
                    None if inferred::named_by_pattern(tensors, &p.name.name) => {
                        deferred.push(p.name.name.clone());
                        continue;
                    }
                    None => {
                        return Err(Diag::new(
                            "kiln::argument",
                            format!("missing argument `{}` of `{owner}`", p.name.name),
                        )
                        .at(call_span, format!("`{}` is not given", p.name.name))
                        .note(
                            Some(p.name.span),
                            format!("`{}` is declared here without a default", p.name.name),
                        )
                        .help(format!(
                            "pass it by name: `{owner}(..., {} = ...)`",
                            p.name.name
                        )))
                    }
                },
            };
            out.push((p.name.name.clone(), v));
        }
        Ok((out, deferred))
    }

    /// Applies an instance to tensor arguments: binds them, checks their shapes against
    /// the patterns, and runs the layer body in a fresh scope.
    pub(crate) fn apply(&mut self, inst: &Rc<Instance>, args: Vec<EArg>, span: Span) -> R<Value> {
        inst.state.borrow_mut().applied = true;
        if let Some(stack) = &inst.stack {
            // repeat: thread the first argument through the copies.
            let mut args = args;
            if args.is_empty() || args[0].name.is_some() {
                return Err(Diag::new(
                    "kiln::argument",
                    format!(
                        "`{}` needs its input as the first argument",
                        inst.display_name()
                    ),
                )
                .at(span, "no positional input"));
            }
            let mut x = args.remove(0);
            for layer in stack.iter() {
                let mut a = vec![EArg {
                    name: x.name.clone(),
                    value: x.value.clone(),
                    span: x.span,
                }];
                a.extend(args.iter().map(|e| EArg {
                    name: e.name.clone(),
                    value: e.value.clone(),
                    span: e.span,
                }));
                let y = self.apply(layer, a, span)?;
                x = EArg {
                    name: None,
                    value: y,
                    span: x.span,
                };
            }
            return Ok(x.value);
        }
        let def = inst
            .layer
            .clone()
            .expect("layer instances have a definition");
        if self.stack.len() >= MAX_DEPTH {
            return Err(Diag::new("kiln::depth", format!("layer calls nest deeper than {MAX_DEPTH}"))
                .at(span, "too deep")
                .help("layers cannot call themselves; check for indirect recursion through layer arguments"));
        }
        self.stack.push((def.name.name.clone(), span));
        let r = self.apply_body(inst, &def, args, span);
        let r = r.map_err(|mut d| {
            if d.stack.is_empty() {
                d.stack = self.stack.clone();
            }
            d
        });
        self.stack.pop();
        r
    }

    pub(super) fn apply_body(
        &mut self,
        inst: &Rc<Instance>,
        def: &Rc<LayerDef>,
        args: Vec<EArg>,
        span: Span,
    ) -> R<Value> {
        let anon = self.anon_names(&def.body);
        let mut frame = Frame::new(inst.clone(), false, anon);
        for (k, v) in &inst.hyper {
            frame.vars.insert(k.clone(), v.clone());
        }
        // Bind tensor arguments: positional in order, then by name.
        let n = def.tensor_params.len();
        let mut slots: Vec<Option<EArg>> = (0..n).map(|_| None).collect();
        let mut next = 0;
        let positional = args.iter().filter(|a| a.name.is_none()).count();
        if positional > n {
            let extra = args
                .iter()
                .filter(|a| a.name.is_none())
                .nth(n)
                .expect("counted");
            return Err(too_many_positional(def, extra.span, positional));
        }
        for a in args {
            match &a.name {
                None => {
                    slots[next] = Some(a);
                    next += 1;
                }
                Some(nm) => {
                    let i = def
                        .tensor_params
                        .iter()
                        .position(|p| p.name.name == nm.name)
                        .ok_or_else(|| {
                            unknown_param(
                                &def.name.name,
                                nm,
                                def.tensor_params.iter().map(|p| p.name.name.as_str()),
                            )
                        })?;
                    if slots[i].is_some() {
                        return Err(Diag::new(
                            "kiln::argument",
                            format!("argument `{}` is given twice", nm.name),
                        )
                        .at(a.span, "already given by position")
                        .help("pass it once"));
                    }
                    slots[i] = Some(a);
                }
            }
        }
        let mut given: Vec<(Value, Span)> = Vec::with_capacity(n);
        for (tp, slot) in def.tensor_params.iter().zip(slots) {
            let (value, aspan) = match slot {
                Some(a) => (a.value, a.span),
                None if tp.optional => (Value::None, span),
                None => {
                    return Err(Diag::new(
                        "kiln::argument",
                        format!(
                            "missing tensor argument `{}` of `{}`",
                            tp.name.name, def.name.name
                        ),
                    )
                    .at(span, format!("`{}` is not given", tp.name.name))
                    .note(Some(tp.name.span), "declared here")
                    .help(format!(
                        "pass it in order or by name: `{}({} = ...)`",
                        def.name.name, tp.name.name
                    )))
                }
            };
            match &value {
                Value::None if tp.optional => {}
                Value::Tensor(_) => {}
                other => {
                    return Err(Diag::new(
                        "kiln::type",
                        format!(
                            "argument `{}` of `{}` must be a tensor, got {}",
                            tp.name.name,
                            def.name.name,
                            other.kind()
                        ),
                    )
                    .at(aspan, format!("this is {}", other.kind())))
                }
            }
            given.push((value, aspan));
        }
        for (k, v) in self.resolve_deferred(inst, def, &given, span)? {
            frame.vars.insert(k, v);
        }
        for (tp, (value, aspan)) in def.tensor_params.iter().zip(given) {
            if let (Value::Tensor(id), Some(pat)) = (&value, &tp.ty) {
                self.match_pattern(&mut frame, def, tp, pat, *id, aspan)
                    .map_err(|d| self.note_inferred(inst, pat, d))?;
            }
            frame.vars.insert(tp.name.name.clone(), value);
        }
        let flow = self.exec_block(&mut frame, &def.body)?;
        let value = if flow.returned {
            self.returning.take()
        } else {
            flow.value
        };
        match value {
            Some(Value::None) | None => Err(Diag::new(
                "kiln::no-value",
                format!("layer `{}` produces no value", def.name.name),
            )
            .at(def.name.span, "its body does not end with an expression")
            .help("end the body with the result, e.g. the name of the last tensor")),
            Some(v) => Ok(v),
        }
    }

    /// Checks a tensor against `x: f32[b, t, d_model]`, binding new dim names.
    pub(super) fn match_pattern(
        &mut self,
        frame: &mut Frame,
        def: &LayerDef,
        tp: &TensorParam,
        pat: &TensorTypeExpr,
        id: NodeId,
        aspan: Span,
    ) -> R<()> {
        let ty = self.ty(id);
        let pat_text = self.prog.sources.text(pat.span).to_string();
        let mismatch = |me: &Self, why: String| -> Diag {
            Diag::new(
                "kiln::shape",
                format!(
                    "argument `{}` of `{}` must be `{}`, got {}",
                    tp.name.name, def.name.name, pat_text, ty
                ),
            )
            .at(aspan, format!("this is {ty}"))
            .note(Some(pat.span), why)
            .help_opt(if me.prog.sources.file(pat.span.file).is_prelude {
                None
            } else {
                Some("fix the argument or the pattern".to_string())
            })
        };
        if let Some(dt) = &pat.dtype {
            let want = parse_dtype(dt)?;
            if want != ty.dtype {
                return Err(mismatch(self, format!("the element type must be {want}")));
            }
        }
        let ell = pat
            .dims
            .iter()
            .filter(|d| matches!(d, ShapeItem::Ellipsis(_)))
            .count();
        if ell > 1 {
            return Err(Diag::new("kiln::type", "a pattern may contain `...` once")
                .at(pat.span, "two `...`"));
        }
        let fixed = pat.dims.len() - ell;
        let rank = ty.shape.rank();
        if (ell == 0 && rank != fixed) || (ell == 1 && rank < fixed) {
            return Err(mismatch(
                self,
                format!(
                    "the pattern has {}{fixed} axes, the tensor {rank}",
                    if ell == 1 { "at least " } else { "" }
                ),
            ));
        }
        let pos = pat
            .dims
            .iter()
            .position(|d| matches!(d, ShapeItem::Ellipsis(_)));
        let skip = rank - fixed;
        let mut axis = 0;
        for (i, item) in pat.dims.iter().enumerate() {
            let ShapeItem::Expr(e) = item else {
                axis += skip;
                continue;
            };
            let _ = (i, pos);
            let actual = ty.shape.dims()[axis].clone();
            match &e.kind {
                ExprKind::Var(n) if n == "_" => {}
                ExprKind::Var(n) if !frame.vars.contains_key(n) => {
                    frame
                        .vars
                        .insert(n.clone(), Value::from_dim(actual.clone()));
                }
                _ => {
                    let want = self.eval(frame, e)?;
                    let Some(want) = want.as_dim() else {
                        return Err(Diag::new(
                            "kiln::type",
                            format!("a pattern dim must be an int or a dim, got {}", want.kind()),
                        )
                        .at(e.span, ""));
                    };
                    if want != actual {
                        let etext = self.prog.sources.text(e.span).to_string();
                        let shown = if etext == want.to_string() {
                            etext
                        } else {
                            format!("{etext} = {want}")
                        };
                        return Err(mismatch(
                            self,
                            format!("axis {axis} must be {shown}, but it is {actual}"),
                        ));
                    }
                }
            }
            axis += 1;
        }
        Ok(())
    }

    /// Names for the anonymous instances of a body: the layer's name when it is called
    /// from one place, `name_0`, `name_1`, … when from several.
    pub(super) fn anon_names(&mut self, body: &Block) -> Rc<HashMap<u32, String>> {
        let key = body as *const Block as usize;
        if let Some(m) = self.anon_cache.get(&key) {
            return m.clone();
        }
        let mut calls: Vec<(String, u32)> = Vec::new();
        body.walk(&mut |e| {
            if let ExprKind::Call { callee, site, .. } = &e.kind {
                if let ExprKind::Var(n) = &callee.kind {
                    calls.push((n.clone(), *site));
                }
            }
        });
        let mut count: HashMap<&str, usize> = HashMap::new();
        for (n, _) in &calls {
            *count.entry(n.as_str()).or_insert(0) += 1;
        }
        let mut seen: HashMap<&str, usize> = HashMap::new();
        let mut out = HashMap::new();
        for (n, site) in &calls {
            let k = seen.entry(n.as_str()).or_insert(0);
            let name = if count[n.as_str()] == 1 {
                n.clone()
            } else {
                format!("{n}_{k}")
            };
            *k += 1;
            out.insert(*site, name);
        }
        let m = Rc::new(out);
        self.anon_cache.insert(key, m.clone());
        m
    }
}

/// The error for more positional arguments than `def` has tensor parameters.
fn too_many_positional(def: &LayerDef, extra: Span, positional: usize) -> Diag {
    let n = def.tensor_params.len();
    if n == 0 {
        let names: Vec<String> = def
            .params
            .iter()
            .map(|p| format!("{} = ...", p.name.name))
            .collect();
        Diag::new(
            "kiln::argument",
            format!("layer `{}` takes no tensor arguments", def.name.name),
        )
        .at(extra, "unexpected argument")
        .help(format!(
            "its parameters are named: `{}({})`",
            def.name.name,
            names.join(", ")
        ))
    } else {
        Diag::new(
            "kiln::argument",
            format!(
                "layer `{}` takes {n} tensor argument{}, got {positional}",
                def.name.name,
                if n == 1 { "" } else { "s" }
            ),
        )
        .at(extra, "one too many")
        .help(format!(
            "its tensor arguments are ({}); pass the others by name{}",
            def.tensor_params
                .iter()
                .map(|p| p.name.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            def.params
                .first()
                .map(|p| format!(", as in `{} = ...`", p.name.name))
                .unwrap_or_default()
        ))
    }
}
