//! Training data: parallel corpora, the shared BPE vocabulary, and token-based batches.
//!
//! In: a source and a target text file, one sentence per line, aligned by line. Out:
//! - [`ParallelCorpus`] — the lines of both files ([`load_parallel`]);
//! - [`Tokenizer`] — a BPE vocabulary shared by both languages, trained with the
//!   `tokenizers` crate ([`Tokenizer::train`]) and kept as `tokenizer.json`;
//! - [`Dataset`] — the pairs as token ids ([`Example`]), empty and over-long pairs left out
//!   and counted ([`Dataset::build`]);
//! - [`binarized::Binarized`] — the same pairs encoded once into files and read mapped
//!   (`kiln preprocess`), for corpora too large to hold; both are [`Pairs`];
//! - [`BatchPlan`] — batches made by token count, fairseq style, in an order per epoch
//!   that depends only on (seed, epoch) ([`BatchPlan::epoch_order`]); each becomes a
//!   [`Batch`] of padded `i32` tensors ready for the model's `src`, `tgt_in` and `tgt_out`.
//!
//! Special tokens have fixed ids: `<pad>` = 0, `<bos>` = 1, `<eos>` = 2, `<unk>` = 3.
//! Texts are never lowercased or normalized; a Metaspace pre-tokenizer and decoder make
//! `decode(encode(s)) == s` for any text whose characters the vocabulary knows and that
//! does not start with a space (see [`Tokenizer::encode`]).

use std::path::{Path, PathBuf};

use kiln_compiler::rng::philox4x32_10;
use kiln_compiler::tensor::Tensor;

pub mod binarized;
mod bpe;
pub use bpe::{BpeReport, Tokenizer, BYTE_TOKENS};

/// The padding id; also what the specs use as `pad`.
pub const PAD: i32 = 0;
/// Beginning of a target sequence (first position of `tgt_in`).
pub const BOS: i32 = 1;
/// End of a target sequence (last non-pad position of `tgt_out`).
pub const EOS: i32 = 2;
/// A character the vocabulary does not know.
pub const UNK: i32 = 3;
/// The special tokens, at the index that is their id.
pub const SPECIAL_TOKENS: [&str; 4] = ["<pad>", "<bos>", "<eos>", "<unk>"];

/// The character Metaspace writes for a space.
const METASPACE: char = '\u{2581}';

/// Why data could not be read, a vocabulary trained or loaded, or batches made.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(transparent)]
    Io(#[from] kiln_compiler::io_error::PathIoError),
    #[error(
        "`{path}` line {line} is not valid UTF-8 (bad byte at column {column}); \
         re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
    )]
    Utf8 {
        path: PathBuf,
        line: usize,
        column: usize,
    },
    #[error(
        "the parallel files do not align: `{src}` has {src_lines} lines but `{tgt}` has \
         {tgt_lines}; each line of one must translate the same line of the other"
    )]
    LineCount {
        src: PathBuf,
        src_lines: usize,
        tgt: PathBuf,
        tgt_lines: usize,
    },
    #[error(
        "a vocabulary of {requested} tokens cannot hold the 4 special tokens{} and the \
         {alphabet} distinct characters of the corpus; ask for at least {needed}{}",
        if *byte_fallback { ", the 256 byte tokens" } else { "" },
        if *byte_fallback { " (or set data.byte_fallback: false)" } else { "" }
    )]
    VocabTooSmall {
        requested: usize,
        alphabet: usize,
        needed: usize,
        byte_fallback: bool,
    },
    #[error("BPE training failed: {message}")]
    Train { message: String },
    #[error(
        "`{path}` is not a usable tokenizer: {message}; re-create it with kiln's BPE \
         training (it must map <pad>, <bos>, <eos>, <unk> to ids 0, 1, 2, 3)"
    )]
    BadTokenizer { path: PathBuf, message: String },
    #[error("cannot encode {what}: {message}")]
    Encode { what: String, message: String },
    #[error("{message}")]
    Config { message: String },
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> DataError + 'a {
    kiln_compiler::io_error::PathIoError::at(action, path)
}

// ---------------------------------------------------------------------------------------
// Corpora
// ---------------------------------------------------------------------------------------

/// The lines of a text file: split at `\n`, a trailing `\r` removed from each line (CRLF
/// files), a leading UTF-8 byte-order mark removed. A final newline does not start an
/// extra line. Invalid UTF-8 is an error naming the file and the 1-based line.
pub fn read_lines(path: &Path) -> Result<Vec<String>, DataError> {
    let bytes = std::fs::read(path).map_err(io_err("read", path))?;
    let mut body: &[u8] = &bytes;
    if let Some(rest) = body.strip_prefix(b"\xEF\xBB\xBF") {
        body = rest;
    }
    if body.is_empty() {
        return Ok(Vec::new());
    }
    let body = body.strip_suffix(b"\n").unwrap_or(body);
    let mut lines = Vec::new();
    for (i, raw) in body.split(|&b| b == b'\n').enumerate() {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        match std::str::from_utf8(raw) {
            Ok(s) => lines.push(s.to_string()),
            Err(e) => {
                return Err(DataError::Utf8 {
                    path: path.to_path_buf(),
                    line: i + 1,
                    column: e.valid_up_to() + 1,
                })
            }
        }
    }
    Ok(lines)
}

