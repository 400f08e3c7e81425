//! The BPE vocabulary shared by source and target: trained with the `tokenizers` crate,
//! kept as `tokenizer.json`, with byte fallback for characters it has never seen.

use std::path::Path;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;

use super::{io_err, write_atomic, DataError, ParallelCorpus, METASPACE, SPECIAL_TOKENS, UNK};

/// A BPE vocabulary shared by source and target, wrapping a `tokenizers` tokenizer.
///
/// Pipeline: no normalizer (case and Unicode form are kept), a Metaspace pre-tokenizer
/// (`▁` for a space, prepended to the text, split before each `▁`), a BPE model whose
/// unknown token is `<unk>` — or, with byte fallback, which spells a character it does not
/// know as its UTF-8 bytes (`<0xF0>` …, as sentencepiece does) — no post-processor (no
/// specials are added by encoding), and the decoder: byte tokens back into characters,
/// then Metaspace, which turns `▁` back into spaces and drops the one it prepended.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

/// What BPE training produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BpeReport {
    /// The vocabulary size asked for (specials included).
    pub requested: usize,
    /// The size reached. Smaller than `requested` when the corpus runs out of pairs to
    /// merge (every word is already a single token).
    pub vocab_size: usize,
    /// Distinct characters of the training text (each is a token).
    pub alphabet: usize,
    /// Merges learned.
    pub merges: usize,
}

