//! The memory plan: which arena slot holds each kernel result, by liveness.
//!
//! In: a [`KernelGraph`] (kernels in launch order). Out: a [`MemoryPlan`] — one buffer per
//! kernel result (one per output of a multi-output kernel), each born at the step that
//! writes it and dead after the last step that reads it (directly or through views and
//! projections); the graph's outputs live to the end. Buffers whose lifetimes do not
//! overlap share a slot.
//!
//! Shapes are symbolic, so the plan is static and the sizes are not: one plan serves
//! every batch size and length, and a run's layout ([`MemoryPlan::layout`]) is made for
//! its bound dims. With concrete sizes the buffers are packed by lifetime (largest
//! first, each into the smallest gap free for its whole life: TensorFlow Lite's
//! greedy-by-size arena planner), which reaches the live peak on the shipped models; the
//! slots end to end — a slot sized by its largest buffer — are the fallback whenever
//! they would be smaller, so a layout is never larger than the slots. Slot choice
//! when a buffer is born, among the slots free at that step: one whose buffers have the
//! same symbolic size, else the smallest that is at least as large (sizes estimated with
//! every dim at 32), else the largest (it grows), else a new slot.
//!
//! Activations are kept for the backward pass exactly as long as a backward kernel reads
//! them: liveness is the whole policy. `KILN_NO_REUSE=1` gives every buffer its own slot
//! (a debugging aid: every value survives to the end of the run). Sources (inputs,
//! parameters, constants) are not in the arena: executors read the caller's tensors in
//! place.
//!
//! Buffers are 4-byte words ([`ELEM_BYTES`]) unless planned with other element sizes
//! ([`MemoryPlan::build_with`]: a CUDA mixed-precision program keeps its activations in
//! 2-byte bf16); a slot's size is then its buffers' largest byte size, and slots are
//! matched by element count and element size together.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::ir::TensorType;
use crate::optimize::kernels::{Def, KernelGraph, KernelOp};
use crate::optimize::templates::registry;
use crate::reference::ExecError;
use crate::shape::Dim;

/// Bytes per element in CPU buffers (f32, i32, and bool stored as i32).
pub const ELEM_BYTES: usize = 4;
/// Slot offsets are multiples of this many bytes.
pub const ALIGN: usize = 64;

/// One kernel result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    /// The kernel's value number in the kernel graph.
    pub value: usize,
    /// Which output of the kernel.
    pub output: usize,
    pub ty: TensorType,
    pub slot: usize,
    /// The step (kernel launch index) that writes it.
    pub born: usize,
    /// The last step that reads it (`steps` for graph outputs).
    pub dies: usize,
    /// Bytes per element: [`ELEM_BYTES`] but in plans built with other sizes.
    #[serde(default = "elem_bytes", skip_serializing_if = "is_elem_bytes")]
    pub elem_bytes: usize,
    /// Written in place of this earlier buffer (by plan index): an operand of the same
    /// size that its kernel reads for the last time and may overwrite ([`in_place`]). The
    /// two share their bytes; the operand's life ends, and this one's begins, at the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_place_of: Option<usize>,
}

fn elem_bytes() -> usize {
    ELEM_BYTES
}

fn is_elem_bytes(n: &usize) -> bool {
    *n == ELEM_BYTES
}

impl Buffer {
    /// Its size in bytes for concrete dims (unaligned).
    pub fn bytes(&self, dims: &BTreeMap<String, i64>) -> Result<usize, String> {
        let shape = self.ty.shape.eval(dims)?;
        shape
            .iter()
            .try_fold(self.elem_bytes, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("a buffer of shape {shape:?} has more bytes than 64 bits count"))
    }
}

/// The plan of one kernel graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryPlan {
    pub buffers: Vec<Buffer>,
    pub slots: usize,
    pub steps: usize,
    /// Whether buffers share slots and results are written over dying operands
    /// ([`crate::options::CompileOptions::buffer_reuse`]); without it every buffer has
    /// memory of its own.
    pub reuse: bool,
}

