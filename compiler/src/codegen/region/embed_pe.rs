//! The `embed_pe` kernel.

use super::*;

/// The `embed_pe` kernel: `out[r, :] = table[ids[r], :] · scale + pe[r mod t, :]` for rows
/// `r` of the flattened `[b·t]` positions, then (if `dropout`) inverted dropout keyed by
/// the flat output index `r·d + c`.
///
/// - `args`: `[table f32 [vocab, d], ids i32 [b, t], pe f32 [t, d], scale f32 (a pointer
///   to one element), out f32 [b, t, d]]`.
/// - `dims` ([`embed_pe_dims`]): `[d, t]`, and with dropout `[d, t, seed (u64 bits),
///   step, stream, threshold (dropout_threshold(p)), keep scale (the f32 bits of
///   (1/(1−p)) computed in f64)]`.
/// - Items: rows, `b·t`. Ids must be in `0..vocab` (the caller checks them).
pub fn embed_pe(name: &str, dropout: bool) -> Function {
    build_kernel(name, |kb| {
        let table = kb.ptr(0);
        let ids = kb.ptr(1);
        let pe = kb.ptr(2);
        let scale_p = kb.ptr(3);
        let out = kb.ptr(4);
        let d = kb.dim(0);
        let t = kb.dim(1);
        let zero = kb.iconst(0);
        let scale = kb.load(types::F32, scale_p, zero);
        let scale_v = kb.b.ins().splat(VF, scale);
        // With dropout: the masks' function, its arguments but the index and count, a
        // stack buffer for a chunk's masks, and the kept elements' scale.
        let gen = if dropout {
            let seed = kb.dim(2);
            let dims: Vec<Value> = (3..7)
                .map(|i| {
                    let v = kb.dim(i);
                    kb.b.ins().ireduce(types::I32, v)
                })
                .collect();
            let func = import_masks(kb);
            let drop = DropoutMasks {
                args: [seed, dims[0], dims[1], dims[2]],
                slot: mask_slot(kb),
            };
            let ks = kb.b.ins().bitcast(types::F32, lanes(), dims[3]);
            let ks_v = kb.b.ins().splat(VF, ks);
            Some((func, drop, ks, ks_v))
        } else {
            None
        };
        // Position of `begin` within its sequence.
        let one = kb.iconst(1);
        let tz = kb.b.ins().icmp_imm_u(IntCC::Equal, t, 0);
        let tn = kb.b.ins().select(tz, one, t);
        let pos = kb.b.ins().urem(kb.begin, tn);
        let (begin, end) = (kb.begin, kb.end);
        kb.for_range(begin, end, 1, &[pos], |kb, row, p| {
            let pos = p[0];
            let id = kb.load(types::I32, ids, row);
            let id = kb.b.ins().sextend(types::I64, id);
            let src = kb.b.ins().imul(id, d);
            let src = kb.elem_addr(table, src);
            let pr = kb.b.ins().imul(pos, d);
            let pr = kb.elem_addr(pe, pr);
            let first = kb.b.ins().imul(row, d);
            let dst = kb.elem_addr(out, first);
            let zero = kb.iconst(0);
            // Elements `[lo, hi)` of the row (with dropout, a chunk whose masks are drawn).
            let elems = |kb: &mut Kb, lo: Value, hi: Value| {
                kb.map_elems(lo, hi, |kb, c, ty| {
                    let vector = ty.is_vector();
                    let x = kb.load(ty, src, c);
                    let s = if vector { scale_v } else { scale };
                    let x = kb.b.ins().fmul(x, s);
                    let q = kb.load(ty, pr, c);
                    let mut y = kb.b.ins().fadd(x, q);
                    if let Some((_, drop, ks, ks_v)) = &gen {
                        let keep = chunk_keep(kb, drop.slot, (c, lo), vector);
                        let k = if vector { *ks_v } else { *ks };
                        let kept = kb.b.ins().fmul(y, k);
                        let z = kb.fconst(ty, 0.0);
                        y = kb.select(keep, kept, z);
                    }
                    kb.store(y, dst, c);
                });
            };
            match &gen {
                None => elems(kb, zero, d),
                Some((func, drop, _, _)) => in_mask_chunks(kb, *func, &[*drop], (first, d), elems),
            }
            let p1 = kb.b.ins().iadd_imm_s(pos, 1);
            let wrap = kb.b.ins().icmp(IntCC::Equal, p1, t);
            let z = kb.iconst(0);
            vec![kb.b.ins().select(wrap, z, p1)]
        });
    })
}

/// The `dims` of [`embed_pe`] and its items (`b·t` rows) for the output `[b, t, d]` (the
/// batch, sequence length and embedding width); `dropout` is `(p, stream)` when the kernel
/// was built with dropout (`seed` and `step` are then the run's).
pub fn embed_pe_dims(
    [b, t, d]: [usize; 3],
    dropout: Option<(f64, u32)>,
    (seed, step): (u64, u32),
) -> (Vec<i64>, usize) {
    let mut dims = vec![d as i64, t as i64];
    if let Some((p, stream)) = dropout {
        dims.push(seed as i64);
        dims.push(i64::from(step));
        dims.push(i64::from(stream));
        dims.push(i64::from(rng::dropout_threshold(p)));
        dims.push(i64::from(((1.0 / (1.0 - p)) as f32).to_bits()));
    }
    let items = if d == 0 { 0 } else { b * t };
    (dims, items)
}
