//! Attention's launches: per head, `q·kᵀ` through a product, the generated masked
//! softmax in place and `p·v`; the backward recomputes `p` and runs the softmax's backward.

use ::gemm::Parallelism;
use kiln_compiler::codegen::jit::KernelFn;
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_matmul::Mat;
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
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let (m, scale, fill) = if mask == MaskKind::None {
        (None, ins[3], None)
    } else {
        (Some(contig(ins[3], keep)?), ins[4], Some(ins[5]))
    };
    let qs = q.shape();
    let (b, h, tq, dk) = (qs[0], qs[1], qs[2], qs[3]);
    let tk = k.shape()[2];
    let dv = v.shape()[3];
    let (sp, fp) = (
        P(scale.base()),
        P(fill.map(|f| f.base()).unwrap_or(std::ptr::null_mut())),
    );
    let o = HeadsOut::of(out)?;
    scores_fit("attention", 1, tq, tk)?;
    let (dims, _) = rows::scale_mask_softmax_dims(1, 1, tq, tk);
    (0..b * h).into_par_iter().for_each_init(
        || vec![0f32; tq * tk],
        |s, bh| {
            let (bi, hi) = (bh / h, bh % h);
            let (sp, fp, o) = (sp, fp, &o);
            let qm = head(q, bi, hi, 2, 3);
            let kt = head(k, bi, hi, 3, 2);
            // SAFETY: each task writes its own scratch and its own head of `out`.
            unsafe {
                kiln_matmul::gemm_one(
                    (tq, dk, tk),
                    s.as_mut_ptr(),
                    tk as isize,
                    qm,
                    kt,
                    false,
                    Parallelism::None,
                );
                let sptr = s.as_mut_ptr() as *mut u8;
                let ptrs: Vec<*mut u8> = if mask == MaskKind::None {
                    vec![sptr, sp.0, sptr]
                } else {
                    vec![sptr, mask_at(m.as_ref(), mask, bi, tk), sp.0, fp.0, sptr]
                };
                softmax(ptrs.as_ptr(), dims.as_ptr(), 0, tq as i64);
                let pm = Mat {
                    ptr: s.as_ptr(),
                    rs: tk as isize,
                    cs: 1,
                };
                let vm = head(v, bi, hi, 2, 3);
                kiln_matmul::gemm_one(
                    (tq, tk, dv),
                    o.at(bi, hi),
                    o.rs,
                    pm,
                    vm,
                    false,
                    Parallelism::None,
                );
            }
        },
    );
    let _ = dk;
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
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let (m, g, scale, fill) = if mask == MaskKind::None {
        (None, ins[3], ins[4], None)
    } else {
        (Some(contig(ins[3], keep)?), ins[4], ins[5], Some(ins[6]))
    };
    let qs = q.shape();
    let (b, h, tq, dk) = (qs[0], qs[1], qs[2], qs[3]);
    let tk = k.shape()[2];
    let dv = v.shape()[3];
    let (sp, fp) = (
        P(scale.base()),
        P(fill.map(|f| f.base()).unwrap_or(std::ptr::null_mut())),
    );
    let (dq, dkk, dvv) = (
        HeadsOut::of(&outs[0])?,
        HeadsOut::of(&outs[1])?,
        HeadsOut::of(&outs[2])?,
    );
    scores_fit("attention_bwd", 2, tq, tk)?;
    let (dims, _) = rows::scale_mask_softmax_dims(1, 1, tq, tk);
    let (bdims, _) = rows::softmax_bwd_dims(tq, tk);
    let mloc = m.as_ref();
    (0..b * h).into_par_iter().for_each_init(
        || (vec![0f32; tq * tk], vec![0f32; tq * tk]),
        |(s, dp), bh| {
            let (bi, hi) = (bh / h, bh % h);
            let (sp, fp, dq, dkk, dvv) = (sp, fp, &dq, &dkk, &dvv);
            let mp = mask_at(mloc, mask, bi, tk);
            // SAFETY: each task writes its own scratch and its own heads of the results.
            unsafe {
                kiln_matmul::gemm_one(
                    (tq, dk, tk),
                    s.as_mut_ptr(),
                    tk as isize,
                    head(q, bi, hi, 2, 3),
                    head(k, bi, hi, 3, 2),
                    false,
                    Parallelism::None,
                );
                let sptr = s.as_mut_ptr() as *mut u8;
                let ptrs: Vec<*mut u8> = if mask == MaskKind::None {
                    vec![sptr, sp.0, sptr]
                } else {
                    vec![sptr, mp, sp.0, fp.0, sptr]
                };
                softmax(ptrs.as_ptr(), dims.as_ptr(), 0, tq as i64);
                let pm = Mat {
                    ptr: s.as_ptr(),
                    rs: tk as isize,
                    cs: 1,
                };
                let pt = Mat {
                    ptr: s.as_ptr(),
                    rs: 1,
                    cs: tk as isize,
                };
                let gm = head(g, bi, hi, 2, 3);
                // dv = pᵀ·g
                kiln_matmul::gemm_one(
                    (tk, tq, dv),
                    dvv.at(bi, hi),
                    dvv.rs,
                    pt,
                    gm,
                    false,
                    Parallelism::None,
                );
                // dp = g·vᵀ
                kiln_matmul::gemm_one(
                    (tq, dv, tk),
                    dp.as_mut_ptr(),
                    tk as isize,
                    gm,
                    head(v, bi, hi, 3, 2),
                    false,
                    Parallelism::None,
                );
                let dpp = dp.as_mut_ptr() as *mut u8;
                let bp = [sptr, dpp, sp.0, dpp];
                softmax_bwd(bp.as_ptr(), bdims.as_ptr(), 0, tq as i64);
                let _ = pm;
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
                let ds = Mat {
                    ptr: dp.as_ptr(),
                    rs: tk as isize,
                    cs: 1,
                };
                let dst = Mat {
                    ptr: dp.as_ptr(),
                    rs: 1,
                    cs: tk as isize,
                };
                kiln_matmul::gemm_one(
                    (tq, tk, dk),
                    dq.at(bi, hi),
                    dq.rs,
                    ds,
                    head(k, bi, hi, 2, 3),
                    false,
                    Parallelism::None,
                );
                kiln_matmul::gemm_one(
                    (tk, tq, dk),
                    dkk.at(bi, hi),
                    dkk.rs,
                    dst,
                    head(q, bi, hi, 2, 3),
                    false,
                    Parallelism::None,
                );
            }
        },
    );
    Ok(())
}
