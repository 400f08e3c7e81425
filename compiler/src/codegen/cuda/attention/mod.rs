//! Flash-style attention as CUDA C: tiled, online softmax, the `[tq, tk]` score matrix
//! never in global memory (DESIGN §5).
//!
//! In: the mask kind, the head sizes `dk` and `dv` (constants of the kernel graph), the
//! element type. Out: three [`CudaFunction`]s per (mask, dk, dv):
//!
//! - [`forward`] — `out = softmax(where(mask, q·kᵀ·scale, fill))·v`. One block per tile of
//!   `T` query rows of one head; key/value tiles of `T` rows stream through shared
//!   memory; each row keeps its running maximum `m`, sum `l` and unnormalized output
//!   (rescaled by `exp(m_old − m_new)` when the maximum grows), divided by `l` at the end.
//! - [`backward_q`] — recomputes the forward for its query tile (so `m`, `l` and `o`),
//!   then `D = Σ_c g·o / l` per row, writes `(m, l, D)` to the `stats` scratch
//!   (`f32[b·h·tq, 3]`) and streams the keys again for `dq = Σ_j ds_ij·k_j` with
//!   `p = exp(s − m)/l`, `dp = g·vᵀ`, `ds = p·(dp − D)·scale` (0 where masked).
//! - [`backward_kv`] — one block per tile of `T` keys: streams the query tiles (with their
//!   `stats`) for `dv = Σ_i p_ij·g_i` and `dk = Σ_i ds_ij·q_i`.
//! - [`backward_short`] — the two above in one kernel when every query and key row of a
//!   head fits one tile ([`fits_short`]; the Transformer's sentences mostly do): one block
//!   per head holds `q`, `k`, `v`, `g`, the probabilities and the score gradients in
//!   shared memory and computes `s`, `dp = g·vᵀ`, the softmax, `D = Σ_j p·dp` (the CPU
//!   `softmax_bwd`'s), `ds`, then `dq`, `dk`, `dv` — five products of the head's size
//!   instead of nine across the pair (which recompute the forward twice), one launch and
//!   no statistics scratch.
//!
//! The products over the shared tiles in the forward and in [`backward_short`] run with
//! 2×2 register tiles (each thread four outputs, four loads from shared memory for four
//! multiply-adds); each output's sum is still one thread's, in key order. Every output
//! element is summed by one thread in a fixed order: no atomics, the same bits on every
//! run. The formulas are the CPU attention's (`s = q·kᵀ`, the masked scaled
//! softmax, `softmax_bwd`, the zeroed masked gradient); only the rounding of the online
//! softmax differs from the CPU's two-pass one.
//!
//! # ABI
//!
//! The general one of [`super`] (`Work::Blocks`, any block size: every loop strides by
//! `blockDim.x`). Buffers, with `[mask]` and `[fill]` present unless the mask kind is
//! `None` (the CPU attention's operand order, then the results):
//!
//! - forward: `q, k, v, [mask], scale, [fill], out`;
//! - backward_q: `q, k, v, [mask], g, scale, [fill], dq, stats`;
//! - backward_kv: `q, k, v, [mask], g, scale, [fill], stats, dk, dv`;
//! - backward_short: `q, k, v, [mask], g, scale, [fill], dq, dk, dv`.
//!
//! `q [b, h, tq, dk]`, `k [b, h, tk, dk]`, `v [b, h, tk, dv]` and `g [b, h, tq, dv]` are
//! read through their strides (views of the projections need no copy), and `out`, `dq`,
//! `dk`, `dv` written through theirs (stored with the heads merged, `[b, t, h, d]`, the
//! output projection reads them as rows without a copy). The mask is `int` 0/1, `[b, tk]`
//! (key padding) or `[tq, tk]` (causal). dims ([`dims`]): `[b, h, tq, tk]`, then the four
//! element strides of `q`, `k`, `v`, then forward `out`'s, backward `g`'s, `dq`'s, `dk`'s
//! and `dv`'s. Items: tiles, `b·h·⌈tq/T⌉` (forward, backward_q) or
//! `b·h·⌈tk/T⌉` (backward_kv), `b·h` (backward_short), with `T` from [`tile`].

mod backward;
mod forward;
mod shared;
mod tiles;

pub use backward::{backward_kv, backward_q, backward_short};
pub use forward::forward;
pub(super) use shared::{arrays, bytes, word_pitch, Cores};
pub(super) use tiles::{
    at, begin, close_query_sweep, function, lines, masked_out, online_softmax, open_query_sweep,
    open_tiles, score_store, softmax_and_d, stats_then_dq, store_rows, Index2, Store,
};

use crate::codegen::cuda::text::Elem;
use crate::codegen::cuda::{param, Param};
use crate::codegen::rows::MaskKind;

/// The largest head size the flash kernels take (larger heads use the batched-GEMM path).
pub const MAX_HEAD: usize = 128;

/// Static shared memory a kernel may use (the limit without opting in to more).
pub const SHARED_BYTES: usize = 48 * 1024;

