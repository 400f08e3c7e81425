//! The flags of `kiln compile` that set the compiler's options
//! ([`kiln_compiler::options`], whose docs are their help).

use kiln_compiler::optimize::Target;
use kiln_compiler::options::{
    CompileOptions, Precision, BUFFER_REUSE_DOC, CUDA_ARCH_DOC, PRECISION_DOC, TARGET_DOC,
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
        };
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
