//! Flow control's policy: what a request is (its [`FlowKey`]: priority, tenant, TTFT objective,
//! token cost) and how the `[flow_control]` section turns that into a class, a weight and an
//! objective ([`FlowPolicy`], swapped whole on reload). The queue that applies it is
//! `admission.rs`; the front ends build the key with `flow::key` (top-level module) (HTTP headers stay there).

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::{ClassOrder, FlowControlConfig, OnMiss};

/// What flow control needs of one request, built by a front end from its headers and API key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowKey {
    /// Higher first; negative = sheddable.
    pub priority: i32,
    /// The fairness key (tenant, API key, session); `None` = the anonymous tenant.
    pub tenant: Option<Arc<str>>,
    /// The request's own TTFT objective (overrides its class's).
    pub slo_ttft_ms: Option<u64>,
    /// What the request costs in the fair share: prompt + expected output tokens.
    pub tokens: u64,
}

impl Default for FlowKey {
    fn default() -> Self {
        FlowKey {
            priority: 0,
            tenant: None,
            slo_ttft_ms: None,
            tokens: 1,
        }
    }
}

/// One priority class (band) as the queue uses it.
#[derive(Debug)]
pub struct Class {
    pub name: Arc<str>,
    pub priority: i32,
    /// Most waiters of this class (`None`: only `admission.queue_size`).
    pub queue_size: Option<usize>,
    pub max_wait_ms: Option<u64>,
    pub ttft_ms: Option<u64>,
    pub on_miss: OnMiss,
    pub order: ClassOrder,
}

impl Class {
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }
}

/// The compiled `[flow_control]` section.
#[derive(Debug)]
pub struct FlowPolicy {
    pub enabled: bool,
    pub default_priority: i32,
    pub expected_output_tokens: u64,
    /// Classes by priority, highest first (never empty).
    pub classes: Vec<Arc<Class>>,
    default_weight: f64,
    /// Listed tenants: weight and metric label.
    tenants: HashMap<Arc<str>, f64>,
    pub objectives: HashMap<String, (i32, Option<u64>)>,
    pub models: HashMap<String, i32>,
    /// Worker kinds whose bodies get `priority` (lower-case kind names).
    pub forward_priority: Vec<String>,
    pub bypass_busy_priority: Option<i32>,
}

/// The `tenant` label of tenants not listed in `flow_control.tenants` (bounded cardinality).
pub const OTHER_TENANT: &str = "other";
/// The `tenant` label of requests without a fairness key.
pub const NO_TENANT: &str = "none";

/// The two fixed labels, allocated once: every request without a fairness key takes `none`.
static NO_TENANT_LABEL: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| NO_TENANT.into());
static OTHER_TENANT_LABEL: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| OTHER_TENANT.into());

impl Default for FlowPolicy {
    fn default() -> Self {
        FlowPolicy::new(&FlowControlConfig::default())
    }
}

impl FlowPolicy {
    pub fn new(cfg: &FlowControlConfig) -> FlowPolicy {
        let mut classes: Vec<Arc<Class>> = if cfg.classes.is_empty() {
            [("default", 0), ("sheddable", -1)]
                .into_iter()
                .map(|(name, priority)| {
                    Arc::new(Class {
                        name: name.into(),
                        priority,
                        // As a configured class: sheddable ones do not queue.
                        queue_size: (priority < 0).then_some(0),
                        max_wait_ms: None,
                        ttft_ms: None,
                        on_miss: OnMiss::BestEffort,
                        order: ClassOrder::Fair,
                    })
                })
                .collect()
        } else {
            cfg.classes
                .iter()
                .map(|c| {
                    Arc::new(Class {
                        name: c.name.as_str().into(),
                        priority: c.priority,
                        queue_size: c.queue_size.or(if c.priority < 0 { Some(0) } else { None }),
                        max_wait_ms: c.max_wait_ms,
                        ttft_ms: c.ttft_ms,
                        on_miss: c.on_miss,
                        order: c.order,
                    })
                })
                .collect()
        };
        classes.sort_by_key(|c| std::cmp::Reverse(c.priority));
        FlowPolicy {
            enabled: cfg.enabled,
            default_priority: cfg.default_priority,
            expected_output_tokens: cfg.expected_output_tokens,
            classes,
            default_weight: cfg.default_weight,
            tenants: cfg
                .tenants
                .iter()
                .map(|(t, w)| (Arc::from(t.as_str()), *w))
                .collect(),
            objectives: cfg
                .objectives
                .iter()
                .map(|(n, o)| (n.clone(), (o.priority, o.ttft_ms)))
                .collect(),
            models: cfg.models.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            forward_priority: cfg
                .forward_priority
                .iter()
                .map(|k| k.to_ascii_lowercase())
                .collect(),
            bypass_busy_priority: cfg.bypass_busy_priority,
        }
    }

