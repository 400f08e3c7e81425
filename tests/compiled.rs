//! The compiled CPU executor against the reference executor: every shipped spec, every
//! entry point, several dim sets (batch 1, length 1, lengths not divisible by 4).
//!
//! Tolerance, per output: `max|compiled − reference| ≤ 1e-5·max|reference| + 1e-6`
//! (f32; the compiled executor reorders sums — GEMM blocking, vector accumulators — and
//! evaluates `exp`/`log` as polynomials within 2 ulp).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use kiln_compiler::optimize::validate::{random_feeds_with, Feeds};
use kiln_compiler::reference::{self, RunOptions};
use kiln_compiler::Graph;
use kiln_dsl::{Mode, Options};
use kiln_runtime::compiled::Compiled;
use kiln_runtime::{compiled_entry_graph, compiled_graph_kind, GraphKind, COMPILED_ENTRIES};
use rayon::prelude::*;

mod common;
use common::shipped_specs;

const REL: f64 = 1e-5;
const ABS: f64 = 1e-6;

fn entry_graph(spec: &Path, set: &[&str], entry: &str) -> Result<Graph, String> {
    let mode = match compiled_graph_kind(entry).map_err(|e| e.message)? {
        GraphKind::Eval => Mode::Eval,
        GraphKind::Train => Mode::Train,
        GraphKind::Decode => Mode::Decode,
    };
    let opts = Options {
        overrides: set.iter().map(|s| s.to_string()).collect(),
        mode,
        model: None,
    };
    let mut g = kiln_dsl::compile_file(spec, &opts)
        .map_err(|e| format!("{} does not compile: {e:?}", spec.display()))?;
    if entry == "adam_update" {
        // One parameter per distinct shape: every parameter's update is the same kernel.
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

/// Dim sets: the validation default, then odd sizes.
fn dim_sets(g: &Graph) -> Vec<BTreeMap<String, i64>> {
    let sets: [&[i64]; 3] = [&[2, 5, 3, 2, 2, 2], &[1, 1, 1, 1, 1, 1], &[3, 7, 9, 5, 3, 2]];
    sets.iter()
        .map(|s| {
            g.dims
                .iter()
                .enumerate()
                .map(|(i, d)| (d.clone(), s[i % s.len()]))
                .collect()
        })
        .collect()
}

/// Compares every output; returns the worst relative error or a report of mismatches.
fn compare(g: &Graph, exec: &Compiled, dims: &BTreeMap<String, i64>, seed: u64) -> Result<f64, String> {
    let (inputs, params): (Feeds, Feeds) = random_feeds_with(g, seed, dims)?;
    let opts = RunOptions {
        seed,
        step: 3,
        ..RunOptions::default()
    };
    let want = reference::run(g, &inputs, &params, &opts).map_err(|e| format!("reference: {e}"))?;
    let got = exec
        .run(&inputs, &params, &opts)
        .map_err(|e| format!("compiled: {e}"))?;
    let mut worst: f64 = 0.0;
    let mut bad = Vec::new();
    for ((name, w), (n2, c)) in want.iter().zip(&got) {
        assert_eq!(name, n2);
        let (Some(w), Some(c)) = (w.to_f64_vec(), c.to_f64_vec()) else {
            return Err(format!("output `{name}` is not numeric"));
        };
        if w.len() != c.len() {
            return Err(format!("output `{name}`: {} elements, expected {}", c.len(), w.len()));
        }
        let max_ref = w.iter().fold(0f64, |m, x| m.max(x.abs()));
        let diff = w
            .iter()
            .zip(&c)
            .fold(0f64, |m, (a, b)| if a.is_nan() && b.is_nan() { m } else { m.max((a - b).abs()) });
        let rel = diff / max_ref.max(1e-30);
        worst = worst.max(if diff <= ABS { 0.0 } else { rel });
        if diff > REL * max_ref + ABS || diff.is_nan() {
            bad.push(format!("  {name}: max diff {diff:.3e}, max |ref| {max_ref:.3e}"));
        }
    }
    if bad.is_empty() {
        Ok(worst)
    } else {
        Err(bad.join("\n"))
    }
}

#[test]
fn every_spec_every_entry_matches_the_reference() {
    let t0 = Instant::now();
    let specs = shipped_specs();
    assert!(specs.len() >= 22, "expected the paper's specs, found {specs:?}");
    let pairs: Vec<(&Path, &str)> = specs
        .iter()
        .flat_map(|p| COMPILED_ENTRIES.iter().map(move |&e| (p.as_path(), e)))
        .collect();
    let failures: Vec<String> = pairs
        .par_iter()
        .enumerate()
        .filter_map(|(i, &(path, entry))| {
            let name = path.file_name().unwrap().to_string_lossy();
            let what = format!("{name} --entry {entry}");
            let g = match entry_graph(path, &["vocab=48"], entry) {
                Ok(g) => g,
                Err(e) => return Some(format!("{what}: {e}")),
            };
            let exec = match Compiled::from_graph(g.clone()) {
                Ok(x) => x,
                Err(e) => return Some(format!("{what}: compiling: {e}")),
            };
            let mut worst: f64 = 0.0;
            for (k, dims) in dim_sets(&g).iter().enumerate() {
                match compare(&g, &exec, dims, 1 + i as u64 + 1000 * k as u64) {
                    Ok(w) => worst = worst.max(w),
                    Err(e) => return Some(format!("{what} at {dims:?}:\n{e}")),
                }
            }
            eprintln!("{what}: worst relative error {worst:.2e}");
            None
        })
        .collect();
    eprintln!(
        "{} (spec, entry) pairs × 3 dim sets in {:.1} s",
        pairs.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} of {} pairs failed:\n{}",
        failures.len(),
        pairs.len(),
        failures.join("\n")
    );
}
