//! A lower bound on how many tokens a text becomes, known without tokenizing it.
//!
//! Why: tokenizing is the most memory a request can make the router spend. The `tokenizers`
//! pipeline keeps per-byte alignment data for every pre-token, measured at about 170 bytes of
//! peak memory per byte of text on the shipped tokenizer (4 MiB of `"ab cd "` took 677 MB), so a
//! 10 MB text prompt, well under the body limit, costs over a gigabyte. A prompt that is
//! longer than its model's token limit must therefore be refused BEFORE it is tokenized, which
//! needs a bound that is a proof, never an estimate: a refused prompt must really be too long.
//!
//! The bound: if no token of the tokenizer can stand for more than `b` bytes of input text, a
//! text of `n` bytes becomes at least `ceil(n / b)` tokens. `b` is read from `tokenizer.json`
//! when the pipeline allows it, and is `None` (no bound, no refusal before tokenizing) when a
//! stage could make one token stand for arbitrarily much text:
//! * normalizer: none, or `NFC`. NFC composition can shrink text; the strongest canonical
//!   composition, a Hangul L+V+T jamo triple (9 bytes) into one syllable (3 bytes), shrinks it
//!   threefold, so `b` is multiplied by [`NFC_SHRINK_FACTOR_MAX`]. Any other normalizer (lower
//!   casing, accent stripping, replacements, sequences) is not analysed: no bound.
//! * pre-tokenizer: stages that split or re-spell text but never drop any (`ByteLevel`,
//!   `Metaspace`, `Digits`, `Split` and `Punctuation` unless their behaviour is `Removed`, and
//!   sequences of these). `Whitespace`-style splitters drop text: no bound.
//! * model: `BPE` only. Each vocabulary entry's UTF-8 length bounds the input it stands for
//!   (byte-level entries spell one input byte per character, Metaspace's `▁` is 3 bytes for one
//!   space, byte-fallback entries like `<0x41>` are 6 bytes for one). An unknown token stands for
//!   one character (at most 4 bytes) unless `fuse_unk` merges runs of them: then no bound.
//!   WordPiece, Unigram and WordLevel can map a whole unknown word to one token: no bound.
//! * added tokens (special tokens matched literally in the text): their content's length.
//!
//! The post-processor only adds tokens (BOS, EOS), so it never weakens the bound.

use serde_json::Value;

/// How much NFC normalization can shrink a text at most (see the module doc).
pub const NFC_SHRINK_FACTOR_MAX: usize = 3;
/// Most bytes an unknown token stands for when unknown tokens are not fused: one character.
const UNK_CHAR_BYTES_MAX: usize = 4;

/// The most input bytes one token of this tokenizer can stand for, or `None` when its pipeline
/// allows no such bound. `tokenizer` is the parsed `tokenizer.json`.
pub fn bytes_per_token_max(tokenizer: &Value) -> Option<usize> {
    let shrink = normalizer_shrink_factor(tokenizer.get("normalizer")?)?;
    if !pre_tokenizer_keeps_all_text(tokenizer.get("pre_tokenizer")?) {
        return None;
    }
    let model = tokenizer.get("model")?;
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return None;
    }
    let has_unk = !model.get("unk_token").is_none_or(Value::is_null);
    let fuses_unk = model.get("fuse_unk").and_then(Value::as_bool) == Some(true);
    if has_unk && fuses_unk {
        return None;
    }
    let vocab_max = model
        .get("vocab")?
        .as_object()?
        .keys()
        .map(String::len)
        .max()?;
    let added_max = tokenizer
        .get("added_tokens")
        .and_then(Value::as_array)
        .map_or(0, |added| {
            added
                .iter()
                .filter_map(|t| t.get("content").and_then(Value::as_str))
                .map(str::len)
                .max()
                .unwrap_or(0)
        });
    let unk_max = if has_unk { UNK_CHAR_BYTES_MAX } else { 0 };
    let longest = vocab_max.max(added_max).max(unk_max);
    (longest > 0).then(|| longest * shrink)
}