impl Tokenizer {
    /// Trains a BPE vocabulary of `vocab_size` tokens (the 4 specials included, and with
    /// `byte_fallback` the 256 byte tokens) on `texts`: for a translation task, every
    /// source and every target line.
    ///
    /// Deterministic: the same texts (in any order) and size give the same vocabulary and
    /// the same `tokenizer.json` bytes. The `tokenizers` trainer counts words and pairs in
    /// hash maps with per-process random seeds and in parallel, but every quantity it
    /// derives is an order-independent sum, merges are chosen by (count, then pair ids),
    /// and the pair ids come from the sorted alphabet. The tests check the bytes.
    ///
    /// The size is smaller than asked when the corpus has too few distinct words to merge
    /// further ([`BpeReport::vocab_size`]); a size too small to hold the specials and the
    /// alphabet is an error.
    pub fn train<'a, I>(
        texts: I,
        vocab_size: usize,
        byte_fallback: bool,
    ) -> Result<(Tokenizer, BpeReport), DataError>
    where
        I: IntoIterator<Item = &'a str>,
    {
        let texts: Vec<&str> = texts.into_iter().collect();
        let mut alphabet: Vec<char> = texts
            .iter()
            .flat_map(|t| t.chars())
            .map(|c| if c == ' ' { METASPACE } else { c })
            .collect();
        // Metaspace prepends `▁` to every non-empty text.
        if texts.iter().any(|t| !t.is_empty()) {
            alphabet.push(METASPACE);
        }
        alphabet.sort_unstable();
        alphabet.dedup();
        let bytes = if byte_fallback { BYTE_TOKENS } else { 0 };
        let needed = SPECIAL_TOKENS.len() + bytes + alphabet.len();
        if vocab_size < needed {
            return Err(DataError::VocabTooSmall {
                requested: vocab_size,
                alphabet: alphabet.len(),
                needed,
                byte_fallback,
            });
        }

        // No corpus gives more merges than it has characters (each merge joins two
        // symbols of a word into one), so a larger request is clamped to that bound:
        // the trainer sizes its tables by the request, and a huge one aborted it.
        let chars: usize = texts.iter().map(|t| t.chars().count()).sum();
        let reachable = (vocab_size - bytes).min((needed - bytes).saturating_add(chars));
        let model = BPE::builder()
            .unk_token(SPECIAL_TOKENS[UNK as usize].to_string())
            .build()
            .map_err(|e| DataError::Train {
                message: e.to_string(),
            })?;
        let mut inner = tokenizers::Tokenizer::new(model);
        inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(metaspace())));
        inner.with_decoder(Some(DecoderWrapper::Metaspace(metaspace())));
        let trainer = BpeTrainerBuilder::new()
            .vocab_size(reachable)
            .min_frequency(0)
            .show_progress(false)
            .special_tokens(
                SPECIAL_TOKENS
                    .iter()
                    .map(|s| AddedToken::from(*s, true))
                    .collect(),
            )
            .build();
        let mut trainer = TrainerWrapper::BpeTrainer(trainer);
        inner
            .train(&mut trainer, texts.iter().copied())
            .map_err(|e| DataError::Train {
                message: e.to_string(),
            })?;
        if byte_fallback {
            inner = with_byte_fallback(&inner)?;
        }
        let tok = Tokenizer::from_inner(inner, Path::new("<trained>"))?;
        let merges = match serde_json::to_value(tok.inner.get_model()) {
            Ok(v) => v["merges"].as_array().map_or(0, |m| m.len()),
            Err(_) => 0,
        };
        let report = BpeReport {
            requested: vocab_size,
            vocab_size: tok.vocab_size(),
            alphabet: alphabet.len(),
            merges,
        };
        Ok((tok, report))
    }

    /// Trains on every line of both sides of `corpus` (source lines first).
    pub fn train_on_corpus(
        corpus: &ParallelCorpus,
        vocab_size: usize,
        byte_fallback: bool,
    ) -> Result<(Tokenizer, BpeReport), DataError> {
        Tokenizer::train(
            corpus
                .src
                .iter()
                .chain(corpus.tgt.iter())
                .map(String::as_str),
            vocab_size,
            byte_fallback,
        )
    }

    /// Checks the special tokens and sets encoding to read them as plain text.
    fn from_inner(mut inner: tokenizers::Tokenizer, path: &Path) -> Result<Tokenizer, DataError> {
        for (id, tok) in SPECIAL_TOKENS.iter().enumerate() {
            match inner.token_to_id(tok) {
                Some(got) if got as usize == id => {}
                Some(got) => {
                    return Err(DataError::BadTokenizer {
                        path: path.to_path_buf(),
                        message: format!("`{tok}` has id {got}, not {id}"),
                    })
                }
                None => {
                    return Err(DataError::BadTokenizer {
                        path: path.to_path_buf(),
                        message: format!("it has no `{tok}` token"),
                    })
                }
            }
        }
        if inner.get_vocab_size(true) > i32::MAX as usize {
            return Err(DataError::BadTokenizer {
                path: path.to_path_buf(),
                message: "its vocabulary does not fit i32 ids".to_string(),
            });
        }
        // A literal "<pad>" in a sentence is text, not the padding token.
        inner.set_encode_special_tokens(true);
        Ok(Tokenizer { inner })
    }

    /// The tokenizer as `tokenizer.json` text (pretty-printed JSON).
    pub fn to_json(&self) -> Result<String, DataError> {
        self.inner.to_string(true).map_err(|e| DataError::Train {
            message: format!("cannot serialize the tokenizer: {e}"),
        })
    }

    /// Reads a tokenizer from `tokenizer.json` text; `origin` names it in errors.
    pub fn from_json(json: &str, origin: &Path) -> Result<Tokenizer, DataError> {
        let inner: tokenizers::Tokenizer =
            json.parse()
                .map_err(|e: tokenizers::Error| DataError::BadTokenizer {
                    path: origin.to_path_buf(),
                    message: format!("it does not parse ({e})"),
                })?;
        Tokenizer::from_inner(inner, origin)
    }

    /// Writes `tokenizer.json` atomically (a temporary sibling, fsync, rename).
    pub fn save(&self, path: &Path) -> Result<(), DataError> {
        let json = self.to_json()?;
        write_atomic(path, json.as_bytes())
    }

    /// Reads a `tokenizer.json` and checks its special tokens.
    pub fn load(path: &Path) -> Result<Tokenizer, DataError> {
        let json = std::fs::read_to_string(path).map_err(io_err("read", path))?;
        Tokenizer::from_json(&json, path)
    }

    /// Tokens in the vocabulary, specials included; ids are `0..vocab_size()`.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: i32) -> Option<String> {
        u32::try_from(id)
            .ok()
            .and_then(|i| self.inner.id_to_token(i))
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<i32> {
        self.inner
            .token_to_id(token)
            .and_then(|i| i32::try_from(i).ok())
    }

    /// The ids of `text`, without special tokens. A character the vocabulary has never
    /// seen becomes its UTF-8 bytes' tokens with byte fallback, else `<unk>` (id 3);
    /// special-token strings in the text (`<pad>`, ...) are encoded as ordinary text.
    ///
    /// Decoding restores `text` exactly unless it holds a character that became `<unk>`, starts with a
    /// space (the Metaspace decoder cannot tell it from the space it prepends), or holds
    /// `▁` (U+2581) itself, which decodes as a space.
    pub fn encode(&self, text: &str) -> Result<Vec<i32>, DataError> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| DataError::Encode {
                what: format!("{:?}", truncate(text, 60)),
                message: e.to_string(),
            })?;
        // Ids are below vocab_size, which `from_inner` checked fits i32.
        Ok(enc.get_ids().iter().map(|&i| i as i32).collect())
    }

    /// The text of `ids`. `<unk>` is written as `<unk>`: a word the model could not spell
    /// shows, it is not silently dropped. The other special tokens and ids outside the
    /// vocabulary are skipped, so a decoder's output can be passed as is.
    pub fn decode(&self, ids: &[i32]) -> String {
        let tokens: Vec<String> = ids
            .iter()
            .filter_map(|&id| match id {
                UNK => Some(SPECIAL_TOKENS[UNK as usize].to_string()),
                _ if id < SPECIAL_TOKENS.len() as i32 => None,
                _ => u32::try_from(id)
                    .ok()
                    .and_then(|id| self.inner.id_to_token(id)),
            })
            .collect();
        // The decoders kiln writes cannot fail; should a hand-edited `tokenizer.json` carry
        // one that does, or none, join the tokens with `▁` read as a space.
        let joined = |tokens: &[String]| {
            tokens
                .concat()
                .replace(METASPACE, " ")
                .trim_start()
                .to_string()
        };
        use tokenizers::Decoder as _;
        match self.inner.get_decoder() {
            Some(d) => d.decode(tokens.clone()).unwrap_or_else(|_| joined(&tokens)),
            None => joined(&tokens),
        }
    }
}

