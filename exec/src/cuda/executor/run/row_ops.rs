//! A run's row and element kernels on the device: elementwise regions, layer norm and
//! its gradient, the label-smoothed cross-entropy, and the embedding with positions.

use kiln_compiler::codegen::rows;
use kiln_compiler::optimize::regions::Expr;

use crate::compiled::launch::{region_operands, row_buffers};
use crate::cuda::abi::Launch;

use super::*;

impl Run<'_> {
    /// An elementwise region: each operand read through its strides where the kernel
    /// was built for them, else through a contiguous copy.
    pub(super) fn region(
        &mut self,
        f: &str,
        expr: &Expr,
        inner: &[bool],
        ins: &[&DLoc],
        out: &DLoc,
    ) -> Result<(), String> {
        let shape = out.shape().to_vec();
        let (mut ptrs, strides) = region_operands(
            ins,
            &shape,
            inner,
            |l: &DLoc| &l.layout,
            |l| self.contig(l),
            |l, offset| l.at(offset),
        )?;
        ptrs.push(out.base());
        let launch = Launch::region(expr, &shape, &strides, self.seed, self.step);
        self.launch(f, &ptrs, launch)
    }

    /// `layer_norm(x + y)` by rows.
    pub(super) fn add_layer_norm(
        &mut self,
        f: &str,
        ins: &[&DLoc],
        out: &DLoc,
    ) -> Result<(), String> {
        let contig = |l: &DLoc| self.contig(l);
        let outs = std::slice::from_ref(out);
        let (ptrs, x) = row_buffers((ins, outs), 4, contig, DLoc::base)?;
        let d = x.last();
        let l = Launch::same(rows::add_layer_norm_dims(x.numel() / d.max(1), d));
        self.launch(f, &ptrs, l)
    }

    /// The gradient of `add_layer_norm`: the rows' kernel, then the gain and bias
    /// gradients summed over the rows' partials.
    pub(super) fn add_layer_norm_bwd(
        &mut self,
        main: &str,
        finish: &str,
        ins: &[&DLoc],
        outs: &[DLoc],
    ) -> Result<(), String> {
        let contig = |l: &DLoc| self.contig(l);
        let (mut ptrs, x) = row_buffers((ins, &outs[..1]), 4, contig, DLoc::base)?;
        let d = x.last();
        let rows_n = x.numel() / d.max(1);
        let scratch = self.alloc(rows::add_layer_norm_bwd_scratch(rows_n, d))?;
        ptrs.push(scratch);
        self.launch(
            main,
            &ptrs,
            Launch::same(rows::add_layer_norm_bwd_dims(rows_n, d)),
        )?;
        // RMSNorm's kernel has no dβ output: its partials are summed into scratch.
        let dbeta = match outs.get(2) {
            Some(o) => o.base(),
            None => self.alloc(d)?,
        };
        self.launch(
            finish,
            &[scratch, outs[1].base(), dbeta],
            Launch::ln_bwd_finish(rows_n, d),
        )
    }

    /// The label-smoothed cross-entropy: the targets counted, the rows' losses (and
    /// gradients, with `grad`), then their sum.
    pub(super) fn xent_ls(
        &mut self,
        [count, main, finish]: [&str; 3],
        pad: i64,
        grad: bool,
        ins: &[&DLoc],
        outs: &[DLoc],
    ) -> Result<(), String> {
        let logits = self.contig(ins[0])?;
        let target = self.contig(ins[1])?;
        let v = logits.last();
        let rows_n = logits.numel() / v.max(1);
        // Targets are checked on the host, as on the CPU (the kernels read one out
        // of range as no class).
        kiln_compiler::bind::check_targets(&self.words(&target)?, v, pad)?;
        let stats = self.alloc(2)?;
        let row_loss = self.alloc(rows_n)?;
        // The `seeded` form (a loss-scaled train_step) has the seed as operand 5.
        let count_bufs = match ins.get(5) {
            Some(seed) => vec![target.base(), self.contig(seed)?.base(), stats],
            None => vec![target.base(), stats],
        };
        self.launch(count, &count_bufs, Launch::xent_count(rows_n, pad))?;
        let scalars = [2, 3, 4].map(|k| ins[k].base());
        let ptrs = rows::xent_ls_buffers(
            (logits.base(), target.base(), scalars),
            row_loss,
            grad.then(|| (stats + 4, outs[1].base())),
        );
        self.launch(
            main,
            &ptrs,
            Launch::same(rows::xent_ls_dims(rows_n, v, pad)),
        )?;
        self.launch(
            finish,
            &[row_loss, stats, outs[0].base()],
            Launch::xent_finish(rows_n),
        )
    }

    /// The embedding rows of the ids, scaled, plus the positions (and dropout).
    pub(super) fn embed_pe(
        &mut self,
        f: &str,
        dropout: Option<(f64, u32)>,
        ins: &[&DLoc],
        out: &DLoc,
    ) -> Result<(), String> {
        let table = self.contig(ins[0])?;
        let ids = self.contig(ins[1])?;
        let pe = self.contig(ins[2])?;
        let vocab = table.shape()[0];
        // Ids are checked on the host, as on the CPU (the kernel does not).
        kiln_compiler::bind::check_embedding_ids(&self.words(&ids)?, vocab)?;
        let s = out.shape().to_vec();
        let l = Launch::embed_pe([s[0], s[1], s[2]], dropout, (self.seed, self.step));
        let ptrs = [
            table.base(),
            ids.base(),
            pe.base(),
            ins[3].base(),
            out.base(),
        ];
        self.launch(f, &ptrs, l)
    }
}
