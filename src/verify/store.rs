//! One device's verdicts: in memory for the process (or the page), read
//! from and written to the disk cache where there is one, with a once-guard
//! per family so that parallel calls run one check and wait for its verdict.

use super::key::DeviceKey;
use super::verdict::{Checked, FamilyKey, Verdict};
use super::VerifyMode;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// A family's state in memory.
#[derive(Clone, Debug)]
enum Slot {
    /// A call is running its check on this thread.
    Running(Holder),
    Done(Verdict),
}

/// The thread a check runs on (native), so that a call on that same thread
/// (another future of one executor) goes on instead of waiting for itself.
#[cfg(not(target_arch = "wasm32"))]
type Holder = std::thread::ThreadId;
#[cfg(target_arch = "wasm32")]
type Holder = ();

fn holder() -> Holder {
    #[cfg(not(target_arch = "wasm32"))]
    return std::thread::current().id();
}

/// The verdicts of one device, and how checks are run and kept.
#[derive(Debug)]
pub struct VerdictStore {
    mode: VerifyMode,
    // The disk cache's key (the web has no disk cache; its `Debug` shows it).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    device: DeviceKey,
    #[cfg(not(target_arch = "wasm32"))]
    disk: Option<super::VerdictCache>,
    slots: Mutex<HashMap<FamilyKey, Slot>>,
    /// Wakes calls waiting for a check another thread runs.
    #[cfg(not(target_arch = "wasm32"))]
    ready: std::sync::Condvar,
    checks: AtomicU32,
    check_seconds: Mutex<f64>,
}

/// What a call learns about its family.
pub(crate) enum Lookup<'a> {
    /// The verdict (from this process, the disk, or `Off`).
    Known(Verdict),
    /// No verdict yet: this call runs the check and hands in the verdict.
    Run(Claim<'a>),
    /// Another call is running the check and this one cannot wait for it:
    /// on the same thread (in the browser everything is), it would wait
    /// for itself.
    Busy,
}

/// The right (and duty) to run one family's check. Dropped unfinished (the
/// check's future cancelled, or a panic), it frees the family for the next
/// call.
pub(crate) struct Claim<'a> {
    store: &'a VerdictStore,
    family: FamilyKey,
    open: bool,
}

impl VerdictStore {
    /// The store of `device` under `mode`, without a disk cache.
    pub fn new(mode: VerifyMode, device: DeviceKey) -> Self {
        Self {
            mode,
            device,
            #[cfg(not(target_arch = "wasm32"))]
            disk: None,
            slots: Mutex::new(HashMap::new()),
            #[cfg(not(target_arch = "wasm32"))]
            ready: std::sync::Condvar::new(),
            checks: AtomicU32::new(0),
            check_seconds: Mutex::new(0.0),
        }
    }

