//! Matrix products with int8 operands and int32 sums, for inference (`--gemm-type int8`,
//! `kiln compile --precision int8`): CTranslate2's and oneDNN's scheme. Each column of the
//! right operand (a weight's output channel) and each row of the left one (an
//! activation's row, at run time) is scaled by `127 / max|·|` and rounded to the nearest
//! integer (ties to even), so the largest magnitude becomes ±127 and every other value is
//! within half a unit, `1/254` of the largest. The products are summed exactly in int32
//! over the whole of `k` (at most [`K_MAX`]), and each sum `S` becomes
//! `f32(S) · inv_a[i] · inv_b[j]` (`inv = max / 127`), in that order, then the bias and
//! the ReLU of the [`crate::Epilogue`]. A row or column holding an infinity or a NaN sends the
//! whole product to the f32 kernel, so these propagate as in f32; one whose largest
//! magnitude is below [`TINY`] is taken as zeros.
//!
//! Four instruction families compute the same integer sums, so the same bits: Intel
//! AMX's `TDPBUSD` (`amx.rs`, 16 × 16 results of 64 products each a instruction),
//! AVX-512 VNNI's `VPDPBUSD` (`avx512_vnni.rs`, 64 products a instruction), AVX-VNNI's
//! (`avx_vnni.rs`, 32) and plain AVX2 (`avx2.rs`: `VPMADDUBSW` on magnitudes and signs,
//! `VPMADDWD`). AMX and VNNI multiply unsigned by signed bytes, so the left operand is
//! stored offset by 128 (`q + 128`, in `1..=255`) and `128 · Σ_k q_b` is taken off each
//! column's sums ([`Panels::comp`]); AVX2 undoes the offset in its registers.
//!
//! Every result element is one exact integer sum, whatever the threads and the
//! instructions: a product gives the same bits on every run, machine and thread count.
//!
//! No well-kept crate multiplies int8 matrices on stable Rust (the `gemm` crate's kernels
//! are floating point), so the kernels are written here, one file per instruction family,
//! and tested against the f64 sums of the quantized operands (`tests.rs`).

use rayon::prelude::*;

use crate::float16::Rhs;
use crate::int16::{f32_member, relu};
use crate::{Mat, Member};
mod amx;
mod avx2;
mod avx512_vnni;
mod avx_vnni;
mod quantize;
#[cfg(test)]
mod tests;

use quantize::*;

/// The largest magnitude after scaling.
pub(crate) const LIMIT: f32 = 127.0;
/// The longest `k` summed in int32: the VNNI sums of the offset operand, at most
/// `k · 255 · 127`, stay below `2³¹`.
pub(crate) const K_MAX: usize = 65536;
const _: () = assert!((K_MAX as u64) * 255 * 127 < 1 << 31);
/// A row or column whose largest magnitude is below this is quantized as zeros
/// (`127 / max` would not be a finite f32 for the smallest subnormals).
pub(crate) const TINY: f32 = 1e-30;
/// Rows of the left operand in one panel, and columns of the right one.
pub(crate) const MR: usize = 12;
pub(crate) const NR: usize = 32;
/// Values of `k` one 32-bit lane sums: the operands are stored in quads of `k`.
pub(crate) const QUAD: usize = 4;

/// The instructions that run the products here, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Intel AMX's `TDPBUSD` on tiles (Xeons of the 4th generation on).
    Amx,
    /// AVX-512 VNNI's `VPDPBUSD` on 512 bits.
    Vnni512,
    /// AVX-VNNI's `VPDPBUSD` on 256 bits (CPUs with VNNI but no AVX-512).
    AvxVnni,
    /// AVX2's `VPMADDUBSW` and `VPMADDWD`.
    Avx2,
}

impl Isa {
    /// The best this CPU has, or `None` without AVX2.
    pub(crate) fn best() -> Option<Isa> {
        if amx::available() && Isa::vnni512() {
            Some(Isa::Amx)
        } else if Isa::vnni512() {
            Some(Isa::Vnni512)
        } else if is_x86_feature_detected!("avxvnni") && is_x86_feature_detected!("avx2") {
            Some(Isa::AvxVnni)
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            Some(Isa::Avx2)
        } else {
            None
        }
    }

