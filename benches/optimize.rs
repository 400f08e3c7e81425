//! `cargo bench --bench optimize`: how long the e-graph optimizer takes on the paper's
//! models (the target: the base `train_step` in at most 2 s on 2 cores).
//!
//! For each (spec, entry): the median of 5 runs of `optimize`, the e-graph size after
//! each phase, and the kernel counts before and after.

use std::path::Path;
use std::time::Instant;

use kiln_compiler::optimize::{optimize, Options};
use kiln_dsl::{Mode, Options as DslOptions};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let runs = 5;
    println!(
        "{:<22} {:<11} {:>7} {:>9} {:>9} {:>10} {:>10}",
        "spec", "entry", "nodes", "e-nodes", "kernels", "median s", "min s"
    );
    for (spec, entry) in [
        ("transformer_base.kiln", "forward"),
        ("transformer_base.kiln", "train_step"),
        ("transformer_base.kiln", "decode_step"),
        ("transformer_big.kiln", "train_step"),
    ] {
        let mode = match entry {
            "train_step" => Mode::Train,
            "decode_step" => Mode::Decode,
            _ => Mode::Eval,
        };
        let elaborate = |mode| {
            kiln_dsl::compile_file(
                &root.join("models").join(spec),
                &DslOptions {
                    mode,
                    ..DslOptions::default()
                },
            )
            .expect("the spec compiles")
        };
        let g = elaborate(mode);
        let g = match entry {
            "train_step" => kiln_compiler::autodiff::train_step(&g).expect("differentiates"),
            // The step the decoder runs: its per-sentence values computed by `encode`.
            "decode_step" => {
                kiln_exec::decoder_entries(&elaborate(Mode::Eval), &g)
                    .expect("cuts the decoder's entries")
                    .1
            }
            _ => g.prune(&g.forward_outputs()).expect("prunes"),
        };
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..runs {
            let t = Instant::now();
            let r = optimize(&g, &Options::default()).expect("optimizes");
            times.push(t.elapsed().as_secs_f64());
            last = Some(r);
        }
        times.sort_by(f64::total_cmp);
        let (kg, report) = last.expect("ran");
        let enodes = report.phases.last().map(|p| p.nodes).unwrap_or(0);
        println!(
            "{:<22} {:<11} {:>7} {:>9} {:>4}->{:<4} {:>10.3} {:>10.3}",
            spec,
            entry,
            g.len(),
            enodes,
            report.kernels_before.values().sum::<usize>(),
            kg.kernels().len(),
            times[runs / 2],
            times[0]
        );
    }
}
