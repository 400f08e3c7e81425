//! Attention's launches: per head, `q·kᵀ` through a product, the generated masked
//! softmax in place and `p·v`; the backward recomputes `p` and runs the softmax's backward.

use ::gemm::Parallelism;
use kiln_compiler::codegen::jit::KernelFn;
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_matmul::{Mat, RowProduct};
use rayon::prelude::*;

use super::{Keep, Loc};

/// A raw pointer that may cross threads (each task touches its own elements).
#[derive(Clone, Copy)]
pub(super) struct P(*mut u8);
unsafe impl Send for P {}
unsafe impl Sync for P {}

/// The mask pointer for batch entry `bi` (key: row `bi` of `[b, tk]`; causal: the
/// `[tq, tk]` matrix), or null.
pub(super) fn mask_at(mask: Option<&Loc>, kind: MaskKind, bi: usize, tk: usize) -> *mut u8 {
    match (mask, kind) {
        (Some(m), MaskKind::Key) => m.base().wrapping_add(4 * bi * tk),
        (Some(m), MaskKind::Causal) => m.base(),
        _ => std::ptr::null_mut(),
    }
}

/// Checks that the attention kernels' score blocks fit in memory before they are
/// allocated: `blocks` `[tq, tk]` f32 matrices per worker thread (a sentence of 100,000
/// tokens asks 40 GB of each; the allocation would abort the process).
pub(super) fn scores_fit(kind: &str, blocks: usize, tq: usize, tk: usize) -> Result<(), String> {
    let threads = rayon::current_num_threads().max(1) as u64;
    let need = (blocks as u64)
        .saturating_mul(threads)
        .saturating_mul(tq as u64)
        .saturating_mul(tk as u64)
        .saturating_mul(4);
    kiln_compiler::memory::ensure(
        need,
        || {
            format!(
                "the compiled executor's `{kind}` ({blocks} f32 [{tq}, {tk}] score block(s) \
                 for each of {threads} threads)"
            )
        },
        || kiln_compiler::memory::SMALLER_RUN.into(),
    )
    .map_err(|e| e.to_string())
}

/// Attention's operands: `q`, `k`, `v` (`[b, h, t, d]`), the output gradient `g` of the
/// backward, the mask (contiguous) and the scale and fill scalars.
struct Operands<'a> {
    q: &'a Loc,
    k: &'a Loc,
    v: &'a Loc,
    g: Option<&'a Loc>,
    mask: Option<Loc>,
    kind: MaskKind,
    scale: P,
    fill: P,
}

impl<'a> Operands<'a> {
    /// From a kernel's inputs: `q, k, v, [mask], [g], scale, [fill]` (`g` with
    /// `backward`, the mask and fill unless `kind` is `None`).
    fn of(
        ins: &[&'a Loc],
        (kind, backward): (MaskKind, bool),
        keep: &mut Keep,
        contig: &mut dyn FnMut(&Loc, &mut Keep) -> Result<Loc, String>,
    ) -> Result<Operands<'a>, String> {
        let mut rest = ins[3..].iter().copied();
        let mut next = || {
            rest.next()
                .ok_or("internal: an attention kernel's operands")
        };
        let masked = kind != MaskKind::None;
        let mask = if masked {
            Some(contig(next()?, keep)?)
        } else {
            None
        };
        let g = if backward { Some(next()?) } else { None };
        let scale = P(next()?.base());
        let fill = P(if masked {
            next()?.base()
        } else {
            std::ptr::null_mut()
        });
        Ok(Operands {
            q: ins[0],
            k: ins[1],
            v: ins[2],
            g,
            mask,
            kind,
            scale,
            fill,
        })
    }

    /// `(b, h, tq, tk, dk, dv)`.
    fn sizes(&self) -> (usize, usize, usize, usize, usize, usize) {
        let qs = self.q.shape();
        (
            qs[0],
            qs[1],
            qs[2],
            self.k.shape()[2],
            qs[3],
            self.v.shape()[3],
        )
    }

    /// The probabilities of head (bi, hi) into `s` (`[tq, tk]`): `q·kᵀ`, then the masked
    /// scaled softmax in place (`dims` its dims).
    ///
    /// # Safety
    /// `s` holds `tq·tk` elements; the operands are live.
    unsafe fn probabilities(
        &self,
        s: &mut [f32],
        (bi, hi): (usize, usize),
        softmax: KernelFn,
        dims: &[i64],
    ) {
        let (_, _, tq, tk, dk, _) = self.sizes();
        let (q, k) = (head(self.q, bi, hi, 2, 3), head(self.k, bi, hi, 3, 2));
        product((tq, dk, tk), (s.as_mut_ptr(), tk as isize), q, k);
        self.softmax(s, bi, (tq, tk), softmax, dims);
    }

