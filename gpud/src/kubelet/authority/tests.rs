use loona_hpack::{Decoder, Encoder};
use proptest::prelude::*;

use super::*;

/// What grpc-go v1.85 sends when dialled as the kubelet dials (tests/grpc-go/capture.sh).
const REGISTRATION: &[u8] = include_bytes!("../../../../tests/fixtures/grpc-go/registration.bin");
const DRA: &[u8] = include_bytes!("../../../../tests/fixtures/grpc-go/dra.bin");
const DEVICE_PLUGIN: &[u8] = include_bytes!("../../../../tests/fixtures/grpc-go/device-plugin.bin");
const FIXTURES: [(&str, &[u8]); 3] = [
    ("registration.bin", REGISTRATION),
    ("dra.bin", DRA),
    ("device-plugin.bin", DEVICE_PLUGIN),
];

type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// A frame as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut out = len[1..].to_vec();
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The frames after the preface, which must be there and whole.
fn frames(bytes: &[u8]) -> Vec<Frame> {
    let mut rest = bytes.strip_prefix(PREFACE.as_slice()).expect("a preface");
    let mut frames = Vec::new();
    while !rest.is_empty() {
        let head: [u8; FRAME_HEADER] = rest[..FRAME_HEADER].try_into().unwrap();
        let h = FrameHead::parse(&head);
        frames.push(Frame {
            kind: h.kind,
            flags: h.flags,
            stream: h.stream,
            payload: rest[FRAME_HEADER..FRAME_HEADER + h.len].to_vec(),
        });
        rest = &rest[FRAME_HEADER + h.len..];
    }
    frames
}

/// A header block as read back: its stream, END_STREAM, and its compressed bytes.
#[derive(Debug)]
struct ReadBlock {
    stream: u32,
    end_stream: bool,
    fragment: Vec<u8>,
}

/// The header blocks of `bytes` (padding and priority dropped, CONTINUATIONs joined) and the
/// other frames, in order.
fn split(bytes: &[u8]) -> (Vec<ReadBlock>, Vec<Frame>) {
    let mut blocks: Vec<ReadBlock> = Vec::new();
    let mut others = Vec::new();
    for f in frames(bytes) {
        match f.kind {
            HEADERS => {
                let mut p = f.payload.as_slice();
                if f.flags & PADDED != 0 {
                    let pad = usize::from(p[0]);
                    p = &p[1..p.len() - pad];
                }
                if f.flags & PRIORITY != 0 {
                    p = &p[PRIORITY_FIELDS..];
                }
                blocks.push(ReadBlock {
                    stream: f.stream,
                    end_stream: f.flags & END_STREAM != 0,
                    fragment: p.to_vec(),
                });
            }
            CONTINUATION => {
                let last = blocks.last_mut().unwrap();
                assert_eq!(last.stream, f.stream);
                last.fragment.extend_from_slice(&f.payload);
            }
            _ => others.push(f),
        }
    }
    (blocks, others)
}

/// Each header block of `bytes`, decoded with one decoder, as h2 decodes them.
fn decoded(bytes: &[u8]) -> Vec<(u32, bool, Fields)> {
    let mut decoder = Decoder::new();
    split(bytes)
        .0
        .into_iter()
        .map(|b| (b.stream, b.end_stream, decoder.decode(&b.fragment).unwrap()))
        .collect()
}

fn rewrite(input: &[u8]) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    Rewriter::new().feed(input, &mut out)?;
    Ok(out)
}

fn authority(fields: &[(Vec<u8>, Vec<u8>)]) -> Option<&[u8]> {
    fields
        .iter()
        .find(|(n, _)| n == b":authority")
        .map(|(_, v)| v.as_slice())
}

/// A connection: the preface, an empty SETTINGS, then `frames`.
fn connection(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    for f in frames {
        out.extend_from_slice(f);
    }
    out
}

