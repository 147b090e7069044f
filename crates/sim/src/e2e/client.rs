//! The client: inserts as NDJSON over HTTP to the current writer's
//! endpoint (as a load balancer in front of the writers routes them), each
//! with an idempotency key, and what each answer means for what the lake
//! may hold:
//! * 200: acknowledged, so in the lake exactly once;
//! * 4xx (a reused key, a key in flight): refused, nothing written, so its
//!   rows are never in the lake (a key in flight is retried later);
//! * 503, a broken connection, a timeout: unknown; retried with the same
//!   key later, or given up (then in the lake at most once).

use std::time::Duration;

use bytes::Bytes;
use ferry_node::http::{HttpPeers, Method, StatusCode};
use rand::Rng;

use super::nodes::writer_http;
use super::{partition_of, Sim, TABLE};

/// How long the client waits for an answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Of the inserts of unknown outcome, the share the client gives up.
const GIVE_UP: f64 = 0.2;

/// An insert as the client sent it.
#[derive(Debug, Clone)]
pub(super) struct Sent {
    pub(super) key: String,
    pub(super) ids: Vec<i64>,
    /// The same key with other rows (never acknowledged as new rows while
    /// the writer remembers the key).
    pub(super) reuse_of: Option<String>,
}

/// What one request got.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) sent: Sent,
    pub(super) outcome: Result<(StatusCode, String), String>,
}

impl Sim {
    /// One HTTP call to the current writer's endpoint from the client.
    pub(super) async fn http_call(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        headers: &[(&'static str, String)],
        body: Bytes,
    ) -> Result<(StatusCode, Bytes), String> {
        let Some(w) = self.writers.last() else {
            return Err("no writer runs".into());
        };
        HttpPeers::new(self.world.net.node("client"), None)
            .request(
                &writer_http(w.number),
                method,
                path,
                content_type,
                headers,
                body,
                CLIENT_TIMEOUT,
            )
            .await
            .map_err(|e| e.to_string())
    }

    /// A new insert of `rows` rows with a key of its own.
    pub(super) fn insert(&mut self, rows: usize) {
        let ids: Vec<i64> = (self.next_id..self.next_id + rows as i64).collect();
        self.next_id += rows as i64;
        let key = format!("k{}", self.next_request);
        self.next_request += 1;
        let sent = Sent {
            key: key.clone(),
            ids,
            reuse_of: None,
        };
        self.sent.insert(key, sent.clone());
        self.send(sent);
    }

    /// A key the client sent with its own rows and was answered 200 for,
    /// drawn at random.
    fn pick_acked(&mut self) -> Option<Sent> {
        let keys: Vec<&String> = self
            .acked
            .keys()
            .filter(|k| self.sent.contains_key(*k))
            .collect();
        if keys.is_empty() {
            return None;
        }
        let pick = self.client_rng.random_range(0..keys.len());
        self.sent.get(keys[pick]).cloned()
    }

    /// An acknowledged key sent again with `rows` other rows.
    pub(super) fn reuse_key(&mut self, rows: usize) {
        let Some(of) = self.pick_acked() else {
            return;
        };
        let ids: Vec<i64> = (self.next_id..self.next_id + rows as i64).collect();
        self.next_id += rows as i64;
        self.log(format!("key {} reused for ids {ids:?}", of.key));
        self.send(Sent {
            key: of.key.clone(),
            ids,
            reuse_of: Some(of.key),
        });
    }

    /// An acknowledged insert sent again, as it was.
    pub(super) fn retry_acked(&mut self) {
        if let Some(sent) = self.pick_acked() {
            self.log(format!("retry of {}", sent.key));
            self.send(sent);
        }
    }

    pub(super) fn send(&mut self, sent: Sent) {
        let body: String = sent
            .ids
            .iter()
            .map(|id| {
                format!(
                    "{{\"id\":{id},\"p\":\"{}\",\"pad\":\"{id:0>200}\"}}\n",
                    partition_of(*id)
                )
            })
            .collect();
        let Some(w) = self.writers.last() else {
            // No writer: the client's connection is refused.
            let _ = self.results.0.send(Answer {
                sent,
                outcome: Err("no writer runs".into()),
            });
            self.in_flight += 1;
            return;
        };
        let addr = writer_http(w.number);
        let peers = HttpPeers::new(self.world.net.node("client"), None);
        let tx = self.results.0.clone();
        self.in_flight += 1;
        tokio::spawn(async move {
            let outcome = peers
                .request(
                    &addr,
                    Method::POST,
                    &format!("/tables/{TABLE}/insert"),
                    "application/x-ndjson",
                    &[("idempotency-key", sent.key.clone())],
                    Bytes::from(body),
                    CLIENT_TIMEOUT,
                )
                .await
                .map(|(status, bytes)| (status, String::from_utf8_lossy(&bytes).into_owned()))
                .map_err(|e| e.to_string());
            let _ = tx.send(Answer { sent, outcome });
        });
    }

    /// Takes in the answers that came: acknowledged, refused, or unknown
    /// (retried later, or given up unless `retry_all`). Returns the
    /// requests to send again.
    pub(super) fn collect_answers(&mut self, retry_all: bool) -> Vec<Sent> {
        let mut again = Vec::new();
        while let Ok(Answer { sent, outcome }) = self.results.1.try_recv() {
            self.in_flight -= 1;
            match outcome {
                Ok((status, _)) if status.is_success() => {
                    if let Some(of) = &sent.reuse_of {
                        // Acknowledged as new rows: the writer that
                        // remembered the key is gone (the key index lives
                        // in memory), so the rows are new rows.
                        self.log(format!("reuse of {of} acknowledged as new rows"));
                    }
                    // A reuse acknowledged is an insert of its own.
                    let key = match sent.reuse_of {
                        Some(_) => format!("{}~{}", sent.key, sent.ids.first().unwrap_or(&0)),
                        None => sent.key.clone(),
                    };
                    self.acked.entry(key).or_insert(sent.ids);
                }
                Ok((status, body))
                    if status.is_client_error() && body.contains("idempotency_key_in_flight") =>
                {
                    again.push(sent);
                }
                Ok((status, body)) if status.is_client_error() => {
                    self.log(format!("{} refused: {status} {body}", sent.key));
                    self.refused.extend(sent.ids.iter().copied());
                }
                Ok(_) | Err(_) => {
                    if !retry_all && self.client_rng.random_bool(GIVE_UP) {
                        self.log(format!("{} given up after an unknown outcome", sent.key));
                        self.given_up.extend(sent.ids.iter().copied());
                    } else {
                        again.push(sent);
                    }
                }
            }
        }
        again
    }
}
