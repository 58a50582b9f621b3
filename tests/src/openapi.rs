//! Every exchange the tests make through [`crate::try_http`] is checked against
//! `schema/openapi.json`, so that the document cannot drift from what gpud accepts and
//! returns:
//!
//! - the route and method must be in the document, or gpud must answer 404 (no route) or
//!   405 with an `Allow` header (no such method);
//! - a request the document refuses (an undeclared or ill-typed query parameter, a body
//!   that does not match the request schema, a missing required body) must be refused by
//!   gpud with a 4xx the operation documents;
//! - every reply's status must be one the operation documents, and its body must match that
//!   reply's schema (or, for a non-JSON reply, carry the documented content type).
//!
//! - a request the document accepts must not get a 400 whose cause the document could have
//!   stated (a pattern, a length, which fields go together), so that a client generated
//!   from it cannot send one: gpud's 400 must be one of [`UNSTATABLE`], the causes a schema
//!   cannot say (a size string that is not a size, a renew of a reservation that is not a
//!   lease, a cgroup path that does not exist). A new 400 that fails here belongs in the
//!   document, or, if no schema can say it, in that list with why.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use serde_json::{Map, Value, json};

use crate::Reply;

/// The 400s a request the document accepts may get, by a phrase of gpud's message: each
/// a rule no OpenAPI 3.0 schema can state, and why.
pub const UNSTATABLE: &[(&str, &str)] = &[
    // What exists on this machine now.
    (
        "does not exist",
        "a process named in the request is not running",
    ),
    (
        "is not a GPU of this machine",
        "the GPUs are the machine's, not the API's",
    ),
    ("is not a cgroup", "a cgroup path that does not exist"),
    (
        "cannot read the cgroup of process",
        "a process that is not running",
    ),
    (
        "is named twice",
        "an index and a UUID can name the same GPU",
    ),
    (
        "named in devices",
        "gpus against the length of devices: a schema cannot compare two fields",
    ),
    (
        "no lease to renew",
        "whether a reservation has a lease is its state",
    ),
    // A size's value rather than its form (the form is SIZE_PATTERN's).
    (
        "must be more than 0%",
        "a range on the number inside a string",
    ),
    (
        "must be at most 100%",
        "a range on the number inside a string",
    ),
    (
        "too large",
        "a size beyond 2^64 bytes: arithmetic, not form",
    ),
    ("must be whole", "a fraction of a byte: the unit decides"),
    // JSON Schema in OpenAPI 3.0 has no propertyNames, and counts characters, not bytes.
    (
        "keys are 1-",
        "a label key's length and characters; a value's bytes",
    ),
    (
        "in all (keys and values)",
        "the labels' total size in bytes",
    ),
    (
        "not valid percent-encoded UTF-8",
        "UTF-8 under percent-encoding",
    ),
    (
        "since must be RFC 3339",
        "a date's calendar (month 13, February 30): a pattern checks its form",
    ),
];

/// The document, with its schemas made plain JSON Schema (see [`to_json_schema`]).
struct Spec {
    doc: Value,
    validators: Mutex<HashMap<String, std::sync::Arc<jsonschema::Validator>>>,
}

fn spec() -> &'static Spec {
    static SPEC: OnceLock<Spec> = OnceLock::new();
    SPEC.get_or_init(|| {
        let path = crate::repo_root().join("schema/openapi.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut doc: Value = serde_json::from_str(&text).expect("openapi.json is JSON");
        to_json_schema(&mut doc);
        Spec {
            doc,
            validators: Mutex::new(HashMap::new()),
        }
    })
}

