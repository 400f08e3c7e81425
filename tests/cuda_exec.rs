//! The CUDA executor (`kiln_exec::cuda::CudaExecutor`) on a `--target cuda` artifact
//! of `models/transformer_tiny.kiln`.
//!
//! Without a GPU: building it fails with the guard's reason and points at the CPU
//! executor (never a panic), every kernel of every entry has a GPU launch, and the
//! artifact-level errors are named. With a GPU (skipped here unless
//! `KILN_REQUIRE_CUDA=1`): every entry matches the CPU compiled executor within
//! `1e-5·max + 1e-6`, and so do consecutive training steps. `cuda_emulated.rs` runs
//! these same tests on the host emulation of the device (`KILN_CUDA_EMULATE=1`).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{cuda_available, kiln, require_cuda_or_skip};
use kiln_compiler::codegen::cuda::Library;
use kiln_compiler::optimize::validate::{random_feeds_with, Feeds};
use kiln_compiler::reference::RunOptions;
use kiln_compiler::tensor::{Tensor, TensorData};
use kiln_exec::artifact::Artifact;
use kiln_exec::cuda::{
    emulate, executor_for, launch_plan, memory_plan, precision_label, program_source,
    CudaExecError, CudaExecutor, CudaOptions,
};
use kiln_exec::executor::{DeviceResident, Exec};

const SPEC: &str = "models/transformer_tiny.kiln";
const ENTRIES: [&str; 4] = ["train_step", "loss", "encode", "decode_step"];

fn tmp(name: &str) -> PathBuf {
    // The emulated device's runs (`cuda_emulated.rs`) apart from the plain ones, which
    // may run at the same time.
    let kind = if common::emulated() {
        "cuda_emulated"
    } else {
        "cuda_exec"
    };
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{kind}_{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn compile(dir: &Path, target: &str) -> Artifact {
    compile_spec(dir, SPEC, &["vocab=48"], target)
}

/// `spec` with `sets` compiled for `target` (`cuda`, or `cuda:PRECISION`) with the four
/// entries into `dir/art`.
fn compile_spec(dir: &Path, spec: &str, sets: &[&str], target: &str) -> Artifact {
    let art = dir.join("art");
    let mut args = vec!["compile", spec];
    for s in sets {
        args.extend(["--set", s]);
    }
    let entries = ENTRIES.join(",");
    let (target, precision) = target.split_once(':').unwrap_or((target, "f32"));
    args.extend(["--entries", &entries, "--target", target]);
    args.extend(["--precision", precision, "-o"]);
    args.push(art.to_str().unwrap());
    let out = kiln(&args);
    assert!(
        out.status.success(),
        "kiln compile failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Artifact::load(&art).unwrap()
}

/// The tiny model's CUDA artifact (f32), compiled once per test process.
fn cuda_artifact() -> &'static Artifact {
    artifact_in("f32")
}

/// The tiny model's CUDA artifact compiled with `--precision precision`, once per test
/// process and precision, in a directory of its own: a runner that starts a process per
/// test (`cargo nextest`) would otherwise have one process clear the artifact another is
/// reading. Those of processes a day old are removed.
fn artifact_in(precision: &str) -> &'static Artifact {
    static ARTS: std::sync::Mutex<BTreeMap<String, &'static Artifact>> =
        std::sync::Mutex::new(BTreeMap::new());
    let mut arts = ARTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(a) = arts.get(precision) {
        return a;
    }
    let dir = tmp(&format!("cuda-{precision}.{}", std::process::id()));
    let day = std::time::Duration::from_secs(86_400);
    let own = dir.file_name().unwrap().to_string_lossy().into_owned();
    let prefix = &own[..=own.rfind('.').unwrap()];
    for e in std::fs::read_dir(dir.parent().unwrap()).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|a| a > day));
        if name.starts_with(prefix) && old {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    let art: &'static Artifact = Box::leak(Box::new(compile(&dir, &format!("cuda:{precision}"))));
    arts.insert(precision.to_string(), art);
    art
}