    /// The masked scaled softmax of batch entry `bi`'s scores `s` (`[tq, tk]`), in place.
    ///
    /// # Safety
    /// `s` holds `tq·tk` elements; the operands are live.
    unsafe fn softmax(
        &self,
        s: &mut [f32],
        bi: usize,
        (tq, tk): (usize, usize),
        softmax: KernelFn,
        dims: &[i64],
    ) {
        let sptr = s.as_mut_ptr() as *mut u8;
        match self.kind {
            MaskKind::None => {
                let ptrs = [sptr, self.scale.0, sptr];
                softmax(ptrs.as_ptr(), dims.as_ptr(), 0, tq as i64);
            }
            kind => {
                let m = mask_at(self.mask.as_ref(), kind, bi, tk);
                let ptrs = [sptr, m, self.scale.0, self.fill.0, sptr];
                softmax(ptrs.as_ptr(), dims.as_ptr(), 0, tq as i64);
            }
        }
    }

    /// Decoding's attention, one query a head: [`HEADS`] heads a task, their `q·kᵀ` and
    /// their `p·v` each run together ([`kiln_matmul::gemm_rows`], the same bits as one
    /// head at a time), the softmax between them head by head.
    fn one_query(&self, o: HeadsOut, softmax: KernelFn, dims: &[i64]) {
        let (b, h, _, tk, dk, dv) = self.sizes();
        (0..(b * h).div_ceil(HEADS)).into_par_iter().for_each_init(
            || vec![0f32; HEADS * tk],
            |s, task| {
                let heads = task * HEADS..(task * HEADS + HEADS).min(b * h);
                let at = |bh: usize| (bh / h, bh % h);
                let scores: Vec<RowProduct> = heads
                    .clone()
                    .zip(s.chunks_mut(tk))
                    .map(|(bh, row)| {
                        let (bi, hi) = at(bh);
                        let (a, b) = (head(self.q, bi, hi, 2, 3), head(self.k, bi, hi, 3, 2));
                        RowProduct {
                            a,
                            b,
                            dst: row.as_mut_ptr(),
                        }
                    })
                    .collect();
                // SAFETY: each task writes its own scratch and its own heads of `out`;
                // the operands are live.
                unsafe {
                    kiln_matmul::gemm_rows((dk, tk), &scores);
                    for (bh, row) in heads.clone().zip(s.chunks_mut(tk)) {
                        self.softmax(row, at(bh).0, (1, tk), softmax, dims);
                    }
                    let outs: Vec<RowProduct> = heads
                        .zip(s.chunks(tk))
                        .map(|(bh, row)| {
                            let (bi, hi) = at(bh);
                            let (a, b) = (rows_of(row.as_ptr(), tk), head(self.v, bi, hi, 2, 3));
                            RowProduct {
                                a,
                                b,
                                dst: o.at(bi, hi),
                            }
                        })
                        .collect();
                    kiln_matmul::gemm_rows((tk, dv), &outs);
                }
            },
        );
    }
}

/// Heads a task of [`Operands::one_query`] takes: the most [`kiln_matmul::gemm_rows`]
/// runs together.
const HEADS: usize = 8;

/// `dst = a·b` (`(m, k, n)`, `dst` with row stride `ld`), on the calling thread.
///
/// # Safety
/// As [`kiln_matmul::gemm_one`].
unsafe fn product((m, k, n): (usize, usize, usize), (dst, ld): (*mut f32, isize), a: Mat, b: Mat) {
    kiln_matmul::gemm_one(
        (m, k, n),
        a,
        b,
        kiln_matmul::Dst::new(dst, ld, false),
        Parallelism::None,
    );
}

/// A row-major `[_, cols]` matrix at `ptr`.
fn rows_of(ptr: *const f32, cols: usize) -> Mat {
    Mat {
        ptr,
        rs: cols as isize,
        cs: 1,
    }
}

/// Attention forward: per (batch, head), `s = q·kᵀ` (GEMM), the masked scaled softmax
/// in place (generated), `o = s·v` (GEMM). Heads run in parallel.
pub(super) fn attention(
    ins: &[&Loc],
    out: &Loc,
    softmax: KernelFn,
    mask: MaskKind,
    keep: &mut Keep,
    contig: &mut dyn FnMut(&Loc, &mut Keep) -> Result<Loc, String>,
) -> Result<(), String> {
    let ops = Operands::of(ins, (mask, false), keep, contig)?;
    let (b, h, tq, tk, _, dv) = ops.sizes();
    let o = HeadsOut::of(out)?;
    scores_fit("attention", 1, tq, tk)?;
    let (dims, _) = rows::scale_mask_softmax_dims(1, 1, tq, tk);
    if tq == 1 && tk > 0 {
        ops.one_query(o, softmax, &dims);
        return Ok(());
    }
    (0..b * h).into_par_iter().for_each_init(
        || vec![0f32; tq * tk],
        |s, bh| {
            let (bi, hi) = (bh / h, bh % h);
            // SAFETY: each task writes its own scratch and its own head of `out`.
            unsafe {
                ops.probabilities(s, (bi, hi), softmax, &dims);
                let (p, v) = (rows_of(s.as_ptr(), tk), head(ops.v, bi, hi, 2, 3));
                product((tq, tk, dv), (o.at(bi, hi), o.rs), p, v);
            }
        },
    );
    Ok(())
}

