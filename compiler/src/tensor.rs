//! (placeholder, written next)