#[test]
fn without_cuda_building_names_the_reason_and_the_cpu_executor() {
    let art = cuda_artifact();
    let Err(reason) = cuda_available() else {
        println!("skipped: CUDA is available here");
        return;
    };
    for entry in ENTRIES {
        let e = CudaExecutor::from_artifact_entry(art, entry).unwrap_err();
        assert!(
            matches!(&e, CudaExecError::Unavailable { entry: n, reason: r } if n == entry && r == &reason),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(text.starts_with("CUDA is not available: "), "{text}");
        assert!(text.contains(&format!("entry `{entry}`")), "{text}");
        assert!(text.contains("CPU compiled executor"), "{text}");
        // The CLI's entry point says the same.
        let e = executor_for(art, entry)
            .err()
            .expect("no executor without CUDA");
        assert_eq!(e, text);
    }
}

#[test]
fn artifact_errors_come_before_the_guard() {
    let art = cuda_artifact();
    let e = CudaExecutor::from_artifact_entry(art, "no_such_entry").unwrap_err();
    assert!(matches!(e, CudaExecError::Artifact(_)), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("no_such_entry") && text.contains("`encode`"),
        "{text}"
    );
    let cpu = compile(&tmp("cpu"), "cpu");
    let e = CudaExecutor::from_artifact_entry(&cpu, "encode").unwrap_err();
    assert!(matches!(e, CudaExecError::Artifact(_)), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("entry `encode` has no CUDA code")
            && text.contains("target is `cpu`")
            && text.contains("--target cuda"),
        "{text}"
    );
    assert!(launch_plan(&cpu, "encode").is_err());
}

#[test]
fn every_kernel_of_the_tiny_model_has_a_gpu_launch() {
    let art = cuda_artifact();
    let mut seen = BTreeMap::<&str, usize>::new();
    for entry in ENTRIES {
        let plan = launch_plan(art, entry).unwrap_or_else(|e| panic!("{entry}: {e}"));
        let e = art.entry(entry).unwrap();
        let launches = &e.manifest.cuda.as_ref().unwrap().kernels;
        assert_eq!(plan.len(), launches.len(), "{entry}");
        assert_eq!(plan.len(), e.manifest.kernel_graph.kernels().len());
        for ((kind, how), l) in plan.iter().zip(launches) {
            assert_eq!(kind, &l.kind);
            let want = match &l.library {
                Some(Library::Host) => "host",
                Some(Library::Attention { .. })
                    if l.functions.contains_key("flash") || l.functions.contains_key("flash_q") =>
                {
                    "flash"
                }
                Some(Library::Attention { .. }) => "attention",
                // Integer matmuls would go to the host; the tiny model has none.
                Some(Library::Gemm { .. }) => "gemm",
                None => "generated",
            };
            assert_eq!(*how, want, "{entry}: {kind}");
            *seen.entry(how).or_default() += 1;
        }
    }
    // The tiny model exercises every device path: generated kernels, cuBLAS and flash
    // attention (its heads are small). Its training step never leaves the device: the
    // tied embedding's gradient (its rows added onto the projection's, `scatter_add_into`)
    // is a generated kernel too.
    let train = launch_plan(art, "train_step").unwrap();
    assert!(
        train
            .iter()
            .any(|(k, how)| k == "scatter_add_into" && *how == "generated"),
        "{train:?}"
    );
    assert!(train.iter().all(|(_, how)| *how != "host"), "{train:?}");
    for how in ["generated", "gemm", "flash"] {
        assert!(
            seen.get(how).copied().unwrap_or(0) > 0,
            "no `{how}` kernel: {seen:?}"
        );
    }
}

/// Mixed precision (`kiln compile --precision mixed`): every entry's bf16 program is the
/// artifact's own CUDA C (another program than the f32 one), prepares without a GPU, each
/// kernel running as it does in f32 (flash attention included), and plans its bf16
/// activations in 2-byte elements; an entry that is not in the artifact is named.
#[test]
fn every_kernel_of_the_tiny_model_has_a_mixed_precision_launch() {
    let (art, mixed) = (cuda_artifact(), artifact_in("mixed"));
    assert_eq!(
        precision_label(mixed.manifest.options.precision),
        "mixed-bf16"
    );
    for entry in ENTRIES {
        let f32_plan = launch_plan(art, entry).unwrap();
        let plan = launch_plan(mixed, entry).unwrap_or_else(|e| panic!("{entry}: {e}"));
        assert_eq!(plan, f32_plan, "{entry}");
        let cu = |a: &Artifact| std::fs::read_to_string(a.dir.join(format!("kernels/{entry}.cu")));
        let text = cu(mixed).unwrap();
        assert_eq!(program_source(mixed, entry).unwrap(), text, "{entry}");
        assert!(text.contains("kiln_bf16"), "{entry}: no bf16 in its CUDA C");
        assert_ne!(text, cu(art).unwrap(), "{entry}");
        // The f32 program runs in the artifact's memory plan; the mixed one plans its bf16
        // activations in 2-byte elements.
        let manifest = &art.entry(entry).unwrap().manifest.plan;
        assert_eq!(&memory_plan(art, entry).unwrap(), manifest);
        let halves = memory_plan(mixed, entry)
            .unwrap()
            .buffers
            .iter()
            .filter(|b| b.elem_bytes == 2)
            .count();
        assert!(halves > 3, "{entry}: {halves} two-byte buffers");
    }
    let e = launch_plan(mixed, "no_such_entry").unwrap_err();
    assert!(e.to_string().contains("no_such_entry"), "{e}");
}

// ---------------------------------------------------------------------------------------
// GPU tests (skipped without CUDA)

fn feeds(g: &kiln_compiler::Graph, art: &Artifact, seed: u64) -> (Feeds, Feeds) {
    feeds_sized(g, art, seed, &[2, 5, 3, 2])
}

/// [`feeds`] with the graph's dims taking `sizes` in turn.
fn feeds_sized(
    g: &kiln_compiler::Graph,
    art: &Artifact,
    seed: u64,
    sizes: &[i64],
) -> (Feeds, Feeds) {
    let dims: BTreeMap<String, i64> = g
        .dims
        .iter()
        .enumerate()
        .map(|(i, d)| (d.clone(), sizes[i % sizes.len()]))
        .collect();
    let (inputs, random_params) = random_feeds_with(g, seed, &dims).unwrap();
    let weights = art.weights().unwrap();
    let params = random_params
        .keys()
        .map(|k| (k.clone(), weights[k].clone()))
        .collect();
    (inputs, params)
}

fn as_f64(t: &Tensor) -> Vec<f64> {
    match &t.data {
        TensorData::F32(v) => v.iter().map(|&x| x as f64).collect(),
        TensorData::I32(v) => v.iter().map(|&x| x as f64).collect(),
        TensorData::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
        other => panic!("a {} output", other.dtype_name()),
    }
}

/// `(‖want − got‖₂, ‖want‖₂)`.
fn l2_distance(want: &[f64], got: &[f64]) -> (f64, f64) {
    let norm = want.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff = want
        .iter()
        .zip(got)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt();
    (diff, norm)
}

/// Mismatches of `got` against `want` beyond `1e-5·max|want| + 1e-6`.
fn mismatches(entry: &str, want: &[(String, Tensor)], got: &[(String, Tensor)]) -> Vec<String> {
    let mut bad = Vec::new();
    assert_eq!(want.len(), got.len());
    for ((n, w), (m, g)) in want.iter().zip(got) {
        assert_eq!(n, m);
        if w.shape != g.shape {
            bad.push(format!("{entry}.{n}: shape {:?} vs {:?}", g.shape, w.shape));
            continue;
        }
        let (w, g) = (as_f64(w), as_f64(g));
        let max = w.iter().fold(0f64, |a, x| a.max(x.abs()));
        let diff = w.iter().zip(&g).fold(0f64, |a, (x, y)| {
            if (x - y).is_nan() {
                f64::NAN
            } else {
                a.max((x - y).abs())
            }
        });
        if diff.is_nan() || diff > 1e-5 * max + 1e-6 {
            bad.push(format!("{entry}.{n}: max diff {diff:e}, max |cpu| {max:e}"));
        }
    }
    bad
}

/// How many kernels of a kind ran each way over the entries: `(fused, separate)`.
type Counts = (usize, usize);

/// Every entry on the GPU with `options` against the CPU executor on the same random
/// feeds (`seed`, dropout step `step`): the mismatches, the `linear` kernels with a bias
/// that ran (fused, separate), and the bias gradients paired with a weight-gradient GEMM
/// (summed in its epilogue, by their own kernel).
fn entries_vs_cpu(options: CudaOptions, seed: u64, step: u32) -> (Vec<String>, Counts, Counts) {
    let art = cuda_artifact();
    let (mut bad, mut counts, mut grads) = (Vec::new(), (0, 0), (0, 0));
    for entry in ENTRIES {
        let gpu = CudaExecutor::with_options(art, entry, options).unwrap_or_else(|e| panic!("{e}"));
        let cpu = art.executor(entry).unwrap();
        let (inputs, params) = feeds(cpu.graph(), art, seed);
        let opts = RunOptions {
            seed,
            step,
            ..RunOptions::default()
        };
        let want = cpu.run(&inputs, &params, &opts).unwrap();
        let got = Exec::run(&gpu, &inputs, &params, &opts).unwrap();
        let tag = if options.separate_epilogues {
            " (separate epilogues)"
        } else {
            ""
        };
        bad.extend(mismatches(&format!("{entry}{tag}"), &want, &got));
        let (f, s) = gpu.epilogue_counts();
        counts.0 += f;
        counts.1 += s;
        let (f, s) = gpu.bias_grad_counts();
        grads.0 += f;
        grads.1 += s;
    }
    (bad, counts, grads)
}

/// Every spec whose kernels differ from the tiny model's (`common::DISTINCT_SPECS`: base,
/// big, parsing, one head, `d_k ≠ d_v`, no dropout, learned positions), one layer of
/// each with an FFN of 128 and a vocabulary of 48: every entry on the GPU against the
/// CPU executor on the same random feeds, within `1e-5·max + 1e-6`, the gradients of
/// `train_step` within `1e-2` in relative L2 norm (a ReLU input within rounding of zero
/// may fall on either side in two correct executors; `tests/compiled.rs` says more).
#[test]
fn gpu_every_distinct_spec_matches_the_cpu_executor() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    use rayon::prelude::*;
    let specs: Vec<&str> = common::DISTINCT_SPECS
        .into_iter()
        .filter(|&n| n != "transformer_tiny.kiln") // every other test here
        .collect();
    // Specs in parallel: compiling them is most of the time (launches take turns).
    let bad: Vec<String> = specs
        .par_iter()
        .flat_map(|&name| spec_vs_cpu(name))
        .collect();
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The mismatches of spec `name` (see `gpu_every_distinct_spec_matches_the_cpu_executor`).
fn spec_vs_cpu(name: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let spec = common::SPEC_DIRS
        .iter()
        .map(|d| format!("{d}/{name}"))
        .find(|p| common::root().join(p).exists())
        .unwrap_or_else(|| panic!("no {name} under models/"));
    let dir = tmp(&format!("spec_{}", name.trim_end_matches(".kiln")));
    let art = compile_spec(&dir, &spec, &["vocab=48", "n=1", "d_ff=128"], "cuda");
    for entry in ENTRIES {
        let gpu = CudaExecutor::from_artifact_entry(&art, entry)
            .unwrap_or_else(|e| panic!("{name} {entry}: {e}"));
        let cpu = art.executor(entry).unwrap();
        let (inputs, params) = feeds(cpu.graph(), &art, 21);
        let opts = RunOptions {
            seed: 21,
            step: 1,
            ..RunOptions::default()
        };
        let want = cpu.run(&inputs, &params, &opts).unwrap();
        let got = Exec::run(&gpu, &inputs, &params, &opts).unwrap();
        let is_grad = |n: &str| n.starts_with("grad.");
        let plain = |v: &[(String, Tensor)]| -> Vec<(String, Tensor)> {
            v.iter().filter(|(n, _)| !is_grad(n)).cloned().collect()
        };
        bad.extend(mismatches(
            &format!("{name} {entry}"),
            &plain(&want),
            &plain(&got),
        ));
        for ((n, w), (_, g)) in want.iter().zip(&got).filter(|((n, _), _)| is_grad(n)) {
            let (diff, norm) = l2_distance(&as_f64(w), &as_f64(g));
            if diff.is_nan() || diff > 1e-2 * norm + 1e-6 {
                bad.push(format!(
                    "{name} {entry}.{n}: ‖gpu − cpu‖₂ {diff:e}, ‖cpu‖₂ {norm:e}"
                ));
            }
        }
    }
    bad
}

/// Sentences longer than the one-block attention backward's tile (32 rows) take the
/// two-kernel flash backward (`flash_q`, then `flash_kv` over a statistics scratch); the
/// short ones of the other tests take the one-block kernel. Both match the CPU.
#[test]
fn gpu_long_sentences_match_the_cpu_executor() {
    use kiln_compiler::codegen::cuda::attention::fits_short;
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = cuda_artifact();
    let entry = "train_step";
    let gpu = CudaExecutor::from_artifact_entry(art, entry).unwrap();
    let cpu = art.executor(entry).unwrap();
    let g = cpu.graph();
    let sizes = [2i64, 37, 34, 2];
    let lens: Vec<i64> = (0..g.dims.len()).map(|i| sizes[i % sizes.len()]).collect();
    assert_eq!(g.dims[..3], ["batch", "src_len", "tgt_len"], "{:?}", g.dims);
    assert!(
        !fits_short(37, 37, 8, 8) && !fits_short(34, 37, 8, 8),
        "{lens:?}"
    );
    let (inputs, params) = feeds_sized(g, art, 17, &sizes);
    let opts = RunOptions {
        seed: 17,
        step: 2,
        ..RunOptions::default()
    };
    let want = cpu.run(&inputs, &params, &opts).unwrap();
    let got = Exec::run(&gpu, &inputs, &params, &opts).unwrap();
    let bad = mismatches("train_step at lengths 37 and 34", &want, &got);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn gpu_every_entry_matches_the_cpu_executor() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let (bad, _, _) = entries_vs_cpu(CudaOptions::default(), 11, 3);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// `linear` and `linear_relu` run by default as one cuBLASLt GEMM with a bias (+ ReLU)
/// epilogue, and with `separate_epilogues` as a bias fill, a GEMM and a ReLU pass: both
/// match the CPU executor on every entry (fp32, within 1e-5), the default fuses some, and
/// the separate path fuses none. The same for the bias gradients: by default the
/// weight-gradient GEMM sums them in its epilogue where cuBLASLt has an algorithm (the
/// emulated device always has one, unless told to refuse: then every one runs apart), and
/// `separate_bias_grads` runs them apart alone.
/// The CUDA executor launches its artifact's launch plan: each kernel once, in the
/// plan's order, a bias gradient the plan pairs with a GEMM right after that GEMM —
/// summed by its epilogue (`SummedBy`), which the emulated cuBLASLt always does, or on
/// its own where cuBLASLt refused.
#[test]
fn gpu_a_cuda_artifact_runs_exactly_its_launch_plan() {
    use kiln_compiler::launch_plan::KernelKind;
    use kiln_compiler::optimize::kind::TemplateKind;
    use kiln_exec::executor::{How, Launched};
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = cuda_artifact();
    let mut pairs = 0;
    for entry in ENTRIES {
        let gpu = CudaExecutor::with_options(art, entry, CudaOptions::default()).unwrap();
        gpu.record_launches(true);
        let plan = &art.entry(entry).unwrap().manifest.launch;
        let (inputs, params) = feeds(gpu.graph(), art, 5);
        Exec::run(&gpu, &inputs, &params, &RunOptions::default()).unwrap();
        let got = gpu.last_launches();
        let sum_rows = KernelKind::Template(TemplateKind::SumRows);
        let paired_sum =
            |i: usize| plan.launches[i].kind == sum_rows && plan.launches[i].bias_grad.is_some();
        let mut want = Vec::new();
        for (s, l) in plan.launches.iter().enumerate() {
            if paired_sum(s) {
                continue;
            }
            want.push(Launched {
                launch: s,
                how: How::Alone,
            });
            if let Some(p) = l.bias_grad {
                pairs += 1;
                want.push(Launched {
                    launch: p,
                    how: How::SummedBy { product: s },
                });
            }
        }
        let mut seen: Vec<usize> = got.iter().map(|l| l.launch).collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..plan.launches.len()).collect::<Vec<_>>(),
            "{entry}: each once"
        );
        let unpaired = |v: &[Launched]| -> Vec<Launched> {
            v.iter()
                .copied()
                .filter(|l| plan.launches[l.launch].bias_grad.is_none())
                .collect()
        };
        assert_eq!(
            unpaired(&got),
            unpaired(&want),
            "{entry}: in the plan's order"
        );
        let refused = std::env::var_os(emulate::REFUSE_BIAS_GRAD_ENV).is_some();
        if common::emulated() && !refused {
            assert_eq!(got, want, "{entry}");
        }
    }
    assert!(pairs > 10, "train_step pairs its bias gradients: {pairs}");
}

