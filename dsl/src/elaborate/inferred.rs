//! Hyper-parameters taken from the input's shape (#61): `attention(h = 8, d_k = 64)`
//! leaves `d_model` to its first application, whose `q_in: f32[b, tq, d_model]` binds it,
//! as a paper writes the layer. The instance keeps what that application bound; a later
//! application must fit it, as explicit values must.

use std::collections::HashMap;
use std::rc::Rc;

use crate::diagnostics::Diag;
use crate::source::Span;
use crate::values::{Inferred, Instance, Value};

use super::*;

/// Whether a tensor argument's pattern names `name` as one axis (`x: [..., d_in]`).
pub(super) fn named_by_pattern(tensors: &[TensorParam], name: &str) -> bool {
    tensors.iter().any(|tp| {
        tp.ty.as_ref().is_some_and(|pat| {
            pat.dims
                .iter()
                .any(|d| matches!(d, ShapeItem::Expr(e) if matches!(&e.kind, ExprKind::Var(n) if n == name)))
        })
    })
}

/// Whether expression `e` reads any of `names`.
pub(super) fn uses_any(e: &Expr, names: &[String]) -> bool {
    let mut hit = false;
    e.walk(&mut |x| {
        if let ExprKind::Var(n) = &x.kind {
            hit |= names.contains(n);
        }
    });
    hit
}

/// The axis each item of `pat` stands for in a tensor of rank `rank` (`None` for `...`),
/// or `None` when the ranks cannot fit (the pattern check reports that).
pub(super) fn axes(pat: &TensorTypeExpr, rank: usize) -> Option<Vec<Option<usize>>> {
    let ell = pat
        .dims
        .iter()
        .filter(|d| matches!(d, ShapeItem::Ellipsis(_)))
        .count();
    let fixed = pat.dims.len() - ell;
    if ell > 1 || (ell == 0 && rank != fixed) || (ell == 1 && rank < fixed) {
        return None;
    }
    let mut axis = 0;
    let mut out = Vec::with_capacity(pat.dims.len());
    for item in &pat.dims {
        match item {
            ShapeItem::Ellipsis(_) => {
                axis += rank - fixed;
                out.push(None);
            }
            ShapeItem::Expr(_) => {
                out.push(Some(axis));
                axis += 1;
            }
        }
    }
    Some(out)
}

impl<'p> Elab<'p> {
    /// The values of `inst`'s deferred hyper-parameters for this application: the first
    /// binds them, from the first tensor argument whose pattern names each (then the
    /// defaults that use them, in declaration order); later ones reuse them.
    pub(super) fn resolve_deferred(
        &mut self,
        inst: &Rc<Instance>,
        def: &LayerDef,
        given: &[(Value, Span)],
        span: Span,
    ) -> R<Vec<(String, Value)>> {
        if inst.deferred.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(done) = &inst.state.borrow().inferred {
            return Ok(done.values.clone());
        }
        let mut scope = Frame::new(inst.clone(), false, Rc::new(HashMap::new()));
        for (k, v) in &inst.hyper {
            scope.vars.insert(k.clone(), v.clone());
        }
        let mut values = Vec::new();
        for name in &inst.deferred {
            let p = def
                .params
                .iter()
                .find(|p| &p.name.name == name)
                .expect("deferred names are the layer's hyper-parameters");
            let v = match &p.default {
                Some(d) => {
                    let v = self.eval(&mut scope, d)?;
                    check_type(p, v, d.span)?
                }
                None => self.taken_from_shape(def, p, given, span)?,
            };
            scope.vars.insert(name.clone(), v.clone());
            values.push((name.clone(), v));
        }
        inst.state.borrow_mut().inferred = Some(Inferred {
            values: values.clone(),
            at: span,
        });
        Ok(values)
    }

    /// Hyper-parameter `p` from the first given tensor argument whose pattern names it.
    fn taken_from_shape(
        &mut self,
        def: &LayerDef,
        p: &HyperParam,
        given: &[(Value, Span)],
        span: Span,
    ) -> R<Value> {
        let name = &p.name.name;
        for (tp, (value, aspan)) in def.tensor_params.iter().zip(given) {
            let (Some(pat), Value::Tensor(id)) = (&tp.ty, value) else {
                continue;
            };
            let ty = self.ty(*id);
            let Some(axes) = axes(pat, ty.shape.rank()) else {
                continue;
            };
            for (item, axis) in pat.dims.iter().zip(axes) {
                let (ShapeItem::Expr(e), Some(axis)) = (item, axis) else {
                    continue;
                };
                if !matches!(&e.kind, ExprKind::Var(n) if n == name) {
                    continue;
                }
                let dim = ty.shape.dims()[axis].clone();
                let v = Value::from_dim(dim.clone());
                let wants_number =
                    p.ty.as_ref()
                        .is_some_and(|t| t.name == "int" || t.name == "float");
                if wants_number && matches!(v, Value::Dim(_)) {
                    return Err(Diag::new(
                        "kiln::argument",
                        format!(
                            "`{name}` of `{}` comes from axis {axis} of `{}`, which is `{dim}`, not a number",
                            def.name.name, tp.name.name
                        ),
                    )
                    .at(*aspan, format!("this is {ty}"))
                    .note(Some(e.span), format!("the pattern takes `{name}` from here"))
                    .help(format!(
                        "pass it where the layer is made: `{}(..., {name} = ...)`",
                        def.name.name
                    )));
                }
                return check_type(p, v, *aspan);
            }
        }
        Err(Diag::new(
            "kiln::argument",
            format!("missing argument `{name}` of `{}`", def.name.name),
        )
        .at(
            span,
            format!("`{name}` is not given, and no input here has its axis"),
        )
        .note(
            Some(p.name.span),
            format!("`{name}` is declared here without a default"),
        )
        .help(format!(
            "pass it by name: `{}(..., {name} = ...)`",
            def.name.name
        )))
    }

    /// A pattern mismatch on an application after the first, of a pattern naming a
    /// hyper-parameter that the first one bound: says where that value came from.
    pub(super) fn note_inferred(&self, inst: &Instance, pat: &TensorTypeExpr, d: Diag) -> Diag {
        let state = inst.state.borrow();
        let Some(inf) = &state.inferred else {
            return d;
        };
        let named: Vec<&(String, Value)> = inf
            .values
            .iter()
            .filter(|(n, _)| {
                pat.dims.iter().any(|item| {
                    matches!(item, ShapeItem::Expr(e) if uses_any(e, std::slice::from_ref(n)))
                })
            })
            .collect();
        if named.is_empty() {
            return d;
        }
        let said: Vec<String> = named.iter().map(|(n, v)| format!("`{n}` = {v}")).collect();
        d.note(
            Some(inf.at),
            format!(
                "{} of `{}` came from its first application, here",
                said.join(", "),
                inst.display_name()
            ),
        )
    }
}
