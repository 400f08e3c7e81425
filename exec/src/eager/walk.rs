//! The elementwise engine: one loop nest for every op that maps input elements to output
//! elements at the same multi-index.
//!
//! In: an output buffer (row-major), its shape, and up to three operand views with any
//! strides (a broadcast axis has stride 0, a permuted one a large stride). Out: the
//! buffer filled by a per-element function.
//!
//! How: axes of size 1 are dropped and neighbouring axes that are contiguous in every
//! operand are merged, so same-shape contiguous data becomes one long row and a
//! broadcast trailing vector becomes `[rows, d]`. The flat output is cut into chunks (in
//! parallel with rayon above a size threshold); inside a chunk, each run along the last
//! merged axis is a *segment*, where every operand is either a contiguous slice, a
//! single repeated value or a strided slice. The inner loops are monomorphized for each
//! combination, so the common ones are plain loops over slices that LLVM vectorizes.
//! Each output element is computed by the same function of the same inputs however the
//! work is split, so results do not depend on the number of threads.

use rayon::prelude::*;

use super::pool::Pool;
use super::value::{Elem, Layout, View};

/// Work below this many elements runs on the calling thread.
pub(crate) const PAR_MIN: usize = 1 << 15;
/// Elements per parallel task.
pub(crate) const CHUNK: usize = 1 << 14;

/// One operand as the walker sees it: strides and offset into its storage.
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a> {
    pub strides: &'a [usize],
    pub offset: usize,
}

impl<'a> Operand<'a> {
    pub(crate) fn of(l: &'a Layout) -> Operand<'a> {
        Operand {
            strides: &l.strides,
            offset: l.offset,
        }
    }
}

/// Drops size-1 axes and merges neighbours that are contiguous in every operand. The
/// result has at least one axis.
fn collapse<const N: usize>(
    shape: &[usize],
    ops: &[Operand<'_>; N],
) -> (Vec<usize>, [Vec<usize>; N]) {
    let mut cshape: Vec<usize> = Vec::with_capacity(shape.len());
    let mut cstr: [Vec<usize>; N] = std::array::from_fn(|_| Vec::with_capacity(shape.len()));
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        if let Some(&last) = cshape.last() {
            // The previous (outer) axis merges with this one when its stride is this
            // axis's stride times this axis's size, in every operand. The output is
            // row-major, so it always qualifies.
            let merge = (0..N).all(|k| {
                let prev = cstr[k][cstr[k].len() - 1];
                prev == ops[k].strides[d] * size
            });
            if merge {
                let i = cshape.len() - 1;
                cshape[i] = last * size;
                for k in 0..N {
                    let j = cstr[k].len() - 1;
                    cstr[k][j] = ops[k].strides[d];
                }
                continue;
            }
        }
        cshape.push(size);
        for k in 0..N {
            cstr[k].push(ops[k].strides[d]);
        }
    }
    if cshape.is_empty() {
        cshape.push(1);
        for s in cstr.iter_mut() {
            s.push(0);
        }
    }
    (cshape, cstr)
}

/// Calls `body(out_segment, flat_start, offsets, strides)` for every segment of `out`
/// (row-major over `shape`): `offsets[k]` is operand `k`'s storage index of the segment's
/// first element and `strides[k]` its step along the segment.
pub(crate) fn walk<O: Send, const N: usize>(
    out: &mut [O],
    shape: &[usize],
    ops: [Operand<'_>; N],
    body: impl Fn(&mut [O], usize, [usize; N], [usize; N]) + Sync,
) {
    let numel = out.len();
    if numel == 0 {
        return;
    }
    let (cshape, cstr) = collapse(shape, &ops);
    let r = cshape.len();
    let inner = cshape[r - 1];
    let last: [usize; N] = std::array::from_fn(|k| cstr[k][r - 1]);
    let process = |lo: usize, chunk: &mut [O]| {
        let end = lo + chunk.len();
        let mut row = lo / inner;
        let mut col = lo % inner;
        // The multi-index of `row` over the outer axes, and each operand's row start.
        let mut idx = vec![0usize; r - 1];
        for d in (0..r - 1).rev() {
            idx[d] = row % cshape[d];
            row /= cshape[d];
        }
        let mut base: [usize; N] = std::array::from_fn(|k| {
            ops[k].offset + (0..r - 1).map(|d| idx[d] * cstr[k][d]).sum::<usize>()
        });
        let mut pos = lo;
        loop {
            let len = (inner - col).min(end - pos);
            let offs: [usize; N] = std::array::from_fn(|k| base[k] + col * last[k]);
            body(&mut chunk[pos - lo..pos - lo + len], pos, offs, last);
            pos += len;
            if pos == end {
                break;
            }
            col = 0;
            for d in (0..r - 1).rev() {
                idx[d] += 1;
                for k in 0..N {
                    base[k] += cstr[k][d];
                }
                if idx[d] < cshape[d] {
                    break;
                }
                for k in 0..N {
                    base[k] -= cstr[k][d] * cshape[d];
                }
                idx[d] = 0;
            }
        }
    };
    if numel >= PAR_MIN {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| process(c * CHUNK, chunk));
    } else {
        process(0, out);
    }
}

/// What one operand contributes to a segment.
#[derive(Clone, Copy)]
pub(crate) enum Seg<'s, E> {
    /// Consecutive elements, exactly as many as the segment.
    Contig(&'s [E]),
    /// One value for the whole segment (a broadcast axis).
    Splat(E),
    /// Every `stride`-th element from the start of the slice.
    Strided(&'s [E], usize),
}

/// Operand `data`'s segment of `len` elements from `offset` with step `stride`.
#[inline]
pub(crate) fn seg<E: Copy>(data: &[E], offset: usize, stride: usize, len: usize) -> Seg<'_, E> {
    match stride {
        0 => Seg::Splat(data[offset]),
        1 => Seg::Contig(&data[offset..offset + len]),
        s => Seg::Strided(&data[offset..offset + (len - 1) * s + 1], s),
    }
}

/// Reading element `i` of a segment; one implementation per [`Seg`] variant so inner
/// loops are specialized.
pub(crate) trait Read<E>: Copy {
    fn at(self, i: usize) -> E;
}

#[derive(Clone, Copy)]
pub(crate) struct Contig<'s, E>(pub &'s [E]);
#[derive(Clone, Copy)]
pub(crate) struct Splat<E>(pub E);
#[derive(Clone, Copy)]
pub(crate) struct Strided<'s, E>(pub &'s [E], pub usize);

