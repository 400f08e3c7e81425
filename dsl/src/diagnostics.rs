//! Diagnostics: what went wrong, where, and how to fix it.
//!
//! In: a [`Diag`] built anywhere in the front end (parser, checks, elaborator) — a message,
//! a primary [`Span`] with a label, secondary labels, a help line, notes, and the stack of
//! layer calls that led to it. Out: an [`Error`] that implements `miette::Diagnostic`,
//! owning the source text it shows, and renders deterministically (file, line, column,
//! the source line with a caret) via [`Error::render`].
//!
//! Errors inside the embedded prelude are moved to the user's call site: the user sees
//! the line they wrote, and a note shows the prelude line that failed.

use std::fmt;

use miette::{
    Diagnostic, GraphicalReportHandler, GraphicalTheme, LabeledSpan, NamedSource, Severity,
    SourceSpan,
};

use crate::source::{SourceMap, Span};

/// A diagnostic under construction (boxed: errors travel through every `Result`).
#[derive(Clone, Debug)]
pub struct Diag(Box<DiagData>);

impl std::ops::Deref for Diag {
    type Target = DiagData;
    fn deref(&self) -> &DiagData {
        &self.0
    }
}

impl std::ops::DerefMut for Diag {
    fn deref_mut(&mut self) -> &mut DiagData {
        &mut self.0
    }
}

#[derive(Clone, Debug)]
pub struct DiagData {
    pub code: &'static str,
    pub message: String,
    pub span: Option<Span>,
    pub label: Option<String>,
    pub labels: Vec<(Span, String)>,
    pub help: Option<String>,
    pub notes: Vec<(Option<Span>, String)>,
    /// Layer calls from the outermost to the innermost: (layer name, call site).
    pub stack: Vec<(String, Span)>,
}

impl Diag {
    pub fn new(code: &'static str, message: impl Into<String>) -> Diag {
        Diag(Box::new(DiagData {
            code,
            message: message.into(),
            span: None,
            label: None,
            labels: vec![],
            help: None,
            notes: vec![],
            stack: vec![],
        }))
    }

    pub fn at(mut self, span: Span, label: impl Into<String>) -> Diag {
        self.span = Some(span);
        let l = label.into();
        self.label = if l.is_empty() { None } else { Some(l) };
        self
    }

    pub fn label(mut self, span: Span, label: impl Into<String>) -> Diag {
        self.0.labels.push((span, label.into()));
        self
    }

    pub fn help(mut self, help: impl Into<String>) -> Diag {
        self.0.help = Some(help.into());
        self
    }

    pub fn help_opt(mut self, help: Option<String>) -> Diag {
        if help.is_some() {
            self.0.help = help;
        }
        self
    }

    pub fn note(mut self, span: Option<Span>, note: impl Into<String>) -> Diag {
        self.notes.push((span, note.into()));
        self
    }

    /// Finishes the diagnostic against the sources it points into.
    pub fn finish(self, sources: &SourceMap) -> Error {
        let mut d = self;
        // An error inside the prelude is reported at the innermost user call site.
        if let Some(span) = d.span {
            if sources.file(span.file).is_prelude {
                if let Some(pos) = d
                    .stack
                    .iter()
                    .rposition(|(_, site)| !sources.file(site.file).is_prelude)
                {
                    let layer = d.stack.get(pos).map(|(l, _)| l.clone()).unwrap_or_default();
                    let site = d.stack[pos].1;
                    let label = d.label.take().unwrap_or_default();
                    let inner = format!(
                        "inside prelude layer `{layer}`{}",
                        if label.is_empty() {
                            String::new()
                        } else {
                            format!(": {label}")
                        }
                    );
                    // Secondary labels in the prelude go with the note.
                    let moved: Vec<(Span, String)> = std::mem::take(&mut d.labels);
                    d.notes.insert(0, (Some(span), inner));
                    for (s, l) in moved {
                        if sources.file(s.file).is_prelude {
                            d.notes.insert(1, (Some(s), l));
                        } else {
                            d.labels.push((s, l));
                        }
                    }
                    d.span = Some(site);
                    d.label = Some(format!("in this call to `{layer}`"));
                    d.stack.truncate(pos);
                }
            }
        }
        let mut related = Vec::new();
        for (span, msg) in &d.notes {
            related.push(Error::note(sources, *span, msg));
        }
        // The calls that led here, innermost first, user code only.
        for (layer, site) in d.stack.iter().rev() {
            if sources.file(site.file).is_prelude {
                continue;
            }
            // A call site that contains the error adds nothing to it.
            if let Some(p) = d.span {
                if p.file == site.file && site.start <= p.start && p.end <= site.end {
                    continue;
                }
            }
            related.push(Error::note(
                sources,
                Some(*site),
                &format!("while elaborating `{layer}`, called here"),
            ));
        }
        let mut labels = Vec::new();
        let mut source = None;
        let location = d.span.map(|span| {
            let (line, column) = sources.line_col(span);
            Location {
                file: sources.file(span.file).name.clone(),
                line,
                column,
            }
        });
        if let Some(span) = d.span {
            let (src, map) = snippet(sources, span);
            labels.push(LabeledSpan::new_primary_with_span(
                d.label.clone(),
                map(span),
            ));
            for (s, l) in &d.labels {
                if s.file == span.file {
                    labels.push(LabeledSpan::new_with_span(Some(l.clone()), map(*s)));
                } else {
                    related.push(Error::note(sources, Some(*s), l));
                }
            }
            source = Some(src);
        }
        Error(Box::new(ErrorData {
            code: d.code,
            message: d.message.clone(),
            severity: Severity::Error,
            help: d.help.clone(),
            labels,
            source,
            related,
            location,
        }))
    }
}