/// Concrete offsets of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct ArenaLayout {
    /// Byte offset of each buffer (same order as [`MemoryPlan::buffers`]).
    pub offsets: Vec<usize>,
    /// Bytes of each slot.
    pub slot_bytes: Vec<usize>,
    /// The arena's size in bytes.
    pub total: usize,
    /// Bytes if every buffer had its own memory (no reuse).
    pub unshared: usize,
    /// Bytes of the slots end to end (every slot at its largest buffer).
    pub slots_total: usize,
    /// Whether the offsets are the packed ones (else each buffer is at its slot).
    pub packed: bool,
    /// Buffers the executor keeps outside the arena (empty: none). They take no bytes of
    /// it; their offsets mean nothing. See [`MemoryPlan::layout_with`].
    pub external: Vec<bool>,
}

/// Bound dims in name order.
type DimsKey = Vec<(String, i64)>;

/// Layouts already made, by dims: training and decoding meet the same few shapes again
/// and again, and packing ~700 buffers takes a few hundred microseconds. Holds at most
/// [`LayoutCache::CAPACITY`] layouts (it starts over when full).
#[derive(Debug, Default)]
pub struct LayoutCache {
    map: std::sync::Mutex<HashMap<DimsKey, Arc<ArenaLayout>>>,
    /// The buffers its layouts leave out of the arena ([`MemoryPlan::layout_with`]).
    external: Vec<bool>,
}

impl LayoutCache {
    pub const CAPACITY: usize = 256;

    /// A cache whose layouts keep the buffers marked in `external` (one flag per buffer
    /// of the plan) out of the arena.
    pub fn with_external(external: Vec<bool>) -> LayoutCache {
        LayoutCache {
            map: Default::default(),
            external,
        }
    }

    /// `plan.layout(dims)`, made once per distinct `dims`; an error is the executors'
    /// (the node is "the memory plan"). The cache belongs to one plan: asking it for
    /// another plan's layout is a bug.
    pub fn get(
        &self,
        plan: &MemoryPlan,
        dims: &BTreeMap<String, i64>,
    ) -> Result<Arc<ArenaLayout>, ExecError> {
        let key: DimsKey = dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = map.get(&key) {
            return Ok(l.clone());
        }
        let l = Arc::new(plan.layout_with(dims, &self.external).map_err(|message| {
            ExecError::Node {
                node: "the memory plan".into(),
                message,
            }
        })?);
        if map.len() >= Self::CAPACITY {
            map.clear();
        }
        map.insert(key, l.clone());
        Ok(l)
    }
}

/// The kernel result (value, output) that graph output `name` is, when it is a whole f32
/// result — a kernel's, directly or through a projection — and not a view (which may be
/// strided): an executor can write it straight into the tensor it returns.
pub fn direct_output(kg: &KernelGraph, name: &str) -> Option<(usize, usize)> {
    let (_, v) = kg.outputs.iter().find(|(n, _)| n == name)?;
    let (v, k) = match &kg.values.get(*v)?.def {
        Def::Kernel { .. } => (*v, 0),
        Def::Proj(t, k) if matches!(kg.values.get(*t)?.def, Def::Kernel { .. }) => {
            (*t, *k as usize)
        }
        _ => return None,
    };
    (kg.values[v].types.get(k)?.dtype == crate::ir::DType::F32).then_some((v, k))
}

/// Elements of `d` with every dim at the cost model's estimate.
pub(crate) fn estimate(d: &Dim) -> f64 {
    let mut b = BTreeMap::new();
    for s in d.symbols() {
        b.insert(s.to_string(), crate::optimize::extract::ESTIMATE_DIM);
    }
    d.eval(&b).unwrap_or(0) as f64
}

/// The outputs a kernel may write over one of its operands, as (output, operand) pairs:
/// the kernel reads each element of that operand before it writes the same element of the
/// output, on every backend. `xent_ls` writes the logits' gradient over the logits (both
/// `[rows, vocab]`, the largest tensors of a training step); its CPU and CUDA kernels
/// read a row whole before they write it. `scatter_add_into` adds rows onto its base
/// (operand 0), each element read before it is written.
pub fn in_place(op: &KernelOp) -> &'static [(usize, usize)] {
    match op {
        KernelOp::Template { id, .. } => match registry()[*id as usize].name.as_str() {
            "xent_ls" => &[(1, 0)],
            "scatter_add_into" => &[(0, 0)],
            _ => &[],
        },
        _ => &[],
    }
}

