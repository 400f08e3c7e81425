//! One run's launches on the device: every kernel of the launch plan through the
//! generated functions, cuBLAS and cuBLASLt, with its scratch, views and bias-gradient
//! pairs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::compiled::launch::row_buffers;
use kiln_compiler::bind::Source;
use kiln_compiler::codegen::cuda::cast;
use kiln_compiler::codegen::cuda::index;
use kiln_compiler::codegen::misc::{ReduceLayout, MAX_COPY_RANK};
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_compiler::ir::DType;
use kiln_compiler::optimize::kernels::KernelGraph;
use kiln_compiler::optimize::templates::{layer_norm_operands, LnForm};
use kiln_compiler::tensor::{Tensor, TensorData};

use crate::compiled::fallback::{self, HostCtx};
use crate::compiled::Loc;
use crate::cuda::abi::{Launch, MatmulPlan};
use crate::cuda::device::{self, Buf, Device};
use crate::cuda::steps::{Exec as StepExec, Step};
use crate::eager::pool::Pool;
use crate::eager::value::Layout;

use super::*;

mod attention_ops;
mod index_ops;
mod products;
mod row_ops;

/// One run's device work: launches, GEMMs, copies, and the buffers they need.
pub(crate) struct Run<'a> {
    pub(crate) dev: &'a Device,
    pub(crate) copy: Option<&'a str>,
    /// The 2-byte strided copy (mixed precision).
    pub(crate) copy16: Option<&'a str>,
    pub(crate) keep: Vec<Buf>,
    pub(crate) dims: &'a BTreeMap<String, i64>,
    pub(crate) seed: u64,
    pub(crate) step: u32,
    pub(crate) pool: &'a Arc<Pool>,
    /// GEMM operands as bf16 ([`CudaOptions::bf16`]).
    pub(crate) bf16: bool,
    /// Bias (+ ReLU) of `linear` kernels in cuBLASLt's epilogue where it can.
    pub(crate) fused_epilogues: bool,
    /// Bias gradients in their weight gradient's GEMM epilogue where it can.
    pub(crate) fused_bias_grads: bool,
    /// `linear` kernels with a bias so far: (fused by cuBLASLt, run separately).
    pub(crate) epilogues: (usize, usize),
    /// Paired bias gradients so far ([`CudaExecutor::bias_grad_counts`]).
    pub(crate) bias_grads: (usize, usize),
    /// Bias gradients whose weight-gradient GEMM comes later, by the GEMM's step: the
    /// `sum_rows` step, the rows it sums (`dy`) and its result. The GEMM writes the
    /// result, or runs the `sum_rows` after itself where cuBLASLt cannot.
    pub(crate) bias_deferred: HashMap<usize, (usize, DLoc, DLoc)>,
    /// Bias gradients an earlier GEMM computed, by the `sum_rows` step: the buffer
    /// holding them, copied into the step's result when it comes.
    pub(crate) bias_ready: HashMap<usize, Buf>,
    /// The host words of each integer input this run uploaded, by device buffer: inputs
    /// are only read on the device, so [`Run::words`] of an i32 view of one (ids checked
    /// against the vocabulary, targets, the embedding gradient's row index) gathers them
    /// here instead of synchronizing the stream mid-step for a download.
    pub(crate) mirror: HashMap<u64, Vec<u32>>,
    /// The device buffers of this run's parameters: f32 data no kernel of the run writes.
    pub(crate) params: std::collections::HashSet<u64>,
    /// bf16 GEMM operands cast from spans of those parameters, made once a run (a weight
    /// is read by its forward and its backward products) or, for a decoder's or a
    /// validation's parameters kept on the device, once a parameters version.
    pub(crate) casts: HashMap<CastKey, Buf>,
}

/// A planned GEMM: the plan and where its operands are (f32 in place, or bf16 copies).
pub(crate) struct MatmulOps {
    pub(crate) plan: MatmulPlan,
    pub(crate) a: Addr,
    pub(crate) b: Addr,
    pub(crate) elem: device::GemmElem,
}

