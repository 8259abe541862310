//! The SQLite WAL format, and a scanner that yields committed transactions.
//!
//! Format (sqlite.org fileformat2.html §4; all fields big-endian):
//! - a 32-byte header: magic, format version 3007000, page size, checkpoint sequence,
//!   salt-1, salt-2, checksum-1, checksum-2 (over the header's first 24 bytes);
//! - frames of a 24-byte header (page number, database size in pages after commit or 0,
//!   salt-1, salt-2, checksum-1, checksum-2) and one page.
//!
//! A frame is valid when its salts equal the header's and its checksums equal the running
//! checksum over the header and, for every frame up to and including it, the frame
//! header's first 8 bytes and its page. A transaction is committed when its commit frame
//! (non-zero size) is valid. Everything after the first invalid frame is a write in
//! flight or leftovers of an older cycle, and is never read as data.
//!
//! Nothing here does I/O except through [`ReadAt`], so tests feed it bytes.

use std::collections::BTreeMap;
use std::io;

pub const HEADER_BYTES: usize = 32;
pub const FRAME_HEADER_BYTES: usize = 24;
/// Checksums over little-endian words.
pub const MAGIC_LE: u32 = 0x377f_0682;
/// Checksums over big-endian words.
pub const MAGIC_BE: u32 = 0x377f_0683;
pub const FORMAT_VERSION: u32 = 3_007_000;

/// A WAL's salts: they name one cycle of the WAL between two resets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Salts(pub u32, pub u32);

/// A cumulative checksum.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub struct Checksum(pub u32, pub u32);

/// Reads at an offset, the only I/O the scanner needs.
pub trait ReadAt {
    /// Fill as much of `buf` as the source holds from `offset`; return how much.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Bytes the source holds.
    fn size(&self) -> io::Result<u64>;
}

impl ReadAt for std::fs::File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let mut filled = 0;
        while filled < buf.len() {
            match FileExt::read_at(self, &mut buf[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(filled)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(crate::quiet::fstat(self)?.len)
    }
}

impl ReadAt for [u8] {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let start = (offset as usize).min(<[u8]>::len(self));
        let n = buf.len().min(<[u8]>::len(self) - start);
        buf[..n].copy_from_slice(&self[start..start + n]);
        Ok(n)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(<[u8]>::len(self) as u64)
    }
}

impl ReadAt for Vec<u8> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.as_slice().read_at(buf, offset)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.as_slice().len() as u64)
    }
}

/// Why a WAL header was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("the WAL is shorter than its 32-byte header")]
    Short,
    #[error("bad WAL magic {0:#010x}: this is not a SQLite WAL file")]
    Magic(u32),
    #[error("unsupported WAL format version {0} (expected 3007000)")]
    Version(u32),
    #[error("invalid WAL page size {0}")]
    PageSize(u32),
    #[error("the WAL header checksum does not match (a header being rewritten, or damage)")]
    Checksum,
}

/// A parsed, validated WAL header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub big_endian: bool,
    pub page_size: u32,
    pub checkpoint_seq: u32,
    pub salts: Salts,
    pub checksum: Checksum,
}

impl Header {
    pub fn parse(b: &[u8]) -> Result<Header, HeaderError> {
        if b.len() < HEADER_BYTES {
            return Err(HeaderError::Short);
        }
        let magic = be32(b, 0);
        let big_endian = match magic {
            MAGIC_LE => false,
            MAGIC_BE => true,
            other => return Err(HeaderError::Magic(other)),
        };
        let version = be32(b, 4);
        if version != FORMAT_VERSION {
            return Err(HeaderError::Version(version));
        }
        let raw_page_size = be32(b, 8);
        let page_size = if raw_page_size == 1 {
            65_536
        } else {
            raw_page_size
        };
        if !valid_page_size(page_size) {
            return Err(HeaderError::PageSize(raw_page_size));
        }
        let checksum = Checksum(be32(b, 24), be32(b, 28));
        if checksum_words(big_endian, Checksum(0, 0), &b[..24]) != checksum {
            return Err(HeaderError::Checksum);
        }
        Ok(Header {
            big_endian,
            page_size,
            checkpoint_seq: be32(b, 12),
            salts: Salts(be32(b, 16), be32(b, 20)),
            checksum,
        })
    }

