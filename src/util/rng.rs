//! SplitMix64 (Steele, Lea, Flood 2014; constants from Vigna's public-domain `splitmix64.c`):
//! the one pseudo-random generator of glmdiff. Synthetic models, benchmark inputs and test
//! weights all draw from it, so every output is a pure function of the seed and the call count.

/// The generator's increment (2^64 / golden ratio, odd); also a good odd multiplier for
/// deriving well-spread seeds from a counter.
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (a bijective 64-bit mixer).
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A small, fast, well-mixed 64-bit generator.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator started at `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix64(self.0)
    }

    /// Uniform in [0, 1): the top 24 bits, exact in f32.
    #[inline]
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform integer in `lo..=hi` (multiply-shift of the top 32 bits, no division).
    #[inline]
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        let n = u64::from(hi - lo + 1);
        lo + (((self.next_u64() >> 32) * n) >> 32) as u32
    }

    /// Approximately standard normal: Irwin-Hall sum of four uniforms, centred and scaled to
    /// unit variance (each uniform has variance 1/12).
    #[inline]
    pub fn normal(&mut self) -> f32 {
        let s = self.uniform() + self.uniform() + self.uniform() + self.uniform();
        (s - 2.0) * 3f32.sqrt()
    }

    /// Fills `b` with random bytes: one draw per 8 bytes, little-endian, the last draw cut to
    /// the bytes left.
    pub fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let r = self.next_u64().to_le_bytes();
            c.copy_from_slice(&r[..c.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // First outputs for seed 0 of the reference C code (Vigna, splitmix64.c).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn rng_is_deterministic_and_ranges_hold() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let r = a.range(3, 9);
            assert!((3..=9).contains(&r));
            b.range(3, 9);
        }
    }
}
