//! The workspace's house rules that no compiler checks by itself.

#![allow(clippy::disallowed_methods)] // reads the workspace's files

use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/testkit lies two levels below the workspace root")
        .to_path_buf()
}

fn crates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(workspace_root().join("crates"))
        .expect("crates/")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").exists())
        .collect();
    out.sort();
    out
}

/// One clippy.toml at the root holds the seam rule (clippy looks for it
/// from each crate's folder upwards, so a crate's own file would shadow
/// it), and only the crates at the edge opt out of it, in their manifest.
#[test]
fn one_clippy_config_and_only_edge_crates_opt_out_of_the_seam_rule() {
    let root = workspace_root();
    let rules = std::fs::read_to_string(root.join("clippy.toml")).expect("root clippy.toml");
    assert!(rules.contains("std::time::Instant::now") && rules.contains("std::fs::File"));
    let mut opted_out = Vec::new();
    for krate in crates() {
        assert!(
            !krate.join("clippy.toml").exists() && !krate.join(".clippy.toml").exists(),
            "{} has its own clippy config, which hides the root one",
            krate.display()
        );
        let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).expect("manifest");
        if manifest.contains("disallowed_methods = \"allow\"")
            || manifest.contains("disallowed_types = \"allow\"")
        {
            opted_out.push(
                krate
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .unwrap_or_default(),
            );
        }
    }
    assert_eq!(
        opted_out,
        ["bench", "client", "env", "ferry", "host"],
        "crates outside the seam rule"
    );
}
