//! kiln-dsl (written next)
