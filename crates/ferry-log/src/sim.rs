//! A storage for tests that keeps, per file, what a completed sync made durable and
//! what was written since. `kill` is a process dying (the page cache keeps everything,
//! unsynced); `crash` is a power loss, which keeps the durable bytes plus some of the rest:
//! a random prefix of the unsynced operations, the next one torn (a random subset of its
//! 4 KiB pages, some of them zeroes). It fails the Nth write or sync on request. One
//! seed drives every choice, so a failing run replays exactly.

use crate::storage::Storage;
use ferry_core::seams::{Rng, SplitMix64};
use ferry_core::sync::lock;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::Mutex;

const PAGE: usize = 4096;

#[derive(Clone, Debug)]
enum Op {
    Write { offset: u64, data: Vec<u8> },
    Truncate(u64),
}

#[derive(Clone, Debug, Default)]
struct SimFile {
    /// What reads see.
    current: Vec<u8>,
    /// What survives a crash for sure.
    durable: Vec<u8>,
    /// Since the last completed sync, in order.
    unsynced: Vec<Op>,
}

impl SimFile {
    /// A file after a crash: what is on disk is all there is, and it is durable.
    fn settled(bytes: Vec<u8>) -> SimFile {
        SimFile {
            current: bytes.clone(),
            durable: bytes,
            unsynced: Vec::new(),
        }
    }
}

#[derive(Debug)]
struct Sim {
    files: BTreeMap<String, SimFile>,
    /// Names whose existence (or absence) a directory sync made durable.
    durable_names: BTreeSet<String>,
    /// Files removed since the last directory sync, with their durable bytes: a crash
    /// brings them back.
    ghosts: BTreeMap<String, Vec<u8>>,
    rng: SplitMix64,
    writes: u64,
    syncs: u64,
    fail_write_at: Option<u64>,
    fail_sync_at: Option<u64>,
    /// Every sync from this one on fails (`fail_syncs_from_now`).
    fail_syncs_from: Option<u64>,
    dir_syncs: u64,
    fail_sync_dir_at: Option<u64>,
    /// Between `halt` and `crash`: the process is dead, every call fails.
    halted: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct SimStorage {
    sim: Mutex<Sim>,
}

fn halted() -> io::Error {
    io::Error::other("the simulated process is halted")
}

fn exists(name: &str) -> io::Error {
    io::Error::new(io::ErrorKind::AlreadyExists, format!("{name} exists"))
}

fn missing(name: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("{name}: no such file"))
}

fn apply(buf: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write { offset, data } => {
            let end = *offset as usize + data.len();
            if buf.len() < end {
                buf.resize(end, 0);
            }
            buf[*offset as usize..end].copy_from_slice(data);
        }
        Op::Truncate(len) => buf.resize(*len as usize, 0),
    }
}

impl SimStorage {
    pub fn new(seed: u64) -> SimStorage {
        SimStorage {
            sim: Mutex::new(Sim {
                files: BTreeMap::new(),
                durable_names: BTreeSet::new(),
                ghosts: BTreeMap::new(),
                rng: SplitMix64::seeded(seed),
                writes: 0,
                syncs: 0,
                fail_write_at: None,
                fail_sync_at: None,
                fail_syncs_from: None,
                dir_syncs: 0,
                fail_sync_dir_at: None,
                halted: false,
            }),
        }
    }

    /// Fail the `n`th write from now (1 = the next one); it leaves a random prefix.
    pub fn fail_write_after(&self, n: u64) {
        let mut s = lock(&self.sim);
        s.fail_write_at = Some(s.writes + n);
    }

    /// Fail the `n`th sync from now; what it covered may or may not survive a crash.
    pub fn fail_sync_after(&self, n: u64) {
        let mut s = lock(&self.sim);
        s.fail_sync_at = Some(s.syncs + n);
    }

    /// Fail every sync from now on, whichever file it is for (a disk gone bad): unlike
    /// `fail_sync_after`, no background sync can take the failure in a test's place.
    pub fn fail_syncs_from_now(&self) {
        let mut s = lock(&self.sim);
        s.fail_syncs_from = Some(s.syncs + 1);
    }

    /// Fail the `n`th directory sync from now: the creations, removals and renames it
    /// would have made durable stay undecided, for a crash to decide.
    pub fn fail_sync_dir_after(&self, n: u64) {
        let mut s = lock(&self.sim);
        s.fail_sync_dir_at = Some(s.dir_syncs + n);
    }

    /// The process dies: every call fails until `crash`.
    pub fn halt(&self) {
        lock(&self.sim).halted = true;
    }

    /// The process died but the machine did not (after `halt`): the page cache keeps
    /// everything written, still unsynced, for a later `crash` to decide. Calls succeed
    /// again.
    pub fn kill(&self) {
        let mut s = lock(&self.sim);
        s.halted = false;
        s.fail_write_at = None;
        s.fail_sync_at = None;
        s.fail_syncs_from = None;
        s.fail_sync_dir_at = None;
    }

