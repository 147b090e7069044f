//! Settings of the insert API shared by the roles that serve it (`ferry dev`,
//! `ferry writer`).

use std::time::Duration;

use ferry_ingest::{ApiLimits, ApiToken};

#[derive(Debug, Clone, clap::Args)]
pub struct ApiArgs {
    /// Bearer token every HTTP request must carry (`Authorization: Bearer
    /// <token>`); at least 16 characters. Unset: no authentication. Prefer the
    /// environment variable: a flag shows in the process list.
    #[arg(long, env = "FERRY_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// Largest insert body in bytes (413 past it).
    #[arg(long, default_value_t = ApiLimits::default().max_body_bytes)]
    pub max_body_bytes: usize,
    /// Most rows in one insert (413 past it).
    #[arg(long, default_value_t = ApiLimits::default().max_rows)]
    pub max_rows: usize,
    /// Inserts running at once (429 past it).
    #[arg(long, default_value_t = ApiLimits::default().max_concurrent_inserts as u64,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub max_concurrent_inserts: u64,
    /// Seconds an insert waits for its commit before answering 503 (outcome unknown).
    #[arg(long, default_value_t = ApiLimits::default().commit_timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub commit_timeout_secs: u64,
}

impl ApiArgs {
    pub fn limits(&self) -> ApiLimits {
        ApiLimits {
            max_body_bytes: self.max_body_bytes,
            max_rows: self.max_rows,
            max_concurrent_inserts: self.max_concurrent_inserts as usize,
            commit_timeout: Duration::from_secs(self.commit_timeout_secs),
            ..ApiLimits::default()
        }
    }

    pub fn token(&self) -> anyhow::Result<Option<ApiToken>> {
        match self.api_token.as_deref() {
            None | Some("") => Ok(None),
            Some(t) => ApiToken::new(t)
                .map(Some)
                .map_err(|e| anyhow::anyhow!("--api-token / FERRY_API_TOKEN: {e}")),
        }
    }
}
