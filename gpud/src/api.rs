//! HTTP routes: parse a request into a typed broker call, run it, encode the result.
//!
//! Depends on `broker` and the `gpud-schema` wire types; never on SQLite or NVML. The
//! caller's identity comes from the connection (SO_PEERCRED), passed in by `server`.
//! [`status_for`] is the one mapping from domain errors to HTTP statuses.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde::Serialize;

use gpud_schema::{self as schema, MemoryAmount, MemorySpec, codes};

use crate::broker::{Broker, BrokerError, Caller, ReserveOutcome, ReserveRequest};
use crate::clock::rfc3339;
use crate::isolation::{TargetError, Workloads};
use crate::metrics::Metrics;
use crate::model::{
    self, EventFilter, EventKind, MemoryAsk, Millis, Page, Policy, ReservationState, Topology,
};
use crate::probe::link_cell;

use gpud_schema::limits::{
    MAX_DEVICES, MAX_ID_LEN, MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, MAX_LABELS_BYTES,
};

/// What every request handler shares.
#[derive(Debug)]
pub struct Api {
    /// The application.
    pub broker: Arc<Broker>,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// How long a body may take to arrive once the headers are in.
    pub body_timeout: Duration,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Where workloads' cgroups are.
    pub workloads: Arc<Workloads>,
}

/// An error on its way to becoming a JSON response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// The methods the route takes, for the `Allow` header of a 405.
    allow: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            allow: None,
        }
    }

    fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_REQUEST, message)
    }
}

/// The HTTP status and stable code for a broker error.
pub fn status_for(e: &BrokerError) -> (StatusCode, &'static str) {
    match e {
        BrokerError::Invalid(_) => (StatusCode::BAD_REQUEST, codes::INVALID_REQUEST),
        BrokerError::Unsatisfiable(_) => (StatusCode::UNPROCESSABLE_ENTITY, codes::UNSATISFIABLE),
        BrokerError::NoCapacity(_) => (StatusCode::CONFLICT, codes::NO_CAPACITY),
        BrokerError::WaitTimeout(_) => (StatusCode::REQUEST_TIMEOUT, codes::WAIT_TIMEOUT),
        BrokerError::Forbidden(_) => (StatusCode::FORBIDDEN, codes::FORBIDDEN),
        BrokerError::Holder(e) if e.is_gpud_s_fault() => {
            (StatusCode::SERVICE_UNAVAILABLE, codes::OUT_OF_RESOURCES)
        }
        BrokerError::Holder(e) if e.is_forbidden() => (StatusCode::FORBIDDEN, codes::FORBIDDEN),
        BrokerError::Holder(_) => (StatusCode::BAD_REQUEST, codes::INVALID_REQUEST),
        BrokerError::QuotaExceeded(_) => (StatusCode::FORBIDDEN, codes::QUOTA_EXCEEDED),
        BrokerError::RateLimited(_) => (StatusCode::TOO_MANY_REQUESTS, codes::RATE_LIMITED),
        BrokerError::NotFound(_) => (StatusCode::NOT_FOUND, codes::NOT_FOUND),
        BrokerError::NotActive { .. } => (StatusCode::CONFLICT, codes::NOT_ACTIVE),
        BrokerError::Conflict(_) => (StatusCode::CONFLICT, codes::CONFLICT),
        BrokerError::IsolationUnavailable(_) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            codes::ISOLATION_UNAVAILABLE,
        ),
        BrokerError::Storage(s) if s.is_storage_unavailable() => {
            (StatusCode::SERVICE_UNAVAILABLE, codes::STORAGE_UNAVAILABLE)
        }
        BrokerError::Storage(_) | BrokerError::Internal(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, codes::INTERNAL)
        }
        BrokerError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, codes::SHUTTING_DOWN),
    }
}

impl From<BrokerError> for ApiError {
    fn from(e: BrokerError) -> ApiError {
        let (status, code) = status_for(&e);
        match &e {
            // Its waiters told, as a stop or restart does: nothing went wrong.
            BrokerError::ShuttingDown => {
                tracing::debug!(error = %e, "request answered: gpud is stopping");
            }
            _ if status.is_server_error() => tracing::error!(error = %e, "request failed"),
            _ => {}
        }
        let message = if code == codes::OUT_OF_RESOURCES {
            format!(
                "{e}; gpud is out of open files or memory, which is not your request's fault: \
                 nothing was done, try again shortly (an admin can raise gpud's LimitNOFILE)"
            )
        } else {
            e.to_string()
        };
        ApiError::new(status, code, message)
    }
}

type Reply = Response<Full<Bytes>>;

fn json<T: Serialize>(status: StatusCode, body: &T) -> Reply {
    let bytes = serde_json::to_vec(body).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(Full::new(Bytes::from(bytes)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn error_reply(e: &ApiError) -> Reply {
    let mut reply = json(
        e.status,
        &schema::ErrorBody {
            error: schema::ErrorDetail {
                code: e.code.to_owned(),
                message: e.message.clone(),
            },
        },
    );
    if let Some(allow) = e.allow {
        reply
            .headers_mut()
            .insert(hyper::header::ALLOW, HeaderValue::from_static(allow));
    }
    reply
}

/// The methods a route takes, `None` for no route.
fn allowed(segments: &[&str]) -> Option<&'static str> {
    match segments {
        ["v1", "health" | "gpus" | "events" | "waiters" | "processes"] | ["metrics"] => Some("GET"),
        ["v1", "reservations"] => Some("GET, POST, DELETE"),
        ["v1", "reservations", _] => Some("GET, DELETE"),
        ["v1", "reservations", _, "renew" | "cgroup"] => Some("POST"),
        _ => None,
    }
}

/// Refuses query parameters on a route that takes none.
fn no_query(query: &str, path: &str) -> Result<(), ApiError> {
    if query.is_empty() {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "{path} takes no query parameters; got ?{query}"
    )))
}

