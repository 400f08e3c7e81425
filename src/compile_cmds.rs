//! `kiln explain` and `kiln compile`: the optimizer from the command line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::artifact::TOKENIZER_FILE;
use kiln_compiler::init::init_params;
use kiln_compiler::tensor::Tensor;
use kiln_runtime::config::Config;
use kiln_runtime::model::{self, GraphSet};
use kiln_runtime::train::tokenizer_of;

use kiln_compiler::optimize::validate::{validate, DEFAULT_ABS, DEFAULT_REL};
use kiln_compiler::optimize::{optimize, KernelGraph, Options as OptOptions, Report, Target};
use kiln_compiler::options::CompileOptions;
use kiln_compiler::pipeline::{compile_entry, PipelineError};
use kiln_compiler::Graph;
use kiln_dsl::{Error, Options};
use kiln_runtime::{GraphKind, COMPILED_ENTRIES};

use crate::plain;

/// Which spec, overrides and entry point.
#[derive(clap::Args, Clone)]
pub struct OptArgs {
    /// The model spec (a `.kiln` file).
    pub spec: PathBuf,
    /// Override a model parameter: `--set d_model=256` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Which model of the file, when it defines several.
    #[arg(long)]
    pub model: Option<String>,
    /// The entry point: forward, loss, encode, decode_step, train_step, or adam_update
    /// (the optimizer step of every parameter: Adam with β = 0.9, 0.98, ε = 1e-9).
    #[arg(long, default_value = "forward", value_parser = COMPILED_ENTRIES)]
    pub entry: String,
    /// The target whose cost model drives extraction.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub target: String,
}

