//! How each kernel kind runs on the CPU: its operands made contiguous where its code
//! needs them, its generated function called over its rows, GEMM for the products.

use kiln_compiler::codegen::jit::KernelFn;
use kiln_compiler::codegen::misc::{self, ReduceLayout};
use kiln_compiler::codegen::region;
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_compiler::optimize::regions::Expr;
use kiln_compiler::optimize::templates::{layer_norm_operands, LnForm};

use super::*;
use crate::eager::value::Layout;

pub(super) fn run_exec(
    step: &Step,
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
) -> Result<(), String> {
    let mut contig = |l: &Loc, keep: &mut Keep| contiguous(ctx.copy, l, keep);
    match &step.exec {
        Exec::Matmul => {
            let rows = outs[0].numel() / last(&outs[0]).max(1);
            let packed = ctx.packed_rhs(step, ins, rows);
            gemm::matmul(ins[0], ins[1], &outs[0], false, ctx.bf16, packed.as_deref())
        }
        Exec::Linear { bias, relu } => linear(step, ins, outs, ctx, keep, (bias, relu)),
        Exec::Region { f, expr, inner } => region_kernel(ins, outs, ctx, keep, (f, expr, inner)),
        Exec::Softmax(f) => {
            let x = contig(ins[0], keep)?;
            let c = last(&x);
            let (dims, items) = rows::softmax_dims(x.numel() / c.max(1), c);
            call(*f, &[x.base(), outs[0].base()], &dims, items, grain(c));
            Ok(())
        }
        Exec::ScaleMaskSoftmax(f, mask) => scale_mask_softmax(ins, outs, ctx, keep, (f, mask)),
        Exec::Attention { softmax, mask } => {
            attention(ins, &outs[0], *softmax, *mask, keep, &mut contig)
        }
        Exec::AttentionBwd {
            softmax,
            softmax_bwd,
            mask,
        } => attention_bwd(ins, outs, *softmax, *softmax_bwd, *mask, keep, &mut contig),
        Exec::AddLayerNorm { f, add, rms } => {
            let form = if *add { LnForm::Add } else { LnForm::Plain };
            add_layer_norm(&layer_norm_operands(ins, form, *rms), outs, ctx, keep, f)
        }
        Exec::AddLayerNormBwd { main, finish, form } => {
            let ins = layer_norm_operands(ins, *form, false);
            add_layer_norm_bwd(&ins, outs, ctx, keep, (main, finish))
        }
        Exec::XentLs { f, pad, grad } => xent_ls(ins, outs, ctx, keep, (f, pad, grad)),
        Exec::EmbedPe { f, dropout } => embed_pe(ins, outs, ctx, keep, (f, dropout)),
        Exec::SumRows(f) => {
            let x = contig(ins[0], keep)?;
            let (dims, items) = misc::sum_rows_dims(x.shape());
            let rows_n = x.numel() / last(&x).max(1);
            call(
                *f,
                &[x.base(), outs[0].base()],
                &dims,
                items,
                (grain(rows_n * 16) / 16).max(1),
            );
            Ok(())
        }
        Exec::Adam(f) => {
            let mut ptrs = Vec::with_capacity(14);
            for l in ins.iter().take(4) {
                ptrs.push(contig(l, keep)?.base());
            }
            for l in ins.iter().skip(4) {
                ptrs.push(l.base());
            }
            for o in outs {
                ptrs.push(o.base());
            }
            let (dims, items) = misc::adam_update_dims(outs[0].numel());
            call(*f, &ptrs, &dims, items, 32);
            Ok(())
        }
        Exec::Reduce { f, axis, layout } => reduce(ins, outs, ctx, keep, (f, axis, layout)),
        Exec::Fallback(fb) => fallback::run(fb, ins, outs, ctx),
    }
}

/// The length of a location's last axis (1 for a scalar).
fn last(l: &Loc) -> usize {
    l.shape().last().copied().unwrap_or(1)
}

/// An operand as a contiguous location (copied by the generated copy kernel if not).
fn contiguous(copy: KernelFn, l: &Loc, keep: &mut Keep) -> Result<Loc, String> {
    if l.is_contiguous() {
        return Ok(l.clone());
    }
    if l.layout.shape.len() > misc::MAX_COPY_RANK {
        let p = keep.alloc(l.numel());
        copy_to_contiguous(l, p);
        return Ok(Loc {
            ptr: p,
            layout: Layout::contiguous(l.shape()),
            dtype: l.dtype,
        });
    }
    let p = keep.alloc(l.numel());
    let strides: Vec<i64> = l.layout.strides.iter().map(|&s| s as i64).collect();
    let (dims, items) = misc::copy_strided_dims(l.shape(), &strides);
    call(copy, &[l.base(), p], &dims, items, 64);
    Ok(Loc {
        ptr: p,
        layout: Layout::contiguous(l.shape()),
        dtype: l.dtype,
    })
}

