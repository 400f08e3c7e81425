//! Training with its state on the device: parameters, accumulators and Adam's moments
//! uploaded once, micro-batches that consume their gradients there, the update, and the
//! copies back for validation and checkpoints.

use std::collections::BTreeMap;

use kiln_compiler::codegen::cuda::optim;
use kiln_compiler::reference::{ExecError, RunOptions};
use kiln_compiler::tensor::{Feeds, Tensor, TensorData};

use super::*;
use crate::cuda::device::Buf;

impl CudaExecutor {
    /// Starts training with its state on the device: uploads `params` and Adam's moments
    /// `m`, `v` (by parameter name, f32, the moments as long as their parameter) and
    /// zeroes the gradient accumulators. Replaces any earlier training state. Compiles
    /// and loads the optimizer's kernels (`codegen::cuda::optim`) on first use.
    pub fn train_begin(
        &self,
        params: &Feeds,
        m: &BTreeMap<String, Vec<f32>>,
        v: &BTreeMap<String, Vec<f32>>,
    ) -> Result<(), ExecError> {
        let mut guard = self.state();
        guard.device.bind().map_err(dev_err)?;
        guard.training = None;
        load_unit_once(
            &mut guard.device,
            optim::ADAM_STEP,
            optim::code,
            &self.nvrtc_options,
        )
        .map_err(|log| dev_err(format!("NVRTC cannot compile the optimizer: {log}")))?;
        let dev = &guard.device;
        let mut tps = BTreeMap::new();
        for (index, (name, t)) in params.iter().enumerate() {
            let TensorData::F32(p) = &t.data else {
                return Err(ExecError::Unsupported(format!(
                    "parameter `{name}` is not f32: device training keeps f32 parameters"
                )));
            };
            let moment = |which: &str, x: &BTreeMap<String, Vec<f32>>| {
                x.get(name)
                    .filter(|x| x.len() == p.len())
                    .ok_or_else(|| {
                        ExecError::Unsupported(format!(
                            "no Adam moment `{which}` of {} elements for parameter `{name}`",
                            p.len()
                        ))
                    })
                    .map(|x| x.iter().map(|f| f.to_bits()).collect::<Vec<u32>>())
            };
            let (mw, vw) = (moment("m", m)?, moment("v", v)?);
            let bits: Vec<u32> = p.iter().map(|f| f.to_bits()).collect();
            tps.insert(
                name.clone(),
                TrainParam {
                    index,
                    shape: t.shape.clone(),
                    p: dev.upload(&bits).map_err(dev_err)?,
                    acc: dev.alloc(p.len()).map_err(dev_err)?,
                    m: dev.upload(&mw).map_err(dev_err)?,
                    v: dev.upload(&vw).map_err(dev_err)?,
                },
            );
        }
        let bad = dev.alloc(tps.len()).map_err(dev_err)?;
        let rows: Vec<u64> = tps
            .values()
            .flat_map(|tp| {
                [
                    tp.p.ptr,
                    tp.acc.ptr,
                    tp.m.ptr,
                    tp.v.ptr,
                    tp.acc.words as u64,
                ]
            })
            .collect();
        let adam_table = dev.upload(&optim::table_words(&rows)).map_err(dev_err)?;
        let scalars = dev
            .alloc(1 + optim::ADAM_CONSTANTS.len())
            .map_err(dev_err)?;
        dev.sync().map_err(dev_err)?;
        guard.training = Some(Training {
            params: tps,
            bad,
            scalars,
            adam_table,
        });
        Ok(())
    }

    /// One micro-batch of device training: runs the entry on the device's parameters
    /// (`params` gives only the shapes, as the bound dims need them) and adds
    /// `weight·grad.NAME` to each parameter's accumulator (assigns it when `first`).
    /// The other outputs come back to the host. A gradient that is not finite is
    /// reported in [`MicroOut::non_finite`] (its accumulator is then not usable: the
    /// caller stops or starts the step over).
    pub fn train_micro(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
        weight: f32,
        first: bool,
        rec: Option<Recorder<'_>>,
    ) -> Result<MicroOut, ExecError> {
        let out = self.run_with(
            inputs,
            params,
            opts,
            rec,
            Some(Micro { weight, first }),
            None,
        )?;
        Ok(MicroOut {
            outputs: out.outputs,
            non_finite: out.non_finite,
        })
    }

