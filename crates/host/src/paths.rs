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

/// The data dir from `--data-dir`, else from the environment variable `env`,
/// else `default`, checked without touching the file system beyond looking: not
/// empty (the message names where the empty value came from), and not an
/// existing non-directory.
pub fn data_dir(
    flag: Option<&Path>,
    env: &str,
    default: Option<PathBuf>,
) -> anyhow::Result<PathBuf> {
    let dir = match (flag, std::env::var_os(env)) {
        (Some(dir), _) if dir.as_os_str().is_empty() => {
            anyhow::bail!("--data-dir is empty: give it a directory")
        }
        (Some(dir), _) => dir.to_path_buf(),
        (None, Some(value)) if value.is_empty() => anyhow::bail!(
            "the environment variable {env} is set but empty: set it to a directory, or unset it"
        ),
        (None, Some(value)) => PathBuf::from(value),
        (None, None) => default.ok_or_else(|| {
            anyhow::anyhow!("no data dir: pass --data-dir or set the environment variable {env}")
        })?,
    };
    check_data_dir(&dir)
}

fn check_data_dir(dir: &Path) -> anyhow::Result<PathBuf> {
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

/// The export roots a node was given, or `<data dir>/lake` without any.
pub fn export_roots(
    given: &[std::path::PathBuf],
    data_dir: &std::path::Path,
) -> anyhow::Result<ferry_storage::LocalRoots> {
    let roots = if given.is_empty() {
        vec![data_dir.join("lake")]
    } else {
        given.to_vec()
    };
    ferry_storage::LocalRoots::new(roots.iter().cloned()).map_err(|e| {
        anyhow::anyhow!(
            "export roots {}: {e}",
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}
