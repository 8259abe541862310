//! The replica.