#[test]
fn gpu_fused_and_separate_epilogues_match_the_cpu_executor() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let (mut bad, fused, grads) = entries_vs_cpu(CudaOptions::default(), 17, 1);
    let separate = CudaOptions {
        separate_epilogues: true,
        ..CudaOptions::default()
    };
    let (bad_separate, apart, grads_apart) = entries_vs_cpu(separate, 17, 1);
    bad.extend(bad_separate);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    println!("linear kernels with a bias (fused, separate): default {fused:?}, separate {apart:?}");
    println!(
        "bias gradients (in the GEMM's epilogue, apart): default {grads:?}, separate \
         {grads_apart:?}"
    );
    assert!(
        fused.0 > 0,
        "no linear kernel went through cuBLASLt: {fused:?}"
    );
    assert_eq!(apart.0, 0, "{apart:?}");
    assert_eq!(fused.0 + fused.1, apart.1, "{fused:?} {apart:?}");
    // train_step pairs each bias's gradient with its weight's.
    assert!(
        grads_apart.1 > 0,
        "no bias gradient was paired: {grads_apart:?}"
    );
    assert_eq!(grads_apart.0, 0, "{grads_apart:?}");
    assert_eq!(
        grads.0 + grads.1,
        grads_apart.1,
        "{grads:?} {grads_apart:?}"
    );
    // Bias gradients apart, bias epilogues still fused.
    let grads_only = CudaOptions {
        separate_bias_grads: true,
        ..CudaOptions::default()
    };
    let (bad, only, grads_only) = entries_vs_cpu(grads_only, 17, 1);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert_eq!((only, grads_only), (fused, (0, grads_apart.1)));
    if common::emulated() {
        let refused = std::env::var_os(emulate::REFUSE_BIAS_GRAD_ENV).is_some();
        let want = if refused {
            (0, grads_apart.1)
        } else {
            (grads_apart.1, 0)
        };
        assert_eq!(grads, want, "refused: {refused}");
    }
}

#[test]
fn gpu_train_steps_match_the_cpu_executor() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = cuda_artifact();
    let gpu = CudaExecutor::from_artifact_entry(art, "train_step").unwrap();
    let cpu = art.executor("train_step").unwrap();
    let (inputs, params) = feeds(cpu.graph(), art, 5);
    // Three runs with different dropout seeds and steps: the arena, the module and
    // cuBLAS are reused between runs.
    let mut bad = Vec::new();
    for (step, seed) in [(1u32, 5u64), (2, 6), (3, 5)] {
        let opts = RunOptions {
            seed,
            step,
            ..RunOptions::default()
        };
        let want = cpu.run(&inputs, &params, &opts).unwrap();
        let got = gpu.run(&inputs, &params, &opts).unwrap();
        bad.extend(mismatches(&format!("train_step@{step}"), &want, &got));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Attention's results are stored with their heads merged (`[b, t, h, d]`), so the output
/// projection and the projections' gradients read them without a copy. An artifact
/// written before the flash kernels took their results' strides (no `strided_results` in
/// its manifest) keeps them row-major and copies each before its readers: the same bits
/// (with the bias gradients by their own kernels on both sides).
#[test]
fn gpu_attention_results_with_heads_merged_give_the_older_artifacts_bits() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = cuda_artifact();
    let (old, attentions) = older_attention(art, "older_attention");
    // Bias gradients by `sum_rows` on both sides: the GEMM's epilogue sums them in
    // another order, and takes only output gradients it reads in place (not copies).
    let apart = CudaOptions {
        separate_epilogues: true,
        ..CudaOptions::default()
    };
    let new_gpu = CudaExecutor::with_options(art, "train_step", apart).unwrap();
    let old_gpu = CudaExecutor::with_options(&old, "train_step", apart).unwrap();
    let (inputs, params) = feeds(new_gpu.graph(), art, 9);
    let opts = RunOptions {
        seed: 3,
        step: 2,
        ..RunOptions::default()
    };
    let a = new_gpu.run(&inputs, &params, &opts).unwrap();
    let b = old_gpu.run(&inputs, &params, &opts).unwrap();
    assert_eq!(new_gpu.view_copies(), (0, 0));
    let (n, bytes) = old_gpu.view_copies();
    // At least each attention's output and each backward's dq, dk and dv.
    assert!(n >= 4 * attentions, "{n} copies of {bytes} bytes");
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x.data == y.data, "{name} differs");
    }
}

