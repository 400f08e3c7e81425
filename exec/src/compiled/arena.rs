//! Where the compiled executor's values live during a run: the arena and its layout,
//! each value's location ([`Loc`]), the scratch kept for a kernel ([`Keep`]), view
//! copies, weights transposed or packed once, and the outputs copied out.

use std::sync::Arc;

use kiln_compiler::bind::Source;
use kiln_compiler::ir::{DType, Graph, Op};
use kiln_compiler::optimize::kernels::{Def, KernelGraph};
use kiln_compiler::plan::{direct_output, ALIGN};
use kiln_compiler::tensor::{Tensor, TensorData};

use super::*;
use crate::eager::value::Layout;

/// A copy of a weight made for one parameters version (a transposed view's contiguous
/// copy, a weight packed for the bf16 products), by the first run of the version that
/// needs it, for the version's later runs.
pub(crate) struct Versioned<T> {
    /// The `params_version` of the last run that read the weight.
    pub(crate) version: Option<u64>,
    /// The copy, made by the first run of that version that needed it.
    pub(crate) copy: Option<Arc<T>>,
}

impl<T> Default for Versioned<T> {
    fn default() -> Self {
        Versioned {
            version: None,
            copy: None,
        }
    }
}

impl<T> Versioned<T> {
    /// The copy for `version`: the one kept, or `make`'s (dropping an older version's).
    pub(crate) fn get(&mut self, version: u64, make: impl FnOnce() -> T) -> Arc<T> {
        if self.version != Some(version) {
            self.version = Some(version);
            self.copy = None;
        }
        self.copy.get_or_insert_with(|| Arc::new(make())).clone()
    }
}

/// A transposed weight view's contiguous copy.
pub(crate) type Transposed = Versioned<Vec<f32>>;

/// A weight packed for the bf16 products.
pub(crate) type PackedWeight = Versioned<kiln_matmul::float16::PackedRhs>;