/// The byte tokens `<0x00>` … `<0xFF>` a vocabulary with byte fallback holds.
pub const BYTE_TOKENS: usize = 256;

/// `inner` with byte fallback: the 256 byte tokens after its learned ones, its BPE model
/// spelling a character it does not know with them, and the byte-fallback decoder before
/// its own. `tokenizers` has the pieces but no trainer option for them.
fn with_byte_fallback(inner: &tokenizers::Tokenizer) -> Result<tokenizers::Tokenizer, DataError> {
    let fail = |e: &dyn std::fmt::Display| DataError::Train {
        message: format!("cannot add byte fallback: {e}"),
    };
    let json = inner.to_string(false).map_err(|e| fail(&e))?;
    let mut v: serde_json::Value = serde_json::from_str(&json).map_err(|e| fail(&e))?;
    let vocab = v["model"]["vocab"]
        .as_object_mut()
        .ok_or_else(|| fail(&"the BPE model has no vocabulary"))?;
    let mut next = vocab
        .values()
        .filter_map(|id| id.as_u64())
        .max()
        .map_or(0, |m| m + 1);
    for b in 0..=255u8 {
        let token = format!("<0x{b:02X}>");
        if !vocab.contains_key(&token) {
            vocab.insert(token, next.into());
            next += 1;
        }
    }
    v["model"]["byte_fallback"] = true.into();
    let decoder = v["decoder"].take();
    v["decoder"] = serde_json::json!({
        "type": "Sequence",
        "decoders": [{"type": "ByteFallback"}, decoder],
    });
    let json = serde_json::to_string(&v).map_err(|e| fail(&e))?;
    json.parse().map_err(|e: tokenizers::Error| fail(&e))
}

fn metaspace() -> Metaspace {
    Metaspace::new(METASPACE, PrependScheme::Always, true)
}

fn truncate(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}
