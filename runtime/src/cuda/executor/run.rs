//! One run's launches on the device: every kernel of the launch plan through the
//! generated functions, cuBLAS and cuBLASLt, with its scratch, views and bias-gradient
//! pairs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use kiln_compiler::bind::Source;
use kiln_compiler::codegen::cuda::attention::{self, Part};
use kiln_compiler::codegen::cuda::cast;
use kiln_compiler::codegen::cuda::index;
use kiln_compiler::codegen::cuda::misc as cuda_misc;
use kiln_compiler::codegen::misc::{ReduceLayout, MAX_COPY_RANK};
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_compiler::ir::DType;
use kiln_compiler::optimize::kernels::KernelGraph;
use kiln_compiler::tensor::{Tensor, TensorData};

use super::*;
use crate::compiled::fallback::{self, HostCtx};
use crate::compiled::launch::region_operand;
use crate::compiled::Loc;
use crate::cuda::abi::{
    blas_operand, even_stride, plan_matmul, sgemm_args, Launch, MatDesc, MatmulPlan,
};
use crate::cuda::device::{self, Buf, Device};
use crate::cuda::steps::{Exec as StepExec, Step};
use crate::eager::pool::Pool;
use crate::eager::value::Layout;

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

    /// `out = a·b` (`beta = 1`: `out += a·b`, a bias already loaded), `out` contiguous.
    pub(crate) fn matmul(
        &mut self,
        a: &DLoc,
        b: &DLoc,
        out: &DLoc,
        beta: f32,
    ) -> Result<(), String> {
        let plan = self.matmul_plan(a, b)?;
        let (a, b, plan) = plan;
        if out.numel() == 0 {
            return Ok(());
        }
        if plan.empty_k {
            return if beta == 0.0 {
                self.dev.zero(out.base(), words_of(out.dtype, out.numel()))
            } else {
                Ok(())
            };
        }
        let ops = self.matmul_ops(&a, &b, plan)?;
        self.matmul_launch(&ops, out, beta)
    }

    /// The plan of `a·b`, with the operands cuBLAS cannot read as they are copied
    /// contiguous first (the returned locations).
    pub(crate) fn matmul_plan(
        &mut self,
        a: &DLoc,
        b: &DLoc,
    ) -> Result<(DLoc, DLoc, MatmulPlan), String> {
        let (mut a, mut b) = (a.clone(), b.clone());
        let plan = match plan_matmul(&a.layout, &b.layout) {
            Ok(p) => p,
            Err(Err(m)) => return Err(m),
            Err(Ok(need)) => {
                if need.a {
                    a = self.contig(&a)?;
                }
                if need.b {
                    b = self.contig(&b)?;
                }
                plan_matmul(&a.layout, &b.layout).map_err(|e| match e {
                    Ok(n) => format!("internal: cuBLAS cannot read contiguous operands ({n:?})"),
                    Err(m) => m,
                })?
            }
        };
        Ok((a, b, plan))
    }

    /// The operands' addresses: f32 in place, or as bf16 — in place when stored in
    /// bf16 (mixed precision), else bf16 copies (element `e` of the f32 location at
    /// `base + 2·(e − lo)`).
    pub(crate) fn matmul_ops(
        &mut self,
        a: &DLoc,
        b: &DLoc,
        plan: MatmulPlan,
    ) -> Result<MatmulOps, String> {
        if !self.bf16 && (a.is_bf16() || b.is_bf16()) {
            return Err("internal: a bf16 operand of an f32 GEMM".to_string());
        }
        Ok(if self.bf16 {
            let (pa, la) = self.bf16_span(a)?;
            let (pb, lb) = self.bf16_span(b)?;
            MatmulOps {
                plan,
                a: Addr {
                    base: pa,
                    lo: la,
                    size: 2,
                },
                b: Addr {
                    base: pb,
                    lo: lb,
                    size: 2,
                },
                elem: device::GemmElem::Bf16,
            }
        } else {
            MatmulOps {
                plan,
                a: Addr {
                    base: a.ptr,
                    lo: 0,
                    size: 4,
                },
                b: Addr {
                    base: b.ptr,
                    lo: 0,
                    size: 4,
                },
                elem: device::GemmElem::F32,
            }
        })
    }

    /// The cuBLAS calls of a planned GEMM into `out` (`beta`: 1 adds to what `out`
    /// holds), f32 or, in a mixed-precision program, bf16.
    pub(crate) fn matmul_launch(
        &mut self,
        ops: &MatmulOps,
        out: &DLoc,
        beta: f32,
    ) -> Result<(), String> {
        let plan = &ops.plan;
        let out_elem = if out.is_bf16() {
            device::GemmElem::Bf16
        } else {
            device::GemmElem::F32
        };
        match plan.strided {
            Some((sa, sb)) => self.dev.gemm(
                &plan.gemm,
                ops.elem,
                out_elem,
                ops.a.at(plan.a_offsets[0]),
                ops.b.at(plan.b_offsets[0]),
                out.base(),
                beta,
                Some((plan.a_offsets.len(), sa, sb, plan.c_stride as i64)),
            ),
            None => {
                for (i, (&oa, &ob)) in plan.a_offsets.iter().zip(&plan.b_offsets).enumerate() {
                    self.dev.gemm(
                        &plan.gemm,
                        ops.elem,
                        out_elem,
                        ops.a.at(oa),
                        ops.b.at(ob),
                        out.at(out.layout.offset + i * plan.c_stride),
                        beta,
                        None,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// `out[j] = Σ_rows x[…, j]`: a chunk's partial sums, then their finish.
    pub(crate) fn sum_rows(
        &mut self,
        main: &str,
        finish: &str,
        x: &DLoc,
        out: &DLoc,
    ) -> Result<(), String> {
        let x = self.contig(x)?;
        let n = x.last();
        let rows = x.numel() / n.max(1);
        let part = self.alloc(cuda_misc::sum_rows_chunks(rows) * n)?;
        let (main_l, finish_l) = Launch::sum_rows(x.shape());
        self.launch(main, &[x.base(), part], main_l)?;
        self.launch(finish, &[part, out.base()], finish_l)
    }

    /// Step `s` of a bias-gradient pair (the launch plan's; `other` is the other
    /// step): what this did of the step's work ([`Paired`]).
    /// - A `sum_rows` before its GEMM is deferred to it (unless its rows are a view copy,
    ///   which may be freed by then); one after its GEMM copies what the GEMM computed.
    /// - The GEMM computes the bias gradient in its epilogue ([`Run::gemm_bias_grad`]):
    ///   into the `sum_rows`'s result when that came first — its slot is planned from the
    ///   `sum_rows` on, and no kernel between reads it — or into a buffer of its own when
    ///   the `sum_rows` comes later. Where it cannot, a deferred `sum_rows` runs after it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn bias_grad_pair(
        &mut self,
        steps: &[Step],
        s: usize,
        other: usize,
        ins: &[&DLoc],
        outs: &[DLoc],
        locs: &[Vec<DLoc>],
        needs: &[Vec<usize>],
    ) -> Result<Paired, String> {
        let step = &steps[s];
        match &step.exec {
            StepExec::SumRows { .. } if other > s => {
                if !needs[step.inputs[0]].is_empty() {
                    return Ok(Paired::No);
                }
                self.bias_deferred
                    .insert(other, (s, ins[0].clone(), outs[0].clone()));
                Ok(Paired::Left)
            }
            StepExec::SumRows { .. } => {
                let Some(buf) = self.bias_ready.remove(&s) else {
                    return Ok(Paired::No);
                };
                let out = &outs[0];
                let bytes = elem_bytes(out.dtype) as usize * out.numel();
                self.dev.copy_bytes(out.base(), buf.ptr, bytes)?;
                // Freed in stream order, as a kernel's scratch.
                self.keep.push(buf);
                Ok(Paired::Left)
            }
            StepExec::Gemm { .. } if other < s => {
                let Some((sum, dy, db)) = self.bias_deferred.remove(&s) else {
                    return Ok(Paired::No);
                };
                if self.gemm_bias_grad(ins[0], ins[1], &outs[0], &dy, &db)? {
                    self.bias_grads.0 += 1;
                    return Ok(Paired::Summed);
                }
                self.exec(step, ins, outs)?;
                let StepExec::SumRows { main, finish } = &steps[sum].exec else {
                    return Err(format!("internal: step {sum} deferred as a bias gradient"));
                };
                self.bias_grads.1 += 1;
                self.sum_rows(main, finish, &dy, &db)?;
                Ok(Paired::RanBoth)
            }
            StepExec::Gemm { .. } => {
                let sum = &steps[other];
                if !needs[sum.inputs[0]].is_empty() {
                    return Ok(Paired::No);
                }
                let (dy, db) = (&locs[sum.inputs[0]][0], &locs[sum.value][0]);
                // Every element is written by the epilogue: no need to zero it.
                let buf = self
                    .dev
                    .alloc_uninit(words_of(db.dtype, db.numel()).max(1))?;
                let to = DLoc {
                    ptr: buf.ptr,
                    layout: Layout::contiguous(db.shape()),
                    dtype: db.dtype,
                };
                if self.gemm_bias_grad(ins[0], ins[1], &outs[0], dy, &to)? {
                    self.bias_grads.0 += 1;
                    self.bias_ready.insert(other, buf);
                    return Ok(Paired::Summed);
                }
                Ok(Paired::No)
            }
            _ => Ok(Paired::No),
        }
    }

    /// `out = x·w` and `db[j] = Σ_rows dy[…, j]` in one cuBLASLt call, where the GEMM
    /// reads `dy` in place as its right operand (`w` is `dy` as `[rows, n]`: cuBLAS's
    /// first operand, summed along `k` by the `BGRADA` epilogue). `Ok(false)`, with
    /// nothing launched, where it does not (a copy, a batched or empty product, a bf16
    /// cast of an f32 `dy`), for a single row, or where cuBLASLt has no algorithm.
    pub(crate) fn gemm_bias_grad(
        &mut self,
        x: &DLoc,
        w: &DLoc,
        out: &DLoc,
        dy: &DLoc,
        db: &DLoc,
    ) -> Result<bool, String> {
        let n = dy.last();
        let rows = dy.numel() / n.max(1);
        // One row (`k = 1`) stays apart: OneFlow found cuBLASLt's bias gradient wrong there
        // (its `cublas_fused_matmul_bias_add_grad.cu` copies the row instead).
        if out.numel() == 0
            || rows < 2
            || !dy.layout.is_contiguous()
            || !db.layout.is_contiguous()
            || db.numel() != n
            || w.dtype != dy.dtype
            || (self.bf16 && !w.is_bf16())
        {
            return Ok(false);
        }
        let (a, b, plan) = self.matmul_plan(x, w)?;
        let g = plan.gemm;
        let in_place = plan.a_offsets.len() == 1
            && plan.strided.is_none()
            && !plan.empty_k
            && b.ptr == w.ptr
            && b.at(plan.b_offsets[0]) == dy.base()
            && !g.transa
            && g.lda as usize == n
            && g.m as usize == n
            && g.k as usize == rows;
        if !in_place {
            return Ok(false);
        }
        let out_elem = if out.is_bf16() {
            device::GemmElem::Bf16
        } else {
            device::GemmElem::F32
        };
        let ops = self.matmul_ops(&a, &b, plan)?;
        let p = &ops.plan;
        self.dev.gemm_bias_grad(
            &p.gemm,
            (ops.elem, out_elem),
            ops.a.at(p.a_offsets[0]),
            ops.b.at(p.b_offsets[0]),
            out.base(),
            db.base(),
            db.is_bf16(),
        )
    }

    /// A `linear` kernel: `out = x·w + bias` (`relu`: then `max(·, 0)`); `bias_fill`
    /// and `relu` are the generated kernels of the separate path. One cuBLASLt call with
    /// a bias epilogue where it can (one GEMM over every row, cuBLASLt has an algorithm);
    /// otherwise the bias rows, a GEMM adding to them, and a ReLU pass.
    pub(crate) fn linear(
        &mut self,
        ins: &[&DLoc],
        out: &DLoc,
        bias_fill: Option<&str>,
        relu: Option<&str>,
    ) -> Result<(), String> {
        let Some(fill) = bias_fill else {
            self.matmul(ins[0], ins[1], out, 0.0)?;
            if let Some(f) = relu {
                self.launch(f, &[out.base()], Launch::relu(out.numel()))?;
            }
            return Ok(());
        };
        let bias = self.contig(ins[2])?;
        let (a, b, plan) = self.matmul_plan(ins[0], ins[1])?;
        let n = out.last();
        let rows = out.numel() / n.max(1);
        let one_gemm = plan.a_offsets.len() == 1 && plan.strided.is_none() && !plan.empty_k;
        if out.numel() == 0 {
            return Ok(());
        }
        let ops = self.matmul_ops(&a, &b, plan)?;
        // cuBLASLt's epilogue writes the result in its element type and reads the bias in
        // the same: a bf16 result (mixed precision, bf16 operands) takes the f32 bias
        // rounded to bf16, as the separate path's bias fill rounds it.
        let out_elem = if out.is_bf16() {
            device::GemmElem::Bf16
        } else {
            device::GemmElem::F32
        };
        let fusable = out_elem == device::GemmElem::F32 || ops.elem == device::GemmElem::Bf16;
        if self.fused_epilogues && one_gemm && bias.dtype == DType::F32 && fusable {
            let bias_ptr = if out_elem == device::GemmElem::Bf16 {
                // Contiguous: its first element is at the span's start (a parameter's
                // cast is made once a run, or once a parameters version).
                self.bf16_span(&bias)?.0
            } else {
                bias.base()
            };
            let p = &ops.plan;
            let fused = self.dev.gemm_bias(
                &p.gemm,
                (ops.elem, out_elem),
                ops.a.at(p.a_offsets[0]),
                ops.b.at(p.b_offsets[0]),
                out.base(),
                bias_ptr,
                relu.is_some(),
            )?;
            if fused {
                self.epilogues.0 += 1;
                return Ok(());
            }
        }
        self.epilogues.1 += 1;
        self.launch(fill, &[bias.base(), out.base()], Launch::fill_rows(rows, n))?;
        if !ops.plan.empty_k {
            self.matmul_launch(&ops, out, 1.0)?;
        }
        if let Some(f) = relu {
            self.launch(f, &[out.base()], Launch::relu(out.numel()))?;
        }
        Ok(())
    }

    /// The elements `l` can address, `lo..hi` of its buffer, converted to bf16 in a
    /// fresh buffer: its address and `lo`.
    pub(crate) fn bf16_span(&mut self, l: &DLoc) -> Result<(u64, usize), String> {
        if l.is_bf16() {
            // Stored in bf16 already: element `e` at `ptr + 2·e`.
            return Ok((l.ptr, 0));
        }
        if l.dtype != DType::F32 {
            return Err(format!("a {:?} GEMM operand", l.dtype));
        }
        let lo = l.layout.offset;
        let hi = lo
            + l.layout
                .shape
                .iter()
                .zip(&l.layout.strides)
                .map(|(&d, &s)| d.saturating_sub(1) * s)
                .sum::<usize>()
            + 1;
        let n = hi - lo;
        let key = (l.ptr, lo, n);
        if let Some(b) = self.casts.get(&key) {
            return Ok((b.ptr, lo));
        }
        // Every element of the copy is written: no need to zero it.
        let buf = self.dev.alloc_uninit(n.div_ceil(2))?;
        let dst = buf.ptr;
        self.dev
            .launch(cast::TO_BF16, &[l.at(lo), dst], &[n as i64], n)?;
        if self.params.contains(&l.ptr) {
            self.casts.insert(key, buf);
        } else {
            self.keep.push(buf);
        }
        Ok((dst, lo))
    }

    /// Per head `i`: `c_i[m, n] = a_i[m, k]·b_i[k, n]` into contiguous `c` (`m·n` per
    /// head); one strided-batched call when the heads are evenly spaced.
    pub(crate) fn head_gemms(
        &self,
        (m, k, n): (usize, usize, usize),
        a: &Heads,
        b: &Heads,
        c: u64,
    ) -> Result<(), String> {
        let count = a.offsets.len();
        if count == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            return self.dev.zero(c, count * m * n);
        }
        let da = MatDesc {
            rows: m,
            cols: k,
            rs: a.rs,
            cs: a.cs,
        };
        let db = MatDesc {
            rows: k,
            cols: n,
            rs: b.rs,
            cs: b.cs,
        };
        let g = sgemm_args((m, k, n), &da, &db, n).map_err(|e| match e {
            Ok(need) => format!("internal: attention operands cuBLAS cannot read ({need:?})"),
            Err(m) => m,
        })?;
        let at = |h: &Heads, i: usize| h.ptr + 4 * h.offsets[i] as u64;
        match (even_stride(&a.offsets), even_stride(&b.offsets)) {
            (Some(sa), Some(sb)) => self.dev.sgemm(
                &g,
                at(a, 0),
                at(b, 0),
                c,
                0.0,
                Some((count, sa, sb, (m * n) as i64)),
            ),
            _ => {
                for i in 0..count {
                    self.dev.sgemm(
                        &g,
                        at(a, i),
                        at(b, i),
                        c + 4 * (i * m * n) as u64,
                        0.0,
                        None,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// A `[b, h, t, d]` operand whose matrices cuBLAS can read (copied if not).
    pub(crate) fn blas_ready(&mut self, l: &DLoc) -> Result<DLoc, String> {
        let (s, st) = (&l.layout.shape, &l.layout.strides);
        let d = MatDesc {
            rows: s[2],
            cols: s[3],
            rs: st[2],
            cs: st[3],
        };
        if blas_operand(&d).is_some() {
            Ok(l.clone())
        } else {
            self.contig(l)
        }
    }

    /// Zeroes `ds[b, h, tq, tk]` where the mask is false (the CPU executor's rule), on
    /// the host: no generated function does it yet.
    pub(crate) fn zero_masked(
        &mut self,
        ds: u64,
        mask: &DLoc,
        kind: MaskKind,
        (b, h, tq, tk): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        let m = self.words(mask)?;
        let mut d = self.dev.read(ds, b * h * tq * tk)?;
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..tq {
                    let row = if kind == MaskKind::Key {
                        bi * tk
                    } else {
                        i * tk
                    };
                    for j in 0..tk {
                        if m[row + j] == 0 {
                            d[((bi * h + hi) * tq + i) * tk + j] = 0f32.to_bits();
                        }
                    }
                }
            }
        }
        self.dev.write(ds, &d)
    }

    /// Runs one kernel (the CPU executor's `launch::run_exec`, on the device).
    pub(crate) fn exec(&mut self, step: &Step, ins: &[&DLoc], outs: &[DLoc]) -> Result<(), String> {
        match &step.exec {
            StepExec::Gemm { bias, relu } => {
                self.linear(ins, &outs[0], bias.as_deref(), relu.as_deref())
            }
            StepExec::Region { f, expr, inner } => {
                let out = &outs[0];
                let shape = out.shape().to_vec();
                let mut ptrs = Vec::with_capacity(ins.len() + 1);
                let mut strides = Vec::with_capacity(ins.len());
                for (k, l) in ins.iter().enumerate() {
                    let want_unit = inner.get(k).copied().unwrap_or(true);
                    let mut l = (*l).clone();
                    let b = match region_operand(&l.layout, &shape, want_unit)? {
                        Some(b) => b,
                        None => {
                            l = self.contig(&l)?;
                            l.layout.broadcast(&shape)
                        }
                    };
                    ptrs.push(l.at(b.offset));
                    strides.push(b.strides.iter().map(|&s| s as isize).collect::<Vec<_>>());
                }
                ptrs.push(out.base());
                let launch = Launch::region(expr, &shape, &strides, self.seed, self.step);
                self.launch(f, &ptrs, launch)
            }
            StepExec::Softmax(f) => {
                let x = self.contig(ins[0])?;
                let c = x.last();
                let l = Launch::same(rows::softmax_dims(x.numel() / c.max(1), c));
                self.launch(f, &[x.base(), outs[0].base()], l)
            }
            StepExec::ScaleMaskSoftmax(f, mask) => {
                let x = self.contig(ins[0])?;
                let s = x.shape().to_vec();
                let l = Launch::same(rows::scale_mask_softmax_dims(s[0], s[1], s[2], s[3]));
                let ptrs = if *mask == MaskKind::None {
                    vec![x.base(), ins[1].base(), outs[0].base()]
                } else {
                    let m = self.contig(ins[1])?;
                    vec![
                        x.base(),
                        m.base(),
                        ins[2].base(),
                        ins[3].base(),
                        outs[0].base(),
                    ]
                };
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
            StepExec::AddLayerNorm(f) => {
                let x = self.contig(ins[0])?;
                let y = self.contig(ins[1])?;
                let g = self.contig(ins[2])?;
                let b = self.contig(ins[3])?;
                let d = x.last();
                let l = Launch::same(rows::add_layer_norm_dims(x.numel() / d.max(1), d));
                let ptrs = [
                    x.base(),
                    y.base(),
                    g.base(),
                    b.base(),
                    ins[4].base(),
                    ins[5].base(),
                    outs[0].base(),
                ];
                self.launch(f, &ptrs, l)
            }
            StepExec::AddLayerNormBwd { main, finish } => {
                let x = self.contig(ins[0])?;
                let y = self.contig(ins[1])?;
                let g = self.contig(ins[2])?;
                let dy = self.contig(ins[3])?;
                let d = x.last();
                let rows_n = x.numel() / d.max(1);
                let scratch = self.alloc(rows::add_layer_norm_bwd_scratch(rows_n, d))?;
                let ptrs = [
                    x.base(),
                    y.base(),
                    g.base(),
                    dy.base(),
                    ins[4].base(),
                    ins[5].base(),
                    outs[0].base(),
                    scratch,
                ];
                self.launch(
                    main,
                    &ptrs,
                    Launch::same(rows::add_layer_norm_bwd_dims(rows_n, d)),
                )?;
                self.launch(
                    finish,
                    &[scratch, outs[1].base(), outs[2].base()],
                    Launch::ln_bwd_finish(rows_n, d),
                )
            }
            StepExec::XentLs {
                count,
                main,
                finish,
                pad,
                grad,
            } => {
                let logits = self.contig(ins[0])?;
                let target = self.contig(ins[1])?;
                let v = logits.last();
                let rows_n = logits.numel() / v.max(1);
                // Targets are checked on the host, as on the CPU (the kernels read one out
                // of range as no class).
                kiln_compiler::bind::check_targets(&self.words(&target)?, v, *pad)?;
                let stats = self.alloc(2)?;
                let row_loss = self.alloc(rows_n)?;
                // The `seeded` form (a loss-scaled train_step) has the seed as operand 5.
                let count_bufs = match ins.get(5) {
                    Some(seed) => vec![target.base(), self.contig(seed)?.base(), stats],
                    None => vec![target.base(), stats],
                };
                self.launch(count, &count_bufs, Launch::xent_count(rows_n, *pad))?;
                let ptrs = rows::xent_ls_buffers(
                    [
                        logits.base(),
                        target.base(),
                        ins[2].base(),
                        ins[3].base(),
                        ins[4].base(),
                    ],
                    row_loss,
                    grad.then(|| (stats + 4, outs[1].base())),
                );
                self.launch(
                    main,
                    &ptrs,
                    Launch::same(rows::xent_ls_dims(rows_n, v, *pad)),
                )?;
                self.launch(
                    finish,
                    &[row_loss, stats, outs[0].base()],
                    Launch::xent_finish(rows_n),
                )
            }
            StepExec::EmbedPe { f, dropout } => {
                let table = self.contig(ins[0])?;
                let ids = self.contig(ins[1])?;
                let pe = self.contig(ins[2])?;
                let vocab = table.shape()[0];
                // Ids are checked on the host, as on the CPU (the kernel does not).
                for (i, w) in self.words(&ids)?.iter().enumerate() {
                    kiln_compiler::bind::check_id(
                        *w as i32,
                        vocab,
                        i,
                        format_args!("the embedding table has {vocab} rows"),
                    )?;
                }
                let s = outs[0].shape().to_vec();
                let l = Launch::embed_pe(s[2], s[1], s[0], *dropout, self.seed, self.step);
                let ptrs = [
                    table.base(),
                    ids.base(),
                    pe.base(),
                    ins[3].base(),
                    outs[0].base(),
                ];
                self.launch(f, &ptrs, l)
            }
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
            StepExec::Arange(f, start) => {
                let start = start
                    .eval(self.dims)
                    .map_err(|e| format!("arange start: {e}"))?;
                let n = outs[0].numel();
                let end = start + n as i64;
                if n > 0 && (start < i64::from(i32::MIN) || end - 1 > i64::from(i32::MAX)) {
                    return Err(format!("the range {start}..{end} does not fit in i32"));
                }
                self.launch(
                    f,
                    &[outs[0].base()],
                    Launch::same(index::arange_dims(n, start)),
                )
            }
            StepExec::Concat(f, axis) => {
                let out = &outs[0];
                let s = out.shape().to_vec();
                if *axis >= s.len() {
                    return Err(format!("internal: concat axis {axis} of {s:?}"));
                }
                let outer: usize = s[..*axis].iter().product();
                let inner: usize = s[axis + 1..].iter().product();
                let mut ptrs = Vec::with_capacity(ins.len() + 1);
                let mut sizes = Vec::with_capacity(ins.len());
                for l in ins {
                    sizes.push(l.shape()[*axis]);
                    ptrs.push(self.contig(l)?.base());
                }
                ptrs.push(out.base());
                self.launch(
                    f,
                    &ptrs,
                    Launch::same(index::concat_dims(outer, inner, &sizes)),
                )
            }
            StepExec::ScatterAdd(f) => {
                let out = &outs[0];
                let (start, order, src, l) = self.scatter_index(ins[0], ins[1], out)?;
                self.launch(f, &[start, order, src, out.base()], l)
            }
            StepExec::ScatterAddInto(f) => {
                let out = &outs[0];
                // A strided base is read through a contiguous copy; one planned in place
                // is `out` itself.
                let base = self.contig(ins[0])?;
                if base.numel() != out.numel() {
                    return Err(format!(
                        "scatter_add_into onto {} elements into {}",
                        base.numel(),
                        out.numel()
                    ));
                }
                let (start, order, src, l) = self.scatter_index(ins[1], ins[2], out)?;
                self.launch(f, &[start, order, base.base(), src, out.base()], l)
            }
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

    /// Flash attention forward ([`attention::forward`]): operands read through their
    /// strides, the mask made contiguous, `out` contiguous.
    pub(crate) fn flash_forward(
        &mut self,
        ins: &[&DLoc],
        out: &DLoc,
        f: &str,
        mask: MaskKind,
    ) -> Result<(), String> {
        let (q, k, v) = (ins[0], ins[1], ins[2]);
        let (b, h, tq, tk, dk, dv) = attention_sizes(q, k, v)?;
        let mut ptrs = vec![q.base(), k.base(), v.base()];
        if mask == MaskKind::None {
            ptrs.push(ins[3].base());
        } else {
            let m = self.contig(ins[3])?;
            ptrs.extend([m.base(), ins[4].base(), ins[5].base()]);
        }
        ptrs.push(out.base());
        let t = attention::tile(Part::Forward, dk, dv).ok_or("internal: no flash tile")?;
        let dims = attention::dims(
            b,
            h,
            tq,
            tk,
            &[strides4(q)?, strides4(k)?, strides4(v)?, strides4(out)?],
        );
        let items = attention::items(Part::Forward, t, b, h, tq, tk);
        self.launch(f, &ptrs, Launch { dims, items })
    }

    /// Flash attention backward: [`attention::backward_short`] (one block per head) when
    /// the module has it and both lengths fit its tile, else [`attention::backward_q`]
    /// (`dq` and the row statistics into scratch), then [`attention::backward_kv`] (`dk`,
    /// `dv`).
    pub(crate) fn flash_backward(
        &mut self,
        ins: &[&DLoc],
        outs: &[DLoc],
        (fq, fkv, short): (&str, &str, Option<&str>),
        mask: MaskKind,
    ) -> Result<(), String> {
        let (q, k, v) = (ins[0], ins[1], ins[2]);
        let (b, h, tq, tk, dk, dv) = attention_sizes(q, k, v)?;
        let mut ptrs = vec![q.base(), k.base(), v.base()];
        let g = if mask == MaskKind::None {
            ptrs.extend([ins[3].base(), ins[4].base()]);
            ins[3]
        } else {
            let m = self.contig(ins[3])?;
            ptrs.extend([m.base(), ins[4].base(), ins[5].base(), ins[6].base()]);
            ins[4]
        };
        let dims = attention::dims(
            b,
            h,
            tq,
            tk,
            &[
                strides4(q)?,
                strides4(k)?,
                strides4(v)?,
                strides4(g)?,
                strides4(&outs[0])?,
                strides4(&outs[1])?,
                strides4(&outs[2])?,
            ],
        );
        if let Some(fs) = short.filter(|_| attention::fits_short(tq, tk, dk, dv)) {
            ptrs.extend([outs[0].base(), outs[1].base(), outs[2].base()]);
            let items = attention::items(Part::Short, 0, b, h, tq, tk);
            return self.launch(fs, &ptrs, Launch { dims, items });
        }
        let stats = self.alloc(b * h * tq * 3)?;
        let tile = |p| attention::tile(p, dk, dv).ok_or("internal: no flash tile");
        let mut pq = ptrs.clone();
        pq.extend([outs[0].base(), stats]);
        let items = attention::items(Part::BackwardQ, tile(Part::BackwardQ)?, b, h, tq, tk);
        self.launch(
            fq,
            &pq,
            Launch {
                dims: dims.clone(),
                items,
            },
        )?;
        ptrs.extend([stats, outs[1].base(), outs[2].base()]);
        let items = attention::items(Part::BackwardKv, tile(Part::BackwardKv)?, b, h, tq, tk);
        self.launch(fkv, &ptrs, Launch { dims, items })
    }

    /// Attention forward on `[b, h, t, d]` operands: `s = q·kᵀ` for every head (batched
    /// GEMM into scratch), the generated masked softmax over all `b·h·tq` rows in place,
    /// `o = s·v` (batched GEMM into the contiguous result).
    pub(crate) fn attention(
        &mut self,
        ins: &[&DLoc],
        out: &DLoc,
        softmax: &str,
        mask: MaskKind,
    ) -> Result<(), String> {
        results_contiguous(std::slice::from_ref(out))?;
        let q = self.blas_ready(ins[0])?;
        let k = self.blas_ready(ins[1])?;
        let v = self.blas_ready(ins[2])?;
        let (m, scale, fill) = if mask == MaskKind::None {
            (None, ins[3], None)
        } else {
            (Some(self.contig(ins[3])?), ins[4], Some(ins[5]))
        };
        let qs = q.shape();
        let (b, h, tq, dk) = (qs[0], qs[1], qs[2], qs[3]);
        let tk = k.shape()[2];
        let dv = v.shape()[3];
        let s = self.alloc(b * h * tq * tk)?;
        self.head_gemms((tq, dk, tk), &heads(&q, 2, 3), &heads(&k, 3, 2), s)?;
        self.softmax_rows(s, softmax, m.as_ref(), scale, fill, (b, h, tq, tk))?;
        let p = scratch_heads(s, b * h, tq, tk, false);
        self.head_gemms((tq, tk, dv), &p, &heads(&v, 2, 3), out.base())
    }

    /// The generated masked scaled softmax over `s[b, h, tq, tk]`, in place.
    pub(crate) fn softmax_rows(
        &self,
        s: u64,
        f: &str,
        mask: Option<&DLoc>,
        scale: &DLoc,
        fill: Option<&DLoc>,
        (b, h, tq, tk): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        let l = Launch::same(rows::scale_mask_softmax_dims(b, h, tq, tk));
        let ptrs = match (mask, fill) {
            (Some(m), Some(fl)) => vec![s, m.base(), scale.base(), fl.base(), s],
            _ => vec![s, scale.base(), s],
        };
        self.launch(f, &ptrs, l)
    }

    /// Attention backward, as the CPU executor: recompute `p`, `dv = pᵀ·g`,
    /// `dp = g·vᵀ`, `ds = softmax_bwd(p, dp)·scale` (zero where masked), `dq = ds·k`,
    /// `dk = dsᵀ·q`, every GEMM batched over the heads.
    pub(crate) fn attention_bwd(
        &mut self,
        ins: &[&DLoc],
        outs: &[DLoc],
        softmax: &str,
        softmax_bwd: &str,
        mask: MaskKind,
    ) -> Result<(), String> {
        results_contiguous(outs)?;
        let q = self.blas_ready(ins[0])?;
        let k = self.blas_ready(ins[1])?;
        let v = self.blas_ready(ins[2])?;
        let (m, g, scale, fill) = if mask == MaskKind::None {
            (None, ins[3], ins[4], None)
        } else {
            (Some(self.contig(ins[3])?), ins[4], ins[5], Some(ins[6]))
        };
        let g = self.blas_ready(g)?;
        let qs = q.shape();
        let (b, h, tq, dk) = (qs[0], qs[1], qs[2], qs[3]);
        let tk = k.shape()[2];
        let dv = v.shape()[3];
        let n = b * h;
        let s = self.alloc(n * tq * tk)?;
        let dp = self.alloc(n * tq * tk)?;
        self.head_gemms((tq, dk, tk), &heads(&q, 2, 3), &heads(&k, 3, 2), s)?;
        self.softmax_rows(s, softmax, m.as_ref(), scale, fill, (b, h, tq, tk))?;
        // dv = pᵀ·g
        let pt = scratch_heads(s, n, tq, tk, true);
        self.head_gemms((tk, tq, dv), &pt, &heads(&g, 2, 3), outs[2].base())?;
        // dp = g·vᵀ
        self.head_gemms((tq, dv, tk), &heads(&g, 2, 3), &heads(&v, 3, 2), dp)?;
        let l = Launch::same(rows::softmax_bwd_dims(n * tq, tk));
        self.launch(softmax_bwd, &[s, dp, scale.base(), dp], l)?;
        if let Some(m) = &m {
            self.zero_masked(dp, m, mask, (b, h, tq, tk))?;
        }
        let ds = scratch_heads(dp, n, tq, tk, false);
        self.head_gemms((tq, tk, dk), &ds, &heads(&k, 2, 3), outs[0].base())?;
        let dst = scratch_heads(dp, n, tq, tk, true);
        self.head_gemms((tk, tq, dk), &dst, &heads(&q, 2, 3), outs[1].base())
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
