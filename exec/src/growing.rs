//! A decoder's key/value cache that grows in place: room kept along the axis it grows on
//! (and for more rows), so that a decoding step appends its new positions where today's
//! cache ends instead of copying the whole cache into a new tensor, and a beam's
//! reordering copies only the rows that continue another row.

use kiln_compiler::tensor::{Tensor, TensorData};

/// Copies of at least this many elements run on every thread.
const PAR_MIN: usize = 1 << 16;

/// An f32 tensor of logical shape `shape`, stored with room for `row_cap` rows (axis 0)
/// and `cap` positions along `axis`: row-major in the physical shape (`shape` with those
/// two sizes), so element `[i0, …, ik, …]` is at the physical offset of that index.
#[derive(Clone, Debug)]
pub struct Growing {
    data: Vec<f32>,
    shape: Vec<usize>,
    axis: usize,
    cap: usize,
    row_cap: usize,
    /// The storage before the last reordering that copied every row (kept for the
    /// next such reordering, so that it allocates nothing).
    spare: Vec<f32>,
}

impl Growing {
    /// An empty cache of logical shape `shape` (its length along `axis` 0, say), growing
    /// along `axis` (≥ 1).
    pub fn new(shape: Vec<usize>, axis: usize) -> Result<Growing, String> {
        if axis == 0 || axis >= shape.len() {
            return Err(format!(
                "a cache of shape {shape:?} cannot grow along axis {axis} (it must be an axis after the first)"
            ));
        }
        let (cap, row_cap) = (shape[axis], shape[0]);
        let mut g = Growing {
            data: Vec::new(),
            shape,
            axis,
            cap,
            row_cap,
            spare: Vec::new(),
        };
        g.data = vec![0.0; g.physical_len()];
        Ok(g)
    }

    /// The logical shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The axis the cache grows along.
    pub fn axis(&self) -> usize {
        self.axis
    }

    /// The room along the growing axis.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The strides of the logical shape in the storage (elements).
    pub fn strides(&self) -> Vec<usize> {
        let phys = self.physical_shape();
        let mut s = vec![1; phys.len()];
        for i in (0..phys.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * phys[i + 1];
        }
        s
    }

    /// The storage: [`Growing::strides`] locate the logical elements in it; what lies
    /// past the logical length along the axis (or past the rows) is room.
    pub fn as_mut_ptr(&mut self) -> *mut f32 {
        self.data.as_mut_ptr()
    }

    fn physical_shape(&self) -> Vec<usize> {
        let mut p = self.shape.clone();
        p[0] = self.row_cap;
        p[self.axis] = self.cap;
        p
    }

    fn physical_len(&self) -> usize {
        self.physical_shape().iter().product()
    }

    /// Elements per row in the storage.
    fn row_stride(&self) -> usize {
        self.physical_shape()[1..].iter().product()
    }

    /// (segments per row, elements per position along the axis): a row's logical elements
    /// are `segments` runs of `len · inner` elements, `cap · inner` apart.
    fn segments(&self) -> (usize, usize) {
        let outer = self.shape[1..self.axis].iter().product();
        let inner = self.shape[self.axis + 1..].iter().product();
        (outer, inner)
    }

    /// Room for `len` positions along the axis (the rows and their elements kept);
    /// the room at least doubles when it grows, so appending one position per step copies
    /// each element a bounded number of times.
    pub fn reserve(&mut self, len: usize) {
        if len <= self.cap {
            return;
        }
        let cap = len.max(self.cap * 2).max(16);
        self.relayout(cap);
    }

