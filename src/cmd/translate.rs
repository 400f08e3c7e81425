//! `kiln translate`: beam search or greedy decoding of lines of text with a trained model
//! (a checkpoint, a run, an average or a compiled artifact).

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use kiln_compiler::artifact::TOKENIZER_FILE;
use kiln_compiler::tensor::Tensor;
use kiln_decode::search::{DecodeOptions, EarlyStop, Hypothesis, LengthPenalty};
use kiln_decode::translate::{
    check_sources, decode_workers, translate_nbest_ids, Batching, Schedule, StepModels,
};
use kiln_dsl::Error;
use kiln_exec::artifact::{is_artifact_dir, Artifact};
use kiln_exec::executor::{executor, Exec, ExecutorKind};
use kiln_train::data::Tokenizer;
use kiln_train::model;

use crate::args::SearchArgs;
use crate::input::Chunks;
use crate::{err, plain};

/// What `kiln translate` runs: a model directory's, or a compiled artifact's.
pub(crate) struct Translator {
    pub(crate) encode: Box<dyn Exec>,
    pub(crate) step: Box<dyn Exec>,
    pub(crate) params: BTreeMap<String, Tensor>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) vocab: usize,
}

impl Translator {
    /// The programs, parameters and vocabulary the batch functions decode with.
    pub(crate) fn step_models(&self) -> StepModels<'_> {
        StepModels {
            encode: &*self.encode,
            step: &*self.step,
            params: &self.params,
            vocab: self.vocab,
        }
    }
}

/// `kind` `None`: the CUDA executor (a `--target cuda` artifact only).
pub(crate) fn translator(path: &Path, kind: Option<ExecutorKind>) -> Result<Translator, Error> {
    let cuda = kind.is_none();
    let kind = kind.unwrap_or(ExecutorKind::Compiled);
    if is_artifact_dir(path) {
        let art = Artifact::load(path).map_err(err("kiln::artifact"))?;
        let Some(bytes) = art.tokenizer_json() else {
            return Err(plain(
                "kiln::translate",
                format!(
                    "the artifact `{}` carries no tokenizer, so it cannot translate text",
                    path.display()
                ),
                Some(
                    "compile it from a trained model: `kiln compile --from-model RUN_OR_CHECKPOINT -o DIR`"
                        .to_string(),
                ),
            ));
        };
        let origin = path.join(TOKENIZER_FILE);
        let tokenizer = Tokenizer::from_json(&String::from_utf8_lossy(bytes), &origin)
            .map_err(err("kiln::artifact"))?;
        let ex = |name: &str| -> Result<Box<dyn Exec>, Error> {
            if cuda {
                kiln_exec::cuda::executor_for(&art, name).map_err(|e| {
                    plain(
                        "kiln::cuda",
                        e,
                        Some("`--executor compiled` runs the artifact's CPU code".to_string()),
                    )
                })
            } else if kind == ExecutorKind::Compiled {
                Ok(Box::new(art.executor(name).map_err(err("kiln::artifact"))?))
            } else {
                let g = art.entry(name).map_err(err("kiln::artifact"))?;
                executor(kind, g.manifest.graph.clone()).map_err(err("kiln::model"))
            }
        };
        let encode = ex("encode")?;
        let mut step = ex("decode_step")?;
        share_arena(encode.as_ref(), step.as_mut());
        let params = art.weights().map_err(err("kiln::artifact"))?;
        let width = model::logits_width(step.graph());
        model::check_vocab(&tokenizer, width, &origin).map_err(err("kiln::artifact"))?;
        let vocab = width.unwrap_or(tokenizer.vocab_size());
        return Ok(Translator {
            encode,
            step,
            params,
            tokenizer,
            vocab,
        });
    }
    if cuda {
        return Err(plain(
            "kiln::translate",
            format!(
                "`--executor cuda` runs a compiled CUDA artifact, and `{}` is a model directory",
                path.display()
            ),
            Some(format!(
                "compile one first: `kiln compile --from-model {} --target cuda -o DIR`, then \
                 `kiln translate DIR --executor cuda`",
                path.display()
            )),
        ));
    }
    let m = model::load(path).map_err(err("kiln::model"))?;
    let encode = executor(kind, m.graphs.encode.clone()).map_err(err("kiln::model"))?;
    let mut step = executor(kind, m.graphs.decode_step.clone()).map_err(err("kiln::model"))?;
    share_arena(encode.as_ref(), step.as_mut());
    let vocab = m.graphs.vocab().unwrap_or(m.tokenizer.vocab_size());
    Ok(Translator {
        encode,
        step,
        params: m.params,
        tokenizer: m.tokenizer,
        vocab,
    })
}

