//! Which entries beneath a transfer's sources it takes: `--exclude`/`--include` rules and
//! a `--files-from` list, applied by whichever side lists the tree (the client for a
//! push, the server for a pull, which gets them in the request), so that an excluded
//! file is never announced, read, sent, or touched on the receiving side.
//!
//! The rules follow rsync's filter rules, because that is what users of science
//! networks already write: each path is matched against the rules in order and the
//! first that matches decides; no match includes it. An excluded directory is not
//! descended into, so `--include '*.dat' --exclude '*'` needs `--include '*/'` to reach
//! the `.dat` files below the top, as with rsync. A pattern is a glob (`globset`, with
//! `*` and `?` never crossing a `/`, `**` crossing any number of directories, `[...]`
//! classes, `\` escapes); a trailing `/` matches only directories; a leading `/` anchors
//! it at the source's top, otherwise it matches the end of the path (a pattern without
//! `/` matches the name alone). Paths are those beneath each source named on the command
//! line: for `cp -r data DST`, `data/raw/a.dat` is matched as `raw/a.dat`. The sources
//! named on the command line are themselves always taken.
//!
//! What this does not do: rsync's other rule kinds (protect, hide, merge files, `***`),
//! and matching against the destination (a dry run lists what the source side selects,
//! not what the receiver would skip as up to date).

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use std::sync::Arc;

use globset::{GlobBuilder, GlobMatcher};
use wanxfer_proto::ops::{self, NodeKind};
use wanxfer_proto::{Entry, EntryKind, RelPath, SelectRule, Selection, MAX_PATTERN_BYTES};

use crate::preserve::Preserve;
use crate::session::{ClientConfig, ClientJob};
use crate::source::{Source, Walker};
use crate::Error;

/// A [`Selection`] compiled for matching.
#[derive(Debug, Clone, Default)]
pub struct Matcher {
    rules: Vec<Compiled>,
    files: Option<FileSet>,
}

#[derive(Debug, Clone)]
struct Compiled {
    include: bool,
    dirs_only: bool,
    glob: GlobMatcher,
}

/// The `--files-from` paths, and every directory above one of them.
#[derive(Debug, Clone, Default)]
struct FileSet {
    listed: HashSet<Vec<u8>>,
    parents: HashSet<Vec<u8>>,
}

impl Matcher {
    /// Compiles `selection`; a pattern that is not a glob is a usage error naming it.
    pub fn new(selection: &Selection) -> Result<Matcher, Error> {
        let rules = selection
            .rules
            .iter()
            .map(compile)
            .collect::<Result<_, _>>()?;
        let files = selection.files.as_ref().map(|files| {
            let mut set = FileSet::default();
            for path in files {
                // Every proper prefix ending before a `/` is a parent directory.
                let bytes = path.as_bytes();
                for (i, _) in bytes.iter().enumerate().filter(|(_, b)| **b == b'/') {
                    set.parents.insert(bytes[..i].to_vec());
                }
                set.listed.insert(path.as_bytes().to_vec());
            }
            set
        });
        Ok(Matcher { rules, files })
    }

    /// Selects everything.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.files.is_none()
    }

    /// Whether the entry at `path` beneath its source (not the source itself) is taken,
    /// its parents having been taken.
    pub fn selects(&self, path: &RelPath, is_dir: bool) -> bool {
        if let Some(files) = &self.files {
            if !files.selects(path.as_bytes(), is_dir) {
                return false;
            }
        }
        let candidate = Path::new(OsStr::from_bytes(path.as_bytes()));
        for rule in &self.rules {
            if rule.dirs_only && !is_dir {
                continue;
            }
            if rule.glob.is_match(candidate) {
                return rule.include;
            }
        }
        true
    }
}

impl FileSet {
    fn selects(&self, path: &[u8], is_dir: bool) -> bool {
        if self.listed.contains(path) || (is_dir && self.parents.contains(path)) {
            return true;
        }
        // Beneath a listed directory.
        path.iter()
            .enumerate()
            .filter(|(_, b)| **b == b'/')
            .any(|(i, _)| self.listed.contains(&path[..i]))
    }
}

fn compile(rule: &SelectRule) -> Result<Compiled, Error> {
    let shown = String::from_utf8_lossy(&rule.pattern).into_owned();
    let bad = |reason: &str| Error::Usage(format!("pattern {shown:?}: {reason}"));
    let pattern = std::str::from_utf8(&rule.pattern).map_err(|_| bad("not UTF-8"))?;
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(bad(&format!("longer than {MAX_PATTERN_BYTES} bytes")));
    }
    let (body, dirs_only) = match pattern.strip_suffix('/') {
        Some(body) => (body, true),
        None => (pattern, false),
    };
    let (body, anchored) = match body.strip_prefix('/') {
        Some(body) => (body, true),
        None => (body, false),
    };
    if body.is_empty() || body.contains('\0') {
        return Err(bad("matches nothing (write a name or a glob)"));
    }
    let glob = if anchored {
        body.to_owned()
    } else {
        format!("**/{body}")
    };
    let glob = GlobBuilder::new(&glob)
        .literal_separator(true)
        .backslash_escape(true)
        .build()
        .map_err(|e| bad(&e.kind().to_string()))?
        .compile_matcher();
    Ok(Compiled {
        include: rule.include,
        dirs_only,
        glob,
    })
}

