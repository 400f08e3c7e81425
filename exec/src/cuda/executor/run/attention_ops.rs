//! A run's attention on the device: the flash kernels where the plan has them, else per
//! head products around the generated masked softmax, and their backward.

use kiln_compiler::codegen::cuda::attention::{self, Part};
use kiln_compiler::codegen::rows::{self, MaskKind};

use crate::cuda::abi::{even_stride, sgemm_args, GemmPtrs, Launch, MatDesc};

use super::*;

impl Run<'_> {
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
                GemmPtrs {
                    a: at(a, 0),
                    b: at(b, 0),
                    c,
                    beta: 0.0,
                    batch: Some((count, sa, sb, (m * n) as i64)),
                },
            ),
            _ => {
                for i in 0..count {
                    self.dev.sgemm(
                        &g,
                        GemmPtrs {
                            a: at(a, i),
                            b: at(b, i),
                            c: c + 4 * (i * m * n) as u64,
                            beta: 0.0,
                            batch: None,
                        },
                    )?;
                }
                Ok(())
            }
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
