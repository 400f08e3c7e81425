use super::*;
use crate::ir::DType;
use crate::shape::Shape;

fn buffer(value: usize, slot: usize, born: usize, dies: usize, elem_bytes: usize) -> Buffer {
    sized(value, slot, born, dies, elem_bytes, 100)
}

/// `f32[batch, cols]` at `elem_bytes` per element.
fn sized(
    value: usize,
    slot: usize,
    born: usize,
    dies: usize,
    elem_bytes: usize,
    cols: i64,
) -> Buffer {
    Buffer {
        value,
        output: 0,
        ty: TensorType::new(DType::F32, Shape(vec![Dim::sym("batch"), Dim::c(cols)])),
        slot,
        born,
        dies,
        elem_bytes,
        in_place_of: None,
    }
}

fn dims() -> BTreeMap<String, i64> {
    [("batch".to_string(), 10)].into_iter().collect()
}

#[test]
fn check_names_two_buffers_of_one_slot_live_at_once() {
    let mut plan = MemoryPlan {
        buffers: vec![buffer(1, 0, 0, 2, 4), buffer(2, 0, 2, 3, 4)],
        slots: 1,
        steps: 4,
        reuse: true,
    };
    let e = plan.check(&dims()).unwrap_err();
    assert_eq!(
        e,
        "slot 0: %1.0 (k0..k2) and %2.0 (k2..k3) are live at once"
    );
    plan.buffers[1].born = 3;
    plan.check(&dims()).unwrap();
    plan.buffers[1].slot = 1;
    let e = plan.check(&dims()).unwrap_err();
    assert_eq!(
        e,
        "buffer %2.0: slot 1 of 1, lifetime k3..k3 of 4 steps; the plan is damaged \
         (recompile the artifact)"
    );
    // A buffer living past the last step: an error from every use, not a panic.
    plan.buffers[1].slot = 0;
    plan.buffers[1].dies = 9;
    let e = plan.live_peak(&dims()).unwrap_err();
    assert!(e.contains("lifetime k3..k9 of 4 steps"), "{e}");
    assert_eq!(plan.layout(&dims()).unwrap_err(), e);
}

#[test]
fn sizes_that_overflow_64_bits_are_errors_not_wrapped_numbers() {
    // Two buffers of 2^61 f32 each (2^63 bytes): each fits, the two together do not.
    let huge = |value, slot| sized(value, slot, 0, 1, 4, 1 << 31);
    let plan = MemoryPlan {
        buffers: vec![huge(1, 0), huge(2, 1)],
        slots: 2,
        steps: 2,
        reuse: true,
    };
    let at: BTreeMap<String, i64> = [("batch".to_string(), 1i64 << 30)].into_iter().collect();
    assert_eq!(plan.buffers[0].bytes(&at).unwrap(), 1usize << 63);
    assert_eq!(
        plan.layout(&at).unwrap_err(),
        "the arena has more bytes than 64 bits count"
    );
    assert_eq!(
        plan.live_peak(&at).unwrap_err(),
        "the live buffers have more bytes than 64 bits count"
    );
    let at: BTreeMap<String, i64> = [("batch".to_string(), 1i64 << 31)].into_iter().collect();
    assert_eq!(
        plan.buffers[0].bytes(&at).unwrap_err(),
        "a buffer of shape [2147483648, 2147483648] has more bytes than 64 bits count"
    );
}

#[test]
fn two_byte_buffers_take_half_the_bytes() {
    let plan = MemoryPlan {
        buffers: vec![buffer(1, 0, 0, 1, 2), buffer(2, 1, 0, 1, 4)],
        slots: 2,
        steps: 2,
        reuse: true,
    };
    let l = plan.layout(&dims()).unwrap();
    // 1,000 elements: 2,000 bytes aligned up to 2,048, and 4,000 to 4,032; packed
    // the larger first.
    assert_eq!(l.slot_bytes, vec![2048, 4032]);
    assert_eq!((l.offsets.clone(), l.total), (vec![4032, 0], 6080));
    assert_eq!(plan.live_peak(&dims()).unwrap(), 6000);
    // 4-byte buffers serialize as before (artifacts are unchanged); others name it.
    let text = serde_json::to_string(&plan).unwrap();
    assert_eq!(text.matches("elem_bytes").count(), 1, "{text}");
    let back: MemoryPlan = serde_json::from_str(&text).unwrap();
    assert_eq!(back, plan);
}

