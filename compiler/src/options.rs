//! The options of a compilation, declared once.
//!
//! Each option has a name, a type, a default and a one-line doc ([`OPTIONS`]). `kiln
//! compile` sets them by flags (whose help is the doc below), an artifact's manifest
//! records them, and `kiln inspect` prints them. The passes take them as values: nothing
//! here, or in any pass, reads the environment, so the same graph and options give the
//! same program, byte for byte.

use serde::{Deserialize, Serialize};

use crate::optimize::Target;

/// The arithmetic of an artifact's program: the CUDA program's, or `int8` for a CPU
/// inference artifact's weight products. (Otherwise the CPU program is f32; its matrix
/// products may run with 16-bit operands, a choice of the run: `--gemm-type`.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 everywhere, the GEMMs pedantic (no TF32).
    #[default]
    F32,
    /// f32 activations; the GEMMs round their operands to TF32.
    Tf32,
    /// f32 activations; the GEMMs take bf16 operands and sum in f32.
    Bf16,
    /// bf16 activations and GEMM operands, f32 sums, f32 master weights, Adam and loss
    /// (the CUDA program is generated for it).
    Mixed,
    /// Target cpu, inference: the products of a weight run with int8 operands (the weight
    /// per output channel, the activation per row at run time) and exact int32 sums, as
    /// CTranslate2's int8; everything else f32 (`kiln_matmul::int8`).
    Int8,
}

impl Precision {
    pub const NAMES: [&'static str; 5] = ["f32", "tf32", "bf16", "mixed", "int8"];

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Mixed => "mixed",
            Precision::Int8 => "int8",
        }
    }

    pub fn parse(s: &str) -> Option<Precision> {
        Precision::NAMES
            .iter()
            .position(|n| *n == s)
            .map(|i| [Self::F32, Self::Tf32, Self::Bf16, Self::Mixed, Self::Int8][i])
    }
}

/// What one compilation is for and how it is done.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompileOptions {
    /// The machine the cost model and the code are for.
    pub target: Target,
    /// Target `cuda`: the GPU architecture NVRTC compiles for (`sm_90`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_arch: Option<String>,
    /// Target `cuda`: the CUDA program's arithmetic.
    pub precision: Precision,
    /// The memory plan shares arena slots and writes results over dying operands.
    pub buffer_reuse: bool,
    /// Consecutive products of one left operand form a group ([`crate::fuse`]).
    pub product_groups: bool,
    /// Bias gradients are paired with their weight gradient's product ([`crate::fuse`]).
    pub bias_grad_fusion: bool,
}

impl Default for CompileOptions {
    fn default() -> CompileOptions {
        CompileOptions {
            target: Target::Cpu,
            cuda_arch: None,
            precision: Precision::F32,
            buffer_reuse: true,
            product_groups: true,
            bias_grad_fusion: true,
        }
    }
}

/// One declared option: its name (the flag is `--NAME` with `-` for `_`), its default and
/// what it does.
#[derive(Clone, Copy, Debug)]
pub struct OptionInfo {
    pub name: &'static str,
    pub default: &'static str,
    pub doc: &'static str,
}

pub const TARGET_DOC: &str = "the machine the program is for: cpu, or cuda (its CUDA C as well as \
     the CLIF every machine runs)";
pub const CUDA_ARCH_DOC: &str =
    "target cuda: the GPU architecture NVRTC compiles for (sm_90: H100/H200, sm_80: A100)";
pub const PRECISION_DOC: &str = "target cuda: f32 (pedantic GEMMs), tf32 or bf16 (the GEMMs' \
     operands), or mixed (bf16 activations, f32 master weights); target cpu: f32, or int8 \
     (inference: the weights' products with int8 operands and int32 sums)";
pub const BUFFER_REUSE_DOC: &str =
    "whether the memory plan shares arena slots and writes results in place (off: for debugging)";

pub const PRODUCT_GROUPS_DOC: &str = "whether consecutive products of one left operand run as \
     one group that reads it once (off: each on its own, for comparisons)";
pub const BIAS_GRAD_FUSION_DOC: &str = "whether a bias gradient is summed by its layer's \
     weight-gradient product as it reads the output gradient (off: a kernel of its own)";

/// Every option, in the order `kiln inspect` prints them.
pub const OPTIONS: [OptionInfo; 6] = [
    OptionInfo {
        name: "target",
        default: "cpu",
        doc: TARGET_DOC,
    },
    OptionInfo {
        name: "cuda_arch",
        default: crate::codegen::cuda::DEFAULT_ARCH,
        doc: CUDA_ARCH_DOC,
    },
    OptionInfo {
        name: "precision",
        default: "f32",
        doc: PRECISION_DOC,
    },
    OptionInfo {
        name: "buffer_reuse",
        default: "true",
        doc: BUFFER_REUSE_DOC,
    },
    OptionInfo {
        name: "product_groups",
        default: "true",
        doc: PRODUCT_GROUPS_DOC,
    },
    OptionInfo {
        name: "bias_grad_fusion",
        default: "true",
        doc: BIAS_GRAD_FUSION_DOC,
    },
];

