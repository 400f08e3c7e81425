//! Compiling a spec into an artifact: what `kiln compile` and the Python package's
//! `kiln.compile` run.
//!
//! In: a spec (with `--set` overrides and a model name), a training configuration's or a
//! trained model's graphs and weights ([`Source`]), and how to build ([`Build`]: the
//! entries, the output directory, validation and the compile options). Out: the artifact
//! directory (`kiln_compiler::artifact`), every entry through the compiler's driver.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_compiler::artifact::TOKENIZER_FILE;
use kiln_compiler::init::init_params;
use kiln_compiler::options::CompileOptions;
use kiln_compiler::pipeline::{compile_entry, PipelineError};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::Graph;
use kiln_dsl::{Error, Mode, Options};
use kiln_exec::GraphKind;
use kiln_train::config::Config;
use kiln_train::model::{self, GraphSet};
use kiln_train::tokenizer::tokenizer_of;
use kiln_train::trainer::ModelGraphs;

fn plain(code: &'static str, message: String, help: Option<String>) -> Error {
    Error::plain(code, message, help)
}

fn err<E: std::fmt::Display>(code: &'static str) -> impl Fn(E) -> Error {
    move |e| plain(code, e.to_string(), None)
}

/// The graph of an entry point of a spec.
pub fn entry_graph_of(
    spec: &Path,
    set: &[String],
    model: &Option<String>,
    entry: &str,
) -> Result<Graph, Error> {
    let run_err = |e: kiln_exec::RuntimeError| plain("kiln::entry", e.message, Some(e.help));
    let elaborate = |kind: GraphKind| -> Result<Graph, Error> {
        let opts = Options {
            overrides: set.to_vec(),
            mode: crate::dsl_mode(kind),
            model: model.clone(),
        };
        kiln_dsl::compile_file(spec, &opts)
    };
    kiln_exec::compiled_entry_graph_with(entry, elaborate, run_err)
}

/// The entry points of [`SPEC_ENTRIES`] that the spec's model has (`--entries` left
/// out): `loss` and `train_step` where it declares an objective, `encode` where it
/// declares a `stage`, `decode_step` where its decode graph has a key/value cache.
pub fn model_entries(
    spec: &Path,
    set: &[String],
    model: &Option<String>,
) -> Result<Vec<String>, Error> {
    let graph = |mode| {
        let opts = kiln_dsl::Options {
            overrides: set.to_vec(),
            mode,
            model: model.clone(),
        };
        kiln_dsl::compile_file(spec, &opts)
    };
    let eval = graph(kiln_dsl::Mode::Eval)?;
    let decode = graph(kiln_dsl::Mode::Decode)?;
    let has = |entry: &str| match entry {
        "loss" | "train_step" => eval.objective.is_some(),
        "encode" => !eval.stages.is_empty(),
        "decode_step" => !decode.cache_outputs().is_empty(),
        _ => true,
    };
    Ok(SPEC_ENTRIES
        .iter()
        .filter(|e| has(e))
        .map(|e| e.to_string())
        .collect())
}

/// The entry points of `--entries`, each once.
pub fn entry_names(entries: &[String]) -> Result<Vec<String>, Error> {
    let mut names: Vec<String> = Vec::new();
    for e in entries {
        if names.contains(e) {
            return Err(plain(
                "kiln::compile",
                format!("entry `{e}` is given twice in `--entries`"),
                Some("list each entry once".to_string()),
            ));
        }
        names.push(e.clone());
    }
    Ok(names)
}

/// What an artifact is compiled from, whatever the source (spec, training configuration
/// or trained model).
pub struct Source {
    /// Entry points and their graphs, in `--entries` order.
    pub graphs: Vec<(String, Graph)>,
    /// The weights to ship; `None`: initialized from `seed` per entry graph.
    pub weights: Option<BTreeMap<String, Tensor>>,
    pub seed: u64,
    pub spec_hash: String,
    pub extras: BTreeMap<String, Vec<u8>>,
}

