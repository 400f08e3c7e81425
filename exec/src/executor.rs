//! Executors behind one interface.
//!
//! In: an entry-point graph and the tensors it needs. Out: its outputs. The trainer and
//! the decoder hold a `Box<dyn Exec>` and do not care which executor runs the graph:
//! - [`Reference`]: the compiler's reference executor (plain loops, the oracle);
//! - [`crate::eager::Eager`]: op by op, GEMM through the `gemm` crate;
//! - [`crate::compiled::Compiled`]: the optimized kernel graph as generated code.

use std::collections::BTreeMap;

use kiln_compiler::ir::Graph;
use kiln_compiler::reference::{self, ExecError, RunOptions};
use kiln_compiler::tensor::{Feeds, Outputs, Tensor};

use crate::cuda::{DeviceTensor, ResidentOut, RowsTopK};

/// One timed part of a profiled run: a kernel (named by its kind; the CUDA executor adds
/// how it ran), an upload or download, or a whole-run figure in `[brackets]`.
#[derive(Clone, Copy, Debug)]
pub struct Timing<'a> {
    pub what: &'a str,
    pub seconds: f64,
    /// For a matrix product (`matmul`, `linear`, `linear_relu`), its shape.
    pub product: Option<Product>,
}

/// The shape of a matrix product as a kernel ran it: `batch` products of an `[m, k]`
/// operand by a `[k, n]` one, each stored transposed (read down its columns) or not.
/// A product whose right operand is shared by the batch counts the batch's rows in `m`
/// (one GEMM, as both executors run it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Product {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a_transposed: bool,
    pub b_transposed: bool,
}

impl Product {
    /// The product of operands laid out as `a` (`[..., m, k]`) and `b` (`[..., k, n]`, or a
    /// shared `[k, n]`); `None` for anything else.
    pub(crate) fn of(
        a: &crate::eager::value::Layout,
        b: &crate::eager::value::Layout,
    ) -> Option<Product> {
        let (ar, br) = (a.shape.len(), b.shape.len());
        if ar < 2 || br < 2 || a.shape[ar - 1] != b.shape[br - 2] {
            return None;
        }
        let transposed = |l: &crate::eager::value::Layout| {
            let r = l.shape.len();
            l.strides[r - 1] != 1 && l.shape[r - 1] > 1
        };
        let lead: usize = a.shape[..ar - 2].iter().product();
        let (batch, m) = if br == 2 {
            (1, lead * a.shape[ar - 2])
        } else {
            (lead, a.shape[ar - 2])
        };
        Some(Product {
            batch,
            m,
            k: a.shape[ar - 1],
            n: b.shape[br - 1],
            a_transposed: transposed(a),
            b_transposed: transposed(b),
        })
    }

    /// Floating-point operations: a multiply and an add per term.
    pub fn flops(&self) -> f64 {
        2.0 * self.batch as f64 * self.m as f64 * self.k as f64 * self.n as f64
    }
}

impl std::fmt::Display for Product {
    /// `800×512·512×37000ᵀ`, with `32× ` in front of a batch.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = |x: bool| if x { "ᵀ" } else { "" };
        if self.batch > 1 {
            write!(f, "{}× ", self.batch)?;
        }
        write!(
            f,
            "{}×{}{}·{}×{}{}",
            self.m,
            self.k,
            t(self.a_transposed),
            self.k,
            self.n,
            t(self.b_transposed)
        )
    }
}

/// Something that runs one graph.
pub trait Exec: Send + Sync {
    fn graph(&self) -> &Graph;
    fn run(&self, inputs: &Feeds, params: &Feeds, opts: &RunOptions) -> Result<Outputs, ExecError>;

    /// Hands back output tensors of an earlier run that the caller is done with; an
    /// executor may store later outputs in their memory. The default drops them.
    fn recycle(&self, tensors: Vec<Tensor>) {
        drop(tensors);
    }

