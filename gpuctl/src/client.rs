//! The HTTP client: gpud's API over its Unix socket, one typed method per route.
//!
//! hyper's HTTP/1.1 client connection on a tokio `UnixStream`, one connection per request,
//! driven by a current-thread tokio runtime (gpuctl makes one or two requests; a thread
//! pool, a connection pool or a connector service would only cost start-up time). Replies
//! are deserialized into the schema crate's types and nothing else: gpud's error bodies
//! become [`CliError::Api`] with their stable code.

use std::path::{Path, PathBuf};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;

use gpud_schema::{
    AttachCgroupRequest, ErrorBody, EventList, GpuList, GpuProcessList, RenewRequest, Reservation,
    ReservationList, ReservationRequest, WaiterList,
};

use crate::error::CliError;

/// A client for one gpud socket.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
}

impl Client {
    /// A client for the gpud listening on `socket`. Connects for each request.
    pub fn new(socket: &Path) -> Client {
        Client {
            socket: socket.to_owned(),
        }
    }

    /// `POST /v1/reservations`; may wait (long-poll) when the request asks to.
    pub async fn reserve(&self, request: &ReservationRequest) -> Result<Reservation, CliError> {
        self.call(Method::POST, "/v1/reservations", Some(request))
            .await
    }

    /// `DELETE /v1/reservations/{id}`.
    pub async fn release(&self, id: &str) -> Result<Reservation, CliError> {
        self.call::<(), _>(Method::DELETE, &format!("/v1/reservations/{id}"), None)
            .await
    }

    /// `POST /v1/reservations/{id}/renew`.
    pub async fn renew(&self, id: &str, ttl_seconds: Option<u64>) -> Result<Reservation, CliError> {
        self.call(
            Method::POST,
            &format!("/v1/reservations/{id}/renew"),
            Some(&RenewRequest { ttl_seconds }),
        )
        .await
    }

    /// `POST /v1/reservations/{id}/cgroup`: the memory limits go on that cgroup.
    pub async fn attach_cgroup(
        &self,
        id: &str,
        request: &AttachCgroupRequest,
    ) -> Result<Reservation, CliError> {
        self.call(
            Method::POST,
            &format!("/v1/reservations/{id}/cgroup"),
            Some(request),
        )
        .await
    }

    /// `GET /v1/reservations/{id}`.
    pub async fn get(&self, id: &str) -> Result<Reservation, CliError> {
        self.call::<(), _>(Method::GET, &format!("/v1/reservations/{id}"), None)
            .await
    }

    /// `GET /v1/reservations?state=…[&owner=…]`.
    pub async fn list(&self, state: &str, owner: Option<u32>) -> Result<ReservationList, CliError> {
        let mut path = format!("/v1/reservations?state={state}");
        if let Some(uid) = owner {
            path.push_str(&format!("&owner={uid}"));
        }
        self.call::<(), _>(Method::GET, &path, None).await
    }

    /// `GET /v1/reservations?label=KEY=VALUE&…`: the active ones with every label.
    pub async fn list_labelled(
        &self,
        labels: &[(String, String)],
    ) -> Result<ReservationList, CliError> {
        let path = format!("/v1/reservations?{}", selector(labels));
        self.call::<(), _>(Method::GET, &path, None).await
    }

    /// `DELETE /v1/reservations?label=KEY=VALUE&…`: releases the active ones with every
    /// label that the caller may release, and lists them.
    pub async fn release_labelled(
        &self,
        labels: &[(String, String)],
    ) -> Result<ReservationList, CliError> {
        let path = format!("/v1/reservations?{}", selector(labels));
        self.call::<(), _>(Method::DELETE, &path, None).await
    }

    /// `GET /v1/events?…` with the query already built (`since=…&kind=…`).
    pub async fn events(&self, query: &str) -> Result<EventList, CliError> {
        self.call::<(), _>(Method::GET, &format!("/v1/events?{query}"), None)
            .await
    }

    /// `GET /v1/waiters`.
    pub async fn waiters(&self) -> Result<WaiterList, CliError> {
        self.call::<(), _>(Method::GET, "/v1/waiters", None).await
    }

    /// `GET /v1/processes`.
    pub async fn processes(&self) -> Result<GpuProcessList, CliError> {
        self.call::<(), _>(Method::GET, "/v1/processes", None).await
    }

    /// `GET /v1/gpus`.
    pub async fn gpus(&self) -> Result<GpuList, CliError> {
        self.call::<(), _>(Method::GET, "/v1/gpus", None).await
    }

