//! Local tokenization: text and chat requests become the token ids the router hashes.
//!
//! Routing must hash exactly what the engine will cache, so the router tokenizes with the model's
//! own `tokenizer.json` and renders chat messages with the model's `chat_template` (minijinja),
//! then forwards token ids where the engine API accepts them.
//!
//! Chat caching, and why it is exact. A chat request is rendered as a sequence of SEGMENTS: the
//! text that message `k` adds is `render(messages[..=k])` minus its prefix
//! `render(messages[..k])`, and the generation prompt is `render(all, add_generation_prompt)`
//! minus `render(all)`. Each segment is tokenized on its own and looked up in a bounded cache by
//! (hash, length) of its text, so a shared system prompt or the earlier turns of a conversation
//! are tokenized once. Concatenating per-segment tokens equals tokenizing the whole rendering only
//! when no token spans a segment boundary; chat templates put special tokens (which the
//! pre-tokenizer always splits at) on those boundaries, so this holds for ordinary templates. It
//! is not assumed: the first [`VERIFY_FIRST_CHATS`] chats of a model, and one in
//! [`VERIFY_EVERY_NTH_CHAT`] after that, are also tokenized whole and compared; one mismatch
//! switches that model to whole-text tokenization for good. Every check runs on the blocking
//! pool, off the request's thread, one at a time per model: a whole tokenization costs
//! milliseconds (tens for a long chat) and would stall every request queued behind it on that
//! thread. The first checks run one after another from the first chat on, until
//! [`VERIFY_FIRST_CHATS`] have completed (a chat that comes while one runs is not checked), so a
//! template that breaks the assumption is caught within the first check's time; the periodic
//! ones at most one per [`VERIFY_INTERVAL_MIN_MS`]. Meanwhile the chats route on their segmented
//! tokens: a chat's token ids only steer routing (its body is forwarded as sent), so a check that
//! lags costs at most the routing of the chats before it. (Checking the first chats inline had
//! every new replica pay a whole tokenization on each of its first 32 chats' paths: behind a
//! round robin of four fresh replicas a third of the demo's requests; docs/BENCHMARKS.md.) If a
//! template's rendering of a prefix
//! is not a prefix of the longer rendering (templates that look at the last message), that request
//! is tokenized whole.
//!
//! Rendering every prefix is itself quadratic in the conversation's length, so what a prefix
//! rendered is remembered too, keyed by a chained hash of its messages (`PrefixRender`): a
//! conversation's next turn renders only the messages it adds (and the generation prompt), and a
//! repeated request renders nothing. A remembered prefix is only used after checking, by length
//! and hash, that the new rendering starts with it.
//!
//! Shared with siblings. Behind a per-request round robin, a conversation's next turn reaches a
//! replica that tokenized few of its earlier turns; alone, that replica renders and tokenizes every
//! message its siblings already did (it doubled the data plane's CPU per request with four
//! replicas; docs/BENCHMARKS.md). So every conversation prefix a replica renders is also offered
//! (`SharedPrefix`: its key, rendering length and hash, and the segment's tokens) to the load-sharing
//! stream, which carries it to the siblings that asked for it (`peer::load_share_tasks`); a sibling
//! adopts it into its own prefix cache if it holds the same tokenizer (`fingerprint`: the hash of
//! `tokenizer.json` and the chat template) and does not know that prefix yet. An adopted prefix is
//! used like one's own: a rendering that does not start with it is caught by the length-and-hash
//! check, and the periodic whole-chat comparison covers its tokens (a mismatch turns segmenting off
//! for the model, the safe direction). Chats are forwarded as text, so a wrong shared segment could
//! misroute a chat, never change what the engine computes. Adopted prefixes live in the same
//! bounded cache as one's own (entries and tokens), which a fleet of N replicas fills about N
//! times as fast.
//!
//! Heads. A new document in a chat (a long segment the cache has not seen) is what tokenizing
//! costs most, and routing needs little of it: a rank's match can only run past a block if the
//! rank holds every block before it. So the data plane asks for the chat's head
//! (`encode_chat_head`): the segments before the document and the document's first 8 KiB. It
//! keeps the head when no rank's match reaches the head's end, and once the request is routed
//! the rest is tokenized on the blocking pool (`complete_aside`), which caches it for the next
//! turn, hands the whole tokens on (the router makes them pending on the chosen rank) and checks
//! that the head began the whole chat; one mismatch turns heads off for the model, as with the
//! segment cache.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use serde_json::Value;

/// Chats verified whole-vs-segmented after a model's tokenizer loads.
pub const VERIFY_FIRST_CHATS: u64 = 32;
/// After the first ones, one chat in this many is verified.
pub const VERIFY_EVERY_NTH_CHAT: u64 = 256;
/// ... and at most one per this long, so the checks' CPU stays bounded at any request rate.
pub const VERIFY_INTERVAL_MIN_MS: u64 = 1_000;
/// Segments longer than this are tokenized but not cached (one huge document must not evict
/// every shared system prompt).
pub const CACHED_SEGMENT_MAX_TOKENS: usize = 32_768;
/// Upper bound on tokens held by one model's segment cache (4 bytes each).
pub const SEGMENT_CACHE_TOKENS_MAX: usize = 16 * 1024 * 1024;
/// Segments longer than this (in tokens) are not offered to siblings: every segment this
/// replica caches ([`CACHED_SEGMENT_MAX_TOKENS`]), so a long document a sibling tokenized is not
/// tokenized again on its next turn's path wherever it lands (the long-conversations workload's
/// documents are 19,000-28,000 tokens). One such prefix is about 230 KB of a frame's JSON, under
/// half of a frame line's limit (`peer::load_frame`).
pub const SHARED_PREFIX_TOKENS_MAX: usize = CACHED_SEGMENT_MAX_TOKENS;
/// Shared prefixes held for the siblings' streams between two frames (a broadcast ring: a
/// stream that falls this far behind loses the oldest, and its sibling tokenizes them itself).
/// The ring keeps a prefix until every stream has taken it, so a sibling that stops reading
/// pins at most this many: [`SHARED_PREFIX_PINNED_BYTES_MAX`] at the longest.
pub const SHARED_PREFIX_QUEUE_MAX: usize = 512;
/// The most bytes of token ids the shared-prefix ring can pin (4 bytes a token).
pub const SHARED_PREFIX_PINNED_BYTES_MAX: usize = 64 * 1024 * 1024;
const _: () = assert!(
    SHARED_PREFIX_QUEUE_MAX * SHARED_PREFIX_TOKENS_MAX * 4 <= SHARED_PREFIX_PINNED_BYTES_MAX
);
/// Messages accepted in one chat request.
pub const CHAT_MESSAGES_MAX: usize = 4_096;
/// Segmented tokenization renders every message prefix, so its cost is about
/// `messages x conversation bytes`; above this budget the chat is tokenized whole (linear), so a
/// long conversation cannot make the router do quadratic work.
pub const SEGMENTED_RENDER_BUDGET_BYTES: usize = 32 * 1024 * 1024;

/// A segment the cache has not seen and at least this long is tokenized only in its head on the
/// request's path, when the caller allows it ([`ModelTokenizer::encode_chat_head`]).
pub const ROUTING_HEAD_SEGMENT_BYTES_MIN: usize = 32 * 1024;
/// How much of such a segment is tokenized on the path: about 1,600 tokens of English, 100
/// blocks of 16, far more than the first block a match needs.
pub const ROUTING_HEAD_BYTES: usize = 8 * 1024;
/// Completions of head-only chats running aside at once, per model; past it a chat's tail is
/// not tokenized aside (its next turn tokenizes it on its own path, as without heads).
pub const ROUTING_HEAD_COMPLETIONS_MAX: usize = 2;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot load tokenizer from {path}: {reason}")]
    Load { path: PathBuf, reason: String },
    #[error("tokenization failed: {0}")]
    Encode(String),
    #[error("model has no chat template")]
    NoChatTemplate,
    #[error("chat template failed: {0}")]
    Template(String),
    #[error("invalid messages: {0}")]
    BadMessages(String),
}

