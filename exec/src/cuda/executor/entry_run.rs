//! One run of the entry on the device: bind the inputs and parameters, place every value,
//! launch the launch plan's kernels in order, and copy the outputs back.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kiln_compiler::bind::Binder;
use kiln_compiler::ir::DType;
use kiln_compiler::reference::{ExecError, Precision, RunOptions};
use kiln_compiler::tensor::Feeds;

use super::*;
use crate::executor::Product;

/// Per value, the view copies it reads through; the copies; the binding made afresh.
type PlacedDerived = (Vec<Vec<usize>>, Vec<DevCopy>, Option<Bound>);

impl CudaExecutor {
    /// A run; with `micro`, one micro-batch of device training (the parameters are the
    /// device's, the gradients go into its accumulators instead of to the host).
    pub(super) fn run_with(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
        mut rec: Option<Recorder<'_>>,
        micro: Option<Micro>,
        resident: Option<&Resident<'_>>,
    ) -> Result<RunOut, ExecError> {
        let profiling = rec.is_some();
        if opts.precision != Precision::F32 {
            return Err(ExecError::Unsupported(format!(
                "the CUDA executor computes in f32 only, but {:?} precision was requested",
                opts.precision
            )));
        }
        let held = held_types(resident);
        let bind = Binder::with_resident(&self.graph, inputs, &held, params, EXECUTOR)?;
        let dims = bind.dims.clone();
        let layout = self.layouts.get(&self.plan, &dims)?;
        let mut guard = self.state();
        guard.device.bind().map_err(dev_err)?;
        self.ensure_arena(&mut guard, &dims, layout.total)?;
        // The parameters' device copies are kept for runs of the same version (taken out
        // here, put back after a successful run).
        let mut cache = param_cache(opts.params_version, guard.params.take());
        let st = &*guard;
        let training = start_micro(st, micro)?;
        // Profiled runs: marks in the stream around each phase, read at the end.
        let mut phases = Phases::new(profiling);
        phases.begin(&st.device).map_err(dev_err)?;
        let base = st.arena.as_ref().expect("allocated").ptr;
        let mut r = Run {
            dev: &st.device,
            copy: self.copy.as_deref(),
            copy16: self.copy16.as_deref(),
            keep: Vec::new(),
            dims: &dims,
            seed: opts.seed,
            step: opts.step,
            pool: &self.pool,
            bf16: self.bf16,
            fused_epilogues: !self.separate_epilogues,
            fused_bias_grads: !self.separate_bias_grads,
            epilogues: (0, 0),
            bias_grads: (0, 0),
            bias_deferred: HashMap::new(),
            bias_ready: HashMap::new(),
            mirror: HashMap::new(),
            params: std::collections::HashSet::new(),
            casts: HashMap::new(),
        };
        // Locations by value. The sources (inputs, parameters, constants) are bound at
        // every run; the views and kernel results are made once per dims and sources'
        // dtypes (`State::bound`) and placed at this run's addresses.
        let mut locs: Vec<Vec<DLoc>> = vec![Vec::new(); self.kg.values.len()];
        let kept = st.bound.get(&dims).cloned();
        let ctx = sources::SourceCtx {
            bind: &bind,
            dims: &dims,
            kept: kept.as_ref(),
            resident,
            training,
            device: &st.device,
        };
        let param_uploaded = self.bind_sources(&mut r, &ctx, &mut cache, &mut locs)?;
        let (needs, mut copies, made) =
            self.place_derived(kept, &dims, base, &layout, &mut locs)?;
        phases.end(&st.device, "upload").map_err(dev_err)?;
        // The casts kept from the last run of this version, unless a parameter changed
        // buffers (a freed buffer's address may come back with other contents).
        if let Some(c) = cache.as_mut() {
            let kept = std::mem::take(&mut c.casts);
            if !param_uploaded && training.is_none() {
                r.casts = kept;
            }
        }
        let freed = crate::executor::copies_freed_after(
            copies.len(),
            &needs,
            self.steps.iter().map(|s| s.inputs.as_slice()),
            self.kg.outputs.iter().map(|(_, v)| *v),
        );
        let mut launches = st.launches.as_ref().map(|_| Vec::new());
        let placed = (&needs[..], &mut copies[..], &mut locs[..]);
        self.launch_steps(&mut r, &mut phases, placed, &freed, launches.as_mut())?;
        phases.begin(&st.device).map_err(dev_err)?;
        let placed = outputs::Placed {
            needs: &needs,
            copies: &mut copies,
            locs: &mut locs,
        };
        let (out, kept, non_finite) =
            self.outputs(&mut r, &st.device, placed, training.zip(micro), resident)?;
        phases.end(&st.device, "download").map_err(dev_err)?;
        st.device.sync().map_err(dev_err)?;
        if let Some(rec) = rec.as_mut() {
            phases.report(&mut **rec).map_err(dev_err)?;
        }
        let (fused, separate) = r.epilogues;
        let bias_grads = r.bias_grads;
        // Casts of parameters kept on the device outlive the run; a trained parameter
        // changes with the step, so its casts do not.
        if let Some(c) = cache.as_mut().filter(|_| training.is_none()) {
            c.casts = std::mem::take(&mut r.casts);
        }
        drop(r);
        if launches.is_some() {
            guard.launches = launches;
        }
        guard.epilogues.0 += fused;
        guard.epilogues.1 += separate;
        guard.bias_grads.0 += bias_grads.0;
        guard.bias_grads.1 += bias_grads.1;
        guard.view_copies = (copies.len(), copies.iter().map(|c| c.plan.words * 4).sum());
        guard.params = cache;
        match made {
            None => guard.binds.1 += 1,
            Some(b) => {
                guard.binds.0 += 1;
                if guard.bound.len() >= Bound::KEPT {
                    guard.bound.clear();
                }
                guard.bound.insert(dims.clone(), Arc::new(b));
            }
        }
        Ok(RunOut {
            outputs: out,
            non_finite,
            kept,
        })
    }

