//! `kiln train`: a run from a configuration, or resumed, around the runtime's trainer.

use std::path::PathBuf;

use kiln_compiler::artifact::TOKENIZER_FILE;
use kiln_dsl::Error;
use kiln_exec::artifact::Artifact;
use kiln_train::config::Config;
use kiln_train::data::Tokenizer;
use kiln_train::model;
use kiln_train::tokenizer::prepare_tokenizer;
use kiln_train::trainer::{Progress, Trainer};

use crate::{err, plain};

// `kiln train`'s arguments (their help is `kiln train --help`).
#[derive(clap::Args)]
pub struct TrainArgs {
    /// The configuration of a new run.
    #[arg(long, conflicts_with = "resume")]
    pub config: Option<PathBuf>,
    /// Continue the run in this directory from its newest checkpoint.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Override `train.max_steps`: the step the run trains to, counted from its start.
    #[arg(long, value_parser = crate::args::total_steps)]
    pub max_steps: Option<u64>,
    /// Override `train.max_seconds` (stop after this long, with a checkpoint).
    #[arg(long)]
    pub max_seconds: Option<u64>,
    /// Override `checkpoint.dir` (the run directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Start from this compiled artifact (`kiln compile --config CONFIG.yaml -o DIR`)
    /// instead of compiling the spec: sets `model.artifact`.
    #[arg(long, conflicts_with = "resume")]
    pub artifact: Option<PathBuf>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Override `train.gemm_type` (see `kiln run --help`; a resumed run keeps its own).
    #[arg(long, value_name = "TYPE", conflicts_with = "resume",
          value_parser = kiln_exec::compiled::GemmType::NAMES)]
    pub gemm_type: Option<String>,
    /// No progress output.
    #[arg(long)]
    pub quiet: bool,
}

pub fn train(a: TrainArgs) -> Result<(), Error> {
    // The thread pool is sized before any parallel work: from the command line, else
    // from the configuration (the run directory's, when resuming).
    let threads = a.threads.or_else(|| {
        let path = match (&a.config, &a.resume) {
            (Some(p), _) => p.clone(),
            (None, Some(d)) => d.join(kiln_train::model::CONFIG_FILE),
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
            kiln_train::run_dir::check_new_run_dir(&cfg).map_err(err("kiln::train"))?;
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
                    let graphs = kiln::build::compile_graphs(&cfg, tok.vocab_size())?;
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
        // A resumed run says the steps it took, and where they took it.
        let took = if s.steps_taken == s.steps {
            format!("{} steps", s.steps)
        } else {
            format!("{} steps (to step {})", s.steps_taken, s.steps)
        };
        say!(
            "trained {took} in {:.1}s ({:.0} tokens/s); last training loss {:.4}{}{}",
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
                kiln_train::trainer::scale_text(scale),
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
