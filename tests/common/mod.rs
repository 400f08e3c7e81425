//! Helpers shared by the integration tests (each test file uses some of them).
#![allow(dead_code)]

pub mod cuda;
// (Each test binary uses some of them.)
#[allow(unused_imports)]
pub use cuda::{cuda_available, emulated, emulation, require_cuda_or_skip};

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Elaborates `spec` with `set` in the mode of a graph kind (what
/// `kiln_exec::compiled_entry_graph_with` asks for).
pub fn elaborator<'a>(
    spec: &'a Path,
    set: &'a [&str],
) -> impl Fn(kiln_exec::GraphKind) -> Result<kiln_compiler::Graph, String> + 'a {
    move |kind| {
        let opts = kiln_dsl::Options {
            overrides: set.iter().map(|s| s.to_string()).collect(),
            mode: kiln::dsl_mode(kind),
            model: None,
        };
        kiln_dsl::compile_file(spec, &opts)
            .map_err(|e| format!("{} does not compile: {e:?}", spec.display()))
    }
}

/// The repository root.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the `kiln` binary from the repository root, without colors.
pub fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(root())
        .env("NO_COLOR", "1")
        .output()
        .expect("kiln runs")
}

/// The folders of the shipped specs: the paper's models, Table 3's variants and the
/// gallery of user variants (#61).
pub const SPEC_DIRS: [&str; 3] = ["models", "models/table3", "models/gallery"];

/// Every spec shipped in [`SPEC_DIRS`], listed from the folders (a new spec is covered
/// without editing a test), sorted.
pub fn shipped_specs() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in SPEC_DIRS.map(|d| root().join(d)) {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "kiln") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The shipped specs whose kernels differ from base's in kind or structure (every kernel
/// kind, every mask, d_k ≠ d_v, one head, learned positions, no dropout, parsing's
/// vocabulary and depth, the gallery's pre-LN norms, GELU, RMSNorm and SwiGLU); the other
/// Table 3 variants repeat base's kernels at other widths, and the gallery's separate
/// embeddings base's with one more product. The expensive per-kernel sweeps run on these;
/// end-to-end comparisons on all.
pub const DISTINCT_SPECS: [&str; 11] = [
    "transformer_tiny.kiln",
    "transformer_base.kiln",
    "transformer_big.kiln",
    "parsing.kiln",
    "a_h1.kiln",
    "b_dk32.kiln",
    "d_drop0.kiln",
    "e_learned.kiln",
    "pre_ln.kiln",
    "gelu_ffn.kiln",
    "rms_swiglu.kiln",
];

/// The graph of an entry point of a spec, built as `kiln explain` / `kiln compile` build
/// it (the runtime's `compiled_entry_graph`), except that `adam_update` is built over
/// one parameter per distinct shape: every parameter's update is the same kernel, and
/// big's 176M parameters with their moments would need ~3 GB.
pub fn entry_graph(spec: &Path, set: &[&str], entry: &str) -> Result<kiln_compiler::Graph, String> {
    use kiln_exec::{compiled_entry_graph, compiled_entry_graph_with, GraphKind};
    let elaborate = elaborator(spec, set);
    if entry != "adam_update" {
        return compiled_entry_graph_with(entry, elaborate, |e| e.message);
    }
    let mut g = elaborate(GraphKind::Eval)?;
    {
        let mut seen = std::collections::BTreeSet::new();
        let params: Vec<_> = g
            .params
            .iter()
            .copied()
            .filter(|&p| seen.insert(g.ty(p).shape.to_string()))
            .collect();
        g.params = params;
    }
    compiled_entry_graph(&g, entry).map_err(|e| e.message)
}

/// A miette diagnostic as one line: whitespace collapsed and the frame's `│` dropped
/// (miette wraps lines where the paths in them decide), for `contains` checks.
#[allow(dead_code)]
pub fn flat(text: &str) -> String {
    text.split_whitespace()
        .filter(|w| *w != "│")
        .collect::<Vec<_>>()
        .join(" ")
}