/// Where a chat's tokens came from; reported in metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatTokenization {
    /// Every segment was tokenized now or taken from the cache.
    Segmented {
        cached_segments: usize,
        fresh_segments: usize,
    },
    /// The whole rendering was tokenized (template not prefix-stable, or model fell back).
    Whole,
    /// Only a head was tokenized ([`ModelTokenizer::encode_chat_head`]): the tokens are the
    /// chat's first ones, and `prompt_tokens_estimate` is the whole chat's length estimated
    /// from the head's bytes per token.
    Head {
        cached_segments: usize,
        prompt_tokens_estimate: usize,
    },
}

/// What a cache entry costs against the token budget.
trait TokenCost {
    fn token_cost(&self) -> usize;
}

impl TokenCost for Arc<[u32]> {
    fn token_cost(&self) -> usize {
        self.len()
    }
}

/// A bounded approximate-LRU map. Two generations: lookups hit `current` or promote from
/// `previous`; when `current` fills up (entries or tokens) it becomes `previous` and the old
/// `previous` is dropped. That bounds memory by entries and by tokens without per-entry
/// bookkeeping. Used for segment text (xxh3 hash + length) -> token ids, and for conversation
/// prefixes (see `PrefixRender`).
struct SegmentCache<K, V> {
    current: HashMap<K, V>,
    previous: HashMap<K, V>,
    current_tokens: usize,
    entries_max: usize,
}

impl<K: std::hash::Hash + Eq + Copy, V: TokenCost + Clone> SegmentCache<K, V> {
    fn new(entries_max: usize) -> Self {
        SegmentCache {
            current: HashMap::new(),
            previous: HashMap::new(),
            current_tokens: 0,
            entries_max: entries_max.max(2),
        }
    }

    fn get(&mut self, key: K) -> Option<V> {
        if let Some(v) = self.current.get(&key) {
            return Some(v.clone());
        }
        let v = self.previous.remove(&key)?;
        self.insert(key, v.clone());
        Some(v)
    }

    fn insert(&mut self, key: K, value: V) {
        let cost = value.token_cost();
        if cost > CACHED_SEGMENT_MAX_TOKENS {
            return;
        }
        if self.current.len() >= self.entries_max / 2
            || self.current_tokens + cost > SEGMENT_CACHE_TOKENS_MAX / 2
        {
            self.previous = std::mem::take(&mut self.current);
            self.current_tokens = 0;
        }
        self.current_tokens += cost;
        self.current.insert(key, value);
    }

    fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

/// Segment text (xxh3 hash, byte length) -> its token ids.
type SegmentTokens = SegmentCache<(u64, usize), Arc<[u32]>>;

/// What rendering a conversation prefix `messages[..=k]` produced, keyed by a chained hash of
/// those messages: the rendering's length and hash (to check that a longer rendering really
/// starts with it) and the tokens of the segment message `k` added. With it, a multi-turn request
/// renders only the messages added since the conversation's previous turn (and the generation
/// prompt), not every prefix again: rendering every prefix was the bulk of a cached chat's cost
/// (minijinja evaluation and string copies, quadratic in the conversation's length).
#[derive(Clone)]
struct PrefixRender {
    rendered_len: usize,
    rendered_hash: u64,
    segment: Arc<[u32]>,
}

impl TokenCost for PrefixRender {
    fn token_cost(&self) -> usize {
        self.segment.len()
    }
}

/// A conversation prefix this replica rendered, as offered to its siblings: the
/// [`PrefixRender`] under its key, tagged with the tokenizer it was made with. Defined with the
/// frame codec that carries it (`peer::load_frame`, which must stay free of `crate::` paths).
pub use crate::peer::load_frame::SharedPrefix;

/// Chained key of a conversation prefix: message `k`'s canonical JSON hashed with the key of
/// `messages[..k]` as seed. The generation prompt gets its own step with a fixed marker.
fn prefix_key(parent: u64, message_json: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(message_json, parent)
}
const PREFIX_KEY_ROOT: u64 = 0x6368_6174_7072_6566; // "chatpref"
const GENERATION_PROMPT_MARK: &[u8] = b"\x00add_generation_prompt";

/// One model's tokenizer, chat template and segment cache.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<minijinja::Environment<'static>>,
    bos_token: String,
    eos_token: String,
    cache: Mutex<SegmentTokens>,
    prefixes: Mutex<SegmentCache<u64, PrefixRender>>,
    /// Template renderings done, for tests and the benchmark's accounting.
    renders: AtomicU64,
    chats_seen: AtomicU64,
    segmented_disabled: AtomicBool,
    /// Set when a completed chat's tokens did not start with its head's: heads are then never
    /// used again for this model.
    heads_disabled: AtomicBool,
    /// Head-only chats being completed aside (at most [`ROUTING_HEAD_COMPLETIONS_MAX`]).
    completing: std::sync::atomic::AtomicUsize,
    /// Completions finished, for tests.
    completions_done: AtomicU64,
    /// Set while a periodic verification runs in the background (at most one per model).
    verifying: AtomicBool,
    /// First checks completed: until [`VERIFY_FIRST_CHATS`], every chat is offered one.
    first_checks_done: AtomicU64,
    /// Periodic verifications completed, for tests.
    verifications_done: AtomicU64,
    /// When the last periodic verification started, in ms since `created` (`u64::MAX`: never).
    last_verify_ms: AtomicU64,
    created: std::time::Instant,
    /// Identifies this tokenizer and chat template across replicas (see [`SharedPrefix`]).
    fingerprint: u64,
    /// Where rendered prefixes are offered to the siblings' streams; set by [`TokenizerSet`].
    shared_out: Option<tokio::sync::broadcast::Sender<Arc<SharedPrefix>>>,
    /// Prefixes adopted from siblings, for tests.
    adopted_prefixes: AtomicU64,
    /// One past the highest token id of the vocabulary (added tokens included): a sibling's
    /// prefix naming an id at or past it is refused. Computed once at load, because the
    /// tokenizer's own count walks its added tokens on every call.
    token_ids_end: u64,
    /// The most text bytes one token can stand for, when the pipeline allows a bound
    /// (see [`crate::routing::text_bound`]).
    text_bytes_per_token_max: Option<usize>,
    pub path: PathBuf,
}

