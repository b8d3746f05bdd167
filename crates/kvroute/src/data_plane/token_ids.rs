//! The token-id fast path's body reader: finds `model` and the token-id array of a request body
//! in one pass over the bytes, without building a `serde_json::Value` and without serde's
//! per-element machinery.
//!
//! Why hand-rolled: on the proxy path a 2,048-id body costs the router more CPU than anything
//! else it does. A derived typed serde parse spends its time in `parse_integer` /
//! `has_next_element` per element; a tight digit loop over the array is several times cheaper
//! (both measured in docs/BENCHMARKS.md). The reader is deliberately NARROW: it accepts a
//! subset of JSON and returns `None` for anything outside it (escapes in keys or in the model
//! name, numbers that are not plain non-negative integers fitting a `u32`, duplicate keys it
//! cares about, a non-object body, trailing bytes), and the caller then takes the generic serde
//! path, which also produces every error message. So the fast path can never accept a body the
//! generic path would reject or read one differently: a property test checks exactly that.
//!
//! Values of every other key are parsed with serde_json itself (a stream deserializer, which
//! reports how many bytes it consumed), so strings with escapes, nested objects and numbers in
//! those values are validated by the same parser as everywhere else.

/// What routing needs from a body that already carries token ids.
#[derive(Debug, PartialEq, Eq)]
pub struct TokenIdsBody {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// Reads `model` and the array under `ids_key` (`"prompt"` or `"input_ids"`) from a JSON object,
/// or `None` when the body is outside the accepted subset or has no such array.
pub fn read_token_ids_body(bytes: &[u8], ids_key: &str) -> Option<TokenIdsBody> {
    let mut r = Reader { bytes, pos: 0 };
    r.skip_ws();
    r.eat(b'{')?;
    let mut model: Option<Option<String>> = None;
    let mut tokens: Option<Vec<u32>> = None;
    r.skip_ws();
    if r.peek() == Some(b'}') {
        return None; // no ids at all
    }
    loop {
        r.skip_ws();
        // Keys are validated as UTF-8 like serde does, even the ones skipped.
        let key = std::str::from_utf8(r.plain_string()?).ok()?.as_bytes();
        r.skip_ws();
        r.eat(b':')?;
        r.skip_ws();
        if key == b"model" {
            if model.is_some() {
                return None;
            }
            model = Some(if r.peek() == Some(b'n') {
                r.literal(b"null")?;
                None
            } else {
                let s = r.plain_string()?;
                Some(std::str::from_utf8(s).ok()?.to_owned())
            });
        } else if key == ids_key.as_bytes() {
            if tokens.is_some() {
                return None;
            }
            tokens = Some(r.id_array()?);
        } else {
            r.skip_value()?;
        }
        r.skip_ws();
        match r.next()? {
            b',' => continue,
            b'}' => break,
            _ => return None,
        }
    }
    r.skip_ws();
    if r.pos != bytes.len() {
        return None;
    }
    Some(TokenIdsBody {
        model: model.flatten(),
        tokens: tokens?,
    })
}

/// Above this many bytes after an id array's `[`, the array is sized exactly before it is read.
const EXACT_CAPACITY_FROM_BYTES: usize = 1024 * 1024;

/// serde_json's default nesting limit: a document nests arrays and objects fewer than this many
/// levels deep (127 parse, 128 are refused), which the generic path's parse of the whole body
/// applies.
pub const SERDE_NESTING_MAX: usize = 128;

/// Deepest array/object nesting of `value`, a slice serde_json already validated (so strings
/// are well formed and a quote inside one is always escaped).
fn nesting_depth(value: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in value {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

#[inline]
fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\t' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    #[inline]
    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }

    #[inline]
    fn eat(&mut self, want: u8) -> Option<()> {
        (self.next()? == want).then_some(())
    }

    #[inline]
    fn skip_ws(&mut self) {
        self.pos = skip_ws(self.bytes, self.pos);
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.pos.checked_add(word.len())?;
        (self.bytes.get(self.pos..end)? == word).then(|| self.pos = end)
    }

    /// A string with no escapes and no control characters (JSON forbids raw ones); its bytes
    /// between the quotes. Anything else: `None`, and the generic parser decides.
    fn plain_string(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.pos;
        loop {
            match self.next()? {
                b'"' => return Some(&self.bytes[start..self.pos - 1]),
                b'\\' => return None,
                c if c < 0x20 => return None,
                _ => {}
            }
        }
    }

    /// `[` ids `]` where each id is a JSON integer in `0..=u32::MAX` without sign, fraction or
    /// exponent (JSON also forbids leading zeros, so `0` must stand alone). One tight loop over
    /// a local index: this is the router's hottest loop on the token-id path.
    fn id_array(&mut self) -> Option<Vec<u32>> {
        self.eat(b'[')?;
        let b = self.bytes;
        let mut i = self.pos;
        // The common id is 3-6 digits plus a comma; the caller already bounded the body size.
        // A large array is sized exactly instead (its commas counted by memchr up to the first
        // `]`, which ends an id array): growth by doubling would hold up to 1.5x the final
        // array, plus the copy, for a body of millions of short ids.
        let rest = &b[i..];
        let capacity = if rest.len() > EXACT_CAPACITY_FROM_BYTES {
            let span = memchr::memchr(b']', rest).unwrap_or(rest.len());
            memchr::memchr_iter(b',', &rest[..span]).count() + 1
        } else {
            rest.len() / 6
        };
        let mut ids = Vec::with_capacity(capacity);
        i = skip_ws(b, i);
        if b.get(i) == Some(&b']') {
            self.pos = i + 1;
            return Some(ids);
        }
        loop {
            let start = i;
            let mut value = 0u64;
            while let Some(&c) = b.get(i) {
                let digit = c.wrapping_sub(b'0');
                if digit > 9 {
                    break;
                }
                value = value * 10 + u64::from(digit);
                i += 1;
                // More than 10 digits cannot be a u32 (and would overflow the u64 later).
                if i - start > 10 {
                    return None;
                }
            }
            let digits = i - start;
            if digits == 0 || (digits > 1 && b[start] == b'0') {
                return None;
            }
            ids.push(u32::try_from(value).ok()?);
            // A sign, fraction or exponent lands here as an unexpected byte.
            i = skip_ws(b, i);
            match b.get(i) {
                Some(b',') => i = skip_ws(b, i + 1),
                Some(b']') => {
                    self.pos = i + 1;
                    return Some(ids);
                }
                _ => return None,
            }
        }
    }

    /// Skips one JSON value of any kind, validated by serde_json.
    ///
    /// serde_json's nesting limit counts from the value it is given, and this value sits one
    /// level inside the body, so serde alone would accept a value one level deeper than the
    /// generic path (which parses the whole body) accepts; the depth is checked here too, so
    /// the reader never takes a body the generic path refuses.
    fn skip_value(&mut self) -> Option<()> {
        let rest = &self.bytes[self.pos..];
        // Parsed into a `Value`, not skipped as `IgnoredAny`: serde_json does not check the
        // UTF-8 of strings it ignores, nor the range of numbers (`1e400`), and the generic path
        // (which builds values) refuses both; the fuzzer found each. The values skipped are
        // the small fields of a request (`max_tokens`, `temperature`, ...).
        let mut values =
            serde_json::Deserializer::from_slice(rest).into_iter::<serde_json::Value>();
        values.next()?.ok()?;
        let len = values.byte_offset();
        // The body's own object is one level: the value may nest one level less than serde
        // allows from its root.
        if nesting_depth(&rest[..len]) + 1 >= SERDE_NESTING_MAX {
            return None;
        }
        self.pos += len;
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the generic path reads, for the same subset: a derived typed parse.
    #[derive(serde::Deserialize)]
    struct Reference {
        #[serde(default)]
        model: Option<String>,
        #[serde(default)]
        prompt: Option<Vec<u32>>,
    }

    fn reference(bytes: &[u8]) -> Option<TokenIdsBody> {
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return None;
        }
        let r: Reference = serde_json::from_slice(bytes).ok()?;
        Some(TokenIdsBody {
            model: r.model,
            tokens: r.prompt?,
        })
    }

    #[test]
    fn reads_model_and_ids_around_skipped_values_of_every_kind() {
        let body = br#" { "x" : {"y":[null, "a\"b", -1.5e3, true]}, "model":"m-1",
            "prompt" : [ 0, 1,2 ,4294967295 ] ,"max_tokens":1, "s":"\u00e9"} "#;
        assert_eq!(
            read_token_ids_body(body, "prompt"),
            Some(TokenIdsBody {
                model: Some("m-1".into()),
                tokens: vec![0, 1, 2, u32::MAX]
            })
        );
        assert_eq!(
            read_token_ids_body(br#"{"input_ids":[],"model":null}"#, "input_ids"),
            Some(TokenIdsBody {
                model: None,
                tokens: vec![]
            })
        );
    }

    #[test]
    fn a_value_nested_as_deep_as_serde_refuses_for_the_whole_body_is_left_to_the_generic_path() {
        let nested = |levels: usize| {
            format!(
                r#"{{"model":"m","prompt":[1,2],"x":{}0{}}}"#,
                "[".repeat(levels),
                "]".repeat(levels)
            )
        };
        // The whole body adds one level: serde refuses at 128 levels inside it.
        let deepest_ok = nested(SERDE_NESTING_MAX - 2);
        assert!(serde_json::from_str::<serde_json::Value>(&deepest_ok).is_ok());
        assert!(read_token_ids_body(deepest_ok.as_bytes(), "prompt").is_some());
        for levels in [SERDE_NESTING_MAX - 1, SERDE_NESTING_MAX, 100_000] {
            let body = nested(levels);
            assert!(serde_json::from_str::<serde_json::Value>(&body).is_err());
            assert_eq!(
                read_token_ids_body(body.as_bytes(), "prompt"),
                None,
                "{levels} levels"
            );
        }
        // Brackets inside strings are not nesting.
        let in_string = format!(r#"{{"prompt":[1],"x":"{}"}}"#, "[".repeat(500));
        assert!(read_token_ids_body(in_string.as_bytes(), "prompt").is_some());
    }

    #[test]
    fn a_skipped_value_the_generic_path_refuses_is_left_to_it() {
        // Found by the fuzzer (fuzz/seeds/token_ids/regression_*): invalid UTF-8 in a skipped
        // string, and a number out of f64's range.
        for body in [
            &b"{\"prompt\":[1],\"x\":\"\xff\"}"[..],
            b"{\"prompt\":[1],\"x\":{\"\xc3\":1}}",
            b"{\"prompt\":[1],\"x\":1e400}",
        ] {
            assert!(serde_json::from_slice::<serde_json::Value>(body).is_err());
            assert_eq!(
                read_token_ids_body(body, "prompt"),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn anything_outside_the_subset_is_left_to_the_generic_path() {
        for body in [
            &br#"["m",[1,2]]"#[..],
            br#"{}"#,
            br#"{"prompt":"text"}"#,
            br#"{"prompt":[1,-2]}"#,
            br#"{"prompt":[01]}"#,
            br#"{"prompt":[1.0]}"#,
            br#"{"prompt":[1e2]}"#,
            br#"{"prompt":[4294967296]}"#,
            br#"{"prompt":[99999999999999999999]}"#,
            br#"{"prompt":[1],"prompt":[2]}"#,
            br#"{"prompt":[1],"model":3}"#,
            br#"{"prompt":[1],"model":"a","model":"b"}"#,
            br#"{"prompt":[1],"model":"m\u0031"}"#,
            br#"{"pro\u006dpt":[1]}"#,
            br#"{"prompt":[1]} trailing"#,
            br#"{"prompt":[1],}"#,
            br#"{"prompt":[1,]}"#,
            br#"{"prompt":[1] "x":1}"#,
            br#"{"prompt":[1],"x":tru}"#,
            br#"{"prompt":[1],"x":"unterminated}"#,
            br#"{"prompt":[[1],[2]]}"#,
            br#"{"prompt":[1"#,
            b"{\"prompt\":[1],\"model\":\"a\x01\"}",
        ] {
            assert_eq!(
                read_token_ids_body(body, "prompt"),
                None,
                "{} must fall back",
                String::from_utf8_lossy(body)
            );
        }
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(serde_json::Value::from),
            ".{0,8}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                prop::collection::btree_map("[a-z\"\\\\]{0,4}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// The fast reader never disagrees with the generic parse: on any body it either steps
        /// aside or reads exactly what serde reads.
        #[test]
        fn never_reads_a_body_differently_from_serde(
            ids in prop::collection::vec(any::<u32>(), 0..20),
            model in prop::option::of("[a-zA-Z0-9\\-\\\\\"é]{0,6}"),
            extra in prop::collection::vec(("[a-z_]{1,6}", json_value()), 0..4),
            spacing in prop::collection::vec(prop::sample::select(vec!["", " ", "\n", "\t "]), 8),
        ) {
            let mut fields = vec![format!("\"prompt\":{}", serde_json::to_string(&ids).unwrap())];
            if let Some(m) = &model {
                fields.push(format!("\"model\":{}", serde_json::to_string(m).unwrap()));
            }
            for (k, v) in &extra {
                fields.push(format!("\"{k}\":{v}"));
            }
            let body = format!("{}{{{}}}{}", spacing[0], fields.join(&format!(",{}", spacing[1])), spacing[2]);
            let fast = read_token_ids_body(body.as_bytes(), "prompt");
            let slow = reference(body.as_bytes());
            if let Some(f) = &fast {
                prop_assert_eq!(Some(f), slow.as_ref(), "body {}", body);
            }
            // Plain bodies (no escapes in the model, no duplicate keys) must take the fast path.
            let plain_model = model.as_ref().is_none_or(|m| !m.contains(['\\', '"']));
            let dup = extra.iter().any(|(k, _)| k == "prompt" || k == "model");
            if plain_model && !dup {
                prop_assert!(fast.is_some(), "plain body fell back: {}", body);
            }
        }

        /// Mutated bytes never panic and never read differently from serde.
        #[test]
        fn mutated_bodies_never_panic_or_disagree(
            ids in prop::collection::vec(any::<u32>(), 0..8),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let mut body = format!("{{\"model\":\"m\",\"prompt\":{},\"n\":[1,{{\"a\":\"b\"}}]}}",
                serde_json::to_string(&ids).unwrap()).into_bytes();
            let i = at.index(body.len());
            body[i] = byte;
            if let Some(f) = read_token_ids_body(&body, "prompt") {
                prop_assert_eq!(Some(f), reference(&body));
            }
        }
    }
}
