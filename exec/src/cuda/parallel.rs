//! Data-parallel training on several GPUs of one process, gradients summed by NCCL.
//!
//! In: a `--target cuda` artifact, its `train_step` entry and the GPUs to use
//! (`train.devices`). Out: [`DataParallel`] — one [`CudaExecutor`] per GPU (a *rank*), each
//! holding a full copy of the parameters, gradient accumulators and Adam's moments (device
//! training, [`CudaExecutor::train_begin`]), and one NCCL communicator per rank
//! (`Comm::from_devices`, one process driving every GPU).
//!
//! An optimizer step with `R` ranks and `batch.update_freq = U` takes `R·U` batches:
//! micro-batch round `u` gives batch `u·R + r` of the step to rank `r`, and the ranks run
//! their micro-batches at the same time, one host thread each. Each rank accumulates the
//! token-weighted gradients of its own micro-batches; then one NCCL all-reduce (sum,
//! in place, all ranks in one group) leaves every rank with the sum over all `R·U`
//! micro-batches, and every rank takes the same Adam step from it. The ranks start from
//! the same parameters and run the same deterministic update on the same sums, so they
//! stay equal without ever being broadcast again. That is fairseq's
//! `--distributed-world-size` with `--update-freq`, and the same data, dropout masks and
//! gradients as one GPU with `update_freq = R·U` (only the order of the gradient sums
//! differs); with one rank the all-reduce copies nothing and the run is bit for bit the
//! run without `train.devices`.
//!
//! NCCL is a cargo feature (`--features nccl`): without it [`DataParallel::new`] says how
//! to rebuild. Like the rest of CUDA, `libnccl` is opened at run time
//! (`cuda::nccl_available`), so the feature builds on a machine without it.

use std::collections::BTreeMap;

use kiln_compiler::reference::{ExecError, RunOptions};
use kiln_compiler::tensor::{Feeds, Tensor};

use super::{CudaExecutor, CudaOptions, MicroOut};
use crate::artifact::Artifact;

/// Checks a list of GPU ordinals for data-parallel training: at least one, none twice
/// (NCCL runs one rank per GPU). The sentence names the fix.
pub fn check_devices(devices: &[usize]) -> Result<(), String> {
    if devices.is_empty() {
        return Err(
            "train.devices is empty; list the GPUs to train on, e.g. [0, 1], or leave it \
             out to train on GPU 0 without NCCL"
                .to_string(),
        );
    }
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(format!(
                "train.devices lists GPU {d} twice; NCCL runs one rank per GPU, so list each \
                 GPU once"
            ));
        }
    }
    Ok(())
}

/// NCCL's version code (`ncclGetVersion`: `major·10000 + minor·100 + patch` since 2.9,
/// `major·1000 + minor·100 + patch` before) as `2.27.3`.
pub fn nccl_version_text(code: i32) -> String {
    let (major, minor, patch) = if code >= 10000 {
        (code / 10000, code % 10000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    };
    format!("{major}.{minor}.{patch}")
}

/// The dropout counter (`RunOptions::step`) and the position in the step's batches of
/// rank `rank`'s micro-batch of round `round`, in a step (1-based) of `update_freq`
/// rounds over `world` ranks: the numbering of one GPU with `update_freq·world`
/// micro-batches, so that both draw the same masks for the same batch.
pub fn micro_counter(
    step: u64,
    update_freq: usize,
    world: usize,
    round: usize,
    rank: usize,
) -> u64 {
    let per_step = (update_freq * world) as u64;
    (step - 1) * per_step + (round * world + rank) as u64
}

/// One rank's micro-batch: its inputs, run options and weight (its target tokens over
/// the loss scale).
pub struct RankJob {
    pub inputs: BTreeMap<String, Tensor>,
    pub opts: RunOptions,
    pub weight: f32,
}

/// Every rank's NCCL communicator, in rank order.
#[cfg(feature = "nccl")]
struct Comms(Vec<cudarc::nccl::Comm>);

// SAFETY: an NCCL communicator may be used from any thread as long as no two threads use
// it at once; `DataParallel` keeps them behind a mutex.
#[cfg(feature = "nccl")]
unsafe impl Send for Comms {}

/// Data-parallel device training over several GPUs (see the module documentation).
pub struct DataParallel {
    /// Declared first: the communicators go before the executors (fields drop in order).
    #[cfg(feature = "nccl")]
    comms: std::sync::Mutex<Comms>,
    ranks: Vec<CudaExecutor>,
    devices: Vec<usize>,
    engine: String,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DataParallel({} on GPUs {:?})",
            self.engine, self.devices
        )
    }
}

