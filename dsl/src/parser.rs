//! Parsing: text → AST.
//!
//! In: one source file of the [`SourceMap`](crate::source::SourceMap). Out: an [`ast::File`](crate::ast::File), or a [`Diag`] that
//! points at the first problem. The grammar lives in `grammar.pest`; operator precedence
//! is resolved by pest's Pratt parser. Parse errors are rewritten for people: unbalanced
//! brackets are reported at the bracket that was never closed, pest's rule names become
//! "an expression", "`{`", …, and two statements on one line without `;` are caught here.

use std::cell::Cell;

use pest::error::InputLocation;
use pest::iterators::Pair;
use pest::pratt_parser::{Assoc, Op, PrattParser};
use pest::Parser as _;
use pest_derive::Parser;

use crate::ast::*;
use crate::diagnostics::Diag;
use crate::source::Span;

mod syntax_errors;

pub use syntax_errors::MAX_NESTING;
use syntax_errors::*;

#[derive(Parser)]
#[grammar = "grammar.pest"]
struct Grammar;

type PResult<T> = Result<T, Diag>;

/// Parses a whole file. `next_site` numbers call sites across files.
pub fn parse_file(file: u32, text: &str, next_site: &Cell<u32>) -> PResult<File> {
    if let Err((at, deep)) = nesting_check(file, text) {
        // Parse what comes before the deep part: an earlier syntax error explains more.
        if let Err(e) = Grammar::parse(Rule::file, &text[..at]) {
            let pos = match e.location {
                InputLocation::Pos(p) => p,
                InputLocation::Span((s, _)) => s,
            };
            if pos < at.saturating_sub(1) && !text[pos..at].trim().is_empty() {
                let d = parse_error(file, text, e);
                if d.span.is_some_and(|s| (s.start as usize) < at) {
                    return Err(d);
                }
            }
        }
        return Err(deep);
    }
    let mut pairs = match Grammar::parse(Rule::file, text) {
        Ok(p) => p,
        Err(e) => return Err(parse_error(file, text, e)),
    };
    let long = pairs
        .clone()
        .flatten()
        .find(|x| x.as_rule() == Rule::ident && x.as_str().chars().count() > MAX_NAME_CHARS);
    if let Some(name) = long {
        let s = name.as_span();
        return Err(Diag::new(
            "kiln::syntax",
            format!(
                "a name of {} characters; names have at most {MAX_NAME_CHARS}",
                name.as_str().chars().count()
            ),
        )
        .at(
            Span::new(file, s.start(), s.start() + 1),
            "this name starts here",
        )
        .help("use a shorter name"));
    }
    let p = Parser {
        file,
        text,
        site: next_site,
        pratt: pratt(),
    };
    let top = pairs
        .next()
        .expect("a successful parse yields the file rule");
    let mut items = Vec::new();
    for item in top.into_inner() {
        match item.as_rule() {
            Rule::import => {
                let span = p.span(&item);
                let s = item
                    .into_inner()
                    .find(|x| x.as_rule() == Rule::string)
                    .expect("import has a string");
                items.push(Item::Import {
                    path: p.string(s)?,
                    span,
                });
            }
            Rule::model_def => items.push(Item::Model(p.model(item)?)),
            Rule::layer_def => items.push(Item::Layer(p.layer(item)?)),
            Rule::EOI => {}
            r => unreachable!("unexpected top-level rule {r:?}"),
        }
    }
    Ok(File { items })
}

fn pratt() -> PrattParser<Rule> {
    PrattParser::new()
        .op(Op::infix(Rule::or, Assoc::Left))
        .op(Op::infix(Rule::and, Assoc::Left))
        .op(Op::prefix(Rule::not))
        .op(Op::infix(Rule::eq, Assoc::Left)
            | Op::infix(Rule::ne, Assoc::Left)
            | Op::infix(Rule::lt, Assoc::Left)
            | Op::infix(Rule::le, Assoc::Left)
            | Op::infix(Rule::gt, Assoc::Left)
            | Op::infix(Rule::ge, Assoc::Left))
        .op(Op::infix(Rule::add, Assoc::Left) | Op::infix(Rule::sub, Assoc::Left))
        .op(Op::infix(Rule::mul, Assoc::Left)
            | Op::infix(Rule::div, Assoc::Left)
            | Op::infix(Rule::rem, Assoc::Left)
            | Op::infix(Rule::matmul, Assoc::Left))
        .op(Op::prefix(Rule::neg))
        .op(Op::infix(Rule::pow, Assoc::Right))
}

