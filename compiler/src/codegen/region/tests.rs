use super::*;
use crate::codegen::clif::text;
use crate::codegen::jit::{compile, launch};
use crate::ir::Float;

/// Two dropout steps in one region, over rows longer than a chunk of masks
/// (`MASK_CHUNK`), of a length that is no multiple of 4 (so rows start inside a
/// counter block, and each chunk ends in vector and scalar tails): every element as
/// `rng::dropout_keep` decides, with the kept ones scaled.
#[test]
fn dropout_masks_every_chunk_of_long_rows_as_the_generator_decides() {
    let (rows, cols) = (3usize, 2 * masks::MASK_CHUNK as usize + 455);
    let expr = Expr {
        out: crate::TensorType {
            dtype: DType::F32,
            shape: crate::Shape::consts(&[rows as i64, cols as i64]),
        },
        inputs: 1,
        insts: vec![
            Inst::In(0),
            Inst::Dropout(Float::new(0.3), 11, 0),
            Inst::Dropout(Float::new(0.2), 12, 1),
        ],
    };
    let f = region("drop2", &expr, &[true]).expect("region builds");
    let m = compile(&text(&f)).expect("region compiles");
    let n = rows * cols;
    let x: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
    let mut y = vec![f32::NAN; n];
    let (seed, step) = (0x5eed_0000_0000_0042u64, 9u32);
    let strides: Vec<isize> = vec![cols as isize, 1];
    let (dims, items) = region_dims(&expr, &[rows, cols], &[strides], seed, step);
    let k = m.get("drop2").expect("the kernel");
    // SAFETY: the buffers hold the shapes `dims` describe.
    unsafe {
        launch(
            k,
            &[x.as_ptr() as *mut u8, y.as_mut_ptr() as *mut u8],
            &dims,
            items,
            1,
        )
    };
    let (t1, t2) = (rng::dropout_threshold(0.3), rng::dropout_threshold(0.2));
    let (s1, s2) = ((1.0 / (1.0 - 0.3)) as f32, (1.0 / (1.0 - 0.2)) as f32);
    let mut dropped = 0;
    for (i, (&x, &y)) in x.iter().zip(&y).enumerate() {
        let i64_ = i as u64;
        let a = if rng::dropout_keep(seed, step, 11, i64_, t1) {
            x * s1
        } else {
            0.0
        };
        let want = if rng::dropout_keep(seed, step, 12, i64_, t2) {
            a * s2
        } else {
            0.0
        };
        dropped += usize::from(want == 0.0);
        assert_eq!(
            y.to_bits(),
            want.to_bits(),
            "element {i} (row {})",
            i / cols
        );
    }
    // About 1 − 0.7 · 0.8 = 44 % dropped.
    assert!(
        (n * 40 / 100..n * 48 / 100).contains(&dropped),
        "{dropped} of {n}"
    );
}

/// `embed_pe` with dropout over rows longer than a chunk of masks, of a length that
/// is no multiple of 4: each element `table[id]·scale + pe`, kept as
/// `rng::dropout_keep` decides for its flat index and scaled.
#[test]
fn embed_pe_drops_out_every_chunk_of_long_rows_as_the_generator_decides() {
    let (b, t, d, vocab) = (2usize, 3usize, 2 * masks::MASK_CHUNK as usize + 455, 5usize);
    let f = embed_pe("emb", true);
    let m = compile(&text(&f)).expect("embed_pe compiles");
    let table: Vec<f32> = (0..vocab * d)
        .map(|i| (i % 11) as f32 * 0.5 - 2.0)
        .collect();
    let ids: Vec<i32> = vec![3, 0, 4, 1, 1, 2];
    let pe: Vec<f32> = (0..t * d).map(|i| (i % 5) as f32 * 0.125).collect();
    let scale = [1.5f32];
    let mut out = vec![f32::NAN; b * t * d];
    let (p, stream, seed, step) = (0.25, 17u32, 99u64, 4u32);
    let (dims, items) = embed_pe_dims([b, t, d], Some((p, stream)), (seed, step));
    let k = m.get("emb").expect("the kernel");
    // SAFETY: the buffers hold the shapes `dims` describe.
    unsafe {
        launch(
            k,
            &[
                table.as_ptr() as *mut u8,
                ids.as_ptr() as *mut u8,
                pe.as_ptr() as *mut u8,
                scale.as_ptr() as *mut u8,
                out.as_mut_ptr() as *mut u8,
            ],
            &dims,
            items,
            1,
        )
    };
    let threshold = rng::dropout_threshold(p);
    let keep_scale = (1.0 / (1.0 - p)) as f32;
    let mut dropped = 0;
    for r in 0..b * t {
        for c in 0..d {
            let i = r * d + c;
            let y = table[ids[r] as usize * d + c] * scale[0] + pe[(r % t) * d + c];
            let want = if rng::dropout_keep(seed, step, stream, i as u64, threshold) {
                y * keep_scale
            } else {
                dropped += 1;
                0.0
            };
            assert_eq!(out[i].to_bits(), want.to_bits(), "row {r}, column {c}");
        }
    }
    let n = b * t * d;
    assert!(
        (n * 21 / 100..n * 29 / 100).contains(&dropped),
        "{dropped} of {n}"
    );
}
