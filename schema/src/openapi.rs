//! The OpenAPI 3.0 document for gpud's API, generated from the types in this crate.
//!
//! `schema/openapi.json` is this document, checked in so that people and tools can read
//! the API without building anything. The test `openapi_file_matches_types` fails when the
//! file and the types disagree; regenerate it with
//! `UPDATE_OPENAPI=1 cargo test -p gpud-schema openapi`.

use schemars::generate::{SchemaGenerator, SchemaSettings};
use serde_json::{Value, json};

use crate::{
    AttachCgroupRequest, ErrorBody, EventList, GpuList, GpuProcessList, Health, RenewRequest,
    Reservation, ReservationList, ReservationRequest, WaiterList, limits,
};

/// Builds the whole document.
pub fn document() -> Value {
    let mut generator = SchemaSettings::openapi3().into_generator();
    let r =
        |g: &mut SchemaGenerator, t: fn(&mut SchemaGenerator) -> schemars::Schema| t(g).to_value();
    let reservation_request = r(&mut generator, |g| g.subschema_for::<ReservationRequest>());
    let renew_request = r(&mut generator, |g| g.subschema_for::<RenewRequest>());
    let attach_request = r(&mut generator, |g| g.subschema_for::<AttachCgroupRequest>());
    let reservation = r(&mut generator, |g| g.subschema_for::<Reservation>());
    let reservation_list = r(&mut generator, |g| g.subschema_for::<ReservationList>());
    let gpu_list = r(&mut generator, |g| g.subschema_for::<GpuList>());
    let health = r(&mut generator, |g| g.subschema_for::<Health>());
    let error = r(&mut generator, |g| g.subschema_for::<ErrorBody>());
    let event_list = r(&mut generator, |g| g.subschema_for::<EventList>());
    let waiter_list = r(&mut generator, |g| g.subschema_for::<WaiterList>());
    let process_list = r(&mut generator, |g| g.subschema_for::<GpuProcessList>());
    let mut components = generator.take_definitions(true);
    add_rules_serde_cannot_say(&mut components);

    let body = |schema: &Value| json!({"content": {"application/json": {"schema": schema}}});
    let reply = |description: &str, schema: &Value| json!({"description": description, "content": {"application/json": {"schema": schema}}});
    let error_reply = |description: &str| reply(description, &error);
    let id_param = json!({
        "name": "id", "in": "path", "required": true,
        "description": "Reservation id.", "schema": id_schema()
    });

    let mut doc = json!({
        "openapi": "3.0.3",
        "info": {
            "title": "gpud",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Node-local GPU broker. HTTP/1.1 + JSON over a Unix socket \
                (default /run/gpud/gpud.sock). The caller's uid/gid/pid come from the kernel \
                (SO_PEERCRED), never from the request."
        },
        "paths": {
            "/v1/health": {"get": {
                "summary": "Liveness and GPU health",
                "responses": {"200": reply("Health", &health)}
            }},
            "/v1/gpus": {"get": {
                "summary": "Inventory with total, reserved and used memory per GPU",
                "responses": {"200": reply("GPUs", &gpu_list)}
            }},
            "/v1/reservations": {
                "get": {
                    "summary": "List reservations",
                    "parameters": [
                        {"name": "state", "in": "query", "required": false,
                         "description": "active (default), released, expired or all",
                         "schema": {"type": "string", "enum": ["active", "released", "expired", "all"]}},
                        {"name": "owner", "in": "query", "required": false,
                         "description": "Owner uid", "schema": {"type": "integer", "format": "uint32", "minimum": 0}},
                        {"name": "label", "in": "query", "required": false,
                         "description": "Only reservations with this label: KEY=VALUE (the = may be written %3D); repeat it to require several",
                         "schema": label_schema()},
                        {"name": "limit", "in": "query", "required": false,
                         "description": "At most this many (default 1000)",
                         "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                        {"name": "after", "in": "query", "required": false,
                         "description": "A listing's next cursor, or 0: the first reservations created after it, oldest first (default: the newest)",
                         "schema": cursor_schema()}
                    ],
                    "responses": {
                        "200": reply("Reservations", &reservation_list),
                        "400": error_reply("Bad filter")
                    }
                },
                "delete": {
                    "summary": "Release by label: the active reservations with every label given that the caller may release (its own; any for root and admin groups). None matching is 200 with an empty list",
                    "parameters": [
                        {"name": "label", "in": "query", "required": true,
                         "description": "KEY=VALUE (the = may be written %3D); repeat it to require several",
                         "schema": label_schema()}
                    ],
                    "responses": {
                        "200": reply("The reservations released", &reservation_list),
                        "400": error_reply("No label, or another query parameter"),
                        "429": error_reply("Too many connections (too_many_connections)"),
                        "503": error_reply("State cannot be written (storage_unavailable), or gpud is stopping (shutting_down)")
                    }
                },
                "post": {
                    "summary": "Reserve GPU memory or whole GPUs; may wait (long-poll) for capacity",
                    "requestBody": {"required": true, "content": body(&reservation_request)["content"]},
                    "responses": {
                        "200": reply("The reservation an earlier request with the same id and body made (a retry)", &reservation),
                        "201": reply("Reserved", &reservation),
                        "400": error_reply("Malformed request"),
                        "403": error_reply("Forbidden or over quota"),
                        "408": error_reply("Waited wait_seconds without capacity (wait_timeout), or the body did not arrive in time (body_timeout)"),
                        "409": error_reply("No capacity now (no_capacity), or the id is taken (conflict)"),
                        "413": error_reply("Body too large"),
                        "422": error_reply("Can never fit on this machine (unsatisfiable), or [isolation] require is set and the driver cannot enforce it (isolation_unavailable)"),
                        "429": error_reply("Changes faster than [limits] allows (rate_limited), or too many connections (too_many_connections)"),
                        "503": error_reply("State cannot be written (storage_unavailable), gpud is stopping (shutting_down), or gpud is out of open files or memory (out_of_resources)")
                    }
                }
            },
            "/v1/reservations/{id}": {
                "get": {
                    "summary": "One reservation with its assignment and environment",
                    "parameters": [id_param],
                    "responses": {
                        "200": reply("Reservation", &reservation),
                        "400": error_reply("Not a valid id, or a query parameter"),
                        "404": error_reply("No such reservation")
                    }
                },
                "delete": {
                    "summary": "Release (owner, root or admin group only)",
                    "parameters": [id_param],
                    "responses": {
                        "200": reply("Released", &reservation),
                        "400": error_reply("Not a valid id, or a query parameter"),
                        "403": error_reply("Not yours"),
                        "429": error_reply("Changes faster than [limits] allows (rate_limited), or too many connections (too_many_connections)"),
                        "404": error_reply("No such reservation"),
                        "409": error_reply("Already released"),
                        "503": error_reply("State cannot be written (storage_unavailable), or gpud is stopping (shutting_down)")
                    }
                }
            },
            "/v1/reservations/{id}/renew": {"post": {
                "summary": "Extend a TTL lease",
                "parameters": [id_param],
                "requestBody": {"required": false, "content": body(&renew_request)["content"]},
                "responses": {
                    "200": reply("Renewed", &reservation),
                    "400": error_reply("Not a lease, bad TTL, not a valid id, or a body that is not an object"),
                    "403": error_reply("Not yours"),
                    "408": error_reply("The body did not arrive in time (body_timeout)"),
                    "413": error_reply("Body too large"),
                    "429": error_reply("Changes faster than [limits] allows (rate_limited), or too many connections (too_many_connections)"),
                    "404": error_reply("No such reservation"),
                    "409": error_reply("No longer active"),
                    "503": error_reply("State cannot be written (storage_unavailable), or gpud is stopping (shutting_down)")
                }
            }},
            "/v1/reservations/{id}/cgroup": {"post": {
                "summary": "Put a reservation's memory limits on a cgroup (a container's, from a CDI hook)",
                "parameters": [id_param],
                "requestBody": {"required": true, "content": body(&attach_request)["content"]},
                "responses": {
                    "200": reply("The reservation, with its isolation", &reservation),
                    "400": error_reply("Not a cgroup v2 directory, a process that is not there, not a valid id, or a query parameter"),
                    "403": error_reply("Not yours, or a cgroup the caller may not name"),
                    "408": error_reply("The body did not arrive in time (body_timeout)"),
                    "413": error_reply("Body too large"),
                    "429": error_reply("Changes faster than [limits] allows (rate_limited), or too many connections (too_many_connections)"),
                    "404": error_reply("No such reservation"),
                    "409": error_reply("No longer active, or limits on another cgroup already (conflict)"),
                    "422": error_reply("The driver could enforce the reservation but gpud cannot limit this cgroup or container (not its own, the root cgroup, …), or [isolation] require is set and the driver cannot enforce it (isolation_unavailable)"),
                    "503": error_reply("State cannot be written (storage_unavailable), or gpud is stopping (shutting_down)")
                }
            }},
            "/v1/events": {"get": {
                "summary": "Audit events and violations",
                "parameters": [
                    {"name": "since", "in": "query", "required": false,
                     "description": "Only events at or after this time (RFC 3339, or Unix seconds)",
                     "schema": {"type": "string", "pattern": SINCE_PATTERN}},
                    {"name": "after", "in": "query", "required": false,
                     "description": "Only events with a larger id (to follow)",
                     "schema": {"type": "integer", "format": "uint64", "minimum": 0}},
                    {"name": "kind", "in": "query", "required": false,
                     "schema": {"type": "string", "enum": crate::EventKind::ALL.map(crate::EventKind::as_str)}},
                    {"name": "reservation", "in": "query", "required": false, "schema": id_schema()},
                    {"name": "limit", "in": "query", "required": false,
                     "schema": {"type": "integer", "format": "uint32", "minimum": 1, "maximum": 10000}}
                ],
                "responses": {"200": reply("Events", &event_list), "400": error_reply("Bad filter")}
            }},
            "/v1/processes": {"get": {
                "summary": "Every process on the GPUs with its memory, owner, command line and the reservation it is attributed to, as the last usage check saw them",
                "responses": {"200": reply("Processes", &process_list)}
            }},
            "/v1/waiters": {"get": {
                "summary": "Requests waiting for capacity, in the order gpud tries them",
                "responses": {"200": reply("Waiters", &waiter_list)}
            }},
            "/metrics": {"get": {
                "summary": "Prometheus text exposition",
                "responses": {"200": {"description": "Metrics (OpenMetrics text exposition)", "content": {"application/openmetrics-text; version=1.0.0; charset=utf-8": {"schema": {"type": "string"}}}}}
            }}
        },
        "components": {"schemas": components}
    });
    add_refusals_of_every_route(&mut doc, &error_reply);
    doc
}

