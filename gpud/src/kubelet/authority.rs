//! The connections of gpud's gRPC servers on Unix sockets, with the `:authority` that
//! grpc-go sends made one that h2 accepts.
//!
//! Why: the kubelet dials its plugins with grpc-go as `grpc.Dial(socketPath, …)` and a
//! context dialer, without `WithAuthority`, so grpc-go sends the socket path, percent-encoded,
//! as the HTTP/2 `:authority` (`%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2F…`). h2, under
//! tonic, parses `:authority` as an `http::uri::Authority`, which rejects `%`, and resets
//! the stream with `PROTOCOL_ERROR`: the kubelet sees `Stream removed` and never registers
//! gpud (h2 pull request 487, which would accept it, is still open; tonic issue 1876).
//!
//! What: [`incoming`] wraps each accepted socket in a [`Conn`] whose reads pass the client's
//! bytes through a [`Rewriter`]. It re-encodes every request header block and, where
//! `:authority` is not a valid authority, replaces it with `localhost`. A valid authority is
//! kept, every other field keeps its name, value and order, every other frame passes
//! through byte for byte, and what gpud writes back is untouched. gRPC does not use the
//! authority on a Unix socket, and neither does any gpud service.
//!
//! How: header blocks are HPACK-compressed against tables that live as long as the
//! connection (grpc-go adds `:authority` to its table on the first call and names it by
//! index afterwards), so one decoder per connection follows the client's encoder and one
//! encoder per connection makes the blocks h2's decoder reads. Both tables keep HTTP/2's
//! default size (4096 bytes), which h2 announces and grpc-go honours. A re-encoded block is
//! sent as HEADERS and CONTINUATION frames of at most 16 KiB, the frame size every HTTP/2
//! peer accepts. A sequence no HTTP/2 client may send (a header block interrupted, a stray
//! CONTINUATION, a block over 1 MiB, bad padding or HPACK) fails the read with
//! `InvalidData`, which closes the connection, as h2 would have.
//!
//! Depends on nothing else in gpud.

use std::borrow::Cow;
use std::fmt;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use loona_hpack::decoder::DecoderError;
use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt as _};
use tonic::transport::server::Connected;

/// What every HTTP/2 client sends first.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The size of a frame header: length (24 bits), type, flags, stream id (31 bits).
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The stream dependency and weight a HEADERS frame with PRIORITY carries.
const PRIORITY_FIELDS: usize = 5;
/// The most a header block may hold, compressed (its frames' payloads) or decoded (as HPACK
/// counts a header list: name, value and 32 bytes per field). h2 under tonic refuses header
/// lists over 16 KiB anyway; this only bounds what a connection can make gpud buffer.
const MAX_BLOCK: usize = 1 << 20;
/// The largest frame payload written: HTTP/2's minimum `SETTINGS_MAX_FRAME_SIZE`, which
/// every peer accepts whatever it announced.
const MAX_FRAME: usize = 16_384;
/// HTTP/2's default `SETTINGS_HEADER_TABLE_SIZE`: the most the client's encoder may use
/// (h2 never announces another), and what h2's decoder allows gpud's encoder.
const TABLE_SIZE: usize = 4096;
/// The `:authority` put in place of one h2 would reject.
const FALLBACK: &[u8] = b"localhost";
/// How much is read from the socket at once.
const READ_CHUNK: usize = 16_384;

/// A sequence of frames no HTTP/2 client may send, or a header block that cannot be decoded.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another frame came while a header block was still open.
    #[error(
        "a frame of type {kind} on stream {stream} interrupted the header block of stream {open}"
    )]
    Interrupted {
        /// The stream whose block was open.
        open: u32,
        /// The interrupting frame's type.
        kind: u8,
        /// The interrupting frame's stream.
        stream: u32,
    },
    /// A CONTINUATION frame with no header block open.
    #[error("a CONTINUATION frame on stream {stream} with no header block open")]
    StrayContinuation {
        /// Its stream.
        stream: u32,
    },
    /// A header block over [`MAX_BLOCK`], compressed or decoded.
    #[error("the header block of stream {stream} is over {MAX_BLOCK} bytes")]
    TooLarge {
        /// Its stream.
        stream: u32,
    },
    /// A HEADERS frame whose padding or priority fields are longer than its payload.
    #[error("the HEADERS frame of stream {stream} is shorter than its padding and priority")]
    Padding {
        /// Its stream.
        stream: u32,
    },
    /// The header block is not valid HPACK.
    #[error("the header block of stream {stream} cannot be decoded")]
    Hpack {
        /// Its stream.
        stream: u32,
        /// What the decoder found.
        #[source]
        source: DecoderError,
    },
}

/// A frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FrameHead {
    len: usize,
    kind: u8,
    flags: u8,
    stream: u32,
}

impl FrameHead {
    fn parse(b: &[u8; FRAME_HEADER]) -> FrameHead {
        FrameHead {
            len: usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]),
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5] & 0x7f, b[6], b[7], b[8]]),
        }
    }
}