impl<E: Copy> Read<E> for Contig<'_, E> {
    #[inline(always)]
    fn at(self, i: usize) -> E {
        self.0[i]
    }
}
impl<E: Copy> Read<E> for Splat<E> {
    #[inline(always)]
    fn at(self, _: usize) -> E {
        self.0
    }
}
impl<E: Copy> Read<E> for Strided<'_, E> {
    #[inline(always)]
    fn at(self, i: usize) -> E {
        self.0[i * self.1]
    }
}

/// Binds `$r` to the specialized reader of segment `$seg` and evaluates `$body`.
macro_rules! with_read {
    ($seg:expr, $r:ident => $body:expr) => {
        match $seg {
            Seg::Contig(s) => {
                let $r = Contig(s);
                $body
            }
            Seg::Splat(v) => {
                let $r = Splat(v);
                $body
            }
            Seg::Strided(s, k) => {
                let $r = Strided(s, k);
                $body
            }
        }
    };
}

#[inline(always)]
fn fill1<A: Copy, O>(o: &mut [O], a: impl Read<A>, f: &impl Fn(A) -> O) {
    for (i, o) in o.iter_mut().enumerate() {
        *o = f(a.at(i));
    }
}

#[inline(always)]
fn fill2<A: Copy, B: Copy, O>(
    o: &mut [O],
    a: impl Read<A>,
    b: impl Read<B>,
    f: &impl Fn(A, B) -> O,
) {
    for (i, o) in o.iter_mut().enumerate() {
        *o = f(a.at(i), b.at(i));
    }
}

#[inline(always)]
fn fill3<A: Copy, B: Copy, C: Copy, O>(
    o: &mut [O],
    a: impl Read<A>,
    b: impl Read<B>,
    c: impl Read<C>,
    f: &impl Fn(A, B, C) -> O,
) {
    for (i, o) in o.iter_mut().enumerate() {
        *o = f(a.at(i), b.at(i), c.at(i));
    }
}

