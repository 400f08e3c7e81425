//! The abstract syntax tree of a kiln spec.
//!
//! In: nothing (plain data). Out: the types the parser ([`crate::parser`]) produces and
//! the elaborator ([`crate::elaborate`]) consumes. Every node carries a [`Span`] into its
//! source file so that any later error can point at the exact text.

use crate::source::Span;
pub use kiln_ir::ir::CmpOp;

#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// A parsed file.
#[derive(Clone, Debug, Default)]
pub struct File {
    pub items: Vec<Item>,
}

#[derive(Clone, Debug)]
pub enum Item {
    Import { path: String, span: Span },
    Model(ModelDef),
    Layer(LayerDef),
}

#[derive(Clone, Debug)]
pub struct ModelDef {
    pub name: Ident,
    pub kind: ModelKind,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub enum ModelKind {
    /// `model name(params) { body }`
    Full {
        params: Vec<HyperParam>,
        body: Block,
    },
    /// `model name = base(overrides) { extra statements }`
    Alias {
        base: Ident,
        args: Vec<Arg>,
        extra: Option<Block>,
    },
}

#[derive(Clone, Debug)]
pub struct LayerDef {
    pub name: Ident,
    pub params: Vec<HyperParam>,
    /// The tensor arguments; `None` when the definition has no second parameter list.
    pub tensor_params: Vec<TensorParam>,
    pub body: Block,
    pub span: Span,
}

/// A hyper-parameter: `h: int = 8`.
#[derive(Clone, Debug)]
pub struct HyperParam {
    pub name: Ident,
    pub ty: Option<Ident>,
    pub default: Option<Expr>,
}

/// A tensor argument: `x: f32[..., d_model]`, optionally `= none`.
#[derive(Clone, Debug)]
pub struct TensorParam {
    pub name: Ident,
    pub ty: Option<TensorTypeExpr>,
    pub optional: bool,
}

/// `f32[batch, src_len]`, `[..., d]`.
#[derive(Clone, Debug)]
pub struct TensorTypeExpr {
    pub dtype: Option<Ident>,
    pub dims: Vec<ShapeItem>,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub enum ShapeItem {
    Ellipsis(Span),
    Expr(Expr),
}

#[derive(Clone, Debug)]
pub struct Block {
    pub stmts: Vec<Stmt>,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub struct Stmt {
    pub kind: StmtKind,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub enum StmtKind {
    Dims(Vec<Ident>),
    Input(Ident, TensorTypeExpr),
    Output(Ident, Option<Expr>),
    Objective(Ident, Option<Expr>),
    /// `stage memory = encoder(...)`: where the `encode` entry point stops and
    /// `decode_step` starts (there it is an input).
    Stage(Ident, Expr),
    Param {
        name: Ident,
        ty: TensorTypeExpr,
        init: Option<Expr>,
    },
    Check {
        cond: Expr,
        message: Option<String>,
    },
    Return(Expr),
    Assign(Ident, Expr),
    Expr(Expr),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnOp {
    Neg,
    Not,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Or,
    And,
    /// A comparison: the IR's own operator.
    Cmp(CmpOp),
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    MatMul,
    Pow,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Or => "or",
            BinOp::And => "and",
            BinOp::Cmp(c) => c.symbol(),
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Rem => "%",
            BinOp::MatMul => "@",
            BinOp::Pow => "**",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

/// A call argument: positional (`x`) or named (`h = 8`).
#[derive(Clone, Debug)]
pub struct Arg {
    pub name: Option<Ident>,
    pub value: Expr,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub enum ExprKind {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    None,
    Var(String),
    List(Vec<Expr>),
    Unary(UnOp, Box<Expr>),
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `callee(args)`; `site` is unique per call in the whole program (it keys the
    /// anonymous layer instance a call creates).
    Call {
        callee: Box<Expr>,
        args: Vec<Arg>,
        site: u32,
    },
    Field(Box<Expr>, Ident),
    If {
        cond: Box<Expr>,
        then: Block,
        otherwise: Option<Box<Else>>,
    },
}

#[derive(Clone, Debug)]
pub enum Else {
    If(Expr),
    Block(Block),
}

impl Expr {
    /// Visits this expression and every expression inside it, in source order.
    pub fn walk<'a>(&'a self, f: &mut dyn FnMut(&'a Expr)) {
        f(self);
        match &self.kind {
            ExprKind::List(items) => items.iter().for_each(|e| e.walk(f)),
            ExprKind::Unary(_, e) | ExprKind::Field(e, _) => e.walk(f),
            ExprKind::Binary(_, a, b) => {
                a.walk(f);
                b.walk(f);
            }
            ExprKind::Call { callee, args, .. } => {
                callee.walk(f);
                args.iter().for_each(|a| a.value.walk(f));
            }
            ExprKind::If {
                cond,
                then,
                otherwise,
            } => {
                cond.walk(f);
                then.walk(f);
                match otherwise.as_deref() {
                    Some(Else::If(e)) => e.walk(f),
                    Some(Else::Block(b)) => b.walk(f),
                    None => {}
                }
            }
            _ => {}
        }
    }
}

impl Block {
    /// Visits every expression in the block, in source order.
    pub fn walk<'a>(&'a self, f: &mut dyn FnMut(&'a Expr)) {
        for s in &self.stmts {
            match &s.kind {
                StmtKind::Dims(_) | StmtKind::Input(..) => {}
                StmtKind::Output(_, e) | StmtKind::Objective(_, e) => {
                    if let Some(e) = e {
                        e.walk(f)
                    }
                }
                StmtKind::Param { ty, init, .. } => {
                    ty.walk(f);
                    if let Some(e) = init {
                        e.walk(f)
                    }
                }
                StmtKind::Check { cond, .. } => cond.walk(f),
                StmtKind::Return(e)
                | StmtKind::Assign(_, e)
                | StmtKind::Stage(_, e)
                | StmtKind::Expr(e) => e.walk(f),
            }
        }
    }
}

impl TensorTypeExpr {
    pub fn walk<'a>(&'a self, f: &mut dyn FnMut(&'a Expr)) {
        for d in &self.dims {
            if let ShapeItem::Expr(e) = d {
                e.walk(f)
            }
        }
    }
}
