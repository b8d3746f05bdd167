//! Load sharing between sibling replicas, end to end: real routers in-process, each with its own
//! internal listener, streaming their bookings to each other over real HTTP, in front of
//! simulated engines (real HTTP, real ZMQ). Requests are held in flight by the simulator's
//! armed head stalls, so a booking stays put while the test looks at it.

mod common;

use std::time::Duration;

use common::*;
use kvroute::RouterConfig;
use kvroute::peer::load_share::{LOAD_BOOKINGS_PATH, LoadShareConfig};
use kvroute_discovery::PeerUrl;
use serde_json::{Value, json};

/// How long the armed stalls hold a request before its answer starts.
const STALL_MS: u64 = 3_000;
/// Requests held in flight on the sibling.
const HELD_REQUESTS: u64 = 4;
/// The staleness bound of these tests (the smallest the flag accepts).
const STALE_MS: u64 = kvroute::peer::load_share::LOAD_SHARE_STALE_MS_MIN;
const TOKEN: &[u8] = b"load-share-test-token-0123456789abcdef";

fn config(urls: &[String], token: Option<&[u8]>) -> RouterConfig {
    RouterConfig {
        internal_auth_token: token.map(Into::into),
        load_share: LoadShareConfig {
            stale_ms: STALE_MS,
            ..LoadShareConfig::default()
        },
        ..router_config(urls)
    }
}

/// Waits until `base`'s first followed sibling is fresh on its `/workers`.
async fn wait_first_sibling_heard(what: &str, base: &str) {
    wait_until(what, WAIT_DEADLINE, || async {
        let w = workers(base).await;
        if w["load_share"]["siblings"][0]["fresh"] == true {
            Ok(())
        } else {
            Err(w["load_share"].to_string())
        }
    })
    .await;
}

fn follow(follower: &kvroute::RouterHandle, sibling: &kvroute::RouterHandle) {
    follower
        .router
        .peers
        .replace([PeerUrl::parse(&sibling.internal_url()).expect("internal URL")]);
}

/// Waits until the ranks' `field` on `base`'s `/workers` adds up to `total`; returns the ranks.
async fn wait_rank_total(
    what: &str,
    base: &str,
    field: &str,
    total: i64,
) -> Vec<(String, u64, i64)> {
    wait_until(what, WAIT_DEADLINE, || async {
        let ranks = rank_field(&workers(base).await, field);
        if ranks.iter().map(|r| r.2).sum::<i64>() == total {
            Ok(ranks)
        } else {
            Err(format!("{field}: {ranks:?}"))
        }
    })
    .await
}

async fn arm_head_stalls(engine: &str, requests: u64) {
    let (status, body, _) = post_json(
        &format!("{engine}/control/stall"),
        &json!({"at": "head", "requests": requests, "stall_ms": STALL_MS}),
    )
    .await;
    assert_eq!(status, 200, "arming stalls: {body}");
}

/// Sends `n` distinct chats through `base` without waiting for them; returns their tasks.
fn send_held(base: &str, n: u64, tag: &str) -> Vec<tokio::task::JoinHandle<u16>> {
    (0..n)
        .map(|i| send_chat(base, format!("held request {tag} {i}: tell me something")))
        .collect()
}