fn nccl_err(what: &str) -> impl Fn(String) -> ExecError + '_ {
    move |message| ExecError::Node {
        node: format!("NCCL ({what})"),
        message,
    }
}

/// Runs `f` for every rank, at the same time (one scoped thread per rank beyond the
/// first), and gives the answers in rank order.
fn each_rank<T: Send>(
    ranks: &[CudaExecutor],
    f: impl Fn(usize, &CudaExecutor) -> Result<T, ExecError> + Sync,
) -> Result<Vec<T>, ExecError> {
    if ranks.len() == 1 {
        return Ok(vec![f(0, &ranks[0])?]);
    }
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, exec)| s.spawn(move || f(r, exec)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

impl DataParallel {
    /// One executor of `entry` (the training step) per GPU of `devices`, and their NCCL
    /// communicators. Errors name the fix: a build without the `nccl` feature, no CUDA
    /// or NCCL library, a GPU the driver does not have.
    pub fn new(
        art: &Artifact,
        entry: &str,
        devices: &[usize],
        options: CudaOptions,
    ) -> Result<DataParallel, String> {
        check_devices(devices)?;
        #[cfg(not(feature = "nccl"))]
        {
            let _ = (art, entry, options);
            Err(
                "data-parallel training (`train.devices`) sums the gradients with NCCL, which \
                 this build of kiln leaves out: rebuild it with `cargo build --release \
                 --features nccl`, or leave `train.devices` out to train on one GPU"
                    .to_string(),
            )
        }
        #[cfg(feature = "nccl")]
        {
            let info = super::nccl_available()?;
            if let Some(d) = devices.iter().find(|&&d| d >= info.device_count) {
                return Err(format!(
                    "train.devices lists GPU {d}, but the driver reports {} GPU(s), numbered \
                     from 0",
                    info.device_count
                ));
            }
            let ranks = devices
                .iter()
                .map(|&device| {
                    CudaExecutor::with_options(art, entry, CudaOptions { device, ..options })
                        .map_err(|e| format!("GPU {device}: {e}"))
                })
                .collect::<Result<Vec<_>, String>>()?;
            let code = cudarc::nccl::result::get_nccl_version()
                .map_err(|e| format!("NCCL does not answer: {e:?}"))?;
            let streams = ranks
                .iter()
                .map(|r| r.stream())
                .collect::<Result<Vec<_>, String>>()?;
            let comms = cudarc::nccl::Comm::from_devices(streams).map_err(|e| {
                format!("NCCL cannot make communicators for GPUs {devices:?}: {e:?}")
            })?;
            Ok(DataParallel {
                comms: std::sync::Mutex::new(Comms(comms)),
                ranks,
                devices: devices.to_vec(),
                engine: format!("NCCL {}", nccl_version_text(code)),
            })
        }
    }

    /// The GPUs, in rank order.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// The number of ranks (GPUs).
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// What sums the gradients, e.g. `NCCL 2.27.3`.
    pub fn engine(&self) -> &str {
        &self.engine
    }

    /// [`CudaExecutor::train_begin`] on every rank: the same parameters and moments on
    /// every GPU.
    pub fn train_begin(
        &self,
        params: &Feeds,
        m: &BTreeMap<String, Vec<f32>>,
        v: &BTreeMap<String, Vec<f32>>,
    ) -> Result<(), ExecError> {
        each_rank(&self.ranks, |_, r| r.train_begin(params, m, v)).map(|_| ())
    }

    /// One round of micro-batches: `jobs[r]` on rank `r`, all at once; accumulators
    /// assigned when `first` (the step's first round), added to otherwise. The answers
    /// in rank order.
    pub fn train_micro(
        &self,
        jobs: &[RankJob],
        params: &Feeds,
        first: bool,
    ) -> Result<Vec<MicroOut>, ExecError> {
        if jobs.len() != self.ranks.len() {
            return Err(ExecError::Unsupported(format!(
                "{} micro-batches for {} GPUs: a round gives each GPU one",
                jobs.len(),
                self.ranks.len()
            )));
        }
        each_rank(&self.ranks, |r, exec| {
            let j = &jobs[r];
            exec.train_micro(&j.inputs, params, &j.opts, j.weight, first, None)
        })
    }

    /// The optimizer step: sums every accumulator over the ranks (one NCCL group), then
    /// [`CudaExecutor::train_update`] on every rank with the same constants and `scale`.
    pub fn train_update(&self, constants: [f32; 7], scale: f32) -> Result<(), ExecError> {
        #[cfg(feature = "nccl")]
        {
            let comms = self.comms.lock().unwrap_or_else(|p| p.into_inner());
            cudarc::nccl::group_start().map_err(|e| nccl_err("group start")(format!("{e:?}")))?;
            let queued = self
                .ranks
                .iter()
                .zip(&comms.0)
                .try_for_each(|(r, c)| r.train_all_reduce(c));
            let ended =
                cudarc::nccl::group_end().map_err(|e| nccl_err("group end")(format!("{e:?}")));
            queued?;
            ended?;
        }
        #[cfg(not(feature = "nccl"))]
        let _ = nccl_err;
        each_rank(&self.ranks, |_, r| r.train_update(constants, scale)).map(|_| ())
    }

    /// Copies rank 0's parameters and moments to the host (every rank holds the same).
    pub fn train_download(
        &self,
        params: &mut BTreeMap<String, Tensor>,
        m: &mut BTreeMap<String, Vec<f32>>,
        v: &mut BTreeMap<String, Vec<f32>>,
    ) -> Result<(), ExecError> {
        self.ranks[0].train_download(params, m, v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_are_checked() {
        assert_eq!(check_devices(&[0]), Ok(()));
        assert_eq!(check_devices(&[3, 1, 0]), Ok(()));
        let e = check_devices(&[]).unwrap_err();
        assert!(e.contains("empty") && e.contains("[0, 1]"), "{e}");
        let e = check_devices(&[0, 1, 0]).unwrap_err();
        assert!(e.contains("GPU 0 twice"), "{e}");
    }

    #[test]
    fn nccl_versions_read_as_text() {
        assert_eq!(nccl_version_text(22703), "2.27.3");
        assert_eq!(nccl_version_text(23004), "2.30.4");
        assert_eq!(nccl_version_text(2804), "2.8.4");
    }

    #[test]
    fn ranks_number_micro_batches_as_one_gpu_would() {
        // 2 ranks × 3 rounds: the 6 micro-batches of a step, each once, in order.
        let mut seen = Vec::new();
        for round in 0..3 {
            for rank in 0..2 {
                seen.push(micro_counter(4, 3, 2, round, rank));
            }
        }
        assert_eq!(seen, (18..24).collect::<Vec<u64>>());
        // One rank: the numbering of plain gradient accumulation.
        assert_eq!(micro_counter(1, 2, 1, 1, 0), 1);
        assert_eq!(micro_counter(7, 1, 1, 0, 0), 6);
    }
}
