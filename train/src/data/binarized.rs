//! A training corpus encoded once into token ids and read mapped from disk, as fairseq's
//! `.bin`/`.idx` datasets: training then holds per pair only what batching needs (two
//! lengths and an offset in the index), never the text or the ids of the whole corpus.
//!
//! In: the two text files of a parallel corpus, the run's [`Tokenizer`] and the length
//! limit. Out: a directory with
//! - `train.ids`: every kept pair's source then target ids, `i32` little-endian;
//! - `train.idx`: [`MAGIC`], the pair count (`u64`), then per pair its first id's offset
//!   in `train.ids` (`u64`), source and target lengths (`u32` each) and its 0-based
//!   corpus line (`u64`), all little-endian;
//! - `binarized.yaml` ([`Meta`]): the tokenizer's digest (checked when the corpus is
//!   opened: ids are only meaningful with the vocabulary that made them) and the counts.
//!
//! The pairs kept, and their order, are those of [`super::Dataset::build`] on the same
//! files, so batches, and a run's trajectory, are the same from either.

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{io_err, DataError, Pairs, Tokenizer};

/// The index file's first bytes.
pub const MAGIC: &[u8; 8] = b"KILNIDX1";
/// The ids of the pairs.
pub const IDS_FILE: &str = "train.ids";
/// Where each pair's ids are.
pub const INDEX_FILE: &str = "train.idx";
/// What the directory holds ([`Meta`]).
pub const META_FILE: &str = "binarized.yaml";
/// Bytes of one pair's index entry.
const ENTRY: usize = 24;
/// Bytes before the first entry.
const HEADER: usize = 16;
/// Pairs encoded at a time (in parallel) while the files stream by.
const CHUNK: usize = 1 << 14;

/// What a binarized corpus holds and was made with.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    pub format: u32,
    /// The digest of the `tokenizer.json` that encoded the pairs.
    pub tokenizer: String,
    pub train_src: PathBuf,
    pub train_tgt: PathBuf,
    /// Lines of each file.
    pub lines: u64,
    pub pairs: u64,
    pub skipped_empty: u64,
    pub dropped_too_long: u64,
    /// `data.max_len` when it was made.
    pub max_len: usize,
}

/// The lines of a text file as [`super::read_lines`] splits them, read as they come.
struct Lines {
    path: PathBuf,
    reader: BufReader<std::fs::File>,
    line: usize,
    buf: Vec<u8>,
}

impl Lines {
    fn open(path: &Path) -> Result<Lines, DataError> {
        let file = std::fs::File::open(path).map_err(io_err("open", path))?;
        Ok(Lines {
            path: path.to_path_buf(),
            reader: BufReader::with_capacity(1 << 20, file),
            line: 0,
            buf: Vec::new(),
        })
    }

    /// The next line, `None` at the end.
    fn next_line(&mut self) -> Result<Option<String>, DataError> {
        self.buf.clear();
        let n = self
            .reader
            .read_until(b'\n', &mut self.buf)
            .map_err(io_err("read", &self.path))?;
        if n == 0 {
            return Ok(None);
        }
        let mut raw: &[u8] = &self.buf;
        if self.line == 0 {
            raw = raw.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(raw);
        }
        raw = raw.strip_suffix(b"\n").unwrap_or(raw);
        raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        self.line += 1;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(Some(s.to_string())),
            Err(e) => Err(DataError::Utf8 {
                path: self.path.clone(),
                line: self.line,
                column: e.valid_up_to() + 1,
            }),
        }
    }
}

/// A file written under a temporary name and renamed into place once complete.
struct Staged {
    tmp: PathBuf,
    path: PathBuf,
    out: BufWriter<std::fs::File>,
    done: bool,
}

