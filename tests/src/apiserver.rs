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
    /// While set, every request is answered with this status code (503: unavailable, 429:
    /// too many requests), as an API server in trouble answers.
    pub outage: Option<u16>,
    /// While set, no request is answered (an API server that hangs).
    pub stall: bool,
    /// A slice write offering a device of this name is refused as invalid (422), as a
    /// real API server refuses a slice one of whose devices breaks a rule.
    pub refuse_device: Option<String>,
    /// Slice writes refused as invalid, with why.
    pub refused: Vec<String>,
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

/// Why a real API server would refuse `slice` as invalid: the device named in
/// `refuse_device`, or a consumable capacity whose request policy breaks the rules
/// `validateRequestPolicyRange` checks in kube-apiserver (`pkg/apis/resource/validation`).
fn invalid_slice(slice: &Value, refuse_device: Option<&str>) -> Option<String> {
    let bytes = |q: &Value| q.as_str().and_then(gpud::dra::quantity::parse);
    for (i, device) in slice["spec"]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let name = device["name"].as_str().unwrap_or_default();
        if refuse_device == Some(name) {
            return Some(format!("spec.devices[{i}]: refused device {name}"));
        }
        for (capacity, c) in device["capacity"].as_object().into_iter().flatten() {
            let Some(range) = c["requestPolicy"]["validRange"].as_object() else {
                continue;
            };
            let at = format!("spec.devices[{i}].capacity[{capacity}].requestPolicy");
            let value = bytes(&c["value"]).unwrap_or(0);
            let default = bytes(&c["requestPolicy"]["default"]).unwrap_or(0);
            let (Some(min), max, step) = (
                range.get("min").and_then(bytes),
                range.get("max").and_then(bytes),
                range.get("step").and_then(bytes),
            ) else {
                return Some(format!("{at}.validRange.min: Required value"));
            };
            let mut wrong = Vec::new();
            if min > value {
                wrong.push("min is larger than capacity value");
            }
            if default < min {
                wrong.push("default is less than min");
            }
            if let Some(max) = max {
                if min > max {
                    wrong.push("min is larger than max");
                }
                if max > value {
                    wrong.push("max is larger than capacity value");
                }
                if default > max {
                    wrong.push("default is more than max");
                }
            }
            if let Some(step) = step.filter(|s| *s > 0) {
                if min + step > value {
                    wrong.push("one step is larger than capacity value");
                }
                let on_grid = |v: u64| v >= min && (v - min).is_multiple_of(step);
                if !on_grid(default) || max.is_some_and(|m| !on_grid(m)) {
                    wrong.push("value is not a multiple of a given step");
                }
            }
            if !wrong.is_empty() {
                return Some(format!("{at}: {}", wrong.join("; ")));
            }
        }
    }
    None
}

async fn handle(state: Arc<Mutex<State>>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    loop {
        let (stall, outage) = {
            let st = state.lock().unwrap();
            (st.stall, st.outage)
        };
        if let Some(code) = outage {
            let status_code = StatusCode::from_u16(code).unwrap();
            let reason = if code == 429 {
                "TooManyRequests"
            } else {
                "ServiceUnavailable"
            };
            return reply(status_code, &status(code, reason));
        }
        if !stall {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let mut st = state.lock().unwrap();
    if (method == Method::POST || method == Method::PUT)
        && let Some(why) = invalid_slice(&body, st.refuse_device.as_deref())
    {
        st.refused.push(why.clone());
        return reply(StatusCode::UNPROCESSABLE_ENTITY, &status(422, &why));
    }
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
