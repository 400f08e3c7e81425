//! One training step: its micro-batches, their gradients accumulated, the loss scale's
//! overflow checks, and the update.

use std::collections::BTreeMap;

use kiln_compiler::autodiff::LOSS_SCALE;
use kiln_compiler::reference::RunOptions;
use kiln_compiler::tensor::{Tensor, TensorData};

use crate::config::Config;
use crate::model::GraphSet;
use kiln_exec::artifact::Artifact;
use kiln_exec::cuda::parallel::{micro_counter, RankJob};

use super::*;

/// A round's micro-batches, one per rank, and each one's target and source tokens.
type RoundJobs = (Vec<RankJob>, Vec<(usize, usize)>);

/// A gradient that is not finite: the parameter and the value.
type Overflow = (String, f32);

impl Trainer {
    /// The next batch, advancing the data position (epochs wrap around).
    pub(super) fn next_batch(&mut self) -> crate::data::Batch {
        if self.state.batch_in_epoch as usize >= self.plan.len() {
            self.state.epoch += 1;
            self.state.batch_in_epoch = 0;
        }
        let order = self.plan.epoch_order(self.state.seed, self.state.epoch);
        let b = order[self.state.batch_in_epoch as usize];
        self.state.batch_in_epoch += 1;
        self.plan
            .batch(self.train.as_ref(), b)
            .expect("batch index from the plan")
    }

    /// The value of the `loss_scale` input, when `train_step` has one: the run's scale
    /// (`train.loss_scale`), or 1 for a loss-scaled graph trained without scaling.
    pub(super) fn scale_input(&self) -> Option<f32> {
        self.graphs.train_step.input(LOSS_SCALE)?;
        Some(self.state.loss_scale.unwrap_or(1.0) as f32)
    }

    /// One optimizer step: the token-weighted loss and the target and source tokens; or,
    /// with dynamic loss scaling, a skipped step whose gradients overflowed.
    pub(super) fn step(
        &mut self,
        grads: &mut BTreeMap<String, Vec<f32>>,
    ) -> Result<StepOutcome, TrainError> {
        let step = self.state.step + 1;
        let objective = self
            .graphs
            .train_step
            .objective
            .clone()
            .unwrap_or_else(|| "loss".to_string());
        let (mut loss_sum, mut tokens, mut src_tokens) = (0.0f64, 0usize, 0usize);
        let scale = self.scale_input();
        // The parameters stay as they are until the optimizer step below.
        let params_version = Some(kiln_exec::executor::fresh_params_version());
        let update_freq = self.cfg.batch.update_freq;
        for round in 0..update_freq {
            let (jobs, counts) = self.round_jobs(step, round, scale, params_version)?;
            let (losses, overflow) = self.run_round(&jobs, grads, round == 0, step, &objective)?;
            if let Some((name, value)) = overflow {
                return self.overflowed(step, name, value);
            }
            for (loss, (tgt, src)) in losses.into_iter().zip(counts) {
                loss_sum += loss as f64 * tgt as f64;
                tokens += tgt;
                src_tokens += src;
            }
        }
        let inv = 1.0 / tokens.max(1) as f32;
        let lr = self
            .cfg
            .schedule
            .lr(self.d_model, step, self.cfg.train.max_steps);
        // Device training: the same constants and op order as `Adam::step` (see
        // `optim::constants`).
        let constants = self.adam.constants(self.adam.t + 1, lr);
        let on_device = match &self.train_exec {
            TrainExec::Host(_) => {
                use rayon::prelude::*;
                grads.par_iter_mut().for_each(|(_, g)| {
                    g.par_chunks_mut(ACC_CHUNK)
                        .for_each(|c| c.iter_mut().for_each(|x| *x *= inv))
                });
                let clip = self.cfg.optimizer.clip_norm;
                if clip > 0.0 {
                    crate::optim::clip_global_norm(grads, clip);
                }
                self.adam
                    .step(&mut self.params, grads, lr)
                    .map_err(setup("the optimizer step"))?;
                None
            }
            TrainExec::Device(exec) => Some(exec.train_update(constants, inv)),
            TrainExec::Parallel(dp) => Some(dp.train_update(constants, inv)),
        };
        if let Some(done) = on_device {
            done.map_err(|source| TrainError::Exec { step, source })?;
            self.adam.t += 1;
            self.device = DeviceState::Ahead;
        }
        if let (Some(ls), Some(s)) = (&self.cfg.train.loss_scale, self.state.loss_scale) {
            self.state.loss_scale_good_steps += 1;
            if self.state.loss_scale_good_steps >= ls.window {
                self.state.loss_scale = Some((s * 2.0).min(MAX_LOSS_SCALE));
                self.state.loss_scale_good_steps = 0;
            }
        }
        self.state.step = step;
        self.state.lr = lr;
        self.state.tgt_tokens_seen += tokens as u64;
        self.state.src_tokens_seen += src_tokens as u64;
        Ok(StepOutcome::Update(
            loss_sum / tokens.max(1) as f64,
            tokens,
            src_tokens,
        ))
    }