/// How `kiln compile` writes an artifact: the entries asked for (none: the source's
/// default ones), the directory (`-o`), whether each entry's program is checked against
/// the reference executor first (`--validate`), and the compile options.
pub struct Build<'a> {
    pub entries: &'a [String],
    pub output: Option<&'a Path>,
    pub check: bool,
    pub options: &'a CompileOptions,
}

/// `kiln compile SPEC --entries …`: a compiled artifact directory (see
/// `kiln_compiler::artifact`): per entry the kernel graph, memory plan and CLIF code,
/// plus the initial weights from `seed`.
pub fn compile_artifact(
    (spec, set, model): (&Path, &[String], &Option<String>),
    seed: u64,
    build: &Build<'_>,
) -> Result<(), Error> {
    let dir = output_dir(build.output)?;
    let names = entry_names(build.entries)?;
    let spec_text = kiln_dsl::source_text(spec)?;
    let spec_hash = kiln_compiler::artifact::spec_hash(&spec_text, set, model.as_deref());
    let mut graphs = Vec::new();
    for name in &names {
        graphs.push((name.clone(), entry_graph_of(spec, set, model, name)?));
    }
    let src = Source {
        graphs,
        weights: None,
        seed,
        spec_hash,
        extras: BTreeMap::new(),
    };
    write_artifact_from(dir, src, build)
}

/// The entries `kiln compile SPEC -o DIR` compiles without `--entries`: every one that
/// `kiln run`, `kiln bench`, `kiln train --artifact` and `kiln translate` use.
pub const SPEC_ENTRIES: [&str; 5] = ["forward", "train_step", "loss", "encode", "decode_step"];
/// The entries a trainer needs, which `--config` compiles by default.
pub const TRAINING_ENTRIES: [&str; 4] = ["train_step", "loss", "encode", "decode_step"];
/// The entries a decoder needs, which `--from-model` compiles by default.
pub const DECODING_ENTRIES: [&str; 2] = ["encode", "decode_step"];

pub fn output_dir(output: Option<&Path>) -> Result<&Path, Error> {
    output.ok_or_else(|| {
        plain(
            "kiln::compile",
            "an artifact is a directory, and no `-o DIR` was given".to_string(),
            Some("add `-o DIR`, e.g. `-o build/model.kiln-artifact`".to_string()),
        )
    })
}

