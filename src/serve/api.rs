//! The server's JSON: what a request may say, how it is checked, and the answers.
//!
//! In: a `POST /translate` body. Out: the sentences and the search they ask for, or an
//! [`ApiError`] (a 4xx status and a message that names the field and the fix); then the
//! hypotheses as the answer's JSON. Pure functions, so the checks are tested without a
//! socket.

use serde::Deserialize;
use serde_json::{json, Value};

use kiln_decode::search::{DecodeOptions, Hypothesis, MAX_BEAM};
use kiln_train::data::Tokenizer;

use crate::args::SearchArgs;

/// A refused request: its HTTP status and why.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub(crate) fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    /// The error as the answer's body: `{"error": {"status": …, "message": …}}`.
    pub(crate) fn body(&self) -> Value {
        json!({"error": {"status": self.status, "message": self.message}})
    }
}

/// What one request may carry at most (`kiln serve` flags).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Sentences in one request (`--max-sentences`).
    pub sentences: usize,
    /// Characters in one sentence (`--max-chars`).
    pub chars: usize,
    /// Bytes of one request's body (`--max-body-bytes`).
    pub body_bytes: usize,
}

/// `POST /translate`'s body. Every field but `text` falls back on the server's flags.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Request {
    text: Vec<String>,
    beam: Option<usize>,
    alpha: Option<f64>,
    length_penalty: Option<String>,
    early_stop: Option<String>,
    max_len_a: Option<f64>,
    max_len_b: Option<usize>,
    greedy: Option<bool>,
    allow_unk: Option<bool>,
    nbest: Option<usize>,
}

/// A checked request: its sentences, the search and how many hypotheses per sentence.
#[derive(Debug)]
pub(crate) struct Translate {
    pub text: Vec<String>,
    pub opts: DecodeOptions,
    pub nbest: usize,
}

/// Parses and checks a `POST /translate` body against `limits`, its search options
/// over the server's `defaults`.
pub(crate) fn parse_translate(
    body: &[u8],
    defaults: &SearchArgs,
    limits: &Limits,
) -> Result<Translate, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(400, format!("malformed JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::new(
            422,
            format!(
                "the body is a JSON {}, not an object: send {{\"text\": [\"a sentence\", …]}}",
                kind(&v)
            ),
        ));
    }
    let r: Request = serde_json::from_value(v).map_err(|e| {
        ApiError::new(
            422,
            format!(
                "{e}; send {{\"text\": [\"a sentence\", …]}} and optionally beam, alpha, \
                 length_penalty, early_stop, max_len_a, max_len_b, greedy, allow_unk, nbest"
            ),
        )
    })?;
    if r.text.is_empty() {
        return Err(ApiError::new(
            422,
            "`text` is empty: send at least one sentence",
        ));
    }
    if r.text.len() > limits.sentences {
        return Err(ApiError::new(
            413,
            format!(
                "`text` has {} sentences, and this server takes at most {} per request \
                 (--max-sentences): split the request",
                r.text.len(),
                limits.sentences
            ),
        ));
    }
    for (i, t) in r.text.iter().enumerate() {
        let chars = t.chars().count();
        if chars > limits.chars {
            return Err(ApiError::new(
                413,
                format!(
                    "sentence {} has {chars} characters, and this server takes at most {} \
                     (--max-chars): split it",
                    i + 1,
                    limits.chars
                ),
            ));
        }
        if t.contains(['\n', '\r']) {
            return Err(ApiError::new(
                422,
                format!(
                    "sentence {} holds a line break: send each sentence as its own string",
                    i + 1
                ),
            ));
        }
    }
    let mut search = defaults.clone();
    if let Some(b) = r.beam {
        if !(1..=MAX_BEAM).contains(&b) {
            return Err(ApiError::new(
                422,
                format!("`beam` is {b}: give 1 to {MAX_BEAM}"),
            ));
        }
        search.beam = b;
    }
    if let Some(a) = r.alpha {
        search.alpha = a;
    }
    if let Some(a) = r.max_len_a {
        if a < 0.0 {
            return Err(ApiError::new(
                422,
                format!("`max_len_a` is {a}: give 0 or more"),
            ));
        }
        search.max_len_a = a;
    }
    search.max_len_b = r.max_len_b.unwrap_or(search.max_len_b);
    search.greedy = r.greedy.unwrap_or(search.greedy);
    search.allow_unk = r.allow_unk.unwrap_or(search.allow_unk);
    if let Some(p) = r.length_penalty {
        search.length_penalty = p;
    }
    if let Some(s) = r.early_stop {
        search.early_stop = s;
    }
    if r.nbest == Some(0) {
        return Err(ApiError::new(422, "`nbest` is 0: give 1 or more"));
    }
    let opts = search
        .decode_options(r.nbest)
        .map_err(|e| ApiError::new(422, api_message(&e)))?;
    Ok(Translate {
        text: r.text,
        opts,
        nbest: r.nbest.unwrap_or(1),
    })
}

/// What kind of JSON value `v` is, as a message names it.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// A command-line error said for a JSON client: the message and its fix, with the
/// flags' names turned into the request's fields.
pub(crate) fn api_message(e: &kiln_dsl::Error) -> String {
    let mut s = e.message().to_string();
    if let Some(h) = e.help_text() {
        s = format!("{s}; {h}");
    }
    for (flag, field) in [
        ("--nbest", "nbest"),
        ("--beam", "beam"),
        ("--greedy", "greedy"),
    ] {
        s = s.replace(flag, field);
    }
    s
}

