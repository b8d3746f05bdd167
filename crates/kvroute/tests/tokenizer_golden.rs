//! The router tokenizes with `tokenizers` built on the pure-Rust `fancy-regex` backend (no C
//! build of Oniguruma). A tokenizer that disagrees with the engine's silently zeroes the cache hit
//! rate, so this proves the backend gives exactly the ids of Hugging Face's reference
//! implementation (Oniguruma regexes) for the shipped tokenizer, on a fixed corpus of 870 cases:
//! every script, emoji with joiners, combining marks, unusual whitespace, contractions, digits and
//! long runs. The fixture is written by `scripts/gen_tokenizer_golden.py` from the PyPI wheel.

use std::path::PathBuf;

use serde_json::Value;

fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// One golden case: the text, whether special tokens are added, and the reference ids.
struct Case {
    text: String,
    add_special: bool,
    ids: Vec<u32>,
}

fn golden_cases() -> Vec<Case> {
    let raw = std::fs::read_to_string(repo_file(
        "crates/kvroute/tests/fixtures/tokenizer_golden.json",
    ))
    .expect("golden fixture");
    let doc: Value = serde_json::from_str(&raw).expect("golden fixture is JSON");
    let cases: Vec<Case> = doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|case| Case {
            text: case["text"].as_str().expect("text").to_string(),
            add_special: case["add_special_tokens"].as_bool().expect("flag"),
            ids: case["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|v| u32::try_from(v.as_u64().expect("id")).expect("id fits u32"))
                .collect(),
        })
        .collect();
    assert!(cases.len() >= 800, "corpus too small: {}", cases.len());
    cases
}

#[test]
fn the_shipped_tokenizer_gives_the_reference_ids_on_the_golden_corpus() {
    let tokenizer = tokenizers::Tokenizer::from_file(repo_file("assets/tokenizer/tokenizer.json"))
        .expect("shipped tokenizer loads");
    let cases = golden_cases();
    let mut mismatches = Vec::new();
    for case in &cases {
        let got = tokenizer
            .encode(case.text.as_str(), case.add_special)
            .expect("encodes")
            .get_ids()
            .to_vec();
        if got != case.ids {
            mismatches.push(format!(
                "{:?} (special {}): got {got:?}, want {:?}",
                case.text, case.add_special, case.ids
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} cases differ from the reference:\n{}",
        mismatches.len(),
        cases.len(),
        mismatches[..mismatches.len().min(5)].join("\n")
    );
}

#[test]
fn the_router_prompt_path_matches_the_reference_too() {
    // The same check through the router's own loader and prompt encoder (special tokens added),
    // so a change in how kvroute builds its tokenizer cannot bypass the golden corpus.
    let model =
        kvroute::routing::tokenize::ModelTokenizer::load(&repo_file("assets/tokenizer"), 1024)
            .expect("router loads the shipped tokenizer");
    let mut checked = 0;
    for case in golden_cases().iter().filter(|c| c.add_special) {
        assert_eq!(
            model.encode_prompt(&case.text).expect("encodes"),
            case.ids,
            "{:?}",
            case.text
        );
        checked += 1;
    }
    assert!(checked >= 400, "only {checked} cases checked");
}
