//! What `kiln bench` times, set up once: the entry's graph at the benchmark's dims, random
//! inputs and parameters, the executor, and a training step's optimizer.

use std::collections::BTreeMap;
use std::time::Instant;

use kiln_compiler::init::init_params;
use kiln_compiler::optimize::validate::random_feeds_with;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::Graph;
use kiln_dsl::Error;
use kiln_exec::compiled::Compiled;
use kiln_exec::cuda::parallel::DataParallel;
use kiln_exec::cuda::{CudaExecutor, DeviceTensor};
use kiln_exec::executor::{DeviceResident, Exec, ExecutorKind};

use super::device::{cuda_executor, data_parallel};
use super::BenchArgs;
use crate::cmd::explain::entry_graph_of;
use crate::plain;

pub(super) struct Rig {
    /// The entry point's name (`decode` is `decode_step`).
    pub entry: String,
    pub g: Graph,
    pub inputs: BTreeMap<String, Tensor>,
    pub params: BTreeMap<String, Tensor>,
    pub compiled: Option<Compiled>,
    pub parallel: Option<DataParallel>,
    pub cuda: Option<CudaExecutor>,
    /// The executor where it is neither the compiled nor the CUDA one.
    pub other: Option<Box<dyn Exec>>,
    /// A training step's optimizer step, as a graph.
    pub adam: Option<Graph>,
    /// `--adam-program`: the compiled `adam_update` program, and Adam's moments for it.
    pub adam_exec: Option<Box<dyn Exec>>,
    pub moments: BTreeMap<String, Tensor>,
    /// The trainer's optimizer step (the runtime's Adam over host tensors).
    pub host_adam: kiln_train::optim::Adam,
    /// The CUDA executor's training step as the trainer runs it: everything on the GPU.
    pub device_training: bool,
    /// The decoder's state on the GPU, as `kiln translate` keeps it: everything but the
    /// newest tokens uploaded once.
    pub resident: Option<BTreeMap<String, DeviceTensor>>,
    /// The forward on the GPU leaves its outputs there (timed as PyTorch's is).
    pub outputs_on_device: bool,
    /// The newest tokens, all a resident step uploads (none otherwise).
    pub step_inputs: BTreeMap<String, Tensor>,
    /// Seconds to compile and initialize.
    pub setup: f64,
}

fn err(e: impl ToString) -> Error {
    plain("kiln::bench", e.to_string(), None)
}

pub(super) fn executor(kind: ExecutorKind, g: &Graph) -> Result<Box<dyn Exec>, Error> {
    Ok(match kind {
        ExecutorKind::Eager => Box::new(kiln_exec::Eager::new(g.clone()).map_err(err)?),
        _ => Box::new(Compiled::from_graph(g.clone()).map_err(err)?),
    })
}

/// The benchmark's value of each of the graph's dims.
fn bench_dims(a: &BenchArgs, g: &Graph, entry: &str) -> BTreeMap<String, i64> {
    g.dims
        .iter()
        .map(|d| {
            let v = match d.as_str() {
                "batch" => a.batch,
                "src_len" => a.src_len,
                "tgt_len" if entry == "decode_step" => 1,
                "tgt_len" => a.tgt_len,
                "past" => a.tgt_len,
                _ => 1,
            };
            (d.clone(), v)
        })
        .collect()
}

/// `--devices`, checked: it times data-parallel training on the GPU only.
fn check_devices(a: &BenchArgs, entry: &str) -> Result<(), Error> {
    let Some(devices) = &a.devices else {
        return Ok(());
    };
    if a.executor != ExecutorKind::Cuda
        || entry != "train_step"
        || a.host_optimizer
        || a.adam_program
    {
        return Err(plain(
            "kiln::bench",
            "`--devices` times data-parallel training on the GPU".to_string(),
            Some(
                "use it with `--executor cuda --entry train_step`, without \
                 `--host-optimizer` or `--adam-program`"
                    .to_string(),
            ),
        ));
    }
    kiln_exec::cuda::parallel::check_devices(devices)
        .map_err(|e| plain("kiln::bench", e.replace("train.devices", "--devices"), None))
}