/// A parallel corpus: line `i` of `tgt` translates line `i` of `src`. Every line of the
/// files is kept, empty ones included, so line numbers match the files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParallelCorpus {
    pub src_path: PathBuf,
    pub tgt_path: PathBuf,
    pub src: Vec<String>,
    pub tgt: Vec<String>,
}

impl ParallelCorpus {
    /// The number of line pairs.
    pub fn len(&self) -> usize {
        self.src.len()
    }

    pub fn is_empty(&self) -> bool {
        self.src.is_empty()
    }

    /// Whether pair `i` has a side that is empty or only whitespace (such pairs are not
    /// trained on).
    pub fn is_empty_pair(&self, i: usize) -> bool {
        self.src[i].trim().is_empty() || self.tgt[i].trim().is_empty()
    }

    /// How many pairs have an empty side.
    pub fn empty_pairs(&self) -> usize {
        (0..self.len()).filter(|&i| self.is_empty_pair(i)).count()
    }
}

/// Reads a parallel corpus; the two files must have the same number of lines.
pub fn load_parallel(src: &Path, tgt: &Path) -> Result<ParallelCorpus, DataError> {
    let src_lines = read_lines(src)?;
    let tgt_lines = read_lines(tgt)?;
    if src_lines.len() != tgt_lines.len() {
        return Err(DataError::LineCount {
            src: src.to_path_buf(),
            src_lines: src_lines.len(),
            tgt: tgt.to_path_buf(),
            tgt_lines: tgt_lines.len(),
        });
    }
    Ok(ParallelCorpus {
        src_path: src.to_path_buf(),
        tgt_path: tgt.to_path_buf(),
        src: src_lines,
        tgt: tgt_lines,
    })
}

/// Writes `bytes` to `path` through `<path>.tmp-<pid>`, fsync and rename; on failure the
/// temporary file is removed and `path` is untouched.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    use std::io::Write;
    let mut name = path.as_os_str().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(name);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(io_err("create", &tmp))?;
        f.write_all(bytes).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("sync", &tmp))?;
        std::fs::rename(&tmp, path).map_err(io_err("rename a temporary file over", path))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

// ---------------------------------------------------------------------------------------
// Examples
// ---------------------------------------------------------------------------------------

/// One training pair as token ids, without special tokens: the batch adds `<bos>` and
/// `<eos>` on the target side; the source gets neither.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    pub src: Vec<i32>,
    pub tgt: Vec<i32>,
}

impl Example {
    /// Source positions the model sees: `src.len()`.
    pub fn src_positions(&self) -> usize {
        self.src.len()
    }

    /// Target positions the model sees: `tgt.len() + 1` (`<bos>` in, `<eos>` out).
    pub fn tgt_positions(&self) -> usize {
        self.tgt.len() + 1
    }
}

/// Training pairs as token ids, without special tokens: in memory ([`Dataset`], a
/// `Vec` of [`Example`]s) or mapped from a binarized corpus ([`binarized::Binarized`]).
pub trait Pairs: Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Pair `i`'s source and target ids.
    fn pair(&self, i: usize) -> (&[i32], &[i32]);
    /// The 0-based corpus line pair `i` comes from.
    fn line(&self, i: usize) -> usize;
    /// Source positions the model sees ([`Example::src_positions`]).
    fn src_positions(&self, i: usize) -> usize {
        self.pair(i).0.len()
    }
    /// Target positions the model sees ([`Example::tgt_positions`]).
    fn tgt_positions(&self, i: usize) -> usize {
        self.pair(i).1.len() + 1
    }
}

impl Pairs for Vec<Example> {
    fn len(&self) -> usize {
        <[Example]>::len(self)
    }
    fn pair(&self, i: usize) -> (&[i32], &[i32]) {
        (&self[i].src, &self[i].tgt)
    }
    fn line(&self, i: usize) -> usize {
        i
    }
}

impl Pairs for Dataset {
    fn len(&self) -> usize {
        self.examples.len()
    }
    fn pair(&self, i: usize) -> (&[i32], &[i32]) {
        (&self.examples[i].src, &self.examples[i].tgt)
    }
    fn line(&self, i: usize) -> usize {
        self.lines[i]
    }
}

