//! `kiln run`: one entry point of a spec or an artifact on given inputs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::init::init_params;
use kiln_compiler::optimize::Target;
use kiln_compiler::reference::{Precision, RunOptions};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::tensor::{load_safetensors, save_safetensors};
use kiln_dsl::Error;
use kiln_exec::executor::ExecutorKind;
use kiln_exec::GraphKind;
use kiln_exec::{check_inputs, check_weights, Entry};

use crate::outputs::{self, Output};
use crate::plain;
use crate::{file_error, runtime_error, GemmArgs, SpecArgs};

// `kiln run`'s arguments (their help is `kiln run --help`).
#[derive(clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// The entry point: `forward`, `loss`, `encode`, `decode_step` or `train_step`.
    #[arg(long, default_value = "forward")]
    pub entry: String,
    /// A safetensors file with one tensor per input, named as in the spec.
    #[arg(long)]
    pub inputs: PathBuf,
    /// Weights (from `kiln init` or training); without it, weights are initialized
    /// from `--seed`.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Seed for weight initialization (without `--weights`) and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Working precision of the reference executor.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f64"])]
    pub precision: String,
    /// The training step the dropout masks are drawn for (`train_step`).
    #[arg(long, default_value_t = 0)]
    pub step: u32,
    /// `reference` (plain loops, the oracle; the default for a spec), `eager` (op by
    /// op, fast GEMM), `compiled` (the optimized program as generated code; the
    /// default for an artifact) or `cuda` (a `--target cuda` artifact's CUDA C on the
    /// GPU).
    #[arg(long, value_parser = crate::args::executor_kind(&["reference", "eager", "compiled", "cuda"]))]
    pub executor: Option<ExecutorKind>,
    #[command(flatten)]
    pub gemm: GemmArgs,
    /// Where to write the outputs.
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
}

