//! `kiln compile`: one entry point's kernel graph as text, or an artifact of a spec, a
//! training configuration or a trained model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::artifact::TOKENIZER_FILE;
use kiln_compiler::init::init_params;
use kiln_compiler::optimize::validate::{validate, DEFAULT_ABS, DEFAULT_REL};
use kiln_compiler::optimize::{optimize, KernelGraph, Options as OptOptions, Report, Target};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::Graph;
use kiln_dsl::Error;
use kiln_train::config::Config;
use kiln_train::model::{self, GraphSet};
use kiln_train::tokenizer::tokenizer_of;

use crate::cmd::explain::OptArgs;
use crate::outputs::{self, Output};
use crate::plain;
use kiln::build::{
    compile_artifact, entry_graph_of, entry_names, output_dir, write_artifact_from, Build, Source,
    DECODING_ENTRIES, TRAINING_ENTRIES,
};

// `kiln compile`'s arguments (their help is `kiln compile --help`).
#[derive(clap::Args)]
pub struct CompileArgs {
    /// The model spec (a `.kiln` file); not with `--config` or `--from-model`.
    #[arg(required_unless_present_any = ["config", "from_model"])]
    pub spec: Option<PathBuf>,
    /// Override a model parameter: `--set d_model=256` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Which model of the file, when it defines several.
    #[arg(long)]
    pub model: Option<String>,
    /// Compile this one entry point into its kernel graph (text, to `-o FILE` or
    /// standard output; `forward` when neither `--entry` nor `-o` is given): forward,
    /// loss, encode, decode_step, train_step, or adam_update.
    #[arg(long, value_parser = kiln_exec::COMPILED_ENTRIES, conflicts_with = "entries")]
    pub entry: Option<String>,
    #[command(flatten)]
    pub flags: crate::compile_flags::CompileFlags,
    /// Compile the spec of this training configuration, at its BPE vocabulary's size,
    /// with its first weights (`train.seed`) and its tokenizer, into the artifact
    /// `kiln train --artifact DIR` starts from (entries: train_step, loss, encode,
    /// decode_step).
    #[arg(long, conflicts_with_all = ["spec", "from_model", "set", "model"])]
    pub config: Option<PathBuf>,
    /// Compile a trained model (checkpoint, run directory or `kiln average` output)
    /// with its weights and tokenizer, for `kiln translate --model DIR` (entries:
    /// encode, decode_step).
    #[arg(long = "from-model", conflicts_with_all = ["spec", "set", "model"])]
    pub from_model: Option<PathBuf>,
    /// The entry points of the artifact directory (`-o DIR`), e.g.
    /// `--entries train_step,encode,decode_step` (default: those of forward, loss,
    /// encode, decode_step and train_step that the model has).
    #[arg(long, value_delimiter = ',', value_parser = kiln_exec::COMPILED_ENTRIES)]
    pub entries: Vec<String>,
    /// The artifact directory to write, or with `--entry` the kernel graph's file
    /// (default: the kernel graph on standard output).
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
    /// Run the program and the unoptimized graph on random inputs (reference
    /// executor) and fail unless they agree.
    #[arg(long)]
    pub validate: bool,
    /// Seed of the validation's inputs and weights (and an artifact's weights).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `kiln compile`: an artifact (`-o DIR`, `--entries`, `--config`, `--from-model`) or one
/// entry point's kernel graph as text.
pub fn compile(a: CompileArgs) -> Result<(), Error> {
    let CompileArgs {
        spec,
        set,
        model,
        entry,
        flags,
        config,
        from_model,
        entries,
        output,
        validate,
        seed,
    } = a;
    if let Some(out) = &output {
        let inputs: Vec<&std::path::Path> = [&spec, &config, &from_model]
            .into_iter()
            .flatten()
            .map(|p| p.as_path())
            .collect();
        let text = entry.is_some() && entries.is_empty() && config.is_none();
        let kind = if text && from_model.is_none() {
            Output::File
        } else {
            Output::Artifact
        };
        outputs::check("kiln::compile", out, &inputs, kind)?;
    }
    // An artifact, written from `source` with the options of the flags.
    let write = |source: &dyn Fn(&Build<'_>) -> Result<(), Error>, entries: &[String]| {
        let options = flags.options()?;
        source(&Build {
            entries,
            output: output.as_deref(),
            check: validate,
            options: &options,
        })
    };
    // A training configuration or a trained model, instead of a spec.
    type FromFile = fn(&Path, &Build<'_>) -> Result<(), Error>;
    let from: [(Option<PathBuf>, FromFile); 2] = [
        (config, compile_artifact_from_config),
        (from_model, compile_artifact_from_model),
    ];
    if let Some((path, compile)) = from.into_iter().find_map(|(p, f)| p.map(|p| (p, f))) {
        return write(&|build| compile(&path, build), &entries);
    }
    let Some(spec) = spec else {
        return Err(plain(
            "kiln::compile",
            "nothing to compile".to_string(),
            Some("give a spec, `--config CONFIG.yaml` or `--from-model DIR`".to_string()),
        ));
    };
    // `-o DIR` alone writes an artifact, as a compiler's `-o` writes its program;
    // `--entry` asks for one kernel graph's text.
    let artifact = !entries.is_empty() || (output.is_some() && entry.is_none());
    let args = OptArgs {
        spec,
        set,
        model,
        entry: entry.unwrap_or_else(|| "forward".to_string()),
        target: flags.target.clone(),
    };
    if !artifact {
        kernel_graph(&args, output.as_deref(), validate, seed)
    } else {
        let entries = if entries.is_empty() {
            kiln::build::model_entries(&args.spec, &args.set, &args.model)?
        } else {
            entries
        };
        write(
            &|build| compile_artifact((&args.spec, &args.set, &args.model), seed, build),
            &entries,
        )
    }
}

fn run_optimizer(args: &OptArgs) -> Result<(Graph, KernelGraph, Report), Error> {
    let g = entry_graph_of(&args.spec, &args.set, &args.model, &args.entry)?;
    let opts = OptOptions {
        target: Target::parse(&args.target).unwrap_or(Target::Cpu),
        ..OptOptions::default()
    };
    let (kg, report) =
        optimize(&g, &opts).map_err(|e| plain("kiln::optimizer", e.to_string(), None))?;
    Ok((g, kg, report))
}

/// `kiln compile --entry`: the kernel graph to a file (or stdout), optionally validated.
pub fn kernel_graph(
    args: &OptArgs,
    output: Option<&Path>,
    check: bool,
    seed: u64,
) -> Result<(), Error> {
    let (g, kg, report) = run_optimizer(args)?;
    if check {
        let v = validate(&g, &kg, seed, DEFAULT_REL, DEFAULT_ABS)
            .map_err(|e| plain("kiln::validate", e, None))?;
        eprint!("{}", v.text());
        if !v.ok() {
            return Err(plain(
                "kiln::validate",
                "the optimized program does not match the source graph".to_string(),
                Some("this is an optimizer bug; please report it with the spec".to_string()),
            ));
        }
    }
    let text = kg.text();
    match output {
        Some(path) => {
            kiln_compiler::fsync::write_replacing(path, text.as_bytes()).map_err(
                |(action, e)| {
                    plain(
                        "kiln::file",
                        format!("cannot {action} `{}`: {e}", path.display()),
                        None,
                    )
                },
            )?;
            let total: usize = report.kernels_after.values().sum();
            eprintln!("wrote {} ({} kernels)", path.display(), total);
        }
        None => out!("{text}"),
    }
    Ok(())
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
    let (tok, note, _) = tokenizer_of(&cfg).map_err(crate::err("kiln::train"))?;
    eprintln!("{note}");
    let model_graphs = crate::cmd::train::compile_graphs(&cfg, tok.vocab_size())?;
    let set = model_graphs
        .entries_with(cfg.train.loss_scale.is_some())
        .map_err(crate::err("kiln::compile"))?;
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
    let tok_json = tok.to_json().map_err(crate::err("kiln::compile"))?;
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
    let m = model::load(model_dir).map_err(crate::err("kiln::model"))?;
    let origin = format!("the model `{}`", m.dir.display());
    let graphs = graphs_of(&m.graphs, build.entries, &DECODING_ENTRIES, &origin)?;
    let tok_json = m.tokenizer.to_json().map_err(crate::err("kiln::compile"))?;
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
