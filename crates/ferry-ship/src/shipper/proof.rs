//! The continuity proof (docs/ship.md §3.3): the rules that decide, before every step,
//! whether the WAL still continues what the shipper read, and the state the proof keeps
//! between steps. Pure: the WAL and the main file are read through [`ReadAt`], what
//! SQLite published comes in as a value, and nothing here logs or sleeps.
//!
//! The rules, in the order a step applies them (rule 1, the file's identity, is a `stat`
//! that `files` does):
//! 2. The WAL header validates and its page size is the stream's ([`same_cycle`],
//!    [`new_cycle`]).
//! 3. Same salts as the cursor: the frame at the cursor still carries the cursor's
//!    checksum, and once per open the whole chain to it validates and it is not past
//!    what SQLite published ([`same_cycle`]).
//! 4. Other salts: one reset, proven to have happened right at the cursor
//!    ([`new_cycle`]); if the old cycle goes on past the cursor, the caller reads on and
//!    [`old_cycle_ended`] checks the new cycle did not reach what was read. Where the old
//!    cycle was seen published ends ([`PublishedEnds`]); past that, its last commit counts
//!    only if the main file holds it ([`old_cycle_end`]).
//! 5. The main file's change counter lies in the range seen ([`check_counter`]); one above
//!    it counts only once the scan has read all SQLite published ([`counter_above`]).
//!
//! Anything not proven owes a base ([`Unproven`]): never a guess.

use super::base::BaseReason;
use super::limits::IDENTITY_INTERVAL;
use crate::sqlite::WalIndexEnd;
use crate::wal::{self, Cursor, Header, Pages, ReadAt, Salts, Stop};
use std::io;
use std::time::{Duration, Instant};

/// A commit whose frames are in the `-wal` but not yet published in the wal-index is
/// looked at again every `UNPUBLISHED_RECHECK`, `UNPUBLISHED_RECHECKS_FAST` times, then
/// every `UNPUBLISHED_RECHECK_SLOW`. An app publishes right after its commit's sync (well
/// under a millisecond to some tens of them), and in another process it says nothing when
/// it does: inotify saw the frames written, before the sync. Seeing it soon matters: an
/// app that checkpoints itself may reset the WAL a few milliseconds later, and a commit of
/// the old cycle the shipper never saw published costs a base. One that stays unpublished
/// is a commit its writer died in; it is looked at every `UNPUBLISHED_RECHECK_SLOW` until
/// the app's next writer overwrites it, for a read of the index and of one frame each time.
pub const UNPUBLISHED_RECHECK: Duration = Duration::from_millis(1);
pub const UNPUBLISHED_RECHECKS_FAST: u32 = 100;
pub const UNPUBLISHED_RECHECK_SLOW: Duration = Duration::from_millis(100);

/// Cycles whose published end is remembered: the shipper looks at a reset within a step
/// or two, and a fold is only asked for once per cycle.
const PUBLISHED_CYCLES_MAX: usize = 4;

/// Continuity not proven: the base it owes, and a sentence for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unproven {
    pub reason: BaseReason,
    pub why: String,
}

fn unproven(reason: BaseReason, why: impl Into<String>) -> Unproven {
    Unproven {
        reason,
        why: why.into(),
    }
}

/// What the proof keeps between steps.
#[derive(Debug)]
pub struct ProofState {
    /// Where scanning has reached; None while the WAL was empty at the base. Never past
    /// what SQLite published (`published`), and within a cycle it only moves forward.
    pub scan: Option<Cursor>,
    /// Why the last scan stopped.
    pub stop: Stop,
    /// The furthest SQLite's wal-index was seen to publish of the cycles it named
    /// (docs/ship.md §3.2). Frames past it are not committed for SQLite, whatever their
    /// checksums say; once the index has moved on to a new cycle, this is all the shipper
    /// knows of where the old one ended.
    pub published: PublishedEnds,
    /// A valid commit follows what SQLite published (being published, or one its writer
    /// died in): where the scan stopped before it, and how many times in a row.
    pub unpublished: Option<(Cursor, u32)>,
    /// Scans that stopped at such a commit, since the track opened (for status: it shows
    /// the shipper looked at one and left it alone).
    pub unpublished_seen: u64,
    /// The WAL chain from the header to the cursor was verified in full (once per open).
    pub chain_verified: bool,
    /// A scan found the receiver holding another history than this WAL.
    pub forked: bool,
    /// When rule 5 last looked at the main file's change counter.
    pub counters_at: Instant,
}

