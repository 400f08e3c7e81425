//! Elaboration: AST → IR graph.
//!
//! In: a loaded [`Program`], the name of a model, `--set` overrides and a [`Mode`].
//! Out: a checked [`Graph`] whose parameters have stable dotted names, or a diagnostic.
//!
//! The elaborator is an interpreter over [`Value`]s. Numbers, dims and booleans are
//! computed on the spot (so `d_k = d_model / h` is checked here, with both values in
//! the message); tensor operations append IR nodes, with shapes inferred as they go.
//!
//! Layers. `attention(h = 8, d_model = 512)` with no tensor argument is a [`Partial`];
//! binding it to a name makes an [`Instance`] that owns parameters named after that
//! binding (`self_attn` → `encoder.layers.0.self_attn.w_q`). Applying an instance twice
//! shares its weights; that is how the paper's three-way embedding sharing is written. A
//! call with tensor arguments (`ffn(x, d_model = 512, d_ff = 2048)`) instantiates and
//! applies at once; its instance is keyed by the call site, so re-applying the enclosing
//! instance reuses it, and it is named after the layer (`ffn`, or `ffn_1` when a body
//! calls the same layer from several places).
//!
//! Tensor arguments may declare shape patterns (`x: f32[b, t, d_model]`): names already
//! bound are checked, new names bind the actual dims, `...` matches leading axes.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use kiln_ir::ir::{DType, Graph, NodeId, Op, TensorType};

use crate::ast::*;
use crate::builtins;
use crate::diagnostics::{did_you_mean, Diag};
use crate::load::Program;
use crate::source::Span;
use crate::values::{Instance, Partial, Value};

mod calls;
mod expr;
mod inferred;
mod stmts;
mod tensor_ops;

pub(crate) type R<T> = Result<T, Diag>;

/// What the graph is for. `Eval` and `Decode` leave dropout out; `Train` keeps it.
/// `Decode` elaborates one incremental decoder step: every `stage` value becomes an
/// input, and every `kv_cache(...)` reads the previous positions from an input and
/// returns all of them as an output (see the prelude's `attention`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    #[default]
    Eval,
    Train,
    Decode,
}

/// A `--set key=value` override with spans into the command-line source.
#[derive(Clone, Debug)]
pub struct Override {
    pub key: String,
    pub value: String,
    pub key_span: Span,
    pub value_span: Span,
}

/// How deep layer calls may nest.
const MAX_DEPTH: usize = 64;
/// The most IR nodes a spec may elaborate to: fifty times the paper's big model's training
/// graph, a 1,000-layer `parsing` model (DeepNet's 1,000-layer Transformer fits), and low
/// enough that a spec past it is refused within the fuzz target's time bound on a slow
/// core (docs/perf-log/2026-12-02.md).
const MAX_NODES: usize = 250_000;

/// An evaluated call argument.
pub(crate) struct EArg {
    pub name: Option<Ident>,
    pub value: Value,
    pub span: Span,
}

pub(crate) struct Frame {
    pub vars: HashMap<String, Value>,
    pub inst: Rc<Instance>,
    pub is_model: bool,
    /// Names of the anonymous instances made by call sites of this body.
    pub anon: Rc<HashMap<u32, String>>,
    declared_params: HashSet<String>,
    assigned: HashMap<String, Span>,
}

impl Frame {
    fn new(inst: Rc<Instance>, is_model: bool, anon: Rc<HashMap<u32, String>>) -> Frame {
        Frame {
            vars: HashMap::new(),
            inst,
            is_model,
            anon,
            declared_params: HashSet::new(),
            assigned: HashMap::new(),
        }
    }
}

/// What a block produced.
struct Flow {
    value: Option<Value>,
    returned: bool,
}

pub(crate) struct Elab<'p> {
    pub prog: &'p Program,
    pub graph: Graph,
    pub mode: Mode,
    pub stack: Vec<(String, Span)>,
    pub next_stream: u32,
    /// Set by `return` until the enclosing layer body picks the value up.
    returning: Option<Value>,
    anon_cache: HashMap<usize, Rc<HashMap<u32, String>>>,
}

