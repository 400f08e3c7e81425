//! Entry points and the checks on what is fed to them.
//!
//! In: a model graph (every output and the objective) and the name of an entry point;
//! tensors read from safetensors files. Out: the pruned graph of that entry
//! ([`entry_graph`]), or an error that names the entry, tensor or parameter at fault
//! and says how to fix it ([`check_inputs`], [`check_weights`]).
//!
//! Entry points, and the graph each is cut from:
//! - `forward`: every declared output except the objective and stages (inference graph);
//! - `loss`: the objective alone (inference graph; the training graph adds dropout);
//! - `encode`: the `stage` outputs, e.g. the encoder memory (inference graph);
//! - `decode_step`: the outputs plus the updated key/value caches of one incremental
//!   decoder step (decode graph, where stages and caches are inputs);
//! - `train_step`: the objective and the gradient of every parameter (training graph,
//!   differentiated by the compiler).

use std::collections::BTreeMap;

use kiln_compiler::ir::{Graph, Op};
use kiln_compiler::tensor::{Feeds, TensorData};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    Forward,
    Loss,
    Encode,
    DecodeStep,
    TrainStep,
}

/// Which graph of a spec an entry point is cut from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphKind {
    /// Inference: no dropout.
    Eval,
    /// Training: dropout kept.
    Train,
    /// One incremental decoder step: stages and caches are inputs.
    Decode,
}