    /// [`Exec::run`], calling `rec` with a [`Timing`] for each part of the run an
    /// executor times (the CUDA executor: uploads, each kernel, downloads). The default
    /// times nothing and just runs.
    fn run_profiled(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
        rec: &mut dyn FnMut(&Timing<'_>),
    ) -> Result<Outputs, ExecError> {
        let _ = rec;
        self.run(inputs, params, opts)
    }

    /// Whether this executor runs on a GPU: a decoder there keeps its state on the device
    /// and takes the batches one after another. The default: no.
    fn on_device(&self) -> bool {
        false
    }

    /// This executor as one that keeps tensors on its device between runs, if it is one
    /// (what lets a decoder hold its state on the GPU: `decode::DeviceCachedStep`). The
    /// default: none.
    fn as_resident(&self) -> Option<&dyn DeviceResident> {
        None
    }

    /// Runs the large matrix products with `kernel`'s 16-bit instructions (`None`: in
    /// f32), where this executor runs them itself (the compiled CPU executor); an error
    /// where the CPU cannot run the kernel. The default ignores it.
    fn set_product_kernel(
        &mut self,
        kernel: Option<crate::compiled::Kernel16>,
    ) -> Result<(), ExecError> {
        let _ = kernel;
        Ok(())
    }

    /// The arena this executor's programs run in, for executors that never run at the
    /// same time as this one to share ([`Exec::share_arena`]). The default: none.
    fn arena(&self) -> Option<crate::compiled::SharedArena> {
        None
    }

    /// Runs in `arena` from now on, instead of an arena of its own. The default ignores
    /// it.
    fn share_arena(&mut self, arena: &crate::compiled::SharedArena) {
        let _ = arena;
    }

    /// Whether [`Exec::run_map_gathered`] reads input `name` with its rows gathered
    /// without a copy first. The default: no input.
    fn folds_row_gather(&self, name: &str) -> bool {
        let _ = name;
        false
    }

    /// [`Exec::run_map`] with each input named in `gathered` read as if it were
    /// `decode::take_rows(t, rows)`: a decoder's caches reordered to the surviving beams,
    /// without the copy. Every name must be one [`Exec::folds_row_gather`] accepts; the
    /// default accepts none, so it runs only with `gathered` empty.
    fn run_map_gathered(
        &self,
        inputs: &Feeds,
        gathered: &std::collections::BTreeSet<String>,
        rows: &[usize],
        params: &Feeds,
        opts: &RunOptions,
    ) -> Result<BTreeMap<String, Tensor>, ExecError> {
        let _ = rows;
        if let Some(name) = gathered.iter().next() {
            return Err(ExecError::Unsupported(format!(
                "this executor reads no input with gathered rows (`{name}`)"
            )));
        }
        self.run_map(inputs, params, opts)
    }

    /// Runs and returns the outputs by name.
    fn run_map(
        &self,
        inputs: &Feeds,
        params: &Feeds,
        opts: &RunOptions,
    ) -> Result<BTreeMap<String, Tensor>, ExecError> {
        Ok(self.run(inputs, params, opts)?.into_iter().collect())
    }
}

/// An executor that keeps tensors on its device between runs (the CUDA executor): a
/// decoder holds its encoder output and key/value caches there from step to step.
pub trait DeviceResident: Exec {
    /// `t` uploaded to the device.
    fn to_device(&self, t: &Tensor) -> Result<DeviceTensor, ExecError>;

    /// Rows `rows` of each of `ts`, in that order, gathered on the device.
    fn take_rows(
        &self,
        ts: &[&DeviceTensor],
        rows: &[usize],
    ) -> Result<Vec<DeviceTensor>, ExecError>;

