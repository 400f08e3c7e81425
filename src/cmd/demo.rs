//! `kiln demo`: the whole job on an embedded default, with no files needed.
//!
//! It generates a translation-like task (reverse a sentence and translate each of its 100
//! words through a fixed lexicon), trains the paper's architecture at a small size for
//! about a minute with the paper's recipe (Adam, warmup, label smoothing, token batches),
//! then beam-decodes a held-out set and reports exact-match accuracy and BLEU.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln_compiler::tensor::Tensor;
use kiln_decode::bleu::{corpus_bleu, BleuOptions};
use kiln_decode::search::{DecodeOptions, LengthPenalty};
use kiln_decode::translate::{
    decode_workers, translate_ids, Batching, Schedule, StepModels, TRANSLATE_BATCH,
};
use kiln_dsl::Error;
use kiln_train::checkpoint;
use kiln_train::config::Config;
use kiln_train::data::Tokenizer;
use kiln_train::synthetic::Task;
use kiln_train::tokenizer::prepare_tokenizer;
use kiln_train::trainer::{Progress, Trainer};

use crate::{err, plain};
use kiln::build::compile_graphs;

/// The base spec, embedded so the demo runs anywhere.
const BASE: &str = include_str!("../../models/transformer_base.kiln");

pub struct DemoArgs {
    pub seconds: u64,
    /// A fixed number of steps instead of a time budget: the same result on every run.
    pub steps: Option<u64>,
    pub dir: Option<PathBuf>,
}

/// Everything the demo writes into its directory.
const DEMO_ENTRIES: [&str; 10] = [
    "demo.yaml",
    "transformer_base.kiln",
    "train.src",
    "train.tgt",
    "valid.src",
    "valid.tgt",
    "test.src",
    "test.tgt",
    "test.hyp",
    "run",
];

/// Makes `dir` ready for a demo: a missing or empty directory is used as it is; one that an
/// earlier demo wrote (it has `demo.yaml` and nothing but [`DEMO_ENTRIES`]) is cleared of
/// those entries. Anything else is refused, so `--dir` never deletes a user's files.
fn clear_demo_dir(dir: &Path) -> Result<(), Error> {
    let fail = |message: String| {
        plain(
            "kiln::demo",
            message,
            Some(
                "give `--dir` a new or empty directory (or one an earlier `kiln demo` wrote)"
                    .to_string(),
            ),
        )
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) if dir.exists() && !dir.is_dir() => {
            return Err(fail(format!(
                "`{}` is not a directory ({e})",
                dir.display()
            )))
        }
        Err(e) => return Err(fail(format!("cannot read `{}`: {e}", dir.display()))),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| fail(format!("cannot read `{}`: {e}", dir.display())))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    if names.is_empty() {
        return Ok(());
    }
    let foreign: Vec<&String> = names
        .iter()
        .filter(|n| !DEMO_ENTRIES.contains(&n.as_str()))
        .collect();
    if !foreign.is_empty() || !names.iter().any(|n| n == "demo.yaml") {
        let shown: Vec<String> = foreign.iter().take(5).map(|n| format!("`{n}`")).collect();
        let what = if foreign.is_empty() {
            "no `demo.yaml`".to_string()
        } else {
            format!(
                "files the demo does not write ({}{})",
                shown.join(", "),
                if foreign.len() > shown.len() {
                    ", …"
                } else {
                    ""
                }
            )
        };
        return Err(fail(format!(
            "`{}` is not empty and holds {what}: the demo replaces the contents of its \
             directory, so it only reuses one that an earlier demo wrote",
            dir.display()
        )));
    }
    for name in &names {
        let path = dir.join(name);
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|e| fail(format!("cannot remove `{}`: {e}", path.display())))?;
    }
    Ok(())
}

