//! A Rust client of ferry's HTTP API: what `ferry table`, `ferry insert` and the
//! tests use.
//!
//! Retries: [`Client::insert_with_retry`] sends an insert again, with the same
//! idempotency key, when its outcome is unknown (503 `outcome_unknown`, a lost
//! connection, a timeout) or when it was refused for now (503 `overloaded`, 429).
//! With a key, replicas apply a retried insert whose first attempt did commit
//! only once; without one, a retry may apply it twice (at-least-once). A key is
//! bound to its rows: a retry the node knows committed is answered with
//! [`Inserted::deduplicated`] set and writes nothing; the same key with other
//! rows is refused (409, [`ClientError::key_reused`]); a retry while the first
//! request is still being written (409 `idempotency_key_in_flight`) is retried.

use std::time::Duration;

use arrow::array::RecordBatch;
use bytes::Bytes;
use ferry_table::{Format, Table, TableDef};
use serde::{Deserialize, Serialize};

/// What a committed insert answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inserted {
    pub rows: u64,
    pub blocks: Vec<u64>,
    pub commit_lsn: String,
    /// The insert had committed before under its idempotency key: nothing was
    /// written by this request (absent from older nodes: false).
    #[serde(default)]
    pub deduplicated: bool,
}

/// An error the API answered, as it answered it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiErrorBody {
    pub kind: String,
    pub error: String,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub row: Option<u64>,
    #[serde(default)]
    pub column: Option<String>,
    #[serde(default)]
    pub field: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{status}: {}", body.error)]
    Api {
        status: u16,
        body: Box<ApiErrorBody>,
    },
    /// The request may or may not have reached the server.
    #[error("request to {url} failed: {detail}")]
    Transport { url: String, detail: String },
    #[error("invalid answer from {url}: {detail}")]
    BadAnswer { url: String, detail: String },
    #[error("invalid client setting: {0}")]
    Config(String),
    #[error("encoding rows: {0}")]
    Encode(String),
}

impl ClientError {
    /// Whether sending the same request again (with the same idempotency key)
    /// is the right answer to this error.
    pub fn retryable(&self) -> bool {
        match self {
            ClientError::Transport { .. } => true,
            ClientError::Api { status, body } => {
                *status == 429
                    || (*status == 409 && body.kind == "idempotency_key_in_flight")
                    || (*status == 503
                        && matches!(
                            body.kind.as_str(),
                            "outcome_unknown" | "overloaded" | "coordination" | "lake_upkeep"
                        ))
            }
            _ => false,
        }
    }
}

impl ClientError {
    /// Whether the node refused the insert because its idempotency key was
    /// used before with other rows (409 `idempotency_key_reused`): nothing of
    /// it was written, and sending it again will not change that.
    pub fn key_reused(&self) -> bool {
        matches!(self, ClientError::Api { status: 409, body } if body.kind == "idempotency_key_reused")
    }
}

/// How [`Client::insert_with_retry`] retries.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Attempts in all (the first included).
    pub attempts: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            attempts: 10,
            first_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
        }
    }
}

/// A client of one ferry node.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    http: reqwest::Client,
    token: Option<String>,
}