    /// Round `round`'s micro-batches, one per rank (one rank but in data parallel), and
    /// each one's target and source tokens.
    fn round_jobs(
        &mut self,
        step: u64,
        round: usize,
        scale: Option<f32>,
        params_version: Option<u64>,
    ) -> Result<RoundJobs, TrainError> {
        let update_freq = self.cfg.batch.update_freq;
        let world = self.world_size();
        // Round `round`: one micro-batch per rank (one rank but in data parallel).
        let mut jobs = Vec::with_capacity(world);
        // Each micro-batch's target and source tokens.
        let mut counts = Vec::with_capacity(world);
        for rank in 0..world {
            let batch = self.next_batch();
            let mut inputs = BTreeMap::new();
            inputs.insert("src".to_string(), batch.src);
            inputs.insert("tgt_in".to_string(), batch.tgt_in);
            inputs.insert("tgt_out".to_string(), batch.tgt_out);
            if let Some(s) = scale {
                let t = Tensor::f32(vec![], vec![s]).map_err(setup("the loss scale"))?;
                inputs.insert(LOSS_SCALE.to_string(), t);
            }
            let counter = micro_counter(step, update_freq, world, round, rank);
            let opts = RunOptions {
                seed: self.state.seed,
                step: counter as u32,
                params_version,
                ..RunOptions::default()
            };
            // The gradients come scaled: unscaled by the weight (exact for a power of
            // two).
            let weight = batch.n_tgt_tokens as f32 / scale.unwrap_or(1.0);
            jobs.push(RankJob {
                inputs,
                opts,
                weight,
            });
            counts.push((batch.n_tgt_tokens, batch.n_src_tokens));
        }
        Ok((jobs, counts))
    }

