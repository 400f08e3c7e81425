//! `kiln bench`: time an entry point of a spec with an executor.
//!
//! Warm-up runs, then timed runs; prints the median (and min/max) per step, tokens per
//! second and the process's peak resident memory. `train_step` includes the Adam update
//! of every parameter (the compiled executor runs the `adam_update` program; the eager
//! executor the runtime's optimizer; the CUDA executor keeps parameters, gradients and
//! Adam's moments on the GPU and updates them there, as `kiln train` does), as a training
//! step of the paper's recipe does.
//! `decode` is one incremental decoder step with `tgt_len` cached positions.

use kiln_runtime::exec::ExecutorKind;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use kiln_compiler::init::init_params;
use kiln_compiler::optimize::validate::random_feeds_with;
use kiln_compiler::reference::RunOptions;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::Graph;
use kiln_dsl::Error;
use kiln_runtime::compiled::Compiled;
use kiln_runtime::exec::{Exec, Product, Timing};

use crate::cmd::explain::entry_graph_of;
use crate::plain;

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

fn executor(kind: ExecutorKind, g: &Graph) -> Result<Box<dyn Exec>, Error> {
    let err = |e: kiln_compiler::reference::ExecError| plain("kiln::bench", e.to_string(), None);
    Ok(match kind {
        ExecutorKind::Eager => Box::new(kiln_runtime::Eager::new(g.clone()).map_err(err)?),
        _ => Box::new(Compiled::from_graph(g.clone()).map_err(err)?),
    })
}

fn no_cuda(reason: String) -> Error {
    plain(
        "kiln::cuda",
        reason,
        Some("`--executor compiled` benchmarks the CPU backend".to_string()),
    )
}

/// The spec's `entry` compiled as a `--target cuda` artifact into a temporary directory
/// (removed again) and loaded. Without a GPU the error is the guard's reason.
fn cuda_artifact(a: &BenchArgs, entry: &str) -> Result<kiln_runtime::artifact::Artifact, Error> {
    // Before compiling anything: is there a GPU at all?
    kiln_runtime::cuda::cuda_available().map_err(no_cuda)?;
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
    let built = crate::cmd::compile::compile_artifact(
        &args,
        &[entry.to_string()],
        Some(&dir),
        false,
        1,
        &options,
    )
    .and_then(|()| {
        kiln_runtime::artifact::Artifact::load(&dir)
            .map_err(|e| plain("kiln::artifact", e.to_string(), None))
    });
    let _ = std::fs::remove_dir_all(&dir);
    built
}

/// `--precision`.
fn precision(a: &BenchArgs) -> kiln_compiler::options::Precision {
    kiln_compiler::options::Precision::parse(&a.precision).unwrap_or_default()
}

/// The CUDA executor of `entry` (see [`cuda_artifact`]).
fn cuda_executor(a: &BenchArgs, entry: &str) -> Result<kiln_runtime::cuda::CudaExecutor, Error> {
    let art = cuda_artifact(a, entry)?;
    kiln_runtime::cuda::CudaExecutor::with_options(
        &art,
        entry,
        kiln_runtime::cuda::CudaOptions::default(),
    )
    .map_err(|e| no_cuda(e.to_string()))
}

/// Data-parallel training of `train_step` over `devices` (see [`cuda_artifact`]).
fn data_parallel(
    a: &BenchArgs,
    devices: &[usize],
) -> Result<kiln_runtime::cuda::parallel::DataParallel, Error> {
    let art = cuda_artifact(a, "train_step")?;
    kiln_runtime::cuda::parallel::DataParallel::new(
        &art,
        "train_step",
        devices,
        kiln_runtime::cuda::CudaOptions::default(),
    )
    .map_err(|e| plain("kiln::bench", e, None))
}

