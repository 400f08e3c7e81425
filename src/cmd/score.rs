//! `kiln score`: teacher-forced log-probabilities of reference translations.

use std::io::Write;
use std::path::{Path, PathBuf};

use kiln_decode::search::DecodeOptions;
use kiln_decode::translate::{
    check_references, check_sources, decode_workers, score_ids, Batching, Schedule,
};
use kiln_dsl::Error;
use kiln_exec::executor::ExecutorKind;

use crate::cmd::translate::{executor_label, progress_bar, with_progress};
use crate::input::read_text_lines;
use crate::{err, plain};
use kiln::translator::Translator;

pub struct ScoreArgs {
    pub checkpoint: PathBuf,
    pub src: PathBuf,
    pub reference: PathBuf,
    pub normalize: bool,
    pub batching: Batching,
    pub executor: ExecutorKind,
    /// Pair batches scored at once (`None`: `decode_workers`).
    pub workers: Option<usize>,
}

/// `kiln score`: the log-probability of each reference under teacher forcing.
pub fn score(a: ScoreArgs) -> Result<(), Error> {
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
    let m = Translator::load(&a.checkpoint, a.executor)?;
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
    let src_line = |i: usize| format!("`{}` line {}", a.src.display(), which[i] + 1);
    let ref_line = |i: usize| {
        let line = which[i] + 1;
        format!(
            "`{}` line {line} (<bos> and its tokens)",
            a.reference.display()
        )
    };
    check_sources(m.encode.as_ref(), &srcs, &src_line)
        .and_then(|()| check_references(m.step.as_ref(), &refs, &ref_line))
        .map_err(|e| plain("kiln::score", e, None))?;
    let started = std::time::Instant::now();
    let bar = progress_bar(srcs.len(), a.batching.sentences, "sentence pairs");
    let scores = with_progress(bar, |done| {
        let schedule = Schedule {
            batching: a.batching,
            workers: a.workers.unwrap_or_else(|| decode_workers(&*m.step)),
        };
        score_ids(m.step_models(), (&srcs, &refs), &opts, schedule, done)
    })
    .map_err(err("kiln::score"))?;
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
        executor_label(a.executor),
    );
    Ok(())
}
