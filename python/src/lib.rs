//! `kiln._kiln`: the Rust side of kiln's Python package (PyO3). The Python side
//! (`python/kiln/__init__.py`) wraps it: NumPy arrays in and out, dictionaries, docs.
//!
//! Modules:
//! - [`translate`] — `Translator`: a trained model translating and scoring text;
//! - [`spec`] — `check`, `compile` and `compile_model`: the compiler on a spec or a
//!   trained model;
//! - [`model`] — `Model`: one entry point of a compiled artifact run on tensors.
//!
//! Every kiln error is raised as `kiln.KilnError`, with the diagnostic's `code`, `help`
//! and, where it points into a spec, its `file`, `line` and `column`. The GIL is released
//! while kiln computes.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

mod model;
mod spec;
mod translate;

pyo3::create_exception!(
    _kiln,
    KilnError,
    PyException,
    "An error of kiln: the message, and the attributes `code` (`kiln::type`), `help` (the \
     fix, or None), `file`, `line` and `column` (where in a spec, or None), `rendered` (the \
     diagnostic as the command line prints it)."
);

/// A kiln error as a `KilnError` with its code, help and place.
pub(crate) fn kiln_error(e: kiln_dsl::Error) -> PyErr {
    Python::attach(|py| {
        let err = KilnError::new_err(e.message().to_string());
        let v = err.value(py);
        let loc = e.location();
        let set = |name: &str, value: Bound<'_, PyAny>| {
            // Setting an attribute of a fresh exception cannot fail.
            let _ = v.setattr(name, value);
        };
        set("code", e.code_str().into_pyobject(py).unwrap().into_any());
        set("help", e.help_text().into_pyobject(py).unwrap().into_any());
        set(
            "file",
            loc.map(|l| l.file.clone())
                .into_pyobject(py)
                .unwrap()
                .into_any(),
        );
        set(
            "line",
            loc.map(|l| l.line).into_pyobject(py).unwrap().into_any(),
        );
        set(
            "column",
            loc.map(|l| l.column).into_pyobject(py).unwrap().into_any(),
        );
        set(
            "rendered",
            e.render(false).into_pyobject(py).unwrap().into_any(),
        );
        err
    })
}

/// A plain kiln error (no place in a spec) as a `KilnError`.
pub(crate) fn plain_error(code: &'static str, message: String) -> PyErr {
    kiln_error(kiln_dsl::Error::plain(code, message, None))
}

/// Sizes kiln's thread pool once per process (`threads` 0 or None: one per core); a
/// later call asking for another size is an error, since the pool cannot change.
pub(crate) fn set_threads(threads: Option<usize>) -> PyResult<()> {
    let Some(n) = threads.filter(|&n| n > 0) else {
        return Ok(());
    };
    if rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .is_err()
        && rayon::current_num_threads() != n
    {
        return Err(plain_error(
            "kiln::threads",
            format!(
                "kiln already runs on {} threads in this process, so it cannot take {n}: give \
                 the same `threads` (or none) to every Translator",
                rayon::current_num_threads()
            ),
        ));
    }
    Ok(())
}

#[pymodule]
fn _kiln(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KilnError", m.py().get_type::<KilnError>())?;
    m.add_class::<translate::Translator>()?;
    m.add_class::<model::Model>()?;
    m.add_function(wrap_pyfunction!(spec::check, m)?)?;
    m.add_function(wrap_pyfunction!(spec::compile, m)?)?;
    m.add_function(wrap_pyfunction!(spec::compile_model, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
