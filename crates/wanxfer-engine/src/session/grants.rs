//! The grants a destination server made for third-party copies, and what each allows.
//!
//! Why a table in memory, bounded, and nothing on disk: a grant is a credential that
//! lives minutes at most ([`wanxfer_proto::tpc::MAX_GRANT_TTL_S`]); a server restarted in
//! between simply does not know it any more, and the client asks for a new one when it
//! runs the copy again (which then resumes from the journal, as any push does). The table
//! holds at most [`MAX_GRANTS`]; expired and used grants make room first, and a full
//! table of live ones refuses the next request rather than evicting one in use.
//!
//! A grant allows one transfer: one push into exactly its path (the session's placement
//! keeps everything at or beneath it), by whoever proves its secret. The first session
//! binds the grant to that session's transfer; later sessions of the same transfer (the
//! source retrying after a network failure, resuming) may use it until it expires, any
//! other transfer may not, and once a session of it completes the grant is spent.
//! A session that has started is not cut off by the grant expiring.
//!
//! A grant also names what the push may keep beyond mode and mtime (`cp --preserve`
//! between two servers): the session may ask no `PRESERVE_*` flag the client did not ask
//! for when it got the grant, so a grant made for a plain copy cannot be turned, by the
//! source that holds it, into one that sets owners or attributes on this server.
//!
//! Time is passed in, so that expiry is tested without waiting.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use wanxfer_proto::tpc::{Granted, MAX_GRANT_TTL_S};
use wanxfer_proto::{session_flags, Direction, OpenSession, RelPath};

use super::random;
use crate::auth::Identity;
use crate::Error;

/// Most grants a server holds at once.
pub const MAX_GRANTS: usize = 4096;

/// What a grant has been used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    Fresh,
    /// Sessions of this transfer have started with it.
    Bound([u8; 16]),
    /// A session of its transfer completed.
    Spent,
}

#[derive(Debug)]
struct Entry {
    secret: [u8; 32],
    path: RelPath,
    /// The `PRESERVE_*` session flags its sessions may ask.
    preserve: u32,
    /// The client the grant was made for: its push runs with this identity.
    identity: Identity,
    expires: Instant,
    used: Use,
}

impl Entry {
    fn live(&self, now: Instant) -> bool {
        now < self.expires && self.used != Use::Spent
    }
}

/// A server's grants.
#[derive(Debug, Default)]
pub struct GrantTable {
    grants: Mutex<HashMap<[u8; 16], Entry>>,
}

/// Why a grant's session was refused, in words for the source server's log and for the
/// client it reports to.
pub const GRANT_REFUSED: &str = "the third-party copy's grant is unknown, expired or already \
     used (grants live minutes and allow one transfer): run the copy again for a new one";

impl GrantTable {
    /// Makes a grant for one push into `path` that may keep what `preserve` (session
    /// flags) names, usable for `ttl` (cut to the protocol's maximum).
    pub fn issue(
        &self,
        path: RelPath,
        preserve: u32,
        identity: Identity,
        ttl: Duration,
        now: Instant,
    ) -> Result<Granted, Error> {
        let ttl_s = ttl.as_secs().clamp(1, u64::from(MAX_GRANT_TTL_S)) as u32;
        let mut grants = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        if grants.len() >= MAX_GRANTS {
            grants.retain(|_, g| g.live(now) || matches!(g.used, Use::Bound(_)));
        }
        if grants.len() >= MAX_GRANTS {
            return Err(Error::Limit(format!(
                "this server holds {MAX_GRANTS} live third-party grants already: retry in a \
                 few minutes"
            )));
        }
        let granted = Granted {
            id: random()?,
            secret: random()?,
            ttl_s,
        };
        grants.insert(
            granted.id,
            Entry {
                secret: granted.secret,
                path,
                preserve: preserve & session_flags::PRESERVE_ALL,
                identity,
                expires: now + Duration::from_secs(ttl_s.into()),
                used: Use::Fresh,
            },
        );
        Ok(granted)
    }

