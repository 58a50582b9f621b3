//! [`Env`]: the environment a workload receives, shared and serialized once.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

/// A workload's environment, variable → value, as a JSON object on the wire.
///
/// Cheap to clone (shared), and one made by [`Env::new`] or [`Env::from_json`] is kept as
/// its compact JSON text alone, made once: gpud stores that text and writes it into every
/// reply about the reservation instead of encoding a dozen strings again each time (under
/// load that was a tenth of gpud's CPU), and the map of variables is read from the text
/// only when first asked for (gpud holds thousands of environments that it only ever
/// writes out: the map beside the text doubled what each cost). One read from JSON
/// through `Deserialize` keeps its map instead, and serializes from it, so that
/// pretty-printing stays pretty.
#[derive(Clone, Default)]
pub struct Env(Arc<Inner>);

#[derive(Default)]
struct Inner {
    /// The variables: read from `json` when first asked for, where there is one.
    vars: OnceLock<BTreeMap<String, String>>,
    json: Option<Box<RawValue>>,
}

impl Env {
    /// The environment `vars`, kept as its JSON text.
    pub fn new(vars: BTreeMap<String, String>) -> Env {
        match serde_json::value::to_raw_value(&vars) {
            Ok(json) => Env(Arc::new(Inner {
                vars: OnceLock::new(),
                json: Some(json),
            })),
            Err(_) => Env::of_map(vars),
        }
    }

    /// The environment `vars`, kept as a map.
    fn of_map(vars: BTreeMap<String, String>) -> Env {
        Env(Arc::new(Inner {
            vars: OnceLock::from(vars),
            json: None,
        }))
    }

    /// Reads an environment from the JSON text of an object of strings, and keeps the text.
    pub fn from_json(text: &str) -> Result<Env, serde_json::Error> {
        // Read once to refuse what is not an object of strings; the map is made again if
        // it is ever asked for.
        serde_json::from_str::<BTreeMap<String, String>>(text)?;
        let json = RawValue::from_string(text.to_owned())?;
        Ok(Env(Arc::new(Inner {
            vars: OnceLock::new(),
            json: Some(json),
        })))
    }

    /// The compact JSON text of the object.
    pub fn json(&self) -> Cow<'_, str> {
        match &self.0.json {
            Some(raw) => Cow::Borrowed(raw.get()),
            None => Cow::Owned(serde_json::to_string(&**self).unwrap_or_else(|_| "{}".to_owned())),
        }
    }
}

impl Deref for Env {
    type Target = BTreeMap<String, String>;

    fn deref(&self) -> &BTreeMap<String, String> {
        self.0.vars.get_or_init(|| {
            // The text was read as such an object when it was made.
            self.0
                .json
                .as_ref()
                .and_then(|raw| serde_json::from_str(raw.get()).ok())
                .unwrap_or_default()
        })
    }
}

impl From<BTreeMap<String, String>> for Env {
    fn from(vars: BTreeMap<String, String>) -> Env {
        Env::new(vars)
    }
}

impl PartialEq for Env {
    fn eq(&self, other: &Env) -> bool {
        **self == **other
    }
}

impl Eq for Env {}

impl fmt::Debug for Env {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

impl Serialize for Env {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.0.json {
            Some(raw) => raw.serialize(serializer),
            None => (**self).serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Env {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Env, D::Error> {
        BTreeMap::deserialize(deserializer).map(Env::of_map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("CUDA_VISIBLE_DEVICES".to_owned(), "GPU-a,GPU-b".to_owned()),
            ("QUOTE".to_owned(), "say \"hi\"\n".to_owned()),
        ])
    }

    #[test]
    fn serializes_as_the_object_it_holds_however_it_was_made() {
        let expected = serde_json::to_string(&vars()).unwrap();
        let made = Env::new(vars());
        assert_eq!(serde_json::to_string(&made).unwrap(), expected);
        assert_eq!(made.json(), expected);
        assert!(made.0.vars.get().is_none(), "kept as text until asked");
        let read: Env = serde_json::from_str(&expected).unwrap();
        assert_eq!(read, made);
        assert_eq!(serde_json::to_string(&read).unwrap(), expected);
        assert_eq!(read.json(), expected);
        let kept = Env::from_json(&expected).unwrap();
        assert_eq!(kept, made);
        assert_eq!(serde_json::to_string(&kept).unwrap(), expected);
        assert_eq!(kept["QUOTE"], "say \"hi\"\n");
        assert_eq!(
            made.json(),
            expected,
            "the text is kept once the map is made"
        );
        assert!(Env::from_json("[1]").is_err());
    }

    #[test]
    fn pretty_printing_one_read_from_json_stays_pretty() {
        let read: Env = serde_json::from_str(&serde_json::to_string(&vars()).unwrap()).unwrap();
        assert_eq!(
            serde_json::to_string_pretty(&read).unwrap(),
            serde_json::to_string_pretty(&vars()).unwrap()
        );
    }
}
