//! `kiln compile`: one entry point's kernel graph as text, or an artifact of a spec, a
//! training configuration or a trained model.

use std::path::{Path, PathBuf};

use kiln_compiler::optimize::validate::{validate, DEFAULT_ABS, DEFAULT_REL};
use kiln_compiler::optimize::{optimize, KernelGraph, Options as OptOptions, Report, Target};
use kiln_compiler::Graph;
use kiln_dsl::Error;

use crate::cmd::explain::OptArgs;
use crate::outputs::{self, Output};
use crate::plain;
use kiln::build::{
    compile_artifact, compile_artifact_from_config, compile_artifact_from_model, entry_graph_of,
    Build,
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
