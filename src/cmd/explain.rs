//! `kiln explain`: what the optimizer did to an entry point, and the launch plan's fusions.

use std::path::PathBuf;

pub use kiln::build::entry_graph_of;
use kiln_compiler::optimize::Target;
use kiln_compiler::options::CompileOptions;
use kiln_compiler::pipeline::compile_entry;
use kiln_dsl::Error;
use kiln_exec::COMPILED_ENTRIES;

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
