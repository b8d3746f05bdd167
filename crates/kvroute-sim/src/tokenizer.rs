//! Tokenization, chat-template rendering and the simulator's deterministic "model output".
//!
//! The simulator tokenizes with the same HF `tokenizer.json` the router loads, so both sides see
//! identical token ids and the router's content hashes line up with the blocks the engine caches.
//! The chat template comes from `tokenizer_config.json` next to it (HF layout), rendered with
//! minijinja, as engines render Jinja chat templates.
//!
//! Output is not sampled: completion token `i` of a prompt is chosen by hashing the prompt with
//! `i`, from the vocabulary's plain lower-case word tokens. Same prompt, same answer, on any
//! engine, which makes tests and latency comparisons reproducible and the text readable.

use std::path::Path;

use minijinja::Environment;
use serde::Serialize;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::SimError;
use crate::chat_memo::ChatMemo;

/// Used when the tokenizer directory has no `tokenizer_config.json` chat template.
const FALLBACK_CHAT_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Largest tokenizer_config.json read, so a wrong path cannot make startup read a huge file.
const TOKENIZER_CONFIG_MAX_BYTES: u64 = 4 * 1024 * 1024;

/// One chat message after normalisation (content parts joined to a string).
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct TextModel {
    tokenizer: tokenizers::Tokenizer,
    chat: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// (token id, decoded text) of plain word tokens the fake model "generates".
    words: Vec<(u32, String)>,
    vocab_size: usize,
    /// Messages already tokenized, so a chat costs only its new ones (see `chat_memo`).
    chat_memo: ChatMemo,
}

impl std::fmt::Debug for TextModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextModel")
            .field("vocab_size", &self.vocab_size)
            .field("words", &self.words.len())
            .finish()
    }
}

impl TextModel {
    pub fn load(tokenizer_path: &Path) -> Result<Self, SimError> {
        let tokenizer = tokenizers::Tokenizer::from_file(tokenizer_path)
            .map_err(|e| SimError::Tokenizer(format!("{}: {e}", tokenizer_path.display())))?;
        let config = tokenizer_path
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .filter(|p| p.is_file())
            .map(|p| read_config(&p))
            .transpose()?
            .unwrap_or(serde_json::Value::Null);
        let template = config
            .get("chat_template")
            .and_then(|t| t.as_str())
            .unwrap_or(FALLBACK_CHAT_TEMPLATE)
            .to_string();
        let token_str = |key: &str, default: &str| match config.get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            // HF also writes special tokens as {"content": "..."} objects.
            Some(v) => v
                .get("content")
                .and_then(|c| c.as_str())
                .unwrap_or(default)
                .to_string(),
            None => default.to_string(),
        };
        let mut chat = Environment::new();
        chat.add_template_owned("chat", template)
            .map_err(|e| SimError::Tokenizer(format!("chat template: {e}")))?;

        let vocab_size = tokenizer.get_vocab_size(true);
        let mut words: Vec<(u32, String)> = tokenizer
            .get_vocab(false)
            .into_iter()
            .filter_map(|(tok, id)| {
                // Byte-level BPE marks a leading space with 'Ġ'; keep " word" tokens only.
                let word = tok.strip_prefix('\u{120}')?;
                (word.len() >= 2 && word.bytes().all(|b| b.is_ascii_lowercase()))
                    .then(|| (id, format!(" {word}")))
            })
            .collect();
        words.sort_unstable();
        if words.is_empty() {
            // A tokenizer without such tokens still needs something to emit.
            words = (0..vocab_size.min(256) as u32)
                .filter_map(|id| tokenizer.decode(&[id], true).ok().map(|s| (id, s)))
                .filter(|(_, s)| !s.is_empty())
                .collect();
        }
        if words.is_empty() {
            return Err(SimError::Tokenizer(
                "no decodable tokens in vocabulary".into(),
            ));
        }
        let chat_memo = ChatMemo::for_tokenizer(&tokenizer);
        Ok(TextModel {
            bos_token: token_str("bos_token", "<|endoftext|>"),
            eos_token: token_str("eos_token", "<|im_end|>"),
            tokenizer,
            chat,
            words,
            vocab_size,
            chat_memo,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Token ids of `text` (special tokens written in the text are recognised, as engines do
    /// for rendered chat templates).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// Token ids of a rendered chat: exactly `encode(rendered)`, but the messages this model
    /// already tokenized are remembered rather than tokenized again (`chat_memo`).
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, String> {
        self.chat_memo
            .encode_chat(rendered, |text| self.encode(text))
    }

    /// The chat template applied to `messages`, with the assistant header appended.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.render_chat_with(messages, true)
    }

    /// The chat template applied to `messages`; `add_generation_prompt` as in HF / vLLM
    /// (`/tokenize` lets the caller turn the assistant header off).
    pub fn render_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let template = self.chat.get_template("chat").map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| e.to_string())
    }

    /// The deterministic completion of `prompt`: `n` (token id, text piece) pairs.
    pub fn complete(&self, prompt: &[u32], n: usize) -> Vec<(u32, &str)> {
        let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
        let seed = xxh3_64(&bytes);
        (0..n as u64)
            .map(|i| {
                let pick = xxh3_64_with_seed(&i.to_le_bytes(), seed) as usize % self.words.len();
                let (id, text) = &self.words[pick];
                (*id, text.as_str())
            })
            .collect()
    }
}

fn read_config(path: &Path) -> Result<serde_json::Value, SimError> {
    let err = |e: String| SimError::Tokenizer(format!("{}: {e}", path.display()));
    let len = std::fs::metadata(path)
        .map_err(|e| err(e.to_string()))?
        .len();
    if len > TOKENIZER_CONFIG_MAX_BYTES {
        return Err(err(format!(
            "larger than {TOKENIZER_CONFIG_MAX_BYTES} bytes"
        )));
    }
    let body = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_slice(&body).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> TextModel {
        TextModel::load(&crate::config::default_tokenizer_path()).expect("shipped tokenizer")
    }

    #[test]
    fn shipped_tokenizer_round_trips_text_and_knows_the_chat_markers() {
        let m = model();
        let ids = m
            .encode("<|im_start|>user\nhello router<|im_end|>")
            .unwrap();
        assert_eq!(ids[0], 1, "<|im_start|> is a single special token");
        assert_eq!(
            m.tokenizer.decode(&ids, false).unwrap(),
            "<|im_start|>user\nhello router<|im_end|>"
        );
    }

    #[test]
    fn chat_template_renders_chatml_with_generation_prompt() {
        let m = model();
        let text = m
            .render_chat(&[
                ChatMessage {
                    role: "system".into(),
                    content: "be brief".into(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                },
            ])
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn completion_is_deterministic_per_prompt_and_differs_between_prompts() {
        let m = model();
        let a = m.complete(&[1, 2, 3], 8);
        assert_eq!(a, m.complete(&[1, 2, 3], 8));
        assert_ne!(a, m.complete(&[1, 2, 4], 8));
        assert!(a.iter().all(|(_, t)| t.starts_with(' ') && t.len() > 1));
    }
}
