//! The receiver's position record for one replica (docs/ship.md §4.3).
//!
//! Protocol:
//! 1. Before a replica transaction commits, write a record whose intent names the
//!    position before and after it and a witness that tells them apart; fdatasync.
//! 2. Commit the replica transaction.
//! 3. The next write (the next group's intent, or a clean record) supersedes it.
//!
//! The file holds two 512-byte slots. Each write goes to the slot that does not hold the
//! newest record, so a torn write spoils at most the record being written and the other
//! slot still holds the previous one. On open, the valid slot with the higher counter wins.
//!
//! A crash between 1 and 2 leaves an intent whose transaction did not commit; between 2
//! and 3 one that did. [`crate::receiver::replica`] decides which by reading the witness.

use ferry_core::epoch::Epoch;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub const SLOT_BYTES: usize = 512;
const MAGIC: [u8; 4] = *b"FRS1";

pub const FLAG_HAS_REPLICA: u32 = 1;
pub const FLAG_PROMOTED: u32 = 2;

/// Where a replica stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pos {
    pub epoch: Epoch,
    pub generation: u64,
    pub seq: u64,
    pub page_size: u32,
    pub flags: u32,
    /// The primary's WAL checksum after transaction `seq` (see `RecordHeader`).
    pub checksum: u64,
}

impl Pos {
    pub fn has_replica(&self) -> bool {
        self.flags & FLAG_HAS_REPLICA != 0
    }
    pub fn promoted(&self) -> bool {
        self.flags & FLAG_PROMOTED != 0
    }

    /// This position once its replica is gone (set aside, lost, or never there): no
    /// generation, seq 0, so the shipper sends a base; epoch, page size, checksum and
    /// the other flags kept.
    pub fn without_replica(self) -> Pos {
        Pos {
            generation: 0,
            seq: 0,
            flags: self.flags & !FLAG_HAS_REPLICA,
            ..self
        }
    }
}

/// What tells a committed group from one that did not commit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Witness {
    /// A page whose image the group changes; 0 if only the size changes (or nothing).
    pub pgno: u32,
    /// CRC32C of the page before and after; `pre_absent` when the page did not exist.
    pub pre_crc: u32,
    pub pre_absent: bool,
    pub post_crc: u32,
    pub size_pre: u32,
    pub size_post: u32,
}

/// An operation that may or may not have committed when the record was last written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Intent {
    #[default]
    None,
    /// A replica transaction that moves `pre` to the record's position.
    Group { pre: Pos, witness: Witness },
    /// A base built in a new file with inode `ino`, renamed over the replica.
    Replace { pre: Pos, ino: u64 },
}

/// One record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    pub pos: Pos,
    pub intent: Intent,
}

/// The open state file.
#[derive(Debug)]
pub struct StateFile {
    file: File,
    /// Counter of the newest valid record on disk (0 if none); the next goes to slot
    /// `(counter + 1) % 2`.
    counter: u64,
}

impl StateFile {
    /// Open or create the file at `path`; return the newest valid record, if any.
    pub fn open(path: &Path) -> io::Result<(StateFile, Option<Record>)> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        // Opened per request: a full stat would make the next write of the record take a
        // fine-grained timestamp, which advances every file's clock on the machine (see
        // `crate::quiet`).
        if crate::quiet::fstat(&file)?.len < (2 * SLOT_BYTES) as u64 {
            // Preallocate both slots so later writes never need new blocks (a full disk
            // must not stop the receiver from recording where it stands).
            file.write_all_at(&[0u8; 2 * SLOT_BYTES], 0)?;
            file.sync_all()?;
        }
        let mut best: Option<(u64, Record)> = None;
        for slot in 0..2 {
            let mut b = [0u8; SLOT_BYTES];
            file.read_exact_at(&mut b, (slot * SLOT_BYTES) as u64)?;
            if let Some((counter, rec)) = decode(&b)
                && best.is_none_or(|(c, _)| counter > c)
            {
                best = Some((counter, rec));
            }
        }
        let counter = best.map_or(0, |(c, _)| c);
        Ok((StateFile { file, counter }, best.map(|(_, r)| r)))
    }

    /// The counter of the newest record this handle knows of: another process wrote the
    /// file if a fresh open sees a different one.
    pub fn counter(&self) -> u64 {
        self.counter
    }

    /// Write `rec` durably. On error the caller must drop this file and reopen it before
    /// writing again: after a failed fdatasync nothing about the page cache is known.
    pub fn write(&mut self, rec: &Record) -> io::Result<()> {
        let counter = self.counter + 1;
        let slot = (counter % 2) as usize;
        self.file
            .write_all_at(&encode(counter, rec), (slot * SLOT_BYTES) as u64)?;
        self.file.sync_data()?;
        self.counter = counter;
        Ok(())
    }
}

