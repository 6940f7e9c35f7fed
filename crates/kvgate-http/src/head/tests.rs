use super::*;

/// The shortcut for common field names gives exactly what `HeaderName::from_bytes` gives, for
/// those names in any case, near misses, other names and invalid ones.
#[test]
fn header_name_matches_the_general_parse() {
    let mut names: Vec<Vec<u8>> = Vec::new();
    for n in [
        "host",
        "date",
        "accept",
        "server",
        "user-agent",
        "connection",
        "content-type",
        "authorization",
        "content-length",
        "accept-encoding",
    ] {
        names.push(n.as_bytes().to_vec());
        names.push(n.to_ascii_uppercase().into_bytes());
        let mut mixed = n.as_bytes().to_vec();
        mixed[0] = mixed[0].to_ascii_uppercase();
        names.push(mixed.clone());
        // Same length, one byte off (last byte changed, a space inside, a non-ASCII byte).
        let mut off = n.as_bytes().to_vec();
        *off.last_mut().unwrap() ^= 1;
        names.push(off);
        let mut sp = n.as_bytes().to_vec();
        sp[1] = b' ';
        names.push(sp);
        let mut hi = n.as_bytes().to_vec();
        hi[0] = 0xC3;
        names.push(hi);
    }
    for n in [
        "x-request-id",
        "X-Stainless-Lang",
        "hosts",
        "",
        "content_type",
        "te",
        "a\r\nb",
    ] {
        names.push(n.as_bytes().to_vec());
    }
    for n in &names {
        let want = HeaderName::from_bytes(n);
        let got = header_name(n);
        match (&want, &got) {
            (Ok(w), Ok(g)) => {
                assert_eq!(w, g, "{:?}", String::from_utf8_lossy(n));
                assert_eq!(w.as_str(), g.as_str());
            }
            (Err(_), Err(_)) => {}
            _ => panic!("{:?}: {want:?} vs {got:?}", String::from_utf8_lossy(n)),
        }
    }
}

/// The one-number shortcut of `parse_len` gives what the general comma-list reader gives.
#[test]
fn parse_len_shortcut_matches_the_list_reader() {
    let mut values: Vec<String> = vec![
        String::new(),
        " 5".into(),
        "5 ".into(),
        "5,5".into(),
        "+5".into(),
        "-5".into(),
        "5a".into(),
        "0x5".into(),
        "18446744073709551615".into(),
        "18446744073709551616".into(),
    ];
    for len in 1..=21 {
        values.push("9".repeat(len));
        values.push(format!("1{}", "0".repeat(len - 1)));
        values.push("0".repeat(len));
        values.push(format!("{}7", "0".repeat(len - 1)));
    }
    for v in &values {
        assert_eq!(
            parse_len(v.as_bytes()),
            parse_len_list(v.as_bytes()),
            "{v:?}"
        );
    }
    assert_eq!(parse_len(b"1234"), Some(1234));
    assert_eq!(
        parse_len(b"9999999999999999999"),
        Some(9_999_999_999_999_999_999)
    );
    assert_eq!(parse_len(b"99999999999999999999"), None);
}

/// The word-at-a-time compare is exactly `eq_ignore_ascii_case` against the lowercase name,
/// for every name it is used with, with every byte of every position replaced by every value
/// (one at a time), in lower and upper case.
#[test]
fn eq_lower_is_a_case_insensitive_compare() {
    for lower in [
        "host",
        "date",
        "expect",
        "accept",
        "server",
        "user-agent",
        "connection",
        "content-type",
        "authorization",
        "content-length",
        "accept-encoding",
        "transfer-encoding",
    ] {
        let lower = lower.as_bytes();
        let check = |b: &[u8]| {
            assert_eq!(
                eq_lower(b, lower),
                b.eq_ignore_ascii_case(lower),
                "{:?} vs {:?}",
                String::from_utf8_lossy(b),
                String::from_utf8_lossy(lower)
            );
        };
        check(lower);
        check(&lower.to_ascii_uppercase());
        check(&lower[1..]);
        check(&[lower, b"x"].concat());
        for at in 0..lower.len() {
            for v in 0..=255u8 {
                let mut b = lower.to_vec();
                b[at] = v;
                check(&b);
                let mut up = lower.to_ascii_uppercase();
                up[at] = v;
                check(&up);
            }
        }
    }
}

fn fold(fields: &[(&str, &str)]) -> Result<FramingFields, FramingError> {
    let mut f = FramingFields::default();
    for (n, v) in fields {
        f.field(n.as_bytes(), v.as_bytes())?;
    }
    f.finish()?;
    Ok(f)
}