    /// Runs one round's micro-batches, adding their gradients to `grads` (overwriting
    /// them in the first round): each micro-batch's loss, and the first gradient that is
    /// not finite (the parameter and the value).
    fn run_round(
        &mut self,
        jobs: &[RankJob],
        grads: &mut BTreeMap<String, Vec<f32>>,
        first: bool,
        step: u64,
        objective: &str,
    ) -> Result<(Vec<f32>, Option<Overflow>), TrainError> {
        let mut overflow: Option<Overflow> = None;
        let losses: Vec<f32> = match &self.train_exec {
            TrainExec::Host(exec) => {
                let j = &jobs[0];
                let out = exec
                    .run_map(&j.inputs, &self.params, &j.opts)
                    .map_err(|source| TrainError::Exec { step, source })?;
                let loss = finite_loss(&out, objective, step)?;
                let acc = accumulate(grads, &out, j.weight, first);
                // The outputs' storage goes back to the executor for the next run.
                exec.recycle(out.into_values().collect());
                match acc {
                    Ok(()) => {}
                    Err(Accumulate::Missing(name)) => {
                        return Err(TrainError::Setup(format!(
                            "train_step has no gradient for `{name}`"
                        )))
                    }
                    Err(Accumulate::NonFinite(name, value)) => {
                        overflow = Some((name, value));
                    }
                }
                vec![loss]
            }
            TrainExec::Device(exec) => {
                if self.device == DeviceState::Off {
                    exec.train_begin(&self.params, &self.adam.m, &self.adam.v)
                        .map_err(|source| TrainError::Exec { step, source })?;
                    self.device = DeviceState::InSync;
                }
                let j = &jobs[0];
                let out = exec
                    .train_micro(&j.inputs, &self.params, &j.opts, j.weight, first, None)
                    .map_err(|source| TrainError::Exec { step, source })?;
                overflow = out.non_finite;
                vec![finite_loss(
                    &out.outputs.into_iter().collect(),
                    objective,
                    step,
                )?]
            }
            TrainExec::Parallel(dp) => {
                if self.device == DeviceState::Off {
                    dp.train_begin(&self.params, &self.adam.m, &self.adam.v)
                        .map_err(|source| TrainError::Exec { step, source })?;
                    self.device = DeviceState::InSync;
                }
                let outs = dp
                    .train_micro(jobs, &self.params, first)
                    .map_err(|source| TrainError::Exec { step, source })?;
                let mut losses = Vec::with_capacity(outs.len());
                for out in outs {
                    // The first rank (in rank order) whose gradients overflowed.
                    if overflow.is_none() {
                        overflow = out.non_finite;
                    }
                    losses.push(finite_loss(
                        &out.outputs.into_iter().collect(),
                        objective,
                        step,
                    )?);
                }
                losses
            }
        };
        Ok((losses, overflow))
    }

    /// A gradient that is not finite at step `step`: with dynamic loss scaling, the step
    /// is skipped (nothing was updated; the next step's first micro-batch overwrites the
    /// accumulated gradients) and the scale halved, unless that goes below the minimum;
    /// without it, an error.
    pub(super) fn overflowed(
        &mut self,
        step: u64,
        name: String,
        value: f32,
    ) -> Result<StepOutcome, TrainError> {
        let what = format!("the gradient of `{name}`");
        let (Some(ls), Some(from)) = (&self.cfg.train.loss_scale, self.state.loss_scale) else {
            return Err(TrainError::NonFinite {
                step,
                what,
                value,
                kept: Kept::default(),
            });
        };
        let to = from / 2.0;
        if to < ls.min {
            return Err(TrainError::LossScale {
                step,
                what,
                scale: from,
                min: ls.min,
                kept: Kept::default(),
            });
        }
        self.state.loss_scale = Some(to);
        self.state.loss_scale_good_steps = 0;
        self.state.overflows += 1;
        Ok(StepOutcome::Overflow { what, from, to })
    }

    /// Device training: copies the device's parameters and Adam moments to the host
    /// when the device is ahead (before validation, checkpoints and at the end of
    /// [`Trainer::run`]); nothing otherwise.
    pub(super) fn sync_device(&mut self) -> Result<(), TrainError> {
        if self.device != DeviceState::Ahead {
            return Ok(());
        }
        let (params, m, v) = (&mut self.params, &mut self.adam.m, &mut self.adam.v);
        let done = match &self.train_exec {
            TrainExec::Host(_) => Ok(()),
            TrainExec::Device(exec) => exec.train_download(params, m, v),
            TrainExec::Parallel(dp) => dp.train_download(params, m, v),
        };
        done.map_err(|source| TrainError::Exec {
            step: self.state.step,
            source,
        })?;
        self.device = DeviceState::InSync;
        Ok(())
    }

    /// Ranks of data-parallel training (GPUs); 1 otherwise.
    pub(super) fn world_size(&self) -> usize {
        match &self.train_exec {
            TrainExec::Parallel(dp) => dp.world_size(),
            _ => 1,
        }
    }
}

/// `train.loss_scale` needs a `train_step` seeded by the `loss_scale` input.
pub(super) fn loss_scale_fits(
    cfg: &Config,
    graphs: &GraphSet,
    artifact: Option<&Artifact>,
) -> Result<(), TrainError> {
    if cfg.train.loss_scale.is_none() || graphs.train_step.input(LOSS_SCALE).is_some() {
        return Ok(());
    }
    let fix = match artifact {
        Some(art) => format!(
            "the artifact `{}` was compiled without it: recompile it from this \
             configuration (`kiln compile --config CONFIG -o DIR`)",
            art.dir.display()
        ),
        None => "this run's graphs were built without it: start a new run with \
                 `kiln train --config`"
            .to_string(),
    };
    Err(TrainError::Setup(format!(
        "`train.loss_scale` needs a train_step whose backward pass is seeded by the input \
         `{LOSS_SCALE}`; {fix}"
    )))
}

