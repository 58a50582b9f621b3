//! The bytes grpc-go sends when the kubelet calls a plugin, replayed against gpud's sockets.
//!
//! `tests/fixtures/grpc-go/*.bin` each hold one connection of a grpc-go v1.85 client dialled
//! as the kubelet dials (the socket path as its target, no `WithAuthority`: the path,
//! percent-encoded, is the `:authority`), captured by `tests/grpc-go/capture.sh` against a
//! listener that answered nothing but SETTINGS. [`replay`] sends its frames in order,
//! without the ones that ended the calls at their deadline (RST_STREAM, GOAWAY) and without
//! the listener's SETTINGS acknowledged (it acknowledges gpud's own instead), waits for each
//! call's answer before the next call, and decodes the answers.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use loona_hpack::Decoder;

use crate::PATIENCE;

/// `registration.bin`: the plugin watcher's `GetInfo`, then `NotifyRegistrationStatus`
/// (registered), on `/var/lib/kubelet/plugins_registry/gpu.gpud.io-reg.sock`.
pub const REGISTRATION: &[u8] = include_bytes!("../fixtures/grpc-go/registration.bin");
/// `dra.bin`: `NodePrepareResources`, `NodeUnprepareResources`, `NodePrepareResources` of
/// claim `ml/reuse` ([`DRA_CLAIM_UID`]), DRA v1.
pub const DRA: &[u8] = include_bytes!("../fixtures/grpc-go/dra.bin");
/// The uid of the claim in [`DRA`].
pub const DRA_CLAIM_UID: &str = "4f1c9e52-7d5b-4c1e-9a43-1d2b3c4d5e6f";
/// `device-plugin.bin`: the device manager's `GetDevicePluginOptions`, twice.
pub const DEVICE_PLUGIN: &[u8] = include_bytes!("../fixtures/grpc-go/device-plugin.bin");

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const ACK: u8 = 0x1;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// One HTTP/2 frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// The frame as sent.
    pub fn bytes(&self) -> Vec<u8> {
        let len = u32::try_from(self.payload.len()).unwrap().to_be_bytes();
        let mut out = len[1..].to_vec();
        out.extend_from_slice(&[self.kind, self.flags]);
        out.extend_from_slice(&self.stream.to_be_bytes());
        out.extend_from_slice(&self.payload);
        out
    }

    fn head(b: &[u8; 9]) -> (usize, Frame) {
        let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
        let frame = Frame {
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5] & 0x7f, b[6], b[7], b[8]]),
            payload: Vec::new(),
        };
        (len, frame)
    }
}

/// The client's frames of a capture, after its preface.
pub fn frames(capture: &[u8]) -> Vec<Frame> {
    let mut rest = capture
        .strip_prefix(PREFACE)
        .expect("a capture starts with the client preface");
    let mut frames = Vec::new();
    while !rest.is_empty() {
        let (len, mut frame) = Frame::head(rest[..9].try_into().unwrap());
        frame.payload = rest[9..9 + len].to_vec();
        rest = &rest[9 + len..];
        frames.push(frame);
    }
    frames
}

/// What the server answered on one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    /// The stream.
    pub stream: u32,
    /// `:status`.
    pub status: Option<String>,
    /// `grpc-status`, from the trailers (or a trailers-only answer).
    pub grpc_status: Option<String>,
    /// `grpc-message`.
    pub grpc_message: Option<String>,
    /// The answer's message: its DATA after the 5-byte gRPC prefix.
    pub message: Vec<u8>,
    /// How the stream ended otherwise: reset with its error code, or the connection gone.
    pub failure: Option<String>,
}

/// The connection, from the client's side.
struct Client {
    socket: UnixStream,
    decoder: Decoder<'static>,
    /// The header block being read: its stream, END_STREAM, and its bytes so far.
    block: Option<(u32, bool, Vec<u8>)>,
    answers: BTreeMap<u32, Answer>,
    /// Set once the server closed the connection or said GOAWAY.
    closed: Option<String>,
}

impl Client {
    fn send(&mut self, bytes: &[u8]) {
        // A closed connection shows in what is read next.
        let _ = self.socket.write_all(bytes);
    }

