//! `kiln train`, `translate`, `average`, `export` and `import`: argument handling around
//! the runtime's trainer, decoder, checkpoints and interop.

use std::collections::BTreeMap;
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

use kiln_compiler::artifact::TOKENIZER_FILE;
use kiln_compiler::tensor::{load_safetensors, save_safetensors, Tensor};
use kiln_dsl::{Error, Mode, Options};
use kiln_runtime::artifact::{is_artifact_dir, Artifact};
use kiln_runtime::config::Config;
use kiln_runtime::data::Tokenizer;
use kiln_runtime::decode::{DecodeOptions, Hypothesis, LengthPenalty};
use kiln_runtime::exec::{executor, Exec, ExecutorKind};
use kiln_runtime::model;
use kiln_runtime::train::{
    check_positions, decode_workers, prepare_tokenizer, score_ids, translate_nbest_ids,
    ModelGraphs, Progress, Trainer,
};

use crate::outputs::Output;
use crate::plain;

/// `println!` that does not panic when standard output is closed (`kiln train … | head`):
/// the reports of these commands are not their product, and a finished run is not undone
/// by a reader that went away. (`kiln translate` and `score` write their output with
/// errors checked.)
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `eprintln!` that does not panic when standard error is closed (see `say!`).
macro_rules! tell {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

pub fn err<E: std::fmt::Display>(code: &'static str) -> impl Fn(E) -> Error {
    move |e| plain(code, e.to_string(), None)
}

/// Compiles the spec of a configuration in the three modes the trainer needs.
pub fn compile_graphs(cfg: &Config, vocab: usize) -> Result<ModelGraphs, Error> {
    let mut overrides = cfg.overrides();
    overrides.retain(|o| !o.starts_with("vocab="));
    overrides.push(format!("vocab={vocab}"));
    let compile = |mode| {
        kiln_dsl::compile_file(
            &cfg.model.spec,
            &Options {
                overrides: overrides.clone(),
                mode,
                model: cfg.model.name.clone(),
            },
        )
    };
    Ok(ModelGraphs {
        train: compile(Mode::Train)?,
        eval: compile(Mode::Eval)?,
        decode: compile(Mode::Decode)?,
    })
}

pub struct TrainArgs {
    pub config: Option<PathBuf>,
    pub resume: Option<PathBuf>,
    pub max_steps: Option<u64>,
    pub max_seconds: Option<u64>,
    pub dir: Option<PathBuf>,
    /// `--artifact`: start from a compiled artifact (sets `model.artifact`).
    pub artifact: Option<PathBuf>,
    /// `--threads`; without it, the configuration's `train.threads` (0: one per core).
    pub threads: Option<usize>,
    /// `--gemm-type`: overrides `train.gemm_type` (a new run only).
    pub gemm_type: Option<String>,
    pub quiet: bool,
}

pub fn train(a: TrainArgs) -> Result<(), Error> {
    // The thread pool is sized before any parallel work: from the command line, else
    // from the configuration (the run directory's, when resuming).
    let threads = a.threads.or_else(|| {
        let path = match (&a.config, &a.resume) {
            (Some(p), _) => p.clone(),
            (None, Some(d)) => d.join(kiln_runtime::model::CONFIG_FILE),
            _ => return None,
        };
        Config::load(&path)
            .ok()
            .map(|c| c.train.threads)
            .filter(|&n| n > 0)
    });
    crate::set_threads(threads)?;
    if a.max_steps == Some(0) {
        return Err(plain(
            "kiln::train",
            "--max-steps 0 asks for no step at all".to_string(),
            Some("give at least 1 (when resuming, more than the run's step)".to_string()),
        ));
    }
    let progress = if a.quiet {
        Progress::Quiet
    } else {
        Progress::Auto
    };
    let mut trainer = match (&a.config, &a.resume) {
        (Some(path), None) => {
            let mut cfg = Config::load(path).map_err(|e| {
                plain(
                    "kiln::config",
                    e.to_string(),
                    Some("see models/configs/base.yaml for every key and its default".to_string()),
                )
            })?;
            if let Some(n) = a.max_steps {
                cfg.train.max_steps = n;
            }
            if let Some(s) = a.max_seconds {
                cfg.train.max_seconds = s;
            }
            if let Some(d) = &a.dir {
                cfg.checkpoint.dir = d.clone();
            }
            if let Some(art) = &a.artifact {
                cfg.model.artifact = Some(std::path::absolute(art).unwrap_or(art.clone()));
            }
            if let Some(g) = &a.gemm_type {
                cfg.train.gemm_type = Some(g.clone());
                cfg.check().map_err(|e| {
                    plain(
                        "kiln::train",
                        format!("with --gemm-type {g}: {e}"),
                        Some("leave --gemm-type out, or change the configuration".to_string()),
                    )
                })?;
            }
            // Before the tokenizer is trained or written into the run directory.
            kiln_runtime::train::check_new_run_dir(&cfg).map_err(err("kiln::train"))?;
            match cfg.model.artifact.clone() {
                Some(dir) => {
                    let art = Artifact::load(&dir).map_err(err("kiln::artifact"))?;
                    let tok = artifact_tokenizer(&art, &cfg, a.quiet)?;
                    Trainer::from_artifact(cfg, tok, &art, progress).map_err(err("kiln::train"))?
                }
                None => {
                    let (tok, note) = prepare_tokenizer(&cfg).map_err(err("kiln::train"))?;
                    if !a.quiet {
                        tell!("{note}");
                    }
                    let graphs = compile_graphs(&cfg, tok.vocab_size())?;
                    Trainer::new(cfg, tok, &graphs, progress).map_err(err("kiln::train"))?
                }
            }
        }
        (None, Some(dir)) => {
            let mut t = Trainer::resume(dir, progress).map_err(err("kiln::train"))?;
            if a.max_steps.is_some() || a.max_seconds.is_some() {
                t.set_limits(a.max_steps, a.max_seconds);
            }
            t
        }
        _ => {
            return Err(plain(
                "kiln::train",
                "give either `--config CONFIG.yaml` (a new run) or `--resume RUN_DIR`".to_string(),
                None,
            ))
        }
    };
    if !a.quiet {
        for n in trainer.notes() {
            tell!("{n}");
        }
    }
    let s = trainer.run().map_err(err("kiln::train"))?;
    // A resumed run whose patience was spent takes no step: only the reason is said.
    let idle = s.steps_taken == 0 && s.early_stop.is_some();
    if !a.quiet && s.steps_taken == 0 && !idle {
        // Resumed at its max_steps: no step, no loss, no speed to report.
        say!(
            "nothing to train: the run is at step {}, its train.max_steps; give a larger \
             --max-steps to train on",
            s.steps
        );
    } else if !a.quiet && !idle {
        say!(
            "trained {} steps in {:.1}s ({:.0} tokens/s); last training loss {:.4}{}{}",
            s.steps,
            s.seconds,
            s.tokens_per_second,
            s.last_loss,
            s.valid_loss
                .map(|l| format!(", validation loss {l:.4}"))
                .unwrap_or_default(),
            s.valid_bleu
                .map(|b| format!(", BLEU {b:.2}"))
                .unwrap_or_default()
        );
        if let Some(scale) = s.loss_scale {
            say!(
                "loss scale {}; {} step(s) skipped for overflowing gradients",
                kiln_runtime::train::scale_text(scale),
                s.overflows
            );
        }
        if let Some(c) = s.checkpoint {
            say!("checkpoint: {}", c.display());
        }
        if let Some(b) = s.best {
            say!("best model so far: {}", b.display());
        }
    }
    // Said even with --quiet: the run ended before max_steps.
    if let Some(why) = s.early_stop {
        tell!("{why}");
    }
    Ok(())
}

/// The tokenizer of a run started from an artifact: the artifact's own (also written to
/// the run directory), else the run's as `kiln train --config` prepares it.
fn artifact_tokenizer(art: &Artifact, cfg: &Config, quiet: bool) -> Result<Tokenizer, Error> {
    let Some(bytes) = art.tokenizer_json() else {
        let (tok, note) = prepare_tokenizer(cfg).map_err(err("kiln::train"))?;
        if !quiet {
            tell!("{note} (the artifact carries no tokenizer)");
        }
        return Ok(tok);
    };
    let origin = art.dir.join(TOKENIZER_FILE);
    let text = std::str::from_utf8(bytes).map_err(|_| {
        plain(
            "kiln::artifact",
            format!("`{}` is not UTF-8", origin.display()),
            None,
        )
    })?;
    let tok = Tokenizer::from_json(text, &origin).map_err(err("kiln::artifact"))?;
    let run = &cfg.checkpoint.dir;
    std::fs::create_dir_all(run)
        .and_then(|_| model::write_atomic(&run.join(TOKENIZER_FILE), bytes))
        .map_err(|e| {
            plain(
                "kiln::train",
                format!("cannot write `{}`: {e}", run.join(TOKENIZER_FILE).display()),
                None,
            )
        })?;
    if !quiet {
        tell!(
            "the artifact's BPE vocabulary ({} tokens)",
            tok.vocab_size()
        );
    }
    Ok(tok)
}

/// What `kiln translate` runs: a model directory's, or a compiled artifact's.
struct Translator {
    encode: Box<dyn Exec>,
    step: Box<dyn Exec>,
    params: BTreeMap<String, Tensor>,
    tokenizer: Tokenizer,
    vocab: usize,
}

/// `kind` `None`: the CUDA executor (a `--target cuda` artifact only).
fn translator(path: &Path, kind: Option<ExecutorKind>) -> Result<Translator, Error> {
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
                kiln_runtime::cuda::executor_for(&art, name).map_err(|e| {
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
        let mut encode = ex("encode")?;
        let mut step = ex("decode_step")?;
        share_arena(&mut encode, &mut step);
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
    let mut encode = executor(kind, m.graphs.encode.clone()).map_err(err("kiln::model"))?;
    let mut step = executor(kind, m.graphs.decode_step.clone()).map_err(err("kiln::model"))?;
    share_arena(&mut encode, &mut step);
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
fn share_arena(encode: &mut Box<dyn Exec>, step: &mut Box<dyn Exec>) {
    if let (Some(e), Some(s)) = (encode.as_compiled_mut(), step.as_compiled_mut()) {
        s.share_arena_with(e);
    }
}

pub struct TranslateArgs {
    pub checkpoint: PathBuf,
    pub input: Option<PathBuf>,
    pub beam: usize,
    pub alpha: f64,
    pub length_penalty: String,
    pub max_len_a: f64,
    pub max_len_b: usize,
    pub greedy: bool,
    /// Print the N best hypotheses of each sentence in the Moses n-best format.
    pub nbest: Option<usize>,
    /// Sentences decoded together.
    pub batch: usize,
    pub executor: String,
    /// Batches decoded at once (`None`: `decode_workers`).
    pub workers: Option<usize>,
}

/// The lines of a text file (standard input for `None`), without `\r` line ends.
fn read_text_lines(path: Option<&Path>) -> Result<Vec<String>, Error> {
    match path {
        // The corpus reader: CRLF, a byte-order mark, and invalid UTF-8 named by line.
        Some(p) => kiln_runtime::data::read_lines(p).map_err(err("kiln::io")),
        None => std::io::stdin()
            .lock()
            .lines()
            .map(|l| l.map(|l| l.trim_end_matches('\r').to_string()))
            .collect::<Result<_, _>>()
            .map_err(|e| plain("kiln::io", format!("cannot read standard input: {e}"), None)),
    }
}

/// A progress bar over `n` items on a terminal, when they take more than one batch.
fn progress_bar(n: usize, batch: usize, unit: &str) -> Option<indicatif::ProgressBar> {
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

pub struct ScoreArgs {
    pub checkpoint: PathBuf,
    pub src: PathBuf,
    pub reference: PathBuf,
    pub normalize: bool,
    pub batch: usize,
    pub executor: String,
    /// Pair batches scored at once (`None`: `decode_workers`).
    pub workers: Option<usize>,
}

/// `kiln score`: the log-probability of each reference under teacher forcing.
pub fn score(a: ScoreArgs) -> Result<(), Error> {
    let kind = match a.executor.as_str() {
        "cuda" => None,
        e => Some(ExecutorKind::parse(e).unwrap_or(ExecutorKind::Compiled)),
    };
    let srcs_text = read_text_lines(Some(&a.src))?;
    let refs_text = read_text_lines(Some(&a.reference))?;
    if srcs_text.len() != refs_text.len() {
        return Err(plain(
            "kiln::score",
            format!(
                "`{}` has {} lines but `{}` has {}",
                a.src.display(),
                srcs_text.len(),
                a.reference.display(),
                refs_text.len()
            ),
            Some("give one translation per source line, in the same order".to_string()),
        ));
    }
    let m = translator(&a.checkpoint, kind)?;
    let opts = DecodeOptions::default();
    let encode = |file: &Path, i: usize, line: &str| {
        m.tokenizer.encode(line).map_err(|e| {
            plain(
                "kiln::score",
                format!("{} line {}: {e}", file.display(), i + 1),
                None,
            )
        })
    };
    // Pairs with an empty source are not scored (a model has no source to attend to):
    // their output line stays empty.
    let (mut srcs, mut refs, mut which) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (s, r)) in srcs_text.iter().zip(&refs_text).enumerate() {
        if s.trim().is_empty() {
            continue;
        }
        srcs.push(encode(&a.src, i, s)?);
        refs.push(encode(&a.reference, i, r)?);
        which.push(i);
    }
    // Named by line here; `score_ids` would name them by their place among the scored.
    check_positions(
        m.encode.graph(),
        "src_len",
        srcs.len(),
        &|i| srcs[i].len(),
        &|i| format!("`{}` line {}", a.src.display(), which[i] + 1),
        "shorten it",
    )
    .and_then(|()| {
        check_positions(
            m.step.graph(),
            "tgt_len",
            refs.len(),
            &|i| refs[i].len() + 1,
            &|i| {
                format!(
                    "`{}` line {} (<bos> and its tokens)",
                    a.reference.display(),
                    which[i] + 1
                )
            },
            "shorten it",
        )
    })
    .map_err(|e| plain("kiln::score", e, None))?;
    let started = std::time::Instant::now();
    let bar = progress_bar(srcs.len(), a.batch, "sentence pairs");
    let scores = score_ids(
        &*m.encode,
        &*m.step,
        &m.params,
        &srcs,
        &refs,
        &opts,
        m.vocab,
        a.batch,
        a.workers.unwrap_or_else(|| decode_workers(&*m.step)),
        &mut |n| {
            if let Some(b) = &bar {
                b.set_position(n as u64);
            }
        },
    )
    .map_err(err("kiln::score"))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let secs = started.elapsed().as_secs_f64();
    let mut out = vec![String::new(); srcs_text.len()];
    let (mut total, mut tokens) = (0.0f64, 0usize);
    for ((&i, r), s) in which.iter().zip(&refs).zip(&scores) {
        let len = r.len() + 1;
        total += s;
        tokens += len;
        let v = if a.normalize { s / len as f64 } else { *s };
        out[i] = format!("{}", v as f32);
    }
    let stdout = std::io::stdout();
    let mut w = std::io::BufWriter::new(stdout.lock());
    let write_err = |e: std::io::Error| plain("kiln::io", format!("cannot write: {e}"), None);
    for l in out {
        writeln!(w, "{l}").map_err(write_err)?;
    }
    w.flush().map_err(write_err)?;
    let skipped = srcs_text.len() - which.len();
    if tokens == 0 {
        // No pair to score: no cross-entropy (it is not 0, nor the perplexity 1).
        tell!(
            "scored no sentence pairs: {}",
            if skipped > 0 {
                format!("all {skipped} sources are empty (their lines are left blank)")
            } else {
                "the input is empty".to_string()
            }
        );
        return Ok(());
    }
    let xent = -total / tokens as f64;
    tell!(
        "scored {} sentence pair{} ({tokens} target tokens with <eos>{}) in {secs:.1} s: \
         cross-entropy {xent:.4} nats/token, perplexity {:.2} ({})",
        which.len(),
        if which.len() == 1 { "" } else { "s" },
        if skipped > 0 {
            format!("; {skipped} with an empty source left blank")
        } else {
            String::new()
        },
        xent.exp(),
        executor_label(&a.executor),
    );
    Ok(())
}

pub fn translate(a: TranslateArgs) -> Result<(), Error> {
    let kind = match a.executor.as_str() {
        "cuda" => None,
        e => Some(ExecutorKind::parse(e).unwrap_or(ExecutorKind::Compiled)),
    };
    let m = translator(&a.checkpoint, kind)?;
    let penalty = LengthPenalty::parse(&a.length_penalty, a.alpha).ok_or_else(|| {
        plain(
            "kiln::translate",
            format!("unknown length penalty `{}`", a.length_penalty),
            Some("use gnmt, len_pow or none".to_string()),
        )
    })?;
    let opts = DecodeOptions {
        beam: a.beam,
        greedy: a.greedy,
        penalty,
        max_len_a: a.max_len_a,
        max_len_b: a.max_len_b,
        ..DecodeOptions::default()
    };
    if let Some(n) = a.nbest {
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
    let lines = read_text_lines(a.input.as_deref())?;
    let mut srcs = Vec::new();
    let mut which = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if !l.trim().is_empty() {
            let ids = m
                .tokenizer
                .encode(l)
                .map_err(|e| plain("kiln::translate", format!("line {}: {e}", i + 1), None))?;
            srcs.push(ids);
            which.push(i);
        }
    }
    check_positions(
        m.encode.graph(),
        "src_len",
        srcs.len(),
        &|i| srcs[i].len(),
        &|i| format!("line {}", which[i] + 1),
        "shorten it",
    )
    .map_err(|e| plain("kiln::translate", e, None))?;
    // A progress bar on a terminal; a summary line on standard error in any case, as
    // fairseq and Marian print one.
    let started = std::time::Instant::now();
    let bar = progress_bar(srcs.len(), a.batch, "sentences");
    let hyps = translate_nbest_ids(
        &*m.encode,
        &*m.step,
        &m.params,
        &srcs,
        &opts,
        m.vocab,
        a.batch,
        a.nbest.unwrap_or(1),
        a.workers.unwrap_or_else(|| decode_workers(&*m.step)),
        &mut |n| {
            if let Some(b) = &bar {
                b.set_position(n as u64);
            }
        },
    )
    .map_err(err("kiln::translate"))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let secs = started.elapsed().as_secs_f64();
    let tokens: usize = hyps
        .iter()
        .map(|h| h.first().map_or(0, |h| h.tokens.len()))
        .sum();
    // Per input line: its hypotheses (none for an empty line).
    let mut out: Vec<Vec<Hypothesis>> = vec![Vec::new(); lines.len()];
    for (i, h) in which.into_iter().zip(hyps) {
        out[i] = h;
    }
    let stdout = std::io::stdout();
    let mut w = std::io::BufWriter::new(stdout.lock());
    let write_err = |e: std::io::Error| plain("kiln::io", format!("cannot write: {e}"), None);
    for (i, hyps) in out.iter().enumerate() {
        match a.nbest {
            None => {
                let text = hyps
                    .first()
                    .map(|h| m.tokenizer.decode(&h.tokens))
                    .unwrap_or_default();
                writeln!(w, "{text}").map_err(write_err)?;
            }
            // An empty input line has the empty translation, with probability 1.
            Some(_) if hyps.is_empty() => {
                writeln!(w, "{i} |||  ||| log_prob= 0 ||| 0").map_err(write_err)?
            }
            Some(_) => {
                for h in hyps {
                    writeln!(
                        w,
                        "{i} ||| {} ||| log_prob= {} ||| {}",
                        m.tokenizer.decode(&h.tokens),
                        h.log_prob as f32,
                        h.score as f32
                    )
                    .map_err(write_err)?;
                }
            }
        }
    }
    w.flush()
        .map_err(|e| plain("kiln::io", format!("cannot write: {e}"), None))?;
    tell!(
        "translated {} sentence{} ({} source and {tokens} output tokens) in {secs:.1} s: \
         {:.1} sentences/s, {:.0} output tokens/s ({}, {})",
        srcs.len(),
        if srcs.len() == 1 { "" } else { "s" },
        srcs.iter().map(|s| s.len()).sum::<usize>(),
        srcs.len() as f64 / secs.max(1e-9),
        tokens as f64 / secs.max(1e-9),
        if opts.greedy {
            "greedy".to_string()
        } else {
            format!("beam {}", opts.beam)
        },
        executor_label(&a.executor),
    );
    Ok(())
}

/// The executor as a summary names it: with the products' kernel where the compiled
/// executor runs them in 16 bits (`--gemm-type`, `KILN_CPU_BF16`).
fn executor_label(executor: &str) -> String {
    match kiln_runtime::compiled::default_products() {
        Some(kernel) if executor == "compiled" => format!("compiled, {} products", kernel.key()),
        _ => executor.to_string(),
    }
}

/// `kiln average --last N RUN`: the run's newest `n` checkpoints, oldest first.
pub fn last_checkpoints(inputs: &[PathBuf], n: usize) -> Result<Vec<PathBuf>, Error> {
    let [run] = inputs else {
        return Err(plain(
            "kiln::average",
            format!(
                "--last takes one run directory, but {} inputs were given",
                inputs.len()
            ),
            Some("give the run directory (`checkpoint.dir`) alone".to_string()),
        ));
    };
    let root = if run.join("checkpoints").is_dir() {
        run.join("checkpoints")
    } else {
        run.clone()
    };
    let all = kiln_runtime::checkpoint::list(&root).map_err(err("kiln::average"))?;
    if all.is_empty() {
        return Err(plain(
            "kiln::average",
            format!("`{}` holds no checkpoints", root.display()),
            Some("give the directory of a run (`checkpoint.dir`) that has saved some".into()),
        ));
    }
    if all.len() < n {
        let steps: Vec<String> = all.iter().map(|c| c.step.to_string()).collect();
        return Err(plain(
            "kiln::average",
            format!(
                "--last {n} asks for {n} checkpoints, but `{}` has {} ({} {})",
                root.display(),
                all.len(),
                if all.len() == 1 { "step" } else { "steps" },
                steps.join(", ")
            ),
            Some(format!(
                "average fewer (--last {}), or keep more with checkpoint.keep",
                all.len()
            )),
        ));
    }
    Ok(all[all.len() - n..].iter().map(|c| c.dir.clone()).collect())
}

/// Refuses an average of the same checkpoint twice, and an output that would overwrite an
/// input, a checkpoint or a run directory (`inputs` as given, `dirs` the model directories
/// they name).
fn check_average_paths(inputs: &[PathBuf], dirs: &[PathBuf], output: &Path) -> Result<(), Error> {
    let mut seen: Vec<(PathBuf, &Path)> = Vec::new();
    for (given, dir) in inputs.iter().zip(dirs) {
        let Some(c) = crate::outputs::canonical(dir) else {
            continue;
        };
        if let Some((_, first)) = seen.iter().find(|(s, _)| *s == c) {
            let message = if *first == given.as_path() {
                format!("`{}` is given twice", given.display())
            } else {
                format!(
                    "`{}` and `{}` are the same checkpoint (`{}`)",
                    first.display(),
                    given.display(),
                    dir.display()
                )
            };
            return Err(plain(
                "kiln::average",
                message,
                Some("average distinct checkpoints (each counts once in the mean)".to_string()),
            ));
        }
        seen.push((c, given));
    }
    let all: Vec<&Path> = inputs.iter().chain(dirs).map(|p| p.as_path()).collect();
    let kind = if output.extension().and_then(|e| e.to_str()) == Some("safetensors") {
        Output::File
    } else {
        Output::Model
    };
    crate::outputs::check("kiln::average", output, &all, kind)
}

pub fn average(inputs: &[PathBuf], output: &Path) -> Result<(), Error> {
    let dirs: Vec<PathBuf> = inputs
        .iter()
        .map(|p| {
            if p.is_dir() {
                model::resolve(p).map_err(err("kiln::average"))
            } else {
                Ok(p.clone())
            }
        })
        .collect::<Result<_, _>>()?;
    check_average_paths(inputs, &dirs, output)?;
    // Checkpoint directories: their graphs and tokenizer checked as `kiln translate`
    // would, and the same for all (one run's checkpoints).
    let mut files: Option<(&Path, model::ModelFiles)> = None;
    for dir in dirs.iter().filter(|d| d.is_dir()) {
        let these = model::read_files(dir).map_err(err("kiln::average"))?;
        let Some((first, reference)) = &files else {
            files = Some((dir, these));
            continue;
        };
        for (name, same) in [
            (
                model::GRAPHS_FILE,
                these.graphs.to_json() == reference.graphs.to_json(),
            ),
            (
                model::TOKENIZER_FILE,
                these.tokenizer.to_json().ok() == reference.tokenizer.to_json().ok(),
            ),
        ] {
            if !same {
                return Err(plain(
                    "kiln::average",
                    format!(
                        "`{}` differs from `{}`: these are checkpoints of different models \
                         or runs ({})",
                        dir.join(name).display(),
                        first.join(name).display(),
                        if name == model::GRAPHS_FILE {
                            "another spec or other spec settings"
                        } else {
                            "another vocabulary: other training data or vocab_size"
                        }
                    ),
                    Some("average checkpoints of one run only".to_string()),
                ));
            }
        }
    }
    let refs: Vec<&Path> = dirs.iter().map(|p| p.as_path()).collect();
    let avg = kiln_runtime::checkpoint::average(&refs).map_err(err("kiln::average"))?;
    if let Some((first, f)) = &files {
        let weights = first.join(kiln_runtime::checkpoint::MODEL_FILE);
        kiln_runtime::entry::check_weights(&f.graphs.loss, &weights.display().to_string(), &avg)
            .map_err(|e| {
                plain(
                    "kiln::average",
                    e.message,
                    Some(format!(
                        "`{}` does not fit the checkpoint's `{}`: average intact checkpoints",
                        weights.display(),
                        model::GRAPHS_FILE
                    )),
                )
            })?;
    }
    if output.extension().and_then(|e| e.to_str()) == Some("safetensors") {
        let list: Vec<(String, Tensor)> = avg.into_iter().collect();
        save_safetensors(output, &list, None).map_err(err("kiln::average"))?;
    } else {
        let first_is_dir = dirs.first().is_some_and(|d| d.is_dir());
        let Some((_, f)) = files.filter(|_| first_is_dir) else {
            return Err(plain(
                "kiln::average",
                "averaging safetensors files gives weights only; name the output `*.safetensors`".to_string(),
                Some("or average checkpoint directories to get a model directory for `kiln translate`".to_string()),
            ));
        };
        model::save_dir(output, &avg, &f.graphs_json, &f.tokenizer_json)
            .map_err(err("kiln::average"))?;
    }
    let steps: Vec<String> = dirs
        .iter()
        .filter_map(|d| d.file_name()?.to_str())
        .filter_map(kiln_runtime::checkpoint::parse_dir_name)
        .map(|s| s.to_string())
        .collect();
    say!(
        "averaged {} checkpoint{}{} into {}",
        inputs.len(),
        if inputs.len() == 1 { "" } else { "s" },
        if steps.len() == dirs.len() {
            let word = if steps.len() == 1 { "step" } else { "steps" };
            format!(" ({word} {})", steps.join(", "))
        } else {
            String::new()
        },
        output.display()
    );
    Ok(())
}

/// Weights from a model directory or a safetensors file.
/// The weights of a model directory (loaded and checked against its graphs, as `kiln
/// translate` loads them) or of a plain safetensors file ([`plain_weights`]).
fn weights_of(input: &Path) -> Result<BTreeMap<String, Tensor>, Error> {
    if input.is_dir() {
        return Ok(model::load(input).map_err(err("kiln::model"))?.params);
    }
    plain_weights(input)
}

/// A safetensors file of weights with no model beside it: its tensors must be floats,
/// and finite.
fn plain_weights(file: &Path) -> Result<BTreeMap<String, Tensor>, Error> {
    let w = load_safetensors(file).map_err(err("kiln::file"))?;
    if let Some((name, t)) = w
        .iter()
        .find(|(_, t)| !matches!(t.dtype_name(), "f32" | "f64"))
    {
        return Err(plain(
            "kiln::file",
            format!(
                "tensor `{name}` in `{}` is {}, but weights are floats",
                file.display(),
                t.dtype_name()
            ),
            Some("give a file of model weights (F32)".to_string()),
        ));
    }
    kiln_runtime::entry::check_finite(&file.display().to_string(), &w)
        .map_err(crate::runtime_error)?;
    Ok(w)
}

pub fn export(format: &str, input: &Path, output: &Path) -> Result<(), Error> {
    check_format(format)?;
    crate::outputs::check("kiln::export", output, &[input], Output::File)?;
    let w = weights_of(input)?;
    let t = kiln_runtime::interop::to_torch(&w).map_err(err("kiln::export"))?;
    let list: Vec<(String, Tensor)> = t.into_iter().collect();
    save_safetensors(output, &list, None).map_err(err("kiln::export"))?;
    say!(
        "wrote {} tensors in nn.Transformer naming to {}",
        list.len(),
        output.display()
    );
    Ok(())
}

pub fn import(format: &str, input: &Path, output: &Path) -> Result<(), Error> {
    check_format(format)?;
    crate::outputs::check("kiln::import", output, &[input], Output::File)?;
    let w = plain_weights(input)?;
    let k = kiln_runtime::interop::from_torch(&w).map_err(err("kiln::import"))?;
    let list: Vec<(String, Tensor)> = k.into_iter().collect();
    save_safetensors(output, &list, None).map_err(err("kiln::import"))?;
    say!(
        "wrote {} tensors in kiln naming to {}",
        list.len(),
        output.display()
    );
    Ok(())
}

fn check_format(format: &str) -> Result<(), Error> {
    if format == "torch" {
        Ok(())
    } else {
        Err(plain(
            "kiln::interop",
            format!("unknown weight format `{format}`"),
            Some("the supported format is `torch` (PyTorch nn.Transformer names)".to_string()),
        ))
    }
}
