//! The harness's HTTP client: one shared `reqwest` client with a bounded timeout, and small JSON
//! helpers whose errors are strings, because every caller is a [`crate::wait`] probe that
//! reports what it saw.

use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

/// Upper bound on one harness request; a probe that takes longer is a failed probe.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;

pub fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .timeout(Duration::from_millis(REQUEST_TIMEOUT_MS))
            // Connections to a killed replica must not be reused for the next one on that port.
            .pool_max_idle_per_host(0)
            .build()
            .expect("the HTTP client builds")
    })
}

/// `GET url` as JSON; a non-2xx status is an error naming it and the body.
pub async fn get_json(url: &str) -> Result<Value, String> {
    let resp = client()
        .get(url)
        .send()
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| format!("GET {url}: {e}"))?;
    if !status.is_success() {
        return Err(format!("GET {url}: {status}: {text}"));
    }
    serde_json::from_str(&text).map_err(|e| format!("GET {url}: not JSON ({e}): {text}"))
}

/// `POST url` with a JSON body; returns the status and the body (JSON, or `Null`).
pub async fn post_json(url: &str, body: &Value) -> Result<(u16, Value), String> {
    let resp = client()
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| format!("POST {url}: {e}"))?;
    let status = resp.status().as_u16();
    let v = resp.json::<Value>().await.unwrap_or(Value::Null);
    Ok((status, v))
}

/// `GET url` status only (connection failures are `Err`).
pub async fn get_status(url: &str) -> Result<u16, String> {
    client()
        .get(url)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("GET {url}: {e}"))
}

/// `GET url` as text.
pub async fn get_text(url: &str) -> Result<String, String> {
    let resp = client()
        .get(url)
        .send()
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    resp.text().await.map_err(|e| format!("GET {url}: {e}"))
}