/// OpenAPI 3.0's `nullable: true` is not JSON Schema: it becomes a type array (`integer` →
/// `["integer", "null"]`), or an `anyOf` with `null` where there is no plain type.
fn to_json_schema(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for v in map.values_mut() {
                to_json_schema(v);
            }
            if map.remove("nullable") == Some(Value::Bool(true)) {
                match map.get("type").cloned() {
                    Some(Value::String(t)) => {
                        map.insert("type".into(), json!([t, "null"]));
                        if let Some(Value::Array(e)) = map.get_mut("enum") {
                            e.push(Value::Null);
                        }
                    }
                    _ => {
                        let inner = Value::Object(std::mem::take(map));
                        map.insert("anyOf".into(), json!([inner, {"type": "null"}]));
                    }
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(to_json_schema),
        _ => {}
    }
}

impl Spec {
    /// A validator for the schema at `pointer` in the document (`$ref`s resolve against
    /// the document's components).
    fn validator(&self, pointer: &str) -> std::sync::Arc<jsonschema::Validator> {
        let mut cache = self
            .validators
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(v) = cache.get(pointer) {
            return v.clone();
        }
        let schema = json!({
            // A fragment is a URI: path templates' braces must be percent-encoded.
            "$ref": format!("#{}", pointer.replace('{', "%7B").replace('}', "%7D")),
            "components": self.doc["components"],
            "paths": self.doc["paths"],
        });
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft4)
            .build(&schema)
            .unwrap_or_else(|e| panic!("openapi.json {pointer} is not a valid schema: {e}"));
        let validator = std::sync::Arc::new(validator);
        cache.insert(pointer.to_owned(), validator.clone());
        validator
    }

    /// Why `instance` does not match the schema at `pointer` (empty when it does).
    fn errors(&self, pointer: &str, instance: &Value) -> Vec<String> {
        self.validator(pointer)
            .iter_errors(instance)
            .map(|e| format!("{e} (at {})", e.instance_path()))
            .collect()
    }
}

/// JSON pointer escaping of one token (`/v1/gpus` → `~1v1~1gpus`).
fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// The document's path template that `path` matches (`{id}` matches one segment).
fn template<'a>(paths: &'a Map<String, Value>, path: &str) -> Option<&'a str> {
    let segments: Vec<&str> = path.split('/').collect();
    paths.keys().map(String::as_str).find(|t| {
        let parts: Vec<&str> = t.split('/').collect();
        parts.len() == segments.len()
            && parts
                .iter()
                .zip(&segments)
                .all(|(p, s)| p == s || (p.starts_with('{') && !s.is_empty()))
    })
}

/// Why the document refuses the path parameters of `path` (matching `template`).
fn path_errors(spec: &Spec, op_pointer: &str, template: &str, path: &str) -> Vec<String> {
    let op = spec.doc.pointer(op_pointer).expect("operation");
    let params = op["parameters"].as_array().cloned().unwrap_or_default();
    let mut errors = Vec::new();
    for (part, segment) in template.split('/').zip(path.split('/')) {
        let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) else {
            continue;
        };
        let Some(i) = params
            .iter()
            .position(|p| p["in"] == "path" && p["name"] == name)
        else {
            errors.push(format!("path parameter {name:?} is not declared"));
            continue;
        };
        errors.extend(
            spec.errors(
                &format!("{op_pointer}/parameters/{i}/schema"),
                &Value::String(segment.to_owned()),
            )
            .into_iter()
            .map(|e| format!("path parameter {name}: {e}")),
        );
    }
    errors
}

/// Why the document refuses this request (empty when it accepts it).
fn request_errors(spec: &Spec, op_pointer: &str, query: &str, body: &str) -> Vec<String> {
    let op = spec.doc.pointer(op_pointer).expect("operation");
    let params = op["parameters"].as_array().cloned().unwrap_or_default();
    let mut errors = Vec::new();
    for required in params
        .iter()
        .filter(|p| p["in"] == "query" && p["required"] == true)
    {
        let name = required["name"].as_str().unwrap_or_default();
        let given = query
            .split('&')
            .any(|pair| pair.split_once('=').map_or(pair, |(n, _)| n) == name);
        if !given {
            errors.push(format!("query parameter {name} is required"));
        }
    }
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, raw) = pair.split_once('=').unwrap_or((pair, ""));
        let Some(i) = params
            .iter()
            .position(|p| p["in"] == "query" && p["name"] == name)
        else {
            errors.push(format!("query parameter {name:?} is not declared"));
            continue;
        };
        let param = &params[i];
        let value = match param["schema"]["type"].as_str() {
            Some("integer") => match raw.parse::<i128>() {
                Ok(n) => serde_json::from_str(&n.to_string()).unwrap_or(Value::Null),
                Err(_) => Value::String(raw.to_owned()),
            },
            _ => Value::String(raw.to_owned()),
        };
        errors.extend(
            spec.errors(&format!("{op_pointer}/parameters/{i}/schema"), &value)
                .into_iter()
                .map(|e| format!("query parameter {name}: {e}")),
        );
    }
    if let Some(request_body) = op.get("requestBody") {
        let schema = format!("{op_pointer}/requestBody/content/application~1json/schema");
        if body.trim().is_empty() {
            if request_body["required"] == true {
                errors.push("the request body is required".to_owned());
            }
        } else {
            match serde_json::from_str::<Value>(body) {
                Ok(value) => errors.extend(spec.errors(&schema, &value)),
                Err(e) => errors.push(format!("the body is not JSON: {e}")),
            }
        }
    }
    errors
}

