//! Reading the fields of a JSON call event without building a document:
//! one pass over the payload that keeps only the wanted fields' scalars,
//! borrowed from the payload where no escape forces a copy. Other fields'
//! values are checked for syntax and skipped.
//!
//! It reads what `serde_json::Value` would: the same syntax errors, the
//! last of repeated keys, integers beyond `i64` as floats.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::RawValue;

/// A field's value as found: a scalar, or an array or object (`Nested`).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Scalar<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Cow<'a, str>),
    Nested,
}

impl Scalar<'_> {
    /// As a raw value; arrays and objects become `None`.
    pub fn raw(&self) -> Option<RawValue<'_>> {
        Some(match self {
            Scalar::Null => RawValue::Null,
            Scalar::Bool(b) => RawValue::Bool(*b),
            Scalar::Int(i) => RawValue::Int(*i),
            Scalar::Float(f) => RawValue::Float(*f),
            Scalar::Str(s) => RawValue::Str(s),
            Scalar::Nested => return None,
        })
    }
}

/// Most keys of other fields noted per object (see [`read_fields`]).
pub(super) const MAX_NOTED: usize = 16;

/// Reads the values of the fields `names` from a JSON object; `Ok(None)`
/// when the payload is JSON but not an object. With `others`, the keys of
/// the object's other fields are noted there (the first [`MAX_NOTED`]).
pub(super) fn read_fields<'a, const N: usize>(
    text: &'a str,
    names: [&str; N],
    others: Option<&mut Vec<String>>,
) -> Result<Option<[Option<Scalar<'a>>; N]>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let found = Fields { names, others }.deserialize(&mut de)?;
    de.end()?;
    Ok(found)
}

/// The seed that reads the wanted fields of an object.
struct Fields<'n, 'o, const N: usize> {
    names: [&'n str; N],
    others: Option<&'o mut Vec<String>>,
}

impl<'de, const N: usize> DeserializeSeed<'de> for Fields<'_, '_, N> {
    type Value = Option<[Option<Scalar<'de>>; N]>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, const N: usize> Visitor<'de> for Fields<'_, '_, N> {
    type Value = Option<[Option<Scalar<'de>>; N]>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found: [Option<Scalar<'de>>; N] = std::array::from_fn(|_| None);
        while let Some(Key(key)) = map.next_key()? {
            let wanted = self.names.iter().position(|n| *n == key);
            match wanted {
                Some(first) => {
                    let v: Scalar<'de> = map.next_value()?;
                    // Two fields may be read from one name.
                    for (i, n) in self.names.iter().enumerate().skip(first + 1) {
                        if *n == key {
                            found[i] = Some(v.clone());
                        }
                    }
                    found[first] = Some(v);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                    if let Some(others) = self.others.as_deref_mut() {
                        if others.len() < MAX_NOTED && !others.iter().any(|o| *o == key) {
                            others.push(key.into_owned());
                        }
                    }
                }
            }
        }
        Ok(Some(found))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// An object key, borrowed where it has no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(StrVisitor).map(Key)
    }
}

/// Reads a string, borrowed where it can be.
struct StrVisitor;

impl<'de> Visitor<'de> for StrVisitor {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

impl<'de> Deserialize<'de> for Scalar<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

/// Reads a value as a [`Scalar`], skipping the insides of arrays and objects.
struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Scalar::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Scalar::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Scalar::Int(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        // As `serde_json::Value::as_i64` then `as_f64`.
        Ok(match i64::try_from(v) {
            Ok(i) => Scalar::Int(i),
            Err(_) => Scalar::Float(v as f64),
        })
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Scalar::Float(v))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Owned(v.to_string())))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar::Nested)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar::Nested)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `serde_json::Value` reads of the same fields.
    fn by_value<const N: usize>(
        text: &str,
        names: [&str; N],
    ) -> Result<Option<Vec<Option<String>>>, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let Some(obj) = v.as_object() else {
            return Ok(None);
        };
        Ok(Some(
            names
                .iter()
                .map(|n| obj.get(*n).map(|v| format!("{:?}", RawValue::from_json(v))))
                .collect(),
        ))
    }

    fn by_fields<const N: usize>(
        text: &str,
        names: [&str; N],
    ) -> Result<Option<Vec<Option<String>>>, String> {
        let found = read_fields(text, names, None).map_err(|e| e.to_string())?;
        Ok(found.map(|f| {
            f.iter()
                .map(|v| v.as_ref().map(|s| format!("{:?}", s.raw())))
                .collect()
        }))
    }

    #[test]
    fn reads_what_a_json_document_would() {
        let names = ["call_id", "caller", "ts", "callee", "x"];
        let cases = [
            r#"{"call_id":"c1","caller":"+34600000001","ts":1700000000000,"callee":null}"#,
            r#"{"call_id":"c\"1\u00e9","caller":"a\\b","ts":-5,"x":[1,{"y":2}],"zz":{"a":[]}}"#,
            r#"{"call_id":7,"caller":"x","caller":"y","ts":18446744073709551615,"callee":true}"#,
            r#"{"ts":1.5e3,"x":{"caller":"nested"},"callee":"\ud83d\ude00"}"#,
            r#" { } "#,
            r#"[1,2,{"a":3}]"#,
            r#""just a string""#,
            r#"12"#,
            r#"null"#,
            r#"{"call_id":"c1",}"#,
            r#"{"call_id":"c1"} x"#,
            r#"{"call_id":"c1""#,
            r#"{"call_id":"c1","ts":}"#,
            r#"{"call_id":"\x"}"#,
            r#"{"ts":123456789012345678901234567890}"#,
            "",
            r#"{"caller":"a","x":"b","x":[1]}"#,
        ];
        for text in cases {
            assert_eq!(by_fields(text, names), by_value(text, names), "{text}");
        }
        // One name read for two fields.
        let text = r#"{"src":"+34600000001","other":1}"#;
        assert_eq!(
            by_fields(text, ["src", "src", "other"]),
            by_value(text, ["src", "src", "other"])
        );
    }

    #[test]
    fn unescaped_strings_are_borrowed() {
        let text = r#"{"caller":"+34600000001","callee":"a\nb"}"#;
        let found = read_fields(text, ["caller", "callee"], None)
            .unwrap()
            .unwrap();
        assert!(matches!(&found[0], Some(Scalar::Str(Cow::Borrowed(_)))));
        assert!(matches!(&found[1], Some(Scalar::Str(Cow::Owned(s))) if s == "a\nb"));
    }
}
