//! Criterion benchmark of the per-request routing work, no HTTP: chat tokenization with the
//! segment cache, and `Router::plan` (hash once, match the model's index, score 8 ranks).
//!
//! Run: `cargo bench -p kvroute --bench routing_path`.
//!
//! The index is populated for real: an in-process simulated fleet (4 engines x 2 DP ranks)
//! publishes KV events for stored prefixes, and the router's KV plane consumes them before the
//! measurement starts.

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use serde_json::json;

#[path = "support/sim_router.rs"]
mod support;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (fleet, router) = support::fleet_and_router(
        &rt,
        4,
        2,
        Some(kvroute_sim::config::default_tokenizer_path()),
    );
    let r = router.router.clone();
    let group = r.registry.model("bench").unwrap();
    let tok = group.tokenizer.clone().unwrap();
    // A 4-turn chat over a ~1,000-token system prompt.
    let system = "You are a careful assistant for routing questions. ".repeat(100);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..4 {
        messages.push(json!({"role": "user", "content": format!("question {t}: how are prefixes matched across ranks?")}));
        messages.push(json!({"role": "assistant", "content": format!("answer {t}: by chained block hashes.")}));
    }
    messages.push(json!({"role": "user", "content": "and the last one?"}));
    let (tokens, _) = tok.encode_chat(&messages).unwrap();
    // Every rank caches a different-length prefix of this prompt, so the match walks deep.
    let block = fleet.engines[0].block_size();
    for (i, e) in fleet.engines.iter().enumerate() {
        for rank in 0..2 {
            let blocks = (tokens.len() / block) * (i * 2 + rank + 1) / 8;
            e.store_chains(rank, &[tokens[..blocks * block].to_vec()]);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let plan = r.plan(group.clone(), &tokens).unwrap();
        if plan
            .candidates
            .iter()
            .filter(|c| c.input.matched_blocks > 0)
            .count()
            == 8
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "index never saw all 8 ranks' prefixes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "prompt: {} tokens, {} blocks",
        tokens.len(),
        tokens.len() / block
    );
    c.bench_function("encode_chat_cached_9_messages", |b| {
        b.iter(|| tok.encode_chat(&messages).unwrap())
    });
    // A conversation's NEXT turn: the 9 messages above are known, the previous answer and the
    // new question are not (a different pair every iteration, as in a live multi-turn chat).
    let mut turn = 0u64;
    c.bench_function("encode_chat_next_turn_9_known_plus_2_new_messages", |b| {
        b.iter(|| {
            turn += 1;
            let mut next = messages.clone();
            next.push(serde_json::json!({"role": "assistant", "content": format!("answer number {turn} with some words")}));
            next.push(serde_json::json!({"role": "user", "content": format!("follow-up question {turn}?")}));
            tok.encode_chat(&next).unwrap()
        })
    });
    c.bench_function("encode_chat_whole_uncached_9_messages", |b| {
        b.iter(|| tok.encode_chat_whole(&messages).unwrap())
    });
    // The first turn of a long conversation (the demo's long-conversations workload at twice
    // its default words, `--system-block-words 500 --context-words 11000`): a known ~500-word
    // system block, then a new ~11,000-word document every iteration, which no cache can have
    // seen (the whole of it is tokenized on the request's path).
    let long_system = format!(
        "You are a careful assistant. {}",
        (0..500)
            .map(|i| format!("word{}", i % 97))
            .collect::<Vec<_>>()
            .join(" ")
    );
    // Words drawn at random from a small vocabulary, as the demo's generator draws them.
    const VOCABULARY: [&str; 16] = [
        "prefix", "cache", "rank", "block", "engine", "router", "token", "decode", "replica",
        "snapshot", "sibling", "pending", "graft", "cursor", "eviction", "latency",
    ];
    let mut draw = 0x9e37_79b9_7f4a_7c15_u64;
    let document: Vec<&str> = (0..11_000)
        .map(|_| {
            draw = draw
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            VOCABULARY[(draw >> 60) as usize]
        })
        .collect();
    let document = document.join(" ");
    // A new first turn on every call (its number leads the document), so no cache has it.
    let mut doc_turn = 0u64;
    let mut first_turn = move || {
        doc_turn += 1;
        [
            json!({"role": "system", "content": long_system}),
            json!({"role": "user", "content": format!(
                "Document {doc_turn}. {document} Question: what does it say?"
            )}),
        ]
    };
    c.bench_function("encode_chat_first_turn_11000_word_document", |b| {
        b.iter(|| tok.encode_chat(&first_turn()).unwrap())
    });
    // The same first turn as the request's path tokenizes it: its head only (the rest is
    // tokenized aside, off the path, and not timed here).
    c.bench_function("encode_chat_head_first_turn_11000_word_document", |b| {
        b.iter(|| tok.encode_chat_head(&first_turn()).unwrap())
    });
    c.bench_function("plan_cache_aware_8_ranks", |b| {
        b.iter(|| r.plan(group.clone(), &tokens).unwrap())
    });
    // The token-id body of the side-by-side benchmark (2,048 ids), read by the fast path's
    // reader and, for comparison in the same run, by a derived serde parse (the previous reader).
    let ids_body = serde_json::to_vec(&serde_json::json!({
        "model": "bench",
        "prompt": (0..2048u32).map(|i| (i * 7919) % 30000 + 100).collect::<Vec<_>>(),
        "max_tokens": 1,
    }))
    .unwrap();
    #[derive(serde::Deserialize)]
    struct SerdeIds<'a> {
        #[serde(borrow)]
        _model: Option<std::borrow::Cow<'a, str>>,
        prompt: Option<Vec<u32>>,
    }
    c.bench_function("read_token_ids_body_2048_ids_fast_reader", |b| {
        b.iter(|| kvroute::data_plane::token_ids::read_token_ids_body(&ids_body, "prompt").unwrap())
    });
    // The same reader on ids of irregular length, as a real tokenizer's are (a 150k vocabulary:
    // 1 to 6 digits in no pattern). The body above is an arithmetic progression whose digit
    // counts repeat, which a branch predictor learns and which flatters a byte loop.
    let mut lcg = 0x2545_f491_4f6c_dd1d_u64;
    let irregular_ids: Vec<u32> = (0..2048)
        .map(|_| {
            lcg = lcg
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let digits = 1 + (lcg >> 61) as u32 % 6;
            ((lcg >> 20) % 10u64.pow(digits)) as u32
        })
        .collect();
    let irregular_body = serde_json::to_vec(&serde_json::json!({
        "model": "bench", "prompt": irregular_ids, "max_tokens": 1,
    }))
    .unwrap();
    c.bench_function("read_token_ids_body_2048_irregular_ids_fast_reader", |b| {
        b.iter(|| {
            kvroute::data_plane::token_ids::read_token_ids_body(&irregular_body, "prompt").unwrap()
        })
    });
    c.bench_function("read_token_ids_body_2048_ids_serde_derive", |b| {
        b.iter(|| {
            serde_json::from_slice::<SerdeIds<'_>>(&ids_body)
                .unwrap()
                .prompt
                .unwrap()
        })
    });
    rt.block_on(async {
        router.shutdown().await;
        fleet.shutdown().await;
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