    /// The next frame from the server; `None` once it closed the connection.
    fn read(&mut self) -> Option<Frame> {
        let mut head = [0; 9];
        match self.socket.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return None,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
            Err(e) => panic!("no answer from gpud within {PATIENCE:?}: {e}"),
        }
        let (len, mut frame) = Frame::head(&head);
        frame.payload = vec![0; len];
        self.socket.read_exact(&mut frame.payload).ok()?;
        Some(frame)
    }

    fn answer(&mut self, stream: u32) -> &mut Answer {
        self.answers.entry(stream).or_insert_with(|| Answer {
            stream,
            ..Answer::default()
        })
    }

    /// Reads and handles the server's frames until `stream` has ended.
    fn until_ended(&mut self, stream: u32) {
        loop {
            if let Some(why) = &self.closed {
                let why = why.clone();
                self.answer(stream).failure.get_or_insert(why);
                return;
            }
            let Some(frame) = self.read() else {
                self.closed = Some("the connection was closed".to_owned());
                continue;
            };
            if self.handle(frame) == Some(stream) {
                return;
            }
        }
    }

    /// Handles one of the server's frames; the stream it ended, if any.
    fn handle(&mut self, frame: Frame) -> Option<u32> {
        match frame.kind {
            SETTINGS if frame.flags & ACK == 0 => {
                self.send(
                    &Frame {
                        kind: SETTINGS,
                        flags: ACK,
                        stream: 0,
                        payload: Vec::new(),
                    }
                    .bytes(),
                );
                None
            }
            PING if frame.flags & ACK == 0 => {
                self.send(
                    &Frame {
                        flags: ACK,
                        ..frame
                    }
                    .bytes(),
                );
                None
            }
            HEADERS => {
                let mut p = frame.payload.as_slice();
                if frame.flags & PADDED != 0 {
                    let pad = usize::from(p[0]);
                    p = &p[1..p.len() - pad];
                }
                if frame.flags & PRIORITY != 0 {
                    p = &p[5..];
                }
                self.block = Some((frame.stream, frame.flags & END_STREAM != 0, p.to_vec()));
                self.end_of_block(frame.flags)
            }
            CONTINUATION => {
                let (_, _, block) = self.block.as_mut().expect("a CONTINUATION in a block");
                block.extend_from_slice(&frame.payload);
                self.end_of_block(frame.flags)
            }
            DATA => {
                let mut p = frame.payload.as_slice();
                if frame.flags & PADDED != 0 {
                    let pad = usize::from(p[0]);
                    p = &p[1..p.len() - pad];
                }
                self.answer(frame.stream).message.extend_from_slice(p);
                (frame.flags & END_STREAM != 0).then_some(frame.stream)
            }
            RST_STREAM => {
                let code = u32::from_be_bytes(frame.payload[..4].try_into().unwrap());
                self.answer(frame.stream).failure = Some(format!(
                    "the stream was reset with error code {code} ({})",
                    reason(code)
                ));
                Some(frame.stream)
            }
            GOAWAY => {
                let code = u32::from_be_bytes(frame.payload[4..8].try_into().unwrap());
                self.closed = Some(format!(
                    "the server sent GOAWAY, error code {code} ({}): {}",
                    reason(code),
                    String::from_utf8_lossy(&frame.payload[8..])
                ));
                None
            }
            _ => None,
        }
    }

    /// At END_HEADERS, decodes the block into its stream's answer.
    fn end_of_block(&mut self, flags: u8) -> Option<u32> {
        if flags & END_HEADERS == 0 {
            return None;
        }
        let (stream, end_stream, block) = self.block.take().unwrap();
        let fields = self.decoder.decode(&block).unwrap();
        let answer = self.answer(stream);
        for (name, value) in fields {
            let value = Some(String::from_utf8_lossy(&value).into_owned());
            match name.as_slice() {
                b":status" => answer.status = value,
                b"grpc-status" => answer.grpc_status = value,
                b"grpc-message" => answer.grpc_message = value,
                _ => {}
            }
        }
        end_stream.then_some(stream)
    }
}

/// The name of an HTTP/2 error code.
fn reason(code: u32) -> &'static str {
    match code {
        0 => "NO_ERROR",
        1 => "PROTOCOL_ERROR",
        2 => "INTERNAL_ERROR",
        3 => "FLOW_CONTROL_ERROR",
        6 => "FRAME_SIZE_ERROR",
        7 => "REFUSED_STREAM",
        8 => "CANCEL",
        9 => "COMPRESSION_ERROR",
        11 => "ENHANCE_YOUR_CALM",
        _ => "other",
    }
}

/// Replays `capture` on `socket`: the answer of each call, in the order of the calls.
pub fn replay(socket: &Path, capture: &[u8]) -> Vec<Answer> {
    let stream = UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", socket.display()));
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut client = Client {
        socket: stream,
        decoder: Decoder::new(),
        block: None,
        answers: BTreeMap::new(),
        closed: None,
    };
    client.send(PREFACE);
    let mut calls = Vec::new();
    for frame in frames(capture) {
        let skip = matches!(frame.kind, RST_STREAM | GOAWAY)
            || (frame.kind == SETTINGS && frame.flags & ACK != 0);
        if skip {
            continue;
        }
        client.send(&frame.bytes());
        if frame.stream != 0 && !calls.contains(&frame.stream) {
            calls.push(frame.stream);
        }
        let ends_request = frame.flags & END_STREAM != 0
            && (frame.kind == DATA || frame.kind == HEADERS && frame.flags & END_HEADERS != 0);
        if ends_request {
            client.until_ended(frame.stream);
        }
    }
    calls
        .into_iter()
        .map(|stream| {
            let mut answer = client.answer(stream).clone();
            answer.message = message(&answer.message);
            answer
        })
        .collect()
}

/// The one message in a gRPC answer's DATA: after its prefix (not compressed, a 4-byte
/// length), which must cover the rest. Empty when there is none.
fn message(data: &[u8]) -> Vec<u8> {
    let Some((prefix, message)) = data.split_at_checked(5) else {
        assert!(data.is_empty(), "a partial gRPC prefix: {data:?}");
        return Vec::new();
    };
    assert_eq!(prefix[0], 0, "a compressed answer");
    let len = u32::from_be_bytes(prefix[1..].try_into().unwrap());
    assert_eq!(
        usize::try_from(len).unwrap(),
        message.len(),
        "one whole message"
    );
    message.to_vec()
}