/// A reservation id, as gpud checks it: letters, digits, `-`, `_` and `.`, at most 128, and
/// neither `.` nor `..`.
fn id_schema() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": limits::MAX_ID_LEN,
           "pattern": "^(?!\\.\\.?$)[A-Za-z0-9._-]+$"})
}

/// `KEY=VALUE`, percent-encoded (the `=` may be written `%3D`), the key not empty.
fn label_schema() -> Value {
    json!({"type": "string",
           "pattern": "^([^%=]|%[0-9A-Fa-f]{2})+(=|%3[Dd])([^%]|%[0-9A-Fa-f]{2})*$"})
}

/// A listing's cursor as its `next` gives it: `CREATED_MS.ID`, or `0` (the start).
fn cursor_schema() -> Value {
    json!({"type": "string", "pattern": "^[0-9]+(\\.(?!\\.?$)[A-Za-z0-9._-]+)?$"})
}

/// `field` given, and not as null (which gpud reads as absent).
fn present(field: &str) -> Value {
    json!({"required": [field], "not": {"properties": {field: {"enum": [null]}}}})
}

/// Unix seconds, or an RFC 3339 time (its colons may be written `%3A`).
const SINCE_PATTERN: &str =
    "^([0-9]+|[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}(:|%3[Aa])[0-9]{2}(:|%3[Aa])[0-9]{2}.*)$";

