//! The chain of heads over the log, so that an auditor holding one head can prove the history
//! behind it has not changed.
//!
//! After the event at sequence `n` the log's head is
//! `h_n = SHA-256(h_{n-1} ‖ canonical(payload_n))`, with `h_0` 32 zero bytes. `canonical` is the
//! payload's JSON in the RFC 8785 canonical form (JCS: keys sorted, no whitespace, numbers as
//! ECMAScript writes them), so every copy of the log — JetStream, the embedded log, an export, a
//! subscriber's — computes the same heads whatever its bytes' spacing or key order. A payload
//! that is not JSON is hashed as its bytes. Every event is chained, rejected ones too: they are
//! in the log.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The head of the log after one event.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Head {
    /// The sequence of the last event chained (0: none yet).
    pub seq: u64,
    /// The chain's hash after it.
    #[serde(with = "hex32")]
    pub hash: [u8; 32],
}

impl Head {
    /// The head after the event at `seq`, whose stored payload is `payload`, follows this one.
    pub fn next(&self, seq: u64, payload: &[u8]) -> Head {
        match canonical(payload) {
            Some(canonical) => self.next_hashing(seq, &canonical),
            None => self.next_hashing(seq, payload),
        }
    }

    /// [`Head::next`] given what it hashes for the event: [`hashed`] of its payload (worked out
    /// ahead, off the thread that chains).
    pub fn next_hashing(&self, seq: u64, hashed: &[u8]) -> Head {
        let mut h = Sha256::new();
        h.update(self.hash);
        h.update(hashed);
        Head {
            seq,
            hash: h.finalize().into(),
        }
    }

    /// The hash as 64 lowercase hex digits.
    pub fn hex(&self) -> String {
        hex32::encode(&self.hash)
    }

    /// Reads `SEQ:HASH` (64 hex digits), as an auditor writes a head down.
    pub fn parse(text: &str) -> Result<Head, String> {
        let (seq, hash) = text
            .split_once(':')
            .ok_or_else(|| format!("{text:?} is not SEQ:HASH"))?;
        let seq = seq
            .parse()
            .map_err(|_| format!("{seq:?} is not a sequence number"))?;
        Ok(Head {
            seq,
            hash: hex32::decode(hash)?,
        })
    }
}

impl std::fmt::Display for Head {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.seq, self.hex())
    }
}

/// What the chain hashes for an event whose stored payload is `payload`: its canonical JSON,
/// or its bytes when it is not JSON.
pub fn hashed(payload: &[u8]) -> Vec<u8> {
    canonical(payload).unwrap_or_else(|| payload.to_vec())
}

/// The RFC 8785 canonical form of `payload`'s JSON; `None` when it is not JSON.
///
/// serde_json keeps an object's keys sorted by their UTF-8 bytes and writes strings escaped as
/// RFC 8785 asks, so a value whose keys are ASCII (where UTF-8 and UTF-16 orders agree) and
/// whose numbers are all integers an IEEE double holds exactly is written canonically by
/// serde_json itself: every event this service writes. Anything else (a float, a key beyond
/// ASCII) goes through the full canonicalizer, several times slower.
pub fn canonical(payload: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(payload).ok()?;
    if plain(&value) {
        serde_json::to_vec(&value).ok()
    } else {
        serde_json_canonicalizer::to_vec(&value).ok()
    }
}

/// Whether serde_json writes `v` as RFC 8785 does: ASCII keys, exact integers only.
fn plain(v: &serde_json::Value) -> bool {
    use serde_json::Value;
    const EXACT: u64 = 1 << 53;
    match v {
        Value::Null | Value::Bool(_) | Value::String(_) => true,
        Value::Number(n) => n
            .as_u64()
            .map(|u| u <= EXACT)
            .or_else(|| n.as_i64().map(|i| i.unsigned_abs() <= EXACT))
            .unwrap_or(false),
        Value::Array(items) => items.iter().all(plain),
        Value::Object(map) => map.iter().all(|(k, v)| k.is_ascii() && plain(v)),
    }
}

