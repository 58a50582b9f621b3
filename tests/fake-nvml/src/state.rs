//! The library's global state apart from event sets (see `events`): the init reference
//! count and the fixture currently loaded, re-read whenever the file behind
//! `FAKE_NVML_CONFIG` changes.
//! Depends on `fixture` (parsing) and `codes`; knows nothing about pointers.

use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::codes::{self, NvmlReturn};
use crate::fixture::Machine;

/// Environment variable naming the fixture file; read at every first init.
pub const CONFIG_ENV: &str = "FAKE_NVML_CONFIG";

/// What identifies one version of the fixture file. A rename over the old file changes
/// the inode; an in-place write changes size or mtime (nanoseconds) or ctime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(path: &Path) -> std::io::Result<Self> {
        let meta = std::fs::metadata(path)?;
        Ok(Self {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        })
    }
}

#[derive(Debug)]
struct Loaded {
    path: PathBuf,
    stamp: Stamp,
    machine: Arc<Machine>,
}

#[derive(Debug)]
struct State {
    refcount: u32,
    loaded: Option<Loaded>,
    /// The last file version that failed to reload, so its complaint is printed once.
    rejected: Option<Stamp>,
    /// Whether the fixture file's disappearance has been reported.
    missing_reported: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    refcount: 0,
    loaded: None,
    rejected: None,
    missing_reported: false,
});

fn lock() -> MutexGuard<'static, State> {
    // A panic while holding the lock is caught at the FFI boundary; the state it leaves
    // is still consistent (every update is a single assignment), so poisoning is ignored.
    STATE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn complain(message: &str) {
    // Never panic on a closed stderr.
    let _ = writeln!(std::io::stderr(), "fake-nvml: {message}");
}

/// Why a fixture could not be loaded, and the code `nvmlInit` returns for it.
fn load(path: &Path) -> Result<Loaded, (NvmlReturn, String)> {
    let unreadable = |e: std::io::Error| {
        (
            codes::UNKNOWN,
            format!("cannot read fixture {}: {e}", path.display()),
        )
    };
    let stamp = Stamp::of(path).map_err(unreadable)?;
    let text = std::fs::read_to_string(path).map_err(unreadable)?;
    let machine = Machine::from_json(&text).map_err(|e| {
        (
            codes::UNKNOWN,
            format!("invalid fixture {}: {e}", path.display()),
        )
    })?;
    Ok(Loaded {
        path: path.to_owned(),
        stamp,
        machine: Arc::new(machine),
    })
}

impl State {
    /// Re-reads the fixture if its file changed; a broken or missing new version keeps the
    /// last good one and is reported once.
    fn refresh(&mut self) {
        let Some(loaded) = &self.loaded else { return };
        let stamp = match Stamp::of(&loaded.path) {
            Ok(stamp) => stamp,
            Err(e) => {
                if !self.missing_reported {
                    complain(&format!(
                        "fixture {} vanished ({e}); keeping the last good one",
                        loaded.path.display()
                    ));
                    self.missing_reported = true;
                }
                return;
            }
        };
        self.missing_reported = false;
        if stamp == loaded.stamp || Some(stamp) == self.rejected {
            return;
        }
        match load(&loaded.path) {
            Ok(new) => {
                self.loaded = Some(new);
                self.rejected = None;
            }
            Err((_, message)) => {
                complain(&format!("{message}; keeping the last good one"));
                self.rejected = Some(stamp);
            }
        }
    }
}

/// `nvmlInit*`: the first init reads `FAKE_NVML_CONFIG` and loads the fixture; later ones
/// only count. A fixture's `init_error` fails every init.
pub fn init() -> NvmlReturn {
    let mut state = lock();
    if state.refcount == 0 {
        let Some(path) = std::env::var_os(CONFIG_ENV) else {
            complain(&format!(
                "{CONFIG_ENV} is not set; it must name a fixture JSON file"
            ));
            return codes::UNKNOWN;
        };
        match load(Path::new(&path)) {
            Ok(loaded) => {
                state.loaded = Some(loaded);
                state.rejected = None;
            }
            Err((code, message)) => {
                complain(&message);
                state.loaded = None;
                return code;
            }
        }
    } else {
        state.refresh();
    }
    if let Some(code) = state.loaded.as_ref().and_then(|l| l.machine.init_error) {
        return code;
    }
    state.refcount = state.refcount.saturating_add(1);
    codes::SUCCESS
}

/// `nvmlShutdown`: undoes one init.
pub fn shutdown() -> NvmlReturn {
    let mut state = lock();
    if state.refcount == 0 {
        return codes::UNINITIALIZED;
    }
    state.refcount -= 1;
    codes::SUCCESS
}

/// The current machine for a call, or UNINITIALIZED.
pub fn machine() -> Result<Arc<Machine>, NvmlReturn> {
    let mut state = lock();
    if state.refcount == 0 {
        return Err(codes::UNINITIALIZED);
    }
    state.refresh();
    state
        .loaded
        .as_ref()
        .map(|l| Arc::clone(&l.machine))
        .ok_or(codes::UNINITIALIZED)
}