/// The kernel result that value `v` is with its elements in the same order: the result
/// itself, a projection of it, or a reshape of one (a reshape of a contiguous buffer
/// moves no element). `None` for a source, or through a permute or broadcast: a kernel
/// writing over such an operand would meet its elements in another order.
fn same_order_result(kg: &KernelGraph, mut v: usize) -> Option<(usize, usize)> {
    loop {
        match &kg.values[v].def {
            Def::View(crate::ir::Op::Reshape { .. }, x) => v = *x,
            Def::Proj(t, k) => return Some((*t, *k as usize)),
            Def::Kernel { .. } => return Some((v, 0)),
            _ => return None,
        }
    }
}

impl MemoryPlan {
    /// Plans `kg` with every buffer in 4-byte elements.
    pub fn build(kg: &KernelGraph) -> MemoryPlan {
        Self::build_with(kg, &|_, _| ELEM_BYTES)
    }

    /// Plans `kg` with `elem_bytes(v, k)` bytes per element of output `k` of kernel value
    /// `v`.
    pub fn build_with(kg: &KernelGraph, elem_bytes: &dyn Fn(usize, usize) -> usize) -> MemoryPlan {
        Self::build_reusing(kg, elem_bytes, true)
    }

    /// [`MemoryPlan::build_with`], with buffers sharing memory only when `reuse`.
    pub fn build_reusing(
        kg: &KernelGraph,
        elem_bytes: &dyn Fn(usize, usize) -> usize,
        reuse: bool,
    ) -> MemoryPlan {
        // Step of each kernel value.
        let mut step_of: BTreeMap<usize, usize> = BTreeMap::new();
        for (v, val) in kg.values.iter().enumerate() {
            if let Def::Kernel { index, .. } = val.def {
                step_of.insert(v, index);
            }
        }
        let steps = step_of.len();
        // Buffers in birth order.
        let mut buffers: Vec<Buffer> = Vec::new();
        let mut index: BTreeMap<(usize, usize), usize> = BTreeMap::new();
        let mut order: Vec<(usize, usize)> = step_of.iter().map(|(&v, &s)| (s, v)).collect();
        order.sort();
        for &(s, v) in &order {
            for (k, ty) in kg.values[v].types.iter().enumerate() {
                index.insert((v, k), buffers.len());
                buffers.push(Buffer {
                    value: v,
                    output: k,
                    ty: ty.clone(),
                    slot: 0,
                    born: s,
                    dies: s,
                    elem_bytes: elem_bytes(v, k),
                    in_place_of: None,
                });
            }
        }
        // Liveness: every read of a value (through views and projections) extends the
        // life of the buffer under it.
        for val in &kg.values {
            if let Def::Kernel {
                index: s, inputs, ..
            } = &val.def
            {
                for &x in inputs {
                    if let Some(b) = kg.result_of(x).and_then(|r| index.get(&r)) {
                        let b = &mut buffers[*b];
                        b.dies = b.dies.max(*s);
                    }
                }
            }
        }
        for (_, v) in &kg.outputs {
            if let Some(b) = kg.result_of(*v).and_then(|r| index.get(&r)) {
                buffers[*b].dies = steps;
            }
        }
        // Results written over an operand that dies at their kernel ([`in_place`]):
        // never over a graph output (it lives to the end), never over an operand that
        // another operand of the kernel also reads or that it reads through a permute or
        // broadcast, and only of the same size. A graph output may be written in place:
        // an executor that keeps the output outside the arena keeps the buffers it is
        // written over there too ([`MemoryPlan::output_buffers`]).
        let returned: Vec<(usize, usize)> = kg
            .outputs
            .iter()
            .filter_map(|(_, v)| kg.result_of(*v))
            .collect();
        for (v, op, inputs) in kg.kernels() {
            for &(k, j) in in_place(op).iter().filter(|_| reuse) {
                let (Some(&out), Some(src)) = (
                    index.get(&(v, k)),
                    inputs.get(j).and_then(|&x| same_order_result(kg, x)),
                ) else {
                    continue;
                };
                let Some(&inp) = index.get(&src) else {
                    continue;
                };
                let shared = inputs
                    .iter()
                    .enumerate()
                    .any(|(i, &x)| i != j && kg.result_of(x) == Some(src));
                let (a, b) = (&buffers[inp], &buffers[out]);
                if a.dies == b.born
                    && !shared
                    && !returned.contains(&src)
                    && a.elem_bytes == b.elem_bytes
                    && a.ty.shape.numel() == b.ty.shape.numel()
                    && !buffers.iter().any(|c| c.in_place_of == Some(inp))
                {
                    buffers[out].in_place_of = Some(inp);
                }
            }
        }
        // Slot assignment in birth order. A slot is free for a buffer born at step s if
        // its last buffer died before s; a buffer written in place takes its operand's.
        // Last death per slot.
        let mut slot_free_after: Vec<usize> = Vec::new();
        // Largest buffer of each slot: symbolic elements, element size, estimated bytes.
        let mut slot_size: Vec<(Dim, usize, f64)> = Vec::new();
        for i in 0..buffers.len() {
            if let Some(a) = buffers[i].in_place_of {
                let slot = buffers[a].slot;
                buffers[i].slot = slot;
                slot_free_after[slot] = slot_free_after[slot].max(buffers[i].dies);
                continue;
            }
            let b = &mut buffers[i];
            let need = b.ty.shape.numel();
            let need_est = estimate(&need) * b.elem_bytes as f64;
            let free: Vec<usize> = (0..slot_free_after.len())
                .filter(|&s| slot_free_after[s] < b.born)
                .collect();
            let same = free
                .iter()
                .copied()
                .find(|&s| slot_size[s].0 == need && slot_size[s].1 == b.elem_bytes);
            let fit = free
                .iter()
                .copied()
                .filter(|&s| slot_size[s].2 >= need_est)
                .min_by(|&a, &c| slot_size[a].2.total_cmp(&slot_size[c].2).then(a.cmp(&c)));
            let largest = free
                .iter()
                .copied()
                .max_by(|&a, &c| slot_size[a].2.total_cmp(&slot_size[c].2).then(c.cmp(&a)));
            let slot = match same.or(fit).or(largest).filter(|_| reuse) {
                Some(s) => s,
                None => {
                    slot_free_after.push(0);
                    slot_size.push((need.clone(), b.elem_bytes, need_est));
                    slot_free_after.len() - 1
                }
            };
            if need_est > slot_size[slot].2 {
                slot_size[slot] = (need, b.elem_bytes, need_est);
            }
            slot_free_after[slot] = b.dies;
            b.slot = slot;
        }
        MemoryPlan {
            buffers,
            slots: slot_free_after.len(),
            steps,
            reuse,
        }
    }