/// Elaborates model `name` of `prog`.
pub fn elaborate(prog: &Program, name: &str, overrides: &[Override], mode: Mode) -> R<Graph> {
    let mut e = Elab {
        prog,
        graph: Graph::new(name),
        mode,
        stack: Vec::new(),
        next_stream: 0,
        returning: None,
        anon_cache: HashMap::new(),
    };
    e.model(name, overrides)?;
    Ok(e.graph)
}

impl<'p> Elab<'p> {
    // ----------------------------------------------------------------- models

    fn model(&mut self, name: &str, overrides: &[Override]) -> R<()> {
        // Follow `model a = b(...)` to the full definition.
        let mut chain: Vec<Rc<ModelDef>> = Vec::new();
        let mut cur = self
            .prog
            .models
            .get(name)
            .cloned()
            .expect("caller checked the model");
        loop {
            if chain.iter().any(|m| Rc::ptr_eq(m, &cur)) {
                return Err(Diag::new(
                    "kiln::recursive",
                    format!("model `{}` is defined in terms of itself", cur.name.name),
                )
                .at(cur.name.span, "this model")
                .help("an alias must end at a model with a body"));
            }
            chain.push(cur.clone());
            match &cur.kind {
                ModelKind::Full { .. } => break,
                ModelKind::Alias { base, .. } => {
                    cur = match self.prog.models.get(&base.name) {
                        Some(m) => m.clone(),
                        None => {
                            let names: Vec<&str> =
                                self.prog.models.keys().map(|s| s.as_str()).collect();
                            return Err(Diag::new(
                                "kiln::unknown-model",
                                format!("unknown model `{}`", base.name),
                            )
                            .at(base.span, "no model with this name")
                            .help_opt(
                                did_you_mean(&base.name, names).or_else(|| {
                                    Some(
                                        "import the file that defines it: `import \"file.kiln\"`"
                                            .to_string(),
                                    )
                                }),
                            ));
                        }
                    }
                }
            }
        }
        let full = chain.last().expect("chain has the full model").clone();
        let (params, body) = match &full.kind {
            ModelKind::Full { params, body } => (params, body),
            ModelKind::Alias { .. } => unreachable!("loop stops at a full model"),
        };
        let root = Rc::new(Instance {
            name: String::new(),
            kind: full.name.name.clone(),
            layer: None,
            hyper: vec![],
            deferred: vec![],
            stack: None,
            state: Default::default(),
        });
        let anon = self.anon_names(body);
        let mut frame = Frame::new(root.clone(), true, anon);

        // Overrides: aliases from the full model outwards, then the command line.
        let mut given: Vec<EArg> = Vec::new();
        for m in chain.iter().rev() {
            if let ModelKind::Alias { args, .. } = &m.kind {
                for a in args {
                    let Some(n) = &a.name else {
                        return Err(Diag::new("kiln::argument", "model overrides must be named")
                            .at(a.span, "unnamed")
                            .help("write `model big = transformer(d_model = 1024)`"));
                    };
                    if !params.iter().any(|p| p.name.name == n.name) {
                        return Err(unknown_param(
                            &full.name.name,
                            n,
                            params.iter().map(|p| p.name.name.as_str()),
                        ));
                    }
                    let v = self.eval(&mut frame, &a.value)?;
                    given.retain(|g| g.name.as_ref().map(|x| &x.name) != Some(&n.name));
                    given.push(EArg {
                        name: Some(n.clone()),
                        value: v,
                        span: a.span,
                    });
                }
            }
        }
        for o in overrides {
            let Some(p) = params.iter().find(|p| p.name.name == o.key) else {
                let names: Vec<&str> = params.iter().map(|p| p.name.name.as_str()).collect();
                return Err(Diag::new(
                    "kiln::set",
                    format!(
                        "`--set {}`: model `{}` has no parameter `{}`",
                        o.key, full.name.name, o.key
                    ),
                )
                .at(o.key_span, "unknown parameter")
                .help(match did_you_mean(&o.key, names.iter().copied()) {
                    Some(s) => s,
                    None => format!("its parameters are: {}", names.join(", ")),
                }));
            };
            let v = parse_override(o, p)?;
            given.retain(|g| g.name.as_ref().map(|x| &x.name) != Some(&o.key));
            given.push(EArg {
                name: Some(Ident {
                    name: o.key.clone(),
                    span: o.key_span,
                }),
                value: v,
                span: o.value_span,
            });
        }
        let (bound, _) = self.bind_hyper(
            &full.name.name,
            params,
            &[],
            given,
            full.name.span,
            &mut frame,
        )?;
        for (k, v) in bound {
            let text = match &v {
                Value::Str(s) => s.to_string(),
                other => other.to_string(),
            };
            self.graph.hparams.push((k.clone(), text));
            frame.vars.insert(k, v);
        }
        self.exec_block(&mut frame, body)?;
        self.returning = None;
        // Extension blocks of aliases run in the same scope, innermost first.
        for m in chain.iter().rev() {
            if let ModelKind::Alias { extra: Some(b), .. } = &m.kind {
                frame.anon = self.anon_names(b);
                self.exec_block(&mut frame, b)?;
            }
        }
        if self.graph.outputs.is_empty() {
            let top = chain[0].clone();
            return Err(Diag::new(
                "kiln::no-output",
                format!("model `{}` has no outputs", top.name.name),
            )
            .at(top.name.span, "declares no `output`")
            .help("name what the model computes: `output logits = ...`"));
        }
        Ok(())
    }