/// The values that matrix products read as their right operand (`x·w`, `x·w + b`) and
/// that are a parameter or a view of one: with `views_only`, only the views (those a
/// transposed copy can serve, see `Compiled::weight_copy`); else the parameters read as
/// they are too (those the bf16 products can pack once, see `Compiled::packed_weight`).
pub(crate) fn weight_operands(
    kg: &KernelGraph,
    steps: &[launch::Step],
    views_only: bool,
) -> Vec<usize> {
    let mut out: Vec<usize> = steps
        .iter()
        .filter(|s| matches!(s.exec, launch::Exec::Matmul | launch::Exec::Linear { .. }))
        .filter_map(|s| s.inputs.get(1).copied())
        .filter(|&w| {
            let mut v = w;
            loop {
                match &kg.values[v].def {
                    Def::View(Op::Permute { .. } | Op::Reshape { .. }, x) => v = *x,
                    Def::Param(_) => return !views_only || v != w,
                    _ => return false,
                }
            }
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Where a kernel result is stored during a run.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Home {
    /// In the arena, as buffer `b` of the memory plan.
    Arena(usize),
    /// In the storage of graph output `i` (see `Compiled::direct`).
    Output(usize),
}

/// Where a value's elements are during a run.
#[derive(Clone, Debug)]
pub(crate) struct Loc {
    pub ptr: *mut u8,
    pub layout: Layout,
    pub dtype: DType,
}

// SAFETY: a run's locations point into memory the run owns or borrows for its duration;
// kernels that share them across threads write disjoint elements.
unsafe impl Send for Loc {}
unsafe impl Sync for Loc {}

impl Loc {
    /// Element `offset + i` as a pointer (4-byte elements).
    pub fn at(&self, elem: usize) -> *mut u8 {
        self.ptr.wrapping_add(4 * elem)
    }

    /// The pointer to the first element of the layout.
    pub fn base(&self) -> *mut u8 {
        self.at(self.layout.offset)
    }

    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// One past the largest element offset the layout reaches.
    pub fn extent(&self) -> usize {
        if self.numel() == 0 {
            return self.layout.offset;
        }
        self.layout.offset
            + self
                .layout
                .shape
                .iter()
                .zip(&self.layout.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }
}

/// Memory a run owns besides the arena: converted inputs, constants, copies of strided
/// views, kernels' scratch. Buffers come from (and go back to) a pool kept between runs,
/// so a run does not page-fault fresh memory in for every copy; a buffer handed back
/// during the run ([`Keep::release_since`], [`Keep::give_back`]) serves later requests of
/// the same run.
#[derive(Default)]
pub(crate) struct Keep {
    /// In use until the run ends (or until released).
    pub(crate) bufs: Vec<Vec<u32>>,
    /// Free, handed back during this run.
    pub(crate) free: Vec<Vec<u32>>,
    /// Free, left by earlier runs; what this run does not take is dropped at its end, so
    /// the pool never holds more than one run used.
    pub(crate) old: Vec<Vec<u32>>,
}

impl Keep {
    /// A keep whose requests are served first from `pool` (an earlier run's buffers).
    pub(crate) fn with_pool(pool: Vec<Vec<u32>>) -> Keep {
        Keep {
            bufs: Vec::new(),
            free: Vec::new(),
            old: pool,
        }
    }

    /// A buffer of at least `n` 4-byte elements (contents unspecified), owned by the
    /// caller: the smallest free one that holds `n`, else a fresh one.
    pub(crate) fn take(&mut self, n: usize) -> Vec<u32> {
        let n = n.max(1);
        let best = |v: &Vec<Vec<u32>>| {
            v.iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= n)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, b)| (i, b.capacity()))
        };
        let mut b = match (best(&self.free), best(&self.old)) {
            (Some((i, a)), Some((_, o))) if a <= o => self.free.swap_remove(i),
            (_, Some((j, _))) => self.old.swap_remove(j),
            (Some((i, _)), None) => self.free.swap_remove(i),
            (None, None) => Vec::with_capacity(n),
        };
        // Filled once, when first grown: a buffer's length only ever grows, so reusing
        // it writes nothing.
        if b.len() < n {
            b.resize(n, 0);
        }
        b
    }

    /// A buffer of `n` 4-byte elements that lives as long as the run (contents
    /// unspecified).
    pub fn alloc(&mut self, n: usize) -> *mut u8 {
        let b = self.take(n);
        self.bufs.push(b);
        self.bufs.last_mut().expect("pushed").as_mut_ptr() as *mut u8
    }

    /// How many buffers are in use: a mark for [`Keep::release_since`].
    pub(crate) fn mark(&self) -> usize {
        self.bufs.len()
    }

    /// Frees every buffer allocated since `mark` (a kernel's scratch, once it has run).
    pub(crate) fn release_since(&mut self, mark: usize) {
        let done = self.bufs.drain(mark..);
        self.free.extend(done);
    }

    /// Frees a buffer [`Keep::take`] gave out.
    pub(crate) fn give_back(&mut self, b: Vec<u32>) {
        self.free.push(b);
    }

    /// The pool for the next run: every buffer this run used.
    pub(crate) fn into_pool(self) -> Vec<Vec<u32>> {
        let mut pool = self.bufs;
        pool.extend(self.free);
        pool
    }
}

/// A reshape of a non-contiguous view, which cannot be another view of its source: its
/// elements are copied into a buffer of their own when a kernel first reads them, and
/// the buffer is freed after the last kernel that reads them.
pub(crate) struct ViewCopy {
    /// The value copied (a strided view).
    pub(crate) src: usize,
    pub(crate) words: usize,
    pub(crate) buf: Option<Vec<u32>>,
    /// The values that start at the copy: itself and views of it. Their locations get
    /// its address when it is made.
    pub(crate) users: Vec<usize>,
}

/// Makes the copies in `cs` that are not made yet (in order: a copy of a view of a copy
/// comes after the copy it reads).
pub(crate) fn materialize(
    copy: kiln_compiler::codegen::jit::KernelFn,
    cs: &[usize],
    copies: &mut [ViewCopy],
    locs: &mut [Vec<Loc>],
    keep: &mut Keep,
) {
    for &c in cs {
        if copies[c].buf.is_some() {
            continue;
        }
        let mut b = keep.take(copies[c].words);
        let p = b.as_mut_ptr() as *mut u8;
        for &u in &copies[c].users {
            locs[u][0].ptr = p;
        }
        launch::copy_with(copy, &locs[copies[c].src][0], p);
        copies[c].buf = Some(b);
    }
}

/// Per graph output, the kernel result written straight into the returned tensor's
/// storage ([`direct_output`]), for the first output naming it only.
pub(crate) fn direct_outputs(graph: &Graph, kg: &KernelGraph) -> Vec<Option<(usize, usize)>> {
    let mut seen = std::collections::HashSet::new();
    graph
        .outputs
        .iter()
        .map(|o| direct_output(kg, &o.name).filter(|vk| seen.insert(*vk)))
        .collect()
}

/// Storage for `n` f32 elements: a vector of exactly that length from `spare` (taken
/// out of it) when there is one and it is worth it, else a fresh zeroed one.
pub(crate) fn take_spare(spare: &mut Vec<Vec<f32>>, n: usize) -> Vec<f32> {
    let reused = if n >= RECYCLE_MIN {
        spare
            .iter()
            .position(|v| v.len() == n)
            .map(|i| spare.swap_remove(i))
    } else {
        None
    };
    reused.unwrap_or_else(|| zeroed(n))
}

/// Storage for an output a kernel writes whole: a recycled vector of exactly `n`
/// elements, else an empty one with room for `n` — its elements are written by the run
/// and its length set after ([`Compiled::run`]), so it is never zeroed first (the
/// decoder's caches are fresh every step, and zeroing them was 3 % of a translation).
/// Large ones ask for transparent huge pages, as [`zeroed`].
pub(crate) fn take_storage(spare: &mut Vec<Vec<f32>>, n: usize) -> Vec<f32> {
    if n >= RECYCLE_MIN {
        if let Some(i) = spare.iter().position(|v| v.len() == n) {
            return spare.swap_remove(i);
        }
    }
    let mut v: Vec<f32> = Vec::with_capacity(n);
    advise_huge_pages(v.as_mut_ptr(), n * 4);
    v
}

/// Words an arena holds past its memory plan's bytes: room to start the plan's offset 0
/// on an [`ALIGN`]-byte boundary ([`aligned_base`]).
pub(crate) const ARENA_PAD: usize = ALIGN / 4;

/// The words of `arena` its memory plan may use (less [`ARENA_PAD`]).
pub(crate) fn arena_len(arena: &[f32]) -> usize {
    arena.len().saturating_sub(ARENA_PAD)
}

/// Where the memory plan's offset 0 is in `arena` (at least [`ARENA_PAD`] words long):
/// its first [`ALIGN`]-byte (64-byte) boundary. The plan's offsets are multiples of
/// [`ALIGN`], so every buffer then starts on a cache line, as a 512-bit load or store
/// of a row wants. A large `Vec` from the allocator starts 16 bytes past a page (glibc's
/// header before an `mmap`ed block), which put every buffer 16 bytes off a line: each
/// 64-byte load and store of the 16-bit products' packing and results touched two lines.
/// On this Xeon an 800×512·512×512 fp16 product took 857–876 µs with its operands 16
/// bytes off a line against 817–854 µs with them on one (each the fastest of a round of
/// 200 runs, hot in cache).
pub(crate) fn aligned_base(arena: &mut [f32]) -> *mut u8 {
    let pad = arena.as_ptr().align_offset(ALIGN);
    assert!(
        pad <= ARENA_PAD,
        "an f32 arena is 4-byte aligned, so at most 15 words from a 64-byte boundary"
    );
    arena[pad..].as_mut_ptr() as *mut u8
}

/// A zeroed vector of `n` f32. Large ones ask for transparent huge pages before the
/// first touch (Linux `madvise(MADV_HUGEPAGE)`, which the default `madvise` THP mode
/// honours): a fresh 118 MB of logits is otherwise page-faulted in 4 KiB at a time by
/// the kernel writing it — 29,000 faults, a quarter of the output projection's time.
pub(crate) fn zeroed(n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    advise_huge_pages(v.as_mut_ptr(), n * 4);
    v
}

/// Asks for transparent huge pages under the `bytes` bytes at `ptr` (an allocation of
/// the caller's).
#[cfg(target_os = "linux")]
pub(crate) fn advise_huge_pages(ptr: *mut f32, bytes: usize) {
    const HUGE: usize = 2 << 20;
    let start = ptr as usize;
    if bytes < 2 * HUGE {
        return;
    }
    let (from, to) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
    if to > from {
        // SAFETY: the range lies inside the caller's allocation; the advice changes how
        // its pages are backed, never their contents.
        // Failure (no THP in this kernel) leaves ordinary pages.
        unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn advise_huge_pages(_: *mut f32, _: usize) {}

/// A bound source as a location: f32 and i32 read in place, others converted.
pub(crate) fn source_loc(src: Source<'_>, shape: &[usize], keep: &mut Keep) -> Loc {
    let layout = Layout::contiguous(shape);
    match src {
        Source::F32(v) => Loc {
            ptr: v.as_ptr() as *mut u8,
            layout,
            dtype: DType::F32,
        },
        Source::F64(v) => {
            let p = keep.alloc(v.len());
            for (i, x) in v.iter().enumerate() {
                // SAFETY: `p` holds `v.len()` elements.
                unsafe { *(p as *mut f32).add(i) = *x as f32 };
            }
            Loc {
                ptr: p,
                layout,
                dtype: DType::F32,
            }
        }
        Source::I32(v) => match v {
            std::borrow::Cow::Borrowed(s) => Loc {
                ptr: s.as_ptr() as *mut u8,
                layout,
                dtype: DType::I32,
            },
            std::borrow::Cow::Owned(s) => {
                let p = keep.alloc(s.len());
                // SAFETY: `p` holds `s.len()` elements.
                unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), p as *mut i32, s.len()) };
                Loc {
                    ptr: p,
                    layout,
                    dtype: DType::I32,
                }
            }
        },
        Source::Bool(v) => {
            let p = keep.alloc(v.len());
            for (i, &b) in v.iter().enumerate() {
                // SAFETY: `p` holds `v.len()` elements.
                unsafe { *(p as *mut u32).add(i) = b as u32 };
            }
            Loc {
                ptr: p,
                layout,
                dtype: DType::Bool,
            }
        }
    }
}

