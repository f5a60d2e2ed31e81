//! Byte-level reading and writing shared by every message and header.
//!
//! All integers are little-endian: both ends of a DTN transfer are x86-64 or aarch64 in
//! practice, so no byte swapping happens on the data path. Every variable-length field is
//! read through [`Decoder::bytes`] with an explicit upper bound, so a length read off the
//! wire can never make us allocate more than a local limit allows.

use crate::DecodeError;

/// Appends encoded fields to a buffer. Encoding cannot fail: callers build messages from
/// values that already satisfy the limits (the constructors of limited types check them).
#[derive(Debug)]
pub struct Encoder<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> Encoder<'a> {
    pub fn new(out: &'a mut Vec<u8>) -> Self {
        Encoder { out }
    }

    fn buf(&mut self) -> &mut Vec<u8> {
        self.out
    }

    pub fn u8(&mut self, v: u8) {
        self.buf().push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf().extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf().extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf().extend_from_slice(&v.to_le_bytes());
    }
    pub fn i64(&mut self, v: i64) {
        self.buf().extend_from_slice(&v.to_le_bytes());
    }
    pub fn raw(&mut self, bytes: &[u8]) {
        self.buf().extend_from_slice(bytes);
    }
    /// A length-prefixed (u32) byte string.
    pub fn bytes(&mut self, bytes: &[u8]) {
        self.u32(u32::try_from(bytes.len()).expect("field lengths are bounded far below 4 GiB"));
        self.raw(bytes);
    }
}

/// Reads fields from a byte slice, refusing to read past its end.
#[derive(Debug)]
pub struct Decoder<'a> {
    input: &'a [u8],
}

impl<'a> Decoder<'a> {
    pub fn new(input: &'a [u8]) -> Self {
        Decoder { input }
    }

    pub fn remaining(&self) -> usize {
        self.input.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.input.len() < n {
            return Err(DecodeError::Truncated {
                needed: n - self.input.len(),
            });
        }
        let (head, tail) = self.input.split_at(n);
        self.input = tail;
        Ok(head)
    }

    /// Exactly `n` raw bytes (a length the caller already bounded).
    pub fn take_bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        self.take(n)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// A length-prefixed byte string of at most `max` bytes; `what` names the field in errors.
    pub fn bytes(&mut self, what: &'static str, max: usize) -> Result<&'a [u8], DecodeError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(DecodeError::TooLong { what, len, max });
        }
        self.take(len)
    }

    /// A count that prefixes a list; checked against `max` and against the bytes left, so a
    /// peer cannot make us reserve memory for elements it never sends.
    pub fn count(
        &mut self,
        what: &'static str,
        max: usize,
        min_element_len: usize,
    ) -> Result<usize, DecodeError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(DecodeError::TooLong { what, len, max });
        }
        let needed = len.saturating_mul(min_element_len.max(1));
        if needed > self.remaining() {
            return Err(DecodeError::Truncated {
                needed: needed - self.remaining(),
            });
        }
        Ok(len)
    }

    /// Fails unless every byte was consumed: trailing bytes mean the peer and we disagree
    /// about the format, which is better caught here than as a strange value later.
    pub fn finish(self) -> Result<(), DecodeError> {
        if self.input.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Trailing {
                len: self.input.len(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_longer_than_limit_are_refused_before_reading() {
        let mut buf = Vec::new();
        Encoder::new(&mut buf).bytes(&[7u8; 10]);
        let err = Decoder::new(&buf).bytes("name", 9).unwrap_err();
        assert_eq!(
            err,
            DecodeError::TooLong {
                what: "name",
                len: 10,
                max: 9
            }
        );
    }

    #[test]
    fn count_larger_than_input_is_truncated_not_allocated() {
        let mut buf = Vec::new();
        Encoder::new(&mut buf).u32(1_000_000);
        let err = Decoder::new(&buf)
            .count("entries", 2_000_000, 8)
            .unwrap_err();
        assert!(matches!(err, DecodeError::Truncated { .. }));
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        let d = Decoder::new(&[1, 2]);
        assert_eq!(d.finish(), Err(DecodeError::Trailing { len: 2 }));
    }
}
