use super::*;

/// Feed `wire` to a decoder in pieces cut at `cuts`; the data it yields, or its error.
fn decode_in_pieces(
    mut d: Decode,
    wire: &[u8],
    cuts: &[usize],
) -> Result<(Vec<u8>, bool), ChunkError> {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut at = 0;
    let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c < wire.len()).collect();
    bounds.push(wire.len());
    for end in bounds {
        buf.extend_from_slice(&wire[at..end]);
        at = end;
        loop {
            match d.step(&mut buf)? {
                Step::Data(b) => out.extend_from_slice(&b),
                Step::NeedMore => break,
                Step::Done => return Ok((out, buf.is_empty())),
            }
        }
    }
    Ok((out, false))
}

pub(crate) const CHUNKED: &[u8] = b"5\r\nhello\r\n7;ext=\"a\"\r\n, world\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-trailer: 1\r\n\r\n";
pub(crate) const CHUNKED_DATA: &[u8] = b"hello, worldabcdefghijklmnopqrstuvwxyz";

#[test]
fn chunked_bodies_decode_the_same_however_they_are_split() {
    let start = Decode::Chunked(Chunk::Size);
    // Every two-piece split, and one byte at a time.
    for cut in 0..=CHUNKED.len() {
        let (data, clean) = decode_in_pieces(start, CHUNKED, &[cut]).unwrap();
        assert_eq!(data, CHUNKED_DATA, "cut at {cut}");
        assert!(clean, "cut at {cut}: the terminator is consumed");
    }
    let every: Vec<usize> = (1..CHUNKED.len()).collect();
    let (data, clean) = decode_in_pieces(start, CHUNKED, &every).unwrap();
    assert_eq!((data.as_slice(), clean), (CHUNKED_DATA, true));
    // Bare LF line endings are tolerated.
    let lf = b"3\nabc\n0\n\n";
    assert_eq!(
        decode_in_pieces(start, lf, &[]).unwrap(),
        (b"abc".to_vec(), true)
    );
}

#[test]
fn a_chunked_body_is_not_done_before_its_last_chunk() {
    let (data, done) =
        decode_in_pieces(Decode::Chunked(Chunk::Size), b"5\r\nhello\r\n", &[]).unwrap();
    assert_eq!((data.as_slice(), done), (&b"hello"[..], false));
    let (_, done) =
        decode_in_pieces(Decode::Chunked(Chunk::Size), b"5\r\nhello\r\n0\r\n", &[]).unwrap();
    assert!(!done, "trailers section still open");
}

#[test]
fn malformed_chunked_bodies_are_errors() {
    let start = Decode::Chunked(Chunk::Size);
    for bad in [
        &b"zz\r\nhello\r\n0\r\n\r\n"[..],
        b"\r\nhello\r\n",
        b"3\r\nhello\r\n0\r\n\r\n",
        b"1234567890abcdef0\r\n",
    ] {
        let r = decode_in_pieces(start, bad, &[]);
        assert!(r.is_err(), "{:?} accepted", String::from_utf8_lossy(bad));
    }
    let long = vec![b'1'; MAX_LINE + 10];
    assert!(decode_in_pieces(start, &long, &[]).is_err());
}

#[test]
fn length_bodies_stop_at_their_length() {
    for cut in 0..=10 {
        let mut buf = BytesMut::new();
        let mut d = Decode::Length(10);
        let wire = b"0123456789EXTRA";
        buf.extend_from_slice(&wire[..cut]);
        let mut out = Vec::new();
        while let Step::Data(b) = d.step(&mut buf).unwrap() {
            out.extend_from_slice(&b);
        }
        buf.extend_from_slice(&wire[cut..]);
        loop {
            match d.step(&mut buf).unwrap() {
                Step::Data(b) => out.extend_from_slice(&b),
                Step::Done => break,
                Step::NeedMore => panic!("all ten bytes are buffered"),
            }
        }
        assert_eq!(out, b"0123456789");
        assert_eq!(&buf[..], b"EXTRA", "bytes after the body are left alone");
    }
}

#[test]
fn a_long_trailer_line_is_refused_however_it_arrives() {
    // Found by the fuzz target `chunked`: in one read the line was accepted, byte by byte not.
    let mut wire = b"0\r\nx-long: ".to_vec();
    wire.extend(std::iter::repeat_n(b'a', MAX_LINE + 10));
    wire.extend_from_slice(b"\r\n\r\n");
    assert!(decode_in_pieces(Decode::CHUNKED, &wire, &[]).is_err());
    let every: Vec<usize> = (1..wire.len()).collect();
    assert!(decode_in_pieces(Decode::CHUNKED, &wire, &every).is_err());
}