pub fn demo(a: DemoArgs) -> Result<(), Error> {
    let dir = a
        .dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("kiln-demo-{}", std::process::id())));
    clear_demo_dir(&dir)?;
    std::fs::create_dir_all(&dir).map_err(|e| {
        plain(
            "kiln::io",
            format!("cannot create `{}`: {e}", dir.display()),
            None,
        )
    })?;
    let test = write_inputs(&dir, &a)?;
    let cfg = Config::load(&dir.join("demo.yaml")).map_err(err("kiln::config"))?;
    let (tok, note) = prepare_tokenizer(&cfg).map_err(err("kiln::train"))?;
    outln!("  {note}");
    let graphs = compile_graphs(&cfg, tok.vocab_size())?;
    let mut trainer =
        Trainer::new(cfg, tok.clone(), &graphs, Progress::Auto).map_err(err("kiln::train"))?;
    for n in trainer.notes() {
        outln!("  {n}");
    }
    match a.steps {
        Some(n) => outln!("  training for {n} steps ..."),
        None => outln!("  training for about {} seconds ...", a.seconds),
    }
    let s = trainer.run().map_err(err("kiln::train"))?;
    outln!(
        "  trained {} steps in {:.0}s ({:.0} tokens/s); training loss {:.3}",
        s.steps,
        s.seconds,
        s.tokens_per_second,
        s.last_loss
    );
    let best = evaluate_test(&trainer, &tok, &test, s.steps)?;
    write_file(&dir, "test.src", &join(test.iter().map(|p| &p.0)))?;
    write_file(&dir, "test.tgt", &join(test.iter().map(|p| &p.1)))?;
    write_file(&dir, "test.hyp", &join(best.hyps.iter()))?;
    outln!(
        "  run directory (checkpoints, metrics.jsonl, training.png): {}",
        Path::new(&dir).join("run").display()
    );
    outln!(
        "  test set and beam output: {}/test.{{src,tgt,hyp}}",
        dir.display()
    );
    Ok(())
}

fn write_file(dir: &Path, name: &str, text: &str) -> Result<(), Error> {
    std::fs::write(dir.join(name), text).map_err(|e| {
        plain(
            "kiln::io",
            format!("cannot write `{}`: {e}", dir.join(name).display()),
            None,
        )
    })
}

/// Writes the task's training and validation data, the spec and the config into `dir`,
/// says what the demo does, and returns the held-out test pairs.
fn write_inputs(dir: &Path, a: &DemoArgs) -> Result<Vec<(String, String)>, Error> {
    // The task: 3 to 8 words; disjoint draws for training, validation and test.
    let task = Task::new(2026, 3, 8);
    let (train, valid, test) = (
        task.pairs(1, 20_000),
        task.pairs(2, 100),
        task.pairs(3, 200),
    );
    for (name, pairs) in [("train", &train), ("valid", &valid)] {
        write_file(
            dir,
            &format!("{name}.src"),
            &join(pairs.iter().map(|p| &p.0)),
        )?;
        write_file(
            dir,
            &format!("{name}.tgt"),
            &join(pairs.iter().map(|p| &p.1)),
        )?;
    }
    write_file(dir, "transformer_base.kiln", BASE)?;
    write_file(
        dir,
        "demo.yaml",
        &format!(
            "model:\n  spec: transformer_base.kiln\n  set: {{d_model: 48, d_ff: 96, h: 4, n: 2, p_drop: 0.0, eps_ls: 0.1}}\n\
             data: {{train_src: train.src, train_tgt: train.tgt, valid_src: valid.src, valid_tgt: valid.tgt, vocab_size: 256, byte_fallback: false, max_len: 32}}\n\
             batch: {{max_src_tokens: 600, max_tgt_tokens: 600, update_freq: 1}}\n\
             schedule: {{warmup: 300, factor: 1.0}}\n\
             train: {{max_steps: {}, max_seconds: {}, executor: compiled, log_every: 50, seed: 1}}\n\
             checkpoint: {{dir: run, every: 100, keep: 5}}\n\
             valid: {{every: 250, beam: 4, max_sentences: 50}}\n",
            a.steps.unwrap_or(100_000),
            if a.steps.is_some() {
                0
            } else {
                a.seconds
            }
        ),
    )?;
    outln!("kiln demo — the paper's Transformer, small, on a generated translation task");
    outln!("  task: reverse a sentence of 3-8 words and translate every word (100-word lexicon)");
    outln!("  e.g. {:?} → {:?}", train[0].0, train[0].1);
    outln!("  working directory: {}", dir.display());
    Ok(test)
}