    /// The secret of grant `id` if it can still start a session.
    pub fn secret(&self, id: &[u8; 16], now: Instant) -> Option<[u8; 32]> {
        let grants = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        grants.get(id).filter(|g| g.live(now)).map(|g| g.secret)
    }

    /// Checks that `open`, from a connection that proved grant `id`, is what the grant
    /// allows, and binds the grant to its transfer; the identity the grant was made for.
    pub fn admit(
        &self,
        id: &[u8; 16],
        open: &OpenSession,
        now: Instant,
    ) -> Result<Identity, Error> {
        let mut grants = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        let Some(grant) = grants.get_mut(id).filter(|g| g.live(now)) else {
            return Err(Error::Auth {
                peer: String::new(),
                detail: GRANT_REFUSED.into(),
            });
        };
        let refused = |reason: String| Error::Refused {
            path: grant.path.to_string(),
            reason,
        };
        if open.direction != Direction::Push || open.flags & session_flags::DISCARD != 0 {
            return Err(refused(
                "a third-party grant allows a push of files into its path, nothing else".into(),
            ));
        }
        let beyond = open.flags & session_flags::PRESERVE_ALL & !grant.preserve;
        if beyond != 0 {
            return Err(refused(format!(
                "the grant was made for a copy that keeps {}, not {} (session flags {beyond:#x})",
                kept(grant.preserve),
                kept(open.flags & session_flags::PRESERVE_ALL),
            )));
        }
        match open.paths.as_slice() {
            [dest] if *dest == grant.path => {}
            _ => {
                let asked: Vec<String> = open.paths.iter().map(|p| p.to_string()).collect();
                return Err(refused(format!(
                    "the grant was made for this path, not for {}",
                    asked.join(", ")
                )));
            }
        }
        match grant.used {
            Use::Fresh => grant.used = Use::Bound(open.transfer_id),
            Use::Bound(transfer) if transfer == open.transfer_id => {}
            _ => {
                return Err(Error::Auth {
                    peer: String::new(),
                    detail: GRANT_REFUSED.into(),
                })
            }
        }
        Ok(grant.identity.clone())
    }

    /// A session admitted with grant `id` ended; once one completed, the grant is spent.
    pub fn finish(&self, id: &[u8; 16], completed: bool) {
        if !completed {
            return;
        }
        let mut grants = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(grant) = grants.get_mut(id) {
            grant.used = Use::Spent;
        }
    }
}

