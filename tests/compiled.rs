//! The compiled CPU executor: every shipped spec, every entry point.
//!
//! Two checks, both at `max|got − want| ≤ 1e-5·max|want| + 1e-6` (f32):
//! - **per kernel** (base, big, tiny, parsing and the Table 3 variants whose kernels
//!   differ from base's): every generated kernel (and GEMM-driven template) is checked
//!   right after it runs against its own definition, expanded to primitives and run on
//!   the same operands; the worst relative error per kernel kind is printed and asserted;
//! - **end to end**: the program's outputs against the reference executor
//!   (`transformer_tiny`, three dim sets: batch 1 / length 1, odd lengths, lengths not
//!   divisible by 4) and against the eager executor (every other spec at full width, odd
//!   lengths), which the runtime's own tests pin to the reference.
//!
//! One exception, stated: the gradients of `train_step` pass through relu's kink
//! (`where(y > 0, g, 0)`); an activation within rounding of 0 can fall on either side in
//! two correct executors, which changes one column of the first FFN weight's gradient by
//! a visible amount and, through the rest of the backward pass, every earlier gradient by
//! a little. A gradient output therefore passes when `‖got − want‖₂ ≤ 1e-2·‖want‖₂` (one
//! flip moves a gradient's norm by ~1e-3; a wrong kernel by O(1)); the per-kernel checks
//! hold every kernel of the backward pass to 1e-5.

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use kiln_compiler::optimize::validate::{random_feeds_with, Feeds};
use kiln_compiler::options::CompileOptions;
use kiln_compiler::reference::{self, RunOptions};
use kiln_compiler::Graph;
use kiln_exec::compiled::{Compiled, KernelErrors, RELATIVE_FROM};
use kiln_exec::Eager;
use kiln_exec::COMPILED_ENTRIES;
use rayon::prelude::*;
use std::sync::Mutex;

mod common;
use common::{entry_graph, shipped_specs};

const REL: f64 = 1e-5;
const ABS: f64 = 1e-6;
/// Gradients of `train_step`: relative tolerance on the 2-norm of the difference (see the
/// module documentation).
const GRAD_NORM_REL: f64 = 1e-2;

/// Dim sets: the validation default, then odd sizes.
fn dim_sets(g: &Graph) -> Vec<BTreeMap<String, i64>> {
    let sets: [&[i64]; 3] = [
        &[2, 5, 3, 2, 2, 2],
        &[1, 1, 1, 1, 1, 1],
        &[3, 7, 9, 5, 3, 2],
    ];
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
fn compare(
    g: &Graph,
    exec: &Compiled,
    dims: &BTreeMap<String, i64>,
    seed: u64,
    with_reference: bool,
) -> Result<f64, String> {
    let (inputs, params): (Feeds, Feeds) = random_feeds_with(g, seed, dims)?;
    let opts = RunOptions {
        seed,
        step: 3,
        ..RunOptions::default()
    };
    let want = if with_reference {
        reference::run(g, &inputs, &params, &opts).map_err(|e| format!("reference: {e}"))?
    } else {
        Eager::new(g.clone())
            .and_then(|e| e.run(&inputs, &params, &opts))
            .map_err(|e| format!("eager: {e}"))?
    };
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
            return Err(format!(
                "output `{name}`: {} elements, expected {}",
                c.len(),
                w.len()
            ));
        }
        let max_ref = w.iter().fold(0f64, |m, x| m.max(x.abs()));
        let diff = w.iter().zip(&c).fold(0f64, |m, (a, b)| {
            if a.is_nan() && b.is_nan() {
                m
            } else {
                m.max((a - b).abs())
            }
        });
        let rel = diff / max_ref.max(1e-30);
        let outside = w
            .iter()
            .zip(&c)
            .filter(|(a, b)| {
                let within = (*a - *b).abs() <= REL * max_ref + ABS;
                !(within || a.is_nan() && b.is_nan())
            })
            .count();
        let grad = name.starts_with("grad.");
        if !grad {
            worst = worst.max(if diff <= ABS { 0.0 } else { rel });
        }
        let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
        let ok = if grad {
            let d =
                norm(
                    &mut w
                        .iter()
                        .zip(&c)
                        .map(|(a, b)| if a.is_nan() && b.is_nan() { 0.0 } else { a - b }),
                );
            let r = norm(&mut w.iter().copied());
            d <= GRAD_NORM_REL * r + ABS
        } else {
            outside == 0
        };
        if !ok {
            bad.push(format!(
                "  {name}: max diff {diff:.3e}, max |ref| {max_ref:.3e}, {outside} of {} elements outside",
                w.len()
            ));
        }
    }
    if bad.is_empty() {
        Ok(worst)
    } else {
        Err(bad.join("\n"))
    }
}