    /// One Adam update of every parameter from its accumulated gradient times `scale`
    /// (`1 / tokens`); `constants` are the first seven `optim::ADAM_CONSTANTS`, as
    /// `Adam::constants` rounds them. Waits for the update to finish.
    pub fn train_update(&self, constants: [f32; 7], scale: f32) -> Result<(), ExecError> {
        let guard = self.state();
        guard.device.bind().map_err(dev_err)?;
        let t = guard.training.as_ref().ok_or_else(|| {
            ExecError::Unsupported("an optimizer step before `train_begin`".to_string())
        })?;
        let mut k: Vec<u32> = constants.iter().map(|c| c.to_bits()).collect();
        k.push(scale.to_bits());
        let dev = &guard.device;
        dev.write(t.scalars.ptr + 4, &k).map_err(dev_err)?;
        // One launch over the table of every parameter's buffers (train_begin's).
        let count = t.params.len();
        let largest = t.params.values().map(|tp| tp.acc.words).max().unwrap_or(0);
        dev.launch(
            optim::ADAM_STEP_MANY,
            &[t.adam_table.ptr, t.scalars.ptr + 4],
            &[count as i64],
            optim::many_items(largest),
        )
        .map_err(dev_err)?;
        dev.sync().map_err(dev_err)
    }

    /// Copies the device's parameters and Adam moments into `params`, `m` and `v`
    /// (which must have every trained parameter, of its size).
    pub fn train_download(
        &self,
        params: &mut BTreeMap<String, Tensor>,
        m: &mut BTreeMap<String, Vec<f32>>,
        v: &mut BTreeMap<String, Vec<f32>>,
    ) -> Result<(), ExecError> {
        let guard = self.state();
        guard.device.bind().map_err(dev_err)?;
        let t = guard.training.as_ref().ok_or_else(|| {
            ExecError::Unsupported("no training state on the device to download".to_string())
        })?;
        let dev = &guard.device;
        let read = |b: &Buf, into: &mut [f32]| -> Result<(), ExecError> {
            let w = dev.read(b.ptr, into.len()).map_err(dev_err)?;
            into.iter_mut()
                .zip(w)
                .for_each(|(d, x)| *d = f32::from_bits(x));
            Ok(())
        };
        for (name, tp) in &t.params {
            let missing = || ExecError::Unsupported(format!("no host copy of `{name}`"));
            let p = params.get_mut(name).ok_or_else(missing)?;
            let n = p.numel();
            let (Some(TensorData::F32(pv)), Some(mv), Some(vv)) = (
                Some(&mut p.data),
                m.get_mut(name).filter(|x| x.len() == n),
                v.get_mut(name).filter(|x| x.len() == n),
            ) else {
                return Err(missing());
            };
            if pv.len() != tp.acc.words {
                return Err(missing());
            }
            read(&tp.p, pv)?;
            read(&tp.m, mv)?;
            read(&tp.v, vv)?;
        }
        Ok(())
    }

    /// The device's stream, for an NCCL communicator ([`super::parallel`]).
    #[cfg(feature = "nccl")]
    pub(crate) fn stream(&self) -> Result<std::sync::Arc<cudarc::driver::CudaStream>, String> {
        let guard = self.state();
        guard.device.stream()
    }

    /// Enqueues an NCCL sum of every gradient accumulator (in name order) over the ranks
    /// of `comm`, in place; the next [`CudaExecutor::train_update`] follows it on the
    /// stream. With several ranks driven from one thread, call it for every rank between
    /// `cudarc::nccl::group_start` and `group_end`.
    #[cfg(feature = "nccl")]
    pub(crate) fn train_all_reduce(&self, comm: &cudarc::nccl::Comm) -> Result<(), ExecError> {
        let mut guard = self.state();
        let st = &mut *guard;
        st.device.bind().map_err(dev_err)?;
        let t = st.training.as_mut().ok_or_else(|| {
            ExecError::Unsupported("an all-reduce before `train_begin`".to_string())
        })?;
        for tp in t.params.values_mut() {
            st.device
                .all_reduce_sum(comm, &mut tp.acc)
                .map_err(dev_err)?;
        }
        Ok(())
    }

    /// Frees the training state on the device.
    pub fn train_end(&self) {
        let mut guard = self.state();
        guard.training = None;
    }
}
