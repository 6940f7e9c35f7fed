//! A bounds-checked MessagePack cursor over a borrowed slice.
//!
//! Markers are classified by `rmp::Marker`; the payload bytes are read straight from the slice, so
//! strings and binaries are borrowed (no copy) and a hostile length can never make us allocate more
//! than the input holds.

use rmp::Marker;

use super::KvEventError;

/// Nesting bound for skipping unknown values (msgspec never nests this deep in an event).
const MAX_DEPTH: u32 = 32;

/// One decoded scalar-or-header; containers report only their length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Value<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

impl Value<'_> {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Value::Nil => "nil",
            Value::Bool(_) => "bool",
            Value::Uint(_) | Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bin(_) => "bin",
            Value::Array(_) => "array",
            Value::Map(_) => "map",
            Value::Ext => "ext",
        }
    }
}

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn eof(&self) -> KvEventError {
        KvEventError::Truncated { offset: self.pos }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], KvEventError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.eof())?;
        let s = self.buf.get(self.pos..end).ok_or_else(|| self.eof())?;
        self.pos = end;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], KvEventError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn len8(&mut self) -> Result<usize, KvEventError> {
        Ok(self.be::<1>()?[0] as usize)
    }
    fn len16(&mut self) -> Result<usize, KvEventError> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }
    fn len32(&mut self) -> Result<usize, KvEventError> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    fn str_of(&mut self, n: usize) -> Result<Value<'a>, KvEventError> {
        let at = self.pos;
        let s = self.take(n)?;
        std::str::from_utf8(s)
            .map(Value::Str)
            .map_err(|_| KvEventError::BadUtf8 { offset: at })
    }

    /// Reads the next value header (scalars in full, containers as their length).
    pub(crate) fn next(&mut self) -> Result<Value<'a>, KvEventError> {
        let m = Marker::from_u8(self.be::<1>()?[0]);
        Ok(match m {
            Marker::FixPos(v) => Value::Uint(v as u64),
            Marker::FixNeg(v) => Value::Int(v as i64),
            Marker::Null => Value::Nil,
            Marker::True => Value::Bool(true),
            Marker::False => Value::Bool(false),
            Marker::U8 => Value::Uint(self.be::<1>()?[0] as u64),
            Marker::U16 => Value::Uint(u16::from_be_bytes(self.be()?) as u64),
            Marker::U32 => Value::Uint(u32::from_be_bytes(self.be()?) as u64),
            Marker::U64 => Value::Uint(u64::from_be_bytes(self.be()?)),
            Marker::I8 => Value::Int(self.be::<1>()?[0] as i8 as i64),
            Marker::I16 => Value::Int(i16::from_be_bytes(self.be()?) as i64),
            Marker::I32 => Value::Int(i32::from_be_bytes(self.be()?) as i64),
            Marker::I64 => Value::Int(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Value::Float(f32::from_be_bytes(self.be()?) as f64),
            Marker::F64 => Value::Float(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(n) => self.str_of(n as usize)?,
            Marker::Str8 => {
                let n = self.len8()?;
                self.str_of(n)?
            }
            Marker::Str16 => {
                let n = self.len16()?;
                self.str_of(n)?
            }
            Marker::Str32 => {
                let n = self.len32()?;
                self.str_of(n)?
            }
            Marker::Bin8 => {
                let n = self.len8()?;
                Value::Bin(self.take(n)?)
            }
            Marker::Bin16 => {
                let n = self.len16()?;
                Value::Bin(self.take(n)?)
            }
            Marker::Bin32 => {
                let n = self.len32()?;
                Value::Bin(self.take(n)?)
            }
            Marker::FixArray(n) => Value::Array(n as u32),
            Marker::Array16 => Value::Array(self.len16()? as u32),
            Marker::Array32 => Value::Array(self.len32()? as u32),
            Marker::FixMap(n) => Value::Map(n as u32),
            Marker::Map16 => Value::Map(self.len16()? as u32),
            Marker::Map32 => Value::Map(self.len32()? as u32),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.len8()?;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.len16()?;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len32()?;
                self.ext(n)?
            }
            Marker::Reserved => {
                return Err(KvEventError::Unexpected {
                    offset: self.pos - 1,
                    expected: "a msgpack value",
                    found: "reserved marker 0xc1",
                })
            }
        })
    }

    fn ext(&mut self, n: usize) -> Result<Value<'a>, KvEventError> {
        self.take(1 + n)?; // type byte + data
        Ok(Value::Ext)
    }

    fn unexpected(&self, expected: &'static str, found: Value<'_>) -> KvEventError {
        KvEventError::Unexpected {
            offset: self.pos,
            expected,
            found: found.kind(),
        }
    }

    /// Skips one complete value (containers recursively, bounded depth).
    pub(crate) fn skip(&mut self) -> Result<(), KvEventError> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: u32) -> Result<(), KvEventError> {
        if depth > MAX_DEPTH {
            return Err(KvEventError::TooDeep { offset: self.pos });
        }
        match self.next()? {
            Value::Array(n) => (0..n).try_for_each(|_| self.skip_depth(depth + 1)),
            Value::Map(n) => (0..n.saturating_mul(2)).try_for_each(|_| self.skip_depth(depth + 1)),
            _ => Ok(()),
        }
    }

    pub(crate) fn array_len(&mut self) -> Result<u32, KvEventError> {
        match self.next()? {
            Value::Array(n) => Ok(n),
            v => Err(self.unexpected("array", v)),
        }
    }

    /// An array length, or `None` for nil.
    pub(crate) fn opt_array_len(&mut self) -> Result<Option<u32>, KvEventError> {
        match self.next()? {
            Value::Array(n) => Ok(Some(n)),
            Value::Nil => Ok(None),
            v => Err(self.unexpected("array or nil", v)),
        }
    }

    pub(crate) fn str(&mut self) -> Result<&'a str, KvEventError> {
        match self.next()? {
            Value::Str(s) => Ok(s),
            v => Err(self.unexpected("str", v)),
        }
    }

    pub(crate) fn opt_str(&mut self) -> Result<Option<&'a str>, KvEventError> {
        match self.next()? {
            Value::Str(s) => Ok(Some(s)),
            Value::Nil => Ok(None),
            v => Err(self.unexpected("str or nil", v)),
        }
    }

    pub(crate) fn opt_int(&mut self) -> Result<Option<i64>, KvEventError> {
        match self.next()? {
            Value::Uint(u) => Ok(Some(u as i64)),
            Value::Int(i) => Ok(Some(i)),
            Value::Nil => Ok(None),
            v => Err(self.unexpected("int or nil", v)),
        }
    }

    pub(crate) fn u32(&mut self) -> Result<u32, KvEventError> {
        match self.next()? {
            Value::Uint(u) if u <= u32::MAX as u64 => Ok(u as u32),
            Value::Int(i) if (0..=u32::MAX as i64).contains(&i) => Ok(i as u32),
            v => Err(self.unexpected("u32", v)),
        }
    }

    /// A timestamp: float, or an int from encoders that narrowed it.
    pub(crate) fn f64(&mut self) -> Result<f64, KvEventError> {
        match self.next()? {
            Value::Float(f) => Ok(f),
            Value::Uint(u) => Ok(u as f64),
            Value::Int(i) => Ok(i as f64),
            v => Err(self.unexpected("float", v)),
        }
    }

    /// A block hash: uint64, int64 (two's complement, as SGLang's signed ids), or bytes
    /// (the last 8 bytes big-endian, which is what vLLM's `int.from_bytes(d,"big") & (2**64-1)` keeps).
    pub(crate) fn hash(&mut self) -> Result<u64, KvEventError> {
        match self.next()? {
            Value::Uint(u) => Ok(u),
            Value::Int(i) => Ok(i as u64),
            Value::Bin(b) => Ok(bytes_hash(b)),
            v => Err(self.unexpected("hash (int or bytes)", v)),
        }
    }

    pub(crate) fn opt_hash(&mut self) -> Result<Option<u64>, KvEventError> {
        match self.next()? {
            Value::Uint(u) => Ok(Some(u)),
            Value::Int(i) => Ok(Some(i as u64)),
            Value::Bin(b) => Ok(Some(bytes_hash(b))),
            Value::Nil => Ok(None),
            v => Err(self.unexpected("hash or nil", v)),
        }
    }

    /// Capacity for `n` claimed elements: never more than the bytes left (each element ≥ 1 byte).
    pub(crate) fn cap(&self, n: u32) -> usize {
        (n as usize).min(self.remaining())
    }
}

/// The low 64 bits of a big-endian integer of any byte length.
pub fn bytes_hash(b: &[u8]) -> u64 {
    let tail = &b[b.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64)
}
