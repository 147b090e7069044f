//! `ferry dev` as a child process of a benchmark: started on a data dir of
//! its own with an ephemeral HTTP port, stopped (SIGINT, then SIGKILL) when
//! dropped, and its CPU time and memory read from /proc, so that what the
//! server spends is measured apart from the client.

use std::io::BufRead as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A running `ferry dev`.
pub struct Dev {
    child: Child,
    /// `http://host:port` of its API.
    pub url: String,
}

impl Dev {
    /// Starts `ferry dev --http 127.0.0.1:0 --data-dir <data> <extra...>` and
    /// waits until it says it is ready; its log goes to `<data>.log`.
    pub fn start(data: &Path, extra: &[String]) -> anyhow::Result<Dev> {
        let exe = std::env::current_exe().context("the ferry binary")?;
        let log = std::fs::File::create(data.with_extension("log"))?;
        let mut child = Command::new(exe)
            .args(["dev", "--http", "127.0.0.1:0"])
            .args(extra)
            .arg("--data-dir")
            .arg(data)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .context("starting ferry dev")?;
        let stdout = child.stdout.take().context("ferry dev's stdout")?;
        let mut lines = std::io::BufReader::new(stdout).lines();
        let url = loop {
            match lines.next() {
                Some(Ok(line)) if line.contains("ferry dev ready") => {
                    let status = line.rsplit("status on ").next().unwrap_or_default().trim();
                    break status.trim_end_matches("/status").to_string();
                }
                Some(Ok(_)) => {}
                _ => {
                    let _ = child.kill();
                    bail!(
                        "ferry dev exited before it was ready (log: {}.log)",
                        data.display()
                    )
                }
            }
        };
        // The rest of its output is not read: drain it so it never blocks.
        std::thread::spawn(move || for _ in lines {});
        Ok(Dev { child, url })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU seconds (user + system) from a `/proc/<pid>/stat` line: the process's
/// own (`children: false`) or that of its children it waited for.
fn stat_cpu_seconds(stat: &str, children: bool) -> Option<f64> {
    // Fields after the command name (in parentheses, which may hold spaces):
    // utime, stime, cutime, cstime are the 12th to 15th of those.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let at = if children { 13 } else { 11 };
    let ticks: f64 =
        fields.get(at)?.parse::<f64>().ok()? + fields.get(at + 1)?.parse::<f64>().ok()?;
    // The kernel reports in USER_HZ, 100 on every Linux platform ferry runs on.
    Some(ticks / 100.0)
}

/// CPU seconds process `pid` used so far.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    stat_cpu_seconds(
        &std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?,
        false,
    )
}

/// CPU seconds of this process's children it waited for so far.
pub fn waited_children_cpu_seconds() -> Option<f64> {
    stat_cpu_seconds(&std::fs::read_to_string("/proc/self/stat").ok()?, true)
}

/// A `/proc/<pid>/status` memory line (`VmRSS`, `VmHWM`), in KiB.
pub fn memory_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Starts `pid`'s peak resident set (`VmHWM`) over from its current size;
/// false where the kernel does not allow it.
pub fn reset_peak_memory(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_past_a_command_with_spaces() {
        let stat = "42 (a b) S 1 2 3 4 5 6 7 8 9 10 250 50 30 20 0";
        assert_eq!(stat_cpu_seconds(stat, false), Some(3.0));
        assert_eq!(stat_cpu_seconds(stat, true), Some(0.5));
        assert_eq!(stat_cpu_seconds("garbage", false), None);
    }
}
