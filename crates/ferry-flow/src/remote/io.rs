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
    filled: usize,
    limit: usize,
}

impl Default for FrameReader {
    fn default() -> FrameReader {
        FrameReader {
            buf: Vec::new(),
            filled: 0,
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
            if self.filled >= 4 {
                let total =
                    proto::frame_len(&self.buf[..self.filled])?.expect("four bytes are there");
                if total - 4 > self.limit {
                    return Err(ReadError::Malformed(DecodeError {
                        what: format!(
                            "the frame's length {} is over the {} bytes allowed here",
                            total - 4,
                            self.limit
                        ),
                    }));
                }
                if self.filled >= total {
                    let frame = proto::decode(&self.buf[..total]);
                    self.buf.copy_within(total..self.filled, 0);
                    self.filled -= total;
                    // A large frame's room is not kept for the life of the connection.
                    if self.buf.len() > (1 << 20) && self.filled < (1 << 16) {
                        self.buf.truncate(1 << 16);
                        self.buf.shrink_to_fit();
                    }
                    return Ok(Some(frame?));
                }
                // Room for the rest of this frame, as far as 64 KiB at a time.
                let want = total.min(self.filled + (64 << 10));
                if self.buf.len() < want {
                    self.buf.resize(want, 0);
                }
            } else if self.buf.len() < 4096 {
                self.buf.resize(4096, 0);
            }
            let n = r.read(&mut self.buf[self.filled..]).await?;
            if n == 0 {
                return if self.filled == 0 {
                    Ok(None)
                } else {
                    Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into())
                };
            }
            self.filled += n;
        }
    }
}

/// Write one frame whole.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &Frame) -> std::io::Result<()> {
    w.write_all(&proto::encode(frame)).await
}