fn request(authority: &str) -> Fields {
    [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1beta1.DevicePlugin/GetDevicePluginOptions"),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    .iter()
    .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
    .collect()
}

fn encode(encoder: &mut Encoder<'_>, fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
}

#[test]
fn grpc_go_s_socket_path_authority_becomes_localhost_and_nothing_else_changes() {
    for (name, input) in FIXTURES {
        let output = rewrite(input).unwrap();
        let before = decoded(input);
        let after = decoded(&output);
        assert!(before.len() >= 2, "{name}: {before:?}");
        assert_eq!(before.len(), after.len(), "{name}");
        for ((stream, end, fields), (stream2, end2, fields2)) in before.iter().zip(&after) {
            assert_eq!((stream, end), (stream2, end2), "{name}");
            // What h2 rejects: the socket path, percent-encoded.
            let sent = authority(fields).unwrap();
            assert!(sent.starts_with(b"%2Fvar%2Flib%2Fkubelet%2F"), "{name}");
            assert!(http::uri::Authority::try_from(sent).is_err());
            assert_eq!(authority(fields2), Some(b"localhost".as_slice()), "{name}");
            let others = |f: &[(Vec<u8>, Vec<u8>)]| -> Fields {
                f.iter()
                    .filter(|(n, _)| n != b":authority")
                    .cloned()
                    .collect()
            };
            assert_eq!(others(fields), others(fields2), "{name}");
            assert_eq!(
                fields.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                fields2.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                "{name}: the order of the fields"
            );
        }
        // Every other frame, DATA and all, passes as it was.
        assert_eq!(split(input).1, split(&output).1, "{name}");
        // Each block in one HEADERS frame, END_HEADERS set.
        for f in frames(&output) {
            assert_ne!(f.kind, CONTINUATION);
            if f.kind == HEADERS {
                assert_eq!(f.flags & !END_STREAM, END_HEADERS, "{name}");
            }
        }
    }
}

#[test]
fn later_calls_name_the_authority_by_index_so_the_decoder_lives_with_the_connection() {
    for (name, input) in FIXTURES {
        let blocks = split(input).0;
        // Decoded alone, the second call's block refers to a table entry it does not have.
        assert!(
            Decoder::new().decode(&blocks[1].fragment).is_err(),
            "{name}: the second block decodes without the first"
        );
        // And fed after the first, it is rewritten like it.
        let after = decoded(&rewrite(input).unwrap());
        assert!(
            after
                .iter()
                .all(|(_, _, f)| authority(f) == Some(b"localhost"))
        );
    }
}

#[test]
fn a_valid_authority_is_kept_and_an_invalid_one_replaced() {
    for (sent, seen) in [
        ("localhost", "localhost"),
        ("gpud.io:50051", "gpud.io:50051"),
        ("127.0.0.1:8080", "127.0.0.1:8080"),
        ("[::1]:50051", "[::1]:50051"),
        ("/var/lib/kubelet/device-plugins/kubelet.sock", "localhost"),
        ("%2Frun%2Fgpud%2Fx.sock", "localhost"),
        ("a b", "localhost"),
    ] {
        let mut encoder = Encoder::new();
        let block = encode(&mut encoder, &request(sent));
        let input = connection(&[frame(HEADERS, END_HEADERS | END_STREAM, 1, &block)]);
        let after = decoded(&rewrite(&input).unwrap());
        assert_eq!(after.len(), 1);
        assert_eq!(after[0].2, request(seen), "{sent}");
        assert!(after[0].1, "END_STREAM is kept");
    }
}

#[test]
fn padding_priority_and_continuation_frames_are_read() {
    let mut encoder = Encoder::new();
    let block = encode(&mut encoder, &request("%2Fa.sock"));
    let (one, two) = block.split_at(10);
    let (two, three) = two.split_at(5);
    let mut headers = vec![3]; // pad length
    headers.extend_from_slice(&[0x80, 0, 0, 1, 200]); // exclusive dependency on 1, weight
    headers.extend_from_slice(one);
    headers.extend_from_slice(&[0, 0, 0]);
    let input = connection(&[
        frame(HEADERS, PADDED | PRIORITY | END_STREAM, 5, &headers),
        frame(CONTINUATION, 0, 5, two),
        frame(CONTINUATION, END_HEADERS, 5, three),
        frame(0x0, END_STREAM, 5, b"\0\0\0\0\0"),
    ]);
    let output = rewrite(&input).unwrap();
    let written = frames(&output);
    assert_eq!(written.len(), 3, "SETTINGS, one HEADERS, DATA: {written:?}");
    assert_eq!(written[1].kind, HEADERS);
    assert_eq!(written[1].flags, END_STREAM | END_HEADERS);
    assert_eq!(written[1].stream, 5);
    assert_eq!(written[2], frames(&input)[4]);
    assert_eq!(decoded(&output), [(5, true, request("localhost"))]);
}

#[test]
fn a_block_over_16_kib_is_written_as_continuation_frames() {
    let mut fields = request("%2Fbig.sock");
    fields.push((b"x-big".to_vec(), vec![b'a'; 40_000]));
    let mut encoder = Encoder::new();
    let block = encode(&mut encoder, &fields);
    let input = connection(
        &block
            .chunks(10_000)
            .enumerate()
            .map(|(i, piece)| {
                let last = (i + 1) * 10_000 >= block.len();
                let flags = if last { END_HEADERS } else { 0 };
                match i {
                    0 => frame(HEADERS, flags | END_STREAM, 7, piece),
                    _ => frame(CONTINUATION, flags, 7, piece),
                }
            })
            .collect::<Vec<_>>(),
    );
    let output = rewrite(&input).unwrap();
    let written: Vec<_> = frames(&output)
        .into_iter()
        .filter(|f| f.stream == 7)
        .collect();
    let shape: Vec<_> = written
        .iter()
        .map(|f| (f.kind, f.flags, f.payload.len()))
        .collect();
    assert_eq!(shape.len(), 3, "{shape:?}");
    assert_eq!(shape[0], (HEADERS, END_STREAM, MAX_FRAME));
    assert_eq!(shape[1], (CONTINUATION, 0, MAX_FRAME));
    assert_eq!((shape[2].0, shape[2].1), (CONTINUATION, END_HEADERS));
    assert!(shape[2].2 <= MAX_FRAME);
    fields[3].1 = b"localhost".to_vec();
    assert_eq!(decoded(&output), [(7, true, fields)]);
}

#[test]
fn frames_no_client_may_send_are_errors() {
    let mut encoder = Encoder::new();
    let block = encode(&mut encoder, &request("x"));
    let (first, rest) = block.split_at(4);
    let headers = || frame(HEADERS, 0, 1, first);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "a DATA frame inside a header block",
            connection(&[headers(), frame(0x0, 0, 1, b"x")]),
        ),
        (
            "a HEADERS frame inside a header block",
            connection(&[headers(), frame(HEADERS, END_HEADERS, 3, rest)]),
        ),
        (
            "a CONTINUATION of another stream",
            connection(&[headers(), frame(CONTINUATION, END_HEADERS, 3, rest)]),
        ),
        (
            "a CONTINUATION with no block open",
            connection(&[frame(CONTINUATION, END_HEADERS, 1, rest)]),
        ),
        (
            "a block over 1 MiB",
            connection(
                &std::iter::once(frame(HEADERS, 0, 1, &[0; 16_384]))
                    .chain((0..64).map(|_| frame(CONTINUATION, 0, 1, &[0; 16_384])))
                    .collect::<Vec<_>>(),
            ),
        ),
        (
            "padding longer than the frame",
            connection(&[frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 0x82])]),
        ),
        (
            "priority fields longer than the frame",
            connection(&[frame(HEADERS, PRIORITY | END_HEADERS, 1, &[0, 0])]),
        ),
        (
            "an index past the tables",
            connection(&[frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f])]),
        ),
        (
            "a table over 4096 bytes",
            connection(&[frame(HEADERS, END_HEADERS, 1, &[0x3f, 0xe1, 0x3f, 0x82])]),
        ),
    ];
    for (what, input) in cases {
        assert!(rewrite(&input).is_err(), "{what} was accepted");
    }
}