/// The graph of an entry point of a spec.
pub fn entry_graph_of(
    spec: &Path,
    set: &[String],
    model: &Option<String>,
    entry: &str,
) -> Result<Graph, Error> {
    let run_err = |e: kiln_runtime::RuntimeError| plain("kiln::entry", e.message, Some(e.help));
    let elaborate = |kind: GraphKind| -> Result<Graph, Error> {
        let opts = Options {
            overrides: set.to_vec(),
            mode: kiln::dsl_mode(kind),
            model: model.clone(),
        };
        kiln_dsl::compile_file(spec, &opts)
    };
    kiln_runtime::compiled_entry_graph_with(entry, elaborate, run_err)
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

/// `kiln explain`: what the optimizer did and the fusions of the launch plan, through the
/// compiler's driver with the default options but the target and `fusions`.
pub fn explain(
    args: &OptArgs,
    kernels: bool,
    fusions: &crate::compile_flags::FusionFlags,
) -> Result<(), Error> {
    let g = entry_graph_of(&args.spec, &args.set, &args.model, &args.entry)?;
    let target = Target::parse(&args.target).unwrap_or(Target::Cpu);
    let opts = fusions.apply(CompileOptions {
        target,
        cuda_arch: (target == Target::Cuda)
            .then(|| kiln_compiler::codegen::cuda::DEFAULT_ARCH.to_string()),
        ..CompileOptions::default()
    });
    let p = compile_entry(&g, &opts, None)
        .map_err(|e| plain("kiln::optimizer", e.to_string(), None))?;
    outln!(
        "explain {} entry={} target={}",
        args.spec.display(),
        args.entry,
        args.target
    );
    out!("{}", p.report.text(true));
    out!("{}", p.launch.fusions_text(kernels));
    if kernels {
        out!("{}", p.kernel_graph.text());
    }
    Ok(())
}

/// `kiln compile`: the kernel graph to a file (or stdout), optionally validated.
pub fn compile(args: &OptArgs, output: Option<&Path>, check: bool, seed: u64) -> Result<(), Error> {
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

/// The entry points of `--entries`, each once.
fn entry_names(entries: &[String]) -> Result<Vec<String>, Error> {
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
struct Source {
    /// Entry points and their graphs, in `--entries` order.
    graphs: Vec<(String, Graph)>,
    /// The weights to ship; `None`: initialized from `seed` per entry graph.
    weights: Option<BTreeMap<String, Tensor>>,
    seed: u64,
    spec_hash: String,
    extras: BTreeMap<String, Vec<u8>>,
}

/// `kiln compile SPEC --entries …`: a compiled artifact directory (see
/// `kiln_compiler::artifact`): per entry the kernel graph, memory plan and CLIF code,
/// plus the initial weights from `seed`.
pub fn compile_artifact(
    args: &OptArgs,
    entries: &[String],
    output: Option<&Path>,
    check: bool,
    seed: u64,
    options: &CompileOptions,
) -> Result<(), Error> {
    let dir = output_dir(output)?;
    let names = entry_names(entries)?;
    let spec_text = kiln_dsl::source_text(&args.spec)?;
    let spec_hash =
        kiln_compiler::artifact::spec_hash(&spec_text, &args.set, args.model.as_deref());
    let mut graphs = Vec::new();
    for name in &names {
        graphs.push((
            name.clone(),
            entry_graph_of(&args.spec, &args.set, &args.model, name)?,
        ));
    }
    let src = Source {
        graphs,
        weights: None,
        seed,
        spec_hash,
        extras: BTreeMap::new(),
    };
    write_artifact_from(dir, options, src, check)
}

/// The entries `kiln compile SPEC -o DIR` compiles without `--entries`: every one that
/// `kiln run`, `kiln bench`, `kiln train --artifact` and `kiln translate` use.
pub const SPEC_ENTRIES: [&str; 5] = ["forward", "train_step", "loss", "encode", "decode_step"];
/// The entries a trainer needs, which `--config` compiles by default.
pub const TRAINING_ENTRIES: [&str; 4] = ["train_step", "loss", "encode", "decode_step"];
/// The entries a decoder needs, which `--from-model` compiles by default.
pub const DECODING_ENTRIES: [&str; 2] = ["encode", "decode_step"];

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
pub fn compile_artifact_from_config(
    config: &Path,
    entries: &[String],
    output: Option<&Path>,
    check: bool,
    options: &CompileOptions,
) -> Result<(), Error> {
    let dir = output_dir(output)?;
    let cfg = Config::load(config).map_err(|e| plain("kiln::config", e.to_string(), None))?;
    if cfg.model.spec.as_os_str().is_empty() {
        return Err(plain(
            "kiln::compile",
            format!("`{}` names no `model.spec` to compile", config.display()),
            Some("add `model: {spec: path/to/model.kiln}`".to_string()),
        ));
    }
    let (tok, note, _) = tokenizer_of(&cfg).map_err(crate::train_cmds::err("kiln::train"))?;
    eprintln!("{note}");
    let model_graphs = crate::train_cmds::compile_graphs(&cfg, tok.vocab_size())?;
    let set = model_graphs
        .entries_with(cfg.train.loss_scale.is_some())
        .map_err(crate::train_cmds::err("kiln::compile"))?;
    let origin = format!("the configuration `{}`", config.display());
    let graphs = graphs_of(&set, entries, &TRAINING_ENTRIES, &origin)?;
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
    let tok_json = tok
        .to_json()
        .map_err(crate::train_cmds::err("kiln::compile"))?;
    let src = Source {
        graphs,
        weights: Some(weights),
        seed: cfg.train.seed,
        spec_hash,
        extras: [(TOKENIZER_FILE.to_string(), tok_json.into_bytes())].into(),
    };
    write_artifact_from(dir, options, src, check)
}

/// `kiln compile --from-model MODEL_DIR -o DIR`: a trained model (a checkpoint, a run
/// directory or the output of `kiln average`) with its weights and tokenizer, compiled for
/// `kiln translate --model DIR` (by default the decoding entries).
pub fn compile_artifact_from_model(
    model_dir: &Path,
    entries: &[String],
    output: Option<&Path>,
    check: bool,
    options: &CompileOptions,
) -> Result<(), Error> {
    let dir = output_dir(output)?;
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
    let m = model::load(model_dir).map_err(crate::train_cmds::err("kiln::model"))?;
    let origin = format!("the model `{}`", m.dir.display());
    let graphs = graphs_of(&m.graphs, entries, &DECODING_ENTRIES, &origin)?;
    let tok_json = m
        .tokenizer
        .to_json()
        .map_err(crate::train_cmds::err("kiln::compile"))?;
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
    write_artifact_from(dir, options, src, check)
}

fn output_dir(output: Option<&Path>) -> Result<&Path, Error> {
    output.ok_or_else(|| {
        plain(
            "kiln::compile",
            "an artifact is a directory, and no `-o DIR` was given".to_string(),
            Some("add `-o DIR`, e.g. `-o build/model.kiln-artifact`".to_string()),
        )
    })
}

/// Optimizes, plans and generates code for every entry of `src`, and writes the artifact.
fn write_artifact_from(
    dir: &Path,
    options: &CompileOptions,
    src: Source,
    check: bool,
) -> Result<(), Error> {
    let mut specs = Vec::new();
    let mut weights = BTreeMap::new();
    let mut model = String::new();
    let mut hparams = Vec::new();
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
        let help = matches!(e, kiln_compiler::artifact::ArtifactError::Io { .. })
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

/// `kiln run ARTIFACT_DIR --entry …`: an entry of a compiled artifact on the inputs of a
/// safetensors file, with the artifact's weights (or `--weights`).
pub fn run_artifact(
    dir: &Path,
    entry: &str,
    inputs: &Path,
    weights: Option<&Path>,
    opts: &kiln_compiler::reference::RunOptions,
    executor: &str,
    output: &Path,
) -> Result<(), Error> {
    use kiln_runtime::artifact::Artifact;
    use kiln_runtime::exec::ExecutorKind;
    let art = Artifact::load(dir).map_err(|e| plain("kiln::artifact", e.to_string(), None))?;
    if art.manifest.target() == Target::Cuda && executor == "compiled" {
        let why = match kiln_runtime::cuda::cuda_available() {
            Ok(_) => "kiln has no CUDA executor yet (#6)".to_string(),
            Err(reason) => reason,
        };
        eprintln!("note: a `cuda` artifact, run with its CPU code ({why})");
    }
    let e = art
        .entry(entry)
        .map_err(|e| plain("kiln::artifact", e.to_string(), None))?;
    let g = e.manifest.graph.clone();
    let mut feeds = kiln_compiler::tensor::load_safetensors(inputs).map_err(crate::file_error)?;
    // Inputs of the artifact's other entries (`tgt_out` in a file made for `loss`) are
    // not an error, as with a spec; anything else is named by the entry's check.
    let input_names = |g: &kiln_compiler::Graph| -> Vec<String> {
        g.inputs
            .iter()
            .filter_map(|&i| g.source_name(i).map(str::to_string))
            .collect()
    };
    let others: Vec<String> = art
        .entries()
        .iter()
        .flat_map(|e| input_names(&e.manifest.graph))
        .collect();
    let mine_in = input_names(&g);
    feeds.retain(|k, _| mine_in.contains(k) || !others.contains(k));
    kiln_runtime::check_inputs(&g, &inputs.display().to_string(), &feeds)
        .map_err(crate::runtime_error)?;
    // The parameters of this entry; others (of other entries) are not an error.
    let mine: std::collections::BTreeSet<String> = g
        .params
        .iter()
        .filter_map(|&p| match &g.node(p).op {
            kiln_compiler::ir::Op::Param { name, .. } => Some(name.clone()),
            _ => None,
        })
        .collect();
    let (origin, all) = match weights {
        Some(path) => (
            path.display().to_string(),
            kiln_compiler::tensor::load_safetensors(path).map_err(crate::file_error)?,
        ),
        None => (
            dir.join(kiln_compiler::artifact::WEIGHTS_FILE)
                .display()
                .to_string(),
            art.weights()
                .map_err(|e| plain("kiln::artifact", e.to_string(), None))?,
        ),
    };
    let params: BTreeMap<String, Tensor> =
        all.into_iter().filter(|(k, _)| mine.contains(k)).collect();
    kiln_runtime::check_weights(&g, &origin, &params).map_err(crate::runtime_error)?;
    let kind = ExecutorKind::parse(executor).unwrap_or(ExecutorKind::Compiled);
    let exec: Box<dyn kiln_runtime::exec::Exec> = if executor == "cuda" {
        kiln_runtime::cuda::executor_for(&art, entry).map_err(|e| {
            plain(
                "kiln::cuda",
                e,
                Some("`--executor compiled` runs the artifact's CPU code".to_string()),
            )
        })?
    } else if kind == ExecutorKind::Compiled {
        Box::new(
            art.executor(entry)
                .map_err(|e| plain("kiln::artifact", e.to_string(), None))?,
        )
    } else {
        kiln_runtime::exec::executor(kind, g.clone())
            .map_err(|e| plain("kiln::run", e.to_string(), None))?
    };
    let outs = exec
        .run(&feeds, &params, opts)
        .map_err(|e| plain("kiln::run", e.to_string(), None))?;
    crate::write_outputs(art.model(), &outs, output)
}

/// `kiln inspect`: what an artifact holds.
pub fn inspect(
    dir: &Path,
    dims: &[(&str, i64)],
    plan_text: bool,
    nvrtc: bool,
) -> Result<(), Error> {
    use kiln_runtime::artifact::{is_artifact_dir, Artifact};
    if !is_artifact_dir(dir) && model::resolve(dir).is_ok() {
        if plan_text || nvrtc {
            return Err(plain(
                "kiln::inspect",
                format!(
                    "`{}` is a model directory: it has graphs and weights, but no memory \
                     plans or generated code for --plan or --nvrtc",
                    dir.display()
                ),
                Some(format!(
                    "compile it first: `kiln compile --from-model {} -o DIR`, then inspect DIR",
                    dir.display()
                )),
            ));
        }
        return inspect_model(dir);
    }
    let art = Artifact::load(dir).map_err(|e| {
        let help = (!is_artifact_dir(dir)).then(|| {
            "`kiln inspect` also reads model directories: a checkpoint (`<run>/checkpoints/\
             step_N`), a run directory or the output of `kiln average`"
                .to_string()
        });
        plain("kiln::artifact", e.to_string(), help)
    })?;
    let m = &art.manifest;
    let nvrtc_version = if nvrtc {
        if m.target() != Target::Cuda {
            return Err(plain(
                "kiln::inspect",
                format!(
                    "`{}` is a `{}` artifact: it has no CUDA C for NVRTC",
                    dir.display(),
                    m.target().name()
                ),
                Some("compile one with `kiln compile … --target cuda -o DIR`".to_string()),
            ));
        }
        Some(kiln_runtime::cuda::nvrtc_available().map_err(|e| {
            plain(
                "kiln::inspect",
                e,
                Some(
                    "NVRTC needs no GPU: `pip install nvidia-cuda-nvrtc`, then run with \
                     `LD_LIBRARY_PATH=<site-packages>/nvidia/cu13/lib`"
                        .to_string(),
                ),
            )
        })?)
    } else {
        None
    };
    let weights = art
        .weights()
        .map_err(|e| plain("kiln::artifact", e.to_string(), None))?;
    let params: usize = weights.values().map(|t| t.numel()).sum();
    let tensor_bytes: usize = weights
        .values()
        .map(|t| t.numel() * elem_bytes(t.dtype_name()))
        .sum();
    let mut out = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(out, "artifact {}", dir.display());
    let _ = writeln!(out, "  format: {} v{}", m.format, m.version);
    let _ = writeln!(out, "  written by: {}", m.kiln);
    let _ = writeln!(out, "  model: {}", m.model);
    let _ = writeln!(out, "  spec hash: {}", m.spec_hash);
    let _ = writeln!(out, "  options:");
    for (o, v) in m.options.values() {
        let _ = writeln!(out, "    {}: {v}", o.name);
    }
    let _ = writeln!(
        out,
        "  host: {}",
        kiln_compiler::codegen::jit::host_description()
    );
    let _ = writeln!(
        out,
        "  16-bit products (--gemm-type 16bit): {}",
        match kiln_runtime::compiled::Bf16Kernel::best() {
            Ok(kernel) => kernel.name().to_string(),
            Err(why) => format!("none here ({why})"),
        }
    );
    let _ = writeln!(
        out,
        "  weights: {} tensors, {} parameters, {} bytes (file {} bytes, seed {})",
        weights.len(),
        params,
        tensor_bytes,
        art.weights_file_bytes(),
        m.seed
    );
    if let Some(t) = art.tokenizer_json() {
        let _ = writeln!(out, "  tokenizer: {TOKENIZER_FILE} ({} bytes)", t.len());
    }
    if !m.hparams.is_empty() {
        let hp: Vec<String> = m.hparams.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(out, "  hparams: {}", hp.join(" "));
    }
    for e in art.entries() {
        let me = &e.manifest;
        let kg = &me.kernel_graph;
        let counts = kg.counts();
        let total: usize = counts.values().sum();
        let _ = writeln!(out, "entry {}", me.name);
        let per: Vec<String> = counts.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(out, "  kernels: {total} ({})", per.join(", "));
        let _ = write!(out, "  {}", me.launch.fusions_text(false));
        let _ = writeln!(
            out,
            "  functions: {} ({} bytes of CLIF in {})",
            e.code.functions.len(),
            e.clif_bytes,
            me.clif
        );
        if let (Some(c), Some(src)) = (&me.cuda, &e.cuda_source) {
            use kiln_compiler::codegen::cuda::Library;
            let (mut gemm, mut attn, mut host) = (0, 0, 0);
            for k in &c.kernels {
                match k.library {
                    Some(Library::Gemm { .. }) => gemm += 1,
                    Some(Library::Attention { .. }) => attn += 1,
                    Some(Library::Host) => host += 1,
                    None => {}
                }
            }
            let _ = writeln!(
                out,
                "  cuda: {} functions ({} bytes of CUDA C in {}) for {}; {gemm} cuBLAS GEMMs, \
                 {attn} attentions, {host} on the host",
                c.functions.len(),
                src.len(),
                c.source,
                c.arch
            );
            if let Some(version) = &nvrtc_version {
                let mixed = m.options.precision == kiln_compiler::options::Precision::Mixed;
                let _ = writeln!(out, "{}", nvrtc_summary(version, src, mixed, c, &me.name)?);
            }
        }
        let _ = writeln!(
            out,
            "  memory plan: {} buffers in {} slots over {} steps",
            me.plan.buffers.len(),
            me.plan.slots,
            me.plan.steps
        );
        let bound: std::collections::BTreeMap<String, i64> = dims
            .iter()
            .filter(|(d, _)| me.graph.dims.iter().any(|x| x == d))
            .map(|(d, v)| (d.to_string(), *v))
            .collect();
        let missing: Vec<&String> = me
            .graph
            .dims
            .iter()
            .filter(|d| !bound.contains_key(*d))
            .collect();
        let at: Vec<String> = bound.iter().map(|(k, v)| format!("{k}={v}")).collect();
        if missing.is_empty() {
            // The CPU executor writes the outputs straight into the tensors it returns,
            // outside the arena; the CUDA executor keeps them in its device arena.
            let external = if m.target() == Target::Cuda {
                Vec::new()
            } else {
                me.plan.output_buffers(kg)
            };
            match (
                me.plan.layout_with(&bound, &external),
                me.plan.live_peak(&bound),
            ) {
                (Ok(l), Ok(peak)) => {
                    let outside: usize = me
                        .plan
                        .buffers
                        .iter()
                        .zip(&external)
                        // A chain written in place holds one output's bytes.
                        .filter(|(b, &x)| x && b.in_place_of.is_none())
                        .map(|(b, _)| b.bytes(&bound).unwrap_or(0))
                        .sum();
                    let outputs = if outside > 0 {
                        format!(" (+ {outside} bytes of outputs outside it)")
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        out,
                        "  at {}: arena {} bytes{outputs}, live peak {} bytes, unshared {} bytes",
                        at.join(" "),
                        l.total,
                        peak,
                        l.unshared
                    );
                }
                (Err(e), _) | (_, Err(e)) => {
                    let _ = writeln!(out, "  at {}: cannot size the plan: {e}", at.join(" "));
                }
            }
        } else {
            let miss: Vec<&str> = missing.iter().map(|s| s.as_str()).collect();
            let _ = writeln!(out, "  arena: needs dims {}", miss.join(", "));
        }
        if plan_text {
            let d = if missing.is_empty() {
                Some(&bound)
            } else {
                None
            };
            for line in me.plan.text(kg, d).lines() {
                let _ = writeln!(out, "    {line}");
            }
        }
    }
    out!("{out}");
    Ok(())
}

/// `kiln inspect --nvrtc`: NVRTC compiles `src` (the entry's CUDA C, or with `mixed` its
/// mixed-precision program) with the options the artifact records plus the assembler's
/// `-v`; the lines say how many functions, the most registers and shared memory, and
/// every function that spills.
fn nvrtc_summary(
    version: &str,
    src: &str,
    mixed: bool,
    c: &kiln_compiler::artifact::CudaManifest,
    entry: &str,
) -> Result<String, Error> {
    let what = if mixed {
        "the mixed-precision program"
    } else {
        c.source.as_str()
    };
    let mut options = c.nvrtc_options.clone();
    options.push("--ptxas-options=-v".to_string());
    let (_, log) = kiln_runtime::cuda::nvrtc_compile_with_log(src, &options).map_err(|log| {
        plain(
            "kiln::nvrtc",
            format!("entry `{entry}`: NVRTC {version} rejects {what}:\n{log}"),
            Some("this is a code generator bug; please report it with the spec".to_string()),
        )
    })?;
    let report = kiln_runtime::cuda::ptxas_report(&log);
    let regs = report.iter().max_by_key(|f| f.registers);
    let shared = report.iter().max_by_key(|f| f.shared);
    let spills: Vec<String> = report
        .iter()
        .filter(|f| f.spill_stores > 0 || f.spill_loads > 0)
        .map(|f| {
            format!(
                "{} ({} B stored, {} B loaded)",
                f.name, f.spill_stores, f.spill_loads
            )
        })
        .collect();
    let mixed = if mixed { " (mixed precision)" } else { "" };
    let mut s = format!(
        "  nvrtc {version}: {} functions{mixed} assembled for {}",
        report.len(),
        c.arch
    );
    if let (Some(r), Some(m)) = (regs, shared) {
        s.push_str(&format!(
            "; at most {} registers ({}), {} bytes of shared memory ({})",
            r.registers, r.name, m.shared, m.name
        ));
    }
    if spills.is_empty() {
        s.push_str("; no spills");
    } else {
        s.push_str(&format!("; spilling: {}", spills.join(", ")));
    }
    // Occupancy on an sm_90 SM at the launch's block size, per function kind (the name
    // without its number): the kinds with a function below full occupancy.
    let threads = kiln_compiler::codegen::cuda::text::THREADS;
    let mut kinds: BTreeMap<&str, Vec<(u32, &'static str, u32, u32)>> = BTreeMap::new();
    for f in &report {
        let (blocks, limit) = f.occupancy(threads);
        let kind = f.name.rsplit_once('_').map_or(f.name.as_str(), |(k, _)| k);
        kinds
            .entry(kind)
            .or_default()
            .push((blocks, limit.name(), f.registers, f.shared));
    }
    let full = report
        .iter()
        .filter(|f| f.occupancy(threads).0 * threads >= 2048)
        .count();
    s.push_str(&format!(
        "\n  occupancy (an sm_90 SM, the CUDA calculator's rules, blocks of {threads}): \
         {full} of {} functions fill its 2,048 threads",
        report.len()
    ));
    let range = |v: Vec<u32>| {
        let (lo, hi) = (v.iter().min().copied(), v.iter().max().copied());
        match (lo, hi) {
            (Some(a), Some(b)) if a == b => a.to_string(),
            (Some(a), Some(b)) => format!("{a}-{b}"),
            _ => String::new(),
        }
    };
    for (kind, fs) in kinds {
        if fs.iter().all(|f| f.0 * threads >= 2048) {
            continue;
        }
        let mut limits: Vec<&str> = fs.iter().map(|f| f.1).collect();
        limits.sort();
        limits.dedup();
        s.push_str(&format!(
            "\n    {kind} ({} function{}): {} blocks an SM ({} registers, {} B shared; \
             limited by {})",
            fs.len(),
            if fs.len() == 1 { "" } else { "s" },
            range(fs.iter().map(|f| f.0).collect()),
            range(fs.iter().map(|f| f.2).collect()),
            range(fs.iter().map(|f| f.3).collect()),
            limits.join(", ")
        ));
    }
    Ok(s)
}

fn elem_bytes(dtype: &str) -> usize {
    match dtype {
        "f64" | "i64" => 8,
        "bool" => 1,
        _ => 4,
    }
}

/// `kiln inspect` of a model directory: what the model is, its size, the training state
/// of a checkpoint, and the run's last logged losses.
fn inspect_model(path: &Path) -> Result<(), Error> {
    let s = model::summarize(path).map_err(|e| plain("kiln::model", e.to_string(), None))?;
    let what = match (&s.run_steps, &s.state) {
        (Some(steps), _) if steps.len() == 1 => {
            format!("the only checkpoint of run `{}`", path.display())
        }
        (Some(steps), _) => format!(
            "the newest of the {} checkpoints of run `{}` (steps {})",
            steps.len(),
            path.display(),
            steps
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        (None, Some(st)) => format!("a checkpoint (step {})", st.step),
        (None, None) => {
            "a model directory without training state (`kiln average`'s output, or a run's best/)"
                .into()
        }
    };
    outln!("model directory {} — {what}", s.dir.display());
    match &s.spec {
        Some((spec, set)) => {
            let set: Vec<String> = set.iter().map(|(k, v)| format!("{k}={v}")).collect();
            outln!(
                "  model `{}` of {}{}",
                s.model,
                spec.display(),
                if set.is_empty() {
                    String::new()
                } else {
                    format!(" with {}", set.join(", "))
                }
            );
        }
        None => outln!("  model `{}`", s.model),
    }
    outln!(
        "  parameters {} in {} tensors ({})",
        kiln_compiler::summary::group_digits(s.parameters),
        s.tensors,
        kiln_compiler::memory::size(s.bytes)
    );
    // Loading checked that the logits have one column per token.
    outln!("  vocabulary {} (tokenizer.json)", s.tokenizer_vocab);
    outln!(
        "  positions: sources {}; outputs {}",
        match s.source_positions {
            Some(n) => format!("up to {n} tokens (a learned table)"),
            None => "of any length".to_string(),
        },
        match s.output_positions {
            Some(n) => format!("up to {n} tokens, <eos> included"),
            None => "as long as --max-len-a and --max-len-b allow".to_string(),
        }
    );
    let graphs: Vec<String> = s
        .graphs
        .iter()
        .map(|(name, nodes)| format!("{name} ({nodes} nodes)"))
        .collect();
    outln!("  graphs {}", graphs.join(", "));
    if let Some(st) = &s.state {
        outln!(
            "  training step {}, epoch {} ({} batches into it), seed {}; {} source and {} \
             target tokens seen; last learning rate {:.4e}",
            st.step,
            st.epoch + 1,
            st.batch_in_epoch,
            st.seed,
            kiln_compiler::summary::group_digits(st.src_tokens_seen),
            kiln_compiler::summary::group_digits(st.tgt_tokens_seen),
            st.lr
        );
        let best = |v: Option<f64>, digits: usize| {
            v.map_or("none yet".to_string(), |v| format!("{v:.digits$}"))
        };
        outln!(
            "  best validation loss {}, best BLEU {}{}",
            best(st.best_val_loss, 4),
            best(st.best_bleu, 2),
            match (st.loss_scale, st.overflows) {
                (Some(scale), n) => format!("; loss scale {scale}, {n} overflowing steps skipped"),
                (None, _) => String::new(),
            }
        );
        outln!("  Adam moments for every parameter (optimizer.safetensors)");
        if !s.extra_files.is_empty() {
            outln!("  extra files {}", s.extra_files.join(", "));
        }
    }
    // The run's log: `<run>/metrics.jsonl`, beside `checkpoints/`.
    let run = s
        .dir
        .parent()
        .filter(|p| p.file_name().is_some_and(|n| n == "checkpoints"))
        .and_then(Path::parent);
    if let Some(log) = run.map(|r| r.join("metrics.jsonl")).filter(|p| p.is_file()) {
        if let Ok(records) = kiln_runtime::metrics::read_metrics(&log) {
            use kiln_runtime::metrics::Kind;
            let last = |kind: Kind| records.iter().rev().find(|r| r.kind == kind);
            let mut parts = Vec::new();
            if let Some(r) = last(Kind::Train) {
                if let Some(l) = r.loss {
                    parts.push(format!("training loss {l:.4} at step {}", r.step));
                }
            }
            if let Some(r) = last(Kind::Valid) {
                let mut v = Vec::new();
                if let Some(l) = r.loss {
                    v.push(format!("loss {l:.4}"));
                }
                if let Some(b) = r.bleu {
                    v.push(format!("BLEU {b:.2}"));
                }
                if !v.is_empty() {
                    parts.push(format!("validation {} at step {}", v.join(", "), r.step));
                }
            }
            if !parts.is_empty() {
                outln!("  last logged ({}): {}", log.display(), parts.join("; "));
            }
        }
    }
    Ok(())
}