/// `art` as an older kiln wrote it (into `tmp(name)`): every attention kernel's
/// `strided_results` cleared, the manifest's hash recomputed (the files it lists are
/// unchanged). Its programs copy each attention's result before its readers. Also the
/// count of the training step's forward attention kernels.
fn older_attention(art: &Artifact, name: &str) -> (Artifact, usize) {
    let old_dir = tmp(name);
    for f in walk(&art.dir) {
        let to = old_dir.join(f.strip_prefix(&art.dir).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&f, &to).unwrap();
    }
    let mut m: kiln_compiler::artifact::Manifest =
        serde_json::from_slice(&std::fs::read(art.dir.join("manifest.json")).unwrap()).unwrap();
    // The training step's attention kernels (forward ones; as many backward).
    let mut attentions = 0;
    for e in &mut m.entries {
        for k in &mut e.cuda.as_mut().unwrap().kernels {
            if let Some(Library::Attention {
                strided_results,
                backward,
                ..
            }) = &mut k.library
            {
                assert!(
                    *strided_results,
                    "a new artifact's flash kernels take strides"
                );
                *strided_results = false;
                attentions += usize::from(e.name == "train_step" && !*backward);
            }
        }
    }
    assert_eq!(attentions, 6);
    m.manifest_hash = m.digest().unwrap();
    std::fs::write(
        old_dir.join("manifest.json"),
        serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
    let old = Artifact::load(&old_dir).unwrap();
    let text = std::fs::read_to_string(old_dir.join("manifest.json")).unwrap();
    assert!(!text.contains("strided_results"), "left out when false");
    (old, attentions)
}

/// The views' and kernel results' locations are bound once per dims and kept. A run at
/// dims met before, after a larger batch grew the arena and with new inputs, gives the
/// bits of a fresh executor: with and without view copies (the older artifact's), in
/// f32 and in mixed precision.
#[test]
fn gpu_bindings_kept_by_dims_give_a_fresh_executors_bits() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    for precision in ["f32", "mixed"] {
        let art = artifact_in(precision);
        let (old, _) = older_attention(art, &format!("older_bindings_{precision}"));
        for (label, art) in [("new", art), ("older", &old)] {
            let what = format!("{label} {precision} artifact");
            let gpu = CudaExecutor::from_artifact_entry(art, "train_step").unwrap();
            let (first, params) = feeds(gpu.graph(), art, 9);
            let (larger, _) = feeds_sized(gpu.graph(), art, 10, &[4, 11, 9, 4]);
            let (again, _) = feeds(gpu.graph(), art, 11);
            let opts = |seed| RunOptions {
                seed,
                step: 2,
                ..RunOptions::default()
            };
            gpu.run(&first, &params, &opts(3)).unwrap();
            let small = gpu.arena_bytes();
            gpu.run(&larger, &params, &opts(4)).unwrap();
            assert!(gpu.arena_bytes() > small, "{what}: the arena grew");
            let got = gpu.run(&again, &params, &opts(5)).unwrap();
            assert_eq!(
                gpu.binding_counts(),
                (2, 1),
                "{what}: made twice, kept once"
            );
            let fresh = CudaExecutor::from_artifact_entry(art, "train_step").unwrap();
            let want = fresh.run(&again, &params, &opts(5)).unwrap();
            assert_eq!(fresh.binding_counts(), (1, 0), "{what}");
            assert_eq!(gpu.view_copies(), fresh.view_copies(), "{what}");
            assert_eq!(got.len(), want.len());
            for ((name, x), (_, y)) in want.iter().zip(&got) {
                assert!(x.data == y.data, "{what}: {name} differs");
            }
        }
    }
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A target outside the vocabulary (other than the padding id) is an error on the GPU as
/// on the CPU, not a loss computed as if the row had no target.
#[test]
fn gpu_rejects_a_target_outside_the_vocabulary() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = cuda_artifact();
    let gpu = CudaExecutor::from_artifact_entry(art, "train_step").unwrap();
    let cpu = art.executor("train_step").unwrap();
    let (mut inputs, params) = feeds(cpu.graph(), art, 5);
    let t = inputs.get_mut("tgt_out").unwrap();
    let TensorData::I32(ids) = &mut t.data else {
        panic!("tgt_out is i32")
    };
    ids[1] = 48;
    let opts = RunOptions::default();
    for e in [
        cpu.run(&inputs, &params, &opts).unwrap_err().to_string(),
        gpu.run(&inputs, &params, &opts).unwrap_err().to_string(),
    ] {
        assert!(
            e.contains("xent_ls: id 48 (at flat position 1) is out of range: valid ids are 0..48"),
            "{e}"
        );
    }
}

/// A `train_step` with `options` against the CPU executor on the same random feeds:
/// every output within `rel` in relative L2 norm (`‖gpu − cpu‖₂ ≤ rel·‖cpu‖₂ +
/// abs·√n`), the loss within `loss_rel·|loss|`. The L2 norm, not the largest element:
/// a ReLU whose input rounds across zero in reduced precision passes or stops a whole
/// gradient element, which is how reduced precision behaves, not an error. Returns the
/// executor, the feeds and the options, and asserts that some output differs (the
/// reduced precision shows). Prints the share of the bound used.
fn close_train_step(
    what: &str,
    options: CudaOptions,
    seed: u64,
    bounds: (f64, f64, f64),
) -> (CudaExecutor, Feeds, Feeds, RunOptions) {
    let art = artifact_in(what.split(',').next().unwrap_or(what));
    close_train_step_of(art, what, options, seed, bounds, &[2, 5, 3, 2])
}

/// [`close_train_step`] for the artifact `art`, the dims taking `sizes` in turn.
fn close_train_step_of(
    art: &Artifact,
    what: &str,
    options: CudaOptions,
    seed: u64,
    (rel, abs, loss_rel): (f64, f64, f64),
    sizes: &[i64],
) -> (CudaExecutor, Feeds, Feeds, RunOptions) {
    let gpu = CudaExecutor::with_options(art, "train_step", options).unwrap();
    let cpu = art.executor("train_step").unwrap();
    let (inputs, params) = feeds_sized(cpu.graph(), art, seed, sizes);
    let opts = RunOptions {
        seed,
        step: 2,
        ..RunOptions::default()
    };
    let want = cpu.run(&inputs, &params, &opts).unwrap();
    let got = gpu.run(&inputs, &params, &opts).unwrap();
    assert!(want.iter().any(|(n, _)| n == "loss"));
    let (mut worst, mut exact) = (0f64, true);
    for ((n, w), (_, g)) in want.iter().zip(&got) {
        let (w, g) = (as_f64(w), as_f64(g));
        let (diff, norm) = l2_distance(&w, &g);
        let bound = rel * norm + abs * (w.len() as f64).sqrt();
        assert!(
            diff <= bound,
            "{what} {n}: ‖gpu − cpu‖₂ {diff:e}, ‖cpu‖₂ {norm:e} (bound {bound:e})"
        );
        if n == "loss" {
            assert!(diff <= loss_rel * norm, "{what} loss: {g:?} vs {w:?}");
        }
        exact &= diff == 0.0;
        worst = worst.max(diff / bound);
    }
    assert!(
        !exact,
        "{what}: every output equals fp32's; the precision did not apply"
    );
    println!("{what} train_step: at most {worst:.3} of the bound used");
    (gpu, inputs, params, opts)
}

