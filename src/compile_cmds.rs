//! `kiln explain` and `kiln compile`: the optimizer from the command line.

use std::path::{Path, PathBuf};

use kiln_compiler::optimize::validate::{validate, DEFAULT_ABS, DEFAULT_REL};
use kiln_compiler::optimize::{optimize, KernelGraph, Options as OptOptions, Report, Target};
use kiln_compiler::Graph;
use kiln_dsl::{Error, Mode, Options};
use kiln_runtime::{compiled_entry_graph, compiled_graph_kind, GraphKind, COMPILED_ENTRIES};

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
    let mode = match compiled_graph_kind(entry).map_err(run_err)? {
        GraphKind::Eval => Mode::Eval,
        GraphKind::Train => Mode::Train,
        GraphKind::Decode => Mode::Decode,
    };
    let opts = Options {
        overrides: set.to_vec(),
        mode,
        model: model.clone(),
    };
    let g = kiln_dsl::compile_file(spec, &opts)?;
    compiled_entry_graph(&g, entry).map_err(run_err)
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

/// `kiln explain`.
pub fn explain(args: &OptArgs, kernels: bool) -> Result<(), Error> {
    let (_, kg, report) = run_optimizer(args)?;
    println!(
        "explain {} entry={} target={}",
        args.spec.display(),
        args.entry,
        args.target
    );
    print!("{}", report.text(true));
    if kernels {
        print!("{}", kg.text());
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
            let mut tmp = path.as_os_str().to_owned();
            tmp.push(".tmp");
            let tmp = PathBuf::from(tmp);
            std::fs::write(&tmp, &text)
                .and_then(|_| std::fs::rename(&tmp, path))
                .map_err(|e| {
                    plain(
                        "kiln::file",
                        format!("cannot write {}: {e}", path.display()),
                        None,
                    )
                })?;
            let total: usize = report.kernels_after.values().sum();
            eprintln!("wrote {} ({} kernels)", path.display(), total);
        }
        None => print!("{text}"),
    }
    Ok(())
}