/// Parses a `--files-from` list: one path per line (or, with `nul`, per NUL-terminated
/// record), relative to each source; blank lines are skipped, and without `nul` so are
/// lines starting with `#` or `;` (comments, as rsync reads them). Leading `/` and `./`
/// and a trailing `/` are dropped. An invalid path is an error naming its line.
pub fn parse_file_list(list: &[u8], nul: bool) -> Result<Vec<RelPath>, Error> {
    let sep = if nul { b'\0' } else { b'\n' };
    let mut paths = Vec::new();
    for (n, record) in list.split(|b| *b == sep).enumerate() {
        let mut record = record;
        if !nul {
            record = record.strip_suffix(b"\r").unwrap_or(record);
            if record.starts_with(b"#") || record.starts_with(b";") {
                continue;
            }
        }
        loop {
            if let Some(rest) = record.strip_prefix(b"/") {
                record = rest;
            } else if let Some(rest) = record.strip_prefix(b"./") {
                record = rest;
            } else {
                break;
            }
        }
        while let Some(rest) = record.strip_suffix(b"/") {
            record = rest;
        }
        if record.is_empty() || record == b"." {
            continue;
        }
        let path = RelPath::new(record).map_err(|e| {
            let what = if nul { "record" } else { "line" };
            Error::Usage(format!(
                "--files-from {what} {}: {:?}: {e}",
                n + 1,
                String::from_utf8_lossy(record)
            ))
        })?;
        paths.push(path);
    }
    Ok(paths)
}

/// Lists what `job` would move under `cfg.selection`, in manifest order and with
/// manifest paths (each source's name first), moving and writing nothing on either side:
/// a push walks its sources here, as the transfer would; a pull lists its sources on
/// the server over a remote-operations connection and applies the same selection to
/// that listing. Unlike the transfer, it does not ask the receiver what it has already.
/// With `--preserve hardlinks` a push lists another name of a file listed before with
/// that name (the second argument of `each`); a pull's listing does not say which
/// names are one file, so there they are listed as files.
pub fn dry_run(
    cfg: &ClientConfig,
    job: &ClientJob,
    mut each: impl FnMut(&Entry, Option<&RelPath>),
) -> Result<(), Error> {
    let matcher = Arc::new(Matcher::new(&cfg.selection)?);
    match job {
        ClientJob::Push {
            source: source @ Source::Items(_),
            ..
        } => {
            // Only the links: the other items would read every file's attributes.
            let links = Preserve {
                hardlinks: cfg.preserve.hardlinks,
                ..Preserve::default()
            };
            let mut walker = Walker::new(source)
                .selecting(matcher)
                .preserving(links)
                .marking_link_targets(true);
            // The first names of files with several, by entry id.
            let mut first_names: HashMap<u64, RelPath> = HashMap::new();
            let mut id = 0u64;
            while let Some(walked) = walker.next_entry() {
                let walked = walked?;
                let link = walked.entry.meta.as_ref().and_then(|m| m.link);
                each(&walked.entry, link.and_then(|l| first_names.get(&l)));
                if walked.entry.meta.as_ref().is_some_and(|m| m.linkable) {
                    first_names.insert(id, walked.entry.path.clone());
                }
                id += 1;
            }
            Ok(())
        }
        ClientJob::Pull {
            sources,
            synthetic_bytes: None,
            ..
        } => {
            let mut client = crate::ops::Client::connect(cfg)?;
            for source in sources {
                list_remote(&mut client, source, &matcher, &mut |entry| {
                    each(entry, None)
                })?;
            }
            Ok(())
        }
        _ => Err(Error::Usage(
            "--dry-run lists files: a synthetic transfer (--bytes) has none".into(),
        )),
    }
}

/// Lists one pulled source as the server's walker would take it.
fn list_remote(
    client: &mut crate::ops::Client,
    source: &RelPath,
    matcher: &Matcher,
    each: &mut impl FnMut(&Entry),
) -> Result<(), Error> {
    let Some((_, name)) = source.split_last() else {
        return Err(Error::Usage(
            "name a file or directory beneath the server's root, not the root itself".into(),
        ));
    };
    let top = RelPath::root()
        .join(name)
        .map_err(|e| Error::Usage(format!("{source}: {e}")))?;
    let meta = client.stat(source)?;
    let Some(entry) = entry_of(top.clone(), &meta) else {
        return Ok(());
    };
    each(&entry);
    if meta.kind != NodeKind::Dir {
        return Ok(());
    }
    // Depth first, a directory before what is in it: what lies beneath an excluded
    // directory is left out with it, as the walker never descends there.
    let mut excluded: HashSet<Vec<u8>> = HashSet::new();
    client.list(source, true, true, |listed| {
        let is_dir = listed.kind == NodeKind::Dir;
        let bytes = listed.path.as_bytes();
        let under_excluded = bytes
            .iter()
            .enumerate()
            .filter(|(_, b)| **b == b'/')
            .any(|(i, _)| excluded.contains(&bytes[..i]));
        if under_excluded || !matcher.selects(&listed.path, is_dir) {
            if is_dir {
                excluded.insert(bytes.to_vec());
            }
            return Ok(());
        }
        let path = top
            .concat(&listed.path)
            .map_err(|e| Error::Usage(format!("{source}/{}: {e}", listed.path)))?;
        if let Some(entry) = listed.meta.as_ref().and_then(|m| entry_of(path, m)) {
            each(&entry);
        }
        Ok(())
    })
}