/// The largest loss scale: 2^127, the largest power of two in f32.
pub(super) const MAX_LOSS_SCALE: f64 = 1.7014118346046923e38;

/// What one call of `Trainer::step` did.
pub(super) enum StepOutcome {
    /// An optimizer update: the token-weighted loss, target and source tokens.
    Update(f64, usize, usize),
    /// Loss scaling: a gradient overflowed, the update was skipped and the scale halved.
    Overflow { what: String, from: f64, to: f64 },
}

/// The scalar loss `name` of a training run's outputs; an error when it is missing or
/// not finite.
pub(super) fn finite_loss(
    out: &BTreeMap<String, Tensor>,
    name: &str,
    step: u64,
) -> Result<f32, TrainError> {
    let loss = scalar(out, name)
        .ok_or_else(|| TrainError::Setup("train_step has no scalar loss".to_string()))?;
    if !loss.is_finite() {
        return Err(TrainError::NonFinite {
            step,
            what: "the loss".to_string(),
            value: loss,
            kept: Kept::default(),
        });
    }
    Ok(loss)
}

pub(super) fn scalar(out: &BTreeMap<String, Tensor>, name: &str) -> Option<f32> {
    let t = out.get(name)?;
    match &t.data {
        TensorData::F32(v) if v.len() == 1 => Some(v[0]),
        TensorData::F64(v) if v.len() == 1 => Some(v[0] as f32),
        _ => None,
    }
}

/// Elements per parallel task of the gradient passes.
pub(super) const ACC_CHUNK: usize = 1 << 16;

/// Why a micro-batch's gradients could not be accumulated.
pub(super) enum Accumulate {
    /// The step's outputs have no gradient for this parameter.
    Missing(String),
    /// This parameter's gradient has a non-finite element (the first one found).
    NonFinite(String, f32),
}

/// `acc = w·g` (`first`) or `acc += w·g` for every parameter's accumulator, with `g` the
/// micro-batch's `grad.NAME` output, checking that `g` is finite on the way: one pass
/// over the gradients, split across the threads. The results do not depend on the
/// split (every element is its own sum).
pub(super) fn accumulate(
    grads: &mut BTreeMap<String, Vec<f32>>,
    out: &BTreeMap<String, Tensor>,
    w: f32,
    first: bool,
) -> Result<(), Accumulate> {
    use rayon::prelude::*;
    let pairs: Vec<(&String, &mut Vec<f32>, &[f32])> = grads
        .iter_mut()
        .map(|(name, acc)| {
            out.get(&format!("grad.{name}"))
                .and_then(|t| t.as_f32())
                .filter(|g| g.len() == acc.len())
                .map(|g| (name, acc, g))
                .ok_or_else(|| Accumulate::Missing(name.clone()))
        })
        .collect::<Result<_, _>>()?;
    let bad = pairs
        .into_par_iter()
        .filter_map(|(name, acc, g)| {
            acc.par_chunks_mut(ACC_CHUNK)
                .zip(g.par_chunks(ACC_CHUNK))
                .filter_map(|(a, g)| {
                    if let Some(x) = g.iter().find(|x| !x.is_finite()) {
                        return Some(*x);
                    }
                    if first {
                        a.iter_mut().zip(g).for_each(|(a, x)| *a = w * x);
                    } else {
                        a.iter_mut().zip(g).for_each(|(a, x)| *a += w * x);
                    }
                    None
                })
                .find_first(|_| true)
                .map(|x| (name, x))
        })
        .find_first(|_| true);
    match bad {
        Some((name, x)) => Err(Accumulate::NonFinite(name.clone(), x)),
        None => Ok(()),
    }
}