impl ProofState {
    /// The proof of a track that starts from `scan`; rule 5 is due at once.
    pub fn new(scan: Option<Cursor>, published: Option<WalIndexEnd>, now: Instant) -> Self {
        let mut ends = PublishedEnds::default();
        if let Some(end) = published {
            ends.note(end);
        }
        ProofState {
            scan,
            stop: Stop::End,
            published: ends,
            unpublished: None,
            unpublished_seen: 0,
            chain_verified: false,
            forked: false,
            counters_at: now.checked_sub(IDENTITY_INTERVAL).unwrap_or(now),
        }
    }

    /// After a scan that ended at `end`: does a valid frame follow what SQLite published
    /// (`held_back`)? Counts the times in a row the scan stopped at the same place.
    pub fn note_unpublished(&mut self, end: Cursor, held_back: bool) {
        self.unpublished = if held_back {
            self.unpublished_seen += 1;
            match self.unpublished {
                Some((at, n)) if at == end => Some((at, n + 1)),
                _ => Some((end, 0)),
            }
        } else {
            None
        };
    }

    /// How soon to look again at a commit not yet published; None if there is none.
    pub fn recheck(&self) -> Option<Duration> {
        self.unpublished.map(|(_, n)| {
            if n < UNPUBLISHED_RECHECKS_FAST {
                UNPUBLISHED_RECHECK
            } else {
                UNPUBLISHED_RECHECK_SLOW
            }
        })
    }

    /// Rule 5 is looked at most this often (a step per commit cannot afford the read).
    pub fn counters_due(&mut self, now: Instant) -> bool {
        if now.saturating_duration_since(self.counters_at) < IDENTITY_INTERVAL {
            return false;
        }
        self.counters_at = now;
        true
    }
}

/// How far SQLite was seen to publish each of the last few WAL cycles (docs/ship.md
/// §3.2): an end seen is a lower bound of that cycle's, and stays one after the wal-index
/// moves on to the next cycle.
#[derive(Clone, Debug, Default)]
pub struct PublishedEnds(Vec<WalIndexEnd>);

impl PublishedEnds {
    pub fn get(&self, salts: Salts) -> Option<u32> {
        self.0.iter().find(|e| e.salts == salts).map(|e| e.frame)
    }

    pub fn note(&mut self, end: WalIndexEnd) {
        match self.0.iter_mut().find(|e| e.salts == end.salts) {
            Some(e) => e.frame = e.frame.max(end.frame),
            None => {
                if self.0.len() == PUBLISHED_CYCLES_MAX {
                    self.0.remove(0);
                }
                self.0.push(end);
            }
        }
    }
}

/// Rules 2 and 3, for a WAL whose header `h` carries the cursor's salts.
///
/// `verify_chain`: walk the whole chain to the cursor (once per open: after a power loss
/// the frame at the cursor can survive while frames below it did not, and SQLite's own
/// recovery would then end the WAL earlier), and check the cursor is not past what SQLite
/// publishes now (`index`, asked only then): a cursor saved past it covers a commit whose
/// writer died before publishing it (or one that overwrote it).
pub fn same_cycle(
    wal: &(impl ReadAt + ?Sized),
    cursor: &Cursor,
    h: &Header,
    verify_chain: bool,
    index: impl FnOnce() -> Option<WalIndexEnd>,
) -> io::Result<Result<(), Unproven>> {
    debug_assert_eq!(
        h.salts, cursor.salts,
        "same_cycle is for the cursor's cycle"
    );
    if h.page_size != cursor.page_size {
        return Ok(Err(unproven(
            BaseReason::PageSize,
            format!("page size {} → {}", cursor.page_size, h.page_size),
        )));
    }
    if !wal::cursor_holds(wal, cursor)? {
        return Ok(Err(unproven(
            BaseReason::Rewritten,
            format!(
                "the WAL no longer holds the cursor's frame {} as it was read",
                cursor.frame
            ),
        )));
    }
    if verify_chain {
        if wal::chain_to(wal, h, cursor.frame)? != Some(cursor.checksum) {
            return Ok(Err(unproven(
                BaseReason::Rewritten,
                format!(
                    "the WAL below the saved cursor (frame {}) changed",
                    cursor.frame
                ),
            )));
        }
        if let Some(now) = index()
            && past_published(cursor, now)
        {
            return Ok(Err(unproven(
                BaseReason::Rewritten,
                format!(
                    "the saved cursor (frame {}) is past what SQLite published (frame {})",
                    cursor.frame, now.frame
                ),
            )));
        }
    }
    Ok(Ok(()))
}

