//! A run's products on the device: matmuls and linears through cuBLAS or cuBLASLt (with
//! the bias and ReLU epilogue), `sum_rows`, and a bias gradient paired with its weight
//! gradient's product.

use kiln_compiler::codegen::cuda::cast;
use kiln_compiler::codegen::cuda::misc as cuda_misc;
use kiln_compiler::ir::DType;

use crate::cuda::abi::{
    blas_operand, plan_matmul, EpiloguePtrs, GemmPtrs, Launch, MatDesc, MatmulPlan,
};
use crate::cuda::device::{self};
use crate::cuda::steps::{Exec as StepExec, Step};
use crate::eager::value::Layout;

use super::*;

impl Run<'_> {
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
                (ops.elem, out_elem),
                GemmPtrs {
                    a: ops.a.at(plan.a_offsets[0]),
                    b: ops.b.at(plan.b_offsets[0]),
                    c: out.base(),
                    beta,
                    batch: Some((plan.a_offsets.len(), sa, sb, plan.c_stride as i64)),
                },
            ),
            None => {
                for (i, (&oa, &ob)) in plan.a_offsets.iter().zip(&plan.b_offsets).enumerate() {
                    self.dev.gemm(
                        &plan.gemm,
                        (ops.elem, out_elem),
                        GemmPtrs {
                            a: ops.a.at(oa),
                            b: ops.b.at(ob),
                            c: out.at(out.layout.offset + i * plan.c_stride),
                            beta,
                            batch: None,
                        },
                    )?;
                }
                Ok(())
            }
        }
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
        let ptrs = EpiloguePtrs {
            a: ops.a.at(p.a_offsets[0]),
            b: ops.b.at(p.b_offsets[0]),
            c: out.base(),
            vector: db.base(),
        };
        let elems = (ops.elem, out_elem);
        self.dev.gemm_bias_grad(&p.gemm, elems, ptrs, db.is_bf16())
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
            let ptrs = EpiloguePtrs {
                a: ops.a.at(p.a_offsets[0]),
                b: ops.b.at(p.b_offsets[0]),
                c: out.base(),
                vector: bias_ptr,
            };
            let elems = (ops.elem, out_elem);
            let fused = self.dev.gemm_bias(&p.gemm, elems, ptrs, relu.is_some())?;
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
}