fn special_token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ModelTokenizer {
    /// Loads `tokenizer.json` (the path may be the file or its directory) and, when present, the
    /// `chat_template` from the sibling `tokenizer_config.json`.
    pub fn load(path: &Path, cache_entries_max: usize) -> Result<ModelTokenizer, TokenizeError> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let load_err = |reason: String| TokenizeError::Load {
            path: file.clone(),
            reason,
        };
        let raw = std::fs::read(&file).map_err(|e| load_err(e.to_string()))?;
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&raw).map_err(|e| load_err(e.to_string()))?;
        // The same bytes as plain JSON: which stages the pipeline has is what decides whether a
        // text's token count has a lower bound.
        let text_bytes_per_token_max = serde_json::from_slice::<Value>(&raw)
            .ok()
            .and_then(|json| crate::routing::text_bound::bytes_per_token_max(&json));
        let config_path = file
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .unwrap_or_else(|| PathBuf::from("tokenizer_config.json"));
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(s) => serde_json::from_str(&s)
                .map_err(|e| load_err(format!("tokenizer_config.json: {e}")))?,
            Err(_) => Value::Null,
        };
        let template_src = match config.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // HF also allows a list of named templates; the one named "default" is the chat one.
            Some(Value::Array(items)) => items
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| items.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            _ => None,
        };
        let fingerprint = {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            h.update(&raw);
            h.update(b"\x00chat_template\x00");
            h.update(template_src.as_deref().unwrap_or_default().as_bytes());
            h.digest()
        };
        let token_ids_end = tokenizer
            .get_vocab(true)
            .values()
            .map(|&id| u64::from(id) + 1)
            .max()
            .unwrap_or(0);
        let template = match template_src {
            Some(src) => {
                let mut env = minijinja::Environment::new();
                env.add_function(
                    "raise_exception",
                    |msg: String| -> Result<String, minijinja::Error> {
                        Err(minijinja::Error::new(
                            minijinja::ErrorKind::InvalidOperation,
                            msg,
                        ))
                    },
                );
                env.add_template_owned("chat", src)
                    .map_err(|e| load_err(format!("chat_template: {e}")))?;
                Some(env)
            }
            None => None,
        };
        Ok(ModelTokenizer {
            tokenizer,
            template,
            bos_token: special_token_text(config.get("bos_token")),
            eos_token: special_token_text(config.get("eos_token")),
            cache: Mutex::new(SegmentCache::new(cache_entries_max)),
            prefixes: Mutex::new(SegmentCache::new(cache_entries_max)),
            renders: AtomicU64::new(0),
            chats_seen: AtomicU64::new(0),
            segmented_disabled: AtomicBool::new(false),
            heads_disabled: AtomicBool::new(false),
            completing: std::sync::atomic::AtomicUsize::new(0),
            completions_done: AtomicU64::new(0),
            verifying: AtomicBool::new(false),
            first_checks_done: AtomicU64::new(0),
            verifications_done: AtomicU64::new(0),
            last_verify_ms: AtomicU64::new(u64::MAX),
            created: std::time::Instant::now(),
            fingerprint,
            shared_out: None,
            adopted_prefixes: AtomicU64::new(0),
            token_ids_end,
            text_bytes_per_token_max,
            path: file,
        })
    }

    /// The most text bytes one token can stand for, or `None` when this tokenizer allows no
    /// such bound (see [`crate::routing::text_bound`]).
    pub fn text_bytes_per_token_max(&self) -> Option<usize> {
        self.text_bytes_per_token_max
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Tokenizes a completion prompt the way engines do (special tokens such as BOS added).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode(text, true)
    }

    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Renders messages with the chat template. `messages` must be a JSON array of objects.
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let env = self
            .template
            .as_ref()
            .ok_or(TokenizeError::NoChatTemplate)?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        self.renders.fetch_add(1, Ordering::Relaxed);
        tmpl.render(minijinja::context! {
            messages => minijinja::Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| TokenizeError::Template(e.to_string()))
    }

    /// Chat template renderings done so far by this model's tokenizer.
    pub fn renders_total(&self) -> u64 {
        self.renders.load(Ordering::Relaxed)
    }

    /// Tokenizes the whole rendering at once (the reference the segmented path must equal).
    pub fn encode_chat_whole(&self, messages: &[Value]) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render(messages, true)?;
        // The template already wrote BOS and role markers, so the tokenizer must not add more.
        self.encode(&text, false)
    }

    /// Tokenizes a chat with the per-segment cache (see the module doc for why it is exact).
    pub fn encode_chat(
        self: &Arc<Self>,
        messages: &[Value],
    ) -> Result<(Vec<u32>, ChatTokenization), TokenizeError> {
        self.encode_chat_with(messages, false)
    }

    /// Like [`Self::encode_chat`], but a long segment the cache has not seen (a new document)
    /// is tokenized only in its head, and the chat's later segments not at all: the result is
    /// then [`ChatTokenization::Head`] and its tokens are the chat's first ones.
    ///
    /// Why: routing reads a prompt's tokens only as far as some rank holds its blocks, and on
    /// a new document that is the document's first block at most, while tokenizing all of it
    /// costs milliseconds per ten thousand tokens on the request's path (docs/BENCHMARKS.md,
    /// "Long conversations against the peers"). The caller decides whether the head is enough
    /// (no rank's match reaches its last whole block), else tokenizes the chat whole with
    /// [`Self::encode_chat`]; and it hands the head to [`Self::complete_aside`], which tokenizes
    /// the rest off the path (so the conversation's next turn finds it cached) and checks that
    /// the head was the whole chat's beginning.
    ///
    /// The head ends before a single space between two words, so the text after it starts
    /// with that space and its next word. Pre-tokenizers of the BPE tokenizers in use (byte-level
    /// GPT-2 and tiktoken-style patterns, SentencePiece's metaspace) attach a space to the word
    /// that follows it, so no token spans the cut. That is an observation about tokenizers, not
    /// a guarantee, so it is checked on every completion, and one mismatch turns heads off for
    /// the model for good.
    pub fn encode_chat_head(
        self: &Arc<Self>,
        messages: &[Value],
    ) -> Result<(Vec<u32>, ChatTokenization), TokenizeError> {
        let heads = !self.heads_disabled.load(Ordering::Relaxed);
        self.encode_chat_with(messages, heads)
    }

    /// Tokenizes the rest of a chat whose head [`Self::encode_chat_head`] gave, on the blocking
    /// pool (filling the segment cache for the next turn), and turns heads off for this model if
    /// the whole chat's tokens do not start with `head`. At most
    /// [`ROUTING_HEAD_COMPLETIONS_MAX`] run at once; past that the chat is not completed.
    /// `held` (the caller's share of a memory budget, say) is dropped when the completion ends;
    /// `then` receives the whole chat's tokens when they start with `head`.
    /// Outside a tokio runtime it runs inline.
    pub fn complete_aside<H: Send + 'static>(
        self: &Arc<Self>,
        messages: Vec<Value>,
        head: Vec<u32>,
        held: H,
        then: impl FnOnce(&[u32]) + Send + 'static,
    ) {
        if self.completing.fetch_add(1, Ordering::AcqRel) >= ROUTING_HEAD_COMPLETIONS_MAX {
            self.completing.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        let me = self.clone();
        let complete = move || {
            match me.encode_chat_with(&messages, false) {
                Ok((whole, _)) if !whole.starts_with(&head) => {
                    tracing::warn!(
                        tokenizer = %me.path.display(),
                        "a chat's head tokens differ from the start of its whole tokens; \
                         tokenizing chats whole on the request's path from now on"
                    );
                    me.heads_disabled.store(true, Ordering::Relaxed);
                }
                Ok((whole, _)) => then(&whole),
                Err(e) => tracing::debug!(error = %e, "completing a chat's tokens failed"),
            }
            me.completions_done.fetch_add(1, Ordering::Relaxed);
            me.completing.fetch_sub(1, Ordering::AcqRel);
            drop(held);
        };
        run_aside(complete);
    }

    /// Head-only chats completed aside so far, for tests.
    pub fn completions_done(&self) -> u64 {
        self.completions_done.load(Ordering::Relaxed)
    }

    /// False once a completion found a head that was not its chat's beginning.
    pub fn heads_enabled(&self) -> bool {
        !self.heads_disabled.load(Ordering::Relaxed)
    }

    fn encode_chat_with(
        self: &Arc<Self>,
        messages: &[Value],
        allow_head: bool,
    ) -> Result<(Vec<u32>, ChatTokenization), TokenizeError> {
        validate_messages(messages)?;
        let conversation_bytes: usize = messages
            .iter()
            .map(|m| m.get("content").and_then(Value::as_str).map_or(0, str::len) + 16)
            .sum();
        if self.segmented_disabled.load(Ordering::Relaxed)
            || messages.len().saturating_mul(conversation_bytes) > SEGMENTED_RENDER_BUDGET_BYTES
        {
            return Ok((self.encode_chat_whole(messages)?, ChatTokenization::Whole));
        }
        let Some((tokens, how)) = self.encode_chat_segmented(messages, allow_head)? else {
            return Ok((self.encode_chat_whole(messages)?, ChatTokenization::Whole));
        };
        if matches!(how, ChatTokenization::Head { .. }) {
            // Checked when it is completed (`complete_aside`), not here: checking now would
            // tokenize the whole chat on the path, which is what the head spares.
            return Ok((tokens, how));
        }
        let n = self.chats_seen.fetch_add(1, Ordering::Relaxed);
        if self.first_checks_done() < VERIFY_FIRST_CHATS {
            self.verify_aside(messages, &tokens, Check::First);
        } else if n.is_multiple_of(VERIFY_EVERY_NTH_CHAT) && self.verification_due() {
            self.verify_aside(messages, &tokens, Check::Periodic);
        }
        Ok((tokens, how))
    }

    /// True when `segmented` equals the whole-text tokenization; on a mismatch the segment cache
    /// is disabled for this model.
    fn agrees_with_whole(
        &self,
        messages: &[Value],
        segmented: &[u32],
    ) -> Result<bool, TokenizeError> {
        let whole = self.encode_chat_whole(messages)?;
        if whole != segmented {
            tracing::warn!(
                tokenizer = %self.path.display(),
                "segmented chat tokenization differs from whole-text tokenization; \
                 disabling the segment cache for this model"
            );
            self.segmented_disabled.store(true, Ordering::Relaxed);
            return Ok(false);
        }
        Ok(true)
    }

    /// True (and the interval restarted) when no periodic check started in the last
    /// [`VERIFY_INTERVAL_MIN_MS`].
    fn verification_due(&self) -> bool {
        let now_ms = self.created.elapsed().as_millis() as u64;
        let last = self.last_verify_ms.load(Ordering::Relaxed);
        if last != u64::MAX && now_ms.saturating_sub(last) < VERIFY_INTERVAL_MIN_MS {
            return false;
        }
        // One caller wins the slot; a racing one skips this sample.
        self.last_verify_ms
            .compare_exchange(last, now_ms, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// A check (first or periodic), run on the blocking pool instead of the request's thread.
    ///
    /// Why: tokenizing a long chat whole costs milliseconds, and done inline on a data-plane
    /// thread it delays this request and every request queued behind it on that thread (the
    /// chat row's tail in docs/BENCHMARKS.md shows it). This
    /// request routes on its segmented tokens either way (a chat's token ids only steer routing;
    /// its body is forwarded as the client sent it), so the check can run aside; a mismatch
    /// disables the cache for the requests after it. At most one check runs per model; a
    /// chat that comes while one runs is not checked. Outside a tokio runtime it runs inline.
    fn verify_aside(self: &Arc<Self>, messages: &[Value], segmented: &[u32], kind: Check) {
        if self.verifying.swap(true, Ordering::AcqRel) {
            return;
        }
        let check = {
            let me = self.clone();
            let (messages, segmented) = (messages.to_vec(), segmented.to_vec());
            move || {
                if let Err(e) = me.agrees_with_whole(&messages, &segmented) {
                    tracing::debug!(error = %e, "chat tokenization check failed to run");
                }
                match kind {
                    Check::First => me.first_checks_done.fetch_add(1, Ordering::AcqRel),
                    Check::Periodic => me.verifications_done.fetch_add(1, Ordering::Relaxed),
                };
                me.verifying.store(false, Ordering::Release);
            }
        };
        run_aside(check);
    }

    /// First checks (the first [`VERIFY_FIRST_CHATS`]) completed so far.
    pub fn first_checks_done(&self) -> u64 {
        self.first_checks_done.load(Ordering::Acquire)
    }

    /// Periodic (background) verifications completed so far.
    pub fn verifications_done(&self) -> u64 {
        self.verifications_done.load(Ordering::Relaxed)
    }

    /// `None` when the template is not prefix-stable for these messages.
    /// With `allow_head`, stops at the first segment the cache has not seen that is at least
    /// [`ROUTING_HEAD_SEGMENT_BYTES_MIN`] long, after tokenizing its head (see
    /// [`Self::encode_chat_head`]); nothing is cached for that segment or after it.
    fn encode_chat_segmented(
        &self,
        messages: &[Value],
        allow_head: bool,
    ) -> Result<Option<(Vec<u32>, ChatTokenization)>, TokenizeError> {
        // Step k < n is the prefix messages[..=k]; step n is the generation prompt.
        let mut keys = Vec::with_capacity(messages.len() + 1);
        let mut key = PREFIX_KEY_ROOT;
        for m in messages {
            let json =
                serde_json::to_vec(m).map_err(|e| TokenizeError::BadMessages(e.to_string()))?;
            key = prefix_key(key, &json);
            keys.push(key);
        }
        keys.push(prefix_key(key, GENERATION_PROMPT_MARK));
        let mut out = Vec::new();
        let (mut cached, mut fresh) = (0usize, 0usize);
        // The longest run of steps already known: their segments come straight from the cache.
        let mut prev_len = 0usize;
        let mut prev_hash = xxhash_rust::xxh3::xxh3_64(b"");
        let mut first = 0usize;
        {
            let mut prefixes = self.prefixes.lock();
            while let Some(known) = keys.get(first).and_then(|&k| prefixes.get(k)) {
                out.extend_from_slice(&known.segment);
                cached += 1;
                prev_len = known.rendered_len;
                prev_hash = known.rendered_hash;
                first += 1;
            }
        }
        for (k, &step_key) in keys.iter().enumerate().skip(first) {
            let rendered = if k < messages.len() {
                self.render(&messages[..=k], false)?
            } else {
                self.render(messages, true)?
            };
            // Prefix-stable means this rendering starts with the previous one (checked by
            // length and hash, since the previous one may come from the cache).
            let Some(segment) = rendered.get(prev_len..) else {
                return Ok(None);
            };
            if xxhash_rust::xxh3::xxh3_64(&rendered.as_bytes()[..prev_len]) != prev_hash {
                return Ok(None);
            }
            let tokens: Arc<[u32]> = if segment.is_empty() {
                Arc::from(Vec::new())
            } else {
                let seg_key = (
                    xxhash_rust::xxh3::xxh3_64(segment.as_bytes()),
                    segment.len(),
                );
                let hit = self.cache.lock().get(seg_key);
                match hit {
                    Some(t) => {
                        cached += 1;
                        t
                    }
                    None if allow_head && segment.len() >= ROUTING_HEAD_SEGMENT_BYTES_MIN => {
                        if let Some(cut) = head_cut(segment, ROUTING_HEAD_BYTES) {
                            let head = self.encode(&segment[..cut], false)?;
                            // The rest of the chat: this segment's tail, and what the later
                            // messages hold (their rendering adds a few tokens each).
                            let rest_bytes = (segment.len() - cut)
                                + messages[k.min(messages.len())..]
                                    .iter()
                                    .skip(1)
                                    .map(|m| {
                                        m.get("content").and_then(Value::as_str).map_or(0, str::len)
                                            + 16
                                    })
                                    .sum::<usize>()
                                + 16;
                            let rest_tokens = (rest_bytes as u128 * head.len().max(1) as u128
                                / cut.max(1) as u128)
                                as usize;
                            out.extend_from_slice(&head);
                            let prompt_tokens_estimate = out.len().saturating_add(rest_tokens);
                            return Ok(Some((
                                out,
                                ChatTokenization::Head {
                                    cached_segments: cached,
                                    prompt_tokens_estimate,
                                },
                            )));
                        }
                        fresh += 1;
                        let t: Arc<[u32]> = self.encode(segment, false)?.into();
                        self.cache.lock().insert(seg_key, t.clone());
                        t
                    }
                    None => {
                        fresh += 1;
                        let t: Arc<[u32]> = self.encode(segment, false)?.into();
                        self.cache.lock().insert(seg_key, t.clone());
                        t
                    }
                }
            };
            out.extend_from_slice(&tokens);
            prev_len = rendered.len();
            prev_hash = xxhash_rust::xxh3::xxh3_64(rendered.as_bytes());
            let known = PrefixRender {
                rendered_len: prev_len,
                rendered_hash: prev_hash,
                segment: tokens,
            };
            self.offer_to_siblings(step_key, &known);
            self.prefixes.lock().insert(step_key, known);
        }
        Ok(Some((
            out,
            ChatTokenization::Segmented {
                cached_segments: cached,
                fresh_segments: fresh,
            },
        )))
    }

    /// Identifies this tokenizer and chat template: two replicas that loaded the same files
    /// have the same fingerprint, and only then share rendered prefixes.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Offers a prefix this replica just rendered to the siblings' streams. When no sibling
    /// asked for them it costs the channel's receiver count: one uncontended lock of its tail
    /// (tokio's broadcast keeps the count under that lock), no allocation.
    fn offer_to_siblings(&self, key: u64, known: &PrefixRender) {
        let Some(out) = &self.shared_out else {
            return;
        };
        if known.segment.len() > SHARED_PREFIX_TOKENS_MAX || out.receiver_count() == 0 {
            return;
        }
        let _ = out.send(Arc::new(SharedPrefix {
            tokenizer: self.fingerprint,
            key,
            rendered_len: known.rendered_len as u64,
            rendered_hash: known.rendered_hash,
            tokens: known.segment.clone(),
        }));
    }

    /// Takes a sibling's rendered prefix into this tokenizer's prefix cache, unless this
    /// replica already knows that prefix (its own rendering stays). Refused (`false`) when it
    /// was made with another tokenizer, is too long, or names a token id this vocabulary does
    /// not have.
    pub fn adopt_shared_prefix(&self, shared: &SharedPrefix) -> bool {
        if shared.tokenizer != self.fingerprint
            || shared.tokens.len() > SHARED_PREFIX_TOKENS_MAX
            || shared
                .tokens
                .iter()
                .any(|&t| u64::from(t) >= self.token_ids_end)
        {
            return false;
        }
        let Ok(rendered_len) = usize::try_from(shared.rendered_len) else {
            return false;
        };
        let mut prefixes = self.prefixes.lock();
        if prefixes.get(shared.key).is_none() {
            prefixes.insert(
                shared.key,
                PrefixRender {
                    rendered_len,
                    rendered_hash: shared.rendered_hash,
                    segment: shared.tokens.clone(),
                },
            );
            self.adopted_prefixes.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// Prefixes adopted from siblings so far.
    pub fn adopted_prefixes(&self) -> u64 {
        self.adopted_prefixes.load(Ordering::Relaxed)
    }

    pub fn cached_segments(&self) -> usize {
        self.cache.lock().len()
    }

    pub fn segmented_enabled(&self) -> bool {
        !self.segmented_disabled.load(Ordering::Relaxed)
    }
}

/// Which count a whole-versus-segmented check adds to when it completes.
#[derive(Debug, Clone, Copy)]
enum Check {
    /// One of a model's first [`VERIFY_FIRST_CHATS`].
    First,
    /// A later sample ([`VERIFY_EVERY_NTH_CHAT`], [`VERIFY_INTERVAL_MIN_MS`]).
    Periodic,
}

/// Runs `job` on the blocking pool of the current tokio runtime, or inline outside one (the
/// background checks and completions of this module).
fn run_aside(job: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn_blocking(job);
        }
        Err(_) => job(),
    }
}

/// Where a head of at most `head_bytes` of `segment` ends: before the last single space
/// between two non-space characters within it (see [`ModelTokenizer::encode_chat_head`]), or
/// `None` when the head holds no such space (one unbroken run of text: tokenize it all).
fn head_cut(segment: &str, head_bytes: usize) -> Option<usize> {
    let bytes = segment.as_bytes();
    let end = head_bytes.min(bytes.len().saturating_sub(1));
    (1..end).rev().find(|&i| {
        bytes[i] == b' ' && !bytes[i - 1].is_ascii_whitespace() && {
            let next = bytes[i + 1];
            !next.is_ascii_whitespace()
        }
    })
}

fn validate_messages(messages: &[Value]) -> Result<(), TokenizeError> {
    if messages.is_empty() {
        return Err(TokenizeError::BadMessages(
            "messages must not be empty".into(),
        ));
    }
    if messages.len() > CHAT_MESSAGES_MAX {
        return Err(TokenizeError::BadMessages(format!(
            "at most {CHAT_MESSAGES_MAX} messages are accepted"
        )));
    }
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Value::as_str).is_none() {
            return Err(TokenizeError::BadMessages(format!(
                "messages[{i}].role must be a string"
            )));
        }
    }
    Ok(())
}