/// A memory size as `parse_memory` reads it: a decimal (at most 18 places) and a binary
/// unit (`B`, `K`, `KB`, `KiB`, … `PiB`, any case, or none), or a percentage. What the
/// pattern lets through may still be refused for its value (0, over 100 %, too large).
const SIZE_PATTERN: &str =
    "^\\s*([0-9]+(\\.[0-9]{0,18})?|\\.[0-9]{1,18})\\s*(%|[Bb]|[KkMmGgTtPp]([Ii]?[Bb])?)?\\s*$";

/// The rules of the request bodies that their types cannot say: which fields go together,
/// and the form of their strings. A client generated from the document then cannot send a
/// body gpud refuses for them.
fn add_rules_serde_cannot_say(components: &mut serde_json::Map<String, Value>) {
    if let Some(request) = components.get_mut("ReservationRequest") {
        request["allOf"] = json!([
            // Memory per GPU, or whole GPUs: one of the two.
            {"oneOf": [
                {"required": ["memory"]},
                {"required": ["exclusive"], "properties": {"exclusive": {"enum": [true]}}}
            ]},
            // A lifetime: a holder process, a holder cgroup, a lease, or a chosen id (held
            // until released). A field given as null is absent to gpud.
            {"anyOf": [
                present("holder_pid"),
                present("holder_cgroup"),
                present("ttl_seconds"),
                present("id")
            ]},
            // A cgroup of its own is made for the holder process.
            {"anyOf": [
                {"not": {"required": ["own_cgroup"]}},
                {"properties": {"own_cgroup": {"enum": [false]}}},
                present("holder_pid")
            ]},
            // A holder cgroup is the holder: no process beside it.
            {"not": {"allOf": [present("holder_cgroup"), present("holder_pid")]}},
            // A compute share is a part of a shared GPU: not with whole GPUs, which have
            // all their compute.
            {"anyOf": [
                {"not": {"required": ["compute"]}},
                {"properties": {"compute": {"enum": [null]}}},
                {"not": {"required": ["exclusive"]}},
                {"properties": {"exclusive": {"enum": [false]}}}
            ]}
        ]);
        let id = &mut request["properties"]["id"];
        for (key, value) in id_schema().as_object().into_iter().flatten() {
            id[key] = value.clone();
        }
        // Sizes in bytes, which a schema counts in characters: the same for ASCII.
        let labels = &mut request["properties"]["labels"];
        labels["maxProperties"] = json!(limits::MAX_LABELS);
        labels["additionalProperties"]["maxLength"] = json!(limits::MAX_LABEL_VALUE);
        request["properties"]["devices"]["maxItems"] = json!(limits::MAX_DEVICES);
        request["properties"]["devices"]["uniqueItems"] = json!(true);
    }
    if let Some(size) = components.get_mut("MemorySpec") {
        size["anyOf"][0]["minimum"] = json!(1);
        size["anyOf"][1]["pattern"] = json!(SIZE_PATTERN);
    }
}