/// Beam-decodes the held-out test set (beam 4, the paper's length penalty) with the last
/// weights, then with the average of the last five checkpoints (the paper averages the
/// last 5 or 20), prints both and three examples, and returns the better.
fn evaluate_test(
    trainer: &Trainer,
    tok: &Tokenizer,
    test: &[(String, String)],
    steps: u64,
) -> Result<Scored, Error> {
    let set = trainer.graphs();
    let kind = kiln_exec::executor::ExecutorKind::Compiled;
    let encode =
        kiln_exec::executor::executor(kind, set.encode.clone()).map_err(err("kiln::demo"))?;
    let step =
        kiln_exec::executor::executor(kind, set.decode_step.clone()).map_err(err("kiln::demo"))?;
    let srcs: Vec<Vec<i32>> = test
        .iter()
        .map(|(s, _)| tok.encode(s))
        .collect::<Result<_, _>>()
        .map_err(err("kiln::demo"))?;
    let opts = DecodeOptions {
        beam: 4,
        penalty: LengthPenalty::Gnmt(0.6),
        ..DecodeOptions::default()
    };
    let vocab = set.vocab().unwrap_or(tok.vocab_size());
    let refs: Vec<String> = test.iter().map(|p| p.1.clone()).collect();
    let evaluate = |params: &BTreeMap<String, Tensor>| -> Result<Scored, Error> {
        let start = Instant::now();
        let models = StepModels {
            encode: &*encode,
            step: &*step,
            params,
            vocab,
        };
        let schedule = Schedule {
            batching: Batching::sentences(TRANSLATE_BATCH),
            workers: decode_workers(&*step),
        };
        let hyps = translate_ids(models, &srcs, &opts, schedule, &mut |_| {})
            .map_err(err("kiln::demo"))?;
        let hyps: Vec<String> = hyps.iter().map(|h| tok.decode(h)).collect();
        let exact = hyps.iter().zip(&refs).filter(|(h, r)| h == r).count();
        let bleu = corpus_bleu(&hyps, std::slice::from_ref(&refs), &BleuOptions::default())
            .map_err(err("kiln::demo"))?;
        Ok(Scored {
            line: format!(
                "exact match {}/{} = {:.1}%   {}",
                exact,
                refs.len(),
                100.0 * exact as f64 / refs.len() as f64,
                bleu
            ),
            hyps,
            seconds: start.elapsed().as_secs_f64(),
            rank: (exact, bleu.score),
        })
    };
    let last = evaluate(trainer.params())?;
    let ckpts = checkpoint::list(&trainer.checkpoint_root()).map_err(err("kiln::demo"))?;
    let recent: Vec<&checkpoint::Checkpoint> = ckpts.iter().rev().take(5).rev().collect();
    let averaged = if recent.len() >= 2 {
        let dirs: Vec<&Path> = recent.iter().map(|c| c.dir.as_path()).collect();
        let p = checkpoint::average(&dirs).map_err(err("kiln::demo"))?;
        Some(evaluate(&p)?)
    } else {
        None
    };
    outln!(
        "  beam search (beam 4, α 0.6) on {} held-out sentences, {:.1}s:",
        test.len(),
        last.seconds
    );
    // The result is the better of the two (the average is usually, not always: a short
    // run's early checkpoints pull it back), and says which it is.
    let use_average = averaged.as_ref().is_some_and(|a| a.rank >= last.rank);
    let which = match (&averaged, use_average) {
        (Some(_), true) => "the average",
        (Some(_), false) => "the last weights, better than the average",
        (None, _) => "the last weights",
    };
    let best = match &averaged {
        Some(a) if use_average => a,
        _ => &last,
    };
    for i in 0..3.min(test.len()) {
        outln!(
            "    {}  →  {}{}",
            test[i].0,
            best.hyps[i],
            if best.hyps[i] == refs[i] {
                ""
            } else {
                "   ✗"
            }
        );
    }
    outln!("  last weights (step {steps}):      {}", last.line);
    if let Some(a) = &averaged {
        let steps: Vec<String> = recent.iter().map(|c| c.step.to_string()).collect();
        outln!(
            "  average of {} checkpoints (steps {}):  {}",
            recent.len(),
            steps.join(", "),
            a.line
        );
    }
    outln!("  result ({which}): {}", best.line);
    Ok(match averaged {
        Some(a) if use_average => a,
        _ => last,
    })
}

/// One decoding of the test set.
struct Scored {
    line: String,
    hyps: Vec<String>,
    seconds: f64,
    /// Exact matches, then BLEU: what ranks two models' results.
    rank: (usize, f64),
}

fn join<'a>(lines: impl Iterator<Item = &'a String>) -> String {
    let mut s = String::new();
    for l in lines {
        s.push_str(l);
        s.push('\n');
    }
    s
}
