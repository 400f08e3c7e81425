//! The step models a search runs: a decoder step with its caches kept on the host
//! ([`CachedStep`]) or on the device ([`DeviceCachedStep`]), or the whole target prefix
//! run again each step ([`FullStep`]), and the rows they keep as beams survive.

use std::collections::BTreeMap;

use kiln_compiler::reference::RunOptions;
use kiln_compiler::tensor::{Tensor, TensorData};

use kiln_exec::executor::{DeviceResident, Exec};

use super::*;

/// The rows `rows` of `t` along axis 0, in that order.
pub fn take_rows(t: &Tensor, rows: &[usize]) -> Tensor {
    let row = if t.shape.is_empty() || t.shape[0] == 0 {
        0
    } else {
        t.numel() / t.shape[0]
    };
    fn pick<E: Copy>(v: &[E], rows: &[usize], row: usize) -> Vec<E> {
        let mut out = Vec::with_capacity(rows.len() * row);
        for &r in rows {
            out.extend_from_slice(&v[r * row..(r + 1) * row]);
        }
        out
    }
    let data = match &t.data {
        TensorData::F32(v) => TensorData::F32(pick(v, rows, row)),
        TensorData::F64(v) => TensorData::F64(pick(v, rows, row)),
        TensorData::I32(v) => TensorData::I32(pick(v, rows, row)),
        TensorData::I64(v) => TensorData::I64(pick(v, rows, row)),
        TensorData::Bool(v) => TensorData::Bool(pick(v, rows, row)),
    };
    let mut shape = t.shape.clone();
    if !shape.is_empty() {
        shape[0] = rows.len();
    }
    Tensor { shape, data }
}

pub(super) fn logits_of(
    out: &mut BTreeMap<String, Tensor>,
    rows: usize,
) -> Result<(Vec<f32>, usize), DecodeError> {
    let t = out
        .remove("logits")
        .ok_or_else(|| DecodeError::Model("the model has no `logits` output".to_string()))?;
    let TensorData::F32(v) = t.data else {
        return Err(DecodeError::Model("logits are not f32".to_string()));
    };
    let [r, len, vocab] = t.shape[..] else {
        return Err(DecodeError::Model(format!(
            "logits have shape {:?}, expected [rows, len, vocab]",
            t.shape
        )));
    };
    if r != rows {
        return Err(DecodeError::Model(format!(
            "logits have {r} rows, expected {rows}"
        )));
    }
    if len == 1 {
        // A decoding step: the logits are those of the newest position already.
        return Ok((v, vocab));
    }
    // The last position of every row.
    let mut last = Vec::with_capacity(rows * vocab);
    for i in 0..rows {
        let start = (i * len + len - 1) * vocab;
        last.extend_from_slice(&v[start..start + vocab]);
    }
    Ok((last, vocab))
}

/// The [`StepModel`] methods of a host step model with a `step_logits` method and a
/// `vocab` field: log-probabilities of whole rows, or each row's best tokens straight
/// from the logits ([`rows_top`]).
macro_rules! host_step_methods {
    () => {
        fn step(&mut self, tokens: &[i32], parents: &[usize]) -> Result<Vec<f64>, DecodeError> {
            let (logits, vocab) = self.step_logits(tokens, parents)?;
            Ok(log_softmax_rows(&logits, vocab))
        }

        fn step_top(
            &mut self,
            tokens: &[i32],
            parents: &[usize],
            spec: &TopSpec<'_>,
        ) -> Result<Vec<RowTop>, DecodeError> {
            let (logits, vocab) = self.step_logits(tokens, parents)?;
            Ok(rows_top(&logits, vocab, spec))
        }

        fn vocab(&self) -> usize {
            self.vocab
        }
    };
}

/// How a step's rows continue the rows of the step before (`parents`), given the
/// sentence of each earlier row: rows in the same order (greedy decoding until a sentence
/// ends) keep every state tensor as it is; in any other order the caches are gathered,
/// and the per-sentence values too unless every row continues a row of its own sentence.
pub(super) struct RowLayout {
    same: bool,
    same_sentences: bool,
    /// The sentence of each new row.
    sentences: Vec<usize>,
}

impl RowLayout {
    fn new(before: &[usize], parents: &[usize]) -> Result<RowLayout, DecodeError> {
        if let Some(&p) = parents.iter().find(|&&p| p >= before.len()) {
            return Err(DecodeError::Model(format!(
                "row {p} continued, but the step before had {} rows",
                before.len()
            )));
        }
        let sentences: Vec<usize> = parents.iter().map(|&p| before[p]).collect();
        Ok(RowLayout {
            same: parents.iter().enumerate().all(|(i, &p)| i == p),
            same_sentences: sentences == before,
            sentences,
        })
    }