impl CompileOptions {
    /// Each option of [`OPTIONS`] with its value here (`-` where it does not apply).
    pub fn values(&self) -> Vec<(&'static OptionInfo, String)> {
        OPTIONS
            .iter()
            .map(|o| {
                let v = match o.name {
                    "target" => self.target.name().to_string(),
                    "cuda_arch" => self.cuda_arch.clone().unwrap_or_else(|| "-".to_string()),
                    "precision" => self.precision.name().to_string(),
                    "buffer_reuse" => self.buffer_reuse.to_string(),
                    "product_groups" => self.product_groups.to_string(),
                    _ => self.bias_grad_fusion.to_string(),
                };
                (o, v)
            })
            .collect()
    }

    /// Options that contradict each other, as a sentence that says the fix.
    pub fn check(&self) -> Result<(), String> {
        match (self.target, &self.cuda_arch, self.precision) {
            (Target::Cpu, Some(a), _) => Err(format!(
                "--cuda-arch {a} is for target cuda, but the target is cpu; give --target cuda"
            )),
            (Target::Cpu, None, p) if !matches!(p, Precision::F32 | Precision::Int8) => {
                Err(format!(
                    "--precision {} is the CUDA program's, but the target is cpu (whose \
                     products run in 16 bits with `--gemm-type` at run time); give --target \
                     cuda",
                    p.name()
                ))
            }
            (Target::Cuda, _, Precision::Int8) => Err(
                "--precision int8 is for the CPU's products, but the target is cuda; give \
                 --target cpu, or --precision bf16 or mixed for the GPU"
                    .to_string(),
            ),
            (Target::Cuda, None, _) => {
                Err("target cuda needs a GPU architecture; give --cuda-arch sm_XY".to_string())
            }
            (Target::Cuda, Some(a), _) if !is_cuda_arch(a) => Err(format!(
                "`{a}` is not a CUDA architecture; give --cuda-arch sm_XY, e.g. sm_90 (H100) \
                 or sm_80 (A100)"
            )),
            _ => Ok(()),
        }
    }
}

/// `sm_` and two or more digits.
fn is_cuda_arch(a: &str) -> bool {
    let digits = a.strip_prefix("sm_").unwrap_or("");
    digits.len() >= 2 && digits.chars().all(|c| c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_has_a_value_and_names_parse_back() {
        let o = CompileOptions {
            target: Target::Cuda,
            cuda_arch: Some("sm_90".to_string()),
            precision: Precision::Mixed,
            buffer_reuse: false,
            product_groups: true,
            bias_grad_fusion: false,
        };
        let v: Vec<(String, String)> = o
            .values()
            .into_iter()
            .map(|(i, v)| (i.name.to_string(), v))
            .collect();
        assert_eq!(
            v,
            [
                ("target", "cuda"),
                ("cuda_arch", "sm_90"),
                ("precision", "mixed"),
                ("buffer_reuse", "false"),
                ("product_groups", "true"),
                ("bias_grad_fusion", "false")
            ]
            .map(|(a, b)| (a.to_string(), b.to_string()))
        );
        for n in Precision::NAMES {
            assert_eq!(Precision::parse(n).map(Precision::name), Some(n));
        }
        assert_eq!(Precision::parse("fp16"), None);
        assert!(o.check().is_ok());
        let json = serde_json::to_string(&o).unwrap();
        assert_eq!(
            json,
            r#"{"target":"Cuda","cuda_arch":"sm_90","precision":"mixed","buffer_reuse":false,"product_groups":true,"bias_grad_fusion":false}"#
        );
        assert_eq!(serde_json::from_str::<CompileOptions>(&json).unwrap(), o);
    }

    #[test]
    fn contradicting_options_are_refused_with_the_fix() {
        let cpu = CompileOptions::default();
        assert!(cpu.check().is_ok());
        let mixed_cpu = CompileOptions {
            precision: Precision::Mixed,
            ..cpu.clone()
        };
        assert!(mixed_cpu
            .check()
            .unwrap_err()
            .contains("give --target cuda"));
        // int8 is the CPU's inference precision: taken there, refused for the GPU.
        let int8 = CompileOptions {
            precision: Precision::Int8,
            ..cpu.clone()
        };
        assert!(int8.check().is_ok());
        let int8_cuda = CompileOptions {
            target: Target::Cuda,
            cuda_arch: Some("sm_90".to_string()),
            ..int8
        };
        let e = int8_cuda.check().unwrap_err();
        assert!(
            e.contains("--precision int8 is for the CPU's products") && e.contains("--target cpu"),
            "{e}"
        );
        let bad_arch = CompileOptions {
            target: Target::Cuda,
            cuda_arch: Some("90".to_string()),
            ..cpu
        };
        assert!(bad_arch
            .check()
            .unwrap_err()
            .contains("is not a CUDA architecture"));
    }
}