/// Reads a location into a host tensor (row-major).
pub(crate) fn to_tensor(loc: &Loc) -> Tensor {
    to_tensor_into(loc, &mut Vec::new(), None)
}

/// Outputs at least this long (in elements) are worth recycling (see
/// [`Compiled::recycle`]); smaller ones are cheap to allocate.
pub(crate) const RECYCLE_MIN: usize = 1 << 14;

/// [`to_tensor`], storing an f32 output in a vector of `spare` of exactly its length
/// when there is one (taken out of `spare`); a strided f32 one (a view, such as the
/// hoisted keys stored transposed) through the generated strided `copy` where given,
/// not an element at a time.
pub(crate) fn to_tensor_into(
    loc: &Loc,
    spare: &mut Vec<Vec<f32>>,
    copy: Option<kiln_compiler::codegen::jit::KernelFn>,
) -> Tensor {
    let shape = loc.layout.shape.clone();
    if loc.is_contiguous() && loc.dtype == DType::F32 {
        // SAFETY: a contiguous layout covers `offset .. offset + numel` of f32 elements.
        let src = unsafe {
            std::slice::from_raw_parts((loc.ptr as *const f32).add(loc.layout.offset), loc.numel())
        };
        // Large outputs (logits, gradients) are copied by all threads: a fresh
        // allocation's first touch costs as much as the copy, which recycled storage
        // does not pay.
        const CHUNK: usize = 1 << 16;
        let mut v = take_spare(spare, src.len());
        if src.len() > 4 * CHUNK {
            use rayon::prelude::*;
            v.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s));
        } else {
            v.copy_from_slice(src);
        }
        return Tensor {
            shape,
            data: TensorData::F32(v),
        };
    }
    if let (DType::F32, Some(copy)) = (loc.dtype, copy) {
        let mut v = take_spare(spare, loc.numel());
        if !v.is_empty() {
            launch::copy_with(copy, loc, v.as_mut_ptr() as *mut u8);
        }
        return Tensor {
            shape,
            data: TensorData::F32(v),
        };
    }
    let words = launch::gather_words(loc);
    let data = match loc.dtype {
        DType::I32 => TensorData::I32(words.iter().map(|&w| w as i32).collect()),
        DType::Bool => TensorData::Bool(words.iter().map(|&w| w != 0).collect()),
        _ => TensorData::F32(words.iter().map(|&w| f32::from_bits(w)).collect()),
    };
    Tensor { shape, data }
}