/// Refusals any route can give, added where an operation does not document its own: a
/// query parameter on a route that takes none (400), and a connection over the caller's
/// cap, answered before the request is read (429).
fn add_refusals_of_every_route(doc: &mut Value, error_reply: &dyn Fn(&str) -> Value) {
    let Some(paths) = doc["paths"].as_object_mut() else {
        return;
    };
    for operation in paths.values_mut().filter_map(Value::as_object_mut) {
        for op in operation.values_mut() {
            let responses = &mut op["responses"];
            for (status, why) in [
                ("400", "A query parameter: this route takes none"),
                (
                    "429",
                    "Too many connections from this user (too_many_connections)",
                ),
            ] {
                if responses.get(status).is_none() {
                    responses[status] = error_reply(why);
                }
            }
        }
    }
}

/// Serialises [`document`] the way the checked-in file is written.
pub fn document_text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).unwrap_or_default();
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openapi_file_matches_types() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");
        let expected = document_text();
        if std::env::var_os("UPDATE_OPENAPI").is_some() {
            std::fs::write(path, &expected).unwrap();
        }
        let actual = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            actual == expected,
            "schema/openapi.json is out of date with the types in gpud-schema; \
             regenerate it with `UPDATE_OPENAPI=1 cargo test -p gpud-schema openapi` and review the diff"
        );
    }

    #[test]
    fn the_paths_are_the_route_table_s() {
        let doc = document();
        let mut documented = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let query = op["parameters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|p| p["in"] == "query");
                documented.push((method.to_uppercase(), path.clone(), query));
            }
        }
        let mut table: Vec<(String, String, bool)> = crate::routes::ENDPOINTS
            .iter()
            .map(|e| (e.method.to_owned(), e.template.to_owned(), e.query))
            .collect();
        documented.sort();
        table.sort();
        assert_eq!(
            documented, table,
            "openapi.json's paths against schema::routes"
        );
    }

    #[test]
    fn every_ref_resolves() {
        let doc = document();
        let text = doc.to_string();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        for name in [
            "ReservationRequest",
            "Reservation",
            "GpuList",
            "GpuStatus",
            "ErrorBody",
            "Health",
        ] {
            assert!(schemas.contains_key(name), "{name} missing from components");
        }
        for piece in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = piece.split('"').next().unwrap();
            assert!(schemas.contains_key(name), "dangling $ref to {name}");
        }
    }
}