    /// A run with the `resident` tensors bound as inputs where they are: the outputs that
    /// come back, and those `keep` names left on the device.
    fn run_resident(
        &self,
        inputs: &Feeds,
        resident: &BTreeMap<String, DeviceTensor>,
        params: &Feeds,
        opts: &RunOptions,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<ResidentOut, ExecError>;

    /// The `k` best tokens of each row of `[rows, 1, vocab]` logits but `banned`, and each
    /// row's `eos` log-probability, selected on the device.
    fn row_top_k(
        &self,
        logits: &DeviceTensor,
        k: usize,
        banned: &[i32],
        eos: i32,
    ) -> Result<RowsTopK, ExecError>;
}

/// A `RunOptions::params_version` no earlier call returned (process-wide): for a caller
/// about to run an executor several times on parameters it will not change in between
/// (one decoder, one optimizer step's micro-batches, one validation pass).
pub fn fresh_params_version() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The reference executor.
pub struct Reference {
    graph: Graph,
}

impl Reference {
    pub fn new(graph: Graph) -> Result<Reference, ExecError> {
        graph.verify()?;
        Ok(Reference { graph })
    }
}

impl Exec for Reference {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    fn run(&self, inputs: &Feeds, params: &Feeds, opts: &RunOptions) -> Result<Outputs, ExecError> {
        reference::run(&self.graph, inputs, params, opts)
    }
}

/// Which executor to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecutorKind {
    Reference,
    Eager,
    /// Generated kernels (`crate::compiled`): the graph is optimized, planned and
    /// JIT-compiled when the executor is built.
    Compiled,
    /// The CUDA executor (`crate::cuda`): a `--target cuda` artifact's program on a
    /// GPU. It is built from an artifact, not a graph ([`executor`] refuses it).
    Cuda,
}

impl ExecutorKind {
    /// Every kind, by the name [`ExecutorKind::parse`] takes.
    pub const ALL: [ExecutorKind; 4] = [
        ExecutorKind::Reference,
        ExecutorKind::Eager,
        ExecutorKind::Compiled,
        ExecutorKind::Cuda,
    ];

    pub fn parse(s: &str) -> Option<ExecutorKind> {
        ExecutorKind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Its name for `--executor` and `train.executor`.
    pub fn name(self) -> &'static str {
        match self {
            ExecutorKind::Reference => "reference",
            ExecutorKind::Eager => "eager",
            ExecutorKind::Compiled => "compiled",
            ExecutorKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for ExecutorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An executor of `kind` for `graph`.
pub fn executor(kind: ExecutorKind, graph: Graph) -> Result<Box<dyn Exec>, ExecError> {
    match kind {
        ExecutorKind::Reference => Ok(Box::new(Reference::new(graph)?)),
        ExecutorKind::Eager => Ok(Box::new(crate::eager::Eager::new(graph)?)),
        ExecutorKind::Compiled => Ok(Box::new(crate::compiled::Compiled::from_graph(graph)?)),
        ExecutorKind::Cuda => Err(ExecError::Unsupported(
            "the CUDA executor runs a `--target cuda` artifact, not a graph: compile one \
             with `kiln compile … --target cuda -o DIR`"
                .to_string(),
        )),
    }
}

/// One launch of the launch plan as an executor ran it ([`kiln_compiler::launch_plan`]):
/// its index in the plan and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launched {
    pub launch: usize,
    pub how: How,
}

/// How a launch ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// Its own kernel.
    Alone,
    /// As a member of the product group that starts at launch `first`.
    InGroup { first: usize },
    /// A bias gradient, summed by its weight gradient's product (launch `product`) as
    /// that read the output gradient.
    SummedBy { product: usize },
}

/// The kernel graph's value of the graph output `name` (an internal error if it has none).
pub(crate) fn program_output(
    kg: &kiln_compiler::optimize::kernels::KernelGraph,
    name: &str,
) -> Result<usize, ExecError> {
    kg.output(name)
        .ok_or_else(|| ExecError::Unsupported(format!("no program output `{name}`")))
}

/// When an executor may hand back the buffers of a run's view copies (reshapes of
/// non-contiguous views, which the memory plan does not place): per step, the copies
/// whose last reader it is. `needs[v]` lists the copies value `v` reads through, `steps`
/// gives each launch's input values in order, and copies that an output reads (`outputs`)
/// are in no list: they live to the end of the run.
pub(crate) fn copies_freed_after<'a>(
    copies: usize,
    needs: &[Vec<usize>],
    steps: impl Iterator<Item = &'a [usize]>,
    outputs: impl Iterator<Item = usize>,
) -> Vec<Vec<usize>> {
    const END: usize = usize::MAX;
    let mut last: Vec<Option<usize>> = vec![None; copies];
    let mut count = 0;
    for (s, inputs) in steps.enumerate() {
        count = s + 1;
        for &x in inputs {
            for &c in &needs[x] {
                last[c] = Some(s);
            }
        }
    }
    for v in outputs {
        for &c in &needs[v] {
            last[c] = Some(END);
        }
    }
    let mut freed = vec![Vec::new(); count];
    for (c, l) in last.into_iter().enumerate() {
        if let Some(s) = l.filter(|&s| s != END) {
            freed[s].push(c);
        }
    }
    freed
}

#[cfg(test)]
mod tests {
    use super::{copies_freed_after, Product};
    use crate::eager::value::Layout;

