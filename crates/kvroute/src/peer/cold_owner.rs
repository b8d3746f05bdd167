//! Cold prompts placed by one replica: a prompt no engine has confirmed half of (pending blocks
//! do not count) is placed by the replica that OWNS it, so that replicas receiving one new
//! prefix at the same instant start it on one rank instead of each on its own.
//!
//! Why: load sharing ([`crate::peer::load_share`]) tells every replica where its siblings just
//! sent a new prefix, and how loaded that left each rank, but only one frame later (5 ms).
//! Behind a Service, the first turns of a new system prompt reach several replicas within a
//! fraction of a millisecond (a burst of new conversations); each sees the prefix nowhere, or
//! pending on a rank whose load it does not know yet, and each places it by its own view: two
//! or three cold copies of the same prefill, each filling a rank's cache with the same blocks.
//! Agreement without talking was tried and measured (a rendezvous hash over tied ranks, a random
//! backoff; docs/BENCHMARKS.md, "Several replicas behind one Service"): at this timescale each
//! replica's own bookings of the previous millisecond already differ, so their choices do too.
//! What works is one decision point, found without asking anyone.
//!
//! Shape:
//! * The owner is the highest rendezvous weight ([`owner_of`]) of a key over this replica and
//!   its siblings: every replica with the same sibling set names the same owner, and a replica
//!   leaving or joining moves only what it owned. `--cold-owner fleet` uses one fixed key, so
//!   one replica places every cold prompt and sees all of them at once; `--cold-owner prefix`
//!   keys by one of the prompt's opening block hashes ([`owner_key`]), so the placements spread
//!   over the replicas and agree per prefix only.
//! * A replica that plans a cold prompt it does not own records nothing, asks the owner
//!   (`POST /internal/cold_place`, the prompt's token ids as little-endian `u32`, the model in
//!   the `x-kvroute-model` header), waits at most `--cold-owner-timeout-ms`, and routes to the
//!   rank the owner named; it then records the pending prefix and publishes it as if it had
//!   chosen the rank itself.
//! * Bookings: the owner queues the prompt's prefill on the rank's clock as its own dispatched
//!   work (so its siblings learn it from its frames) and counts the request in its own cost
//!   model for [`placed_booking_ms`] (never shared), so its next placement sees this one at
//!   once; the asker books the request (in flight, queued tokens) but not the prefill work, or
//!   the siblings would receive the work twice.
//! * Everything degrades to placing the prompt here: no answer in time, an owner that does not
//!   know the model, a rank the asker cannot route to. Ownership only moves a prompt among
//!   ranks the asker would also route to; it cannot fail a request. An owner that answers
//!   after the asker gave up has recorded a pending prefix nobody sent: it expires with
//!   `--pending-prefix-ttl-ms` like any unconfirmed one.
//! * Only a sibling this replica can use owns anything (`Router::cold_owner_candidates`): with
//!   load sharing on, one whose bookings stream it hears; and one whose asks have not failed
//!   lately ([`crate::peer::owner_standings`]). A dead or partitioned sibling still listed by
//!   discovery would otherwise make every cold prompt it owns wait for the timeout.
//! * Identity: a replica names itself as its siblings name it ([`self_peer_url`]). If that
//!   cannot be known (a wildcard internal bind and no advertise URL), ownership stays off: a
//!   replica that misnames itself would disagree with every sibling about who owns what.
//!
//! Cost: one round trip on the internal listener for a cold prompt of a fleet with siblings,
//! nothing for a prompt an engine holds half of, nothing without siblings. A cold prompt's
//! prefill is tens of milliseconds, a round trip between two hosts a fraction of one (0.6-0.9 ms
//! p50 between four in-process replicas on two cores at one request at a time). Where the
//! replicas' cores are saturated, every thread of the round trip waits for one (11 ms p50 in
//! the demo's four-replica sweep, docs/BENCHMARKS.md): the asker names its wait in the
//! decision header (`owner_wait_ms`) so that such a host shows where the time went.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use kvroute_discovery::{PeerSourceConfig, PeerUrl};
use serde::{Deserialize, Serialize};

pub use crate::config::ColdOwnerScope;
use crate::control::router::Router;