    // ------------------------------------------------------------ statements

    fn exec_block(&mut self, frame: &mut Frame, block: &Block) -> R<Flow> {
        let mut flow = Flow {
            value: None,
            returned: false,
        };
        for stmt in &block.stmts {
            flow.value = None;
            match &stmt.kind {
                StmtKind::Expr(e) => {
                    let v = self.eval(frame, e)?;
                    flow.value = Some(v);
                }
                StmtKind::Return(e) => {
                    let v = self.eval(frame, e)?;
                    self.returning = Some(v);
                    return Ok(Flow {
                        value: None,
                        returned: true,
                    });
                }
                StmtKind::Assign(name, e) => {
                    let v = self.eval(frame, e)?;
                    let v = self.materialize(frame, name, v)?;
                    frame.vars.insert(name.name.clone(), v);
                }
                StmtKind::Dims(names) => self.stmt_dims(frame, names, stmt.span)?,
                StmtKind::Input(name, ty) => self.stmt_input(frame, name, ty, stmt.span)?,
                StmtKind::Output(name, e) => {
                    self.stmt_output(frame, name, e.as_ref(), false, stmt.span)?
                }
                StmtKind::Objective(name, e) => {
                    self.stmt_output(frame, name, e.as_ref(), true, stmt.span)?
                }
                StmtKind::Stage(name, e) => self.stmt_stage(frame, name, e, stmt.span)?,
                StmtKind::Param { name, ty, init } => {
                    self.stmt_param(frame, name, ty, init.as_ref())?
                }
                StmtKind::Check { cond, message } => {
                    self.stmt_check(frame, cond, message.as_deref())?
                }
            }
            if self.returning.is_some() {
                return Ok(Flow {
                    value: None,
                    returned: true,
                });
            }
        }
        Ok(flow)
    }

    /// Binding a [`Partial`] to a name makes a named instance of the current one.
    fn materialize(&mut self, frame: &mut Frame, name: &Ident, v: Value) -> R<Value> {
        let Value::Partial(p) = v else { return Ok(v) };
        if let Some(prev) = frame.assigned.insert(name.name.clone(), name.span) {
            return Err(Diag::new(
                "kiln::duplicate",
                format!("instance name `{}` is bound twice in this body", name.name),
            )
            .at(name.span, "second binding")
            .label(prev, "first binding")
            .help("parameters are named after the binding; give each instance its own name"));
        }
        let existing = frame.inst.state.borrow().children.get(&name.name).cloned();
        if let Some(inst) = existing {
            return Ok(Value::Instance(inst));
        }
        let inst = self.instantiate(&frame.inst.child_name(&name.name), &p);
        frame
            .inst
            .state
            .borrow_mut()
            .children
            .insert(name.name.clone(), inst.clone());
        Ok(Value::Instance(inst))
    }