    #[test]
    fn products_are_named_as_they_run() {
        let rows = Layout::contiguous;
        // A shared right operand: the batch's rows are one GEMM's.
        let p = Product::of(&rows(&[32, 25, 512]), &rows(&[512, 2048])).unwrap();
        assert_eq!((p.batch, p.m, p.k, p.n), (1, 800, 512, 2048));
        assert_eq!(p.to_string(), "800×512·512×2048");
        assert_eq!(p.flops(), 2.0 * 800.0 * 512.0 * 2048.0);
        // A batched product, its right operand read transposed (keys of attention).
        let keys = rows(&[2, 3, 5, 4]).permute(&[0, 1, 3, 2]);
        let p = Product::of(&rows(&[2, 3, 7, 4]), &keys).unwrap();
        assert_eq!((p.batch, p.m, p.k, p.n), (6, 7, 4, 5));
        assert!(!p.a_transposed && p.b_transposed);
        assert_eq!(p.to_string(), "6× 7×4·4×5ᵀ");
        // A transposed left operand (a weight gradient's `xᵀ·dy`).
        let x = rows(&[800, 512]).permute(&[1, 0]);
        let p = Product::of(&x, &rows(&[800, 512])).unwrap();
        assert_eq!(p.to_string(), "512×800ᵀ·800×512");
        // Operands that do not chain are no product.
        assert_eq!(Product::of(&rows(&[3, 4]), &rows(&[5, 6])), None);
        assert_eq!(Product::of(&rows(&[4]), &rows(&[4, 6])), None);
    }

    #[test]
    fn a_copy_is_freed_after_its_last_reader_unless_an_output_reads_it() {
        // Values: 0 and 1 are copies 0 and 1, 2 a view of copy 1, 3 reads nothing.
        let needs = vec![vec![0], vec![1], vec![1], vec![]];
        let steps: Vec<Vec<usize>> = vec![vec![0, 3], vec![2], vec![3], vec![0]];
        let freed = copies_freed_after(
            2,
            &needs,
            steps.iter().map(|s| s.as_slice()),
            [].into_iter(),
        );
        assert_eq!(freed, vec![vec![], vec![1], vec![], vec![0]]);
        let freed = copies_freed_after(
            2,
            &needs,
            steps.iter().map(|s| s.as_slice()),
            [2].into_iter(),
        );
        assert_eq!(freed, vec![vec![], vec![], vec![], vec![0]]);
        // A copy of a copy: reading the outer one reads the inner one too.
        let needs = vec![vec![0], vec![0, 1], vec![]];
        let steps: Vec<Vec<usize>> = vec![vec![0], vec![2], vec![1]];
        let freed = copies_freed_after(
            2,
            &needs,
            steps.iter().map(|s| s.as_slice()),
            [].into_iter(),
        );
        assert_eq!(freed, vec![vec![], vec![], vec![0, 1]]);
    }
}
