//! Corpus BLEU with sacreBLEU's semantics.
//!
//! In: hypothesis lines and one or more reference streams (each a line per hypothesis),
//! plus [`BleuOptions`] (tokenizer, case, smoothing). Out: a [`Bleu`] score with its
//! sufficient statistics, printed the way sacreBLEU prints it:
//! `BLEU = 31.25 62.1/38.9/25.7/17.3 (BP = 0.963 ratio = 0.964 hyp_len = 12345 ref_len = 12800)`.
//!
//! What is reproduced from sacreBLEU 2.x (`sacrebleu.metrics.bleu.BLEU`):
//!
//! - each segment is lowercased (if asked), stripped of trailing whitespace, then
//!   tokenized (`13a`, see [`tokenize_13a`], or `none`) and split on whitespace;
//! - n-grams of order 1 to 4; a hypothesis n-gram is clipped to the largest count it has
//!   in any one reference of that segment;
//! - statistics are summed over the corpus before any precision is taken;
//! - the brevity penalty uses, per segment, the reference length closest to the
//!   hypothesis length (ties go to the shorter one);
//! - score = BP · exp(mean of log p_n) · 100, with sacreBLEU's floor of `log 0` and its
//!   four smoothing methods ([`Smooth`]).
//!
//! Unlike sacreBLEU, whose default smoothing is `exp`, kiln's default is no smoothing
//! (corpus BLEU as in the paper). Unlike sacreBLEU, which silently zips streams of
//! different lengths, a line-count mismatch is an error.

use std::collections::HashMap;
use std::fmt;

/// The order of the largest n-grams counted.
pub const MAX_ORDER: usize = 4;

/// How segments are split into tokens before n-grams are counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Tokenize {
    /// sacreBLEU's `13a`, the tokenizer of WMT's `mteval-v13a.pl`.
    #[default]
    V13a,
    /// sacreBLEU's `none`: the text is only split on whitespace.
    None,
}

impl Tokenize {
    /// sacreBLEU's name for this tokenizer (`13a`, `none`).
    pub fn name(self) -> &'static str {
        match self {
            Tokenize::V13a => "13a",
            Tokenize::None => "none",
        }
    }
}

/// Smoothing of zero n-gram precisions, as sacreBLEU defines it (Chen & Cherry, 2014).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Smooth {
    /// No smoothing: any order without a match makes the score 0.
    None,
    /// `exp` (method 3, mteval's): the k-th order without a match gets precision
    /// `1 / (2^k · total)`. sacreBLEU's default, and kiln's.
    #[default]
    Exp,
    /// `floor` (method 1): an order without a match gets precision `value / total`.
    /// sacreBLEU's default value is 0.1.
    Floor(f64),
    /// `add-k` (method 2): `value` is added to the matches and the totals of orders 2 to 4.
    /// sacreBLEU's default value is 1.
    AddK(f64),
}

impl Smooth {
    /// sacreBLEU's name for this method (`none`, `exp`, `floor`, `add-k`).
    pub fn name(self) -> &'static str {
        match self {
            Smooth::None => "none",
            Smooth::Exp => "exp",
            Smooth::Floor(_) => "floor",
            Smooth::AddK(_) => "add-k",
        }
    }
}

/// How BLEU is computed. The default is sacreBLEU's: corpus BLEU on `13a` tokens,
/// case-sensitive, `exp` smoothing.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BleuOptions {
    /// Lowercase hypotheses and references before tokenizing.
    pub lowercase: bool,
    pub tokenize: Tokenize,
    pub smooth: Smooth,
}

/// The sacreBLEU version whose scores kiln's are tested to equal under every option
/// (`decode/tests/bleu.rs`, `tests/cli.rs`), named in [`BleuOptions::signature`].
pub const SACREBLEU_VERSION: &str = "2.6.0";

impl BleuOptions {
    /// sacreBLEU's signature of a score computed with these options against `nrefs`
    /// references (`nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`), so a
    /// number can be compared with one sacreBLEU reports.
    pub fn signature(&self, nrefs: usize) -> String {
        let case = if self.lowercase { "lc" } else { "mixed" };
        let smooth = match self.smooth {
            Smooth::Floor(v) | Smooth::AddK(v) => format!("{}[{v:.2}]", self.smooth.name()),
            s => s.name().to_string(),
        };
        format!(
            "nrefs:{nrefs}|case:{case}|eff:no|tok:{}|smooth:{smooth}|version:{SACREBLEU_VERSION}",
            self.tokenize.name()
        )
    }
}

