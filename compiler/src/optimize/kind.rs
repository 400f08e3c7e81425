//! The kinds of fused kernel: one variant per template the optimizer rewrites into.
//!
//! Every backend matches a template's kind exhaustively (the CLIF emitter, the CUDA C
//! emitter, the CPU launcher, the CUDA launcher), so adding a kind that one of them does
//! not handle is a compile error there, not a string that falls through at run time.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TemplateKind {
    /// `x @ w + b`.
    Linear,
    /// `relu(x @ w + b)`.
    LinearRelu,
    Softmax,
    /// `softmax(scale · s + mask)`.
    ScaleMaskSoftmax,
    /// `softmax(scale · q kᵀ + mask) v`, per head.
    Attention,
    /// The attention's gradients with respect to `q`, `k` and `v`.
    AttentionBwd,
    /// `layer_norm(x + y)`.
    AddLayerNorm,
    AddLayerNormBwd,
    /// Log-softmax and label-smoothed cross-entropy, with its gradient.
    XentLs,
    /// `embedding · scale + positions` (then dropout).
    EmbedPe,
    /// Sums over every leading axis (a bias gradient).
    SumRows,
    /// Rows added into a table at ids (an embedding's gradient).
    ScatterAddInto,
    /// One Adam step of a parameter and its moments.
    AdamUpdate,
}

impl TemplateKind {
    pub const ALL: [TemplateKind; 13] = [
        TemplateKind::Linear,
        TemplateKind::LinearRelu,
        TemplateKind::Softmax,
        TemplateKind::ScaleMaskSoftmax,
        TemplateKind::Attention,
        TemplateKind::AttentionBwd,
        TemplateKind::AddLayerNorm,
        TemplateKind::AddLayerNormBwd,
        TemplateKind::XentLs,
        TemplateKind::EmbedPe,
        TemplateKind::SumRows,
        TemplateKind::ScatterAddInto,
        TemplateKind::AdamUpdate,
    ];

    /// The kind's name in kernel graphs, manifests and reports.
    pub fn name(self) -> &'static str {
        match self {
            TemplateKind::Linear => "linear",
            TemplateKind::LinearRelu => "linear_relu",
            TemplateKind::Softmax => "softmax",
            TemplateKind::ScaleMaskSoftmax => "scale_mask_softmax",
            TemplateKind::Attention => "attention",
            TemplateKind::AttentionBwd => "attention_bwd",
            TemplateKind::AddLayerNorm => "add_layer_norm",
            TemplateKind::AddLayerNormBwd => "add_layer_norm_bwd",
            TemplateKind::XentLs => "xent_ls",
            TemplateKind::EmbedPe => "embed_pe",
            TemplateKind::SumRows => "sum_rows",
            TemplateKind::ScatterAddInto => "scatter_add_into",
            TemplateKind::AdamUpdate => "adam_update",
        }
    }

    /// The kind of a name ([`TemplateKind::name`]).
    pub fn parse(name: &str) -> Option<TemplateKind> {
        TemplateKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_parse_back() {
        let mut seen = std::collections::BTreeSet::new();
        for k in TemplateKind::ALL {
            assert!(seen.insert(k.name()), "{} twice", k.name());
            assert_eq!(TemplateKind::parse(k.name()), Some(k));
        }
        assert_eq!(TemplateKind::parse("matmul"), None);
    }
}