    /// The same store reading and writing `cache` (`None`: memory only).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn with_disk(self, cache: Option<super::VerdictCache>) -> Self {
        Self {
            disk: cache,
            ..self
        }
    }

    /// The same device's store under another mode (verdicts known so far
    /// are kept).
    pub fn with_mode(mut self, mode: VerifyMode) -> Self {
        self.mode = mode;
        self
    }

    /// When checks run.
    pub fn mode(&self) -> VerifyMode {
        self.mode
    }

    /// The disk cache verdicts are kept in, if any.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn disk(&self) -> Option<&super::VerdictCache> {
        self.disk.as_ref()
    }

    /// Checks this store ran (not read from the disk cache).
    pub fn checks_run(&self) -> u32 {
        self.checks.load(Ordering::Relaxed)
    }

    /// Seconds those checks took in all.
    pub fn check_seconds(&self) -> f64 {
        self.check_seconds.lock().map_or(0.0, |s| *s)
    }

    /// Every verdict known in this process, by family.
    pub fn known(&self) -> Vec<Checked> {
        let Ok(slots) = self.slots.lock() else {
            return Vec::new();
        };
        let mut known: Vec<Checked> = slots
            .iter()
            .filter_map(|(family, slot)| match slot {
                Slot::Done(verdict) => Some(Checked {
                    family: family.clone(),
                    verdict: verdict.clone(),
                }),
                Slot::Running(_) => None,
            })
            .collect();
        known.sort_by_key(|c| c.family.cache_text());
        known
    }

    /// The verdict `family` has without running anything: this process's,
    /// else the disk's, else [`Verdict::NotYetChecked`] (`Off` when off).
    #[cfg(test)]
    pub fn peek(&self, family: &FamilyKey) -> Verdict {
        if self.mode == VerifyMode::Off {
            return Verdict::Off;
        }
        let memory = self.slots.lock().ok().and_then(|s| match s.get(family) {
            Some(Slot::Done(v)) => Some(v.clone()),
            _ => None,
        });
        memory
            .or_else(|| self.on_disk(family))
            .unwrap_or(Verdict::NotYetChecked)
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn on_disk(&self, family: &FamilyKey) -> Option<Verdict> {
        self.disk.as_ref()?.get(&self.device, family)
    }

    #[cfg(target_arch = "wasm32")]
    fn on_disk(&self, _: &FamilyKey) -> Option<Verdict> {
        None
    }

    fn poisoned() -> Error {
        Error::Poisoned {
            what: "the verdict store",
        }
    }

    /// What a call of `family` does about its check: use the verdict known,
    /// run the check, or (in the browser, while another call runs it) go on
    /// unchecked. On native targets a call whose family another thread is
    /// checking waits for that verdict.
    pub(crate) fn lookup(&self, family: &FamilyKey) -> Result<Lookup<'_>> {
        let claim = || Claim {
            store: self,
            family: family.clone(),
            open: true,
        };
        match self.mode {
            VerifyMode::Off => return Ok(Lookup::Known(Verdict::Off)),
            VerifyMode::Always => return Ok(Lookup::Run(claim())),
            VerifyMode::FirstUse => {}
        }
        let mut slots = self.slots.lock().map_err(|_| Self::poisoned())?;
        loop {
            match slots.get(family) {
                Some(Slot::Done(v)) => return Ok(Lookup::Known(v.clone())),
                Some(Slot::Running(h)) if *h == holder() => return Ok(Lookup::Busy),
                Some(Slot::Running(_)) => {
                    #[cfg(not(target_arch = "wasm32"))]
                    {
                        slots = self.ready.wait(slots).map_err(|_| Self::poisoned())?;
                    }
                }
                None => break,
            }
        }
        if let Some(v) = self.on_disk(family) {
            slots.insert(family.clone(), Slot::Done(v.clone()));
            return Ok(Lookup::Known(v));
        }
        slots.insert(family.clone(), Slot::Running(holder()));
        Ok(Lookup::Run(claim()))
    }

    /// Keep `verdict` for `family`: in memory, and on disk when `persist`
    /// (a verdict of the accuracy rule, not of an error that may pass).
    fn settle(&self, family: &FamilyKey, verdict: &Verdict, persist: bool) {
        if let Ok(mut slots) = self.slots.lock() {
            slots.insert(family.clone(), Slot::Done(verdict.clone()));
        }
        #[cfg(not(target_arch = "wasm32"))]
        {
            if let (true, Some(disk)) = (persist, &self.disk) {
                // An unwritable cache only means checking again next time.
                let _ = disk.put(&self.device, family, verdict);
            }
            self.ready.notify_all();
        }
        #[cfg(target_arch = "wasm32")]
        let _ = persist;
    }

    /// Forget `family`'s running check (it did not finish).
    fn abandon(&self, family: &FamilyKey) {
        if let Ok(mut slots) = self.slots.lock() {
            if matches!(slots.get(family), Some(Slot::Running(_))) {
                slots.remove(family);
            }
        }
        #[cfg(not(target_arch = "wasm32"))]
        self.ready.notify_all();
    }
}

