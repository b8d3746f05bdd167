//! The simulated engines' memory of chat messages they already tokenized.
//!
//! Why it exists: a real engine tokenizes every prompt on its own host. The simulator runs its
//! engines beside the routers it serves, often on the same two cores (the demo, its replica
//! sweep, the benches), and there every chat's tokenizing is CPU taken from the routers: in a
//! sweep of four replicas over the demo workload it was about a quarter of the process's CPU,
//! most of it the same system prompts and earlier turns tokenized again for each request. So
//! the engines tokenize a rendered chat in SEGMENTS, each starting at a chat marker such as
//! `<|im_start|>`, remember each segment's tokens, and tokenize only the segments they have not
//! seen. The token ids must be exactly those of tokenizing the whole rendering: the simulator
//! is the ground truth the router is measured against.
//!
//! Why the segments are exact. The tokenizer first splits a text at every added token it finds
//! (a leftmost-longest scan), and normalizes, pre-tokenizes and encodes each piece between them
//! on its own; with `add_special_tokens` off nothing is added at the ends. So cutting the text
//! at the start of an added token `S` changes nothing when:
//! * the scan of the whole text finds `S` where the cut is: no added token can match text that
//!   crosses the cut, which [`segment_markers`] proves for every pair of added tokens at load
//!   (no added token has a proper suffix that `S` starts with or that starts `S`);
//! * `S` does not reach outside its own text: not `lstrip` (it would take the whitespace before
//!   the cut), not `rstrip`, not `single_word` (its match depends on the character before it),
//!   not `normalized` (it would be found only after the piece around it was normalized);
//! * the tokenizer neither truncates nor pads (each segment would be cut or padded on its own),
//!   and splits at special tokens (it does not when told to encode them as text).
//!
//! Checked, not only argued: the first [`CHAT_MEMO_VERIFY_FIRST`] chats and one in
//! [`CHAT_MEMO_VERIFY_EVERY_NTH`] after them are also tokenized whole and compared, and one
//! mismatch turns the memory off for good (the whole tokens are what the engine then uses).
//!
//! Bounds: segments over [`CHAT_MEMO_SEGMENT_BYTES_MAX`] are tokenized but not kept, and when the
//! kept tokens would pass [`CHAT_MEMO_TOKENS_MAX`] the memory is emptied and starts again
//! (simple, and a simulator's memory only saves CPU: nothing it answers depends on a hit).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_128;

/// Tokens the memory holds at most (4 bytes each), over every segment kept.
pub const CHAT_MEMO_TOKENS_MAX: usize = 4 * 1024 * 1024;
/// Longest segment kept, in bytes of text: a long document in a conversation is kept (it comes
/// back in every later turn), a pasted book is not.
pub const CHAT_MEMO_SEGMENT_BYTES_MAX: usize = 1024 * 1024;
/// Chats checked against a whole tokenization after the memory starts.
pub const CHAT_MEMO_VERIFY_FIRST: u64 = 8;
/// After the first ones, one chat in this many is checked.
pub const CHAT_MEMO_VERIFY_EVERY_NTH: u64 = 64;

/// What the chats tokenized through the memory did, in all (what its tests read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoCounts {
    /// Segments found in the memory.
    pub segments_remembered: u64,
    /// Segments tokenized (and kept, unless too long).
    pub segments_tokenized: u64,
    /// Chats also tokenized whole and compared.
    pub chats_verified: u64,
}

/// Remembered segment tokens, keyed by the 128-bit hash and length of the segment's text.
pub struct ChatMemo {
    /// The added tokens a segment may start at ([`segment_markers`]); empty = never segment.
    markers: Vec<String>,
    segments: Mutex<Segments>,
    /// Cleared by the first mismatch a check finds; never set again.
    trusted: AtomicBool,
    chats: AtomicU64,
    segments_remembered: AtomicU64,
    segments_tokenized: AtomicU64,
    chats_verified: AtomicU64,
    tokens_max: usize,
}

#[derive(Default)]
struct Segments {
    by_text: HashMap<(u128, usize), Arc<[u32]>>,
    tokens: usize,
}

impl std::fmt::Debug for ChatMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatMemo")
            .field("markers", &self.markers)
            .field("trusted", &self.trusted.load(Ordering::Relaxed))
            .finish()
    }
}