    /// The class of a request of priority `p`: the highest band not above it, else the lowest.
    pub fn class(&self, p: i32) -> &Arc<Class> {
        self.classes
            .iter()
            .find(|c| c.priority <= p)
            .unwrap_or_else(|| self.classes.last().expect("at least one class"))
    }

    /// A tenant's weight in its class's fair share.
    pub fn weight(&self, tenant: Option<&str>) -> f64 {
        tenant
            .and_then(|t| self.tenants.get(t))
            .copied()
            .unwrap_or(self.default_weight)
    }

    /// A tenant's metric label: its name when listed in `flow_control.tenants`, else `other`
    /// (`none` without a fairness key).
    pub fn tenant_label(&self, tenant: Option<&str>) -> Arc<str> {
        match tenant {
            None => NO_TENANT_LABEL.clone(),
            Some(t) => match self.tenants.get_key_value(t) {
                Some((k, _)) => k.clone(),
                None => OTHER_TENANT_LABEL.clone(),
            },
        }
    }

    /// The TTFT objective of a request: its own, else its class's.
    pub fn objective(&self, key: &FlowKey, class: &Class) -> Option<u64> {
        key.slo_ttft_ms.or(class.ttft_ms)
    }

    /// The token cost of a request: `isl` prompt tokens and at most `max_tokens` output tokens,
    /// charged `expected_output_tokens` of output at most.
    pub fn cost(&self, isl: u64, max_tokens: Option<u64>) -> u64 {
        let out = max_tokens.map_or(self.expected_output_tokens, |m| {
            m.min(self.expected_output_tokens)
        });
        isl.saturating_add(out).max(1)
    }

    /// Whether a worker of `kind` (lower-case) gets the class priority in the body.
    pub fn forwards_to(&self, kind: &str) -> bool {
        self.enabled && self.forward_priority.iter().any(|k| k == kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FlowClassConfig, FlowControlConfig};

    fn class(name: &str, priority: i32) -> FlowClassConfig {
        FlowClassConfig {
            name: name.into(),
            priority,
            queue_size: None,
            max_wait_ms: None,
            ttft_ms: None,
            on_miss: OnMiss::BestEffort,
            order: ClassOrder::Fair,
        }
    }

    #[test]
    fn a_priority_joins_the_highest_band_not_above_it() {
        let cfg = FlowControlConfig {
            classes: vec![
                class("batch", 0),
                class("interactive", 10),
                class("sheddable", -5),
            ],
            ..Default::default()
        };
        let p = FlowPolicy::new(&cfg);
        assert_eq!(&*p.class(10).name, "interactive");
        assert_eq!(&*p.class(99).name, "interactive");
        assert_eq!(&*p.class(9).name, "batch");
        assert_eq!(&*p.class(-1).name, "sheddable");
        assert_eq!(&*p.class(-100).name, "sheddable", "below all: the lowest");
        assert_eq!(p.class(-5).queue_size, Some(0), "sheddable: shed when full");
        assert_eq!(p.class(0).queue_size, None);
    }

    #[test]
    fn the_builtin_classes_make_negative_priorities_sheddable() {
        let p = FlowPolicy::default();
        assert_eq!(&*p.class(0).name, "default");
        assert!(p.class(-1).sheddable());
        assert_eq!(p.class(-1).queue_size, Some(0), "shed at once when full");
        assert_eq!(p.class(0).queue_size, None);
        assert!(!p.class(3).sheddable());
    }

    #[test]
    fn labels_and_weights_of_tenants() {
        let mut cfg = FlowControlConfig::default();
        cfg.tenants.insert("a".into(), 2.0);
        let p = FlowPolicy::new(&cfg);
        assert_eq!(p.weight(Some("a")), 2.0);
        assert_eq!(p.weight(Some("zzz")), 1.0);
        assert_eq!(&*p.tenant_label(Some("a")), "a");
        assert_eq!(&*p.tenant_label(Some("user-123")), OTHER_TENANT);
        assert_eq!(&*p.tenant_label(None), NO_TENANT);
        assert_eq!(p.cost(100, None), 356);
        assert_eq!(p.cost(100, Some(10)), 110);
    }
}
