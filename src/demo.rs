//! `kiln demo`: the whole job on an embedded default, with no files needed.
//!
//! It generates a translation-like task (reverse a sentence and translate each of its 100
//! words through a fixed lexicon), trains the paper's architecture at a small size for
//! about a minute with the paper's recipe (Adam, warmup, label smoothing, token batches),
//! then beam-decodes a held-out set and reports exact-match accuracy and BLEU.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln_dsl::Error;
use kiln_runtime::bleu::{corpus_bleu, BleuOptions};
use kiln_runtime::config::Config;
use kiln_runtime::decode::{DecodeOptions, LengthPenalty};
use kiln_runtime::synthetic::Task;
use kiln_runtime::train::{prepare_tokenizer, translate_ids, Progress, Trainer};

use crate::plain;
use crate::train_cmds::{compile_graphs, err};

/// The base spec, embedded so the demo runs anywhere.
const BASE: &str = include_str!("../models/transformer_base.kiln");

pub struct DemoArgs {
    pub seconds: u64,
    pub dir: Option<PathBuf>,
}

pub fn demo(a: DemoArgs) -> Result<(), Error> {
    let dir = a
        .dir
        .unwrap_or_else(|| std::env::temp_dir().join(format!("kiln-demo-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| {
        plain(
            "kiln::io",
            format!("cannot create `{}`: {e}", dir.display()),
            None,
        )
    })?;
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text).map_err(|e| {
            plain(
                "kiln::io",
                format!("cannot write `{}`: {e}", dir.join(name).display()),
                None,
            )
        })
    };
    // The task: 3 to 8 words; disjoint draws for training, validation and test.
    let task = Task::new(2026, 3, 8);
    let (train, valid, test) = (
        task.pairs(1, 20_000),
        task.pairs(2, 100),
        task.pairs(3, 200),
    );
    for (name, pairs) in [("train", &train), ("valid", &valid)] {
        write(&format!("{name}.src"), &join(pairs.iter().map(|p| &p.0)))?;
        write(&format!("{name}.tgt"), &join(pairs.iter().map(|p| &p.1)))?;
    }
    write("transformer_base.kiln", BASE)?;
    write(
        "demo.yaml",
        &format!(
            "model:\n  spec: transformer_base.kiln\n  set: {{d_model: 64, d_ff: 256, h: 4, n: 2, p_drop: 0.0, eps_ls: 0.1}}\n\
             data: {{train_src: train.src, train_tgt: train.tgt, valid_src: valid.src, valid_tgt: valid.tgt, vocab_size: 256, max_len: 32}}\n\
             batch: {{max_src_tokens: 1200, max_tgt_tokens: 1200, update_freq: 1}}\n\
             schedule: {{warmup: 300, factor: 2.0}}\n\
             train: {{max_steps: 100000, max_seconds: {}, executor: eager, log_every: 50, seed: 1}}\n\
             checkpoint: {{dir: run, every: 100000, keep: 1}}\n\
             valid: {{every: 250, beam: 4, max_sentences: 50}}\n",
            a.seconds
        ),
    )?;
    println!("kiln demo — the paper's Transformer, small, on a generated translation task");
    println!("  task: reverse a sentence of 3-8 words and translate every word (100-word lexicon)");
    println!("  e.g. {:?} → {:?}", train[0].0, train[0].1);
    println!("  working directory: {}", dir.display());
    let cfg = Config::load(&dir.join("demo.yaml")).map_err(err("kiln::config"))?;
    let (tok, note) = prepare_tokenizer(&cfg).map_err(err("kiln::train"))?;
    println!("  {note}");
    let graphs = compile_graphs(&cfg, tok.vocab_size())?;
    let mut trainer =
        Trainer::new(cfg, tok.clone(), &graphs, Progress::Auto).map_err(err("kiln::train"))?;
    for n in trainer.notes() {
        println!("  {n}");
    }
    println!("  training for about {} seconds ...", a.seconds);
    let s = trainer.run().map_err(err("kiln::train"))?;
    println!(
        "  trained {} steps in {:.0}s ({:.0} tokens/s); training loss {:.3}",
        s.steps, s.seconds, s.tokens_per_second, s.last_loss
    );
    // Held-out test set, beam 4 with the paper's length penalty.
    let start = Instant::now();
    let set = trainer.graphs();
    let encode =
        kiln_runtime::exec::executor(kiln_runtime::exec::ExecutorKind::Eager, set.encode.clone())
            .map_err(err("kiln::demo"))?;
    let step = kiln_runtime::exec::executor(
        kiln_runtime::exec::ExecutorKind::Eager,
        set.decode_step.clone(),
    )
    .map_err(err("kiln::demo"))?;
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
    let hyps = translate_ids(&*encode, &*step, trainer.params(), &srcs, &opts, vocab)
        .map_err(err("kiln::demo"))?;
    let hyps: Vec<String> = hyps.iter().map(|h| tok.decode(h)).collect();
    let refs: Vec<String> = test.iter().map(|p| p.1.clone()).collect();
    let exact = hyps.iter().zip(&refs).filter(|(h, r)| h == r).count();
    let bleu =
        corpus_bleu(&hyps, &[refs.clone()], &BleuOptions::default()).map_err(err("kiln::demo"))?;
    println!(
        "  beam search (beam 4, α 0.6) on {} held-out sentences in {:.1}s:",
        test.len(),
        start.elapsed().as_secs_f64()
    );
    for i in 0..3.min(test.len()) {
        println!(
            "    {}  →  {}{}",
            test[i].0,
            hyps[i],
            if hyps[i] == refs[i] { "" } else { "   ✗" }
        );
    }
    println!(
        "  exact match: {}/{} = {:.1}%   {}",
        exact,
        test.len(),
        100.0 * exact as f64 / test.len() as f64,
        bleu
    );
    println!(
        "  run directory (checkpoint, metrics.jsonl, training.png): {}",
        Path::new(&dir).join("run").display()
    );
    Ok(())
}

fn join<'a>(lines: impl Iterator<Item = &'a String>) -> String {
    let mut s = String::new();
    for l in lines {
        s.push_str(l);
        s.push('\n');
    }
    s
}