/// TF32 GEMMs (`kiln compile --precision tf32`): a training
/// step within `1e-2` of the CPU in relative L2 norm (operands rounded to a 10-bit
/// mantissa, fp32 accumulation), the loss within `1e-3` relative.
#[test]
fn gpu_tf32_train_step_is_close_to_the_cpu() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    close_train_step("tf32", CudaOptions::default(), 9, (1e-2, 1e-5, 1e-3));
}

/// bf16 GEMM operands (`kiln compile --precision bf16`): a training step within
/// `8e-2` of the CPU in relative L2 norm (operands rounded to an 8-bit mantissa, fp32
/// accumulation and results; the host emulation measured at most 3.6 %, the first FFN
/// layer's gradients, where ReLU gates flip), the loss within `1e-2` relative; and
/// device training runs with it (the loss of a second step is finite and differs from
/// the first).
#[test]
fn gpu_bf16_train_step_is_close_to_the_cpu() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let bf16 = CudaOptions::default();
    let (gpu, inputs, params, opts) = close_train_step("bf16", bf16, 12, (8e-2, 1e-4, 1e-2));
    two_device_steps(&gpu, &inputs, &params, &opts);
}

/// Two training steps with the state on the device (`train_begin`, `train_micro`,
/// `train_update`): finite gradients, and finite losses that differ (the update applied).
fn two_device_steps(gpu: &CudaExecutor, inputs: &Feeds, params: &Feeds, opts: &RunOptions) {
    let mut adam = kiln_train::optim::Adam::new(&Default::default(), params);
    gpu.train_begin(params, &adam.m, &adam.v).unwrap();
    let mut losses = Vec::new();
    for step in 1..=2u64 {
        let out = gpu
            .train_micro(inputs, params, opts, 1.0, true, None)
            .unwrap();
        assert!(out.non_finite.is_none());
        let l = out.outputs.iter().find(|(n, _)| n == "loss").unwrap();
        losses.push(as_f64(&l.1)[0]);
        adam.t += 1;
        gpu.train_update(adam.constants(step, 1e-3), 1.0).unwrap();
    }
    assert!(
        losses.iter().all(|l| l.is_finite()) && losses[0] != losses[1],
        "{losses:?}"
    );
}

/// Mixed precision (`kiln compile --precision mixed`): activations stored in
/// bf16, bf16 GEMMs, f32 parameters and loss. A training step within `0.3` of the CPU in
/// relative L2 norm and the loss within `2e-2` relative (the host emulation, which
/// rounds exactly as the kernels do, measured the loss within 1e-4 and the gradients at
/// 2–20 %, the most in the first decoder layer's query projection: every activation and
/// activation gradient is rounded to 8 bits on the way); every other entry within
/// `0.1·max + 1e-3`; device training runs with it (two steps, finite and different
/// losses).
#[test]
fn gpu_mixed_precision_is_close_to_the_cpu() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let mixed = CudaOptions::default();
    let (gpu, inputs, params, opts) = close_train_step("mixed", mixed, 13, (0.3, 1e-3, 2e-2));
    // The biased products write bf16 through cuBLASLt's epilogue (a bf16 bias); the
    // separate path (bias fill, GEMM, ReLU) is as close.
    let (fused, _) = gpu.epilogue_counts();
    assert!(fused > 0, "no bf16 bias epilogue fused");
    let separate = CudaOptions {
        separate_epilogues: true,
        ..mixed
    };
    let (sep, ..) = close_train_step("mixed, separate", separate, 13, (0.3, 1e-3, 2e-2));
    assert_eq!(sep.epilogue_counts().0, 0);
    let art = artifact_in("mixed");
    for entry in ["encode", "decode_step"] {
        let g = CudaExecutor::from_artifact_entry(art, entry).unwrap();
        let cpu = art.executor(entry).unwrap();
        let (inputs, params) = feeds(cpu.graph(), art, 14);
        let want = cpu.run(&inputs, &params, &RunOptions::default()).unwrap();
        let got = Exec::run(&g, &inputs, &params, &RunOptions::default()).unwrap();
        for ((n, w), (_, o)) in want.iter().zip(&got) {
            let (w, o) = (as_f64(w), as_f64(o));
            let max = w.iter().fold(0f64, |a, x| a.max(x.abs()));
            let diff = w
                .iter()
                .zip(&o)
                .fold(0f64, |a, (x, y)| a.max((x - y).abs()));
            assert!(
                diff <= 0.1 * max + 1e-3,
                "mixed {entry} {n}: max diff {diff:e}, max |cpu| {max:e}"
            );
        }
    }
    two_device_steps(&gpu, &inputs, &params, &opts);
}

/// Heads of 16 (the tiny model at `d_model = 64`): the mixed-precision program's attention
/// runs on tensor cores (`codegen::cuda::tensor`), within the bounds of the CUDA-core
/// kernels above — short sentences (the one-block backward) and sentences of 37 and 34
/// tokens (two key tiles forward, the query-side and key-side backward) — and device
/// training takes two steps with it.
#[test]
fn gpu_mixed_precision_attention_on_tensor_cores_is_close_to_the_cpu() {
    use kiln_compiler::codegen::cuda::attention::{fits_short, Part};
    use kiln_compiler::codegen::cuda::tensor;
    if require_cuda_or_skip().is_none() {
        return;
    }
    assert!(tensor::fits(Part::Forward, 16, 16) && tensor::fits(Part::Short, 16, 16));
    assert!(fits_short(5, 7, 16, 16));
    let art = compile_spec(
        &tmp("cuda_heads16"),
        SPEC,
        &["vocab=48", "d_model=64"],
        "cuda:mixed",
    );
    let mixed = CudaOptions::default();
    let bounds = (0.3, 1e-3, 2e-2);
    let (gpu, inputs, params, opts) =
        close_train_step_of(&art, "mixed, heads of 16", mixed, 23, bounds, &[2, 5, 3, 2]);
    two_device_steps(&gpu, &inputs, &params, &opts);
    assert!(!fits_short(37, 37, 16, 16) && !fits_short(34, 37, 16, 16));
    let long = "mixed, heads of 16, 37 and 34 tokens";
    close_train_step_of(&art, long, mixed, 24, bounds, &[2, 37, 34, 2]);
}

/// With bf16 GEMMs, each span of a parameter a product reads is cast to bf16 once a run
/// and kept for the next run of the same parameters version: that run gives the same
/// bits without casting again. A new version with other values casts again, and gives
/// what a fresh executor gives.
#[test]
fn gpu_parameter_casts_are_kept_for_a_version() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let bits = |outs: &[(String, Tensor)]| -> Vec<u64> {
        outs.iter()
            .flat_map(|(_, t)| as_f64(t))
            .map(f64::to_bits)
            .collect()
    };
    let version = |v| RunOptions {
        params_version: Some(v),
        ..RunOptions::default()
    };
    for what in ["mixed", "bf16"] {
        let art = artifact_in(what);
        let g = CudaExecutor::from_artifact_entry(art, "encode").unwrap();
        let cpu = art.executor("encode").unwrap();
        let (inputs, params) = feeds(cpu.graph(), art, 21);
        let v1 = kiln_exec::executor::fresh_params_version();
        let first = bits(&Exec::run(&g, &inputs, &params, &version(v1)).unwrap());
        let kept = g.parameter_casts();
        assert!(kept > 0, "{what}: no parameter cast kept");
        let again = bits(&Exec::run(&g, &inputs, &params, &version(v1)).unwrap());
        assert!(again == first, "{what}: the kept casts change the result");
        assert_eq!(g.parameter_casts(), kept, "{what}: cast again");
        // Other values under a new version: cast again, as a fresh executor does.
        let mut halved = params.clone();
        for t in halved.values_mut() {
            if let TensorData::F32(v) = &mut t.data {
                v.iter_mut().for_each(|x| *x *= 0.5);
            }
        }
        let v2 = kiln_exec::executor::fresh_params_version();
        let new = bits(&Exec::run(&g, &inputs, &halved, &version(v2)).unwrap());
        let fresh = CudaExecutor::from_artifact_entry(art, "encode").unwrap();
        let want = bits(&Exec::run(&fresh, &inputs, &halved, &RunOptions::default()).unwrap());
        assert!(new == want, "{what}: a new version reads stale casts");
        assert!(new != first, "{what}: the halved parameters change nothing");
    }
}

