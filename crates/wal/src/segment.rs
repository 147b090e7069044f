//! Cutting the WAL into segment files, and their names.
//!
//! Names follow PostgreSQL's `XLogFileName` (timeline 1), so object names of WAL
//! backups read like Neon's: `000000010000000000000002` for the third 16 MiB
//! segment. The segment being written carries the `.partial` suffix locally.

use crate::Lsn;

/// The default segment size, 16 MiB.
pub const DEFAULT_SEGMENT_BYTES: u64 = 16 << 20;
/// Suffix of the segment being written.
pub const PARTIAL_SUFFIX: &str = ".partial";

/// Segment geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSize(u64);

/// Why a segment size is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("segment size {0} must be a power of two between 64 KiB and 1 GiB")]
pub struct BadSegmentSize(pub u64);

impl SegmentSize {
    /// A power of two between 64 KiB and 1 GiB, like PostgreSQL's `wal_segment_size`.
    pub fn new(bytes: u64) -> Result<SegmentSize, BadSegmentSize> {
        if bytes.is_power_of_two() && ((64 << 10)..=(1 << 30)).contains(&bytes) {
            Ok(SegmentSize(bytes))
        } else {
            Err(BadSegmentSize(bytes))
        }
    }

    pub fn bytes(self) -> u64 {
        self.0
    }

    /// The segment holding the byte at `lsn`.
    pub fn segno(self, lsn: Lsn) -> u64 {
        lsn.0 / self.0
    }

    /// Offset of `lsn` inside its segment.
    pub fn offset(self, lsn: Lsn) -> u64 {
        lsn.0 % self.0
    }

    /// First LSN of segment `segno`.
    pub fn start(self, segno: u64) -> Lsn {
        Lsn(segno * self.0)
    }

    /// File name of segment `segno` (without the `.partial` suffix).
    pub fn file_name(self, segno: u64) -> String {
        let per_xlogid = 0x1_0000_0000 / self.0;
        format!(
            "{:08X}{:08X}{:08X}",
            1,
            segno / per_xlogid,
            segno % per_xlogid
        )
    }

    /// The segment number of a file name produced by [`SegmentSize::file_name`],
    /// with or without `.partial`; `None` for anything else.
    pub fn parse_file_name(self, name: &str) -> Option<(u64, bool)> {
        let (base, partial) = match name.strip_suffix(PARTIAL_SUFFIX) {
            Some(base) => (base, true),
            None => (name, false),
        };
        if base.len() != 24
            || !base
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_lowercase())
        {
            return None;
        }
        let tli = u64::from_str_radix(&base[..8], 16).ok()?;
        let hi = u64::from_str_radix(&base[8..16], 16).ok()?;
        let lo = u64::from_str_radix(&base[16..], 16).ok()?;
        let per_xlogid = 0x1_0000_0000 / self.0;
        if tli != 1 || lo >= per_xlogid {
            return None;
        }
        Some((hi * per_xlogid + lo, partial))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_postgres() {
        let s = SegmentSize::new(DEFAULT_SEGMENT_BYTES).expect("size");
        assert_eq!(s.file_name(2), "000000010000000000000002");
        assert_eq!(s.file_name(256), "000000010000000100000000");
        assert_eq!(
            s.parse_file_name("000000010000000100000000"),
            Some((256, false))
        );
        assert_eq!(
            s.parse_file_name("000000010000000000000002.partial"),
            Some((2, true))
        );
        assert_eq!(
            s.parse_file_name("000000010000000000000100"),
            None,
            "low part out of range"
        );
        assert_eq!(s.parse_file_name("00000001000000000000000g"), None);
        assert_eq!(s.parse_file_name("safekeeper.control"), None);
        assert_eq!(s.segno(Lsn(0x2534868)), 2);
        assert_eq!(s.offset(Lsn(0x2534868)), 0x534868);
        assert!(SegmentSize::new(1000).is_err());
        assert!(SegmentSize::new(1 << 12).is_err());
    }
}