    /// Power loss after `halt` (or instead of it): keep what was durable and a random
    /// part of the rest, then let calls succeed again.
    pub fn crash(&self) {
        let mut s = lock(&self.sim);
        let s = &mut *s;
        let mut after = BTreeMap::new();
        let names: Vec<String> = s.files.keys().cloned().collect();
        for name in names {
            let f = s.files.remove(&name).expect("listed");
            if !s.durable_names.contains(&name) && s.rng.below(2) == 0 {
                // Created since the last directory sync, and the entry did not make it.
                continue;
            }
            let mut bytes = f.durable.clone();
            let keep = s.rng.below(f.unsynced.len() as u64 + 1) as usize;
            for op in &f.unsynced[..keep] {
                apply(&mut bytes, op);
            }
            if let Some(Op::Write { offset, data }) = f.unsynced.get(keep) {
                // Torn: each page of the write independently made it, or not, or made
                // it as zeroes (the size was updated, the data was not).
                for (i, page) in data.chunks(PAGE).enumerate() {
                    let at = *offset as usize + i * PAGE;
                    match s.rng.below(4) {
                        0 | 1 => continue,
                        2 => apply(
                            &mut bytes,
                            &Op::Write {
                                offset: at as u64,
                                data: page.to_vec(),
                            },
                        ),
                        _ => apply(
                            &mut bytes,
                            &Op::Write {
                                offset: at as u64,
                                data: vec![0; page.len()],
                            },
                        ),
                    }
                }
            }
            after.insert(name, SimFile::settled(bytes));
        }
        for (name, bytes) in std::mem::take(&mut s.ghosts) {
            if s.durable_names.contains(&name) && !after.contains_key(&name) && s.rng.below(2) == 0
            {
                after.insert(name, SimFile::settled(bytes));
            }
        }
        s.durable_names = after.keys().cloned().collect();
        s.files = after;
        s.halted = false;
        s.fail_write_at = None;
        s.fail_sync_at = None;
        s.fail_syncs_from = None;
        s.fail_sync_dir_at = None;
    }

    /// Another storage holding what these files hold now, all of it durable: for
    /// reading a state (after a `crash`, say) without recovering it in place, which
    /// would leave the next open nothing to cut or repair.
    pub fn copy(&self) -> SimStorage {
        let s = lock(&self.sim);
        let copy = SimStorage::new(0);
        {
            let mut c = lock(&copy.sim);
            c.files = s
                .files
                .iter()
                .map(|(name, f)| (name.clone(), SimFile::settled(f.current.clone())))
                .collect();
            c.durable_names = c.files.keys().cloned().collect();
        }
        copy
    }

    /// Flip one bit of what a file durably holds (and shows), for damage tests.
    pub fn flip_bit(&self, name: &str, offset: u64, bit: u8) {
        let mut s = lock(&self.sim);
        let f = s.files.get_mut(name).expect("flip_bit: no such file");
        f.current[offset as usize] ^= 1 << bit;
        f.durable[offset as usize] ^= 1 << bit;
    }

    /// Writes and syncs so far (to place faults).
    pub fn counts(&self) -> (u64, u64) {
        let s = lock(&self.sim);
        (s.writes, s.syncs)
    }
}

impl Storage for SimStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        let s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        Ok(s.files.keys().cloned().collect())
    }

    fn create(&self, name: &str) -> io::Result<()> {
        let mut s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        if s.files.contains_key(name) {
            return Err(exists(name));
        }
        s.files.insert(name.to_string(), SimFile::default());
        Ok(())
    }

    fn len(&self, name: &str) -> io::Result<u64> {
        let s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        s.files
            .get(name)
            .map(|f| f.current.len() as u64)
            .ok_or_else(|| missing(name))
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        let f = s.files.get(name).ok_or_else(|| missing(name))?;
        let start = (offset as usize).min(f.current.len());
        let n = buf.len().min(f.current.len() - start);
        buf[..n].copy_from_slice(&f.current[start..start + n]);
        Ok(n)
    }

    fn write_at(&self, name: &str, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        s.writes += 1;
        let fail = s.fail_write_at == Some(s.writes);
        let cut = if fail {
            s.rng.below(data.len() as u64 + 1) as usize
        } else {
            data.len()
        };
        let f = s.files.get_mut(name).ok_or_else(|| missing(name))?;
        let op = Op::Write {
            offset,
            data: data[..cut].to_vec(),
        };
        apply(&mut f.current, &op);
        f.unsynced.push(op);
        if fail {
            return Err(io::Error::other("injected write failure"));
        }
        Ok(())
    }

    fn sync(&self, name: &str) -> io::Result<()> {
        let mut s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        s.syncs += 1;
        if s.fail_sync_at == Some(s.syncs) || s.fail_syncs_from.is_some_and(|f| s.syncs >= f) {
            // What the failed sync covered may or may not reach the disk: it stays
            // unsynced, for a crash to decide.
            return Err(io::Error::other("injected sync failure"));
        }
        let f = s.files.get_mut(name).ok_or_else(|| missing(name))?;
        f.durable = f.current.clone();
        f.unsynced.clear();
        Ok(())
    }

    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let mut s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        let f = s.files.get_mut(name).ok_or_else(|| missing(name))?;
        let op = Op::Truncate(len);
        apply(&mut f.current, &op);
        f.unsynced.push(op);
        Ok(())
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        let mut s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        let f = s.files.remove(name).ok_or_else(|| missing(name))?;
        s.ghosts.insert(name.to_string(), f.durable);
        Ok(())
    }

    fn sync_dir(&self) -> io::Result<()> {
        let mut s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        s.dir_syncs += 1;
        if s.fail_sync_dir_at == Some(s.dir_syncs) {
            return Err(io::Error::other("injected directory sync failure"));
        }
        s.durable_names = s.files.keys().cloned().collect();
        s.ghosts.clear();
        Ok(())
    }

    /// Until the next `sync_dir`, a crash may keep the old name, the new one, both or
    /// neither: harsher than a real rename, which keeps exactly one.
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut s = lock(&self.sim);
        if s.halted {
            return Err(halted());
        }
        if s.files.contains_key(to) {
            return Err(exists(to));
        }
        let f = s.files.remove(from).ok_or_else(|| missing(from))?;
        s.ghosts.insert(from.to_string(), f.durable.clone());
        s.files.insert(to.to_string(), f);
        Ok(())
    }
}