/// At least how many tokens a text of `text_bytes` bytes becomes, given
/// [`bytes_per_token_max`].
pub fn tokens_at_least(text_bytes: usize, bytes_per_token_max: usize) -> usize {
    text_bytes.div_ceil(bytes_per_token_max.max(1))
}

fn normalizer_shrink_factor(normalizer: &Value) -> Option<usize> {
    match normalizer {
        Value::Null => Some(1),
        n if n.get("type").and_then(Value::as_str) == Some("NFC") => Some(NFC_SHRINK_FACTOR_MAX),
        _ => None,
    }
}

fn pre_tokenizer_keeps_all_text(pre: &Value) -> bool {
    if pre.is_null() {
        return true;
    }
    let removes = pre.get("behavior").and_then(Value::as_str) == Some("Removed");
    match pre.get("type").and_then(Value::as_str) {
        Some("ByteLevel" | "Metaspace" | "Digits") => true,
        Some("Split" | "Punctuation") => !removes,
        Some("Sequence") => pre
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|stages| stages.iter().all(pre_tokenizer_keeps_all_text)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bpe(normalizer: Value, pre: Value, model_extra: Value) -> Value {
        let mut model = json!({
            "type": "BPE",
            "vocab": {"a": 0, "Ġthe": 1, "ĠĠĠĠĠĠĠĠ": 2},
            "unk_token": null,
            "fuse_unk": false,
        });
        for (k, v) in model_extra.as_object().unwrap() {
            model[k] = v.clone();
        }
        json!({
            "normalizer": normalizer,
            "pre_tokenizer": pre,
            "model": model,
            "added_tokens": [{"content": "<|x|>"}],
        })
    }

    fn byte_level() -> Value {
        json!({"type": "ByteLevel", "add_prefix_space": false})
    }

    #[test]
    fn a_byte_level_bpe_is_bounded_by_its_longest_entry() {
        // "ĠĠĠĠĠĠĠĠ" is 8 characters of 2 UTF-8 bytes: 16 bytes, for 8 input bytes.
        let t = bpe(Value::Null, byte_level(), json!({}));
        assert_eq!(bytes_per_token_max(&t), Some(16));
    }

    #[test]
    fn a_long_special_token_raises_the_bound() {
        let mut t = bpe(Value::Null, byte_level(), json!({}));
        t["added_tokens"] = json!([{"content": "<|a_very_long_special_token|>"}]);
        assert_eq!(bytes_per_token_max(&t), Some(29));
    }

    #[test]
    fn nfc_multiplies_the_bound_by_its_largest_shrink() {
        let t = bpe(json!({"type": "NFC"}), byte_level(), json!({}));
        assert_eq!(bytes_per_token_max(&t), Some(16 * NFC_SHRINK_FACTOR_MAX));
    }

    #[test]
    fn normalizers_that_can_drop_text_give_no_bound() {
        for n in [
            json!({"type": "Lowercase"}),
            json!({"type": "StripAccents"}),
            json!({"type": "Sequence", "normalizers": []}),
        ] {
            assert_eq!(
                bytes_per_token_max(&bpe(n.clone(), byte_level(), json!({}))),
                None,
                "{n}"
            );
        }
    }

    #[test]
    fn pre_tokenizers_that_drop_text_give_no_bound() {
        for p in [
            json!({"type": "Whitespace"}),
            json!({"type": "WhitespaceSplit"}),
            json!({"type": "BertPreTokenizer"}),
            json!({"type": "Split", "behavior": "Removed"}),
            json!({"type": "Sequence", "pretokenizers": [byte_level(), {"type": "Whitespace"}]}),
        ] {
            assert_eq!(
                bytes_per_token_max(&bpe(Value::Null, p.clone(), json!({}))),
                None,
                "{p}"
            );
        }
    }

    #[test]
    fn pre_tokenizers_that_keep_all_text_keep_the_bound() {
        for p in [
            Value::Null,
            json!({"type": "Metaspace", "replacement": "▁"}),
            json!({"type": "Split", "behavior": "Isolated"}),
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "behavior": "Isolated"}, byte_level()]}),
        ] {
            assert_eq!(
                bytes_per_token_max(&bpe(Value::Null, p.clone(), json!({}))),
                Some(16),
                "{p}"
            );
        }
    }

    #[test]
    fn fused_unknown_tokens_give_no_bound_and_single_ones_count_one_character() {
        let fused = bpe(
            Value::Null,
            byte_level(),
            json!({"unk_token": "<unk>", "fuse_unk": true}),
        );
        assert_eq!(bytes_per_token_max(&fused), None);
        let mut single = bpe(
            Value::Null,
            byte_level(),
            json!({"unk_token": "<unk>", "vocab": {"a": 0}}),
        );
        single["added_tokens"] = json!([]);
        assert_eq!(bytes_per_token_max(&single), Some(UNK_CHAR_BYTES_MAX));
    }

    #[test]
    fn models_that_map_whole_words_to_one_token_give_no_bound() {
        for kind in ["WordPiece", "Unigram", "WordLevel"] {
            let t = bpe(Value::Null, byte_level(), json!({"type": kind}));
            assert_eq!(bytes_per_token_max(&t), None, "{kind}");
        }
    }

    #[test]
    fn the_shipped_tokenizer_has_a_bound_and_it_holds_on_real_text() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../assets/tokenizer/tokenizer.json"
        );
        let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let bound = bytes_per_token_max(&json).expect("byte-level BPE without a normalizer");
        let tokenizer = tokenizers::Tokenizer::from_file(path).unwrap();
        // Texts that tokenize into few long tokens and many short ones alike.
        for text in [
            "the the the the the the the the".to_string(),
            " ".repeat(4_096),
            "=".repeat(4_096),
            "<|im_start|>".repeat(64),
            "日本語のテキスト".repeat(64),
            "Lorem ipsum dolor sit amet, consectetur adipiscing elit. ".repeat(64),
        ] {
            let tokens = tokenizer.encode(text.as_str(), false).unwrap().len();
            assert!(
                tokens >= tokens_at_least(text.len(), bound),
                "{} bytes became {tokens} tokens, fewer than the bound's {} (b = {bound})",
                text.len(),
                tokens_at_least(text.len(), bound)
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Any text, built from pieces that favour long tokens (runs of spaces and symbols,
        /// special tokens, words the vocabulary holds whole) and bytes it does not.
        #[test]
        fn no_text_becomes_fewer_tokens_than_the_bound(
            pieces in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::string::string_regex("[ =\\-_.]{1,40}").unwrap(),
                    proptest::string::string_regex("[a-z]{1,12}").unwrap(),
                    proptest::string::string_regex("\\PC{1,8}").unwrap(),
                    proptest::prop_oneof![
                        proptest::strategy::Just("<|im_start|>".to_string()),
                        proptest::strategy::Just("<|endoftext|>".to_string()),
                        proptest::strategy::Just(" the".to_string()),
                    ],
                ],
                1..64,
            )
        ) {
            let (tokenizer, bound) = shipped();
            let text: String = pieces.concat();
            let tokens = tokenizer.encode(text.as_str(), false).unwrap().len();
            proptest::prop_assert!(
                tokens >= tokens_at_least(text.len(), bound),
                "{:?}: {} bytes became {} tokens, bound {}", text, text.len(), tokens, bound
            );
        }
    }

    fn shipped() -> (&'static tokenizers::Tokenizer, usize) {
        static SHIPPED: std::sync::OnceLock<(tokenizers::Tokenizer, usize)> =
            std::sync::OnceLock::new();
        let (t, b) = SHIPPED.get_or_init(|| {
            let path = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../assets/tokenizer/tokenizer.json"
            );
            let json: Value =
                serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            let bound = bytes_per_token_max(&json).expect("byte-level BPE without a normalizer");
            (tokenizers::Tokenizer::from_file(path).unwrap(), bound)
        });
        (t, *b)
    }
}
