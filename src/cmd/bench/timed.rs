//! The timed runs of `kiln bench`: warm-up runs, then the runs it reports, each as the
//! trainer or the decoder would run it with the executor chosen.

use std::collections::BTreeMap;
use std::time::Instant;

use kiln_compiler::reference::RunOptions;
use kiln_compiler::tensor::{Tensor, TensorData};
use kiln_dsl::Error;
use kiln_exec::executor::{DeviceResident, Exec, ExecutorKind, Timing};

use super::device::device_update;
use super::report::Profile;
use super::rig::Rig;
use super::BenchArgs;
use crate::plain;

/// What the timed runs measured.
#[derive(Default)]
pub(super) struct Measured {
    /// Seconds per run, the optimizer step included.
    pub times: Vec<f64>,
    /// Seconds of the optimizer step per run (0 without one).
    pub adam_times: Vec<f64>,
    /// `--profile`: the last run's kernels.
    pub profile: Profile,
}

fn err(e: impl ToString) -> Error {
    plain("kiln::bench", e.to_string(), None)
}

impl Rig {
    pub fn time(&mut self, a: &BenchArgs) -> Result<Measured, Error> {
        let mut opts = RunOptions {
            seed: 1,
            step: 1,
            ..RunOptions::default()
        };
        let mut m = Measured::default();
        // Without an optimizer step the parameters never change: an executor may keep
        // them on its device between runs (the decoder's promise). A training step's
        // optimizer changes them: every run is a new version.
        let fixed_params = kiln_exec::executor::fresh_params_version();
        for run in 0..a.warmup + a.runs {
            opts.params_version = if self.adam.is_some() {
                Some(kiln_exec::executor::fresh_params_version())
            } else {
                Some(fixed_params)
            };
            let last = a.profile && run + 1 == a.warmup + a.runs;
            let (seconds, update) = self.run_once(a, &opts, last, &mut m.profile)?;
            if run >= a.warmup {
                m.times.push(seconds);
                m.adam_times.push(update);
            }
        }
        Ok(m)
    }

    /// One run: its seconds, and those of its optimizer step.
    fn run_once(
        &mut self,
        a: &BenchArgs,
        opts: &RunOptions,
        last: bool,
        profile: &mut Profile,
    ) -> Result<(f64, f64), Error> {
        let started = Instant::now();
        if self.resident.is_some() {
            self.resident_step(a, opts)?;
            return Ok((started.elapsed().as_secs_f64(), 0.0));
        }
        if let Some(dp) = &self.parallel {
            let jobs: Vec<_> = (0..dp.world_size())
                .map(|_| kiln_exec::cuda::parallel::RankJob {
                    inputs: self.inputs.clone(),
                    opts: *opts,
                    weight: 1.0,
                })
                .collect();
            let outs = dp.train_micro(&jobs, &self.params, true).map_err(err)?;
            let fwd = started.elapsed().as_secs_f64();
            let bad = outs.into_iter().find_map(|o| o.non_finite);
            let upd = device_update(bad, &mut self.host_adam, |k| dp.train_update(k, 1.0))?;
            return Ok((fwd + upd, upd));
        }
        if let (Some(c), true) = (&self.cuda, self.device_training) {
            let mut rec = |t: &Timing<'_>| profile.note(t);
            let rec = if last { Some(&mut rec as _) } else { None };
            let out = c
                .train_micro(&self.inputs, &self.params, opts, 1.0, true, rec)
                .map_err(err)?;
            let fwd = started.elapsed().as_secs_f64();
            let upd = device_update(out.non_finite, &mut self.host_adam, |k| {
                c.train_update(k, 1.0)
            })?;
            return Ok((fwd + upd, upd));
        }
        if let (Some(c), true) = (&self.cuda, self.outputs_on_device) {
            // Every output stays on the device (copied out of the arena there); the run
            // ends with the device synchronized.
            let (_, kept) = c
                .run_resident(&self.inputs, &BTreeMap::new(), &self.params, opts, &|_| {
                    true
                })
                .map_err(err)?;
            let fwd = started.elapsed().as_secs_f64();
            drop(kept);
            return Ok((fwd, 0.0));
        }
        let outs = self.host_run(a, opts, last, profile)?;
        let fwd = started.elapsed().as_secs_f64();
        let upd = if self.adam.is_some() {
            self.host_update(outs, opts)?
        } else {
            0.0
        };
        Ok((fwd + upd, upd))
    }