impl Run<'_> {
    /// Makes the copies in `cs` not made yet, in order (a copy of a view of a copy comes
    /// after the copy it reads).
    pub(crate) fn materialize(
        &mut self,
        cs: &[usize],
        copies: &mut [DevCopy],
        locs: &mut [Vec<DLoc>],
    ) -> Result<(), String> {
        for &c in cs {
            if copies[c].buf.is_some() {
                continue;
            }
            let b = self.dev.alloc(copies[c].plan.words)?;
            for &u in &copies[c].plan.users {
                locs[u][0].ptr = b.ptr;
            }
            let src = locs[copies[c].plan.src][0].clone();
            self.copy_to(&src, b.ptr)?;
            copies[c].buf = Some(b);
        }
        Ok(())
    }

    /// A fresh zeroed buffer of `words` words, alive until the run ends.
    pub(crate) fn alloc(&mut self, words: usize) -> Result<u64, String> {
        let b = self.dev.alloc(words)?;
        let p = b.ptr;
        self.keep.push(b);
        Ok(p)
    }

    /// [`Run::upload`] in stream order, without waiting for the stream where the copy is
    /// small ([`device::Device::write_enqueued`]): for data made mid-step.
    pub(crate) fn upload_enqueued(&mut self, words: &[u32]) -> Result<u64, String> {
        let b = self.dev.alloc(words.len())?;
        self.dev.write_enqueued(b.ptr, words)?;
        let p = b.ptr;
        self.keep.push(b);
        Ok(p)
    }

    /// A bound input or parameter on the device (`bf16`: a float input the program keeps
    /// in bf16, rounded on the host).
    pub(crate) fn source(
        &mut self,
        src: Source<'_>,
        shape: &[usize],
        bf16: bool,
    ) -> Result<DLoc, String> {
        let (words, dtype, _) = source_words(&src);
        // Inputs are uploaded as the launch order reaches them (just before their first
        // reader, possibly mid-step): small ones in stream order without a wait.
        if bf16 && dtype == DType::F32 {
            let packed = pack_bf16(words.iter().map(|&w| f32::from_bits(w)));
            return Ok(DLoc {
                ptr: self.upload_enqueued(&packed)?,
                layout: Layout::contiguous(shape),
                dtype: DType::BF16,
            });
        }
        let ptr = self.upload_enqueued(&words)?;
        if dtype == DType::I32 {
            self.mirror.insert(ptr, words.into_owned());
        }
        Ok(DLoc {
            ptr,
            layout: Layout::contiguous(shape),
            dtype,
        })
    }

    /// `l` (contiguous f32) rounded to bf16 in a fresh buffer.
    pub(crate) fn rounded_to_bf16(&mut self, l: &DLoc) -> Result<DLoc, String> {
        let n = l.numel();
        let dst = self.alloc(n.div_ceil(2).max(1))?;
        if n > 0 {
            self.dev
                .launch(cast::TO_BF16, &[l.base(), dst], &[n as i64], n)?;
        }
        Ok(DLoc {
            ptr: dst,
            layout: Layout::contiguous(l.shape()),
            dtype: DType::BF16,
        })
    }

    pub(crate) fn launch(&self, f: &str, ptrs: &[u64], l: Launch) -> Result<(), String> {
        self.dev.launch(f, ptrs, &l.dims, l.items)
    }

    /// Copies a strided location into the contiguous buffer at `dst` (generated
    /// `copy_strided`, rank ≤ `MAX_COPY_RANK`).
    pub(crate) fn copy_to(&mut self, src: &DLoc, dst: u64) -> Result<(), String> {
        if src.numel() == 0 {
            return Ok(());
        }
        if src.layout.is_contiguous() {
            let bytes = elem_bytes(src.dtype) as usize * src.numel();
            return self.dev.copy_bytes(dst, src.base(), bytes);
        }
        if src.shape().len() > MAX_COPY_RANK {
            return Err(format!(
                "unsupported: a strided view of rank {} (copy_strided takes at most {MAX_COPY_RANK})",
                src.shape().len()
            ));
        }
        let f = if src.is_bf16() {
            self.copy16
                .ok_or("the CUDA module has no strided copy of bf16 elements")?
        } else {
            self.copy
                .ok_or("the CUDA module has no copy_strided function")?
        };
        let strides: Vec<i64> = src.layout.strides.iter().map(|&s| s as i64).collect();
        self.launch(f, &[src.base(), dst], Launch::copy(src.shape(), &strides))
    }

    /// The row index of a scatter of `src` by `ids` into `out`'s rows, on the device:
    /// `(start, order, src, launch)` for `index::scatter_rows` and its `onto` form. Ids are
    /// checked on the host, as on the CPU (the kernels do not).
    pub(crate) fn scatter_index(
        &mut self,
        ids: &DLoc,
        src: &DLoc,
        out: &DLoc,
    ) -> Result<(u64, u64, u64, Launch), String> {
        let rows = out.shape().first().copied().unwrap_or(1);
        let width: usize = out.shape().iter().skip(1).product();
        let ids: Vec<i32> = self.words(ids)?.iter().map(|&w| w as i32).collect();
        let src = self.contig(src)?;
        if src.numel() != ids.len() * width {
            return Err(format!(
                "scatter_add of {} ids with {} values into rows of {width}",
                ids.len(),
                src.numel()
            ));
        }
        for (i, &id) in ids.iter().enumerate() {
            kiln_compiler::bind::check_id(id, rows, i, format_args!("the result has {rows} rows"))?;
        }
        let (start, order) = index::scatter_index(&ids, rows)
            .map_err(|(p, id)| format!("internal: id {id} at {p} passed the check"))?;
        let start = self.upload_enqueued(&start.iter().map(|&x| x as u32).collect::<Vec<_>>())?;
        let mut order: Vec<u32> = order.iter().map(|&x| x as u32).collect();
        if order.is_empty() {
            order.push(0);
        }
        let order = self.upload_enqueued(&order)?;
        Ok((
            start,
            order,
            src.base(),
            Launch::same(index::scatter_rows_dims(rows, width)),
        ))
    }

    /// `l` as a contiguous location (copied if it is not).
    pub(crate) fn contig(&mut self, l: &DLoc) -> Result<DLoc, String> {
        if l.layout.is_contiguous() {
            return Ok(l.clone());
        }
        let dst = self.alloc(words_of(l.dtype, l.numel()))?;
        self.copy_to(l, dst)?;
        Ok(DLoc {
            ptr: dst,
            layout: Layout::contiguous(l.shape()),
            dtype: l.dtype,
        })
    }

    /// `l`'s elements in row-major order, on the host (bf16 elements two to a word, as
    /// [`pack_bf16`] lays them out).
    pub(crate) fn words(&mut self, l: &DLoc) -> Result<Vec<u32>, String> {
        if let Some(host) = self.mirror.get(&l.ptr).filter(|_| l.dtype == DType::I32) {
            return gather_words(host, &l.layout);
        }
        let c = self.contig(l)?;
        self.dev.read(c.base(), words_of(c.dtype, c.numel()))
    }

    pub(crate) fn download(&mut self, l: &DLoc) -> Result<Tensor, String> {
        let w = self.words(l)?;
        // Same-size maps over an owned vector reuse its allocation (no copy).
        let data = match l.dtype {
            DType::I32 => TensorData::I32(w.into_iter().map(|x| x as i32).collect()),
            DType::Bool => TensorData::Bool(w.iter().map(|&x| x != 0).collect()),
            DType::BF16 => TensorData::F32(unpack_bf16(&w, l.numel())),
            _ => TensorData::F32(w.into_iter().map(f32::from_bits).collect()),
        };
        Ok(Tensor {
            shape: l.shape().to_vec(),
            data,
        })
    }

    /// Runs one kernel (the CPU executor's `launch::run_exec`, on the device).
    pub(crate) fn exec(&mut self, step: &Step, ins: &[&DLoc], outs: &[DLoc]) -> Result<(), String> {
        match &step.exec {
            StepExec::Gemm { bias, relu } => {
                self.linear(ins, &outs[0], bias.as_deref(), relu.as_deref())
            }
            StepExec::Region { f, expr, inner } => self.region(f, expr, inner, ins, &outs[0]),
            StepExec::Softmax(f) => {
                let x = self.contig(ins[0])?;
                let c = x.last();
                let l = Launch::same(rows::softmax_dims(x.numel() / c.max(1), c));
                self.launch(f, &[x.base(), outs[0].base()], l)
            }
            StepExec::ScaleMaskSoftmax(f, mask) => {
                let masked = usize::from(*mask != MaskKind::None);
                let contig = |l: &DLoc| self.contig(l);
                let (ptrs, x) = row_buffers((ins, &outs[..1]), 1 + masked, contig, DLoc::base)?;
                let s = x.shape().to_vec();
                let l = Launch::same(rows::scale_mask_softmax_dims(s[0], s[1], s[2], s[3]));
                self.launch(f, &ptrs, l)
            }
            StepExec::Attention {
                flash: Some(f),
                mask,
                ..
            } => self.flash_forward(ins, &outs[0], f, *mask),
            StepExec::Attention { softmax, mask, .. } => {
                self.attention(ins, &outs[0], softmax, *mask)
            }
            StepExec::AttentionBwd {
                flash: Some((fq, fkv)),
                mask,
                short,
                ..
            } => self.flash_backward(ins, outs, (fq, fkv, short.as_deref()), *mask),
            StepExec::AttentionBwd {
                softmax,
                softmax_bwd,
                mask,
                ..
            } => self.attention_bwd(ins, outs, softmax, softmax_bwd, *mask),
            StepExec::AddLayerNorm { f, add, rms } => {
                let form = if *add { LnForm::Add } else { LnForm::Plain };
                self.add_layer_norm(f, &layer_norm_operands(ins, form, *rms), &outs[0])
            }
            StepExec::AddLayerNormBwd { main, finish, form } => {
                let ins = layer_norm_operands(ins, *form, false);
                self.add_layer_norm_bwd(main, finish, &ins, outs)
            }
            StepExec::XentLs {
                count,
                main,
                finish,
                pad,
                grad,
            } => self.xent_ls([count, main, finish], *pad, *grad, ins, outs),
            StepExec::EmbedPe { f, dropout } => self.embed_pe(f, *dropout, ins, &outs[0]),
            StepExec::SumRows { main, finish } => {
                if step.bias_grad.is_some() {
                    self.bias_grads.1 += 1;
                }
                self.sum_rows(main, finish, ins[0], &outs[0])
            }
            StepExec::Adam(f) => {
                let mut ptrs = Vec::with_capacity(14);
                for l in ins.iter().take(4) {
                    ptrs.push(self.contig(l)?.base());
                }
                for l in ins.iter().skip(4) {
                    ptrs.push(l.base());
                }
                for o in outs {
                    ptrs.push(o.base());
                }
                self.launch(f, &ptrs, Launch::adam(outs[0].numel()))
            }
            StepExec::Reduce { f, axis, layout } => {
                let x = self.contig(ins[0])?;
                let s = x.shape();
                let outer: usize = s[..*axis].iter().product();
                let len = s[*axis];
                let inner: usize = s[axis + 1..].iter().product();
                if *layout == ReduceLayout::Rows && inner != 1 {
                    return Err("internal: a row reduction over a non-last axis".into());
                }
                let l = Launch::reduce(*layout, outer, len, inner);
                self.launch(f, &[x.base(), outs[0].base()], l)
            }
            StepExec::CausalMask(f) => {
                let s = outs[0].shape();
                let l = Launch::same(index::causal_mask_dims(s[0], s[1]));
                self.launch(f, &[outs[0].base()], l)
            }
            StepExec::PadMask(f, pad) => {
                let ids = self.contig(ins[0])?;
                let l = Launch::same(index::pad_mask_dims(ids.numel(), *pad));
                self.launch(f, &[ids.base(), outs[0].base()], l)
            }
            StepExec::Arange(f, start) => self.arange(f, start, &outs[0]),
            StepExec::Concat(f, axis) => self.concat(f, *axis, ins, &outs[0]),
            StepExec::ScatterAdd(f) => {
                let out = &outs[0];
                let (start, order, src, l) = self.scatter_index(ins[0], ins[1], out)?;
                self.launch(f, &[start, order, src, out.base()], l)
            }
            StepExec::ScatterAddInto(f) => self.scatter_add_into(f, ins, &outs[0]),
            StepExec::Host(fb) => self.host(fb, ins, outs),
        }
    }

    /// A kernel without CUDA code: operands to the host, the CPU executor's fallback,
    /// results back into the arena.
    pub(crate) fn host(
        &mut self,
        fb: &fallback::Fallback,
        ins: &[&DLoc],
        outs: &[DLoc],
    ) -> Result<(), String> {
        if ins.iter().any(|l| l.is_bf16()) || outs.iter().any(|l| l.is_bf16()) {
            return Err("internal: a host kernel with a bf16 buffer".into());
        }
        let mut host_ins: Vec<Vec<u32>> = Vec::with_capacity(ins.len());
        for l in ins {
            host_ins.push(self.words(l)?);
        }
        let mut host_outs: Vec<Vec<u32>> =
            outs.iter().map(|o| vec![0u32; o.numel().max(1)]).collect();
        let in_locs: Vec<Loc> = host_ins
            .iter_mut()
            .zip(ins)
            .map(|(w, l)| Loc {
                ptr: w.as_mut_ptr() as *mut u8,
                layout: Layout::contiguous(l.shape()),
                dtype: l.dtype,
            })
            .collect();
        let out_locs: Vec<Loc> = host_outs
            .iter_mut()
            .zip(outs)
            .map(|(w, o)| Loc {
                ptr: w.as_mut_ptr() as *mut u8,
                layout: Layout::contiguous(o.shape()),
                dtype: o.dtype,
            })
            .collect();
        let in_refs: Vec<&Loc> = in_locs.iter().collect();
        let ctx = HostCtx {
            dims: self.dims,
            seed: self.seed,
            step: self.step,
            pool: self.pool,
        };
        fallback::run_host(fb, &in_refs, &out_locs, &ctx)?;
        for (o, w) in outs.iter().zip(&host_outs) {
            if !o.layout.is_contiguous() {
                return Err("internal: a strided kernel result".into());
            }
            self.dev.write(o.base(), &w[..o.numel()])?;
        }
        Ok(())
    }
}