/// Optimizes, plans and generates code for every entry of `src`, and writes the artifact.
pub fn write_artifact_from(dir: &Path, src: Source, build: &Build<'_>) -> Result<(), Error> {
    let (options, check) = (build.options, build.check);
    let mut specs = Vec::new();
    let mut weights = BTreeMap::new();
    let mut model = String::new();
    let mut hparams = Vec::new();
    let training = ["train_step", "adam_update"];
    if let Some((name, _)) = src
        .graphs
        .iter()
        .find(|(n, _)| training.contains(&n.as_str()))
    {
        if options.precision == kiln_compiler::options::Precision::Int8 {
            return Err(plain(
                "kiln::compile",
                format!(
                    "--precision int8 rounds the weights' products to 8 bits, which inference \
                     takes and training does not, but entry `{name}` trains"
                ),
                Some(
                    "compile the decoding entries (`--from-model RUN`, or `--entries \
                     encode,decode_step`) in int8, and train in f32"
                        .to_string(),
                ),
            ));
        }
    }
    for (name, g) in src.graphs {
        let p = compile_entry(&g, options, check.then_some(src.seed)).map_err(|e| {
            let (code, help) = match &e {
                PipelineError::Options(_) => ("kiln::compile", None),
                PipelineError::Optimize(_) => ("kiln::optimizer", None),
                PipelineError::Validate(_) => ("kiln::validate", None),
                PipelineError::Cpu(_) | PipelineError::Cuda(_) => (
                    "kiln::codegen",
                    Some(
                        "this is a code generator bug; please report it with the spec".to_string(),
                    ),
                ),
            };
            plain(code, format!("entry `{name}`: {e}"), help)
        })?;
        if let Some(v) = &p.validation {
            eprint!("{}", v.text());
            if !v.ok() {
                return Err(plain(
                    "kiln::validate",
                    format!("the optimized `{name}` does not match the source graph"),
                    Some("this is an optimizer bug; please report it with the spec".to_string()),
                ));
            }
        }
        let cuda = p.cuda.map(|code| kiln_compiler::artifact::CudaEntrySpec {
            code,
            arch: options.cuda_arch.clone().unwrap_or_default(),
        });
        match &src.weights {
            Some(all) => {
                // Only the parameters some entry reads.
                for p in &g.params {
                    if let kiln_compiler::ir::Op::Param { name: pname, .. } = &g.node(*p).op {
                        let t = all.get(pname).ok_or_else(|| {
                            plain(
                                "kiln::compile",
                                format!("entry `{name}` reads parameter `{pname}`, which the weights lack"),
                                Some("the weights and graphs come from different models".to_string()),
                            )
                        })?;
                        weights.insert(pname.clone(), t.clone());
                    }
                }
            }
            None => {
                for (p, t) in init_params(&g, src.seed)
                    .map_err(|e| plain("kiln::init", e.to_string(), None))?
                {
                    weights.insert(p, t);
                }
            }
        }
        if model.is_empty() {
            model = g.name.clone();
            hparams = g.hparams.clone();
        }
        specs.push(kiln_compiler::artifact::EntrySpec {
            name,
            graph: g,
            kernel_graph: p.kernel_graph,
            plan: p.plan,
            code: p.cpu,
            launch: p.launch,
            cuda,
        });
    }
    let art = kiln_compiler::artifact::ArtifactSpec {
        model,
        spec_hash: src.spec_hash,
        seed: src.seed,
        hparams,
        options: options.clone(),
        entries: specs,
        weights,
        extras: src.extras,
    };
    kiln_compiler::artifact::write_artifact(dir, &art).map_err(|e| {
        let help = matches!(e, kiln_compiler::artifact::ArtifactError::Io(_))
            .then(|| "check that the output directory is writable".to_string());
        plain("kiln::artifact", e.to_string(), help)
    })?;
    let kernels: usize = art
        .entries
        .iter()
        .map(|e| e.kernel_graph.kernels().len())
        .sum();
    eprintln!(
        "wrote {} ({} entries, {} kernels, {} parameter tensors{})",
        dir.display(),
        art.entries.len(),
        kernels,
        art.weights.len(),
        if art.extras.contains_key(TOKENIZER_FILE) {
            ", tokenizer"
        } else {
            ""
        }
    );
    Ok(())
}

/// Compiles the spec of a configuration in the three modes the trainer needs.
pub fn compile_graphs(cfg: &Config, vocab: usize) -> Result<ModelGraphs, Error> {
    let mut overrides = cfg.overrides();
    overrides.retain(|o| !o.starts_with("vocab="));
    overrides.push(format!("vocab={vocab}"));
    let compile = |mode| {
        kiln_dsl::compile_file(
            &cfg.model.spec,
            &Options {
                overrides: overrides.clone(),
                mode,
                model: cfg.model.name.clone(),
            },
        )
    };
    Ok(ModelGraphs {
        train: compile(Mode::Train)?,
        eval: compile(Mode::Eval)?,
        decode: compile(Mode::Decode)?,
    })
}

/// The graph of `name` in a trainer's graph set.
fn from_set(set: &GraphSet, name: &str, origin: &str) -> Result<Graph, Error> {
    Ok(match name {
        "train_step" => set.train_step.clone(),
        "loss" => set.loss.clone(),
        "encode" => set.encode.clone(),
        "decode_step" => set.decode_step.clone(),
        other => {
            return Err(plain(
                "kiln::compile",
                format!("{origin} has no entry `{other}`"),
                Some(format!(
                    "its entries are {}; compile `{other}` from the spec instead",
                    TRAINING_ENTRIES.join(", ")
                )),
            ))
        }
    })
}

/// The graphs of `--entries` (or of `default` without it) from a trainer's graph set.
fn graphs_of(
    set: &GraphSet,
    entries: &[String],
    default: &[&str],
    origin: &str,
) -> Result<Vec<(String, Graph)>, Error> {
    let names = if entries.is_empty() {
        default.iter().map(|s| s.to_string()).collect()
    } else {
        entry_names(entries)?
    };
    names
        .into_iter()
        .map(|n| from_set(set, &n, origin).map(|g| (n, g)))
        .collect()
}