    /// A decoding step with its state on the GPU: the rows gathered, the step run with
    /// the state bound in place, each row's best tokens selected there.
    fn resident_step(&self, a: &BenchArgs, opts: &RunOptions) -> Result<(), Error> {
        let (Some(c), Some(held)) = (&self.cuda, &self.resident) else {
            return Ok(());
        };
        let names: Vec<&String> = held.keys().collect();
        let rows: Vec<usize> = (0..a.batch as usize).collect();
        let gathered = c
            .take_rows(&held.values().collect::<Vec<_>>(), &rows)
            .map_err(err)?;
        let state: BTreeMap<String, _> = names.into_iter().cloned().zip(gathered).collect();
        // The caches and the logits stay on the device; beam search (beam 4, the paper's)
        // reads each row's best 8 tokens, selected there.
        let keep = |n: &str| n.starts_with(kiln_compiler::ir::CACHE_PREFIX) || n == "logits";
        let (_, kept) = c
            .run_resident(&self.step_inputs, &state, &self.params, opts, &keep)
            .map_err(err)?;
        let logits = kept
            .get("logits")
            .ok_or_else(|| err("the decoding step has no `logits`"))?;
        let d = kiln_decode::search::DecodeOptions::default();
        c.row_top_k(logits, 2 * d.beam, &[d.pad, d.bos], d.eos)
            .map_err(err)?;
        Ok(())
    }

    /// The entry run with its inputs and outputs on the host (the last run profiled
    /// where `--profile` asks).
    fn host_run(
        &self,
        a: &BenchArgs,
        opts: &RunOptions,
        last: bool,
        profile: &mut Profile,
    ) -> Result<Vec<(String, Tensor)>, Error> {
        let (inputs, params) = (&self.inputs, &self.params);
        let mut rec = |t: &Timing<'_>| profile.note(t);
        match (&self.compiled, a.executor) {
            (Some(c), ExecutorKind::Compiled) if last => {
                c.run_profiled(inputs, params, opts, &mut rec)
            }
            (_, ExecutorKind::Eager) if last => {
                let e = kiln_exec::Eager::new(self.g.clone()).map_err(err)?;
                let (outs, times) = e.run_profiled(inputs, params, opts).map_err(err)?;
                for t in times {
                    profile.kinds.insert(t.op.to_string(), (t.seconds, t.nodes));
                }
                Ok(outs)
            }
            (_, ExecutorKind::Cuda) if last => {
                self.exec().run_profiled(inputs, params, opts, &mut rec)
            }
            (Some(c), _) => c.run(inputs, params, opts),
            (None, _) => self.exec().run(inputs, params, opts),
        }
        .map_err(err)
    }

    /// A training step's optimizer step on the host: `--adam-program`'s compiled
    /// `adam_update`, else the trainer's. Its seconds.
    fn host_update(
        &mut self,
        outs: Vec<(String, Tensor)>,
        opts: &RunOptions,
    ) -> Result<f64, Error> {
        let t1 = Instant::now();
        let grads: BTreeMap<String, Tensor> = outs
            .into_iter()
            .filter_map(|(n, t)| n.strip_prefix("grad.").map(|p| (p.to_string(), t)))
            .collect();
        if let Some(ax) = &self.adam_exec {
            let mut feed: BTreeMap<String, Tensor> = BTreeMap::new();
            feed.insert(
                "step_size".into(),
                Tensor::f32(vec![], vec![1e-4]).map_err(err)?,
            );
            feed.insert(
                "inv_sqrt_bc2".into(),
                Tensor::f32(vec![], vec![1.0]).map_err(err)?,
            );
            for (n, t) in &self.params {
                feed.insert(n.clone(), t.clone());
                if let Some(gr) = grads.get(n) {
                    feed.insert(format!("grad.{n}"), gr.clone());
                }
            }
            for (n, t) in &self.moments {
                feed.insert(n.clone(), t.clone());
            }
            let out = ax.run(&feed, &BTreeMap::new(), opts).map_err(err)?;
            for (n, t) in out {
                if n.starts_with("m.") || n.starts_with("v.") {
                    self.moments.insert(n, t);
                } else {
                    self.params.insert(n, t);
                }
            }
            return Ok(t1.elapsed().as_secs_f64());
        }
        let gv: BTreeMap<String, Vec<f32>> = grads
            .into_iter()
            .filter_map(|(n, t)| match t.data {
                TensorData::F32(v) => Some((n, v)),
                _ => None,
            })
            .collect();
        self.host_adam
            .step(&mut self.params, &gv, 1e-4)
            .map_err(|e| plain("kiln::bench", e.0, None))?;
        // As the trainer does: the gradients' storage goes back to the executor.
        if let Some(c) = &self.compiled {
            c.recycle(gv.into_values().map(|v| Tensor {
                shape: vec![v.len()],
                data: TensorData::F32(v),
            }));
        }
        Ok(t1.elapsed().as_secs_f64())
    }
}