impl Rig {
    pub fn build(a: &BenchArgs) -> Result<Rig, Error> {
        let entry = match a.entry.as_str() {
            "decode" => "decode_step",
            e => e,
        };
        if a.tgt_len == 0 && entry != "decode_step" {
            return Err(plain(
                "kiln::bench",
                format!("--tgt-len 0 leaves `{}` no target tokens to time", a.entry),
                Some(
                    "give --tgt-len 1 or more (0 cached positions is for `--entry decode`)".into(),
                ),
            ));
        }
        let t0 = Instant::now();
        let g = entry_graph_of(&a.spec, &a.set, &a.model, entry)?;
        let dims = bench_dims(a, &g, entry);
        let (inputs, _) = random_feeds_with(&g, 1, &dims).map_err(err)?;
        let params: BTreeMap<String, Tensor> =
            init_params(&g, 1).map_err(err)?.into_iter().collect();
        let compiled = if a.executor == ExecutorKind::Compiled {
            Some(Compiled::from_graph(g.clone()).map_err(err)?)
        } else {
            None
        };
        check_devices(a, entry)?;
        let parallel = match &a.devices {
            Some(devices) => Some(data_parallel(a, devices)?),
            None => None,
        };
        let cuda = if a.executor == ExecutorKind::Cuda && parallel.is_none() {
            Some(cuda_executor(a, entry)?)
        } else {
            None
        };
        let other: Option<Box<dyn Exec>> = match (&compiled, &cuda) {
            (_, Some(_)) => None,
            (Some(_), None) => Some(Box::new(
                kiln_exec::executor::Reference::new(g.clone()).map_err(err)?,
            )),
            (None, None) if parallel.is_some() => Some(Box::new(
                kiln_exec::executor::Reference::new(g.clone()).map_err(err)?,
            )),
            (None, None) => Some(executor(a.executor, &g)?),
        };
        let adam = if entry == "train_step" {
            let ag = kiln_exec::compiled_entry_graph(&g, "adam_update")
                .map_err(|e| plain("kiln::bench", e.message, Some(e.help)))?;
            Some(ag)
        } else {
            None
        };
        // `--adam-program` runs the compiled `adam_update` program instead of the
        // trainer's optimizer step.
        let adam_exec = match (&adam, a.adam_program) {
            (Some(ag), true) => Some(executor(ExecutorKind::Compiled, ag)?),
            _ => None,
        };
        let mut moments: BTreeMap<String, Tensor> = BTreeMap::new();
        if adam.is_some() {
            for (n, t) in &params {
                let z = Tensor::f32(t.shape.clone(), vec![0.0; t.numel()]).map_err(err)?;
                moments.insert(format!("m.{n}"), z.clone());
                moments.insert(format!("v.{n}"), z);
            }
        }
        let host_adam = kiln_train::optim::Adam::new(&Default::default(), &params);
        let mut rig = Rig {
            entry: entry.to_string(),
            g,
            inputs,
            params,
            compiled,
            parallel,
            cuda,
            other,
            adam,
            adam_exec,
            moments,
            host_adam,
            device_training: false,
            resident: None,
            outputs_on_device: false,
            step_inputs: BTreeMap::new(),
            setup: 0.0,
        };
        rig.on_device(a)?;
        rig.setup = t0.elapsed().as_secs_f64();
        Ok(rig)
    }

    /// What stays on the GPU between runs, as the trainer and the decoder keep it.
    fn on_device(&mut self, a: &BenchArgs) -> Result<(), Error> {
        if let Some(c) = &self.cuda {
            if self.adam.is_some() && !a.host_optimizer {
                c.train_begin(&self.params, &self.host_adam.m, &self.host_adam.v)
                    .map_err(err)?;
                self.device_training = true;
            }
            // Each timed decoding step gathers the state's rows (the identity order),
            // runs with the state bound in place and downloads only each row's best
            // tokens.
            if self.entry == "decode_step" && !a.host_state && !a.profile {
                let mut held = BTreeMap::new();
                for (n, t) in self.inputs.iter() {
                    if n.as_str() == "tgt_in" {
                        self.step_inputs.insert(n.clone(), t.clone());
                    } else {
                        held.insert(n.clone(), c.to_device(t).map_err(err)?);
                    }
                }
                self.resident = Some(held);
            }
            self.outputs_on_device = self.entry == "forward" && !a.host_outputs && !a.profile;
        }
        if let Some(dp) = &self.parallel {
            dp.train_begin(&self.params, &self.host_adam.m, &self.host_adam.v)
                .map_err(err)?;
        }
        Ok(())
    }

    /// The executor that runs the entry where it is not the compiled one.
    pub fn exec(&self) -> &dyn Exec {
        match (&self.cuda, &self.other) {
            (Some(c), _) => c,
            (None, Some(o)) => o.as_ref(),
            (None, None) => unreachable!("one executor is built"),
        }
    }
}