impl Api {
    /// Serves one request from `caller`. Never fails: errors become JSON error responses.
    pub async fn handle(
        self: Arc<Self>,
        caller: Caller,
        req: Request<Incoming>,
    ) -> Result<Reply, Infallible> {
        let started = Instant::now();
        let method = req.method().clone();
        let route = route_name(req.uri().path());
        let reply = match self.route(caller, req).await {
            Ok(reply) => reply,
            Err(e) => error_reply(&e),
        };
        self.metrics
            .observe_request(&method, route, reply.status().as_u16(), started.elapsed());
        Ok(reply)
    }

    async fn route(&self, caller: Caller, req: Request<Incoming>) -> Result<Reply, ApiError> {
        let path = req.uri().path().to_owned();
        let query = req.uri().query().unwrap_or("").to_owned();
        let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
        let method = req.method().clone();
        // Only listings and events take query parameters; a mistyped one anywhere else
        // would otherwise be ignored without a word.
        if !matches!(
            (segments.as_slice(), &method),
            (["v1", "reservations"] | ["v1", "events"], &Method::GET)
                | (["v1", "reservations"], &Method::DELETE)
        ) {
            no_query(&query, &path)?;
        }
        match (segments.as_slice(), &method) {
            (["v1", "health"], &Method::GET) => Ok(self.health()),
            (["v1", "gpus"], &Method::GET) => Ok(self.gpus()),
            (["v1", "reservations"], &Method::GET) => self.list(&query).await,
            (["v1", "reservations"], &Method::DELETE) => {
                self.release_labelled(caller, &query).await
            }
            (["v1", "reservations"], &Method::POST) => {
                let body = self.body(req).await?;
                self.create(caller, &body).await
            }
            (["v1", "reservations", id], &Method::GET) => {
                let id = valid_id(id)?;
                let r = self.broker.get(id).await?;
                Ok(json(StatusCode::OK, &to_wire(r)))
            }
            (["v1", "reservations", id], &Method::DELETE) => {
                let id = valid_id(id)?;
                let r = self.broker.release(caller, id).await?;
                Ok(json(StatusCode::OK, &to_wire(r)))
            }
            (["v1", "reservations", id, "renew"], &Method::POST) => {
                let id = valid_id(id)?;
                let body = self.body(req).await?;
                let renew: schema::RenewRequest = if body.iter().all(u8::is_ascii_whitespace) {
                    schema::RenewRequest::default()
                } else {
                    parse_json(&body)?
                };
                let r = self.broker.renew(caller, id, renew.ttl_seconds).await?;
                Ok(json(StatusCode::OK, &to_wire(r)))
            }
            (["v1", "reservations", id, "cgroup"], &Method::POST) => {
                let id = valid_id(id)?;
                let body = self.body(req).await?;
                self.attach_cgroup(caller, id, &body).await
            }
            (["metrics"], &Method::GET) => Ok(self.metrics_reply()),
            (["v1", "events"], &Method::GET) => self.events(&query).await,
            (["v1", "waiters"], &Method::GET) => Ok(self.waiters()),
            (["v1", "processes"], &Method::GET) => Ok(self.processes()),
            (segments, _) if let Some(allow) = allowed(segments) => Err(ApiError {
                allow: Some(allow),
                ..ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    codes::METHOD_NOT_ALLOWED,
                    format!("{method} is not allowed on {path}; it takes {allow}"),
                )
            }),
            _ => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                codes::NOT_FOUND,
                format!(
                    "no route {path}; see the API in docs/api.md (GET /v1/gpus, POST /v1/reservations, ...)"
                ),
            )),
        }
    }

    async fn body(&self, req: Request<Incoming>) -> Result<Bytes, ApiError> {
        let limit = self.max_body_bytes;
        let within = self.body_timeout;
        let Ok(collected) =
            tokio::time::timeout(within, Limited::new(req.into_body(), limit).collect()).await
        else {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                codes::BODY_TIMEOUT,
                format!(
                    "the request body did not arrive within {}; send it whole",
                    gpud_schema::format_duration(within)
                ),
            ));
        };
        match collected {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e)
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some() =>
            {
                Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    codes::PAYLOAD_TOO_LARGE,
                    format!("request body is larger than {limit} bytes"),
                ))
            }
            Err(e) => Err(ApiError::invalid(format!(
                "could not read the request body: {e}"
            ))),
        }
    }

    fn health(&self) -> Reply {
        let snap = self.broker.snapshot();
        let healthy = snap.gpus.iter().filter(|g| g.healthy).count();
        json(
            StatusCode::OK,
            &schema::Health {
                status: if healthy == snap.gpus.len() {
                    "ok"
                } else {
                    "degraded"
                }
                .to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                gpus: count_u32(snap.gpus.len()),
                healthy_gpus: count_u32(healthy),
                active_reservations: snap.active() as u64,
                waiting: snap.waiting() as u64,
            },
        )
    }

    fn processes(&self) -> Reply {
        let snap = self.broker.snapshot();
        let mut processes: Vec<schema::GpuProcess> = snap
            .processes
            .iter()
            .map(|p| schema::GpuProcess {
                pid: p.pid,
                gpu: p.gpu_index,
                uuid: p.unit_uuid.clone(),
                memory_used_bytes: p.used_bytes,
                uid: p.uid,
                command: p.command.clone(),
                reservation: p.reservation.clone(),
                wrong_gpu: p.wrong_gpu,
            })
            .collect();
        processes.sort_by(|a, b| (a.gpu, &a.uuid, a.pid).cmp(&(b.gpu, &b.uuid, b.pid)));
        json(StatusCode::OK, &schema::GpuProcessList { processes })
    }

    fn waiters(&self) -> Reply {
        let snap = self.broker.snapshot();
        let waiters = snap
            .waiters
            .iter()
            .zip(1..)
            .map(|(w, position)| schema::Waiter {
                position,
                owner_uid: w.caller.uid,
                owner_gid: w.caller.gid,
                pid: w.caller.pid,
                gpus: w.gpus,
                memory: memory_spec(w.memory),
                exclusive: w.memory == MemoryAsk::Exclusive,
                waiting_since: rfc3339(w.since),
                gives_up_at: rfc3339(w.gives_up_at),
                reason: Some(w.reason.clone()),
                expected_start: w.expected_start.map(rfc3339),
                plan: w.plan.clone(),
            })
            .collect();
        let max_wait_seconds = Some(snap.settings.config.wait.max_wait_seconds);
        json(
            StatusCode::OK,
            &schema::WaiterList {
                waiters,
                max_wait_seconds,
            },
        )
    }

    fn gpus(&self) -> Reply {
        json(StatusCode::OK, &gpu_list(&self.broker))
    }

    fn metrics_reply(&self) -> Reply {
        let text = self.metrics.render(&self.broker.snapshot());
        let mut resp = Response::new(Full::new(Bytes::from(text)));
        resp.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        );
        resp
    }

    /// `GET /metrics` and nothing else (the TCP listener).
    pub async fn handle_metrics_only(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Reply, Infallible> {
        if req.method() == Method::GET && req.uri().path() == "/metrics" {
            return Ok(self.metrics_reply());
        }
        Ok(error_reply(&ApiError::new(
            StatusCode::NOT_FOUND,
            codes::NOT_FOUND,
            "only GET /metrics is served on this address",
        )))
    }

    async fn events(&self, query: &str) -> Result<Reply, ApiError> {
        let mut filter = EventFilter::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let bad =
                |what: &str| ApiError::invalid(format!("{key} must be {what}; got {value:?}"));
            match key {
                "since" => {
                    filter.since =
                        parse_since(value).ok_or_else(|| bad("RFC 3339 or Unix seconds"))?
                }
                "after" => filter.after_id = value.parse().map_err(|_| bad("an event id"))?,
                "kind" => {
                    filter.kind = Some(EventKind::parse(value).ok_or_else(|| {
                        bad(
                            "unreserved, wrong_gpu, over_limit, gpu_unhealthy, isolation or \
                             unlimited",
                        )
                    })?);
                }
                "reservation" => filter.reservation = Some(valid_id(value)?),
                "limit" => {
                    filter.limit = value
                        .parse()
                        .ok()
                        .filter(|l| (1..=10_000).contains(l))
                        .ok_or_else(|| bad("1 to 10000"))?;
                }
                _ => {
                    return Err(ApiError::invalid(format!(
                        "unknown query parameter {key:?}; use since, after, kind, reservation or limit"
                    )));
                }
            }
        }
        let events = self.broker.events(filter).await?;
        Ok(json(
            StatusCode::OK,
            &schema::EventList {
                events: events.iter().map(event_to_wire).collect(),
            },
        ))
    }

    async fn list(&self, query: &str) -> Result<Reply, ApiError> {
        let mut state = Some(ReservationState::Active);
        let mut owner = None;
        let mut labels = BTreeMap::new();
        let mut page = Page::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "state" if value == "all" => state = None,
                "state" => {
                    state = Some(ReservationState::parse(value).ok_or_else(|| {
                        ApiError::invalid(format!(
                            "state must be active, released, expired or all; got {value:?}"
                        ))
                    })?);
                }
                "owner" => {
                    owner = Some(value.parse::<u32>().map_err(|_| {
                        ApiError::invalid(format!("owner must be a numeric uid; got {value:?}"))
                    })?);
                }
                "limit" => {
                    page.limit = value
                        .parse()
                        .ok()
                        .filter(|l| (1..=10_000).contains(l))
                        .ok_or_else(|| {
                            ApiError::invalid(format!("limit must be 1 to 10000; got {value:?}"))
                        })?;
                }
                "after" => page.after = Some(parse_cursor(value)?),
                "label" => {
                    let (k, v) = label_param(value)?;
                    labels.insert(k, v);
                }
                _ => {
                    return Err(ApiError::invalid(format!(
                        "unknown query parameter {key:?}; use state, owner, label, limit or after"
                    )));
                }
            }
        }
        let forward = page.after.is_some();
        let (rows, more) = self.broker.list(state, owner, labels, page).await?;
        let next = rows
            .last()
            .filter(|_| more && forward)
            .map(|r| format!("{}.{}", r.created_at, r.id));
        Ok(json(
            StatusCode::OK,
            &schema::ReservationList {
                reservations: rows.into_iter().map(to_wire).collect(),
                more,
                next,
            },
        ))
    }

    /// `DELETE /v1/reservations?label=K=V[&label=…]`: releases the active reservations
    /// that carry every label given and that the caller may release (its own; any for root
    /// and the admin groups). None matching is no error: a cleanup may run twice.
    async fn release_labelled(&self, caller: Caller, query: &str) -> Result<Reply, ApiError> {
        let mut labels = BTreeMap::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("label", value)) => {
                    let (k, v) = label_param(value)?;
                    labels.insert(k, v);
                }
                _ => {
                    return Err(ApiError::invalid(format!(
                        "DELETE /v1/reservations takes only label=KEY=VALUE selectors; got {pair:?}"
                    )));
                }
            }
        }
        if labels.is_empty() {
            return Err(ApiError::invalid(
                "DELETE /v1/reservations releases by label: give at least one \
                 ?label=KEY=VALUE (DELETE /v1/reservations/{id} releases one)",
            ));
        }
        let admin = self.broker.is_admin(&caller);
        let matching: Vec<String> = self
            .broker
            .snapshot()
            .reservations
            .iter()
            .filter(|r| admin || r.owner_uid == caller.uid)
            .filter(|r| labels.iter().all(|(k, v)| r.labels.get(k) == Some(v)))
            .map(|r| r.id.clone())
            .collect();
        let mut released = Vec::with_capacity(matching.len());
        for id in matching {
            match self.broker.release(caller, id).await {
                Ok(r) => released.push(to_wire(r)),
                // Ended meanwhile (its holder exited, another release): not ours to report.
                Err(BrokerError::NotFound(_) | BrokerError::NotActive { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(json(
            StatusCode::OK,
            &schema::ReservationList {
                reservations: released,
                more: false,
                next: None,
            },
        ))
    }

    async fn create(&self, caller: Caller, body: &[u8]) -> Result<Reply, ApiError> {
        let wire: schema::ReservationRequest = parse_json(body)?;
        let (named, own) = (wire.holder_cgroup.clone(), wire.own_cgroup);
        let mut request = to_request(wire)?;
        // A cgroup made for the holder is named after the reservation: its id is chosen here,
        // unless the client chose it.
        if own && request.id.is_none() {
            request.id = Some(crate::broker::new_reservation_id());
        }
        let workloads = self.workloads.clone();
        let admin = self.broker.is_admin(&caller);
        let id = request.id.clone().unwrap_or_default();
        let enforceable = self
            .broker
            .snapshot()
            .gpus
            .iter()
            .any(|g| g.isolation.mode == schema::IsolationMode::Driver);
        let holder_pid = request.holder_pid;
        let reads_proc = holder_pid.is_some() || named.is_some() || own;
        // Pinning the holder and finding its cgroup read /proc and cgroupfs: one trip to a
        // blocking thread for both, and none for a request that names neither.
        let pin_and_prepare = move || -> Result<_, ApiError> {
            let holder = match holder_pid {
                Some(pid) => Some(
                    crate::holder::pin_holder(&caller, pid)
                        .map_err(|e| ApiError::from(BrokerError::from(e)))?,
                ),
                None => None,
            };
            let pinned_pid = holder.as_ref().map(|h| h.holder.pid);
            let prepared = workloads
                .prepare(
                    &caller,
                    admin,
                    named.as_deref(),
                    own,
                    enforceable,
                    pinned_pid,
                    &id,
                )
                .map_err(target_error)?;
            Ok((holder, prepared))
        };
        let (holder, prepared) = if reads_proc {
            tokio::task::spawn_blocking(pin_and_prepare)
                .await
                .map_err(|_| {
                    BrokerError::Internal("pinning the holder or finding its cgroup panicked")
                })??
        } else {
            pin_and_prepare()?
        };
        request.target = prepared.target.clone();
        let outcome = match self.broker.reserve(caller, request, holder).await {
            Ok(ReserveOutcome::Reserved(r)) => Ok((StatusCode::CREATED, r)),
            // A retry: what the first request made, unchanged.
            Ok(ReserveOutcome::Existing(r)) => Ok((StatusCode::OK, r)),
            Ok(ReserveOutcome::Queued(ticket)) => {
                ticket.wait().await.map(|r| (StatusCode::CREATED, r))
            }
            Err(e) => Err(e),
        };
        match outcome {
            Ok((status, r)) => Ok(json(status, &to_wire(r))),
            Err(e) => {
                let workloads = self.workloads.clone();
                let _ = tokio::task::spawn_blocking(move || workloads.undo(&prepared)).await;
                Err(e.into())
            }
        }
    }

    async fn attach_cgroup(
        &self,
        caller: Caller,
        id: String,
        body: &[u8],
    ) -> Result<Reply, ApiError> {
        let wire: schema::AttachCgroupRequest = parse_json(body)?;
        let given = [
            wire.cgroup.is_some(),
            wire.pid.is_some(),
            wire.container_pid.is_some(),
        ];
        if given.iter().filter(|&&g| g).count() != 1 {
            return Err(ApiError::invalid(
                "give the cgroup (\"cgroup\": \"/kubepods/…\"), a process in it \
                 (\"pid\": 4242) or a container's first process as its CDI hook sees it \
                 (\"container_pid\": 1): one of the three",
            ));
        }
        // Not active: the broker says which (404 or 409) before any cgroup is looked at.
        let Some(previous) = self.broker.snapshot().reservation(&id).map(|r| {
            r.isolation
                .cgroup
                .clone()
                .filter(|_| r.isolation.is_driver())
        }) else {
            let r = self
                .broker
                .attach_cgroup(caller, id, crate::isolation::Target::default())
                .await?;
            return Ok(json(StatusCode::OK, &to_wire(r)));
        };
        let workloads = self.workloads.clone();
        let admin = self.broker.is_admin(&caller);
        let (target, previous_ended) = tokio::task::spawn_blocking(move || {
            // The previous container may have ended a moment ago, before gpud saw its
            // cgroup empty.
            let previous_ended = previous.filter(|p| {
                crate::isolation::cgroup::populated(std::path::Path::new(p)) != Some(true)
            });
            attach_target(&workloads, caller, admin, wire).map(|t| (t, previous_ended))
        })
        .await
        .map_err(|_| BrokerError::Internal("finding the cgroup panicked"))?
        .map_err(target_error)?;
        // Detached first (commands run in order), so that the next container does not
        // conflict with it.
        if let Some(previous) = previous_ended {
            self.broker.detach(id.clone(), previous);
        }
        let r = self.broker.attach_cgroup(caller, id, target).await?;
        Ok(json(StatusCode::OK, &to_wire(r)))
    }
}

/// Where an attach's limits go: the cgroup it names, a process's (read in the caller's PID
/// namespace), or a container's being created (see [`Workloads::of_container`]), checked
/// against what the caller may name. Blocking: it reads `/proc` and cgroupfs.
fn attach_target(
    workloads: &Workloads,
    caller: Caller,
    admin: bool,
    wire: schema::AttachCgroupRequest,
) -> Result<crate::isolation::Target, TargetError> {
    let Some(h) = workloads.hierarchy() else {
        return Ok(crate::isolation::Target::none(
            "this host has no cgroup v2 hierarchy mounted",
        ));
    };
    if let Some(seen_as) = wire.container_pid {
        let Some(hook) = caller.pid else {
            return Ok(crate::isolation::Target::none(
                "gpud cannot see the hook's process (it runs in a PID namespace that \
                 does not include the container's), so it cannot find the container",
            ));
        };
        let target = workloads.of_container(h, hook, seen_as);
        // Whoever names a container may only limit a cgroup they could name.
        if let Some(cgroup) = &target.cgroup {
            workloads.named(h, &caller, admin, cgroup)?;
        }
        return Ok(target);
    }
    match (wire.cgroup, wire.pid) {
        (Some(named), _) => {
            let full = workloads.named(h, &caller, admin, &named)?;
            Ok(crate::isolation::Target::on(full))
        }
        (None, Some(seen_as)) => {
            // The pid as the caller sees it, like a holder's.
            let pid = match caller.pid {
                Some(caller_pid) => {
                    crate::holder::translate_pid(caller_pid, seen_as).map_err(|e| {
                        TargetError::Invalid(format!(
                            "process {seen_as} (pid): {e} in your PID namespace"
                        ))
                    })?
                }
                None => seen_as,
            };
            let target = workloads.of_process(h, pid)?;
            // Whoever names a process may only limit a cgroup they could name.
            if let Some(cgroup) = &target.cgroup {
                workloads.named(h, &caller, admin, cgroup)?;
            }
            Ok(target)
        }
        (None, None) => Ok(crate::isolation::Target::default()),
    }
}

/// The API error of a request's cgroup that cannot be used.
fn target_error(e: TargetError) -> ApiError {
    match e {
        TargetError::Invalid(m) => ApiError::invalid(m),
        TargetError::Forbidden(m) => BrokerError::Forbidden(m).into(),
        TargetError::Failed(m) => {
            tracing::error!(error = %m, "could not prepare a workload cgroup");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, codes::INTERNAL, m)
        }
    }
}

/// `value` with its `%XX` escapes decoded; `None` for a broken escape or invalid UTF-8.
fn percent_decoded(value: &str) -> Option<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A listing cursor, `CREATED_MS.ID` as `next` gives it (`0` for the beginning).
fn parse_cursor(value: &str) -> Result<(Millis, String), ApiError> {
    let bad = || {
        ApiError::invalid(format!(
            "after must be a cursor from a listing's next (or 0 for the start); got {value:?}"
        ))
    };
    let (at, id) = value.split_once('.').unwrap_or((value, ""));
    let at = at.parse().map_err(|_| bad())?;
    let id = if id.is_empty() {
        String::new()
    } else {
        valid_id(id).map_err(|_| bad())?
    };
    Ok((at, id))
}

/// `2026-11-21T05:00:00Z` (RFC 3339, with `%3A` for `:` as URLs may encode it) or Unix seconds.
fn parse_since(value: &str) -> Option<Millis> {
    if let Ok(secs) = value.parse::<u64>() {
        return secs.checked_mul(1000);
    }
    let text = value.replace("%3A", ":").replace("%3a", ":");
    let at = humantime::parse_rfc3339_weak(&text).ok()?;
    let since_epoch = at.duration_since(std::time::UNIX_EPOCH).ok()?;
    u64::try_from(since_epoch.as_millis()).ok()
}

/// The wire form of an event.
pub fn event_to_wire(e: &model::Event) -> schema::Event {
    schema::Event {
        id: e.id,
        at: rfc3339(e.at),
        kind: e.kind,
        phase: e.phase,
        gpu_index: e.gpu_index,
        unit_uuid: e.unit_uuid.clone(),
        pid: e.pid,
        uid: e.uid,
        reservation_id: e.reservation_id.clone(),
        used_bytes: e.used_bytes,
        reserved_bytes: e.reserved_bytes,
        action: e.action.clone(),
        message: e.message.clone(),
    }
}

/// A low-cardinality name for the metrics label (ids replaced by `{id}`).
fn route_name(path: &str) -> &'static str {
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    match segments.as_slice() {
        ["v1", "health"] => "/v1/health",
        ["v1", "gpus"] => "/v1/gpus",
        ["v1", "reservations"] => "/v1/reservations",
        ["v1", "reservations", _] => "/v1/reservations/{id}",
        ["v1", "reservations", _, "renew"] => "/v1/reservations/{id}/renew",
        ["v1", "reservations", _, "cgroup"] => "/v1/reservations/{id}/cgroup",
        ["v1", "events"] => "/v1/events",
        ["v1", "waiters"] => "/v1/waiters",
        ["v1", "processes"] => "/v1/processes",
        ["metrics"] => "/metrics",
        _ => "other",
    }
}

