//! gpud's routes, said once: each endpoint's method, path template and whether it takes
//! query parameters. gpud dispatches on it, answers 405 with its `Allow`, names its request
//! metrics by its templates; the OpenAPI document's paths are checked against it
//! (`openapi`'s tests).

/// One method on one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// `GET`, `POST` or `DELETE`.
    pub method: &'static str,
    /// The path, `{id}` standing for one segment: also the request metrics' `route` label.
    pub template: &'static str,
    /// Whether it takes query parameters: elsewhere a query is refused (400), so that a
    /// mistyped filter is never ignored without a word.
    pub query: bool,
}

const fn at(method: &'static str, template: &'static str, query: bool) -> Endpoint {
    Endpoint {
        method,
        template,
        query,
    }
}

/// Every endpoint, grouped by path in the order `Allow` lists their methods.
pub const ENDPOINTS: &[Endpoint] = &[
    at("GET", "/v1/health", false),
    at("GET", "/v1/gpus", false),
    at("GET", "/v1/reservations", true),
    at("POST", "/v1/reservations", false),
    at("DELETE", "/v1/reservations", true),
    at("GET", "/v1/reservations/{id}", false),
    at("DELETE", "/v1/reservations/{id}", false),
    at("POST", "/v1/reservations/{id}/renew", false),
    at("POST", "/v1/reservations/{id}/cgroup", false),
    at("GET", "/v1/events", true),
    at("GET", "/v1/waiters", false),
    at("GET", "/v1/processes", false),
    at("GET", "/metrics", false),
];

/// The template `path` matches (a trailing `/` ignored), with the segments that stand for
/// its `{…}` parts; `None` for no route.
pub fn matching(path: &str) -> Option<(&'static str, Vec<&str>)> {
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    ENDPOINTS.iter().map(|e| e.template).find_map(|template| {
        let parts: Vec<&str> = template.split('/').skip(1).collect();
        if parts.len() != segments.len() {
            return None;
        }
        let mut values = Vec::new();
        for (part, segment) in parts.iter().zip(&segments) {
            if part.starts_with('{') {
                values.push(*segment);
            } else if part != segment {
                return None;
            }
        }
        Some((template, values))
    })
}

/// The endpoint for `method` on `template`, if it has one.
pub fn endpoint(method: &str, template: &str) -> Option<&'static Endpoint> {
    ENDPOINTS
        .iter()
        .find(|e| e.template == template && e.method == method)
}

/// The methods `template` takes, as an `Allow` header lists them: `GET, POST, DELETE`.
pub fn allow(template: &str) -> String {
    ENDPOINTS
        .iter()
        .filter(|e| e.template == template)
        .map(|e| e.method)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn paths_match_their_templates_one_segment_per_part() {
        assert_eq!(matching("/v1/gpus"), Some(("/v1/gpus", vec![])));
        assert_eq!(matching("/v1/gpus/"), Some(("/v1/gpus", vec![])));
        assert_eq!(
            matching("/v1/reservations/abc/renew"),
            Some(("/v1/reservations/{id}/renew", vec!["abc"]))
        );
        assert_eq!(
            matching("/v1/reservations/abc"),
            Some(("/v1/reservations/{id}", vec!["abc"]))
        );
        assert_eq!(matching("/v1/reservations/a/b"), None);
        assert_eq!(matching("/v2/gpus"), None);
        assert_eq!(matching("/"), None);
        assert_eq!(allow("/v1/reservations"), "GET, POST, DELETE");
        assert_eq!(allow("/v1/reservations/{id}"), "GET, DELETE");
        assert!(endpoint("GET", "/v1/events").unwrap().query);
        assert!(endpoint("PUT", "/v1/events").is_none());
    }
}