    /// The buffers of the graph's outputs that a CPU executor keeps out of the arena
    /// (one flag per buffer): it writes each whole f32 kernel result the graph returns
    /// straight into the returned tensor ([`direct_output`]), and with it every buffer
    /// that result is written in place of ([`MemoryPlan::chain`]) when all of them are
    /// f32 — the chain's first kernel writes into the returned tensor, and the rest
    /// update it there. Where some buffer of the chain is not f32, the output alone is
    /// flagged and gets bytes of its own.
    pub fn output_buffers(&self, kg: &KernelGraph) -> Vec<bool> {
        let mut flags = vec![false; self.buffers.len()];
        for (name, _) in &kg.outputs {
            if let Some(b) = direct_output(kg, name).and_then(|(v, k)| self.buffer_of(v, k)) {
                let chain = self.chain(b);
                if chain
                    .iter()
                    .all(|&c| self.buffers[c].ty.dtype == crate::ir::DType::F32)
                {
                    for c in chain {
                        flags[c] = true;
                    }
                } else {
                    flags[b] = true;
                }
            }
        }
        flags
    }

    /// Buffer `i` and the buffers it is written in place of, from its home
    /// ([`MemoryPlan::home`]) to `i`.
    pub fn chain(&self, mut i: usize) -> Vec<usize> {
        let mut out = vec![i];
        while let Some(a) = self.buffers[i].in_place_of {
            out.push(a);
            i = a;
        }
        out.reverse();
        out
    }

    /// The buffer holding output `output` of kernel value `value`.
    pub fn buffer_of(&self, value: usize, output: usize) -> Option<usize> {
        self.buffers
            .iter()
            .position(|b| b.value == value && b.output == output)
    }

