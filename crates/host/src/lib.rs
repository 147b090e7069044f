//! The process edge of ferry's roles, shared by the `ferry` binary and the
//! benchmarks: what binds real sockets, opens and locks real directories,
//! and serves a node's HTTP endpoint. The nodes themselves are assembled in
//! `ferry-node` from seams; this crate plugs in the real implementations.
//!
//! Its errors are for the person running the process (`anyhow`, with the
//! path or address at fault), like the binary's.

/// Prints a line to stdout, ignoring a closed stdout (a supervisor that stopped
/// reading must not turn a clean shutdown into a panic).
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

pub mod api;
pub mod cluster;
pub mod http;
pub mod local;
pub mod lockfile;
pub mod metrics;
pub mod paths;
pub mod reads;
pub mod signals;

/// S3 settings from the process environment (`AWS_ENDPOINT_URL`,
/// `AWS_REGION`, credentials, ...): the one place the environment is read
/// for object storage; libraries take the settings as data.
pub fn s3_settings_from_env() -> ferry_storage::S3Settings {
    ferry_storage::S3Settings::default().with_aws_env(std::env::vars())
}