/// Path of the placement endpoint on the internal listener.
pub const COLD_PLACE_PATH: &str = "/internal/cold_place";
/// Header naming the prompt's model on a placement request.
pub const COLD_PLACE_MODEL_HEADER: &str = "x-kvroute-model";
/// Largest placement request body: 1 M token ids. A longer prompt is placed where it arrives.
pub const COLD_PLACE_BODY_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Largest answer read from an owner (a placement is a worker URL and two numbers).
pub const COLD_PLACE_ANSWER_MAX_BYTES: usize = 16 * 1024;
/// The longest prompt sent to its owner (what fits the body cap).
pub const COLD_PLACE_TOKENS_MAX: usize = COLD_PLACE_BODY_MAX_BYTES / 4;
/// Header of a placement request: the prompt's whole length in tokens, when the body holds
/// only its first ones (a chat tokenized in its head, `crate::routing::tokenize`).
pub const COLD_PLACE_PROMPT_TOKENS_HEADER: &str = "x-kvroute-prompt-tokens";
/// Position of the block whose hash keys a prompt's owner (or the prompt's last block, when it
/// is shorter). Eight blocks is 128 tokens at the common block size of 16: past a chat
/// template's opening, inside a system prompt.
pub const COLD_OWNER_KEY_BLOCK: usize = 7;
/// Prompts shorter than this many blocks are placed where they arrive: their prefill is too
/// short for a duplicate to matter, and the round trip would be most of its cost.
pub const COLD_OWNER_MIN_BLOCKS: usize = 4;

/// A cold prompt this replica planned and does not own: where to ask, and the prompt's block
/// hashes, to record as pending on whichever rank it finally goes to.
#[derive(Debug, Clone)]
pub struct ColdDeferral {
    pub owner: PeerUrl,
    pub hashes: Vec<u64>,
}

/// The owner's answer: the rank it chose for the prompt, and the prefill work (us, by its
/// cost model) it queued on that rank's clock as its own dispatched work. The owner books the
/// prefill, so that its next placement sees this one at once and its siblings learn it from
/// its frames; the asker books only the request (in flight, queued tokens), or the work would
/// reach the siblings twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColdPlacement {
    pub worker_url: String,
    pub dp_rank: u32,
    pub prefill_booked_us: u64,
}

/// True when no engine has confirmed half of a prompt of `prompt_blocks` blocks (`best_held`
/// is the deepest rank's indexed blocks), and the prompt is long enough for a duplicate
/// prefill to matter. Pending blocks do not count: a prefix that is only pending somewhere is
/// exactly one that several replicas may be placing at this instant, each with its own lagging
/// view of where it went and of the ranks' load, and its owner is the one that knows.
pub fn is_cold(best_held: usize, prompt_blocks: usize) -> bool {
    prompt_blocks >= COLD_OWNER_MIN_BLOCKS && best_held * 2 < prompt_blocks
}

/// The key of a prompt's owner, or `None` for an empty prompt: a block hash of the prompt
/// ([`COLD_OWNER_KEY_BLOCK`]) under `Prefix`, one fixed key for every prompt under `Fleet`.
pub fn owner_key(scope: ColdOwnerScope, hashes: &[u64]) -> Option<u64> {
    match scope {
        ColdOwnerScope::Off => None,
        ColdOwnerScope::Prefix => hashes
            .get(COLD_OWNER_KEY_BLOCK)
            .or_else(|| hashes.last())
            .copied(),
        ColdOwnerScope::Fleet => (!hashes.is_empty()).then_some(FLEET_OWNER_KEY),
    }
}

/// The key every prompt has under `--cold-owner fleet` (any fixed value names one owner).
pub const FLEET_OWNER_KEY: u64 = 0;

/// The owner of `key` among `me` and `siblings`: the one whose weight for `key` is highest.
/// Deterministic across processes and machines (a fixed hash, no per-process seed); a URL
/// listed twice changes nothing; ties (a 64-bit collision) go to the lower URL.
pub fn owner_of<'a>(key: u64, me: &'a PeerUrl, siblings: &'a [PeerUrl]) -> &'a PeerUrl {
    let mut best = (weight(key, me), me);
    for s in siblings {
        let w = weight(key, s);
        if w > best.0 || (w == best.0 && s.as_str() < best.1.as_str()) {
            best = (w, s);
        }
    }
    best.1
}