    /// Every buffer names a slot of the plan and lives within its steps; the error says
    /// which does not (a damaged artifact).
    fn sound(&self) -> Result<(), String> {
        if let Some(b) = self
            .buffers
            .iter()
            .find(|b| b.born > b.dies || b.dies > self.steps || b.slot >= self.slots)
        {
            return Err(format!(
                "buffer %{}.{}: slot {} of {}, lifetime k{}..k{} of {} steps; the plan is \
                 damaged (recompile the artifact)",
                b.value, b.output, b.slot, self.slots, b.born, b.dies, self.steps
            ));
        }
        for (i, b) in self.buffers.iter().enumerate() {
            let Some(a) = b.in_place_of else { continue };
            let ok = self.buffers.get(a).is_some_and(|o| {
                a < i
                    && o.dies == b.born
                    && o.slot == b.slot
                    && o.elem_bytes == b.elem_bytes
                    && o.ty.shape.numel() == b.ty.shape.numel()
            });
            if !ok {
                return Err(format!(
                    "buffer %{}.{} is planned in place of buffer {a}, which is not an \
                     operand of its size that dies where it is born; the plan is damaged \
                     (recompile the artifact)",
                    b.value, b.output
                ));
            }
        }
        Ok(())
    }

    /// The buffer whose bytes buffer `i` occupies: itself, or the first of its chain of
    /// [`Buffer::in_place_of`].
    pub fn home(&self, mut i: usize) -> usize {
        while let Some(a) = self.buffers[i].in_place_of {
            i = a;
        }
        i
    }

    /// Offsets for concrete dims: the buffers packed by lifetime at these sizes, or the
    /// slots end to end where that is not larger (and always without [`MemoryPlan::reuse`]). A
    /// plan whose buffers name a slot it does not have, or die before they are born (a
    /// damaged artifact), is an error.
    pub fn layout(&self, dims: &BTreeMap<String, i64>) -> Result<ArenaLayout, String> {
        self.layout_with(dims, &[])
    }

    /// [`MemoryPlan::layout`] with the buffers flagged in `external` (by plan index; a
    /// short or empty slice flags none) left out of the arena: an executor that stores
    /// them elsewhere — the CPU executor writes the graph's outputs straight into the
    /// tensors it returns — needs no arena bytes for them.
    pub fn layout_with(
        &self,
        dims: &BTreeMap<String, i64>,
        external: &[bool],
    ) -> Result<ArenaLayout, String> {
        self.sound()?;
        let overflow = || "the arena has more bytes than 64 bits count".to_string();
        let outside = |i: usize| external.get(i).copied().unwrap_or(false);
        let mut slot_bytes = vec![0usize; self.slots];
        let mut sizes = Vec::with_capacity(self.buffers.len());
        let mut unshared = 0usize;
        for (i, b) in self.buffers.iter().enumerate() {
            let bytes = if outside(i) {
                0
            } else {
                b.bytes(dims)?
                    .checked_next_multiple_of(ALIGN)
                    .ok_or_else(overflow)?
            };
            sizes.push(bytes);
            unshared = unshared.checked_add(bytes).ok_or_else(overflow)?;
            slot_bytes[b.slot] = slot_bytes[b.slot].max(bytes);
        }
        let mut slot_off = Vec::with_capacity(self.slots);
        let mut slots_total = 0usize;
        for &s in &slot_bytes {
            slot_off.push(slots_total);
            slots_total = slots_total.checked_add(s).ok_or_else(overflow)?;
        }
        // A buffer written in place takes no bytes of its own, unless it or its home is
        // kept outside the arena (a graph output whose chain is not all f32 is, alone:
        // [`MemoryPlan::output_buffers`]).
        let shares: Vec<bool> = (0..self.buffers.len())
            .map(|i| self.buffers[i].in_place_of.is_some() && !outside(i) && !outside(self.home(i)))
            .collect();
        for (i, &s) in shares.iter().enumerate() {
            if s {
                sizes[i] = 0;
            }
        }
        let mut layout = ArenaLayout {
            offsets: self.buffers.iter().map(|b| slot_off[b.slot]).collect(),
            slot_bytes,
            total: slots_total,
            unshared,
            slots_total,
            packed: false,
            external: (0..self.buffers.len()).map(outside).collect(),
        };
        if self.reuse {
            let (offsets, total) = self.pack(&sizes, &shares);
            if total <= slots_total {
                layout.offsets = offsets;
                layout.total = total;
                layout.packed = true;
            }
        }
        Ok(layout)
    }

