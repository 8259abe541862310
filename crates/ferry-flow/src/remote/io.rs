//! Frames over a byte stream (docs/flow-server.md §4.1): the one reader and writer the
//! server, the worker and the tests use.

use super::proto::{self, DecodeError, Frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Why no frame was read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The stream broke (or ended inside a frame).
    #[error("the connection broke: {0}")]
    Io(#[from] std::io::Error),
    /// The bytes are not a frame: refuse them by name and close.
    #[error("a malformed frame: {0}")]
    Malformed(#[from] DecodeError),
}

/// Reads frames from a stream. Cancel-safe: bytes read before a cancelled
/// [`FrameReader::next`] are kept for the next call, so it may sit in a `select!` or a
/// timeout. Its buffer grows only as bytes arrive, so a length prefix alone costs
/// nothing, and [`FrameReader::limit`] caps what a frame may announce (before a peer
/// has said who it is, say).
pub struct FrameReader {
    buf: Vec<u8>,
    /// The unread bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    limit: usize,
}

impl Default for FrameReader {
    fn default() -> FrameReader {
        FrameReader {
            buf: Vec::new(),
            start: 0,
            end: 0,
            limit: proto::FRAME_MAX,
        }
    }
}

impl FrameReader {
    /// Frames over `limit` bytes (after the length) are refused as malformed.
    pub fn limit(&mut self, limit: usize) {
        self.limit = limit.min(proto::FRAME_MAX);
    }

    /// The next frame; `Ok(None)` at a clean end of the stream (between frames).
    pub async fn next<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
    ) -> Result<Option<Frame>, ReadError> {
        loop {
            let unread = self.end - self.start;
            let mut want = 4;
            if unread >= 4 {
                let total = proto::frame_len(&self.buf[self.start..self.end])?
                    .expect("four bytes are there");
                if total - 4 > self.limit {
                    return Err(ReadError::Malformed(DecodeError {
                        what: format!(
                            "the frame's length {} is over the {} bytes allowed here",
                            total - 4,
                            self.limit
                        ),
                    }));
                }
                if unread >= total {
                    let frame = proto::decode(&self.buf[self.start..self.start + total]);
                    self.start += total;
                    if self.start == self.end {
                        self.start = 0;
                        self.end = 0;
                        // A large frame's room is not kept for the life of the connection.
                        if self.buf.len() > (1 << 20) {
                            self.buf = Vec::new();
                        }
                    }
                    return Ok(Some(frame?));
                }
                // Room for the rest of this frame, as far as 64 KiB at a time.
                want = total.min(unread + (64 << 10));
            }
            // The unread bytes go to the front only when the frame would not fit after
            // them: each byte is moved at most once per frame it belongs to.
            if self.buf.len() - self.start < want {
                self.buf.copy_within(self.start..self.end, 0);
                self.end = unread;
                self.start = 0;
            }
            let room = (self.start + want).max(self.start + 4096);
            if self.buf.len() < room {
                self.buf.resize(room, 0);
            }
            if self.end == self.buf.len() {
                let grow = self.buf.len() + 4096;
                self.buf.resize(grow, 0);
            }
            let n = r.read(&mut self.buf[self.end..]).await?;
            if n == 0 {
                return if unread == 0 {
                    Ok(None)
                } else {
                    Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into())
                };
            }
            self.end += n;
        }
    }
}

/// Write one frame whole.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &Frame) -> std::io::Result<()> {
    w.write_all(&proto::encode(frame)).await
}