/// Two slots, each a large buffer then a small one in turn: end to end they take two
/// large sizes, packed one large and one small — the live peak.
#[test]
fn packing_reuses_what_slots_sized_by_their_largest_buffer_hold() {
    let plan = MemoryPlan {
        buffers: vec![
            sized(1, 0, 0, 1, 4, 1000),
            sized(2, 1, 0, 1, 4, 16),
            sized(3, 0, 2, 3, 4, 16),
            sized(4, 1, 2, 3, 4, 1000),
        ],
        slots: 2,
        steps: 4,
        reuse: true,
    };
    let l = plan.layout(&dims()).unwrap();
    assert_eq!((l.slots_total, l.total, l.packed), (80_000, 40_640, true));
    assert_eq!(l.offsets, vec![0, 40_000, 40_000, 0]);
    assert_eq!(plan.live_peak(&dims()).unwrap(), 40_640);
    plan.check(&dims()).unwrap();
    // The check sees a layout that puts two live buffers on shared bytes.
    let mut bad = l.clone();
    bad.offsets[1] = 39_936;
    let e = plan.check_layout(&dims(), &bad).unwrap_err();
    assert_eq!(
        e,
        "%1.0 (k0..k1, bytes 0..40000) and %2.0 (k0..k1, bytes 39936..40576) are live \
         at once in shared bytes"
    );
    bad.offsets[1] = 40_064;
    let e = plan.check_layout(&dims(), &bad).unwrap_err();
    assert_eq!(e, "buffer %2.0 at bytes 40064..40704 of an arena of 40640");
}

/// Buffers kept outside the arena take none of it: the rest pack as if they were
/// not there, and the check passes over them.
#[test]
fn external_buffers_take_no_arena_bytes() {
    let plan = MemoryPlan {
        buffers: vec![
            sized(1, 0, 0, 1, 4, 1000),
            sized(2, 1, 0, 3, 4, 16),
            sized(3, 0, 2, 3, 4, 500),
        ],
        slots: 2,
        steps: 4,
        reuse: true,
    };
    assert_eq!(plan.layout(&dims()).unwrap().total, 40_640);
    let l = plan.layout_with(&dims(), &[true, false, false]).unwrap();
    // Without the 40,000-byte buffer: 20,032 and 640 bytes, live at once.
    assert_eq!((l.total, l.unshared), (20_672, 20_672));
    assert_eq!(l.external, vec![true, false, false]);
    assert_eq!((l.offsets[2], l.offsets[1]), (0, 20_032));
    plan.check_layout(&dims(), &l).unwrap();
    // A short flag list flags only what it covers.
    assert_eq!(
        plan.layout_with(&dims(), &[]).unwrap(),
        plan.layout(&dims()).unwrap()
    );
    let all = plan.layout_with(&dims(), &[true, true, true]).unwrap();
    assert_eq!(all.total, 0);
    plan.check_layout(&dims(), &all).unwrap();
}

/// Random plans (lifetimes, sizes, slots from a greedy first fit): every layout is
/// sound, never larger than the slots, and at least the live peak.
#[test]
fn random_plans_pack_soundly() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for _ in 0..200 {
        let steps = 1 + next(40) as usize;
        let n = 1 + next(60) as usize;
        let mut buffers = Vec::new();
        let mut free_after: Vec<usize> = Vec::new();
        for v in 0..n {
            let born = next(steps as u64) as usize;
            let dies = born + next((steps - born) as u64 + 1) as usize;
            let slot = match free_after.iter().position(|&d| d < born) {
                Some(s) => s,
                None => {
                    free_after.push(0);
                    free_after.len() - 1
                }
            };
            free_after[slot] = dies;
            let elem = if next(2) == 0 { 2 } else { 4 };
            buffers.push(sized(v, slot, born, dies, elem, 1 + next(500) as i64));
        }
        // Slots were chosen in value order, not birth order: keep only what a slot
        // holds soundly by moving clashing buffers to slots of their own.
        let plan = MemoryPlan {
            slots: free_after.len(),
            buffers,
            steps: steps + 1,
            reuse: true,
        };
        let plan = if plan.check(&dims()).is_err() {
            let slots = plan.buffers.len();
            MemoryPlan {
                buffers: plan
                    .buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| Buffer {
                        slot: i,
                        ..b.clone()
                    })
                    .collect(),
                slots,
                steps: plan.steps,
                reuse: true,
            }
        } else {
            plan
        };
        plan.check(&dims()).unwrap();
        let l = plan.layout(&dims()).unwrap();
        assert!(l.total <= l.slots_total);
        assert!(l.total >= plan.live_peak(&dims()).unwrap());
    }
}