/// Mixed-precision decoding with the state on the GPU equals the same executor with the
/// state on the host: the caches are bf16 on the device, and the host path widens them
/// to f32 and rounds them back exactly; bf16 rows gather as words; the top-k reads bf16
/// logits (the same tokens, scores within rounding: `same_hypotheses`).
#[test]
fn gpu_mixed_precision_resident_decoding_matches_its_host_state() {
    use kiln_decode::search::DecodeOptions;
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = artifact_in("mixed");
    let enc = CudaExecutor::from_artifact_entry(art, "encode").unwrap();
    let step = CudaExecutor::from_artifact_entry(art, "decode_step").unwrap();
    let params: BTreeMap<String, Tensor> = art.weights().unwrap().into_iter().collect();
    let src = Tensor::i32(vec![2, 4], vec![5, 6, 7, 0, 8, 9, 10, 11]).unwrap();
    let opts = DecodeOptions {
        beam: 3,
        max_len_b: 5,
        ..DecodeOptions::default()
    };
    host_and_device_state(&enc, &step, &params, &src, &opts);
}

/// Decodes `src` with the state on the host (`CachedStep`) and on the device
/// (`DeviceCachedStep`) through the same executors; the two agree (`same_hypotheses`).
/// Returns the device's hypotheses.
fn host_and_device_state(
    enc: &CudaExecutor,
    step: &CudaExecutor,
    params: &BTreeMap<String, Tensor>,
    src: &Tensor,
    opts: &kiln_decode::search::DecodeOptions,
) -> Vec<kiln_decode::search::Hypothesis> {
    use kiln_decode::search::{decode, CachedStep, DeviceCachedStep};
    let host = decode(&mut CachedStep::new(enc, step, params, 48), src, opts).unwrap();
    let device = decode(&mut DeviceCachedStep::new(enc, step, params, 48), src, opts).unwrap();
    same_hypotheses(&host, &device);
    device
}

/// The host decoder's hypotheses and the GPU decoder's (the best tokens of each row
/// selected on the device, `CudaExecutor::row_top_k`): the same tokens, scores within
/// `1e-9` relative (the log-softmax sums in another order, CUDA's `exp` and `log`).
fn same_hypotheses(
    host: &[kiln_decode::search::Hypothesis],
    device: &[kiln_decode::search::Hypothesis],
) {
    assert_eq!(host.len(), device.len());
    for (h, d) in host.iter().zip(device) {
        assert_eq!(h.tokens, d.tokens, "{h:?} vs {d:?}");
        for (a, b) in [(h.score, d.score), (h.log_prob, d.log_prob)] {
            assert!((a - b).abs() <= 1e-9 * a.abs().max(1.0), "{h:?} vs {d:?}");
        }
    }
}

