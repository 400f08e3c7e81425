//! Where a run reports: the progress bar or plain lines on standard error, and the
//! metrics log (`metrics.jsonl`) in the run directory.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use super::{Progress, TrainError};
use crate::metrics::{MetricsWriter, Record};

pub(super) struct Report {
    bar: Option<indicatif::ProgressBar>,
    /// Plain lines: progress asked for, and no bar to draw it on.
    lines: bool,
    metrics: MetricsWriter,
    path: PathBuf,
}

impl Report {
    /// Opens the metrics log of run directory `dir` (appending), and the bar at step `at`
    /// of `total` when standard error is a terminal.
    pub(super) fn open(
        dir: &Path,
        progress: Progress,
        total: u64,
        at: u64,
    ) -> Result<Report, TrainError> {
        let path = dir.join(crate::metrics::FILE_NAME);
        let metrics = MetricsWriter::open(&path).map_err(|e| TrainError::Write {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let bar = match progress {
            Progress::Auto if std::io::stderr().is_terminal() => {
                let b = indicatif::ProgressBar::new(total);
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{elapsed_precise} [{bar:30}] step {pos}/{len} {msg}",
                    )
                    .expect("valid template")
                    .progress_chars("=> "),
                );
                b.set_position(at);
                Some(b)
            }
            _ => None,
        };
        let lines = matches!(progress, Progress::Auto | Progress::Lines) && bar.is_none();
        Ok(Report {
            bar,
            lines,
            metrics,
            path,
        })
    }

    /// Whether the per-interval progress lines are printed.
    pub(super) fn lines(&self) -> bool {
        self.lines
    }

    /// A line of progress, unless the run is quiet.
    pub(super) fn say(&self, msg: &str) {
        if self.bar.is_some() || self.lines {
            self.warn(msg);
        }
    }

    /// A line that is printed even when the run is quiet.
    pub(super) fn warn(&self, msg: &str) {
        use std::io::Write;
        match &self.bar {
            Some(b) => b.println(msg),
            None => {
                let _ = writeln!(std::io::stderr().lock(), "{msg}");
            }
        }
    }

    /// Moves the bar to `step`, with `msg` beside it.
    pub(super) fn bar(&self, step: u64, msg: impl FnOnce() -> String) {
        if let Some(b) = &self.bar {
            b.set_position(step);
            b.set_message(msg());
        }
    }

    /// Appends `record` to the metrics log.
    pub(super) fn record(&mut self, record: &Record) -> Result<(), TrainError> {
        self.metrics.write(record).map_err(|e| TrainError::Write {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }

    pub(super) fn finish(self) {
        if let Some(b) = self.bar {
            b.finish_and_clear();
        }
    }
}