    /// The views and kernel results placed at this run's arena: as kept for these dims
    /// where the sources' dtypes are the same, else bound afresh (and returned, to keep).
    /// Reshapes of non-contiguous views are copied when first read and freed after their
    /// last reader; `needs[v]` lists the copies value `v` reads through.
    fn place_derived(
        &self,
        kept: Option<Arc<Bound>>,
        dims: &BTreeMap<String, i64>,
        base: u64,
        layout: &kiln_compiler::plan::ArenaLayout,
        locs: &mut [Vec<DLoc>],
    ) -> Result<PlacedDerived, ExecError> {
        let dtypes: Vec<DType> = self
            .sources
            .iter()
            .map(|&(v, _)| locs[v][0].dtype)
            .collect();
        let (needs, copies, made) = match kept.filter(|b| b.dtypes == dtypes) {
            Some(b) => {
                b.place(locs, base);
                (b.needs.clone(), b.copies.clone(), None)
            }
            None => {
                let d = self.bind_derived(dims, base, layout, locs)?;
                let b = Bound::of(&d, locs, base, dtypes);
                (d.needs, d.copies, Some(b))
            }
        };
        let copies = copies
            .into_iter()
            .map(|plan| DevCopy { plan, buf: None })
            .collect();
        Ok((needs, copies, made))
    }

    /// The device arena, grown to `total` bytes where it is smaller.
    fn ensure_arena(
        &self,
        st: &mut State,
        dims: &BTreeMap<String, i64>,
        total: usize,
    ) -> Result<(), ExecError> {
        let words = total / 4;
        if st.arena.as_ref().is_none_or(|a| a.words < words) {
            st.arena = None;
            let what = || {
                let at: Vec<String> = dims.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!(
                    "the device arena of `{}` at {}",
                    self.kg.name,
                    at.join(", ")
                )
            };
            let fix = "run smaller batches (fewer sentences or tokens per batch) or shorter \
                       sequences";
            // The emulated device's memory is the host's: checked as the CPU's arena is.
            if st.device.memory_info().is_none() {
                kiln_compiler::memory::ensure(total as u64, what, || fix.to_string())?;
            }
            let a = st.device.alloc(words).map_err(|e| {
                let free = match st.device.memory_info() {
                    Some((free, total)) => format!(
                        " (the GPU has {} free of {})",
                        kiln_compiler::memory::size(free as u64),
                        kiln_compiler::memory::size(total as u64)
                    ),
                    None => String::new(),
                };
                dev_err(format!(
                    "{} needs {}{free}: {e}; {fix}",
                    what(),
                    kiln_compiler::memory::size(total as u64)
                ))
            })?;
            st.arena = Some(a);
        }
        Ok(())
    }

