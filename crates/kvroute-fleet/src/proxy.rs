//! A TCP proxy that can be cut: the network partition of the scenarios. Simpler than network
//! namespaces (no privileges, no cleanup on a crash) and exact about what it models: while cut,
//! new connections are either black-holed (accepted, never answered: packets dropped, the
//! usual partition) or closed at once (a reject), and connections already open are dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What a cut proxy does to a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Forward (not cut).
    Open = 0,
    /// Accept and never answer (dropped packets).
    Blackhole = 1,
    /// Accept and close at once (a reject).
    Reject = 2,
}

/// A running proxy `127.0.0.1:<port>` -> `target`; stops when dropped.
pub struct CutProxy {
    pub port: u16,
    mode: Arc<AtomicU8>,
    /// Bumped on every cut: open connections watch it and close.
    epoch: watch::Sender<u64>,
    task: JoinHandle<()>,
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl CutProxy {
    /// `target` is `host:port`.
    pub async fn start(target: &str) -> CutProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("the proxy binds");
        let port = listener.local_addr().expect("local addr").port();
        let mode = Arc::new(AtomicU8::new(Cut::Open as u8));
        let (epoch, _) = watch::channel(0u64);
        let (m, e, target) = (mode.clone(), epoch.clone(), target.to_string());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let mut cut_seen = e.subscribe();
                let target = target.clone();
                match m.load(Ordering::Relaxed) {
                    x if x == Cut::Blackhole as u8 => {
                        // Held until the next cut change (or the proxy stops), never read.
                        tokio::spawn(async move {
                            let _ = cut_seen.changed().await;
                            drop(inbound);
                        });
                    }
                    x if x == Cut::Reject as u8 => drop(inbound),
                    _ => {
                        tokio::spawn(async move {
                            let Ok(mut outbound) = TcpStream::connect(&target).await else {
                                return;
                            };
                            tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                                _ = cut_seen.changed() => {}
                            }
                        });
                    }
                }
            }
        });
        CutProxy {
            port,
            mode,
            epoch,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Changes the mode; every connection open or held now is dropped.
    pub fn set(&self, cut: Cut) {
        self.mode.store(cut as u8, Ordering::Relaxed);
        self.epoch.send_modify(|e| *e += 1);
    }
}
