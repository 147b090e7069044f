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

/// A size in bytes as flags give it: a number with an optional unit of
/// `B`, `KiB`, `MiB`, `GiB` or `TiB` (`512MiB`, `2GiB`, `1048576`).
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB or TiB)"
            ))
        }
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 512MiB, 2GiB)"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod size_tests {
    use super::parse_byte_size;

    #[test]
    fn sizes_parse_with_binary_units_and_refuse_the_rest() {
        assert_eq!(parse_byte_size("0"), Ok(0));
        assert_eq!(parse_byte_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_byte_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_byte_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_byte_size("3 KiB"), Ok(3 << 10));
        assert!(parse_byte_size("1GB").is_err());
        assert!(parse_byte_size("MiB").is_err());
        assert!(parse_byte_size("-1").is_err());
        assert!(parse_byte_size("99999999999TiB").is_err());
    }
}