    /// AVX-512 F, BW and VNNI (which the tiles' results are stored with, too).
    fn vnni512() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// Whether this CPU runs it.
    #[cfg(test)]
    pub(crate) fn runs_here(self) -> bool {
        match self {
            Isa::Amx => Isa::best() == Some(Isa::Amx),
            Isa::Vnni512 => Isa::vnni512(),
            Isa::AvxVnni => is_x86_feature_detected!("avxvnni") && is_x86_feature_detected!("avx2"),
            Isa::Avx2 => Isa::best().is_some(),
        }
    }
}

/// Whether this CPU runs the int8 products (AVX2 at least).
pub(crate) fn available() -> Result<(), &'static str> {
    Isa::best()
        .map(|_| ())
        .ok_or("this CPU has no AVX2, which the int8 products need at least")
}

/// Quads of `k` a row or column holds: `k` rounded up to whole tile steps (16 quads, 64
/// values; zeros past `k`).
pub(crate) fn quads(k: usize) -> usize {
    k.div_ceil(QUAD).next_multiple_of(amx::QUADS)
}

/// `max / 127` and `127 / max` of a row or column whose largest magnitude is `max`
/// (zeros below [`TINY`]).
pub(crate) fn scales(max: f32) -> (f32, f32) {
    if max < TINY {
        (0.0, 0.0)
    } else {
        (max / LIMIT, LIMIT / max)
    }
}

/// A right operand `[k, n]` quantized once, for the products that read it while it is
/// unchanged (an inference program's weights): its panels of [`NR`] columns, `ld` quads
/// a column (`k` rounded up to quads, zero past `k`, zero columns past `n`), the
/// columns' `max / 127` and `128 · Σ_k q` (what the offset left operand adds to each
/// column's VNNI sums).
pub(crate) struct Panels {
    pub(crate) k: usize,
    pub(crate) n: usize,
    pub(crate) ld: usize,
    pub(crate) q: Vec<i8>,
    pub(crate) inv: Vec<f32>,
    pub(crate) comp: Vec<i32>,
}

impl Panels {
    /// `b` (`k × n`, any strides) quantized over rayon's threads; `None` where a column
    /// holds an infinity or a NaN, or `k` is 0 or above [`K_MAX`].
    ///
    /// # Safety
    /// `b` must address `k × n` valid elements.
    pub(crate) unsafe fn new(b: Mat, (k, n): (usize, usize)) -> Option<Panels> {
        if k == 0 || k > K_MAX || n == 0 {
            return None;
        }
        // SAFETY: as the caller's.
        unsafe { quantize_columns(b, (k, n)) }
    }

    /// Whether it is a quantized `[k, n]` operand.
    pub(crate) fn is(&self, (k, n): (usize, usize)) -> bool {
        (self.k, self.n) == (k, n)
    }

    /// Its size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.q.len() + self.inv.len() * 4 + self.comp.len() * 4
    }
}

/// `dst[m, n] (row stride ld) = (read_dst ? dst : 0) + a[m, k]·b[k, n]`, then the
/// [`crate::Epilogue`], with int8 operands (see the module's comment). Column sums are not
/// taken: a member that asks for them, or whose operands hold an infinity or a NaN, goes
/// to the f32 kernel.
///
/// # Safety
/// As [`gemm_group`]'s for the one member.
pub(crate) unsafe fn gemm(m: usize, k: usize, a: Mat, member: Member<'_>) {
    // SAFETY: as the caller's.
    unsafe { gemm_group((m, k), a, std::slice::from_ref(&member)) }
}

