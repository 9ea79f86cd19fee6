//! Subcommands of the `volring` binary that live outside main.rs.

pub mod nbd;
