//! Relative paths as they travel on the wire.
//!
//! A path from the peer is the one input that can make a server write somewhere it should
//! not, so the rules live in the type: a [`RelPath`] that exists has no `..`, no `.`, no
//! empty component, no NUL, no leading `/`, and fits `NAME_MAX`/`PATH_MAX`. Paths are raw
//! bytes, not UTF-8: scientific archives carry names in every encoding and we must copy
//! them byte for byte. This module does not make paths safe to *open*: a symlink planted
//! on disk can still redirect a lexically clean path, which is why the engine resolves
//! every path beneath a held directory handle with `RESOLVE_BENEATH`.

use std::fmt;

/// Longest single component, as Linux's `NAME_MAX`.
pub const MAX_NAME_BYTES: usize = 255;
/// Longest whole path, as Linux's `PATH_MAX` less the terminating NUL.
pub const MAX_PATH_BYTES: usize = 4095;

/// Why a path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PathError {
    #[error("absolute paths are not allowed")]
    Absolute,
    #[error("'..' components are not allowed")]
    ParentComponent,
    #[error("'.' or empty components are not allowed")]
    EmptyComponent,
    #[error("NUL bytes are not allowed in names")]
    Nul,
    #[error("a name is longer than {MAX_NAME_BYTES} bytes")]
    NameTooLong,
    #[error("the path is longer than {MAX_PATH_BYTES} bytes")]
    PathTooLong,
}

/// A validated relative path; the empty path names the root itself.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RelPath(Vec<u8>);

impl RelPath {
    /// The root of the tree being served or written.
    pub fn root() -> Self {
        RelPath(Vec::new())
    }

    /// Checks `bytes` against every rule; a trailing `/` is tolerated and dropped.
    pub fn new(bytes: &[u8]) -> Result<Self, PathError> {
        let trimmed = bytes.strip_suffix(b"/").unwrap_or(bytes);
        if trimmed.is_empty() {
            return if bytes.is_empty() {
                Ok(RelPath::root())
            } else {
                Err(PathError::Absolute)
            };
        }
        if trimmed.len() > MAX_PATH_BYTES {
            return Err(PathError::PathTooLong);
        }
        if trimmed[0] == b'/' {
            return Err(PathError::Absolute);
        }
        for name in trimmed.split(|&b| b == b'/') {
            check_name(name)?;
        }
        Ok(RelPath(trimmed.to_vec()))
    }

    /// Builds `self/name`, where `name` must be one valid component.
    pub fn join(&self, name: &[u8]) -> Result<Self, PathError> {
        check_name(name)?;
        let mut bytes = Vec::with_capacity(self.0.len() + 1 + name.len());
        bytes.extend_from_slice(&self.0);
        if !bytes.is_empty() {
            bytes.push(b'/');
        }
        bytes.extend_from_slice(name);
        if bytes.len() > MAX_PATH_BYTES {
            return Err(PathError::PathTooLong);
        }
        Ok(RelPath(bytes))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    pub fn components(&self) -> impl Iterator<Item = &[u8]> {
        self.0.split(|&b| b == b'/').filter(|c| !c.is_empty())
    }

    /// The parent path and the last name; `None` for the root.
    pub fn split_last(&self) -> Option<(RelPath, &[u8])> {
        if self.0.is_empty() {
            return None;
        }
        match self.0.iter().rposition(|&b| b == b'/') {
            Some(i) => Some((RelPath(self.0[..i].to_vec()), &self.0[i + 1..])),
            None => Some((RelPath::root(), &self.0[..])),
        }
    }

    /// The first component and the rest; `None` for the root.
    pub fn split_first(&self) -> Option<(&[u8], RelPath)> {
        if self.0.is_empty() {
            return None;
        }
        match self.0.iter().position(|&b| b == b'/') {
            Some(i) => Some((&self.0[..i], RelPath(self.0[i + 1..].to_vec()))),
            None => Some((&self.0[..], RelPath::root())),
        }
    }

    /// `self` joined with every component of `rest`.
    pub fn concat(&self, rest: &RelPath) -> Result<Self, PathError> {
        if rest.is_root() {
            return Ok(self.clone());
        }
        if self.is_root() {
            return Ok(rest.clone());
        }
        let mut bytes = self.0.clone();
        bytes.push(b'/');
        bytes.extend_from_slice(&rest.0);
        if bytes.len() > MAX_PATH_BYTES {
            return Err(PathError::PathTooLong);
        }
        Ok(RelPath(bytes))
    }
}

/// Checks one path component.
pub fn check_name(name: &[u8]) -> Result<(), PathError> {
    match name {
        b"" | b"." => Err(PathError::EmptyComponent),
        b".." => Err(PathError::ParentComponent),
        _ if name.contains(&0) => Err(PathError::Nul),
        _ if name.contains(&b'/') => Err(PathError::EmptyComponent),
        _ if name.len() > MAX_NAME_BYTES => Err(PathError::NameTooLong),
        _ => Ok(()),
    }
}

impl fmt::Debug for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(&self.0))
    }
}

impl fmt::Display for RelPath {
    /// Shows the path escaped (see [`Escaped`]); the root is `.`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str(".");
        }
        Escaped(&self.0).fmt(f)
    }
}

/// Shows bytes from a peer or a disk (a name, a symlink target) escaped, so that
/// newlines or control bytes in a hostile name cannot forge lines in a log, a terminal
/// or a line of JSON: control characters as Rust escapes, bytes that are not UTF-8 as
/// `\xNN`, everything else as is.
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(pub &'a [u8]);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for chunk in self.0.utf8_chunks() {
            for c in chunk.valid().chars() {
                if c.is_control() {
                    write!(f, "{}", c.escape_default())?;
                } else {
                    write!(f, "{c}")?;
                }
            }
            for b in chunk.invalid() {
                write!(f, "\\x{b:02x}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_escapes() {
        assert_eq!(RelPath::new(b"/etc/passwd"), Err(PathError::Absolute));
        assert_eq!(RelPath::new(b"a/../../b"), Err(PathError::ParentComponent));
        assert_eq!(RelPath::new(b".."), Err(PathError::ParentComponent));
        assert_eq!(RelPath::new(b"a//b"), Err(PathError::EmptyComponent));
        assert_eq!(RelPath::new(b"./a"), Err(PathError::EmptyComponent));
        assert_eq!(RelPath::new(b"a\0b"), Err(PathError::Nul));
        assert_eq!(RelPath::new(b"/"), Err(PathError::Absolute));
    }

    #[test]
    fn accepts_odd_but_legal_names() {
        for name in [
            &b"-rf"[..],
            b"a b",
            b"line\nbreak",
            b"\xff\xfe",
            b"...",
            b".hidden",
        ] {
            assert!(RelPath::new(name).is_ok(), "{name:?}");
        }
        assert!(RelPath::new(&[b'x'; 255]).is_ok());
        assert_eq!(RelPath::new(&[b'x'; 256]), Err(PathError::NameTooLong));
    }

    #[test]
    fn split_and_join_agree() {
        let p = RelPath::new(b"a/b/c").unwrap();
        let (parent, name) = p.split_last().unwrap();
        assert_eq!(parent.join(name).unwrap(), p);
        let (first, rest) = p.split_first().unwrap();
        assert_eq!(first, b"a");
        assert_eq!(rest, RelPath::new(b"b/c").unwrap());
    }

    #[test]
    fn display_escapes_control_characters() {
        let p = RelPath::new(b"evil\nname\xff").unwrap();
        assert_eq!(p.to_string(), "evil\\nname\\xff");
    }
}
