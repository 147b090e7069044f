//! The simulator's command line as users run it.

use std::process::Command;

const FERRY_SIM: &str = env!("CARGO_BIN_EXE_ferry-sim");

#[test]
fn simulation_runs_seeds_and_replays_one_identically() {
    let out = Command::new(FERRY_SIM)
        .args(["wal", "--seeds", "5", "--start-seed", "100"])
        .output()
        .expect("run sim");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("5 seeds in") && stdout.contains("seeds/s") && stdout.contains("0 failed"),
        "{stdout}"
    );

    let replay = || {
        let out = Command::new(FERRY_SIM)
            .args(["wal", "--seed", "103", "--log"])
            .output()
            .expect("replay");
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = replay();
    assert!(first.contains("elected in term"), "{first}");
    assert!(first.contains("seed 103: ok"), "{first}");
    assert_eq!(first, replay(), "one seed, one event log");
}
