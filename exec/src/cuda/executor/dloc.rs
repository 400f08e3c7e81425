//! Device locations (a pointer, a strided layout, an element type) and the small
//! helpers over them: gathers of words, element sizes, bf16 packing, head layouts.

use kiln_compiler::ir::DType;

use crate::eager::value::Layout;

/// Where a value's elements are on the device: element `i` of the layout at
/// `ptr + 4·i` (4-byte elements: f32, i32, bools as 0/1).
#[derive(Clone, Debug)]
pub(crate) struct DLoc {
    pub ptr: u64,
    pub layout: Layout,
    pub dtype: DType,
}

impl DLoc {
    pub(crate) fn base(&self) -> u64 {
        self.at(self.layout.offset)
    }

    pub(crate) fn at(&self, elem: usize) -> u64 {
        self.ptr + elem_bytes(self.dtype) * elem as u64
    }

    /// Whether the elements are 2-byte bf16 (a mixed-precision program's activations).
    pub(crate) fn is_bf16(&self) -> bool {
        self.dtype == DType::BF16
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    pub(crate) fn numel(&self) -> usize {
        self.layout.numel()
    }

    pub(crate) fn last(&self) -> usize {
        self.shape().last().copied().unwrap_or(1)
    }
}

/// The elements of `layout` (row-major) from `host`, the words of its whole buffer; an
/// element outside the buffer is an internal error.
pub(crate) fn gather_words(host: &[u32], layout: &Layout) -> Result<Vec<u32>, String> {
    let n = layout.numel();
    if n == 0 {
        return Ok(Vec::new());
    }
    // The farthest element read, checked once.
    let far = layout.offset
        + layout
            .shape
            .iter()
            .zip(&layout.strides)
            .map(|(d, s)| (d - 1) * s)
            .sum::<usize>();
    if far >= host.len() {
        return Err(format!(
            "internal: a view reads element {far} of an input of {}",
            host.len()
        ));
    }
    let Some((&inner, outer_shape)) = layout.shape.split_last() else {
        return Ok(vec![host[layout.offset]]);
    };
    let step = layout.strides[outer_shape.len()];
    let mut out = Vec::with_capacity(n);
    // Row by row (the last dim), the rows' starts as an odometer over the others.
    let mut idx = vec![0usize; outer_shape.len()];
    let mut start = layout.offset;
    for _ in 0..n / inner {
        if step == 1 {
            out.extend_from_slice(&host[start..start + inner]);
        } else {
            out.extend((0..inner).map(|i| host[start + i * step]));
        }
        for k in (0..idx.len()).rev() {
            idx[k] += 1;
            start += layout.strides[k];
            if idx[k] < outer_shape[k] {
                break;
            }
            start -= idx[k] * layout.strides[k];
            idx[k] = 0;
        }
    }
    Ok(out)
}

/// Bytes per element of a device buffer of `dtype`: 2 for bf16 (a mixed-precision
/// program's activations), else 4 (f32, i32, bools as 0/1).
pub(crate) fn elem_bytes(dtype: DType) -> u64 {
    if dtype == DType::BF16 {
        2
    } else {
        4
    }
}

/// Words (4 bytes) that hold `n` elements of `dtype`.
pub(crate) fn words_of(dtype: DType, n: usize) -> usize {
    if dtype == DType::BF16 {
        n.div_ceil(2)
    } else {
        n
    }
}

/// f32 values rounded to bf16 (the `half` crate's round to nearest even, as the device's
/// conversion), two to a word, little end first (an odd count pads with zero).
pub(crate) fn pack_bf16(v: impl ExactSizeIterator<Item = f32>) -> Vec<u32> {
    let mut out = Vec::with_capacity(v.len().div_ceil(2));
    let mut half_word: Option<u32> = None;
    for x in v {
        let h = u32::from(half::bf16::from_f32(x).to_bits());
        match half_word.take() {
            None => half_word = Some(h),
            Some(lo) => out.push(lo | (h << 16)),
        }
    }
    out.extend(half_word);
    out
}

/// The first `n` bf16 values of `words` (as [`pack_bf16`] lays them out), widened.
pub(crate) fn unpack_bf16(words: &[u32], n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let w = words[i / 2];
            let h = if i % 2 == 0 { w & 0xffff } else { w >> 16 };
            half::bf16::from_bits(h as u16).to_f32()
        })
        .collect()
}

/// Where a GEMM operand's element `e` is: `base + size·(e − lo)`.
pub(crate) struct Addr {
    pub(crate) base: u64,
    pub(crate) lo: usize,
    pub(crate) size: u64,
}

impl Addr {
    pub(crate) fn at(&self, e: usize) -> u64 {
        self.base + self.size * (e - self.lo) as u64
    }
}

/// A matrix per (batch, head): element offsets of each, and the row and column strides.
pub(crate) struct Heads {
    pub(crate) ptr: u64,
    pub(crate) offsets: Vec<usize>,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// The `[rows, cols]` matrices of every head of a `[b, h, t, d]` location, rows along
/// axis `r` and columns along axis `c` (`r = 3, c = 2` reads them transposed).
pub(crate) fn heads(l: &DLoc, r: usize, c: usize) -> Heads {
    let (s, st) = (&l.layout.shape, &l.layout.strides);
    let mut offsets = Vec::with_capacity(s[0] * s[1]);
    for bi in 0..s[0] {
        for hi in 0..s[1] {
            offsets.push(l.layout.offset + bi * st[0] + hi * st[1]);
        }
    }
    Heads {
        ptr: l.ptr,
        offsets,
        rs: st[r],
        cs: st[c],
    }
}

/// Contiguous `[count, rows, cols]` scratch as per-head matrices (`transposed`: read
/// as `[cols, rows]`).
pub(crate) fn scratch_heads(
    ptr: u64,
    count: usize,
    rows: usize,
    cols: usize,
    transposed: bool,
) -> Heads {
    Heads {
        ptr,
        offsets: (0..count).map(|i| i * rows * cols).collect(),
        rs: if transposed { 1 } else { cols },
        cs: if transposed { cols } else { 1 },
    }
}
