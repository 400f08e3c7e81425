//! A run's vocabulary: the shared BPE tokenizer a configuration asks for — trained on
//! its training data, or the file it names — and the record of what it was trained on,
//! so that a resumed or retried run reuses it only when that still holds.

use std::path::Path;

use crate::config::Config;
use crate::data::{load_parallel, Tokenizer};
use crate::model::{write_atomic, TOKENIZER_FILE};
use crate::run_dir::holds_training;
use crate::trainer::TrainError;

/// The tokenizer of a run: trained on the training corpus (both sides), or loaded from
/// `<run>/tokenizer.json` when the run already has one; a trained one is saved there,
/// with the record of what it was trained on (`tokenizer.source.yaml`).
pub fn prepare_tokenizer(cfg: &Config) -> Result<(Tokenizer, String), TrainError> {
    let (tok, note, trained) = tokenizer_of(cfg)?;
    if trained {
        let dir = &cfg.checkpoint.dir;
        std::fs::create_dir_all(dir).map_err(|e| TrainError::Write {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        let json = tok.to_json()?;
        let source = TokenizerSource::of(cfg, json.as_bytes())?;
        // The record first: a tokenizer.json without one is taken as it is.
        let record = dir.join(TOKENIZER_SOURCE_FILE);
        let yaml = serde_yaml::to_string(&source).expect("the record serializes");
        write_atomic(&record, yaml.as_bytes()).map_err(|e| TrainError::Write {
            path: record.clone(),
            message: e.to_string(),
        })?;
        tok.save(&dir.join(TOKENIZER_FILE))?;
    }
    Ok((tok, note))
}

/// Beside `<run>/tokenizer.json`: what it was trained on.
pub const TOKENIZER_SOURCE_FILE: &str = "tokenizer.source.yaml";

/// What a run directory's `tokenizer.json` was trained on: `data.vocab_size` and the
/// size and FNV-1a digest of each training file (not their paths: moving the data
/// changes nothing). `tokenizer` is the digest of the `tokenizer.json` it describes, so
/// that a tokenizer put there by hand (or from an artifact) is not judged by another's
/// record.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenizerSource {
    tokenizer: String,
    vocab_size: usize,
    /// Absent from the records of kilns before byte fallback, whose vocabularies had none.
    #[serde(default)]
    byte_fallback: bool,
    train_src: FileDigest,
    train_tgt: FileDigest,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileDigest {
    bytes: u64,
    fnv1a: String,
}

impl TokenizerSource {
    /// The record of `tokenizer_json` trained on `cfg`'s data now.
    fn of(cfg: &Config, tokenizer_json: &[u8]) -> Result<TokenizerSource, TrainError> {
        Ok(TokenizerSource {
            tokenizer: kiln_compiler::artifact::hash_hex(tokenizer_json),
            vocab_size: cfg.data.vocab_size,
            byte_fallback: cfg.data.byte_fallback,
            train_src: FileDigest::of(&cfg.data.train_src)?,
            train_tgt: FileDigest::of(&cfg.data.train_tgt)?,
        })
    }
}

impl FileDigest {
    fn of(path: &Path) -> Result<FileDigest, TrainError> {
        use std::io::Read;
        let fail =
            |e: std::io::Error| TrainError::Setup(format!("cannot read `{}`: {e}", path.display()));
        let mut file = std::fs::File::open(path).map_err(fail)?;
        let mut buf = vec![0u8; 1 << 20];
        let (mut h, mut bytes) = (kiln_compiler::artifact::FNV1A64_OFFSET, 0u64);
        loop {
            let n = file.read(&mut buf).map_err(fail)?;
            if n == 0 {
                break;
            }
            h = kiln_compiler::artifact::fnv1a64_update(h, &buf[..n]);
            bytes += n as u64;
        }
        Ok(FileDigest {
            bytes,
            fnv1a: format!("{h:016x}"),
        })
    }
}

/// The tokenizer [`prepare_tokenizer`] would give, without writing anything; `true` when
/// it was trained now (rather than loaded from the run directory).
///
/// A `<run>/tokenizer.json` is reused only for the settings it was trained for: when
/// its record (`tokenizer.source.yaml`) gives another `data.vocab_size`,
/// `data.byte_fallback` or other
/// training files, it is refused, saying so. One without a record (written by a kiln
/// before records, or put there by hand) is used as it is.
pub fn tokenizer_of(cfg: &Config) -> Result<(Tokenizer, String, bool), TrainError> {
    let dir = &cfg.checkpoint.dir;
    let path = dir.join(TOKENIZER_FILE);
    if path.is_file() {
        let bytes = std::fs::read(&path)
            .map_err(|e| TrainError::Setup(format!("cannot read `{}`: {e}", path.display())))?;
        let t = Tokenizer::from_json(&String::from_utf8_lossy(&bytes), &path)?;
        let checked = match recorded_for(cfg, &bytes, t.vocab_size())? {
            TokenizerRecord::Matches => Some("; it was trained on this configuration's data"),
            TokenizerRecord::Missing => Some(
                "; it has no record of what it was trained on (an older kiln's, or put there \
                 by hand), so it is used as it is",
            ),
            TokenizerRecord::FailedStart => None,
        };
        if let Some(checked) = checked {
            let note = format!(
                "loaded the BPE vocabulary {} ({} tokens){checked}",
                path.display(),
                t.vocab_size()
            );
            return Ok((t, note, false));
        }
    }
    let corpus = load_parallel(&cfg.data.train_src, &cfg.data.train_tgt)?;
    let (tok, report) =
        Tokenizer::train_on_corpus(&corpus, cfg.data.vocab_size, cfg.data.byte_fallback)?;
    let note = if report.vocab_size < report.requested {
        format!(
            " (asked for {}; the corpus has no more merges)",
            report.requested
        )
    } else {
        String::new()
    };
    Ok((
        tok,
        format!(
            "trained a shared BPE vocabulary of {} tokens{note} on {} pairs",
            report.vocab_size,
            corpus.len()
        ),
        true,
    ))
}

/// What the record beside a run directory's `tokenizer.json` says of it.
pub(crate) enum TokenizerRecord {
    /// It was trained on this configuration's data and vocabulary size.
    Matches,
    /// There is no record of it: it is used as it is.
    Missing,
    /// It was trained for other settings by a start that failed before training: it is
    /// trained again.
    FailedStart,
}

/// Whether the record beside the run directory's `tokenizer.json` (`bytes`, `tokens`
/// tokens) says it was trained for `cfg`'s settings: `true` when so, `false` when there is
/// no record (of it), an error saying what changed when it was trained for others.
pub(crate) fn recorded_for(
    cfg: &Config,
    bytes: &[u8],
    tokens: usize,
) -> Result<TokenizerRecord, TrainError> {
    let dir = &cfg.checkpoint.dir;
    let record = dir.join(TOKENIZER_SOURCE_FILE);
    let Ok(text) = std::fs::read_to_string(&record) else {
        return Ok(TokenizerRecord::Missing);
    };
    let delete = format!(
        "delete `{}` and `{}` to train a tokenizer for this configuration, or delete `{}` \
         alone to use this tokenizer all the same",
        dir.join(TOKENIZER_FILE).display(),
        record.display(),
        record.display()
    );
    let then: TokenizerSource = serde_yaml::from_str(&text).map_err(|e| {
        TrainError::Setup(format!(
            "`{}` is not a record of what `{TOKENIZER_FILE}` was trained on ({e}); {delete}",
            record.display()
        ))
    })?;
    let now = TokenizerSource::of(cfg, bytes)?;
    if then.tokenizer != now.tokenizer {
        // The record is of another tokenizer.json: this one was put there otherwise.
        return Ok(TokenizerRecord::Missing);
    }
    let mut changed = Vec::new();
    if then.vocab_size != now.vocab_size {
        changed.push(format!(
            "data.vocab_size was {}, it is {} now",
            then.vocab_size, now.vocab_size
        ));
    }
    if then.byte_fallback != now.byte_fallback {
        changed.push(format!(
            "data.byte_fallback was {}, it is {} now",
            then.byte_fallback, now.byte_fallback
        ));
    }
    for (key, path, a, b) in [
        (
            "data.train_src",
            &cfg.data.train_src,
            &then.train_src,
            &now.train_src,
        ),
        (
            "data.train_tgt",
            &cfg.data.train_tgt,
            &then.train_tgt,
            &now.train_tgt,
        ),
    ] {
        if a != b {
            changed.push(format!(
                "{key} was a file of {} bytes{}, `{}` has {}",
                a.bytes,
                if a.bytes == b.bytes {
                    " with other contents"
                } else {
                    ""
                },
                path.display(),
                b.bytes
            ));
        }
    }
    if changed.is_empty() {
        return Ok(TokenizerRecord::Matches);
    }
    // Left by a start that failed before its first step: a cache, trained again.
    if !holds_training(dir)? {
        return Ok(TokenizerRecord::FailedStart);
    }
    Err(TrainError::Setup(format!(
        "`{}` ({tokens} tokens) was trained for other settings than this configuration's: \
         {}; {delete}",
        dir.join(TOKENIZER_FILE).display(),
        changed.join("; ")
    )))
}
