//! `kiln inspect`: an artifact's options, kernels, code and memory plans, or a model
//! directory's model, parameters, vocabulary and training state, after checking it.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_compiler::artifact::TOKENIZER_FILE;
use kiln_compiler::optimize::Target;
use kiln_dsl::Error;
use kiln_train::model::{self};

use crate::plain;

/// `kiln inspect`: what an artifact holds.
pub fn inspect(
    dir: &Path,
    dims: &[(&str, i64)],
    plan_text: bool,
    nvrtc: bool,
) -> Result<(), Error> {
    use kiln_exec::artifact::{is_artifact_dir, Artifact};
    let resolved = (!is_artifact_dir(dir)).then(|| model::resolve(dir));
    if let Some(Err(e)) = &resolved {
        // A run whose newest checkpoint is damaged is a run, not a broken artifact.
        if !matches!(e, model::ModelError::Missing { .. }) {
            return Err(plain("kiln::model", e.to_string(), None));
        }
    }
    if matches!(resolved, Some(Ok(_))) {
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
    let nvrtc_version = nvrtc_check(dir, m, nvrtc)?;
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
        match kiln_exec::compiled::Kernel16::best() {
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
        write_entry(&mut out, m, e, dims, plan_text, nvrtc_version.as_deref())?;
    }
    out!("{out}");
    Ok(())
}

/// With `--nvrtc`, NVRTC's version: the artifact must be a CUDA one, and NVRTC present.
fn nvrtc_check(
    dir: &Path,
    m: &kiln_compiler::artifact::Manifest,
    nvrtc: bool,
) -> Result<Option<String>, Error> {
    Ok(if nvrtc {
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
        Some(kiln_exec::cuda::nvrtc_available().map_err(|e| {
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
    })
}

/// An entry's lines: its kernels and fusions, its code, its CUDA C (compiled by NVRTC
/// with `--nvrtc`), and its memory plan.
fn write_entry(
    out: &mut String,
    m: &kiln_compiler::artifact::Manifest,
    e: &kiln_exec::artifact::ArtifactEntry,
    dims: &[(&str, i64)],
    plan_text: bool,
    nvrtc_version: Option<&str>,
) -> Result<(), Error> {
    use std::fmt::Write as _;
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
        if let Some(version) = nvrtc_version {
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
    write_memory(out, m, e, dims, plan_text);
    Ok(())
}

/// An entry's memory plan: its arena at the dims given (or the dims it needs), and with
/// `--plan` the plan itself.
fn write_memory(
    out: &mut String,
    m: &kiln_compiler::artifact::Manifest,
    e: &kiln_exec::artifact::ArtifactEntry,
    dims: &[(&str, i64)],
    plan_text: bool,
) {
    use std::fmt::Write as _;
    let me = &e.manifest;
    let kg = &me.kernel_graph;
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
    let (_, log) = kiln_exec::cuda::nvrtc_compile_with_log(src, &options).map_err(|log| {
        plain(
            "kiln::nvrtc",
            format!("entry `{entry}`: NVRTC {version} rejects {what}:\n{log}"),
            Some("this is a code generator bug; please report it with the spec".to_string()),
        )
    })?;
    let report = kiln_exec::cuda::ptxas_report(&log);
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
    // An average's record: what was averaged and how it was chosen.
    if let Ok(text) = std::fs::read_to_string(s.dir.join(super::average::RECORD_FILE)) {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            outln!("  {line}");
        }
    }
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
        if let Ok(records) = kiln_train::metrics::read_metrics(&log) {
            use kiln_train::metrics::Kind;
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
            // How that BLEU was computed (sacreBLEU's signature and the search).
            if let Some(sig) = last(Kind::Valid).and_then(|r| r.bleu_signature.as_ref()) {
                outln!("  BLEU signature {sig}");
            }
        }
    }
    Ok(())
}