    /// Sets the logical length along the axis, within the room: the positions up to it
    /// must have been written (a step's run appends them).
    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.cap);
        self.shape[self.axis] = len.min(self.cap);
    }

    /// New storage with room `cap` along the axis, holding the same rows.
    fn relayout(&mut self, cap: usize) {
        let mut next = self.like(self.row_cap, cap);
        next.shape[0] = self.shape[0];
        for r in 0..self.shape[0] {
            copy_row(self, r, &mut next, r);
        }
        *self = next;
    }

    /// The rows `rows` along axis 0, in that order (repeats allowed), as
    /// `decode::take_rows` takes them: a row that continues itself (`rows[r] == r`) is
    /// not copied, nor is anything past the logical length.
    pub fn take_rows(&mut self, rows: &[usize]) -> Result<(), String> {
        if let Some(&bad) = rows.iter().find(|&&p| p >= self.shape[0]) {
            return Err(format!(
                "row {bad} continued, but the cache has {} rows",
                self.shape[0]
            ));
        }
        let moved: Vec<usize> = (0..rows.len()).filter(|&r| rows[r] != r).collect();
        // Where most rows move, copying every row (on every thread) beats moving them
        // one by one.
        if rows.len() > self.row_cap || 2 * moved.len() > rows.len() {
            self.take_rows_anew(rows);
            return Ok(());
        }
        self.move_rows(rows, &moved);
        self.shape[0] = rows.len();
        Ok(())
    }

    /// Row `r` ← row `rows[r]` for each `r` of `moved`, in place: a row is overwritten
    /// once no move left reads it; on a cycle, one row is first saved aside and read from
    /// there.
    fn move_rows(&mut self, rows: &[usize], moved: &[usize]) {
        let n = rows.len().max(self.shape[0]);
        // Per row: the moves left that read it.
        let mut readers = vec![0usize; n];
        for &r in moved {
            readers[rows[r]] += 1;
        }
        let mut ready: Vec<usize> = moved.iter().copied().filter(|&r| readers[r] == 0).collect();
        let mut done = vec![false; n];
        let mut saved: Vec<(usize, Growing)> = Vec::new();
        let mut left = moved.len();
        while left > 0 {
            while let Some(r) = ready.pop() {
                let p = rows[r];
                match saved.iter().find(|(s, _)| *s == p) {
                    Some((_, one)) => copy_row(one, 0, self, r),
                    None => {
                        self.copy_within(p, r);
                        readers[p] -= 1;
                        if readers[p] == 0 && p < rows.len() && rows[p] != p && !done[p] {
                            ready.push(p);
                        }
                    }
                }
                done[r] = true;
                left -= 1;
            }
            // What is left lies on cycles: save one of its rows, whose readers then read
            // the copy, and it can be overwritten.
            if let Some(&c) = moved.iter().find(|&&r| !done[r]) {
                let mut one = self.like(1, self.cap);
                copy_row(self, c, &mut one, 0);
                saved.push((c, one));
                readers[c] = 0;
                ready.push(c);
            }
        }
    }

    /// An empty cache of this one's shape with `rows` rows (and room for them) and room
    /// `cap` along the axis.
    fn like(&self, rows: usize, cap: usize) -> Growing {
        let mut g = Growing {
            data: Vec::new(),
            shape: self.shape.clone(),
            axis: self.axis,
            cap,
            row_cap: rows,
            spare: Vec::new(),
        };
        g.shape[0] = rows;
        g.data = vec![0.0; g.physical_len()];
        g
    }

    /// [`Growing::take_rows`] by copying every row into the spare storage, which then
    /// becomes the cache's.
    fn take_rows_anew(&mut self, rows: &[usize]) {
        let mut next = Growing {
            data: std::mem::take(&mut self.spare),
            shape: self.shape.clone(),
            axis: self.axis,
            cap: self.cap,
            row_cap: self.row_cap.max(rows.len()),
            spare: Vec::new(),
        };
        next.shape[0] = rows.len();
        // Only what grows is zeroed: every logical element is copied below.
        next.data.resize(next.physical_len(), 0.0);
        let rs = next.row_stride();
        let (gap, run) = next.runs();
        let dst = &mut next.data[..rows.len() * rs];
        let copy = |(row, &p): (&mut [f32], &usize)| self.copy_row_to(p, row, gap, run);
        if dst.len() >= PAR_MIN {
            use rayon::prelude::*;
            dst.par_chunks_mut(rs.max(1)).zip(rows).for_each(copy);
        } else {
            dst.chunks_mut(rs.max(1)).zip(rows).for_each(copy);
        }
        next.spare = std::mem::take(&mut self.data);
        *self = next;
    }

    /// (The distance between a row's runs of logical elements, their length.)
    fn runs(&self) -> (usize, usize) {
        let (_, inner) = self.segments();
        (self.cap * inner, self.shape[self.axis] * inner)
    }

    /// Row `from`'s logical elements into `row`, a row of storage whose runs are `gap`
    /// apart (the same logical sizes, `run` elements a run).
    fn copy_row_to(&self, from: usize, row: &mut [f32], gap: usize, run: usize) {
        let (outer, _) = self.segments();
        let (rs, own_gap) = (self.row_stride(), self.runs().0);
        for o in 0..outer {
            let a = from * rs + o * own_gap;
            row[o * gap..o * gap + run].copy_from_slice(&self.data[a..a + run]);
        }
    }

    /// Row `from`'s logical elements onto row `to` (another row).
    fn copy_within(&mut self, from: usize, to: usize) {
        let (outer, inner) = self.segments();
        let (rs, run, gap) = (
            self.row_stride(),
            self.shape[self.axis] * inner,
            self.cap * inner,
        );
        for o in 0..outer {
            let (a, b) = (from * rs + o * gap, to * rs + o * gap);
            self.data.copy_within(a..a + run, b);
        }
    }

    /// The logical elements as a contiguous tensor.
    pub fn to_tensor(&self) -> Tensor {
        let mut t = self.like(self.shape[0], self.shape[self.axis]);
        for r in 0..self.shape[0] {
            copy_row(self, r, &mut t, r);
        }
        Tensor {
            shape: self.shape.clone(),
            data: TensorData::F32(t.data),
        }
    }

    /// Replaces the cache by `t` (f32, the same rank, the same sizes but along axis 0 and
    /// the growing axis), with no room past it.
    pub fn assign(&mut self, t: Tensor) -> Result<(), String> {
        let same = t.shape.len() == self.shape.len()
            && (1..t.shape.len()).all(|i| i == self.axis || t.shape[i] == self.shape[i]);
        let TensorData::F32(data) = t.data else {
            return Err("a cache must be f32".into());
        };
        if !same || data.len() != t.shape.iter().product::<usize>() {
            return Err(format!(
                "a cache of shape {:?} cannot take a tensor of shape {:?}",
                self.shape, t.shape
            ));
        }
        self.cap = t.shape[self.axis];
        self.row_cap = t.shape[0];
        self.shape = t.shape;
        self.data = data;
        self.spare = Vec::new();
        Ok(())
    }
}