#[test]
fn every_spec_every_entry_matches() {
    let t0 = Instant::now();
    let specs = shipped_specs();
    assert!(
        specs.len() >= 22,
        "expected the paper's specs, found {specs:?}"
    );
    let pairs: Vec<(&Path, &str)> = specs
        .iter()
        .flat_map(|p| COMPILED_ENTRIES.iter().map(move |&e| (p.as_path(), e)))
        .collect();
    let kinds: Mutex<BTreeMap<String, KernelErrors>> = Mutex::new(BTreeMap::new());
    let failures: Vec<String> = pairs
        .par_iter()
        .enumerate()
        .filter_map(|(i, &(path, entry))| {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let what = format!("{name} --entry {entry}");
            let g = match entry_graph(path, &["vocab=48"], entry) {
                Ok(g) => g,
                Err(e) => return Some(format!("{what}: {e}")),
            };
            // Kernel checks where the kernels differ (every kind, every mask, d_k ≠ d_v,
            // one head, learned positions, no dropout); the other Table 3 variants repeat
            // base's kernels at other widths and are compared end to end.
            let checked = common::DISTINCT_SPECS.contains(&name.as_str());
            let built = if checked {
                Compiled::from_graph_checked(g.clone())
            } else {
                Compiled::from_graph(g.clone())
            };
            let exec = match built {
                Ok(x) => x,
                Err(e) => return Some(format!("{what}: compiling: {e}")),
            };
            let tiny = name == "transformer_tiny.kiln";
            let sets = dim_sets(&g);
            let sets: Vec<_> = if tiny { sets } else { sets[2..].to_vec() };
            let mut worst: f64 = 0.0;
            for (k, dims) in sets.iter().enumerate() {
                match compare(&g, &exec, dims, 1 + i as u64 + 1000 * k as u64, tiny) {
                    Ok(w) => worst = worst.max(w),
                    Err(e) => return Some(format!("{what} at {dims:?}:\n{e}")),
                }
            }
            let mut bad = Vec::new();
            let mut all = kinds.lock().unwrap();
            for (kind, k) in exec.kernel_errors() {
                let e = all.entry(kind.clone()).or_default();
                let worst = |w: f64, x: f64| if x.is_nan() { x } else { w.max(x) };
                e.relative = worst(e.relative, k.relative);
                e.absolute_small = worst(e.absolute_small, k.absolute_small);
                e.checked += k.checked;
                e.outside += k.outside;
                if k.outside > 0 || k.relative.is_nan() || k.absolute_small.is_nan() {
                    bad.push(format!(
                        "  kernel kind {kind}: {} of {} outputs outside 1e-5 of their \
                         definition (worst relative error {:.3e}, worst absolute error of \
                         outputs under 0.1 {:.3e})",
                        k.outside, k.checked, k.relative, k.absolute_small
                    ));
                }
            }
            drop(all);
            if !bad.is_empty() {
                return Some(format!("{what}:\n{}", bad.join("\n")));
            }
            eprintln!(
                "{what}: outputs within {worst:.2e} of the {}",
                if tiny { "reference" } else { "eager executor" }
            );
            None
        })
        .collect();
    eprintln!(
        "per kernel kind, against its definition: the worst relative error of outputs of \
         magnitude ≥ {RELATIVE_FROM}, the worst absolute error of smaller ones:"
    );
    for (kind, e) in kinds.lock().unwrap().iter() {
        eprintln!(
            "  {kind:<22} {:.2e}  {:.2e}  ({} outputs checked)",
            e.relative, e.absolute_small, e.checked
        );
        assert!(e.relative < 1e-5, "{kind}: relative error {:e}", e.relative);
    }
    eprintln!(
        "{} (spec, entry) pairs in {:.1} s",
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

/// One program run from several places at once: plain threads, and rayon's workers
/// (where a run waiting for its kernels may take up a second run of the same program).
/// Every run must give the bits of a run alone, with different dims in flight together,
/// and none may wait on itself (the shared arena is never waited for).
#[test]
fn concurrent_runs_of_one_program_agree_bit_for_bit() {
    let path = common::root().join("models/transformer_tiny.kiln");
    let g = entry_graph(&path, &["vocab=48"], "train_step").expect("the entry");
    let exec = Compiled::from_graph(g.clone()).expect("compiles");
    let sets = dim_sets(&g);
    let opts = RunOptions {
        seed: 5,
        step: 3,
        ..RunOptions::default()
    };
    let feeds: Vec<(Feeds, Feeds)> = sets
        .iter()
        .enumerate()
        .map(|(k, d)| random_feeds_with(&g, 40 + k as u64, d).expect("feeds"))
        .collect();
    let alone: Vec<Vec<u64>> = feeds
        .iter()
        .map(|(i, p)| output_bits(&exec.run(i, p, &opts).expect("runs")))
        .collect();
    let check = |n: usize| {
        let k = n % feeds.len();
        let (i, p) = &feeds[k];
        let got = output_bits(&exec.run(i, p, &opts).expect("runs"));
        assert!(
            got == alone[k],
            "run {n} (dims {:?}) differs from a run alone",
            sets[k]
        );
    };
    std::thread::scope(|s| {
        for t in 0..3 {
            let check = &check;
            s.spawn(move || (0..8).for_each(|n| check(t * 8 + n)));
        }
        (0..24).into_par_iter().for_each(check);
    });
}

/// An inference program run on unchanged parameters (one `params_version`) reads the
/// tied output projection from a contiguous copy of the transposed embedding from its
/// first run on (at these sizes with the bits of a run that reads it in place; see
/// `a_decoders_first_batch_gives_the_bits_of_its_later_ones` in `decode.rs` for sizes
/// where they differ); a training step never copies its weights.
#[test]
fn a_transposed_weight_copy_gives_the_bits_of_the_view() {
    let path = common::root().join("models/transformer_tiny.kiln");
    let g = entry_graph(&path, &["vocab=3001"], "forward").expect("the entry");
    let exec = Compiled::from_graph(g.clone()).expect("compiles");
    let dims = dim_sets(&g).pop().expect("a dim set");
    let (inputs, params) = random_feeds_with(&g, 7, &dims).expect("feeds");
    let plain = output_bits(
        &exec
            .run(&inputs, &params, &RunOptions::default())
            .expect("runs"),
    );
    let fixed = RunOptions {
        params_version: Some(kiln_exec::executor::fresh_params_version()),
        ..RunOptions::default()
    };
    for run in 0..3 {
        let got = output_bits(&exec.run(&inputs, &params, &fixed).expect("runs"));
        assert!(got == plain, "run {run} on a fixed version differs");
        // The first run of the version makes the copy; the later ones read it.
        assert_eq!(exec.weight_copies(), 1, "after run {run}");
    }
    // A new version: a new copy, in place of the old one.
    let next = RunOptions {
        params_version: Some(kiln_exec::executor::fresh_params_version()),
        ..RunOptions::default()
    };
    assert!(output_bits(&exec.run(&inputs, &params, &next).expect("runs")) == plain);
    assert_eq!(exec.weight_copies(), 1);
    // Without a version: read in place, the copy left for its version.
    assert!(
        output_bits(
            &exec
                .run(&inputs, &params, &RunOptions::default())
                .expect("runs")
        ) == plain
    );

    let g = entry_graph(&path, &["vocab=48"], "train_step").expect("the entry");
    let exec = Compiled::from_graph(g.clone()).expect("compiles");
    let (inputs, params) = random_feeds_with(&g, 7, &dims).expect("feeds");
    for _ in 0..3 {
        exec.run(&inputs, &params, &fixed).expect("runs");
    }
    assert_eq!(exec.weight_copies(), 0, "a training step copies no weight");
}

/// `kiln bench --json` of the tiny model's `train_step` (vocabulary 48, 3 sentences of 7
/// source and 5 target tokens) with `extra` arguments, parsed.
fn bench_tiny_step_json(extra: &[&str]) -> serde_json::Value {
    bench_tiny_json("train_step", extra, &[]).0
}

/// `kiln bench --json` of the tiny model's `entry` (vocabulary 48, 3 sentences of 7 source
/// and 5 target tokens) with `extra` arguments and `env` variables, parsed, and what it
/// wrote to stderr.
fn bench_tiny_json(
    entry: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (serde_json::Value, String) {
    let out = bench_tiny(entry, extra, env);
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "{env:?}: {text}{err}");
    let v = serde_json::from_str(text.trim()).expect("one JSON object");
    (v, err)
}

/// The process of [`bench_tiny_json`], whatever its outcome.
fn bench_tiny(entry: &str, extra: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut args = vec![
        "bench",
        "models/transformer_tiny.kiln",
        "--set",
        "vocab=48",
        "--entry",
        entry,
        "--batch",
        "3",
        "--src-len",
        "7",
        "--tgt-len",
        "5",
        "--json",
    ];
    args.extend_from_slice(extra);
    std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(&args)
        .current_dir(common::root())
        .env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .output()
        .expect("kiln runs")
}

/// The products' type is an option (`--gemm-type`, `train.gemm_type`), never the
/// environment's: the variable an older kiln read changes nothing.
#[test]
fn the_environment_does_not_choose_the_products() {
    let (v, err) = bench_tiny_json("forward", &["--runs", "1"], &[("KILN_CPU_BF16", "int16")]);
    assert_eq!(v["executor"].as_str(), Some("compiled"), "{err}");
    assert!(!err.contains("KILN_CPU_BF16"), "{err}");
}

/// `--gemm-type` chooses the products: `f32`; each kernel where this CPU runs it (the
/// bench names it); an
/// error, exit status 1, naming the kernel and why, where it cannot; an error for a 16-bit
/// type asked of the eager executor.
#[test]
fn gemm_type_names_the_kernel_or_fails_saying_why() {
    use kiln_exec::compiled::Kernel16;
    let executor = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["--runs", "1"];
        args.extend_from_slice(extra);
        let (v, _) = bench_tiny_json("forward", &args, env);
        v["executor"].as_str().unwrap_or_default().to_string()
    };
    let refusal = |extra: &[&str]| {
        let mut args = vec!["--runs", "1"];
        args.extend_from_slice(extra);
        let out = bench_tiny("forward", &args, &[]);
        assert_eq!(out.status.code(), Some(1), "{extra:?}");
        // The diagnostic's wrapped lines joined.
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .map(|l| l.trim_start().trim_start_matches('│').trim())
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(executor(&["--gemm-type", "f32"], &[]), "compiled");
    for (kernel, label) in [
        (Kernel16::Tiles, "compiled-bf16-products"),
        (Kernel16::Dot, "compiled-bf16-products-vdpbf16ps"),
        (Kernel16::Half, "compiled-fp16-products"),
        (Kernel16::Int16, "compiled-int16-products"),
        (Kernel16::Int8, "compiled-int8-products"),
    ] {
        let key = kernel.key();
        match kernel.available() {
            Ok(()) => assert_eq!(executor(&["--gemm-type", key], &[]), label),
            Err(why) => {
                let err = refusal(&["--gemm-type", key]);
                assert!(err.contains(&format!("--gemm-type {key}: {why}")), "{err}");
                assert!(err.contains("use --gemm-type f32, or 16bit"), "{err}");
            }
        }
    }
    let err = refusal(&["--gemm-type", "int16", "--executor", "eager"]);
    assert!(
        err.contains(
            "--gemm-type int16 chooses the compiled executor's matrix products, but this \
             runs the eager executor"
        ),
        "{err}"
    );
}

/// `kiln bench --json` with the compiled executor reports what it measured: the runs it
/// was asked for, `min ≤ median ≤ max`, tokens per second from the median and the batch's
/// target tokens, and the arena of the memory plan at the bench's dims.
#[test]
fn kiln_bench_reports_the_compiled_run_and_its_arena() {
    let v = bench_tiny_step_json(&["--runs", "3"]);
    assert_eq!(v["executor"], "compiled");
    assert_eq!(
        (v["runs"].as_u64(), v["warmup"].as_u64()),
        (Some(3), Some(1))
    );
    let ms = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {v}"));
    assert!(
        0.0 < ms("min_ms") && ms("min_ms") <= ms("median_ms") && ms("median_ms") <= ms("max_ms")
    );
    let tokens = ms("tokens_per_s") * ms("median_ms") / 1e3;
    assert!(
        (tokens - 15.0).abs() < 1e-6,
        "3 sentences × 5 target tokens, got {tokens}"
    );
    let path = common::root().join("models/transformer_tiny.kiln");
    let g = entry_graph(&path, &["vocab=48"], "train_step").expect("the entry");
    let exec = Compiled::from_graph(g).expect("compiles");
    let dims: BTreeMap<String, i64> = [("batch", 3), ("src_len", 7), ("tgt_len", 5)]
        .iter()
        .map(|(k, n)| (k.to_string(), *n))
        .collect();
    // The gradients and the loss are written straight into the returned tensors: the
    // arena is the plan's layout without their buffers.
    let plan = exec.plan();
    let external = plan.output_buffers(exec.kernel_graph());
    assert!(
        external.iter().filter(|&&x| x).count() > 10,
        "the gradients are outside"
    );
    let want = plan.layout_with(&dims, &external).expect("a layout").total;
    assert!(want < plan.layout(&dims).expect("a layout").total);
    assert!(want > 0);
    assert_eq!(v["arena_bytes"].as_u64(), Some(want as u64), "{v}");
}

/// `kiln bench --profile --json` times every kernel of the last run by kind, and every
/// matrix product by shape: the products' counts add up to the product kernels', each
/// shape's rate is its floating-point operations over its time, and the tied output
/// projection is there with the shape the step runs it at (15 target rows, d_model 32,
/// the vocabulary of 48, the embedding read transposed), with its two gradients.
#[test]
fn kiln_bench_profiles_kernel_kinds_and_matrix_products() {
    let v = bench_tiny_step_json(&["--runs", "1", "--profile"]);
    let kinds = v["profile"]["kinds"].as_object().expect("kinds");
    let kernels = |k: &str| kinds.get(k).map_or(0, |x| x["kernels"].as_u64().unwrap());
    let products = v["profile"]["products"].as_array().expect("products");
    let counted: u64 = products.iter().map(|p| p["count"].as_u64().unwrap()).sum();
    assert_eq!(
        counted,
        kernels("matmul") + kernels("linear") + kernels("linear_relu"),
        "{v}"
    );
    assert!(counted > 20, "{v}");
    for p in products.iter().filter(|p| p["ms"].as_f64() > Some(0.0)) {
        let n = |k: &str| p[k].as_f64().unwrap();
        let flops = 2.0 * n("batch") * n("m") * n("k") * n("n") * n("count");
        let rate = flops / (n("ms") / 1e3) / 1e9;
        assert!((rate / n("gflop_per_s") - 1.0).abs() < 1e-9, "{p}");
    }
    let find = |m: u64, k: u64, n: u64, at: bool, bt: bool| {
        products.iter().find(|p| {
            (p["m"].as_u64(), p["k"].as_u64(), p["n"].as_u64()) == (Some(m), Some(k), Some(n))
                && p["a_transposed"] == at
                && p["b_transposed"] == bt
                && p["batch"] == 1
        })
    };
    // logits = h·Eᵀ, dh = dlogits·E, dE = dlogitsᵀ·h.
    for (m, k, n, at, bt) in [
        (15, 32, 48, false, true),
        (15, 48, 32, false, false),
        (48, 15, 32, true, false),
    ] {
        let p = find(m, k, n, at, bt).unwrap_or_else(|| panic!("no {m}×{k}·{k}×{n} in {v}"));
        assert_eq!(p["kind"], "matmul", "{p}");
        assert!(p["count"].as_u64().unwrap() >= 1, "{p}");
    }
}

/// Attention's results are stored with their heads merged (`[b, t, h, d]`): the output
/// projection and the projections' gradients read them as rows without a copy. Before,
/// each reader copied its `[b, h, t, d]` result (144 copies, 225 MiB, in a base step).
#[test]
fn attention_results_are_stored_with_their_heads_merged() {
    let path = common::root().join("models/transformer_base.kiln");
    let sets = ["vocab=64", "d_model=32", "d_ff=64", "h=4", "n=2"];
    let g = entry_graph(&path, &sets, "train_step").expect("the entry");
    let exec = Compiled::from_graph(g.clone()).expect("compiles");
    let kg = exec.kernel_graph();
    let counts = kg.counts();
    // Every result of every attention kernel: n encoder + 2n decoder attentions, with
    // dq, dk and dv each.
    let want = counts["attention"] + 3 * counts["attention_bwd"];
    assert_eq!(counts["attention"], 6);
    assert_eq!(kg.heads_merged().len(), want, "{:?}", kg.heads_merged());
    let dims: BTreeMap<String, i64> = [("batch", 3), ("src_len", 5), ("tgt_len", 7)]
        .iter()
        .map(|(k, n)| (k.to_string(), *n))
        .collect();
    let (inputs, params) = random_feeds_with(&g, 5, &dims).expect("feeds");
    let out = exec
        .run(&inputs, &params, &RunOptions::default())
        .expect("runs");
    assert_eq!(exec.view_copies(), (0, 0), "no head is copied");
    let want = reference::run(&g, &inputs, &params, &RunOptions::default()).expect("runs");
    for ((name, a), (_, b)) in out.iter().zip(&want) {
        let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
        let max = b.iter().fold(0f64, |m, x| m.max(x.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-4 * max + 1e-6, "{name}: {diff:e} of {max:e}");
    }
}

/// Reshapes of non-contiguous views are copies outside the memory plan. Each is freed
/// after the last kernel that reads it, so what a run holds outside the arena is what was
/// live at once, not every copy; runs that reuse those buffers give the first run's bits.
/// Here each of four batched products is read transposed as rows by another product.
#[test]
fn view_copies_are_freed_after_their_last_reader() {
    use kiln_compiler::ir::{BinaryOp, DType, Op, TensorType};
    use kiln_compiler::shape::{Dim, Shape};
    use kiln_compiler::tensor::Tensor;
    let f32s = |dims: &[usize]| {
        TensorType::new(
            DType::F32,
            Shape(dims.iter().map(|&d| Dim::c(d as i64)).collect()),
        )
    };
    let mut g = Graph::new("copies");
    let x = g.add_input("x", f32s(&[4, 5, 6])).unwrap();
    let mut sum = None;
    for i in 0..4 {
        let w = g.add_input(&format!("w{i}"), f32s(&[6, 6])).unwrap();
        let v = g.add_input(&format!("v{i}"), f32s(&[24, 3])).unwrap();
        let a = g.add(Op::MatMul, &[x, w], "").unwrap();
        let t = g
            .add(
                Op::Permute {
                    perm: vec![1, 0, 2],
                },
                &[a],
                "",
            )
            .unwrap();
        let rows = g
            .add(
                Op::Reshape {
                    shape: Shape(vec![Dim::c(5), Dim::c(24)]),
                },
                &[t],
                "",
            )
            .unwrap();
        let y = g.add(Op::MatMul, &[rows, v], "").unwrap();
        sum = Some(match sum {
            None => y,
            Some(s) => g.add(Op::Binary(BinaryOp::Add), &[s, y], "").unwrap(),
        });
    }
    g.add_output("y", sum.unwrap()).unwrap();
    g.verify().unwrap();
    let exec = Compiled::from_graph(g.clone()).expect("compiles");
    let mut inputs: Feeds = BTreeMap::new();
    let mut fill = |name: String, shape: Vec<usize>, seed: usize| {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|j| ((j * 7 + seed * 13) % 17) as f32 / 8.0 - 1.0)
            .collect();
        inputs.insert(name, Tensor::f32(shape, data).unwrap());
    };
    fill("x".into(), vec![4, 5, 6], 0);
    for i in 0..4 {
        fill(format!("w{i}"), vec![6, 6], 1 + i);
        fill(format!("v{i}"), vec![24, 3], 5 + i);
    }
    let params = BTreeMap::new();
    let out = exec
        .run(&inputs, &params, &RunOptions::default())
        .expect("runs");
    let first = output_bits(&out);
    let (count, copied) = exec.view_copies();
    let held = exec.scratch_bytes();
    eprintln!("{count} view copies of {copied} bytes; {held} bytes held outside the arena");
    assert_eq!(count, 4, "each product's transposed rows are copied");
    assert!(
        held < copied,
        "{held} bytes held for {copied} bytes of copies: every copy was kept"
    );
    let want = reference::run(&g, &inputs, &params, &RunOptions::default()).expect("runs");
    let (a, b) = (
        out[0].1.to_f64_vec().unwrap(),
        want[0].1.to_f64_vec().unwrap(),
    );
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{x} against {y}");
    }
    for run in 0..2 {
        let again = output_bits(
            &exec
                .run(&inputs, &params, &RunOptions::default())
                .expect("runs"),
        );
        assert!(again == first, "run {run} reusing the buffers differs");
        assert_eq!(exec.scratch_bytes(), held, "the pool does not grow");
    }
}

/// Every output element's bits, outputs in order.
fn output_bits(out: &[(String, kiln_compiler::tensor::Tensor)]) -> Vec<u64> {
    out.iter()
        .flat_map(|(_, t)| t.to_f64_vec().expect("numeric"))
        .map(f64::to_bits)
        .collect()
}

/// The trainer runs its training step, validation and decoder programs in one arena
/// (`Exec::arena` and `Exec::share_arena`): a program run in another's arena gives the bits it
/// gives in its own, the arena is the larger layout of the two (not their sum), and the
/// first program is unaffected by what the second left there.
#[test]
fn programs_sharing_an_arena_give_the_bits_of_their_own() {
    let path = common::root().join("models/transformer_tiny.kiln");
    let train = entry_graph(&path, &["vocab=48"], "train_step").expect("the entry");
    let loss = entry_graph(&path, &["vocab=48"], "loss").expect("the entry");
    let trainer = Compiled::from_graph(train.clone()).expect("compiles");
    let alone = Compiled::from_graph(loss.clone()).expect("compiles");
    let mut shared = Compiled::from_graph(loss.clone()).expect("compiles");
    let arena = kiln_exec::executor::Exec::arena(&trainer).expect("a compiled program's arena");
    kiln_exec::executor::Exec::share_arena(&mut shared, &arena);
    let dims: BTreeMap<String, i64> = [("batch", 3), ("src_len", 7), ("tgt_len", 5)]
        .iter()
        .map(|(k, n)| (k.to_string(), *n))
        .collect();
    let (ti, tp) = random_feeds_with(&train, 5, &dims).expect("feeds");
    let (li, lp) = random_feeds_with(&loss, 6, &dims).expect("feeds");
    let opts = RunOptions::default();
    let first = output_bits(&trainer.run(&ti, &tp, &opts).expect("runs"));
    let own = output_bits(&alone.run(&li, &lp, &opts).expect("runs"));
    let in_shared = output_bits(&shared.run(&li, &lp, &opts).expect("runs"));
    assert!(in_shared == own, "the loss differs in the shared arena");
    assert!(alone.arena_bytes() < trainer.arena_bytes());
    assert_eq!(shared.arena_bytes(), trainer.arena_bytes(), "one arena");
    let again = output_bits(&trainer.run(&ti, &tp, &opts).expect("runs"));
    assert!(
        again == first,
        "the training step differs after the loss ran"
    );
}

/// A tied embedding's gradient: the output projection's weight gradient, written as the
/// `[vocab, d]` product `dlogitsᵀ·x` (`permute-matmul`), then each embedding's rows added
/// onto it in place (`scatter_add_into`), the last of them the returned gradient. The
/// compiled executor keeps the whole chain in the returned tensor, outside the arena; each
/// `scatter_add_into` equals its definition within 1e-5 on the same operands, and the
/// gradient matches the reference's.
#[test]
fn the_tied_embeddings_gradient_is_summed_in_place_into_the_returned_tensor() {
    let path = common::root().join("models/transformer_tiny.kiln");
    let dims: BTreeMap<String, i64> = [("batch", 3), ("src_len", 7), ("tgt_len", 5)]
        .iter()
        .map(|(k, n)| (k.to_string(), *n))
        .collect();
    let g = entry_graph(&path, &["vocab=2000"], "train_step").expect("the entry");
    let exec = Compiled::from_graph(g.clone()).expect("compiles");
    let (plan, kg) = (exec.plan(), exec.kernel_graph());
    let (_, out) = kg
        .outputs
        .iter()
        .find(|(n, _)| n == "grad.emb.weight")
        .expect("the embedding's gradient");
    let last = plan
        .buffer_of(kg.result_of(*out).unwrap().0, 0)
        .expect("a buffer");
    let chain = plan.chain(last);
    let kinds: Vec<String> = chain
        .iter()
        .map(|&b| {
            let v = plan.buffers[b].value;
            kg.kernels()
                .into_iter()
                .find(|(k, ..)| *k == v)
                .map(|(_, op, _)| op.kind())
                .unwrap()
        })
        .collect();
    assert_eq!(
        kinds,
        ["matmul", "scatter_add_into", "scatter_add_into"],
        "the product, then the decoder's and the encoder's embedding rows"
    );
    for &b in &chain {
        assert_eq!(plan.buffers[b].ty.shape.eval(&dims).unwrap(), [2000, 32]);
    }
    plan.check(&dims).unwrap();
    // All three live in the returned tensor: none takes arena bytes.
    let external = plan.output_buffers(kg);
    assert!(chain.iter().all(|&b| external[b]));
    let run = plan.layout_with(&dims, &external).unwrap();
    plan.check_layout(&dims, &run).unwrap();
    let mut apart = external.clone();
    for &b in &chain[..2] {
        apart[b] = false;
    }
    let inside = plan.layout_with(&dims, &apart).unwrap();
    assert!(
        inside.total >= run.total + 2000 * 32 * 4,
        "{} vs {}",
        inside.total,
        run.total
    );
    let (inputs, params) = random_feeds_with(&g, 5, &dims).expect("feeds");
    let opts = RunOptions {
        seed: 5,
        step: 2,
        ..RunOptions::default()
    };
    let got = exec.run(&inputs, &params, &opts).expect("runs");
    assert_eq!(exec.arena_bytes(), run.total);
    // Each of the two kernels against its definition on the same operands (copies of
    // the base it overwrites), at the module's 1e-5.
    let checked = Compiled::from_graph_checked(g.clone()).expect("compiles");
    let again = checked.run(&inputs, &params, &opts).expect("runs");
    let errors = checked.kernel_errors();
    let e = errors["scatter_add_into"];
    assert_eq!((e.checked, e.outside), (2, 0), "{e:?}");
    assert!(e.relative <= REL && e.absolute_small <= 1e-6, "{e:?}");
    let pick = |v: &[(String, kiln_compiler::tensor::Tensor)]| {
        v.iter()
            .find(|(n, _)| n == "grad.emb.weight")
            .and_then(|(_, t)| t.to_f64_vec())
            .unwrap()
    };
    assert_eq!(pick(&got), pick(&again), "the same bits, checked or not");
    // End to end against the reference, by the norm of the difference as every
    // gradient (see the module documentation).
    let want = reference::run(&g, &inputs, &params, &opts).expect("the reference");
    let (got, want) = (pick(&got), pick(&want));
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let d = norm(&mut want.iter().zip(&got).map(|(a, b)| a - b));
    let r = norm(&mut want.iter().copied());
    assert!(r > 1e-3, "a gradient that is not zero: {r}");
    assert!(
        d <= GRAD_NORM_REL * r,
        "grad.emb.weight: ‖got − want‖ {d:e}, ‖want‖ {r:e}"
    );
}

/// The label-smoothed cross-entropy writes the logits' gradient over the logits, which it
/// reads for the last time (`plan::in_place`): in `train_step` and in `loss` (where the
/// gradient is not even read) the two share their bytes, and the arena is smaller by a
/// logits-sized buffer than the same plan without it, with the outputs equal to the
/// reference's (`every_spec_every_entry_matches` checks the values).
#[test]
fn the_logits_gradient_is_written_over_the_logits() {
    let path = common::root().join("models/transformer_tiny.kiln");
    let dims: BTreeMap<String, i64> = [("batch", 3), ("src_len", 7), ("tgt_len", 5)]
        .iter()
        .map(|(k, n)| (k.to_string(), *n))
        .collect();
    for entry in ["train_step", "loss"] {
        let g = entry_graph(&path, &["vocab=2000"], entry).expect("the entry");
        let exec = Compiled::from_graph(g.clone()).expect("compiles");
        let plan = exec.plan();
        let over: Vec<_> = plan
            .buffers
            .iter()
            .filter_map(|b| b.in_place_of.map(|a| (&plan.buffers[a], b)))
            .collect();
        let kind_of = |v: usize| {
            exec.kernel_graph()
                .kernels()
                .into_iter()
                .find(|(k, ..)| *k == v)
                .map(|(_, op, _)| op.kind())
        };
        // (The tied embedding's gradient is summed in place too: see the next test.)
        let over: Vec<_> = over
            .into_iter()
            .filter(|(_, b)| kind_of(b.value).as_deref() == Some("xent_ls"))
            .collect();
        assert_eq!(over.len(), 1, "{entry}: one result written in place");
        let (logits, grad) = over[0];
        assert_eq!(grad.output, 1, "{entry}: the gradient");
        assert_eq!(logits.ty.shape.eval(&dims).unwrap(), [3, 5, 2000]);
        let mut apart = plan.clone();
        for b in &mut apart.buffers {
            b.in_place_of = None;
        }
        // Slots as they were planned, the gradient in one of its own.
        let i = apart
            .buffers
            .iter()
            .position(|b| b.value == grad.value && b.output == 1)
            .unwrap();
        apart.buffers[i].slot = apart.slots;
        apart.slots += 1;
        let a = plan
            .buffers
            .iter()
            .position(|b| std::ptr::eq(b, logits))
            .unwrap();
        let layout = plan.layout(&dims).unwrap();
        assert_eq!(layout.offsets[a], layout.offsets[i], "{entry}: one offset");
        plan.check(&dims).unwrap();
        // Bytes live while the cross-entropy runs: one logits-sized buffer fewer.
        let live_at = |p: &kiln_compiler::plan::MemoryPlan, s: usize| -> usize {
            p.buffers
                .iter()
                .filter(|b| b.born + usize::from(b.in_place_of.is_some()) <= s && s <= b.dies)
                .map(|b| b.bytes(&dims).unwrap())
                .sum()
        };
        let (with, without) = (live_at(plan, grad.born), live_at(&apart, grad.born));
        assert_eq!(
            without - with,
            3 * 5 * 2000 * 4,
            "{entry}: {with} vs {without}"
        );
        assert!(plan.live_peak(&dims).unwrap() <= apart.live_peak(&dims).unwrap());
        let (inputs, params) = random_feeds_with(&g, 9, &dims).expect("feeds");
        exec.run(&inputs, &params, &RunOptions::default())
            .expect("runs");
        // The executor's layout: the graph's outputs are written outside the arena.
        let external = plan.output_buffers(exec.kernel_graph());
        let run = plan.layout_with(&dims, &external).unwrap();
        assert_eq!(run.offsets[a], run.offsets[i], "{entry}: one offset");
        assert_eq!(exec.arena_bytes(), run.total, "{entry}");
    }
}

/// A decoding step reading its caches with their rows gathered (`Exec::run_map_gathered`,
/// what beam search does when the beams move) gives the bits of the same step run on
/// caches copied with `take_rows` first — rows repeated, dropped and reordered, from a
/// state with more rows than the step — and only the caches can be read that way. A row
/// outside the tensor or another input is a clear error.
#[test]
fn a_decoding_step_reads_its_caches_with_gathered_rows() {
    use kiln_decode::search::take_rows;
    use std::collections::BTreeSet;
    let path = common::root().join("models/transformer_tiny.kiln");
    let g = entry_graph(&path, &[], "decode_step").expect("the entry");
    let exec = Compiled::from_graph(g.clone()).expect("compiles");
    // The state of 5 rows; the step runs on 4 of them: [3, 0, 3, 1].
    let (old, rows) = (5usize, [3usize, 0, 3, 1]);
    let dims: BTreeMap<String, i64> = g
        .dims
        .iter()
        .map(|d| {
            let n = match d.as_str() {
                "batch" => old as i64,
                "past" => 3,
                "tgt_len" => 1,
                _ => 6,
            };
            (d.clone(), n)
        })
        .collect();
    let (state, params) = random_feeds_with(&g, 11, &dims).expect("feeds");
    let caches: BTreeSet<String> = state
        .keys()
        .filter(|k| k.starts_with(kiln_compiler::ir::CACHE_PREFIX))
        .cloned()
        .collect();
    assert!(caches.len() >= 4, "{caches:?}");
    for k in state.keys() {
        assert_eq!(exec.folds_row_gather(k), caches.contains(k), "{k}");
    }
    // Every input at 4 rows: the caches gathered by `take_rows`, the rest as it would be.
    let copied: BTreeMap<String, kiln_compiler::tensor::Tensor> = state
        .iter()
        .map(|(k, t)| (k.clone(), take_rows(t, &rows)))
        .collect();
    let mut folded = copied.clone();
    for k in &caches {
        folded.insert(k.clone(), state[k].clone());
    }
    let opts = RunOptions::default();
    let want = exec.run_map(&copied, &params, &opts).expect("runs");
    let got = exec
        .run_map_gathered(&folded, &caches, &rows, &params, &opts)
        .expect("runs gathered");
    assert_eq!(want.len(), got.len());
    for ((n, a), (m, b)) in want.iter().zip(&got) {
        assert_eq!(n, m);
        assert_eq!(a.shape, b.shape, "{n}");
        assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{n}: the same bits");
    }
    let e = exec
        .run_map_gathered(&folded, &caches, &[0, 5, 1, 2], &params, &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("row 5 is gathered") && e.contains("5 rows"),
        "{e}"
    );
    let other: BTreeSet<String> = ["tgt_in".to_string()].into();
    let e = exec
        .run_map_gathered(&folded, &other, &rows, &params, &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`tgt_in` cannot be read with its rows gathered"),
        "{e}"
    );
}

/// `encode`'s outputs equal the reference executor's, the hoisted cross-attention keys
/// among them: stored transposed (`[b, h, d_k, src]`), a view of a kernel result, which
/// the compiled executor copies out with its generated strided copy.
#[test]
fn encode_outputs_that_are_views_equal_the_reference() {
    let path = common::root().join("models/transformer_tiny.kiln");
    let g = entry_graph(&path, &[], "encode").expect("the entry");
    let exec = Compiled::from_graph(g.clone()).expect("compiles");
    let dims: BTreeMap<String, i64> = g
        .dims
        .iter()
        .map(|d| (d.clone(), if d == "batch" { 3 } else { 5 }))
        .collect();
    let (inputs, params) = random_feeds_with(&g, 7, &dims).expect("feeds");
    let opts = RunOptions::default();
    let want: BTreeMap<String, kiln_compiler::tensor::Tensor> =
        reference::run(&g, &inputs, &params, &opts)
            .expect("the reference runs")
            .into_iter()
            .collect();
    let got = exec.run_map(&inputs, &params, &opts).expect("runs");
    let keys: Vec<&String> = got
        .keys()
        .filter(|k| got[*k].shape.len() == 4 && k.starts_with("static."))
        .collect();
    assert!(!keys.is_empty(), "no hoisted keys in {:?}", got.keys());
    assert_eq!(got.len(), want.len());
    for (name, t) in &got {
        assert_eq!(t.shape, want[name].shape, "{name}");
        let (a, b) = (
            t.to_f64_vec().expect("numbers"),
            want[name].to_f64_vec().expect("numbers"),
        );
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
            .fold(0.0f64, f64::max);
        assert!(worst < 1e-5, "{name}: {worst}");
    }
}

/// A run whose values would not fit the machine is an error before anything is
/// allocated (`kiln_compiler::memory`), not an abort: here an outer product of two
/// 4 MiB vectors into a 4 TiB matrix.
#[test]
fn a_run_larger_than_the_machine_is_an_error_that_names_its_bytes() {
    use kiln_compiler::ir::{DType, Op, TensorType};
    use kiln_compiler::reference::ExecError;
    use kiln_compiler::shape::{Dim, Shape};
    use kiln_compiler::tensor::Tensor;
    let mut g = Graph::new("outer");
    g.add_dim("n");
    let n = Dim::sym("n");
    let a = g
        .add_input(
            "a",
            TensorType::new(DType::F32, Shape(vec![n.clone(), Dim::c(1)])),
        )
        .unwrap();
    let b = g
        .add_input("b", TensorType::new(DType::F32, Shape(vec![Dim::c(1), n])))
        .unwrap();
    let c = g.add(Op::MatMul, &[a, b], "").unwrap();
    g.add_output("c", c).unwrap();
    g.verify().unwrap();
    let exec = Compiled::from_graph(g).expect("compiles");
    let len = 1usize << 20;
    let inputs: Feeds = [
        (
            "a".to_string(),
            Tensor::f32(vec![len, 1], vec![1.0; len]).unwrap(),
        ),
        (
            "b".to_string(),
            Tensor::f32(vec![1, len], vec![2.0; len]).unwrap(),
        ),
    ]
    .into_iter()
    .collect();
    let err = exec
        .run(&inputs, &BTreeMap::new(), &RunOptions::default())
        .unwrap_err();
    let ExecError::Memory(oom) = &err else {
        panic!("expected a memory error, got {err}");
    };
    assert!(oom.need >= 4 << 40, "{err}");
    assert!(oom.need > oom.headroom.bytes, "{err}");
    let text = err.to_string();
    assert!(
        text.starts_with("running `outer` at n=1048576 (arena ")
            && text.contains("outputs 4.0 TiB) would allocate ")
            && text.contains("run smaller batches"),
        "{text}"
    );
    // The same program still runs at a size that fits.
    let small: Feeds = [
        (
            "a".to_string(),
            Tensor::f32(vec![3, 1], vec![1.0, 2.0, 3.0]).unwrap(),
        ),
        (
            "b".to_string(),
            Tensor::f32(vec![1, 3], vec![10.0, 20.0, 30.0]).unwrap(),
        ),
    ]
    .into_iter()
    .collect();
    let out = exec
        .run(&small, &BTreeMap::new(), &RunOptions::default())
        .unwrap();
    assert_eq!(
        out[0].1.as_f32().unwrap(),
        &[10.0, 20.0, 30.0, 20.0, 40.0, 60.0, 30.0, 60.0, 90.0]
    );
}

/// A target outside the vocabulary is an error naming it, as in the reference executor
/// (whose `one_hot` rejects it), for every entry with a loss; the padding id is not a
/// class and passes.
#[test]
fn a_target_outside_the_vocabulary_is_an_error_not_a_silent_loss() {
    fn set_target(inputs: &mut Feeds, i: usize, id: i32) {
        match &mut inputs.get_mut("tgt_out").unwrap().data {
            kiln_compiler::tensor::TensorData::I32(v) => v[i] = id,
            _ => panic!("tgt_out is i32"),
        }
    }
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_tiny.kiln");
    for entry in ["loss", "train_step"] {
        let g = entry_graph(&spec, &[], entry).unwrap();
        let exec = Compiled::from_graph(g.clone()).expect("compiles");
        let dims: BTreeMap<String, i64> = g.dims.iter().map(|d| (d.clone(), 3)).collect();
        let (mut inputs, params) = random_feeds_with(&g, 7, &dims).unwrap();
        let opts = RunOptions::default();
        // The padding id (0) anywhere is fine.
        set_target(&mut inputs, 0, 0);
        exec.run(&inputs, &params, &opts).unwrap();
        reference::run(&g, &inputs, &params, &opts).unwrap();
        set_target(&mut inputs, 4, 64);
        let e = exec.run(&inputs, &params, &opts).unwrap_err().to_string();
        assert!(
            e.contains("xent_ls: id 64 (at flat position 4) is out of range: valid ids are 0..64"),
            "{entry}: {e}"
        );
        let r = reference::run(&g, &inputs, &params, &opts)
            .unwrap_err()
            .to_string();
        assert!(
            r.contains("id 64 (at flat position 4) is out of range"),
            "{entry}: {r}"
        );
        set_target(&mut inputs, 4, -2);
        let e = exec.run(&inputs, &params, &opts).unwrap_err().to_string();
        assert!(
            e.contains("xent_ls: id -2 (at flat position 4)"),
            "{entry}: {e}"
        );
    }
}

/// base (`vocab=300`) cut to `entry` with random feeds (`seed`) at a batch of 4 and
/// lengths of 9: 36 rows, so every `linear` of 512 is past the 16-bit products' threshold.
fn base_at_36_rows(entry: &str, seed: u64) -> (Graph, BTreeMap<String, i64>, Feeds, Feeds) {
    let path = common::root().join("models/transformer_base.kiln");
    let g = entry_graph(&path, &["vocab=300"], entry).expect("the entry");
    let dims: BTreeMap<String, i64> = g
        .dims
        .iter()
        .map(|d| (d.clone(), if d == "batch" { 4 } else { 9 }))
        .collect();
    let (inputs, params) = random_feeds_with(&g, seed, &dims).expect("feeds");
    (g, dims, inputs, params)
}

/// `--gemm-type` / `set_bf16_kernel`: the large matrix products in bf16, on AMX tiles
/// and with AVX-512's `VDPBF16PS`, and in scaled fp16 with AVX512-FP16's `VFMADD231PH`,
/// each where the CPU has it. On base at small sizes
/// (every `linear` over 36 rows of 512 is past the threshold) the forward's logits and
/// `train_step`'s loss and gradients stay within bf16's rounding of the f32 program's —
/// and are not its bits (the products really are bf16) — and a second run gives the same
/// bits. Each kernel is skipped where the CPU cannot run it.
#[test]
fn bf16_products_stay_within_bf16_of_f32_and_repeat_bit_for_bit() {
    use kiln_exec::compiled::Kernel16;
    for kernel in Kernel16::SIXTEEN_BIT {
        match kernel.available() {
            Ok(()) => bf16_products_within_bf16_of_f32(kernel),
            Err(why) => println!("skipped: {why}"),
        }
    }
}

fn bf16_products_within_bf16_of_f32(kernel: kiln_exec::compiled::Kernel16) {
    for entry in ["forward", "train_step"] {
        let (g, _, inputs, params) = base_at_36_rows(entry, 11);
        let f32_exec = Compiled::from_graph(g.clone()).expect("compiles");
        let mut bf16_exec = Compiled::from_graph(g.clone()).expect("compiles");
        bf16_exec
            .set_bf16_kernel(Some(kernel))
            .expect("the kernel runs here");
        assert!(bf16_exec.bf16_products() && !f32_exec.bf16_products());
        assert_eq!(bf16_exec.bf16_kernel(), Some(kernel));
        let opts = RunOptions {
            seed: 2,
            ..RunOptions::default()
        };
        let want = f32_exec.run(&inputs, &params, &opts).expect("runs");
        let got = bf16_exec.run(&inputs, &params, &opts).expect("runs");
        let again = bf16_exec.run(&inputs, &params, &opts).expect("runs");
        assert_eq!(
            output_bits(&got),
            output_bits(&again),
            "{entry}: a second run"
        );
        let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
        let vals = |t: &kiln_compiler::tensor::Tensor| t.to_f64_vec().expect("f32");
        // The key projection's bias has a gradient of zero in exact arithmetic (a
        // constant added to a row's scores leaves its softmax alone): in both programs it
        // is rounding noise, so each gradient is measured against a floor of 1e-3 of the
        // largest gradient's norm.
        let floor = 1e-3
            * want
                .iter()
                .map(|(_, t)| norm(&mut vals(t).into_iter()))
                .fold(0.0, f64::max);
        for ((name, w), (_, o)) in want.iter().zip(&got) {
            let (w, o) = (vals(w), vals(o));
            let diff = norm(&mut w.iter().zip(&o).map(|(a, b)| a - b));
            let rel = diff / norm(&mut w.iter().copied()).max(floor);
            println!("{kernel:?} {entry} {name}: ‖bf16 − f32‖ / ‖f32‖ = {rel:.2e}");
            // bf16 keeps 8 bits: 2^-9 relative per operand; measured 8e-3 on the logits,
            // 2e-4 on the loss and 0.3–8 % on the gradients (the first layers' most).
            let tol = if name.starts_with("grad.") {
                0.15
            } else {
                2e-2
            };
            assert!(
                rel < tol,
                "{kernel:?} {entry} {name}: {rel:e} from the f32 program"
            );
            assert!(
                diff > 1e-6 * norm(&mut w.iter().copied()),
                "{kernel:?} {entry} {name}: the products look f32"
            );
        }
    }
}

/// `g` compiled with the options `set` makes of the defaults and run once by a compiled
/// executor with 16-bit products on `kernel`: the outputs and the executor (for its
/// counts).
fn run_16bit(
    g: &Graph,
    kernel: kiln_exec::compiled::Kernel16,
    (inputs, params): (&Feeds, &Feeds),
    opts: &RunOptions,
    set: impl FnOnce(&mut CompileOptions),
) -> (Vec<(String, kiln_compiler::tensor::Tensor)>, Compiled) {
    let mut options = CompileOptions::default();
    set(&mut options);
    let mut exec = Compiled::from_graph_with(g.clone(), &options).expect("compiles");
    exec.set_bf16_kernel(Some(kernel))
        .expect("the kernel runs here");
    let out = exec.run(inputs, params, opts).expect("runs");
    (out, exec)
}

/// With 16-bit products, each bias gradient of base's training step (96: 6 + 6 layers'
/// attention and FFN biases) is summed by its weight gradient's product as that packs
/// `dy`, with no `sum_rows` launch, and every output keeps the bits of the program that
/// runs the `sum_rows` kernels (compiled without `bias_grad_fusion`); in f32 they all run as
/// kernels. Each 16-bit kernel is skipped where the CPU cannot run it.
#[test]
fn bias_gradients_summed_by_their_products_keep_the_sum_rows_bits() {
    use kiln_exec::compiled::Kernel16;
    let (g, dims, inputs, params) = base_at_36_rows("train_step", 5);
    let opts = RunOptions {
        seed: 3,
        ..RunOptions::default()
    };
    let f32_exec = Compiled::from_graph(g.clone()).expect("compiles");
    f32_exec.run(&inputs, &params, &opts).expect("runs");
    assert_eq!(f32_exec.bias_grad_counts(), (0, 96), "f32");
    for kernel in Kernel16::SIXTEEN_BIT {
        if let Err(why) = kernel.available() {
            println!("skipped: {why}");
            continue;
        }
        let run = |separate: bool| {
            let feeds = (&inputs, &params);
            let (out, exec) =
                run_16bit(&g, kernel, feeds, &opts, |e| e.bias_grad_fusion = !separate);
            (out, exec.bias_grad_counts())
        };
        let (fused, counts) = run(false);
        assert_eq!(counts, (96, 0), "{kernel:?}: summed by the products");
        let (separate, counts) = run(true);
        assert_eq!(counts, (0, 0), "{kernel:?}: separate, none paired");
        for ((name, a), (_, b)) in fused.iter().zip(&separate) {
            let (a, b) = (a.to_f64_vec().expect("f32"), b.to_f64_vec().expect("f32"));
            assert_eq!(a.len(), b.len(), "{kernel:?}: {name}");
            if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
                panic!(
                    "{kernel:?}: {name}[{i}] is {:e} summed by the product, {:e} by sum_rows",
                    a[i], b[i]
                );
            }
        }
        assert!(
            fused.iter().any(|(n, _)| n.ends_with(".b")),
            "a bias gradient"
        );
        // The tiny model's products are all too small for 16 bits: each `sum_rows` left
        // for its product then runs after it, with the same bits.
        let tiny = entry_graph(
            &common::root().join("models/transformer_tiny.kiln"),
            &[],
            "train_step",
        )
        .expect("the entry");
        let (inputs, params) = random_feeds_with(&tiny, 5, &dims).expect("feeds");
        let runs: Vec<_> = [false, true]
            .into_iter()
            .map(|separate| {
                let feeds = (&inputs, &params);
                let (out, exec) = run_16bit(&tiny, kernel, feeds, &opts, |e| {
                    e.bias_grad_fusion = !separate
                });
                (output_bits(&out), exec.bias_grad_counts())
            })
            .collect();
        assert_eq!(runs[1].1, (0, 0), "{kernel:?}: tiny, none paired");
        assert!(
            runs[0].1 .0 == 0 && runs[0].1 .1 > 0,
            "{kernel:?}: tiny {:?}",
            runs[0].1
        );
        assert!(runs[0].0 == runs[1].0, "{kernel:?}: tiny's outputs");
    }
}