/// The three flash kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Forward,
    BackwardQ,
    BackwardKv,
    /// The whole backward of one head in one block ([`backward_short`]), when `tq` and
    /// `tk` both fit one tile.
    Short,
}

/// Shared memory of `part` with tiles of `t` rows, in bytes.
pub fn shared_bytes(part: Part, t: usize, dk: usize, dv: usize) -> usize {
    shared::bytes(t, &shared::arrays(Cores::Cuda, part, t, (dk, dv)))
}

/// Rows per tile of `part` for heads `dk`, `dv`: the largest of 32, 16, 8 whose shared
/// memory fits [`SHARED_BYTES`]; `None` past [`MAX_HEAD`].
pub fn tile(part: Part, dk: usize, dv: usize) -> Option<usize> {
    if dk == 0 || dv == 0 || dk > MAX_HEAD || dv > MAX_HEAD {
        return None;
    }
    [32, 16, 8]
        .into_iter()
        .find(|&t| shared_bytes(part, t, dk, dv) <= SHARED_BYTES)
}

/// dims of every flash kernel: `[b, h, tq, tk]` and the `[b, h, t, d]` element strides of
/// each operand and result in `strides` (`q, k, v, out` forward; `q, k, v, g, dq, dk, dv`
/// backward).
pub fn dims(b: usize, h: usize, tq: usize, tk: usize, strides: &[[usize; 4]]) -> Vec<i64> {
    let mut d = vec![b as i64, h as i64, tq as i64, tk as i64];
    for s in strides {
        d.extend(s.iter().map(|&x| x as i64));
    }
    d
}

/// Work items of `part` (tiles): `b·h·⌈tq/T⌉`, for `BackwardKv` `b·h·⌈tk/T⌉`, for
/// `Short` the heads `b·h`.
pub fn items(part: Part, t: usize, b: usize, h: usize, tq: usize, tk: usize) -> usize {
    match part {
        Part::Short => b * h,
        Part::BackwardKv => b * h * tk.div_ceil(t),
        _ => b * h * tq.div_ceil(t),
    }
}

/// Whether [`backward_short`] takes `tq` query and `tk` key rows with heads `dk`, `dv`:
/// both fit its tile.
pub fn fits_short(tq: usize, tk: usize, dk: usize, dv: usize) -> bool {
    tile(Part::Short, dk, dv).is_some_and(|t| tq <= t && tk <= t)
}

/// The buffer parameters of `part`.
pub(super) fn params(part: Part, mask: MaskKind, e: Elem) -> Vec<Param> {
    let masked = mask != MaskKind::None;
    let mut p = vec![
        param("q", &e.ptr(true)),
        param("k", &e.ptr(true)),
        param("v", &e.ptr(true)),
    ];
    if masked {
        p.push(param("mask", "const int*"));
    }
    if part != Part::Forward {
        p.push(param("g", &e.ptr(true)));
    }
    p.push(param("scale", "const float*"));
    if masked {
        p.push(param("fill", "const float*"));
    }
    match part {
        Part::Forward => p.push(param("out", &e.ptr(false))),
        Part::BackwardQ => {
            p.push(param("dq", &e.ptr(false)));
            p.push(param("stats", "float*"));
        }
        Part::Short => {
            p.push(param("dq", &e.ptr(false)));
            p.push(param("dk", &e.ptr(false)));
            p.push(param("dv", &e.ptr(false)));
        }
        Part::BackwardKv => {
            p.push(param("stats", "const float*"));
            p.push(param("dk", &e.ptr(false)));
            p.push(param("dv", &e.ptr(false)));
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_shared_memory() {
        for part in [
            Part::Forward,
            Part::BackwardQ,
            Part::BackwardKv,
            Part::Short,
        ] {
            for d in [1, 8, 64, 100, 128] {
                let t = tile(part, d, d).expect("a tile");
                assert!(shared_bytes(part, t, d, d) <= SHARED_BYTES);
            }
            assert_eq!(tile(part, 129, 64), None);
            assert_eq!(tile(part, 64, 0), None);
        }
        // The base and big Transformers' heads (64) get 32-row tiles forward and on the
        // query side.
        assert_eq!(tile(Part::Forward, 64, 64), Some(32));
        assert_eq!(tile(Part::BackwardQ, 64, 64), Some(32));
        assert_eq!(tile(Part::BackwardKv, 64, 64), Some(16));
        assert_eq!(items(Part::Forward, 32, 2, 8, 25, 40), 16);
        assert_eq!(items(Part::BackwardKv, 16, 2, 8, 25, 40), 48);
        assert_eq!(items(Part::Short, 32, 2, 8, 25, 25), 16);
        // The base Transformer's heads fit 32 rows in one block's shared memory.
        assert_eq!(tile(Part::Short, 64, 64), Some(32));
        assert!(fits_short(25, 32, 64, 64));
        assert!(!fits_short(33, 25, 64, 64));
        assert!(fits_short(16, 16, 128, 128) && !fits_short(17, 16, 128, 128));
    }
}