/// Rendezvous weight of one replica for one key: FNV-1a over the URL, mixed with the key by
/// splitmix64's finalizer. Hand-rolled because it must be the same function in every replica
/// of every build (std's `DefaultHasher` promises no stability, and the field's fast hashers
/// are seeded per process); ten lines of arithmetic with published constants.
fn weight(key: u64, replica: &PeerUrl) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in replica.as_str().bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = h ^ key.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How this replica's siblings name it: the advertise URL of a static peer list, `POD_IP` with
/// the internal port under DNS or Kubernetes discovery, else the internal listener's own
/// address when it is a specific one. `None` when it cannot be known (a wildcard bind with no
/// other clue); ownership is then off.
pub fn self_peer_url(peers: Option<&PeerSourceConfig>, internal: SocketAddr) -> Option<PeerUrl> {
    let with_ip = |ip: std::net::IpAddr, https: bool| {
        let scheme = if https { "https" } else { "http" };
        PeerUrl::parse(&format!(
            "{scheme}://{}",
            SocketAddr::new(ip, internal.port())
        ))
        .ok()
    };
    let from_source = match peers {
        Some(PeerSourceConfig::Static(s)) => s.advertise_url.clone(),
        Some(PeerSourceConfig::Dns(d)) => {
            d.exclude_ips.first().and_then(|&ip| with_ip(ip, d.https))
        }
        Some(PeerSourceConfig::Kubernetes(k)) => k.pod_ip.and_then(|ip| with_ip(ip, k.https)),
        None => None,
    };
    from_source.or_else(|| {
        (!internal.ip().is_unspecified())
            .then(|| PeerUrl::parse(&format!("http://{internal}")).ok())
            .flatten()
    })
}

/// The longest the owner counts a request it placed for a sibling in its own cost model: four
/// of the siblings' frame intervals, by when the sibling's own booking of it has reached the
/// owner (a frame goes out at most one interval after a change). The booking usually ends
/// sooner, handed over to the siblings' sums as they rise ([`hand_over_placed`]).
pub fn placed_booking_ms(router: &Router) -> u64 {
    4 * router.config.load_share.interval_ms.max(1)
}

/// Counts a request this replica (the owner) placed on `rank` for a sibling in its own cost
/// model for [`placed_booking_ms`]: the sibling books the real request and shares it, but only
/// a frame later, and meanwhile the owner's next placements must see this one or they would
/// all pick the same idle rank. Never shared (see `RankLoad::placed_in_flight`).
pub fn book_placed(
    router: &Router,
    rank: Arc<crate::control::registry::RankLoad>,
    prefill_tokens: i64,
) {
    use std::sync::atomic::Ordering::Relaxed;
    rank.placed_in_flight.fetch_add(1, Relaxed);
    rank.placed_queued_prefill_tokens
        .fetch_add(prefill_tokens, Relaxed);
    let hold = Duration::from_millis(placed_booking_ms(router));
    router.control.spawn(async move {
        tokio::time::sleep(hold).await;
        // The siblings' sums may have taken this booking over already (`hand_over_placed`).
        hand_over_placed(&rank.placed_in_flight, 1);
        hand_over_placed(&rank.placed_queued_prefill_tokens, prefill_tokens);
    });
}

/// Releases up to `amount` (> 0) of a placed booking counter, never below zero: the booking's
/// hold ending and the siblings' sums rising both release it, whichever comes first, so neither
/// may take it negative (a negative count would hide real load).
pub fn hand_over_placed(counter: &AtomicI64, amount: i64) {
    if amount <= 0 {
        return;
    }
    // Cannot fail: the closure always returns Some.
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
        Some((held - amount).max(0))
    });
}

/// Why an owner's placement was not used.
#[derive(Debug, thiserror::Error)]
pub enum ColdAskError {
    #[error("the owner did not answer within {0} ms")]
    Timeout(u64),
    #[error("the owner could not be reached: {0}")]
    Transport(String),
    #[error("the owner answered HTTP {0}")]
    Status(u16),
    #[error("the owner's answer is not a placement: {0}")]
    Answer(String),
}