    fn instantiate(&mut self, full_name: &str, p: &Partial) -> Rc<Instance> {
        let stack = p.repeat.map(|n| {
            (0..n)
                .map(|i| {
                    Rc::new(Instance {
                        name: format!("{full_name}.{i}"),
                        kind: p.layer.name.name.clone(),
                        layer: Some(p.layer.clone()),
                        hyper: p.hyper.clone(),
                        deferred: p.deferred.clone(),
                        stack: None,
                        state: Default::default(),
                    })
                })
                .collect()
        });
        Rc::new(Instance {
            name: full_name.to_string(),
            kind: p.layer.name.name.clone(),
            layer: Some(p.layer.clone()),
            hyper: p.hyper.clone(),
            deferred: p.deferred.clone(),
            stack,
            state: Default::default(),
        })
    }

    // ----------------------------------------------------------- expressions

    pub(crate) fn lookup(&mut self, frame: &Frame, name: &str, span: Span) -> R<Value> {
        if let Some(v) = frame.vars.get(name) {
            return Ok(v.clone());
        }
        if let Some(i) = builtins::named_init(name) {
            return Ok(Value::Init(i));
        }
        if self.prog.layers.contains_key(name) || builtins::is_builtin(name) {
            return Ok(Value::Layer(Rc::from(name)));
        }
        if let Some(d) = DType::parse(name) {
            return Ok(Value::DType(d));
        }
        if self.prog.models.contains_key(name) {
            return Err(Diag::new(
                "kiln::name",
                format!("`{name}` is a model; models cannot be used as values"),
            )
            .at(span, "a model")
            .help("to reuse a model's layers, move them into `layer` definitions"));
        }
        let mut cands: Vec<&str> = frame.vars.keys().map(|s| s.as_str()).collect();
        cands.sort();
        Err(
            Diag::new("kiln::unknown-name", format!("unknown name `{name}`"))
                .at(span, "not defined here")
                .help_opt(did_you_mean(name, cands).or_else(|| {
                    if frame.is_model {
                        Some("define it first, e.g. `name = ...`".to_string())
                    } else {
                        Some(
                            "a layer sees only its parameters, its arguments and its own names"
                                .to_string(),
                        )
                    }
                })),
        )
    }

    // ------------------------------------------------------------- tensors

    /// Adds an IR node in the current scope; a type error becomes a diagnostic at `span`.
    pub(crate) fn node(
        &mut self,
        frame: &Frame,
        op: Op,
        inputs: &[NodeId],
        span: Span,
    ) -> R<NodeId> {
        if self.graph.len() >= MAX_NODES {
            return Err(Diag::new(
                "kiln::too-large",
                format!("the model elaborates to more than {MAX_NODES} graph nodes"),
            )
            .at(span, "the limit was reached here")
            .help("check the `repeat` counts and nested stacks (the paper's base model has a few thousand nodes)"));
        }
        self.graph
            .add(op, inputs, &frame.inst.name)
            .map_err(|e| Diag::new("kiln::shape", e.to_string()).at(span, ""))
    }

    pub(crate) fn ty(&self, id: NodeId) -> TensorType {
        self.graph.ty(id).clone()
    }

    // --------------------------------------------------------------- calls
}

fn unknown_param<'a>(owner: &str, n: &Ident, names: impl Iterator<Item = &'a str>) -> Diag {
    let names: Vec<&str> = names.collect();
    Diag::new(
        "kiln::argument",
        format!("`{owner}` has no parameter `{}`", n.name),
    )
    .at(n.span, "unknown parameter")
    .help(match did_you_mean(&n.name, names.iter().copied()) {
        Some(s) => s,
        None => format!("its parameters are: {}", names.join(", ")),
    })
}

pub(crate) fn parse_dtype(id: &Ident) -> R<DType> {
    DType::parse(&id.name).ok_or_else(|| {
        let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        Diag::new("kiln::type", format!("unknown element type `{}`", id.name))
            .at(id.span, "not an element type")
            .help(match did_you_mean(&id.name, names.iter().copied()) {
                Some(s) => s,
                None => format!("element types are {}", names.join(", ")),
            })
    })
}