/// `kiln run`.
pub fn run(a: RunArgs) -> Result<(), Error> {
    let RunArgs {
        spec,
        entry,
        inputs,
        weights,
        seed,
        precision,
        output,
        step,
        executor,
        gemm,
    } = a;
    let given: Vec<&std::path::Path> = [Some(&spec.spec), Some(&inputs), weights.as_ref()]
        .into_iter()
        .flatten()
        .map(|p| p.as_path())
        .collect();
    outputs::check("kiln::run", &output, &given, Output::File)?;
    let entry = Entry::parse(&entry).map_err(runtime_error)?;
    // An artifact runs its generated kernels by default, a spec the reference.
    let default = if spec.spec.is_dir() {
        ExecutorKind::Compiled
    } else {
        ExecutorKind::Reference
    };
    gemm.apply(executor.unwrap_or(default))?;
    let run_opts = RunOptions {
        precision: if precision == "f64" {
            Precision::F64
        } else {
            Precision::F32
        },
        seed,
        step,
        ..RunOptions::default()
    };
    // A directory can only be an artifact: one without a manifest is named as such.
    if spec.spec.is_dir() {
        return run_artifact(
            &spec.spec,
            entry.name(),
            &inputs,
            weights.as_deref(),
            &run_opts,
            executor.unwrap_or(ExecutorKind::Compiled),
            &output,
        );
    }
    let executor = executor.unwrap_or(ExecutorKind::Reference);
    if executor == ExecutorKind::Cuda {
        return Err(plain(
            "kiln::run",
            "`--executor cuda` runs a compiled CUDA artifact, not a spec".to_string(),
            Some(format!(
                "compile one first: `kiln compile {} --entries {} --target cuda -o DIR`, \
                     then `kiln run DIR --executor cuda …`",
                spec.spec.display(),
                entry.name()
            )),
        ));
    }
    let elaborate = |kind: GraphKind| -> Result<kiln_compiler::Graph, Error> {
        let mut opts = spec.options();
        opts.mode = kiln::dsl_mode(kind);
        kiln_dsl::compile_file(&spec.spec, &opts)
    };
    let g = elaborate(entry.graph_kind())?;
    let eg = kiln_exec::compiled_entry_graph_with(entry.name(), elaborate, runtime_error)?;
    let feeds = load_safetensors(&inputs).map_err(file_error)?;
    // A decoder step reads what `encode` hoisted out of it (`static.…`): the
    // step's own inputs are the ones to check.
    let check = if entry == Entry::DecodeStep { &eg } else { &g };
    check_inputs(check, &inputs.display().to_string(), &feeds).map_err(runtime_error)?;
    let params: BTreeMap<String, Tensor> = match &weights {
        Some(path) => {
            let w = load_safetensors(path).map_err(file_error)?;
            check_weights(&g, &path.display().to_string(), &w).map_err(runtime_error)?;
            w
        }
        None => init_params(&g, seed)
            .map_err(|e| plain("kiln::init", e.to_string(), None))?
            .into_iter()
            .collect(),
    };
    let opts = run_opts;
    let exec = kiln_exec::executor::executor(executor, eg.clone())
        .map_err(|e| plain("kiln::run", e.to_string(), None))?;
    let outs = exec.run(&feeds, &params, &opts).map_err(|e| {
        plain(
            "kiln::run",
            e.to_string(),
            Some(format!(
                "the entry's inputs are: {}",
                eg.inputs
                    .iter()
                    .map(|&i| format!("{} {}", eg.source_name(i).unwrap_or("?"), eg.ty(i)))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        )
    })?;
    write_outputs(&g.name, &outs, &output)
}

/// `kiln run ARTIFACT_DIR --entry …`: an entry of a compiled artifact on the inputs of a
/// safetensors file, with the artifact's weights (or `--weights`).
pub fn run_artifact(
    dir: &Path,
    entry: &str,
    inputs: &Path,
    weights: Option<&Path>,
    opts: &kiln_compiler::reference::RunOptions,
    executor: ExecutorKind,
    output: &Path,
) -> Result<(), Error> {
    use kiln_exec::artifact::Artifact;
    let art = Artifact::load(dir).map_err(|e| plain("kiln::artifact", e.to_string(), None))?;
    if art.manifest.target() == Target::Cuda && executor == ExecutorKind::Compiled {
        let why = match kiln_exec::cuda::cuda_available() {
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
    kiln_exec::check_inputs(&g, &inputs.display().to_string(), &feeds)
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
    kiln_exec::check_weights(&g, &origin, &params).map_err(crate::runtime_error)?;
    let kind = executor;
    let exec: Box<dyn kiln_exec::executor::Exec> = if executor == ExecutorKind::Cuda {
        kiln_exec::cuda::executor_for(&art, entry).map_err(|e| {
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
        kiln_exec::executor::executor(kind, g.clone())
            .map_err(|e| plain("kiln::run", e.to_string(), None))?
    };
    let outs = exec
        .run(&feeds, &params, opts)
        .map_err(|e| plain("kiln::run", e.to_string(), None))?;
    write_outputs(art.model(), &outs, output)
}

/// Writes the outputs of `kiln run` and prints one line per output.
pub(crate) fn write_outputs(
    model: &str,
    outs: &[(String, Tensor)],
    output: &std::path::Path,
) -> Result<(), Error> {
    let mut meta = BTreeMap::new();
    meta.insert("kiln.model".to_string(), model.to_string());
    save_safetensors(output, outs, Some(&meta)).map_err(file_error)?;
    for (name, t) in outs {
        let value = match (t.shape.is_empty(), t.to_f64_vec()) {
            (true, Some(v)) => format!(" = {}", v[0]),
            _ => String::new(),
        };
        outln!("{name}: {} {:?}{value}", t.dtype_name(), t.shape);
    }
    outln!("wrote {} output(s) to {}", outs.len(), output.display());
    Ok(())
}
