//! Which checkpoints `kiln average` takes from a run: the last N (`--last`), the N with
//! the best validation (`--best`, by the run's `valid.metric`), or those given; and the
//! record of that choice written beside the averaged model (`average.yaml`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_dsl::Error;
use kiln_train::checkpoint::{self, Checkpoint};
use kiln_train::metrics::{read_metrics, Kind, Record};

use crate::{err, plain};

/// The averaged model's record of what was averaged.
pub const RECORD_FILE: &str = "average.yaml";

/// How the checkpoints were chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// As given on the command line.
    Given,
    /// The run's newest `n`.
    Last(usize),
    /// The run's `n` best validations by `metric` (`bleu` or `loss`); `scores` has each
    /// chosen step's validation `(loss, bleu)`.
    Best {
        n: usize,
        metric: String,
        scores: BTreeMap<u64, (f64, Option<f64>)>,
    },
}

impl Choice {
    /// In words (`last 5`, `best 5 by bleu`), unless given.
    pub fn how(&self) -> Option<String> {
        match self {
            Choice::Given => None,
            Choice::Last(n) => Some(format!("last {n}")),
            Choice::Best { n, metric, .. } => Some(format!("best {n} by {metric}")),
        }
    }

    /// `average.yaml`'s text for the model directories `dirs`: their steps (where their
    /// names give them), the choice, and the chosen validations.
    pub fn record(&self, dirs: &[PathBuf]) -> String {
        let steps: Vec<String> = dirs
            .iter()
            .map(|d| {
                let name = d.file_name().and_then(|n| n.to_str()).unwrap_or("");
                match checkpoint::parse_dir_name(name) {
                    Some(s) => s.to_string(),
                    None => format!("{:?}", d.display().to_string()),
                }
            })
            .collect();
        let mut text = format!(
            "# What `kiln average` averaged into this model.\naveraged: [{}]\nchosen: {}\n",
            steps.join(", "),
            self.how().unwrap_or_else(|| "as given".to_string())
        );
        if let Choice::Best { scores, .. } = self {
            text.push_str("validation:\n");
            for (step, (loss, bleu)) in scores {
                let bleu = bleu.map_or(String::new(), |b| format!(", bleu: {b}"));
                text.push_str(&format!("  {step}: {{loss: {loss}{bleu}}}\n"));
            }
        }
        text
    }
}

/// The run directory of `--last` / `--best` (one input) and its checkpoints, oldest
/// first; `flag` names the option in errors.
fn run_checkpoints(inputs: &[PathBuf], flag: &str) -> Result<(PathBuf, Vec<Checkpoint>), Error> {
    let [run] = inputs else {
        return Err(plain(
            "kiln::average",
            format!(
                "{flag} takes one run directory, but {} inputs were given",
                inputs.len()
            ),
            Some("give the run directory (`checkpoint.dir`) alone".to_string()),
        ));
    };
    let (run, root) = if run.join("checkpoints").is_dir() {
        (run.clone(), run.join("checkpoints"))
    } else {
        (
            run.parent().unwrap_or(Path::new(".")).to_path_buf(),
            run.clone(),
        )
    };
    let all = checkpoint::list(&root).map_err(err("kiln::average"))?;
    if all.is_empty() {
        return Err(plain(
            "kiln::average",
            format!("`{}` holds no checkpoints", root.display()),
            Some("give the directory of a run (`checkpoint.dir`) that has saved some".into()),
        ));
    }
    Ok((run, all))
}

/// The error for `flag n` when only `have` of what it takes are there (`steps`).
fn too_few(flag: &str, n: usize, what: String, steps: &[u64], fix: String) -> Error {
    let list: Vec<String> = steps.iter().map(u64::to_string).collect();
    plain(
        "kiln::average",
        format!(
            "{flag} {n} asks for {n} checkpoints, but {what} {} ({} {})",
            steps.len(),
            if steps.len() == 1 { "step" } else { "steps" },
            list.join(", ")
        ),
        Some(fix),
    )
}

/// `kiln average --last N RUN`: the run's newest `n` checkpoints, oldest first.
pub fn last_checkpoints(inputs: &[PathBuf], n: usize) -> Result<(Vec<PathBuf>, Choice), Error> {
    let (run, all) = run_checkpoints(inputs, "--last")?;
    if all.len() < n {
        let steps: Vec<u64> = all.iter().map(|c| c.step).collect();
        let what = format!("`{}` has", run.join("checkpoints").display());
        let fix = format!(
            "average fewer (--last {}), or keep more with checkpoint.keep",
            all.len()
        );
        return Err(too_few("--last", n, what, &steps, fix));
    }
    let dirs = all[all.len() - n..].iter().map(|c| c.dir.clone()).collect();
    Ok((dirs, Choice::Last(n)))
}

/// `kiln average --best N RUN`: the run's `n` checkpoints whose validation was best by
/// the run's `valid.metric` (BLEU, highest first, when the run computed it; else the
/// loss, lowest first; a tie goes to the later step), oldest first. Only checkpoints
/// taken at a validation's step have a score (`metrics.jsonl`).
pub fn best_checkpoints(inputs: &[PathBuf], n: usize) -> Result<(Vec<PathBuf>, Choice), Error> {
    let (run, all) = run_checkpoints(inputs, "--best")?;
    let cfg_path = run.join(kiln_train::model::CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| {
        plain(
            "kiln::average",
            format!("cannot read `{}`: {e}", cfg_path.display()),
            Some(
                "--best reads the run's configuration and metrics.jsonl: give a run directory"
                    .into(),
            ),
        )
    })?;
    let cfg = kiln_train::config::Config::parse(&text).map_err(|e| {
        plain(
            "kiln::average",
            format!("`{}`: {e}", cfg_path.display()),
            None,
        )
    })?;
    let metric = cfg.valid.best_metric().to_string();
    let log = run.join(kiln_train::metrics::FILE_NAME);
    let records = read_metrics(&log).map_err(err("kiln::average"))?;
    // The last validation logged at each step (a resumed run redoes none).
    let mut scores: BTreeMap<u64, (f64, Option<f64>)> = BTreeMap::new();
    for r in records.iter().filter(|r| r.kind == Kind::Valid) {
        if let Record { loss: Some(l), .. } = r {
            scores.insert(r.step, (*l, r.bleu));
        }
    }
    let key = |step: u64| -> Option<f64> {
        let (loss, bleu) = scores.get(&step)?;
        if metric == "bleu" {
            bleu.map(|b| -b)
        } else {
            Some(*loss)
        }
    };
    let mut scored: Vec<(f64, &Checkpoint)> =
        all.iter().filter_map(|c| Some((key(c.step)?, c))).collect();
    if scored.len() < n {
        let steps: Vec<u64> = scored.iter().map(|(_, c)| c.step).collect();
        let what = format!("the run's validations ({metric}) score");
        let fix = format!(
            "average fewer (--best {}), or validate at every checkpoint's step \
             (checkpoint.every a multiple of valid.every) and keep more with checkpoint.keep",
            scored.len().max(1)
        );
        return Err(too_few("--best", n, what, &steps, fix));
    }
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.step.cmp(&a.1.step)));
    let mut chosen: Vec<&Checkpoint> = scored[..n].iter().map(|(_, c)| *c).collect();
    chosen.sort_by_key(|c| c.step);
    let scores = chosen.iter().map(|c| (c.step, scores[&c.step])).collect();
    let dirs = chosen.iter().map(|c| c.dir.clone()).collect();
    Ok((dirs, Choice::Best { n, metric, scores }))
}
