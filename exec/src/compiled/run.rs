//! One run of the compiled executor: bind, lay out the arena, place every value, launch
//! the launch plan's kernels in order (its product groups and bias-gradient pairs where
//! the products run in 16 bits), copy the outputs out.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_compiler::bind::Binder;
use kiln_compiler::ir::DType;
use kiln_compiler::reference::{ExecError, Precision, RunOptions};
use kiln_compiler::tensor::{Feeds, Outputs, Tensor, TensorData};

use super::*;

impl Compiled {
    pub(super) fn run_inner(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
        mut profile: Option<Profile<'_>>,
        dump: Option<&mut Vec<Vec<Tensor>>>,
        gather: Option<Gather<'_>>,
    ) -> Result<Outputs, ExecError> {
        if opts.precision != Precision::F32 {
            return Err(ExecError::Unsupported(format!(
                "the compiled executor computes in f32 only, but {:?} precision was \
                 requested; use the reference executor for f64",
                opts.precision
            )));
        }
        let as_read = self.gathered_inputs(inputs, gather)?;
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
        let mut held: Vec<Arc<Vec<f32>>> = Vec::new();
        let sources = place::Sources {
            inputs,
            as_read: &as_read,
            bind: &bind,
            params_version: opts.params_version,
        };
        let mut storage = place::Storage {
            base,
            layout: &layout,
            keep: &mut keep,
            spare: &mut spare,
            direct: &mut direct,
            held: &mut held,
        };
        let placed = self.place(&sources, &mut storage)?;
        let freed = self.copies_freed(&placed, dump.is_some());
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
        let mut st = steps::Launching {
            placed,
            keep,
            freed,
            deferred: Vec::new(),
            summed: Vec::new(),
            bias_counts: (0, 0),
            group_counts: (0, 0),
            trace: self.tracing.then(Vec::new),
        };
        let gathered = gather.map(|(_, rows)| (rows, &as_read));
        self.launch_steps(&mut st, &ctx, &mut profile, gathered)?;
        let (placed, mut keep) = self.finish_launch(st);
        let place::Placed {
            mut locs,
            needs,
            mut copies,
        } = placed;
        if let Some(dump) = dump {
            let all: Vec<usize> = (0..copies.len()).collect();
            materialize(self.copy, &all, &mut copies, &mut locs, &mut keep);
            for l in &locs {
                dump.push(l.iter().map(to_tensor).collect());
            }
        }
        let out = self.outputs(
            &mut direct,
            &mut spare,
            &needs,
            &mut copies,
            &mut locs,
            &mut keep,
        )?;
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

    /// Which view copies each step is the last to read (none while dumping every value).
    fn copies_freed(&self, placed: &place::Placed, dumping: bool) -> Vec<Vec<usize>> {
        if dumping {
            return vec![Vec::new(); self.steps.len()];
        }
        crate::executor::copies_freed_after(
            placed.copies.len(),
            &placed.needs,
            self.steps.iter().map(|s| s.inputs.as_slice()),
            self.kg.outputs.iter().map(|(_, v)| *v),
        )
    }

    /// Inputs read with their rows gathered, with the shape they are read with (their
    /// dims bind at it).
    fn gathered_inputs(
        &self,
        inputs: &Feeds,
        gather: Option<Gather<'_>>,
    ) -> Result<BTreeMap<String, (Vec<usize>, DType)>, ExecError> {
        let mut as_read = BTreeMap::new();
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
        Ok(as_read)
    }

    /// The graph's outputs: an output written in place in its own storage, any other
    /// copied out of where its value lives (into recycled storage where there is some).
    fn outputs(
        &self,
        direct: &mut [Option<Vec<f32>>],
        spare: &mut Vec<Vec<f32>>,
        needs: &[Vec<usize>],
        copies: &mut [ViewCopy],
        locs: &mut [Vec<Loc>],
        keep: &mut Keep,
    ) -> Result<Outputs, ExecError> {
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
            let v = &crate::executor::program_output(&self.kg, &o.name)?;
            materialize(self.copy, &needs[*v], copies, locs, keep);
            let loc = &locs[*v][0];
            out.push((o.name.clone(), to_tensor_into(loc, spare, Some(self.copy))));
        }
        Ok(out)
    }
}