/// The tail of a training step on the GPU: its gradients must be finite (`non_finite`
/// names the first that is not), then `update` runs Adam's next step with learning rate
/// 1e-4. Returns the update's seconds.
fn device_update(
    non_finite: Option<(String, f32)>,
    adam: &mut kiln_runtime::optim::Adam,
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

/// Peak resident set size of this process, bytes (Linux; 0 elsewhere).
pub fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// What `--profile` gathered from the last run: seconds and count per kernel kind, and
/// per matrix product shape (under its kernel's kind).
#[derive(Default)]
struct Profile {
    kinds: BTreeMap<String, (f64, usize)>,
    products: BTreeMap<(String, Product), (f64, usize)>,
}

impl Profile {
    fn note(&mut self, t: &Timing<'_>) {
        let e = self.kinds.entry(t.what.to_string()).or_insert((0.0, 0));
        e.0 += t.seconds;
        e.1 += 1;
        if let Some(p) = t.product {
            let e = self
                .products
                .entry((t.what.to_string(), p))
                .or_insert((0.0, 0));
            e.0 += t.seconds;
            e.1 += 1;
        }
    }

    /// The product shapes, most time first: `(kind, shape, seconds, count)`.
    fn products_by_time(&self) -> Vec<(&str, Product, f64, usize)> {
        let mut p: Vec<_> = self
            .products
            .iter()
            .map(|((k, p), (s, n))| (k.as_str(), *p, *s, *n))
            .collect();
        p.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.1.cmp(&b.1)));
        p
    }
}

/// How many product shapes the text profile lists (the JSON lists them all).
const PRODUCT_ROWS: usize = 12;

