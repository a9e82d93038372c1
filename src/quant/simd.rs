//! One dequantizer body, compiled for several instruction sets, chosen at run time.
//!
//! glmdiff is built for the baseline of its target (x86-64: SSE2), so that one binary runs on
//! every machine; the bodies of the dequantizers are plain Rust that LLVM auto-vectorizes, and
//! wider vectors (AVX2, AVX-512) make them several times faster. `multiversion!` compiles a
//! body three times on x86-64: as is, and inside functions carrying
//! `#[target_feature(enable = ...)]` for the x86-64-v3 (AVX2, FMA, F16C, BMI) and x86-64-v4
//! (AVX-512 F/BW/CD/DQ/VL) levels, and picks one per call from the features the CPU reports
//! ([`level`], detected once). The source is the same in all three, and every dequantizer's
//! arithmetic is exact or rounds once (see each module), so every build gives the same bits:
//! the unit test `every_level_gives_the_same_bits` checks it on random blocks of every type.
//! No FMA contraction happens: Rust never fuses a multiply and an add on its own (a body that
//! wants one asks with `mul_add` in its FMA builds only, as the CPU reference's matrix product
//! does where a fused multiply-add gives the same bits).
//!
//! Other architectures get the body alone.

use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction sets a body is compiled for, in increasing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The target's baseline (x86-64: SSE2).
    Base,
    /// x86-64-v3: AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT, MOVBE, POPCNT.
    Avx2,
    /// x86-64-v4: v3 plus AVX-512 F, BW, CD, DQ, VL.
    Avx512,
}

impl Level {
    /// Lower-case name (`base`, `avx2`, `avx512`).
    pub fn name(self) -> &'static str {
        match self {
            Level::Base => "base",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }
}

impl Level {
    /// The level named `s` (`base`, `avx2`, `avx512`).
    pub fn from_name(s: &str) -> Option<Level> {
        [Level::Base, Level::Avx2, Level::Avx512]
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(s.trim()))
    }
}

/// The environment variable that sets the default of the command line's `--cpu-simd` (read once
/// by the binary at its start, never here); a value that names no level is ignored.
pub const LEVEL_ENV: &str = "GLMDIFF_CPU_SIMD";

/// The level [`detected`] found (a [`Level`] as `u8`; `u8::MAX` until it is first asked).
static DETECTED: AtomicU8 = AtomicU8::new(u8::MAX);
/// The process-wide cap [`set_cap`] set (a [`Level`] as `u8`; none by default).
static PROCESS_CAP: AtomicU8 = AtomicU8::new(Level::Avx512 as u8);

/// Caps the level of every dequantizer and matrix product of this process at `cap` (`base`,
/// `avx2`, `avx512`), to compare the builds or to rule one out: the command's `--cpu-simd`,
/// set once at its start, before any work.
pub fn set_cap(cap: Level) {
    PROCESS_CAP.store(cap as u8, Ordering::Relaxed);
    // Detected again at the next use, under the new cap.
    DETECTED.store(u8::MAX, Ordering::Relaxed);
}

/// The level stored as `v` (see [`DETECTED`]), `None` for an unknown one.
fn from_u8(v: u8) -> Option<Level> {
    match v {
        0 => Some(Level::Base),
        1 => Some(Level::Avx2),
        2 => Some(Level::Avx512),
        _ => None,
    }
}