    /// `POST /v1/reservations` for a request that does not wait, without a runtime: the
    /// exec form (`gpuctl reserve -- COMMAND`) sends it and execs, and a tokio runtime and
    /// hyper would only add to every workload's start (docs/performance.md).
    /// `T` is the [`Reservation`] or the part of it the caller needs.
    pub fn reserve_now<T: DeserializeOwned>(
        &self,
        request: &ReservationRequest,
    ) -> Result<T, CliError> {
        self.call_blocking("POST", "/v1/reservations", request)
    }

    /// One request on a blocking `UnixStream`, `Connection: close`: the body is what
    /// follows the head (up to its `Content-Length`, else to the end). The head is parsed by
    /// `httparse`, hyper's own parser. A 2xx body becomes `T`, anything else a [`CliError`].
    fn call_blocking<B: Serialize, T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: &B,
    ) -> Result<T, CliError> {
        use std::io::{Read, Write};

        let body = serde_json::to_vec(body).map_err(|e| self.protocol(format!("encoding: {e}")))?;
        let mut stream = std::os::unix::net::UnixStream::connect(&self.socket)
            .map_err(|e| self.unreachable(&e))?;
        let mut request = format!(
            "{method} {path} HTTP/1.1\r\nhost: gpud\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(&body);
        stream
            .write_all(&request)
            .map_err(|e| self.unreachable(&e))?;
        let mut reply = Vec::with_capacity(4096);
        stream
            .read_to_end(&mut reply)
            .map_err(|e| self.unreachable(&e))?;
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut head = httparse::Response::new(&mut headers);
        let start = match head.parse(&reply) {
            Ok(httparse::Status::Complete(start)) => start,
            Ok(httparse::Status::Partial) => {
                return Err(self.unreachable(&cut_short()));
            }
            Err(e) => return Err(self.protocol(format!("not an HTTP reply ({e})"))),
        };
        let status = head
            .code
            .and_then(|code| StatusCode::from_u16(code).ok())
            .ok_or_else(|| self.protocol("an HTTP reply without a status".to_owned()))?;
        let length = head
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .and_then(|h| {
                std::str::from_utf8(h.value)
                    .ok()?
                    .trim()
                    .parse::<usize>()
                    .ok()
            });
        let rest = &reply[start..];
        let body = match length {
            Some(n) if n <= rest.len() => &rest[..n],
            Some(_) => {
                return Err(self.unreachable(&cut_short()));
            }
            None => rest,
        };
        self.decoded(status, body)
    }

    /// One request; a 2xx body becomes `T`, anything else a [`CliError`].
    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, CliError> {
        let bytes = match body {
            Some(b) => {
                serde_json::to_vec(b).map_err(|e| self.protocol(format!("encoding: {e}")))?
            }
            None => Vec::new(),
        };
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, "gpud")
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| self.protocol(format!("building the request: {e}")))?;
        let stream = UnixStream::connect(&self.socket)
            .await
            .map_err(|e| self.unreachable(&e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| self.unreachable(&e))?;
        // The connection's I/O runs beside the request; a failure there fails the request
        // too, which reports it. It ends once the reply is read and `sender` dropped.
        tokio::spawn(connection);
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| self.unreachable(&e))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| self.unreachable(&e))?
            .to_bytes();
        self.decoded(status, &body)
    }

    /// A reply as `T`, or gpud's error, or a protocol error naming the socket.
    fn decoded<T: DeserializeOwned>(&self, status: StatusCode, body: &[u8]) -> Result<T, CliError> {
        decode(status, body).map_err(|detail| match detail {
            Decoded::Api(e) => e,
            Decoded::Garbage(detail) => self.protocol(detail),
        })
    }

    fn protocol(&self, detail: String) -> CliError {
        CliError::Protocol {
            socket: self.socket.clone(),
            detail,
        }
    }

    /// A transport failure: the innermost I/O error says why (ENOENT, ECONNREFUSED, EACCES);
    /// without one, the innermost cause ("connection closed before message completed").
    fn unreachable(&self, e: &(dyn std::error::Error + 'static)) -> CliError {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
        let (mut io, mut innermost) = (None, e.to_string());
        while let Some(c) = cause {
            if let Some(found) = c.downcast_ref::<std::io::Error>() {
                io = Some(std::io::Error::new(found.kind(), found.to_string()));
            }
            innermost = c.to_string();
            cause = c.source();
        }
        let source = io.unwrap_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::ConnectionAborted, innermost)
        });
        CliError::Unreachable {
            socket: self.socket.clone(),
            source,
        }
    }
}

/// A reply that ended before its head or its `Content-Length` did.
fn cut_short() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        "connection closed before message completed",
    )
}