/// With 16-bit products, consecutive products of one left operand run as one group that
/// packs it once. `linear` kernels in base: each layer's query, key and value
/// projections (6 encoder and 6 decoder self-attention groups of 3) and the decoder
/// layers' cross-attention keys and values of the encoder's output — a pair a layer in
/// the forward's schedule (18 groups of 48 kernels a run), in the training step's the
/// first layer's pair and the other five layers' side by side (14 groups of 48). Weight
/// gradients `xᵀ·dy` with their bias gradients' column sums: in the training step the
/// keys' and values' of each self-attention and of the first decoder layer's
/// cross-attention, adjacent in the schedule (13 pairs; 27 groups of 74 kernels in all).
/// Every output of the forward (with weights packed beforehand or not) and of the
/// training step, with biases of their own, keeps the bits of running each kernel on its
/// own (compiled without `product_groups`). Each 16-bit kernel is skipped where the CPU cannot run
/// it.
#[test]
fn products_of_one_left_operand_run_as_one_group_with_their_own_bits() {
    use kiln_exec::compiled::Kernel16;
    for kernel in Kernel16::SIXTEEN_BIT {
        if let Err(why) = kernel.available() {
            println!("skipped: {why}");
            continue;
        }
        for entry in ["forward", "train_step"] {
            let (g, _, inputs, mut params) = base_at_36_rows(entry, 7);
            // Biases of their own (initialized to zeros), so that a member given
            // another's bias, or none, changes its result.
            let mut seed = 11u64;
            for t in params.values_mut() {
                let v = t.to_f64_vec().expect("f32");
                if v.iter().all(|&x| x == 0.0) {
                    let v: Vec<f32> = (0..v.len())
                        .map(|_| {
                            seed = seed
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                        })
                        .collect();
                    *t =
                        kiln_compiler::tensor::Tensor::f32(t.shape.clone(), v).expect("same shape");
                }
            }
            for version in [None, Some(kiln_exec::executor::fresh_params_version())] {
                if version.is_some() && entry == "train_step" {
                    continue;
                }
                let opts = RunOptions {
                    seed: 3,
                    params_version: version,
                    ..RunOptions::default()
                };
                let run = |separate: bool| {
                    let feeds = (&inputs, &params);
                    let (out, exec) =
                        run_16bit(&g, kernel, feeds, &opts, |e| e.product_groups = !separate);
                    (output_bits(&out), exec.product_groups())
                };
                let what = format!("{kernel:?} {entry} packed {}", version.is_some());
                let (grouped, counts) = run(false);
                let want = if entry == "forward" {
                    (18, 48)
                } else {
                    (27, 74)
                };
                assert_eq!(counts, want, "{what}: grouped");
                let (separate, counts) = run(true);
                assert_eq!(counts, (0, 0), "{what}: separate");
                assert!(grouped == separate, "{what}: the outputs differ");
            }
        }
    }
}

