//! Source files and spans.
//!
//! In: the text of every file a spec reads (the spec, its imports, the embedded prelude,
//! and a virtual file for `--set` arguments). Out: a [`SourceMap`] that owns them and
//! [`Span`]s (file + byte range) that every AST node and diagnostic refers to.

use std::sync::Arc;

/// A byte range in one file of a [`SourceMap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Span {
    pub file: u32,
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(file: u32, start: usize, end: usize) -> Span {
        Span {
            file,
            start: start as u32,
            end: end as u32,
        }
    }

    /// The smallest span covering both (same file).
    pub fn to(self, other: Span) -> Span {
        Span {
            file: self.file,
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }

    pub fn len(&self) -> usize {
        (self.end - self.start) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

#[derive(Clone, Debug)]
pub struct SourceFile {
    /// The name shown in diagnostics (the path as given, or `prelude.kiln`).
    pub name: String,
    pub text: Arc<str>,
    /// The embedded prelude: errors inside it are shown at the user's call site.
    pub is_prelude: bool,
}

#[derive(Clone, Debug, Default)]
pub struct SourceMap {
    files: Vec<SourceFile>,
}

impl SourceMap {
    pub fn new() -> SourceMap {
        SourceMap::default()
    }

    pub fn add(&mut self, name: &str, text: &str, is_prelude: bool) -> u32 {
        self.files.push(SourceFile {
            name: name.to_string(),
            text: Arc::from(text),
            is_prelude,
        });
        (self.files.len() - 1) as u32
    }

    /// Every file, in the order they were added.
    pub fn files(&self) -> &[SourceFile] {
        &self.files
    }

    pub fn file(&self, id: u32) -> &SourceFile {
        &self.files[id as usize]
    }

    pub fn text(&self, span: Span) -> &str {
        let f = self.file(span.file);
        f.text
            .get(span.start as usize..span.end as usize)
            .unwrap_or("")
    }

    /// 1-based line and column (in characters) of the span's start.
    pub fn line_col(&self, span: Span) -> (usize, usize) {
        let text = &self.file(span.file).text;
        let start = (span.start as usize).min(text.len());
        let before = &text[..start];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
        let col = before[line_start..].chars().count() + 1;
        (line, col)
    }

    /// `file:line:col` of the span's start.
    pub fn location(&self, span: Span) -> String {
        let (l, c) = self.line_col(span);
        format!("{}:{}:{}", self.file(span.file).name, l, c)
    }
}