/// A buffer written in place of its kernel's operand shares the operand's bytes: one
/// offset, no bytes of its own in the arena or the live peak; a plan that says so of an
/// operand living on past the step is damaged.
#[test]
fn a_buffer_written_in_place_shares_its_operands_bytes() {
    // %1 k0..k1; %2 written by k1 over %1, read until k3; %3 k1..k3 beside them.
    let mut over = buffer(2, 0, 1, 3, 4);
    over.in_place_of = Some(0);
    let mut plan = MemoryPlan {
        buffers: vec![buffer(1, 0, 0, 1, 4), over, buffer(3, 1, 1, 3, 4)],
        slots: 2,
        steps: 4,
        reuse: true,
    };
    plan.check(&dims()).unwrap();
    let l = plan.layout(&dims()).unwrap();
    assert_eq!(l.offsets[0], l.offsets[1]);
    assert_ne!(l.offsets[0], l.offsets[2]);
    assert_eq!(l.total, 2 * 4032);
    assert_eq!(plan.live_peak(&dims()).unwrap(), 8000);
    assert_eq!(plan.home(1), 0);
    // Without it, three buffers are live at k1.
    let mut apart = plan.clone();
    apart.buffers[1].in_place_of = None;
    apart.buffers[1].slot = 2;
    apart.slots = 3;
    assert_eq!(apart.live_peak(&dims()).unwrap(), 12000);
    assert_eq!(apart.layout(&dims()).unwrap().total, 3 * 4032);
    // Kept outside the arena, the operand cannot lend its bytes: each has its own.
    let l = plan.layout_with(&dims(), &[true]).unwrap();
    assert_ne!(l.offsets[1], l.offsets[2]);
    assert_eq!(l.total, 2 * 4032);
    plan.check_layout(&dims(), &l).unwrap();
    // A buffer in the slot while the one written in place still lives: a clash.
    let mut clash = plan.clone();
    clash.buffers.push(buffer(4, 0, 2, 3, 4));
    let e = clash.check(&dims()).unwrap_err();
    assert!(e.contains("%2.0 (k1..k3) and %4.0 (k2..k3)"), "{e}");
    // The operand read again at k2: not a kernel's last read.
    plan.buffers[0].dies = 2;
    let e = plan.layout(&dims()).unwrap_err();
    assert!(e.contains("%2.0 is planned in place of buffer 0"), "{e}");
}

#[test]
fn a_chain_written_in_place_is_kept_outside_the_arena_whole() {
    // %1 k0..k1, %2 over it k1..k2, %3 over that k2..k3 (a graph output); %4 beside.
    let mut b2 = buffer(2, 0, 1, 2, 4);
    b2.in_place_of = Some(0);
    let mut b3 = buffer(3, 0, 2, 3, 4);
    b3.in_place_of = Some(1);
    let plan = MemoryPlan {
        buffers: vec![buffer(1, 0, 0, 1, 4), b2, b3, buffer(4, 1, 0, 3, 4)],
        slots: 2,
        steps: 3,
        reuse: true,
    };
    plan.check(&dims()).unwrap();
    assert_eq!(plan.chain(2), [0, 1, 2]);
    assert_eq!(plan.chain(0), [0]);
    assert_eq!(plan.home(2), 0);
    // In the arena the chain takes one buffer's bytes; outside, none.
    assert_eq!(plan.layout(&dims()).unwrap().total, 2 * 4032);
    let l = plan
        .layout_with(&dims(), &[true, true, true, false])
        .unwrap();
    assert_eq!(l.total, 4032);
    plan.check_layout(&dims(), &l).unwrap();
    assert_eq!(plan.live_peak(&dims()).unwrap(), 8000);
}

#[test]
fn the_cache_makes_each_layout_once() {
    let plan = MemoryPlan {
        buffers: vec![buffer(1, 0, 0, 1, 4), buffer(2, 1, 0, 1, 4)],
        slots: 2,
        steps: 2,
        reuse: true,
    };
    let cache = LayoutCache::default();
    let a = cache.get(&plan, &dims()).unwrap();
    let b = cache.get(&plan, &dims()).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    let other: BTreeMap<String, i64> = [("batch".to_string(), 3)].into_iter().collect();
    let c = cache.get(&plan, &other).unwrap();
    assert_eq!((a.total, c.total), (8064, 2432));
    assert_eq!(*a, plan.layout(&dims()).unwrap());
    let e = cache.get(&plan, &BTreeMap::new()).unwrap_err().to_string();
    assert!(e.contains("the memory plan") && e.contains("batch"), "{e}");
}
