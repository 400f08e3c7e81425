//! `kiln translate`: beam search or greedy decoding of lines of text with a trained model
//! (a checkpoint, a run, an average or a compiled artifact).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use kiln::translator::Translator;
use kiln_decode::search::Hypothesis;
use kiln_decode::translate::{decode_workers, Batching, Schedule};
use kiln_dsl::Error;
use kiln_exec::executor::ExecutorKind;
use kiln_train::data::Tokenizer;

use crate::args::SearchArgs;
use crate::input::Chunks;
use crate::plain;

pub struct TranslateArgs {
    pub checkpoint: PathBuf,
    pub input: Option<PathBuf>,
    pub search: SearchArgs,
    /// Print the N best hypotheses of each sentence in the Moses n-best format.
    pub nbest: Option<usize>,
    /// How the sentences are cut into batches.
    pub batching: Batching,
    pub executor: ExecutorKind,
    /// Batches decoded at once (`None`: `decode_workers`).
    pub workers: Option<usize>,
}

/// A progress bar over `n` items on a terminal, when they take more than one batch.
pub(crate) fn progress_bar(n: usize, batch: usize, unit: &str) -> Option<indicatif::ProgressBar> {
    (std::io::stderr().is_terminal() && n > batch).then(|| {
        let b = indicatif::ProgressBar::new(n as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(&format!(
                "{{elapsed_precise}} [{{bar:30}}] {{pos}}/{{len}} {unit}"
            ))
            .expect("valid template")
            .progress_chars("=> "),
        );
        b
    })
}

/// `job` given a callback that moves `bar` (if any) to the count it is passed; the bar is
/// cleared after.
pub(crate) fn with_progress<T>(
    bar: Option<indicatif::ProgressBar>,
    job: impl FnOnce(&mut dyn FnMut(usize)) -> T,
) -> T {
    let out = job(&mut |n| {
        if let Some(b) = &bar {
            b.set_position(n as u64);
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    out
}

/// Chunks of standard input hold this many batches for each worker (as CTranslate2 reads
/// ahead 16 batches): enough to sort by length and keep every worker busy.
const CHUNK_BATCHES: usize = 16;

pub fn translate(a: TranslateArgs) -> Result<(), Error> {
    let m = Translator::load(&a.checkpoint, a.executor)?;
    let opts = a.search.decode_options(a.nbest)?;
    let workers = a.workers.unwrap_or_else(|| decode_workers(&*m.step));
    let cap = a
        .batching
        .sentences
        .saturating_mul(workers)
        .saturating_mul(CHUNK_BATCHES);
    let mut input = Chunks::open(a.input.as_deref(), cap)?;
    let stdout = std::io::stdout();
    let mut w = std::io::BufWriter::new(stdout.lock());
    let write_err = |e: std::io::Error| plain("kiln::io", format!("cannot write: {e}"), None);
    let (mut sentences, mut src_tokens, mut out_tokens) = (0usize, 0usize, 0usize);
    // Each chunk's translations are written, in input order, before the next is read.
    // The time is the chunks' own, from arrival to output, not the wait for input.
    let (mut first_line, mut busy) = (0, std::time::Duration::ZERO);
    while let Some(lines) = input.next_chunk()? {
        let started = std::time::Instant::now();
        let line = |i: usize| format!("line {}", first_line + i + 1);
        let src = m.encode_lines(&lines, &line)?;
        // A progress bar on a terminal, for input that comes whole.
        let bar = progress_bar(src.ids.len(), a.batching.sentences, "sentences")
            .filter(|_| input.is_whole());
        let out = with_progress(bar, |done| {
            let schedule = Schedule {
                batching: a.batching,
                workers,
            };
            m.translate_sources(&src, &opts, (a.nbest.unwrap_or(1), schedule), done)
        })?;
        sentences += src.ids.len();
        src_tokens += src.ids.iter().map(|s| s.len()).sum::<usize>();
        out_tokens += out
            .iter()
            .map(|h| h.first().map_or(0, |h| h.tokens.len()))
            .sum::<usize>();
        write_translations(&mut w, &m.tokenizer, a.nbest, first_line, &out).map_err(write_err)?;
        w.flush().map_err(write_err)?;
        first_line += lines.len();
        busy += started.elapsed();
    }
    let secs = busy.as_secs_f64();
    // A summary line on standard error, as fairseq and Marian print one.
    tell!(
        "translated {sentences} sentence{} ({src_tokens} source and {out_tokens} output \
         tokens) in {secs:.2} s: {:.1} sentences/s, {:.0} output tokens/s ({}, {})",
        if sentences == 1 { "" } else { "s" },
        sentences as f64 / secs.max(1e-9),
        out_tokens as f64 / secs.max(1e-9),
        if opts.greedy {
            "greedy".to_string()
        } else {
            format!("beam {}", opts.beam)
        },
        executor_label(a.executor),
    );
    Ok(())
}

/// A chunk's translations, a line each, or with `nbest` its hypotheses in the Moses
/// n-best format, lines numbered from `first_line`.
fn write_translations(
    w: &mut dyn Write,
    tokenizer: &Tokenizer,
    nbest: Option<usize>,
    first_line: usize,
    out: &[Vec<Hypothesis>],
) -> std::io::Result<()> {
    for (k, hyps) in out.iter().enumerate() {
        let i = first_line + k;
        match nbest {
            None => {
                let text = hyps
                    .first()
                    .map(|h| tokenizer.decode(&h.tokens))
                    .unwrap_or_default();
                writeln!(w, "{text}")?;
            }
            // An empty input line has the empty translation, with probability 1.
            Some(_) if hyps.is_empty() => writeln!(w, "{i} |||  ||| log_prob= 0 ||| 0")?,
            Some(_) => {
                for h in hyps {
                    writeln!(
                        w,
                        "{i} ||| {} ||| log_prob= {} ||| {}",
                        tokenizer.decode(&h.tokens),
                        h.log_prob as f32,
                        h.score as f32
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// The executor as a summary names it: with the products' kernel where the compiled
/// executor runs them in 16 bits (`--gemm-type`).
pub(crate) fn executor_label(executor: ExecutorKind) -> String {
    match kiln_exec::compiled::default_products() {
        Some(kernel) if executor == ExecutorKind::Compiled => {
            format!("compiled, {} products", kernel.key())
        }
        _ => executor.to_string(),
    }
}