impl Drop for Staged {
    /// An unfinished file (the run failed) is removed.
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl Staged {
    fn create(path: PathBuf) -> Result<Staged, DataError> {
        let mut name = path.as_os_str().to_os_string();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp = PathBuf::from(name);
        let file = std::fs::File::create(&tmp).map_err(io_err("create", &tmp))?;
        Ok(Staged {
            tmp,
            path,
            out: BufWriter::with_capacity(1 << 20, file),
            done: false,
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), DataError> {
        self.out
            .write_all(bytes)
            .map_err(io_err("write", &self.tmp))
    }

    fn finish(mut self) -> Result<(), DataError> {
        self.out.flush().map_err(io_err("write", &self.tmp))?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(io_err("sync", &self.tmp))?;
        std::fs::rename(&self.tmp, &self.path)
            .map_err(io_err("rename a temporary file over", &self.path))?;
        self.done = true;
        Ok(())
    }
}

/// A pair's source and target ids, or `None` for a pair with an empty side.
type Encoded = Option<(Vec<i32>, Vec<i32>)>;

/// Encodes the corpus `src`/`tgt` with `tokenizer` into the directory `dir` (created;
/// files already there are replaced only once the new ones are complete). Pairs with an
/// empty side are skipped, pairs with more than `max_len` source or target positions
/// dropped, both counted, as [`super::Dataset::build`] does. `tokenizer_digest`:
/// [`digest`] of the tokenizer's JSON.
pub fn binarize(
    (src, tgt): (&Path, &Path),
    tokenizer: &Tokenizer,
    tokenizer_digest: &str,
    max_len: usize,
    dir: &Path,
) -> Result<Meta, DataError> {
    use rayon::prelude::*;
    std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let (mut sl, mut tl) = (Lines::open(src)?, Lines::open(tgt)?);
    let mut ids = Staged::create(dir.join(IDS_FILE))?;
    let mut idx = Staged::create(dir.join(INDEX_FILE))?;
    let mut meta = Meta {
        format: 1,
        tokenizer: tokenizer_digest.to_string(),
        train_src: src.to_path_buf(),
        train_tgt: tgt.to_path_buf(),
        lines: 0,
        pairs: 0,
        skipped_empty: 0,
        dropped_too_long: 0,
        max_len,
    };
    // The count is written last, over this placeholder.
    idx.write(MAGIC)?;
    idx.write(&0u64.to_le_bytes())?;
    let mut offset = 0u64;
    loop {
        let mut chunk: Vec<(String, String)> = Vec::with_capacity(CHUNK);
        while chunk.len() < CHUNK {
            match (sl.next_line()?, tl.next_line()?) {
                (Some(s), Some(t)) => chunk.push((s, t)),
                (None, None) => break,
                _ => {
                    // One file ended first: count both to name them.
                    let (mut a, mut b) = (sl.line, tl.line);
                    while sl.next_line()?.is_some() {}
                    while tl.next_line()?.is_some() {}
                    (a, b) = (a.max(sl.line), b.max(tl.line));
                    return Err(DataError::LineCount {
                        src: src.to_path_buf(),
                        src_lines: a,
                        tgt: tgt.to_path_buf(),
                        tgt_lines: b,
                    });
                }
            }
        }
        if chunk.is_empty() {
            break;
        }
        let first = meta.lines as usize;
        let encoded: Vec<Result<Encoded, DataError>> = chunk
            .par_iter()
            .enumerate()
            .map(|(k, (s, t))| {
                if s.trim().is_empty() || t.trim().is_empty() {
                    return Ok(None);
                }
                let at = |path: &Path, e: DataError| match e {
                    DataError::Encode { message, .. } => DataError::Encode {
                        what: format!("`{}` line {}", path.display(), first + k + 1),
                        message,
                    },
                    other => other,
                };
                let s = tokenizer.encode(s).map_err(|e| at(src, e))?;
                let t = tokenizer.encode(t).map_err(|e| at(tgt, e))?;
                Ok(Some((s, t)))
            })
            .collect();
        for (k, e) in encoded.into_iter().enumerate() {
            let line = (first + k) as u64;
            let Some((s, t)) = e? else {
                meta.skipped_empty += 1;
                continue;
            };
            if s.len() > max_len || t.len() + 1 > max_len {
                meta.dropped_too_long += 1;
                continue;
            }
            let mut entry = [0u8; ENTRY];
            entry[..8].copy_from_slice(&offset.to_le_bytes());
            entry[8..12].copy_from_slice(&(s.len() as u32).to_le_bytes());
            entry[12..16].copy_from_slice(&(t.len() as u32).to_le_bytes());
            entry[16..].copy_from_slice(&line.to_le_bytes());
            idx.write(&entry)?;
            for id in s.iter().chain(&t) {
                ids.write(&id.to_le_bytes())?;
            }
            offset += (s.len() + t.len()) as u64;
            meta.pairs += 1;
        }
        meta.lines += chunk.len() as u64;
    }
    // The pair count over its placeholder.
    {
        use std::io::{Seek, SeekFrom};
        idx.out.flush().map_err(io_err("write", &idx.tmp))?;
        let file = idx.out.get_mut();
        file.seek(SeekFrom::Start(MAGIC.len() as u64))
            .and_then(|_| file.write_all(&meta.pairs.to_le_bytes()))
            .map_err(io_err("write", &idx.tmp))?;
    }
    // The metadata goes last: a directory without it (an interrupted run) is refused.
    let _ = std::fs::remove_file(dir.join(META_FILE));
    ids.finish()?;
    idx.finish()?;
    let yaml = serde_yaml::to_string(&meta).expect("the metadata serializes");
    super::write_atomic(&dir.join(META_FILE), yaml.as_bytes())?;
    Ok(meta)
}

/// The digest a binarized corpus records of the tokenizer that encoded it.
pub fn digest(tokenizer_json: &str) -> String {
    kiln_compiler::artifact::hash_hex(tokenizer_json.as_bytes())
}

/// A binarized corpus, mapped.
pub struct Binarized {
    pub meta: Meta,
    ids: memmap2::Mmap,
    idx: memmap2::Mmap,
    len: usize,
}

impl Binarized {
    /// Opens the corpus `binarize` wrote into `dir`, which must have been encoded by the
    /// tokenizer of digest `tokenizer_digest`.
    pub fn open(dir: &Path, tokenizer_digest: &str) -> Result<Binarized, DataError> {
        let bad = |message: String| DataError::Config { message };
        let meta_path = dir.join(META_FILE);
        let text = std::fs::read_to_string(&meta_path).map_err(|e| {
            bad(format!(
                "`{}` is not a binarized corpus ({e}); make one with `kiln preprocess \
                 --config CONFIG.yaml`",
                meta_path.display()
            ))
        })?;
        let meta: Meta = serde_yaml::from_str(&text)
            .map_err(|e| bad(format!("`{}`: {e}", meta_path.display())))?;
        if meta.tokenizer != tokenizer_digest {
            return Err(bad(format!(
                "the binarized corpus `{}` was encoded with another tokenizer (digest {}, the \
                 run's is {tokenizer_digest}); encode it again with `kiln preprocess --config \
                 CONFIG.yaml`",
                dir.display(),
                meta.tokenizer
            )));
        }
        let map = |name: &str| -> Result<memmap2::Mmap, DataError> {
            let path = dir.join(name);
            let file = std::fs::File::open(&path).map_err(io_err("open", &path))?;
            // SAFETY: the file is only read; kiln never writes a binarized corpus in
            // place (a new one replaces it by renaming), so the mapping stays valid.
            unsafe { memmap2::Mmap::map(&file) }.map_err(io_err("map", &path))
        };
        let (ids, idx) = (map(IDS_FILE)?, map(INDEX_FILE)?);
        let len = meta.pairs as usize;
        let damaged = |what: &str| {
            bad(format!(
                "the binarized corpus `{}` is damaged ({what}); make it again with `kiln \
                 preprocess --config CONFIG.yaml`",
                dir.display()
            ))
        };
        if idx.len() != HEADER + ENTRY * len
            || &idx[..8] != MAGIC
            || idx[8..16] != meta.pairs.to_le_bytes()
        {
            return Err(damaged("its index does not hold the pairs it counts"));
        }
        let b = Binarized {
            meta,
            ids,
            idx,
            len,
        };
        // Each pair's ids right after the one before's, the last ending with the file:
        // every pair's slice is then in range (batching reads every entry anyway).
        let mut total = 0usize;
        for i in 0..len {
            let (o, s, t, _) = b.entry(i);
            if o != total {
                return Err(damaged(&format!(
                    "pair {i}'s ids are not where the index says"
                )));
            }
            total = total.saturating_add(s).saturating_add(t);
        }
        if b.ids.len() != total.saturating_mul(4) || !cfg!(target_endian = "little") {
            return Err(damaged("its ids do not fill the index's pairs"));
        }
        Ok(b)
    }

    /// Pair `i`'s entry: offset, source and target lengths (in ids), line.
    fn entry(&self, i: usize) -> (usize, usize, usize, usize) {
        let e = &self.idx[HEADER + ENTRY * i..HEADER + ENTRY * (i + 1)];
        let u64_at = |k: usize| u64::from_le_bytes(e[k..k + 8].try_into().expect("8 bytes"));
        let u32_at = |k: usize| u32::from_le_bytes(e[k..k + 4].try_into().expect("4 bytes"));
        (
            u64_at(0) as usize,
            u32_at(8) as usize,
            u32_at(12) as usize,
            u64_at(16) as usize,
        )
    }

    /// All ids, as `i32`s (the map is page-aligned).
    fn all_ids(&self) -> &[i32] {
        // SAFETY: the map holds `len / 4` little-endian `i32`s (checked at `open`), is
        // aligned to a page, and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ids.as_ptr() as *const i32, self.ids.len() / 4) }
    }
}

impl Pairs for Binarized {
    fn len(&self) -> usize {
        self.len
    }

    fn pair(&self, i: usize) -> (&[i32], &[i32]) {
        let (o, s, t, _) = self.entry(i);
        let ids = self.all_ids();
        (&ids[o..o + s], &ids[o + s..o + s + t])
    }

    fn line(&self, i: usize) -> usize {
        self.entry(i).3
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{load_parallel, BatchConfig, BatchPlan, Dataset};

    const TEXT: [&str; 6] = [
        "the cat sat on the mat",
        "a dog ran in the park",
        "the bird sang",
        "two cats and a dog sat together on a long green mat",
        "a park",
        "the mat",
    ];

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-binarized-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A corpus with a byte-order mark, CRLF lines, an empty pair and a long one.
    fn corpus(dir: &Path) -> (PathBuf, PathBuf) {
        let (src, tgt) = (dir.join("train.src"), dir.join("train.tgt"));
        let mut s = String::from("\u{feff}");
        let mut t = String::new();
        for (i, line) in TEXT.iter().enumerate() {
            let (a, b) = if i == 2 {
                ("", "the bird")
            } else {
                (*line, TEXT[5 - i])
            };
            s.push_str(&format!("{a}\r\n"));
            t.push_str(&format!("{b}\n"));
        }
        std::fs::write(&src, s).unwrap();
        std::fs::write(&tgt, t).unwrap();
        (src, tgt)
    }

    #[test]
    fn the_mapped_pairs_are_the_datasets_and_batch_alike() {
        let dir = scratch("same");
        let (src, tgt) = corpus(&dir);
        let (tok, _) = Tokenizer::train(TEXT, 60, false).unwrap();
        let digest = digest(&tok.to_json().unwrap());
        let out = dir.join("bin");
        let meta = binarize((&src, &tgt), &tok, &digest, 9, &out).unwrap();
        let text = load_parallel(&src, &tgt).unwrap();
        let ds = Dataset::build(&text, &tok, Some(9)).unwrap();
        assert_eq!((meta.lines, meta.skipped_empty), (6, 1));
        assert_eq!(meta.dropped_too_long, ds.dropped_too_long as u64);
        assert!(meta.dropped_too_long >= 1, "the long pair is dropped");
        let b = Binarized::open(&out, &digest).unwrap();
        assert_eq!(Pairs::len(&b), ds.examples.len());
        for i in 0..Pairs::len(&b) {
            let e = &ds.examples[i];
            assert_eq!(b.pair(i), (&e.src[..], &e.tgt[..]), "pair {i}");
            assert_eq!(b.line(i), ds.lines[i]);
        }
        let cfg = BatchConfig {
            max_src_tokens: 12,
            max_tgt_tokens: 12,
        };
        let (p, q) = (
            BatchPlan::new(&b, cfg).unwrap(),
            BatchPlan::new(&ds, cfg).unwrap(),
        );
        assert_eq!(p, q);
        for k in 0..p.len() {
            assert_eq!(p.batch(&b, k), q.batch(&ds, k));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn another_tokenizer_a_damaged_index_and_unaligned_files_are_refused() {
        let dir = scratch("refused");
        let (src, tgt) = corpus(&dir);
        let (tok, _) = Tokenizer::train(TEXT, 60, false).unwrap();
        let digest = digest(&tok.to_json().unwrap());
        let out = dir.join("bin");
        binarize((&src, &tgt), &tok, &digest, 100, &out).unwrap();
        let e = Binarized::open(&out, "0123456789abcdef").err().unwrap();
        assert!(e.to_string().contains("another tokenizer"), "{e}");
        assert!(e.to_string().contains("kiln preprocess"), "{e}");
        let idx = out.join(INDEX_FILE);
        let bytes = std::fs::read(&idx).unwrap();
        // The second pair's source said longer than it is: refused, not read past.
        let mut longer = bytes.clone();
        longer[HEADER + ENTRY + 8] += 1;
        std::fs::write(&idx, &longer).unwrap();
        let e = Binarized::open(&out, &digest).err().unwrap();
        assert!(e.to_string().contains("damaged"), "{e}");
        std::fs::write(&idx, &bytes[..bytes.len() - 3]).unwrap();
        let e = Binarized::open(&out, &digest).err().unwrap();
        assert!(e.to_string().contains("damaged"), "{e}");
        std::fs::write(&tgt, "one line\n").unwrap();
        let e = binarize((&src, &tgt), &tok, &digest, 100, &out).unwrap_err();
        assert!(
            matches!(
                e,
                DataError::LineCount {
                    src_lines: 6,
                    tgt_lines: 1,
                    ..
                }
            ),
            "{e}"
        );
        // The failed run left the corpus before it as it was: still refused as damaged,
        // not replaced by a partial one.
        assert!(Binarized::open(&out, &digest).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
