//! kvgate-fleet: worker registry, load scrapers, KV-event subscribers, health and breakers.
#![forbid(unsafe_code)]
