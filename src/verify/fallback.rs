//! Which family runs when one failed its check: pure functions, unit-tested
//! with made-up verdicts. On wgpu: coop → registers → tiled, and lanes (the
//! CPU adapters' default) → tiled; on CUDA: Hopper → sm80 → scalar.

use super::verdict::Verdict;
use crate::error::Result;
use crate::plan::KernelFamily;

/// The wgpu families a call may end on, from the planner's choice: that
/// family, then each fallback in order.
pub fn wgpu_chain(first: KernelFamily) -> &'static [KernelFamily] {
    use KernelFamily::*;
    match first {
        Coop => &[Coop, Registers, Tiled],
        Registers => &[Registers, Tiled],
        Lanes => &[Lanes, Tiled],
        Tiled => &[Tiled],
    }
}

/// The CUDA kernel paths, fastest first.
#[cfg(any(test, feature = "cuda"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaFamily {
    /// The wgmma + TMA forward (compute capability 9.x).
    Hopper,
    /// The `mma.sync` tensor-core kernels (8.0+).
    Sm80,
    /// f32 FMAs on f32 tiles: every precision and head dim.
    Scalar,
}

#[cfg(any(test, feature = "cuda"))]
impl CudaFamily {
    /// The family's name in keys and messages.
    pub fn name(self) -> &'static str {
        match self {
            CudaFamily::Hopper => "hopper",
            CudaFamily::Sm80 => "sm80",
            CudaFamily::Scalar => "scalar",
        }
    }
}

/// The CUDA families a call may end on, from the plan's choice.
#[cfg(any(test, feature = "cuda"))]
pub fn cuda_chain(first: CudaFamily) -> &'static [CudaFamily] {
    use CudaFamily::*;
    match first {
        Hopper => &[Hopper, Sm80, Scalar],
        Sm80 => &[Sm80, Scalar],
        Scalar => &[Scalar],
    }
}

/// Where a walk down a chain ends.
#[derive(Clone, Debug, PartialEq)]
pub enum Route<F> {
    /// Run this family: the first whose verdict is not a failure (or the
    /// first, when forced).
    Run(F),
    /// Every family of the chain failed.
    Exhausted,
}

/// Where a walk ended and every verdict it asked for, in order.
pub type Walked<F> = (Route<F>, Vec<(F, Verdict)>);

/// Walk `chain` asking `verdict` (which may run a check) for each family in
/// turn until one has not failed; a forced chain stops at its first family.
pub async fn walk<F: Copy>(
    chain: &[F],
    forced: bool,
    mut verdict: impl AsyncFnMut(F) -> Result<Verdict>,
) -> Result<Walked<F>> {
    let mut tried = Vec::new();
    for &family in chain {
        let v = verdict(family).await?;
        let failed = v.is_failed();
        tried.push((family, v));
        if !failed || forced {
            return Ok((Route::Run(family), tried));
        }
    }
    Ok((Route::Exhausted, tried))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::verdict::Evidence;

    fn sync<F: Copy>(chain: &[F], forced: bool, mut v: impl FnMut(F) -> Verdict) -> Walked<F> {
        pollster::block_on(walk(chain, forced, async |f| Ok(v(f)))).unwrap()
    }

    fn failed() -> Verdict {
        Verdict::Failed(Evidence {
            detail: "o: max error 1 > bound 1e-3".into(),
            seconds: 0.0,
            cached: false,
        })
    }

    fn verified() -> Verdict {
        Verdict::Verified(Evidence {
            detail: "ok".into(),
            seconds: 0.0,
            cached: false,
        })
    }

    #[test]
    fn wgpu_falls_back_coop_registers_tiled_and_lanes_tiled() {
        use KernelFamily::*;
        assert_eq!(wgpu_chain(Coop), [Coop, Registers, Tiled]);
        assert_eq!(wgpu_chain(Lanes), [Lanes, Tiled]);
        let broken = [Coop, Registers];
        let pick = |first, forced| {
            sync(wgpu_chain(first), forced, |f| {
                if broken.contains(&f) {
                    failed()
                } else {
                    verified()
                }
            })
        };
        let (route, tried) = pick(Coop, false);
        assert_eq!(route, Route::Run(Tiled));
        assert_eq!(tried.len(), 3);
        assert_eq!(pick(Lanes, false).0, Route::Run(Lanes));
        // Forced: what the caller asked for runs, its verdict reported.
        let (route, tried) = pick(Registers, true);
        assert_eq!(route, Route::Run(Registers));
        assert!(tried[0].1.is_failed());
        // Not yet checked (or off) is not a failure: the family runs.
        let (route, _) = sync(wgpu_chain(Coop), false, |_| Verdict::NotYetChecked);
        assert_eq!(route, Route::Run(Coop));
    }

    #[test]
    fn cuda_falls_back_hopper_sm80_scalar_and_reports_a_dead_end() {
        use CudaFamily::*;
        let only_scalar = |f| if f == Scalar { verified() } else { failed() };
        let (route, tried) = sync(cuda_chain(Hopper), false, only_scalar);
        assert_eq!(route, Route::Run(Scalar));
        assert_eq!(
            tried.iter().map(|t| t.0).collect::<Vec<_>>(),
            [Hopper, Sm80, Scalar]
        );
        assert_eq!(
            sync(cuda_chain(Sm80), false, |_| verified()).0,
            Route::Run(Sm80)
        );
        let (route, tried) = sync(cuda_chain(Sm80), false, |_| failed());
        assert_eq!(route, Route::Exhausted);
        assert_eq!(tried.len(), 2);
        // A verdict is asked for only as far as the walk goes.
        let mut asked = Vec::new();
        sync(cuda_chain(Hopper), false, |f| {
            asked.push(f);
            verified()
        });
        assert_eq!(asked, [Hopper]);
    }
}
