//! Syntax errors people can act on: pest's complaint turned into a diagnostic, an
//! unbalanced bracket or an unterminated string found at its opening, bracket nesting
//! bounded before pest recurses, and names outside ASCII.

use pest::error::InputLocation;

use crate::diagnostics::Diag;
use crate::source::Span;

use super::*;

/// How deeply brackets may nest, and how many operators one expression may have: far
/// beyond any real spec, and low enough that parsing and elaboration (which recurse)
/// never exhaust the stack.
pub const MAX_NESTING: usize = 64;
pub const MAX_OPERATORS: usize = 256;

/// What the bracket scanner sees outside comments and strings.
pub(super) enum Token {
    Bracket(usize, u8),
    /// A string opened at this offset and not closed on its line.
    OpenString(usize),
}

/// The brackets of `text` outside comments and strings, in order; stops at an
/// unterminated string. Iterative, so any input is safe to scan.
pub(super) fn scan_brackets(text: &str) -> Vec<Token> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'"' => {
                let start = i;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' && bytes[i] != b'\n' {
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                if i >= bytes.len() || bytes[i] == b'\n' {
                    out.push(Token::OpenString(start));
                    return out;
                }
            }
            c @ (b'(' | b'[' | b'{' | b')' | b']' | b'}') => out.push(Token::Bracket(i, c)),
            _ => {}
        }
        i += 1;
    }
    out
}

pub(super) fn nesting_check(file: u32, text: &str) -> Result<(), (usize, Diag)> {
    let mut depth = 0usize;
    for t in scan_brackets(text) {
        let Token::Bracket(i, c) = t else { break };
        if matches!(c, b'(' | b'[' | b'{') {
            depth += 1;
            if depth > MAX_NESTING {
                return Err((
                    i,
                    Diag::new(
                        "kiln::too-deep",
                        format!("brackets nest more than {MAX_NESTING} deep"),
                    )
                    .at(Span::new(file, i, i + 1), format!("nesting level {depth}"))
                    .help("name intermediate results instead of nesting them"),
                ));
            }
        } else {
            depth = depth.saturating_sub(1);
        }
    }
    Ok(())
}

/// Turns a pest error into a diagnostic people can act on.
pub(super) fn parse_error(file: u32, text: &str, e: pest::error::Error<Rule>) -> Diag {
    let pos = match e.location {
        InputLocation::Pos(p) => p,
        InputLocation::Span((s, _)) => s,
    };
    if let Some((at, d)) = bracket_error(file, text) {
        // An unclosed bracket that opens before the parser's complaint, or a stray closer
        // the parser got as far as, explains the error better than the parser can.
        if at <= pos {
            return d;
        }
    }
    if let Some(d) = non_ascii_name(file, text, pos) {
        return d;
    }
    let found = found_token(text, pos);
    let expected = match &e.variant {
        pest::error::ErrorVariant::ParsingError { positives, .. } => describe(positives),
        pest::error::ErrorVariant::CustomError { message } => message.clone(),
    };
    let end = (pos + found_len(text, pos)).min(text.len());
    let msg = if expected.is_empty() {
        format!("unexpected {found}")
    } else {
        format!("expected {expected}, found {found}")
    };
    let mut d =
        Diag::new("kiln::syntax", msg).at(Span::new(file, pos, end), format!("unexpected {found}"));
    if pos == 0 && !text.trim_start().starts_with(['m', 'l', 'i', '#']) {
        d = d.help("a spec is a list of `model`, `layer` and `import` items");
    } else if text[..pos].trim_end().ends_with('=') && !text[..pos].trim_end().ends_with("==") {
        d = d.help("a named argument needs a value, as in `h = 8`");
    } else if text[pos..].starts_with('=') && !text[pos..].starts_with("==") {
        d = d.help("`=` binds a name (`x = ...`) or a named argument (`h = 8`); compare with `==`");
    }
    d
}