/// The encoder runs once per batch and the decoder step after it, never at once: compiled
/// CPU programs share one arena, as large as the larger layout, as the trainer's do.
pub(crate) fn share_arena(encode: &dyn Exec, step: &mut dyn Exec) {
    if let Some(arena) = encode.arena() {
        step.share_arena(&arena);
    }
}

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
    let kind = (a.executor != ExecutorKind::Cuda).then_some(a.executor);
    let m = translator(&a.checkpoint, kind)?;
    let opts = decode_options(&a)?;
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
        let (srcs, which) = encode_lines(&m, &lines, first_line)?;
        // A progress bar on a terminal, for input that comes whole.
        let bar = progress_bar(srcs.len(), a.batching.sentences, "sentences")
            .filter(|_| input.is_whole());
        let hyps = with_progress(bar, |done| {
            let schedule = Schedule {
                batching: a.batching,
                workers,
            };
            let nbest = a.nbest.unwrap_or(1);
            translate_nbest_ids(m.step_models(), &srcs, &opts, nbest, schedule, done)
        })
        .map_err(err("kiln::translate"))?;
        sentences += srcs.len();
        src_tokens += srcs.iter().map(|s| s.len()).sum::<usize>();
        out_tokens += hyps
            .iter()
            .map(|h| h.first().map_or(0, |h| h.tokens.len()))
            .sum::<usize>();
        // Per input line: its hypotheses (none for an empty line).
        let mut out: Vec<Vec<Hypothesis>> = vec![Vec::new(); lines.len()];
        for (i, h) in which.into_iter().zip(hyps) {
            out[i] = h;
        }
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

/// The search `a` asks for, checked.
fn decode_options(t: &TranslateArgs) -> Result<DecodeOptions, Error> {
    let a = &t.search;
    let penalty = LengthPenalty::parse(&a.length_penalty, a.alpha).ok_or_else(|| {
        plain(
            "kiln::translate",
            format!("unknown length penalty `{}`", a.length_penalty),
            Some("use gnmt, len_pow or none".to_string()),
        )
    })?;
    let early_stop = EarlyStop::parse(&a.early_stop).ok_or_else(|| {
        plain(
            "kiln::translate",
            format!("unknown stopping rule `{}`", a.early_stop),
            Some(format!("use {}", EarlyStop::NAMES.join(" or "))),
        )
    })?;
    let opts = DecodeOptions {
        beam: a.beam,
        greedy: a.greedy,
        allow_unk: a.allow_unk,
        penalty,
        early_stop,
        max_len_a: a.max_len_a,
        max_len_b: a.max_len_b,
        ..DecodeOptions::default()
    };
    if let Some(n) = t.nbest {
        let keep = if opts.greedy { 1 } else { opts.beam };
        if n > keep {
            return Err(plain(
                "kiln::translate",
                format!(
                    "--nbest {n} asks for more hypotheses than the search keeps ({keep}, {})",
                    if opts.greedy {
                        "greedy".to_string()
                    } else {
                        format!("--beam {}", opts.beam)
                    }
                ),
                Some(if opts.greedy {
                    "drop --greedy, or ask for --nbest 1".to_string()
                } else {
                    format!("use --beam {n} or more, or --nbest {keep} or fewer")
                }),
            ));
        }
    }
    Ok(opts)
}

/// The token ids of the non-empty lines of a chunk whose first line is input line
/// `first_line` (counted from 0), and which line of the chunk each is.
fn encode_lines(
    m: &Translator,
    lines: &[String],
    first_line: usize,
) -> Result<(Vec<Vec<i32>>, Vec<usize>), Error> {
    let mut srcs = Vec::new();
    let mut which = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if !l.trim().is_empty() {
            let ids = m.tokenizer.encode(l).map_err(|e| {
                plain(
                    "kiln::translate",
                    format!("line {}: {e}", first_line + i + 1),
                    None,
                )
            })?;
            srcs.push(ids);
            which.push(i);
        }
    }
    let line = |i: usize| format!("line {}", first_line + which[i] + 1);
    check_sources(m.encode.as_ref(), &srcs, &line)
        .map_err(|e| plain("kiln::translate", e, None))?;
    Ok((srcs, which))
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
