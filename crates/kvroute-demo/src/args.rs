//! The demo's flags (each also readable from a `KVROUTE_DEMO_...` env var): the workload's shape,
//! the in-process fleet's prefill model, and the external-router mode.

use clap::Args;
use kvroute::PolicyKind;

/// The demo fleet's prefill model (see `kvroute_sim`'s `--prefill-serial`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FleetPrefill {
    Serial,
    Parallel,
}

/// The workload the demo drives (the same for every row of a run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Multi-turn chats over a few shared system prompts (the crate doc describes it).
    Chat,
    /// Long, mostly unique conversations against caches that hold about half of them
    /// (`long_conversations` describes it; its settings are the `--session-*`, `--context-words`,
    /// `--think-*` and `--long-capacity-blocks` flags).
    LongConversations,
}

#[derive(Debug, Args, Clone)]
pub struct DemoArgs {
    /// The workload.
    #[arg(long, env = "KVROUTE_DEMO_WORKLOAD", value_enum, default_value_t = Workload::Chat)]
    pub workload: Workload,
    /// The long-conversations workload's settings.
    #[command(flatten)]
    pub long: crate::long_conversations::LongArgs,
    /// Number of conversations in the workload.
    #[arg(long, env = "KVROUTE_DEMO_CONVERSATIONS", default_value_t = 96)]
    pub conversations: usize,
    /// Distinct shared system prompts.
    #[arg(long, env = "KVROUTE_DEMO_SYSTEM_PROMPTS", default_value_t = 8)]
    pub system_prompts: usize,
    /// User turns per conversation.
    #[arg(long, env = "KVROUTE_DEMO_TURNS", default_value_t = 4)]
    pub turns: usize,
    /// Zipf exponent of the system prompts' popularity (0 = uniform): with 1.2, the most
    /// popular of 8 prompts opens ~43 % of the conversations, like one big tenant among small ones.
    #[arg(long, env = "KVROUTE_DEMO_SYSTEM_PROMPT_SKEW", default_value_t = 1.2, value_parser = crate::parse_skew)]
    pub system_prompt_skew: f64,
    /// How the in-process fleet's ranks prefill: `serial` (one prompt at a time per rank, like a
    /// compute-bound GPU) or `parallel` (every prompt at full speed, load never delays it).
    #[arg(long, env = "KVROUTE_DEMO_FLEET_PREFILL", value_enum, default_value_t = FleetPrefill::Serial)]
    pub fleet_prefill: FleetPrefill,
    /// The in-process routers' `--eviction-cost-fraction` (the share of a prefill charged on
    /// top for each uncached token, for the cached block its insertion displaces).
    #[arg(long, env = "KVROUTE_DEMO_EVICTION_COST_FRACTION",
          default_value_t = kvroute::routing::policy::DEFAULT_EVICTION_COST_FRACTION,
          value_parser = crate::parse_eviction_cost_fraction)]
    pub eviction_cost_fraction: f64,
    /// Concurrent conversations.
    #[arg(long, env = "KVROUTE_DEMO_CONCURRENCY", default_value_t = 32)]
    pub concurrency: usize,
    #[arg(long, env = "KVROUTE_DEMO_SEED", default_value_t = 7)]
    pub seed: u64,
    /// Run only these policies (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub policies: Vec<PolicyKind>,
    /// Drive this router (base URL, e.g. `http://127.0.0.1:30000`) with the same workload once,
    /// instead of starting the in-process fleet and router (for comparing other routers in
    /// front of `kvroute-sim` engines).
    #[arg(long, env = "KVROUTE_DEMO_ROUTER_URL")]
    pub router_url: Option<String>,
    /// With `--router-url`: the engines behind it, whose `/served_stats` give the per-rank
    /// load-balance figures.
    #[arg(long, env = "KVROUTE_DEMO_ENGINE_URLS", value_delimiter = ',')]
    pub engine_urls: Vec<String>,
    /// With `--router-url`: the row's name.
    #[arg(long, env = "KVROUTE_DEMO_LABEL", default_value = "external")]
    pub label: String,
    /// Print the results as one JSON document (with per-rank balance) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The rolling-update mode (`--rolling-update` and its settings).
    #[command(flatten)]
    pub rolling: crate::rolling::RollingArgs,
    /// The replica-sweep mode (`--replica-sweep` and its settings).
    #[command(flatten)]
    pub sweep: crate::replicas::SweepArgs,
}

impl DemoArgs {
    /// Conversations in flight at once: `--concurrency` for the chat workload; every session
    /// for long conversations, whose Poisson arrivals and think times pace the load instead.
    pub fn concurrency_limit(&self) -> usize {
        match self.workload {
            Workload::Chat => self.concurrency.max(1),
            Workload::LongConversations => self.long.sessions.max(1),
        }
    }

    /// Device blocks per rank of the in-process fleet.
    pub fn capacity_blocks(&self) -> usize {
        match self.workload {
            Workload::Chat => crate::CAPACITY_BLOCKS,
            Workload::LongConversations => self.long.long_capacity_blocks,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::parse_skew;

    #[test]
    fn demo_skew_outside_its_range_or_not_a_number_is_refused() {
        assert_eq!(parse_skew("1.2"), Ok(1.2));
        assert_eq!(parse_skew("0"), Ok(0.0));
        for bad in ["-0.5", "17", "NaN", "inf", "x"] {
            assert!(parse_skew(bad).is_err(), "{bad} accepted");
        }
    }
}
