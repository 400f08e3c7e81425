//! Dropout inside a region kernel: a stack buffer of keep masks per dropout step, filled
//! by `kiln_dropout_masks` chunk by chunk of a row, and the masks applied.

use super::*;

/// A dropout step of a kernel: `kiln_dropout_masks`'s arguments but the index and the
/// count (`seed i64, step, stream, threshold i32`), and the stack buffer its masks go to
/// (see [`mask_slot`]).
#[derive(Clone, Copy)]
pub(super) struct DropoutMasks {
    pub(super) args: [Value; 4],
    pub(super) slot: StackSlot,
}

/// A stack buffer for the keep masks of [`masks::MASK_CHUNK`] elements.
pub(super) fn mask_slot(kb: &mut Kb) -> StackSlot {
    kb.b.create_sized_stack_slot(StackSlotData::new(
        StackSlotKind::ExplicitSlot,
        (4 * masks::MASK_CHUNK) as u32,
        4,
    ))
}

/// Runs `elems(lo, hi)` over the chunks `[lo, hi)` of a row's elements `[0, len)`
/// ([`masks::MASK_CHUNK`] each, the last shorter), each after `func` (the kernel's
/// import of `kiln_dropout_masks`) has drawn the chunk's masks of every step of `drops`;
/// `first` is the row's first flat index.
pub(super) fn in_mask_chunks(
    kb: &mut Kb,
    func: FuncRef,
    drops: &[DropoutMasks],
    (first, len): (Value, Value),
    mut elems: impl FnMut(&mut Kb, Value, Value),
) {
    let zero = kb.iconst(0);
    let span = kb.b.ins().iadd_imm_s(len, masks::MASK_CHUNK - 1);
    kb.for_range(zero, span, masks::MASK_CHUNK, &[], |kb, lo, _| {
        let next = kb.b.ins().iadd_imm_s(lo, masks::MASK_CHUNK);
        let hi = kb.b.ins().umin(next, len);
        let count = kb.b.ins().isub(hi, lo);
        let index = kb.b.ins().iadd(first, lo);
        for d in drops {
            let out = kb.b.ins().stack_addr(types::I64, d.slot, 0);
            let [seed, step, stream, threshold] = d.args;
            kb.b.ins()
                .call(func, &[seed, step, stream, threshold, index, count, out]);
        }
        elems(kb, lo, hi);
        vec![]
    });
}

/// The keep mask of element `c` of the chunk from `lo` whose masks `slot` holds: a lane
/// mask of four elements for a vector step, an `i8` condition for a scalar one.
pub(super) fn chunk_keep(
    kb: &mut Kb,
    slot: StackSlot,
    (c, lo): (Value, Value),
    vector: bool,
) -> Value {
    let at = kb.b.ins().isub(c, lo);
    let base = kb.b.ins().stack_addr(types::I64, slot, 0);
    if vector {
        kb.load(VI, base, at)
    } else {
        let m = kb.load(types::I32, base, at);
        kb.b.ins().icmp_imm_u(IntCC::NotEqual, m, 0)
    }
}

/// Declares `kiln_dropout_masks` (see [`masks`]) in the kernel: `(seed i64, step i32,
/// stream i32, threshold i32, index i64, count i64, out i64)`, the C ABI.
pub(super) fn import_masks(kb: &mut Kb) -> FuncRef {
    let signature = kb.b.import_signature(masks::signature(CallConv::SystemV));
    kb.b.import_function(ExtFuncData {
        name: ExternalName::testcase(masks::SYMBOL),
        signature,
        colocated: false,
        patchable: false,
    })
}

/// `keep ? x·scale : 0` for a keep condition (`i8`) or lane mask.
pub(super) fn apply_dropout(kb: &mut Kb, keep: Value, x: Value, scale: f32) -> Value {
    let ty = kb.ty(x);
    let s = kb.fconst(ty, scale);
    let y = kb.b.ins().fmul(x, s);
    let z = kb.fconst(ty, 0.0);
    kb.select(keep, y, z)
}
