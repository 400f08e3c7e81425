//! The training tests that need a GPU (each skips, printing why, without one): training
//! on the device follows the compiled executor, loss scaling on the device, data
//! parallel through NCCL.

use super::*;

/// `train.executor: cuda` with a `--target cuda` artifact (`kiln compile --config …
/// --target cuda`): without a GPU, a non-zero exit that names the reason; with one
/// (device training: parameters, gradient accumulators and Adam's moments stay on the
/// GPU), the logged losses of 10 steps within 1e-4 relative of the compiled executor's
/// run and the final parameters and moments within 1e-2 (relative norm: executors differ
/// by float rounding, which Adam's first steps amplify), and resuming continues on the
/// device.
#[test]
fn training_on_the_gpu_follows_the_compiled_executor() {
    let gpu = workspace("gpu_cuda", "");
    edit_cfg(
        &gpu,
        "max_steps: 20, executor: reference",
        "max_steps: 10, executor: cuda",
    );
    let out = compile_and_train(&gpu);
    if require_cuda_or_skip().is_none() {
        let reason = cuda_available().unwrap_err();
        let first: String = reason
            .split_whitespace()
            .take(4)
            .collect::<Vec<_>>()
            .join(" ");
        let err = unwrapped(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(&first), "{err}");
        return;
    }
    assert!(out.status.success(), "{}", unwrapped(&out.stderr));
    let comp = workspace("gpu_compiled", "");
    edit_cfg(
        &comp,
        "max_steps: 20, executor: reference",
        "max_steps: 10, executor: compiled",
    );
    ok(&comp, &["train", "--config", "cfg.yaml", "--quiet"]);
    same_losses(&comp, &gpu, "compiled", "GPU");
    let (pg, sg) = final_state(&gpu, 10);
    let (pc, sc) = final_state(&comp, 10);
    assert_eq!((sg.epoch, sg.batch_in_epoch), (sc.epoch, sc.batch_in_epoch));
    let d = relative_distance(&pc, &pg);
    assert!(
        d <= 1e-2 && d > 0.0,
        "GPU vs compiled after 10 steps: {d:e}"
    );
    ok(
        &gpu,
        &["train", "--resume", "run", "--quiet", "--max-steps", "12"],
    );
    let (p12, s12) = final_state(&gpu, 12);
    assert_eq!(s12.step, 12);
    assert!(
        relative_distance(&pg, &p12) > 0.0,
        "the resumed steps trained"
    );
}

/// Dynamic loss scaling on the GPU's device-resident training: a power-of-two scale that
/// never overflows leaves the run as it is without scaling (the scale reaches the seeded
/// cross-entropy kernel, and the accumulation weights `tokens/S` undo it).
#[test]
fn loss_scaling_on_the_gpu_leaves_the_run_unchanged() {
    let Some(plain) = gpu_run("gpu_unscaled", "max_steps: 6, executor: cuda, log_every: 5") else {
        return;
    };
    let scaled = gpu_run(
        "gpu_scaled",
        "max_steps: 6, executor: cuda, log_every: 5, loss_scale: {init: 1024, window: 2}",
    )
    .expect("a GPU");
    let (pa, _) = final_state(&plain, 6);
    let (pb, sb) = final_state(&scaled, 6);
    assert_eq!((sb.loss_scale, sb.overflows), (Some(8192.0), 0));
    let d = relative_distance(&pa, &pb);
    eprintln!("GPU, scaled vs unscaled after 6 steps: relative distance {d:e}");
    assert!(d <= 1e-6, "scaled vs unscaled on the GPU: {d:e}");
}

/// Data-parallel training (`train.devices`) sums gradients with NCCL: without the `nccl`
/// feature the run is refused with the command that builds it; with it but without a
/// GPU, with CUDA's reason. Nothing is trained either way.
#[test]
fn data_parallel_training_says_what_it_needs() {
    let dir = workspace("dp_needs", "");
    set_train(&dir, "max_steps: 2, executor: cuda, devices: [0]");
    let out = compile_and_train(&dir);
    let err = unwrapped(&out.stderr);
    if cfg!(feature = "nccl") {
        if cuda_available().is_ok() {
            println!("skipped: a GPU is here (data_parallel_on_one_gpu_is_the_single_gpu_run)");
            return;
        }
        assert!(err.contains("CUDA is not available"), "{err}");
    } else {
        assert!(
            err.contains("train.devices")
                && err.contains("NCCL")
                && err.contains("cargo build --release --features nccl"),
            "{err}"
        );
    }
    assert!(!out.status.success());
    assert!(!dir.join("run/checkpoints").exists(), "nothing trained");
}

/// With one GPU, data parallel through NCCL (`devices: [0]`) is bit for bit the
/// single-GPU run: the all-reduce over one rank changes nothing, and the batches and
/// dropout masks are the same. With two GPUs, `devices: [0, 1]` and `update_freq: 1`
/// follow one GPU with `update_freq: 2` (the same batches and masks; only the order of
/// the gradient sums differs).
#[cfg(feature = "nccl")]
#[test]
fn data_parallel_on_one_gpu_is_the_single_gpu_run() {
    let train = "max_steps: 6, executor: cuda, log_every: 1";
    let Some(single) = gpu_run("dp_single", train) else {
        return;
    };
    let one = gpu_run("dp_one_rank", &format!("{train}, devices: [0]")).expect("a GPU");
    assert_eq!(logged_losses(&single), logged_losses(&one));
    let (ps, ss) = final_state(&single, 6);
    let (p1, s1) = final_state(&one, 6);
    assert_eq!((ss.epoch, ss.batch_in_epoch), (s1.epoch, s1.batch_in_epoch));
    same_bits(&ps, &p1, "with one NCCL rank");
    let gpus = cuda_available().unwrap().device_count;
    if gpus < 2 {
        println!("{gpus} GPU: the two-rank comparison needs two");
        return;
    }
    let two = gpu_run_edited(
        "dp_two_ranks",
        &format!("{train}, devices: [0, 1]"),
        &[("update_freq: 2", "update_freq: 1")],
    )
    .expect("two GPUs");
    same_losses(&single, &two, "one GPU", "two GPUs");
    let (p2, s2) = final_state(&two, 6);
    assert_eq!((ss.epoch, ss.batch_in_epoch), (s2.epoch, s2.batch_in_epoch));
    let d = relative_distance(&ps, &p2);
    eprintln!("two NCCL ranks vs one GPU after 6 steps: relative distance {d:e}");
    assert!(d <= 1e-4, "two ranks vs one GPU: {d:e}");
}