/// `kiln compile --config CONFIG.yaml -o DIR`: what `kiln train --config` would train —
/// the spec with the configuration's overrides and its BPE vocabulary's size, the first
/// weights from `train.seed`, and the tokenizer — as an artifact that `kiln train
/// --artifact DIR` (or `model.artifact`) starts from.
pub fn compile_artifact_from_config(config: &Path, build: &Build<'_>) -> Result<(), Error> {
    let dir = output_dir(build.output)?;
    let cfg = Config::load(config).map_err(|e| plain("kiln::config", e.to_string(), None))?;
    if cfg.model.spec.as_os_str().is_empty() {
        return Err(plain(
            "kiln::compile",
            format!("`{}` names no `model.spec` to compile", config.display()),
            Some("add `model: {spec: path/to/model.kiln}`".to_string()),
        ));
    }
    let (tok, note, _) = tokenizer_of(&cfg).map_err(err("kiln::train"))?;
    eprintln!("{note}");
    let model_graphs = compile_graphs(&cfg, tok.vocab_size())?;
    let set = model_graphs
        .entries_with(cfg.train.loss_scale.is_some())
        .map_err(err("kiln::compile"))?;
    let origin = format!("the configuration `{}`", config.display());
    let graphs = graphs_of(&set, build.entries, &TRAINING_ENTRIES, &origin)?;
    let weights: BTreeMap<String, Tensor> = init_params(&set.loss, cfg.train.seed)
        .map_err(|e| plain("kiln::init", e.to_string(), None))?
        .into_iter()
        .collect();
    let mut overrides = cfg.overrides();
    overrides.retain(|o| !o.starts_with("vocab="));
    overrides.push(format!("vocab={}", tok.vocab_size()));
    let spec_text = kiln_dsl::source_text(&cfg.model.spec)?;
    let spec_hash =
        kiln_compiler::artifact::spec_hash(&spec_text, &overrides, cfg.model.name.as_deref());
    let tok_json = tok.to_json().map_err(err("kiln::compile"))?;
    let src = Source {
        graphs,
        weights: Some(weights),
        seed: cfg.train.seed,
        spec_hash,
        extras: [(TOKENIZER_FILE.to_string(), tok_json.into_bytes())].into(),
    };
    write_artifact_from(dir, src, build)
}

/// `kiln compile --from-model MODEL_DIR -o DIR`: a trained model (a checkpoint, a run
/// directory or the output of `kiln average`) with its weights and tokenizer, compiled for
/// `kiln translate --model DIR` (by default the decoding entries).
pub fn compile_artifact_from_model(model_dir: &Path, build: &Build<'_>) -> Result<(), Error> {
    let dir = output_dir(build.output)?;
    if model_dir
        .join(kiln_compiler::artifact::MANIFEST_FILE)
        .is_file()
    {
        return Err(plain(
            "kiln::model",
            format!(
                "`{}` is a compiled artifact, not a model: it is compiled already",
                model_dir.display()
            ),
            Some(format!(
                "`kiln translate --model {}` runs it; `--from-model` takes a checkpoint, a run \
                 directory or the output of `kiln average`",
                model_dir.display()
            )),
        ));
    }
    let m = model::load(model_dir).map_err(err("kiln::model"))?;
    let origin = format!("the model `{}`", m.dir.display());
    let graphs = graphs_of(&m.graphs, build.entries, &DECODING_ENTRIES, &origin)?;
    let tok_json = m.tokenizer.to_json().map_err(err("kiln::compile"))?;
    let src = Source {
        graphs,
        weights: Some(m.params),
        seed: 0,
        spec_hash: format!(
            "model:{}",
            kiln_compiler::artifact::hash_hex(&m.graphs.to_json())
        ),
        extras: [(TOKENIZER_FILE.to_string(), tok_json.into_bytes())].into(),
    };
    write_artifact_from(dir, src, build)
}
