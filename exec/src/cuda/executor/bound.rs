//! What a run binds once per dims and keeps (views' and kernel results' locations, the
//! copies of non-contiguous views), and the device's units loaded once.

use kiln_compiler::codegen::cuda::{CudaCode, Work};
use kiln_compiler::ir::DType;

use super::*;
use crate::cuda::device::{self, Buf, Device};

/// Compiles (NVRTC, `options`) and loads the generated unit `code` unless its function
/// `marker` is loaded already: the extra units (bf16 casts, the device optimizer, the row
/// gather) are built on first use. The error is NVRTC's log or the driver's message.
pub(crate) fn load_unit_once(
    device: &mut Device,
    marker: &str,
    code: fn() -> CudaCode,
    options: &[String],
) -> Result<(), String> {
    if device.has(marker) {
        return Ok(());
    }
    let code = code();
    let unit = device::compile(&code.source(), options)?;
    device.load_module(unit, &signatures(&code))
}

/// What `Device::load_module` needs of a generated unit's functions: name, work
/// division and parameter count.
pub(crate) fn signatures(code: &CudaCode) -> Vec<(String, Work, usize)> {
    code.functions
        .iter()
        .map(|f| (f.name.clone(), f.work, f.params.len()))
        .collect()
}

/// A reshape of a non-contiguous view, as binding plans it (see the CPU executor's
/// `ViewCopy`): the value copied, its size, and the values whose locations start at the
/// copy (itself and views of it), which get its address when it is made.
#[derive(Clone, Debug)]
pub(crate) struct CopyPlan {
    pub(crate) src: usize,
    pub(crate) words: usize,
    pub(crate) users: Vec<usize>,
}

/// Where a bound location's address comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Root {
    /// A source (input, parameter, constant), bound at every run.
    Source,
    /// The arena: the plan's offset from its start.
    Arena,
    /// A view of source value `.0`: its address.
    Of(usize),
    /// A view copy (or a view of one): set when the copy is made.
    Copy,
}

/// [`CudaExecutor::bind_derived`]'s results besides the locations.
pub(crate) struct Derived {
    pub(crate) needs: Vec<Vec<usize>>,
    pub(crate) copies: Vec<CopyPlan>,
    pub(crate) roots: Vec<Root>,
}

/// The views' and kernel results' locations at one dims, kept for the next run at those
/// dims: binding ~1,400 values (evaluating their shapes, building their layouts) took
/// about 2 ms of host time before a base training step's first launch, while the GPU
/// waited. Addresses are kept relative to their [`Root`].
pub(crate) struct Bound {
    /// The sources' dtypes (in [`CudaExecutor::sources`] order) it was made with: a run
    /// whose sources differ (an f64 input, a bf16 device tensor) binds afresh.
    pub(crate) dtypes: Vec<DType>,
    pub(crate) locs: Vec<Vec<DLoc>>,
    pub(crate) roots: Vec<Root>,
    pub(crate) needs: Vec<Vec<usize>>,
    pub(crate) copies: Vec<CopyPlan>,
}

impl Bound {
    /// At most this many dims are kept (each about 0.2 MB for the base model).
    pub(crate) const KEPT: usize = 64;

    /// The bound locations `locs` (arena at `base`) with addresses made relative.
    pub(crate) fn of(d: &Derived, locs: &[Vec<DLoc>], base: u64, dtypes: Vec<DType>) -> Bound {
        let locs = locs
            .iter()
            .zip(&d.roots)
            .map(|(ls, root)| {
                let from = match *root {
                    Root::Source | Root::Copy => None,
                    Root::Arena => Some(base),
                    Root::Of(s) => Some(locs[s][0].ptr),
                };
                ls.iter()
                    .map(|l| DLoc {
                        ptr: from.map_or(0, |f| l.ptr.wrapping_sub(f)),
                        layout: l.layout.clone(),
                        dtype: l.dtype,
                    })
                    .collect()
            })
            .collect();
        Bound {
            dtypes,
            locs,
            roots: d.roots.clone(),
            needs: d.needs.clone(),
            copies: d.copies.clone(),
        }
    }

    /// Places the kept locations at this run's addresses: the arena at `base`, the
    /// sources as `locs` holds them.
    pub(crate) fn place(&self, locs: &mut [Vec<DLoc>], base: u64) {
        for (v, (kept, root)) in self.locs.iter().zip(&self.roots).enumerate() {
            let at = match *root {
                Root::Source => continue,
                Root::Arena => base,
                Root::Of(s) => locs[s][0].ptr,
                Root::Copy => 0,
            };
            locs[v] = kept
                .iter()
                .map(|l| DLoc {
                    ptr: at.wrapping_add(l.ptr),
                    layout: l.layout.clone(),
                    dtype: l.dtype,
                })
                .collect();
        }
    }
}

/// A [`CopyPlan`] in a run: copied into a buffer of its own when a kernel first reads
/// it, freed after the last one does.
pub(crate) struct DevCopy {
    pub(crate) plan: CopyPlan,
    pub(crate) buf: Option<Buf>,
}
