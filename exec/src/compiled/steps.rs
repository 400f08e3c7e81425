//! The launch plan's steps of one run, in order: a product group run as one where the
//! products run in 16 bits, a bias gradient's `sum_rows` summed by its weight gradient's
//! product while it packs `dy`, else each kernel on its own.

use std::collections::BTreeMap;

use kiln_compiler::ir::DType;
use kiln_compiler::optimize::kernels::Def;
use kiln_compiler::reference::ExecError;

use super::place::Placed;
use super::*;
use crate::executor::{How, Launched, Product, Timing};

/// One run's state while it launches.
pub(super) struct Launching {
    pub placed: Placed,
    pub keep: Keep,
    /// Per step, the copies it is the last to read.
    pub freed: Vec<Vec<usize>>,
    /// The `sum_rows` launches left for a later product.
    pub deferred: Vec<usize>,
    /// The sums a product wrote for a later `sum_rows`, by the `sum_rows` launch.
    pub summed: Vec<(usize, Vec<f32>)>,
    /// Bias gradients (summed by a product, by their own kernel).
    pub bias_counts: (usize, usize),
    /// (Groups of products run as one, the kernels in them.)
    pub group_counts: (usize, usize),
    pub trace: Option<Vec<Launched>>,
}

/// The rows a run reads of its gathered inputs, and their shapes as read.
pub(super) type GatheredRows<'a> = Option<(&'a [usize], &'a BTreeMap<String, (Vec<usize>, DType)>)>;

impl Launching {
    /// Gives back the view copies no step after `s` reads.
    fn free_after(&mut self, s: usize) {
        for &c in &self.freed[s] {
            if let Some(b) = self.placed.copies[c].buf.take() {
                self.keep.give_back(b);
            }
        }
    }

    fn materialize_inputs(
        &mut self,
        copy: kiln_compiler::codegen::jit::KernelFn,
        step: &launch::Step,
    ) {
        let p = &mut self.placed;
        for &x in &step.inputs {
            materialize(
                copy,
                &p.needs[x],
                &mut p.copies,
                &mut p.locs,
                &mut self.keep,
            );
        }
    }
}

impl Compiled {
    /// Every step of the launch plan, in order.
    pub(super) fn launch_steps(
        &self,
        st: &mut Launching,
        ctx: &launch::RunCtx<'_>,
        profile: &mut Option<Profile<'_>>,
        gathered: GatheredRows<'_>,
    ) -> Result<(), ExecError> {
        let mut s = 0;
        while s < self.steps.len() {
            st.materialize_inputs(self.copy, &self.steps[s]);
            // The launch plan's product group this starts, run as one where the products
            // run in 16 bits (`launch::product_group`).
            let end = match self.launch.group_at(s) {
                Some(g) if self.bf16_products.is_some() => s + g.len,
                _ => s + 1,
            };
            if end > s + 1 && self.launch_group(s, end, st, ctx, profile) {
                s = end;
                continue;
            }
            self.launch_one(s, st, ctx, profile, gathered)?;
            s += 1;
        }
        if let Some(&s) = st.deferred.first() {
            return Err(self.node_err(
                self.steps[s].value,
                "internal: a bias gradient was left for a product that did not take it".into(),
            ));
        }
        Ok(())
    }

    /// Records what the run's launches did (its trace, how its bias gradients were
    /// summed, its product groups) and gives back where its values live.
    pub(super) fn finish_launch(&self, st: Launching) -> (Placed, Keep) {
        if let Some(t) = st.trace {
            *self.trace.lock().unwrap_or_else(|p| p.into_inner()) = t;
        }
        let mut counts = self.bias_grads.lock().unwrap_or_else(|p| p.into_inner());
        counts.0 += st.bias_counts.0;
        counts.1 += st.bias_counts.1;
        let mut groups = self
            .product_groups
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        groups.0 += st.group_counts.0;
        groups.1 += st.group_counts.1;
        (st.placed, st.keep)
    }

    /// Steps `s..end` as one product group, each weight gradient's bias gradient summed
    /// as a product on its own would sum it: into the `sum_rows` result where that launch
    /// was left for this product, else into a buffer of its own that the launch copies.
    /// Whether the group ran; where it did not, its steps run one by one.
    fn launch_group(
        &self,
        s: usize,
        end: usize,
        st: &mut Launching,
        ctx: &launch::RunCtx<'_>,
        profile: &mut Option<Profile<'_>>,
    ) -> bool {
        for t in &self.steps[s + 1..end] {
            st.materialize_inputs(self.copy, t);
        }
        let started = profile.as_ref().map(|_| std::time::Instant::now());
        let group: Vec<&launch::Step> = self.steps[s..end].iter().collect();
        let locs = &st.placed.locs;
        let ins: Vec<Vec<&Loc>> = group
            .iter()
            .map(|t| t.inputs.iter().map(|&x| &locs[x][0]).collect())
            .collect();
        let outs: Vec<&[Loc]> = group.iter().map(|t| locs[t.value].as_slice()).collect();
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
                if !st.deferred.contains(&other) {
                    sums.push(None);
                    continue;
                }
                (db.base() as *mut f32, None)
            } else if self.sums_own_bias(sum, &st.placed) {
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
        if !planned || !launch::product_group(&group, &ins, &outs, &sums, ctx) {
            return false;
        }
        st.group_counts.0 += 1;
        st.group_counts.1 += group.len();
        if let Some(t) = st.trace.as_mut() {
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
            st.bias_counts.0 += 1;
            match own {
                Some(own) => st.summed.push((other, own)),
                None => st.deferred.retain(|&d| d != other),
            }
        }
        if let (Some(p), Some(t0)) = (profile.as_mut(), started) {
            profile_group(p, &group, &ins, t0.elapsed().as_secs_f64());
        }
        for q in s..end {
            st.free_after(q);
        }
        true
    }