    /// Offsets of buffers of `sizes` bytes (multiples of [`ALIGN`]) packed by lifetime,
    /// and the arena's size: the largest first (then the earliest born, then in plan
    /// order), each into the smallest gap that holds it between the buffers already
    /// placed that are live at the same time as it, else above them all. The greedy-by-size
    /// offset assignment of TensorFlow Lite's arena planner; on the shipped models it
    /// reaches the live peak, where slots sized by their largest buffer take ~40% more.
    fn pack(&self, sizes: &[usize], shares: &[bool]) -> (Vec<usize>, usize) {
        let n = self.buffers.len();
        // A buffer written in place (`shares`) lives on in its home's bytes.
        let mut life: Vec<(usize, usize)> = self.buffers.iter().map(|b| (b.born, b.dies)).collect();
        for (i, b) in self.buffers.iter().enumerate().filter(|&(i, _)| shares[i]) {
            let h = self.home(i);
            life[h].1 = life[h].1.max(b.dies);
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_unstable_by(|&a, &c| {
            sizes[c]
                .cmp(&sizes[a])
                .then(life[a].0.cmp(&life[c].0))
                .then(a.cmp(&c))
        });
        let mut offsets = vec![0usize; n];
        // Placed buffers as (start, end, born, dies), kept sorted by offset so the scan
        // below meets the ones live with a buffer in address order.
        let mut placed: Vec<(usize, usize, usize, usize)> = Vec::with_capacity(n);
        let mut total = 0;
        for &i in &order {
            let (born, dies) = life[i];
            let need = sizes[i];
            if need == 0 {
                // Takes no bytes (an empty tensor, or a buffer kept outside the arena).
                continue;
            }
            // (gap, offset) of the smallest gap that holds it.
            let mut best: Option<(usize, usize)> = None;
            let mut top = 0;
            for &(start, end, b0, b1) in &placed {
                if b0 > dies || born > b1 {
                    continue;
                }
                if start >= top + need && best.is_none_or(|(g, _)| start - top < g) {
                    best = Some((start - top, top));
                }
                top = top.max(end);
            }
            let at = best.map_or(top, |(_, at)| at);
            offsets[i] = at;
            total = total.max(at + need);
            let entry = (at, at + need, born, dies);
            let k = placed.partition_point(|p| *p < entry);
            placed.insert(k, entry);
        }
        for i in (0..n).filter(|&i| shares[i]) {
            offsets[i] = offsets[self.home(i)];
        }
        (offsets, total)
    }

    /// Checks the plan for concrete dims: buffers sharing a slot have disjoint lifetimes
    /// and each fits its slot, and in the layout no two buffers live at once share a
    /// byte, every one lies inside the arena at an aligned offset. The error names the
    /// first two buffers that overlap, or the buffer that does not fit.
    pub fn check(&self, dims: &BTreeMap<String, i64>) -> Result<(), String> {
        let layout = self.layout(dims)?;
        let mut by_slot: Vec<Vec<(usize, &Buffer)>> = vec![Vec::new(); self.slots];
        for (i, b) in self.buffers.iter().enumerate() {
            let bytes = b.bytes(dims)?;
            if bytes > layout.slot_bytes[b.slot] {
                return Err(format!(
                    "buffer %{}.{} ({bytes} bytes) does not fit slot {} ({} bytes)",
                    b.value, b.output, b.slot, layout.slot_bytes[b.slot]
                ));
            }
            by_slot[b.slot].push((i, b));
        }
        for (slot, members) in by_slot.iter_mut().enumerate() {
            members.sort_by_key(|(i, b)| (b.born, b.dies, *i));
            for w in members.windows(2) {
                let ((i0, a), (i1, c)) = (w[0], w[1]);
                // Written in place of the other: it starts where the other ends.
                let handed = c.born == a.dies && self.home(i0) == self.home(i1);
                if c.born <= a.dies && !handed {
                    let w = [a, c];
                    return Err(format!(
                        "slot {slot}: %{}.{} (k{}..k{}) and %{}.{} (k{}..k{}) are live at once",
                        w[0].value,
                        w[0].output,
                        w[0].born,
                        w[0].dies,
                        w[1].value,
                        w[1].output,
                        w[1].born,
                        w[1].dies
                    ));
                }
            }
        }
        self.check_layout(dims, &layout)
    }

    /// Checks `layout` for concrete dims: every buffer at an aligned offset inside the
    /// arena, and no two buffers live at the same step sharing a byte.
    pub fn check_layout(
        &self,
        dims: &BTreeMap<String, i64>,
        layout: &ArenaLayout,
    ) -> Result<(), String> {
        self.sound()?;
        let mut spans = Vec::with_capacity(self.buffers.len());
        for (i, (b, &at)) in self.buffers.iter().zip(&layout.offsets).enumerate() {
            if layout.external.get(i).copied().unwrap_or(false) {
                continue;
            }
            let end = at + b.bytes(dims)?;
            if at % ALIGN != 0 || end > layout.total {
                return Err(format!(
                    "buffer %{}.{} at bytes {at}..{end} of an arena of {}",
                    b.value, b.output, layout.total
                ));
            }
            spans.push((self.home(i), b, at, end));
        }
        for (i, &(ha, a, a0, a1)) in spans.iter().enumerate() {
            for &(hc, c, c0, c1) in &spans[i + 1..] {
                // One written in place of the other: the same bytes by design.
                if ha == hc {
                    continue;
                }
                let live = a.born <= c.dies && c.born <= a.dies;
                if live && a0 < c1 && c0 < a1 && a0 < a1 && c0 < c1 {
                    return Err(format!(
                        "%{}.{} (k{}..k{}, bytes {a0}..{a1}) and %{}.{} (k{}..k{}, bytes \
                         {c0}..{c1}) are live at once in shared bytes",
                        a.value, a.output, a.born, a.dies, c.value, c.output, c.born, c.dies
                    ));
                }
            }
        }
        Ok(())
    }

    /// The most bytes live at once over the steps (a lower bound for any plan; the arena
    /// reaches it only when slot sizes fit perfectly).
    pub fn live_peak(&self, dims: &BTreeMap<String, i64>) -> Result<usize, String> {
        self.sound()?;
        let overflow = || "the live buffers have more bytes than 64 bits count".to_string();
        let mut delta = vec![0i128; self.steps + 2];
        for b in &self.buffers {
            let bytes = b.bytes(dims)? as i128;
            // Written in place: its bytes are its operand's until the operand dies.
            let from = b.born + usize::from(b.in_place_of.is_some());
            delta[from] += bytes;
            delta[b.dies + 1] -= bytes;
        }
        let mut cur = 0i128;
        let mut peak = 0i128;
        for d in delta {
            cur += d;
            peak = peak.max(cur);
        }
        usize::try_from(peak).map_err(|_| overflow())
    }

    /// The plan as text: one line per slot (its buffers with their lifetimes), then the
    /// totals for `dims` when given.
    pub fn text(&self, kg: &KernelGraph, dims: Option<&BTreeMap<String, i64>>) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "memory plan: {} buffers in {} slots over {} steps",
            self.buffers.len(),
            self.slots,
            self.steps
        );
        let layout = dims.and_then(|d| self.layout(d).ok());
        for slot in 0..self.slots {
            let members: Vec<String> = self
                .buffers
                .iter()
                .filter(|b| b.slot == slot)
                .map(|b| {
                    let name = if kg.values[b.value].types.len() > 1 {
                        format!("%{}.{}", b.value, b.output)
                    } else {
                        format!("%{}", b.value)
                    };
                    let elem = if b.elem_bytes == ELEM_BYTES {
                        String::new()
                    } else {
                        format!(" ({} B each)", b.elem_bytes)
                    };
                    let over = match b.in_place_of.and_then(|a| self.buffers.get(a)) {
                        Some(o) => {
                            if kg.values[o.value].types.len() > 1 {
                                format!(" (in place of %{}.{})", o.value, o.output)
                            } else {
                                format!(" (in place of %{})", o.value)
                            }
                        }
                        None => String::new(),
                    };
                    format!("{name} {}{elem} [k{}..k{}]{over}", b.ty, b.born, b.dies)
                })
                .collect();
            let size = match &layout {
                Some(l) => format!(" {} B", l.slot_bytes[slot]),
                None => String::new(),
            };
            let _ = writeln!(s, "  slot {slot}{size}: {}", members.join(", "));
        }
        if let (Some(l), Some(d)) = (&layout, dims) {
            let dims_text: Vec<String> = d.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = writeln!(
                s,
                "arena at {}: {} bytes ({:.1} MiB, {}); slots end to end {:.1} MiB; \
                 without reuse {:.1} MiB; live peak {:.1} MiB",
                dims_text.join(" "),
                l.total,
                l.total as f64 / 1048576.0,
                if l.packed {
                    "buffers packed at these sizes"
                } else {
                    "the slots"
                },
                l.slots_total as f64 / 1048576.0,
                l.unshared as f64 / 1048576.0,
                self.live_peak(d).unwrap_or(0) as f64 / 1048576.0
            );
        }
        s
    }
}

#[cfg(test)]
mod tests;