/// Sends one chat through `base` without waiting for it.
fn send_chat(base: &str, content: String) -> tokio::task::JoinHandle<u16> {
    let url = format!("{base}/v1/chat/completions");
    tokio::spawn(async move {
        client()
            .post(url)
            .json(&json!({"model": "m", "max_tokens": 2,
                "messages": [{"role": "user", "content": content}]}))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_siblings_requests_in_flight_appear_in_this_replicas_view_and_leave_when_they_finish() {
    let fleet = fleet(1, 2, "m").await;
    let urls = urls(&fleet);
    let a = kvroute::serve(config(&urls, Some(TOKEN))).await.expect("a");
    let b = kvroute::serve(config(&urls, Some(TOKEN))).await.expect("b");
    follow(&a, &b);
    follow(&b, &a);
    wait_subscribed(&b.url(), 2).await;
    arm_head_stalls(&urls[0], HELD_REQUESTS).await;
    let held = send_held(&b.url(), HELD_REQUESTS, "b");

    let own_b = wait_rank_total(
        "b to hold every stalled request in flight",
        &b.url(),
        "in_flight",
        HELD_REQUESTS as i64,
    )
    .await;
    wait_until(
        "a's sibling bookings to equal b's own, rank by rank",
        WAIT_DEADLINE,
        || async {
            let seen = rank_field(&workers(&a.url()).await, "sibling_in_flight");
            if seen == own_b {
                Ok(())
            } else {
                Err(format!("a sees {seen:?}, b holds {own_b:?}"))
            }
        },
    )
    .await;
    let w = workers(&a.url()).await;
    assert_eq!(
        w["load_share"]["siblings"][0]["fresh"], true,
        "a lists b as fresh: {}",
        w["load_share"]
    );
    assert_eq!(
        rank_field(&w, "in_flight").iter().map(|r| r.2).sum::<i64>(),
        0,
        "a's OWN bookings stay its own"
    );
    let b_sees: i64 = rank_field(&workers(&b.url()).await, "sibling_in_flight")
        .iter()
        .map(|r| r.2)
        .sum();
    assert_eq!(b_sees, 0, "b does not hear its own bookings back from a");

    for h in held {
        assert_eq!(h.await.unwrap(), 200, "a held request completes");
    }
    wait_rank_total(
        "a's sibling bookings to drop to zero once b's requests finished",
        &a.url(),
        "sibling_in_flight",
        0,
    )
    .await;
    let m = metrics_text(&a.url()).await;
    assert!(
        m.lines()
            .any(|l| l.starts_with("kvroute_load_share_frames_total{result=\"applied\"}")),
        "a counts the frames it applied:\n{m}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_sends_new_prompts_away_from_the_engine_its_sibling_loaded() {
    // Two one-rank engines; b routes to engine 0 only, a to both: they share engine 0.
    let fleet = fleet(2, 1, "m").await;
    let urls = urls(&fleet);
    for sharing in [true, false] {
        let a = kvroute::serve(RouterConfig {
            load_share: LoadShareConfig {
                enabled: sharing,
                stale_ms: STALE_MS,
                ..LoadShareConfig::default()
            },
            ..config(&urls, None)
        })
        .await
        .expect("a");
        let b = kvroute::serve(config(&urls[..1], None)).await.expect("b");
        follow(&a, &b);
        wait_subscribed(&a.url(), 2).await;
        wait_subscribed(&b.url(), 1).await;
        arm_head_stalls(&urls[0], HELD_REQUESTS).await;
        let tag = if sharing { "on" } else { "off" };
        let held = send_held(&b.url(), HELD_REQUESTS, tag);
        wait_rank_total(
            "b to hold every stalled request in flight",
            &b.url(),
            "in_flight",
            HELD_REQUESTS as i64,
        )
        .await;
        if sharing {
            wait_rank_total(
                "a to hear b's bookings",
                &a.url(),
                "sibling_in_flight",
                HELD_REQUESTS as i64,
            )
            .await;
        }
        let mut to_loaded = 0;
        for i in 0..8 {
            let (status, body, headers) = post_json(
                &format!("{}/v1/chat/completions", a.url()),
                &json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user",
                    "content": format!("fresh prompt {tag} {i} with no prefix anywhere")}]}),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            let d = decision(&headers);
            if d.contains(&format!("url={};", urls[0])) {
                to_loaded += 1;
            }
        }
        if sharing {
            assert_eq!(to_loaded, 0, "with sharing, a avoids the engine b loaded");
        } else {
            assert!(
                to_loaded > 0,
                "without sharing a sees both engines idle and spreads over them (control)"
            );
        }
        for h in held {
            assert_eq!(h.await.unwrap(), 200);
        }
        a.shutdown().await;
        b.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_with_another_token_is_refused_and_counts_for_nothing() {
    let fleet = fleet(1, 1, "m").await;
    let urls = urls(&fleet);
    let a = kvroute::serve(config(&urls, Some(TOKEN))).await.expect("a");
    let b = kvroute::serve(config(
        &urls,
        Some(b"another-token-another-token-another-tok"),
    ))
    .await
    .expect("b");
    follow(&a, &b);
    // b's listener answers a's stream request with 401; asked directly, it says so too.
    let status = client()
        .get(format!("{}{LOAD_BOOKINGS_PATH}", b.internal_url()))
        .bearer_auth(String::from_utf8_lossy(TOKEN))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 401);
    arm_head_stalls(&urls[0], 1).await;
    let held = send_held(&b.url(), 1, "other-token");
    wait_rank_total("b to hold its request", &b.url(), "in_flight", 1).await;
    // Several staleness bounds pass with b's request in flight; a never counts it.
    let until = std::time::Instant::now() + Duration::from_millis(3 * STALE_MS);
    while std::time::Instant::now() < until {
        let seen = rank_field(&workers(&a.url()).await, "sibling_in_flight");
        assert!(seen.iter().all(|r| r.2 == 0), "a counted b: {seen:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let w = workers(&a.url()).await;
    assert!(
        w["load_share"]["siblings"]
            .as_array()
            .is_none_or(|s| s.iter().all(|s| s["fresh"] == false)),
        "{}",
        w["load_share"]
    );
    assert_eq!(held.into_iter().next().unwrap().await.unwrap(), 200);
    a.shutdown().await;
    b.shutdown().await;
}

/// Requests the wedged sibling books on the engine's rank 0.
const WEDGED_BOOKINGS: i64 = 5;

/// Starts a wedged sibling booking [`WEDGED_BOOKINGS`] on `engine_url`, makes it `a`'s only
/// sibling, and waits until `a` has taken its one frame.
async fn follow_wedged_sibling(a: &kvroute::RouterHandle, engine_url: &str) {
    let wedged = start_wedged_sibling(engine_url.to_string()).await;
    a.router
        .peers
        .replace([PeerUrl::parse(&wedged).expect("url")]);
    wait_rank_total(
        "a to take the wedged sibling's frame",
        &a.url(),
        "sibling_in_flight",
        WEDGED_BOOKINGS,
    )
    .await;
}

/// A sibling that stops talking while keeping its connection open: a test double, because a
/// real replica in-process cannot be frozen (the fleet harness freezes real processes). It
/// serves one full frame booking [`WEDGED_BOOKINGS`] requests on the engine on its first
/// connection, then holds every connection open without a byte more.
async fn start_wedged_sibling(engine_url: String) -> String {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let served = Arc::new(AtomicBool::new(false));
    let app = axum::Router::new().route(
        LOAD_BOOKINGS_PATH,
        axum::routing::get(move || {
            let first = !served.swap(true, Ordering::SeqCst);
            let engine_url = engine_url.clone();
            async move {
                let frame = format!(
                    "{{\"seq\":1,\"full\":[[\"{engine_url}\",0,{WEDGED_BOOKINGS},0,0,0]]}}\n"
                );
                let head = futures::stream::iter(
                    first.then(|| Ok::<_, std::convert::Infallible>(bytes::Bytes::from(frame))),
                );
                axum::body::Body::from_stream(futures::StreamExt::chain(
                    head,
                    futures::stream::pending(),
                ))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_siblings_bookings_leave_the_sums_after_the_staleness_bound() {
    let fleet = fleet(1, 1, "m").await;
    let urls = urls(&fleet);
    let a = kvroute::serve(config(&urls, None)).await.expect("a");
    follow_wedged_sibling(&a, &urls[0]).await;
    let heard = std::time::Instant::now();
    wait_rank_total(
        "the silent sibling's bookings to leave the sums",
        &a.url(),
        "sibling_in_flight",
        0,
    )
    .await;
    let dropped = std::time::Instant::now();
    let held_for = dropped - heard;
    // Not before the bound (less the polling granularity), and within it plus the
    // aggregator's tick and the polling.
    assert!(
        held_for >= Duration::from_millis(STALE_MS / 2),
        "bookings dropped after {held_for:?}, before the {STALE_MS} ms bound"
    );
    assert!(
        held_for <= Duration::from_millis(STALE_MS * 3),
        "bookings held {held_for:?}, far past the {STALE_MS} ms bound"
    );
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_fresh_load_report_outweighs_a_siblings_in_flight_bookings_and_without_one_they_count()
 {
    // The wedged sibling books requests on the engine's rank that the engine is not running:
    // what a sibling's last frame still holds for requests that finished after it. An engine
    // that pushes its load (SGLang's load feed) has reported them gone; a router that trusts
    // that report over the frame no longer sees a busy rank. Without a load feed the bookings
    // are all there is, and they count (the control).
    for publishing in [true, false] {
        let fleet = kvroute_sim::start_fleet(kvroute_sim::SimConfig {
            engines: 1,
            dp_size: 1,
            served_model_name: "m".into(),
            load_publish: publishing,
            ..kvroute_sim::SimConfig::for_tests()
        })
        .await
        .expect("fleet starts");
        let urls = urls(&fleet);
        let a = kvroute::serve(RouterConfig {
            load_share: LoadShareConfig {
                // A frame interval longer than the engine's report interval (100 ms), so every
                // report is younger than a frame here, and a staleness bound that keeps the
                // wedged sibling's frame for the whole test.
                interval_ms: kvroute::peer::load_share::LOAD_SHARE_INTERVAL_MS_MAX,
                stale_ms: 30_000,
                ..LoadShareConfig::default()
            },
            // The vLLM-style scrape is another engine-load source: off, so the control has none.
            engine_metrics_interval_ms: 0,
            ..config(&urls, None)
        })
        .await
        .expect("a");
        wait_subscribed(&a.url(), 1).await;
        follow_wedged_sibling(&a, &urls[0]).await;
        let rank = wait_until(
            "a's plan to carry the engine's pushed report (or, without a feed, none)",
            WAIT_DEADLINE,
            || async {
                let route = debug_route(&a.url(), "how busy is the engine?").await;
                let rank = route["ranks"][0].clone();
                let reported = rank["engine_load"].is_object();
                if reported == publishing {
                    Ok(rank)
                } else {
                    Err(format!("rank as planned: {rank}"))
                }
            },
        )
        .await;
        let expected = if publishing { 0 } else { WEDGED_BOOKINGS };
        assert_eq!(
            rank["in_flight"].as_i64(),
            Some(expected),
            "publishing {publishing}: the rank's in-flight as planned: {rank}"
        );
        a.shutdown().await;
        fleet.shutdown().await;
    }
}

/// A long prompt nobody has cached: many blocks, so a pending prefix is visible.
fn cold_prompt(tag: &str) -> String {
    let words: Vec<String> = (0..160).map(|i| format!("w{}{tag}", i % 37)).collect();
    format!("a cold prompt {tag}: {}", words.join(" "))
}

async fn debug_route(base: &str, content: &str) -> Value {
    let (status, body, _) = post_json(
        &format!("{base}/debug/route"),
        &json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body
}

fn pending_blocks_by_rank(route: &Value) -> Vec<(u64, u64)> {
    route["ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["dp_rank"].as_u64().unwrap_or(99),
                r["pending_blocks"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_siblings_pending_prefix_steers_the_same_cold_prompt_to_the_same_rank() {
    let fleet = fleet(1, 2, "m").await;
    let urls = urls(&fleet);
    for sharing in [true, false] {
        let ttl = RouterConfig {
            // Longer than the stall, so the entry outlives the whole check.
            pending_prefix_ttl_ms: 2 * STALL_MS,
            ..config(&urls, Some(TOKEN))
        };
        let a = kvroute::serve(RouterConfig {
            load_share: LoadShareConfig {
                enabled: sharing,
                stale_ms: STALE_MS,
                ..LoadShareConfig::default()
            },
            ..ttl.clone()
        })
        .await
        .expect("a");
        let b = kvroute::serve(ttl).await.expect("b");
        follow(&a, &b);
        wait_subscribed(&a.url(), 2).await;
        wait_subscribed(&b.url(), 2).await;
        if sharing {
            wait_first_sibling_heard("a to hear b", &a.url()).await;
        }
        // The engine holds the request before prefilling it: no KV event will confirm its
        // blocks while the check runs, so only a pending entry can point at its rank.
        arm_head_stalls(&urls[0], 1).await;
        let prompt = cold_prompt(if sharing { "on" } else { "off" });
        let held = send_chat(&b.url(), prompt.clone());
        let b_rank = wait_until("b to hold the cold request", WAIT_DEADLINE, || async {
            let own = rank_field(&workers(&b.url()).await, "in_flight");
            match own.iter().find(|r| r.2 == 1) {
                Some(r) => Ok(r.1),
                None => Err(format!("{own:?}")),
            }
        })
        .await;
        if sharing {
            wait_until(
                "a's route for the same prompt to follow b's pending prefix",
                WAIT_DEADLINE,
                || async {
                    let route = debug_route(&a.url(), &prompt).await;
                    let pending = pending_blocks_by_rank(&route);
                    let on_b_rank = pending.iter().any(|&(r, n)| r == b_rank && n > 0);
                    if on_b_rank && route["chosen"]["dp_rank"] == b_rank {
                        Ok(())
                    } else {
                        Err(format!("b chose rank {b_rank}; a's route: {route}"))
                    }
                },
            )
            .await;
        } else {
            // Control: without sharing, a knows of no pending block for as long as the
            // sharing case needed at most, several times over.
            let until = std::time::Instant::now() + Duration::from_millis(STALE_MS);
            while std::time::Instant::now() < until {
                let pending = pending_blocks_by_rank(&debug_route(&a.url(), &prompt).await);
                assert!(
                    pending.iter().all(|&(_, n)| n == 0),
                    "a saw pending blocks without sharing: {pending:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        assert_eq!(held.await.unwrap(), 200);
        a.shutdown().await;
        b.shutdown().await;
    }
}

/// The `outcome="..."` sample of `kvroute_tokenizer_cache_total` on `base`'s `/metrics`.
async fn tokenizer_cache(base: &str, outcome: &str) -> u64 {
    let text = metrics_text(base).await;
    let series = format!("kvroute_tokenizer_cache_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .map_or(0, |v| v.trim().parse().expect("a counter"))
}

async fn send_conversation(base: &str, messages: &[Value]) {
    let (status, body, _) = post_json(
        &format!("{base}/v1/chat/completions"),
        &json!({"model": "m", "max_tokens": 2, "messages": messages}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_a_sibling_rendered_is_not_rendered_again_and_a_follower_that_did_not_ask_gets_none()
 {
    let fleet = fleet(1, 2, "m").await;
    let urls = urls(&fleet);
    let a = kvroute::serve(config(&urls, Some(TOKEN))).await.expect("a");
    let b = kvroute::serve(config(&urls, Some(TOKEN))).await.expect("b");
    follow(&a, &b);
    wait_subscribed(&a.url(), 2).await;
    wait_subscribed(&b.url(), 2).await;
    wait_first_sibling_heard("a to hear b", &a.url()).await;
    // A follower of the kind that predates shared prefixes: it does not ask for them.
    let mut older_follower = client()
        .get(format!("{}{LOAD_BOOKINGS_PATH}", b.internal_url()))
        .bearer_auth(String::from_utf8_lossy(TOKEN))
        .send()
        .await
        .expect("b's stream");
    assert_eq!(older_follower.status(), 200);

    let mut messages = vec![
        json!({"role": "system", "content": "You answer questions about routers. ".repeat(8)}),
        json!({"role": "user", "content": "What does a cache-aware router do?"}),
    ];
    send_conversation(&b.url(), &messages).await;
    let a_tokenizer = a
        .router
        .tokenizers
        .get_or_load(
            &tokenizer_path(),
            a.router.config.tokenizer_cache_entries_max,
        )
        .expect("a's tokenizer");
    // b rendered the system message, the question and the generation prompt.
    wait_until(
        "a to adopt b's rendered prefixes",
        WAIT_DEADLINE,
        || async {
            match a_tokenizer.adopted_prefixes() {
                n if n >= 3 => Ok(()),
                n => Err(format!("adopted {n}")),
            }
        },
    )
    .await;
    messages.push(json!({"role": "assistant", "content": "It sends a prompt where it is cached."}));
    messages.push(json!({"role": "user", "content": "And when that rank is busy?"}));
    let (hits, misses) = (
        tokenizer_cache(&a.url(), "hit").await,
        tokenizer_cache(&a.url(), "miss").await,
    );
    send_conversation(&a.url(), &messages).await;
    assert_eq!(
        (
            tokenizer_cache(&a.url(), "hit").await - hits,
            tokenizer_cache(&a.url(), "miss").await - misses
        ),
        (2, 3),
        "a took the first two messages from b and rendered the answer, the question and the \
         generation prompt"
    );

    // Everything b sent the follower that did not ask, meanwhile and for one more heartbeat.
    let mut seen = String::new();
    let until = tokio::time::Instant::now()
        + Duration::from_millis(2 * kvroute::peer::load_share::LOAD_SHARE_HEARTBEAT_MS);
    while let Ok(Ok(Some(chunk))) = tokio::time::timeout_at(until, older_follower.chunk()).await {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("\"seq\""), "frames reached it: {seen:?}");
    assert!(
        !seen.contains("prefixes"),
        "a follower that did not ask got shared prefixes: {seen}"
    );
    a.shutdown().await;
    b.shutdown().await;
}
