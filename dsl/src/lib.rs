//! kiln-dsl: the model language.
//!
//! Pipeline order (see `docs/ARCHITECTURE.md`): [`source`] (files and spans) →
//! [`parser`] (pest grammar in `grammar.pest` → [`ast`]) → [`load`] (imports, the
//! embedded prelude, definition tables, static checks) → [`elaborate`] (an interpreter
//! that builds the IR graph, using [`builtins`] for the primitives) → a
//! [`kiln_ir::Graph`]. Every failure along the way is a [`Error`] built in
//! [`diagnostics`]: file, line, column, the source line with a caret, and a fix.

pub mod ast;
pub mod builtins;
pub mod diagnostics;
pub mod elaborate;
pub mod load;
pub mod parser;
pub mod source;
pub mod values;

use std::path::Path;

use kiln_ir::Graph;

pub use diagnostics::Error;
pub use elaborate::Mode;
use elaborate::Override;
use load::Program;
use source::Span;

/// What to elaborate and how.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `key=value` overrides of model parameters, as given to `--set`.
    pub overrides: Vec<String>,
    pub mode: Mode,
    /// Which model of the file; needed only when the file defines several.
    pub model: Option<String>,
}

/// Compiles the spec at `path` into a checked IR graph.
pub fn compile_file(path: &Path, opts: &Options) -> Result<Graph, Error> {
    let prog = load::load_file(path)?;
    compile_program(prog, opts)
}

/// The text of every file the spec at `path` reads — the embedded prelude, the spec and
/// its imports (transitively), in load order, NUL-separated: what a hash of "the spec"
/// must cover (an edited import or a new prelude is a different model). Paths are left
/// out, so the same files give the same text from any working directory.
pub fn source_text(path: &Path) -> Result<String, Error> {
    let prog = load::load_file(path)?;
    let mut out = String::new();
    for f in prog.sources.files() {
        out.push_str(&f.text);
        out.push('\0');
    }
    Ok(out)
}

/// Compiles spec text; `name` is the file name shown in diagnostics, imports resolve
/// against the current directory.
pub fn compile_str(name: &str, text: &str, opts: &Options) -> Result<Graph, Error> {
    let prog = load::load_text(name, text, None)?;
    compile_program(prog, opts)
}

/// The layer names the prelude defines.
pub fn prelude_layers() -> Result<Vec<String>, Error> {
    let prog = load::load_text("<empty>", "", None)?;
    Ok(prog.layers.keys().cloned().collect())
}

fn compile_program(mut prog: Program, opts: &Options) -> Result<Graph, Error> {
    let overrides = match parse_overrides(&mut prog, &opts.overrides) {
        Ok(o) => o,
        Err(d) => return Err(d.finish(&prog.sources)),
    };
    let model = match pick_model(&prog, opts.model.as_deref()) {
        Ok(m) => m,
        Err(d) => return Err(d.finish(&prog.sources)),
    };
    elaborate::elaborate(&prog, &model, &overrides, opts.mode).map_err(|d| d.finish(&prog.sources))
}

/// Puts the `--set` arguments in a virtual source file so errors can point into them.
fn parse_overrides(prog: &mut Program, raw: &[String]) -> Result<Vec<Override>, diagnostics::Diag> {
    if raw.is_empty() {
        return Ok(vec![]);
    }
    let mut text = String::new();
    let mut spans = Vec::new();
    for r in raw {
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str("--set ");
        let start = text.len();
        text.push_str(r);
        spans.push((start, text.len()));
    }
    let file = prog.sources.add("<command line>", &text, false);
    let mut out: Vec<Override> = Vec::new();
    for (r, (start, end)) in raw.iter().zip(spans) {
        let Some(eq) = r.find('=') else {
            return Err(diagnostics::Diag::new(
                "kiln::set",
                format!("`--set {r}` needs the form key=value"),
            )
            .at(Span::new(file, start, end), "no `=`")
            .help(format!("for example `--set {}=512`", r.trim())));
        };
        let key = r[..eq].trim().to_string();
        if key.is_empty() {
            return Err(diagnostics::Diag::new(
                "kiln::set",
                format!("`--set {r}` has no parameter name"),
            )
            .at(Span::new(file, start, start + eq + 1), "name missing")
            .help("write `--set d_model=512`"));
        }
        if let Some(prev) = out.iter().find(|o| o.key == key) {
            return Err(
                diagnostics::Diag::new("kiln::set", format!("`{key}` is set twice"))
                    .at(Span::new(file, start, end), "second time")
                    .label(prev.key_span, "first time")
                    .help("set each parameter once"),
            );
        }
        out.push(Override {
            key,
            value: r[eq + 1..].to_string(),
            key_span: Span::new(file, start, start + eq),
            value_span: Span::new(file, start + eq + 1, end),
        });
    }
    Ok(out)
}

fn pick_model(prog: &Program, wanted: Option<&str>) -> Result<String, diagnostics::Diag> {
    use diagnostics::Diag;
    let main = prog.sources.file(prog.main_file);
    if let Some(w) = wanted {
        if prog.models.contains_key(w) {
            return Ok(w.to_string());
        }
        let names: Vec<&str> = prog.models.keys().map(|s| s.as_str()).collect();
        return Err(Diag::new(
            "kiln::unknown-model",
            format!("`{}` defines no model `{w}`", main.name),
        )
        .help(
            diagnostics::did_you_mean(w, names.iter().copied())
                .unwrap_or_else(|| format!("its models are: {}", names.join(", "))),
        ));
    }
    match prog.main_models.as_slice() {
        [one] => Ok(one.clone()),
        [] => {
            let blank = main.text.lines().all(|l| {
                let t = l.trim();
                t.is_empty() || t.starts_with('#')
            });
            let end = main.text.len();
            if blank {
                Err(Diag::new(
                    "kiln::empty",
                    format!("`{}` is empty: there is no model to compile", main.name),
                )
                .at(Span::new(prog.main_file, end, end), "nothing here")
                .help("a spec needs a model: `model name(d: int = 4) { ... }`"))
            } else {
                Err(Diag::new("kiln::no-model", format!("`{}` defines no model", main.name))
                    .at(Span::new(prog.main_file, 0, main.text.find('\n').unwrap_or(end).min(end)), "only layers and imports")
                    .help("add `model name(...) { ... }`, or derive one: `model mine = transformer(d_model = 256)`"))
            }
        }
        many => Err(Diag::new(
            "kiln::ambiguous-model",
            format!(
                "`{}` defines {} models: {}",
                main.name,
                many.len(),
                many.join(", ")
            ),
        )
        .help(format!("choose one with `--model {}`", many[0]))),
    }
}
