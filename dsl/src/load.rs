//! Loading: files → a [`Program`] of definitions.
//!
//! In: a spec file path (or text), plus the embedded prelude. Out: a [`Program`] — every
//! source file, every layer and model definition by name, and the models of the main
//! file — or a diagnostic: a missing or non-UTF-8 file, an import that cannot be read,
//! a duplicate definition, or a recursive layer definition (found statically, before
//! elaboration runs).

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::ast::{Expr, ExprKind, Item, LayerDef, ModelDef, ModelKind};
use crate::builtins;
use crate::diagnostics::{Diag, Error};
use crate::parser::parse_file;
use crate::source::{SourceMap, Span};

/// The prelude, written in kiln.
pub const PRELUDE: &str = include_str!("prelude.kiln");
pub const PRELUDE_NAME: &str = "prelude.kiln";

/// Every definition a spec can see.
pub struct Program {
    pub sources: SourceMap,
    pub layers: BTreeMap<String, Rc<LayerDef>>,
    pub models: BTreeMap<String, Rc<ModelDef>>,
    /// Models defined in the main file, in source order.
    pub main_models: Vec<String>,
    /// The file id of the main spec.
    pub main_file: u32,
}

struct Loader {
    sources: SourceMap,
    site: Cell<u32>,
    layers: BTreeMap<String, Rc<LayerDef>>,
    models: BTreeMap<String, Rc<ModelDef>>,
    loaded: HashSet<PathBuf>,
}

/// The largest spec file read: the shipped ones are a few kilobytes, and a read without a
/// bound never ends on a device such as `/dev/zero`.
pub const MAX_SOURCE_BYTES: u64 = 16 << 20;

/// The bytes of `path`, or `Ok(None)` where it holds more than [`MAX_SOURCE_BYTES`].
fn read_bounded(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_SOURCE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= MAX_SOURCE_BYTES).then_some(bytes))
}

fn too_large(path: &Path) -> String {
    format!(
        "`{}` is larger than {} MiB, too large for a spec",
        path.display(),
        MAX_SOURCE_BYTES >> 20
    )
}

/// Reads a file as UTF-8, or explains why not.
pub fn read_source(path: &Path) -> Result<String, Error> {
    let bytes = read_bounded(path).map_err(|e| {
        let help = match e.kind() {
            std::io::ErrorKind::NotFound => {
                Some("check the path; specs usually live in `models/`".to_string())
            }
            std::io::ErrorKind::PermissionDenied => {
                Some("check the file's permissions".to_string())
            }
            _ if path.is_dir() => {
                Some("give the path of a `.kiln` file, not a directory".to_string())
            }
            _ => None,
        };
        Error::plain(
            "kiln::io",
            format!("cannot read `{}`: {}", path.display(), io_reason(&e)),
            help,
        )
    })?;
    let Some(bytes) = bytes else {
        return Err(Error::plain(
            "kiln::io",
            too_large(path),
            Some("give the path of a `.kiln` spec file".to_string()),
        ));
    };
    match String::from_utf8(bytes) {
        Ok(s) => Ok(without_bom(s)),
        Err(e) => {
            let at = e.utf8_error().valid_up_to();
            let lossy = String::from_utf8_lossy(e.as_bytes()).into_owned();
            let mut sources = SourceMap::new();
            let f = sources.add(&path.display().to_string(), &lossy, false);
            let byte = e.as_bytes()[at];
            let end = (at + '\u{fffd}'.len_utf8()).min(lossy.len());
            Err(Diag::new(
                "kiln::encoding",
                format!(
                    "`{}` is not valid UTF-8: byte 0x{byte:02x} at offset {at}",
                    path.display()
                ),
            )
            .at(Span::new(f, at, end), "invalid byte here")
            .help("kiln specs are UTF-8 text; re-save the file as UTF-8")
            .finish(&sources))
        }
    }
}

/// The text without a leading byte-order mark (U+FEFF), which some editors write at the
/// start of UTF-8 files; rustc and Python ignore it too.
fn without_bom(text: String) -> String {
    match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    }
}

fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => e.to_string(),
    }
}

/// Loads a spec file, its imports and the prelude.
pub fn load_file(path: &Path) -> Result<Program, Error> {
    let text = read_source(path)?;
    load_text(
        &path.display().to_string(),
        &text,
        path.parent().map(Path::to_path_buf),
    )
}

