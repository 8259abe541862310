//! A cursor over a message's bytes that refuses, with the field's name and offset, every
//! read the bytes cannot back. Used by the body and report decoders; no read allocates
//! more than the bytes it returns.

use super::{Fault, Rule};
use crate::value::{self, DecodeError, DecodeProblem, Value};

/// Reads fields in order from `bytes`, starting at 0.
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// What the bytes are, for messages: "body", "report".
    region: &'static str,
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8], region: &'static str) -> Reader<'a> {
        Reader {
            bytes,
            at: 0,
            region,
        }
    }

    /// The offset of the next byte to read.
    pub(super) fn at(&self) -> usize {
        self.at
    }

    pub(super) fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    pub(super) fn bytes(&mut self, len: usize, what: &str) -> Result<&'a [u8], Fault> {
        if len > self.remaining() {
            return Err(Fault::new(
                Rule::Truncated,
                format!(
                    "{what} at byte {} of the {} needs {len} bytes, but only {} remain",
                    self.at,
                    self.region,
                    self.remaining()
                ),
            ));
        }
        let taken = &self.bytes[self.at..self.at + len];
        self.at += len;
        Ok(taken)
    }

    pub(super) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], Fault> {
        let bytes = self.bytes(N, what)?;
        Ok(bytes.try_into().expect("bytes() returned N bytes"))
    }

    pub(super) fn u8(&mut self, what: &str) -> Result<u8, Fault> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(super) fn u16(&mut self, what: &str) -> Result<u16, Fault> {
        Ok(u16::from_be_bytes(self.array(what)?))
    }

    pub(super) fn u64(&mut self, what: &str) -> Result<u64, Fault> {
        Ok(u64::from_be_bytes(self.array(what)?))
    }

    pub(super) fn varint(&mut self, what: &str) -> Result<u64, Fault> {
        value::decode_varint(self.bytes, &mut self.at).map_err(|e| self.fault(e, what))
    }

    /// A varint count of items that take at least `bytes_each` bytes apiece, refused when
    /// the bytes that remain could not hold that many: a hostile count must not size an
    /// allocation.
    pub(super) fn count(&mut self, what: &str, bytes_each: usize) -> Result<usize, Fault> {
        let start = self.at;
        let count = self.varint(what)?;
        self.count_checked(count, what, bytes_each, start)
    }

    /// Checks a count already read (at `start`) as [`Reader::count`] does.
    pub(super) fn count_checked(
        &self,
        count: u64,
        what: &str,
        bytes_each: usize,
        start: usize,
    ) -> Result<usize, Fault> {
        let bytes_each = bytes_each.max(1);
        let fits = usize::try_from(count).ok().filter(|count| {
            count
                .checked_mul(bytes_each)
                .is_some_and(|needed| needed <= self.remaining())
        });
        match fits {
            Some(count) => Ok(count),
            None => Err(Fault::new(
                Rule::CountExceedsBytes,
                format!(
                    "{what} at byte {start} of the {} is {count}, but the {} bytes that remain \
                     hold at most {} items of at least {bytes_each} bytes",
                    self.region,
                    self.remaining(),
                    self.remaining() / bytes_each
                ),
            )),
        }
    }

    /// A varint length and that many bytes of UTF-8.
    pub(super) fn str(&mut self, what: &str) -> Result<&'a str, Fault> {
        let start = self.at;
        let len = self.varint(what)?;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let bytes = self.bytes(len, what)?;
        std::str::from_utf8(bytes).map_err(|e| {
            Fault::new(
                Rule::NotUtf8,
                format!(
                    "{what} at byte {start} of the {} is not UTF-8 ({e})",
                    self.region
                ),
            )
        })
    }

    pub(super) fn value(&mut self, what: &str) -> Result<Value, Fault> {
        value::decode_value(self.bytes, &mut self.at).map_err(|e| self.fault(e, what))
    }

    /// Refuses bytes after the end of the message.
    pub(super) fn finish(&self) -> Result<(), Fault> {
        if self.remaining() == 0 {
            return Ok(());
        }
        Err(Fault::new(
            Rule::TrailingBytes,
            format!(
                "{} bytes follow the end of the {} at byte {}; nothing may",
                self.remaining(),
                self.region,
                self.at
            ),
        ))
    }

    fn fault(&self, error: DecodeError, what: &str) -> Fault {
        let rule = match error.problem {
            DecodeProblem::Truncated => Rule::Truncated,
            DecodeProblem::VarintOverlong => Rule::VarintOverlong,
            DecodeProblem::VarintOverflow => Rule::VarintOverflow,
            DecodeProblem::UnknownTag(_) => Rule::ValueTag,
            DecodeProblem::NotUtf8 => Rule::NotUtf8,
            DecodeProblem::NotANumber => Rule::RealNan,
        };
        Fault::new(
            rule,
            format!(
                "{what} (from byte {} of the {}): {}",
                self.at, self.region, error
            ),
        )
    }
}
