//! One run of the compiled executor: bind, lay out the arena, place every value, launch
//! the launch plan's kernels in order (its product groups and bias-gradient pairs where
//! the products run in 16 bits), copy the outputs out.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_compiler::bind::Binder;
use kiln_compiler::ir::{DType, Op};
use kiln_compiler::optimize::kernels::Def;
use kiln_compiler::reference::{ExecError, Precision, RunOptions};
use kiln_compiler::tensor::{Tensor, TensorData};

use super::*;
use crate::eager::value::Layout;
use crate::exec::{How, Launched, Product, Timing};

impl Compiled {
    pub(super) fn run_inner(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        mut profile: Option<Profile<'_>>,
        dump: Option<&mut Vec<Vec<Tensor>>>,
        gather: Option<Gather<'_>>,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        if opts.precision != Precision::F32 {
            return Err(ExecError::Unsupported(format!(
                "the compiled executor computes in f32 only, but {:?} precision was \
                 requested; use the reference executor for f64",
                opts.precision
            )));
        }
        // Inputs read with their rows gathered bind their dims at the shape they are
        // read with.
        let mut as_read: BTreeMap<String, (Vec<usize>, DType)> = BTreeMap::new();
        if let Some((names, rows)) = gather {
            for name in names {
                let err = |message: String| ExecError::Input {
                    name: name.clone(),
                    message,
                };
                if !self.gatherable.contains(name) {
                    return Err(ExecError::Unsupported(format!(
                        "input `{name}` cannot be read with its rows gathered: a kernel other \
                         than a concatenation reads it"
                    )));
                }
                let t = inputs.get(name).ok_or_else(|| ExecError::MissingInput {
                    name: name.clone(),
                    expected: format!("`{name}` (to gather its rows)"),
                })?;
                if !matches!(t.data, TensorData::F32(_)) || t.shape.is_empty() {
                    return Err(err(format!(
                        "has rows gathered, so it must be f32 of rank ≥ 1, got shape {:?}",
                        t.shape
                    )));
                }
                if let Some(&r) = rows.iter().find(|&&r| r >= t.shape[0]) {
                    return Err(err(format!(
                        "row {r} is gathered, but the tensor has {} rows",
                        t.shape[0]
                    )));
                }
                let mut shape = t.shape.clone();
                shape[0] = rows.len();
                as_read.insert(name.clone(), (shape, DType::F32));
            }
        }
        if gather.is_some() && dump.is_some() {
            return Err(ExecError::Unsupported(
                "a run that dumps every value reads no gathered rows".into(),
            ));
        }
        let bind = Binder::with_resident(&self.graph, inputs, &as_read, params, EXECUTOR)?;
        let dims = bind.dims.clone();
        let layout = self.layouts.get(&self.plan, &dims)?;
        // The shared arena, or one of this run's own while another run holds it (an idle
        // one of an earlier such run if there is one). Never wait for it: runs go on
        // rayon's workers, and a worker waiting for its kernels may take up a second run
        // of this program (rayon steals whole jobs), which would then wait on the worker
        // itself.
        let mut shared = match self.arena.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let mut own = match shared {
            Some(_) => Vec::new(),
            None => self
                .idle_arenas
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop()
                .unwrap_or_default(),
        };
        let arena: &mut Vec<f32> = match shared.as_deref_mut() {
            Some(a) => a,
            None => &mut own,
        };
        let words = layout.total / 4 + ARENA_PAD;
        self.ensure_memory(&dims, layout.total, arena_len(arena) * 4)?;
        if arena.len() < words {
            // The old arena goes before the new one comes: never both at once.
            *arena = Vec::new();
            *arena = zeroed(words);
        }
        let base = aligned_base(arena);
        let mut keep = Keep::with_pool(std::mem::take(
            &mut *self.scratch.lock().unwrap_or_else(|p| p.into_inner()),
        ));
        // Outputs written in place: their storage, taken from recycled outputs of the
        // same length where there are some, else fresh.
        let mut spare = std::mem::take(&mut *self.spare.lock().unwrap_or_else(|p| p.into_inner()));
        let mut direct: Vec<Option<Vec<f32>>> = vec![None; self.direct.len()];
        // Contiguous copies of transposed weights this run reads (kept alive by it).
        let mut held: Vec<Arc<Vec<f32>>> = Vec::new();
        let mut locs: Vec<Vec<Loc>> = Vec::with_capacity(self.kg.values.len());
        // Reshapes of non-contiguous views become copies, made when first read (their
        // source is computed by then, and still alive: views extend liveness) and freed
        // after their last reader. `needs[v]`: the copies value `v` reads through;
        // `origin[v]`: the copy whose buffer `v`'s location starts at.
        let mut copies: Vec<ViewCopy> = Vec::new();
        let mut needs: Vec<Vec<usize>> = Vec::with_capacity(self.kg.values.len());
        let mut origin: Vec<Option<usize>> = Vec::with_capacity(self.kg.values.len());
        let node_err = |v: usize, m: String| ExecError::Node {
            node: format!("kernel value %{v} ({})", self.kg.values[v].scope),
            message: m,
        };
        for (v, val) in self.kg.values.iter().enumerate() {
            let shapes: Vec<Vec<usize>> = val
                .types
                .iter()
                .map(|t| t.shape.eval(&dims))
                .collect::<Result<_, _>>()
                .map_err(|m| node_err(v, m))?;
            let loc = match &val.def {
                // Read with rows gathered: the tensor as it is (its own shape), the rows
                // given to the concatenations that read it.
                Def::Input(name) if as_read.contains_key(name) => {
                    let t = &inputs[name];
                    let TensorData::F32(data) = &t.data else {
                        return Err(node_err(v, "internal: a gathered input not f32".into()));
                    };
                    vec![Loc {
                        ptr: data.as_ptr() as *mut u8,
                        layout: Layout::contiguous(&t.shape),
                        dtype: DType::F32,
                    }]
                }
                Def::Input(name) => {
                    let id = self
                        .graph
                        .input(name)
                        .ok_or_else(|| node_err(v, format!("the graph has no input `{name}`")))?;
                    vec![source_loc(bind.input(id, name)?, &shapes[0], &mut keep)]
                }
                Def::Param(name) => {
                    let id = self.graph.param(name).ok_or_else(|| {
                        node_err(v, format!("the graph has no parameter `{name}`"))
                    })?;
                    vec![source_loc(
                        bind.param(id, name, &shapes[0])?,
                        &shapes[0],
                        &mut keep,
                    )]
                }
                Def::Const(c, dtype) => {
                    let p = keep.alloc(1);
                    let bits = match dtype {
                        DType::I32 => c.get() as i32 as u32,
                        DType::Bool => (c.get() != 0.0) as u32,
                        _ => (c.get() as f32).to_bits(),
                    };
                    // SAFETY: `p` is a fresh one-element buffer.
                    unsafe { *(p as *mut u32) = bits };
                    vec![Loc {
                        ptr: p,
                        layout: Layout::contiguous(&[]),
                        dtype: *dtype,
                    }]
                }
                Def::View(op, x) => {
                    let src = &locs[*x][0];
                    let mut need = needs[*x].clone();
                    let mut from = origin[*x];
                    let layout = match op {
                        Op::Reshape { .. } => src.layout.reshape(&shapes[0]),
                        Op::Permute { perm } => Some(src.layout.permute(perm)),
                        Op::Broadcast { .. } => Some(src.layout.broadcast(&shapes[0])),
                        other => {
                            return Err(node_err(v, format!("`{}` is not a view", other.name())))
                        }
                    };
                    let loc = match layout {
                        Some(layout) => {
                            needs.push(need);
                            let loc = Loc {
                                ptr: src.ptr,
                                layout,
                                dtype: val.types[0].dtype,
                            };
                            match self.weight_copy(v, &loc, opts.params_version) {
                                Some(copy) => {
                                    let l = Loc {
                                        ptr: copy.as_ptr() as *mut u8,
                                        layout: Layout::contiguous(&shapes[0]),
                                        dtype: DType::F32,
                                    };
                                    held.push(copy);
                                    from = None;
                                    vec![l]
                                }
                                None => vec![loc],
                            }
                        }
                        None => {
                            // A reshape of a non-contiguous view: a copy, placed when
                            // it is made.
                            copies.push(ViewCopy {
                                src: *x,
                                words: src.numel(),
                                buf: None,
                                users: Vec::new(),
                            });
                            from = Some(copies.len() - 1);
                            need.push(copies.len() - 1);
                            needs.push(need);
                            vec![Loc {
                                ptr: std::ptr::null_mut(),
                                layout: Layout::contiguous(&shapes[0]),
                                dtype: val.types[0].dtype,
                            }]
                        }
                    };
                    if let Some(c) = from {
                        copies[c].users.push(v);
                    }
                    origin.push(from);
                    loc
                }
                Def::Proj(t, k) => {
                    needs.push(needs[*t].clone());
                    vec![locs[*t][*k as usize].clone()]
                }
                Def::Kernel { .. } => (0..val.types.len())
                    .map(|k| {
                        let ptr = match self.home.get(&(v, k)) {
                            // The first result of an in-place chain places the storage;
                            // the later ones write over it.
                            Some(Home::Output(i)) => match &mut direct[*i] {
                                Some(store) => store.as_mut_ptr() as *mut u8,
                                slot => {
                                    let n: usize = shapes[k].iter().product();
                                    let mut store = take_storage(&mut spare, n);
                                    let ptr = store.as_mut_ptr() as *mut u8;
                                    *slot = Some(store);
                                    ptr
                                }
                            },
                            Some(Home::Arena(b)) => base.wrapping_add(layout.offsets[*b]),
                            None => {
                                return Err(node_err(
                                    v,
                                    "internal: no buffer in the memory plan".into(),
                                ))
                            }
                        };
                        let layout = if self.merged.contains(&(v, k)) {
                            Layout::heads_merged(&shapes[k])
                        } else {
                            Layout::contiguous(&shapes[k])
                        };
                        Ok(Loc {
                            ptr,
                            layout,
                            dtype: val.types[k].dtype,
                        })
                    })
                    .collect::<Result<_, ExecError>>()?,
            };
            if needs.len() < locs.len() + 1 {
                needs.push(Vec::new());
            }
            if origin.len() < locs.len() + 1 {
                origin.push(None);
            }
            locs.push(loc);
        }
        // Which copies each step is the last to read (none while dumping every value).
        let freed = if dump.is_some() {
            vec![Vec::new(); self.steps.len()]
        } else {
            crate::exec::copies_freed_after(
                copies.len(),
                &needs,
                self.steps.iter().map(|s| s.inputs.as_slice()),
                self.kg.outputs.iter().map(|(_, v)| *v),
            )
        };
        let packer = |v: usize, loc: &Loc| self.packed_weight(v, loc, opts.params_version);
        let ctx = launch::RunCtx {
            dims: &dims,
            copy: self.copy,
            checks: Some(&self.checks),
            seed: opts.seed,
            step: opts.step,
            pool: &self.pool,
            bf16: self.bf16_products,
            packed: Some(&packer),
        };
        // Bias gradients written by their weight gradient's product (16-bit products,
        // `launch::product_with_sums`): the `sum_rows` launches left for a later product,
        // and the sums a product wrote for a later `sum_rows`, by the `sum_rows` launch.
        let mut deferred: Vec<usize> = Vec::new();
        let mut summed: Vec<(usize, Vec<f32>)> = Vec::new();
        let fuse_bias = self.bf16_products.is_some();
        // (summed by a product, by their own kernel), for `bias_grad_counts`.
        let mut bias_counts = (0, 0);
        // Groups of products run as one (`launch::product_group`), and the kernels in
        // them; the kernels up to `grouped_until` ran in the last group.
        let mut group_counts = (0, 0);
        let mut grouped_until = 0;
        let mut trace: Option<Vec<Launched>> = self.tracing.then(Vec::new);
        for (s, step) in self.steps.iter().enumerate() {
            if s < grouped_until {
                continue;
            }
            for &x in &step.inputs {
                materialize(self.copy, &needs[x], &mut copies, &mut locs, &mut keep);
            }
            // The launch plan's product group this starts, run as one where the products
            // run in 16 bits (`launch::product_group`).
            let end = match self.launch.group_at(s) {
                Some(g) if self.bf16_products.is_some() => s + g.len,
                _ => s + 1,
            };
            if end > s + 1 {
                for t in &self.steps[s + 1..end] {
                    for &x in &t.inputs {
                        materialize(self.copy, &needs[x], &mut copies, &mut locs, &mut keep);
                    }
                }
                let started = profile.as_ref().map(|_| std::time::Instant::now());
                let group: Vec<&launch::Step> = self.steps[s..end].iter().collect();
                let ins: Vec<Vec<&Loc>> = group
                    .iter()
                    .map(|t| t.inputs.iter().map(|&x| &locs[x][0]).collect())
                    .collect();
                let outs: Vec<&[Loc]> = group.iter().map(|t| locs[t.value].as_slice()).collect();
                // Each weight gradient's bias gradient, as a product on its own would sum
                // it (below): into the `sum_rows` result where that launch was left for
                // this product, else into a buffer of its own that the launch copies.
                let mut plans = Vec::new();
                let mut sums = Vec::with_capacity(group.len());
                for (q, t) in group.iter().enumerate() {
                    let matmul = matches!(t.exec, launch::Exec::Matmul);
                    let Some(other) = t.bias_grad.filter(|_| matmul) else {
                        sums.push(None);
                        continue;
                    };
                    let sum = &self.steps[other];
                    let (dy, db) = (&locs[sum.inputs[0]][0], &locs[sum.value][0]);
                    let (at, own) = if other < s + q {
                        if !deferred.contains(&other) {
                            sums.push(None);
                            continue;
                        }
                        (db.base() as *mut f32, None)
                    } else if fuse_bias && needs[sum.inputs[0]].is_empty() && sum.check.is_none() {
                        let mut own = vec![0f32; db.numel()];
                        (own.as_mut_ptr(), Some(own))
                    } else {
                        sums.push(None);
                        continue;
                    };
                    sums.push(launch::bias_sums(dy, ins[q][1], at));
                    plans.push((other, own, sums[q].is_some()));
                }
                let planned = plans.iter().all(|&(_, _, ok)| ok);
                if planned && launch::product_group(&group, &ins, &outs, &sums, &ctx) {
                    group_counts.0 += 1;
                    group_counts.1 += group.len();
                    if let Some(t) = trace.as_mut() {
                        let first = s;
                        t.extend((s..end).map(|launch| Launched {
                            launch,
                            how: How::InGroup { first },
                        }));
                        t.extend(plans.iter().map(|&(other, _, _)| Launched {
                            launch: other,
                            how: How::SummedBy {
                                product: self.steps[other].bias_grad.unwrap_or(other),
                            },
                        }));
                    }
                    for (other, own, _) in plans {
                        bias_counts.0 += 1;
                        match own {
                            Some(own) => summed.push((other, own)),
                            None => deferred.retain(|&d| d != other),
                        }
                    }
                    if let (Some(p), Some(t0)) = (profile.as_mut(), started) {
                        // The group's time shared by the kernels' multiply-adds.
                        let seconds = t0.elapsed().as_secs_f64();
                        let products: Vec<Option<Product>> = ins
                            .iter()
                            .map(|i| Product::of(&i[0].layout, &i[1].layout))
                            .collect();
                        let flops = |p: &Option<Product>| p.map_or(0.0, |p| p.flops());
                        let total: f64 = products.iter().map(flops).sum();
                        for (t, product) in group.iter().zip(products) {
                            let share = if total > 0.0 {
                                flops(&product) / total
                            } else {
                                1.0 / group.len() as f64
                            };
                            p(&Timing {
                                what: &t.kind,
                                seconds: seconds * share,
                                product,
                            });
                        }
                    }
                    for freed in &freed[s..end] {
                        for &c in freed {
                            if let Some(b) = copies[c].buf.take() {
                                keep.give_back(b);
                            }
                        }
                    }
                    grouped_until = end;
                    continue;
                }
            }
            // A `sum_rows` left out here reads `dy` without a view copy (`needs[dy]` is
            // empty), so it frees none.
            if let (Some(other), launch::Exec::SumRows(_)) = (step.bias_grad, &step.exec) {
                let dy = step.inputs[0];
                if other > s {
                    // Its product sums `dy` later (if it can: else it runs this then).
                    if fuse_bias && step.check.is_none() && needs[dy].is_empty() {
                        deferred.push(s);
                        continue;
                    }
                } else if let Some(i) = summed.iter().position(|(at, _)| *at == s) {
                    let (_, sums) = summed.swap_remove(i);
                    let out = &locs[step.value][0];
                    // SAFETY: the result is a contiguous buffer of `n` values, the sums'
                    // count (`launch::bias_sums` checked `dy`'s shape, whose rows it sums).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            sums.as_ptr(),
                            out.base() as *mut f32,
                            sums.len().min(out.numel()),
                        )
                    };
                    continue;
                }
                bias_counts.1 += 1;
            }
            let started = profile.as_ref().map(|_| std::time::Instant::now());
            let ins: Vec<&Loc> = step.inputs.iter().map(|&x| &locs[x][0]).collect();
            let product = match step.exec {
                launch::Exec::Matmul | launch::Exec::Linear { .. } if profile.is_some() => {
                    Product::of(&ins[0].layout, &ins[1].layout)
                }
                _ => None,
            };
            let outs = &locs[step.value];
            let mark = keep.mark();
            // The operands read with their rows gathered (a concatenation's).
            let gathered: Vec<Option<&[usize]>> = match gather {
                Some((_, rows)) => step
                    .inputs
                    .iter()
                    .map(|&x| match &self.kg.values[x].def {
                        Def::Input(n) if as_read.contains_key(n) => Some(rows),
                        _ => None,
                    })
                    .collect(),
                None => Vec::new(),
            };
            // This product's bias gradient: the `sum_rows` step, `dy`, and where the sums go.
            // (Only concatenations read gathered rows, never a product.)
            let bias = match (step.bias_grad, &step.exec) {
                (Some(other), launch::Exec::Matmul) => {
                    let sum = &self.steps[other];
                    let (dy, db) = (&locs[sum.inputs[0]][0], &locs[sum.value][0]);
                    if other < s {
                        deferred
                            .iter()
                            .position(|&d| d == other)
                            .map(|i| (deferred.swap_remove(i), dy, db.base() as *mut f32, None))
                    } else if fuse_bias && needs[sum.inputs[0]].is_empty() && sum.check.is_none() {
                        // Into a buffer of its own: the result's slot may be this
                        // product's operand's until then.
                        let mut own = vec![0f32; db.numel()];
                        let at = own.as_mut_ptr();
                        Some((other, dy, at, Some(own)))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            let summing = bias.map(|(other, dy, at, own)| {
                let sums = launch::bias_sums(dy, ins[1], at);
                let done = sums
                    .is_some_and(|sums| launch::product_with_sums(step, &ins, outs, &ctx, sums));
                (other, own, done)
            });
            let alone = Launched {
                launch: s,
                how: How::Alone,
            };
            match summing {
                Some((other, own, true)) => {
                    bias_counts.0 += 1;
                    summed.extend(own.map(|own| (other, own)));
                    if let Some(t) = trace.as_mut() {
                        t.push(alone);
                        t.push(Launched {
                            launch: other,
                            how: How::SummedBy { product: s },
                        });
                    }
                }
                // Left for this product, which could not sum it: the kernel after it.
                Some((other, None, false)) => {
                    bias_counts.1 += 1;
                    if let Some(t) = trace.as_mut() {
                        t.push(alone);
                        t.push(Launched {
                            launch: other,
                            how: How::Alone,
                        });
                    }
                    let sum = &self.steps[other];
                    let sum_ins = [&locs[sum.inputs[0]][0]];
                    launch::run_step(step, &ins, outs, &ctx, &mut keep)
                        .and_then(|()| {
                            launch::run_step(sum, &sum_ins, &locs[sum.value], &ctx, &mut keep)
                        })
                        .map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?;
                }
                _ if gathered.iter().any(Option::is_some) => {
                    if let Some(t) = trace.as_mut() {
                        t.push(alone);
                    }
                    fallback::concat_gathered(&step.exec, &ins, &gathered, outs)
                        .map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?
                }
                _ => {
                    if let Some(t) = trace.as_mut() {
                        t.push(alone);
                    }
                    launch::run_step(step, &ins, outs, &ctx, &mut keep)
                        .map_err(|m| node_err(step.value, format!("{}: {m}", step.kind)))?
                }
            }
            // The kernel's scratch and the copies no later kernel reads.
            keep.release_since(mark);
            for &c in &freed[s] {
                if let Some(b) = copies[c].buf.take() {
                    keep.give_back(b);
                }
            }
            if let (Some(p), Some(t0)) = (profile.as_mut(), started) {
                p(&Timing {
                    what: &step.kind,
                    seconds: t0.elapsed().as_secs_f64(),
                    product,
                });
            }
        }
        if let Some(&s) = deferred.first() {
            return Err(node_err(
                self.steps[s].value,
                "internal: a bias gradient was left for a product that did not take it".into(),
            ));
        }
        if let Some(t) = trace {
            *self.trace.lock().unwrap_or_else(|p| p.into_inner()) = t;
        }
        {
            let mut counts = self.bias_grads.lock().unwrap_or_else(|p| p.into_inner());
            counts.0 += bias_counts.0;
            counts.1 += bias_counts.1;
            let mut groups = self
                .product_groups
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            groups.0 += group_counts.0;
            groups.1 += group_counts.1;
        }
        if let Some(dump) = dump {
            let all: Vec<usize> = (0..copies.len()).collect();
            materialize(self.copy, &all, &mut copies, &mut locs, &mut keep);
            for l in &locs {
                dump.push(l.iter().map(to_tensor).collect());
            }
        }
        let mut out = Vec::with_capacity(self.graph.outputs.len());
        for (i, o) in self.graph.outputs.iter().enumerate() {
            if let (Some(mut store), Some((v, k))) = (direct[i].take(), self.direct[i]) {
                let shape = locs[v][k].layout.shape.clone();
                let n: usize = shape.iter().product();
                if store.len() < n {
                    if store.capacity() < n {
                        return Err(ExecError::Unsupported(format!(
                            "internal: output `{}` has storage for {} of its {n} elements",
                            o.name,
                            store.capacity()
                        )));
                    }
                    // SAFETY: the storage holds `n` elements (the capacity was asked for
                    // them), and the kernel this output is the result of has written
                    // every one: a `direct_output` is a whole kernel result.
                    unsafe { store.set_len(n) };
                }
                out.push((
                    o.name.clone(),
                    Tensor {
                        shape,
                        data: TensorData::F32(store),
                    },
                ));
                continue;
            }
            let (_, v) = self
                .kg
                .outputs
                .iter()
                .find(|(n, _)| n == &o.name)
                .ok_or_else(|| ExecError::Unsupported(format!("no program output `{}`", o.name)))?;
            materialize(self.copy, &needs[*v], &mut copies, &mut locs, &mut keep);
            out.push((o.name.clone(), to_tensor_into(&locs[*v][0], &mut spare)));
        }
        // What no output took is not kept: its sizes no longer match.
        drop(spare);
        *self.view_copies.lock().unwrap_or_else(|p| p.into_inner()) =
            (copies.len(), copies.iter().map(|c| c.words * 4).sum());
        for c in copies {
            if let Some(b) = c.buf {
                keep.give_back(b);
            }
        }
        *self.scratch.lock().unwrap_or_else(|p| p.into_inner()) = keep.into_pool();
        drop(shared);
        if !own.is_empty() {
            let mut idle = self.idle_arenas.lock().unwrap_or_else(|p| p.into_inner());
            // As many as runs have overlapped; none is kept past that.
            idle.push(own);
        }
        Ok(out)
    }
}