    /// The cursor before this cycle's first frame.
    pub fn start(&self) -> Cursor {
        Cursor {
            salts: self.salts,
            page_size: self.page_size,
            big_endian: self.big_endian,
            frame: 0,
            checksum: self.checksum,
        }
    }
}

/// SQLite page sizes: powers of two from 512 to 65536.
pub fn valid_page_size(p: u32) -> bool {
    (512..=65_536).contains(&p) && p.is_power_of_two()
}

/// A frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub pgno: u32,
    /// Database size in pages after this commit; 0 for a frame that is not a commit.
    pub commit_size: u32,
    pub salts: Salts,
    pub checksum: Checksum,
}

impl FrameHeader {
    pub fn parse(b: &[u8]) -> FrameHeader {
        FrameHeader {
            pgno: be32(b, 0),
            commit_size: be32(b, 4),
            salts: Salts(be32(b, 8), be32(b, 12)),
            checksum: Checksum(be32(b, 16), be32(b, 20)),
        }
    }
}

/// A place in one WAL cycle: after frame `frame` (0 = before the first), whose cumulative
/// checksum is `checksum`. Because the checksum is cumulative, a frame that still validates
/// at the cursor proves the whole prefix is unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Cursor {
    pub salts: Salts,
    pub page_size: u32,
    pub big_endian: bool,
    pub frame: u32,
    pub checksum: Checksum,
}

impl Cursor {
    pub fn frame_bytes(&self) -> u64 {
        frame_bytes(self.page_size)
    }
}

pub fn frame_bytes(page_size: u32) -> u64 {
    FRAME_HEADER_BYTES as u64 + page_size as u64
}

/// Byte offset of frame `n` (1-based).
pub fn frame_offset(page_size: u32, n: u32) -> u64 {
    debug_assert!(n >= 1);
    HEADER_BYTES as u64 + (n as u64 - 1) * frame_bytes(page_size)
}

/// The checksum of `frame` (header and page, `24 + page_size` bytes) following `prev`, or
/// None if the frame is not valid at that place (other salts, or a checksum mismatch).
pub fn verify_frame(prev: &Cursor, frame: &[u8]) -> Option<(FrameHeader, Checksum)> {
    debug_assert_eq!(frame.len() as u64, prev.frame_bytes());
    let header = FrameHeader::parse(frame);
    if header.salts != prev.salts || header.pgno == 0 {
        return None;
    }
    let sum = checksum_words(prev.big_endian, prev.checksum, &frame[..8]);
    let sum = checksum_words(prev.big_endian, sum, &frame[FRAME_HEADER_BYTES..]);
    (sum == header.checksum).then_some((header, sum))
}

/// SQLite's WAL checksum over `data` (a multiple of 8 bytes), continuing from `init`:
/// for each pair of words, `s0 += x0 + s1; s1 += x1 + s0`.
pub fn checksum_words(big_endian: bool, init: Checksum, data: &[u8]) -> Checksum {
    debug_assert!(data.len().is_multiple_of(8));
    let (mut s0, mut s1) = (init.0, init.1);
    for pair in data.chunks_exact(8) {
        let (x0, x1) = if big_endian {
            (
                u32::from_be_bytes(pair[0..4].try_into().unwrap()),
                u32::from_be_bytes(pair[4..8].try_into().unwrap()),
            )
        } else {
            (
                u32::from_le_bytes(pair[0..4].try_into().unwrap()),
                u32::from_le_bytes(pair[4..8].try_into().unwrap()),
            )
        };
        s0 = s0.wrapping_add(x0).wrapping_add(s1);
        s1 = s1.wrapping_add(x1).wrapping_add(s0);
    }
    Checksum(s0, s1)
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("callers pass enough bytes"))
}

/// Page images with their page numbers, in page order.
pub type PageImages = Vec<(u32, Box<[u8]>)>;

/// Pages of one committed transaction.
#[derive(Clone, Debug)]
pub enum Pages {
    /// The last image of each page the transaction wrote, in page order.
    Inline(PageImages),
    /// Too large to hold: the last frame that wrote each page, in page order, to be read
    /// again (and verified) when shipped.
    Frames(Vec<(u32, FrameRef)>),
}