#[test]
fn a_decoded_header_list_over_1_mib_is_an_error() {
    // A 4000-byte field in the table, then named by index 300 times: a small block that
    // would decode to more than 1 MiB.
    let mut encoder = Encoder::new();
    let mut block = encode(&mut encoder, &[(b"x-big".to_vec(), vec![b'a'; 4000])]);
    block.extend(std::iter::repeat_n(0x80 | 62, 300));
    let input = connection(&[frame(HEADERS, END_HEADERS, 1, &block)]);
    assert!(matches!(
        rewrite(&input),
        Err(Error::TooLarge { stream: 1 })
    ));
}

#[test]
fn a_client_that_does_not_speak_http2_passes_untouched() {
    for input in [
        b"GET / HTTP/1.1\r\nHost: gpud\r\n\r\n".as_slice(),
        b"PRI * HTTP/1.1\r\n".as_slice(),
    ] {
        assert_eq!(rewrite(input).unwrap(), input);
    }
}

proptest! {
    #[test]
    fn any_split_of_the_input_gives_the_same_output(
        which in 0..FIXTURES.len(),
        cuts in proptest::collection::vec(0usize..600, 0..40),
    ) {
        let input = FIXTURES[which].1;
        let whole = rewrite(input).unwrap();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (input.len() + 1)).collect();
        cuts.sort_unstable();
        let mut rewriter = Rewriter::new();
        let mut out = Vec::new();
        let mut at = 0;
        for cut in cuts.into_iter().chain([input.len()]) {
            rewriter.feed(&input[at..cut], &mut out).unwrap();
            at = cut;
        }
        prop_assert_eq!(out, whole);
    }
}