pub fn bench(a: &BenchArgs) -> Result<(), Error> {
    a.gemm.apply(a.executor)?;
    let entry = match a.entry.as_str() {
        "decode" => "decode_step",
        e => e,
    };
    if a.tgt_len == 0 && entry != "decode_step" {
        return Err(plain(
            "kiln::bench",
            format!("--tgt-len 0 leaves `{}` no target tokens to time", a.entry),
            Some("give --tgt-len 1 or more (0 cached positions is for `--entry decode`)".into()),
        ));
    }
    let t0 = Instant::now();
    let g = entry_graph_of(&a.spec, &a.set, &a.model, entry)?;
    let mut dims = BTreeMap::new();
    for d in &g.dims {
        let v = match d.as_str() {
            "batch" => a.batch,
            "src_len" => a.src_len,
            "tgt_len" if entry == "decode_step" => 1,
            "tgt_len" => a.tgt_len,
            "past" => a.tgt_len,
            _ => 1,
        };
        dims.insert(d.clone(), v);
    }
    let (inputs, _) = random_feeds_with(&g, 1, &dims).map_err(|e| plain("kiln::bench", e, None))?;
    let params: BTreeMap<String, Tensor> = init_params(&g, 1)
        .map_err(|e| plain("kiln::bench", e.to_string(), None))?
        .into_iter()
        .collect();
    let compiled = if a.executor == ExecutorKind::Compiled {
        Some(
            Compiled::from_graph(g.clone())
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?,
        )
    } else {
        None
    };
    if let Some(devices) = &a.devices {
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
        kiln_runtime::cuda::parallel::check_devices(devices)
            .map_err(|e| plain("kiln::bench", e.replace("train.devices", "--devices"), None))?;
    }
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
        (None, None) if parallel.is_some() => Some(Box::new(
            kiln_runtime::exec::Reference::new(g.clone())
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?,
        )),
        (Some(_), None) => Some(Box::new(
            kiln_runtime::exec::Reference::new(g.clone())
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?,
        )),
        (None, None) => Some(executor(a.executor, &g)?),
    };
    let exec: &dyn Exec = match (&cuda, &other) {
        (Some(c), _) => c,
        (None, Some(o)) => o.as_ref(),
        (None, None) => unreachable!("one executor is built"),
    };
    // The optimizer step of a training step.
    let adam = if entry == "train_step" {
        let ag = kiln_runtime::compiled_entry_graph(&g, "adam_update")
            .map_err(|e| plain("kiln::bench", e.message, Some(e.help)))?;
        Some(ag)
    } else {
        None
    };
    // The trainer's optimizer step (the runtime's Adam over host tensors) for every
    // executor; `--adam-program` runs the compiled `adam_update` program instead.
    let adam_exec = match (&adam, a.adam_program) {
        (Some(ag), true) => Some(executor(ExecutorKind::Compiled, ag)?),
        _ => None,
    };
    let mut moments: BTreeMap<String, Tensor> = BTreeMap::new();
    if adam.is_some() {
        for (n, t) in &params {
            let z = Tensor::f32(t.shape.clone(), vec![0.0; t.numel()])
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            moments.insert(format!("m.{n}"), z.clone());
            moments.insert(format!("v.{n}"), z);
        }
    }
    let mut host_adam = kiln_runtime::optim::Adam::new(0.9, 0.98, 1e-9, &params);
    // The CUDA executor's training step as the trainer runs it: everything on the GPU.
    let device_training = match &cuda {
        Some(c) if adam.is_some() && !a.host_optimizer => {
            c.train_begin(&params, &host_adam.m, &host_adam.v)
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            Some(c)
        }
        _ => None,
    };
    // The decoder's state on the GPU, as `kiln translate` keeps it: everything but the
    // newest tokens uploaded once; each timed step gathers the rows (the identity order),
    // runs with the state bound in place and downloads only each row's best tokens.
    let resident = match &cuda {
        Some(c) if entry == "decode_step" && !a.host_state && !a.profile => {
            let mut held = BTreeMap::new();
            for (n, t) in inputs.iter().filter(|(n, _)| n.as_str() != "tgt_in") {
                let d = c
                    .to_device(t)
                    .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
                held.insert(n.clone(), d);
            }
            Some((c, held))
        }
        _ => None,
    };
    // The forward on the GPU leaves its outputs there (timed as PyTorch's is).
    let outputs_on_device = match &cuda {
        Some(c) if entry == "forward" && !a.host_outputs && !a.profile => Some(c),
        _ => None,
    };
    // The newest tokens, all a resident step uploads (no copy otherwise).
    let step_inputs: BTreeMap<String, Tensor> = inputs
        .iter()
        .filter(|(n, _)| resident.is_some() && n.as_str() == "tgt_in")
        .map(|(n, t)| (n.clone(), t.clone()))
        .collect();
    if let Some(dp) = &parallel {
        dp.train_begin(&params, &host_adam.m, &host_adam.v)
            .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
    }
    let setup = t0.elapsed().as_secs_f64();
    let mut opts = RunOptions {
        seed: 1,
        step: 1,
        ..RunOptions::default()
    };
    let mut params = params;
    let mut times = Vec::new();
    let mut adam_times = Vec::new();
    let mut profile = Profile::default();
    // Without an optimizer step the parameters never change: an executor may keep them
    // on its device between runs (the decoder's promise). A training step's optimizer
    // changes them: every run is a new version.
    let fixed_params = kiln_runtime::exec::fresh_params_version();
    for run in 0..a.warmup + a.runs {
        opts.params_version = if adam.is_some() {
            Some(kiln_runtime::exec::fresh_params_version())
        } else {
            Some(fixed_params)
        };
        let started = Instant::now();
        if let Some((c, held)) = &resident {
            let names: Vec<&String> = held.keys().collect();
            let rows: Vec<usize> = (0..a.batch as usize).collect();
            let gathered = c
                .take_rows(&held.values().collect::<Vec<_>>(), &rows)
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            let state: BTreeMap<String, _> = names.into_iter().cloned().zip(gathered).collect();
            // The caches and the logits stay on the device; beam search (beam 4, the
            // paper's) reads each row's best 8 tokens, selected there.
            let keep = |n: &str| n.starts_with(kiln_compiler::ir::CACHE_PREFIX) || n == "logits";
            let (_, kept) = c
                .run_resident(&step_inputs, &state, &params, &opts, &keep)
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            let logits = kept.get("logits").ok_or_else(|| {
                plain(
                    "kiln::bench",
                    "the decoding step has no `logits`".into(),
                    None,
                )
            })?;
            let d = kiln_runtime::decode::DecodeOptions::default();
            c.row_top_k(logits, 2 * d.beam, &[d.pad, d.bos], d.eos)
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            if run >= a.warmup {
                times.push(started.elapsed().as_secs_f64());
                adam_times.push(0.0);
            }
            continue;
        }
        if let Some(dp) = &parallel {
            let jobs: Vec<_> = (0..dp.world_size())
                .map(|_| kiln_runtime::cuda::parallel::RankJob {
                    inputs: inputs.clone(),
                    opts,
                    weight: 1.0,
                })
                .collect();
            let outs = dp
                .train_micro(&jobs, &params, true)
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            let fwd = started.elapsed().as_secs_f64();
            let bad = outs.into_iter().find_map(|o| o.non_finite);
            let upd = device_update(bad, &mut host_adam, |k| dp.train_update(k, 1.0))?;
            if run >= a.warmup {
                times.push(fwd + upd);
                adam_times.push(upd);
            }
            continue;
        }
        if let Some(c) = device_training {
            let mut rec = |t: &Timing<'_>| profile.note(t);
            let last = a.profile && run + 1 == a.warmup + a.runs;
            let out = c
                .train_micro(
                    &inputs,
                    &params,
                    &opts,
                    1.0,
                    true,
                    if last { Some(&mut rec) } else { None },
                )
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            let fwd = started.elapsed().as_secs_f64();
            let upd = device_update(out.non_finite, &mut host_adam, |k| c.train_update(k, 1.0))?;
            if run >= a.warmup {
                times.push(fwd + upd);
                adam_times.push(upd);
            }
            continue;
        }
        if let Some(c) = outputs_on_device {
            // Every output stays on the device (copied out of the arena there); the run
            // ends with the device synchronized.
            let (_, kept) = c
                .run_resident(&inputs, &BTreeMap::new(), &params, &opts, &|_| true)
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            let fwd = started.elapsed().as_secs_f64();
            drop(kept);
            if run >= a.warmup {
                times.push(fwd);
                adam_times.push(0.0);
            }
            continue;
        }
        let outs = if a.profile
            && run + 1 == a.warmup + a.runs
            && a.executor == ExecutorKind::Compiled
        {
            let c = compiled.as_ref().expect("compiled");
            let mut rec = |t: &Timing<'_>| profile.note(t);
            c.run_profiled(&inputs, &params, &opts, &mut rec)
        } else if a.profile && run + 1 == a.warmup + a.runs && a.executor == ExecutorKind::Eager {
            let e = kiln_runtime::Eager::new(g.clone())
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            let (outs, times) = e
                .run_profiled(&inputs, &params, &opts)
                .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
            for t in times {
                profile.kinds.insert(t.op.to_string(), (t.seconds, t.nodes));
            }
            Ok(outs)
        } else if a.profile && run + 1 == a.warmup + a.runs && a.executor == ExecutorKind::Cuda {
            let mut rec = |t: &Timing<'_>| profile.note(t);
            exec.run_profiled(&inputs, &params, &opts, &mut rec)
        } else if let Some(c) = &compiled {
            c.run(&inputs, &params, &opts)
        } else {
            exec.run(&inputs, &params, &opts)
        }
        .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
        let fwd = started.elapsed().as_secs_f64();
        let mut upd = 0.0;
        if adam.is_some() {
            let t1 = Instant::now();
            let grads: BTreeMap<String, Tensor> = outs
                .into_iter()
                .filter_map(|(n, t)| n.strip_prefix("grad.").map(|p| (p.to_string(), t)))
                .collect();
            if let Some(ax) = &adam_exec {
                let mut feed: BTreeMap<String, Tensor> = BTreeMap::new();
                feed.insert(
                    "step_size".into(),
                    Tensor::f32(vec![], vec![1e-4]).expect("scalar"),
                );
                feed.insert(
                    "inv_sqrt_bc2".into(),
                    Tensor::f32(vec![], vec![1.0]).expect("scalar"),
                );
                for (n, t) in &params {
                    feed.insert(n.clone(), t.clone());
                    if let Some(gr) = grads.get(n) {
                        feed.insert(format!("grad.{n}"), gr.clone());
                    }
                }
                for (n, t) in &moments {
                    feed.insert(n.clone(), t.clone());
                }
                let out = ax
                    .run(&feed, &BTreeMap::new(), &opts)
                    .map_err(|e| plain("kiln::bench", e.to_string(), None))?;
                for (n, t) in out {
                    if n.starts_with("m.") || n.starts_with("v.") {
                        moments.insert(n, t);
                    } else {
                        params.insert(n, t);
                    }
                }
            } else {
                let gv: BTreeMap<String, Vec<f32>> = grads
                    .into_iter()
                    .filter_map(|(n, t)| match t.data {
                        kiln_compiler::tensor::TensorData::F32(v) => Some((n, v)),
                        _ => None,
                    })
                    .collect();
                host_adam
                    .step(&mut params, &gv, 1e-4)
                    .map_err(|e| plain("kiln::bench", e.0, None))?;
                // As the trainer does: the gradients' storage goes back to the executor.
                if let Some(c) = &compiled {
                    c.recycle(gv.into_values().map(|v| Tensor {
                        shape: vec![v.len()],
                        data: kiln_compiler::tensor::TensorData::F32(v),
                    }));
                }
            }
            upd = t1.elapsed().as_secs_f64();
        }
        if run >= a.warmup {
            times.push(fwd + upd);
            adam_times.push(upd);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            0.0
        } else {
            v[v.len() / 2]
        }
    };
    let (min, max) = (
        times.iter().cloned().fold(f64::INFINITY, f64::min),
        times.iter().cloned().fold(0.0, f64::max),
    );
    let med = median(&mut times.clone());
    let adam_med = median(&mut adam_times);
    let ranks = parallel.as_ref().map_or(1, |dp| dp.world_size());
    let tokens = match entry {
        "decode_step" => a.batch,
        _ => a.batch * a.tgt_len * ranks as i64,
    } as f64;
    // The CUDA executor's GEMM precision is part of what was measured.
    let mut executor_name = if a.executor == ExecutorKind::Cuda {
        match kiln_runtime::cuda::precision_label(precision(a)) {
            "fp32" => "cuda".to_string(),
            g => format!("cuda-{g}"),
        }
    } else if let Some(kernel) = compiled.as_ref().and_then(|c| c.bf16_kernel()) {
        // `--gemm-type` on a CPU with a 16-bit kernel: the large products in 16 bits.
        match kernel {
            kiln_runtime::compiled::Kernel16::Tiles => "compiled-bf16-products".to_string(),
            kiln_runtime::compiled::Kernel16::Dot => "compiled-bf16-products-vdpbf16ps".to_string(),
            kiln_runtime::compiled::Kernel16::Half => "compiled-fp16-products".to_string(),
            kiln_runtime::compiled::Kernel16::Int16 => "compiled-int16-products".to_string(),
        }
    } else {
        a.executor.to_string()
    };
    if resident.is_some() {
        executor_name.push_str(" (state on the GPU)");
    }
    if outputs_on_device.is_some() {
        executor_name.push_str(" (outputs left on the GPU)");
    }
    if let Some(dp) = &parallel {
        executor_name = format!(
            "{executor_name} x{} (GPUs {:?}, {})",
            dp.world_size(),
            dp.devices(),
            dp.engine()
        );
    }
    let rss = peak_rss();
    let threads = rayon::current_num_threads();
    if a.json {
        let obj = serde_json::json!({
            "spec": a.spec.display().to_string(),
            "entry": a.entry,
            "executor": executor_name,
            "batch": a.batch, "src_len": a.src_len, "tgt_len": a.tgt_len,
            "threads": threads,
            "runs": a.runs, "warmup": a.warmup,
            "median_ms": med * 1e3, "min_ms": min * 1e3, "max_ms": max * 1e3,
            "adam_ms": adam_med * 1e3,
            "tokens_per_s": tokens / med,
            "peak_rss_bytes": rss,
            "setup_s": setup,
        });
        let mut obj = obj;
        if let Some(c) = &compiled {
            obj["arena_bytes"] = serde_json::json!(c.arena_bytes());
            obj["scratch_bytes"] = serde_json::json!(c.scratch_bytes());
            let (n, bytes) = c.view_copies();
            obj["view_copies"] = serde_json::json!({"count": n, "bytes": bytes});
            let (summed, separate) = c.bias_grad_counts();
            obj["bias_grads"] = serde_json::json!({"summed": summed, "separate": separate});
            let (groups, kernels) = c.product_groups();
            obj["product_groups"] = serde_json::json!({"groups": groups, "kernels": kernels});
        }
        if !profile.kinds.is_empty() {
            let kinds: serde_json::Map<String, serde_json::Value> = profile
                .kinds
                .iter()
                .map(|(k, (s, n))| (k.clone(), serde_json::json!({"ms": s * 1e3, "kernels": n})))
                .collect();
            let products: Vec<serde_json::Value> = profile
                .products_by_time()
                .into_iter()
                .map(|(k, p, s, n)| {
                    serde_json::json!({
                        "kind": k, "batch": p.batch, "m": p.m, "k": p.k, "n": p.n,
                        "a_transposed": p.a_transposed, "b_transposed": p.b_transposed,
                        "count": n, "ms": s * 1e3,
                        "gflop_per_s": (s > 0.0).then(|| n as f64 * p.flops() / s / 1e9),
                    })
                })
                .collect();
            obj["profile"] = serde_json::json!({"kinds": kinds, "products": products});
        }
        if let Some(c) = &cuda {
            let (fused, separate) = c.epilogue_counts();
            obj["bias_epilogues"] = serde_json::json!({"fused": fused, "separate": separate});
            let (fused, separate) = c.bias_grad_counts();
            obj["bias_grads"] = serde_json::json!({"fused": fused, "separate": separate});
            obj["arena_bytes"] = serde_json::json!(c.arena_bytes());
            let (n, bytes) = c.view_copies();
            obj["view_copies"] = serde_json::json!({"count": n, "bytes": bytes});
        }
        outln!("{obj}");
    } else {
        outln!(
            "bench {} entry={} executor={} batch={} src_len={} tgt_len={} threads={threads}",
            a.spec.display(),
            a.entry,
            executor_name,
            a.batch,
            a.src_len,
            a.tgt_len
        );
        outln!(
            "  median {:.1} ms/step (min {:.1}, max {:.1}; {} runs after {} warm-up){}",
            med * 1e3,
            min * 1e3,
            max * 1e3,
            a.runs,
            a.warmup,
            if adam.is_some() {
                format!("; Adam {:.1} ms of it", adam_med * 1e3)
            } else {
                String::new()
            }
        );
        outln!("  {:.0} target tokens/s", tokens / med);
        outln!(
            "  peak RSS {:.1} MiB; setup (compile, init) {:.2} s",
            rss as f64 / 1048576.0,
            setup
        );
        if let Some(c) = &compiled {
            outln!(
                "  arena {:.1} MiB (the memory plan at these dims)",
                c.arena_bytes() as f64 / 1048576.0
            );
            let (n, bytes) = c.view_copies();
            outln!(
                "  outside the arena: {:.1} MiB live at once for inputs, view copies and kernel \
                 scratch ({n} view copies of {:.1} MiB in all)",
                c.scratch_bytes() as f64 / 1048576.0,
                bytes as f64 / 1048576.0
            );
            let (summed, separate) = c.bias_grad_counts();
            if summed + separate > 0 {
                outln!(
                    "  bias gradients: {summed} summed by their weight gradient's product as it \
                     packed dy, {separate} by sum_rows ({} runs)",
                    a.warmup + a.runs
                );
            }
            let (groups, kernels) = c.product_groups();
            if groups > 0 {
                outln!(
                    "  products of one left operand: {kernels} in {groups} groups that packed \
                     it once ({} runs)",
                    a.warmup + a.runs
                );
            }
        }
        if let Some(c) = &cuda {
            outln!(
                "  device arena {:.1} MiB (the memory plan at these dims)",
                c.arena_bytes() as f64 / 1048576.0
            );
            let (fused, separate) = c.epilogue_counts();
            if fused + separate > 0 {
                outln!(
                    "  linear kernels with a bias: {fused} in one cuBLASLt call (bias epilogue), \
                     {separate} as bias + GEMM (+ ReLU) ({} runs)",
                    a.warmup + a.runs
                );
            }
            let (fused, separate) = c.bias_grad_counts();
            if fused + separate > 0 {
                outln!(
                    "  bias gradients: {fused} summed by their weight gradient's GEMM (cuBLASLt \
                     BGRADA epilogue), {separate} by sum_rows ({} runs)",
                    a.warmup + a.runs
                );
            }
            let (n, bytes) = c.view_copies();
            outln!(
                "  view copies: {n} of {:.1} MiB in all (outside the arena)",
                bytes as f64 / 1048576.0
            );
        }
        if !profile.kinds.is_empty() {
            let mut p: Vec<(String, (f64, usize))> = profile.kinds.clone().into_iter().collect();
            p.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
            outln!("  time per kernel kind (last run):");
            // Whole-run figures (the CUDA executor's idle and issue times) come last.
            let (runs, kinds): (Vec<_>, Vec<_>) =
                p.into_iter().partition(|(k, _)| k.starts_with('['));
            let width = kinds
                .iter()
                .chain(&runs)
                .map(|(k, _)| k.chars().count())
                .max()
                .unwrap_or(0)
                .max(22);
            for (k, (s, n)) in kinds {
                outln!("    {k:<width$} {:>9.1} ms  {n:>5} kernels", s * 1e3);
            }
            for (k, (s, _)) in runs {
                outln!("    {k:<width$} {:>9.1} ms", s * 1e3);
            }
        }
        let products = profile.products_by_time();
        if !products.is_empty() {
            // GFLOP/s on the CPU, TFLOP/s on a GPU.
            let (unit, scale) = if a.executor == ExecutorKind::Cuda {
                ("TFLOP/s", 1e12)
            } else {
                ("GFLOP/s", 1e9)
            };
            let (secs, flops) = products.iter().fold((0.0, 0.0), |(s, f), (_, p, t, n)| {
                (s + t, f + *n as f64 * p.flops())
            });
            outln!(
                "  matrix products by shape (last run; m×k·k×n, ᵀ an operand stored \
                 transposed): {} kernels, {:.1} ms, {:.1} {unit}",
                products.iter().map(|p| p.3).sum::<usize>(),
                secs * 1e3,
                flops / secs / scale
            );
            let shown = &products[..products.len().min(PRODUCT_ROWS)];
            let width = shown.iter().map(|p| p.0.chars().count()).max().unwrap_or(0);
            for (k, p, s, n) in shown {
                outln!(
                    "    {:<28} {k:<width$} {n:>4} × {:>8.3} ms = {:>8.1} ms  {:>7.1} {unit}",
                    p.to_string(),
                    s * 1e3 / *n as f64,
                    s * 1e3,
                    *n as f64 * p.flops() / s / scale
                );
            }
            if products.len() > PRODUCT_ROWS {
                outln!(
                    "    … {} more shapes (`--json` lists them all)",
                    products.len() - PRODUCT_ROWS
                );
            }
        }
    }
    Ok(())
}