/// The items of `flags` as `--preserve` names them, or "nothing".
fn kept(flags: u32) -> String {
    let names = crate::preserve::Preserve::from_flags(flags).names();
    if names.is_empty() {
        "nothing".into()
    } else {
        names.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wanxfer_proto::{Compare, Placement, TransportKind};

    fn rel(s: &str) -> RelPath {
        RelPath::new(s.as_bytes()).unwrap()
    }

    fn push(dest: &str, transfer: u8) -> OpenSession {
        OpenSession {
            direction: Direction::Push,
            transport: TransportKind::Tcp,
            paths: vec![rel(dest)],
            source_count: 1,
            streams: 1,
            block_size: 1 << 20,
            depth: 1,
            window: 16,
            flags: 0,
            synthetic_bytes: 0,
            transfer_id: [transfer; 16],
            placement: Placement::Resolve,
            compare: Compare::QuickCheck,
            selection: Default::default(),
        }
    }

    #[test]
    fn a_grant_expires() {
        let table = GrantTable::default();
        let t0 = Instant::now();
        let g = table
            .issue(rel("d"), 0, Identity::Secret, Duration::from_secs(60), t0)
            .unwrap();
        assert_eq!(g.ttl_s, 60);
        assert_eq!(table.secret(&g.id, t0), Some(g.secret));
        let later = t0 + Duration::from_secs(61);
        assert_eq!(table.secret(&g.id, later), None);
        assert!(matches!(
            table.admit(&g.id, &push("d", 1), later),
            Err(Error::Auth { .. })
        ));
    }

    #[test]
    fn a_grant_allows_one_transfer_and_its_retries() {
        let table = GrantTable::default();
        let now = Instant::now();
        let g = table
            .issue(rel("d"), 0, Identity::Secret, Duration::from_secs(60), now)
            .unwrap();
        table.admit(&g.id, &push("d", 1), now).unwrap();
        // The same transfer again: the source retrying after a network failure.
        table.finish(&g.id, false);
        table.admit(&g.id, &push("d", 1), now).unwrap();
        // Another transfer with the same grant: refused.
        assert!(matches!(
            table.admit(&g.id, &push("d", 2), now),
            Err(Error::Auth { .. })
        ));
        // Once a session completed, nobody may use it again, not even its transfer.
        table.finish(&g.id, true);
        assert_eq!(table.secret(&g.id, now), None);
        assert!(table.admit(&g.id, &push("d", 1), now).is_err());
    }

    #[test]
    fn a_grant_allows_only_a_push_into_its_path() {
        let table = GrantTable::default();
        let now = Instant::now();
        let g = table
            .issue(rel("d"), 0, Identity::Secret, Duration::from_secs(60), now)
            .unwrap();
        let err = table.admit(&g.id, &push("e", 1), now).unwrap_err();
        assert!(
            matches!(&err, Error::Refused { path, .. } if path == "d"),
            "{err:?}"
        );
        assert!(table.admit(&g.id, &push("d/sub", 1), now).is_err());
        let mut pull = push("d", 1);
        pull.direction = Direction::Pull;
        assert!(table.admit(&g.id, &pull, now).is_err());
        let mut discard = push("d", 1);
        discard.flags = session_flags::DISCARD;
        assert!(table.admit(&g.id, &discard, now).is_err());
        // None of those refusals used the grant up.
        table.admit(&g.id, &push("d", 1), now).unwrap();
    }

    /// A grant made for a plain copy cannot be used to keep owners or attributes, nor
    /// one made for attributes to keep owners; what was granted, or less, is admitted.
    #[test]
    fn a_grant_allows_only_the_preserve_flags_it_was_made_for() {
        let table = GrantTable::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        let plain = table
            .issue(rel("d"), 0, Identity::Secret, ttl, now)
            .unwrap();
        let mut owners = push("d", 1);
        owners.flags = session_flags::PRESERVE_OWNER;
        let err = table.admit(&plain.id, &owners, now).unwrap_err();
        assert!(
            matches!(&err, Error::Refused { reason, .. } if reason.contains("keeps nothing")),
            "{err:?}"
        );
        table.admit(&plain.id, &push("d", 1), now).unwrap();

        let xattrs = session_flags::PRESERVE_XATTRS | session_flags::PRESERVE_SPARSE;
        let some = table
            .issue(rel("d"), xattrs, Identity::Secret, ttl, now)
            .unwrap();
        let mut more = push("d", 2);
        more.flags = xattrs | session_flags::PRESERVE_GROUP;
        assert!(table.admit(&some.id, &more, now).is_err());
        let mut less = push("d", 2);
        less.flags = session_flags::PRESERVE_SPARSE;
        table.admit(&some.id, &less, now).unwrap();
    }

    #[test]
    fn the_table_is_bounded_and_makes_room_from_expired_grants() {
        let table = GrantTable::default();
        let now = Instant::now();
        for _ in 0..MAX_GRANTS {
            table
                .issue(rel("d"), 0, Identity::Secret, Duration::from_secs(1), now)
                .unwrap();
        }
        assert!(matches!(
            table.issue(rel("d"), 0, Identity::Secret, Duration::from_secs(1), now),
            Err(Error::Limit(_))
        ));
        let later = now + Duration::from_secs(2);
        table
            .issue(
                rel("d"),
                0,
                Identity::Secret,
                Duration::from_secs(600),
                later,
            )
            .unwrap();
        assert_eq!(table.grants.lock().unwrap().len(), 1);
    }

    #[test]
    fn an_unknown_grant_has_no_secret() {
        let table = GrantTable::default();
        assert_eq!(table.secret(&[0; 16], Instant::now()), None);
    }
}