#[inline(always)]
fn update2<A: Copy, B: Copy>(o: &mut [A], b: impl Read<B>, f: &impl Fn(A, B) -> A) {
    for (i, o) in o.iter_mut().enumerate() {
        *o = f(*o, b.at(i));
    }
}

/// `f` of every element of `x`, row-major.
pub(crate) fn map1<A: Elem, O: Elem>(
    pool: Option<&Pool>,
    x: View<'_, A>,
    f: impl Fn(A) -> O + Sync,
) -> Vec<O> {
    let mut out = O::alloc(pool, x.layout.numel());
    if let Some(xs) = x.contiguous() {
        let body = |o: &mut [O], lo: usize| fill1(o, Contig(&xs[lo..lo + o.len()]), &f);
        chunked(&mut out, body);
        return out;
    }
    walk(
        &mut out,
        x.shape(),
        [Operand::of(x.layout)],
        |o, _, off, st| with_read!(seg(x.data, off[0], st[0], o.len()), a => fill1(o, a, &f)),
    );
    out
}

/// `f` of corresponding elements of `x` and `y` (same shape), row-major.
pub(crate) fn map2<A: Elem, B: Elem, O: Elem>(
    pool: Option<&Pool>,
    x: View<'_, A>,
    y: View<'_, B>,
    f: impl Fn(A, B) -> O + Sync,
) -> Vec<O> {
    let mut out = O::alloc(pool, x.layout.numel());
    if let (Some(xs), Some(ys)) = (x.contiguous(), y.contiguous()) {
        let body = |o: &mut [O], lo: usize| {
            let n = o.len();
            fill2(o, Contig(&xs[lo..lo + n]), Contig(&ys[lo..lo + n]), &f)
        };
        chunked(&mut out, body);
        return out;
    }
    walk(
        &mut out,
        x.shape(),
        [Operand::of(x.layout), Operand::of(y.layout)],
        |o, _, off, st| {
            let n = o.len();
            with_read!(seg(x.data, off[0], st[0], n), a =>
                with_read!(seg(y.data, off[1], st[1], n), b => fill2(o, a, b, &f)))
        },
    );
    out
}

/// `f` of corresponding elements of three same-shape views, row-major.
pub(crate) fn map3<A: Elem, B: Elem, C: Elem, O: Elem>(
    pool: Option<&Pool>,
    x: View<'_, A>,
    y: View<'_, B>,
    z: View<'_, C>,
    f: impl Fn(A, B, C) -> O + Sync,
) -> Vec<O> {
    let mut out = O::alloc(pool, x.layout.numel());
    walk(
        &mut out,
        x.shape(),
        [
            Operand::of(x.layout),
            Operand::of(y.layout),
            Operand::of(z.layout),
        ],
        |o, _, off, st| {
            let n = o.len();
            with_read!(seg(x.data, off[0], st[0], n), a =>
                with_read!(seg(y.data, off[1], st[1], n), b =>
                    with_read!(seg(z.data, off[2], st[2], n), c => fill3(o, a, b, c, &f))))
        },
    );
    out
}

/// `buf[i] = f(buf[i])` for a row-major buffer.
pub(crate) fn update1<A: Elem>(buf: &mut [A], f: impl Fn(A) -> A + Sync) {
    chunked(buf, |o: &mut [A], _| {
        for v in o.iter_mut() {
            *v = f(*v);
        }
    });
}

/// `buf[i] = f(buf[i], y[i])` for a row-major buffer of `y`'s shape.
pub(crate) fn update_with<A: Elem, B: Elem>(
    buf: &mut [A],
    y: View<'_, B>,
    f: impl Fn(A, B) -> A + Sync,
) {
    if let Some(ys) = y.contiguous() {
        chunked(buf, |o: &mut [A], lo| {
            let n = o.len();
            update2(o, Contig(&ys[lo..lo + n]), &f)
        });
        return;
    }
    walk(
        buf,
        y.shape(),
        [Operand::of(y.layout)],
        |o, _, off, st| with_read!(seg(y.data, off[0], st[0], o.len()), b => update2(o, b, &f)),
    );
}

