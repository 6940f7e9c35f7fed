//! Ollama `/api/ps`: which models are resident. Ollama exposes no queue figures, so running and
//! waiting stay unknown and the router uses its own accounting for this worker.

use serde::Deserialize;

use super::ParseError;
use crate::sink::ScrapedLoad;

#[derive(Deserialize)]
struct Ps {
    #[serde(default)]
    models: Vec<Model>,
}

#[derive(Deserialize)]
struct Model {
    name: String,
}

pub fn parse_ps(body: &[u8]) -> Result<ScrapedLoad, ParseError> {
    let ps: Ps = serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    Ok(ScrapedLoad {
        loaded_models: ps.models.into_iter().map(|m| m.name).collect(),
        ..ScrapedLoad::default()
    })
}
