//! The training metrics log, `metrics.jsonl`.
//!
//! In: [`Record`]s (a step, `train` or `valid`, and whichever of loss, learning rate,
//! throughput and BLEU were measured). Out: one JSON object per line, appended and
//! flushed as each record is written ([`MetricsWriter`]):
//!
//! ```text
//! {"step":100,"kind":"train","loss":4.21,"lr":0.0007,"tokens_per_s":51234.5}
//! {"step":100,"kind":"valid","loss":4.02,"bleu":12.3,"bleu_signature":"nrefs:1|…|beam:4|…"}
//! ```
//!
//! Reading ([`read_metrics`]) tolerates a truncated last line, which is what a crash in
//! the middle of a write leaves. On resume, [`truncate_after`] drops the records of steps
//! after the checkpoint's (the run will redo them), rewriting the file atomically.
//!
//! Absent fields are omitted. A non-finite value (a diverged loss) is written as `null`,
//! since JSON has no NaN, and reads back as `None`. Unknown fields are ignored on read,
//! and kept verbatim by [`truncate_after`].

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The file name the trainer uses in its run directory.
pub const FILE_NAME: &str = "metrics.jsonl";

/// Which loop a record comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Train,
    Valid,
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    /// Optimizer steps taken when the record was made.
    pub step: u64,
    pub kind: Kind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bleu: Option<f64>,
    /// How `bleu` was computed: sacreBLEU's signature, then the search
    /// (`beam:4|alpha:0.6|penalty:gnmt|stop:k-finished|max_len:1.0x+50`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bleu_signature: Option<String>,
}

impl Record {
    /// A record with no measurements; set the fields that apply.
    pub fn new(step: u64, kind: Kind) -> Record {
        Record {
            step,
            kind,
            loss: None,
            lr: None,
            tokens_per_s: None,
            bleu: None,
            bleu_signature: None,
        }
    }
}

/// A metrics log that cannot be written or read.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot {action} metrics log `{path}`: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "metrics log `{path}` line {line} is not a metrics record ({source}); the file was \
         edited or is not a kiln metrics log: fix or delete that line, or move the file away"
    )]
    Parse {
        path: PathBuf,
        line: usize,
        source: serde_json::Error,
    },
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> MetricsError {
    let path = path.to_path_buf();
    move |source| MetricsError::Io {
        action,
        path,
        source,
    }
}

/// Appends records to a metrics log, one line each, flushed as it is written.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: File,
}

impl MetricsWriter {
    /// Opens `path` for appending, creating it if needed. If the file does not end with a
    /// newline (a crash mid-write), its last line is completed when it holds a whole
    /// record and cut off otherwise, so that the next record starts on a line of its own.
    pub fn open(path: &Path) -> Result<MetricsWriter, MetricsError> {
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io_error("open", path))?;
        let len = file
            .metadata()
            .map_err(io_error("read the size of", path))?
            .len();
        let complete = complete_len(&mut file, len).map_err(io_error("read", path))?;
        if complete < len {
            let mut tail = Vec::new();
            file.seek(SeekFrom::Start(complete))
                .and_then(|_| file.read_to_end(&mut tail))
                .map_err(io_error("read", path))?;
            if serde_json::from_slice::<Record>(&tail).is_ok() {
                file.write_all(b"\n")
                    .map_err(io_error("complete the last line of", path))?;
            } else {
                file.set_len(complete)
                    .map_err(io_error("cut the truncated last line of", path))?;
            }
        }
        Ok(MetricsWriter {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `record` as one line and flushes it to the operating system.
    pub fn write(&mut self, record: &Record) -> Result<(), MetricsError> {
        let mut line = serde_json::to_string(record).map_err(|e| MetricsError::Io {
            action: "serialize a record for",
            path: self.path.clone(),
            source: e.into(),
        })?;
        line.push('\n');
        // One write call per line: a crash leaves at most the last line partial.
        self.file
            .write_all(line.as_bytes())
            .map_err(io_error("append to", &self.path))?;
        self.file.flush().map_err(io_error("flush", &self.path))
    }
}

/// The length of `file` up to and including its last `\n` (0 if it has none).
fn complete_len(file: &mut File, len: u64) -> std::io::Result<u64> {
    const CHUNK: u64 = 4096;
    let mut end = len;
    let mut buf = vec![0u8; CHUNK as usize];
    while end > 0 {
        let start = end.saturating_sub(CHUNK);
        let n = (end - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut buf[..n])?;
        if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// The lines of a log that hold records: `(line number, text)`. Blank lines are skipped.
/// A last line without its `\n` is kept only if it parses: anything else there is a
/// record cut off by a crash.
fn record_lines(path: &Path, text: &str) -> Result<Vec<(usize, String, Record)>, MetricsError> {
    let mut out = Vec::new();
    let ends_complete = text.is_empty() || text.ends_with('\n');
    let lines: Vec<&str> = text.split('\n').collect();
    let last = lines.len() - 1; // after a final '\n' this is the empty tail
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Record>(line) {
            Ok(record) => out.push((i + 1, line.to_string(), record)),
            Err(_) if i == last && !ends_complete => {}
            Err(source) => {
                return Err(MetricsError::Parse {
                    path: path.to_path_buf(),
                    line: i + 1,
                    source,
                })
            }
        }
    }
    Ok(out)
}

fn read_text(path: &Path) -> Result<String, MetricsError> {
    let bytes = std::fs::read(path).map_err(io_error("read", path))?;
    // A crash can cut a multi-byte character in the last line; that line is dropped
    // anyway, so decode lossily and let the parser reject real damage elsewhere.
    Ok(String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into()))
}

/// Every record of the log at `path`, in file order. A truncated last line is ignored;
/// any other line that is not a record is an error naming its line number.
pub fn read_metrics(path: &Path) -> Result<Vec<Record>, MetricsError> {
    let text = read_text(path)?;
    Ok(record_lines(path, &text)?
        .into_iter()
        .map(|(_, _, r)| r)
        .collect())
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary sibling of `path`: `<path>.tmp-<pid>-<n>`.
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(format!(
        ".tmp-{}-{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    PathBuf::from(name)
}

/// Drops the records whose step is after `step` (and a truncated last line), keeping the
/// others verbatim and in order. Returns how many records were dropped. A missing file
/// has nothing to drop.
///
/// The rewrite is atomic: the kept lines go to a temporary file in the same directory,
/// which is synced and renamed over `path`. On any error the log is left as it was.
pub fn truncate_after(path: &Path, step: u64) -> Result<usize, MetricsError> {
    if !path.exists() {
        return Ok(0);
    }
    let text = read_text(path)?;
    let lines = record_lines(path, &text)?;
    let mut kept = String::with_capacity(text.len());
    let mut dropped = 0;
    for (_, line, record) in &lines {
        if record.step > step {
            dropped += 1;
        } else {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if kept == text {
        return Ok(0);
    }

    let tmp = temp_path(path);
    let written = write_synced(&tmp, kept.as_bytes())
        .and_then(|()| std::fs::rename(&tmp, path).map_err(io_error("replace", path)));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_parent_dir(path);
    Ok(dropped)
}

fn write_synced(tmp: &Path, bytes: &[u8]) -> Result<(), MetricsError> {
    let mut f = File::create(tmp).map_err(io_error("create the temporary file", tmp))?;
    f.write_all(bytes)
        .map_err(io_error("write the temporary file", tmp))?;
    f.sync_all()
        .map_err(io_error("sync the temporary file", tmp))
}

/// Makes a rename durable where the platform allows it (best effort).
fn sync_parent_dir(path: &Path) {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}