impl ChatMemo {
    /// A memory for `tokenizer`, cutting only where [`segment_markers`] allows.
    pub fn for_tokenizer(tokenizer: &tokenizers::Tokenizer) -> ChatMemo {
        Self::with_markers(segment_markers(tokenizer), CHAT_MEMO_TOKENS_MAX)
    }

    fn with_markers(markers: Vec<String>, tokens_max: usize) -> ChatMemo {
        ChatMemo {
            markers,
            segments: Mutex::new(Segments::default()),
            trusted: AtomicBool::new(true),
            chats: AtomicU64::new(0),
            segments_remembered: AtomicU64::new(0),
            segments_tokenized: AtomicU64::new(0),
            chats_verified: AtomicU64::new(0),
            tokens_max,
        }
    }

    /// Whether chats are tokenized through the memory (markers found at load, and no check has
    /// failed).
    pub fn in_use(&self) -> bool {
        !self.markers.is_empty() && self.trusted.load(Ordering::Relaxed)
    }

    pub fn counts(&self) -> MemoCounts {
        MemoCounts {
            segments_remembered: self.segments_remembered.load(Ordering::Relaxed),
            segments_tokenized: self.segments_tokenized.load(Ordering::Relaxed),
            chats_verified: self.chats_verified.load(Ordering::Relaxed),
        }
    }

    /// Tokens currently held.
    pub fn tokens_held(&self) -> usize {
        self.segments.lock().tokens
    }

    /// The token ids of a rendered chat, as `encode` gives for the whole text.
    pub fn encode_chat(
        &self,
        rendered: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, String>,
    ) -> Result<Vec<u32>, String> {
        if !self.in_use() {
            return encode(rendered);
        }
        let mut ids = Vec::new();
        for segment in self.segments_of(rendered) {
            ids.extend_from_slice(&self.segment_tokens(segment, &encode)?);
        }
        let chat = self.chats.fetch_add(1, Ordering::Relaxed);
        if chat < CHAT_MEMO_VERIFY_FIRST || chat.is_multiple_of(CHAT_MEMO_VERIFY_EVERY_NTH) {
            self.chats_verified.fetch_add(1, Ordering::Relaxed);
            let whole = encode(rendered)?;
            if whole != ids {
                // Only one thread logs: the swap tells it that it was the first to see it.
                if self.trusted.swap(false, Ordering::Relaxed) {
                    let at = whole.iter().zip(&ids).take_while(|(a, b)| a == b).count();
                    tracing::warn!(
                        first_difference = at,
                        whole_tokens = whole.len(),
                        segmented_tokens = ids.len(),
                        "simulated engine: a chat tokenized per message differs from its whole \
                         tokenization; tokenizing chats whole from now on"
                    );
                    *self.segments.lock() = Segments::default();
                }
                return Ok(whole);
            }
        }
        Ok(ids)
    }

    /// `rendered` cut before every marker occurrence (the first segment may start with none).
    fn segments_of<'t>(&self, rendered: &'t str) -> Vec<&'t str> {
        let mut cuts: Vec<usize> = self
            .markers
            .iter()
            .flat_map(|m| rendered.match_indices(m.as_str()).map(|(at, _)| at))
            .filter(|&at| at > 0)
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut segments = Vec::with_capacity(cuts.len() + 1);
        let mut start = 0;
        for cut in cuts {
            segments.push(&rendered[start..cut]);
            start = cut;
        }
        segments.push(&rendered[start..]);
        segments
    }

    fn segment_tokens(
        &self,
        segment: &str,
        encode: &impl Fn(&str) -> Result<Vec<u32>, String>,
    ) -> Result<Arc<[u32]>, String> {
        let key = (xxh3_128(segment.as_bytes()), segment.len());
        if let Some(ids) = self.segments.lock().by_text.get(&key) {
            self.segments_remembered.fetch_add(1, Ordering::Relaxed);
            return Ok(ids.clone());
        }
        // Tokenized outside the lock: two requests may tokenize the same new segment at once,
        // which costs CPU once more but never makes one wait for the other's tokenizing.
        let ids: Arc<[u32]> = encode(segment)?.into();
        self.segments_tokenized.fetch_add(1, Ordering::Relaxed);
        if segment.len() <= CHAT_MEMO_SEGMENT_BYTES_MAX && ids.len() <= self.tokens_max {
            let mut held = self.segments.lock();
            if held.tokens + ids.len() > self.tokens_max {
                *held = Segments::default();
            }
            if held.by_text.insert(key, ids.clone()).is_none() {
                held.tokens += ids.len();
            }
        }
        Ok(ids)
    }
}

