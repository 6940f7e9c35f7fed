//! Every file of the checked-in fuzz corpus `fuzz/corpus/request_body/` through the fuzz
//! target's invariant function, so the normal test run covers the corpus without a fuzzer.

#[test]
fn request_body_corpus() {
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/request_body");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("corpus entry").path();
        let data = std::fs::read(&path).expect("corpus file");
        let r = std::panic::catch_unwind(|| kvgate_protocol::fuzz::request_body(&data));
        assert!(r.is_ok(), "{} breaks an invariant", path.display());
        n += 1;
    }
    assert!(n >= 10, "only {n} corpus files");
}
