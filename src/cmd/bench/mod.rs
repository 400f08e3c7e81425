//! `kiln bench`: time an entry point of a spec with an executor.
//!
//! Warm-up runs, then timed runs; prints the median (and min/max) per step, tokens per
//! second and the process's peak resident memory. `train_step` includes the Adam update
//! of every parameter (the compiled executor runs the `adam_update` program; the eager
//! executor the runtime's optimizer; the CUDA executor keeps parameters, gradients and
//! Adam's moments on the GPU and updates them there, as `kiln train` does), as a training
//! step of the paper's recipe does.
//! `decode` is one incremental decoder step with `tgt_len` cached positions.

use std::path::PathBuf;

use kiln_dsl::Error;
use kiln_exec::executor::ExecutorKind;

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// The model spec (a `.kiln` file).
    pub spec: PathBuf,
    /// Override a model parameter: `--set vocab=37000` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Which model of the file, when it defines several.
    #[arg(long)]
    pub model: Option<String>,
    /// What to time: `forward`, `loss` (the forward and the label-smoothed loss, as
    /// validation and `kiln score` run it), `train_step` (forward, backward and Adam) or
    /// `decode` (one decoder step with `tgt-len` cached positions).
    #[arg(long, default_value = "train_step", value_parser = ["forward", "loss", "train_step", "decode"])]
    pub entry: String,
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(i64).range(1..))]
    pub batch: i64,
    #[arg(long = "src-len", default_value_t = 25, value_parser = clap::value_parser!(i64).range(1..))]
    pub src_len: i64,
    /// Target tokens (`decode`: cached positions, which may be 0 for a first step).
    #[arg(long = "tgt-len", default_value_t = 25, value_parser = clap::value_parser!(i64).range(0..))]
    pub tgt_len: i64,
    /// `compiled` (generated kernels), `eager` (one primitive at a time) or `cuda` (the
    /// entry compiled with `--target cuda` and run by the CUDA executor on the GPU).
    #[arg(long, default_value = "compiled",
          value_parser = crate::args::executor_kind(&["compiled", "eager", "cuda"]))]
    pub executor: ExecutorKind,
    #[command(flatten)]
    pub gemm: crate::GemmArgs,
    /// Untimed runs first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed runs.
    #[arg(long, default_value_t = 5,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub runs: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Print the time per kernel kind of the last run. With `--executor cuda`, the GPU's
    /// time per kind from events around each kernel (the run is not synchronized in
    /// between), the time the GPU sat idle waiting for the host's launches, and the
    /// host's time issuing them.
    #[arg(long)]
    pub profile: bool,
    /// Run the optimizer step as the compiled `adam_update` program (fed by copies of
    /// every parameter and moment) instead of the runtime's optimizer.
    #[arg(long)]
    pub adam_program: bool,
    /// With `--executor cuda`, `train_step`: copy the gradients to the host and update
    /// host parameters with the runtime's Adam (uploading them again for every step),
    /// instead of keeping parameters, gradients and moments on the GPU.
    #[arg(long)]
    pub host_optimizer: bool,
    /// With `--executor cuda`, `train_step`: data parallel over these GPUs (`0,1,2,3`),
    /// as `train.devices` trains: every GPU runs the batch, NCCL sums the gradients, every
    /// GPU takes the Adam step (needs a kiln built with `--features nccl`). Tokens/s count
    /// every GPU's batch.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub devices: Option<Vec<usize>>,
    /// With `--executor cuda`, `decode`: upload the caches and the encoder output and
    /// download the grown caches every step, instead of keeping the decoder's state on
    /// the GPU (a row gather, the step, the logits back), as `kiln translate` does.
    /// (`--profile` times the host-state step, kernel by kernel.)
    #[arg(long)]
    pub host_state: bool,
    /// With `--executor cuda`, `forward`: copy the outputs (the logits) to the host after
    /// every run, instead of leaving them on the GPU for a caller that reads them there,
    /// as PyTorch's forward does and the decoder's top-k selection does.
    #[arg(long)]
    pub host_outputs: bool,
    /// With `--executor cuda`: the precision the entry is compiled for (`kiln compile
    /// --precision`): f32, tf32, bf16 or mixed.
    #[arg(long, default_value = "f32", value_parser = kiln_compiler::options::Precision::NAMES)]
    pub precision: String,
}

mod device;
mod report;
mod rig;
mod timed;

pub fn bench(a: &BenchArgs) -> Result<(), Error> {
    a.gemm.apply(a.executor)?;
    let mut rig = rig::Rig::build(a)?;
    let measured = rig.time(a)?;
    report::report(a, &rig, &measured);
    Ok(())
}
