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

use kiln_ir::infer::broadcast_shapes;
use kiln_ir::ir::{BinaryOp, CmpOp, DType, Graph, Init, NodeId, Op, TensorType, UnaryOp};
use kiln_ir::shape::{Dim, Shape};

use crate::ast::*;
use crate::builtins;
use crate::diagnostics::{did_you_mean, Diag};
use crate::load::Program;
use crate::source::Span;
use crate::values::{Instance, Partial, Value};

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
/// The most IR nodes a spec may elaborate to (about 0.8 KB each while elaborating).
const MAX_NODES: usize = 1_000_000;

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
        let bound = self.bind_hyper(&full.name.name, params, given, full.name.span, &mut frame)?;
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
            stack,
            state: Default::default(),
        })
    }

    fn stmt_dims(&mut self, frame: &mut Frame, names: &[Ident], span: Span) -> R<()> {
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

    fn stmt_input(
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
    fn fixed_dims(
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
    fn dim_item(&mut self, frame: &mut Frame, e: &Expr, symbolic_ok: bool) -> R<Dim> {
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

    fn stmt_output(
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
    fn stmt_stage(&mut self, frame: &mut Frame, name: &Ident, e: &Expr, span: Span) -> R<()> {
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

    fn stmt_param(
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

    fn stmt_check(&mut self, frame: &mut Frame, cond: &Expr, message: Option<&str>) -> R<()> {
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

    fn field(&mut self, frame: &mut Frame, base: &Expr, field: &Ident) -> R<Value> {
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
            return Ok(h.clone());
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

    fn unary(
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

    fn binary(&mut self, frame: &mut Frame, op: BinOp, a: &Expr, b: &Expr, span: Span) -> R<Value> {
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
    fn binary_values(
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
        let text = |e: &Expr| self.prog.sources.text(e.span).to_string();
        match (&va, &vb) {
            (Tensor(_), _) | (_, Tensor(_)) => {
                self.tensor_binary(frame, op, va, a.span, vb, b.span, span)
            }
            (None, _) | (_, None) if matches!(op, BinOp::Eq | BinOp::Ne) => {
                let same = matches!((&va, &vb), (None, None));
                Ok(Bool(if op == BinOp::Eq { same } else { !same }))
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
                    BinOp::Eq => Ok(Bool(x == y)),
                    BinOp::Ne => Ok(Bool(x != y)),
                    _ => Err(Diag::new(
                        "kiln::type",
                        format!("`{}` is not defined on symbolic dims (`{x}` {} `{y}`)", op.symbol(), op.symbol()),
                    )
                    .at(span, "symbolic dims can be added, subtracted, multiplied and compared for equality")),
                }
            }
            (Bool(x), Bool(y)) if matches!(op, BinOp::Eq | BinOp::Ne) => {
                Ok(Bool((x == y) == (op == BinOp::Eq)))
            }
            (Str(x), Str(y)) if matches!(op, BinOp::Eq | BinOp::Ne) => {
                Ok(Bool((x == y) == (op == BinOp::Eq)))
            }
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

    /// Broadcasts `id` to `shape` (no node when it already has it).
    pub(crate) fn broadcast(
        &mut self,
        frame: &Frame,
        id: NodeId,
        shape: &Shape,
        span: Span,
    ) -> R<NodeId> {
        if &self.graph.ty(id).shape == shape {
            return Ok(id);
        }
        self.node(
            frame,
            Op::Broadcast {
                shape: shape.clone(),
            },
            &[id],
            span,
        )
    }

    /// A tensor from a value: tensors as they are, numbers as scalar constants of `dtype`.
    pub(crate) fn as_tensor(&mut self, v: &Value, dtype: DType, span: Span) -> R<NodeId> {
        match v {
            Value::Tensor(t) => Ok(*t),
            Value::Int(x) => Ok(self.graph.add_const(*x as f64, dtype)),
            Value::Float(x) if dtype.is_float() => Ok(self.graph.add_const(*x, dtype)),
            Value::Float(x) => Err(Diag::new(
                "kiln::type",
                format!("cannot use the float {x} with an {dtype} tensor"),
            )
            .at(span, "a float")
            .help("cast the tensor first: `cast(x, f32)`")),
            Value::Bool(b) if dtype == DType::Bool => Ok(self
                .graph
                .add_const(if *b { 1.0 } else { 0.0 }, DType::Bool)),
            other => Err(Diag::new(
                "kiln::type",
                format!("expected a tensor or a number, got {}", other.kind()),
            )
            .at(span, format!("this is {}", other.kind()))),
        }
    }

    /// Elementwise arithmetic with numpy broadcasting.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn elementwise(
        &mut self,
        frame: &Frame,
        op: BinaryOp,
        va: &Value,
        sa: Span,
        vb: &Value,
        sb: Span,
        span: Span,
        verb: &str,
    ) -> R<NodeId> {
        self.elementwise_op(frame, Op::Binary(op), va, sa, vb, sb, span, verb)
    }

    /// A two-operand elementwise op (arithmetic or comparison) with numpy broadcasting.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn elementwise_op(
        &mut self,
        frame: &Frame,
        op: Op,
        va: &Value,
        sa: Span,
        vb: &Value,
        sb: Span,
        span: Span,
        verb: &str,
    ) -> R<NodeId> {
        let dtype = match (va, vb) {
            (Value::Tensor(t), _) | (_, Value::Tensor(t)) => self.graph.ty(*t).dtype,
            _ => DType::F32,
        };
        let ta = self.as_tensor(va, dtype, sa)?;
        let tb = self.as_tensor(vb, dtype, sb)?;
        let (ya, yb) = (self.ty(ta), self.ty(tb));
        if ya.dtype != yb.dtype {
            return Err(Diag::new(
                "kiln::type",
                format!("cannot {verb} {} and {} tensors", ya.dtype, yb.dtype),
            )
            .at(sa, format!("this is {ya}"))
            .label(sb, format!("{yb}"))
            .help(format!("convert one of them with `cast(x, {})`", ya.dtype)));
        }
        let Some(shape) = broadcast_shapes(&ya.shape, &yb.shape) else {
            return Err(Diag::new("kiln::shape", format!("shape mismatch: cannot {verb} {} and {}", ya, yb))
                .at(sa, format!("this is {ya}"))
                .label(sb, format!("this is {yb}"))
                .help("shapes broadcast when, aligned from the right, each pair of dims is equal or one of them is 1"));
        };
        let ba = self.broadcast(frame, ta, &shape, sa)?;
        let bb = self.broadcast(frame, tb, &shape, sb)?;
        self.node(frame, op, &[ba, bb], span)
    }

    #[allow(clippy::too_many_arguments)]
    fn tensor_binary(
        &mut self,
        frame: &mut Frame,
        op: BinOp,
        va: Value,
        sa: Span,
        vb: Value,
        sb: Span,
        span: Span,
    ) -> R<Value> {
        let (bop, verb) = match op {
            BinOp::Add => (BinaryOp::Add, "add"),
            BinOp::Sub => (BinaryOp::Sub, "subtract"),
            BinOp::Mul => (BinaryOp::Mul, "multiply"),
            BinOp::Div => (BinaryOp::Div, "divide"),
            BinOp::MatMul => {
                return self
                    .matmul(frame, &va, sa, &vb, sb, span)
                    .map(Value::Tensor)
            }
            BinOp::Pow => return self.tensor_pow(frame, &va, sa, &vb, sb, span),
            BinOp::Eq | BinOp::Ne if matches!(va, Value::None) || matches!(vb, Value::None) => {
                return Ok(Value::Bool(op == BinOp::Ne));
            }
            BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => {
                let c = match op {
                    BinOp::Eq => CmpOp::Eq,
                    BinOp::Ne => CmpOp::Ne,
                    BinOp::Lt => CmpOp::Lt,
                    BinOp::Le => CmpOp::Le,
                    BinOp::Gt => CmpOp::Gt,
                    _ => CmpOp::Ge,
                };
                return Ok(Value::Tensor(self.elementwise_op(
                    frame,
                    Op::Compare(c),
                    &va,
                    sa,
                    &vb,
                    sb,
                    span,
                    "compare",
                )?));
            }
            _ => {
                return Err(Diag::new(
                    "kiln::type",
                    format!("`{}` is not defined on tensors", op.symbol()),
                )
                .at(span, "")
                .help("tensors support + - * / @, comparisons, and ** with a number"))
            }
        };
        Ok(Value::Tensor(
            self.elementwise(frame, bop, &va, sa, &vb, sb, span, verb)?,
        ))
    }

    fn tensor_pow(
        &mut self,
        frame: &mut Frame,
        va: &Value,
        sa: Span,
        vb: &Value,
        sb: Span,
        span: Span,
    ) -> R<Value> {
        let (Value::Tensor(x), Some(p)) = (va, vb.as_f64()) else {
            return Err(
                Diag::new("kiln::type", "`**` on tensors needs a number exponent")
                    .at(sb, format!("this is {}", vb.kind())),
            );
        };
        let x = *x;
        let id = if p == 1.0 {
            x
        } else if p == 2.0 {
            self.node(frame, Op::Binary(BinaryOp::Mul), &[x, x], span)?
        } else if p == 0.5 {
            self.node(frame, Op::Unary(UnaryOp::Sqrt), &[x], span)?
        } else if p == -1.0 {
            self.node(frame, Op::Unary(UnaryOp::Recip), &[x], span)?
        } else if p == -0.5 {
            let s = self.node(frame, Op::Unary(UnaryOp::Sqrt), &[x], span)?;
            self.node(frame, Op::Unary(UnaryOp::Recip), &[s], span)?
        } else {
            return Err(Diag::new("kiln::type", format!("tensor ** {p} is not supported"))
                .at(sb, "this exponent")
                .label(sa, "tensor")
                .help("exponents 2, 1, 0.5, -0.5 and -1 are supported; write others with exp and log"));
        };
        Ok(Value::Tensor(id))
    }

    /// `a @ b`: batched matrix product; batch dims broadcast, a `[k, n]` right side is shared.
    pub(crate) fn matmul(
        &mut self,
        frame: &Frame,
        va: &Value,
        sa: Span,
        vb: &Value,
        sb: Span,
        span: Span,
    ) -> R<NodeId> {
        let (Value::Tensor(a), Value::Tensor(b)) = (va, vb) else {
            let (bad, s) = if matches!(va, Value::Tensor(_)) {
                (vb, sb)
            } else {
                (va, sa)
            };
            return Err(Diag::new(
                "kiln::type",
                format!("`@` multiplies tensors, not {}", bad.kind()),
            )
            .at(s, format!("this is {}", bad.kind()))
            .help("scale with `*` instead"));
        };
        let (ya, yb) = (self.ty(*a), self.ty(*b));
        let (ra, rb) = (ya.shape.rank(), yb.shape.rank());
        if ra < 2 || rb < 2 {
            let (t, s) = if ra < 2 { (&ya, sa) } else { (&yb, sb) };
            return Err(Diag::new(
                "kiln::shape",
                format!("`@` needs operands with at least two axes, got {t}"),
            )
            .at(s, format!("this is {t}"))
            .help("reshape it to a matrix, e.g. `reshape(x, [1, n])`"));
        }
        let k1 = &ya.shape.dims()[ra - 1];
        let k2 = &yb.shape.dims()[rb - 2];
        if k1 != k2 {
            return Err(Diag::new(
                "kiln::shape",
                format!("shape mismatch: cannot multiply {} by {}: inner dims {k1} and {k2} differ", ya, yb),
            )
            .at(sa, format!("this is {ya}"))
            .label(sb, format!("this is {yb}"))
            .help("the last axis of the left operand must equal the second-to-last axis of the right one"));
        }
        if rb == 2 {
            return self.node(frame, Op::MatMul, &[*a, *b], span);
        }
        let batch_a = Shape(ya.shape.dims()[..ra - 2].to_vec());
        let batch_b = Shape(yb.shape.dims()[..rb - 2].to_vec());
        let Some(batch) = broadcast_shapes(&batch_a, &batch_b) else {
            return Err(Diag::new(
                "kiln::shape",
                format!(
                    "shape mismatch: cannot multiply {} by {}: batch dims {} and {} differ",
                    ya, yb, batch_a, batch_b
                ),
            )
            .at(sa, format!("this is {ya}"))
            .label(sb, format!("this is {yb}")));
        };
        let mut full_a = batch.0.clone();
        full_a.extend(ya.shape.dims()[ra - 2..].iter().cloned());
        let mut full_b = batch.0.clone();
        full_b.extend(yb.shape.dims()[rb - 2..].iter().cloned());
        let ba = self.broadcast(frame, *a, &Shape(full_a), sa)?;
        let bb = self.broadcast(frame, *b, &Shape(full_b), sb)?;
        self.node(frame, Op::MatMul, &[ba, bb], span)
    }

    // --------------------------------------------------------------- calls

    fn call(
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

    fn call_layer(
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
            let r = self.bind_hyper(&def.name.name, &def.params, hyper, callee_span, &mut tmp);
            self.stack.pop();
            r.map_err(|mut d| {
                if d.stack.is_empty() {
                    d.stack = self.stack.clone();
                    d.stack.push((def.name.name.clone(), span));
                }
                d
            })?
        };
        let p = Rc::new(Partial {
            layer: def.clone(),
            hyper: bound,
            repeat: None,
        });
        if tensors.is_empty() && !def.tensor_params.is_empty() {
            return Ok(Value::Partial(p));
        }
        let inst = self.anon_instance(frame, site, &p);
        self.apply(&inst, tensors, span)
    }

    /// The instance a call site makes inside `frame`'s instance (made once, then reused).
    fn anon_instance(&mut self, frame: &mut Frame, site: u32, p: &Rc<Partial>) -> Rc<Instance> {
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

    /// Binds hyper-parameters: given values (type-checked), then defaults in order.
    pub(crate) fn bind_hyper(
        &mut self,
        owner: &str,
        params: &[HyperParam],
        given: Vec<EArg>,
        call_span: Span,
        frame: &mut Frame,
    ) -> R<Vec<(String, Value)>> {
        let mut out: Vec<(String, Value)> = Vec::new();
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
                    Some(d) => {
                        for (k, v) in &out {
                            frame.vars.insert(k.clone(), v.clone());
                        }
                        let v = self.eval(frame, d)?;
                        check_type(p, v, d.span)?
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
        Ok(out)
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

    fn apply_body(
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
            let d = if n == 0 {
                let names: Vec<String> = def
                    .params
                    .iter()
                    .map(|p| format!("{} = ...", p.name.name))
                    .collect();
                Diag::new(
                    "kiln::argument",
                    format!("layer `{}` takes no tensor arguments", def.name.name),
                )
                .at(extra.span, "unexpected argument")
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
                .at(extra.span, "one too many")
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
            };
            return Err(d);
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
                Value::Tensor(id) => {
                    if let Some(pat) = &tp.ty {
                        self.match_pattern(&mut frame, def, tp, pat, *id, aspan)?;
                    }
                }
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
    fn match_pattern(
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
    fn anon_names(&mut self, body: &Block) -> Rc<HashMap<u32, String>> {
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
fn check_type(p: &HyperParam, v: Value, span: Span) -> R<Value> {
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

fn int_op(op: BinOp, x: i64, y: i64, ta: &str, tb: &str, sb: Span, span: Span) -> R<Value> {
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
        BinOp::Eq => Value::Bool(x == y),
        BinOp::Ne => Value::Bool(x != y),
        BinOp::Lt => Value::Bool(x < y),
        BinOp::Le => Value::Bool(x <= y),
        BinOp::Gt => Value::Bool(x > y),
        BinOp::Ge => Value::Bool(x >= y),
        BinOp::MatMul => {
            return Err(
                Diag::new("kiln::type", "`@` multiplies tensors, not numbers")
                    .at(span, "")
                    .help("use `*` for numbers"),
            )
        }
        BinOp::And | BinOp::Or => unreachable!("handled before"),
    })
}

/// Divisors of `x` closest to `y` (one below, one above), found by trial division up to
/// `√x`, so at most 2²⁰ steps (`x` up to 2⁴⁰; none suggested beyond).
fn divisors_near(x: i64, y: i64) -> Vec<i64> {
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

fn float_op(op: BinOp, x: f64, y: f64, tb: &str, sb: Span, span: Span) -> R<Value> {
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
        BinOp::Eq => return Ok(Value::Bool(x == y)),
        BinOp::Ne => return Ok(Value::Bool(x != y)),
        BinOp::Lt => return Ok(Value::Bool(x < y)),
        BinOp::Le => return Ok(Value::Bool(x <= y)),
        BinOp::Gt => return Ok(Value::Bool(x > y)),
        BinOp::Ge => return Ok(Value::Bool(x >= y)),
        BinOp::MatMul => {
            return Err(
                Diag::new("kiln::type", "`@` multiplies tensors, not numbers")
                    .at(span, "")
                    .help("use `*` for numbers"),
            )
        }
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

#[cfg(test)]
mod tests {
    use super::divisors_near;

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