/// Why a reply did not decode into the expected type.
#[derive(Debug)]
enum Decoded {
    /// gpud's own error body.
    Api(CliError),
    /// Not gpud's API at all.
    Garbage(String),
}

fn decode<T: DeserializeOwned>(status: StatusCode, body: &[u8]) -> Result<T, Decoded> {
    if status.is_success() {
        return serde_json::from_slice(body).map_err(|e| {
            Decoded::Garbage(format!(
                "HTTP {status} with a body gpuctl does not understand ({e}): {}",
                snippet(body)
            ))
        });
    }
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(ErrorBody { error }) => Err(Decoded::Api(CliError::Api {
            status: status.as_u16(),
            code: error.code,
            message: error.message,
        })),
        Err(_) => Err(Decoded::Garbage(format!(
            "HTTP {status}: {}",
            snippet(body)
        ))),
    }
}

/// `label=K%3DV&label=…`.
fn selector(labels: &[(String, String)]) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("label={}", query_escaped(&format!("{k}={v}"))))
        .collect::<Vec<_>>()
        .join("&")
}

/// `text` percent-encoded for a query value: everything but unreserved characters.
fn query_escaped(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    match text.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_keep_their_code() {
        let body = br#"{"error": {"code": "no_capacity", "message": "no GPU has 4 GiB free"}}"#;
        match decode::<WaiterList>(StatusCode::CONFLICT, body) {
            Err(Decoded::Api(CliError::Api {
                status,
                code,
                message,
            })) => {
                assert_eq!((status, code.as_str()), (409, "no_capacity"));
                assert_eq!(message, "no GPU has 4 GiB free");
            }
            other => panic!("{other:?}"),
        }
    }

    /// Serves one connection on a socket in `dir` with `reply`; returns the client and what
    /// the server read.
    fn serve_once(dir: &Path, reply: &'static [u8]) -> (Client, std::thread::JoinHandle<Vec<u8>>) {
        use std::io::{Read, Write};
        let socket = dir.join("gpud.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut got = vec![0; 4096];
            let n = stream.read(&mut got).unwrap();
            got.truncate(n);
            stream.write_all(reply).unwrap();
            got
        });
        (Client::new(&socket), server)
    }

    #[test]
    fn a_blocking_call_sends_one_request_and_reads_the_reply_gpud_closes() {
        let dir = tempfile::tempdir().unwrap();
        let (client, server) = serve_once(
            dir.path(),
            b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 10\r\nconnection: close\r\n\r\n{\"id\":\"x\"}",
        );
        let body = serde_json::json!({"memory": 1024});
        let got: serde_json::Value = client
            .call_blocking("POST", "/v1/reservations", &body)
            .unwrap();
        assert_eq!(got["id"], "x");
        let sent = String::from_utf8(server.join().unwrap()).unwrap();
        assert!(
            sent.starts_with("POST /v1/reservations HTTP/1.1\r\n"),
            "{sent}"
        );
        assert!(sent.contains("content-length: 15\r\n"), "{sent}");
        assert!(sent.ends_with("\r\n\r\n{\"memory\":1024}"), "{sent}");
    }

    /// The error of a blocking reserve that gpud answers with `reply`.
    fn blocking_error(reply: &'static [u8]) -> CliError {
        let dir = tempfile::tempdir().unwrap();
        let (client, server) = serve_once(dir.path(), reply);
        let e = client
            .call_blocking::<_, serde_json::Value>("POST", "/v1/reservations", &())
            .unwrap_err();
        server.join().unwrap();
        e
    }

    #[test]
    fn a_blocking_call_gives_gpud_s_error_and_notices_a_cut_reply() {
        let e = blocking_error(
            b"HTTP/1.1 409 Conflict\r\ncontent-length: 64\r\n\r\n{\"error\": {\"code\": \"no_capacity\", \"message\": \"no GPU has room\"}}",
        );
        assert_eq!(e.code(), Some("no_capacity"), "{e}");
        let e = blocking_error(b"HTTP/1.1 201 Created\r\ncontent-length: 100\r\n\r\n{\"id\"");
        assert!(matches!(e, CliError::Unreachable { .. }), "{e}");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(query_escaped("slurm.job=42"), "slurm.job%3D42");
        assert_eq!(query_escaped("a b&c/é"), "a%20b%26c%2F%C3%A9");
    }

    #[test]
    fn foreign_replies_are_protocol_errors() {
        assert!(matches!(
            decode::<WaiterList>(StatusCode::OK, b"<html>hello</html>"),
            Err(Decoded::Garbage(_))
        ));
        assert!(matches!(
            decode::<WaiterList>(StatusCode::BAD_GATEWAY, b"bad gateway"),
            Err(Decoded::Garbage(_))
        ));
    }
}