/// Turns OpenAI content parts (`[{"type":"text","text":..}]`) into the plain string templates
/// expect, leaving other fields alone.
pub fn normalize_messages(messages: &[Value]) -> Vec<Value> {
    messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(Value::Array(parts)) = m.get("content") {
                let text: String = parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("");
                m["content"] = Value::String(text);
            }
            m
        })
        .collect()
}

/// Tokenizers by file path, so models sharing one tokenizer share its cache; and the one
/// channel on which every one of them offers its rendered prefixes to the siblings' streams.
pub struct TokenizerSet {
    loaded: Mutex<HashMap<PathBuf, Arc<ModelTokenizer>>>,
    shared_out: tokio::sync::broadcast::Sender<Arc<SharedPrefix>>,
}

impl Default for TokenizerSet {
    fn default() -> Self {
        TokenizerSet {
            loaded: Mutex::new(HashMap::new()),
            shared_out: tokio::sync::broadcast::channel(SHARED_PREFIX_QUEUE_MAX).0,
        }
    }
}

impl TokenizerSet {
    /// The prefixes every loaded tokenizer renders from now on (for one sibling's stream).
    pub fn subscribe_shared(&self) -> tokio::sync::broadcast::Receiver<Arc<SharedPrefix>> {
        self.shared_out.subscribe()
    }