/// Checks a value against a hyper-parameter's declared type, converting ints to floats.
pub(super) fn check_type(p: &HyperParam, v: Value, span: Span) -> R<Value> {
    let Some(ty) = &p.ty else { return Ok(v) };
    let ok = match (ty.name.as_str(), &v) {
        ("int", Value::Int(_)) => return Ok(v),
        ("float", Value::Int(x)) => return Ok(Value::Float(*x as f64)),
        ("float", Value::Float(_)) => return Ok(v),
        ("bool", Value::Bool(_)) => true,
        ("str", Value::Str(_)) => true,
        ("dim", Value::Int(_) | Value::Dim(_)) => true,
        ("layer", Value::Instance(_) | Value::Partial(_) | Value::Layer(_)) => true,
        ("tensor", Value::Tensor(_)) => true,
        ("list", Value::List(_)) => true,
        ("any", _) => true,
        (t, _)
            if ![
                "int", "float", "bool", "str", "dim", "layer", "tensor", "list", "any",
            ]
            .contains(&t) =>
        {
            return Err(
                Diag::new("kiln::type", format!("unknown parameter type `{t}`"))
                    .at(ty.span, "not a type")
                    .help("types are int, float, bool, str, dim, layer, tensor, list and any"),
            )
        }
        _ => false,
    };
    if ok {
        return Ok(v);
    }
    let article = if ty.name == "int" { "an" } else { "a" };
    let mut d = Diag::new(
        "kiln::type",
        format!(
            "`{}` must be {article} {}, got {} ({v})",
            p.name.name,
            ty.name,
            v.kind()
        ),
    )
    .at(span, format!("this is {}", v.kind()))
    .note(
        Some(ty.span),
        format!("`{}` is declared `{}` here", p.name.name, ty.name),
    );
    if let (Value::Float(x), "int") = (&v, ty.name.as_str()) {
        d = d.help(format!("use a whole number, e.g. {}", x.round() as i64));
    }
    Err(d)
}

/// Parses a `--set` value by the parameter's declared type (or its default's form).
fn parse_override(o: &Override, p: &HyperParam) -> R<Value> {
    let ty = p.ty.as_ref().map(|t| t.name.as_str()).unwrap_or_else(|| {
        match p.default.as_ref().map(|d| &d.kind) {
            Some(ExprKind::Int(_)) => "int",
            Some(ExprKind::Float(_)) => "float",
            Some(ExprKind::Bool(_)) => "bool",
            Some(ExprKind::Str(_)) => "str",
            _ => "any",
        }
    });
    let text = o.value.trim();
    let bad = |what: &str, example: &str| {
        Diag::new(
            "kiln::set",
            format!(
                "`--set {}={}`: `{}` is {what}, and `{}` is not one",
                o.key, o.value, o.key, text
            ),
        )
        .at(o.value_span, format!("not {what}"))
        .help(format!("for example `--set {}={example}`", o.key))
    };
    let clean: String = text.chars().filter(|&c| c != '_').collect();
    Ok(match ty {
        "int" | "dim" => Value::Int(clean.parse::<i64>().map_err(|_| bad("an int", "512"))?),
        "float" => Value::Float(
            clean
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| bad("a float", "0.1"))?,
        ),
        "bool" => match text {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => return Err(bad("a bool", "true")),
        },
        "str" => Value::Str(Rc::from(text.trim_matches('"'))),
        _ => {
            if let Ok(v) = clean.parse::<i64>() {
                Value::Int(v)
            } else if let Ok(v) = clean.parse::<f64>() {
                Value::Float(v)
            } else if text == "true" || text == "false" {
                Value::Bool(text == "true")
            } else {
                Value::Str(Rc::from(text.trim_matches('"')))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::expr::divisors_near;

    #[test]
    fn divisors_near_a_divisor_are_the_closest_ones_found_without_a_scan() {
        assert_eq!(divisors_near(512, 7), vec![4, 8]);
        assert_eq!(divisors_near(512, 3), vec![2, 4]);
        assert_eq!(divisors_near(512, 1000), vec![512]);
        // A huge divisor (the scan in it hung) and a large prime below 2⁴⁰.
        assert_eq!(divisors_near(512, i64::MAX), vec![512]);
        assert_eq!(
            divisors_near(1_099_511_627_689, 3),
            vec![1, 1_099_511_627_689]
        );
        assert!(divisors_near(-5, 3).is_empty() && divisors_near(1 << 41, 3).is_empty());
    }
}