/// Where a page image lives in the WAL, with what proves it unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameRef {
    /// The cursor just before the frame; the frame must validate from it.
    pub before: Cursor,
}

impl FrameRef {
    pub fn frame(&self) -> u32 {
        self.before.frame + 1
    }
}

/// One committed transaction found by a scan.
#[derive(Clone, Debug)]
pub struct Txn {
    pub first_frame: u32,
    pub last_frame: u32,
    /// Database size in pages after this commit.
    pub commit_size: u32,
    pub pages: Pages,
    /// Change counters (bytes 24..28) of page-1 images this transaction wrote.
    pub page1_counters: Vec<u32>,
    /// WAL bytes the transaction occupies (its frames, duplicates included).
    pub wal_bytes: u64,
    /// The cursor after its commit frame.
    pub end: Cursor,
}

impl Txn {
    pub fn page_count(&self) -> usize {
        match &self.pages {
            Pages::Inline(p) => p.len(),
            Pages::Frames(p) => p.len(),
        }
    }
    pub fn page_bytes(&self) -> u64 {
        self.page_count() as u64 * self.end.page_size as u64
    }
}

/// What a scan found.
#[derive(Clone, Debug)]
pub struct Scan {
    pub txns: Vec<Txn>,
    /// After the last committed transaction found (the start cursor if none).
    pub end: Cursor,
    /// Why the scan stopped.
    pub stop: Stop,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// No further valid frame: the end of this cycle as far as it is written.
    End,
    /// The inline budget is used up; more committed frames may follow.
    Budget,
}

/// Scan limits.
#[derive(Clone, Copy, Debug)]
pub struct ScanLimits {
    /// A transaction whose pages exceed this is kept as frame references.
    pub txn_inline_bytes_max: u64,
    /// Stop after transactions holding this many bytes of pages (at least one transaction
    /// is always returned when one is committed).
    pub budget_bytes: u64,
}

/// A scan for where transactions end that holds no page in memory: every transaction is
/// kept as frame references (`Pages::Frames`: any page is more than 0 bytes), and no
/// budget stops it before the end.
pub const POSITIONS_ONLY: ScanLimits = ScanLimits {
    txn_inline_bytes_max: 0,
    budget_bytes: u64::MAX,
};

/// Bytes read per call while scanning, at most: whole frames, about 1 MiB.
const SCAN_READ_BYTES: u64 = 1 << 20;
/// Frames read by a scan's first call (then twice as many each call, up to 1 MiB).
const SCAN_FIRST_FRAMES: u64 = 8;

/// Scan committed transactions following `from`.
pub fn scan(src: &(impl ReadAt + ?Sized), from: &Cursor, limits: ScanLimits) -> io::Result<Scan> {
    let fb = from.frame_bytes();
    let frames_max = (SCAN_READ_BYTES / fb).max(1);
    // Start small and double while frames keep validating: a WAL file is usually longer
    // than its current cycle (a reset keeps the file), and reading and zeroing a megabyte
    // of stale frames on every step cost more than everything else the shipper did.
    let mut frames_next = SCAN_FIRST_FRAMES.min(frames_max);
    let mut buf = Vec::new();
    let mut cursor = *from;
    let mut committed = *from;
    let mut txns = Vec::new();
    let mut used = 0u64;
    let mut pending = PendingTxn::default();
    loop {
        let offset = frame_offset(cursor.page_size, cursor.frame + 1);
        let available = src.size()?.saturating_sub(offset) / fb;
        let frames = available.min(frames_next) as usize;
        frames_next = (frames_next * 2).min(frames_max);
        if frames == 0 {
            return Ok(Scan {
                txns,
                end: committed,
                stop: Stop::End,
            });
        }
        buf.resize(frames * fb as usize, 0);
        let n = src.read_at(&mut buf, offset)?;
        let whole = (n as u64 / fb) as usize;
        if whole == 0 {
            return Ok(Scan {
                txns,
                end: committed,
                stop: Stop::End,
            });
        }
        for i in 0..whole {
            let frame = &buf[i * fb as usize..(i + 1) * fb as usize];
            let Some((header, sum)) = verify_frame(&cursor, frame) else {
                return Ok(Scan {
                    txns,
                    end: committed,
                    stop: Stop::End,
                });
            };
            pending.add(
                &cursor,
                header.pgno,
                &frame[FRAME_HEADER_BYTES..],
                limits.txn_inline_bytes_max,
            );
            cursor.frame += 1;
            cursor.checksum = sum;
            if header.commit_size != 0 {
                let txn = std::mem::take(&mut pending).finish(header.commit_size, cursor);
                used += txn.page_bytes();
                txns.push(txn);
                committed = cursor;
                if used >= limits.budget_bytes {
                    return Ok(Scan {
                        txns,
                        end: committed,
                        stop: Stop::Budget,
                    });
                }
            }
        }
    }
}