/// `x·w + b` (then ReLU): the bias and ReLU in a 16-bit product's epilogue where it can,
/// else the bias pre-loaded into the result, the product added onto it, the ReLU after.
fn linear(
    step: &Step,
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
    (bias, relu): (&KernelFn, &Option<KernelFn>),
) -> Result<(), String> {
    let contig = |l: &Loc, keep: &mut Keep| contiguous(ctx.copy, l, keep);
    let out = &outs[0];
    let n = last(out);
    let rows = out.numel() / n.max(1);
    let b = contig(ins[2], keep)?;
    if b.numel() != n {
        return Err(format!(
            "a bias of shape {:?} for a result of {n} columns (one value a column)",
            b.shape()
        ));
    }
    let packed = ctx.packed_rhs(step, ins, rows);
    // A 16-bit product adds the bias and applies the ReLU to each block of its
    // result while the block is in cache.
    let epilogue = kiln_matmul::Epilogue {
        bias: Some(b.base() as *const f32),
        relu: relu.is_some(),
    };
    let fused = gemm::matmul_epilogue(
        ins[0],
        ins[1],
        out,
        ctx.bf16,
        packed.as_deref(),
        epilogue,
        None,
    );
    if fused.is_some() {
        return Ok(());
    }
    let (dims, items) = misc::rows_dims(rows, n);
    call(*bias, &[b.base(), out.base()], &dims, items, grain(n));
    gemm::matmul(ins[0], ins[1], out, true, ctx.bf16, packed.as_deref())?;
    if let Some(relu) = relu {
        let (dims, items) = misc::relu_dims(out.numel());
        call(*relu, &[out.base()], &dims, items, 32);
    }
    Ok(())
}

/// A fused elementwise region: each operand read in place with the output's broadcast
/// strides where the kernel can, else made contiguous first.
fn region_kernel(
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
    (f, expr, inner): (&KernelFn, &Expr, &[bool]),
) -> Result<(), String> {
    let contig = |l: &Loc, keep: &mut Keep| contiguous(ctx.copy, l, keep);
    let out = &outs[0];
    let shape = out.shape().to_vec();
    let c = shape.last().copied().unwrap_or(1);
    let (mut ptrs, strides) = region_operands(
        ins,
        &shape,
        inner,
        |l: &Loc| &l.layout,
        |l| contig(l, keep),
        |l, offset| l.ptr.wrapping_add(4 * offset),
    )?;
    ptrs.push(out.base());
    let (dims, items) = region::region_dims(expr, &shape, &strides, ctx.seed, ctx.step);
    call(*f, &ptrs, &dims, items, grain(c));
    Ok(())
}

/// A scaled, masked softmax over attention scores `[b, h, tq, tk]`.
fn scale_mask_softmax(
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
    (f, mask): (&KernelFn, &MaskKind),
) -> Result<(), String> {
    let contig = |l: &Loc| contiguous(ctx.copy, l, keep);
    let masked = usize::from(*mask != MaskKind::None);
    let (ptrs, x) = row_buffers((ins, &outs[..1]), 1 + masked, contig, Loc::base)?;
    let s = x.shape().to_vec();
    let (dims, items) = rows::scale_mask_softmax_dims(s[0], s[1], s[2], s[3]);
    call(*f, &ptrs, &dims, items, grain(s[3]));
    Ok(())
}

/// `normalize(x + y)` over the last axis.
fn add_layer_norm(
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
    f: &KernelFn,
) -> Result<(), String> {
    let contig = |l: &Loc| contiguous(ctx.copy, l, keep);
    let (ptrs, x) = row_buffers((ins, &outs[..1]), 4, contig, Loc::base)?;
    let d = last(&x);
    let (dims, items) = rows::add_layer_norm_dims(x.numel() / d.max(1), d);
    call(*f, &ptrs, &dims, items, grain(d));
    Ok(())
}

/// The backward of `add_layer_norm`: per row block, then the parameters' gradients
/// summed over the blocks.
fn add_layer_norm_bwd(
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
    (main, finish): (&KernelFn, &KernelFn),
) -> Result<(), String> {
    let contig = |l: &Loc| contiguous(ctx.copy, l, keep);
    let (mut ptrs, x) = row_buffers((ins, &outs[..1]), 4, contig, Loc::base)?;
    let d = last(&x);
    let rows_n = x.numel() / d.max(1);
    let scratch = keep.alloc(rows::add_layer_norm_bwd_scratch(rows_n, d));
    ptrs.push(scratch);
    let (dims, items) = rows::add_layer_norm_bwd_dims(rows_n, d);
    let grain_rows = (grain(d) / rows::LN_BWD_BLOCK).max(1);
    call(*main, &ptrs, &dims, items, grain_rows);
    let (dims, items) = rows::add_layer_norm_bwd_finish_dims(rows_n, d);
    // RMSNorm's kernel has no dβ output: its partials are summed into scratch.
    let dbeta = match outs.get(2) {
        Some(o) => o.base(),
        None => keep.alloc(d),
    };
    call(*finish, &[scratch, outs[1].base(), dbeta], &dims, items, 64);
    Ok(())
}

