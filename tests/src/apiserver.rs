//! A stand-in for the Kubernetes API server, on loopback over plain HTTP: it serves the
//! ResourceClaims a test gives it and keeps the ResourceSlices written to it (create,
//! replace with the stored `resourceVersion`, conflicts as a real one answers them),
//! recording every write. gpud's kube-rs client talks to it as to a real one, through a
//! kubeconfig ([`ApiServer::kubeconfig`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::Path;
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

/// What the server holds, and the writes it saw.
#[derive(Debug, Default)]
pub struct State {
    /// ResourceClaims by `namespace/name`.
    pub claims: HashMap<String, Value>,
    /// ResourceSlices by name.
    pub slices: HashMap<String, Value>,
    /// `(method, path)` of every write.
    pub writes: Vec<(String, String)>,
    /// The body of every write, as the client sent it.
    pub bodies: Vec<Value>,
}

/// The running server.
#[derive(Debug)]
pub struct ApiServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// What it holds.
    pub state: Arc<Mutex<State>>,
    _runtime: tokio::runtime::Runtime,
}

impl ApiServer {
    /// Starts a server on a loopback port, on a runtime of its own.
    pub fn start() -> ApiServer {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let served = state.clone();
        runtime.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let state = served.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(state, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        ApiServer {
            url,
            state,
            _runtime: runtime,
        }
    }

    /// Writes a kubeconfig for this server at `path`.
    pub fn kubeconfig(&self, path: &Path) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n\
             users:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context:\n    \
             cluster: test\n    user: test\ncurrent-context: test\n",
            self.url
        );
        std::fs::write(path, text).unwrap();
    }

    /// Stores a ResourceClaim `namespace/name` with `uid`, allocated `devices` (the
    /// `status.allocation.devices.results` entries).
    pub fn claim(&self, namespace: &str, name: &str, uid: &str, results: Value) {
        let claim = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.gpud.io"}}]}},
            "status": {"allocation": {"devices": {"results": results}}}
        });
        self.state
            .lock()
            .unwrap()
            .claims
            .insert(format!("{namespace}/{name}"), claim);
    }

    /// Deletes ResourceClaim `namespace/name`.
    pub fn delete_claim(&self, namespace: &str, name: &str) {
        self.state
            .lock()
            .unwrap()
            .claims
            .remove(&format!("{namespace}/{name}"));
    }

    /// ResourceSlice `name`, as stored.
    pub fn slice(&self, name: &str) -> Option<Value> {
        self.state.lock().unwrap().slices.get(name).cloned()
    }

    /// Deletes ResourceSlice `name` (as a starting kubelet does).
    pub fn delete_slice(&self, name: &str) {
        self.state.lock().unwrap().slices.remove(name);
    }
}

fn reply(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

/// A list of `items`, as a list call answers.
fn list<'a>(kind: &str, items: impl Iterator<Item = &'a Value>) -> Response<Full<Bytes>> {
    let items: Vec<&Value> = items.collect();
    reply(
        StatusCode::OK,
        &json!({"apiVersion": "resource.k8s.io/v1", "kind": kind,
                "metadata": {"resourceVersion": "1"}, "items": items}),
    )
}

fn status(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
           "message": reason, "reason": reason, "code": code})
}

async fn handle(state: Arc<Mutex<State>>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let mut st = state.lock().unwrap();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (&method, parts.as_slice()) {
        (
            &Method::GET,
            [
                "apis",
                "resource.k8s.io",
                "v1",
                "namespaces",
                ns,
                "resourceclaims",
                name,
            ],
        ) => match st.claims.get(&format!("{ns}/{name}")) {
            Some(c) => reply(StatusCode::OK, c),
            None => reply(StatusCode::NOT_FOUND, &status(404, "NotFound")),
        },
        (&Method::GET, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
            match st.slices.get(*name) {
                Some(s) => reply(StatusCode::OK, s),
                None => reply(StatusCode::NOT_FOUND, &status(404, "NotFound")),
            }
        }
        (&Method::GET, ["apis", "resource.k8s.io", "v1", "resourceslices"]) => {
            list("ResourceSliceList", st.slices.values())
        }
        (&Method::GET, ["apis", "resource.k8s.io", "v1", "resourceclaims"]) => {
            list("ResourceClaimList", st.claims.values())
        }
        (&Method::POST, ["apis", "resource.k8s.io", "v1", "resourceslices"]) => {
            let name = body["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if st.slices.contains_key(&name) {
                return reply(StatusCode::CONFLICT, &status(409, "AlreadyExists"));
            }
            st.bodies.push(body.clone());
            let mut stored = body;
            stored["metadata"]["resourceVersion"] = json!("1");
            st.writes.push((method.to_string(), path));
            st.slices.insert(name, stored.clone());
            reply(StatusCode::CREATED, &stored)
        }
        (&Method::PUT, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
            let Some(current) = st.slices.get(*name) else {
                return reply(StatusCode::NOT_FOUND, &status(404, "NotFound"));
            };
            let version = current["metadata"]["resourceVersion"].clone();
            if body["metadata"]["resourceVersion"] != version {
                return reply(StatusCode::CONFLICT, &status(409, "Conflict"));
            }
            let next: u64 = version.as_str().unwrap_or("0").parse().unwrap_or(0) + 1;
            st.bodies.push(body.clone());
            let mut stored = body;
            stored["metadata"]["resourceVersion"] = json!(next.to_string());
            let name = (*name).to_owned();
            st.writes.push((method.to_string(), path));
            st.slices.insert(name, stored.clone());
            reply(StatusCode::OK, &stored)
        }
        _ => reply(StatusCode::NOT_FOUND, &status(404, "NotFound")),
    }
}
