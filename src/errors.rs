//! The command line's errors: a code, a message and the fix, as every crate's are.

use kiln_compiler::tensor::TensorFileError;
use kiln_dsl::Error;
use kiln_exec::RuntimeError;

pub(crate) fn plain(code: &'static str, message: String, help: Option<String>) -> Error {
    Error::plain(code, message, help)
}

pub(crate) fn file_error(e: TensorFileError) -> Error {
    plain("kiln::file", e.to_string(), None)
}

pub(crate) fn runtime_error(e: RuntimeError) -> Error {
    plain("kiln::run", e.message, Some(e.help))
}

/// An error of `code` from any displayable error (`.map_err(err("kiln::train"))`).
pub fn err<E: std::fmt::Display>(code: &'static str) -> impl Fn(E) -> Error {
    move |e| plain(code, e.to_string(), None)
}