    /// Whether state tensor `name` (first axis `first`) stays as it is for `rows` rows.
    fn stays(&self, name: &str, first: Option<&usize>, rows: usize) -> bool {
        first == Some(&rows)
            && (self.same
                || (self.same_sentences && !name.starts_with(kiln_compiler::ir::CACHE_PREFIX)))
    }
}

/// Decoding with the `encode` and `decode_step` entry points and a key/value cache.
pub struct CachedStep<'a> {
    encode: &'a dyn Exec,
    step: &'a dyn Exec,
    params: &'a BTreeMap<String, Tensor>,
    opts: RunOptions,
    /// Per row: the source, the stage values (encoder memory), the caches.
    state: BTreeMap<String, Tensor>,
    /// The sentence of each row of `state`. What is not a cache is the same for every
    /// row of a sentence, so a step whose rows continue the same sentences in the same
    /// places (beam search between two steps where no sentence ends) keeps it as it is.
    sentences: Vec<usize>,
    vocab: usize,
}

impl<'a> CachedStep<'a> {
    pub fn new(
        encode: &'a dyn Exec,
        step: &'a dyn Exec,
        params: &'a BTreeMap<String, Tensor>,
        vocab: usize,
    ) -> CachedStep<'a> {
        CachedStep {
            encode,
            step,
            params,
            // `params` is borrowed for the decoder's life: unchanged between its runs.
            opts: RunOptions {
                params_version: Some(kiln_exec::executor::fresh_params_version()),
                ..RunOptions::default()
            },
            state: BTreeMap::new(),
            sentences: Vec::new(),
            vocab,
        }
    }

    /// One step: the state's rows gathered in the order `parents`, the step run on the
    /// newest `tokens`, the grown caches kept as the next state. Returns the logits of
    /// the newest position, `rows × vocab`.
    fn step_logits(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
    ) -> Result<(Vec<f32>, usize), DecodeError> {
        use rayon::prelude::*;
        let rows = tokens.len();
        let layout = RowLayout::new(&self.sentences, parents)?;
        let tgt_in = Tensor::i32(vec![rows, 1], tokens.to_vec())
            .map_err(|e| DecodeError::Model(e.to_string()))?;
        let sentences = layout.sentences.clone();
        let keep = |k: &str, t: &Tensor| layout.stays(k, t.shape.first(), rows);
        // What must be reordered: the step reads some of it with its rows gathered (the
        // caches, which only its concatenations read), the rest is copied here.
        let step = self.step;
        let folded: std::collections::BTreeSet<String> = self
            .state
            .iter()
            .filter(|(k, t)| !keep(k, t) && step.folds_row_gather(k))
            .map(|(k, _)| k.clone())
            .collect();
        let mut inputs: BTreeMap<String, Tensor> = std::mem::take(&mut self.state)
            .into_par_iter()
            .map(|(k, t)| {
                if keep(&k, &t) || folded.contains(&k) {
                    (k, t)
                } else {
                    (k, take_rows(&t, parents))
                }
            })
            .collect();
        inputs.insert("tgt_in".to_string(), tgt_in);
        let out = self
            .step
            .run_map_gathered(&inputs, &folded, parents, self.params, &self.opts);
        inputs.remove("tgt_in");
        let mut out = match out {
            Ok(out) => out,
            Err(e) => {
                // The state as this step read it: the decoder stays usable.
                for k in &folded {
                    if let Some(t) = inputs.get_mut(k) {
                        *t = take_rows(t, parents);
                    }
                }
                self.state = inputs;
                self.sentences = sentences;
                return Err(e.into());
            }
        };
        let logits = logits_of(&mut out, rows);
        for (name, t) in out {
            if name.starts_with(kiln_compiler::ir::CACHE_PREFIX) {
                inputs.insert(name, t);
            }
        }
        self.state = inputs;
        self.sentences = sentences;
        let (logits, vocab) = logits?;
        self.vocab = vocab;
        Ok((logits, vocab))
    }
}

impl StepModel for CachedStep<'_> {
    fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
        let mut inputs = BTreeMap::new();
        inputs.insert("src".to_string(), src.clone());
        let stages = self.encode.run_map(&inputs, self.params, &self.opts)?;
        self.state = stages;
        self.state.insert("src".to_string(), src.clone());
        // Only what the step reads is kept (and reordered at every step): a step whose
        // per-sentence values `encode` computed (`static.…`) no longer reads the memory.
        let g = self.step.graph();
        self.state.retain(|name, _| g.input(name).is_some());
        self.sentences = (0..src.shape.first().copied().unwrap_or(0)).collect();
        // Empty caches: the decode graph's cache inputs with 0 past positions.
        let b = src.shape[0];
        for name in g.cache_outputs() {
            let id = g
                .input(&name)
                .ok_or_else(|| DecodeError::Model(format!("cache `{name}` has no input")))?;
            let ty = g.ty(id);
            let mut shape = Vec::new();
            for (i, d) in ty.shape.dims().iter().enumerate() {
                shape.push(match (i, d.as_const()) {
                    (0, _) => b,
                    (_, Some(c)) => c as usize,
                    _ => 0, // the `past` axis starts empty
                });
            }
            self.state.insert(
                name,
                Tensor::f32(shape, vec![]).map_err(|e| DecodeError::Model(e.to_string()))?,
            );
        }
        Ok(())
    }

    host_step_methods!();
}