    /// The loaded tokenizer with this fingerprint, if any.
    pub fn by_fingerprint(&self, fingerprint: u64) -> Option<Arc<ModelTokenizer>> {
        self.loaded
            .lock()
            .values()
            .find(|t| t.fingerprint == fingerprint)
            .cloned()
    }

    pub fn get_or_load(
        &self,
        path: &Path,
        cache_entries_max: usize,
    ) -> Result<Arc<ModelTokenizer>, TokenizeError> {
        if let Some(t) = self.loaded.lock().get(path) {
            return Ok(t.clone());
        }
        let mut t = ModelTokenizer::load(path, cache_entries_max)?;
        t.shared_out = Some(self.shared_out.clone());
        let t = Arc::new(t);
        Ok(self
            .loaded
            .lock()
            .entry(path.to_path_buf())
            .or_insert(t)
            .clone())
    }
}

/// Why a text prompt or chat is routed on load without its tokens: the `reason` label of
/// `kvroute_untokenized_prompts_total`. The first two are the router's configuration, not the
/// request: every text request of that model is then routed blind to the engines' caches, which
/// is the silent hit-rate loss operators most need told about (see [`Untokenized::is_configuration`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untokenized {
    /// The model has no tokenizer (`--tokenizer-path`, `--model-tokenizer`).
    NoTokenizer,
    /// A chat for a model whose tokenizer has no chat template.
    NoChatTemplate,
    /// Text past `--tokenize-text-bytes-max`.
    TextTooLong,
    /// The tokenizer or the chat template failed on this request.
    TokenizeFailed,
}