/// 32 bytes as 64 lowercase hex digits.
mod hex32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn encode(bytes: &[u8; 32]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn decode(text: &str) -> Result<[u8; 32], String> {
        let bad = || format!("{text:?} is not 64 hex digits");
        if text.len() != 64 || !text.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(out)
    }

    pub fn serialize<S: Serializer>(bytes: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let text = String::deserialize(d)?;
        decode(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_ignores_spacing_and_key_order_but_not_content() {
        let h0 = Head::default();
        let a = h0.next(1, br#"{"b":1,"a":[1.0,"x"]}"#);
        let same = h0.next(1, b" { \"a\" : [1, \"x\"], \"b\" : 1 } ");
        assert_eq!(a, same);
        assert_ne!(a, h0.next(1, br#"{"b":2,"a":[1.0,"x"]}"#));
        // The chain: the same event after another head is another head.
        assert_ne!(a.next(2, b"{}").hash, h0.next(2, b"{}").hash);
        // Not JSON: its bytes.
        assert_ne!(h0.next(1, b"not json"), h0.next(1, b"not  json"));
    }

    #[test]
    fn the_first_head_is_sha256_of_zeros_and_the_canonical_json() {
        // sha256(32 zero bytes ‖ b"{\"a\":1}"), computed apart from this code.
        let h = Head::default().next(1, br#"{ "a": 1 }"#);
        let mut expected = Sha256::new();
        expected.update([0u8; 32]);
        expected.update(br#"{"a":1}"#);
        assert_eq!(h.hash, <[u8; 32]>::from(expected.finalize()));
    }

    #[test]
    fn the_fast_path_writes_what_the_canonicalizer_writes() {
        // Events as the service writes them, and the corners of JSON the fast path must leave
        // to the canonicalizer, or write the same way.
        let cases = [
            r#"{"z":1,"a":{"y":[true,null,"x"],"b":-9007199254740992},"m":9007199254740992}"#,
            r#"{"s":"tab\t nl\n quote\" back\\ ctl\u0001 del\u007f é ☃ \ud83d\ude00 \u2028"}"#,
            r#"{"f":1.0,"g":0.1,"h":1e21,"i":1e-7,"j":-0.0,"k":123456789.125}"#,
            r#"{"big":18446744073709551615,"neg":-9007199254740993}"#,
            r#"{"é":1,"e":2,"\ud83d\ude00":3,"\uffff":4}"#,
            r#"[]"#,
            r#""only a string""#,
        ];
        for case in cases {
            let v: serde_json::Value = serde_json::from_str(case).unwrap();
            assert_eq!(
                canonical(case.as_bytes()).unwrap(),
                serde_json_canonicalizer::to_vec(&v).unwrap(),
                "{case}"
            );
        }
    }

    fn json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-(1i64 << 53)..(1i64 << 53)).prop_map(Value::from),
            any::<f64>()
                .prop_filter("JSON numbers are finite", |f| f.is_finite())
                .prop_map(Value::from),
            any::<String>().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map(any::<String>(), inner.clone(), 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
                proptest::collection::btree_map("[a-z_]{1,8}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #[test]
        fn any_json_is_written_as_the_canonicalizer_writes_it(v in json()) {
            let payload = serde_json::to_vec(&v).unwrap();
            proptest::prop_assert_eq!(
                canonical(&payload).unwrap(),
                serde_json_canonicalizer::to_vec(&v).unwrap()
            );
        }
    }

    #[test]
    fn a_head_reads_back_as_written() {
        let h = Head::default().next(7, b"{}");
        assert_eq!(Head::parse(&h.to_string()), Ok(h));
        assert!(Head::parse("7").is_err());
        assert!(Head::parse("x:00").is_err());
        assert!(Head::parse(&format!("7:{}", "g".repeat(64))).is_err());
        let json = serde_json::to_value(h).unwrap();
        assert_eq!(json["hash"].as_str().unwrap(), h.hex());
        assert_eq!(serde_json::from_value::<Head>(json).unwrap(), h);
    }
}