#[test]
fn byte_by_byte_gives_the_same_output() {
    for (name, input) in FIXTURES {
        let mut rewriter = Rewriter::new();
        let mut out = Vec::new();
        for b in input {
            rewriter.feed(std::slice::from_ref(b), &mut out).unwrap();
        }
        assert_eq!(out, rewrite(input).unwrap(), "{name}");
    }
}

#[tokio::test]
async fn a_connection_reads_rewritten_and_writes_untouched() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let (client, server) = UnixStream::pair().unwrap();
    let mut conn = Conn::new(server);
    let (mut client_read, mut client_write) = client.into_split();
    client_write.write_all(DRA).await.unwrap();
    drop(client_write);
    let mut read = Vec::new();
    conn.read_to_end(&mut read).await.unwrap();
    assert_eq!(read, rewrite(DRA).unwrap());
    conn.write_all(b"\0\0\0\x04\0\0\0\0\0").await.unwrap();
    conn.shutdown().await.unwrap();
    let mut written = Vec::new();
    client_read.read_to_end(&mut written).await.unwrap();
    assert_eq!(written, b"\0\0\0\x04\0\0\0\0\0");
    // Peer credentials are the socket's.
    let info = conn.connect_info();
    assert_eq!(
        info.peer_cred.map(|c| c.uid()),
        Some(nix::unistd::geteuid().as_raw())
    );
}

#[tokio::test]
async fn a_connection_that_breaks_the_rules_fails_its_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let (mut client, server) = UnixStream::pair().unwrap();
    let mut conn = Conn::new(server);
    client
        .write_all(&connection(&[frame(CONTINUATION, END_HEADERS, 1, &[0x82])]))
        .await
        .unwrap();
    let mut buf = [0; 64];
    // The preface and SETTINGS first, then the error, and again on every read after.
    let mut read = 0;
    let error = loop {
        match conn.read(&mut buf).await {
            Ok(n) => {
                assert!(n > 0);
                read += n;
            }
            Err(e) => break e,
        }
    };
    assert_eq!(read, PREFACE.len() + FRAME_HEADER);
    assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    assert_eq!(
        conn.read(&mut buf).await.unwrap_err().kind(),
        io::ErrorKind::InvalidData
    );
}