#[test]
fn content_length_is_digits_or_one_repeated_value() {
    assert_eq!(fold(&[("Content-Length", "5")]).unwrap().length, Some(5));
    assert_eq!(fold(&[("content-length", " 5 ")]).unwrap().length, Some(5));
    assert_eq!(fold(&[("content-length", "5, 5")]).unwrap().length, Some(5));
    assert_eq!(
        fold(&[("content-length", "5"), ("content-length", "5")])
            .unwrap()
            .length,
        Some(5)
    );
    for bad in [
        "5, 6",
        "-1",
        "+5",
        "0x10",
        "",
        "5 5",
        "1e3",
        "12345678901234567890",
    ] {
        assert!(
            fold(&[("content-length", bad)]).is_err(),
            "content-length {bad:?} accepted"
        );
    }
    assert!(fold(&[("content-length", "5"), ("content-length", "6")]).is_err());
}

#[test]
fn only_a_single_chunked_coding_is_accepted() {
    assert!(fold(&[("Transfer-Encoding", "chunked")]).unwrap().chunked);
    assert!(fold(&[("transfer-encoding", " CHUNKED ")]).unwrap().chunked);
    for bad in [
        "identity, chunked",
        "gzip, chunked",
        "chunked, chunked",
        "chunked, gzip",
        "gzip",
        "identity",
        "",
        "chunked;q=1",
        "xchunked",
    ] {
        assert!(
            fold(&[("transfer-encoding", bad)]).is_err(),
            "transfer-encoding {bad:?} accepted"
        );
    }
    assert!(fold(&[
        ("transfer-encoding", "chunked"),
        ("transfer-encoding", "chunked")
    ])
    .is_err());
    assert!(fold(&[("transfer-encoding", "chunked"), ("content-length", "3")]).is_err());
    assert!(fold(&[("content-length", "3"), ("transfer-encoding", "chunked")]).is_err());
}

#[test]
fn connection_host_and_expect_are_noted() {
    let f = fold(&[
        ("Connection", "Keep-Alive, x-hop"),
        ("host", "a"),
        ("HOST", "b"),
        ("expect", "100-Continue"),
    ])
    .unwrap();
    assert!(f.keep_alive && !f.close && f.expect_continue);
    assert_eq!(f.hosts, 2);
    assert!(fold(&[("connection", "close")]).unwrap().close);
    let mut f = FramingFields::default();
    assert_eq!(f.field(b"connection", b"x").unwrap(), FieldKind::Connection);
    assert_eq!(
        f.field(b"content-length", b"1").unwrap(),
        FieldKind::Framing
    );
    assert_eq!(f.field(b"x-other", b"1").unwrap(), FieldKind::Other);
}

/// `push_decimal` writes what `format!` writes.
#[test]
fn push_decimal_matches_format() {
    let mut values = vec![0u64, 1, 9, 10, 99, 100, 1234, u64::MAX, u64::MAX - 1];
    for k in 0..20 {
        let p = 10u64.pow(k);
        values.extend([p, p - 1, p + 1]);
    }
    for n in values {
        let mut out = b"x".to_vec();
        push_decimal(&mut out, n);
        assert_eq!(out, format!("x{n}").into_bytes(), "{n}");
    }
}

/// Field spans past the inline ones go to the heap and come back in order.
#[test]
fn field_spans_keep_every_field_in_order() {
    for n in [0u32, 1, 15, 16, 17, 40, MAX_HEADERS as u32] {
        let mut s = FieldSpans::default();
        for i in 0..n {
            s.push((i, i + 1, i + 2, i + 3));
        }
        assert_eq!(s.len(), n as usize);
        let got: Vec<Span> = s.iter().collect();
        let want: Vec<Span> = (0..n).map(|i| (i, i + 1, i + 2, i + 3)).collect();
        assert_eq!(got, want, "{n}");
    }
}

/// A map given back comes out of `header_map` empty, with its allocation, and fills in order; a
/// map too large to keep, or one past the few kept, is dropped.
#[test]
fn header_maps_are_recycled_empty() {
    std::thread::spawn(|| {
        let mut h = header_map(4);
        for (n, v) in [("b", "1"), ("a", "2"), ("b", "3")] {
            h.append(
                header::HeaderName::from_static(n),
                header::HeaderValue::from_static(v),
            );
        }
        let cap = h.capacity();
        recycle(h);
        let mut h = header_map(2);
        assert!(h.is_empty() && h.keys_len() == 0);
        assert_eq!(h.capacity(), cap, "the recycled map");
        h.append(header::HOST, header::HeaderValue::from_static("x"));
        h.append(header::ACCEPT, header::HeaderValue::from_static("y"));
        let got: Vec<_> = h
            .iter()
            .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
            .collect();
        assert_eq!(got, [("host", "x"), ("accept", "y")]);
        // Too large to keep.
        recycle(header::HeaderMap::with_capacity(1000));
        assert!(header_map(0).capacity() < 1000);
        // At most MAPS_KEPT kept.
        for _ in 0..MAPS_KEPT + 3 {
            recycle(header::HeaderMap::with_capacity(8));
        }
        let kept = (0..MAPS_KEPT + 3)
            .filter(|_| header_map(0).capacity() > 0)
            .count();
        assert_eq!(kept, MAPS_KEPT);
    })
    .join()
    .unwrap();
}
