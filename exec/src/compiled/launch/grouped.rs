//! Products with more than one result: a bias gradient's column sums written by the
//! weight gradient's product, and the product groups of one left operand.

use kiln_compiler::ir::DType;

use super::gemm;
use super::Loc;
use super::*;

/// The column sums of a bias gradient's `dy` (`[lead…, n]`, contiguous) into `dst`, for
/// a product whose right operand `b` is `dy` itself seen as rows (`[Π lead, n]`, the
/// same address); `None` where it is not.
pub(crate) fn bias_sums(dy: &Loc, b: &Loc, dst: *mut f32) -> Option<kiln_matmul::ColumnSums> {
    let (sy, sb) = (dy.shape(), b.shape());
    let axes = sy.len().checked_sub(1)?;
    if !(1..=kiln_matmul::SUM_AXES).contains(&axes)
        || !dy.is_contiguous()
        || !b.is_contiguous()
        || dy.dtype != DType::F32
        || b.dtype != DType::F32
        || dy.base() != b.base()
        || sb != [sy[..axes].iter().product(), sy[axes]]
    {
        return None;
    }
    let mut lead = [1; kiln_matmul::SUM_AXES];
    lead[..axes].copy_from_slice(&sy[..axes]);
    Some(kiln_matmul::ColumnSums { dst, lead, axes })
}

/// `step`'s product (an [`Exec::Matmul`] not checked) with the column sums `sums` of its
/// right operand, as one 16-bit product that sums each column while it packs it
/// ([`gemm::matmul_epilogue`]); `false`, with nothing written, where the product does
/// not run so.
pub(crate) fn product_with_sums(
    step: &Step,
    ins: &[&Loc],
    outs: &[Loc],
    ctx: &RunCtx<'_>,
    sums: kiln_matmul::ColumnSums,
) -> bool {
    if !matches!(step.exec, Exec::Matmul) || step.check.is_some() || ctx.bf16.is_none() {
        return false;
    }
    let out = &outs[0];
    let rows = out.numel() / out.shape().last().copied().unwrap_or(1).max(1);
    let packed = ctx.packed_rhs(step, ins, rows);
    let e = kiln_matmul::Epilogue::default();
    gemm::matmul_epilogue(
        ins[0],
        ins[1],
        out,
        ctx.bf16,
        packed.as_deref(),
        e,
        Some(sums),
    )
    .is_some()
}

/// The products `steps` — all `linear` kernels or all `matmul` kernels, consecutive in
/// launch order, each with its operands `ins` and results `outs` — all of one left
/// operand `x`, as one group of 16-bit products ([`gemm::group_epilogue`]: `x` packed
/// once for all): the attention's query, key and value projections, every decoder
/// layer's keys and values of the encoder's output, or weight gradients `xᵀ·dy` of one
/// input. A `linear`'s bias and ReLU are its product's epilogue; a `matmul` writes the
/// column sums `sums` asks of its right operand (a bias gradient, as
/// [`product_with_sums`]). `false`, with nothing written, where they do not run so (a
/// kernel checked, kernels of two kinds or another left operand, f32 products, a bias not
/// of one contiguous value a column, sums of an operand not read in place, results
/// overlapping operands); the caller then runs each on its own. The same bits as each
/// on its own.
pub(crate) fn product_group(
    steps: &[&Step],
    ins: &[Vec<&Loc>],
    outs: &[&[Loc]],
    sums: &[Option<kiln_matmul::ColumnSums>],
    ctx: &RunCtx<'_>,
) -> bool {
    let Some(&x) = ins.first().and_then(|i| i.first()) else {
        return false;
    };
    let same_x = |i: &Vec<&Loc>| {
        i.first()
            .is_some_and(|y| y.ptr == x.ptr && y.layout == x.layout)
    };
    let lengths = [ins.len(), outs.len(), sums.len()] == [steps.len(); 3];
    if steps.len() < 2 || !lengths || ctx.bf16.is_none() || !ins.iter().all(same_x) {
        return false;
    }
    let linear = matches!(steps[0].exec, Exec::Linear { .. });
    let mut packed = Vec::with_capacity(steps.len());
    for ((step, ins), (outs, sums)) in steps.iter().zip(ins).zip(outs.iter().zip(sums)) {
        let out = &outs[0];
        let n = out.shape().last().copied().unwrap_or(1);
        let epilogue = match &step.exec {
            Exec::Linear { relu, .. } if linear && sums.is_none() => {
                let bias = ins[2];
                if !bias.is_contiguous() || bias.numel() != n {
                    return false;
                }
                kiln_matmul::Epilogue {
                    bias: Some(bias.base() as *const f32),
                    relu: relu.is_some(),
                }
            }
            Exec::Matmul if !linear => kiln_matmul::Epilogue::default(),
            _ => return false,
        };
        if step.check.is_some() {
            return false;
        }
        let rows = out.numel() / n.max(1);
        // A right operand whose columns are summed is packed here (it is `dy`).
        let p = if sums.is_some() {
            None
        } else {
            ctx.packed_rhs(step, ins, rows)
        };
        packed.push((p, epilogue));
    }
    let members: Vec<gemm::GroupMember<'_>> = ins
        .iter()
        .zip(outs)
        .zip(packed.iter().zip(sums))
        .map(|((ins, outs), ((p, e), s))| (ins[1], &outs[0], p.as_deref(), *e, *s))
        .collect();
    gemm::group_epilogue(x, &members, ctx.bf16).is_some()
}
