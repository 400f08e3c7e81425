//! A trained model loaded for translating text: what `kiln translate`, `kiln score`,
//! `kiln serve` and the Python package run.
//!
//! In: a checkpoint, a run (its newest checkpoint), the output of `kiln average`, or a
//! compiled artifact that carries a tokenizer. Out: the model's encoder and decoder-step
//! programs, its weights and tokenizer, and [`Translator::translate`] from lines of text
//! to hypotheses. A sentence's translation does not depend on what else is in its batch
//! (`kiln_decode::translate`), so callers may batch as they like.

use std::path::Path;

use kiln_compiler::artifact::TOKENIZER_FILE;
use kiln_compiler::options::CompileOptions;
use kiln_compiler::tensor::Feeds;
use kiln_decode::search::{DecodeOptions, Hypothesis};
use kiln_decode::translate::{check_sources, translate_nbest_ids, Schedule, StepModels};
use kiln_dsl::Error;
use kiln_exec::artifact::{is_artifact_dir, Artifact};
use kiln_exec::executor::{executor, Exec, ExecutorKind};
use kiln_train::data::Tokenizer;
use kiln_train::model;

/// A model ready to translate: its encoder and decoder-step programs, weights and
/// tokenizer.
pub struct Translator {
    pub encode: Box<dyn Exec>,
    pub step: Box<dyn Exec>,
    pub params: Feeds,
    pub tokenizer: Tokenizer,
    /// The width of the model's output layer (the tokenizer's vocabulary or more).
    pub vocab: usize,
    /// Whether it was loaded from a compiled artifact (else a model directory).
    pub from_artifact: bool,
    /// The options an artifact was compiled with (none for a model directory).
    pub options: Option<CompileOptions>,
}

fn plain(code: &'static str, message: String, help: Option<String>) -> Error {
    Error::plain(code, message, help)
}

fn err<E: std::fmt::Display>(code: &'static str) -> impl Fn(E) -> Error {
    move |e| plain(code, e.to_string(), None)
}

impl Translator {
    /// Loads the model at `path` to run on `kind` (a model directory runs on the CPU
    /// executors; `ExecutorKind::Cuda` takes a `--target cuda` artifact).
    pub fn load(path: &Path, kind: ExecutorKind) -> Result<Translator, Error> {
        if is_artifact_dir(path) {
            return Translator::from_artifact(path, kind);
        }
        if kind == ExecutorKind::Cuda {
            return Err(plain(
                "kiln::translate",
                format!(
                    "the CUDA executor (`--executor cuda`) runs a compiled CUDA artifact, and `{}` is a \
                     model directory",
                    path.display()
                ),
                Some(format!(
                    "compile one first: `kiln compile --from-model {} --target cuda -o DIR`, then \
                     load DIR",
                    path.display()
                )),
            ));
        }
        let m = model::load(path).map_err(err("kiln::model"))?;
        let encode = executor(kind, m.graphs.encode.clone()).map_err(err("kiln::model"))?;
        let mut step = executor(kind, m.graphs.decode_step.clone()).map_err(err("kiln::model"))?;
        share_arena(encode.as_ref(), step.as_mut());
        let vocab = m.graphs.vocab().unwrap_or(m.tokenizer.vocab_size());
        Ok(Translator {
            encode,
            step,
            params: m.params,
            tokenizer: m.tokenizer,
            vocab,
            from_artifact: false,
            options: None,
        })
    }

