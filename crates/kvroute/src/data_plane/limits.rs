//! The public listener's client limits: timeouts at each step of a connection and the cap on
//! open connections. A leaf module (it names nothing else in the crate), so the plain config
//! struct can hold it without depending on the data plane's machinery.

/// Default of `--client-idle-timeout-ms`.
pub const DEFAULT_CLIENT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Default of `--request-head-timeout-ms`.
pub const DEFAULT_REQUEST_HEAD_TIMEOUT_MS: u64 = 10_000;
/// Default of `--request-body-timeout-ms`.
pub const DEFAULT_REQUEST_BODY_TIMEOUT_MS: u64 = 30_000;
/// Default of `--client-write-timeout-ms`.
pub const DEFAULT_CLIENT_WRITE_TIMEOUT_MS: u64 = 30_000;
/// Default of `--client-connections-max`.
pub const DEFAULT_CLIENT_CONNECTIONS_MAX: usize = 10_000;

/// How long a client may take at each step of a connection, and how many may be open: what
/// keeps idle, trickling and non-reading clients from holding sockets, memory, engine requests
/// and load bookings without bound. Every limit has a flag (`kvroute --help`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// A keep-alive connection with no request in progress is closed after this long.
    pub idle_timeout_ms: u64,
    /// Once a request's first byte arrived, its whole head must arrive within this long (408).
    pub head_timeout_ms: u64,
    /// Once the head is complete, the whole body must arrive within this long (408).
    pub body_timeout_ms: u64,
    /// One write of the answer to a client that does not read must complete within this long;
    /// else the connection is closed, which drops the engine request and its load booking.
    pub write_timeout_ms: u64,
    /// Open client connections across the public listener; one more is answered 503 and closed.
    pub connections_max: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            idle_timeout_ms: DEFAULT_CLIENT_IDLE_TIMEOUT_MS,
            head_timeout_ms: DEFAULT_REQUEST_HEAD_TIMEOUT_MS,
            body_timeout_ms: DEFAULT_REQUEST_BODY_TIMEOUT_MS,
            write_timeout_ms: DEFAULT_CLIENT_WRITE_TIMEOUT_MS,
            connections_max: DEFAULT_CLIENT_CONNECTIONS_MAX,
        }
    }
}
