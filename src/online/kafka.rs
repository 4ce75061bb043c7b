//! Kafka plumbing shared by `consume`, `produce` and `demo`: client
//! settings, the embedded mock cluster and topic creation.

use rdkafka::config::ClientConfig;
use rdkafka::mocking::MockCluster;

use crate::error::KafkaError;

/// Wraps a librdkafka error with context.
pub fn client_err(
    context: impl Into<String>,
) -> impl FnOnce(rdkafka::error::KafkaError) -> KafkaError {
    let context = context.into();
    move |source| KafkaError::Client { context, source }
}

/// Parses `-X key=value` settings.
pub fn parse_settings(settings: &[String]) -> Result<Vec<(String, String)>, KafkaError> {
    settings
        .iter()
        .map(|s| {
            s.split_once('=')
                .filter(|(k, _)| !k.trim().is_empty())
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .ok_or_else(|| {
                    // The text may be a secret: say what is wrong, not what it is.
                    KafkaError::BadSetting(match s.split_once('=') {
                        Some(_) => "a setting with an empty key".to_string(),
                        None => {
                            format!("a setting of {} characters with no `=`", s.chars().count())
                        }
                    })
                })
        })
        .collect()
}

/// A client configuration for `brokers` with extra settings applied last.
pub fn client_config(brokers: &str, settings: &[(String, String)]) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    for (k, v) in settings {
        c.set(k, v);
    }
    c
}

/// A producer configuration: [`client_config`] with the Java client's
/// partitioner (murmur2), so a caller's events land in the same partition
/// whichever client produced them, then the caller's `defaults`, then the
/// user's `settings`, which win over both.
pub fn producer_config(
    brokers: &str,
    defaults: &[(&str, &str)],
    settings: &[(String, String)],
) -> ClientConfig {
    let mut c = client_config(brokers, &[]);
    c.set("partitioner", "murmur2_random");
    for (k, v) in defaults {
        c.set(*k, *v);
    }
    for (k, v) in settings {
        c.set(k, v);
    }
    c
}

/// librdkafka's in-process mock cluster: the embedded default broker.
pub struct EmbeddedKafka {
    cluster: MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
}

impl EmbeddedKafka {
    /// Starts a one-broker mock cluster.
    pub fn start() -> Result<Self, KafkaError> {
        let cluster =
            MockCluster::new(1).map_err(client_err("starting the embedded Kafka mock cluster"))?;
        Ok(EmbeddedKafka { cluster })
    }

    /// Its bootstrap servers.
    pub fn bootstrap(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    /// Creates a topic.
    pub fn create_topic(&self, name: &str, partitions: i32) -> Result<(), KafkaError> {
        self.cluster
            .create_topic(name, partitions, 1)
            .map_err(client_err(format!("creating topic {name}")))
    }
}