/// A BLEU score and the statistics it was computed from.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Bleu {
    /// BLEU, 0 to 100.
    pub score: f64,
    /// Clipped matches of each order (1-grams first), before any smoothing.
    pub counts: [u64; MAX_ORDER],
    /// Hypothesis n-grams of each order, before any smoothing.
    pub totals: [u64; MAX_ORDER],
    /// The (smoothed) precision of each order, in percent.
    pub precisions: [f64; MAX_ORDER],
    /// Brevity penalty.
    pub bp: f64,
    /// `sys_len / ref_len` (0 when `ref_len` is 0).
    pub ratio: f64,
    /// Hypothesis tokens.
    pub sys_len: u64,
    /// Effective reference tokens (the closest reference length of each segment).
    pub ref_len: u64,
}

impl fmt::Display for Bleu {
    /// sacreBLEU's line, with its rounding: score to 2 decimals, precisions to 1, BP and
    /// ratio to 3.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.precisions;
        write!(
            f,
            "BLEU = {:.2} {:.1}/{:.1}/{:.1}/{:.1} (BP = {:.3} ratio = {:.3} hyp_len = {} ref_len = {})",
            self.score, p[0], p[1], p[2], p[3], self.bp, self.ratio, self.sys_len, self.ref_len
        )
    }
}

/// Why BLEU could not be computed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BleuError {
    #[error(
        "no reference stream was given; pass at least one stream with a reference line per \
         hypothesis line"
    )]
    NoReferences,
    #[error(
        "the hypotheses have {hyps} lines but reference stream {stream} (of {streams}) has \
         {refs}; every stream needs exactly one line per hypothesis (look for a missing or \
         extra line, or a line break inside a sentence)"
    )]
    LineCount {
        /// 1-based index of the reference stream.
        stream: usize,
        streams: usize,
        hyps: usize,
        refs: usize,
    },
    #[error(
        "BLEU smoothing `{method}` needs a finite, non-negative value, got {value}; \
         sacreBLEU's defaults are 0.1 for `floor` and 1 for `add-k`"
    )]
    BadSmoothing { method: &'static str, value: f64 },
}

/// Whitespace as Python's `str.isspace` sees it, which is what sacreBLEU splits and
/// strips on: Rust's `char::is_whitespace` plus the four ASCII separators U+001C..U+001F.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.split()` with no argument.
fn py_split(s: &str) -> impl Iterator<Item = &str> {
    s.split(is_py_space).filter(|t| !t.is_empty())
}

/// The punctuation `13a` always separates: the character class
/// `[\{-\~\[-\` -\&\(-\+\:-\@\/]` of sacreBLEU's regex tokenizer.
fn is_13a_symbol(c: char) -> bool {
    matches!(c,
        '{'..='~' | '['..='`' | ' '..='&' | '('..='+' | ':'..='@' | '/')
}

/// One left-to-right pass of Python's `re.sub` for a two-character pattern `(A)(B)`:
/// at each position, if the character matches `first` and the next matches `second`,
/// `emit` writes the replacement and the scan resumes after the pair.
fn sub_pair(
    s: &str,
    first: impl Fn(char) -> bool,
    second: impl Fn(char) -> bool,
    emit: impl Fn(&mut String, char, char),
) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len() + s.len() / 4);
    let mut i = 0;
    while i < chars.len() {
        match chars.get(i + 1) {
            Some(&next) if first(chars[i]) && second(next) => {
                emit(&mut out, chars[i], next);
                i += 2;
            }
            _ => {
                out.push(chars[i]);
                i += 1;
            }
        }
    }
    out
}

/// sacreBLEU's `13a` tokenizer (`Tokenizer13a`), the tokenization of `mteval-v13a.pl`.
///
/// 1. `<skipped>` is removed, `-\n` joins lines, other `\n` become spaces.
/// 2. Only if the line contains `&`: `&quot;`, `&amp;`, `&lt;`, `&gt;` are unescaped, in
///    that order.
/// 3. The line is padded with a space on each side; then, in order: the symbols
///    `{|}~[\]^_` `` ` `` `!"#$%&()*+:;<=>?@/` get a space on each side; `.` and `,` are
///    split from a preceding non-digit, then from a following non-digit; `-` is split
///    from a preceding digit.
/// 4. Whitespace runs become one space; leading and trailing whitespace is removed.
///
/// So `1,000.50` and `3.14` stay whole, `e-mail` stays whole, `5-6` becomes `5 - 6`.
pub fn tokenize_13a(line: &str) -> String {
    let mut s = line
        .replace("<skipped>", "")
        .replace("-\n", "")
        .replace('\n', " ");
    if s.contains('&') {
        s = s
            .replace("&quot;", "\"")
            .replace("&amp;", "&")
            .replace("&lt;", "<")
            .replace("&gt;", ">");
    }

    let mut spaced = String::with_capacity(s.len() * 2 + 2);
    spaced.push(' ');
    for c in s.chars() {
        if is_13a_symbol(c) {
            spaced.push(' ');
            spaced.push(c);
            spaced.push(' ');
        } else {
            spaced.push(c);
        }
    }
    spaced.push(' ');

    let digit = |c: char| c.is_ascii_digit();
    let period_comma = |c: char| c == '.' || c == ',';
    // ([^0-9])([\.,]) -> "\1 \2 "
    let s = sub_pair(
        &spaced,
        |c| !digit(c),
        period_comma,
        |out, a, b| {
            out.push(a);
            out.push(' ');
            out.push(b);
            out.push(' ');
        },
    );
    // ([\.,])([^0-9]) -> " \1 \2"
    let s = sub_pair(
        &s,
        period_comma,
        |c| !digit(c),
        |out, a, b| {
            out.push(' ');
            out.push(a);
            out.push(' ');
            out.push(b);
        },
    );
    // ([0-9])(-) -> "\1 \2 "
    let s = sub_pair(
        &s,
        digit,
        |c| c == '-',
        |out, a, b| {
            out.push(a);
            out.push(' ');
            out.push(b);
            out.push(' ');
        },
    );
    py_split(&s).collect::<Vec<_>>().join(" ")
}