/// The elements of `x` in row-major order, copied (a borrowed slice when they already
/// are is the caller's business). Transposed views (the last two merged axes swapped in
/// memory) are copied in bands of output rows, reading the source in short contiguous
/// runs instead of one element per cache line.
pub(crate) fn to_vec<E: Elem>(pool: Option<&Pool>, x: View<'_, E>) -> Vec<E> {
    let numel = x.layout.numel();
    let (cshape, [cstr]) = collapse(x.shape(), &[Operand::of(x.layout)]);
    let r = cshape.len();
    let transposed = r >= 2 && cstr[r - 2] == 1 && cstr[r - 1] > 1;
    if !transposed || numel < 4 * TILE * TILE {
        return map1(pool, x, |a| a);
    }
    let (rows, cols) = (cshape[r - 2], cshape[r - 1]);
    let col_stride = cstr[r - 1];
    let mut out = E::alloc(pool, numel);
    // One task per band of TILE output rows of one matrix.
    let bands = rows.div_ceil(TILE);
    let band = |(t, dst): (usize, &mut [E])| {
        let (m, b) = (t / bands, t % bands);
        // Storage offset of matrix `m` (an odometer over the leading merged axes).
        let mut base = x.layout.offset;
        let mut rest = m;
        for d in (0..r - 2).rev() {
            base += (rest % cshape[d]) * cstr[d];
            rest /= cshape[d];
        }
        let i0 = b * TILE;
        let h = dst.len() / cols;
        // Column j of the band is `h` consecutive source elements; the band itself
        // (`h` output rows) stays in cache while its columns are filled.
        for j in 0..cols {
            let src = &x.data[base + i0 + j * col_stride..][..h];
            for (i, &v) in src.iter().enumerate() {
                dst[i * cols + j] = v;
            }
        }
    };
    // Bands of TILE output rows, never straddling two matrices.
    let matrices = numel / (rows * cols);
    let mut tasks: Vec<(usize, &mut [E])> = Vec::with_capacity(matrices * bands);
    let mut rest: &mut [E] = &mut out;
    for m in 0..matrices {
        for b in 0..bands {
            let h = TILE.min(rows - b * TILE);
            let (head, tail) = rest.split_at_mut(h * cols);
            tasks.push((m * bands + b, head));
            rest = tail;
        }
    }
    if numel >= PAR_MIN {
        tasks.into_par_iter().for_each(band);
    } else {
        tasks.into_iter().for_each(band);
    }
    out
}

/// Output rows per band of a transposing copy.
const TILE: usize = 32;

/// Calls `body(chunk, flat_start)` over `out` in chunks, in parallel when large.
pub(crate) fn chunked<O: Send>(out: &mut [O], body: impl Fn(&mut [O], usize) + Sync) {
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| body(chunk, c * CHUNK));
    } else {
        body(out, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapse_merges_contiguous_axes() {
        let out = [4usize, 4, 1];
        // A [3, 4, 5] row-major operand and a trailing vector of 5 broadcast.
        let (shape, st) = collapse(
            &[3, 4, 5],
            &[
                Operand {
                    strides: &[20, 5, 1],
                    offset: 0,
                },
                Operand {
                    strides: &[0, 0, 1],
                    offset: 0,
                },
            ],
        );
        assert_eq!(shape, vec![12, 5]);
        assert_eq!(st[0], vec![5, 1]);
        assert_eq!(st[1], vec![0, 1]);
        let (shape, st) = collapse(
            &[3, 1, 4],
            &[Operand {
                strides: &out,
                offset: 0,
            }],
        );
        assert_eq!(shape, vec![12]);
        assert_eq!(st[0], vec![1]);
    }

    #[test]
    fn walk_visits_a_transposed_view_in_row_major_order() {
        // x = [[0, 1, 2], [3, 4, 5]] seen transposed as a [3, 2] view.
        let data: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let l = Layout {
            shape: vec![3, 2],
            strides: vec![1, 3],
            offset: 0,
        };
        let v = View {
            data: &data,
            layout: &l,
        };
        assert_eq!(to_vec(None, v), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    }
}