/// `(b, h, tq, tk, dk, dv)` of attention operands `q [b, h, tq, dk]`, `k [b, h, tk, dk]`,
/// `v [b, h, tk, dv]`.
pub(crate) fn attention_sizes(
    q: &DLoc,
    k: &DLoc,
    v: &DLoc,
) -> Result<(usize, usize, usize, usize, usize, usize), String> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Err(format!(
            "attention takes [b, h, t, d] operands, not {qs:?}, {ks:?}, {vs:?}"
        ));
    }
    Ok((qs[0], qs[1], qs[2], ks[2], qs[3], vs[3]))
}

/// The attention results the batched-GEMM path writes must be contiguous (it writes
/// each head's matrix whole; only the flash kernels take merged heads).
pub(crate) fn results_contiguous(outs: &[DLoc]) -> Result<(), String> {
    match outs.iter().find(|o| !o.layout.is_contiguous()) {
        Some(o) => Err(format!(
            "internal: the batched-GEMM attention writes contiguous results, not {:?}",
            o.layout
        )),
        None => Ok(()),
    }
}

/// [`KernelGraph::heads_merged`] where the kernel runs as flash kernels that write
/// through their results' strides.
pub(crate) fn heads_merged(
    kg: &KernelGraph,
    steps: &[Step],
) -> std::collections::HashSet<(usize, usize)> {
    let strided: BTreeSet<usize> = steps
        .iter()
        .filter(|s| {
            matches!(
                s.exec,
                StepExec::Attention {
                    flash: Some(_),
                    strided: true,
                    ..
                } | StepExec::AttentionBwd {
                    flash: Some(_),
                    strided: true,
                    ..
                }
            )
        })
        .map(|s| s.value)
        .collect();
    kg.heads_merged()
        .into_iter()
        .filter(|(v, _)| strided.contains(v))
        .collect()
}

/// The element strides of a rank-4 location.
pub(crate) fn strides4(l: &DLoc) -> Result<[usize; 4], String> {
    <[usize; 4]>::try_from(l.layout.strides.as_slice())
        .map_err(|_| format!("a rank-4 operand was expected, not {:?}", l.shape()))
}