/// The added tokens of `tokenizer` a chat may be cut before, by the rules in the module comment;
/// none when the tokenizer truncates or pads.
pub fn segment_markers(tokenizer: &tokenizers::Tokenizer) -> Vec<String> {
    // A tokenizer told to encode special tokens as text does not split at them at all.
    if tokenizer.get_truncation().is_some()
        || tokenizer.get_padding().is_some()
        || tokenizer.get_encode_special_tokens()
    {
        return Vec::new();
    }
    let added: Vec<tokenizers::AddedToken> =
        tokenizer.get_added_tokens_decoder().into_values().collect();
    let contents: Vec<&str> = added.iter().map(|t| t.content.as_str()).collect();
    let mut markers: Vec<String> = added
        .iter()
        .filter(|t| t.special && !t.content.is_empty())
        .filter(|t| !t.lstrip && !t.rstrip && !t.single_word && !t.normalized)
        .filter(|t| !any_match_could_cross(&contents, &t.content))
        .map(|t| t.content.clone())
        .collect();
    markers.sort_unstable();
    markers
}

/// Whether some added token could match text that starts before an occurrence of `marker` and
/// ends inside or past it: a proper suffix of the token that `marker` starts with, or that
/// starts `marker`.
fn any_match_could_cross(added: &[&str], marker: &str) -> bool {
    added.iter().any(|token| {
        token
            .char_indices()
            .skip(1)
            .map(|(at, _)| &token[at..])
            .any(|suffix| suffix.starts_with(marker) || marker.starts_with(suffix))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped() -> tokenizers::Tokenizer {
        tokenizers::Tokenizer::from_file(crate::config::default_tokenizer_path())
            .expect("shipped tokenizer")
    }

    fn whole(tokenizer: &tokenizers::Tokenizer) -> impl Fn(&str) -> Result<Vec<u32>, String> + '_ {
        |text| {
            tokenizer
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string())
        }
    }

    const CHAT: &str = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n  hi  there \
                        <|im_end|>\n<|im_start|>assistant\n";

    #[test]
    fn the_shipped_chat_markers_are_segment_markers() {
        let markers = segment_markers(&shipped());
        assert!(
            markers.iter().any(|m| m == "<|im_start|>"),
            "markers found: {markers:?}"
        );
    }

    #[test]
    fn never_cut_at_markers_that_strip_nor_for_tokenizers_that_truncate_or_read_markers_as_text() {
        let mut tokenizer = shipped();
        tokenizer
            .add_special_tokens([
                tokenizers::AddedToken::from("<|lstrip|>", true).lstrip(true),
                tokenizers::AddedToken::from("<|word|>", true).single_word(true),
            ])
            .expect("tokens added");
        let markers = segment_markers(&tokenizer);
        assert!(!markers.iter().any(|m| m == "<|lstrip|>" || m == "<|word|>"));
        assert!(!markers.is_empty(), "the plain markers stay");
        let mut special_as_text = tokenizer.clone();
        special_as_text.set_encode_special_tokens(true);
        assert_eq!(segment_markers(&special_as_text), Vec::<String>::new());
        tokenizer
            .with_truncation(Some(tokenizers::TruncationParams::default()))
            .expect("truncation set");
        assert_eq!(segment_markers(&tokenizer), Vec::<String>::new());
    }

    #[test]
    fn a_marker_that_another_added_token_could_run_into_is_never_cut_at() {
        assert!(
            any_match_could_cross(&["x<|a"], "<|a|>"),
            "suffix starts the marker"
        );
        assert!(
            any_match_could_cross(&["x<|a|>y"], "<|a|>"),
            "suffix starts with the marker"
        );
        assert!(
            !any_match_could_cross(&["<|a|>", "<|b|>"], "<|a|>"),
            "a token is not its own suffix"
        );
        assert!(!any_match_could_cross(&["<|b|>x"], "<|a|>"));
    }

    #[test]
    fn a_remembered_chat_is_tokenized_as_the_whole_text_is() {
        let tokenizer = shipped();
        let memo = ChatMemo::for_tokenizer(&tokenizer);
        let first = memo.encode_chat(CHAT, whole(&tokenizer)).unwrap();
        assert_eq!(first, whole(&tokenizer)(CHAT).unwrap());
        let next_turn = format!("{CHAT}Sure.<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n");
        let before = memo.counts();
        let ids = memo.encode_chat(&next_turn, whole(&tokenizer)).unwrap();
        assert_eq!(ids, whole(&tokenizer)(&next_turn).unwrap());
        let after = memo.counts();
        // Cut before each marker (`<|im_start|>` and `<|im_end|>`): of the next turn's eight
        // segments, only the answer and the new question are new.
        assert_eq!(
            after.segments_tokenized - before.segments_tokenized,
            2,
            "only the new messages tokenized: {before:?} -> {after:?}"
        );
        assert_eq!(after.segments_remembered - before.segments_remembered, 6);
    }

    #[test]
    fn a_check_that_finds_a_mismatch_turns_the_memory_off_and_answers_the_whole_tokens() {
        let tokenizer = shipped();
        let memo = ChatMemo::for_tokenizer(&tokenizer);
        // A wrong entry, as a broken cut would leave: the first segment's tokens reversed.
        let system = &CHAT[..CHAT.find("<|im_end|>").unwrap()];
        let mut wrong = whole(&tokenizer)(system).unwrap();
        wrong.reverse();
        memo.segments
            .lock()
            .by_text
            .insert((xxh3_128(system.as_bytes()), system.len()), wrong.into());
        let ids = memo.encode_chat(CHAT, whole(&tokenizer)).unwrap();
        assert_eq!(
            ids,
            whole(&tokenizer)(CHAT).unwrap(),
            "the first chat is checked"
        );
        assert!(!memo.in_use(), "one mismatch turns the memory off");
        assert_eq!(memo.tokens_held(), 0, "and empties it");
    }

    #[test]
    fn chats_after_the_first_ones_are_checked_one_in_n() {
        let tokenizer = shipped();
        let memo = ChatMemo::for_tokenizer(&tokenizer);
        let chats = CHAT_MEMO_VERIFY_FIRST + 2 * CHAT_MEMO_VERIFY_EVERY_NTH;
        for _ in 0..chats {
            memo.encode_chat(CHAT, whole(&tokenizer)).unwrap();
        }
        // Chats 0..8 and then every chat whose number is a multiple of 64 (64 and 128).
        assert_eq!(memo.counts().chats_verified, CHAT_MEMO_VERIFY_FIRST + 2);
    }

    #[test]
    fn the_memory_never_holds_more_tokens_than_its_bound() {
        let tokenizer = shipped();
        let memo = ChatMemo::with_markers(segment_markers(&tokenizer), 64);
        for i in 0..200 {
            let chat = format!(
                "<|im_start|>user\nmessage number {i} with a few words<|im_end|>\n\
                 <|im_start|>assistant\n"
            );
            let ids = memo.encode_chat(&chat, whole(&tokenizer)).unwrap();
            assert_eq!(ids, whole(&tokenizer)(&chat).unwrap());
            assert!(memo.tokens_held() <= 64, "held {}", memo.tokens_held());
        }
    }

    #[test]
    fn a_tokenizer_without_markers_tokenizes_whole() {
        let tokenizer = shipped();
        let memo = ChatMemo::with_markers(Vec::new(), CHAT_MEMO_TOKENS_MAX);
        assert!(!memo.in_use());
        assert_eq!(
            memo.encode_chat(CHAT, whole(&tokenizer)).unwrap(),
            whole(&tokenizer)(CHAT).unwrap()
        );
        assert_eq!(memo.counts(), MemoCounts::default());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Random chats, markers and whitespace at every edge, a marker written inside a
        /// message: cut per segment and remembered, they tokenize as the whole text does.
        #[test]
        fn segmented_tokens_equal_the_whole_text_for_random_chats(
            messages in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["system", "user", "assistant"]),
                    "[ a-zA-Z0-9\\n\\t.,!?'é中<>|_]{0,60}",
                    proptest::bool::ANY,
                ),
                1..6,
            )
        ) {
            let tokenizer = shipped();
            let memo = ChatMemo::for_tokenizer(&tokenizer);
            let mut chat = String::new();
            for (role, content, inner_marker) in &messages {
                let content = if *inner_marker {
                    format!("{content}<|im_start|>{content}")
                } else {
                    content.to_string()
                };
                chat.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
                // Each prefix too, so later chats find earlier segments remembered.
                let ids = memo.encode_chat(&chat, whole(&tokenizer)).unwrap();
                proptest::prop_assert_eq!(ids, whole(&tokenizer)(&chat).unwrap());
            }
            proptest::prop_assert!(memo.in_use(), "no check found a mismatch");
        }
    }
}