/// Is `cursor` past the end SQLite publishes of its cycle?
pub fn past_published(cursor: &Cursor, index: WalIndexEnd) -> bool {
    index.salts == cursor.salts && index.frame < cursor.frame
}

/// The outcome of rule 4's first half.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Proof {
    /// The old cycle ended exactly at the cursor: continue in the new one.
    Clean,
    /// The old cycle still holds valid frames after the cursor: read them first, then
    /// [`old_cycle_ended`].
    OldCycleGoesOn,
    /// Not provable.
    Unproven(Unproven),
}

/// Rule 4: did the old cycle end exactly at `cursor` before the reset that started the
/// cycle `h` names?
///
/// The order of the reads matters. The file's length and slot P+1 are read first, the
/// new cycle's reach after, and the header last: the new cycle only grows, so not having
/// reached slot P after slot P+1 was read proves it had not reached that slot when it
/// was read, and an unchanged header proves no further reset happened meanwhile.
pub fn new_cycle(wal: &(impl ReadAt + ?Sized), cursor: &Cursor, h: &Header) -> io::Result<Proof> {
    if h.page_size != cursor.page_size {
        return Ok(Proof::Unproven(unproven(
            BaseReason::PageSize,
            format!("page size {} → {}", cursor.page_size, h.page_size),
        )));
    }
    // One reset by a writer increments salt-1; anything else (two resets, a reset by a
    // connection that never reset before) gives another value.
    if h.salts.0 != cursor.salts.0.wrapping_add(1) {
        return Ok(Proof::Unproven(unproven(
            BaseReason::Reset,
            format!(
                "salt-1 went from {:#x} to {:#x}, not by one reset",
                cursor.salts.0, h.salts.0
            ),
        )));
    }
    let p = cursor.frame;
    let frames_in_file =
        (wal.size()?.saturating_sub(wal::HEADER_BYTES as u64) / cursor.frame_bytes()) as u32;
    if frames_in_file < p {
        return Ok(Proof::Unproven(unproven(
            BaseReason::Reset,
            format!("the WAL was truncated to {frames_in_file} frames, below our cursor {p}"),
        )));
    }
    // Slot P+1, if the file has one: does the old cycle go on there?
    let goes_on = frames_in_file > p && wal::continues(wal, cursor)?;
    // If it does, the caller reads on and bounds the new cycle by where the old one ended.
    // If not, the new cycle must not have reached our cursor's slot by now (or it may have
    // overwritten slot P+1 before it was read, or fill a file truncated and grown again to
    // end there): it only grows, so not reached now means not reached then.
    if !goes_on && (p == 0 || wal::reached(wal, h, p)?) {
        return Ok(Proof::Unproven(unproven(
            BaseReason::Reset,
            format!("the new cycle reached our cursor's slot {p}"),
        )));
    }
    if !header_still(wal, h)? {
        return Ok(Proof::Unproven(unproven(
            BaseReason::Reset,
            "the WAL was reset again while the reset was being proved",
        )));
    }
    Ok(if goes_on {
        Proof::OldCycleGoesOn
    } else {
        Proof::Clean
    })
}