/// Asks `owner` to place a prompt of `model` with `tokens`; bounded by the configured timeout.
/// Runs on the control runtime (the shared HTTP client's connections live there). Sending it
/// from the data-plane thread's own client instead was measured twice: no shorter wait (the
/// thread also serves its other connections), and once more timeouts on a loaded machine
/// (docs/BENCHMARKS.md, "Each replica on a runtime of its own").
pub async fn ask_owner(
    router: &Arc<Router>,
    owner: &PeerUrl,
    model: &str,
    tokens: &[u32],
    prompt_tokens: usize,
) -> Result<ColdPlacement, ColdAskError> {
    let timeout_ms = router.config.load_share.cold_owner_timeout_ms;
    let mut body = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        body.extend_from_slice(&t.to_le_bytes());
    }
    let mut req = router
        .http
        .post(format!(
            "{}{COLD_PLACE_PATH}",
            owner.as_str().trim_end_matches('/')
        ))
        .header(COLD_PLACE_MODEL_HEADER, model)
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .body(body);
    if prompt_tokens > tokens.len() {
        req = req.header(COLD_PLACE_PROMPT_TOKENS_HEADER, prompt_tokens);
    }
    if let Some(t) = router.config.internal_auth_token.as_deref() {
        req = req.bearer_auth(String::from_utf8_lossy(t));
    }
    let asked = router.control.spawn(async move {
        let resp = req
            .send()
            .await
            .map_err(|e| ColdAskError::Transport(e.to_string()))?;
        if resp.status() != reqwest::StatusCode::OK {
            return Err(ColdAskError::Status(resp.status().as_u16()));
        }
        let mut resp = resp;
        let mut bytes = Vec::new();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| ColdAskError::Transport(e.to_string()))?
        {
            if bytes.len() + chunk.len() > COLD_PLACE_ANSWER_MAX_BYTES {
                return Err(ColdAskError::Answer(format!(
                    "over {COLD_PLACE_ANSWER_MAX_BYTES} bytes"
                )));
            }
            bytes.extend_from_slice(&chunk);
        }
        serde_json::from_slice::<ColdPlacement>(&bytes)
            .map_err(|e| ColdAskError::Answer(e.to_string()))
    });
    let abort = asked.abort_handle();
    match tokio::time::timeout(Duration::from_millis(timeout_ms), asked).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => Err(ColdAskError::Transport(e.to_string())),
        Err(_) => {
            abort.abort();
            Err(ColdAskError::Timeout(timeout_ms))
        }
    }
}

/// Why a placement request was refused (the internal listener maps each to a status).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ColdPlaceError {
    #[error("the body is {0} bytes, not a whole number of little-endian u32 token ids")]
    NotTokenIds(usize),
    #[error("the body is over {COLD_PLACE_BODY_MAX_BYTES} bytes")]
    TooLarge,
    #[error("the body holds no token ids")]
    Empty,
}

