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
use kiln_compiler::tensor::Tensor;

/// Something that runs one graph.
pub trait Exec: Send + Sync {
    fn graph(&self) -> &Graph;
    fn run(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, ExecError>;

    /// Hands back output tensors of an earlier run that the caller is done with; an
    /// executor may store later outputs in their memory. The default drops them.
    fn recycle(&self, tensors: Vec<Tensor>) {
        drop(tensors);
    }

    /// [`Exec::run`], calling `rec(what, seconds)` for the parts of the run an executor
    /// times (the CUDA executor: uploads, each kernel, downloads). The default times
    /// nothing and just runs.
    fn run_profiled(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
        rec: &mut dyn FnMut(&str, f64),
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        let _ = rec;
        self.run(inputs, params, opts)
    }

    /// The CUDA executor behind this one, if it is one: what lets the decoder keep its
    /// state on the GPU (`decode::DeviceCachedStep`). The default: none.
    fn as_cuda(&self) -> Option<&crate::cuda::CudaExecutor> {
        None
    }

    /// The compiled CPU program behind this executor, if it is one (what lets the trainer
    /// run its programs in one arena). The default: none.
    fn as_compiled_mut(&mut self) -> Option<&mut crate::compiled::Compiled> {
        None
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
        inputs: &BTreeMap<String, Tensor>,
        gathered: &std::collections::BTreeSet<String>,
        rows: &[usize],
        params: &BTreeMap<String, Tensor>,
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
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<BTreeMap<String, Tensor>, ExecError> {
        Ok(self.run(inputs, params, opts)?.into_iter().collect())
    }
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

    fn run(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        reference::run(&self.graph, inputs, params, opts)
    }
}

impl Exec for crate::eager::Eager {
    fn graph(&self) -> &Graph {
        crate::eager::Eager::graph(self)
    }

    fn run(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        crate::eager::Eager::run(self, inputs, params, opts)
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
}

impl ExecutorKind {
    pub fn parse(s: &str) -> Option<ExecutorKind> {
        match s {
            "reference" => Some(ExecutorKind::Reference),
            "eager" => Some(ExecutorKind::Eager),
            "compiled" => Some(ExecutorKind::Compiled),
            _ => None,
        }
    }
}

/// An executor of `kind` for `graph`.
pub fn executor(kind: ExecutorKind, graph: Graph) -> Result<Box<dyn Exec>, ExecError> {
    match kind {
        ExecutorKind::Reference => Ok(Box::new(Reference::new(graph)?)),
        ExecutorKind::Eager => Ok(Box::new(crate::eager::Eager::new(graph)?)),
        ExecutorKind::Compiled => Ok(Box::new(crate::compiled::Compiled::from_graph(graph)?)),
    }
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
    use super::copies_freed_after;

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