/// Label-smoothed cross-entropy averaged over the non-pad targets (the targets checked
/// against the vocabulary), with the logits' gradient where `grad`.
fn xent_ls(
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
    (f, pad, grad): (&KernelFn, &i64, &bool),
) -> Result<(), String> {
    let contig = |l: &Loc, keep: &mut Keep| contiguous(ctx.copy, l, keep);
    let logits = contig(ins[0], keep)?;
    let target = contig(ins[1], keep)?;
    let v = last(&logits);
    let rows_n = logits.numel() / v.max(1);
    let t = gather_words(&target);
    kiln_compiler::bind::check_targets(&t, v, *pad)?;
    let den = t.iter().filter(|&&w| w as i32 as i64 != *pad).count() as f32;
    // The gradient's weight per non-pad row: `1/den`, times the seed in the
    // `seeded` form (a loss-scaled train_step), as `native::xent_ls`.
    let w = match ins.get(5) {
        Some(seed) => match gather_words(seed).as_slice() {
            [s] => f32::from_bits(*s) * (1.0 / den),
            s => return Err(format!("xent_ls: the seed has {} elements, not 1", s.len())),
        },
        None => 1.0 / den,
    };
    let inv = keep.alloc(1);
    // SAFETY: a fresh one-element buffer.
    unsafe { *(inv as *mut f32) = w };
    let row_loss = keep.alloc(rows_n);
    let (dims, items) = rows::xent_ls_dims(rows_n, v, *pad);
    let scalars = [2, 3, 4].map(|k| ins[k].base());
    let args = rows::xent_ls_buffers(
        (logits.base(), target.base(), scalars),
        row_loss,
        grad.then(|| (inv, outs[1].base())),
    );
    call(*f, &args, &dims, items, grain(v));
    // SAFETY: `row_loss` holds `rows_n` elements the kernel wrote.
    let rl = unsafe { std::slice::from_raw_parts(row_loss as *const f32, rows_n) };
    let mean = rows::xent_ls_finish(rl, den);
    write_words(&outs[0], &[mean.to_bits()]);
    Ok(())
}

/// `gather(table, ids) · scale + positions` (then dropout), the ids checked against the
/// table.
fn embed_pe(
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
    (f, dropout): (&KernelFn, &Option<(f64, u32)>),
) -> Result<(), String> {
    let contig = |l: &Loc, keep: &mut Keep| contiguous(ctx.copy, l, keep);
    let table = contig(ins[0], keep)?;
    let ids = contig(ins[1], keep)?;
    let pe = contig(ins[2], keep)?;
    let vocab = table.shape()[0];
    kiln_compiler::bind::check_embedding_ids(&gather_words(&ids), vocab)?;
    let s = outs[0].shape().to_vec();
    let (b, t, d) = (s[0], s[1], s[2]);
    let (dims, items) = region::embed_pe_dims([b, t, d], *dropout, (ctx.seed, ctx.step));
    call(
        *f,
        &[
            table.base(),
            ids.base(),
            pe.base(),
            ins[3].base(),
            outs[0].base(),
        ],
        &dims,
        items,
        grain(d),
    );
    Ok(())
}

/// A reduction over one axis, along rows (the last axis) or across them.
fn reduce(
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    keep: &mut Keep,
    (f, axis, layout): (&KernelFn, &usize, &ReduceLayout),
) -> Result<(), String> {
    let contig = |l: &Loc, keep: &mut Keep| contiguous(ctx.copy, l, keep);
    let x = contig(ins[0], keep)?;
    let s = x.shape();
    let outer: usize = s[..*axis].iter().product();
    let len = s[*axis];
    let inner: usize = s[axis + 1..].iter().product();
    let (layout, f) = match (layout, inner) {
        (ReduceLayout::Rows, 1) => (ReduceLayout::Rows, *f),
        (ReduceLayout::Across, _) => (ReduceLayout::Across, *f),
        _ => return Err("internal: a row reduction over a non-last axis".into()),
    };
    let (dims, items) = misc::reduce_dims(layout, outer, len, inner);
    call(f, &[x.base(), outs[0].base()], &dims, items, grain(len));
    Ok(())
}