/// A name with a letter outside ASCII where the parser stopped (`größe`, `é`): the
/// grammar's names are ASCII, so pest reports only the byte it could not take.
pub(super) fn non_ascii_name(file: u32, text: &str, pos: usize) -> Option<Diag> {
    let c = text.get(pos..)?.chars().next()?;
    if c.is_ascii() || !c.is_alphanumeric() {
        return None;
    }
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let start = text[..pos]
        .char_indices()
        .rev()
        .take_while(|&(_, c)| word(c))
        .last()
        .map_or(pos, |(i, _)| i);
    let end = text[pos..]
        .char_indices()
        .find(|&(_, c)| !word(c))
        .map_or(text.len(), |(i, _)| pos + i);
    let name = &text[start..end];
    Some(
        Diag::new(
            "kiln::syntax",
            format!("`{name}` is not a name: names are ASCII letters, digits and `_`"),
        )
        .at(Span::new(file, start, end), format!("`{c}` is not ASCII"))
        .help("rename it with ASCII letters (`e` for `é`, `ss` for `ß`, …)"),
    )
}

/// Unbalanced `(`, `[` or `{` (comments and strings skipped): the most common cause of a
/// parse error, and one whose real location is the opening bracket, not the end of file.
pub(super) fn bracket_error(file: u32, text: &str) -> Option<(usize, Diag)> {
    let mut stack: Vec<(u8, usize)> = Vec::new();
    for t in scan_brackets(text) {
        let (i, c) = match t {
            Token::OpenString(start) => {
                return Some((
                    start,
                    Diag::new("kiln::syntax", "unterminated string")
                        .at(
                            Span::new(file, start, start + 1),
                            "this string is never closed",
                        )
                        .help("close it with `\"` on the same line"),
                ))
            }
            Token::Bracket(i, c) => (i, c),
        };
        if matches!(c, b'(' | b'[' | b'{') {
            stack.push((c, i));
            continue;
        }
        let want = match c {
            b')' => b'(',
            b']' => b'[',
            _ => b'{',
        };
        match stack.pop() {
            Some((open, _)) if open == want => {}
            Some((open, at)) => {
                let (line, _) = line_of(text, i);
                return Some((
                    at,
                    Diag::new(
                        "kiln::syntax",
                        format!(
                            "unclosed `{}`: the `{}` on line {line} comes before its `{}`",
                            open as char,
                            c as char,
                            closer(open)
                        ),
                    )
                    .at(
                        Span::new(file, at, at + 1),
                        format!("this `{}` is never closed", open as char),
                    )
                    .label(
                        Span::new(file, i, i + 1),
                        format!("`{}` found here", c as char),
                    )
                    .help(format!(
                        "add `{}` where the `{}` should end",
                        closer(open),
                        open as char
                    )),
                ));
            }
            None => {
                return Some((
                    i,
                    Diag::new("kiln::syntax", format!("unmatched `{}`", c as char))
                        .at(Span::new(file, i, i + 1), "nothing to close here")
                        .help("remove it, or add the opening bracket it belongs to"),
                ))
            }
        }
    }
    let (open, at) = stack.pop()?;
    let what = if open == b'{' { "block" } else { "bracket" };
    let (line, _) = line_of(text, at);
    Some((
        at,
        Diag::new(
            "kiln::unterminated",
            format!(
                "unterminated {what}: `{}` on line {line} is never closed",
                open as char
            ),
        )
        .at(
            Span::new(file, at, at + 1),
            format!("this `{}` has no matching `{}`", open as char, closer(open)),
        )
        .help(format!("add `{}` where it should end", closer(open))),
    ))
}

/// Length of `text` without trailing whitespace and trailing `#` comments.
pub(super) fn trimmed_len(text: &str) -> usize {
    let mut t = text.trim_end();
    loop {
        let line_start = t.rfind('\n').map(|i| i + 1).unwrap_or(0);
        let line = &t[line_start..];
        let mut in_str = false;
        let mut cut = None;
        let mut prev = '\0';
        for (i, c) in line.char_indices() {
            match c {
                '"' if prev != '\\' => in_str = !in_str,
                '#' if !in_str => {
                    cut = Some(i);
                    break;
                }
                _ => {}
            }
            prev = c;
        }
        match cut {
            Some(i) => t = t[..line_start + i].trim_end(),
            None => return t.len(),
        }
    }
}

pub(super) fn closer(open: u8) -> char {
    match open {
        b'(' => ')',
        b'[' => ']',
        _ => '}',
    }
}

pub(super) fn line_of(text: &str, pos: usize) -> (usize, usize) {
    let before = &text[..pos.min(text.len())];
    let line = before.matches('\n').count() + 1;
    (
        line,
        pos - before.rfind('\n').map(|i| i + 1).unwrap_or(0) + 1,
    )
}

