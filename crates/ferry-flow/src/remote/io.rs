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

/// The next frame; `Ok(None)` at a clean end of the stream (between frames). `buf` is
/// reused from call to call. A length over the limit is refused before its bytes arrive.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Option<Frame>, ReadError> {
    buf.clear();
    buf.resize(4, 0);
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut buf[got..4]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into())
            };
        }
        got += n;
    }
    let total = proto::frame_len(buf)?.expect("four bytes are there");
    buf.resize(total, 0);
    r.read_exact(&mut buf[4..]).await?;
    Ok(Some(proto::decode(buf)?))
}

/// Write one frame whole.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &Frame) -> std::io::Result<()> {
    w.write_all(&proto::encode(frame)).await
}
