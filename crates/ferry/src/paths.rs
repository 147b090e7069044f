//! Directories given on the command line, checked with messages a user can act
//! on: an empty value names the flag and variable it came from, a file where a
//! directory is expected says so, every I/O error names its path.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Creates `dir` and its parents unless it exists; a file in its place is an
/// error that says so.
pub fn create_dir(dir: &Path) -> anyhow::Result<()> {
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => anyhow::bail!("{} exists and is not a directory", dir.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the directory {}", dir.display())),
        Err(e) => Err(e).with_context(|| format!("checking {}", dir.display())),
    }
}

/// Checks a data dir argument without touching the file system beyond looking:
/// not empty, and not an existing non-directory.
pub fn check_data_dir(dir: &Path, flag: &str, env: &str) -> anyhow::Result<PathBuf> {
    if dir.as_os_str().is_empty() {
        anyhow::bail!(
            "the data dir is empty: set {flag} or the environment variable {env} to a directory"
        );
    }
    if let Ok(meta) = std::fs::metadata(dir) {
        if !meta.is_dir() {
            anyhow::bail!(
                "the data dir {} exists and is not a directory",
                dir.display()
            );
        }
    }
    Ok(dir.to_path_buf())
}

/// Creates the data dir if needed and returns its absolute path.
pub fn absolute(dir: &Path) -> anyhow::Result<PathBuf> {
    create_dir(dir)?;
    dir.canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))
}