/// The frames of a transaction whose commit frame has not been seen yet.
#[derive(Default)]
struct PendingTxn {
    first_frame: u32,
    frames: u32,
    /// Last frame per page, always kept.
    refs: BTreeMap<u32, FrameRef>,
    /// Last image per page, while the transaction is small enough.
    images: Option<BTreeMap<u32, Box<[u8]>>>,
    image_bytes: u64,
    page1_counters: Vec<u32>,
    wal_bytes: u64,
}

impl PendingTxn {
    fn add(&mut self, before: &Cursor, pgno: u32, page: &[u8], inline_max: u64) {
        if self.frames == 0 {
            self.first_frame = before.frame + 1;
            self.images = Some(BTreeMap::new());
        }
        self.frames += 1;
        self.wal_bytes += before.frame_bytes();
        self.refs.insert(pgno, FrameRef { before: *before });
        if pgno == 1 && page.len() >= 28 {
            self.page1_counters
                .push(u32::from_be_bytes(page[24..28].try_into().unwrap()));
        }
        if let Some(images) = &mut self.images {
            if images.insert(pgno, page.into()).is_none() {
                self.image_bytes += page.len() as u64;
            }
            if self.image_bytes > inline_max {
                self.images = None;
            }
        }
    }

    fn finish(self, commit_size: u32, end: Cursor) -> Txn {
        // Pages beyond the committed size were freed by this transaction (a shrink): they
        // are not part of the database after it and are not shipped.
        let pages = match self.images {
            Some(images) => Pages::Inline(
                images
                    .into_iter()
                    .filter(|(p, _)| *p <= commit_size)
                    .collect(),
            ),
            None => Pages::Frames(
                self.refs
                    .into_iter()
                    .filter(|(p, _)| *p <= commit_size)
                    .collect(),
            ),
        };
        Txn {
            first_frame: self.first_frame,
            last_frame: end.frame,
            commit_size,
            pages,
            page1_counters: self.page1_counters,
            wal_bytes: self.wal_bytes,
            end,
        }
    }
}

/// Has the cycle `header` names written its frame `n` yet? A cycle writes its frames in
/// order, each with the cycle's salts in its header (the header first, then the page), and
/// no other cycle carries them (salt-2 is drawn at random at every reset): frame `n`
/// carrying them means the cycle reached it. One read however long the cycle is, so a
/// proof that it has not reached a slot takes no longer when it is long (counting valid
/// frames did, while the app kept writing). A frame whose salts match but whose page is
/// still being written counts as reached, which errs on the side of a base.
pub fn reached(src: &(impl ReadAt + ?Sized), header: &Header, n: u32) -> io::Result<bool> {
    let mut b = [0u8; FRAME_HEADER_BYTES];
    let got = src.read_at(&mut b, frame_offset(header.page_size, n))?;
    Ok(got == FRAME_HEADER_BYTES && FrameHeader::parse(&b).salts == header.salts)
}

/// The cumulative checksum after frame `n` of the cycle `header` names, walking and
/// validating every frame from the first; None if the chain breaks before frame `n`.
pub fn chain_to(
    src: &(impl ReadAt + ?Sized),
    header: &Header,
    n: u32,
) -> io::Result<Option<Checksum>> {
    let mut cursor = header.start();
    let fb = cursor.frame_bytes() as usize;
    let mut buf = vec![0u8; fb * 256];
    while cursor.frame < n {
        let want = ((n - cursor.frame) as usize).min(256);
        let got = src.read_at(
            &mut buf[..want * fb],
            frame_offset(cursor.page_size, cursor.frame + 1),
        )? / fb;
        if got == 0 {
            return Ok(None);
        }
        for i in 0..got {
            let Some((_, sum)) = verify_frame(&cursor, &buf[i * fb..(i + 1) * fb]) else {
                return Ok(None);
            };
            cursor.frame += 1;
            cursor.checksum = sum;
        }
    }
    Ok(Some(cursor.checksum))
}