    /// The launch plan's steps, in order, each with its bias gradient where its GEMM's
    /// epilogue sums it.
    fn launch_steps(
        &self,
        r: &mut Run<'_>,
        phases: &mut Phases,
        (needs, copies, locs): (&[Vec<usize>], &mut [DevCopy], &mut [Vec<DLoc>]),
        freed: &[Vec<usize>],
        mut launches: Option<&mut Vec<Launched>>,
    ) -> Result<(), ExecError> {
        for (s, step) in self.steps.iter().enumerate() {
            phases.begin(r.dev).map_err(dev_err)?;
            for &x in &step.inputs {
                r.materialize(&needs[x], copies, locs)
                    .map_err(|m| self.node_err(step.value, m))?;
            }
            let ins: Vec<&DLoc> = step.inputs.iter().map(|&x| &locs[x][0]).collect();
            let outs = &locs[step.value];
            let held = r.keep.len();
            let paired = match step.bias_grad {
                Some(other) if r.fused_bias_grads => {
                    r.bias_grad_pair(&self.steps, s, other, &ins, outs, locs, needs)
                }
                _ => Ok(Paired::No),
            };
            let paired =
                paired.map_err(|m| self.node_err(step.value, format!("{}: {m}", step.kind)))?;
            if paired == Paired::No {
                r.exec(step, &ins, outs)
                    .map_err(|m| self.node_err(step.value, format!("{}: {m}", step.kind)))?;
            }
            if let Some(t) = launches.as_mut() {
                t.extend(paired.launched(s, step.bias_grad));
            }
            // The kernel's scratch and the copies no later kernel reads (freed in stream
            // order: the memory is reused by later launches only).
            r.keep.truncate(held);
            for &c in &freed[s] {
                copies[c].buf = None;
            }
            if phases.on {
                let what = format!("{} ({})", step.kind, step.exec.how());
                let product = match step.kind.as_str() {
                    "matmul" | "linear" | "linear_relu" if ins.len() >= 2 => {
                        Product::of(&ins[0].layout, &ins[1].layout)
                    }
                    _ => None,
                };
                phases.end_product(r.dev, &what, product).map_err(dev_err)?;
            }
        }
        if let Some(g) = r.bias_deferred.keys().next() {
            return Err(dev_err(format!(
                "internal: a bias gradient was left for step {g}, which did not take it"
            )));
        }
        if let Some(g) = r.bias_deferred.keys().next() {
            return Err(dev_err(format!(
                "internal: a bias gradient was left for step {g}, which did not take it"
            )));
        }
        Ok(())
    }
}

/// The shapes and dtypes of the inputs a run finds on the device. A bf16 device tensor
/// stands for an f32 input of the graph (a mixed-precision program's caches): the binder
/// sees f32, and the placement checks the dtype against the storage plan.
fn held_types(resident: Option<&Resident<'_>>) -> BTreeMap<String, (Vec<usize>, DType)> {
    let Some(r) = resident else {
        return BTreeMap::new();
    };
    r.inputs
        .iter()
        .map(|(n, t)| {
            let seen = if t.dtype == DType::BF16 {
                DType::F32
            } else {
                t.dtype
            };
            (n.clone(), (t.shape.clone(), seen))
        })
        .collect()
}

/// The parameters' device copies kept for runs of the same version (taken out for the
/// run, put back after a successful one).
fn param_cache(version: Option<u64>, kept: Option<ParamCache>) -> Option<ParamCache> {
    match (version, kept) {
        (Some(v), Some(c)) if c.version == v => Some(c),
        (Some(v), _) => Some(ParamCache {
            version: v,
            bufs: BTreeMap::new(),
            casts: HashMap::new(),
        }),
        (None, _) => None,
    }
}

/// A training micro-batch's start: its weight written, the non-finite flags cleared.
fn start_micro(st: &State, micro: Option<Micro>) -> Result<Option<&Training>, ExecError> {
    let Some(mb) = micro else {
        return Ok(None);
    };
    let t = st.training.as_ref().ok_or_else(|| {
        ExecError::Unsupported(
            "a training micro-batch before `train_begin` put the parameters on the device"
                .to_string(),
        )
    })?;
    st.device
        .write(t.scalars.ptr, &[mb.weight.to_bits()])
        .map_err(dev_err)?;
    st.device.zero(t.bad.ptr, t.params.len()).map_err(dev_err)?;
    Ok(Some(t))
}