/// Loads spec text (imports resolve against `dir`).
pub fn load_text(name: &str, text: &str, dir: Option<PathBuf>) -> Result<Program, Error> {
    let mut l = Loader {
        sources: SourceMap::new(),
        site: Cell::new(0),
        layers: BTreeMap::new(),
        models: BTreeMap::new(),
        loaded: HashSet::new(),
    };
    let prelude = l.sources.add(PRELUDE_NAME, PRELUDE, true);
    if let Err(d) = l.add_file(prelude, None) {
        return Err(d.finish(&l.sources));
    }
    let main = l.sources.add(name, text, false);
    if let Some(dir) = &dir {
        if let Ok(canon) =
            std::fs::canonicalize(dir.join(Path::new(name).file_name().unwrap_or_default()))
        {
            l.loaded.insert(canon);
        }
    }
    let main_models = match l.add_file(main, dir.as_deref()) {
        Ok(m) => m,
        Err(d) => return Err(d.finish(&l.sources)),
    };
    if let Err(d) = check_recursion(&l.layers) {
        return Err(d.finish(&l.sources));
    }
    Ok(Program {
        sources: l.sources,
        layers: l.layers,
        models: l.models,
        main_models,
        main_file: main,
    })
}

impl Loader {
    /// Parses file `id` and registers its definitions; returns the models it defines.
    fn add_file(&mut self, id: u32, dir: Option<&Path>) -> Result<Vec<String>, Diag> {
        let text = self.sources.file(id).text.clone();
        let is_prelude = self.sources.file(id).is_prelude;
        let file = parse_file(id, &text, &self.site)?;
        let mut models = Vec::new();
        for item in file.items {
            match item {
                Item::Import { path, span } => self.import(&path, span, dir)?,
                Item::Layer(def) => {
                    let name = def.name.name.clone();
                    if builtins::is_builtin(&name) && !is_prelude {
                        return Err(Diag::new(
                            "kiln::duplicate",
                            format!("`{name}` is a builtin function and cannot be redefined"),
                        )
                        .at(def.name.span, "this name is taken")
                        .help("pick another name for the layer"));
                    }
                    if let Some(prev) = self.layers.get(&name) {
                        let prev_prelude = self.sources.file(prev.name.span.file).is_prelude;
                        let mut d = Diag::new(
                            "kiln::duplicate",
                            if prev_prelude {
                                format!("layer `{name}` is already defined in the prelude")
                            } else {
                                format!("layer `{name}` is defined twice")
                            },
                        )
                        .at(def.name.span, "second definition")
                        .help("rename one of them");
                        d = if prev_prelude {
                            d.note(Some(prev.name.span), "the prelude defines it here")
                        } else {
                            d.label(prev.name.span, "first definition")
                        };
                        return Err(d);
                    }
                    check_layer_signature(&def)?;
                    self.layers.insert(name, Rc::new(def));
                }
                Item::Model(def) => {
                    let name = def.name.name.clone();
                    if let Some(prev) = self.models.get(&name) {
                        return Err(Diag::new(
                            "kiln::duplicate",
                            format!("model `{name}` is defined twice"),
                        )
                        .at(def.name.span, "second definition")
                        .label(prev.name.span, "first definition")
                        .help("rename one of them"));
                    }
                    if let ModelKind::Full { params, .. } = &def.kind {
                        check_unique(params.iter().map(|p| &p.name), "parameter")?;
                    }
                    models.push(name.clone());
                    self.models.insert(name, Rc::new(def));
                }
            }
        }
        Ok(models)
    }

    fn import(&mut self, path: &str, span: Span, dir: Option<&Path>) -> Result<(), Diag> {
        let full = match dir {
            Some(d) => d.join(path),
            None => PathBuf::from(path),
        };
        let canon = std::fs::canonicalize(&full).unwrap_or(full.clone());
        if !self.loaded.insert(canon) {
            return Ok(()); // already loaded (or being loaded): definitions are shared
        }
        let text = match read_bounded(&full) {
            Ok(None) => {
                return Err(Diag::new("kiln::import", too_large(&full))
                    .at(span, "imported here")
                    .help("import `.kiln` spec files only"))
            }
            Ok(Some(b)) => match String::from_utf8(b) {
                Ok(t) => without_bom(t),
                Err(_) => {
                    return Err(Diag::new(
                        "kiln::encoding",
                        format!("imported file `{}` is not valid UTF-8", full.display()),
                    )
                    .at(span, "imported here")
                    .help("kiln specs are UTF-8 text"))
                }
            },
            Err(e) => {
                return Err(Diag::new(
                    "kiln::import",
                    format!(
                        "cannot import `{path}`: {} (looked for `{}`)",
                        io_reason(&e),
                        full.display()
                    ),
                )
                .at(span, "imported here")
                .help("import paths are relative to the importing file"))
            }
        };
        let id = self.sources.add(&full.display().to_string(), &text, false);
        let sub_dir = full.parent().map(Path::to_path_buf);
        self.add_file(id, sub_dir.as_deref())?;
        Ok(())
    }
}