/// Read the frame `r` points at and return its page if it still validates from
/// `r.before`: the image the scan saw, unchanged.
pub fn read_verified(src: &(impl ReadAt + ?Sized), r: &FrameRef) -> io::Result<Option<Box<[u8]>>> {
    let mut frame = vec![0u8; r.before.frame_bytes() as usize];
    let n = src.read_at(&mut frame, frame_offset(r.before.page_size, r.frame()))?;
    if n < frame.len() || verify_frame(&r.before, &frame).is_none() {
        return Ok(None);
    }
    Ok(Some(frame[FRAME_HEADER_BYTES..].into()))
}

/// The pages a transaction's frame references point at, in their order, each read back
/// and verified ([`read_verified`]); None as soon as one no longer validates (the WAL
/// was rewritten since the scan).
pub fn read_frames(
    src: &(impl ReadAt + ?Sized),
    refs: &[(u32, FrameRef)],
) -> io::Result<Option<PageImages>> {
    let mut out = Vec::with_capacity(refs.len());
    for (pgno, r) in refs {
        match read_verified(src, r)? {
            Some(page) => out.push((*pgno, page)),
            None => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// `src` read only up to `len` bytes: a scan through it stops where SQLite's committed
/// frames end (`sqlite::wal_index_end`), however far valid frames go on after them.
pub struct Upto<'a, R: ?Sized> {
    pub src: &'a R,
    pub len: u64,
}

impl<R: ReadAt + ?Sized> ReadAt for Upto<'_, R> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let n = self.len.saturating_sub(offset).min(buf.len() as u64) as usize;
        if n == 0 {
            return Ok(0);
        }
        self.src.read_at(&mut buf[..n], offset)
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.src.size()?.min(self.len))
    }
}

/// Does the frame just after `cursor` hold a valid continuation of its cycle?
pub fn continues(src: &(impl ReadAt + ?Sized), cursor: &Cursor) -> io::Result<bool> {
    let mut frame = vec![0u8; cursor.frame_bytes() as usize];
    let n = src.read_at(&mut frame, frame_offset(cursor.page_size, cursor.frame + 1))?;
    Ok(n == frame.len() && verify_frame(cursor, &frame).is_some())
}

/// Does the frame at the cursor (the last one it covers) still carry the cursor's
/// checksum and salts? For frame 0 the header itself is compared.
pub fn cursor_holds(src: &(impl ReadAt + ?Sized), cursor: &Cursor) -> io::Result<bool> {
    if cursor.frame == 0 {
        let mut b = [0u8; HEADER_BYTES];
        if src.read_at(&mut b, 0)? < HEADER_BYTES {
            return Ok(false);
        }
        return Ok(Header::parse(&b)
            .is_ok_and(|h| h.salts == cursor.salts && h.checksum == cursor.checksum));
    }
    let mut h = [0u8; FRAME_HEADER_BYTES];
    if src.read_at(&mut h, frame_offset(cursor.page_size, cursor.frame))? < FRAME_HEADER_BYTES {
        return Ok(false);
    }
    let f = FrameHeader::parse(&h);
    Ok(f.salts == cursor.salts && f.checksum == cursor.checksum)
}

/// Read and parse the header, or None if the WAL is empty or shorter than a header.
pub fn read_header(
    src: &(impl ReadAt + ?Sized),
) -> io::Result<Option<Result<Header, HeaderError>>> {
    let mut b = [0u8; HEADER_BYTES];
    if src.read_at(&mut b, 0)? < HEADER_BYTES {
        return Ok(None);
    }
    Ok(Some(Header::parse(&b)))
}

