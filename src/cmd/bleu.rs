//! `kiln bleu`: corpus BLEU with sacreBLEU's semantics.

use std::path::PathBuf;

use kiln_decode::bleu::{corpus_bleu, BleuOptions, Smooth, Tokenize};
use kiln_dsl::Error;

use crate::plain;

// `kiln bleu`'s arguments (their help is `kiln bleu --help`).
#[derive(clap::Args)]
pub struct BleuArgs {
    /// Reference file(s), one segment per line (repeat for several references).
    #[arg(long = "ref", required = true)]
    pub refs: Vec<PathBuf>,
    /// Hypothesis file; standard input when absent.
    pub hyp: Option<PathBuf>,
    /// Lowercase before tokenizing.
    #[arg(long)]
    pub lowercase: bool,
    /// Tokenizer: `13a` or `none`.
    #[arg(long, default_value = "13a", value_parser = ["13a", "none"])]
    pub tokenize: String,
    /// Smoothing: `exp` (sacreBLEU's default), `none`, `floor` or `add-k`.
    #[arg(long, default_value = "exp", value_parser = ["none", "exp", "floor", "add-k"])]
    pub smooth: String,
    /// The value for `floor` (default 0.1) or `add-k` (default 1).
    #[arg(long)]
    pub smooth_value: Option<f64>,
    /// Print only the score.
    #[arg(long)]
    pub score_only: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn bleu(a: BleuArgs) -> Result<(), Error> {
    let BleuArgs {
        refs,
        hyp,
        lowercase,
        tokenize,
        smooth,
        smooth_value,
        score_only,
        json,
    } = a;

    if smooth_value.is_some() && !matches!(smooth.as_str(), "floor" | "add-k") {
        return Err(plain(
            "kiln::usage",
            format!(
                "--smooth-value sets the value of `floor` or `add-k` smoothing, not of `{smooth}`"
            ),
            Some("add `--smooth floor` or `--smooth add-k`, or drop --smooth-value".to_string()),
        ));
    }
    let read = |p: &PathBuf| -> Result<Vec<String>, Error> {
        kiln_train::data::read_lines(p).map_err(|e| plain("kiln::io", e.to_string(), None))
    };
    let hyps = match &hyp {
        Some(p) => read(p)?,
        None => {
            let mut t = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut t)
                .map_err(|e| plain("kiln::io", format!("cannot read standard input: {e}"), None))?;
            lines(&t)
        }
    };
    let refs = refs.iter().map(read).collect::<Result<Vec<_>, _>>()?;
    let opts = BleuOptions {
        lowercase,
        tokenize: if tokenize == "none" {
            Tokenize::None
        } else {
            Tokenize::V13a
        },
        smooth: match smooth.as_str() {
            "none" => Smooth::None,
            "floor" => Smooth::Floor(smooth_value.unwrap_or(0.1)),
            "add-k" => Smooth::AddK(smooth_value.unwrap_or(1.0)),
            _ => Smooth::Exp,
        },
    };
    let b =
        corpus_bleu(&hyps, &refs, &opts).map_err(|e| plain("kiln::bleu", e.to_string(), None))?;
    if json {
        let mut v = serde_json::to_value(&b).expect("BLEU serializes");
        v["signature"] = opts.signature(refs.len()).into();
        outln!(
            "{}",
            serde_json::to_string_pretty(&v).expect("BLEU serializes")
        );
    } else if score_only {
        outln!("{:.2}", b.score);
    } else {
        outln!("{b}");
    }
    Ok(())
}

/// Lines of a text, without line terminators (a final newline ends the last line).
fn lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.trim_end_matches('\r').to_string())
        .collect()
}