/// A JSON object body. Only an object: serde would also take the fields of a struct from
/// an array in order, which skips every name check (`deny_unknown_fields` included).
fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid(
            "the body must be a JSON object ({\"memory\": \"4GiB\", …}), not an array or a value",
        ));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

fn valid_id(id: &str) -> Result<String, ApiError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && id != "."
        && id != "..";
    if ok {
        Ok(id.to_owned())
    } else {
        Err(ApiError::invalid(format!(
            "{id:?} is not a reservation id (letters, digits, '-', '_' and '.', at most {MAX_ID_LEN})"
        )))
    }
}

/// A memory ask as the wire writes it (the reverse of [`to_request`]'s); `None` when
/// exclusive.
fn memory_spec(ask: MemoryAsk) -> Option<MemorySpec> {
    match ask {
        MemoryAsk::Bytes(b) => Some(MemorySpec::Bytes(b)),
        MemoryAsk::BasisPoints(bp) => Some(MemorySpec::Text(schema::format_basis_points(bp))),
        MemoryAsk::Exclusive => None,
    }
}

/// Checks and converts the wire request into the broker's.
pub fn to_request(wire: schema::ReservationRequest) -> Result<ReserveRequest, ApiError> {
    let named = u32::try_from(wire.devices.len()).unwrap_or(u32::MAX);
    let gpus = wire.gpus.unwrap_or(named.max(1));
    if gpus == 0 {
        return Err(ApiError::invalid("gpus must be at least 1"));
    }
    if named > 0 && gpus > named {
        return Err(ApiError::invalid(format!(
            "asked for {gpus} GPUs among {named} named in devices; name at least as many \
             as you ask for, or leave gpus out to reserve all the named ones"
        )));
    }
    if named > MAX_DEVICES {
        return Err(ApiError::invalid(format!(
            "devices names {named} GPUs; at most {MAX_DEVICES}"
        )));
    }
    let memory = match (wire.memory, wire.exclusive) {
        (Some(_), true) => {
            return Err(ApiError::invalid(
                "give either memory (shared GPUs) or exclusive: true (whole GPUs), not both",
            ));
        }
        (None, true) => MemoryAsk::Exclusive,
        (None, false) => {
            return Err(ApiError::invalid(
                "say how much memory per GPU (\"memory\": \"4GiB\") or ask for whole GPUs (\"exclusive\": true)",
            ));
        }
        (Some(MemorySpec::Bytes(0)), false) => {
            return Err(ApiError::invalid("memory must be at least 1 byte"));
        }
        (Some(MemorySpec::Bytes(b)), false) => MemoryAsk::Bytes(b),
        (Some(MemorySpec::Text(t)), false) => match gpud_schema::parse_memory(&t) {
            Ok(MemoryAmount::Bytes(b)) => MemoryAsk::Bytes(b),
            Ok(MemoryAmount::BasisPoints(bp)) => MemoryAsk::BasisPoints(bp),
            Err(e) => return Err(ApiError::invalid(e.to_string())),
        },
    };
    if wire.labels.len() > MAX_LABELS {
        return Err(ApiError::invalid(format!("at most {MAX_LABELS} labels")));
    }
    for (k, v) in &wire.labels {
        if k.is_empty() || k.len() > MAX_LABEL_KEY || v.len() > MAX_LABEL_VALUE || k.contains('=') {
            return Err(ApiError::invalid(format!(
                "label {k:?}: keys are 1-{MAX_LABEL_KEY} characters without '=', values at most {MAX_LABEL_VALUE}"
            )));
        }
    }
    let bytes: usize = wire.labels.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_LABELS_BYTES {
        return Err(ApiError::invalid(format!(
            "labels take {bytes} bytes; at most {MAX_LABELS_BYTES} in all (keys and values)"
        )));
    }
    if wire.holder_pid == Some(0) {
        return Err(ApiError::invalid("holder_pid must be a process id, not 0"));
    }
    Ok(ReserveRequest {
        gpus,
        memory,
        policy: wire.policy.map(|p| match p {
            schema::PolicyName::Binpack => Policy::Binpack,
            schema::PolicyName::Spread => Policy::Spread,
        }),
        wait: wire.wait_seconds.map(Duration::from_secs),
        ttl_seconds: wire.ttl_seconds,
        holder_pid: wire.holder_pid,
        labels: wire.labels,
        id: wire.id.as_deref().map(valid_id).transpose()?,
        target: crate::isolation::Target::default(),
        owner_uid: wire.owner_uid,
        devices: wire.devices,
    })
}