/// The examples of a corpus and what was left out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dataset {
    pub examples: Vec<Example>,
    /// `lines[i]` is the 0-based line of the corpus that `examples[i]` comes from.
    pub lines: Vec<usize>,
    /// Pairs with an empty (or whitespace-only) side.
    pub skipped_empty: usize,
    /// Pairs longer than the length limit.
    pub dropped_too_long: usize,
}

impl Dataset {
    /// Encodes every pair of `corpus`. Pairs with an empty side are skipped; with
    /// `max_len = Some(n)`, pairs with more than `n` source positions or more than `n`
    /// target positions (tokens + 1, see [`Example::tgt_positions`]) are dropped. Both are
    /// counted.
    pub fn build(
        corpus: &ParallelCorpus,
        tokenizer: &Tokenizer,
        max_len: Option<usize>,
    ) -> Result<Dataset, DataError> {
        let mut ds = Dataset {
            examples: Vec::new(),
            lines: Vec::new(),
            skipped_empty: 0,
            dropped_too_long: 0,
        };
        for i in 0..corpus.len() {
            if corpus.is_empty_pair(i) {
                ds.skipped_empty += 1;
                continue;
            }
            let at = |path: &Path, e: DataError| match e {
                DataError::Encode { message, .. } => DataError::Encode {
                    what: format!("`{}` line {}", path.display(), i + 1),
                    message,
                },
                other => other,
            };
            let ex = Example {
                src: tokenizer
                    .encode(&corpus.src[i])
                    .map_err(|e| at(&corpus.src_path, e))?,
                tgt: tokenizer
                    .encode(&corpus.tgt[i])
                    .map_err(|e| at(&corpus.tgt_path, e))?,
            };
            if let Some(n) = max_len {
                if ex.src_positions() > n || ex.tgt_positions() > n {
                    ds.dropped_too_long += 1;
                    continue;
                }
            }
            ds.examples.push(ex);
            ds.lines.push(i);
        }
        Ok(ds)
    }
}

// ---------------------------------------------------------------------------------------
// Batches
// ---------------------------------------------------------------------------------------

/// Token budgets of one batch, counted as padded sizes: rows × longest row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BatchConfig {
    /// Budget of the `src` tensor, `B × S`.
    pub max_src_tokens: usize,
    /// Budget of the `tgt_in`/`tgt_out` tensors, `B × T` with `T` = longest target + 1.
    pub max_tgt_tokens: usize,
}

impl Default for BatchConfig {
    /// The paper's recipe (§5.1): about 25,000 source and 25,000 target tokens a batch.
    fn default() -> Self {
        BatchConfig {
            max_src_tokens: 25_000,
            max_tgt_tokens: 25_000,
        }
    }
}

/// The batches of a dataset: fixed membership, fresh order every epoch.
///
/// Examples are sorted by (source positions, target positions, index), which puts
/// similar lengths together (the buckets), and cut greedily: an example joins the current
/// batch when the batch, padded to its longest row, still fits both budgets. An example
/// that alone exceeds a budget is not an error: it gets a batch of its own (counted in
/// [`BatchPlan::oversized`]); use the `max_len` filter of [`Dataset::build`] to drop such
/// examples instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchPlan {
    /// Example indices of each batch, in bucket order (shortest first).
    pub batches: Vec<Vec<usize>>,
    /// Batches holding one example that alone exceeds a budget.
    pub oversized: usize,
}

/// The Philox stream (counter word 3) of the batch shuffle: "SHUF".
const SHUFFLE_STREAM: u32 = 0x5348_5546;

impl BatchPlan {
    pub fn new(examples: &dyn Pairs, config: BatchConfig) -> Result<BatchPlan, DataError> {
        if config.max_src_tokens == 0 || config.max_tgt_tokens == 0 {
            return Err(DataError::Config {
                message: format!(
                    "batch budgets must be positive (max_src_tokens = {}, max_tgt_tokens = {}); \
                     the paper uses about 25000 each",
                    config.max_src_tokens, config.max_tgt_tokens
                ),
            });
        }
        let mut order: Vec<usize> = (0..examples.len()).collect();
        order.sort_by_key(|&i| (examples.src_positions(i), examples.tgt_positions(i), i));

        let mut plan = BatchPlan {
            batches: Vec::new(),
            oversized: 0,
        };
        let mut cur: Vec<usize> = Vec::new();
        let (mut s_max, mut t_max) = (0usize, 0usize);
        for i in order {
            let (s, t) = (examples.src_positions(i), examples.tgt_positions(i));
            let rows = cur.len() + 1;
            let (s2, t2) = (s_max.max(s), t_max.max(t));
            let fits = rows.saturating_mul(s2) <= config.max_src_tokens
                && rows.saturating_mul(t2) <= config.max_tgt_tokens;
            if fits {
                cur.push(i);
                (s_max, t_max) = (s2, t2);
                continue;
            }
            if !cur.is_empty() {
                plan.batches.push(std::mem::take(&mut cur));
            }
            cur.push(i);
            (s_max, t_max) = (s, t);
            if s > config.max_src_tokens || t > config.max_tgt_tokens {
                plan.oversized += 1;
                plan.batches.push(std::mem::take(&mut cur));
                (s_max, t_max) = (0, 0);
            }
        }
        if !cur.is_empty() {
            plan.batches.push(cur);
        }
        Ok(plan)
    }