fn check_unique<'a>(
    names: impl Iterator<Item = &'a crate::ast::Ident>,
    what: &str,
) -> Result<(), Diag> {
    let mut seen: HashMap<&str, Span> = HashMap::new();
    for n in names {
        if let Some(prev) = seen.insert(&n.name, n.span) {
            return Err(Diag::new(
                "kiln::duplicate",
                format!("{what} `{}` is declared twice", n.name),
            )
            .at(n.span, "second declaration")
            .label(prev, "first declaration")
            .help("each name may appear once"));
        }
    }
    Ok(())
}

fn check_layer_signature(def: &LayerDef) -> Result<(), Diag> {
    check_unique(
        def.params
            .iter()
            .map(|p| &p.name)
            .chain(def.tensor_params.iter().map(|p| &p.name)),
        "parameter",
    )
}

/// The layer names a layer body calls directly, with the first call site of each.
fn callees(def: &LayerDef) -> Vec<(String, Span)> {
    let mut out: Vec<(String, Span)> = Vec::new();
    let mut visit = |e: &Expr| {
        if let ExprKind::Call { callee, .. } = &e.kind {
            if let ExprKind::Var(name) = &callee.kind {
                if !out.iter().any(|(n, _)| n == name) {
                    out.push((name.clone(), callee.span));
                }
            }
        }
        // `repeat(n, layer(...))` and `x = layer(...)` make instances that are applied
        // later; the instantiation itself is a call of the layer, covered above.
    };
    def.body.walk(&mut visit);
    for p in &def.params {
        if let Some(d) = &p.default {
            d.walk(&mut visit);
        }
    }
    out
}

/// Rejects layer definitions that call themselves, directly or through others.
fn check_recursion(layers: &BTreeMap<String, Rc<LayerDef>>) -> Result<(), Diag> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Active,
        Done,
    }
    let names: Vec<&String> = layers.keys().collect();
    let mut mark: HashMap<&str, Mark> = names.iter().map(|n| (n.as_str(), Mark::New)).collect();
    let edges: HashMap<&str, Vec<(String, Span)>> = layers
        .iter()
        .map(|(n, d)| {
            (
                n.as_str(),
                callees(d)
                    .into_iter()
                    .filter(|(c, _)| layers.contains_key(c))
                    .collect(),
            )
        })
        .collect();

    fn dfs<'a>(
        n: &'a str,
        edges: &'a HashMap<&'a str, Vec<(String, Span)>>,
        mark: &mut HashMap<&'a str, Mark>,
        path: &mut Vec<(&'a str, Span)>,
    ) -> Option<Vec<(String, Span)>> {
        mark.insert(n, Mark::Active);
        for (c, span) in &edges[n] {
            path.push((n, *span));
            match mark.get(c.as_str()).copied() {
                Some(Mark::Active) => {
                    let start = path.iter().position(|(p, _)| *p == c.as_str()).unwrap_or(0);
                    let cycle = path[start..]
                        .iter()
                        .map(|(p, s)| (p.to_string(), *s))
                        .collect();
                    return Some(cycle);
                }
                Some(Mark::New) => {
                    if let Some(c) = dfs(c.as_str(), edges, mark, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
            path.pop();
        }
        mark.insert(n, Mark::Done);
        None
    }

    for n in names {
        if mark[n.as_str()] == Mark::New {
            let mut path = Vec::new();
            if let Some(cycle) = dfs(n.as_str(), &edges, &mut mark, &mut path) {
                let chain: Vec<&str> = cycle
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .chain(std::iter::once(cycle[0].0.as_str()))
                    .collect();
                let (first, span) = &cycle[0];
                let mut d = Diag::new(
                    "kiln::recursive",
                    format!("layer `{first}` is recursive: {}", chain.join(" → ")),
                )
                .at(*span, format!("`{first}` calls `{}` here", chain[1]))
                .help("layers cannot call themselves; use `repeat(n, layer(...))` to stack copies");
                for (n, s) in cycle.iter().skip(1) {
                    d = d.label(*s, format!("`{n}` calls back here"));
                }
                return Err(d);
            }
        }
    }
    Ok(())
}