/// Parameters kept on the device under one `params_version`: the second run of a
/// version reads the kept copies (same results), a new version reads the changed values
/// even though they sit at the same host address.
#[test]
fn gpu_kept_parameters_follow_the_version() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = cuda_artifact();
    let gpu = CudaExecutor::from_artifact_entry(art, "encode").unwrap();
    let cpu = art.executor("encode").unwrap();
    let (inputs, mut params) = feeds(cpu.graph(), art, 7);
    let version = kiln_exec::executor::fresh_params_version();
    let opts = RunOptions {
        params_version: Some(version),
        ..RunOptions::default()
    };
    let want = cpu.run(&inputs, &params, &opts).unwrap();
    let mut bad = Vec::new();
    for round in 0..2 {
        let got = gpu.run(&inputs, &params, &opts).unwrap();
        bad.extend(mismatches(&format!("encode, run {round}"), &want, &got));
    }
    // Change every f32 parameter in place (same allocation), under a new version.
    for t in params.values_mut() {
        if let TensorData::F32(v) = &mut t.data {
            v.iter_mut().for_each(|x| *x = *x * 0.5 + 0.01);
        }
    }
    let opts = RunOptions {
        params_version: Some(kiln_exec::executor::fresh_params_version()),
        ..RunOptions::default()
    };
    let want2 = cpu.run(&inputs, &params, &opts).unwrap();
    assert!(
        !mismatches("changed", &want, &want2).is_empty(),
        "the change shows"
    );
    let got = gpu.run(&inputs, &params, &opts).unwrap();
    bad.extend(mismatches("encode, new version", &want2, &got));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Training with its state on the device (`train_begin`, `train_micro`,
/// `train_update`, `train_download`) against the host optimizer fed by the same GPU's
/// gradients: three optimizer steps of two micro-batches each give the same parameters
/// and moments **bit for bit** (the trainer's accumulation, `1/tokens` and `Adam::step`
/// in the same op order), and the losses agree. A parameter made NaN is reported as a
/// non-finite gradient.
#[test]
fn gpu_device_training_matches_the_host_optimizer_bit_for_bit() {
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = cuda_artifact();
    let dev = CudaExecutor::from_artifact_entry(art, "train_step").unwrap();
    let host = CudaExecutor::from_artifact_entry(art, "train_step").unwrap();
    let g = host.graph().clone();
    let (_, params) = feeds(&g, art, 3);
    let batches: Vec<Feeds> = (0..2).map(|k| feeds(&g, art, 20 + k).0).collect();
    let names: Vec<String> = params.keys().cloned().collect();
    let mut adam = kiln_train::optim::Adam::new(&Default::default(), &params);
    let mut dev_adam = kiln_train::optim::Adam::new(&Default::default(), &params);
    let mut hp = params.clone();
    dev.train_begin(&params, &dev_adam.m, &dev_adam.v).unwrap();
    for step in 1..=3u64 {
        let lr = 1e-3 * step as f64;
        let mut acc: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        let mut tokens = 0usize;
        for (micro, inputs) in batches.iter().enumerate() {
            let w = 7.0 + micro as f32 * 3.0;
            tokens += w as usize;
            let opts = RunOptions {
                seed: 4,
                step: (2 * step + micro as u64) as u32,
                ..RunOptions::default()
            };
            let out = host.run(inputs, &hp, &opts).unwrap();
            let got = dev
                .train_micro(inputs, &params, &opts, w, micro == 0, None)
                .unwrap();
            assert!(got.non_finite.is_none());
            let loss = |o: &[(String, Tensor)]| {
                o.iter()
                    .find(|(n, _)| n == "loss")
                    .map(|(_, t)| as_f64(t)[0])
            };
            assert_eq!(loss(&got.outputs), loss(&out), "step {step}.{micro}: loss");
            assert!(got.outputs.iter().all(|(n, _)| !n.starts_with("grad.")));
            for (n, t) in &out {
                let Some(p) = n.strip_prefix("grad.") else {
                    continue;
                };
                let TensorData::F32(gv) = &t.data else {
                    panic!("{n}")
                };
                let a = acc
                    .entry(p.to_string())
                    .or_insert_with(|| vec![0.0; gv.len()]);
                for (a, x) in a.iter_mut().zip(gv) {
                    if micro == 0 {
                        *a = w * x;
                    } else {
                        *a += w * x;
                    }
                }
            }
        }
        let inv = 1.0 / tokens as f32;
        acc.values_mut()
            .for_each(|v| v.iter_mut().for_each(|x| *x *= inv));
        adam.step(&mut hp, &acc, lr).unwrap();
        dev_adam.t += 1;
        dev.train_update(dev_adam.constants(dev_adam.t, lr), inv)
            .unwrap();
    }
    let mut dp = params.clone();
    dev.train_download(&mut dp, &mut dev_adam.m, &mut dev_adam.v)
        .unwrap();
    for n in &names {
        let bits = |t: &Tensor| match &t.data {
            TensorData::F32(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>(),
            _ => panic!("{n}"),
        };
        assert_eq!(bits(&dp[n]), bits(&hp[n]), "parameter {n}");
        assert_ne!(bits(&dp[n]), bits(&params[n]), "parameter {n} was trained");
        assert_eq!(dev_adam.m[n], adam.m[n], "m.{n}");
        assert_eq!(dev_adam.v[n], adam.v[n], "v.{n}");
    }

    // A NaN parameter: the gradients are not finite, and the first one is named.
    let mut bad = params.clone();
    let first = names[0].clone();
    if let TensorData::F32(v) = &mut bad.get_mut(&first).unwrap().data {
        v.iter_mut().for_each(|x| *x = f32::NAN);
    }
    dev.train_begin(&bad, &adam.m, &adam.v).unwrap();
    let opts = RunOptions::default();
    let out = dev
        .train_micro(&batches[0], &bad, &opts, 1.0, true, None)
        .unwrap();
    let (name, x) = out.non_finite.expect("a non-finite gradient is reported");
    assert!(names.contains(&name) && !x.is_finite(), "{name}: {x}");
    dev.train_end();
    assert!(dev.train_update(adam.constants(1, 1e-3), 1.0).is_err());
}

/// `kiln run DIR --executor cuda`: without CUDA a non-zero exit with the guard's reason
/// and the CPU alternative; on a spec, the command to compile an artifact first.
#[test]
fn kiln_run_with_the_cuda_executor() {
    let dir = tmp("run");
    let art = cuda_artifact();
    let inputs = dir.join("in.safetensors");
    kiln_compiler::tensor::save_safetensors(
        &inputs,
        &[(
            "src".to_string(),
            Tensor::i32(vec![1, 4], vec![5, 6, 7, 8]).unwrap(),
        )],
        None,
    )
    .unwrap();
    let out_path = dir.join("out.safetensors");
    let run = |target: &str| {
        kiln(&[
            "run",
            target,
            "--entry",
            "encode",
            "--inputs",
            inputs.to_str().unwrap(),
            "--executor",
            "cuda",
            "-o",
            out_path.to_str().unwrap(),
        ])
    };
    let out = run(art.dir.to_str().unwrap());
    // Miette wraps lines (where depends on the paths): compare with whitespace collapsed.
    let flat = |o: &std::process::Output| common::flat(&String::from_utf8_lossy(&o.stderr));
    let err = flat(&out);
    match cuda_available() {
        Err(reason) => {
            assert!(!out.status.success());
            let first = reason
                .split_whitespace()
                .take(4)
                .collect::<Vec<_>>()
                .join(" ");
            assert!(err.contains("kiln::cuda") && err.contains(&first), "{err}");
            assert!(err.contains("--executor compiled"), "{err}");
            assert!(!out_path.exists(), "no output written on failure");
        }
        Ok(_) => assert!(out.status.success(), "{err}"),
    }
    let out = run(SPEC);
    assert!(!out.status.success());
    let err = flat(&out);
    assert!(
        err.contains("runs a compiled CUDA artifact, not a spec") && err.contains("--target cuda"),
        "{err}"
    );
}

/// `kiln bench SPEC --executor cuda`: without CUDA a non-zero exit with the guard's reason
/// before anything is compiled; with it, a timing line.
/// `kiln bench` of the tiny model on the CUDA executor: `entry`, a batch of 2, one timed
/// run, then `extra`.
fn bench_tiny(entry: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "bench",
        SPEC,
        "--set",
        "vocab=48",
        "--entry",
        entry,
        "--batch",
        "2",
        "--runs",
        "1",
        "--executor",
        "cuda",
    ];
    args.extend_from_slice(extra);
    kiln(&args)
}

#[test]
fn kiln_bench_with_the_cuda_executor() {
    // `train_step` on the GPU keeps parameters, gradients and moments on the device;
    // `decode` the decoder's state; `forward` leaves its logits there.
    for entry in ["forward", "loss", "train_step", "decode"] {
        let out = bench_tiny(entry, &["--src-len", "5", "--tgt-len", "4"]);
        let err = common::flat(&String::from_utf8_lossy(&out.stderr));
        match cuda_available() {
            Err(reason) => {
                assert!(!out.status.success());
                let first = reason
                    .split_whitespace()
                    .take(4)
                    .collect::<Vec<_>>()
                    .join(" ");
                assert!(
                    err.contains("kiln::cuda")
                        && err.contains(&first)
                        && err.contains("--executor compiled"),
                    "{entry}: {err}"
                );
            }
            Ok(_) => {
                assert!(out.status.success(), "{entry}: {err}");
                let text = String::from_utf8_lossy(&out.stdout);
                assert!(text.contains("ms/step"), "{text}");
                assert_eq!(
                    text.contains("(state on the GPU)"),
                    entry == "decode",
                    "{text}"
                );
                assert_eq!(
                    text.contains("(outputs left on the GPU)"),
                    entry == "forward",
                    "{text}"
                );
                // Attention's results are stored with their heads merged: the output
                // projection and the projections' gradients read them without a copy.
                assert!(
                    text.contains("view copies: 0 of 0.0 MiB"),
                    "{entry}: {text}"
                );
            }
        }
    }
    // `--profile`: the GPU's time per kernel kind from events around each kernel, the
    // time it waited for the host, and the host's time issuing the launches.
    if cuda_available().is_ok() {
        let out = bench_tiny("train_step", &["--profile"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ms = |label: &str| -> f64 {
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(label))
                .unwrap_or_else(|| panic!("no `{label}` line in {text}"));
            line[line.find(label).unwrap() + label.len()..]
                .split_whitespace()
                .next()
                .and_then(|x| x.parse().ok())
                .unwrap_or_else(|| panic!("no time on `{line}`"))
        };
        for label in [
            "upload",
            "download",
            "matmul (gemm)",
            "add_layer_norm_bwd (generated)",
            "xent_ls (generated)",
        ] {
            assert!(ms(label) >= 0.0, "{text}");
        }
        let idle = ms(kiln_exec::cuda::GPU_IDLE);
        let issue = ms(kiln_exec::cuda::HOST_ISSUE);
        assert!(idle >= 0.0 && issue > 0.0, "{text}");
        // The whole-run figures come after the kernel kinds.
        let at = |l: &str| text.find(l).unwrap();
        assert!(
            at(kiln_exec::cuda::GPU_IDLE) > at("matmul (gemm)"),
            "{text}"
        );
        // Then the products by shape (the slowest; `--json` lists them all, the tied
        // output projection among them: 2 × 25 target rows, d_model 32, the embedding
        // read transposed).
        assert!(
            at("matrix products by shape") > at(kiln_exec::cuda::HOST_ISSUE),
            "{text}"
        );
        let out = bench_tiny("train_step", &["--profile", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        let products = v["profile"]["products"].as_array().expect("products");
        assert!(
            products.iter().any(|p| {
                (p["m"].as_u64(), p["k"].as_u64(), p["n"].as_u64())
                    == (Some(50), Some(32), Some(48))
                    && p["b_transposed"] == true
                    && p["kind"]
                        .as_str()
                        .is_some_and(|k| k.starts_with("matmul ("))
            }),
            "{v}"
        );
    }
    // `--host-outputs`: the forward's logits come back to the host, as before.
    if cuda_available().is_ok() {
        let out = bench_tiny("forward", &["--host-outputs"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("ms/step") && !text.contains("(outputs left on the GPU)"),
            "{text}"
        );
    }
}

/// A batch whose device arena does not fit is an error that names the arena, its size
/// and the fix, not an abort. On the emulated device (whose memory is the host's) the
/// host's limits are checked before the allocation, here `ulimit -v`; on a GPU a failed
/// allocation gets the same context and the GPU's free memory (not exercised here: a GPU
/// would hold this 41.9 GiB arena).
#[test]
fn a_device_arena_too_large_for_the_emulated_device_is_an_error() {
    if !common::emulated() {
        println!("skipped: the emulated device's check (a GPU would hold this arena)");
        return;
    }
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 8000000 && exec {} bench {SPEC} --set vocab=48 --entry forward \
             --batch 2000000 --runs 1 --executor cuda",
            env!("CARGO_BIN_EXE_kiln")
        ))
        .current_dir(common::root())
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let err = common::flat(&String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "the device arena of `transformer_tiny` at batch=2000000, src_len=25, tgt_len=25 \
             would allocate 41.9 GiB, but the address-space limit (ulimit -v"
        ) && err.contains("run smaller batches"),
        "{err}"
    );
}

/// `kiln bench --devices`: data-parallel training steps. Refused, with the fix, for
/// anything but the GPU's `train_step` and for a GPU listed twice; without the `nccl`
/// feature or without a GPU, the reason; with both (and one GPU), a step over `--devices
/// 0` counts one GPU's tokens.
#[test]
fn kiln_bench_data_parallel() {
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            SPEC,
            "--set",
            "vocab=48",
            "--batch",
            "2",
            "--src-len",
            "5",
            "--tgt-len",
            "4",
            "--runs",
            "1",
        ];
        args.extend_from_slice(extra);
        let out = kiln(&args);
        let err = common::flat(&String::from_utf8_lossy(&out.stderr));
        (out, err)
    };
    let (out, err) = bench(&["--executor", "compiled", "--devices", "0"]);
    assert!(!out.status.success());
    assert!(
        err.contains("`--devices` times data-parallel training on the GPU")
            && err.contains("--executor cuda --entry train_step"),
        "{err}"
    );
    let (out, err) = bench(&["--executor", "cuda", "--devices", "0,0"]);
    assert!(!out.status.success());
    assert!(err.contains("--devices lists GPU 0 twice"), "{err}");
    let (out, err) = bench(&["--executor", "cuda", "--devices", "0"]);
    match cuda_available() {
        Err(reason) => {
            assert!(!out.status.success());
            let first = reason
                .split_whitespace()
                .take(4)
                .collect::<Vec<_>>()
                .join(" ");
            assert!(err.contains(&first), "{err}");
        }
        Ok(_) if !cfg!(feature = "nccl") => {
            assert!(!out.status.success());
            assert!(err.contains("--features nccl"), "{err}");
        }
        Ok(_) => {
            assert!(out.status.success(), "{err}");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("x1 (GPUs [0], NCCL "), "{text}");
            assert!(text.contains("ms/step"), "{text}");
        }
    }
}