/// Reads a placement request's body into token ids.
pub fn read_token_ids(body: &[u8]) -> Result<Vec<u32>, ColdPlaceError> {
    if body.len() > COLD_PLACE_BODY_MAX_BYTES {
        return Err(ColdPlaceError::TooLarge);
    }
    if !body.len().is_multiple_of(4) {
        return Err(ColdPlaceError::NotTokenIds(body.len()));
    }
    if body.is_empty() {
        return Err(ColdPlaceError::Empty);
    }
    Ok(body
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> PeerUrl {
        PeerUrl::parse(s).unwrap()
    }

    #[test]
    fn a_placed_booking_released_twice_never_goes_below_zero() {
        let placed = AtomicI64::new(2);
        // The siblings' sums rose by one: one booking handed over.
        hand_over_placed(&placed, 1);
        assert_eq!(placed.load(Ordering::Relaxed), 1);
        // A rise larger than what is held releases what is held, no more.
        hand_over_placed(&placed, 5);
        assert_eq!(placed.load(Ordering::Relaxed), 0);
        // Then the holds end: nothing left to release, and no negative count hides real load.
        hand_over_placed(&placed, 1);
        assert_eq!(placed.load(Ordering::Relaxed), 0);
        // A fall of the sums (a negative rise) releases nothing.
        placed.store(3, Ordering::Relaxed);
        hand_over_placed(&placed, -2);
        hand_over_placed(&placed, 0);
        assert_eq!(placed.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn every_replica_names_the_same_owner_whatever_its_own_view_order() {
        let all = [
            url("http://10.0.0.1:8081"),
            url("http://10.0.0.2:8081"),
            url("http://10.0.0.3:8081"),
            url("http://10.0.0.4:8081"),
        ];
        for key in [0u64, 1, 42, u64::MAX, 0xdead_beef] {
            let owners: Vec<String> = (0..all.len())
                .map(|me| {
                    let mut siblings: Vec<PeerUrl> = all
                        .iter()
                        .enumerate()
                        .filter(|&(i, _)| i != me)
                        .map(|(_, u)| u.clone())
                        .collect();
                    siblings.reverse();
                    owner_of(key, &all[me], &siblings).as_str().to_string()
                })
                .collect();
            assert!(
                owners.windows(2).all(|w| w[0] == w[1]),
                "key {key}: replicas disagree on the owner: {owners:?}"
            );
        }
    }

    #[test]
    fn ownership_spreads_over_the_replicas() {
        let all: Vec<PeerUrl> = (1..=4)
            .map(|i| url(&format!("http://10.0.0.{i}:8081")))
            .collect();
        let mut owned = [0usize; 4];
        for key in 0..4_000u64 {
            let key = key.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let owner = owner_of(key, &all[0], &all[1..]);
            owned[all.iter().position(|u| u == owner).unwrap()] += 1;
        }
        assert!(
            owned.iter().all(|&n| (800..=1_200).contains(&n)),
            "4,000 keys over 4 replicas should give each about 1,000: {owned:?}"
        );
    }

    #[test]
    fn a_replica_leaving_moves_only_the_prefixes_it_owned() {
        let all: Vec<PeerUrl> = (1..=4)
            .map(|i| url(&format!("http://10.0.0.{i}:8081")))
            .collect();
        for key in 0..1_000u64 {
            let before = owner_of(key, &all[0], &all[1..]).clone();
            let after = owner_of(key, &all[0], &all[1..3]).clone();
            if before != all[3] {
                assert_eq!(before, after, "key {key} moved though its owner stayed");
            }
        }
    }

    #[test]
    fn a_prompt_is_cold_while_no_engine_has_confirmed_half_of_it() {
        assert!(is_cold(0, 10));
        assert!(is_cold(4, 10));
        assert!(!is_cold(5, 10), "half held is not cold");
        assert!(
            !is_cold(0, COLD_OWNER_MIN_BLOCKS - 1),
            "a prompt under the minimum is never sent to an owner"
        );
        assert!(is_cold(0, COLD_OWNER_MIN_BLOCKS));
    }

    #[test]
    fn the_owner_key_is_the_eighth_block_or_the_last_of_a_shorter_prompt() {
        let long: Vec<u64> = (100..120).collect();
        let p = ColdOwnerScope::Prefix;
        assert_eq!(owner_key(p, &long), Some(100 + COLD_OWNER_KEY_BLOCK as u64));
        assert_eq!(owner_key(p, &[5, 6, 7]), Some(7));
        assert_eq!(owner_key(p, &[]), None);
    }

    #[test]
    fn under_fleet_scope_every_prompt_has_one_owner_and_off_has_none() {
        let a: Vec<u64> = (100..120).collect();
        let b: Vec<u64> = (7..9).collect();
        let f = ColdOwnerScope::Fleet;
        assert_eq!(owner_key(f, &a), owner_key(f, &b));
        assert!(owner_key(f, &a).is_some());
        assert_eq!(owner_key(ColdOwnerScope::Off, &a), None);
    }

    #[test]
    fn a_placement_body_must_be_whole_little_endian_token_ids_within_the_cap() {
        assert_eq!(read_token_ids(&[1, 0, 0, 0, 2, 1, 0, 0]), Ok(vec![1, 258]));
        assert_eq!(
            read_token_ids(&[1, 0, 0]),
            Err(ColdPlaceError::NotTokenIds(3))
        );
        assert_eq!(read_token_ids(&[]), Err(ColdPlaceError::Empty));
        assert_eq!(
            read_token_ids(&vec![0u8; COLD_PLACE_BODY_MAX_BYTES + 4]),
            Err(ColdPlaceError::TooLarge)
        );
    }

    #[test]
    fn self_is_named_by_the_advertise_url_or_a_specific_internal_address() {
        let internal: SocketAddr = "0.0.0.0:8081".parse().unwrap();
        assert_eq!(
            self_peer_url(None, internal),
            None,
            "a wildcard bind names nobody"
        );
        let specific: SocketAddr = "127.0.0.1:9001".parse().unwrap();
        assert_eq!(
            self_peer_url(None, specific),
            Some(url("http://127.0.0.1:9001"))
        );
        let advertised = PeerSourceConfig::Static(kvroute_discovery::StaticPeers {
            peers: vec![url("http://10.0.0.2:8081")],
            advertise_url: Some(url("http://10.0.0.1:8081")),
        });
        assert_eq!(
            self_peer_url(Some(&advertised), internal),
            Some(url("http://10.0.0.1:8081"))
        );
        let mut k8s = kvroute_discovery::KubernetesPeers::new("app=kvroute");
        k8s.pod_ip = Some("10.1.2.3".parse().unwrap());
        assert_eq!(
            self_peer_url(Some(&PeerSourceConfig::Kubernetes(k8s)), internal),
            Some(url("http://10.1.2.3:8081"))
        );
    }
}