/// sacreBLEU's per-segment preprocessing: lowercase, strip trailing whitespace, tokenize.
fn preprocess(line: &str, opts: &BleuOptions) -> String {
    let lowered;
    let line = if opts.lowercase {
        lowered = line.to_lowercase();
        &lowered
    } else {
        line
    };
    let line = line.trim_end_matches(is_py_space);
    match opts.tokenize {
        Tokenize::V13a => tokenize_13a(line),
        Tokenize::None => line.to_string(),
    }
}

/// Counts of every n-gram of order 1 to [`MAX_ORDER`] in `tokens`.
fn ngram_counts<'a>(tokens: &'a [&'a str]) -> HashMap<&'a [&'a str], u64> {
    let mut counts = HashMap::new();
    for n in 1..=MAX_ORDER.min(tokens.len()) {
        for gram in tokens.windows(n) {
            *counts.entry(gram).or_insert(0) += 1;
        }
    }
    counts
}

/// The reference length used for the brevity penalty: the one closest to `hyp_len`,
/// the shorter one on a tie.
fn closest_ref_len(hyp_len: u64, ref_lens: &[u64]) -> u64 {
    ref_lens
        .iter()
        .copied()
        .min_by_key(|&r| (r.abs_diff(hyp_len), r))
        .unwrap_or(0)
}

/// BLEU's sufficient statistics, summed over segments. [`corpus_bleu`] is
/// [`BleuStats::add`] over every line, then [`BleuStats::score`]; use these directly to
/// accumulate a corpus batch by batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BleuStats {
    pub sys_len: u64,
    pub ref_len: u64,
    pub correct: [u64; MAX_ORDER],
    pub total: [u64; MAX_ORDER],
}

impl BleuStats {
    /// Adds one segment: a hypothesis and its references (at least one; with none, only
    /// the hypothesis length and n-gram totals are counted).
    pub fn add(&mut self, hyp: &str, refs: &[&str], opts: &BleuOptions) {
        let refs: Vec<String> = refs.iter().map(|r| preprocess(r, opts)).collect();
        let ref_tokens: Vec<Vec<&str>> = refs.iter().map(|r| py_split(r).collect()).collect();
        let mut ref_max: HashMap<&[&str], u64> = HashMap::new();
        let mut ref_lens = Vec::with_capacity(ref_tokens.len());
        for tokens in &ref_tokens {
            ref_lens.push(tokens.len() as u64);
            for (gram, count) in ngram_counts(tokens) {
                let best = ref_max.entry(gram).or_insert(0);
                *best = (*best).max(count);
            }
        }

        let hyp = preprocess(hyp, opts);
        let hyp_tokens: Vec<&str> = py_split(&hyp).collect();
        let hyp_len = hyp_tokens.len() as u64;
        self.sys_len += hyp_len;
        self.ref_len += closest_ref_len(hyp_len, &ref_lens);
        for (gram, count) in ngram_counts(&hyp_tokens) {
            let n = gram.len() - 1;
            self.total[n] += count;
            if let Some(&r) = ref_max.get(gram) {
                self.correct[n] += count.min(r);
            }
        }
    }

    /// The score of the statistics so far (`opts.smooth` is the only option used).
    pub fn score(&self, opts: &BleuOptions) -> Result<Bleu, BleuError> {
        check_smooth(opts.smooth)?;
        Ok(compute_bleu(self, opts.smooth))
    }
}