/// The GPU decoder keeps its state on the device (`DeviceCachedStep`: the encoder's
/// output, the source and the key/value caches stay there; rows are reordered by
/// `take_rows`, the grown caches kept by `run_resident`, each row's best tokens selected
/// by `row_top_k`): the same hypotheses as the host-state decoder (`CachedStep`) on the
/// same CUDA executors (scores within rounding, `same_hypotheses`), and the CPU
/// executor's tokens. `cached_step` picks the device path for a CUDA executor.
#[test]
fn gpu_resident_decoding_matches_the_host_state() {
    use kiln_decode::search::{cached_step, decode, CachedStep, DecodeOptions};
    if require_cuda_or_skip().is_none() {
        return;
    }
    let art = cuda_artifact();
    let enc = CudaExecutor::from_artifact_entry(art, "encode").unwrap();
    let step = CudaExecutor::from_artifact_entry(art, "decode_step").unwrap();
    let params: BTreeMap<String, Tensor> = art.weights().unwrap().into_iter().collect();
    // Three sentences, two of them padded; ids below the vocabulary of 48.
    let src = Tensor::i32(
        vec![3, 5],
        vec![5, 6, 7, 0, 0, 8, 9, 10, 11, 12, 13, 14, 0, 0, 0],
    )
    .unwrap();
    let opts = DecodeOptions {
        beam: 4,
        max_len_b: 6,
        ..DecodeOptions::default()
    };
    let device = host_and_device_state(&enc, &step, &params, &src, &opts);
    let mut picked = cached_step(&enc, &step, &params, 48);
    assert_eq!(decode(picked.as_mut(), &src, &opts).unwrap(), device);
    let (cenc, cstep) = (
        art.executor("encode").unwrap(),
        art.executor("decode_step").unwrap(),
    );
    let cpu = decode(
        &mut CachedStep::new(&cenc, &cstep, &params, 48),
        &src,
        &opts,
    )
    .unwrap();
    for (c, g) in cpu.iter().zip(&device) {
        assert_eq!(c.tokens, g.tokens);
        assert!(
            (c.score - g.score).abs() <= 1e-4 * c.score.abs().max(1.0),
            "{c:?} vs {g:?}"
        );
    }
    // The n best on the device are the CPU's, and teacher-forced scoring on the device
    // (`kiln score`, full log-probability rows) gives each its reported log-probability.
    let nbest = |m: &mut dyn kiln_decode::search::StepModel| {
        kiln_decode::search::decode_nbest(m, &src, &opts, 4).unwrap()
    };
    let gpu_nbest = nbest(cached_step(&enc, &step, &params, 48).as_mut());
    let cpu_nbest = nbest(&mut CachedStep::new(&cenc, &cstep, &params, 48));
    for (c, g) in cpu_nbest.iter().zip(&gpu_nbest) {
        assert_eq!(
            c.iter().map(|h| &h.tokens).collect::<Vec<_>>(),
            g.iter().map(|h| &h.tokens).collect::<Vec<_>>()
        );
    }
    let refs: Vec<Vec<i32>> = gpu_nbest.iter().map(|h| h[0].tokens.clone()).collect();
    let scores = kiln_decode::search::score(
        cached_step(&enc, &step, &params, 48).as_mut(),
        &src,
        &refs,
        &opts,
    )
    .unwrap();
    for (s, h) in scores.iter().zip(&gpu_nbest) {
        assert!(
            (s - h[0].log_prob).abs() <= 1e-4 * s.abs().max(1.0),
            "{s} vs {:?}",
            h[0]
        );
    }
    // Rows are gathered exactly, repeats included.
    let t = Tensor::f32(
        vec![3, 2],
        vec![1.0, -0.0, 2.5, f32::MIN_POSITIVE, -3.0, 7.0],
    )
    .unwrap();
    let d = step.to_device(&t).unwrap();
    let g = step.take_rows(&[&d], &[2, 0, 2, 1]).unwrap();
    let back = step.to_host(&g[0]).unwrap();
    assert_eq!(back.shape, vec![4, 2]);
    let bits = |t: &Tensor| {
        t.as_f32()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>()
    };
    let want = Tensor::f32(
        vec![4, 2],
        vec![-3.0, 7.0, 1.0, -0.0, -3.0, 7.0, 2.5, f32::MIN_POSITIVE],
    )
    .unwrap();
    assert_eq!(bits(&back), bits(&want));
    assert!(step.take_rows(&[&d], &[3]).is_err(), "a row out of range");
    // Each row's best tokens, selected on the device from the last position, are the
    // host's `row_top` of its log-softmax (a tie, a banned token, the end of sentence).
    // [rows 2, len 2, vocab 5]: the first position is never read.
    let logits = Tensor::f32(
        vec![2, 2, 5],
        vec![
            9.0, 9.0, 9.0, 9.0, 9.0, // row 0, position 0
            0.5, 2.0, -1.0, 2.0, 0.25, // row 0, position 1: a tie at the top
            9.0, 9.0, 9.0, 9.0, 9.0, // row 1, position 0
            4.0, -2.0, 1.0, 0.5, 0.5, // row 1, position 1: the best is banned
        ],
    )
    .unwrap();
    let d = step.to_device(&logits).unwrap();
    let spec = kiln_decode::search::TopSpec {
        k: 3,
        banned: &[0],
        eos: 2,
    };
    let top = step.row_top_k(&d, spec.k, spec.banned, spec.eos).unwrap();
    for r in 0..2 {
        let row: Vec<f64> = logits.as_f32().unwrap()[(2 * r + 1) * 5..(2 * r + 2) * 5]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let lp: Vec<f64> = row.iter().map(|v| v - lse).collect();
        let want = kiln_decode::search::row_top(&lp, &spec);
        for (j, &(wv, wi)) in want.best.iter().enumerate() {
            assert_eq!(top.ids[r * 3 + j], wi, "row {r} slot {j}");
            assert!(
                (top.vals[r * 3 + j] - wv).abs() <= 1e-12,
                "row {r} slot {j}"
            );
        }
        assert!((top.eos[r] - want.eos).abs() <= 1e-12, "row {r}");
    }
}