/// WALs built in memory the way SQLite writes them, for the tests of every module that
/// reads one.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Build a WAL in memory the way SQLite writes one.
    pub(crate) struct WalBuilder {
        pub bytes: Vec<u8>,
        cursor: Cursor,
    }

    impl WalBuilder {
        pub fn new(page_size: u32, salts: Salts, big_endian: bool) -> Self {
            let mut b = Vec::new();
            b.extend((if big_endian { MAGIC_BE } else { MAGIC_LE }).to_be_bytes());
            b.extend(FORMAT_VERSION.to_be_bytes());
            b.extend(page_size.to_be_bytes());
            b.extend(0u32.to_be_bytes());
            b.extend(salts.0.to_be_bytes());
            b.extend(salts.1.to_be_bytes());
            let sum = checksum_words(big_endian, Checksum(0, 0), &b);
            b.extend(sum.0.to_be_bytes());
            b.extend(sum.1.to_be_bytes());
            let header = Header::parse(&b).unwrap();
            WalBuilder {
                bytes: b,
                cursor: header.start(),
            }
        }

        /// A frame whose page is `fill` repeated.
        pub fn frame(&mut self, pgno: u32, commit_size: u32, fill: u8) -> &mut Self {
            let page = vec![fill; self.cursor.page_size as usize];
            self.frame_with(pgno, commit_size, &page)
        }
    }

    impl WalBuilder {
        /// The cursor after the last frame written.
        pub fn cursor(&self) -> Cursor {
            self.cursor
        }

        /// The parsed header.
        pub fn header(&self) -> Header {
            Header::parse(&self.bytes).unwrap()
        }

        /// A frame whose page holds `page`.
        pub fn frame_with(&mut self, pgno: u32, commit_size: u32, page: &[u8]) -> &mut Self {
            assert_eq!(page.len(), self.cursor.page_size as usize);
            let mut f = Vec::new();
            f.extend(pgno.to_be_bytes());
            f.extend(commit_size.to_be_bytes());
            let sum = checksum_words(self.cursor.big_endian, self.cursor.checksum, &f);
            let sum = checksum_words(self.cursor.big_endian, sum, page);
            f.extend(self.cursor.salts.0.to_be_bytes());
            f.extend(self.cursor.salts.1.to_be_bytes());
            f.extend(sum.0.to_be_bytes());
            f.extend(sum.1.to_be_bytes());
            f.extend(page);
            self.bytes.extend(f);
            self.cursor.frame += 1;
            self.cursor.checksum = sum;
            self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::WalBuilder;
    use super::*;

    const LIMITS: ScanLimits = ScanLimits {
        txn_inline_bytes_max: 1 << 20,
        budget_bytes: 1 << 30,
    };

    fn start(w: &WalBuilder) -> Cursor {
        Header::parse(&w.bytes).unwrap().start()
    }

    #[test]
    fn a_scan_yields_whole_committed_transactions_with_the_last_image_of_each_page() {
        for big_endian in [false, true] {
            let mut w = WalBuilder::new(512, Salts(7, 9), big_endian);
            w.frame(2, 0, 1).frame(3, 0, 2).frame(2, 3, 3); // txn 1: page 2 twice
            w.frame(3, 3, 4); // txn 2
            w.frame(4, 0, 5); // uncommitted tail
            let s = scan(&w.bytes, &start(&w), LIMITS).unwrap();
            assert_eq!(s.txns.len(), 2);
            let Pages::Inline(p) = &s.txns[0].pages else {
                panic!()
            };
            assert_eq!(
                p.iter().map(|(n, d)| (*n, d[0])).collect::<Vec<_>>(),
                vec![(2, 3), (3, 2)]
            );
            assert_eq!((s.txns[0].first_frame, s.txns[0].last_frame), (1, 3));
            assert_eq!(s.end.frame, 4);
            assert_eq!(s.stop, Stop::End);
            assert!(
                continues(&w.bytes, &s.end).unwrap(),
                "frame 5 is valid, just not committed"
            );
            assert!(cursor_holds(&w.bytes, &s.end).unwrap());
        }
    }

    // Guards against shipping a torn or damaged tail: a scan must stop at the last commit
    // before the first frame that does not validate, wherever the damage is.
    #[test]
    fn a_torn_or_flipped_tail_ends_the_scan_at_the_previous_commit() {
        let mut w = WalBuilder::new(512, Salts(1, 2), false);
        w.frame(1, 1, 1).frame(2, 2, 2).frame(3, 3, 3);
        let full = w.bytes.clone();
        let frame3 = frame_offset(512, 3) as usize;
        for cut in [frame3 + 1, frame3 + 30, full.len() - 1] {
            let s = scan(&full[..cut].to_vec(), &start(&w), LIMITS).unwrap();
            assert_eq!(s.txns.len(), 2, "cut at {cut}");
        }
        for flip in [frame3 + 2, frame3 + 5, frame3 + 30, full.len() - 1] {
            let mut bad = full.clone();
            bad[flip] ^= 0x40;
            let s = scan(&bad, &start(&w), LIMITS).unwrap();
            assert_eq!(s.txns.len(), 2, "flip at {flip}");
        }
    }

    #[test]
    fn frames_of_another_cycle_are_not_read_as_data() {
        let mut old = WalBuilder::new(512, Salts(1, 2), false);
        old.frame(1, 0, 1).frame(2, 0, 1).frame(3, 3, 1);
        let mut new = WalBuilder::new(512, Salts(2, 77), false);
        new.frame(5, 5, 9);
        let mut bytes = new.bytes.clone();
        bytes.extend_from_slice(&old.bytes[bytes.len()..]);
        let s = scan(&bytes, &start(&new), LIMITS).unwrap();
        assert_eq!(s.txns.len(), 1);
        let h = Header::parse(&bytes).unwrap();
        assert!(reached(&bytes, &h, 1).unwrap());
        assert!(!reached(&bytes, &h, 2).unwrap());
        assert!(!reached(&bytes, &h, 9).unwrap(), "past the end of the file");
    }

    #[test]
    fn a_large_transaction_is_kept_as_frame_references_and_read_back_verified() {
        let mut w = WalBuilder::new(512, Salts(1, 2), false);
        for p in 1..=10 {
            w.frame(p, if p == 10 { 10 } else { 0 }, p as u8);
        }
        let limits = ScanLimits {
            txn_inline_bytes_max: 4 * 512,
            budget_bytes: 1 << 30,
        };
        let s = scan(&w.bytes, &start(&w), limits).unwrap();
        let Pages::Frames(refs) = &s.txns[0].pages else {
            panic!("expected references")
        };
        assert_eq!(refs.len(), 10);
        let page = read_verified(&w.bytes, &refs[4].1).unwrap().unwrap();
        assert_eq!(page[0], 5);
        let mut changed = w.bytes.clone();
        let at = frame_offset(512, 5) as usize + FRAME_HEADER_BYTES + 100;
        changed[at] ^= 1;
        assert!(read_verified(&changed, &refs[4].1).unwrap().is_none());
    }

    #[test]
    fn pages_beyond_a_shrunken_size_are_not_shipped() {
        let mut w = WalBuilder::new(512, Salts(1, 2), false);
        w.frame(5, 0, 1).frame(1, 3, 2);
        let s = scan(&w.bytes, &start(&w), LIMITS).unwrap();
        let Pages::Inline(p) = &s.txns[0].pages else {
            panic!()
        };
        assert_eq!(p.iter().map(|(n, _)| *n).collect::<Vec<_>>(), vec![1]);
        assert_eq!(s.txns[0].commit_size, 3);
    }

    #[test]
    fn the_budget_stops_a_scan_at_a_commit_boundary() {
        let mut w = WalBuilder::new(512, Salts(1, 2), false);
        for p in 1..=6 {
            w.frame(p, p, 0);
        }
        let limits = ScanLimits {
            txn_inline_bytes_max: 1 << 20,
            budget_bytes: 2 * 512,
        };
        let s = scan(&w.bytes, &start(&w), limits).unwrap();
        assert_eq!((s.txns.len(), s.stop, s.end.frame), (2, Stop::Budget, 2));
        let rest = scan(&w.bytes, &s.end, LIMITS).unwrap();
        assert_eq!(rest.txns.len(), 4);
    }

    #[test]
    fn bad_headers_are_named() {
        let w = WalBuilder::new(4096, Salts(1, 2), false);
        let mut b = w.bytes.clone();
        b[0] = 0;
        assert!(matches!(Header::parse(&b), Err(HeaderError::Magic(_))));
        let mut b = w.bytes.clone();
        b[17] ^= 1;
        assert_eq!(Header::parse(&b), Err(HeaderError::Checksum));
        assert_eq!(Header::parse(&w.bytes[..10]), Err(HeaderError::Short));
    }
}