/// [`CachedStep`] with the state on the GPU: the `decode_step` entry runs on a CUDA
/// executor, which holds the encoder's output, the source and the key/value caches
/// between steps. Each step uploads only the newest tokens, reorders the state's rows on
/// the device (`DeviceResident::take_rows`), runs the step with that state bound in place
/// (`DeviceResident::run_resident`, the grown caches kept on the device) and, in beam
/// search ([`StepModel::step_top`]), selects each row's best tokens on the device too
/// (`DeviceResident::row_top_k`): `2·beam` tokens a row come back instead of the logits.
/// The same computation as [`CachedStep`] on the same executor (the log-softmax's sum in
/// another order: scores within rounding, the same tokens but for exact ties).
pub struct DeviceCachedStep<'a> {
    /// The encoder, the parameters, the run options and the vocabulary; its host state
    /// only between `start` and the upload.
    host: CachedStep<'a>,
    step: &'a dyn DeviceResident,
    state: BTreeMap<String, kiln_exec::cuda::DeviceTensor>,
}

impl<'a> DeviceCachedStep<'a> {
    pub fn new(
        encode: &'a dyn Exec,
        step: &'a dyn DeviceResident,
        params: &'a BTreeMap<String, Tensor>,
        vocab: usize,
    ) -> DeviceCachedStep<'a> {
        DeviceCachedStep {
            host: CachedStep::new(encode, step, params, vocab),
            step,
            state: BTreeMap::new(),
        }
    }

    /// One step on the device: the state's rows gathered in the order `parents`, the
    /// newest `tokens` uploaded, the grown caches kept on the device as the next state.
    /// Returns the outputs that came back and, with `keep_logits`, the logits left on
    /// the device instead.
    fn advance(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
        keep_logits: bool,
    ) -> Result<
        (
            BTreeMap<String, Tensor>,
            Option<kiln_exec::cuda::DeviceTensor>,
        ),
        DecodeError,
    > {
        let rows = tokens.len();
        // What stays and what is gathered (on the device) as on the host.
        let layout = RowLayout::new(&self.host.sentences, parents)?;
        let (mut resident, moved): (BTreeMap<_, _>, BTreeMap<_, _>) =
            std::mem::take(&mut self.state)
                .into_iter()
                .partition(|(k, t)| layout.stays(k, t.shape.first(), rows));
        let names: Vec<String> = moved.keys().cloned().collect();
        let held: Vec<&kiln_exec::cuda::DeviceTensor> = moved.values().collect();
        if !held.is_empty() {
            let gathered = self.step.take_rows(&held, parents)?;
            resident.extend(names.into_iter().zip(gathered));
        }
        drop(moved);
        self.host.sentences = layout.sentences;
        let mut inputs = BTreeMap::new();
        inputs.insert(
            "tgt_in".to_string(),
            Tensor::i32(vec![rows, 1], tokens.to_vec())
                .map_err(|e| DecodeError::Model(e.to_string()))?,
        );
        let keep = |name: &str| {
            name.starts_with(kiln_compiler::ir::CACHE_PREFIX) || (keep_logits && name == "logits")
        };
        let (out, mut kept) =
            self.step
                .run_resident(&inputs, &resident, self.host.params, &self.host.opts, &keep)?;
        let logits = kept.remove("logits");
        resident.extend(kept);
        self.state = resident;
        Ok((out.into_iter().collect(), logits))
    }
}