    fn from_artifact(path: &Path, kind: ExecutorKind) -> Result<Translator, Error> {
        let art = Artifact::load(path).map_err(err("kiln::artifact"))?;
        let Some(bytes) = art.tokenizer_json() else {
            return Err(plain(
                "kiln::translate",
                format!(
                    "the artifact `{}` carries no tokenizer, so it cannot translate text",
                    path.display()
                ),
                Some(
                    "compile it from a trained model: `kiln compile --from-model RUN_OR_CHECKPOINT -o DIR`"
                        .to_string(),
                ),
            ));
        };
        let origin = path.join(TOKENIZER_FILE);
        let tokenizer = Tokenizer::from_json(&String::from_utf8_lossy(bytes), &origin)
            .map_err(err("kiln::artifact"))?;
        let ex = |name: &str| -> Result<Box<dyn Exec>, Error> {
            match kind {
                ExecutorKind::Cuda => kiln_exec::cuda::executor_for(&art, name).map_err(|e| {
                    plain(
                        "kiln::cuda",
                        e,
                        Some("the compiled executor (`--executor compiled`) runs the artifact's CPU code".to_string()),
                    )
                }),
                ExecutorKind::Compiled => {
                    Ok(Box::new(art.executor(name).map_err(err("kiln::artifact"))?))
                }
                _ => {
                    let g = art.entry(name).map_err(err("kiln::artifact"))?;
                    executor(kind, g.manifest.graph.clone()).map_err(err("kiln::model"))
                }
            }
        };
        let encode = ex("encode")?;
        let mut step = ex("decode_step")?;
        share_arena(encode.as_ref(), step.as_mut());
        let params = art.weights().map_err(err("kiln::artifact"))?;
        let options = Some(art.manifest.options.clone());
        let width = model::logits_width(step.graph());
        model::check_vocab(&tokenizer, width, &origin).map_err(err("kiln::artifact"))?;
        let vocab = width.unwrap_or(tokenizer.vocab_size());
        Ok(Translator {
            encode,
            step,
            params,
            tokenizer,
            vocab,
            from_artifact: true,
            options,
        })
    }

    /// The programs, parameters and vocabulary the batch functions decode with.
    pub fn step_models(&self) -> StepModels<'_> {
        StepModels {
            encode: &*self.encode,
            step: &*self.step,
            params: &self.params,
            vocab: self.vocab,
        }
    }

    /// The token ids of the non-empty `lines`; `name(i)` names line `i` in an error (a
    /// line the tokenizer or the model cannot take).
    pub fn encode_lines(
        &self,
        lines: &[impl AsRef<str>],
        name: &dyn Fn(usize) -> String,
    ) -> Result<Sources, Error> {
        let mut ids = Vec::new();
        let mut which = Vec::new();
        for (i, l) in lines.iter().enumerate() {
            let l = l.as_ref();
            if !l.trim().is_empty() {
                let s = self
                    .tokenizer
                    .encode(l)
                    .map_err(|e| plain("kiln::translate", format!("{}: {e}", name(i)), None))?;
                ids.push(s);
                which.push(i);
            }
        }
        let nth = |k: usize| name(which[k]);
        check_sources(self.encode.as_ref(), &ids, &nth)
            .map_err(|e| plain("kiln::translate", e, None))?;
        Ok(Sources {
            ids,
            which,
            lines: lines.len(),
        })
    }

    /// The `nbest` best hypotheses of each line of `src` (none for an empty line), best
    /// first; `done(n)` is told how many sentences are done as batches finish.
    pub fn translate_sources(
        &self,
        src: &Sources,
        opts: &DecodeOptions,
        (nbest, schedule): (usize, Schedule),
        done: &mut dyn FnMut(usize),
    ) -> Result<Vec<Vec<Hypothesis>>, Error> {
        let hyps = translate_nbest_ids(self.step_models(), &src.ids, opts, nbest, schedule, done)
            .map_err(err("kiln::translate"))?;
        let mut out: Vec<Vec<Hypothesis>> = vec![Vec::new(); src.lines];
        for (&i, h) in src.which.iter().zip(hyps) {
            out[i] = h;
        }
        Ok(out)
    }

    /// [`Translator::encode_lines`] then [`Translator::translate_sources`], the lines
    /// named by their number from 1.
    pub fn translate(
        &self,
        lines: &[impl AsRef<str>],
        opts: &DecodeOptions,
        run: (usize, Schedule),
        done: &mut dyn FnMut(usize),
    ) -> Result<Vec<Vec<Hypothesis>>, Error> {
        let src = self.encode_lines(lines, &|i| format!("line {}", i + 1))?;
        self.translate_sources(&src, opts, run, done)
    }
}

/// Lines of text as a model's source ids: the non-empty ones, and which line each is.
pub struct Sources {
    pub ids: Vec<Vec<i32>>,
    pub which: Vec<usize>,
    /// How many lines there were, empty ones included.
    pub lines: usize,
}

/// The encoder runs once per batch and the decoder step after it, never at once: compiled
/// CPU programs share one arena, as large as the larger layout, as the trainer's do.
pub fn share_arena(encode: &dyn Exec, step: &mut dyn Exec) {
    if let Some(arena) = encode.arena() {
        step.share_arena(&arena);
    }
}
