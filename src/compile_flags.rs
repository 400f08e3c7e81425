//! The flags of `kiln compile` that set the compiler's options
//! ([`kiln_compiler::options`], whose docs are their help).

use kiln_compiler::optimize::Target;
use kiln_compiler::options::{
    CompileOptions, Precision, BIAS_GRAD_FUSION_DOC, BUFFER_REUSE_DOC, CUDA_ARCH_DOC,
    PRECISION_DOC, PRODUCT_GROUPS_DOC, TARGET_DOC,
};
use kiln_dsl::Error;

use crate::plain;

#[derive(clap::Args, Clone, Debug)]
pub struct CompileFlags {
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"], help = TARGET_DOC)]
    pub target: String,
    #[arg(long = "cuda-arch", value_name = "SM", help = CUDA_ARCH_DOC)]
    pub cuda_arch: Option<String>,
    #[arg(long, default_value = "f32", value_parser = Precision::NAMES, help = PRECISION_DOC)]
    pub precision: String,
    #[arg(long = "no-buffer-reuse", help = BUFFER_REUSE_DOC)]
    pub no_buffer_reuse: bool,
    #[command(flatten)]
    pub fusions: FusionFlags,
}

/// The flags that turn off the fusions decided after extraction ([`kiln_compiler::fuse`]).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct FusionFlags {
    #[arg(long = "no-product-groups", help = PRODUCT_GROUPS_DOC)]
    pub no_product_groups: bool,
    #[arg(long = "no-bias-grad-fusion", help = BIAS_GRAD_FUSION_DOC)]
    pub no_bias_grad_fusion: bool,
}

impl FusionFlags {
    /// `opts` with these flags' fusions.
    pub fn apply(&self, opts: CompileOptions) -> CompileOptions {
        CompileOptions {
            product_groups: !self.no_product_groups,
            bias_grad_fusion: !self.no_bias_grad_fusion,
            ..opts
        }
    }
}

impl CompileFlags {
    /// The options these flags ask for, checked; target `cuda` without `--cuda-arch`
    /// compiles for [`kiln_compiler::codegen::cuda::DEFAULT_ARCH`].
    pub fn options(&self) -> Result<CompileOptions, Error> {
        let target = Target::parse(&self.target).unwrap_or(Target::Cpu);
        let cuda_arch = match target {
            Target::Cuda => Some(
                self.cuda_arch
                    .clone()
                    .unwrap_or_else(|| kiln_compiler::codegen::cuda::DEFAULT_ARCH.to_string()),
            ),
            Target::Cpu => self.cuda_arch.clone(),
        };
        let o = CompileOptions {
            target,
            cuda_arch,
            precision: Precision::parse(&self.precision).unwrap_or_default(),
            buffer_reuse: !self.no_buffer_reuse,
            ..Default::default()
        };
        let o = self.fusions.apply(o);
        o.check().map_err(|m| {
            plain(
                "kiln::compile",
                m,
                Some("see `kiln compile --help`".to_string()),
            )
        })?;
        Ok(o)
    }
}
