//! Siblings that misbehave in ways a real replica cannot be made to: one that accepts the
//! connection and never answers, one that answers garbage. These are the harness's only test
//! doubles (a real `kvroute` never hangs on a request or sends a body that is not a snapshot);
//! every other sibling in the scenarios is a real replica, including the one with another block
//! size and the one still bootstrapping. Both listen on real loopback sockets, and both live as
//! long as the returned value.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Bytes of garbage the garbage sibling sends as a snapshot body.
pub const GARBAGE_BODY_BYTES: usize = 4096;
/// Largest request head the garbage sibling reads before answering.
pub const REQUEST_HEAD_MAX_BYTES: usize = 16 * 1024;

/// A fake sibling; stops when dropped.
pub struct FakeSibling {
    pub port: u16,
    task: JoinHandle<()>,
}

impl Drop for FakeSibling {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeSibling {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Accepts every connection and holds it, never reading or writing.
    pub async fn silent() -> FakeSibling {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let port = listener.local_addr().expect("addr").port();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        FakeSibling { port, task }
    }

    /// Answers every request with 200, the binary snapshot media type, and bytes that are not a
    /// snapshot.
    pub async fn garbage() -> FakeSibling {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let port = listener.local_addr().expect("addr").port();
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n")
                        && head.len() < REQUEST_HEAD_MAX_BYTES
                    {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body: Vec<u8> = (0..GARBAGE_BODY_BYTES)
                        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
                        .collect();
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/x-kvroute-snapshot\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = s.write_all(resp.as_bytes()).await;
                    let _ = s.write_all(&body).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        FakeSibling { port, task }
    }
}