/// The products `a·b` of every member (see [`Member`]), each as [`gemm`] computes it
/// alone, with `a` (`m × k`) quantized once for all.
///
/// # Safety
/// [`available`] must have returned `Ok`; as [`crate::gemm_one`] for each member, whose
/// bias holds `n` values; no member's result overlaps another's, `a`, or any member's
/// `b` or bias.
pub(crate) unsafe fn gemm_group((m, k): (usize, usize), a: Mat, members: &[Member<'_>]) {
    let Some(isa) = Isa::best() else {
        // SAFETY: as the caller's.
        return members
            .iter()
            .for_each(|mb| unsafe { f32_member((m, k), a, mb) });
    };
    // SAFETY: as the caller's.
    unsafe { gemm_group_with(isa, (m, k), a, members) }
}

thread_local! {
    /// The quantized left operand's buffer, kept between a thread's products (taken out
    /// while one runs, so that a product inside another allocates its own).
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A result pointer shared by the tasks, each writing its own columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// [`gemm_group`] on `isa`'s instructions (which the CPU must run).
///
/// # Safety
/// As [`gemm_group`]'s, and `isa.runs_here()`.
pub(crate) unsafe fn gemm_group_with(
    isa: Isa,
    (m, k): (usize, usize),
    a: Mat,
    members: &[Member<'_>],
) {
    // SAFETY (all `f32_member`s): as the caller's.
    let to_f32 = |mb: &Member<'_>| unsafe { f32_member((m, k), a, mb) };
    if m == 0 || k == 0 || k > K_MAX {
        return members.iter().for_each(to_f32);
    }
    let tiles = isa == Isa::Amx;
    // SAFETY: `a` addresses its elements (the caller's contract).
    let buf = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let Some(qa) = (unsafe { quantize_rows(a, (m, k), tiles, buf) }) else {
        return members.iter().for_each(to_f32);
    };
    // Each member's quantized `b`, made here or packed beforehand; `None`: the f32 kernel.
    let mut here: Vec<Option<Panels>> = Vec::with_capacity(members.len());
    for mb in members {
        here.push(match mb.b {
            Rhs::Mat(b) if mb.sums.is_none() && mb.n > 0 => {
                // SAFETY: `b` addresses its `k × n` elements.
                unsafe { Panels::new(b, (k, mb.n)) }
            }
            _ => None,
        });
    }
    let views: Vec<Option<&Panels>> = members
        .iter()
        .zip(&here)
        .map(|(mb, h)| match (mb.b, h) {
            (_, Some(p)) => Some(p),
            (Rhs::Packed(p, _), None) if mb.sums.is_none() => p.int8().filter(|p| p.is((k, mb.n))),
            _ => None,
        })
        .collect();
    let tasks = crate::mat::panel_tasks(&views, members, NR);
    let run = |&(i, t): &(usize, usize)| {
        let (mb, Some(p)) = (&members[i], views[i]) else {
            return;
        };
        let panel = &p.q[t * NR * QUAD * p.ld..(t + 1) * NR * QUAD * p.ld];
        let j0 = t * NR;
        let w = NR.min(mb.n - j0);
        let dst = Out(mb.dst.ptr);
        let finish = |r0: usize, rows: usize, acc: &[i32]| {
            let out = Block {
                inv_a: &qa.inv[r0..r0 + rows],
                inv_b: &p.inv[j0..j0 + w],
                comp: (isa != Isa::Avx2).then(|| &p.comp[j0..j0 + w]),
                // SAFETY: the caller's bias holds `n` values.
                bias: mb
                    .epilogue
                    .bias
                    .map(|b| unsafe { std::slice::from_raw_parts(b.add(j0), w) }),
                relu: mb.epilogue.relu,
            };
            // SAFETY: rows `r0..r0 + rows` and columns `j0..j0 + w` of the member's
            // result; each task writes only its own columns.
            unsafe {
                let d = dst.0.offset(r0 as isize * mb.dst.ld).add(j0);
                if matches!(isa, Isa::Vnni512 | Isa::Amx) {
                    avx512_vnni::store(acc, &out, d, mb.dst.ld, mb.dst.read)
                } else {
                    store(acc, &out, d, mb.dst.ld, mb.dst.read)
                }
            };
        };
        if tiles {
            let mut acc = [0i32; amx::ROWS * NR];
            // (The chunk of tasks this one belongs to configured the tiles: `chunks`.)
            for r0 in (0..m).step_by(amx::ROWS) {
                let rows = amx::ROWS.min(m - r0);
                // SAFETY: the tiles are configured on this thread; the rows' buffer holds
                // whole blocks of rows, the panel `ld` quads.
                unsafe {
                    amx::block(
                        qa.q[r0 * QUAD * qa.ld..].as_ptr(),
                        QUAD * qa.ld,
                        panel.as_ptr(),
                        p.ld,
                        &mut acc,
                    )
                };
                finish(r0, rows, &acc);
            }
            return;
        }
        let mut acc = [0i32; MR * NR];
        for r0 in (0..m).step_by(MR) {
            let rows = MR.min(m - r0);
            let a_panel = &qa.q[r0 * QUAD * qa.ld..(r0 + MR) * QUAD * qa.ld];
            // SAFETY: the CPU runs `isa` (the caller's); both panels hold `ld` quads.
            unsafe { tile(isa, (a_panel, rows), panel, p.ld, &mut acc) };
            finish(r0, rows, &acc);
        }
    };
    // A chunk of tasks a thread: the tiles are configured once a chunk (each
    // configuration and release cost as much as a few tile products).
    let threads = rayon::current_num_threads();
    let chunks = |chunk: &[(usize, usize)]| {
        if tiles {
            // SAFETY: the CPU has the tiles (the caller's).
            unsafe { amx::configure() };
        }
        chunk.iter().for_each(run);
        if tiles {
            // SAFETY: configured just above, on this thread.
            unsafe { amx::release() };
        }
    };
    if threads > 1 && tasks.len() > 1 {
        tasks
            .par_chunks(tasks.len().div_ceil(4 * threads))
            .for_each(chunks);
    } else {
        chunks(&tasks);
    }
    for (mb, v) in members.iter().zip(&views) {
        if v.is_none() && mb.n > 0 {
            to_f32(mb);
        }
    }
    SCRATCH.with(|s| *s.borrow_mut() = qa.q);
}

/// The int32 sums of the first `rows ≤ MR` rows of one [`MR`] × [`NR`] tile over `ld`
/// quads into `acc` (`acc[NR·r + j]`; at least those rows, the kernels work in groups),
/// on `isa`'s instructions: the VNNI families' include the offset (`128 · Σ q_b`),
/// AVX2's do not.
///
/// # Safety
/// The CPU must run `isa`; `a` must hold `MR · ld` quads, `b` `NR · ld`.
unsafe fn tile(isa: Isa, (a, rows): (&[u8], usize), b: &[i8], ld: usize, acc: &mut [i32; MR * NR]) {
    assert!(a.len() >= MR * QUAD * ld && b.len() >= NR * QUAD * ld && rows <= MR);
    let (a, b) = (a.as_ptr(), b.as_ptr());
    // SAFETY: as the caller's.
    unsafe {
        match isa {
            Isa::Vnni512 if rows <= 4 => avx512_vnni::tile::<4>(a, b, ld, acc),
            Isa::Vnni512 if rows <= 8 => avx512_vnni::tile::<8>(a, b, ld, acc),
            Isa::Vnni512 | Isa::Amx => avx512_vnni::tile::<MR>(a, b, ld, acc),
            Isa::AvxVnni => avx_vnni::tile(a, b, ld, rows, acc),
            Isa::Avx2 => avx2::tile(a, b, ld, rows, acc),
        }
    }
}

/// How a tile's sums become results: the rows' and columns' `max / 127`, the columns'
/// offsets to take off (VNNI), and the epilogue.
pub(crate) struct Block<'a> {
    pub(crate) inv_a: &'a [f32],
    pub(crate) inv_b: &'a [f32],
    pub(crate) comp: Option<&'a [i32]>,
    pub(crate) bias: Option<&'a [f32]>,
    pub(crate) relu: bool,
}

/// The tile's results written at `d` (row stride `ld`), or added to what it holds where
/// `read_dst`: `f32(S) · inv_a · inv_b`, then the bias and the ReLU.
///
/// # Safety
/// `d` must address the block's rows and columns.
unsafe fn store(acc: &[i32], b: &Block<'_>, d: *mut f32, ld: isize, read_dst: bool) {
    for (r, &ia) in b.inv_a.iter().enumerate() {
        // SAFETY: row `r` of the block holds its columns.
        let row =
            unsafe { std::slice::from_raw_parts_mut(d.offset(r as isize * ld), b.inv_b.len()) };
        let sums = &acc[NR * r..NR * r + b.inv_b.len()];
        for (j, (v, &s)) in row.iter_mut().zip(sums).enumerate() {
            let s = match b.comp {
                Some(c) => s.wrapping_sub(c[j]),
                None => s,
            };
            let mut x = s as f32 * ia * b.inv_b[j];
            if read_dst {
                x += *v;
            }
            if let Some(bias) = b.bias {
                x += bias[j];
            }
            if b.relu {
                x = relu(x);
            }
            *v = x;
        }
    }
}