/// A header block being collected: the HEADERS frame's fragment and its CONTINUATIONs'.
#[derive(Debug)]
struct Block {
    stream: u32,
    end_stream: bool,
    fragment: Vec<u8>,
}

/// Where the rewriter is in the client's bytes.
#[derive(Debug)]
enum State {
    /// Within the client preface: how many of its bytes came.
    Preface(usize),
    /// Not an HTTP/2 client: everything passes, for h2 to refuse.
    Transparent,
    /// Reading a frame header: `head[..head_len]`.
    Head,
    /// Passing on this many more payload bytes of a frame.
    Pass(usize),
    /// Collecting the payload of a HEADERS or CONTINUATION frame.
    Collect { frame: FrameHead, payload: Vec<u8> },
}

/// Rewrites the client's side of one HTTP/2 connection, fed in pieces of any size: pure, no
/// I/O.
pub struct Rewriter {
    state: State,
    head: [u8; FRAME_HEADER],
    head_len: usize,
    block: Option<Block>,
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
}

impl fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rewriter")
            .field("state", &self.state)
            .field("block", &self.block)
            .finish_non_exhaustive()
    }
}

impl Default for Rewriter {
    fn default() -> Self {
        Rewriter::new()
    }
}

impl Rewriter {
    /// A rewriter for a new connection, before its preface.
    pub fn new() -> Rewriter {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Rewriter {
            state: State::Preface(0),
            head: [0; FRAME_HEADER],
            head_len: 0,
            block: None,
            decoder,
            encoder: Encoder::new(),
        }
    }

