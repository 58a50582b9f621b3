//! User names and uids as people use them, without the C library's name service switch
//! (NSS) inside gpuctl.
//!
//! The gpuctl that is installed is linked statically (`cargo build-gpuctl`,
//! docs/performance.md): a dynamically linked start costs about 0.4 ms more, on every
//! workload's path. A statically linked glibc cannot use NSS safely: asked for a user that
//! `/etc/passwd` lacks, it loads the system's NSS modules (`systemd`, `sss`, `ldap`) into a
//! static process, which crashed on Debian 12 (`passwd: files systemd`). So gpuctl reads
//! `/etc/passwd` itself, and asks `getent passwd`, a dynamically linked program of the
//! system's own, for anyone it does not find there: users from a directory (LDAP, SSSD,
//! systemd-homed) are found as `id` finds them, at the cost of one process start each,
//! only when a name is not local.

use std::process::{Command, Stdio};

/// Where local accounts are.
const PASSWD: &str = "/etc/passwd";

/// One account: its name and uid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
}

/// Which account is wanted.
#[derive(Debug, Clone, Copy)]
enum Key<'a> {
    Uid(u32),
    Name(&'a str),
}

impl Key<'_> {
    fn matches(self, account: &Account) -> bool {
        match self {
            Key::Uid(uid) => account.uid == uid,
            Key::Name(name) => account.name == name,
        }
    }
}

/// The local accounts (`/etc/passwd`, read once), and the system's `getent` for the rest.
#[derive(Debug)]
pub struct Accounts {
    local: String,
}

impl Accounts {
    /// Reads `/etc/passwd` (none if it cannot be read: then every lookup asks `getent`).
    pub fn read() -> Accounts {
        Accounts {
            local: std::fs::read_to_string(PASSWD).unwrap_or_default(),
        }
    }

    /// The name of `uid`, if the system knows one.
    pub fn name_of(&self, uid: u32) -> Option<String> {
        self.find(Key::Uid(uid)).map(|a| a.name)
    }

    /// The uid of user `name`, if the system knows it.
    pub fn uid_of(&self, name: &str) -> Option<u32> {
        self.find(Key::Name(name)).map(|a| a.uid)
    }

    fn find(&self, key: Key<'_>) -> Option<Account> {
        in_passwd(&self.local, key).or_else(|| from_getent(key))
    }
}

/// The first account of `text` (passwd(5) lines) that `key` names.
fn in_passwd(text: &str, key: Key<'_>) -> Option<Account> {
    text.lines().filter_map(account).find(|a| key.matches(a))
}

/// One passwd(5) line (`name:password:uid:gid:gecos:home:shell`) as an account; `None`
/// for comments, NIS `+`/`-` entries and malformed lines.
fn account(line: &str) -> Option<Account> {
    let mut fields = line.split(':');
    let name = fields.next()?;
    let uid = fields.nth(1)?.parse().ok()?;
    if name.is_empty() || name.starts_with(['#', '+', '-']) {
        return None;
    }
    Some(Account {
        name: name.to_owned(),
        uid,
    })
}

/// Asks `getent passwd` (the system's NSS, every source nsswitch.conf names).
fn from_getent(key: Key<'_>) -> Option<Account> {
    let arg = match key {
        Key::Uid(uid) => uid.to_string(),
        // getent reads an all-digit name as a uid: such a name is not looked up.
        Key::Name(name) if name.is_empty() || name.bytes().all(|b| b.is_ascii_digit()) => {
            return None;
        }
        Key::Name(name) => name.to_owned(),
    };
    let output = Command::new("getent")
        .args(["passwd", &arg])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    in_passwd(&String::from_utf8_lossy(&output.stdout), key)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD_TEXT: &str = "\
# a comment
root:x:0:0:root:/root:/bin/bash
alice:x:1000:1000:Alice,,,:/home/alice:/bin/bash
+nisuser::::::
broken line
bob:x:notanumber:1001::/home/bob:/bin/sh
carol:x:1002:1002::/home/carol:/bin/sh
";

    #[test]
    fn passwd_lines_are_read_by_uid_and_by_name() {
        let by_uid = |uid| in_passwd(PASSWD_TEXT, Key::Uid(uid)).map(|a| a.name);
        let by_name = |name| in_passwd(PASSWD_TEXT, Key::Name(name)).map(|a| a.uid);
        assert_eq!(by_uid(0).as_deref(), Some("root"));
        assert_eq!(by_uid(1002).as_deref(), Some("carol"));
        assert_eq!(by_name("alice"), Some(1000));
        // Malformed, NIS and comment lines are skipped, not misread.
        assert_eq!(by_name("bob"), None);
        assert_eq!(by_name("+nisuser"), None);
        assert_eq!(by_name("# a comment"), None);
        assert_eq!(by_uid(1001), None);
    }

    #[test]
    fn getent_finds_what_the_system_knows_and_nothing_else() {
        // root is in every passwd database; getent answers from the system's own NSS.
        let root = from_getent(Key::Uid(0)).expect("getent passwd 0");
        assert_eq!(root.name, "root");
        assert_eq!(from_getent(Key::Name(&root.name)).map(|a| a.uid), Some(0));
        assert_eq!(from_getent(Key::Name("no-such-user-gpuctl-test")), None);
        assert_eq!(from_getent(Key::Name("12345")), None);
        let accounts = Accounts::read();
        assert_eq!(accounts.uid_of("no-such-user-gpuctl-test"), None);
        assert_eq!(accounts.name_of(0).as_deref(), Some("root"));
    }
}
