//! Times the eager executor on the base Transformer.
//!
//! In: `models/transformer_base.kiln` elaborated with `vocab=37000` (63M parameters,
//! initialized with seed 1), a batch of B = 32 sentences of S = T = 25 random ids in
//! `3..37000`. Out: for the forward entry (logits) and the loss entry, the median time
//! of a few runs after a warm-up, tokens per second (`B * T / median`), and where one
//! run spends its time per op kind, on stdout; also whether runs are bit-identical and
//! a hash of the outputs' bits, to compare runs with different thread counts.
//!
//! The `train_step` entry (train mode: dropout on, objective plus every parameter's
//! gradient) is timed the same way.
//!
//! Run with `cargo run --release --example eager_bench [RUNS [SPEC [B]]]`: RUNS timed
//! runs (default 5), SPEC `base` (default) or `big`, B sentences (default 32) — e.g.
//! `eager_bench 3 big 256` for the big model on 6,400 target tokens.
//! `RAYON_NUM_THREADS` sets the thread count.

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use kiln_compiler::init::init_params;
use kiln_compiler::reference::RunOptions;
use kiln_compiler::rng;
use kiln_compiler::tensor::Tensor;
use kiln_dsl::Options;
use kiln_exec::Eager;

const S: usize = 25;
const T: usize = 25;
const VOCAB: i32 = 37000;

fn random_ids(rows: usize, cols: usize, stream: u64) -> Result<Tensor> {
    let v = (0..(rows * cols) as u64)
        .map(|i| 3 + (rng::uniform01(2024, stream, i) * f64::from(VOCAB - 3)) as i32)
        .collect();
    Ok(Tensor::i32(vec![rows, cols], v)?)
}

/// FNV-1a over the outputs' f32 bits: equal hashes mean (all but surely) equal outputs.
fn bits_hash(outputs: &[(String, Tensor)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, t) in outputs {
        for x in t.as_f32().unwrap_or(&[]) {
            for b in x.to_bits().to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    h
}

fn median_ms(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let runs: usize = match args.next() {
        Some(a) => a
            .parse()
            .context("the first argument is the number of runs")?,
        None => 5,
    };
    let spec = args.next().unwrap_or_else(|| "base".to_string());
    if spec != "base" && spec != "big" {
        return Err(anyhow!(
            "the second argument is the spec: `base` or `big`, not `{spec}`"
        ));
    }
    let b: usize = match args.next() {
        Some(a) => a
            .parse()
            .context("the third argument is the number of sentences")?,
        None => 32,
    };
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("models/transformer_{spec}.kiln"));
    let opts = Options {
        overrides: vec!["vocab=37000".into()],
        ..Options::default()
    };
    let g = kiln_dsl::compile_file(&path, &opts).map_err(|e| anyhow!("{e}"))?;
    let train = kiln_dsl::compile_file(
        &path,
        &Options {
            mode: kiln_dsl::Mode::Train,
            ..opts.clone()
        },
    )
    .map_err(|e| anyhow!("{e}"))?;
    let params: BTreeMap<String, Tensor> = init_params(&g, 1)?.into_iter().collect();
    let mut inputs = BTreeMap::new();
    inputs.insert("src".to_string(), random_ids(b, S, 1)?);
    inputs.insert("tgt_in".to_string(), random_ids(b, T, 2)?);
    inputs.insert("tgt_out".to_string(), random_ids(b, T, 3)?);
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| {
        std::thread::available_parallelism().map_or("?".into(), |n| n.to_string())
    });
    println!(
        "transformer_{spec}, vocab 37000: {} parameters; B={b}, S={S}, T={T}; {threads} threads",
        g.num_parameters(),
    );
    let objective = g
        .objective
        .clone()
        .ok_or_else(|| anyhow!("the model declares no objective"))?;
    let entries = [
        ("forward (logits)", g.prune(&g.forward_outputs())?),
        ("loss", g.prune(&[objective])?),
        ("train_step", kiln_compiler::autodiff::train_step(&train)?),
    ];
    let run_opts = RunOptions {
        seed: 1,
        step: 1,
        ..RunOptions::default()
    };
    for (name, entry) in entries {
        let nodes = entry.len();
        let eager = Eager::new(entry)?;
        let t0 = Instant::now();
        eager.run(&inputs, &params, &run_opts)?;
        let warm = t0.elapsed().as_secs_f64() * 1e3;
        let first = eager.run(&inputs, &params, &run_opts)?;
        let mut times = Vec::with_capacity(runs);
        let mut repeatable = true;
        for _ in 0..runs {
            let t0 = Instant::now();
            let out = eager.run(&inputs, &params, &run_opts)?;
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            repeatable &= out == first;
        }
        let med = median_ms(times.clone());
        println!(
            "{name:>17}: {nodes} nodes; median {med:.1} ms over {runs} runs (warm-up {warm:.1} ms, \
             min {:.1}, max {:.1}); {:.0} target tokens/s",
            times.iter().copied().fold(f64::INFINITY, f64::min),
            times.iter().copied().fold(0.0, f64::max),
            (b * T) as f64 / (med / 1e3)
        );
        println!(
            "{:>17}  outputs bit-identical across runs: {}; their bits hash to {:016x} \
             (compare across RAYON_NUM_THREADS)",
            "",
            if repeatable { "yes" } else { "NO" },
            bits_hash(&first)
        );
        let (_, profile) = eager.run_profiled(&inputs, &params, &run_opts)?;
        let total: f64 = profile.iter().map(|t| t.seconds).sum();
        let top: Vec<String> = profile
            .iter()
            .take(8)
            .map(|t| format!("{} {:.1} ms ({}x)", t.op, t.seconds * 1e3, t.nodes))
            .collect();
        println!(
            "{:>17}  one profiled run, {:.1} ms: {}",
            "",
            total * 1e3,
            top.join(", ")
        );
    }
    Ok(())
}