/// An inference program with bf16 products, run on unchanged parameters (one
/// `params_version`), packs each weight once, at its first product, and reads the packed
/// copy from then on: base's forward at 36 rows has 97 products, all past the bf16
/// threshold, each with a weight of its own (the tied output projection reads the
/// embedding transposed). The packed copies give the bits of packing for each product;
/// a training step packs none. Each kernel is skipped where the CPU cannot run it.
#[test]
fn bf16_products_pack_each_weight_once_a_version_with_the_same_bits() {
    use kiln_exec::compiled::Kernel16;
    let (g, _, inputs, params) = base_at_36_rows("forward", 5);
    // The weights' elements: 24 + 48 attention projections of 512 × 512 (encoder, and
    // decoder self and cross), 12 + 12 of 512 × 2048 and 2048 × 512, the 300 × 512
    // embedding.
    let elements = 72 * 512 * 512 + 24 * 512 * 2048 + 300 * 512;
    for kernel in Kernel16::SIXTEEN_BIT {
        if let Err(why) = kernel.available() {
            println!("skipped: {why}");
            continue;
        }
        let mut exec = Compiled::from_graph(g.clone()).expect("compiles");
        exec.set_bf16_kernel(Some(kernel))
            .expect("the kernel runs here");
        let plain = output_bits(
            &exec
                .run(&inputs, &params, &RunOptions::default())
                .expect("runs"),
        );
        assert_eq!(
            exec.packed_weights(),
            (0, 0),
            "{kernel:?}: no version, no copies"
        );
        let fixed = RunOptions {
            params_version: Some(kiln_exec::executor::fresh_params_version()),
            ..RunOptions::default()
        };
        for run in 0..2 {
            let got = output_bits(&exec.run(&inputs, &params, &fixed).expect("runs"));
            assert!(
                got == plain,
                "{kernel:?}: run {run} on a fixed version differs"
            );
            let (count, bytes) = exec.packed_weights();
            assert_eq!(count, 97, "{kernel:?}: after run {run}");
            // 16 bits with the panels' padding (k to 32, n to 32 columns; int16: k to
            // pairs, n to 16 columns) and, in fp16 and int16, the columns' scales: at
            // least two bytes an element, and little more.
            assert!(
                bytes >= 2 * elements && bytes < 2 * elements + 2 * elements / 10,
                "{kernel:?}: {bytes} bytes packed for {elements} elements"
            );
        }
    }

    let Some(kernel) = Kernel16::SIXTEEN_BIT
        .into_iter()
        .find(|k| k.available().is_ok())
    else {
        return;
    };
    let (g, _, inputs, params) = base_at_36_rows("train_step", 5);
    let mut exec = Compiled::from_graph(g.clone()).expect("compiles");
    exec.set_bf16_kernel(Some(kernel))
        .expect("the kernel runs here");
    let fixed = RunOptions {
        params_version: Some(kiln_exec::executor::fresh_params_version()),
        ..RunOptions::default()
    };
    exec.run(&inputs, &params, &fixed).expect("runs");
    assert_eq!(
        exec.packed_weights(),
        (0, 0),
        "a training step packs no weight"
    );
}