/// Rule 4's second half, after the frames of the old cycle past `cursor` were read up to
/// `reached`: the old cycle's chain ended right after what was read (at `reached`, or
/// further on with no commit) unless the new cycle (header `h`) had overwritten the slot
/// after it by then. It only grows, so not having reached that slot now proves it had not
/// then; and the header, read last and unchanged, that no second reset began meanwhile.
/// Reading on must also have found a commit, or nothing moved.
pub fn old_cycle_ended(
    wal: &(impl ReadAt + ?Sized),
    h: &Header,
    cursor: &Cursor,
    reached: &Cursor,
) -> io::Result<Result<(), Unproven>> {
    let overwritten = wal::reached(wal, h, reached.frame + 1)?;
    let same = header_still(wal, h)?;
    if !same || overwritten {
        return Ok(Err(unproven(
            BaseReason::Reset,
            format!(
                "the new WAL cycle reached the old one's frames while they were read \
                 (cursor {}, read to {}, same header: {same})",
                cursor.frame, reached.frame
            ),
        )));
    }
    if reached == cursor {
        return Ok(Err(unproven(
            BaseReason::Reset,
            format!(
                "the old WAL cycle goes on past the cursor (frame {}) with no commit in it",
                cursor.frame
            ),
        )));
    }
    Ok(Ok(()))
}

/// Does the WAL's header still read as `h`?
fn header_still(wal: &(impl ReadAt + ?Sized), h: &Header) -> io::Result<bool> {
    Ok(wal::read_header(wal)?.and_then(|x| x.ok()).as_ref() == Some(h))
}

/// After a reset, where the old cycle's published frames end, given that valid frames
/// follow `from`, the end of what SQLite was seen to publish: the end of the old cycle's
/// valid chain if its last commit is in the main file (`main`, read from its start),
/// else None.
///
/// An app that checkpoints itself can publish its last commits and reset the WAL
/// between two looks of the shipper. Every commit the chain holds after `from` but the
/// last was published: the next one could only be written after it. The last was
/// too if the checkpoint that let the WAL reset copied it: then the main file holds each
/// of its pages as it wrote them (a checkpoint copies each page's last image as the WAL
/// holds it, page 1 included). A commit whose writer died before publishing it was
/// never copied; the main file shows it only where it changed nothing, and a page the
/// new cycle has copied since shows another image: both answer None, and a base is
/// sent, never a guess.
pub fn old_cycle_end(
    wal: &(impl ReadAt + ?Sized),
    main: &(impl ReadAt + ?Sized),
    from: &Cursor,
) -> io::Result<Option<u32>> {
    let chain = wal::scan(wal, from, wal::POSITIONS_ONLY)?;
    let Some(last) = chain.txns.last() else {
        return Ok(Some(from.frame));
    };
    let Pages::Frames(refs) = &last.pages else {
        unreachable!("a POSITIONS_ONLY scan keeps every transaction as frame references");
    };
    let Some(images) = wal::read_frames(wal, refs)? else {
        return Ok(None);
    };
    let mut on_disk = vec![0u8; from.page_size as usize];
    for (pgno, image) in images {
        let at = (pgno as u64 - 1) * from.page_size as u64;
        let got = main.read_at(&mut on_disk, at).unwrap_or(0);
        if got < on_disk.len() || on_disk[..] != image[..] {
            return Ok(None);
        }
    }
    Ok(Some(last.last_frame))
}

/// What rule 5 found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Counter {
    /// In range; the range to keep (its low end follows the counter up).
    InRange((u32, u32)),
    /// Below every counter seen there: the file was overwritten.
    Below(Unproven),
    /// Above the highest a page-1 image read so far carried. Legitimate if the folder's
    /// checkpoint copied a page 1 from frames the scan has not read yet (it copies all
    /// SQLite published, and the scan can be held back by its budget, or have looked
    /// before the last commits were published); the caller decides with
    /// [`counter_above`] once it knows whether the scan has caught up.
    Above { now: u32, lo: u32, hi: u32 },
}

/// Rule 5: the main file's change counter `now` against `range`, the counters it may
/// legitimately carry (`[lo, hi]`: the last seen there, the highest a page-1 image read
/// since carried). The first time, the range starts at `now`.
pub fn check_counter(range: Option<(u32, u32)>, now: u32) -> Counter {
    match range {
        None => Counter::InRange((now, now)),
        Some((lo, hi)) if lo <= now && now <= hi => Counter::InRange((now, hi)),
        Some((lo, hi)) if now < lo => Counter::Below(overwritten(now, lo, hi)),
        Some((lo, hi)) => Counter::Above { now, lo, hi },
    }
}

