//! HTTP routes: parse a request into a typed broker call, run it, encode the result.
//!
//! Depends on `broker` and the `gpud-schema` wire types; never on SQLite or NVML. The
//! caller's identity comes from the connection (SO_PEERCRED), passed in by `server`.
//! [`status_for`] is the one mapping from domain errors to HTTP statuses.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde::Serialize;

use gpud_schema::{self as schema, codes, routes};

use crate::broker::{Broker, BrokerError, Caller, Forbidden};
use crate::clock::rfc3339;
use crate::isolation::TargetError;
use crate::metrics::Metrics;
use crate::model::{EventFilter, EventKind, MemoryAsk, Page, ReservationState};
use crate::service::{HolderCgroup, Reserved, Service, ServiceError};

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
    /// Reserving and attaching, with the host's cgroups.
    pub service: Arc<Service>,
}

/// An error on its way to becoming a JSON response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// The methods the route takes, for the `Allow` header of a 405.
    allow: Option<String>,
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
        BrokerError::WaitTimeout { .. } => (StatusCode::REQUEST_TIMEOUT, codes::WAIT_TIMEOUT),
        BrokerError::Forbidden(_) => (StatusCode::FORBIDDEN, codes::FORBIDDEN),
        BrokerError::Holder(e) if e.is_gpud_s_fault() => {
            (StatusCode::SERVICE_UNAVAILABLE, codes::OUT_OF_RESOURCES)
        }
        BrokerError::Holder(e) if e.is_forbidden() => (StatusCode::FORBIDDEN, codes::FORBIDDEN),
        BrokerError::Holder(_) => (StatusCode::BAD_REQUEST, codes::INVALID_REQUEST),
        BrokerError::QuotaExceeded(_) => (StatusCode::FORBIDDEN, codes::QUOTA_EXCEEDED),
        BrokerError::RateLimited { .. } => (StatusCode::TOO_MANY_REQUESTS, codes::RATE_LIMITED),
        BrokerError::NotFound { .. } => (StatusCode::NOT_FOUND, codes::NOT_FOUND),
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
    if let Some(allow) = e
        .allow
        .as_deref()
        .and_then(|a| HeaderValue::from_str(a).ok())
    {
        reply.headers_mut().insert(hyper::header::ALLOW, allow);
    }
    reply
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
        let method = req.method().clone();
        let Some((template, values)) = routes::matching(&path) else {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                codes::NOT_FOUND,
                format!(
                    "no route {path}; see the API in docs/api.md (GET /v1/gpus, POST /v1/reservations, ...)"
                ),
            ));
        };
        let Some(endpoint) = routes::endpoint(method.as_str(), template) else {
            let allow = routes::allow(template);
            return Err(ApiError {
                allow: Some(allow.clone()),
                ..ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    codes::METHOD_NOT_ALLOWED,
                    format!("{method} is not allowed on {path}; it takes {allow}"),
                )
            });
        };
        // A mistyped query parameter on a route that takes none would otherwise be ignored
        // without a word.
        if !endpoint.query {
            no_query(&query, &path)?;
        }
        let id = || valid_id(values.first().copied().unwrap_or_default());
        match (endpoint.method, endpoint.template) {
            ("GET", "/v1/health") => Ok(self.health()),
            ("GET", "/v1/gpus") => Ok(self.gpus()),
            ("GET", "/v1/reservations") => self.list(&query).await,
            ("DELETE", "/v1/reservations") => self.release_labelled(caller, &query).await,
            ("POST", "/v1/reservations") => {
                let body = self.body(req).await?;
                self.create(caller, &body).await
            }
            ("GET", "/v1/reservations/{id}") => {
                let r = self.broker.get(id()?).await?;
                Ok(json(StatusCode::OK, &to_wire(r)))
            }
            ("DELETE", "/v1/reservations/{id}") => {
                let r = self.broker.release(caller, id()?).await?;
                Ok(json(StatusCode::OK, &to_wire(r)))
            }
            ("POST", "/v1/reservations/{id}/renew") => {
                let id = id()?;
                let body = self.body(req).await?;
                let renew: schema::RenewRequest = if body.iter().all(u8::is_ascii_whitespace) {
                    schema::RenewRequest::default()
                } else {
                    parse_json(&body)?
                };
                let r = self.broker.renew(caller, id, renew.ttl_seconds).await?;
                Ok(json(StatusCode::OK, &to_wire(r)))
            }
            ("POST", "/v1/reservations/{id}/cgroup") => {
                let id = id()?;
                let body = self.body(req).await?;
                self.attach_cgroup(caller, id, &body).await
            }
            ("GET", "/metrics") => Ok(self.metrics_reply().await),
            ("GET", "/v1/events") => self.events(&query).await,
            ("GET", "/v1/waiters") => Ok(self.waiters()),
            ("GET", "/v1/processes") => Ok(self.processes()),
            (method, template) => Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::INTERNAL,
                format!("{method} {template} is in the route table but has no handler"),
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
                compute: w.compute.percent(),
                waiting_since: rfc3339(w.since),
                gives_up_at: rfc3339(w.gives_up_at),
                reason: Some(w.reason.to_string()),
                expected_start: w.expected_start.map(rfc3339),
                plan: w.plan.as_deref().map(str::to_owned),
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

    /// `GET /metrics`, rendered off the runtime's threads: naming a new owner asks the user
    /// database (NSS, perhaps LDAP), which may block.
    async fn metrics_reply(&self) -> Reply {
        let (metrics, snapshot) = (self.metrics.clone(), self.broker.snapshot());
        let text = tokio::task::spawn_blocking(move || metrics.render(&snapshot))
            .await
            .unwrap_or_else(|_| "# EOF\n".to_owned());
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
            return Ok(self.metrics_reply().await);
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
                Err(BrokerError::NotFound { .. } | BrokerError::NotActive { .. }) => {}
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
        let cgroup = HolderCgroup {
            named: wire.holder_cgroup.clone(),
            own: wire.own_cgroup,
        };
        let request = to_request(wire)?;
        Ok(match self.service.reserve(caller, request, cgroup).await? {
            Reserved::Made(r) => json(StatusCode::CREATED, &to_wire(r)),
            // A retry: what the first request made, unchanged.
            Reserved::Existing(r) => json(StatusCode::OK, &to_wire(r)),
        })
    }

    async fn attach_cgroup(
        &self,
        caller: Caller,
        id: String,
        body: &[u8],
    ) -> Result<Reply, ApiError> {
        let r = self.service.attach(caller, id, attach_body(body)?).await?;
        Ok(json(StatusCode::OK, &to_wire(r)))
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> ApiError {
        match e {
            ServiceError::Broker(e) => e.into(),
            ServiceError::Target(TargetError::Invalid(m)) => ApiError::invalid(m),
            ServiceError::Target(TargetError::Forbidden(m)) => {
                BrokerError::Forbidden(Forbidden::Cgroup(m)).into()
            }
            ServiceError::Target(TargetError::Failed(m)) => {
                tracing::error!(error = %m, "could not prepare a workload cgroup");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, codes::INTERNAL, m)
            }
        }
    }
}

/// A low-cardinality name for the metrics label: the route's template (ids as `{id}`).
fn route_name(path: &str) -> &'static str {
    routes::matching(path).map_or("other", |(template, _)| template)
}

/// An attach's body: one of the three. An object of one key that is none of them, or of
/// the wrong type, is told so by serde; one of no key or several, what to give.
fn attach_body(body: &[u8]) -> Result<schema::AttachCgroupRequest, ApiError> {
    parse_json(body).map_err(|e| {
        match serde_json::from_slice::<HashMap<String, serde::de::IgnoredAny>>(body) {
            Ok(keys) if keys.len() != 1 => {
                ApiError::invalid(schema::AttachCgroupRequest::ONE_OF_THREE)
            }
            _ => e,
        }
    })
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

mod wire;

use wire::{count_u32, label_param, memory_spec, parse_cursor, parse_since, valid_id};
pub use wire::{event_to_wire, gpu_list, to_request, to_wire};

#[cfg(test)]
mod tests;