struct Parser<'t> {
    file: u32,
    text: &'t str,
    site: &'t Cell<u32>,
    pratt: PrattParser<Rule>,
}

impl<'t> Parser<'t> {
    /// The span of a pair without the whitespace and comments pest's implicit
    /// whitespace rule may have consumed after it.
    fn span(&self, p: &Pair<Rule>) -> Span {
        let s = p.as_span();
        Span::new(
            self.file,
            s.start(),
            s.start() + trimmed_len(&self.text[s.start()..s.end()]),
        )
    }

    fn ident(&self, p: Pair<Rule>) -> Ident {
        debug_assert!(matches!(p.as_rule(), Rule::ident | Rule::dtype));
        Ident {
            name: p.as_str().to_string(),
            span: self.span(&p),
        }
    }

    fn string(&self, p: Pair<Rule>) -> PResult<String> {
        let span = self.span(&p);
        let raw = p.into_inner().next().map(|i| i.as_str()).unwrap_or("");
        let mut out = String::new();
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                match chars.next() {
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some('\\') => out.push('\\'),
                    Some('"') => out.push('"'),
                    other => {
                        return Err(Diag::new(
                            "kiln::syntax",
                            format!(
                                "unknown escape `\\{}` in string",
                                other.map(String::from).unwrap_or_default()
                            ),
                        )
                        .at(span, "in this string")
                        .help("the escapes are \\n, \\t, \\\\ and \\\""))
                    }
                }
            } else {
                out.push(c);
            }
        }
        Ok(out)
    }

    fn model(&self, p: Pair<Rule>) -> PResult<ModelDef> {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        inner.next(); // kw_model
        let name = self.ident(inner.next().expect("model name"));
        let body = inner.next().expect("model body");
        let kind = match body.as_rule() {
            Rule::model_full => {
                let mut params = Vec::new();
                let mut block = None;
                for x in body.into_inner() {
                    match x.as_rule() {
                        Rule::hyper_params => params = self.hyper_params(x)?,
                        Rule::block => block = Some(self.block(x)?),
                        r => unreachable!("model_full: {r:?}"),
                    }
                }
                ModelKind::Full {
                    params,
                    body: block.expect("model block"),
                }
            }
            Rule::model_alias => {
                let mut inner = body.into_inner();
                let base = self.ident(inner.next().expect("alias base"));
                let mut args = Vec::new();
                let mut extra = None;
                for x in inner {
                    match x.as_rule() {
                        Rule::args => args = self.args(x)?,
                        Rule::block => extra = Some(self.block(x)?),
                        r => unreachable!("model_alias: {r:?}"),
                    }
                }
                ModelKind::Alias { base, args, extra }
            }
            r => unreachable!("model: {r:?}"),
        };
        Ok(ModelDef { name, kind, span })
    }

    fn layer(&self, p: Pair<Rule>) -> PResult<LayerDef> {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        inner.next(); // kw_layer
        let name = self.ident(inner.next().expect("layer name"));
        let mut params = Vec::new();
        let mut tensor_params = Vec::new();
        let mut body = None;
        for x in inner {
            match x.as_rule() {
                Rule::hyper_params => params = self.hyper_params(x)?,
                Rule::tensor_params => {
                    for tp in x.into_inner() {
                        tensor_params.push(self.tensor_param(tp)?);
                    }
                }
                Rule::block => body = Some(self.block(x)?),
                r => unreachable!("layer: {r:?}"),
            }
        }
        Ok(LayerDef {
            name,
            params,
            tensor_params,
            body: body.expect("layer body"),
            span,
        })
    }

    fn hyper_params(&self, p: Pair<Rule>) -> PResult<Vec<HyperParam>> {
        p.into_inner()
            .map(|hp| {
                let mut inner = hp.into_inner();
                let name = self.ident(inner.next().expect("param name"));
                let mut ty = None;
                let mut default = None;
                for x in inner {
                    match x.as_rule() {
                        Rule::type_name => {
                            ty = Some(Ident {
                                name: x.as_str().to_string(),
                                span: self.span(&x),
                            })
                        }
                        Rule::expr => default = Some(self.expr(x)?),
                        r => unreachable!("hyper_param: {r:?}"),
                    }
                }
                Ok(HyperParam { name, ty, default })
            })
            .collect()
    }

    fn tensor_param(&self, p: Pair<Rule>) -> PResult<TensorParam> {
        let mut inner = p.into_inner();
        let name = self.ident(inner.next().expect("tensor param name"));
        let mut ty = None;
        let mut optional = false;
        for x in inner {
            match x.as_rule() {
                Rule::tensor_type => ty = Some(self.tensor_type(x)?),
                Rule::kw_none => optional = true,
                r => unreachable!("tensor_param: {r:?}"),
            }
        }
        Ok(TensorParam { name, ty, optional })
    }

    fn tensor_type(&self, p: Pair<Rule>) -> PResult<TensorTypeExpr> {
        let span = self.span(&p);
        let mut dtype = None;
        let mut dims = Vec::new();
        for x in p.into_inner() {
            match x.as_rule() {
                Rule::dtype => dtype = Some(self.ident(x)),
                Rule::shape_list => {
                    for item in x.into_inner() {
                        let inner = item.into_inner().next().expect("shape item");
                        dims.push(match inner.as_rule() {
                            Rule::ellipsis => ShapeItem::Ellipsis(self.span(&inner)),
                            Rule::expr => ShapeItem::Expr(self.expr(inner)?),
                            r => unreachable!("shape item: {r:?}"),
                        });
                    }
                }
                r => unreachable!("tensor_type: {r:?}"),
            }
        }
        Ok(TensorTypeExpr { dtype, dims, span })
    }

    fn block(&self, p: Pair<Rule>) -> PResult<Block> {
        let span = self.span(&p);
        let mut stmts: Vec<Stmt> = Vec::new();
        for s in p.into_inner() {
            let stmt = self.stmt(s)?;
            if let Some(prev) = stmts.last() {
                let between = &self.text[prev.span.end as usize..stmt.span.start as usize];
                if !between.contains(['\n', ';']) {
                    let starts_paren = self.text[stmt.span.start as usize..].starts_with('(');
                    let mut d = Diag::new("kiln::syntax", "two statements on one line")
                        .at(stmt.span, "a second statement starts here")
                        .label(prev.span, "this statement ends here");
                    d = if starts_paren {
                        d.help("to call something, write `name(...)` with no space before `(`")
                    } else {
                        d.help("put each statement on its own line, or separate them with `;`")
                    };
                    return Err(d);
                }
            }
            stmts.push(stmt);
        }
        Ok(Block { stmts, span })
    }

    fn stmt(&self, p: Pair<Rule>) -> PResult<Stmt> {
        let span = self.span(&p);
        let s = p.into_inner().next().expect("stmt kind");
        let rule = s.as_rule();
        let mut inner = s.into_inner();
        let kind = match rule {
            Rule::dims_stmt => {
                inner.next();
                StmtKind::Dims(inner.map(|i| self.ident(i)).collect())
            }
            Rule::input_stmt => {
                inner.next();
                let name = self.ident(inner.next().expect("input name"));
                let ty = self.tensor_type(inner.next().expect("input type"))?;
                StmtKind::Input(name, ty)
            }
            Rule::output_stmt | Rule::objective_stmt => {
                inner.next();
                let name = self.ident(inner.next().expect("output name"));
                let e = inner.next().map(|e| self.expr(e)).transpose()?;
                if rule == Rule::output_stmt {
                    StmtKind::Output(name, e)
                } else {
                    StmtKind::Objective(name, e)
                }
            }
            Rule::stage_stmt => {
                inner.next();
                let name = self.ident(inner.next().expect("stage name"));
                StmtKind::Stage(name, self.expr(inner.next().expect("stage value"))?)
            }
            Rule::param_stmt => {
                inner.next();
                let name = self.ident(inner.next().expect("param name"));
                let ty = self.tensor_type(inner.next().expect("param type"))?;
                let mut init = None;
                for x in inner {
                    if x.as_rule() == Rule::expr {
                        init = Some(self.expr(x)?);
                    }
                }
                StmtKind::Param { name, ty, init }
            }
            Rule::check_stmt => {
                inner.next();
                let cond = self.expr(inner.next().expect("check condition"))?;
                let message = inner.next().map(|s| self.string(s)).transpose()?;
                StmtKind::Check { cond, message }
            }
            Rule::return_stmt => {
                inner.next();
                StmtKind::Return(self.expr(inner.next().expect("return value"))?)
            }
            Rule::assign_stmt => {
                let name = self.ident(inner.next().expect("assign target"));
                StmtKind::Assign(name, self.expr(inner.next().expect("assign value"))?)
            }
            Rule::expr_stmt => StmtKind::Expr(self.expr(inner.next().expect("expr"))?),
            r => unreachable!("stmt: {r:?}"),
        };
        Ok(Stmt { kind, span })
    }

    fn expr(&self, p: Pair<Rule>) -> PResult<Expr> {
        debug_assert_eq!(p.as_rule(), Rule::expr);
        let parts = p.clone().into_inner().count();
        if parts > 2 * MAX_OPERATORS {
            return Err(Diag::new(
                "kiln::too-long",
                format!("an expression with more than {MAX_OPERATORS} operators"),
            )
            .at(self.span(&p), format!("{} operators and operands", parts))
            .help("split it into named steps: `a = ...` then `b = a + ...`"));
        }
        self.pratt
            .map_primary(|x| self.postfix(x))
            .map_prefix(|op, rhs| {
                let rhs = rhs?;
                let span = self.span(&op).to(rhs.span);
                let u = match op.as_rule() {
                    Rule::neg => UnOp::Neg,
                    Rule::not => UnOp::Not,
                    r => unreachable!("prefix {r:?}"),
                };
                // Fold negative literals so `-1` is a number, not an operation.
                Ok(match (u, &rhs.kind) {
                    (UnOp::Neg, ExprKind::Int(v)) => Expr {
                        kind: ExprKind::Int(-v),
                        span,
                    },
                    (UnOp::Neg, ExprKind::Float(v)) => Expr {
                        kind: ExprKind::Float(-v),
                        span,
                    },
                    _ => Expr {
                        kind: ExprKind::Unary(u, Box::new(rhs)),
                        span,
                    },
                })
            })
            .map_infix(|lhs, op, rhs| {
                let (lhs, rhs) = (lhs?, rhs?);
                let b = match op.as_rule() {
                    Rule::or => BinOp::Or,
                    Rule::and => BinOp::And,
                    Rule::eq => BinOp::Cmp(CmpOp::Eq),
                    Rule::ne => BinOp::Cmp(CmpOp::Ne),
                    Rule::lt => BinOp::Cmp(CmpOp::Lt),
                    Rule::le => BinOp::Cmp(CmpOp::Le),
                    Rule::gt => BinOp::Cmp(CmpOp::Gt),
                    Rule::ge => BinOp::Cmp(CmpOp::Ge),
                    Rule::add => BinOp::Add,
                    Rule::sub => BinOp::Sub,
                    Rule::mul => BinOp::Mul,
                    Rule::div => BinOp::Div,
                    Rule::rem => BinOp::Rem,
                    Rule::matmul => BinOp::MatMul,
                    Rule::pow => BinOp::Pow,
                    r => unreachable!("infix {r:?}"),
                };
                let span = lhs.span.to(rhs.span);
                Ok(Expr {
                    kind: ExprKind::Binary(b, Box::new(lhs), Box::new(rhs)),
                    span,
                })
            })
            .parse(p.into_inner())
    }

    fn postfix(&self, p: Pair<Rule>) -> PResult<Expr> {
        debug_assert_eq!(p.as_rule(), Rule::postfix);
        let mut inner = p.into_inner();
        let mut e = self.primary(inner.next().expect("primary"))?;
        for suffix in inner {
            let sspan = self.span(&suffix);
            match suffix.as_rule() {
                Rule::call => {
                    let args = match suffix.into_inner().next() {
                        Some(a) => self.args(a)?,
                        None => vec![],
                    };
                    let site = self.site.get();
                    self.site.set(site + 1);
                    let span = e.span.to(sspan);
                    e = Expr {
                        kind: ExprKind::Call {
                            callee: Box::new(e),
                            args,
                            site,
                        },
                        span,
                    };
                }
                Rule::field => {
                    let name = self.ident(suffix.into_inner().next().expect("field name"));
                    let span = e.span.to(sspan);
                    e = Expr {
                        kind: ExprKind::Field(Box::new(e), name),
                        span,
                    };
                }
                r => unreachable!("suffix {r:?}"),
            }
        }
        Ok(e)
    }

    fn args(&self, p: Pair<Rule>) -> PResult<Vec<Arg>> {
        p.into_inner()
            .map(|a| {
                let span = self.span(&a);
                let x = a.into_inner().next().expect("arg");
                match x.as_rule() {
                    Rule::named_arg => {
                        let mut inner = x.into_inner();
                        let name = self.ident(inner.next().expect("arg name"));
                        let value = self.expr(inner.next().expect("arg value"))?;
                        Ok(Arg {
                            name: Some(name),
                            value,
                            span,
                        })
                    }
                    Rule::expr => Ok(Arg {
                        name: None,
                        value: self.expr(x)?,
                        span,
                    }),
                    r => unreachable!("arg {r:?}"),
                }
            })
            .collect()
    }

    fn primary(&self, p: Pair<Rule>) -> PResult<Expr> {
        let x = p.into_inner().next().expect("primary kind");
        let span = self.span(&x);
        let kind = match x.as_rule() {
            Rule::if_expr => return self.if_expr(x),
            Rule::list => {
                let items = x
                    .into_inner()
                    .map(|e| self.expr(e))
                    .collect::<PResult<_>>()?;
                ExprKind::List(items)
            }
            Rule::paren => {
                let mut e = self.expr(x.into_inner().next().expect("paren expr"))?;
                e.span = span;
                return Ok(e);
            }
            Rule::number => self.number(x.as_str(), span)?,
            Rule::string => ExprKind::Str(self.string(x)?),
            Rule::kw_true => ExprKind::Bool(true),
            Rule::kw_false => ExprKind::Bool(false),
            Rule::kw_none => ExprKind::None,
            Rule::ident => ExprKind::Var(x.as_str().to_string()),
            r => unreachable!("primary {r:?}"),
        };
        Ok(Expr { kind, span })
    }

    fn if_expr(&self, p: Pair<Rule>) -> PResult<Expr> {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        inner.next(); // kw_if
        let cond = self.expr(inner.next().expect("if condition"))?;
        let then = self.block(inner.next().expect("if block"))?;
        let mut otherwise = None;
        if inner.next().is_some() {
            // kw_else
            let e = inner.next().expect("else branch");
            otherwise = Some(Box::new(match e.as_rule() {
                Rule::if_expr => Else::If(self.if_expr(e)?),
                Rule::block => Else::Block(self.block(e)?),
                r => unreachable!("else {r:?}"),
            }));
        }
        Ok(Expr {
            kind: ExprKind::If {
                cond: Box::new(cond),
                then,
                otherwise,
            },
            span,
        })
    }

    fn number(&self, text: &str, span: Span) -> PResult<ExprKind> {
        let clean: String = text.chars().filter(|&c| c != '_').collect();
        if clean.contains(['.', 'e', 'E']) {
            match clean.parse::<f64>() {
                Ok(v) if v.is_finite() => Ok(ExprKind::Float(v)),
                _ => Err(
                    Diag::new("kiln::number", format!("`{text}` is not a finite number"))
                        .at(span, "this number"),
                ),
            }
        } else {
            clean.parse::<i64>().map(ExprKind::Int).map_err(|_| {
                Diag::new(
                    "kiln::number",
                    format!("integer `{text}` does not fit in 64 bits"),
                )
                .at(span, "this integer is too large")
                .help(format!("integers range up to {}", i64::MAX))
            })
        }
    }
}

/// Rejects bracket nesting deeper than [`MAX_NESTING`] before pest (which recurses) sees
/// it; the error carries the offset where the limit is crossed.
/// The longest name a spec may use (names are compared and suggested by edit distance,
/// which costs the product of two names' lengths).
pub const MAX_NAME_CHARS: usize = 256;