impl Entry {
    pub const NAMES: [&'static str; 5] = ["forward", "loss", "encode", "decode_step", "train_step"];

    pub fn parse(s: &str) -> Result<Entry, RuntimeError> {
        match s {
            "forward" => Ok(Entry::Forward),
            "loss" => Ok(Entry::Loss),
            "encode" => Ok(Entry::Encode),
            "decode_step" => Ok(Entry::DecodeStep),
            "train_step" => Ok(Entry::TrainStep),
            other => Err(RuntimeError::new(
                format!("unknown entry point `{other}`"),
                format!("entry points are {}", Entry::NAMES.join(", ")),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Entry::Forward => "forward",
            Entry::Loss => "loss",
            Entry::Encode => "encode",
            Entry::DecodeStep => "decode_step",
            Entry::TrainStep => "train_step",
        }
    }

    /// The graph the entry point is cut from.
    pub fn graph_kind(self) -> GraphKind {
        match self {
            Entry::Forward | Entry::Loss | Entry::Encode => GraphKind::Eval,
            Entry::DecodeStep => GraphKind::Decode,
            Entry::TrainStep => GraphKind::Train,
        }
    }
}

/// An error with a fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RuntimeError {
    pub message: String,
    pub help: String,
}

impl RuntimeError {
    pub fn new(message: impl Into<String>, help: impl Into<String>) -> RuntimeError {
        RuntimeError {
            message: message.into(),
            help: help.into(),
        }
    }
}

/// The graph of one entry point, cut from the model graph of `entry.graph_kind()`.
pub fn entry_graph(model: &Graph, entry: Entry) -> Result<Graph, RuntimeError> {
    let outputs = match entry {
        Entry::Encode => {
            if model.stages.is_empty() {
                return Err(RuntimeError::new(
                    format!(
                        "model `{}` declares no `stage`, so it has no `encode` entry",
                        model.name
                    ),
                    "mark where encoding ends in the spec: `stage memory = encoder(...)`",
                ));
            }
            model.stages.clone()
        }
        Entry::DecodeStep => {
            let caches = model.cache_outputs();
            if caches.is_empty() {
                return Err(RuntimeError::new(
                    format!(
                        "model `{}` has no key/value cache, so it has no `decode_step` entry \
                         (was it elaborated in decode mode?)",
                        model.name
                    ),
                    "decode_step needs a causal attention (`attention(..., causal = true)`) in the decoder",
                ));
            }
            let mut outs = model.forward_outputs();
            outs.extend(caches);
            outs
        }
        Entry::TrainStep => {
            return Err(RuntimeError::new(
                "train_step is built by the compiler's autodiff pass, not by pruning",
                "use kiln_compiler::autodiff::train_step on the training graph",
            ))
        }
        Entry::Forward => model.forward_outputs(),
        Entry::Loss => match &model.objective {
            Some(o) => vec![o.clone()],
            None => return Err(RuntimeError::new(
                format!(
                    "model `{}` declares no objective, so it has no `loss` entry",
                    model.name
                ),
                "declare one in the spec: `objective loss = label_smoothed_xent(logits, targets)`",
            )),
        },
    };
    if outputs.is_empty() {
        return Err(RuntimeError::new(
            format!(
                "model `{}` has no outputs besides its objective",
                model.name
            ),
            "use `--entry loss`, or declare an `output` in the spec",
        ));
    }
    model
        .prune(&outputs)
        .map_err(|e| RuntimeError::new(e.to_string(), "this is a bug in kiln; please report it"))
}

/// The entry points the optimizer compiles (`kiln explain`, `kiln compile`): the
/// runtime's, plus `adam_update`, the optimizer step of every parameter.
pub const COMPILED_ENTRIES: [&str; 6] = [
    "forward",
    "loss",
    "encode",
    "decode_step",
    "train_step",
    "adam_update",
];

/// The graph a compiled entry point is cut from (`adam_update` needs only the
/// parameters: the inference graph).
pub fn compiled_graph_kind(name: &str) -> Result<GraphKind, RuntimeError> {
    if name == "adam_update" {
        Ok(GraphKind::Eval)
    } else {
        Ok(Entry::parse(name)?.graph_kind())
    }
}

/// The graph of any compiled entry point of `model` (elaborated as
/// [`compiled_graph_kind`] says): `train_step` through the compiler's autodiff,
/// `adam_update` as Adam with the paper's β1 = 0.9, β2 = 0.98, ε = 1e-9 over every
/// parameter, the others through [`entry_graph`].
pub fn compiled_entry_graph(model: &Graph, name: &str) -> Result<Graph, RuntimeError> {
    let bug = |e: kiln_compiler::IrError| {
        RuntimeError::new(e.to_string(), "this is a bug in kiln; please report it")
    };
    match name {
        "adam_update" => {
            let params: Vec<(String, kiln_compiler::TensorType)> = model
                .params
                .iter()
                .map(|&p| {
                    (
                        model.source_name(p).unwrap_or("").to_string(),
                        model.ty(p).clone(),
                    )
                })
                .collect();
            let mut g =
                kiln_compiler::adam::adam_update_graph(&params, 0.9, 0.98, 1e-9).map_err(bug)?;
            g.name = model.name.clone();
            Ok(g)
        }
        "train_step" if model.objective.is_none() => Err(RuntimeError::new(
            format!(
                "model `{}` declares no objective, so it has no `train_step` entry",
                model.name
            ),
            "declare one in the spec: `objective loss = label_smoothed_xent(logits, targets)`",
        )),
        "train_step" => kiln_compiler::autodiff::train_step(model).map_err(bug),
        "encode" | "decode_step" => Err(RuntimeError::new(
            format!("the `{name}` entry is cut from two graphs (eval and decode)"),
            "this is a bug in kiln: build it with compiled_entry_graph_with or decoder_entries",
        )),
        other => entry_graph(model, Entry::parse(other)?),
    }
}

/// [`compiled_entry_graph`] for any entry point, elaborating the model in each mode the
/// entry needs through `elaborate` (`encode` and `decode_step` need the eval and the
/// decode graphs: see [`decoder_entries`]); `err` turns the runtime's errors into the
/// caller's.
pub fn compiled_entry_graph_with<E>(
    name: &str,
    mut elaborate: impl FnMut(GraphKind) -> Result<Graph, E>,
    err: impl Fn(RuntimeError) -> E,
) -> Result<Graph, E> {
    match name {
        "encode" | "decode_step" => {
            let eval = elaborate(GraphKind::Eval)?;
            let decode = elaborate(GraphKind::Decode)?;
            if name == "decode_step" && eval.stages.is_empty() {
                // Nothing is encoded once per sentence (a language model): the step is
                // the decode graph's, with nothing to hoist.
                return entry_graph(&decode, Entry::DecodeStep).map_err(err);
            }
            let (encode, step) = decoder_entries(&eval, &decode).map_err(err)?;
            Ok(if name == "encode" { encode } else { step })
        }
        _ => {
            let kind = compiled_graph_kind(name).map_err(&err)?;
            let model = elaborate(kind)?;
            compiled_entry_graph(&model, name).map_err(err)
        }
    }
}

/// The decoder's two entry points: `encode` cut from the eval graph and `decode_step`
/// from the decode graph, with every value of the step that depends only on what
/// `encode` provides (its stages and its inputs: the memory, the source) and on
/// parameters computed once per sentence by `encode` instead of at every step
/// ([`kiln_compiler::hoist`]: the cross-attention's keys and values, the source mask).
/// The step takes them as inputs named `static.…`; `encode` returns them beside its
/// stages.
pub fn decoder_entries(eval: &Graph, decode: &Graph) -> Result<(Graph, Graph), RuntimeError> {
    let encode = entry_graph(eval, Entry::Encode)?;
    let step = entry_graph(decode, Entry::DecodeStep)?;
    let per_step = |name: &str| encode.output(name).is_none() && encode.input(name).is_none();
    match kiln_compiler::hoist::hoist_static(&encode, &step, &per_step) {
        Ok(Some(h)) => Ok((h.encode, h.step)),
        Ok(None) => Ok((encode, step)),
        Err(e) => Err(RuntimeError::new(
            format!("cannot hoist the decoder's per-sentence values: {e}"),
            "this is a bug in kiln; please report it",
        )),
    }
}

/// Rejects tensors whose names are not inputs of the model (a typo, or a file meant for
/// another spec). Inputs of the model that this entry does not use are fine.
pub fn check_inputs(model: &Graph, file: &str, inputs: &Feeds) -> Result<(), RuntimeError> {
    let names: Vec<&str> = model
        .inputs
        .iter()
        .filter_map(|&i| model.source_name(i))
        .collect();
    for name in inputs.keys() {
        if !names.contains(&name.as_str()) {
            let near = names
                .iter()
                .min_by_key(|n| strsim::levenshtein(n, name))
                .filter(|n| strsim::levenshtein(n, name) <= 2);
            return Err(RuntimeError::new(
                format!(
                    "`{file}` has a tensor `{name}`, which is not an input of model `{}`",
                    model.name
                ),
                match near {
                    Some(n) => format!("did you mean `{n}`? the inputs are {}", names.join(", ")),
                    None => format!("the inputs are {}", names.join(", ")),
                },
            ));
        }
    }
    Ok(())
}

/// The first index where `finite` is false, and how many are.
fn non_finite(finite: impl Iterator<Item = bool>) -> (Option<usize>, usize) {
    finite
        .enumerate()
        .filter(|(_, ok)| !ok)
        .fold((None, 0), |(first, n), (i, _)| (first.or(Some(i)), n + 1))
}

/// Checks that every float of a weights file is finite: NaN or infinite weights (a
/// damaged file, or a run that diverged) would translate into nothing and average into
/// another broken model.
pub fn check_finite(file: &str, weights: &Feeds) -> Result<(), RuntimeError> {
    check_finite_named(file, weights, &|name| format!("parameter `{name}`"))
}

/// [`check_finite`], each tensor named in the message by `label(name)`.
pub fn check_finite_named(
    file: &str,
    tensors: &Feeds,
    label: &dyn Fn(&str) -> String,
) -> Result<(), RuntimeError> {
    for (name, t) in tensors {
        let (first, count) = match &t.data {
            TensorData::F32(v) => non_finite(v.iter().map(|x| x.is_finite())),
            TensorData::F64(v) => non_finite(v.iter().map(|x| x.is_finite())),
            _ => (None, 0),
        };
        if let Some(first) = first {
            return Err(RuntimeError::new(
                format!(
                    "{} in `{file}` has {count} of its {} values not finite \
                 (NaN or infinite; the first at flat index {first})",
                    label(name),
                    t.numel()
                ),
                "the weights are damaged, or a run diverged before they were saved: use an \
             earlier checkpoint (`kiln inspect RUN_DIR` lists a run's checkpoints)",
            ));
        }
    }
    Ok(())
}

/// Checks a weights file against the model: every tensor must be a parameter of the
/// model with exactly its shape ([`check_weights_fit`]) and finite values
/// ([`check_finite`]).
pub fn check_weights(model: &Graph, file: &str, weights: &Feeds) -> Result<(), RuntimeError> {
    check_weights_fit(model, file, weights)?;
    check_finite(file, weights)
}

/// Checks that a weights file fits the model: every tensor must be a parameter of the
/// model with exactly its shape and a float type; parameters the file lacks are reported
/// all at once.
pub fn check_weights_fit(model: &Graph, file: &str, weights: &Feeds) -> Result<(), RuntimeError> {
    let mut want: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for &p in &model.params {
        if let Op::Param { name, .. } = &model.node(p).op {
            want.insert(name, model.ty(p).shape.as_consts().unwrap_or_default());
        }
    }
    for (name, t) in weights {
        let Some(shape) = want.get(name.as_str()) else {
            return Err(RuntimeError::new(
                format!("`{file}` has a tensor `{name}`, which is not a parameter of model `{}`", model.name),
                "these weights belong to another spec (or other --set values); regenerate them with `kiln init`",
            ));
        };
        if &t.shape != shape {
            return Err(RuntimeError::new(
                format!(
                    "parameter `{name}` in `{file}` has shape {:?}, but model `{}` needs {:?}",
                    t.shape, model.name, shape
                ),
                "the weights were made for other model dimensions; check the --set values",
            ));
        }
        if !matches!(t.dtype_name(), "f32" | "f64") {
            return Err(RuntimeError::new(
                format!(
                    "parameter `{name}` in `{file}` is {}, but parameters are floats",
                    t.dtype_name()
                ),
                "store parameters as F32",
            ));
        }
    }
    let missing: Vec<&str> = want
        .keys()
        .filter(|n| !weights.contains_key(**n))
        .copied()
        .collect();
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(5).copied().collect();
        return Err(RuntimeError::new(
            format!(
                "`{file}` lacks {} of the {} parameters of model `{}`: {}{}",
                missing.len(),
                want.len(),
                model.name,
                shown.join(", "),
                if missing.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            ),
            "make a complete weights file with `kiln init`",
        ));
    }
    Ok(())
}