impl Untokenized {
    pub fn label(self) -> &'static str {
        match self {
            Untokenized::NoTokenizer => "no_tokenizer",
            Untokenized::NoChatTemplate => "no_chat_template",
            Untokenized::TextTooLong => "text_too_long",
            Untokenized::TokenizeFailed => "tokenize_failed",
        }
    }

    /// True when every request of this kind for the model is untokenized, whatever its content:
    /// the router then predicts no cached tokens for any of them, and its prediction check is
    /// what shows the engines finding hits it cannot see.
    pub fn is_configuration(self) -> bool {
        matches!(self, Untokenized::NoTokenizer | Untokenized::NoChatTemplate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_cache_stays_bounded_and_keeps_recent_entries() {
        let mut c: SegmentTokens = SegmentCache::new(8);
        for i in 0..100u64 {
            c.insert((i, 1), vec![i as u32].into());
            assert!(c.len() <= 8, "cache grew to {}", c.len());
        }
        assert!(c.get((99, 1)).is_some(), "most recent entry must survive");
        assert!(
            c.get((0, 1)).is_none(),
            "oldest entry must have been evicted"
        );
    }

    #[test]
    fn a_promoted_entry_survives_the_next_generation_swap() {
        let mut c: SegmentTokens = SegmentCache::new(4);
        c.insert((1, 1), vec![1].into());
        c.insert((2, 1), vec![2].into()); // swap: {1} becomes previous
        assert!(c.get((1, 1)).is_some()); // promoted back into current
        c.insert((3, 1), vec![3].into());
        assert!(c.get((1, 1)).is_some());
    }

    #[test]
    fn oversized_segments_are_not_cached() {
        let mut c: SegmentTokens = SegmentCache::new(8);
        c.insert((1, 1), vec![0u32; CACHED_SEGMENT_MAX_TOKENS + 1].into());
        assert!(c.get((1, 1)).is_none());
    }

    #[test]
    fn messages_without_a_role_are_rejected() {
        let bad = vec![serde_json::json!({"content": "x"})];
        assert!(matches!(
            validate_messages(&bad),
            Err(TokenizeError::BadMessages(_))
        ));
        assert!(matches!(
            validate_messages(&[]),
            Err(TokenizeError::BadMessages(_))
        ));
    }

    #[test]
    fn content_parts_become_plain_text() {
        let m = normalize_messages(&[serde_json::json!({"role":"user","content":[
            {"type":"text","text":"a"},{"type":"text","text":"b"}]})]);
        assert_eq!(m[0]["content"], "ab");
    }
}

#[cfg(test)]
mod real_tokenizer_tests {
    //! Against the repository's shipped tokenizer and ChatML template (the one the simulated
    //! engines use), so the equivalence is proven on a real BPE, not a toy.
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    fn shipped() -> Arc<ModelTokenizer> {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer/tokenizer.json");
        Arc::new(ModelTokenizer::load(&path, 1024).expect("shipped tokenizer loads"))
    }

    fn conversation() -> Vec<Value> {
        vec![
            json!({"role": "system", "content": "You answer questions about routers. ".repeat(8)}),
            json!({"role": "user", "content": "What does a cache-aware router do?"}),
            json!({"role": "assistant", "content": "It sends a prompt where its prefix is cached."}),
            json!({"role": "user", "content": "And when that rank is busy?"}),
        ]
    }

    #[test]
    fn a_siblings_rendered_prefixes_spare_this_replica_rendering_and_tokenizing_them() {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer/tokenizer.json");
        let siblings = TokenizerSet::default();
        let mut offered = siblings.subscribe_shared();
        let sibling = siblings.get_or_load(&path, 1024).expect("loads");
        let here = shipped();
        assert_eq!(here.fingerprint(), sibling.fingerprint(), "same files");
        let chat = conversation();
        let (sibling_tokens, _) = sibling.encode_chat(&chat).expect("sibling tokenizes");
        let mut shared = 0;
        while let Ok(prefix) = offered.try_recv() {
            assert!(here.adopt_shared_prefix(&prefix), "adopted: {prefix:?}");
            shared += 1;
        }
        assert_eq!(
            shared,
            chat.len() + 1,
            "one per message and the generation prompt"
        );
        assert_eq!(here.adopted_prefixes(), shared as u64);
        let (tokens, how) = here.encode_chat(&chat).expect("tokenizes");
        assert_eq!(tokens, sibling_tokens, "the same ids as the sibling's");
        assert_eq!(
            how,
            ChatTokenization::Segmented {
                cached_segments: chat.len() + 1,
                fresh_segments: 0
            },
            "every step came from the sibling"
        );
        // The next turn renders only what it adds, as on the replica that saw the first.
        let mut next = chat.clone();
        next.push(json!({"role": "assistant", "content": "It weighs the queue against the hit."}));
        next.push(json!({"role": "user", "content": "Thanks."}));
        let (_, how) = here.encode_chat(&next).expect("tokenizes");
        assert_eq!(
            how,
            ChatTokenization::Segmented {
                cached_segments: chat.len(),
                fresh_segments: 3
            }
        );
    }

    #[test]
    fn a_prefix_from_another_tokenizer_or_naming_ids_outside_the_vocabulary_is_refused() {
        let here = shipped();
        let good = SharedPrefix {
            tokenizer: here.fingerprint(),
            key: 1,
            rendered_len: 3,
            rendered_hash: 7,
            tokens: Arc::from(vec![1u32, 2, 3]),
        };
        assert!(here.adopt_shared_prefix(&good));
        let foreign = SharedPrefix {
            tokenizer: here.fingerprint() ^ 1,
            key: 2,
            ..good.clone()
        };
        assert!(!here.adopt_shared_prefix(&foreign), "another tokenizer's");
        let unknown_id = SharedPrefix {
            key: 3,
            tokens: Arc::from(vec![u32::MAX]),
            ..good.clone()
        };
        assert!(
            !here.adopt_shared_prefix(&unknown_id),
            "an id past the vocabulary"
        );
        let last_id = u32::try_from(here.token_ids_end - 1).expect("a u32 vocabulary");
        let at_the_end = SharedPrefix {
            key: 5,
            tokens: Arc::from(vec![last_id + 1]),
            ..good.clone()
        };
        assert!(
            !here.adopt_shared_prefix(&at_the_end),
            "the first id past the highest one"
        );
        let highest = SharedPrefix {
            key: 6,
            tokens: Arc::from(vec![last_id]),
            ..good.clone()
        };
        assert!(here.adopt_shared_prefix(&highest), "the highest id itself");
        assert!(
            here.tokenizer.id_to_token(last_id).is_some(),
            "the bound is the vocabulary's own highest id"
        );
        let too_long = SharedPrefix {
            key: 4,
            tokens: vec![1u32; SHARED_PREFIX_TOKENS_MAX + 1].into(),
            ..good.clone()
        };
        assert!(
            !here.adopt_shared_prefix(&too_long),
            "past the shared maximum"
        );
        let again = SharedPrefix {
            tokens: Arc::from(vec![9u32]),
            ..good.clone()
        };
        assert!(
            here.adopt_shared_prefix(&again),
            "valid, but the key is known"
        );
        assert_eq!(
            here.adopted_prefixes(),
            2,
            "the two valid ones; a known prefix is not replaced"
        );
    }

    #[test]
    fn an_adopted_prefix_that_the_rendering_does_not_start_with_falls_back_to_the_whole_chat() {
        let here = shipped();
        let chat = conversation();
        let first_step = prefix_key(
            PREFIX_KEY_ROOT,
            &serde_json::to_vec(&chat[0]).expect("json"),
        );
        let wrong = SharedPrefix {
            tokenizer: here.fingerprint(),
            key: first_step,
            rendered_len: 5,
            rendered_hash: 12_345,
            tokens: Arc::from(vec![1u32, 2]),
        };
        assert!(here.adopt_shared_prefix(&wrong));
        let (tokens, how) = here.encode_chat(&chat).expect("tokenizes");
        assert_eq!(
            how,
            ChatTokenization::Whole,
            "the length-and-hash check refused it"
        );
        assert_eq!(tokens, here.encode_chat_whole(&chat).expect("whole"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn sampled_chats_are_checked_on_the_blocking_pool_at_most_once_per_interval() {
        let tok = shipped();
        let messages = vec![
            json!({"role": "system", "content": "Be brief. ".repeat(10)}),
            json!({"role": "user", "content": "hello there"}),
        ];
        // The first checks, one at a time on the blocking pool, until VERIFY_FIRST_CHATS are
        // done; chats sent while one runs are not checked.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while tok.first_checks_done() < VERIFY_FIRST_CHATS {
            assert!(
                std::time::Instant::now() < deadline,
                "waited 10 s for the first checks; done = {}",
                tok.first_checks_done()
            );
            tok.encode_chat(&messages).unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert_eq!(tok.verifications_done(), 0, "no periodic check among them");
        // Chat number VERIFY_EVERY_NTH_CHAT is the first sampled one after them.
        tok.chats_seen.store(1, Ordering::Relaxed);
        for _ in 0..VERIFY_EVERY_NTH_CHAT {
            tok.encode_chat(&messages).unwrap();
        }
        while tok.verifications_done() < 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "waited 10 s for the background check; done = {}",
                tok.verifications_done()
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(tok.verifications_done(), 1, "exactly one sampled chat");
        assert!(tok.segmented_enabled(), "ChatML passes the check");
        // The next sampled chat comes well within VERIFY_INTERVAL_MIN_MS: it is not checked.
        // Whether a check starts is decided inside `encode_chat`, so right after the calls
        // return a started one would show as in flight or done.
        for _ in 0..VERIFY_EVERY_NTH_CHAT {
            tok.encode_chat(&messages).unwrap();
        }
        assert!(
            !tok.verifying.load(Ordering::Acquire) && tok.verifications_done() == 1,
            "a second check started within the interval (done = {})",
            tok.verifications_done()
        );
    }

    const WORDS: &[&str] = &[
        "the",
        "router",
        " cache",
        "prefix",
        "token",
        "\n",
        "  ",
        "GPU",
        "émigré",
        "日本語",
        "<|im_end|>",
        "123",
        "!",
        "?",
        "don't",
        " hello",
        "world\n\n",
        "{json}",
        "tab\t",
    ];

    fn random_text(rng: &mut StdRng) -> String {
        let n = rng.random_range(0..30);
        (0..n)
            .map(|_| WORDS[rng.random_range(0..WORDS.len())])
            .collect::<Vec<_>>()
            .join(if rng.random_bool(0.5) { " " } else { "" })
    }

    /// A document of `words` random words from [`WORDS`] (single spaces, and now and then a
    /// word glued to the next, so cuts fall in every kind of place).
    fn document(rng: &mut StdRng, words: usize) -> String {
        let mut doc = String::new();
        for _ in 0..words {
            doc.push_str(WORDS[rng.random_range(0..WORDS.len())]);
            if rng.random_bool(0.9) {
                doc.push(' ');
            }
        }
        doc
    }

    #[test]
    fn a_new_long_document_is_tokenized_in_its_head_and_the_head_starts_the_whole_chat() {
        let tok = shipped();
        let mut rng = StdRng::seed_from_u64(5);
        for case in 0..6 {
            let doc = document(&mut rng, 12_000);
            assert!(doc.len() >= ROUTING_HEAD_SEGMENT_BYTES_MIN, "{}", doc.len());
            let mut messages = vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": doc}),
            ];
            if case % 2 == 1 {
                // Later messages are estimated, not tokenized.
                messages.push(json!({"role": "assistant", "content": "noted"}));
                messages.push(json!({"role": "user", "content": random_text(&mut rng)}));
            }
            let (head, how) = tok.encode_chat_head(&messages).unwrap();
            let ChatTokenization::Head {
                prompt_tokens_estimate,
                ..
            } = how
            else {
                panic!("case {case}: a long new document gave {how:?}");
            };
            let whole = tok.encode_chat_whole(&messages).unwrap();
            assert!(
                whole.starts_with(&head),
                "case {case}: the head ({} tokens) is not the start of the whole chat",
                head.len()
            );
            assert!(
                head.len() * 4 < whole.len(),
                "case {case}: a head of {} tokens out of {} spares little",
                head.len(),
                whole.len()
            );
            let error = prompt_tokens_estimate.abs_diff(whole.len()) as f64 / whole.len() as f64;
            assert!(
                error < 0.2,
                "case {case}: estimated {prompt_tokens_estimate} tokens, the chat has {}",
                whole.len()
            );
        }
    }

    #[test]
    fn a_completed_head_leaves_its_document_cached_and_short_chats_are_never_cut() {
        let tok = shipped();
        let mut rng = StdRng::seed_from_u64(6);
        let short = vec![json!({"role": "user", "content": random_text(&mut rng)})];
        let (_, how) = tok.encode_chat_head(&short).unwrap();
        assert!(matches!(how, ChatTokenization::Segmented { .. }), "{how:?}");
        // Long enough for a head, short enough to be cached (`CACHED_SEGMENT_MAX_TOKENS`).
        let messages = vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": document(&mut rng, 8_000)}),
        ];
        let (head, how) = tok.encode_chat_head(&messages).unwrap();
        assert!(matches!(how, ChatTokenization::Head { .. }), "{how:?}");
        // Outside a runtime the completion runs inline.
        let whole_len = Arc::new(AtomicU64::new(0));
        let seen = whole_len.clone();
        tok.complete_aside(messages.clone(), head, (), move |whole| {
            seen.store(whole.len() as u64, Ordering::Relaxed)
        });
        assert_eq!(tok.completions_done(), 1);
        assert_eq!(
            whole_len.load(Ordering::Relaxed) as usize,
            tok.encode_chat_whole(&messages).unwrap().len(),
            "the completion hands the whole chat's tokens on"
        );
        assert!(tok.heads_enabled());
        // The next turn: the document comes from the cache, nothing is cut.
        let mut next = messages.clone();
        next.push(json!({"role": "assistant", "content": "noted"}));
        next.push(json!({"role": "user", "content": "and then?"}));
        let (tokens, how) = tok.encode_chat_head(&next).unwrap();
        assert!(
            matches!(how, ChatTokenization::Segmented { cached_segments, .. } if cached_segments >= 2),
            "{how:?}"
        );
        assert_eq!(tokens, tok.encode_chat_whole(&next).unwrap());
    }

    #[test]
    fn a_head_that_does_not_start_its_whole_chat_turns_heads_off_for_the_model() {
        let tok = shipped();
        let mut rng = StdRng::seed_from_u64(8);
        let messages = vec![json!({"role": "user", "content": document(&mut rng, 12_000)})];
        let (mut head, _) = tok.encode_chat_head(&messages).unwrap();
        // As if the tokenizer had merged a token across the cut.
        let last = head.len() - 1;
        head[last] = head[last].wrapping_add(1);
        tok.complete_aside(messages.clone(), head, (), |_| {
            panic!("a head that is not the chat's beginning is not handed on")
        });
        assert!(!tok.heads_enabled());
        let other = vec![json!({"role": "user", "content": document(&mut rng, 12_000)})];
        let (tokens, how) = tok.encode_chat_head(&other).unwrap();
        assert!(!matches!(how, ChatTokenization::Head { .. }), "{how:?}");
        assert_eq!(tokens, tok.encode_chat_whole(&other).unwrap());
    }

    #[test]
    fn a_head_is_cut_before_a_single_space_between_two_words_or_not_at_all() {
        assert_eq!(head_cut("alpha beta gamma", 12), Some(10));
        // Not inside a run of spaces, nor before a newline.
        assert_eq!(head_cut("alpha  beta\ngamma", 16), None);
        assert_eq!(head_cut("alpha beta  gamma", 16), Some(5));
        // No space at all: no head.
        assert_eq!(head_cut(&"x".repeat(100), 50), None);
        // Multi-byte text around the space: the cut is a char boundary.
        let text = "日本語 émigré 日本語";
        let cut = head_cut(text, text.len()).unwrap();
        assert!(text.is_char_boundary(cut) && text[cut..].starts_with(' '));
    }

    #[test]
    fn segmented_chat_tokens_equal_tokenizing_the_whole_rendering() {
        let tok = shipped();
        let mut rng = StdRng::seed_from_u64(42);
        for case in 0..300 {
            let n = rng.random_range(1..8);
            let messages: Vec<Value> = (0..n)
                .map(|i| {
                    let role = if i == 0 && rng.random_bool(0.5) {
                        "system"
                    } else if i % 2 == 1 {
                        "user"
                    } else {
                        "assistant"
                    };
                    json!({"role": role, "content": random_text(&mut rng)})
                })
                .collect();
            let whole = tok.encode_chat_whole(&messages).unwrap();
            let (segmented, _) = tok
                .encode_chat_segmented(&messages, false)
                .unwrap()
                .expect("ChatML is prefix-stable");
            assert_eq!(segmented, whole, "case {case}: {messages:?}");
        }
        assert!(tok.segmented_enabled());
    }

    #[test]
    fn a_later_turn_reuses_the_cached_segments_of_earlier_turns() {
        let tok = shipped();
        let system =
            json!({"role": "system", "content": "You are a meticulous assistant. ".repeat(20)});
        let turn1 = vec![
            system.clone(),
            json!({"role": "user", "content": "first question"}),
        ];
        let (_, how1) = tok.encode_chat(&turn1).unwrap();
        assert_eq!(
            how1,
            ChatTokenization::Segmented {
                cached_segments: 0,
                fresh_segments: 3
            }
        );
        let turn2 = vec![
            system,
            json!({"role": "user", "content": "first question"}),
            json!({"role": "assistant", "content": "an answer"}),
            json!({"role": "user", "content": "second question"}),
        ];
        let (tokens, how2) = tok.encode_chat(&turn2).unwrap();
        // system, user 1 and the generation prompt are reused; assistant and user 2 are new.
        assert_eq!(
            how2,
            ChatTokenization::Segmented {
                cached_segments: 3,
                fresh_segments: 2
            }
        );
        assert_eq!(tokens, tok.encode_chat_whole(&turn2).unwrap());
    }

    #[test]
    fn a_later_turn_renders_only_the_messages_added_since_the_previous_turn() {
        let tok = shipped();
        let mut conversation = vec![json!({"role": "system", "content": "Be brief. ".repeat(50)})];
        for turn in 0..6 {
            conversation.push(json!({"role": "user", "content": format!("question {turn}")}));
            let before = tok.renders_total();
            // Skip the whole-text verification renders of the first chats (inline outside a
            // runtime): count them apart.
            let verified = tok.first_checks_done() < VERIFY_FIRST_CHATS;
            let (tokens, _) = tok.encode_chat(&conversation).unwrap();
            let renders = tok.renders_total() - before - u64::from(verified);
            // Turn 0 renders system, user and the generation prompt; later turns the previous
            // answer, the new question and the generation prompt: never the whole history again.
            assert_eq!(renders, 3, "turn {turn}: {renders} renders");
            assert_eq!(tokens, tok.encode_chat_whole(&conversation).unwrap());
            conversation.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
        }
        let before = tok.renders_total();
        conversation.pop();
        tok.first_checks_done
            .store(VERIFY_FIRST_CHATS, Ordering::Relaxed);
        tok.encode_chat(&conversation).unwrap();
        assert_eq!(
            tok.renders_total(),
            before,
            "a repeated request is served from the prefix cache without rendering"
        );
    }

    /// A template that renders the message count first: no rendering of a conversation is a
    /// prefix of the rendering of a longer one.
    fn count_first_template() -> minijinja::Environment<'static> {
        let mut env = minijinja::Environment::new();
        env.add_template_owned(
            "chat",
            "{{ messages|length }}{% for m in messages %}[{{ m.content }}]{% endfor %}".to_string(),
        )
        .unwrap();
        env
    }

    #[test]
    fn a_cached_prefix_the_longer_rendering_does_not_start_with_falls_back_to_whole() {
        let mut tok = shipped();
        // Renders the message count first: a one-message rendering ("1[a]") is cached by the
        // first request, and the two-message rendering ("2[a][b]") does not start with it.
        Arc::get_mut(&mut tok).expect("sole owner").template = Some(count_first_template());
        let one = vec![json!({"role": "user", "content": "a"})];
        let (_, how) = tok.encode_chat(&one).unwrap();
        assert!(matches!(how, ChatTokenization::Segmented { .. }));
        let two = vec![one[0].clone(), json!({"role": "user", "content": "b"})];
        let (tokens, how) = tok.encode_chat(&two).unwrap();
        assert_eq!(how, ChatTokenization::Whole);
        assert_eq!(tokens, tok.encode_chat_whole(&two).unwrap());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_template_whose_segments_tokenize_apart_is_caught_by_the_first_check_off_the_path() {
        let mut tok = shipped();
        // Prefix-stable, but nothing separates the messages: "in" + "teresting" tokenized
        // apart is not "interesting" tokenized whole.
        let mut env = minijinja::Environment::new();
        env.add_template_owned(
            "chat",
            "{% for m in messages %}{{ m.content }}{% endfor %}".to_string(),
        )
        .unwrap();
        Arc::get_mut(&mut tok).expect("sole owner").template = Some(env);
        let msgs = vec![
            json!({"role": "user", "content": "in"}),
            json!({"role": "user", "content": "teresting questions"}),
        ];
        let whole = tok.encode_chat_whole(&msgs).unwrap();
        let (first, how) = tok.encode_chat(&msgs).unwrap();
        assert!(
            matches!(how, ChatTokenization::Segmented { .. }),
            "the first chat routes on its segments while it is checked aside: {how:?}"
        );
        assert_ne!(first, whole, "the template really splits a word");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while tok.first_checks_done() < 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "waited 10 s for the first check"
            );
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        assert!(!tok.segmented_enabled(), "the check found the mismatch");
        let (tokens, how) = tok.encode_chat(&msgs).unwrap();
        assert_eq!(how, ChatTokenization::Whole);
        assert_eq!(tokens, whole);
    }

    #[test]
    fn a_template_that_is_not_prefix_stable_falls_back_to_whole_tokenization() {
        let mut tok = shipped();
        // Renders the message count first, so a prefix rendering is never a prefix of the next.
        Arc::get_mut(&mut tok).expect("sole owner").template = Some(count_first_template());
        let msgs = vec![
            json!({"role": "user", "content": "a"}),
            json!({"role": "user", "content": "b"}),
        ];
        let (tokens, how) = tok.encode_chat(&msgs).unwrap();
        assert_eq!(how, ChatTokenization::Whole);
        assert_eq!(tokens, tok.encode_chat_whole(&msgs).unwrap());
    }
}

#[cfg(test)]
mod budget_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_conversation_over_the_render_budget_is_tokenized_whole() {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer/tokenizer.json");
        let tok = Arc::new(ModelTokenizer::load(&path, 1024).unwrap());
        // Each message counts as its content + 16 bytes; 1,500 empty messages are 1,500 x 24,000
        // = 36 MB of prefix rendering, over the budget, while the whole text is only ~30 KB.
        let msgs: Vec<Value> = (0..1_500)
            .map(|_| json!({"role": "user", "content": ""}))
            .collect();
        const { assert!(1_500 * 1_500 * 16 > SEGMENTED_RENDER_BUDGET_BYTES) };
        let (_, how) = tok.encode_chat(&msgs[..2]).unwrap();
        assert!(matches!(how, ChatTokenization::Segmented { .. }));
        let (tokens, how) = tok.encode_chat(&msgs).unwrap();
        assert_eq!(how, ChatTokenization::Whole);
        assert_eq!(tokens, tok.encode_chat_whole(&msgs).unwrap());
    }
}
