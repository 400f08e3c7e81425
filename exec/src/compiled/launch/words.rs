//! Copies of a value's elements: gathered from or written to a strided location as
//! 32-bit words, or made contiguous by the generated copy kernel.

use kiln_compiler::codegen::jit::KernelFn;
use kiln_compiler::codegen::misc::{self};

use super::Loc;
use super::*;

/// The elements of a location in row-major order, as 4-byte words.
pub(crate) fn gather_words(loc: &Loc) -> Vec<u32> {
    let n = loc.numel();
    let mut out = Vec::with_capacity(n);
    let p = loc.ptr as *const u32;
    if loc.is_contiguous() {
        // SAFETY: a contiguous layout covers `offset .. offset + n`.
        unsafe { out.extend_from_slice(std::slice::from_raw_parts(p.add(loc.layout.offset), n)) };
        return out;
    }
    let shape = &loc.layout.shape;
    let strides = &loc.layout.strides;
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let off = loc.layout.offset + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
        // SAFETY: every multi-index of the layout is inside the location's buffer.
        out.push(unsafe { *p.add(off) });
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Writes row-major words into a contiguous location.
pub(crate) fn write_words(loc: &Loc, words: &[u32]) {
    debug_assert!(loc.is_contiguous() && words.len() == loc.numel());
    // SAFETY: the location is a contiguous buffer of `numel` elements.
    unsafe {
        std::ptr::copy_nonoverlapping(
            words.as_ptr(),
            loc.base() as *mut u32,
            words.len().min(loc.numel()),
        )
    };
}

/// Copies a strided location into a contiguous buffer at `dst` with the generated copy
/// kernel (rank ≤ 5; a plain loop otherwise).
pub(crate) fn copy_with(copy: KernelFn, src: &Loc, dst: *mut u8) {
    if src.layout.shape.len() > misc::MAX_COPY_RANK {
        return copy_to_contiguous(src, dst);
    }
    let strides: Vec<i64> = src.layout.strides.iter().map(|&s| s as i64).collect();
    let (dims, items) = misc::copy_strided_dims(src.shape(), &strides);
    let row = src.shape().last().copied().unwrap_or(1);
    call(copy, &[src.base(), dst], &dims, items, grain(row));
}

/// Copies a strided location into a fresh contiguous buffer at `dst`.
pub(crate) fn copy_to_contiguous(src: &Loc, dst: *mut u8) {
    let w = gather_words(src);
    // SAFETY: the caller allocated `numel` elements at `dst`.
    unsafe { std::ptr::copy_nonoverlapping(w.as_ptr(), dst as *mut u32, w.len()) };
}