impl Client {
    /// `base` is the node's HTTP address (`http://127.0.0.1:7878`); `timeout`
    /// bounds every request.
    pub fn new(
        base: &str,
        token: Option<String>,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        let base = base.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ClientError::Config(format!(
                "{base:?} is not an http:// or https:// URL"
            )));
        }
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| ClientError::Config(e.to_string()))?;
        Ok(Client { base, http, token })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    async fn send<T: serde::de::DeserializeOwned>(
        &self,
        builder: reqwest::RequestBuilder,
    ) -> Result<(u16, T), ClientError> {
        let url = self.base.clone();
        let response = builder.send().await.map_err(|e| ClientError::Transport {
            url: url.clone(),
            detail: error_chain(&e),
        })?;
        let status = response.status().as_u16();
        let bytes = response.bytes().await.map_err(|e| ClientError::Transport {
            url: url.clone(),
            detail: error_chain(&e),
        })?;
        if (200..300).contains(&status) {
            serde_json::from_slice(&bytes)
                .map(|v| (status, v))
                .map_err(|e| ClientError::BadAnswer {
                    url,
                    detail: e.to_string(),
                })
        } else {
            let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| ApiErrorBody {
                kind: "http".into(),
                error: String::from_utf8_lossy(&bytes).into_owned(),
                reason: None,
                row: None,
                column: None,
                field: None,
            });
            Err(ClientError::Api {
                status,
                body: Box::new(body),
            })
        }
    }

    /// POSTs `body` as JSON to `path` and decodes the JSON answer.
    pub async fn post_json<B: serde::Serialize, T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let (_, v) = self
            .send(self.request(reqwest::Method::POST, path).json(body))
            .await?;
        Ok(v)
    }

    /// GETs `path` and decodes the JSON answer.
    pub async fn get_typed<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<T, ClientError> {
        let (_, v) = self.send(self.request(reqwest::Method::GET, path)).await?;
        Ok(v)
    }

    /// Creates a table (TOML definition); returns it and whether it was new.
    pub async fn create_table_toml(&self, toml: &str) -> Result<(Table, bool), ClientError> {
        let (status, table) = self
            .send(
                self.request(reqwest::Method::POST, "/tables")
                    .header("content-type", "application/toml")
                    .body(toml.to_string()),
            )
            .await?;
        Ok((table, status == 201))
    }

    /// Creates a table; returns it and whether it was new.
    pub async fn create_table(&self, def: &TableDef) -> Result<(Table, bool), ClientError> {
        let (status, table) = self
            .send(self.request(reqwest::Method::POST, "/tables").json(def))
            .await?;
        Ok((table, status == 201))
    }

    pub async fn tables(&self) -> Result<Vec<Table>, ClientError> {
        Ok(self
            .send(self.request(reqwest::Method::GET, "/tables"))
            .await?
            .1)
    }

    pub async fn table(&self, name: &str) -> Result<Table, ClientError> {
        let path = format!("/tables/{}", path_segment(name)?);
        Ok(self
            .send(self.request(reqwest::Method::GET, &path))
            .await?
            .1)
    }

    /// Replaces a table's `[export]` section (`export` is its JSON form, as
    /// in a definition; `null` removes it).
    pub async fn set_export(
        &self,
        name: &str,
        export: &serde_json::Value,
    ) -> Result<Table, ClientError> {
        let path = format!("/tables/{}", path_segment(name)?);
        Ok(self
            .send(
                self.request(reqwest::Method::PATCH, &path)
                    .json(&serde_json::json!({ "export": export })),
            )
            .await?
            .1)
    }

    pub async fn drop_table(&self, name: &str) -> Result<Table, ClientError> {
        let path = format!("/tables/{}", path_segment(name)?);
        Ok(self
            .send(self.request(reqwest::Method::DELETE, &path))
            .await?
            .1)
    }

    /// A GET of the read API, as JSON (`path` and query built by the caller
    /// from validated names).
    pub async fn get_json(&self, path_and_query: &str) -> Result<serde_json::Value, ClientError> {
        Ok(self
            .send(self.request(reqwest::Method::GET, path_and_query))
            .await?
            .1)
    }

    /// Merges decided and not yet run, summed over the node's replicas
    /// (`GET /replicas`): zero once the background merges settled.
    pub async fn pending_merges(&self) -> Result<u64, ClientError> {
        let replicas = self.get_json("/replicas").await?;
        Ok(replicas
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| r["pending_merges"].as_u64().unwrap_or(0))
            .sum())
    }

    /// Rows of a table, or of one partition, on replica `replica`, once it
    /// applied `min_lsn` (an insert's `commit_lsn`) if given.
    pub async fn count(
        &self,
        table: &str,
        partition: Option<&str>,
        replica: usize,
        min_lsn: Option<&str>,
    ) -> Result<u64, ClientError> {
        let mut q = format!("/tables/{}/count?replica={replica}", path_segment(table)?);
        if let Some(p) = partition {
            q += &format!("&partition={}", query_value(p)?);
        }
        if let Some(l) = min_lsn {
            q += &format!("&min_lsn={}", query_value(l)?);
        }
        let v = self.get_json(&q).await?;
        v["rows"].as_u64().ok_or_else(|| ClientError::BadAnswer {
            url: self.base.clone(),
            detail: format!("no row count in {v}"),
        })
    }

    /// The partitions of a table on replica `replica`, with their parts.
    pub async fn partitions(
        &self,
        table: &str,
        replica: usize,
    ) -> Result<serde_json::Value, ClientError> {
        self.get_json(&format!(
            "/tables/{}/partitions?replica={replica}",
            path_segment(table)?
        ))
        .await
    }

    /// One insert of a body in `format`, sent once.
    pub async fn insert_body(
        &self,
        table: &str,
        format: Format,
        body: Bytes,
        idempotency_key: Option<&str>,
    ) -> Result<Inserted, ClientError> {
        let path = format!("/tables/{}/insert", path_segment(table)?);
        let mut r = self
            .request(reqwest::Method::POST, &path)
            .header("content-type", format.content_type())
            .body(body);
        if let Some(key) = idempotency_key {
            r = r.header("idempotency-key", key);
        }
        Ok(self.send(r).await?.1)
    }

    /// Inserts a batch (sent as Arrow IPC).
    pub async fn insert_batch(
        &self,
        table: &str,
        batch: &RecordBatch,
        idempotency_key: Option<&str>,
    ) -> Result<Inserted, ClientError> {
        let body =
            ferry_table::rows::to_ipc(batch).map_err(|e| ClientError::Encode(e.to_string()))?;
        self.insert_body(table, Format::Arrow, body, idempotency_key)
            .await
    }

    /// [`Client::insert_body`], sent again with the same key while the error is
    /// [retryable](ClientError::retryable), with exponential back-off; `on_retry`
    /// hears of every retry. Without a key a retry may apply the rows twice.
    pub async fn insert_with_retry(
        &self,
        table: &str,
        format: Format,
        body: Bytes,
        idempotency_key: Option<&str>,
        policy: &RetryPolicy,
        mut on_retry: impl FnMut(u32, &ClientError),
    ) -> Result<Inserted, ClientError> {
        let mut backoff = policy.first_backoff;
        let mut attempt = 1;
        loop {
            match self
                .insert_body(table, format, body.clone(), idempotency_key)
                .await
            {
                Err(e) if e.retryable() && attempt < policy.attempts => {
                    on_retry(attempt, &e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(policy.max_backoff);
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}

/// A table name as a URL path segment: only valid names are sent, so nothing
/// needs escaping and nothing can reach another route.
fn path_segment(name: &str) -> Result<&str, ClientError> {
    if ferry_table::def::valid_name(name) {
        Ok(name)
    } else {
        Err(ClientError::Config(format!(
            "{name:?} is not a valid table name ([A-Za-z_][A-Za-z0-9_]{{0,63}})"
        )))
    }
}

/// A query value ferry accepts as it is: partition ids and LSNs only use
/// characters that need no escaping.
fn query_value(v: &str) -> Result<&str, ClientError> {
    if !v.is_empty()
        && v.len() <= 64
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'/'))
    {
        Ok(v)
    } else {
        Err(ClientError::Config(format!(
            "{v:?} is not a partition id or LSN"
        )))
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out += ": ";
        out += &s.to_string();
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(status: u16, kind: &str) -> ClientError {
        ClientError::Api {
            status,
            body: Box::new(ApiErrorBody {
                kind: kind.into(),
                error: String::new(),
                reason: None,
                row: None,
                column: None,
                field: None,
            }),
        }
    }

    #[test]
    fn only_answers_that_promise_nothing_was_decided_are_retried() {
        for kind in [
            "outcome_unknown",
            "overloaded",
            "coordination",
            "lake_upkeep",
        ] {
            assert!(api(503, kind).retryable(), "503 {kind}");
        }
        assert!(api(429, "too_many_requests").retryable());
        assert!(api(409, "idempotency_key_in_flight").retryable());
        assert!(!api(409, "idempotency_key_reused").retryable());
        assert!(!api(400, "bad_row").retryable());
        assert!(!api(503, "disk_failed").retryable());
    }
}
