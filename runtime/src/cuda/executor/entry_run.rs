//! One run of the entry on the device: bind the inputs and parameters, place every value,
//! launch the launch plan's kernels in order, and copy the outputs back.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kiln_compiler::bind::Binder;
use kiln_compiler::codegen::cuda::optim;
use kiln_compiler::ir::DType;
use kiln_compiler::optimize::kernels::Def;
use kiln_compiler::reference::{ExecError, Precision, RunOptions};
use kiln_compiler::tensor::Tensor;

use super::*;
use crate::eager::value::Layout;
use crate::exec::Product;

impl CudaExecutor {
    /// A run; with `micro`, one micro-batch of device training (the parameters are the
    /// device's, the gradients go into its accumulators instead of to the host).
    pub(super) fn run_with(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
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
        // A bf16 device tensor stands for an f32 input of the graph (a mixed-precision
        // program's caches): the binder sees f32, and the placement below checks the
        // dtype against the storage plan.
        let held: BTreeMap<String, (Vec<usize>, DType)> = resident
            .map(|r| {
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
            })
            .unwrap_or_default();
        let bind = Binder::with_resident(&self.graph, inputs, &held, params, EXECUTOR)?;
        let dims = bind.dims.clone();
        let layout = self.layouts.get(&self.plan, &dims)?;
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.device.bind().map_err(dev_err)?;
        let words = layout.total / 4;
        if guard.arena.as_ref().is_none_or(|a| a.words < words) {
            guard.arena = None;
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
            if guard.device.memory_info().is_none() {
                kiln_compiler::memory::ensure(layout.total as u64, what, || fix.to_string())?;
            }
            let a = guard.device.alloc(words).map_err(|e| {
                let free = match guard.device.memory_info() {
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
                    kiln_compiler::memory::size(layout.total as u64)
                ))
            })?;
            guard.arena = Some(a);
        }
        // The parameters' device copies are kept for runs of the same version (taken out
        // here, put back after a successful run).
        let mut cache = match (opts.params_version, guard.params.take()) {
            (Some(v), Some(c)) if c.version == v => Some(c),
            (Some(v), _) => Some(ParamCache {
                version: v,
                bufs: BTreeMap::new(),
                casts: HashMap::new(),
            }),
            (None, _) => None,
        };
        let st = &*guard;
        let training = match micro {
            None => None,
            Some(mb) => {
                let t = st.training.as_ref().ok_or_else(|| {
                    ExecError::Unsupported(
                        "a training micro-batch before `train_begin` put the parameters on \
                         the device"
                            .to_string(),
                    )
                })?;
                st.device
                    .write(t.scalars.ptr, &[mb.weight.to_bits()])
                    .map_err(dev_err)?;
                st.device.zero(t.bad.ptr, t.params.len()).map_err(dev_err)?;
                Some(t)
            }
        };
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
        // Whether a parameter was uploaded in this run (kept bf16 casts are then stale).
        let mut param_uploaded = false;
        let node_err = |v: usize, m: String| ExecError::Node {
            node: format!("kernel value %{v} ({})", self.kg.values[v].scope),
            message: m,
        };
        // Locations by value. The sources (inputs, parameters, constants) are bound at
        // every run; the views and kernel results are made once per dims and sources'
        // dtypes (`State::bound`) and placed at this run's addresses.
        let mut locs: Vec<Vec<DLoc>> = vec![Vec::new(); self.kg.values.len()];
        let kept = st.bound.get(&dims).cloned();
        for &(v, node) in &self.sources {
            let val = &self.kg.values[v];
            let shape = match &kept {
                Some(b) => b.locs[v][0].layout.shape.clone(),
                None => val.types[0].shape.eval(&dims).map_err(|m| node_err(v, m))?,
            };
            let loc = match &val.def {
                Def::Input(name) => {
                    let id = node
                        .ok_or_else(|| node_err(v, format!("the graph has no input `{name}`")))?;
                    if let Some(t) = resident.and_then(|r| r.inputs.get(name.as_str())) {
                        if t.shape != shape {
                            return Err(node_err(
                                v,
                                format!(
                                    "the device's `{name}` has shape {:?}, the entry needs {:?}",
                                    t.shape, shape
                                ),
                            ));
                        }
                        let held = DLoc {
                            ptr: t.buf.ptr,
                            layout: Layout::contiguous(&shape),
                            dtype: t.dtype,
                        };
                        let want = self.stored(v, 0);
                        if want == DType::BF16 && held.dtype == DType::F32 {
                            // An f32 tensor (`to_device`) for a bf16 input: rounded here.
                            r.rounded_to_bf16(&held).map_err(|m| node_err(v, m))?
                        } else if held.dtype != want {
                            return Err(node_err(
                                v,
                                format!(
                                    "the device's `{name}` holds {:?}, the entry reads {want:?}",
                                    held.dtype
                                ),
                            ));
                        } else {
                            held
                        }
                    } else {
                        let src = bind.input(id, name)?;
                        let bf16 = self.stored(v, 0) == DType::BF16;
                        r.source(src, &shape, bf16).map_err(|m| node_err(v, m))?
                    }
                }
                Def::Param(name) => {
                    let id = node.ok_or_else(|| {
                        node_err(v, format!("the graph has no parameter `{name}`"))
                    })?;
                    let src = bind.param(id, name, &shape)?;
                    if let Some(t) = training {
                        let tp = t.params.get(name).ok_or_else(|| {
                            node_err(
                                v,
                                format!("parameter `{name}` is not among the trained ones"),
                            )
                        })?;
                        if tp.shape != shape {
                            return Err(node_err(
                                v,
                                format!(
                                    "parameter `{name}` is trained with shape {:?}, the entry \
                                     needs {:?}",
                                    tp.shape, shape
                                ),
                            ));
                        }
                        r.params.insert(tp.p.ptr);
                        DLoc {
                            ptr: tp.p.ptr,
                            layout: Layout::contiguous(&shape),
                            dtype: DType::F32,
                        }
                    } else {
                        let loc = match cache.as_mut() {
                            None => r.source(src, &shape, false).map_err(|m| node_err(v, m))?,
                            Some(c) => {
                                let (words, dtype, key) = source_words(&src);
                                let hit = c.bufs.get(name).is_some_and(|(k, _, _)| *k == key);
                                if !hit {
                                    let b = st.device.upload(&words).map_err(|m| node_err(v, m))?;
                                    c.bufs.insert(name.to_string(), (key, dtype, b));
                                    param_uploaded = true;
                                }
                                let (_, dtype, b) = &c.bufs[name];
                                DLoc {
                                    ptr: b.ptr,
                                    layout: Layout::contiguous(&shape),
                                    dtype: *dtype,
                                }
                            }
                        };
                        r.params.insert(loc.ptr);
                        loc
                    }
                }
                Def::Const(c, dtype) => {
                    let bits = match dtype {
                        DType::I32 => c.get() as i32 as u32,
                        DType::Bool => (c.get() != 0.0) as u32,
                        _ => (c.get() as f32).to_bits(),
                    };
                    // In stream order, without a wait (four bytes, staged by the driver).
                    let ptr = r.upload_enqueued(&[bits]).map_err(|m| node_err(v, m))?;
                    DLoc {
                        ptr,
                        layout: Layout::contiguous(&[]),
                        dtype: *dtype,
                    }
                }
                _ => {
                    return Err(node_err(
                        v,
                        "internal: not an input, parameter or constant".into(),
                    ))
                }
            };
            locs[v] = vec![loc];
        }
        let dtypes: Vec<DType> = self
            .sources
            .iter()
            .map(|&(v, _)| locs[v][0].dtype)
            .collect();
        // Reshapes of non-contiguous views: copied when first read, freed after their last
        // reader; `needs[v]` lists the copies value `v` reads through.
        let (needs, copies, made) = match kept.filter(|b| b.dtypes == dtypes) {
            Some(b) => {
                b.place(&mut locs, base);
                (b.needs.clone(), b.copies.clone(), None)
            }
            None => {
                let d = self.bind_derived(&dims, base, &layout, &mut locs)?;
                let b = Bound::of(&d, &locs, base, dtypes);
                (d.needs, d.copies, Some(b))
            }
        };
        let mut copies: Vec<DevCopy> = copies
            .into_iter()
            .map(|plan| DevCopy { plan, buf: None })
            .collect();
        phases.end(&st.device, "upload").map_err(dev_err)?;
        // The casts kept from the last run of this version, unless a parameter changed
        // buffers (a freed buffer's address may come back with other contents).
        if let Some(c) = cache.as_mut() {
            let kept = std::mem::take(&mut c.casts);
            if !param_uploaded && training.is_none() {
                r.casts = kept;
            }
        }
        let freed = crate::exec::copies_freed_after(
            copies.len(),
            &needs,
            self.steps.iter().map(|s| s.inputs.as_slice()),
            self.kg.outputs.iter().map(|(_, v)| *v),
        );
        let mut launches = st.launches.as_ref().map(|_| Vec::new());
        for (s, step) in self.steps.iter().enumerate() {
            phases.begin(&st.device).map_err(dev_err)?;
            for &x in &step.inputs {
                r.materialize(&needs[x], &mut copies, &mut locs)
                    .map_err(|m| node_err(step.value, m))?;
            }
            let ins: Vec<&DLoc> = step.inputs.iter().map(|&x| &locs[x][0]).collect();
            let outs = &locs[step.value];
            let held = r.keep.len();
            let paired = match step.bias_grad {
                Some(other) if r.fused_bias_grads => {
                    r.bias_grad_pair(&self.steps, s, other, &ins, outs, &locs, &needs)
                }
                _ => Ok(Paired::No),
            };
            let paired = paired.map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?;
            if paired == Paired::No {
                r.exec(step, &ins, outs)
                    .map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?;
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
            if profiling {
                let what = format!("{} ({})", step.kind, step.exec.how());
                let product = match step.kind.as_str() {
                    "matmul" | "linear" | "linear_relu" if ins.len() >= 2 => {
                        Product::of(&ins[0].layout, &ins[1].layout)
                    }
                    _ => None,
                };
                phases
                    .end_product(&st.device, &what, product)
                    .map_err(dev_err)?;
            }
        }
        if let Some(g) = r.bias_deferred.keys().next() {
            return Err(dev_err(format!(
                "internal: a bias gradient was left for step {g}, which did not take it"
            )));
        }
        phases.begin(&st.device).map_err(dev_err)?;
        let mut out = Vec::with_capacity(self.graph.outputs.len());
        let mut kept = BTreeMap::new();
        // Device training: each parameter's gradient, contiguous, as accumulated.
        let mut grads: BTreeMap<&str, DLoc> = BTreeMap::new();
        // ... by one launch over a table of the gradients (optim::GRAD_ENTRY a row).
        let mut grad_table: Vec<u64> = Vec::new();
        let (mut grad_largest, mut first_micro) = (0usize, true);
        for o in &self.graph.outputs {
            let (_, v) = self
                .kg
                .outputs
                .iter()
                .find(|(n, _)| n == &o.name)
                .ok_or_else(|| ExecError::Unsupported(format!("no program output `{}`", o.name)))?;
            r.materialize(&needs[*v], &mut copies, &mut locs)
                .map_err(dev_err)?;
            let trained = training.zip(micro).and_then(|(t, mb)| {
                let name = o.name.strip_prefix("grad.")?;
                let (key, tp) = t.params.get_key_value(name)?;
                Some((t, mb, key.as_str(), tp))
            });
            if let Some((t, mb, name, tp)) = trained {
                let g = r.contig(&locs[*v][0]).map_err(dev_err)?;
                let n = g.numel();
                if g.dtype != DType::F32 || g.shape() != tp.shape.as_slice() {
                    return Err(dev_err(format!(
                        "the gradient of `{name}` is {:?} {:?}, the parameter f32 {:?}",
                        g.dtype,
                        g.shape(),
                        tp.shape
                    )));
                }
                let flag = t.bad.ptr + 4 * tp.index as u64;
                grad_table.extend([g.base(), tp.acc.ptr, flag, n as u64]);
                grad_largest = grad_largest.max(n);
                first_micro = mb.first;
                grads.insert(name, g);
                continue;
            }
            if resident.is_some_and(|res| (res.keep)(&o.name)) {
                let l = &locs[*v][0];
                let buf = st.device.alloc(l.numel()).map_err(dev_err)?;
                r.copy_to(l, buf.ptr).map_err(dev_err)?;
                let t = DeviceTensor {
                    buf,
                    shape: l.shape().to_vec(),
                    dtype: l.dtype,
                };
                kept.insert(o.name.clone(), t);
                continue;
            }
            let t = r.download(&locs[*v][0]).map_err(dev_err)?;
            out.push((o.name.clone(), t));
        }
        if let (Some(t), false) = (training, grad_table.is_empty()) {
            let f = if first_micro {
                optim::GRAD_ASSIGN_MANY
            } else {
                optim::GRAD_ACCUMULATE_MANY
            };
            let tab = r
                .upload_enqueued(&optim::table_words(&grad_table))
                .map_err(dev_err)?;
            let count = grad_table.len() / optim::GRAD_ENTRY;
            st.device
                .launch(
                    f,
                    &[tab, t.scalars.ptr],
                    &[count as i64],
                    optim::many_items(grad_largest),
                )
                .map_err(dev_err)?;
        }
        let mut non_finite = None;
        if let Some(t) = training {
            if let Some(missing) = t.params.keys().find(|n| !grads.contains_key(n.as_str())) {
                return Err(ExecError::Unsupported(format!(
                    "the entry has no gradient output `grad.{missing}` for a trained parameter"
                )));
            }
            let flags = st.device.read(t.bad.ptr, t.params.len()).map_err(dev_err)?;
            // The first flagged parameter in name order, and its first bad element.
            if let Some((name, _)) = t.params.iter().find(|(_, tp)| flags[tp.index] != 0) {
                let words = r.words(&grads[name.as_str()]).map_err(dev_err)?;
                let x = words
                    .into_iter()
                    .map(f32::from_bits)
                    .find(|x| !x.is_finite())
                    .unwrap_or(f32::NAN);
                non_finite = Some((name.clone(), x));
            }
        }
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
}