/// A `label=KEY=VALUE` query parameter's value (the `=` may be written `%3D`).
fn label_param(value: &str) -> Result<(String, String), ApiError> {
    let decoded = percent_decoded(value).ok_or_else(|| {
        ApiError::invalid(format!(
            "label: {value:?} is not valid percent-encoded UTF-8"
        ))
    })?;
    let (k, v) = decoded.split_once('=').ok_or_else(|| {
        ApiError::invalid(format!(
            "label must be KEY=VALUE (label=job%3Dasr, or label=job=asr); got {decoded:?}"
        ))
    })?;
    Ok((k.to_owned(), v.to_owned()))
}

/// The wire form of a reservation.
/// Consumes the reservation: its maps and strings move into the reply, uncopied.
pub fn to_wire(r: model::Reservation) -> schema::Reservation {
    schema::Reservation {
        state: r.state,
        owner_uid: r.owner_uid,
        owner_gid: r.owner_gid,
        holder_pid: r.holder.as_ref().map(|h| h.pid),
        exclusive: r.exclusive,
        gpus: r
            .units
            .into_iter()
            .map(|u| schema::ReservedGpu {
                index: u.gpu_index,
                uuid: u.uuid,
                memory_bytes: u.memory_bytes,
            })
            .collect(),
        env: r.env,
        created_at: rfc3339(r.created_at),
        expires_at: r.expires_at.map(rfc3339),
        ttl_seconds: r.ttl_seconds,
        ended_at: r.ended_at.map(rfc3339),
        end_reason: r.end_reason,
        labels: r.labels,
        holder_cgroup: r.holder_cgroup,
        isolation: schema::Isolation {
            mode: r.isolation.mode,
            cgroup: r.isolation.cgroup,
            reason: r.isolation.reason,
        },
        id: r.id,
    }
}