    /// The number of batches in an epoch.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// The order in which epoch `epoch` visits the batches: a permutation of
    /// `0..len()` that depends only on `(seed, epoch)` (and the plan's size). A run that
    /// stopped after `k` batches of an epoch resumes at `epoch_order(seed, epoch)[k]`.
    ///
    /// Fisher–Yates, drawing position `j`'s partner from Philox4x32-10 with key `seed`
    /// and counter `(j, epoch low, epoch high, "SHUF")`.
    pub fn epoch_order(&self, seed: u64, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len()).collect();
        let key = [seed as u32, (seed >> 32) as u32];
        for j in (1..order.len()).rev() {
            let w = philox4x32_10(
                [j as u32, epoch as u32, (epoch >> 32) as u32, SHUFFLE_STREAM],
                key,
            );
            let x = u64::from(w[0]) | (u64::from(w[1]) << 32);
            // A multiply-shift draw in [0, j]: bias below 2^-32 for any plan size.
            let k = ((u128::from(x) * (j as u128 + 1)) >> 64) as usize;
            order.swap(j, k);
        }
        order
    }

    /// Batch `index` (an index into [`BatchPlan::batches`]) as tensors.
    pub fn batch(&self, examples: &dyn Pairs, index: usize) -> Option<Batch> {
        self.batches
            .get(index)
            .map(|members| Batch::new(examples, members))
    }

    /// The batches of epoch `epoch` in its order, starting at position `start` (0 for a
    /// fresh epoch, the saved `batch_in_epoch` when resuming).
    pub fn epoch<'a>(
        &'a self,
        examples: &'a dyn Pairs,
        seed: u64,
        epoch: u64,
        start: usize,
    ) -> impl Iterator<Item = Batch> + 'a {
        self.epoch_order(seed, epoch)
            .into_iter()
            .skip(start)
            .map(move |b| Batch::new(examples, &self.batches[b]))
    }
}

/// One batch, right-padded with `<pad>` (0).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// `i32 [B, S]`: source ids.
    pub src: Tensor,
    /// `i32 [B, T]`: `<bos>` y₁ … y_m.
    pub tgt_in: Tensor,
    /// `i32 [B, T]`: y₁ … y_m `<eos>`.
    pub tgt_out: Tensor,
    /// Non-pad source tokens.
    pub n_src_tokens: usize,
    /// Non-pad target tokens, `<eos>` included (the tokens the loss averages over).
    pub n_tgt_tokens: usize,
    /// The examples of the rows, in row order (indices into the dataset's examples).
    pub indices: Vec<usize>,
}

impl Batch {
    /// The batch of `examples[i]` for `i` in `members`, in that order.
    ///
    /// Panics if a member is out of range: members come from a [`BatchPlan`] built on the
    /// same examples, never from user data.
    pub fn new(examples: &dyn Pairs, members: &[usize]) -> Batch {
        let b = members.len();
        let s = members
            .iter()
            .map(|&i| examples.src_positions(i))
            .max()
            .unwrap_or(0);
        let t = members
            .iter()
            .map(|&i| examples.tgt_positions(i))
            .max()
            .unwrap_or(0);
        let mut src = vec![PAD; b * s];
        let mut tgt_in = vec![PAD; b * t];
        let mut tgt_out = vec![PAD; b * t];
        let (mut n_src, mut n_tgt) = (0, 0);
        for (row, &i) in members.iter().enumerate() {
            let (xs, ys) = examples.pair(i);
            src[row * s..row * s + xs.len()].copy_from_slice(xs);
            let m = ys.len();
            tgt_in[row * t] = BOS;
            tgt_in[row * t + 1..row * t + 1 + m].copy_from_slice(ys);
            tgt_out[row * t..row * t + m].copy_from_slice(ys);
            tgt_out[row * t + m] = EOS;
            n_src += xs.len();
            n_tgt += m + 1;
        }
        Batch {
            src: Tensor::i32(vec![b, s], src).expect("sized above"),
            tgt_in: Tensor::i32(vec![b, t], tgt_in).expect("sized above"),
            tgt_out: Tensor::i32(vec![b, t], tgt_out).expect("sized above"),
            n_src_tokens: n_src,
            n_tgt_tokens: n_tgt,
            indices: members.to_vec(),
        }
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.indices.len()
    }
}

#[cfg(test)]
mod tests;