/// The widest level this CPU supports, at most [`set_cap`]'s, detected on first use.
pub fn detected() -> Level {
    match from_u8(DETECTED.load(Ordering::Relaxed)) {
        Some(l) => l,
        None => {
            let cap = from_u8(PROCESS_CAP.load(Ordering::Relaxed)).unwrap_or(Level::Avx512);
            let l = detect().min(cap);
            DETECTED.store(l as u8, Ordering::Relaxed);
            l
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    use std::arch::is_x86_feature_detected as has;
    let v3 = has!("avx")
        && has!("avx2")
        && has!("bmi1")
        && has!("bmi2")
        && has!("f16c")
        && has!("fma")
        && has!("lzcnt")
        && has!("movbe")
        && has!("popcnt");
    let v4 = v3
        && has!("avx512f")
        && has!("avx512bw")
        && has!("avx512cd")
        && has!("avx512dq")
        && has!("avx512vl");
    if v4 {
        Level::Avx512
    } else if v3 {
        Level::Avx2
    } else {
        Level::Base
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Base
}

#[cfg(test)]
thread_local! {
    /// Tests cap the level of their own thread to compare the builds.
    static CAP: std::cell::Cell<Level> = const { std::cell::Cell::new(Level::Avx512) };
}

/// The level a dequantizer runs at now: [`detected`] (in unit tests, at most the calling
/// thread's cap, see `with_cap`).
#[inline]
pub fn level() -> Level {
    let l = detected();
    #[cfg(test)]
    let l = l.min(CAP.with(|c| c.get()));
    l
}

/// Runs `f` with this thread's dequantizers at most at `cap`.
#[cfg(test)]
pub(crate) fn with_cap<R>(cap: Level, f: impl FnOnce() -> R) -> R {
    let old = CAP.with(|c| c.replace(cap));
    let r = f();
    CAP.with(|c| c.set(old));
    r
}

/// `multiversion!(#[doc] pub fn name(a: A, b: B) -> R = body;)`: defines `name`, which runs
/// `body` (an `#[inline(always)]` function of the same signature, whose helpers are
/// `#[inline(always)]` or small enough for LLVM to inline) compiled for the widest [`Level`]
/// the CPU has.
///
/// With `max avx2` after the `;` it stops at AVX2: for the bodies that look values up in small
/// tables, where LLVM's AVX-512 build gathers (slow on the CPUs measured) and runs slower than
/// the AVX2 one. With `base other` after the `;` the baseline build runs `other` instead of
/// `body` (the same values computed another way that suits narrow vectors better). With
/// `avx2 b3 base b1` after the `;` the AVX2 build runs `b3` and the baseline build `b1`, `body`
/// being the AVX-512 build's (e.g. the same kernel with a tile sized to each level's registers).
macro_rules! multiversion {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;
        avx2 $v3body:path, base $base:path
    ) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(
                    enable = "avx,avx2,bmi1,bmi2,f16c,fma,lzcnt,movbe,popcnt,avx512f,avx512bw,avx512cd,avx512dq,avx512vl"
                )]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx,avx2,bmi1,bmi2,f16c,fma,lzcnt,movbe,popcnt")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? {
                    $v3body($($arg),*)
                }
                match $crate::quant::simd::level() {
                    // SAFETY: `level()` is Avx512 only when the CPU reported every feature `v4`
                    // enables (`detect`), and `v4` is the safe body compiled with them.
                    $crate::quant::simd::Level::Avx512 => return unsafe { v4($($arg),*) },
                    // SAFETY: as above, for the features of `v3`.
                    $crate::quant::simd::Level::Avx2 => return unsafe { v3($($arg),*) },
                    $crate::quant::simd::Level::Base => {}
                }
            }
            $base($($arg),*)
        }
    };
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;
        base $base:path
    ) => {
        $crate::quant::simd::multiversion! {
            $(#[$attr])*
            $vis fn $name($($arg: $ty),*) $(-> $ret)? = $body;
            avx2 $body, base $base
        }
    };
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;
        max avx2
    ) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx,avx2,bmi1,bmi2,f16c,fma,lzcnt,movbe,popcnt")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if $crate::quant::simd::level() >= $crate::quant::simd::Level::Avx2 {
                    // SAFETY: `level()` is Avx2 or above only when the CPU reported every
                    // feature `v3` enables (`detect`), and `v3` is the safe body compiled with
                    // them.
                    return unsafe { v3($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;
    ) => {
        $crate::quant::simd::multiversion! {
            $(#[$attr])*
            $vis fn $name($($arg: $ty),*) $(-> $ret)? = $body;
            base $body
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, TYPE_TABLE};

    /// xorshift64*: raw bytes, so that scales take every f16 pattern (subnormal, Inf, NaN).
    fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
            })
            .collect()
    }

    /// Every build of every dequantizer gives the same bits as the baseline build on raw random
    /// blocks (NaNs compared by their bits too), at a length that is not a multiple of any
    /// vector width in blocks.
    #[test]
    fn every_level_gives_the_same_bits() {
        let levels: Vec<Level> = [Level::Base, Level::Avx2, Level::Avx512]
            .into_iter()
            .filter(|&l| l <= detected())
            .collect();
        for row in TYPE_TABLE.iter().filter(|r| r.dequant.is_some()) {
            let blocks = 4096 / row.block_size.max(1) + 3;
            let n = blocks * row.block_size;
            let src = random_bytes(row.ty.id().into(), blocks * row.type_size);
            let run = |l: Level| {
                let mut y = vec![0f32; n];
                with_cap(l, || dequantize(row.ty, &src, &mut y)).unwrap();
                y
            };
            let base = run(Level::Base);
            for &l in &levels[1..] {
                let y = run(l);
                let first = y
                    .iter()
                    .zip(&base)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(
                    first,
                    None,
                    "{} at {} differs from base",
                    row.name,
                    l.name()
                );
            }
        }
    }

    #[test]
    fn level_names_round_trip() {
        for l in [Level::Base, Level::Avx2, Level::Avx512] {
            assert_eq!(Level::from_name(l.name()), Some(l));
        }
        assert_eq!(Level::from_name("AVX2 "), Some(Level::Avx2));
        assert_eq!(Level::from_name("sse"), None);
    }
}
