//! S3 connection settings, given as data (the `AWS_*` variables included,
//! read by the binary), kept out of logs, and applied to the S3 store's
//! builder.

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};

/// S3 connection settings. Anything left `None` comes from the AWS
/// variables in `aws_env` (`AWS_ENDPOINT_URL`, `AWS_REGION`,
/// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, the
/// web-identity and container credential variables, ...): the binary reads
/// the process environment once, at its edge ([`S3Settings::with_aws_env`]),
/// so this library never does and a test states all it uses.
#[derive(Clone, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct S3Settings {
    /// Endpoint of an S3-compatible server, e.g. `http://127.0.0.1:9000`; path-style
    /// requests are used when it is set.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    /// `AWS_*` variables (name, value), applied as `object_store` reads them.
    #[serde(skip)]
    pub aws_env: Vec<(String, String)>,
}

impl S3Settings {
    /// Adds the `AWS_*` variables among `vars` (the process environment,
    /// read by the binary).
    pub fn with_aws_env(mut self, vars: impl IntoIterator<Item = (String, String)>) -> Self {
        self.aws_env
            .extend(vars.into_iter().filter(|(k, _)| k.starts_with("AWS_")));
        self
    }

    fn aws_var(&self, name: &str) -> Option<&str> {
        self.aws_env
            .iter()
            .find(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.as_str())
    }

    /// The S3 store builder for `bucket` with these settings: the `AWS_*`
    /// variables first, then the settings given, which win over them.
    pub(crate) fn builder(&self, bucket: &str) -> AmazonS3Builder {
        // Every upload carries its SHA-256 (`x-amz-checksum-sha256`, per
        // part for multipart uploads): S3 refuses bytes that changed on
        // the way, and stores the checksum with the object.
        let mut builder = AmazonS3Builder::new();
        for (name, value) in &self.aws_env {
            if let Ok(key) = name.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                builder = builder.with_config(key, value);
            }
        }
        let mut builder = builder
            .with_bucket_name(bucket)
            .with_checksum_algorithm(object_store::aws::Checksum::SHA256);
        if let Some(endpoint) = &self.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"));
        } else if let Some(endpoint) = ["AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
            .iter()
            .find_map(|k| self.aws_var(k))
        {
            // Both names set the endpoint (object_store reads them);
            // plain HTTP is allowed only for an endpoint that says so.
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"));
        }
        if let Some(region) = &self.region {
            builder = builder.with_region(region);
        }
        if let Some(key) = &self.access_key_id {
            builder = builder.with_access_key_id(key);
        }
        if let Some(secret) = &self.secret_access_key {
            builder = builder.with_secret_access_key(secret);
        }
        if let Some(token) = &self.session_token {
            builder = builder.with_token(token);
        }
        builder
    }
}

/// Secrets stay out of logs and error messages.
impl std::fmt::Debug for S3Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |v: &Option<String>| v.as_ref().map(|_| "<set>");
        f.debug_struct("S3Settings")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &redact(&self.access_key_id))
            .field("secret_access_key", &redact(&self.secret_access_key))
            .field("session_token", &redact(&self.session_token))
            .field(
                "aws_env",
                &self.aws_env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::open;

    #[test]
    fn s3_settings_take_aws_variables_as_data_and_hide_secrets() {
        let s3 = S3Settings::default().with_aws_env([
            (
                "AWS_ENDPOINT_URL".to_string(),
                "http://127.0.0.1:1".to_string(),
            ),
            ("AWS_SECRET_ACCESS_KEY".to_string(), "hunter2".to_string()),
            ("AWS_ACCESS_KEY_ID".to_string(), "key".to_string()),
            ("HOME".to_string(), "/root".to_string()),
        ]);
        assert_eq!(s3.aws_env.len(), 3, "only AWS_ variables: {s3:?}");
        assert_eq!(s3.aws_var("AWS_ENDPOINT_URL"), Some("http://127.0.0.1:1"));
        let shown = format!("{s3:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        let with_key = S3Settings {
            secret_access_key: Some("hunter3".into()),
            ..S3Settings::default()
        };
        assert!(!format!("{with_key:?}").contains("hunter3"));
        // The credentials come from the variables (without them the store
        // refuses to open: MissingAccessKeyId).
        open("s3://bucket/p", &s3).expect("open with credentials from the variables");
        assert!(open("s3://bucket/p", &with_key).is_err());
    }
}