type SpanMap = Box<dyn Fn(Span) -> SourceSpan>;

/// The source text to show for `span` and a map from spans to offsets in it. Lines
/// longer than a screen are cut to a window around the span (line numbers are kept;
/// the label states the true column).
fn snippet(sources: &SourceMap, span: Span) -> (NamedSource<String>, SpanMap) {
    let file = sources.file(span.file);
    let text: &str = &file.text;
    let start = (span.start as usize).min(text.len());
    let line_start = text[..start].rfind('\n').map(|i| i + 1).unwrap_or(0);
    let line_end = text[start..]
        .find('\n')
        .map(|i| start + i)
        .unwrap_or(text.len());
    const MAX_LINE: usize = 240;
    if line_end - line_start <= MAX_LINE && text.len() <= 4 << 20 {
        let named = NamedSource::new(file.name.clone(), text.to_string()).with_language("kiln");
        let len = text.len();
        return (
            named,
            Box::new(move |s: Span| {
                let a = (s.start as usize).min(len);
                let b = (s.end as usize).min(len).max(a);
                SourceSpan::new(a.into(), b - a)
            }),
        );
    }
    // Keep the line number right by padding with newlines; show 80 chars each side.
    let mut lo = start.saturating_sub(80).max(line_start);
    while !text.is_char_boundary(lo) {
        lo -= 1;
    }
    let mut hi = (start + 80).min(line_end);
    while !text.is_char_boundary(hi) {
        hi += 1;
    }
    let line_no = text[..line_start].matches('\n').count();
    let mut window = "\n".repeat(line_no);
    let base = window.len();
    window.push_str(&text[lo..hi]);
    let named = NamedSource::new(file.name.clone(), window).with_language("kiln");
    (
        named,
        Box::new(move |s: Span| {
            let a = (s.start as usize).clamp(lo, hi);
            let b = (s.end as usize).clamp(a, hi);
            SourceSpan::new((base + a - lo).into(), b - a)
        }),
    )
}

/// A finished diagnostic: owns the text it shows.
#[derive(Debug)]
pub struct Error(Box<ErrorData>);

#[derive(Debug)]
struct ErrorData {
    code: &'static str,
    message: String,
    severity: Severity,
    help: Option<String>,
    labels: Vec<LabeledSpan>,
    source: Option<NamedSource<String>>,
    related: Vec<Error>,
    /// Where the error points: file name, line and column (from 1).
    location: Option<Location>,
}

/// A place in a source file, as an error names it: the file's name, the line and the
/// column (in characters), both counted from 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub file: String,
    pub line: usize,
    pub column: usize,
}

impl Error {
    fn note(sources: &SourceMap, span: Option<Span>, msg: &str) -> Error {
        let mut labels = Vec::new();
        let mut source = None;
        let mut message = msg.to_string();
        if let Some(span) = span {
            let (src, map) = snippet(sources, span);
            labels.push(LabeledSpan::new_primary_with_span(None, map(span)));
            source = Some(src);
            message = format!("{msg} ({})", sources.location(span));
        }
        Error(Box::new(ErrorData {
            code: "",
            message,
            severity: Severity::Advice,
            help: None,
            labels,
            source,
            related: vec![],
            location: None,
        }))
    }

