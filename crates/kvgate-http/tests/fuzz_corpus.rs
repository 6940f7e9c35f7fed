//! Every file of the checked-in fuzz corpus (`fuzz/corpus/<target>/`) through the same invariant
//! functions the fuzz targets run, so the normal test run covers the corpus without a fuzzer.

use std::path::PathBuf;

fn replay(target: &str, check: fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("corpus entry").path();
        let data = std::fs::read(&path).expect("corpus file");
        let r = std::panic::catch_unwind(|| check(&data));
        assert!(r.is_ok(), "{} breaks an invariant", path.display());
        n += 1;
    }
    assert!(n >= 10, "{target}: only {n} corpus files");
}

#[test]
fn request_head_corpus() {
    replay("request_head", kvgate_http::fuzz::request_head);
}

#[test]
fn response_head_corpus() {
    replay("response_head", kvgate_http::fuzz::response_head);
}

#[test]
fn chunked_corpus() {
    replay("chunked", kvgate_http::fuzz::chunked);
}