    /// Takes the next bytes the client sent and appends what h2 is to read instead to `out`.
    /// An error means the connection must close; the rewriter is then of no further use.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
        while !input.is_empty() {
            match &mut self.state {
                State::Preface(seen) => {
                    let expected = PREFACE.get(*seen..).unwrap_or_default();
                    let n = expected.len().min(input.len());
                    let (now, rest) = input.split_at(n);
                    if expected.get(..n) != Some(now) {
                        self.state = State::Transparent;
                        continue;
                    }
                    out.extend_from_slice(now);
                    input = rest;
                    *seen += n;
                    if *seen == PREFACE.len() {
                        self.state = State::Head;
                    }
                }
                State::Transparent => {
                    out.extend_from_slice(input);
                    input = &[];
                }
                State::Head => {
                    let n = (FRAME_HEADER - self.head_len).min(input.len());
                    let (now, rest) = input.split_at(n);
                    if let Some(slot) = self.head.get_mut(self.head_len..self.head_len + n) {
                        slot.copy_from_slice(now);
                    }
                    self.head_len += n;
                    input = rest;
                    if self.head_len == FRAME_HEADER {
                        self.head_len = 0;
                        let frame = FrameHead::parse(&self.head);
                        self.start(frame, out)?;
                    }
                }
                State::Pass(remaining) => {
                    let n = (*remaining).min(input.len());
                    let (now, rest) = input.split_at(n);
                    out.extend_from_slice(now);
                    input = rest;
                    *remaining -= n;
                    if *remaining == 0 {
                        self.state = State::Head;
                    }
                }
                State::Collect { frame, payload } => {
                    let n = (frame.len - payload.len()).min(input.len());
                    let (now, rest) = input.split_at(n);
                    payload.extend_from_slice(now);
                    input = rest;
                    if payload.len() == frame.len {
                        let frame = *frame;
                        let payload = std::mem::take(payload);
                        self.state = State::Head;
                        self.collected(frame, payload, out)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A frame header has come: pass it on, or start collecting a header block's frame.
    fn start(&mut self, frame: FrameHead, out: &mut Vec<u8>) -> Result<(), Error> {
        match (&self.block, frame.kind) {
            (Some(open), CONTINUATION) if open.stream == frame.stream => {}
            (Some(open), kind) => {
                return Err(Error::Interrupted {
                    open: open.stream,
                    kind,
                    stream: frame.stream,
                });
            }
            (None, CONTINUATION) => {
                return Err(Error::StrayContinuation {
                    stream: frame.stream,
                });
            }
            (None, HEADERS) => {}
            (None, _) => {
                out.extend_from_slice(&self.head);
                if frame.len > 0 {
                    self.state = State::Pass(frame.len);
                }
                return Ok(());
            }
        }
        let open = self.block.as_ref().map_or(0, |b| b.fragment.len());
        if open.saturating_add(frame.len) > MAX_BLOCK {
            return Err(Error::TooLarge {
                stream: frame.stream,
            });
        }
        if frame.len == 0 {
            return self.collected(frame, Vec::new(), out);
        }
        self.state = State::Collect {
            frame,
            payload: Vec::with_capacity(frame.len),
        };
        Ok(())
    }

    /// A HEADERS or CONTINUATION frame's payload has come whole.
    fn collected(
        &mut self,
        frame: FrameHead,
        mut payload: Vec<u8>,
        out: &mut Vec<u8>,
    ) -> Result<(), Error> {
        if frame.kind == HEADERS {
            let bad = || Error::Padding {
                stream: frame.stream,
            };
            let mut start = 0;
            let mut end = payload.len();
            if frame.flags & PADDED != 0 {
                let pad = usize::from(*payload.first().ok_or_else(bad)?);
                start = 1;
                end = end.checked_sub(pad).ok_or_else(bad)?;
            }
            if frame.flags & PRIORITY != 0 {
                start += PRIORITY_FIELDS;
            }
            if start > end {
                return Err(bad());
            }
            payload.truncate(end);
            payload.drain(..start);
            self.block = Some(Block {
                stream: frame.stream,
                end_stream: frame.flags & END_STREAM != 0,
                fragment: payload,
            });
        } else if let Some(block) = &mut self.block {
            block.fragment.extend_from_slice(&payload);
        }
        if frame.flags & END_HEADERS != 0
            && let Some(block) = self.block.take()
        {
            self.rewrite(&block, out)?;
        }
        Ok(())
    }

    /// Decodes a whole header block, replaces an `:authority` h2 would reject, and writes
    /// the block, encoded again, as frames.
    fn rewrite(&mut self, block: &Block, out: &mut Vec<u8>) -> Result<(), Error> {
        let mut fields = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(
                &block.fragment,
                |name: Cow<'_, [u8]>, value: Cow<'_, [u8]>| {
                    size = size.saturating_add(name.len() + value.len() + 32);
                    if size <= MAX_BLOCK {
                        fields.push((name.into_owned(), value.into_owned()));
                    }
                },
            )
            .map_err(|source| Error::Hpack {
                stream: block.stream,
                source,
            })?;
        if size > MAX_BLOCK {
            return Err(Error::TooLarge {
                stream: block.stream,
            });
        }
        for (name, value) in &mut fields {
            if name.as_slice() == b":authority"
                && http::uri::Authority::try_from(value.as_slice()).is_err()
            {
                tracing::trace!(
                    stream = block.stream,
                    authority = %String::from_utf8_lossy(value),
                    "`:authority` replaced with localhost"
                );
                *value = FALLBACK.to_vec();
            }
        }
        let encoded = self
            .encoder
            .encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        write_block(block.stream, block.end_stream, &encoded, out);
        Ok(())
    }
}

/// Writes `block` for `stream` as a HEADERS frame and as many CONTINUATION frames as
/// [`MAX_FRAME`] needs, END_HEADERS on the last.
fn write_block(stream: u32, end_stream: bool, block: &[u8], out: &mut Vec<u8>) {
    let mut rest = block;
    let mut kind = HEADERS;
    let mut flags = if end_stream { END_STREAM } else { 0 };
    loop {
        let (piece, tail) = rest.split_at(rest.len().min(MAX_FRAME));
        let last = tail.is_empty();
        let len = piece.len().to_be_bytes();
        out.extend_from_slice(len.get(len.len() - 3..).unwrap_or_default());
        out.push(kind);
        out.push(if last { flags | END_HEADERS } else { flags });
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(piece);
        if last {
            return;
        }
        rest = tail;
        kind = CONTINUATION;
        flags = 0;
    }
}

/// An accepted connection: reads are the client's bytes rewritten, writes go straight to
/// the socket.
#[derive(Debug)]
pub struct Conn {
    stream: UnixStream,
    rewriter: Rewriter,
    /// Rewritten bytes not yet read, from `ready[taken..]`.
    ready: Vec<u8>,
    taken: usize,
    /// What the socket gave, before it is rewritten.
    raw: Box<[u8]>,
    /// Why the rewriter failed: every read after what it had rewritten fails.
    failed: Option<String>,
}

impl Conn {
    fn new(stream: UnixStream) -> Conn {
        Conn {
            stream,
            rewriter: Rewriter::new(),
            ready: Vec::new(),
            taken: 0,
            raw: vec![0; READ_CHUNK].into_boxed_slice(),
            failed: None,
        }
    }
}

/// The connections `listener` accepts, each a [`Conn`]: what a tonic server is served on.
pub fn incoming(listener: UnixListener) -> impl Stream<Item = io::Result<Conn>> {
    UnixListenerStream::new(listener).map(|accepted| accepted.map(Conn::new))
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if let Some(ready) = this.ready.get(this.taken..)
                && !ready.is_empty()
            {
                let n = ready.len().min(buf.remaining());
                buf.put_slice(ready.get(..n).unwrap_or_default());
                this.taken += n;
                if this.taken == this.ready.len() {
                    this.ready.clear();
                    this.taken = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if let Some(error) = &this.failed {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    error.clone(),
                )));
            }
            let mut raw = ReadBuf::new(&mut this.raw);
            ready!(Pin::new(&mut this.stream).poll_read(cx, &mut raw))?;
            let input = raw.filled();
            if input.is_empty() {
                return Poll::Ready(Ok(()));
            }
            // What came before the error is read first, then the error, as h2 would see it.
            if let Err(e) = this.rewriter.feed(input, &mut this.ready) {
                tracing::warn!(error = %e, "closing a gRPC connection that is not valid HTTP/2");
                this.failed = Some(e.to_string());
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Connected for Conn {
    type ConnectInfo = <UnixStream as Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

#[cfg(test)]
mod tests;