    /// An error that points at no source (a missing file, a bad command line).
    pub fn plain(code: &'static str, message: impl Into<String>, help: Option<String>) -> Error {
        Error(Box::new(ErrorData {
            code,
            message: message.into(),
            severity: Severity::Error,
            help,
            labels: vec![],
            source: None,
            related: vec![],
            location: None,
        }))
    }

    /// The diagnostic code (`kiln::unknown-layer`).
    pub fn code_str(&self) -> &'static str {
        self.0.code
    }

    pub fn message(&self) -> &str {
        &self.0.message
    }

    pub fn help_text(&self) -> Option<&str> {
        self.0.help.as_deref()
    }

    /// The file, line and column the error points at, if it points into a source.
    pub fn location(&self) -> Option<&Location> {
        self.0.location.as_ref()
    }

    /// Renders the diagnostic as text: unicode frame, fixed width, no terminal links;
    /// colors only when asked. Deterministic for a given input. Lines break at spaces
    /// only — not at a hyphen or after a `/`, and a word longer than a line is left
    /// whole — so a flag (`--from-model`) or a path is never split over two lines and
    /// can be copied back.
    pub fn render(&self, color: bool) -> String {
        let theme = if color {
            GraphicalTheme::unicode()
        } else {
            GraphicalTheme::unicode_nocolor()
        };
        let handler = GraphicalReportHandler::new_themed(theme)
            .with_width(100)
            .with_word_separator(textwrap::WordSeparator::AsciiSpace)
            .with_word_splitter(textwrap::WordSplitter::NoHyphenation)
            .with_break_words(false)
            .with_links(false)
            .with_context_lines(1);
        let mut out = String::new();
        if handler.render_report(&mut out, self).is_err() {
            out = format!("error: {}\n", self.0.message);
        }
        out
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.message)
    }
}

impl std::error::Error for Error {}

impl Diagnostic for Error {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        if self.0.code.is_empty() {
            None
        } else {
            Some(Box::new(self.0.code))
        }
    }

    fn severity(&self) -> Option<Severity> {
        Some(self.0.severity)
    }

    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.0
            .help
            .as_ref()
            .map(|h| Box::new(h.as_str()) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        self.0.source.as_ref().map(|s| s as &dyn miette::SourceCode)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        if self.0.labels.is_empty() {
            None
        } else {
            Some(Box::new(self.0.labels.iter().cloned()))
        }
    }

    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn Diagnostic> + 'a>> {
        if self.0.related.is_empty() {
            None
        } else {
            Some(Box::new(
                self.0.related.iter().map(|e| e as &dyn Diagnostic),
            ))
        }
    }
}

/// Names longer than this get no suggestion: the edit distance costs the product of the
/// two lengths, and no typo of a real name is that long.
pub const SUGGEST_MAX_CHARS: usize = 64;

/// The candidate closest to `name`, if it is close enough to be a likely typo.
pub fn closest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    if name.len() > SUGGEST_MAX_CHARS * 4 || name.chars().count() > SUGGEST_MAX_CHARS {
        return None;
    }
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        if c == name || c.len() > SUGGEST_MAX_CHARS * 4 || c.chars().count() > SUGGEST_MAX_CHARS {
            continue;
        }
        let d = strsim::damerau_levenshtein(name, c);
        let limit = (name.chars().count().max(c.chars().count()) / 3).max(1);
        let prefix_match = name.len() >= 3 && (c.starts_with(name) || name.starts_with(c));
        if d <= limit || prefix_match {
            let score = if prefix_match && d > limit {
                limit + 1
            } else {
                d
            };
            if best.is_none_or(|(bd, bc)| score < bd || (score == bd && c < bc)) {
                best = Some((score, c));
            }
        }
    }
    best.map(|(_, c)| c)
}

/// `did you mean `x`?` for [`Diag::help`].
pub fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    closest(name, candidates).map(|c| format!("did you mean `{c}`?"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_near_names() {
        let names = ["attention", "linear", "layer_norm", "embedding"];
        assert_eq!(closest("atention", names), Some("attention"));
        assert_eq!(closest("layernorm", names), Some("layer_norm"));
        assert_eq!(closest("lnear", names), Some("linear"));
        assert_eq!(closest("xyz", names), None);
        // A name too long for a typo gets no suggestion (and costs no quadratic search).
        let long = "a".repeat(1_000_000);
        assert_eq!(closest(&long, [long.as_str(), &"a".repeat(999_999)]), None);
    }
}