pub(super) fn found_len(text: &str, pos: usize) -> usize {
    let rest = &text[pos.min(text.len())..];
    let word: usize = rest
        .char_indices()
        .take_while(|(_, c)| c.is_alphanumeric() || *c == '_')
        .map(|(i, c)| i + c.len_utf8())
        .last()
        .unwrap_or(0);
    if word > 0 {
        word.min(40)
    } else {
        rest.chars().next().map(|c| c.len_utf8()).unwrap_or(0)
    }
}

pub(super) fn found_token(text: &str, pos: usize) -> String {
    let n = found_len(text, pos);
    if n == 0 {
        return "end of file".to_string();
    }
    let tok = &text[pos..pos + n];
    match tok {
        "\n" => "end of line".to_string(),
        t if t.chars().all(|c| c.is_control() || c == '\u{fffd}') => {
            format!("character {:?}", t)
        }
        t => format!("`{t}`"),
    }
}

/// Human names for what the parser expected, deduplicated and in a stable order.
pub(super) fn describe(rules: &[Rule]) -> String {
    let mut names: Vec<&'static str> = Vec::new();
    let mut operator = false;
    for r in rules {
        let name = match r {
            Rule::EOI => "end of file",
            Rule::file => "`model`, `layer` or `import`",
            Rule::import | Rule::kw_import => "`import`",
            Rule::model_def | Rule::kw_model => "`model`",
            Rule::layer_def | Rule::kw_layer => "`layer`",
            Rule::model_full => "`(`",
            Rule::model_alias => "`=`",
            Rule::hyper_params | Rule::hyper_param => "a parameter",
            Rule::tensor_params => "`(`",
            Rule::tensor_param => "a tensor argument",
            Rule::tensor_type | Rule::shape_list => "a tensor type such as `f32[batch, 512]`",
            Rule::dtype => "an element type",
            Rule::type_name => "a type",
            Rule::shape_item | Rule::ellipsis => "a dim",
            Rule::block => "`{`",
            Rule::stmt
            | Rule::dims_stmt
            | Rule::input_stmt
            | Rule::output_stmt
            | Rule::objective_stmt
            | Rule::stage_stmt
            | Rule::param_stmt
            | Rule::check_stmt
            | Rule::return_stmt
            | Rule::assign_stmt
            | Rule::expr_stmt => "a statement",
            Rule::expr
            | Rule::postfix
            | Rule::primary
            | Rule::paren
            | Rule::list
            | Rule::if_expr => "an expression",
            Rule::neg | Rule::not | Rule::kw_not => "an expression",
            Rule::or
            | Rule::and
            | Rule::eq
            | Rule::ne
            | Rule::le
            | Rule::ge
            | Rule::lt
            | Rule::gt
            | Rule::add
            | Rule::sub
            | Rule::matmul
            | Rule::pow
            | Rule::mul
            | Rule::div
            | Rule::rem
            | Rule::kw_and
            | Rule::kw_or => {
                operator = true;
                continue;
            }
            Rule::call => "`(`",
            Rule::field => "`.`",
            Rule::args | Rule::arg | Rule::named_arg => "an argument",
            Rule::number => "a number",
            Rule::string | Rule::str_inner => "a string",
            Rule::ident | Rule::keyword => "a name",
            Rule::kw_dims => "`dims`",
            Rule::kw_input => "`input`",
            Rule::kw_output => "`output`",
            Rule::kw_objective => "`objective`",
            Rule::kw_stage => "`stage`",
            Rule::kw_param => "`param`",
            Rule::kw_check => "`check`",
            Rule::kw_return => "`return`",
            Rule::kw_init => "`init`",
            Rule::kw_if => "`if`",
            Rule::kw_else => "`else`",
            Rule::kw_true | Rule::kw_false => "a boolean",
            Rule::kw_none => "`none`",
            _ => continue,
        };
        if !names.contains(&name) {
            names.push(name);
        }
    }
    if operator {
        names.push("an operator");
    }
    match names.len() {
        0 => String::new(),
        1 => names[0].to_string(),
        n => format!("{} or {}", names[..n - 1].join(", "), names[n - 1]),
    }
}