/// The manifest entry the walker would make of `meta`; none for what it skips.
fn entry_of(path: RelPath, meta: &ops::Meta) -> Option<Entry> {
    let kind = match meta.kind {
        NodeKind::File => EntryKind::File,
        NodeKind::Dir => EntryKind::Dir,
        NodeKind::Symlink => EntryKind::Symlink,
        _ => return None,
    };
    Some(Entry {
        kind,
        path,
        size: if kind == EntryKind::File {
            meta.size
        } else {
            0
        },
        mode: meta.mode,
        mtime_sec: meta.mtime_sec,
        mtime_nsec: meta.mtime_nsec,
        link_target: meta.link_target.clone(),
        meta: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(rules: &[(bool, &str)]) -> Matcher {
        Matcher::new(&Selection {
            rules: rules
                .iter()
                .map(|(include, p)| SelectRule {
                    include: *include,
                    pattern: p.as_bytes().to_vec(),
                })
                .collect(),
            files: None,
        })
        .unwrap()
    }

    fn path(p: &str) -> RelPath {
        RelPath::new(p.as_bytes()).unwrap()
    }

    #[test]
    fn rules_match_as_rsync_does() {
        let m = matcher(&[(false, "*.tmp"), (false, "/top.log"), (false, "cache/")]);
        assert!(!m.selects(&path("a.tmp"), false));
        assert!(!m.selects(&path("deep/er/a.tmp"), false));
        assert!(m.selects(&path("a.tmp.keep"), false));
        // Anchored: only at the top.
        assert!(!m.selects(&path("top.log"), false));
        assert!(m.selects(&path("sub/top.log"), false));
        // Directories only.
        assert!(!m.selects(&path("x/cache"), true));
        assert!(m.selects(&path("x/cache"), false));
    }

    #[test]
    fn the_first_rule_that_matches_decides() {
        let m = matcher(&[
            (true, "keep.dat"),
            (false, "*.dat"),
            (true, "*/"),
            (false, "*"),
        ]);
        assert!(m.selects(&path("d/keep.dat"), false));
        assert!(!m.selects(&path("d/other.dat"), false));
        assert!(m.selects(&path("d"), true));
        assert!(!m.selects(&path("d/readme"), false));
    }

    #[test]
    fn double_star_crosses_directories_and_star_does_not() {
        let m = matcher(&[(false, "/a/*/x"), (false, "/b/**/y")]);
        assert!(!m.selects(&path("a/1/x"), false));
        assert!(m.selects(&path("a/1/2/x"), false));
        assert!(!m.selects(&path("b/y"), false));
        assert!(!m.selects(&path("b/1/2/y"), false));
        // Unanchored with a slash: matches the end of the path.
        let m = matcher(&[(false, "raw/*.dat")]);
        assert!(!m.selects(&path("run1/raw/a.dat"), false));
        assert!(m.selects(&path("run1/raw/sub/a.dat"), false));
    }

    #[test]
    fn bad_patterns_are_usage_errors() {
        for bad in ["/", "//", "a[", "a{b"] {
            let r = Matcher::new(&Selection {
                rules: vec![SelectRule {
                    include: false,
                    pattern: bad.as_bytes().to_vec(),
                }],
                files: None,
            });
            assert!(matches!(r, Err(Error::Usage(_))), "{bad}: {r:?}");
        }
    }

    #[test]
    fn a_file_list_takes_its_paths_their_parents_and_what_is_below() {
        let files = parse_file_list(b"# comment\n./a/b.txt\n\n/c/\nd/e/f\n", false).unwrap();
        let shown: Vec<_> = files.iter().map(|p| p.to_string()).collect();
        assert_eq!(shown, ["a/b.txt", "c", "d/e/f"]);
        let m = Matcher::new(&Selection {
            rules: Vec::new(),
            files: Some(files),
        })
        .unwrap();
        assert!(m.selects(&path("a"), true));
        assert!(m.selects(&path("a/b.txt"), false));
        assert!(!m.selects(&path("a/other"), false));
        assert!(!m.selects(&path("a"), false), "a parent is a directory");
        assert!(m.selects(&path("c/anything/below"), false));
        assert!(m.selects(&path("d/e"), true));
        assert!(!m.selects(&path("d/x"), true));
        assert!(!m.selects(&path("cc"), false));
        let nul = parse_file_list(b"x y\0#z\0", true).unwrap();
        assert_eq!(nul, [path("x y"), path("#z")]);
        assert!(parse_file_list(b"ok\na/../b\n", false)
            .unwrap_err()
            .to_string()
            .contains("line 2"));
    }
}