/// Checks one exchange (see the module documentation); panics with the difference.
pub fn check(method: &str, target: &str, body: &str, reply: &Reply) {
    let spec = spec();
    let paths = spec.doc["paths"].as_object().expect("paths");
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let what = format!("{method} {target} → {} {}", reply.status, reply.text);
    let Some(template) = template(paths, path) else {
        assert_eq!(
            reply.status, 404,
            "{what}: a path not in openapi.json must be 404"
        );
        return check_error_body(spec, &what, reply);
    };
    let lower = method.to_ascii_lowercase();
    let path_pointer = format!("/paths/{}", escape(template));
    if spec
        .doc
        .pointer(&format!("{path_pointer}/{lower}"))
        .is_none()
    {
        assert_eq!(
            reply.status, 405,
            "{what}: a method openapi.json lacks must be 405"
        );
        let mut documented: Vec<String> = paths[template]
            .as_object()
            .expect("path item")
            .keys()
            .map(|m| m.to_ascii_uppercase())
            .collect();
        documented.sort();
        let mut allow: Vec<String> = reply
            .header("allow")
            .unwrap_or_else(|| panic!("{what}: 405 without Allow"))
            .split(',')
            .map(|m| m.trim().to_owned())
            .collect();
        allow.sort();
        assert_eq!(allow, documented, "{what}: Allow differs from openapi.json");
        return check_error_body(spec, &what, reply);
    }
    let op_pointer = format!("{path_pointer}/{lower}");
    let mut refused_by_spec = path_errors(spec, &op_pointer, template, path);
    refused_by_spec.extend(request_errors(spec, &op_pointer, query, body));
    let responses = &spec.doc.pointer(&op_pointer).expect("operation")["responses"];
    let status = reply.status.to_string();
    let Some(response) = responses.get(&status) else {
        panic!(
            "{what}: openapi.json does not document {status} for {method} {template} \
             (it documents {:?})",
            responses.as_object().map(|r| r.keys().collect::<Vec<_>>())
        );
    };
    if !refused_by_spec.is_empty() {
        assert!(
            (400..500).contains(&reply.status),
            "{what}: gpud accepted a request openapi.json refuses: {refused_by_spec:?}"
        );
    } else if reply.status == 400 {
        let message = reply.body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            UNSTATABLE
                .iter()
                .any(|(phrase, _)| message.contains(phrase)),
            "{what}: gpud refused with 400 a request openapi.json accepts, for a cause the \
             document could state (put it in openapi.json, or in UNSTATABLE with why not)"
        );
    }
    let content = response["content"].as_object().expect("reply content");
    if content.contains_key("application/json") {
        let pointer = format!("{op_pointer}/responses/{status}/content/application~1json/schema");
        let errors = spec.errors(&pointer, &reply.body);
        assert!(
            errors.is_empty(),
            "{what}: the reply does not match openapi.json: {errors:?}"
        );
    } else {
        let served = reply.header("content-type").unwrap_or_default();
        assert!(
            content.contains_key(served.as_str()),
            "{what}: served as {served:?}, openapi.json says {:?}",
            content.keys().collect::<Vec<_>>()
        );
    }
}

