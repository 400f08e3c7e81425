//! The shared arrays of the flash kernels, one table per kernel: the kernels declare
//! them from it and [`super::shared_bytes`] sums it, so a tile's size and what the
//! kernel declares cannot disagree.

use super::Part;
use crate::codegen::cuda::text::W;

/// A shared array's length in 4-byte elements, for tiles of `T` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::codegen::cuda) enum Size {
    /// One element a row: `T`.
    Row,
    /// `n` elements a row: `T * n`.
    Rows(usize),
    /// A `T × T` tile of scores, rows padded to `T + 1`.
    Scores,
}

impl Size {
    fn c(self) -> String {
        match self {
            Size::Row => "T".into(),
            Size::Rows(n) => format!("T * {n}"),
            Size::Scores => "T * (T + 1)".into(),
        }
    }

    fn elements(self, t: usize) -> usize {
        match self {
            Size::Row => t,
            Size::Rows(n) => t * n,
            Size::Scores => t * (t + 1),
        }
    }
}

/// One shared array: its name, its C element type (`float`, or `unsigned` for words of
/// bf16 pairs) and its length.
pub(in crate::codegen::cuda) type Shared = (&'static str, &'static str, Size);

/// Declares `T` and the arrays, in the table's order.
pub(in crate::codegen::cuda) fn declare(w: &mut W, t: usize, arrays: &[Shared]) {
    w.l(format!("enum {{ T = {t} }};"));
    for (name, ty, size) in arrays {
        w.l(format!("__shared__ {ty} {name}[{}];", size.c()));
    }
}

/// The arrays' bytes with tiles of `t` rows.
pub(in crate::codegen::cuda) fn bytes(t: usize, arrays: &[Shared]) -> usize {
    4 * arrays.iter().map(|a| a.2.elements(t)).sum::<usize>()
}

/// Which kernels: the CUDA cores' (float tiles, rows padded by one element) or the
/// tensor cores' (operand tiles as words of bf16 pairs, rows of [`word_pitch`] words,
/// and the probabilities and score gradients as words too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::codegen::cuda) enum Cores {
    Cuda,
    Tensor,
}

impl Cores {
    /// What `part`'s kernel on these cores does, as its opening comment says it.
    pub(in crate::codegen::cuda) fn what(self, part: Part) -> &'static str {
        match (self, part) {
            (Cores::Cuda, Part::Forward) => "forward",
            (Cores::Cuda, Part::BackwardQ) => "backward, query side",
            (Cores::Cuda, Part::BackwardKv) => "backward, key side",
            (Cores::Cuda, Part::Short) => "backward in one block per head",
            (Cores::Tensor, Part::Forward) => "forward on tensor cores",
            (Cores::Tensor, Part::BackwardQ) => "backward on tensor cores, query side",
            (Cores::Tensor, Part::BackwardKv) => "backward on tensor cores, key side",
            (Cores::Tensor, Part::Short) => "backward on tensor cores, one block per head",
        }
    }
}

/// Words a row of `d` bf16 takes in the tensor cores' tiles: `d/2` pairs and 4 of
/// padding, so that the eight rows a fragment load touches fall in distinct banks.
pub(in crate::codegen::cuda) fn word_pitch(d: usize) -> usize {
    d / 2 + 4
}

/// The shared arrays of `part`'s kernel with tiles of `t` rows: the staged operands, the
/// tensor cores' word tiles, then the float tiles.
pub(in crate::codegen::cuda) fn arrays(
    cores: Cores,
    part: Part,
    t: usize,
    (dk, dv): (usize, usize),
) -> Vec<Shared> {
    let tensor = cores == Cores::Tensor;
    let operand = |name, d| match cores {
        Cores::Cuda => (name, "float", Size::Rows(d + 1)),
        Cores::Tensor => (name, "unsigned", Size::Rows(word_pitch(d))),
    };
    let staged: &[(&'static str, usize)] = match (part, cores) {
        (Part::Forward, _) => &[("qs", dk), ("ks", dk), ("vs", dv)],
        (Part::BackwardKv, Cores::Cuda) => &[("ks", dk), ("vs", dv), ("qs", dk), ("gs", dv)],
        (Part::BackwardKv, Cores::Tensor) => &[("ks", dk), ("qs", dk), ("vs", dv), ("gs", dv)],
        _ => &[("qs", dk), ("ks", dk), ("vs", dv), ("gs", dv)],
    };
    let words: &[&'static str] = match part {
        _ if !tensor => &[],
        Part::Forward => &["ps"],
        Part::BackwardQ => &["ps", "dw"],
        Part::BackwardKv | Part::Short => &["pw", "dw"],
    };
    use Size::{Row, Rows, Scores};
    let floats: Vec<(&'static str, Size)> = match part {
        Part::Forward => vec![
            ("ss", Scores),
            ("os", Rows(dv)),
            ("ms", Row),
            ("ls", Row),
            ("as_", Row),
        ],
        Part::BackwardQ => {
            let mut f = vec![
                ("ss", Scores),
                ("os", Rows(dk.max(dv))),
                ("ms", Row),
                ("ls", Row),
                ("as_", Row),
                ("ds", Row),
            ];
            if tensor {
                f.insert(1, ("dss", Scores));
            }
            f
        }
        Part::BackwardKv => vec![
            ("ps", Scores),
            ("dss", Scores),
            ("dks", Rows(dk)),
            ("dvs", Rows(dv)),
            ("st", Rows(3)),
        ],
        Part::Short => vec![("ps", Scores), ("dss", Scores), ("ds", Row)],
    };
    let staged = staged.iter().map(|&(name, d)| operand(name, d));
    let words = words
        .iter()
        .map(|&name| (name, "unsigned", Rows(word_pitch(t))));
    let floats = floats.into_iter().map(|(name, size)| (name, "float", size));
    staged.chain(words).chain(floats).collect()
}