/// Rule 5 for a counter above the range: the file was overwritten only if the scan had
/// read every frame SQLite published when the counter was read (`caught_up`: the caller
/// reads the counter first, then where SQLite's publishing ends, which only grows, so a
/// checkpoint that copied a page 1 before the counter was read copied it from frames the
/// scan has read). Otherwise it is judged again once the scan catches up.
pub fn counter_above(now: u32, lo: u32, hi: u32, caught_up: bool) -> Result<(), Unproven> {
    if caught_up {
        Err(overwritten(now, lo, hi))
    } else {
        Ok(())
    }
}

fn overwritten(now: u32, lo: u32, hi: u32) -> Unproven {
    unproven(
        BaseReason::Replaced,
        format!(
            "the main file's change counter {now} is not one this shipper saw ({lo}..={hi}): \
             the file was overwritten"
        ),
    )
}

/// The counter range after a page-1 image carrying `counter` was read from the WAL.
pub fn raise_counters(range: Option<(u32, u32)>, counter: u32) -> (u32, u32) {
    match range {
        Some((lo, hi)) => (lo, hi.max(counter)),
        None => (counter, counter),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::testing::WalBuilder;
    use std::cell::RefCell;

    const PS: u32 = 512;

    /// The old cycle: six frames, commits at 3 and 6.
    fn old_cycle() -> WalBuilder {
        let mut w = WalBuilder::new(PS, Salts(5, 9), false);
        w.frame(2, 0, 1).frame(3, 0, 2).frame(1, 3, 3);
        w.frame(2, 0, 4).frame(3, 0, 5).frame(1, 3, 6);
        w
    }

    /// `new`'s bytes laid over `old`'s, as a writer that resets the WAL leaves them.
    fn over(new: &WalBuilder, old: &WalBuilder) -> Vec<u8> {
        let mut b = new.bytes.clone();
        if old.bytes.len() > b.len() {
            b.extend_from_slice(&old.bytes[b.len()..]);
        }
        b
    }

    fn cursor_at(w: &WalBuilder, frame: u32) -> Cursor {
        let mut c = w.header().start();
        c.checksum = wal::chain_to(&w.bytes, &w.header(), frame)
            .unwrap()
            .unwrap();
        c.frame = frame;
        c
    }

    fn reason(p: Proof) -> BaseReason {
        match p {
            Proof::Unproven(u) => u.reason,
            other => panic!("expected unproven, got {other:?}"),
        }
    }

    // Rule 3. Guards against shipping on top of a WAL rewritten below the cursor (a power
    // loss that kept the frame at the cursor but lost frames below it, or a tail lost and
    // rewritten with the same salts).
    #[test]
    fn the_same_cycle_continues_only_while_the_cursor_and_its_chain_hold() {
        let w = old_cycle();
        let at3 = cursor_at(&w, 3);
        let none = || None;
        assert_eq!(
            same_cycle(&w.bytes, &at3, &w.header(), true, none).unwrap(),
            Ok(())
        );

        // The frame at the cursor rewritten: another checksum there.
        let mut rewritten = WalBuilder::new(PS, Salts(5, 9), false);
        rewritten.frame(2, 0, 1).frame(3, 0, 2).frame(1, 3, 99);
        let got = same_cycle(&rewritten.bytes, &at3, &w.header(), false, none).unwrap();
        assert_eq!(got.unwrap_err().reason, BaseReason::Rewritten);

        // Shorter than the cursor.
        let short = &w.bytes[..wal::frame_offset(PS, 3) as usize];
        let got = same_cycle(short, &at3, &w.header(), false, none).unwrap();
        assert_eq!(got.unwrap_err().reason, BaseReason::Rewritten);

        // A frame below the cursor damaged: the cursor's frame still holds, the chain not.
        let mut damaged = w.bytes.clone();
        damaged[wal::frame_offset(PS, 2) as usize + 24 + 7] ^= 1;
        assert_eq!(
            same_cycle(&damaged, &at3, &w.header(), false, none).unwrap(),
            Ok(()),
            "the quick check only looks at the cursor's frame"
        );
        let got = same_cycle(&damaged, &at3, &w.header(), true, none).unwrap();
        assert_eq!(got.unwrap_err().reason, BaseReason::Rewritten);

        // Another page size.
        let other = WalBuilder::new(1024, Salts(5, 9), false);
        let got = same_cycle(&w.bytes, &at3, &other.header(), false, none).unwrap();
        assert_eq!(got.unwrap_err().reason, BaseReason::PageSize);
    }

    // Rule 3, §3.2. Guards against a restart shipping from a cursor saved past what SQLite
    // published (a commit whose writer died before publishing it).
    #[test]
    fn a_cursor_saved_past_what_sqlite_published_is_refused_once_per_open() {
        let w = old_cycle();
        let at6 = cursor_at(&w, 6);
        let index = |frame| {
            move || {
                Some(WalIndexEnd {
                    salts: Salts(5, 9),
                    frame,
                })
            }
        };
        let got = same_cycle(&w.bytes, &at6, &w.header(), true, index(3)).unwrap();
        assert_eq!(got.unwrap_err().reason, BaseReason::Rewritten);
        assert_eq!(
            same_cycle(&w.bytes, &at6, &w.header(), true, index(6)).unwrap(),
            Ok(())
        );
        let asked = RefCell::new(0);
        let counting = || {
            *asked.borrow_mut() += 1;
            None
        };
        same_cycle(&w.bytes, &at6, &w.header(), false, counting)
            .unwrap()
            .unwrap();
        assert_eq!(*asked.borrow(), 0, "the index is asked only with the chain");
        let other_cycle = WalIndexEnd {
            salts: Salts(6, 1),
            frame: 1,
        };
        assert!(
            !past_published(&at6, other_cycle),
            "an index of another cycle says nothing"
        );
    }

    // Rule 4. Guards against continuing across a reset that cannot be proven to have
    // happened right at the cursor: each way it can fail owes a base.
    #[test]
    fn a_reset_is_clean_only_when_it_happened_right_at_the_cursor() {
        let old = old_cycle();
        let at6 = cursor_at(&old, 6);
        let mut new = WalBuilder::new(PS, Salts(6, 77), false);
        new.frame(2, 3, 8).frame(3, 3, 9);
        let bytes = over(&new, &old);
        assert_eq!(
            new_cycle(&bytes, &at6, &new.header()).unwrap(),
            Proof::Clean
        );

        // Two resets (or a writer that never reset before): salt-1 moved by another value.
        let mut twice = WalBuilder::new(PS, Salts(7, 77), false);
        twice.frame(2, 3, 8);
        let p = new_cycle(&over(&twice, &old), &at6, &twice.header()).unwrap();
        assert_eq!(reason(p), BaseReason::Reset);

        // Another page size.
        let big = WalBuilder::new(1024, Salts(6, 77), false);
        assert_eq!(
            reason(new_cycle(&big.bytes, &at6, &big.header()).unwrap()),
            BaseReason::PageSize
        );

        // Truncated below the cursor (a TRUNCATE checkpoint, then writes).
        let p = new_cycle(&new.bytes, &at6, &new.header()).unwrap();
        assert_eq!(reason(p), BaseReason::Reset);

        // The new cycle reached the cursor's slot: it may have overwritten slot P+1 first.
        let mut long = WalBuilder::new(PS, Salts(6, 77), false);
        for i in 0..6 {
            long.frame(2, if i % 2 == 1 { 3 } else { 0 }, i);
        }
        let p = new_cycle(&over(&long, &old), &at6, &long.header()).unwrap();
        assert_eq!(reason(p), BaseReason::Reset);

        // A cursor at the start of the old cycle: slot 1 is always the new cycle's.
        let at0 = old.header().start();
        assert_eq!(
            reason(new_cycle(&over(&new, &old), &at0, &new.header()).unwrap()),
            BaseReason::Reset
        );
    }

    // Rule 4. Guards against losing the old cycle's last commits when the reset came after
    // frames the shipper had not read yet: they must be read first.
    #[test]
    fn an_old_cycle_that_goes_on_past_the_cursor_is_read_before_the_new_one() {
        let old = old_cycle();
        let at3 = cursor_at(&old, 3);
        let mut new = WalBuilder::new(PS, Salts(6, 77), false);
        new.frame(2, 3, 8);
        let bytes = over(&new, &old);
        assert_eq!(
            new_cycle(&bytes, &at3, &new.header()).unwrap(),
            Proof::OldCycleGoesOn
        );
        // Read on to frame 6: the new cycle has not reached slot 7, nothing changed.
        let at6 = cursor_at(&old, 6);
        assert_eq!(
            old_cycle_ended(&bytes, &new.header(), &at3, &at6).unwrap(),
            Ok(())
        );
        // Nothing read (no commit after the cursor): nothing proves where the cycle ended.
        let got = old_cycle_ended(&bytes, &new.header(), &at3, &at3).unwrap();
        assert_eq!(got.unwrap_err().reason, BaseReason::Reset);
        // The new cycle reached the slot after what was read.
        let mut long = WalBuilder::new(PS, Salts(6, 77), false);
        for i in 0..7 {
            long.frame(2, 3, i);
        }
        let got = old_cycle_ended(&over(&long, &old), &long.header(), &at3, &at6).unwrap();
        assert_eq!(got.unwrap_err().reason, BaseReason::Reset);
        // A second reset meanwhile: the header is not the one the proof began with.
        let mut again = WalBuilder::new(PS, Salts(7, 78), false);
        again.frame(2, 3, 8);
        let got = old_cycle_ended(&over(&again, &old), &new.header(), &at3, &at6).unwrap();
        assert_eq!(got.unwrap_err().reason, BaseReason::Reset);
    }

    /// A WAL whose reads are recorded, and whose header becomes `later` after the first
    /// `header_reads` reads of it: a second reset landing while the proof reads.
    struct Watched<'a> {
        bytes: &'a [u8],
        later: Option<&'a [u8]>,
        header_reads: RefCell<u32>,
        log: RefCell<Vec<&'static str>>,
    }

    impl ReadAt for Watched<'_> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            let what = if offset == 0 {
                *self.header_reads.borrow_mut() += 1;
                "header"
            } else if buf.len() == wal::FRAME_HEADER_BYTES {
                "reach"
            } else {
                "slot"
            };
            self.log.borrow_mut().push(what);
            let src = match self.later {
                Some(later) if offset == 0 && *self.header_reads.borrow() > 1 => later,
                _ => self.bytes,
            };
            src.read_at(buf, offset)
        }
        fn size(&self) -> io::Result<u64> {
            self.log.borrow_mut().push("length");
            Ok(self.bytes.len() as u64)
        }
    }

    // Rule 4's order. Guards against a proof whose reads race a writer: the length and
    // slot P+1 first, the new cycle's reach after, the header last, and a header that
    // changed while the proof read fails it.
    #[test]
    fn the_reset_proof_reads_length_slot_reach_then_header_and_sees_a_second_reset() {
        let old = old_cycle();
        let at6 = cursor_at(&old, 6);
        let mut new = WalBuilder::new(PS, Salts(6, 77), false);
        new.frame(2, 3, 8);
        let bytes = over(&new, &old);
        let extended = {
            let mut b = bytes.clone();
            b.extend(vec![0u8; (24 + PS) as usize]);
            b
        };
        // With a slot P+1 present (zeros: not a continuation), every read is made.
        let full = Watched {
            bytes: &extended,
            later: None,
            header_reads: RefCell::new(0),
            log: RefCell::default(),
        };
        assert_eq!(new_cycle(&full, &at6, &new.header()).unwrap(), Proof::Clean);
        assert_eq!(
            *full.log.borrow(),
            vec!["length", "slot", "reach", "header"],
            "the header must be read last"
        );

        let mut again = WalBuilder::new(PS, Salts(6, 78), false);
        again.frame(2, 3, 8);
        let racing = Watched {
            bytes: &extended,
            later: Some(&again.bytes),
            header_reads: RefCell::new(0),
            log: RefCell::default(),
        };
        // The first header read is the caller's; the proof's own read sees the new one.
        racing.read_at(&mut [0u8; 32], 0).unwrap();
        let p = new_cycle(&racing, &at6, &new.header()).unwrap();
        assert_eq!(reason(p), BaseReason::Reset);
    }

    // §3.2. Guards against shipping a last commit of the old cycle SQLite never published:
    // past the published end, it counts only if the main file holds its pages.
    #[test]
    fn the_old_cycles_last_commit_counts_only_if_the_main_file_holds_it() {
        let old = old_cycle();
        let at3 = cursor_at(&old, 3);
        // The main file as a checkpoint of the whole cycle leaves it: each page's last
        // image (pages 1..3 were written with fills 6, 4, 5).
        let page = |fill: u8| vec![fill; PS as usize];
        let main: Vec<u8> = [page(6), page(4), page(5)].concat();
        assert_eq!(old_cycle_end(&old.bytes, &main, &at3).unwrap(), Some(6));
        let stale: Vec<u8> = [page(3), page(1), page(2)].concat();
        assert_eq!(
            old_cycle_end(&old.bytes, &stale, &at3).unwrap(),
            None,
            "a main file without the last commit's pages: never a guess"
        );
        assert_eq!(
            old_cycle_end(&old.bytes, &main[..PS as usize], &at3).unwrap(),
            None,
            "a main file too short to hold them"
        );
        let at6 = cursor_at(&old, 6);
        assert_eq!(
            old_cycle_end(&old.bytes, &stale, &at6).unwrap(),
            Some(6),
            "no commit after the cursor: it ends there"
        );
    }

    // Rule 5. Guards against a main file overwritten in place: its change counter must be
    // one the shipper saw, and the range follows the counter up.
    #[test]
    fn the_change_counter_must_lie_in_the_range_seen() {
        assert_eq!(check_counter(None, 7), Counter::InRange((7, 7)));
        assert_eq!(check_counter(Some((7, 9)), 8), Counter::InRange((8, 9)));
        assert_eq!(check_counter(Some((7, 9)), 9), Counter::InRange((9, 9)));
        let Counter::Below(u) = check_counter(Some((7, 9)), 6) else {
            panic!("a counter below the range")
        };
        assert_eq!(u.reason, BaseReason::Replaced);
        assert_eq!(
            check_counter(Some((7, 9)), 10),
            Counter::Above {
                now: 10,
                lo: 7,
                hi: 9
            }
        );
    }

    // Rule 5. Guards against a base for a counter the shipper's own fold put there: the
    // folder copies every frame SQLite published, and the scan may not have read them yet
    // (held back by its budget while the receiver is away, or before the last commits
    // were published). Seen in CI as a "replaced" base while a receiver was killed
    // repeatedly. Above the range is judged only once the scan has caught up.
    #[test]
    fn a_counter_above_the_range_counts_only_once_the_scan_caught_up() {
        assert_eq!(counter_above(10, 7, 9, false), Ok(()));
        assert_eq!(
            counter_above(10, 7, 9, true).unwrap_err().reason,
            BaseReason::Replaced
        );
        assert_eq!(raise_counters(None, 4), (4, 4));
        assert_eq!(raise_counters(Some((4, 6)), 5), (4, 6));
        assert_eq!(raise_counters(Some((4, 6)), 8), (4, 8));
    }

    #[test]
    fn published_ends_keep_the_furthest_of_the_last_cycles() {
        let mut ends = PublishedEnds::default();
        let end = |s, frame| WalIndexEnd {
            salts: Salts(s, 0),
            frame,
        };
        ends.note(end(1, 5));
        ends.note(end(1, 3));
        assert_eq!(
            ends.get(Salts(1, 0)),
            Some(5),
            "an end seen is a lower bound"
        );
        for s in 2..=5 {
            ends.note(end(s, s));
        }
        assert_eq!(ends.get(Salts(1, 0)), None, "the oldest cycle is forgotten");
        assert_eq!(ends.get(Salts(5, 0)), Some(5));
    }

    #[test]
    fn an_unpublished_commit_is_rechecked_soon_then_slowly() {
        let now = Instant::now();
        let mut p = ProofState::new(None, None, now);
        let at = old_cycle().cursor();
        assert_eq!(p.recheck(), None);
        for _ in 0..UNPUBLISHED_RECHECKS_FAST {
            p.note_unpublished(at, true);
            assert_eq!(p.recheck(), Some(UNPUBLISHED_RECHECK));
        }
        p.note_unpublished(at, true);
        assert_eq!(p.recheck(), Some(UNPUBLISHED_RECHECK_SLOW));
        assert_eq!(p.unpublished_seen, u64::from(UNPUBLISHED_RECHECKS_FAST) + 1);
        p.note_unpublished(at, false);
        assert_eq!(p.recheck(), None);
        assert!(p.counters_due(now), "rule 5 is due at once");
        assert!(!p.counters_due(now + Duration::from_millis(10)));
        assert!(p.counters_due(now + IDENTITY_INTERVAL));
    }
}
