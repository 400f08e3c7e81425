//! The region kernel itself: steps computed once per call, once per row or per element,
//! rows stepped through the output's leading multi-index.

use super::*;

/// When a step can be computed: once per call (0), once per row (1), per element (2).
pub(super) fn levels(expr: &Expr, inner: &[bool]) -> Vec<u8> {
    let mut lv: Vec<u8> = Vec::with_capacity(expr.insts.len());
    for inst in &expr.insts {
        let l = match *inst {
            Inst::In(i) => {
                if inner[i] {
                    2
                } else {
                    1
                }
            }
            Inst::Const(..) => 0,
            Inst::Dropout(..) => 2,
            Inst::Un(_, a) | Inst::Cast(_, a) => lv[a],
            Inst::Bin(_, a, b) | Inst::Cmp(_, a, b) => lv[a].max(lv[b]),
            Inst::Where(c, a, b) => lv[c].max(lv[a]).max(lv[b]),
        };
        lv.push(l);
    }
    lv
}

pub(super) fn build_region(
    name: &str,
    expr: &Expr,
    inner: &[bool],
    types: &[DType],
    in_types: &[DType],
) -> Result<Function, String> {
    if inner.len() != expr.inputs {
        return Err(format!(
            "region `{name}`: {} inner flags for {} inputs",
            inner.len(),
            expr.inputs
        ));
    }
    let rank = expr.out.shape.rank();
    if rank > 5 {
        return Err(format!(
            "region `{name}`: rank {rank} outputs are not supported"
        ));
    }
    let lead = rank.saturating_sub(1);
    let n_in = expr.inputs;
    let n = expr.insts.len();
    let out_d = types[n - 1];
    let lv = levels(expr, inner);
    let need_vec = vector_needs(expr, &lv);
    let used = used_inputs(expr);
    let dropout = has_dropout(expr);

    Ok(build_kernel(name, |kb| {
        let in_ptr: Vec<Value> = (0..n_in).map(|i| kb.ptr(i)).collect();
        let out_ptr = kb.ptr(n_in);
        let cols = kb.dim(0);
        let sizes: Vec<Value> = (0..lead).map(|k| kb.dim(1 + k)).collect();
        let strides: Vec<Vec<Value>> = (0..n_in)
            .map(|i| {
                if used[i] {
                    (0..lead).map(|k| kb.dim(1 + lead + i * lead + k)).collect()
                } else {
                    vec![]
                }
            })
            .collect();
        let (gens, draw) = if dropout {
            dropout_steps(kb, expr, 1 + lead + n_in * lead)
        } else {
            (vec![None; n], None)
        };
        // Level 0: constants, once per call.
        let mut scal: Vec<Option<Value>> = vec![None; n];
        let mut vecs: Vec<Option<Value>> = vec![None; n];
        let eval_level = |kb: &mut Kb,
                          level: u8,
                          scal: &mut Vec<Option<Value>>,
                          vecs: &mut Vec<Option<Value>>,
                          rowptr: &[Option<Value>]| {
            let zero = kb.iconst(0);
            for (k, inst) in expr.insts.iter().enumerate() {
                if lv[k] != level {
                    continue;
                }
                let v = match *inst {
                    Inst::In(i) => {
                        let p = rowptr[i].expect("a read input has a row pointer");
                        load_value(kb, in_types[i], false, p, zero)
                    }
                    Inst::Const(c, d) => constant(kb, d, c.get()),
                    _ => {
                        let ops: Vec<Value> = scal.iter().map(|o| o.unwrap_or(zero)).collect();
                        lower(kb, inst, types, &ops)
                    }
                };
                scal[k] = Some(v);
                if need_vec[k] {
                    vecs[k] = Some(splat(kb, types[k], v));
                }
            }
        };
        eval_level(kb, 0, &mut scal, &mut vecs, &[]);

        let js = unravel(kb, kb.begin, &sizes);
        let (begin, end) = (kb.begin, kb.end);
        kb.for_range(begin, end, 1, &js, |kb, row, js| {
            let rowptr = row_pointers(kb, js, (&in_ptr, &strides, &used));
            let first = kb.b.ins().imul(row, cols);
            let out_row = kb.elem_addr(out_ptr, first);
            // Level 1: once per row.
            let mut scal = scal.clone();
            let mut vecs = vecs.clone();
            eval_level(kb, 1, &mut scal, &mut vecs, &rowptr);

            let zero = kb.iconst(0);
            // The row's elements `[lo, hi)` (where dropout draws its masks first: a chunk).
            let elems = |kb: &mut Kb, lo: Value, hi: Value| {
                kb.map_elems_unrolled(lo, hi, |kb, c, ty, _| {
                    let vector = ty.is_vector();
                    let mut v: Vec<Value> = Vec::with_capacity(n);
                    let mut loaded: Vec<Option<Value>> = vec![None; n_in];
                    for (k, inst) in expr.insts.iter().enumerate() {
                        if lv[k] < 2 {
                            let x = if vector { vecs[k] } else { scal[k] };
                            // Lower-level values no element step reads are never used.
                            v.push(x.unwrap_or(zero));
                            continue;
                        }
                        let x = match *inst {
                            Inst::In(i) => match loaded[i] {
                                Some(x) => x,
                                None => {
                                    let p = rowptr[i].expect("a read input has a row pointer");
                                    let x = load_value(kb, in_types[i], vector, p, c);
                                    loaded[i] = Some(x);
                                    x
                                }
                            },
                            Inst::Dropout(_, _, a) => {
                                let (g, scale) = gens[k].expect("a mask buffer per dropout");
                                let keep = chunk_keep(kb, g.slot, (c, lo), vector);
                                apply_dropout(kb, keep, v[a], scale)
                            }
                            _ => lower(kb, inst, types, &v),
                        };
                        v.push(x);
                    }
                    store_value(kb, out_d, v[n - 1], out_row, c);
                });
            };
            match draw {
                None => elems(kb, zero, cols),
                Some(func) => {
                    let drops: Vec<DropoutMasks> = gens.iter().flatten().map(|g| g.0).collect();
                    in_mask_chunks(kb, func, &drops, (first, cols), elems);
                }
            }

            step_index(kb, js, &sizes)
        });
    }))
}