fn check_smooth(smooth: Smooth) -> Result<(), BleuError> {
    match smooth {
        Smooth::Floor(value) | Smooth::AddK(value) if !(value.is_finite() && value >= 0.0) => {
            Err(BleuError::BadSmoothing {
                method: smooth.name(),
                value,
            })
        }
        _ => Ok(()),
    }
}

/// `log`, with sacreBLEU's floor for 0 (`my_log`).
fn floored_ln(x: f64) -> f64 {
    if x == 0.0 {
        -9_999_999_999.0
    } else {
        x.ln()
    }
}

/// sacreBLEU's `BLEU.compute_bleu` without effective order, operation for operation.
fn compute_bleu(stats: &BleuStats, smooth: Smooth) -> Bleu {
    let (sys_len, ref_len) = (stats.sys_len, stats.ref_len);
    let bp = if sys_len >= ref_len {
        1.0
    } else if sys_len > 0 {
        (1.0 - ref_len as f64 / sys_len as f64).exp()
    } else {
        0.0
    };
    let ratio = if ref_len > 0 {
        sys_len as f64 / ref_len as f64
    } else {
        0.0
    };
    let mut bleu = Bleu {
        score: 0.0,
        counts: stats.correct,
        totals: stats.total,
        precisions: [0.0; MAX_ORDER],
        bp,
        ratio,
        sys_len,
        ref_len,
    };
    // No match of any order: 0, whatever the smoothing (sacreBLEU #141).
    if stats.correct.iter().all(|&c| c == 0) {
        return bleu;
    }

    let mut mteval = 1.0f64;
    for n in 0..MAX_ORDER {
        let (mut correct, mut total) = (stats.correct[n] as f64, stats.total[n] as f64);
        if let Smooth::AddK(k) = smooth {
            if n > 0 {
                correct += k;
                total += k;
            }
        }
        if total == 0.0 {
            // Orders from here on keep precision 0, floored in the log.
            break;
        }
        bleu.precisions[n] = if correct == 0.0 {
            match smooth {
                Smooth::Exp => {
                    mteval *= 2.0;
                    100.0 / (mteval * total)
                }
                Smooth::Floor(value) => 100.0 * value / total,
                Smooth::None | Smooth::AddK(_) => 0.0,
            }
        } else {
            100.0 * correct / total
        };
    }
    let mut log_sum = 0.0;
    for &p in &bleu.precisions {
        log_sum += floored_ln(p);
    }
    bleu.score = bp * (log_sum / MAX_ORDER as f64).exp();
    bleu
}

/// Corpus BLEU of `hyps` against one or more reference streams; `refs[k][i]` is the k-th
/// reference of hypothesis `i`. Every stream must have one line per hypothesis.
pub fn corpus_bleu(
    hyps: &[String],
    refs: &[Vec<String>],
    opts: &BleuOptions,
) -> Result<Bleu, BleuError> {
    if refs.is_empty() {
        return Err(BleuError::NoReferences);
    }
    for (k, stream) in refs.iter().enumerate() {
        if stream.len() != hyps.len() {
            return Err(BleuError::LineCount {
                stream: k + 1,
                streams: refs.len(),
                hyps: hyps.len(),
                refs: stream.len(),
            });
        }
    }
    check_smooth(opts.smooth)?;
    let mut stats = BleuStats::default();
    let mut segment_refs: Vec<&str> = Vec::with_capacity(refs.len());
    for (i, hyp) in hyps.iter().enumerate() {
        segment_refs.clear();
        segment_refs.extend(refs.iter().map(|stream| stream[i].as_str()));
        stats.add(hyp, &segment_refs, opts);
    }
    stats.score(opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbol_class_matches_the_regex_ranges() {
        let symbols: String = (' '..='~').filter(|&c| is_13a_symbol(c)).collect();
        assert_eq!(symbols, " !\"#$%&()*+/:;<=>?@[\\]^_`{|}~");
    }

    #[test]
    fn closest_reference_length_prefers_the_shorter_on_ties() {
        assert_eq!(closest_ref_len(5, &[6, 4]), 4);
        assert_eq!(closest_ref_len(5, &[7, 6, 9]), 6);
        assert_eq!(closest_ref_len(0, &[]), 0);
    }

    #[test]
    fn sub_pair_does_not_overlap_matches() {
        // Python: re.sub(r'([^0-9])([\.,])', r'\1 \2 ', 'a..b') == 'a . .b'
        let out = sub_pair(
            "a..b",
            |c| !c.is_ascii_digit(),
            |c| c == '.' || c == ',',
            |o, a, b| {
                o.push(a);
                o.push(' ');
                o.push(b);
                o.push(' ');
            },
        );
        assert_eq!(out, "a . .b");
    }
}
