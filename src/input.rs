//! The lines a command reads: a file at once, or standard input as it arrives.
//!
//! Standard input comes in chunks: whatever lines are there when the translator is ready
//! for more, up to a cap. A line typed at a terminal is a chunk of its own and is
//! translated at once; a pipe fills each chunk to the cap, so its sentences are still
//! batched by length.

use std::io::BufRead;
use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use kiln_dsl::Error;

use crate::{err, plain};

/// How long a chunk waits for more lines after its first: long enough for a pipe's next
/// lines to arrive, too short for a person to notice.
const GATHER: Duration = Duration::from_millis(20);

/// Every line of `path` (the corpus reader: CRLF, a byte-order mark, and invalid UTF-8
/// named by line), or of standard input until it ends.
pub(crate) fn read_text_lines(path: Option<&Path>) -> Result<Vec<String>, Error> {
    match path {
        Some(p) => kiln_train::data::read_lines(p).map_err(err("kiln::io")),
        None => std::io::stdin()
            .lock()
            .lines()
            .map(|l| l.map(|l| l.trim_end_matches('\r').to_string()))
            .collect::<Result<_, _>>()
            .map_err(stdin_error),
    }
}

fn stdin_error(e: std::io::Error) -> Error {
    plain("kiln::io", format!("cannot read standard input: {e}"), None)
}

/// Lines in chunks: a file's all at once, standard input's as they arrive.
pub(crate) enum Chunks {
    File(Option<Vec<String>>),
    Stdin {
        lines: Receiver<std::io::Result<String>>,
        cap: usize,
        ended: bool,
    },
}

impl Chunks {
    /// The lines of `path`, or of standard input in chunks of at most `cap` lines.
    pub(crate) fn open(path: Option<&Path>, cap: usize) -> Result<Chunks, Error> {
        if let Some(p) = path {
            return Ok(Chunks::File(Some(read_text_lines(Some(p))?)));
        }
        // A reader thread, so that a chunk can take what has arrived without waiting for
        // more; the channel's bound keeps at most two chunks read ahead.
        let (tx, rx) = sync_channel(2 * cap.max(1));
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let stop = line.is_err();
                let line = line.map(|l| l.trim_end_matches('\r').to_string());
                if tx.send(line).is_err() || stop {
                    break;
                }
            }
        });
        Ok(Chunks::Stdin {
            lines: rx,
            cap: cap.max(1),
            ended: false,
        })
    }

    /// Whether all the input comes at once (a file), so that its size is known.
    pub(crate) fn is_whole(&self) -> bool {
        matches!(self, Chunks::File(_))
    }

    /// The next chunk; `None` once the input has ended.
    pub(crate) fn next_chunk(&mut self) -> Result<Option<Vec<String>>, Error> {
        match self {
            Chunks::File(lines) => Ok(lines.take()),
            Chunks::Stdin { ended: true, .. } => Ok(None),
            Chunks::Stdin { lines, cap, ended } => {
                let Ok(first) = lines.recv() else {
                    *ended = true;
                    return Ok(None);
                };
                let mut chunk = vec![first.map_err(stdin_error)?];
                let deadline = Instant::now() + GATHER;
                while chunk.len() < *cap {
                    let wait = deadline.saturating_duration_since(Instant::now());
                    match lines.recv_timeout(wait) {
                        Ok(line) => chunk.push(line.map_err(stdin_error)?),
                        Err(RecvTimeoutError::Timeout) => break,
                        Err(RecvTimeoutError::Disconnected) => {
                            *ended = true;
                            break;
                        }
                    }
                }
                Ok(Some(chunk))
            }
        }
    }
}