/// `GET /v1/gpus` from the broker's snapshot.
pub fn gpu_list(broker: &Broker) -> schema::GpuList {
    let snap = broker.snapshot();
    let inventory = model::GpuInventory {
        driver_version: None,
        cuda_driver_version: None,
        gpus: snap.gpus.to_vec(),
        topology: Topology::clone(&snap.topology),
    };
    let mut per_gpu: BTreeMap<u32, (u64, u64, u64, u32)> = BTreeMap::new();
    let mut free: BTreeMap<u32, u64> = BTreeMap::new();
    let mut migs: BTreeMap<u32, Vec<schema::MigStatus>> = BTreeMap::new();
    for ((unit, load), used) in snap.units.iter().zip(&snap.loads).zip(&snap.used) {
        let entry = per_gpu.entry(unit.gpu_index).or_default();
        entry.0 += load.reserved_bytes;
        entry.1 += used;
        entry.2 += load.unaccounted_bytes;
        entry.3 += load.reservations;
        // What one request could get: a MIG instance only whole.
        let here = match (load.healthy && !load.exclusive, unit.is_mig()) {
            (false, _) => 0,
            (true, true) if crate::placement::is_completely_free(load) => unit.memory_total_bytes,
            (true, true) => 0,
            (true, false) => crate::placement::free_bytes(unit, load),
        };
        let slot = free.entry(unit.gpu_index).or_default();
        *slot = (*slot).max(here);
        if unit.is_mig() {
            let name = snap
                .gpus
                .get(usize::try_from(unit.gpu_index).unwrap_or(usize::MAX))
                .and_then(|g| g.mig_instances.iter().find(|m| m.uuid == unit.uuid))
                .map_or_else(String::new, |m| m.name.clone());
            migs.entry(unit.gpu_index)
                .or_default()
                .push(schema::MigStatus {
                    uuid: unit.uuid.clone(),
                    name,
                    memory_total_bytes: unit.memory_total_bytes,
                    memory_reserved_bytes: load.reserved_bytes,
                    memory_used_bytes: *used,
                    reservations: load.reservations,
                });
        }
    }
    let n = snap.gpus.len();
    schema::GpuList {
        driver_version: snap.driver_version.clone(),
        gpus: snap
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let (reserved, used, unaccounted, reservations) =
                    per_gpu.get(&g.index).copied().unwrap_or_default();
                schema::GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    pci_bus_id: g.pci_bus_id.clone(),
                    numa_node: g.numa_node,
                    memory_total_bytes: g.memory_total_bytes,
                    memory_reserved_bytes: reserved,
                    memory_used_bytes: used,
                    memory_unaccounted_bytes: unaccounted,
                    memory_free_bytes: Some(free.get(&g.index).copied().unwrap_or(0)),
                    reservations,
                    healthy: g.healthy,
                    mig_instances: migs.remove(&g.index).unwrap_or_default(),
                    isolation: g.isolation.clone(),
                    links: (0..n)
                        .map(|j| link_cell(&inventory, i, j).trim().to_owned())
                        .collect(),
                }
            })
            .collect(),
        reservations: Some(snap.reservations.len() as u64),
    }
}

fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreError;

    #[test]
    fn every_broker_error_has_its_status() {
        let sqlite_full = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
            Some("database or disk is full".into()),
        );
        let sqlite_bug = rusqlite::Error::InvalidColumnIndex(99);
        let table: Vec<(BrokerError, u16, &str)> = vec![
            (
                BrokerError::Invalid("x".into()),
                400,
                codes::INVALID_REQUEST,
            ),
            (
                BrokerError::Unsatisfiable("x".into()),
                422,
                codes::UNSATISFIABLE,
            ),
            (BrokerError::NoCapacity("x".into()), 409, codes::NO_CAPACITY),
            (
                BrokerError::WaitTimeout("x".into()),
                408,
                codes::WAIT_TIMEOUT,
            ),
            (BrokerError::Forbidden("x".into()), 403, codes::FORBIDDEN),
            (
                BrokerError::from(crate::holder::PinError::NotYours {
                    pid: 1,
                    owner: 0,
                    caller: 1000,
                }),
                403,
                codes::FORBIDDEN,
            ),
            (
                BrokerError::from(crate::holder::PinError::Invisible { seen_as: 1 }),
                400,
                codes::INVALID_REQUEST,
            ),
            (
                BrokerError::from(crate::holder::PinError::Unpinnable {
                    pid: 1,
                    source: crate::holder::HolderError::Resources {
                        pid: 1,
                        source: std::io::Error::from_raw_os_error(libc::EMFILE),
                    },
                }),
                503,
                codes::OUT_OF_RESOURCES,
            ),
            (
                BrokerError::QuotaExceeded("x".into()),
                403,
                codes::QUOTA_EXCEEDED,
            ),
            (BrokerError::NotFound("x".into()), 404, codes::NOT_FOUND),
            (
                BrokerError::RateLimited("x".into()),
                429,
                codes::RATE_LIMITED,
            ),
            (
                BrokerError::NotActive {
                    id: "x".into(),
                    state: "released",
                    reason: "r".into(),
                },
                409,
                codes::NOT_ACTIVE,
            ),
            (
                BrokerError::from(StoreError::Sqlite {
                    op: "insert",
                    path: "db".into(),
                    source: sqlite_full,
                }),
                503,
                codes::STORAGE_UNAVAILABLE,
            ),
            (
                BrokerError::from(StoreError::Sqlite {
                    op: "insert",
                    path: "db".into(),
                    source: sqlite_bug,
                }),
                500,
                codes::INTERNAL,
            ),
            (BrokerError::ShuttingDown, 503, codes::SHUTTING_DOWN),
        ];
        for (e, status, code) in table {
            let (s, c) = status_for(&e);
            assert_eq!((s.as_u16(), c), (status, code), "{e:?}");
        }
    }

    fn wire(json: &str) -> Result<ReserveRequest, String> {
        let w: schema::ReservationRequest =
            serde_json::from_str(json).map_err(|e| e.to_string())?;
        to_request(w).map_err(|e| e.message)
    }

    #[test]
    fn requests_are_checked_before_they_reach_the_broker() {
        let r = wire(r#"{"memory": "4G", "ttl_seconds": 60}"#).unwrap();
        assert_eq!((r.gpus, r.memory), (1, MemoryAsk::Bytes(4 << 30)));
        let r = wire(r#"{"gpus": 2, "memory": 1024, "holder_pid": 1}"#).unwrap();
        assert_eq!((r.gpus, r.memory), (2, MemoryAsk::Bytes(1024)));
        assert_eq!(
            wire(r#"{"memory": "25%"}"#).unwrap().memory,
            MemoryAsk::BasisPoints(2500)
        );
        assert_eq!(
            wire(r#"{"exclusive": true}"#).unwrap().memory,
            MemoryAsk::Exclusive
        );
        for (body, needle) in [
            (r#"{"gpus": 0, "exclusive": true}"#, "at least 1"),
            (r#"{}"#, "how much memory"),
            (r#"{"memory": "4G", "exclusive": true}"#, "not both"),
            (r#"{"memory": 0}"#, "at least 1 byte"),
            (r#"{"memory": "1e99GiB"}"#, "invalid memory size"),
            (r#"{"memory": "-4G"}"#, "invalid memory size"),
            (
                r#"{"memory": "4G", "colour": "red"}"#,
                "unknown field `colour`",
            ),
            (r#"{"memory": "4G", "gpus": -1}"#, "invalid value"),
            (r#"{"memory": "4G", "gpus": "two"}"#, "invalid type"),
            (
                r#"{"memory": 18446744073709551616}"#,
                "expected a whole number of bytes",
            ),
            (r#"{"memory": "4G", "holder_pid": 0}"#, "not 0"),
            (r#"{"memory": "4G", "labels": {"": "x"}}"#, "label"),
        ] {
            let e = wire(body).unwrap_err();
            assert!(e.contains(needle), "{body}: {e}");
        }
        // Five labels of 1000 characters: each is allowed, together they are too much.
        let labels: serde_json::Map<String, serde_json::Value> = (0..5)
            .map(|i| (format!("k{i}"), serde_json::Value::from("v".repeat(1000))))
            .collect();
        let body = serde_json::json!({"memory": "4G", "labels": labels}).to_string();
        let e = wire(&body).unwrap_err();
        assert!(e.contains("at most 4096 in all"), "{e}");
    }

    #[test]
    fn ids_in_paths_are_plain() {
        assert!(valid_id("3f2a9c0d1e2b4a5c").is_ok());
        for bad in ["", "..", "a/b", "a%2Fb", &"x".repeat(200), "a b"] {
            assert!(valid_id(bad).is_err(), "{bad}");
        }
    }
}