/// Where an attention kernel writes head (bi, hi) of a `[b, h, t, d]` result: contiguous,
/// or with the heads merged (`[b, t, h, d]` storage, [`Layout::heads_merged`]); rows of
/// `d` contiguous elements either way.
#[derive(Clone, Copy)]
pub(super) struct HeadsOut {
    ptr: P,
    sb: usize,
    sh: usize,
    /// The row stride.
    rs: isize,
}

impl HeadsOut {
    fn of(l: &Loc) -> Result<HeadsOut, String> {
        let st = &l.layout.strides;
        if st.len() != 4 || (st[3] != 1 && l.layout.shape[3] > 1) {
            return Err(format!(
                "internal: an attention result of layout {:?} (rows of contiguous elements expected)",
                l.layout
            ));
        }
        Ok(HeadsOut {
            ptr: P(l.base()),
            sb: st[0],
            sh: st[1],
            rs: st[2] as isize,
        })
    }

    /// The first element of head (bi, hi).
    fn at(&self, bi: usize, hi: usize) -> *mut f32 {
        (self.ptr.0 as *mut f32).wrapping_add(bi * self.sb + hi * self.sh)
    }
}

/// The `[rows, cols]` matrix of head (bi, hi) of a `[b, h, t, d]` location, with rows
/// along axis `r` and columns along axis `c` (`r = 3, c = 2` reads it transposed).
pub(super) fn head(l: &Loc, bi: usize, hi: usize, r: usize, c: usize) -> Mat {
    let st = &l.layout.strides;
    let off = l.layout.offset + bi * st[0] + hi * st[1];
    Mat {
        ptr: (l.ptr as *const f32).wrapping_add(off),
        rs: st[r] as isize,
        cs: st[c] as isize,
    }
}

/// Attention backward: per (batch, head), recompute `p` (GEMM + generated softmax),
/// `dv = pᵀ·g`, `dp = g·vᵀ`, `ds = softmax_bwd(p, dp)·scale` (generated; zero where
/// masked), `dq = ds·k`, `dk = dsᵀ·q`.
pub(super) fn attention_bwd(
    ins: &[&Loc],
    outs: &[Loc],
    softmax: KernelFn,
    softmax_bwd: KernelFn,
    mask: MaskKind,
    keep: &mut Keep,
    contig: &mut dyn FnMut(&Loc, &mut Keep) -> Result<Loc, String>,
) -> Result<(), String> {
    let ops = Operands::of(ins, (mask, true), keep, contig)?;
    let g = ops
        .g
        .ok_or("internal: attention_bwd without its output gradient")?;
    let (b, h, tq, tk, dk, dv) = ops.sizes();
    let (dq, dkk, dvv) = (
        HeadsOut::of(&outs[0])?,
        HeadsOut::of(&outs[1])?,
        HeadsOut::of(&outs[2])?,
    );
    scores_fit("attention_bwd", 2, tq, tk)?;
    let (dims, _) = rows::scale_mask_softmax_dims(1, 1, tq, tk);
    let (bdims, _) = rows::softmax_bwd_dims(tq, tk);
    (0..b * h).into_par_iter().for_each_init(
        || (vec![0f32; tq * tk], vec![0f32; tq * tk]),
        |(s, dp), bh| {
            let (bi, hi) = (bh / h, bh % h);
            let (q, k) = (head(ops.q, bi, hi, 2, 3), head(ops.k, bi, hi, 2, 3));
            // SAFETY: each task writes its own scratch and its own heads of the results.
            unsafe {
                ops.probabilities(s, (bi, hi), softmax, &dims);
                let gm = head(g, bi, hi, 2, 3);
                // dv = pᵀ·g
                let pt = rows_of(s.as_ptr(), tk).transposed();
                product((tk, tq, dv), (dvv.at(bi, hi), dvv.rs), pt, gm);
                // dp = g·vᵀ
                let vt = head(ops.v, bi, hi, 3, 2);
                product((tq, dv, tk), (dp.as_mut_ptr(), tk as isize), gm, vt);
                let (sptr, dpp) = (s.as_mut_ptr() as *mut u8, dp.as_mut_ptr() as *mut u8);
                let bp = [sptr, dpp, ops.scale.0, dpp];
                softmax_bwd(bp.as_ptr(), bdims.as_ptr(), 0, tq as i64);
                let mp = mask_at(ops.mask.as_ref(), mask, bi, tk);
                if !mp.is_null() {
                    let mi = mp as *const i32;
                    for i in 0..tq {
                        let row = if mask == MaskKind::Key { 0 } else { i * tk };
                        for j in 0..tk {
                            if *mi.add(row + j) == 0 {
                                dp[i * tk + j] = 0.0;
                            }
                        }
                    }
                }
                let ds = rows_of(dp.as_ptr(), tk);
                product((tq, tk, dk), (dq.at(bi, hi), dq.rs), ds, k);
                product((tk, tq, dk), (dkk.at(bi, hi), dkk.rs), ds.transposed(), q);
            }
        },
    );
    Ok(())
}