impl Claim<'_> {
    /// Hand in the check's verdict (`persist`: keep it on disk too) after
    /// `seconds`; returns it.
    pub fn finish(mut self, verdict: Verdict, persist: bool, seconds: f64) -> Verdict {
        self.open = false;
        let store = self.store;
        store.checks.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut total) = store.check_seconds.lock() {
            *total += seconds;
        }
        store.settle(&self.family, &verdict, persist);
        verdict
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.open {
            self.store.abandon(&self.family);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tensor::Precision;
    use crate::verify::verdict::{CallKind, Evidence};

    fn device() -> DeviceKey {
        DeviceKey {
            api: "Vulkan".into(),
            adapter: "made-up".into(),
            vendor: 1,
            device: 2,
            driver: "d".into(),
            driver_info: "1.0".into(),
        }
    }

    fn family(name: &'static str) -> FamilyKey {
        FamilyKey {
            call: CallKind::Forward,
            family: name,
            precision: Precision::F32,
            flags: Vec::new(),
        }
    }

    fn pass() -> Verdict {
        Verdict::Verified(Evidence {
            detail: "o ok".into(),
            seconds: 0.1,
            cached: false,
        })
    }

    #[test]
    fn a_family_is_checked_once_and_an_abandoned_check_is_run_again() {
        let store = VerdictStore::new(VerifyMode::FirstUse, device());
        let tiled = family("tiled");
        let Lookup::Run(claim) = store.lookup(&tiled).unwrap() else {
            panic!("the first call runs the check");
        };
        // Another future on this thread goes on unchecked, not waiting for itself.
        assert!(matches!(store.lookup(&tiled).unwrap(), Lookup::Busy));
        drop(claim);
        let Lookup::Run(claim) = store.lookup(&tiled).unwrap() else {
            panic!("an abandoned check is run by the next call");
        };
        claim.finish(pass(), false, 0.1);
        assert!(matches!(store.lookup(&tiled).unwrap(), Lookup::Known(v) if v.is_verified()));
        assert_eq!(store.checks_run(), 1);
        assert_eq!(store.peek(&family("lanes")), Verdict::NotYetChecked);
        assert_eq!(store.known().len(), 1);
    }

    #[test]
    fn threads_wait_for_the_one_check_of_their_family() {
        let store = VerdictStore::new(VerifyMode::FirstUse, device());
        let tiled = family("tiled");
        let ran = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| match store.lookup(&tiled).unwrap() {
                    Lookup::Run(claim) => {
                        ran.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        claim.finish(pass(), false, 0.05);
                    }
                    Lookup::Known(v) => assert!(v.is_verified()),
                    Lookup::Busy => panic!("native calls wait"),
                });
            }
        });
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert_eq!(store.checks_run(), 1);
    }

    #[test]
    fn off_never_checks_and_always_checks_every_call() {
        let off = VerdictStore::new(VerifyMode::Off, device());
        assert!(matches!(
            off.lookup(&family("tiled")).unwrap(),
            Lookup::Known(Verdict::Off)
        ));
        let always = VerdictStore::new(VerifyMode::Always, device());
        for _ in 0..2 {
            let Lookup::Run(claim) = always.lookup(&family("tiled")).unwrap() else {
                panic!("always runs the check");
            };
            claim.finish(pass(), false, 0.0);
        }
        assert_eq!(always.checks_run(), 2);
    }

    #[test]
    fn the_disk_keeps_verdicts_per_version() {
        let dir = tempfile::tempdir().unwrap();
        let cache = crate::verify::VerdictCache::in_dir(dir.path()).with_version("1.0.0");
        let first =
            VerdictStore::new(VerifyMode::FirstUse, device()).with_disk(Some(cache.clone()));
        let tiled = family("tiled");
        let Lookup::Run(claim) = first.lookup(&tiled).unwrap() else {
            panic!("nothing cached yet");
        };
        claim.finish(pass(), true, 0.1);
        // A new store (a new process) reads it back without a check.
        let second =
            VerdictStore::new(VerifyMode::FirstUse, device()).with_disk(Some(cache.clone()));
        match second.lookup(&tiled).unwrap() {
            Lookup::Known(Verdict::Verified(e)) => {
                assert!(e.cached && e.detail == "o ok" && e.seconds == 0.1, "{e:?}")
            }
            _ => panic!("the verdict was not read back"),
        }
        assert_eq!(second.checks_run(), 0);
        // Another version, or another device, checks again.
        let newer = VerdictStore::new(VerifyMode::FirstUse, device())
            .with_disk(Some(cache.clone().with_version("1.0.1")));
        assert!(matches!(newer.lookup(&tiled).unwrap(), Lookup::Run(_)));
        let other = DeviceKey {
            driver_info: "1.1".into(),
            ..device()
        };
        let other = VerdictStore::new(VerifyMode::FirstUse, other).with_disk(Some(cache));
        assert!(matches!(other.lookup(&tiled).unwrap(), Lookup::Run(_)));
    }
}
