//! The token-id body reader of the proxy's fast path (`kvroute`'s `data_plane::token_ids`),
//! differentially against serde_json: byte 0 picks the id key (`prompt` for completions,
//! `input_ids` for generate), the rest is the body.
//!
//! Property: the reader accepts a strict subset of what the generic path accepts, and reads it
//! the same: whenever it returns ids, serde_json parses the body as an object whose `model` is a
//! string or null (or absent) and whose id key holds an array of integers in `u32`, with the
//! same model and the same ids. Whenever serde refuses (bad JSON, too deep, wrong types), the
//! reader refuses too. The converse is deliberately not required: the reader steps aside on
//! escapes, duplicates and the like, and the generic path then decides.
#![no_main]

use kvroute_fuzz::token_ids::{TokenIdsBody, read_token_ids_body};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// What the generic path routes on, for a body that carries token ids under `key`.
fn generic(body: &[u8], key: &str) -> Option<TokenIdsBody> {
    let Value::Object(map) = serde_json::from_slice::<Value>(body).ok()? else {
        return None;
    };
    let model = match map.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return None,
    };
    let tokens = map
        .get(key)?
        .as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()?;
    Some(TokenIdsBody { model, tokens })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let key = if which & 1 == 0 {
        "prompt"
    } else {
        "input_ids"
    };
    if let Some(fast) = read_token_ids_body(body, key) {
        assert_eq!(
            Some(&fast),
            generic(body, key).as_ref(),
            "the fast reader read {:?} differently from serde",
            String::from_utf8_lossy(body)
        );
    }
});