fn check_error_body(spec: &Spec, what: &str, reply: &Reply) {
    let errors = spec.errors("/components/schemas/ErrorBody", &reply.body);
    assert!(errors.is_empty(), "{what}: not an ErrorBody: {errors:?}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nullable_becomes_json_schema() {
        let mut schema = json!({
            "a": {"type": "integer", "nullable": true},
            "b": {"type": "string", "enum": ["x"], "nullable": true},
            "c": {"allOf": [{"$ref": "#/x"}], "nullable": true},
            "d": {"type": "string", "nullable": false},
        });
        to_json_schema(&mut schema);
        assert_eq!(
            schema,
            json!({
                "a": {"type": ["integer", "null"]},
                "b": {"type": ["string", "null"], "enum": ["x", null]},
                "c": {"anyOf": [{"allOf": [{"$ref": "#/x"}]}, {"type": "null"}]},
                "d": {"type": "string"},
            })
        );
    }

    #[test]
    fn templates_match_one_segment_per_parameter() {
        let paths = json!({"/v1/reservations": {}, "/v1/reservations/{id}": {}, "/v1/reservations/{id}/renew": {}});
        let paths = paths.as_object().unwrap();
        assert_eq!(
            template(paths, "/v1/reservations/abc"),
            Some("/v1/reservations/{id}")
        );
        assert_eq!(
            template(paths, "/v1/reservations/abc/renew"),
            Some("/v1/reservations/{id}/renew")
        );
        assert_eq!(
            template(paths, "/v1/reservations"),
            Some("/v1/reservations")
        );
        assert_eq!(template(paths, "/v1/reservations/"), None);
        assert_eq!(template(paths, "/v2/gpus"), None);
    }

    fn reply(status: u16, body: Value) -> Reply {
        Reply {
            status,
            text: body.to_string(),
            body,
            headers: vec![("content-type".into(), "application/json".into())],
        }
    }

    #[test]
    #[should_panic(expected = "gpud accepted a request openapi.json refuses")]
    fn an_accepted_request_the_document_refuses_fails() {
        let gpus = json!({"gpus": []});
        check("GET", "/v1/gpus?verbose=1", "", &reply(200, gpus));
    }

    #[test]
    #[should_panic(expected = "a request openapi.json accepts")]
    fn a_400_the_document_could_have_prevented_fails() {
        let error = json!({"error": {"code": "invalid_request", "message": "made up"}});
        check("GET", "/v1/reservations?state=all", "", &reply(400, error));
    }

    #[test]
    fn the_document_states_what_gpud_refuses() {
        let attach = "/paths/~1v1~1reservations~1{id}~1cgroup/post";
        let reserve = "/paths/~1v1~1reservations/post";
        let events = "/paths/~1v1~1events/get";
        let list = "/paths/~1v1~1reservations/get";
        let refused =
            |op: &str, query: &str, body: &str| !request_errors(spec(), op, query, body).is_empty();
        assert!(refused(attach, "", "{}"));
        assert!(refused(attach, "", r#"{"cgroup": "/a", "pid": 4}"#));
        assert!(!refused(attach, "", r#"{"container_pid": 1}"#));
        assert!(refused(reserve, "", r#"{"gpus": 1, "ttl_seconds": 60}"#));
        assert!(refused(reserve, "", r#"{"memory": "1G"}"#));
        assert!(refused(
            reserve,
            "",
            r#"{"memory": "1G", "own_cgroup": true, "ttl_seconds": 9}"#
        ));
        assert!(refused(
            reserve,
            "",
            r#"{"memory": "1G", "holder_pid": 9, "holder_cgroup": "/a"}"#
        ));
        assert!(refused(
            reserve,
            "",
            r#"{"memory": "1G", "ttl_seconds": 9, "devices": ["0", "0"]}"#
        ));
        assert!(!refused(
            reserve,
            "",
            r#"{"memory": "1G", "own_cgroup": true, "holder_pid": 9}"#
        ));
        let with_lease = |body: &str| format!("{},\"ttl_seconds\":9}}", &body[..body.len() - 1]);
        assert!(refused(
            reserve,
            "",
            &with_lease(r#"{"memory": "1G", "exclusive": true}"#)
        ));
        assert!(refused(reserve, "", &with_lease(r#"{"exclusive": false}"#)));
        assert!(!refused(reserve, "", &with_lease(r#"{"exclusive": true}"#)));
        assert!(!refused(
            reserve,
            "",
            &with_lease(r#"{"memory": "1G", "exclusive": false}"#)
        ));
        assert!(refused(events, "since=", ""));
        assert!(refused(events, "since=yesterday", ""));
        assert!(!refused(events, "since=1700000000", ""));
        assert!(!refused(events, "since=2026-11-26T10%3A00%3A00Z", ""));
        assert!(refused(events, "reservation=..", ""));
        assert!(refused(events, "reservation=a%2Fb", ""));
        assert!(!refused(events, "reservation=k8s-pod.a_1", ""));
        assert!(refused(list, "label=", ""));
        assert!(refused(list, "label=%3D", ""));
        assert!(refused(list, "label==x", ""));
        assert!(!refused(list, "label=job%3Dasr", ""));
        assert!(!refused(list, "label=job=", ""));
        assert!(refused(list, "after=", ""));
        assert!(refused(list, "after=5..", ""));
        assert!(!refused(list, "after=0", ""));
        assert!(!refused(list, "after=1764300000000.1a2b.c", ""));
        // A field given as null is absent to gpud: no lifetime, and no holder conflict.
        assert!(refused(
            reserve,
            "",
            r#"{"memory": "1G", "ttl_seconds": null}"#
        ));
        assert!(refused(
            reserve,
            "",
            r#"{"memory": "1G", "holder_pid": null, "holder_cgroup": null}"#
        ));
        assert!(!refused(
            reserve,
            "",
            r#"{"memory": "1G", "holder_pid": 9, "holder_cgroup": null}"#
        ));
        // An attach body has exactly one key: a null is no target, nor beside one.
        assert!(refused(attach, "", r#"{"cgroup": null}"#));
        assert!(refused(attach, "", r#"{"cgroup": null, "pid": 4}"#));
        assert!(!refused(attach, "", r#"{"pid": 4}"#));
        assert!(refused("/paths/~1v1~1reservations/delete", "", ""));
        assert!(refused(
            reserve,
            "",
            r#"{"memory": "1e99GiB", "ttl_seconds": 9}"#
        ));
        assert!(refused(reserve, "", r#"{"memory": 0, "ttl_seconds": 9}"#));
        assert!(refused(reserve, "", r#"{"memory": "4G", "id": "a/b"}"#));
        for size in [
            "4GiB",
            "4G",
            " 1.5 gib ",
            "512MiB",
            "1048576",
            "25%",
            "12.5 %",
            "3kb",
            "7P",
        ] {
            let body = json!({"memory": size, "ttl_seconds": 9}).to_string();
            assert!(!refused(reserve, "", &body), "{size}");
        }
        assert!(refused(list, "label=job", ""));
        assert!(refused(list, "label=job%3", ""));
        assert!(!refused(list, "label=job%3Dasr", ""));
        assert!(!refused(list, "label=job=", ""));
        let one = "/paths/~1v1~1reservations~1{id}/get";
        let template = "/v1/reservations/{id}";
        assert!(path_errors(spec(), one, template, "/v1/reservations/k8s-a.1").is_empty());
        assert!(!path_errors(spec(), one, template, "/v1/reservations/..").is_empty());
        assert!(!path_errors(spec(), one, template, "/v1/reservations/a%20b").is_empty());
        let long = format!("/v1/reservations/{}", "a".repeat(129));
        assert!(!path_errors(spec(), one, template, &long).is_empty());
    }

    #[test]
    #[should_panic(expected = "does not document 418")]
    fn an_undocumented_status_fails() {
        let error = json!({"error": {"code": "teapot", "message": "no"}});
        check("GET", "/v1/health", "", &reply(418, error));
    }

    #[test]
    #[should_panic(expected = "does not match openapi.json")]
    fn a_reply_off_its_schema_fails() {
        check("GET", "/v1/health", "", &reply(200, json!({"status": 1})));
    }
}
