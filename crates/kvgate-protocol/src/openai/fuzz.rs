//! The fuzz target's entry point for the request body reader (`fuzz/`, and the corpus replay
//! test `tests/fuzz_corpus.rs`): arbitrary bytes through [`RequestView::parse`], panicking if an
//! invariant breaks. Not an API.
//!
//! Invariants: no panic; whenever the one-pass reader answers, serde's twin answers the same
//! (with and without messages); a parsed view's prompt and messages read without panicking, and
//! `stream_options.include_usage` spliced into the body gives a body that parses with it set.

use super::{fast, request::serde_fields, splice_include_usage, RequestView};

/// One body through both readers and the view.
pub fn request_body(data: &[u8]) {
    if let Ok(body) = std::str::from_utf8(data) {
        for with_messages in [true, false] {
            if let Some(f) = fast::fields(body, with_messages) {
                let slow = serde_fields(body, with_messages);
                match slow {
                    Ok(s) => assert_eq!(format!("{f:?}"), format!("{s:?}"), "{body:?}"),
                    Err(e) => panic!("fast reader read {body:?}, serde refused: {e}"),
                }
            }
        }
    }
    if let Ok(v) = RequestView::parse(data) {
        let _ = v.prompt_input();
        let _ = v.messages();
        let _ = v.messages_raw();
        if let Some(out) = splice_include_usage(data, &v) {
            let again = RequestView::parse(&out).expect("a spliced body parses");
            assert!(again.include_usage, "splice lost include_usage");
            assert_eq!(again.model, v.model);
        }
    }
}
