//! A run's index kernels on the device: ranges, concatenations and scatters onto a base.

use kiln_compiler::codegen::cuda::index;
use kiln_compiler::shape::Dim;

use super::*;

impl Run<'_> {
    /// `start, start + 1, …` as i32, the start evaluated at the run's dims.
    pub(super) fn arange(&mut self, f: &str, start: &Dim, out: &DLoc) -> Result<(), String> {
        let start = start
            .eval(self.dims)
            .map_err(|e| format!("arange start: {e}"))?;
        let n = out.numel();
        let end = start + n as i64;
        if n > 0 && (start < i64::from(i32::MIN) || end - 1 > i64::from(i32::MAX)) {
            return Err(format!("the range {start}..{end} does not fit in i32"));
        }
        self.launch(f, &[out.base()], Launch::same(index::arange_dims(n, start)))
    }

    /// The operands side by side along `axis`.
    pub(super) fn concat(
        &mut self,
        f: &str,
        axis: usize,
        ins: &[&DLoc],
        out: &DLoc,
    ) -> Result<(), String> {
        let s = out.shape().to_vec();
        if axis >= s.len() {
            return Err(format!("internal: concat axis {axis} of {s:?}"));
        }
        let outer: usize = s[..axis].iter().product();
        let inner: usize = s[axis + 1..].iter().product();
        let mut ptrs = Vec::with_capacity(ins.len() + 1);
        let mut sizes = Vec::with_capacity(ins.len());
        for l in ins {
            sizes.push(l.shape()[axis]);
            ptrs.push(self.contig(l)?.base());
        }
        ptrs.push(out.base());
        self.launch(
            f,
            &ptrs,
            Launch::same(index::concat_dims(outer, inner, &sizes)),
        )
    }

    /// `scatter_add_into(base, ids, src)`: `base` with the rows of `src` added at `ids`.
    pub(super) fn scatter_add_into(
        &mut self,
        f: &str,
        ins: &[&DLoc],
        out: &DLoc,
    ) -> Result<(), String> {
        // A strided base is read through a contiguous copy; one planned in place
        // is `out` itself.
        let base = self.contig(ins[0])?;
        if base.numel() != out.numel() {
            return Err(format!(
                "scatter_add_into onto {} elements into {}",
                base.numel(),
                out.numel()
            ));
        }
        let (start, order, src, l) = self.scatter_index(ins[1], ins[2], out)?;
        self.launch(f, &[start, order, base.base(), src, out.base()], l)
    }
}