/// One hypothesis as JSON: its text, its tokens (the vocabulary's pieces), its score
/// (the log-probability over the length penalty) and its log-probability.
fn hypothesis(tokenizer: &Tokenizer, h: &Hypothesis) -> Value {
    let tokens: Vec<String> = h
        .tokens
        .iter()
        .map(|&t| tokenizer.id_to_token(t).unwrap_or_default())
        .collect();
    json!({
        "text": tokenizer.decode(&h.tokens),
        "tokens": tokens,
        "score": h.score,
        "log_prob": h.log_prob,
    })
}

/// The answer to a translate request: per sentence its best hypothesis, and with
/// `nbest` > 1 all of them under `nbest`. An empty sentence has the empty translation.
pub(crate) fn translations(
    tokenizer: &Tokenizer,
    per_line: &[Vec<Hypothesis>],
    nbest: usize,
) -> Value {
    let empty = Hypothesis {
        tokens: Vec::new(),
        score: 0.0,
        log_prob: 0.0,
    };
    let out: Vec<Value> = per_line
        .iter()
        .map(|hyps| {
            let mut best = hypothesis(tokenizer, hyps.first().unwrap_or(&empty));
            if nbest > 1 {
                let all: Vec<Value> = hyps.iter().map(|h| hypothesis(tokenizer, h)).collect();
                best["nbest"] = Value::Array(all);
            }
            best
        })
        .collect();
    json!({ "translations": out })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `kiln serve`'s search flags left at their defaults.
    fn defaults() -> SearchArgs {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            search: SearchArgs,
        }
        <Flags as clap::Parser>::parse_from(["kiln"]).search
    }

    const LIMITS: Limits = Limits {
        sentences: 4,
        chars: 20,
        body_bytes: 1 << 20,
    };

    fn refused(body: &str) -> ApiError {
        parse_translate(body.as_bytes(), &defaults(), &LIMITS).unwrap_err()
    }

    #[test]
    fn a_request_takes_the_servers_search_unless_it_says_otherwise() {
        let t = parse_translate(br#"{"text": ["a b", ""]}"#, &defaults(), &LIMITS).unwrap();
        assert_eq!(t.text, ["a b", ""]);
        assert_eq!((t.opts.beam, t.opts.greedy, t.nbest), (4, false, 1));
        let body =
            br#"{"text": ["a"], "beam": 2, "nbest": 2, "alpha": 1.0, "length_penalty": "none"}"#;
        let t = parse_translate(body, &defaults(), &LIMITS).unwrap();
        assert_eq!((t.opts.beam, t.nbest), (2, 2));
        assert_eq!(
            t.opts.penalty,
            kiln_decode::search::LengthPenalty::parse("none", 1.0).unwrap()
        );
    }

    /// Each bad request is refused with its own status and a message that names the
    /// field and the fix.
    #[test]
    fn bad_requests_are_refused_with_what_to_change() {
        let long = format!(r#"{{"text": ["{}"]}}"#, "x".repeat(21));
        for (body, status, want) in [
            (r#"{"text": ["a"#, 400, "malformed JSON: EOF while parsing"),
            ("not json", 400, "malformed JSON: expected ident"),
            (r#"["a"]"#, 422, "the body is a JSON array, not an object"),
            ("null", 422, "the body is a JSON null, not an object"),
            (r#"{"beam": 4}"#, 422, "missing field `text`"),
            (
                r#"{"text": "a"}"#,
                422,
                "invalid type: string \"a\", expected a sequence",
            ),
            (
                r#"{"text": [1]}"#,
                422,
                "invalid type: integer `1`, expected a string",
            ),
            (
                r#"{"text": ["a"], "beem": 4}"#,
                422,
                "unknown field `beem`, expected one of",
            ),
            (r#"{"text": []}"#, 422, "`text` is empty"),
            (
                r#"{"text": ["a","b","c","d","e"]}"#,
                413,
                "at most 4 per request (--max-sentences)",
            ),
            (
                &long,
                413,
                "sentence 1 has 21 characters, and this server takes at most 20",
            ),
            (
                r#"{"text": ["a\nb"]}"#,
                422,
                "sentence 1 holds a line break",
            ),
            (
                r#"{"text": ["a"], "beam": 0}"#,
                422,
                "`beam` is 0: give 1 to 256",
            ),
            (
                r#"{"text": ["a"], "beam": -1}"#,
                422,
                "invalid value: integer `-1`",
            ),
            (
                r#"{"text": ["a"], "nbest": 5}"#,
                422,
                "nbest 5 asks for more hypotheses than the search keeps (4",
            ),
            (r#"{"text": ["a"], "nbest": 0}"#, 422, "`nbest` is 0"),
            (
                r#"{"text": ["a"], "length_penalty": "x"}"#,
                422,
                "unknown length penalty `x`",
            ),
            (
                r#"{"text": ["a"], "early_stop": "never"}"#,
                422,
                "unknown stopping rule `never`",
            ),
            (
                r#"{"text": ["a"], "max_len_a": -1}"#,
                422,
                "`max_len_a` is -1: give 0 or more",
            ),
            (
                r#"{"text": ["a"], "greedy": "yes"}"#,
                422,
                "invalid type: string \"yes\", expected a boolean",
            ),
        ] {
            let e = refused(body);
            assert_eq!(e.status, status, "{body}: {}", e.message);
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
    }
}