    /// Whether a product may sum bias gradient `sum` into a buffer of its own: the
    /// products run in 16 bits, and `dy` is read without a view copy or a check.
    fn sums_own_bias(&self, sum: &launch::Step, placed: &Placed) -> bool {
        self.bf16_products.is_some()
            && placed.needs[sum.inputs[0]].is_empty()
            && sum.check.is_none()
    }

    /// Whether step `s` is a bias gradient's `sum_rows` that its product sums (later) or
    /// summed (earlier), so that nothing is left to launch for it. A `sum_rows` left out
    /// here reads `dy` without a view copy, so it frees none.
    fn bias_sum_taken(&self, s: usize, st: &mut Launching) -> bool {
        let step = &self.steps[s];
        let (Some(other), launch::Exec::SumRows(_)) = (step.bias_grad, &step.exec) else {
            return false;
        };
        if other > s {
            // Its product sums `dy` later (if it can: else it runs this then).
            if self.sums_own_bias(step, &st.placed) {
                st.deferred.push(s);
                return true;
            }
        } else if let Some(i) = st.summed.iter().position(|(at, _)| *at == s) {
            let (_, sums) = st.summed.swap_remove(i);
            let out = &st.placed.locs[step.value][0];
            // SAFETY: the result is a contiguous buffer of `n` values, the sums' count
            // (`launch::bias_sums` checked `dy`'s shape, whose rows it sums).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    sums.as_ptr(),
                    out.base() as *mut f32,
                    sums.len().min(out.numel()),
                )
            };
            return true;
        }
        st.bias_counts.1 += 1;
        false
    }

    /// Step `s` on its own, with the bias gradient its product sums where there is one.
    fn launch_one(
        &self,
        s: usize,
        st: &mut Launching,
        ctx: &launch::RunCtx<'_>,
        profile: &mut Option<Profile<'_>>,
        gathered: GatheredRows<'_>,
    ) -> Result<(), ExecError> {
        if self.bias_sum_taken(s, st) {
            return Ok(());
        }
        let step = &self.steps[s];
        let started = profile.as_ref().map(|_| std::time::Instant::now());
        let locs = &st.placed.locs;
        let ins: Vec<&Loc> = step.inputs.iter().map(|&x| &locs[x][0]).collect();
        let product = match step.exec {
            launch::Exec::Matmul | launch::Exec::Linear { .. } if profile.is_some() => {
                Product::of(&ins[0].layout, &ins[1].layout)
            }
            _ => None,
        };
        let outs = &locs[step.value];
        let mark = st.keep.mark();
        // The operands read with their rows gathered (a concatenation's).
        let rows: Vec<Option<&[usize]>> = match gathered {
            Some((rows, as_read)) => step
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
                    let deferred = &mut st.deferred;
                    deferred
                        .iter()
                        .position(|&d| d == other)
                        .map(|i| (deferred.swap_remove(i), dy, db.base() as *mut f32, None))
                } else if self.sums_own_bias(sum, &st.placed) {
                    // Into a buffer of its own: the result's slot may be this product's
                    // operand's until then.
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
            let done =
                sums.is_some_and(|sums| launch::product_with_sums(step, &ins, outs, ctx, sums));
            (other, own, done)
        });
        let alone = Launched {
            launch: s,
            how: How::Alone,
        };
        let failed = |m: String| self.node_err(step.value, format!("{}: {m}", step.kind));
        match summing {
            Some((other, own, true)) => {
                st.bias_counts.0 += 1;
                st.summed.extend(own.map(|own| (other, own)));
                if let Some(t) = st.trace.as_mut() {
                    t.push(alone);
                    t.push(Launched {
                        launch: other,
                        how: How::SummedBy { product: s },
                    });
                }
            }
            // Left for this product, which could not sum it: the kernel after it.
            Some((other, None, false)) => {
                st.bias_counts.1 += 1;
                if let Some(t) = st.trace.as_mut() {
                    t.push(alone);
                    t.push(Launched {
                        launch: other,
                        how: How::Alone,
                    });
                }
                let sum = &self.steps[other];
                let sum_ins = [&locs[sum.inputs[0]][0]];
                launch::run_step(step, &ins, outs, ctx, &mut st.keep)
                    .and_then(|()| {
                        launch::run_step(sum, &sum_ins, &locs[sum.value], ctx, &mut st.keep)
                    })
                    .map_err(failed)?;
            }
            _ if rows.iter().any(Option::is_some) => {
                if let Some(t) = st.trace.as_mut() {
                    t.push(alone);
                }
                fallback::concat_gathered(&step.exec, &ins, &rows, outs).map_err(failed)?
            }
            _ => {
                if let Some(t) = st.trace.as_mut() {
                    t.push(alone);
                }
                launch::run_step(step, &ins, outs, ctx, &mut st.keep).map_err(failed)?
            }
        }
        // The kernel's scratch and the copies no later kernel reads.
        st.keep.release_since(mark);
        st.free_after(s);
        if let (Some(p), Some(t0)) = (profile.as_mut(), started) {
            p(&Timing {
                what: &step.kind,
                seconds: t0.elapsed().as_secs_f64(),
                product,
            });
        }
        Ok(())
    }
}

/// A product group's time, shared by its kernels in proportion to their multiply-adds.
fn profile_group(p: &mut Profile<'_>, group: &[&launch::Step], ins: &[Vec<&Loc>], seconds: f64) {
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
