//! The GPU side of `kiln bench`: the entry compiled as a CUDA artifact and loaded, data
//! parallelism over several GPUs, and the optimizer step on the device.

use std::time::Instant;

use kiln_dsl::Error;

use super::BenchArgs;
use crate::plain;

pub(super) fn no_cuda(reason: String) -> Error {
    plain(
        "kiln::cuda",
        reason,
        Some("`--executor compiled` benchmarks the CPU backend".to_string()),
    )
}

/// The spec's `entry` compiled as a `--target cuda` artifact into a temporary directory
/// (removed again) and loaded. Without a GPU the error is the guard's reason.
fn cuda_artifact(a: &BenchArgs, entry: &str) -> Result<kiln_exec::artifact::Artifact, Error> {
    // Before compiling anything: is there a GPU at all?
    kiln_exec::cuda::cuda_available().map_err(no_cuda)?;
    let dir = std::env::temp_dir().join(format!("kiln-bench-{}", std::process::id()));
    let args = crate::cmd::explain::OptArgs {
        spec: a.spec.clone(),
        set: a.set.clone(),
        model: a.model.clone(),
        entry: entry.to_string(),
        target: "cuda".to_string(),
    };
    let options = kiln_compiler::options::CompileOptions {
        target: kiln_compiler::optimize::Target::Cuda,
        cuda_arch: Some(kiln_compiler::codegen::cuda::DEFAULT_ARCH.to_string()),
        precision: precision(a),
        ..Default::default()
    };
    let build = kiln::build::Build {
        entries: &[entry.to_string()],
        output: Some(&dir),
        check: false,
        options: &options,
    };
    let built = kiln::build::compile_artifact((&args.spec, &args.set, &args.model), 1, &build)
        .and_then(|()| {
            kiln_exec::artifact::Artifact::load(&dir)
                .map_err(|e| plain("kiln::artifact", e.to_string(), None))
        });
    let _ = std::fs::remove_dir_all(&dir);
    built
}

/// `--precision`.
pub(super) fn precision(a: &BenchArgs) -> kiln_compiler::options::Precision {
    kiln_compiler::options::Precision::parse(&a.precision).unwrap_or_default()
}

/// The CUDA executor of `entry` (see [`cuda_artifact`]).
pub(super) fn cuda_executor(
    a: &BenchArgs,
    entry: &str,
) -> Result<kiln_exec::cuda::CudaExecutor, Error> {
    let art = cuda_artifact(a, entry)?;
    kiln_exec::cuda::CudaExecutor::with_options(
        &art,
        entry,
        kiln_exec::cuda::CudaOptions::default(),
    )
    .map_err(|e| no_cuda(e.to_string()))
}

/// Data-parallel training of `train_step` over `devices` (see [`cuda_artifact`]).
pub(super) fn data_parallel(
    a: &BenchArgs,
    devices: &[usize],
) -> Result<kiln_exec::cuda::parallel::DataParallel, Error> {
    let art = cuda_artifact(a, "train_step")?;
    kiln_exec::cuda::parallel::DataParallel::new(
        &art,
        "train_step",
        devices,
        kiln_exec::cuda::CudaOptions::default(),
    )
    .map_err(|e| plain("kiln::bench", e, None))
}

/// The tail of a training step on the GPU: its gradients must be finite (`non_finite`
/// names the first that is not), then `update` runs Adam's next step with learning rate
/// 1e-4. Returns the update's seconds.
pub(super) fn device_update(
    non_finite: Option<(String, f32)>,
    adam: &mut kiln_train::optim::Adam,
    update: impl FnOnce([f32; 7]) -> Result<(), kiln_compiler::reference::ExecError>,
) -> Result<f64, Error> {
    if let Some((name, x)) = non_finite {
        return Err(plain(
            "kiln::bench",
            format!("the gradient of `{name}` is not finite ({x})"),
            None,
        ));
    }
    let t = Instant::now();
    adam.t += 1;
    update(adam.constants(adam.t, 1e-4)).map_err(|e| plain("kiln::bench", e.to_string(), None))?;
    Ok(t.elapsed().as_secs_f64())
}
