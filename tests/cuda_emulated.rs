//! Every GPU test of `cuda_exec.rs`, run on the host emulation of the CUDA device
//! (`kiln_exec::cuda::emulate`): the CUDA executor's whole host side — binding, the
//! device arena, views, launches, the cuBLAS and cuBLASLt calls, the device optimizer,
//! loss scaling, mixed precision, the resident decoder, `kiln run` and `kiln bench`
//! with `--executor cuda` — on a machine without a GPU, the generated CUDA C compiled by
//! the host C++ compiler under the shim of `codegen::cuda::host`.
//!
//! In: this test binary. Out: pass/fail. `every_gpu_test_passes_on_the_emulated_device`
//! runs this binary again with `KILN_CUDA_EMULATE=1`, filtered to the tests of
//! `cuda_exec.rs` (included below as `gpu`) and the GPU training tests of
//! `train_common/gpu.rs` (`train_common::gpu`: `kiln train` with `executor: cuda`, loss
//! scaling on the device), and fails with the child's output if any of them fails. Skipped, with the reason printed, without `g++` (or `$CXX`). In this
//! process itself the included tests run as they do in `cuda_exec.rs` (here: skipped,
//! no GPU).

// `cuda_exec.rs` and `train_common` both load the GPU tests' helpers
// (`tests/common/cuda.rs`).
#![allow(clippy::duplicate_mod)]

#[path = "cuda_exec.rs"]
mod gpu;
#[path = "train_common/mod.rs"]
mod train_common;

use std::process::Command;

use kiln_exec::cuda::emulate::EMULATE_ENV;

#[test]
fn every_gpu_test_passes_on_the_emulated_device() {
    if std::env::var_os(EMULATE_ENV).is_some() {
        // The child: its own tests are the `gpu::` ones.
        return;
    }
    let Some((ok, text)) = emulated_child(&["gpu::", "--test-threads", "2"], &[]) else {
        return;
    };
    println!("{text}");
    assert!(ok, "a GPU test fails on the emulated device");
    // Every GPU test ran (none skipped for want of CUDA), and there were some.
    assert!(!text.contains("skipped: CUDA is not available"), "{text}");
    let passed = text
        .lines()
        .filter(|l| l.contains("gpu::") && l.ends_with("... ok"))
        .count();
    assert!(passed >= 20, "only {passed} GPU tests ran:\n{text}");
}

/// The dry emulation (`KILN_CUDA_EMULATE=dry`) times the CUDA executor's own host work:
/// every call checked, no kernel, GEMM or device copy run, no C++ compiler needed (here
/// `$CXX` names none). `kiln bench --profile` then shows the kernels' issue and the
/// host's total; the GPU is never idle for long, since nothing runs.
#[test]
fn the_dry_emulation_times_the_executors_host_work() {
    if std::env::var_os(EMULATE_ENV).is_some() {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "bench",
            "models/transformer_tiny.kiln",
            "--set",
            "vocab=48",
            "--executor",
            "cuda",
            "--entry",
            "train_step",
            "--batch",
            "3",
            "--runs",
            "2",
            "--profile",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(EMULATE_ENV, "dry")
        .env("CXX", "/nonexistent/c++")
        .env_remove("KILN_REQUIRE_CUDA")
        .output()
        .expect("kiln runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("ms/step"), "{text}");
    for label in [
        "matmul (gemm)",
        "xent_ls (generated)",
        kiln_exec::cuda::HOST_ISSUE,
        kiln_exec::cuda::GPU_IDLE,
    ] {
        assert!(text.contains(label), "no `{label}` in {text}");
    }
    // The tiny model's 32 bias gradients a step, in 3 runs (a warm-up and 2 timed), all
    // summed by their weight gradients' GEMMs.
    assert!(
        text.contains("bias gradients: 96 summed by their weight gradient's GEMM"),
        "{text}"
    );
}

/// Where cuBLASLt has no bias-gradient epilogue for a weight-gradient GEMM (the emulated
/// one told to refuse, `REFUSE_BIAS_GRAD_ENV`), every bias gradient runs as its own
/// `sum_rows` — those deferred to their GEMM too — and every entry still matches the CPU
/// executor (fp32, and the mixed-precision and training steps within their bounds).
#[test]
fn bias_gradients_without_a_cublaslt_algorithm_run_apart() {
    if std::env::var_os(EMULATE_ENV).is_some() {
        return;
    }
    let args = [
        "gpu::gpu_fused_and_separate_epilogues_match_the_cpu_executor",
        "gpu::gpu_train_steps_match_the_cpu_executor",
        "gpu::gpu_mixed_precision_is_close_to_the_cpu",
        "--exact",
        "--nocapture",
        "--test-threads",
        "2",
    ];
    let refuse = [(kiln_exec::cuda::emulate::REFUSE_BIAS_GRAD_ENV, "1")];
    let Some((ok, text)) = emulated_child(&args, &refuse) else {
        return;
    };
    assert!(ok, "{text}");
    assert!(text.contains("test result: ok. 3 passed"), "{text}");
    assert!(
        text.contains("bias gradients (in the GEMM's epilogue, apart): default (0, 32)"),
        "{text}"
    );
}

/// This test binary run again on the emulated device with `args` and the variables
/// `env`: whether it passed, and its output. `None`, with the reason printed, without
/// `g++` (or `$CXX`) to compile the CUDA C.
fn emulated_child(args: &[&str], env: &[(&str, &str)]) -> Option<(bool, String)> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".to_string());
    let have = Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        println!("skipped: no `{cxx}` to compile the CUDA C for the emulated device");
        return None;
    }
    let me = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(me)
        .args(args)
        .envs(env.iter().copied())
        .env(EMULATE_ENV, "1")
        .env_remove("KILN_REQUIRE_CUDA")
        .output()
        .expect("the test binary runs again");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), text))
}