/// Row `from` of `src`'s logical elements onto row `to` of `dst` (the same logical shape
/// but for the rows).
fn copy_row(src: &Growing, from: usize, dst: &mut Growing, to: usize) {
    let (gap, run) = dst.runs();
    let rs = dst.row_stride();
    src.copy_row_to(from, &mut dst.data[to * rs..(to + 1) * rs], gap, run);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `[rows, 2, len, 3]` cache whose element `[r, a, t, c]` is `1000 r + 100 a +
    /// 10 t + c`, grown one position at a time.
    fn filled(rows: usize, len: usize) -> Growing {
        let mut g = Growing::new(vec![rows, 2, 0, 3], 2).unwrap();
        for t in 0..len {
            g.reserve(t + 1);
            let s = g.strides();
            let p = g.as_mut_ptr();
            for r in 0..rows {
                for a in 0..2 {
                    for c in 0..3 {
                        let v = (1000 * r + 100 * a + 10 * t + c) as f32;
                        // SAFETY: the index is inside the reserved room.
                        unsafe { *p.add(r * s[0] + a * s[1] + t * s[2] + c * s[3]) = v };
                    }
                }
            }
            g.set_len(t + 1);
        }
        g
    }

    fn values(g: &Growing) -> Vec<f32> {
        match g.to_tensor().data {
            TensorData::F32(v) => v,
            _ => unreachable!(),
        }
    }

    fn expected(rows: &[usize], len: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for &r in rows {
            for a in 0..2 {
                for t in 0..len {
                    for c in 0..3 {
                        out.push((1000 * r + 100 * a + 10 * t + c) as f32);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn appending_keeps_every_position_through_growth() {
        let g = filled(3, 40);
        assert!(g.capacity() >= 40 && g.capacity() < 80);
        assert_eq!(g.shape(), &[3, 2, 40, 3]);
        assert_eq!(values(&g), expected(&[0, 1, 2], 40));
    }

    #[test]
    fn rows_are_taken_as_take_rows_takes_them() {
        // Swaps (a cycle), repeats, dropped rows, more rows than there is room for.
        for rows in [
            vec![1, 0, 2],
            vec![0, 0, 0],
            vec![2, 1],
            vec![2, 0, 1],
            vec![0, 1, 2],
            vec![1],
            vec![0, 0, 1, 1, 2, 2],
        ] {
            let mut g = filled(3, 5);
            g.take_rows(&rows).unwrap();
            assert_eq!(values(&g), expected(&rows, 5), "{rows:?}");
            assert_eq!(g.shape()[0], rows.len());
        }
        // Few rows moved: copied where they are (a swap through a saved copy).
        for rows in [
            vec![0, 1, 2, 0, 4, 5],
            vec![1, 0, 2, 3, 4, 5],
            vec![0, 1, 5, 3, 4],
            vec![1, 2, 0, 3, 4, 5],
            vec![0, 2, 3, 3, 4, 5],
        ] {
            let mut g = filled(6, 4);
            g.take_rows(&rows).unwrap();
            assert_eq!(values(&g), expected(&rows, 4), "{rows:?}");
        }
        // Fewer rows, then as many again: the room is kept, the rows are taken again.
        let mut g = filled(4, 3);
        g.take_rows(&[3, 1]).unwrap();
        g.take_rows(&[1, 1, 0, 0]).unwrap();
        assert_eq!(values(&g), expected(&[1, 1, 3, 3], 3));
        assert!(g.take_rows(&[4]).is_err());
        let mut g = filled(6, 3);
        g.take_rows(&[0, 1, 2, 3]).unwrap();
        g.take_rows(&[0, 1, 2, 3, 0, 1]).unwrap();
        assert_eq!(values(&g), expected(&[0, 1, 2, 3, 0, 1], 3));
    }

    #[test]
    fn a_cache_assigned_from_a_tensor_grows_from_it() {
        let mut g = filled(2, 4);
        let t = filled(2, 6).to_tensor();
        g.assign(t).unwrap();
        assert_eq!(values(&g), expected(&[0, 1], 6));
        g.reserve(7);
        assert_eq!(values(&g), expected(&[0, 1], 6));
        assert!(g
            .assign(Tensor::f32(vec![2, 3, 1, 3], vec![0.0; 18]).unwrap())
            .is_err());
        assert!(Growing::new(vec![2, 3], 0).is_err());
    }
}