/// With int16 products, a product whose weight is packed beforehand (an inference
/// program on a `params_version`, as decoding runs) takes the 16-bit kernel from 65536
/// multiply-adds instead of 4M, since only its left operand is then packed at the call:
/// base's forward at 4 rows (batch 1, lengths 4) has 97 products of at least 4 × 512 ·
/// 512 × 300, all on packed weights, of which only the 24 feed-forward ones (4 × 512 ·
/// 512 × 2048 and back) reach 4M. Its logits then move from the unversioned run's (which
/// runs the rest in f32) by int16's rounding, and stay within 1e-2 of the f32
/// program's. Skipped where the CPU has no int16 kernel.
#[test]
fn int16_products_of_few_rows_run_16bit_on_weights_packed_beforehand() {
    use kiln_exec::compiled::Kernel16;
    if let Err(why) = Kernel16::Int16.available() {
        println!("skipped: {why}");
        return;
    }
    let path = common::root().join("models/transformer_base.kiln");
    let g = entry_graph(&path, &["vocab=300"], "forward").expect("the entry");
    let dims: BTreeMap<String, i64> = g
        .dims
        .iter()
        .map(|d| (d.clone(), if d == "batch" { 1 } else { 4 }))
        .collect();
    let (inputs, params) = random_feeds_with(&g, 3, &dims).expect("feeds");
    let f32_out = Compiled::from_graph(g.clone())
        .expect("compiles")
        .run(&inputs, &params, &RunOptions::default())
        .expect("runs");
    let mut exec = Compiled::from_graph(g.clone()).expect("compiles");
    exec.set_bf16_kernel(Some(Kernel16::Int16))
        .expect("the kernel runs here");
    let plain = exec
        .run(&inputs, &params, &RunOptions::default())
        .expect("runs");
    assert_eq!(exec.packed_weights().0, 0, "no version, no copies");
    let fixed = RunOptions {
        params_version: Some(kiln_exec::executor::fresh_params_version()),
        ..RunOptions::default()
    };
    let packed = exec.run(&inputs, &params, &fixed).expect("runs");
    assert_eq!(exec.packed_weights().0, 97, "every product's weight packed");
    let again = exec.run(&inputs, &params, &fixed).expect("runs");
    assert!(output_bits(&again) == output_bits(&packed), "a second run");
    let logits = |out: &[(String, kiln_compiler::tensor::Tensor)]| {
        out.iter()
            .find(|(n, _)| n == "logits")
            .expect("the logits")
            .1
            .to_f64_vec()
            .expect("f32")
    };
    let (want, plain, packed) = (logits(&f32_out), logits(&plain), logits(&packed));
    let dist = |a: &[f64], b: &[f64]| {
        let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        d.sqrt() / want.iter().map(|x| x * x).sum::<f64>().sqrt()
    };
    let (moved, from_f32) = (dist(&packed, &plain), dist(&packed, &want));
    println!("‖packed − unversioned‖ = {moved:.2e}, ‖packed − f32‖ = {from_f32:.2e} (relative)");
    assert!(
        moved > 1e-6,
        "the small products stayed f32 on packed weights"
    );
    assert!(from_f32 < 1e-2, "{from_f32:e} from the f32 program");
}

/// `matmul16`, the public product, with each kernel the CPU can run: a slice of the
/// wrong length is an error that names it (checked after the kernel, so where the CPU
/// cannot run it that is the error); a product of 2 × 3 · 3 × 2 exact in bf16 gives exact
/// sums.
#[test]
fn bf16_matmul_checks_its_slices() {
    use kiln_exec::compiled::{matmul16, Kernel16};
    let (a, b) = (
        [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0],
        [1.0f32, 0.5, -1.0, 2.0, 0.25, 4.0],
    );
    for kernel in Kernel16::SIXTEEN_BIT {
        let mut c = [0f32; 4];
        match matmul16(kernel, (2, 3, 2), &a, &b, &mut c) {
            Err(e) => {
                assert!(
                    e.starts_with(&format!("{} cannot run here: ", kernel.name())),
                    "{e}"
                );
                println!("skipped: {e}");
                continue;
            }
            Ok(()) => assert_eq!(c, [-0.25, 16.5, 0.5, 36.0], "{kernel:?}"),
        }
        let e = matmul16(kernel, (2, 3, 2), &a[..5], &b, &mut c).unwrap_err();
        assert_eq!(e, "`a` holds 5 elements; a 2×3·3×2 product needs 6");
    }
}