/// Which values below the element level the per-element code reads (as vectors), and
/// the output where it is below that level.
fn vector_needs(expr: &Expr, lv: &[u8]) -> Vec<bool> {
    let n = expr.insts.len();
    let mut need_vec = vec![false; n];
    for (k, inst) in expr.insts.iter().enumerate() {
        if lv[k] < 2 {
            continue;
        }
        let ops: Vec<usize> = match *inst {
            Inst::Un(_, a) | Inst::Cast(_, a) | Inst::Dropout(_, _, a) => vec![a],
            Inst::Bin(_, a, b) | Inst::Cmp(_, a, b) => vec![a, b],
            Inst::Where(c, a, b) => vec![c, a, b],
            _ => vec![],
        };
        for o in ops {
            if lv[o] < 2 {
                need_vec[o] = true;
            }
        }
    }
    if lv[n - 1] < 2 {
        need_vec[n - 1] = true;
    }
    need_vec
}

/// Which inputs the program reads.
fn used_inputs(expr: &Expr) -> Vec<bool> {
    let mut used = vec![false; expr.inputs];
    for inst in &expr.insts {
        if let Inst::In(i) = *inst {
            used[i] = true;
        }
    }
    used
}

/// Per dropout step, a stack buffer for the keep masks of `MASK_CHUNK` elements of a
/// row, filled by `kiln_dropout_masks` (see `masks`) before the elements' loop over
/// them, and its scale; and the imported `kiln_dropout_masks`. The seed and the step are
/// dims `base` and `base + 1`.
#[allow(clippy::type_complexity)]
fn dropout_steps(
    kb: &mut Kb,
    expr: &Expr,
    base: usize,
) -> (Vec<Option<(DropoutMasks, f32)>>, Option<FuncRef>) {
    let mut gens: Vec<Option<(DropoutMasks, f32)>> = vec![None; expr.insts.len()];
    let seed = kb.dim(base);
    let step = kb.dim(base + 1);
    let step = kb.b.ins().ireduce(types::I32, step);
    let draw = Some(import_masks(kb));
    for (k, inst) in expr.insts.iter().enumerate() {
        if let Inst::Dropout(p, stream, _) = *inst {
            let p = p.get();
            let stream = kb.b.ins().iconst(types::I32, i64::from(stream));
            let t = rng::dropout_threshold(p);
            let threshold = kb.b.ins().iconst(types::I32, i64::from(t));
            let masks = DropoutMasks {
                args: [seed, step, stream, threshold],
                slot: mask_slot(kb),
            };
            gens[k] = Some((masks, (1.0 / (1.0 - p)) as f32));
        }
    }
    (gens, draw)
}

/// Row `begin` as the leading multi-index over `sizes` (the outermost index unbounded).
fn unravel(kb: &mut Kb, begin: Value, sizes: &[Value]) -> Vec<Value> {
    let lead = sizes.len();
    let mut js: Vec<Value> = vec![begin; lead];
    if lead > 0 {
        let mut rest = begin;
        for k in (1..lead).rev() {
            let one = kb.iconst(1);
            let z = kb.b.ins().icmp_imm_u(IntCC::Equal, sizes[k], 0);
            let nk = kb.b.ins().select(z, one, sizes[k]);
            js[k] = kb.b.ins().urem(rest, nk);
            rest = kb.b.ins().udiv(rest, nk);
        }
        js[0] = rest;
    }
    js
}

/// The next row's multi-index (the outermost index never wraps).
fn step_index(kb: &mut Kb, js: &[Value], sizes: &[Value]) -> Vec<Value> {
    let lead = sizes.len();
    let mut next = js.to_vec();
    if lead > 0 {
        let mut carry = kb.iconst(1);
        for k in (1..lead).rev() {
            let j = kb.b.ins().iadd(js[k], carry);
            let wrap = kb.b.ins().icmp(IntCC::Equal, j, sizes[k]);
            let z = kb.iconst(0);
            next[k] = kb.b.ins().select(wrap, z, j);
            carry = kb.b.ins().uextend(types::I64, wrap);
        }
        next[0] = kb.b.ins().iadd(js[0], carry);
    }
    next
}

/// Each read input's pointer at the row of multi-index `js`: its base plus the row's
/// offset through its strides over the leading dims.
fn row_pointers(
    kb: &mut Kb,
    js: &[Value],
    (in_ptr, strides, used): (&[Value], &[Vec<Value>], &[bool]),
) -> Vec<Option<Value>> {
    let mut rowptr: Vec<Option<Value>> = vec![None; in_ptr.len()];
    for i in 0..in_ptr.len() {
        if !used[i] {
            continue;
        }
        let mut off: Option<Value> = None;
        for (k, &j) in js.iter().enumerate() {
            let t = kb.b.ins().imul(j, strides[i][k]);
            off = Some(match off {
                Some(o) => kb.b.ins().iadd(o, t),
                None => t,
            });
        }
        rowptr[i] = Some(match off {
            Some(o) => kb.elem_addr(in_ptr[i], o),
            None => in_ptr[i],
        });
    }
    rowptr
}
