//! kiln-runtime (written next)