fn encode(counter: u64, rec: &Record) -> [u8; SLOT_BYTES] {
    let mut w = Writer {
        b: [0u8; SLOT_BYTES],
        at: 0,
    };
    w.bytes(&MAGIC);
    w.u64(counter);
    w.pos(&rec.pos);
    match rec.intent {
        Intent::None => w.u32(0),
        Intent::Group { pre, witness } => {
            w.u32(1);
            w.pos(&pre);
            w.u32(witness.pgno);
            w.u32(witness.pre_crc);
            w.u32(witness.pre_absent as u32);
            w.u32(witness.post_crc);
            w.u32(witness.size_pre);
            w.u32(witness.size_post);
        }
        Intent::Replace { pre, ino } => {
            w.u32(2);
            w.pos(&pre);
            w.u64(ino);
        }
    }
    let crc = crc32c::crc32c(&w.b[..SLOT_BYTES - 4]);
    w.b[SLOT_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
    w.b
}

fn decode(b: &[u8; SLOT_BYTES]) -> Option<(u64, Record)> {
    if b[0..4] != MAGIC
        || crc32c::crc32c(&b[..SLOT_BYTES - 4])
            != u32::from_le_bytes(b[SLOT_BYTES - 4..].try_into().ok()?)
    {
        return None;
    }
    let mut r = Reader { b, at: 4 };
    let counter = r.u64();
    let pos = r.pos();
    let intent = match r.u32() {
        0 => Intent::None,
        1 => {
            let pre = r.pos();
            Intent::Group {
                pre,
                witness: Witness {
                    pgno: r.u32(),
                    pre_crc: r.u32(),
                    pre_absent: r.u32() != 0,
                    post_crc: r.u32(),
                    size_pre: r.u32(),
                    size_post: r.u32(),
                },
            }
        }
        2 => Intent::Replace {
            pre: r.pos(),
            ino: r.u64(),
        },
        _ => return None,
    };
    Some((counter, Record { pos, intent }))
}

struct Writer {
    b: [u8; SLOT_BYTES],
    at: usize,
}

impl Writer {
    fn bytes(&mut self, v: &[u8]) {
        self.b[self.at..self.at + v.len()].copy_from_slice(v);
        self.at += v.len();
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn pos(&mut self, p: &Pos) {
        self.u64(p.epoch.0);
        self.u64(p.generation);
        self.u64(p.seq);
        self.u32(p.page_size);
        self.u32(p.flags);
        self.u64(p.checksum);
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn u32(&mut self) -> u32 {
        let v = u32::from_le_bytes(
            self.b[self.at..self.at + 4]
                .try_into()
                .expect("within the slot"),
        );
        self.at += 4;
        v
    }
    fn u64(&mut self) -> u64 {
        let v = u64::from_le_bytes(
            self.b[self.at..self.at + 8]
                .try_into()
                .expect("within the slot"),
        );
        self.at += 8;
        v
    }
    fn pos(&mut self) -> Pos {
        Pos {
            epoch: Epoch(self.u64()),
            generation: self.u64(),
            seq: self.u64(),
            page_size: self.u32(),
            flags: self.u32(),
            checksum: self.u64(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64) -> Record {
        let pos = Pos {
            epoch: Epoch(1),
            generation: 7,
            seq,
            page_size: 4096,
            flags: FLAG_HAS_REPLICA,
            checksum: 5,
        };
        Record {
            pos,
            intent: Intent::Group {
                pre: Pos {
                    seq: seq - 1,
                    ..pos
                },
                witness: Witness {
                    pgno: 3,
                    pre_crc: 1,
                    pre_absent: false,
                    post_crc: 2,
                    size_pre: 9,
                    size_post: 9,
                },
            },
        }
    }

    #[test]
    fn the_newest_record_wins_and_survives_reopen() {
        let dir = std::env::temp_dir().join(format!("ferry-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.state");
        let (mut f, none) = StateFile::open(&p).unwrap();
        assert!(none.is_none());
        for s in 1..=5 {
            f.write(&rec(s)).unwrap();
        }
        let (_, got) = StateFile::open(&p).unwrap();
        assert_eq!(got, Some(rec(5)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    // Guards against losing the position to a torn write: damaging the slot being written
    // must leave the previous record readable.
    #[test]
    fn a_torn_slot_falls_back_to_the_previous_record() {
        let dir = std::env::temp_dir().join(format!("ferry-state-torn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.state");
        let (mut f, _) = StateFile::open(&p).unwrap();
        f.write(&rec(1)).unwrap();
        f.write(&rec(2)).unwrap(); // counter 2 → slot 0
        drop(f);
        for at in [0usize, 10, 100, 511] {
            let mut bytes = std::fs::read(&p).unwrap();
            bytes[at] ^= 0xff;
            let q = dir.join(format!("torn-{at}.state"));
            std::fs::write(&q, &bytes).unwrap();
            let (_, got) = StateFile::open(&q).unwrap();
            assert_eq!(got, Some(rec(1)), "damage at {at}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