impl StepModel for DeviceCachedStep<'_> {
    fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
        self.host.start(src)?;
        let host = std::mem::take(&mut self.host.state);
        self.state = host
            .iter()
            .map(|(k, t)| Ok((k.clone(), self.step.to_device(t)?)))
            .collect::<Result<_, DecodeError>>()?;
        Ok(())
    }

    fn step(&mut self, tokens: &[i32], parents: &[usize]) -> Result<Vec<f64>, DecodeError> {
        let (mut out, _) = self.advance(tokens, parents, false)?;
        let (logits, vocab) = logits_of(&mut out, tokens.len())?;
        self.host.vocab = vocab;
        Ok(log_softmax_rows(&logits, vocab))
    }

    /// The step with its logits left on the GPU: the best tokens of each row are
    /// selected there (`DeviceResident::row_top_k`), so only `k` tokens a row come back.
    fn step_top(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
        spec: &TopSpec<'_>,
    ) -> Result<Vec<RowTop>, DecodeError> {
        let (_, logits) = self.advance(tokens, parents, true)?;
        let logits = logits
            .ok_or_else(|| DecodeError::Model("the model has no `logits` output".to_string()))?;
        match logits.shape[..] {
            [r, _, vocab] if r == tokens.len() => self.host.vocab = vocab,
            _ => {
                return Err(DecodeError::Model(format!(
                    "logits have shape {:?}, expected [{}, len, vocab]",
                    logits.shape,
                    tokens.len()
                )))
            }
        }
        let top = self
            .step
            .row_top_k(&logits, spec.k, spec.banned, spec.eos)?;
        Ok((0..tokens.len())
            .map(|r| RowTop {
                best: (0..top.k)
                    .map(|j| (top.vals[r * top.k + j], top.ids[r * top.k + j]))
                    .take_while(|&(_, id)| id >= 0)
                    .collect(),
                eos: top.eos[r],
            })
            .collect())
    }

    fn vocab(&self) -> usize {
        self.host.vocab
    }
}

/// The cached decoder for `encode` and `step`: [`DeviceCachedStep`] when `step` is a
/// CUDA executor (the state stays on the GPU), [`CachedStep`] otherwise.
pub fn cached_step<'a>(
    encode: &'a dyn Exec,
    step: &'a dyn Exec,
    params: &'a BTreeMap<String, Tensor>,
    vocab: usize,
) -> Box<dyn StepModel + 'a> {
    cached_step_with_version(
        encode,
        step,
        params,
        vocab,
        kiln_exec::executor::fresh_params_version(),
    )
}

/// [`cached_step`] for decoders that run at once on the same `params` (decoding
/// workers): they promise the same parameters `version`, so the programs' copies derived
/// from the parameters are made once and serve them all.
pub fn cached_step_with_version<'a>(
    encode: &'a dyn Exec,
    step: &'a dyn Exec,
    params: &'a BTreeMap<String, Tensor>,
    vocab: usize,
    version: u64,
) -> Box<dyn StepModel + 'a> {
    match step.as_resident() {
        Some(resident) => Box::new(DeviceCachedStep::new(encode, resident, params, vocab)),
        None => {
            let mut m = CachedStep::new(encode, step, params, vocab);
            m.opts.params_version = Some(version);
            Box::new(m)
        }
    }
}

/// Decoding by running the `forward` entry on the whole prefix at every step.
pub struct FullStep<'a> {
    forward: &'a dyn Exec,
    params: &'a BTreeMap<String, Tensor>,
    src: Option<Tensor>,
    prefixes: Vec<Vec<i32>>,
    src_rows: Vec<usize>,
    vocab: usize,
}

impl<'a> FullStep<'a> {
    pub fn new(
        forward: &'a dyn Exec,
        params: &'a BTreeMap<String, Tensor>,
        vocab: usize,
    ) -> FullStep<'a> {
        FullStep {
            forward,
            params,
            src: None,
            prefixes: vec![],
            src_rows: vec![],
            vocab,
        }
    }

    /// One step on the whole prefix of every row: the logits of its newest position.
    fn step_logits(
        &mut self,
        tokens: &[i32],
        parents: &[usize],
    ) -> Result<(Vec<f32>, usize), DecodeError> {
        let rows = tokens.len();
        let mut prefixes = Vec::with_capacity(rows);
        let mut src_rows = Vec::with_capacity(rows);
        for (r, &p) in parents.iter().enumerate() {
            let mut pre = self.prefixes[p].clone();
            pre.push(tokens[r]);
            prefixes.push(pre);
            src_rows.push(self.src_rows[p]);
        }
        let len = prefixes.first().map(|p| p.len()).unwrap_or(0);
        let flat: Vec<i32> = prefixes.concat();
        let src = self
            .src
            .as_ref()
            .ok_or_else(|| DecodeError::Model("step before start".to_string()))?;
        let mut inputs = BTreeMap::new();
        inputs.insert("src".to_string(), take_rows(src, &src_rows));
        inputs.insert(
            "tgt_in".to_string(),
            Tensor::i32(vec![rows, len], flat).map_err(|e| DecodeError::Model(e.to_string()))?,
        );
        let mut out = self
            .forward
            .run_map(&inputs, self.params, &RunOptions::default())?;
        let (logits, vocab) = logits_of(&mut out, rows)?;
        self.prefixes = prefixes;
        self.src_rows = src_rows;
        self.vocab = vocab;
        Ok((logits, vocab))
    }
}

impl StepModel for FullStep<'_> {
    fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
        self.src = Some(src.clone());
        self.prefixes = vec![vec![]; src.shape[0]];
        self.src_rows = (0..src.shape[0]).collect();
        Ok(())
    }

    host_step_methods!();
}
