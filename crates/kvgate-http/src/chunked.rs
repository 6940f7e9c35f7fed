//! Body framing: the decoder of content-length, chunked and close-delimited bodies (client
//! request bodies in the server, worker response bodies in the client), and the chunk-size
//! prefix the server writes.

use bytes::{Buf, Bytes, BytesMut};

/// Longest chunk-size or trailer line accepted in a chunked body.
pub const MAX_LINE: usize = 4 << 10;

/// A malformed body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkError(pub &'static str);

impl std::fmt::Display for ChunkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// HTTP/1.1 body framing state: the decoder of this client's response bodies, and of the
/// gateway server's request bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decode {
    /// `content-length`: bytes still to come.
    Length(u64),
    Chunked(Chunk),
    /// Close-delimited: everything until the worker closes.
    Eof,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data: bytes still to come.
    Data(u64),
    /// Expecting the CRLF that ends a chunk's data.
    DataEnd,
    /// After the last chunk: trailer fields (dropped) until an empty line.
    Trailers,
}

/// One step of decoding what is buffered.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    Data(Bytes),
    NeedMore,
    Done,
}

impl Decode {
    /// A chunked body, before its first chunk-size line.
    pub const CHUNKED: Decode = Decode::Chunked(Chunk::Size);

    /// Consume the framing at the front of `buf` (chunk-ending CRLFs, chunk-size lines, the last
    /// chunk and its trailers) up to the next data byte or the end. `false`: more bytes needed.
    pub fn skip_framing(&mut self, buf: &mut BytesMut) -> Result<bool, ChunkError> {
        loop {
            match self {
                Decode::Chunked(Chunk::DataEnd) => match buf.first() {
                    None => return Ok(false),
                    Some(b'\n') => {
                        buf.advance(1);
                        *self = Decode::Chunked(Chunk::Size);
                    }
                    Some(b'\r') if buf.len() < 2 => return Ok(false),
                    Some(b'\r') if buf[1] == b'\n' => {
                        buf.advance(2);
                        *self = Decode::Chunked(Chunk::Size);
                    }
                    Some(_) => {
                        return Err(ChunkError(
                            "malformed chunked body: chunk data longer than its size",
                        ))
                    }
                },
                Decode::Chunked(Chunk::Size) => {
                    let Some(line) = take_line(buf)? else {
                        return Ok(false);
                    };
                    let size = chunk_size(&line)?;
                    *self = if size == 0 {
                        Decode::Chunked(Chunk::Trailers)
                    } else {
                        Decode::Chunked(Chunk::Data(size))
                    };
                }
                Decode::Chunked(Chunk::Trailers) => {
                    let Some(line) = take_line(buf)? else {
                        return Ok(false);
                    };
                    if line.is_empty() {
                        *self = Decode::Done;
                    }
                }
                _ => return Ok(true),
            }
        }
    }

    /// Decode from `buf`, consuming what is used: the next piece of body data, or the end.
    pub fn step(&mut self, buf: &mut BytesMut) -> Result<Step, ChunkError> {
        if !self.skip_framing(buf)? {
            return Ok(Step::NeedMore);
        }
        let left = match self {
            Decode::Done => return Ok(Step::Done),
            _ if buf.is_empty() => return Ok(Step::NeedMore),
            Decode::Eof => return Ok(Step::Data(buf.split().freeze())),
            Decode::Length(n) | Decode::Chunked(Chunk::Data(n)) => n,
            Decode::Chunked(_) => unreachable!("skip_framing stops at data or the end"),
        };
        let take = (*left).min(buf.len() as u64) as usize;
        *left -= take as u64;
        if *left == 0 {
            *self = match self {
                Decode::Length(_) => Decode::Done,
                _ => Decode::Chunked(Chunk::DataEnd),
            };
        }
        Ok(Step::Data(buf.split_to(take).freeze()))
    }
}

/// A whole line (without its CRLF or LF) from the front of `buf`, if buffered. Over
/// [`MAX_LINE`] is an error however the line arrived (in one read or in pieces), so that the
/// answer never depends on how the peer's bytes were cut.
fn take_line(buf: &mut BytesMut) -> Result<Option<BytesMut>, ChunkError> {
    match memchr::memchr(b'\n', buf) {
        Some(i) if i > MAX_LINE => Err(ChunkError("malformed chunked body: line too long")),
        Some(i) => {
            let mut line = buf.split_to(i + 1);
            line.truncate(i);
            if line.last() == Some(&b'\r') {
                line.truncate(i - 1);
            }
            Ok(Some(line))
        }
        None if buf.len() > MAX_LINE => Err(ChunkError("malformed chunked body: line too long")),
        None => Ok(None),
    }
}

/// The size of a chunk-size line (`1a;ext=1`).
fn chunk_size(line: &[u8]) -> Result<u64, ChunkError> {
    let bad = || ChunkError("malformed chunked body: bad chunk size");
    let end = line
        .iter()
        .position(|&b| b == b';' || b == b' ' || b == b'\t')
        .unwrap_or(line.len());
    let hex = &line[..end];
    if hex.is_empty() || hex.len() > 15 {
        return Err(bad());
    }
    let mut n: u64 = 0;
    for &b in hex {
        let d = (b as char).to_digit(16).ok_or_else(bad)?;
        n = n * 16 + u64::from(d);
    }
    Ok(n)
}

/// `{len:x}\r\n` into `buf`.
pub fn chunk_prefix(len: usize, buf: &mut [u8; 18]) -> &[u8] {
    let mut i = 16;
    let mut n = len;
    loop {
        i -= 1;
        buf[i] = b"0123456789abcdef"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    buf[16] = b'\r';
    buf[17] = b'\n';
    &buf[i..]
}

#[cfg(test)]
pub(crate) mod tests;
