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

/// `kiln compile --entries …`: a compiled artifact directory (see
/// `kiln_compiler::artifact`): per entry the kernel graph, memory plan and CLIF code,
/// plus the initial weights from `seed`.
pub fn compile_artifact(
    args: &OptArgs,
    entries: &[String],
    output: Option<&Path>,
    check: bool,
    seed: u64,
) -> Result<(), Error> {
    let Some(dir) = output else {
        return Err(plain(
            "kiln::compile",
            "`--entries` writes an artifact directory, and no `-o DIR` was given".to_string(),
            Some("add `-o DIR`, e.g. `-o build/model.kiln-artifact`".to_string()),
        ));
    };
    let target = Target::parse(&args.target).unwrap_or(Target::Cpu);
    if target != Target::Cpu {
        return Err(plain(
            "kiln::compile",
            format!(
                "artifacts for target `{}` are not supported yet (#6): only `cpu` has generated code",
                args.target
            ),
            Some(
                "use `--target cpu`; `kiln explain --target cuda` shows the CUDA cost model's choices"
                    .to_string(),
            ),
        ));
    }
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
    let spec_text = std::fs::read_to_string(&args.spec).map_err(|e| {
        plain(
            "kiln::file",
            format!("cannot read {}: {e}", args.spec.display()),
            None,
        )
    })?;
    let spec_hash =
        kiln_compiler::artifact::spec_hash(&spec_text, &args.set, args.model.as_deref());
    let opts = OptOptions {
        target,
        ..OptOptions::default()
    };
    let mut specs = Vec::new();
    let mut weights = std::collections::BTreeMap::new();
    let mut model = String::new();
    let mut hparams = Vec::new();
    for name in &names {
        let g = entry_graph_of(&args.spec, &args.set, &args.model, name)?;
        let (kg, _) = optimize(&g, &opts)
            .map_err(|e| plain("kiln::optimizer", format!("entry `{name}`: {e}"), None))?;
        if check {
            let v = validate(&g, &kg, seed, DEFAULT_REL, DEFAULT_ABS)
                .map_err(|e| plain("kiln::validate", e, None))?;
            eprint!("{}", v.text());
            if !v.ok() {
                return Err(plain(
                    "kiln::validate",
                    format!("the optimized `{name}` does not match the source graph"),
                    Some("this is an optimizer bug; please report it with the spec".to_string()),
                ));
            }
        }
        let plan = kiln_compiler::plan::MemoryPlan::build(&kg);
        let code = kiln_compiler::codegen::program::emit(&kg).map_err(|e| {
            plain(
                "kiln::codegen",
                format!("entry `{name}`: {e}"),
                Some("this is a code generator bug; please report it with the spec".to_string()),
            )
        })?;
        for (p, t) in kiln_compiler::init::init_params(&g, seed)
            .map_err(|e| plain("kiln::init", e.to_string(), None))?
        {
            weights.insert(p, t);
        }
        if model.is_empty() {
            model = g.name.clone();
            hparams = g.hparams.clone();
        }
        specs.push(kiln_compiler::artifact::EntrySpec {
            name: name.clone(),
            graph: g,
            kernel_graph: kg,
            plan,
            code,
        });
    }
    let art = kiln_compiler::artifact::ArtifactSpec {
        model,
        spec_hash,
        seed,
        hparams,
        target: target.name().to_string(),
        entries: specs,
        weights,
    };
    kiln_compiler::artifact::write_artifact(dir, &art).map_err(|e| {
        plain(
            "kiln::artifact",
            e.to_string(),
            Some("check that the output directory is writable".to_string()),
        )
    })?;
    let kernels: usize = art
        .entries
        .iter()
        .map(|e| e.kernel_graph.kernels().len())
        .sum();
    eprintln!(
        "wrote {} ({} entries, {} kernels, {} parameter tensors)",
        dir.display(),
        art.entries.len(),
        kernels,
        art.weights.len()
    );
    Ok(())
}

/// `kiln inspect`: what an artifact holds.
pub fn inspect(dir: &Path, dims: &[(&str, i64)], plan_text: bool) -> Result<(), Error> {
    use kiln_runtime::artifact::Artifact;
    let art = Artifact::load(dir).map_err(|e| plain("kiln::artifact", e.to_string(), None))?;
    let m = &art.manifest;
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
    let _ = writeln!(out, "  target: {}", m.target);
    let _ = writeln!(
        out,
        "  host: {}",
        kiln_compiler::codegen::jit::host_description()
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
        let _ = writeln!(
            out,
            "  functions: {} ({} bytes of CLIF in {})",
            e.code.functions.len(),
            e.clif_bytes,
            me.clif
        );
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
            match (me.plan.layout(&bound), me.plan.live_peak(&bound)) {
                (Ok(l), Ok(peak)) => {
                    let _ = writeln!(
                        out,
                        "  at {}: arena {} bytes, live peak {} bytes, unshared {} bytes",
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
    print!("{out}");
    Ok(())
}

fn elem_bytes(dtype: &str) -> usize {
    match dtype {
        "f64" | "i64" => 8,
        "bool" => 1,
        _ => 4,
    }
}
