//! Criterion benchmark of what the prediction check adds to one proxied `cache_aware` answer:
//! scanning the body for the engine's `cached_tokens` as it passes (a non-streamed answer, and
//! a streamed one of 12 chunks), and recording the comparison (two labelled metric updates and
//! the model's window). These are the whole per-request cost of the check on the data path;
//! `bench/side_by_side.sh` measures the path end to end.
//!
//! Run: `cargo bench -p kvroute --bench prediction_check`.

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute::routing::prediction::{
    CachedTokensScanner, PredictionCheckConfig, PredictionChecks, PredictionResult,
};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};

fn bench(c: &mut Criterion) {
    let body = br#"{"id":"cmpl-7f3a","object":"text_completion","created":1764633600,"model":"demo-model","choices":[{"index":0,"text":" cache router token engine prefix block latency","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":2518,"completion_tokens":24,"total_tokens":2542,"prompt_tokens_details":{"cached_tokens":2496}}}"#;
    let chunk = br#"data: {"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764633600,"model":"demo-model","choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,"finish_reason":null}]}

"#;
    let usage = br#"data: {"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764633600,"model":"demo-model","choices":[],"usage":{"prompt_tokens":2518,"completion_tokens":10,"total_tokens":2528,"prompt_tokens_details":{"cached_tokens":2496}}}

data: [DONE]

"#;
    c.bench_function("scan_non_streamed_answer", |b| {
        b.iter(|| {
            let mut s = CachedTokensScanner::default();
            s.feed(std::hint::black_box(body));
            s.last()
        })
    });
    c.bench_function("scan_streamed_answer_12_chunks", |b| {
        b.iter(|| {
            let mut s = CachedTokensScanner::default();
            for _ in 0..11 {
                s.feed(std::hint::black_box(chunk));
            }
            s.feed(std::hint::black_box(usage));
            s.last()
        })
    });
    let predictions = IntCounterVec::new(
        Opts::new("kvroute_predictions_total", "bench"),
        &["model", "worker", "result"],
    )
    .unwrap();
    let errors = HistogramVec::new(
        HistogramOpts::new("kvroute_prediction_error_tokens", "bench").buckets(vec![
            -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 15.0, 63.0, 255.0, 1023.0, 4095.0,
        ]),
        &["model"],
    )
    .unwrap();
    let checks = PredictionChecks::new(PredictionCheckConfig::default());
    c.bench_function("record_one_comparison", |b| {
        b.iter(|| {
            let (predicted, reported) = (std::hint::black_box(2_496u64), 2_496u64);
            let result = PredictionResult::classify(predicted, reported, 16);
            predictions
                .with_label_values(&["demo-model", "http://10.0.0.7:30000", result.label()])
                .inc();
            errors
                .with_label_values(&["demo-model"])
                .observe(predicted as f64 - reported as f64);
            checks.record("demo-model", 16, predicted, reported)
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
